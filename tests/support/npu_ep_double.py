"""A test double of ``torch_npu.npu_moe_distribute_dispatch`` / ``npu_moe_distribute_combine`` over
``torch.distributed`` -- NOT torch_npu.

Written from the op-plugin documentation summarised in ``docs/npu.md``: every
(token, expert) copy goes to the rank owning the expert; ``expand_x`` comes grouped by local expert
(then source rank, then token) with ``expert_token_nums`` counts (type 1) or prefix sums (type 0);
``expand_idx`` / ``ep_recv_counts`` are opaque state for combine; combine returns
``x[t] = sum_k expert_scales[t, k] * y_k`` in the tokens' dtype. It enforces the documented input
rules (int32 ids, **no -1**, no duplicate expert in a row, fp32 scales, bf16/fp16 tokens, the group
name and sizes), not the per-SoC EP-size/hidden limits (the adapter checks those at compile time).
The group is looked up by ``torch.distributed`` group name instead of an HCCL communicator name.
Rows of ``expand_x`` past the received count are NaN (uninitialised), as is ``dynamic_scales`` (unquantised).
:func:`make_module` registers both functions as the CPU kernels of ``npu::<op>`` under torch_npu's real
schemas (``npu_conformance.py``), so every call is bound to the schema first.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist
from support.dist_exchange import exchange
from support.npu_conformance import bound

DEVICE_NAME = "Ascend910B3"
calls: list[str] = []


def _group(name: str) -> Any:
    return dist.distributed_c10d._resolve_process_group(name)


def _check_ids(expert_ids: torch.Tensor, moe_expert_num: int) -> None:
    if expert_ids.dtype != torch.int32 or expert_ids.dim() != 2:
        raise RuntimeError("npu_moe_distribute_dispatch: expert_ids must be int32 [BS, K]")
    if bool((expert_ids < 0).any()) or bool((expert_ids >= moe_expert_num).any()):
        raise RuntimeError("npu_moe_distribute_dispatch: expert ids must lie in [0, moe_expert_num) (no -1)")
    s = expert_ids.sort(1).values
    if bool((s[:, 1:] == s[:, :-1]).any()):
        raise RuntimeError("npu_moe_distribute_dispatch: duplicate expert ids in a row")


def npu_moe_distribute_dispatch(x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *, scales=None,
                                x_active_mask=None, expert_scales=None, group_tp="", tp_world_size=0, tp_rank_id=0,
                                expert_shard_type=0, shared_expert_num=1, shared_expert_rank_num=0, quant_mode=0,
                                global_bs=0, expert_token_nums_type=1):
    group = _group(group_ep)
    if x.dtype not in (torch.bfloat16, torch.float16) or x.dim() != 2:
        raise RuntimeError("npu_moe_distribute_dispatch: x must be bf16/fp16 [BS, H]")
    if ep_world_size != group.size() or ep_rank_id != group.rank():
        raise RuntimeError("npu_moe_distribute_dispatch: ep_world_size/ep_rank_id do not match group_ep")
    if moe_expert_num % ep_world_size or quant_mode != 0 or shared_expert_rank_num != 0 or tp_world_size not in (0, 1):
        raise RuntimeError("npu_moe_distribute_dispatch (double): only quant_mode=0, no shared-expert ranks, no TP")
    _check_ids(expert_ids, moe_expert_num)
    calls.append("dispatch")
    bs, k = expert_ids.shape
    w, me = ep_world_size, ep_rank_id
    per_rank = moe_expert_num // w
    if global_bs and bs * w > global_bs:
        raise RuntimeError("npu_moe_distribute_dispatch: BS x EP exceeds global_bs")
    max_bs = global_bs // w if global_bs else bs
    flat = expert_ids.long().reshape(-1)
    tok = torch.arange(bs * k) // k
    per_dest = []
    for r in range(w):
        sel = (flat // per_rank == r).nonzero().flatten()
        sel = sel[torch.argsort(flat[sel] * bs + tok[sel], stable=True)]  # (local expert, token) order
        per_dest.append([x[tok[sel]], flat[sel], tok[sel]])
    got = exchange(group, per_dest)
    a = max_bs * w * min(per_rank, k)
    expand_x = torch.full((a, x.shape[1]), float("nan"), dtype=x.dtype)
    token_nums = torch.zeros(per_rank, dtype=torch.int64)
    ep_recv_counts = torch.zeros(per_rank * w, dtype=torch.int32)  # [(expert, source)] counts
    pos = 0
    for e in range(per_rank):
        for s in range(w):
            rows, exp, _t = got[s]
            sel = (exp == me * per_rank + e).nonzero().flatten()
            expand_x[pos:pos + sel.numel()] = rows[sel]
            ep_recv_counts[e * w + s] = sel.numel()
            pos += sel.numel()
            token_nums[e] += sel.numel()
    if expert_token_nums_type == 0:
        token_nums = token_nums.cumsum(0)
    # sender-side: flat slot index of each copy in send order (dest, expert, token)
    order = torch.cat([(flat // per_rank == r).nonzero().flatten()[
        torch.argsort(flat[(flat // per_rank == r)] * bs + tok[(flat // per_rank == r)], stable=True)] for r in range(w)])
    expand_idx = order.int()
    dynamic_scales = torch.full((a,), float("nan"))  # [A] fp32 (meta); meaningless without quantisation
    return (expand_x, dynamic_scales, expand_idx, token_nums, ep_recv_counts,
            torch.zeros(tp_world_size, dtype=torch.int32), torch.empty(0))


def npu_moe_distribute_combine(expand_x, expert_ids, expand_idx, ep_send_counts, expert_scales, group_ep,
                               ep_world_size, ep_rank_id, moe_expert_num, *, tp_send_counts=None,
                               x_active_mask=None, activation_scale=None, weight_scale=None, group_list=None,
                               expand_scales=None, shared_expert_x=None, group_tp="", tp_world_size=0, tp_rank_id=0,
                               expert_shard_type=0, shared_expert_num=1, shared_expert_rank_num=0, global_bs=0,
                               out_dtype=0, comm_quant_mode=0, group_list_type=0):
    group = _group(group_ep)
    _check_ids(expert_ids, moe_expert_num)
    bs, k = expert_ids.shape
    if expert_scales.dtype != torch.float32 or tuple(expert_scales.shape) != (bs, k):
        raise RuntimeError("npu_moe_distribute_combine: expert_scales must be fp32 [BS, K]")
    calls.append("combine")
    w = ep_world_size
    per_rank = moe_expert_num // w
    h = expand_x.shape[1]
    # regroup [(expert, source)] blocks into per-source blocks ordered (expert, token) as they were sent
    starts = torch.cumsum(ep_send_counts.long(), 0) - ep_send_counts.long()
    per_dest = []
    for s in range(w):
        parts = [expand_x[int(starts[e * w + s]):int(starts[e * w + s]) + int(ep_send_counts[e * w + s])]
                 for e in range(per_rank)]
        per_dest.append([torch.cat(parts) if parts else expand_x.new_empty(0, h)])
    got = exchange(group, per_dest)
    rows = torch.cat([g[0] for g in got])  # in the sender's send order
    slots = expand_idx.long()
    acc = torch.zeros(bs * k, h, dtype=torch.float32)
    acc[slots] = rows.float()
    out = (acc.view(bs, k, h) * expert_scales.unsqueeze(-1)).sum(1)
    if shared_expert_x is not None:
        out = out + shared_expert_x.float()
    return out.to(expand_x.dtype)


def kernels() -> dict[str, Any]:
    return {"npu_moe_distribute_dispatch": npu_moe_distribute_dispatch,
            "npu_moe_distribute_combine": npu_moe_distribute_combine}


def make_module() -> types.ModuleType:
    """A ``torch_npu`` module object with the distribute ops (``torch.ops.npu.*`` under the real schemas, the
    doubles as CPU kernels) and ``npu.get_device_name``."""
    mod = types.ModuleType("torch_npu")
    for name, op in bound(kernels()).items():
        setattr(mod, name, op)
    mod.npu = types.SimpleNamespace(get_device_name=lambda *a: DEVICE_NAME)
    mod.__ep_fuse_test_double__ = True
    return mod

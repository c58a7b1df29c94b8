"""Ascend EP engine: ``torch_npu.npu_moe_distribute_dispatch`` / ``npu_moe_distribute_combine``
(``docs/npu.md``), ``expert`` layout. **Not run on Ascend hardware**: tested on CPU
against ``tests/support/npu_ep_double.py``, a double of the documented contract, bound to torch_npu 2.14.0's schemas
and run through its meta functions (``docs/npu.md``).

* dispatch sends every (token, expert) copy; ``expand_x`` ``[A, H]`` comes grouped by local expert with
  ``expert_token_nums`` counts (``expert_token_nums_type=1``), copied into the canonical expert-major
  blocks ``[E_r, W * C]``; ``expand_idx`` / ``ep_recv_counts`` stay opaque (kept for combine).
* combine is weighted on the source rank (``expert_scales`` fp32 ``[BS, K]``): the local experts run
  with unit weights.
* Limits (documented; checked at compile time by :func:`supports`, else the EP pass uses all_to_all):
  ids int32 with **no -1** and no duplicate expert in a row; A2: EP in {16, 32, 64}, BS <= 256,
  K <= 16, H <= 7168 and H % 32 == 0, <= 24 experts per rank; A3: EP in {8, 16, 32, 64, 128, 144, 256,
  288}, BS <= 512, K <= 8, H == 7168; BF16/FP16 tokens. -1 slots are handled here without a host sync:
  each is replaced by an expert absent from its row and given weight 0 in combine.
* The EP group is passed by its HCCL communicator name
  (``group._get_backend(npu).get_hccl_comm_name(rank)``); on a group without an HCCL backend (the CPU
  double) by ``group.group_name``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from ep_fuse import runtime
from ep_fuse.ep import groups, handles
from ep_fuse.ops.ep_layout import CODES, capacity_rows, handle_len, valid_slots
from ep_fuse.ops.ep import register_engine

log = logging.getLogger("ep_fuse.ep")


@dataclasses.dataclass(frozen=True)
class SocLimits:
    name: str
    ep_sizes: tuple[int, ...]
    max_bs: int
    max_k: int
    max_hidden: int
    hidden_multiple: int
    exact_hidden: int | None = None
    max_local_experts: int | None = None


LIMITS = {
    "A2": SocLimits("A2", (16, 32, 64), 256, 16, 7168, 32, None, 24),
    "A3": SocLimits("A3", (8, 16, 32, 64, 128, 144, 256, 288), 512, 8, 7168, 1, 7168, None),
}
"""Documented limits of ``npu_moe_distribute_dispatch/combine`` per SoC (§8.11)."""


available = runtime.npu_available
_torch_npu = runtime.torch_npu
CONTRACTS = runtime.npu_contracts("npu_moe_distribute_dispatch", "npu_moe_distribute_combine")


def soc() -> str | None:
    """``A2`` (Atlas A2, 910B) or ``A3`` (Atlas A3, 910_93); ``None`` for other chips."""
    try:
        name = str(_torch_npu().npu.get_device_name())
    except Exception:
        return None
    if "910B" in name:
        return "A2"
    if "910_93" in name:
        return "A3"
    return None


def supports(x: Any, topk_ids: Any, num_experts: int, world: int, capacity: int) -> str | None:
    """Why the Ascend distribute ops cannot run this block (``None``: they can)."""
    chip = soc()
    if chip is None:
        return "npu_moe_distribute_dispatch is documented for Atlas A2/A3 only"
    lim = LIMITS[chip]
    t, k = topk_ids.shape
    h = x.shape[1]
    bs = capacity_rows("expert", t, capacity)
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"x must be bf16/fp16, got {x.dtype}"
    if world not in lim.ep_sizes:
        return f"{chip}: EP size {world} not in {lim.ep_sizes}"
    if bs > lim.max_bs or t == 0:
        return f"{chip}: batch {bs} outside 1..{lim.max_bs}"
    if k > lim.max_k:
        return f"{chip}: top-{k} > {lim.max_k}"
    if lim.exact_hidden is not None and h != lim.exact_hidden:
        return f"{chip}: hidden {h} != {lim.exact_hidden}"
    if h > lim.max_hidden or h % lim.hidden_multiple:
        return f"{chip}: hidden {h} must be <= {lim.max_hidden} and a multiple of {lim.hidden_multiple}"
    if lim.max_local_experts is not None and num_experts // world > lim.max_local_experts:
        return f"{chip}: {num_experts // world} experts per rank > {lim.max_local_experts}"
    return None


def hccl_comm_name(group: Any) -> str:
    try:
        backend = group._get_backend(torch.device("npu"))
        return backend.get_hccl_comm_name(group.rank())
    except Exception:
        return group.group_name


def fill_invalid(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids int32 without -1, valid [T, K])``: each invalid slot takes an expert absent from its row
    (ascending), so rows keep distinct experts; the caller zeroes those slots' weights."""
    ids = topk_ids.long()
    valid = valid_slots(ids, num_experts)
    present = torch.zeros(ids.shape[0], num_experts + 1, dtype=torch.bool, device=ids.device)
    present.scatter_(1, torch.where(valid, ids, num_experts), True)
    absent_first = torch.argsort(present[:, :num_experts].to(torch.int8), dim=1, stable=True)
    nth = (torch.cumsum((~valid).long(), 1) - 1).clamp(min=0)
    filler = absent_first.gather(1, nth)
    return torch.where(valid, ids, filler).to(torch.int32), valid


def dispatch(x, topk_ids, topk_weights, num_experts, group_name, layout, capacity, timeout_s):
    npu = _torch_npu()
    group = groups.resolve_group(group_name)
    world, me = group.size(), group.rank()
    t, k = topk_ids.shape
    h = x.shape[1]
    c = capacity_rows("expert", t, capacity)
    per_rank = num_experts // world
    ids, valid = fill_invalid(topk_ids, num_experts)
    global_bs = world * c if capacity > 0 else 0
    comm = hccl_comm_name(group)
    expand_x, _scales, expand_idx, token_nums, ep_recv_counts, tp_recv_counts, _ = npu.npu_moe_distribute_dispatch(
        x, ids, comm, world, me, num_experts, global_bs=global_bs, expert_token_nums_type=1)
    a = expand_x.shape[0]
    counts = token_nums.long()
    start = torch.cumsum(counts, 0) - counts
    pos = torch.arange(world * c, device=x.device)
    live = pos.unsqueeze(0) < counts.unsqueeze(1)  # [E_r, W*C]
    src = (start.unsqueeze(1) + pos.unsqueeze(0)).clamp(max=max(a - 1, 0))
    rows = per_rank * world * c
    recv_x = torch.where(live.unsqueeze(-1), expand_x[src], torch.zeros((), dtype=x.dtype, device=x.device))
    recv_ids = torch.where(live, torch.arange(per_rank, device=x.device).unsqueeze(1), -1).reshape(rows, 1)
    handle = torch.full((handle_len("expert", world, num_experts, t, k, capacity),), -1, dtype=torch.int64,
                        device=x.device)
    handle[0], handle[2] = CODES["npu"], rows
    handles.put(handle, dict(ids=ids, valid=valid, expand_idx=expand_idx, ep_recv_counts=ep_recv_counts,
                             tp_recv_counts=tp_recv_counts, live=live, src=src, rows=a, comm=comm,
                             global_bs=global_bs))
    return recv_x.reshape(rows, h), recv_ids, live.reshape(rows, 1).to(topk_weights.dtype), handle


def combine(y, handle, topk_ids, topk_weights, num_experts, group_name, layout, capacity, timeout_s, out_dtype):
    npu = _torch_npu()
    group = groups.resolve_group(group_name)
    world, me = group.size(), group.rank()
    st = handles.pop(handle)
    live, src = st["live"], st["src"]
    rows, h = st["rows"], y.shape[1]
    # y's rows follow live [E_r, W*C]: live ones go back to their expand_x row, the rest to a spare row
    # (dropped) -- a scatter of static size, no host sync (a boolean mask index would need one)
    dest = torch.where(live, src, rows).reshape(-1)
    expand_y = y.new_zeros(rows + 1, h).index_copy_(0, dest, y.reshape(-1, h))[:rows]
    scales = torch.where(st["valid"], topk_weights.float(), torch.zeros((), device=y.device))
    out = npu.npu_moe_distribute_combine(expand_y, st["ids"], st["expand_idx"], st["ep_recv_counts"], scales,
                                         st["comm"], world, me, num_experts, global_bs=st["global_bs"])
    return out.to(out_dtype or torch.promote_types(y.dtype, topk_weights.dtype))


register_engine(
    "npu", dispatch, combine, layout="expert", available=lambda: available(),
    supports=lambda x, ids, dt, world, e, cap: supports(x, ids, e, world, cap), contracts=CONTRACTS)

"""The default EP provider, and the reference kernels of ``ep_dispatch`` / ``ep_combine``:
``torch.distributed.all_to_all_single`` on any backend (gloo on CPU, NCCL on GPU, HCCL on NPU).

Layouts and handle format: :mod:`ep_fuse.ep.layout`. Rank layout handle payload:
``[send_counts (W), recv_counts (W), send_token (R)]`` -- the source token of every row this rank
sent, in send order. Expert layout payload: ``[src_slot (T*K)]`` -- where each (token, slot)'s row
comes back in the combine buffer ``[W, E_r, C]`` (-1: invalid slot).

Data-dependent mode (``capacity == 0``, rank layout): per-peer counts are exchanged first and the
payload sent with exact splits (a host sync: not CUDA-graph capturable). Capacity mode: every peer
gets a fixed ``C`` rows (padding has id -1), equal splits, no host sync.
"""

from __future__ import annotations

import logging

import torch

from ep_fuse.ep import groups
from ep_fuse.ep.layout import (
    CODES,
    HEADER,
    capacity_rows,
    dispatch_layout,
    handle_len,
    local_slots,
    pack_meta,
    pair_positions,
    recv_rows,
    unpack_meta,
)

log = logging.getLogger("ep_fuse.ep")
CODE = CODES["all_to_all"]


def _check_tokens(tokens: int, capacity: int, layout: str) -> None:
    if capacity > 0 and tokens > capacity:
        raise groups.EpError(
            f"ep_fuse: {tokens} tokens on this rank exceed ep_capacity={capacity} ({layout} layout); "
            "raise ep_capacity to the largest per-rank batch, or leave it unset for data-dependent sizes"
        )


def dispatch(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    group_name: str,
    layout: str,
    capacity: int,
    timeout_s: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    group = groups.resolve_group(group_name)
    if layout == "rank":
        return _dispatch_rank(x, topk_ids, topk_weights, num_experts, group, capacity, timeout_s)
    return _dispatch_expert(x, topk_ids, topk_weights, num_experts, group, capacity, timeout_s)


def combine(
    y: torch.Tensor,
    handle: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    group_name: str,
    layout: str,
    capacity: int,
    timeout_s: float,
    out_dtype: torch.dtype | None,
) -> torch.Tensor:
    group = groups.resolve_group(group_name)
    if handle.device.type == "cpu" and int(handle[0]) != CODE:
        raise groups.EpError(f"ep_fuse: all_to_all combine got a handle of provider code {int(handle[0])}")
    if layout == "rank":
        return _combine_rank(y, handle, topk_ids.shape[0], group, capacity, timeout_s, out_dtype)
    return _combine_expert(y, handle, topk_ids, topk_weights, num_experts, group, capacity, timeout_s, out_dtype)


# --------------------------------------------------------------------------- rank layout
def _dispatch_rank(x, topk_ids, topk_weights, num_experts, group, capacity, timeout_s):
    world = group.size()
    t, k = topk_ids.shape
    h = x.shape[1]
    _check_tokens(t, capacity, "rank")
    rows = recv_rows("rank", world, num_experts, t, capacity)
    handle = torch.full((handle_len("rank", world, num_experts, t, k, capacity),), -1, dtype=torch.int64,
                        device=x.device)
    handle[0] = CODE
    send_counts, _per_expert, in_rank = dispatch_layout(topk_ids, num_experts, world)
    send_counts = send_counts.long()
    recv_x = x.new_zeros(rows, h)
    recv_meta = pack_meta(torch.full((rows, k), -1, dtype=torch.int64, device=x.device),
                          topk_weights.new_zeros(rows, k))
    if capacity > 0:
        # static shapes only (no nonzero / masked indexing): CUDA-graph capturable, no host sync.
        # Every (token, rank) pair has a slot; pairs not sent write into one spare row, dropped.
        c = capacity
        ranks = torch.arange(world, device=x.device)
        pos = torch.cumsum(in_rank.long(), 0) - 1  # [T, W] row inside the block for rank p
        slot = torch.where(in_rank, ranks * c + pos, world * c).reshape(-1)
        token = torch.arange(t, device=x.device).repeat_interleave(world)
        dest = ranks.repeat(t)
        ids, weights = local_slots(topk_ids[token], topk_weights[token], dest, num_experts, world)
        send_x = x.new_zeros(world * c + 1, h).index_copy_(0, slot, x[token])
        send_meta = recv_meta[:1].expand(world * c + 1, -1).clone().index_copy_(0, slot, pack_meta(ids, weights))
        send_token = torch.full((world * c + 1,), -1, dtype=torch.int64, device=x.device).index_copy_(
            0, slot, torch.where(in_rank.reshape(-1), token, -1))
        groups.all_to_all(recv_x, send_x[:-1], group, timeout_s, what="ep_dispatch (tokens)")
        groups.all_to_all(recv_meta, send_meta[:-1], group, timeout_s, what="ep_dispatch (ids, weights)")
        counts = torch.full((world,), c, dtype=torch.int64, device=x.device)
        handle[HEADER:HEADER + world] = counts
        handle[HEADER + world:HEADER + 2 * world] = counts
        handle[HEADER + 2 * world:] = send_token[:-1]
        handle[2] = rows
    else:
        dest, token = in_rank.t().nonzero(as_tuple=True)  # rank-major, token-ascending (DeepEP order)
        ids, weights = local_slots(topk_ids[token], topk_weights[token], dest, num_experts, world)
        meta = pack_meta(ids, weights)
        recv_counts = torch.empty_like(send_counts)
        groups.all_to_all(recv_counts, send_counts, group, timeout_s, what="ep_dispatch (counts)")
        out_splits, in_splits = recv_counts.tolist(), send_counts.tolist()
        n = sum(out_splits)
        if n > rows:
            raise groups.EpError(
                f"ep_fuse: rank {group.rank()} receives {n} tokens but its receive buffer holds {rows} "
                f"(world {world} x {t} local tokens): ranks run batches of different sizes. Pad every "
                "rank's batch to the same number of tokens, or set ep_capacity to the largest per-rank batch"
            )
        groups.all_to_all(recv_x[:n], x[token], group, timeout_s, out_splits, in_splits, "ep_dispatch (tokens)")
        groups.all_to_all(recv_meta[:n], meta, group, timeout_s, out_splits, in_splits,
                          "ep_dispatch (ids, weights)")
        handle[HEADER:HEADER + world] = send_counts
        handle[HEADER + world:HEADER + 2 * world] = recv_counts
        handle[HEADER + 2 * world:HEADER + 2 * world + token.numel()] = token
        handle[2] = n
    recv_ids, recv_weights = unpack_meta(recv_meta, k, topk_weights.dtype)
    return recv_x, recv_ids.contiguous(), recv_weights.contiguous(), handle


def _combine_rank(y, handle, tokens, group, capacity, timeout_s, out_dtype):
    world = group.size()
    h = y.shape[1]
    send_token = handle[HEADER + 2 * world:]
    if capacity > 0:
        back = torch.empty(world * capacity, h, dtype=y.dtype, device=y.device)
        groups.all_to_all(back, y, group, timeout_s, what="ep_combine")
    else:
        counts = handle[HEADER:HEADER + 2 * world].tolist()
        send_counts, recv_counts = counts[:world], counts[world:]
        s, n = sum(send_counts), sum(recv_counts)
        back = torch.empty(s, h, dtype=y.dtype, device=y.device)
        groups.all_to_all(back, y[:n], group, timeout_s, send_counts, recv_counts, "ep_combine")
        send_token = send_token[:s]
    index = torch.where(send_token >= 0, send_token, tokens)  # padding rows land in a spare row
    acc = torch.zeros(tokens + 1, h, dtype=torch.float32, device=y.device)
    acc.index_add_(0, index, back.float())  # unweighted fp32 sum, one cast (DeepEP normal)
    return acc[:tokens].to(out_dtype or y.dtype)


# --------------------------------------------------------------------------- expert layout
def _dispatch_expert(x, topk_ids, topk_weights, num_experts, group, capacity, timeout_s):
    world = group.size()
    t, k = topk_ids.shape
    h = x.shape[1]
    per_rank = num_experts // world
    _check_tokens(t, capacity, "expert")
    c = capacity_rows("expert", t, capacity)
    valid, pos = pair_positions(topk_ids, num_experts)
    keep = valid & (pos < c)  # only duplicate experts in one token's row can overflow a block
    flat_ids = topk_ids.reshape(-1).long()
    slot = torch.where(keep, flat_ids * c + pos, -1)  # row of the [W, E_r, C] send buffer (= [E, C])
    spare = torch.where(keep, slot, num_experts * c)  # static shapes: dropped slots write a spare row
    tok = torch.arange(t * k, device=x.device) // k
    send_x = x.new_zeros(num_experts * c + 1, h).index_copy_(0, spare, x[tok])
    send_ids = torch.full((num_experts * c + 1,), -1, dtype=torch.int64, device=x.device).index_copy_(
        0, spare, torch.where(keep, flat_ids % per_rank, -1))
    recv_x = x.new_empty(num_experts * c, h)
    recv_ids = torch.empty(num_experts * c, dtype=torch.int64, device=x.device)
    groups.all_to_all(recv_x, send_x[:-1], group, timeout_s, what="ep_dispatch (tokens)")
    groups.all_to_all(recv_ids, send_ids[:-1], group, timeout_s, what="ep_dispatch (ids)")
    # [W(src), E_r, C] -> [E_r, W, C]: expert-major blocks, source-rank-major inside
    recv_x = recv_x.view(world, per_rank, c, h).transpose(0, 1).reshape(-1, h)
    recv_ids = recv_ids.view(world, per_rank, c).transpose(0, 1).reshape(-1, 1)
    recv_weights = (recv_ids >= 0).to(topk_weights.dtype)
    handle = torch.full((handle_len("expert", world, num_experts, t, k, capacity),), -1, dtype=torch.int64,
                        device=x.device)
    handle[0] = CODE
    handle[2] = recv_x.shape[0]
    handle[HEADER:] = slot
    return recv_x, recv_ids, recv_weights, handle


def _combine_expert(y, handle, topk_ids, topk_weights, num_experts, group, capacity, timeout_s, out_dtype):
    world = group.size()
    t, k = topk_ids.shape
    h = y.shape[1]
    per_rank = num_experts // world
    c = capacity_rows("expert", t, capacity)
    send = y.view(per_rank, world, c, h).transpose(0, 1).contiguous()  # back to [W(src), E_r, C]
    back = torch.empty_like(send)
    groups.all_to_all(back, send, group, timeout_s, what="ep_combine")
    back = back.view(num_experts * c, h)
    slot = handle[HEADER:HEADER + t * k]
    valid = (slot >= 0).view(t, k, 1)
    rows = back[slot.clamp(min=0)].view(t, k, h)
    prod = rows * topk_weights.view(t, k, 1)  # weighted on the source rank, in the promoted dtype
    out = torch.where(valid, prod, torch.zeros((), dtype=prod.dtype, device=y.device)).sum(1)
    return out.to(out_dtype) if out_dtype is not None else out


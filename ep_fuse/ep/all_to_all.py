"""The default EP engine, and the reference kernels of ``ep_dispatch`` / ``ep_combine``:
``torch.distributed.all_to_all_single`` on any backend (gloo on CPU, NCCL on GPU, HCCL on NPU).

Layouts, wire format and handle: :mod:`ep_fuse.ops.ep_layout`. Rank layout: one message per direction
(token rows with their ids and weights packed into extra columns, :func:`~ep_fuse.ops.ep_layout.packed_row`);
handle payload ``[send_counts (W), recv_counts (W), slot (T*W)]``. Expert layout payload
``[src_slot (T*K)]`` -- where each (token, slot)'s row comes back in the combine buffer ``[W, E_r, C]``
(-1: invalid slot).

Data-dependent mode (``capacity == 0``, rank layout): per-peer counts are exchanged first and the
payload sent with exact splits (one host sync per layer: not CUDA-graph capturable; combine reuses the
splits). Capacity mode: every peer gets a fixed ``C`` rows (padding has id -1), equal splits, no host sync.

The rank layout's local work runs as Triton kernels (:mod:`ep_fuse.ep.a2a_kernels`: routing, scatter
into the send buffer, unpack, combine sum) on CUDA and under ``TRITON_INTERPRET=1``; the pure-torch
``*_reference`` functions produce the same bytes and run elsewhere (and are the tests' oracle).
"""

from __future__ import annotations

import collections
import logging
import threading
import weakref
from typing import Any

import torch

from ep_fuse import runtime
from ep_fuse.ep import groups
from ep_fuse.ops.ep_layout import (
    CODES,
    HEADER,
    capacity_rows,
    dispatch_layout,
    handle_len,
    local_slots,
    pack_rows,
    packed_row,
    pair_positions,
    recv_rows,
    unpack_rows,
)
from ep_fuse.ops.ep import register_ep_async, register_engine

log = logging.getLogger("ep_fuse.ep")
CODE = CODES["all_to_all"]
_splits_lock = threading.Lock()


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
        raise groups.EpError(f"ep_fuse: all_to_all combine got a handle of engine code {int(handle[0])}")
    if layout == "rank":
        return _combine_rank(y, handle, topk_ids.shape[0], group, capacity, timeout_s, out_dtype)
    return _combine_expert(y, handle, topk_ids, topk_weights, num_experts, group, capacity, timeout_s, out_dtype)


# --------------------------------------------------------------------------- rank layout
def _dispatch_rank(x, topk_ids, topk_weights, num_experts, group, capacity, timeout_s):
    return _dispatch_rank_start(x, topk_ids, topk_weights, num_experts, group, capacity, timeout_s)()


def _dispatch_rank_start(x, topk_ids, topk_weights, num_experts, group, capacity, timeout_s):
    """Pack and issue the token exchange; returns the completion (wait, unpack). Data-dependent mode exchanges
    the counts first (its host sync), so only the payload is in flight when this returns."""
    world = group.size()
    t, k = topk_ids.shape
    h = x.shape[1]
    _check_tokens(t, capacity, "rank")
    rows = recv_rows("rank", world, num_experts, t, capacity)
    hp, moff = packed_row(h, x.dtype, k, topk_weights.dtype)
    kernels = _dispatch_kernels(x, topk_ids, topk_weights, world)
    pack = pack_rank if kernels else pack_rank_reference
    send, handle = pack(x, topk_ids, topk_weights, num_experts, world, capacity)
    recv = torch.empty(rows, hp, dtype=x.dtype, device=x.device) if kernels else x.new_zeros(rows, hp)
    if capacity > 0:
        work = groups.all_to_all_start(recv, send, group)
        n = rows
    else:
        counts = handle[HEADER:HEADER + 2 * world]
        groups.all_to_all(counts[world:], counts[:world], group, timeout_s, what="ep_dispatch (counts)")
        both = counts.tolist()  # the one host sync of the data-dependent mode
        send_counts, recv_counts = both[:world], both[world:]
        n = sum(recv_counts)
        if n > rows:
            raise groups.EpError(
                f"ep_fuse: rank {group.rank()} receives {n} tokens but its receive buffer holds {rows} "
                f"(world {world} x {t} local tokens): ranks run batches of different sizes. Pad every "
                "rank's batch to the same number of tokens, or set ep_capacity to the largest per-rank batch"
            )
        work = groups.all_to_all_start(recv[:n], send[:sum(send_counts)], group, recv_counts, send_counts)
        _remember_splits(handle, send_counts, recv_counts)
    unpack = unpack_rank if kernels else unpack_rank_reference

    def complete():
        groups.wait(work, timeout_s, "ep_dispatch", groups.backend_of(group))
        _alive = send  # noqa: F841 - the send buffer stays alive until the exchange ended
        recv_x, recv_ids, recv_weights = unpack(recv, n, h, k, topk_weights.dtype, handle, capacity == 0)
        return recv_x, recv_ids, recv_weights, handle

    return complete


def _combine_rank(y, handle, tokens, group, capacity, timeout_s, out_dtype):
    return _combine_rank_start(y, handle, tokens, group, capacity, timeout_s, out_dtype)()


def _combine_rank_start(y, handle, tokens, group, capacity, timeout_s, out_dtype):
    """Issue the return exchange; the completion waits and sums each token's rows."""
    world = group.size()
    h = y.shape[1]
    if capacity > 0:
        back = torch.empty(world * capacity, h, dtype=y.dtype, device=y.device)
        work = groups.all_to_all_start(back, y, group)
    else:
        send_counts, recv_counts = _splits(handle, world)
        s, n = sum(send_counts), sum(recv_counts)
        back = torch.empty(max(s, 1), h, dtype=y.dtype, device=y.device)[:s]  # never a null pointer for Triton
        work = groups.all_to_all_start(back, y[:n], group, send_counts, recv_counts)

    def complete():
        groups.wait(work, timeout_s, "ep_combine", groups.backend_of(group))
        return sum_rank_rows(back, handle, tokens, world, out_dtype or y.dtype)

    return complete


def sum_rank_rows(back: torch.Tensor, handle: torch.Tensor, tokens: int, world: int,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """The local half of a rank-layout combine: ``out[t] = sum_r back[slot[t, r]]`` in fp32, rank order, one
    cast, from the ``[T, W]`` slot table at ``handle[HEADER + 2W:]`` (the Triton kernel where it runs, else
    the reference). Any engine whose combine returns the rows to their send slots shares it."""
    if _combine_kernels(back, tokens, out_dtype):
        return combine_rank(back, handle, tokens, world, out_dtype)
    return combine_rank_reference(back, handle, tokens, world, out_dtype)


# Local halves of the rank layout: the Triton kernels (ep_fuse.ep.a2a_kernels) and the pure-torch reference,
# interchangeable (same wire format and handle), so ranks may even mix them. The kernels run wherever Triton runs
# (CUDA; the CPU under TRITON_INTERPRET=1) unless the active config's ep_a2a_kernels is off (always the reference:
# tests and the benchmark compare the two); a compiled graph runs under the config it was compiled with.
MAX_WORLD = 64
MAX_TOP_K = 64
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _kernels_run_on(device: torch.device) -> bool:
    return runtime.active_config().ep_a2a_kernels and (device.type == "cuda" or (device.type == "cpu" and runtime.triton_interpret()))


def _dispatch_kernels(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, world: int) -> bool:
    """Whether the Triton kernels pack/unpack this dispatch (else the reference; the reason at debug level)."""
    if not _kernels_run_on(x.device):
        return False
    reason = None
    if ids.dtype not in (torch.int32, torch.int64) or ids.shape[1] > MAX_TOP_K:
        reason = f"ids {ids.dtype} with top-k {ids.shape[1]}"
    elif weights.element_size() not in (2, 4) or not weights.is_floating_point():
        reason = f"weights dtype {weights.dtype}"
    elif x.element_size() not in (1, 2, 4, 8) or x.shape[0] == 0 or x.shape[1] == 0:
        reason = f"x {x.dtype} {tuple(x.shape)}"
    elif world > MAX_WORLD:
        reason = f"{world} ranks > {MAX_WORLD}"
    if reason is not None:
        log.debug("ep_fuse: all_to_all dispatch on the reference path (%s)", reason)
    return reason is None


def _combine_kernels(back: torch.Tensor, tokens: int, out_dtype: torch.dtype) -> bool:
    if not _kernels_run_on(back.device):
        return False
    if back.dtype not in _KERNEL_DTYPES or out_dtype not in _KERNEL_DTYPES or tokens == 0 or back.shape[1] == 0:
        log.debug("ep_fuse: all_to_all combine on the reference path (%s -> %s, %d tokens)", back.dtype, out_dtype,
                  tokens)
        return False
    return True


def pack_rank_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                        world: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(send [W*(C or T), Hp], handle)``: packed rows in rank-major blocks (capacity: ``C`` rows per
    block, padding ids -1; data-dependent: exact, the rows past the total unused) and the handle."""
    t, k = topk_ids.shape
    h = x.shape[1]
    hp, moff = packed_row(h, x.dtype, k, topk_weights.dtype)
    c = capacity_rows("rank", t, capacity)
    dev = x.device
    handle = torch.full((handle_len("rank", world, num_experts, t, k, capacity),), -1, dtype=torch.int64, device=dev)
    handle[0] = CODE
    handle[2] = world * c
    send_counts, _per_expert, in_rank = dispatch_layout(topk_ids, num_experts, world)
    ranks = torch.arange(world, device=dev)
    pad = pack_rows(x.new_zeros(1, h), torch.full((1, k), -1, dtype=torch.int64, device=dev),
                    topk_weights.new_zeros(1, k), hp, moff)
    if capacity > 0:
        # static shapes only (no nonzero / masked indexing): CUDA-graph capturable, no host sync.
        # Every (token, rank) pair has a slot; pairs not sent write into one spare row, dropped.
        pos = torch.cumsum(in_rank.long(), 0) - 1  # [T, W] row inside the block for rank p
        slot = torch.where(in_rank, ranks * c + pos, -1)
        spare = torch.where(in_rank, slot, world * c).reshape(-1)
        token = torch.arange(t, device=dev).repeat_interleave(world)
        dest = ranks.repeat(t)
        ids, weights = local_slots(topk_ids[token], topk_weights[token], dest, num_experts, world)
        send = pad.expand(world * c + 1, -1).clone().index_copy_(0, spare, pack_rows(x[token], ids, weights, hp, moff))
        send = send[:-1]
        handle[HEADER:HEADER + 2 * world] = c
    else:
        dest, token = in_rank.t().nonzero(as_tuple=True)  # rank-major, token-ascending (DeepEP order)
        ids, weights = local_slots(topk_ids[token], topk_weights[token], dest, num_experts, world)
        send = x.new_zeros(world * t, hp)
        send[:token.numel()] = pack_rows(x[token], ids, weights, hp, moff)
        slot = torch.full((t, world), -1, dtype=torch.int64, device=dev)
        slot[token, dest] = torch.arange(token.numel(), device=dev)
        handle[HEADER:HEADER + world] = send_counts.long()
    handle[HEADER + 2 * world:] = slot.reshape(-1)
    return send, handle


def unpack_rank_reference(recv: torch.Tensor, n_valid: int, hidden: int, top_k: int, w_dtype: torch.dtype,
                          handle: torch.Tensor, zero_tail: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(recv_x [R, H] view, recv_ids [R, K] int64, recv_weights [R, K])`` of the receive buffer."""
    _hp, moff = packed_row(hidden, recv.dtype, top_k, w_dtype)
    if zero_tail:
        recv[n_valid:] = 0
    handle[2] = n_valid
    return unpack_rows(recv, n_valid, hidden, top_k, w_dtype, moff)


def combine_rank_reference(back: torch.Tensor, handle: torch.Tensor, tokens: int, world: int,
                           out_dtype: torch.dtype) -> torch.Tensor:
    """``out[t] = sum_r back[slot[t, r]]``: unweighted fp32 sum in rank order, one cast (DeepEP normal)."""
    slot = handle[HEADER + 2 * world:HEADER + 2 * world + tokens * world].view(tokens, world)
    rows = torch.cat([back, back.new_zeros(1, back.shape[1])])  # a zero row for pairs not sent
    spare = torch.where(slot >= 0, slot, back.shape[0])
    acc = torch.zeros(tokens, back.shape[1], dtype=torch.float32, device=back.device)
    for r in range(world):
        acc += rows[spare[:, r]].float()
    return acc.to(out_dtype)


def pack_rank(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, world: int,
              capacity: int, cfg: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pack_rank_reference` with the Triton kernels (no host sync; rows of ``send`` that carry no
    token are uninitialised except for their padding metadata)."""
    from ep_fuse.ep import a2a_kernels  # imports triton: on first use

    t, k = topk_ids.shape
    hp, moff = packed_row(x.shape[1], x.dtype, k, topk_weights.dtype)
    rows = world * capacity_rows("rank", t, capacity)
    send = torch.empty(rows, hp, dtype=x.dtype, device=x.device)
    handle = torch.empty(handle_len("rank", world, num_experts, t, k, capacity), dtype=torch.int64, device=x.device)
    x = x if x.stride(1) == 1 else x.contiguous()
    w = topk_weights if topk_weights.stride(1) == 1 else topk_weights.contiguous()
    a2a_kernels.launch_pack(x, topk_ids, w, num_experts, world, capacity, send, moff, handle, cfg)
    return send, handle


def unpack_rank(recv: torch.Tensor, n_valid: int, hidden: int, top_k: int, w_dtype: torch.dtype,
                handle: torch.Tensor, zero_tail: bool,
                cfg: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`unpack_rank_reference` with the Triton kernel."""
    from ep_fuse.ep import a2a_kernels  # imports triton: on first use

    _hp, moff = packed_row(hidden, recv.dtype, top_k, w_dtype)
    rows = recv.shape[0]
    recv_ids = torch.empty(rows, top_k, dtype=torch.int64, device=recv.device)
    recv_weights = torch.empty(rows, top_k, dtype=w_dtype, device=recv.device)
    a2a_kernels.launch_unpack(recv, n_valid, moff, recv_ids, recv_weights, handle, zero_tail, cfg)
    return recv[:, :hidden], recv_ids, recv_weights


def combine_rank(back: torch.Tensor, handle: torch.Tensor, tokens: int, world: int, out_dtype: torch.dtype,
                 cfg: Any = None) -> torch.Tensor:
    """:func:`combine_rank_reference` with the Triton kernel."""
    from ep_fuse.ep import a2a_kernels  # imports triton: on first use

    back = back if back.stride(1) == 1 else back.contiguous()
    out = torch.empty(tokens, back.shape[1], dtype=out_dtype, device=back.device)
    a2a_kernels.launch_combine(back, handle, world, out, cfg)
    return out


# Data-dependent mode: dispatch read the per-peer counts on the host; combine reuses them (no second sync)
# when it gets the same handle (by storage), else reads them from the handle.
_SPLITS: collections.OrderedDict[int, tuple[Any, list[int], list[int]]] = collections.OrderedDict()
_SPLITS_MAX = 256


def _remember_splits(handle: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> None:
    with _splits_lock:
        _SPLITS[handle.data_ptr()] = (weakref.ref(handle), send_counts, recv_counts)
        _SPLITS.move_to_end(handle.data_ptr())
        while len(_SPLITS) > _SPLITS_MAX:
            _SPLITS.popitem(last=False)


def _splits(handle: torch.Tensor, world: int) -> tuple[list[int], list[int]]:
    with _splits_lock:
        entry = _SPLITS.get(handle.data_ptr())
    if entry is not None:
        owner = entry[0]()
        if owner is not None and owner.untyped_storage().data_ptr() == handle.untyped_storage().data_ptr():
            return entry[1], entry[2]
    counts = handle[HEADER:HEADER + 2 * world].tolist()
    return counts[:world], counts[world:]


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


def dispatch_start(x, topk_ids, topk_weights, num_experts, group_name, layout, capacity, timeout_s):
    """The async dispatch (``ep_fuse::ep_dispatch_start``): the rank layout's exchange is left in flight; the
    expert layout (two messages, torch index work) runs whole here."""
    group = groups.resolve_group(group_name)
    if layout == "rank":
        return _dispatch_rank_start(x, topk_ids, topk_weights, num_experts, group, capacity, timeout_s)
    out = _dispatch_expert(x, topk_ids, topk_weights, num_experts, group, capacity, timeout_s)
    return lambda: out


def combine_start(y, handle, topk_ids, topk_weights, num_experts, group_name, layout, capacity, timeout_s,
                  out_dtype):
    """The async combine (``ep_fuse::ep_combine_start``)."""
    if layout == "rank":
        group = groups.resolve_group(group_name)
        if handle.device.type == "cpu" and int(handle[0]) != CODE:
            raise groups.EpError(f"ep_fuse: all_to_all combine got a handle of engine code {int(handle[0])}")
        return _combine_rank_start(y, handle, topk_ids.shape[0], group, capacity, timeout_s, out_dtype)
    out = combine(y, handle, topk_ids, topk_weights, num_experts, group_name, layout, capacity, timeout_s, out_dtype)
    return lambda: out


register_engine("all_to_all", dispatch, combine, layout="rank")
register_ep_async("all_to_all", dispatch_start, combine_start, devices=("cpu", "cuda", "npu"))

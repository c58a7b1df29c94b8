"""DeepEP provider (``deep_ep.Buffer``, V1 API; ``op-contracts.md`` §8.2-§8.10). **Not run on real DeepEP**:
tested on CPU against ``tests/deepep_double.py``, a double of the documented contract.

* ``deepep`` (normal, ``rank`` layout): ``get_dispatch_layout`` -> ``dispatch`` (ids rebased to local
  experts, -1 elsewhere; weights fp32, 0.0 elsewhere) -> local experts, weights applied in the
  unpermute -> ``combine`` (unweighted fp32 sum, one BF16 cast). With ``ep_capacity`` the dispatch
  uses ``num_worst_tokens = W * C`` (static outputs, no host sync; intranode only); otherwise the
  received rows (a host sync) are copied into the static ``[W * T, H]`` buffer.
* ``deepep_low_latency`` (``expert`` layout): ``low_latency_dispatch`` (BF16, ``use_fp8=False``) gives
  ``[E_r, W * C, H]``, viewed as ``E_r * W * C`` rows (rows past ``recv_count[e]`` are garbage and
  get id -1); ``low_latency_combine`` applies the routing weights on the source rank.
* One ``Buffer`` per process group, created on first use with sizes from ``Config`` size hints
  (normal) and ``get_low_latency_rdma_size_hint`` (LL), recreated (collectively, on every rank alike)
  only when a larger or low-latency buffer is needed; ``clean_low_latency_buffer`` runs whenever a
  low-latency kernel follows normal kernels on a buffer.
* Guards (checked at compile time by :func:`supports`; run-time errors are raised, never a silent
  switch of provider, which would desynchronise the ranks): ``deep_ep`` importable; BF16 tokens and
  output; the group size in DeepEP's config table (normal); ``T <= C`` (LL); not both
  ``torch.use_deterministic_algorithms`` and ``fill_uninitialized_memory``; no normal dispatch
  without ``ep_capacity`` under CUDA-graph capture.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from typing import Any

import torch

from ep_fuse.ep import groups, handles
from ep_fuse.ep.layout import (
    CODES,
    HEADER,
    capacity_rows,
    handle_len,
    recv_rows,
    valid_slots,
)

log = logging.getLogger("ep_fuse.ep")

CONFIG_RANKS = (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160)
"""Group sizes with tuned ``Buffer.get_dispatch_config`` / ``get_combine_config`` entries (others assert)."""
NVL_RANKS = 8
"""Largest intranode (NVLink) group: ``num_worst_tokens`` is intranode only."""


@functools.lru_cache(maxsize=1)
def available() -> str | None:
    """``None`` when ``deep_ep`` imports, else why not (it is optional: imported lazily)."""
    try:
        importlib.import_module("deep_ep")
    except Exception as exc:  # ImportError, NCCL mismatch abort guards, missing CUDA libraries
        return f"deep_ep cannot be imported ({type(exc).__name__}: {exc})"
    return None


def _deep_ep() -> Any:
    return importlib.import_module("deep_ep")


def supports(mode: str, x: Any, topk_ids: Any, out_dtype: Any, world: int, capacity: int) -> str | None:
    """Why DeepEP ``mode`` (``normal`` / ``low_latency``) cannot run this block (``None``: it can)."""
    if torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory:
        return "DeepEP refuses deterministic algorithms with fill_uninitialized_memory"
    if x.dtype != torch.bfloat16:
        return f"DeepEP dispatches BF16 tokens (FP8 not used by ep_fuse); got {x.dtype}"
    if out_dtype != torch.bfloat16:
        return f"DeepEP combines BF16 expert outputs; the block returns {out_dtype}"
    if mode == "normal":
        if world not in CONFIG_RANKS:
            return f"DeepEP has no dispatch/combine config for {world} ranks (tables: {CONFIG_RANKS})"
        if capacity > 0 and world > NVL_RANKS:
            return "num_worst_tokens (ep_capacity) is intranode only (<= 8 ranks)"
    else:
        c = capacity_rows("expert", topk_ids.shape[0], capacity)
        if topk_ids.shape[0] > c:
            return f"{topk_ids.shape[0]} tokens exceed num_max_dispatch_tokens_per_rank={c}"
    return None


# --------------------------------------------------------------------------- buffer management
@dataclasses.dataclass
class _BufferState:
    buffer: Any
    num_nvl_bytes: int
    num_rdma_bytes: int
    low_latency_mode: bool
    last_kernels: str = "none"


_BUFFERS: dict[str, _BufferState] = {}


def _size_hints(deep_ep: Any, world: int, hidden: int, elem_size: int) -> tuple[int, int]:
    hidden_bytes = hidden * max(elem_size, 2)
    nvl = rdma = 0
    if world in CONFIG_RANKS:
        for cfg in (deep_ep.Buffer.get_dispatch_config(world), deep_ep.Buffer.get_combine_config(world)):
            nvl = max(nvl, cfg.get_nvl_buffer_size_hint(hidden_bytes, world))
            rdma = max(rdma, cfg.get_rdma_buffer_size_hint(hidden_bytes, world))
    return nvl, rdma


def get_buffer(group: Any, mode: str, hidden: int, elem_size: int, num_experts: int, max_tokens: int) -> Any:
    """The group's ``Buffer``, (re)created large enough for ``mode``; cleans the LL buffer after normal use."""
    deep_ep = _deep_ep()
    world = group.size()
    nvl, rdma = _size_hints(deep_ep, world, hidden, elem_size)
    low_latency = mode == "low_latency"
    if low_latency:
        rdma = max(rdma, deep_ep.Buffer.get_low_latency_rdma_size_hint(max_tokens, hidden, world, num_experts))
    state = _BUFFERS.get(group.group_name)
    if (state is None or state.num_nvl_bytes < nvl or state.num_rdma_bytes < rdma
            or (low_latency and not state.low_latency_mode)):
        if state is not None:
            nvl, rdma = max(nvl, state.num_nvl_bytes), max(rdma, state.num_rdma_bytes)
            low_latency = low_latency or state.low_latency_mode
            state.buffer.destroy()
        qps = num_experts // world if low_latency else max(1, deep_ep.Buffer.num_sms // 2)
        log.info("ep_fuse: DeepEP Buffer for group %s: nvl %d B, rdma %d B, low_latency_mode=%s",
                 group.group_name, nvl, rdma, low_latency)
        buffer = deep_ep.Buffer(group, num_nvl_bytes=nvl, num_rdma_bytes=rdma, low_latency_mode=low_latency,
                                num_qps_per_rank=qps, explicitly_destroy=True)
        state = _BUFFERS[group.group_name] = _BufferState(buffer, nvl, rdma, low_latency)
    if low_latency and mode == "low_latency" and state.last_kernels == "normal":
        state.buffer.clean_low_latency_buffer(max_tokens, hidden, num_experts)
    state.last_kernels = mode
    return state.buffer


def _current_buffer(group: Any, mode: str) -> Any:
    """The buffer the matching dispatch used (combine never resizes or recreates it)."""
    state = _BUFFERS[group.group_name]
    state.last_kernels = mode
    return state.buffer


def destroy_buffers() -> None:
    """Release every DeepEP buffer (collective: call on all ranks, e.g. before destroy_process_group)."""
    for state in _BUFFERS.values():
        state.buffer.destroy()
    _BUFFERS.clear()


def _topk_idx(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """DeepEP ``topk_idx_t`` (int64) with -1 for every slot outside ``[0, E)``."""
    ids = topk_ids.long()
    return torch.where(valid_slots(ids, num_experts), ids, -1)


# --------------------------------------------------------------------------- normal
def dispatch_normal(x, topk_ids, topk_weights, num_experts, group_name, layout, capacity, timeout_s):
    group = groups.resolve_group(group_name)
    world = group.size()
    t, k = topk_ids.shape
    if capacity == 0 and x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise groups.EpError("ep_fuse: DeepEP normal dispatch syncs with the host and cannot be captured in a CUDA "
                             "graph; set ep_capacity (num_worst_tokens) or ep_backend='deepep_low_latency'")
    buffer = get_buffer(group, "normal", x.shape[1], x.element_size(), num_experts, t)
    idx = _topk_idx(topk_ids, num_experts)
    per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, num_experts)
    rows = recv_rows("rank", world, num_experts, t, capacity)
    recv_x, recv_idx, recv_w, _counts, native, _ = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=topk_weights.float(),
        num_worst_tokens=rows if capacity > 0 else 0)
    n = recv_x.shape[0]
    if n > rows:
        raise groups.EpError(
            f"ep_fuse: rank {group.rank()} receives {n} tokens, more than its {rows}-row buffer: pad every "
            "rank's batch to the same size or set ep_capacity")
    if n < rows:  # data-dependent receive count: copy into the static buffer
        pad_x = x.new_zeros(rows, x.shape[1])
        pad_x[:n] = recv_x
        pad_idx = torch.full((rows, k), -1, dtype=torch.int64, device=x.device)
        pad_idx[:n] = recv_idx
        pad_w = torch.zeros(rows, k, dtype=torch.float32, device=x.device)
        pad_w[:n] = recv_w
        recv_x, recv_idx, recv_w = pad_x, pad_idx, pad_w
    handle = torch.full((handle_len("rank", world, num_experts, t, k, capacity),), -1, dtype=torch.int64,
                        device=x.device)
    handle[0], handle[2] = CODES["deepep"], n
    handles.put(handle, (native, n))
    return recv_x, recv_idx.long(), recv_w.to(topk_weights.dtype), handle


def combine_normal(y, handle, topk_ids, topk_weights, num_experts, group_name, layout, capacity, timeout_s,
                   out_dtype):
    group = groups.resolve_group(group_name)
    native, n = handles.pop(handle)
    buffer = _current_buffer(group, "normal")
    combined, _w, _ = buffer.combine(y if capacity > 0 else y[:n], native)
    return combined.to(out_dtype or y.dtype)


# --------------------------------------------------------------------------- low latency
def dispatch_low_latency(x, topk_ids, topk_weights, num_experts, group_name, layout, capacity, timeout_s):
    group = groups.resolve_group(group_name)
    world = group.size()
    t, k = topk_ids.shape
    c = capacity_rows("expert", t, capacity)
    per_rank = num_experts // world
    buffer = get_buffer(group, "low_latency", x.shape[1], x.element_size(), num_experts, c)
    idx = _topk_idx(topk_ids, num_experts)
    recv_x, recv_count, native, _event, _hook = buffer.low_latency_dispatch(x, idx, c, num_experts, use_fp8=False)
    rows = per_rank * world * c
    slot = torch.arange(world * c, device=x.device)
    live = slot.unsqueeze(0) < recv_count.to(slot.dtype).unsqueeze(1)  # [E_r, W*C]
    experts = torch.arange(per_rank, device=x.device).unsqueeze(1)
    recv_ids = torch.where(live, experts, -1).reshape(rows, 1)
    handle = torch.full((handle_len("expert", world, num_experts, t, k, capacity),), -1, dtype=torch.int64,
                        device=x.device)
    handle[0], handle[2] = CODES["deepep_low_latency"], rows
    handles.put(handle, (native, idx))
    return recv_x.reshape(rows, x.shape[1]), recv_ids, live.reshape(rows, 1).to(topk_weights.dtype), handle


def combine_low_latency(y, handle, topk_ids, topk_weights, num_experts, group_name, layout, capacity, timeout_s,
                        out_dtype):
    group = groups.resolve_group(group_name)
    world = group.size()
    c = capacity_rows("expert", topk_ids.shape[0], capacity)
    native, idx = handles.pop(handle)
    buffer = _current_buffer(group, "low_latency")
    combined, _event, _hook = buffer.low_latency_combine(
        y.view(num_experts // world, world * c, y.shape[1]).to(torch.bfloat16), idx, topk_weights.float(), native)
    return combined.to(out_dtype or torch.promote_types(y.dtype, topk_weights.dtype))


__all__ = ["HEADER", "available", "destroy_buffers", "get_buffer", "supports"]

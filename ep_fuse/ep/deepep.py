"""DeepEP engine (``deep_ep.Buffer``, V1 API at DeepEP commit 29d31c0; contract: ``docs/ep.md``).

Run for real on 2 GPUs (``tests/gpu/``, ``bench/bench_ep.py``; build: ``tools/build_deepep.sh``) and
on CPU against ``tests/support/deepep_double.py``, a double of the same contract.

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
  switch of engine, which would desynchronise the ranks): ``deep_ep`` importable; BF16 tokens and
  output; rows of 16-byte multiples; at most 1024 local experts; the group size in DeepEP's config
  table (normal); ``num_worst_tokens`` intranode only; low-latency: a hidden size its kernels are
  built for, top-k <= 11, ``T <= C``, ``(C + 1) * 2 <= NVSHMEM_QP_DEPTH`` and an RDMA buffer under
  DeepEP's ``INT_MAX * 16`` bytes -- a capacity beyond these is declined at compile time (the EP pass
  then takes normal mode); not both ``torch.use_deterministic_algorithms`` and
  ``fill_uninitialized_memory``; no normal dispatch without ``ep_capacity`` under CUDA-graph capture.
* Past one node (the group larger than DeepEP's ``NUM_MAX_NVL_PEERS`` = 8 ranks per node): ``Buffer.dispatch``
  / ``combine`` run the internode kernels (RDMA between nodes, NVLink inside one). The buffer then gets an RDMA
  part sized by ``Config.get_rdma_buffer_size_hint``, the layout's ``num_tokens_per_rdma_rank`` is passed on,
  and the native handle is the internode tuple (kept opaque; combine hands it back). Before the buffer is made,
  every rank's host name is gathered and must match DeepEP's assumption that node ``n`` holds group ranks
  ``[8n, 8n + 8)``; afterwards the runtime's ``get_num_rdma_ranks()`` must equal the node count ep_fuse
  planned for. Compile-time guards: group sizes a multiple of 8, node counts DeepEP's kernels are built for,
  no ``num_worst_tokens`` (documented intranode only: with ``ep_capacity`` the block falls back), an RDMA
  buffer under ``INT_MAX``. Not run on more than one node.
* Buffers are collective objects: a failed (re)creation leaves no entry behind, and
  :func:`destroy_buffers` (collective, every rank) releases each live buffer exactly once.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import os
import socket
from typing import Any

import torch

from ep_fuse.ep import groups, handles
from ep_fuse.ops.ep_layout import CODES, HEADER, capacity_rows, handle_len, recv_rows, valid_slots
from ep_fuse.ops.ep import register_ep_async, register_engine

log = logging.getLogger("ep_fuse.ep")

CONFIG_RANKS = (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160)
"""Group sizes with tuned ``Buffer.get_dispatch_config`` / ``get_combine_config`` entries (others assert)."""
NVL_RANKS = 8
"""Ranks per node (DeepEP's compile-time ``NUM_MAX_NVL_PEERS``): larger groups run the internode kernels, and
``num_worst_tokens`` is intranode only. Read per call (tests of a fake node split set it with the double's)."""
RDMA_NODE_COUNTS = (2, 3, 4, 6, 8, 12, 16, 18, 20)
"""Node counts DeepEP's internode kernels are instantiated for (``SWITCH_RDMA_RANKS``); others assert."""
LL_HIDDEN = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)
"""Hidden sizes DeepEP's low-latency kernels are instantiated for (``SWITCH_HIDDEN``); others assert."""
LL_MAX_TOPK = 11
MAX_LOCAL_EXPERTS = 1024
ROW_BYTES = 16
"""DeepEP's normal dispatch copies rows as 16-byte words, whatever their dtype (``csrc/deep_ep.cpp`` host checks)."""
INT_MAX = 2**31 - 1
DEFAULT_QP_DEPTH = 1024
"""``Buffer`` sets ``NVSHMEM_QP_DEPTH`` to this unless the environment sets it; low-latency kernels
assert ``depth >= (num_max_dispatch_tokens_per_rank + 1) * 2``."""


def node_split(world: int) -> tuple[int, int]:
    """``(nodes, ranks per node)`` DeepEP derives for a group of ``world`` ranks (its RDMA and NVL ranks)."""
    return max(1, world // NVL_RANKS), min(world, NVL_RANKS)


def host_name() -> str:
    """The name of this process's node (the node-layout check compares it across the group)."""
    return socket.gethostname()


def internode_reason(world: int, capacity: int) -> str | None:
    """Why DeepEP normal mode cannot run a group of ``world`` ranks past one node (``None``: it can)."""
    nodes, per_node = node_split(world)
    if world <= per_node:
        return None
    if world % per_node:
        return f"DeepEP needs groups past one node to be a multiple of {per_node} ranks per node; got {world}"
    if nodes not in RDMA_NODE_COUNTS:
        return f"DeepEP's internode kernels are built for {RDMA_NODE_COUNTS} nodes, not {nodes}"
    if capacity > 0:
        return (f"num_worst_tokens (ep_capacity) is intranode only in DeepEP's contract; this group spans {nodes} "
                "nodes: drop ep_capacity (data-dependent sizes) or use deepep_low_latency")
    return None


def check_node_layout(group: Any) -> None:
    """Collective: the group's ranks sit on nodes the way DeepEP assumes (rank ``r`` on node ``r // 8``).

    Raises :class:`EpError` naming the ranks that break it (DeepEP would exchange NVLink IPC handles between
    hosts, or RDMA inside one)."""
    world = group.size()
    hosts: list[Any] = [None] * world
    torch.distributed.all_gather_object(hosts, host_name(), group=group)
    _, per_node = node_split(world)
    blocks = [hosts[i:i + per_node] for i in range(0, world, per_node)]
    mixed = [i for i, b in enumerate(blocks) if len(set(b)) != 1]
    shared = len({b[0] for b in blocks}) != len(blocks)
    if mixed or shared:
        raise groups.EpError(
            f"ep_fuse: DeepEP assumes node n holds EP ranks [{per_node}n, {per_node}n + {per_node}); this group's "
            f"hosts by rank are {hosts}. Launch with {per_node} processes per node and node-contiguous ranks "
            f"(torchrun --nproc-per-node {per_node}), or choose ep_engine='all_to_all'")


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


def ll_capacity_limit() -> int:
    """Largest low-latency ``num_max_dispatch_tokens_per_rank`` the NVSHMEM QP depth allows."""
    try:
        depth = int(os.environ.get("NVSHMEM_QP_DEPTH", DEFAULT_QP_DEPTH))
    except ValueError:
        depth = DEFAULT_QP_DEPTH
    return depth // 2 - 1


def supports(mode: str, x: Any, topk_ids: Any, out_dtype: Any, world: int, capacity: int,
             num_experts: int | None = None) -> str | None:
    """Why DeepEP ``mode`` (``normal`` / ``low_latency``) cannot run this block (``None``: it can)."""
    if torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory:
        return "DeepEP refuses deterministic algorithms with fill_uninitialized_memory"
    if x.dtype != torch.bfloat16:
        return (f"ep_fuse sends BF16 tokens through DeepEP (quant='fp8_block' packs fp8 rows after this check); "
                f"got {x.dtype}")
    if out_dtype != torch.bfloat16:
        return f"DeepEP combines BF16 expert outputs; the block returns {out_dtype}"
    hidden = int(x.shape[-1])
    if hidden * 2 % ROW_BYTES:
        return f"DeepEP moves rows of {ROW_BYTES}-byte multiples; hidden {hidden} x 2 bytes is not"
    if num_experts is not None and num_experts // world > MAX_LOCAL_EXPERTS:
        return f"{num_experts // world} local experts exceed DeepEP's {MAX_LOCAL_EXPERTS}"
    if mode == "normal":
        if world not in CONFIG_RANKS:
            return f"DeepEP has no dispatch/combine config for {world} ranks (tables: {CONFIG_RANKS})"
        reason = internode_reason(world, capacity)
        if reason is None and node_split(world)[0] > 1:
            _, rdma = _size_hints(_deep_ep(), world, hidden, x.element_size())
            if rdma >= INT_MAX:
                return f"DeepEP's internode kernels need an RDMA buffer under INT_MAX bytes; rows of {hidden} need {rdma}"
        return reason
    t, k = int(topk_ids.shape[0]), int(topk_ids.shape[1])
    c = capacity_rows("expert", t, capacity)
    if hidden not in LL_HIDDEN:
        return f"DeepEP's low-latency kernels are built for hidden sizes {LL_HIDDEN}, not {hidden}"
    if k > LL_MAX_TOPK:
        return f"DeepEP's low-latency kernels take top-k <= {LL_MAX_TOPK}, not {k}"
    if t > c:
        return f"{t} tokens exceed num_max_dispatch_tokens_per_rank={c}"
    limit = ll_capacity_limit()
    if c > limit:
        return (f"low-latency capacity {c} exceeds {limit} tokens per rank (NVSHMEM_QP_DEPTH must be >= "
                f"(C + 1) * 2); use normal mode for batches this large")
    if num_experts is not None:
        rdma = _deep_ep().Buffer.get_low_latency_rdma_size_hint(c, hidden, world, num_experts)
        if rdma // 16 >= INT_MAX:
            return (f"a low-latency buffer for {c} tokens per rank x hidden {hidden} x {num_experts} experts needs "
                    f"{rdma / 2**30:.1f} GiB, over DeepEP's limit of {16 * INT_MAX / 2**30:.0f} GiB")
    return None


# --------------------------------------------------------------------------- buffer management
@dataclasses.dataclass
class _BufferState:
    buffer: Any
    num_nvl_bytes: int
    num_rdma_bytes: int
    low_latency_mode: bool
    last_kernels: str = "none"
    num_rdma_ranks: int = 1
    """Nodes the runtime spans (``get_num_rdma_ranks()``): > 1 runs DeepEP's internode kernels."""


_BUFFERS: dict[str, _BufferState] = {}


TUNED: dict[int, tuple[tuple[int, int], tuple[int, int]]] = {2: ((24, 12), (24, 8))}
"""Intranode configs per group size: ``((dispatch SMs, NVL chunk), (combine SMs, NVL chunk))``. 2 ranks:
the best of DeepEP's own tuning sweep (``tests/test_intranode.py``, 4096 tokens x 7168, top-8, 256
experts) on 2 GPUs (``docs/ep.md``) -- 339.7 GB/s dispatch, 288.3 GB/s combine (its defaults: 20 SMs,
chunks 24 / 10). Other group sizes use DeepEP's defaults (``bench_ep.py --deepep-config`` overrides)."""
NVL_BUFFER_TOKENS = 256


def _configs(deep_ep: Any, world: int) -> tuple[Any, Any]:
    """``(dispatch, combine)`` ``deep_ep.Config`` for a group of ``world`` ranks."""
    if world in TUNED:
        (ds, dc), (cs, cc) = TUNED[world]
        return deep_ep.Config(ds, dc, NVL_BUFFER_TOKENS), deep_ep.Config(cs, cc, NVL_BUFFER_TOKENS)
    return deep_ep.Buffer.get_dispatch_config(world), deep_ep.Buffer.get_combine_config(world)


def _size_hints(deep_ep: Any, world: int, hidden: int, elem_size: int) -> tuple[int, int]:
    hidden_bytes = hidden * max(elem_size, 2)
    nvl = rdma = 0
    if world in CONFIG_RANKS:
        for cfg in _configs(deep_ep, world):
            nvl = max(nvl, cfg.get_nvl_buffer_size_hint(hidden_bytes, world))
            rdma = max(rdma, cfg.get_rdma_buffer_size_hint(hidden_bytes, world))
    return nvl, rdma


def get_buffer(group: Any, mode: str, hidden: int, elem_size: int, num_experts: int, max_tokens: int) -> Any:
    """The group's ``Buffer``, (re)created large enough for ``mode``; cleans the LL buffer after normal use.

    Collective when it (re)creates: every rank reaches the same decision (same static sizes)."""
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
            del _BUFFERS[group.group_name]  # never leave a destroyed buffer registered
            state.buffer.destroy()
        qps = max(1, num_experts // world) if low_latency else max(1, deep_ep.Buffer.num_sms // 2)
        nodes, per_node = node_split(world)
        check_node_layout(group)
        log.info("ep_fuse: DeepEP Buffer for group %s: nvl %d B, rdma %d B, low_latency_mode=%s, %s",
                 group.group_name, nvl, rdma, low_latency,
                 f"internode ({nodes} nodes x {per_node} ranks)" if nodes > 1 else "intranode")
        try:
            buffer = deep_ep.Buffer(group, num_nvl_bytes=nvl, num_rdma_bytes=rdma, low_latency_mode=low_latency,
                                    num_qps_per_rank=qps, explicitly_destroy=True)
        except Exception as exc:
            raise groups.EpError(
                f"ep_fuse: creating a DeepEP Buffer (nvl {nvl} B, rdma {rdma} B, low_latency_mode={low_latency}) "
                f"failed on rank {group.rank()}: {type(exc).__name__}: {exc}") from exc
        got = buffer.runtime.get_num_rdma_ranks()
        if got != nodes:
            buffer.destroy()
            raise groups.EpError(
                f"ep_fuse: DeepEP's runtime spans {got} node(s) for {world} ranks, ep_fuse planned {nodes} with "
                f"{per_node} ranks per node: deep_ep was built with another NUM_MAX_NVL_PEERS than "
                f"ep_fuse.ep.deepep.NVL_RANKS ({NVL_RANKS}); make them agree")
        state = _BUFFERS[group.group_name] = _BufferState(buffer, nvl, rdma, low_latency, num_rdma_ranks=got)
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
    """Release every DeepEP buffer (collective: call on all ranks, before destroy_process_group).

    Idempotent; each buffer is released once even if one release raises."""
    states = list(_BUFFERS.values())
    _BUFFERS.clear()
    errors = []
    for state in states:
        try:
            if getattr(state.buffer, "runtime", True) is not None:
                state.buffer.destroy()
        except Exception as exc:  # keep releasing the others
            errors.append(exc)
    if errors:
        raise groups.EpError(f"ep_fuse: releasing {len(errors)} DeepEP buffer(s) failed: {errors[0]}") from errors[0]


def _topk_idx(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """DeepEP ``topk_idx_t`` (int64) with -1 for every slot outside ``[0, E)``."""
    ids = topk_ids.long()
    return torch.where(valid_slots(ids, num_experts), ids, -1)


def _new_handle(length: int, code: int, n_recv: int, native: Any, device: torch.device) -> torch.Tensor:
    """The graph-visible handle: registered by storage address; on CUDA left unwritten (no fill kernels
    on the dispatch path; its content is never read there), on CPU with its header filled in."""
    handle = torch.empty(length, dtype=torch.int64, device=device)
    if device.type == "cpu":
        handle.fill_(-1)
        handle[0], handle[2] = code, n_recv
    handles.put(handle, native, write_key=device.type == "cpu")
    return handle


# --------------------------------------------------------------------------- normal
def dispatch_normal(x, topk_ids, topk_weights, num_experts, group_name, layout, capacity, timeout_s):
    return _dispatch_normal(x, topk_ids, topk_weights, num_experts, group_name, capacity, False)()


def dispatch_normal_start(x, topk_ids, topk_weights, num_experts, group_name, layout, capacity, timeout_s):
    """The async dispatch: ``async_finish=True``; the completion makes the current stream wait for its event."""
    return _dispatch_normal(x, topk_ids, topk_weights, num_experts, group_name, capacity, True)


def _dispatch_normal(x, topk_ids, topk_weights, num_experts, group_name, capacity, async_finish):
    group = groups.resolve_group(group_name)
    world = group.size()
    t, k = topk_ids.shape
    if capacity == 0 and x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise groups.EpError("ep_fuse: DeepEP normal dispatch syncs with the host and cannot be captured in a CUDA "
                             "graph; set ep_capacity (num_worst_tokens) or ep_engine='deepep_low_latency'")
    if capacity > 0 and t > capacity:
        raise groups.EpError(f"ep_fuse: {t} tokens on this rank exceed ep_capacity={capacity}; raise ep_capacity "
                             "to the largest per-rank batch")
    buffer = get_buffer(group, "normal", x.shape[1], x.element_size(), num_experts, t)
    dispatch_cfg, _ = _configs(_deep_ep(), world)
    idx = _topk_idx(topk_ids, num_experts)
    per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, num_experts)
    rows = recv_rows("rank", world, num_experts, t, capacity)
    weights = topk_weights if topk_weights.dtype == torch.float32 else topk_weights.float()
    recv_x, recv_idx, recv_w, _counts, native, event = buffer.dispatch(
        x.contiguous(), num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank,
        is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=weights.contiguous(),
        num_worst_tokens=rows if capacity > 0 else 0, config=dispatch_cfg,
        **({"async_finish": True} if async_finish else {}))
    return lambda: _dispatch_normal_done(x, topk_ids, topk_weights, num_experts, group, capacity, rows,
                                         (recv_x, recv_idx, recv_w, native), event if async_finish else None)


def _dispatch_normal_done(x, topk_ids, topk_weights, num_experts, group, capacity, rows, got, event):
    """The local half after DeepEP's dispatch: wait for its event (async), pad to the static bound, the handle."""
    if event is not None:
        event.current_stream_wait()
    recv_x, recv_idx, recv_w, native = got
    world = group.size()
    t, k = topk_ids.shape
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
    handle = _new_handle(handle_len("rank", world, num_experts, t, k, capacity), CODES["deepep"], n, (native, n),
                         x.device)
    if recv_w.dtype != topk_weights.dtype:
        recv_w = recv_w.to(topk_weights.dtype)
    return recv_x, recv_idx if recv_idx.dtype == torch.int64 else recv_idx.long(), recv_w, handle


def combine_normal(y, handle, topk_ids, topk_weights, num_experts, group_name, layout, capacity, timeout_s,
                   out_dtype):
    return _combine_normal(y, handle, group_name, capacity, out_dtype, False)()


def combine_normal_start(y, handle, topk_ids, topk_weights, num_experts, group_name, layout, capacity, timeout_s,
                         out_dtype):
    """The async combine: ``async_finish=True``; the completion waits for its event and casts."""
    return _combine_normal(y, handle, group_name, capacity, out_dtype, True)


def _combine_normal(y, handle, group_name, capacity, out_dtype, async_finish):
    group = groups.resolve_group(group_name)
    native, n = handles.pop(handle)
    buffer = _current_buffer(group, "normal")
    _, combine_cfg = _configs(_deep_ep(), group.size())
    send = y if capacity > 0 else y[:n]
    send = send if send.dtype == torch.bfloat16 else send.to(torch.bfloat16)
    combined, _w, event = buffer.combine(send, native, config=combine_cfg,
                                         **({"async_finish": True} if async_finish else {}))
    dtype = out_dtype or y.dtype

    def complete():
        if async_finish:
            event.current_stream_wait()
        _alive = send  # noqa: F841 - read by the transfer until it ended
        return combined if combined.dtype == dtype else combined.to(dtype)

    return complete


# --------------------------------------------------------------------------- low latency
def dispatch_low_latency(x, topk_ids, topk_weights, num_experts, group_name, layout, capacity, timeout_s):
    return _dispatch_low_latency(x, topk_ids, topk_weights, num_experts, group_name, capacity, False)()


def dispatch_low_latency_start(x, topk_ids, topk_weights, num_experts, group_name, layout, capacity, timeout_s):
    """The async LL dispatch: ``return_recv_hook=True`` issues the sends; the completion calls the receive hook."""
    return _dispatch_low_latency(x, topk_ids, topk_weights, num_experts, group_name, capacity, True)


def _dispatch_low_latency(x, topk_ids, topk_weights, num_experts, group_name, capacity, hook):
    group = groups.resolve_group(group_name)
    world = group.size()
    t, k = topk_ids.shape
    c = capacity_rows("expert", t, capacity)
    if t > c:
        raise groups.EpError(f"ep_fuse: {t} tokens on this rank exceed ep_capacity={c} (DeepEP low-latency "
                             "num_max_dispatch_tokens_per_rank); raise ep_capacity to the largest per-rank batch")
    buffer = get_buffer(group, "low_latency", x.shape[1], x.element_size(), num_experts, c)
    idx = _topk_idx(topk_ids, num_experts)
    recv_x, recv_count, native, _event, recv_hook = buffer.low_latency_dispatch(
        x.contiguous(), idx, c, num_experts, use_fp8=False, **({"return_recv_hook": True} if hook else {}))
    return lambda: _dispatch_low_latency_done(x, topk_ids, topk_weights, num_experts, world, capacity, c,
                                              (recv_x, recv_count, native, idx), recv_hook if hook else None)


def _dispatch_low_latency_done(x, topk_ids, topk_weights, num_experts, world, capacity, c, got, recv_hook):
    if recv_hook is not None:
        recv_hook()
    recv_x, recv_count, native, idx = got
    t, k = topk_ids.shape
    per_rank = num_experts // world
    rows = per_rank * world * c
    slot = torch.arange(world * c, device=x.device)
    live = slot.unsqueeze(0) < recv_count.unsqueeze(1)  # [E_r, W*C]
    experts = torch.arange(per_rank, device=x.device).unsqueeze(1)
    recv_ids = torch.where(live, experts, -1).reshape(rows, 1)
    handle = _new_handle(handle_len("expert", world, num_experts, t, k, capacity), CODES["deepep_low_latency"], rows,
                         (native, idx), x.device)
    return recv_x.reshape(rows, x.shape[1]), recv_ids, live.reshape(rows, 1).to(topk_weights.dtype), handle


def combine_low_latency(y, handle, topk_ids, topk_weights, num_experts, group_name, layout, capacity, timeout_s,
                        out_dtype):
    return _combine_low_latency(y, handle, topk_ids, topk_weights, num_experts, group_name, capacity, out_dtype,
                                False)()


def combine_low_latency_start(y, handle, topk_ids, topk_weights, num_experts, group_name, layout, capacity,
                              timeout_s, out_dtype):
    """The async LL combine: ``return_recv_hook=True``; the completion calls the receive hook and casts."""
    return _combine_low_latency(y, handle, topk_ids, topk_weights, num_experts, group_name, capacity, out_dtype,
                                True)


def _combine_low_latency(y, handle, topk_ids, topk_weights, num_experts, group_name, capacity, out_dtype, hook):
    group = groups.resolve_group(group_name)
    world = group.size()
    c = capacity_rows("expert", topk_ids.shape[0], capacity)
    native, idx = handles.pop(handle)
    buffer = _current_buffer(group, "low_latency")
    send = y.view(num_experts // world, world * c, y.shape[1])
    weights = topk_weights if topk_weights.dtype == torch.float32 else topk_weights.float()
    send = send if send.dtype == torch.bfloat16 else send.to(torch.bfloat16)
    weights = weights.contiguous()
    combined, _event, recv_hook = buffer.low_latency_combine(send, idx, weights, native,
                                                             **({"return_recv_hook": True} if hook else {}))
    dtype = out_dtype or torch.promote_types(y.dtype, topk_weights.dtype)

    def complete():
        if hook:
            recv_hook()
        _alive = (send, weights)  # noqa: F841 - read by the transfer until it ended
        return combined if combined.dtype == dtype else combined.to(dtype)

    return complete


__all__ = ["HEADER", "available", "check_node_layout", "destroy_buffers", "get_buffer", "internode_reason",
           "node_split", "supports"]


# module attributes are looked up per call (tests swap runtimes and limits in and out)
register_engine(
    "deepep", dispatch_normal, combine_normal, layout="rank", available=lambda: available(),
    supports=lambda x, ids, dt, world, e, cap: supports("normal", x, ids, dt, world, cap, e), row_bytes=ROW_BYTES)
register_engine(
    "deepep_low_latency", dispatch_low_latency, combine_low_latency, layout="expert", available=lambda: available(),
    supports=lambda x, ids, dt, world, e, cap: supports("low_latency", x, ids, dt, world, cap, e), masked_blocks=True)
register_ep_async("deepep", dispatch_normal_start, combine_normal_start, devices=("cpu", "cuda"))
register_ep_async("deepep_low_latency", dispatch_low_latency_start, combine_low_latency_start,
                  devices=("cpu", "cuda"))

"""PyTorch symmetric-memory (NVSHMEM) EP engine, ``rank`` layout: ``torch.ops.symm_mem.all_to_all_vdev_2d``
dispatch and ``all_to_all_vdev_2d_offset`` combine. **Not run on a GPU yet**: tested on CPU against
``tests/support/symm_mem_double.py``, a double of the ops' contract (torch 2.11; ``docs/ep.md``).

* Splits and offsets never leave the device: no host sync, static shapes, every received row of the
  static ``R = W * (C or T)`` buffer past the real count carries id -1 (the local permute skips it).
* One message per row: ``[x | weights | local ids (int32)]`` bytes, so ids and weights travel with the
  token in the same exchange (one op = two kernels per direction, no second barrier).
* Each destination rank's rows go as :func:`~ep_fuse.ops.ep_layout.symm_mem_chunks` splits ("virtual
  experts" of the 2-D op), one thread block each, so ``W * chunks <= 64`` blocks share the copy.
  The received rows arrive chunk-major (chunk, source rank) with holes (an empty chunk still takes one
  row: ``major_align`` 1); dispatch gathers them into the compact ``[R, H]`` output (the copy out of the
  symmetric buffer), combine sends ``y`` back with ``all_to_all_vdev_2d_offset`` to its exact source
  slots, and the source sums its rows per token (fp32, unweighted, one cast).
* Buffers: per process group two flat ``uint8`` symmetric buffers (send / receive, roles swapped by
  combine) and four small int64 split tensors, allocated on first use (a collective over the whole
  world: NVSHMEM's symmetric heap), grown (collectively, sizes agreed with an ``all_reduce``) when a
  larger block comes, kept until :func:`destroy_buffers`. NVSHMEM reads peers' buffers one-sidedly and
  the ops end without a barrier: a buffer is safe to rewrite only after the next op's barrier, which
  holds while dispatch and combine alternate on a group; two dispatches (or combines) in a row get a
  stream-ordered ``all_reduce`` barrier first.
* Guards (:func:`supports`, compile time): the group spans the whole world (NVSHMEM teams and heap),
  2..8 ranks (the 2-D ops' tile limits and intranode block count), the buffers fit the symmetric heap
  (``NVSHMEM_SYMMETRIC_SIZE``, default 1 GiB).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ep_fuse.ep import groups
from ep_fuse.ep.all_to_all import sum_rank_rows
from ep_fuse.ops.ep_layout import (
    CODES,
    HEADER,
    capacity_rows,
    dispatch_layout,
    handle_len,
    local_slots,
    symm_mem_chunks,
)
from ep_fuse.ops.ep import register_engine

log = logging.getLogger("ep_fuse.ep")
CODE = CODES["symm_mem"]
MAX_WORLD = 8
"""``all_to_all_vdev_2d_offset`` takes <= 16 ranks; above 8 both ops launch only 8 blocks, which then
loop over splits (internode tuning): the engine is meant for one NVLink node."""
DEFAULT_HEAP = 1 << 30
"""NVSHMEM's default symmetric heap (``NVSHMEM_SYMMETRIC_SIZE``)."""
_GRAIN = 1 << 20


@dataclasses.dataclass(frozen=True)
class Runtime:
    """Where the ops live: ``symm`` is ``torch.distributed._symmetric_memory`` (``empty``, ``rendezvous``,
    ``set_backend``, ``get_backend``, ``is_nvshmem_available``, ``enable_symm_mem_for_group``), ``ops``
    is ``torch.ops.symm_mem``. Tests run the engine on a CPU double with :func:`use_runtime`."""

    symm: Any
    ops: Any
    device_type: str = "cuda"


OVERRIDE: contextvars.ContextVar[Runtime | None] = contextvars.ContextVar("ep_fuse_symm_mem_runtime", default=None)
"""The runtime :func:`use_runtime` set in this context (``None``: the real one)."""


@contextlib.contextmanager
def use_runtime(rt: Runtime) -> Iterator[Runtime]:
    """Run the engine on ``rt`` in this context (tests: ``tests/support/symm_mem_double.py``). The buffers and
    :func:`available`'s answer belong to one runtime: both are dropped on entry and on exit."""
    destroy_buffers()
    available.cache_clear()
    token = OVERRIDE.set(rt)
    try:
        yield rt
    finally:
        destroy_buffers()
        OVERRIDE.reset(token)
        available.cache_clear()


def runtime() -> Runtime:
    """The runtime the engine runs on: :func:`use_runtime`'s, else torch's symmetric memory on CUDA."""
    rt = OVERRIDE.get()
    if rt is not None:
        return rt
    import torch.distributed._symmetric_memory as symm

    return Runtime(symm, torch.ops.symm_mem, "cuda")


def device_type() -> str:
    """Device type the ops run on (``cuda``; ``cpu`` under the test double)."""
    rt = OVERRIDE.get()
    return rt.device_type if rt is not None else "cuda"


@functools.lru_cache(maxsize=1)
def available() -> str | None:
    """``None`` when the NVSHMEM all-to-all ops can run here, else why not. Selects torch's NVSHMEM
    symmetric-memory backend (process-wide) if no other backend is in use yet."""
    rt = runtime()
    if rt.device_type == "cuda":
        if not torch.cuda.is_available():
            return "CUDA is not available"
        major, minor = torch.cuda.get_device_capability()
        if major < 7 or (major, minor) == (11, 0):
            return f"NVSHMEM device code needs sm_70 or newer (not sm_110); this GPU is sm_{major}{minor}"
    for name in ("all_to_all_vdev_2d", "all_to_all_vdev_2d_offset"):
        if not hasattr(rt.ops, name):
            return f"torch {torch.__version__} has no torch.ops.symm_mem.{name} (needs torch >= 2.9 with NVSHMEM)"
    try:
        if not rt.symm.is_nvshmem_available():
            return "NVSHMEM is not available (libnvshmem_host.so.3 not found: pip install nvidia-nvshmem-cu12/cu13)"
        current = rt.symm.get_backend(rt.device_type) if hasattr(rt.symm, "get_backend") else None
        if current != "NVSHMEM":
            rt.symm.set_backend("NVSHMEM")
            log.info("ep_fuse: symmetric-memory backend %s -> NVSHMEM (symm_mem EP engine)", current)
    except Exception as exc:  # backend already in use, missing bindings
        return (f"torch's symmetric memory cannot use NVSHMEM here ({type(exc).__name__}: {exc}); set "
                "TORCH_SYMMMEM=NVSHMEM before any symmetric-memory allocation")
    return None


def heap_bytes() -> int:
    """The NVSHMEM symmetric heap size (``NVSHMEM_SYMMETRIC_SIZE``: bytes or with a K/M/G/T suffix)."""
    raw = os.environ.get("NVSHMEM_SYMMETRIC_SIZE", "").strip()
    if not raw:
        return DEFAULT_HEAP
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(raw[-1].upper(), 1)
    try:
        return int(float(raw[:-1] if mult > 1 else raw) * mult)
    except ValueError:
        return DEFAULT_HEAP


# --------------------------------------------------------------------------- row and buffer layout
@dataclasses.dataclass(frozen=True)
class _Row:
    """Byte layout of one dispatched row: ``[x (H) | weights (K) | local ids int32 (K)]``, 16-byte rows."""

    hidden: int
    x_dtype: torch.dtype
    top_k: int
    w_dtype: torch.dtype

    @property
    def x_bytes(self) -> int:
        return self.hidden * _size(self.x_dtype)

    @property
    def w_off(self) -> int:
        return _align(self.x_bytes, 8)

    @property
    def ids_off(self) -> int:
        return _align(self.w_off + self.top_k * _size(self.w_dtype), 8)

    @property
    def width(self) -> int:
        return _align(self.ids_off + 4 * self.top_k, 16)

    def views(self, flat: torch.Tensor, rows: int) -> tuple[torch.Tensor, ...]:
        """``(bytes [rows, width], x [rows, H], weights [rows, K], ids [rows, K])`` over ``flat``."""
        raw = flat[: rows * self.width].view(rows, self.width)
        x = raw[:, : self.x_bytes].view(self.x_dtype)
        w = raw[:, self.w_off: self.w_off + self.top_k * _size(self.w_dtype)].view(self.w_dtype)
        ids = raw[:, self.ids_off: self.ids_off + 4 * self.top_k].view(torch.int32)
        return raw, x, w, ids


def _human(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 1 << 20 else f"{n / 2**10:.1f} KiB"


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def _typed(flat: torch.Tensor, rows: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """``flat`` as a contiguous ``[rows, hidden]`` tensor of ``dtype`` starting at its first byte."""
    return flat[: rows * hidden * _size(dtype)].view(dtype).view(rows, hidden)


def buffer_bytes(world: int, rows: int, row: _Row, out_dtype: torch.dtype | None = None) -> tuple[int, int]:
    """Bytes of the (send, receive) buffers for ``rows = W * C`` rows: dispatch rows (+1 spare send row,
    + one row per chunk for empty-chunk holes) and combine rows of ``out_dtype``."""
    comb = (rows + 1) * row.hidden * _size(out_dtype or row.x_dtype)
    return (max((rows + 1) * row.width, comb), max((rows + symm_mem_chunks(world)) * row.width, comb))


def supports(x: Any, topk_ids: Any, out_dtype: Any, world: int, capacity: int) -> str | None:
    """Why the symm_mem engine cannot run this block (``None``: it can)."""
    if x.device.type != device_type():
        return f"the NVSHMEM ops run on {device_type()} tensors; the block is on {x.device.type}"
    if not 2 <= world <= MAX_WORLD:
        return f"{world} ranks: all_to_all_vdev_2d(_offset) is used for 2..{MAX_WORLD} ranks (one NVLink node)"
    if groups.initialized() and world != dist.get_world_size():
        return (f"the EP group has {world} of {dist.get_world_size()} ranks: NVSHMEM allocates from a world-wide "
                "symmetric heap (every rank must allocate alike), so the EP group must span the whole world")
    t, k = topk_ids.shape
    if t == 0 and capacity == 0:
        return "an empty batch has no static receive size (set ep_capacity)"
    rows = world * capacity_rows("rank", t, capacity)
    row = _Row(int(x.shape[1]), x.dtype, int(k), torch.float32)
    need = sum(buffer_bytes(world, rows, row, out_dtype if isinstance(out_dtype, torch.dtype) else None))
    if need > 0.9 * heap_bytes():
        return (f"the symmetric buffers need {_human(need)} of the {_human(heap_bytes())} NVSHMEM heap: set "
                f"NVSHMEM_SYMMETRIC_SIZE >= {_align(2 * need, 1 << 30) >> 30}G before the first allocation")
    return None


# --------------------------------------------------------------------------- buffers
@dataclasses.dataclass
class _Buffers:
    send: torch.Tensor  # uint8: dispatch input / combine output
    recv: torch.Tensor  # uint8: dispatch output / combine input
    in_splits: torch.Tensor  # int64 [W * chunks], rank-major (dispatch)
    out_so: torch.Tensor  # int64 [2, W * chunks], chunk-major (dispatch)
    comb_in: torch.Tensor  # int64 [2, W * chunks], chunk-major (combine)
    comb_out: torch.Tensor  # int64 [2, W * chunks], rank-major (combine)
    last: str = "none"  # the last op on the group: "dispatch" / "combine"


_BUFFERS: dict[str, _Buffers] = {}


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _enable_group(rt: Runtime, name: str) -> None:
    """Register the group with torch's symmetric memory (needed before torch 2.12; deprecated after)."""
    is_enabled = getattr(rt.symm, "is_symm_mem_enabled_for_group", None)
    enable = getattr(rt.symm, "enable_symm_mem_for_group", None)
    if enable is None or (is_enabled is not None and is_enabled(name)):
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        try:
            enable(name)
        except RuntimeError as exc:  # registered already (torch resolves groups itself)
            log.debug("ep_fuse: enable_symm_mem_for_group(%s): %s", name, exc)


def _agree(group: Any, sizes: list[int], device: torch.device, timeout_s: float) -> list[int]:
    """The element-wise max of ``sizes`` over the group (every rank allocates the same symmetric sizes)."""
    dev = device if groups.backend_of(group) in groups.DEVICE_ORDERED else torch.device("cpu")
    t = torch.tensor(sizes, dtype=torch.int64, device=dev)
    groups.wait(dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True), timeout_s,
                "symm_mem buffer allocation (sizes)", groups.backend_of(group))
    return [int(v) for v in t.tolist()]


def _allocate(rt: Runtime, group: Any, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
    t = rt.symm.empty(*shape, dtype=dtype, device=device)
    rt.symm.rendezvous(t, group.group_name)
    return t


def _buffers(rt: Runtime, group: Any, device: torch.device, send_bytes: int, recv_bytes: int,
             timeout_s: float) -> _Buffers:
    """The group's buffers, (re)allocated collectively when smaller than asked."""
    state = _BUFFERS.get(group.group_name)
    if state is not None and state.send.numel() >= send_bytes and state.recv.numel() >= recv_bytes:
        return state
    if _capturing(device):
        raise groups.EpError("ep_fuse: the symm_mem engine must allocate its symmetric buffers outside CUDA-graph "
                             "capture: run the model once eagerly (warm-up) before capturing it")
    why = available()  # also selects the NVSHMEM backend (direct op calls skip the compile-time check)
    if why:
        raise groups.EpError(f"ep_fuse: the symm_mem EP engine cannot run: {why}")
    if state is not None:
        send_bytes, recv_bytes = max(send_bytes, state.send.numel()), max(recv_bytes, state.recv.numel())
    send_bytes, recv_bytes = _agree(group, [_align(send_bytes, _GRAIN), _align(recv_bytes, _GRAIN)], device,
                                    timeout_s)
    world = group.size()
    nsplits = world * symm_mem_chunks(world)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _enable_group(rt, dist.group.WORLD.group_name)
        _enable_group(rt, group.group_name)
        if state is not None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # in-flight kernels may still read the old buffers
            state.send = state.recv = None  # type: ignore[assignment]  # freed (collectively) before the new ones
        send = _allocate(rt, group, (send_bytes,), torch.uint8, device)
        recv = _allocate(rt, group, (recv_bytes,), torch.uint8, device)
        if state is None:
            small = [_allocate(rt, group, shape, torch.int64, device)
                     for shape in ((nsplits,), (2, nsplits), (2, nsplits), (2, nsplits))]
            state = _BUFFERS[group.group_name] = _Buffers(send, recv, *small)
        else:
            state.send, state.recv = send, recv
    log.info("ep_fuse: symm_mem buffers for group %s: send %d B, receive %d B", group.group_name, send_bytes,
             recv_bytes)
    return state


def _order(state: _Buffers, kind: str, group: Any, device: torch.device, timeout_s: float) -> None:
    """Barrier before reusing the buffers when the last op on the group was of the same kind."""
    if state.last == kind:
        dev = device if groups.backend_of(group) in groups.DEVICE_ORDERED else torch.device("cpu")
        t = torch.zeros(1, device=dev)
        groups.wait(dist.all_reduce(t, group=group, async_op=True), timeout_s, f"symm_mem {kind} ordering barrier",
                    groups.backend_of(group))
    state.last = kind


def destroy_buffers() -> None:
    """Release every symmetric buffer (collective: call on all ranks alike, e.g. before
    ``destroy_process_group``); the next dispatch allocates again."""
    for state in _BUFFERS.values():
        if state.send is not None and state.send.device.type == "cuda":
            torch.cuda.synchronize(state.send.device)
    _BUFFERS.clear()


# --------------------------------------------------------------------------- dispatch / combine
def _chunk_splits(counts: torch.Tensor, chunks: int) -> torch.Tensor:
    """Rows per (rank, chunk): each rank's count cut into ``chunks`` near-equal consecutive pieces."""
    q = (counts + chunks - 1) // chunks
    j = torch.arange(chunks, device=counts.device)
    return torch.minimum((counts.unsqueeze(1) - j * q.unsqueeze(1)).clamp(min=0), q.unsqueeze(1))


def dispatch(x, topk_ids, topk_weights, num_experts, group_name, layout, capacity, timeout_s):
    rt = runtime()
    group = groups.resolve_group(group_name)
    world = group.size()
    t, k = topk_ids.shape
    h = x.shape[1]
    if capacity > 0 and t > capacity:
        raise groups.EpError(
            f"ep_fuse: {t} tokens on this rank exceed ep_capacity={capacity} (symm_mem); raise ep_capacity to the "
            "largest per-rank batch, or leave it unset for data-dependent sizes")
    rows = world * capacity_rows("rank", t, capacity)
    chunks = symm_mem_chunks(world)
    row = _Row(h, x.dtype, k, topk_weights.dtype)
    send_bytes, recv_bytes = buffer_bytes(world, rows, row)
    state = _buffers(rt, group, x.device, send_bytes, recv_bytes, timeout_s)
    _order(state, "dispatch", group, x.device, timeout_s)
    dev = x.device
    # where every (token, rank) pair goes: rank-major blocks, token order inside (static shapes only)
    counts, _per_expert, in_rank = dispatch_layout(topk_ids, num_experts, world)
    counts = counts.long()
    start = torch.cumsum(counts, 0) - counts
    slot = torch.where(in_rank, start + torch.cumsum(in_rank.long(), 0) - 1, rows)  # rows = spare row
    token = torch.arange(t, device=dev).repeat_interleave(world)
    ids, weights = local_slots(topk_ids[token], topk_weights[token], torch.arange(world, device=dev).repeat(t),
                               num_experts, world)
    send_raw, sx, sw, sids = row.views(state.send, rows + 1)
    sx[slot] = x.unsqueeze(1).expand(t, world, h)
    sw[slot] = weights.view(t, world, k)
    sids[slot] = ids.view(t, world, k).to(torch.int32)
    state.in_splits.copy_(_chunk_splits(counts, chunks).reshape(-1))
    recv_raw = row.views(state.recv, state.recv.numel() // row.width)[0]  # all of it: peers may hold more rows
    rt.ops.all_to_all_vdev_2d(send_raw, recv_raw, state.in_splits, state.out_so, group.group_name)
    # received splits are chunk-major (chunk j, source s) at offsets with holes: gather them compact
    splits, offsets = state.out_so[0], state.out_so[1]
    ends = torch.cumsum(splits, 0)
    total = ends[-1]
    i = torch.arange(rows, device=dev)
    split_of = torch.searchsorted(ends, i, right=True).clamp(max=splits.numel() - 1)
    live = i < total
    src = torch.where(live, offsets[split_of] + i - (ends - splits)[split_of], 0)
    if capacity == 0:
        torch._assert_async(total <= rows, "ep_fuse: symm_mem received more rows than its W x T buffer: ranks run "
                                           "batches of different sizes (pad them, or set ep_capacity)")
    _, rx, rw, rids = row.views(state.recv, recv_raw.shape[0])
    recv_x = rx.index_select(0, src)
    recv_ids = torch.where(live.unsqueeze(1), rids.index_select(0, src).long(), -1)
    recv_w = torch.where(live.unsqueeze(1), rw.index_select(0, src),
                         torch.zeros((), dtype=topk_weights.dtype, device=dev))
    handle = torch.full((handle_len("rank", world, num_experts, t, k, capacity, "symm_mem"),), -1,
                        dtype=torch.int64, device=dev)
    handle[:1].fill_(CODE)  # a kernel, not a host-to-device copy (CUDA-graph capturable)
    handle[2] = total
    slots0 = HEADER + 2 * world  # the rank layout's slot table (ep_fuse.ops.ep_layout.handle_len)
    handle[slots0:slots0 + t * world] = torch.where(in_rank, slot, -1).reshape(-1)
    handle[slots0 + t * world:] = splits
    return recv_x, recv_ids, recv_w, handle


def combine(y, handle, topk_ids, topk_weights, num_experts, group_name, layout, capacity, timeout_s, out_dtype):
    rt = runtime()
    group = groups.resolve_group(group_name)
    world = group.size()
    t = topk_ids.shape[0]
    h = y.shape[1]
    if handle.device.type == "cpu" and int(handle[0]) != CODE:
        raise groups.EpError(f"ep_fuse: symm_mem combine got a handle of engine code {int(handle[0])}")
    rows = world * capacity_rows("rank", t, capacity)
    comb = (rows + 1) * h * _size(y.dtype)
    state = _buffers(rt, group, y.device, comb, comb, timeout_s)
    _order(state, "combine", group, y.device, timeout_s)
    splits = handle[HEADER + 2 * world + t * world:]
    yin = _typed(state.recv, rows, h, y.dtype)
    yin.copy_(y)
    state.comb_in[0].copy_(splits)
    state.comb_in[1].copy_(torch.cumsum(splits, 0) - splits)
    back = _typed(state.send, rows, h, y.dtype)
    rt.ops.all_to_all_vdev_2d_offset(yin, back, state.comb_in, state.comb_out, group.group_name)
    # every row is back at its send slot: the rank layout's fp32 sum over ranks (one cast) applies as is
    return sum_rank_rows(back, handle, t, world, out_dtype or y.dtype)


__all__ = ["Runtime", "available", "buffer_bytes", "destroy_buffers", "heap_bytes", "runtime", "supports"]


register_engine(
    "symm_mem", dispatch, combine, layout="rank", available=lambda: available(),
    supports=lambda x, ids, dt, world, e, cap: supports(x, ids, dt, world, cap))

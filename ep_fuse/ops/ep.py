"""The EP family: the canonical ops ``ep_fuse::ep_dispatch`` / ``ep_fuse::ep_combine`` and the table of engines
that run them.

``ep_dispatch(x, topk_ids, topk_weights, num_experts, group_name, engine, layout, capacity, timeout_s)
-> (recv_x, recv_ids, recv_weights, handle)`` sends each token to the ranks owning its experts;
``ep_combine(y, handle, topk_ids, topk_weights, num_experts, group_name, engine, layout, capacity,
timeout_s, out_dtype) -> out [T, H]`` returns and reduces. Layouts, shapes and the handle format:
:mod:`ep_fuse.ops.ep_layout`.

* The kernels run the engine named by ``engine`` (``all_to_all``, ``deepep``, ``deepep_low_latency``, ``npu``,
  ``symm_mem``), looked up in a table the engines fill from their own modules (:func:`register_engine`,
  called by :mod:`ep_fuse.ep.all_to_all` etc.; :mod:`ep_fuse.catalog` imports them). The EP pass picks the
  engine at compile time, identically on every rank, so dispatch and combine of one block always use the
  same one. ``all_to_all`` is the reference.
* Fake impls have fixed shapes (a static bound, or the capacity), so the rest of the graph keeps
  static shapes; data-dependent receive counts live in the handle. ``all_to_all``'s rank-layout
  ``recv_x`` is a row-strided view (row stride ``Hp`` of :func:`~ep_fuse.ops.ep_layout.packed_row`).
* Both ops are marked side-effectful (``torch.fx.node.has_side_effect``): DCE, CSE and ep_fuse's
  cleanup never drop or merge them; data dependencies (dispatch -> experts -> combine -> next layer)
  order them. They are opaque to Inductor (never inlined).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.fx

from ep_fuse.ops.ep_layout import handle_len, packed_row, recv_rows
from ep_fuse.ops.registry import define_canonical, never_traceable

class EpError(RuntimeError):
    """Expert parallelism cannot run as configured (the message says what to change)."""


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def resolve_group(group: Any) -> Any:
    """A ``ProcessGroup`` from a group, a group name, or ``None`` (the default world group)."""
    if not initialized():
        raise EpError(
            "ep_fuse: expert parallelism needs torch.distributed: call torch.distributed.init_process_group() "
            "on every rank before compiling (or leave ep/ep_group unset for a single-process model)."
        )
    if group is None:
        return dist.group.WORLD
    if isinstance(group, str):
        try:
            return dist.distributed_c10d._resolve_process_group(group)
        except Exception as exc:
            raise EpError(f"ep_fuse: no process group named {group!r} ({exc}); pass the ProcessGroup itself "
                          "as ep_group") from exc
    return group


DISPATCH_SCHEMA = (
    "(Tensor x, Tensor topk_ids, Tensor topk_weights, int num_experts, str group_name, str engine, str layout, "
    "int capacity, float timeout_s) -> (Tensor, Tensor, Tensor, Tensor)"
)
COMBINE_SCHEMA = (
    "(Tensor y, Tensor handle, Tensor topk_ids, Tensor topk_weights, int num_experts, str group_name, "
    "str engine, str layout, int capacity, float timeout_s, ScalarType? out_dtype) -> Tensor"
)

@dataclasses.dataclass(frozen=True)
class EpEngine:
    """One dispatch/combine engine: its kernels, the receive layout it produces, and the compile-time
    checks the EP pass asks before choosing it (decided from static shapes and options, alike on every rank)."""

    name: str
    dispatch: Callable[..., Any]
    """``(x, ids, w, E, group_name, layout, capacity, timeout_s) -> (recv_x, recv_ids, recv_w, handle)``."""
    combine: Callable[..., Any]
    """``(y, handle, ids, w, E, group_name, layout, capacity, timeout_s, out_dtype) -> out``."""
    layout: str
    """``rank`` or ``expert`` (:mod:`ep_fuse.ops.ep_layout`)."""
    available: Callable[[], str | None]
    """``None`` when its runtime (deep_ep, NVSHMEM, torch_npu) can be used here, else why not."""
    supports: Callable[[Any, Any, Any, int, int, int], str | None]
    """``(x, topk_ids, block_dtype, world, num_experts, capacity)``: ``None`` when it can run the block."""
    contracts: dict[str, str] = dataclasses.field(default_factory=dict)
    """External ops its kernels call -> the release whose contract they were checked against (the report)."""
    row_bytes: int = 1
    """A token row's size in bytes must be a multiple of this for the engine to move it (DeepEP's normal dispatch
    copies rows as 16-byte words): what a pass that packs other rows (FP8 codes + scales) must keep."""
    masked_blocks: bool = False
    """``expert`` layout: each expert's block of ``W*C`` received rows holds its valid rows first (padding after,
    id -1), so the local experts may read it in place (``moe_experts_masked``, ``ep_fuse.passes.ep_masked``)."""


_ENGINES: dict[str, EpEngine] = {}


def _nothing(*_args: Any) -> None:
    return None


def register_engine(name: str, dispatch: Callable[..., Any], combine: Callable[..., Any], *, layout: str,
                         available: Callable[[], str | None] = _nothing,
                         supports: Callable[..., str | None] = _nothing,
                         contracts: dict[str, str] | None = None, row_bytes: int = 1,
                         masked_blocks: bool = False) -> EpEngine:
    """Make ``ep_engine=name`` run ``dispatch`` / ``combine`` (signatures on :class:`EpEngine`)."""
    prov = _ENGINES[name] = EpEngine(name, dispatch, combine, layout, available, supports, dict(contracts or {}),
                                         row_bytes, masked_blocks)
    return prov


def engine_names() -> list[str]:
    """The EP engines registered so far (what the option ``ep_engine`` takes besides ``"auto"``), sorted."""
    return sorted(_ENGINES)


def ep_engine(engine: str) -> EpEngine:
    """The engine registered as ``engine`` (:class:`EpError` when there is none)."""
    if engine not in _ENGINES:
        raise EpError(f"ep_fuse: unknown EP engine {engine!r}; known: {', '.join(sorted(_ENGINES)) or 'none'} "
                      "(import ep_fuse.catalog to register the built-in engines)")
    return _ENGINES[engine]


def ep_dispatch_impl(x, topk_ids, topk_weights, num_experts, group_name, engine, layout, capacity, timeout_s):
    """The kernel of ``ep_fuse::ep_dispatch``: the engine named by ``engine``."""
    return ep_engine(engine).dispatch(x, topk_ids, topk_weights, num_experts, group_name, layout, capacity,
                                        timeout_s)


def ep_combine_impl(y, handle, topk_ids, topk_weights, num_experts, group_name, engine, layout, capacity,
                    timeout_s, out_dtype):
    """The kernel of ``ep_fuse::ep_combine``."""
    return ep_engine(engine).combine(y, handle, topk_ids, topk_weights, num_experts, group_name, layout, capacity,
                                 timeout_s, out_dtype)


def ep_dispatch_fake(x, topk_ids, topk_weights, num_experts, group_name, engine, layout, capacity, timeout_s):
    world = resolve_group(group_name).size()
    t, k = topk_ids.shape
    rows = recv_rows(layout, world, num_experts, t, capacity)
    kk = k if layout == "rank" else 1
    h = x.shape[1]
    if engine == "all_to_all" and layout == "rank":  # a view of the packed receive buffer (layout.packed_row)
        recv_x = x.new_empty(rows, packed_row(h, x.dtype, k, topk_weights.dtype)[0])[:, :h]
    else:
        recv_x = x.new_empty(rows, h)
    return (recv_x, topk_ids.new_empty(rows, kk, dtype=torch.int64),
            topk_weights.new_empty(rows, kk),
            x.new_empty(handle_len(layout, world, num_experts, t, k, capacity, engine), dtype=torch.int64))


def ep_combine_fake(y, handle, topk_ids, topk_weights, num_experts, group_name, engine, layout, capacity,
                    timeout_s, out_dtype):
    if out_dtype is None:
        out_dtype = y.dtype if layout == "rank" else torch.promote_types(y.dtype, topk_weights.dtype)
    return y.new_empty(topk_ids.shape[0], y.shape[1], dtype=out_dtype)


ep_dispatch = define_canonical("ep_dispatch", DISPATCH_SCHEMA, ep_dispatch_impl, fake=ep_dispatch_fake,
                               traceable=never_traceable, engine=True)
ep_combine = define_canonical("ep_combine", COMBINE_SCHEMA, ep_combine_impl, fake=ep_combine_fake,
                              traceable=never_traceable, engine=True)
torch.fx.node.has_side_effect(ep_dispatch.op)
torch.fx.node.has_side_effect(ep_combine.op)


# --------------------------------------------------------------------------- async forms (start / wait)
# ``ep_dispatch_start(<ep_dispatch's args>) -> token`` issues the dispatch; ``ep_dispatch_wait(token, <the same
# args>) -> <ep_dispatch's outputs>`` completes it (likewise ``ep_combine_start`` / ``ep_combine_wait``). Work
# placed between the two runs while the communication is in flight (``ep_fuse/passes/ep_overlap.py``). The wait
# takes the start's tensors again so that everything the engine still reads or writes stays alive until then
# (an executor may otherwise reuse a buffer after its last graph use). The token is an int64 tensor ``[code, key]``
# naming the pending operation in a process-local table; each wait pops its entry, so none outlives its pair.

DISPATCH_START_SCHEMA = DISPATCH_SCHEMA.split(" -> ")[0] + " -> Tensor"
DISPATCH_WAIT_SCHEMA = "(Tensor token, " + DISPATCH_SCHEMA[1:]
COMBINE_START_SCHEMA = COMBINE_SCHEMA.split(" -> ")[0] + " -> Tensor"
COMBINE_WAIT_SCHEMA = "(Tensor token, " + COMBINE_SCHEMA[1:]
TOKEN_CODE = 38


@dataclasses.dataclass(frozen=True)
class EpAsync:
    """An engine's start/wait split: each start issues the communication and returns a completion callable
    (``() -> `` what the synchronous op returns), which the wait op calls."""

    dispatch_start: Callable[..., Callable[[], Any]]
    """``(x, ids, w, E, group_name, layout, capacity, timeout_s) -> complete``."""
    combine_start: Callable[..., Callable[[], Any]]
    """``(y, handle, ids, w, E, group_name, layout, capacity, timeout_s, out_dtype) -> complete``."""
    devices: frozenset[str]
    """Devices where its start returns before the transfer ends (elsewhere the pass keeps the sync ops)."""


_ASYNC: dict[str, EpAsync] = {}
_PENDING: dict[int, Callable[[], Any]] = {}
_BY_PTR: dict[int, int] = {}
_pending_lock = threading.Lock()
_keys = itertools.count(1)


def register_ep_async(name: str, dispatch_start: Callable[..., Callable[[], Any]],
                      combine_start: Callable[..., Callable[[], Any]], devices: tuple[str, ...]) -> EpAsync:
    """Give engine ``name`` an async form (signatures on :class:`EpAsync`)."""
    entry = _ASYNC[name] = EpAsync(dispatch_start, combine_start, frozenset(devices))
    return entry


def ep_async(engine: str, device: str) -> EpAsync | None:
    """The async form of ``engine`` on ``device``, or ``None`` (the sync ops then run, without overlap)."""
    entry = _ASYNC.get(engine)
    return entry if entry is not None and device in entry.devices else None


def pending_async() -> int:
    """Started EP operations not yet waited for (tests check this returns to 0)."""
    with _pending_lock:
        return len(_PENDING)


def _token(device: torch.device, complete: Callable[[], Any]) -> torch.Tensor:
    """A fresh token naming ``complete``: found again by its storage address (no device read), and on the CPU also
    by the key written into it."""
    token = torch.empty(2, dtype=torch.int64, device=device)
    with _pending_lock:
        key = next(_keys)
        _PENDING[key] = complete
        _BY_PTR[token.data_ptr()] = key
    if device.type == "cpu":
        token[0], token[1] = TOKEN_CODE, key
    return token


def _complete(token: torch.Tensor) -> Any:
    with _pending_lock:
        key = _BY_PTR.pop(token.data_ptr(), None)
        if key is None and token.device.type == "cpu" and int(token[0]) == TOKEN_CODE:
            key = int(token[1])
        complete = _PENDING.pop(key, None) if key is not None else None
    if complete is None:
        raise EpError("ep_fuse: an EP wait got a token no start of this process issued (each start is waited "
                      "for once, in the same process)")
    return complete()


def _sync_start(run: Callable[[], Any]) -> Callable[[], Any]:
    """An engine without an async form: run the synchronous op at the start (no overlap, same result)."""
    out = run()
    return lambda: out


def ep_dispatch_start_impl(x, topk_ids, topk_weights, num_experts, group_name, engine, layout, capacity,
                           timeout_s):
    """The kernel of ``ep_fuse::ep_dispatch_start``: the engine's async start, or the sync dispatch."""
    args = (x, topk_ids, topk_weights, num_experts, group_name, layout, capacity, timeout_s)
    entry = _ASYNC.get(engine)
    if entry is not None:
        complete = entry.dispatch_start(*args)
    else:
        complete = _sync_start(lambda: ep_engine(engine).dispatch(*args))
    return _token(x.device, complete)


def ep_dispatch_wait_impl(token, x, topk_ids, topk_weights, num_experts, group_name, engine, layout, capacity,
                          timeout_s):
    """The kernel of ``ep_fuse::ep_dispatch_wait``: what ``ep_dispatch`` returns."""
    return tuple(_complete(token))


def ep_combine_start_impl(y, handle, topk_ids, topk_weights, num_experts, group_name, engine, layout, capacity,
                          timeout_s, out_dtype):
    """The kernel of ``ep_fuse::ep_combine_start``."""
    args = (y, handle, topk_ids, topk_weights, num_experts, group_name, layout, capacity, timeout_s, out_dtype)
    entry = _ASYNC.get(engine)
    if entry is not None:
        complete = entry.combine_start(*args)
    else:
        complete = _sync_start(lambda: ep_engine(engine).combine(*args))
    return _token(y.device, complete)


def ep_combine_wait_impl(token, y, handle, topk_ids, topk_weights, num_experts, group_name, engine, layout,
                         capacity, timeout_s, out_dtype):
    """The kernel of ``ep_fuse::ep_combine_wait``: what ``ep_combine`` returns."""
    return _complete(token)


def _start_fake(x, *_args):
    return x.new_empty(2, dtype=torch.int64)


def _dispatch_wait_fake(token, *args):
    return ep_dispatch_fake(*args)


def _combine_wait_fake(token, *args):
    return ep_combine_fake(*args)


ep_dispatch_start = define_canonical("ep_dispatch_start", DISPATCH_START_SCHEMA, ep_dispatch_start_impl,
                                     fake=_start_fake, traceable=never_traceable, engine=True)
ep_dispatch_wait = define_canonical("ep_dispatch_wait", DISPATCH_WAIT_SCHEMA, ep_dispatch_wait_impl,
                                    fake=_dispatch_wait_fake, traceable=never_traceable, engine=True)
ep_combine_start = define_canonical("ep_combine_start", COMBINE_START_SCHEMA, ep_combine_start_impl,
                                    fake=_start_fake, traceable=never_traceable, engine=True)
ep_combine_wait = define_canonical("ep_combine_wait", COMBINE_WAIT_SCHEMA, ep_combine_wait_impl,
                                   fake=_combine_wait_fake, traceable=never_traceable, engine=True)
for _op in (ep_dispatch_start, ep_dispatch_wait, ep_combine_start, ep_combine_wait):
    torch.fx.node.has_side_effect(_op.op)

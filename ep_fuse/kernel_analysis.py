"""One Triton access analysis per ep_fuse kernel signature while Inductor compiles a rewritten graph.

Inductor learns which arguments an inlined (``wrap_triton``) launch writes by generating the kernel's TTIR
and walking it (``torch._higher_order_ops.triton_kernel_wrap``: ``identify_mutated_tensors`` in torch 2.11,
``identify_accessed_tensors`` later). It does so for every launch site, and more than once per site
(AOT's metadata pass and its trace, Inductor's lowering): 56–112 analyses per graph of the generate
benchmark's models on the GPU, at 50–75 ms each, mostly of the same few kernel signatures -- a large part of
the first-call time ep_fuse added on top of Inductor's (``docs/benchmarks.md``, "First call").

The analysis is a pure function of the kernel and of what TTIR generation reads from the arguments:
tensors become ``torch.empty(2, dtype=...)``, every symbolic size the constant 2, TMA arguments their
descriptor metadata, a plain integer of a non-``constexpr`` parameter only its Triton specialization (its
integer type, whether it is 1, whether 16 divides it), everything else its value.
:func:`memoized_access_analysis` keys on exactly that (integers a little finer, see :func:`_int_class`) and
serves a copy of the first result to later sites, so a graph compiled at another static batch size reuses
the analyses of the first; kernels that are not ep_fuse's JITFunctions (or the
one-config Autotuners ``wrap_triton`` makes of them), and arguments it cannot key (unhashable values), go
to torch's analysis unchanged.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

log = logging.getLogger("ep_fuse")

_ANALYSES = ("identify_accessed_tensors", "identify_mutated_tensors")
_MAX_ENTRIES = 1024


@dataclasses.dataclass
class AnalysisStats:
    computed: int = 0
    served: int = 0
    seconds: float = 0.0
    """Time spent in torch's analysis (the computed ones)."""


_memo: dict[tuple[Any, ...], Any] = {}
"""Memo key (:func:`key_of`) -> the analysis' result."""
stats = AnalysisStats()


class _Unkeyable(Exception):
    pass


def _int_class(value: int) -> tuple[Any, ...]:
    """What Triton's specialization of a non-``constexpr`` integer keeps of it, a little finer: its range
    (``i32``/``i64``/``u64``), whether it is 0 or 1, and whether 8 and 16 divide it. The TTIR holds the value
    itself only as the constant 1; otherwise only these attributes."""
    rng = "i32" if -2**31 <= value < 2**31 else "i64" if -2**63 <= value < 2**63 else "u64"
    return (rng, value == 0, value == 1, value % 8 == 0, value % 16 == 0)


def _arg_key(name: str, value: Any, tma: Any, constexprs: frozenset[str] | None) -> tuple[Any, ...]:
    import sympy

    if tma and name in tma:
        return (name, "tma", repr(tma[name]), str(getattr(value, "dtype", None)))
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool, sympy.Expr)):
        return (name, "sym")  # TTIR generation replaces every symbolic value with 2
    if isinstance(value, torch.Tensor):
        return (name, "tensor", str(value.dtype))  # generated from torch.empty(2, dtype=...)
    if callable(getattr(value, "get_dtype", None)):  # Inductor's TensorBox (its .dtype is not forwarded)
        return (name, "tensor", str(value.get_dtype()))
    if type(value) is int and constexprs is not None and name not in constexprs:
        return (name, "int", _int_class(value))
    try:
        hash(value)
    except TypeError as exc:
        raise _Unkeyable(name) from exc
    return (name, type(value).__name__, value)


def _constexprs(kernel: Any) -> frozenset[str] | None:
    """Names of the kernel's ``constexpr`` parameters (a JITFunction's, or the one inside a one-config
    Autotuner); ``None`` when they cannot be read (every integer is then keyed by value)."""
    for fn in (kernel, getattr(kernel, "fn", None)):
        params = getattr(fn, "params", None)
        if isinstance(params, list) and params and all(hasattr(p, "is_constexpr") for p in params):
            return frozenset(p.name for p in params if p.is_constexpr)
    return None


def _jit_id(kernel: Any) -> tuple[Any, ...] | None:
    src, fn = getattr(kernel, "src", None), getattr(kernel, "fn", None)
    if isinstance(src, str) and hasattr(fn, "__qualname__"):
        return (fn.__module__, fn.__qualname__, hashlib.sha256(src.encode()).hexdigest())
    return None


def _config_id(cfg: Any) -> tuple[Any, ...]:
    return (tuple(sorted((str(k), v) for k, v in cfg.kwargs.items())),
            *(getattr(cfg, a, None) for a in ("num_warps", "num_stages", "num_ctas", "maxnreg")))


def _kernel_id(kernel: Any) -> tuple[Any, ...] | None:
    """A JITFunction by its function's module, name and source. ``wrap_triton`` hands each launch with launch
    options (``num_warps=...``) to the analysis as a fresh one-config Autotuner around the JITFunction, whose
    first config's kwargs enter the TTIR: keyed on the JITFunction and the configs. ``None`` for anything
    else (not memoized)."""
    jit = _jit_id(kernel)
    if jit is not None:
        return jit
    inner, configs = _jit_id(getattr(kernel, "fn", None)), getattr(kernel, "configs", None)
    if inner is not None and isinstance(configs, list | tuple):
        return (*inner, tuple(_config_id(c) for c in configs))
    return None


def key_of(kernel: Any, kwargs: dict[str, Any], tma: Any) -> tuple[Any, ...] | None:
    """The memo key of one analysis, ``None`` when it is not memoized (not an ep_fuse kernel, or an argument
    that cannot be keyed)."""
    kid = _kernel_id(kernel)
    if kid is None or not kid[0].startswith("ep_fuse."):
        return None
    try:
        constexprs = _constexprs(kernel)
        key = (kid, *sorted(_arg_key(n, v, tma, constexprs) for n, v in kwargs.items()))
        hash(key)
    except (_Unkeyable, TypeError):
        return None
    return key


def memoized(analysis: Callable[..., Any]) -> Callable[..., Any]:
    """``analysis`` (torch's, signature ``(kernel, kwargs, tma_descriptor_metadata)``) with the memo."""

    def wrapper(kernel: Any, kwargs: dict[str, Any], *rest: Any, **kw: Any) -> Any:
        tma = rest[0] if rest else kw.get("tma_descriptor_metadata")
        key = key_of(kernel, kwargs, tma)
        if key is not None and key in _memo:
            stats.served += 1
            return copy.deepcopy(_memo[key])
        t0 = time.perf_counter()
        out = analysis(kernel, kwargs, *rest, **kw)
        spent = time.perf_counter() - t0
        stats.seconds += spent
        stats.computed += 1
        log.debug("ep_fuse: Triton access analysis computed in %.3f s (key %s)", spent, key)
        if key is not None:
            if len(_memo) >= _MAX_ENTRIES:
                _memo.clear()
            _memo[key] = copy.deepcopy(out)
        return out

    wrapper.__wrapped__ = analysis  # type: ignore[attr-defined]
    return wrapper


@contextlib.contextmanager
def memoized_access_analysis() -> Iterator[AnalysisStats]:
    """While active, torch's Triton access analysis is memoized for ep_fuse's kernels; yields the counts
    of this block (computed, served from the memo, seconds spent computing)."""
    from torch._higher_order_ops import triton_kernel_wrap as tkw

    before = dataclasses.replace(stats)
    saved = {name: getattr(tkw, name) for name in _ANALYSES if hasattr(tkw, name)}
    for name, fn in saved.items():
        if not hasattr(fn, "__wrapped__"):
            setattr(tkw, name, memoized(fn))
    block = AnalysisStats()
    try:
        yield block
    finally:
        for name, fn in saved.items():
            setattr(tkw, name, fn)
        block.computed = stats.computed - before.computed
        block.served = stats.served - before.served
        block.seconds = stats.seconds - before.seconds

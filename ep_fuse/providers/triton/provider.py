"""The Triton provider's registration machinery: where it runs, and how Inductor inlines its launches.

Each family module (:mod:`~ep_fuse.providers.triton.rms_norm`, ...) calls :func:`register` for its ops with its
kernel, its argument checks and its perf rules; :mod:`ep_fuse.catalog` imports the family modules.

Two ways a lowered call runs:

* as the opaque op ``torch.ops.ep_fuse_triton.<name>`` (eager executor; any call Inductor cannot
  inline), whose kernel re-checks its arguments and falls back to the reference if the launch fails;
* inlined by Inductor: when Inductor's AOT pass functionalizes the op on CUDA tensors with static
  shapes, the launch is traced through ``wrap_triton`` so Inductor emits the kernel call in its own
  generated code (no Python dispatch per call).

With symbolic sizes (``dynamic=True``) the launches of the ops registered ``symbolic=True`` are inlined too
(their host code adds no guard). At unbacked sizes (``ep_fuse.dynamic_batch``) a launch is inlined where its
host code traces without deciding on the size; where it would have to (a data-dependent guard), the call
stays the opaque op. The ``<op>_by_size`` ops of ``gemm_swiglu`` and the grouped GEMMs choose
between kernels and the reference by the real row count (each family's perf rules); Inductor
traces that choice as branches on the row count (:mod:`~ep_fuse.providers.triton.size_branches`), except
where the compile uses CUDA graphs, which keeps the opaque op.

The switches are fields of the config the backend compiles the graph with (read through
:func:`ep_fuse.runtime.active_config`): ``inline_in_inductor`` (inline at all), ``inline_symbolic`` (at symbolic
sizes too) and ``size_branches`` (trace the ``<op>_by_size`` choice); all default to on.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Callable
from typing import Any

import torch

from ep_fuse import runtime
from ep_fuse.ops.registry import CanonicalOp, Check, register_provider
from ep_fuse.providers.triton import size_branches

log = logging.getLogger("ep_fuse.providers")

def _devices() -> frozenset[str]:
    return frozenset({"cuda", "cpu"}) if runtime.triton_interpret() else frozenset({"cuda"})


@functools.lru_cache(maxsize=1)
def _available() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install triton)"
    return None


def _static(args: tuple[Any, ...]) -> bool:
    for a in args:
        if isinstance(a, torch.Tensor):
            if any(not isinstance(v, int) for v in (*a.shape, *a.stride())):
                return False
    return True


# ``inline_symbolic`` (config): inline the launches of the ops registered ``symbolic=True`` at symbolic sizes too
# (``dynamic=True``, and the unbacked batch of ``ep_fuse.dynamic_batch`` where the host code traces without a
# data-dependent guard). Their host code computes grids and arguments as size expressions without specialising
# them (no guard is added: ``tests/test_symbolic_launch.py``), so Inductor's generated code launches them with
# pre-bound arguments at every size, instead of calling the opaque op through the dispatcher and Triton's JIT
# launcher (about 80 µs of host time per call, ``docs/benchmarks.md``).


def _unbacked(args: tuple[Any, ...]) -> bool:
    """Whether a size or stride is an unbacked symbol (``ep_fuse.dynamic_batch``): host code that would have
    to decide on it (a guard) cannot be traced, so the launch is tried and the op kept where it fails."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    return any(free_unbacked_symbols((*a.shape, *a.stride())) for a in args if isinstance(a, torch.Tensor))


def _inline_rule(kernel: Callable[..., Any], supports: Check, inline_ok: Check, symbolic: bool) -> Any:
    def rule(mode: Any, op: Any, types: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        config = runtime.active_config()
        sized_ok = _static(args) or (symbolic and config.inline_symbolic)
        if (not config.inline_in_inductor or runtime.triton_interpret() or args[0].device.type != "cuda" or not sized_ok
                or supports(args) is not None or inline_ok(args) is not None):
            return mode.__torch_dispatch__(op, types, args, kwargs)
        from torch.library import wrap_triton

        try:
            with mode:
                return kernel(*args, wrap=wrap_triton)
        except Exception as exc:  # noqa: BLE001 -- at unbacked sizes the opaque op is always a correct lowering
            if not _unbacked(args):
                raise
            from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

            (log.info if isinstance(exc, GuardOnDataDependentSymNode) else log.warning)(
                "ep_fuse: %s at unbacked sizes stays the opaque op: its launch could not be traced (%s: %s)",
                op, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return mode.__torch_dispatch__(op, types, args, kwargs)

    return rule


def _cudagraphs_requested() -> bool:
    """Whether the compile running now asks for CUDA graphs (``mode="reduce-overhead"``): Inductor runs a graph
    holding ``torch.cond`` without them."""
    import torch._inductor.config as inductor_config

    return bool(inductor_config.triton.cudagraphs)


def _size_branches_ok(args: tuple[Any, ...]) -> str | None:
    """``inline_ok`` of the ``<op>_by_size`` ops: their choice is traced unless CUDA graphs are requested or the
    config's ``size_branches`` is off (``EP_FUSE_SIZE_BRANCHES=0``: keep the opaque ``<op>_by_size`` op, which
    makes the choice per call in Python; at static sizes the branches are the one branch those sizes take)."""
    if _cudagraphs_requested():
        return "CUDA graphs requested: Inductor would drop them for a graph holding torch.cond"
    return None if runtime.active_config().size_branches else "size_branches=False"


def always(args: tuple[Any, ...]) -> str | None:
    """An ``inline_ok`` rule that never objects."""
    return None


def register(canon: CanonicalOp, kernel: Callable[..., Any], *, supports: Check,
             prefers: Callable[[tuple[Any, ...], str], Any] | None = None, inline_ok: Check = always,
             run_time: Check | None = None, symbolic: bool = False,
             branches: size_branches.Branches | None = None) -> None:
    """Register ``kernel`` as the Triton provider of ``canon``.

    Args:
        supports: ``args -> None`` when the kernel takes the call, else why not.
        prefers: the family's perf rule ``(args, executor) -> None | reason | AtRunTime``.
        inline_ok: ``args -> None`` when Inductor may inline the launch (``wrap_triton``), else why not.
        run_time: the per-call rule of the ``<op>_by_size`` op (a size-dependent choice).
        symbolic: the launch's host code adds no guard at symbolic sizes, so it is inlined there too.
        branches: the ``<op>_by_size`` choice as row-count branches (:mod:`~ep_fuse.providers.triton.size_branches`),
            traced at symbolic sizes instead of the opaque op.
    """
    prov = register_provider(canon, "triton", kernel, devices=_devices, available=_available,
                             supports=supports, prefers=prefers, run_time=run_time)
    from torch._subclasses.functional_tensor import FunctionalTensorMode  # private torch module: asked at use

    torch.library.register_torch_dispatch(prov.op, FunctionalTensorMode,
                                          _inline_rule(kernel, supports, inline_ok, symbolic))
    if symbolic:
        SYMBOLIC_INLINE[canon.name] = kernel
    if prov.by_size is not None and branches is not None:
        size_branches.BRANCHES[canon.name] = branches

        def launch(*args: Any, wrap: Any = None) -> Any:
            return size_branches.run_by_size(canon.name, args, wrap)

        torch.library.register_torch_dispatch(
            prov.by_size, FunctionalTensorMode, _inline_rule(launch, supports, _size_branches_ok, symbolic=True))


SYMBOLIC_INLINE: dict[str, Callable[..., Any]] = {}
"""Canonical op name -> the kernel whose launch is inlined at symbolic sizes (checked guard-free on CPU)."""



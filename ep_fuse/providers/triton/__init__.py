"""Triton provider: CUDA GPUs, or the CPU under ``TRITON_INTERPRET=1`` (set before the first launch).

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
between kernels and the reference by the real row count (:mod:`ep_fuse.providers.triton.perf`); Inductor
traces that choice as branches on the row count (:mod:`~ep_fuse.providers.triton.size_branches`), except
where the compile uses CUDA graphs, which keeps the opaque op.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from ep_fuse.ops import canonical
from ep_fuse.ops.registry import CanonicalOp, Check, register_provider, triton_interpret
from ep_fuse.providers.common import check_norm_call
from ep_fuse.providers.triton import perf
from ep_fuse.providers.triton.gemm_swiglu import (
    check_gemm_swiglu_call,
    gemm_swiglu_kernel,
)
from ep_fuse.providers.triton.grouped_gemm import (
    check_grouped_gemm_call,
    check_grouped_gemm_swiglu_call,
    grouped_gemm_kernel,
    grouped_gemm_swiglu_kernel,
)
from ep_fuse.providers.triton.moe_permute import (
    check_moe_permute_call,
    check_moe_unpermute_call,
    moe_permute_kernel,
    moe_unpermute_kernel,
)
from ep_fuse.providers.triton.rms_norm import add_rms_norm_kernel, rms_norm_kernel
from ep_fuse.providers.triton.rope import (
    check_rope_cache_call,
    check_rope_call,
    rope_cache_kernel,
    rope_kernel,
    rope_qk_cache_kernel,
    rope_qk_kernel,
)

log = logging.getLogger("ep_fuse.providers")

INLINE_IN_INDUCTOR = True
"""Let Inductor inline the Triton launches (set False to keep the opaque op everywhere)."""


def _devices() -> frozenset[str]:
    return frozenset({"cuda", "cpu"}) if triton_interpret() else frozenset({"cuda"})


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


INLINE_SYMBOLIC = True
"""Inline the launches of the ops registered ``symbolic=True`` at symbolic sizes too (``dynamic=True``, and the
unbacked batch of ``ep_fuse.dynamic_batch`` where the host code traces without a data-dependent guard).

Their host code computes grids and arguments as size expressions without specialising them (no guard is
added: ``tests/test_symbolic_launch.py``), so Inductor's generated code launches them with pre-bound
arguments at every size, instead of calling the opaque op through the dispatcher and Triton's JIT launcher
(about 80 µs of host time per call measured on H200, ``docs/benchmarks.md``)."""


def _unbacked(args: tuple[Any, ...]) -> bool:
    """Whether a size or stride is an unbacked symbol (``ep_fuse.dynamic_batch``): host code that would have
    to decide on it (a guard) cannot be traced, so the launch is tried and the op kept where it fails."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    return any(free_unbacked_symbols((*a.shape, *a.stride())) for a in args if isinstance(a, torch.Tensor))


def _inline_rule(kernel: Callable[..., Any], supports: Check, inline_ok: Check, symbolic: bool) -> Any:
    def rule(mode: Any, op: Any, types: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        sized_ok = _static(args) or (symbolic and INLINE_SYMBOLIC)
        if (not INLINE_IN_INDUCTOR or triton_interpret() or args[0].device.type != "cuda" or not sized_ok
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


INLINE_SIZE_BRANCHES = os.environ.get("EP_FUSE_SIZE_BRANCHES", "1") != "0"
"""Trace the ``<op>_by_size`` choice as ``torch.cond`` branches at symbolic sizes (False, or
``EP_FUSE_SIZE_BRANCHES=0`` at import: keep the opaque ``<op>_by_size`` op, which makes the choice per call in
Python)."""


def _cudagraphs_requested() -> bool:
    """Whether the compile running now asks for CUDA graphs (``mode="reduce-overhead"``): Inductor runs a graph
    holding ``torch.cond`` without them."""
    import torch._inductor.config as inductor_config

    return bool(inductor_config.triton.cudagraphs)


def _size_branches_ok(args: tuple[Any, ...]) -> str | None:
    """``inline_ok`` of the ``<op>_by_size`` ops: their choice is traced unless CUDA graphs are requested or the
    switch is off (at static sizes it is the one branch those sizes take)."""
    if _cudagraphs_requested():
        return "CUDA graphs requested: Inductor would drop them for a graph holding torch.cond"
    return None if INLINE_SIZE_BRANCHES else "EP_FUSE_SIZE_BRANCHES=0"


def _size_branches(name: str) -> Callable[..., Any]:
    def launch(*args: Any, wrap: Any = None) -> Any:
        from ep_fuse.providers.triton.size_branches import run_by_size

        return run_by_size(name, args, wrap)

    return launch


def _register(canon: CanonicalOp, kernel: Callable[..., Any], supports: Check, prefers: Check | None,
              inline_ok: Check, run_time: Check | None = None, symbolic: bool = False) -> None:
    prov = register_provider(canon, "triton", kernel, devices=_devices, available=_available,
                             supports=supports, prefers=prefers, run_time=run_time)
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    torch.library.register_torch_dispatch(prov.op, FunctionalTensorMode,
                                          _inline_rule(kernel, supports, inline_ok, symbolic))
    if symbolic:
        SYMBOLIC_INLINE[canon.name] = kernel
    if prov.by_size is not None:
        from ep_fuse.providers.triton.size_branches import BRANCHES

        if canon.name in BRANCHES:
            torch.library.register_torch_dispatch(
                prov.by_size, FunctionalTensorMode,
                _inline_rule(_size_branches(canon.name), supports, _size_branches_ok, symbolic=True))


SYMBOLIC_INLINE: dict[str, Callable[..., Any]] = {}
"""Canonical op name -> the kernel whose launch is inlined at symbolic sizes (checked guard-free on CPU)."""


def _eps_is_literal(args: tuple[Any, ...]) -> str | None:
    # a tensor eps (dynamic shapes) is read on the host, which a traced launch cannot do
    return "eps is a tensor" if args[-4] is not None else None


def _always(args: tuple[Any, ...]) -> str | None:
    return None


_register(canonical.rms_norm, rms_norm_kernel, check_norm_call, perf.rms_norm_prefers, _eps_is_literal, symbolic=True)
_register(canonical.add_rms_norm, add_rms_norm_kernel, check_norm_call, perf.add_rms_norm_prefers, _eps_is_literal,
          symbolic=True)
_register(canonical.rope, rope_kernel, check_rope_call, perf.rope_prefers, _always, symbolic=True)
_register(canonical.rope_qk, rope_qk_kernel, check_rope_call, perf.rope_prefers, _always, symbolic=True)
_register(canonical.rope_cache, rope_cache_kernel, check_rope_cache_call, perf.rope_cache_prefers, _always,
          symbolic=True)
_register(canonical.rope_qk_cache, rope_qk_cache_kernel, check_rope_cache_call, perf.rope_cache_prefers, _always,
          symbolic=True)
_register(canonical.gemm_swiglu, gemm_swiglu_kernel, check_gemm_swiglu_call, perf.gemm_swiglu_prefers, _always,
          perf.gemm_swiglu_at_run_time)
_register(canonical.grouped_gemm, grouped_gemm_kernel, check_grouped_gemm_call, perf.grouped_gemm_prefers, _always,
          perf.grouped_gemm_at_run_time)
_register(canonical.grouped_gemm_swiglu, grouped_gemm_swiglu_kernel, check_grouped_gemm_swiglu_call,
          perf.grouped_gemm_swiglu_prefers, _always, perf.grouped_gemm_swiglu_at_run_time)
_register(canonical.moe_permute, moe_permute_kernel, check_moe_permute_call, None, _always, symbolic=True)
_register(canonical.moe_unpermute, moe_unpermute_kernel, check_moe_unpermute_call, None, _always, symbolic=True)

from ep_fuse.providers.triton.router import check_gating_call, moe_gating_kernel  # noqa: E402

_register(canonical.moe_gating, moe_gating_kernel, check_gating_call, perf.gating_prefers, _always, symbolic=True)

# --------------------------------------------------------------------------- W8A8 int8 experts (quant="w8a8_int8")
from ep_fuse.ops import quant_ops as _quant_ops  # noqa: E402
from ep_fuse.providers.triton.w8a8 import (  # noqa: E402
    check_quant_call,
    check_w8a8_gemm_call,
    check_w8a8_swiglu_call,
    grouped_gemm_w8a8_kernel,
    grouped_gemm_w8a8_swiglu_quant_kernel,
    quant_per_token_kernel,
)

_register(_quant_ops.quant_per_token, quant_per_token_kernel, check_quant_call, None, _always)
_register(_quant_ops.grouped_gemm_w8a8_swiglu_quant, grouped_gemm_w8a8_swiglu_quant_kernel, check_w8a8_swiglu_call,
          None, _always)
_register(_quant_ops.grouped_gemm_w8a8, grouped_gemm_w8a8_kernel, check_w8a8_gemm_call, None, _always)

# --------------------------------------------------------------------------- FP8 block-scaled experts (quant="fp8_block")
from ep_fuse.ops import fp8_ops as _fp8_ops  # noqa: E402
from ep_fuse.providers.triton.fp8 import (  # noqa: E402
    check_fp8_gemm_call,
    check_fp8_swiglu_call,
    check_permute_fp8_call,
    check_quant_fp8_call,
    grouped_gemm_fp8_kernel,
    grouped_gemm_fp8_swiglu_quant_kernel,
    moe_permute_fp8_kernel,
    quant_fp8_group_kernel,
)

# declined on CUDA unless EP_FUSE_UNVERIFIED_KERNELS=1 (not yet verified on a GPU): see providers/triton/fp8.py
_register(_fp8_ops.quant_fp8_group, quant_fp8_group_kernel, check_quant_fp8_call, None, _always)
_register(_fp8_ops.moe_permute_fp8, moe_permute_fp8_kernel, check_permute_fp8_call, None, _always)
_register(_fp8_ops.grouped_gemm_fp8_swiglu_quant, grouped_gemm_fp8_swiglu_quant_kernel, check_fp8_swiglu_call,
          None, _always)
_register(_fp8_ops.grouped_gemm_fp8, grouped_gemm_fp8_kernel, check_fp8_gemm_call, None, _always)

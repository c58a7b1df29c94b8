"""The Triton provider of the RMSNorm family (``rms_norm``, ``add_rms_norm``): host code, perf rules, registration.

The same host code serves the opaque provider op (eager executor, or Inductor calling the op) and,
with ``wrap_triton``, the traced form Inductor inlines into its own generated code.

Perf rules (under Inductor; the eager executor's baseline, the unfused ATen ops, is slower at every size):

* ``add_rms_norm``: faster from :data:`LARGE_BATCH_ROWS` rows, and below :data:`SMALL_BATCH_ROWS` rows of rows at
  least :data:`WIDE_ROW` wide; in between Inductor's fused kernel measured as fast. With a symbolic row count the
  kernel is used: the only run-time alternative, the unfused ATen ops, is slower than the kernel at every size.
* ``rms_norm`` (no residual): Inductor's kernel measured as fast or faster at every size, so the provider always
  declines it under Inductor. It is still used by the eager executor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ep_fuse.ops import rms_norm as ops
from ep_fuse.ops.rms_norm import (ROUNDED_RSTD, base_mode, host_eps, norm_input_dtype, rms_norm_out_dtype,
                                  unpack_norm_args)
from ep_fuse.providers.measured import Threshold
from ep_fuse.providers.rms_norm import check_norm_call
from ep_fuse.providers.tensor_checks import row_stride, static_rows
from ep_fuse.providers.triton.provider import register
from ep_fuse.providers.triton.unverified import gpu_unverified
from ep_fuse.symbolic import concrete_int


def _run(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
    mode: str,
    upcast: bool,
    out_dtype: torch.dtype | None,
    wrap: Callable[[Any], Any] | None,
    norm_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    from ep_fuse.providers.triton.rms_norm_kernel import launch  # imports triton: on first launch

    y_dtype = rms_norm_out_dtype(x, weight, mode, upcast, out_dtype, in_dtype=norm_dtype)
    y = torch.empty(x.shape, dtype=y_dtype, device=x.device)
    s = None
    if residual is not None:  # the sum in the operands' promoted dtype, as ``x + residual``
        s = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    sx = row_stride(x)
    sr = row_stride(residual) if residual is not None else 0
    assert sx is not None and sr is not None, "checked by the provider's supports()"
    # a ``_pow`` mode's ``pow(·, -0.5)`` is the kernel's ``rsqrt`` (fp32, a few ulp apart)
    launch(x, residual, weight, y, s, eps, base_mode(mode), out_dtype, sx, sr, wrap=wrap, norm_dtype=norm_dtype)
    return y, s


def rms_norm_kernel(x, weight, eps, eps_t, mode, upcast, out_dtype, wrap=None):  # noqa: ANN001, ANN201
    """``ep_fuse_triton::rms_norm`` (canonical schema)."""
    return _run(x, None, weight, host_eps(eps, eps_t), mode, upcast, out_dtype, wrap)[0]


def add_rms_norm_kernel(x, residual, weight, eps, eps_t, mode, upcast, out_dtype, norm_dtype=None,  # noqa: ANN001
                        wrap=None):  # noqa: ANN001, ANN201
    """``ep_fuse_triton::add_rms_norm`` (canonical schema)."""
    return _run(x, residual, weight, host_eps(eps, eps_t), mode, upcast, out_dtype, wrap, norm_dtype)


LARGE_BATCH_ROWS = Threshold(
    4096, command="python bench/bench_rms_norm.py",
    evidence="add_rms_norm vs Inductor: 1.03x at 16384x7168, 1.01x at 16384x4096 and 4096x7168, 1.02x at 4096x2048; "
             "0.91x at 512x7168, 0.94x at 64x4096")
SMALL_BATCH_ROWS = Threshold(128, command="python bench/bench_rms_norm.py",
                             evidence="add_rms_norm vs Inductor: 1.17x at 64x7168, 1.29x at 1x7168")
WIDE_ROW = Threshold(7168, command="python bench/bench_rms_norm.py",
                     evidence="small batches win only on rows at least this wide (0.94x at 64x4096)")


def add_rms_norm_prefers(args: tuple[Any, ...], executor: str) -> str | None:
    if executor != "inductor":
        return None
    x, _res, _rest = unpack_norm_args(args)
    rows, width = static_rows(x), concrete_int(x.shape[-1])
    if rows is None or width is None or rows >= LARGE_BATCH_ROWS:
        return None
    if rows < SMALL_BATCH_ROWS and width >= WIDE_ROW:
        return None
    return f"{rows}x{width}: Inductor's fused kernel measured as fast at this size"


def rms_norm_prefers(args: tuple[Any, ...], executor: str) -> str | None:
    if executor != "inductor":
        return None
    return "plain RMSNorm: Inductor's fused kernel measured as fast or faster"


def _eps_is_literal(args: tuple[Any, ...]) -> str | None:
    # a tensor eps (dynamic shapes) is read on the host, which a traced launch cannot do
    return "eps is a tensor" if unpack_norm_args(args)[2][2] is not None else None


def rounded_variant(args: tuple[Any, ...]) -> str | None:
    """The ``unverified.py`` name of a call's rounded form: ``<op>:none_rstd_cast`` or ``add_rms_norm:norm_dtype``."""
    _x, residual, rest = unpack_norm_args(args)
    op = "add_rms_norm" if residual is not None else "rms_norm"
    if rest[3] in ROUNDED_RSTD:
        return f"{op}:{rest[3]}"
    return "add_rms_norm:norm_dtype" if norm_input_dtype(args) is not None else None


def supports(args: tuple[Any, ...]) -> str | None:
    """:func:`check_norm_call`, and the rounded forms only where cleared for the device (``unverified.py``)."""
    variant = rounded_variant(args)
    return check_norm_call(args) or (gpu_unverified(variant, args[0]) if variant else None)


register(ops.rms_norm, rms_norm_kernel, supports=supports, prefers=rms_norm_prefers,
         inline_ok=_eps_is_literal, symbolic=True)
register(ops.add_rms_norm, add_rms_norm_kernel, supports=supports, prefers=add_rms_norm_prefers,
         inline_ok=_eps_is_literal, symbolic=True)

"""What every fused RMSNorm kernel takes (the Triton and the Ascend provider share these limits)."""

from __future__ import annotations

from typing import Any

import torch

from ep_fuse.ops.rms_norm import RMS_NORM_MODES, ROUNDED_RSTD, norm_input_dtype, unpack_norm_args
from ep_fuse.providers.tensor_checks import KERNEL_DTYPES, contiguous, row_stride
from ep_fuse.symbolic import same_shape


def check_norm_call(args: tuple[Any, ...]) -> str | None:
    """Structural limits every fused RMSNorm kernel shares (contiguous rows, fp32 statistics). Whether a kernel takes
    the rounded forms (mode ``none_rstd_cast``, ``add_rms_norm``'s ``norm_dtype``) is each provider's own check."""
    x, residual, (weight, _eps, eps_t, mode, upcast, out_dtype) = unpack_norm_args(args)
    norm_dtype = norm_input_dtype(args)
    if mode not in RMS_NORM_MODES:
        return f"unknown mode {mode!r}"
    if x.dtype not in KERNEL_DTYPES:
        return f"input dtype {x.dtype} is not one of fp16/bf16/fp32"
    if norm_dtype is not None and norm_dtype not in KERNEL_DTYPES:
        return f"norm input dtype {norm_dtype} is not one of fp16/bf16/fp32"
    if not upcast and (norm_dtype or x.dtype) != torch.float32:
        return f"statistics in {norm_dtype or x.dtype} (no upcast); fused kernels compute them in fp32"
    if x.dim() == 0:
        return "0-d input"
    if row_stride(x) is None:
        return "input rows are not unit-stride rows with one row stride"
    if residual is not None:
        if not same_shape(residual.shape, x.shape):
            return "residual differs from the input in shape"
        if residual.dtype != x.dtype and (norm_dtype is None or residual.dtype not in KERNEL_DTYPES):
            return "residual differs from the input in dtype (the norm does not read a rounding of the sum)"
        if row_stride(residual) is None:
            return "residual rows are not unit-stride rows with one row stride"
    if weight is not None:
        if weight.dtype not in KERNEL_DTYPES:
            return f"weight dtype {weight.dtype} is not one of fp16/bf16/fp32"
        if weight.dim() != 1 or not contiguous(weight):
            return "weight is not a contiguous vector"
    if out_dtype is not None and out_dtype not in KERNEL_DTYPES:
        return f"output dtype {out_dtype} is not one of fp16/bf16/fp32"
    if mode in ROUNDED_RSTD and out_dtype is None:
        return f"mode {mode!r} without the dtype its statistic is rounded to"
    if eps_t is not None and eps_t.dim() != 0:
        return "eps tensor is not 0-d"
    return None

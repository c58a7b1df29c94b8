"""Argument checks shared by providers of the RMSNorm ops."""

from __future__ import annotations

from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from ep_fuse.ops.reference import RMS_NORM_MODES
from ep_fuse.symbolic import same_shape

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def contiguous(t: torch.Tensor) -> bool:
    try:
        return bool(t.is_contiguous())
    except Exception:  # symbolic strides that cannot be decided
        return False


def host_eps(eps: float, eps_t: torch.Tensor | None) -> float:
    """The eps value; a dynamic-shape eps arrives as a 0-d CPU tensor, whose read does not sync a device."""
    return float(eps_t.item()) if eps_t is not None else float(eps)


def row_stride(t: torch.Tensor) -> int | None:
    """Stride between rows when ``t`` is a stack of unit-stride rows over its last dim, else ``None``.

    Contiguous tensors and row slices (``split`` of a wider projection) qualify; their reference
    outputs are contiguous, which is what the kernels write.
    """
    if not all(is_concrete_int(v) for v in (*t.shape, *t.stride())):
        # symbolic sizes: only plain contiguity is decided (int() would specialize the shape)
        return int(t.shape[-1]) if is_concrete_int(t.shape[-1]) and contiguous(t) else None
    shape, strides = [int(s) for s in t.shape], [int(s) for s in t.stride()]
    if len(shape) == 0:
        return None
    if shape[-1] > 1 and strides[-1] != 1:
        return None
    # rows are every index of the leading dims; size-1 dims place nothing (their stride is arbitrary)
    lead = [(n, st) for n, st in zip(shape[:-1], strides[:-1]) if n > 1]
    if not lead:
        return shape[-1]  # a single row
    rs = lead[-1][1]
    expect = rs
    for n, st in reversed(lead):
        if st != expect:
            return None
        expect = st * n
    if rs < shape[-1]:
        return None
    if rs != shape[-1] and not contiguous(t) and _dense(shape, strides):
        return None  # a permuted dense tensor: the reference keeps its layout
    return rs


def _dense(shape: list[int], strides: list[int]) -> bool:
    numel = 1
    for n in shape:
        numel *= n
    span = 1 + sum((n - 1) * s for n, s in zip(shape, strides) if n > 0)
    return span == numel


def rows_2d(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a ``[rows, N]`` view (``row_stride(t)`` must not be ``None``)."""
    n = t.shape[-1]
    rs = row_stride(t)
    assert rs is not None
    return t.as_strided((t.numel() // max(n, 1), n), (rs, 1))


def unpack_norm_args(args: tuple[Any, ...]) -> tuple[torch.Tensor, torch.Tensor | None, tuple[Any, ...]]:
    """Split ``(x[, residual], weight, eps, eps_t, mode, upcast, out_dtype)``."""
    if len(args) == 8:
        return args[0], args[1], args[2:]
    return args[0], None, args[1:]


def rms_norm_out_dtype(
    x: torch.Tensor, weight: torch.Tensor | None, mode: str, upcast: bool, out_dtype: torch.dtype | None
) -> torch.dtype:
    """Output dtype of ``rms_norm_ref`` (type promotion of its last op)."""
    stat = torch.float32 if upcast else x.dtype
    if mode == "llama":
        assert weight is not None and out_dtype is not None
        return torch.promote_types(weight.dtype, out_dtype)
    if out_dtype is not None:
        return out_dtype
    if mode == "weight_fp32":
        assert weight is not None
        return torch.promote_types(weight.dtype, stat)
    if mode == "gemma":
        return torch.promote_types(stat, torch.float32)
    return stat


def check_norm_call(args: tuple[Any, ...]) -> str | None:
    """Structural limits every fused RMSNorm kernel shares (contiguous rows, fp32 statistics)."""
    x, residual, (weight, _eps, eps_t, mode, upcast, out_dtype) = unpack_norm_args(args)
    if mode not in RMS_NORM_MODES:
        return f"unknown mode {mode!r}"
    if x.dtype not in KERNEL_DTYPES:
        return f"input dtype {x.dtype} is not one of fp16/bf16/fp32"
    if not upcast and x.dtype != torch.float32:
        return f"statistics in {x.dtype} (no upcast); fused kernels compute them in fp32"
    if x.dim() == 0:
        return "0-d input"
    if row_stride(x) is None:
        return "input rows are not unit-stride rows with one row stride"
    if residual is not None:
        if residual.dtype != x.dtype or not same_shape(residual.shape, x.shape):
            return "residual differs from the input in dtype or shape"
        if row_stride(residual) is None:
            return "residual rows are not unit-stride rows with one row stride"
    if weight is not None:
        if weight.dtype not in KERNEL_DTYPES:
            return f"weight dtype {weight.dtype} is not one of fp16/bf16/fp32"
        if weight.dim() != 1 or not contiguous(weight):
            return "weight is not a contiguous vector"
    if out_dtype is not None and out_dtype not in KERNEL_DTYPES:
        return f"output dtype {out_dtype} is not one of fp16/bf16/fp32"
    if eps_t is not None and eps_t.dim() != 0:
        return "eps tensor is not 0-d"
    return None

"""Tensor-layout checks shared by every provider: kernel dtypes, unit-stride rows, static row counts."""

from __future__ import annotations

from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import is_concrete_int


KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def contiguous(t: torch.Tensor) -> bool:
    try:
        return bool(t.is_contiguous())
    except Exception:  # symbolic strides that cannot be decided
        return False


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


def static_rows(x: Any) -> int | None:
    """Row count of ``x`` over its last dim, or ``None`` when it is symbolic (no guard is added)."""
    n, width = x.numel(), x.shape[-1]
    if not (is_concrete_int(n) and is_concrete_int(width)):
        return None
    return int(n) // max(int(width), 1)

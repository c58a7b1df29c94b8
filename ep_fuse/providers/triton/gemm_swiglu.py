"""Host side of the Triton GEMM + SwiGLU provider."""

from __future__ import annotations

from typing import Any

import torch

from ep_fuse.providers.common import KERNEL_DTYPES, row_stride


def check_gemm_swiglu_call(args: tuple[Any, ...]) -> str | None:
    x, wg, wu = args
    if x.dtype not in KERNEL_DTYPES or wg.dtype != x.dtype or wu.dtype != x.dtype:
        return f"dtypes {x.dtype}/{wg.dtype}/{wu.dtype} (the kernel takes one of fp16/bf16/fp32 for all)"
    if x.dim() < 1 or wg.dim() != 2 or wu.shape != wg.shape:
        return "weights are not two [I, H] matrices of one shape"
    if row_stride(x) is None:
        return "input rows are not unit-stride rows with one row stride"
    if any(w.shape[-1] > 1 and w.stride(-1) != 1 for w in (wg, wu)):
        return "weight rows are not unit-stride (the kernel walks K contiguously)"
    return None


def gemm_swiglu_kernel(x, w_gate, w_up, wrap=None):  # noqa: ANN001, ANN201 - schema-typed
    """``ep_fuse_triton::gemm_swiglu``."""
    from ep_fuse.providers.triton.gemm_swiglu_kernel import launch

    h = x.shape[-1]
    rs = row_stride(x)
    assert rs is not None
    x2 = x.as_strided((x.numel() // max(h, 1), h), (rs, 1)) if x.dim() != 2 else x
    y = torch.empty((*x.shape[:-1], w_gate.shape[0]), dtype=x.dtype, device=x.device)
    launch(x2, w_gate, w_up, y.view(-1, w_gate.shape[0]), wrap=wrap)
    return y

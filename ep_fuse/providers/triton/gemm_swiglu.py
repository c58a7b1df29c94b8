"""Host side of the Triton GEMM + SwiGLU provider.

Two kernels behind ``gemm_swiglu``, chosen per call from static sizes (:func:`dense_variant`): the
one-tile-per-program kernel (:mod:`~ep_fuse.providers.triton.gemm_swiglu_kernel`, swapped decode tiles), and
from :data:`~ep_fuse.providers.triton.perf.GEMM_SWIGLU_TMA_MIN_ROWS` rows the Hopper TMA persistent kernel of
the grouped GEMMs run as one expert (:func:`~ep_fuse.providers.triton.grouped_gemm_tma_kernel.launch_gemm_swiglu_tma`,
the gate and up weights read in place)."""

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


def dense_variant(x2: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, traced: bool = False) -> str:
    """``"tma"`` or ``"default"``: the kernel that runs ``x2 [M, H]`` (static sizes)."""
    from ep_fuse.providers.triton.grouped_gemm_tma_kernel import dense_tma_unsupported
    from ep_fuse.providers.triton.perf import GEMM_SWIGLU_TMA_MIN_ROWS

    if x2.shape[0] < GEMM_SWIGLU_TMA_MIN_ROWS or w_gate.shape[0] == 0:  # the threshold is >= 1 row
        return "default"
    return "default" if dense_tma_unsupported(x2, w_gate, w_up, traced) else "tma"


def run_dense(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, wrap: Any = None,
              variant: str | None = None, config: Any = None) -> torch.Tensor:
    """Allocate the output and launch the GEMM + SwiGLU on ``x``'s rows: ``variant`` (``None``:
    :func:`dense_variant` chooses from static sizes) with tile ``config`` (``None``: that kernel's own)."""
    h = x.shape[-1]
    rs = row_stride(x)
    assert rs is not None  # checked by check_gemm_swiglu_call
    x2 = x.as_strided((x.numel() // max(h, 1), h), (rs, 1)) if x.dim() != 2 else x
    y = torch.empty((*x.shape[:-1], w_gate.shape[0]), dtype=x.dtype, device=x.device)
    if (variant or dense_variant(x2, w_gate, w_up, traced=wrap is not None)) == "tma":
        from ep_fuse.providers.triton.grouped_gemm_tma_kernel import launch_gemm_swiglu_tma as launch
    else:
        from ep_fuse.providers.triton.gemm_swiglu_kernel import launch
    launch(x2, w_gate, w_up, y.view(-1, w_gate.shape[0]), config=config, wrap=wrap)
    return y


def gemm_swiglu_kernel(x, w_gate, w_up, wrap=None):  # noqa: ANN001, ANN201 - schema-typed
    """``ep_fuse_triton::gemm_swiglu``."""
    return run_dense(x, w_gate, w_up, wrap)

"""Host side of the Triton W8A8 providers: ``quant_per_token``, ``grouped_gemm_w8a8_swiglu_quant``,
``grouped_gemm_w8a8`` (kernels in :mod:`ep_fuse.providers.triton.w8a8_kernel`).

No tensor value is read on the host, so the launches are CUDA-graph capturable and Inductor may
trace them through ``wrap_triton``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ep_fuse.ops import w8a8 as ops
from ep_fuse.providers.tensor_checks import KERNEL_DTYPES
from ep_fuse.providers.triton.grouped_gemm import expert_weight_limits, quantized_operand_checks, unit_last
from ep_fuse.providers.triton.provider import register
from ep_fuse.symbolic import same_shape, sym_eq


def check_quant_call(args: tuple[Any, ...]) -> str | None:
    """``None`` when the kernel runs ``quant_per_token(x [M, K])``, else why not."""
    (x,) = args
    if x.dtype not in KERNEL_DTYPES:
        return f"x dtype {x.dtype} (the kernel takes fp16/bf16/fp32)"
    if x.dim() != 2:
        return f"x is {x.dim()}-D, not [M, K]"
    if not unit_last(x):
        return "x is not unit-stride along K"
    return None


def check_w8a8_gemm_call(args: tuple[Any, ...], swiglu: bool = False) -> str | None:
    """``None`` when the int8 grouped GEMM kernel runs ``(xq, x_scale, w_q, w_scale, seg_indptr, ...)``."""
    xq, xs, wq, ws, seg = args[:5]
    if xq.dtype != torch.int8 or wq.dtype != torch.int8:
        return f"codes {xq.dtype}/{wq.dtype} are not int8"
    if xs.dtype != torch.float32 or ws.dtype != torch.float32:
        return f"scales {xs.dtype}/{ws.dtype} are not fp32"
    if xq.dim() != 2 or wq.dim() != 3 or not sym_eq(wq.shape[2], xq.shape[1]):
        return f"shapes xq {tuple(xq.shape)} / w_q {tuple(wq.shape)} are not [M, K] / [E, N, K]"
    if not same_shape(xs.shape, [xq.shape[0]]) or not same_shape(ws.shape, wq.shape[:2]):
        return "scales are not x_scale [M] / w_scale [E, N]"
    why = quantized_operand_checks(xq, xs, wq, ws, seg, swiglu, None if swiglu else args[5])
    if why:
        return why
    return expert_weight_limits(wq)


def check_w8a8_swiglu_call(args: tuple[Any, ...]) -> str | None:
    return check_w8a8_gemm_call(args, swiglu=True)


def quant_per_token_kernel(x, wrap=None):
    """``ep_fuse_triton::quant_per_token``."""
    from ep_fuse.providers.triton.w8a8_kernel import launch_quant_rows  # imports triton: on first launch

    q = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    s = torch.empty(x.shape[:1], dtype=torch.float32, device=x.device)
    if x.shape[0]:
        if x.shape[1] == 0:
            return q, s.zero_()
        launch_quant_rows(x, q, s, wrap=wrap)
    return q, s


def _gemm(xq, xs, wq, ws, seg, n: int, dtype: torch.dtype, swiglu: bool,
          wrap: Callable[[Any], Any] | None) -> torch.Tensor:
    from ep_fuse.providers.triton.w8a8_kernel import launch_w8a8_gemm  # imports triton: on first launch

    y = torch.empty((xq.shape[0], n), dtype=dtype, device=xq.device)
    if xq.shape[0] == 0 or n == 0:
        return y
    if wq.shape[0] == 0 or xq.shape[1] == 0:  # no experts (every row is tail) or an empty K
        return y.zero_()
    launch_w8a8_gemm(xq, xs, wq, ws, seg, y, swiglu=swiglu, wrap=wrap)
    return y


def grouped_gemm_w8a8_swiglu_quant_kernel(xq, x_scale, w13_q, w13_scale, seg_indptr, wrap=None):
    """``ep_fuse_triton::grouped_gemm_w8a8_swiglu_quant``: int8 GEMM + dequant + SwiGLU (fp32 rows), then requant."""
    act = _gemm(xq, x_scale, w13_q, w13_scale, seg_indptr, w13_q.shape[1] // 2, torch.float32, True, wrap)
    return quant_per_token_kernel(act, wrap=wrap)


def grouped_gemm_w8a8_kernel(xq, x_scale, w_q, w_scale, seg_indptr, out_dtype, wrap=None):
    """``ep_fuse_triton::grouped_gemm_w8a8``: int8 GEMM with the per-token x per-channel dequant epilogue."""
    return _gemm(xq, x_scale, w_q, w_scale, seg_indptr, w_q.shape[1], out_dtype, False, wrap)


register(ops.quant_per_token, quant_per_token_kernel, supports=check_quant_call)
register(ops.grouped_gemm_w8a8_swiglu_quant, grouped_gemm_w8a8_swiglu_quant_kernel, supports=check_w8a8_swiglu_call)
register(ops.grouped_gemm_w8a8, grouped_gemm_w8a8_kernel, supports=check_w8a8_gemm_call)

"""Host side of the Triton MoE permute / unpermute provider: argument checks, outputs, launches.

Both launches are static in shape and read no device value on the host (CUDA-graph capturable).
Limits: 2-D ``x`` / ``y`` with unit-stride rows, fp32/bf16/fp16 data, int32/int64 ids, top-k <= 64.
Like any gather, ``moe_unpermute`` trusts ``src2dst < y.shape[0]`` (the reference raises instead).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ep_fuse.providers.tensor_checks import KERNEL_DTYPES, row_stride

ID_DTYPES = (torch.int32, torch.int64)
MAX_TOP_K = 64
"""Largest top-k the kernels unroll."""


def _rows_ok(t: torch.Tensor, name: str) -> str | None:
    if t.dtype not in KERNEL_DTYPES:
        return f"{name} dtype {t.dtype} is not one of fp16/bf16/fp32"
    if t.dim() != 2:
        return f"{name} is {t.dim()}-D (the kernel takes [rows, H]; reshape to 2-D first)"
    if row_stride(t) is None:
        return f"{name} rows are not unit-stride rows with one row stride"
    return None


def check_moe_permute_call(args: tuple[Any, ...]) -> str | None:
    """Limits of the Triton permute: 2-D x [T, H] with unit-stride rows, ids [T, K] int32/int64."""
    x, topk_ids, num_experts = args
    if (reason := _rows_ok(x, "x")) is not None:
        return reason
    if topk_ids.dtype not in ID_DTYPES:
        return f"topk_ids dtype {topk_ids.dtype} is not int32/int64 (cast the router output)"
    if topk_ids.dim() != 2:
        return f"topk_ids is {topk_ids.dim()}-D, not [T, K]"
    if not statically_known_true(topk_ids.shape[0] == x.shape[0]):
        return "topk_ids and x differ in their token count"
    if not statically_known_true(topk_ids.shape[1] <= MAX_TOP_K):
        return f"top-k {topk_ids.shape[1]} > {MAX_TOP_K}"
    if not isinstance(num_experts, int) or num_experts < 1:
        return f"num_experts {num_experts!r} is not a positive int"
    return None


def _prod_dtype(y: torch.Tensor, w: torch.Tensor | None) -> torch.dtype:
    return y.dtype if w is None else torch.promote_types(y.dtype, w.dtype)


def check_moe_unpermute_call(args: tuple[Any, ...]) -> str | None:
    """Limits of the Triton unpermute: 2-D y with unit-stride rows, 1-D int src2dst, w [T, K] or None."""
    y, src2dst, topk_weights, top_k, out_dtype = args
    if (reason := _rows_ok(y, "y")) is not None:
        return reason
    if src2dst.dtype not in ID_DTYPES or src2dst.dim() != 1:
        return f"src2dst is not a 1-D int32/int64 tensor ({src2dst.dtype}, {src2dst.dim()}-D)"
    if not isinstance(top_k, int) or not 1 <= top_k <= MAX_TOP_K:
        return f"top_k {top_k!r} is not an int in [1, {MAX_TOP_K}]"
    if not statically_known_true(src2dst.shape[0] % top_k == 0):
        return f"src2dst length is not a multiple of top_k {top_k}"
    if topk_weights is not None:
        if topk_weights.dtype not in KERNEL_DTYPES:
            return f"topk_weights dtype {topk_weights.dtype} is not one of fp16/bf16/fp32"
        if topk_weights.dim() != 2 or not statically_known_true(topk_weights.shape[1] == top_k):
            return "topk_weights is not [T, top_k] (reshape it first)"
        if not statically_known_true(topk_weights.shape[0] * top_k == src2dst.shape[0]):
            return "topk_weights and src2dst differ in their slot count"
    if out_dtype is not None and out_dtype not in KERNEL_DTYPES:
        return f"output dtype {out_dtype} is not one of fp16/bf16/fp32"
    return None


def moe_permute_kernel(x, topk_ids, num_experts, wrap=None):  # noqa: ANN001, ANN201 - schema-typed
    """``ep_fuse_triton::moe_permute`` -> ``(rows [T*K, H], src2dst [T*K] int64, seg_indptr [E+1] int64)``."""
    from ep_fuse.providers.triton.moe_permute_kernel import launch_permute  # imports triton: on first launch

    t, k = topk_ids.shape
    rows = torch.empty((t * k, x.shape[1]), dtype=x.dtype, device=x.device)
    src2dst = torch.empty((t * k,), dtype=torch.int64, device=x.device)
    seg_indptr = torch.empty((num_experts + 1,), dtype=torch.int64, device=x.device)
    launch_permute(x, topk_ids, num_experts, rows, src2dst, seg_indptr, wrap=wrap)
    return rows, src2dst, seg_indptr


def moe_unpermute_kernel(y, src2dst, topk_weights, top_k, out_dtype, wrap=None):  # noqa: ANN001, ANN201
    """``ep_fuse_triton::moe_unpermute`` -> ``out [T, H]``: weighted top-k sum of the permuted rows."""
    from ep_fuse.providers.triton.moe_permute_kernel import launch_unpermute  # imports triton: on first launch

    prod = _prod_dtype(y, topk_weights)
    t = src2dst.shape[0] // top_k
    out = torch.empty((t, y.shape[1]), dtype=out_dtype or prod, device=y.device)
    launch_unpermute(y, src2dst, topk_weights, top_k, out, prod, wrap=wrap)
    return out

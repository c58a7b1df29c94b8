"""A test double of DeepGEMM's ``deep_gemm`` module for CPU tests of the DeepGEMM provider: the documented
semantics of the calls the provider makes, in pure torch (DeepGEMM's README and ``csrc/apis/gemm.hpp``):

* ``m_grouped_fp8_gemm_nt_contiguous((a, sfa), (b, sfb), d, grouped_layout, ..., use_psum_layout=True,
  expected_m_for_psum_layout=None)``: ``a`` fp8 [M, K] with fp32 1 x 128 scales ``sfa`` [M, K/128]; ``b`` fp8
  [G, N, K] with fp32 128 x 128 scales ``sfb`` [G, N/128, K/128]; ``d`` bf16 [M, N]. With the prefix-sum
  layout, ``grouped_layout`` int32 [G] holds each group's end row; group ``g`` covers rows
  ``[align(end[g-1], 128), end[g])`` (``end[-1] = 0``). Rows outside every group are not written.
* ``get_mk_alignment_for_contiguous_layout()``: 128 (SM90's default).

The double checks the arguments DeepGEMM's host code asserts on (dtypes, shapes, contiguity) and records each
call's layout, so a test can see what the provider passed.
"""

from __future__ import annotations

from typing import Any

import torch

from ep_fuse.ops.fp8 import dequantize_blocks

ALIGNMENT = 128
calls: list[dict[str, Any]] = []


def get_mk_alignment_for_contiguous_layout() -> int:
    return ALIGNMENT


def m_grouped_fp8_gemm_nt_contiguous(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor],
                                     d: torch.Tensor, grouped_layout: torch.Tensor, recipe: Any = None,
                                     recipe_a: Any = None, recipe_b: Any = None, compiled_dims: str = "nk",
                                     disable_ue8m0_cast: bool = False, use_psum_layout: bool = False,
                                     ensure_zero_padding: bool = True,
                                     expected_m_for_psum_layout: int | None = None) -> None:
    (aq, sfa), (bq, sfb) = a, b
    m, k = aq.shape
    g, n, k2 = bq.shape
    assert aq.dtype == bq.dtype == torch.float8_e4m3fn and sfa.dtype == sfb.dtype == torch.float32
    assert k == k2 and tuple(d.shape) == (m, n) and d.dtype == torch.bfloat16
    assert tuple(sfa.shape) == (m, k // 128) and tuple(sfb.shape) == (g, n // 128, k // 128)
    assert grouped_layout.dtype == torch.int32 and grouped_layout.is_contiguous()
    assert use_psum_layout, "the double implements the prefix-sum layout only"
    assert tuple(grouped_layout.shape) == (g,)
    ends = grouped_layout.tolist()
    calls.append({"ends": ends, "m": m, "expected_m": expected_m_for_psum_layout})
    start = 0
    for e, end in enumerate(ends):
        start = -(-start // ALIGNMENT) * ALIGNMENT
        if end > start:
            x = dequantize_blocks(aq[start:end], sfa[start:end], 1, 128)
            d[start:end] = (x @ dequantize_blocks(bq[e], sfb[e], 128, 128).T).to(d.dtype)
        start = end

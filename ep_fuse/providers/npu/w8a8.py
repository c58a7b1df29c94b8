"""Ascend providers of the W8A8 int8 expert stages, following the sglang Ascend DeepEP chain (seed PR;
``docs/npu.md``)::

    npu_dynamic_quant -> npu_grouped_matmul (int8, int32 out) -> npu_dequant_swiglu_quant
        -> npu_grouped_matmul (int8, scale + per_token_scale, bf16/fp16 out)

Conventions used (documented semantics; **not run on Ascend hardware by this project**, tested against
``tests/support/npu_double.py`` under torch_npu 2.14.0's schemas and meta functions: ``docs/npu.md``):

* ``npu_dynamic_quant(x) -> (int8 y, fp32 scale [M])``: per-token, ``scale = rowmax|x| / 127``.
* ``npu_grouped_matmul`` with int8 x / int8 weight [E, K, N] (the cached transposed copy of the
  [E, N, K] codes, as the bf16 provider's ``gmm_weight``), ``group_type=0``, ``split_item=2``, cumsum
  ``group_list`` covering every row (tail rows join the last expert; they are zero codes, so they give
  zeros). gmm1 returns int32 (``output_dtype=torch.int32``, no scales); gmm2 dequantizes
  ``(x @ W) * scale[e, n] * per_token_scale[m]`` into bf16/fp16 (fp32 outputs are declined).
* ``npu_dequant_swiglu_quant(x int32, weight_scale [E, 2I], activation_scale [M], group_index=counts,
  activate_left=True, quant_mode=1)``: dequant, ``silu(left half) * right half``, dynamic per-token
  requant -> ``(int8 [M, I], fp32 [M])``.

Tail rows (past ``seg_indptr[E]``) are re-zeroed after each op. The NPU's rounding of codes may differ
from the reference's round-half-to-even by one code.
"""

from __future__ import annotations

from typing import Any

import torch

from ep_fuse.ops import w8a8 as Q
from ep_fuse.ops.registry import register_provider
from ep_fuse.providers.npu.provider import available, contracts, devices, torch_npu
from ep_fuse.providers.npu.moe import INNER_LIMIT, MAX_GROUPS, cumsum_group_list, rows_mask, gmm_weight

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
GMM_OUT = (torch.float16, torch.bfloat16)


def _tail_zero(t: torch.Tensor, seg_indptr: torch.Tensor) -> torch.Tensor:
    mask = rows_mask(t.shape[0], seg_indptr)
    return torch.where(mask if t.dim() == 2 else mask.squeeze(-1), t, torch.zeros((), dtype=t.dtype, device=t.device))


def quant_supports(args: tuple[Any, ...]) -> str | None:
    (x,) = args
    if x.dim() != 2 or x.dtype not in FLOATS:
        return f"npu_dynamic_quant takes a 2-D float16/bfloat16/float32 x here, got {x.dim()}-D {x.dtype}"
    if x.numel() == 0:
        return "empty input"
    return None


def _gemm_reason(args: tuple[Any, ...]) -> str | None:
    xq, xs, wq, ws, seg = args[:5]
    if xq.dtype != torch.int8 or wq.dtype != torch.int8 or xs.dtype != torch.float32 or ws.dtype != torch.float32:
        return "needs int8 codes and fp32 scales"
    if xq.dim() != 2 or wq.dim() != 3 or wq.shape[2] != xq.shape[1]:
        return f"shapes xq {tuple(xq.shape)} / w_q {tuple(wq.shape)} are not [M, K] / [E, N, K]"
    if not 1 <= wq.shape[0] <= MAX_GROUPS:
        return f"{wq.shape[0]} experts (npu_grouped_matmul takes at most {MAX_GROUPS} groups)"
    if seg.dim() != 1 or seg.shape[0] != wq.shape[0] + 1 or seg.dtype.is_floating_point:
        return "seg_indptr is not an integer [E+1] tensor"
    if xq.numel() == 0 or wq.shape[1] == 0:
        return "empty input"
    if max(xq.shape[1], wq.shape[1]) >= INNER_LIMIT:
        return f"inner dim >= {INNER_LIMIT} (npu_grouped_matmul InnerLimit)"
    return None


def swiglu_quant_supports(args: tuple[Any, ...]) -> str | None:
    reason = _gemm_reason(args)
    if reason is None and args[2].shape[1] % 2:
        reason = "odd gate|up width"
    return reason


def gemm_supports(args: tuple[Any, ...]) -> str | None:
    reason = _gemm_reason(args)
    if reason is None and args[5] not in GMM_OUT:
        reason = f"out_dtype {args[5]} (quantized npu_grouped_matmul writes float16/bfloat16)"
    return reason


def quant_per_token_kernel(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, s = torch_npu().npu_dynamic_quant(x.contiguous())
    return q, s.reshape(x.shape[0]).to(torch.float32)


def _gmm(xq: torch.Tensor, wq: torch.Tensor, seg: torch.Tensor, **kw: Any) -> torch.Tensor:
    (y,) = torch_npu().npu_grouped_matmul([xq.contiguous()], [gmm_weight(wq)], group_list=cumsum_group_list(seg, xq.shape[0]),
                                     group_list_type=0, group_type=0, split_item=2, **kw)
    return y


def grouped_gemm_w8a8_swiglu_quant_kernel(xq, x_scale, w13_q, w13_scale, seg_indptr):
    h = _gmm(xq, w13_q, seg_indptr, output_dtype=torch.int32)
    counts = torch.diff(cumsum_group_list(seg_indptr, xq.shape[0]), prepend=seg_indptr.new_zeros(1)).to(torch.int64)
    q, s = torch_npu().npu_dequant_swiglu_quant(h, weight_scale=w13_scale.contiguous(), activation_scale=x_scale,
                                           group_index=counts, activate_left=True, quant_mode=1)
    return _tail_zero(q, seg_indptr), _tail_zero(s.reshape(-1).to(torch.float32), seg_indptr)


def grouped_gemm_w8a8_kernel(xq, x_scale, w_q, w_scale, seg_indptr, out_dtype):
    y = _gmm(xq, w_q, seg_indptr, scale=[w_scale.contiguous()], per_token_scale=[x_scale], output_dtype=out_dtype)
    return _tail_zero(y, seg_indptr)


for _op, _kernel, _supports, _calls in (
        (Q.quant_per_token, quant_per_token_kernel, quant_supports, ("npu_dynamic_quant",)),
        (Q.grouped_gemm_w8a8_swiglu_quant, grouped_gemm_w8a8_swiglu_quant_kernel, swiglu_quant_supports,
         ("npu_grouped_matmul", "npu_dequant_swiglu_quant")),
        (Q.grouped_gemm_w8a8, grouped_gemm_w8a8_kernel, gemm_supports, ("npu_grouped_matmul",))):
    register_provider(_op, "npu", _kernel, devices=devices, available=available, supports=_supports,
                      contracts=contracts(*_calls))

"""Canonical W8A8 int8 routed-expert ops (``quant="w8a8_int8"``): stage ops and their block.

Semantics: :mod:`ep_fuse.ops.quant_reference`. The quant pass (:mod:`ep_fuse.passes.quant`) rewrites
each ``moe_experts`` block into ``moe_experts_w8a8``, which the expand pass replaces by::

    moe_permute -> quant_per_token -> grouped_gemm_w8a8_swiglu_quant -> grouped_gemm_w8a8 -> moe_unpermute
"""

from __future__ import annotations

from ep_fuse.ops import quant_reference as _q
from ep_fuse.ops.registry import define_canonical

quant_per_token = define_canonical(
    "quant_per_token", "(Tensor x) -> (Tensor, Tensor)", _q.quant_per_token_ref, fake=_q.quant_per_token_fake)
"""``quant_per_token(x [M, K]) -> (codes int8 [M, K], scale fp32 [M])``: dynamic symmetric per-row int8."""

grouped_gemm_w8a8_swiglu_quant = define_canonical(
    "grouped_gemm_w8a8_swiglu_quant",
    "(Tensor xq, Tensor x_scale, Tensor w13_q, Tensor w13_scale, Tensor seg_indptr) -> (Tensor, Tensor)",
    _q.grouped_gemm_w8a8_swiglu_quant_ref, fake=_q.grouped_gemm_w8a8_swiglu_quant_fake,
    traceable=_q.never_traceable)
"""int8 gate|up grouped GEMM -> dequant -> SwiGLU (fp32) -> per-token requant: ``(codes [M, I], scale [M])``."""

grouped_gemm_w8a8 = define_canonical(
    "grouped_gemm_w8a8",
    "(Tensor xq, Tensor x_scale, Tensor w_q, Tensor w_scale, Tensor seg_indptr, ScalarType out_dtype) -> Tensor",
    _q.grouped_gemm_w8a8_ref, fake=_q.grouped_gemm_w8a8_fake, traceable=_q.never_traceable)
"""int8 grouped GEMM ``xq @ w_q[e].T`` dequantized per token x per channel, rounded to ``out_dtype``."""

moe_experts_w8a8 = define_canonical(
    "moe_experts_w8a8",
    "(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13_q, Tensor w13_scale, Tensor w2_q, "
    "Tensor w2_scale, ScalarType? out_dtype) -> Tensor",
    _q.moe_experts_w8a8_ref, block=True,
    stages=("moe_permute", "quant_per_token", "grouped_gemm_w8a8_swiglu_quant", "grouped_gemm_w8a8", "moe_unpermute"))
"""The W8A8 routed-expert block (``moe_experts`` with int8 weights + per-channel scales)."""

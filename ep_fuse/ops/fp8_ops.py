"""Canonical FP8 block-scaled routed-expert ops (``quant="fp8_block"``): stage ops, their block, and the
weight dequantization that marks a model's own FP8 expert weights.

Semantics: :mod:`ep_fuse.ops.fp8_reference`. The quant pass (:mod:`ep_fuse.passes.quant`) rewrites each
``moe_experts`` block into ``moe_experts_fp8``, which the expand pass replaces by::

    moe_permute_fp8 -> grouped_gemm_fp8_swiglu_quant -> grouped_gemm_fp8 -> moe_unpermute

``align`` (default 1): with ``align > 1`` the permute starts every expert's rows at a multiple of ``align``
(zero padding rows after each expert's real rows), and the GEMM stages are told so: the layout a
fixed-tile grouped GEMM such as DeepGEMM's needs (:mod:`ep_fuse.providers.deepgemm`). The quant pass
chooses it (:func:`ep_fuse.providers.deepgemm.align_for`).
"""

from __future__ import annotations

from ep_fuse.ops import fp8_reference as _f
from ep_fuse.ops.quant_reference import never_traceable
from ep_fuse.ops.registry import define_canonical

fp8_block_dequant = define_canonical(
    "fp8_block_dequant", "(Tensor q, Tensor scale_inv, int block_n, int block_k, ScalarType dtype) -> Tensor",
    _f.fp8_block_dequant_ref, fake=_f.fp8_block_dequant_fake)
"""``fp8_block_dequant(q fp8 [..., N, K], scale_inv [..., ceil(N/bn), ceil(K/bk)], bn, bk, dtype)``: the
weight in ``dtype`` (fp32 product, one rounding). Emitted by :func:`ep_fuse.prepare` for transformers'
``FP8Experts``; the quant pass (``fp8_block``) reads its codes and scales directly."""

quant_fp8_group = define_canonical(
    "quant_fp8_group", "(Tensor x, int group) -> (Tensor, Tensor)", _f.quant_fp8_group_ref,
    fake=_f.quant_fp8_group_fake)
"""``quant_fp8_group(x [M, K], g) -> (codes fp8 [M, K], scale fp32 [M, ceil(K/g)])``: dynamic 1 x g quant."""

moe_permute_fp8 = define_canonical(
    "moe_permute_fp8",
    "(Tensor x, Tensor topk_ids, int num_experts, int group, int align=1) -> (Tensor, Tensor, Tensor, Tensor)",
    _f.moe_permute_fp8_ref, fake=_f.moe_permute_fp8_fake)
"""``moe_permute`` fused with the 1 x ``group`` fp8 quantization: ``(codes, scales, src2dst, seg_indptr)``;
``align > 1``: the aligned layout (:func:`ep_fuse.ops.fp8_reference.moe_permute_fp8_ref`)."""

grouped_gemm_fp8_swiglu_quant = define_canonical(
    "grouped_gemm_fp8_swiglu_quant",
    "(Tensor xq, Tensor x_scale, Tensor w13_q, Tensor w13_scale, Tensor seg_indptr, int block_n, int block_k, "
    "int align=1) -> (Tensor, Tensor)",
    _f.grouped_gemm_fp8_swiglu_quant_ref, fake=_f.grouped_gemm_fp8_swiglu_quant_fake,
    traceable=never_traceable)
"""fp8 gate|up grouped GEMM (block-scale dequant) -> SwiGLU (fp32) -> 1 x ``block_k`` requant."""

grouped_gemm_fp8 = define_canonical(
    "grouped_gemm_fp8",
    "(Tensor xq, Tensor x_scale, Tensor w_q, Tensor w_scale, Tensor seg_indptr, int block_n, int block_k, "
    "ScalarType out_dtype, int align=1) -> Tensor",
    _f.grouped_gemm_fp8_ref, fake=_f.grouped_gemm_fp8_fake, traceable=never_traceable)
"""fp8 grouped GEMM ``x @ w_q[e].T`` with block-scale dequant, rounded to ``out_dtype``."""

moe_experts_fp8 = define_canonical(
    "moe_experts_fp8",
    "(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13_q, Tensor w13_scale, Tensor w2_q, "
    "Tensor w2_scale, int block_n, int block_k, ScalarType? out_dtype, int align=1) -> Tensor",
    _f.moe_experts_fp8_ref, block=True,
    stages=("moe_permute_fp8", "grouped_gemm_fp8_swiglu_quant", "grouped_gemm_fp8", "moe_unpermute"))
"""The FP8 routed-expert block (``moe_experts`` with block-scaled E4M3 weights)."""


moe_permute_fp8_q = define_canonical(
    "moe_permute_fp8_q",
    "(Tensor xq, Tensor x_scale, Tensor topk_ids, int num_experts) -> (Tensor, Tensor, Tensor, Tensor)",
    _f.moe_permute_fp8_q_ref, fake=_f.moe_permute_fp8_q_fake)
"""``moe_permute_fp8`` of tokens that arrive quantized (FP8 EP dispatch): codes and scales moved, no rounding.
Reference only (a gather Inductor compiles): the rows are half the bytes of the bf16 permute's."""

moe_experts_fp8_q = define_canonical(
    "moe_experts_fp8_q",
    "(Tensor xq, Tensor x_scale, Tensor topk_ids, Tensor topk_weights, Tensor w13_q, Tensor w13_scale, "
    "Tensor w2_q, Tensor w2_scale, int block_n, int block_k, ScalarType act_dtype, ScalarType? out_dtype) -> Tensor",
    _f.moe_experts_fp8_q_ref, block=True,
    stages=("moe_permute_fp8_q", "grouped_gemm_fp8_swiglu_quant", "grouped_gemm_fp8", "moe_unpermute"))
"""The FP8 block on pre-quantized tokens (the quant pass emits it behind an FP8 EP dispatch)."""

"""The canonical ep_fuse ops (``torch.ops.ep_fuse.*``): schemas bound to their reference kernels."""

from __future__ import annotations

from ep_fuse.ops.reference import (
    add_rms_norm_ref,
    gemm_swiglu_ref,
    rms_norm_ref,
    rope_cache_ref,
    rope_qk_cache_ref,
    rope_qk_ref,
    rope_ref,
)
from ep_fuse.ops.registry import define_canonical

RMS_NORM_SCHEMA = (
    "(Tensor x, Tensor? weight, float eps, Tensor? eps_t, str mode, bool upcast, ScalarType? out_dtype) -> Tensor"
)
ADD_RMS_NORM_SCHEMA = (
    "(Tensor x, Tensor residual, Tensor? weight, float eps, Tensor? eps_t, str mode, bool upcast, "
    "ScalarType? out_dtype) -> (Tensor, Tensor)"
)

rms_norm = define_canonical("rms_norm", RMS_NORM_SCHEMA, rms_norm_ref)
"""``rms_norm(x, weight, eps, eps_t, mode, upcast, out_dtype)``: see :func:`ep_fuse.ops.reference.rms_norm_ref`."""

add_rms_norm = define_canonical("add_rms_norm", ADD_RMS_NORM_SCHEMA, add_rms_norm_ref)
"""``add_rms_norm(x, residual, ...) -> (normed, x + residual)``: see :func:`ep_fuse.ops.reference.add_rms_norm_ref`."""

ROPE_SCHEMA = "(Tensor x, Tensor cos, Tensor? sin, str form, int rot_dim, ScalarType? out_dtype) -> Tensor"
ROPE_QK_SCHEMA = (
    "(Tensor q, Tensor k, Tensor cos, Tensor? sin, str form, int rot_dim, ScalarType? out_dtype) -> (Tensor, Tensor)"
)

rope = define_canonical("rope", ROPE_SCHEMA, rope_ref)
"""``rope(x, cos, sin, form, rot_dim, out_dtype)``: see :func:`ep_fuse.ops.reference.rope_ref`."""

rope_qk = define_canonical("rope_qk", ROPE_QK_SCHEMA, rope_qk_ref)
"""``rope_qk(q, k, ...) -> (q', k')``: q and k rotated with one cos/sin."""

rope_cache = define_canonical(
    "rope_cache", "(Tensor x, Tensor cos_sin_cache, Tensor positions, str form, int rot_dim) -> Tensor", rope_cache_ref)
"""``rope_cache(x [*T, H, D], cos_sin_cache [max_pos, rot_dim], positions [*T], form, rot_dim)``: RoPE with
cos/sin gathered by position (vLLM's cache form): see :func:`ep_fuse.ops.reference.rope_cache_ref`."""

rope_qk_cache = define_canonical(
    "rope_qk_cache",
    "(Tensor q, Tensor k, Tensor cos_sin_cache, Tensor positions, str form, int rot_dim) -> (Tensor, Tensor)",
    rope_qk_cache_ref)
"""``rope_qk_cache(q, k, ...) -> (q', k')``: q and k rotated with one cache gather."""

GEMM_SWIGLU_SCHEMA = "(Tensor x, Tensor w_gate, Tensor w_up) -> Tensor"

gemm_swiglu = define_canonical("gemm_swiglu", GEMM_SWIGLU_SCHEMA, gemm_swiglu_ref)
"""``gemm_swiglu(x, w_gate, w_up) = silu(x @ w_gate.T) * (x @ w_up.T)``: see :func:`ep_fuse.ops.reference.gemm_swiglu_ref`."""

# --------------------------------------------------------------------------- MoE (op-contracts.md §6, §7)
from ep_fuse.ops import moe_reference as _moe  # noqa: E402

moe_permute = define_canonical(
    "moe_permute", "(Tensor x, Tensor topk_ids, int num_experts) -> (Tensor, Tensor, Tensor)", _moe.moe_permute_ref)
"""``moe_permute(x, topk_ids, E) -> (rows, src2dst, seg_indptr)``: see :mod:`ep_fuse.ops.moe_reference`."""

moe_unpermute = define_canonical(
    "moe_unpermute",
    "(Tensor y, Tensor src2dst, Tensor? topk_weights, int top_k, ScalarType? out_dtype) -> Tensor",
    _moe.moe_unpermute_ref)
"""``moe_unpermute(y, src2dst, w, K, out_dtype)``: weighted top-k sum of permuted rows back per token."""

grouped_gemm = define_canonical(
    "grouped_gemm", "(Tensor x, Tensor w, Tensor seg_indptr) -> Tensor", _moe.grouped_gemm_ref,
    fake=_moe.grouped_gemm_fake, traceable=_moe.grouped_gemm_traceable)
"""``grouped_gemm(x, w [E, N, K], seg_indptr)``: per-expert ``x @ w[e].T`` over row segments."""

grouped_gemm_swiglu = define_canonical(
    "grouped_gemm_swiglu", "(Tensor x, Tensor w13, Tensor seg_indptr) -> Tensor", _moe.grouped_gemm_swiglu_ref,
    fake=_moe.grouped_gemm_swiglu_fake, traceable=_moe.grouped_gemm_traceable)
"""``grouped_gemm_swiglu(x, w13 [E, 2I, H], seg_indptr)``: ``silu(gate) * up`` of the gate|up grouped GEMM."""

moe_experts = define_canonical(
    "moe_experts",
    "(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13, Tensor w2, ScalarType? out_dtype) -> Tensor",
    _moe.moe_experts_ref, block=True, stages=("moe_permute", "grouped_gemm_swiglu", "grouped_gemm", "moe_unpermute"))
"""The routed-expert block; expanded into the four stage ops above before lowering."""

# --------------------------------------------------------------------------- router (op-contracts.md §5)
from ep_fuse.ops.router_reference import moe_gating_ref as _moe_gating_ref  # noqa: E402

MOE_GATING_SCHEMA = (
    "(Tensor logits, Tensor? bias, int top_k, str score, int n_group, int topk_group, str group_score, "
    "bool renormalize, float renorm_eps, float scale, ScalarType? weight_dtype, bool renorm_clamp=False) "
    "-> (Tensor, Tensor)"
)
"""``renorm_clamp`` (Ernie-4.5-MoE) is passed only when true: calls keep the 11 arguments otherwise."""
moe_gating = define_canonical("moe_gating", MOE_GATING_SCHEMA, _moe_gating_ref)
"""``moe_gating(logits, bias, K, ...) -> (weights, ids int64)``: see :mod:`ep_fuse.ops.router_reference`."""

from ep_fuse.ep import ops as _ep_ops  # noqa: E402,F401  (EP: ep_dispatch / ep_combine, docs/ep.md)
from ep_fuse.ops import quant_ops as _quant_ops  # noqa: E402,F401  (W8A8 int8 experts, quant="w8a8_int8")
from ep_fuse.ops import fp8_ops as _fp8_ops  # noqa: E402,F401  (FP8 block-scaled experts, quant="fp8_block")

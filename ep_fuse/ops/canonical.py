"""The canonical ep_fuse ops (``torch.ops.ep_fuse.*``): schemas bound to their reference kernels."""

from __future__ import annotations

from ep_fuse.ops.reference import add_rms_norm_ref, gemm_swiglu_ref, rms_norm_ref, rope_qk_ref, rope_ref
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

GEMM_SWIGLU_SCHEMA = "(Tensor x, Tensor w_gate, Tensor w_up) -> Tensor"

gemm_swiglu = define_canonical("gemm_swiglu", GEMM_SWIGLU_SCHEMA, gemm_swiglu_ref)
"""``gemm_swiglu(x, w_gate, w_up) = silu(x @ w_gate.T) * (x @ w_up.T)``: see :func:`ep_fuse.ops.reference.gemm_swiglu_ref`."""

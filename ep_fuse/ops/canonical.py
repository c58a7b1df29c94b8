"""The canonical ep_fuse ops (``torch.ops.ep_fuse.*``): schemas bound to their reference kernels."""

from __future__ import annotations

from ep_fuse.ops.reference import add_rms_norm_ref, rms_norm_ref
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

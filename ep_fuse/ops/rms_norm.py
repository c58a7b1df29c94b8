"""The RMSNorm family: ``ep_fuse::rms_norm`` and ``ep_fuse::add_rms_norm`` (schemas, pure-torch references, and
the argument conventions every provider of them shares).

The references are the semantics: the fallback of every provider, the fake impls, the test oracles, and what the
Inductor executor inlines where no fused provider is taken. They spell out the exact operation order of the model
code they replace, so an inlined reference is what Inductor would have compiled anyway.
"""

from __future__ import annotations

from typing import Any

import torch

from ep_fuse.ops.registry import define_canonical

RMS_NORM_MODES = ("llama", "weight_fp32", "gemma", "none", "weight_fp32_pow", "none_pow", "none_rstd_cast")
"""How the weight meets the normalised value ``n`` (fp32 when ``upcast``):

* ``llama``: ``w * n.to(out_dtype)`` -- cast first, multiply in the model dtype (HF Llama/Mixtral/Qwen/DeepSeek);
* ``weight_fp32``: ``(w * n)`` then an optional cast (GPT-OSS; also plain fp32 models);
* ``gemma``: ``n * (w.float() + 1)`` then an optional cast (zero-centred weight, Qwen3-Next);
* ``none``: ``n`` then an optional cast (weightless L2 q/k-norm);
* ``none_rstd_cast``: ``x * rstd.to(out_dtype)`` -- the statistic ``rsqrt(mean(xf**2) + eps)`` rounded to
  ``out_dtype`` and multiplied by the *unconverted* input (DeepSeek-V4's ``DeepseekV4UnweightedRMSNorm``: in bf16
  both the statistic and the product are rounded to bf16); Triton only (:data:`ROUNDED_RSTD`).

A ``_pow`` suffix writes the statistic as ``n = xf * pow(mean(xf**2) + eps, -0.5)`` (HF Gemma4 / MuseSpark /
DiffusionGemma, ``with_scale=True`` -> ``weight_fp32_pow``, ``with_scale=False`` -> ``none_pow``); the reference
keeps the ``pow`` so it rounds as the model does. Fused kernels compute ``rsqrt`` (the same function, a few fp32
ulp apart): :func:`base_mode`.
"""

POW_SUFFIX = "_pow"

ROUNDED_RSTD = frozenset({"none_rstd_cast"})
"""Modes that round the statistic to the model dtype before the multiply (not a ``weight`` tail of ``n``)."""

WEIGHTLESS = frozenset({"none", "none_pow", "none_rstd_cast"})
"""Modes that take no weight."""


def base_mode(mode: str) -> str:
    """The weight tail of ``mode`` without the ``_pow`` statistic (what the fused kernels implement)."""
    return mode.removesuffix(POW_SUFFIX)


def _check_mode(mode: str, weight: torch.Tensor | None, out_dtype: torch.dtype | None) -> None:
    if mode not in RMS_NORM_MODES:
        raise ValueError(f"ep_fuse rms_norm: mode {mode!r} is not one of {RMS_NORM_MODES}")
    if (weight is None) != (mode in WEIGHTLESS):
        raise ValueError(f"ep_fuse rms_norm: mode {mode!r} {'takes no' if weight is not None else 'needs'} weight")
    if mode in ("llama", *ROUNDED_RSTD) and out_dtype is None:
        raise ValueError(f"ep_fuse rms_norm: mode {mode!r} casts before a multiply and needs out_dtype")


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    eps_t: torch.Tensor | None,
    mode: str,
    upcast: bool,
    out_dtype: torch.dtype | None,
) -> torch.Tensor:
    """RMSNorm over the last dim: ``n = xf * rsqrt(mean(xf**2) + eps)`` (``_pow`` modes: ``pow(·, -0.5)``), then the
    weight as ``mode`` says."""
    _check_mode(mode, weight, out_dtype)
    xf = x.to(torch.float32) if upcast else x
    var = xf.pow(2).mean(-1, keepdim=True)
    var = var + (eps_t if eps_t is not None else eps)
    if mode in ROUNDED_RSTD:  # the statistic rounded first, the product in the input's dtype
        assert out_dtype is not None
        return x * torch.rsqrt(var).to(out_dtype)
    n = xf * (torch.pow(var, -0.5) if mode.endswith(POW_SUFFIX) else torch.rsqrt(var))
    mode = base_mode(mode)
    if mode == "llama":
        assert weight is not None and out_dtype is not None
        return weight * n.to(out_dtype)
    if mode == "weight_fp32":
        assert weight is not None
        y = weight * n
    elif mode == "gemma":
        assert weight is not None
        y = n * (weight.to(torch.float32) + 1.0)
    else:
        y = n
    return y.to(out_dtype) if out_dtype is not None else y


def add_rms_norm_ref(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    eps_t: torch.Tensor | None,
    mode: str,
    upcast: bool,
    out_dtype: torch.dtype | None,
    norm_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual`` (in the promoted dtype of the two, as ``torch.add``), then :func:`rms_norm_ref` of ``s``,
    or of ``s.to(norm_dtype)`` when given (Zaya's fp32 residual stream in a bf16 model: ``norm(residual.to(bf16))``
    after an fp32 add); returns ``(normed, s)``."""
    s = x + residual
    return rms_norm_ref(s if norm_dtype is None else s.to(norm_dtype), weight, eps, eps_t, mode, upcast, out_dtype), s


def unpack_norm_args(args: tuple[Any, ...]) -> tuple[torch.Tensor, torch.Tensor | None, tuple[Any, ...]]:
    """Split ``(x[, residual], weight, eps, eps_t, mode, upcast, out_dtype[, norm_dtype])`` into ``x``, ``residual``
    and the six norm arguments (``norm_dtype``: :func:`norm_input_dtype`)."""
    if len(args) >= 8:
        return args[0], args[1], tuple(args[2:8])
    return args[0], None, tuple(args[1:])


def norm_input_dtype(args: tuple[Any, ...]) -> torch.dtype | None:
    """``add_rms_norm``'s ``norm_dtype``: the dtype the sum is rounded to before the norm (``None``: the sum itself)."""
    return args[8] if len(args) > 8 else None


def rms_norm_out_dtype(
    x: torch.Tensor, weight: torch.Tensor | None, mode: str, upcast: bool, out_dtype: torch.dtype | None,
    in_dtype: torch.dtype | None = None,
) -> torch.dtype:
    """Output dtype of ``rms_norm_ref`` (type promotion of its last op); ``in_dtype``: the dtype the norm reads when
    it is not ``x``'s (``add_rms_norm``'s ``norm_dtype``)."""
    x_dtype = in_dtype or x.dtype
    stat = torch.float32 if upcast else x_dtype
    if mode in ROUNDED_RSTD:
        assert out_dtype is not None
        return torch.promote_types(x_dtype, out_dtype)
    mode = base_mode(mode)
    if mode == "llama":
        assert weight is not None and out_dtype is not None
        return torch.promote_types(weight.dtype, out_dtype)
    if out_dtype is not None:
        return out_dtype
    if mode == "weight_fp32":
        assert weight is not None
        return torch.promote_types(weight.dtype, stat)
    if mode == "gemma":
        return torch.promote_types(stat, torch.float32)
    return stat


def host_eps(eps: float, eps_t: torch.Tensor | None) -> float:
    """The eps value; a dynamic-shape eps arrives as a 0-d CPU tensor, whose read does not sync a device."""
    return float(eps_t.item()) if eps_t is not None else float(eps)


RMS_NORM_SCHEMA = (
    "(Tensor x, Tensor? weight, float eps, Tensor? eps_t, str mode, bool upcast, ScalarType? out_dtype) -> Tensor"
)
ADD_RMS_NORM_SCHEMA = (
    "(Tensor x, Tensor residual, Tensor? weight, float eps, Tensor? eps_t, str mode, bool upcast, "
    "ScalarType? out_dtype, ScalarType? norm_dtype=None) -> (Tensor, Tensor)"
)

rms_norm = define_canonical("rms_norm", RMS_NORM_SCHEMA, rms_norm_ref)
"""``rms_norm(x, weight, eps, eps_t, mode, upcast, out_dtype)``: see :func:`ep_fuse.ops.rms_norm.rms_norm_ref`."""

add_rms_norm = define_canonical("add_rms_norm", ADD_RMS_NORM_SCHEMA, add_rms_norm_ref)
"""``add_rms_norm(x, residual, ...) -> (normed, x + residual)``: see :func:`ep_fuse.ops.rms_norm.add_rms_norm_ref`."""

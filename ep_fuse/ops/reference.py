"""Pure-torch reference implementations of the canonical ops.

They are the semantics: the fallback of every provider, the fake impls, the test oracles, and what
the Inductor executor inlines where no fused provider is taken. Each one spells out the exact
operation order of the model code it replaces, so an inlined reference is what Inductor would have
compiled anyway.
"""

from __future__ import annotations

import torch

RMS_NORM_MODES = ("llama", "weight_fp32", "gemma", "none")
"""How the weight meets the normalised value ``n`` (fp32 when ``upcast``):

* ``llama``: ``w * n.to(out_dtype)`` -- cast first, multiply in the model dtype (HF Llama/Mixtral/Qwen/DeepSeek);
* ``weight_fp32``: ``(w * n)`` then an optional cast (GPT-OSS; also plain fp32 models);
* ``gemma``: ``n * (w.float() + 1)`` then an optional cast (zero-centred weight, Qwen3-Next);
* ``none``: ``n`` then an optional cast (weightless L2 q/k-norm).
"""


def _check_mode(mode: str, weight: torch.Tensor | None, out_dtype: torch.dtype | None) -> None:
    if mode not in RMS_NORM_MODES:
        raise ValueError(f"ep_fuse rms_norm: mode {mode!r} is not one of {RMS_NORM_MODES}")
    if (weight is None) != (mode == "none"):
        raise ValueError(f"ep_fuse rms_norm: mode {mode!r} {'needs' if mode != 'none' else 'takes no'} weight")
    if mode == "llama" and out_dtype is None:
        raise ValueError("ep_fuse rms_norm: mode 'llama' casts before the weight multiply and needs out_dtype")


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    eps_t: torch.Tensor | None,
    mode: str,
    upcast: bool,
    out_dtype: torch.dtype | None,
) -> torch.Tensor:
    """RMSNorm over the last dim: ``n = xf * rsqrt(mean(xf**2) + eps)`` then the weight as ``mode`` says."""
    _check_mode(mode, weight, out_dtype)
    xf = x.to(torch.float32) if upcast else x
    var = xf.pow(2).mean(-1, keepdim=True)
    var = var + (eps_t if eps_t is not None else eps)
    n = xf * torch.rsqrt(var)
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual`` (rounded to the input dtype), then :func:`rms_norm_ref` of ``s``; returns ``(normed, s)``."""
    s = x + residual
    return rms_norm_ref(s, weight, eps, eps_t, mode, upcast, out_dtype), s

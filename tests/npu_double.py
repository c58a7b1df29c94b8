"""A test double of ``torch_npu``: the documented semantics of the ops ep_fuse calls, on the CPU.

Written from the op-plugin documentation summarised in ``op-contracts.md`` §1, §2, §9 -- not from
running Ascend hardware. It checks the documented input constraints so a provider that passes an
argument the real op rejects fails here too.
"""

from __future__ import annotations

import types

import torch

_RMS_DTYPES = {
    (torch.float16, torch.float32), (torch.bfloat16, torch.float32), (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
}


def _rstd(xf: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def npu_rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6):
    """(y, rstd): fp32 statistics, y = cast(x * rstd * gamma) rounded once to x's dtype."""
    if not 1 <= x.dim() <= 8:
        raise RuntimeError("npu_rms_norm: x must be 1-D to 8-D")
    if (x.dtype, gamma.dtype) not in _RMS_DTYPES:
        raise RuntimeError(f"npu_rms_norm: unsupported (x, gamma) dtypes {(x.dtype, gamma.dtype)}")
    if tuple(gamma.shape) != tuple(x.shape[x.dim() - gamma.dim():]):
        raise RuntimeError("npu_rms_norm: gamma must equal the trailing dims of x")
    if x.numel() == 0:
        raise RuntimeError("npu_rms_norm: empty input")
    xf = x.float()
    rstd = _rstd(xf, epsilon)
    return (xf * rstd * gamma.float()).to(x.dtype), rstd


def npu_add_rms_norm(x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6):
    """(y, rstd, x1 + x2): normalises the unrounded fp32 sum; gamma has x1's dtype."""
    if gamma.dtype != x1.dtype or x2.dtype != x1.dtype:
        raise RuntimeError("npu_add_rms_norm: x1, x2 and gamma must share a dtype")
    if x1.shape != x2.shape or x1.numel() == 0:
        raise RuntimeError("npu_add_rms_norm: x1 and x2 must have one non-empty shape")
    s = x1.float() + x2.float()
    rstd = _rstd(s, epsilon)
    return (s * rstd * gamma.float()).to(x1.dtype), rstd, s.to(x1.dtype)


def make_module() -> types.ModuleType:
    mod = types.ModuleType("torch_npu")
    mod.npu_rms_norm = npu_rms_norm
    mod.npu_add_rms_norm = npu_add_rms_norm
    mod.__ep_fuse_test_double__ = True
    return mod

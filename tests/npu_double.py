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
    mod.npu_rotary_mul = npu_rotary_mul
    mod.npu_swiglu = npu_swiglu
    mod.__ep_fuse_test_double__ = True
    return mod


def npu_rotary_mul(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half"):
    """x·r1 + rotate(x)·r2 in fp32, rounded once; half: (−x2, x1); interleave: (−x[2i+1], x[2i])."""
    if x.dim() not in (3, 4) or x.shape[-1] % 2 or x.shape[-1] >= 896:
        raise RuntimeError("npu_rotary_mul: 3-D/4-D input with an even head dim < 896")
    if not (r1.dtype == r2.dtype == x.dtype):
        raise RuntimeError("npu_rotary_mul: x, r1, r2 must share a dtype")
    xf = x.float()
    if rotary_mode == "half":
        h = x.shape[-1] // 2
        rot = torch.cat((-xf[..., h:], xf[..., :h]), -1)
    elif rotary_mode == "interleave":
        rot = torch.stack((-xf[..., 1::2], xf[..., 0::2]), -1).flatten(-2)
    else:
        raise RuntimeError(f"npu_rotary_mul: rotary_mode {rotary_mode!r}")
    return (xf * r1.float() + rot * r2.float()).to(x.dtype)


def npu_swiglu(x: torch.Tensor, dim: int = -1):
    """silu(A) * B over the two halves of ``dim`` (A first), in fp32, rounded once."""
    if x.shape[dim] % 2 or x.numel() == 0:
        raise RuntimeError("npu_swiglu: the split dim must be even and the input non-empty")
    a, b = x.float().chunk(2, dim=dim)
    return (torch.nn.functional.silu(a) * b).to(x.dtype)

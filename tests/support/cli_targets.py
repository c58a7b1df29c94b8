"""Factories for the CLI tests: modules with deliberate near misses next to fusable sites."""

import torch
from torch import nn


class PerRowEpsNorm(nn.Module):
    """One normal add+RMSNorm, then an RMSNorm whose eps is a per-row tensor (not a constant): a near miss."""

    def __init__(self, h: int = 32):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(h))
        self.w2 = nn.Parameter(torch.randn(h))

    def forward(self, x, r):
        s = x + r
        sf = s.float()
        a = self.w1 * (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        af = a.float()
        eps = af.abs()[..., :1]
        b = self.w2 * (af * torch.rsqrt(af.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        return b, s


def near_miss(device="cpu"):
    torch.manual_seed(0)
    mod = PerRowEpsNorm().to(device=device, dtype=torch.bfloat16)
    x = torch.randn(6, 32, device=device).to(torch.bfloat16)
    return mod, (x, torch.randn_like(x))


def broken():
    raise ValueError("factory failed on purpose")


def semantic_moe(device="cpu"):
    """A routed MoE block spelled with per-token weight gathers and einsum (fused only after ``prepare``)."""
    _tests_on_path()
    from support.semantic_moe_blocks import GeneratedMoE, Spec

    spec = Spec(shared=True)
    return GeneratedMoE(spec).to(device).eval(), (torch.randn(2, 6, spec.hidden, device=device),)


def input_scaled_moe(device="cpu"):
    """Scores multiplying the experts' inputs: ``prepare`` declines it at the combine."""
    _tests_on_path()
    from support.semantic_moe_blocks import InputScaledMoE, Spec

    spec = Spec()
    return InputScaledMoE(spec).to(device).eval(), (torch.randn(2, 6, spec.hidden, device=device),)


def _tests_on_path():
    import sys
    from pathlib import Path

    tests = str(Path(__file__).resolve().parents[1])
    if tests not in sys.path:
        sys.path.insert(0, tests)

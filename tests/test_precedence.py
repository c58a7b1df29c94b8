"""Engine precedence: a pattern does not consume a node at which another family's site matches when a
lower-priority pattern at the same root leaves it (``Canonicalize._choose``)."""

import pytest
import torch
from torch import nn

import ep_fuse
from support.compiling import compile_and_run

BF16 = torch.bfloat16


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class NormAfterRope(nn.Module):
    """q/k RMSNorm over head_dim applied to the rotated heads: ``q = norm(rope(q))``.

    RoPE's final ``add`` looks like a residual add to ``add_rms_norm``; taking it there would lose the
    RoPE site. ``residual=True`` adds a real residual add before one norm (that one stays fused)."""

    def __init__(self, d=16, hq=4, hk=2, residual=False):
        super().__init__()
        self.d, self.hq, self.hk, self.residual = d, hq, hk, residual
        self.q = nn.Linear(32, hq * d, bias=False)
        self.k = nn.Linear(32, hk * d, bias=False)
        self.q_norm = nn.Parameter(torch.randn(d) * 0.1 + 1)
        self.k_norm = nn.Parameter(torch.randn(d) * 0.1 + 1)

    @staticmethod
    def _norm(x, w):
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    def forward(self, x, cos, sin, r):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.hq, self.d).transpose(1, 2)
        k = self.k(x).view(b, s, self.hk, self.d).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if self.residual:
            q = q + r
        return self._norm(q, self.q_norm), self._norm(k, self.k_norm)


def _args():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 32, generator=g).to(BF16)
    ang = torch.randn(1, 1, 7, 8, generator=g)
    ang = torch.cat((ang, ang), -1)
    r = torch.randn(2, 4, 7, 16, generator=g).to(BF16)
    return x, ang.cos().to(BF16), ang.sin().to(BF16), r


@pytest.mark.parametrize("residual, norms", [(False, {"rms_norm": 2}), (True, {"rms_norm": 1, "add_rms_norm": 1})],
                         ids=["norm_after_rope", "residual_add_between"])
def test_rope_and_norm_both_fuse(residual, norms):
    torch.manual_seed(0)
    mod = NormAfterRope(residual=residual).to(BF16)
    args = _args()
    with torch.no_grad():
        ref = mod(*args)
    out = compile_and_run(mod, *args, executor="eager", providers={"cpu": ["reference"]})
    rep = ep_fuse.last_report()
    assert rep.counts() == {"rope": 2, **norms}, rep
    assert rep.ops_after.get("ep_fuse.rope_qk.default") == 1
    assert not rep.near_misses, [m.explain() for m in rep.near_misses]
    for o, e in zip(out, ref):
        assert torch.equal(o, e)


def test_without_the_rope_family_the_add_is_a_residual_add():
    """The rule only defers to a site that matches: with RoPE disabled, add_rms_norm takes the add."""
    torch.manual_seed(0)
    mod = NormAfterRope().to(BF16)
    args = _args()
    with torch.no_grad():
        ref = mod(*args)
    out = compile_and_run(mod, *args, executor="eager", providers={"cpu": ["reference"]}, disable=["rope"])
    assert ep_fuse.last_report().counts() == {"add_rms_norm": 2}
    for o, e in zip(out, ref):
        assert torch.equal(o, e)

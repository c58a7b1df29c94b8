"""RMSNorm / add+RMSNorm pattern variants on hand-written modules: op counts before/after, numerics, look-alikes."""

import pytest
import torch
from support.norm_cases import ulp_close
from torch import nn

import ep_fuse
from ep_fuse.testing import compile_and_run

BF16 = torch.bfloat16
EPS = 1e-6


def _n(hf, eps=EPS):
    return hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)


class Llama(nn.Module):
    """HF LlamaRMSNorm: upcast, cast n, weight on the left."""

    def __init__(self, h, eps=EPS, right=False, add=False):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(h) * 0.1 + 1)
        self.eps, self.right, self.add = eps, right, add

    def forward(self, x, r):
        h = x + r if self.add else x
        y = _n(h.to(torch.float32), self.eps).to(x.dtype)
        out = y * self.weight if self.right else self.weight * y
        return (out, h) if self.add else out


class WeightFp32(nn.Module):
    """GPT-OSS: weight multiply in fp32, then the cast."""

    def __init__(self, h, add=False):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(h) * 0.1 + 1)
        self.add = add

    def forward(self, x, r):
        h = x + r if self.add else x
        out = (self.weight * _n(h.to(torch.float32))).to(x.dtype)
        return (out, h) if self.add else out


class Gemma(nn.Module):
    """Qwen3-Next: n * (1 + w.float()), type_as."""

    def __init__(self, h, add=False):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(h) * 0.1)
        self.add = add

    def forward(self, x, r):
        h = x + r if self.add else x
        out = (_n(h.float()) * (1.0 + self.weight.float())).type_as(x)
        return (out, h) if self.add else out


class NoWeight(nn.Module):
    """Llama4 L2 q/k-norm: type_as, no weight."""

    def forward(self, x, r):
        return _n(x.float()).type_as(x)


class Fp32Model(nn.Module):
    """fp32 model: no casts at all; squares via x*x."""

    def __init__(self, h):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(h))

    def forward(self, x, r):
        h = x + r
        var = (h * h).mean(-1, keepdim=True)
        return self.weight * (h * torch.rsqrt(var + EPS)), h


class HeadDimNorm(nn.Module):
    """Qwen3-MoE q_norm: reduce over head_dim of a [B, S, H, D] view, then transpose."""

    def __init__(self, d):
        super().__init__()
        self.q = nn.Linear(4 * d, 4 * d, bias=False)
        self.norm = Llama(d)

    def forward(self, x, r):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, -1, self.norm.weight.shape[0])
        return self.norm(q, None).transpose(1, 2)


class NoUpcastBf16(nn.Module):
    """Statistics in bf16: matched (reference semantics), fused kernels decline."""

    def __init__(self, h):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(h))

    def forward(self, x, r):
        return self.weight * _n(x)


def _inputs(shape, dtype=BF16):
    g = torch.Generator().manual_seed(1)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


CASES = [
    # module factory, dtype, shape, expected {(pattern, variant): count}
    (lambda: Llama(64), BF16, (3, 7, 64), {("rms_norm", "llama"): 1}),
    (lambda: Llama(64, right=True), BF16, (5, 64), {("rms_norm", "llama"): 1}),
    (lambda: Llama(64, add=True), BF16, (5, 64), {("add_rms_norm", "llama"): 1}),
    (lambda: Llama(64, add=True), torch.float16, (5, 64), {("add_rms_norm", "llama"): 1}),
    (lambda: WeightFp32(48), BF16, (5, 48), {("rms_norm", "weight_fp32"): 1}),
    (lambda: WeightFp32(48, add=True), BF16, (5, 48), {("add_rms_norm", "weight_fp32"): 1}),
    (lambda: Gemma(40), BF16, (6, 40), {("rms_norm", "gemma"): 1}),
    (lambda: Gemma(40, add=True), BF16, (6, 40), {("add_rms_norm", "gemma"): 1}),
    (lambda: NoWeight(), BF16, (2, 3, 4, 16), {("rms_norm", "none"): 1}),
    (lambda: Fp32Model(32), torch.float32, (9, 32), {("add_rms_norm", "weight_fp32"): 1}),
    (lambda: HeadDimNorm(16), BF16, (2, 5, 64), {("rms_norm", "llama"): 1}),
    (lambda: NoUpcastBf16(32), BF16, (4, 32), {("rms_norm", "weight_fp32"): 1}),
]


def _check(report, expected):
    got = {(m.pattern, m.variant): report.count(m.pattern, m.variant) for m in report.matches}
    assert got == expected, report
    n_sites = sum(expected.values())
    assert report.ops_before.get("aten.rsqrt.default", 0) == n_sites
    assert report.ops_after.get("aten.rsqrt.default", 0) == 0
    fused = sum(v for k, v in report.ops_after.items() if k.startswith("ep_fuse"))
    assert fused == n_sites


@pytest.mark.parametrize("case", range(len(CASES)))
def test_variant_matches_and_is_bitwise_with_reference(case):
    factory, dtype, shape, expected = CASES[case]
    torch.manual_seed(0)
    mod = factory().to(dtype if dtype != torch.float32 else torch.float32)
    x, r = _inputs(shape, dtype)
    with torch.no_grad():
        ref = mod(x, r)
    out = compile_and_run(mod, x, r, executor="eager", providers={"cpu": ["reference"]})
    _check(ep_fuse.last_report(), expected)
    for o, e in zip(*(t if isinstance(t, tuple) else (t,) for t in (out, ref))):
        assert torch.equal(o, e), "the reference provider computes exactly what the model computes"


@pytest.mark.parametrize("case", range(len(CASES)))
def test_variant_with_triton_kernel(case):
    factory, dtype, shape, expected = CASES[case]
    torch.manual_seed(0)
    mod = factory().to(dtype)
    x, r = _inputs(shape, dtype)
    with torch.no_grad():
        ref = mod(x, r)
    out = compile_and_run(mod, x, r, executor="eager")
    rep = ep_fuse.last_report()
    _check(rep, expected)
    want = "reference" if isinstance(mod, NoUpcastBf16) else "triton"
    assert all(m.provider == want for m in rep.matches), rep
    for o, e in zip(*(t if isinstance(t, tuple) else (t,) for t in (out, ref))):
        ulp_close(o, e, o.dtype)


def test_dynamic_shapes_eps_as_tensor_input():
    mod = Llama(64, add=True).to(BF16)
    x, r = _inputs((4, 64))
    with torch.no_grad():
        ref = mod(x, r)
        compiled = torch.compile(mod, backend="ep_fuse", options={"executor": "eager"}, dynamic=True)
        out = compiled(x, r)
        x2, r2 = _inputs((7, 64))
        out2, ref2 = compiled(x2, r2), mod(x2, r2)
    assert ep_fuse.last_report().count("add_rms_norm") == 1
    ulp_close(out[0], ref[0], BF16)
    ulp_close(out2[0], ref2[0], BF16)
    assert torch.equal(out2[1], ref2[1])


def test_eps_attribute_becomes_tensor_input_under_dynamic():
    """HF stores eps as a float attribute; dynamic=True turns it into an f64[] graph input."""
    from ep_fuse import tiny_models

    model = tiny_models.build("mixtral")
    inp = tiny_models.example_inputs()
    with torch.no_grad():
        ref = model(**inp).logits
        out = torch.compile(model, backend="ep_fuse", options={"executor": "eager"}, dynamic=True)(**inp).logits
    rep = ep_fuse.last_report()
    assert rep.count("add_rms_norm") == 4 and rep.count("rms_norm") == 1
    torch.testing.assert_close(out.float(), ref.float(), rtol=0.05, atol=0.05)


# --------------------------------------------------------------------------- look-alikes
class MeanOverOtherDim(nn.Module):
    def forward(self, x, r):
        hf = x.float()
        return (hf * torch.rsqrt(hf.pow(2).mean(0, keepdim=True) + EPS)).to(x.dtype)


class RsqrtReused(nn.Module):
    def forward(self, x, r):
        hf = x.float()
        rstd = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS)
        return (hf * rstd).to(x.dtype), rstd


class CubeNotSquare(nn.Module):
    def forward(self, x, r):
        hf = x.float()
        return (hf * torch.rsqrt(hf.abs().pow(3).mean(-1, keepdim=True) + EPS)).to(x.dtype)


class OtherTensorScaled(nn.Module):
    def forward(self, x, r):
        hf = x.float()
        return (r.float() * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


class PerRowEps(nn.Module):
    def forward(self, x, r):
        hf = x.float()
        eps = r.float().abs()[..., :1]  # [T, 1] tensor "eps"
        return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize(
    "mod, why",
    [
        (MeanOverOtherDim(), "failed at mean: guard reduces_last_dim: mean over dim 0 of a 2-D tensor"),
        (RsqrtReused(), "failed at rsqrt: is also used outside the pattern (by output)"),
        (CubeNotSquare(), "failed at abs_1: must be the same node as '_to_copy' (xf)"),
        (OtherTensorScaled(), "failed at _to_copy: must be the same node as '_to_copy_1' (xf)"),
        (PerRowEps(), "failed at slice_1: eps must be a number or a 0-d floating tensor"),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else "",
)
def test_look_alikes_do_not_match(mod, why):
    x, r = _inputs((6, 32))
    with torch.no_grad():
        ref = mod(x, r)
    out = compile_and_run(mod, x, r, executor="eager")
    rep = ep_fuse.last_report()
    assert rep.matches == [], rep
    assert len(rep.near_misses) == 1 and rep.near_misses[0].anchor.startswith("rsqrt")
    assert why in rep.near_misses[0].explain()
    for o, e in zip(*(t if isinstance(t, tuple) else (t,) for t in (out, ref))):
        assert torch.equal(o, e)


class BroadcastWeight(nn.Module):
    """A [T, H] 'weight' is not an RMSNorm weight: the norm fuses, the multiply stays."""

    def forward(self, x, r):
        return r * _n(x.float()).to(x.dtype)


class BroadcastResidual(nn.Module):
    """x + bias[H] broadcasts: no add+norm; the plain norm of the sum fuses."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(32))
        self.weight = nn.Parameter(torch.randn(32))

    def forward(self, x, r):
        h = x + self.bias
        return self.weight * _n(h.float()).to(x.dtype), h


class ScaledAdd(nn.Module):
    """torch.add(x, r, alpha=2) is not a residual add."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(32))

    def forward(self, x, r):
        h = torch.add(x, r, alpha=2)
        return self.weight * _n(h.float()).to(x.dtype), h


class MixedDtypeAdd(nn.Module):
    """bf16 + fp32 residual (promotes): no add+norm."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(32))

    def forward(self, x, r):
        h = x + r.float()
        return (self.weight * _n(h)), h


@pytest.mark.parametrize(
    "mod, expected",
    [
        (BroadcastWeight(), {("rms_norm", "none"): 1}),
        (BroadcastResidual(), {("rms_norm", "llama"): 1}),
        (ScaledAdd(), {("rms_norm", "llama"): 1}),
        (MixedDtypeAdd(), {("rms_norm", "weight_fp32"): 1}),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else "",
)
def test_partial_look_alikes_fuse_only_the_safe_part(mod, expected):
    mod = mod.to(BF16) if not isinstance(mod, MixedDtypeAdd) else mod.to(torch.float32)
    x, r = _inputs((6, 32))
    with torch.no_grad():
        ref = mod(x, r)
    out = compile_and_run(mod, x, r, executor="eager", providers={"cpu": ["reference"]})
    rep = ep_fuse.last_report()
    assert {(m.pattern, m.variant): 1 for m in rep.matches} == expected, rep
    for o, e in zip(*(t if isinstance(t, tuple) else (t,) for t in (out, ref))):
        assert torch.equal(o, e)


def test_disable_and_patterns_options():
    mod = Llama(64, add=True).to(BF16)
    x, r = _inputs((4, 64))
    compile_and_run(mod, x, r, executor="eager", disable=["add_rms_norm"])
    rep = ep_fuse.last_report()
    assert rep.count("add_rms_norm") == 0 and rep.count("rms_norm") == 1
    torch._dynamo.reset()
    compile_and_run(mod, x, r, executor="eager", patterns=["add_rms_norm"])
    assert ep_fuse.last_report().counts() == {"add_rms_norm": 1}

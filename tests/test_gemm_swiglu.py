"""Dense GEMM + SwiGLU: forms, look-alikes that must not match, kernel vs reference, Ascend double."""


import pytest
import torch
from support.norm_cases import ulp_close
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import ep_fuse
from ep_fuse.ops import choose
from ep_fuse.ops import gemm_swiglu as gemm_swiglu_ops
from ep_fuse.ops.gemm_swiglu import gemm_swiglu_ref
from ep_fuse.providers.npu import gemm_swiglu as npu_gemm_swiglu
from support.compiling import compile_and_run

BF16 = torch.bfloat16
F = nn.functional


class Mlp(nn.Module):
    """Llama-style MLP: down(silu(gate(x)) * up(x)); ``swapped`` writes up(x) * silu(gate(x))."""

    def __init__(self, h=32, i=48, swapped=False):
        super().__init__()
        self.gate, self.up = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False)
        self.down = nn.Linear(i, h, bias=False)
        self.swapped = swapped

    def forward(self, x):
        a = self.up(x) * F.silu(self.gate(x)) if self.swapped else F.silu(self.gate(x)) * self.up(x)
        return self.down(a)


class FusedGateUp(nn.Module):
    """Phi-3 style: one gate_up projection, chunked."""

    def __init__(self, h=32, i=48):
        super().__init__()
        self.gate_up = nn.Linear(h, 2 * i, bias=False)

    def forward(self, x):
        g, u = self.gate_up(x).chunk(2, dim=-1)
        return F.silu(g) * u


class RmsNormGated(nn.Module):
    """Qwen3-Next RMSNormGated: normed * silu(gate.float()) -- silu of an activation, not of a GEMM."""

    def __init__(self, h=32):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))

    def forward(self, x, gate):
        xf = x.float()
        n = (self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)).float()
        return (n * F.silu(gate.float())).to(x.dtype)


class GptOssGlu(nn.Module):
    """GPT-OSS: clamp, sigmoid(1.702 g) * g * (u + 1), interleaved gate/up: not SwiGLU."""

    def __init__(self, h=32, i=48):
        super().__init__()
        self.gate_up = nn.Linear(h, 2 * i, bias=False)

    def forward(self, x):
        gu = self.gate_up(x)
        g, u = gu[..., ::2].clamp(max=7.0), gu[..., 1::2].clamp(-7.0, 7.0)
        return (g * torch.sigmoid(g * 1.702)) * (u + 1)


def _x(shape=(3, 5, 32), seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(BF16)


@pytest.mark.parametrize(
    "mod, shape, variant",
    [(Mlp(), (3, 5, 32), "two_gemm"), (Mlp(swapped=True), (3, 5, 32), "two_gemm"),
     (Mlp(), (7, 32), "two_gemm_2d"), (FusedGateUp(), (4, 32), "concat_gemm"),
     (FusedGateUp(), (3, 5, 32), "concat_gemm_nd")],
    ids=["mlp", "up_times_silu", "2d", "fused_gate_up", "fused_gate_up_3d"],
)
def test_forms_match_and_match_eager(mod, shape, variant):
    torch.manual_seed(0)
    mod = mod.to(BF16)
    x = _x(shape)
    with torch.no_grad():
        ref = mod(x)
    out = compile_and_run(mod, x, executor="eager", providers={"cpu": ["reference"]})
    rep = ep_fuse.last_report()
    assert [(m.pattern, m.variant) for m in rep.matches] == [("gemm_swiglu", variant)], rep
    assert rep.ops_before.get("aten.silu.default") == 1 and rep.ops_after.get("aten.silu.default", 0) == 0
    assert rep.ops_after.get("ep_fuse.gemm_swiglu.default") == 1
    if variant.startswith("concat_gemm"):  # two GEMMs over the weight halves vs one over the whole: blocking may differ
        ulp_close(out, ref, BF16)
    else:
        assert torch.equal(out, ref)
    torch._dynamo.reset()
    out = compile_and_run(mod, x, executor="eager", perf_guard=False)  # the kernel, though measured slower
    assert ep_fuse.last_report().matches[0].provider == "triton"
    ulp_close(out, ref, BF16)


class ChunkOverTokens(nn.Module):
    """The 3-D gate|up product chunked over the sequence dim: not a SwiGLU of one token's features."""

    def __init__(self, h=32, i=48):
        super().__init__()
        self.gate_up = nn.Linear(h, 2 * i, bias=False)

    def forward(self, x):
        g, u = self.gate_up(x).chunk(2, dim=1)
        return F.silu(g) * u


class ViewMixesTokens(nn.Module):
    """The product viewed back with features folded into tokens before the chunk."""

    def __init__(self, h=32, i=48):
        super().__init__()
        self.gate_up = nn.Linear(h, 2 * i, bias=False)

    def forward(self, x):
        y = F.linear(x.view(-1, x.shape[-1]), self.gate_up.weight).view(x.shape[0], -1, 2 * 12)
        g, u = y.chunk(2, dim=-1)
        return F.silu(g) * u


@pytest.mark.parametrize("mod, shape, why", [
    (ChunkOverTokens(), (3, 4, 32), "split over dim 1, not the features"),
    (ViewMixesTokens(), (3, 5, 32), "the gate|up product is viewed as [3, 20, 24], not x's tokens by 2I"),
], ids=["chunk_over_tokens", "view_mixes_tokens"])
def test_nd_concat_look_alikes_are_near_misses(mod, shape, why):
    mod = mod.to(BF16)
    x = _x(shape)
    with torch.no_grad():
        ref = mod(x)
    out = compile_and_run(mod, x, executor="eager")
    rep = ep_fuse.last_report()
    assert rep.count("gemm_swiglu") == 0, rep
    text = "\n".join(m.explain() for m in rep.near_misses)
    assert why in text, text
    assert torch.equal(out, ref)


class Fp32ActMlp(nn.Module):
    """Beam's MLP: low-precision GEMMs, ``(silu(gate.float()) * up.float()).to(dtype)``. ``to_fp16``: the fp32
    product rounded to fp16 in a bf16 model (then back), a look-alike."""

    def __init__(self, h=32, i=48, variant="ok"):
        super().__init__()
        self.gate, self.up = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False)
        self.down = nn.Linear(i, h, bias=False)
        self.variant = variant

    def forward(self, x):
        g, u = self.gate(x), self.up(x)
        a = F.silu(g.float()) * u.float()
        a = a.to(torch.float16).to(g.dtype) if self.variant == "to_fp16" else a.to(g.dtype)
        return self.down(a)


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize("shape, variant", [((3, 5, 32), "two_gemm_fp32_act"), ((7, 32), "two_gemm_2d_fp32_act")],
                         ids=["3d", "2d"])
def test_swiglu_in_fp32_of_low_precision_gemms(shape, variant, dtype):
    """Beam's fp32 SwiGLU: ``gemm_swiglu(x, w_gate, w_up, act_fp32=True)``, bitwise the module through the reference
    (one rounding of the fp32 product, not three); the Triton kernel rounds the silu to the input dtype and declines."""
    torch.manual_seed(0)
    mod = Fp32ActMlp().to(dtype)
    x = _x(shape).to(dtype)
    with torch.no_grad():
        ref = mod(x)
        wg, wu = mod.gate.weight, mod.up.weight
        act = gemm_swiglu_ref(x, wg, wu, True)
        assert torch.equal(act, (F.silu(mod.gate(x).float()) * mod.up(x).float()).to(dtype))
        assert not torch.equal(act, gemm_swiglu_ref(x, wg, wu)), "the flag changes the rounding"
    out = compile_and_run(mod, x, executor="eager")
    rep = ep_fuse.last_report()
    assert [(m.pattern, m.variant, m.provider) for m in rep.matches] == [("gemm_swiglu", variant, "reference")], rep
    assert any(p == "triton" and "act_fp32" in why for p, why in rep.matches[0].declined), rep.matches[0].declined
    assert torch.equal(out, ref)
    assert "act_fp32" in npu_gemm_swiglu.gemm_swiglu_supports((x, wg, wu, True))
    assert npu_gemm_swiglu.gemm_swiglu_supports((x, wg, wu)) is None


def test_swiglu_in_fp32_cast_to_another_dtype_is_a_near_miss():
    mod = Fp32ActMlp(variant="to_fp16").to(BF16)
    x = _x()
    with torch.no_grad():
        ref = mod(x)
    out = compile_and_run(mod, x, executor="eager")
    rep = ep_fuse.last_report()
    assert rep.count("gemm_swiglu") == 0, rep
    text = "\n".join(m.explain() for m in rep.near_misses)
    assert "the fp32 SwiGLU is cast to torch.float16, not the input's torch.bfloat16" in text, text
    assert torch.equal(out, ref)


@pytest.mark.parametrize("mod, args", [(RmsNormGated(), (_x(), _x(seed=1))), (GptOssGlu(), (_x(),))],
                         ids=["RMSNormGated", "GptOssGlu"])
def test_look_alikes_are_not_swiglu(mod, args):
    mod = mod.to(BF16)
    with torch.no_grad():
        ref = mod(*args)
    out = compile_and_run(mod, *args, executor="eager")
    rep = ep_fuse.last_report()
    assert rep.count("gemm_swiglu") == 0, rep
    assert not [m for m in rep.near_misses if "gemm_swiglu" in m.explain()], "not even a candidate"
    assert torch.equal(out, ref)


@pytest.mark.parametrize("executor", ["inductor", "eager"])
@pytest.mark.parametrize("rows, provider", [(1, "triton"), (32, "triton"), (33, "reference")])
def test_kernel_only_at_measured_decode_sizes(executor, rows, provider):
    mod = Mlp().to(BF16)
    x = _x((rows, 32))
    with torch.no_grad():
        ref = mod(x)
        out = torch.compile(mod, backend="ep_fuse", options={"executor": executor})(x)
    m = ep_fuse.last_report().matches[0]
    assert m.provider == provider, m.declined
    if provider == "reference":
        assert "measured faster above 32 rows" in m.declined[0][1]
    ulp_close(out, ref, BF16)


def test_symbolic_row_count_chooses_at_run_time(caplog):
    """A symbolic row count: the provider's by-size op runs the kernel up to 32 rows, the reference above."""
    mod = Mlp().to(BF16)
    f = torch.compile(mod, backend="ep_fuse", dynamic=True)
    with torch.no_grad(), caplog.at_level("DEBUG", logger="ep_fuse.ops"):
        for rows in (5, 40):
            caplog.clear()
            x = _x((rows, 32))
            ulp_close(f(x), mod(x), BF16)
            assert ("the reference at run time" in caplog.text) == (rows > 32), caplog.text
    rep = ep_fuse.last_report()
    assert len(ep_fuse.reports()) == 1, "one graph for both row counts"
    m = rep.matches[0]
    assert m.provider == "triton" and not m.declined, m.declined
    assert m.run_time == ["gemm_swiglu: the kernel up to 32 rows and on the TMA kernel's measured wins, the reference "
                          "(cuBLAS + SwiGLU) elsewhere"]
    assert rep.ops_after.get("ep_fuse_triton.gemm_swiglu_by_size.default") == 1
    assert not rep.shape_guards


@settings(max_examples=25, deadline=None)
@given(t=st.integers(0, 70), h=st.sampled_from([8, 32, 40, 96]), i=st.sampled_from([8, 24, 64, 72]),
       dtype=st.sampled_from([BF16, torch.float16, torch.float32]), seed=st.integers(0, 2**16))
def test_triton_kernel_matches_reference(t, h, i, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    wg = (torch.randn(i, h, generator=g) / h**0.5).to(dtype)
    wu = (torch.randn(i, h, generator=g) / h**0.5).to(dtype)
    out, ref = torch.ops.ep_fuse_triton.gemm_swiglu(x, wg, wu), gemm_swiglu_ref(x, wg, wu)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    ulp_close(out, ref, dtype)  # fp32 accumulation order differs from the CPU GEMM


@pytest.mark.parametrize("swap", [True, False], ids=["swapped", "plain"])
@pytest.mark.parametrize("t", [1, 17, 40])
def test_both_tile_orientations_match_reference(swap, t):
    from ep_fuse.providers.triton.gemm_swiglu_kernel import GemmConfig, launch

    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, 96, generator=g).to(BF16)
    wg, wu = ((torch.randn(40, 96, generator=g) / 10).to(BF16) for _ in range(2))
    y = torch.empty(t, 40, dtype=BF16)
    launch(x, wg, wu, y, config=GemmConfig(16, 16, 32, 4, 1, 1, swap_ab=swap))
    ulp_close(y, gemm_swiglu_ref(x, wg, wu), BF16)


def test_opcheck():
    args = (_x((2, 3, 32)), _x((40, 32), 1), _x((40, 32), 2))
    torch.library.opcheck(torch.ops.ep_fuse.gemm_swiglu.default, args)
    torch.library.opcheck(torch.ops.ep_fuse_triton.gemm_swiglu.default, args)


def test_npu_gemm_swiglu_with_the_double(torch_npu_double):
    x, wg, wu = _x((2, 3, 32)), _x((40, 32), 1) / 6, _x((40, 32), 2) / 6
    assert choose(gemm_swiglu_ops.gemm_swiglu, (x, wg, wu), "npu").provider == "npu"
    ulp_close(npu_gemm_swiglu.gemm_swiglu_kernel(x, wg, wu), gemm_swiglu_ref(x, wg, wu), BF16)
    first = npu_gemm_swiglu.concat_weights(wg, wu)
    assert npu_gemm_swiglu.concat_weights(wg, wu) is first, "the gate|up concatenation is made once"
    wg.mul_(2)
    assert npu_gemm_swiglu.concat_weights(wg, wu) is not first, "an in-place weight update invalidates it"

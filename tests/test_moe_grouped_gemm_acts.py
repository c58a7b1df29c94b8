"""The grouped GEMM's gated-activation epilogues (``ep_fuse.ops.moe.ACTS``) vs the canonical reference, the
NPU provider's declines, and the CUDA gate of the variants not yet checked on a GPU; the GeGLU activations
(``gelu_tanh``, ``gelu``) end to end: reference vs HF-style experts, the ``moe_experts`` sites they fuse at, the
look-alikes that must not."""

import importlib
from types import SimpleNamespace

import pytest
import torch
from support.norm_cases import ulp_close

import ep_fuse
import ep_fuse.providers  # noqa: F401  (registers torch.ops.ep_fuse_triton.*)
from ep_fuse.ops.moe import ACTS, GELU_ACTS, HF_GELU_NAMES, act_problem, gated_act, grouped_gemm_swiglu_ref, moe_experts_ref
from ep_fuse.ops.moe_masked import moe_experts_masked_ref, valid_rows
from ep_fuse.providers.npu.moe import gemm_swiglu_supports
from ep_fuse.providers.triton.grouped_gemm import check_grouped_gemm_swiglu_call, grouped_gemm_swiglu_kernel
from ep_fuse.providers.triton.moe_masked import check_moe_experts_masked_call, moe_experts_masked_kernel
from ep_fuse.providers.triton.unverified import ENV, UNVERIFIED_ON_GPU
from support.compiling import compile_and_run

gk = importlib.import_module("ep_fuse.providers.triton.grouped_gemm_kernel")
BF16, F32 = torch.bfloat16, torch.float32
ACT_ARGS = {"silu_clamp": ("silu_clamp", 0.75, None, None), "silu_clamp_post": ("silu_clamp_post", 0.5, None, None),
            "silu_fp32": ("silu_fp32", None, None, None), "softcap_fp32": ("softcap_fp32", None, 0.5, 0.8),
            "softcap_gate_only": ("softcap_fp32", None, 0.5, None), "gelu_tanh": ("gelu_tanh", None, None, None),
            "gelu": ("gelu", None, None, None)}
GELU = ("gelu_tanh", "gelu")


def case(counts, tail, n, k, dtype, seed=0):
    """``(x [M, k], w13 [E, n, k], seg_indptr)``; weights large enough that the clamps and caps bind."""
    g = torch.Generator().manual_seed(seed)
    seg = torch.tensor([0, *counts], dtype=torch.int64).cumsum(0)
    x = torch.randn(sum(counts) + tail, k, generator=g).to(dtype)
    w = (3 * torch.randn(len(counts), n, k, generator=g) / k**0.5).to(dtype)
    return x, w, seg


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("name", sorted(ACT_ARGS))
@pytest.mark.parametrize("regime", ["decode", "prefill"])
def test_epilogue_matches_the_reference(name, dtype, regime):
    counts = [1, 0, 2, 1] if regime == "decode" else [9, 0, 20, 3]
    x, w, seg = case(counts, 3, 16, 32, dtype, seed=1)
    act = ACT_ARGS[name]
    out, ref = grouped_gemm_swiglu_kernel(x, w, seg, *act), grouped_gemm_swiglu_ref(x, w, seg, *act)
    plain = grouped_gemm_swiglu_ref(x, w, seg)
    assert out.shape == ref.shape and out.dtype == ref.dtype and out.stride() == ref.stride()
    end = int(seg[-1])
    assert torch.equal(out[end:], torch.zeros_like(out[end:])), "tail rows must be zero"
    if dtype == F32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        ulp_close(out, ref, dtype)
    if name == "silu_fp32":  # one rounding instead of two: ulps apart from SwiGLU in bf16, equal in fp32
        assert torch.equal(ref, plain) == (dtype == F32)
    else:  # the activation changes the result: the epilogue is not SwiGLU's
        assert not torch.allclose(ref.float(), plain.float(), rtol=1e-2, atol=1e-2)


def test_activation_arguments_are_checked():
    assert act_problem("gelu_new", None, None, None).startswith("unknown activation")
    assert "limit" in act_problem("gelu_tanh", 1.0, None, None)
    assert "soft caps" in act_problem("gelu", None, 1.0, None)
    assert "limit" in act_problem("silu_clamp", None, None, None)
    assert "limit" in act_problem("silu", 1.0, None, None)
    assert "soft caps" in act_problem("silu_fp32", None, 1.0, None)
    assert "positive" in act_problem("silu_clamp", -1.0, None, None)
    assert all(act_problem(*ACT_ARGS[n]) is None for n in ACT_ARGS)
    x, w, seg = case([2], 0, 8, 16, BF16)
    with pytest.raises(ValueError, match="unknown activation"):
        grouped_gemm_swiglu_ref(x, w, seg, "gelu_new")
    assert "unknown activation" in check_grouped_gemm_swiglu_call((x, w, seg, "gelu_new", None, None, None))


def test_new_epilogues_are_declined_on_cuda_until_checked(monkeypatch):
    """Every epilogue passed tests/gpu/test_gpu_moe_forms.py and is cleared (relu², swigluoai and the GeGLUs of
    the grouped GEMM and the masked layout too); the mechanism declines what is listed."""
    listed = {f"grouped_gemm_swiglu:{a}" for a in ACTS} & set(UNVERIFIED_ON_GPU)
    assert listed == set()
    assert not {f"moe_experts_masked:{a}" for a in GELU} & set(UNVERIFIED_ON_GPU)
    monkeypatch.delenv(ENV, raising=False)
    from ep_fuse.providers.triton import unverified as listed

    monkeypatch.setitem(listed.UNVERIFIED_ON_GPU, "grouped_gemm_swiglu:silu_clamp", "not checked")
    x, w, seg = case([2], 0, 8, 16, BF16)

    def on_cuda(t):
        return SimpleNamespace(dtype=t.dtype, shape=t.shape, device=torch.device("cuda"), dim=t.dim,
                               stride=t.stride)

    cuda = (on_cuda(x), on_cuda(w), on_cuda(seg))
    from ep_fuse.providers.triton import unverified

    assert unverified.gpu_unverified("grouped_gemm_swiglu:silu_clamp", cuda[0]) is not None
    assert unverified.gpu_unverified("grouped_gemm_swiglu:silu_clamp", x) is None  # the interpreter runs it
    assert check_grouped_gemm_swiglu_call((x, w, seg, *ACT_ARGS["silu_clamp"])) is None
    for act in GELU:
        assert unverified.gpu_unverified(f"grouped_gemm_swiglu:{act}", cuda[0]) is None
        assert unverified.gpu_unverified(f"moe_experts_masked:{act}", cuda[0]) is None
        assert check_grouped_gemm_swiglu_call((x, w, seg, *ACT_ARGS[act])) is None
        monkeypatch.setenv(ENV, "1")
        assert unverified.gpu_unverified(f"grouped_gemm_swiglu:{act}", cuda[0]) is None
        monkeypatch.delenv(ENV)


@pytest.mark.parametrize("name, ok", [("silu_fp32", True), ("silu_clamp", False), ("silu_clamp_post", False),
                                      ("softcap_fp32", False), ("gelu_tanh", False), ("gelu", False)])
def test_npu_takes_fp32_swiglu_and_declines_the_rest(name, ok):
    x, w, seg = case([2, 3], 1, 8, 16, BF16)
    reason = gemm_swiglu_supports((x, w, seg, *ACT_ARGS[name]))
    assert (reason is None) == ok, reason
    if name in GELU:
        assert "npu_swiglu computes SwiGLU only" in reason and "npu_gelu_mul" in reason
    elif not ok:
        assert "npu_swiglu computes plain SwiGLU only" in reason
    assert gemm_swiglu_supports((x, w, seg)) is None


# --------------------------------------------------------------------------- GeGLU (gelu_tanh, gelu)
def _routing(t=13, e=4, k=2, seed=3, dtype=BF16, h=32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    w, ids = torch.randn(t, e, generator=g).softmax(-1).topk(k)
    return x, ids, w


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_hf_gelu_names_are_the_acts_exactly(dtype):
    """``ACT2FN[name](g) * u`` is ``gated_act`` bit for bit for the names mapped (``F.gelu`` itself); the Python
    formulas of the other tanh-GELU names round differently, which is why they are not mapped (and do not match)."""
    from transformers.activations import ACT2FN

    g = torch.Generator().manual_seed(0)
    gate, up = (4 * torch.randn(2, 4096, generator=g)).to(dtype)
    for name, act in HF_GELU_NAMES.items():
        assert torch.equal(ACT2FN[name](gate) * up, gated_act(gate, up, act)), name
    for name in ("gelu_new", "gelu_fast", "gelu_python_tanh"):
        assert not torch.equal(ACT2FN[name](gate) * up, gated_act(gate, up, "gelu_tanh")), name
    assert not torch.equal(gated_act(gate, up, "gelu_tanh"), gated_act(gate, up, "gelu"))


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("hf_name", sorted(HF_GELU_NAMES))
def test_geglu_reference_matches_hf_experts(hf_name, dtype, impl):
    from support.geglu_moe_modules import GeGLUExperts

    mod = GeGLUExperts(4, 32, 16, dtype=dtype, impl=impl, scale=3.0, act=hf_name)
    x, ids, w = _routing(dtype=dtype)
    w = w.to(dtype) if impl == "batched_mm" else w  # batched_mm's slot weights multiply in the activation dtype
    with torch.no_grad():
        eager = mod(x, ids, w)
        ref = moe_experts_ref(x, ids, w, mod.gate_up_proj, mod.down_proj, dtype, HF_GELU_NAMES[hf_name])
        other = moe_experts_ref(x, ids, w, mod.gate_up_proj, mod.down_proj, dtype,
                                "gelu" if HF_GELU_NAMES[hf_name] == "gelu_tanh" else "gelu_tanh")
    if impl == "grouped_mm" and dtype == BF16:
        assert torch.equal(ref, eager), "the reference rounds as HF's grouped_mm experts do"
    tol = 1e-5 if dtype == F32 else 2e-2 * eager.float().abs().max().item()
    torch.testing.assert_close(ref.float(), eager.float(), rtol=1e-5 if dtype == F32 else 2e-2, atol=tol)
    if dtype == F32:  # the two GELUs differ by more than the tolerance: the comparison tells them apart
        assert not torch.allclose(other, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl, provider", [("grouped_mm", "reference"), ("batched_mm", "reference"),
                                            ("grouped_mm", "triton")])  # (the stages do not depend on the variant)
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("hf_name", sorted(HF_GELU_NAMES))
def test_geglu_experts_fuse(hf_name, dtype, impl, provider):
    """One ``moe_experts`` site per block, with the act of the GELU the model calls; with the pattern disabled the
    graph keeps its ``aten.gelu`` and two expert GEMMs, fused it keeps neither; compiled equals eager."""
    from support.geglu_moe_modules import GeGLUExperts

    mod = GeGLUExperts(4, 32, 16, dtype=dtype, impl=impl, scale=3.0, act=hf_name)
    x, ids, w = _routing(dtype=dtype)
    with torch.no_grad():
        ref = mod(x, ids, w)
    opts = dict(executor="eager", providers={"cpu": [provider]})
    compile_and_run(mod, x, ids, w, disable=("moe_experts",), **opts)
    before = ep_fuse.last_report()
    gemm = "aten._grouped_mm.default" if impl == "grouped_mm" and dtype == BF16 else None
    assert before.count("moe_experts") == 0 and before.ops_after.get("aten.gelu.default") == 1, before.ops_after
    if gemm:
        assert before.ops_after.get(gemm) == 2
    torch._dynamo.reset()
    out = compile_and_run(mod, x, ids, w, **opts)
    rep = ep_fuse.last_report()
    assert rep.count("moe_experts") == 1, rep.summary()
    assert [m.variant for m in rep.matches if m.pattern == "moe_experts"] == [impl]
    assert rep.matches[0].stages["grouped_gemm_swiglu"] == provider
    assert "aten.gelu.default" not in rep.ops_after and (gemm is None or gemm not in rep.ops_after), rep.ops_after
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if dtype == F32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.float().abs().max().item())
    if provider == "reference" and impl == "grouped_mm" and dtype == BF16:
        assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("lookalike", ["gelu_on_up", "gelu_new", "gelu_fast"])
def test_geglu_lookalikes_are_not_fused(lookalike, dtype):
    """The GELU on the up half, and the Python tanh-GELU formulas (rounded op by op): no ``moe_experts``, the graph
    runs as written."""
    from support.geglu_moe_modules import GeGLUExperts, GeluOnUp

    mod = (GeluOnUp(4, 32, 16, dtype=dtype, scale=3.0) if lookalike == "gelu_on_up"
           else GeGLUExperts(4, 32, 16, dtype=dtype, scale=3.0, act=lookalike))
    x, ids, w = _routing(dtype=dtype)
    with torch.no_grad():
        ref = mod(x, ids, w)
    out = compile_and_run(mod, x, ids, w, executor="eager")
    rep = ep_fuse.last_report()
    assert "moe_experts" not in rep.counts(), rep.summary()
    assert any(m.anchor_op.startswith("aten.sort") for m in rep.near_misses), [m.explain() for m in rep.near_misses]
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-5 if dtype == F32 else 1e-2, atol=1e-5)


@pytest.mark.parametrize("quant", ["w8a8_int8", "fp8_block"])
def test_geglu_blocks_stay_unquantized(quant):
    """The quantized blocks compute SwiGLU only: a GeGLU block keeps bf16 (and its act) under ``quant``."""
    from support.geglu_moe_modules import GeGLUExperts

    mod = GeGLUExperts(4, 128, 128, scale=3.0)
    x, ids, w = _routing(h=128)
    with torch.no_grad():
        ref = mod(x, ids, w)
    out = compile_and_run(mod, x, ids, w, executor="eager", providers={"cpu": ["reference"]}, quant=quant)
    rep = ep_fuse.last_report()
    assert rep.count("moe_experts") == 1 and not any(quant.split("_")[0] in op for op in rep.ops_after), rep.ops_after
    assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("act", GELU)
def test_masked_layout_geglu_kernel(act, dtype):
    """The masked expert layout's kernels (EP's expert-major receive buffer) with the GeGLU epilogue."""
    e, m, h, i = 2, 12, 32, 16
    g = torch.Generator().manual_seed(0)
    w13 = (3 * torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) / i**0.5).to(dtype)
    x = torch.randn(e, m, h, generator=g).to(dtype)
    c = torch.tensor([12, 3], dtype=torch.int32)
    args = (x, c, w13, w2, 0, *ACT_ARGS[act])
    assert check_moe_experts_masked_call(args) is None
    out, ref = moe_experts_masked_kernel(*args), moe_experts_masked_ref(*args)
    keep = valid_rows(c, m)
    if dtype == F32:
        torch.testing.assert_close(out[keep], ref[keep], rtol=1e-5, atol=1e-5)
    else:
        ulp_close(out[keep], ref[keep], dtype)
    plain = moe_experts_masked_ref(x, c, w13, w2)
    assert not torch.allclose(ref[keep].float(), plain[keep].float(), rtol=1e-2, atol=1e-2)

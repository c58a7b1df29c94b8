"""GPT-OSS's clamped activation on gate|up halves (MiniMax-M3, ``act="swigluoai"`` of ``moe_experts``): reference,
Triton epilogue, the traced HF forms and look-alikes (``tests/support/oai_moe_modules.py``)."""

import pytest
import torch
from support import oai_moe_modules as O
from support.compiling import compile_and_run
from support.norm_cases import ulp_close

import ep_fuse
import ep_fuse.providers  # noqa: F401  (registers torch.ops.ep_fuse_triton.*)
from ep_fuse.ops.moe import SWIGLUOAI_ALPHA, act_problem, grouped_gemm_swiglu_ref, moe_experts_ref
from ep_fuse.providers.npu.moe import gemm_swiglu_supports
from ep_fuse.providers.triton.grouped_gemm import grouped_gemm_swiglu_kernel
from ep_fuse.providers.triton.unverified import UNVERIFIED_ON_GPU

BF16, F32 = torch.bfloat16, torch.float32
OAI = ("swigluoai", 0.75, None, None)
STAGES = ("moe_permute", "grouped_gemm_swiglu", "grouped_gemm", "moe_unpermute")


def _case(counts, tail, n, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    seg = torch.tensor([0, *counts], dtype=torch.int64).cumsum(0)
    x = torch.randn(sum(counts) + tail, k, generator=g).to(dtype)
    w = (3 * torch.randn(len(counts), n, k, generator=g) / k**0.5).to(dtype)
    return x, w, seg


def _routed(dtype, t=13, h=32, e=4, k=2, seed=3):
    g = torch.Generator().manual_seed(seed)
    w, ids = torch.randn(t, e, generator=g).softmax(-1).topk(k)
    return torch.randn(t, h, generator=g).to(dtype), ids, w


def test_reference_is_the_model_code():
    x, w13, seg = _case([3, 0, 4], 2, 32, 16, F32)
    out = grouped_gemm_swiglu_ref(x, w13, seg, *OAI)
    rows = []
    for r, e in enumerate([0, 0, 0, 2, 2, 2, 2]):
        gu = w13[e] @ x[r]
        g, u = gu[:16].clamp(max=0.75), gu[16:].clamp(-0.75, 0.75)
        rows.append((u + 1) * g * torch.sigmoid(SWIGLUOAI_ALPHA * g))
    torch.testing.assert_close(out[:7], torch.stack(rows), rtol=1e-5, atol=1e-6)
    assert torch.equal(out[7:], torch.zeros(2, 16))
    assert act_problem("swigluoai", None, None, None) is not None, "a limit is required"
    assert "swigluoai" in act_problem("swigluoai", 1.0, 2.0, None)
    assert "grouped_gemm_swiglu:swigluoai" not in UNVERIFIED_ON_GPU  # cleared by tests/gpu/test_gpu_moe_forms.py
    assert "npu_swiglu computes plain SwiGLU only" in gemm_swiglu_supports((x, w13, seg, *OAI))


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("regime", ["decode", "prefill"])
def test_triton_epilogue_matches_the_reference(dtype, regime):
    counts = [1, 0, 2, 1] if regime == "decode" else [9, 0, 20, 3]
    x, w13, seg = _case(counts, 3, 32, 32, dtype, seed=1)
    out, ref = grouped_gemm_swiglu_kernel(x, w13, seg, *OAI), grouped_gemm_swiglu_ref(x, w13, seg, *OAI)
    assert out.shape == ref.shape and out.dtype == ref.dtype and out.stride() == ref.stride()
    end = int(seg[-1])
    assert torch.equal(out[end:], torch.zeros_like(out[end:]))
    if dtype == F32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        ulp_close(out, ref, dtype)
    clamped = grouped_gemm_swiglu_ref(x, w13, seg, "silu_clamp", 0.75)
    assert not torch.allclose(ref.float(), clamped.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("provider", ["reference", "triton"])
def test_minimax_m3_experts_fuse(impl, dtype, provider):
    mod = O.OaiSwiGLU(4, 32, 16, dtype=dtype, impl=impl, scale=3.0)
    args = _routed(dtype)
    with torch.no_grad():
        ref = mod(*args)
    out = compile_and_run(mod, *args, executor="eager", providers={"cpu": [provider]})
    rep = ep_fuse.last_report()
    assert rep.count("moe_experts") == 1, rep.summary()
    assert [m.variant for m in rep.matches] == [impl]
    assert rep.matches[0].stages == {s: provider for s in STAGES}
    assert rep.ops_after.get("aten.sigmoid.default", 0) == 0
    assert out.dtype == ref.dtype and out.shape == ref.shape and out.stride() == ref.stride()
    if dtype == F32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.float().abs().max().item())
    if provider == "reference" and impl == "grouped_mm" and dtype != torch.float32:
        # bf16: the same rounding points as HF, bit for bit; fp32 (checked at 1e-5 above) differs by an ulp on CPUs
        # whose GEMM kernels sum _grouped_mm's fallback and mm in different orders (seen on AMD EPYC)
        assert torch.equal(out, ref), "the reference rounds as HF does"
    x, ids, w = args
    plain = moe_experts_ref(x, ids, w, mod.gate_up_proj, mod.down_proj, x.dtype, "silu_clamp", 0.75)
    assert not torch.allclose(plain.float(), ref.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("cls_name, reason", [
    ("OtherAlpha", "the kernels scale by 1.702 only"),
    ("OtherShift", "expected 1.0, got 2.0"),
    ("UnclampedGate", "expected aten.clamp.default"),
])
def test_lookalikes_are_not_fused(cls_name, reason):
    mod = getattr(O, cls_name)(4, 32, 16, scale=3.0)
    args = _routed(BF16)
    with torch.no_grad():
        ref = mod(*args)
    out = compile_and_run(mod, *args, executor="eager")
    rep = ep_fuse.last_report()
    assert "moe_experts" not in rep.counts(), rep.summary()
    assert any(reason in m.explain() for m in rep.near_misses), [m.explain() for m in rep.near_misses]
    assert torch.equal(out, ref)

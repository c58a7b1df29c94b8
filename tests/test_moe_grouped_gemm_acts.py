"""The grouped GEMM's gated-activation epilogues (``ep_fuse.ops.moe.ACTS``) vs the canonical reference, the
NPU provider's declines, and the CUDA gate of the variants not yet checked on a GPU."""

import importlib
from types import SimpleNamespace

import pytest
import torch
from support.norm_cases import ulp_close

import ep_fuse.providers  # noqa: F401  (registers torch.ops.ep_fuse_triton.*)
from ep_fuse.ops.moe import ACTS, act_problem, grouped_gemm_swiglu_ref
from ep_fuse.providers.npu.moe import gemm_swiglu_supports
from ep_fuse.providers.triton.grouped_gemm import check_grouped_gemm_swiglu_call, grouped_gemm_swiglu_kernel
from ep_fuse.providers.triton.unverified import ENV, UNVERIFIED_ON_GPU

gk = importlib.import_module("ep_fuse.providers.triton.grouped_gemm_kernel")
BF16, F32 = torch.bfloat16, torch.float32
ACT_ARGS = {"silu_clamp": ("silu_clamp", 0.75, None, None), "silu_clamp_post": ("silu_clamp_post", 0.5, None, None),
            "silu_fp32": ("silu_fp32", None, None, None), "softcap_fp32": ("softcap_fp32", None, 0.5, 0.8),
            "softcap_gate_only": ("softcap_fp32", None, 0.5, None)}


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
    assert act_problem("gelu", None, None, None).startswith("unknown activation")
    assert "limit" in act_problem("silu_clamp", None, None, None)
    assert "limit" in act_problem("silu", 1.0, None, None)
    assert "soft caps" in act_problem("silu_fp32", None, 1.0, None)
    assert "positive" in act_problem("silu_clamp", -1.0, None, None)
    assert all(act_problem(*ACT_ARGS[n]) is None for n in ACT_ARGS)
    x, w, seg = case([2], 0, 8, 16, BF16)
    with pytest.raises(ValueError, match="unknown activation"):
        grouped_gemm_swiglu_ref(x, w, seg, "gelu")
    assert "unknown activation" in check_grouped_gemm_swiglu_call((x, w, seg, "gelu", None, None, None))


def test_new_epilogues_are_declined_on_cuda_until_checked(monkeypatch):
    """Every epilogue passed tests/gpu/test_gpu_moe_forms.py and is cleared (relu² and swigluoai too); the
    mechanism still declines one while it is listed."""
    assert not {f"grouped_gemm_swiglu:{a}" for a in ACTS} & set(UNVERIFIED_ON_GPU)
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


@pytest.mark.parametrize("name, ok", [("silu_fp32", True), ("silu_clamp", False), ("silu_clamp_post", False),
                                      ("softcap_fp32", False)])
def test_npu_takes_fp32_swiglu_and_declines_the_rest(name, ok):
    x, w, seg = case([2, 3], 1, 8, 16, BF16)
    reason = gemm_swiglu_supports((x, w, seg, *ACT_ARGS[name]))
    assert (reason is None) == ok, reason
    if not ok:
        assert "npu_swiglu computes plain SwiGLU only" in reason
    assert gemm_swiglu_supports((x, w, seg)) is None

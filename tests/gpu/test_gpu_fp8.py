"""One GPU (Hopper, sm90+): the Triton FP8 kernels against the pure-torch reference on DeepSeek-V3-like
bf16 shapes. This file sets ``EP_FUSE_UNVERIFIED_KERNELS=1`` (for variants not yet cleared); ``fp8:triton``
and ``fp8:tma`` (the persistent TMA variant, taken from 64 rows per expert) passed here on H200 (2026-11-30)."""

import pytest
import torch

from ep_fuse.ops import fp8 as fp8_ops  # noqa: F401  (defines the FP8 ops)
from ep_fuse.ops import fp8 as R

BF16 = torch.bfloat16
FP8 = torch.float8_e4m3fn
CASES = [  # t, h, i, e, k: decode, prefill-ish, ragged H/I (not multiples of 128) with 0-row experts
    (128, 7168, 2048, 256, 8), (1024, 7168, 2048, 256, 8), (7, 1000, 200, 64, 2)]


def bits(a: torch.Tensor) -> torch.Tensor:
    return a.view(torch.uint8)


def dequant(q: torch.Tensor, s: torch.Tensor, g: int = 128) -> torch.Tensor:
    return q.float() * s.repeat_interleave(g, dim=-1)[:, : q.shape[-1]]


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


@pytest.fixture(autouse=True)
def _enable(monkeypatch):
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("FP8 tensor cores need sm90+")
    monkeypatch.setenv("EP_FUSE_UNVERIFIED_KERNELS", "1")


def _case(t, h, i, e, k):
    g = torch.Generator(device="cuda").manual_seed(t)
    x = torch.randn(t, h, device="cuda", dtype=BF16, generator=g)
    x[:, 3] *= 50  # an outlier channel
    ids = torch.randn(t, e, device="cuda", generator=g).topk(k, dim=-1).indices
    ids[0, 0] = -1
    w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=BF16, generator=g) * h**-0.5
    w2 = torch.randn(e, h, i, device="cuda", dtype=BF16, generator=g) * i**-0.5
    return x, ids, R.quantize_weight_fp8(w13), R.quantize_weight_fp8(w2)


@pytest.mark.parametrize("t, h, i, e, k", CASES)
def test_triton_fp8_kernels_match_reference(t, h, i, e, k):
    from ep_fuse.providers.triton import fp8 as T

    x, ids, (q13, s13), (q2, s2) = _case(t, h, i, e, k)
    got, want = T.moe_permute_fp8_kernel(x, ids, e, 128), R.moe_permute_fp8_ref(x, ids, e, 128)
    assert torch.equal(bits(got[0]), bits(want[0])) and torch.equal(got[1], want[1])
    assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])
    xq, xs, _src, seg = want
    args = (xq, xs, q13, s13, seg, 128, 128)
    assert T.check_fp8_swiglu_call(args) is None
    aq, a_s = T.grouped_gemm_fp8_swiglu_quant_kernel(*args)
    aqr, asr = R.grouped_gemm_fp8_swiglu_quant_ref(*args)
    # Hopper's fp8 tensor-core MMA accumulates each 128-deep K block with fewer mantissa bits than fp32 (the
    # reason DeepSeek-V3 promotes to fp32 per block, as these kernels do): measured on H200, the group scales
    # (amax / 448) differ from the exact-fp32 reference by up to 2.5e-3 relative. Codes may then move by one
    # E4M3 step where a value sits near a rounding boundary; the accumulation error is absolute (a fraction
    # of the group's amax), so small values can move by many codes while moving little: bound it in units
    # of the group's scale (amax / 448; the top E4M3 step is 32 of them). Measured: 1.4 % of codes moved.
    torch.testing.assert_close(a_s, asr, rtol=1e-2, atol=1e-9)
    assert (bits(aq) != bits(aqr)).float().mean() < 0.05
    deq, deq_ref = dequant(aq, a_s), dequant(aqr, asr)
    unit = torch.maximum(a_s, asr).repeat_interleave(128, dim=-1)[:, : aq.shape[-1]]
    assert ((deq - deq_ref).abs() <= 40 * unit).all()
    assert rel_l2(deq, deq_ref) < 2e-2
    y = T.grouped_gemm_fp8_kernel(aqr, asr, q2, s2, seg, 128, 128, BF16)
    yr = R.grouped_gemm_fp8_ref(aqr, asr, q2, s2, seg, 128, 128, BF16)
    assert rel_l2(y, yr) < 1e-2
    assert (y.float() - yr.float()).abs().max() <= 0.05 * yr.float().abs().max()
    assert not y[int(seg[-1]):].any()


def test_fp8_block_is_lowered_to_triton_when_enabled():
    from support.moe_modules import compile_routed_case  # tests/support/moe_modules.py

    import ep_fuse

    # 16 tokens x top-2 over 8 experts: 4 rows per expert, inside perf.fp8_block_quant_rule's measured win
    out, ref = compile_routed_case(16, "cuda", quant="fp8_block")
    rep = ep_fuse.last_report()
    assert any("ep_fuse_triton.grouped_gemm_fp8" in op for op in rep.ops_after), rep.ops_after
    assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 0.08


def test_fp8_tma_variant_matches_the_default_kernel():
    """``fp8:tma`` (persistent TMA walk) at a prefill size it takes (128 rows per expert): chosen by the
    provider, and its SwiGLU scales / codes and down output agree with the one-tile-per-program kernel."""
    from ep_fuse.providers.triton import fp8 as T
    from ep_fuse.providers.triton.fp8_kernel import launch_fp8_gemm

    t, h, i, e, k = 4096, 7168, 2048, 256, 8
    x, ids, (q13, s13), (q2, s2) = _case(t, h, i, e, k)
    xq, xs, _src, seg = T.moe_permute_fp8_kernel(x, ids, e, 128)
    assert T.gemm_variant(xq, q13) == "tma"
    aq, a_s = T.grouped_gemm_fp8_swiglu_quant_kernel(xq, xs, q13, s13, seg, 128, 128)
    m = xq.shape[0]
    aqd, asd = torch.empty_like(aq), torch.empty_like(a_s)
    launch_fp8_gemm(xq, xs, q13, s13, seg, aqd, asd, 128, 128, swiglu=True)
    torch.testing.assert_close(a_s, asd, rtol=1e-2, atol=1e-9)
    assert (bits(aq) != bits(aqd)).float().mean() < 0.05
    y = T.grouped_gemm_fp8_kernel(aqd, asd, q2, s2, seg, 128, 128, BF16)
    yd = torch.empty(m, h, device="cuda", dtype=BF16)
    launch_fp8_gemm(aqd, asd, q2, s2, seg, yd, None, 128, 128, swiglu=False)
    assert rel_l2(y, yd) < 1e-2
    assert not y[int(seg[-1]):].any()

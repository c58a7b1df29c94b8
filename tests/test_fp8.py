"""FP8 block-scaled routed experts (``quant="fp8_block"``): quantizer, references, Triton kernels
(interpreter), the quant pass, transformers' ``FP8Experts`` through ``ep_fuse.prepare``, provider choice.

* the quantizer (``ep_fuse/ops/fp8.py``): round-trip bounds on any shape (ragged blocks),
  zeros and outliers (hypothesis);
* the GEMM references against a direct fp64 computation of the dequantized math;
* Triton kernels under the interpreter against the references (codes bit-exact);
* the Triton provider declines CUDA calls unless ``EP_FUSE_UNVERIFIED_KERNELS=1``; the NPU provider always declines;
* the quant pass on a hand-written module (eager and Inductor executors) and tiny DeepSeek-V3 models
  holding transformers' ``FP8Experts``.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from support.moe_modules import routed_case
from torch._subclasses.fake_tensor import FakeTensorMode

import ep_fuse
from ep_fuse.config import ConfigError, EpFuseConfig
from ep_fuse.ops import choose
from ep_fuse.ops import fp8 as O
from ep_fuse.ops import fp8 as R
from ep_fuse.passes.weight_eval import WEIGHT_CACHE
from ep_fuse.providers.triton import fp8 as T
from support.compiling import compile_and_run

BF16 = torch.bfloat16
FP8 = torch.float8_e4m3fn
FP8_STAGES = ("moe_permute_fp8", "grouped_gemm_fp8_swiglu_quant", "grouped_gemm_fp8")


def op_count(hist: dict[str, int], name: str) -> int:
    return sum(v for op, v in hist.items() if op.count(".") >= 2 and op.split(".")[1] == name)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def routed(t: int, k: int, e: int, h: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(BF16)
    ids = torch.randint(0, e, (t, k), generator=g)
    if t > 1:
        ids[0, 0] = -1
        ids[-1, -1] = e + 2  # another rank's expert
    return x, ids


def fp8_weights(e: int, h: int, i: int, block: tuple[int, int], seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    return R.quantize_weight_fp8(w13, block), R.quantize_weight_fp8(w2, block)


# --------------------------------------------------------------------------- quantizer
@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 70), k=st.integers(1, 70), bn=st.sampled_from([1, 16, 32, 128]),
       bk=st.sampled_from([16, 32, 128]), zero_rows=st.integers(0, 3), outlier=st.floats(1.0, 1e4),
       seed=st.integers(0, 2**16))
def test_quantize_blocks_round_trip(n, k, bn, bk, zero_rows, outlier, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    w[: min(zero_rows, n)] = 0
    w[n // 2, k // 2] *= outlier
    q, s = R.quantize_blocks(w, bn, bk)
    nb, kb = R.cdiv(n, bn), R.cdiv(k, bk)
    assert q.dtype == FP8 and q.shape == w.shape and s.dtype == torch.float32 and s.shape == (nb, kb)
    blocks = torch.nn.functional.pad(w.abs(), (0, kb * bk - k, 0, nb * bn - n)).reshape(nb, bn, kb, bk)
    amax = blocks.amax(dim=(1, 3))
    assert torch.equal(s, amax / 448)  # ragged edge blocks: amax of their real elements only
    codes = q.float()
    assert codes.abs().max() <= 448 and not codes.isnan().any()
    full = R.expand_scale(s, n, k, bn, bk)
    assert torch.equal(codes[full == 0], torch.zeros_like(codes[full == 0]))  # zero blocks: zero codes
    # each nonzero block's amax element becomes +-448
    qb = torch.nn.functional.pad(codes.abs(), (0, kb * bk - k, 0, nb * bn - n)).reshape(nb, bn, kb, bk)
    assert torch.equal(qb.amax(dim=(1, 3))[amax > 0], torch.full_like(amax[amax > 0], 448.0))
    # error: half an E4M3 spacing (relative 2**-4, or 2**-10 of the scale in the subnormal range)
    err = (R.dequantize_blocks(q, s, bn, bk) - w).abs()
    assert (err <= w.abs() * 2**-4 + full * 2**-10 + 1e-30).all()
    # codes are the round-to-nearest-even fp8 of w / scale
    want = torch.where(full > 0, w / torch.where(full > 0, full, 1), 0).clamp(-448, 448).to(FP8)
    assert torch.equal(bits(q), bits(want))


def test_group_quant_keeps_an_outlier_in_its_group():
    x = torch.randn(3, 256)
    x[1, 5] = 1e4
    q, s = R.quant_fp8_group_ref(x, 128)
    assert s.shape == (3, 2)
    assert s[1, 0] == torch.tensor(1e4) / 448 and s[1, 1] == x[1, 128:].abs().max() / 448
    assert rel_l2(R.dequantize_blocks(q[:, 128:], s[:, 1:], 1, 128), x[:, 128:]) < 0.05


# --------------------------------------------------------------------------- references vs fp64 math
@pytest.mark.parametrize("block", [(16, 32), (128, 128)])
def test_references_match_fp64_dequantized_math(block):
    bn, bk = block
    t, k, e, h, i = 10, 2, 4, 80, 40  # ragged: 80 and 40 are not multiples of 32 / 128
    x, ids = routed(t, k, e, h)
    (q13, s13), (q2, s2) = fp8_weights(e, h, i, block)
    xq, xs, src2dst, seg = R.moe_permute_fp8_ref(x, ids, e, bk)
    # the fused permute+quant is quant-then-permute of the T tokens
    qt, st_ = R.quant_fp8_group_ref(x, bk)
    valid = src2dst >= 0
    assert torch.equal(bits(xq)[src2dst[valid]], bits(qt).repeat_interleave(k, 0)[valid])
    assert torch.equal(xs[src2dst[valid]], st_.repeat_interleave(k, 0)[valid])
    tail = int(seg[-1])
    assert not bits(xq)[tail:].any() and not xs[tail:].any()
    aq, a_s = R.grouped_gemm_fp8_swiglu_quant_ref(xq, xs, q13, s13, seg, bn, bk)
    y = R.grouped_gemm_fp8_ref(aq, a_s, q2, s2, seg, bn, bk, torch.float32)
    bounds = seg.tolist()
    xd = R.dequantize_blocks(xq, xs, 1, bk).double()
    ad = R.dequantize_blocks(aq, a_s, 1, bk).double()
    w13 = R.dequantize_blocks(q13, s13, bn, bk).double()
    w2 = R.dequantize_blocks(q2, s2, bn, bk).double()
    h1 = torch.zeros(xq.shape[0], 2 * i, dtype=torch.float64)
    y2 = torch.zeros(xq.shape[0], h, dtype=torch.float64)
    for ei in range(e):
        lo, hi = bounds[ei], bounds[ei + 1]
        h1[lo:hi] = xd[lo:hi] @ w13[ei].T
        y2[lo:hi] = ad[lo:hi] @ w2[ei].T
    act = F.silu(h1[:, :i]) * h1[:, i:]
    torch.testing.assert_close(a_s.double(), R.quantize_blocks(act, 1, bk)[1].double(), rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(ad, act, rtol=2**-4, atol=1e-6)  # one E4M3 rounding of the fp32 SwiGLU
    torch.testing.assert_close(y.double(), y2, rtol=1e-5, atol=1e-6)
    assert not y[tail:].any() and not bits(aq)[tail:].any()


def test_canonical_ops_fake_impls():
    x, ids = routed(6, 2, 3, 64)
    (q13, s13), (q2, s2) = fp8_weights(3, 64, 32, (16, 32))
    ops = torch.ops.ep_fuse
    xq, xs, _src, seg = ops.moe_permute_fp8(x, ids, 3, 32)
    aq, a_s = ops.grouped_gemm_fp8_swiglu_quant(xq, xs, q13, s13, seg, 16, 32)
    for op, args in ((ops.moe_permute_fp8.default, (x, ids, 3, 32)), (ops.quant_fp8_group.default, (x, 32)),
                     (ops.fp8_block_dequant.default, (q13, s13, 16, 32, BF16)),
                     (ops.grouped_gemm_fp8_swiglu_quant.default, (xq, xs, q13, s13, seg, 16, 32)),
                     (ops.grouped_gemm_fp8.default, (aq, a_s, q2, s2, seg, 16, 32, BF16)),
                     (ops.moe_permute_fp8_q.default, (*ops.quant_fp8_group(x, 32), ids, 3))):
        # test_schema compares fp8 tensors with allclose, which torch does not implement for float8
        torch.library.opcheck(op, args, test_utils=("test_faketensor",))


def test_prequantized_block_equals_the_block_bit_for_bit():
    """``moe_experts_fp8_q`` (tokens quantized before an EP dispatch) == ``moe_experts_fp8``: the activation
    quantization is per token and group, so moving it before the permute changes no bit; -1 slots and
    strided codes/scales (what the all_to_all receive buffer hands over) included."""
    x, ids = routed(9, 2, 4, 256)
    ids[0, 1] = -1
    w = torch.rand(9, 2)
    (q13, s13), (q2, s2) = fp8_weights(4, 256, 64, (128, 128))
    ops = torch.ops.ep_fuse
    xq, xs = ops.quant_fp8_group(x, 128)
    wire = torch.zeros(9, 256 + 8 + 24, dtype=torch.uint8)  # a packed row: codes | scales | other bytes
    wire[:, :256] = xq.view(torch.uint8)
    wire[:, 256:264] = xs.view(torch.uint8)
    rq, rs = wire[:, :256].view(R.FP8), wire[:, 256:264].view(torch.float32)
    assert rq.stride(0) == 288 and rs.stride(0) == 72
    want = ops.moe_experts_fp8(x, ids, w, q13, s13, q2, s2, 128, 128, BF16)
    got = ops.moe_experts_fp8_q(rq, rs, ids, w, q13, s13, q2, s2, 128, 128, BF16, BF16)
    assert torch.equal(got, want)
    a, b = ops.moe_permute_fp8(x, ids, 4, 128), ops.moe_permute_fp8_q(rq, rs, ids, 4)
    assert torch.equal(bits(a[0]), bits(b[0])) and all(torch.equal(u, v) for u, v in zip(a[1:], b[1:]))


# --------------------------------------------------------------------------- Triton (interpreter) vs reference
TRITON_CASES = [  # t, k, e, h, i, block: ragged K / N, 0-row experts (8 experts, 3 tokens), block 128
    (9, 2, 4, 64, 48, (16, 32)), (3, 1, 8, 70, 40, (16, 32)), (5, 2, 3, 128, 64, (128, 128))]


@pytest.mark.parametrize("t, k, e, h, i, block", TRITON_CASES)
def test_triton_kernels_match_reference(t, k, e, h, i, block):
    bn, bk = block
    x, ids = routed(t, k, e, h, seed=t)
    (q13, s13), (q2, s2) = fp8_weights(e, h, i, block, seed=t + 1)
    q, s = T.quant_fp8_group_kernel(x, bk)
    qr, sr = R.quant_fp8_group_ref(x, bk)
    assert torch.equal(s, sr) and torch.equal(bits(q), bits(qr))
    got, want = T.moe_permute_fp8_kernel(x, ids, e, bk), R.moe_permute_fp8_ref(x, ids, e, bk)
    assert torch.equal(bits(got[0]), bits(want[0])) and torch.equal(got[1], want[1])
    assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])
    xq, xs, _src, seg = want
    aq, a_s = T.grouped_gemm_fp8_swiglu_quant_kernel(xq, xs, q13, s13, seg, bn, bk)
    aqr, asr = R.grouped_gemm_fp8_swiglu_quant_ref(xq, xs, q13, s13, seg, bn, bk)
    torch.testing.assert_close(a_s, asr, rtol=1e-5, atol=1e-9)
    # codes: equal up to the summation order of the fp32 accumulators (a code at a rounding tie may move)
    assert (bits(aq) != bits(aqr)).float().mean() < 0.01
    torch.testing.assert_close(R.dequantize_blocks(aq, a_s, 1, bk),
                               R.dequantize_blocks(aqr, asr, 1, bk), rtol=2**-3, atol=1e-6)
    for dtype in (BF16, torch.float32):
        y = T.grouped_gemm_fp8_kernel(aqr, asr, q2, s2, seg, bn, bk, dtype)
        yr = R.grouped_gemm_fp8_ref(aqr, asr, q2, s2, seg, bn, bk, dtype)
        assert y.dtype == dtype
        torch.testing.assert_close(y, yr, rtol=1e-5 if dtype == torch.float32 else 8e-3, atol=1e-6)


@pytest.mark.parametrize("desc", ["device", "host", "pointer"])
@pytest.mark.parametrize("t, k, e, h, i, block", [TRITON_CASES[0], TRITON_CASES[2], (7, 2, 4, 96, 80, (16, 32))])
def test_fp8_tma_kernel_matches_reference(t, k, e, h, i, block, desc):
    """The FP8 GEMMs on the persistent TMA walk (``fp8:tma``), every descriptor mode (K-block counts odd and
    even): SwiGLU scales and codes and the down GEMM against the references, as for the one-tile-per-program
    kernel (zero tail included)."""
    import dataclasses

    from ep_fuse.providers.triton import fp8_tma_kernel as F

    bn, bk = block
    x, ids = routed(t, k, e, h, seed=t)
    (q13, s13), (q2, s2) = fp8_weights(e, h, i, block, seed=t + 1)
    xq, xs, _src, seg = R.moe_permute_fp8_ref(x, ids, e, bk)
    m = xq.shape[0]
    aqr, asr = R.grouped_gemm_fp8_swiglu_quant_ref(xq, xs, q13, s13, seg, bn, bk)
    aq = torch.empty(m, i, dtype=FP8)
    a_s = torch.full((m, R.cdiv(i, bk)), float("nan"))
    cfg = dataclasses.replace(F.config_for(m, i, h, e, bk, swiglu=True), desc=desc)
    F.launch_fp8_gemm_tma(xq, xs, q13, s13, seg, aq, a_s, bn, bk, swiglu=True, config=cfg)
    torch.testing.assert_close(a_s, asr, rtol=1e-5, atol=1e-9)
    assert (bits(aq) != bits(aqr)).float().mean() < 0.01
    y = torch.full((m, h), float("nan"), dtype=BF16)
    cfg = dataclasses.replace(F.config_for(m, h, i, e, bk), desc=desc)
    F.launch_fp8_gemm_tma(aqr, asr, q2, s2, seg, y, None, bn, bk, swiglu=False, config=cfg)
    torch.testing.assert_close(y, R.grouped_gemm_fp8_ref(aqr, asr, q2, s2, seg, bn, bk, BF16), rtol=8e-3, atol=1e-6)


@pytest.mark.parametrize("desc", ["device", "host", "pointer"])
def test_fp8_tma_expert_groups_walk_the_same_tiles(desc):
    """``expert_groups`` on the FP8 TMA walk: an empty expert, one of three row tiles (ragged last tile) whose
    tiles span two of the plain walk's ``GROUP_M=2`` groups, one of two, and a zero tail. Each tile's K loop is
    the same in both walks, so the outputs are bit-identical to the plain walk's and match the references."""
    import dataclasses

    from ep_fuse.providers.triton import fp8_tma_kernel as F

    e, h, i, bn, bk = 4, 64, 48, 16, 32
    counts = [0, 75, 33, 9]  # rows per expert; 32-row tiles (the interpreter's config): 0, 3, 2, 1 tiles
    ids = torch.cat([torch.full((c,), j) for j, c in enumerate(counts)] + [torch.full((5,), e + 1)])
    ids = ids[torch.randperm(len(ids), generator=torch.Generator().manual_seed(3))].view(-1, 1)
    x = torch.randn(len(ids), h, generator=torch.Generator().manual_seed(4)).to(BF16)
    (q13, s13), (q2, s2) = fp8_weights(e, h, i, (bn, bk), seed=5)
    xq, xs, _src, seg = R.moe_permute_fp8_ref(x, ids, e, bk)
    assert seg.tolist() == [0, 0, 75, 108, 117]
    m = xq.shape[0]
    outs = {}
    for xg in (False, True):
        cfg = dataclasses.replace(F.config_for(m, i, h, e, bk, swiglu=True), desc=desc, group_m=2, expert_groups=xg)
        aq, a_s = torch.empty(m, i, dtype=FP8), torch.full((m, R.cdiv(i, bk)), float("nan"))
        F.launch_fp8_gemm_tma(xq, xs, q13, s13, seg, aq, a_s, bn, bk, swiglu=True, config=cfg)
        cfg = dataclasses.replace(F.config_for(m, h, i, e, bk), desc=desc, group_m=2, expert_groups=xg)
        y = torch.full((m, h), float("nan"), dtype=BF16)
        F.launch_fp8_gemm_tma(aq, a_s, q2, s2, seg, y, None, bn, bk, swiglu=False, config=cfg)
        outs[xg] = (aq, a_s, y)
    for a, b in zip(outs[False], outs[True]):
        assert torch.equal(bits(a) if a.dtype == FP8 else a, bits(b) if b.dtype == FP8 else b)
    aq, a_s, y = outs[True]
    aqr, asr = R.grouped_gemm_fp8_swiglu_quant_ref(xq, xs, q13, s13, seg, bn, bk)
    torch.testing.assert_close(a_s, asr, rtol=1e-5, atol=1e-9)
    assert (bits(aq) != bits(aqr)).float().mean() < 0.01
    torch.testing.assert_close(y, R.grouped_gemm_fp8_ref(aq, a_s, q2, s2, seg, bn, bk, BF16), rtol=8e-3, atol=1e-6)
    assert not y[117:].any()
    with pytest.raises(ValueError, match="swapped"):
        F.launch_fp8_gemm_tma(aq, a_s, q2, s2, seg, y, None, bn, bk, swiglu=False,
                              config=dataclasses.replace(cfg, small_bm=16))


def test_fp8_provider_takes_the_tma_kernel_by_size_and_alignment(monkeypatch):
    """From ``triton_fp8.FP8_TMA_MIN_ROWS_PER_EXPERT`` rows per expert and 16-byte fp8 rows the provider launches the
    TMA kernel; below, or with K = 70, the one-tile-per-program kernel."""
    from ep_fuse.providers.triton import fp8_tma_kernel as F
    from ep_fuse.providers.triton import fp8 as triton_fp8

    calls = []
    real = F.launch_fp8_gemm_tma
    monkeypatch.setattr(F, "launch_fp8_gemm_tma", lambda *a, **kw: (calls.append(1), real(*a, **kw)))
    monkeypatch.setattr(T, "FP8_TMA_MIN_ROWS_PER_EXPERT", 4)
    for t, h, tma in ((9, 64, True), (3, 64, False), (9, 70, False)):
        x, ids = routed(t, 2, 4, h, seed=t)
        (q13, s13), _ = fp8_weights(4, h, 48, (16, 32), seed=2)
        xq, xs, _src, seg = R.moe_permute_fp8_ref(x, ids, 4, 32)
        assert T.gemm_variant(xq, q13) == ("tma" if tma else "default")
        calls.clear()
        aq, a_s = T.grouped_gemm_fp8_swiglu_quant_kernel(xq, xs, q13, s13, seg, 16, 32)
        assert calls == ([1] if tma else [])
        torch.testing.assert_close(a_s, R.grouped_gemm_fp8_swiglu_quant_ref(xq, xs, q13, s13, seg, 16, 32)[1],
                                   rtol=1e-5, atol=1e-9)


def test_triton_rounding_matches_torch_at_ties_and_binade_edges():
    """The kernel's E4M3 rounding (on fp32 bits) equals torch's cast at every midpoint between fp8 values,
    including the ones that carry into the next binade (where the interpreter's own cast is wrong)."""
    vals = bits(torch.arange(0, 127, dtype=torch.uint8)).view(FP8).float()  # 0 .. 448, all non-negative finite
    mids = (vals[1:] + vals[:-1]) / 2
    row = torch.cat([torch.tensor([448.0]), mids, -mids, vals[1:] * 0.999])
    x = row.unsqueeze(0)
    q, s = T.quant_fp8_group_kernel(x, 512)
    assert s.tolist() == [[1.0]]  # amax 448: the codes are the values themselves
    assert torch.equal(bits(q), bits(x.to(FP8)))


# --------------------------------------------------------------------------- provider choice
def _fake_args(device: str):
    with FakeTensorMode():
        xq = torch.empty(16, 256, dtype=FP8, device=device)
        xs = torch.empty(16, 2, dtype=torch.float32, device=device)
        wq = torch.empty(4, 512, 256, dtype=FP8, device=device)
        ws = torch.empty(4, 4, 2, dtype=torch.float32, device=device)
        seg = torch.empty(5, dtype=torch.int64, device=device)
    return xq, xs, wq, ws, seg


def test_triton_takes_cuda_fp8_calls(monkeypatch):
    """``fp8:triton`` passed tests/gpu/test_gpu_fp8.py on H200 (2026-11-30): CUDA calls go to Triton."""
    args = (*_fake_args("cuda"), 128, 128)
    from ep_fuse.providers.triton.unverified import ENV

    monkeypatch.delenv(ENV, raising=False)
    assert T.check_fp8_swiglu_call(args) is None
    assert T.check_fp8_gemm_call((*args, BF16)) is None
    assert choose(O.grouped_gemm_fp8_swiglu_quant, args, "cuda", ("triton", "reference")).provider == "triton"
    assert choose(O.grouped_gemm_fp8, (*args, BF16), "cuda", ("triton", "reference")).provider == "triton"
    assert T.check_fp8_gemm_call((*args[:5], 128, 96, BF16)) is not None  # block_k not a power of two


def test_fp8_block_quant_rule_takes_only_the_measured_win():
    """bf16 weights become fp8 on CUDA only at sizes measured faster (<= 128 rows per expert: 1.92x at T128 on
    DeepSeek-V3's E256 k8, 1.08x at T4096; 0.90x at T16384)."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from ep_fuse.providers.triton.fp8 import FP8_BLOCK_MAX_ROWS_PER_EXPERT, fp8_block_quant_rule

    assert FP8_BLOCK_MAX_ROWS_PER_EXPERT == 128
    assert fp8_block_quant_rule(torch.empty(128, 7168, device="meta"), 8, 256) is None
    assert fp8_block_quant_rule(torch.empty(1, 7168, device="meta"), 8, 256) is None
    assert fp8_block_quant_rule(torch.empty(4096, 7168, device="meta"), 8, 256) is None
    why = fp8_block_quant_rule(torch.empty(16384, 7168, device="meta"), 8, 256)
    assert why is not None and "512.0 rows per expert" in why
    assert fp8_block_quant_rule(torch.empty(4100, 7168, device="meta"), 8, 256) is not None
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv())
    x = mode.from_tensor(torch.empty(64, 16), symbolic_context=StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC]))
    assert "symbolic token count" in fp8_block_quant_rule(x, 8, 256)


def test_fp8_rule_behind_an_ep_dispatch_counts_the_tokens_sent():
    """Behind an EP dispatch the block's input is the receive buffer ([world * capacity, H] in the rank layout),
    whose rows x top-k overcount the rows the local experts get by the world size; the rule counts the tokens
    this rank sends: 2 ranks, 128 local experts, top-8, 2048 tokens per rank is 128 rows per expert (quantized),
    4096 is 256 (kept bf16). The same receive buffer fed to a block without a dispatch counts as it is."""
    import operator

    import torch.fx as fx

    from ep_fuse.ops.ep import ep_dispatch
    from ep_fuse.passes.quant_weights import fp8_not_faster

    def block_behind(t: int, dispatched: bool) -> tuple[fx.Node, fx.Node]:
        g = fx.Graph()
        meta = {"x": (t, 7168), "ids": (t, 8), "w": (t, 8), "w13": (128, 4096, 7168)}
        nodes = {name: g.placeholder(name) for name in meta}
        for name, shape in meta.items():
            nodes[name].meta["val"] = torch.empty(shape, device="meta",
                                                  dtype=torch.int64 if name == "ids" else torch.bfloat16)
        if dispatched:
            d = g.call_function(ep_dispatch.op, (nodes["x"], nodes["ids"], nodes["w"], 256, "g", "deepep", "rank",
                                                 t, 300.0))
            rx, rid = (g.call_function(operator.getitem, (d, i)) for i in (0, 1))
        else:
            rx, rid = g.placeholder("rx"), g.placeholder("rid")
        rx.meta["val"] = torch.empty(2 * t, 7168, device="meta", dtype=torch.bfloat16)  # 2 ranks x capacity t
        rid.meta["val"] = torch.empty(2 * t, 8, device="meta", dtype=torch.int64)
        return g.call_function(operator.add, (rx, rid)), nodes["w13"]

    assert fp8_not_faster(*block_behind(2048, True)) is None
    assert "256.0 rows per expert" in fp8_not_faster(*block_behind(4096, True))
    assert "256.0 rows per expert" in fp8_not_faster(*block_behind(2048, False))
    assert fp8_not_faster(*block_behind(4096, True), aligned=True) is None  # DeepGEMM takes it: always faster


def test_npu_declines_fp8_with_the_reason():
    import ep_fuse.catalog  # noqa: F401  (registers the NPU provider too)
    from ep_fuse.providers.npu.fp8 import NO_FP8

    choice = choose(O.grouped_gemm_fp8, (*_fake_args("cpu"), 128, 128, BF16), "npu")
    assert choice.provider == "reference" and ("npu", NO_FP8) in choice.declined


# --------------------------------------------------------------------------- the quant pass
def test_quant_option_is_validated():
    assert EpFuseConfig.from_options({"quant": "fp8_block"}).quant == "fp8_block"
    with pytest.raises(ConfigError, match="fp8_block"):
        EpFuseConfig.from_options({"quant": "fp8"})


@pytest.mark.parametrize("executor", ["eager", "inductor"])
def test_quant_pass_on_module(executor):
    mod, args = routed_case()
    WEIGHT_CACHE.clear()
    with torch.no_grad():
        ref = mod(*args)
    out = compile_and_run(mod, *args, executor=executor, quant="fp8_block")
    rep = ep_fuse.last_report()
    assert rep.counts() == {"moe_experts": 1}
    gemms = ("grouped_gemm_fp8_swiglu_quant", "grouped_gemm_fp8")
    for name in FP8_STAGES if executor == "eager" else gemms:  # Inductor inlines the traceable permute
        assert op_count(rep.ops_after, name) == 1, (name, rep.ops_after)
    assert not any("grouped_gemm_swiglu." in op or "w8a8" in op for op in rep.ops_after)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    err = rel_l2(out, ref)
    assert err < 0.08, err  # measured 0.059: four E4M3 roundings (x, w13, SwiGLU output, w2), 3 mantissa bits each
    assert WEIGHT_CACHE.quantized == 2
    torch._dynamo.reset()
    out2 = compile_and_run(mod, *args, executor=executor, quant="fp8_block")
    assert WEIGHT_CACHE.quantized == 2  # a recompile reuses the fp8 weights
    torch.testing.assert_close(out2, out)


# --------------------------------------------------------------------------- transformers FP8Experts
def _fp8_deepseek(block=(16, 32)):
    """A tiny DeepSeek-V3 whose experts are transformers' ``FP8Experts`` (as ``replace_with_fp8_linear``
    builds them for an FP8 checkpoint), and the same model with those weights dequantized into bf16."""
    from transformers.integrations.finegrained_fp8 import (
        ALL_FP8_EXPERTS_FUNCTIONS,
        FP8Experts,
    )
    from transformers.integrations.moe import use_experts_implementation

    from ep_fuse.testing import tiny as tiny_models

    model, dequantized = tiny_models.build("deepseek_v3"), tiny_models.build("deepseek_v3")
    cls = use_experts_implementation(experts_class=FP8Experts, experts_interface=ALL_FP8_EXPERTS_FUNCTIONS)
    for path, mod in list(model.named_modules()):
        if not path.endswith(".experts"):
            continue
        fp8 = cls(config=model.config, block_size=block)
        with torch.no_grad():
            for name in ("gate_up_proj", "down_proj"):
                q, s = R.quantize_weight_fp8(getattr(mod, name).float(), block)
                getattr(fp8, name).copy_(q)
                getattr(fp8, f"{name}_scale_inv").copy_(s)
                getattr(dequantized.get_submodule(path), name).copy_(R.dequantize_blocks(q, s, *block, BF16))
        model.set_submodule(path, fp8)
    return model, dequantized


@pytest.mark.hf
def test_fp8_experts_need_the_hub_kernel_until_prepared(caplog):
    from ep_fuse.testing import tiny as tiny_models

    model, dequantized = _fp8_deepseek()
    inputs = tiny_models.example_inputs(batch=1, seq=8)
    # without `kernels`: ImportError; with it (transformers 5.25 installs it), the Hub lookup fails offline or on
    # the publisher check, a ValueError; both name the kernel repository
    with torch.no_grad(), pytest.raises((ImportError, ValueError, OSError), match="finegrained-fp8"):
        model(**inputs)
    with caplog.at_level(logging.WARNING, logger="ep_fuse"):
        ep_fuse.prepare(model)
    # the decoder layers' ModuleList (no forward of its own) is not taken for a block of experts
    assert "(ModuleList)" not in caplog.text, caplog.text
    with torch.no_grad():
        # the prepared forward is transformers' grouped_mm on the exactly dequantized weights
        assert torch.equal(model(**inputs).logits, dequantized(**inputs).logits)


@pytest.mark.hf
@pytest.mark.parametrize("executor", ["eager", "inductor"])
def test_fp8_experts_compile_to_the_fp8_block(executor):
    from ep_fuse.testing import tiny as tiny_models

    model, dequantized = _fp8_deepseek()
    ep_fuse.prepare(model)
    inputs = tiny_models.example_inputs()
    WEIGHT_CACHE.clear()
    with torch.no_grad():
        ref = dequantized(**inputs).logits
        out = torch.compile(model, backend="ep_fuse", options={"executor": executor, "quant": "fp8_block"})(
            **inputs).logits
    rep = ep_fuse.last_report()
    assert rep.counts()["moe_experts"] == 1
    assert op_count(rep.ops_after, "grouped_gemm_fp8_swiglu_quant") == 1
    assert op_count(rep.ops_after, "grouped_gemm_fp8") == 1
    assert op_count(rep.ops_after, "fp8_block_dequant") == 0  # the codes are used, never dequantized
    assert WEIGHT_CACHE.quantized == 0  # the model's own fp8 codes and scales
    err = rel_l2(out, ref)
    assert err < 0.03, err  # measured 0.006-0.007 (weights identical; activations quantized 1 x 32)


@pytest.mark.hf
def test_unsupported_fp8_experts_are_refused(caplog):
    from ep_fuse.surgery.fp8_experts import convert_fp8_experts

    model, _ = _fp8_deepseek()
    experts = model.get_submodule("model.layers.1.mlp.experts")
    experts.limit = 7.0  # a clamped gate is not SwiGLU
    with caplog.at_level(logging.WARNING, logger="ep_fuse"):
        done = convert_fp8_experts(model)
    assert [c.reason for c in done] == ["limit=7.0: a clamped or soft-capped gate is not SwiGLU"]
    assert "forward" not in vars(experts)
    with pytest.raises(ValueError, match="clamped"):
        convert_fp8_experts(model, strict=True)


@pytest.mark.hf
def test_fp8_experts_limit_after_act_dequantize_and_fuse_as_silu_clamp_post():
    """transformers 5.25's ``limit_after_act`` (Step-3.7): ``silu(g).clamp(max=L) * u.clamp(-L, L)``; the prepared
    forward computes it as FP8Experts does, and the block fuses with the ``silu_clamp_post`` epilogue."""
    from ep_fuse.testing import tiny as tiny_models
    from ep_fuse.surgery.fp8_experts import convert_fp8_experts

    model, dequantized = _fp8_deepseek()
    path = "model.layers.1.mlp.experts"
    experts, plain = model.get_submodule(path), dequantized.get_submodule(path)
    experts.limit, experts.limit_after_act = 0.02, True

    def clamped(gate_up):  # the reference: FP8Experts' own gate on the dequantized weights
        gate, up = gate_up.chunk(2, dim=-1)
        return plain.act_fn(gate).clamp(max=0.02) * up.clamp(min=-0.02, max=0.02)

    plain._apply_gate = clamped
    assert [c.reason for c in convert_fp8_experts(model) if c.reason] == []
    ep_fuse.prepare(model)
    inputs = tiny_models.example_inputs(batch=1, seq=8)
    with torch.no_grad():
        ref = dequantized(**inputs).logits
        assert torch.equal(model(**inputs).logits, ref)
        out = torch.compile(model, backend="ep_fuse", options={"executor": "eager"})(**inputs).logits
        del plain._apply_gate
        unclamped = dequantized(**inputs).logits
    rep = ep_fuse.last_report()
    assert rep.counts()["moe_experts"] == 1, rep.counts()
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    assert (unclamped - ref).abs().max() > 10 * (out - ref).abs().max()  # the clamp is active, and fused


@pytest.mark.hf
@pytest.mark.parametrize("limit", [None, 0.0])
def test_fp8_experts_limit_after_act_on_a_layer_without_a_limit(limit):
    """Step-3.7 (transformers 5.25) clamps only some layers: a per-layer limit of 0 means no clamp and reaches
    ``FP8Experts`` as ``limit=None`` with ``limit_after_act`` set -- plain SwiGLU (this raised a TypeError before);
    a limit of 0 itself is what FP8Experts' own forward clamps to: refused, never run as 'no clamp'."""
    from ep_fuse.testing import tiny as tiny_models
    from ep_fuse.surgery.fp8_experts import convert_fp8_experts

    model, dequantized = _fp8_deepseek()
    path = "model.layers.1.mlp.experts"
    experts = model.get_submodule(path)
    experts.limit, experts.limit_after_act = limit, True
    done = convert_fp8_experts(model)
    if limit is not None:
        assert [c.reason for c in done] == ["limit=0.0 with limit_after_act: FP8Experts' own forward clamps to it "
                                            "(a model's per-layer 0 means 'no clamp' only once the model turns it "
                                            "into None)"]
        assert "forward" not in vars(experts)
        return
    assert [c.reason for c in done] == [None]
    inputs = tiny_models.example_inputs(batch=1, seq=8)
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, dequantized(**inputs).logits)


def test_quant_pass_asks_the_providers_what_is_cleared_for_gpus(monkeypatch, caplog):
    """What is cleared for GPUs is the Triton provider's table (``providers/triton/unverified.py``); the quant pass
    asks it through the registry (questions ``not_cleared`` of ``moe_experts_fp8``, ``not_cleared_before_dispatch``
    of ``quant_fp8_group``), and warns where the FP8 experts would run the reference on CUDA."""
    from ep_fuse.ops.registry import ask
    from ep_fuse.passes import quant
    from ep_fuse.providers.triton import unverified

    monkeypatch.delenv(unverified.ENV, raising=False)
    for op, question in ((O.moe_experts_fp8, "not_cleared"), (O.quant_fp8_group, "not_cleared_before_dispatch")):
        assert ask(op, question, "cuda") == {"triton": None}
    monkeypatch.setitem(unverified.UNVERIFIED_ON_GPU, "fp8:triton", "not checked")
    monkeypatch.setitem(unverified.UNVERIFIED_ON_GPU, "ep:fp8_dispatch", "not checked")
    assert "ep:fp8_dispatch" in ask(O.quant_fp8_group, "not_cleared_before_dispatch", "cuda")["triton"]
    assert ask(O.quant_fp8_group, "not_cleared_before_dispatch", "cpu") == {"triton": None}
    with caplog.at_level(logging.WARNING, logger="ep_fuse"):
        quant._warn_fp8_reference("cpu")
        assert not caplog.records
        quant._warn_fp8_reference("cuda")
    assert "not cleared for GPUs" in caplog.text and unverified.ENV in caplog.text and "SLOW" in caplog.text
    monkeypatch.setenv(unverified.ENV, "1")
    assert ask(O.moe_experts_fp8, "not_cleared", "cuda") == {"triton": None}


def test_quant_pass_modules_import_no_provider():
    """The quant pass, its weights, evaluator and FP8 dispatch ask providers and EP engines through the registry
    and the EP engine table; none imports a provider or engine module (at module level or in a function)."""
    import ast
    from pathlib import Path

    passes = Path(ep_fuse.__file__).parent / "passes"
    for name in ("quant", "quant_weights", "weight_eval", "ep_fp8_dispatch", "graph_edit"):
        tree = ast.parse((passes / f"{name}.py").read_text())
        imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        bad = [m for m in imported if m.startswith(("ep_fuse.providers", "ep_fuse.ep.", "ep_fuse.catalog"))]
        assert not bad, (name, bad)
        inner = [n for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for n in ast.walk(f) if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("ep_fuse")]
        assert not inner, (name, [n.module for n in inner])

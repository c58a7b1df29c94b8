"""The FP8 block's aligned layout (``align > 1``) and the DeepGEMM provider that needs it, on CPU.

* the reference permute's aligned layout: every expert starts at a multiple of ``align``, its real rows are
  the plain layout's rows, padding is zero (hypothesis over token counts, experts, top-k, dropped slots);
* the Triton permute (interpreter) writes the same layout, padding zeroed;
* the block's output does not depend on ``align``;
* the DeepGEMM provider against a test double of ``deep_gemm`` (``tests/support/deepgemm_double.py``): the prefix-sum
  layout it passes, its SwiGLU/requant kernel (interpreter), when it declines, and when the quant pass asks for
  the aligned layout (:func:`ep_fuse.providers.deepgemm.fp8.align_for`). The real DeepGEMM runs in
  ``tests/gpu/test_gpu_deepgemm.py``.
"""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from ep_fuse.ops import choose
from ep_fuse.ops import fp8 as O
from ep_fuse.ops import fp8 as R
from ep_fuse.providers.deepgemm import fp8 as D
from ep_fuse.providers.triton import fp8 as T

BF16 = torch.bfloat16


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def routing(t: int, k: int, e: int, seed: int, skew: bool = False, dropped: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, 256, generator=g).to(BF16)
    hi = max(1, e // 3) if skew else e  # skew: the last experts get no rows
    ids = torch.randint(0, hi, (t, k), generator=g)
    for j in range(min(dropped, t * k)):
        ids.view(-1)[j * 7 % (t * k)] = -1
    return x, ids


@settings(max_examples=30, deadline=None)
@given(t=st.integers(1, 40), k=st.integers(1, 4), e=st.integers(1, 9), align=st.sampled_from([2, 4, 16, 128]),
       skew=st.booleans(), dropped=st.integers(0, 3), seed=st.integers(0, 99))
def test_reference_aligned_layout(t, k, e, align, skew, dropped, seed):
    x, ids = routing(t, k, e, seed, skew, dropped)
    q, s, src, seg = R.moe_permute_fp8_ref(x, ids, e, 128, align)
    qc, sc, srcc, segc = R.moe_permute_fp8_ref(x, ids, e, 128)
    assert q.shape[0] == R.aligned_rows(t, k, e, align) == t * k + e * (align - 1)
    assert not (seg % align).any()
    counts = segc.diff()
    assert torch.equal(seg.diff(), (counts + align - 1) // align * align)
    assert torch.equal(src < 0, srcc < 0)
    v = src >= 0
    assert torch.equal(bits(q[src[v]]), bits(qc[srcc[v]])) and torch.equal(s[src[v]], sc[srcc[v]])
    real = torch.zeros(q.shape[0], dtype=torch.bool)
    real[src[v]] = True
    assert not bits(q[~real]).any() and not s[~real].any()  # padding and tail rows are zero
    for j in range(e):  # each expert's real rows come first in its segment
        lo, n = int(seg[j]), int(counts[j])
        assert bool(real[lo:lo + n].all()) and not bool(real[lo + n:int(seg[j + 1])].any())


@pytest.mark.parametrize("t, k, e, align, skew, dropped", [
    (9, 2, 5, 4, False, 1), (33, 3, 6, 16, True, 2), (5, 2, 4, 128, False, 0), (12, 4, 3, 128, True, 0)])
def test_triton_permute_writes_the_aligned_layout(t, k, e, align, skew, dropped):
    x, ids = routing(t, k, e, t, skew, dropped)
    if not dropped and not skew:
        ids[0] = torch.arange(k) % e
    got, want = T.moe_permute_fp8_kernel(x, ids, e, 128, align), R.moe_permute_fp8_ref(x, ids, e, 128, align)
    n = int(want[3][-1])
    assert torch.equal(got[3], want[3]) and torch.equal(got[2], want[2])
    assert torch.equal(bits(got[0][:n]), bits(want[0][:n])) and torch.equal(got[1][:n], want[1][:n])
    assert T.check_permute_fp8_call((x, ids, e, 128, align)) is None
    assert T.check_permute_fp8_call((x, ids, e, 128, 0)) is not None


def test_one_expert_taking_every_row():
    x, _ = routing(20, 3, 4, 0)
    ids = torch.full((20, 3), 2)
    got, want = T.moe_permute_fp8_kernel(x, ids, 4, 128, 16), R.moe_permute_fp8_ref(x, ids, 4, 128, 16)
    assert want[3].tolist() == [0, 0, 0, 64, 64]
    assert torch.equal(bits(got[0][:64]), bits(want[0][:64])) and torch.equal(got[2], want[2])


def _weights(e: int, h: int, i: int) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    w13 = torch.randn(e, 2 * i, h, generator=g) * h**-0.5
    w2 = torch.randn(e, h, i, generator=g) * i**-0.5
    return R.quantize_weight_fp8(w13), R.quantize_weight_fp8(w2)


def test_block_output_does_not_depend_on_align():
    e, h, i, k = 5, 256, 128, 2
    x, ids = routing(23, k, e, 5, dropped=1)
    w = torch.softmax(torch.randn(23, k), -1)
    (q13, s13), (q2, s2) = _weights(e, h, i)
    plain = O.moe_experts_fp8.op(x, ids, w, q13, s13, q2, s2, 128, 128, None)
    for align in (4, 128):
        aligned = O.moe_experts_fp8.op(x, ids, w, q13, s13, q2, s2, 128, 128, None, align)
        # the same math per row; the fp32 matmuls see more rows (padding), which can change their summation
        # order and so, rarely, one requantized code: a few elements move by about one fp8 step's share
        assert (aligned != plain).float().mean() < 0.01
        assert ((aligned.float() - plain.float()).norm() / plain.float().norm()).item() < 1e-3


@pytest.fixture
def deep_gemm(monkeypatch):
    """``import deep_gemm`` yields the double; its call log starts empty."""
    from support import deepgemm_double

    deepgemm_double.calls.clear()
    monkeypatch.setitem(sys.modules, "deep_gemm", deepgemm_double)
    return deepgemm_double


def test_deepgemm_provider_on_the_double(deep_gemm):
    e, h, i, k, t = 4, 256, 256, 2, 150
    x, ids = routing(t, k, e, 1, skew=True, dropped=2)  # expert 3 gets no rows
    (q13, s13), (q2, s2) = _weights(e, h, i)
    xq, xs, src, seg = R.moe_permute_fp8_ref(x, ids, e, 128, D.ALIGN)
    n = int(seg[-1])
    aq, a_s = D.grouped_gemm_fp8_swiglu_quant_kernel(xq, xs, q13, s13, seg, 128, 128, D.ALIGN)
    assert deep_gemm.calls[-1]["ends"] == seg[1:].tolist()  # the aligned segments, as DeepGEMM's prefix sums
    assert deep_gemm.calls[-1]["expected_m"] == t * k // e
    # the SwiGLU/requant kernel on the double's bf16 gate|up: the reference quantizer of silu(gate) * up
    hgu = torch.zeros(xq.shape[0], 2 * i, dtype=BF16)
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous((xq, xs), (q13, s13), hgu, seg[1:].to(torch.int32),
                                               use_psum_layout=True)
    gate, up = hgu[:n].float().split(i, -1)
    wq, ws = R.quant_fp8_group_ref(torch.nn.functional.silu(gate) * up, 128)
    torch.testing.assert_close(a_s[:n], ws, rtol=1e-6, atol=0)
    assert (bits(aq[:n]) != bits(wq)).float().mean() < 1e-3  # fp32 silu vs torch's: rare one-step ties
    y = D.grouped_gemm_fp8_kernel(aq, a_s, q2, s2, seg, 128, 128, BF16, D.ALIGN)
    yr = R.grouped_gemm_fp8_ref(aq, a_s, q2, s2, seg, 128, 128, BF16)
    torch.testing.assert_close(y[:n].float(), yr[:n].float(), rtol=1e-2, atol=1e-2)
    # the block's rows, summed back per token, against the reference block on the plain layout
    from ep_fuse.ops.moe import moe_unpermute_ref

    c = R.moe_permute_fp8_ref(x, ids, e, 128)
    ac, acs = R.grouped_gemm_fp8_swiglu_quant_ref(c[0], c[1], q13, s13, c[3], 128, 128)
    ref = moe_unpermute_ref(R.grouped_gemm_fp8_ref(ac, acs, q2, s2, c[3], 128, 128, BF16), c[2], None, k, None)
    out = moe_unpermute_ref(y, src, None, k, None)
    assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 2e-2


def _fake_call(m: int = 512, e: int = 4, n: int = 512, kk: int = 256, device: str = "cuda"):
    with FakeTensorMode():
        xq = torch.empty(m, kk, dtype=R.FP8, device=device)
        xs = torch.empty(m, kk // 128, dtype=torch.float32, device=device)
        wq = torch.empty(e, n, kk, dtype=R.FP8, device=device)
        ws = torch.empty(e, n // 128, kk // 128, dtype=torch.float32, device=device)
        seg = torch.empty(e + 1, dtype=torch.int64, device=device)
    return xq, xs, wq, ws, seg


def test_deepgemm_takes_only_aligned_hopper_shaped_calls(monkeypatch):
    from ep_fuse.providers.triton.unverified import ENV

    monkeypatch.setenv(ENV, "1")
    args = (*_fake_call(), 128, 128)
    assert D.check_swiglu_call((*args, D.ALIGN)) is None
    assert D.check_call((*args, BF16, D.ALIGN)) is None
    assert "aligned layout" in D.check_swiglu_call(args)  # align 1: DeepGEMM would misplace the segments
    assert "aligned layout" in D.check_call((*args, BF16, 64))
    assert "bf16" in D.check_call((*args, torch.float16, D.ALIGN))
    assert "block" in D.check_swiglu_call((*args[:5], 64, 128, D.ALIGN))
    assert "multiples of 128" in D.check_call((*_fake_call(kk=200), 128, 128, BF16, D.ALIGN))
    assert "CUDA" in D.check_call((*_fake_call(device="cpu"), 128, 128, BF16, D.ALIGN))
    monkeypatch.delenv(ENV)
    assert D.check_call((*args, BF16, D.ALIGN)) is None  # fp8:deepgemm passed tests/gpu/test_gpu_deepgemm.py


def test_default_cuda_order_tries_deepgemm_only_where_it_exists():
    args = (*_fake_call(), 128, 128, D.ALIGN)
    c = choose(O.grouped_gemm_fp8_swiglu_quant, args, "cuda")
    assert c.provider != "deepgemm" and any(name == "deepgemm" for name, _ in c.declined)  # not installed here
    c = choose(O.moe_permute_fp8, (args[0], torch.empty(4, 2, dtype=torch.int64), 4, 128), "cuda")
    assert not any(name == "deepgemm" for name, _ in c.declined)  # no DeepGEMM permute: not listed


def test_align_for_asks_for_the_layout_only_where_deepgemm_is_faster(monkeypatch):
    from ep_fuse.providers.triton.unverified import ENV

    monkeypatch.setenv(ENV, "1")
    monkeypatch.setattr(D, "available", lambda: None)
    with FakeTensorMode():
        w13 = torch.empty(256, 4096, 7168, dtype=BF16, device="cuda")
        w2 = torch.empty(256, 7168, 2048, dtype=BF16, device="cuda")

        def x(t: int, h: int = 7168, device: str = "cuda") -> torch.Tensor:
            return torch.empty(t, h, dtype=BF16, device=device)

        assert D.align_for(x(2048), 8, w13, w2) == D.ALIGN  # 64 rows per expert: measured 1.79x vs 1.59x
        assert D.align_for(x(4096), 8, w13, w2) == D.ALIGN
        assert D.align_for(x(1024), 8, w13, w2) == 1  # 32 rows per expert: the Triton FP8 kernels win
        assert D.align_for(x(4096, device="cpu"), 8, w13, w2) == 1
        w13_odd = torch.empty(256, 4000, 7168, dtype=BF16, device="cuda")
        assert D.align_for(x(4096), 8, w13_odd, w2) == 1  # I 2000 is not a multiple of 128
        monkeypatch.setattr(D, "available", lambda: "not installed")
        assert D.align_for(x(4096), 8, w13, w2) == 1


def test_fp8_rule_quantizes_large_blocks_when_deepgemm_takes_them():
    from ep_fuse.providers.triton.fp8 import fp8_block_quant_rule

    with FakeTensorMode():
        x = torch.empty(16384, 7168, dtype=BF16, device="cuda")
    assert fp8_block_quant_rule(x, 8, 256) is not None  # 512 rows per expert: Triton FP8 0.95x bf16
    assert fp8_block_quant_rule(x, 8, 256, deepgemm=True) is None  # DeepGEMM: 1.54x


def test_aligned_schemas_pass_opcheck():
    """The ``align`` argument: the fake impls give the reference's shapes (``T*K + E*(align-1)`` rows)."""
    utils = ("test_schema", "test_faketensor")  # no autograd for fp8 codes
    x, ids = routing(9, 2, 5, 2, dropped=1)
    torch.library.opcheck(O.moe_permute_fp8.op, (x, ids, 5, 128, 16), test_utils=utils)
    (q13, s13), (q2, s2) = _weights(5, 256, 128)
    xq, xs, _src, seg = R.moe_permute_fp8_ref(x, ids, 5, 128, 16)
    fake = ("test_faketensor",)  # test_schema's input check multiplies the fp8 inputs, which CPU torch lacks
    torch.library.opcheck(O.grouped_gemm_fp8_swiglu_quant.op, (xq, xs, q13, s13, seg, 128, 128, 16),
                          test_utils=fake)
    torch.library.opcheck(O.grouped_gemm_fp8.op, (xq[:, :128].contiguous(), xs[:, :1].contiguous(), q2, s2, seg,
                                                  128, 128, BF16, 16), test_utils=fake)


def test_quant_pass_asks_the_providers_for_the_aligned_layout(monkeypatch):
    """The quant pass imports no provider: it asks the registry (question ``aligned_layout`` of ``moe_experts_fp8``),
    which DeepGEMM answers with its alignment and the 128 x 128 weight block it needs; on CPU, or where DeepGEMM is
    not available, no provider asks for an aligned layout."""
    import torch.fx as fx

    from ep_fuse.config import EpFuseConfig
    from ep_fuse.ops.moe import moe_experts
    from ep_fuse.ops.registry import ask
    from ep_fuse.passes.base import PassContext
    from ep_fuse.passes.quant import fp8_layout
    from ep_fuse.providers.triton.unverified import ENV

    monkeypatch.setenv(ENV, "1")
    monkeypatch.setattr(D, "available", lambda: None)
    with FakeTensorMode():
        vals = {"x": torch.empty(4096, 7168, dtype=BF16, device="cuda"),
                "ids": torch.empty(4096, 8, dtype=torch.int64, device="cuda"),
                "w": torch.empty(4096, 8, dtype=torch.float32, device="cuda"),
                "w13": torch.empty(256, 4096, 7168, dtype=BF16, device="cuda"),
                "w2": torch.empty(256, 7168, 2048, dtype=BF16, device="cuda")}
    g = fx.Graph()
    nodes = {name: g.placeholder(name) for name in vals}
    for name, v in vals.items():
        nodes[name].meta["val"] = v
    block = g.call_function(moe_experts.op, (*nodes.values(), None))

    def ctx(device: str) -> PassContext:
        return PassContext(config=EpFuseConfig.from_options({"quant": "fp8_block"}), device=device,
                           executor="eager", report=None)

    assert ask(O.moe_experts_fp8, "aligned_layout", vals["x"], 8, vals["w13"], vals["w2"]) == {
        "deepgemm": (D.ALIGN, (D.BLOCK, D.BLOCK))}
    assert fp8_layout(ctx("cuda"), block, nodes["w13"], nodes["w2"]) == (D.ALIGN, (D.BLOCK, D.BLOCK))
    assert fp8_layout(ctx("cpu"), block, nodes["w13"], nodes["w2"]) == (1, None)
    monkeypatch.setattr(D, "available", lambda: "not installed")
    assert fp8_layout(ctx("cuda"), block, nodes["w13"], nodes["w2"]) == (1, None)

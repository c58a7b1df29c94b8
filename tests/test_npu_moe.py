"""Ascend MoE stage providers (``ep_fuse/providers/npu/moe.py``) against the reference, on the torch_npu double.

No Ascend hardware here: ``torch_npu_double`` installs ``tests/npu_double.py``, which implements the
documented semantics of ``npu_moe_init_routing_v2`` / ``npu_grouped_matmul`` / ``npu_swiglu`` /
``npu_moe_finalize_routing`` and raises on documented constraint violations.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import pytest
import torch

from ep_fuse import runtime
from ep_fuse.config import EpFuseConfig
from ep_fuse.runtime import TORCH_NPU_CONTRACT_VERSION
from ep_fuse.ops.registry import canonical_ops
from ep_fuse.ops import choose
from ep_fuse.ops import moe as moe_ops
from ep_fuse.ops import moe as ref
from ep_fuse.pipeline import run_passes
from ep_fuse.providers.npu import provider as npu_provider
from ep_fuse.providers.npu import moe
from ep_fuse.report import GraphReport
from support.compiling import capture_aten

BF16 = torch.bfloat16
TOL = {BF16: (2e-2, 2e-2), torch.float16: (4e-3, 4e-3), torch.float32: (2e-5, 2e-5)}
NPU_OPS = ("npu_moe_init_routing_v2", "npu_grouped_matmul", "npu_swiglu", "npu_moe_finalize_routing")


def close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == expected.dtype and out.shape == expected.shape
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.float(), expected.float(), rtol=rtol, atol=atol)


def make_case(t: int, k: int, e: int, h: int = 32, inter: int = 16, dtype: torch.dtype = BF16, *,
              invalid: float = 0.0, out_of_range: bool = False, used: int | None = None,
              ids_dtype: torch.dtype = torch.int64, seed: int = 0) -> dict[str, Any]:
    """Inputs of one MoE block; ``used`` experts only (the rest empty), ``invalid`` fraction of -1 slots."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, used or e, (t, k), generator=g)
    drop = torch.rand(t, k, generator=g) < invalid
    ids = torch.where(drop, -1, ids)
    if out_of_range and t * k > 1:
        ids.view(-1)[1] = e + 3  # another rank's expert: invalid here
    if invalid and t > 1:
        ids[0] = -1  # a token without a valid slot -> zero row
    return {
        "x": torch.randn(t, h, generator=g).to(dtype),
        "ids": ids.to(ids_dtype),
        "w": torch.softmax(torch.randn(t, k, generator=g), -1),  # fp32, as Mixtral keeps it
        "w13": (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).to(dtype),
        "w2": (torch.randn(e, h, inter, generator=g) / inter**0.5).to(dtype),
        "e": e,
    }


CASES = {
    "plain": {"t": 9, "k": 2, "e": 4},
    "minus_one": {"t": 12, "k": 4, "e": 8, "invalid": 0.3},
    "out_of_range": {"t": 7, "k": 2, "e": 4, "out_of_range": True, "invalid": 0.2},
    "empty_experts": {"t": 10, "k": 2, "e": 8, "used": 3},
    "one_token": {"t": 1, "k": 2, "e": 4},
    "one_expert": {"t": 5, "k": 1, "e": 1},
    "int32_ids": {"t": 6, "k": 3, "e": 5, "ids_dtype": torch.int32, "invalid": 0.2},
}


@pytest.fixture
def spy(torch_npu_double, monkeypatch):
    """Records ``(name, args, kwargs)`` of every torch_npu call the providers make."""
    calls: list[tuple[str, tuple, dict]] = []
    mod = sys.modules["torch_npu"]
    for name in NPU_OPS:
        fn = getattr(mod, name)

        @functools.wraps(fn)
        def wrapper(*args, __fn=fn, __name=name, **kwargs):
            calls.append((__name, args, kwargs))
            return __fn(*args, **kwargs)

        monkeypatch.setattr(mod, name, wrapper)
    moe.TRANSPOSED.clear()
    yield calls
    moe.TRANSPOSED.clear()


# --------------------------------------------------------------------------- stages vs reference
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_permute_is_bitwise_reference(spy, case, dtype):
    c = make_case(**CASES[case], dtype=dtype)
    args = (c["x"], c["ids"], c["e"])
    assert moe.permute_supports(args) is None
    rows, src2dst, seg = moe.moe_permute_kernel(*args)
    ref_rows, ref_src2dst, ref_seg = ref.moe_permute_ref(*args)
    assert torch.equal(rows, ref_rows)  # incl. zero tail rows (the op leaves them invalid: NaN in the double)
    assert src2dst.dtype == torch.int64 and torch.equal(src2dst, ref_src2dst)
    assert seg.dtype == torch.int64 and torch.equal(seg, ref_seg)
    ((name, _, kw),) = spy
    assert name == "npu_moe_init_routing_v2"
    assert kw["row_idx_type"] == 0 and kw["active_expert_range"] == [0, c["e"]] and kw["quant_mode"] == -1
    assert kw["expert_tokens_num_type"] == 1 and kw["expert_tokens_num_flag"] and kw["drop_pad_mode"] == 0


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [BF16, torch.float16, torch.float32])
def test_grouped_gemms_match_reference(spy, case, dtype):
    c = make_case(**CASES[case], dtype=dtype)
    rows, _, seg = ref.moe_permute_ref(c["x"], c["ids"], c["e"])
    assert moe.gemm_swiglu_supports((rows, c["w13"], seg)) is None
    act = moe.grouped_gemm_swiglu_kernel(rows, c["w13"], seg)
    close(act, ref.grouped_gemm_swiglu_ref(rows, c["w13"], seg), dtype)  # npu_swiglu rounds once
    assert moe.gemm_supports((act, c["w2"], seg)) is None
    y = moe.grouped_gemm_kernel(act, c["w2"], seg)
    close(y, ref.grouped_gemm_ref(act, c["w2"], seg), dtype)
    tail = int(seg[-1])
    assert not act[tail:].any() and not y[tail:].any()  # rows past seg[E] are exactly zero
    assert [n for n, _, _ in spy] == ["npu_grouped_matmul", "npu_swiglu", "npu_grouped_matmul"]
    (_, (_xs, ws), kw), (_, (_h,), skw) = spy[0], spy[1]
    assert tuple(ws[0].shape) == (c["e"], c["x"].shape[1], c["w13"].shape[1])  # [E, K, N] per group
    assert kw["group_type"] == 0 and kw["split_item"] == 2 and kw["group_list_type"] == 0
    assert kw["group_list"][-1] == rows.shape[0] and kw["output_dtype"] == dtype
    assert skw == {"dim": -1}


@pytest.mark.parametrize("case", ["plain", "minus_one", "out_of_range", "one_token", "int32_ids"])
@pytest.mark.parametrize("w_dtype,out_dtype", [
    (torch.float32, BF16), (torch.float32, None), (torch.float32, torch.float32), (BF16, BF16), (BF16, None),
    (None, BF16), (None, None),
])
def test_unpermute_matches_reference(spy, case, w_dtype, out_dtype):
    c = make_case(**CASES[case], dtype=BF16)
    k = c["ids"].shape[1]
    _, src2dst, seg = ref.moe_permute_ref(c["x"], c["ids"], c["e"])
    y = torch.randn(src2dst.numel(), c["x"].shape[1]).to(BF16)
    y[int(seg[-1]):] = 0  # the contract's zero tail
    w = c["w"].to(w_dtype) if w_dtype is not None else None
    args = (y, src2dst, w, k, out_dtype)
    assert moe.unpermute_supports(args) is None
    out, expected = moe.moe_unpermute_kernel(*args), ref.moe_unpermute_ref(*args)
    close(out, expected, BF16 if expected.dtype == BF16 else torch.float32)
    no_slot = (src2dst.reshape(-1, k) < 0).all(1)
    assert not out[no_slot].any()  # a token without a valid slot is a zero row
    ((name, a, kw),) = spy
    assert name == "npu_moe_finalize_routing" and a[7] == 2 and not kw  # row-major dropless
    assert a[4].dtype == a[0].dtype and a[5].dtype == torch.int32 and int(a[5].min()) >= 0
    if w_dtype == torch.float32 and out_dtype != BF16:
        assert a[0].dtype == torch.float32  # fp32 result: rows upcast rather than weights rounded


def test_unpermute_fp16_rows(spy):
    c = make_case(6, 2, 4, dtype=torch.float16, invalid=0.3)
    _, src2dst, _ = ref.moe_permute_ref(c["x"], c["ids"], c["e"])
    y = torch.randn(src2dst.numel(), 32).to(torch.float16)
    args = (y, src2dst, c["w"].to(torch.float16), 2, None)
    close(moe.moe_unpermute_kernel(*args), ref.moe_unpermute_ref(*args), torch.float16)


# --------------------------------------------------------------------------- the whole block
def _block(x, ids, w, w13, w2):
    return torch.ops.ep_fuse.moe_experts(x, ids, w, w13, w2, x.dtype)


@pytest.mark.parametrize("case", ["minus_one", "empty_experts"])
def test_block_expanded_to_npu_providers(spy, case):
    c = make_case(**CASES[case], dtype=BF16)
    inputs = (c["x"], c["ids"], c["w"], c["w13"], c["w2"])
    ((gm, example),) = capture_aten(_block, *inputs)
    report = run_passes(gm, EpFuseConfig.from_options({"executor": "eager"}),
                        GraphReport(graph="npu-moe", device="npu", executor="eager"))
    for op in ("moe_permute", "grouped_gemm_swiglu", "grouped_gemm", "moe_unpermute"):
        assert report.ops_after.get(f"ep_fuse_npu.{op}.default") == 1, report.ops_after
    assert not report.unlowered
    # the report names every torch_npu op the graph calls with the release its contract was checked against
    assert report.contracts == dict.fromkeys(NPU_OPS, f"torch_npu {TORCH_NPU_CONTRACT_VERSION}")
    assert f"{', '.join(sorted(NPU_OPS))} (contracts checked against torch_npu 2.14.0)" in report.summary()
    with torch.no_grad():
        (out,) = gm(*example)
    expected = ref.moe_experts_ref(*inputs, BF16)
    close(out, expected, BF16)
    names = [n for n, _, _ in spy]
    assert names == ["npu_moe_init_routing_v2", "npu_grouped_matmul", "npu_swiglu", "npu_grouped_matmul",
                     "npu_moe_finalize_routing"], names  # no stage fell back to the reference


def test_block_calls_the_provider_ops_eagerly(spy):
    c = make_case(**CASES["minus_one"], dtype=BF16)
    ops = torch.ops.ep_fuse_npu
    rows, src2dst, seg = ops.moe_permute(c["x"], c["ids"], c["e"])
    act = ops.grouped_gemm_swiglu(rows, c["w13"], seg)
    y = ops.grouped_gemm(act, c["w2"], seg)
    out = ops.moe_unpermute(y, src2dst, c["w"], c["ids"].shape[1], BF16)
    close(out, ref.moe_experts_ref(c["x"], c["ids"], c["w"], c["w13"], c["w2"], BF16), BF16)
    assert len(spy) == 5


# --------------------------------------------------------------------------- choice and declines
def _stage_args(c: dict[str, Any]) -> dict[str, tuple]:
    rows, src2dst, seg = ref.moe_permute_ref(c["x"], c["ids"], c["e"])
    act = ref.grouped_gemm_swiglu_ref(rows, c["w13"], seg)
    y = ref.grouped_gemm_ref(act, c["w2"], seg)
    return {
        "moe_permute": (c["x"], c["ids"], c["e"]),
        "grouped_gemm_swiglu": (rows, c["w13"], seg),
        "grouped_gemm": (act, c["w2"], seg),
        "moe_unpermute": (y, src2dst, c["w"], c["ids"].shape[1], BF16),
    }


def test_choose_picks_npu_with_torch_npu(torch_npu_double):
    for name, args in _stage_args(make_case(**CASES["minus_one"])).items():
        choice = choose(canonical_ops()[name], args, "npu")
        assert choice.provider == "npu", (name, choice.declined)


def test_choose_without_torch_npu_says_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    npu_provider.available.cache_clear()
    try:
        for name, args in _stage_args(make_case(**CASES["plain"])).items():
            choice = choose(canonical_ops()[name], args, "npu")
            assert choice.provider == "reference"
            assert "install torch_npu with CANN" in dict(choice.declined)["npu"]
    finally:
        npu_provider.available.cache_clear()


def _declined(op: Any, args: tuple) -> str:
    choice = choose(op, args, "npu")
    assert choice.provider == "reference"
    return dict(choice.declined)["npu"]


def test_unsupported_calls_decline_with_a_reason(torch_npu_double):
    c = make_case(**CASES["plain"])
    a = _stage_args(c)
    x, ids, e = a["moe_permute"]
    assert "2-D x" in _declined(moe_ops.moe_permute, (x.unsqueeze(0), ids, e))
    assert "torch.int8" in _declined(moe_ops.moe_permute, (x.to(torch.int8), ids, e))
    assert "experts" in _declined(moe_ops.moe_permute, (x, ids, 20000))
    assert "empty" in _declined(moe_ops.moe_permute, (x[:0], ids[:0], e))
    rows, w13, seg = a["grouped_gemm_swiglu"]
    big = w13.new_zeros(1025, *w13.shape[1:])
    assert "1024 groups" in _declined(moe_ops.grouped_gemm_swiglu,
                                      (rows, big, torch.zeros(1026, dtype=torch.int64)))
    assert "dtypes" in _declined(moe_ops.grouped_gemm_swiglu, (rows.double(), w13.double(), seg))
    assert "odd" in _declined(moe_ops.grouped_gemm_swiglu, (rows, w13[:, :31], seg))
    act, w2, _ = a["grouped_gemm"]
    assert "dtypes" in _declined(moe_ops.grouped_gemm, (act, w2.float(), seg))
    y, src2dst, w, k, out_dtype = a["moe_unpermute"]
    assert "rows" in _declined(moe_ops.moe_unpermute, (y[:-1], src2dst, w, k, out_dtype))
    assert "float64" in _declined(moe_ops.moe_unpermute, (y, src2dst, w.double(), k, None))


# --------------------------------------------------------------------------- weight layout
def test_transposed_weight_is_made_once_per_weight(spy):
    c = make_case(**CASES["plain"])
    rows, _, seg = ref.moe_permute_ref(c["x"], c["ids"], c["e"])
    first = moe.grouped_gemm_swiglu_kernel(rows, c["w13"], seg)
    for _ in range(3):
        moe.grouped_gemm_swiglu_kernel(rows, c["w13"], seg)
        moe.grouped_gemm_swiglu_kernel(rows, c["w13"].detach(), seg)  # an alias of the same storage
    assert moe.TRANSPOSED.copies == 1
    assert sum(n == "npu_grouped_matmul" for n, _, _ in spy) == 7
    with torch.no_grad():
        c["w13"].mul_(2)  # an in-place update remakes the copy
    second = moe.grouped_gemm_swiglu_kernel(rows, c["w13"], seg)
    assert moe.TRANSPOSED.copies == 2 and not torch.equal(first, second)


def test_transposed_view_mode(spy):
    c = make_case(**CASES["minus_one"])
    rows, _, seg = ref.moe_permute_ref(c["x"], c["ids"], c["e"])
    with runtime.use_config(EpFuseConfig(npu_gmm_weight="view")):  # (default from EP_FUSE_NPU_GMM_WEIGHT)
        out = moe.grouped_gemm_swiglu_kernel(rows, c["w13"], seg)
    close(out, ref.grouped_gemm_swiglu_ref(rows, c["w13"], seg), BF16)
    assert moe.TRANSPOSED.copies == 0
    (_, (_, (w,)), _) = spy[0]
    assert w.data_ptr() == c["w13"].data_ptr() and not w.is_contiguous()


# --------------------------------------------------------------------------- the double (under the real schemas)
def test_double_init_routing_gather_and_scatter_indices_are_inverse(torch_npu_double):
    ids = torch.tensor([[2, -1], [0, 2], [1, 0]], dtype=torch.int32)
    x = torch.arange(3.0).unsqueeze(1).expand(3, 4).contiguous()
    kw = {"active_num": 6, "expert_num": 3, "expert_tokens_num_type": 1, "expert_tokens_num_flag": True, "quant_mode": -1,
              "active_expert_range": [0, 3]}
    ex, gather, counts, _ = torch.ops.npu.npu_moe_init_routing_v2(x, ids, row_idx_type=0, **kw)
    _, scatter, _, _ = torch.ops.npu.npu_moe_init_routing_v2(x, ids, row_idx_type=1, **kw)
    # row-major slots 0..5 = (t0:2, t0:-1, t1:0, t1:2, t2:1, t2:0); stable expert-major order: 2, 5, 4, 0, 3
    assert scatter.tolist() == [2, 5, 4, 0, 3, -1]
    assert gather.tolist() == [3, -1, 0, 4, 2, 1]
    assert counts.tolist() == [2, 1, 2] and counts.dtype == torch.int64
    assert ex[:5, 0].tolist() == [1.0, 2.0, 2.0, 0.0, 1.0] and ex[5].isnan().all()


def test_double_rejects_what_the_docs_forbid(torch_npu_double):
    x, ids = torch.randn(2, 8), torch.tensor([[0, 1], [1, 0]], dtype=torch.int32)
    kw = {"active_num": 4, "expert_num": 2, "expert_tokens_num_type": 1, "expert_tokens_num_flag": True}
    with pytest.raises(RuntimeError, match="quant_mode"):
        torch.ops.npu.npu_moe_init_routing_v2(x, ids, quant_mode=0, **kw)  # static quant: documented unsupported
    with pytest.raises(RuntimeError, match="exceed"):
        torch.ops.npu.npu_moe_init_routing_v2(x, ids + 1, quant_mode=-1, **kw)
    w = torch.randn(2, 8, 4)
    with pytest.raises(RuntimeError, match="cover"):
        torch.ops.npu.npu_grouped_matmul([torch.randn(4, 8)], [w], group_list=torch.tensor([1, 2]), group_list_type=1,
                                      group_type=0, split_item=2)
    with pytest.raises(RuntimeError, match=r"\[E, K, N\]"):
        torch.ops.npu.npu_grouped_matmul([torch.randn(4, 8)], [w.transpose(1, 2).contiguous()],
                                      group_list=torch.tensor([1, 3]), group_list_type=1, group_type=0, split_item=2)
    rows, scales = torch.randn(4, 8), torch.ones(2, 2)
    with pytest.raises(RuntimeError, match=r"\[0, NUM_ROWS\*K-1\]"):
        torch.ops.npu.npu_moe_finalize_routing(rows, None, None, None, scales, torch.tensor([0, -1, 2, 3],
                                            dtype=torch.int32), None, 2)
    with pytest.raises(RuntimeError, match="scales dtype"):
        torch.ops.npu.npu_moe_finalize_routing(rows.to(BF16), None, None, None, scales, torch.arange(4, dtype=torch.int32),
                                            None, 2)


def test_double_finalize_column_and_row_major_agree(torch_npu_double):
    n, k, h = 3, 2, 4
    rows, scales = torch.randn(n * k, h), torch.rand(n, k)
    row_major = torch.randperm(n * k).to(torch.int32)  # index of slot (n, k) at n*K + k
    col_major = row_major.reshape(n, k).t().contiguous().reshape(-1)  # ... at k*N + n
    a = torch.ops.npu.npu_moe_finalize_routing(rows, None, None, None, scales, row_major, None, 2)
    b = torch.ops.npu.npu_moe_finalize_routing(rows, None, None, None, scales, col_major, None, 0)
    expected = (rows[row_major.long()].reshape(n, k, h) * scales.unsqueeze(-1)).sum(1)
    torch.testing.assert_close(a, expected)
    torch.testing.assert_close(b, expected)


def test_opcheck_npu_moe_ops(torch_npu_double):
    c = make_case(**CASES["minus_one"])
    for name, args in _stage_args(c).items():
        torch.library.opcheck(getattr(torch.ops.ep_fuse_npu, name).default, args)

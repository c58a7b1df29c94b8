"""Triton MoE permute / unpermute (interpreter): bitwise permute, unpermute numerics, routing edge cases."""

import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ep_fuse.ops import choose
from ep_fuse.ops import moe as moe_ops
from ep_fuse.ops.moe import moe_permute_ref, moe_unpermute_ref
from ep_fuse.providers.triton.moe_permute import (
    check_moe_permute_call,
    check_moe_unpermute_call,
    moe_permute_kernel,
    moe_unpermute_kernel,
)

mk = importlib.import_module("ep_fuse.providers.triton.moe_permute_kernel")  # the package attribute is the op kernel
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
DTYPES = (FP32, BF16, FP16)
TINY_INDEX = mk.IndexConfig(chunk=8, block_e=4, block_j=4, scan_tile=16, num_warps=4)
"""Several chunks, expert tiles, rank tiles and scan tiles even for a handful of tokens."""
TINY_COPY = mk.CopyConfig(block_h=8, num_warps=4, h_iters=2)


def _ids(t, k, e, mode="random", invalid=0.0, dtype=torch.int64, seed=0):
    g = torch.Generator().manual_seed(seed)
    if mode == "one_expert":
        ids = torch.full((t, k), e - 1, dtype=torch.int64)
    elif mode == "topk":  # distinct experts per token, like a router
        ids = torch.randn(t, max(e, k), generator=g).topk(k, dim=-1).indices % e
    else:
        ids = torch.randint(0, e, (t, k), generator=g)
    drop = torch.rand(t, k, generator=g) < invalid
    above = e + torch.randint(0, 3, (t, k), generator=g)  # another EP rank's experts
    bad = torch.where(torch.rand(t, k, generator=g) < 0.5, torch.full_like(ids, -1), above)
    return torch.where(drop, bad, ids).to(dtype)


def _x(t, h, dtype, seed=1):
    return torch.randn(t, h, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _permute(x, ids, e, index_cfg=None, copy_cfg=None):
    t, k = ids.shape
    rows = torch.full((t * k, x.shape[1]), float("nan")).to(x.dtype)  # poisoned: every row must be written
    src2dst = torch.full((t * k,), 12345, dtype=torch.int64)
    seg = torch.full((e + 1,), 12345, dtype=torch.int64)
    mk.launch_permute(x, ids, e, rows, src2dst, seg, index_cfg, copy_cfg)
    return rows, src2dst, seg


def _assert_permute_equal(out, ref):
    for name, o, r in zip(("rows", "src2dst", "seg_indptr"), out, ref):
        assert o.dtype == r.dtype and o.shape == r.shape, name
        assert torch.equal(o.view(torch.uint8) if o.is_floating_point() else o,
                           r.view(torch.uint8) if r.is_floating_point() else r), f"{name} differs"


def _unpermute_model(y, src2dst, w, k, out_dtype):
    """The reference's numerics spelled out: products in the promoted dtype, fp32 sum in slot order."""
    prod = y.dtype if w is None else torch.promote_types(y.dtype, w.dtype)
    t = src2dst.numel() // k
    acc = torch.zeros(t, y.shape[1], dtype=torch.float32)
    for j in range(k):
        s = src2dst.view(t, k)[:, j]
        v = y[s.clamp(min=0)].float()
        if w is not None:
            v = (v * w[:, j, None].float()).to(prod).float()
        acc = acc + torch.where((s >= 0)[:, None], v, torch.zeros(()))
    return acc.to(prod).to(out_dtype or prod)


# --------------------------------------------------------------------------- permute


@pytest.mark.parametrize("mode,invalid", [("random", 0.0), ("topk", 0.3), ("one_expert", 0.0), ("one_expert", 0.5),
                                          ("random", 1.0)])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_permute_bitwise_routing_cases(mode, invalid, id_dtype):
    t, k, e, h = 13, 3, 6, 20
    x, ids = _x(t, h, BF16), _ids(t, k, e, mode, invalid, id_dtype, seed=7)
    ref = moe_permute_ref(x, ids, e)
    _assert_permute_equal(_permute(x, ids, e, TINY_INDEX, TINY_COPY), ref)
    _assert_permute_equal(moe_permute_kernel(x, ids, e), ref)


def test_permute_edge_values():
    """Experts with no tokens, ids >= E and negative ids, one token, strided ids and x rows."""
    x = _x(4, 24, FP32)
    ids = torch.tensor([[5, -1, 0], [7, 5, 5], [-3, 6, 0], [2, 5, 9]])
    out = _permute(x, ids, 6, TINY_INDEX, TINY_COPY)
    _assert_permute_equal(out, moe_permute_ref(x, ids, 6))
    assert out[2].tolist() == [0, 2, 2, 3, 3, 3, 7]
    assert out[1].tolist() == [3, -1, 0, -1, 4, 5, -1, -1, 1, 2, 6, -1]
    assert torch.equal(out[0][7:], torch.zeros(5, 24)) and torch.equal(out[0][4], x[1])
    wide_ids = torch.randint(-1, 8, (9, 10), dtype=torch.int32)[:, 1:8:2]  # [9, 4], strides (10, 2)
    wide_x = _x(9, 40, FP16)[:, 8:32]  # row stride 40
    assert check_moe_permute_call((wide_x, wide_ids, 8)) is None
    _assert_permute_equal(moe_permute_kernel(wide_x, wide_ids, 8), moe_permute_ref(wide_x, wide_ids, 8))
    one = _x(1, 16, BF16)
    _assert_permute_equal(moe_permute_kernel(one, torch.tensor([[3]]), 4), moe_permute_ref(one, torch.tensor([[3]]), 4))


def test_permute_many_experts():
    x, ids = _x(5, 16, BF16), _ids(5, 4, 300, "topk", 0.2, seed=3)
    _assert_permute_equal(moe_permute_kernel(x, ids, 300), moe_permute_ref(x, ids, 300))


@settings(max_examples=20, deadline=None)
@given(t=st.integers(1, 17), h=st.integers(1, 40), e=st.integers(1, 12), k=st.integers(1, 6),
       dtype=st.sampled_from(DTYPES), id_dtype=st.sampled_from([torch.int32, torch.int64]),
       mode=st.sampled_from(["random", "topk", "one_expert"]), invalid=st.sampled_from([0.0, 0.25, 1.0]),
       tiny=st.booleans(), seed=st.integers(0, 2**16))
def test_permute_property(t, h, e, k, dtype, id_dtype, mode, invalid, tiny, seed):
    x, ids = _x(t, h, dtype, seed), _ids(t, k, e, mode, invalid, id_dtype, seed)
    cfgs = (TINY_INDEX, TINY_COPY) if tiny else (None, None)
    out = _permute(x, ids, e, *cfgs)
    _assert_permute_equal(out, moe_permute_ref(x, ids, e))
    # round trip: each token comes back once per valid slot
    n_valid = ((ids >= 0) & (ids < e)).sum(1, keepdim=True)
    xs = (torch.randint(-8, 9, (t, h)) / 4).to(dtype)  # small dyadic values: the sums are exact
    rows, src2dst, _ = moe_permute_kernel(xs, ids, e)
    ones = torch.ones(t, k, dtype=dtype)
    for w in (None, ones):
        back = moe_unpermute_kernel(rows, src2dst, w, k, None)
        assert back.dtype == dtype and torch.equal(back, xs * n_valid.to(dtype))


# --------------------------------------------------------------------------- unpermute


def _unpermute_args(t, k, m, h, y_dtype, w_dtype, invalid=0.25, seed=0):
    g = torch.Generator().manual_seed(seed)
    src2dst = torch.randperm(m, generator=g)[: t * k] if m >= t * k else torch.randint(0, m, (t * k,), generator=g)
    src2dst = torch.where(torch.rand(t * k, generator=g) < invalid, -1, src2dst)
    y = torch.randn(m, h, generator=g).to(y_dtype)
    w = None if w_dtype is None else torch.rand(t, k, generator=g).to(w_dtype)
    return y, src2dst, w


@pytest.mark.parametrize("y_dtype,w_dtype,out_dtype", [
    (BF16, BF16, None), (BF16, FP32, BF16), (BF16, FP32, None), (FP16, FP16, FP32), (FP32, BF16, None),
    (BF16, None, None), (BF16, FP16, BF16), (FP16, None, BF16),
])
def test_unpermute_numerics(y_dtype, w_dtype, out_dtype):
    t, k, h = 11, 4, 37
    y, src2dst, w = _unpermute_args(t, k, 50, h, y_dtype, w_dtype, seed=5)
    args = (y, src2dst, w, k, out_dtype)
    assert check_moe_unpermute_call(args) is None
    out, ref = moe_unpermute_kernel(*args), moe_unpermute_ref(*args)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.equal(out, _unpermute_model(*args)), "products rounded to the promoted dtype, fp32 sum in slot order"
    tol = {FP32: (2e-6, 1e-6), BF16: (2 ** -7, 1e-5), FP16: (2 ** -10, 1e-5)}[out.dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol[0], atol=tol[1])  # the reference's sum order differs
    # tiled: several H blocks per program, partial last block
    launched = torch.empty_like(out)
    prod = y.dtype if w is None else torch.promote_types(y.dtype, w.dtype)
    mk.launch_unpermute(y, src2dst, w, k, launched, prod, TINY_COPY)
    assert torch.equal(launched, out)


def test_unpermute_rounds_each_product_like_the_model():
    """bf16 y * bf16 w rounds each product: (1 + 2^-7)^2 is 1 + 2^-6 in bf16, so two sum to 2 + 2^-5."""
    a = 1 + 2 ** -7
    y = torch.tensor([[a], [a]], dtype=BF16)
    w = torch.tensor([[a, a]], dtype=BF16)
    args = (y, torch.tensor([0, 1]), w, 2, FP32)
    out, ref = moe_unpermute_kernel(*args), moe_unpermute_ref(*args)
    assert out.item() == ref.item() == 2 + 2 ** -5
    assert (y.float().view(1, 2) * w.float()).sum().item() == 2 + 2 ** -5 + 2 ** -13  # unrounded products differ


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf * masked 0, discarded
def test_unpermute_no_valid_slot_is_zero_and_ignores_inf_weights():
    y = torch.full((3, 8), 5.0)
    w = torch.tensor([[float("inf"), 2.0], [1.0, 1.0]])
    out = moe_unpermute_kernel(y, torch.tensor([-1, 2, -1, -1]), w, 2, None)
    assert torch.equal(out, torch.stack([torch.full((8,), 10.0), torch.zeros(8)]))


@settings(max_examples=20, deadline=None)
@given(t=st.integers(1, 9), k=st.integers(1, 5), h=st.integers(1, 40), y_dtype=st.sampled_from(DTYPES),
       w_dtype=st.sampled_from([None, *DTYPES]), out_dtype=st.sampled_from([None, *DTYPES]),
       invalid=st.sampled_from([0.0, 0.5, 1.0]), seed=st.integers(0, 2**16))
def test_unpermute_property(t, k, h, y_dtype, w_dtype, out_dtype, invalid, seed):
    y, src2dst, w = _unpermute_args(t, k, t * k + 3, h, y_dtype, w_dtype, invalid, seed)
    args = (y, src2dst.to(torch.int32) if seed % 2 else src2dst, w, k, out_dtype)
    out = moe_unpermute_kernel(*args)
    assert torch.equal(out, _unpermute_model(*args))
    ref = moe_unpermute_ref(*args)
    assert out.dtype == ref.dtype
    prod = y.dtype if w is None else torch.promote_types(y.dtype, w.dtype)
    eps = max(torch.finfo(out.dtype).eps, torch.finfo(prod).eps)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 * eps, atol=1e-5)


# --------------------------------------------------------------------------- op registration and choice


def test_opcheck():
    x, ids = _x(6, 16, BF16), _ids(6, 3, 5, "topk", 0.2, torch.int32)
    torch.library.opcheck(torch.ops.ep_fuse_triton.moe_permute.default, (x, ids, 5))
    rows, src2dst, _ = moe_permute_ref(x, ids, 5)
    w = torch.rand(6, 3)
    for args in ((rows, src2dst, w, 3, BF16), (rows, src2dst, None, 3, None)):
        torch.library.opcheck(torch.ops.ep_fuse_triton.moe_unpermute.default, args)
    out = torch.ops.ep_fuse_triton.moe_permute(x, ids, 5)
    _assert_permute_equal(out, moe_permute_ref(x, ids, 5))


def test_launch_through_wrap_triton():
    """The launch Inductor inlines (``wrap_triton``) computes the same outputs (eager here)."""
    from torch.library import wrap_triton

    x, ids = _x(9, 24, BF16), _ids(9, 4, 6, "topk", 0.2)
    out = moe_permute_kernel(x, ids, 6, wrap=wrap_triton)
    _assert_permute_equal(out, moe_permute_ref(x, ids, 6))
    w = torch.rand(9, 4)
    got = moe_unpermute_kernel(out[0], out[1], w, 4, BF16, wrap=wrap_triton)
    assert torch.equal(got, _unpermute_model(out[0], out[1], w, 4, BF16))


def test_choose_triton_and_declines():
    x, ids = _x(4, 16, BF16), _ids(4, 2, 4)
    assert choose(moe_ops.moe_permute, (x, ids, 4), "cpu").provider == "triton"
    for bad, why in (((x.double(), ids, 4), "dtype"), ((x, ids.to(torch.int16), 4), "int32/int64"),
                     ((x.view(4, 2, 8), ids, 4), "3-D"), ((x.t().contiguous().t(), ids, 4), "unit-stride"),
                     ((x[:3], ids, 4), "token count")):
        c = choose(moe_ops.moe_permute, bad, "cpu")
        assert c.provider == "reference" and why in c.declined[0][1], c.declined
    rows, src2dst, _ = moe_permute_ref(x, ids, 4)
    args = (rows, src2dst, torch.rand(4, 2), 2, None)
    assert choose(moe_ops.moe_unpermute, args, "cpu").provider == "triton"
    c = choose(moe_ops.moe_unpermute, (rows, src2dst, torch.rand(8), 2, None), "cpu")
    assert c.provider == "reference" and "[T, top_k]" in c.declined[0][1]
    c = choose(moe_ops.moe_unpermute, (rows, src2dst, None, 3, None), "cpu")
    assert c.provider == "reference" and "multiple of top_k" in c.declined[0][1]

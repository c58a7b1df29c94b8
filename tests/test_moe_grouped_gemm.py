"""Triton grouped GEMM and grouped GEMM + SwiGLU over expert row segments vs a per-expert loop."""

import importlib

import pytest
import torch
from support.norm_cases import ulp_close
from hypothesis import given, settings
from hypothesis import strategies as st

import ep_fuse.providers  # noqa: F401  (registers torch.ops.ep_fuse_triton.*)
from ep_fuse.ops import choose
from ep_fuse.ops import moe as moe_ops
from ep_fuse.ops.moe import grouped_gemm_ref, grouped_gemm_swiglu_ref
from ep_fuse.providers.triton.grouped_gemm import (
    check_grouped_gemm_call,
    check_grouped_gemm_swiglu_call,
    grouped_gemm_kernel,
    grouped_gemm_swiglu_kernel,
)

gk = importlib.import_module("ep_fuse.providers.triton.grouped_gemm_kernel")  # the package's attribute is the op
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
DECODE = gk.config_for(1, 1, 1, 1, interpret=True)
PREFILL = gk.config_for(10**6, 1, 1, 1, interpret=True)
CONFIGS = {"decode": DECODE, "prefill": PREFILL, "bm16_noswap": gk.GemmConfig(16, 32, 16, 4, 1, 3)}


def case(counts, tail, n, k, dtype, seed=0):
    """``(x [M, k], w [E, n, k], seg_indptr)`` with ``counts[e]`` rows per expert and ``tail`` spare rows."""
    g = torch.Generator().manual_seed(seed)
    seg = torch.tensor([0, *counts], dtype=torch.int64).cumsum(0)
    x = torch.randn(sum(counts) + tail, k, generator=g).to(dtype)
    w = (torch.randn(len(counts), n, k, generator=g) / k**0.5).to(dtype)
    return x, w, seg


def loop_ref(x, w, seg, swiglu=False):
    """Per-expert fp32 GEMMs, each rounded once to the activation dtype (Hugging Face numerics)."""
    n = w.shape[1] // 2 if swiglu else w.shape[1]
    out = torch.zeros(x.shape[0], n, dtype=x.dtype)
    b = seg.tolist()
    for e in range(w.shape[0]):
        h = (x[b[e]:b[e + 1]].double() @ w[e].double().T).to(x.dtype)
        out[b[e]:b[e + 1]] = torch.nn.functional.silu(h[:, :n]) * h[:, n:] if swiglu else h
    return out


def run(x, w, seg, swiglu, cfg):
    """The launch with an explicit config into a NaN-filled output (unwritten rows stay NaN)."""
    n = w.shape[1] // 2 if swiglu else w.shape[1]
    y = torch.full((x.shape[0], n), float("nan"), dtype=x.dtype)
    (gk.launch_grouped_gemm_swiglu if swiglu else gk.launch_grouped_gemm)(x, w, seg, y, config=cfg)
    return y


def assert_matches(out, ref, seg, dtype):
    end = int(seg[-1])
    assert not out.isnan().any(), "unwritten or NaN output"
    assert torch.equal(out[end:], torch.zeros_like(out[end:])), "tail rows must be zero"
    if dtype == F32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        ulp_close(out, ref, dtype)  # fp32 accumulation order differs: an ulp here and there


@pytest.mark.parametrize("regime", sorted(CONFIGS))
@pytest.mark.parametrize("counts, tail", [([0, 0, 70, 0], 0), ([70], 9), ([0, 2, 0, 0, 1], 33), ([0, 0, 0], 6),
                                          ([1] * 5 + [0] * 59, 2), ([0] * 40 + [1, 1, 1] + [0] * 21, 0)],
                         ids=["one_expert", "E1_tail", "sparse_tail", "all_tail", "decode_many_experts",
                              "decode_experts_late"])
@pytest.mark.parametrize("swiglu", [False, True], ids=["gemm", "swiglu"])
def test_edge_routings(counts, tail, regime, swiglu):
    x, w, seg = case(counts, tail, 18, 40, BF16)
    out = run(x, w, seg, swiglu, CONFIGS[regime])
    assert_matches(out, loop_ref(x, w, seg, swiglu), seg, BF16)


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_host_functions_match_the_canonical_reference(dtype):
    x, w, seg = case([5, 0, 40, 3, 0, 21], 7, 32, 64, dtype, seed=3)  # K, N multiples of 8: _grouped_mm's alignment
    for kernel, ref in ((grouped_gemm_kernel, grouped_gemm_ref), (grouped_gemm_swiglu_kernel, grouped_gemm_swiglu_ref)):
        out, expect = kernel(x, w, seg), ref(x, w, seg)
        assert out.shape == expect.shape and out.dtype == expect.dtype
        assert_matches(out, expect, seg, dtype)


def test_grid_bound_is_the_rows_not_the_experts():
    """M rows can occupy at most min(E, M) experts: the grid must not scale with E at decode."""
    cfg = gk.config_for(8, 1536, 2048, 256, swiglu=True)
    assert gk.num_programs(8, 1536, 256, cfg) == (1 + 8) * -(-1536 // cfg.bn)
    assert gk.num_programs(4096, 1536, 256, cfg) == (-(-4096 // cfg.bm) + 256) * -(-1536 // cfg.bn)


def test_empty_shapes():
    x, w, seg = case([0, 0], 0, 8, 16, BF16)
    assert grouped_gemm_kernel(x, w, seg).shape == (0, 8)
    x, w, seg = case([], 5, 8, 16, BF16)  # no experts: every row is tail
    assert torch.equal(grouped_gemm_swiglu_kernel(x, w, seg), torch.zeros(5, 4, dtype=BF16))


def test_config_regimes():
    decode = gk.config_for(128 * 8, 2048, 7168, 256, swiglu=True, interpret=False)
    prefill = gk.config_for(4096 * 8, 2048, 7168, 256, swiglu=True, interpret=False)
    assert decode.bm == 16 and prefill.bm >= 64 and prefill.bn >= 128
    assert gk.is_decode(1024, 256) and not gk.is_decode(32768, 256)
    assert DECODE.bm == 16 and DECODE.swap_ab and PREFILL.bm > 16 and not PREFILL.swap_ab


def test_launch_reads_no_host_values():
    """Grid and arguments come from static shapes only: the launch works on meta tensors (inline_ok)."""
    launches = []

    class Stub:
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((grid, args, kw))

    x, w13, w2 = (torch.empty(s, dtype=BF16, device="meta") for s in ((1000, 64), (8, 96, 64), (8, 64, 48)))
    seg = torch.empty(9, dtype=torch.int64, device="meta")
    assert grouped_gemm_swiglu_kernel(x, w13, seg, wrap=lambda k: Stub()).shape == (1000, 48)
    assert grouped_gemm_kernel(x[:, :48], w2, seg, wrap=lambda k: Stub()).shape == (1000, 64)
    (grid1, _, kw1), (grid2, _, kw2) = launches
    assert grid1 == ((-(-1000 // kw1["BM"]) + 8) * -(-48 // kw1["BN"]),)
    assert grid2 == ((-(-1000 // kw2["BM"]) + 8) * -(-64 // kw2["BN"]),)


def test_checks_decline():
    x, w, seg = case([3, 4], 1, 16, 32, BF16)
    assert check_grouped_gemm_call((x, w, seg)) is None
    assert check_grouped_gemm_swiglu_call((x, w, seg)) is None
    assert "dtypes" in check_grouped_gemm_call((x, w.float(), seg))
    assert "seg_indptr" in check_grouped_gemm_call((x, w, seg[:-1]))
    assert "seg_indptr" in check_grouped_gemm_call((x, w, seg.float()))
    assert "unit-stride" in check_grouped_gemm_call((x, w.transpose(1, 2).contiguous().transpose(1, 2), seg))
    assert "shapes" in check_grouped_gemm_call((x[:, :8], w, seg))
    assert "odd" in check_grouped_gemm_swiglu_call((x, w[:, :15], seg))
    assert choose(moe_ops.grouped_gemm, (x, w, seg), "cpu").provider == "triton"
    assert choose(moe_ops.grouped_gemm_swiglu, (x, w, seg), "cpu").provider == "triton"


def test_opcheck(monkeypatch):
    from ep_fuse.ops import registry

    def no_fallback(provider, op, error):
        raise AssertionError(f"{provider} {op} fell back to the reference: {error}")

    monkeypatch.setattr(registry, "_warn_once", no_fallback)
    x, w, seg = case([3, 0, 5], 2, 16, 32, BF16)
    ops = torch.ops.ep_fuse_triton
    for op, swiglu in ((ops.grouped_gemm.default, False), (ops.grouped_gemm_swiglu.default, True)):
        torch.library.opcheck(op, (x, w, seg))
        assert_matches(op(x, w, seg), loop_ref(x, w, seg, swiglu), seg, BF16)


@settings(max_examples=40, deadline=None)
@given(counts=st.lists(st.sampled_from([0, 0, 1, 3, 4, 15, 16, 17, 33]), min_size=1, max_size=5),
       tail=st.sampled_from([0, 0, 1, 5, 17]), n=st.sampled_from([8, 13, 24, 40]), k=st.sampled_from([8, 16, 37, 64]),
       dtype=st.sampled_from([BF16, F16, F32]), swiglu=st.booleans(), regime=st.sampled_from(sorted(CONFIGS)),
       seed=st.integers(0, 2**16))
def test_kernel_matches_expert_loop(counts, tail, n, k, dtype, swiglu, regime, seed):
    if swiglu and n % 2:
        n += 1
    x, w, seg = case(counts, tail, n, k, dtype, seed)
    if x.shape[0] == 0:
        return
    out = run(x, w, seg, swiglu, CONFIGS[regime])
    assert_matches(out, loop_ref(x, w, seg, swiglu), seg, dtype)

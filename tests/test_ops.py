"""Canonical ops, providers and the Triton kernel (interpreted on the CPU) against the reference."""

import logging

import pytest
import torch
from support.norm_cases import MODES, norm_args, ulp_close
from hypothesis import given, settings
from hypothesis import strategies as st

from ep_fuse.ops import canonical, choose
from ep_fuse.ops.reference import add_rms_norm_ref, rms_norm_ref
from ep_fuse.providers.common import rms_norm_out_dtype

OPS = {
    False: (torch.ops.ep_fuse.rms_norm.default, torch.ops.ep_fuse_triton.rms_norm.default, rms_norm_ref),
    True: (torch.ops.ep_fuse.add_rms_norm.default, torch.ops.ep_fuse_triton.add_rms_norm.default, add_rms_norm_ref),
}


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_opcheck_canonical_and_triton(mode, residual):
    args = norm_args(5, 40, torch.bfloat16, mode, residual)
    canon, tri, _ = OPS[residual]
    torch.library.opcheck(canon, args)
    torch.library.opcheck(tri, args)


def test_reference_modes_spell_out_model_numerics():
    """Each mode reproduces the model code it replaces, including where it rounds."""
    x = torch.randn(4, 32).to(torch.bfloat16)
    w = torch.randn(32).to(torch.bfloat16)
    xf = x.float()
    n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(rms_norm_ref(x, w, 1e-6, None, "llama", True, torch.bfloat16), w * n.to(torch.bfloat16),
                               rtol=0, atol=0)
    torch.testing.assert_close(rms_norm_ref(x, w, 1e-6, None, "weight_fp32", True, torch.bfloat16),
                               (w * n).to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(rms_norm_ref(x, w, 1e-6, None, "gemma", True, torch.bfloat16),
                               (n * (1.0 + w.float())).to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(rms_norm_ref(x, None, 1e-6, None, "none", True, None), n, rtol=0, atol=0)
    # llama rounds n before the weight; weight_fp32 does not: they differ somewhere on random data
    a = rms_norm_ref(x, w, 1e-6, None, "llama", True, torch.bfloat16)
    b = rms_norm_ref(x, w, 1e-6, None, "weight_fp32", True, torch.bfloat16)
    assert not torch.equal(a, b)


def test_reference_rejects_inconsistent_arguments():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="needs weight"):
        rms_norm_ref(x, None, 1e-6, None, "llama", True, torch.float32)
    with pytest.raises(ValueError, match="needs out_dtype"):
        rms_norm_ref(x, torch.ones(8), 1e-6, None, "llama", True, None)
    with pytest.raises(ValueError, match="not one of"):
        rms_norm_ref(x, torch.ones(8), 1e-6, None, "layer", True, None)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(0, 37),
    n=st.sampled_from([1, 7, 16, 33, 64, 100, 257, 1024]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    mode=st.sampled_from(MODES),
    residual=st.booleans(),
    eps_tensor=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_triton_matches_reference(rows, n, dtype, mode, residual, eps_tensor, seed):
    args = norm_args(rows, n, dtype, mode, residual, eps_tensor=eps_tensor, seed=seed)
    _, tri, ref_fn = OPS[residual]
    out, ref = tri(*args), ref_fn(*args)
    if residual:
        assert torch.equal(out[1], ref[1]), "the residual sum is rounded exactly like x + residual"
        out, ref = out[0], ref[0]
    assert out.dtype == ref.dtype and out.shape == ref.shape
    ulp_close(out, ref, out.dtype)


@pytest.mark.parametrize("w_dtype, out_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, None)])
def test_triton_mixed_weight_dtypes(w_dtype, out_dtype):
    for mode in ("llama", "weight_fp32"):
        if mode == "llama" and out_dtype is None:
            continue
        args = norm_args(9, 48, torch.bfloat16, mode, True, w_dtype=w_dtype, out_dtype=out_dtype)
        out, ref = OPS[True][1](*args), add_rms_norm_ref(*args)
        assert out[0].dtype == ref[0].dtype == rms_norm_out_dtype(args[0], args[2], mode, True, out_dtype)
        ulp_close(out[0], ref[0], out[0].dtype)


def test_triton_chunked_path_for_wide_rows():
    from ep_fuse.providers.triton.rms_norm_kernel import LaunchConfig, launch

    x, r, w, eps, _, mode, _, out_dtype = norm_args(6, 300, torch.bfloat16, "llama", True)
    y, s = torch.empty_like(x), torch.empty_like(x)
    launch(x, r, w, y, s, eps, mode, out_dtype, 300, 300, config=LaunchConfig(64, 1, 4, chunked=True))
    ref_y, ref_s = add_rms_norm_ref(x, r, w, eps, None, mode, True, out_dtype)
    assert torch.equal(s, ref_s)
    ulp_close(y, ref_y, torch.bfloat16)


def test_triton_on_4d_head_dim_view():
    x = torch.randn(2, 5, 4, 16).to(torch.bfloat16)
    w = torch.randn(16).to(torch.bfloat16)
    args = (x, w, 1e-6, None, "llama", True, torch.bfloat16)
    ulp_close(OPS[False][1](*args), rms_norm_ref(*args), torch.bfloat16)


def test_failing_kernel_falls_back_with_one_warning(monkeypatch, caplog):
    import ep_fuse.providers.triton.rms_norm_kernel as k

    def boom(*a, **kw):
        raise RuntimeError("simulated launch failure")

    monkeypatch.setattr(k, "launch", boom)
    args = norm_args(4, 32, torch.bfloat16, "llama", True)
    with caplog.at_level(logging.WARNING, logger="ep_fuse"):
        out1 = OPS[True][1](*args)
        out2 = OPS[True][1](*args)
    ref = add_rms_norm_ref(*args)
    assert torch.equal(out1[0], ref[0]) and torch.equal(out2[1], ref[1])
    warnings = [r for r in caplog.records if "simulated launch failure" in r.getMessage()]
    assert len(warnings) == 1 and "using the reference implementation" in warnings[0].getMessage()


def test_unsupported_call_runs_reference_at_run_time():
    x = torch.randn(8, 6).t()  # not contiguous
    args = (x, torch.ones(8), 1e-6, None, "weight_fp32", True, None)
    torch.testing.assert_close(OPS[False][1](*args), rms_norm_ref(*args), rtol=0, atol=0)


def test_choose_by_device_priority_and_support():
    args = norm_args(4, 32, torch.bfloat16, "llama", False)
    assert choose(canonical.rms_norm, args, "cpu").provider == "triton"  # interpreter on
    assert choose(canonical.rms_norm, args, "cpu", ("reference",)).provider == "reference"
    bad = (args[0].t().contiguous().t(), *args[1:])
    c = choose(canonical.rms_norm, bad, "cpu")
    assert c.provider == "reference" and c.declined == (("triton", "input rows are not unit-stride rows with one row stride"),)
    c = choose(canonical.rms_norm, args, "npu")
    assert c.provider == "reference" and c.declined[0][0] == "npu" and "torch_npu" in c.declined[0][1]
    no_upcast = (args[0], args[1], args[2], None, "llama", False, torch.bfloat16)
    assert "no upcast" in choose(canonical.rms_norm, no_upcast, "cpu").declined[0][1]


@pytest.mark.parametrize("seq", [7, 1], ids=["prefill", "decode"])
def test_triton_on_row_slices_of_a_wider_projection(seq):
    """DeepSeek kv_a_layernorm reads split(kv_a_proj(x), [kv_lora, rope])[0]: strided rows. At decode the
    sequence dim has size 1 and the rows are 48 apart along the batch dim (a size-1 dim places nothing)."""
    proj = torch.randn(2, seq, 48).to(torch.bfloat16)
    x, _rope = proj.split([32, 16], dim=-1)
    r = torch.randn(2, seq, 48).to(torch.bfloat16)[..., 8:40]
    w = torch.randn(32).to(torch.bfloat16)
    for args, ref_fn, op in (
        ((x, w, 1e-6, None, "llama", True, torch.bfloat16), rms_norm_ref, OPS[False][1]),
        ((x, r, w, 1e-6, None, "llama", True, torch.bfloat16), add_rms_norm_ref, OPS[True][1]),
    ):
        out, ref = op(*args), ref_fn(*args)
        out, ref = (out, ref) if isinstance(out, tuple) else ((out,), (ref,))
        for o, e in zip(out, ref):
            assert o.stride() == e.stride(), "provider output layout equals the reference layout"
            ulp_close(o, e, torch.bfloat16)
    assert choose(canonical.rms_norm, (x, w, 1e-6, None, "llama", True, torch.bfloat16), "cpu").provider == "triton"
    permuted = torch.randn(7, 2, 32).to(torch.bfloat16).transpose(0, 1)
    c = choose(canonical.rms_norm, (permuted, w, 1e-6, None, "llama", True, torch.bfloat16), "cpu")
    assert c.provider == "reference"


def test_perf_rules_from_the_h200_measurements():
    from ep_fuse.providers.triton import perf

    def args(rows, h):
        return norm_args(1, 1, torch.bfloat16, "llama", True, shape=(rows, h))

    assert perf.add_rms_norm_prefers(args(16384, 7168), "inductor") is None
    assert perf.add_rms_norm_prefers(args(64, 7168), "inductor") is None
    assert "measured as fast" in perf.add_rms_norm_prefers(args(512, 7168), "inductor")
    assert "measured as fast" in perf.add_rms_norm_prefers(args(64, 4096), "inductor")
    assert perf.add_rms_norm_prefers(args(512, 7168), "eager") is None, "always beats unfused eager ops"
    assert perf.rms_norm_prefers(norm_args(4, 64, torch.bfloat16, "llama", False), "inductor") is not None
    c = choose(canonical.add_rms_norm, args(512, 7168), "cpu", executor="inductor")
    assert c.provider == "reference" and c.declined[0][0] == "triton"

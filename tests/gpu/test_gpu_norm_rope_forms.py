"""The norm and RoPE forms added for issue 35 on CUDA: the ``_pow`` RMSNorm modes (Gemma4-style, the existing
``weight_fp32`` / ``none`` kernel code with ``rsqrt``) and the ``rotate_pairs_fp32`` RoPE (Ernie 4.5: fp32 math, one
rounding at the store) against the references, at decode and prefill sizes, with q/k as views of one projection;
and issue 45's rounded RMSNorm forms (``unverified.py``: ``rms_norm:none_rstd_cast``, ``add_rms_norm:none_rstd_cast``,
``add_rms_norm:norm_dtype``): DeepSeek-V4's statistic rounded before the multiply, Zaya's fp32 residual stream."""

from __future__ import annotations

import pytest
import torch

import ep_fuse.catalog  # noqa: F401  (defines every op and provider)
from ep_fuse.ops.rms_norm import add_rms_norm_ref, rms_norm_ref
from ep_fuse.ops.rope import rope_qk_ref
from ep_fuse.providers.triton.rms_norm import supports as triton_norm_supports
from ep_fuse.providers.triton.rope import check_rope_call

BF16 = torch.bfloat16
TOL = {BF16: (1.6e-2, 1e-5), torch.float16: (1e-3, 1e-5), torch.float32: (1e-5, 1e-6)}


@pytest.fixture(autouse=True)
def _unverified_kernels_on(monkeypatch):
    """These checks are what clears the variants (``unverified.py``): their support checks must pass."""
    monkeypatch.setenv("EP_FUSE_UNVERIFIED_KERNELS", "1")


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    rtol, atol = TOL[ref.dtype]
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("rows, n", [(1, 2816), (37, 256), (4096, 2816), (64, 20000)])
@pytest.mark.parametrize("mode", ["weight_fp32_pow", "none_pow"])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_pow_rms_norm_modes_match_the_reference(rows, n, mode, residual, dtype):
    g = torch.Generator(device="cuda").manual_seed(rows + n)
    x = torch.randn(rows, n, generator=g, device="cuda").to(dtype)
    r = torch.randn(rows, n, generator=g, device="cuda").to(dtype)
    w = None if mode == "none_pow" else (torch.randn(n, generator=g, device="cuda") * 0.1 + 1)  # w.float()
    out_dtype = dtype if dtype != torch.float32 else None
    rest = (w, 1e-6, None, mode, True, out_dtype)
    if residual:
        out = torch.ops.ep_fuse_triton.add_rms_norm(x, r, *rest)
        ref = add_rms_norm_ref(x, r, *rest)
        assert torch.equal(out[1], ref[1]), "the residual sum rounds as x + residual"
        _close(out[0], ref[0])
    else:
        _close(torch.ops.ep_fuse_triton.rms_norm(x, *rest), rms_norm_ref(x, *rest))


@pytest.mark.parametrize("b, s, hq, hk, d", [(1, 1, 32, 4, 128), (2, 333, 8, 2, 64), (4, 1, 16, 16, 80)])
@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize("cos_dtype", ["fp32", "heads"])
def test_rotate_pairs_fp32_rope_matches_the_reference(b, s, hq, hk, d, dtype, cos_dtype):
    g = torch.Generator(device="cuda").manual_seed(s * d)
    qkv = torch.randn(b, s, hq + hk, d, generator=g, device="cuda").to(dtype)
    q, k = qkv[:, :, :hq].transpose(1, 2), qkv[:, :, hq:].transpose(1, 2)  # [B, H, S, D] views
    ang = torch.randn(b, 1, s, d // 2, generator=g, device="cuda")
    cos, sin = ang.cos(), ang.sin()
    if cos_dtype == "heads":
        cos, sin = cos.to(dtype), sin.to(dtype)
    args = (q, k, cos, sin, "rotate_pairs_fp32", d, dtype)
    assert check_rope_call(args) is None
    out = torch.ops.ep_fuse_triton.rope_qk(*args)
    ref = rope_qk_ref(*args)
    for o, r in zip(out, ref):
        assert o.stride() == r.stride()
        # fp32 math: FMA contraction may move the fp32 sum by an ulp, so at most one bf16/fp16 ulp apart
        _close(o, r)
        assert (o.float() != r.float()).float().mean() < 1e-3


@pytest.mark.parametrize("rows, n", [(1, 2816), (37, 256), (4096, 2048), (64, 20000)])
@pytest.mark.parametrize("form", ["rstd", "rstd_add", "norm_dtype"])
@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_rounded_rms_norm_forms_match_the_reference(rows, n, form, dtype):
    """The statistic rounded to the model dtype (DeepSeek-V4) or the norm over the fp32 sum rounded (Zaya): the sum
    bitwise, the output within one ulp of the model dtype on few elements (the fp32 statistic may differ in its last
    bit, which the rounding of the statistic or of the output can carry); the 64-row case takes the chunked kernel."""
    g = torch.Generator(device="cuda").manual_seed(rows + n)
    x = (torch.randn(rows, n, generator=g, device="cuda") * 3).to(dtype)
    r = torch.randn(rows, n, generator=g, device="cuda") * 3
    if form == "rstd":
        args = (x, None, 1e-6, None, "none_rstd_cast", True, dtype)
        assert triton_norm_supports(args) is None, "the kernel takes the call (no silent fallback)"
        out, ref = torch.ops.ep_fuse_triton.rms_norm(*args), rms_norm_ref(*args)
    else:
        w = (torch.randn(n, generator=g, device="cuda") * 0.1 + 1).to(dtype)
        args = ((x, r.to(dtype), None, 1e-6, None, "none_rstd_cast", True, dtype) if form == "rstd_add"
                else (x, r, w, 1e-6, None, "llama", True, dtype, dtype))
        assert triton_norm_supports(args) is None, "the kernel takes the call (no silent fallback)"
        (out, s), (ref, ref_s) = torch.ops.ep_fuse_triton.add_rms_norm(*args), add_rms_norm_ref(*args)
        assert s.dtype == ref_s.dtype and torch.equal(s, ref_s), "the sum rounds as x + residual"
    assert out.shape == ref.shape and out.dtype == ref.dtype
    rtol = {BF16: 1.6e-2, torch.float16: 2e-3}[dtype]  # one ulp of the model dtype
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=1e-5)
    assert (out.float() != ref.float()).float().mean() < 1e-2

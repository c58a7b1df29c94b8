"""The router and RoPE forms added for issue 15 (``topk_softmax``, ``topk_sigmoid``, ``softmax_bias``, DeepSeek-V3's
remote ``sum_top2_fill0`` mask, Ernie's ``renorm_clamp``, ``rotate_pairs``) on CUDA:
the Triton kernels against the references, at decode and prefill token counts, with exact ties."""

from __future__ import annotations

import pytest
import torch

import ep_fuse.catalog  # noqa: F401  (defines every op and provider)
from ep_fuse.ops.rope import rope_qk_ref
from ep_fuse.ops.moe_gating import moe_gating_stable_ref
from ep_fuse.providers.triton.moe_gating import check_gating_call, moe_gating_kernel

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _unverified_kernels_on(monkeypatch):
    """These checks are what clears the variants (``unverified.py``): their support checks must pass."""
    monkeypatch.setenv("EP_FUSE_UNVERIFIED_KERNELS", "1")


def _logits(t: int, e: int, ties: bool, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(t * 31 + e)
    if ties:  # few distinct values: exact ties inside and across the top-k
        x = torch.randint(-2, 3, (t, e), generator=g, device="cuda").float() * 0.5
    else:
        x = torch.randn(t, e, generator=g, device="cuda") * 2
    return x.to(dtype)


@pytest.mark.parametrize("t", [1, 37, 512, 4096])
@pytest.mark.parametrize("form", ["topk_softmax", "softmax_bias", "topk_sigmoid", "fill0", "clamp"])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_router_forms_match_the_stable_reference(t, form, ties, dtype):
    if form in ("softmax_bias", "fill0", "clamp") and dtype == BF16:
        pytest.skip("bf16 softmax/sigmoid scores are declined (not bitwise reproducible)")
    e, k = 64, 8
    b = torch.randint(-1, 2, (e,), device="cuda").float() * 0.25
    x = _logits(t, e, ties, dtype)
    args = {"topk_softmax": (x, None, k, "topk_softmax", 1, 1, "none", False, 0.0, 1.0, BF16),
            "softmax_bias": (x, b, k, "softmax", 1, 1, "none", True, 0.0, 1.0, BF16),
            "topk_sigmoid": (x, None, k, "topk_sigmoid", 1, 1, "none", True, 0.0, 1.0, BF16),
            # a bias of -0.75 on some experts: masked experts at 0.0 are chosen over negative kept ones
            "fill0": (x, b * 3, k, "sigmoid", 8, 2, "sum_top2_fill0", True, 1e-20, 2.5, None),
            "clamp": (x, b, k, "softmax", 1, 1, "none", True, 1e-12, 1.0, BF16, True)}[form]
    assert check_gating_call(args) is None
    w, ids = moe_gating_kernel(*args)
    rw, rids = moe_gating_stable_ref(*args)
    assert torch.equal(ids, rids), "identical ids, exact ties included (lowest index first)"
    torch.testing.assert_close(w.float(), rw.float(), rtol=8e-3, atol=1e-6)


@pytest.mark.parametrize("shape", [(1, 32, 1, 128), (2, 8, 333, 64), (4, 16, 1, 80)])
@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_rotate_pairs_rope_is_bitwise_the_reference(shape, dtype):
    b, h, s, d = shape
    g = torch.Generator(device="cuda").manual_seed(s)
    q = torch.randn(b, h, s, d, generator=g, device="cuda").to(dtype)
    k = q[:, :2].clone()
    ang = torch.randn(b, 1, s, d // 2, generator=g, device="cuda")
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    out = torch.ops.ep_fuse_triton.rope_qk(q, k, cos, sin, "rotate_pairs", d, None)
    ref = rope_qk_ref(q, k, cos, sin, "rotate_pairs", d, None)
    for o, r in zip(out, ref):
        assert o.shape == r.shape and o.dtype == r.dtype and torch.equal(o, r)

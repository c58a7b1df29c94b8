"""Issue 35's router kernel variants on CUDA (``unverified.py``: ``moe_gating:sqrt_softplus``, ``topk_bias``,
``expert_scale``, ``softmax_sum_top2_fill0``): the Triton kernel against the stable reference at decode and prefill
token counts, with exact ties. Passing clears them for GPUs. ``moe_gating:nd_logits`` (Zaya's [B, S, E + 1] logits run
as rows of one view): the same kernel on 3-D logits; ``moe_gating_sink:triton`` (Inkling's sink router kernel).
Passing clears them (remove them from ``UNVERIFIED_ON_GPU``)."""

from __future__ import annotations

import pytest
import torch

import ep_fuse.catalog  # noqa: F401  (defines every op and provider)
from ep_fuse.ops.moe_gating import moe_gating_sink_stable_ref, moe_gating_stable_ref
from ep_fuse.providers.triton.moe_gating import check_gating_call, check_sink_call, moe_gating_kernel, moe_gating_sink_kernel

BF16 = torch.bfloat16
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def _unverified_kernels_on(monkeypatch):
    """These checks are what clears the variants: their support checks must pass."""
    monkeypatch.setenv("EP_FUSE_UNVERIFIED_KERNELS", "1")


def _logits(t: int, e: int, ties: bool) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(t * 31 + e)
    if ties:  # few distinct values: exact ties inside and across the top-k
        return torch.randint(-2, 3, (t, e), generator=g, device="cuda").float() * 0.5
    return torch.randn(t, e, generator=g, device="cuda") * 2


@pytest.mark.parametrize("t", [1, 37, 512, 4096])
@pytest.mark.parametrize("form", ["sqrt_softplus", "topk_bias", "expert_scale", "softmax_fill0"])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("weight_dtype", [None, BF16])
def test_issue35_router_forms_match_the_stable_reference(t, form, ties, weight_dtype):
    e, k = 64, 8
    x = _logits(t, e, ties)
    b = torch.randint(-1, 2, (e,), device="cuda").float() * 0.25
    s = torch.linspace(0.5, 1.5, e, device="cuda").to(BF16)  # Gemma-4's per_expert_scale in the model dtype
    if form == "sqrt_softplus" and ties:
        x = (x > 0).float() * 40  # softplus(0) and softplus(40) = 40 are exact in every implementation
    args = {"sqrt_softplus": (x, b, k, "sqrt_softplus", 1, 1, "none", True, 1e-20, 1.5, weight_dtype),
            "topk_bias": (x, b, k, "topk_sigmoid", 1, 1, "none", False, 0.0, 1.0, weight_dtype),
            "expert_scale": (x, None, k, "softmax", 1, 1, "none", True, 0.0, 1.0, weight_dtype, False, s),
            "softmax_fill0": (x, None, k, "softmax", 8, 4, "sum_top2_fill0", True, 1e-20, 2.83, weight_dtype)}[form]
    assert check_gating_call(args) is None
    w, ids = moe_gating_kernel(*args)
    rw, rids = moe_gating_stable_ref(*args)
    assert torch.equal(ids, rids), "identical ids, exact ties included (lowest index first)"
    torch.testing.assert_close(w.float(), rw.float(), rtol=1e-5 if weight_dtype is None else 8e-3, atol=1e-6)


@pytest.mark.parametrize("b, s", [(1, 1), (2, 37), (4, 1024)])
@pytest.mark.parametrize("ties", [False, True])
def test_nd_logits_match_the_stable_reference(b, s, ties):
    """Zaya: softmax over E + 1 classes (the skip expert) + balancing bias, top-1 and top-2, [B, S, K] outputs."""
    e = 17
    x = _logits(b * s, e, ties).view(b, s, e)
    bias = torch.linspace(-0.05, 0.05, e, device="cuda")
    bias[-1] = -1.0
    for k in (1, 2):
        args = (x, bias, k, "softmax", 1, 1, "none", False, 0.0, 1.0, None)
        assert check_gating_call(args) is None
        w, ids = moe_gating_kernel(*args)
        rw, rids = moe_gating_stable_ref(*args)
        assert w.shape == (b, s, k) and torch.equal(ids, rids)
        torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("t", [1, 37, 512, 4096])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("weight_dtype", [None, BF16])
def test_sink_matches_the_stable_reference(t, ties, weight_dtype):
    """Inkling: 64 routed + 2 shared experts, top-6, ``route_scale`` 8 and a learned global scale."""
    e, s, k = 64, 2, 6
    x = _logits(t, e + s, ties)
    b = torch.randint(-1, 2, (e,), device="cuda").float() * 0.25
    args = (x, b, k, s, 8.0, torch.tensor([1.25], device="cuda"), weight_dtype)
    assert check_sink_call(args) is None
    w, ids = moe_gating_sink_kernel(*args)
    rw, rids = moe_gating_sink_stable_ref(*args)
    assert torch.equal(ids, rids), "identical ids, exact ties included (lowest index first)"
    torch.testing.assert_close(w.float(), rw.float(), rtol=1e-5 if weight_dtype is None else 8e-3, atol=1e-6)

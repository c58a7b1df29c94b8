"""Router forms beyond transformers 5's own routers: DeepSeek-V3's remote-code ``MoEGate`` (``masked_fill`` 0.0),
Ernie-4.5-MoE's ``clamp(sum, min=eps)`` renormalisation and Cohere2-MoE's ``expert_selection_fn="sigmoid"``:
the pattern variants, exact equality with eager through the reference provider, the Triton kernel (interpreter)
against the stable reference, and look-alikes reported as near misses with the failing check."""

from support import loop_moe_modules as L
import pytest
import torch
import transformers as tf
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import ep_fuse
from ep_fuse.ops.moe_gating import moe_gating_ref, moe_gating_stable_ref
from ep_fuse.providers.triton.moe_gating import check_gating_call, moe_gating_kernel
from support.compiling import compile_and_run

BF16, F32 = torch.bfloat16, torch.float32
REFERENCE = {"executor": "eager", "providers": {"cpu": ["reference"]}}
TRITON = {"executor": "eager", "patterns": ["moe_gating"]}


class RemoteGate(nn.Module):
    """DeepSeek-V3's remote ``MoEGate.forward`` after the router GEMM, on given fp32 logits. ``variant``
    breaks one step: ``fill_one`` (``masked_fill`` 1.0), ``flat_view`` (scores viewed ``[T * 2, -1]`` before a
    ``[E / 2]`` bias), ``mask_weights`` (weights gathered from the masked selection)."""

    def __init__(self, e=8, n_group=2, topk_group=1, k=2, fill=0.0, bias=None, variant="ok"):
        super().__init__()
        self.e, self.g, self.topk_group, self.k, self.fill, self.variant = e, n_group, topk_group, k, fill, variant
        width = e // 2 if variant == "flat_view" else e
        self.e_score_correction_bias = nn.Parameter(torch.linspace(-0.1, 0.1, width) if bias is None else bias)

    def forward(self, logits):
        t = logits.shape[0]
        scores = logits.sigmoid()
        if self.variant == "flat_view":
            choice = (scores.view(t * 2, -1) + self.e_score_correction_bias.unsqueeze(0)).view(t, -1)
        else:
            choice = scores.view(t, -1) + self.e_score_correction_bias.unsqueeze(0)
        group_scores = choice.view(t, self.g, -1).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(t, self.g, self.e // self.g).reshape(t, -1)
        fill = 1.0 if self.variant == "fill_one" else self.fill
        tmp_scores = choice.masked_fill(~score_mask.bool(), fill)
        _, topk_idx = torch.topk(tmp_scores, k=self.k, dim=-1, sorted=False)
        topk_weight = (tmp_scores if self.variant == "mask_weights" else scores).gather(1, topk_idx)
        topk_weight = topk_weight / (topk_weight.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_idx, topk_weight * 2.5


class ClampRouter(nn.Module):
    """Ernie-4.5-MoE's router tail on given logits; ``clamp_max``/``clamp_weights`` are look-alikes."""

    def __init__(self, e=8, variant="ok"):
        super().__init__()
        self.bias = nn.Parameter(torch.linspace(-0.05, 0.05, e)[None], requires_grad=False)  # [1, E] as Ernie
        self.variant = variant

    def forward(self, logits):
        p = torch.softmax(logits, dim=1, dtype=torch.float)
        _, ids = torch.topk(p + self.bias.squeeze(), 2, dim=-1)
        w = torch.gather(p, dim=-1, index=ids)
        if self.variant == "clamp_max":
            return w / torch.clamp(w.sum(dim=-1, keepdim=True), min=1e-12, max=1.0), ids
        if self.variant == "clamp_weights":
            return torch.clamp(w, min=1e-12) / w.sum(dim=-1, keepdim=True), ids
        return (w / torch.clamp(w.sum(dim=-1, keepdim=True), min=1e-12)).to(BF16), ids


def _logits(t, e, seed, dtype=F32, scale=2.0):
    return (torch.randn(t, e, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _run(mod, *inputs, **options):
    with torch.no_grad():
        ref = mod(*inputs)
    torch._dynamo.reset()
    out = compile_and_run(mod, *inputs, **(options or REFERENCE))
    rep = ep_fuse.last_report()
    return ref, out, rep


def _gating(rep):
    return [m for m in rep.matches if m.pattern == "moe_gating"]


def _set_equal(ids, w, ref_ids, ref_w):
    """Same (expert, weight) pairs per token in any slot order (``sorted=False`` routers). Weights bitwise for
    K <= 2; for K > 2 the renormalising sum runs in the reference's slot order (within an ulp)."""
    o, ro = ids.argsort(-1), ref_ids.argsort(-1)
    assert torch.equal(ids.gather(1, o), ref_ids.gather(1, ro))
    assert w.dtype == ref_w.dtype
    if ids.shape[1] <= 2:
        assert torch.equal(w.gather(1, o), ref_w.gather(1, ro))
    else:
        torch.testing.assert_close(w.gather(1, o), ref_w.gather(1, ro), rtol=1e-6, atol=0)


# --------------------------------------------------------------------------- DeepSeek-V3 remote MoEGate
@pytest.mark.parametrize("fill, variant", [(0.0, "sigmoid_group_sum_top2_fill0"),
                                           (float("-inf"), "sigmoid_group_sum_top2")])
def test_remote_gate_fuses_and_is_bitwise_eager(fill, variant):
    """Both fills, through ``view(T, -1)``, ``bias.unsqueeze(0)`` and ``view(T, G, -1)``: reference provider
    bitwise the model; the Triton kernel (interpreter) the same experts and weights on tie-free logits."""
    mod = RemoteGate(e=16, n_group=4, topk_group=2, k=4, fill=fill)
    x = _logits(24, 16, seed=3)
    (ids, w), (oids, ow), rep = _run(mod, x)
    assert [m.variant for m in _gating(rep)] == [variant] and not rep.near_misses, rep.summary()
    _set_equal(oids, ow, ids, w)
    _, (kids, kw), rep = _run(mod, x, **TRITON)
    assert {m.provider for m in _gating(rep)} == {"triton"}
    o, ro = kids.argsort(-1), ids.argsort(-1)
    assert torch.equal(kids.gather(1, o), ids.gather(1, ro))
    torch.testing.assert_close(kw.gather(1, o), w.gather(1, ro), rtol=1e-6, atol=1e-6)


def test_remote_gate_zero_fill_semantics():
    """A negative bias leaves fewer than K kept experts with a positive biased score: the remote code then picks
    masked experts (at 0.0, tied) and weighs them by their own sigmoid score. The canonical ``sum_top2_fill0``
    reproduces it -- the reference with the model's ``torch.topk`` ties (bitwise), Triton with the lowest
    masked id -- and differs from transformers 5's -inf fill on exactly those tokens."""
    bias = torch.full((8,), -0.9)
    mod = RemoteGate(bias=bias)
    x = _logits(32, 8, seed=4, scale=0.5)  # sigmoid in about (0.3, 0.7): every biased score is negative
    (ids, w), (oids, ow), rep = _run(mod, x)
    assert [m.variant for m in _gating(rep)] == ["sigmoid_group_sum_top2_fill0"]
    _set_equal(oids, ow, ids, w)
    args = (x, bias, 2, "sigmoid", 2, 1, "sum_top2_fill0", True, 1e-20, 2.5, None)
    neg_inf = moe_gating_ref(x, bias, 2, "sigmoid", 2, 1, "sum_top2", True, 1e-20, 2.5, None)[1]
    kept = torch.arange(8).view(2, 4)
    masked_rows = [t for t in range(32) if set(ids[t].tolist()) != set(neg_inf[t].tolist())]
    assert masked_rows == list(range(32)), "all biased scores < 0: the 0.0 of masked experts always wins"
    for t in range(32):  # every row: the two ids come from the group the -inf fill keeps, never both
        group = int(neg_inf[t, 0]) // 4
        assert not set(ids[t].tolist()) <= set(kept[group].tolist())
    kw, kids = moe_gating_kernel(*args)
    sw, sids = moe_gating_stable_ref(*args)
    assert torch.equal(kids, sids)
    torch.testing.assert_close(kw, sw, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("variant, why", [
    ("fill_one", "moe_gating[sigmoid_group_sum_top2_fill0]: failed at 1.0: expected 0.0, got 1.0"),
    ("flat_view", "moe_gating[sigmoid_group_sum_top2_fill0]: failed at add: must be the same node as 'sigmoid'"),
    ("mask_weights", "sigmoid (aten.sigmoid.default): not fused"),  # the gather reads the masked scores
])
def test_remote_gate_look_alikes_are_near_misses(variant, why):
    """Before the anchors read through views, the remote gate and its look-alikes left no near miss at all
    (the sigmoid's readers are a ``view`` and a ``gather``)."""
    ref, out, rep = _run(RemoteGate(variant=variant), _logits(12, 8, seed=2))
    assert _gating(rep) == [] and all(torch.equal(a, b) for a, b in zip(out, ref))
    text = "\n".join(m.explain() for m in rep.near_misses if "moe_gating" in m.explain())
    assert why in text, text


# --------------------------------------------------------------------------- Ernie-4.5-MoE, Cohere2-MoE
def _hf_router(cls, cfg):
    torch.manual_seed(0)
    router = cls(cfg).eval()
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
        for name, p in router.named_parameters():
            if "bias" in name:
                p.copy_(torch.linspace(-0.05, 0.05, p.numel()).view_as(p))
    return router


def test_ernie_router_fuses_with_clamp_renorm():
    """transformers' ``Ernie4_5_MoeTopKRouter``: softmax, ``moe_statics`` bias (selection only), top-k, gather,
    ``/ clamp(sum, min=moe_norm_min)``, cast: canonical ``renorm_clamp=True``."""
    from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import (
        Ernie4_5_MoeTopKRouter,
    )

    cfg = tf.Ernie4_5_MoeConfig(hidden_size=32, num_experts=8, num_experts_per_tok=2, moe_norm_min=1e-12)
    router = _hf_router(Ernie4_5_MoeTopKRouter, cfg)
    h = _logits(20, 32, seed=5, dtype=BF16, scale=1.0)
    ref, out, rep = _run(router, h)
    gating = _gating(rep)
    assert [m.variant for m in gating] == ["softmax_bias"] and not rep.near_misses, rep.summary()
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    _, out, rep = _run(router, h, **TRITON)
    assert {m.provider for m in _gating(rep)} == {"triton"}
    assert torch.equal(out[2], ref[2])
    torch.testing.assert_close(out[1].float(), ref[1].float(), rtol=8e-3, atol=1e-6)


@pytest.mark.parametrize("variant, why", [
    ("clamp_max", "moe_gating[softmax_bias]: failed at 1.0: expected None, got 1.0"),
    ("clamp_weights", "guard whole_tail: the routing weights feed sum_1")])
def test_clamp_look_alikes_are_near_misses(variant, why):
    ref, out, rep = _run(ClampRouter(variant=variant), _logits(12, 8, seed=6))
    assert _gating(rep) == [] and all(torch.equal(a, b) for a, b in zip(out, ref))
    text = "\n".join(m.explain() for m in rep.near_misses if "moe_gating" in m.explain())
    assert why in text, text


def test_clamp_router_exact():
    ref, out, rep = _run(ClampRouter(), _logits(12, 8, seed=6))
    assert [m.variant for m in _gating(rep)] == ["softmax_bias"]
    assert all(torch.equal(a, b) for a, b in zip(out, ref))


@pytest.mark.parametrize("norm", [True, False])
def test_cohere2_sigmoid_router(norm):
    """``Cohere2MoeTopKRouter(expert_selection_fn="sigmoid")``: top-k of the logits, sigmoid of the K values,
    ``norm_topk_prob``. fp32 fuses (``topk_sigmoid``); bf16 computes the sigmoid in bf16: a near miss."""
    from transformers.models.cohere2_moe.modeling_cohere2_moe import (
        Cohere2MoeTopKRouter,
    )

    cfg = tf.Cohere2MoeConfig(hidden_size=32, num_experts=8, num_experts_per_tok=2, expert_selection_fn="sigmoid",
                              norm_topk_prob=norm)
    router = _hf_router(Cohere2MoeTopKRouter, cfg)
    h = _logits(20, 32, seed=7, scale=1.0)
    ref, out, rep = _run(router, h)
    assert [m.variant for m in _gating(rep)] == ["topk_sigmoid"] and not rep.near_misses, rep.summary()
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    _, out, rep = _run(router, h, **TRITON)
    assert {m.provider for m in _gating(rep)} == {"triton"}
    assert torch.equal(out[2], ref[2])
    torch.testing.assert_close(out[1], ref[1], rtol=1e-6, atol=1e-7)
    _, _, rep = _run(router.to(BF16), h.to(BF16))
    assert _gating(rep) == []
    text = "\n".join(m.explain() for m in rep.near_misses if "moe_gating" in m.explain())
    assert "sigmoid of the top-k values in torch.bfloat16" in text, text


# --------------------------------------------------------------------------- kernel vs the stable reference
@settings(max_examples=40, deadline=None)
@given(t=st.integers(1, 24), form=st.sampled_from(["fill0", "clamp", "topk_sigmoid"]), ties=st.booleans(),
       renorm=st.booleans(), weight_dtype=st.sampled_from([None, BF16]), seed=st.integers(0, 2**16))
def test_triton_new_forms_match_the_stable_reference(t, form, ties, renorm, weight_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if ties:
        # exact ties only: logits 0 or 40 (sigmoid 0.5 / 1.0 exactly, whatever the implementation) and biases
        # in quarters, so every biased score and group sum is exact. Ties of values equal only in exact math
        # (e.g. sigmoid(1) + sigmoid(-1) - 0.3 == 0.5 + 0.2) are decided by an ulp of the sigmoid, which the
        # kernel and torch round differently: no contract can fix those.
        x = torch.randint(0, 2, (t, 16), generator=g).float() * 40
        b = torch.randint(-4, 2, (16,), generator=g).float() * 0.25  # negative: masked experts at 0.0 compete
    else:
        x = torch.randn(t, 16, generator=g) * 2
        b = torch.randint(-3, 2, (16,), generator=g).float() * 0.3
    args = {"fill0": (x, b, 3, "sigmoid", 4, 2, "sum_top2_fill0", renorm, 1e-20, 2.5, weight_dtype),
            "clamp": (x, b, 3, "softmax", 1, 1, "none", renorm, 0.3, 1.0, weight_dtype, True),
            "topk_sigmoid": (x, None, 3, "topk_sigmoid", 1, 1, "none", renorm, 0.0, 1.0, weight_dtype)}[form]
    assert check_gating_call(args) is None
    w, ids = moe_gating_kernel(*args)
    rw, rids = moe_gating_stable_ref(*args)
    assert torch.equal(ids, rids), "identical ids, exact ties included (lowest index first)"
    torch.testing.assert_close(w.float(), rw.float(), rtol=1e-6 if weight_dtype is None else 8e-3, atol=1e-7)


def test_opcheck_new_arguments():
    x, b = _logits(9, 16, seed=8), torch.linspace(-0.5, 0.2, 16)
    for args in [(x, b, 4, "sigmoid", 4, 2, "sum_top2_fill0", True, 1e-20, 2.5, None),
                 (x, b, 2, "softmax", 1, 1, "none", True, 1e-12, 1.0, BF16, True),
                 (x, None, 2, "topk_sigmoid", 1, 1, "none", True, 0.0, 1.0, None)]:
        torch.library.opcheck(torch.ops.ep_fuse.moe_gating.default, args)
        torch.library.opcheck(torch.ops.ep_fuse_triton.moe_gating.default, args)


def test_clamp_renorm_differs_from_adding_eps():
    """``clamp(sum, min=eps)`` is its own renormalisation: a sum below eps is replaced, not shifted."""
    w = torch.tensor([[1e-4, 2e-4]])
    args = (torch.log(w), None, 2, "topk_softmax", 1, 1, "none", True, 0.5, 1.0, None)
    clamp = moe_gating_ref(*args, True)[0]
    add = moe_gating_ref(*args)[0]
    expected = torch.softmax(torch.log(w), -1).sort(descending=True)[0]  # the sum is 1.0 > eps: unchanged
    assert torch.equal(clamp, expected) and torch.equal(add, expected / 1.5)


def test_deepseek_remote_loop_block_gate_is_fused():
    """The whole remote-code block after ``prepare``: the gate is ``sigmoid_group_sum_top2_fill0``."""
    model = L.build(L.DeepseekV3MoE, layers=1)
    ep_fuse.prepare(model)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(9))
    ref, out, rep = _run(model, x)
    assert [m.variant for m in _gating(rep)] == ["sigmoid_group_sum_top2_fill0"], rep.summary()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_new_kernel_variants_are_checked_and_npu_declines(monkeypatch):
    """Triton asks :func:`gpu_unverified` about the score, the group mask and the clamp (each is a kernel variant
    of its own, off on CUDA until ``tests/gpu/test_gpu_forms.py`` has run); ``npu_moe_gating_top_k`` has neither
    the 0.0 mask nor the clamp: the NPU provider declines them (the reference runs)."""
    import ep_fuse.providers.triton.moe_gating as triton_router
    from ep_fuse.providers.npu.moe_gating import gating_supports

    asked = []
    monkeypatch.setattr(triton_router, "gpu_unverified", lambda v, _t: asked.append(v))
    x, b = _logits(4, 16, seed=1), torch.zeros(16)
    assert check_gating_call((x, b, 2, "sigmoid", 4, 1, "sum_top2_fill0", True, 1e-20, 2.5, None, True)) is None
    assert asked == ["moe_gating:sigmoid", "moe_gating:sum_top2_fill0", "moe_gating:renorm_clamp"]
    assert "0.0" in gating_supports((x, b, 2, "sigmoid", 4, 1, "sum_top2_fill0", True, 1e-20, 2.5, None))
    assert "clamp" in gating_supports((x, b, 2, "softmax", 1, 1, "none", True, 1e-12, 1.0, None, True))
    assert "score" in gating_supports((x, None, 2, "topk_sigmoid", 1, 1, "none", True, 0.0, 1.0, None))

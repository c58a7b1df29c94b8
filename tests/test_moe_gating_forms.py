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
    ``norm_topk_prob``. fp32 fuses (``topk_sigmoid``); bf16 computes the sigmoid in bf16, which fuses with
    ``score_dtype=bf16`` (bitwise the module through the reference; the Triton kernel declines it)."""
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
    ref, out, rep = _run(router.to(BF16), h.to(BF16))
    assert [m.variant for m in _gating(rep)] == ["topk_sigmoid"], rep.summary()
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    _, out, rep = _run(router, h.to(BF16), **TRITON)
    assert {m.provider for m in _gating(rep)} == {"reference"}
    assert all(torch.equal(a, b) for a, b in zip(out, ref))


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


# --------------------------------------------------------------------------- issue 35: transformers 5.24 routers
class SqrtSoftplusRouter(nn.Module):
    """``DeepseekV4TopKRouter.forward`` after the router GEMM (``scoring_func="sqrtsoftplus"``; Inkling-2 with it).
    ``beta2``: ``softplus(beta=2)``, a look-alike."""

    def __init__(self, e=16, k=4, variant="ok"):
        super().__init__()
        self.e_score_correction_bias = nn.Buffer(torch.linspace(-0.05, 0.05, e))
        self.k, self.variant = k, variant

    def forward(self, logits):
        scores = nn.functional.softplus(logits, beta=2.0 if self.variant == "beta2" else 1.0).sqrt()
        indices = torch.topk(scores + self.e_score_correction_bias, self.k, dim=-1, sorted=False).indices
        weights = scores.gather(1, indices)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, weights * 1.5, indices


class SigmoidTopkRouter(nn.Module):
    """``FlintTopKRouter.forward`` after the router GEMM: sigmoid scores, no bias, top-k, ``norm_topk_prob``.
    ``all_scores``: renormalised by the sum of every expert's score (a look-alike)."""

    def __init__(self, k=2, norm=True, variant="ok"):
        super().__init__()
        self.k, self.norm, self.variant = k, norm, variant

    def forward(self, router_logits):
        scores = router_logits.sigmoid()
        routing_weights, selected_experts = torch.topk(scores, self.k, dim=-1)
        if self.variant == "all_scores":
            routing_weights = routing_weights / scores.sum(dim=-1, keepdim=True)
        elif self.norm:
            routing_weights = routing_weights / routing_weights.sum(dim=-1, keepdim=True)
        return router_logits, routing_weights, selected_experts


class KolibriRouter(nn.Module):
    """``Kolibri1TopKRouter.forward`` after the router GEMM: top-k of ``logits + bias``, sigmoid of the chosen
    logits, optional ``norm_topk_prob``. ``biased_weights``: sigmoid of the chosen *biased* logits (a look-alike)."""

    def __init__(self, e=8, k=2, norm=False, variant="ok"):
        super().__init__()
        self.e_score_correction_bias = nn.Buffer(torch.linspace(-0.5, 0.5, e))
        self.k, self.norm, self.variant = k, norm, variant

    def forward(self, router_logits):
        biased = router_logits + self.e_score_correction_bias
        router_indices = torch.topk(biased, self.k, dim=-1)[1]
        src = biased if self.variant == "biased_weights" else router_logits
        router_scores = src.gather(1, router_indices).sigmoid()
        if self.norm:
            router_scores = router_scores / router_scores.sum(dim=-1, keepdim=True)
        return router_logits, router_scores, router_indices


class MistralGroupRouter(nn.Module):
    """``MistralLarge4TextTopkRouter.forward`` (= ``Mistral4TopkRouter`` with ``norm_topk_prob``) after the router
    GEMM: softmax, group sum of top-2 with no bias, ``masked_fill(~mask, 0.0)``, top-k, gather, renorm, scale.
    ``masked_weights``: weights gathered from the masked scores (a look-alike)."""

    def __init__(self, e=16, n_group=1, topk_group=1, k=4, variant="ok"):
        super().__init__()
        self.num_experts, self.num_group, self.topk_group, self.top_k = e, n_group, topk_group, k
        self.variant = variant

    def forward(self, router_logits):
        scores = router_logits.softmax(-1)
        group_scores = (
            scores.view(-1, self.num_group, self.num_experts // self.num_group).topk(2, dim=-1)[0].sum(dim=-1)
        )
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = (
            group_mask.unsqueeze(-1)
            .expand(-1, self.num_group, self.num_experts // self.num_group)
            .reshape(-1, self.num_experts)
        )
        scores_for_choice = scores.masked_fill(~score_mask.bool(), 0.0)
        topk_indices = torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False)[1]
        topk_weights = (scores_for_choice if self.variant == "masked_weights" else scores).gather(1, topk_indices)
        denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20
        topk_weights /= denominator
        topk_weights = topk_weights * 2.83
        return router_logits, topk_weights, topk_indices


class GemmaRouter(nn.Module):
    """``Gemma4TextRouter.forward`` (and DiffusionGemma's) after the norm·scale and the router GEMM: softmax in
    fp32, top-k, renormalise, ``* per_expert_scale[top_k_index]``. ``other_ids``: the scale indexed by the ids in
    reverse slot order (a look-alike)."""

    def __init__(self, e=8, k=2, variant="ok"):
        super().__init__()
        self.per_expert_scale = nn.Parameter(torch.linspace(0.5, 1.5, e))
        self.k, self.variant = k, variant

    def forward(self, expert_scores):
        router_probabilities = nn.functional.softmax(expert_scores, dim=-1, dtype=torch.float32)
        top_k_weights, top_k_index = torch.topk(router_probabilities, k=self.k, dim=-1)
        top_k_weights /= top_k_weights.sum(dim=-1, keepdim=True)
        index = top_k_index.flip(-1) if self.variant == "other_ids" else top_k_index
        top_k_weights = top_k_weights * self.per_expert_scale[index]
        # the decoder layer drops the probabilities (``_, top_k_weights, top_k_index = self.router(...)``)
        return expert_scores, top_k_weights, top_k_index


UNSORTED = {"sqrt_softplus_bias", "softmax_group_sum_top2_fill0"}
"""``topk(sorted=False)`` routers: the slots follow ``sorted=True`` (``ops/moe_gating.py``), so for K > 2 the
renormalising sum runs in another order than the model's (weights within an ulp)."""


def _route_equal(out, ref, exact=True, dtype=F32):
    """(logits|probs, weights, ids): same ids per token as a set; weights bitwise (``exact``) or within tolerance."""
    (_, w, ids), (_, rw, rids) = out, ref
    o, ro = ids.argsort(-1), rids.argsort(-1)
    assert torch.equal(ids.gather(1, o), rids.gather(1, ro))
    assert w.dtype == rw.dtype and w.shape == rw.shape and w.stride() == rw.stride()
    if exact == "ulp":
        torch.testing.assert_close(w.gather(1, o), rw.gather(1, ro), rtol=1e-6, atol=0)
    elif exact:
        assert torch.equal(w.gather(1, o), rw.gather(1, ro))
    else:
        torch.testing.assert_close(w.gather(1, o).float(), rw.gather(1, ro).float(),
                                   rtol=1e-6 if dtype == F32 else 8e-3, atol=1e-6)


NEW_FORMS = {
    # name: (module, logits [T, E] dtype, expected variant, canonical arguments after logits / before the tail)
    "deepseek_v4": (lambda: SqrtSoftplusRouter(), 16, "sqrt_softplus_bias", "sqrt_softplus"),
    "flint": (lambda: SigmoidTopkRouter(), 8, "sigmoid_topk", "sigmoid"),
    "flint_no_norm": (lambda: SigmoidTopkRouter(norm=False), 8, "sigmoid_topk", "sigmoid"),
    "kolibri": (lambda: KolibriRouter(), 8, "topk_bias_sigmoid", "topk_sigmoid"),
    "kolibri_norm": (lambda: KolibriRouter(norm=True), 8, "topk_bias_sigmoid", "topk_sigmoid"),
    "mistral_large4_one_group": (lambda: MistralGroupRouter(), 16, "softmax_group_sum_top2_fill0", "softmax"),
    "mistral4_groups": (lambda: MistralGroupRouter(n_group=4, topk_group=2), 16, "softmax_group_sum_top2_fill0",
                        "softmax"),
    "gemma4": (lambda: GemmaRouter(), 8, "softmax_topk", "softmax"),
}


def _canonical_call(rep):
    (m,) = _gating(rep)
    return m


@pytest.mark.parametrize("name", list(NEW_FORMS))
def test_new_router_forms_fuse_exactly(name):
    """Each transformers 5.24 router form: one ``moe_gating`` site, the reference provider bitwise the eager module
    (weights, ids, dtype, strides), the Triton kernel (interpreter) the same experts and weights within fp32 ulps."""
    make, e, variant, _score = NEW_FORMS[name]
    mod = make()
    x = _logits(40, e, seed=11)
    ref, out, rep = _run(mod, x)
    assert rep.count("moe_gating") == 1 and rep.count("moe_gating", variant=variant) == 1, rep.summary()
    assert not [n for n in rep.near_misses if "moe_gating" in n.explain()], rep.summary()
    assert torch.equal(out[0], ref[0])
    _route_equal(out, ref, exact="ulp" if variant in UNSORTED else True)
    torch._dynamo.reset()
    _, kout, rep = _run(mod, x, **TRITON)
    assert rep.count("moe_gating", provider="triton") == 1, rep.summary()
    _route_equal(kout, ref, exact=False)


@pytest.mark.parametrize("name", ["deepseek_v4", "flint", "mistral_large4_one_group", "gemma4"])
def test_new_router_forms_bf16_models(name):
    """bf16 logits upcast before the score (the HF code's ``.float()`` / ``softmax(dtype=float32)``): the same
    site, ids equal to eager, weights at bf16 tolerance. (Kolibri-1 computes fp32 logits in every model dtype;
    a sigmoid of bf16 logits is a look-alike below.)"""
    make, e, variant, _score = NEW_FORMS[name]
    mod = make()
    x = _logits(40, e, seed=12).to(BF16)
    if name == "gemma4":
        mod = mod.to(BF16)  # the per-expert scale in the model dtype: fp32 weights x bf16 scale -> fp32
        fn = mod
    else:
        class Up(nn.Module):  # the upcast the HF routers write after their router GEMM
            def __init__(self):
                super().__init__()
                self.inner = mod

            def forward(self, logits):
                return self.inner(logits.float())
        fn = Up()
    ref, out, rep = _run(fn, x)
    assert rep.count("moe_gating", variant=variant) == 1, rep.summary()
    _route_equal(out, ref, exact="ulp" if variant in UNSORTED else True)
    torch._dynamo.reset()
    _, kout, rep = _run(fn, x, **TRITON)
    assert rep.count("moe_gating", provider="triton") == 1, rep.summary()
    _route_equal(kout, ref, exact=False, dtype=BF16)


def test_one_group_is_the_ungrouped_router(caplog):
    """One group keeps every expert (the mask is a no-op): the call becomes the ungrouped router (the verified kernel
    path, and one the NPU provider takes); with 4 groups the 0.0-filled group mask stays."""
    import logging

    calls = {}
    for g, tg in ((1, 1), (4, 2)):
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="ep_fuse.patterns"):
            _run(MistralGroupRouter(n_group=g, topk_group=tg), _logits(8, 16, seed=1))
        calls[g] = [r.getMessage() for r in caplog.records if "moe_gating(" in r.getMessage()]
    assert calls[1] == ["ep_fuse: moe_gating(4, 'softmax', 1, 1, 'none', True, 1e-20, 2.83, None) at mul"], calls
    assert calls[4] == ["ep_fuse: moe_gating(4, 'softmax', 4, 2, 'sum_top2_fill0', True, 1e-20, 2.83, None) at mul"]
    x, b = _logits(64, 16, seed=2), torch.linspace(-0.1, 0.1, 16)
    for score, bias in (("softmax", None), ("sigmoid", b)):
        one = moe_gating_ref(x, bias, 4, score, 1, 1, "sum_top2", True, 1e-20, 2.83, None)
        none = moe_gating_ref(x, bias, 4, score, 1, 1, "none", True, 1e-20, 2.83, None)
        assert all(torch.equal(a, c) for a, c in zip(one, none))


@pytest.mark.parametrize("mod, e, dtype, why", [
    (SqrtSoftplusRouter(variant="beta2"), 16, F32,
     "moe_gating[sqrt_softplus_bias]: failed at softplus: argument beta=2.0 differs from the default 1"),
    (SigmoidTopkRouter(variant="all_scores"), 8, F32,
     "moe_gating[sigmoid_topk]: failed at sigmoid: must be the same node as 'getitem' (weights_raw)"),
    (KolibriRouter(variant="biased_weights"), 8, F32, "moe_gating[topk_bias_sigmoid]: failed at"),
    (MistralGroupRouter(n_group=4, topk_group=2, variant="masked_weights"), 16, F32,
     "moe_gating[softmax_group_sum_top2_fill0]: failed at masked_fill: expected aten._softmax.default, "
     "got aten.masked_fill.Scalar"),
], ids=["softplus_beta2", "sigmoid_all_scores", "kolibri_biased_weights", "mistral_masked_weights"])
def test_new_router_look_alikes_are_near_misses(mod, e, dtype, why):
    ref, out, rep = _run(mod, _logits(12, e, seed=13, dtype=dtype))
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    assert rep.count("moe_gating") == 0, rep.summary()
    text = "\n".join(m.explain() for m in rep.near_misses if "moe_gating" in m.explain())
    assert why in text, text


def test_kolibri_router_on_bf16_logits_fuses_in_bf16():
    """A sigmoid of the chosen bf16 logits (no upcast): ``score_dtype=bf16``, bitwise the module; the selection adds
    the fp32 bias to the bf16 logits in fp32, as the module does (torch's promotion)."""
    ref, out, rep = _run(KolibriRouter(norm=True), _logits(12, 8, seed=13, dtype=BF16))
    assert [m.variant for m in _gating(rep)] == ["topk_bias_sigmoid"], rep.summary()
    assert all(torch.equal(a, b) for a, b in zip(out, ref))


def test_gemma_scale_by_other_ids_stays_outside():
    """``per_expert_scale`` indexed by other ids than the router's (guard ``router_shapes``): the router fuses up to
    the renormalisation and the multiply by the scale stays an ATen op (bitwise the model)."""
    ref, out, rep = _run(GemmaRouter(variant="other_ids"), _logits(12, 8, seed=13))
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    (m,) = _gating(rep)
    assert m.variant == "softmax_topk" and m.root == "div" and not any(n.startswith("index") for n in m.nodes)
    _, _, rep = _run(GemmaRouter(), _logits(12, 8, seed=13))
    (m,) = _gating(rep)
    assert any(n.startswith("index") for n in m.nodes), m.nodes


@settings(max_examples=40, deadline=None)
@given(t=st.integers(1, 24), form=st.sampled_from(["sqrt_softplus", "topk_bias", "expert_scale", "softmax_fill0"]),
       ties=st.booleans(), renorm=st.booleans(), weight_dtype=st.sampled_from([None, BF16]),
       seed=st.integers(0, 2**16))
def test_triton_issue35_forms_match_the_stable_reference(t, form, ties, renorm, weight_dtype, seed):
    """The new kernel variants (``unverified.py``) against the stable reference, exact ties included."""
    g = torch.Generator().manual_seed(seed)
    if ties:  # few distinct logits and quarter biases: exact ties of the selection scores
        x = torch.randint(-2, 3, (t, 16), generator=g).float() * 0.5
        b = torch.randint(-2, 2, (16,), generator=g).float() * 0.25
    else:
        x = torch.randn(t, 16, generator=g) * 2
        b = torch.randn(16, generator=g) * 0.1
    s = torch.rand(16, generator=g) + 0.5
    args = {"sqrt_softplus": (x, b, 3, "sqrt_softplus", 1, 1, "none", renorm, 1e-20, 1.5, weight_dtype),
            "topk_bias": (x, b, 3, "topk_sigmoid", 1, 1, "none", renorm, 0.0, 1.0, weight_dtype),
            "expert_scale": (x, None, 3, "softmax", 1, 1, "none", renorm, 0.0, 1.0, weight_dtype, False, s),
            "softmax_fill0": (x, None, 3, "softmax", 4, 2, "sum_top2_fill0", renorm, 1e-20, 2.83, weight_dtype)}[form]
    if form == "sqrt_softplus" and ties:
        # exact ties only where the scores are exact in every implementation: logits 0 or 40 (softplus(40) = 40)
        args = ((x > 0).float() * 40, *args[1:])
    assert check_gating_call(args) is None
    w, ids = moe_gating_kernel(*args)
    rw, rids = moe_gating_stable_ref(*args)
    assert torch.equal(ids, rids), "identical ids, exact ties included (lowest index first)"
    torch.testing.assert_close(w.float(), rw.float(), rtol=2e-6 if weight_dtype is None else 8e-3, atol=1e-7)


def test_sqrt_softplus_kernel_score_across_the_range():
    """The kernel's ``sqrt(log1p(exp(x)))`` (and ``x`` above 20) against torch's softplus, from -80 to 60: the
    scores that select and weigh, within a few fp32 ulps even where ``exp(x)`` is tiny."""
    x = torch.linspace(-80, 60, 4096).view(256, 16)
    w, ids = moe_gating_kernel(x, None, 16, "sqrt_softplus", 1, 1, "none", False, 0.0, 1.0, None)
    ref = torch.nn.functional.softplus(x).sqrt().gather(1, ids)
    torch.testing.assert_close(w, ref, rtol=4e-7, atol=0)


def test_opcheck_issue35_arguments():
    x, b, s = _logits(9, 16, seed=8), torch.linspace(-0.5, 0.2, 16), torch.linspace(0.5, 1.5, 16)
    for args in [(x, b, 4, "sqrt_softplus", 1, 1, "none", True, 1e-20, 1.5, None),
                 (x, b, 2, "topk_sigmoid", 1, 1, "none", False, 0.0, 1.0, None),
                 (x, None, 2, "softmax", 1, 1, "none", True, 0.0, 1.0, None, False, s.to(BF16)),
                 (x, None, 4, "softmax", 4, 2, "sum_top2_fill0", True, 1e-20, 2.83, None)]:
        torch.library.opcheck(torch.ops.ep_fuse.moe_gating.default, args)
        torch.library.opcheck(torch.ops.ep_fuse_triton.moe_gating.default, args)


def test_issue35_kernel_variants_are_checked_and_npu_declines(monkeypatch, torch_npu_double):
    """Triton asks :func:`gpu_unverified` about each new variant (off on CUDA until
    ``tests/gpu/test_gpu_moe_gating_forms.py`` has run); NPU takes the per-expert scale (a multiply after the op)
    and declines what ``npu_moe_gating_top_k`` has no mode for: sqrt(softplus), a top-k of biased logits."""
    import ep_fuse.providers.triton.moe_gating as triton_router
    from ep_fuse.ops import choose
    from ep_fuse.ops import moe_gating as moe_gating_ops
    from ep_fuse.providers.npu import moe_gating as npu_router

    asked = []
    monkeypatch.setattr(triton_router, "gpu_unverified", lambda v, _t: asked.append(v))
    x, b, s = _logits(33, 16, seed=1), torch.linspace(-0.2, 0.2, 16), torch.linspace(0.5, 1.5, 16)
    calls = {"moe_gating:sqrt_softplus": (x, b, 2, "sqrt_softplus", 1, 1, "none", True, 1e-20, 1.5, None),
             "moe_gating:topk_bias": (x, b, 2, "topk_sigmoid", 1, 1, "none", False, 0.0, 1.0, None),
             "moe_gating:expert_scale": (x, None, 2, "softmax", 1, 1, "none", True, 0.0, 1.0, None, False, s),
             "moe_gating:softmax_sum_top2_fill0": (x, None, 4, "softmax", 4, 2, "sum_top2_fill0", True, 1e-20, 2.83,
                                                   None)}
    for variant, args in calls.items():
        asked.clear()
        assert check_gating_call(args) is None and variant in asked, (variant, asked)
    assert "bias rounds in torch.bfloat16" in check_gating_call((x.to(BF16), b.to(BF16), *calls[
        "moe_gating:topk_bias"][2:]))
    sup = npu_router.gating_supports
    assert "no sqrt_softplus score" in sup(calls["moe_gating:sqrt_softplus"])
    assert "no topk_sigmoid score" in sup(calls["moe_gating:topk_bias"])
    assert "0.0" in sup(calls["moe_gating:softmax_sum_top2_fill0"])
    args = calls["moe_gating:expert_scale"]
    assert choose(moe_gating_ops.moe_gating, args, "npu").provider == "npu"
    w, ids = npu_router.moe_gating_kernel(*args)
    rw, rids = moe_gating_stable_ref(*args)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, rtol=1e-6, atol=1e-7)


HF_ROUTERS = {
    # model: (config, router class, config kwargs, variant)
    "flint": ("FlintConfig", "FlintTopKRouter", dict(num_experts=8, num_experts_per_tok=2), "sigmoid_topk"),
    "kolibri1": ("Kolibri1Config", "Kolibri1TopKRouter", dict(num_experts=8, num_experts_per_tok=2),
                 "topk_bias_sigmoid"),
    # V4's router GEMM runs in the model dtype: bf16 sqrt(softplus) scores, fused with score_dtype=bf16
    "deepseek_v4": ("DeepseekV4Config", "DeepseekV4TopKRouter", dict(num_local_experts=8, num_experts_per_tok=2),
                    "sqrt_softplus_bias"),
    "mistral_large4": ("MistralLarge4TextConfig", "MistralLarge4TextTopkRouter",
                       dict(n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1),
                       "softmax_group_sum_top2_fill0"),
    "gemma4": ("Gemma4TextConfig", "Gemma4TextRouter", dict(num_experts=8, top_k_experts=2), "softmax_topk"),
}


@pytest.mark.parametrize("name", list(HF_ROUTERS))
def test_transformers_routers_fuse(name):
    """The transformers 5.24 router classes themselves (router GEMM, and Gemma-4's norm·scale, inside the graph),
    fp32 and bf16: one site each, bitwise the module through the reference provider (DeepSeek-V4's bf16 scores with
    ``score_dtype=bf16``)."""
    import importlib

    cfg_name, cls_name, kwargs, variant = HF_ROUTERS[name]
    module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    cfg = getattr(tf, cfg_name)(hidden_size=32, **kwargs)
    router = getattr(module, cls_name)(cfg).eval()
    with torch.no_grad():
        for p in router.parameters():
            p.normal_(0, 0.5) if p.dim() == 2 else p.copy_(torch.linspace(0.5, 1.5, p.numel()))

    class Layer(nn.Module):  # the decoder layer keeps the weights and ids (Gemma-4 drops the probabilities)
        def __init__(self):
            super().__init__()
            self.router = router

        def forward(self, h):
            out = self.router(h)
            return out[-2], out[-1]

    for dtype in (F32, BF16):
        layer = Layer().to(dtype)
        ref, out, rep = _run(layer, _logits(20, 32, seed=14, dtype=dtype, scale=1.0))
        assert all(torch.equal(a, b) for a, b in zip(out, ref))
        assert rep.count("moe_gating", variant=variant) == 1, rep.summary()

"""Router gating (``ep_fuse::moe_gating``): reference vs HF routers, Triton and NPU vs the stable
reference (ties included), patterns and look-alikes, and the tiny HF MoE models end to end."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import ep_fuse
from ep_fuse.testing import tiny as tiny_models
from ep_fuse.ops import choose
from ep_fuse.ops import moe_gating as moe_gating_ops
from ep_fuse.ops.moe_gating import moe_gating_ref, moe_gating_stable_ref
from ep_fuse.providers.triton.moe_gating import check_gating_call, moe_gating_kernel
from support.compiling import compile_and_run

BF16, F32 = torch.bfloat16, torch.float32

# name -> (HF overrides, moe_gating arguments after the logits and bias, MoE layers, matched variant)
MODELS = {
    "mixtral": ({}, (2, "softmax", 1, 1, "none", True, 0.0, 1.0, None), 2, "softmax_topk"),
    "qwen2_moe": ({}, (2, "softmax", 1, 1, "none", False, 0.0, 1.0, BF16), 2, "softmax_topk"),
    "qwen3_moe": ({}, (2, "softmax", 1, 1, "none", True, 0.0, 1.0, BF16), 2, "softmax_topk"),
    "deepseek_v3": ({}, (2, "sigmoid", 2, 1, "sum_top2", True, 1e-20, 2.5, None), 1, "sigmoid_group_sum_top2"),
    "deepseek_v2": ({}, (2, "softmax", 1, 1, "none", False, 0.0, 1.0, None), 1, "softmax_topk"),
    "deepseek_v2_grouped": ({"topk_method": "group_limited_greedy"},
                            (2, "softmax", 2, 1, "max", False, 0.0, 1.0, None), 1, "softmax_group_max"),
    "glm4_moe": ({}, (2, "sigmoid", 2, 1, "sum_top2", True, 1e-20, 1.0, None), 1, "sigmoid_group_sum_top2"),
}


def _build(name):
    overrides = MODELS[name][0]
    return tiny_models.build(name.replace("_grouped", ""), **overrides)


def _gate_calls(model):
    """(logits fp32, bias, HF weights, HF ids) of every router call of one eager forward."""
    calls = []

    def hook(mod, _inputs, out):
        bias = getattr(mod, "e_score_correction_bias", None)
        calls.append((out[0].detach().float(), bias, out[1].detach(), out[2].detach()))

    handles = [layer.mlp.gate.register_forward_hook(hook) for layer in model.model.layers
               if hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts")]
    with torch.no_grad():
        model(**tiny_models.example_inputs())
    for h in handles:
        h.remove()
    return calls


def _same_routing(w, ids, ref_w, ref_ids, exact=True):
    """Per token the same (expert, weight) pairs in any slot order; ``exact=False``: weights within an ulp."""
    assert ids.dtype == torch.int64 and w.dtype == ref_w.dtype and w.shape == ref_w.shape
    o, ro = ids.argsort(-1), ref_ids.argsort(-1)
    assert torch.equal(ids.gather(1, o), ref_ids.gather(1, ro))
    if exact:
        assert torch.equal(w.gather(1, o), ref_w.gather(1, ro))
    else:
        torch.testing.assert_close(w.gather(1, o).float(), ref_w.gather(1, ro).float(), rtol=1e-6 if w.dtype == F32
                                   else 8e-3, atol=1e-6)


# --------------------------------------------------------------------------- reference vs the HF routers
@pytest.mark.parametrize("name", list(MODELS))
def test_reference_is_the_hf_router(name):
    args = MODELS[name][1]
    calls = _gate_calls(_build(name))
    assert len(calls) == MODELS[name][2]
    for logits, bias, w, ids in calls:
        rw, rids = moe_gating_ref(logits, bias, *args)
        if args[1] == "softmax" and args[4] == "none" and name != "deepseek_v2":
            assert torch.equal(rids, ids) and torch.equal(rw, w)  # sorted=True: same slot order
        else:
            _same_routing(rw, rids, w, ids)  # sorted=False: the model's slot order is unspecified


def test_opcheck():
    g = torch.Generator().manual_seed(0)
    x, b = torch.randn(9, 16, generator=g), torch.randn(16, generator=g) * 0.1
    for args in [(x, None, 3, "softmax", 1, 1, "none", True, 0.0, 1.0, BF16),
                 (x, b, 4, "sigmoid", 4, 2, "sum_top2", True, 1e-20, 2.5, None),
                 (x, None, 2, "softmax", 4, 2, "max", False, 0.0, 16.0, None)]:
        torch.library.opcheck(torch.ops.ep_fuse.moe_gating.default, args)
        torch.library.opcheck(torch.ops.ep_fuse_triton.moe_gating.default, args)


def test_reference_rejects_bad_arguments():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="groups"):
        moe_gating_ref(x, None, 2, "sigmoid", 3, 1, "sum_top2", True, 0.0, 1.0, None)
    with pytest.raises(ValueError, match="bias"):
        moe_gating_ref(x, torch.zeros(4, 8), 2, "sigmoid", 2, 1, "sum_top2", True, 0.0, 1.0, None)
    with pytest.raises(ValueError, match="top_k"):
        moe_gating_ref(x, None, 9, "softmax", 1, 1, "none", True, 0.0, 1.0, None)
    with pytest.raises(ValueError, match="no selection bias"):
        moe_gating_ref(x, torch.zeros(8), 2, "topk_softmax", 1, 1, "none", False, 0.0, 1.0, None)
    with pytest.raises(ValueError, match="group_score='max'"):
        moe_gating_ref(x, torch.zeros(8), 2, "softmax", 2, 1, "max", False, 0.0, 1.0, None)


# --------------------------------------------------------------------------- Triton kernel
def _logits(t, e, ties, seed, dtype=F32):
    g = torch.Generator().manual_seed(seed)
    if ties:  # few distinct values: many exact ties inside and across the top-k and the groups
        x = torch.randint(-2, 3, (t, e), generator=g).to(F32) * 0.5
    else:
        x = torch.randn(t, e, generator=g) * 2
    return x.to(dtype)


@settings(max_examples=80, deadline=None)
@given(t=st.integers(1, 40), e_g=st.sampled_from([(4, 1), (8, 1), (8, 2), (16, 4), (24, 3), (64, 8), (40, 5)]),
       k=st.integers(1, 6), topk_group=st.integers(1, 3),
       form=st.sampled_from(["softmax", "v2", "v3", "sigmoid", "topk_softmax"]),
       ties=st.booleans(), bias=st.booleans(), renorm=st.booleans(),
       weight_dtype=st.sampled_from([None, BF16, torch.float16]), logit_dtype=st.sampled_from([F32, BF16]),
       seed=st.integers(0, 2**16))
def test_triton_matches_the_stable_reference(t, e_g, k, topk_group, form, ties, bias, renorm, weight_dtype,
                                             logit_dtype, seed):
    e, n_group = e_g
    score = "sigmoid" if form in ("v3", "sigmoid") else "topk_softmax" if form == "topk_softmax" else "softmax"
    group_score = {"v2": "max", "v3": "sum_top2"}.get(form, "none")
    if group_score == "none":
        n_group, topk_group = 1, 1
    topk_group = min(topk_group, n_group)
    k = min(k, e)
    bias = bias and form not in ("v2", "topk_softmax")  # no selection bias there (check_gating_args)
    b = (torch.randint(-1, 2, (e,), generator=torch.Generator().manual_seed(seed)).float() * 0.25) if bias else None
    x = _logits(t, e, ties, seed, logit_dtype)
    if ties and score == "sigmoid":
        # exact ties only: sigmoid(0) = 0.5 and sigmoid(40) = 1.0 in every implementation; with x = +-1 a tie that
        # holds only in exact math (sigmoid(1) + sigmoid(-1) == 2 * sigmoid(0)) is decided by an ulp of the
        # sigmoid, which the kernel and torch round differently (torch's sigmoid(-1) is one ulp off 1/(1+e))
        x = ((x > 0).float() * 40).to(logit_dtype)
    args = (x, b, k, score, n_group, topk_group, group_score, renorm,
            1e-20 if score == "sigmoid" else 0.0, 2.5 if form == "v3" else 1.0, weight_dtype)
    assert check_gating_call(args) is None
    w, ids = moe_gating_kernel(*args)
    rw, rids = moe_gating_stable_ref(*args)
    assert torch.equal(ids, rids), "identical ids, exact ties included (lowest index first)"
    ulp = {None: 1e-6, BF16: 8e-3, torch.float16: 1e-3}[weight_dtype]
    torch.testing.assert_close(w.float(), rw.float(), rtol=ulp, atol=1e-6)
    if not ties and logit_dtype == F32 and k <= topk_group * (e // n_group):
        # no ties (masked experts tie at -inf / 0.0): the model's own torch.topk selects the same experts
        _tw, tids = moe_gating_ref(*args)
        assert torch.equal(tids, ids)


def test_triton_declines_outside_its_limits():
    x = torch.randn(4, 4096)
    assert "experts" in check_gating_call((x, None, 2, "softmax", 1, 1, "none", True, 0.0, 1.0, None))
    x = torch.randn(8, 4)
    assert "unit-stride" in check_gating_call((x.t(), None, 2, "softmax", 1, 1, "none", True, 0.0, 1.0, None))
    assert moe_gating_kernel(torch.randn(0, 8), None, 2, "softmax", 1, 1, "none", True, 0.0, 1.0, None)[0].shape == (0, 2)


# --------------------------------------------------------------------------- Ascend provider (test double)
@pytest.mark.parametrize("form", ["mixtral", "qwen2", "v2", "v3", "v3_k4"])
def test_npu_matches_the_stable_reference(torch_npu_double, form):
    from ep_fuse.providers.npu import moe_gating as npu_router

    x = _logits(33, 16, ties=True, seed=3)
    b = torch.linspace(-0.2, 0.2, 16)
    args = {"mixtral": (x, None, 2, "softmax", 1, 1, "none", True, 0.0, 1.0, None),
            "qwen2": (x, None, 4, "softmax", 1, 1, "none", False, 0.0, 1.0, BF16),
            "v2": (x, None, 3, "softmax", 4, 2, "max", False, 0.0, 16.0, None),
            "v3": (x, b, 2, "sigmoid", 4, 1, "sum_top2", True, 1e-20, 2.5, None),
            "v3_k4": (x, b, 4, "sigmoid", 2, 1, "sum_top2", True, 1e-20, 2.5, BF16)}[form]
    assert choose(moe_gating_ops.moe_gating, args, "npu").provider == "npu"
    w, ids = npu_router.moe_gating_kernel(*args)
    rw, rids = moe_gating_stable_ref(*args)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w.float(), rw.float(), rtol=1e-6 if w.dtype == F32 else 8e-3, atol=1e-6)
    torch.library.opcheck(torch.ops.ep_fuse_npu.moe_gating.default, args)


def test_npu_declines_what_the_op_cannot_compute(torch_npu_double):
    from ep_fuse.providers.npu.moe_gating import gating_supports

    x = torch.randn(4, 8)
    assert "E / group_count" in gating_supports((x, None, 2, "sigmoid", 4, 1, "sum_top2", True, 0.0, 1.0, None))
    assert "kept groups" in gating_supports((x, None, 5, "sigmoid", 2, 1, "sum_top2", True, 0.0, 1.0, None))
    assert "renormalises" in gating_supports((x, None, 2, "sigmoid", 2, 1, "sum_top2", False, 0.0, 1.0, None))
    assert "2048" in gating_supports((torch.randn(2, 4096), None, 2, "softmax", 1, 1, "none", True, 0.0, 1.0, None))
    assert "no topk_softmax score" in gating_supports((x, None, 2, "topk_softmax", 1, 1, "none", False, 0.0, 1.0, None))


# --------------------------------------------------------------------------- patterns and look-alikes
class Router(nn.Module):
    """A DeepSeek-V3-style router on given logits with knobs that break its contract."""

    def __init__(self, e=8, n_group=2, k=2, variant="ok"):
        super().__init__()
        self.register_buffer("bias", torch.linspace(-0.1, 0.1, e))
        self.e, self.n_group, self.k, self.variant = e, n_group, k, variant

    def forward(self, logits):
        scores = logits.sigmoid()
        sel = scores + self.bias
        g = sel.view(-1, self.n_group, self.e // self.n_group).topk(2, dim=-1)[0].sum(dim=-1)
        idx = torch.topk(g, k=1, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(g).scatter_(1, idx, 1)
        mask = mask.unsqueeze(-1).expand(-1, self.n_group, self.e // self.n_group).reshape(-1, self.e)
        sel = sel.masked_fill(~mask.bool(), float("-inf"))
        ids = torch.topk(sel, k=self.k, dim=-1, sorted=False)[1]
        w = (sel if self.variant == "bias_in_weights" else scores).gather(1, ids)
        if self.variant == "eps_in_numerator":
            w = (w + 1e-20) / w.sum(dim=-1, keepdim=True)
        else:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * 2.5, ids


class SoftmaxRouter(nn.Module):
    def __init__(self, variant="ok"):
        super().__init__()
        self.variant = variant

    def forward(self, logits):
        p = torch.softmax(logits, dim=0 if self.variant == "softmax_dim0" else -1)
        w, ids = torch.topk(p, 2, dim=-1)
        w = w / w.sum(dim=0 if self.variant == "sum_dim0" else -1, keepdim=True)
        if self.variant == "probs_also_returned":  # e.g. for an auxiliary load-balancing loss
            return w.to(BF16), ids, p
        return w.to(BF16), ids


class TopkSoftmaxRouter(nn.Module):
    """Granite-MoE (fp32 logits, ``type_as``) and Cohere2-MoE (bf16 logits, ``softmax(dtype=float)``):
    the top-k of the logits, then a softmax of the K values. Look-alikes: GPT-OSS's bf16 softmax, a softmax
    over dim 0, the top-k values also returned (e.g. for an auxiliary loss)."""

    def __init__(self, variant="granite"):
        super().__init__()
        self.variant = variant

    def forward(self, logits):
        v, ids = torch.topk(logits, 2, dim=-1)
        if self.variant == "granite":
            return torch.softmax(v, dim=-1).type_as(torch.ones((), dtype=BF16)), ids
        if self.variant == "cohere2":
            return torch.softmax(v, dim=1, dtype=torch.float).to(logits.dtype), ids
        if self.variant == "bf16_softmax":  # GPT-OSS
            return torch.softmax(v, dim=1, dtype=v.dtype), ids
        if self.variant == "softmax_dim0":
            return torch.softmax(v, dim=0), ids
        return torch.softmax(v, dim=-1), ids, v  # "values_also_returned"


class SoftmaxBiasRouter(nn.Module):
    """Softmax scores, a learned bias that only selects, weights gathered from the unbiased scores, renorm,
    scale (the softmax sibling of DeepSeek-V3's router). Look-alikes: the bias in the weights, a per-token
    [T, E] bias."""

    def __init__(self, e=8, variant="ok"):
        super().__init__()
        self.register_buffer("bias", torch.linspace(-0.05, 0.05, e))
        self.variant = variant

    def forward(self, logits):
        p = torch.softmax(logits, dim=-1)
        bias = logits * 0.01 if self.variant == "per_token_bias" else self.bias
        sel = p + bias
        ids = torch.topk(sel, 2, dim=-1)[1]
        w = (sel if self.variant == "bias_in_weights" else p).gather(1, ids)
        return (w / (w.sum(dim=-1, keepdim=True) + 1e-20) * 2.0).to(BF16), ids


def _matches(mod, x):
    with torch.no_grad():
        ref = mod(x)
    out = compile_and_run(mod, x, executor="eager", providers={"cpu": ["reference"]})
    rep = ep_fuse.last_report()
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    return [m.variant for m in rep.matches if m.pattern == "moe_gating"], rep


def test_router_modules_match():
    x = _logits(12, 8, ties=False, seed=1)
    assert _matches(Router(), x)[0] == ["sigmoid_group_sum_top2"]
    assert _matches(SoftmaxRouter(), x)[0] == ["softmax_topk"]
    assert _matches(SoftmaxBiasRouter(), x)[0] == ["softmax_bias"]
    assert _matches(TopkSoftmaxRouter("granite"), x)[0] == ["topk_softmax"]
    assert _matches(TopkSoftmaxRouter("cohere2"), x.to(BF16))[0] == ["topk_softmax"]


@pytest.mark.parametrize("variant, dtype, args", [
    ("granite", F32, (2, "topk_softmax", 1, 1, "none", False, 0.0, 1.0, BF16)),
    ("cohere2", BF16, (2, "topk_softmax", 1, 1, "none", False, 0.0, 1.0, BF16)),
])
def test_topk_softmax_router_exact_and_with_the_kernel(variant, dtype, args):
    """Reference: bitwise the model, ties included (it selects with the model's torch.topk on the logits in
    their dtype). Triton: stable ties; the bf16 logits of Cohere2 have many exact ties, where the experts
    picked carry the same logit and so the same weight."""
    mod = TopkSoftmaxRouter(variant)
    for ties in (False, True):
        x = _logits(40, 8, ties=ties, seed=5, dtype=dtype)
        assert _matches(mod, x)[0] == ["topk_softmax"]  # (asserts bitwise equality with the reference)
        with torch.no_grad():
            w, ids = mod(x)
        out = compile_and_run(mod, x, executor="eager")
        assert {m.provider for m in ep_fuse.last_report().matches} == {"triton"}
        sw, sids = moe_gating_stable_ref(x, None, *args)
        assert torch.equal(out[1], sids)
        torch.testing.assert_close(out[0].float(), sw.float(), rtol=8e-3, atol=1e-6)
        if not ties:
            _same_routing(out[0], out[1], w, ids, exact=False)
        else:  # same weights as a multiset per token (a tied expert swapped for one of equal logit)
            assert torch.equal(x.gather(1, ids).sort(-1)[0], x.gather(1, sids).sort(-1)[0])
            torch.testing.assert_close(out[0].sort(-1)[0].float(), w.sort(-1)[0].float(), rtol=8e-3, atol=1e-6)


class ZayaStyleRouter(nn.Module):
    """Zaya's selection on ``[B, S, E]`` scores: ``softmax`` in the model dtype, ``.float() + bias``, weights gathered
    from the unbiased scores. With a bias in the model dtype (``bias_dtype``) eager selects in fp32 where torch's
    promotion of the scores and the bias would add in bf16: a look-alike."""

    def __init__(self, e=8, bias_dtype=F32):
        super().__init__()
        self.register_buffer("bias", torch.linspace(-0.05, 0.05, e).to(bias_dtype))

    def forward(self, logits):
        p = torch.softmax(logits, dim=-1)
        ids = torch.topk(p.detach().float() + self.bias, 2, dim=-1)[1]
        return torch.gather(p, 2, ids), ids


def test_zaya_style_router_in_bf16_fuses_and_its_bf16_bias_look_alike_does_not():
    x = _logits(24, 8, ties=True, seed=7, dtype=BF16).view(2, 12, 8)
    assert _matches(ZayaStyleRouter(), x)[0] == ["softmax_bias_3d"]  # (bitwise the model)
    variants, rep = _matches(ZayaStyleRouter(bias_dtype=BF16), x)
    assert variants == [], rep
    text = "\n".join(m.explain() for m in rep.near_misses)
    assert "selection computed in torch.float32 from torch.bfloat16 scores and a torch.bfloat16 bias" in text, text


@pytest.mark.parametrize("mod, dtype, why", [
    (TopkSoftmaxRouter("softmax_dim0"), F32, "expected one of (-1, 1), got 0"),
    (TopkSoftmaxRouter("values_also_returned"), F32, "is also used outside the pattern"),
    (SoftmaxBiasRouter(variant="bias_in_weights"), F32, "expected aten._softmax.default, got aten.add.Tensor"),
    (SoftmaxBiasRouter(variant="per_token_bias"), F32, "failed at mul: must be the same node as '_softmax' (probs)"),
], ids=["softmax_dim0", "values_also_returned", "bias_in_weights", "per_token_bias"])
def test_new_router_look_alikes_are_near_misses(mod, dtype, why):
    variants, rep = _matches(mod, _logits(12, 8, ties=False, seed=2, dtype=dtype))
    assert variants == [], rep
    text = "\n".join(m.explain() for m in rep.near_misses)
    assert why in text, text


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize("mod, variant, args", [
    # GPT-OSS / Aria: the softmax of the top-k values in the model dtype
    (TopkSoftmaxRouter("bf16_softmax"), "topk_softmax", (2, "topk_softmax", 1, 1, "none", False, 0.0, 1.0, None)),
    # Mistral-4 / Zaya: the softmax of the logits, the renormalisation in the model dtype
    (SoftmaxRouter(), "softmax_topk", (2, "softmax", 1, 1, "none", True, 0.0, 1.0, BF16)),
    # an fp32 selection bias over bf16 scores: the selection adds in fp32 (torch's promotion), weights stay bf16
    (SoftmaxBiasRouter(), "softmax_bias", (2, "softmax", 1, 1, "none", True, 1e-20, 2.0, BF16)),
    (Router(), "sigmoid_group_sum_top2", (2, "sigmoid", 2, 1, "sum_top2", True, 1e-20, 2.5, None)),
], ids=["topk_softmax", "softmax_topk", "softmax_bias", "sigmoid_grouped"])
def test_routers_computed_in_the_model_dtype_fuse_with_score_dtype(mod, variant, args, dtype):
    """Routers that never upcast (their softmax/sigmoid, group scores and renormalisation round to bf16/fp16 at every
    op) fuse with ``score_dtype`` = that dtype: the reference computes each step in it, bitwise the model (ties
    included: bf16 scores tie often); the fused providers compute in fp32 and decline it (the reference runs)."""
    x = _logits(40, 8, ties=True, seed=6, dtype=dtype)
    assert _matches(mod, x)[0] == [variant]  # (asserts bitwise equality with the reference)
    bias = getattr(mod, "bias", None)
    with torch.no_grad():
        w, ids = mod(x)
    rw, rids = moe_gating_ref(x, bias, *args, False, None, dtype)
    assert torch.equal(rids, ids) and torch.equal(rw, w) and rw.dtype == w.dtype  # (the routers' own casts)
    out = compile_and_run(mod, x, executor="eager")
    (match,) = [m for m in ep_fuse.last_report().matches if m.pattern == "moe_gating"]
    assert match.provider == "reference", match
    assert any(p == "triton" and f"scores computed in {dtype}" in why for p, why in match.declined), match.declined
    assert all(torch.equal(a, b) for a, b in zip(out, (w, ids)))
    assert check_gating_call((x, bias, *args, False, None, dtype)) == (
        f"scores computed in {dtype} (the kernel computes them in fp32; the reference rounds as the model)")


@pytest.mark.parametrize("mod", [Router(variant="bias_in_weights"), Router(variant="eps_in_numerator"),
                                 SoftmaxRouter("softmax_dim0"), SoftmaxRouter("sum_dim0"),
                                 SoftmaxRouter("probs_also_returned")],
                         ids=["bias_in_weights", "eps_in_numerator", "softmax_dim0", "sum_dim0",
                              "probs_also_returned"])
def test_look_alikes_do_not_match(mod):
    variants, rep = _matches(mod, _logits(12, 8, ties=False, seed=2))
    assert variants == [], rep


# --------------------------------------------------------------------------- tiny HF models end to end
@pytest.mark.parametrize("name", list(MODELS))
def test_hf_models(name):
    _, args, layers, variant = MODELS[name]
    model = _build(name)
    inputs = tiny_models.example_inputs()
    with torch.no_grad():
        ref = model(**inputs).logits
    out = _compiled(model, inputs, executor="eager", providers={"cpu": ["reference"]})
    rep = ep_fuse.last_report()
    gating = [m for m in rep.matches if m.pattern == "moe_gating"]
    assert [m.variant for m in gating] == [variant] * layers, rep
    assert torch.equal(out, ref), "the reference provider is bitwise the eager model"
    torch._dynamo.reset()
    out = _compiled(model, inputs, executor="eager", patterns=["moe_gating"])  # the interpreter runs the router only
    rep = ep_fuse.last_report()
    assert {m.provider for m in rep.matches if m.pattern == "moe_gating"} == {"triton"}
    # routing of the Triton kernel vs the model's, per layer; exact ties may be broken differently
    keep = torch.ones(ref.shape[:2], dtype=torch.bool)
    for logits, bias, w, ids in _gate_calls(model):
        kw, kids = moe_gating_kernel(logits, bias, *args)
        tied = _tied_rows(kids, ids, logits, bias, args)
        rest = [t for t in range(ids.shape[0]) if t not in tied]
        _same_routing(kw[rest], kids[rest], w[rest], ids[rest], exact=False)
        for t in tied:  # a token routed differently changes itself and (causal attention) later tokens
            b, pos = divmod(t, ref.shape[1])
            keep[b, pos:] = False
    assert keep.sum() >= keep.numel() // 2, "ties are rare"
    torch.testing.assert_close(out[keep].float(), ref[keep].float(), rtol=0.02,
                               atol=0.02 * ref.float().abs().max().item())


def _compiled(model, inputs, **options):
    with torch.no_grad():
        return torch.compile(model, backend="ep_fuse", options=options)(**inputs).logits


def _tied_rows(kids, ids, logits, bias, args):
    """Tokens where the kernel and the model's torch.topk chose different experts, after checking that
    the experts swapped carry exactly the same selection score (an exact tie)."""
    sel = torch.softmax(logits, -1) if args[1] == "softmax" else torch.sigmoid(logits)
    sel = sel + bias if bias is not None else sel
    rows = [t for t in range(ids.shape[0]) if set(kids[t].tolist()) != set(ids[t].tolist())]
    for t in rows:
        a, b = sorted(sel[t, kids[t]].tolist()), sorted(sel[t, ids[t]].tolist())
        assert a == b, f"token {t}: the kernel picked {kids[t].tolist()}, the model {ids[t].tolist()}"
    return rows


def test_unverified_kernel_variants_decline_on_cuda_only(monkeypatch):
    from types import SimpleNamespace

    from ep_fuse.providers.triton import unverified
    from ep_fuse.providers.triton.unverified import ENV, UNVERIFIED_ON_GPU, gpu_unverified

    cuda, cpu = SimpleNamespace(device=torch.device("cuda")), SimpleNamespace(device=torch.device("cpu"))
    monkeypatch.delenv(ENV, raising=False)
    # every variant passed its tests/gpu check (docs/benchmarks.md); the TMA kernels were also measured
    # faster than what they replace (torch._grouped_mm; the one-tile-per-program FP8 kernel; the masked expert
    # layout's kernels: the permute over padding); the rounded RMSNorm forms last (2026-12-03)
    assert set(UNVERIFIED_ON_GPU) == set()
    for variant in ("rms_norm:none_rstd_cast", "add_rms_norm:none_rstd_cast", "add_rms_norm:norm_dtype",
                    "moe_gating:softmax", "moe_gating:topk_softmax", "rope:rotate_pairs", "fp8:triton",
                    "grouped_gemm:tma", "ep:fp8_dispatch", "fp8:tma", "moe_gating:sqrt_softplus",
                    "rope:rotate_pairs_fp32", "grouped_gemm_swiglu:silu_clamp", "grouped_gemm_swiglu:gelu_tanh",
                    "moe_experts_masked:gelu"):
        assert gpu_unverified(variant, cuda) is None
    # the mechanism, on a variant added to the list
    monkeypatch.setitem(unverified.UNVERIFIED_ON_GPU, "op:new", "not run on a GPU")
    assert "not cleared for GPUs" in gpu_unverified("op:new", cuda) and "not run on a GPU" in gpu_unverified(
        "op:new", cuda)
    assert gpu_unverified("op:new", cpu) is None  # the interpreter checks them on the CPU
    monkeypatch.setenv(ENV, "1")
    assert gpu_unverified("op:new", cuda) is None


def test_deepseek_v3_one_group_bf16_router_is_exact():
    """Issue 35's drift report (DeepSeek-V3 router, one group, x2.83, bf16 model): the router is not the stage.
    The fp32 logits, the one-group mask (a no-op: canonicalised to the ungrouped router), the fp32 renorm and
    scale, and the fp32 weights the experts read are the model's; with the Triton kernel (interpreter) for the
    router only, the bf16 model logits are bitwise eager."""
    model = tiny_models.build("deepseek_v3", n_group=1, topk_group=1, routed_scaling_factor=2.83).to(BF16)
    inputs = tiny_models.example_inputs()
    with torch.no_grad():
        ref = model(**inputs).logits
    out = _compiled(model, inputs, executor="eager", patterns=["moe_gating"])
    rep = ep_fuse.last_report()
    assert rep.count("moe_gating", variant="sigmoid_group_sum_top2", provider="triton") == 1, rep
    assert torch.equal(out, ref)
    for logits, bias, w, ids in _gate_calls(model):
        args = (2, "sigmoid", 1, 1, "sum_top2", True, 1e-20, 2.83, None)
        kw, kids = moe_gating_kernel(logits, bias, *args)
        _same_routing(kw, kids, w, ids, exact=False)
        assert w.dtype == kw.dtype == F32

"""Router forms of the MoE decoders transformers 5.24 added (issue 35): Inkling's shared-expert sink router
(``ep_fuse::moe_gating_sink``), Zaya's ``[B, S, E + 1]`` softmax + balancing-bias router (``moe_gating`` on N-D
logits), and the forms recognised only to say why they are not fused (DeepSeek-V4's hash layers, PhiMoE's
sparsemixer, Llama-4's dense scores). Each is written here from the model code, checked against eager through the
reference provider and the Triton kernel (interpreter), with look-alikes whose near miss names the failing check."""

import importlib

import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from torch import nn

import ep_fuse
from ep_fuse.ops.moe_gating import moe_gating_ref, moe_gating_sink_ref, moe_gating_sink_stable_ref, moe_gating_stable_ref
from ep_fuse.providers.triton.moe_gating import (
    check_gating_call,
    check_sink_call,
    moe_gating_kernel,
    moe_gating_sink_kernel,
    sink_prefers,
)
from support.compiling import compile_and_run

BF16, F32 = torch.bfloat16, torch.float32
REFERENCE = {"executor": "eager", "providers": {"cpu": ["reference"]}}
TRITON = {"executor": "eager", "patterns": ["moe_gating"]}


def _logits(*shape, seed, dtype=F32, scale=2.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _run(mod, *inputs, **options):
    with torch.no_grad():
        ref = mod(*inputs)
    torch._dynamo.reset()
    out = compile_and_run(mod, *inputs, **(options or REFERENCE))
    return ref, out, ep_fuse.last_report()


def _explain(rep):
    return "\n".join(m.explain() for m in rep.near_misses if "moe_gating" in m.explain())


def _per_token(ids, *weights):
    """Rows sorted by expert id (a ``sorted=False`` router's slot order is unspecified)."""
    order = ids.argsort(-1)
    return (ids.gather(1, order), *(w.gather(1, order) for w in weights))


# --------------------------------------------------------------------------- Inkling: the shared-expert sink
class SinkRouter(nn.Module):
    """``InklingTopkRouter.forward`` after the router GEMM, on fp32 logits ``[T, E + S]``. ``variant`` breaks one step:
    ``shared_first`` (the shared logits are the first S columns), ``softmax`` (a softmax of the logits instead of
    logsigmoid/logsumexp), ``gather_scores`` (the chosen sigmoid scores, not logits), ``vector_scale`` (a [K + S]
    learned scale)."""

    def __init__(self, e=8, s=2, k=2, route_scale=8.0, variant="ok"):
        super().__init__()
        self.e, self.s, self.k, self.route_scale, self.variant = e, s, k, route_scale, variant
        self.e_score_correction_bias = nn.Parameter(torch.linspace(-0.1, 0.1, e), requires_grad=False)
        width = k + s if variant == "vector_scale" else 1
        self.global_scale = nn.Parameter(torch.linspace(0.9, 1.1, width), requires_grad=False)

    def forward(self, router_logits, dtype=BF16):
        s = self.s
        if self.variant == "shared_first":
            routed, shared = router_logits[..., s:], router_logits[..., :s]
            scores = router_logits.sigmoid()[..., s:]
        else:
            routed, shared = router_logits[..., :-s], router_logits[..., -s:]
            scores = router_logits.sigmoid()[..., :-s]
        ids = torch.topk(scores + self.e_score_correction_bias.float(), self.k, dim=-1, sorted=False)[1]
        picked = (scores if self.variant == "gather_scores" else routed).gather(-1, ids)
        chosen = torch.cat([picked, shared], dim=-1)
        if self.variant == "softmax":
            w = torch.softmax(chosen, dim=-1)
        else:
            log_p = F.logsigmoid(chosen)
            w = torch.exp(log_p - torch.logsumexp(log_p, dim=-1, keepdim=True))
        w = (w * self.route_scale * self.global_scale.float()).to(dtype)
        return w[..., : self.k].contiguous(), ids, w[..., -s:].contiguous()


def test_sink_reference_is_the_model_code():
    """``moe_gating_sink_ref`` = the module: the same experts per token, routed and shared weights within an ulp
    (the slot order is ``sorted=True``'s, so the logsumexp adds in another order)."""
    mod = SinkRouter(e=16, s=2, k=4)
    x = _logits(40, 18, seed=1)
    w, ids, shared = mod(x, F32)
    rw, rids = moe_gating_sink_ref(x, mod.e_score_correction_bias, 4, 2, 8.0, mod.global_scale, None)
    assert rw.shape == (40, 6) and rids.dtype == torch.int64
    a, b = _per_token(ids, w), _per_token(rids, rw[:, :4])
    assert torch.equal(a[0], b[0])
    torch.testing.assert_close(a[1], b[1], rtol=1e-6, atol=0)
    torch.testing.assert_close(rw[:, 4:], shared, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="n_shared >= 1"):
        moe_gating_sink_ref(x, None, 4, 0, 1.0, None, None)


@pytest.mark.parametrize("k", [1, 2])
def test_sink_fuses_and_is_bitwise_eager(k):
    """One ``moe_gating_sink`` site, three outputs of the module with their dtype, shape and strides, bitwise equal
    for K <= 2 (the slot order of two tie-free experts is the model's on the CPU)."""
    mod = SinkRouter(k=k)
    x = _logits(24, 10, seed=2)
    ref, out, rep = _run(mod, x)
    assert rep.count("moe_gating", variant="sigmoid_sink") == 1 and not rep.near_misses, rep.summary()
    rw, rids, rshared = ref
    ow, oids, oshared = out
    assert torch.equal(oshared, rshared) and oshared.dtype == BF16 and oshared.stride() == rshared.stride()
    a, b = _per_token(oids, ow), _per_token(rids, rw)
    assert all(torch.equal(p, q) for p, q in zip(a, b)) and ow.stride() == rw.stride()


@pytest.mark.parametrize("variant, failing", [
    ("shared_first", "columns [2, 10) are routed and [0, 2) shared"),
    ("softmax", "expected aten.exp.default, got aten._softmax.default"),
    ("gather_scores", "must be the same node as 'sigmoid' (logits)"),
])
def test_sink_look_alikes_are_near_misses(variant, failing):
    mod = SinkRouter(variant=variant)
    ref, out, rep = _run(mod, _logits(24, 10, seed=3))
    assert rep.count("moe_gating") == 0
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    assert failing in _explain(rep), _explain(rep)


@pytest.mark.parametrize("t, e, s, k, dtype", [(1, 8, 1, 2, None), (37, 16, 2, 4, BF16), (20, 62, 2, 6, None)])
@pytest.mark.parametrize("ties", [False, True])
def test_sink_kernel_matches_the_stable_reference(t, e, s, k, dtype, ties):
    """The Triton sink kernel (interpreter): the stable reference's ids exactly (ties lowest index first), its
    weights within fp32 rounding (logsigmoid/logsumexp/exp in the kernel's own order)."""
    x = _logits(t, e + s, seed=t + e)
    if ties:
        x = (x * 2).round() / 2
    bias = torch.linspace(-0.1, 0.1, e)
    args = (x, bias, k, s, 8.0, torch.tensor([1.25]), dtype)
    assert check_sink_call(args) is None
    w, ids = moe_gating_sink_kernel(*args)
    rw, rids = moe_gating_sink_stable_ref(*args)
    assert torch.equal(ids, rids) and w.dtype == rw.dtype and w.shape == (t, k + s)
    torch.testing.assert_close(w.float(), rw.float(), rtol=1e-5 if dtype is None else 8e-3, atol=1e-6)
    assert sink_prefers(args, "inductor") and sink_prefers(args, "eager") is None
    assert "unrolled loops" in check_sink_call((_logits(2, 42, seed=0), None, 33, 2, 8.0, None, None))


def test_sink_fused_through_triton():
    """The fused graph runs the Triton sink kernel: same experts per token, weights within fp32 rounding."""
    mod = SinkRouter(e=16, s=2, k=4)
    x = _logits(24, 18, seed=13)
    ref, out, rep = _run(mod, x, **TRITON)
    assert {m.provider for m in rep.matches if m.pattern == "moe_gating"} == {"triton"}, rep.summary()
    a, b = _per_token(out[1], out[0]), _per_token(ref[1], ref[0])
    assert torch.equal(a[0], b[0])
    torch.testing.assert_close(a[1].float(), b[1].float(), rtol=8e-3, atol=1e-6)
    torch.testing.assert_close(out[2].float(), ref[2].float(), rtol=8e-3, atol=1e-6)


def test_sink_vector_scale_stays_outside():
    """A [K + S] learned scale is not the op's one-element ``global_scale``: the match ends before that multiply,
    which stays an ATen op after the fused router (exact)."""
    ref, out, rep = _run(SinkRouter(variant="vector_scale"), _logits(24, 10, seed=3))
    assert rep.count("moe_gating", variant="sigmoid_sink") == 1
    a, b = _per_token(out[1], out[0]), _per_token(ref[1], ref[0])
    assert all(torch.equal(p, q) for p, q in zip(a, b)) and torch.equal(out[2], ref[2])


def test_inkling_router_class_fuses_in_fp32_and_bf16():
    """transformers' ``InklingTopkRouter`` itself (the fp32 router GEMM inside the graph): one site in an fp32 and in
    a bf16 module (it computes its logits in fp32), its weights, ids and shared gammas equal to the module's."""
    from transformers.models.inkling import modeling_inkling

    cfg = tf.InklingTextConfig(hidden_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2)
    router = modeling_inkling.InklingTopkRouter(cfg).eval()
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
        router.e_score_correction_bias.copy_(torch.linspace(-0.05, 0.05, 8))
        router.global_scale.fill_(1.25)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.router = router

        def forward(self, h):
            return self.router(h)[1:]

    for dtype in (F32, BF16):
        layer = Layer().to(dtype)
        ref, out, rep = _run(layer, _logits(20, 32, seed=4, dtype=dtype, scale=1.0))
        assert rep.count("moe_gating", variant="sigmoid_sink") == 1, rep.summary()
        a, b = _per_token(out[1], out[0]), _per_token(ref[1], ref[0])
        assert all(torch.equal(p, q) for p, q in zip(a, b)) and torch.equal(out[2], ref[2])


# --------------------------------------------------------------------------- Zaya: [B, S, E + 1] + skip expert
class ZayaTail(nn.Module):
    """``ZayaRouter.forward`` after its MLP, on ``[B, S, E + 1]`` logits; ``variant``: ``renormalised`` (the weights
    divided by their sum: a tail this form does not take), ``scalar_bias`` (a number added, not a bias vector)."""

    def __init__(self, e=8, k=2, variant="ok"):
        super().__init__()
        self.e, self.k, self.variant = e, k, variant
        bias = torch.linspace(-0.05, 0.05, e + 1)
        bias[-1] = -1.0
        self.balancing_biases = nn.Buffer(bias)

    def forward(self, logits):
        probs = torch.softmax(logits, dim=-1)
        biased = probs.detach().to(torch.float32) + (0.5 if self.variant == "scalar_bias" else self.balancing_biases)
        _, ids = torch.topk(biased, self.k, dim=-1)
        w = torch.gather(probs, dim=2, index=ids)
        if self.variant == "renormalised":
            w = w / w.sum(dim=-1, keepdim=True)
        skip = ids == self.e
        return w.masked_fill(skip, 0).reshape(-1, self.k), ids.masked_fill(skip, 0).reshape(-1, self.k)


def test_zaya_router_fuses_and_is_bitwise_eager():
    """The router part (softmax, bias, top-k, gather) is one ``moe_gating`` on the 3-D logits, bitwise the model
    through the reference provider; the skip-expert masking stays (and still applies: a large skip logit)."""
    mod = ZayaTail()
    mod.balancing_biases[-1] = 0.0
    x = _logits(2, 12, 9, seed=5)
    x[0, :4, -1] = 9.0  # the skip expert wins on these tokens
    ref, out, rep = _run(mod, x)
    assert rep.count("moe_gating", variant="softmax_bias_3d") == 1 and not rep.near_misses, rep.summary()
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    assert (ref[0][:4, 0] == 0).all() and (ref[1][:4, 0] == 0).all()
    _, kout, rep = _run(mod, x, **TRITON)
    assert {m.provider for m in rep.matches if m.pattern == "moe_gating"} == {"triton"}
    assert torch.equal(kout[1], ref[1])
    torch.testing.assert_close(kout[0], ref[0], rtol=1e-6, atol=1e-7)


def test_nd_logits_reference_and_kernel():
    """``moe_gating`` on [B, S, E] logits routes each row alone (= the [T, E] call viewed back); the Triton kernel runs
    them as rows of one contiguous view and declines logits that are not (a transposed view)."""
    x, b = _logits(3, 7, 9, seed=6), torch.linspace(-0.1, 0.1, 9)
    args = (b, 2, "softmax", 1, 1, "none", False, 0.0, 1.0, None)
    w, ids = moe_gating_ref(x, *args)
    w2, ids2 = moe_gating_ref(x.reshape(21, 9), *args)
    assert w.shape == (3, 7, 2) and torch.equal(w.reshape(21, 2), w2) and torch.equal(ids.reshape(21, 2), ids2)
    assert check_gating_call((x, *args)) is None
    kw, kids = moe_gating_kernel(x, *args)
    sw, sids = moe_gating_stable_ref(x, *args)
    assert kw.shape == (3, 7, 2) and torch.equal(kids, sids)
    torch.testing.assert_close(kw, sw, rtol=1e-6, atol=1e-7)
    assert "not contiguous" in check_gating_call((x.transpose(0, 1), *args))
    from ep_fuse.providers.npu import moe_gating as npu_router

    assert "logits must be [T, E]" in npu_router.gating_supports((x, *args))  # NPU takes [T, E] only


@pytest.mark.parametrize("variant, failing", [
    ("renormalised", "guard whole_tail: the routing weights feed sum_1, div"),
    ("scalar_bias", "a selection bias is a floating [E] vector"),
])
def test_zaya_look_alikes_are_near_misses(variant, failing):
    ref, out, rep = _run(ZayaTail(variant=variant), _logits(2, 12, 9, seed=7))
    assert rep.count("moe_gating") == 0
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    assert failing in _explain(rep), _explain(rep)


def test_zaya_bf16_router_fuses_with_score_dtype():
    """A bf16 Zaya model computes the softmax in bf16 (then selects on its fp32 upcast + the fp32 biases): one site
    with ``score_dtype=bf16``, bitwise the model through the reference; the Triton kernel declines it."""
    x = _logits(2, 12, 9, seed=8, dtype=BF16)
    ref, out, rep = _run(ZayaTail(), x)
    assert rep.count("moe_gating", variant="softmax_bias_3d") == 1 and not rep.near_misses, rep.summary()
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    _, kout, rep = _run(ZayaTail(), x, **TRITON)
    (m,) = [m for m in rep.matches if m.pattern == "moe_gating"]
    assert m.provider == "reference" and any("scores computed in torch.bfloat16" in why for _, why in m.declined)
    assert all(torch.equal(a, b) for a, b in zip(kout, ref))


def test_zaya_router_class_fuses_layer_to_layer():
    """transformers' ``ZayaRouter`` (its MLP, the EDA state of layer 1 from layer 0) in fp32: one site per router."""
    module = importlib.import_module("transformers.models.zaya.modeling_zaya")
    cfg = tf.ZayaConfig(hidden_size=32, num_experts=8, num_experts_per_tok=1, router_hidden_size=16)  # Zaya: K = 1
    torch.manual_seed(0)
    routers = nn.ModuleList([module.ZayaRouter(cfg, layer_idx=i) for i in range(2)]).eval()
    with torch.no_grad():
        for p in routers.parameters():
            p.normal_(0, 0.5)

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.routers = routers

        def forward(self, h):
            _, w0, i0, state = self.routers[0](h)
            _, w1, i1, _ = self.routers[1](h, router_states=state)
            return w0, i0, w1, i1

    ref, out, rep = _run(Two(), _logits(2, 6, 32, seed=9, scale=1.0))
    assert rep.count("moe_gating", variant="softmax_bias_3d") == 2, rep.summary()
    assert all(torch.equal(a, b) for a, b in zip(out, ref))


# --------------------------------------------------------------------------- recognised and declined
class HashRouter(nn.Module):
    """``DeepseekV4HashRouter.forward`` after the GEMM: ids from a token-id table."""

    def __init__(self, vocab=16, e=8, k=2):
        super().__init__()
        self.tid2eid = nn.Buffer(torch.randint(0, e, (vocab, k), generator=torch.Generator().manual_seed(0)))

    def forward(self, logits, input_ids):
        scores = F.softplus(logits).sqrt()
        ids = self.tid2eid[input_ids.reshape(-1)].long()
        w = scores.gather(1, ids)
        return w / (w.sum(dim=-1, keepdim=True) + 1e-20) * 1.5, ids


def sparsemixer_pass(scores, logits, eps=0.01):
    """One pass of PhiMoE's ``sparsemixer`` in eval mode."""
    threshold, ind = scores.max(dim=-1, keepdim=True)
    factor = logits.abs().clamp(min=threshold)
    mask = ((threshold - logits) / factor) > (2 * eps)
    return torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1).gather(-1, ind), ind


class SparseMixer(nn.Module):
    def forward(self, logits):
        w1, i1 = sparsemixer_pass(logits, logits)
        w2, i2 = sparsemixer_pass(torch.scatter(logits, -1, i1, float("-inf")), logits)
        return torch.cat((w1, w2), dim=-1), torch.cat((i1, i2), dim=-1)


class DenseScores(nn.Module):
    def forward(self, logits):
        v, ids = torch.topk(logits, 2, dim=1)
        return torch.sigmoid(torch.full_like(logits, float("-inf")).scatter_(1, ids, v).float())


@pytest.mark.parametrize("name, make, inputs, reason", [
    ("hash_routed", HashRouter, lambda: (_logits(12, 8, seed=10), torch.randint(0, 16, (3, 4))),
     "hash routing: the experts come from a frozen token-id table"),
    ("sparsemixer", SparseMixer, lambda: (_logits(12, 8, seed=11),), "sparsemixer (PhiMoE): two argmax passes"),
    ("dense_topk_sigmoid", DenseScores, lambda: (_logits(12, 8, seed=12),), "dense router scores (Llama-4)"),
])
def test_declined_forms_say_why(name, make, inputs, reason):
    """Nothing fused, the graph unchanged in value, and the near miss's closest variant is the form, with why."""
    ref, out, rep = _run(make(), *inputs())
    assert rep.count("moe_gating") == 0
    ref, out = (ref, out) if isinstance(ref, tuple) else ((ref,), (out,))
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    best = [m.best for m in rep.near_misses if m.best is not None and m.best.pattern.startswith("moe_gating")]
    assert best and all(b.pattern == f"moe_gating[{name}]" and reason in b.reason for b in best), _explain(rep)


@pytest.mark.slow
@pytest.mark.hf
@pytest.mark.parametrize("family, sites, declined", [
    ("inkling", {"sigmoid_sink": 2}, None), ("zaya", {"softmax_bias_3d": 2}, None),
    ("phimoe", {}, "moe_gating[sparsemixer]"), ("llama4", {}, "moe_gating[dense_topk_sigmoid]"),
    ("deepseek_v4", {"sqrt_softplus_bias": 2}, "moe_gating[hash_routed]"),
    ("dbrx", {}, "got aten.linalg_vector_norm.default"),
])
def test_tiny_models_exact_router_sites(family, sites, declined):
    """The sweep's tiny model of each family, fp32: exactly these ``moe_gating`` sites (by variant), and for the
    routers left unfused every near miss names why (the declined form, or DBRX's p-norm renormalisation)."""
    from ep_fuse.testing import sweep

    model, _ = sweep.build_tiny(family, F32)
    torch._dynamo.reset()
    ep_fuse.reset_reports()
    with torch.no_grad():
        torch.compile(model, backend="ep_fuse", options={"executor": "eager"})(**sweep.example_inputs())
    got: dict[str, int] = {}
    for rep in ep_fuse.reports():
        for m in rep.matches:
            if m.pattern == "moe_gating":
                got[m.variant] = got.get(m.variant, 0) + 1
    assert got == sites
    best = [f"{m.best.pattern}: {m.best.reason}" for rep in ep_fuse.reports() for m in rep.near_misses
            if m.best is not None and m.best.pattern.startswith("moe_gating")]
    if declined is None:
        assert not best, best
    else:
        assert best and all(declined in b for b in best), best
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.hf
def test_jetmoe_one_router_graph_runs_for_every_router():
    """JetMoE's per-expert loop breaks the graph after its router (``expert_size.tolist()``); Dynamo compiles that
    router frame once (one ``topk_softmax`` site) and reuses it: every router of the model runs ``ep_fuse::moe_gating``
    (2 layers x (attention experts + MLP experts) = 4 calls per forward)."""
    from ep_fuse.testing import sweep

    model, _ = sweep.build_tiny("jetmoe", F32)
    torch._dynamo.reset()
    ep_fuse.reset_reports()
    compiled = torch.compile(model, backend="ep_fuse", options={"executor": "eager"})
    with torch.no_grad():
        compiled(**sweep.example_inputs())
        assert sum(rep.count("moe_gating", variant="topk_softmax") for rep in ep_fuse.reports()) == 1
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            compiled(**sweep.example_inputs())
    calls = sum(e.count for e in prof.key_averages() if e.key.endswith("::moe_gating"))
    assert calls == 4 == sum(1 for _ in model.modules() if type(_).__name__ == "JetMoeTopKGating")
    torch._dynamo.reset()

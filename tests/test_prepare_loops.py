"""``ep_fuse.prepare`` on MoE blocks that loop over an ``nn.ModuleList`` of experts
(``tests/support/loop_moe_modules.py``): stacked experts, the same outputs in eager and compiled, one graph with
the expert block fused, the state dict unchanged; non-SwiGLU experts, biased Linears and routing it does not
reproduce are refused."""

import functools
import logging

from support import loop_moe_modules as L
import pytest
import torch

import ep_fuse
from ep_fuse.surgery.expert_loops import StackedExperts
from ep_fuse.surgery.loop_dataflow import LoopPlan, recognise_loop

pytestmark = pytest.mark.hf  # the stacked experts run transformers' grouped_mm function

REFERENCE = {"executor": "eager", "providers": {"cpu": ["reference"]}}
NORMS = {"rms_norm": 1, "add_rms_norm": 1}  # LoopModel's two pre-block norms

CASES = {
    # name: block, (form, layout), fused sites in the one graph of the 2-layer model
    "deepseek_v3": (L.DeepseekV3MoE, ("moe_infer", "gate_proj/up_proj/down_proj"),
                    # the remote-code gate (``masked_fill`` 0.0): moe_gating ``sigmoid_group_sum_top2_fill0``
                    {"moe_experts": 2, "moe_gating": 2, "gemm_swiglu": 2, **NORMS}),  # + the shared experts
    "mixtral": (L.MixtralSparseMoeBlock, ("softmax_topk", "w1/w3/w2"), {"moe_experts": 2, "moe_gating": 2, **NORMS}),
    "qwen2_moe": (L.Qwen2MoeSparseMoeBlock, ("softmax_topk", "gate_proj/up_proj/down_proj"),
                  {"moe_experts": 2, "moe_gating": 2, "gemm_swiglu": 2, **NORMS}),  # + the shared expert
    "fused_gate_up": (functools.partial(L.MixtralSparseMoeBlock, mlp=L.FusedGateUpMLP),
                      ("softmax_topk", "gate_up_proj/down_proj"), {"moe_experts": 2, "moe_gating": 2, **NORMS}),
    "roles_by_computation": (functools.partial(L.MixtralSparseMoeBlock, mlp=L.WiWoMLP),
                             ("softmax_topk", "wi_0/wi_1/wo"), {"moe_experts": 2, "moe_gating": 2, **NORMS}),
}


def _tokens(seed=1, batch=2, seq=7, hidden=32, dtype=torch.float32):
    return torch.randn(batch, seq, hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _eager(model, x):
    with torch.no_grad():
        return model(x.clone())


@pytest.mark.parametrize("name", list(CASES))
def test_loop_blocks_convert_and_fuse(name, caplog):
    block, (form, layout), sites = CASES[name]
    model = L.build(block)
    x = _tokens()
    ref = _eager(model, x)
    keys, numel = list(model.state_dict()), sum(p.numel() for p in model.parameters())
    with caplog.at_level(logging.INFO, logger="ep_fuse"):
        ep_fuse.prepare(model)
    converted = [r.getMessage() for r in caplog.records if "stacked into" in r.getMessage()]
    replaced = "moe_infer replaced" if form == "moe_infer" else "forward (softmax top-k) replaced"
    assert len(converted) == 2 and all(layout in m and replaced in m for m in converted), caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert all(isinstance(layer.experts, StackedExperts) for layer in model.layers)
    assert list(model.state_dict()) == keys
    assert sum(p.numel() for p in model.parameters()) == numel, "stacked copies replace the per-expert weights"
    torch.testing.assert_close(_eager(model, x), ref, rtol=1e-5, atol=1e-6)

    with torch.no_grad():
        out = torch.compile(model, backend="ep_fuse", options=REFERENCE)(x.clone())
    assert len(ep_fuse.reports()) == 1, "the model is one graph"
    rep = ep_fuse.last_report()
    assert rep.counts() == sites, rep.summary()
    blocks = [m for m in rep.matches if m.pattern == "moe_experts"]
    assert [(m.module_path, m.variant) for m in blocks] == [("layers.0.experts", "grouped_mm"),
                                                             ("layers.1.experts", "grouped_mm")]
    assert not rep.near_misses, [m.explain() for m in rep.near_misses]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_loop_breaks_the_graph_before_prepare():
    model = L.build(L.DeepseekV3MoE, layers=1)
    before = torch._dynamo.explain(model)(_tokens())
    assert before.graph_break_count > 0
    ep_fuse.prepare(model)
    torch._dynamo.reset()
    after = torch._dynamo.explain(model)(_tokens())
    assert (after.graph_count, after.graph_break_count) == (1, 0)


def test_batched_mm_implementation():
    model = L.build(L.MixtralSparseMoeBlock, layers=1)
    x = _tokens()
    ref = _eager(model, x)
    ep_fuse.prepare(model, "batched_mm")
    with torch.no_grad():
        out = torch.compile(model, backend="ep_fuse", options=REFERENCE)(x.clone())
    rep = ep_fuse.last_report()
    assert [m.variant for m in rep.matches if m.pattern == "moe_experts"] == ["batched_mm"]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_state_dict_of_the_original_model_loads():
    """Per-expert keys in, per-expert keys out: loading another model's weights changes the outputs to its."""
    x = _tokens()
    source = L.build(L.DeepseekV3MoE, seed=1)
    expected, state = _eager(source, x), source.state_dict()
    model = L.build(L.DeepseekV3MoE, seed=0)
    ep_fuse.prepare(model)
    assert not torch.allclose(_eager(model, x), expected)
    assert list(model.state_dict()) == list(state)
    model.load_state_dict(state)
    torch.testing.assert_close(_eager(model, x), expected, rtol=1e-5, atol=1e-6)
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key
    mixtral = L.build(L.MixtralSparseMoeBlock, layers=1)
    ep_fuse.prepare(mixtral)
    assert [k for k in mixtral.state_dict() if k.startswith("layers.0.experts.0.")] == \
        ["layers.0.experts.0.w1.weight", "layers.0.experts.0.w2.weight", "layers.0.experts.0.w3.weight"]
    partial = {k: v for k, v in state.items() if k != "layers.1.experts.3.up_proj.weight"}
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*layers\.1\.experts\.gate_up_proj"):
        model.load_state_dict(partial)


def test_stacked_experts_still_index_like_the_list():
    model = L.build(L.Qwen2MoeSparseMoeBlock, layers=1)
    experts = list(model.layers[0].experts)
    rows = _tokens().view(-1, 32)
    expected = [_eager(e, rows) for e in experts]
    ep_fuse.prepare(model)
    stacked = model.layers[0].experts
    assert len(stacked) == len(experts) == 8
    for i, want in enumerate(expected):
        torch.testing.assert_close(_eager(stacked[i], rows), want, rtol=1e-5, atol=1e-6)


def test_weights_narrower_than_tokens_keep_the_loop_numerics():
    """fp64 tokens, fp32 routing weights: DeepSeek's sum runs in fp32, which grouped_mm would not do;
    the converted ``moe_infer`` runs the loop over stacked slices, bit for bit."""
    model = L.build(L.DeepseekV3MoE, layers=1, dtype=torch.float64)
    x = _tokens(dtype=torch.float64)
    ref = _eager(model, x)
    ep_fuse.prepare(model)
    assert isinstance(model.layers[0].experts, StackedExperts)
    assert torch.equal(_eager(model, x), ref)


REFUSED = {
    "bias": (L.DeepseekV3MoE, {"mlp_bias": True}, "experts[0].gate_proj has a bias"),
    "roles_not_swiglu": (functools.partial(L.MixtralSparseMoeBlock, mlp=L.WiWoReluMLP), {},
                         "or others computing down(silu(gate(x)) * up(x))"),
    "up_first": (functools.partial(L.MixtralSparseMoeBlock, mlp=L.UpFirstFusedMLP), {},
                 "experts[0] does not compute down(silu(gate(x)) * up(x))"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_unconvertible_loops_stay_with_a_warning(name, caplog):
    block, overrides, reason = REFUSED[name]
    model = L.build(block, layers=1, **overrides)
    x = _tokens()
    ref = _eager(model, x)
    with caplog.at_level(logging.INFO, logger="ep_fuse"):
        ep_fuse.prepare(model)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and reason in warnings[0] and "layers.0" in warnings[0], caplog.text
    assert type(model.layers[0].experts) is torch.nn.ModuleList
    assert "forward" not in vars(model.layers[0]) and "moe_infer" not in vars(model.layers[0])
    assert torch.equal(_eager(model, x), ref)
    with pytest.raises(ValueError, match="strict=True") as err:
        ep_fuse.prepare(model, strict=True)
    assert reason in str(err.value)
    assert type(model.layers[0].experts) is torch.nn.ModuleList


def test_models_without_loops_are_untouched(caplog):
    with caplog.at_level(logging.INFO, logger="ep_fuse"):
        ep_fuse.prepare(torch.nn.Linear(2, 2), strict=True)
    assert "no per-expert loops; unchanged" in caplog.text


# --------------------------------------------------------------------------- recognised by dataflow
DATAFLOW_SITES = {"moe_experts": 2, "moe_gating": 2, "gemm_swiglu": 2, **NORMS}  # + the shared experts
ROUTE = "router self.route(), shared experts shared_experts"
DATAFLOW = {  # name: block, dtype, what the trace finds, fused sites of the 2-layer model
    "raw_weight_method": (L.RemoteRoutedMoE, torch.float32, f"experts self.experts, {ROUTE}", DATAFLOW_SITES),
    "raw_weight_method_bf16": (L.RemoteRoutedMoE, torch.bfloat16, f"experts self.experts, {ROUTE}", DATAFLOW_SITES),
    "gate_module": (L.GateModuleLoopMoE, torch.float32,
                    "experts self.experts, router self.gate, shared experts shared_experts", DATAFLOW_SITES),
    "renamed_list": (L.RenamedListMoE, torch.float32, f"experts self.mlps, {ROUTE}", DATAFLOW_SITES),
    "softmax_method": (L.SoftmaxMethodMoE, torch.float32, "experts self.experts, router self.select(), shared "
                       "experts none", {"moe_experts": 2, "moe_gating": 2, **NORMS}),
    "returns_logits": (L.LogitsReturningMoE, torch.float32, "experts self.experts, router self.select(), shared "
                       "experts none", {"moe_experts": 2, "moe_gating": 2, **NORMS}),
}
# the moe_gating variant of each case; the others: DeepSeek's remote-code router
GATING = {"softmax_method": "softmax_topk", "returns_logits": "softmax_topk"}
SLOW = {"gate_module", "renamed_list", "returns_logits"}  # router forms of the cases before them again


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in DATAFLOW])
def test_routing_method_on_a_raw_weight_converts_by_dataflow(name, caplog):
    """No known layout (routing in a method or a gate module, no ``moe_infer``): the trace finds the router (the
    top-k ids the experts follow), the weighted combine and the shared experts; the router's code is kept, so
    ``moe_gating`` still matches it."""
    block, dtype, found, sites = DATAFLOW[name]
    model = L.build(block, dtype=dtype)
    x = _tokens(dtype=dtype)
    ref = _eager(model, x)
    keys = list(model.state_dict())
    with caplog.at_level(logging.DEBUG, logger="ep_fuse"):
        ep_fuse.prepare(model, strict=True)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    converted = [r.getMessage() for r in caplog.records if "stacked into" in r.getMessage()]
    assert len(converted) == 2 and all("recognised by dataflow" in m for m in converted), caplog.text
    assert caplog.text.count(found) == 2, caplog.text
    assert all(isinstance(layer.experts, StackedExperts) for layer in model.layers)
    assert list(model.state_dict()) == keys, "the per-expert keys, under the list's own name"
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(_eager(model, x), ref, **tol)

    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend="ep_fuse", options=REFERENCE)(x.clone())
    assert len(ep_fuse.reports()) == 1, "the model is one graph"
    rep = ep_fuse.last_report()
    assert rep.counts() == sites, rep.summary()
    assert {m.variant for m in rep.matches if m.pattern == "moe_gating"} == \
        {GATING.get(name, "sigmoid_group_sum_top2_fill0")}, "the block's own router is matched"
    list_name = found.split(",")[0].removeprefix("experts self.")
    assert [m.module_path for m in rep.matches if m.pattern == "moe_experts"] == [f"layers.0.{list_name}",
                                                                                  f"layers.1.{list_name}"]
    torch.testing.assert_close(out, ref, **tol)


@pytest.mark.parametrize("block, plan", [
    (L.RemoteRoutedMoE, LoopPlan("experts", "route", True, "input", 0, 1, (("shared_experts", "input"),), "input")),
    (L.GateModuleLoopMoE, LoopPlan("experts", "gate", False, "input", 0, 1, (("shared_experts", "input"),), "input")),
    (L.SoftmaxMethodMoE, LoopPlan("experts", "select", True, "rows", 1, 0, (), "rows")),
    (L.LogitsReturningMoE, LoopPlan("experts", "select", True, "rows", 1, 0, (), "input", (2,))),
])
def test_the_trace_places_router_outputs_and_shapes(block, plan):
    layer = L.build(block, layers=1).layers[0]
    assert recognise_loop(layer, "experts", _tokens(batch=2, seq=16)) == plan
    assert not layer._forward_hooks and not layer.experts[0]._forward_pre_hooks and "route" not in vars(layer)


DATAFLOW_REFUSED = {
    "unweighted": (L.UnweightedRemoteMoE, "outputs are not multiplied by the top-k weights of route"),
    "early_exit": (L.EarlyExitRemoteMoE, "the top-k ids send it (a loop that skips or repeats experts"),
    "normed_output": (L.NormedOutputMoE, "post_norm (RMSNorm) runs outside the router and is not a shared expert"),
}


@pytest.mark.parametrize("name", list(DATAFLOW_REFUSED))
def test_dataflow_look_alikes_are_refused_with_the_reason(name, caplog):
    block, reason = DATAFLOW_REFUSED[name]
    model = L.build(block, layers=1)
    x = _tokens()
    ref = _eager(model, x)
    with caplog.at_level(logging.INFO, logger="ep_fuse"):
        ep_fuse.prepare(model)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and reason in warnings[0] and "unknown forward structure" in warnings[0], caplog.text
    assert "by what it computes: " in warnings[0], "the semantic pass's reason is reported in the same warning"
    layer = model.layers[0]
    assert type(layer.experts) is torch.nn.ModuleList
    assert not {"forward", "route", "loop", "_ep_fuse_loop_plan"} & set(vars(layer)), "the trace's wrappers are gone"
    assert not layer._forward_hooks and not layer.shared_experts._forward_pre_hooks
    assert torch.equal(_eager(model, x), ref)
    with pytest.raises(ValueError, match="strict=True") as err:
        ep_fuse.prepare(model, strict=True)
    assert reason in str(err.value)


def test_mlp_lists_that_are_not_routed_are_left_quietly(caplog):
    """A list of MLPs that each see every token is no expert loop: no conversion, no warning."""
    model = L.build(L.DenseBranches, layers=1)
    x = _tokens()
    ref = _eager(model, x)
    with caplog.at_level(logging.DEBUG, logger="ep_fuse"):
        ep_fuse.prepare(model, strict=True)
    assert "does not run them on routed subsets of tokens" in caplog.text
    assert "no per-expert loops; unchanged" in caplog.text
    assert type(model.layers[0].branches) is torch.nn.ModuleList and not model.layers[0]._forward_hooks
    assert torch.equal(_eager(model, x), ref)


# --------------------------------------------------------------------------- rebuilt by what they compute
SEMANTIC = {  # loop blocks the forms above refuse, recognised by ep_fuse.surgery.moe_semantics
    "unnormalised": (L.UnnormalisedMixtral, {}, "router: linear(rows, gate.weight), softmax top-2, ",
                     "experts: experts (8 x MixtralBlockSparseTop2MLP, w1/w3/w2, silu)"),
    "inline_router": (L.InlineRouterMoE, {}, "router: linear(rows, weight), softmax top-2, ",
                      "shared experts: shared_experts"),
    "gelu": (L.MixtralSparseMoeBlock, {"hidden_act": "gelu"}, "router: linear(rows, gate.weight), softmax top-2, ",
             "experts: experts (8 x MixtralBlockSparseTop2MLP, w1/w3/w2, gelu)"),  # the known form is SwiGLU only
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(SEMANTIC))
def test_loops_the_known_forms_refuse_are_rebuilt_by_what_they_compute(name, dtype, caplog):
    block, overrides, router, parts = SEMANTIC[name]
    model = L.build(block, dtype=dtype, **overrides)
    x = _tokens(dtype=dtype)
    ref = _eager(model, x)
    keys = list(model.state_dict())
    with caplog.at_level(logging.INFO, logger="ep_fuse"):
        ep_fuse.prepare(model, strict=True)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    rebuilt = [r.getMessage() for r in caplog.records if "recognised by what it computes" in r.getMessage()]
    assert len(rebuilt) == 2 and all(router in m and parts in m for m in rebuilt), caplog.text
    assert list(model.state_dict()) == keys, "the per-expert keys stay"
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    got = _eager(model, x)
    torch.testing.assert_close(got, ref, **tol)
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend="ep_fuse", options=REFERENCE)(x.clone())
    assert len(ep_fuse.reports()) == 1, "the model is one graph"
    rep = ep_fuse.last_report()
    assert rep.counts()["moe_experts"] == 2 and rep.counts()["moe_gating"] == 2, rep.summary()
    assert {m.variant for m in rep.matches if m.pattern == "moe_gating"} == {"softmax_bias"}, "moe_gating_ref's spelling"
    torch.testing.assert_close(out, ref, **tol)

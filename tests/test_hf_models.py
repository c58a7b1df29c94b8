"""Tiny HF MoE models (random weights, built from configs): exact site counts and eager-matching outputs."""

import pytest
import torch

import ep_fuse
from ep_fuse.testing import tiny as tiny_models

pytestmark = pytest.mark.hf

MODELS = list(tiny_models.TINY_MODELS)


def _run(model, inputs, **options):
    with torch.no_grad():
        return torch.compile(model, backend="ep_fuse", options=options).__call__(**inputs).logits


def _check_counts(name, report, rope_variant=None):
    sites, expected_variant = tiny_models.EXPECTED_SITES[name]
    rope_variant = rope_variant or expected_variant
    assert report.counts() == sites, report
    assert {m.variant for m in report.matches if m.pattern == "rope"} == ({rope_variant} if rope_variant else set())
    assert len(ep_fuse.reports()) == 1, "the model is one graph"
    assert report.ops_after.get("aten.rsqrt.default", 0) == 0
    if report.executor == "eager":  # (Inductor inlines the reference of sites no fused provider took)
        assert report.ops_after.get("aten.neg.default", 0) == 0
        assert report.ops_after.get("aten.view_as_complex.default", 0) == 0
        rope_calls = sum(v for k, v in report.ops_after.items() if ".rope_qk." in k)
        assert rope_calls == sites.get("rope", 0) // 2, "q and k of a layer run as one rope_qk"
    misses = [m for m in report.near_misses
              if not m.explain().startswith(("sort", "topk")) and m.anchor_op != "routed experts"]
    assert not misses, [m.explain() for m in misses]
    routed = [m.explain() for m in report.near_misses if m.anchor_op == "routed experts"]
    assert len(routed) == tiny_models.NOT_MOE_BLOCKS.get(name, 0), routed  # named by the backend, one per layer
    sorts = [m for m in report.near_misses if m.explain().startswith("sort")]
    assert len(sorts) == tiny_models.NOT_MOE_BLOCKS.get(name, 0), [m.explain() for m in report.near_misses]
    routers = [m.explain() for m in report.near_misses if m.explain().startswith("topk")]
    assert len(routers) == tiny_models.DECLINED_ROUTERS.get(name, 0), routers
    assert all("do not reproduce bitwise" in r or "guard not_fusable" in r for r in routers), routers


@pytest.mark.parametrize("name", MODELS)
def test_reference_provider_is_bitwise_eager(name):
    model = tiny_models.build(name)
    inputs = tiny_models.example_inputs()
    with torch.no_grad():
        ref = model(**inputs).logits
    out = _run(model, inputs, executor="eager", providers={"cpu": ["reference"]})
    _check_counts(name, ep_fuse.last_report())
    assert torch.equal(out, ref)


@pytest.mark.parametrize("seq", [16, 1], ids=["prefill", "decode"])
@pytest.mark.parametrize("name", MODELS)
def test_triton_kernels_match_eager(name, seq):
    """Decode shapes (one token per sequence) put size-1 dims between the rows of sliced inputs
    (DeepSeek's kv_a_layernorm): a stride read off the wrong dim once gave garbage there."""
    model = tiny_models.build(name)
    # seed 0 (and seed 1 at 4 x 1 tokens) gives one Qwen3-MoE token two experts of exactly equal probability;
    # the Triton gating kernel gives ties to the lowest expert id, torch.topk on the CPU does not
    # (tests/test_moe_gating.py)
    inputs = tiny_models.example_inputs(seed=1, batch=2, seq=seq) if seq > 1 else \
        tiny_models.example_inputs(seed=2, batch=4, seq=1)
    with torch.no_grad():
        ref = model(**inputs).logits
    out = _run(model, inputs, executor="eager")
    rep = ep_fuse.last_report()
    _check_counts(name, rep)
    assert {m.provider for m in rep.matches if m.pattern.endswith("rms_norm")} == {"triton"}
    if seq == 1:  # 4 x 1 tokens: a bf16 ulp flips an element here and there; the relative L2 says it all
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert err < 1e-2, f"relative L2 {err:.2e}"
        return
    # one bf16 ulp in a norm output moves tiny-model logits by at most a few bf16 ulps of their scale
    torch.testing.assert_close(out.float(), ref.float(), rtol=0.02, atol=0.02 * ref.float().abs().max().item())


def test_module_paths_in_report():
    model = tiny_models.build("qwen3_moe")
    _run(model, tiny_models.example_inputs(), executor="eager")
    paths = [m.module_path for m in ep_fuse.last_report().matches]
    assert paths == [
        "model.layers.0.input_layernorm", "model.layers.0.self_attn.q_norm", "model.layers.0.self_attn.k_norm",
        "model.layers.0.self_attn", "model.layers.0.self_attn",
        "model.layers.0.post_attention_layernorm", "model.layers.0.mlp.gate", "model.layers.0.mlp.experts", "model.layers.1.input_layernorm",
        "model.layers.1.self_attn.q_norm", "model.layers.1.self_attn.k_norm",
        "model.layers.1.self_attn", "model.layers.1.self_attn",
        "model.layers.1.post_attention_layernorm", "model.layers.1.mlp.gate", "model.layers.1.mlp.experts", "model.norm",
    ]
    classes = {m.pattern: set() for m in ep_fuse.last_report().matches}
    for m in ep_fuse.last_report().matches:
        classes[m.pattern].add(m.module_class)
    assert classes["rms_norm"] | classes["add_rms_norm"] == {"Qwen3MoeRMSNorm"}
    assert classes["moe_experts"] == {"Qwen3MoeExperts"}
    assert classes["moe_gating"] == {"Qwen3MoeTopKRouter"}
    assert {m.module_class for m in ep_fuse.last_report().matches if m.pattern == "rope"} == {"Qwen3MoeAttention"}


def test_fp32_model_uses_weight_fp32_variant():
    model = tiny_models.build("mixtral", dtype=torch.float32)
    inputs = tiny_models.example_inputs()
    with torch.no_grad():
        ref = model(**inputs).logits
    out = _run(model, inputs, executor="eager")
    rep = ep_fuse.last_report()
    _check_counts("mixtral", rep)
    assert {m.variant for m in rep.matches if m.pattern.endswith("rms_norm")} == {"weight_fp32"}
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_deepseek_v3_without_rope_interleave():
    model = tiny_models.build("deepseek_v3", rope_interleave=False)
    inputs = tiny_models.example_inputs()
    with torch.no_grad():
        ref = model(**inputs).logits
    out = _run(model, inputs, executor="eager", providers={"cpu": ["reference"]})
    _check_counts("deepseek_v3", ep_fuse.last_report(), rope_variant="half")
    assert torch.equal(out, ref)


@pytest.mark.slow
def test_inductor_executor_keeps_fused_ops():
    model = tiny_models.build("mixtral")
    inputs = tiny_models.example_inputs()
    with torch.no_grad():
        ref = model(**inputs).logits
    out = _run(model, inputs, executor="inductor", perf_guard=False)
    rep = ep_fuse.last_report()
    _check_counts("mixtral", rep)
    assert rep.executor == "inductor" and {m.provider for m in rep.matches if m.pattern != "rope"} == {"triton"}
    assert rep.ops_after.get("ep_fuse_triton.add_rms_norm.default") == 4
    torch.testing.assert_close(out.float(), ref.float(), rtol=0.02, atol=0.02 * ref.float().abs().max().item())


def test_prepare_selects_a_traceable_experts_implementation():
    model = tiny_models.build("mixtral", experts_implementation="batched_mm")
    assert model.config._experts_implementation == "batched_mm"
    ep_fuse.prepare(model)
    assert model.config._experts_implementation == "grouped_mm"
    with pytest.raises(ValueError, match="cannot be captured as one graph"):
        ep_fuse.prepare(model, "eager")
    assert ep_fuse.prepare(torch.nn.Linear(2, 2)) is not None  # models without experts pass through

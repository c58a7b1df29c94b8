"""3-D experts without transformers' experts-implementation switch (``ep_fuse.surgery.hookless_experts``): the converted
forward reproduces the module's own loop, look-alikes are refused with the reason, hooked and other modules are left
alone, and a tiny Gemma-4 whose experts loop (its GeGLU experts as transformers writes them without the hook) goes from
a graph per expert and no ``moe_experts`` to one graph with a ``moe_experts`` site per MoE layer after ``prepare``
(and transformers' own Gemma-4 experts, which switch, fuse as ``gelu_tanh`` with nothing converted)."""

from __future__ import annotations

import logging

import pytest
import torch

import ep_fuse
from ep_fuse.surgery.hookless_experts import convert_hookless_experts, has_experts_hook, is_candidate
from support.compiling import compile_and_run
from support.geglu_moe_modules import HooklessGeGLUExperts, UpHalfHookless

BF16, F32 = torch.bfloat16, torch.float32


def _inputs(t, h, e, k, dtype, seed=7):
    """Tokens, ids with a repeated expert in one token and expert 0 never hit, fp32 weights."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, e, (t, k), generator=g)
    ids[1, -1] = ids[1, 0]
    return torch.randn(t, h, generator=g).to(dtype), ids, torch.rand(t, k, generator=g)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("act", ["gelu_pytorch_tanh", "gelu", "silu"])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_converted_forward_reproduces_the_loop(dtype, act, transposed):
    mod = HooklessGeGLUExperts(6, 32, 16, dtype=dtype, act=act, transposed=transposed)
    x, ids, w = _inputs(9, 32, 6, 3, dtype)
    with torch.no_grad():
        ref = mod(x, ids, w)
    keys = {k: v.clone() for k, v in mod.state_dict().items()}
    [conv] = convert_hookless_experts(mod)
    assert conv.converted and conv.transposed == transposed and conv.path == "HooklessGeGLUExperts"
    assert has_experts_hook(mod) and not is_candidate(mod), "converted once"
    assert convert_hookless_experts(mod) == [], "idempotent"
    assert mod.state_dict().keys() == keys.keys() and all(torch.equal(mod.state_dict()[k], v) for k, v in keys.items())
    with torch.no_grad():
        out = mod(x, ids, w)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if dtype == F32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:  # the loop sums the top-k in bf16 per expert, the experts function in fp32 once
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.float().abs().max().item())


def test_converted_forward_follows_the_parameters():
    """The new forward reads the module's parameters at each call: a cast or a loaded state dict is seen."""
    mod = HooklessGeGLUExperts(4, 32, 16)
    convert_hookless_experts(mod, "batched_mm")
    mod.load_state_dict({k: 2 * v for k, v in mod.state_dict().items()})
    mod.to(BF16)
    x, ids, w = _inputs(5, 32, 4, 2, BF16)
    loop = HooklessGeGLUExperts(4, 32, 16, dtype=BF16)
    loop.load_state_dict(mod.state_dict())
    with torch.no_grad():
        out, ref = mod(x, ids, w), loop(x, ids, w)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.float().abs().max().item())


def test_a_lookalike_is_refused_with_the_reason(caplog):
    """The activation on the up half: transformers' experts functions would compute another block; the loop stays."""
    mod = UpHalfHookless(4, 32, 16)
    forward = mod.forward
    with caplog.at_level(logging.WARNING, logger="ep_fuse"):
        [conv] = convert_hookless_experts(mod)
    assert not conv.converted and "differs from its forward" in conv.reason
    assert "keep their per-expert loop" in caplog.text and conv.reason in caplog.text
    assert mod.forward == forward and is_candidate(mod)
    with pytest.raises(ValueError, match="strict=True"):
        convert_hookless_experts(mod, strict=True)


def test_hooked_and_other_expert_modules_are_left_alone():
    from transformers import Gemma4TextConfig, Llama4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts
    from transformers.models.llama4.modeling_llama4 import Llama4TextExperts

    hooked = Gemma4TextExperts(Gemma4TextConfig(hidden_size=32, num_experts=4, top_k_experts=2,
                                                moe_intermediate_size=16))
    dense = Llama4TextExperts(Llama4TextConfig(hidden_size=32, intermediate_size=16, num_local_experts=4))
    assert has_experts_hook(hooked) and not is_candidate(hooked)
    assert not is_candidate(dense), "one-argument forward: not a routed top-k block"
    model = torch.nn.ModuleDict({"hooked": hooked, "dense": dense, "loop": HooklessGeGLUExperts(4, 32, 16)})
    assert [c.path for c in convert_hookless_experts(model)] == ["loop"]


def test_step37_experts_convert_and_fuse():
    """Step-3.7's experts (their own clamped ``_apply_gate``) fuse as ``silu_clamp_post``: transformers 5.24's have
    no hook and are converted; 5.25's have the hook (and a per-layer limit) and fuse through its grouped_mm."""
    from transformers.models.step3p7.configuration_step3p7 import Step3p7TextConfig
    from transformers.models.step3p7.modeling_step3p7 import Step3p7Experts

    hooked = getattr(Step3p7Experts.forward, "__wrapped__", None) is not None
    if hooked:  # transformers >= 5.25
        cfg = Step3p7TextConfig(hidden_size=32, moe_intermediate_size=16, num_local_experts=4, num_hidden_layers=1,
                                swiglu_limits=[0.5])
        mod = Step3p7Experts(cfg, 0)
    else:
        cfg = Step3p7TextConfig(hidden_size=32, moe_intermediate_size=16, num_local_experts=4)
        mod = Step3p7Experts(cfg, swiglu_limit=0.5)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        mod.gate_up_proj.copy_(3 * torch.randn(mod.gate_up_proj.shape, generator=g) / 32**0.5)
        mod.down_proj.copy_(torch.randn(mod.down_proj.shape, generator=g) / 16**0.5)
    x, ids, w = _inputs(9, 32, 4, 2, F32)
    with torch.no_grad():
        ref = mod(x, ids, w)
    if hooked:
        assert convert_hookless_experts(mod) == []
        mod.config._experts_implementation = "grouped_mm"  # what prepare sets on a model
    else:
        assert [c.converted for c in convert_hookless_experts(mod)] == [True]
    out = compile_and_run(mod, x, ids, w, executor="eager")
    reps = ep_fuse.reports()
    assert len(reps) == 1 and reps[0].count("moe_experts") == 1, [r.summary() for r in reps]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- a tiny Gemma-4
def _tiny_gemma4(dtype, hookless=True):
    """A 2-layer Gemma-4 text model with MoE blocks; ``hookless``: its experts are the loop over the same weights
    without the experts-implementation switch (transformers 5.24's own ``Gemma4TextExperts`` have the switch)."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    cfg = Gemma4TextConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=16,
                           enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=48,
                           hidden_size_per_layer_input=16, vocab_size_per_layer_input=128, sliding_window=16,
                           max_position_embeddings=256, layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(cfg).eval()
    for layer in model.model.layers if hookless else ():
        loop = HooklessGeGLUExperts(4, 64, 48, act=cfg.hidden_activation)
        loop.gate_up_proj, loop.down_proj = layer.experts.gate_up_proj, layer.experts.down_proj
        layer.experts = loop
    return model.to(dtype)


def _counts(reps):
    return {p: sum(r.count(p) for r in reps) for p in ("moe_experts", "moe_gating")}


@pytest.mark.hf
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_tiny_gemma4_experts_fuse_after_prepare(dtype):
    model = _tiny_gemma4(dtype)
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
    if dtype == F32:  # before: the loop breaks the graph at every expert and leaves no moe_experts site
        compile_and_run(model, ids, executor="eager")
        reps = ep_fuse.reports()
        assert len(reps) > 2 and _counts(reps) == {"moe_experts": 0, "moe_gating": 2}, [r.summary() for r in reps]
        torch._dynamo.reset()
        ep_fuse.reset_reports()
    ep_fuse.prepare(model)
    out = compile_and_run(model, ids, executor="eager").logits
    reps = ep_fuse.reports()
    assert len(reps) == 1 and _counts(reps) == {"moe_experts": 2, "moe_gating": 2}, [r.summary() for r in reps]
    assert {m.variant for m in reps[0].matches if m.pattern == "moe_experts"} == {"grouped_mm"}
    gelu = "aten.gelu.default"  # the experts' two went into the blocks (as act="gelu_tanh"), the dense MLPs' stay
    assert reps[0].ops_before[gelu] - reps[0].ops_after.get(gelu, 0) == 2, (reps[0].ops_before, reps[0].ops_after)
    if dtype == F32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=3e-2, atol=3e-2 * ref.float().abs().max().item())


@pytest.mark.hf
def test_tiny_gemma4_with_transformers_experts_fuses():
    """transformers 5.24's ``Gemma4TextExperts`` switch to ``grouped_mm``: nothing to convert, and their GeGLU
    (``gelu_pytorch_tanh``) fuses as ``act="gelu_tanh"``, one site per MoE layer, bitwise equal to eager in bf16."""
    model = _tiny_gemma4(BF16, hookless=False)
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    ep_fuse.prepare(model)
    assert convert_hookless_experts(model) == []
    with torch.no_grad():
        ref = model(ids).logits
    out = compile_and_run(model, ids, executor="eager", providers={"cpu": ["reference"]}).logits
    reps = ep_fuse.reports()
    assert len(reps) == 1 and _counts(reps) == {"moe_experts": 2, "moe_gating": 2}, [r.summary() for r in reps]
    assert torch.equal(out, ref)

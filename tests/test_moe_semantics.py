"""MoE blocks recognised by what they compute (``ep_fuse.surgery.moe_semantics``), on blocks generated from a
description (``tests/support/semantic_moe_blocks.py``): the binding found reproduces the block in fp32 and bf16 on
fresh tokens, the rebuilt block compiles to one graph with ``moe_experts`` and ``moe_gating``, the state dict keeps its
keys, and look-alikes that are not a routing-weighted combine of expert MLPs are declined by the part that fails."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ep_fuse
from ep_fuse.surgery.moe_semantics import EXPERTS_ATTR, convert_semantic_blocks
from support.semantic_moe_blocks import AuxLossMoE, GeneratedMoE, InputScaledMoE, Spec, SquaredWeightsMoE, \
    UnweightedMoE

pytestmark = pytest.mark.hf  # the rebuilt experts run transformers' grouped_mm function

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
REFERENCE = {"executor": "eager", "providers": {"cpu": ["reference"]}}


def _tokens(spec: Spec, dtype: torch.dtype, seed: int = 5, batch: int = 3, seq: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (batch * seq, spec.hidden) if spec.packed else (batch, seq, spec.hidden)
    return torch.randn(*shape, generator=g).to(dtype)


def _run(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return block(x.clone())


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _tied_rows(block: GeneratedMoE, x: torch.Tensor) -> torch.Tensor:
    """Rows where the block's own top-k has a near tie at the k-th place (bf16 rounds such rows either way)."""
    s = block.spec
    rows = x.reshape(-1, s.hidden).float()
    w = block.router.float()
    logits = rows @ w if s.router_transposed else rows @ w.t()
    scores = logits if s.score == "topk_softmax" else (logits.softmax(-1) if s.score == "softmax" else logits.sigmoid())
    if s.bias:
        scores = scores + block.score_bias.float()
    top = scores.topk(min(s.top_k + 1, s.experts), dim=-1).values
    gap = (top[:, s.top_k - 1] - top[:, -1]).abs() if s.top_k < s.experts else torch.full_like(top[:, 0], 1.0)
    return gap < 0.02 * top[:, s.top_k - 1].abs().clamp(min=1e-2)


def _check_rebuilt(spec: Spec, dtype: torch.dtype, seed: int = 0) -> str:
    block = GeneratedMoE(spec, seed).to(dtype).eval()
    x = _tokens(spec, dtype)
    ref = _run(block, x)
    results = convert_semantic_blocks(block, strict=True)
    assert len(results) == 1 and results[0].converted, results
    got = _run(block, x)
    if dtype == torch.float32 or spec.groups is None:
        keep = ~_tied_rows(block, x) if dtype != torch.float32 else torch.ones(got.numel() // spec.hidden, dtype=bool)
        got_rows, ref_rows = got.reshape(-1, spec.hidden)[keep], ref.reshape(-1, spec.hidden)[keep]
        assert _rel(got_rows, ref_rows) <= TOL[dtype], (results[0].description, _rel(got_rows, ref_rows))
    return results[0].description


SPECS = {
    "einsum_softmax": Spec(),
    "dense_sigmoid_bias": Spec(score="sigmoid", bias=True, dispatch="dense", renormalize=False),
    "loop_topk_softmax_packed": Spec(score="topk_softmax", dispatch="loop", packed=True, renormalize=False),
    "grouped_scaled_shared": Spec(experts=16, top_k=4, score="sigmoid", bias=True, groups=(4, 2), scale=2.5,
                                  shared=True, storage="fused", transposed=True),
    "list_fused_gate_up": Spec(storage="list", router_transposed=True, shared=True),
    "up_first_fused": Spec(storage="fused", fused_order="up_first", dispatch="dense", top_k=1),
    "transposed_router_top1": Spec(router_transposed=True, top_k=1, renormalize=False, transposed=True),
    "gelu_tanh_list": Spec(storage="list", act="gelu_tanh", score="sigmoid", renormalize=False),
    "gelu_tanh_stacked": Spec(act="gelu_tanh", dispatch="dense", scale=1.5),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(SPECS))
def test_generated_blocks_are_bound_and_rebuilt(name, dtype):
    spec = SPECS[name]
    description = _check_rebuilt(spec, dtype)
    assert ("selection bias score_bias" in description) == spec.bias, description
    assert (f"{spec.groups[1]} of {spec.groups[0]} groups" in description) if spec.groups else \
        "groups" not in description, description
    if spec.scale != 1.0:
        assert f"x {spec.scale:g}" in description, description
    assert ("shared experts: shared" in description) == spec.shared, description
    assert f", {spec.act}" in description, description


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(score=st.sampled_from(["softmax", "sigmoid", "topk_softmax"]), bias=st.booleans(),
       renormalize=st.booleans(), top_k=st.sampled_from([1, 2, 3]), experts=st.sampled_from([4, 8]),
       storage=st.sampled_from(["stacked", "fused", "list"]), transposed=st.booleans(),
       dispatch=st.sampled_from(["einsum", "dense", "loop"]), router_transposed=st.booleans(),
       shared=st.booleans(), seed=st.integers(0, 3))
def test_any_spelling_of_a_routed_block_is_rebuilt_equal_fp32(score, bias, renormalize, top_k, experts, storage,
                                                              transposed, dispatch, router_transposed, shared, seed):
    spec = Spec(experts=experts, top_k=top_k, score=score, bias=bias and score != "topk_softmax",
                renormalize=renormalize and score != "topk_softmax", storage=storage, transposed=transposed,
                dispatch=dispatch, router_transposed=router_transposed, shared=shared)
    _check_rebuilt(spec, torch.float32, seed)


@pytest.mark.parametrize("name", ["einsum_softmax", "grouped_scaled_shared", "list_fused_gate_up"])
def test_rebuilt_blocks_compile_to_one_graph_with_router_and_experts(name):
    spec = SPECS[name]
    block = GeneratedMoE(spec).eval()
    x = _tokens(spec, torch.float32)
    ref = _run(block, x)
    ep_fuse.prepare(block, strict=True)
    torch._dynamo.reset()
    ep_fuse.reset_reports()
    with torch.no_grad():
        out = torch.compile(block, backend="ep_fuse", options=REFERENCE)(x.clone())
    assert len(ep_fuse.reports()) == 1
    counts = ep_fuse.last_report().counts()
    assert counts.get("moe_experts") == 1 and counts.get("moe_gating") == 1, counts
    assert counts.get("gemm_swiglu", 0) == int(spec.shared), counts
    assert _rel(out, ref) <= 1e-5


def test_the_state_dict_keeps_the_stacked_keys_and_loads_back():
    spec = SPECS["grouped_scaled_shared"]
    source, block = GeneratedMoE(spec, seed=1).eval(), GeneratedMoE(spec, seed=0).eval()
    x = _tokens(spec, torch.float32)
    state, keys = source.state_dict(), list(block.state_dict())
    convert_semantic_blocks(block, strict=True)
    assert not hasattr(block, "gate_up") and isinstance(getattr(block, EXPERTS_ATTR), torch.nn.Module)
    assert sorted(block.state_dict()) == sorted(keys), "the original keys, not the canonical ones"
    for key, value in block.state_dict().items():
        assert value.shape == GeneratedMoE(spec).state_dict()[key].shape, key
    block.load_state_dict(state)
    assert _rel(_run(block, x), _run(source, x)) <= 1e-5, "loaded through the original keys"
    for key, value in block.state_dict().items():
        assert torch.equal(value, state[key]), key
    block.to(torch.bfloat16)
    assert _run(block, x.bfloat16()).dtype == torch.bfloat16


DECLINED = {
    "input_scaled": (InputScaledMoE, "combine: no binding reproduces the block's output"),
    "unweighted": (UnweightedMoE, "combine: no binding reproduces the block's output"),
    "squared_weights": (SquaredWeightsMoE, "combine: no binding reproduces the block's output"),
    "aux_loss": (AuxLossMoE, "combine: the block returns more than its output and the router logits"),
}


@pytest.mark.parametrize("name", list(DECLINED))
def test_look_alikes_are_declined_by_the_part_that_fails(name, caplog):
    cls, reason = DECLINED[name]
    block = cls(Spec()).eval()
    x = _tokens(block.spec, torch.float32)
    ref = _run(block, x)
    state = {k: v.clone() for k, v in block.state_dict().items()}
    with caplog.at_level(logging.WARNING, logger="ep_fuse"):
        results = convert_semantic_blocks(block)
    assert len(results) == 1 and not results[0].converted and reason in results[0].reason, results
    assert reason in caplog.text
    assert "forward" not in vars(block) and not hasattr(block, EXPERTS_ATTR), "restored"
    assert block.state_dict().keys() == state.keys() and all(torch.equal(v, state[k])
                                                             for k, v in block.state_dict().items())
    got = _run(block, x)
    assert torch.equal(got[0] if isinstance(got, tuple) else got, ref[0] if isinstance(ref, tuple) else ref)
    with pytest.raises(ValueError, match="strict=True"):
        convert_semantic_blocks(block, strict=True)


def test_a_router_that_reads_more_than_its_weight_is_declined_as_router():
    """Top-k of logits plus a per-token noise the rebuilt router cannot compute: declined at the router."""

    class NoisyRouter(GeneratedMoE):
        def _route(self, x):
            weights, ids = super()._route(x + 0.5 * torch.sin(x * 7))
            return weights, ids

    block = NoisyRouter(Spec()).eval()
    results = convert_semantic_blocks(block)
    assert results and results[0].part == "router", results


def test_modules_of_transformers_and_blocks_without_a_router_are_not_candidates():
    class NoRouter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = torch.nn.Parameter(torch.randn(4, 8, 16))
            self.w2 = torch.nn.Parameter(torch.randn(4, 16, 8))

        def forward(self, x):
            return x

    assert convert_semantic_blocks(NoRouter()) == []


def test_zero_rows_tie_every_score_and_still_prove():
    spec = dataclasses.replace(SPECS["dense_sigmoid_bias"], bias=False)
    block = GeneratedMoE(spec).eval()
    x = _tokens(spec, torch.float32)
    x[0] = 0.0
    ref = _run(block, x)
    assert convert_semantic_blocks(block, strict=True)[0].converted
    assert _rel(_run(block, x), ref) <= 1e-5


def test_expert_shaped_parameters_without_a_top_k_are_left_quietly(caplog):
    """Two 3-D parameters with a common leading dim and an [E, H] matrix, but no top-k: no MoE block, no WARNING."""

    class ConvLike(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = torch.nn.Parameter(torch.randn(4, 16, 8))
            self.w2 = torch.nn.Parameter(torch.randn(4, 8, 16))
            self.mix = torch.nn.Parameter(torch.randn(4, 8))

        def forward(self, x):
            return x + (x @ self.mix.t()).softmax(-1) @ self.mix

    block = ConvLike().eval()
    with caplog.at_level(logging.DEBUG, logger="ep_fuse"):
        results = convert_semantic_blocks(block, strict=True)
    assert len(results) == 1 and not results[0].converted and results[0].part == "router", results
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "is not a routed MoE block" in caplog.text and "forward" not in vars(block)

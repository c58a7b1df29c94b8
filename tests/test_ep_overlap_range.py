"""``two_batch`` over a decoder-layer range (``ep_fuse/passes/ep_overlap.py``, ``find_range`` / ``_range_split``):
the tokens of every layer from the first EP block's layer input to the last combine are split along the batch into
two micro-batches whose dispatch/combine run under the other micro-batch's attention and experts.

Gloo processes (``support/dist_harness.py``): a hand-written decoder (``support/decoder_modules.py``: attention,
norms, a biased router, the canonical experts) and tiny HF Qwen3-MoE / Qwen2-MoE models at batch >= 2, every rank
equal to the unsharded model; op counts, the order of the start/wait pairs around the attentions and experts,
uneven routing, a rank with no routed tokens, a capacity, an attention-mask input; and the declines (batch 1,
packed sequences, a step that mixes the batch, a failing analysis), each back to per-block ``two_batch``.
"""

from __future__ import annotations

import copy
import operator

import torch
import torch.distributed as dist

import ep_fuse
from support.dist_harness import rank_tests
from support.overlap_graphs import OPS, OverlapGraphs, counts, positions

F32 = torch.float32
TIMEOUT_S = 60.0


# =========================================================================== helpers (run in the workers)
def _two_batch(blocks):
    """Two start/wait pairs (dispatch, combine) per micro-batch per EP block."""
    return {op: (2 * blocks if op.endswith(("_start", "_wait")) else 0) for op in OPS}


def _close(out, ref, tol=1e-4):
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * max(ref.abs().max().item(), 1e-3))


def _check_range_order(order, layers=2):
    """Per layer k, micro-batches 0 and 1: mb0's dispatch under mb1's attention, mb1's dispatch under mb0's experts,
    mb0's combine under mb1's experts, mb1's combine waited after mb0's next-layer attention."""
    ops = torch.ops.ep_fuse
    attn = positions(order, lambda t: "scaled_dot_product" in str(t))
    ds, dw = (positions(order, lambda t, op=op: t is op.default) for op in (ops.ep_dispatch_start, ops.ep_dispatch_wait))
    cs, cw = (positions(order, lambda t, op=op: t is op.default) for op in (ops.ep_combine_start, ops.ep_combine_wait))
    ex = positions(order, lambda t: t is ops.moe_experts.default)
    assert len(attn) == len(ds) == len(dw) == len(cs) == len(cw) == len(ex) == 2 * layers, (attn, ds, ex)
    for k in range(layers):
        i0, i1 = 2 * k, 2 * k + 1
        assert ds[i0] < attn[i1] < dw[i0], ("d0 not under mb1's attention", k, ds, attn, dw)
        assert ds[i1] < ex[i0] < dw[i1], ("d1 not under mb0's experts", k, ds, ex, dw)
        assert cs[i0] < ex[i1] < cw[i0], ("c0 not under mb1's experts", k, cs, ex, cw)
        if k + 1 < layers:
            assert cs[i1] < attn[i1 + 1] < cw[i1], ("c1 not waited after mb0's next attention", k, cs, attn, cw)


def _decoder(world, *, batch=4, seq=6, layers=2, bias=None, mask=False, capacity=None, executor="eager",
             mix_batch=False, seed=0, batches=None):
    """Compile the sharded decoder with two_batch; returns (report, graphs) after checking it equals the full one.
    ``batches``: a batch size per rank (with a capacity)."""
    from support.decoder_modules import TinyDecoder

    from ep_fuse.ops.ep import pending_async

    e = 2 * world
    full = TinyDecoder(e, layers=layers, mix_batch=mix_batch)
    if bias is not None:
        for layer in full.layers:
            layer.router_bias.copy_(bias)
    g = torch.Generator().manual_seed(100 + 7 * dist.get_rank() + seed)
    batch = batch if batches is None else batches[dist.get_rank()]
    h = torch.randn(batch, seq, 32, generator=g)
    args = [h]
    if mask:  # padding: sequence i keeps its first seq - i tokens (and causal order)
        keep = torch.arange(seq)[None, :] < (seq - torch.arange(batch) % seq)[:, None]
        args.append((torch.ones(seq, seq, dtype=torch.bool).tril() & keep[:, None, :])[:, None])
    with torch.no_grad():
        ref = full(*args)
    model = ep_fuse.shard_experts(copy.deepcopy(full))
    opts = ep_fuse.ep_options(model, engine="all_to_all", capacity=capacity, timeout_s=TIMEOUT_S)
    torch._dynamo.reset()
    with OverlapGraphs() as order, torch.no_grad():
        out = torch.compile(model, backend="ep_fuse", options={
            "executor": executor, "providers": {"cpu": ["reference"]}, "ep_overlap": "two_batch", **opts})(*args)
    _close(out, ref)
    assert pending_async() == 0
    return ep_fuse.last_report(), order.graphs


def _assert_split(rep, batch, layers=2):
    b0 = batch // 2
    assert [e.overlap for e in rep.ep] == ["two_batch"] * layers, [(e.overlap, e.overlap_reason) for e in rep.ep]
    for e in rep.ep:
        assert e.range_split.startswith(f"layers L0-L{layers - 1}, batch {batch} = {b0} + {batch - b0}"), e.range_split
    assert counts(rep) == _two_batch(layers), counts(rep)
    text = rep.schedule()
    assert "L0 d0 under mb1 attention L0" in text and "L0 c1 under mb0 attention L1" in text, text
    assert f"L{layers - 1} c1 under nothing" in text, text


def _assert_declined(rep, reason, layers=2):
    """Declined with ``reason``: per-block two_batch (the range untouched, each block split by itself)."""
    for e in rep.ep:
        assert e.range_split.startswith("declined: ") and reason in e.range_split, e.range_split
        assert e.overlap == "two_batch" and e.schedule[1] == "dispatch start mb0", (e.overlap, e.schedule)
    assert counts(rep) == _two_batch(layers), counts(rep)


# =========================================================================== scenarios
def sc_decoder_eager(world):
    """Batch 4 (2 + 2) and batch 3 (1 + 2): equal to the full decoder, the counts and the interleaved order."""
    for batch in (4, 3):
        rep, graphs = _decoder(world, batch=batch, seed=batch)
        _assert_split(rep, batch)
        _check_range_order(graphs[-1])
        assert rep.ops_after.get("ep_fuse.moe_permute.default") == 4  # each block's experts twice


def sc_decoder_three_layers(world):
    """Three layers: the middle one's transfers overlap both neighbours' micro-batches."""
    rep, graphs = _decoder(world, batch=2, layers=3)
    _assert_split(rep, 2, layers=3)
    _check_range_order(graphs[-1], layers=3)


def sc_uneven_and_empty_rank(world):
    """Uneven routing (most slots to one expert), and no routed token at all for the last rank (its experts
    biased away), data-dependent and with a capacity."""
    e = 2 * world
    uneven = torch.zeros(e)
    uneven[0] = 2.0
    empty = torch.zeros(e)
    empty[-2:] = -30.0  # the last rank's two experts never win the top-2
    for bias, cap in ((uneven, None), (empty, None), (empty, 4 * 6)):
        rep, graphs = _decoder(world, bias=bias, capacity=cap)
        _assert_split(rep, 4)
        _check_range_order(graphs[-1])


def sc_capacity(world):
    """With ``ep_capacity`` C each micro-batch gets ceil(C/2) (as per block): batch 3 at C = 24 splits 1 + 2
    sequences of 6; at C = 18 the 12 tokens of micro-batch 1 do not fit, so the range declines. Ranks of different
    batches (2, and 1 which declines) issue the same collectives either way."""
    rep, graphs = _decoder(world, batch=3, capacity=24)
    _assert_split(rep, 3)
    _check_range_order(graphs[-1])
    rep, _ = _decoder(world, batch=3, capacity=18)
    _assert_declined(rep, "exceeds half the capacity 18")
    batches = [2, 1] + [2] * (world - 2)
    rep, _ = _decoder(world, seq=8, capacity=16, batches=batches)
    if batches[dist.get_rank()] == 2:
        _assert_split(rep, 2)
    else:
        _assert_declined(rep, "batch 1")


def sc_mask_input(world):
    """A boolean [B, 1, S, S] attention mask passed in: cut per micro-batch with the hidden states."""
    rep, graphs = _decoder(world, batch=4, mask=True, seed=2)
    _assert_split(rep, 4)
    _check_range_order(graphs[-1])


def sc_batch_one_declines(world):
    """Batch 1: nothing to split along the batch; per-block two_batch splits each block's tokens instead."""
    rep, _ = _decoder(world, batch=1, seq=8)
    _assert_declined(rep, "batch 1")


def sc_mixed_batch_declines(world):
    """A step that reads across sequences (a mean over the batch) is never split."""
    rep, _ = _decoder(world, mix_batch=True)
    _assert_declined(rep, "works along dim 0")


def sc_failed_analysis_declines(world):
    """An analysis that raises before the rewrite leaves the graph as it was: per-block two_batch, one warning."""
    from ep_fuse.passes import ep_layer_range

    def broken(*_args, **_kwargs):
        raise RuntimeError("injected")

    saved = ep_layer_range.slice_spec
    ep_layer_range.slice_spec = broken  # (a spawned rank: no monkeypatch fixture there)
    try:
        rep, _ = _decoder(world)
    finally:
        ep_layer_range.slice_spec = saved
    _assert_declined(rep, "analysis failed: RuntimeError: injected")


def sc_failed_rewrite_restores(world):
    """A rewrite that raises after it changed the graph: the copy taken before goes back (one warning), per-block
    two_batch, results still equal."""
    from ep_fuse.passes import ep_overlap

    def broken(*_args, **_kwargs):
        raise RuntimeError("injected")

    saved = ep_overlap.EpOverlap.__dict__["_range_schedule"]  # the staticmethod itself
    ep_overlap.EpOverlap._range_schedule = staticmethod(broken)
    try:
        rep, _ = _decoder(world, batch=2)
    finally:
        ep_overlap.EpOverlap._range_schedule = saved
    _assert_declined(rep, "the rewrite failed (RuntimeError: injected); the graph was put back")


def sc_inductor(world):
    """The Inductor executor runs the split range (batch 2)."""
    rep, _ = _decoder(world, batch=2, executor="inductor")
    _assert_split(rep, 2)


def _hf(world, name, batch, seq=8, executor="eager", packed=False):
    from ep_fuse.testing import tiny as tiny_models

    model = tiny_models.build(name, dtype=F32)
    inputs = tiny_models.example_inputs(batch=batch, seq=seq, seed=dist.get_rank())
    if packed:  # two sequences packed in one row: positions restart (HF masks across the boundary)
        half = seq // 2
        inputs["position_ids"] = torch.cat([torch.arange(half), torch.arange(seq - half)])[None]
    with torch.no_grad():
        ref = model(**inputs).logits
    ep_fuse.shard_experts(model)
    torch._dynamo.reset()
    opts = ep_fuse.ep_options(model, engine="all_to_all", timeout_s=TIMEOUT_S)
    options = {"executor": executor, "providers": {"cpu": ["reference"]}, "ep_overlap": "two_batch", **opts}
    with OverlapGraphs() as order, torch.no_grad():
        out = torch.compile(model, backend="ep_fuse", options=options)(**inputs).logits
    _close(out, ref)
    return ep_fuse.last_report(), order.graphs


def sc_hf_qwen3_moe(world):
    """Tiny HF Qwen3-MoE at batch 2 (q/k norms, RoPE, SDPA with its mask): the range split, equal logits; packed
    sequences in one row ([1, T], restarting positions) decline to per-block two_batch."""
    rep, graphs = _hf(world, "qwen3_moe", batch=2)
    _assert_split(rep, 2)
    _check_range_order(graphs[-1])
    rep, _ = _hf(world, "qwen3_moe", batch=1, seq=16, packed=True)
    _assert_declined(rep, "packed / varlen")


def sc_hf_qwen2_moe_batch3(world):
    """Tiny HF Qwen2-MoE (shared experts and their gate) at batch 3: 1 + 2 sequences."""
    rep, graphs = _hf(world, "qwen2_moe", batch=3)
    _assert_split(rep, 3)
    _check_range_order(graphs[-1])


def sc_hf_inductor(world):
    """Tiny HF Qwen3-MoE through Inductor."""
    rep, _ = _hf(world, "qwen3_moe", batch=2, executor="inductor")
    _assert_split(rep, 2)


SCENARIOS_2 = [sc_decoder_eager, sc_decoder_three_layers, sc_uneven_and_empty_rank, sc_capacity, sc_mask_input,
               sc_batch_one_declines, sc_mixed_batch_declines, sc_failed_analysis_declines,
               sc_failed_rewrite_restores, sc_hf_qwen3_moe]
SLOW_2 = [sc_inductor, sc_hf_qwen2_moe_batch3, sc_hf_inductor]
"""Inductor compiles and the second HF model: minutes on two shared cores (``-m slow``)."""
SCENARIOS_4 = [sc_decoder_eager, sc_uneven_and_empty_rank, sc_capacity]


# =========================================================================== process management
rg2, test_two_ranks = rank_tests("rg2", 2, SCENARIOS_2)
rg2_slow, test_two_ranks_slow = rank_tests("rg2_slow", 2, SLOW_2, slow=True)
rg4, test_four_ranks = rank_tests("rg4", 4, SCENARIOS_4, slow=True)


# =========================================================================== single process
def test_batch_rows_and_batch_dim_use():
    """The batch role of a value, and the steps that work along the batch dim."""
    from ep_fuse.passes import ep_layer_range

    t = torch.empty
    assert ep_layer_range.batch_rows(t(4, 6, 32, device="meta"), 4, 6, 2) == 2
    assert ep_layer_range.batch_rows(t(24, 32, device="meta"), 4, 6, 2) == 12
    assert ep_layer_range.batch_rows(t(1, 6, 32, device="meta"), 4, 6, 2) is None
    assert ep_layer_range.batch_rows(t((), device="meta"), 4, 6, 2) is None
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = t(4, 6, 32, device="meta")
    aten = torch.ops.aten
    calls = {
        "mean0": g.call_function(aten.mean.dim, (x, [0], True)),
        "mean_last": g.call_function(aten.mean.dim, (x, [-1], True)),
        "t01": g.call_function(aten.transpose.int, (x, 0, 1)),
        "t12": g.call_function(aten.transpose.int, (x, 1, 2)),
        "perm_keep": g.call_function(aten.permute.default, (x, [0, 2, 1])),
        "perm_move": g.call_function(aten.permute.default, (x, [1, 0, 2])),
        "index0": g.call_function(aten.index.Tensor, (x, [x])),
        "index1": g.call_function(aten.index.Tensor, (x, [None, x])),
        "cat0": g.call_function(aten.cat.default, ([x, x], 0)),
        "cat_last": g.call_function(aten.cat.default, ([x, x], -1)),
        "roll_flat": g.call_function(aten.roll.default, (x, [1])),
        "roll_last": g.call_function(aten.roll.default, (x, [1], [-1])),
        "flatten": g.call_function(aten.flatten.using_ints, (x,)),  # start_dim 0 by default
        "strided": g.call_function(aten.as_strided.default, (x, [4, 6], [1, 4])),
        "getitem": g.call_function(operator.getitem, (x, 0)),
        "python": g.call_function(operator.add, (x, x)),
    }
    declined = {k for k, n in calls.items() if ep_layer_range.batch_dim_use(n) is not None}
    assert declined == {"mean0", "t01", "perm_move", "index0", "cat0", "roll_flat", "flatten", "strided",
                        "python"}, declined

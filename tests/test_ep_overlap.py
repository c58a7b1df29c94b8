"""EP overlap (``ep_overlap``, ``ep_fuse/passes/ep_overlap.py``): every rank equals the unsharded model in each mode.

Gloo processes (``support/dist_harness.py``), as ``tests/test_ep.py``: a block with a shared expert (the work
independent of the routed tokens), uneven and -1 routings, a rank with no tokens, data-dependent sizes and a
capacity, the eager and Inductor executors, a tiny HF Qwen2-MoE (shared experts), the DeepEP double; op counts and
the order of the start/wait pairs around the shared-expert GEMMs in the rewritten graph.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.distributed as dist

import ep_fuse
from ep_fuse.config import ConfigError, EpFuseConfig
from support.dist_harness import rank_tests
from support.overlap_graphs import OPS, OverlapGraphs, counts, positions

F32 = torch.float32
BF16 = torch.bfloat16
TIMEOUT_S = 60.0


# =========================================================================== helpers (run in the workers)
class SharedBlock(torch.nn.Module):
    """The canonical routed block plus a shared SwiGLU expert on the same tokens (independent of the routing)."""

    def __init__(self, num_experts: int, hidden: int = 32, inter: int = 16, shared: int = 24,
                 dtype: torch.dtype = F32) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.num_experts = num_experts
        self.w13 = torch.nn.Parameter((torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype))
        self.w2 = torch.nn.Parameter((torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5).to(dtype))
        self.gate_up = torch.nn.Parameter((torch.randn(2 * shared, hidden, generator=g) / hidden**0.5).to(dtype))
        self.down = torch.nn.Parameter((torch.randn(hidden, shared, generator=g) / shared**0.5).to(dtype))

    def forward(self, x, topk_ids, topk_weights):
        routed = torch.ops.ep_fuse.moe_experts(x, topk_ids, topk_weights, self.w13, self.w2, None)
        gate, up = torch.nn.functional.linear(x, self.gate_up).chunk(2, dim=-1)
        shared = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, self.down)
        return routed + shared


def _routing(t, e, k, seed, invalid=0.0, dtype=F32, hidden=32, skew=False):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(t, e, generator=g)
    if skew:  # uneven: most slots go to the last rank's experts
        scores[:, -(e // max(dist.get_world_size(), 1)):] += 2.0
    w, ids = scores.softmax(-1).topk(k)
    if invalid:
        ids = torch.where(torch.rand(t, k, generator=g) < invalid, -1, ids)
    return torch.randn(t, hidden, generator=g).to(dtype), ids, w.to(dtype)


def _compile(model, **options):
    opts = {"executor": "eager", "providers": {"cpu": ["reference"]}, **options}
    return torch.compile(model, backend="ep_fuse", options=opts)


def _close(out, ref, tol):
    out, ref = out.float(), ref.float()
    if ref.numel() == 0:  # a rank without tokens
        assert out.shape == ref.shape, (out.shape, ref.shape)
        return
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol * max(ref.abs().max().item(), 1e-3))


EXPECT = {
    "none": {"ep_dispatch": 1, "ep_combine": 1},
    "shared": {"ep_dispatch_start": 1, "ep_dispatch_wait": 1, "ep_combine_start": 1, "ep_combine_wait": 1},
    "two_batch": {"ep_dispatch_start": 2, "ep_dispatch_wait": 2, "ep_combine_start": 2, "ep_combine_wait": 2},
}


def _expected(mode, blocks=1):
    return {op: EXPECT[mode].get(op, 0) * blocks for op in OPS}


def _check_shared_order(order):
    """start < a shared GEMM < wait, for the dispatch and for the combine; experts between the two pairs."""
    ops, aten = torch.ops.ep_fuse, torch.ops.aten
    gemms = sorted(i for t in (aten.mm.default, aten.addmm.default, ops.gemm_swiglu.default)
                   for i in positions(order, t))
    (ds,), (dw,) = positions(order, ops.ep_dispatch_start.default), positions(order, ops.ep_dispatch_wait.default)
    (cs,), (cw,) = positions(order, ops.ep_combine_start.default), positions(order, ops.ep_combine_wait.default)
    (ex,) = positions(order, ops.moe_experts.default)
    assert ds < dw < ex < cs < cw, (ds, dw, ex, cs, cw)
    assert any(ds < g < dw for g in gemms), ("no shared GEMM under the dispatch", gemms, ds, dw)
    assert any(cs < g < cw for g in gemms), ("no shared GEMM under the combine", gemms, cs, cw)


def _block_case(world, mode, *, capacity=None, executor="eager", t=12, seed=0, invalid=0.2, skew=False,
                backend="all_to_all", dtype=F32, hidden=32, tol=None, x_tokens=None, rules=()):
    from ep_fuse.ops.ep import pending_async

    e = 2 * world
    full = SharedBlock(e, hidden=hidden, dtype=dtype)
    rank = dist.get_rank()
    t = t if x_tokens is None else x_tokens[rank]
    x, ids, w = _routing(t, e, 2, seed=100 + 7 * rank + seed, invalid=invalid, dtype=dtype, hidden=hidden, skew=skew)
    with torch.no_grad():
        ref = full(x, ids, w)
    model = ep_fuse.shard_experts(copy.deepcopy(full))
    opts = ep_fuse.ep_options(model, engine=backend, capacity=capacity, timeout_s=TIMEOUT_S)
    torch._dynamo.reset()
    with OverlapGraphs() as order, torch.no_grad():
        out = _compile(model, executor=executor, ep_overlap=mode, ep_overlap_rules=list(rules), **opts)(x, ids, w)
    rep = ep_fuse.last_report()
    _close(out, ref, tol or (1e-4 if dtype == F32 else 3e-2))
    assert pending_async() == 0
    return rep, order.graphs


# =========================================================================== scenarios
def sc_modes_eager(world):
    """Every mode, data-dependent and capacity sizes, -1 slots, uneven routing: equal to the full block."""
    for cap, mode in [(None, "none"), *((c, m) for c in (None, 12) for m in ("shared", "two_batch", "auto"))]:
        rep, graphs = _block_case(world, mode, capacity=cap, skew=cap is None, seed=len(mode))
        (rec,) = rep.ep
        want = "none" if mode == "auto" else mode
        assert rec.overlap == want, (mode, rec)
        assert counts(rep) == _expected(want), (mode, cap, counts(rep))
        if mode == "shared":
            _check_shared_order(graphs[-1])
            assert any(s.startswith("under dispatch: ") and s != "under dispatch: nothing" for s in rec.schedule)
        if mode == "two_batch":
            assert rec.schedule[0].startswith("micro-batches of 6 + 6"), rec.schedule
            assert rep.ops_after.get("ep_fuse.moe_permute.default") == 2  # the local block twice
        if mode == "auto":
            assert "no measured overlap rule" in rec.overlap_reason, rec


def sc_cli_schedule(world):
    """The schedule is in the dump's report.json and ``ep-fuse diff DIR`` prints it."""
    import contextlib
    import io
    import tempfile

    from ep_fuse import cli

    folder = tempfile.mkdtemp(prefix=f"ep_overlap_dump{dist.get_rank()}_")
    e = 2 * world
    full = SharedBlock(e)
    x, ids, w = _routing(8, e, 2, seed=dist.get_rank())
    model = ep_fuse.shard_experts(copy.deepcopy(full))
    with torch.no_grad():
        _compile(model, ep_overlap="shared", dump_dir=folder, **ep_fuse.ep_options(model, timeout_s=TIMEOUT_S))(x, ids, w)
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        assert cli.main(["diff", folder]) == 0
    out = text.getvalue()
    assert "overlap shared" in out and "under dispatch: " in out and "under combine: " in out, out
    assert "ep_overlap" in out, out  # the pass's op-count delta


def sc_zero_and_one_token(world):
    """Capacity mode with a rank of 0 tokens and one of 1 token (its second micro-batch is empty): every rank
    issues the same collectives and the results stay exact."""
    tokens = [0, 1] + [5] * (world - 2)
    for mode in ("shared", "two_batch"):
        rep, _ = _block_case(world, mode, capacity=8, x_tokens=tokens, invalid=0.0)
        assert rep.ep[0].overlap == mode, rep.ep[0]
        assert counts(rep) == _expected(mode)


def sc_two_batch_falls_back(world):
    """A micro-batch that would be empty everywhere (capacity 1) stays one batch, with the shared overlap."""
    rep, _ = _block_case(world, "two_batch", capacity=1, t=1, invalid=0.0)
    (rec,) = rep.ep
    assert rec.overlap == "shared" and "empty" in rec.overlap_reason, rec
    assert counts(rep) == _expected("shared")


def sc_inductor(world):
    """The Inductor executor: shared with data-dependent sizes, two_batch with a capacity."""
    for cap, mode in ((None, "shared"), (12, "two_batch")):
        rep, _ = _block_case(world, mode, capacity=cap, executor="inductor", seed=3)
        assert rep.ep[0].overlap == mode and counts(rep) == _expected(mode), counts(rep)


def sc_auto_rule(world):
    """``auto`` follows a rule when one exists: from its token count on, below it ``none``."""
    from ep_fuse.passes import ep_overlap
    from ep_fuse.providers.measured import Threshold

    rule = ep_overlap.OverlapRule("cpu", "all_to_all", "two_batch",
                                  Threshold(8, evidence="test rule", command="tests/test_ep_overlap.py"))
    rep, _ = _block_case(world, "auto", t=12, rules=[rule])
    assert rep.ep[0].overlap == "two_batch" and "test rule" in rep.ep[0].overlap_reason
    assert counts(rep) == _expected("two_batch")
    rep, _ = _block_case(world, "auto", t=4, rules=[rule])
    assert rep.ep[0].overlap == "none" and counts(rep) == _expected("none")
    rep, _ = _block_case(world, "auto", t=12)  # the rule is the option's: without it, none
    assert rep.ep[0].overlap == "none" and counts(rep) == _expected("none")


def sc_sync_engine(world):
    """An engine without an async form keeps the synchronous ops (no overlap), and the record says why."""
    from ep_fuse.ops import ep as ep_ops

    saved = ep_ops._ASYNC.pop("all_to_all")
    try:
        rep, _ = _block_case(world, "shared")
        assert rep.ep[0].overlap == "none" and "no async form" in rep.ep[0].overlap_reason
        assert counts(rep) == _expected("none")
    finally:
        ep_ops._ASYNC["all_to_all"] = saved


def sc_no_independent_work(world):
    """``shared`` on a block with nothing independent of the routing: left as it is."""
    from test_ep import CanonicalBlock

    e = 2 * world
    full = CanonicalBlock(e, out_dtype=None)
    x, ids, w = _routing(8, e, 2, seed=dist.get_rank(), dtype=BF16)
    model = ep_fuse.shard_experts(copy.deepcopy(full))
    with torch.no_grad():
        ref = full(x, ids, w)
        out = _compile(model, ep_overlap="shared", **ep_fuse.ep_options(model, timeout_s=TIMEOUT_S))(x, ids, w)
    rep = ep_fuse.last_report()
    assert rep.ep[0].overlap == "none" and "no work independent" in rep.ep[0].overlap_reason
    assert counts(rep) == _expected("none")
    _close(out, ref, 1e-5)


def sc_hf_qwen2_moe(world):
    """A tiny HF Qwen2-MoE (shared experts, two MoE layers): logits equal to the unsharded model per mode."""
    from ep_fuse.testing import tiny as tiny_models

    model = tiny_models.build("qwen2_moe", dtype=F32)
    inputs = tiny_models.example_inputs(batch=2, seq=8, seed=dist.get_rank())
    with torch.no_grad():
        ref = model(**inputs).logits
    ep_fuse.shard_experts(model)
    for mode in ("shared", "two_batch"):
        torch._dynamo.reset()
        opts = ep_fuse.ep_options(model, engine="all_to_all", timeout_s=TIMEOUT_S)
        with torch.no_grad():
            out = _compile(model, ep_overlap=mode, **opts)(**inputs).logits
        rep = ep_fuse.last_report()
        assert [e.overlap for e in rep.ep] == [mode, mode], [(e.overlap, e.overlap_reason) for e in rep.ep]
        assert counts(rep) == _expected(mode, blocks=2), counts(rep)
        assert "EP overlap" in rep.summary()
        if mode == "two_batch":  # batch 2: the whole layer range splits (tests/test_ep_overlap_range.py)
            assert all(e.range_split.startswith("layers L0-L1") for e in rep.ep), [e.range_split for e in rep.ep]
            assert "L0 c1 under mb0 attention L1" in rep.schedule(), rep.schedule()
        else:
            assert "dispatch start" in rep.schedule()
        _close(out, ref, 1e-4)


def sc_deepep_double(world):
    """DeepEP normal (async_finish + events) and low-latency (receive hooks) through the test double."""
    from support import deepep_double

    from ep_fuse.ep import deepep, handles

    sys.modules["deep_ep"] = deepep_double.make_module()
    deepep.available.cache_clear()
    deepep._BUFFERS.clear()
    try:
        for cap in (None, 12):
            for mode in ("shared", "two_batch"):
                rep, _ = _block_case(world, mode, capacity=cap, backend="deepep", dtype=BF16, seed=5)
                assert rep.ep[0].engine == "deepep" and rep.ep[0].overlap == mode
                assert counts(rep) == _expected(mode)
        rep, _ = _block_case(world, "shared", capacity=16, backend="deepep_low_latency", dtype=BF16, hidden=2048)
        assert rep.ep[0].engine == "deepep_low_latency" and rep.ep[0].overlap == "shared"
        rep, _ = _block_case(world, "two_batch", capacity=16, backend="deepep_low_latency", dtype=BF16, hidden=2048)
        assert rep.ep[0].overlap == "shared" and "low-latency" in rep.ep[0].overlap_reason
        assert handles.pending() == 0
    finally:
        deepep.destroy_buffers()
        sys.modules.pop("deep_ep", None)
        deepep.available.cache_clear()


SCENARIOS_2 = [sc_modes_eager, sc_cli_schedule, sc_zero_and_one_token, sc_two_batch_falls_back, sc_auto_rule,
               sc_sync_engine, sc_no_independent_work]
SLOW_2 = [sc_inductor, sc_hf_qwen2_moe, sc_deepep_double]
"""Inductor compiles, the HF model and the DeepEP double: minutes on two shared cores (``-m slow``)."""
SCENARIOS_4 = [sc_modes_eager, sc_zero_and_one_token]


# =========================================================================== process management
ov2, test_two_ranks = rank_tests("ov2", 2, SCENARIOS_2)
ov2_slow, test_two_ranks_slow = rank_tests("ov2_slow", 2, SLOW_2, slow=True)
ov4, test_four_ranks = rank_tests("ov4", 4, SCENARIOS_4, slow=True)


# =========================================================================== single process
def test_option_validates():
    assert EpFuseConfig.from_options({"ep_overlap": "two_batch"}).ep_overlap == "two_batch"
    assert EpFuseConfig.from_options({}).ep_overlap == "none"
    with pytest.raises(ConfigError, match="Did you mean 'shared'"):
        EpFuseConfig.from_options({"ep_overlap": "sharde"})


def test_split_by_cost_puts_about_half_under_the_dispatch():
    """The first GEMM (2/3 of the cost) under the dispatch, the second under the combine."""
    from ep_fuse.passes import ep_blocks

    g = torch.fx.Graph()
    x = g.placeholder("x")
    w1, w2 = g.placeholder("w1"), g.placeholder("w2")
    a = g.call_function(torch.ops.aten.mm.default, (x, w1))
    s = g.call_function(torch.ops.aten.silu.default, (a,))
    b = g.call_function(torch.ops.aten.mm.default, (s, w2))
    for n, shape in ((x, (4, 8)), (w1, (8, 16)), (w2, (16, 8)), (a, (4, 16)), (s, (4, 16)), (b, (4, 8))):
        n.meta["val"] = torch.empty(shape, device="meta")
    first, rest = ep_blocks.split_by_cost([a, s, b])
    assert first == [a] and rest == [s, b]
    assert ep_blocks.split_by_cost([s]) == ([s], [])


def test_no_process_group_no_overlap_nodes():
    """Without EP (one process) the overlap option changes nothing."""
    from test_ep import CanonicalBlock

    model = CanonicalBlock(4, out_dtype=None)
    x, ids, w = _routing(6, 4, 2, seed=0, dtype=BF16) if dist.is_initialized() else (
        torch.randn(6, 32).to(BF16), torch.randint(0, 4, (6, 2)), torch.rand(6, 2))
    with torch.no_grad():
        ref = model(x, ids, w)
        out = _compile(model, ep=True, ep_overlap="two_batch")(x, ids, w)
    rep = ep_fuse.last_report()
    assert counts(rep) == {op: 0 for op in OPS}
    assert torch.equal(out, ref)

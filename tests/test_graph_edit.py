"""``ep_fuse/passes/graph_edit.py``: the shared graph edits keep values, source metadata, matches and EP records."""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

from ep_fuse.config import EpFuseConfig
from ep_fuse.fx_utils import copy_graph, source_meta
from ep_fuse.passes import graph_edit
from ep_fuse.passes.base import PassContext
from ep_fuse.report import EpRecord, GraphReport

aten = torch.ops.aten


def _graph():
    """``relu(x) + 1`` as an ATen graph with fake values and source metadata on every call."""
    g = fx.Graph()
    x = g.placeholder("x")
    r = g.call_function(aten.relu.default, (x,))
    a = g.call_function(aten.add.Tensor, (r, 1))
    g.output(a)
    gm = fx.GraphModule(torch.nn.Module(), g)
    mode = FakeTensorMode()
    with mode:
        x.meta["val"] = torch.empty(4, 8)
        r.meta["val"] = torch.empty(4, 8)
        a.meta["val"] = torch.empty(4, 8)
    for n in (r, a):
        n.meta["nn_module_stack"] = {"L__self___mlp": ("mlp", torch.nn.Module)}
        n.meta["stack_trace"] = f"model.py, line {n.name}"
    return gm, mode, x, r, a


def _ctx(mode):
    return PassContext(config=EpFuseConfig(), device="cpu", executor="eager",
                       report=GraphReport(graph="0", device="cpu", executor="eager"), fake_mode=mode)


def _record(block):
    return EpRecord(block=block, module_path="mlp", engine="all_to_all", layout="rank", requested="auto",
                    num_experts=4, local_experts=2, world=2, capacity=0)


def test_replace_node_moves_uses_meta_matches_and_the_ep_record():
    gm, mode, x, r, a = _graph()
    ctx = _ctx(mode)
    rec = _record(r.name)
    graph_edit.mark_ep_block(rec, r)
    ctx.match_by_node[r.name] = ["match"]
    with gm.graph.inserting_before(r):
        new = graph_edit.call(ctx, gm, aten.abs.default, (x,))
    graph_edit.replace_node(ctx, gm, r, new)
    assert a.args[0] is new and r not in gm.graph.nodes
    assert graph_edit.ep_record(new) is rec and rec.block == new.name
    assert ctx.match_by_node == {new.name: ["match"]}
    assert source_meta(new) == {**source_meta(a), "stack_trace": f"model.py, line {r.name}"}
    gm.recompile()
    x_real = torch.randn(4, 8)
    torch.testing.assert_close(gm(x_real), x_real.abs() + 1)


def test_the_ep_record_survives_a_graph_copy():
    gm, mode, _x, r, _a = _graph()
    rec = _record(r.name)
    graph_edit.mark_ep_block(rec, r)
    copy = copy_graph(gm)
    copied = next(n for n in copy.nodes if n.name == r.name)
    assert copied is not r and graph_edit.ep_record(copied) is rec
    assert all(graph_edit.ep_record(n) is None for n in copy.nodes if n.name != r.name)


def test_set_fake_vals_fills_new_nodes_in_order_and_copy_source_meta_names_their_origin():
    gm, mode, x, r, a = _graph()
    ctx = _ctx(mode)
    with gm.graph.inserting_after(a):
        s = gm.graph.call_function(aten.split.Tensor, (a, 3, 1))
        parts = [gm.graph.call_function(operator.getitem, (s, i)) for i in range(3)]
        c = gm.graph.call_function(aten.cat.default, ([parts[2], parts[0]], 1))
    graph_edit.set_fake_vals(ctx, s, *parts, c)
    graph_edit.copy_source_meta(a, s, *parts, c)
    assert [tuple(p.meta["val"].shape) for p in parts] == [(4, 3), (4, 3), (4, 2)]
    assert tuple(c.meta["val"].shape) == (4, 5)
    assert all(source_meta(n) == source_meta(a) for n in (s, *parts, c))


def test_fake_mode_is_made_once_where_the_graph_has_none():
    ctx = _ctx(None)
    mode = graph_edit.fake_mode(ctx)
    assert isinstance(mode, FakeTensorMode) and graph_edit.fake_mode(ctx) is mode
    with mode:  # a real tensor (a weight the pass reads) mixes with fake ones
        assert (torch.ones(2) + torch.empty(2)).shape == (2,)

"""Pair: sibling canonical calls that share everything but their main input run as one op (q/k RoPE)."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from ep_fuse.fx_utils import literal_value, source_meta, val
from ep_fuse.matching import PairRule
from ep_fuse.passes.base import GraphPass, PassContext

aten = torch.ops.aten


class Pair(GraphPass):
    name = "pair"

    def __init__(self, rules: list[PairRule]):
        self.rules = rules

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> int:
        changes = 0
        for rule in self.rules:
            groups: dict[tuple[Any, ...], list[fx.Node]] = {}
            for node in gm.graph.nodes:
                if node.op == "call_function" and node.target is rule.single:
                    x = val(node.args[0])
                    key = (*(structural_key(a) for a in node.args[1:]),
                           getattr(x, "dtype", None), getattr(x, "device", None))
                    groups.setdefault(key, []).append(node)
            for nodes in groups.values():
                while len(nodes) >= 2:
                    a, b = nodes.pop(0), nodes.pop(0)
                    if _depends_on(b.args[0], a) or _depends_on(a.args[0], b):
                        continue
                    self._pair(gm, ctx, rule, a, b)
                    changes += 1
        return changes

    def _pair(self, gm: fx.GraphModule, ctx: PassContext, rule: PairRule, a: fx.Node, b: fx.Node) -> None:
        graph = gm.graph
        with graph.inserting_before(b):
            call = graph.call_function(rule.paired, (a.args[0], b.args[0], *a.args[1:]))
            outs = [graph.call_function(operator.getitem, (call, i)) for i in (0, 1)]
        call.meta.update(source_meta(a))
        if "val" in a.meta and "val" in b.meta:
            call.meta["val"] = (a.meta["val"], b.meta["val"])
            for out, old in zip(outs, (a, b)):
                out.meta["val"] = old.meta["val"]
        records = [*ctx.match_by_node.pop(a.name, []), *ctx.match_by_node.pop(b.name, [])]
        for r in records:
            r.fused_node = call.name
        ctx.match_by_node[call.name] = records
        a.replace_all_uses_with(outs[0])
        b.replace_all_uses_with(outs[1])
        graph.erase_node(a)
        graph.erase_node(b)


VIEW_OPS = {
    aten.unsqueeze.default, aten.squeeze.dim, aten.view.default, aten._unsafe_view.default, aten.slice.Tensor,
    aten.expand.default, aten.transpose.int, aten.permute.default, aten.select.int, aten.alias.default,
}


def structural_key(arg: Any) -> Any:
    """Identity of a value up to pure view ops: ``unsqueeze(c, 1)`` computed twice is one value.

    Lists (view sizes) are keyed element-wise; a size node of a dynamic-shape graph by its symbolic
    expression (two nodes computing ``s27*s52`` are one size)."""
    if isinstance(arg, (list, tuple)):
        return ("list", *(structural_key(a) for a in arg))
    if not isinstance(arg, fx.Node):
        return arg
    size = literal_value(arg)
    if isinstance(size, torch.SymInt):
        return ("sym", str(size.node.expr))
    if arg.op == "call_function" and arg.target in VIEW_OPS:
        return (arg.target, *(structural_key(a) for a in arg.args),
                tuple(sorted((k, structural_key(v)) for k, v in arg.kwargs.items())))
    return ("node", arg)


def _depends_on(node: Any, target: fx.Node, limit: int = 10000) -> bool:
    """Whether ``node`` is computed from ``target`` (a bounded walk up the inputs)."""
    if not isinstance(node, fx.Node):
        return False
    seen, stack = set(), [node]
    while stack and len(seen) < limit:
        n = stack.pop()
        if n is target:
            return True
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return False

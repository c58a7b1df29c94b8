"""The EP blocks of a graph (``ep_dispatch`` -> local block -> ``ep_combine``) and the work around them that the
overlap schedules can move: what does not depend on a block's routed tokens, and its cost (GEMM FLOPs)."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable
from typing import Any

import torch
from torch import fx

from ep_fuse.fx_utils import val
from ep_fuse.ops import ep as ep_ops
from ep_fuse.ops.registry import canonical_ops
from ep_fuse.passes.graph_edit import ep_record
from ep_fuse.report import EpRecord

aten = torch.ops.aten

GEMMS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.matmul.default, aten.linear.default,
         aten._grouped_mm.default}


@dataclasses.dataclass
class EpBlock:
    """One EP block of the graph: the dispatch, its outputs, the local nodes between, and the combine."""

    dispatch: fx.Node
    parts: dict[int, fx.Node]
    local: list[fx.Node]
    combine: fx.Node
    record: EpRecord | None


def find_blocks(graph: fx.Graph) -> list[EpBlock]:
    """Every ``ep_dispatch`` whose handle feeds one ``ep_combine``, with the nodes between them on the path and
    the record the EP pass left on the dispatch."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    blocks = []
    for d in [n for n in graph.nodes if n.target is ep_ops.ep_dispatch.op]:
        parts = {u.args[1]: u for u in d.users if u.target is operator.getitem}
        handle = parts.get(3)
        combines = [u for u in (handle.users if handle is not None else ()) if u.target is ep_ops.ep_combine.op]
        if len(combines) != 1 or len(parts) != len(d.users):
            continue
        c = combines[0]
        down = descendants(d, order[c])
        up = ancestors(c.args[0], order[d])
        local = sorted((down & up) - set(parts.values()), key=order.__getitem__)
        blocks.append(EpBlock(d, parts, local, c, ep_record(d)))
    return blocks


def descendants(node: fx.Node, limit: int | None = None) -> set[fx.Node]:
    seen, stack = set(), [node]
    order = None if limit is None else {n: i for i, n in enumerate(node.graph.nodes)}
    while stack:
        for u in stack.pop().users:
            if u not in seen and (order is None or order[u] < limit):
                seen.add(u)
                stack.append(u)
    return seen


def ancestors(node: Any, stop: int) -> set[fx.Node]:
    order = {n: i for i, n in enumerate(node.graph.nodes)} if isinstance(node, fx.Node) else {}
    seen, stack = set(), [node] if isinstance(node, fx.Node) else []
    while stack:
        n = stack.pop()
        if n in seen or order[n] <= stop:
            continue
        seen.add(n)
        stack.extend(a for a in n.all_input_nodes)
    return seen


def pure_call(node: fx.Node) -> bool:
    if node.op != "call_function" or node.is_impure():
        return False
    schema = getattr(node.target, "_schema", None)
    return not (schema is not None and schema.is_mutable)


def independent_work(block: EpBlock) -> list[fx.Node]:
    """The pure nodes after the dispatch, before the next EP dispatch, that depend neither on the block's routed
    tokens nor on anything after the dispatch but themselves: work that can run while the tokens travel."""
    graph = block.dispatch.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    start = order[block.dispatch]
    after_d = descendants(block.dispatch)
    picked: list[fx.Node] = []
    chosen: set[fx.Node] = set()
    for n in list(graph.nodes)[start + 1:]:
        if n.target is ep_ops.ep_dispatch.op or n.op == "output":
            break
        if n in after_d or not pure_call(n):
            continue
        if all(order[a] < start or a in chosen for a in n.all_input_nodes):
            picked.append(n)
            chosen.add(n)
    return picked if any(gemm_like(n) for n in picked) else []


def gemm_like(node: fx.Node) -> bool:
    """A GEMM or a fused canonical op (not an EP op): the work worth placing under a transfer."""
    return node.target in GEMMS or any(node.target is c.op for c in canonical_ops().values() if not c.engine)


def cost(node: fx.Node) -> float:
    """A GEMM-like node's multiply-adds (output elements x the first input's last dim), else 0."""
    if not gemm_like(node):
        return 0.0
    out, first = val(node), val(node.args[0]) if node.args else None
    if isinstance(out, (tuple, list)):
        out = out[0]
    if not isinstance(out, torch.Tensor) or not isinstance(first, torch.Tensor) or first.dim() == 0:
        return 0.0
    try:
        return float(out.numel()) * float(first.shape[-1])
    except Exception:  # symbolic sizes: count it, weight unknown
        return 1.0


def split_by_cost(nodes: list[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
    """``(under the dispatch, under the combine)``: in graph order, the first part up to about half the GEMM cost
    (the GEMM that crosses it included), the rest after."""
    total = sum(cost(n) for n in nodes)
    acc = 0.0
    for i, n in enumerate(nodes):
        acc += cost(n)
        if total and acc >= total / 2:
            return nodes[:i + 1], nodes[i + 1:]
    return nodes, []


def node_names(nodes: Iterable[fx.Node]) -> str:
    heavy = [n.name for n in nodes if gemm_like(n)]
    return ", ".join(heavy) if heavy else "nothing"

"""Canonicalize: replace ATen subgraphs matched by the pattern catalog with canonical ``ep_fuse`` ops."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ep_fuse.fx_utils import module_class, module_path, target_name, val
from ep_fuse.matching import Match, Mismatch, Pattern, try_match
from ep_fuse.matching.spec import apply_replacement, fake_value
from ep_fuse.passes.base import GraphPass, PassContext
from ep_fuse.passes.moe_probe import unbound_experts
from ep_fuse.report import Attempt, MatchRecord, NearMiss

log = logging.getLogger("ep_fuse.passes")
MIN_EXPLAIN_DEPTH = 3
ANCHOR_REACH = 8
"""How many ops below an anchor a failed attempt may have matched and still explain it (the deepest pattern
trees put their root about that far below their anchor: RoPE's final cast over add, mul, cast, view, stack)."""


class Canonicalize(GraphPass):
    """Walk the graph from outputs to inputs; at each node try the enabled patterns in priority order."""

    name = "canonicalize"

    def __init__(self, patterns: list[Pattern]):
        self.patterns = patterns
        self._by_root: dict[Any, list[Pattern]] = {}
        for p in patterns:
            for t in p.root_targets():
                self._by_root.setdefault(t, []).append(p)

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> int:
        graph = gm.graph
        misses: list[tuple[Pattern, Mismatch]] = []
        erased: set[fx.Node] = set()
        changes = 0
        for node in reversed(list(graph.nodes)):
            if node in erased or node.op != "call_function":
                continue
            chosen = self._choose(node, misses, ctx)
            if chosen is None:
                continue
            res, rep, value = chosen
            ctx.current = (res.pattern, node)
            record = self._record(res, ctx)
            new = apply_replacement(gm, res, rep, ctx.fake_mode, value)
            record.fused_node = new[0].name
            ctx.report.matches.append(record)
            ctx.match_by_node.setdefault(new[0].name, []).append(record)
            erased.update(res.nodes)
            changes += 1
            log.debug("ep_fuse: %s matched at %s (%s)", res.pattern.key, node.name, record.module_path)
        ctx.current = None
        ctx.report.matches.reverse()  # report in graph order
        self._near_misses(graph, misses, ctx)
        ctx.report.near_misses.extend(unbound_experts(graph, ctx.report.graph))
        return changes

    def _choose(self, node: fx.Node, misses: list[tuple[Pattern, Mismatch]], ctx: PassContext
                ) -> tuple[Match, Any, Any] | None:
        """The match to apply at ``node``: the first pattern (priority order) that matches, unless it
        would consume a node at which another family's pattern matches (a site it would destroy,
        e.g. RoPE's final ``add`` read by a q/k RMSNorm as if it were a residual add) and a later
        pattern at ``node`` matches without doing so; then that one (both fusions happen). When every
        match at ``node`` costs a site, the first is taken (nothing would be gained by declining).
        Also returns the replacement's fake output (``None`` where it was not run), reused by the rewrite."""
        first: tuple[Match, Any, Any] | None = None
        for pattern in self._by_root.get(node.target, ()):
            ctx.current = (pattern, node)
            res = try_match(pattern, node)
            if isinstance(res, Mismatch):
                misses.append((pattern, res))
                continue
            rep = pattern.build(res)
            reason, value = _same_result(res, rep, ctx.fake_mode)
            if reason:
                misses.append((pattern, Mismatch(node, reason, tuple(res.nodes))))
                continue
            taken = self._sites_taken(res)
            if not taken:
                return res, rep, value
            if first is None:
                first = (res, rep, value)
            log.debug("ep_fuse: %s at %s would consume %s; trying the next pattern", pattern.key, node.name,
                      ", ".join(f"{n.name} ({key})" for n, key in taken))
        return first

    def _sites_taken(self, m: Match) -> list[tuple[fx.Node, str]]:
        """Interior nodes of ``m`` at which a pattern of another family matches now."""
        out = []
        for n in m.nodes:
            if n is m.root or n.op != "call_function":
                continue
            for other in self._by_root.get(n.target, ()):
                if other.family != m.pattern.family and isinstance(try_match(other, n), Match):
                    out.append((n, other.key))
                    break
        return out

    def _record(self, m: Match, ctx: PassContext) -> MatchRecord:
        return MatchRecord(
            graph=ctx.report.graph,
            pattern=m.pattern.name,
            variant=m.pattern.variant,
            root=m.root.name,
            nodes=[n.name for n in m.nodes],
            module_path=module_path(m.root),
            module_class=module_class(m.root),
            fused_node="",
        )

    def _near_misses(self, graph: fx.Graph, misses: list[tuple[Pattern, Mismatch]], ctx: PassContext) -> None:
        """For every anchor op left in the graph, the deepest failure of each pattern variant that reached it."""
        for node in graph.nodes:
            if node.op != "call_function":
                continue
            names = {p.name for p in self.patterns if any(_is_anchor(a, node) for a in p.anchors)}
            if not names:
                continue
            best: dict[str, Mismatch] = {}
            below = _downstream(node, ANCHOR_REACH)
            for pattern, miss in misses:
                if pattern.name not in names:
                    continue
                # the attempt reached the anchor, failed on it, or matched (or failed at) a node computed from it
                # a few ops below: a variant rooted below the anchor that failed before reaching it still counts
                if not (node in miss.matched or miss.node is node or miss.node in below
                        or any(n in below for n in miss.matched)):
                    continue
                if pattern.key not in best or miss.depth > best[pattern.key].depth:
                    best[pattern.key] = miss
            # deepest first (the variant that came closest); ties in pattern priority order
            attempts = sorted(
                (Attempt(key, m.where(), m.reason, m.depth) for key, m in best.items()),
                key=lambda a: -a.depth,
            )
            # variants that failed on their first node or two only add noise to an explanation
            attempts = [a for a in attempts if a.depth >= MIN_EXPLAIN_DEPTH] or attempts[:1]
            note = ""
            if not attempts:
                users = ", ".join(f"{u.name} ({target_name(u.target) if u.op == 'call_function' else u.op})"
                                  for u in list(node.users)[:3]) or "none"
                note = f"no pattern of {'/'.join(sorted(names))} is rooted above it; its users: {users}"
            ctx.report.near_misses.append(
                NearMiss(ctx.report.graph, node.name, target_name(node.target), module_path(node), attempts, note,
                         sorted(names))
            )


def _downstream(node: fx.Node, hops: int) -> set[fx.Node]:
    """The nodes computed from ``node`` within ``hops`` ops (``node`` excluded)."""
    out: set[fx.Node] = set()
    frontier = [node]
    for _ in range(hops):
        frontier = [u for n in frontier for u in n.users if u not in out]
        out.update(frontier)
        if not frontier:
            break
    return out


def _is_anchor(anchor: Any, node: fx.Node) -> bool:
    if isinstance(anchor, torch._ops.OpOverload):
        return node.target is anchor
    return bool(anchor(node))


def _same_result(m: Match, rep: Any, fake_mode: Any) -> tuple[str | None, Any]:
    """Fake-run the replacement: each output must have the dtype, shape and strides of the node whose uses it takes
    over (``rep.outputs``), so that nothing downstream (a ``view``, a stride-sensitive op) sees another layout.

    Returns (why not, ``None`` when it does; the replacement's fake output, ``None`` when not run)."""
    if fake_mode is None:
        return None, None
    olds = [val(m.root if name == "root" else m[name]) for name in rep.outputs]
    if not isinstance(olds[0], torch.Tensor):
        return None, None
    args = [fake_value(a, fake_mode) for a in rep.args]
    try:
        with fake_mode:
            out = rep.op(*args)
    except Exception as exc:  # the canonical op rejected the arguments
        return f"replacement {rep.op} rejects the matched arguments: {exc}", None
    news = list(out) if isinstance(out, (tuple, list)) else [out]
    for name, new, old in zip(rep.outputs, news, olds):
        if not isinstance(old, torch.Tensor) or not isinstance(new, torch.Tensor):
            continue
        what = "" if name == "root" else f" (output {name!r})"
        if new.dtype != old.dtype:
            return f"replacement would produce {new.dtype} where the graph has {old.dtype}{what}", None
        if new.dim() != old.dim() or not all(statically_known_true(a == b) for a, b in zip(new.shape, old.shape)):
            return f"replacement would produce shape {list(new.shape)} where the graph has {list(old.shape)}{what}", None
        if not _same_strides(new, old):
            return (f"replacement would produce strides {list(new.stride())} where the graph has "
                    f"{list(old.stride())}{what} (shape {list(old.shape)})"), None
    return None, out


def _same_strides(new: torch.Tensor, old: torch.Tensor) -> bool:
    """Whether ``new`` lays out its elements as ``old`` does: equal strides on every dim of more than one element
    (decided for every value of the symbols, never by adding a guard)."""
    return all(statically_known_true(n <= 1) or statically_known_true(a == b)
               for n, a, b in zip(old.shape, new.stride(), old.stride()))

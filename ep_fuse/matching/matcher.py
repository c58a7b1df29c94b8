"""Matching :mod:`ep_fuse.matching.pattern` trees against FX nodes, with reasons for every failure."""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx

from ep_fuse.fx_utils import MISSING, NOT_LITERAL, literal_value, op_args, schema_defaults, tensor_val
from ep_fuse.matching.pattern import Alt, Cast, Item, Lit, Op, Opt, Pat, Var, equals

aten = torch.ops.aten
prims = torch.ops.prims
CAST_TARGETS = (aten._to_copy.default, prims.convert_element_type.default)


@dataclasses.dataclass
class State:
    bindings: dict[str, Any] = dataclasses.field(default_factory=dict)
    nodes: list[fx.Node] = dataclasses.field(default_factory=list)
    shared: set[fx.Node] = dataclasses.field(default_factory=set)

    def fork(self) -> State:
        return State(dict(self.bindings), list(self.nodes), set(self.shared))


@dataclasses.dataclass
class Mismatch:
    """Why a pattern did not match: the node (or literal) where it failed and what was expected."""

    node: Any
    reason: str
    matched: tuple[fx.Node, ...] = ()

    @property
    def depth(self) -> int:
        return len(self.matched)

    def where(self) -> str:
        return self.node.name if isinstance(self.node, fx.Node) else repr(self.node)

    def __str__(self) -> str:
        return f"{self.where()}: {self.reason}"


def _deeper(a: Mismatch | None, b: Mismatch) -> Mismatch:
    return b if a is None or b.depth >= a.depth else a


def match_tree(pat: Any, value: Any, state: State) -> State | Mismatch:
    if isinstance(pat, (list, tuple)):
        if not isinstance(value, (list, tuple)) or len(value) != len(pat):
            return Mismatch(value, f"expected a list of {len(pat)}", tuple(state.nodes))
        for p, v in zip(pat, value):
            res = match_tree(p, v, state)
            if isinstance(res, Mismatch):
                return res
            state = res
        return state
    if not isinstance(pat, Pat):
        reason = equals(pat)(value)
        return Mismatch(value, reason, tuple(state.nodes)) if reason else state
    if isinstance(pat, Lit):
        return _match_lit(pat, value, state)
    bound = pat.bind is not None and pat.bind in state.bindings
    if bound:
        prev = state.bindings[pat.bind]
        if isinstance(prev, fx.Node) or isinstance(value, fx.Node):
            if prev is value:
                return state
            return Mismatch(value, f"must be the same node as {getattr(prev, 'name', prev)!r} ({pat.bind})",
                            tuple(state.nodes))
        reason = equals(prev)(value)
        return Mismatch(value, f"{pat.bind}: {reason}", tuple(state.nodes)) if reason else state
    if isinstance(pat, Op):
        res = _match_op(pat, value, state)
    elif isinstance(pat, Cast):
        res = _match_cast(pat, value, state)
    elif isinstance(pat, Var):
        res = _match_var(pat, value, state)
    elif isinstance(pat, Alt):
        res = _match_alt(pat.options, value, state)
    elif isinstance(pat, Item):
        res = _match_item(pat, value, state)
    elif isinstance(pat, Opt):
        inner_of = pat.inner.inner if isinstance(pat.inner, (Cast,)) else None
        options = (pat.inner, inner_of) if inner_of is not None else (pat.inner,)
        res = _match_alt(options, value, state)
    else:  # pragma: no cover - programming error in a pattern file
        raise TypeError(f"unknown pattern element {pat!r}")
    if isinstance(res, State) and pat.bind is not None:
        res.bindings[pat.bind] = value
    return res


def _match_lit(pat: Lit, value: Any, state: State) -> State | Mismatch:
    """A literal argument. In a dynamic-shape graph a size may be a node computing a ``SymInt``
    (alone or inside a list): the check sees, and the binding holds, its symbolic value
    (:func:`ep_fuse.fx_utils.literal_value`), so guards compare sizes without adding a guard."""
    lit = literal_value(value)
    if lit is NOT_LITERAL:
        return Mismatch(value, "expected a literal, got a graph value", tuple(state.nodes))
    if pat.bind is not None and pat.bind in state.bindings:
        reason = equals(state.bindings[pat.bind])(lit)
        return Mismatch(value, f"{pat.bind}: {reason}", tuple(state.nodes)) if reason else state
    reason = pat.check(lit)
    if reason:
        return Mismatch(value, reason, tuple(state.nodes))
    if pat.bind is not None:
        state.bindings[pat.bind] = lit
    return state


def _match_alt(options: tuple[Any, ...], value: Any, state: State) -> State | Mismatch:
    best: Mismatch | None = None
    for option in options:
        res = match_tree(option, value, state.fork())
        if isinstance(res, State):
            return res
        best = _deeper(best, res)
    assert best is not None
    return best


def _match_item(pat: Item, value: Any, state: State) -> State | Mismatch:
    miss = _expect_call(value, (operator.getitem,), state)
    if miss:
        return miss
    node: fx.Node = value
    if node.args[1] != pat.index:
        return Mismatch(node, f"expected output {pat.index}, got output {node.args[1]}", tuple(state.nodes))
    return match_tree(pat.inner, node.args[0], _enter(node, state))


def _match_var(pat: Var, value: Any, state: State) -> State | Mismatch:
    if pat.check is not None:
        reason = pat.check(value)
        if reason:
            return Mismatch(value, reason, tuple(state.nodes))
    return state


def _expect_call(value: Any, targets: tuple[Any, ...], state: State) -> Mismatch | None:
    names = " | ".join(str(t) for t in targets)
    if not isinstance(value, fx.Node):
        return Mismatch(value, f"expected a call of {names}, got literal {value!r}", tuple(state.nodes))
    if value.op != "call_function" or value.target not in targets:
        got = value.target if value.op == "call_function" else value.op
        return Mismatch(value, f"expected {names}, got {got}", tuple(state.nodes))
    return None


def _enter(node: fx.Node, state: State) -> State:
    state = state.fork()
    if node not in state.nodes:
        state.nodes.append(node)
    return state


def _match_op(pat: Op, value: Any, state: State) -> State | Mismatch:
    miss = _expect_call(value, pat.targets, state)
    if miss:
        return miss
    node: fx.Node = value
    args = op_args(node)
    state = _enter(node, state)
    if pat.shared:
        state.shared.add(node)
    # unconstrained arguments must keep their schema defaults
    for name, given in args.items():
        if name in pat.args or name in pat.ignore:
            continue
        default = schema_defaults(node.target)[name]
        if default is MISSING or not _same_literal(given, default):
            return Mismatch(node, f"argument {name}={given!r} differs from the default {default!r}",
                            tuple(state.nodes))
    orders = [None]
    if pat.commutative:
        orders.append(pat.commutative)
    best: Mismatch | None = None
    for swap in orders:
        cur = state.fork()
        failed: Mismatch | None = None
        for name, sub in pat.args.items():
            src = name
            if swap is not None and name in swap:
                src = swap[1] if name == swap[0] else swap[0]
            if src not in args:
                raise KeyError(f"pattern {pat!r} constrains unknown argument {src!r}")
            res = match_tree(sub, args[src], cur)
            if isinstance(res, Mismatch):
                failed = res
                break
            cur = res
        if failed is None:
            return cur
        best = _deeper(best, failed)
    assert best is not None
    return best


def _same_literal(a: Any, b: Any) -> bool:
    if isinstance(a, fx.Node) or isinstance(b, fx.Node):
        return a is b
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    try:
        return a == b
    except Exception:
        return False


def _match_cast(pat: Cast, value: Any, state: State) -> State | Mismatch:
    miss = _expect_call(value, CAST_TARGETS, state)
    if miss:
        return Mismatch(miss.node, miss.reason.replace(" | ", " or ") + " (a dtype cast)", miss.matched)
    node: fx.Node = value
    state = _enter(node, state)
    args = op_args(node)
    if node.target is aten._to_copy.default:
        src = args["self"]
        dtype = args["dtype"]
        if dtype is None:
            return Mismatch(node, "_to_copy without dtype is not a cast", tuple(state.nodes))
        if args["layout"] not in (None, torch.strided):
            return Mismatch(node, f"_to_copy changes layout to {args['layout']}", tuple(state.nodes))
        src_val = tensor_val(src)
        if args["device"] is not None and (src_val is None or torch.device(args["device"]) != src_val.device):
            return Mismatch(node, f"_to_copy moves data to {args['device']}", tuple(state.nodes))
        if args["pin_memory"] or args["non_blocking"]:
            return Mismatch(node, "_to_copy with pin_memory/non_blocking is not a plain cast", tuple(state.nodes))
        if args["memory_format"] not in (None, torch.preserve_format):
            return Mismatch(node, f"_to_copy changes memory format to {args['memory_format']}", tuple(state.nodes))
    else:
        src, dtype = args["a"], args["dtype"]
    if isinstance(pat.dtype, torch.dtype):
        if dtype != pat.dtype:
            return Mismatch(node, f"cast to {dtype}, expected {pat.dtype}", tuple(state.nodes))
    elif isinstance(pat.dtype, str):
        prev = state.bindings.get(pat.dtype)
        if prev is not None and prev != dtype:
            return Mismatch(node, f"cast to {dtype}, expected {prev} ({pat.dtype})", tuple(state.nodes))
        state.bindings[pat.dtype] = dtype
    return match_tree(pat.inner, src, state)


def external_users(state: State, roots: list[fx.Node]) -> Mismatch | None:
    """Interior nodes must not be used outside the match unless marked ``shared`` (or an output root)."""
    inside = set(state.nodes)
    for node in state.nodes:
        if node in roots or node in state.shared:
            continue
        outside = [u for u in node.users if u not in inside]
        if outside:
            names = ", ".join(u.name for u in outside[:3])
            return Mismatch(node, f"is also used outside the pattern (by {names}); fusing would compute it twice",
                            tuple(state.nodes))
    return None

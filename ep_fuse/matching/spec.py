"""Pattern specifications (what the catalog declares) and the generic graph surgery that applies them."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from ep_fuse.fx_utils import module_class, module_path, source_meta, val
from ep_fuse.matching.matcher import CAST_TARGETS, Mismatch, State, external_users, match_tree
from ep_fuse.matching.pattern import Alt, Cast, Item, Op, Opt, Pat

Guard = Callable[["Match"], "str | tuple[Any, str] | None"]
"""``None`` when the match is safe, else the reason (or ``(node, reason)`` to point at a node)."""


@dataclasses.dataclass(frozen=True)
class Anchor:
    """A candidate-site marker narrower than an op: calls of ``target`` for which ``when(node)`` holds."""

    target: Any
    when: Callable[[fx.Node], bool]

    def __call__(self, node: fx.Node) -> bool:
        return node.op == "call_function" and node.target is self.target and bool(self.when(node))

    def __str__(self) -> str:
        return f"{self.target} (where {getattr(self.when, '__name__', 'a condition holds')})"


@dataclasses.dataclass(frozen=True)
class Derived:
    """A value the replacement needs that the graph does not hold yet, e.g. a slice of a weight."""

    op: Any
    args: tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class Replacement:
    """How a match becomes one canonical op call.

    ``outputs`` maps each output index of ``op`` to the binding whose uses it takes over
    (``"root"`` is the pattern's root node).
    """

    op: torch._ops.OpOverload
    args: tuple[Any, ...]
    outputs: tuple[str, ...] = ("root",)


@dataclasses.dataclass(frozen=True, eq=False)
class Pattern:
    """One variant of a fusion: a tree, guards and the canonical op it becomes."""

    name: str
    variant: str
    tree: Pat
    build: Callable[[Match], Replacement]
    guards: tuple[Guard, ...] = ()
    anchors: tuple[Any, ...] = ()
    """Ops (or ``node -> bool`` predicates) marking a candidate site, for near-miss explanations."""
    description: str = ""
    produces: str = ""
    """Name of the canonical op the pattern becomes (for the catalog listing)."""
    outputs: tuple[tuple[str, Pat], ...] = ()
    """More outputs of the fused computation, each ``(binding, tree)``: the tree is matched after the
    main one, on the same bindings, at the node bound to ``binding`` or, for an ``Item(inner, i)`` whose
    ``inner`` is bound, at that node's single ``getitem(·, i)`` user; the node is then bound to
    ``binding`` and, like the root, may be used outside the match (a router's top-k ids)."""

    @property
    def key(self) -> str:
        return f"{self.name}[{self.variant}]"

    @property
    def family(self) -> str:
        """The catalog module that declares the pattern (the module of its ``build``): patterns of one
        family compete only through their priority order, never through the engine's precedence rule."""
        return self.build.__module__.rsplit(".", 1)[-1]

    def root_targets(self) -> set[Any]:
        return _root_targets(self.tree)


def _root_targets(p: Any) -> set[Any]:
    if isinstance(p, Op):
        return set(p.targets)
    if isinstance(p, Cast):
        return set(CAST_TARGETS)
    if isinstance(p, Item):
        return {operator.getitem}
    if isinstance(p, Alt):
        out: set[Any] = set()
        for o in p.options:
            out |= _root_targets(o)
        return out
    if isinstance(p, Opt):
        return _root_targets(p.inner) | (_root_targets(p.inner.inner) if isinstance(p.inner, Cast) else set())
    raise TypeError(f"a pattern root must be an op, a cast or a choice of them, got {p!r}")


@dataclasses.dataclass(frozen=True)
class PairRule:
    """Two calls of ``single`` that agree on every argument but the first become one ``paired`` call.

    ``paired(a0, b0, *shared)`` returns ``(single(a0, *shared), single(b0, *shared))``; the first call
    in graph order takes output 0. Used for q/k pairs that share cos/sin.
    """

    name: str
    single: torch._ops.OpOverload
    paired: torch._ops.OpOverload


@dataclasses.dataclass
class Match:
    pattern: Pattern
    root: fx.Node
    bindings: dict[str, Any]
    nodes: list[fx.Node]

    def __getitem__(self, name: str) -> Any:
        return self.bindings[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self.bindings.get(name, default)

    def val(self, name: str) -> Any:
        return val(self.bindings[name])

    @property
    def module_path(self) -> str:
        return module_path(self.root)

    @property
    def module_class(self) -> str:
        return module_class(self.root)


def try_match(pattern: Pattern, node: fx.Node) -> Match | Mismatch:
    """Match ``pattern`` rooted at ``node``: structure, exclusive use of interior nodes, then guards."""
    res = match_tree(pattern.tree, node, State())
    if isinstance(res, Mismatch):
        return res
    roots = [node]
    for name, tree in pattern.outputs:
        at = _output_node(name, tree, res)
        if isinstance(at, Mismatch):
            return at
        res = match_tree(tree, at, res.fork())
        if isinstance(res, Mismatch):
            return res
        res.bindings[name] = at
        roots.append(at)
    ext = external_users(res, roots)
    if ext is not None:
        return ext
    m = Match(pattern, node, res.bindings, res.nodes)
    for guard in pattern.guards:
        verdict = guard(m)
        if verdict:
            where, reason = verdict if isinstance(verdict, tuple) else (node, verdict)
            return Mismatch(where, f"guard {guard.__name__}: {reason}", tuple(res.nodes))
    return m


def _output_node(name: str, tree: Pat, state: State) -> fx.Node | Mismatch:
    """Where a further output's tree is rooted (see :attr:`Pattern.outputs`)."""
    bound = state.bindings.get(name)
    if isinstance(bound, fx.Node):
        return bound
    inner = tree.inner if isinstance(tree, Item) else None
    src = state.bindings.get(inner.bind) if inner is not None and inner.bind else None
    if not isinstance(src, fx.Node):
        raise ValueError(f"pattern output {name!r}: bind it in the main tree, or root it at an Item of a bound op")
    items = [u for u in src.users if u.target is operator.getitem and u.args[1] == tree.index]
    if len(items) != 1:
        return Mismatch(src, f"output {name}: {len(items)} readers of output {tree.index}, expected one",
                        tuple(state.nodes))
    return items[0]


def apply_replacement(gm: fx.GraphModule, m: Match, rep: Replacement, fake_mode: Any,
                      value: Any = None) -> list[fx.Node]:
    """Insert ``rep`` before the match root, redirect uses, erase dead matched nodes.

    ``value``: the replacement's fake output when the caller has already run it on the same arguments'
    fake values (the canonicalize pass does, to check it); ``None``: run it here.
    Returns the new nodes (the op call and its ``getitem`` projections).
    """
    graph = gm.graph
    meta = source_meta(m.root, extra=("source_fn_stack",))
    with graph.inserting_before(m.root):
        args = tuple(_materialize(graph, a, fake_mode, meta) for a in rep.args)
        call = _add_call(graph, rep.op, args, meta, fake_mode, value)
    out_val = call.meta.get("val")
    new_nodes = [call]
    if len(rep.outputs) == 1:
        targets = [call]
    else:
        targets = []
        for i in range(len(rep.outputs)):
            with graph.inserting_after(new_nodes[-1]):
                g = graph.call_function(operator.getitem, (call, i))
            g.meta.update(meta)
            if out_val is not None:
                g.meta["val"] = out_val[i]
            new_nodes.append(g)
            targets.append(g)
    matched = set(m.nodes)
    for name, new in zip(rep.outputs, targets):
        old = m.root if name == "root" else m.bindings[name]
        old.replace_all_uses_with(new, delete_user_cb=lambda user: user not in matched or old is m.root)
    erase_dead(graph, m.nodes)
    return new_nodes


def _materialize(graph: fx.Graph, arg: Any, fake_mode: Any, meta: dict[str, Any]) -> Any:
    if not isinstance(arg, Derived):
        return arg
    args = tuple(_materialize(graph, a, fake_mode, meta) for a in arg.args)
    return _add_call(graph, arg.op, args, meta, fake_mode)


def _add_call(graph: fx.Graph, op: Any, args: tuple[Any, ...], meta: dict[str, Any], fake_mode: Any,
              value: Any = None) -> fx.Node:
    """A call of ``op`` at the graph's insertion point, with the match's metadata and its fake value
    (``value`` when given, else ``op`` run on the arguments' fake values)."""
    node = graph.call_function(op, args)
    node.meta.update(meta)
    if value is None:
        value = _fake_run(op, args, fake_mode)
    if value is not None:
        node.meta["val"] = value
    return node


def fake_value(arg: Any, fake_mode: Any) -> Any:
    """The fake value of a replacement argument (a node, a :class:`Derived` or a literal)."""
    if isinstance(arg, Derived):
        return _fake_run(arg.op, [fake_value(a, fake_mode) for a in arg.args], fake_mode, raw=True)
    return val(arg) if isinstance(arg, fx.Node) else arg


def erase_dead(graph: fx.Graph, nodes: Sequence[fx.Node]) -> None:
    """Erase the given nodes that have no users left (users first, until nothing changes)."""
    alive = [n for n in nodes]
    changed = True
    while changed:
        changed = False
        for node in list(alive):
            if not node.users:
                graph.erase_node(node)
                alive.remove(node)
                changed = True


def _fake_run(op: torch._ops.OpOverload, args: Sequence[Any], fake_mode: Any, raw: bool = False) -> Any:
    if fake_mode is None:
        return None
    fake_args = list(args) if raw else [val(a) if isinstance(a, fx.Node) else a for a in args]
    with fake_mode:
        return op(*fake_args)

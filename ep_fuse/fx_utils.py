"""Small helpers over torch.fx graphs of ATen ops."""

from __future__ import annotations

import collections
import functools
import re
from typing import Any

import torch
import torch.fx as fx
from ep_fuse.symbolic import concrete_int

MISSING = object()


@functools.lru_cache(maxsize=None)
def _schema_args(target: torch._ops.OpOverload) -> tuple[tuple[str, Any, bool], ...]:
    out = []
    for a in target._schema.arguments:
        out.append((a.name, a.default_value if a.has_default_value() else MISSING, a.kwarg_only))
    return tuple(out)


def op_args(node: fx.Node) -> dict[str, Any]:
    """Arguments of an OpOverload call by schema name, defaults filled in."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        raise TypeError(f"{node.format_node()} does not call an OpOverload")
    out: dict[str, Any] = {}
    for i, (name, default, _kw_only) in enumerate(_schema_args(target)):
        if i < len(node.args):
            out[name] = node.args[i]
        elif name in node.kwargs:
            out[name] = node.kwargs[name]
        else:
            out[name] = default
    return out


@functools.lru_cache(maxsize=None)
def schema_defaults(target: torch._ops.OpOverload) -> dict[str, Any]:
    """Schema argument name -> default (``MISSING`` for required arguments)."""
    return {name: default for name, default, _ in _schema_args(target)}


def val(node: Any) -> Any:
    """The fake value (``meta['val']``) of a node, or the literal itself."""
    if isinstance(node, fx.Node):
        return node.meta.get("val", node.meta.get("example_value"))
    return node


def tensor_val(node: Any) -> torch.Tensor | None:
    v = val(node)
    return v if isinstance(v, torch.Tensor) else None


NOT_LITERAL = object()
"""What :func:`literal_value` returns for a graph value that is not a scalar (a tensor)."""

SYM_SCALARS = (torch.SymInt, torch.SymFloat, torch.SymBool)


def literal_value(arg: Any) -> Any:
    """The literal an argument holds, with the size expressions of a dynamic-shape graph resolved.

    Under ``dynamic=True`` sizes are computed in the graph (``mul_608: "Sym(6*s27*s52)" = 6 * arg1_1``)
    and passed as nodes, alone (``arange(mul_608)``) or inside lists (``view(y, [mul_241, 6, 360])``).
    Such a node stands for its symbolic value (a ``SymInt``, or a plain int where its value is a
    constant); lists are resolved element-wise. Any other graph value (a tensor) is :data:`NOT_LITERAL`.
    Reading ``meta['val']`` adds no guard: nothing is evaluated.
    """
    if isinstance(arg, fx.Node):
        v = val(arg)
        if isinstance(v, torch.SymInt):
            c = concrete_int(v)
            return v if c is None else c  # a size Dynamo specialised is a plain int
        if isinstance(v, SYM_SCALARS) or (isinstance(v, (int, float)) and not isinstance(v, bool)):
            return v
        return NOT_LITERAL
    if isinstance(arg, (list, tuple)):
        items = [literal_value(a) for a in arg]
        return NOT_LITERAL if any(i is NOT_LITERAL for i in items) else type(arg)(items)
    return arg


def _innermost_module(node: fx.Node) -> tuple[str, Any] | None:
    """The innermost ``(path, class)`` of ``nn_module_stack`` that belongs to the model: a module held in a global
    (``G['...apply_rotary_pos_emb']``: transformers 5.25 wraps kernel-replaceable functions in modules) is skipped
    for the module that called it."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    entries = list(stack.values())
    for path, cls in reversed(entries):
        if not str(path).startswith(("G[", "G.")):
            return path, cls
    return entries[-1]


SOURCE_META = ("nn_module_stack", "stack_trace")
"""The node metadata that says where in the model's source a node comes from (what the report and dumps name)."""


def source_meta(node: fx.Node, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """``node``'s source metadata (:data:`SOURCE_META` and ``extra`` keys), for the nodes that replace it."""
    return {k: node.meta[k] for k in (*SOURCE_META, *extra) if k in node.meta}


def copy_graph(gm: fx.GraphModule) -> fx.Graph:
    """A copy of ``gm``'s graph (node names kept; metadata, fake values included, shared with the original): the
    graph a pass puts back when its rewrite fails."""
    graph = fx.Graph(owning_module=gm, tracer_cls=gm.graph._tracer_cls)
    graph.output(graph.graph_copy(gm.graph, {}))
    return graph


def module_path(node: fx.Node) -> str:
    """Dotted module path from ``nn_module_stack`` (``model.layers.0.input_layernorm``), or ``''``."""
    inner = _innermost_module(node)
    return clean_module_path(inner[0]) if inner else ""


def module_class(node: fx.Node) -> str:
    inner = _innermost_module(node)
    if inner is None:
        return ""
    cls = inner[1]
    return getattr(cls, "__name__", str(cls).rsplit(".", 1)[-1].rstrip("'>"))


def clean_module_path(path: str) -> str:
    """``L['self'].model.layers[0].norm`` / ``L['self'].model.layers.0.norm`` -> ``model.layers.0.norm``.

    A method bound on the instance (``layers.0.forward.__self__.experts``: a forward swapped in by
    ``ep_fuse.prepare`` or by hooks) is its owner: ``layers.0.experts``."""
    p = re.sub(r"\.[A-Za-z_]\w*\.__self__\b", "", path)
    for prefix in ("L['self'].", "L['self']", "self."):
        if p.startswith(prefix):
            p = p[len(prefix):]
            break
    p = p.replace("['", ".").replace("']", "").replace("[", ".").replace("]", "")
    return p.strip(".")


def op_histogram(graph: fx.Graph) -> dict[str, int]:
    """Count call_function targets by name (``aten.add.Tensor`` ...)."""
    counts: collections.Counter[str] = collections.Counter()
    for n in graph.nodes:
        if n.op == "call_function":
            counts[target_name(n.target)] += 1
    return dict(sorted(counts.items()))


def target_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        ns, name = target.name().split("::", 1)
        return f"{ns}.{name}" if "." in name else f"{ns}.{name}.default"
    return getattr(target, "__name__", str(target))


def stable_topological_sort(graph: fx.Graph) -> None:
    """Reorder nodes minimally so each comes after its inputs (the existing order is kept otherwise)."""
    done: set[fx.Node] = set()
    waiting: dict[fx.Node, list[fx.Node]] = collections.defaultdict(list)
    order: list[fx.Node] = []
    stack = list(reversed(graph.nodes))
    while stack:
        node = stack.pop()
        if node in done:
            continue
        missing = next((i for i in node.all_input_nodes if i not in done), None)
        if missing is not None:
            waiting[missing].append(node)
            continue
        done.add(node)
        order.append(node)
        stack.extend(reversed(waiting.pop(node, [])))
    if len(order) != len(graph.nodes):
        raise RuntimeError("ep_fuse: the rewritten graph has a cycle; this is a bug in a pattern, please report it")
    prev = graph._root  # type: ignore[attr-defined]
    for node in order:
        if node.prev is not prev:
            prev.append(node)
        prev = node


def fake_mode_of(gm: fx.GraphModule):
    """The FakeTensorMode that produced the graph's ``meta['val']`` (or ``None``)."""
    from torch._guards import detect_fake_mode

    vals = [val(n) for n in gm.graph.nodes if n.op == "placeholder"]
    return detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])

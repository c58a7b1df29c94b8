"""The graph edits passes share: nodes added with their fake values (``meta['val']``) so later passes read their
shape, the source metadata copied onto them, a canonical op inlined as the ATen ops of its reference, a node
replaced by another (its matches and EP record follow it), and the EP record a block's nodes carry."""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from ep_fuse.fx_utils import source_meta, val
from ep_fuse.passes.base import PassContext
from ep_fuse.report import EpRecord

EP_RECORD = "ep_fuse_ep_record"
"""``node.meta`` key of the :class:`~ep_fuse.report.EpRecord` on an EP block's dispatch and local-experts
nodes: the block's nodes point at their record (it survives graph copies and a node replaced by
:func:`replace_node`), so no pass looks a record up by node name."""


def fake_mode(ctx: PassContext) -> Any:
    """The graph's fake mode (a new one, kept on ``ctx``, where the graph has none)."""
    if ctx.fake_mode is None:
        ctx.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    return ctx.fake_mode


def call(ctx: PassContext, gm: fx.GraphModule, target: Any, args: tuple[Any, ...],
         kwargs: dict[str, Any] | None = None) -> fx.Node:
    """A ``call_function`` node of ``target`` at the graph's insertion point, its value computed on the fake
    values of its arguments."""
    node = gm.graph.call_function(target, args, kwargs or {})
    fakes = fx.node.map_arg(args, lambda a: a.meta["val"])
    with fake_mode(ctx):
        node.meta["val"] = target(*fakes, **(kwargs or {}))
    return node


def set_fake_vals(ctx: PassContext, *nodes: fx.Node) -> None:
    """Fill ``meta["val"]`` of new nodes, in order, from their targets run on their arguments' fake values."""
    def fake(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return val(a)
        if isinstance(a, (list, tuple)):
            return type(a)(fake(b) for b in a)
        return a

    with fake_mode(ctx):
        for n in nodes:
            n.meta["val"] = n.target(*fake(n.args), **{k: fake(v) for k, v in n.kwargs.items()})


def copy_source_meta(like: fx.Node, *nodes: fx.Node) -> None:
    """Give ``nodes`` the source metadata of ``like`` (the node they replace or stand beside)."""
    keep = source_meta(like)
    for n in nodes:
        n.meta.update(keep)


def ep_record(node: fx.Node) -> EpRecord | None:
    """The EP record ``node`` carries (an EP block's dispatch or local experts), else ``None``."""
    return node.meta.get(EP_RECORD)


def mark_ep_block(record: EpRecord, *nodes: fx.Node) -> None:
    """Let ``nodes`` (the block's dispatch and local experts) carry ``record``."""
    for n in nodes:
        n.meta[EP_RECORD] = record


def replace_node(ctx: PassContext, gm: fx.GraphModule, old: fx.Node, new: fx.Node) -> None:
    """Put ``new`` in the place of ``old``: its metadata, its uses, the matches it carries and its EP record
    (whose block is now named ``new``); ``old`` is erased."""
    new.meta.update(old.meta)
    rec = ep_record(old)
    if rec is not None and rec.block == old.name:
        rec.block = new.name
    old.replace_all_uses_with(new)
    gm.graph.erase_node(old)
    if old.name in ctx.match_by_node:
        ctx.match_by_node[new.name] = ctx.match_by_node.pop(old.name)


def inline_reference(gm: fx.GraphModule, node: fx.Node, fn: Any, fake_mode: Any) -> None:
    """Replace ``node`` by the ATen ops of ``fn`` traced on the node's fake arguments."""
    graph = gm.graph
    tensor_pos = [i for i, a in enumerate(node.args) if isinstance(a, fx.Node)]
    consts = list(node.args)

    def body(*tensors: torch.Tensor) -> Any:
        args = list(consts)
        for i, t in zip(tensor_pos, tensors):
            args[i] = t
        return fn(*args)

    fakes = [val(node.args[i]) for i in tensor_pos]
    with fake_mode:
        traced = make_fx(body, tracing_mode="real", record_module_stack=False)(*fakes)
    env: dict[fx.Node, Any] = {}
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    for ph, i in zip(placeholders, tensor_pos):
        env[ph] = node.args[i]
    result: Any = None
    keep = source_meta(node)
    with graph.inserting_before(node):
        for n in traced.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                result = torch.fx.map_arg(n.args[0], lambda a: env[a])
                continue
            if n.op == "get_attr":  # constants created by the reference (none today)
                raise RuntimeError(f"ep_fuse: reference of {node.target} created a constant; cannot inline")
            new = graph.node_copy(n, lambda a: env[a])
            new.meta.update(keep)
            env[n] = new
    if isinstance(result, (tuple, list)):
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(result[user.args[1]])
                graph.erase_node(user)
    else:
        node.replace_all_uses_with(result)
    graph.erase_node(node)

"""Nodes a pass adds to the ATen graph, each with its fake value (``meta['val']``) so later passes read its shape."""

from __future__ import annotations

from typing import Any

from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

from ep_fuse.passes.base import PassContext


def fake_mode(ctx: PassContext) -> Any:
    """The graph's fake mode (a new one, kept on ``ctx``, where the graph has none)."""
    if ctx.fake_mode is None:
        ctx.fake_mode = FakeTensorMode()
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

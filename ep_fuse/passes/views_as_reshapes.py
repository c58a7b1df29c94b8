"""The ``view`` of every computed tensor back to a ``reshape`` before Inductor compiles the graph."""

from __future__ import annotations

import torch
import torch.fx as fx

from ep_fuse.passes.base import GraphPass, PassContext


class ViewsAsReshapes(GraphPass):
    """The capture traced ``reshape`` (and ``matmul``'s reshapes) on eager strides, where it became a ``view``.

    Inductor re-traces the graph with its own decompositions, which may lay a tensor out otherwise (its ``cat``
    drops an empty operand and clones the other, keeping that operand's strides), and a ``view`` that was valid
    on eager's strides then fails ("Cannot view a tensor with shape ... and strides ..."), for a graph
    ``backend="inductor"`` compiles. A ``reshape`` is the same ``view`` where the layout allows it and a copy
    where it does not. Views of the graph's inputs stay views (their aliasing is part of the graph's contract).
    Runs under the Inductor executor only, and also on a graph put back after a failing pass."""

    name = "views_as_reshapes"
    runs_on_restored = True

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> int:
        changed = 0
        for node in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.view.default):
            base = node.args[0]
            if isinstance(base, fx.Node) and base.op not in ("placeholder", "get_attr"):
                node.target = torch.ops.aten.reshape.default
                changed += 1
        if changed:
            gm.recompile()
        return changed

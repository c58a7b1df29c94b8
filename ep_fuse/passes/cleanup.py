"""Stable topological order, dead-code elimination, lint and recompile."""

from __future__ import annotations

import torch.fx as fx

from ep_fuse.fx_utils import stable_topological_sort
from ep_fuse.passes.base import GraphPass, PassContext


class Cleanup(GraphPass):
    name = "cleanup"

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> int:
        before = len(gm.graph.nodes)
        stable_topological_sort(gm.graph)  # before DCE, which lints the order first
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
        return before - len(gm.graph.nodes)

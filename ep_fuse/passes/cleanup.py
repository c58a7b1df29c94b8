"""Dead-code elimination, stable topological order, lint and recompile."""

from __future__ import annotations

import torch.fx as fx

from ep_fuse.fx_utils import stable_topological_sort
from ep_fuse.passes.base import GraphPass, PassContext


class Cleanup(GraphPass):
    name = "cleanup"

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> int:
        before = len(gm.graph.nodes)
        gm.graph.eliminate_dead_code()
        stable_topological_sort(gm.graph)
        gm.graph.lint()
        gm.recompile()
        return before - len(gm.graph.nodes)

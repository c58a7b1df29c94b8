"""Expand: replace each block op (``ep_fuse::moe_experts``) by its canonical stage ops.

Canonicalize recognises the whole routed-expert computation as one block, which is what the report
counts and what the EP pass rewrites. Providers are chosen per stage (``moe_permute``,
``grouped_gemm_swiglu``, ``grouped_gemm``, ``moe_unpermute``), so the block is traced through its
reference -- written with the stage ops -- and inlined before lowering.
"""

from __future__ import annotations

import torch.fx as fx

from ep_fuse.ops.registry import canonical_for
from ep_fuse.passes.base import GraphPass, PassContext
from ep_fuse.passes.graph_edit import fake_mode, inline_reference


class Expand(GraphPass):
    name = "expand"

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> int:
        changes = 0
        for node in list(gm.graph.nodes):
            canon = canonical_for(node.target) if node.op == "call_function" else None
            if canon is None or not canon.block:
                continue
            records = ctx.match_by_node.pop(node.name, [])
            for record in records:
                record.block = True
            before = set(gm.graph.nodes)
            inline_reference(gm, node, canon.reference, fake_mode(ctx))
            for new in gm.graph.nodes:
                if new not in before and new.op == "call_function" and canonical_for(new.target) is not None:
                    ctx.match_by_node.setdefault(new.name, []).extend(records)
                    for record in records:
                        if not record.stage_nodes:
                            record.fused_node = new.name  # the block's first stage stands for it
                        record.stage_nodes.append(new.name)
            changes += 1
        return changes

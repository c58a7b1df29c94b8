"""Drop zero-weight remapped slots: routed-expert slots whose routing weight the graph sets to exactly 0 are not
dispatched to any expert.

transformers 5.25's LongCat-Flash runs its zero-compute ("identity") experts outside the experts module: their
top-k slots get routing weight 0 and an id remapped onto a real expert (spread over the experts to balance EP
traffic), so the grouped GEMM computes rows whose product with 0 is summed for nothing::

    mask = topk_ids >= num_routed_experts
    ids = torch.where(mask, dummy_ids, topk_ids)        # aten.where.self(mask, dummy, ids)
    weights = topk_weights.masked_fill(mask, 0.0)        # aten.masked_fill.Scalar(w, mask, 0.0)
    out = experts(x, ids, weights)                        # ep_fuse::moe_experts(x, ids, weights, ...)

The proof is the graph itself: the ids and the weights of the block are selected by the same boolean mask node,
and the weights are ``masked_fill(.., mask, 0)`` -- so every remapped slot has weight exactly 0, whatever the dummy
id is. Its ids become ``ids.masked_fill(mask, -1)``: -1 is an invalid slot, which every MoE op and provider skips
(:mod:`ep_fuse.ops.moe`), and an invalid slot adds exactly what ``0 * y`` adds for a finite expert output ``y``
(a zero). Only an expert row that overflowed to inf/NaN differs: eager's ``0 * inf`` is NaN, the dropped slot 0.

Runs after EP and quant, right before expand, on the blocks whose ids and weights are still the graph's own
(``moe_experts``, ``moe_experts_w8a8``, ``moe_experts_fp8``); a block behind an EP dispatch keeps its slots (the
dispatch moved them already). Each rewritten site's :class:`~ep_fuse.report.MatchRecord` says so
(``dropped_zero_slots``).
"""

from __future__ import annotations

import logging

import torch
from torch import fx

from ep_fuse.fx_utils import op_args
from ep_fuse.ops import fp8 as fp8_ops
from ep_fuse.ops import moe as moe_ops
from ep_fuse.ops import w8a8 as w8a8_ops
from ep_fuse.passes import graph_edit
from ep_fuse.passes.base import GraphPass, PassContext

log = logging.getLogger("ep_fuse")

aten = torch.ops.aten

BLOCKS = (moe_ops.moe_experts, w8a8_ops.moe_experts_w8a8, fp8_ops.moe_experts_fp8)
"""The routed-expert blocks (each takes ``topk_ids`` and ``topk_weights``)."""


def remap_mask(ids: object, weights: object) -> fx.Node | None:
    """The boolean mask that selects both the remapped ids and the zeroed weights of a block (``None``: no such
    mask, the slots stay)."""
    if not (isinstance(ids, fx.Node) and isinstance(weights, fx.Node)):
        return None
    if weights.target is not aten.masked_fill.Scalar or ids.target is not aten.where.self:
        return None
    _, mask, value = weights.args[:3]
    if not isinstance(value, (int, float)) or value != 0 or ids.args[0] is not mask:
        return None
    mask_val, ids_val = mask.meta.get("val"), ids.meta.get("val")
    if mask_val is None or ids_val is None or mask_val.dtype != torch.bool or mask_val.shape != ids_val.shape:
        return None  # a broadcast mask could zero other slots than it remaps
    return mask


class DropZeroWeightSlots(GraphPass):
    name = "drop_zero_slots"

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> int:
        targets = {c.op for c in BLOCKS}
        changes = 0
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or node.target not in targets:
                continue
            args = op_args(node)
            ids = args["topk_ids"]
            mask = remap_mask(ids, args["topk_weights"])
            if mask is None:
                continue
            with gm.graph.inserting_before(node):
                dropped = graph_edit.call(ctx, gm, aten.masked_fill.Scalar, (ids, mask, -1))
            node.replace_input_with(ids, dropped)
            for record in ctx.match_by_node.get(node.name, []):
                record.dropped_zero_slots = True
            log.info("ep_fuse: %s: slots with weight 0 where %s (remapped ids) are not dispatched", node.name,
                     mask.name)
            changes += 1
        return changes

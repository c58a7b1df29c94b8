"""The local experts of an EP block on the masked expert layout (``ep_fuse::moe_experts_masked``).

Behind a dispatch whose receive buffer is expert-major with each expert's valid rows first (DeepEP low-latency:
``[E_r, W*C, H]``, rows past ``recv_count[e]`` are padding with id -1; ``EpEngine.masked_blocks``), the EP pass
asks :func:`masked_experts` for the local experts instead of ``moe_experts`` over all ``E_r*W*C`` rows (a permute
and unpermute over the padding)::

    counts = (recv_ids.view(E_r, W*C) >= 0).sum(1, dtype=int32)
    y = moe_experts_masked(recv_x.view(E_r, W*C, H), counts, w13, w2, max_rows, act...).view(E_r*W*C, H)

``y`` is what ``moe_experts`` gave on the valid rows (unit weights: the expert layout weights in combine), bit for
bit in the rounding, and the combine reads only those rows. Used only where a fused provider takes the call on
this device (the reference would compute the padding rows: slower than the permute path), the block is not
quantized (``quant``), and the sizes are static; otherwise ``None`` and the block keeps ``moe_experts``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import fx

from ep_fuse.ops.ep import ep_engine
from ep_fuse.ops.ep_layout import capacity_rows
from ep_fuse.ops.moe_masked import moe_experts_masked
from ep_fuse.ops.registry import REFERENCE, choose
from ep_fuse.passes.base import PassContext
from ep_fuse.passes.graph_edit import fake_mode

log = logging.getLogger("ep_fuse.passes")
aten = torch.ops.aten


def masked_decline(engine: str, layout: str, xv: Any, idv: Any, w13v: Any, w2v: Any, world: int, capacity: int,
                   activation: tuple, ctx: PassContext) -> str | None:
    """Why the local experts of this block keep ``moe_experts`` (``None``: they take the masked layout)."""
    if layout != "expert" or not ep_engine(engine).masked_blocks:
        return f"{engine} ({layout} layout) does not receive expert blocks with their valid rows first"
    if ctx.config.quant:
        return f"quant={ctx.config.quant!r}: the quantized block runs on permuted rows"
    sizes = (*xv.shape, *idv.shape, *w13v.shape, *w2v.shape)
    if not all(isinstance(s, int) for s in sizes):
        return "symbolic sizes"
    local, m, h = w13v.shape[0], world * capacity_rows("expert", xv.shape[0], capacity), xv.shape[1]
    with fake_mode(ctx):
        x = torch.empty((local, m, h), dtype=xv.dtype, device=xv.device)
        counts = torch.empty((local,), dtype=torch.int32, device=xv.device)
    args = (x, counts, w13v, w2v, max_rows(world, capacity_rows("expert", xv.shape[0], capacity), idv, local),
            *activation)
    perf = ctx.executor if ctx.config.perf_guard else None
    choice = choose(moe_experts_masked, args, ctx.device, ctx.config.provider_order(ctx.device), perf)
    if choice.provider == REFERENCE:
        return "no fused provider takes moe_experts_masked here: " + (
            "; ".join(f"{p}: {why}" for p, why in choice.declined) or "none on this device")
    return None


def max_rows(world: int, capacity: int, idv: Any, local: int) -> int:
    """A bound on the rows a rank receives in the expert layout: each of the ``W*C`` source tokens sends one row
    per distinct local expert among its top-k."""
    return world * capacity * min(int(idv.shape[1]), local)


def masked_experts(graph: fx.Graph, recv_x: fx.Node, recv_ids: fx.Node, w13: Any, w2: Any, activation: tuple,
                   xv: Any, idv: Any, local: int, world: int, capacity: int) -> tuple[list[fx.Node], fx.Node]:
    """The nodes of the masked local experts (module docstring), in order, and the masked op's node; the last
    node is ``y`` [E_r*W*C, H] for the combine. Inserted at the graph's insertion point."""
    c = capacity_rows("expert", xv.shape[0], capacity)
    m, h = world * c, xv.shape[1]
    xs = graph.call_function(aten.view.default, (recv_x, [local, m, h]))
    ids = graph.call_function(aten.view.default, (recv_ids, [local, m]))
    live = graph.call_function(aten.ge.Scalar, (ids, 0))
    counts = graph.call_function(aten.sum.dim_IntList, (live, [1]), {"dtype": torch.int32})
    ym = graph.call_function(moe_experts_masked.op, (xs, counts, w13, w2, max_rows(world, c, idv, local),
                                                     *activation))
    y = graph.call_function(aten.view.default, (ym, [local * m, h]))
    return [xs, ids, live, counts, ym, y], ym

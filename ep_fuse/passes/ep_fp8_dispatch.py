"""FP8 dispatch: the activation quantization of an FP8 block moved before its EP dispatch, so that tokens cross the
wire as fp8 codes + scales instead of bf16.

The quant pass calls :func:`quantize_before_dispatch` for each ``quant="fp8_block"`` block behind an ``ep_dispatch``
that the EP pass (:mod:`ep_fuse.passes.ep`) inserted, while the option ``ep_fp8_dispatch`` is on (the default).
"""

from __future__ import annotations

import logging
import operator

import torch
from torch import fx

from ep_fuse.fx_utils import op_args, val
from ep_fuse.ops import fp8 as fp8_ops
from ep_fuse.ops.ep import ep_engine
from ep_fuse.ops.fp8 import FP8, cdiv
from ep_fuse.ops.registry import ask
from ep_fuse.passes.base import PassContext
from ep_fuse.passes.ep import dispatch_of
from ep_fuse.passes.graph_edit import call, ep_record, fake_mode

log = logging.getLogger("ep_fuse.passes.quant")
aten = torch.ops.aten

FP8_DISPATCH_ENGINES = ("all_to_all", "deepep")
"""Dispatch engines that move rows of any element size bit for bit: ``all_to_all``'s packed rows take 1-byte
elements, and DeepEP's normal (intranode) dispatch copies rows as 16-byte words whatever their dtype (its host
checks: 2-D, contiguous, ``H * element_size % 16 == 0``; DeepEP V1 ``csrc/deep_ep.cpp``; the engine's
``row_bytes``), so the codes + scales row crosses it as one uint8 row, the same bytes its own ``(x_fp8, x_scales)``
form would send. The ``expert``-layout engines (DeepEP low-latency, Ascend) have their own row formats, and
``symm_mem`` checks bf16 tokens."""


def quantize_before_dispatch(gm: fx.GraphModule, ctx: PassContext, block: fx.Node, bk: int
                             ) -> tuple[fx.Node, fx.Node, torch.dtype] | None:
    """Move the 1 x ``bk`` activation quantization of an FP8 block before its EP dispatch.

    ``recv_x = ep_dispatch(x, ...)[0]`` feeding ``block`` becomes ``ep_dispatch(cat(codes, scales as
    bytes), ...)[0]``: each token crosses the wire as ``H`` fp8 bytes + ``4 * ceil(H / bk)`` scale bytes
    instead of ``2H`` (bf16), and the receiver's rows are the codes and scales the block would have computed
    itself (the quantization is per token, so the result is bit for bit the same). Returns ``(received codes,
    received scales, the tokens' dtype)``, or ``None`` when the dispatch is not one this applies to."""
    recv = op_args(block)["x"]
    d = dispatch_of(recv)
    if d is None:
        return None
    da = op_args(d)
    x, engine, layout = da["x"], da["engine"], da["layout"]
    xv = val(x)
    static_width = isinstance(xv, torch.Tensor) and xv.dim() == 2 and isinstance(xv.shape[1], int)
    h = int(xv.shape[1]) if static_width else 0
    ng = cdiv(h, bk)
    row_bytes = h + 4 * ng  # the codes, then the fp32 scales
    not_cleared = [why for why in ask(fp8_ops.quant_fp8_group, "not_cleared_before_dispatch", ctx.device).values()
                   if why is not None]
    why = None
    if not_cleared:
        why = not_cleared[0]
    elif engine not in FP8_DISPATCH_ENGINES or layout != "rank":
        why = (f"the {engine} dispatch sends the tokens as they are (FP8 dispatch: "
               f"{', '.join(FP8_DISPATCH_ENGINES)})")
    elif not static_width or h % 4:
        why = "the token width is not a static multiple of 4 (the scales must start 4-byte aligned)"
    elif row_bytes % (words := ep_engine(engine).row_bytes):
        why = (f"{engine} moves rows in {words}-byte words and the codes + scales row of {row_bytes} bytes "
               "is not")
    elif len(recv.users) != 1:
        why = "the received tokens have other users than the block"
    if why is not None:
        log.info("ep_fuse: quant: %s: bf16 dispatch: %s", block.name, why)
        return None
    graph = gm.graph
    with graph.inserting_before(d):
        qn = call(ctx, gm, fp8_ops.quant_fp8_group.op, (x, bk))
        as_bytes = [call(ctx, gm, aten.view.dtype, (call(ctx, gm, operator.getitem, (qn, i)), torch.uint8))
                    for i in range(2)]
        packed = call(ctx, gm, aten.cat.default, (as_bytes, 1))
    d.args = (packed, *d.args[1:])
    with fake_mode(ctx):  # the dispatch and its outputs, now over the packed rows
        d.meta["val"] = d.target(*fx.node.map_arg(d.args, val))
        for out in d.users:
            out.meta["val"] = d.meta["val"][out.args[1]]
    with graph.inserting_before(block):
        rcodes, rscales = (call(ctx, gm, aten.view.dtype, (call(ctx, gm, aten.slice.Tensor, (recv, 1, lo, hi)), dt))
                           for lo, hi, dt in ((0, h, FP8), (h, row_bytes, torch.float32)))
    rec = ep_record(block)
    if rec is not None:
        rec.payload = f"fp8 e4m3 + 1x{bk} fp32 scales"
    log.info("ep_fuse: quant: %s: the %s dispatch sends fp8 codes + 1x%d scales (%d + %d bytes per token, "
             "bf16 would be %d)", block.name, engine, bk, h, 4 * ng, 2 * h)
    return rcodes, rscales, xv.dtype

"""The expert weights of a quantized block: int8 (``quant="w8a8_int8"``) and FP8 (``quant="fp8_block"``) codes and
scales for the ``w13`` / ``w2`` weight nodes of an ``ep_fuse::moe_experts`` block.

A weight the model already holds quantized is used as it is (nothing is made at compile time):

* **int8**: a dequantization ``q * s`` of an int8 tensor ``q`` [E, N, K] by a per-output-channel scale ``s``
  ([E, N, 1], or ``s.unsqueeze(-1)`` of [E, N]), optionally with dtype casts around either operand or the product.
  The accepted module convention (see ``tests/test_w8a8.py::Int8Experts``)::

      gate_up_proj int8 [E, 2I, H], gate_up_proj_scale fp32 [E, 2I]   (gate rows, then up rows)
      down_proj    int8 [E, H, I],  down_proj_scale    fp32 [E, H]
      w13 = self.gate_up_proj.to(x.dtype) * self.gate_up_proj_scale.unsqueeze(-1).to(x.dtype)

  (int8 parameters with ``requires_grad=False`` or buffers).
* **FP8**: ``ep_fuse::fp8_block_dequant(q, scale_inv, bn, bk, dtype)`` of an fp8 tensor (what :func:`ep_fuse.prepare`
  emits for transformers' ``FP8Experts``, optionally behind casts), with its own block.

Every other weight is evaluated from the static inputs and quantized once (:mod:`ep_fuse.passes.weight_eval`): per
output channel to int8 (:func:`ep_fuse.ops.w8a8.quantize_weight`), or to E4M3 with 128 x 128 block scales
(:func:`ep_fuse.ops.fp8.quantize_weight_fp8`). On CUDA, bf16 weights become FP8 only where the providers say the
FP8 experts are faster (:func:`fp8_not_faster`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import fx

from ep_fuse.fx_utils import tensor_val
from ep_fuse.ops import fp8 as fp8_ops
from ep_fuse.ops.fp8 import BLOCK, FP8, cdiv, quantize_weight_fp8
from ep_fuse.ops.registry import ask
from ep_fuse.ops.w8a8 import quantize_weight
from ep_fuse.passes.base import PassContext
from ep_fuse.passes.ep import dispatch_of
from ep_fuse.passes.graph_edit import call
from ep_fuse.passes.weight_eval import QuantFormat, quantized_constants

log = logging.getLogger("ep_fuse.passes.quant")

aten = torch.ops.aten
CASTS = {aten._to_copy.default, torch.ops.prims.convert_element_type.default}

INT8 = QuantFormat("int8", quantize_weight, "int8 (per-channel scales)", ("q", "scale"))
FP8_BLOCK = QuantFormat("fp8_block", lambda w: quantize_weight_fp8(w, BLOCK), "fp8 e4m3 (128x128 block scales)",
                        ("fp8", "fp8_scale"))

Weights = tuple[tuple[fx.Node, fx.Node], tuple[fx.Node, fx.Node], tuple[int, int]]
"""``((w13 codes, scales), (w2 codes, scales), (block_n, block_k))``."""


def strip_casts(node: Any) -> Any:
    """``node`` without the dtype casts around it."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in CASTS:
        node = node.args[0]
    return node


# --------------------------------------------------------------------------- int8
def int8_weight(gm: fx.GraphModule, ctx: PassContext, weight: fx.Node, block: fx.Node, label: str
                ) -> tuple[fx.Node, fx.Node] | None:
    """``(codes node int8 [E, N, K], scale node fp32 [E, N])`` for an expert weight node, or ``None``."""
    pre = int8_prequantized(gm, ctx, weight)
    if pre is not None:
        log.info("ep_fuse: %s at %s: using the model's int8 %s and its scales", block.name, weight.name, label)
        return pre
    return quantized_constants(gm, ctx, weight, block, label, INT8)


def int8_prequantized(gm: fx.GraphModule, ctx: PassContext, weight: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """Match ``[cast](mul([cast](q int8 [E,N,K]), [cast](s [E,N,1] | unsqueeze(s [E,N], -1))))``."""
    w = strip_casts(weight)
    if not (isinstance(w, fx.Node) and w.op == "call_function" and w.target is aten.mul.Tensor):
        return None
    wv = tensor_val(weight)
    for a, b in (w.args, tuple(reversed(w.args))):
        q, s = strip_casts(a), strip_casts(b)
        qv, sv = tensor_val(q), tensor_val(s)
        if qv is None or sv is None or qv.dtype != torch.int8:
            continue
        if wv is None or qv.dim() != 3 or tuple(qv.shape) != tuple(wv.shape):
            continue
        e, n = qv.shape[0], qv.shape[1]
        if (isinstance(s, fx.Node) and s.op == "call_function" and s.target is aten.unsqueeze.default
                and s.args[1] in (-1, 2)):
            base = strip_casts(s.args[0])
            if tuple(tensor_val(base).shape) == (e, n):
                s, sv = base, tensor_val(base)
        if tuple(sv.shape) == (e, n, 1):
            s = call(ctx, gm, aten.view.default, (s, [e, n]))
            sv = tensor_val(s)
        if tuple(sv.shape) != (e, n) or not sv.dtype.is_floating_point:
            continue
        if sv.dtype != torch.float32:
            s = call(ctx, gm, aten._to_copy.default, (s,), {"dtype": torch.float32})
        return q, s
    return None


# --------------------------------------------------------------------------- fp8
def fp8_weights(gm: fx.GraphModule, ctx: PassContext, block: fx.Node, w13: fx.Node, w2: fx.Node,
                aligned: bool = False) -> Weights | None:
    """The FP8 weights of a block, or ``None`` (left as is). ``aligned``: a provider takes the block's GEMMs on
    the aligned layout (DeepGEMM), which the perf rule counts."""
    pre = {label: fp8_prequantized(gm, ctx, wt) for label, wt in (("w13", w13), ("w2", w2))}
    shapes = {p[2] for p in pre.values() if p is not None}
    if len(shapes) > 1:
        log.warning("ep_fuse: quant: %s: the model's fp8 w13 and w2 have different blocks %s; the block stays "
                    "unquantized (the activation group must be one block_k)", block.name, sorted(shapes))
        return None
    bn, bk = shapes.pop() if shapes else BLOCK
    if ctx.device == "cuda" and ctx.config.perf_guard and any(p is None for p in pre.values()):
        reason = fp8_not_faster(block, w13, aligned)
        if reason is not None:
            log.info("ep_fuse: quant: %s stays bf16: %s", block.name, reason)
            for match in ctx.match_by_node.get(block.name, []):
                match.declined.append(("quant fp8_block", reason))
            return None
    out = []
    for label, wt in (("w13", w13), ("w2", w2)):
        if pre[label] is not None:
            log.info("ep_fuse: %s at %s: using the model's fp8 %s and its block scales", block.name, wt.name, label)
            out.append(pre[label][:2])
            continue
        if (bn, bk) != BLOCK:
            log.warning("ep_fuse: quant: %s: %s is not fp8 while the other weight has %sx%s blocks; the block stays "
                        "unquantized", block.name, label, bn, bk)
            return None
        made = quantized_constants(gm, ctx, wt, block, label, FP8_BLOCK)
        if made is None:
            return None
        out.append(made)
    return out[0], out[1], (bn, bk)


def fp8_not_faster(block: fx.Node, w13: fx.Node, aligned: bool = False) -> str | None:
    """Why a block that would quantize bf16 weights on CUDA stays bf16 (``None``: quantize it): the providers'
    measured rule, question ``keep_bf16`` of ``moe_experts_fp8`` (the Triton provider's
    :func:`~ep_fuse.providers.triton.fp8.fp8_block_quant_rule`) on ``(tokens [T, H], top_k, local experts,
    aligned)``. Behind an EP dispatch the block's input is the receive buffer (a row per token and destination,
    padded to the capacity), whose rows x top-k overcount the rows its local experts get; the rule then counts the
    tokens this rank sends instead: with ranks sending alike, each rank's experts receive ``T * k`` rows in all,
    ``T * k / E_local`` each."""
    x_node, ids_node = block.args[:2]
    sent = dispatch_of(x_node)
    if sent is not None:
        x_node, ids_node = sent.args[0], sent.args[1]
    x, ids, weight = (tensor_val(a) for a in (x_node, ids_node, w13))
    if x is None or ids is None or weight is None:
        return "the block's shapes are unknown"
    answers = ask(fp8_ops.moe_experts_fp8, "keep_bf16", x, int(ids.shape[-1]), int(weight.shape[0]), aligned)
    return next((why for why in answers.values() if why is not None), None)


def fp8_prequantized(gm: fx.GraphModule, ctx: PassContext, weight: fx.Node
                     ) -> tuple[fx.Node, fx.Node, tuple[int, int]] | None:
    """``(codes, fp32 scales, (bn, bk))`` when ``weight`` is ``[cast](fp8_block_dequant(q fp8 [E,N,K], s, bn, bk))``
    with ``s`` [E, ceil(N/bn), ceil(K/bk)] (fp32, or another float dtype cast to fp32 in the graph)."""
    w = strip_casts(weight)
    if not (isinstance(w, fx.Node) and w.op == "call_function" and w.target is fp8_ops.fp8_block_dequant.op):
        return None
    q, s, bn, bk = w.args[:4]
    qv, sv = tensor_val(q), tensor_val(s)
    if qv is None or sv is None or qv.dtype != FP8 or qv.dim() != 3:
        return None
    if not (isinstance(bn, int) and isinstance(bk, int) and bn > 0 and bk > 0):
        return None
    e, n, k = qv.shape
    if tuple(sv.shape) != (e, cdiv(n, bn), cdiv(k, bk)) or not sv.dtype.is_floating_point:
        return None
    if sv.dtype != torch.float32:
        s = call(ctx, gm, aten._to_copy.default, (s,), {"dtype": torch.float32})
    return q, s, (bn, bk)

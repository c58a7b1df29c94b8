"""Quant: rewrite each routed-expert block to W8A8 int8 (``quant="w8a8_int8"``) or FP8 (``quant="fp8_block"``).

Runs after EP and before expand. Each ``ep_fuse::moe_experts(x, ids, w, w13, w2, out_dtype)`` becomes
``ep_fuse::moe_experts_w8a8(x, ids, w, w13_q, w13_scale, w2_q, w2_scale, out_dtype)``
(:mod:`ep_fuse.ops.w8a8`), which expand turns into ``moe_permute -> quant_per_token ->
grouped_gemm_w8a8_swiglu_quant -> grouped_gemm_w8a8 -> moe_unpermute``. Dense layers are untouched.

The int8 weights are the model's own where its expert weights are a dequantization ``q * s`` of int8
tensors (used as they are), else the bf16 weights evaluated from the graph's *static* inputs (parameters and
buffers) and quantized per output channel once, cached per source weights, and entered into the graph as constants
(:mod:`ep_fuse.passes.quant_weights`, :mod:`ep_fuse.passes.weight_eval`).

A block whose weights depend on activations, or whose weights the backend could not see (e.g.
``run_passes`` called without inputs), is left in bf16 with a warning.

**FP8** (``quant="fp8_block"``): each block becomes ``ep_fuse::moe_experts_fp8(x, ids, w, w13_q,
w13_scale, w2_q, w2_scale, block_n, block_k, out_dtype)`` (:mod:`ep_fuse.ops.fp8`), expanded into
``moe_permute_fp8 -> grouped_gemm_fp8_swiglu_quant -> grouped_gemm_fp8 -> moe_unpermute``. Weights
that are ``ep_fuse::fp8_block_dequant(q, scale_inv, bn, bk, dtype)`` of an fp8 tensor (what
:func:`ep_fuse.prepare` emits for transformers' ``FP8Experts``, optionally behind casts) are used as
they are, with their own block; every other weight is evaluated from the static inputs as above and
quantized once to E4M3 with 128 x 128 block scales
(:func:`ep_fuse.ops.fp8.quantize_weight_fp8`). Both weights of a block must share one
block shape (the activation group is its ``block_k``); otherwise the block stays unquantized. On CUDA, bf16
weights are quantized only where the FP8 experts measured faster (the providers' rule, asked through the registry:
:func:`ep_fuse.passes.quant_weights.fp8_not_faster`), and the permuted layout is aligned where a provider asks for
it (DeepGEMM). Behind an ``all_to_all`` or DeepEP-normal EP dispatch the activation quantization moves
before the dispatch (:func:`ep_fuse.passes.ep_fp8_dispatch.quantize_before_dispatch`: fp8 codes + scales on the
wire; the option ``ep_fp8_dispatch=False`` turns it off) and the block becomes ``moe_experts_fp8_q`` on the received codes and
scales.

The pass imports no provider: what only providers know (DeepGEMM's layout, the measured rule, which variants are
cleared for GPUs) it asks through :func:`ep_fuse.ops.registry.ask`, which the providers' modules fill.
"""

from __future__ import annotations

import logging

from torch import fx

from ep_fuse.fx_utils import op_args, tensor_val
from ep_fuse.ops import fp8 as fp8_ops
from ep_fuse.ops import moe as moe_ops
from ep_fuse.ops import w8a8 as w8a8_ops
from ep_fuse.ops.registry import ask
from ep_fuse.passes.base import GraphPass, PassContext
from ep_fuse.passes.ep import dispatch_of
from ep_fuse.passes.ep_fp8_dispatch import quantize_before_dispatch
from ep_fuse.passes.graph_edit import replace_node
from ep_fuse.passes.quant_weights import fp8_weights, int8_weight

log = logging.getLogger("ep_fuse.passes.quant")

class QuantizeExperts(GraphPass):
    name = "quant"

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> int:
        if ctx.config.quant is None:
            return 0

        block = moe_ops.moe_experts.op
        fp8 = ctx.config.quant == "fp8_block"
        target = fp8_ops.moe_experts_fp8.op if fp8 else w8a8_ops.moe_experts_w8a8.op
        changes = 0
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or node.target is not block:
                continue
            a = op_args(node)
            x, ids, w, w13, w2, out_dtype = (a[k] for k in ("x", "topk_ids", "topk_weights", "w13", "w2",
                                                             "out_dtype"))
            if a["act"] != "silu" or any(a[k] is not None for k in ("limit", "gate_cap", "up_cap")):
                log.info("ep_fuse: quant=%s keeps the MoE block at %s unquantized: its activation is %r, the "
                         "quantized experts compute plain SwiGLU only", ctx.config.quant, node.name, a["act"])
                continue
            with gm.graph.inserting_before(node):
                if fp8:
                    align, align_block = fp8_layout(ctx, node, w13, w2)
                    found = fp8_weights(gm, ctx, node, w13, w2, aligned=align > 1)
                    if found is None:
                        continue
                    (q13, s13), (q2, s2), (bn, bk) = found
                    sent = quantize_before_dispatch(gm, ctx, node, bk) if ctx.config.ep_fp8_dispatch else None
                    if sent is not None:  # the block on the received codes and scales
                        xq, xs, act_dtype = sent
                        new = gm.graph.call_function(fp8_ops.moe_experts_fp8_q.op,
                                                     (xq, xs, ids, w, q13, s13, q2, s2, bn, bk, act_dtype,
                                                      out_dtype))
                    else:
                        extra = (align,) if align > 1 and (bn, bk) == align_block else ()
                        new = gm.graph.call_function(target, (x, ids, w, q13, s13, q2, s2, bn, bk, out_dtype, *extra))
                else:
                    q13 = int8_weight(gm, ctx, w13, node, "w13")
                    q2 = int8_weight(gm, ctx, w2, node, "w2") if q13 is not None else None
                    if q13 is None or q2 is None:
                        continue
                    new = gm.graph.call_function(target, (x, ids, w, q13[0], q13[1], q2[0], q2[1], out_dtype))
            replace_node(ctx, gm, node, new)
            changes += 1
        if changes:
            gm.graph.eliminate_dead_code()
            gm.recompile()
            if fp8:
                _warn_fp8_reference(ctx.device)
        return changes


def fp8_layout(ctx: PassContext, block: fx.Node, w13: fx.Node, w2: fx.Node) -> tuple[int, tuple[int, int] | None]:
    """``(align, weight block)``: the permuted layout's row alignment for an FP8 block, and the weight block a
    provider needs to take it (question ``aligned_layout`` of ``moe_experts_fp8``, answered by DeepGEMM on CUDA:
    128 where it takes the block's GEMMs); ``(1, None)`` where no provider asks for one. Behind an EP dispatch the
    block keeps 1."""
    args = op_args(block)
    if ctx.device != "cuda" or dispatch_of(args["x"]) is not None:
        return 1, None
    x, ids, a13, a2 = (tensor_val(a) for a in (args["x"], args["topk_ids"], w13, w2))
    if ids is None:
        return 1, None
    answers = ask(fp8_ops.moe_experts_fp8, "aligned_layout", x, int(ids.shape[-1]), a13, a2)
    return next((a for a in answers.values() if a is not None), (1, None))


def _warn_fp8_reference(device: str) -> None:
    """Say once per graph when the FP8 expert GEMMs will run the pure-torch reference."""
    not_cleared = [why for why in ask(fp8_ops.moe_experts_fp8, "not_cleared", device).values() if why is not None]
    if device == "cuda" and not_cleared:
        log.warning("ep_fuse: quant='fp8_block' on CUDA: %s; the FP8 experts run the pure-torch reference (fp32 "
                    "dequantize + matmul per expert), which is correct but SLOW", not_cleared[0])
    elif device == "npu":
        log.warning("ep_fuse: quant='fp8_block' on Ascend: torch_npu documents no FP8 grouped matmul for Atlas "
                    "A2/A3 (docs/npu.md); the FP8 experts run the pure-torch reference, unverified on an NPU "
                    "(use quant='w8a8_int8' there)")

"""Attention masks computed from sizes alone, folded into SDPA's own causal flag.

Traced, Hugging Face models build their attention mask inside the graph even where the eager path passes none
(no padding mask, no cache: eager SDPA runs with ``is_causal=True``), so the compiled model runs SDPA's *masked*
kernel: it reads a ``[B, 1, S, S]`` bias and computes the blocks above the diagonal. On an H200 at 2048 tokens the
causal cuDNN kernel is 2.6x faster than the masked one (``docs/benchmarks.md``).

For each SDPA call with a mask, this pass finds what the mask is computed from. When that is constants and
static sizes only (no graph input: no padding mask, no caller-given positions, no cache position), it evaluates
the mask once at compile time and reads it:

* equal to SDPA's causal mask (square, the lower triangle, every batch and head): the same SDPA op with
  ``is_causal=True`` and no mask;
* true everywhere (one-token forwards, bidirectional layers): the same op without the mask.

Boolean masks and additive float masks (``0`` where allowed, :data:`BLOCKED` or below elsewhere) are read; anything
else keeps its mask, and the reason is in :attr:`~ep_fuse.report.GraphReport.attention_masks`.
The proof is exact (the evaluated mask equals the flag's mask element for element), the op and its output
layout stay the same (checked on the fake values), so only the kernel's reduction order changes.
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
import torch.fx as fx

from ep_fuse.fx_utils import op_args, tensor_val
from ep_fuse.passes.base import GraphPass, PassContext
from ep_fuse.passes.graph_edit import set_fake_vals

log = logging.getLogger(__name__)
aten = torch.ops.aten

MASK_ARG = {
    aten._scaled_dot_product_efficient_attention.default: "attn_bias",
    aten._scaled_dot_product_cudnn_attention.default: "attn_bias",
    aten._scaled_dot_product_flash_attention_for_cpu.default: "attn_mask",
    aten.scaled_dot_product_attention.default: "attn_mask",
}
"""The SDPA ops whose mask the pass reads, and the schema name of that mask."""

MAX_MASK_NODES = 256
"""At most this many ops compute one mask (HF's mask builders take a few dozen)."""
MAX_ELEMENTS = 1 << 28
"""No value on the way to a mask may hold more elements (the evaluation runs at compile time)."""

BLOCKED = -65504.0
"""An additive mask value at or below this blocks its key: fp16's lowest value, which PyTorch's cuDNN path writes for
a false entry of a bool mask (the memory-efficient and CPU paths write ``-inf``, HF's float masks the dtype's lowest
value). Added to a score, it leaves an fp32 softmax weight of exactly 0 unless the row's scores differ by more than
~65000, where the masked kernel and the model's own eager path (``is_causal``) already disagree."""
CAUSAL = "is_causal"
NO_MASK = "no mask"


def _ancestors(mask: fx.Node) -> list[fx.Node] | str:
    """The nodes ``mask`` is computed from, in graph order, or why it cannot be evaluated at compile time."""
    seen: dict[fx.Node, None] = {}
    stack = [mask]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        if n.op == "placeholder":
            return f"it reads the graph input {n.name}"
        if n.op == "get_attr":
            seen[n] = None
            continue
        if n.op != "call_function":
            return f"it reads {n.op} {n.name}"
        if n.target is not operator.getitem:
            if not isinstance(n.target, torch._ops.OpOverload):
                return f"it calls {n.target} ({n.name})"
            if n.target._schema.is_mutable or torch.Tag.nondeterministic_seeded in n.target.tags:
                return f"{n.name} ({n.target}) mutates or draws random numbers"
        v = tensor_val(n)
        if v is not None and (any(not isinstance(s, int) for s in v.shape) or v.numel() > MAX_ELEMENTS):
            return f"{n.name} has symbolic or more than {MAX_ELEMENTS} elements"
        seen[n] = None
        if len(seen) > MAX_MASK_NODES:
            return f"more than {MAX_MASK_NODES} ops compute it"
        stack.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def evaluate(gm: fx.GraphModule, mask: fx.Node) -> torch.Tensor | str:
    """The real value of ``mask`` (run at compile time), or why it has none without the graph's inputs."""
    nodes = _ancestors(mask)
    if isinstance(nodes, str):
        return nodes
    env: dict[fx.Node, Any] = {}
    with torch.no_grad():
        for n in nodes:
            if n.op == "get_attr":
                env[n] = getattr(gm, str(n.target))
                continue
            args = fx.node.map_arg(n.args, env.__getitem__)
            kwargs = fx.node.map_arg(n.kwargs, env.__getitem__)
            env[n] = n.target(*args, **kwargs)
    value = env[mask]
    return value if isinstance(value, torch.Tensor) else f"{mask.name} is not a tensor"


def read_mask(mask: torch.Tensor, q_len: int, kv_len: int) -> str:
    """:data:`CAUSAL`, :data:`NO_MASK`, or why ``mask`` (broadcast to ``[..., q_len, kv_len]``) is neither."""
    if mask.dtype == torch.bool:
        allowed = mask
    elif mask.is_floating_point():
        allowed = mask == 0
        blocked = mask <= BLOCKED
        if not bool((allowed | blocked).all()):
            return f"an additive mask with values other than 0 and <= {BLOCKED} (a bias, not a mask)"
    else:
        return f"a {mask.dtype} mask"
    try:
        allowed = torch.broadcast_to(allowed, (*allowed.shape[:-2], q_len, kv_len))
    except RuntimeError:
        return f"mask shape {tuple(mask.shape)} does not broadcast to [{q_len}, {kv_len}]"
    if bool(allowed.all()):
        return NO_MASK
    if q_len != kv_len:
        return f"not all true, and {q_len} queries against {kv_len} keys (SDPA's causal flag is square here)"
    causal = torch.ones(q_len, kv_len, dtype=torch.bool, device=allowed.device).tril()
    if torch.equal(allowed, causal.expand_as(allowed)):
        return CAUSAL
    return "neither causal nor all true (padding, a sliding window or another pattern)"


class FoldAttentionMasks(GraphPass):
    """SDPA calls whose mask is proved causal or all true run without it (module docstring)."""

    name = "attention_mask"

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> int:
        changed = 0
        readings: dict[tuple[fx.Node, int, int], str] = {}  # (mask, query length, key length) -> its reading
        sites = [n for target in MASK_ARG for n in gm.graph.find_nodes(op="call_function", target=target)]
        for node in sites:
            arg = MASK_ARG[node.target]
            args = op_args(node)
            mask = args.get(arg)
            if not isinstance(mask, fx.Node):
                continue
            if any(u.target is not operator.getitem or u.args[1] != 0 for u in node.users) and \
                    node.target is not aten.scaled_dot_product_attention.default:
                ctx.report.attention_masks[node.name] = "kept: more than the attention output is read"
                continue
            if args.get("is_causal") or (args.get("dropout_p") or 0.0) != 0.0:
                ctx.report.attention_masks[node.name] = "kept: already causal, or dropout"
                continue
            q, k = tensor_val(args["query"]), tensor_val(args["key"])
            if q is None or k is None or not isinstance(q.shape[-2], int) or not isinstance(k.shape[-2], int):
                ctx.report.attention_masks[node.name] = "kept: symbolic sequence lengths"
                continue
            key = (mask, q.shape[-2], k.shape[-2])
            if key not in readings:
                try:
                    value = evaluate(gm, mask)
                    readings[key] = value if isinstance(value, str) else read_mask(value, *key[1:])
                except Exception as exc:  # a mask that cannot be evaluated here stays: never a broken compile
                    readings[key] = f"its evaluation failed ({type(exc).__name__}: {str(exc)[:80]})"
            reading = readings[key]
            if reading not in (CAUSAL, NO_MASK):
                ctx.report.attention_masks[node.name] = f"kept: {reading}"
                continue
            if _drop_mask(ctx, node, arg, reading == CAUSAL):
                ctx.report.attention_masks[node.name] = reading
                changed += 1
            else:
                ctx.report.attention_masks[node.name] = "kept: the op's output layout would change"
        if changed:
            log.info("ep_fuse: graph %s: %d attention mask(s) folded into SDPA's flags", ctx.report.graph, changed)
        return changed


def _drop_mask(ctx: PassContext, node: fx.Node, arg: str, causal: bool) -> bool:
    """Drop ``node``'s mask (and set ``is_causal``) where its output keeps dtype, shape and strides; else leave it."""
    names = [a.name for a in node.target._schema.arguments]
    old_args, old_kwargs, old_val = node.args, dict(node.kwargs), node.meta.get("val")
    for name, value in ((arg, None), ("is_causal", True)) if causal else ((arg, None),):
        i = names.index(name)
        if i < len(node.args):
            node.update_arg(i, value)
        else:
            node.update_kwarg(name, value)
    set_fake_vals(ctx, node)
    if _layout(_output(old_val)) != _layout(_output(node.meta["val"])):
        node.args, node.kwargs = old_args, old_kwargs
        node.meta["val"] = old_val
        return False
    return True


def _output(v: Any) -> Any:
    """The attention output of an SDPA op's value (the fused ops return it first, then their statistics)."""
    return v[0] if isinstance(v, (tuple, list)) else v


def _layout(v: Any) -> Any:
    return (v.dtype, tuple(v.shape), tuple(v.stride())) if isinstance(v, torch.Tensor) else None

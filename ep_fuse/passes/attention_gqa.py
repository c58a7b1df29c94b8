"""One-query-row attention over repeated K/V heads, run with each K/V head's query heads as its query rows.

With grouped-query attention (``G = q heads / kv heads > 1``) Hugging Face's SDPA path repeats every K/V head ``G``
times (``repeat_kv``: ``unsqueeze -> expand -> clone -> view``, a copy of the whole K/V, cache included) whenever
it passes a mask, and SDPA's kernels then run one program per (batch, query head). At decode a head has one query
row, so the ``G`` query heads that share a K/V head are ``G`` independent softmax rows over the *same* keys and
values: they can be the ``G`` query rows of one head instead. Same rows, same keys, same arithmetic per row, but
``G`` times fewer programs, the K/V read once per group and no repeat copy. On an H200 (bf16) that is 2.9-4.2x on
a one-token forward and 14-29x at 64 rows over a 1024-token cache, bit for bit the same output
(``docs/benchmarks.md``).

For each SDPA call this pass rewrites it when all of these hold (else it records why not):

* key and value are head repeats of ``[B, Hkv, N, D]`` tensors with the same ``G``: the ``repeat_kv`` ops above or
  ``repeat_interleave`` over the heads, on that layout (HF) or on ``[B, N, Hkv, D]`` before the ``transpose(1, 2)``
  (the reference implementations of Llama and Mistral);
* one query row, no dropout, not ``is_causal``, only the attention output read;
* the mask, if any, is the same for every head (size 1, or stride 0, in the head dimension).

The query ``[B, Hq, 1, D]`` is viewed as ``[B, Hkv, G, D]``, the mask broadcast to ``[B, Hkv, G, N]``, the same op
runs on the un-repeated key and value, and its output is laid back out as ``[B, Hq, 1, D]`` with the replaced
output's strides (checked on the fake values).
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from typing import Any

import torch
import torch.fx as fx

from ep_fuse.fx_utils import op_args, tensor_val
from ep_fuse.passes.base import GraphPass, PassContext
from ep_fuse.passes.graph_edit import copy_source_meta, set_fake_vals
from ep_fuse.symbolic import concrete_int, same_shape

log = logging.getLogger(__name__)
aten = torch.ops.aten

MASK_ARG: dict[Any, str | None] = {
    aten._scaled_dot_product_efficient_attention.default: "attn_bias",
    aten._scaled_dot_product_cudnn_attention.default: "attn_bias",
    aten._scaled_dot_product_flash_attention.default: None,
    aten._scaled_dot_product_flash_attention_for_cpu.default: "attn_mask",
    aten.scaled_dot_product_attention.default: "attn_mask",
}
"""The SDPA ops this pass rewrites, and the schema name of their mask (``None``: the op takes none)."""

VIEWS = (aten._unsafe_view.default, aten.view.default, aten.reshape.default)


@dataclasses.dataclass(frozen=True)
class HeadRepeat:
    """A key or value that is ``source`` with each head repeated ``g`` times in a row."""

    source: fx.Node
    """The un-repeated tensor: ``[B, Hkv, N, D]``, or ``[B, N, Hkv, D]`` when ``seq_major``."""
    g: int
    seq_major: bool = False
    """The repeat ran before the ``transpose(1, 2)`` that puts the heads second (reference implementations repeat
    on ``[B, N, H, D]``); the packed call reads ``source.transpose(1, 2)``."""


def head_repeat(node: Any) -> HeadRepeat | None:
    """How ``node`` (a ``[B, Hkv * G, N, D]`` SDPA key or value) repeats the heads of a ``[B, Hkv, N, D]`` tensor:
    ``unsqueeze -> expand -> clone -> view`` or ``repeat_interleave`` over the head dimension, either on that layout
    or on ``[B, N, Hkv, D]`` followed by ``transpose(1, 2)``; else ``None``."""
    out = tensor_val(node)
    if out is None or out.dim() != 4 or not isinstance(node, fx.Node):
        return None
    seq_major = node.target is aten.transpose.int and sorted(d % 4 for d in node.args[1:3]) == [1, 2]
    rep = node.args[0] if seq_major else node
    axis = 2 if seq_major else 1  # the head axis of the repeated tensor
    found = _repeat_of(rep, axis)
    return HeadRepeat(found[0], found[1], seq_major) if found else None


def _repeat_of(node: Any, axis: int) -> tuple[fx.Node, int] | None:
    """``(source, G)`` where the 4-d ``node`` is ``source`` with each entry along ``axis`` repeated ``G`` times."""
    out = tensor_val(node)
    if not isinstance(node, fx.Node) or out is None or out.dim() != 4:
        return None
    if node.target is aten.repeat_interleave.self_int:
        args = op_args(node)
        src, reps, dim = args["self"], args["repeats"], args["dim"]
        sv = tensor_val(src)
        if sv is None or sv.dim() != 4 or not isinstance(dim, int) or dim % 4 != axis or not isinstance(reps, int) \
                or reps < 2 or concrete_int(sv.shape[axis]) is None:
            return None
        return src, reps
    if node.target not in VIEWS:
        return None
    n = node.args[0]
    if isinstance(n, fx.Node) and n.target is aten.clone.default:
        n = n.args[0]
    if not isinstance(n, fx.Node) or n.target is not aten.expand.default:
        return None
    unsq = n.args[0]
    if not isinstance(unsq, fx.Node) or unsq.target is not aten.unsqueeze.default or unsq.args[1] % 5 != axis + 1:
        return None
    src = unsq.args[0]
    sv, ev = tensor_val(src), tensor_val(n)
    if sv is None or ev is None or sv.dim() != 4 or ev.dim() != 5:
        return None
    shape = list(sv.shape)
    g, heads = concrete_int(ev.shape[axis + 1]), concrete_int(shape[axis])
    if g is None or g < 2 or heads is None:
        return None
    merged = shape[:axis] + [heads * g] + shape[axis + 1:]
    if not same_shape(tuple(ev.shape), tuple(shape[:axis + 1] + [g] + shape[axis + 1:])) or \
            not same_shape(tuple(out.shape), tuple(merged)):
        return None
    return src, g


def _candidate(node: fx.Node) -> tuple[HeadRepeat, HeadRepeat, int] | str | None:
    """``(key repeat, value repeat, G)`` for a packable call, the reason it is not, or ``None`` (no head repeat)."""
    args = op_args(node)
    k, v = head_repeat(args["key"]), head_repeat(args["value"])
    if k is None or v is None:
        return None
    if k.g != v.g:
        return "key and value repeat their heads differently"
    if node.target is not aten.scaled_dot_product_attention.default and \
            any(u.target is not operator.getitem or (u.args[1] != 0 and u.users) for u in node.users):
        return "more than the attention output is read"
    q = tensor_val(args["query"])
    if q is None or q.dim() != 4 or concrete_int(q.shape[-2]) is None:
        return "a symbolic number of query rows"
    if concrete_int(q.shape[-2]) != 1:
        return "more than one query row"
    if args.get("is_causal") or (args.get("dropout_p") or 0.0) != 0.0:
        return "causal or dropout"
    if concrete_int(q.shape[1]) is None or concrete_int(q.shape[-1]) is None or \
            concrete_int(q.shape[1]) != concrete_int(tensor_val(args["key"]).shape[1]):
        return "query and key head counts differ"
    mask_name = MASK_ARG[node.target]
    mask = args.get(mask_name) if mask_name else None
    if mask is not None:
        m = tensor_val(mask)
        if m is None or m.dim() != 4 or concrete_int(m.shape[-2]) != 1 or \
                (concrete_int(m.shape[1]) != 1 and concrete_int(m.stride(1)) != 0):
            return "the mask is not one row shared by every head"
        if concrete_int(m.shape[0]) == 1 and concrete_int(q.shape[0]) is None:
            return "a mask broadcast over a symbolic batch"
    return k, v, k.g


class PackGqaHeads(GraphPass):
    """One-query-row SDPA over repeated K/V heads runs on the un-repeated K/V (module docstring)."""

    name = "attention_gqa"

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> int:
        changed = 0
        sites = [n for target in MASK_ARG for n in gm.graph.find_nodes(op="call_function", target=target)]
        for node in sites:
            found = _candidate(node)
            if found is None:
                continue
            if isinstance(found, str):
                ctx.report.attention_gqa[node.name] = f"kept: {found}"
                continue
            k_rep, v_rep, g = found
            if _pack(gm, ctx, node, k_rep, v_rep, g):
                ctx.report.attention_gqa[node.name] = f"packed G={g}"
                changed += 1
            else:
                ctx.report.attention_gqa[node.name] = "kept: the op's output layout would change"
        if changed:
            log.info("ep_fuse: graph %s: %d one-row attention call(s) run on un-repeated K/V heads",
                     ctx.report.graph, changed)
        return changed


def _pack(gm: fx.GraphModule, ctx: PassContext, node: fx.Node, k_rep: HeadRepeat, v_rep: HeadRepeat, g: int
          ) -> bool:
    """Insert the packed call before ``node`` and route ``node``'s output users to it; ``False`` (graph unchanged)
    where the result would not have the replaced output's dtype, shape and strides."""
    graph = gm.graph
    args = op_args(node)
    q, old_k, old_v = args["query"], args["key"], args["value"]
    qv = tensor_val(q)
    b, hq, _, d = qv.shape
    hkv = hq // g
    tuple_out = node.target is not aten.scaled_dot_product_attention.default
    outs = [u for u in node.users if u.args[1] == 0] if tuple_out else [node]
    if len(outs) != 1:
        return False
    old_out = outs[0]
    names = [a.name for a in node.target._schema.arguments]
    new_args, new_kwargs = list(node.args), dict(node.kwargs)

    def put(name: str, value: Any) -> None:
        i = names.index(name)
        if i < len(new_args):
            new_args[i] = value
        else:
            new_kwargs[name] = value

    added: list[fx.Node] = []
    with graph.inserting_before(node):
        added.append(graph.call_function(aten.view.default, (q, [-1, hkv, g, d])))
        put("query", added[-1])
        for name, rep in (("key", k_rep), ("value", v_rep)):
            if rep.seq_major:
                added.append(graph.call_function(aten.transpose.int, (rep.source, 1, 2)))
            put(name, added[-1] if rep.seq_major else rep.source)
        mask_name = MASK_ARG[node.target]
        mask = args.get(mask_name) if mask_name else None
        if mask is not None:
            m = mask
            if concrete_int(tensor_val(mask).shape[1]) != 1:  # shared by the heads (stride 0): one of them
                added.append(graph.call_function(aten.slice.Tensor, (m, 1, 0, 1)))
                m = added[-1]
            mb = concrete_int(tensor_val(mask).shape[0])
            added.append(graph.call_function(aten.expand.default, (m, [b if mb == 1 else -1, hkv, g, -1])))
            put(mask_name, added[-1])
        added.append(graph.call_function(node.target, tuple(new_args), new_kwargs))
        if tuple_out:
            added.append(graph.call_function(operator.getitem, (added[-1], 0)))
    want = tensor_val(old_out)
    try:
        set_fake_vals(ctx, *added)
        # back to [B, Hq, 1, D]: a view where the kernel's output allows it, else a copy; then the replaced
        # output's strides (they differ at most in the size-1 query dimension)
        with graph.inserting_before(node):
            if not tensor_val(added[-1]).is_contiguous():
                added.append(graph.call_function(aten.clone.default, (added[-1],),
                                                 {"memory_format": torch.contiguous_format}))
                set_fake_vals(ctx, added[-1])
            added.append(graph.call_function(aten.view.default, (added[-1], [-1, hq, 1, d])))
            set_fake_vals(ctx, added[-1])
            if not same_shape(tuple(tensor_val(added[-1]).stride()), tuple(want.stride())):
                if any(concrete_int(v) is None for v in (*want.shape, *want.stride())):
                    raise ValueError("symbolic sizes: the output's strides cannot be restored")
                added.append(graph.call_function(aten.as_strided.default,
                                                 (added[-1], list(want.shape), list(want.stride()))))
                set_fake_vals(ctx, added[-1])
    except Exception as exc:  # an op that refuses the packed shapes: leave the call as it was
        log.debug("ep_fuse: packing %s failed on fake values: %s", node.name, exc)
        for n in reversed(added):
            graph.erase_node(n)
        return False
    got = tensor_val(added[-1])
    if got.dtype != want.dtype or not same_shape(tuple(got.shape), tuple(want.shape)) or \
            not same_shape(tuple(got.stride()), tuple(want.stride())):
        for n in reversed(added):
            graph.erase_node(n)
        return False
    copy_source_meta(node, *added)
    old_out.replace_all_uses_with(added[-1])
    if tuple_out:
        for u in list(node.users):  # the output and statistics nothing reads
            graph.erase_node(u)
    graph.erase_node(node)
    for n in (old_k, old_v):
        _erase_dead(graph, n)
    return True


def _erase_dead(graph: fx.Graph, node: Any) -> None:
    """Erase ``node`` and the ops only it used, while nothing else reads them (the repeat left behind)."""
    stack = [node]
    while stack:
        n = stack.pop()
        if not isinstance(n, fx.Node) or n.users or n.op != "call_function" or n.target is operator.getitem \
                or not isinstance(n.target, torch._ops.OpOverload) or n.target._schema.is_mutable:
            continue
        inputs = n.all_input_nodes
        graph.erase_node(n)
        stack.extend(inputs)

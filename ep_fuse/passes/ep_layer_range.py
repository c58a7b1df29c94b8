"""The decoder-layer range of the ``two_batch`` overlap: from the first EP block's ``[B, S, H]`` layer input to the
last block's combine, every node derived from that input with its batch dim, so that the range can be cloned per
micro-batch (``ep_fuse.passes.ep_overlap``; declined with :class:`RangeDeclined` where that is not proven)."""

from __future__ import annotations

import dataclasses
import operator
import re
from typing import Any

import torch
from torch import fx

from ep_fuse.fx_utils import module_path, op_args, val
from ep_fuse.passes.ep_blocks import EpBlock, ancestors, pure_call

aten = torch.ops.aten

class RangeDeclined(Exception):
    """The range split is not proven right on this graph (the message says why): per-block two_batch instead."""


SIZE_LIST_ARG = {aten.view.default: 1, aten._unsafe_view.default: 1, aten.reshape.default: 1,
                 aten.expand.default: 1, aten.new_zeros.default: 1, aten.new_ones.default: 1,
                 aten.new_empty.default: 1, aten.new_full.default: 1}
"""Ops whose size list (at this argument) names the batch in its first entry: ``B`` or ``B*S`` there becomes
the micro-batch's."""

ROW_INDEXING = {aten.index.Tensor, aten._unsafe_index.Tensor, aten.index_put.default}
"""Ops that index with tensors: a derived node may not index the batch dim with them (indices are batch-wide)."""

DIM_ARGS = ("dim", "dims", "dim0", "dim1", "start_dim")
"""Schema arguments naming the dims an op works along (dim 0 there: the op mixes or moves the batch)."""

KNOWN_NAMESPACES = ("aten", "prims", "ep_fuse")
"""Ops of other libraries (a varlen attention with ``cu_seqlens``, ...) may mix rows across sequences."""


@dataclasses.dataclass
class LayerRange:
    """What the range split found: the layer input, the batch, the derived (batch-carrying) nodes by stage."""

    h0: fx.Node
    batch: int
    seq: int
    blocks: list[EpBlock]
    derived: list[fx.Node]
    """Every node of the range that carries the batch, in graph order (EP nodes included)."""
    pre: list[list[fx.Node]]
    """Per block: the derived nodes before its dispatch (after the previous combine): attention, norms, router."""
    mid: list[list[fx.Node]]
    """Per block: derived nodes between dispatch and combine that are not the local block (not routed work)."""
    outputs: list[fx.Node]
    """Derived nodes read after the range (each becomes a ``cat`` of its two micro-batch values)."""
    labels: list[str]


def layer_label(block: EpBlock, index: int) -> str:
    """``L3`` for a block under ``...layers.3...``, else ``B<index>``."""
    path = (block.record.module_path if block.record else "") or module_path(block.combine)
    m = re.search(r"layers?[._](\d+)", path)
    return f"L{m.group(1)}" if m else f"B{index}"


def batch_rows(v: Any, batch: int, seq: int, part: int) -> int | None:
    """The leading size of ``v`` for a micro-batch of ``part`` sequences: ``part`` where it is ``batch``,
    ``part * seq`` where it is the flattened token count ``batch * seq``, else ``None`` (no batch role)."""
    if not isinstance(v, torch.Tensor) or v.dim() == 0 or not isinstance(v.shape[0], int):
        return None
    if v.shape[0] == batch:
        return part
    if v.shape[0] == batch * seq:
        return part * seq
    return None


def substituted(v: Any, batch: int, seq: int, part: int) -> Any:
    if isinstance(v, torch.Tensor):
        rows = batch_rows(v, batch, seq, part)
        return None if rows is None else (rows, *v.shape[1:])
    if isinstance(v, (tuple, list)):
        return tuple(substituted(e, batch, seq, part) for e in v)
    return v


def batch_dim_use(node: fx.Node) -> str | None:
    """Why ``node`` works along the batch dim (reduces, indexes, moves or concatenates it), else ``None``."""
    t = node.target
    first = next((val(a) for a in node.all_input_nodes if isinstance(val(a), torch.Tensor)), None)
    nd = first.dim() if isinstance(first, torch.Tensor) else 0
    if t is aten.permute.default:
        dims = list(node.args[1])
        return None if dims and nd and dims[0] % nd == 0 else "permutes the batch dim"
    if t in ROW_INDEXING:
        idx = node.args[1]
        return "indexes the batch dim with a tensor" if idx and idx[0] is not None else None
    if t is operator.getitem:
        return None
    if not isinstance(t, torch._ops.OpOverload) or t.namespace not in KNOWN_NAMESPACES:
        return f"is not an aten or ep_fuse op (its rows may mix sequences: {t})"
    if t in (aten.take.default, aten.as_strided.default):
        return "indexes the flattened tensor"
    if not nd:
        return None
    args = op_args(node)
    if t is aten.roll.default and not args.get("dims"):
        return "rolls the flattened tensor"
    for name in DIM_ARGS:
        d = args.get(name)
        dims = d if isinstance(d, (list, tuple)) else [d]
        if any(isinstance(x, int) and not isinstance(x, bool) and x % nd == 0 for x in dims):
            return f"works along dim 0 ({name}={d})"
    return None


def find_range(blocks: list[EpBlock], batch_hint: Any = None) -> LayerRange:
    """The layer range from the first EP block's layer input to the last block's combine, or
    :class:`RangeDeclined` saying why it cannot be split along the batch."""
    graph = blocks[0].dispatch.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    blocks = sorted(blocks, key=lambda b: order[b.dispatch])
    first, end = blocks[0].dispatch, blocks[-1].combine
    x = val(first.args[0])
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not all(isinstance(s, int) for s in x.shape):
        raise RangeDeclined("the first dispatch's tokens are not a static [T, H] tensor")
    tokens, hidden = x.shape
    # the layer input: the earliest [B, S, H] ancestor of the first dispatch's tokens
    cands = [a for a in ancestors(first.args[0], -1) | {first.args[0]}
             if (v := val(a)) is not None and isinstance(v, torch.Tensor) and v.dim() == 3
             and all(isinstance(s, int) for s in v.shape) and v.shape[2] == hidden
             and v.shape[0] * v.shape[1] == tokens]
    if not cands:
        raise RangeDeclined(f"no [B, S, {hidden}] layer input feeds the first dispatch's {tokens} tokens")
    h0 = min(cands, key=order.__getitem__)
    batch, seq = val(h0).shape[:2]
    if batch < 2:
        raise RangeDeclined(f"batch {batch} (one sequence, or packed / varlen sequences in one row): nothing to "
                            "split along the batch dim")
    ep_nodes: dict[fx.Node, int] = {}
    for k, b in enumerate(blocks):
        for n in (b.dispatch, *b.parts.values(), *b.local, b.combine):
            ep_nodes[n] = k
    derived: list[fx.Node] = []
    seen = {h0}
    lo, hi = order[h0], order[end]
    for n in list(graph.nodes)[lo + 1:hi + 1]:
        if any(a in seen for a in n.all_input_nodes):
            seen.add(n)
            derived.append(n)
    missing = [b.dispatch.name for b in blocks if b.dispatch not in seen]
    if missing:
        raise RangeDeclined(f"the tokens of {', '.join(missing)} do not come from the layer input {h0.name}")
    pre: list[list[fx.Node]] = [[] for _ in blocks]
    mid: list[list[fx.Node]] = [[] for _ in blocks]
    for n in derived:
        if n in ep_nodes:
            continue
        if n.op != "call_function" or not range_pure(n):
            raise RangeDeclined(f"{n.name} ({n.target}) is not a pure call (a mutation or a side effect)")
        why = batch_dim_use(n)
        if why is not None:
            raise RangeDeclined(f"{n.name} ({n.target}) {why}")
        v = val(n)
        if isinstance(v, (tuple, list)):
            used = {u.args[1] for u in n.users if u.target is operator.getitem}
            bad = [i for i in used if batch_rows(v[i], batch, seq, 1) is None]
        else:
            bad = [0] if batch_rows(v, batch, seq, 1) is None else []
        if bad:
            shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise RangeDeclined(f"{n.name} ({n.target}, {shape}) has no batch dim (its leading size is neither "
                                f"B={batch} nor B*S={batch * seq})")
        k = next((k for k, b in enumerate(blocks) if order[n] < order[b.combine]), None)
        if k is None:
            raise RangeDeclined(f"{n.name} lies after the last combine")
        (pre if order[n] < order[blocks[k].dispatch] else mid)[k].append(n)
    outputs = []
    for n in derived:
        if any(order[u] > hi for u in n.users):
            v = val(n)
            if n in ep_nodes and n is not blocks[ep_nodes[n]].combine:
                raise RangeDeclined(f"{n.name} of an EP block is read after the range")
            if not isinstance(v, torch.Tensor):
                raise RangeDeclined(f"{n.name} (not a tensor) is read after the range")
            outputs.append(n)
    return LayerRange(h0, batch, seq, blocks, derived, pre, mid, outputs,
                      [layer_label(b, k) for k, b in enumerate(blocks)])


def slice_spec(node: fx.Node, rng: LayerRange, params: set[str]) -> int | None:
    """The row unit (1 per sequence, ``S`` per flattened token) in which a value from outside the range is cut per
    micro-batch, or ``None`` where it is shared (weights, tables and masks without the batch dim)."""
    if node.op == "get_attr" or (node.op == "placeholder" and node.name in params):
        return None
    v = val(node)
    if batch_rows(v, rng.batch, rng.seq, 1) is None:
        return None
    return 1 if v.shape[0] == rng.batch else rng.seq


def range_pure(node: fx.Node) -> bool:
    """Pure enough to move and clone: a pure call, or a seeded one that draws nothing (attention, dropout 0)."""
    if pure_call(node):
        return True
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable:
        return False
    seeded = torch.Tag.nondeterministic_seeded in target.tags
    return seeded and op_args(node).get("dropout_p", None) in (0, 0.0)


def same_value(got: Any, want: Any, like: Any) -> bool:
    """``got`` (a micro-batch's fake value) has the shapes ``want`` and the dtypes of ``like`` (the original)."""
    if isinstance(like, torch.Tensor):
        return isinstance(got, torch.Tensor) and tuple(got.shape) == want and got.dtype == like.dtype
    return True

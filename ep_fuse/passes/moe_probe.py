"""Routed experts the graph computes but no pattern bound: found by what they compute, explained by semantic part.

After canonicalize, every router output of the graph -- the ids of a ``topk`` on the last dim, or of a fused
``moe_gating`` -- either reaches an ``ep_fuse`` expert block or it does not. Where it does not, but the ids select
experts (a gather of a stacked weight by the ids, a sort / one-hot / count of the ids, a grouped GEMM fed from them)
and a matrix product is computed from what they select, the graph holds an unfused routed-expert block. It is
reported as a near miss that names its parts: the router (fused or not), how the experts are selected and their
stacked weights, and what to do.

Binding such a block from the graph alone is not attempted: the forms that reach here keep their experts' weights
as separate tensors (``w1`` / ``w3`` / ``w2``, or one module per expert), while the canonical block takes gate and
up stacked in one ``[E, 2I, H]`` weight -- stacking them in the graph copies every expert's weights on every call.
``ep_fuse.prepare`` recognises these blocks on the module, proves each binding numerically and restacks the weights
once. Sizes are read without adding shape guards (a symbolic expert count is written ``E``).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from ep_fuse.fx_utils import module_path, target_name, tensor_val
from ep_fuse.ops.registry import canonical_for
from ep_fuse.report import NearMiss
from ep_fuse.symbolic import concrete_int

aten = torch.ops.aten

_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
          aten.squeeze.dim, aten.flatten.using_ints, aten.expand.default, aten.clone.default,
          aten._to_copy.default, aten.alias.default, aten.t.default, aten.transpose.int, aten.permute.default}
_INDEXING = {aten.sort.default, aten.sort.stable, aten.argsort.default, aten.argsort.stable,
             aten.one_hot.default, aten.eq.Scalar, aten.eq.Tensor, aten.bincount.default, aten.histc.default,
             aten.index.Tensor, aten.gather.default, aten.scatter.src, aten.scatter.value, aten.scatter_add.default,
             aten.index_add.default, aten.index_select.default, aten.where.self, aten.nonzero.default,
             aten._grouped_mm.default, aten.embedding.default}
_GEMMS = {aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default, aten.linear.default,
          aten.matmul.default, aten._grouped_mm.default}
REACH = 12
"""How many ops below the ids the probe follows (the deepest seen to the experts' first GEMM: views, a sort, a divide,
a gather, the grouped GEMM)."""


def router_ids(graph: fx.Graph) -> list[tuple[fx.Node, str, int | None]]:
    """``(ids node, router, experts)`` of each router output: ``getitem(topk, 1)`` of a top-k on the last dim, or
    ``getitem(moe_gating, 1)``; the expert count is ``None`` where it is symbolic."""
    out = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not operator.getitem or node.args[1] != 1:
            continue
        src = node.args[0]
        if not isinstance(src, fx.Node) or src.op != "call_function":
            continue
        canon = canonical_for(src.target)
        if canon is not None and canon.name == "moe_gating":
            logits = tensor_val(src.args[0])
            if logits is not None:
                out.append((node, f"fused: moe_gating at {src.name}", concrete_int(logits.shape[-1])))
        elif src.target is aten.topk.default:
            scores = tensor_val(src.args[0])
            dim = src.args[2] if len(src.args) > 2 else -1
            if scores is not None and dim in (-1, scores.dim() - 1) and scores.dim() >= 2:
                experts = concrete_int(scores.shape[-1])
                out.append((node, f"not fused: topk over {experts or 'E'} experts at {src.name}", experts))
    return out


def _router_internal(node: fx.Node) -> bool:
    """A ``gather`` / ``scatter`` along the last dim of a score tensor (``[T, E]``, or ``[T, G]`` of expert groups):
    the router picking or masking its own scores by the ids. Tokens go to their experts along dim 0."""
    if node.target not in (aten.gather.default, aten.scatter.src, aten.scatter.value):
        return False
    scores = tensor_val(node.args[0])
    return scores is not None and scores.dim() >= 2 and node.args[1] in (-1, scores.dim() - 1)


def _reach(ids: fx.Node) -> tuple[bool, list[fx.Node], bool]:
    """Whether ``ids`` reaches an ``ep_fuse`` expert block, the expert-selecting ops it feeds (graph order), and
    whether a matrix product is computed from them (the experts' GEMMs)."""
    seen: set[fx.Node] = set()
    frontier, indexing, block, gemm = [ids], [], False, False
    for _ in range(REACH):
        nxt = []
        for n in frontier:
            for u in n.users:
                if u in seen or u.op != "call_function":
                    continue
                seen.add(u)
                canon = canonical_for(u.target)
                if canon is not None and (canon.block or canon.engine or canon.name == "moe_experts_masked"):
                    block = True  # an expert block, or the EP dispatch in front of one
                    continue
                if u.target in _INDEXING and not _router_internal(u):
                    indexing.append(u)
                gemm = gemm or u.target in _GEMMS
                nxt.append(u)
        frontier = nxt
    order = {n: i for i, n in enumerate(ids.graph.nodes)}
    return block, sorted(indexing, key=order.__getitem__), gemm


def _expert_weights(indexing: list[fx.Node], experts: int | None) -> list[str]:
    """Shapes of the stacked ``[E, ...]`` graph inputs (through views and casts) the indexing ops select from or
    multiply by, e.g. ``[8, 64, 32]``."""
    shapes = []
    for n in indexing:
        for a in n.all_input_nodes:
            while a.op == "call_function" and a.target in _VIEWS and isinstance(a.args[0], fx.Node):
                a = a.args[0]
            v = tensor_val(a)
            if (a.op == "placeholder" and v is not None and v.dim() >= 3 and experts is not None
                    and concrete_int(v.shape[0]) == experts):
                shapes.append(str(list(v.shape)))
    return list(dict.fromkeys(shapes))


def unbound_experts(graph: fx.Graph, graph_id: str) -> list[NearMiss]:
    """A near miss for each router whose ids select experts that no ``ep_fuse`` block computes."""
    misses = []
    for ids, router, experts in router_ids(graph):
        block, indexing, gemm = _reach(ids)
        if block or not indexing or not gemm:
            continue
        ops = ", ".join(dict.fromkeys(target_name(n.target) for n in indexing[:6]))
        weights = _expert_weights(indexing, experts)
        selected = f"{experts or 'E'} experts selected by the ids through {ops}" + (
            f" from the stacked weights {', '.join(weights)}" if weights else "")
        note = (f"routed experts not fused. router: {router}. experts: {selected}. combine: not reached (the "
                "experts are not bound). No pattern binds this form from the graph alone (binding it there would "
                "restack the expert weights on every call). ep_fuse.prepare(model), called before torch.compile, "
                "recognises such blocks by what they compute, proves the binding on random inputs and stacks the "
                "weights once; where the model was prepared, prepare's log says which part (router / experts / "
                "combine) it could not bind")
        misses.append(NearMiss(graph_id, ids.name, "routed experts", module_path(indexing[0]), [], note,
                               ["moe_experts"]))
    return misses

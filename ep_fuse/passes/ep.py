"""Expert parallelism: rewrite each canonical MoE block into dispatch -> local experts -> combine.

Runs after canonicalization, before Expand. For every ``ep_fuse::moe_experts(x, ids, w, w13, w2, dt)``
whose weights hold this rank's ``E_r`` experts (``ep_fuse.shard_experts``) and whose ids are global::

    recv_x, recv_ids, recv_w, handle = ep_dispatch(x, ids, w, E, group, engine, layout, C, timeout)
    y   = moe_experts(recv_x, recv_ids, recv_w, w13, w2, dt')     # local ids, -1 = elsewhere / padding
    out = ep_combine(y, handle, ids, w, E, group, engine, layout, C, timeout, dt'')

Routing weights are applied exactly once (``docs/ep.md``): ``rank`` layout (all_to_all,
DeepEP normal) in the local unpermute (non-local slots carry weight 0 / id -1) and combine sums
unweighted; ``expert`` layout (DeepEP low-latency, Ascend) runs the experts with unit weights and
combine weights on the source rank. The engine is chosen here, once, identically on every rank.

Without EP (no ``ep``/``ep_group`` option, or a group of one rank) nothing is inserted; a block whose
router scores more experts than its weights hold (a sharded model compiled without EP) is an error.
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
from torch import fx

from ep_fuse.ep import groups
from ep_fuse.ep.groups import EpError
from ep_fuse.ops.ep import ep_combine, ep_dispatch, ep_engine
from ep_fuse.fx_utils import module_path, op_args, source_meta, val
from ep_fuse.ops import moe as moe_ops
from ep_fuse.ops.registry import canonical_ops
from ep_fuse.passes.base import GraphPass, PassContext
from ep_fuse.passes.ep_masked import masked_decline, masked_experts
from ep_fuse.passes.graph_edit import copy_source_meta, mark_ep_block, set_fake_vals
from ep_fuse.report import EpRecord

log = logging.getLogger("ep_fuse.passes")
aten = torch.ops.aten

_PASS_THROUGH = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten._to_copy.default,
                 aten.clone.default, aten.alias.default, torch.ops.prims.convert_element_type.default}


def ep_sites(report: Any) -> list[EpRecord]:
    """EP rewrites recorded on a :class:`~ep_fuse.report.GraphReport` (its ``ep`` list)."""
    return list(report.ep)


def router_width(ids: Any) -> int | None:
    """Experts the router scored (last dim of the ``topk`` / ``moe_gating`` input that produced ``ids``)."""
    gating = canonical_ops().get("moe_gating")
    node = ids
    for _ in range(16):
        if not isinstance(node, fx.Node) or node.op != "call_function":
            return None
        if node.target in _PASS_THROUGH:
            node = node.args[0]
            continue
        if node.target is operator.getitem and node.args[1] == 1 and isinstance(node.args[0], fx.Node):
            src = node.args[0]
            if src.target is aten.topk.default or (gating is not None and src.target is gating.op):
                scores = val(src.args[0])
                if isinstance(scores, torch.Tensor) and scores.dim() >= 1:
                    dim = src.args[2] if src.target is aten.topk.default and len(src.args) > 2 else -1
                    if dim in (-1, scores.dim() - 1):
                        try:
                            return int(scores.shape[-1])
                        except Exception:
                            return None
        return None
    return None


def dispatch_of(recv: Any) -> fx.Node | None:
    """The ``ep_dispatch`` node whose received tokens (output 0) ``recv`` is, else ``None`` (a block behind the
    dispatch this pass inserts reads them)."""
    if not (isinstance(recv, fx.Node) and recv.target is operator.getitem and recv.args[1] == 0):
        return None
    d = recv.args[0]
    return d if isinstance(d, fx.Node) and d.target is ep_dispatch.op else None


FALLBACKS = {
    "deepep_low_latency": ("deepep_low_latency", "deepep", "all_to_all"),
    "deepep": ("deepep", "all_to_all"),
    "npu": ("npu", "all_to_all"),
    "symm_mem": ("symm_mem", "all_to_all"),
    "all_to_all": ("all_to_all",),
}
"""What an explicitly requested engine falls back to, in order, when it cannot run a block (a
low-latency capacity DeepEP cannot hold takes DeepEP normal mode before all_to_all)."""


MEASURED_AUTO: dict[tuple[int, bool], tuple[str, ...]] = {
    (2, True): ("all_to_all",),
    (2, False): ("deepep", "all_to_all"),
}
"""``auto`` on CUDA where it was measured: ``(ranks, capacity set) -> engines, fastest first``.
``bench/bench_ep.py`` on 2 GPUs with NVLink (``docs/ep.md``), per-rank EP MoE layer, Inductor executor:
with a capacity (CUDA graphs) the Triton-indexed NCCL all_to_all was fastest at every shape
(DeepSeek-V3 decode 2847 us vs DeepEP normal 2895, low-latency 4017, symm_mem 3644; prefill 8218 vs
DeepEP 8275; Qwen3-30B-A3B decode 233 vs 250 / 377, prefill 1134 vs 1403); data-dependent sizes:
DeepEP normal (Qwen3-30B-A3B prefill 1500 vs 2069 us; DeepSeek-V3 prefill 8462 vs 8233, within
DeepEP's own run-to-run spread)."""


def auto_order(device: str, capacity: int, world: int = 0) -> tuple[str, ...]:
    """``ep_engine="auto"``: the engines tried, fastest first, for a graph on ``device``.

    Measured group sizes follow :data:`MEASURED_AUTO`; elsewhere DeepEP comes first (low-latency with a
    capacity, then normal), then all_to_all. ``symm_mem`` is never chosen automatically: it ran slower
    than all_to_all at every measured shape (request it explicitly)."""
    if device == "cuda":
        measured = MEASURED_AUTO.get((world, bool(capacity)))
        if measured is not None:
            return measured
        return (("deepep_low_latency",) if capacity else ()) + ("deepep", "all_to_all")
    if device == "npu":
        return ("npu", "all_to_all")
    return ("all_to_all",)


def choose_engine(
    requested: str, device: str, x: Any, ids: Any, block_dtype: Any, world: int, num_experts: int, capacity: int
) -> tuple[str, str, list[tuple[str, str]]]:
    """``(engine, layout, declined)`` for one block, decided from static shapes and options only (so
    every rank decides alike); raises when an explicitly requested runtime is missing."""
    if requested == "auto":
        order = auto_order(device, capacity, world)
    else:
        why = ep_engine(requested).available()
        if why:
            raise EpError(f"ep_fuse: ep_engine={requested!r} but {why}. Install it, or use ep_engine="
                          "'all_to_all' / 'auto'.")
        order = FALLBACKS[requested]
    declined: list[tuple[str, str]] = []
    for name in order:
        prov = ep_engine(name)
        why = prov.available() or prov.supports(x, ids, block_dtype, world, num_experts, capacity)
        if why is None:
            if requested != "auto" and declined:
                log.warning("ep_fuse: %s cannot run this MoE block (%s); using %s", requested, declined[0][1], name)
            return name, prov.layout, declined
        declined.append((name, why))
    raise EpError(f"ep_fuse: no EP engine can run this MoE block: {declined}")


def behind_dispatch(block: fx.Node, depth: int = 8) -> bool:
    """Whether the tokens or ids of ``block`` come from an ``ep_dispatch`` (within ``depth`` producers, not through
    an ``ep_combine``: a previous layer): a block already local to this rank, never rewritten again."""
    seen: set[fx.Node] = set()
    todo = [(a, 0) for a in block.args[:3] if isinstance(a, fx.Node)]
    while todo:
        n, d = todo.pop()
        if n in seen or d > depth or n.op != "call_function" or n.target is ep_combine.op:
            continue
        seen.add(n)
        if n.target is ep_dispatch.op:
            return True
        todo.extend((a, d + 1) for a in n.args if isinstance(a, fx.Node))
    return False


def placed_sites(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node, fx.Node]]:
    """``(dispatch, local block, combine)`` triples already in the graph in the ``rank`` layout (placed by model
    code: transformers' native EP with ``ep_implementation="ep_fuse"``, ``ep_fuse/hf/expert_parallel.py``)."""
    out = []
    for y in gm.graph.nodes:
        if y.op != "call_function" or y.target is not moe_ops.moe_experts.op:
            continue
        ya = op_args(y)
        d = dispatch_of(ya["x"])
        if d is None or op_args(d)["layout"] != "rank":
            continue
        gets = {u.args[1]: u for u in d.users if u.target is operator.getitem}
        if not (gets.get(1) is ya["topk_ids"] and gets.get(2) is ya["topk_weights"] and 3 in gets):
            continue
        combines = [u for u in gets[3].users if u.target is ep_combine.op]
        if len(combines) != 1 or list(y.users) != combines:
            continue
        c = combines[0]
        if any(set(g.users) - {y, c} for g in gets.values()) or len(gets) != len(d.users):
            continue  # the received rows are read elsewhere too: leave the triple as it is
        ca, da = op_args(c), op_args(d)
        shared = ("num_experts", "group_name", "engine", "layout", "capacity", "timeout_s")
        same = (ca["y"] is y and ca["topk_ids"] is da["topk_ids"] and ca["topk_weights"] is da["topk_weights"]
                and all(ca[k] == da[k] for k in shared))
        if same and ca["out_dtype"] is None:
            out.append((d, y, c))
    return out


def adopt_placed(gm: fx.GraphModule, ctx: PassContext) -> list[tuple[fx.Node, Any, int, float]]:
    """Turn each placed triple back into the global block it computes (``moe_experts`` on the dispatch's inputs,
    the local weights), so that the rewrite re-chooses its engine from ``ep_engine``; returns ``(block, group,
    capacity, timeout)`` per site (the capacity and timeout the model code gave, unless the options set them)."""
    sites = []
    for d, y, c in placed_sites(gm):
        x, ids, w, _e, group_name, _backend, _layout, cap, timeout = d.args
        with gm.graph.inserting_before(c):
            g = gm.graph.call_function(moe_ops.moe_experts.op, (x, ids, w, *y.args[3:]))
        g.meta.update(source_meta(y))
        g.meta["val"] = c.meta.get("val")
        c.replace_all_uses_with(g)
        for n in (c, y, *[u for u in d.users], d):
            gm.graph.erase_node(n)
        records = ctx.match_by_node.pop(y.name, [])
        if records:
            ctx.match_by_node[g.name] = records
        cfg = ctx.config
        sites.append((g, groups.resolve_group(group_name), cfg.ep_capacity or cap,
                      float(cfg.ep_timeout_s) if cfg.ep_requested else float(timeout)))
    return sites


class ExpertParallel(GraphPass):
    name = "ep"

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> int:
        op = moe_ops.moe_experts.op
        placed = adopt_placed(gm, ctx)
        adopted = {node for node, *_ in placed}
        # a block behind a dispatch (placed in a form not adopted) is already local: never rewritten twice
        blocks = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is op and n not in adopted
                  and not behind_dispatch(n)]
        for node, group, cap, timeout in placed:
            self._rewrite(gm, node, group, group.size(), ctx, cap, timeout)
        if not blocks:
            return len(placed)
        cfg = ctx.config
        world = 1
        group = None
        if cfg.ep_requested:
            if groups.initialized():
                group = groups.resolve_group(cfg.ep_group)
                world = group.size()
            elif cfg.ep_group is not None:
                raise EpError("ep_fuse: ep_group is set but torch.distributed is not initialised")
            if world == 1:
                log.info("ep_fuse: EP requested on a group of one rank: MoE blocks stay local")
        for node in blocks:
            args = op_args(node)
            local, routed = int(val(args["w13"]).shape[0]), router_width(args["topk_ids"])
            if world == 1:
                if routed is not None and routed > local:
                    raise EpError(
                        f"ep_fuse: the MoE block at {module_path(node) or node.name} routes over {routed} experts "
                        f"but holds {local}: its experts were sharded (ep_fuse.shard_experts) and EP is off. "
                        "Compile with options={**ep_fuse.ep_options(model), ...} on every rank of the EP group.")
                continue
            if routed is not None and routed != world * local:
                raise EpError(
                    f"ep_fuse: the MoE block at {module_path(node) or node.name} routes over {routed} experts, "
                    f"but {world} ranks x {local} local experts = {world * local}. Shard the experts with "
                    "ep_fuse.shard_experts(model, group) over the same group given as ep_group.")
        if world == 1:
            return len(placed)
        for node in blocks:
            self._rewrite(gm, node, group, world, ctx)
        return len(placed) + len(blocks)

    def _rewrite(self, gm: fx.GraphModule, node: fx.Node, group: Any, world: int, ctx: PassContext,
                 capacity: int | None = None, timeout_s: float | None = None) -> None:
        graph = gm.graph
        x, ids, w, w13, w2, out_dtype = (list(node.args) + [None] * 6)[:6]
        activation = tuple(node.args[6:])  # (act, limit, gate_cap, up_cap) where not SwiGLU: kept as it is
        xv, idv, wv = val(x), val(ids), val(w)
        local = int(val(w13).shape[0])
        num_experts = world * local
        cfg = ctx.config
        cap = (cfg.ep_capacity or 0) if capacity is None else capacity
        block_dtype = out_dtype or torch.promote_types(xv.dtype, wv.dtype)
        engine, layout, declined = choose_engine(cfg.ep_engine, ctx.device, xv, idv, block_dtype, world,
                                                   num_experts, cap)
        common = (num_experts, group.group_name, engine, layout, cap,
                  float(cfg.ep_timeout_s if timeout_s is None else timeout_s))
        w13v, w2v = val(w13), val(w2)
        why_not_masked = masked_decline(engine, layout, xv, idv, w13v, w2v, world, cap, activation, ctx)
        with graph.inserting_before(node):
            d = graph.call_function(ep_dispatch.op, (x, ids, w, *common))
            parts = [graph.call_function(operator.getitem, (d, i)) for i in range(4)]
            if why_not_masked is None:  # the expert-major receive buffer read in place (passes/ep_masked.py)
                local_nodes, y = masked_experts(graph, parts[0], parts[1], w13, w2, activation, xv, idv, local,
                                                world, cap)
            else:
                experts_dtype = out_dtype if layout == "rank" else xv.dtype
                y = graph.call_function(moe_ops.moe_experts.op,
                                        (parts[0], parts[1], parts[2], w13, w2, experts_dtype, *activation))
                local_nodes = [y]
            out = graph.call_function(ep_combine.op, (local_nodes[-1], parts[3], ids, w, *common,
                                                      None if layout == "rank" else out_dtype))
        copy_source_meta(node, d, *parts, *local_nodes, out)
        set_fake_vals(ctx, d, *parts, *local_nodes, out)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        records = ctx.match_by_node.pop(node.name, [])
        if records:
            ctx.match_by_node[y.name] = records
            for r in records:
                r.fused_node = y.name
        rec = EpRecord(block=y.name, module_path=module_path(y), engine=engine, layout=layout,
                       requested=cfg.ep_engine, num_experts=num_experts, local_experts=local, world=world,
                       capacity=cap, declined=declined,
                       local_block="moe_experts" if why_not_masked else "moe_experts_masked")
        mark_ep_block(rec, d, y)
        ctx.report.ep.append(rec)
        ctx.report.contracts.update(ep_engine(engine).contracts)
        log.info("ep_fuse: EP at %s: %s (%s layout), %d of %d experts per rank x %d ranks, capacity %s, local %s%s",
                 rec.module_path or rec.block, engine, layout, local, num_experts, world, cap or "data-dependent",
                 rec.local_block, f" (not masked: {why_not_masked})" if why_not_masked and layout == "expert" else "")

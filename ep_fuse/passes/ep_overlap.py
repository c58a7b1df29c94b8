"""Overlap EP communication with compute: split each ``ep_dispatch`` / ``ep_combine`` into a start and a wait and
schedule work between them (option ``ep_overlap``; ``docs/ep.md``, "Overlap").

Runs after the EP pass (and the quant pass), before Expand. Per EP block (``ep_dispatch`` -> local block ->
``ep_combine``):

* ``shared``: the work of the graph that does not depend on the block's routed tokens (shared experts, a
  gate over the input, ...) and sits before the next EP block moves between ``ep_dispatch_start`` and
  ``ep_dispatch_wait``, and its later part (by GEMM cost, about half) between ``ep_combine_start`` and
  ``ep_combine_wait``::

      s = ep_dispatch_start(x, ...); <shared GEMMs, first half>; recv = ep_dispatch_wait(s, x, ...)
      y = <local experts>(recv); c = ep_combine_start(y, ...); <the rest>; out = ep_combine_wait(c, y, ...)

* ``two_batch``: the block's tokens are split into two micro-batches (sizes from the token count, or with
  ``ep_capacity`` from the capacity, so every rank issues the same collectives) and interleaved::

      start(d0); start(d1); <independent work>; wait(d0); experts(mb0); start(c0)
      wait(d1); experts(mb1); start(c1); wait(c0); wait(c1); out = cat(out0, out1)

  The dispatch of micro-batch 1 runs under the experts of micro-batch 0, the combine of 0 under the experts
  of 1. The split is per MoE block (router, attention and the rest of the layer run once on all tokens); a
  block whose micro-batch would be empty on some rank stays one batch.
* ``auto``: per block and token count from :data:`MEASURED_RULES` (no rule measured yet: ``none``).

Engines without an async form on the graph's device keep the synchronous ops (one INFO line). Each decision
and the schedule is recorded on the block's :class:`~ep_fuse.report.EpRecord` (``overlap``, ``schedule``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator
import sys
from collections.abc import Iterable
from typing import Any

import torch
from torch import fx

from ep_fuse.fx_utils import module_path, val
from ep_fuse.ops import ep as ep_ops
from ep_fuse.ops.ep import EpError
from ep_fuse.ops.registry import canonical_ops
from ep_fuse.passes.base import GraphPass, PassContext
from ep_fuse.report import EpRecord

log = logging.getLogger("ep_fuse.passes")
aten = torch.ops.aten

GEMMS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.matmul.default, aten.linear.default,
         aten._grouped_mm.default}


@dataclasses.dataclass(frozen=True)
class OverlapRule:
    """``ep_overlap="auto"``: on ``device`` with ``engine``, use ``mode`` from ``min_tokens`` tokens per rank."""

    device: str
    engine: str
    mode: str
    min_tokens: int
    """A :class:`ep_fuse.providers.measured.Threshold` (an ``int`` carrying its evidence and bench command)."""


MEASURED_RULES: list[OverlapRule] = []
"""What ``auto`` follows, first match wins. Empty: ``bench/bench_ep.py --overlap`` has not run on a GPU yet, so
no mode is known to be faster than ``none`` anywhere and ``auto`` keeps ``none`` (and says so in the record)."""


@dataclasses.dataclass
class EpBlock:
    """One EP block of the graph: the dispatch, its outputs, the local nodes between, and the combine."""

    dispatch: fx.Node
    parts: dict[int, fx.Node]
    local: list[fx.Node]
    combine: fx.Node
    record: EpRecord | None


def find_blocks(graph: fx.Graph, records: list[EpRecord]) -> list[EpBlock]:
    """Every ``ep_dispatch`` whose handle feeds one ``ep_combine``, with the nodes between them on the path."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    blocks = []
    unclaimed = list(records)
    for d in [n for n in graph.nodes if n.target is ep_ops.ep_dispatch.op]:
        parts = {u.args[1]: u for u in d.users if u.target is operator.getitem}
        handle = parts.get(3)
        combines = [u for u in (handle.users if handle is not None else ()) if u.target is ep_ops.ep_combine.op]
        if len(combines) != 1 or len(parts) != len(d.users):
            continue
        c = combines[0]
        down = _descendants(d, order[c])
        up = _ancestors(c.args[0], order[d])
        local = sorted((down & up) - set(parts.values()), key=order.__getitem__)
        names = {n.name for n in local}
        rec = next((r for r in unclaimed if r.block in names), unclaimed[0] if unclaimed else None)
        if rec is not None:
            unclaimed.remove(rec)
        blocks.append(EpBlock(d, parts, local, c, rec))
    return blocks


def _descendants(node: fx.Node, limit: int | None = None) -> set[fx.Node]:
    seen, stack = set(), [node]
    order = None if limit is None else {n: i for i, n in enumerate(node.graph.nodes)}
    while stack:
        for u in stack.pop().users:
            if u not in seen and (order is None or order[u] < limit):
                seen.add(u)
                stack.append(u)
    return seen


def _ancestors(node: Any, stop: int) -> set[fx.Node]:
    order = {n: i for i, n in enumerate(node.graph.nodes)} if isinstance(node, fx.Node) else {}
    seen, stack = set(), [node] if isinstance(node, fx.Node) else []
    while stack:
        n = stack.pop()
        if n in seen or order[n] <= stop:
            continue
        seen.add(n)
        stack.extend(a for a in n.all_input_nodes)
    return seen


def _pure(node: fx.Node) -> bool:
    if node.op != "call_function" or node.is_impure():
        return False
    schema = getattr(node.target, "_schema", None)
    return not (schema is not None and schema.is_mutable)


def independent_work(block: EpBlock) -> list[fx.Node]:
    """The pure nodes after the dispatch, before the next EP dispatch, that depend neither on the block's routed
    tokens nor on anything after the dispatch but themselves: work that can run while the tokens travel."""
    graph = block.dispatch.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    start = order[block.dispatch]
    after_d = _descendants(block.dispatch)
    picked: list[fx.Node] = []
    chosen: set[fx.Node] = set()
    for n in list(graph.nodes)[start + 1:]:
        if n.target is ep_ops.ep_dispatch.op or n.op == "output":
            break
        if n in after_d or not _pure(n):
            continue
        if all(order[a] < start or a in chosen for a in n.all_input_nodes):
            picked.append(n)
            chosen.add(n)
    return picked if any(gemm_like(n) for n in picked) else []


def gemm_like(node: fx.Node) -> bool:
    """A GEMM or a fused canonical op (not an EP op): the work worth placing under a transfer."""
    return node.target in GEMMS or any(node.target is c.op for c in canonical_ops().values() if not c.engine)


def cost(node: fx.Node) -> float:
    """A GEMM-like node's multiply-adds (output elements x the first input's last dim), else 0."""
    if not gemm_like(node):
        return 0.0
    out, first = val(node), val(node.args[0]) if node.args else None
    if isinstance(out, (tuple, list)):
        out = out[0]
    if not isinstance(out, torch.Tensor) or not isinstance(first, torch.Tensor) or first.dim() == 0:
        return 0.0
    try:
        return float(out.numel()) * float(first.shape[-1])
    except Exception:  # symbolic sizes: count it, weight unknown
        return 1.0


def split_by_cost(nodes: list[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
    """``(under the dispatch, under the combine)``: in graph order, the first part up to about half the GEMM cost
    (the GEMM that crosses it included), the rest after."""
    total = sum(cost(n) for n in nodes)
    acc = 0.0
    for i, n in enumerate(nodes):
        acc += cost(n)
        if total and acc >= total / 2:
            return nodes[:i + 1], nodes[i + 1:]
    return nodes, []


def _names(nodes: Iterable[fx.Node]) -> str:
    heavy = [n.name for n in nodes if gemm_like(n)]
    return ", ".join(heavy) if heavy else "nothing"


class EpOverlap(GraphPass):
    name = "ep_overlap"
    _mutating = False

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> int:
        mode = ctx.config.ep_overlap
        if mode == "none":
            return 0
        blocks = find_blocks(gm.graph, list(ctx.report.ep))
        changed = 0
        sync_said: set[str] = set()
        for block in blocks:
            self._mutating = False
            try:
                changed += self._block(gm, block, mode, ctx, sync_said)
            except Exception as exc:  # noqa: BLE001 - a failed analysis keeps the block synchronous
                if self._mutating:
                    raise EpError(f"ep_fuse: ep_overlap failed while rewriting the EP block at "
                                  f"{module_path(block.combine) or block.combine.name} ({type(exc).__name__}: {exc}); "
                                  "compile with ep_overlap='none' and please report it") from exc
                log.warning("ep_fuse: ep_overlap left the EP block at %s synchronous (%s: %s)",
                            module_path(block.combine) or block.combine.name, type(exc).__name__, exc)
                if block.record is not None:
                    block.record.overlap, block.record.overlap_reason = "none", f"analysis failed: {exc}"
        if changed:
            gm.graph.lint()
        return changed

    def _block(self, gm: fx.GraphModule, block: EpBlock, mode: str, ctx: PassContext, sync_said: set[str]) -> int:
        rec = block.record
        backend, cap = block.dispatch.args[5], int(block.dispatch.args[7])
        chosen, why = self._choose(mode, block, ctx)
        if chosen != "none" and ep_ops.ep_async(backend, ctx.device) is None:
            if backend not in sync_said:
                log.info("ep_fuse: EP engine %s has no async form on %s: its blocks keep the synchronous "
                         "dispatch/combine (no overlap)", backend, ctx.device)
                sync_said.add(backend)
            chosen, why = "none", f"{backend} has no async form on {ctx.device}"
        if chosen == "two_batch":
            reason = self._two_batch_blocker(block, cap)
            if reason is not None:
                log.info("ep_fuse: two_batch at %s stays one batch (%s); shared overlap instead",
                         module_path(block.combine) or block.combine.name, reason)
                chosen, why = "shared", f"two_batch declined: {reason}"
        schedule: list[str] = []
        if chosen == "shared":
            schedule = self._shared(gm.graph, block, ctx)
            if not schedule:
                chosen, why = "none", (why + "; " if why else "") + "no work independent of the routed tokens"
        elif chosen == "two_batch":
            schedule = self._two_batch(gm.graph, block, ctx, cap)
        if rec is not None:
            rec.overlap, rec.overlap_reason, rec.schedule = chosen, why, schedule
        log.info("ep_fuse: EP overlap at %s: %s%s", (rec.module_path if rec else "") or block.combine.name,
                 chosen, f" ({why})" if why else "")
        return int(chosen != "none")

    # ------------------------------------------------------------------ decisions
    @staticmethod
    def _choose(mode: str, block: EpBlock, ctx: PassContext) -> tuple[str, str]:
        if mode != "auto":
            return mode, ""
        backend = block.dispatch.args[5]
        tokens = int(block.dispatch.args[7]) or _static_rows(block.dispatch.args[1])  # alike on every rank
        for rule in MEASURED_RULES:
            if rule.device == ctx.device and rule.engine == backend and tokens is not None \
                    and tokens >= rule.min_tokens:
                return rule.mode, (f"auto: {rule.mode} from {int(rule.min_tokens)} tokens "
                                    f"({getattr(rule.min_tokens, 'evidence', 'no evidence given')})")
        return "none", (f"auto: no measured overlap rule for {backend} on {ctx.device} at "
                        f"{tokens if tokens is not None else 'symbolic'} tokens")

    @staticmethod
    def _two_batch_blocker(block: EpBlock, cap: int) -> str | None:
        backend = block.dispatch.args[5]
        if backend == "deepep_low_latency":
            return "DeepEP low-latency keeps two receive buffers; interleaving micro-batches on them is not checked"
        tokens = _static_rows(block.dispatch.args[1])
        if not cap and tokens is None:
            return "the token count is symbolic and no ep_capacity is set"
        agreed = cap or tokens
        if agreed < 2:
            return f"a micro-batch would be empty ({'capacity' if cap else 'tokens'} {agreed})"
        canon = {c.op for c in canonical_ops().values() if not c.engine}
        for n in block.local:
            if n.target is not operator.getitem and n.target not in canon:
                return f"the local block holds {n.target} (only canonical ops are split)"
            if any(u not in block.local and u is not block.combine for u in n.users):
                return f"{n.name} is used outside the block"
        for i, p in block.parts.items():
            if i != 3 and any(u not in block.local for u in p.users):
                return f"received output {i} is used outside the local block"
        if any(u is not block.combine for u in block.parts[3].users):
            return "the handle is used outside the combine"
        return None

    # ------------------------------------------------------------------ rewrites
    def _shared(self, graph: fx.Graph, block: EpBlock, ctx: PassContext) -> list[str]:
        work = independent_work(block)
        if not work:
            return []
        under_d, under_c = split_by_cost(work)
        d, c = block.dispatch, block.combine
        self._mutating = True
        with graph.inserting_before(d):
            ds = graph.call_function(ep_ops.ep_dispatch_start.op, d.args)
        for n in under_d:
            d.prepend(n)
        with graph.inserting_before(d):
            dw = graph.call_function(ep_ops.ep_dispatch_wait.op, (ds, *d.args))
        with graph.inserting_before(c):
            cs = graph.call_function(ep_ops.ep_combine_start.op, c.args)
        for n in under_c:
            c.prepend(n)
        with graph.inserting_before(c):
            cw = graph.call_function(ep_ops.ep_combine_wait.op, (cs, *c.args))
        _meta_from(d, ds, dw)
        _meta_from(c, cs, cw)
        _fake(ctx, ds, dw, cs, cw)
        d.replace_all_uses_with(dw)
        c.replace_all_uses_with(cw)
        graph.erase_node(d)
        graph.erase_node(c)
        return ["dispatch start", f"under dispatch: {_names(under_d)}", "dispatch wait",
                f"experts: {_names(block.local)}", "combine start", f"under combine: {_names(under_c)}",
                "combine wait"]

    def _two_batch(self, graph: fx.Graph, block: EpBlock, ctx: PassContext, cap: int) -> list[str]:
        d, c = block.dispatch, block.combine
        x, ids, w = d.args[:3]
        rest = d.args[3:]
        # the split point is the same on every rank: half the capacity (a rank's batch may be smaller, its
        # second micro-batch then shorter or empty: slices clamp), else half the (equal) token count
        t0 = math.ceil(cap / 2) if cap else math.ceil(_static_rows(ids) / 2)
        half_cap = t0 if cap else 0
        common = (*rest[:4], half_cap, rest[5])
        c_ids, c_w = c.args[2], c.args[3]
        c_tail = c.args[4:]
        c_common = (*c_tail[:4], half_cap, *c_tail[5:])
        work = independent_work(block)
        new: list[fx.Node] = []
        self._mutating = True

        def call(target: Any, args: tuple, like: fx.Node) -> fx.Node:
            n = graph.call_function(target, args)
            _meta_from(like, n)
            new.append(n)
            return n

        def rows(a: Any, lo: int, hi: int, like: fx.Node) -> Any:
            return call(aten.slice.Tensor, (a, 0, lo, hi), like)

        with graph.inserting_before(d):
            spans = ((0, t0), (t0, _END))
            halves = []
            for lo, hi in spans:
                hx, hids, hw = (rows(a, lo, hi, d) for a in (x, ids, w))
                hcids = hids if c_ids is ids else rows(c_ids, lo, hi, c)
                hcw = hw if c_w is w else rows(c_w, lo, hi, c)
                halves.append((hx, hids, hw, hcids, hcw))
            starts = [call(ep_ops.ep_dispatch_start.op, (hx, hids, hw, *common), d) for hx, hids, hw, _, _ in halves]
        for n in work:
            d.prepend(n)
        outs_started = []
        with graph.inserting_before(d):
            for i, (hx, hids, hw, hcids, hcw) in enumerate(halves):
                wait = call(ep_ops.ep_dispatch_wait.op, (starts[i], hx, hids, hw, *common), d)
                env: dict[fx.Node, Any] = {p: call(operator.getitem, (wait, k), p) for k, p in block.parts.items()}
                for n in block.local:
                    clone = graph.node_copy(n, lambda a: env.get(a, a))
                    new.append(clone)
                    env[n] = clone
                y = env.get(c.args[0], c.args[0])
                cs = call(ep_ops.ep_combine_start.op, (y, env[block.parts[3]], hcids, hcw, *c_common), c)
                outs_started.append((cs, (y, env[block.parts[3]], hcids, hcw, *c_common)))
            outs = [call(ep_ops.ep_combine_wait.op, (cs, *args), c) for cs, args in outs_started]
            out = call(aten.cat.default, (outs, 0), c)
        _fake(ctx, *new)
        c.replace_all_uses_with(out)
        for n in [c, *reversed(block.local), *block.parts.values(), d]:
            graph.erase_node(n)
        t = _static_rows(ids)
        sizes = f"{min(t, t0)} + {max(t - t0, 0)} tokens" if t is not None else f"split at token {t0}"
        return [f"micro-batches of {sizes}" + (f" (capacity {half_cap} each)" if cap else ""),
                "dispatch start mb0", "dispatch start mb1", f"under both dispatches: {_names(work)}",
                "dispatch wait mb0", f"experts mb0 (under dispatch mb1): {_names(block.local)}", "combine start mb0",
                "dispatch wait mb1", "experts mb1 (under combine mb0)", "combine start mb1",
                "combine wait mb0", "combine wait mb1", "cat"]


_END = sys.maxsize
"""A slice end past any batch (slices clamp to the tensor's size)."""


def _static_rows(node: Any) -> int | None:
    v = val(node)
    if not isinstance(v, torch.Tensor) or v.dim() < 1:
        return None
    size = v.shape[0]
    return int(size) if isinstance(size, int) else None


def _meta_from(like: fx.Node, *nodes: fx.Node) -> None:
    keep = {k: like.meta[k] for k in ("nn_module_stack", "stack_trace") if k in like.meta}
    for n in nodes:
        n.meta.update(keep)


def _fake(ctx: PassContext, *nodes: fx.Node) -> None:
    """Fill ``meta["val"]`` of new nodes, in order, from their targets on fake inputs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = ctx.fake_mode or FakeTensorMode(allow_non_fake_inputs=True)

    def fake(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return val(a)
        if isinstance(a, (list, tuple)):
            return type(a)(fake(b) for b in a)
        return a

    with mode:
        for n in nodes:
            n.meta["val"] = n.target(*fake(n.args), **{k: fake(v) for k, v in n.kwargs.items()})

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
  of 1. This per-block split (router, attention and the rest of the layer run once on all tokens) is the
  fallback; a block whose micro-batch would be empty on some rank stays one batch.

  First, over the *layer range* (:func:`find_range`: from the first EP block's ``[B, S, H]`` layer input to the
  last block's combine), the batch is split (``B // 2`` sequences, the same on every rank as ranks trace the same
  shapes): every node derived from the layer input is cloned per micro-batch (values from before the range cut
  by rows where their leading size is ``B`` or ``B*S``: masks, positions; weights and tables shared; the first
  entry of view / reshape / expand sizes substituted), and per block::

      ... attention(mb0); start(d0); attention(mb1); start(d1); wait(d0); experts(mb0); start(c0)
      wait(d1); experts(mb1); start(c1); wait(c0); attention'(mb0); start(d0'); wait(c1); attention'(mb1) ...

  the values read after the range are ``cat`` s of the two. Every clone's fake value must equal the original's
  with the batch substituted and every ``cat`` the original's shape, dtype and strides; the split declines (the
  reason in ``EpRecord.range_split``, the graph untouched, per-block two_batch instead) at batch < 2 (one
  sequence, or packed / varlen sequences in one row), a node without a batch dim, a step along dim 0 (a
  reduction, a transpose, tensor indexing, a cat), an op of another library, an impure call in the range, or
  any failing check.
* ``auto``: per block and token count from the option ``ep_overlap_rules``, then :data:`MEASURED_RULES` (no rule
  measured yet: ``none``).

Engines without an async form on the graph's device keep the synchronous ops (one INFO line). Each decision
and the schedule is recorded on the block's :class:`~ep_fuse.report.EpRecord` (``overlap``, ``schedule``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator
import sys
from typing import Any

import torch
from torch import fx

from ep_fuse.fx_utils import copy_graph, module_path, op_args, val
from ep_fuse.ops import ep as ep_ops
from ep_fuse.ops.ep import EpError
from ep_fuse.ops.registry import canonical_ops
from ep_fuse.passes import ep_layer_range
from ep_fuse.passes.base import GraphPass, PassContext
from ep_fuse.passes.graph_edit import copy_source_meta, set_fake_vals
from ep_fuse.passes.ep_blocks import EpBlock, find_blocks, independent_work, node_names, split_by_cost
from ep_fuse.passes.ep_layer_range import (SIZE_LIST_ARG, LayerRange, RangeDeclined, find_range, range_pure,
                                           same_value, substituted)

log = logging.getLogger("ep_fuse.passes")
aten = torch.ops.aten

@dataclasses.dataclass(frozen=True)
class OverlapRule:
    """``ep_overlap="auto"``: on ``device`` with ``engine``, use ``mode`` from ``min_tokens`` tokens per rank."""

    device: str
    engine: str
    mode: str
    min_tokens: int
    """A :class:`ep_fuse.providers.measured.Threshold` (an ``int`` carrying its evidence and bench command)."""


MEASURED_RULES: tuple[OverlapRule, ...] = ()
"""What ``auto`` follows after the option ``ep_overlap_rules``, first match wins. Empty: ``bench/bench_ep.py --overlap`` has not run on a GPU yet, so
no mode is known to be faster than ``none`` anywhere and ``auto`` keeps ``none`` (and says so in the record)."""


class EpOverlap(GraphPass):
    name = "ep_overlap"
    _mutating = False

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> int:
        mode = ctx.config.ep_overlap
        if mode == "none":
            return 0
        blocks = find_blocks(gm.graph)
        changed = 0
        sync_said: set[str] = set()
        if mode == "two_batch" and blocks and all(ep_ops.ep_async(op_args(b.dispatch)["engine"], ctx.device) for b in blocks):
            if self._range(gm, blocks, ctx):
                gm.graph.lint()
                return len(blocks)
            blocks = find_blocks(gm.graph)  # the graph may be the copy put back
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
        engine, cap = op_args(block.dispatch)["engine"], int(op_args(block.dispatch)["capacity"])
        chosen, why = self._choose(mode, block, ctx)
        if chosen != "none" and ep_ops.ep_async(engine, ctx.device) is None:
            if engine not in sync_said:
                log.info("ep_fuse: EP engine %s has no async form on %s: its blocks keep the synchronous "
                         "dispatch/combine (no overlap)", engine, ctx.device)
                sync_said.add(engine)
            chosen, why = "none", f"{engine} has no async form on {ctx.device}"
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

    # ------------------------------------------------------------------ two_batch over a layer range
    def _range(self, gm: fx.GraphModule, blocks: list[EpBlock], ctx: PassContext) -> bool:
        """Split the layer range of ``blocks`` along the batch (every block then ``two_batch``); ``False``, the
        graph untouched and the reason on each record, where it declines."""
        new: list[fx.Node] = []
        backup = copy_graph(gm)
        self._mutating = False
        try:
            rng = find_range(blocks)
            for k, b in enumerate(rng.blocks):
                reason = self._two_batch_blocker(b, int(op_args(b.dispatch)["capacity"]))
                if reason is not None:
                    raise RangeDeclined(f"{rng.labels[k]}: {reason}")
            schedules = self._range_split(gm.graph, rng, ctx, new)
        except Exception as exc:  # noqa: BLE001 - any failure: the graph as it was, per-block two_batch
            if self._mutating:  # half rewritten: the copy taken before goes back
                gm.graph = backup
                gm.recompile()
                self._mutating = False
                why = f"the rewrite failed ({type(exc).__name__}: {exc}); the graph was put back"
            elif isinstance(exc, RangeDeclined):
                why = str(exc)
            else:
                why = f"analysis failed: {type(exc).__name__}: {exc}"
            if gm.graph is not backup:
                for n in reversed(new):
                    gm.graph.erase_node(n)
            (log.info if isinstance(exc, RangeDeclined) else log.warning)(
                "ep_fuse: two_batch over the layer range declined (%s); two_batch per EP block instead", why)
            for b in blocks:
                if b.record is not None:
                    b.record.range_split = f"declined: {why}"
            return False
        b0 = rng.batch // 2
        layers = f"layers {rng.labels[0]}-{rng.labels[-1]}" if len(rng.labels) > 1 else f"layer {rng.labels[0]}"
        summary = f"{layers}, batch {rng.batch} = {b0} + {rng.batch - b0} sequences of {rng.seq} tokens"
        for b, steps in zip(rng.blocks, schedules):
            if b.record is not None:
                b.record.overlap, b.record.overlap_reason = "two_batch", ""
                b.record.range_split, b.record.schedule = summary, steps
        log.info("ep_fuse: two_batch over the layer range: %s", summary)
        return True

    def _range_split(self, graph: fx.Graph, rng: LayerRange, ctx: PassContext, new: list[fx.Node]) -> list[list[str]]:
        """Clone the range per micro-batch (inserted before the last combine), interleave the start/wait pairs,
        check every clone's fake value against the original's with the batch substituted, then (only then)
        redirect the readers after the range to ``cat`` s of the two values and erase the originals."""
        b, s = rng.batch, rng.seq
        b0 = b // 2
        spans = ((0, b0), (b0, b))
        parts = (b0, b - b0)
        params = {name for name, t in ctx.inputs.items() if t is not None}  # parameters, buffers
        derived = set(rng.derived)
        ep_nodes = {n for blk in rng.blocks for n in (blk.dispatch, *blk.parts.values(), *blk.local, blk.combine)}
        end = rng.blocks[-1].combine
        envs: list[dict[fx.Node, fx.Node]] = [{}, {}]
        cuts: list[dict[fx.Node, fx.Node]] = [{}, {}]
        lo_order = {n: i for i, n in enumerate(graph.nodes)}
        window = list(graph.nodes)[lo_order[rng.h0] + 1:lo_order[end] + 1]
        for k, blk in enumerate(rng.blocks):
            cap = int(op_args(blk.dispatch)["capacity"])
            if cap and parts[1] * s > math.ceil(cap / 2):
                raise RangeDeclined(f"{rng.labels[k]}: a micro-batch of {parts[1] * s} tokens exceeds half the "
                                    f"capacity {cap} (each micro-batch gets {math.ceil(cap / 2)}, as per block)")
        impure = [n.name for n in window if n.op == "call_function" and n not in ep_nodes and not range_pure(n)]
        if impure:
            raise RangeDeclined(f"the range holds impure calls ({', '.join(impure[:3])}): moving them is not checked")

        def call(target: Any, args: tuple, like: fx.Node) -> fx.Node:
            n = graph.call_function(target, args)
            copy_source_meta(like, n)
            new.append(n)
            return n

        def arg(i: int, a: Any, user: fx.Node) -> Any:
            if a in envs[i]:
                return envs[i][a]
            if a in derived:
                raise RangeDeclined(f"{user.name} reads {a.name} before its micro-batch value exists")
            unit = 1 if a is rng.h0 else ep_layer_range.slice_spec(a, rng, params)
            if unit is None:
                return a
            if a not in cuts[i]:
                lo, hi = spans[i]
                cuts[i][a] = call(aten.slice.Tensor, (a, 0, lo * unit, hi * unit), user)
            return cuts[i][a]

        def local_arg(i: int, a: Any, user: fx.Node) -> Any:
            if a in envs[i]:
                return envs[i][a]
            if a in derived or a is rng.h0:
                raise RangeDeclined(f"the local block's {user.name} reads {a.name} of the range directly")
            return a

        def clone(i: int, n: fx.Node, local: bool = False) -> None:
            c = graph.node_copy(n, lambda a: (local_arg if local else arg)(i, a, n))
            c.meta.pop("tensor_meta", None)
            pos = SIZE_LIST_ARG.get(n.target)
            if pos is not None and len(c.args) > pos and isinstance(c.args[pos], (list, tuple)) and c.args[pos]:
                sizes, first = list(c.args[pos]), c.args[pos][0]
                if isinstance(first, int) and first in (b, b * s):
                    sizes[0] = parts[i] if first == b else parts[i] * s
                    c.args = (*c.args[:pos], sizes, *c.args[pos + 1:])
            new.append(c)
            envs[i][n] = c

        def front(k: int, i: int) -> tuple[fx.Node, tuple]:
            """Micro-batch ``i``'s work before block ``k``'s dispatch, the dispatch start, the work beside it."""
            for n in rng.pre[k]:
                clone(i, n)
            d = rng.blocks[k].dispatch
            cap = int(op_args(d)["capacity"])
            dargs = (*(arg(i, a, d) for a in d.args[:3]), *d.args[3:7], math.ceil(cap / 2) if cap else 0,
                     *d.args[8:])
            st = call(ep_ops.ep_dispatch_start.op, dargs, d)
            for n in rng.mid[k]:
                clone(i, n)
            return st, dargs

        def experts(k: int, i: int, started: tuple[fx.Node, tuple]) -> tuple[fx.Node, tuple]:
            """Wait for micro-batch ``i``'s tokens of block ``k``, its local experts, its combine start."""
            blk = rng.blocks[k]
            st, dargs = started
            wait = call(ep_ops.ep_dispatch_wait.op, (st, *dargs), blk.dispatch)
            for j, p in blk.parts.items():
                envs[i][p] = call(operator.getitem, (wait, j), p)
            for n in blk.local:
                clone(i, n, local=True)
            c = blk.combine
            cargs = (local_arg(i, c.args[0], c), envs[i][blk.parts[3]], arg(i, c.args[2], c), arg(i, c.args[3], c),
                     *c.args[4:8], dargs[7], *c.args[9:])
            return call(ep_ops.ep_combine_start.op, cargs, c), cargs

        def combine_wait(k: int, i: int, started: tuple[fx.Node, tuple]) -> None:
            c = rng.blocks[k].combine
            envs[i][c] = call(ep_ops.ep_combine_wait.op, (started[0], *started[1]), c)

        count = len(rng.blocks)
        with graph.inserting_before(end):
            starts = [front(0, 0), front(0, 1)]
            for k in range(count):
                combines = [experts(k, 0, starts[0]), experts(k, 1, starts[1])]
                if k + 1 < count:
                    nxt = []
                    for i in (0, 1):
                        combine_wait(k, i, combines[i])
                        nxt.append(front(k + 1, i))
                    starts = nxt
                else:
                    for i in (0, 1):
                        combine_wait(k, i, combines[i])
            cats = {n: call(aten.cat.default, ([envs[0][n], envs[1][n]], 0), n) for n in rng.outputs}
        set_fake_vals(ctx, *new)
        for i in (0, 1):
            for n in rng.derived:
                if n in ep_nodes and n not in {blk.combine for blk in rng.blocks}:
                    continue
                like, got = val(n), val(envs[i][n])
                want = substituted(like, b, s, parts[i])
                if isinstance(like, (tuple, list)):
                    used = {u.args[1] for u in n.users if u.target is operator.getitem}
                    ok = isinstance(got, (tuple, list)) and all(same_value(got[j], want[j], like[j]) for j in used)
                else:
                    ok = same_value(got, want, like)
                if not ok:
                    raise RangeDeclined(f"micro-batch {i}'s {envs[i][n].name} is {_shape(got)}, not {_shape(like)} "
                                        f"with the batch {b} -> {parts[i]}")
        for n, cat in cats.items():
            like, got = val(n), val(cat)
            if (tuple(got.shape), got.dtype, got.stride()) != (tuple(like.shape), like.dtype, like.stride()):
                raise RangeDeclined(f"the cat of {n.name} is {_shape(got)} stride {got.stride()}, not {_shape(like)} "
                                    f"stride {like.stride()}")
        self._mutating = True
        made = set(new)
        for n, cat in cats.items():
            for u in [u for u in n.users if u not in derived and u not in made]:
                u.replace_input_with(n, cat)
        for n in reversed(rng.derived):
            graph.erase_node(n)
        return self._range_schedule(rng)

    @staticmethod
    def _range_schedule(rng: LayerRange) -> list[list[str]]:
        """Per block: what each transfer runs under (``c1 under mb0 attention L1``), in graph order."""
        out = []
        labels = rng.labels
        for k, blk in enumerate(rng.blocks):
            here = labels[k]
            front = node_names([*rng.pre[k], *rng.mid[k]])
            steps = [f"{here} d0 under mb1 attention {here} ({front})", f"{here} d1 under mb0 experts {here}",
                     f"{here} c0 under mb1 experts {here}"]
            if k + 1 < len(rng.blocks):
                nxt = labels[k + 1]
                steps.append(f"{here} c1 under mb0 attention {nxt} "
                             f"({node_names([*rng.pre[k + 1], *rng.mid[k + 1]])})")
            else:
                steps.append(f"{here} c1 under nothing (the end of the range); cat of {len(rng.outputs)} value(s)")
            out.append(steps)
        return out

    # ------------------------------------------------------------------ decisions
    @staticmethod
    def _choose(mode: str, block: EpBlock, ctx: PassContext) -> tuple[str, str]:
        if mode != "auto":
            return mode, ""
        engine = op_args(block.dispatch)["engine"]
        tokens = int(op_args(block.dispatch)["capacity"]) or _static_rows(op_args(block.dispatch)["topk_ids"])  # alike on every rank
        for rule in (*ctx.config.ep_overlap_rules, *MEASURED_RULES):
            if rule.device == ctx.device and rule.engine == engine and tokens is not None \
                    and tokens >= rule.min_tokens:
                return rule.mode, (f"auto: {rule.mode} from {int(rule.min_tokens)} tokens "
                                    f"({getattr(rule.min_tokens, 'evidence', 'no evidence given')})")
        return "none", (f"auto: no measured overlap rule for {engine} on {ctx.device} at "
                        f"{tokens if tokens is not None else 'symbolic'} tokens")

    @staticmethod
    def _two_batch_blocker(block: EpBlock, cap: int) -> str | None:
        engine = op_args(block.dispatch)["engine"]
        if engine == "deepep_low_latency":
            return "DeepEP low-latency keeps two receive buffers; interleaving micro-batches on them is not checked"
        tokens = _static_rows(op_args(block.dispatch)["topk_ids"])
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
        copy_source_meta(d, ds, dw)
        copy_source_meta(c, cs, cw)
        set_fake_vals(ctx, ds, dw, cs, cw)
        d.replace_all_uses_with(dw)
        c.replace_all_uses_with(cw)
        graph.erase_node(d)
        graph.erase_node(c)
        return ["dispatch start", f"under dispatch: {node_names(under_d)}", "dispatch wait",
                f"experts: {node_names(block.local)}", "combine start", f"under combine: {node_names(under_c)}",
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
            copy_source_meta(like, n)
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
        set_fake_vals(ctx, *new)
        c.replace_all_uses_with(out)
        for n in [c, *reversed(block.local), *block.parts.values(), d]:
            graph.erase_node(n)
        t = _static_rows(ids)
        sizes = f"{min(t, t0)} + {max(t - t0, 0)} tokens" if t is not None else f"split at token {t0}"
        return [f"micro-batches of {sizes}" + (f" (capacity {half_cap} each)" if cap else ""),
                "dispatch start mb0", "dispatch start mb1", f"under both dispatches: {node_names(work)}",
                "dispatch wait mb0", f"experts mb0 (under dispatch mb1): {node_names(block.local)}", "combine start mb0",
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


def _shape(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return str(list(v.shape))
    if isinstance(v, (tuple, list)):
        return "(" + ", ".join(_shape(e) for e in v) + ")"
    return type(v).__name__

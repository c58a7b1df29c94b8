"""The rewrite pipeline on one ATen graph: attention masks -> GQA heads -> canonicalize -> lower -> cleanup
(-> views_as_reshapes under Inductor), with timing, report and dumps."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch.fx as fx

from ep_fuse.catalog import all_pairs, all_patterns
from ep_fuse.config import ConfigError, EpFuseConfig
from ep_fuse.dump import Dumper
from ep_fuse.fx_utils import copy_graph, fake_mode_of, op_histogram
from ep_fuse.ops.ep import EpError
from ep_fuse.ops.registry import canonical_ops
from ep_fuse.passes.attention_gqa import PackGqaHeads
from ep_fuse.passes.attention_mask import FoldAttentionMasks
from ep_fuse.passes.base import GraphPass, PassContext
from ep_fuse.passes.canonicalize import Canonicalize
from ep_fuse.passes.cleanup import Cleanup
from ep_fuse.passes.ep import ExpertParallel
from ep_fuse.passes.ep_overlap import EpOverlap
from ep_fuse.passes.expand import Expand
from ep_fuse.passes.lower import Lower
from ep_fuse.passes.moe_zero_slots import DropZeroWeightSlots
from ep_fuse.passes.pair import Pair
from ep_fuse.passes.quant import QuantizeExperts
from ep_fuse.passes.views_as_reshapes import ViewsAsReshapes
from ep_fuse.report import GraphReport, PassRecord
from ep_fuse.shape_guards import ShapeGuardWatch

log = logging.getLogger("ep_fuse")
progress = logging.getLogger("ep_fuse.progress")


def build_passes(config: EpFuseConfig, executor: str) -> list[GraphPass]:
    """The passes, in order, for ``config`` and the executor that runs the result (``eager`` / ``inductor``)."""
    patterns = [p for p in all_patterns() if config.pattern_enabled(p.name)]
    pairs = all_pairs({p.name for p in patterns})
    return [*([FoldAttentionMasks()] if config.fold_attention_masks else []),
            *([PackGqaHeads()] if config.pack_gqa else []),
            Canonicalize(patterns), Pair(pairs), Cleanup(), ExpertParallel(),
            *([QuantizeExperts()] if config.quant else []), *([EpOverlap()] if config.ep_overlap != "none" else []),
            DropZeroWeightSlots(), Expand(), Lower(), Cleanup(),
            *([ViewsAsReshapes()] if executor == "inductor" else [])]


def run_passes(
    gm: fx.GraphModule, config: EpFuseConfig, report: GraphReport, dumper: Dumper | None = None,
    inputs: list[Any] | None = None,
) -> GraphReport:
    """Rewrite ``gm`` in place; fills and returns ``report`` (and writes dumps when ``dumper`` has a folder).

    ``inputs``: the real tensors of ``gm``'s placeholders, in order (weights for the quant pass)."""
    placeholders = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    ctx = PassContext(config=config, device=report.device, executor=report.executor, report=report,
                      fake_mode=fake_mode_of(gm),
                      inputs=dict(zip(placeholders, inputs)) if inputs is not None else {})
    dumper = dumper or Dumper.for_config(config, report.graph)
    report.ops_before = op_histogram(gm.graph)
    dumper.graph("01_aten", gm)
    watch = ShapeGuardWatch(ctx.fake_mode)
    backup = copy_graph(gm)
    passes = build_passes(config, report.executor)
    for i, p in enumerate(passes, start=2):
        t0 = time.perf_counter()
        ctx.current = None
        try:
            changes = p(gm, ctx)
        except (EpError, ConfigError):  # what the user asked for cannot run: say so, as the docs promise
            raise
        except Exception as exc:  # a failing pass must never break the compile: the graph as Dynamo gave it
            _restore(gm, backup, report, _where(p, ctx), exc)
            for j, q in enumerate((q for q in passes if q.runs_on_restored), start=i + 1):
                _run_recorded(q, gm, ctx, dumper, j)
            break
        _record(p, gm, report, dumper, i, changes, t0)
    report.ops_after = op_histogram(gm.graph)
    report.shape_guards = watch.added()
    if report.shape_guards:
        log.warning("ep_fuse: graph %s: the rewrite added %d shape guard(s) (the graph recompiles for sizes "
                    "outside them): %s", report.graph, len(report.shape_guards), "; ".join(report.shape_guards))
    canon = {c.op for c in canonical_ops().values() if not c.engine}
    report.unlowered = [n.name for n in gm.graph.nodes if n.op == "call_function" and n.target in canon]
    dumper.report(report)
    for m in report.matches:
        log.info("ep_fuse: graph %s: %s[%s] at %s -> %s", report.graph, m.pattern, m.variant,
                 m.module_path or m.root, m.provider)
    log.info("ep_fuse: %s", report.summary())
    return report


def _record(p: GraphPass, gm: fx.GraphModule, report: GraphReport, dumper: Dumper, i: int, changes: int,
            t0: float) -> None:
    report.passes.append(PassRecord(p.name, time.perf_counter() - t0, changes, op_histogram(gm.graph)))
    progress.info("graph %s: %s: %d change(s) in %.2f s", report.graph, p.name, changes, report.passes[-1].seconds)
    dumper.graph(f"{i:02d}_{p.name}", gm)


def _run_recorded(p: GraphPass, gm: fx.GraphModule, ctx: PassContext, dumper: Dumper, i: int) -> None:
    """Run ``p`` on the graph put back after a failure (``runs_on_restored``); its own failure propagates."""
    t0 = time.perf_counter()
    _record(p, gm, ctx.report, dumper, i, p(gm, ctx), t0)


def _where(p: GraphPass, ctx: PassContext) -> str:
    if isinstance(ctx.current, tuple) and len(ctx.current) == 2:
        pattern, node = ctx.current
        return f"pass {p.name}, pattern {pattern.key} at {node.name}"
    return f"pass {p.name}"


def _restore(gm: fx.GraphModule, backup: fx.Graph, report: GraphReport, where: str, exc: Exception) -> None:
    """Put ``backup`` back as ``gm``'s graph after a pass raised, and say so once (a WARNING and the report)."""
    gm.graph = backup
    gm.recompile()
    report.matches.clear()
    report.near_misses.clear()
    report.attention_masks.clear()
    report.attention_gqa.clear()
    report.ep.clear()
    report.passes.clear()
    first = str(exc).splitlines()[0] if str(exc) else ""
    report.skipped = f"the rewrite failed in {where}: {type(exc).__name__}: {first}; the graph runs unrewritten"
    log.warning("ep_fuse: graph %s: %s (please report it with EP_FUSE_DUMP_DIR set)", report.graph, report.skipped)
    log.debug("ep_fuse: the failing pass's traceback", exc_info=exc)

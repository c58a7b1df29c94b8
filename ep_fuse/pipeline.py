"""The rewrite pipeline on one ATen graph: canonicalize -> lower -> cleanup, with timing, report and dumps."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch.fx as fx

from ep_fuse.catalog import all_pairs, all_patterns
from ep_fuse.config import EpFuseConfig
from ep_fuse.dump import Dumper
from ep_fuse.fx_utils import fake_mode_of, op_histogram
from ep_fuse.ops.registry import canonical_ops
from ep_fuse.passes.base import GraphPass, PassContext
from ep_fuse.passes.canonicalize import Canonicalize
from ep_fuse.passes.cleanup import Cleanup
from ep_fuse.passes.ep import ExpertParallel
from ep_fuse.passes.expand import Expand
from ep_fuse.passes.lower import Lower
from ep_fuse.passes.pair import Pair
from ep_fuse.passes.quant import QuantizeExperts
from ep_fuse.report import GraphReport, PassRecord
from ep_fuse.shape_guards import ShapeGuardWatch

log = logging.getLogger("ep_fuse")
progress = logging.getLogger("ep_fuse.progress")


def build_passes(config: EpFuseConfig) -> list[GraphPass]:
    patterns = [p for p in all_patterns() if config.pattern_enabled(p.name)]
    pairs = all_pairs({p.name for p in patterns})
    return [Canonicalize(patterns), Pair(pairs), Cleanup(), ExpertParallel(),
            *([QuantizeExperts()] if config.quant else []), Expand(), Lower(), Cleanup()]


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
    for i, p in enumerate(build_passes(config), start=2):
        t0 = time.perf_counter()
        changes = p(gm, ctx)
        report.passes.append(PassRecord(p.name, time.perf_counter() - t0, changes, op_histogram(gm.graph)))
        progress.info("graph %s: %s: %d change(s) in %.2f s", report.graph, p.name, changes,
                      report.passes[-1].seconds)
        dumper.graph(f"{i:02d}_{p.name}", gm)
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

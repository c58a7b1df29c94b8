"""What each compile fused, where, and with which provider (``ep_fuse.last_report()``)."""

from __future__ import annotations

import dataclasses
import json
import threading
from typing import Any


@dataclasses.dataclass
class MatchRecord:
    """One rewritten site."""

    graph: str
    pattern: str
    variant: str
    root: str
    """Name of the node the pattern was rooted at (in the ATen graph before the rewrite)."""
    nodes: list[str]
    """Every ATen node the match replaced."""
    module_path: str
    module_class: str
    fused_node: str
    """Name of the inserted canonical op node."""
    provider: str | None = None
    declined: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    """(provider, reason) for providers passed over before ``provider``."""
    block: bool = False
    """The match is a block (MoE experts) whose stage ops are lowered one by one."""
    stages: dict[str, str] = dataclasses.field(default_factory=dict)
    """For a block: the provider chosen for each stage op."""
    stage_nodes: list[str] = dataclasses.field(default_factory=list)
    """For a block: the nodes of its stage ops after expansion (what the report draws as "after")."""
    dropped_zero_slots: bool = False
    """For a routed-expert block: its slots with a remapped id and weight exactly 0 are not dispatched
    (:mod:`ep_fuse.passes.moe_zero_slots`)."""
    run_time: list[str] = dataclasses.field(default_factory=list)
    """Size-dependent provider choices deferred to run time (a symbolic size under ``dynamic=True``):
    ``"<op>: <rule>"``, e.g. ``"gemm_swiglu: > 32 rows: the reference"``."""

    def set_provider(self, op: str, provider: str, declined: tuple[tuple[str, str], ...],
                     run_time: str | None = None) -> None:
        """Record the provider lowering chose for ``op`` (the fused op, or one stage of a block)."""
        if run_time:
            self.run_time.append(f"{op}: {run_time}")
        if not self.block:
            self.provider, self.declined = provider, list(declined)
            return
        self.stages[op] = provider
        self.declined.extend((f"{p} ({op})", r) for p, r in declined)
        names = sorted(set(self.stages.values()))
        self.provider = names[0] if len(names) == 1 else "+".join(names)


@dataclasses.dataclass
class EpRecord:
    """One MoE block the expert-parallel pass rewrote into dispatch -> local experts -> combine."""

    block: str
    module_path: str
    engine: str
    """The dispatch/combine engine (``all_to_all``, ``deepep``, ``deepep_low_latency``, ``npu``, ``symm_mem``)."""
    layout: str
    """``rank`` (one row per token and destination rank) or ``expert`` (one row per token and expert)."""
    requested: str
    num_experts: int
    local_experts: int
    world: int
    capacity: int
    declined: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    payload: str = ""
    """What the dispatch sends when it is not the tokens as they are: ``"fp8 e4m3 + 1xG fp32 scales"``
    (``quant="fp8_block"`` quantizes before an ``all_to_all`` dispatch), else empty."""
    local_block: str = "moe_experts"
    """The local experts' op: ``moe_experts`` (permute -> GEMMs -> unpermute over the received rows) or
    ``moe_experts_masked`` (the expert-major receive buffer read in place, ``ep_fuse.passes.ep_masked``)."""
    overlap: str = "none"
    """How its communication overlaps compute (``ep_overlap``): ``none``, ``shared`` or ``two_batch``."""
    overlap_reason: str = ""
    """Why ``overlap`` differs from the option (an ``auto`` rule, a decline), else empty."""
    schedule: list[str] = dataclasses.field(default_factory=list)
    """The block's steps in graph order, naming the GEMM-like nodes that run under each transfer."""
    range_split: str = ""
    """``two_batch`` over a decoder-layer range: the range and batch split (``"layers L0-L1, batch 4 = 2 + 2
    ..."``), ``"declined: <why>"`` where the block fell back to the per-block split, empty when not tried."""

    @property
    def backend(self) -> str:
        """The first name of :attr:`engine` (kept for code written against it)."""
        return self.engine


@dataclasses.dataclass
class InductorHandoff:
    """How the rewritten ATen graph was handed to Inductor, and what Inductor saw of its inputs."""

    direct: bool
    """``True``: Inductor compiled the rewritten graph as Dynamo's graph (one runtime wrapper, the same
    CUDA-graph decisions as ``backend="inductor"``); ``False``: behind ep_fuse's own AOT wrapper."""
    reason: str = ""
    """Why the hand-off was not direct."""
    mutated_inputs: list[int] = dataclasses.field(default_factory=list)
    """Graph inputs mutated in place (static KV cache, counters)."""
    static_inputs: list[int] = dataclasses.field(default_factory=list)
    """Inputs Inductor treats as static addresses (parameters, ``mark_static_address`` buffers); Inductor
    keeps CUDA graphs for a graph whose mutated inputs are all static."""

    @property
    def cudagraph_safe_mutations(self) -> bool:
        """Every mutated input is static, so mutations do not stop CUDA graphs (``mode="reduce-overhead"``)."""
        return set(self.mutated_inputs) <= set(self.static_inputs)


@dataclasses.dataclass
class Attempt:
    """One pattern variant tried at a candidate site: the node where it failed and why."""

    pattern: str
    failed_at: str
    reason: str
    depth: int
    """How many nodes matched before the failure (deeper = closer to a match)."""


@dataclasses.dataclass
class NearMiss:
    """A candidate site (e.g. an ``rsqrt`` not absorbed by any match) and why each variant failed there."""

    graph: str
    anchor: str
    anchor_op: str
    module_path: str
    attempts: list[Attempt] = dataclasses.field(default_factory=list)
    """Deepest first; empty when no pattern root reaches the anchor (see ``note``)."""
    note: str = ""
    patterns: list[str] = dataclasses.field(default_factory=list)
    """The patterns whose candidate site this is (``ep-fuse explain --pattern`` shows it under them)."""

    @property
    def best(self) -> Attempt | None:
        return self.attempts[0] if self.attempts else None

    def explain(self) -> str:
        """The site, the variant that came closest (most nodes matched) with its failing check, then every
        variant tried, deepest first."""
        where = f" in {self.module_path}" if self.module_path else ""
        lines = [f"{self.anchor} ({self.anchor_op}){where}: not fused"]
        if self.note:
            lines.append(f"  {self.note}")
        best = self.best
        if best is not None:
            lines.append(f"  closest: {best.pattern} ({best.depth} nodes matched), failing check at "
                         f"{best.failed_at}: {best.reason}")
        for a in self.attempts:
            lines.append(f"  {a.pattern}: failed at {a.failed_at}: {a.reason} ({a.depth} nodes matched)")
        return "\n".join(lines)


@dataclasses.dataclass
class PassRecord:
    name: str
    seconds: float
    changes: int
    ops: dict[str, int] = dataclasses.field(default_factory=dict)
    """Op histogram of the graph after the pass."""


@dataclasses.dataclass
class GraphReport:
    """Everything ep_fuse did to one captured graph."""

    graph: str
    device: str
    executor: str
    matches: list[MatchRecord] = dataclasses.field(default_factory=list)
    near_misses: list[NearMiss] = dataclasses.field(default_factory=list)
    passes: list[PassRecord] = dataclasses.field(default_factory=list)
    ops_before: dict[str, int] = dataclasses.field(default_factory=dict)
    ops_after: dict[str, int] = dataclasses.field(default_factory=dict)
    unlowered: list[str] = dataclasses.field(default_factory=list)
    skipped: str | None = None
    """Why the graph was compiled without rewriting (e.g. it needs autograd)."""
    ep: list[EpRecord] = dataclasses.field(default_factory=list)
    """MoE blocks the expert-parallel pass rewrote."""
    inductor: InductorHandoff | None = None
    """How the rewritten graph reached Inductor (``None`` for the eager executor)."""
    shape_guards: list[str] = dataclasses.field(default_factory=list)
    """Shape guards the rewrite added to a dynamic-shape graph (expected: none; each one restricts the
    sizes the compiled graph accepts, so other sizes recompile). See :mod:`ep_fuse.shape_guards`."""
    compile_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    """Where this graph's compile time went: ``capture`` (AOT's trace to the functional ATen graph),
    ``rewrite`` (ep_fuse's passes) and ``inductor`` (``compile_fx`` on the rewritten graph, up to its
    first-call compile: kernels it compiles lazily on the first run are not in it)."""
    kernel_analyses: dict[str, float] = dataclasses.field(default_factory=dict)
    """Inductor's Triton access analyses of ep_fuse's inlined launches during ``inductor``: ``computed``,
    ``served`` (from ep_fuse's memo, :mod:`ep_fuse.kernel_analysis`) and ``seconds`` spent computing."""
    attention_masks: dict[str, str] = dataclasses.field(default_factory=dict)
    """SDPA node -> what the ``attention_mask`` pass did with its mask: ``is_causal`` (proved causal, now the op's
    flag), ``no mask`` (proved all true, dropped) or ``kept: <why>`` (:mod:`ep_fuse.passes.attention_mask`)."""
    attention_gqa: dict[str, str] = dataclasses.field(default_factory=dict)
    """SDPA node over repeated K/V heads -> what the ``attention_gqa`` pass did: ``packed G=<n>`` (runs on the
    un-repeated K/V, ``n`` query heads per K/V head as its query rows) or ``kept: <why>``
    (:mod:`ep_fuse.passes.attention_gqa`)."""
    contracts: dict[str, str] = dataclasses.field(default_factory=dict)
    """External ops the lowered graph calls (the chosen providers' ``torch_npu.npu_*`` ops, EP included) ->
    the release whose op contract they were checked against, e.g. ``{"npu_rms_norm": "torch_npu 2.14.0"}``
    (schemas and meta functions, not execution on hardware: ``docs/npu.md``)."""

    def count(self, pattern: str | None = None, variant: str | None = None, provider: str | None = None) -> int:
        return sum(
            1
            for m in self.matches
            if (pattern is None or m.pattern == pattern)
            and (variant is None or m.variant == variant)
            and (provider is None or m.provider == provider)
        )

    def ops_after_pass(self, name: str) -> dict[str, int]:
        """The graph's op histogram right after the (first) run of the pass ``name``, e.g. ``"canonicalize"``
        (``KeyError`` if it did not run)."""
        for p in self.passes:
            if p.name == name:
                return p.ops
        raise KeyError(f"pass {name!r} did not run on graph {self.graph} (ran: {[p.name for p in self.passes]})")

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for m in self.matches:
            out[m.pattern] = out.get(m.pattern, 0) + 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)

    def table(self) -> str:
        """A plain-text table of the matches, one row per fused site."""
        head = ("pattern", "variant", "module", "provider", "replaced", "declined")
        rows = [
            (m.pattern, m.variant, m.module_path or "?", m.provider or "-", str(len(m.nodes)) + " nodes",
             "; ".join(f"{p}: {r}" for p, r in m.declined)[:70])
            for m in self.matches
        ]
        widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
        lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip()]
        lines.append("  ".join("-" * w for w in widths))
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        return "\n".join(lines)

    def summary(self) -> str:
        counts = ", ".join(f"{k} x{v}" for k, v in self.counts().items()) or "nothing fused"
        providers: dict[str, int] = {}
        for m in self.matches:
            providers[m.provider or "-"] = providers.get(m.provider or "-", 0) + 1
        prov = ", ".join(f"{k} x{v}" for k, v in providers.items())
        text = f"graph {self.graph} ({self.device}, executor={self.executor}): {counts}"
        if prov:
            text += f"; providers: {prov}"
        if self.ep:
            backends = sorted({f"{e.engine} over {e.world} ranks" + (f" ({e.payload})" if e.payload else "")
                               + (", masked experts" if e.local_block == "moe_experts_masked" else "")
                               for e in self.ep})
            text += f"; expert-parallel: {len(self.ep)} block(s), {', '.join(backends)}"
        overlapped = [e.overlap for e in self.ep if e.overlap != "none"]
        if overlapped:
            text += "; EP overlap: " + ", ".join(f"{m} x{overlapped.count(m)}" for m in sorted(set(overlapped)))
        if self.inductor is not None and not self.inductor.direct:
            text += f"; Inductor behind ep_fuse's AOT wrapper ({self.inductor.reason})"
        if self.skipped:
            text += f"; not rewritten: {self.skipped}"
        folded = [r for r in self.attention_masks.values() if not r.startswith("kept")]
        if folded:
            text += "; attention masks folded: " + ", ".join(f"{r} x{folded.count(r)}" for r in sorted(set(folded)))
        packed = [r for r in self.attention_gqa.values() if not r.startswith("kept")]
        if packed:
            text += f"; one-row attention on un-repeated K/V heads x{len(packed)}"
        if self.near_misses:
            text += f"; {len(self.near_misses)} near miss(es)"
        if self.shape_guards:
            text += f"; {len(self.shape_guards)} shape guard(s) added"
        by_release: dict[str, list[str]] = {}
        for op, release in sorted(self.contracts.items()):
            by_release.setdefault(release, []).append(op)
        for release, ops in by_release.items():
            text += f"; calls {', '.join(ops)} (contracts checked against {release})"
        return text

    def schedule(self) -> str:
        """The EP blocks' overlap schedules, one block per paragraph (empty without EP)."""
        return "\n".join(f"EP block {e.module_path or e.block}: overlap {e.overlap}"
                         + (f" ({e.overlap_reason})" if e.overlap_reason else "")
                         + (f"\n  range split: {e.range_split}" if e.range_split else "")
                         + "".join(f"\n  {step}" for step in e.schedule) for e in self.ep)

    def __str__(self) -> str:
        text = self.summary() + ("\n" + self.table() if self.matches else "")
        return text + ("\n" + self.schedule() if any(e.schedule for e in self.ep) else "")


_lock = threading.Lock()
_reports: dict[str, GraphReport] = {}


def record(report: GraphReport) -> None:
    """Keep ``report``; a recompile of the same graph id (Dynamo may call a backend twice) replaces it."""
    with _lock:
        _reports.pop(report.graph, None)
        _reports[report.graph] = report


def compile_totals(graphs: list[GraphReport]) -> tuple[dict[str, float], dict[str, int]]:
    """The graphs' :attr:`GraphReport.compile_seconds` summed per phase, and their
    :attr:`GraphReport.kernel_analyses` counts (``computed``, ``served``) summed."""
    phases: dict[str, float] = {}
    for r in graphs:
        for phase, s in r.compile_seconds.items():
            phases[phase] = phases.get(phase, 0.0) + s
    analyses = {k: sum(int(r.kernel_analyses.get(k, 0)) for r in graphs) for k in ("computed", "served")}
    return phases, analyses


def reports() -> list[GraphReport]:
    """Reports of every graph compiled since the last :func:`reset_reports`, oldest first."""
    with _lock:
        return list(_reports.values())


def last_report() -> GraphReport | None:
    """The report of the most recently compiled graph (``None`` before any compile)."""
    with _lock:
        return next(reversed(_reports.values()), None)


def reset_reports() -> None:
    with _lock:
        _reports.clear()

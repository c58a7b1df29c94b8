"""Project the measured 2-rank EP layer times to 8-64 ranks and to RDMA bandwidth (issue 38, item 5).

    python tools/ep_projection.py [--markdown]

A small cost model in pure Python (no torch, no GPU). Per MoE layer and per rank it projects the bytes a rank
sends and receives (top-k deduplicated per destination rank, and per destination node where the engine forwards
inside the node as DeepEP's internode kernels do), the dispatch and combine times, the local expert time, and the
layer time with ``ep_overlap`` ``none`` / ``shared`` / ``two_batch`` with the overlap efficiency as
``bench/overlap_bench.py`` defines it: ``(t(none) - t(mode)) / t(dispatch + combine)``.

Its constants are fitted to the measured 2-rank rows in :data:`MEASURED` (the all_to_all capacity rows of
``docs/ep.md``, "Measured on ..."): :func:`calibrate` fits them and :func:`calibration_check` says how far the
model then is from each measured figure. Everything past 2 ranks is a projection from those rows, not a
measurement (``docs/ep.md``, "Larger EP groups: a projection").

The model, per rank, ``T`` tokens per rank, ``R`` ranks, ``G`` ranks per node, ``N = R / G`` nodes:

* routing uniform: each token picks ``k`` distinct experts of ``E`` uniformly; experts spread evenly, ``E / R``
  per rank. A given set of ``m`` experts is hit by a token with probability
  ``1 - C(E - m, k) / C(E, k)`` (:func:`p_hit`); distinct destination ranks per token
  ``n_R = R * p_hit(E / R)``, distinct destination nodes ``n_N = N * p_hit(E / N)``.
* a row is ``H * dtype_bytes`` (metadata ignored: 0.4 % at H 7168). Per rank (sent = received, by symmetry):
  rank dedup (all_to_all, DeepEP intranode): ``T * p_hit(E / R)`` rows per peer rank, ``G - 1`` peers over
  NVLink and ``R - G`` over RDMA (no node dedup: NCCL's all_to_all sends a row to every rank); node dedup
  (DeepEP internode): ``T * p_hit(E / N)`` rows per other node over RDMA, then forwarded over NVLink to the
  node's ranks: ``T * n_R * (G - 1) / G`` NVLink rows per rank.
* a transfer (dispatch or combine) takes ``latency + max(nvlink bytes / B_nvlink, rdma bytes / B_rdma)``
  (+ an RDMA latency past one node): the two links run concurrently. ``latency`` and ``B_nvlink`` are fitted
  per direction to the measured rows by remote bytes (the rank's own rows are a local copy, folded in).
* local experts: ``t0 + max(weights read / B_hbm, FLOPs / F)``. Weights: the experts of this rank that get at
  least one row, ``3 * H * I * dtype_bytes`` each; FLOPs ``6 * H * I`` per (token, expert) pair, ``T * k``
  pairs per rank at any ``R``. ``t0`` and ``B_hbm`` come from the two decode rows (weight-read bound), ``F``
  from the two prefill rows (compute-bound).
* a shared expert (``shared_i``) runs on the rank's ``T`` tokens with the same roofline (no ``t0``).
* ``none``: ``dispatch + experts + combine + shared``. ``shared``: half the shared expert under the dispatch,
  half under the combine (``ep_overlap``'s split), ``max(dispatch, s/2) + experts + max(combine, s/2)``.
  ``two_batch``: two micro-batches of ``T / 2``, one comm stream and one compute stream, in the order
  ``ep_overlap`` emits (``start d0, start d1, shared, wait d0, experts 0, start c0, wait d1, experts 1, start c1,
  wait c0, wait c1, cat``), plus ``split_overhead_us``. Each micro-batch pays its own transfer latency and
  reads its experts' weights again: at decode (weight-read bound) that makes two_batch slower than none.
  ``two_batch_tail`` (:data:`WHAT_IF`, not emitted by the pass): half the shared work under the last combine.
* ideal efficiency: ``min(dispatch + combine, experts + shared) / (dispatch + combine)``, what any schedule of
  this block's own work could hide (the comm in excess of the compute stays exposed whatever the mode).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Iterable, Sequence

MODES = ("none", "shared", "two_batch")
"""The ``ep_overlap`` modes, as the pass schedules them."""
WHAT_IF = ("two_batch_tail",)
"""Schedules the pass does not emit: ``two_batch_tail`` is two_batch with half of the independent work moved under
the last micro-batch's combine (which two_batch leaves exposed)."""


@dataclasses.dataclass(frozen=True)
class Layer:
    """An MoE layer's shape: hidden ``h``, expert intermediate ``i``, ``e`` experts, top-``k``, a shared expert of
    intermediate ``shared_i`` (0: none), ``dtype_bytes`` per element of tokens and weights."""

    name: str
    h: int
    i: int
    e: int
    k: int
    shared_i: int = 0
    dtype_bytes: int = 2

    def row_bytes(self) -> int:
        """Bytes of one token row on the wire."""
        return self.h * self.dtype_bytes

    def expert_bytes(self) -> int:
        """Weight bytes of one expert (gate, up, down)."""
        return 3 * self.h * self.i * self.dtype_bytes


@dataclasses.dataclass(frozen=True)
class Fabric:
    """The EP group: ``ranks`` in nodes of ``ranks_per_node``; NVLink inside a node, RDMA across.

    ``nvlink_gbps`` ``None``: the bandwidths fitted to the measured rows (per direction); a number replaces both.
    ``rdma_gbps`` is per GPU (one NIC per GPU); ``rdma_latency_us`` is added to a transfer that leaves the node.
    """

    ranks: int
    ranks_per_node: int = 8
    nvlink_gbps: float | None = None
    rdma_gbps: float = 50.0
    rdma_latency_us: float = 20.0
    node_dedup: bool = True

    def nodes(self) -> int:
        """Nodes the group spans (1 within a node)."""
        return max(1, math.ceil(self.ranks / self.ranks_per_node))

    def node_ranks(self) -> int:
        """Ranks of the group on one node."""
        return min(self.ranks, self.ranks_per_node)


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Per rank and per transfer: rows received (own rows included, DeepEP's count), bytes over NVLink and RDMA."""

    recv_rows: float
    nvlink_bytes: float
    rdma_bytes: float


@dataclasses.dataclass(frozen=True)
class Link:
    """One transfer direction's fitted constants: a fixed latency and a bandwidth by remote bytes."""

    latency_us: float
    gbps: float


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The fitted constants: ``dispatch`` / ``combine`` links, and the expert roofline (``t0_us``, ``hbm_gbps``,
    ``tflops``)."""

    dispatch: Link
    combine: Link
    t0_us: float
    hbm_gbps: float
    tflops: float


@dataclasses.dataclass(frozen=True)
class Measured:
    """One measured 2-rank row: layer, tokens per rank, dispatch / combine / EP layer µs (routed layer only)."""

    layer: Layer
    tokens: int
    dispatch_us: float
    combine_us: float
    layer_us: float
    source: str


DEEPSEEK_V3 = Layer("DeepSeek-V3", 7168, 2048, 256, 8, shared_i=2048)
QWEN3_30B = Layer("Qwen3-30B-A3B", 2048, 768, 128, 8)
_ROUTED_DS = dataclasses.replace(DEEPSEEK_V3, shared_i=0)

MEASURED: list[Measured] = [
    # docs/ep.md "Measured on 2 x ... (NCCL, NVLink)": all_to_all with a capacity (CUDA-graph replays). Qwen3's split of
    # dispatch + combine comes from its recv GB/s (rows received x H x 2 B over each time).
    Measured(_ROUTED_DS, 128, 31.4, 29.4, 2847.0, "DeepSeek-V3 decode, all_to_all capacity"),
    Measured(_ROUTED_DS, 4096, 292.0, 435.0, 8218.0, "DeepSeek-V3 prefill, all_to_all capacity"),
    Measured(QWEN3_30B, 128, 26.1, 19.5, 233.0, "Qwen3-30B-A3B decode, all_to_all capacity (45.6 at 40 / 54 GB/s)"),
    Measured(QWEN3_30B, 4096, 112.1, 132.9, 1134.0,
             "Qwen3-30B-A3B prefill, all_to_all capacity (245 at 298 / 252 GB/s)"),
]
MEASURED_RANKS = 2


def p_hit(e: int, k: int, m: float) -> float:
    """Probability that a token's ``k`` distinct experts (uniform over ``e``) include one of a given ``m``."""
    m_int = round(m)
    if m_int >= e:
        return 1.0
    if e - m_int < k:
        return 1.0
    return 1.0 - math.comb(e - m_int, k) / math.comb(e, k)


def distinct_ranks(e: int, k: int, ranks: int) -> float:
    """Expected distinct destination ranks per token, ``e / ranks`` experts per rank (DeepEP's rank dedup)."""
    return ranks * p_hit(e, k, e / ranks)


def distinct_nodes(e: int, k: int, ranks: int, ranks_per_node: int) -> float:
    """Expected distinct destination nodes per token (DeepEP internode's RDMA dedup)."""
    nodes = max(1, math.ceil(ranks / ranks_per_node))
    return nodes * p_hit(e, k, e / nodes)


def traffic(layer: Layer, tokens: int, fabric: Fabric) -> Traffic:
    """Rows and bytes per rank of one dispatch (a combine moves the same rows back)."""
    r, g, n = fabric.ranks, fabric.node_ranks(), fabric.nodes()
    p_rank = p_hit(layer.e, layer.k, layer.e / r)
    recv_rows = tokens * r * p_rank
    row = layer.row_bytes()
    if n == 1:
        return Traffic(recv_rows, tokens * (r - 1) * p_rank * row, 0.0)
    if fabric.node_dedup:
        p_node = p_hit(layer.e, layer.k, layer.e / n)
        return Traffic(recv_rows, recv_rows * (g - 1) / g * row, tokens * (n - 1) * p_node * row)
    return Traffic(recv_rows, tokens * (g - 1) * p_rank * row, tokens * (r - g) * p_rank * row)


def transfer_us(tr: Traffic, link: Link, fabric: Fabric) -> float:
    """One transfer: ``latency + max(NVLink bytes / B_nvlink, RDMA bytes / B_rdma)`` (+ RDMA latency)."""
    nvl = fabric.nvlink_gbps if fabric.nvlink_gbps is not None else link.gbps
    t = link.latency_us + max(tr.nvlink_bytes / (nvl * 1e3), tr.rdma_bytes / (fabric.rdma_gbps * 1e3))
    return t + (fabric.rdma_latency_us if tr.rdma_bytes > 0 else 0.0)


def dispatch_us(layer: Layer, tokens: int, fabric: Fabric, cal: Calibration) -> float:
    """Dispatch time per rank."""
    return transfer_us(traffic(layer, tokens, fabric), cal.dispatch, fabric)


def combine_us(layer: Layer, tokens: int, fabric: Fabric, cal: Calibration) -> float:
    """Combine time per rank (the dispatch's rows back, summed on the source)."""
    return transfer_us(traffic(layer, tokens, fabric), cal.combine, fabric)


def active_experts(layer: Layer, tokens: int, ranks: int) -> float:
    """Expected local experts that receive at least one row (all ``ranks * tokens`` tokens route uniformly)."""
    return layer.e / ranks * (1.0 - (1.0 - layer.k / layer.e) ** (ranks * tokens))


def expert_us(layer: Layer, tokens: int, ranks: int, cal: Calibration) -> float:
    """Local expert time per rank: ``t0 + max(weights read / B_hbm, FLOPs / F)``, ``tokens * k`` pairs per rank."""
    weights = active_experts(layer, tokens, ranks) * layer.expert_bytes()
    flops = tokens * layer.k * 6.0 * layer.h * layer.i
    return cal.t0_us + max(weights / (cal.hbm_gbps * 1e3), flops / (cal.tflops * 1e6))


def shared_us(layer: Layer, tokens: int, cal: Calibration) -> float:
    """The shared expert on the rank's own tokens (same roofline, no fixed term; 0 without one)."""
    if not layer.shared_i:
        return 0.0
    weights = 3.0 * layer.h * layer.shared_i * layer.dtype_bytes
    flops = tokens * 6.0 * layer.h * layer.shared_i
    return max(weights / (cal.hbm_gbps * 1e3), flops / (cal.tflops * 1e6))


def two_batch_us(d: float, c: float, e: float, s: float, overhead: float, tail: float = 0.0) -> float:
    """The two-micro-batch schedule on one comm and one compute stream; ``d``, ``c``, ``e``: one micro-batch's
    dispatch, combine and experts, ``s``: the independent (shared) work, ``overhead``: the split's own cost.

    ``tail``: the part of ``s`` placed after the last combine's start instead of under the dispatches (not what
    ``ep_overlap`` emits, which puts all of it before the first wait: a what-if, :data:`WHAT_IF`)."""
    head = s - tail
    d0 = d
    d1 = d0 + d
    e0 = max(head, d0) + e
    c0 = max(d1, e0) + c
    e1 = max(e0, d1) + e
    c1 = max(c0, e1) + c
    return max(c1, e1 + tail) + overhead


@dataclasses.dataclass(frozen=True)
class Projection:
    """One layer at one size: the stage times (µs), the layer time per mode, the overlap efficiency per mode."""

    layer: Layer
    tokens: int
    fabric: Fabric
    traffic: Traffic
    dispatch_us: float
    combine_us: float
    expert_us: float
    shared_us: float
    layer_us: dict[str, float]
    efficiency: dict[str, float]
    ideal_efficiency: float
    """The most any schedule can hide: ``min(dispatch + combine, experts + shared) / (dispatch + combine)``."""


def project(layer: Layer, tokens: int, fabric: Fabric, cal: Calibration,
            split_overhead_us: float = 10.0) -> Projection:
    """Stage times and the layer per ``ep_overlap`` mode; efficiency ``(t(none) - t(mode)) / (dispatch + combine)``."""
    r = fabric.ranks
    d, c = dispatch_us(layer, tokens, fabric, cal), combine_us(layer, tokens, fabric, cal)
    e, s = expert_us(layer, tokens, r, cal), shared_us(layer, tokens, cal)
    half = tokens / 2
    t = {
        "none": d + e + c + s,
        "shared": max(d, s / 2) + e + max(c, s / 2) if s else d + e + c,
        "two_batch": two_batch_us(dispatch_us(layer, half, fabric, cal), combine_us(layer, half, fabric, cal),
                                  expert_us(layer, half, r, cal), s, split_overhead_us),
        "two_batch_tail": two_batch_us(dispatch_us(layer, half, fabric, cal), combine_us(layer, half, fabric, cal),
                                       expert_us(layer, half, r, cal), s, split_overhead_us, tail=s / 2),
    }
    eff = {m: (t["none"] - t[m]) / (d + c) for m in MODES + WHAT_IF}
    ideal = min(d + c, e + s) / (d + c)
    return Projection(layer, tokens, fabric, traffic(layer, tokens, fabric), d, c, e, s, t, eff, ideal)


def _fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``y = a + b x`` minimizing the relative squared error (weights ``1 / y^2``)."""
    w = [1.0 / y**2 for _, y in points]
    sw = sum(w)
    sx = sum(wi * x for wi, (x, _) in zip(w, points))
    sy = sum(wi * y for wi, (_, y) in zip(w, points))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, points))
    sxy = sum(wi * x * y for wi, (x, y) in zip(w, points))
    b = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    return (sy - b * sx) / sw, b


def calibrate(rows: Iterable[Measured] = MEASURED, ranks: int = MEASURED_RANKS) -> Calibration:
    """Fit the constants to the measured rows.

    * dispatch / combine: ``latency`` and ``B_nvlink`` per direction, a line through (remote bytes, µs) of all rows;
    * experts (layer minus dispatch and combine): ``t0`` and ``B_hbm`` through the decode rows (the smallest
      token count per layer: weight-read bound), ``F`` the FLOP rate that minimizes the relative squared error
      over the prefill rows (the largest token count per layer: compute-bound) given ``t0``.
    """
    rows = list(rows)
    fab = Fabric(ranks)
    remote = [traffic(m.layer, m.tokens, fab).nvlink_bytes for m in rows]
    a_d, b_d = _fit_line([(x, m.dispatch_us) for x, m in zip(remote, rows)])
    a_c, b_c = _fit_line([(x, m.combine_us) for x, m in zip(remote, rows)])
    by_layer: dict[str, list[Measured]] = {}
    for m in rows:
        by_layer.setdefault(m.layer.name, []).append(m)
    decode = [min(v, key=lambda m: m.tokens) for v in by_layer.values()]
    prefill = [max(v, key=lambda m: m.tokens) for v in by_layer.values()]
    local = lambda m: m.layer_us - m.dispatch_us - m.combine_us  # noqa: E731
    t0, per_byte = _fit_line([(active_experts(m.layer, m.tokens, ranks) * m.layer.expert_bytes(), local(m))
                              for m in decode])
    # relative least squares of local - t0 = flops / F over the prefill rows: 1/F = sum(f/y) / sum(f^2/y^2)
    fl = [(m.tokens * m.layer.k * 6.0 * m.layer.h * m.layer.i, local(m) - t0) for m in prefill]
    inv_f = sum(f / y for f, y in fl) / sum(f * f / (y * y) for f, y in fl)
    return Calibration(Link(a_d, 1e-3 / b_d), Link(a_c, 1e-3 / b_c), t0, 1e-3 / per_byte, 1e-6 / inv_f)


@dataclasses.dataclass(frozen=True)
class Check:
    """A measured figure next to the model's value at the measured size."""

    row: str
    quantity: str
    measured_us: float
    model_us: float

    @property
    def error(self) -> float:
        """Relative error of the model, ``model / measured - 1``."""
        return self.model_us / self.measured_us - 1.0


def calibration_check(cal: Calibration, rows: Iterable[Measured] = MEASURED,
                      ranks: int = MEASURED_RANKS) -> list[Check]:
    """The model against every measured figure it was fitted to (dispatch, combine, dispatch + combine, layer)."""
    out = []
    fab = Fabric(ranks)
    for m in rows:
        p = project(m.layer, m.tokens, fab, cal)
        out += [Check(m.source, "dispatch", m.dispatch_us, p.dispatch_us),
                Check(m.source, "combine", m.combine_us, p.combine_us),
                Check(m.source, "dispatch + combine", m.dispatch_us + m.combine_us, p.dispatch_us + p.combine_us),
                Check(m.source, "EP layer", m.layer_us, p.layer_us["none"])]
    return out


TOLERANCE = {"dispatch": 0.15, "combine": 0.15, "dispatch + combine": 0.10, "EP layer": 0.05}
"""The stated calibration error: the largest ``|model / measured - 1|`` allowed per quantity."""

RANKS = (2, 8, 16, 32, 64)
FABRICS = {  # label -> (NVLink GB/s or None = fitted, RDMA GB/s per GPU)
    "NVLink as measured, RDMA 50 GB/s (400 Gb/s NIC)": (None, 50.0),
    "NVLink as measured, RDMA 90 GB/s": (None, 90.0),
    "NVLink 400 GB/s, RDMA 50 GB/s": (400.0, 50.0),
}
CASES = ((DEEPSEEK_V3, 4096), (DEEPSEEK_V3, 128), (QWEN3_30B, 4096), (QWEN3_30B, 128))


def projection_table(cal: Calibration, nvlink_gbps: float | None = None, rdma_gbps: float = 50.0,
                     ranks: Sequence[int] = RANKS, node_dedup: bool = True,
                     split_overhead_us: float = 10.0) -> list[Projection]:
    """Every case of :data:`CASES` at every group size of ``ranks`` on one fabric."""
    return [project(layer, t, Fabric(r, nvlink_gbps=nvlink_gbps, rdma_gbps=rdma_gbps, node_dedup=node_dedup), cal,
                    split_overhead_us)
            for layer, t in CASES for r in ranks]


def _fmt(x: float) -> str:
    """µs as in docs/ep.md: thousands separated by a space from 100 up, one decimal below."""
    return f"{x:,.0f}".replace(",", " ") if abs(x) >= 100 else f"{x:.1f}"


def check_lines(checks: Sequence[Check], markdown: bool) -> list[str]:
    """The calibration check as text or markdown lines."""
    head = ["measured row (2 ranks)", "quantity", "measured µs", "model µs", "error"]
    body = [[c.row, c.quantity, _fmt(c.measured_us), _fmt(c.model_us), f"{c.error:+.1%}"] for c in checks]
    return _lines(head, body, markdown)


def table_lines(rows: Sequence[Projection], markdown: bool) -> list[str]:
    """The projection as text or markdown lines."""
    head = ["layer", "T/rank", "R", "nodes", "ranks/token", "nodes/token", "NVLink MB", "RDMA MB", "dispatch µs",
            "combine µs", "experts µs", "shared expert µs", "t(none) µs", "t(shared) µs",
            "t(two_batch) µs", "eff shared",
            "eff two_batch", "eff two_batch_tail", "eff ideal", "comm / compute"]
    body = []
    for p in rows:
        lay, f = p.layer, p.fabric
        comm = p.dispatch_us + p.combine_us
        body.append([lay.name, str(p.tokens), str(f.ranks), str(f.nodes()),
                     f"{distinct_ranks(lay.e, lay.k, f.ranks):.2f}",
                     f"{distinct_nodes(lay.e, lay.k, f.ranks, f.ranks_per_node):.2f}" if f.nodes() > 1 else "—",
                     f"{p.traffic.nvlink_bytes / 1e6:.1f}", f"{p.traffic.rdma_bytes / 1e6:.1f}",
                     _fmt(p.dispatch_us), _fmt(p.combine_us), _fmt(p.expert_us), _fmt(p.shared_us),
                     _fmt(p.layer_us["none"]), _fmt(p.layer_us["shared"]), _fmt(p.layer_us["two_batch"]),
                     f"{p.efficiency['shared']:.2f}", f"{p.efficiency['two_batch']:.2f}",
                     f"{p.efficiency['two_batch_tail']:.2f}", f"{p.ideal_efficiency:.2f}",
                     f"{comm / (p.expert_us + p.shared_us):.2f}"])
    return _lines(head, body, markdown)


def summary_lines(cal: Calibration, markdown: bool, split_overhead_us: float = 10.0) -> list[str]:
    """Per case and group size, on every fabric of :data:`FABRICS`: dispatch + combine, the better overlap mode
    with its efficiency, and the ideal efficiency (what any schedule could hide)."""
    tables = {label: projection_table(cal, nvl, rdma, split_overhead_us=split_overhead_us)
              for label, (nvl, rdma) in FABRICS.items()}
    head = ["layer", "T/rank", "R"]
    for label in FABRICS:
        short = label.replace("NVLink as measured", "NVL fit").replace(" (400 Gb/s NIC)", "")
        head += [f"{short}: d+c µs", "best mode (eff)", "ideal"]
    body = []
    for i, p in enumerate(next(iter(tables.values()))):
        row = [p.layer.name, str(p.tokens), str(p.fabric.ranks)]
        for rows in tables.values():
            q = rows[i]
            best = max(("shared", "two_batch"), key=lambda m: q.efficiency[m])
            row += [_fmt(q.dispatch_us + q.combine_us), f"{best} {q.efficiency[best]:.2f}",
                    f"{q.ideal_efficiency:.2f}"]
        body.append(row)
    return _lines(head, body, markdown)


def _lines(head: list[str], body: list[list[str]], markdown: bool) -> list[str]:
    """A table as markdown rows or right-aligned text columns."""
    if markdown:
        return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |"
                                                                              for r in body]
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    return ["  ".join(x.rjust(w) for x, w in zip(r, widths)) for r in [head, *body]]


def main(argv: Sequence[str] | None = None) -> int:
    """Print the calibration, its check against the measured rows and the projections; 1 if a check is off."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--markdown", action="store_true", help="markdown tables (as in docs/ep.md)")
    ap.add_argument("--split-overhead-us", type=float, default=10.0, help="two_batch's own cost per layer")
    args = ap.parse_args(argv)
    cal = calibrate()
    print("Calibration (fitted to the 2-rank all_to_all capacity rows):")
    print(f"  dispatch: latency {cal.dispatch.latency_us:.1f} µs, {cal.dispatch.gbps:.0f} GB/s by remote bytes")
    print(f"  combine:  latency {cal.combine.latency_us:.1f} µs, {cal.combine.gbps:.0f} GB/s by remote bytes")
    print(f"  experts:  t0 {cal.t0_us:.1f} µs, weights at {cal.hbm_gbps:.0f} GB/s, {cal.tflops:.0f} TFLOP/s")
    checks = calibration_check(cal)
    print()
    print("\n".join(check_lines(checks, args.markdown)))
    worst = {q: max(abs(c.error) for c in checks if c.quantity == q) for q in TOLERANCE}
    print()
    print("largest error: " + ", ".join(f"{q} {e:.1%} (tolerance {TOLERANCE[q]:.0%})" for q, e in worst.items()))
    for label, (nvl, rdma) in FABRICS.items():
        print()
        print(f"Projection, {label}, 8 ranks per node, node dedup past one node "
              f"(two_batch split overhead {args.split_overhead_us:g} µs):")
        print("\n".join(table_lines(projection_table(cal, nvl, rdma, split_overhead_us=args.split_overhead_us),
                                    args.markdown)))
    print()
    print("What overlap saves, per fabric (d+c: dispatch + combine; eff: (t(none) - t(mode)) / t(d+c)):")
    print("\n".join(summary_lines(cal, args.markdown, args.split_overhead_us)))
    print()
    print("all_to_all past one node (rank dedup only, every row to a remote node over RDMA), RDMA 50 GB/s:")
    print("\n".join(table_lines(projection_table(cal, None, 50.0, ranks=RANKS[2:], node_dedup=False,
                                                 split_overhead_us=args.split_overhead_us), args.markdown)))
    return 0 if all(abs(c.error) <= TOLERANCE[c.quantity] for c in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())

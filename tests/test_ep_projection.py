"""tools/ep_projection.py: the calibration reproduces the measured 2-rank rows, the dedup formulas match a
Monte-Carlo of uniform top-k routing, the projection moves the right way with ranks and bandwidth, and no overlap
schedule is projected to hide more than it can."""

from __future__ import annotations

import dataclasses
import importlib.util
import random
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "tools" / "ep_projection.py"
_spec = importlib.util.spec_from_file_location("ep_projection", _PATH)
proj = importlib.util.module_from_spec(_spec)
sys.modules["ep_projection"] = proj
_spec.loader.exec_module(proj)

CAL = proj.calibrate()
LAYERS = (proj.DEEPSEEK_V3, proj.QWEN3_30B)
FABRICS = [proj.Fabric(r, nvlink_gbps=nvl, rdma_gbps=rdma, node_dedup=dedup)
           for r in proj.RANKS for nvl, rdma in proj.FABRICS.values() for dedup in (True, False)]


def test_calibration_reproduces_the_measured_rows_within_the_stated_tolerance():
    checks = proj.calibration_check(CAL)
    assert len(checks) == 4 * len(proj.MEASURED)
    for c in checks:
        assert abs(c.error) <= proj.TOLERANCE[c.quantity], (c.row, c.quantity, c.measured_us, c.model_us)


def test_calibrated_constants_are_physical():
    # remote-byte bandwidths below the H200 NVLink line rate, HBM below its peak, latencies of tens of µs
    assert 100 < CAL.dispatch.gbps < 450 and 100 < CAL.combine.gbps < 450
    assert 5 < CAL.dispatch.latency_us < 60 and 5 < CAL.combine.latency_us < 60
    assert 3000 < CAL.hbm_gbps < 4800 and 200 < CAL.tflops < 990 and 0 <= CAL.t0_us < 100


def test_main_prints_the_check_and_exits_zero(capsys):
    assert proj.main(["--markdown"]) == 0
    out = capsys.readouterr().out
    assert "largest error" in out and "| DeepSeek-V3 | 4096 | 64 |" in out


@pytest.mark.parametrize("e,k,ranks,g", [(256, 8, 8, 8), (256, 8, 32, 8), (128, 8, 64, 8), (16, 4, 4, 2)])
def test_dedup_matches_monte_carlo_of_uniform_top_k(e, k, ranks, g):
    rng = random.Random(1234 + ranks)
    per_rank = e // ranks
    n = 4000
    tot_r = tot_n = 0
    for _ in range(n):
        experts = rng.sample(range(e), k)
        dest = {x // per_rank for x in experts}
        tot_r += len(dest)
        tot_n += len({r // g for r in dest})
    assert tot_r / n == pytest.approx(proj.distinct_ranks(e, k, ranks), rel=0.02)
    assert tot_n / n == pytest.approx(proj.distinct_nodes(e, k, ranks, g), rel=0.02)


def test_dedup_limits():
    assert proj.distinct_ranks(256, 8, 1) == 1.0
    assert proj.distinct_ranks(256, 8, 256) == pytest.approx(8.0)  # one expert per rank: k ranks
    assert proj.distinct_ranks(256, 8, 2) == pytest.approx(2 * (1 - 0.5**8), abs=1e-3)


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("tokens", [128, 4096])
def test_more_ranks_fewer_expert_bytes_per_rank(layer, tokens):
    weights = [proj.active_experts(layer, tokens, r) * layer.expert_bytes() for r in proj.RANKS]
    assert all(a > b for a, b in zip(weights, weights[1:]))
    times = [proj.expert_us(layer, tokens, r, CAL) for r in proj.RANKS]
    assert all(a >= b for a, b in zip(times, times[1:]))
    # the (token, expert) pairs per rank do not shrink: prefill stays compute-bound at the same time
    if tokens == 4096:
        assert times[0] == pytest.approx(times[-1])


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("ranks", [16, 32, 64])
def test_rdma_slower_than_nvlink_means_longer_comm(layer, ranks):
    # RDMA as fast as NVLink (and no RDMA latency), then 90 GB/s, then 50 GB/s per GPU: comm only grows
    as_nvlink = proj.Fabric(ranks, nvlink_gbps=400.0, rdma_gbps=400.0, rdma_latency_us=0.0)
    fast = dataclasses.replace(as_nvlink, rdma_gbps=90.0, rdma_latency_us=20.0)
    slow = dataclasses.replace(fast, rdma_gbps=50.0)
    for t in (128, 4096):
        for stage in (proj.dispatch_us, proj.combine_us):
            a, b, c = (stage(layer, t, f, CAL) for f in (as_nvlink, fast, slow))
            assert a < b <= c
        # node dedup sends fewer RDMA bytes than one row per remote rank
        no_dedup = dataclasses.replace(slow, node_dedup=False)
        assert proj.traffic(layer, t, slow).rdma_bytes < proj.traffic(layer, t, no_dedup).rdma_bytes
        # leaving the node costs more than the 8 ranks of one node
        assert proj.dispatch_us(layer, t, proj.Fabric(ranks), CAL) > proj.dispatch_us(layer, t, proj.Fabric(8), CAL)


@pytest.mark.parametrize("layer", LAYERS)
def test_more_ranks_more_bytes_per_rank(layer):
    fabs = [proj.Fabric(r) for r in proj.RANKS]
    sent = [proj.traffic(layer, 4096, f) for f in fabs]
    total = [s.nvlink_bytes + s.rdma_bytes for s in sent]
    assert all(a < b for a, b in zip(total, total[1:]))


@pytest.mark.parametrize("fabric", FABRICS, ids=lambda f: f"R{f.ranks}-{f.nvlink_gbps}-{f.rdma_gbps}-{f.node_dedup}")
@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("tokens", [128, 4096])
def test_overlap_never_hides_more_than_it_can(layer, tokens, fabric):
    p = proj.project(layer, tokens, fabric, CAL)
    # shared never slower than none, and no schedule hides more than min(comm, overlappable compute)
    assert p.layer_us["shared"] <= p.layer_us["none"] + 1e-9
    for m in proj.MODES + proj.WHAT_IF:
        assert p.efficiency[m] <= p.ideal_efficiency + 1e-9
    assert 0 < p.ideal_efficiency <= 1


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("ranks", proj.RANKS)
def test_two_batch_slower_only_by_its_own_costs(layer, ranks):
    # with no split overhead, no fixed latencies and a linear expert cost (compute-bound, no t0), the two
    # micro-batches cost the same work as one batch: two_batch is then never slower than none
    linear = proj.Calibration(proj.Link(0.0, CAL.dispatch.gbps), proj.Link(0.0, CAL.combine.gbps), 0.0, 1e12,
                              CAL.tflops)
    fab = proj.Fabric(ranks, rdma_latency_us=0.0)
    for t in (128, 4096):
        p = proj.project(layer, t, fab, linear, split_overhead_us=0.0)
        assert p.layer_us["two_batch"] <= p.layer_us["none"] * (1 + 1e-9)
        assert p.efficiency["two_batch"] >= 0


def test_two_batch_schedule():
    # comm-free: the two halves of the experts back to back
    assert proj.two_batch_us(0, 0, 5, 0, 0) == 10
    # compute-free: four transfers on one comm stream
    assert proj.two_batch_us(1, 2, 0, 0, 0) == 6
    # the shared work hides both dispatches; the last combine stays exposed
    assert proj.two_batch_us(1, 1, 10, 3, 0.5) == 3 + 10 + 10 + 1 + 0.5
    # with part of it after the last combine's start, that combine hides under it
    assert proj.two_batch_us(1, 1, 10, 3, 0.5, tail=1.5) == 1.5 + 10 + 10 + 1.5 + 0.5

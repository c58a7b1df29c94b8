"""GPU check of ``ep_overlap`` on 2 NCCL processes (skipped without 2 GPUs): every rank equals the unsharded block.

A routed block with a shared expert (bf16, H 2048, 64 experts top-8) under ``all_to_all`` (capacity and
data-dependent) and, where ``deep_ep`` imports, DeepEP normal (``async_finish``) and low-latency (receive hooks),
each with ``shared`` and ``two_batch``, the Inductor executor; the capacity modes also replayed from CUDA graphs
(``mode="reduce-overhead"``). Not yet run on a GPU.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
import torch.distributed as dist

WORLD = 2
BF16 = torch.bfloat16

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < WORLD or not dist.is_nccl_available(),
    reason=f"needs {WORLD} CUDA GPUs and NCCL")


def _case(backend, cap, mode, graphs):
    import ep_fuse
    from test_ep_overlap import SharedBlock

    from ep_fuse.ops.ep import pending_async

    dev = torch.device("cuda", torch.cuda.current_device())
    e, h, t = 64, 2048, 128
    torch.manual_seed(0)
    full = SharedBlock(e, hidden=h, inter=512, shared=1024, dtype=BF16).to(dev)
    g = torch.Generator().manual_seed(dist.get_rank())
    w, ids = torch.randn(t, e, generator=g).softmax(-1).topk(8)
    x, ids, w = torch.randn(t, h, generator=g).to(dev, BF16), ids.to(dev), w.to(dev, BF16)
    with torch.no_grad():
        ref = full(x, ids, w)
    model = ep_fuse.shard_experts(copy.deepcopy(full))
    opts = {**ep_fuse.ep_options(model, engine=backend, capacity=cap), "executor": "inductor", "ep_overlap": mode,
            **({"mode": "reduce-overhead"} if graphs else {})}
    torch._dynamo.reset()
    fn = torch.compile(model, backend="ep_fuse", options=opts)
    with torch.no_grad():
        for _ in range(3 if graphs else 1):  # CUDA graphs: warm-up, record, replay
            out = fn(x, ids, w).clone()
    torch.cuda.synchronize()
    rec = ep_fuse.last_report().ep[0]
    assert rec.engine == backend, rec
    assert rec.overlap == mode or (backend == "deepep_low_latency" and rec.overlap == "shared"), rec
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < 2e-2, (backend, cap, mode, err)
    assert pending_async() == 0


def sc_overlap(world):
    cases = [("all_to_all", 128), ("all_to_all", None)]
    if importlib.util.find_spec("deep_ep") is not None:
        cases += [("deepep", 128), ("deepep", None), ("deepep_low_latency", 128)]
    for backend, cap in cases:
        for mode in ("shared", "two_batch"):
            _case(backend, cap, mode, graphs=False)
            if cap and backend != "deepep":  # DeepEP normal with events under capture: not claimed
                _case(backend, cap, mode, graphs=True)


def test_overlap_on_two_gpus():
    from support.dist_harness import check, run_ranks

    check(run_ranks(__name__, ["sc_overlap"], world=WORLD, backend="nccl", timeout_s=600.0), "sc_overlap")

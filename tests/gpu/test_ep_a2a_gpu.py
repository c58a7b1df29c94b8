"""GPU check of the ``all_to_all`` EP engine's Triton kernels on 2 NCCL processes (skipped without 2 GPUs).

    python -m pytest tests/gpu/test_ep_a2a_gpu.py -q        (or: python tests/gpu/test_ep_a2a_gpu.py)

Per rank: the kernels equal the torch reference bitwise (DeepSeek-V3 / Qwen3 shapes and small odd ones,
capacity and data-dependent, -1 slots, a rank receiving nothing); combine(dispatch(x)) = x * #ranks(t);
capacity mode makes no host synchronisation (``torch.cuda.set_sync_debug_mode("error")``) and replays
under CUDA-graph capture with new inputs; data-dependent dispatch + combine synchronise exactly once.
NVLS / multicast are switched off in every process before the process group starts.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
import torch.distributed as dist

WORLD = 2
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
CASES = [  # (H, E, K, T, capacity, x dtype, weights dtype, routing)
    (7168, 256, 8, 128, 128, BF16, FP32, "topk"),
    (7168, 256, 8, 301, 0, BF16, FP32, "topk"),
    (2048, 128, 8, 513, 600, BF16, BF16, "topk"),
    (200, 16, 4, 77, 0, FP32, FP32, "invalid"),
    (200, 16, 4, 64, 64, FP16, FP32, "one_rank"),
    (7168, 256, 8, 4096, 4096, BF16, FP32, "topk"),
]

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < WORLD or not dist.is_nccl_available(),
    reason=f"needs {WORLD} CUDA GPUs and NCCL")


def _routing(t, e, k, h, mode, x_dtype, w_dtype, seed, device):
    g = torch.Generator().manual_seed(seed)
    w, ids = torch.randn(t, e, generator=g).softmax(-1).topk(k)
    if mode == "invalid":
        ids = torch.where(torch.rand(t, k, generator=g) < 0.3, -1, ids)
    elif mode == "one_rank":  # everything to rank 1's experts: rank 0 receives nothing
        ids = e // 2 + ids % (e // 2)
    x = torch.randn(t, h, generator=g).to(x_dtype)
    return x.to(device), ids.to(device), w.to(w_dtype).to(device)


def _run(x, ids, w, e, cap, use_kernels, a2a):
    ops = torch.ops.ep_fuse
    name = dist.group.WORLD.group_name
    from ep_fuse import runtime
    from ep_fuse.config import EpFuseConfig

    with runtime.use_config(EpFuseConfig(ep_a2a_kernels=use_kernels)):
        rx, rids, rw, hd = ops.ep_dispatch(x, ids, w, e, name, "all_to_all", "rank", cap, 60.0)
        y = (rx.float() * 2).to(x.dtype)
        out = ops.ep_combine(y, hd, ids, w, e, name, "all_to_all", "rank", cap, 60.0, None)
    return rx, rids, rw, hd, out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.is_floating_point() else t


def _checks(rank: int, device: torch.device) -> None:
    import ep_fuse.catalog  # noqa: F401  (defines every op and provider)
    from ep_fuse.ep import all_to_all as a2a
    from ep_fuse.providers.triton.jit_helpers import INTERPRET

    assert not INTERPRET, "the GPU test must compile the kernels"
    for i, (h, e, k, t, cap, xd, wd, mode) in enumerate(CASES):
        x, ids, w = _routing(t, e, k, h, mode, xd, wd, 100 * i + rank, device)
        assert a2a._dispatch_kernels(x, ids, w, WORLD)
        kern = _run(x, ids, w, e, cap, True, a2a)
        ref = _run(x, ids, w, e, cap, False, a2a)
        live = ref[1].max(1).values >= 0
        for what, a, b in zip(("recv_x", "recv_ids", "recv_weights", "handle", "combine"), kern, ref):
            if what == "recv_x":
                a, b = a[live], b[live]
            assert torch.equal(_bits(a), _bits(b)), f"case {i} ({h}, {t}, cap {cap}): {what} differs"
        valid = (ids >= 0) & (ids < e)
        dest = torch.where(valid, ids // (e // WORLD), WORLD)
        n = torch.zeros(t, WORLD + 1, device=device).scatter_(1, dest, 1.0)[:, :WORLD].sum(1, keepdim=True)
        expect = (x.float() * 2 * n).to(xd)
        assert torch.equal(_bits(kern[4]), _bits(expect)), f"case {i}: combine(dispatch(x)) != 2 x #ranks"

    h, e, k, t = 7168, 256, 8, 256
    x, ids, w = _routing(t, e, k, h, "topk", BF16, FP32, 7 + rank, device)
    # capacity mode: no host synchronisation at all
    _run(x, ids, w, e, t, True, a2a)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _run(x, ids, w, e, t, True, a2a)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    # data-dependent mode: one host read per dispatch + combine (combine reuses dispatch's splits)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _run(x, ids, w, e, 0, True, a2a)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [c for c in caught if "synchroniz" in str(c.message)]
    assert len(syncs) == 1, [str(c.message) for c in syncs]

    # capacity mode under CUDA-graph capture, replayed with new inputs
    xs, idss, ws = x.clone(), ids.clone(), w.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            _run(xs, idss, ws, e, t, True, a2a)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        captured = _run(xs, idss, ws, e, t, True, a2a)
    for seed in (11, 12):
        x2, ids2, w2 = _routing(t, e, k, h, "invalid" if seed == 12 else "topk", BF16, FP32, seed + rank, device)
        xs.copy_(x2)
        idss.copy_(ids2)
        ws.copy_(w2)
        graph.replay()
        torch.cuda.synchronize()
        eager = _run(x2, ids2, w2, e, t, True, a2a)
        live = eager[1].max(1).values >= 0
        assert torch.equal(_bits(captured[0][live]), _bits(eager[0][live])), "graph replay: recv_x"
        for what, a, b in zip(("recv_ids", "recv_weights", "handle", "combine"), captured[1:], eager[1:]):
            assert torch.equal(_bits(a), _bits(b)), f"graph replay (seed {seed}): {what} differs"


def sc_checks(world: int) -> None:
    rank = dist.get_rank()
    _checks(rank, torch.device("cuda", rank))


def test_a2a_kernels_on_two_gpus():
    from support.dist_harness import check, run_ranks

    check(run_ranks(__name__, ["sc_checks"], world=WORLD, backend="nccl", timeout_s=400.0), "sc_checks")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))

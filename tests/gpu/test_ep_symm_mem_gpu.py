"""The symm_mem EP engine on real GPUs: PyTorch's NVSHMEM ``all_to_all_vdev_2d`` / ``_offset`` through
``ep_dispatch`` / ``ep_combine``, checked against the ``all_to_all`` provider (NCCL) on random routings.

Needs >= 2 CUDA GPUs, torch with the ``symm_mem`` ops and NVSHMEM (``pip install nvidia-nvshmem-cu13``);
skipped otherwise. Two NCCL processes (``torch.multiprocessing``, spawn) run all cases and write their
results to files (a hung or crashed rank shows as "never finished"). Run it alone:
``python -m pytest -q tests/gpu/test_ep_symm_mem_gpu.py``.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import tempfile
import time
import traceback

import pytest
import torch

ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""Set in every process before torch.distributed starts (NVLink SHARP / multicast stay off)."""
WORLD = 2
TIMEOUT_S = 120.0
CASES = [(7168, 128), (2048, 128), (7168, 4096), (2048, 4096)]  # (hidden, tokens per rank)
NUM_EXPERTS, TOP_K = 64, 8


def _why_skip() -> str | None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < WORLD:
        return f"needs {WORLD} CUDA GPUs"
    if not hasattr(torch.ops.symm_mem, "all_to_all_vdev_2d"):
        return f"torch {torch.__version__} has no torch.ops.symm_mem.all_to_all_vdev_2d"
    import torch.distributed._symmetric_memory as symm

    if not symm.is_nvshmem_available():
        return "NVSHMEM is not available to torch"
    return None


pytestmark = pytest.mark.skipif(_why_skip() is not None, reason=str(_why_skip()))


# =========================================================================== in the workers
def _routing(t: int, h: int, seed: int, rank: int):
    """bf16 tokens whose first three columns identify (rank, token) exactly; top-k ids with some -1."""
    g = torch.Generator(device="cuda").manual_seed(seed * 10 + rank)
    x = torch.randn(t, h, generator=g, device="cuda").to(torch.bfloat16)
    tok = torch.arange(t, device="cuda")
    x[:, 0], x[:, 1], x[:, 2] = rank, tok // 256, tok % 256
    ids = torch.rand(t, NUM_EXPERTS, generator=g, device="cuda").topk(TOP_K).indices
    ids = torch.where(torch.rand(t, TOP_K, generator=g, device="cuda") < 0.1, -1, ids)
    if seed % 3 == 2:  # skewed: most tokens to rank 0's experts
        ids = torch.where(torch.rand(t, TOP_K, generator=g, device="cuda") < 0.8, ids % (NUM_EXPERTS // WORLD), ids)
        ids = torch.where(ids.unsqueeze(2).eq(ids.unsqueeze(1)).triu(1).any(2), -1, ids)  # no duplicate experts
    w = torch.rand(t, TOP_K, generator=g, device="cuda")
    return x, ids, w


def _fake_experts(rx, rids, rw):
    live = rids >= 0
    scale = 1 + torch.where(live, rw.float(), 0.0).sum(1, keepdim=True)
    return torch.where(live.any(1, keepdim=True), rx.float() * scale, 0.0).to(rx.dtype)


def _run(backend, x, ids, w, cap):
    ops, name = torch.ops.ep_fuse, torch.distributed.group.WORLD.group_name
    rx, rids, rw, hd = ops.ep_dispatch(x, ids, w, NUM_EXPERTS, name, backend, "rank", cap, TIMEOUT_S)
    out = ops.ep_combine(_fake_experts(rx, rids, rw), hd, ids, w, NUM_EXPERTS, name, backend, "rank", cap,
                         TIMEOUT_S, None)
    return rx, rids, rw, out


def _canonical(rx, rids, rw):
    """Received live rows sorted by their (source rank, token) key."""
    live = (rids >= 0).any(1)
    rx, rids, rw = rx[live], rids[live], rw[live]
    key = rx[:, 0].long() * 65536 + rx[:, 1].long() * 256 + rx[:, 2].long()
    order = torch.argsort(key)
    assert torch.unique(key).numel() == key.numel(), "a (token, rank) pair arrived twice"
    return rx[order], rids[order], rw[order]


def _compare(ref, got, what):
    for name, a, b in zip(("x", "ids", "weights"), _canonical(*ref[:3]), _canonical(*got[:3])):
        assert a.shape == b.shape and torch.equal(a, b), f"{what}: received {name} differ"
    assert torch.equal(ref[3], got[3]), f"{what}: combine differs, max {(ref[3].float() - got[3].float()).abs().max()}"


def case_random_routings(rank):
    for h, t in CASES:
        for seed in range(3):
            x, ids, w = _routing(t, h, seed, rank)
            for cap in (0, t):
                _compare(_run("all_to_all", x, ids, w, cap), _run("symm_mem", x, ids, w, cap),
                         f"H={h} T={t} seed={seed} capacity={cap}")
    torch.cuda.synchronize()


def case_cuda_graph(rank):
    """Capacity mode captured in a CUDA graph (buffers allocated by an eager warm-up), replayed on new routings."""
    h, t = 2048, 128
    static = _routing(t, h, 0, rank)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            _run("symm_mem", *static, t)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    torch.distributed.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _run("symm_mem", *static, t)
    for seed in range(1, 4):
        x, ids, w = _routing(t, h, seed, rank)
        for dst, src in zip(static, (x, ids, w)):
            dst.copy_(src)
        graph.replay()
        _compare(_run("all_to_all", x, ids, w, t), [c.clone() for c in captured], f"graph replay seed={seed}")
    torch.cuda.synchronize()


def _worker(rank: int, port: int, names: list[str], out_dir: str) -> None:
    os.environ.update(ENV)
    os.environ.pop("TRITON_INTERPRET", None)
    import torch.distributed as dist

    import ep_fuse.ops.ep
    import ep_fuse.catalog  # noqa: F401  (defines every op and provider)
    from ep_fuse.ep import symm_mem

    torch.cuda.set_device(rank)
    torch.empty(1, device="cuda")  # a CUDA context before NVSHMEM starts
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    results: dict[str, str] = {"available": str(symm_mem.available())}
    for name in names:
        t0 = time.perf_counter()
        try:
            globals()[name](rank)
            results[name] = "ok"
        except BaseException:  # noqa: BLE001 - reported per case
            results[name] = traceback.format_exc()
        results[name + ":seconds"] = f"{time.perf_counter() - t0:.1f}"
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        if results[name] != "ok":
            break  # a failed collective may leave the peers waiting: stop here
    with contextlib.suppress(Exception):
        symm_mem.destroy_buffers()
        dist.barrier()
        dist.destroy_process_group()


# =========================================================================== the tests
def _run_ranks(names: list[str], timeout_s: float = 540.0) -> list[dict[str, str]]:
    import torch.multiprocessing as mp

    os.environ.update(ENV)
    out_dir = tempfile.mkdtemp(prefix="ep_fuse_symm_gpu_")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.start_processes(_worker, args=(port, names, out_dir), nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    with contextlib.suppress(Exception):
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                break
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
    results = []
    for r in range(WORLD):
        try:
            with open(os.path.join(out_dir, f"rank{r}.json")) as f:
                results.append(json.load(f))
        except FileNotFoundError:
            results.append({})
    return results


def _check(results: list[dict[str, str]], name: str) -> None:
    for rank, res in enumerate(results):
        assert res.get("available", "None") == "None", f"rank {rank}: symm_mem unavailable: {res.get('available')}"
        assert name in res, f"rank {rank} never finished {name} (hang or crash): {res}"
        assert res[name] == "ok", f"rank {rank}:\n{res[name]}"


def test_random_routings_match_all_to_all():
    _check(_run_ranks(["case_random_routings"]), "case_random_routings")


def test_capacity_mode_in_a_cuda_graph():
    _check(_run_ranks(["case_cuda_graph"]), "case_cuda_graph")

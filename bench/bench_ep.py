"""Benchmark of the EP path: ``ep_dispatch`` + ``ep_combine`` alone and a whole EP MoE layer.

    torchrun --nproc-per-node 8 bench/bench_ep.py [--quick] [--backends all_to_all,deepep,deepep_low_latency]
    python bench/bench_ep.py --quick          # one process: world size 1 (loopback; says so)

Per rank: tokens/s of the EP MoE layer (``ep_fuse.shard_experts`` + compile with ``ep_fuse.ep_options``)
and GB/s of the dispatch + combine traffic (bytes of the rows that leave or arrive at a rank, both
directions, divided by the time of dispatch + combine with identity experts). Backends: ``all_to_all``
(data-dependent sizes and static capacity) always; DeepEP normal / low-latency when ``deep_ep``
imports. NCCL on CUDA, gloo on CPU. With world size 1 no EP nodes are inserted into the layer
(plain local MoE) and the dispatch/combine numbers are a loopback copy: the output says so.
Writes ``$OUT/ep.json`` and ``$OUT/ep.md`` (rank 0).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import ep_fuse
import ep_fuse.ops.canonical
from ep_fuse.ep import deepep

BF16 = torch.bfloat16
SHAPES = [  # (name, tokens per rank, H, I, E, K)
    ("DeepSeek-V3 decode", 128, 7168, 2048, 256, 8),
    ("DeepSeek-V3 prefill", 4096, 7168, 2048, 256, 8),
    ("Qwen3-30B-A3B prefill", 4096, 2048, 768, 128, 8),
]
QUICK = [("small", 256, 1024, 512, 32, 4)]


def log(*a: Any) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*a, flush=True)


def init() -> torch.device:
    cuda = torch.cuda.is_available()
    if "RANK" in os.environ:
        local = int(os.environ.get("LOCAL_RANK", 0))
        if cuda:
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=300))
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1)
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def timed(fn, iters: int, device: torch.device) -> float:
    """Median seconds of ``fn()`` over ``iters`` runs (barrier-aligned; CUDA events on GPU)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


class Block(torch.nn.Module):
    def __init__(self, e: int, h: int, i: int, device: torch.device) -> None:
        super().__init__()
        self.num_experts = e
        self.w13 = torch.nn.Parameter(torch.randn(e, 2 * i, h, device=device, dtype=BF16) / h**0.5)
        self.w2 = torch.nn.Parameter(torch.randn(e, h, i, device=device, dtype=BF16) / i**0.5)

    def forward(self, x, ids, w):
        return torch.ops.ep_fuse.moe_experts(x, ids, w, self.w13, self.w2, BF16)


def traffic_bytes(ids: torch.Tensor, e: int, world: int, rank: int, h: int, layout: str) -> int:
    """Bytes of token rows leaving this rank for other ranks in dispatch (combine moves the same back)."""
    per_rank = e // world
    dest = ids // per_rank
    if layout == "rank":
        remote = sum(int((dest == r).any(1).sum()) for r in range(world) if r != rank)
    else:
        remote = int(((dest != rank) & (ids >= 0)).sum())
    return 2 * remote * h * 2  # dispatch + combine, bf16


def run_shape(name, t, h, inter, e, k, backends, iters, device):
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = []
    if e % world:
        log(f"skip {name}: {e} experts not divisible by {world} ranks")
        return rows
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(t, h, generator=g).to(device, BF16)
    w, ids = torch.randn(t, e, generator=g).softmax(-1).topk(k)
    ids, w = ids.to(device), w.to(device)
    torch.manual_seed(1234)  # one model: every rank must hold the same expert weights before sharding
    full = Block(e, h, inter, device)
    for backend in backends:
        for cap in ((None, t) if backend == "all_to_all" else (None,) if backend == "deepep" else (t,)):
            label = f"{backend}" + (f" (capacity {cap})" if cap else " (data-dependent)")
            layout = "expert" if backend == "deepep_low_latency" else "rank"
            opname = dist.group.WORLD.group_name
            ops = torch.ops.ep_fuse

            def comm(backend=backend, layout=layout, cap=cap, opname=opname, ops=ops, ys={}):  # noqa: B006
                rx, _ids, _w, hd = ops.ep_dispatch(x, ids, w, e, opname, backend, layout, cap or 0, 300.0)
                y = ys.setdefault("y", rx.contiguous())  # stands for the experts' contiguous output (made once)
                return ops.ep_combine(y, hd, ids, w, e, opname, backend, layout, cap or 0, 300.0,
                                      BF16 if layout == "expert" else None)

            try:
                sec_comm = timed(comm, iters, device)
                model = ep_fuse.shard_experts(copy.deepcopy(full))
                opts = ep_fuse.ep_options(model, backend=backend, capacity=cap)
                executor = "inductor" if device.type == "cuda" else "eager"
                fn = torch.compile(model, backend="ep_fuse", options={**opts, "executor": executor})
                with torch.no_grad():
                    out, ref = fn(x, ids, w), full(x, ids, w)  # EP layer vs all experts on this rank
                    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                    if not err < 1e-2:
                        raise AssertionError(f"rank {rank}: EP output differs from the full layer (rel L2 {err:.2e})")
                    sec_layer = timed(lambda fn=fn: fn(x, ids, w), iters, device)
                from ep_fuse.passes.ep import ep_sites

                sites = ep_sites(ep_fuse.last_report())
                ran = sites[0].backend if sites else "none (world size 1: local MoE)"
            except Exception as exc:  # one backend failing must not hide the others
                log(f"{name} {label}: failed: {type(exc).__name__}: {exc}")
                continue
            gbs = traffic_bytes(ids, e, world, rank, h, layout) / sec_comm / 1e9
            rows.append(dict(shape=name, backend=label, ran=ran, world=world, tokens_per_rank=t,
                             dispatch_combine_us=round(sec_comm * 1e6, 1), gb_s_per_rank=round(gbs, 2),
                             layer_us=round(sec_layer * 1e6, 1), tokens_s_per_rank=round(t / sec_layer),
                             rel_l2_vs_full=f"{err:.1e}"))
            log(rows[-1])
            torch._dynamo.reset()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--backends", default=None)
    ap.add_argument("--shapes", default=None, help="comma-separated shape names (default: all)")
    args = ap.parse_args()
    device = init()
    world = dist.get_world_size()
    backends = args.backends.split(",") if args.backends else ["all_to_all"]
    if args.backends is None and device.type == "cuda" and deepep.available() is None:
        backends += ["deepep", "deepep_low_latency"]
    note = ("world size 1: no EP nodes are inserted (plain local MoE) and dispatch/combine is a loopback copy"
            if world == 1 else f"{world} ranks, {dist.get_backend()}")
    log(f"bench_ep: {note}; device {device}; backends {backends}; deep_ep: {deepep.available() or 'available'}")
    rows = []
    shapes = QUICK if args.quick else SHAPES
    if args.shapes:
        shapes = [s for s in shapes if s[0] in args.shapes.split(",")]
    for shape in shapes:
        rows += run_shape(*shape, backends, args.iters, device)
    if dist.get_rank() == 0:
        out = Path(os.environ.get("OUT", "bench_out"))
        out.mkdir(parents=True, exist_ok=True)
        meta = dict(note=note, torch=torch.__version__, device=str(device),
                    gpu=torch.cuda.get_device_name() if device.type == "cuda" else None)
        (out / "ep.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
        head = ["shape", "backend", "ran", "world", "tokens_per_rank", "dispatch_combine_us", "gb_s_per_rank",
                "layer_us", "tokens_s_per_rank", "rel_l2_vs_full"]
        lines = [f"EP benchmark ({note}; {meta['gpu'] or 'CPU'})", "", "| " + " | ".join(head) + " |",
                 "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(str(r[c]) for c in head) + " |" for r in rows]
        (out / "ep.md").write_text("\n".join(lines) + "\n")
        log("\n".join(lines))
    deepep.destroy_buffers()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Host time per call of the grouped-GEMM ops at a small size, layer by layer (GPU; issue 14).

    PYTHONPATH=bench python experiments/2026-12/host_overhead.py [--shape T,H,I,E,K] [--calls 300]

At decode sizes a compiled graph with symbolic sizes is bound by host time, and the opaque
``<op>_by_size`` ops are where ep_fuse spends more of it than Inductor (``experiments/2026-12/profile_dynamic.py``). This
times the host (CPU) time of one call issued onto an idle queue (median of 30), and ``--calls`` back-to-back
calls with one ``torch.cuda.synchronize()`` at the end (µs per call, wall clock) next to the GPU time of one
call (CUDA-graph replay). Layers, outermost first: the ``_by_size`` op, the provider op, the provider's Python function,
the launch with a precomputed config and output, and for scale ``torch._grouped_mm`` + SwiGLU (what Inductor
calls) and an empty op. Writes ``$OUT/host_overhead.json`` / ``.md``.
"""

from __future__ import annotations

import argparse
import importlib
import time
from typing import Any, Callable

import torch

from common import bench_graph_us, env_info, markdown_table, out_dir, write_json  # noqa: E402

import ep_fuse.providers  # noqa: F401  (registers torch.ops.ep_fuse_triton.*)
from ep_fuse.ops.moe import moe_permute_ref  # noqa: E402
from ep_fuse.providers.triton import moe as triton_moe  # noqa: E402

DEVICE = "cuda"
BF16 = torch.bfloat16


HOST_ONLY = ("torch.empty", "check + run-time rule", "kernel_variant")


def wall_us(fn: Callable[[], Any], calls: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def host_us(fn: Callable[[], Any], calls: int = 30) -> float:
    """Median CPU time of one call issued onto an idle queue (the GPU work never blocks the host)."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="21,2880,1408,60,6", help="T,H,I,E,K (default: issue 14's model at 3x7)")
    ap.add_argument("--calls", type=int, default=300)
    opts = ap.parse_args()
    t, h, i, e, k = (int(v) for v in opts.shape.split(","))
    g = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(t, h, device=DEVICE, dtype=BF16, generator=g)
    ids = torch.randn(t, e, device=DEVICE, generator=g).topk(k, dim=-1).indices
    rows, _s2d, seg = moe_permute_ref(x, ids, e)
    w13 = torch.randn(e, 2 * i, h, device=DEVICE, dtype=BF16, generator=g) * h**-0.5
    gk = importlib.import_module("ep_fuse.providers.triton.grouped_gemm_kernel")
    gg = importlib.import_module("ep_fuse.providers.triton.grouped_gemm")
    ops = torch.ops.ep_fuse_triton
    m = rows.shape[0]
    cfg = gk.config_for(m, i, h, e, swiglu=True)
    y = torch.empty(m, i, device=DEVICE, dtype=BF16)
    offs = seg[1:].to(torch.int32)

    def grouped_mm_swiglu():
        gate, up = torch._grouped_mm(rows, w13.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    layers = {
        "grouped_gemm_swiglu_by_size (op)": lambda: ops.grouped_gemm_swiglu_by_size(rows, w13, seg),
        "grouped_gemm_swiglu (provider op)": lambda: ops.grouped_gemm_swiglu(rows, w13, seg),
        "provider function": lambda: gg.grouped_gemm_swiglu_kernel(rows, w13, seg),
        "launch, config and output given": lambda: gk.launch_grouped_gemm_swiglu(rows, w13, seg, y, config=cfg),
        "check + run-time rule": lambda: (gg.check_grouped_gemm_swiglu_call((rows, w13, seg)),
                                          triton_moe.grouped_gemm_swiglu_at_run_time((rows, w13, seg))),
        "kernel_variant": lambda: gg.kernel_variant(rows, w13, swiglu=True),
        "torch._grouped_mm + silu * up": grouped_mm_swiglu,
        "torch.empty": lambda: torch.empty(m, i, device=DEVICE, dtype=BF16),
    }
    res = []
    for name, fn in layers.items():
        row = {"layer": name, "wall_us": wall_us(fn, opts.calls), "host_us": host_us(fn)}
        row["gpu_us"] = bench_graph_us(fn) if name not in HOST_ONLY else 0.0
        row["host_excess_us"] = max(row["wall_us"] - row["gpu_us"], 0.0)
        res.append(row)
        print(row, flush=True)
    write_json("host_overhead.json", {"env": env_info(), "shape": opts.shape, "rows": res})
    table = markdown_table(["layer", "host µs/call (idle queue)", "wall µs/call", "GPU µs/call", "wall - GPU µs"],
                           [[r["layer"], r["host_us"], r["wall_us"], r["gpu_us"], r["host_excess_us"]] for r in res])
    (out_dir() / "host_overhead.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()

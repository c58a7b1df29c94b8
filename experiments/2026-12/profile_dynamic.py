"""Where a compiled call spends its host time: ep_fuse vs Inductor on one shape, static or dynamic (GPU).

    PYTHONPATH=bench python experiments/2026-12/profile_dynamic.py [--shape 3x7] [--dynamic] [--mode default|reduce-overhead] [--layers 2]
    bash tools/device_run.sh profile_dynamic        (with $PROF_ARGS)

Same Qwen2-MoE-style model as ``experiments/2026-12/check_dynamic.py`` (issue 14's odd sizes, random weights, bf16). For
each backend it compiles, warms up, then measures per call

* **wall µs**: host time of one call with ``torch.cuda.synchronize()`` only after the loop (what the host
  spends issuing the work; when it exceeds the GPU time the call is host-bound);
* **GPU µs**: CUDA events around the same loop;
* a ``torch.profiler`` trace of a few calls: the ops with the most self CPU time, and the number of kernel
  launches per call (``cudaLaunchKernel`` / ``cuLaunchKernel*``).

It prints both tables side by side and writes ``$OUT/profile_dynamic.json`` / ``.md``, plus one Chrome trace per
backend (``profile_<backend>.json``). This is the measurement issue 14 asks for: ep_fuse at symbolic sizes
runs its provider ops opaque (no Inductor inlining), and the table shows which Python layers cost the time.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from common import env_info, markdown_table, out_dir, write_json  # noqa: E402

import ep_fuse  # noqa: E402
from ep_fuse.testing import tiny as tiny_models  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="3x7", help="batch x length of the timed call")
    p.add_argument("--warm-shapes", default="1x1,2x5", help="shapes run first (with --dynamic: compile the "
                   "symbolic graph the timed shape then reuses)")
    p.add_argument("--dynamic", action="store_true", help="torch.compile(..., dynamic=True)")
    p.add_argument("--mode", default=None)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of this script (tiny model, no GPU timing)")
    return p.parse_args()


DEVICE = "cuda"


def _inputs(spec: str) -> dict[str, Any]:
    b, s = (int(v) for v in spec.split("x"))
    g = torch.Generator().manual_seed(b * 7 + s)
    return {"input_ids": torch.randint(0, 128, (b, s), generator=g).to(DEVICE), "use_cache": False}


def _compile(model: torch.nn.Module, backend: str, args: argparse.Namespace) -> Any:
    if backend == "ep_fuse":
        return torch.compile(model, backend="ep_fuse", dynamic=args.dynamic,
                             options={"mode": args.mode} if args.mode else None)
    return torch.compile(model, backend="inductor", dynamic=args.dynamic, mode=args.mode)


def measure(model: torch.nn.Module, backend: str, args: argparse.Namespace) -> dict[str, Any]:
    torch._dynamo.reset()
    ep_fuse.reset_reports()
    f = _compile(model, backend, args)
    inputs = _inputs(args.shape)
    with torch.no_grad():
        for spec in [s for s in args.warm_shapes.split(",") if s] + [args.shape] * 5:
            f(**_inputs(spec) if spec != args.shape else inputs)
        cuda = DEVICE == "cuda"
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        sync()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            f(**inputs)
        wall = (time.perf_counter() - t0) / args.calls * 1e6
        gpu = None
        if cuda:
            end.record()
            sync()
            gpu = start.elapsed_time(end) / args.calls * 1e3
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        n_prof = 5
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(n_prof):
                f(**inputs)
            sync()
    prof.export_chrome_trace(str(out_dir() / f"profile_{backend}.json"))
    events = prof.key_averages()
    launches = sum(e.count for e in events if "LaunchKernel" in e.key) / n_prof
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[: args.top]
    rows = [[e.key[:70], e.count // n_prof, round(e.self_cpu_time_total / n_prof, 1)] for e in top]
    dev = [e for e in events if getattr(e, "self_device_time_total", 0) > 0 and e.device_type != torch.autograd.DeviceType.CPU]
    busy = sum(e.self_device_time_total for e in dev) / n_prof
    top_dev = sorted(dev, key=lambda e: e.self_device_time_total, reverse=True)[: args.top]
    dev_rows = [[e.key[:70], e.count // n_prof, round(e.self_device_time_total / n_prof, 1)] for e in top_dev]
    graphs = len(ep_fuse.reports()) if backend == "ep_fuse" else None
    return {"backend": backend, "wall_us": wall, "gpu_us": gpu, "gpu_busy_us": busy, "launches_per_call": launches,
            "graphs": graphs, "top_self_cpu": rows, "top_gpu": dev_rows}


def main() -> int:
    global DEVICE
    args = parse_args()
    DEVICE = args.device
    assert DEVICE != "cuda" or torch.cuda.is_available(), "needs a CUDA GPU (or --device cpu for a smoke test)"
    info = env_info()
    print(info, flush=True)
    sizes = dict(hidden=2880, head_dim=80, heads=36, kv_heads=4, experts=60, top_k=6, moe_intermediate=1408,
                 shared_intermediate=5632) if DEVICE == "cuda" else {}
    model = tiny_models.qwen2_moe_sized(**sizes, layers=args.layers, dtype=torch.bfloat16, device=DEVICE)
    results = [measure(model, b, args) for b in ("inductor", "ep_fuse")]
    md = [f"# Host time per call, shape {args.shape}, dynamic={args.dynamic}, mode {args.mode or 'default'}, "
          f"{args.layers} layers", ""]
    md.append(markdown_table(["backend", "wall µs/call", "GPU µs/call (events)", "GPU busy µs/call (kernels)",
                              "kernel launches/call"],
                             [[r["backend"], round(r["wall_us"], 1), r["gpu_us"] and round(r["gpu_us"], 1),
                               round(r["gpu_busy_us"], 1), r["launches_per_call"]] for r in results]))
    for r in results:
        md += ["", f"## {r['backend']}: kernels by GPU time (µs per call)", "",
               markdown_table(["kernel", "calls/call", "GPU µs"], r["top_gpu"])]
        md += ["", f"## {r['backend']}: ops by self CPU time (µs per call)", "",
               markdown_table(["op", "calls/call", "self CPU µs"], r["top_self_cpu"])]
    text = "\n".join(md) + "\n"
    print(text, flush=True)
    (out_dir() / "profile_dynamic.md").write_text(text)
    write_json("profile_dynamic.json", {"env": info, "args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

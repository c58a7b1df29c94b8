"""Host time of one compiled forward, ep_fuse against Inductor on the same model and shape, and where it goes (GPU).

    PYTHONPATH=bench python experiments/2026-12/host_per_call.py [--models qwen3_30b_a3b] [--shapes 64x1,1x1]
    bash tools/device_run.sh host_per_call        (with $HPC_ARGS)

Issue 46, item 4: ep_fuse's part of a compiled call must not cost more host time than Inductor's. Both backends
compile the same real-sized model (``bench/hf_models.py``) side by side in one process; then, per shape:

* **host µs**: one call issued onto an idle GPU queue, from the call to its return; the two backends alternate
  call by call (so drift of the machine hits both), median and 10th / 90th percentiles;
* **Python self time by package** (cProfile over ``--profile-calls`` calls): ep_fuse, Inductor's generated code,
  Inductor's runtime, AOT / Dynamo wrappers, Triton, transformers, C built-ins (kernel launches, ATen calls);
* **launches per call** by driver API (``torch.profiler``): ``cudaLaunchKernel`` (ATen, cuBLAS),
  ``cuLaunchKernel*`` (Triton kernels, Inductor's static launcher).

Writes ``$OUT/host_per_call.json`` / ``.md``.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections import defaultdict
from typing import Any, Callable

import torch

from common import env_info, markdown_table, out_dir, write_json  # noqa: E402
from hf_models import build  # noqa: E402

import ep_fuse  # noqa: E402

PACKAGES = (
    ("/ep_fuse/", "ep_fuse"),
    ("/torchinductor_", "Inductor's generated code"),
    ("/torch/_inductor/", "Inductor runtime"),
    ("/torch/_functorch/", "AOT wrappers"),
    ("/torch/_dynamo/", "Dynamo"),
    ("/torch/", "torch (other)"),
    ("/triton/", "Triton"),
    ("/transformers/", "transformers"),
)


def package(filename: str) -> str:
    if filename == "~":
        return "C built-ins (launches, ATen)"
    for needle, name in PACKAGES:
        if needle in filename:
            return name
    if "/tmp/" in filename and filename.endswith(".py"):
        return "Inductor's generated code"
    return "other"


def host_times(calls: dict[str, Callable[[], Any]], n: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(n):
        for k, fn in calls.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            times[k].append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return times


def python_split(fn: Callable[[], Any], calls: int, top: int) -> tuple[dict[str, float], list[list[Any]]]:
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(calls):
        fn()
        torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    by_pkg: dict[str, float] = defaultdict(float)
    rows = []
    for (filename, line, func), (_cc, nc, tt, _ct, _callers) in stats.items():
        if "synchronize" in func:
            continue
        by_pkg[package(filename)] += tt / calls * 1e6
        rows.append([f"{filename.rsplit('/', 2)[-1] if filename != '~' else ''}:{line} {func}"[:90], nc // calls,
                     round(tt / calls * 1e6, 1)])
    rows.sort(key=lambda r: -r[2])
    return {k: round(v, 1) for k, v in sorted(by_pkg.items(), key=lambda kv: -kv[1])}, rows[:top]


def launches(fn: Callable[[], Any], calls: int = 5) -> dict[str, float]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        if "LaunchKernel" in e.key or "cuLaunch" in e.key:
            out[e.key] += e.count / calls
    return dict(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen3_30b_a3b")
    ap.add_argument("--shapes", default="64x1,1x1")
    ap.add_argument("--calls", type=int, default=200, help="alternating timed calls per backend")
    ap.add_argument("--profile-calls", type=int, default=30)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    info = env_info()
    print(info, flush=True)
    res: dict[str, Any] = {"env": info, "args": vars(args), "rows": []}
    md = [f"# Host time per compiled call ({info.get('gpu', '')})", ""]
    for name in args.models.split(","):
        model = build(name)
        compiled = {"inductor": torch.compile(model, dynamic=False),
                    "ep_fuse": torch.compile(model, dynamic=False, backend="ep_fuse")}
        for shape in args.shapes.split(","):
            b, s = (int(v) for v in shape.split("x"))
            ids = torch.randint(0, model.config.vocab_size, (b, s), device="cuda")
            calls = {k: (lambda f=f: f(input_ids=ids, use_cache=False)) for k, f in compiled.items()}
            ep_fuse.reset_reports()
            with torch.no_grad():
                for fn in calls.values():
                    for _ in range(5):
                        fn()
                times = host_times(calls, args.calls)
                row: dict[str, Any] = {"model": name, "shape": shape, "ep_fuse_graphs": len(ep_fuse.reports())}
                for k, fn in calls.items():
                    t = sorted(times[k])
                    row[k] = {"host_us_median": round(statistics.median(t), 1),
                              "host_us_p10": round(t[len(t) // 10], 1), "host_us_p90": round(t[9 * len(t) // 10], 1)}
                    row[k]["python_self_us"], row[k]["top_functions"] = python_split(fn, args.profile_calls, args.top)
                    row[k]["launches_per_call"] = launches(fn)
            res["rows"].append(row)
            md += [f"## {name} {shape}", "", markdown_table(
                ["backend", "host µs median (p10–p90)", "launches/call"],
                [[k, f"{row[k]['host_us_median']} ({row[k]['host_us_p10']}–{row[k]['host_us_p90']})",
                  ", ".join(f"{a}: {c:g}" for a, c in row[k]["launches_per_call"].items())] for k in calls]), ""]
            pkgs = sorted({p for k in calls for p in row[k]["python_self_us"]})
            md += [markdown_table(["Python self µs/call (cProfile)"] + list(calls),
                                  [[p] + [row[k]["python_self_us"].get(p, 0.0) for k in calls] for p in pkgs]), ""]
            for k in calls:
                md += [f"### {k}: functions by self time (µs per call, under cProfile)", "",
                       markdown_table(["function", "calls/call", "self µs"], row[k]["top_functions"]), ""]
            print("\n".join(md[-40:]), flush=True)
        del model, compiled
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    text = "\n".join(md) + "\n"
    (out_dir() / "host_per_call.md").write_text(text)
    write_json("host_per_call.json", res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

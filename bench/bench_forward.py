"""One whole model forward (prefill or decode shape) of real-sized HF MoE models: eager vs Inductor vs ep_fuse,
each against the H200's floor for that forward.

    python bench/bench_forward.py [--models mixtral_8x7b,deepseek_v3] [--shapes 1x2048,64x1] [--stages]

Models from ``bench/hf_models.py`` (random weights, cut layer counts). Per (model, batch x length): the
logits of ``model(input_ids, use_cache=False)`` timed with CUDA events (``triton.testing.do_bench`` median;
host time included, so prefill shapes are GPU-bound and decode shapes partly host-bound), for eager,
``torch.compile`` (Inductor, default mode) and ``torch.compile(backend="ep_fuse")``; the logits rel-L2 of
both compiled runs against eager, and the ep_fuse report's fused sites with the provider of each MoE stage.

**Against the hardware** (``bench/roofline.py``): the floor of each row is the forward's least FLOPs at the
dense bf16 GEMM peak or its least bytes at the device-copy bandwidth, whichever binds, both ceilings measured at
the start of the same run. Each compiled run is also timed replayed from a CUDA graph (``*_graph_us``: no host
time) and its host time per call is measured (``*_host_us``: from the call to its return, the GPU idle at
the start). The fraction of the floor reached uses the CUDA-graph time. ``--stages`` adds a per-stage split
from a profile (attention, dense GEMMs, routed experts, router, norms/RoPE, LM head, other) with each stage's
own floor, so the next lever is visible.
Results are written after every measurement (``$OUT/forward.json`` / ``forward.md``), so a run cut short
keeps what it measured.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from common import (bench_graph_us, bench_parser, bench_us, copy_bandwidth_gbs, dense_gemm_tflops, env_info,
                    markdown_table, out_dir, start, write_json)
from hf_models import build  # noqa: E402
from roofline import KernelStages, forward_costs, profile_forward, stage_split, top_kernels, total

import ep_fuse


def log(*a: Any) -> None:
    print(*a, flush=True)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def providers(rep: Any) -> str:
    """``pattern=provider`` of every match, counted."""
    seen: dict[str, int] = {}
    for m in rep.matches:
        key = f"{m.pattern}={m.provider}"
        seen[key] = seen.get(key, 0) + 1
    return ", ".join(f"{k} x{v}" for k, v in sorted(seen.items()))


def host_us(fn: Any, calls: int = 20) -> float:
    """Median host time of one call of ``fn``: from the call to its return, with the GPU idle at the start."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        times.append(1e6 * (time.perf_counter() - t))
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def pct(part: float | None, whole: float | None) -> str | None:
    return f"{100 * part / whole:.0f} %" if part and whole else None


def save(res: dict[str, Any]) -> None:
    write_json("forward.json", res)
    rows = [[r["model"], r["shape"], r.get("eager_us"), r.get("inductor_us"), r.get("ep_fuse_us"),
             f"{r['speedup']:.2f}×" if "speedup" in r else None,
             f"{r.get('inductor_rel_l2', float('nan')):.1e} / {r.get('ep_fuse_rel_l2', float('nan')):.1e}",
             r.get("providers", r.get("error"))] for r in res["rows"]]
    md = markdown_table(
        ["model", "batch×len", "eager µs", "Inductor µs", "ep_fuse µs", "vs Inductor", "logits rel-L2 (Ind / ep)",
         "ep_fuse sites"], rows) + "\n"
    ceil = res.get("ceilings", {})
    rows = [[r["model"], r["shape"], r.get("floor_us") and f"{r['floor_us']:.0f} ({r.get('bound')})",
             r.get("ep_fuse_graph_us"), pct(r.get("floor_us"), r.get("ep_fuse_graph_us")),
             r.get("inductor_graph_us"), pct(r.get("floor_us"), r.get("inductor_graph_us")),
             r.get("ep_fuse_host_us"), r.get("inductor_host_us")] for r in res["rows"]]
    md += (f"\nCeilings measured in this run: copy {ceil.get('copy_gbs', 0):.0f} GB/s, dense bf16 GEMM "
           f"{ceil.get('gemm_tflops', 0):.0f} TF/s.\n\n" + markdown_table(
               ["model", "batch×len", "floor µs (bound)", "ep_fuse µs (CUDA graph)", "of floor",
                "Inductor µs (CUDA graph)", "of floor", "ep_fuse host µs/call", "Inductor host µs/call"], rows) + "\n")
    for r in res["rows"]:
        if "stages" not in r:
            continue
        srows = [[s, v.get("floor_us"), v.get("inductor_us"), v.get("ep_fuse_us"),
                  pct(v.get("floor_us"), v.get("ep_fuse_us"))] for s, v in r["stages"].items()]
        md += f"\n{r['model']} {r['shape']}, per stage (profiled GPU µs):\n\n" + markdown_table(
            ["stage", "floor µs", "Inductor µs", "ep_fuse µs", "ep_fuse of floor"], srows) + "\n"
    (out_dir() / "forward.md").write_text(md)


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--models", default="mixtral_8x7b,deepseek_v3")
    ap.add_argument("--shapes", default="1x2048")
    ap.add_argument("--stages", action="store_true", help="profile each compiled forward and split it by stage")
    opts = ap.parse_args()
    start(opts)
    res: dict[str, Any] = {"env": env_info(), "rows": []}
    log(res["env"])
    ceil = res["ceilings"] = {"copy_gbs": copy_bandwidth_gbs(), "gemm_tflops": dense_gemm_tflops()}
    log(f"ceilings: {ceil}")
    stages = KernelStages() if opts.stages else None
    t0 = time.time()
    for name in opts.models.split(","):
        torch.cuda.empty_cache()
        model = build(name)
        for shape in opts.shapes.split(","):
            b, s = (int(v) for v in shape.split("x"))
            row: dict[str, Any] = {"model": name, "shape": shape}
            res["rows"].append(row)
            costs = forward_costs(model, b, s)
            whole = total(costs)
            row["floor_us"] = whole.floor_us(ceil["gemm_tflops"], ceil["copy_gbs"])
            row["bound"] = whole.bound(ceil["gemm_tflops"], ceil["copy_gbs"])
            row["floor_tflop"], row["floor_gb"] = whole.flops / 1e12, whole.bytes / 1e9
            if stages is not None:
                floors = {k: c.floor_us(ceil["gemm_tflops"], ceil["copy_gbs"]) for k, c in costs.items()}
                row["stages"] = {k: {"floor_us": round(f, 1) if f >= 0.5 else None} for k, f in floors.items()}
            ids = torch.randint(0, model.config.vocab_size, (b, s), device="cuda",
                                generator=torch.Generator(device="cuda").manual_seed(b * s))
            try:
                with torch.no_grad():
                    ref = model(input_ids=ids, use_cache=False).logits
                    row["eager_us"] = bench_us(lambda m=model: m(input_ids=ids, use_cache=False))
                    for label, kw in (("inductor", {}), ("ep_fuse", {"backend": "ep_fuse"})):
                        torch._dynamo.reset()
                        ep_fuse.reset_reports()
                        fn = torch.compile(model, dynamic=False, **kw)
                        out = fn(input_ids=ids, use_cache=False).logits
                        row[f"{label}_rel_l2"] = rel_l2(out, ref)
                        call = lambda fn=fn: fn(input_ids=ids, use_cache=False)  # noqa: E731
                        row[f"{label}_us"] = bench_us(call)
                        row[f"{label}_host_us"] = host_us(call)
                        try:
                            row[f"{label}_graph_us"] = bench_graph_us(call)
                        except Exception as exc:  # not capturable: say so, keep the row
                            row[f"{label}_graph_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                        if stages is not None:
                            kernels = profile_forward(call)
                            for k, v in stage_split(kernels, stages).items():
                                row["stages"][k][f"{label}_us"] = round(v, 1)
                            row[f"{label}_top_kernels"] = top_kernels(kernels, stages)
                        if label == "ep_fuse":
                            row["providers"] = providers(ep_fuse.last_report())
                        log(f"{name} {shape} {label}: {row[f'{label}_us']:.1f} us ({time.time() - t0:.0f} s)")
                row["speedup"] = row["inductor_us"] / row["ep_fuse_us"]
            except Exception as exc:  # a failure is a result; keep the others
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                log(f"{name} {shape}: {row['error']}")
            save(res)
        del model
    log((out_dir() / "forward.md").read_text())


if __name__ == "__main__":
    main()

"""GPU check of dynamic shapes on an odd-sized Qwen2-MoE-style model: graphs, fused sites, accuracy, speed.

    PYTHONPATH=bench python experiments/2026-12/check_dynamic.py [--dtype bf16 fp16] [--dynamic true auto] [--no-mark]
                                  [--mode default|reduce-overhead] [--layers 4] [--quick]
    bash tools/run_on_device.sh experiments/2026-12/check_dynamic.py [args]      (installs ep_fuse first)

The model (random weights, nothing downloaded) has the issue's sizes by default: hidden 2880, head_dim 80
(36 heads, 4 KV heads), 60 experts, top-6, a shared expert (``--moe-inter``/``--shared-inter`` set the
expert widths). For each dtype and dynamic setting (``true``: ``dynamic=True``; ``auto``: ``dynamic=None``,
static first, dynamic on recompile) it runs the (batch, length) sequence ``--shapes`` through

* ``torch.compile(model, backend="ep_fuse", dynamic=...)`` and
* ``torch.compile(model, backend="inductor", dynamic=...)`` with the same settings and inputs,

with the batch dim marked by ``ep_fuse.dynamic_batch`` (unless ``--no-mark``: then Dynamo specialises
batch 1 and length 1, 4 graphs over the default sequence for both backends). It prints, per graph,
the fused sites (against a static compile of the same model) and the providers (including choices made
at run time), then per shape the relative L2 error of the logits against eager and the time per call of
both backends (median, CUDA events; ``--mode reduce-overhead`` replays CUDA graphs). Exit status 1 when
ep_fuse compiled more than 2 graphs (with the batch marked), a graph fused other sites than the static
compile, the rewrite added shape guards, or an error exceeds ``--max-rel``. Writes
``$OUT/check_dynamic.json`` and ``check_dynamic.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

from common import bench_us, env_info, markdown_table, out_dir, write_json  # noqa: E402

import ep_fuse  # noqa: E402
from ep_fuse.testing import tiny as tiny_models  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DYNAMIC = {"true": True, "auto": None}


def log(*a: Any) -> None:
    print(*a, flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=["bf16", "fp16"])
    p.add_argument("--dynamic", nargs="+", choices=list(DYNAMIC), default=["true", "auto"])
    p.add_argument("--no-mark", action="store_true", help="do not mark the batch dim (Dynamo's 0/1 specialisation)")
    p.add_argument("--no-cudnn-sdpa", action="store_true",
                   help="torch.backends.cuda.enable_cudnn_sdp(False): cuDNN's SDPA check guards on an unbacked "
                        "batch when there is a mask (docs/benchmarks.md#dynamic-shapes)")
    p.add_argument("--mode", default=None, help="torch.compile mode for both backends (e.g. reduce-overhead)")
    p.add_argument("--shapes", default="1x1,3x7,17x1,64x1,2x333,1x1024", help="batch x length, comma-separated")
    p.add_argument("--hidden", type=int, default=2880)
    p.add_argument("--head-dim", type=int, default=80)
    p.add_argument("--heads", type=int, default=36)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--experts", type=int, default=60)
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--moe-inter", type=int, default=1408)
    p.add_argument("--shared-inter", type=int, default=5632)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--max-rel", type=float, default=0.02, help="largest relative L2 error of the logits accepted")
    p.add_argument("--quick", action="store_true", help="2 layers, shorter timing")
    p.add_argument("--no-time", action="store_true", help="skip the timing (graphs, sites and errors only)")
    p.add_argument("--device", default="cuda", help="cuda; cpu only for a smoke test of this script (with --no-time)")
    p.add_argument("--tag", default="", help="suffix of the result files (check_dynamic_TAG.json/.md)")
    p.add_argument("--ep-options", type=json.loads, default={},
                   help='extra ep_fuse options as JSON for every ep_fuse compile, e.g. \'{"disable": ["moe_gating"]}\'')
    return p.parse_args()


def shapes(spec: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in s.split("x")) for s in spec.split(",")]  # type: ignore[misc]


DEVICE = "cuda"


def inputs_for(b: int, s: int, mark: bool) -> dict[str, Any]:
    g = torch.Generator().manual_seed(b * 100003 + s)
    inputs = {"input_ids": torch.randint(0, 128, (b, s), generator=g).to(DEVICE), "use_cache": False}
    return ep_fuse.dynamic_batch(inputs, force=True) if mark else inputs


def graph_count() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compile_for(model: torch.nn.Module, backend: str, dynamic: bool | None, args: argparse.Namespace) -> Any:
    if backend == "ep_fuse":
        options = {**args.ep_options, **({"mode": args.mode} if args.mode else {})}
        return torch.compile(model, backend="ep_fuse", dynamic=dynamic, options=options or None)
    return torch.compile(model, backend="inductor", dynamic=dynamic, mode=args.mode)


def static_sites(model: torch.nn.Module, args: argparse.Namespace) -> dict[str, int]:
    torch._dynamo.reset()
    ep_fuse.reset_reports()
    with torch.no_grad():
        torch.compile(model, backend="ep_fuse", dynamic=False, options=args.ep_options or None)(
            **inputs_for(2, 5, False))
    return ep_fuse.last_report().counts()


def run(model: torch.nn.Module, backend: str, dynamic: bool | None, args: argparse.Namespace,
        refs: dict[tuple[int, int], torch.Tensor]) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    ep_fuse.reset_reports()
    counters.clear()
    f = compile_for(model, backend, dynamic, args)
    rows = []
    with torch.no_grad():
        for b, s in shapes(args.shapes):
            inputs = inputs_for(b, s, not args.no_mark)
            out = f(**inputs).logits.float()  # compiles (or reuses) the graph for this shape
            ref = refs[b, s]
            rel = ((out - ref).norm() / ref.norm()).item()
            us = None
            if not args.no_time:
                us = bench_us(lambda: f(**inputs), warmup_ms=25 if args.quick else 100,
                              rep_ms=100 if args.quick else 500)
            rows.append({"shape": f"{b}x{s}", "rel_l2": rel, "us": us, "graphs_so_far": graph_count()})
            log(f"  {backend:8s} {b}x{s}: rel-L2 {rel:.4f}, {us if us is None else round(us, 1)} us, "
                f"graphs so far {graph_count()}")
    result: dict[str, Any] = {"graphs": graph_count(), "shapes": rows}
    if backend == "ep_fuse":
        result["reports"] = [{"graph": r.graph, "sites": r.counts(), "providers": sorted({m.provider or "-" for m in
                                                                                        r.matches}),
                              "run_time": sorted({rt for m in r.matches for rt in m.run_time}),
                              "declined": sorted({f"{p}: {why}" for m in r.matches for p, why in m.declined}),
                              "shape_guards": r.shape_guards,
                              "near_misses": [n.explain() for n in r.near_misses]} for r in ep_fuse.reports()]
    return result


def main() -> int:
    global DEVICE
    args = parse_args()
    if args.quick:
        args.layers = 2
    DEVICE = args.device
    assert DEVICE != "cuda" or torch.cuda.is_available(), "a CUDA GPU is needed"
    if args.no_cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    assert DEVICE == "cuda" or args.no_time, "timing needs CUDA (use --no-time)"
    info = env_info()
    log(info)
    failures: list[str] = []
    payload: dict[str, Any] = {"env": info, "args": vars(args), "runs": []}
    md = [f"# Dynamic shapes: Qwen2-MoE-style H{args.hidden} D{args.head_dim} E{args.experts} k{args.top_k} "
          f"I{args.moe_inter} shared {args.shared_inter}, {args.layers} layers, mode {args.mode or 'default'}, "
          f"batch {'not marked' if args.no_mark else 'marked (ep_fuse.dynamic_batch)'}"
          f"{', cuDNN SDPA off' if args.no_cudnn_sdpa else ''}", ""]
    for dname in args.dtype:
        model = tiny_models.qwen2_moe_sized(
            hidden=args.hidden, head_dim=args.head_dim, heads=args.heads, kv_heads=args.kv_heads,
            experts=args.experts, top_k=args.top_k, moe_intermediate=args.moe_inter,
            shared_intermediate=args.shared_inter, layers=args.layers, dtype=DTYPES[dname], device=DEVICE)
        with torch.no_grad():
            refs = {(b, s): model(**inputs_for(b, s, False)).logits.float() for b, s in shapes(args.shapes)}
        static = static_sites(model, args)
        expected = tiny_models.qwen2_moe_expected(args.layers)
        log(f"{dname}: static compile sites {static}" + ("" if static == expected else f" (expected {expected})"))
        for dyn in args.dynamic:
            log(f"== {dname}, dynamic={dyn}")
            ours = run(model, "ep_fuse", DYNAMIC[dyn], args, refs)
            base = run(model, "inductor", DYNAMIC[dyn], args, refs)
            for rep in ours["reports"]:
                same = rep["sites"] == static
                log(f"  graph {rep['graph']}: sites {rep['sites']}{'' if same else '  != static ' + str(static)}; "
                    f"providers {rep['providers']}; shape guards {rep['shape_guards'] or 'none'}")
                for note in rep["run_time"]:
                    log(f"    chosen per call: {note}")
                for note in rep["declined"]:
                    log(f"    declined: {note}")
                for miss in rep["near_misses"]:
                    log("    near miss: " + miss.replace("\n", "\n      "))
                if not same:
                    failures.append(f"{dname}/{dyn}: graph {rep['graph']} fused {rep['sites']}, static {static}")
                if rep["shape_guards"]:
                    failures.append(f"{dname}/{dyn}: graph {rep['graph']} shape guards {rep['shape_guards']}")
            if not args.no_mark and ours["graphs"] > 2:
                failures.append(f"{dname}/{dyn}: ep_fuse compiled {ours['graphs']} graphs (> 2)")
            rows = []
            for a, b in zip(ours["shapes"], base["shapes"]):
                if a["rel_l2"] > args.max_rel:
                    failures.append(f"{dname}/{dyn} {a['shape']}: rel-L2 {a['rel_l2']:.4f} > {args.max_rel}")
                speedup = b["us"] / a["us"] if a["us"] and b["us"] else None
                rows.append([a["shape"], f"{a['rel_l2']:.4f}", f"{b['rel_l2']:.4f}", a["us"], b["us"],
                             f"{speedup:.3f}" if speedup else None])
            table = markdown_table(["batch x length", "rel-L2 ep_fuse", "rel-L2 Inductor", "ep_fuse us",
                                    "Inductor us", "speedup"], rows)
            summary = f"graphs: ep_fuse {ours['graphs']}, Inductor {base['graphs']}"
            log(summary)
            log(table)
            md += [f"## {dname}, dynamic={dyn}", "", summary, "", table, ""]
            payload["runs"].append({"dtype": dname, "dynamic": dyn, "static_sites": static, "ep_fuse": ours,
                                    "inductor": base})
        del model, refs
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    stem = f"check_dynamic_{args.tag}" if args.tag else "check_dynamic"
    write_json(f"{stem}.json", payload)
    (out_dir() / f"{stem}.md").write_text("\n".join(md) + "\n")
    for f in failures:
        log("FAIL:", f)
    log("OK" if not failures else f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

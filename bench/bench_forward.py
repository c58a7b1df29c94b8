"""One whole model forward (prefill or decode shape) of real-sized HF MoE models: eager vs Inductor vs ep_fuse.

    python bench/bench_forward.py [--models mixtral_8x7b,deepseek_v3] [--shapes 1x2048,64x1]

Models from ``bench/hf_models.py`` (random weights, cut layer counts). Per (model, batch x length): the
logits of ``model(input_ids, use_cache=False)`` timed with CUDA events (``triton.testing.do_bench`` median;
host time included, so prefill shapes are GPU-bound and decode shapes partly host-bound), for eager,
``torch.compile`` (Inductor, default mode) and ``torch.compile(backend="ep_fuse")``; the logits rel-L2 of
both compiled runs against eager, and the ep_fuse report's fused sites with the provider of each MoE stage.
Results are written after every measurement (``$OUT/forward.json`` / ``forward.md``), so a run cut short
keeps what it measured.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from common import bench_parser, bench_us, env_info, markdown_table, out_dir, start, write_json
from hf_models import build  # noqa: E402

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


def save(res: dict[str, Any]) -> None:
    write_json("forward.json", res)
    rows = [[r["model"], r["shape"], r.get("eager_us"), r.get("inductor_us"), r.get("ep_fuse_us"),
             f"{r['speedup']:.2f}×" if "speedup" in r else None,
             f"{r.get('inductor_rel_l2', float('nan')):.1e} / {r.get('ep_fuse_rel_l2', float('nan')):.1e}",
             r.get("providers", r.get("error"))] for r in res["rows"]]
    (out_dir() / "forward.md").write_text(markdown_table(
        ["model", "batch×len", "eager µs", "Inductor µs", "ep_fuse µs", "vs Inductor", "logits rel-L2 (Ind / ep)",
         "ep_fuse sites"], rows) + "\n")


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--models", default="mixtral_8x7b,deepseek_v3")
    ap.add_argument("--shapes", default="1x2048")
    opts = ap.parse_args()
    start(opts)
    res: dict[str, Any] = {"env": env_info(), "rows": []}
    log(res["env"])
    t0 = time.time()
    for name in opts.models.split(","):
        torch.cuda.empty_cache()
        model = build(name)
        for shape in opts.shapes.split(","):
            b, s = (int(v) for v in shape.split("x"))
            row: dict[str, Any] = {"model": name, "shape": shape}
            res["rows"].append(row)
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
                        row[f"{label}_us"] = bench_us(lambda fn=fn: fn(input_ids=ids, use_cache=False))
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

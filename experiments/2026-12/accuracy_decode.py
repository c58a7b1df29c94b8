"""Which fused stage moves the logits away from eager, and is it closer to or further from the truth?

    PYTHONPATH=bench python experiments/2026-12/accuracy_decode.py [--model deepseek_v3] [--shapes 64x1,1x2048]

One forward of a real-sized model (``hf_models.py``, random weights, bf16) per shape (batch x length).
References: eager bf16 (what the user runs today) and an fp32 copy of the same weights ("truth").
Compared: Inductor (``torch.compile`` default), ep_fuse (Inductor executor, all patterns), and ep_fuse
with one pattern family at a time under the eager executor -- every other op runs exactly as eager,
so the difference from eager is that family's alone. Relative L2 of the logits against both
references. Writes ``$OUT/accuracy_decode.json`` / ``.md``.
"""

from __future__ import annotations

import argparse
import copy
import gc
from typing import Any

import torch

import hf_models  # noqa: E402
from common import env_info, markdown_table, out_dir, write_json  # noqa: E402

import ep_fuse  # noqa: E402

FAMILIES = [("norms", ["rms_norm", "add_rms_norm"]), ("rope", ["rope"]), ("gemm_swiglu", ["gemm_swiglu"]),
            ("moe_gating", ["moe_gating"]), ("moe_experts", ["moe_experts"])]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def logits(fn: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return fn(input_ids=ids, use_cache=False).logits.float()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="deepseek_v3")
    ap.add_argument("--shapes", default="64x1,1x2048")
    args = ap.parse_args()
    info = env_info()
    print(info, flush=True)
    model = hf_models.build(args.model)
    truth_model = copy.deepcopy(model).float()
    rows = []
    for shape in args.shapes.split(","):
        b, s = (int(v) for v in shape.split("x"))
        g = torch.Generator(device="cuda").manual_seed(b * 10007 + s)
        ids = torch.randint(1, model.config.vocab_size, (b, s), device="cuda", generator=g)
        eager = logits(model, ids)
        truth = logits(truth_model, ids)
        runs: list[tuple[str, Any, str]] = [("eager bf16", model, "")]
        torch._dynamo.reset()
        runs.append(("inductor", torch.compile(model), ""))
        for label, opts in [("ep_fuse (all, inductor)", {}),
                            *[(f"ep_fuse {name} only (eager executor)", {"patterns": pats, "executor": "eager"})
                              for name, pats in FAMILIES]]:
            runs.append((label, ("ep_fuse", opts), ""))
        for label, fn, _ in runs:
            note = ""
            if isinstance(fn, tuple):
                torch._dynamo.reset()
                ep_fuse.reset_reports()
                fn = torch.compile(model, backend=fn[0], options=fn[1])
            try:
                out = logits(fn, ids)
            except Exception as exc:
                print(f"{shape} {label}: failed: {type(exc).__name__}: {exc}", flush=True)
                continue
            if "ep_fuse" in label:
                note = " | ".join(r.summary() for r in ep_fuse.reports())
            rows.append(dict(shape=shape, run=label, vs_eager=rel(out, eager), vs_truth=rel(out, truth), note=note))
            print(rows[-1], flush=True)
            torch._dynamo.reset()
            gc.collect()
    write_json("accuracy_decode.json", dict(env=info, rows=rows))
    md = markdown_table(["shape", "run", "rel-L2 vs eager bf16", "rel-L2 vs fp32 truth", "note"],
                        [[r["shape"], r["run"], f"{r['vs_eager']:.2e}", f"{r['vs_truth']:.2e}", r["note"][:90]]
                         for r in rows])
    (out_dir() / "accuracy_decode.md").write_text(f"{info}\n\n{md}\n")
    print(md, flush=True)


if __name__ == "__main__":
    main()

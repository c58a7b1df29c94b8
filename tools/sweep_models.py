"""Generality sweep: every MoE causal-LM family of the installed transformers, built tiny from its own config
class with random weights, compiled with ``backend="ep_fuse"`` (and ``backend="inductor"``), compared with eager.

    python tools/sweep_models.py                          # all families, fp32, executor eager
    python tools/sweep_models.py --only inkling2_loop,mixtral --dtype bf16 --executor inductor --inductor
    python tools/sweep_models.py --json sweep.json --md sweep.md
    python tools/sweep_models.py --dtype fp32,bf16,fp16 --reference --json sweep.json   # site counts per dtype

One row per family: routed MoE blocks in the model, ``moe_experts`` / ``moe_gating`` sites fused (all graphs of
the forward), other sites, graph count, max |Δ| of the logits vs eager per backend and dtype, errors. The logic
is :mod:`ep_fuse.testing.sweep`; ``tests/test_sweep.py`` pins the counts (``pytest -m "not slow" tests/test_sweep.py``: the FAST families only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import ep_fuse.catalog  # noqa: E402,F401
from ep_fuse.testing import sweep  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated families (default: all discovered)")
    ap.add_argument("--dtype", default="fp32", help="fp32, bf16 or fp32,bf16")
    ap.add_argument("--executor", default="eager", choices=("eager", "inductor"))
    ap.add_argument("--inductor", action="store_true", help='also compile with backend="inductor" (slow)')
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the tiny models are built on the CPU, then moved)")
    ap.add_argument("--reference", action="store_true",
                    help="lower every site to its reference provider (the same sites; on a CPU several times faster "
                         "than the Triton interpreter)")
    ap.add_argument("--json", help="write the results as JSON here")
    ap.add_argument("--md", help="write the markdown table here")
    ap.add_argument("--pins", help="write tests/support/sweep_expected.py's EXPECTED entries here")
    args = ap.parse_args(argv)
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("ep_fuse").setLevel(logging.ERROR)
    families = [f for f in args.only.split(",") if f] or sweep.discover()
    dtypes = tuple(d for d in args.dtype.split(",") if d)
    results = []
    t0 = time.perf_counter()
    for fam in families:
        providers = {dt: sweep.REFERENCE_ONLY for dt in dtypes} if args.reference else None
        res = sweep.sweep_family(fam, dtypes, args.executor, args.inductor, args.device, providers)
        results.append(res)
        runs = "; ".join(f"{r.backend} {r.dtype}: {r.counts} graphs={r.graphs} max|d|={sweep._fmt(r.max_abs)}"
                         + (f" ERROR {r.error[:200]}" if r.error else "") for r in res.runs)
        print(f"{fam}: blocks={res.moe_blocks} {runs or 'not built: ' + (res.skip or '')[:200]} "
              f"({res.seconds:.1f}s)", flush=True)
    table = sweep.markdown(results, dtypes, args.inductor)
    print(table)
    print(f"total {time.perf_counter() - t0:.0f}s for {len(families)} families")
    if args.md:
        with open(args.md, "w") as f:
            f.write(table + "\n")
    if args.pins:
        with open(args.pins, "w") as f:
            f.writelines(f"    {r.family!r}: {sweep.pins(r)!r},\n" for r in results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": sweep.to_json(results), "totals": sweep.totals(results, dtypes[0])}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

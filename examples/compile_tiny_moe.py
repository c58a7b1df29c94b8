"""Compile a tiny Mixtral-style MoE model with ep_fuse and print what was fused.

    python examples/compile_tiny_moe.py [--model NAME] [--device cpu|cuda] [--executor auto|inductor|eager]
                                        [--dynamic]

NAME is one of ``ep_fuse.testing.tiny.TINY_MODELS`` (default mixtral). The model is built from a config
with random weights (nothing is downloaded). On a CPU without ``TRITON_INTERPRET=1`` the sites are
matched and lowered to the reference provider; on CUDA the Triton kernels run where they measured
faster than Inductor (``docs/benchmarks.md``).
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

import ep_fuse
from ep_fuse.testing import tiny as tiny_models
from ep_fuse.report import compile_totals

warnings.filterwarnings("ignore", message=".*functools.lru_cache.*")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="mixtral", choices=tiny_models.TINY_MODELS)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--executor", default="auto", choices=["auto", "inductor", "eager"])
    ap.add_argument("--dynamic", action="store_true", help="compile with dynamic shapes")
    args = ap.parse_args()

    model = tiny_models.build(args.model, device=args.device)
    inputs = tiny_models.example_inputs(device=args.device)
    compiled = torch.compile(model, backend="ep_fuse", options={"executor": args.executor},
                             dynamic=args.dynamic or None)
    with torch.no_grad():
        expected = model(**inputs).logits
        t0 = time.perf_counter()
        got = compiled(**inputs).logits
        seconds = time.perf_counter() - t0

    phases, _ = compile_totals(ep_fuse.reports())
    split = ", ".join(f"{phase} {s:.1f} s" for phase, s in phases.items())
    print(f"ep_fuse {ep_fuse.__version__}, torch {torch.__version__}: {args.model} on {args.device}, "
          f"first call (compile) {seconds:.1f} s ({split})")
    for report in ep_fuse.reports():
        print(report)
        for miss in report.near_misses:
            print(miss.explain())
    diff = (got.float() - expected.float()).abs().max().item()
    print(f"max |compiled - eager| over the logits: {diff:.4g} (logits up to {expected.float().abs().max().item():.3g})")


if __name__ == "__main__":
    main()

"""Which rewrite moves a model's bf16 output away from eager: compile one sweep family with ``backend="ep_fuse"``
once per pattern disabled (and with ``--alone`` once per pattern alone) and print max |Δ| of the logits against eager, beside
``backend="inductor"``'s.

    PYTHONPATH=bench python experiments/2026-12/drift_bisect.py exaone_moe granitemoe_swa [--device cuda] [--executor inductor] [--seeds 8]

With ``--seeds N`` each compile is compared on N input sets: a rewrite that changes how Inductor fuses the rest of
the graph can flip a near-tied top-k choice on one input and not on the next, which one input cannot tell apart from
a stage that rounds differently on every input.
"""

from __future__ import annotations

import argparse
import logging
import os
import warnings

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import ep_fuse.catalog as catalog  # noqa: E402
from ep_fuse.testing import sweep  # noqa: E402


def _dist(model: torch.nn.Module, inputs: list[dict], refs: list[torch.Tensor], backend: str,
          opts: dict | None) -> str:
    """max |Δ| to eager for each input set (one compile: the inputs share their shapes)."""
    torch._dynamo.reset()
    fn = torch.compile(model, backend=backend, options=opts)
    with torch.no_grad():
        ds = [(sweep._logits(fn(**x)).float() - r.float()).abs().max().item() for x, r in zip(inputs, refs)]
    torch._dynamo.reset()
    return " ".join(f"{d:.2e}" for d in ds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("families", nargs="+")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--executor", default="inductor", choices=("eager", "inductor"))
    ap.add_argument("--seeds", type=int, default=1, help="input sets (token ids) to compare on, one compile")
    ap.add_argument("--only-base", action="store_true", help="inductor and ep_fuse only (no bisection)")
    ap.add_argument("--alone", action="store_true", help="also compile with each pattern alone")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("ep_fuse").setLevel(logging.ERROR)
    names = catalog.pattern_names()
    for fam in args.families:
        model, _ = sweep.build_tiny(fam, torch.bfloat16)
        model = model.to(args.device)
        inputs = [{k: v.to(args.device) if isinstance(v, torch.Tensor) else v
                   for k, v in sweep.example_inputs(seed=seed).items()} for seed in range(args.seeds)]
        with torch.no_grad():
            ref = [sweep._logits(model(**x)) for x in inputs]
        base = {"executor": args.executor}
        rows = [("inductor", _dist(model, inputs, ref, "inductor", None)), ("ep_fuse", _dist(model, inputs, ref, "ep_fuse", base)),
                ("ep_fuse, no pattern", _dist(model, inputs, ref, "ep_fuse", {**base, "patterns": ()}))]
        for n in [] if args.only_base else names:
            rows.append((f"without {n}", _dist(model, inputs, ref, "ep_fuse", {**base, "disable": (n,)})))
            if args.alone:
                rows.append((f"only {n}", _dist(model, inputs, ref, "ep_fuse", {**base, "patterns": (n,)})))
        for label, d in rows:
            print(f"{fam} {label:<24} max|d| {d}", flush=True)


if __name__ == "__main__":
    main()

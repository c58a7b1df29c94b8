"""Same-process A/B of the TMA grouped GEMM: another version of its module against the installed one.

    git show REV:ep_fuse/providers/triton/grouped_gemm_tma_kernel.py > bench/_old_tma_kernel.py
    python bench/ab_tma_kernel.py --old bench/_old_tma_kernel.py [--only NAME,...] [--repeat 4]

(the copy must sit inside the working tree to reach the device machine; it is not committed). Per shape, both
GEMMs (gate|up + SwiGLU, then down on its output) run at each module's own ``config_for`` pick, plus the
installed pick without ``flatten`` where it has it; outputs must be bit-identical (same K order), then the
variants are timed alternately ``--repeat`` times from CUDA-graph replays and the medians compared (the same
kernel timed twice in one process differs by up to 7 %). Random top-k routing as in
``bench_grouped_gemm_tma.py``. Writes ``$OUT/ab_tma.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("EP_FUSE_UNVERIFIED_KERNELS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_grouped_gemm_tma import SHAPES  # noqa: E402
from bench_moe_experts import make_weights, routed_rows  # noqa: E402
from common import bench_graph_us, env_info, write_json  # noqa: E402


def load_module(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("ab_old_tma_kernel", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="a copy of grouped_gemm_tma_kernel.py to compare against")
    ap.add_argument("--only", default="qwen3_30b_a3b_T4096,deepseek_v3_T4096,deepseek_v3_T16384")
    ap.add_argument("--repeat", type=int, default=4)
    args = ap.parse_args()
    new = importlib.import_module("ep_fuse.providers.triton.grouped_gemm_tma_kernel")
    old = load_module(args.old)
    rows_out = []
    for name in args.only.split(","):
        t, h, i, e, k = SHAPES[name]
        w13, w2 = make_weights(h, i, e)
        rows, seg = routed_rows(t, h, e, k)
        m = rows.shape[0]
        act = torch.empty(m, i, device="cuda", dtype=torch.bfloat16)
        new.launch_grouped_gemm_swiglu_tma(rows, w13, seg, act)
        for gemm, x, w, n, kk in (("gate_up_swiglu", rows, w13, i, h), ("down", act, w2, h, i)):
            swiglu = gemm == "gate_up_swiglu"
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            picked = new.config_for(m, n, kk, e, swiglu=swiglu)
            variants = {"old": (old, old.config_for(m, n, kk, e, swiglu=swiglu)), "new": (new, picked)}
            if getattr(picked, "flatten", False):
                variants["new, not flattened"] = (new, dataclasses.replace(picked, flatten=False))

            def launcher(mod: Any, cfg: Any) -> Any:
                fn = mod.launch_grouped_gemm_swiglu_tma if swiglu else mod.launch_grouped_gemm_tma
                return lambda: fn(x, w, seg, out, config=cfg)

            results = {}
            for label, (mod, cfg) in variants.items():
                launcher(mod, cfg)()
                results[label] = out.clone()
            for label, res in results.items():
                assert torch.equal(res, results["old"]), f"{name} {gemm}: {label} differs from old"
            times: dict[str, list[float]] = {label: [] for label in variants}
            for _ in range(args.repeat):
                for label, (mod, cfg) in variants.items():
                    times[label].append(bench_graph_us(launcher(mod, cfg)))
            med = {label: statistics.median(v) for label, v in times.items()}
            row = {"shape": name, "gemm": gemm, "configs": {lb: str(c) for lb, (_m, c) in variants.items()},
                   "us": times, "median_us": med, "vs_old": {lb: med["old"] / v for lb, v in med.items()}}
            rows_out.append(row)
            print(name, gemm, {lb: f"{med[lb]:.1f} us ({row['vs_old'][lb]:.3f}x)" for lb in med}, flush=True)
        del w13, w2, rows, act
        torch.cuda.empty_cache()
    write_json("ab_tma.json", {"env": env_info(), "old": args.old, "rows": rows_out})


if __name__ == "__main__":
    main()

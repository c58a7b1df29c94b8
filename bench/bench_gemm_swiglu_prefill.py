"""Dense GEMM + SwiGLU at prefill sizes: the Hopper TMA kernel (one-expert grouped GEMM) vs cuBLAS + Inductor.

    python bench/bench_gemm_swiglu_prefill.py [--rows 1024,2048,4096,8192] [--budget 120]

Issue 16 item 3. For each (H, I) of an MLP (Llama-7B H4096/I11008, DeepSeek-V3 dense H7168/I18432, its
shared expert H7168/I2048) and each row count: (a) what Inductor runs without ep_fuse, ``silu(x @ Wg.T) *
(x @ Wu.T)`` compiled by ``torch.compile`` (two cuBLAS GEMMs and one fused SwiGLU kernel), (b) one dense
cuBLAS GEMM with both weights concatenated (the practical ceiling, no SwiGLU), (c) the one-tile-per-program
``gemm_swiglu`` kernel, (d) the TMA kernel at its default config and, within ``--budget`` seconds, a few other
configs. Outputs are checked against an fp32 reference (relative L2 < 1e-2). GPU time from CUDA-graph replays.
Writes ``$OUT/gemm_swiglu_prefill.json`` / ``.md``; the ``vs Inductor`` column is what
``perf.GEMM_SWIGLU_TMA_WINS`` is set from.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("EP_FUSE_UNVERIFIED_KERNELS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_grouped_gemm_tma import log, timed  # noqa: E402
from common import env_info, markdown_table, out_dir, write_json  # noqa: E402

import ep_fuse.providers  # noqa: E402,F401
# by module path: the package attribute ``gemm_swiglu_kernel`` is the provider function of that name
dk = importlib.import_module("ep_fuse.providers.triton.gemm_swiglu_kernel")
tk = importlib.import_module("ep_fuse.providers.triton.grouped_gemm_tma_kernel")

BF16 = torch.bfloat16
MLPS = {"llama7b": (4096, 11008), "deepseek_v3_dense": (7168, 18432), "deepseek_v3_shared": (7168, 2048)}


def configs() -> list[Any]:
    c = tk.TmaGemmConfig
    return [c(128, 128, 64, 8, 4, 8), c(64, 256, 64, 8, 3, 8), c(128, 128, 64, 8, 3, 16), c(128, 128, 64, 8, 4, 1),
            c(128, 64, 64, 4, 4, 8), c(128, 128, 64, 8, 3, 8, desc="host")]


def run(name: str, h: int, i: int, m: int, until: float) -> list[dict[str, Any]]:
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, h, device="cuda", dtype=BF16, generator=g)
    wg = (torch.randn(i, h, device="cuda", generator=g) * h**-0.5).to(BF16)
    wu = (torch.randn(i, h, device="cuda", generator=g) * h**-0.5).to(BF16)
    w13t = torch.cat([wg, wu]).t()
    ref = torch.nn.functional.silu(x.float() @ wg.float().T) * (x.float() @ wu.float().T)
    out = torch.empty(m, i, device="cuda", dtype=BF16)
    flops = 2.0 * m * h * 2 * i

    @torch.compile(dynamic=False)
    def inductor(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(torch.nn.functional.linear(x, wg)) * torch.nn.functional.linear(x, wu)

    d_cfg = dk.gemm_config(m, i, h)
    t_cfg = tk.dense_config_for(m, i, h)
    rows = [
        timed("inductor (cuBLAS + SwiGLU)", lambda: inductor(x), flops, None, ref),
        timed("cublas_dense (ceiling)", lambda: torch.mm(x, w13t), flops),
        timed(f"gemm_swiglu default [{d_cfg}]", lambda: dk.launch(x, wg, wu, out, config=d_cfg), flops, out, ref),
        timed(f"tma_default [{t_cfg}]", lambda: tk.launch_gemm_swiglu_tma(x, wg, wu, out, config=t_cfg), flops,
              out, ref),
    ]
    for cfg in configs():
        if cfg == t_cfg:
            continue
        if time.time() > until:
            rows.append({"variant": f"tma [{cfg}]", "error": "skipped: time budget"})
            continue
        rows.append(timed(f"tma [{cfg}]", lambda c=cfg: tk.launch_gemm_swiglu_tma(x, wg, wu, out, config=c), flops,
                          out, ref))
    base, ceil = rows[0].get("us"), rows[1].get("tflops")
    for r in rows:
        r.update(mlp=name, H=h, I=i, rows=m)
        if base and "us" in r:
            r["vs_inductor"] = base / r["us"]
        if ceil and "tflops" in r:
            r["pct_cublas"] = 100 * r["tflops"] / ceil
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=",".join(MLPS))
    ap.add_argument("--rows", default="1024,2048,4096,8192")
    ap.add_argument("--budget", type=float, default=120.0, help="seconds of config sweeping, shared over the cases")
    opts = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (sm90+)")
    t0 = time.time()
    res: dict[str, Any] = {"env": env_info(), "rows": []}
    log(res["env"])
    cases = [(n, *MLPS[n], int(m)) for n in opts.only.split(",") for m in opts.rows.split(",")]
    for idx, (name, h, i, m) in enumerate(cases):
        left = max(0.0, opts.budget - (time.time() - t0)) / (len(cases) - idx)
        log(f"{name} H{h} I{i} rows {m}")
        res["rows"] += run(name, h, i, m, time.time() + left)
        write_json("gemm_swiglu_prefill.json", res)
    body = [[r["mlp"], r["rows"], r["variant"], r.get("us"), r.get("tflops"), r.get("pct_cublas"),
             f"{r['vs_inductor']:.2f}×" if "vs_inductor" in r else None,
             f"{r['rel_err']:.1e}" if "rel_err" in r else r.get("error")] for r in res["rows"]]
    md = markdown_table(["MLP", "rows", "variant", "µs", "TF/s", "% cuBLAS", "vs Inductor", "rel err"], body)
    best = []
    for name, h, i, m in cases:
        ok = [r for r in res["rows"] if r["mlp"] == name and r["rows"] == m and r["variant"].startswith("tma")
              and "us" in r]
        if ok:
            b = min(ok, key=lambda r: r["us"])
            best.append([name, m, b["variant"], b["tflops"], b.get("pct_cublas"),
                         f"{b['vs_inductor']:.2f}×" if "vs_inductor" in b else None])
    md += "\n\nBest TMA config per case:\n\n" + markdown_table(
        ["MLP", "rows", "config", "TF/s", "% cuBLAS", "vs Inductor"], best)
    (out_dir() / "gemm_swiglu_prefill.md").write_text(md + "\n")
    log(md)
    log(f"total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()

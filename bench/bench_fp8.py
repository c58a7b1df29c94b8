"""Benchmark of the FP8 block-scaled experts vs the bf16 ep_fuse experts (DeepSeek-V3 routed layer).

    EP_FUSE_UNVERIFIED_KERNELS=1 python bench/bench_fp8.py [--only decode,prefill] [--no-reference]

**Not run yet**: written in a session without a GPU; no numbers exist (``docs/benchmarks.md``).
Shapes: H7168 I2048 E256 top-8, decode T128 and prefill T4096. Rows are routed by top-k of random logits.
Timed from CUDA-graph replays, permute to unpermute excluded for bf16 (both paths share the unpermute):

* ``bf16``: ``grouped_gemm_swiglu`` + ``grouped_gemm`` (the ep_fuse Triton experts path), on permuted rows;
* ``fp8 triton``: ``moe_permute_fp8`` (permute + 1 x 128 quant) + ``grouped_gemm_fp8_swiglu_quant`` +
  ``grouped_gemm_fp8`` (needs ``EP_FUSE_UNVERIFIED_KERNELS=1``); ``+ bf16 permute`` is added to the bf16 time
  so both include the permute;
* ``fp8 reference``: the pure-torch reference chain (what runs by default on CUDA), timed once (host loop).

Reports µs, TFLOP/s (``2 * rows * (2I*H + H*I)`` flops) and the output rel-L2 vs the bf16 path on
random activations and on activations with outlier channels (a few channels x50). Targets (issue 17):
decode >= 1.8x, prefill >= 1.6x. Writes ``$OUT/fp8.json`` / ``fp8.md``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_graph_us, env_info, markdown_table, out_dir, write_json

import ep_fuse.providers  # noqa: F401  (registers torch.ops.ep_fuse_triton.*)
from ep_fuse.ops import fp8_reference as R
from ep_fuse.providers.triton import fp8 as T
from ep_fuse.providers.triton.grouped_gemm import (
    grouped_gemm_kernel,
    grouped_gemm_swiglu_kernel,
)
from ep_fuse.providers.triton.moe_permute import moe_permute_kernel
from ep_fuse.providers.triton.unverified import ENV, cleared

BF16 = torch.bfloat16
DEVICE = "cuda"
SHAPES = {"decode": (128, 7168, 2048, 256, 8), "prefill": (4096, 7168, 2048, 256, 8)}
TARGETS = {"decode": 1.8, "prefill": 1.6}
BN, BK = R.BLOCK


def log(*a: Any) -> None:
    print(*a, flush=True)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def make_weights(h: int, i: int, e: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=DEVICE).manual_seed(1)
    w13 = torch.randn(e, 2 * i, h, device=DEVICE, dtype=BF16, generator=g).mul_(h**-0.5)
    w2 = torch.randn(e, h, i, device=DEVICE, dtype=BF16, generator=g).mul_(i**-0.5)
    (q13, s13), (q2, s2) = R.quantize_weight_fp8(w13), R.quantize_weight_fp8(w2)
    return {"w13": w13, "w2": w2, "q13": q13, "s13": s13, "q2": q2, "s2": s2}


def tokens(t: int, h: int, e: int, k: int, outliers: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=DEVICE).manual_seed(t)
    x = torch.randn(t, h, device=DEVICE, dtype=BF16, generator=g)
    if outliers:
        x[:, torch.randperm(h, device=DEVICE, generator=g)[:8]] *= 50
    ids = torch.randn(t, e, device=DEVICE, generator=g).topk(k, dim=-1).indices
    return x, ids


def bf16_path(x, ids, w, e):
    rows, _src, seg = moe_permute_kernel(x, ids, e)
    return grouped_gemm_kernel(grouped_gemm_swiglu_kernel(rows, w["w13"], seg), w["w2"], seg), seg


def fp8_triton(x, ids, w, e):
    xq, xs, _src, seg = T.moe_permute_fp8_kernel(x, ids, e, BK)
    aq, a_s = T.grouped_gemm_fp8_swiglu_quant_kernel(xq, xs, w["q13"], w["s13"], seg, BN, BK)
    return T.grouped_gemm_fp8_kernel(aq, a_s, w["q2"], w["s2"], seg, BN, BK, BF16)


def fp8_reference(x, ids, w, e):
    xq, xs, _src, seg = R.moe_permute_fp8_ref(x, ids, e, BK)
    aq, a_s = R.grouped_gemm_fp8_swiglu_quant_ref(xq, xs, w["q13"], w["s13"], seg, BN, BK)
    return R.grouped_gemm_fp8_ref(aq, a_s, w["q2"], w["s2"], seg, BN, BK, BF16)


def run_shape(name: str, shape: tuple[int, ...], w: dict[str, torch.Tensor], reference: bool) -> dict[str, Any]:
    t, h, i, e, k = shape
    flops = 2 * t * k * (2 * i * h + h * i)
    row: dict[str, Any] = {"shape": name, "T": t, "H": h, "I": i, "E": e, "K": k, "target": TARGETS[name]}
    with torch.no_grad():
        for label, outliers in (("random", False), ("outliers", True)):
            x, ids = tokens(t, h, e, k, outliers)
            y_bf16, _seg = bf16_path(x, ids, w, e)
            y_ref = fp8_reference(x, ids, w, e)
            row[f"ref_vs_bf16_{label}"] = rel_l2(y_ref, y_bf16)
            row[f"triton_vs_ref_{label}"] = rel_l2(fp8_triton(x, ids, w, e), y_ref)
            row[f"triton_vs_bf16_{label}"] = rel_l2(fp8_triton(x, ids, w, e), y_bf16)
        x, ids = tokens(t, h, e, k, False)
        row["bf16_us"] = bench_graph_us(lambda: bf16_path(x, ids, w, e))
        row["fp8_triton_us"] = bench_graph_us(lambda: fp8_triton(x, ids, w, e))
        if reference:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fp8_reference(x, ids, w, e)
            torch.cuda.synchronize()
            row["fp8_reference_us"] = 1e6 * (time.perf_counter() - t0)
    for key in ("bf16", "fp8_triton", "fp8_reference"):
        if f"{key}_us" in row:
            row[f"{key}_tflops"] = flops / row[f"{key}_us"] / 1e6
    row["speedup"] = row["bf16_us"] / row["fp8_triton_us"]
    log(row)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=",".join(SHAPES))
    ap.add_argument("--no-reference", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8.py needs a CUDA GPU (sm90+)")
    if not cleared("fp8:triton"):
        raise SystemExit(f"set {ENV}=1: the Triton FP8 kernels are not yet verified on a GPU")
    info = env_info()
    log(info)
    w = make_weights(7168, 2048, 256)
    rows = [run_shape(name, SHAPES[name], w, not args.no_reference) for name in args.only.split(",")]
    write_json("fp8.json", {"env": info, "rows": rows})
    table = markdown_table(
        ["shape", "bf16 µs", "FP8 Triton µs", "speedup", "target", "FP8 ref µs", "bf16 TFLOP/s", "FP8 TFLOP/s",
         "rel L2 vs bf16 (random / outliers)"],
        [[r["shape"], r["bf16_us"], r["fp8_triton_us"], f"{r['speedup']:.2f}x", f"{r['target']}x",
          r.get("fp8_reference_us"), r["bf16_tflops"], r["fp8_triton_tflops"],
          f"{r['triton_vs_bf16_random']:.4f} / {r['triton_vs_bf16_outliers']:.4f}"] for r in rows])
    (out_dir() / "fp8.md").write_text(table + "\n")
    log(table)


if __name__ == "__main__":
    main()

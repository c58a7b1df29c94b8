"""GPU check + benchmark of the W8A8 int8 expert chain vs the bf16 ep_fuse experts path.

    python bench/bench_w8a8.py [--no-sweep] [--only decode,prefill]

Shapes (DeepSeek-V3 experts): decode T128, prefill T4096, with H7168 I2048 E256 top-8. Rows are routed by
top-k of random logits and permuted with the reference permute (not timed: both paths share it and the
unpermute). Timed, from CUDA-graph replays:

* ``bf16``: ``grouped_gemm_swiglu`` + ``grouped_gemm`` (the ep_fuse Triton experts path);
* ``w8a8``: ``quant_per_token`` + ``grouped_gemm_w8a8_swiglu_quant`` (int8 GEMM, dequant + SwiGLU
  epilogue, per-token requant) + ``grouped_gemm_w8a8`` (int8 GEMM, dequant epilogue to bf16).

Correctness first: each W8A8 stage against the pure-torch reference (``quant_reference``), and the W8A8
output's relative L2 vs the bf16 path. Targets (issue): decode >= 1.7x, prefill >= 1.4x. Then a small
tile-config sweep per int8 kernel. Writes ``$OUT/w8a8.json`` / ``w8a8.md``. Runs in < 4 minutes.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from common import bench_graph_us, bench_parser, env_info, markdown_table, out_dir, start, write_json

import ep_fuse.providers  # noqa: F401  (registers torch.ops.ep_fuse_triton.*)
from ep_fuse.ops import w8a8 as R
from ep_fuse.ops.moe import moe_permute_ref
from ep_fuse.providers.triton import w8a8_kernel as K
from ep_fuse.providers.triton.grouped_gemm import grouped_gemm_kernel, grouped_gemm_swiglu_kernel
from ep_fuse.providers.triton.grouped_gemm_kernel import GemmConfig as C
from ep_fuse.providers.triton.w8a8 import (
    grouped_gemm_w8a8_kernel,
    grouped_gemm_w8a8_swiglu_quant_kernel,
    quant_per_token_kernel,
)

BF16 = torch.bfloat16
DEVICE = "cuda"
SHAPES = {"decode": (128, 7168, 2048, 256, 8), "prefill": (4096, 7168, 2048, 256, 8)}
TARGETS = {"decode": 1.7, "prefill": 1.4}
SWEEP_BUDGET_S = 170.0
"""Stop sweeping once the whole run has taken this long."""


def log(*a: Any) -> None:
    print(*a, flush=True)


def sweep_configs(decode: bool, swiglu: bool) -> list[C]:
    if decode:
        return [C(16, 64, 256, 4, 4, 1, True), C(16, 128, 256, 4, 4, 1, True), C(16, 64, 128, 4, 5, 1, True),
                C(16, 32, 256, 4, 4, 1, True), C(16, 128, 128, 4, 6, 1, True), C(16, 64, 512, 4, 3, 1, True),
                C(32, 64, 256, 4, 4, 1, True), C(16, 64, 256, 4, 4, 1, False)]
    if swiglu:
        return [C(128, 128, 128, 8, 3, 8), C(128, 128, 128, 8, 4, 8), C(128, 64, 128, 4, 4, 8),
                C(64, 128, 128, 4, 4, 8), C(128, 128, 64, 8, 4, 8), C(128, 256, 128, 8, 3, 8)]
    return [C(128, 256, 128, 8, 3, 8), C(128, 128, 128, 8, 4, 8), C(128, 256, 64, 8, 4, 8),
            C(64, 256, 128, 4, 3, 8), C(128, 128, 128, 4, 4, 8), C(256, 128, 128, 8, 3, 8)]


def rel_l2(out: torch.Tensor, ref: torch.Tensor, limit: float) -> float:
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    if not err < limit or torch.isnan(out.float()).any():
        raise AssertionError(f"relative L2 error {err} >= {limit}")
    return err


def codes_close(q: torch.Tensor, qr: torch.Tensor) -> float:
    """Fraction of int8 codes off by one (any larger difference fails)."""
    diff = (q.int() - qr.int()).abs()
    if int(diff.max()) > 1:
        raise AssertionError(f"int8 codes differ by {int(diff.max())}")
    return (diff > 0).float().mean().item()


def make_weights(h: int, i: int, e: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=DEVICE).manual_seed(1)
    w13 = torch.randn(e, 2 * i, h, device=DEVICE, dtype=BF16, generator=g).mul_(h**-0.5)
    w2 = torch.randn(e, h, i, device=DEVICE, dtype=BF16, generator=g).mul_(i**-0.5)
    (w13q, w13s), (w2q, w2s) = R.quantize_weight(w13), R.quantize_weight(w2)
    return {"w13": w13, "w2": w2, "w13q": w13q, "w13s": w13s, "w2q": w2q, "w2s": w2s}


def routed_rows(t: int, h: int, e: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=DEVICE).manual_seed(t)
    x = torch.randn(t, h, device=DEVICE, dtype=BF16, generator=g)
    ids = torch.randn(t, e, device=DEVICE, generator=g).topk(k, dim=-1).indices
    rows, _src2dst, seg = moe_permute_ref(x, ids, e)
    return rows, seg


def bf16_path(rows, w, seg):
    return grouped_gemm_kernel(grouped_gemm_swiglu_kernel(rows, w["w13"], seg), w["w2"], seg)


def w8a8_path(rows, w, seg):
    xq, xs = quant_per_token_kernel(rows)
    aq, a_s = grouped_gemm_w8a8_swiglu_quant_kernel(xq, xs, w["w13q"], w["w13s"], seg)
    return grouped_gemm_w8a8_kernel(aq, a_s, w["w2q"], w["w2s"], seg, BF16)


def check(rows, w, seg) -> dict[str, float]:
    """Each Triton stage vs the reference on the same inputs; the chain vs the bf16 path."""
    out: dict[str, float] = {}
    xq, xs = quant_per_token_kernel(rows)
    xqr, xsr = R.quant_per_token_ref(rows)
    out["quant_codes_off_by_one"] = codes_close(xq, xqr)
    out["quant_scale_err"] = rel_l2(xs, xsr, 1e-5)
    aq, a_s = grouped_gemm_w8a8_swiglu_quant_kernel(xqr, xsr, w["w13q"], w["w13s"], seg)
    aqr, asr = R.grouped_gemm_w8a8_swiglu_quant_ref(xqr, xsr, w["w13q"], w["w13s"], seg)
    out["swiglu_codes_off_by_one"] = codes_close(aq, aqr)
    out["swiglu_scale_err"] = rel_l2(a_s, asr, 1e-4)
    y = grouped_gemm_w8a8_kernel(aqr, asr, w["w2q"], w["w2s"], seg, BF16)
    out["gemm_err"] = rel_l2(y, R.grouped_gemm_w8a8_ref(aqr, asr, w["w2q"], w["w2s"], seg, BF16), 1e-2)
    out["w8a8_vs_bf16_err"] = rel_l2(w8a8_path(rows, w, seg), bf16_path(rows, w, seg), 5e-2)
    return out


def sweep(rows, w, seg, t0: float) -> dict[str, list[dict[str, Any]]]:
    m, h = rows.shape
    e, i = w["w13q"].shape[0], w["w13q"].shape[1] // 2
    decode = K.is_decode(m, e)
    xq, xs = quant_per_token_kernel(rows)
    act = torch.empty(m, i, device=DEVICE, dtype=torch.float32)
    K.launch_w8a8_gemm(xq, xs, w["w13q"], w["w13s"], seg, act, swiglu=True)
    aq, a_s = quant_per_token_kernel(act)
    y = torch.empty(m, h, device=DEVICE, dtype=BF16)
    K.launch_w8a8_gemm(aq, a_s, w["w2q"], w["w2s"], seg, y, swiglu=False)
    refs = {"swiglu": act.clone(), "gemm": y.clone()}
    res: dict[str, list[dict[str, Any]]] = {"swiglu": [], "gemm": []}
    jobs = (("swiglu", True, K.config_for(m, i, h, e, swiglu=True), xq, xs, "w13q", "w13s", act),
            ("gemm", False, K.config_for(m, h, i, e), aq, a_s, "w2q", "w2s", y))
    for name, swiglu, default, a, s, wq, ws, out in jobs:
        cfgs = [default] + [c for c in sweep_configs(decode, swiglu) if c != default]
        for cfg in cfgs:
            if time.time() - t0 > SWEEP_BUDGET_S:
                res[name].append({"cfg": str(cfg), "error": "skipped: time budget"})
                continue
            try:
                out.fill_(float("nan"))

                def launch(a=a, s=s, wq=wq, ws=ws, out=out, swiglu=swiglu, cfg=cfg):
                    K.launch_w8a8_gemm(a, s, w[wq], w[ws], seg, out, swiglu=swiglu, config=cfg)

                launch()
                rel_l2(out, refs[name], 1e-3)
                res[name].append({"cfg": str(cfg), "us": bench_graph_us(launch), "default": cfg == default})
            except Exception as exc:
                res[name].append({"cfg": str(cfg), "error": f"{type(exc).__name__}: {str(exc)[:160]}"})
            log(f"    {name}: {res[name][-1]}")
    return res


def run_shape(name: str, shape: tuple[int, ...], w: dict[str, torch.Tensor], do_sweep: bool, t0: float) -> dict[str, Any]:
    t, h, i, e, k = shape
    rows, seg = routed_rows(t, h, e, k)
    m = rows.shape[0]
    row: dict[str, Any] = {"shape": name, "T": t, "H": h, "I": i, "E": e, "K": k, "rows": m,
                           "active_experts": int((seg.diff() > 0).sum())}
    with torch.no_grad():
        row.update(check(rows, w, seg))
        row["bf16_us"] = bench_graph_us(lambda: bf16_path(rows, w, seg))
        row["w8a8_us"] = bench_graph_us(lambda: w8a8_path(rows, w, seg))
        xq, xs = quant_per_token_kernel(rows)
        aq, a_s = grouped_gemm_w8a8_swiglu_quant_kernel(xq, xs, w["w13q"], w["w13s"], seg)
        row["w8a8_quant_us"] = bench_graph_us(lambda: quant_per_token_kernel(rows))
        row["w8a8_swiglu_quant_us"] = bench_graph_us(
            lambda: grouped_gemm_w8a8_swiglu_quant_kernel(xq, xs, w["w13q"], w["w13s"], seg))
        row["w8a8_gemm_us"] = bench_graph_us(lambda: grouped_gemm_w8a8_kernel(aq, a_s, w["w2q"], w["w2s"], seg, BF16))
        row["speedup"] = row["bf16_us"] / row["w8a8_us"]
        row["target"] = TARGETS.get(name)
        log(f"{name} T{t} H{h} I{i} E{e} K{k}: bf16 {row['bf16_us']:.1f}us, w8a8 {row['w8a8_us']:.1f}us "
            f"(quant {row['w8a8_quant_us']:.1f} + swiglu+requant {row['w8a8_swiglu_quant_us']:.1f} + gemm "
            f"{row['w8a8_gemm_us']:.1f}) -> {row['speedup']:.2f}x (target {row['target']}x); "
            f"w8a8 vs bf16 rel L2 {row['w8a8_vs_bf16_err']:.4f}")
        if do_sweep:
            row["sweep"] = sweep(rows, w, seg, t0)
            best = {}
            for kern in ("swiglu", "gemm"):
                ok = [s for s in row["sweep"][kern] if "us" in s]
                if ok:
                    best[kern] = min(ok, key=lambda s: s["us"])
                    row[f"best_{kern}_cfg"], row[f"best_{kern}_us"] = best[kern]["cfg"], best[kern]["us"]
            if len(best) == 2:
                # the swept swiglu GEMM excludes its requant launch; add it back from the default run
                requant = row["w8a8_swiglu_quant_us"] - next(
                    (s["us"] for s in row["sweep"]["swiglu"] if s.get("default") and "us" in s), 0.0)
                row["best_w8a8_us"] = row["w8a8_quant_us"] + max(requant, 0.0) + best["swiglu"]["us"] + best["gemm"]["us"]
                row["best_speedup"] = row["bf16_us"] / row["best_w8a8_us"]
                log(f"  best swept: swiglu {best['swiglu']['cfg']} + gemm {best['gemm']['cfg']} -> "
                    f"{row['best_w8a8_us']:.1f}us, {row['best_speedup']:.2f}x")
    return row


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--only", default=",".join(SHAPES))
    args = ap.parse_args()
    start(args)
    if not torch.cuda.is_available():
        raise SystemExit("bench_w8a8.py needs a CUDA GPU (run experiments/2026-12/accuracy_w8a8.py for the CPU accuracy numbers)")
    t0 = time.time()
    info = env_info()
    log(info)
    h, i, e = 7168, 2048, 256
    w = make_weights(h, i, e)
    log(f"weights ready in {time.time() - t0:.1f}s")
    rows = []
    for name in args.only.split(","):
        rows.append(run_shape(name, SHAPES[name], w, not args.no_sweep, t0))
    write_json("w8a8.json", {"env": info, "rows": rows})
    table = markdown_table(
        ["shape", "rows", "bf16 µs", "W8A8 µs", "speedup", "target", "best swept µs", "best speedup", "rel L2 vs bf16"],
        [[r["shape"], r["rows"], r["bf16_us"], r["w8a8_us"], f"{r['speedup']:.2f}x", f"{r['target']}x",
          r.get("best_w8a8_us"), f"{r['best_speedup']:.2f}x" if "best_speedup" in r else None,
          f"{r['w8a8_vs_bf16_err']:.4f}"] for r in rows])
    (out_dir() / "w8a8.md").write_text(table + "\n")
    log(table)
    log(f"total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()

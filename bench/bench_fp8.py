"""Benchmark of the FP8 block-scaled experts vs the bf16 ep_fuse experts (DeepSeek-V3 routed layer).

    python bench/bench_fp8.py [--only decode,prefill] [--no-reference] [--sweep] [--tma] [--budget S] [--balanced]

H200, 2026-11-30 (``docs/benchmarks.md``), with the swept configs: decode 1.92x, prefill 1.08x the bf16 experts.
Shapes: H7168 I2048 E256 top-8, decode T128, T512-T2048, prefill T4096 and T16384 (``--only`` picks). Rows are
routed by top-k of random logits (``--balanced``: ``common.balanced_topk_ids``, every expert gets ``T*K/E``
rows).
Timed from CUDA-graph replays, permute to unpermute excluded for bf16 (both paths share the unpermute):

* ``bf16``: ``grouped_gemm_swiglu`` + ``grouped_gemm`` (the ep_fuse Triton experts path), on permuted rows;
* ``fp8 triton``: ``moe_permute_fp8`` (permute + 1 x 128 quant) + ``grouped_gemm_fp8_swiglu_quant`` +
  ``grouped_gemm_fp8``; ``+ bf16 permute`` is added to the bf16 time
  so both include the permute;
* ``fp8 reference``: the pure-torch reference chain (what runs by default on CUDA), timed once (host loop).

Reports µs, TFLOP/s (``2 * rows * (2I*H + H*I)`` flops) and the output rel-L2 vs the bf16 path on
random activations and on activations with outlier channels (a few channels x50). Targets (issue 17):
decode >= 1.8x, prefill >= 1.6x; the other shapes feed ``providers.triton.fp8.FP8_BLOCK_MAX_ROWS_PER_EXPERT`` (>= 1.0x).
Writes ``$OUT/fp8.json`` / ``fp8.md``.

``--sweep``: per shape, each FP8 GEMM (gate|up + SwiGLU + requant, and down) alone under a list of tile
configs (:class:`~ep_fuse.providers.triton.gemm_tiles.GemmConfig`; SwiGLU tiles are ``BN = 128``, the requant
group) next to the bf16 kernel of the same GEMM and the config ``config_for`` picks today, in µs and TFLOP/s;
the fastest config per (shape, GEMM) is printed and written to ``$OUT/fp8_sweep.json``/``.md``. Stops starting
new configs after ``--budget`` seconds.
``--tma``: the same per-GEMM timing for the persistent TMA FP8 kernel (``fp8:tma``, :func:`tma_configs`: the
shipped config and its ``expert_groups`` twin first and again last, four others between), alone or next to
``--sweep``'s configs.
``--deepgemm``: also the FP8 chain on DeepGEMM (:mod:`ep_fuse.providers.deepgemm`, needs ``deep_gemm``):
``moe_permute_fp8`` with the 128-row aligned layout + DeepGEMM gate|up + Triton SwiGLU/requant + DeepGEMM down,
timed the same way, and its output (summed back per token) against the reference's.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from common import balanced_topk_ids, bench_graph_us, bench_parser, env_info, markdown_table, out_dir, start, write_json

import ep_fuse.providers  # noqa: F401  (registers torch.ops.ep_fuse_triton.*)
from ep_fuse.ops import fp8 as R
from ep_fuse.providers.triton import fp8 as T
from ep_fuse.providers.triton.grouped_gemm import grouped_gemm_kernel, grouped_gemm_swiglu_kernel
from ep_fuse.providers.triton.moe_permute import moe_permute_kernel
from ep_fuse.providers.triton.unverified import ENV, cleared

BF16 = torch.bfloat16
DEVICE = "cuda"
SHAPES = {  # name: (T, H, I, E, K); the T512..T2048 rows (16..64 rows per expert) feed the perf rule
    "decode": (128, 7168, 2048, 256, 8),
    "T512": (512, 7168, 2048, 256, 8),
    "T1024": (1024, 7168, 2048, 256, 8),
    "T2048": (2048, 7168, 2048, 256, 8),
    "prefill": (4096, 7168, 2048, 256, 8),
    "T16384": (16384, 7168, 2048, 256, 8),
}
TARGETS = {"decode": 1.8, "prefill": 1.6}
"""Issue 17's targets; the other shapes must not be slower than bf16 (1.0) for the rule to take them."""
BN, BK = R.BLOCK
BALANCED = False
"""``--balanced`` routing (module docstring)."""
DEEPGEMM = False
"""``--deepgemm``: also time the DeepGEMM chain (module docstring)."""


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
    if BALANCED:
        ids = balanced_topk_ids(t, k, e, DEVICE)
    return x, ids


def bf16_path(x, ids, w, e):
    rows, _src, seg = moe_permute_kernel(x, ids, e)
    return grouped_gemm_kernel(grouped_gemm_swiglu_kernel(rows, w["w13"], seg), w["w2"], seg), seg


def fp8_triton(x, ids, w, e):
    xq, xs, _src, seg = T.moe_permute_fp8_kernel(x, ids, e, BK)
    aq, a_s = T.grouped_gemm_fp8_swiglu_quant_kernel(xq, xs, w["q13"], w["s13"], seg, BN, BK)
    return T.grouped_gemm_fp8_kernel(aq, a_s, w["q2"], w["s2"], seg, BN, BK, BF16)


def fp8_deepgemm(x, ids, w, e):
    from ep_fuse.providers.deepgemm import fp8 as D

    xq, xs, src, seg = T.moe_permute_fp8_kernel(x, ids, e, BK, D.ALIGN)
    aq, a_s = D.grouped_gemm_fp8_swiglu_quant_kernel(xq, xs, w["q13"], w["s13"], seg, BN, BK, D.ALIGN)
    return D.grouped_gemm_fp8_kernel(aq, a_s, w["q2"], w["s2"], seg, BN, BK, BF16, D.ALIGN), src


def per_token(y: torch.Tensor, src2dst: torch.Tensor, k: int) -> torch.Tensor:
    """The permuted rows summed back per token (unweighted): compares layouts that place rows differently."""
    from ep_fuse.ops.moe import moe_unpermute_ref

    return moe_unpermute_ref(y, src2dst, None, k, torch.float32)


def fp8_reference(x, ids, w, e):
    xq, xs, _src, seg = R.moe_permute_fp8_ref(x, ids, e, BK)
    aq, a_s = R.grouped_gemm_fp8_swiglu_quant_ref(xq, xs, w["q13"], w["s13"], seg, BN, BK)
    return R.grouped_gemm_fp8_ref(aq, a_s, w["q2"], w["s2"], seg, BN, BK, BF16)


def run_shape(name: str, shape: tuple[int, ...], w: dict[str, torch.Tensor], reference: bool) -> dict[str, Any]:
    t, h, i, e, k = shape
    flops = 2 * t * k * (2 * i * h + h * i)
    row: dict[str, Any] = {"shape": name + (" balanced" if BALANCED else ""), "T": t, "H": h, "I": i, "E": e, "K": k,
                           "target": TARGETS.get(name, 1.0)}
    with torch.no_grad():
        for label, outliers in (("random", False), ("outliers", True)):
            x, ids = tokens(t, h, e, k, outliers)
            y_bf16, _seg = bf16_path(x, ids, w, e)
            y_ref = fp8_reference(x, ids, w, e)
            row[f"ref_vs_bf16_{label}"] = rel_l2(y_ref, y_bf16)
            row[f"triton_vs_ref_{label}"] = rel_l2(fp8_triton(x, ids, w, e), y_ref)
            row[f"triton_vs_bf16_{label}"] = rel_l2(fp8_triton(x, ids, w, e), y_bf16)
            if DEEPGEMM:
                _q, _s, src_ref, _seg = R.moe_permute_fp8_ref(x, ids, e, BK)
                y_dg, src_dg = fp8_deepgemm(x, ids, w, e)
                row[f"deepgemm_vs_ref_{label}"] = rel_l2(per_token(y_dg, src_dg, k), per_token(y_ref, src_ref, k))
                row[f"deepgemm_vs_bf16_{label}"] = rel_l2(per_token(y_dg, src_dg, k), per_token(y_bf16, src_ref, k))
        x, ids = tokens(t, h, e, k, False)
        row["bf16_us"] = bench_graph_us(lambda: bf16_path(x, ids, w, e))
        row["fp8_triton_us"] = bench_graph_us(lambda: fp8_triton(x, ids, w, e))
        if DEEPGEMM:
            row["fp8_deepgemm_us"] = bench_graph_us(lambda: fp8_deepgemm(x, ids, w, e))
        if reference:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fp8_reference(x, ids, w, e)
            torch.cuda.synchronize()
            row["fp8_reference_us"] = 1e6 * (time.perf_counter() - t0)
    for key in ("bf16", "fp8_triton", "fp8_deepgemm", "fp8_reference"):
        if f"{key}_us" in row:
            row[f"{key}_tflops"] = flops / row[f"{key}_us"] / 1e6
    row["speedup"] = row["bf16_us"] / row["fp8_triton_us"]
    if DEEPGEMM:
        row["speedup_deepgemm"] = row["bf16_us"] / row["fp8_deepgemm_us"]
    codes = torch.empty(t * k, h, dtype=R.FP8, device=DEVICE)  # the permuted rows' shape: what the choice reads
    row["fp8_gemm_kernel"] = T.gemm_variant(codes, w["q13"])  # "tma" only where fp8:tma is enabled
    log(row)
    return row


def sweep_configs(decode: bool, swiglu: bool) -> list[Any]:
    """Candidate tiles: swapped small-M tiles for decode, 64/128-row tiles with deeper pipelines for prefill."""
    from ep_fuse.providers.triton.gemm_tiles import GemmConfig

    bns = (128,) if swiglu else (128, 256)
    out = []
    if decode:
        for bm in (16, 32, 64):
            for bn in bns:
                for warps, stages in ((4, 3), (4, 4), (8, 3)):
                    out.append(GemmConfig(bm, bn, 128, warps, stages, 1, swap_ab=bm < 64))
        return out
    for bm in (64, 128):
        for bn in bns:
            for bk in (64, 128):
                for warps, stages in ((4, 3), (4, 4), (8, 3), (8, 4)):
                    out.append(GemmConfig(bm, bn, bk, warps, stages, 8))
    return out


def tma_configs(m: int, n: int, k: int, e: int, swiglu: bool) -> list[Any]:
    """Candidate tiles of the persistent TMA FP8 kernel (``fp8:tma``): ``BK = 128`` (one scale block per step).
    The shipped config (``fp8_tma_kernel.config_for``) and its expert-groups twin are timed first and again
    last, so the run shows its own noise next to the difference."""
    import dataclasses

    from ep_fuse.providers.triton.fp8_tma_kernel import config_for
    from ep_fuse.providers.triton.grouped_gemm_tma_kernel import TmaGemmConfig as C

    shipped = config_for(m, n, k, e, BK, swiglu=swiglu, interpret=False)
    pair = [shipped, dataclasses.replace(shipped, expert_groups=not shipped.expert_groups)]
    if swiglu:
        others = [C(64, 128, 128, 4, 3, 8, expert_groups=True), C(64, 128, 128, 4, 4, 8, expert_groups=True),
                  C(128, 128, 128, 8, 3, 8, expert_groups=True), C(64, 128, 128, 4, 4, 8, desc="host")]
    else:
        others = [C(64, 256, 128, 8, 3, 8, expert_groups=True), C(64, 256, 128, 8, 4, 8, expert_groups=True),
                  C(128, 256, 128, 8, 3, 8, expert_groups=True), C(64, 256, 128, 8, 4, 8, desc="host")]
    return pair + [c for c in others if c not in pair] + pair


def run_sweep(name: str, shape: tuple[int, ...], w: dict[str, torch.Tensor], deadline: float,
              pointer: bool = True, tma: bool = False) -> list[dict[str, Any]]:
    """Each FP8 GEMM of ``name`` alone under :func:`sweep_configs` (``pointer``) and/or :func:`tma_configs`
    (``tma``), with the bf16 kernel and today's pick of the one-tile-per-program kernel."""
    from ep_fuse.providers.triton.fp8_kernel import config_for, launch_fp8_gemm
    from ep_fuse.providers.triton.fp8_tma_kernel import launch_fp8_gemm_tma
    from ep_fuse.providers.triton.grouped_gemm_kernel import is_decode

    t, h, i, e, k = shape
    x, ids = tokens(t, h, e, k, False)
    xq, xs, _src, seg = T.moe_permute_fp8_kernel(x, ids, e, BK)
    rows, _s, seg16 = moe_permute_kernel(x, ids, e)
    aq, a_s = T.grouped_gemm_fp8_swiglu_quant_kernel(xq, xs, w["q13"], w["s13"], seg, BN, BK)
    act16 = grouped_gemm_swiglu_kernel(rows, w["w13"], seg16)
    m = t * k
    results = []
    for gemm, swiglu in (("gate_up", True), ("down", False)):
        n, kk = (i, h) if swiglu else (h, i)
        flops = 2 * m * kk * (2 * n if swiglu else n)
        if swiglu:
            y, ys = torch.empty(m, n, dtype=R.FP8, device=DEVICE), torch.empty(m, n // BK, device=DEVICE)
            args = (xq, xs, w["q13"], w["s13"], seg, y, ys, BN, BK)
            bf16 = bench_graph_us(lambda: grouped_gemm_swiglu_kernel(rows, w["w13"], seg16))
        else:
            y, ys = torch.empty(m, n, dtype=BF16, device=DEVICE), None
            args = (aq, a_s, w["q2"], w["s2"], seg, y, ys, BN, BK)
            bf16 = bench_graph_us(lambda: grouped_gemm_kernel(act16, w["w2"], seg16))
        today = config_for(m, n, kk, e, BK, swiglu=swiglu, interpret=False)
        row = {"shape": name, "gemm": gemm, "bf16_us": bf16, "today": str(today), "configs": []}
        cands = [(str(today), launch_fp8_gemm, today)]
        cands += [(str(c), launch_fp8_gemm, c) for c in (sweep_configs(is_decode(m, e), swiglu) if pointer else [])]
        cands += [(f"tma [{c}]", launch_fp8_gemm_tma, c) for c in (tma_configs(m, n, kk, e, swiglu) if tma else [])]
        for label, launch, cfg in cands:
            if time.monotonic() > deadline:
                row["stopped"] = "budget"
                break
            try:
                us = bench_graph_us(lambda launch=launch, cfg=cfg: launch(*args, swiglu=swiglu, config=cfg))
            except Exception as exc:  # a config Triton cannot compile (shared memory, registers)
                row["configs"].append({"config": label, "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
                continue
            row["configs"].append({"config": label, "us": us, "tflops": flops / us / 1e6})
        timed = [c for c in row["configs"] if "us" in c]
        if timed:
            best = min(timed, key=lambda c: c["us"])
            row.update(best=best["config"], best_us=best["us"], best_tflops=best["tflops"],
                       today_us=timed[0]["us"], bf16_tflops=flops / bf16 / 1e6)
        log(f"{name} {gemm}: bf16 {bf16:.1f} us; today {row['today']} {row.get('today_us', float('nan')):.1f} us; "
            f"best {row.get('best')} {row.get('best_us', float('nan')):.1f} us")
        results.append(row)
    return results


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--only", default=",".join(SHAPES))
    ap.add_argument("--no-reference", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="time tile configs per GEMM (see the module docstring)")
    ap.add_argument("--tma", action="store_true", help="time the persistent TMA FP8 kernel's configs per GEMM")
    ap.add_argument("--budget", type=float, default=150.0, help="seconds of sweeping before no new config starts")
    ap.add_argument("--balanced", action="store_true", help="every expert gets T*K/E rows (no ragged groups)")
    ap.add_argument("--deepgemm", action="store_true", help="also the FP8 chain on DeepGEMM (needs deep_gemm)")
    args = ap.parse_args()
    start(args)
    global BALANCED, DEEPGEMM
    BALANCED, DEEPGEMM = args.balanced, args.deepgemm
    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8.py needs a CUDA GPU (sm90+)")
    if not cleared("fp8:triton"):
        raise SystemExit(f"set {ENV}=1: the Triton FP8 kernels are not yet verified on a GPU")
    info = env_info()
    log(info)
    w = make_weights(7168, 2048, 256)
    if args.sweep or args.tma:
        deadline = time.monotonic() + args.budget
        sweep = [r for name in args.only.split(",")
                 for r in run_sweep(name, SHAPES[name], w, deadline, pointer=args.sweep, tma=args.tma)]
        write_json("fp8_sweep.json", {"env": info, "rows": sweep})
        (out_dir() / "fp8_sweep.md").write_text(markdown_table(
            ["shape", "GEMM", "bf16 µs", "today's config", "today µs", "best config", "best µs", "best TFLOP/s",
             "bf16 TFLOP/s"],
            [[r["shape"], r["gemm"], r["bf16_us"], r["today"], r.get("today_us"), r.get("best"), r.get("best_us"),
              r.get("best_tflops"), r.get("bf16_tflops")] for r in sweep]) + "\n")
    rows = [run_shape(name, SHAPES[name], w, not args.no_reference) for name in args.only.split(",")]
    write_json("fp8.json", {"env": info, "rows": rows})
    table = markdown_table(
        ["shape", "bf16 µs", "FP8 Triton µs", "speedup", "target", "FP8 ref µs", "bf16 TFLOP/s", "FP8 TFLOP/s",
         "rel L2 vs bf16 (random / outliers)"],
        [[r["shape"], r["bf16_us"], r["fp8_triton_us"], f"{r['speedup']:.2f}x", f"{r['target']}x",
          r.get("fp8_reference_us"), r["bf16_tflops"], r["fp8_triton_tflops"],
          f"{r['triton_vs_bf16_random']:.4f} / {r['triton_vs_bf16_outliers']:.4f}"] for r in rows])
    if DEEPGEMM:
        table += "\n\n" + markdown_table(
            ["shape", "bf16 µs", "FP8 Triton µs", "FP8 DeepGEMM µs", "DeepGEMM speedup", "target",
             "DeepGEMM TFLOP/s",
             "rel L2 vs reference (random / outliers)", "rel L2 vs bf16 (random / outliers)"],
            [[r["shape"], r["bf16_us"], r["fp8_triton_us"], r["fp8_deepgemm_us"], f"{r['speedup_deepgemm']:.2f}x",
              f"{r['target']}x", r["fp8_deepgemm_tflops"],
              f"{r['deepgemm_vs_ref_random']:.4f} / {r['deepgemm_vs_ref_outliers']:.4f}",
              f"{r['deepgemm_vs_bf16_random']:.4f} / {r['deepgemm_vs_bf16_outliers']:.4f}"] for r in rows])
    (out_dir() / "fp8.md").write_text(table + "\n")
    log(table)


if __name__ == "__main__":
    main()

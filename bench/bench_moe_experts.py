"""GPU check + benchmark of the routed-expert GEMMs: torch._grouped_mm (eager, Inductor) vs ep_fuse Triton.

    python bench/bench_moe_experts.py [--no-sweep] [--only decode,prefill,prefill_e64] [--shape NAME=T,H,I,E,K ...]

For each shape: tokens routed by top-k of random logits, rows permuted expert-major with the
reference permute, then ``silu(x @ w13[e, :I].T) * (x @ w13[e, I:].T) @ w2[e].T`` per expert.
Variants: (a) ``torch._grouped_mm`` x2 + eager SwiGLU, (b) the same under Inductor, (c) ep_fuse's
``grouped_gemm_swiglu`` + ``grouped_gemm`` launched directly (the variant the provider picks), (d) the
ep_fuse_triton ops under Inductor (the kernels traced through ``wrap_triton``), (e) the Hopper TMA kernels
forced at any size (``ep_fuse_tma``, where TMA takes the operands). Correctness first: relative L2 against an fp32
per-expert loop. GPU time from CUDA-graph replays; decode also reports the share of copy bandwidth
that streaming the active experts' weights once would take. Then sweeps tile configs per kernel (until
``$SWEEP_BUDGET_S`` seconds, default 200, have passed).
Writes ``$OUT/moe_experts.json`` / ``moe_experts.md``.
"""

from __future__ import annotations

import importlib
import os
import time
from typing import Any

import torch

from common import (
    balanced_topk_ids,
    bench_graph_us,
    copy_bandwidth_gbs,
    env_info,
    markdown_table,
    out_dir,
    bench_parser,
    start,
    write_json,
)

import ep_fuse.providers  # noqa: F401  (registers torch.ops.ep_fuse_triton.*)
from ep_fuse.ops.moe import moe_permute_ref
from ep_fuse.providers.triton.grouped_gemm import grouped_gemm_kernel, grouped_gemm_swiglu_kernel

gg = importlib.import_module("ep_fuse.providers.triton.grouped_gemm")  # module paths: the package attributes
gk = importlib.import_module("ep_fuse.providers.triton.grouped_gemm_kernel")  # of these names are functions
tk = importlib.import_module("ep_fuse.providers.triton.grouped_gemm_tma_kernel")
BF16 = torch.bfloat16
DEVICE = "cuda"
SHAPES = {  # name: (tokens T, hidden H, intermediate I, experts E, top-k K)
    "decode": (128, 7168, 2048, 256, 8),
    "prefill": (4096, 7168, 2048, 256, 8),
    "prefill_e64": (16384, 2048, 1408, 64, 6),
}
SWEEP_BUDGET_S = float(os.environ.get("SWEEP_BUDGET_S", "200"))
"""Stop sweeping once the whole run has taken this long (``SWEEP_BUDGET_S``; the default keeps a run under 4 minutes)."""


def log(*a: Any) -> None:
    print(*a, flush=True)


def sweep_configs(decode: bool, swiglu: bool) -> list[Any]:
    from ep_fuse.providers.triton.grouped_gemm_kernel import GemmConfig as C

    if decode:
        return [C(16, 64, 128, 4, 4, 1, True), C(16, 32, 256, 4, 4, 1, True), C(16, 128, 128, 4, 4, 1, True),
                C(16, 64, 256, 4, 3, 1, True), C(16, 64, 128, 4, 4, 1, False), C(16, 128, 64, 4, 6, 1, True),
                C(16, 64, 128, 4, 6, 1, True), C(16, 64, 256, 4, 4, 1, True), C(16, 128, 128, 8, 4, 1, True),
                C(16, 128, 256, 8, 3, 1, True), C(16, 32, 128, 2, 6, 1, True), C(16, 64, 64, 4, 8, 1, True),
                C(32, 64, 128, 4, 4, 1, True), C(32, 128, 128, 4, 4, 1, True), C(16, 256, 64, 8, 4, 1, True),
                C(16, 64, 128, 2, 5, 1, True), C(64, 64, 128, 4, 4, 1, True), C(64, 128, 64, 8, 4, 1, True)]
    if swiglu:
        return [C(128, 128, 64, 8, 3, 8), C(128, 128, 64, 8, 4, 8), C(64, 128, 64, 4, 4, 8), C(64, 256, 64, 8, 3, 8),
                C(128, 64, 64, 4, 4, 8), C(128, 128, 64, 8, 3, 1), C(32, 128, 64, 4, 4, 8), C(64, 64, 128, 4, 4, 8),
                C(32, 64, 128, 4, 4, 1, True)]
    return [C(128, 256, 64, 8, 3, 8), C(128, 256, 64, 8, 4, 8), C(128, 128, 64, 8, 4, 8), C(64, 256, 64, 8, 3, 8),
            C(64, 128, 64, 4, 4, 8), C(128, 256, 64, 8, 3, 1), C(32, 128, 64, 4, 4, 8), C(64, 256, 64, 8, 4, 8)]


def make_weights(h: int, i: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=DEVICE).manual_seed(1)
    w13 = torch.randn(e, 2 * i, h, device=DEVICE, dtype=BF16, generator=g).mul_(h**-0.5)
    w2 = torch.randn(e, h, i, device=DEVICE, dtype=BF16, generator=g).mul_(i**-0.5)
    return w13, w2


def routed_rows(t: int, h: int, e: int, k: int, balanced: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Permuted rows and ``seg_indptr`` of ``t`` tokens routed by top-k of random logits (``balanced``:
    :func:`common.balanced_topk_ids`)."""
    g = torch.Generator(device=DEVICE).manual_seed(t)
    x = torch.randn(t, h, device=DEVICE, dtype=BF16, generator=g)
    ids = torch.randn(t, e, device=DEVICE, generator=g).topk(k, dim=-1).indices
    if balanced:
        ids = balanced_topk_ids(t, k, e, DEVICE)
    rows, _src2dst, seg = moe_permute_ref(x, ids, e)
    return rows, seg


def eager_experts(rows, w13, w2, seg):
    offs = seg[1:].to(torch.int32)
    gate, up = torch._grouped_mm(rows, w13.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    return torch._grouped_mm(torch.nn.functional.silu(gate) * up, w2.transpose(-2, -1), offs=offs)


def ep_fuse_experts(rows, w13, w2, seg):
    return grouped_gemm_kernel(grouped_gemm_swiglu_kernel(rows, w13, seg), w2, seg)


def ep_fuse_tma(rows, w13, w2, seg):
    act = torch.empty(rows.shape[0], w13.shape[1] // 2, device=rows.device, dtype=rows.dtype)
    tk.launch_grouped_gemm_swiglu_tma(rows, w13, seg, act)
    y = torch.empty(rows.shape[0], w2.shape[1], device=rows.device, dtype=rows.dtype)
    tk.launch_grouped_gemm_tma(act, w2, seg, y)
    return y


def ep_fuse_ops(rows, w13, w2, seg):
    ops = torch.ops.ep_fuse_triton
    return ops.grouped_gemm(ops.grouped_gemm_swiglu(rows, w13, seg), w2, seg)


def reference(rows, w13, w2, seg) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 per-expert loop: ``(act [M, I], y [M, H])``."""
    bounds = seg.tolist()
    i = w13.shape[1] // 2
    act = torch.zeros(rows.shape[0], i, device=DEVICE)
    y = torch.zeros(rows.shape[0], w2.shape[1], device=DEVICE)
    for e in range(w13.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            gu = rows[lo:hi].float() @ w13[e].float().T
            act[lo:hi] = torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]
            y[lo:hi] = act[lo:hi] @ w2[e].float().T
    return act, y


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    err = ((out.float() - ref).norm() / ref.norm()).item()
    if not err < 1e-2 or torch.isnan(out).any():
        raise AssertionError(f"relative L2 error {err}")
    return err


def sweep(rows, w13, w2, seg, act_ref, y_ref, t0: float) -> dict[str, list[dict[str, Any]]]:
    m, h = rows.shape
    e, i = w13.shape[0], w13.shape[1] // 2
    decode = gk.is_decode(m, e)
    act = torch.empty(m, i, device=DEVICE, dtype=BF16)
    y = torch.empty(m, h, device=DEVICE, dtype=BF16)
    gk.launch_grouped_gemm_swiglu(rows, w13, seg, act)
    res: dict[str, list[dict[str, Any]]] = {"swiglu": [], "gemm": []}
    jobs = (("swiglu", gk.config_for(m, i, h, e, swiglu=True), gk.launch_grouped_gemm_swiglu, rows, w13, act, act_ref),
            ("gemm", gk.config_for(m, h, i, e), gk.launch_grouped_gemm, act, w2, y, y_ref))
    for name, default, launch, a, w, out, ref in jobs:
        cfgs = [default] + [c for c in sweep_configs(decode, name == "swiglu") if c != default]
        for cfg in cfgs:
            if time.time() - t0 > SWEEP_BUDGET_S:
                res[name].append({"cfg": str(cfg), "error": "skipped: time budget"})
                continue
            try:
                out.fill_(float("nan"))
                launch(a, w, seg, out, config=cfg)
                rel_l2(out, ref)
                us = bench_graph_us(lambda: launch(a, w, seg, out, config=cfg))  # noqa: B023
                res[name].append({"cfg": str(cfg), "us": us, "default": cfg == default})
            except Exception as exc:
                res[name].append({"cfg": str(cfg), "error": f"{type(exc).__name__}: {str(exc)[:160]}"})
            log(f"    {name}: {res[name][-1]}")
    return res


def run_shape(name: str, shape: tuple[int, ...], weights: tuple[torch.Tensor, torch.Tensor], copy_gbs: float,
              do_sweep: bool, t0: float) -> dict[str, Any]:
    t, h, i, e, k = shape
    w13, w2 = weights
    rows, seg = routed_rows(t, h, e, k)
    m = rows.shape[0]
    counts = seg.diff()
    active = int((counts > 0).sum())
    flops = 2 * m * (2 * i * h + h * i)
    weight_bytes = active * 3 * i * h * w13.element_size()
    row: dict[str, Any] = {"shape": name, "T": t, "H": h, "I": i, "E": e, "K": k, "rows": m, "active_experts": active,
                           "max_rows_per_expert": int(counts.max())}
    act_ref, y_ref = reference(rows, w13, w2, seg)
    with torch.no_grad():
        row["err_ep_fuse_act"] = rel_l2(grouped_gemm_swiglu_kernel(rows, w13, seg), act_ref)
        torch._dynamo.reset()
        variants = {"eager": eager_experts, "inductor": torch.compile(eager_experts, dynamic=False),
                    "ep_fuse": ep_fuse_experts, "ep_fuse_inductor": torch.compile(ep_fuse_ops, dynamic=False),
                    "ep_fuse_tma": ep_fuse_tma}
        for label, fn in variants.items():
            try:
                row[f"err_{label}"] = rel_l2(fn(rows, w13, w2, seg), y_ref)
                row[label] = bench_graph_us(lambda: fn(rows, w13, w2, seg))  # noqa: B023
                row[f"{label}_tflops"] = flops / (row[label] * 1e-6) / 1e12
                row[f"{label}_weight_bw_pct"] = 100 * weight_bytes / (row[label] * 1e-6) / 1e9 / copy_gbs
            except Exception as exc:
                row[label] = None
                row[f"error_{label}"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                log(f"  {label} failed: {row[f'error_{label}']}")
        if do_sweep:
            row["sweep"] = sweep(rows, w13, w2, seg, act_ref, y_ref, t0)
            for kern in ("swiglu", "gemm"):
                ok = [s for s in row["sweep"][kern] if "us" in s]
                if ok:
                    best = min(ok, key=lambda s: s["us"])
                    row[f"best_{kern}_cfg"], row[f"best_{kern}_us"] = best["cfg"], best["us"]
            if "best_swiglu_us" in row and "best_gemm_us" in row:
                row["best_us"] = row["best_swiglu_us"] + row["best_gemm_us"]
                row["best_tflops"] = flops / (row["best_us"] * 1e-6) / 1e12
                row["best_weight_bw_pct"] = 100 * weight_bytes / (row["best_us"] * 1e-6) / 1e9 / copy_gbs
    row["kernel_variant"] = gg.kernel_variant(rows, w13, swiglu=True)
    row["config_swiglu"] = str(gk.config_for(m, i, h, e, swiglu=True))
    if row.get("ep_fuse") and row.get("inductor"):
        row["speedup_vs_inductor"] = row["inductor"] / row["ep_fuse"]
    if row.get("ep_fuse_tma") and row.get("inductor"):
        row["tma_vs_inductor"] = row["inductor"] / row["ep_fuse_tma"]
    summary = " ".join(f"{v} {row[v]:.1f}us ({row[v + '_tflops']:.0f} TF/s, {row[v + '_weight_bw_pct']:.0f}% wBW)"
                       for v in variants if row.get(v))
    log(f"{name} T{t} H{h} I{i} E{e} K{k}: {summary}")
    if "best_us" in row:
        log(f"  best swept: swiglu {row['best_swiglu_cfg']} {row['best_swiglu_us']:.1f}us + gemm "
            f"{row['best_gemm_cfg']} {row['best_gemm_us']:.1f}us = {row['best_tflops']:.0f} TF/s")
    return row


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--only", default=None, help="names from SHAPES (default: all, unless --shape is given)")
    ap.add_argument("--shape", action="append", default=[], help="NAME=T,H,I,E,K: an extra shape (repeatable)")
    ap.add_argument("--masked", action="store_true", help="the DeepEP low-latency receive layout's local experts: "
                    "masked vs permute over padding vs one GPU (bench/bench_moe_masked.py; tiny and on CPU without CUDA)")
    opts = ap.parse_args()
    if opts.masked:
        return run_masked(opts.json)
    start(opts)
    for spec in opts.shape:
        name, dims = spec.split("=")
        SHAPES[name] = tuple(int(v) for v in dims.split(","))
    names = opts.only.split(",") if opts.only else [s.split("=")[0] for s in opts.shape] or list(SHAPES)
    t0 = time.time()
    res: dict[str, Any] = {"env": env_info(), "rows": []}
    res["env"]["copy_bandwidth_gbs"] = copy_gbs = copy_bandwidth_gbs()
    log(res["env"])
    weights: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    for name in names:
        _t, h, i, e, _k = SHAPES[name]
        if (h, i, e) not in weights:
            weights.clear()
            torch.cuda.empty_cache()
            weights[(h, i, e)] = make_weights(h, i, e)
        res["rows"].append(run_shape(name, SHAPES[name], weights[(h, i, e)], copy_gbs, not opts.no_sweep, t0))
        write_json("moe_experts.json", res)
    head = ["shape", "T", "E", "rows/expert", "eager µs", "Inductor µs", "ep_fuse µs (variant)", "ep_fuse+Ind µs",
            "ep_fuse TF/s", "ep_fuse wBW %", "vs Inductor", "TMA µs", "TMA vs Inductor", "best swept µs",
            "best TF/s"]
    table = markdown_table(head, [[r["shape"], r["T"], r["E"], f"{r['rows'] / r['E']:.1f}", r.get("eager"),
                                   r.get("inductor"), f"{r.get('ep_fuse') or 0:.1f} ({r.get('kernel_variant')})",
                                   r.get("ep_fuse_inductor"), r.get("ep_fuse_tflops"), r.get("ep_fuse_weight_bw_pct"),
                                   f"{r['speedup_vs_inductor']:.2f}×" if "speedup_vs_inductor" in r else None,
                                   r.get("ep_fuse_tma"),
                                   f"{r['tma_vs_inductor']:.2f}×" if "tma_vs_inductor" in r else None,
                                   r.get("best_us"), r.get("best_tflops")] for r in res["rows"]])
    (out_dir() / "moe_experts.md").write_text(table + "\n")
    log(table)
    log(f"total {time.time() - t0:.0f}s")


def run_masked(json_path: str | None) -> None:
    """``--masked``: ``bench_moe_masked.py`` (at its real shapes on CUDA, at its tiny shape on a CPU)."""
    import bench_moe_masked

    bench_moe_masked.main(["--json", json_path] if json_path else [])


if __name__ == "__main__":
    main()

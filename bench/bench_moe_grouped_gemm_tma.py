"""Hopper TMA grouped GEMM vs the existing kernel, ``torch._grouped_mm`` and a dense cuBLAS ceiling (one run).

    python bench/bench_moe_grouped_gemm_tma.py [--only deepseek_v3_T4096,...] [--shape NAME=T,H,I,E,K ...] [--budget 300]
        [--balanced]

For each shape: tokens routed by top-k of random logits, rows permuted expert-major, then per GEMM
(gate|up + SwiGLU, and down on the SwiGLU output): (a) the existing Triton kernel at its default config,
(b) the TMA kernel at its default config, (c) ``torch._grouped_mm`` (the GEMM alone; for gate|up also with
the eager SwiGLU), (d) one dense cuBLAS matmul of the same FLOPs (``[rows, K] @ [K, N]``: the practical
ceiling). TF/s counts real rows only (2 * rows * N * K); "weights TB/s" is the experts' weight bytes over the
time (each expert's weights must be read at least once). ``--balanced`` routes every expert exactly
``T * K / E`` rows (no ragged tiles) instead of top-k of random logits. Correctness first (relative L2 against
an fp32 per-expert loop, < 1e-2, outputs NaN-poisoned). GPU time from CUDA-graph replays (``bench/common.py``).
Then, within ``--budget`` seconds, a sweep of TMA configs (tiles, stages, warps, GROUP_M, persistent grid,
descriptor mode, ``warp_specialize``), and the decode configuration (DeepSeek-V3 T128) re-timed through the
provider's host functions. Sets ``EP_FUSE_UNVERIFIED_KERNELS=1`` (the TMA kernel is launched directly).
Writes ``$OUT/grouped_gemm_tma.json`` / ``grouped_gemm_tma.md``.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import time
from typing import Any

import torch

os.environ.setdefault("EP_FUSE_UNVERIFIED_KERNELS", "1")
from bench_moe_experts import make_weights, routed_rows
from common import (  # noqa: E402
    bench_graph_us, bench_parser, env_info, markdown_table, out_dir, start, tma_config_fields, write_json)

import ep_fuse.providers  # noqa: F401  (registers torch.ops.ep_fuse_triton.*)
from ep_fuse.providers.triton.grouped_gemm import grouped_gemm_kernel, grouped_gemm_swiglu_kernel

gk = importlib.import_module("ep_fuse.providers.triton.grouped_gemm_kernel")
tk = importlib.import_module("ep_fuse.providers.triton.grouped_gemm_tma_kernel")
BF16 = torch.bfloat16
SHAPES = {  # name: (tokens T, hidden H, intermediate I, experts E, top-k K); ordered to build each weight set once
    "qwen3_30b_a3b_T4096": (4096, 2048, 768, 128, 8),
    "mixtral_8x7b_T2048": (2048, 4096, 14336, 8, 2),
    "mixtral_8x7b_T8192": (8192, 4096, 14336, 8, 2),
    "deepseek_v3_T4096": (4096, 7168, 2048, 256, 8),
    "deepseek_v3_T16384": (16384, 7168, 2048, 256, 8),
}
DECODE = ("deepseek_v3_T128", (128, 7168, 2048, 256, 8))
DECODE_DOCS_US = 4978.0
"""Both decode GEMMs at T128 in docs/benchmarks.md (2026-11-29), for the regression check (<= 2 %)."""
TARGETS = {"deepseek_v3_T4096": 450.0, "qwen3_30b_a3b_T4096": 500.0}
"""Issue 16's gate|up + SwiGLU targets in TF/s; the large-group shapes target >= 1.0x ``_grouped_mm``."""


def log(*a: Any) -> None:
    print(*a, flush=True)


EXTRA_CONFIGS: dict[str, list[Any]] = {"gate_up_swiglu": [], "down": []}
"""``--config`` tile configs timed for every shape next to the default (with or without the sweep)."""


def parse_config(spec: str) -> tuple[str, Any]:
    """``gate_up_swiglu:BM,BN,BK,warps,stages[,GROUP_M][,field=value...]`` (or ``down:...``) -> (GEMM, config);
    ``field=value`` sets any other ``TmaGemmConfig`` field (``expert_groups=1``, ``small_bm=32``, ``desc=host``)."""
    kernel, dims = spec.split(":")
    assert kernel in EXTRA_CONFIGS, f"--config {spec}: GEMM is one of {list(EXTRA_CONFIGS)}"
    parts = dims.split(",")
    kw = tma_config_fields([p for p in parts if "=" in p])
    return kernel, tk.TmaGemmConfig(*(int(v) for v in parts if "=" not in v), **kw)


def sweep_configs(swiglu: bool) -> list[Any]:
    c = tk.TmaGemmConfig
    if swiglu:
        base = [c(128, 128, 64, 8, 4, 8), c(128, 128, 64, 8, 3, 8), c(64, 128, 64, 4, 4, 8), c(128, 64, 64, 4, 4, 8),
                c(128, 128, 64, 8, 4, 16), c(128, 128, 64, 8, 4, 1), c(64, 256, 64, 8, 3, 8), c(128, 128, 32, 8, 6, 8)]
        top = c(128, 128, 64, 8, 4, 8)
    else:
        base = [c(128, 256, 64, 8, 3, 8), c(128, 256, 64, 8, 4, 8), c(128, 128, 64, 8, 4, 8), c(128, 128, 64, 4, 4, 8),
                c(64, 256, 64, 8, 3, 8), c(256, 128, 64, 8, 3, 8), c(128, 256, 64, 8, 3, 16), c(128, 256, 32, 8, 5, 8)]
        top = c(128, 256, 64, 8, 3, 8)
    variants = [dataclasses.replace(top, desc="host"), dataclasses.replace(top, desc="pointer"),
                dataclasses.replace(top, warp_specialize=True), dataclasses.replace(top, programs=-2)]
    return base + variants


def resolve(cfg: Any) -> Any:
    """``programs=-n``: n programs per SM."""
    if cfg.programs < 0:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        return dataclasses.replace(cfg, programs=-cfg.programs * sms)
    return cfg


def loop_ref(x: torch.Tensor, w: torch.Tensor, seg: torch.Tensor, swiglu: bool) -> torch.Tensor:
    n = w.shape[1] // 2 if swiglu else w.shape[1]
    out = torch.zeros(x.shape[0], n, device="cuda")
    b = seg.tolist()
    for e in range(w.shape[0]):
        if b[e + 1] > b[e]:
            h = x[b[e]:b[e + 1]].float() @ w[e].float().T
            out[b[e]:b[e + 1]] = torch.nn.functional.silu(h[:, :n]) * h[:, n:] if swiglu else h
    return out


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    err = ((out.float() - ref).norm() / ref.norm()).item()
    if not err < 1e-2 or torch.isnan(out).any():
        raise AssertionError(f"relative L2 error {err}")
    return err


def timed(label: str, fn: Any, flops: float, out: torch.Tensor | None = None, ref: torch.Tensor | None = None,
          **extra: Any) -> dict[str, Any]:
    """Check (when ``ref`` is given) then time ``fn`` from graph replays; errors are recorded, not raised."""
    row: dict[str, Any] = {"variant": label, **extra}
    try:
        if out is not None:
            out.fill_(float("nan"))
        res = fn()
        torch.cuda.synchronize()
        if ref is not None:
            row["rel_err"] = rel_l2(res if out is None else out, ref)
        row["us"] = bench_graph_us(fn)
        row["tflops"] = flops / (row["us"] * 1e-6) / 1e12
    except Exception as exc:  # a config that does not compile or is wrong is a result too
        row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    log(f"    {label}: " + (f"{row['us']:.1f} us {row['tflops']:.0f} TF/s" if "us" in row else row["error"]))
    return row


def gemm_rows(kernel: str, a: torch.Tensor, w: torch.Tensor, seg: torch.Tensor, ref: torch.Tensor, e: int,
              sweep_until: float | None) -> list[dict[str, Any]]:
    swiglu = kernel == "gate_up_swiglu"
    m, k = a.shape
    n_out = w.shape[1] // 2 if swiglu else w.shape[1]
    flops = 2.0 * m * w.shape[1] * k
    out = torch.empty(m, n_out, device="cuda", dtype=a.dtype)
    offs = seg[1:].to(torch.int32)
    wt = w.transpose(-2, -1)
    dense_b = w[0].t()
    g_launch = gk.launch_grouped_gemm_swiglu if swiglu else gk.launch_grouped_gemm
    t_launch = tk.launch_grouped_gemm_swiglu_tma if swiglu else tk.launch_grouped_gemm_tma
    g_cfg = gk.config_for(m, n_out, k, e, swiglu=swiglu)
    t_cfg = tk.config_for(m, n_out, k, e, swiglu=swiglu)
    rows = [
        timed("cublas_dense", lambda: torch.mm(a, dense_b), flops),
        timed("grouped_mm", lambda: torch._grouped_mm(a, wt, offs=offs), flops),
        timed(f"triton_default [{g_cfg}]", lambda: g_launch(a, w, seg, out, config=g_cfg), flops, out, ref),
        timed(f"tma_default [{t_cfg}]", lambda: t_launch(a, w, seg, out, config=t_cfg), flops, out, ref),
    ]
    if swiglu:
        def mm_swiglu() -> torch.Tensor:
            gate, up = torch._grouped_mm(a, wt, offs=offs).chunk(2, dim=-1)
            return torch.nn.functional.silu(gate) * up

        rows.insert(2, timed("grouped_mm+swiglu", mm_swiglu, flops, None, ref))
    for cfg in EXTRA_CONFIGS[kernel]:
        rows.append(timed(f"tma [{cfg}]", lambda c=resolve(cfg): t_launch(a, w, seg, out, config=c), flops, out, ref))
    if sweep_until is not None:
        for cfg in sweep_configs(swiglu):
            cfg = resolve(cfg)
            if cfg == t_cfg:
                continue
            if time.time() > sweep_until:
                rows.append({"variant": f"tma [{cfg}]", "error": "skipped: time budget"})
                continue
            rows.append(timed(f"tma [{cfg}]", lambda c=cfg: t_launch(a, w, seg, out, config=c), flops, out, ref))
    dense = rows[0].get("tflops")
    mm = next((r.get("us") for r in rows if r["variant"] == "grouped_mm"), None)
    for r in rows:
        r["kernel"] = kernel
        if dense and "tflops" in r:
            r["pct_cublas"] = 100 * r["tflops"] / dense
        if mm and "us" in r:
            r["vs_grouped_mm"] = mm / r["us"]
        if "us" in r and r["variant"] != "cublas_dense":
            r["weights_tbps"] = w.numel() * w.element_size() / (r["us"] * 1e-6) / 1e12
    return rows


def run_shape(name: str, shape: tuple[int, ...], weights: tuple[torch.Tensor, torch.Tensor],
              sweep_until: float | None, balanced: bool = False) -> dict[str, Any]:
    t, h, i, e, k = shape
    w13, w2 = weights
    rows, seg = routed_rows(t, h, e, k, balanced)
    counts = seg.diff()
    info: dict[str, Any] = {"shape": name + (" balanced" if balanced else ""), "T": t, "H": h, "I": i, "E": e,
                            "K": k, "rows": rows.shape[0], "rows_per_expert_max": int(counts.max()),
                            "rows_per_expert_mean": rows.shape[0] / e}
    log(f"{name}: {info}")
    act_ref = loop_ref(rows, w13, seg, True)
    act = torch.empty(rows.shape[0], i, device="cuda", dtype=BF16)
    gk.launch_grouped_gemm_swiglu(rows, w13, seg, act)
    y_ref = loop_ref(act, w2, seg, False)
    info["results"] = (gemm_rows("gate_up_swiglu", rows, w13, seg, act_ref, e, sweep_until)
                       + gemm_rows("down", act, w2, seg, y_ref, e, sweep_until))
    return info


def decode_retime(weights: dict[Any, Any]) -> dict[str, Any]:
    """Both decode GEMMs through the provider's host functions (they keep the existing kernel at 4 rows/expert)."""
    from ep_fuse.providers.triton.grouped_gemm import kernel_variant

    name, (t, h, i, e, k) = DECODE
    w13, w2 = weights[(h, i, e)]
    rows, seg = routed_rows(t, h, e, k)
    act_ref = loop_ref(rows, w13, seg, True)

    def both() -> torch.Tensor:
        return grouped_gemm_kernel(grouped_gemm_swiglu_kernel(rows, w13, seg), w2, seg)

    row = timed("provider swiglu+down", both, 2.0 * rows.shape[0] * 3 * i * h)
    row.update(shape=name, variant_chosen=kernel_variant(rows, w13), docs_us=DECODE_DOCS_US,
               act_rel_err=rel_l2(grouped_gemm_swiglu_kernel(rows, w13, seg), act_ref))
    if "us" in row:
        row["vs_docs"] = DECODE_DOCS_US / row["us"]
    return row


def tables(res: dict[str, Any]) -> str:
    head = ["shape", "GEMM", "variant", "µs", "TF/s", "% cuBLAS", "vs _grouped_mm", "weights TB/s", "rel err"]
    body = []
    for s in res["shapes"]:
        for r in s["results"]:
            body.append([s["shape"], r["kernel"], r["variant"], r.get("us"), r.get("tflops"), r.get("pct_cublas"),
                         f"{r['vs_grouped_mm']:.2f}×" if "vs_grouped_mm" in r else None, r.get("weights_tbps"),
                         f"{r['rel_err']:.1e}" if "rel_err" in r else r.get("error")])
    out = markdown_table(head, body)
    best = []
    for s in res["shapes"]:
        for kern in ("gate_up_swiglu", "down"):
            ok = [r for r in s["results"] if r["kernel"] == kern and r["variant"].startswith("tma") and "us" in r]
            if ok:
                b = min(ok, key=lambda r: r["us"])
                target = TARGETS.get(s["shape"]) if kern == "gate_up_swiglu" else None
                best.append([s["shape"], kern, b["variant"], b["tflops"], b.get("pct_cublas"),
                             f"{b['vs_grouped_mm']:.2f}×" if "vs_grouped_mm" in b else None, target])
    out += "\n\nBest TMA config per shape and GEMM:\n\n" + markdown_table(
        ["shape", "GEMM", "config", "TF/s", "% cuBLAS", "vs _grouped_mm", "target TF/s"], best)
    d = res.get("decode")
    if d:
        out += (f"\n\nDecode ({d['shape']}, both GEMMs through the provider, "
                f"kernel chosen: {d.get('variant_chosen')}): "
                f"{d.get('us', float('nan')):.1f} µs vs {d['docs_us']:.0f} µs in docs/benchmarks.md")
    return out


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--only", default=None, help="names from SHAPES (default: all, unless --shape is given)")
    ap.add_argument("--shape", action="append", default=[], help="NAME=T,H,I,E,K: an extra shape (repeatable)")
    ap.add_argument("--budget", type=float, default=200.0, help="stop starting sweep configs after this many seconds")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--balanced", action="store_true", help="every expert gets T*K/E rows (no ragged groups)")
    ap.add_argument("--config", action="append", default=[],
                    help="GEMM:BM,BN,BK,warps,stages[,GROUP_M][,small_bm=N]: a TMA config timed next to the default (repeatable)")
    ap.add_argument("--no-decode", action="store_true", help="skip the decode re-time")
    opts = ap.parse_args()
    start(opts)
    for spec in opts.config:
        kernel, cfg = parse_config(spec)
        EXTRA_CONFIGS[kernel].append(cfg)
    for spec in opts.shape:
        name, dims = spec.split("=")
        SHAPES[name] = tuple(int(v) for v in dims.split(","))
    t0 = time.time()
    res: dict[str, Any] = {"env": env_info(), "shapes": []}
    log(res["env"])
    weights: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    names = opts.only.split(",") if opts.only else [s.split("=")[0] for s in opts.shape] or list(SHAPES)
    for name in names:
        _t, h, i, e, _k = SHAPES[name]
        if (h, i, e) not in weights:
            weights.clear()
            torch.cuda.empty_cache()
            weights[(h, i, e)] = make_weights(h, i, e)
        # the sweep budget is shared out over the shapes still to run
        left = max(0.0, opts.budget - (time.time() - t0)) / (len(names) - names.index(name))
        until = None if opts.no_sweep else time.time() + left
        res["shapes"].append(run_shape(name, SHAPES[name], weights[(h, i, e)], until, opts.balanced))
        write_json("grouped_gemm_tma.json", res)
    if not opts.no_decode:
        _n, (_t, h, i, e, _k) = DECODE
        if (h, i, e) not in weights:
            weights.clear()
            torch.cuda.empty_cache()
            weights[(h, i, e)] = make_weights(h, i, e)
        res["decode"] = decode_retime(weights)
        write_json("grouped_gemm_tma.json", res)
    md = tables(res)
    (out_dir() / "grouped_gemm_tma.md").write_text(md + "\n")
    log(md)
    log(f"total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()

"""GPU benchmark of dense GEMM + SwiGLU (``gemm_swiglu``) at decode and at prefill sizes, in one script.

    python bench/bench_gemm_swiglu.py [--part decode,prefill] [--json PATH]
        decode:  [--tokens 16,64] [--shapes 4096x11008,7168x2048] [--no-sweep]
        prefill: [--only llama7b,deepseek_v3_dense,deepseek_v3_shared] [--rows 1024,2048,4096,8192] [--budget 120]

**decode** (``--part decode``): eager vs Inductor (cuBLAS GEMMs + a fused SwiGLU kernel) vs ep_fuse with
``perf_guard=False`` (the one-tile-per-program Triton kernel with SwiGLU in the epilogue) vs Liger (cuBLAS GEMMs +
``LigerSiLUMulFunction``, when liger-kernel is installed), ``silu(x @ Wg.T) * (x @ Wu.T)`` in bf16. Shapes: the
dense MLP of 7B-class models (H=4096/I=11008, H=7168/I=18432) and two MoE shared experts (DeepSeek-V3 H7168/I2048,
Qwen2-MoE-A2.7B H2048/I5632); ``--tokens`` row counts. Also sweeps the kernel's tile configs per shape
(``--no-sweep``: not). Writes ``$OUT/swiglu.json`` / ``swiglu.md``; ``providers.triton.gemm_swiglu.GEMM_SWIGLU_MAX_ROWS`` comes from it.

**prefill** (``--part prefill``): the Hopper TMA kernel run as one expert (``launch_gemm_swiglu_tma``) vs what
Inductor runs without ep_fuse. For each (H, I) of an MLP (Llama-7B H4096/I11008, DeepSeek-V3 dense H7168/I18432,
its shared expert H7168/I2048) and each ``--rows`` count: (a) ``torch.compile`` of the MLP (two cuBLAS GEMMs and
one fused SwiGLU kernel), (b) one dense cuBLAS GEMM with both weights concatenated (the practical ceiling, no
SwiGLU), (c) the one-tile-per-program ``gemm_swiglu`` kernel, (d) the TMA kernel at its default config and,
within ``--budget`` seconds, a few other configs. Outputs are checked against an fp32 reference (relative L2 <
1e-2). Writes ``$OUT/gemm_swiglu_prefill.json`` / ``.md``; the ``vs Inductor`` column is what
``providers.triton.gemm_swiglu.GEMM_SWIGLU_TMA_MIN_ROWS`` / ``GEMM_SWIGLU_TMA_MIN_I`` are set from.

GPU time from CUDA-graph replays throughout. Needs a CUDA GPU (the prefill part sm_90+).
"""

from __future__ import annotations

import importlib
import os
import time
from typing import Any

import torch

os.environ.setdefault("EP_FUSE_UNVERIFIED_KERNELS", "1")
from bench_moe_grouped_gemm_tma import log, timed
from common import bench_graph_us, bench_parser, env_info, markdown_table, out_dir, start, write_json  # noqa: E402

import ep_fuse
import ep_fuse.providers  # noqa: F401  (registers torch.ops.ep_fuse_triton.*)
# by module path: the package attribute ``gemm_swiglu_kernel`` is the provider function of that name
dk = importlib.import_module("ep_fuse.providers.triton.gemm_swiglu_kernel")
tk = importlib.import_module("ep_fuse.providers.triton.grouped_gemm_tma_kernel")

PARTS = ("decode", "prefill")

# --- decode sizes -------------------------------------------------------------------------------------------

BF16 = torch.bfloat16
SHAPES = [(4096, 11008), (7168, 18432), (7168, 2048), (2048, 5632)]
"""7B-class dense MLPs (the issue's shapes), DeepSeek-V3's shared expert, Qwen2-MoE-A2.7B's shared expert."""
TOKENS = [16, 64, 128, 256, 1024, 8192]


def mlp_up(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(torch.nn.functional.linear(x, wg)) * torch.nn.functional.linear(x, wu)


def liger_fn():
    """cuBLAS GEMMs + Liger's fused SiLU·mul kernel (Liger has no GEMM-epilogue SwiGLU), or None."""
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except Exception as exc:
        log("liger unavailable:", exc)
        return None

    def fn(x, wg, wu):
        return LigerSiLUMulFunction.apply(torch.nn.functional.linear(x, wg), torch.nn.functional.linear(x, wu))

    return fn


def inputs(t: int, h: int, i: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, h, device="cuda", dtype=BF16, generator=g)
    wg = (torch.randn(i, h, device="cuda", generator=g) / h**0.5).to(BF16)
    wu = (torch.randn(i, h, device="cuda", generator=g) / h**0.5).to(BF16)
    return x, wg, wu


def reference(x, wg, wu) -> torch.Tensor:
    return mlp_up(x.double(), wg.double(), wu.double())


def check(ref: torch.Tensor, out: torch.Tensor) -> float:
    err = ((out.double() - ref).norm() / ref.norm()).item()
    if not err < 1e-2 or torch.isnan(out).any():
        raise AssertionError(f"relative L2 error {err}")
    return err


def sweep(x, wg, wu, ref) -> list[dict[str, Any]]:
    from ep_fuse.providers.triton.gemm_swiglu_kernel import GemmConfig, gemm_config, launch

    t, h = x.shape
    y = torch.empty(t, wg.shape[0], device="cuda", dtype=BF16)
    cfgs = {gemm_config(t, wg.shape[0], h)}
    if t <= 256:  # swapped tiles: weight rows in the MMA's M dim, BM covers the tokens
        bm = max(16, min(128, 1 << (t - 1).bit_length()))
        for bn in (16, 32, 64):
            for bk in (128, 256):
                for st_ in (3, 4, 5):
                    cfgs.add(GemmConfig(bm, bn, bk, 4, st_, 1, swap_ab=True))
        cfgs.add(GemmConfig(64, 64, 128, 4, 4))
    else:
        for bm, bn, bk, w, st_ in ((64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (128, 128, 64, 8, 3),
                                   (128, 128, 64, 8, 4), (128, 256, 64, 8, 3)):
            cfgs.add(GemmConfig(bm, bn, bk, w, st_))
    out = []
    for cfg in sorted(cfgs, key=str):
        try:
            launch(x, wg, wu, y, config=cfg)
            check(ref, y)
            out.append({"cfg": str(cfg), "us": bench_graph_us(lambda: launch(x, wg, wu, y, config=cfg))})
        except Exception as exc:
            out.append({"cfg": str(cfg), "error": str(exc)[:160]})
        log(f"  T{t} H{h}: {out[-1]}")
    return out


def run_decode(opts: Any) -> None:
    """The decode-size table (formerly ``bench_swiglu.py``): every shape x token count."""
    t0 = time.time()
    res: dict[str, Any] = {"env": env_info(), "rows": []}
    log(res["env"])
    shapes = [tuple(int(v) for v in hi.split("x")) for hi in opts.shapes.split(",") if hi] or SHAPES
    tokens = [int(v) for v in opts.tokens.split(",") if v] or TOKENS
    for h, i in shapes:
        for t in tokens:
            x, wg, wu = inputs(t, h, i, seed=t)
            flops = 2 * t * h * 2 * i
            row: dict[str, Any] = {"tokens": t, "h": h, "i": i}
            with torch.no_grad():
                torch._dynamo.reset()
                ind = torch.compile(mlp_up, dynamic=False)
                torch._dynamo.reset()
                epf = torch.compile(mlp_up, backend="ep_fuse", dynamic=False, options={"perf_guard": False})
                ref = reference(x, wg, wu)
                row["err_ep_fuse"] = check(ref, epf(x, wg, wu))
                assert ep_fuse.last_report().matches[0].provider == "triton"
                impls = [("eager", mlp_up), ("inductor", ind), ("ep_fuse", epf)]
                lf = liger_fn()
                if lf is not None:
                    row["err_liger"] = check(ref, lf(x, wg, wu))
                    impls.append(("liger", lf))
                for label, fn in impls:
                    fn(x, wg, wu)
                    row[label] = bench_graph_us(lambda: fn(x, wg, wu))
                    row[label + "_tflops"] = flops / (row[label] * 1e-6) / 1e12
            row["sweep"] = sweep(x, wg, wu, ref) if not opts.no_sweep else [
                {"cfg": "default", "us": row["ep_fuse"]}]
            del ref
            best = min((s for s in row["sweep"] if "us" in s), key=lambda s: s["us"])
            row["best_cfg"], row["best_us"] = best["cfg"], best["us"]
            row["speedup_vs_inductor"] = row["inductor"] / row["ep_fuse"]
            log(f"T{t} H{h} I{i}: eager {row['eager']:.1f} inductor {row['inductor']:.1f} ep_fuse {row['ep_fuse']:.1f} "
                f"(best cfg {row['best_us']:.1f}) us; ep_fuse {row['ep_fuse_tflops']:.0f} TF/s")
            res["rows"].append(row)
            write_json("swiglu.json", res)
    head = ["T", "H", "I", "eager µs", "Inductor µs", "ep_fuse µs", "ep_fuse TF/s", "vs Inductor", "Liger µs",
            "best swept µs"]
    table = markdown_table(head, [[r["tokens"], r["h"], r["i"], r["eager"], r["inductor"], r["ep_fuse"],
                                   r["ep_fuse_tflops"], f"{r['speedup_vs_inductor']:.2f}×", r.get("liger"),
                                   r["best_us"]] for r in res["rows"]])
    (out_dir() / "swiglu.md").write_text(table + "\n")
    log(table)
    log(f"total {time.time() - t0:.0f}s")



# --- prefill sizes (the Hopper TMA kernel) ----------------------------------------------------------

MLPS = {"llama7b": (4096, 11008), "deepseek_v3_dense": (7168, 18432), "deepseek_v3_shared": (7168, 2048)}


def prefill_configs() -> list[Any]:
    c = tk.TmaGemmConfig
    return [c(128, 128, 64, 8, 4, 8), c(64, 256, 64, 8, 3, 8), c(128, 128, 64, 8, 3, 16), c(128, 128, 64, 8, 4, 1),
            c(128, 64, 64, 4, 4, 8), c(128, 128, 64, 8, 3, 8, desc="host")]


def run_prefill_case(name: str, h: int, i: int, m: int, until: float) -> list[dict[str, Any]]:
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
    for cfg in prefill_configs():
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


def run_prefill(opts: Any) -> None:
    """The prefill-size table (formerly ``bench_gemm_swiglu_prefill.py``): every MLP x row count."""
    t0 = time.time()
    res: dict[str, Any] = {"env": env_info(), "rows": []}
    log(res["env"])
    cases = [(n, *MLPS[n], int(m)) for n in opts.only.split(",") for m in opts.rows.split(",")]
    for idx, (name, h, i, m) in enumerate(cases):
        left = max(0.0, opts.budget - (time.time() - t0)) / (len(cases) - idx)
        log(f"{name} H{h} I{i} rows {m}")
        res["rows"] += run_prefill_case(name, h, i, m, time.time() + left)
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



def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--part", default=",".join(PARTS), help="decode, prefill or both (default: both)")
    g = ap.add_argument_group("decode")
    g.add_argument("--tokens", default="", help=f"row counts (default {','.join(map(str, TOKENS))})")
    g.add_argument("--shapes", default="", help="HxI,... (default: " + ",".join(f"{h}x{i}" for h, i in SHAPES) + ")")
    g.add_argument("--no-sweep", action="store_true", help="no tile-config sweep")
    g = ap.add_argument_group("prefill")
    g.add_argument("--only", default=",".join(MLPS), help="MLP names")
    g.add_argument("--rows", default="1024,2048,4096,8192")
    g.add_argument("--budget", type=float, default=120.0, help="seconds of config sweeping, shared over the cases")
    opts = ap.parse_args()
    parts = [p for p in opts.part.split(",") if p]
    bad = sorted(set(parts) - set(PARTS))
    if bad:
        ap.error(f"--part: unknown {bad}; one of {list(PARTS)}")
    start(opts)
    if "decode" in parts:
        run_decode(opts)
    if "prefill" in parts:
        run_prefill(opts)


if __name__ == "__main__":
    main()

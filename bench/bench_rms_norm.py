"""GPU check + benchmark of add+RMSNorm / RMSNorm: eager vs Inductor vs ep_fuse (vs Liger) in one run.

    python bench/bench_rms_norm.py [--quick] [--sweep]

Writes ``$OUT/rms_norm.json`` and ``$OUT/rms_norm.md``. Correctness checks run first (fresh random
inputs, Triton provider vs the reference, compiled models vs eager); a failed check stops the run.
"""

from __future__ import annotations

import time
import traceback
from typing import Any

import torch

from common import (
    bench_graph_us,
    bench_us,
    check_hf_models,
    copy_bandwidth_gbs,
    env_info,
    markdown_table,
    out_dir,
    bench_parser,
    start,
    write_json,
)

import ep_fuse
from ep_fuse.ops.rms_norm import add_rms_norm_ref, rms_norm_ref  # noqa: E402

BF16 = torch.bfloat16
EPS = 1e-6
GRID = [  # (op, rows, hidden): the H200 baseline grid first, then the row sweep for the decline rule
    ("add_rms_norm", 64, 7168), ("add_rms_norm", 16384, 7168), ("add_rms_norm", 16384, 4096),
    ("add_rms_norm", 1, 7168), ("add_rms_norm", 512, 7168), ("add_rms_norm", 4096, 7168),
    ("add_rms_norm", 64, 4096), ("add_rms_norm", 4096, 2048),
    ("rms_norm", 64, 7168), ("rms_norm", 16384, 7168), ("rms_norm", 16384, 4096),
    ("rms_norm", 262144, 128),  # q/k-norm over head_dim: 16384 tokens x 16 heads
]


def hf_add_rms_norm(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor):
    s = x + r
    hf = s.to(torch.float32)
    n = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS)
    return w * n.to(x.dtype), s


def hf_rms_norm(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor):
    hf = x.to(torch.float32)
    n = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS)
    return w * n.to(x.dtype)


def zaya_add_rms_norm(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor):
    """An fp32 residual stream in a bf16 model, normed after rounding the sum to bf16 (Zaya; ``add_rms_norm``'s
    ``norm_dtype``): ``r`` is fp32, so the sum is read and written in fp32."""
    s = x + r
    return hf_rms_norm(s.to(x.dtype), None, w), s


FNS = {"add_rms_norm": hf_add_rms_norm, "rms_norm": hf_rms_norm, "add_rms_norm_norm_dtype": zaya_add_rms_norm}
BYTES_PER_ELEMENT = {"add_rms_norm": 8, "rms_norm": 4, "add_rms_norm_norm_dtype": 12}
"""Bytes moved per element: the inputs read and the outputs written (bf16 = 2, fp32 = 4)."""
NORM_DTYPE_GRID = [("add_rms_norm_norm_dtype", rows, h) for rows, h in ((1, 4096), (64, 4096), (512, 4096),
                                                                         (4096, 4096), (16384, 4096), (4096, 2048))]


def log(*a: Any, sep: str = " ") -> None:
    print(*a, sep=sep, flush=True)


def inputs(rows: int, h: int, seed: int = 0, residual_dtype: torch.dtype = BF16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, h, device="cuda", dtype=BF16, generator=g)
    r = torch.randn(rows, h, device="cuda", dtype=residual_dtype, generator=g)
    w = (torch.randn(h, device="cuda", generator=g) * 0.1 + 1).to(BF16)
    return x, r, w


def close(out: torch.Tensor, ref: torch.Tensor, name: str) -> None:
    tol = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 2e-5}[out.dtype]
    if torch.isnan(out).any():
        raise AssertionError(f"{name}: NaN in output")
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")


# --------------------------------------------------------------------------- correctness
def check_kernels() -> int:
    n = 0
    ops = {False: torch.ops.ep_fuse_triton.rms_norm.default, True: torch.ops.ep_fuse_triton.add_rms_norm.default}
    for dtype in (BF16, torch.float16, torch.float32):
        for mode in ("llama", "weight_fp32", "gemma", "none"):
            for residual in (False, True):
                for rows, h in ((1, 7168), (37, 4096), (1000, 96), (3, 32768), (129, 5120)):
                    g = torch.Generator(device="cuda").manual_seed(n)
                    x = torch.randn(rows, h, device="cuda", generator=g).to(dtype)
                    r = torch.randn(rows, h, device="cuda", generator=g).to(dtype)
                    w = None if mode == "none" else torch.randn(h, device="cuda", generator=g).to(dtype)
                    out_dtype = dtype if mode == "llama" else (dtype if n % 2 else None)
                    rest = (w, EPS, None, mode, True, out_dtype)
                    args = (x, r, *rest) if residual else (x, *rest)
                    out = ops[residual](*args)
                    ref = (add_rms_norm_ref if residual else rms_norm_ref)(*args)
                    if residual:
                        if not torch.equal(out[1], ref[1]):
                            raise AssertionError(f"residual sum differs {dtype} {mode} {rows}x{h}")
                        out, ref = out[0], ref[0]
                    close(out, ref, f"triton {dtype} {mode} res={residual} {rows}x{h}")
                    n += 1
    # strided rows (split of a wider projection) and a 4-D head_dim view
    proj = torch.randn(64, 48 + 64, device="cuda").to(BF16)
    x, _ = proj.split([48, 64], dim=-1)
    w = torch.randn(48, device="cuda").to(BF16)
    close(ops[False](x, w, EPS, None, "llama", True, BF16), rms_norm_ref(x, w, EPS, None, "llama", True, BF16), "split")
    q = torch.randn(2, 16, 8, 128, device="cuda").to(BF16)
    w = torch.randn(128, device="cuda").to(BF16)
    close(ops[False](q, w, EPS, None, "llama", True, BF16), rms_norm_ref(q, w, EPS, None, "llama", True, BF16), "4d")
    # eps as a 0-d CPU tensor (dynamic shapes)
    x, r, w = inputs(33, 4096, seed=7)
    et = torch.tensor(1e-5)
    o, s = ops[True](x, r, w, 0.0, et, "llama", True, BF16)
    e, es = add_rms_norm_ref(x, r, w, 0.0, et, "llama", True, BF16)
    close(o, e, "eps tensor")
    return n + 3


def check_compiled() -> list[str]:
    done = []
    for inline in (True, False):
        opts = {"inline_in_inductor": inline}
        for name, fn in FNS.items():
            for rows, h in ((64, 7168), (1000, 4096)):
                torch._dynamo.reset()
                x, r, w = inputs(rows, h, seed=rows)
                with torch.no_grad():
                    ref = fn(x, r, w)
                    out = torch.compile(fn, backend="ep_fuse", dynamic=False, options=opts)(x, r, w)
                    x2, r2, w2 = inputs(rows, h, seed=rows + 1)
                    out2, ref2 = (torch.compile(fn, backend="ep_fuse", dynamic=False, options=opts)(x2, r2, w2),
                                  fn(x2, r2, w2))
                rep = ep_fuse.last_report()
                assert rep.matches and rep.matches[0].provider == "triton", rep
                for o, e in ((out, ref), (out2, ref2)):
                    o, e = (o, e) if isinstance(o, tuple) else ((o,), (e,))
                    for a, b in zip(o, e):
                        close(a, b, f"compiled {name} inline={inline} {rows}x{h}")
                done.append(f"{name} inline={inline} {rows}x{h}")
    # dynamic shapes (eps stays a literal here; HF models make it a tensor input)
    torch._dynamo.reset()
    f = torch.compile(hf_add_rms_norm, backend="ep_fuse", dynamic=True)
    for rows in (17, 300):
        x, r, w = inputs(rows, 4096, seed=rows)
        with torch.no_grad():
            o, e = f(x, r, w), hf_add_rms_norm(x, r, w)
        close(o[0], e[0], f"dynamic {rows}")
    done.append("dynamic=True")
    # CUDA graphs through Inductor
    torch._dynamo.reset()
    f = torch.compile(hf_add_rms_norm, backend="ep_fuse", mode="reduce-overhead")
    x, r, w = inputs(64, 7168, seed=3)
    with torch.no_grad():
        for _ in range(3):
            o = f(x, r, w)
        close(o[0], hf_add_rms_norm(x, r, w)[0], "reduce-overhead")
    done.append("reduce-overhead")
    return done


# --------------------------------------------------------------------------- timing
def liger_fn(op: str):
    try:
        if op == "add_rms_norm":
            from liger_kernel.ops.fused_add_rms_norm import (
                LigerFusedAddRMSNormFunction as F,
            )

            return lambda x, r, w: F.apply(x, r, w, EPS, 0.0, "llama", False)
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction as F

        return lambda x, r, w: F.apply(x, w, EPS, 0.0, "llama", False)
    except Exception as exc:  # not installed here
        log("liger unavailable:", exc)
        return None


def sweep(rows: int, h: int) -> list[dict[str, Any]]:
    """GPU time (CUDA-graph replay) of the raw kernel per launch config."""
    from ep_fuse.providers.triton.rms_norm_kernel import LaunchConfig, launch, launch_config

    x, r, w = inputs(rows, h, seed=11)
    y, s = torch.empty_like(x), torch.empty_like(x)
    block = 1 << (h - 1).bit_length()
    cfgs = {launch_config(h, 2)}
    for warps in (8, 16, 32):
        for nrows in (1, 2):
            if block * nrows <= 16384:
                cfgs.add(LaunchConfig(block, nrows, warps))
    for cb, warps in ((1024, 8), (2048, 8)):
        cfgs.add(LaunchConfig(cb, 1, warps, chunked=True))
    out = []
    for cfg in sorted(cfgs, key=lambda c: (c.chunked, c.rows, c.block_n, c.num_warps)):
        try:
            us = bench_graph_us(lambda: launch(x, r, w, y, s, EPS, "llama", BF16, h, h, config=cfg))
            out.append({"rows": rows, "h": h, "cfg": str(cfg), "us": us})
        except Exception as exc:
            out.append({"rows": rows, "h": h, "cfg": str(cfg), "error": str(exc)[:200]})
        log(out[-1])
    return out


def time_grid(copy_gbs: float, grid: list[tuple[str, int, int]]) -> list[dict[str, Any]]:
    """Per shape and implementation: GPU time (CUDA-graph replay) and call time (with CPU overhead)."""
    results = []
    for op, rows, h in grid:
        fn = FNS[op]
        x, r, w = inputs(rows, h, seed=rows + h,
                         residual_dtype=torch.float32 if op == "add_rms_norm_norm_dtype" else BF16)
        nbytes = BYTES_PER_ELEMENT[op] * rows * h + h * 2
        row: dict[str, Any] = {"op": op, "rows": rows, "h": h, "bytes": nbytes}
        impls: dict[str, Any] = {"eager": lambda a, b, c: fn(a, b, c)}
        with torch.no_grad():
            torch._dynamo.reset()
            impls["inductor"] = torch.compile(fn, dynamic=False)
            for label, inline in (("ep_fuse", True), ("ep_fuse_opaque", False)):
                torch._dynamo.reset()
                f = torch.compile(fn, backend="ep_fuse", dynamic=False,
                                  options={"perf_guard": False, "inline_in_inductor": inline})
                f(x, r, w)
                impls[label] = f
            lf = liger_fn(op) if op in ("add_rms_norm", "rms_norm") else None
            if lf is not None:
                impls["liger"] = lf
            for label, f in impls.items():
                try:
                    f(x, r, w)
                    row[label] = bench_graph_us(lambda: f(x, r, w))
                    row[label + "_call"] = bench_us(lambda: f(x, r, w))
                    row[label + "_gbs"] = nbytes / (row[label] * 1e-6) / 1e9
                except Exception as exc:
                    row[label + "_error"] = str(exc)[:300]
        row["ep_fuse_pct_copy"] = 100 * row["ep_fuse_gbs"] / copy_gbs
        row["speedup_vs_inductor"] = row["inductor"] / row["ep_fuse"]
        log(f"{op} {rows}x{h} GPU us: " + " ".join(f"{k} {row[k]:.1f}" for k in impls if k in row)
            + " | call us: " + " ".join(f"{k} {row[k + '_call']:.1f}" for k in impls if k + "_call" in row)
            + f" | ep_fuse {row['ep_fuse_gbs']:.0f} GB/s = {row['ep_fuse_pct_copy']:.1f}% copy")
        results.append(row)
    return results


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="baseline grid only, no sweep")
    ap.add_argument("--sweep", action="store_true", help="time launch configs of the raw kernel")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--norm-dtype", action="store_true",
                    help="time only the fp32-residual form (add_rms_norm:norm_dtype; run with EP_FUSE_UNVERIFIED_KERNELS=1 "
                         "while unverified.py lists it)")
    args = ap.parse_args()
    start(args)
    t0 = time.time()
    res: dict[str, Any] = {"env": env_info()}
    log(res["env"])
    res["copy_gbs"] = copy_bandwidth_gbs()
    log(f"copy bandwidth {res['copy_gbs']:.0f} GB/s")
    if not args.skip_checks:
        res["checks"] = {"kernels": check_kernels()}
        log(f"kernel checks ok: {res['checks']['kernels']} cases ({time.time() - t0:.0f}s)")
        res["checks"]["compiled"] = check_compiled()
        log("compiled checks ok:", res["checks"]["compiled"], f"({time.time() - t0:.0f}s)")
        try:
            res["checks"]["hf"] = check_hf_models(
                [("mixtral", False), ("qwen3_moe", False), ("deepseek_v3", False), ("mixtral", True)], rtol=0.02)
            log("hf checks ok:", *res["checks"]["hf"], sep="\n  ")
        except Exception:
            res["checks"]["hf_error"] = traceback.format_exc()
            log(res["checks"]["hf_error"])
        write_json("rms_norm.json", res)
    if args.sweep:
        res["sweep"] = []
        for rows, h in ((16384, 7168), (4096, 7168), (16384, 4096), (64, 7168), (4096, 2048)):
            res["sweep"] += sweep(rows, h)
        write_json("rms_norm.json", res)
    grid = NORM_DTYPE_GRID if args.norm_dtype else GRID[:3] if args.quick else GRID
    res["grid"] = time_grid(res["copy_gbs"], grid)
    write_json("rms_norm.json", res)
    head = ["op", "T×H", "eager µs", "Inductor µs", "ep_fuse µs", "ep_fuse GB/s", "% copy", "vs Inductor",
            "Liger µs", "Inductor call µs", "ep_fuse call µs"]
    rows = [[r["op"], f"{r['rows']}×{r['h']}", r.get("eager"), r.get("inductor"), r.get("ep_fuse"), r.get("ep_fuse_gbs"),
             r.get("ep_fuse_pct_copy"), f"{r['speedup_vs_inductor']:.2f}×", r.get("liger"), r.get("inductor_call"),
             r.get("ep_fuse_call")] for r in res["grid"]]
    table = markdown_table(head, rows)
    (out_dir() / "rms_norm.md").write_text(table + "\n")
    log(table)
    log(f"total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()

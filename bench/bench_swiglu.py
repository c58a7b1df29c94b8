"""GPU check + benchmark of dense GEMM + SwiGLU: eager vs Inductor (cuBLAS + fused SwiGLU) vs ep_fuse.

    python bench/bench_swiglu.py [--tokens 16,64] [--shapes 4096x11008,7168x2048] [--no-sweep]

Shapes: the dense MLP of 7B-class models (H=4096/I=11008, H=7168/I=18432) and two MoE shared experts;
Liger = cuBLAS GEMMs + ``LigerSiLUMulFunction`` (when liger-kernel is installed).
Writes ``$OUT/swiglu.json`` / ``swiglu.md``; also sweeps the kernel's tile configs per shape.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_graph_us, env_info, markdown_table, out_dir, write_json  # noqa: E402

import ep_fuse  # noqa: E402
import ep_fuse.providers  # noqa: E402,F401  (registers torch.ops.ep_fuse_triton.*)

BF16 = torch.bfloat16
SHAPES = [(4096, 11008), (7168, 18432), (7168, 2048), (2048, 5632)]
"""7B-class dense MLPs (the issue's shapes), DeepSeek-V3's shared expert, Qwen2-MoE-A2.7B's shared expert."""
TOKENS = [16, 64, 128, 256, 1024, 8192]


def _arg(name: str, default: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def log(*a: Any) -> None:
    print(*a, flush=True)


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
    from ep_fuse.providers.triton.gemm_swiglu_kernel import (
        GemmConfig,
        gemm_config,
        launch,
    )

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


def main() -> None:
    t0 = time.time()
    res: dict[str, Any] = {"env": env_info(), "rows": []}
    log(res["env"])
    shapes = [tuple(int(v) for v in hi.split("x")) for hi in _arg("--shapes", "").split(",") if hi] or SHAPES
    tokens = [int(v) for v in _arg("--tokens", "").split(",") if v] or TOKENS
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
            row["sweep"] = sweep(x, wg, wu, ref) if "--no-sweep" not in sys.argv else [
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


if __name__ == "__main__":
    main()

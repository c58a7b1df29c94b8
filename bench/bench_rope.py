"""GPU check + benchmark of RoPE: eager vs Inductor vs ep_fuse vs Liger in one run.

    python bench/bench_rope.py [--quick] [--sweep] [--json PATH]

``--quick``: no tiny-HF-model checks; ``--sweep``: also the rounding-mode x rows x warps sweep of the kernel.
Writes ``$OUT/rope.json`` and ``$OUT/rope.md``. Checks first: the Triton kernel against the
reference for every form, dtype and layout; every tiny HF model compiled with ``backend="ep_fuse"``
on CUDA against eager (site counts included).
"""

from __future__ import annotations

import time
import traceback
from typing import Any

import torch

from common import (
    bench_graph_us,
    bench_parser,
    bench_us,
    check_hf_models,
    copy_bandwidth_gbs,
    env_info,
    markdown_table,
    out_dir,
    start,
    test_support,
    write_json,
)

import ep_fuse
import ep_fuse.providers  # noqa: F401  (registers torch.ops.ep_fuse_triton.*)
from ep_fuse.ops.rope import rope_qk_ref

BF16 = torch.bfloat16
GRID = [  # (tokens, q heads, k heads, head dim): the H200 baseline grid rows, then a DeepSeek-V3-like MLA rope part
    (64, 32, 8, 128), (16384, 32, 8, 128), (16384, 128, 128, 64), (4096, 128, 1, 64),
]


def log(*a: Any, sep: str = " ") -> None:
    print(*a, sep=sep, flush=True)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def hf_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """HF apply_rotary_pos_emb: q, k [B, H, S, D] (transposed views), cos/sin [B, S, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def inputs(t: int, hq: int, hk: int, d: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, t, hq, d, device="cuda", dtype=BF16, generator=g).transpose(1, 2)
    k = torch.randn(1, t, hk, d, device="cuda", dtype=BF16, generator=g).transpose(1, 2)
    ang = torch.randn(1, t, d // 2, device="cuda", generator=g)
    ang = torch.cat((ang, ang), -1)
    return q, k, ang.cos().to(BF16), ang.sin().to(BF16)


def rounding_diagnostics() -> dict[str, int]:
    """Does a bf16/fp16 round trip inside a Triton kernel round on this GPU? (counts of mismatches)"""
    import triton
    import triton.language as tl

    @triton.jit
    def trip(X, Y16, YB, YE, N: tl.constexpr):
        i = tl.arange(0, N)
        x = tl.load(X + i)
        tl.store(YB + i, x.to(tl.bfloat16).to(tl.float32) * 1.0)
        tl.store(Y16 + i, x.to(tl.float16).to(tl.float32) * 1.0)
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        tl.store(YE + i, bits.to(tl.float32, bitcast=True))

    x = torch.randn(4096, device="cuda")
    yb, y16, ye = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)
    trip[(1,)](x, y16, yb, ye, N=4096)
    return {"bf16_roundtrip_mismatch": int((yb != x.bfloat16().float()).sum()),
            "fp16_roundtrip_mismatch": int((y16 != x.half().float()).sum()),
            "bf16_bits_mismatch": int((ye != x.bfloat16().float()).sum())}


def norm_bitwise() -> dict[str, int]:
    """Mismatching elements of the Triton add+RMSNorm against the reference (informational)."""
    from ep_fuse.ops.rms_norm import add_rms_norm_ref

    g = torch.Generator(device="cuda").manual_seed(0)
    x, r = (torch.randn(512, 4096, device="cuda", generator=g).to(BF16) for _ in range(2))
    w = torch.randn(4096, device="cuda", generator=g).to(BF16)
    args = (x, r, w, 1e-6, None, "llama", True, BF16)
    out, ref = torch.ops.ep_fuse_triton.add_rms_norm(*args), add_rms_norm_ref(*args)
    return {"normed_mismatch": int((out[0] != ref[0]).sum()), "sum_mismatch": int((out[1] != ref[1]).sum()),
            "elements": out[0].numel()}


def check_kernels(rounding: int | None = None) -> int:
    """Kernel vs reference for every form/dtype/layout: bf16 and fp16 bitwise (fp32 and complex to 2e-6)."""
    from ep_fuse.providers.triton import rope as rope_host

    tuning = rope_host.RopeTuning(rounding=rounding)
    n = 0
    for form in ("half", "chunk", "deinterleave", "interleave", "complex"):
        for dtype in (BF16, torch.float16, torch.float32):
            for t, hq, hk, d, rot in ((7, 4, 2, 64, 64), (33, 8, 1, 128, 128), (5, 2, 2, 128, 64)):
                g = torch.Generator(device="cuda").manual_seed(n)
                q = torch.randn(2, t, hq, d, device="cuda", generator=g).to(dtype).transpose(1, 2)
                k = torch.randn(2, t, hk, d, device="cuda", generator=g).to(dtype).transpose(1, 2)
                width = rot if form == "half" else rot // 2
                if form == "complex":
                    f = torch.randn(2, 1, t, rot // 2, device="cuda", generator=g)
                    cos, sin, out_dtype = torch.polar(torch.ones_like(f), f), None, dtype
                else:
                    ang = torch.randn(2, 1, t, width, device="cuda", generator=g)
                    cos, sin, out_dtype = ang.cos().to(dtype), ang.sin().to(dtype), None
                args = (q, k, cos, sin, form, rot, out_dtype)
                out, ref = rope_host.rope_qk_kernel(*args, tuning=tuning), rope_qk_ref(*args)
                for o, e in zip(out, ref):
                    exact = dtype == BF16 or (dtype == torch.float16 and rounding in (None, 3))
                    if form == "complex" or not exact:  # fp32: the GPU may contract a*b+c to an FMA
                        tol = 2e-6 if dtype == torch.float32 else 1e-2
                        torch.testing.assert_close(o.float(), e.float(), rtol=tol, atol=tol)
                    elif not torch.equal(o, e):
                        raise AssertionError(f"rope {form} {dtype} {t}x{hq}x{d} rot {rot}: "
                                             f"max diff {(o.float() - e.float()).abs().max().item()}")
                n += 1
    return n


def check_cache_kernels() -> int:
    """``rope_qk_cache`` (positions gathered in the kernel) vs the reference: bf16/fp16 bitwise, fp32 to 2e-6."""
    from ep_fuse.ops.rope import rope_qk_cache_ref

    n = 0
    for form in ("chunk", "interleave"):
        for dtype in (BF16, torch.float16, torch.float32):
            for t, hq, hk, d, rot in ((7, 4, 2, 64, 64), (33, 8, 1, 128, 128), (5, 2, 2, 128, 64)):
                g = torch.Generator(device="cuda").manual_seed(n)
                q = torch.randn(t, hq, d, device="cuda", generator=g).to(dtype)
                k = torch.randn(t, hk, d, device="cuda", generator=g).to(dtype)
                cache = torch.randn(50, rot, device="cuda", generator=g).to(dtype)
                pos = torch.randint(0, 50, (t,), device="cuda", generator=g)
                args = (q, k, cache, pos, form, rot)
                for o, e in zip(torch.ops.ep_fuse_triton.rope_qk_cache(*args), rope_qk_cache_ref(*args)):
                    if dtype == torch.float32:
                        torch.testing.assert_close(o, e, rtol=2e-6, atol=2e-6)
                    elif not torch.equal(o, e):
                        raise AssertionError(f"rope_cache {form} {dtype} {t}x{hq}x{d} rot {rot}")
                n += 1
    return n


def form_fn(form: str):
    """q, k [B, H, S, D] views, cos/sin [B, S, D/2]: chunk / de-interleaved (DeepSeek-V3) / GPT-J forms."""
    def one(t, c, s):
        if form == "chunk":
            t1, t2 = torch.chunk(t, 2, dim=-1)
        else:
            t1, t2 = t[..., 0::2], t[..., 1::2]
        pair = (t1 * c - t2 * s, t2 * c + t1 * s)
        return torch.stack(pair, -1).flatten(-2) if form == "interleave" else torch.cat(pair, -1)

    def fn(q, k, cos, sin):
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        return one(q, c, s), one(k, c, s)

    return fn


def time_forms(copy_gbs: float) -> list[dict[str, Any]]:
    """The other tensor forms at 16384 tokens (q32+k8 x 128; DeepSeek-V3-like q128+k1 x 64), default options."""
    rows = []
    for form, (t, hq, hk, d) in (("chunk", (16384, 32, 8, 128)), ("interleave", (16384, 32, 8, 128)),
                                 ("deinterleave", (16384, 32, 8, 128)), ("deinterleave", (16384, 128, 1, 64))):
        q, k, cos, sin = inputs(t, hq, hk, d, seed=t)
        cos, sin = cos[..., : d // 2].contiguous(), sin[..., : d // 2].contiguous()
        fn = form_fn(form)
        nbytes = 2 * (q.numel() + k.numel()) * 2 + 2 * cos.numel() * 2
        row: dict[str, Any] = {"form": form, "tokens": t, "hq": hq, "hk": hk, "d": d}
        with torch.no_grad():
            torch._dynamo.reset()
            impls = {"eager": fn, "inductor": torch.compile(fn, dynamic=False)}
            torch._dynamo.reset()
            f = torch.compile(fn, backend="ep_fuse", dynamic=False)
            out, ref = f(q, k, cos, sin), fn(q, k, cos, sin)
            row["bitwise_vs_eager"] = all(torch.equal(a, b) for a, b in zip(out, ref))
            row["providers"] = [m.provider for m in ep_fuse.last_report().matches]
            impls["ep_fuse"] = f
            for label, g in impls.items():
                g(q, k, cos, sin)
                row[label] = bench_graph_us(lambda: g(q, k, cos, sin))
        row["ep_fuse_pct_copy"] = 100 * nbytes / (row["ep_fuse"] * 1e-6) / 1e9 / copy_gbs
        log(f"rope {form} T{t} q{hq} k{hk} D{d}: eager {row['eager']:.1f} inductor {row['inductor']:.1f} "
            f"ep_fuse {row['ep_fuse']:.1f} us ({row['ep_fuse_pct_copy']:.1f}% copy, {row['providers']}) "
            f"bitwise {row['bitwise_vs_eager']}")
        rows.append(row)
    return rows


def time_cache(copy_gbs: float) -> list[dict[str, Any]]:
    """vLLM-style native RoPE with a cos/sin cache (q [T, 32*128], k [T, 8*128]): eager / Inductor / ep_fuse."""
    CacheRope = test_support("rope_cache_modules").CacheRope

    rows = []
    for t, neox in ((64, True), (16384, True), (16384, False)):
        mod = CacheRope(head=128, max_pos=32768, neox=neox).cuda()
        g = torch.Generator(device="cuda").manual_seed(t)
        pos = torch.randint(0, 32768, (t,), device="cuda", generator=g)
        q = torch.randn(t, 32 * 128, device="cuda", dtype=BF16, generator=g)
        k = torch.randn(t, 8 * 128, device="cuda", dtype=BF16, generator=g)
        nbytes = 2 * (q.numel() + k.numel()) * 2 + t * 128 * 2
        row: dict[str, Any] = {"tokens": t, "neox": neox, "bytes": nbytes}
        with torch.no_grad():
            torch._dynamo.reset()
            impls = {"eager": mod, "inductor": torch.compile(mod, dynamic=False)}
            torch._dynamo.reset()
            f = torch.compile(mod, backend="ep_fuse", dynamic=False, options={"perf_guard": False})
            out, ref = f(pos, q, k), mod(pos, q, k)
            row["bitwise_vs_eager"] = all(torch.equal(a, b) for a, b in zip(out, ref))
            row["ops"] = {k_: v for k_, v in ep_fuse.last_report().ops_after.items() if "ep_fuse" in k_}
            impls["ep_fuse"] = f
            for label, fn in impls.items():
                fn(pos, q, k)
                row[label] = bench_graph_us(lambda: fn(pos, q, k))
        row["ep_fuse_pct_copy"] = 100 * nbytes / (row["ep_fuse"] * 1e-6) / 1e9 / copy_gbs
        log(f"rope cache T{t} neox={neox}: eager {row['eager']:.1f} inductor {row['inductor']:.1f} "
            f"ep_fuse {row['ep_fuse']:.1f} us ({row['ep_fuse_pct_copy']:.1f}% copy) bitwise {row['bitwise_vs_eager']} "
            f"{row['ops']}")
        rows.append(row)
    return rows


def sweep(copy_gbs: float) -> list[dict[str, Any]]:
    """Direct ``rope_qk`` launches: rounding mode (2 cvt.rn, 3 packed fma.rn) x rows per program x warps."""
    from ep_fuse.providers.triton import rope as rope_host

    out = []
    for t, hq, hk, d in GRID:
        q, k, cos, sin = inputs(t, hq, hk, d, seed=t)
        c4, s4 = cos.unsqueeze(1), sin.unsqueeze(1)
        nbytes = 2 * (q.numel() + k.numel()) * 2 + 2 * cos.numel() * 2
        ref = rope_qk_ref(q, k, c4, s4, "half", d, None)
        best = None
        for rounding in (2, 3):
            for rows in (8, 16, 32, 64):
                for warps in (1, 2, 4):
                    if rows * d // 2 < 32 * warps:
                        continue
                    tuning = rope_host.RopeTuning(rounding=rounding, rows=rows, num_warps=warps)
                    fn = lambda: rope_host.rope_qk_kernel(q, k, c4, s4, "half", d, None,  # noqa: E731
                                                          tuning=tuning)
                    o = fn()
                    exact = all(torch.equal(a, b) for a, b in zip(o, ref))
                    us = bench_graph_us(fn)
                    rec = {"tokens": t, "hq": hq, "hk": hk, "d": d, "rounding": rounding, "rows": rows,
                           "warps": warps, "us": us, "pct_copy": 100 * nbytes / (us * 1e-6) / 1e9 / copy_gbs,
                           "bitwise": exact}
                    out.append(rec)
                    if exact and (best is None or us < best["us"]):
                        best = rec
        log(f"sweep T{t} q{hq} k{hk} D{d}: best {best}")
        for rounding in (2, 3):
            log("  mode", rounding, sorted((r["us"], r["rows"], r["warps"]) for r in out
                                          if r["rounding"] == rounding and r["tokens"] == t and r["d"] == d)[:4])
    return out


def liger_fn():
    try:
        from liger_kernel.ops.rope import LigerRopeFunction

        return lambda q, k, c, s: LigerRopeFunction.apply(q, k, c, s)
    except Exception as exc:
        log("liger unavailable:", exc)
        return None


def time_grid(copy_gbs: float) -> list[dict[str, Any]]:
    rows = []
    for t, hq, hk, d in GRID:
        q, k, cos, sin = inputs(t, hq, hk, d, seed=t)
        nbytes = 2 * (q.numel() + k.numel()) * 2 + 2 * cos.numel() * 2
        row: dict[str, Any] = {"tokens": t, "hq": hq, "hk": hk, "d": d, "bytes": nbytes}
        impls: dict[str, Any] = {"eager": hf_rope}
        with torch.no_grad():
            torch._dynamo.reset()
            impls["inductor"] = torch.compile(hf_rope, dynamic=False)
            torch._dynamo.reset()
            f = torch.compile(hf_rope, backend="ep_fuse", dynamic=False, options={"perf_guard": False})
            f(q, k, cos, sin)
            assert ep_fuse.last_report().count("rope") == 2
            impls["ep_fuse"] = f
            lf = liger_fn()
            if lf:
                impls["liger"] = lf
            for label, fn in impls.items():
                try:
                    fn(q, k, cos, sin)
                    row[label] = bench_graph_us(lambda: fn(q, k, cos, sin))
                    row[label + "_call"] = bench_us(lambda: fn(q, k, cos, sin))
                    row[label + "_gbs"] = nbytes / (row[label] * 1e-6) / 1e9
                except Exception as exc:
                    row[label + "_error"] = str(exc)[:300]
        row["ep_fuse_pct_copy"] = 100 * row["ep_fuse_gbs"] / copy_gbs
        log(f"rope T{t} q{hq} k{hk} D{d}: " + " ".join(f"{k_} {row[k_]:.1f}" for k_ in impls if k_ in row)
            + f" us | ep_fuse {row['ep_fuse_gbs']:.0f} GB/s = {row['ep_fuse_pct_copy']:.1f}% copy")
        rows.append(row)
    return rows


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="skip the tiny HF model checks")
    ap.add_argument("--sweep", action="store_true", help="also sweep rounding mode x rows x warps")
    args = ap.parse_args()
    start(args)
    t0 = time.time()
    res: dict[str, Any] = {"env": env_info()}
    res["copy_gbs"] = copy_bandwidth_gbs()
    log(res["env"], f"copy {res['copy_gbs']:.0f} GB/s")
    res["diagnostics"] = {**rounding_diagnostics(), **norm_bitwise()}
    log("diagnostics:", res["diagnostics"])
    res["checks"] = {"kernels": check_kernels(), "kernels_cvt_rn": check_kernels(2), "cache": check_cache_kernels()}
    log(f"rope kernel checks ok: {res['checks']['kernels']} ({time.time() - t0:.0f}s)")
    try:
        if args.quick:
            raise RuntimeError("skipped (--quick)")
        from ep_fuse.testing import tiny as tiny_models

        res["checks"]["hf"] = check_hf_models([(m, False) for m in tiny_models.TINY_MODELS], {})
        log("hf checks ok:", *res["checks"]["hf"], sep="\n  ")
    except Exception:
        res["checks"]["hf_error"] = traceback.format_exc()
        log(res["checks"]["hf_error"])
    write_json("rope.json", res)
    if args.sweep:
        res["sweep"] = sweep(res["copy_gbs"])
        write_json("rope.json", res)
    res["grid"] = time_grid(res["copy_gbs"])
    write_json("rope.json", res)
    res["cache"] = time_cache(res["copy_gbs"])
    write_json("rope.json", res)
    res["forms"] = time_forms(res["copy_gbs"])
    write_json("rope.json", res)
    head = ["T", "q heads", "k heads", "D", "eager µs", "Inductor µs", "ep_fuse µs", "ep_fuse GB/s", "% copy",
            "vs Inductor", "Liger µs", "vs Liger"]
    table = markdown_table(head, [
        [r["tokens"], r["hq"], r["hk"], r["d"], r.get("eager"), r.get("inductor"), r.get("ep_fuse"),
         r.get("ep_fuse_gbs"), r.get("ep_fuse_pct_copy"), f"{r['inductor'] / r['ep_fuse']:.2f}×", r.get("liger"),
         f"{r['liger'] / r['ep_fuse']:.2f}×" if r.get("liger") else None] for r in res["grid"]])
    (out_dir() / "rope.md").write_text(table + "\n")
    log(table)
    log(f"total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()

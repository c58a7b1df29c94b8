"""DeepGEMM's grouped GEMMs next to ep_fuse's Triton kernels on the issue-16/17 prefill shapes (one run).

    PYTHONPATH=.deepgemm_build:$PYTHONPATH python bench/bench_deepgemm.py [--only NAME,...] [--align 128,64]

DeepGEMM (deepseek-ai/DeepGEMM, built by ``tools/build_deepgemm.sh``) is an optional dependency; this script
only times it. Per shape, tokens routed by top-k of random logits, rows expert-major; then per GEMM (gate|up,
down), on the same rows and weights:

* ep_fuse Triton, bf16 (``grouped_gemm_swiglu`` / ``grouped_gemm``, the provider's choice of kernel) and FP8
  (``grouped_gemm_fp8_swiglu_quant`` / ``grouped_gemm_fp8``) on the contiguous layout (``seg_indptr``);
* DeepGEMM ``m_grouped_{fp8,bf16}_gemm_nt_contiguous`` with its prefix-sum layout: each expert's rows start
  at a multiple of the alignment (``--align``, DeepGEMM's BLOCK_M), so the rows are copied into a padded
  buffer first (setup, not timed). Output bf16, no SwiGLU: ``+ swiglu_quant`` adds the time of an eager
  ``silu(gate) * up`` + ep_fuse's Triton 1 x 128 requant on the padded output, what a DeepGEMM-based FP8 path
  would add.

TF/s counts real rows (2 * rows * N * K). Correctness: relative L2 of DeepGEMM's real rows against ep_fuse's
pure-torch FP8 reference (fp32-exact dequant) / an fp32 loop for bf16. GPU time from CUDA-graph replays.
Writes ``$OUT/deepgemm.json`` / ``deepgemm.md``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

os.environ.setdefault("EP_FUSE_UNVERIFIED_KERNELS", "1")
from bench_moe_experts import routed_rows
from common import bench_graph_us, bench_parser, env_info, markdown_table, out_dir, start, write_json  # noqa: E402

import ep_fuse.providers  # noqa: F401
from ep_fuse.ops import fp8 as R
from ep_fuse.providers.triton import fp8 as T  # noqa: E402
from ep_fuse.providers.triton.grouped_gemm import grouped_gemm_kernel, grouped_gemm_swiglu_kernel

BF16 = torch.bfloat16
SHAPES = {
    "deepseek_v3_T4096": (4096, 7168, 2048, 256, 8),
    "qwen3_30b_a3b_T4096": (4096, 2048, 768, 128, 8),
    "deepseek_v3_T16384": (16384, 7168, 2048, 256, 8),
}


def log(*a: Any) -> None:
    print(*a, flush=True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def timed(label: str, fn: Any, flops: float) -> dict[str, Any]:
    row: dict[str, Any] = {"variant": label}
    try:
        fn()
        torch.cuda.synchronize()
        row["us"] = bench_graph_us(fn)
        row["tflops"] = flops / (row["us"] * 1e-6) / 1e12
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    log(f"    {label}: " + (f"{row['us']:.1f} us {row['tflops']:.0f} TF/s" if "us" in row else row["error"]))
    return row


def padded_layout(seg: torch.Tensor, align: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(dst row of each contiguous row, prefix-sum ends int32 [E], padded row count) for DeepGEMM's psum layout."""
    counts = seg.diff()
    seg_al = R.aligned_seg_indptr(seg, align)
    m = int(seg[-1])
    expert = torch.repeat_interleave(torch.arange(counts.numel(), device=seg.device), counts)
    dst = seg_al[expert] + torch.arange(m, device=seg.device) - seg[:-1][expert]
    return dst, (seg_al[:-1] + counts).to(torch.int32), int(seg_al[-1])


def pad_rows(v: torch.Tensor, dst: torch.Tensor, mp: int, fill: float = 0.0) -> torch.Tensor:
    out = torch.full((mp, *v.shape[1:]), fill, dtype=torch.float32, device=v.device).to(v.dtype)
    out[dst] = v
    return out


def run_shape(name: str, shape: tuple[int, ...], aligns: list[int], dg: Any) -> dict[str, Any]:
    t, h, i, e, k = shape
    rows, seg = routed_rows(t, h, e, k)
    m = rows.shape[0]
    g = torch.Generator(device="cuda").manual_seed(1)
    w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=BF16, generator=g).mul_(h**-0.5)
    w2 = torch.randn(e, h, i, device="cuda", dtype=BF16, generator=g).mul_(i**-0.5)
    (q13, s13), (q2, s2) = R.quantize_weight_fp8(w13), R.quantize_weight_fp8(w2)
    xq, xs = R.quant_fp8_group_ref(rows, 128)
    aq, a_s = T.grouped_gemm_fp8_swiglu_quant_kernel(xq, xs, q13, s13, seg, 128, 128)
    act = grouped_gemm_swiglu_kernel(rows, w13, seg)
    f13, f2 = 2.0 * m * 2 * i * h, 2.0 * m * h * i
    info: dict[str, Any] = {"shape": name, "rows": m, "rows_per_expert_max": int(seg.diff().max())}
    log(f"{name}: T{t} H{h} I{i} E{e} k{k}, {m} rows, max {info['rows_per_expert_max']} per expert")
    res = [
        dict(timed("triton bf16 gate|up+swiglu", lambda: grouped_gemm_swiglu_kernel(rows, w13, seg), f13),
             gemm="gate_up"),
        dict(timed("triton bf16 down", lambda: grouped_gemm_kernel(act, w2, seg), f2), gemm="down"),
        dict(timed("triton fp8 gate|up+swiglu+quant",
                   lambda: T.grouped_gemm_fp8_swiglu_quant_kernel(xq, xs, q13, s13, seg, 128, 128), f13),
             gemm="gate_up"),
        dict(timed("triton fp8 down", lambda: T.grouped_gemm_fp8_kernel(aq, a_s, q2, s2, seg, 128, 128, BF16), f2),
             gemm="down"),
    ]
    ref13 = R.grouped_gemm_fp8_ref(xq, xs, q13, s13, seg, 128, 128, BF16)
    ref2 = R.grouped_gemm_fp8_ref(aq, a_s, q2, s2, seg, 128, 128, BF16)
    for align in aligns:
        try:
            dg.set_mk_alignment_for_contiguous_layout(align)
        except Exception as exc:
            log(f"  align {align}: {exc}")
            continue
        dst, psum, mp = padded_layout(seg, align)
        log(f"  align {align}: {mp} padded rows ({mp / m:.2f}x)")
        xq_p, xs_p = pad_rows(xq, dst, mp), pad_rows(xs, dst, mp, 1.0)
        aq_p, as_p = pad_rows(aq, dst, mp), pad_rows(a_s, dst, mp, 1.0)
        rows_p, act_p = pad_rows(rows, dst, mp), pad_rows(act, dst, mp)
        d13 = torch.empty(mp, 2 * i, device="cuda", dtype=BF16)
        d2 = torch.empty(mp, h, device="cuda", dtype=BF16)
        exp_m = m // e

        def fp8_13() -> None:
            dg.m_grouped_fp8_gemm_nt_contiguous((xq_p, xs_p), (q13, s13), d13, psum, use_psum_layout=True,
                                                expected_m_for_psum_layout=exp_m)

        def fp8_2() -> None:
            dg.m_grouped_fp8_gemm_nt_contiguous((aq_p, as_p), (q2, s2), d2, psum, use_psum_layout=True,
                                                expected_m_for_psum_layout=exp_m)

        def bf16_13() -> None:
            dg.m_grouped_bf16_gemm_nt_contiguous(rows_p, w13, d13, psum, use_psum_layout=True,
                                                 expected_m_for_psum_layout=exp_m)

        def bf16_2() -> None:
            dg.m_grouped_bf16_gemm_nt_contiguous(act_p, w2, d2, psum, use_psum_layout=True,
                                                 expected_m_for_psum_layout=exp_m)

        def swiglu_quant() -> None:
            gate, up = d13.split(i, -1)
            T.quant_fp8_group_kernel(torch.nn.functional.silu(gate) * up, 128)

        for label, fn, flops, gemm, out, ref in (
                ("fp8 gate|up", fp8_13, f13, "gate_up", d13, ref13), ("fp8 down", fp8_2, f2, "down", d2, ref2),
                ("bf16 gate|up", bf16_13, f13, "gate_up", d13, None), ("bf16 down", bf16_2, f2, "down", d2, None)):
            row = dict(timed(f"deepgemm {label} (align {align})", fn, flops), gemm=gemm, align=align,
                       padded_rows=mp)
            if "us" in row:
                fn()
                torch.cuda.synchronize()
                if ref is not None:
                    row["rel_l2"] = rel(out[dst], ref)
                    log(f"      rel-L2 vs fp8 reference {row['rel_l2']:.2e}")
            res.append(row)
            if label == "fp8 gate|up" and "us" in row:
                res.append(dict(timed(f"  + swiglu_quant (align {align}, eager silu*up)", swiglu_quant, f13),
                                gemm="gate_up", align=align))
    info["results"] = res
    return info


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--only", default=",".join(SHAPES))
    ap.add_argument("--align", default="128,64")
    args = ap.parse_args()
    start(args)
    import deep_gemm as dg

    log(env_info(), "deep_gemm", getattr(dg, "__version__", "?"))
    out: list[dict[str, Any]] = []
    for name in args.only.split(","):
        out.append(run_shape(name, SHAPES[name], [int(a) for a in args.align.split(",")], dg))
        torch.cuda.empty_cache()
    write_json("deepgemm.json", {"env": env_info(), "shapes": out})
    lines = []
    for s in out:
        lines.append(f"\n{s['shape']} ({s['rows']} rows)\n")
        lines.append(markdown_table(["variant", "GEMM", "µs", "TF/s", "rel-L2", "error"],
                                    [[r["variant"], r["gemm"], r.get("us"), r.get("tflops"),
                                      f"{r['rel_l2']:.1e}" if "rel_l2" in r else None, r.get("error")]
                                     for r in s["results"]]))
    (out_dir() / "deepgemm.md").write_text("\n".join(lines))
    log("\n".join(lines))


if __name__ == "__main__":
    main()

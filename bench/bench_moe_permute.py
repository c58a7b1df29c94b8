"""GPU check + benchmark of MoE permute / unpermute: eager reference vs Inductor vs the Triton provider.

    python bench/bench_moe_permute.py [--quick] [--no-sweep]

Checks first (a failed check stops the run): the Triton permute bitwise against the reference
(rows, src2dst, seg_indptr) over routing edge cases, unpermute against the reference (1 bf16 ulp)
and against the same numerics summed in slot order (mismatch counts reported), both also inlined by
Inductor (``wrap_triton``). Then GPU time (CUDA-graph replay) per shape, and a sweep of the copy
kernels' ``CopyConfig`` (BLOCK_H, num_warps, H blocks per program) and of the index kernels'
``IndexConfig`` (chunk, scan tile, warps). Writes ``$OUT/moe_permute.json`` and ``$OUT/moe_permute.md``.
"""

from __future__ import annotations

import importlib
import time
import traceback
from typing import Any

import torch

from common import (
    bench_graph_us,
    bench_us,
    copy_bandwidth_gbs,
    env_info,
    markdown_table,
    out_dir,
    bench_parser,
    start,
    write_json,
)

import ep_fuse.providers  # noqa: F401  (registers torch.ops.ep_fuse_triton.*)
from ep_fuse.ops.moe import moe_permute_ref, moe_unpermute_ref

mk = importlib.import_module("ep_fuse.providers.triton.moe_permute_kernel")
BF16 = torch.bfloat16
GRID = [(128, 7168, 256, 8), (4096, 7168, 256, 8), (16384, 2048, 64, 6)]  # (T, H, E, K)
SWEEP_SHAPES = [(4096, 7168, 256, 8), (16384, 2048, 64, 6)]
TRITON = torch.ops.ep_fuse_triton


def log(*a: Any, sep: str = " ") -> None:
    print(*a, sep=sep, flush=True)


def routing(t: int, e: int, k: int, seed: int = 0, invalid: float = 0.0, id_dtype=torch.int64):
    """``topk`` of random logits (distinct experts per token), some slots dropped to -1 or >= E."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(t, e, device="cuda", generator=g)
    w, ids = logits.softmax(-1).topk(k, dim=-1)
    if invalid:
        drop = torch.rand(t, k, device="cuda", generator=g) < invalid
        ids = torch.where(drop, torch.where(torch.rand(t, k, device="cuda", generator=g) < 0.5, -1, e + 1), ids)
    return ids.to(id_dtype), w


def permuted_inputs(t: int, h: int, e: int, k: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    x = torch.randn(t, h, device="cuda", generator=g).to(BF16)
    ids, w = routing(t, e, k, seed)
    return x, ids, w


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32) if t.element_size() == 4 else t


def check_permute_equal(out, ref, what: str) -> None:
    for name, o, r in zip(("rows", "src2dst", "seg_indptr"), out, ref):
        if o.shape != r.shape or o.dtype != r.dtype or not torch.equal(bits(o), bits(r)):
            bad = (bits(o) != bits(r)).sum().item() if o.shape == r.shape else "shape"
            raise AssertionError(f"permute {what}: {name} differs from the reference ({bad} elements)")


def unpermute_model(y, src2dst, w, k, out_dtype):
    """Reference numerics with the top-k sum in slot order (what the kernel does; no FMA)."""
    prod = y.dtype if w is None else torch.promote_types(y.dtype, w.dtype)
    t = src2dst.numel() // k
    acc = torch.zeros(t, y.shape[1], device=y.device)
    for j in range(k):
        s = src2dst.view(t, k)[:, j]
        v = y[s.clamp(min=0)].float()
        if w is not None:
            v = (v * w[:, j, None].float()).to(prod).float()
        acc = acc + torch.where((s >= 0)[:, None], v, torch.zeros((), device=y.device))
    return acc.to(prod).to(out_dtype or prod)


def check_kernels() -> dict[str, Any]:
    """Bitwise permute / close unpermute over edge cases, eager and inlined by Inductor."""
    n, mism = 0, {}
    cases = [  # (T, H, E, K, invalid, id dtype, mode)
        (1, 128, 8, 2, 0.0, torch.int64, "topk"), (37, 7168, 256, 8, 0.2, torch.int64, "topk"),
        (513, 2048, 64, 6, 0.1, torch.int32, "topk"), (64, 96, 1024, 8, 0.3, torch.int64, "topk"),
        (300, 4096, 256, 8, 0.0, torch.int32, "one_expert"), (257, 1000, 5, 3, 1.0, torch.int64, "topk"),
        (4096, 7168, 256, 8, 0.05, torch.int64, "topk"),
    ]
    for t, h, e, k, invalid, id_dtype, mode in cases:
        g = torch.Generator(device="cuda").manual_seed(n)
        x = torch.randn(t, h, device="cuda", generator=g).to(BF16)
        ids, w = routing(t, e, k, n, invalid, id_dtype)
        if mode == "one_expert":
            ids = torch.full_like(ids, e // 2)
        ref = moe_permute_ref(x, ids, e)
        check_permute_equal(TRITON.moe_permute(x, ids, e), ref, f"T{t} H{h} E{e} K{k}")
        rows, src2dst, _ = ref
        for wt, out_dtype in ((w.to(BF16), None), (w, BF16), (None, None)):
            args = (rows, src2dst, wt, k, out_dtype)
            out, exp = TRITON.moe_unpermute(*args), moe_unpermute_ref(*args)
            torch.testing.assert_close(out.float(), exp.float(), rtol=2 ** -7, atol=1e-4)
            key = f"T{t}H{h}K{k} w={None if wt is None else wt.dtype}"
            mism[key] = int((out != unpermute_model(*args)).sum())
        n += 1
    # inlined by Inductor (wrap_triton launches in Inductor's generated code)
    x, ids, w = permuted_inputs(200, 2048, 64, 6, seed=3)
    torch._dynamo.reset()
    f = torch.compile(lambda x, ids: TRITON.moe_permute(x, ids, 64), dynamic=False)
    out = f(x, ids)
    check_permute_equal(out, moe_permute_ref(x, ids, 64), "inlined")
    u = torch.compile(lambda y, s, w: TRITON.moe_unpermute(y, s, w, 6, None), dynamic=False)
    got = u(out[0], out[1], w.to(BF16))
    torch.testing.assert_close(got.float(), moe_unpermute_ref(out[0], out[1], w.to(BF16), 6, None).float(),
                               rtol=2 ** -7, atol=1e-4)
    return {"cases": n, "unpermute_vs_slot_order_model_mismatches": mism}


def permute_bytes(t: int, h: int, k: int, ids: torch.Tensor) -> int:
    return t * h * 2 + t * k * h * 2 + ids.numel() * ids.element_size() + t * k * 8


def unpermute_bytes(t: int, h: int, k: int, w: torch.Tensor | None) -> int:
    return t * k * h * 2 + t * h * 2 + t * k * 8 + (0 if w is None else w.numel() * w.element_size())


def time_fns(fns: dict[str, Any], nbytes: int, copy_gbs: float, row: dict[str, Any], prefix: str) -> None:
    for label, fn in fns.items():
        key = f"{prefix}_{label}"
        try:
            fn()
            row[key] = bench_graph_us(fn)
            row[key + "_gbs"] = nbytes / (row[key] * 1e-6) / 1e9
            row[key + "_pct_copy"] = 100 * row[key + "_gbs"] / copy_gbs
        except Exception as exc:
            row[key + "_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            log(f"  {key} failed: {row[key + '_error']}")


def time_grid(copy_gbs: float) -> list[dict[str, Any]]:
    rows = []
    for t, h, e, k in GRID:
        x, ids, w = permuted_inputs(t, h, e, k, seed=t)
        row: dict[str, Any] = {"T": t, "H": h, "E": e, "K": k}
        torch._dynamo.reset()
        ind_perm = torch.compile(moe_permute_ref, dynamic=False)
        inl_perm = torch.compile(lambda x, ids: TRITON.moe_permute(x, ids, e), dynamic=False)
        seg = torch.empty(e + 1, dtype=torch.int64, device="cuda")
        pb = permute_bytes(t, h, k, ids)
        time_fns({
            "eager": lambda: moe_permute_ref(x, ids, e), "inductor": lambda: ind_perm(x, ids, e),
            "triton": lambda: TRITON.moe_permute(x, ids, e), "triton_inlined": lambda: inl_perm(x, ids),
            "triton_index_only": lambda: mk.launch_permute_index(ids, e, seg),
        }, pb, copy_gbs, row, "permute")
        row["permute_triton_call"] = bench_us(lambda: TRITON.moe_permute(x, ids, e))
        y, src2dst, _ = moe_permute_ref(x, ids, e)
        for wname, wt, out_dtype in (("wbf16", w.to(BF16), None), ("wfp32", w, BF16)):
            ub = unpermute_bytes(t, h, k, wt)
            torch._dynamo.reset()
            ind_un = torch.compile(moe_unpermute_ref, dynamic=False)
            inl_un = torch.compile(lambda y, s, w_: TRITON.moe_unpermute(y, s, w_, k, out_dtype), dynamic=False)
            time_fns({
                "eager": lambda: moe_unpermute_ref(y, src2dst, wt, k, out_dtype),
                "inductor": lambda: ind_un(y, src2dst, wt, k, out_dtype),
                "triton": lambda: TRITON.moe_unpermute(y, src2dst, wt, k, out_dtype),
                "triton_inlined": lambda: inl_un(y, src2dst, wt),
            }, ub, copy_gbs, row, f"unpermute_{wname}")
        line = " | ".join(f"{key} {v:.1f}" for key, v in row.items()
                          if isinstance(v, float) and not key.endswith(("_gbs", "_pct_copy")))
        log(f"T{t} H{h} E{e} K{k}: {line} us | permute triton {row.get('permute_triton_pct_copy', 0):.1f}% copy, "
            f"unpermute triton {row.get('unpermute_wbf16_triton_pct_copy', 0):.1f}% copy")
        rows.append(row)
    return rows


def sweep(copy_gbs: float) -> list[dict[str, Any]]:
    """GPU time per launch config: copy kernels (permute rows, unpermute) and the index kernels."""
    out = []
    copies = [mk.CopyConfig(bh, nw, hi) for bh in (512, 1024, 2048, 4096) for nw in (4, 8, 16) for hi in (1, 2)
              if not (bh == 512 and nw == 16)]
    indexes = [mk.IndexConfig(chunk=c, block_e=32, block_j=32, scan_tile=st, num_warps=nw)
               for c in (128, 256, 512) for st in (4096, 16384) for nw in (4, 8)]
    for t, h, e, k in SWEEP_SHAPES:
        x, ids, w = permuted_inputs(t, h, e, k, seed=5)
        ref = moe_permute_ref(x, ids, e)
        rows, src2dst, seg = torch.empty_like(ref[0]), torch.empty_like(ref[1]), torch.empty_like(ref[2])
        wt = w.to(BF16)
        uo = torch.empty(t, h, device="cuda", dtype=BF16)
        pb, ub = permute_bytes(t, h, k, ids), unpermute_bytes(t, h, k, wt)
        for cc in copies:
            rec: dict[str, Any] = {"T": t, "H": h, "E": e, "K": k, "kind": "copy", "cfg": str(cc)}
            try:
                mk.launch_permute(x, ids, e, rows, src2dst, seg, copy_cfg=cc)
                check_permute_equal((rows, src2dst, seg), ref, f"sweep {cc}")
                rec["permute_us"] = bench_graph_us(
                    lambda: mk.launch_permute(x, ids, e, rows, src2dst, seg, copy_cfg=cc))
                rec["permute_pct_copy"] = 100 * pb / (rec["permute_us"] * 1e-6) / 1e9 / copy_gbs
                rec["unpermute_us"] = bench_graph_us(
                    lambda: mk.launch_unpermute(ref[0], ref[1], wt, k, uo, BF16, copy_cfg=cc))
                rec["unpermute_pct_copy"] = 100 * ub / (rec["unpermute_us"] * 1e-6) / 1e9 / copy_gbs
            except Exception as exc:
                rec["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            out.append(rec)
            log("sweep", rec)
        for ic in indexes:
            rec = {"T": t, "H": h, "E": e, "K": k, "kind": "index", "cfg": str(ic)}
            try:
                mk.launch_permute(x, ids, e, rows, src2dst, seg, index_cfg=ic)
                check_permute_equal((rows, src2dst, seg), ref, f"sweep {ic}")
                rec["index_us"] = bench_graph_us(lambda: mk.launch_permute_index(ids, e, seg, ic))
                rec["permute_us"] = bench_graph_us(
                    lambda: mk.launch_permute(x, ids, e, rows, src2dst, seg, index_cfg=ic))
            except Exception as exc:
                rec["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            out.append(rec)
            log("sweep", rec)
    return out


def best(sweep_rows: list[dict[str, Any]]) -> list[list[Any]]:
    table = []
    for shape in SWEEP_SHAPES:
        mine = [r for r in sweep_rows if (r["T"], r["H"], r["E"], r["K"]) == shape and "error" not in r]
        for kind, key in (("copy", "permute_us"), ("copy", "unpermute_us"), ("index", "index_us")):
            cands = [r for r in mine if r["kind"] == kind and key in r]
            if cands:
                r = min(cands, key=lambda r: r[key])
                table.append([f"T{shape[0]} H{shape[1]} E{shape[2]} K{shape[3]}", key, r["cfg"], r[key]])
    return table


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="checks and the T4096 row only, no sweep")
    ap.add_argument("--no-sweep", action="store_true")
    args = ap.parse_args()
    start(args)
    t0 = time.time()
    res: dict[str, Any] = {"env": env_info(), "defaults": {"index": str(mk.index_config(0, 0)),
                                                            "copy_h7168": str(mk.copy_config(7168))}}
    res["copy_gbs"] = copy_bandwidth_gbs()
    log(res["env"], f"copy {res['copy_gbs']:.0f} GB/s", res["defaults"])
    res["checks"] = check_kernels()
    log(f"checks ok ({time.time() - t0:.0f}s):", res["checks"])
    write_json("moe_permute.json", res)
    if args.quick:
        GRID[:] = [(4096, 7168, 256, 8)]
    res["grid"] = time_grid(res["copy_gbs"])
    write_json("moe_permute.json", res)
    if not (args.quick or args.no_sweep):
        try:
            res["sweep"] = sweep(res["copy_gbs"])
            res["best"] = best(res["sweep"])
        except Exception:
            res["sweep_error"] = traceback.format_exc()
            log(res["sweep_error"])
        write_json("moe_permute.json", res)
    head = ["T", "H", "E", "K", "op", "eager µs", "Inductor µs", "Triton µs", "inlined µs", "Triton % copy",
            "vs Inductor"]
    rows = []
    for r in res["grid"]:
        for op in ("permute", "unpermute_wbf16", "unpermute_wfp32"):
            tri, ind = r.get(f"{op}_triton"), r.get(f"{op}_inductor")
            rows.append([r["T"], r["H"], r["E"], r["K"], op, r.get(f"{op}_eager"), ind, tri,
                         r.get(f"{op}_triton_inlined"), r.get(f"{op}_triton_pct_copy"),
                         f"{ind / tri:.2f}×" if tri and ind else None])
    md = markdown_table(head, rows)
    md += "\n\nPermute index kernels only (µs): " + ", ".join(
        f"T{r['T']}: {r.get('permute_triton_index_only', float('nan')):.1f}" for r in res["grid"])
    if res.get("best"):
        md += "\n\nBest sweep configs:\n\n" + markdown_table(["shape", "metric", "config", "µs"], res["best"])
    (out_dir() / "moe_permute.md").write_text(md + "\n")
    log(md)
    log(f"total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()

"""The ``moe_masked`` family: the local experts of a DeepEP low-latency layer, three ways, one rank.

    python bench/bench_moe_masked.py            (also ``bench/bench_moe_experts.py --masked``)

The rank's LL receive buffer ``[E_r, W*C, H]`` (C = T tokens per rank, every rank's tokens routed top-k over E
experts; expert ``e``'s rows first, padding after) runs through

* **masked**: ``moe_experts_masked`` (the Triton kernels read the buffer in place, skip tiles past each count);
* **padded**: what the EP pass ran before -- ``moe_permute`` -> ``grouped_gemm_swiglu`` -> ``grouped_gemm`` ->
  ``moe_unpermute`` over all ``E_r*W*C`` rows (ids -1 on the padding, unit weights), the Triton stage providers;
* **one GPU**: the same stages on this rank's ``T`` tokens with all ``E`` experts (the one-GPU layer's experts).

Dispatch and combine are not in these times (``bench_ep.py`` times the whole layer). Checked first: masked equals
padded on the valid rows (relative L2). On CUDA the times are CUDA-graph replays; on a CPU (``TRITON_INTERPRET=1``)
one run each at the tiny shape, a check of the wiring only. Writes ``$OUT/moe_masked.json`` / ``moe_masked.md``.
"""

from __future__ import annotations

import time
from typing import Any

import torch

SHAPES = {  # name: (T per rank, H, I, E, K, W)
    "DeepSeek-V3 decode": (128, 7168, 2048, 256, 8, 2),
    "Qwen3-30B-A3B decode": (128, 2048, 768, 128, 8, 2),
}
TINY = {"tiny": (4, 64, 32, 8, 2, 2)}


def ll_buffer(t: int, h: int, e: int, k: int, world: int, dtype: torch.dtype, device: str, seed: int = 0):
    """Rank 0's receive buffer ``x [E_r, W*T, H]``, ``counts [E_r]``, the flat ids ``[E_r*W*T, 1]`` (expert or -1)
    and unit weights, and rank 0's own tokens, ids and weights (for the one-GPU layer)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randn(world * t, h, generator=g).to(dtype)
    weights, ids = torch.randn(world * t, e, generator=g).softmax(-1).topk(k)
    e_r, m = e // world, world * t
    hit = (ids.unsqueeze(-1) == torch.arange(e_r)).any(1)  # [W*T, E_r]
    x = torch.zeros(e_r, m, h, dtype=dtype)
    counts = hit.sum(0).to(torch.int32)
    for j in range(e_r):
        rows = hit[:, j].nonzero().squeeze(1)
        x[j, : rows.numel()] = tokens[rows]
    live = torch.arange(m).unsqueeze(0) < counts.unsqueeze(1)
    flat_ids = torch.where(live, torch.arange(e_r).unsqueeze(1), -1).reshape(-1, 1)
    dev = torch.device(device)
    return (x.to(dev), counts.to(dev), flat_ids.to(dev), live.reshape(-1, 1).float().to(dev),
            tokens[:t].to(dev), ids[:t].to(dev), weights[:t].to(dev))


def stages(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The ``moe_experts`` block's stages on the Triton providers (each falls back to its reference if declined)."""
    ops = torch.ops.ep_fuse_triton
    rows, src2dst, seg = ops.moe_permute(x, ids, w13.shape[0])
    hh = ops.grouped_gemm_swiglu(rows, w13, seg)
    return ops.moe_unpermute(ops.grouped_gemm(hh, w2, seg), src2dst, w, ids.shape[1], x.dtype)


def _time_us(fn, cuda: bool) -> float:
    if cuda:
        from common import bench_graph_us

        return bench_graph_us(fn)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def run(shapes: dict[str, tuple[int, ...]], device: str) -> list[dict[str, Any]]:
    import ep_fuse.catalog  # noqa: F401  (every op and provider)
    from ep_fuse.ops.moe_masked import valid_rows
    from ep_fuse.providers.triton.moe_masked import moe_experts_masked_kernel

    cuda = device == "cuda"
    dtype = torch.bfloat16
    out = []
    for name, (t, h, inter, e, k, world) in shapes.items():
        g = torch.Generator().manual_seed(1)
        w13 = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).to(dtype).to(device)
        w2 = (torch.randn(e, h, inter, generator=g) / inter**0.5).to(dtype).to(device)
        x, counts, flat_ids, unit, own_x, own_ids, own_w = ll_buffer(t, h, e, k, world, dtype, device)
        e_r, m = x.shape[0], x.shape[1]
        lw13, lw2 = w13[:e_r].contiguous(), w2[:e_r].contiguous()
        bound = world * t * min(k, e_r)
        flat = x.reshape(e_r * m, h)

        def masked():
            return moe_experts_masked_kernel(x, counts, lw13, lw2, bound)

        def padded():
            return stages(flat, flat_ids, unit, lw13, lw2)

        def one_gpu():
            return stages(own_x, own_ids, own_w, w13, w2)

        keep = valid_rows(counts, m)
        a, b = masked()[keep].float(), padded().reshape(e_r, m, h)[keep].float()
        rel = ((a - b).norm() / b.norm().clamp(min=1e-6)).item()
        row = {"shape": name, "T": t, "E_r": e_r, "rows": e_r * m, "valid_rows": int(counts.sum()),
               "rel_l2_masked_vs_padded": rel, "masked_us": _time_us(masked, cuda), "padded_us": _time_us(padded, cuda),
               "one_gpu_us": _time_us(one_gpu, cuda)}
        row["masked_vs_padded"] = row["padded_us"] / row["masked_us"]
        row["masked_vs_one_gpu"] = row["masked_us"] / row["one_gpu_us"]
        out.append(row)
        if rel > 2e-2:
            raise AssertionError(f"{name}: masked vs padded relative L2 {rel:.2e}")
    return out


def main(argv: list[str] | None = None) -> None:
    """At the real shapes on CUDA, at the tiny shape on a CPU; the table to ``$OUT/moe_masked.md``."""
    from common import bench_parser, env_info, markdown_table, out_dir, set_json_path, write_json

    args = bench_parser(__doc__).parse_args(argv)
    set_json_path(args.json)
    cuda = torch.cuda.is_available()
    rows = run(SHAPES if cuda else TINY, "cuda" if cuda else "cpu")
    write_json("moe_masked.json", {"env": env_info(), "rows": rows})
    head = ["shape", "T", "E_r", "rows", "valid rows", "masked µs", "padded µs", "one GPU µs", "padded / masked",
            "masked / one GPU", "rel L2"]
    table = markdown_table(head, [[r["shape"], r["T"], r["E_r"], r["rows"], r["valid_rows"], r["masked_us"],
                                   r["padded_us"], r["one_gpu_us"], f"{r['masked_vs_padded']:.2f}×",
                                   f"{r['masked_vs_one_gpu']:.2f}×", f"{r['rel_l2_masked_vs_padded']:.1e}"]
                                  for r in rows])
    (out_dir() / "moe_masked.md").write_text(table + "\n")
    print(table, flush=True)


if __name__ == "__main__":
    main()

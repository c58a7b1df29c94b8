"""What one-query-row attention (decode) costs with HF's repeated K/V heads, against the query heads packed per K/V head.

HF's SDPA path repeats each K/V head ``G = q heads / kv heads`` times (``repeat_kv``: a copy) whenever it passes a
mask, and SDPA's kernels then run one program per (batch, query head) with one valid query row. With one query row
per head, the ``G`` query heads that share a K/V head can instead be the ``G`` query rows of one head: the same
softmax rows, ``G`` times fewer programs, K/V read once per group and no repeat. This times both, per decode shape
of the bench models, with and without a key mask, CUDA-graph replays (the repeat copy and the output copy included).

    PYTHONPATH=bench python experiments/2026-12/attention_gqa_cost.py
"""

from __future__ import annotations

import torch

from common import bench_graph_us

aten = torch.ops.aten
SHAPES = {  # name: (B, kv length, q heads, kv heads, head dim)
    "qwen3 64x1, no cache": (64, 1, 32, 4, 128),
    "mixtral 64x1, no cache": (64, 1, 32, 8, 128),
    "qwen3 64 rows, 1024 cached": (64, 1024, 32, 4, 128),
    "qwen3 1 row, 4096 cached": (1, 4096, 32, 4, 128),
    "mixtral 64 rows, 1024 cached": (64, 1024, 32, 8, 128),
    "qwen3 1 row, 544 cached": (1, 544, 32, 4, 128),
    "mixtral 1 row, 544 cached": (1, 544, 32, 8, 128),
    "mixtral 1 row, 4096 cached": (1, 4096, 32, 8, 128),
    "mixtral 4 rows, 544 cached": (4, 544, 32, 8, 128),
    "qwen3 8 rows, 544 cached": (8, 544, 32, 4, 128),
    "mixtral 16 rows, 2048 cached": (16, 2048, 32, 8, 128),
}


def repeated(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    b, hq, _, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    g = hq // hkv
    k = k[:, :, None].expand(b, hkv, g, n, d).reshape(b, hq, n, d)
    v = v[:, :, None].expand(b, hkv, g, n, d).reshape(b, hq, n, d)
    if bias is not None:
        bias = bias.expand(b, hq, 1, n)
    return aten._scaled_dot_product_efficient_attention(q, k, v, bias, False)[0]


def packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    b, hq, _, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    g = hq // hkv
    if bias is not None:
        bias = bias.expand(b, hkv, g, n)
    out = aten._scaled_dot_product_efficient_attention(q.view(b, hkv, g, d), k, v, bias, False)[0]
    return out.reshape(b, hq, 1, d)


def main() -> None:
    torch.manual_seed(0)
    print("| shape | mask | repeated K/V µs | packed µs | speed-up | max abs diff |")
    print("|---|---|---|---|---|---|")
    for name, (b, n, hq, hkv, d) in SHAPES.items():
        q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k = torch.randn(b, n, hkv, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        v = torch.randn(b, n, hkv, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        masks = [None]
        if n % 16 == 0:
            keep = torch.rand(b, 1, 1, n, device="cuda") < 0.9
            keep[..., 0] = True
            masks.append(torch.zeros(b, 1, 1, n, device="cuda", dtype=torch.bfloat16).masked_fill(~keep, float("-inf")))
        for bias in masks:
            ref, out = repeated(q, k, v, bias), packed(q, k, v, bias)
            t_rep = bench_graph_us(lambda: repeated(q, k, v, bias))
            t_pack = bench_graph_us(lambda: packed(q, k, v, bias))
            print(f"| {name} | {'key mask' if bias is not None else 'none'} | {t_rep:.1f} | {t_pack:.1f} | "
                  f"{t_rep / t_pack:.2f}x | {(ref.float() - out.float()).abs().max().item():.2e} |", flush=True)


if __name__ == "__main__":
    main()

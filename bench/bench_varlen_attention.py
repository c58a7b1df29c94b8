"""Continuous batching's attention, three ways in one run: HF's (SDPA over the dense ``[tokens, keys read]`` mask
its continuous batching builds, the KV heads repeated), Inductor compiling ``ep_fuse::varlen_attention``'s
reference (the same masked SDPA built from the lengths on the device), and the ``flash`` provider.

    python bench/bench_varlen_attention.py [--heads 32,8,128]

Batches: decode steps of 16 and 64 requests with 100-800 cached tokens each, and 64 decodes next to one
512-token prefill chunk (what HF schedules at 64 concurrent requests). Median of CUDA-event timings, µs per layer.
"""

from __future__ import annotations

import itertools

import torch

from common import bench_parser, bench_us, env_info, markdown_table, start, write_json


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")


def hf_masked_sdpa(q, k, v, mask, groups, scale):  # noqa: ANN001, ANN201
    """HF's SDPA path for a packed batch: [1, H, T, D] against the repeated KV heads, additive mask."""
    qh = q.transpose(0, 1).unsqueeze(0)
    kh = k.transpose(0, 1).unsqueeze(0).repeat_interleave(groups, dim=1)
    vh = v.transpose(0, 1).unsqueeze(0).repeat_interleave(groups, dim=1)
    return torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head dim")
    args = ap.parse_args()
    start(args, needs_cuda=True)
    from ep_fuse.ops.varlen_attention import varlen_attention_ref
    from ep_fuse.providers.flash.varlen_attention import varlen_attention_flash
    from transformers.generation.continuous_batching.utils import build_attention_mask

    hq, hk, d = (int(x) for x in args.heads.split(","))
    g = torch.Generator().manual_seed(0)
    batches = {
        "decode x16": ([1] * 16, [int(x) for x in torch.randint(100, 800, (16,), generator=g)]),
        "decode x64": ([1] * 64, [int(x) for x in torch.randint(100, 800, (64,), generator=g)]),
        "prefill 512 + decode x63": ([512] + [1] * 63, [0] + [int(x) for x in torch.randint(100, 800, (63,), generator=g)]),
    }
    compiled_ref = torch.compile(varlen_attention_ref, dynamic=False)
    rows = []
    for name, (lq, past) in batches.items():
        lk = [a + b for a, b in zip(lq, past)]
        t, n = sum(lq), sum(lk)
        q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(n, hk, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(n, hk, d, device="cuda", dtype=torch.bfloat16)
        mask = torch.full((1, 1, t, n), torch.finfo(torch.bfloat16).min, dtype=torch.bfloat16)
        build_attention_mask(mask, [0, *itertools.accumulate(lq)], [0, *itertools.accumulate(lk)])
        mask = mask.cuda()
        cu_q, cu_k, scale = _cu(lq), _cu(lk), d ** -0.5
        ref = varlen_attention_ref(q, k, v, cu_q, cu_k, t, n, scale).float()
        fns = {
            "hf masked sdpa": lambda: hf_masked_sdpa(q, k, v, mask, hq // hk, scale),
            "inductor (reference)": lambda: compiled_ref(q, k, v, cu_q, cu_k, t, n, scale),
            "ep_fuse flash": lambda: varlen_attention_flash(q, k, v, cu_q, cu_k, t, n, scale),
        }
        err = (varlen_attention_flash(q, k, v, cu_q, cu_k, t, n, scale).float() - ref).abs().max().item()
        times = {k_: bench_us(f) for k_, f in fns.items()}
        kv_bytes = 2 * n * hk * d * 2
        for k_, us in times.items():
            rows.append(dict(batch=name, impl=k_, us=us, vs_hf=times["hf masked sdpa"] / us,
                             kv_gb_s=kv_bytes / us / 1e3, max_err=err if k_ == "ep_fuse flash" else None))
    write_json("varlen_attention.json", dict(env=env_info(), heads=args.heads, rows=rows))
    print(env_info())
    print(markdown_table(["batch", "impl", "µs", "vs hf", "KV GB/s", "max |err|"],
                         [[r["batch"], r["impl"], f"{r['us']:.1f}", f"{r['vs_hf']:.2f}x", f"{r['kv_gb_s']:.0f}",
                           r["max_err"] and f"{r['max_err']:.1e}"] for r in rows]))


if __name__ == "__main__":
    main()

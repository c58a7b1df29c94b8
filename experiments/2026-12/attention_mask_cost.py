"""What HF's materialised attention mask costs under torch.compile, and what a proved mask-free call gains.

Without a cache or a padding mask, HF's eager SDPA path passes ``attn_mask=None, is_causal=True``; traced, it builds
the causal mask in the graph (a bool ``[B, 1, S, S]``) and SDPA takes the masked kernel. This times, per attention
shape of the bench models, each fused SDPA kernel with the bool mask and without it (``is_causal`` for the square
causal mask at prefill, no mask for the all-true one of a one-token forward), CUDA-graph replays.

    PYTHONPATH=bench python experiments/2026-12/attention_mask_cost.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from common import bench_graph_us

SHAPES = {  # name: (B, S, q heads, kv heads (repeated as HF does with a mask), qk head dim, v head dim)
    "qwen3 1x2048": (1, 2048, 32, 4, 128, 128),
    "mixtral 1x2048": (1, 2048, 32, 8, 128, 128),
    "deepseek_v3 1x2048": (1, 2048, 128, 128, 192, 128),
    "qwen3 64x1": (64, 1, 32, 4, 128, 128),
    "mixtral 64x1": (64, 1, 32, 8, 128, 128),
    "deepseek_v3 64x1": (64, 1, 128, 128, 192, 128),
}
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "flash": SDPBackend.FLASH_ATTENTION}


def main() -> None:
    torch.manual_seed(0)
    for name, (b, s, hq, hkv, dqk, dv) in SHAPES.items():
        q = torch.randn(b, s, hq, dqk, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k = torch.randn(b, s, hkv, dqk, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        v = torch.randn(b, s, hkv, dv, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
        mask = torch.ones(s, s, device="cuda", dtype=torch.bool).tril().expand(b, 1, s, s)
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=s > 1)
        causal_flops = 2 * b * hq * (s * (s + 1) // 2) * (dqk + dv)
        row = []
        for label, backend in BACKENDS.items():
            for masked in (True, False):
                kw = {"attn_mask": mask} if masked else {"is_causal": s > 1}
                try:
                    with sdpa_kernel([backend]):
                        out = F.scaled_dot_product_attention(q, k, v, **kw)
                        err = ((out.float() - ref).norm() / ref.norm()).item()
                        us = bench_graph_us(lambda: F.scaled_dot_product_attention(q, k, v, **kw))  # noqa: B023
                    row.append(f"{label}{'+mask' if masked else ''} {us:.1f}us "
                               f"({causal_flops / us / 1e6:.0f} TF/s, err {err:.1e})")
                except Exception as exc:  # a backend that does not take the shape
                    row.append(f"{label}{'+mask' if masked else ''} n/a ({type(exc).__name__})")
        print(f"{name}: " + "; ".join(row), flush=True)


if __name__ == "__main__":
    main()

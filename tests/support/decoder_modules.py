"""A hand-written decoder (attention + RMSNorm + softmax router + the canonical routed experts per layer) on
``[B, S, H]`` hidden states, for the EP overlap range split (``tests/test_ep_overlap_range.py``).

Unlike the tiny HF models, its router has a bias buffer (``router_bias``) that tests set to route unevenly or to
leave a rank without routed tokens, and its layer can hold a step that mixes the batch (``mix_batch``: the range
split must decline it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Experts(torch.nn.Module):
    """Stacked SwiGLU experts (``w13`` [E, 2I, H], ``w2`` [E, H, I]): what ``shard_experts`` slices."""

    def __init__(self, num_experts: int, hidden: int, inter: int, g: torch.Generator) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w13 = torch.nn.Parameter(torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5)
        self.w2 = torch.nn.Parameter(torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.ops.ep_fuse.moe_experts(x, ids, w, self.w13, self.w2, None)


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


class DecoderLayer(torch.nn.Module):
    def __init__(self, num_experts: int, hidden: int, heads: int, inter: int, top_k: int, seed: int,
                 mix_batch: bool = False) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.heads, self.top_k, self.mix_batch = heads, top_k, mix_batch
        self.norm1 = torch.nn.Parameter(1 + 0.1 * torch.randn(hidden, generator=g))
        self.qkv = torch.nn.Parameter(torch.randn(3 * hidden, hidden, generator=g) / hidden**0.5)
        self.o = torch.nn.Parameter(torch.randn(hidden, hidden, generator=g) / hidden**0.5)
        self.norm2 = torch.nn.Parameter(1 + 0.1 * torch.randn(hidden, generator=g))
        self.router = torch.nn.Parameter(torch.randn(num_experts, hidden, generator=g) / hidden**0.5)
        self.register_buffer("router_bias", torch.zeros(num_experts))
        self.experts = Experts(num_experts, hidden, inter, g)

    def forward(self, h: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, s, d = h.shape
        q, k, v = F.linear(_rms(h, self.norm1), self.qkv).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        h = h + F.linear(a.transpose(1, 2).reshape(b, s, d), self.o)
        if self.mix_batch:  # every sequence reads the batch mean: no batch split may reorder this
            h = h + 0.5 * h.mean(0, keepdim=True)
        x = _rms(h, self.norm2).reshape(b * s, d)
        probs = (F.linear(x, self.router) + self.router_bias).softmax(-1)
        w, ids = probs.topk(self.top_k, dim=-1)
        y = self.experts(x, ids, w / w.sum(-1, keepdim=True))
        return h + y.view(b, s, d)


class TinyDecoder(torch.nn.Module):
    """``layers`` decoder layers on ``[B, S, H]``; ``forward(h, mask=None)`` (a boolean ``[B, 1, S, S]`` mask,
    else causal)."""

    def __init__(self, num_experts: int, layers: int = 2, hidden: int = 32, heads: int = 4, inter: int = 16,
                 top_k: int = 2, mix_batch: bool = False) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            DecoderLayer(num_experts, hidden, heads, inter, top_k, seed=i, mix_batch=mix_batch and i == 0)
            for i in range(layers))

    def forward(self, h: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers:
            h = layer(h, mask)
        return h

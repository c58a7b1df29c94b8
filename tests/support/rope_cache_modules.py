"""vLLM-style rotary embedding with a cos/sin cache gathered by position (hand-written, as vLLM's native path
computes it): the modules the cache-form RoPE tests compile."""

import torch
from torch import nn


class CacheRope(nn.Module):
    """q ``[T, Hq*D]``, k ``[T, Hk*D]`` and ``positions [T]``; ``cos_sin_cache [max_pos, rot]`` (cos half, sin half).

    ``neox``: rotate the halves (``chunk``), else GPT-J pairs with an interleaved output. ``gather``: ``index_select``
    or advanced indexing. The rotated channels are always cut out and concatenated back, as vLLM does (with
    ``rot == head`` the pass-through is empty)."""

    def __init__(self, head=16, rot=None, max_pos=64, neox=True, dtype=torch.bfloat16, gather="index_select",
                 base=10000.0):
        super().__init__()
        self.head, self.rot, self.neox, self.gather = head, rot or head, neox, gather
        inv_freq = 1.0 / (base ** (torch.arange(0, self.rot, 2, dtype=torch.float) / self.rot))
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float), inv_freq)
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), -1).to(dtype), persistent=False)

    def _rotate(self, x, cos, sin):
        shape = x.shape
        x = x.view(shape[0], -1, self.head)
        xr, xp = x[..., : self.rot], x[..., self.rot:]
        cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
        if self.neox:
            x1, x2 = torch.chunk(xr, 2, dim=-1)
        else:
            x1, x2 = xr[..., ::2], xr[..., 1::2]
        o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        out = torch.cat((o1, o2), -1) if self.neox else torch.stack((o1, o2), -1).flatten(-2)
        return torch.cat((out, xp), -1).reshape(shape)

    def forward(self, positions, q, k):
        if self.gather == "index_select":
            cos_sin = self.cos_sin_cache.index_select(0, positions)
        else:
            cos_sin = self.cos_sin_cache[positions]
        cos, sin = cos_sin.chunk(2, dim=-1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)


def cache_inputs(t=9, hq=4, hk=2, head=16, max_pos=64, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, max_pos, (t,), generator=g)
    q = torch.randn(t, hq * head, generator=g).to(dtype)
    k = torch.randn(t, hk * head, generator=g).to(dtype)
    return positions, q, k

"""The code-base zoo: tiny MoE decoders written the way code bases other than Hugging Face write them.

Each form is a whole decoder -- token embedding, 2 layers of (RMSNorm -> causal self-attention with RoPE ->
residual add -> RMSNorm -> MoE block -> residual add), final RMSNorm, LM head -- with hidden 64, 4 heads, 8
experts, top-2, expert intermediate 32 and vocabulary 128 unless its docstring says otherwise, and
``forward(tokens [B, S] int64) -> logits [B, S, V]``. The attention, RoPE and RMSNorm of each follow its code
base's style too. The modules are written from descriptions of each style, not copied.

* :data:`FORMS`: name -> decoder class; :func:`build` makes one (random deterministic weights, eval mode);
  :func:`tokens` its input (each form has its own batch and length).
* :func:`measure`: eager, :func:`ep_fuse.prepare`, ``torch.compile(backend="ep_fuse")``, and what came of it
  (:class:`Measured`: the error against eager, graphs, fused sites per pattern, what ``prepare`` logged).

Pinned in ``tests/test_moe_zoo.py`` (CPU) and ``tests/gpu/test_gpu_moe_zoo.py`` (CUDA, against Inductor).
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, HIDDEN, HEADS, EXPERTS, TOP_K, INTER, LAYERS = 128, 64, 4, 8, 2, 32, 2
HEAD_DIM = HIDDEN // HEADS
MAX_SEQ = 64
PATTERNS = ("moe_experts", "moe_gating", "add_rms_norm", "rms_norm", "rope", "gemm_swiglu")
"""The patterns :func:`measure` counts sites of."""


# --------------------------------------------------------------------------- the decoder skeleton
class _Decoder(nn.Module):
    """Embedding -> ``LAYERS`` layers -> final norm -> LM head. A form gives its layer and norm classes and
    :meth:`context` (what its layers need besides the hidden states: RoPE tables, a mask)."""

    batch, seq = 2, 8
    """The input :func:`tokens` makes for this form."""

    def __init__(self, layer: type[nn.Module], norm: type[nn.Module]) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(layer() for _ in range(LAYERS))
        self.norm = norm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def context(self, seq: int) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        ctx = self.context(tokens.size(1))
        for layer in self.layers:
            h = layer(h, *ctx)
        return self.head(self.norm(h))


def _stacked(*shape: int) -> nn.Parameter:
    """An expert weight stack of ``shape`` (values set by :func:`build`)."""
    return nn.Parameter(torch.empty(*shape))


# =========================================================================== 1. gathered_einsum
class _FastNorm(nn.Module):
    """Upcast to fp32, normalise with ``mean(x * x)``, cast back, then the weight."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _normed(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._normed(x.float()).type_as(x) * self.weight


def _pair_table(seq: int, dim: int, base: float = 10000.0) -> torch.Tensor:
    """``[seq, dim / 2, 2]``: cos and sin of each position's angle per channel pair."""
    inv = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
    angles = torch.outer(torch.arange(seq).float(), inv)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def _rotate_pairs(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs ``(x0, x1)`` of ``x [B, S, H, D]`` in fp32 (real arithmetic)."""
    xp = x.float().reshape(*x.shape[:-1], -1, 2)
    t = table.view(1, xp.size(1), 1, xp.size(3), 2)
    rotated = torch.stack([xp[..., 0] * t[..., 0] - xp[..., 1] * t[..., 1],
                           xp[..., 1] * t[..., 0] + xp[..., 0] * t[..., 1]], dim=-1)
    return rotated.flatten(3).type_as(x)


class _FastAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wqkv = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.wo = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor, table: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.wqkv(x).split([HIDDEN, HIDDEN, HIDDEN], dim=-1)
        q, k, v = (t.view(b, s, HEADS, HEAD_DIM) for t in (q, k, v))
        q, k = _rotate_pairs(q, table), _rotate_pairs(k, table)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        return self.wo(y.transpose(1, 2).contiguous().view(b, s, HIDDEN))


class _GatheredFFN(nn.Module):
    """Stacked experts whose weights are gathered per token: ``w1[ids]`` is ``[T, A, I, D]``."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = _stacked(EXPERTS, INTER, HIDDEN)
        self.w2 = _stacked(EXPERTS, HIDDEN, INTER)
        self.w3 = _stacked(EXPERTS, INTER, HIDDEN)

    def forward(self, x: torch.Tensor, expert_indices: torch.Tensor) -> torch.Tensor:
        gate_w, up_w, down_w = self.w1[expert_indices], self.w3[expert_indices], self.w2[expert_indices]
        gate = F.silu(torch.einsum("ti,taoi->tao", x, gate_w))
        up = torch.einsum("ti,taoi->tao", x, up_w)
        return torch.einsum("tao,taio->tai", gate * up, down_w)


class _EinsumMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.cond_ffn = _GatheredFFN()
        self.num_activated = TOP_K

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(-1, HIDDEN)
        probs = F.softmax(self.gate(x), dim=-1)
        weights, indices = torch.topk(probs, self.num_activated, dim=-1)
        weights /= weights.sum(dim=-1, keepdim=True)
        outs = self.cond_ffn(x, indices)
        return torch.einsum("tai,ta->ti", outs, weights)


class _FastBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = _FastAttention()
        self.feed_forward = _EinsumMoE()
        self.attention_norm = _FastNorm(HIDDEN)
        self.ffn_norm = _FastNorm(HIDDEN)

    def forward(self, x: torch.Tensor, table: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), table, mask)
        return h + self.feed_forward(self.ffn_norm(h))  # [1, T, D] + [T, D]: a broadcast add


class GatheredEinsumDecoder(_Decoder):
    """gpt-fast style (batch-1 decoding code).

    Experts are stacked ``w1 [E, I, D]``, ``w2 [E, D, I]``, ``w3 [E, I, D]`` in a ``cond_ffn`` module that
    gathers the weights **per token** (``w1[ids]`` -> ``[T, A, I, D]``) and applies them with ``einsum``;
    the router is softmax -> top-k -> in-place renormalise, the combine ``einsum('tai,ta->ti')``. The block
    returns ``[T, D]``, added to the ``[1, T, D]`` residual (a broadcast add): batch 1 only. RoPE rotates
    adjacent channel pairs with real arithmetic in fp32; RMSNorm upcasts and casts back before the weight.
    """

    batch, seq = 1, 16

    def __init__(self) -> None:
        super().__init__(_FastBlock, _FastNorm)
        self.register_buffer("freqs", _pair_table(MAX_SEQ, HEAD_DIM), persistent=False)
        self.register_buffer("causal", torch.ones(MAX_SEQ, MAX_SEQ, dtype=torch.bool).tril(), persistent=False)

    def context(self, seq: int) -> tuple[torch.Tensor, ...]:
        return self.freqs[:seq], self.causal[:seq, :seq]


# =========================================================================== 2. modulelist_where
class _RefNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps)`` in fp32, cast back to the input dtype, times the weight."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def _polar_table(seq: int, dim: int, theta: float = 10000.0) -> torch.Tensor:
    """``[seq, dim / 2]`` complex64 unit rotations."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim))
    angles = torch.outer(torch.arange(seq).float(), inv)
    return torch.polar(torch.ones_like(angles), angles)


def _complex_rotary(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """``x [B, S, H, D]`` times ``freqs_cis [S, D / 2]`` as complex numbers (channel pairs)."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs_cis[None, :, None, :]).flatten(3).type_as(x)


class _SwiGLU(nn.Module):
    """``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, hidden: int = HIDDEN, inter: int = INTER) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _RefAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.wk = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.wv = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.wo = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        xq = self.wq(x).view(b, s, HEADS, HEAD_DIM)
        xk = self.wk(x).view(b, s, HEADS, HEAD_DIM)
        xv = self.wv(x).view(b, s, HEADS, HEAD_DIM)
        xq, xk = _complex_rotary(xq, freqs_cis), _complex_rotary(xk, freqs_cis)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2),
                                             is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, HIDDEN))


class _WhereMoE(nn.Module):
    """Top-k of the gate **logits**, softmax of the K values, then each expert on its rows via ``torch.where``."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(_SwiGLU() for _ in range(EXPERTS))
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.num_experts_per_tok = TOP_K

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        gate_logits = self.gate(inputs)
        weights, selected = torch.topk(gate_logits, self.num_experts_per_tok)
        weights = F.softmax(weights, dim=1, dtype=torch.float).to(inputs.dtype)
        results = torch.zeros_like(inputs)
        for i, expert in enumerate(self.experts):
            rows, nth = torch.where(selected == i)
            results[rows] += weights[rows, nth, None] * expert(inputs[rows])
        return results


class _RefBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = _RefAttention()
        self.feed_forward = _WhereMoE()
        self.attention_norm = _RefNorm(HIDDEN)
        self.ffn_norm = _RefNorm(HIDDEN)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        packed = self.ffn_norm(h).view(-1, HIDDEN)  # the MoE works on packed tokens [T, D]
        return h + self.feed_forward(packed).view_as(h)


class ModuleListWhereDecoder(_Decoder):
    """Vendor reference style (mistral-inference's MoE layer).

    ``experts`` is an ``nn.ModuleList`` of SwiGLU MLPs (``w1``/``w2``/``w3`` bias-free ``nn.Linear``), the gate
    an ``nn.Linear``; tokens are packed ``[T, D]`` (the layer flattens around the block); routing takes the
    top-k of the **logits** and then ``softmax(dtype=float).to(x.dtype)`` of the K values; each expert runs on
    its rows found by ``torch.where(selected == i)`` and is added into ``results[rows]`` (data-dependent:
    Dynamo breaks the graph). RoPE multiplies complex numbers (``view_as_complex``, ``torch.polar`` table).
    """

    def __init__(self) -> None:
        super().__init__(_RefBlock, _RefNorm)
        self.register_buffer("freqs_cis", _polar_table(MAX_SEQ, HEAD_DIM), persistent=False)

    def context(self, seq: int) -> tuple[torch.Tensor, ...]:
        return (self.freqs_cis[:seq],)


# =========================================================================== 3. linear_subclass_grouped
GROUPED_EXPERTS, GROUPED_TOP_K, N_GROUPS, TOPK_GROUPS, ROUTE_SCALE = 16, 4, 4, 2, 2.5


def _linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T``; a 1-byte weight is dequantized with its per-row ``scale`` first."""
    if scale is not None:
        weight = weight.to(x.dtype) * scale.to(x.dtype)[:, None]
    return F.linear(x, weight)


class QLinear(nn.Module):
    """The code base's own linear layer: a ``weight`` Parameter and, for 1-byte (quantized) weights, a
    per-row ``scale``; ``forward`` is :func:`_linear`. Not an ``nn.Linear``."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        if self.weight.element_size() == 1:
            self.scale = nn.Parameter(torch.ones(out_features))
        else:
            self.register_parameter("scale", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(x, self.weight, self.scale)


class _FnNorm(nn.Module):
    """``F.rms_norm`` with a weight."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (self.dim,), self.weight, self.eps)


def _rotary_to(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Complex RoPE that remembers the dtype and casts back at the end."""
    dtype = x.dtype
    xc = torch.view_as_complex(x.float().view(*x.shape[:-1], -1, 2))
    y = torch.view_as_real(xc * freqs_cis.view(1, xc.size(1), 1, xc.size(-1))).flatten(3)
    return y.to(dtype)


class _EinsumAttention(nn.Module):
    """Scores and the weighted sum with ``einsum``; an additive ``-inf`` mask; softmax in fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.wq = QLinear(HIDDEN, HIDDEN)
        self.wk = QLinear(HIDDEN, HIDDEN)
        self.wv = QLinear(HIDDEN, HIDDEN)
        self.wo = QLinear(HIDDEN, HIDDEN)
        self.softmax_scale = HEAD_DIM ** -0.5

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = _rotary_to(self.wq(x).view(b, s, HEADS, HEAD_DIM), freqs_cis)
        k = _rotary_to(self.wk(x).view(b, s, HEADS, HEAD_DIM), freqs_cis)
        v = self.wv(x).view(b, s, HEADS, HEAD_DIM)
        scores = torch.einsum("bshd,bthd->bsht", q, k) * self.softmax_scale
        scores = scores + mask.unsqueeze(1)
        scores = scores.softmax(dim=-1, dtype=torch.float32).type_as(x)
        out = torch.einsum("bsht,bthd->bshd", scores, v)
        return self.wo(out.flatten(2))


class _GroupGate(nn.Module):
    """Sigmoid scores, a selection-only bias, group-limited top-k (group score: sum of its top-2),
    weights from the un-biased scores, renormalised and scaled."""

    def __init__(self) -> None:
        super().__init__()
        self.topk, self.n_groups, self.topk_groups, self.route_scale = (GROUPED_TOP_K, N_GROUPS, TOPK_GROUPS,
                                                                        ROUTE_SCALE)
        self.weight = nn.Parameter(torch.empty(GROUPED_EXPERTS, HIDDEN))
        self.bias = nn.Parameter(torch.empty(GROUPED_EXPERTS))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = _linear(x, self.weight).sigmoid()
        original_scores = scores
        scores = scores + self.bias
        scores = scores.view(x.size(0), self.n_groups, -1)
        group_scores = scores.topk(2, dim=-1)[0].sum(dim=-1)
        top_groups = group_scores.topk(self.topk_groups, dim=-1)[1]
        mask = scores.new_ones(x.size(0), self.n_groups, dtype=torch.bool).scatter_(1, top_groups, False)
        scores = scores.masked_fill_(mask.unsqueeze(-1), float("-inf")).flatten(1)
        indices = torch.topk(scores, self.topk, dim=-1)[1]
        weights = original_scores.gather(1, indices)
        weights /= weights.sum(dim=-1, keepdim=True)
        weights *= self.route_scale
        return weights.type_as(x), indices


class _QExpert(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.w1 = QLinear(hidden, inter)
        self.w2 = QLinear(inter, hidden)
        self.w3 = QLinear(hidden, inter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _GroupedMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n_routed_experts = GROUPED_EXPERTS
        self.gate = _GroupGate()
        self.experts = nn.ModuleList(_QExpert(HIDDEN, INTER) for _ in range(GROUPED_EXPERTS))
        self.shared_experts = _QExpert(HIDDEN, 2 * INTER)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.size()
        x = x.view(-1, HIDDEN)
        weights, indices = self.gate(x)
        y = torch.zeros_like(x)
        counts = torch.bincount(indices.flatten(), minlength=self.n_routed_experts).tolist()
        for i in range(self.n_routed_experts):
            if counts[i] == 0:
                continue
            rows, top = torch.where(indices == i)
            y[rows] += self.experts[i](x[rows]) * weights[rows, top, None]
        z = self.shared_experts(x)
        return (y + z).view(shape)


class _QBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _EinsumAttention()
        self.ffn = _GroupedMoE()
        self.attn_norm = _FnNorm(HIDDEN)
        self.ffn_norm = _FnNorm(HIDDEN)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), freqs_cis, mask)
        return x + self.ffn(self.ffn_norm(x))


class LinearSubclassGroupedDecoder(_Decoder):
    """DeepSeek-V3 inference-reference style (its ``model.py``, with plain multi-head attention).

    Every projection is the code base's own :class:`QLinear` (a ``weight`` Parameter and an optional
    ``scale``, for quantized checkpoints; not an ``nn.Linear``); the ``Gate`` is ``sigmoid(F.linear(x, w))``
    plus a selection-only bias, group-limited (``n_groups=4``, ``topk_groups=2``, group score = sum of its
    top-2) with the group mask built by ``new_ones(T, G).scatter_(1, top, False)`` on the grouped
    ``[T, G, E/G]`` view, ``-inf`` fill, ``flatten(1)``, top-k, weights gathered from the un-biased sigmoid
    scores, renormalised, ``* route_scale`` (2.5). E=16, top-4. The block counts tokens per expert with
    ``bincount(...).tolist()`` (a graph break), skips empty experts and adds ``expert(x[rows]) * w`` into
    ``y[rows]``; a dense shared SwiGLU expert (intermediate 64) is added. Norms are ``F.rms_norm``;
    attention uses ``einsum`` with an additive mask and an fp32 softmax; RoPE is complex.
    """

    def __init__(self) -> None:
        super().__init__(_QBlock, _FnNorm)
        self.head = QLinear(HIDDEN, VOCAB)
        self.register_buffer("freqs_cis", _polar_table(MAX_SEQ, HEAD_DIM), persistent=False)

    def context(self, seq: int) -> tuple[torch.Tensor, ...]:
        mask = torch.full((seq, seq), float("-inf"), device=self.freqs_cis.device).triu_(1)
        return self.freqs_cis[:seq], mask


# =========================================================================== 4. argsort_grouped_mm
def _scatter_add_rows(out: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """A copy of ``out [N, D]`` with each row ``src[j]`` added into row ``index[j]``."""
    return out.index_add(0, index, src.to(out.dtype))


def _scatter_add_rows_fake(out: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(out)


if not hasattr(torch.ops.zoo, "scatter_add_rows"):  # this file may be imported under two module names
    torch.library.custom_op("zoo::scatter_add_rows", mutates_args=())(_scatter_add_rows).register_fake(
        _scatter_add_rows_fake)


class _CosSinRope(nn.Module):
    """Holds ``cos | sin`` (``[MAX_SEQ, 2 * head_dim]``, the halves repeated) in one buffer."""

    def __init__(self, dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        inv = 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim))
        angles = torch.outer(torch.arange(MAX_SEQ).float(), inv)
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cache", torch.cat([angles.cos(), angles.sin()], dim=-1), persistent=False)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _apply_half_rope(q: torch.Tensor, k: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, S, H, D]`` q and k, ``cache [S, 2D]``: ``x * cos + rotate_half(x) * sin`` in the cache dtype."""
    cos = cache[..., :HEAD_DIM].unsqueeze(0).unsqueeze(2)
    sin = cache[..., HEAD_DIM:].unsqueeze(0).unsqueeze(2)
    return (q * cos + _rotate_half(q) * sin).type_as(q), (k * cos + _rotate_half(k) * sin).type_as(k)


class _TitanAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.wk = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.wv = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.wo = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, HEAD_DIM)
        xk = self.wk(x).view(bs, seqlen, -1, HEAD_DIM)
        xv = self.wv(x).view(bs, seqlen, -1, HEAD_DIM)
        xq, xk = _apply_half_rope(xq, xk, rope_cache)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2),
                                             is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class _TokenChoiceRouter(nn.Module):
    """Softmax scores in fp32, top-k of ``scores + expert_bias`` (selection only), weights gathered from the
    scores and renormalised; also returns the tokens routed to each expert (an auxiliary count)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.register_buffer("expert_bias", torch.zeros(EXPERTS))
        self.top_k = TOP_K

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scores = F.softmax(self.gate(x).float(), dim=1)
        _, selected = torch.topk(scores + self.expert_bias, k=self.top_k, dim=1)
        top_scores = scores.gather(dim=1, index=selected)
        top_scores = top_scores / top_scores.sum(dim=-1, keepdim=True)
        load = torch.zeros_like(scores).scatter_add(1, selected, torch.ones_like(top_scores)).sum(0)
        return top_scores, selected, load


class _GroupedExperts(nn.Module):
    """``w1 [E, D, I]``, ``w2 [E, I, D]``, ``w3 [E, D, I]`` run by ``torch._grouped_mm`` on bf16 copies."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = _stacked(EXPERTS, HIDDEN, INTER)
        self.w2 = _stacked(EXPERTS, INTER, HIDDEN)
        self.w3 = _stacked(EXPERTS, HIDDEN, INTER)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        xb = x.bfloat16()
        h = F.silu(torch._grouped_mm(xb, self.w1.bfloat16(), offs=offsets))
        h = h * torch._grouped_mm(xb, self.w3.bfloat16(), offs=offsets)
        return torch._grouped_mm(h, self.w2.bfloat16(), offs=offsets).type_as(x)


class _TitanMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = _TokenChoiceRouter()
        self.experts = _GroupedExperts()
        self.num_experts, self.top_k = EXPERTS, TOP_K

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        top_scores, selected, _load = self.router(x)
        flat = selected.view(-1)
        order = torch.argsort(flat, stable=True)
        token_idx = order // self.top_k
        counts = torch.histc(flat.float(), bins=self.num_experts, min=0, max=self.num_experts - 1)
        offsets = torch.cumsum(counts, dim=0).to(torch.int32)
        routed = torch.gather(x, dim=0, index=token_idx.reshape(-1, 1).expand(-1, dim))
        routed = self.experts(routed, offsets)
        routed = (routed.float() * top_scores.view(-1)[order].unsqueeze(-1)).to(x.dtype)
        out = torch.ops.zoo.scatter_add_rows(torch.zeros_like(x), token_idx, routed)
        return out.view(bs, slen, dim)


class _TitanBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = _TitanAttention()
        self.moe = _TitanMoE()
        self.attention_norm = nn.RMSNorm(HIDDEN, eps=1e-6)
        self.ffn_norm = nn.RMSNorm(HIDDEN, eps=1e-6)

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cache)
        return h + self.moe(self.ffn_norm(h))


class ArgsortGroupedMMDecoder(_Decoder):
    """Training-framework style (torchtitan's token-choice MoE).

    A router module: ``nn.Linear`` gate, fp32 softmax scores, ``expert_bias [E]`` buffer added for the
    selection only (weights gathered from the scores, renormalised) and a load count built on
    ``torch.zeros_like(scores)`` (computed, not used by the block). Dispatch: ``argsort(ids.view(-1),
    stable=True)``, rows gathered with ``torch.gather`` on ``token_idx.reshape(-1, 1).expand(-1, D)``, counts
    by ``histc``, offsets ``cumsum(counts).to(int32)``; experts ``w1 [E, D, I]``, ``w2 [E, I, D]``,
    ``w3 [E, D, I]`` run by ``torch._grouped_mm`` on **bf16 copies** even in an fp32 model; the weighted rows
    are combined by ``zoo::scatter_add_rows`` (a ``torch.library`` custom op) into ``zeros_like(x)``. Norms are
    ``nn.RMSNorm``; RoPE is rotate-half on a ``cos | sin`` cache buffer.
    """

    def __init__(self) -> None:
        super().__init__(_TitanBlock, lambda dim: nn.RMSNorm(dim, eps=1e-6))
        self.rope = _CosSinRope(HEAD_DIM)

    def context(self, seq: int) -> tuple[torch.Tensor, ...]:
        return (self.rope.cache[:seq],)


# =========================================================================== 5. dense_bmm_all_experts
class _AllExpertsMoE(nn.Module):
    """Every expert on every token with ``bmm``. ``input_scaled=False``: the router's sigmoid scores
    (top-k values scattered into ``-inf``, so unselected experts weigh 0) multiply the expert **outputs**;
    ``True``: they multiply the expert **inputs**, ``expert(score * x)`` (not a weighted combine)."""

    def __init__(self, top_k: int, input_scaled: bool) -> None:
        super().__init__()
        self.top_k, self.input_scaled = top_k, input_scaled
        self.router_DE = nn.Parameter(torch.empty(HIDDEN, EXPERTS))
        self.moe_w_in_eD_F = _stacked(EXPERTS, HIDDEN, INTER)
        self.moe_w_swiglu_eD_F = _stacked(EXPERTS, HIDDEN, INTER)
        self.moe_w_out_eF_D = _stacked(EXPERTS, INTER, HIDDEN)
        self.shared_expert = _SwiGLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, slen, dim = x.shape
        a = x.view(-1, dim)
        logits = a @ self.router_DE
        top_vals, top_ids = torch.topk(logits, self.top_k, dim=1)
        scores = torch.full_like(logits, float("-inf")).scatter_(1, top_ids, top_vals)
        scores = torch.sigmoid(scores.float()).to(a.dtype).t()  # [E, T]
        routed = a.unsqueeze(0).repeat(EXPERTS, 1, 1)  # [E, T, D]
        if self.input_scaled:
            routed = routed * scores.unsqueeze(-1)
        h = F.silu(torch.bmm(routed, self.moe_w_in_eD_F)) * torch.bmm(routed, self.moe_w_swiglu_eD_F)
        y = torch.bmm(h, self.moe_w_out_eF_D)  # [E, T, D]
        out = y.sum(0) if self.input_scaled else (scores[..., None] * y).sum(0)
        return (out + self.shared_expert(a)).view(bsz, slen, dim)


class _AllExpertsBlock(nn.Module):
    input_scaled, top_k = False, TOP_K

    def __init__(self) -> None:
        super().__init__()
        self.attention = _RefAttention()
        self.feed_forward = _AllExpertsMoE(self.top_k, self.input_scaled)
        self.attention_norm = _RefNorm(HIDDEN)
        self.ffn_norm = _RefNorm(HIDDEN)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class _InputScaledBlock(_AllExpertsBlock):
    input_scaled, top_k = True, 1


class DenseBmmAllExpertsDecoder(_Decoder):
    """Llama-4 reference style, routed top-k computed densely.

    The router weight is stored transposed (``router_DE [D, E]``, ``logits = x @ router_DE``); the top-k
    values are scattered into ``full_like(logits, -inf)`` and passed through ``sigmoid``, so unselected experts
    weigh 0; the experts ``w1 [E, D, I]``, ``w3 [E, D, I]``, ``w2 [E, I, D]`` run with ``torch.bmm`` on ``x``
    repeated to ``[E, T, D]`` and the scores multiply their **outputs** (``(scores[..., None] * y).sum(0)``):
    a genuine routed top-2 MoE, computed on every expert. A shared SwiGLU expert is added. RMSNorm upcasts and
    casts back; RoPE is complex.
    """

    block: type[nn.Module] = _AllExpertsBlock

    def __init__(self) -> None:
        super().__init__(self.block, _RefNorm)
        self.register_buffer("freqs_cis", _polar_table(MAX_SEQ, HEAD_DIM), persistent=False)

    def context(self, seq: int) -> tuple[torch.Tensor, ...]:
        return (self.freqs_cis[:seq],)


class DenseBmmInputScaledDecoder(DenseBmmAllExpertsDecoder):
    """Llama-4 reference style as the reference writes it: top-1, and the sigmoid score multiplies the expert
    **input** (``expert(score * x)``, summed over experts; unselected experts see zeros and give 0). That is not
    a weighted combine of expert outputs (SwiGLU is not linear in its input), so no MoE rewrite may bind it:
    a recogniser must decline it with a reason. Otherwise as :class:`DenseBmmAllExpertsDecoder`.
    """

    block = _InputScaledBlock


# =========================================================================== 6. logits3d_sort_disabled
@torch._dynamo.disable
def grouped_expert_mlp(rows: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor,
                       w_down: torch.Tensor) -> torch.Tensor:
    """Expert-sorted ``rows``, ``counts [E]``: each expert's SwiGLU MLP on its slice (a host loop, Dynamo off)."""
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        n = int(n)
        if n == 0:
            continue
        gate, up = (rows[start:start + n] @ w_gate_up[e]).chunk(2, dim=-1)
        outs.append((F.silu(gate) * up) @ w_down[e])
        start += n
    return torch.cat(outs)


class _HalfNorm(nn.Module):
    """Variance in fp32; the weight multiplies the result cast back to the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        dtype = hidden.dtype
        hidden = hidden.to(torch.float32)
        variance = hidden.pow(2).mean(-1, keepdim=True)
        hidden = hidden * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden.to(dtype)


class _InlineRopeAttention(nn.Module):
    """Fused ``qkv`` projection; cos/sin computed in each forward from ``inv_freq``; rotate-half by
    ``cat(-x2, x1)``."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.register_buffer("inv_freq", 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4).unbind(0)  # [B, H, S, D]
        t = torch.arange(s, device=x.device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        q, k = (self._rope(t_, cos, sin) for t_ in (q, k))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, HIDDEN))

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2:]
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class _SortedMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.w_gate_up = _stacked(EXPERTS, HIDDEN, 2 * INTER)
        self.w_down = _stacked(EXPERTS, INTER, HIDDEN)
        self.k = TOP_K

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)  # [B, S, E]
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        weights, ids = probs.topk(self.k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        flat_x = x.reshape(-1, x.size(-1))
        flat_ids = ids.reshape(-1)
        _, order = torch.sort(flat_ids)
        token_of = order // self.k
        rows = flat_x.index_select(0, token_of)
        counts = torch.zeros(EXPERTS, dtype=torch.int64, device=x.device).scatter_add_(
            0, flat_ids, torch.ones_like(flat_ids))
        y = grouped_expert_mlp(rows, counts, self.w_gate_up, self.w_down)
        y = y * weights.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
        out = torch.zeros_like(flat_x).index_add_(0, token_of, y)
        return out.view_as(x)


class _SortedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = _HalfNorm(HIDDEN)
        self.attn = _InlineRopeAttention()
        self.ln_2 = _HalfNorm(HIDDEN)
        self.moe = _SortedMoE()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.moe(self.ln_2(x))


class Logits3dSortDisabledDecoder(_Decoder):
    """Research-code style (a sort-based MoE with a hand-rolled grouped GEMM).

    The router gives **3-D** ``[B, S, E]`` logits and the block keeps ``[B, S, D]``; softmax (fp32), top-k,
    renormalise; dispatch by ``torch.sort`` of the flat ids and ``index_select``, scattered back with
    ``index_add_``; the expert GEMMs (``w_gate_up [E, D, 2I]``, ``w_down [E, I, D]``) are a helper decorated
    ``@torch._dynamo.disable`` that loops over experts on ``.tolist()`` counts, so Dynamo breaks the graph
    around it. RMSNorm (variance in fp32, weight times the cast-back result); RoPE is rotate-half with cos/sin
    computed in each forward.
    """

    def __init__(self) -> None:
        super().__init__(_SortedBlock, _HalfNorm)

    def context(self, seq: int) -> tuple[torch.Tensor, ...]:
        return ()


# =========================================================================== 7. dense_mask_loop
class _PlainNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * weight`` in the input dtype (no upcast)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class _MaskedAttention(nn.Module):
    """Explicit ``q @ k^T``, ``masked_fill`` of the upper triangle, fp32 softmax; chunk-form RoPE."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.k_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.v_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.o_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, HEADS, HEAD_DIM).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(HEAD_DIM)
        att = att.masked_fill(causal, float("-inf"))
        att = F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype)
        return self.o_proj((att @ v).transpose(1, 2).reshape(b, s, HIDDEN))


class _GateUpExpert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up = nn.Linear(HIDDEN, 2 * INTER, bias=False)
        self.down = nn.Linear(INTER, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class _DenseMaskMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = nn.ModuleList(_GateUpExpert() for _ in range(EXPERTS))
        self.top_k = TOP_K

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.view(-1, HIDDEN)
        scores = torch.sigmoid(self.router(flat))
        weights, ids = torch.topk(scores, self.top_k, dim=-1)
        dense_w = torch.zeros(flat.size(0), EXPERTS, dtype=weights.dtype, device=flat.device).scatter(1, ids, weights)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            out = out + dense_w[:, e:e + 1] * expert(flat)
        return out.view_as(x)


class _DenseMaskBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = _PlainNorm(HIDDEN)
        self.attn = _MaskedAttention()
        self.norm2 = _PlainNorm(HIDDEN)
        self.mlp = _DenseMaskMoE()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, causal)
        return x + self.mlp(self.norm2(x))


class DenseMaskLoopDecoder(_Decoder):
    """Small research / tutorial code style: a routed top-k MoE computed densely through a weight matrix.

    Router ``sigmoid`` -> top-k, no renormalisation; the K weights are scattered into a dense ``[T, E]`` matrix
    (``zeros(T, E).scatter(1, ids, w)``), and a Python loop over an ``nn.ModuleList`` of experts with a **fused**
    ``gate_up`` Linear (``[2I, D]``, chunked into gate and up) runs every expert on all tokens and adds
    ``dense_w[:, e:e+1] * expert(x)`` (unselected experts weigh 0). No data-dependent step: one graph today.
    RMSNorm without an upcast; attention with an explicit ``masked_fill`` causal mask and an fp32 softmax;
    chunk-form RoPE (``cat([x1 cos - x2 sin, x2 cos + x1 sin])``) on cos/sin tables of the half width.
    """

    def __init__(self) -> None:
        super().__init__(_DenseMaskBlock, _PlainNorm)
        inv = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
        angles = torch.outer(torch.arange(MAX_SEQ).float(), inv)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        self.register_buffer("upper", torch.ones(MAX_SEQ, MAX_SEQ, dtype=torch.bool).triu(1), persistent=False)

    def context(self, seq: int) -> tuple[torch.Tensor, ...]:
        return self.cos[:seq], self.sin[:seq], self.upper[:seq, :seq]


# --------------------------------------------------------------------------- registry, building, measuring
FORMS: dict[str, type[_Decoder]] = {
    "gathered_einsum": GatheredEinsumDecoder,
    "modulelist_where": ModuleListWhereDecoder,
    "linear_subclass_grouped": LinearSubclassGroupedDecoder,
    "argsort_grouped_mm": ArgsortGroupedMMDecoder,
    "dense_bmm_all_experts": DenseBmmAllExpertsDecoder,
    "dense_bmm_input_scaled": DenseBmmInputScaledDecoder,
    "logits3d_sort_disabled": Logits3dSortDisabledDecoder,
    "dense_mask_loop": DenseMaskLoopDecoder,
}
"""Form name -> decoder class (docstring: the style it follows, what is unusual about it)."""

SELECTION_BIASES = ("bias", "expert_bias")
"""1-D tensors that only shift the expert selection: small random values, so that they matter."""


def build(name: str, dtype: torch.dtype = torch.float32, seed: int = 0,
          device: str | torch.device = "cpu") -> _Decoder:
    """The decoder of form ``name`` with random weights drawn from ``seed`` (the same on every call), in eval
    mode, its real tensors cast to ``dtype`` (complex RoPE tables stay complex64), moved to ``device``."""
    if name not in FORMS:
        raise KeyError(f"unknown zoo form {name!r}; one of {sorted(FORMS)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = FORMS[name]()
    g = torch.Generator().manual_seed(seed)
    params = {id(p) for p in model.parameters()}
    with torch.no_grad():
        for pname, t in [*model.named_parameters(), *model.named_buffers()]:
            leaf = pname.rsplit(".", 1)[-1]
            if t.dim() == 1 and "norm" in pname:
                t.copy_(1 + 0.1 * torch.randn(t.shape, generator=g))
            elif t.dim() == 1 and leaf in SELECTION_BIASES:
                t.copy_(0.05 * torch.randn(t.shape, generator=g))
            elif id(t) in params and t.dim() >= 2:  # buffers (RoPE tables, masks) keep their values
                t.copy_(torch.randn(t.shape, generator=g) * (1.0 if pname == "embed.weight" else 0.125))
    # real tensors only: ``Module.to(dtype)`` would also cast complex RoPE tables to real, dropping the rotation
    return model._apply(lambda t: t.to(device, dtype) if t.is_floating_point() else t.to(device)).eval()


def tokens(name: str, seed: int = 0, device: str | torch.device = "cpu") -> torch.Tensor:
    """Input token ids ``[B, S]`` of form ``name`` (batch 1 for the forms whose block assumes it)."""
    cls = FORMS[name]
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(0, VOCAB, (cls.batch, cls.seq), generator=g).to(device)


@dataclasses.dataclass
class Measured:
    """What :func:`measure` saw for one form."""

    name: str
    dtype: torch.dtype
    executor: str
    rel_diff: float
    """``max |compiled - eager| / max |eager|`` over the logits."""
    graphs: int
    """Graphs ep_fuse compiled for the first forward (``len(ep_fuse.reports())``)."""
    sites: dict[str, int]
    """Fused sites per pattern of :data:`PATTERNS`, summed over the graphs."""
    prepare_log: list[str]
    """What ``ep_fuse.prepare`` logged (``"LEVEL: message"``)."""
    near_misses: list[str] = dataclasses.field(default_factory=list)
    eager_vs_fp32: float | None = None
    """Low-precision runs: ``‖eager - fp32 eager‖ / ‖fp32 eager‖`` over the logits (the dtype's own error)."""
    compiled_vs_fp32: float | None = None
    """Low-precision runs: ``‖compiled - fp32 eager‖ / ‖fp32 eager‖``."""
    eager_tokens_vs_fp32: list[float] = dataclasses.field(default_factory=list)
    """Low-precision runs: the same per token (each token's logits)."""
    compiled_tokens_vs_fp32: list[float] = dataclasses.field(default_factory=list)
    """Low-precision runs: ``‖compiled - fp32 eager‖ / ‖fp32 eager‖`` per token."""
    stable_tokens_vs_fp32: list[float] = dataclasses.field(default_factory=list)
    """Low-precision runs: eager again with every ``topk`` tie kept at the lowest index (:class:`_StableTopk`), per
    token against fp32. ``torch.topk`` breaks an exact tie at the selection boundary in an unspecified order (its
    CPU partial sort takes either index), the fused router at the lowest index; bf16 logits tie often (8 mantissa
    bits), and whether a run ties depends on the machine's bf16 GEMM rounding. Both runs are the model's."""

    def counts(self) -> dict[str, int]:
        """``graphs`` and the site counts, in the keys of the zoo's pins."""
        return {"graphs": self.graphs, **self.sites}

    def line(self) -> str:
        """One line for a table of today's numbers (``prepare``'s own messages only)."""
        dt = str(self.dtype).removeprefix("torch.")
        sites = " ".join(f"{k}={v}" for k, v in self.sites.items())
        said = " | ".join(dict.fromkeys(m for m in self.prepare_log if "ep_fuse.prepare:" in m)) or "-"
        vs32 = "" if self.eager_vs_fp32 is None else \
            f" vs fp32: eager {self.eager_vs_fp32:.2e}, compiled {self.compiled_vs_fp32:.2e};"
        return f"{self.name} {dt}: graphs={self.graphs} {sites} rel={self.rel_diff:.2e};{vs32} prepare: {said}"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname}: {record.getMessage()}")


class _StableTopk(torch.overrides.TorchFunctionMode):
    """``topk`` with ties kept at the lowest index (a stable sort), otherwise what ``torch.topk`` returns."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        kwargs = kwargs or {}
        if func not in (torch.topk, torch.Tensor.topk):
            return func(*args, **kwargs)
        x, k = args[0], (args[1] if len(args) > 1 else kwargs["k"])
        dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
        largest = args[3] if len(args) > 3 else kwargs.get("largest", True)
        values, order = x.sort(dim=dim, descending=largest, stable=True)
        return torch.return_types.topk((values.narrow(dim, 0, k).contiguous(), order.narrow(dim, 0, k).contiguous()))


def measure(name: str, dtype: torch.dtype = torch.float32, executor: str = "eager", seed: int = 0,
            device: str | torch.device = "cpu", **options: object) -> Measured:
    """Build form ``name``, run it eagerly, ``ep_fuse.prepare`` it (recording what it logs), compile it with
    ``torch.compile(backend="ep_fuse", options={"executor": executor, **options})``, run it on the same tokens,
    and return the error against eager, the number of graphs and the fused sites (Dynamo is reset before and
    after, and ep_fuse's reports cleared)."""
    import ep_fuse

    torch._dynamo.reset()
    ep_fuse.reset_reports()
    model = build(name, dtype, seed, device)
    ids = tokens(name, seed, device)
    with torch.no_grad():
        ref = model(ids)
    logger = logging.getLogger("ep_fuse")
    handler, level = _Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        ep_fuse.prepare(model)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    compiled = torch.compile(model, backend="ep_fuse", options={"executor": executor, **options})
    with torch.no_grad():
        out = compiled(ids)
    reps = ep_fuse.reports()
    torch._dynamo.reset()
    sites = {p: sum(r.count(p) for r in reps) for p in PATTERNS}
    diff = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    misses = [m.explain() for r in reps for m in r.near_misses]
    eager32 = compiled32 = None
    if dtype != torch.float32:  # the fp32 model on the same tokens: both low-precision runs measured against it
        with torch.no_grad():
            ref32 = build(name, torch.float32, seed, device)(ids).float()
            with _StableTopk():
                stable = build(name, dtype, seed, device)(ids)  # a fresh model: `prepare` has changed this one
        eager32 = float((ref.float() - ref32).norm() / ref32.norm())
        compiled32 = float((out.float() - ref32).norm() / ref32.norm())
        per_token = [((v.float() - ref32).norm(dim=-1) / ref32.norm(dim=-1)).flatten().tolist()
                     for v in (ref, out, stable)]
    else:
        per_token = [[], [], []]
    return Measured(name, dtype, executor, diff, len(reps), sites, handler.lines, misses, eager32, compiled32,
                    *per_token)

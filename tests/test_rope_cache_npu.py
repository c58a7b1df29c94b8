"""Ascend ``npu_mrope`` provider of rope_cache / rope_qk_cache against the torch_npu test double (no Ascend here)."""

import pytest
import torch
from support.norm_cases import ulp_close

from ep_fuse.ops import choose
from ep_fuse.ops import rope as rope_ops
from ep_fuse.ops.rope import CACHE_FORMS, rope_cache_ref, rope_qk_cache_ref
from ep_fuse.providers.npu import rope as npu_rope

BF16 = torch.bfloat16
MAX_POS = 64


def _cache(rot: int, dtype: torch.dtype, base: float = 10000.0) -> torch.Tensor:
    """vLLM's cos_sin_cache: ``[max_pos, rot]``, cos of every position's angles, then their sin."""
    inv_freq = 1.0 / base ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)
    ang = torch.outer(torch.arange(MAX_POS, dtype=torch.float32), inv_freq)
    return torch.cat((ang.cos(), ang.sin()), -1).to(dtype)


def _heads(t: int, h: int, d: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    return torch.randn(t, h, d, generator=g).to(dtype)


def _positions(t: int) -> torch.Tensor:
    """Out of order, with repeats (a batch of decode tokens mixed with a prefill chunk)."""
    return torch.tensor([5, 0, 63, 5, 17, 1, 1, 40, 2, 33, 0][:t] + list(range(t - 11)), dtype=torch.int64)


def _qk_args(form, dtype, d=64, rot=64, hq=4, hk=1, t=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (_heads(t, hq, d, dtype, g), _heads(t, hk, d, dtype, g), _cache(rot, dtype), _positions(t), form, rot)


@pytest.mark.parametrize("rot", [64, 32], ids=["full", "partial"])
@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize("form", CACHE_FORMS)
def test_npu_rope_qk_cache_matches_reference(torch_npu_double, form, dtype, rot):
    args = _qk_args(form, dtype, rot=rot)
    choice = choose(rope_ops.rope_qk_cache, args, "npu")
    assert choice.provider == "npu", choice.declined
    ref = rope_qk_cache_ref(*args)
    for out in (npu_rope.rope_qk_cache_kernel(*args), choice.op(*args)):
        for o, e, x in zip(out, ref, args[:2]):
            assert o.shape == x.shape and o.dtype == x.dtype
            ulp_close(o, e, dtype)  # npu_mrope rounds once; the reference rounds each product and sum
            assert torch.equal(o[..., rot:], x[..., rot:])  # pass-through channels untouched


@pytest.mark.parametrize("rot", [64, 32], ids=["full", "partial"])
@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize("form", CACHE_FORMS)
def test_npu_rope_cache_matches_reference(torch_npu_double, form, dtype, rot):
    x, _k, cache, pos, _form, _rot = _qk_args(form, dtype, rot=rot, hq=3)
    args = (x, cache, pos, form, rot)
    choice = choose(rope_ops.rope_cache, args, "npu")
    assert choice.provider == "npu", choice.declined
    ref = rope_cache_ref(*args)
    for out in (npu_rope.rope_cache_kernel(*args), choice.op(*args)):
        assert out.shape == x.shape
        ulp_close(out, ref, dtype)


def test_npu_rope_qk_cache_strided_qkv_split(torch_npu_double):
    """q and k as views of one fused qkv projection (row stride wider than heads*head_dim), int32 positions."""
    t, hq, hk, d = 11, 4, 2, 32
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=torch.Generator().manual_seed(1)).to(BF16)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hk) * d].view(t, hk, d)
    args = (q, k, _cache(d, BF16), _positions(t).to(torch.int32), "chunk", d)
    assert npu_rope.rope_cache_supports(args) is None
    for o, e in zip(npu_rope.rope_qk_cache_kernel(*args), rope_qk_cache_ref(*args)):
        ulp_close(o, e, BF16)


def _declined(op, args) -> str:
    choice = choose(op, args, "npu")
    assert choice.provider == "reference"
    (name, reason), = choice.declined
    assert name == "npu"
    assert reason == npu_rope.rope_cache_supports(args)
    return reason


def test_npu_rope_cache_declines(torch_npu_double):
    q, k, cache, pos, form, rot = _qk_args("chunk", BF16)
    # sglang's native fallback: bf16 heads with an fp32 cache (npu_mrope needs one dtype)
    assert "cos_sin_cache dtype" in _declined(rope_ops.rope_qk_cache, (q, k, cache.float(), pos, form, rot))
    # [B, S, H, D] heads with [B, S] positions: npu_mrope takes 1-D positions
    x4, pos2 = q.view(1, 11, 4, 64), pos.view(1, 11)
    assert "1-D positions" in _declined(rope_ops.rope_cache, (x4, cache, pos2, form, rot))
    assert "[tokens, heads, head_dim]" in _declined(rope_ops.rope_cache, (x4, cache, pos, form, rot))
    # more than 4096 channels per token, for q or for k
    wide = torch.zeros(11, 33, 128, dtype=BF16)
    big = (wide, k[..., :1].expand(11, 1, 128).contiguous(), _cache(128, BF16), pos, form, 128)
    assert "> 4096" in _declined(rope_ops.rope_qk_cache, big)
    assert "> 4096" in _declined(rope_ops.rope_qk_cache, (big[1], *big[:1], *big[2:]))
    # heads not viewable as [T, H*D]
    xt = q.transpose(0, 1).contiguous().transpose(0, 1)
    assert "cannot be viewed" in _declined(rope_ops.rope_cache, (xt, cache, pos, form, rot))
    assert "form" in _declined(rope_ops.rope_cache, (q, cache, pos, "half", rot))


def test_double_enforces_documented_limits(torch_npu_double):
    t, d = 4, 32
    q, k, pos = torch.zeros(t, 2 * d, dtype=BF16), torch.zeros(t, d, dtype=BF16), torch.arange(t)
    cache = _cache(d, BF16)
    torch.ops.npu.npu_mrope(pos, q, k, cache, d, mrope_section=[0, 0, 0])
    with pytest.raises(RuntimeError, match="share a dtype"):
        torch.ops.npu.npu_mrope(pos, q, k, cache.float(), d, mrope_section=[0, 0, 0])
    with pytest.raises(RuntimeError, match="<= 4096"):
        wide = torch.zeros(t, 4096 + d, dtype=BF16)
        torch.ops.npu.npu_mrope(pos, wide, k, cache, d, mrope_section=[0, 0, 0])
    with pytest.raises(RuntimeError, match="1-D integer positions"):
        torch.ops.npu.npu_mrope(pos.view(1, t), q, k, cache, d, mrope_section=[0, 0, 0])

"""Ascend RoPE family: ``npu_rotary_mul`` and, in the cos/sin-cache form, ``npu_mrope`` (conventions:
:mod:`ep_fuse.providers.npu`)."""

from __future__ import annotations

from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ep_fuse.ops import rope as ops
from ep_fuse.ops.registry import register_provider
from ep_fuse.ops.rope import CACHE_FORMS
from ep_fuse.providers.npu.provider import available, contracts, devices, torch_npu


# --------------------------------------------------------------------------- RoPE
# npu_rotary_mul(x, r1, r2, rotary_mode): x*r1 + rotate(x)*r2, "half": rotate = (-x2, x1);
# "interleave": (x[2i], x[2i+1]) -> (-x[2i+1], x[2i]). 3-D/4-D, even head dim < 896.
ROPE_MODES = {"half": "half", "chunk": "half", "interleave": "interleave", "complex": "interleave"}


def rope_supports(args: tuple[Any, ...]) -> str | None:
    xs = args[:2] if len(args) == 7 else args[:1]
    cos, _sin, form, rot_dim, out_dtype = args[-5:]
    if form not in ROPE_MODES:
        return f"no documented torch_npu op produces the {form} layout"
    for x in xs:
        if x.dim() not in (3, 4):
            return "npu_rotary_mul takes 3-D or 4-D heads"
        d = x.shape[-1]
        if rot_dim != d:
            return "partial rotary (npu_rotary_mul rotates the whole head)"
        if d % 2 or d >= 896:
            return f"head dim {d} (npu_rotary_mul needs an even head dim < 896)"
        if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return f"head dtype {x.dtype}"
    if form != "complex" and (cos.dtype != xs[0].dtype or args[-4].dtype != xs[0].dtype):
        return "cos/sin dtype differs from the heads'"
    if form == "complex" and cos.dtype != torch.complex64:
        return "freqs_cis is not complex64"
    return None


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor | None, form: str, out_dtype: Any) -> torch.Tensor:
    mul = torch_npu().npu_rotary_mul
    if form == "half":
        return mul(x, cos, sin, rotary_mode="half")
    if form == "chunk":  # [x1 c - x2 s, x2 c + x1 s] is rotate-half with c, s repeated over both halves
        return mul(x, torch.cat((cos, cos), -1), torch.cat((sin, sin), -1), rotary_mode="half")
    if form == "interleave":  # GPT-J pairs: the interleave rotation with c_j, s_j repeated over each pair
        return mul(x, torch.repeat_interleave(cos, 2, dim=-1), torch.repeat_interleave(sin, 2, dim=-1),
                   rotary_mode="interleave")
    # complex: pairs (x[2j], x[2j+1]) times freqs[j] in fp32 == interleave rotation with repeated c, s
    r1 = torch.repeat_interleave(cos.real, 2, dim=-1)
    r2 = torch.repeat_interleave(cos.imag, 2, dim=-1)
    y = mul(x.to(torch.float32), r1, r2, rotary_mode="interleave")
    return y.to(out_dtype) if out_dtype is not None else y


def rope_kernel(x, cos, sin, form, rot_dim, out_dtype):  # noqa: ANN001, ANN201 - schema-typed
    return _rotary(x, cos, sin, form, out_dtype)


def rope_qk_kernel(q, k, cos, sin, form, rot_dim, out_dtype):  # noqa: ANN001, ANN201
    return _rotary(q, cos, sin, form, out_dtype), _rotary(k, cos, sin, form, out_dtype)


register_provider(ops.rope, "npu", rope_kernel, devices=devices, available=available, supports=rope_supports,
                  contracts=contracts("npu_rotary_mul"))
register_provider(ops.rope_qk, "npu", rope_qk_kernel, devices=devices, available=available,
                  supports=rope_supports, contracts=contracts("npu_rotary_mul"))


# --------------------------------------------------------------------------- RoPE, cos/sin-cache form
# npu_mrope(positions, q2, k2, cos_sin_cache, head_size, mrope_section=[0, 0, 0], rotary_mode) is the twin of
# vLLM's rotary_embedding: q2/k2 [T, heads*head_size], 1-D positions, cache [max_pos, rot_dim] in q's dtype.
# sglang falls back to native beyond 4096 channels per token; so do we (for q and k).
MROPE_MODES = {"chunk": "half", "interleave": "interleave"}
MROPE_MAX_WIDTH = 4096


def rope_cache_supports(args: tuple[Any, ...]) -> str | None:
    """None if ``npu_mrope`` computes this ``rope_cache`` / ``rope_qk_cache`` call, else why not."""
    *xs, cache, positions, form, rot_dim = args
    if form not in CACHE_FORMS:
        return f"no npu_mrope rotary_mode for the cache form {form!r}"
    if positions.dtype not in (torch.int32, torch.int64):
        return f"positions dtype {positions.dtype} is not int32/int64"
    if positions.dim() != 1:
        return f"npu_mrope with mrope_section [0, 0, 0] takes 1-D positions, got {list(positions.shape)}"
    if cache.dim() != 2 or not statically_known_true(cache.shape[-1] == rot_dim):
        return f"cos_sin_cache is not a [max_pos, {rot_dim}] matrix"
    d = xs[0].shape[-1]
    if rot_dim <= 0 or rot_dim % 2 or not statically_known_true(rot_dim <= d):
        return f"rot_dim {rot_dim} is not even and in (0, head dim {d}]"
    for x in xs:
        if x.dim() != 3:
            return f"npu_mrope takes [tokens, heads, head_dim]; got a {x.dim()}-D input (token dims not flattened)"
        if x.dtype not in (torch.float16, torch.bfloat16, torch.float32) or x.dtype != xs[0].dtype:
            return f"head dtype {x.dtype} (q and k must share fp16/bf16/fp32)"
        if cache.dtype != x.dtype:
            return f"cos_sin_cache dtype {cache.dtype} differs from the heads' {x.dtype} (npu_mrope needs one dtype)"
        t, h, hd = x.shape
        if not statically_known_true(hd == d):
            return "q and k head dims differ (npu_mrope takes one head_size)"
        if not statically_known_true(positions.shape[0] == t):
            return f"positions of shape {list(positions.shape)} do not match the {t} tokens"
        if statically_known_true(t == 0):
            return "empty input"
        if not statically_known_true(h * d <= MROPE_MAX_WIDTH):
            return f"heads*head_dim {h}*{d} > {MROPE_MAX_WIDTH} (sglang falls back to native there)"
        rows = statically_known_true(h == 1) or statically_known_true(x.stride(-2) == d)
        if not (rows and statically_known_true(x.stride(-1) == 1)):
            return "heads cannot be viewed as [tokens, heads*head_dim] (channel/head strides are not contiguous)"
    return None


def _mrope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cache: torch.Tensor, form: str
           ) -> tuple[torch.Tensor, torch.Tensor]:
    t, _h, d = q.shape
    qy, ky = torch_npu().npu_mrope(positions.to(torch.int64), q.view(t, -1), k.view(k.shape[0], -1), cache, d,
                              mrope_section=[0, 0, 0], rotary_mode=MROPE_MODES[form])
    return qy.view(q.shape), ky.view(k.shape)


def rope_cache_kernel(x, cos_sin_cache, positions, form, rot_dim):  # noqa: ANN001, ANN201 - schema-typed
    """``npu_mrope`` needs a key: we pass a fresh copy of x's first head ([T, 1, D]) and drop its output.

    Cheaper than passing x as both query and key (one extra head instead of H), and no aliased inputs.
    """
    y, _ = _mrope(positions, x, x[:, :1].contiguous(), cos_sin_cache, form)
    return y


def rope_qk_cache_kernel(q, k, cos_sin_cache, positions, form, rot_dim):  # noqa: ANN001, ANN201
    """q and k in one ``npu_mrope`` call (k may have fewer heads)."""
    return _mrope(positions, q, k, cos_sin_cache, form)


register_provider(ops.rope_cache, "npu", rope_cache_kernel, devices=devices, available=available,
                  supports=rope_cache_supports, contracts=contracts("npu_mrope"))
register_provider(ops.rope_qk_cache, "npu", rope_qk_cache_kernel, devices=devices, available=available,
                  supports=rope_cache_supports, contracts=contracts("npu_mrope"))

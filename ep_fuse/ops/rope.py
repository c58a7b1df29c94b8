"""The RoPE family: ``ep_fuse::rope``, ``rope_qk``, ``rope_cache`` and ``rope_qk_cache`` (schemas and pure-torch
references, which are the semantics and the test oracles)."""

from __future__ import annotations

import torch

from ep_fuse.ops.registry import define_canonical

ROPE_FORMS = ("half", "chunk", "deinterleave", "interleave", "complex", "rotate_pairs", "rotate_pairs_fp32")
"""How the first ``rot_dim`` channels of a head rotate (``docs/patterns.md``, RoPE):

* ``half`` (rotate-half / NeoX): ``x·cos + cat(-x2, x1)·sin``; cos/sin span ``rot_dim``;
* ``chunk`` (GPT-OSS): ``cat(x1·c − x2·s, x2·c + x1·s)``; c/s span ``rot_dim / 2``;
* ``deinterleave`` (DeepSeek-V3 ``rope_interleave``): the same on ``x[0::2], x[1::2]``, output de-interleaved;
* ``interleave`` (GPT-J, vLLM ``is_neox=False``): the same pairs, output interleaved
  (``stack((x1·c − x2·s, x2·c + x1·s), -1).flatten(-2)``);
* ``rotate_pairs`` (HF GLM / Cohere ``rotate_half``): the GPT-J pairs written with a rotated copy of the
  head, ``x·c2 + stack((−x[1::2], x[0::2]), -1).flatten(-2)·s2`` with ``c2 = c.repeat_interleave(2, -1)``
  (c/s span ``rot_dim / 2``): the values of ``interleave``, the output laid out like ``x`` (an
  element-wise result, where ``interleave``'s ``stack`` is contiguous);
* ``rotate_pairs_fp32`` (HF Ernie 4.5 / Ernie 4.5-MoE, HY-V4-VL, "glm rope style and full precision"):
  ``(x.float()·c2 + rotate_pairs(x).float()·s2).to(out_dtype)``: the pairs of ``rotate_pairs`` computed in
  fp32 (cos/sin in fp32 or in the heads' dtype, promoted), one rounding at the end;
* ``complex`` (DeepSeek-V2, Llama4): pairs ``(x[2j], x[2j+1])`` times ``freqs_cis[j]`` in fp32, interleaved
  output; ``cos`` is the complex ``freqs_cis`` and ``sin`` is ``None``.

Channels from ``rot_dim`` on pass through (partial rotary). Products and sums are rounded to the
input dtype where the model code rounds them (every op of the half/chunk/deinterleave forms).
"""


def rope_ref(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor | None,
    form: str,
    rot_dim: int,
    out_dtype: torch.dtype | None,
) -> torch.Tensor:
    """Rotary embedding of ``x`` (heads in the last dim), spelled as the HF model code spells it."""
    if form not in ROPE_FORMS:
        raise ValueError(f"ep_fuse rope: form {form!r} is not one of {ROPE_FORMS}")
    d = x.shape[-1]
    if rot_dim <= 0 or rot_dim > d or rot_dim % 2:
        raise ValueError(f"ep_fuse rope: rot_dim {rot_dim} must be even and in (0, {d}]")
    if (sin is None) != (form == "complex"):
        raise ValueError(f"ep_fuse rope: form {form!r} {'takes no' if form == 'complex' else 'needs'} sin")
    h = rot_dim // 2
    xr = x if rot_dim == d else x[..., :rot_dim]
    if form == "complex":
        xf = xr.to(torch.float32)
        xc = torch.view_as_complex(xf.view(*xf.shape[:-1], h, 2))
        out = torch.view_as_real(xc * cos).view(xr.shape)
        out = out.to(out_dtype) if out_dtype is not None else out
    elif form == "half":
        out = xr * cos + torch.cat((-xr[..., h:], xr[..., :h]), -1) * sin
    elif form == "rotate_pairs":
        rotated = torch.stack((-xr[..., 1::2], xr[..., 0::2]), -1).flatten(-2)
        out = xr * cos.repeat_interleave(2, -1) + rotated * sin.repeat_interleave(2, -1)
    elif form == "rotate_pairs_fp32":
        if rot_dim != d:
            raise ValueError("ep_fuse rope: form 'rotate_pairs_fp32' rotates the whole head")
        rotated = torch.stack((-xr[..., 1::2], xr[..., 0::2]), -1).flatten(-2)
        out = (xr.float() * cos.repeat_interleave(2, -1)) + (rotated.float() * sin.repeat_interleave(2, -1))
        out = out.to(out_dtype) if out_dtype is not None else out
    else:
        if form == "chunk":
            x1, x2 = torch.split(xr, h, -1)
        else:
            x1, x2 = xr[..., 0::2], xr[..., 1::2]
        pair = (x1 * cos - x2 * sin, x2 * cos + x1 * sin)
        out = torch.stack(pair, -1).flatten(-2) if form == "interleave" else torch.cat(pair, -1)
    if rot_dim < d:
        out = torch.cat((out, x[..., rot_dim:]), -1)
    return out


def rope_qk_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor | None,
    form: str,
    rot_dim: int,
    out_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rope_ref` of q and of k with the same cos/sin (one launch for both in fused providers)."""
    return rope_ref(q, cos, sin, form, rot_dim, out_dtype), rope_ref(k, cos, sin, form, rot_dim, out_dtype)


CACHE_FORMS = ("chunk", "interleave")
"""RoPE forms of the cos/sin-cache ops: vLLM's ``is_neox=True`` (halves) and ``is_neox=False`` (GPT-J pairs)."""


def cache_cos_sin(x: torch.Tensor, cos_sin_cache: torch.Tensor, positions: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``positions`` from a ``[max_pos, rot_dim]`` cache (cos half, then sin half), in
    ``x``'s dtype, with a size-1 head dim before the channels (``[*positions.shape, 1, rot_dim/2]``)."""
    half = cos_sin_cache.shape[-1] // 2
    rows = cos_sin_cache.index_select(0, positions.reshape(-1)).view(*positions.shape, 1, 2 * half)
    return rows[..., :half].to(x.dtype), rows[..., half:].to(x.dtype)


def rope_cache_ref(x: torch.Tensor, cos_sin_cache: torch.Tensor, positions: torch.Tensor, form: str,
                   rot_dim: int) -> torch.Tensor:
    """:func:`rope_ref` of ``x [*T, H, D]`` with cos/sin gathered from ``cos_sin_cache`` by ``positions``
    (``[*T]``, or anything that broadcasts to it), as vLLM's native ``RotaryEmbedding`` computes it."""
    if form not in CACHE_FORMS:
        raise ValueError(f"ep_fuse rope_cache: form {form!r} is not one of {CACHE_FORMS}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[-1] != rot_dim:
        raise ValueError(f"ep_fuse rope_cache: cos_sin_cache must be [max_pos, {rot_dim}], got "
                         f"{list(cos_sin_cache.shape)}")
    cos, sin = cache_cos_sin(x, cos_sin_cache, positions)
    return rope_ref(x, cos, sin, form, rot_dim, None)


def rope_qk_cache_ref(q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, positions: torch.Tensor,
                      form: str, rot_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rope_cache_ref` of q and of k (one launch in fused providers, like vLLM's ``rotary_embedding``)."""
    return (rope_cache_ref(q, cos_sin_cache, positions, form, rot_dim),
            rope_cache_ref(k, cos_sin_cache, positions, form, rot_dim))


ROPE_SCHEMA = "(Tensor x, Tensor cos, Tensor? sin, str form, int rot_dim, ScalarType? out_dtype) -> Tensor"
ROPE_QK_SCHEMA = (
    "(Tensor q, Tensor k, Tensor cos, Tensor? sin, str form, int rot_dim, ScalarType? out_dtype) -> (Tensor, Tensor)"
)

rope = define_canonical("rope", ROPE_SCHEMA, rope_ref)
"""``rope(x, cos, sin, form, rot_dim, out_dtype)``: see :func:`ep_fuse.ops.rope.rope_ref`."""

rope_qk = define_canonical("rope_qk", ROPE_QK_SCHEMA, rope_qk_ref)
"""``rope_qk(q, k, ...) -> (q', k')``: q and k rotated with one cos/sin."""

rope_cache = define_canonical(
    "rope_cache", "(Tensor x, Tensor cos_sin_cache, Tensor positions, str form, int rot_dim) -> Tensor", rope_cache_ref)
"""``rope_cache(x [*T, H, D], cos_sin_cache [max_pos, rot_dim], positions [*T], form, rot_dim)``: RoPE with
cos/sin gathered by position (vLLM's cache form): see :func:`ep_fuse.ops.rope.rope_cache_ref`."""

rope_qk_cache = define_canonical(
    "rope_qk_cache",
    "(Tensor q, Tensor k, Tensor cos_sin_cache, Tensor positions, str form, int rot_dim) -> (Tensor, Tensor)",
    rope_qk_cache_ref)
"""``rope_qk_cache(q, k, ...) -> (q', k')``: q and k rotated with one cache gather."""

"""Ascend provider: ``npu_rms_norm`` / ``npu_add_rms_norm`` / ``npu_rotary_mul`` / ``npu_mrope`` (op-contracts.md
§1-§3, §9).

Conventions used (from the op-plugin docs; **not run on Ascend hardware by this project**; every call is checked
against torch_npu 2.14.0's schema and meta function: ``docs/npu.md``):

* ``npu_rms_norm(x, gamma, epsilon) -> (y, rstd)``: statistics in fp32, ``y = cast(x * rstd * gamma)``
  rounded once; (x, gamma) dtypes fp16/fp16, bf16/bf16, fp32/fp32, fp16/fp32, bf16/fp32.
* ``npu_add_rms_norm(x1, x2, gamma, epsilon) -> (y, rstd, x1 + x2)``; gamma has x1's dtype; it
  normalises the unrounded fp32 sum.

* ``npu_mrope(positions, q, k, cos_sin_cache, head_size, mrope_section=[0,0,0], rotary_mode)``: cos/sin
  gathered by 1-D positions, q/k ``[T, heads*head_size]``, cache in q's dtype, rounded once (assumed).

* ``npu_swiglu(x, dim=-1)``: ``silu(A)·B`` over the halves of x (A first), after one GEMM over the
  gate|up weights concatenated once per weight pair.

So the NPU result can differ from the HF ``llama`` order (round ``n``, then multiply) by one bf16/fp16
ulp; calls whose output dtype or gamma dtype the ops cannot produce are declined (reference runs).
"""

from __future__ import annotations

import collections
import functools
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.multiprocessing.reductions import StorageWeakRef

from ep_fuse import npu_runtime
from ep_fuse.ops import canonical
from ep_fuse.ops.reference import CACHE_FORMS
from ep_fuse.ops.registry import register_provider
from ep_fuse.providers.common import (
    check_norm_call,
    host_eps,
    rms_norm_out_dtype,
    unpack_norm_args,
)
from ep_fuse.symbolic import known, same_shape

_available = npu_runtime.available
_npu = npu_runtime.torch_npu
contracts = npu_runtime.contracts


def _devices() -> frozenset[str]:
    return frozenset({"npu"})


def supports(args: tuple[Any, ...]) -> str | None:
    reason = check_norm_call(args)
    if reason:
        return reason
    x, residual, (weight, _eps, _eps_t, mode, upcast, out_dtype) = unpack_norm_args(args)
    if not 1 <= x.dim() <= 8:
        return "npu_rms_norm takes 1-D to 8-D inputs"
    if known(x.numel() == 0):  # a symbolic size may be empty at run time: re-checked per call
        return "npu_(add_)rms_norm rejects empty tensors"
    if rms_norm_out_dtype(x, weight, mode, upcast, out_dtype) != x.dtype:
        return "the NPU ops return the input dtype; this call produces another"
    gamma_dtype = _gamma_dtype(x, weight, mode)
    if residual is not None and gamma_dtype != x.dtype:
        return f"npu_add_rms_norm needs gamma in {x.dtype}, this call needs {gamma_dtype}"
    if residual is None and gamma_dtype not in (x.dtype, torch.float32):
        return f"npu_rms_norm does not take ({x.dtype}, {gamma_dtype}) inputs"
    return None


def _gamma_dtype(x: torch.Tensor, weight: torch.Tensor | None, mode: str) -> torch.dtype:
    if mode == "gemma":
        return torch.float32 if x.dtype != torch.float32 else x.dtype
    return weight.dtype if weight is not None else x.dtype


def gamma(x: torch.Tensor, weight: torch.Tensor | None, mode: str) -> torch.Tensor:
    """The ``gamma`` the NPU op multiplies by for ``mode``."""
    if mode == "gemma":
        assert weight is not None
        return weight.to(torch.float32) + 1.0
    if mode == "none":
        return _ones(x.shape[-1], x.dtype, x.device)
    assert weight is not None
    return weight


@functools.lru_cache(maxsize=64)
def _ones(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.ones(n, dtype=dtype, device=device)


def rms_norm_kernel(x, weight, eps, eps_t, mode, upcast, out_dtype):  # noqa: ANN001, ANN201 - schema-typed
    y, _rstd = _npu().npu_rms_norm(x, gamma(x, weight, mode), epsilon=host_eps(eps, eps_t))
    return y


def add_rms_norm_kernel(x, residual, weight, eps, eps_t, mode, upcast, out_dtype):  # noqa: ANN001, ANN201
    y, _rstd, s = _npu().npu_add_rms_norm(x, residual, gamma(x, weight, mode), epsilon=host_eps(eps, eps_t))
    return y, s


register_provider(canonical.rms_norm, "npu", rms_norm_kernel, devices=_devices, available=_available,
                  supports=supports, contracts=contracts("npu_rms_norm"))
register_provider(canonical.add_rms_norm, "npu", add_rms_norm_kernel, devices=_devices, available=_available,
                  supports=supports, contracts=contracts("npu_add_rms_norm"))


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
    mul = _npu().npu_rotary_mul
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


register_provider(canonical.rope, "npu", rope_kernel, devices=_devices, available=_available, supports=rope_supports,
                  contracts=contracts("npu_rotary_mul"))
register_provider(canonical.rope_qk, "npu", rope_qk_kernel, devices=_devices, available=_available,
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
    qy, ky = _npu().npu_mrope(positions.to(torch.int64), q.view(t, -1), k.view(k.shape[0], -1), cache, d,
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


register_provider(canonical.rope_cache, "npu", rope_cache_kernel, devices=_devices, available=_available,
                  supports=rope_cache_supports, contracts=contracts("npu_mrope"))
register_provider(canonical.rope_qk_cache, "npu", rope_qk_cache_kernel, devices=_devices, available=_available,
                  supports=rope_cache_supports, contracts=contracts("npu_mrope"))


# --------------------------------------------------------------------------- GEMM + SwiGLU
# One GEMM over the concatenated [2I, H] gate|up weight, then npu_swiglu(y, dim=-1) = silu(y[:I]) * y[I:].
# The concatenation is made once per pair of weight tensors (and remade if either is modified in place). Keyed
# on the weights' storages by weak reference (a freed weight's address is never mistaken for a new weight's),
# offsets, shapes, strides and dtype; inference tensors track no version and count as never modified.
_CONCAT: collections.OrderedDict[tuple[Any, ...], tuple[tuple[int, int], torch.Tensor]] = collections.OrderedDict()
_CONCAT_MAX = 256


def _weight_key(w: torch.Tensor) -> tuple[Any, ...]:
    return (StorageWeakRef(w.untyped_storage()), w.storage_offset(), tuple(w.shape), w.stride(), w.dtype)


def _version(w: torch.Tensor) -> int:
    return -1 if w.is_inference() else w._version


def concat_weights(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    key = (_weight_key(w_gate), _weight_key(w_up))
    version = (_version(w_gate), _version(w_up))
    hit = _CONCAT.get(key)
    if hit is not None and hit[0] == version:
        _CONCAT.move_to_end(key)
        return hit[1]
    cat = torch.cat((w_gate, w_up), dim=0)
    _CONCAT[key] = (version, cat)
    _CONCAT.move_to_end(key)
    for stale in [k for k in _CONCAT if k[0][0].expired() or k[1][0].expired()]:
        del _CONCAT[stale]
    while len(_CONCAT) > _CONCAT_MAX:
        _CONCAT.popitem(last=False)
    return cat


def gemm_swiglu_supports(args: tuple[Any, ...]) -> str | None:
    x, w_gate, w_up = args
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32) or w_gate.dtype != x.dtype:
        return f"dtype {x.dtype} / {w_gate.dtype}"
    if w_gate.dim() != 2 or not same_shape(w_up.shape, w_gate.shape):
        return "weights are not two [I, H] matrices of one shape"
    if known(x.numel() == 0):
        return "npu_swiglu rejects empty tensors"
    return None


def gemm_swiglu_kernel(x, w_gate, w_up):  # noqa: ANN001, ANN201 - schema-typed
    y = torch.matmul(x, concat_weights(w_gate, w_up).t())
    return _npu().npu_swiglu(y, dim=-1)


register_provider(canonical.gemm_swiglu, "npu", gemm_swiglu_kernel, devices=_devices, available=_available,
                  supports=gemm_swiglu_supports, contracts=contracts("npu_swiglu"))

# registration side effects: MoE stages, moe_gating (npu_moe_gating_top_k), W8A8 expert stages, FP8 (declined)
from ep_fuse.providers.npu import fp8, moe, router, w8a8  # noqa: E402,F401

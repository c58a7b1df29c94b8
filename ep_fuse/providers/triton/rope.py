"""The Triton provider of the RoPE family (``rope``, ``rope_qk``, ``rope_cache``, ``rope_qk_cache``): argument
checks, output layout, launch (q and k together), perf rules and registration.

Perf rule (under Inductor): bf16/fp16 heads (exact rounding by packed ``fma.rn``) measured faster than Inductor's
kernel, most in the cos/sin-cache form, so they are used; fp32 heads and the complex form decline."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import is_concrete_int, statically_known_true

from ep_fuse.ops import rope as ops
from ep_fuse.ops.rope import CACHE_FORMS, ROPE_FORMS, rope_cache_ref, rope_ref
from ep_fuse.providers.triton.provider import register
from ep_fuse.providers.triton.unverified import gpu_unverified

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
KERNEL_FORMS = {"rotate_pairs": "interleave", "rotate_pairs_fp32": "interleave"}
"""Canonical forms computed by another form's kernel code: ``rotate_pairs`` has ``interleave``'s values
(its output layout comes from the reference, like every output); ``rotate_pairs_fp32`` too, in fp32 math."""
FP32_MATH_FORMS = ("complex", "rotate_pairs_fp32")
"""Forms the model computes in fp32 whatever the heads' dtype: upcast after the loads, one rounding at the store."""


def _unit_last_stride(t: torch.Tensor) -> bool:
    return statically_known_true(t.shape[-1] == 1) or statically_known_true(t.stride(-1) == 1)


def _broadcasts(t: torch.Tensor, x: torch.Tensor, width: Any) -> bool:
    if t.dim() > x.dim() or not statically_known_true(t.shape[-1] == width):
        return False
    for a, b in zip(reversed(t.shape[:-1]), reversed(x.shape[:-1])):
        if not (statically_known_true(a == 1) or statically_known_true(a == b)):
            return False
    return True


def check_rope_call(args: tuple[Any, ...]) -> str | None:
    """Limits of the Triton kernel: <= 4-D heads with unit-stride channels, matching dtypes."""
    if len(args) == 7:
        q, k, cos, sin, form, rot_dim, out_dtype = args
        xs = (q, k)
    else:
        q, cos, sin, form, rot_dim, out_dtype = args
        xs = (q,)
    if form not in ROPE_FORMS:
        return f"unknown form {form!r}"
    unverified = gpu_unverified(f"rope:{form}", q)
    if unverified:
        return unverified
    for x in xs:
        if x.dtype not in KERNEL_DTYPES:
            return f"head dtype {x.dtype} is not fp16/bf16/fp32"
        if not 1 <= x.dim() <= 4:
            return f"{x.dim()}-D heads (the kernel takes up to 4-D)"
        if not _unit_last_stride(x):
            return "head channels are not contiguous"
        if x.dtype != q.dtype:
            return "q and k differ in dtype"
        width = rot_dim if form == "half" else rot_dim // 2
        if not _broadcasts(cos, x, width) or (sin is not None and not _broadcasts(sin, x, width)):
            return "cos/sin do not broadcast to the heads"
    if form == "complex":
        if cos.dtype != torch.complex64 or not _unit_last_stride(cos):
            return "freqs_cis is not a unit-stride complex64 tensor"
        if out_dtype not in (None, *KERNEL_DTYPES):
            return f"output dtype {out_dtype}"
    elif form == "rotate_pairs_fp32":
        if rot_dim != q.shape[-1]:
            return "partial rotary in the fp32 pairs form"
        if cos.dtype not in (q.dtype, torch.float32) or sin.dtype != cos.dtype:
            return f"cos/sin dtype {cos.dtype}/{sin.dtype} is neither fp32 nor the heads' {q.dtype}"
        if out_dtype not in (None, *KERNEL_DTYPES):
            return f"output dtype {out_dtype}"
        if not (_unit_last_stride(cos) and _unit_last_stride(sin)):
            return "cos/sin channels are not contiguous"
    else:
        if cos.dtype != q.dtype or sin.dtype != q.dtype:
            return f"cos/sin dtype {cos.dtype}/{sin.dtype} differs from the heads' {q.dtype} (type promotion)"
        if not (_unit_last_stride(cos) and _unit_last_stride(sin)):
            return "cos/sin channels are not contiguous"
    return None


@functools.lru_cache(maxsize=1024)
def _layout(ref: Callable[..., torch.Tensor], descs: tuple, params: tuple) -> tuple:
    """Shape, strides and dtype of ``ref(*tensors, *params)`` for these input layouts (meta tensors)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def meta(desc: tuple | None) -> torch.Tensor | None:
        if desc is None:
            return None
        shape, stride, dtype = desc
        return torch.empty_strided(shape, stride, dtype=dtype, device="meta")

    with unset_fake_temporarily():
        out = ref(*(meta(d) for d in descs), *params)
    return tuple(out.shape), tuple(out.stride()), out.dtype


def _desc(t: torch.Tensor) -> tuple:
    return tuple(int(v) for v in t.shape), tuple(int(v) for v in t.stride()), t.dtype


def _alloc(ref: Callable[..., torch.Tensor], tensors: tuple[torch.Tensor | None, ...], params: tuple) -> torch.Tensor:
    """The output of ``ref(*tensors, *params)`` (the reference), empty, laid out as the reference lays it out."""
    x = tensors[0]
    assert x is not None
    if not all(is_concrete_int(v) for t in tensors if t is not None for v in (*t.shape, *t.stride())):
        # symbolic sizes while tracing: the reference on the fake inputs gives the layout (no specialization)
        out = ref(*tensors, *params)
        return torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device=x.device)
    shape, stride, dtype = _layout(ref, tuple(_desc(t) if t is not None else None for t in tensors), params)
    return torch.empty_strided(shape, stride, dtype=dtype, device=x.device)


def _lead3(t: torch.Tensor) -> tuple[list[Any], list[Any]]:
    """The leading (non-channel) dims of ``t`` padded to 3, with their strides."""
    shape, stride = list(t.shape[:-1]), list(t.stride()[:-1])
    pad = 3 - len(shape)
    return [1] * pad + shape, [0] * pad + stride


def _trig(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor | None, form: str, rot: int,
          positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, list[Any], list[Any]]:
    """cos and sin as tensors broadcast over ``x``'s leading dims (the complex form: real/imag views).

    With ``positions``, ``cos`` is the ``[max_pos, rot]`` cache: the cos and sin halves are returned with
    the strides of ``positions`` broadcast over ``x``'s token dims (one head dim added)."""
    lead = list(x.shape[:-1])
    if positions is not None:
        strides = _lead3(positions.unsqueeze(-1).expand(*lead).unsqueeze(-1))[1]  # (no channel dim)
        return cos, cos[:, rot // 2:], strides, strides
    if form == "complex":
        f = torch.view_as_real(cos.expand(*lead, rot // 2))
        strides = _lead3_of(f)[1]
        return f[..., 0], f[..., 1], strides, strides
    width = rot if form == "half" else rot // 2
    c, s = cos.expand(*lead, width), sin.expand(*lead, width)
    return c, s, _lead3(c)[1], _lead3(s)[1]


def _lead3_of(real_view: torch.Tensor) -> tuple[list[Any], list[Any]]:
    """Leading dims of a ``view_as_real`` tensor ([..., h, 2]): drop the two channel dims."""
    shape, stride = list(real_view.shape[:-2]), list(real_view.stride()[:-2])
    pad = 3 - len(shape)
    return [1] * pad + shape, [0] * pad + stride


def _memory_order(lead: list[Any], xs: list[Any], *others: list[Any]) -> tuple[list[Any], ...]:
    """Reorder the three leading dims so the last one has the smallest input stride.

    Programs walk rows in that order: for a ``transpose`` view [B, H, S, D] of a [B, S, H, D] buffer,
    consecutive rows are then the heads of one token (contiguous in memory, one cos/sin row).
    """
    if all(is_concrete_int(v) for v in (*lead, *xs)):
        order = sorted(range(3), key=lambda i: (lead[i] != 1, -int(xs[i]), i))  # size-1 dims first
    else:  # symbolic sizes: decide only what holds for every size (int() would specialize the graph)
        order = sorted(range(3), key=functools.cmp_to_key(lambda i, j: _before(lead, xs, i, j)))
    return tuple([v[i] for i in order] for v in (lead, xs, *others))


def _before(lead: list[Any], xs: list[Any], i: int, j: int) -> int:
    """Order of leading dims ``i`` and ``j`` (size-1 dims first, then larger strides), from facts true at
    every value of the symbolic sizes; undecided pairs keep their logical order."""
    one_i, one_j = statically_known_true(lead[i] == 1), statically_known_true(lead[j] == 1)
    if one_i != one_j:
        return -1 if one_i else 1
    if statically_known_true(xs[i] > xs[j]):
        return -1
    if statically_known_true(xs[i] < xs[j]):
        return 1
    return i - j


@dataclasses.dataclass(frozen=True)
class RopeTuning:
    """Benchmark-only overrides of a launch's choices (``bench/bench_rope.py``); ``None``: the kernel's own."""

    rounding: int | None = None
    """2: fp32 math with ``cvt.rn``; 3: packed ``fma.rn`` (:func:`rounding_mode`)."""
    rows: int | None = None
    num_warps: int | None = None
    idx64: bool = False


DEFAULT_TUNING = RopeTuning()


def launch(q: torch.Tensor, qy: torch.Tensor, k: torch.Tensor | None, ky: torch.Tensor | None,
           cos: torch.Tensor, sin: torch.Tensor | None, form: str, rot: int,
           wrap: Callable[[Any], Any] | None = None, positions: torch.Tensor | None = None,
           tuning: RopeTuning = DEFAULT_TUNING) -> None:
    """One launch for q (and k); with ``positions``, ``cos`` is the cos/sin cache and ``sin`` is unused."""
    import triton

    # kernel modules import triton: on first launch
    from ep_fuse.providers.triton.jit_helpers import DTYPE_CODES, INTERPRET
    from ep_fuse.providers.triton.rope_kernel import FORMS, rope_jit, rows_per_program, warps_for  # triton

    d = q.shape[-1]
    fp32_math = form == "rotate_pairs_fp32"  # fp32 products and sum (CODE fp32: no rounding), rounded at the store
    mode = 2 if fp32_math else rounding_mode(q, tuning.rounding)
    native = mode == 3
    rows = tuning.rows or rows_per_program(int(d), native)
    qlead, qxs = _lead3(q)
    _, qys = _lead3(qy)
    qc, qs, qcs, qss = _trig(q, cos, sin, form, rot, positions)
    qlead, qxs, qys, qcs, qss = _memory_order(qlead, qxs, qys, qcs, qss)
    q_rows = qlead[0] * qlead[1] * qlead[2]
    q_progs = triton.cdiv(q_rows, rows)
    if k is not None:
        assert ky is not None
        klead, kxs = _lead3(k)
        _, kys = _lead3(ky)
        _kc, _ks, kcs, kss = _trig(k, cos, sin, form, rot, positions)
        klead, kxs, kys, kcs, kss = _memory_order(klead, kxs, kys, kcs, kss)
        k_rows = klead[0] * klead[1] * klead[2]
        k_progs = triton.cdiv(k_rows, rows)
    else:
        klead, kxs, kys, kcs, kss, k_rows, k_progs = qlead, qxs, qys, qcs, qss, 0, 0
    if isinstance(q_progs + k_progs, int) and q_progs + k_progs == 0:
        return
    half = rot // 2
    kernel = wrap(rope_jit) if wrap is not None else rope_jit
    kernel[(q_progs + k_progs,)](
        q, qy, k if k is not None else q, ky if ky is not None else qy, qc, qs,
        positions if positions is not None else qc,
        q_progs, q_rows, qlead[1], qlead[2], k_rows, klead[1], klead[2],
        *qxs, *qys, *qcs, *qss, *kxs, *kys, *kcs, *kss, cos.stride(0) if positions is not None else 0,
        HALF=half, ROT=rot, D=int(d), FORM=FORMS[KERNEL_FORMS.get(form, form)],
        CODE=DTYPE_CODES[torch.float32 if fp32_math else q.dtype],
        OUT_CODE=DTYPE_CODES[qy.dtype], BLOCK=triton.next_power_of_2(half),
        PASS_BLOCK=triton.next_power_of_2(max(int(d) - rot, 1)), ROWS=rows, HAS_K=k is not None,
        EMULATE_RTNE=1 if INTERPRET else mode,
        IDX32=_fits_int32(q_rows + rows, k_rows + rows) and not tuning.idx64,
        HAS_POS=positions is not None, num_warps=tuning.num_warps or warps_for(int(d), native),
    )


def rounding_mode(x: torch.Tensor, requested: int | None = None) -> int:
    """3: packed bf16x2/f16x2 ``fma.rn`` (bf16 needs sm_80); 2: fp32 math with inline-PTX ``cvt.rn``
    (fp32 heads, older GPUs, or a benchmark's ``requested`` 2)."""
    native = x.dtype == torch.float16 or (x.dtype == torch.bfloat16 and _capability(x.device) >= (8, 0))
    return 3 if native and requested in (None, 3) else 2


@functools.lru_cache(maxsize=16)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)


def _fits_int32(*values: Any) -> bool:
    return all(isinstance(v, int) and v < 2**31 for v in values)


def _check_out(y: torch.Tensor) -> torch.Tensor:
    if y.dim() and y.shape[-1] > 1 and y.stride(-1) != 1:
        raise RuntimeError("the reference output layout has strided channels; the kernel writes unit-stride rows")
    return y


def rope_kernel(x, cos, sin, form, rot_dim, out_dtype, wrap=None):  # noqa: ANN001, ANN201 - schema-typed
    """``ep_fuse_triton::rope``."""
    y = _check_out(_alloc(rope_ref, (x, cos, sin), (form, rot_dim, out_dtype)))
    launch(x, y, None, None, cos, sin, form, rot_dim, wrap)
    return y


def rope_qk_kernel(q, k, cos, sin, form, rot_dim, out_dtype, wrap=None,  # noqa: ANN001, ANN201
                   tuning: RopeTuning = DEFAULT_TUNING):
    """``ep_fuse_triton::rope_qk``: q and k in one launch (``tuning``: a benchmark's overrides)."""
    qy = _check_out(_alloc(rope_ref, (q, cos, sin), (form, rot_dim, out_dtype)))
    ky = _check_out(_alloc(rope_ref, (k, cos, sin), (form, rot_dim, out_dtype)))
    launch(q, qy, k, ky, cos, sin, form, rot_dim, wrap, tuning=tuning)
    return qy, ky


def check_rope_cache_call(args: tuple[Any, ...]) -> str | None:
    """Limits of the Triton kernel for the cache form: the cache in the heads' dtype (no per-call cast),
    integer positions that broadcast to the token dims, heads of <= 4 dims with unit-stride channels."""
    *xs, cache, positions, form, rot_dim = args
    if form not in CACHE_FORMS:
        return f"unknown cache form {form!r}"
    if positions.dtype not in (torch.int32, torch.int64):
        return f"positions dtype {positions.dtype} is not int32/int64"
    if cache.dim() != 2 or not _unit_last_stride(cache) or not statically_known_true(cache.shape[-1] == rot_dim):
        return "cos_sin_cache is not a [max_pos, rot_dim] matrix with unit-stride rows"
    for x in xs:
        if x.dtype not in KERNEL_DTYPES:
            return f"head dtype {x.dtype} is not fp16/bf16/fp32"
        if cache.dtype != x.dtype:
            return f"cos_sin_cache dtype {cache.dtype} differs from the heads' {x.dtype} (a cast per call)"
        if not 2 <= x.dim() <= 4 or not _unit_last_stride(x):
            return "heads are not [*tokens, heads, head_dim] (<= 4-D) with unit-stride channels"
        lead = list(x.shape[:-2])
        if positions.dim() > len(lead) or not all(
                statically_known_true(p == 1) or statically_known_true(p == t)
                for p, t in zip(reversed(positions.shape), reversed(lead))):
            return f"positions of shape {list(positions.shape)} do not broadcast to the token dims {lead}"
    return None


def rope_cache_kernel(x, cos_sin_cache, positions, form, rot_dim, wrap=None):  # noqa: ANN001, ANN201
    """``ep_fuse_triton::rope_cache``: cos/sin rows gathered inside the kernel."""
    y = _check_out(_alloc(rope_cache_ref, (x, cos_sin_cache, positions), (form, rot_dim)))
    launch(x, y, None, None, cos_sin_cache, None, form, rot_dim, wrap, positions=positions)
    return y


def rope_qk_cache_kernel(q, k, cos_sin_cache, positions, form, rot_dim, wrap=None):  # noqa: ANN001, ANN201
    """``ep_fuse_triton::rope_qk_cache``: q and k in one launch, cos/sin rows gathered inside the kernel."""
    qy = _check_out(_alloc(rope_cache_ref, (q, cos_sin_cache, positions), (form, rot_dim)))
    ky = _check_out(_alloc(rope_cache_ref, (k, cos_sin_cache, positions), (form, rot_dim)))
    launch(q, qy, k, ky, cos_sin_cache, None, form, rot_dim, wrap, positions=positions)
    return qy, ky


def _rope_rule(x: Any, form: str, executor: str) -> str | None:
    """bf16/fp16 heads (packed ``fma.rn`` rounding) measured faster than Inductor's kernel: 1.03-1.22x on the
    baseline grid (parity, 0.99-1.14x over two runs, at 16384 tokens x 32+8 heads x 128), 1.15-2.2x on the
    chunk / GPT-J / de-interleaved forms, 1.2-2.4x in the cache form (``python bench/bench_rope.py``). fp32 heads
    (fp32 math, 0.81-0.89x before the packed path) and the complex form (unmeasured) decline."""
    if executor != "inductor":
        return None
    if form in FP32_MATH_FORMS:
        return f"RoPE {form} form (fp32 math): not measured against Inductor"
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"RoPE on {x.dtype} heads: Inductor's kernel measured faster (0.81-0.89x)"
    return None


def rope_prefers(args: tuple[Any, ...], executor: str) -> str | None:
    """``rope(x, cos, sin, form, ...)`` / ``rope_qk(q, k, cos, sin, form, ...)``: see :func:`_rope_rule`."""
    return _rope_rule(args[0], args[-3], executor)


def rope_cache_prefers(args: tuple[Any, ...], executor: str) -> str | None:
    """``rope_cache(x, cache, positions, form, rot)`` / ``rope_qk_cache(q, k, ...)``: see :func:`_rope_rule`."""
    return _rope_rule(args[0], args[-2], executor)


register(ops.rope, rope_kernel, supports=check_rope_call, prefers=rope_prefers, symbolic=True)
register(ops.rope_qk, rope_qk_kernel, supports=check_rope_call, prefers=rope_prefers, symbolic=True)
register(ops.rope_cache, rope_cache_kernel, supports=check_rope_cache_call, prefers=rope_cache_prefers, symbolic=True)
register(ops.rope_qk_cache, rope_qk_cache_kernel, supports=check_rope_cache_call, prefers=rope_cache_prefers,
         symbolic=True)

"""Host side of the Triton RoPE provider: argument checks, output layout, launch (q and k together)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ep_fuse.ops.reference import ROPE_FORMS, rope_ref

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _unit_last_stride(t: torch.Tensor) -> bool:
    return t.shape[-1] == 1 or statically_known_true(t.stride(-1) == 1)


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
    for x in xs:
        if x.dtype not in KERNEL_DTYPES:
            return f"head dtype {x.dtype} is not fp16/bf16/fp32"
        if not 1 <= x.dim() <= 4:
            return f"{x.dim()}-D heads (the kernel takes up to 4-D)"
        if not _unit_last_stride(x):
            return "head channels are not contiguous"
        if x.dtype != q.dtype:
            return "q and k differ in dtype"
        width = rot_dim // 2 if form in ("chunk", "deinterleave", "complex") else rot_dim
        if not _broadcasts(cos, x, width) or (sin is not None and not _broadcasts(sin, x, width)):
            return "cos/sin do not broadcast to the heads"
    if form == "complex":
        if cos.dtype != torch.complex64 or not _unit_last_stride(cos):
            return "freqs_cis is not a unit-stride complex64 tensor"
        if out_dtype not in (None, *KERNEL_DTYPES):
            return f"output dtype {out_dtype}"
    else:
        if cos.dtype != q.dtype or sin.dtype != q.dtype:
            return f"cos/sin dtype {cos.dtype}/{sin.dtype} differs from the heads' {q.dtype} (type promotion)"
        if not (_unit_last_stride(cos) and _unit_last_stride(sin)):
            return "cos/sin channels are not contiguous"
    return None


@functools.lru_cache(maxsize=1024)
def _layout(form: str, rot: int, out_dtype: Any, x: tuple, c: tuple, s: tuple | None) -> tuple:
    """Shape, strides and dtype of the reference's output for these input layouts (meta tensors)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def meta(desc: tuple) -> torch.Tensor:
        shape, stride, dtype = desc
        return torch.empty_strided(shape, stride, dtype=dtype, device="meta")

    with unset_fake_temporarily():
        out = rope_ref(meta(x), meta(c), meta(s) if s is not None else None, form, rot, out_dtype)
    return tuple(out.shape), tuple(out.stride()), out.dtype


def _desc(t: torch.Tensor) -> tuple:
    return tuple(int(v) for v in t.shape), tuple(int(v) for v in t.stride()), t.dtype


def _alloc(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor | None, form: str, rot: int,
           out_dtype: Any) -> torch.Tensor:
    shape, stride, dtype = _layout(form, rot, out_dtype, _desc(x), _desc(cos), _desc(sin) if sin is not None else None)
    return torch.empty_strided(shape, stride, dtype=dtype, device=x.device)


def _lead3(t: torch.Tensor) -> tuple[list[Any], list[Any]]:
    """The leading (non-channel) dims of ``t`` padded to 3, with their strides."""
    shape, stride = list(t.shape[:-1]), list(t.stride()[:-1])
    pad = 3 - len(shape)
    return [1] * pad + shape, [0] * pad + stride


def _trig(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor | None, form: str, rot: int
          ) -> tuple[torch.Tensor, torch.Tensor, list[Any], list[Any]]:
    """cos and sin as tensors broadcast over ``x``'s leading dims (the complex form: real/imag views)."""
    lead = list(x.shape[:-1])
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
    try:
        order = sorted(range(3), key=lambda i: (lead[i] != 1, -int(xs[i]), i))  # size-1 dims first
    except TypeError:  # symbolic strides: keep the logical order
        return (lead, xs, *others)
    return tuple([v[i] for i in order] for v in (lead, xs, *others))


def launch(q: torch.Tensor, qy: torch.Tensor, k: torch.Tensor | None, ky: torch.Tensor | None,
           cos: torch.Tensor, sin: torch.Tensor | None, form: str, rot: int,
           wrap: Callable[[Any], Any] | None = None) -> None:
    import triton

    from ep_fuse.providers.triton.rms_norm_kernel import DTYPE_CODES, INTERPRET
    from ep_fuse.providers.triton.rope_kernel import (
        FORMS,
        _rope_kernel,
        rows_per_program,
        warps_for,
    )

    d = q.shape[-1]
    rows = TUNING.get("rows") or rows_per_program(int(d))
    qlead, qxs = _lead3(q)
    _, qys = _lead3(qy)
    qc, qs, qcs, qss = _trig(q, cos, sin, form, rot)
    qlead, qxs, qys, qcs, qss = _memory_order(qlead, qxs, qys, qcs, qss)
    q_rows = qlead[0] * qlead[1] * qlead[2]
    q_progs = triton.cdiv(q_rows, rows)
    if k is not None:
        assert ky is not None
        klead, kxs = _lead3(k)
        _, kys = _lead3(ky)
        _kc, _ks, kcs, kss = _trig(k, cos, sin, form, rot)
        klead, kxs, kys, kcs, kss = _memory_order(klead, kxs, kys, kcs, kss)
        k_rows = klead[0] * klead[1] * klead[2]
        k_progs = triton.cdiv(k_rows, rows)
    else:
        klead, kxs, kys, kcs, kss, k_rows, k_progs = qlead, qxs, qys, qcs, qss, 0, 0
    if isinstance(q_progs + k_progs, int) and q_progs + k_progs == 0:
        return
    half = rot // 2
    kernel = wrap(_rope_kernel) if wrap is not None else _rope_kernel
    kernel[(q_progs + k_progs,)](
        q, qy, k if k is not None else q, ky if ky is not None else qy, qc, qs,
        q_progs, q_rows, qlead[1], qlead[2], k_rows, klead[1], klead[2],
        *qxs, *qys, *qcs, *qss, *kxs, *kys, *kcs, *kss,
        HALF=half, ROT=rot, D=int(d), FORM=FORMS[form], CODE=DTYPE_CODES[q.dtype],
        OUT_CODE=DTYPE_CODES[qy.dtype], BLOCK=triton.next_power_of_2(half),
        PASS_BLOCK=triton.next_power_of_2(max(int(d) - rot, 1)), ROWS=rows, HAS_K=k is not None,
        EMULATE_RTNE=1 if INTERPRET else TUNING.get("rounding", 2),  # exact bf16 rounding (bits / inline PTX)
        IDX32=_fits_int32(q_rows + rows, k_rows + rows) and not TUNING.get("idx64", False),
        num_warps=TUNING.get("num_warps") or warps_for(int(d)),
    )


TUNING: dict[str, Any] = {}
"""Benchmark-only overrides (``rounding``, ``idx64``, ``num_warps``); empty in normal use."""


def _fits_int32(*values: Any) -> bool:
    return all(isinstance(v, int) and v < 2**31 for v in values)


def _check_out(y: torch.Tensor) -> torch.Tensor:
    if y.dim() and y.shape[-1] > 1 and y.stride(-1) != 1:
        raise RuntimeError("the reference output layout has strided channels; the kernel writes unit-stride rows")
    return y


def rope_kernel(x, cos, sin, form, rot_dim, out_dtype, wrap=None):  # noqa: ANN001, ANN201 - schema-typed
    """``ep_fuse_triton::rope``."""
    y = _check_out(_alloc(x, cos, sin, form, rot_dim, out_dtype))
    launch(x, y, None, None, cos, sin, form, rot_dim, wrap)
    return y


def rope_qk_kernel(q, k, cos, sin, form, rot_dim, out_dtype, wrap=None):  # noqa: ANN001, ANN201
    """``ep_fuse_triton::rope_qk``: q and k in one launch."""
    qy = _check_out(_alloc(q, cos, sin, form, rot_dim, out_dtype))
    ky = _check_out(_alloc(k, cos, sin, form, rot_dim, out_dtype))
    launch(q, qy, k, ky, cos, sin, form, rot_dim, wrap)
    return qy, ky

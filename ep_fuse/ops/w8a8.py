"""Canonical W8A8 int8 routed-expert ops (``quant="w8a8_int8"``): stage ops and their block.

The quant pass (:mod:`ep_fuse.passes.quant`) rewrites
each ``moe_experts`` block into ``moe_experts_w8a8``, which the expand pass replaces by::

    moe_permute -> quant_per_token -> grouped_gemm_w8a8_swiglu_quant -> grouped_gemm_w8a8 -> moe_unpermute

The references below are the semantics (the oracle):

Conventions (shared by every provider; MoE row conventions as in :mod:`ep_fuse.ops.moe`):

* **int8 codes** are symmetric in ``[-127, 127]``, scales fp32, ``value ~= code * scale``.
* **per-token (dynamic) activation quant** (``npu_dynamic_quant``): ``amax = max |x_row|`` in fp32,
  ``scale = amax / 127``, ``code = clamp(rtne(x * (127 / amax)), -127, 127)`` (round half to even);
  an all-zero row gets scale 0 and codes 0.
* **per-output-channel weight quant** (made once at compile time): the same rule per output row of
  ``w[e]`` (torch Linear layout [E, N, K]): ``w_scale`` [E, N].
* **int8 GEMM**: ``acc = xq @ wq[e].T`` exactly in int32; dequant in fp32 as
  ``(float(acc) * x_scale[row]) * w_scale[e, col]``.
* ``grouped_gemm_w8a8_swiglu_quant``: dequantized gate|up (``w13`` rows ``[0, I)`` gate, ``[I, 2I)``
  up), ``silu(gate) * up`` in fp32 (no intermediate rounding, as ``npu_dequant_swiglu_quant``), then
  per-token requant of that fp32 row -> ``(codes int8 [M, I], scale fp32 [M])``.
* ``grouped_gemm_w8a8``: dequantized output rounded once to ``out_dtype``.
* rows past ``seg_indptr[E]`` (the tail) give zero codes / zero scales / zero outputs.

The integer GEMM is evaluated in fp64 (exact: ``|acc| <= 127^2 * K < 2^53``) by a host loop over
experts, so these references do not trace to ATen ops (they stay opaque canonical ops when no
provider takes them).
"""

from __future__ import annotations

import torch

from ep_fuse.ops.registry import define_canonical, never_traceable

QMAX = 127.0


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization of each row of ``x`` (last dim): ``(codes int8, scale fp32 [...])``."""
    xf = x.to(torch.float32)
    amax = xf.abs().amax(-1) if xf.shape[-1] else xf.new_zeros(xf.shape[:-1])
    scale = amax / QMAX
    inv = torch.where(amax > 0, QMAX / amax, torch.zeros((), dtype=torch.float32, device=x.device))
    q = torch.round(xf * inv.unsqueeze(-1)).clamp(-QMAX, QMAX).to(torch.int8)
    return q, scale


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel int8 weights: ``w`` [E, N, K] -> ``(codes [E, N, K] int8, scale [E, N] fp32)``.

    One expert at a time, so the fp32 temporaries stay one expert's size (DeepSeek-size experts on a GPU)."""
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    s = torch.empty(w.shape[:-1], dtype=torch.float32, device=w.device)
    for e in range(w.shape[0]):
        q[e], s[e] = quantize_rows(w[e])
    return q.contiguous(), s


def dequantize_weight(wq: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (wq.to(torch.float32) * scale.unsqueeze(-1)).to(dtype)


def quant_per_token_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes int8 [M, K], scale fp32 [M])``: dynamic per-token quant (see the module docstring)."""
    return quantize_rows(x)


def quant_per_token_fake(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty(x.shape[:-1], dtype=torch.float32)


def _int_gemm_dequant(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
                      seg_indptr: torch.Tensor) -> torch.Tensor:
    """fp32 ``[M, N]``: per-expert exact int GEMM, dequantized; tail rows zero."""
    out = torch.zeros(xq.shape[0], wq.shape[1], dtype=torch.float32, device=xq.device)
    bounds = seg_indptr.tolist()
    for e in range(wq.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            acc = (xq[lo:hi].to(torch.float64) @ wq[e].to(torch.float64).T).to(torch.int32)
            out[lo:hi] = (acc.to(torch.float32) * xs[lo:hi].unsqueeze(-1)) * ws[e].unsqueeze(0)
    return out


def grouped_gemm_w8a8_swiglu_quant_ref(xq: torch.Tensor, xs: torch.Tensor, w13q: torch.Tensor,
                                       w13s: torch.Tensor, seg_indptr: torch.Tensor
                                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 gate|up GEMM -> dequant -> ``silu(gate) * up`` (fp32) -> per-token requant."""
    h = _int_gemm_dequant(xq, xs, w13q, w13s, seg_indptr)
    gate, up = h.split(w13q.shape[1] // 2, -1)
    return quantize_rows(torch.nn.functional.silu(gate) * up)


def grouped_gemm_w8a8_swiglu_quant_fake(xq, xs, w13q, w13s, seg_indptr):
    m, i = xq.shape[0], w13q.shape[1] // 2
    return xq.new_empty(m, i, dtype=torch.int8), xq.new_empty(m, dtype=torch.float32)


def grouped_gemm_w8a8_ref(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
                          seg_indptr: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """int8 GEMM ``xq @ wq[e].T`` per expert segment, dequantized, rounded to ``out_dtype``; tail zero."""
    return _int_gemm_dequant(xq, xs, wq, ws, seg_indptr).to(out_dtype)


def grouped_gemm_w8a8_fake(xq, xs, wq, ws, seg_indptr, out_dtype):
    return xq.new_empty(xq.shape[0], wq.shape[1], dtype=out_dtype)


def never_traceable(args: tuple) -> bool:
    """The references loop over experts on the host: under Inductor they stay opaque ops."""
    return False


def moe_experts_w8a8_ref(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13_q: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_q: torch.Tensor,
    w2_scale: torch.Tensor,
    out_dtype: torch.dtype | None,
) -> torch.Tensor:
    """The W8A8 routed-expert block, written with the canonical stage ops (expanded before lowering)::

        moe_permute -> quant_per_token -> grouped_gemm_w8a8_swiglu_quant -> grouped_gemm_w8a8 -> moe_unpermute
    """
    ops = torch.ops.ep_fuse
    rows, src2dst, seg_indptr = ops.moe_permute(x, topk_ids, w13_q.shape[0])
    xq, xs = ops.quant_per_token(rows)
    aq, a_s = ops.grouped_gemm_w8a8_swiglu_quant(xq, xs, w13_q, w13_scale, seg_indptr)
    y = ops.grouped_gemm_w8a8(aq, a_s, w2_q, w2_scale, seg_indptr, x.dtype)
    return ops.moe_unpermute(y, src2dst, topk_weights, topk_ids.shape[1], out_dtype)


quant_per_token = define_canonical(
    "quant_per_token", "(Tensor x) -> (Tensor, Tensor)", quant_per_token_ref, fake=quant_per_token_fake)
"""``quant_per_token(x [M, K]) -> (codes int8 [M, K], scale fp32 [M])``: dynamic symmetric per-row int8."""

grouped_gemm_w8a8_swiglu_quant = define_canonical(
    "grouped_gemm_w8a8_swiglu_quant",
    "(Tensor xq, Tensor x_scale, Tensor w13_q, Tensor w13_scale, Tensor seg_indptr) -> (Tensor, Tensor)",
    grouped_gemm_w8a8_swiglu_quant_ref, fake=grouped_gemm_w8a8_swiglu_quant_fake,
    traceable=never_traceable)
"""int8 gate|up grouped GEMM -> dequant -> SwiGLU (fp32) -> per-token requant: ``(codes [M, I], scale [M])``."""

grouped_gemm_w8a8 = define_canonical(
    "grouped_gemm_w8a8",
    "(Tensor xq, Tensor x_scale, Tensor w_q, Tensor w_scale, Tensor seg_indptr, ScalarType out_dtype) -> Tensor",
    grouped_gemm_w8a8_ref, fake=grouped_gemm_w8a8_fake, traceable=never_traceable)
"""int8 grouped GEMM ``xq @ w_q[e].T`` dequantized per token x per channel, rounded to ``out_dtype``."""

moe_experts_w8a8 = define_canonical(
    "moe_experts_w8a8",
    "(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13_q, Tensor w13_scale, Tensor w2_q, "
    "Tensor w2_scale, ScalarType? out_dtype) -> Tensor",
    moe_experts_w8a8_ref, block=True,
    stages=("moe_permute", "quant_per_token", "grouped_gemm_w8a8_swiglu_quant", "grouped_gemm_w8a8", "moe_unpermute"))
"""The W8A8 routed-expert block (``moe_experts`` with int8 weights + per-channel scales)."""

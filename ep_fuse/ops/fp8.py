"""Canonical FP8 block-scaled routed-expert ops (``quant="fp8_block"``): stage ops, their block, and the
weight dequantization that marks a model's own FP8 expert weights.

The quant pass (:mod:`ep_fuse.passes.quant`) rewrites each
``moe_experts`` block into ``moe_experts_fp8``, which the expand pass replaces by::

    moe_permute_fp8 -> grouped_gemm_fp8_swiglu_quant -> grouped_gemm_fp8 -> moe_unpermute

``align`` (default 1): with ``align > 1`` the permute starts every expert's rows at a multiple of ``align``
(zero padding rows after each expert's real rows), and the GEMM stages are told so: the layout a
fixed-tile grouped GEMM such as DeepGEMM's needs (:mod:`ep_fuse.providers.deepgemm`). The quant pass
chooses it (:func:`ep_fuse.providers.deepgemm.fp8.align_for`).

The references below are the semantics (the oracle):

Format (DeepSeek-V3's checkpoints; transformers' ``FP8Experts``):

* **codes** are ``torch.float8_e4m3fn`` (largest finite value 448); **scales** are fp32 *dequant* scales
  (``weight_scale_inv`` in the checkpoints): ``value ~= float(code) * scale``.
* **weights** ``w`` [E, N, K] (torch Linear layout) in blocks of ``block_n x block_k`` (128 x 128):
  ``scale [E, ceil(N / block_n), ceil(K / block_k)]``. When N or K is not a multiple of the block the
  last block row/column is ragged: it covers only the real rows/columns, and its scale is their amax
  (no padding values take part).
* **activations** are quantized per token and per group of ``block_k`` channels (1 x 128), dynamically:
  ``scale [M, ceil(K / block_k)]``. The group is the weight's K block, so one K block of a GEMM has one
  activation scale per row and one weight scale per output block.
* **quantization rule** (one block or group): ``amax = max |v|`` in fp32, ``scale = amax / 448``,
  ``code = fp8(clamp(v / scale, -448, 448))`` with round-to-nearest-even (``Tensor.to``); a block whose
  scale is 0 (all zero, or an amax below ``448 * 2**-149``) gets scale 0 and zero codes.
* **GEMM** (``grouped_gemm_fp8*``): codes dequantized to fp32 (``code * scale`` per group / block), then
  an fp32 matmul per expert segment; rows past ``seg_indptr[E]`` (the tail) give zeros. FP8 tensor
  cores (Hopper ``wgmma``) multiply the codes exactly (two 4-bit significands) and accumulate in fp32,
  and a kernel applies ``x_scale * w_scale`` once per K block; this reference therefore equals the ideal
  kernel up to fp32 rounding: summation order, and the rounding of each dequantized operand (a code
  times a 24-bit scale) before the product. On CUDA with TF32 matmuls allowed
  (``torch.backends.cuda.matmul.allow_tf32``) the reference's fp32 matmul runs in TF32.
* ``grouped_gemm_fp8_swiglu_quant``: dequantized gate|up (``w13`` rows ``[0, I)`` gate, ``[I, 2I)`` up),
  ``silu(gate) * up`` in fp32 (no intermediate rounding), requantized per 1 x ``block_k`` group for the
  down GEMM. ``grouped_gemm_fp8``: the fp32 result rounded once to ``out_dtype``.
* ``moe_permute_fp8``: ``moe_permute`` (:mod:`ep_fuse.ops.moe`) fused with the activation
  quantization: quantizing is per row, so the T tokens are quantized once and their codes and scales
  gathered to the T*K permuted rows (tail rows: zero codes and scales).
* **aligned layout** (``align > 1``, every op's last argument): ``moe_permute_fp8`` starts expert ``e``'s
  rows at ``seg_indptr[e]``, a multiple of ``align``; its ``count_e`` real rows are followed by zero rows
  (codes and scales) up to the next multiple, and ``seg_indptr[e + 1] - seg_indptr[e]`` is ``count_e``
  rounded up to ``align``. The buffers have ``T*K + E*(align - 1)`` rows (the most the padding can take);
  rows past ``seg_indptr[E]`` are zero here and unspecified in kernels (no stage reads them).
  ``src2dst`` points at the real rows. The GEMM stages compute the padding rows like real ones (zero
  rows give zero outputs); a kernel that tiles by ``align`` rows relies on the alignment, the reference
  does not. The block's output does not depend on ``align``.

The GEMM references loop over experts on the host (they do not trace to ATen ops): under Inductor an
unlowered call stays the opaque canonical op.
"""

from __future__ import annotations

import torch

from ep_fuse.ops.moe import moe_permute_ref
from ep_fuse.ops.registry import define_canonical, never_traceable

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = (128, 128)
"""DeepSeek-V3's weight block ``(block_n, block_k)``; the activation group is ``block_k``."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _quantize(v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8 codes of fp32 ``v`` given a broadcastable fp32 dequant ``scale`` (the rule in the module docstring)."""
    safe = torch.where(scale > 0, scale, torch.ones((), dtype=scale.dtype, device=scale.device))
    q = torch.where(scale > 0, v / safe, torch.zeros((), dtype=v.dtype, device=v.device))
    return q.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_blocks(w: torch.Tensor, block_n: int, block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-scaled fp8 of ``w`` [..., N, K]: ``(codes fp8 [..., N, K], scale fp32 [..., ceil(N/bn), ceil(K/bk)])``."""
    n, k = w.shape[-2], w.shape[-1]
    nb, kb = cdiv(n, block_n), cdiv(k, block_k)
    wf = w.to(torch.float32)
    pad = torch.nn.functional.pad(wf, (0, kb * block_k - k, 0, nb * block_n - n))  # zeros: no effect on amax
    blocks = pad.reshape(*w.shape[:-2], nb, block_n, kb, block_k)
    if blocks.numel():
        amax = blocks.abs().amax(dim=(-3, -1))
    else:
        amax = wf.new_zeros(*w.shape[:-2], nb, kb)
    scale = amax / FP8_MAX
    q = _quantize(blocks, scale.unsqueeze(-1).unsqueeze(-3))
    q = q.reshape(pad.shape)[..., :n, :k]
    return q.contiguous(), scale


def expand_scale(scale: torch.Tensor, n: int, k: int, block_n: int, block_k: int) -> torch.Tensor:
    """``scale [..., nb, kb]`` repeated over its blocks and cut to ``[..., n, k]``."""
    s = scale.repeat_interleave(block_n, dim=-2)[..., :n, :]
    return s.repeat_interleave(block_k, dim=-1)[..., :k]


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``float(q) * scale`` per block in fp32, rounded once to ``dtype``."""
    s = expand_scale(scale.to(torch.float32), q.shape[-2], q.shape[-1], block_n, block_k)
    return (q.to(torch.float32) * s).to(dtype)


def quantize_weight_fp8(w: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [E, N, K] -> ``(codes fp8 [E, N, K], scale fp32 [E, ceil(N/bn), ceil(K/bk)])``, one expert at a
    time (the fp32 temporaries stay one expert's size)."""
    bn, bk = block
    e, n, k = w.shape
    q = torch.empty(w.shape, dtype=FP8, device=w.device)
    s = torch.empty(e, cdiv(n, bn), cdiv(k, bk), dtype=torch.float32, device=w.device)
    for i in range(e):
        q[i], s[i] = quantize_blocks(w[i], bn, bk)
    return q, s


# --------------------------------------------------------------------------- canonical op kernels
def fp8_block_dequant_ref(q: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int,
                          dtype: torch.dtype) -> torch.Tensor:
    """``ep_fuse::fp8_block_dequant``: the weight a block-scaled fp8 tensor stands for, in ``dtype``."""
    return dequantize_blocks(q, scale, block_n, block_k, dtype)


def fp8_block_dequant_fake(q, scale, block_n, block_k, dtype):
    return q.new_empty(q.shape, dtype=dtype)


def quant_fp8_group_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes fp8 [M, K], scale fp32 [M, ceil(K/group)])``: dynamic per-token, per-group quantization."""
    return quantize_blocks(x, 1, group)


def quant_fp8_group_fake(x, group):
    return x.new_empty(x.shape, dtype=FP8), x.new_empty(x.shape[0], cdiv(x.shape[1], group), dtype=torch.float32)


def _scatter_rows(v: torch.Tensor, src2dst: torch.Tensor, k: int) -> torch.Tensor:
    """Rows ``v`` [T, C] copied to the permuted rows ``src2dst`` of their T*K slots; other rows zero."""
    s = src2dst.shape[0]
    dst = torch.where(src2dst >= 0, src2dst, s)  # invalid slots write a scratch row
    out = v.new_zeros(s + 1, v.shape[1])
    out[dst] = v.repeat_interleave(k, dim=0)
    return out[:s]


def aligned_rows(t: int, k: int, num_experts: int, align: int) -> int:
    """Rows of the permuted buffers: ``T*K``, plus room for each expert's padding when ``align > 1``."""
    return t * k + (num_experts * (align - 1) if align > 1 else 0)


def aligned_seg_indptr(seg_indptr: torch.Tensor, align: int) -> torch.Tensor:
    """Each expert's segment rounded up to ``align`` rows: the aligned layout's ``seg_indptr`` (device ops)."""
    padded = (seg_indptr.diff() + align - 1) // align * align
    return torch.cat([seg_indptr.new_zeros(1), torch.cumsum(padded, 0)])


def align_layout(q: torch.Tensor, s: torch.Tensor, src2dst: torch.Tensor, seg_indptr: torch.Tensor, align: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The contiguous permuted layout ``(codes, scales, src2dst, seg_indptr)`` moved to the aligned one (module
    docstring). Static shapes only (no host read), so it traces."""
    m = q.shape[0]
    e = seg_indptr.shape[0] - 1
    seg_al = aligned_seg_indptr(seg_indptr, align)
    r = torch.arange(m, device=q.device, dtype=torch.int64)
    expert = torch.searchsorted(seg_indptr[1:], r, right=True)  # E for the tail rows
    real = expert < e
    ex = expert.clamp(max=max(e - 1, 0))
    rows = m + e * (align - 1)
    dst = torch.where(real, seg_al[ex] + r - seg_indptr[ex], rows)  # the tail goes to a scratch row
    out_q = q.new_zeros(rows + 1, q.shape[1])
    out_s = s.new_zeros(rows + 1, s.shape[1])
    out_q.view(torch.uint8)[dst] = q.view(torch.uint8)
    out_s[dst] = s
    s2d = torch.where(src2dst >= 0, dst[src2dst.clamp(min=0)], -1)
    return out_q[:rows], out_s[:rows], s2d, seg_al


def moe_permute_fp8_ref(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, group: int, align: int = 1
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes fp8 [M, H], scale fp32 [M, ceil(H/group)], src2dst, seg_indptr)``: ``moe_permute`` of the
    per-token, per-group fp8 quantization of ``x`` [T, H]; ``M = T*K``, or with ``align > 1`` the aligned
    layout (module docstring) of ``M = T*K + E*(align-1)`` rows."""
    q, s = quant_fp8_group_ref(x.reshape(topk_ids.shape[0], -1), group)
    rows, src2dst, seg_indptr = moe_permute_ref(q.view(torch.uint8), topk_ids, num_experts)
    out = rows.view(FP8), _scatter_rows(s, src2dst, topk_ids.shape[1]), src2dst, seg_indptr
    return align_layout(*out, align) if align > 1 else out


def moe_permute_fp8_fake(x, topk_ids, num_experts, group, align=1):
    t, k = topk_ids.shape
    h = x.shape[-1]
    m = aligned_rows(t, k, num_experts, align)
    return (x.new_empty(m, h, dtype=FP8), x.new_empty(m, cdiv(h, group), dtype=torch.float32),
            x.new_empty(t * k, dtype=torch.int64), x.new_empty(num_experts + 1, dtype=torch.int64))


def moe_permute_fp8_q_ref(xq: torch.Tensor, x_scale: torch.Tensor, topk_ids: torch.Tensor, num_experts: int
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``moe_permute_fp8`` of rows that arrive already quantized (codes ``xq`` fp8 [T, H] and their scales
    ``x_scale`` fp32 [T, G]; FP8 EP dispatch): the same ``(codes, scales, src2dst, seg_indptr)``, no rounding."""
    rows, src2dst, seg_indptr = moe_permute_ref(xq.view(torch.uint8), topk_ids, num_experts)
    return rows.view(FP8), _scatter_rows(x_scale, src2dst, topk_ids.shape[1]), src2dst, seg_indptr


def moe_permute_fp8_q_fake(xq, x_scale, topk_ids, num_experts):
    t, k = topk_ids.shape
    return (xq.new_empty(t * k, xq.shape[-1]), x_scale.new_empty(t * k, x_scale.shape[-1]),
            xq.new_empty(t * k, dtype=torch.int64), xq.new_empty(num_experts + 1, dtype=torch.int64))


def _gemm_fp32(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, seg_indptr: torch.Tensor,
               block_n: int, block_k: int) -> torch.Tensor:
    """fp32 ``[M, N]``: per expert segment, dequantized rows times the dequantized ``w[e].T``; tail zero."""
    m = xq.shape[0]
    out = torch.zeros(m, wq.shape[1], dtype=torch.float32, device=xq.device)
    bounds = seg_indptr.tolist()
    for e in range(wq.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            xd = dequantize_blocks(xq[lo:hi], xs[lo:hi], 1, block_k)
            out[lo:hi] = xd @ dequantize_blocks(wq[e], ws[e], block_n, block_k).T
    return out


def grouped_gemm_fp8_swiglu_quant_ref(xq: torch.Tensor, xs: torch.Tensor, w13q: torch.Tensor, w13s: torch.Tensor,
                                      seg_indptr: torch.Tensor, block_n: int, block_k: int, align: int = 1
                                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 gate|up GEMM -> ``silu(gate) * up`` (fp32) -> per-token 1 x ``block_k`` requant (``align``: the
    layout's promise, not needed here)."""
    h = _gemm_fp32(xq, xs, w13q, w13s, seg_indptr, block_n, block_k)
    gate, up = h.split(w13q.shape[1] // 2, -1)
    return quant_fp8_group_ref(torch.nn.functional.silu(gate) * up, block_k)


def grouped_gemm_fp8_swiglu_quant_fake(xq, xs, w13q, w13s, seg_indptr, block_n, block_k, align=1):
    m, i = xq.shape[0], w13q.shape[1] // 2
    return xq.new_empty(m, i, dtype=FP8), xq.new_empty(m, cdiv(i, block_k), dtype=torch.float32)


def grouped_gemm_fp8_ref(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
                         seg_indptr: torch.Tensor, block_n: int, block_k: int, out_dtype: torch.dtype,
                         align: int = 1) -> torch.Tensor:
    """fp8 GEMM ``x @ w[e].T`` per expert segment, dequantized in fp32, rounded once to ``out_dtype``."""
    return _gemm_fp32(xq, xs, wq, ws, seg_indptr, block_n, block_k).to(out_dtype)


def grouped_gemm_fp8_fake(xq, xs, wq, ws, seg_indptr, block_n, block_k, out_dtype, align=1):
    return xq.new_empty(xq.shape[0], wq.shape[1], dtype=out_dtype)


def moe_experts_fp8_ref(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13_q: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_q: torch.Tensor,
    w2_scale: torch.Tensor,
    block_n: int,
    block_k: int,
    out_dtype: torch.dtype | None,
    align: int = 1,
) -> torch.Tensor:
    """The FP8 routed-expert block, written with the canonical stage ops (expanded before lowering)::

        moe_permute_fp8 -> grouped_gemm_fp8_swiglu_quant -> grouped_gemm_fp8 -> moe_unpermute

    ``align`` picks the permuted layout (module docstring); the output does not depend on it."""
    permuted = torch.ops.ep_fuse.moe_permute_fp8(x, topk_ids, w13_q.shape[0], block_k, *((align,) if align > 1 else ()))
    return _experts_on_permuted(permuted, topk_ids, topk_weights, w13_q, w13_scale, w2_q, w2_scale, block_n,
                                block_k, x.dtype, out_dtype, align)


def _experts_on_permuted(permuted: tuple[torch.Tensor, ...], topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                         w13_q: torch.Tensor, w13_scale: torch.Tensor, w2_q: torch.Tensor, w2_scale: torch.Tensor,
                         block_n: int, block_k: int, act_dtype: torch.dtype, out_dtype: torch.dtype | None,
                         align: int = 1) -> torch.Tensor:
    """The stages after the permute, shared by both FP8 blocks: gate|up + SwiGLU + requant, down, unpermute."""
    ops = torch.ops.ep_fuse
    rq, rs, src2dst, seg_indptr = permuted
    extra = (align,) if align > 1 else ()  # the schema's default stays implicit: plain graphs keep their calls
    aq, a_s = ops.grouped_gemm_fp8_swiglu_quant(rq, rs, w13_q, w13_scale, seg_indptr, block_n, block_k, *extra)
    y = ops.grouped_gemm_fp8(aq, a_s, w2_q, w2_scale, seg_indptr, block_n, block_k, act_dtype, *extra)
    return ops.moe_unpermute(y, src2dst, topk_weights, topk_ids.shape[1], out_dtype)


def moe_experts_fp8_q_ref(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13_q: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_q: torch.Tensor,
    w2_scale: torch.Tensor,
    block_n: int,
    block_k: int,
    act_dtype: torch.dtype,
    out_dtype: torch.dtype | None,
) -> torch.Tensor:
    """The FP8 block on tokens already quantized 1 x ``block_k`` (FP8 EP dispatch sends codes + scales)::

        moe_permute_fp8_q -> grouped_gemm_fp8_swiglu_quant -> grouped_gemm_fp8 -> moe_unpermute

    ``act_dtype`` is the dtype of the tokens before quantization (the down GEMM's output dtype, as in
    :func:`moe_experts_fp8_ref`). Equal to ``moe_experts_fp8`` of the unquantized tokens, bit for bit."""
    permuted = torch.ops.ep_fuse.moe_permute_fp8_q(xq, x_scale, topk_ids, w13_q.shape[0])
    return _experts_on_permuted(permuted, topk_ids, topk_weights, w13_q, w13_scale, w2_q, w2_scale, block_n,
                                block_k, act_dtype, out_dtype)


fp8_block_dequant = define_canonical(
    "fp8_block_dequant", "(Tensor q, Tensor scale_inv, int block_n, int block_k, ScalarType dtype) -> Tensor",
    fp8_block_dequant_ref, fake=fp8_block_dequant_fake)
"""``fp8_block_dequant(q fp8 [..., N, K], scale_inv [..., ceil(N/bn), ceil(K/bk)], bn, bk, dtype)``: the
weight in ``dtype`` (fp32 product, one rounding). Emitted by :func:`ep_fuse.prepare` for transformers'
``FP8Experts``; the quant pass (``fp8_block``) reads its codes and scales directly."""

quant_fp8_group = define_canonical(
    "quant_fp8_group", "(Tensor x, int group) -> (Tensor, Tensor)", quant_fp8_group_ref,
    fake=quant_fp8_group_fake)
"""``quant_fp8_group(x [M, K], g) -> (codes fp8 [M, K], scale fp32 [M, ceil(K/g)])``: dynamic 1 x g quant."""

moe_permute_fp8 = define_canonical(
    "moe_permute_fp8",
    "(Tensor x, Tensor topk_ids, int num_experts, int group, int align=1) -> (Tensor, Tensor, Tensor, Tensor)",
    moe_permute_fp8_ref, fake=moe_permute_fp8_fake)
"""``moe_permute`` fused with the 1 x ``group`` fp8 quantization: ``(codes, scales, src2dst, seg_indptr)``;
``align > 1``: the aligned layout (:func:`ep_fuse.ops.fp8.moe_permute_fp8_ref`)."""

grouped_gemm_fp8_swiglu_quant = define_canonical(
    "grouped_gemm_fp8_swiglu_quant",
    "(Tensor xq, Tensor x_scale, Tensor w13_q, Tensor w13_scale, Tensor seg_indptr, int block_n, int block_k, "
    "int align=1) -> (Tensor, Tensor)",
    grouped_gemm_fp8_swiglu_quant_ref, fake=grouped_gemm_fp8_swiglu_quant_fake,
    traceable=never_traceable)
"""fp8 gate|up grouped GEMM (block-scale dequant) -> SwiGLU (fp32) -> 1 x ``block_k`` requant."""

grouped_gemm_fp8 = define_canonical(
    "grouped_gemm_fp8",
    "(Tensor xq, Tensor x_scale, Tensor w_q, Tensor w_scale, Tensor seg_indptr, int block_n, int block_k, "
    "ScalarType out_dtype, int align=1) -> Tensor",
    grouped_gemm_fp8_ref, fake=grouped_gemm_fp8_fake, traceable=never_traceable)
"""fp8 grouped GEMM ``x @ w_q[e].T`` with block-scale dequant, rounded to ``out_dtype``."""

moe_experts_fp8 = define_canonical(
    "moe_experts_fp8",
    "(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13_q, Tensor w13_scale, Tensor w2_q, "
    "Tensor w2_scale, int block_n, int block_k, ScalarType? out_dtype, int align=1) -> Tensor",
    moe_experts_fp8_ref, block=True,
    stages=("moe_permute_fp8", "grouped_gemm_fp8_swiglu_quant", "grouped_gemm_fp8", "moe_unpermute"))
"""The FP8 routed-expert block (``moe_experts`` with block-scaled E4M3 weights)."""


moe_permute_fp8_q = define_canonical(
    "moe_permute_fp8_q",
    "(Tensor xq, Tensor x_scale, Tensor topk_ids, int num_experts) -> (Tensor, Tensor, Tensor, Tensor)",
    moe_permute_fp8_q_ref, fake=moe_permute_fp8_q_fake)
"""``moe_permute_fp8`` of tokens that arrive quantized (FP8 EP dispatch): codes and scales moved, no rounding.
Reference only (a gather Inductor compiles): the rows are half the bytes of the bf16 permute's."""

moe_experts_fp8_q = define_canonical(
    "moe_experts_fp8_q",
    "(Tensor xq, Tensor x_scale, Tensor topk_ids, Tensor topk_weights, Tensor w13_q, Tensor w13_scale, "
    "Tensor w2_q, Tensor w2_scale, int block_n, int block_k, ScalarType act_dtype, ScalarType? out_dtype) -> Tensor",
    moe_experts_fp8_q_ref, block=True,
    stages=("moe_permute_fp8_q", "grouped_gemm_fp8_swiglu_quant", "grouped_gemm_fp8", "moe_unpermute"))
"""The FP8 block on pre-quantized tokens (the quant pass emits it behind an FP8 EP dispatch)."""

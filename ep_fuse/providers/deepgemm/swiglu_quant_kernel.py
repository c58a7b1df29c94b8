"""Triton kernel behind the DeepGEMM provider's gate|up stage: SwiGLU + 1 x ``group`` FP8 requant of the bf16
gate|up rows DeepGEMM wrote, on the aligned layout (rows past ``seg_indptr[E]`` are skipped: no stage reads them).

Quantization is the reference's rule (``scale = amax / 448``, round-to-nearest-even codes, the same helper as
:mod:`ep_fuse.providers.triton.fp8_kernel`), applied to ``silu(gate) * up`` computed in fp32 from the bf16
gate and up.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ep_fuse.providers.triton.fp8_kernel import FP8_MAX, quantize_fp8
from ep_fuse.providers.triton.jit_helpers import INTERPRET


@triton.jit
def _swiglu_quant_kernel(H, SEG, Q, S, I, NG, E, shm, sqm, ssm, G: tl.constexpr, INTERP: tl.constexpr):
    """Program (row, group): ``silu(h[row, cols]) * h[row, I + cols]`` quantized to codes ``Q`` and scale ``S``."""
    pid = tl.program_id(0)
    row = pid // NG
    g = pid - row * NG
    if row < tl.load(SEG + E):
        cols = g * G + tl.arange(0, G)
        cm = cols < I
        base = H + row.to(tl.int64) * shm
        gate = tl.load(base + cols, mask=cm, other=0.0).to(tl.float32)
        up = tl.load(base + I + cols, mask=cm, other=0.0).to(tl.float32)
        v = gate / (1.0 + tl.exp(-gate)) * up
        scale = tl.max(tl.abs(v), 0) / FP8_MAX
        tl.store(Q + row.to(tl.int64) * sqm + cols, quantize_fp8(v, scale, INTERP), mask=cm)
        tl.store(S + row.to(tl.int64) * ssm + g, scale)


def launch_swiglu_quant(h: torch.Tensor, seg_indptr: torch.Tensor, q: torch.Tensor, s: torch.Tensor,
                        group: int) -> None:
    """``h`` [M, 2I] (gate | up) -> codes ``q`` [M, I] and scales ``s`` [M, I / group], rows below
    ``seg_indptr[E]`` (``group`` a power of two dividing I)."""
    m, i = q.shape
    ng = s.shape[1]
    if m == 0 or ng == 0:
        return
    _swiglu_quant_kernel[(m * ng,)](h, seg_indptr, q, s, i, ng, seg_indptr.shape[0] - 1, h.stride(0), q.stride(0),
                                     s.stride(0), G=group, INTERP=INTERPRET, num_warps=1 if group <= 256 else 4)

"""Triton kernel for RMSNorm and residual add + RMSNorm (one pass over HBM, fp32 statistics).

Imported lazily (first launch): set ``TRITON_INTERPRET=1`` before that to run it on the CPU. Every
bf16/fp16 value is upcast right after its load (the interpreter's bf16 arithmetic is wrong) and
rounded only where the model rounds: the residual sum, the ``llama`` cast before the weight, and
the store.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
import triton
import triton.language as tl

MODES = {"llama": 0, "weight_fp32": 1, "gemma": 2, "none": 3}
MAX_BLOCK = 16384
"""Widest row held in registers at once; wider rows take the two-pass chunked kernel."""


@triton.jit
def _round(x, DT: tl.constexpr, EMULATE_RTNE: tl.constexpr):
    """``x`` (fp32) rounded to ``DT`` and back to fp32, round-to-nearest-even.

    The interpreter truncates on fp32 -> bf16 conversions, so there the rounding is done on the bits.
    """
    if EMULATE_RTNE and DT == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        r = bits.to(tl.float32, bitcast=True)
        return tl.where(x != x, x, r)
    return x.to(DT).to(tl.float32)


@triton.jit
def _for_store(x, DT: tl.constexpr, EMULATE_RTNE: tl.constexpr):
    """``x`` ready for a store into ``DT`` (the store itself converts; only the interpreter needs help)."""
    if EMULATE_RTNE and DT == tl.bfloat16:
        return _round(x, DT, EMULATE_RTNE)
    return x


@triton.jit
def _row_kernel(
    X, R, W, Y, S,
    n_rows, N, eps,
    stride_x, stride_r, stride_y, stride_s,
    HAS_RES: tl.constexpr, HAS_W: tl.constexpr, MODE: tl.constexpr, CAST_DT: tl.constexpr,
    SUM_DT: tl.constexpr, OUT_DT: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
    EMULATE_RTNE: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0,
                eviction_policy="evict_first").to(tl.float32)
    if HAS_RES:
        r = tl.load(R + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
        s = _round(x + r, SUM_DT, EMULATE_RTNE)
        tl.store(S + rows64[:, None] * stride_s + cols[None, :], s, mask=mask)
        x = s
    var = tl.sum(x * x, axis=1) / N
    rstd = tl.math.rsqrt(var + eps)
    n = x * rstd[:, None]
    if HAS_W:
        w = tl.load(W + cols, mask=col_mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        if MODE == 0:
            y = _round(n, CAST_DT, EMULATE_RTNE) * w[None, :]
        elif MODE == 1:
            y = n * w[None, :]
        else:
            y = n * (w[None, :] + 1.0)
    else:
        y = n
    tl.store(Y + rows64[:, None] * stride_y + cols[None, :], _for_store(y, OUT_DT, EMULATE_RTNE), mask=mask)


@triton.jit
def _chunked_kernel(
    X, R, W, Y, S,
    n_rows, N, eps,
    stride_x, stride_r, stride_y, stride_s,
    HAS_RES: tl.constexpr, HAS_W: tl.constexpr, MODE: tl.constexpr, CAST_DT: tl.constexpr,
    SUM_DT: tl.constexpr, OUT_DT: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
    EMULATE_RTNE: tl.constexpr,
):
    # one row per program; pass 1 accumulates sum of squares (and writes the residual sum),
    # pass 2 re-reads the (rounded) row and writes the output
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        m = cols < N
        x = tl.load(X + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
        if HAS_RES:
            r = tl.load(R + row * stride_r + cols, mask=m, other=0.0).to(tl.float32)
            s = _round(x + r, SUM_DT, EMULATE_RTNE)
            tl.store(S + row * stride_s + cols, s, mask=m)
            x = s
        acc += x * x
    rstd = tl.math.rsqrt(tl.sum(acc, axis=0) / N + eps)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        m = cols < N
        if HAS_RES:
            x = tl.load(S + row * stride_s + cols, mask=m, other=0.0).to(tl.float32)
        else:
            x = tl.load(X + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
        n = x * rstd
        if HAS_W:
            w = tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
            if MODE == 0:
                y = _round(n, CAST_DT, EMULATE_RTNE) * w
            elif MODE == 1:
                y = n * w
            else:
                y = n * (w + 1.0)
        else:
            y = n
        tl.store(Y + row * stride_y + cols, _for_store(y, OUT_DT, EMULATE_RTNE), mask=m)


_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    block_n: int
    rows: int
    num_warps: int
    chunked: bool = False


@functools.lru_cache(maxsize=256)
def launch_config(n: int, elem_bytes: int, n_rows: int) -> LaunchConfig:
    """Block shape per row width: wide rows get one row and many warps, narrow rows share a program."""
    block = triton.next_power_of_2(n)
    if block > MAX_BLOCK:
        return LaunchConfig(4096, 1, 16, chunked=True)
    if block >= 4096:
        return LaunchConfig(block, 1, 16 if block * elem_bytes >= 16384 else 8)
    rows = max(1, min(4096 // block, triton.next_power_of_2(max(n_rows, 1))))
    warps = 4 if block * rows <= 2048 else 8
    return LaunchConfig(block, rows, warps)


def launch(
    x2: torch.Tensor,
    r2: torch.Tensor | None,
    weight: torch.Tensor | None,
    y2: torch.Tensor,
    s2: torch.Tensor | None,
    eps: float,
    mode: str,
    cast_dtype: torch.dtype | None,
    config: LaunchConfig | None = None,
) -> None:
    """Run the kernel on 2-D row views (last dim contiguous)."""
    n_rows, n = x2.shape
    if n_rows == 0:
        return
    cfg = config or launch_config(n, x2.element_size(), n_rows)
    kernel = _chunked_kernel if cfg.chunked else _row_kernel
    rows = 1 if cfg.chunked else cfg.rows
    grid = (triton.cdiv(n_rows, rows),)
    kernel[grid](
        x2, r2 if r2 is not None else x2, weight if weight is not None else x2, y2,
        s2 if s2 is not None else y2,
        n_rows, n, eps,
        x2.stride(0), r2.stride(0) if r2 is not None else 0, y2.stride(0), s2.stride(0) if s2 is not None else 0,
        HAS_RES=r2 is not None, HAS_W=weight is not None, MODE=MODES[mode],
        CAST_DT=_TL_DTYPES[cast_dtype or torch.float32], SUM_DT=_TL_DTYPES[x2.dtype], OUT_DT=_TL_DTYPES[y2.dtype],
        BLOCK_N=cfg.block_n, ROWS=rows, EMULATE_RTNE=_INTERPRET, num_warps=cfg.num_warps,
    )

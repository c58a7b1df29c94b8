"""Triton kernel for RMSNorm and residual add + RMSNorm (one pass over HBM, fp32 statistics).

Imported lazily (first launch): set ``TRITON_INTERPRET=1`` before that to run it on the CPU. Every
bf16/fp16 value is upcast right after its load (the interpreter's bf16 arithmetic is wrong) and
rounded only where the model rounds: the residual sum (and, with ``norm_dtype``, the sum the norm
reads), the ``llama`` cast before the weight, the ``none_rstd_cast`` statistic, and the store. All
constexprs are ints or bools so Inductor can also emit the launch itself.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from ep_fuse.providers.triton.jit_helpers import DTYPE_CODES, INTERPRET, for_store, round_as

MODES = {"llama": 0, "weight_fp32": 1, "gemma": 2, "none": 3, "none_rstd_cast": 4}
"""``MODE`` codes. 4 (``none_rstd_cast``): the statistic rounded to ``CAST_CODE`` before the multiply; the product of
two values of that dtype is exact in fp32, so the one rounding at the store is the model's."""
MAX_BLOCK = 16384
"""Widest row held in registers at once; wider rows take the two-pass chunked kernel."""


@triton.jit
def _weigh(n, w, MODE: tl.constexpr, CAST_CODE: tl.constexpr, EMULATE_RTNE: tl.constexpr):
    if MODE == 0:  # llama: round n to the model dtype, then multiply
        return round_as(n, CAST_CODE, EMULATE_RTNE) * w
    elif MODE == 1:  # weight_fp32
        return n * w
    elif MODE == 2:  # gemma
        return n * (w + 1.0)
    else:
        return n


@triton.jit
def _row_kernel(
    X, R, W, Y, S,
    n_rows, N, eps, stride_x, stride_r,
    HAS_RES: tl.constexpr, HAS_W: tl.constexpr, MODE: tl.constexpr, CAST_CODE: tl.constexpr,
    SUM_CODE: tl.constexpr, NORM_CODE: tl.constexpr, OUT_CODE: tl.constexpr, BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr, EMULATE_RTNE: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = (pid * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = round_as(x + r, SUM_CODE, EMULATE_RTNE)
        tl.store(S + rows[:, None] * N + cols[None, :], for_store(x, SUM_CODE, EMULATE_RTNE), mask=mask)
        if NORM_CODE != SUM_CODE:  # the norm reads the sum rounded to norm_dtype
            x = round_as(x, NORM_CODE, EMULATE_RTNE)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    if MODE == 4:  # none_rstd_cast
        rstd = round_as(rstd, CAST_CODE, EMULATE_RTNE)
    n = x * rstd[:, None]
    if HAS_W:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        y = _weigh(n, w[None, :], MODE, CAST_CODE, EMULATE_RTNE)
    else:
        y = n
    tl.store(Y + rows[:, None] * N + cols[None, :], for_store(y, OUT_CODE, EMULATE_RTNE), mask=mask)


@triton.jit
def _chunked_kernel(
    X, R, W, Y, S,
    n_rows, N, eps, stride_x, stride_r,
    HAS_RES: tl.constexpr, HAS_W: tl.constexpr, MODE: tl.constexpr, CAST_CODE: tl.constexpr,
    SUM_CODE: tl.constexpr, NORM_CODE: tl.constexpr, OUT_CODE: tl.constexpr, BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr, EMULATE_RTNE: tl.constexpr,
):
    # one row per program: pass 1 accumulates the sum of squares (writing the residual sum),
    # pass 2 re-reads the rounded row and writes the output
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        m = cols < N
        x = tl.load(X + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
        if HAS_RES:
            r = tl.load(R + row * stride_r + cols, mask=m, other=0.0).to(tl.float32)
            x = round_as(x + r, SUM_CODE, EMULATE_RTNE)
            tl.store(S + row * N + cols, for_store(x, SUM_CODE, EMULATE_RTNE), mask=m)
            if NORM_CODE != SUM_CODE:
                x = round_as(x, NORM_CODE, EMULATE_RTNE)
        acc += x * x
    rstd = tl.math.rsqrt(tl.sum(acc, axis=0) / N + eps)
    if MODE == 4:  # none_rstd_cast
        rstd = round_as(rstd, CAST_CODE, EMULATE_RTNE)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        m = cols < N
        if HAS_RES:
            x = tl.load(S + row * N + cols, mask=m, other=0.0).to(tl.float32)
            if NORM_CODE != SUM_CODE:
                x = round_as(x, NORM_CODE, EMULATE_RTNE)
        else:
            x = tl.load(X + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
        n = x * rstd
        if HAS_W:
            w = tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
            y = _weigh(n, w, MODE, CAST_CODE, EMULATE_RTNE)
        else:
            y = n
        tl.store(Y + row * N + cols, for_store(y, OUT_CODE, EMULATE_RTNE), mask=m)


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    block_n: int
    rows: int
    num_warps: int
    chunked: bool = False


@functools.lru_cache(maxsize=256)
def launch_config(n: int, elem_bytes: int) -> LaunchConfig:
    """Block shape per row width (never per row count, so one config serves dynamic batch sizes).

    Tuned on the GPU (docs/benchmarks.md): one row per program with many warps for wide rows,
    several rows per program for narrow ones. No L2 eviction hints: evict-first loads cost 2-4% there.
    """
    block = triton.next_power_of_2(n)
    if block > MAX_BLOCK:
        return LaunchConfig(2048, 1, 8, chunked=True)
    row_bytes = block * elem_bytes
    if row_bytes >= 16384:
        return LaunchConfig(block, 1, 32)
    if row_bytes >= 8192:
        return LaunchConfig(block, 1, 16)
    if row_bytes >= 4096:
        return LaunchConfig(block, 2, 8)
    rows = max(1, 8192 // row_bytes)
    return LaunchConfig(block, rows, 4 if block * rows <= 2048 else 8)


def launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    y: torch.Tensor,
    s: torch.Tensor | None,
    eps: float,
    mode: str,
    cast_dtype: torch.dtype | None,
    stride_x: int,
    stride_r: int,
    config: LaunchConfig | None = None,
    wrap: Callable[[Any], Any] | None = None,
    norm_dtype: torch.dtype | None = None,
) -> None:
    """Launch over the rows of ``x`` (unit-stride rows ``stride_x`` apart); ``y``/``s`` are contiguous; ``s`` has
    the sum's dtype (the operands' promoted one), and the norm reads it rounded to ``norm_dtype`` when given.

    ``wrap`` (``torch.library.wrap_triton``) lets Inductor trace the launch into its own code.
    """
    n = x.shape[-1]
    n_rows = x.numel() // n if n else 0
    if isinstance(n_rows, int) and n_rows == 0:
        return
    cfg = config or launch_config(int(n), x.element_size())
    kernel = _chunked_kernel if cfg.chunked else _row_kernel
    sum_dtype = s.dtype if s is not None else x.dtype
    rows = 1 if cfg.chunked else cfg.rows
    if wrap is not None:
        kernel = wrap(kernel)
    kernel[(triton.cdiv(n_rows, rows),)](
        x, residual if residual is not None else x, weight if weight is not None else x, y,
        s if s is not None else y,
        n_rows, n, eps, stride_x, stride_r,
        HAS_RES=residual is not None, HAS_W=weight is not None, MODE=MODES[mode],
        CAST_CODE=DTYPE_CODES[cast_dtype or torch.float32], SUM_CODE=DTYPE_CODES[sum_dtype],
        NORM_CODE=DTYPE_CODES[norm_dtype or sum_dtype], OUT_CODE=DTYPE_CODES[y.dtype], BLOCK_N=cfg.block_n,
        ROWS=rows, EMULATE_RTNE=int(INTERPRET),
        num_warps=cfg.num_warps,
    )

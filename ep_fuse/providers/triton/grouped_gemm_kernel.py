"""Triton grouped GEMMs over expert row segments: ``x @ w[e].T`` and the fused gate|up SwiGLU.

Rows are in expert-major order: expert ``e`` owns rows ``[seg[e], seg[e+1])`` of ``x``; rows from
``seg[E]`` on are written as zeros. The work list is built on the device, inside every program,
from ``seg_indptr`` alone (no host sync, so the launch is CUDA-graph capturable and traceable):

* a *tile* is ``BM`` rows of one expert; expert ``e`` has ``cdiv(count_e, BM)`` tiles, listed
  expert by expert, followed by the ``BM``-row tiles of the zero tail. At most ``min(E, M)`` experts
  hold rows, so the total never exceeds the static bound ``cdiv(M, BM) + min(E, M)`` and the flat grid
  is that times ``cdiv(N, BN)`` (grouped ``GROUP_M`` tiles at a time, for L2 reuse); programs past the
  real tiles store nothing. (At decode, M = T*K is far below E: a bound in E launched up to 30x more
  programs than could ever hold work, all of them scanning the offsets.)
* each program loads the ``E + 1`` offsets (a few hundred bytes, L2 resident), takes a cumulative
  sum of the tile counts and finds its expert by counting the experts that end before its tile.
* ``SWAP_AB`` computes ``w_tile @ x_tile.T`` so that the weight rows fill the MMA's M dimension
  (decode: a handful of rows per expert); the accumulator is transposed back for the epilogue.

Rows past the tile's segment are clamped into ``x`` and their results discarded by the store mask,
so the inner loop has no row masks; with ``K % BK == 0`` it has no masks at all. Numerics follow the
unfused model: fp32 accumulation, each GEMM output rounded to the input dtype, then silu and the
product rounded again. Under the interpreter the dot operands are upcast (bf16 dots are wrong there).
"""

from __future__ import annotations

import dataclasses

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from ep_fuse.providers.triton.gemm_tiles import (
    ACT_CODES,
    GemmConfig,
    accumulate,
    gated_rounded,
    operand_ptrs,
    swiglu_rounded,
)
from ep_fuse.providers.triton.jit_helpers import DTYPE_CODES, INTERPRET, for_store, round_as

MIN_BLOCK_E = 16
MAX_EXPERTS = 8192
"""Experts whose offsets one program scans in registers; more are declined on the host."""
DECODE_ROWS_PER_EXPERT = 16
"""At most this many rows per expert on average: the weight-bandwidth-bound decode regime."""
WIDE_DECODE_ROWS_PER_EXPERT = 4
"""Above this many rows per expert on average (still decode), the swapped tiles take 32 rows: one expert's weights
are then read by one tile wherever it holds up to 32 rows. With 16-row tiles an expert holding 17 to 32 rows read
its weights twice; Mixtral-8x7B-sized decode at T = 64 (16 rows per expert on average, 21 at most) ran its
experts in 849 us with 16-row tiles and 677 us with 32-row tiles (H200, CUDA-graph replays,
``bench/bench_moe_experts.py``); at 2 and 4 rows per expert the two tile heights measured within 2 %."""
MID_ROWS_PER_EXPERT = 64
"""Above the decode regime and up to this many rows per expert: 64-row tiles; 128-row tiles above."""


@triton.jit
def tile_rows(tile, SEG, M, E, BM: tl.constexpr, BLOCK_E: tl.constexpr):
    """``(expert, first row, row end, is_real)`` of work tile ``tile`` (see the module docstring)."""
    offs = tl.arange(0, BLOCK_E)
    inside = offs < E
    lo = tl.load(SEG + offs, mask=inside, other=0).to(tl.int32)
    hi = tl.load(SEG + offs + 1, mask=inside, other=0).to(tl.int32)
    lo = tl.minimum(tl.maximum(lo, 0), M)
    hi = tl.minimum(tl.maximum(hi, lo), M)
    ntiles = tl.where(inside, (hi - lo + BM - 1) // BM, 0)
    cum = tl.cumsum(ntiles, 0)
    total = tl.sum(ntiles, 0)
    e = tl.sum((cum <= tile).to(tl.int32), 0)
    first_tile = tl.sum(tl.where(offs < e, ntiles, 0), 0)
    row_lo = tl.sum(tl.where(offs == e, lo, 0), 0)
    row_hi = tl.sum(tl.where(offs == e, hi, 0), 0)
    seg_end = tl.minimum(tl.maximum(tl.load(SEG + E).to(tl.int32), 0), M)
    is_real = tile < total
    m_start = tl.where(is_real, row_lo + (tile - first_tile) * BM, seg_end + (tile - total) * BM)
    m_end = tl.where(is_real, tl.minimum(m_start + BM, row_hi), tl.minimum(m_start + BM, M))
    return tl.minimum(e, E - 1), m_start, m_end, is_real


@triton.jit
def work_item(M, N, E, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """``(tile, n-tile)`` of this program: ``GROUP_M`` tiles at a time, tiles fastest within a group."""
    pid = tl.program_id(0)
    num_tiles = tl.cdiv(M, BM) + tl.minimum(E, M)
    num_n = tl.cdiv(N, BN)
    per_group = GROUP_M * num_n
    first = (pid // per_group) * GROUP_M
    size = tl.minimum(num_tiles - first, GROUP_M)
    return first + (pid % per_group) % size, (pid % per_group) // size


@triton.jit
def _grouped_gemm_kernel(
    X, W, SEG, Y, M, N, K, E,
    sxm, swe, swn, sym,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, BLOCK_E: tl.constexpr,
    SWAP_AB: tl.constexpr, EVEN_K: tl.constexpr, SWIGLU: tl.constexpr, CODE: tl.constexpr,
    UPCAST_DOT: tl.constexpr, IEEE: tl.constexpr, EMULATE_RTNE: tl.constexpr,
    ACT: tl.constexpr, LIMIT, CAP_G, CAP_U, LIBDEVICE: tl.constexpr,
):
    """``Y [M, N] = X @ W[e].T`` per segment; ``SWIGLU``: N is I, gate rows ``[n, n+BN)`` and up rows
    ``[I+n, I+n+BN)`` of ``w13[e]`` share each ``X`` load and meet in the epilogue (``ACT``: the gated
    activation, :data:`~ep_fuse.providers.triton.gemm_tiles.ACT_CODES`); without ``SWIGLU``, ``ACT`` 5 is
    ``relu(y) ** 2`` of the rounded output (an up projection without a gate), rounded again."""
    tile, pid_n = work_item(M, N, E, BM, BN, GROUP_M)
    e, m_start, m_end, is_real = tile_rows(tile, SEG, M, E, BM, BLOCK_E)
    rm = m_start + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    xp, wp = operand_ptrs(X, W + e.to(tl.int64) * swe, tl.minimum(rm, M - 1), tl.minimum(rn, N - 1), rk,
                           sxm, swn, SWAP_AB)
    up = wp + N * swn  # within one expert's weight: < 2**31 (checked on the host)
    num_k = tl.where(is_real, tl.cdiv(K, BK), 0)
    acc, acc_u = accumulate(xp, wp, up, rk, K, num_k, BM, BN, BK, SWAP_AB, EVEN_K, UPCAST_DOT, IEEE, SWIGLU, False)
    if SWIGLU:
        if ACT == 0:
            y = swiglu_rounded(acc, acc_u, CODE, EMULATE_RTNE)
        else:
            y = gated_rounded(acc, acc_u, CODE, EMULATE_RTNE, ACT, LIMIT, CAP_G, CAP_U, LIBDEVICE)
    else:
        y = round_as(acc, CODE, EMULATE_RTNE)
        if ACT == 5:
            r = tl.maximum(y, 0.0)
            y = round_as(r * r, CODE, EMULATE_RTNE)
    mask = (rm < m_end)[:, None] & (rn < N)[None, :]
    tl.store(Y + rm[:, None].to(tl.int64) * sym + rn[None, :], for_store(y, CODE, EMULATE_RTNE), mask=mask)


def is_decode(m: int, e: int) -> bool:
    """Few rows per expert: every weight is read about once, the launch is weight-bandwidth bound."""
    return m <= DECODE_ROWS_PER_EXPERT * max(e, 1)


def config_for(m: int, n: int, k: int, e: int, *, swiglu: bool = False, interpret: bool = INTERPRET) -> GemmConfig:
    """Tile config from static shapes (``n``: output columns; ``swiglu``: two accumulators per tile).

    Decode (few rows per expert): swapped tiles of 16 rows, or 32 above :data:`WIDE_DECODE_ROWS_PER_EXPERT`, chosen
    from a sweep on an H200 (``bench/bench_moe_experts.py``: no other tile shape, stage count or warp count was
    more than 2 % faster at 2, 4 and 16 rows per expert). The larger regimes are not yet tuned. The interpreter gets
    small tiles of the same regimes.
    """
    decode = is_decode(m, e)
    if interpret:
        return GemmConfig(16, 16, 32, 4, 1, 1, swap_ab=True) if decode else GemmConfig(32, 32, 16, 4, 1, 2)
    if decode:
        return GemmConfig(32 if m > WIDE_DECODE_ROWS_PER_EXPERT * e else 16, 64, 128, 4, 4, 1, swap_ab=True)
    if m <= MID_ROWS_PER_EXPERT * e:
        return GemmConfig(64, 128, 64, 4, 4, 8)
    if swiglu:
        return GemmConfig(128, 128, 64, 8, 3, 8)
    return GemmConfig(128, 256, 64, 8, 3, 8)


def num_programs(m: int, n: int, e: int, cfg: GemmConfig) -> int:
    """The flat grid: the static tile bound (module docstring) times the N tiles (a size expression when
    ``m`` is symbolic: no guard)."""
    return (triton.cdiv(m, cfg.bm) + torch.sym_min(e, m)) * triton.cdiv(n, cfg.bn)


def block_e(e: int) -> int:
    return max(MIN_BLOCK_E, triton.next_power_of_2(e))


def _launch(x: torch.Tensor, w: torch.Tensor, seg: torch.Tensor, y: torch.Tensor, n: int, swiglu: bool,
            cfg: GemmConfig, wrap: Callable[[Any], Any] | None, act: tuple = ()) -> None:
    m, k = x.shape
    e = w.shape[0]
    if x.element_size() == 4 and cfg.num_stages > 3 and not INTERPRET:
        # fp32 operands: 4 stages of the 64-row tiles (3 buffered) need 240 KiB of shared memory, over the 227 KiB
        # an SM has (OutOfResources on the GPU); 3 stages fit
        cfg = dataclasses.replace(cfg, num_stages=3)
    fn = wrap(_grouped_gemm_kernel) if wrap is not None else _grouped_gemm_kernel
    grid = (num_programs(m, n, e, cfg),)
    name, limit, gate_cap, up_cap = act or ("silu", None, None, None)  # the gated activation (ep_fuse.ops.moe)
    extra = dict(ACT=ACT_CODES[name], LIMIT=float(limit or 0.0), CAP_G=float(gate_cap or 0.0),
                 CAP_U=float(up_cap or 0.0), LIBDEVICE=not INTERPRET)
    fn[grid](
        x, w, seg, y, m, n, k, e,
        x.stride(0), w.stride(0), w.stride(1), y.stride(0),
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_M=cfg.group_m, BLOCK_E=block_e(e), SWAP_AB=cfg.swap_ab,
        EVEN_K=k % cfg.bk == 0, SWIGLU=swiglu, CODE=DTYPE_CODES[x.dtype], UPCAST_DOT=INTERPRET,
        IEEE=x.dtype == torch.float32, EMULATE_RTNE=int(INTERPRET), **extra,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def launch_grouped_gemm(x: torch.Tensor, w: torch.Tensor, seg: torch.Tensor, y: torch.Tensor,
                        config: GemmConfig | None = None, wrap: Callable[[Any], Any] | None = None,
                        act: tuple = ()) -> None:
    """``y [M, N] = x [M, K] @ w[e].T`` per expert segment, zero tail (``x``, ``w`` unit stride along K);
    ``act``: an activation without a gate (``("relu2", None, None, None)``) applied to ``y``."""
    m, k = x.shape
    e, n = w.shape[0], w.shape[1]
    cfg = config or config_for(m, n, k, e)
    _launch(x, w, seg, y, n, False, cfg, wrap, act)


def launch_grouped_gemm_swiglu(x: torch.Tensor, w13: torch.Tensor, seg: torch.Tensor, y: torch.Tensor,
                               config: GemmConfig | None = None,
                               wrap: Callable[[Any], Any] | None = None, act: tuple = ()) -> None:
    """``y [M, I] = silu(x @ w13[e, :I].T) * (x @ w13[e, I:].T)`` per expert segment, zero tail; ``act``
    (``(name, limit, gate_cap, up_cap)``, empty for plain SwiGLU): another gated activation."""
    m, k = x.shape
    e, n = w13.shape[0], w13.shape[1] // 2
    cfg = config or config_for(m, n, k, e, swiglu=True)
    _launch(x, w13, seg, y, n, True, cfg, wrap, act)

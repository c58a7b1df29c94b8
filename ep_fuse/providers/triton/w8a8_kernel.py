"""Triton W8A8 int8 kernels: per-token quant and int8 grouped GEMMs with fused dequant epilogues.

Semantics: :mod:`ep_fuse.ops.w8a8`. The grouped GEMMs reuse the work list of
:mod:`ep_fuse.providers.triton.grouped_gemm_kernel` (tiles of ``BM`` rows of one expert built on the
device from ``seg_indptr``, flat grid ``(cdiv(M, BM) + min(E, M)) * cdiv(N, BN)``, ``SWAP_AB`` for decode):

* int8 x int8 -> int32 ``tl.dot`` (Hopper int8 tensor cores; both operands K-contiguous, the "NT"
  layout int8 MMAs want). Under the interpreter int8 dots are not trusted: each ``BK`` slice is
  multiplied in fp32 (exact: ``BK * 127^2 < 2^24``) and added to an int32 accumulator.
* epilogue: ``(float(acc) * x_scale[row]) * w_scale[e, col]``, then either the rounding to the output
  dtype (``grouped_gemm_w8a8``) or, with ``SWIGLU``, ``silu(gate) * up`` of the two accumulators
  written as fp32 (``grouped_gemm_w8a8_swiglu_quant``: the per-token requant needs the whole row's
  max, which one tile does not see, so it is a second launch of the per-token quant kernel over the
  fp32 rows -- it reads them once, as any fused version's second pass would).

Rounding to int8 codes is round-half-to-even via the 1.5 * 2^23 trick (exact for |v| < 2^22).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from ep_fuse.providers.triton.gemm_tiles import GemmConfig, accumulate, operand_ptrs
from ep_fuse.providers.triton.grouped_gemm_kernel import tile_rows, work_item, num_programs, block_e, is_decode
from ep_fuse.providers.triton.jit_helpers import DTYPE_CODES, INTERPRET, for_store, round_as

QUANT_BLOCK = 4096
"""Columns one per-token quant program handles per step (wider rows loop)."""


@triton.jit
def _rtne(v):
    return (v + 12582912.0) - 12582912.0  # 1.5 * 2**23: the fp32 add rounds to an integer, half to even


@triton.jit
def _quant_rows_kernel(X, Q, S, K, sxm, sqm, BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr):
    """Row ``program_id``: ``scale = amax / 127``, ``q = clamp(rtne(x * 127 / amax), -127, 127)``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    x_row = X + row * sxm
    q_row = Q + row * sqm
    if ONE_PASS:
        x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), 0)
    else:
        amax = tl.max(tl.zeros([BLOCK_K], dtype=tl.float32), 0)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_row + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(x), 0))
    inv = tl.where(amax > 0, 127.0 / tl.maximum(amax, 1e-30), 0.0)
    tl.store(S + row, amax / 127.0)
    if ONE_PASS:
        q = tl.minimum(tl.maximum(_rtne(x * inv), -127.0), 127.0)
        tl.store(q_row + cols, q.to(tl.int8), mask=cols < K)
    else:
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_row + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(_rtne(x * inv), -127.0), 127.0)
            tl.store(q_row + k0 + cols, q.to(tl.int8), mask=k0 + cols < K)


@triton.jit
def _w8a8_gemm_kernel(
    X, XS, W, WS, SEG, Y, M, N, K, E,
    sxm, swe, swn, swse, sym,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, BLOCK_E: tl.constexpr,
    SWAP_AB: tl.constexpr, EVEN_K: tl.constexpr, SWIGLU: tl.constexpr, CODE: tl.constexpr,
    EMULATE: tl.constexpr, EMULATE_RTNE: tl.constexpr,
):
    """``Y [M, N]``: dequantized ``X @ W[e].T`` (``SWIGLU``: N = I, gate rows ``n``, up rows ``I + n``)."""
    tile, pid_n = work_item(M, N, E, BM, BN, GROUP_M)
    e, m_start, m_end, is_real = tile_rows(tile, SEG, M, E, BM, BLOCK_E)
    rm = m_start + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    rm_c = tl.minimum(rm, M - 1)
    rn_c = tl.minimum(rn, N - 1)
    xp, wp = operand_ptrs(X, W + e.to(tl.int64) * swe, rm_c, rn_c, rk, sxm, swn, SWAP_AB)
    up = wp + N * swn  # within one expert's weight: < 2**31 (checked on the host)
    num_k = tl.where(is_real, tl.cdiv(K, BK), 0)
    acc, acc_u = accumulate(xp, wp, up, rk, K, num_k, BM, BN, BK, SWAP_AB, EVEN_K, EMULATE, False, SWIGLU, True)
    xs = tl.load(XS + rm_c)
    ws_row = WS + e.to(tl.int64) * swse
    ws = tl.load(ws_row + rn_c)
    v = (acc.to(tl.float32) * xs[:, None]) * ws[None, :]
    if SWIGLU:
        wsu = tl.load(ws_row + N + rn_c)
        u = (acc_u.to(tl.float32) * xs[:, None]) * wsu[None, :]
        v = v / (1.0 + tl.exp(-v)) * u
    else:
        v = round_as(v, CODE, EMULATE_RTNE)
    mask = (rm < m_end)[:, None] & (rn < N)[None, :]
    tl.store(Y + rm[:, None].to(tl.int64) * sym + rn[None, :], for_store(v, CODE, EMULATE_RTNE), mask=mask)


# --------------------------------------------------------------------------- configs and launches
def config_for(m: int, n: int, k: int, e: int, *, swiglu: bool = False, interpret: bool = INTERPRET) -> GemmConfig:
    """Tile config of an int8 grouped GEMM from static shapes (``n``: output columns).

    int8 tiles take ``BK = 128``-byte (or wider) K slices. Untuned guesses until
    ``bench/bench_w8a8.py``'s sweep says otherwise. The interpreter gets small tiles of the same regimes.
    """
    decode = is_decode(m, e)
    if interpret:
        return GemmConfig(16, 16, 32, 4, 1, 1, swap_ab=True) if decode else GemmConfig(32, 32, 32, 4, 1, 2)
    if decode:
        return GemmConfig(16, 64, 256, 4, 4, 1, swap_ab=True)
    if m <= 64 * e:
        return GemmConfig(64, 128, 128, 4, 4, 8)
    if swiglu:
        return GemmConfig(128, 128, 128, 8, 3, 8)
    return GemmConfig(128, 256, 128, 8, 3, 8)


def launch_quant_rows(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor,
                      wrap: Callable[[Any], Any] | None = None) -> None:
    """``q [M, K] int8``, ``s [M] fp32`` from ``x [M, K]`` (unit stride along K)."""
    m, k = x.shape
    block = min(triton.next_power_of_2(max(k, 1)), QUANT_BLOCK)
    fn = wrap(_quant_rows_kernel) if wrap is not None else _quant_rows_kernel
    fn[(m,)](x, q, s, k, x.stride(0), q.stride(0), BLOCK_K=block, ONE_PASS=k <= block,
             num_warps=4 if block <= 2048 else 8)


def launch_w8a8_gemm(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, seg: torch.Tensor,
                     y: torch.Tensor, *, swiglu: bool, config: GemmConfig | None = None,
                     wrap: Callable[[Any], Any] | None = None) -> None:
    """``y`` = dequantized int8 grouped GEMM (``swiglu``: fp32 ``silu(gate) * up`` of ``w13`` halves)."""
    m, k = xq.shape
    e = wq.shape[0]
    n = wq.shape[1] // 2 if swiglu else wq.shape[1]
    cfg = config or config_for(m, n, k, e, swiglu=swiglu)
    fn = wrap(_w8a8_gemm_kernel) if wrap is not None else _w8a8_gemm_kernel
    grid = (num_programs(m, n, e, cfg),)
    fn[grid](
        xq, xs, wq, ws, seg, y, m, n, k, e,
        xq.stride(0), wq.stride(0), wq.stride(1), ws.stride(0), y.stride(0),
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_M=cfg.group_m, BLOCK_E=block_e(e), SWAP_AB=cfg.swap_ab,
        EVEN_K=k % cfg.bk == 0, SWIGLU=swiglu, CODE=DTYPE_CODES[y.dtype], EMULATE=INTERPRET,
        EMULATE_RTNE=int(INTERPRET), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )

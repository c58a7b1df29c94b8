"""FP8 (E4M3, block-scaled) grouped GEMMs on the Hopper persistent machinery of
:mod:`~ep_fuse.providers.triton.grouped_gemm_tma_kernel`: the device-built tile table, persistent programs
walking (row tile, column tile) items ``GROUP_M`` tiles at a time, activation and weight codes fetched by TMA.

Same contract and numerics as ``_fp8_gemm_kernel`` in :mod:`~ep_fuse.providers.triton.fp8_kernel`: ``BK``
divides ``block_k``, so each K slice has one activation scale per row and one weight scale per output
column; ``acc += dot(xq, wq.T) * (x_scale * w_scale)`` with an fp8 x fp8 -> fp32 dot, and the same epilogue
(:func:`~ep_fuse.providers.triton.fp8_kernel.fp8_epilogue`: SwiGLU + 1 x ``BN`` requant, or the rounded
output). Scales are loaded by pointer (row clamped), codes by descriptor (``DESC=1`` device-side,
``DESC=2`` host-side) or by pointer on the same walk (``DESC=0``). Rows TMA fetches past a tile's segment
belong to the next expert: computed and not stored, as in the bf16 kernel.

Checked on a GPU by ``tests/gpu/test_gpu_fp8.py`` and measured by ``bench/bench_fp8.py --tma`` (``docs/benchmarks.md``):
1.06-1.10x the one-tile-per-program kernel from 64 rows per expert
(:data:`~ep_fuse.providers.triton.fp8.FP8_TMA_MIN_ROWS_PER_EXPERT`). ``TmaGemmConfig.expert_groups`` (groups
cut at expert boundaries, as in the bf16 kernel) is supported but not taken by :func:`config_for`: at
DeepSeek-V3 sizes (29 MB of fp8 gate|up weights per expert) it measured mixed, -4 % to +8 % per GEMM and size
, next to a spread of up to 5 % between two timings of one config.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from ep_fuse.providers.triton.fp8_kernel import fp8_epilogue
from ep_fuse.providers.triton.grouped_gemm_tma_kernel import (
    TmaGemmConfig,
    expert_item,
    walk_item,
    load_k,
    tile_entry,
    num_programs,
    tma_unsupported,
    walk_operands,
)
from ep_fuse.providers.triton.jit_helpers import DTYPE_CODES, INTERPRET


@triton.jit
def _fp8_gemm_tma_kernel(
    X, XS, W, WS, TABLE, SEG, Y, YS, M, N, K, W_ROWS, NW,
    sxm, sxsm, swn, swse, swsn, sym, sysm, NUM_PROGRAMS,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, EXPERT_GROUPS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DESC: tl.constexpr, SWIGLU: tl.constexpr, CODE: tl.constexpr, INTERP: tl.constexpr,
    EMULATE_RTNE: tl.constexpr,
):
    """``Y [M, N]``: block-dequantized ``X @ W[e].T`` per tile of the table; ``W`` read as [W_ROWS = E * NW, K]
    (``SWIGLU``: N = I, gate rows ``n``, up rows ``I + n``; fp8 codes ``Y`` and 1 x ``BN`` scales ``YS``).
    ``EXPERT_GROUPS``: the walk's groups cut at expert boundaries (``expert_item``, read from ``SEG``)."""
    if DESC == 1:
        xd = tl.make_tensor_descriptor(X, shape=[M, K], strides=[sxm, 1], block_shape=[BM, BK])
        wd = tl.make_tensor_descriptor(W, shape=[W_ROWS, K], strides=[swn, 1], block_shape=[BN, BK])
    else:
        xd = X
        wd = W
    rows_m = tl.arange(0, BM)
    rows_n = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    num_tiles = tl.load(TABLE)
    num_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    for item in tl.range(tl.program_id(0), num_tiles * num_n, NUM_PROGRAMS):
        if EXPERT_GROUPS:
            tile, pid_n = expert_item(item, TABLE, SEG, tl.cast(M, tl.int32), num_n, BM, GROUP_M)
        else:
            tile, pid_n = walk_item(item, num_tiles, num_n, GROUP_M)
        e, m_start, m_end, w_row = tile_entry(TABLE, tile, NW, pid_n, BN)
        e_c = tl.maximum(e, 0)
        rm = m_start + rows_m
        rn = pid_n * BN + rows_n
        rm_c = tl.minimum(rm, M - 1)
        rn_c = tl.minimum(rn, N - 1)
        ws_e = WS + e_c.to(tl.int64) * swse
        ws_row = (rn_c // BLOCK_N) * swsn
        wsu_row = ((N + rn_c) // BLOCK_N) * swsn
        num_k = tl.where(e >= 0, k_tiles, 0)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        acc_u = tl.zeros([BM, BN], dtype=tl.float32)
        for kk in tl.range(0, num_k):
            k0 = kk * BK
            kb = k0 // BLOCK_K
            a = load_k(xd, m_start, k0, rows_m, rk, K, M, sxm, DESC, INTERP)
            b = load_k(wd, w_row, k0, rows_n, rk, K, W_ROWS, swn, DESC, INTERP)
            sx = tl.load(XS + rm_c.to(tl.int64) * sxsm + kb)
            sw = tl.load(ws_e + ws_row + kb)
            acc += tl.dot(a, b.T) * (sx[:, None] * sw[None, :])
            if SWIGLU:
                bu = load_k(wd, w_row + N, k0, rows_n, rk, K, W_ROWS, swn, DESC, INTERP)
                swu = tl.load(ws_e + wsu_row + kb)
                acc_u += tl.dot(a, bu.T) * (sx[:, None] * swu[None, :])
        fp8_epilogue(acc, acc_u, rm, rn, m_end, N, Y, YS, sym, sysm, pid_n, SWIGLU, CODE, INTERP, EMULATE_RTNE)


def fp8_tma_unsupported(xq: torch.Tensor, wq: torch.Tensor, traced: bool = False) -> str | None:
    """``None`` when TMA can address the fp8 codes ``xq [M, K]`` and ``wq [E, N, K]`` (16-byte rows: K a
    multiple of 16), else why not."""
    return tma_unsupported(xq, wq, traced, dtypes=(torch.float8_e4m3fn,))


def config_for(m: int, n: int, k: int, e: int, block_k: int, *, swiglu: bool = False,
               interpret: bool = INTERPRET) -> TmaGemmConfig:
    """Tile config from ``bench/bench_fp8.py --tma`` (DeepSeek-V3 routed layer at 64, 128 and
    512 rows per expert): gate|up + SwiGLU on BM64 BN128 tiles with 4 warps (8 warps ran 6-9 % slower), 3
    stages up to 64 rows per expert and 4 above (4.5 % either way); down on BM64 BN256 with 8 warps and 4
    stages (the best at 64 and 128 rows per expert, 6.5 % off it at 512). ``SWIGLU`` tiles are ``BN = block_k``
    wide (the requant group)."""
    if interpret:
        return TmaGemmConfig(32, block_k if swiglu else 32, min(block_k, 32), 4, 2, 2)
    bk = min(block_k, 128)
    if swiglu:
        return TmaGemmConfig(64, block_k, bk, 4, 3 if m <= 64 * max(e, 1) else 4, 8)
    return TmaGemmConfig(64, 256, bk, 8, 4, 8)


def launch_fp8_gemm_tma(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, seg: torch.Tensor,
                        y: torch.Tensor, ys: torch.Tensor | None, block_n: int, block_k: int, *, swiglu: bool,
                        config: TmaGemmConfig | None = None, wrap: Callable[[Any], Any] | None = None) -> None:
    """As :func:`~ep_fuse.providers.triton.fp8_kernel.launch_fp8_gemm`, on the persistent TMA walk
    (:func:`~ep_fuse.providers.triton.grouped_gemm_tma_kernel.tma_unsupported` must pass for ``xq``/``wq``)."""
    m, k = xq.shape
    e, nw = wq.shape[0], wq.shape[1]
    n = nw // 2 if swiglu else nw
    cfg = config or config_for(m, n, k, e, block_k, swiglu=swiglu)
    if swiglu and cfg.bn != block_k:
        raise ValueError(f"the SwiGLU requant epilogue needs BN == block_k ({cfg.bn} != {block_k})")
    if block_k % cfg.bk:
        raise ValueError(f"BK {cfg.bk} does not divide block_k {block_k}")
    if cfg.small_bm or cfg.flatten:
        raise ValueError(f"small_bm={cfg.small_bm}, flatten={cfg.flatten}: the FP8 TMA kernel has neither swapped "
                         "last tiles nor a flattened walk (use 0 / False)")
    table, xd, wd, _ud, mode = walk_operands(xq, wq, seg, cfg, wrap)
    ys_ = ys if ys is not None else y
    grid = (num_programs(xq, m, n, e, cfg),)
    fn = wrap(_fp8_gemm_tma_kernel) if wrap is not None else _fp8_gemm_tma_kernel
    fn[grid](
        xd, xs, wd, ws, table, seg, y, ys_, m, n, k, e * nw, nw,
        xq.stride(0), xs.stride(0), wq.stride(1), ws.stride(0), ws.stride(1), y.stride(0), ys_.stride(0), grid[0],
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_M=cfg.group_m, EXPERT_GROUPS=cfg.expert_groups, BLOCK_N=block_n,
        BLOCK_K=block_k, DESC=mode, SWIGLU=swiglu, CODE=DTYPE_CODES[torch.float32 if swiglu else y.dtype],
        INTERP=INTERPRET, EMULATE_RTNE=int(INTERPRET), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )

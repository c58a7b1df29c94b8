"""Hopper grouped GEMMs (TMA, persistent) over expert row segments: the ``grouped_gemm`` /
``grouped_gemm_swiglu`` contract of :mod:`~ep_fuse.providers.triton.grouped_gemm_kernel`, for prefill-size
rows per expert.

Measured on a GPU and checked there by ``tests/gpu/test_gpu_moe_grouped_gemm_tma.py`` (``docs/benchmarks.md``);
``bench/bench_moe_grouped_gemm_tma.py`` measures it, :func:`~ep_fuse.providers.triton.grouped_gemm.grouped_gemm_tma_rule`
says where it runs.

Two launches, both CUDA-graph capturable (no tensor value is read on the host; grids and buffers are functions
of the sizes only, so they also trace at a symbolic row count):

1. :func:`_tile_table_kernel` builds the work list on the device from ``seg_indptr``. A *tile* is ``BM``
   rows of one expert; expert ``e`` owns ``cdiv(count_e, BM)`` tiles, listed expert by expert, then the
   ``BM``-row tiles of the zero tail (rows from ``seg[E]`` on). At most ``cdiv(M, BM) + min(E, M)`` tiles
   exist (the bound of the existing kernel), so the table is a static int32 buffer: ``TABLE[0]`` holds the
   tile count, ``TABLE[1]`` the experts' tiles (the tail's follow), tile ``t`` sits at ``4 + 4t`` as
   ``(expert or -1 for a tail tile, first row, row end, 0)``.
   Each program finds the experts of ``BLOCK_T`` tiles by counting, chunk by chunk of experts, those whose
   inclusive tile cumsum is ``<= t`` (and summing their tiles: the tile's index inside its expert).
2. :func:`_grouped_gemm_tma_kernel`: ``NUM_PROGRAMS`` persistent programs (one per SM by default) walk the
   ``tiles x cdiv(N, BN)`` items, ``GROUP_M`` tiles at a time (tiles fastest, so consecutive items share a
   weight tile), and run the K loop on tiles fetched by TMA: ``x`` as one [M, K] tensor and the weights as
   one [E * rows per expert, K] tensor (``DESC=1``: ``tl.make_tensor_descriptor`` on the device, which needs
   the global scratch allocator :func:`ensure_allocator` installs; ``DESC=2``: host-side
   ``TensorDescriptor`` arguments; ``DESC=0``: plain pointer loads, the same tile walk without TMA). TMA
   zero-fills outside each tensor, so the loop has no masks: rows past the tile's segment (the next
   expert's rows) and columns past ``N`` (the up half, the next expert) are computed and discarded by the
   masked store. ``SWIGLU``: gate rows ``[n, n+BN)`` and up rows ``[I+n, I+n+BN)`` share each ``x`` tile.
   Two options of the walk (``TmaGemmConfig``; :func:`config_for` takes both for DeepSeek-V3-sized gate|up
   weights): ``expert_groups`` cuts the ``GROUP_M`` groups at expert boundaries, so every row tile of an
   expert runs while its weight tiles are in L2 (the default groups let an expert straddle two groups, and
   its weights were read from HBM twice: Nsight Compute saw 17.5-18.4 GB of DRAM traffic at DeepSeek-V3 T4096
   where about 15.7 GB is the minimum, and 15.9-16.0 GB with expert groups);
   ``small_bm`` runs an expert's last tile of at most ``small_bm`` rows with the operands swapped
   (:func:`_k_loop` with ``SWAP``: weight rows as the MMA's M, rows as its N), so a ragged remainder does not compute
   a full ``BM``-row tile. ``flatten`` fuses the K loop into the walk: the walk then covers the experts'
   tiles only (``TABLE[1]``), each running all K slices, and a second loop stores the zero tail's tiles.

Epilogue and numerics as in the existing kernel: fp32 accumulation, each GEMM output rounded to the input
dtype, then silu and the product rounded again. There is no routing-weight epilogue: the grouped-GEMM ops
take no routing weights (``moe_unpermute`` applies them). The K loop is a ``tl.range`` software-pipelined
``num_stages`` deep; ``warp_specialize`` is passed through, but Triton 3.6 documents automatic warp
specialisation for Blackwell only, so it stays off unless the GPU sweep shows it works here.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from ep_fuse.providers.triton.gemm_tiles import swiglu_rounded
from ep_fuse.providers.triton.jit_helpers import DTYPE_CODES, INTERPRET, for_store, round_as

TMA_DTYPES = (torch.bfloat16, torch.float16)
_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8 e4m3"}
DESC_MODES = {"pointer": 0, "device": 1, "host": 2}
TABLE_HEADER = 4
"""int32 slots before the first tile entry (slot 0: tile count, slot 1: the experts' tiles); each entry is 4 slots
(16 bytes)."""
TABLE_BLOCK_T = 64
TABLE_CHUNK_E = 128
INTERPRET_PROGRAMS = 3
"""Persistent programs under the interpreter: fewer than the items, so each program walks several."""


@dataclasses.dataclass(frozen=True)
class TmaGemmConfig:
    """Tile shape and schedule of one persistent launch (``programs=0``: one program per SM)."""

    bm: int
    bn: int
    bk: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    programs: int = 0
    desc: str = "device"
    warp_specialize: bool = False
    flatten: bool = False
    """Fuse the walk's item loop and its K loop into one software-pipelined loop (``tl.range(flatten=True)``), so
    the next item's first K slices load during this item's epilogue. Triton fuses only a body with one K loop
    whose bound is the same for every item: with ``small_bm`` the walk stays nested. The fused loop holds more
    shared memory (64 x 256 SwiGLU tiles at 3 stages no longer fit)."""
    expert_groups: bool = False
    """Cut the ``GROUP_M`` groups of the walk at expert boundaries (:func:`expert_item`)."""
    small_bm: int = 0
    """Rows of an expert's *small* last tile (0: none): a last tile of at most ``small_bm`` rows runs with
    the operands swapped (weight rows as the MMA's M, the rows as its N), so a ragged remainder computes
    ``small_bm`` rows instead of ``bm``. A power of two from 16 up, below ``bm``."""

    def __post_init__(self) -> None:
        s = self.small_bm
        if s and (s < 16 or s & (s - 1) or s >= self.bm):
            raise ValueError(f"small_bm={s}: use 0 or a power of two from 16 up, below bm={self.bm}")

    def __str__(self) -> str:
        return (f"BM{self.bm} BN{self.bn} BK{self.bk} w{self.num_warps} s{self.num_stages} g{self.group_m} "
                f"p{self.programs or 'SM'} {self.desc}" + (" ws" if self.warp_specialize else "")
                + (" flat" if self.flatten else "")
                + (" xg" if self.expert_groups else "") + (f" small{self.small_bm}" if self.small_bm else ""))


@triton.jit
def _tile_table_kernel(SEG, TABLE, M, E, MAX_TILES, BM: tl.constexpr, BLOCK_T: tl.constexpr,
                       CHUNK_E: tl.constexpr):
    """Entries of tiles ``[pid * BLOCK_T, (pid + 1) * BLOCK_T)`` (module docstring); program 0 writes the count."""
    M = tl.cast(M, tl.int32)  # int64 when Inductor passes an unbacked size; the host keeps M below 2**31
    pid = tl.program_id(0)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    experts_before = tl.zeros([BLOCK_T], dtype=tl.int32)
    tiles_before = tl.zeros([BLOCK_T], dtype=tl.int32)
    total = pid * 0
    for c in range(tl.cdiv(E, CHUNK_E)):
        offs = c * CHUNK_E + tl.arange(0, CHUNK_E)
        inside = offs < E
        lo = tl.load(SEG + offs, mask=inside, other=0).to(tl.int32)
        hi = tl.load(SEG + offs + 1, mask=inside, other=0).to(tl.int32)
        lo = tl.minimum(tl.maximum(lo, 0), M)
        hi = tl.minimum(tl.maximum(hi, lo), M)
        ntiles = tl.where(inside, (hi - lo + BM - 1) // BM, 0)
        cum = tl.cumsum(ntiles, 0) + total
        done = (cum[None, :] <= t[:, None]) & inside[None, :]
        experts_before += tl.sum(done.to(tl.int32), 1)
        tiles_before += tl.sum(tl.where(done, ntiles[None, :], 0), 1)
        total += tl.sum(ntiles, 0)
    seg_end = tl.minimum(tl.maximum(tl.load(SEG + E).to(tl.int32), 0), M)
    e = tl.minimum(experts_before, E - 1)
    row_lo, row_hi = _expert_rows(SEG, e, M)
    real = t < total
    m_start = tl.where(real, row_lo + (t - tiles_before) * BM, seg_end + (t - total) * BM)
    m_end = tl.where(real, tl.minimum(m_start + BM, row_hi), tl.minimum(m_start + BM, M))
    ok = t < MAX_TILES
    entry = TABLE + 4 + 4 * t
    tl.store(entry, tl.where(real, e, -1), mask=ok)
    tl.store(entry + 1, m_start, mask=ok)
    tl.store(entry + 2, m_end, mask=ok)
    tl.store(entry + 3, t * 0, mask=ok)
    if pid == 0:
        tl.store(TABLE, tl.minimum(total + (M - seg_end + BM - 1) // BM, MAX_TILES))
        tl.store(TABLE + 1, tl.minimum(total, MAX_TILES))


@triton.jit
def _expert_rows(SEG, e, M):
    """Rows ``[lo, hi)`` of expert ``e``, ``seg_indptr`` clamped into ``[0, M]`` as the tile table reads it."""
    lo = tl.minimum(tl.maximum(tl.load(SEG + e).to(tl.int32), 0), M)
    hi = tl.minimum(tl.maximum(tl.load(SEG + e + 1).to(tl.int32), lo), M)
    return lo, hi


@triton.jit
def expert_item(item, TABLE, SEG, M, num_n, BM: tl.constexpr, GROUP_M: tl.constexpr):
    """``(tile, n-tile)`` of work item ``item`` with groups cut at expert boundaries: the items of an expert
    whose tiles are ``[f, f + c)`` are ``[f * num_n, (f + c) * num_n)``, walked ``GROUP_M`` of its tiles at a
    time (tiles fastest), so no group spans two experts and an expert's weight tiles are read while all of
    its row tiles run (a tail tile is a group of its own)."""
    t0 = item // num_n
    entry = TABLE + 4 + 4 * t0
    e = tl.load(entry)
    lo, hi = _expert_rows(SEG, tl.maximum(e, 0), M)
    j = tl.where(e >= 0, (tl.load(entry + 1) - lo) // BM, 0)
    c = tl.where(e >= 0, (hi - lo + BM - 1) // BM, 1)
    first = t0 - j
    tile, pid_n = walk_item(item - first * num_n, c, num_n, GROUP_M)
    return first + tile, pid_n


@triton.jit
def walk_item(item, num_tiles, num_n, GROUP_M: tl.constexpr):
    """``(tile, n-tile)`` of work item ``item``: ``GROUP_M`` tiles at a time, tiles fastest within a group."""
    per_group = GROUP_M * num_n
    first = (item // per_group) * GROUP_M
    size = tl.minimum(num_tiles - first, GROUP_M)
    return first + (item % per_group) % size, (item % per_group) // size


@triton.jit
def tile_entry(TABLE, tile, NW, pid_n, BN: tl.constexpr):
    """``(expert or -1, first row, row end, first weight row)`` of table entry ``tile`` at column tile ``pid_n``
    (weights read as one [E * NW, K] tensor)."""
    entry = TABLE + 4 + 4 * tile
    e = tl.load(entry)
    return e, tl.load(entry + 1), tl.load(entry + 2), tl.maximum(e, 0) * NW + pid_n * BN


@triton.jit
def load_k(src, row, k0, rows, rk, K, W_ROWS_OR_M, sr, DESC: tl.constexpr, UPCAST: tl.constexpr):
    """A [len(rows), BK] K-slice at (``row``, ``k0``): by descriptor, or clamped rows and masked K by pointer."""
    if DESC == 0:
        r = tl.minimum(row + rows, W_ROWS_OR_M - 1)
        v = tl.load(src + r[:, None].to(tl.int64) * sr + (k0 + rk)[None, :], mask=(k0 + rk < K)[None, :], other=0.0)
    else:
        v = src.load([row, k0])
    if UPCAST:
        v = v.to(tl.float32)
    return v


@triton.jit
def _grouped_gemm_tma_kernel(
    X, XS, W, WU, TABLE, SEG, Y, M, N, K, W_ROWS, NW,
    sxm, swn, sun, sym,
    NUM_PROGRAMS, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    EXPERT_GROUPS: tl.constexpr, SMALL_BM: tl.constexpr,
    DESC: tl.constexpr, SWIGLU: tl.constexpr, SPLIT_UP: tl.constexpr, CODE: tl.constexpr,
    UPCAST_DOT: tl.constexpr, EMULATE_RTNE: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, FLATTEN: tl.constexpr,
):
    """``Y [M, N] = X @ W[e].T`` per tile of the table; ``W`` is read as [W_ROWS = E * NW, K] (``NW`` rows per
    expert: ``N``, or ``2N`` for the gate|up weight when ``SWIGLU``). ``SPLIT_UP`` (dense GEMM + SwiGLU, one
    "expert"): the up rows come from their own [W_ROWS, K] weight ``WU`` (row stride ``sun``), at the gate's
    row, so the two nn.Linear weights are read in place. ``SMALL_BM`` (0: off): a tile of at most ``SMALL_BM``
    rows (an expert's ragged last tile) runs swapped (:func:`_k_loop`), reading ``x`` through ``XS``
    (``[SMALL_BM, BK]`` blocks; host descriptor for ``DESC`` 2, else ``X`` again)."""
    if DESC == 1:
        xs = tl.make_tensor_descriptor(X, shape=[M, K], strides=[sxm, 1], block_shape=[BM, BK])
        if SMALL_BM > 0:
            xss = tl.make_tensor_descriptor(X, shape=[M, K], strides=[sxm, 1], block_shape=[SMALL_BM, BK])
        else:
            xss = xs
        ws = tl.make_tensor_descriptor(W, shape=[W_ROWS, K], strides=[swn, 1], block_shape=[BN, BK])
        if SPLIT_UP:
            us = tl.make_tensor_descriptor(WU, shape=[W_ROWS, K], strides=[sun, 1], block_shape=[BN, BK])
        else:
            us = ws
    else:  # host descriptors (DESC 2) or pointers (DESC 0)
        xs = X
        xss = XS
        ws = W
        us = WU
    num_tiles = tl.load(TABLE)
    num_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    step = tl.cast(NUM_PROGRAMS, tl.int32)
    if FLATTEN:  # the experts' tiles only, each running all K slices: a K loop bound the same for every item,
        # which Triton needs to fuse the two loops; the zero tail follows in a loop of its own
        walk_tiles = tl.load(TABLE + 1)
    else:
        walk_tiles = num_tiles
    # int32 work items (they reach TMA coordinates, which are int32) where Inductor passes the program count,
    # a symbolic size, as int64
    for item in tl.range(tl.program_id(0), walk_tiles * num_n, step, flatten=FLATTEN):
        if EXPERT_GROUPS:
            tile, pid_n = expert_item(item, TABLE, SEG, tl.cast(M, tl.int32), num_n, BM, GROUP_M)
        else:
            tile, pid_n = walk_item(item, walk_tiles, num_n, GROUP_M)
        e, m_start, m_end, w_row = tile_entry(TABLE, tile, NW, pid_n, BN)
        if FLATTEN:
            num_k = k_tiles
        else:
            num_k = tl.where(e >= 0, k_tiles, 0)
        if SMALL_BM > 0 and m_end - m_start <= SMALL_BM:  # an expert's ragged last tile, operands swapped
            # (own names: a variable set in both branches of a run-time `if` must keep one shape)
            acc_t, acc_ut = _k_loop(xss, ws, us, m_start, w_row, N, K, M, W_ROWS, sxm, swn, sun, num_k, SMALL_BM, BN,
                                    BK, DESC, SWIGLU, SPLIT_UP, UPCAST_DOT, True, False)
            _store_tile(acc_t, acc_ut, Y, m_start, m_end, pid_n, N, sym, SMALL_BM, BN, SWIGLU, True, CODE,
                        EMULATE_RTNE)
        else:
            acc, acc_u = _k_loop(xs, ws, us, m_start, w_row, N, K, M, W_ROWS, sxm, swn, sun, num_k, BM, BN, BK,
                                 DESC, SWIGLU, SPLIT_UP, UPCAST_DOT, False, WARP_SPECIALIZE)
            _store_tile(acc, acc_u, Y, m_start, m_end, pid_n, N, sym, BM, BN, SWIGLU, False, CODE, EMULATE_RTNE)
    if FLATTEN:  # the zero tail (rows past seg[E]): zeros, no K loop
        for item in tl.range(tl.program_id(0), (num_tiles - walk_tiles) * num_n, step):
            tile = walk_tiles + item // num_n
            pid_n = item % num_n
            _e, m_start, m_end, _w = tile_entry(TABLE, tile, NW, pid_n, BN)
            zero = tl.zeros([BM, BN], dtype=tl.float32)
            _store_tile(zero, zero, Y, m_start, m_end, pid_n, N, sym, BM, BN, SWIGLU, False, CODE, EMULATE_RTNE)


@triton.jit
def _k_loop(xd, ws, us, m_start, w_row, N, K, M, W_ROWS, sxm, swn, sun, num_k, ROWS: tl.constexpr,
            BN: tl.constexpr, BK: tl.constexpr, DESC: tl.constexpr, SWIGLU: tl.constexpr, SPLIT_UP: tl.constexpr,
            UPCAST_DOT: tl.constexpr, SWAP: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """fp32 accumulators of one tile of ``ROWS`` rows x ``BN`` columns (gate and, for ``SWIGLU``, up):
    ``[ROWS, BN] = x . w.T``, or with ``SWAP`` ``[BN, ROWS] = w . x.T`` (the weight rows fill the MMA's M,
    at least 64 on Hopper, and a few rows its N)."""
    rows = tl.arange(0, ROWS)
    rows_n = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    if SWAP:
        acc = tl.zeros([BN, ROWS], dtype=tl.float32)
        acc_u = tl.zeros([BN, ROWS], dtype=tl.float32)
    else:
        acc = tl.zeros([ROWS, BN], dtype=tl.float32)
        acc_u = tl.zeros([ROWS, BN], dtype=tl.float32)
    for kk in tl.range(0, num_k, warp_specialize=WARP_SPECIALIZE):
        k0 = kk * BK
        a = load_k(xd, m_start, k0, rows, rk, K, M, sxm, DESC, UPCAST_DOT)
        b = load_k(ws, w_row, k0, rows_n, rk, K, W_ROWS, swn, DESC, UPCAST_DOT)
        if SWAP:
            acc = tl.dot(b, a.T, acc)
        else:
            acc = tl.dot(a, b.T, acc)
        if SWIGLU:
            if SPLIT_UP:
                bu = load_k(us, w_row, k0, rows_n, rk, K, W_ROWS, sun, DESC, UPCAST_DOT)
            else:
                bu = load_k(ws, w_row + N, k0, rows_n, rk, K, W_ROWS, swn, DESC, UPCAST_DOT)
            if SWAP:
                acc_u = tl.dot(bu, a.T, acc_u)
            else:
                acc_u = tl.dot(a, bu.T, acc_u)
    return acc, acc_u


@triton.jit
def _store_tile(acc, acc_u, Y, m_start, m_end, pid_n, N, sym, ROWS: tl.constexpr, BN: tl.constexpr,
                SWIGLU: tl.constexpr, SWAP: tl.constexpr, CODE: tl.constexpr, EMULATE_RTNE: tl.constexpr):
    """Round (and SwiGLU) the accumulators of :func:`_k_loop` and store rows ``[m_start, m_end)`` of the tile."""
    if SWIGLU:
        y = swiglu_rounded(acc, acc_u, CODE, EMULATE_RTNE)
    else:
        y = round_as(acc, CODE, EMULATE_RTNE)
    rm = m_start + tl.arange(0, ROWS)
    rn = pid_n * BN + tl.arange(0, BN)
    if SWAP:
        mask = (rn < N)[:, None] & (rm < m_end)[None, :]
        tl.store(Y + rm[None, :].to(tl.int64) * sym + rn[:, None], for_store(y, CODE, EMULATE_RTNE), mask=mask)
    else:
        mask = (rm < m_end)[:, None] & (rn < N)[None, :]
        tl.store(Y + rm[:, None].to(tl.int64) * sym + rn[None, :], for_store(y, CODE, EMULATE_RTNE), mask=mask)


# --------------------------------------------------------------------------- host side
def max_tiles(m: int, e: int, bm: int) -> int:
    """Static bound on the tiles of ``m`` rows over ``e`` experts (module docstring; a size expression when
    ``m`` is symbolic)."""
    return triton.cdiv(m, bm) + torch.sym_min(e, m)


@functools.lru_cache(maxsize=16)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_programs(x: torch.Tensor, m: int, n: int, e: int, cfg: TmaGemmConfig) -> int:
    """The persistent grid: ``cfg.programs`` (0: the SM count) capped by the static bound on the items."""
    if cfg.programs:
        want = cfg.programs
    elif x.device.type == "cuda":
        want = _sm_count(x.device.index if x.device.index is not None else torch.cuda.current_device())
    else:
        want = INTERPRET_PROGRAMS
    return torch.sym_max(1, torch.sym_min(want, max_tiles(m, e, cfg.bm) * triton.cdiv(n, cfg.bn)))


EXPERT_GROUPS_MIN_WEIGHT_BYTES = 16 << 20
"""Gate|up weights of one expert from which :func:`config_for` cuts the walk's groups at expert boundaries and
runs swapped 32-row last tiles. About three experts are in flight at once on 132 SMs; once their weights
outgrow the 50 MB L2, an expert whose row tiles fall into two groups has its weights read from HBM twice.
Measured (``docs/benchmarks.md``): DeepSeek-V3's 58.7 MB per expert, T4096 gate|up + SwiGLU 1.10-1.15x and the
layer 1.02-1.04x; Qwen3-30B-A3B's 6.3 MB: the GEMM even, the layer 0.96x, so it keeps the plain walk."""


FEW_EXPERTS = 16
"""At most this many experts: the few-large-experts configs of :func:`config_for` (Mixtral's 8)."""
FEW_EXPERT_TILES_MIN_ROWS_PER_EXPERT = 256
"""Below this many rows per expert on average (a concrete row count), few large experts take the many-experts
gate|up + SwiGLU config too. Mixtral-8x7B-sized (``bench/bench_moe_grouped_gemm_tma.py``, 2026-12-04): at 64 /
128 rows per expert 64 x 256 tiles with expert groups and swapped 32-row last tiles ran 528 / 624 µs against
556 / 728 µs on 128 x 128 tiles (1.05x / 1.17x); at 512 and 2048 rows per expert 128 x 128 is the measured best
(config_for). The down GEMM keeps its config (no consistent winner at 64 / 128 rows per expert)."""


def _few_experts_config(swiglu: bool) -> TmaGemmConfig:
    return TmaGemmConfig(128, 128, 64, 8, 3, 8) if swiglu else TmaGemmConfig(128, 256, 64, 8, 3, 16)


def _many_experts_config(n: int, k: int, swiglu: bool) -> TmaGemmConfig:
    if swiglu:
        if 2 * n * k * 2 >= EXPERT_GROUPS_MIN_WEIGHT_BYTES:  # gate|up rows x K x 2 bytes (bf16 / fp16)
            return TmaGemmConfig(64, 256, 64, 8, 3, 8, expert_groups=True, small_bm=32)
        return TmaGemmConfig(64, 256, 64, 8, 3, 8)
    return TmaGemmConfig(128, 256, 64, 8, 4, 8, flatten=True)


def config_for(m: int, n: int, k: int, e: int, *, swiglu: bool = False, interpret: bool = INTERPRET) -> TmaGemmConfig:
    """Tile config, from ``bench/bench_moe_grouped_gemm_tma.py``'s runs (``docs/benchmarks.md``).

    Many small experts (DeepSeek-V3 E256, Qwen3-30B-A3B E128): gate|up + SwiGLU on 64 x 256 tiles (1.07-1.32x
    ``torch._grouped_mm``, vs 1.03-1.27x on 128 x 128), with groups cut at expert boundaries and swapped
    32-row last tiles where one expert's weights reach :data:`EXPERT_GROUPS_MIN_WEIGHT_BYTES`; down on
    128 x 256 with 4 stages (expert groups there: -7 % to +5 %, not taken) and the K loop flattened into the
    walk (:attr:`TmaGemmConfig.flatten`; against the nested walk: Qwen3-30B-A3B T4096 1.02-1.15x,
    DeepSeek-V3 T4096 0.95-1.05x and T16384 1.01-1.05x, the layers within noise; gate|up + SwiGLU, two
    accumulators, ran 0.78-0.92x flattened). Few large experts (Mixtral E8, at most :data:`FEW_EXPERTS`):
    gate|up on 128 x 128 with 3 stages (1.03x at T2048 where 64 x 256 ran 0.97x) from
    :data:`FEW_EXPERT_TILES_MIN_ROWS_PER_EXPERT` rows per expert (below it the many-experts config, where its
    256-column tiles fill the output), down on 128 x 256 with GROUP_M 16 (1.02x at T2048, 0.98x with GROUP_M 8;
    flattened 0.97-1.01x, not taken). ``m`` counts only as a concrete ``int``: a symbolic row count takes the
    large-row configs (the size branches ask for each regime with a concrete bound). The interpreter gets small
    tiles of the same structure."""
    if interpret:
        return TmaGemmConfig(32, 16, 16, 4, 2, 2) if swiglu else TmaGemmConfig(32, 32, 16, 4, 2, 2)
    many = _many_experts_config(n, k, swiglu)
    if e > FEW_EXPERTS:
        return many
    few_rows = isinstance(m, int) and m < FEW_EXPERT_TILES_MIN_ROWS_PER_EXPERT * e
    if swiglu and few_rows and n % many.bn == 0:
        return many
    return _few_experts_config(swiglu)


def _null_allocator() -> bool:
    try:
        from triton.runtime import _allocation
    except ImportError:
        return False
    return isinstance(_allocation._allocator.get(), _allocation.NullAllocator)


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_allocator() -> None:
    """Device-side descriptors live in global scratch that Triton allocates per launch through
    ``triton.set_allocator``; install a torch allocator unless the caller has set one."""
    if _null_allocator():
        triton.set_allocator(_scratch)


def tma_unsupported(x: torch.Tensor, w: torch.Tensor, traced: bool = False,
                    dtypes: tuple[torch.dtype, ...] = TMA_DTYPES, rows_bounded: bool = False) -> str | None:
    """``None`` when the TMA kernel can address ``x [M, K]`` and ``w [E, rows, K]``, else why not.

    TMA needs 16-byte aligned bases and row strides, unit K stride and int32 coordinates; ``w`` is read as
    one [E * rows, K] tensor. ``traced``: the tensors are fake (Inductor inlining), so only the storage
    offset's alignment can be checked (fresh allocations and parameters are aligned). ``rows_bounded``: the
    caller guarantees fewer than 2**31 rows (a symbolic row count under a branch on it), so ``x``'s row count
    is not compared here (that would add a guard)."""
    if x.dtype not in dtypes or w.dtype != x.dtype:
        return f"dtype {x.dtype} (this TMA kernel takes {'/'.join(_SHORT.get(d, str(d)) for d in dtypes)})"
    if x.device.type == "cuda":
        if not INTERPRET and torch.cuda.get_device_capability(x.device)[0] < 9:
            return "TMA needs compute capability 9.0 or newer"
    elif not (x.device.type == "cpu" and INTERPRET):
        return f"{x.device.type} tensors (CUDA, or the CPU under the Triton interpreter)"
    size = x.element_size()
    if x.stride(1) != 1 or w.stride(2) != 1:
        return "x or w is not contiguous along K"
    if (x.stride(0) * size) % 16 or (w.stride(1) * size) % 16:
        return "row strides are not multiples of 16 bytes"
    if w.shape[0] > 1 and w.stride(0) != w.shape[1] * w.stride(1):
        return "the experts' weights are not one [E * rows, K] tensor"
    if (not rows_bounded and x.shape[0] >= 2**31) or w.shape[0] * w.shape[1] >= 2**31:
        return "more than 2**31 rows"
    for t in (x, w):
        aligned = (t.storage_offset() * size) % 16 == 0 if traced else t.data_ptr() % 16 == 0
        if not aligned:
            return "a base address is not 16-byte aligned"
    return None


def build_tile_table(seg: torch.Tensor, m: int, e: int, bm: int,
                     wrap: Callable[[Any], Any] | None = None) -> torch.Tensor:
    """The int32 tile table of ``m`` rows split by ``seg`` (E + 1 offsets) into ``bm``-row tiles, built on the
    device (module docstring); its size depends on the static sizes only."""
    bound = max_tiles(m, e, bm)
    table = torch.empty(TABLE_HEADER + 4 * bound, dtype=torch.int32, device=seg.device)
    prep = wrap(_tile_table_kernel) if wrap is not None else _tile_table_kernel
    prep[(torch.sym_max(1, triton.cdiv(bound, TABLE_BLOCK_T)),)](seg, table, m, e, bound, BM=bm, BLOCK_T=TABLE_BLOCK_T,
                                               CHUNK_E=TABLE_CHUNK_E)
    return table


def walk_operands(x: torch.Tensor, w: torch.Tensor, seg: torch.Tensor, cfg: TmaGemmConfig,
                  wrap: Callable[[Any], Any] | None, w_up: torch.Tensor | None = None) -> tuple[Any, ...]:
    """What a persistent walk launch takes besides its outputs: ``(table, x, w, w_up, mode)`` with the operands
    in ``cfg.desc``'s form (host ``TensorDescriptor`` s for mode 2, the tensors otherwise; ``w`` as one
    [E * rows, K] tensor), the tile table built on the device, and Triton's scratch allocator installed for
    device-side descriptors."""
    m, k = x.shape
    e, nw = w.shape[0], w.shape[1]
    table = build_tile_table(seg, m, e, cfg.bm, wrap)
    mode = DESC_MODES[cfg.desc]
    if mode == 2:
        from triton.tools.tensor_descriptor import TensorDescriptor

        w2d = w.as_strided((e * nw, k), (w.stride(1), 1), w.storage_offset())  # checked: one [E * rows, K] tensor
        wd = TensorDescriptor.from_tensor(w2d, [cfg.bn, cfg.bk])
        ud = TensorDescriptor.from_tensor(w_up, [cfg.bn, cfg.bk]) if w_up is not None else wd
        return table, TensorDescriptor.from_tensor(x, [cfg.bm, cfg.bk]), wd, ud, mode
    if mode == 1 and x.device.type == "cuda":
        ensure_allocator()
    return table, x, w, w_up if w_up is not None else w, mode


def _launch(x: torch.Tensor, w: torch.Tensor, seg: torch.Tensor, y: torch.Tensor, n: int, swiglu: bool,
            cfg: TmaGemmConfig, wrap: Callable[[Any], Any] | None, w_up: torch.Tensor | None = None) -> None:
    m, k = x.shape
    e, nw = w.shape[0], w.shape[1]
    table, xs, ws, us, mode = walk_operands(x, w, seg, cfg, wrap, w_up)
    xss = xs
    if cfg.small_bm and mode == 2:
        from triton.tools.tensor_descriptor import TensorDescriptor

        xss = TensorDescriptor.from_tensor(x, [cfg.small_bm, cfg.bk])
    grid = (num_programs(x, m, n, e, cfg),)
    fn = wrap(_grouped_gemm_tma_kernel) if wrap is not None else _grouped_gemm_tma_kernel
    fn[grid](
        xs, xss, ws, us, table, seg, y, m, n, k, e * nw, nw,
        x.stride(0), w.stride(1), (w_up if w_up is not None else w).stride(-2), y.stride(0), grid[0],
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_M=cfg.group_m, EXPERT_GROUPS=cfg.expert_groups,
        SMALL_BM=cfg.small_bm, DESC=mode, SWIGLU=swiglu, SPLIT_UP=w_up is not None,
        CODE=DTYPE_CODES[x.dtype], UPCAST_DOT=INTERPRET, EMULATE_RTNE=int(INTERPRET),
        WARP_SPECIALIZE=cfg.warp_specialize, FLATTEN=cfg.flatten, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def launch_grouped_gemm_tma(x: torch.Tensor, w: torch.Tensor, seg: torch.Tensor, y: torch.Tensor,
                            config: TmaGemmConfig | None = None, wrap: Callable[[Any], Any] | None = None) -> None:
    """``y [M, N] = x [M, K] @ w[e].T`` per expert segment, zero tail (:func:`tma_unsupported` must pass)."""
    m, k = x.shape
    e, n = w.shape[0], w.shape[1]
    _launch(x, w, seg, y, n, False, config or config_for(m, n, k, e), wrap)


def launch_grouped_gemm_swiglu_tma(x: torch.Tensor, w13: torch.Tensor, seg: torch.Tensor, y: torch.Tensor,
                                   config: TmaGemmConfig | None = None,
                                   wrap: Callable[[Any], Any] | None = None) -> None:
    """``y [M, I] = silu(x @ w13[e, :I].T) * (x @ w13[e, I:].T)`` per expert segment, zero tail."""
    m, k = x.shape
    e, n = w13.shape[0], w13.shape[1] // 2
    _launch(x, w13, seg, y, n, True, config or config_for(m, n, k, e, swiglu=True), wrap)


def dense_config_for(m: int, n: int, k: int, interpret: bool = INTERPRET) -> TmaGemmConfig:
    """Tile config of the dense GEMM + SwiGLU (one expert, any row count): the few-large-experts gate|up config."""
    return config_for(FEW_EXPERT_TILES_MIN_ROWS_PER_EXPERT, n, k, 1, swiglu=True, interpret=interpret)


def launch_gemm_swiglu_tma(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, y: torch.Tensor,
                           config: TmaGemmConfig | None = None, wrap: Callable[[Any], Any] | None = None) -> None:
    """Dense ``y [M, I] = silu(x @ w_gate.T) * (x @ w_up.T)`` (``w_gate``/``w_up`` [I, K], read in place) on the
    grouped kernel with one expert whose segment is every row (``seg = [0, M]``, built on the device)."""
    m, k = x.shape
    n = w_gate.shape[0]
    seg = torch.arange(2, dtype=torch.int32, device=x.device) * m
    _launch(x, w_gate.unsqueeze(0), seg, y, n, True, config or dense_config_for(m, n, k), wrap, w_up=w_up)


def dense_tma_unsupported(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                          traced: bool = False) -> str | None:
    """:func:`tma_unsupported` for the dense GEMM + SwiGLU (both weights addressed by TMA)."""
    return tma_unsupported(x, w_gate.unsqueeze(0), traced) or tma_unsupported(x, w_up.unsqueeze(0), traced)

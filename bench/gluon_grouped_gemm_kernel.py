"""Experiment for issue 16: a warp-specialised grouped GEMM + SwiGLU written in Gluon (Triton 3.6's
``triton.experimental.gluon``), for Hopper. Not wired into the provider; ``bench_gluon_grouped_gemm.py`` times it
against the shipped TMA kernel (``ep_fuse/providers/triton/grouped_gemm_tma_kernel.py``) on the same tile table.

What it tries: the shipped kernel is one software-pipelined loop per tile, so TMA loads stop at every tile boundary
(epilogue, next tile's prologue). Here one *load* warp walks the same items as the MMA warps and keeps a ring of
``STAGES`` shared-memory slots full across tile boundaries (``ready``/``empty`` mbarriers per slot); the MMA warps
(the default partition, two warpgroups for 8 warps) issue asynchronous wgmma on the gate and up slices, keep
``MMA_LAG`` K steps in flight and hand each slot back once the MMA that read it has retired.

Same contract as ``_grouped_gemm_tma_kernel`` with ``SWIGLU`` (``y = silu(x @ Wg.T) * (x @ Wu.T)`` per expert
segment, each GEMM rounded to bf16 then silu and the product rounded again, zeros past ``seg[E]``), the same tile
table (``build_tile_table``, ``BM``-row tiles) and the same item order (``GROUP_M`` tiles at a time, optionally cut
at expert boundaries). No swapped small tiles. Compiles only for sm_90 with Triton 3.6's Gluon API.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ep_fuse.providers.triton.gemm_tiles import swiglu_rounded
from ep_fuse.providers.triton.grouped_gemm_tma_kernel import _expert_item, _item


@gluon.jit
def _walk(item, TABLE, SEG, M, num_tiles, num_n, BM: gl.constexpr, GROUP_M: gl.constexpr,
          EXPERT_GROUPS: gl.constexpr):
    """``(tile, n-tile)`` of work item ``item``, by the TMA kernel's own scalar helpers (Gluon calls them as is)."""
    if EXPERT_GROUPS:
        tile, pid_n = _expert_item(item, TABLE, SEG, M, num_n, BM, GROUP_M)
    else:
        tile, pid_n = _item(item, num_tiles, num_n, GROUP_M)
    return tile, pid_n


@gluon.jit
def _advance(idx, phase, STAGES: gl.constexpr):
    idx = idx + 1
    wrap = idx == STAGES
    return gl.where(wrap, 0, idx), gl.where(wrap, phase ^ 1, phase)


@gluon.jit
def _load_partition(x_desc, w_desc, TABLE, SEG, M, N, NW, NUM_PROGRAMS, a_bufs, g_bufs, u_bufs, ready, empty,
                    GROUP_M: gl.constexpr, EXPERT_GROUPS: gl.constexpr):
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    STAGES: gl.constexpr = a_bufs.shape[0]
    NBYTES: gl.constexpr = x_desc.block_type.nbytes + 2 * w_desc.block_type.nbytes
    K = x_desc.shape[1]
    num_tiles = gl.load(TABLE)
    num_n = gl.cdiv(N, BN)
    idx = gl.to_tensor(0)
    phase = gl.to_tensor(1)  # a fresh barrier counts its previous (odd) phase as complete: the first pass is free
    for item in range(gl.program_id(0), num_tiles * num_n, NUM_PROGRAMS):
        tile, pid_n = _walk(item, TABLE, SEG, M, num_tiles, num_n, BM, GROUP_M, EXPERT_GROUPS)
        entry = TABLE + 4 + 4 * tile
        e = gl.load(entry)
        if e >= 0:
            m_start = gl.load(entry + 1)
            w_row = e * NW + pid_n * BN
            for k in range(0, K, BK):
                mbarrier.wait(empty.index(idx), phase)
                bar = ready.index(idx)
                mbarrier.expect(bar, NBYTES)
                tma.async_copy_global_to_shared(x_desc, [m_start, k], bar, a_bufs.index(idx))
                tma.async_copy_global_to_shared(w_desc, [w_row, k], bar, g_bufs.index(idx))
                tma.async_copy_global_to_shared(w_desc, [w_row + N, k], bar, u_bufs.index(idx))
                idx, phase = _advance(idx, phase, STAGES)


@gluon.jit
def _mma_partition(TABLE, SEG, Y, M, N, K, sym, NUM_PROGRAMS, a_bufs, g_bufs, u_bufs, ready, empty,
                   GROUP_M: gl.constexpr, EXPERT_GROUPS: gl.constexpr, MMA_LAG: gl.constexpr, num_warps: gl.constexpr):
    BM: gl.constexpr = a_bufs.shape[1]
    BK: gl.constexpr = a_bufs.shape[2]
    BN: gl.constexpr = g_bufs.shape[1]
    STAGES: gl.constexpr = a_bufs.shape[0]
    WM: gl.constexpr = min(num_warps, BM // 16)  # a warpgroup's 4 warps take 64 rows; more warps split N
    WN: gl.constexpr = num_warps // WM
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WM, WN],
                                                     instr_shape=[16, BN // WN, 16])
    num_tiles = gl.load(TABLE)
    num_n = gl.cdiv(N, BN)
    k_tiles = gl.cdiv(K, BK)
    idx = gl.to_tensor(0)
    phase = gl.to_tensor(0)
    for item in range(gl.program_id(0), num_tiles * num_n, NUM_PROGRAMS):
        tile, pid_n = _walk(item, TABLE, SEG, M, num_tiles, num_n, BM, GROUP_M, EXPERT_GROUPS)
        entry = TABLE + 4 + 4 * tile
        e = gl.load(entry)
        m_start = gl.load(entry + 1)
        m_end = gl.load(entry + 2)
        acc_g = gl.zeros([BM, BN], gl.float32, layout)
        acc_u = gl.zeros([BM, BN], gl.float32, layout)
        if e >= 0:
            for kk in range(k_tiles):
                mbarrier.wait(ready.index(idx), phase)
                a = a_bufs.index(idx)
                acc_g = warpgroup_mma(a, g_bufs.index(idx).permute((1, 0)), acc_g, is_async=True)
                acc_u = warpgroup_mma(a, u_bufs.index(idx).permute((1, 0)), acc_u, is_async=True)
                # the two MMAs of the step MMA_LAG back have retired: their slot goes back to the load warp. (The
                # slot is computed, not carried as ``prev = idx``: that alias is not loop-carried by the frontend,
                # which then released the tile's first slot every step and deadlocked the ring.)
                acc_g, acc_u = warpgroup_mma_wait(2 * MMA_LAG, deps=(acc_g, acc_u))
                mbarrier.arrive(empty.index((idx + STAGES - MMA_LAG) % STAGES), pred=kk >= MMA_LAG)
                idx, phase = _advance(idx, phase, STAGES)
            acc_g, acc_u = warpgroup_mma_wait(0, deps=(acc_g, acc_u))
            for j in gl.static_range(MMA_LAG):  # the last MMA_LAG steps' slots (fewer when K is shorter)
                mbarrier.arrive(empty.index((idx + STAGES - 1 - j) % STAGES), pred=j < k_tiles)
        y = swiglu_rounded(acc_g, acc_u, 1, 0).to(gl.bfloat16)  # the TMA kernel's epilogue (bf16 codes)
        rows = m_start + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
        cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
        mask = (rows < m_end)[:, None] & (cols < N)[None, :]
        gl.store(Y + rows[:, None].to(gl.int64) * sym + cols[None, :], y, mask=mask)


@gluon.jit
def gluon_grouped_gemm_swiglu_kernel(x_desc, w_desc, TABLE, SEG, Y, M, N, NW, sym, NUM_PROGRAMS,
                                     GROUP_M: gl.constexpr, EXPERT_GROUPS: gl.constexpr, STAGES: gl.constexpr,
                                     MMA_LAG: gl.constexpr, LOAD_WARPS: gl.constexpr, LOAD_REGS: gl.constexpr,
                                     num_warps: gl.constexpr):
    """``Y [M, N] = silu(x @ w[e, :N].T) * (x @ w[e, N:].T)`` per tile of the table; ``w_desc`` reads the gate|up
    weights as one [E * NW, K] tensor (``NW = 2N`` rows per expert). ``MMA_LAG`` K steps of MMAs stay in flight
    (at most ``STAGES - 1``)."""
    gl.static_assert(MMA_LAG >= 1 and MMA_LAG < STAGES, "MMA_LAG must be 1 .. STAGES - 1")
    dtype: gl.constexpr = x_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    g_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    u_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()  # the initialised barriers visible to the TMA unit before the first copy
    K = x_desc.shape[1]
    gl.warp_specialize([
        (_mma_partition, (TABLE, SEG, Y, M, N, K, sym, NUM_PROGRAMS, a_bufs, g_bufs, u_bufs, ready, empty, GROUP_M,
                          EXPERT_GROUPS, MMA_LAG, num_warps)),
        (_load_partition, (x_desc, w_desc, TABLE, SEG, M, N, NW, NUM_PROGRAMS, a_bufs, g_bufs, u_bufs, ready, empty,
                           GROUP_M, EXPERT_GROUPS)),
    ], [LOAD_WARPS], [LOAD_REGS])

"""Triton kernels of ``moe_experts_masked``: grouped GEMMs over the masked expert layout ``x [E, M, H]``.

Two launches, each over a flat work list built on the device from ``counts`` alone (no host sync: CUDA-graph
capturable and traceable):

* gate|up GEMM with the gated-activation epilogue into ``h [E, M, I]``, then the down GEMM into ``y [E, M, H]``;
* a *tile* is ``BM`` rows of one expert: expert ``e`` has ``cdiv(counts[e], BM)`` tiles, listed expert by
  expert; every program scans the ``E`` counts once (a few hundred bytes, L2 resident), takes their cumulative
  sum, and loops over the tiles ``p, p + P, ...`` (``P`` programs along the first grid dim), finding each
  tile's expert from the sum. Rows past a count are neither read nor written (the padding may hold NaN);
* ``P = min(E * cdiv(M, BM), cdiv(max_rows, BM) + E)``, where ``max_rows`` is the caller's bound on
  ``sum(counts)`` (DeepEP low-latency: ``W * C * min(K, E)``), far below the ``E * M`` padded rows at decode.
  The bound only sizes the grid: more rows than it are still all computed (programs take several tiles).

The K loop, the swapped small-row tiles and the epilogue's rounding are the grouped-GEMM kernels' own
(:mod:`~ep_fuse.providers.triton.gemm_tiles`).
"""

from __future__ import annotations

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
from ep_fuse.providers.triton.grouped_gemm_kernel import MIN_BLOCK_E  # counts one program scans in registers: at
# least this many, at most the grouped GEMMs' MAX_EXPERTS (the host check, grouped_gemm.expert_weight_limits)
from ep_fuse.providers.triton.jit_helpers import DTYPE_CODES, INTERPRET, for_store, round_as


@triton.jit
def _masked_gemm_kernel(
    X, W, COUNTS, Y, M, N, K, E,
    sxe, sxm, swe, swn, sye, sym,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BLOCK_E: tl.constexpr,
    SWAP_AB: tl.constexpr, EVEN_K: tl.constexpr, SWIGLU: tl.constexpr, CODE: tl.constexpr,
    UPCAST_DOT: tl.constexpr, IEEE: tl.constexpr, EMULATE_RTNE: tl.constexpr,
    ACT: tl.constexpr, LIMIT, CAP_G, CAP_U, LIBDEVICE: tl.constexpr,
):
    """``Y[e, :count] = X[e, :count] @ W[e].T``; ``SWIGLU``: N is I, gate rows ``[n, n+BN)`` and up rows
    ``[I+n, I+n+BN)`` of ``w13[e]`` share each ``X`` load and meet in the epilogue. Program ``p`` of the first
    grid dim takes tiles ``p, p + P, ...`` of the work list (module docstring)."""
    pid_n = tl.program_id(1)
    offs = tl.arange(0, BLOCK_E)
    inside = offs < E
    cnt = tl.load(COUNTS + offs, mask=inside, other=0).to(tl.int32)
    cnt = tl.minimum(tl.maximum(cnt, 0), M)
    ntiles = tl.where(inside, (cnt + BM - 1) // BM, 0)
    cum = tl.cumsum(ntiles, 0)
    total = tl.sum(ntiles, 0)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    for tile in range(tl.program_id(0), total, tl.num_programs(0)):
        e = tl.sum((cum <= tile).to(tl.int32), 0)
        first = tl.sum(tl.where(offs < e, ntiles, 0), 0)
        count = tl.sum(tl.where(offs == e, cnt, 0), 0)
        rm = (tile - first) * BM + tl.arange(0, BM)
        e64 = e.to(tl.int64)
        xp, wp = operand_ptrs(X + e64 * sxe, W + e64 * swe, tl.minimum(rm, count - 1), tl.minimum(rn, N - 1), rk,
                              sxm, swn, SWAP_AB)
        up = wp + N * swn  # within one expert's weight: < 2**31 (checked on the host)
        acc, acc_u = accumulate(xp, wp, up, rk, K, tl.cdiv(K, BK), BM, BN, BK, SWAP_AB, EVEN_K, UPCAST_DOT, IEEE,
                                SWIGLU, False)
        if SWIGLU:
            if ACT == 0:
                y = swiglu_rounded(acc, acc_u, CODE, EMULATE_RTNE)
            else:
                y = gated_rounded(acc, acc_u, CODE, EMULATE_RTNE, ACT, LIMIT, CAP_G, CAP_U, LIBDEVICE)
        else:
            y = round_as(acc, CODE, EMULATE_RTNE)
        mask = (rm < count)[:, None] & (rn < N)[None, :]
        tl.store(Y + e64 * sye + rm[:, None].to(tl.int64) * sym + rn[None, :], for_store(y, CODE, EMULATE_RTNE),
                 mask=mask)


def config_for(rows: int, n: int, k: int, e: int, *, interpret: bool = INTERPRET) -> GemmConfig:
    """Tile config from the row bound per expert (``rows``: ``max_rows / E``). Not yet tuned on a GPU: the
    grouped GEMMs' decode tiles (swapped 16-row tiles) up to 16 rows per expert, 64-row tiles above."""
    if interpret:
        return GemmConfig(16, 16, 32, 4, 1, 1, swap_ab=True) if rows <= 16 else GemmConfig(32, 32, 16, 4, 1, 1)
    if rows <= 16:
        return GemmConfig(16, 64, 128, 4, 4, 1, swap_ab=True)
    return GemmConfig(64, 128, 64, 4, 3, 1)


def num_tiles(e: int, m: int, max_rows: int, bm: int) -> int:
    """Row tiles the grid holds: every tile of every block, or the bound ``max_rows`` allows (module docstring)."""
    return min(e * triton.cdiv(m, bm), triton.cdiv(max_rows, bm) + e)


def block_e(e: int) -> int:
    return max(MIN_BLOCK_E, triton.next_power_of_2(e))


def _launch(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, y: torch.Tensor, n: int, swiglu: bool,
            max_rows: int, cfg: GemmConfig, wrap: Callable[[Any], Any] | None, act: tuple) -> None:
    e, m, k = x.shape
    fn = wrap(_masked_gemm_kernel) if wrap is not None else _masked_gemm_kernel
    grid = (num_tiles(e, m, max_rows, cfg.bm), triton.cdiv(n, cfg.bn))
    name, limit, gate_cap, up_cap = act
    fn[grid](
        x, w, counts, y, m, n, k, e,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), y.stride(0), y.stride(1),
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, BLOCK_E=block_e(e), SWAP_AB=cfg.swap_ab, EVEN_K=k % cfg.bk == 0,
        SWIGLU=swiglu, CODE=DTYPE_CODES[x.dtype], UPCAST_DOT=INTERPRET, IEEE=x.dtype == torch.float32,
        EMULATE_RTNE=int(INTERPRET), ACT=ACT_CODES[name], LIMIT=float(limit or 0.0), CAP_G=float(gate_cap or 0.0),
        CAP_U=float(up_cap or 0.0), LIBDEVICE=not INTERPRET, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def launch_moe_experts_masked(x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                              h: torch.Tensor, y: torch.Tensor, max_rows: int, act: tuple,
                              config: GemmConfig | None = None, wrap: Callable[[Any], Any] | None = None) -> None:
    """``h = act(x @ w13[e].T)`` then ``y = h @ w2[e].T`` on the first ``counts[e]`` rows of each expert block
    (``act``: ``(name, limit, gate_cap, up_cap)``; ``max_rows``: a bound on ``sum(counts)``)."""
    e, m, k = x.shape
    inter, hidden = w13.shape[1] // 2, w2.shape[1]
    max_rows = max_rows if 0 < max_rows < e * m else e * m
    per_expert = max(1, -(-max_rows // max(e, 1)))
    _launch(x, w13, counts, h, inter, True, max_rows, config or config_for(per_expert, inter, k, e), wrap, act)
    _launch(h, w2, counts, y, hidden, False, max_rows, config or config_for(per_expert, hidden, inter, e), wrap,
            act)

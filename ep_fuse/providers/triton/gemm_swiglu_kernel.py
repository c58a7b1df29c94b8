"""Triton GEMM with SwiGLU in the epilogue: ``silu(x @ Wg.T) * (x @ Wu.T)`` without the [T, 2I] intermediate.

Each program computes a [BM, BN] tile of the output with two fp32 accumulators over one pass of
x's K dim (x is read once for both weights; the two weights are read in place, as the two halves of
one concatenated gate|up operand). With few rows (decode) the tile is computed swapped,
``dot(w, x.T)``, so the weight rows fill the MMA's M dimension and small ``BN`` gives enough programs
to stream the weights at full bandwidth. The epilogue rounds like the unfused model: each GEMM
output, the silu and the product to the input dtype. Under the interpreter the dot operands are
upcast (bf16 dots are wrong there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ep_fuse.providers.triton.gemm_tiles import GemmConfig, accumulate, operand_ptrs, swiglu_rounded
from ep_fuse.providers.triton.jit_helpers import DTYPE_CODES, INTERPRET, for_store


@triton.jit
def _gemm_swiglu_kernel(
    X, WG, WU, Y, M, N, K,
    sxm, sgn, sun, sym,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, SWAP_AB: tl.constexpr,
    EVEN_K: tl.constexpr, CODE: tl.constexpr, UPCAST_DOT: tl.constexpr, IEEE: tl.constexpr,
    EMULATE_RTNE: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    # rows/columns past the edges are clamped into the operands; the store mask drops their results
    xp, gp = operand_ptrs(X, WG, tl.minimum(rm, M - 1), tl.minimum(rn, N - 1), rk, sxm, sgn, SWAP_AB)
    _, up = operand_ptrs(X, WU, tl.minimum(rm, M - 1), tl.minimum(rn, N - 1), rk, sxm, sun, SWAP_AB)
    acc_g, acc_u = accumulate(xp, gp, up, rk, K, tl.cdiv(K, BK), BM, BN, BK, SWAP_AB, EVEN_K, UPCAST_DOT, IEEE,
                               True, False)
    y = swiglu_rounded(acc_g, acc_u, CODE, EMULATE_RTNE)
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    tl.store(Y + rm[:, None].to(tl.int64) * sym + rn[None, :], for_store(y, CODE, EMULATE_RTNE), mask=mask)


DECODE_ROWS = 64
"""Up to this many rows the tile is computed swapped (weight-bandwidth-bound decode regime)."""


def gemm_config(m: int, n: int, k: int) -> GemmConfig:
    """Tile shape by row count (GPU sweeps, docs/benchmarks.md); the interpreter gets small tiles of
    the same two regimes."""
    if INTERPRET:
        return GemmConfig(16, 16, 32, 4, 1, 1, swap_ab=True) if m <= DECODE_ROWS else GemmConfig(32, 32, 32, 4, 1)
    if m <= DECODE_ROWS:  # <= 32 rows: 1.02-1.26x cuBLAS + Inductor's SwiGLU on four shapes
        return GemmConfig(max(16, triton.next_power_of_2(m)), 64, 128, 4, 5 if m <= 16 else 4, 1, swap_ab=True)
    if m <= 1024:
        return GemmConfig(128, 64, 64, 4, 4)
    return GemmConfig(128, 128, 64, 8, 3)


def launch(x2, wg, wu, y2, config: GemmConfig | None = None, wrap=None) -> None:  # noqa: ANN001
    """``y2 [M, I] = swiglu(x2 [M, H] @ wg.T, x2 @ wu.T)``; every operand has unit-stride rows."""

    m, k = x2.shape
    n = wg.shape[0]
    if isinstance(m, int) and m == 0:
        return
    cfg = config or gemm_config(int(m) if isinstance(m, int) else 4096, int(n), int(k))
    kernel = wrap(_gemm_swiglu_kernel) if wrap is not None else _gemm_swiglu_kernel
    grid = (triton.cdiv(m, cfg.bm) * triton.cdiv(n, cfg.bn),)
    kernel[grid](
        x2, wg, wu, y2, m, n, k,
        x2.stride(0), wg.stride(0), wu.stride(0), y2.stride(0),
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_M=cfg.group_m, SWAP_AB=cfg.swap_ab, EVEN_K=k % cfg.bk == 0,
        CODE=DTYPE_CODES[x2.dtype], UPCAST_DOT=INTERPRET, IEEE=x2.dtype == torch.float32,
        EMULATE_RTNE=int(INTERPRET), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )

"""Triton GEMM with SwiGLU in the epilogue: ``silu(x @ Wg.T) * (x @ Wu.T)`` without the [T, 2I] intermediate.

Each program computes a [BM, BN] tile of the output with two fp32 accumulators over one pass of
x's K dim (x is read once for both weights; the weights are read in place, no concatenated copy).
The epilogue rounds like the unfused model: each GEMM output, the silu and the product to the
input dtype. Under the interpreter the dot operands are upcast (bf16 dots are wrong there).
"""

from __future__ import annotations

import dataclasses

import triton
import triton.language as tl

from ep_fuse.providers.triton.rms_norm_kernel import INTERPRET, _for_store, _round


@triton.jit
def swiglu_rounded(acc_g, acc_u, CODE: tl.constexpr, EMULATE_RTNE: tl.constexpr):
    """``silu(gate) * up`` from fp32 GEMM accumulators, rounded where the unfused model rounds: each GEMM
    output to the input dtype, silu (computed in fp32) and the product again."""
    g = _round(acc_g, CODE, EMULATE_RTNE)
    u = _round(acc_u, CODE, EMULATE_RTNE)
    act = _round(g / (1.0 + tl.exp(-g)), CODE, EMULATE_RTNE)
    return _round(act * u, CODE, EMULATE_RTNE)


@triton.jit
def _gemm_swiglu_kernel(
    X, WG, WU, Y, M, N, K,
    sxm, sxk, sgn, sgk, sun, suk, sym,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, CODE: tl.constexpr,
    UPCAST_DOT: tl.constexpr, EMULATE_RTNE: tl.constexpr,
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
    xp = X + rm[:, None].to(tl.int64) * sxm + rk[None, :] * sxk
    gp = WG + rn[None, :].to(tl.int64) * sgn + rk[:, None] * sgk
    up = WU + rn[None, :].to(tl.int64) * sun + rk[:, None] * suk
    acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        kmask = rk < K - k * BK
        a = tl.load(xp, mask=(rm < M)[:, None] & kmask[None, :], other=0.0)
        bg = tl.load(gp, mask=kmask[:, None] & (rn < N)[None, :], other=0.0)
        bu = tl.load(up, mask=kmask[:, None] & (rn < N)[None, :], other=0.0)
        if UPCAST_DOT:
            a = a.to(tl.float32)
            bg = bg.to(tl.float32)
            bu = bu.to(tl.float32)
        acc_g = tl.dot(a, bg, acc_g)
        acc_u = tl.dot(a, bu, acc_u)
        xp += BK * sxk
        gp += BK * sgk
        up += BK * suk
    y = swiglu_rounded(acc_g, acc_u, CODE, EMULATE_RTNE)
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    tl.store(Y + rm[:, None].to(tl.int64) * sym + rn[None, :], _for_store(y, CODE, EMULATE_RTNE), mask=mask)


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    bm: int
    bn: int
    bk: int
    num_warps: int
    num_stages: int
    group_m: int = 8


def gemm_config(m: int, n: int, k: int) -> GemmConfig:
    """Tile shape by token count (tuned on an H200, docs/benchmarks.md)."""
    if INTERPRET:
        return GemmConfig(32, 32, 32, 4, 1)
    if m <= 64:
        return GemmConfig(64, 64, 128, 4, 4)
    if m <= 1024:
        return GemmConfig(128, 64, 64, 4, 4)
    return GemmConfig(128, 128, 64, 8, 3)


def launch(x2, wg, wu, y2, config: GemmConfig | None = None, wrap=None) -> None:  # noqa: ANN001
    from ep_fuse.providers.triton.rms_norm_kernel import DTYPE_CODES

    m, k = x2.shape
    n = wg.shape[0]
    if isinstance(m, int) and m == 0:
        return
    cfg = config or gemm_config(int(m) if isinstance(m, int) else 4096, int(n), int(k))
    kernel = wrap(_gemm_swiglu_kernel) if wrap is not None else _gemm_swiglu_kernel
    grid = (triton.cdiv(m, cfg.bm) * triton.cdiv(n, cfg.bn),)
    kernel[grid](
        x2, wg, wu, y2, m, n, k,
        x2.stride(0), x2.stride(1), wg.stride(0), wg.stride(1), wu.stride(0), wu.stride(1), y2.stride(0),
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_M=cfg.group_m, CODE=DTYPE_CODES[x2.dtype],
        UPCAST_DOT=INTERPRET, EMULATE_RTNE=int(INTERPRET), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )

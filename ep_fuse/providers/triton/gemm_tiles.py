"""Tile building blocks shared by the Triton GEMM kernels (dense GEMM + SwiGLU, bf16 and int8 grouped GEMMs).

A tile config (:class:`GemmConfig`), operand pointers and K-slice loads for ``dot(x, w.T)`` with
unit-stride K (optionally swapped, ``dot(w, x.T)``, so weight rows fill the MMA's M dimension when
there are few rows of x), and the SwiGLU epilogue rounded as the unfused model rounds.
"""

from __future__ import annotations

import dataclasses

import triton
import triton.language as tl

from ep_fuse.providers.triton.rms_norm_kernel import _round


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Tile shape and schedule of one GEMM launch."""

    bm: int
    bn: int
    bk: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    swap_ab: bool = False

    def __str__(self) -> str:
        return (f"BM{self.bm} BN{self.bn} BK{self.bk} w{self.num_warps} s{self.num_stages} g{self.group_m}"
                + (" swap" if self.swap_ab else ""))


@triton.jit
def swiglu_rounded(acc_g, acc_u, CODE: tl.constexpr, EMULATE_RTNE: tl.constexpr):
    """``silu(gate) * up`` from fp32 GEMM accumulators, rounded where the unfused model rounds: each GEMM
    output to the input dtype, silu (computed in fp32) and the product again."""
    g = _round(acc_g, CODE, EMULATE_RTNE)
    u = _round(acc_u, CODE, EMULATE_RTNE)
    act = _round(g / (1.0 + tl.exp(-g)), CODE, EMULATE_RTNE)
    return _round(act * u, CODE, EMULATE_RTNE)


@triton.jit
def _operand_ptrs(X, W, rm, rn, rk, sxm, swn, SWAP_AB: tl.constexpr):
    """x and w tile pointers, oriented for ``dot(x, w.T)`` (or ``dot(w, x.T)`` when ``SWAP_AB``)."""
    if SWAP_AB:
        xp = X + rm[None, :].to(tl.int64) * sxm + rk[:, None]
        wp = W + rn[:, None].to(tl.int64) * swn + rk[None, :]
    else:
        xp = X + rm[:, None].to(tl.int64) * sxm + rk[None, :]
        wp = W + rn[None, :].to(tl.int64) * swn + rk[:, None]
    return xp, wp


@triton.jit
def _load(p, rk, k_left, SWAP_OR_W: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr):
    """A K-slice of one operand; ``SWAP_OR_W`` says whether K runs along the tile's rows."""
    if EVEN_K:
        v = tl.load(p)
    elif SWAP_OR_W:
        v = tl.load(p, mask=(rk < k_left)[:, None], other=0.0)
    else:
        v = tl.load(p, mask=(rk < k_left)[None, :], other=0.0)
    if UPCAST:
        v = v.to(tl.float32)
    return v


@triton.jit
def _mma(a, b, acc, SWAP_AB: tl.constexpr, IEEE: tl.constexpr):
    if SWAP_AB:
        a, b = b, a
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)

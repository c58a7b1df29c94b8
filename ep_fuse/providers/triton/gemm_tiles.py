"""Tile building blocks shared by the Triton GEMM kernels (dense GEMM + SwiGLU, bf16 and int8 grouped GEMMs).

A tile config (:class:`GemmConfig`), operand pointers, K-slice loads and the K loop
(:func:`accumulate`) for ``dot(x, w.T)`` with unit-stride K (optionally swapped, ``dot(w, x.T)``, so
weight rows fill the MMA's M dimension when there are few rows of x), bf16/fp16/fp32 or int8, and the
SwiGLU epilogue rounded as the unfused model rounds (and :func:`gated_rounded`, its clamped / fp32 / soft-capped
variants and the GeGLUs).
"""

from __future__ import annotations

import dataclasses

import triton
import triton.language as tl
from triton.language.extra import libdevice

from ep_fuse.providers.triton.jit_helpers import round_as


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
    g = round_as(acc_g, CODE, EMULATE_RTNE)
    u = round_as(acc_u, CODE, EMULATE_RTNE)
    act = round_as(g / (1.0 + tl.exp(-g)), CODE, EMULATE_RTNE)
    return round_as(act * u, CODE, EMULATE_RTNE)


ACT_CODES = {"silu": 0, "silu_clamp": 1, "silu_clamp_post": 2, "silu_fp32": 3, "softcap_fp32": 4, "relu2": 5,
             "swigluoai": 6, "gelu_tanh": 7, "gelu": 8}
"""The ``ACT`` constexpr of :func:`gated_rounded` for each activation of ``ep_fuse.ops.moe.ACTS`` (``relu2``, without
a gate: the epilogue of the single-accumulator grouped GEMM)."""


@triton.jit
def _tanh(x, LIBDEVICE: tl.constexpr):
    """fp32 tanh: libdevice on a GPU; ``1 - 2 / (exp(2x) + 1)`` under the interpreter (no libdevice there)."""
    if LIBDEVICE:
        return libdevice.tanh(x)
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def gated_rounded(acc_g, acc_u, CODE: tl.constexpr, EMULATE_RTNE: tl.constexpr, ACT: tl.constexpr,
                  LIMIT, CAP_G, CAP_U, LIBDEVICE: tl.constexpr):
    """The gated activation ``ACT`` (:data:`ACT_CODES`) of fp32 GEMM accumulators, in the models' op order and
    rounded where they round (``ep_fuse.ops.moe``): each GEMM output to the input dtype first; the clamped
    forms round each clamp, silu and the product; the fp32 forms round once at the end. ``CAP_G`` / ``CAP_U``
    <= 0: no soft cap on that half; for ``swigluoai`` (6) ``CAP_G`` carries the sigmoid's scale. The GELUs (7 tanh,
    8 erf) run in fp32 in torch's op order (``0.5 * g * (1 + tanh(sqrt(2/pi) * (g + 0.044715 * g**3)))``,
    ``0.5 * g * (1 + erf(g / sqrt(2)))``), rounded, then the product rounded."""
    g = round_as(acc_g, CODE, EMULATE_RTNE)
    u = round_as(acc_u, CODE, EMULATE_RTNE)
    if ACT == 0:
        act = round_as(g / (1.0 + tl.exp(-g)), CODE, EMULATE_RTNE)
        y = round_as(act * u, CODE, EMULATE_RTNE)
    elif ACT == 1:
        g = round_as(tl.minimum(g, LIMIT), CODE, EMULATE_RTNE)
        u = round_as(tl.minimum(tl.maximum(u, -LIMIT), LIMIT), CODE, EMULATE_RTNE)
        act = round_as(g / (1.0 + tl.exp(-g)), CODE, EMULATE_RTNE)
        y = round_as(act * u, CODE, EMULATE_RTNE)
    elif ACT == 2:
        act = round_as(g / (1.0 + tl.exp(-g)), CODE, EMULATE_RTNE)
        act = round_as(tl.minimum(act, LIMIT), CODE, EMULATE_RTNE)
        u = round_as(tl.minimum(tl.maximum(u, -LIMIT), LIMIT), CODE, EMULATE_RTNE)
        y = round_as(act * u, CODE, EMULATE_RTNE)
    elif ACT == 3:
        y = round_as(g / (1.0 + tl.exp(-g)) * u, CODE, EMULATE_RTNE)
    elif ACT == 6:
        g = round_as(tl.minimum(g, LIMIT), CODE, EMULATE_RTNE)
        u = round_as(tl.minimum(tl.maximum(u, -LIMIT), LIMIT), CODE, EMULATE_RTNE)
        z = round_as(g * CAP_G, CODE, EMULATE_RTNE)
        sig = round_as(1.0 / (1.0 + tl.exp(-z)), CODE, EMULATE_RTNE)
        glu = round_as(g * sig, CODE, EMULATE_RTNE)
        y = round_as(round_as(u + 1.0, CODE, EMULATE_RTNE) * glu, CODE, EMULATE_RTNE)
    elif ACT == 7:
        inner = 0.7978845608028654 * (g + 0.044715 * (g * g * g))
        act = round_as(0.5 * g * (1.0 + _tanh(inner, LIBDEVICE)), CODE, EMULATE_RTNE)
        y = round_as(act * u, CODE, EMULATE_RTNE)
    elif ACT == 8:
        act = round_as(0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476)), CODE, EMULATE_RTNE)
        y = round_as(act * u, CODE, EMULATE_RTNE)
    else:
        cg = tl.where(CAP_G > 0, CAP_G, 1.0)
        cu = tl.where(CAP_U > 0, CAP_U, 1.0)
        a = tl.where(CAP_G > 0, _tanh(g / cg, LIBDEVICE) * cg, g)
        b = 1.0 / (1.0 + tl.exp(-g))
        c = tl.where(CAP_U > 0, _tanh(u / cu, LIBDEVICE) * cu, u)
        y = round_as(a * b * c, CODE, EMULATE_RTNE)
    return y


@triton.jit
def operand_ptrs(X, W, rm, rn, rk, sxm, swn, SWAP_AB: tl.constexpr):
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


@triton.jit
def _imma(a, b, acc, SWAP_AB: tl.constexpr, EMULATE: tl.constexpr):
    if SWAP_AB:
        a, b = b, a
    if EMULATE:  # exact per slice in fp32, accumulated in int32
        return acc + tl.dot(a, b, input_precision="ieee").to(tl.int32)
    return tl.dot(a, b, acc, out_dtype=tl.int32)


@triton.jit
def accumulate(xp, wp, up, rk, K, num_k, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                SWAP_AB: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                SWIGLU: tl.constexpr, INT8: tl.constexpr):
    """``x @ w.T`` (and ``x @ u.T`` when ``SWIGLU``) over ``num_k`` K-slices from the operand pointers of
    :func:`operand_ptrs`, returned as [BM, BN] accumulators: fp32, or int32 for int8 operands (``UPCAST``
    then means exact fp32 slices, as the interpreter needs)."""
    if SWAP_AB:
        if INT8:
            acc = tl.zeros([BN, BM], dtype=tl.int32)
            acc_u = tl.zeros([BN, BM], dtype=tl.int32)
        else:
            acc = tl.zeros([BN, BM], dtype=tl.float32)
            acc_u = tl.zeros([BN, BM], dtype=tl.float32)
    else:
        if INT8:
            acc = tl.zeros([BM, BN], dtype=tl.int32)
            acc_u = tl.zeros([BM, BN], dtype=tl.int32)
        else:
            acc = tl.zeros([BM, BN], dtype=tl.float32)
            acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    for k in range(num_k):
        a = _load(xp, rk, K - k * BK, SWAP_AB, EVEN_K, UPCAST)
        b = _load(wp, rk, K - k * BK, not SWAP_AB, EVEN_K, UPCAST)
        if INT8:
            acc = _imma(a, b, acc, SWAP_AB, UPCAST)
        else:
            acc = _mma(a, b, acc, SWAP_AB, IEEE)
        if SWIGLU:
            bu = _load(up, rk, K - k * BK, not SWAP_AB, EVEN_K, UPCAST)
            if INT8:
                acc_u = _imma(a, bu, acc_u, SWAP_AB, UPCAST)
            else:
                acc_u = _mma(a, bu, acc_u, SWAP_AB, IEEE)
            up += BK
        xp += BK
        wp += BK
    if SWAP_AB:
        acc = tl.trans(acc)
        acc_u = tl.trans(acc_u)
    return acc, acc_u

"""Triton FP8 (E4M3, block-scaled) kernels: 1 x g activation quant fused into the permute, and the
grouped GEMMs with block-scale dequantization in the K loop.

Semantics: :mod:`ep_fuse.ops.fp8`. **Verified only under the Triton interpreter**
(``tests/test_fp8.py``); on CUDA the provider declines unless ``EP_FUSE_UNVERIFIED_KERNELS=1``
(``tests/gpu/test_gpu_fp8.py`` is the GPU check).

* ``_permute_quant_kernel``: one program per (token, group): the token's ``g`` channels are loaded once,
  quantized (``scale = amax / 448``, ``code = rtne(x / scale)``) and stored to each of its valid
  permuted rows (destinations from :func:`ep_fuse.providers.triton.moe_permute_kernel.launch_permute_index`);
  tail rows get zero codes and scales. T rows are quantized, not T*K.
* ``_fp8_gemm_kernel``: the work list of :mod:`ep_fuse.providers.triton.grouped_gemm_kernel`; ``BK``
  divides ``block_k``, so each K slice has one activation scale per row and one weight scale per output
  column (``w_scale[e, n // block_n, k // block_k]``): ``acc += dot(xq, wq.T) * (x_scale * w_scale)``,
  the dot fp8 x fp8 -> fp32 (exact products). With ``SWIGLU`` the gate and up accumulators meet in an
  fp32 ``silu(gate) * up`` and, ``BN`` being the group, each row of the tile is one quantization group:
  the epilogue writes its fp8 codes and scale directly (no fp32 round trip).
* rounding to E4M3 is done on fp32 bits (:func:`_rtne_e4m3`: round-to-nearest-even at the value's fp8
  spacing) and the exact result converted, so the interpreter (whose fp32 -> fp8 cast is wrong where
  rounding carries into the next binade) and GPUs give the same codes; the division is ``div_rn``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from ep_fuse.ops.fp8 import aligned_seg_indptr
from ep_fuse.providers.triton.gemm_tiles import GemmConfig, operand_ptrs
from ep_fuse.providers.triton.grouped_gemm_kernel import tile_rows, work_item, block_e, is_decode, num_programs
from ep_fuse.providers.triton.moe_permute_kernel import token_destinations, index_config, launch_permute_index
from ep_fuse.providers.triton.jit_helpers import DTYPE_CODES, INTERPRET, for_store, round_as

FP8_MAX = tl.constexpr(448.0)


@triton.jit
def _rtne_e4m3(v):
    """fp32 ``v`` (|v| <= 448) rounded to the nearest E4M3 value, ties to even (exact in fp32)."""
    bits = v.to(tl.int32, bitcast=True)
    ex = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # E4M3 spacing: 2**(ex - 3); subnormals below 2**-6
    magic = (((ex + 147) << 23) | 0x400000).to(tl.float32, bitcast=True)  # 1.5 * 2**23 * spacing
    r = (v + magic) - magic
    return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)  # keep -0


@triton.jit
def quantize_fp8(v, scale, INTERP: tl.constexpr):
    """fp8 codes of fp32 ``v`` with dequant ``scale`` (broadcast); 0 where the scale is 0."""
    safe = tl.where(scale > 0, scale, 1.0)
    if INTERP:
        q = v / safe
    else:
        q = tl.math.div_rn(v, safe)
    q = tl.where(scale > 0, q, 0.0)
    q = _rtne_e4m3(tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX))
    return q.to(tl.float8e4nv)


@triton.jit
def _quant_group_kernel(X, Q, S, M, K, NG, sxm, sqm, ssm, G: tl.constexpr, GP: tl.constexpr, INTERP: tl.constexpr):
    """Program (row, group): ``S[row, g] = amax / 448`` and the group's codes."""
    pid = tl.program_id(0)
    row = (pid // NG).to(tl.int64)
    g = pid % NG
    cols = g * G + tl.arange(0, GP)
    cm = (tl.arange(0, GP) < G) & (cols < K)
    x = tl.load(X + row * sxm + cols, mask=cm, other=0.0).to(tl.float32)
    scale = tl.max(tl.abs(x), 0) / FP8_MAX
    tl.store(S + row * ssm + g, scale)
    tl.store(Q + row * sqm + cols, quantize_fp8(x, scale, INTERP), mask=cm)


@triton.jit
def _permute_quant_kernel(
    X, IDS, RANK, BASE, SEG, Q, S, SRC2DST, H, E, NG, sx, st0, st1, sqm, ssm,
    K: tl.constexpr, KP: tl.constexpr, CHUNK: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
    INTERP: tl.constexpr,
):
    """Program (token, group): quantize the token's group once, store it to its K destinations."""
    pid = tl.program_id(0)
    t = pid // NG
    g = pid % NG
    i, km, valid, dst = token_destinations(IDS, RANK, BASE, SRC2DST, t, g == 0, E, st0, st1, K, KP, CHUNK)
    cols = g * G + tl.arange(0, GP)
    cm = (tl.arange(0, GP) < G) & (cols < H)
    x = tl.load(X + t.to(tl.int64) * sx + cols, mask=cm, other=0.0).to(tl.float32)
    scale = tl.max(tl.abs(x), 0) / FP8_MAX
    q = quantize_fp8(x, scale, INTERP)
    tl.store(Q + dst[:, None] * sqm + cols[None, :], tl.broadcast_to(q[None, :], (KP, GP)),
             mask=valid[:, None] & cm[None, :])
    tl.store(S + dst * ssm + g, scale + tl.zeros((KP,), dtype=tl.float32), mask=valid)
    n_valid = tl.load(SEG + E)
    if (t + 1) * K > n_valid:  # this token's home rows t*K+k reach the zero tail
        home = i.to(tl.int64)
        zm = km & (home >= n_valid)
        tl.store(Q + home[:, None] * sqm + cols[None, :], tl.zeros((KP, GP), dtype=tl.float32).to(tl.float8e4nv),
                 mask=zm[:, None] & cm[None, :])
        tl.store(S + home * ssm + g, tl.zeros((KP,), dtype=tl.float32), mask=zm)


@triton.jit
def _fp8_gemm_kernel(
    X, XS, W, WS, SEG, Y, YS, M, N, K, E,
    sxm, sxsm, swe, swn, swse, swsn, sym, sysm,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr, SWIGLU: tl.constexpr,
    CODE: tl.constexpr, INTERP: tl.constexpr, EMULATE_RTNE: tl.constexpr,
):
    """``Y [M, N]``: block-dequantized ``X @ W[e].T``; ``SWIGLU``: N = I, gate rows ``n``, up rows ``I + n``,
    output fp8 codes ``Y`` and their 1 x ``BN`` scales ``YS``."""
    tile, pid_n = work_item(M, N, E, BM, BN, GROUP_M)
    e, m_start, m_end, is_real = tile_rows(tile, SEG, M, E, BM, BLOCK_E)
    rm = m_start + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    rm_c = tl.minimum(rm, M - 1)
    rn_c = tl.minimum(rn, N - 1)
    w_e = W + e.to(tl.int64) * swe
    ws_e = WS + e.to(tl.int64) * swse
    xp, wp = operand_ptrs(X, w_e, rm_c, rn_c, rk, sxm, swn, SWAP_AB)
    if SWAP_AB:
        acc = tl.zeros([BN, BM], dtype=tl.float32)
        acc_u = tl.zeros([BN, BM], dtype=tl.float32)
    else:
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    up = wp + N * swn
    ws_row = (rn_c // BLOCK_N) * swsn
    wsu_row = ((N + rn_c) // BLOCK_N) * swsn
    num_k = tl.where(is_real, tl.cdiv(K, BK), 0)
    for k in range(num_k):
        k0 = k * BK
        kb = k0 // BLOCK_K
        sx = tl.load(XS + rm_c * sxsm + kb)
        sw = tl.load(ws_e + ws_row + kb)
        if SWAP_AB:
            a = tl.load(xp, mask=(rk < K - k0)[:, None], other=0.0)
            b = tl.load(wp, mask=(rk < K - k0)[None, :], other=0.0)
        else:
            a = tl.load(xp, mask=(rk < K - k0)[None, :], other=0.0)
            b = tl.load(wp, mask=(rk < K - k0)[:, None], other=0.0)
        if INTERP:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if SWAP_AB:
            acc += tl.dot(b, a) * (sw[:, None] * sx[None, :])
        else:
            acc += tl.dot(a, b) * (sx[:, None] * sw[None, :])
        if SWIGLU:
            swu = tl.load(ws_e + wsu_row + kb)
            if SWAP_AB:
                bu = tl.load(up, mask=(rk < K - k0)[None, :], other=0.0)
            else:
                bu = tl.load(up, mask=(rk < K - k0)[:, None], other=0.0)
            if INTERP:
                bu = bu.to(tl.float32)
            if SWAP_AB:
                acc_u += tl.dot(bu, a) * (swu[:, None] * sx[None, :])
            else:
                acc_u += tl.dot(a, bu) * (sx[:, None] * swu[None, :])
            up += BK
        xp += BK
        wp += BK
    if SWAP_AB:
        acc = tl.trans(acc)
        acc_u = tl.trans(acc_u)
    fp8_epilogue(acc, acc_u, rm, rn, m_end, N, Y, YS, sym, sysm, pid_n, SWIGLU, CODE, INTERP, EMULATE_RTNE)


@triton.jit
def fp8_epilogue(acc, acc_u, rm, rn, m_end, N, Y, YS, sym, sysm, pid_n, SWIGLU: tl.constexpr, CODE: tl.constexpr,
                  INTERP: tl.constexpr, EMULATE_RTNE: tl.constexpr):
    """Store a [BM, BN] tile: ``SWIGLU``: fp8 codes of ``silu(acc) * acc_u`` and one scale per row (``BN`` is
    the requant group, column group ``pid_n``); else ``acc`` rounded to ``CODE``. Rows from ``m_end`` on and
    columns from ``N`` on are not written."""
    row_ok = rm < m_end
    col_ok = rn < N
    mask = row_ok[:, None] & col_ok[None, :]
    if SWIGLU:
        v = acc / (1.0 + tl.exp(-acc)) * acc_u
        v = tl.where(col_ok[None, :], v, 0.0)
        scale = tl.max(tl.abs(v), 1) / FP8_MAX  # BN is the group: one scale per row of the tile
        tl.store(Y + rm[:, None].to(tl.int64) * sym + rn[None, :], quantize_fp8(v, scale[:, None], INTERP), mask=mask)
        tl.store(YS + rm.to(tl.int64) * sysm + pid_n, scale, mask=row_ok)
    else:
        y = round_as(acc, CODE, EMULATE_RTNE)
        tl.store(Y + rm[:, None].to(tl.int64) * sym + rn[None, :], for_store(y, CODE, EMULATE_RTNE), mask=mask)


# --------------------------------------------------------------------------- configs and launches
def _bk(block_k: int, interpret: bool) -> int:
    """The K slice: at most 128 (32 in the interpreter) and a divisor of ``block_k`` (a power of two)."""
    return min(block_k, 32 if interpret else 128)


def config_for(m: int, n: int, k: int, e: int, block_k: int, *, swiglu: bool = False,
               interpret: bool = INTERPRET) -> GemmConfig:
    """Tile config of an FP8 grouped GEMM, from ``bench/bench_fp8.py --sweep`` (DeepSeek-V3
    routed layer): decode (T128) ``BM16`` swapped, 3 stages; prefill (T4096) ``BM64 BN128 BK128`` with 8 warps
    for gate|up + SwiGLU (its two fp32 accumulators spill with 4 warps: 14.0 ms vs 4.7 ms) and 4 warps for the
    down GEMM (2.29 ms vs 2.98 ms). 128-row tiles spill in both (21.5 / 2.85 ms).

    ``SWIGLU`` tiles are ``BN = block_k`` wide (the requant group)."""
    decode = is_decode(m, e)
    bk = _bk(block_k, interpret)
    if interpret:
        bn = block_k if swiglu else 32
        return GemmConfig(16, bn, bk, 4, 1, 1, swap_ab=True) if decode else GemmConfig(32, bn, bk, 4, 1, 2)
    if decode:
        return GemmConfig(16, block_k if swiglu else 128, bk, 4, 3, 1, swap_ab=True)
    if swiglu:
        return GemmConfig(64, block_k, bk, 8, 4, 8)
    return GemmConfig(64, 128, bk, 4, 3, 8)


def launch_quant_group(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, group: int,
                       wrap: Callable[[Any], Any] | None = None) -> None:
    """``q [M, K]`` fp8 and ``s [M, ceil(K/group)]`` from ``x [M, K]`` (unit stride along K)."""
    m, k = x.shape
    ng = s.shape[1]
    fn = wrap(_quant_group_kernel) if wrap is not None else _quant_group_kernel
    fn[(m * ng,)](x, q, s, m, k, ng, x.stride(0), q.stride(0), s.stride(0), G=group,
                  GP=triton.next_power_of_2(group), INTERP=INTERPRET, num_warps=1 if group <= 256 else 4)


@triton.jit
def _zero_padding_kernel(Q, S, START, END, H, NG, NHB, sqm, ssm, BLOCK_H: tl.constexpr):
    """Program (expert, column block): zero codes (and, in column block 0, scales) of the expert's padding rows
    ``[START[e], END[e])`` (fewer than ``align`` rows)."""
    pid = tl.program_id(0)
    e = pid // NHB
    hb = pid - e * NHB
    lo = tl.load(START + e)
    hi = tl.load(END + e)
    cols = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    cm = cols < H
    zq = tl.zeros((BLOCK_H,), dtype=tl.float32).to(tl.float8e4nv)
    first = lo.to(tl.int64)
    for j in range(0, hi - lo):
        row = first + j
        tl.store(Q + row * sqm + cols, zq, mask=cm)
        if hb == 0:
            for g0 in range(0, NG, BLOCK_H):
                gs = g0 + tl.arange(0, BLOCK_H)
                tl.store(S + row * ssm + gs, tl.zeros((BLOCK_H,), dtype=tl.float32), mask=gs < NG)


def launch_permute_quant(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, group: int, q: torch.Tensor,
                         s: torch.Tensor, src2dst: torch.Tensor, seg_indptr: torch.Tensor, align: int = 1,
                         wrap: Callable[[Any], Any] | None = None) -> None:
    """Fill ``q [M, H]``, ``s [M, ceil(H/group)]``, ``src2dst`` and ``seg_indptr`` (``align > 1``: the aligned
    layout of :mod:`ep_fuse.ops.fp8`: each expert's destinations shifted to its aligned start, then
    its padding rows zeroed)."""
    t, k = topk_ids.shape
    h = x.shape[1]
    if t * k == 0:
        seg_indptr.zero_()
        return
    cfg = index_config(t * k, num_experts)
    base, rank = launch_permute_index(topk_ids, num_experts, seg_indptr, cfg, wrap)
    pad_start = None
    if align > 1:
        seg_al = aligned_seg_indptr(seg_indptr, align)
        pad_start = seg_al[:-1] + seg_indptr.diff()  # each expert's first padding row
        shift = (seg_al - seg_indptr)[:-1].to(base.dtype)
        base = (base.view(-1, num_experts) + shift).view(-1)
        seg_indptr.copy_(seg_al)
    ng = s.shape[1]
    fn = wrap(_permute_quant_kernel) if wrap is not None else _permute_quant_kernel
    fn[(t * ng,)](x, topk_ids, rank, base, seg_indptr, q, s, src2dst, h, num_experts, ng, x.stride(0),
                  topk_ids.stride(0), topk_ids.stride(1), q.stride(0), s.stride(0),
                  K=k, KP=triton.next_power_of_2(k), CHUNK=cfg.chunk, G=group, GP=triton.next_power_of_2(group),
                  INTERP=INTERPRET, num_warps=1 if group <= 256 else 4)
    if pad_start is not None:
        bh = min(1024, triton.next_power_of_2(max(h, 16)))
        nhb = triton.cdiv(h, bh)
        zero = wrap(_zero_padding_kernel) if wrap is not None else _zero_padding_kernel
        zero[(num_experts * nhb,)](q, s, pad_start, seg_indptr[1:], h, ng, nhb, q.stride(0), s.stride(0),
                                   BLOCK_H=bh, num_warps=4)


def launch_fp8_gemm(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, seg: torch.Tensor,
                    y: torch.Tensor, ys: torch.Tensor | None, block_n: int, block_k: int, *, swiglu: bool,
                    config: GemmConfig | None = None, wrap: Callable[[Any], Any] | None = None) -> None:
    """``y`` = block-dequantized fp8 grouped GEMM (``swiglu``: fp8 codes of ``silu(gate) * up`` + scales ``ys``)."""
    m, k = xq.shape
    e = wq.shape[0]
    n = wq.shape[1] // 2 if swiglu else wq.shape[1]
    cfg = config or config_for(m, n, k, e, block_k, swiglu=swiglu)
    if swiglu and cfg.bn != block_k:
        raise ValueError(f"the SwiGLU requant epilogue needs BN == block_k ({cfg.bn} != {block_k})")
    if block_k % cfg.bk:
        raise ValueError(f"BK {cfg.bk} does not divide block_k {block_k}")
    fn = wrap(_fp8_gemm_kernel) if wrap is not None else _fp8_gemm_kernel
    ys_ = ys if ys is not None else y
    fn[(num_programs(m, n, e, cfg),)](
        xq, xs, wq, ws, seg, y, ys_, m, n, k, e,
        xq.stride(0), xs.stride(0), wq.stride(0), wq.stride(1), ws.stride(0), ws.stride(1), y.stride(0),
        ys_.stride(0),
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_M=cfg.group_m, BLOCK_E=block_e(e), BLOCK_N=block_n, BLOCK_K=block_k,
        SWAP_AB=cfg.swap_ab, SWIGLU=swiglu, CODE=DTYPE_CODES[torch.float32 if swiglu else y.dtype], INTERP=INTERPRET,
        EMULATE_RTNE=int(INTERPRET), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )

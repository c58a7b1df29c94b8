"""Triton kernels for the MoE permute / unpermute stages (no sort, no host synchronisation).

``moe_permute`` in three launches over the flat slots ``i = t*K + k`` (``key`` = expert id, or -1
for an invalid slot):

1. ``_count_rank_kernel``, one program per chunk of ``CHUNK`` slots: the chunk's per-expert counts
   (one-hot compares, expert tiles of ``BLOCK_E``) and each slot's rank among the earlier slots of
   its chunk with the same expert (``CHUNK x BLOCK_J`` compares).
2. ``_scan_kernel``, one program: ``seg_indptr`` (exclusive prefix of the per-expert totals) and,
   in place of the counts, each chunk's first row per expert ``seg[e] + sum(counts[:c, e])``.
3. ``_scatter_rows_kernel``, one program per (token, H-block): ``dst = base[chunk, key] + rank``
   (the stable expert-major position), ``src2dst``, the x block loaded once and stored to the
   token's valid destinations, and zeros in the tail rows (``row >= seg[E]``) it owns.

``moe_unpermute``: ``_unpermute_kernel``, one program per (token, H-block), sums the weighted rows
in slot order with fp32 accumulation, rounding each product to the promoted dtype like the model.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ep_fuse.providers.triton.jit_helpers import DTYPE_CODES, INTERPRET, for_store, round_as
from ep_fuse.symbolic import known


@dataclasses.dataclass(frozen=True)
class IndexConfig:
    """Tiles of the index kernels (counts/rank and scan)."""

    chunk: int = 256
    block_e: int = 32
    block_j: int = 32
    scan_tile: int = 8192
    """Elements of one ``[chunks, experts]`` tile of the scan."""
    num_warps: int = 8


@dataclasses.dataclass(frozen=True)
class CopyConfig:
    """Tiles of the row copy kernels: ``h_iters`` blocks of ``block_h`` channels per program."""

    block_h: int = 1024
    num_warps: int = 4
    h_iters: int = 1


def index_config(num_slots: int, num_experts: int) -> IndexConfig:
    """Index-kernel tiles for ``T*K`` slots and ``E`` experts (untuned defaults: see the bench's sweep)."""
    if INTERPRET:  # small chunks: the interpreter runs programs one by one in Python
        return IndexConfig(chunk=32, block_e=16, block_j=16, scan_tile=1024, num_warps=4)
    return IndexConfig()


def copy_config(hidden: int) -> CopyConfig:
    """Copy-kernel tiles for rows of ``hidden`` channels (untuned defaults: see the bench's sweep)."""
    block = min(1024, triton.next_power_of_2(max(hidden, 16)))
    return CopyConfig(block_h=min(block, 256) if INTERPRET else block, num_warps=4, h_iters=1)


def _emulate_rtne() -> int:
    return 1 if INTERPRET else 2  # exact bf16 rounding: on the bits (interpreter) / inline PTX cvt.rn (GPU)


# --------------------------------------------------------------------------- kernels


@triton.jit
def _slot_keys(IDS, i, S, K, E, st0, st1):
    """Expert of each flat slot ``i`` (int32), -1 when invalid or past the end."""
    t = i // K
    ids = tl.load(IDS + t.to(tl.int64) * st0 + (i - t * K) * st1, mask=i < S, other=-1)
    ok = (ids >= 0) & (ids < E) & (i < S)
    return tl.where(ok, ids, -1).to(tl.int32)


@triton.jit
def _count_rank_kernel(
    IDS, COUNTS, RANK, S, K, E, st0, st1,
    CHUNK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_J: tl.constexpr,
):
    c = tl.program_id(0)
    i = c * CHUNK + tl.arange(0, CHUNK)
    key = _slot_keys(IDS, i, S, K, E, st0, st1)
    for e0 in range(0, E, BLOCK_E):
        ex = e0 + tl.arange(0, BLOCK_E)
        hits = (key[:, None] == ex[None, :]).to(tl.int32)
        tl.store(COUNTS + c * E + ex, tl.sum(hits, axis=0), mask=ex < E)
    rank = tl.zeros([CHUNK], dtype=tl.int32)
    for j0 in tl.static_range(0, CHUNK, BLOCK_J):
        j = c * CHUNK + j0 + tl.arange(0, BLOCK_J)
        kj = _slot_keys(IDS, j, S, K, E, st0, st1)
        same = (key[:, None] == kj[None, :]) & (j[None, :] < i[:, None])
        rank += tl.sum(same.to(tl.int32), axis=1)
    tl.store(RANK + i, rank, mask=i < S)


@triton.jit
def _scan_kernel(COUNTS, SEG, NC, E, CB: tl.constexpr, EP: tl.constexpr):
    e = tl.arange(0, EP)
    em = e < E
    total = tl.zeros([EP], dtype=tl.int32)
    for c0 in range(0, NC, CB):
        c = c0 + tl.arange(0, CB)
        m = (c < NC)[:, None] & em[None, :]
        total += tl.sum(tl.load(COUNTS + c[:, None] * E + e[None, :], mask=m, other=0), axis=0)
    seg = tl.cumsum(total, axis=0) - total
    tl.store(SEG + e, seg.to(tl.int64), mask=em)
    tl.store(SEG + E, tl.sum(total, axis=0).to(tl.int64))
    run = seg
    for c0 in range(0, NC, CB):  # counts -> first row of each (chunk, expert), in place
        c = c0 + tl.arange(0, CB)
        m = (c < NC)[:, None] & em[None, :]
        ptr = COUNTS + c[:, None] * E + e[None, :]
        cnt = tl.load(ptr, mask=m, other=0)
        tl.store(ptr, tl.cumsum(cnt, axis=0) - cnt + run[None, :], mask=m)
        run += tl.sum(cnt, axis=0)


@triton.jit
def token_destinations(IDS, RANK, BASE, SRC2DST, t, first, E, st0, st1, K: tl.constexpr, KP: tl.constexpr,
                        CHUNK: tl.constexpr):
    """Token ``t``'s slots ``i = t*K + k``: the valid mask and the permuted row ``dst = base[chunk, key] + rank``
    of each; the program with ``first`` set also writes ``src2dst`` (-1 for invalid slots). Shared by the
    bf16 scatter and the fp8 permute-quant kernels."""
    kk = tl.arange(0, KP)
    km = kk < K
    i = t * K + kk
    ids = tl.load(IDS + t.to(tl.int64) * st0 + kk * st1, mask=km, other=-1)
    valid = km & (ids >= 0) & (ids < E)
    key = tl.where(valid, ids, 0).to(tl.int32)
    base = tl.load(BASE + (i // CHUNK) * E + key, mask=valid, other=0)
    rank = tl.load(RANK + i, mask=valid, other=0)
    dst = (base + rank).to(tl.int64)
    if first:
        tl.store(SRC2DST + i, tl.where(valid, dst, -1), mask=km)
    return i, km, valid, dst


@triton.jit
def _scatter_rows_kernel(
    X, IDS, RANK, BASE, SEG, ROWS, SRC2DST, H, E, NHB, sx, st0, st1,
    K: tl.constexpr, KP: tl.constexpr, CHUNK: tl.constexpr, BLOCK_H: tl.constexpr, H_ITERS: tl.constexpr,
):
    pid = tl.program_id(0)
    t = pid // NHB
    hb = pid - t * NHB
    i, km, valid, dst = token_destinations(IDS, RANK, BASE, SRC2DST, t, hb == 0, E, st0, st1, K, KP, CHUNK)
    x_row = X + t.to(tl.int64) * sx
    out = ROWS + dst[:, None] * H
    for j in tl.static_range(H_ITERS):
        cols = (hb * H_ITERS + j) * BLOCK_H + tl.arange(0, BLOCK_H)
        cm = cols < H
        v = tl.load(x_row + cols, mask=cm)
        tl.store(out + cols[None, :], tl.broadcast_to(v[None, :], (KP, BLOCK_H)), mask=valid[:, None] & cm[None, :])
    n_valid = tl.load(SEG + E)
    if (t + 1) * K > n_valid:  # this token's home rows t*K+k reach the zero tail
        home = i.to(tl.int64)
        zm = km & (home >= n_valid)
        zero = tl.zeros((KP, BLOCK_H), dtype=ROWS.dtype.element_ty)
        for j in tl.static_range(H_ITERS):
            cols = (hb * H_ITERS + j) * BLOCK_H + tl.arange(0, BLOCK_H)
            tl.store(ROWS + home[:, None] * H + cols[None, :], zero, mask=zm[:, None] & (cols < H)[None, :])


@triton.jit
def _mul_rn(a, b):
    # mul.rn: a product ptxas never contracts into an FMA with the following add
    return tl.inline_asm_elementwise(
        asm="mul.rn.f32 $0, $1, $2;", constraints="=f,f,f", args=[a, b], dtype=tl.float32, is_pure=True, pack=1,
    )


@triton.jit
def _unpermute_kernel(
    Y, SRC2DST, W, OUT, H, NHB, sy, ss, sw0, sw1,
    K: tl.constexpr, BLOCK_H: tl.constexpr, H_ITERS: tl.constexpr, HAS_W: tl.constexpr,
    PROD_CODE: tl.constexpr, OUT_CODE: tl.constexpr, EMULATE_RTNE: tl.constexpr,
):
    pid = tl.program_id(0)
    t = pid // NHB
    hb = pid - t * NHB
    for j in tl.static_range(H_ITERS):
        cols = (hb * H_ITERS + j) * BLOCK_H + tl.arange(0, BLOCK_H)
        cm = cols < H
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for k in tl.static_range(K):  # slot order, like the reference's sum over k
            src = tl.load(SRC2DST + (t * K + k).to(tl.int64) * ss).to(tl.int64)
            ok = (tl.zeros([BLOCK_H], dtype=tl.int64) + src) >= 0  # a vector mask (the interpreter wants one)
            v = tl.load(Y + tl.maximum(src, 0) * sy + cols, mask=cm & ok, other=0.0).to(tl.float32)
            if HAS_W:
                w = tl.load(W + t.to(tl.int64) * sw0 + k * sw1).to(tl.float32)
                if PROD_CODE == 0 and EMULATE_RTNE == 2:
                    v = _mul_rn(v, w)
                else:
                    v = v * w
            v = round_as(v, PROD_CODE, EMULATE_RTNE)
            acc += tl.where(ok, v, 0.0)
        acc = round_as(acc, PROD_CODE, EMULATE_RTNE)
        tl.store(OUT + t.to(tl.int64) * H + cols, for_store(acc, OUT_CODE, EMULATE_RTNE), mask=cm)


# --------------------------------------------------------------------------- launches


def launch_permute_index(topk_ids: torch.Tensor, num_experts: int, seg_indptr: torch.Tensor,
                         cfg: IndexConfig | None = None, wrap=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts/rank and scan launches; returns ``(base [chunks * E] int32, rank [T*K] int32)`` and fills
    ``seg_indptr``. ``base`` is flat (row ``c`` at ``c * E``): a 2-D ``[chunks, E]`` buffer would make the
    allocation's contiguity check guard on ``chunks == 1`` at symbolic sizes (a recompile past 256 slots)."""
    t, k = topk_ids.shape
    s, e = t * k, num_experts
    cfg = cfg or index_config(s, e)
    nc = triton.cdiv(s, cfg.chunk)
    counts = torch.empty((nc * e,), dtype=torch.int32, device=topk_ids.device)
    rank = torch.empty((s,), dtype=torch.int32, device=topk_ids.device)
    count_rank = wrap(_count_rank_kernel) if wrap is not None else _count_rank_kernel
    scan = wrap(_scan_kernel) if wrap is not None else _scan_kernel
    count_rank[(nc,)](
        topk_ids, counts, rank, s, k, e, topk_ids.stride(0), topk_ids.stride(1),
        CHUNK=cfg.chunk, BLOCK_E=min(cfg.block_e, triton.next_power_of_2(e)),
        BLOCK_J=min(cfg.block_j, cfg.chunk), num_warps=cfg.num_warps,
    )
    ep = triton.next_power_of_2(e)
    # a symbolic chunk count (dynamic shapes) takes the widest tile: next_power_of_2 would specialize it
    cb = max(1, min(triton.next_power_of_2(nc), cfg.scan_tile // ep) if isinstance(nc, int) else cfg.scan_tile // ep)
    scan[(1,)](counts, seg_indptr, nc, e, CB=cb, EP=ep, num_warps=cfg.num_warps)
    return counts, rank


def launch_permute(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, rows: torch.Tensor,
                   src2dst: torch.Tensor, seg_indptr: torch.Tensor, index_cfg: IndexConfig | None = None,
                   copy_cfg: CopyConfig | None = None, wrap=None) -> None:
    """Fill ``rows`` [T*K, H], ``src2dst`` [T*K] and ``seg_indptr`` [E+1] (``x`` rows unit-stride)."""
    t, k = topk_ids.shape
    h = x.shape[1]
    if known(t * k == 0):
        seg_indptr.zero_()
        return
    # an unbacked token count (ep_fuse.dynamic_batch) is not known to be non-zero: a run-time assert, not a guard
    torch._check(t * k > 0, lambda: "ep_fuse: the inlined MoE permute needs at least one token")
    index_cfg = index_cfg or index_config(t * k, num_experts)
    base, rank = launch_permute_index(topk_ids, num_experts, seg_indptr, index_cfg, wrap)
    cc = copy_cfg or copy_config(h)
    nhb = max(1, triton.cdiv(h, cc.block_h * cc.h_iters))
    scatter = wrap(_scatter_rows_kernel) if wrap is not None else _scatter_rows_kernel
    scatter[(t * nhb,)](
        x, topk_ids, rank, base, seg_indptr, rows, src2dst, h, num_experts, nhb, x.stride(0),
        topk_ids.stride(0), topk_ids.stride(1),
        K=k, KP=triton.next_power_of_2(k), CHUNK=index_cfg.chunk, BLOCK_H=cc.block_h, H_ITERS=cc.h_iters,
        num_warps=cc.num_warps,
    )


def launch_unpermute(y: torch.Tensor, src2dst: torch.Tensor, topk_weights: torch.Tensor | None, top_k: int,
                     out: torch.Tensor, prod_dtype: torch.dtype, copy_cfg: CopyConfig | None = None,
                     wrap=None) -> None:
    """Fill ``out`` [T, H] (contiguous); ``topk_weights`` is read as [T, K] through its two strides."""
    t, h = out.shape
    if known(t == 0) or known(h == 0):  # an unbacked 0 launches an empty grid
        return
    cc = copy_cfg or copy_config(h)
    nhb = max(1, triton.cdiv(h, cc.block_h * cc.h_iters))
    w = topk_weights if topk_weights is not None else src2dst
    sw0, sw1 = (w.stride(0), w.stride(1)) if topk_weights is not None else (0, 0)
    kernel = wrap(_unpermute_kernel) if wrap is not None else _unpermute_kernel
    kernel[(t * nhb,)](
        y, src2dst, w, out, h, nhb, y.stride(0), src2dst.stride(0), sw0, sw1,
        K=top_k, BLOCK_H=cc.block_h, H_ITERS=cc.h_iters, HAS_W=topk_weights is not None,
        PROD_CODE=DTYPE_CODES[prod_dtype], OUT_CODE=DTYPE_CODES[out.dtype], EMULATE_RTNE=_emulate_rtne(),
        num_warps=cc.num_warps,
    )

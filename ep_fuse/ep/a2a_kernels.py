"""Triton kernels of the ``all_to_all`` EP engine, rank layout (no host synchronisation).

Wire format and handle: :mod:`ep_fuse.ops.ep_layout` (:func:`~ep_fuse.ops.ep_layout.packed_row`). Dispatch is
three launches around the one NCCL message:

1. ``_route_kernel``, one program per block of ``BT`` tokens: which ranks each token goes to (once per
   rank, however many of its experts live there), the block's count per rank ``[NB, W]`` and each
   (token, rank) pair's position among the block's tokens for that rank (``tl.cumsum``).
2. ``_scatter_kernel``, one program per (token, H-chunk): the pair's send row ``slot = base[r] +
   (tokens of earlier blocks for r) + position`` (``base[r]`` = ``r*C`` with a capacity, the exclusive
   prefix of the per-rank totals otherwise), the x chunk loaded once and stored to each destination
   row; the first chunk's program also writes the rebased ids / weight bits and the slot table. With a
   capacity, extra programs write the metadata of the padding rows (ids -1, weights 0); program 0
   writes the handle header and the per-peer counts.
3. after the collective, ``_unpack_kernel``, one program per ``BR`` received rows: int32 ids -> int64,
   weight bits -> weights; rows past ``n_valid`` (data-dependent tail) get -1 / 0 and a zero x row.

The prefix over blocks is recomputed by every scatter program from the ``[NB, W]`` counts (``NB`` is
kept <= 64 by growing ``BT``): a few hundred bytes from L2 per program instead of a third launch.
Counts are deterministic (no atomics). Rows are copied as raw integers of the element size (16-byte
vectors when the row strides are multiples of 16 elements), so no bf16 arithmetic happens here.

Combine: ``_combine_kernel``, one program per (token, H-chunk), sums the token's rows of the received
buffer in rank order in fp32 (upcast right after each load) and casts once -- bitwise the reference.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ep_fuse.ops.ep_layout import CODES, HEADER
from ep_fuse.providers.triton.jit_helpers import DTYPE_CODES, INTERPRET, for_store

RAW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""Integer dtype the rows are copied as, by element size."""
MAX_BLOCKS = 64
"""Routing blocks (``T / BT``) at most: the scan every scatter program redoes stays a few hundred bytes."""


@dataclasses.dataclass(frozen=True)
class A2aConfig:
    """Tiles of the rank-layout kernels."""

    block_t: int = 128
    """Tokens per routing program (grown so that at most ``MAX_BLOCKS`` blocks exist)."""
    block_bytes: int = 2048
    """Bytes of one row chunk per copy program (16 B per thread at 4 warps)."""
    pad_rows: int = 128
    """Padding rows per metadata-fill program (capacity mode)."""
    unpack_rows: int = 64
    num_warps: int = 4


def config(tokens: int) -> A2aConfig:
    """Default tiles for ``tokens`` local tokens (untuned; see ``bench/bench_ep_a2a.py``)."""
    if INTERPRET:  # the interpreter runs programs one by one: fewer, bigger ones
        return A2aConfig(block_t=32, block_bytes=1024, pad_rows=64, unpack_rows=64)
    return A2aConfig()


def _block_t(tokens: int, cfg: A2aConfig) -> int:
    return max(cfg.block_t, triton.next_power_of_2(max(1, triton.cdiv(tokens, MAX_BLOCKS))))


def _block_h(width: int, elem: int, cfg: A2aConfig) -> int:
    return min(triton.next_power_of_2(max(width, 1)), max(16, cfg.block_bytes // elem))


# --------------------------------------------------------------------------- kernels


@triton.jit
def _route_kernel(IDS, COUNTS, POS, T, E, E_R, st0, st1,
                  K: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, BT: tl.constexpr):
    b = tl.program_id(0)
    t = b * BT + tl.arange(0, BT)
    tm = t < T
    r = tl.arange(0, WP)
    rm = r < W
    member = tl.zeros([BT, WP], dtype=tl.int32)
    for k in tl.static_range(K):
        ids = tl.load(IDS + t.to(tl.int64) * st0 + k * st1, mask=tm, other=-1)
        ok = (ids >= 0) & (ids < E)
        dest = tl.where(ok, tl.where(ok, ids, 0).to(tl.int32) // E_R, -1)
        member = tl.maximum(member, (dest[:, None] == r[None, :]).to(tl.int32))
    tl.store(COUNTS + b * W + r, tl.sum(member, axis=0), mask=rm)
    pos = tl.cumsum(member, axis=0) - member
    tl.store(POS + t.to(tl.int64)[:, None] * W + r[None, :], tl.where(member > 0, pos, -1),
             mask=tm[:, None] & rm[None, :])


@triton.jit
def _scatter_kernel(
    X, IDS, WB, POS, COUNTS, SEND, META, HANDLE,
    T, C, E, E_R, NB, NHB, NTOK, R, H, ROW, ROW_W, MOFF, sx, st0, st1, sw0, sw1,
    K: tl.constexpr, KP: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, BT: tl.constexpr,
    NBP: tl.constexpr, BLOCK_H: tl.constexpr, PB: tl.constexpr, CAPACITY: tl.constexpr, W16: tl.constexpr,
    CODE: tl.constexpr, HDR: tl.constexpr,
):
    pid = tl.program_id(0)
    r = tl.arange(0, WP)
    rm = r < W
    nb = tl.arange(0, NBP)
    cnt = tl.load(COUNTS + nb[:, None] * W + r[None, :], mask=(nb < NB)[:, None] & rm[None, :], other=0)
    total = tl.sum(cnt, axis=0)  # [WP] tokens this rank sends to each rank
    kk = tl.arange(0, KP)
    km = kk < K
    if pid == 0:  # header [code, key, n_recv] and the per-peer counts (capacity: C both ways)
        j = tl.arange(0, 4)
        head = tl.where(j == 0, CODE, tl.where(j == 1, -1, R + tl.zeros([4], dtype=tl.int64)))
        tl.store(HANDLE + j, head, mask=j < 3)
        if CAPACITY:
            cap = tl.zeros([WP], dtype=tl.int64) + C
            tl.store(HANDLE + HDR + r, cap, mask=rm)
            tl.store(HANDLE + HDR + W + r, cap, mask=rm)
        else:
            tl.store(HANDLE + HDR + r, total.to(tl.int64), mask=rm)
    if pid < NTOK:
        t = pid // NHB
        hb = pid - t * NHB
        before = tl.sum(tl.where((nb < t // BT)[:, None], cnt, 0), axis=0)
        if CAPACITY:
            base = r * C
        else:
            base = tl.cumsum(total, axis=0) - total
        pos = tl.load(POS + t.to(tl.int64) * W + r, mask=rm, other=-1)
        member = pos >= 0
        slot = tl.where(member, (base + before + pos).to(tl.int64), -1)
        cols = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        cm = cols < H
        v = tl.load(X + t.to(tl.int64) * sx + cols, mask=cm)
        tl.store(SEND + slot[:, None] * ROW + cols[None, :], tl.broadcast_to(v[None, :], (WP, BLOCK_H)),
                 mask=member[:, None] & cm[None, :])
        if hb == 0:
            ids = tl.load(IDS + t.to(tl.int64) * st0 + kk * st1, mask=km, other=-1)
            ok = km & (ids >= 0) & (ids < E)
            idc = tl.where(ok, ids, 0).to(tl.int32)
            dest = tl.where(ok, idc // E_R, -1)
            local = idc - dest * E_R
            wb = tl.load(WB + t.to(tl.int64) * sw0 + kk * sw1, mask=km, other=0).to(tl.int32)
            if W16:
                wb = wb & 0xFFFF
            mine = dest[None, :] == r[:, None]  # [WP, KP]
            m2 = member[:, None] & km[None, :]
            meta = META + slot[:, None] * ROW_W + MOFF + kk[None, :]
            tl.store(meta, tl.where(mine, local[None, :], -1), mask=m2)
            tl.store(meta + K, tl.where(mine, wb[None, :], 0), mask=m2)
            tl.store(HANDLE + HDR + 2 * W + t.to(tl.int64) * W + r, slot, mask=rm)
    else:
        if CAPACITY:  # padding rows [count_r, C) of every block: ids -1, weights 0
            j = (pid - NTOK) * PB + tl.arange(0, PB)
            for q in tl.static_range(W):
                tot = tl.sum(tl.where(r == q, total, 0), axis=0)
                pad = (j >= tot) & (j < C)
                meta = META + (q * C + j).to(tl.int64)[:, None] * ROW_W + MOFF + kk[None, :]
                m2 = pad[:, None] & km[None, :]
                tl.store(meta, tl.full([PB, KP], -1, tl.int32), mask=m2)
                tl.store(meta + K, tl.zeros([PB, KP], dtype=tl.int32), mask=m2)


@triton.jit
def _unpack_kernel(META, IDS_OUT, W_OUT, HANDLE, R, N, ROW_W,
                   MOFF: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BR: tl.constexpr, BZ: tl.constexpr,
                   W16: tl.constexpr, ZERO_TAIL: tl.constexpr):
    p = tl.program_id(0)
    i = p * BR + tl.arange(0, BR)
    im = i < R
    live = i < N
    kk = tl.arange(0, KP)
    m = im[:, None] & (kk < K)[None, :]
    src = META + i.to(tl.int64)[:, None] * ROW_W + MOFF + kk[None, :]
    lm = m & live[:, None]
    ids = tl.load(src, mask=lm, other=-1)
    wb = tl.load(src + K, mask=lm, other=0)
    out = i.to(tl.int64)[:, None] * K + kk[None, :]
    tl.store(IDS_OUT + out, ids.to(tl.int64), mask=m)
    if W16:
        tl.store(W_OUT + out, wb.to(tl.int16), mask=m)
    else:
        tl.store(W_OUT + out, wb, mask=m)
    if p == 0:
        j = tl.arange(0, 1)
        tl.store(HANDLE + 2 + j, tl.zeros([1], dtype=tl.int64) + N)
    if ZERO_TAIL:
        if p * BR + BR > N:  # data-dependent tail: zero x rows (the x part is MOFF words)
            dead = im & (i >= N)
            for c0 in range(0, MOFF, BZ):
                c = c0 + tl.arange(0, BZ)
                tl.store(META + i.to(tl.int64)[:, None] * ROW_W + c[None, :], tl.zeros([BR, BZ], dtype=tl.int32),
                         mask=dead[:, None] & (c < MOFF)[None, :])


@triton.jit
def _combine_kernel(BACK, HANDLE, OUT, H, NHB, sb, SLOT0,
                    W: tl.constexpr, BLOCK_H: tl.constexpr, OUT_CODE: tl.constexpr, EMULATE_RTNE: tl.constexpr):
    pid = tl.program_id(0)
    t = pid // NHB
    hb = pid - t * NHB
    cols = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    cm = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for q in tl.static_range(W):  # fixed rank order: deterministic, bitwise the reference
        s = tl.load(HANDLE + SLOT0 + t.to(tl.int64) * W + q)
        sent = (tl.zeros([BLOCK_H], dtype=tl.int64) + s) >= 0  # a vector mask (the interpreter wants one)
        v = tl.load(BACK + tl.maximum(s, 0) * sb + cols, mask=cm & sent, other=0.0)
        acc += v.to(tl.float32)
    tl.store(OUT + t.to(tl.int64) * H + cols, for_store(acc, OUT_CODE, EMULATE_RTNE), mask=cm)


# --------------------------------------------------------------------------- launches


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(RAW[t.element_size()])


def launch_pack(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, world: int,
                capacity: int, send: torch.Tensor, moff: int, handle: torch.Tensor,
                cfg: A2aConfig | None = None) -> None:
    """Route + scatter: fill ``send`` [W*(C or T), Hp] (rows unit-stride), the handle header, send counts
    (capacity: ``C``, both ways) and slot table. ``x`` [T, H] and ``topk_weights`` need unit-stride rows.
    Data-dependent mode (``capacity == 0``) leaves the receive counts to the collective."""
    t, k = topk_ids.shape
    h = x.shape[1]
    cfg = cfg or config(t)
    bt = _block_t(t, cfg)
    nb = triton.cdiv(t, bt)
    wp = triton.next_power_of_2(world)
    counts = torch.empty((nb, world), dtype=torch.int32, device=x.device)
    pos = torch.empty((t, world), dtype=torch.int32, device=x.device)
    _route_kernel[(nb,)](topk_ids, counts, pos, t, num_experts, num_experts // world, topk_ids.stride(0),
                         topk_ids.stride(1), K=k, W=world, WP=wp, BT=bt, num_warps=cfg.num_warps)
    xr, sr = _raw(x), _raw(send)
    block_h = _block_h(h, x.element_size(), cfg)
    nhb = triton.cdiv(h, block_h)
    ntok = t * nhb
    npad = triton.cdiv(capacity, cfg.pad_rows) if capacity > 0 else 0
    wb = _raw(topk_weights)
    meta = send.view(torch.int32)
    _scatter_kernel[(ntok + npad,)](
        xr, topk_ids, wb, pos, counts, sr, meta, handle,
        t, capacity, num_experts, num_experts // world, nb, nhb, ntok, send.shape[0], h, sr.stride(0),
        meta.stride(0), moff, xr.stride(0), topk_ids.stride(0), topk_ids.stride(1), wb.stride(0), wb.stride(1),
        K=k, KP=triton.next_power_of_2(k), W=world, WP=wp, BT=bt, NBP=triton.next_power_of_2(nb),
        BLOCK_H=block_h, PB=cfg.pad_rows, CAPACITY=capacity > 0, W16=topk_weights.element_size() == 2,
        CODE=CODES["all_to_all"], HDR=HEADER, num_warps=cfg.num_warps,
    )


def launch_unpack(recv: torch.Tensor, n_valid: int, moff: int, recv_ids: torch.Tensor, recv_weights: torch.Tensor,
                  handle: torch.Tensor, zero_tail: bool, cfg: A2aConfig | None = None) -> None:
    """Received packed rows [R, Hp] -> ``recv_ids`` [R, K] int64 and ``recv_weights`` [R, K] (contiguous);
    rows from ``n_valid`` on: ids -1, weights 0 (and, with ``zero_tail``, x zeroed); ``handle[2] = n_valid``."""
    rows, k = recv_ids.shape
    cfg = cfg or config(rows)
    words = recv.view(torch.int32)
    grid = (max(1, triton.cdiv(rows, cfg.unpack_rows)),)
    _unpack_kernel[grid](
        words, recv_ids, _raw(recv_weights), handle, rows, n_valid, words.stride(0),
        MOFF=moff, K=k, KP=triton.next_power_of_2(k), BR=cfg.unpack_rows, BZ=min(512, triton.next_power_of_2(max(moff, 1))),
        W16=recv_weights.element_size() == 2, ZERO_TAIL=zero_tail, num_warps=cfg.num_warps,
    )


def launch_combine(back: torch.Tensor, handle: torch.Tensor, world: int, out: torch.Tensor,
                   cfg: A2aConfig | None = None) -> None:
    """``out[t] = sum_r back[slot[t, r]]`` (fp32, rank order, one cast); ``out`` [T, H] contiguous,
    ``back`` rows unit-stride."""
    t, h = out.shape
    cfg = cfg or config(t)
    block_h = _block_h(h, 2, cfg)
    nhb = triton.cdiv(h, block_h)
    _combine_kernel[(t * nhb,)](
        back, handle, out, h, nhb, back.stride(0), HEADER + 2 * world,
        W=world, BLOCK_H=block_h, OUT_CODE=DTYPE_CODES[out.dtype], EMULATE_RTNE=1 if INTERPRET else 0,
        num_warps=cfg.num_warps,
    )

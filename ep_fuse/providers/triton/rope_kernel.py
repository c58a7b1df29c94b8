"""Triton kernel for rotary embedding: q and k in one launch, any strides, all four forms, partial rotary.

Each program handles ``ROWS`` head vectors of q (first programs) or k (the rest). A head vector is
addressed by its three leading indices and per-tensor strides, so ``transpose`` views ([B, H, S, D]
over a [B, S, H, D] buffer) and broadcast cos/sin (stride 0) are read in place, without copies.
Values are upcast after the load; products and sums are rounded to the input dtype where the model
code rounds them (``half``/``chunk``/``deinterleave``), the ``complex`` form computes in fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ep_fuse.providers.triton.rms_norm_kernel import _for_store, _round

FORMS = {"half": 0, "chunk": 1, "deinterleave": 2, "complex": 3}


@triton.jit
def _rope_rows(
    X, Y, C, S, row0, n_rows, n1, n2,
    sx0, sx1, sx2, sy0, sy1, sy2, sc0, sc1, sc2, ss0, ss1, ss2,
    HALF: tl.constexpr, ROT: tl.constexpr, D: tl.constexpr, FORM: tl.constexpr, CODE: tl.constexpr,
    OUT_CODE: tl.constexpr, BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr, ROWS: tl.constexpr,
    EMULATE_RTNE: tl.constexpr, IDX32: tl.constexpr,
):
    if IDX32:  # row indices fit int32: 32-bit division (64-bit division is a long software sequence)
        r32 = row0 + tl.arange(0, ROWS)
        rmask = r32 < n_rows
        i0 = (r32 // (n1 * n2)).to(tl.int64)
        i1 = ((r32 // n2) % n1).to(tl.int64)
        i2 = (r32 % n2).to(tl.int64)
    else:
        r = (row0 + tl.arange(0, ROWS)).to(tl.int64)
        rmask = r < n_rows
        i0 = r // (n1 * n2)
        i1 = (r // n2) % n1
        i2 = r % n2
    xb = (i0 * sx0 + i1 * sx1 + i2 * sx2)[:, None]
    yb = (i0 * sy0 + i1 * sy1 + i2 * sy2)[:, None]
    cb = (i0 * sc0 + i1 * sc1 + i2 * sc2)[:, None]
    sb = (i0 * ss0 + i1 * ss1 + i2 * ss2)[:, None]
    j = tl.arange(0, BLOCK)[None, :]
    m = rmask[:, None] & (j < HALF)
    if FORM == 3:  # complex: (x[2j] + i x[2j+1]) * (c[j] + i s[j]) in fp32, interleaved output
        a = tl.load(X + xb + 2 * j, mask=m, other=0.0).to(tl.float32)
        b = tl.load(X + xb + 2 * j + 1, mask=m, other=0.0).to(tl.float32)
        c = tl.load(C + cb + 2 * j, mask=m, other=0.0).to(tl.float32)
        s = tl.load(S + sb + 2 * j, mask=m, other=0.0).to(tl.float32)
        tl.store(Y + yb + 2 * j, _for_store(a * c - b * s, OUT_CODE, EMULATE_RTNE), mask=m)
        tl.store(Y + yb + 2 * j + 1, _for_store(a * s + b * c, OUT_CODE, EMULATE_RTNE), mask=m)
    else:
        if FORM == 2:  # de-interleaved: pairs (x[2j], x[2j+1])
            x1 = tl.load(X + xb + 2 * j, mask=m, other=0.0).to(tl.float32)
            x2 = tl.load(X + xb + 2 * j + 1, mask=m, other=0.0).to(tl.float32)
        else:
            x1 = tl.load(X + xb + j, mask=m, other=0.0).to(tl.float32)
            x2 = tl.load(X + xb + HALF + j, mask=m, other=0.0).to(tl.float32)
        c1 = tl.load(C + cb + j, mask=m, other=0.0).to(tl.float32)
        s1 = tl.load(S + sb + j, mask=m, other=0.0).to(tl.float32)
        if FORM == 0:  # rotate-half: cos/sin span the rotated width (the halves may differ)
            c2 = tl.load(C + cb + HALF + j, mask=m, other=0.0).to(tl.float32)
            s2 = tl.load(S + sb + HALF + j, mask=m, other=0.0).to(tl.float32)
            y1 = _round(_round(x1 * c1, CODE, EMULATE_RTNE) + _round(-x2 * s1, CODE, EMULATE_RTNE), CODE, EMULATE_RTNE)
            y2 = _round(_round(x2 * c2, CODE, EMULATE_RTNE) + _round(x1 * s2, CODE, EMULATE_RTNE), CODE, EMULATE_RTNE)
        else:
            y1 = _round(_round(x1 * c1, CODE, EMULATE_RTNE) - _round(x2 * s1, CODE, EMULATE_RTNE), CODE, EMULATE_RTNE)
            y2 = _round(_round(x2 * c1, CODE, EMULATE_RTNE) + _round(x1 * s1, CODE, EMULATE_RTNE), CODE, EMULATE_RTNE)
        tl.store(Y + yb + j, y1, mask=m)
        tl.store(Y + yb + HALF + j, y2, mask=m)
    if ROT < D:  # partial rotary: the other channels pass through
        p = ROT + tl.arange(0, PASS_BLOCK)[None, :]
        pm = rmask[:, None] & (p < D)
        tl.store(Y + yb + p, tl.load(X + xb + p, mask=pm, other=0.0), mask=pm)


@triton.jit
def _rope_kernel(
    Q, QY, K, KY, C, S,
    q_progs, q_rows, q_n1, q_n2, k_rows, k_n1, k_n2,
    qx0, qx1, qx2, qy0, qy1, qy2, qc0, qc1, qc2, qs0, qs1, qs2,
    kx0, kx1, kx2, ky0, ky1, ky2, kc0, kc1, kc2, ks0, ks1, ks2,
    HALF: tl.constexpr, ROT: tl.constexpr, D: tl.constexpr, FORM: tl.constexpr, CODE: tl.constexpr,
    OUT_CODE: tl.constexpr, BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr, ROWS: tl.constexpr,
    HAS_K: tl.constexpr, EMULATE_RTNE: tl.constexpr, IDX32: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < q_progs:
        _rope_rows(Q, QY, C, S, pid * ROWS, q_rows, q_n1, q_n2, qx0, qx1, qx2, qy0, qy1, qy2, qc0, qc1, qc2,
                   qs0, qs1, qs2, HALF, ROT, D, FORM, CODE, OUT_CODE, BLOCK, PASS_BLOCK, ROWS, EMULATE_RTNE, IDX32)
    elif HAS_K:
        _rope_rows(K, KY, C, S, (pid - q_progs) * ROWS, k_rows, k_n1, k_n2, kx0, kx1, kx2, ky0, ky1, ky2,
                   kc0, kc1, kc2, ks0, ks1, ks2, HALF, ROT, D, FORM, CODE, OUT_CODE, BLOCK, PASS_BLOCK, ROWS,
                   EMULATE_RTNE, IDX32)


def rows_per_program(d: int) -> int:
    """Head vectors per program: 16 for D >= 128 (with 2 warps; H200, q32+k8 D128: 111 us at T16384 vs
    138 us with 64 rows and 4 warps, also faster at T64/1024/4096), else ~16 KB per program (D64: 64 rows)."""
    if d >= 128:
        return 16
    return max(1, min(64, 8192 // max(d, 1)))


def warps_for(d: int) -> int:
    return 2 if d >= 128 else 4

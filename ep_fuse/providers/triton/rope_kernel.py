"""Triton kernel for rotary embedding: q and k in one launch, any strides, all four forms, partial rotary.

Each program handles ``ROWS`` head vectors of q (first programs) or k (the rest). A head vector is
addressed by its three leading indices and per-tensor strides, so ``transpose`` views ([B, H, S, D]
over a [B, S, H, D] buffer) and broadcast cos/sin (stride 0) are read in place, without copies.
With ``HAS_POS`` (the cos/sin-cache form) the cos/sin strides address ``positions`` instead, and a
head's cos/sin row is ``cache[positions[...]]`` (cos half at ``C``, sin half at ``S``).
Products and sums are rounded to the input dtype where the model code rounds them
(``half``/``chunk``/``deinterleave``); the ``complex`` form computes in fp32, and so does ``CODE`` fp32 on
narrower heads (the ``rotate_pairs_fp32`` form: upcast after the loads, rounded once at the store). ``EMULATE_RTNE`` picks
how (see :func:`~ep_fuse.providers.triton.jit_helpers.round_as`): 3 (GPU, bf16/fp16) keeps the values
in the storage dtype and uses packed ``fma.rn.{bf16x2,f16x2}`` instructions, each one correctly
rounded operation, which is what PyTorch's upcast-compute-round of one eager op gives (fp32 has at
least 2p+2 bits for p = 8 or 11, so the double rounding is innocuous); 1 (interpreter) upcasts after
the load and rounds on the bits; 2 upcasts and rounds with inline-PTX ``cvt.rn``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ep_fuse.providers.triton.jit_helpers import for_store, round_as

FORMS = {"half": 0, "chunk": 1, "deinterleave": 2, "complex": 3, "interleave": 4}


def _fma_pair_asm(lanes: str, sign: str) -> tl.constexpr:
    """PTX for ``round(round($1*$2) + sign*round($3*$4))`` on two packed lanes: ``fma(a, b, -0)`` is the
    rounded product (sign of zero kept), ``fma(q, sign, p)`` the rounded sum; ``sign`` is packed ±1."""
    return tl.constexpr(
        f"{{ .reg .b32 z, m, p, q; mov.b32 z, 0x80008000; mov.b32 m, {sign}; fma.rn.{lanes} p, $1, $2, z; "
        f"fma.rn.{lanes} q, $3, $4, z; fma.rn.{lanes} $0, q, m, p; }}")


_BF16_SUB = _fma_pair_asm("bf16x2", "0xBF80BF80")
_BF16_ADD = _fma_pair_asm("bf16x2", "0x3F803F80")
_F16_SUB = _fma_pair_asm("f16x2", "0xBC00BC00")
_F16_ADD = _fma_pair_asm("f16x2", "0x3C003C00")


@triton.jit
def _fma_pair(a, b, c, d, ASM: tl.constexpr):
    return tl.inline_asm_elementwise(asm=ASM, constraints="=r,r,r,r,r", args=[a, b, c, d], dtype=a.dtype,
                                     is_pure=True, pack=2)


@triton.jit
def _pair_native(a, b, c, d, SUB: tl.constexpr, CODE: tl.constexpr):
    """``round(round(a*b) -/+ round(c*d))`` on bf16 (``CODE`` 1) or fp16 values, three packed ``fma.rn``
    per two lanes."""
    if CODE == 1:
        if SUB:
            y = _fma_pair(a, b, c, d, _BF16_SUB)
        else:
            y = _fma_pair(a, b, c, d, _BF16_ADD)
    else:
        if SUB:
            y = _fma_pair(a, b, c, d, _F16_SUB)
        else:
            y = _fma_pair(a, b, c, d, _F16_ADD)
    return y


@triton.jit
def _load_x(p, m, NATIVE: tl.constexpr):
    """A masked load, upcast to fp32 unless the packed native path keeps the storage dtype."""
    v = tl.load(p, mask=m, other=0.0)
    if not NATIVE:
        v = v.to(tl.float32)
    return v


@triton.jit
def _rope_rows(
    X, Y, C, S, P, row0, n_rows, n1, n2,
    sx0, sx1, sx2, sy0, sy1, sy2, sc0, sc1, sc2, ss0, ss1, ss2, s_cache,
    HALF: tl.constexpr, ROT: tl.constexpr, D: tl.constexpr, FORM: tl.constexpr, CODE: tl.constexpr,
    OUT_CODE: tl.constexpr, BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr, ROWS: tl.constexpr,
    EMULATE_RTNE: tl.constexpr, IDX32: tl.constexpr, HAS_POS: tl.constexpr,
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
    if HAS_POS:  # cos/sin-cache form: the cos strides address positions, one cache row per position
        pos = tl.load(P + (i0 * sc0 + i1 * sc1 + i2 * sc2), mask=rmask, other=0).to(tl.int64)
        cb = (pos * s_cache)[:, None]
        sb = cb
    else:
        cb = (i0 * sc0 + i1 * sc1 + i2 * sc2)[:, None]
        sb = (i0 * ss0 + i1 * ss1 + i2 * ss2)[:, None]
    j = tl.arange(0, BLOCK)[None, :]
    m = rmask[:, None] & (j < HALF)
    if FORM == 3:  # complex: (x[2j] + i x[2j+1]) * (c[j] + i s[j]) in fp32, interleaved output
        a = tl.load(X + xb + 2 * j, mask=m, other=0.0).to(tl.float32)
        b = tl.load(X + xb + 2 * j + 1, mask=m, other=0.0).to(tl.float32)
        c = tl.load(C + cb + 2 * j, mask=m, other=0.0).to(tl.float32)
        s = tl.load(S + sb + 2 * j, mask=m, other=0.0).to(tl.float32)
        tl.store(Y + yb + 2 * j, for_store(a * c - b * s, OUT_CODE, EMULATE_RTNE), mask=m)
        tl.store(Y + yb + 2 * j + 1, for_store(a * s + b * c, OUT_CODE, EMULATE_RTNE), mask=m)
    else:
        jj = tl.arange(0, 2 * BLOCK)[None, :]
        mm = rmask[:, None] & (jj < 2 * HALF)
        if FORM == 2 or FORM == 4:  # pairs (x[2j], x[2j+1]): one contiguous load, split in registers
            x1, x2 = tl.split(tl.reshape(_load_x(X + xb + jj, mm, EMULATE_RTNE == 3), (ROWS, BLOCK, 2)))
        else:
            x1 = _load_x(X + xb + j, m, EMULATE_RTNE == 3)
            x2 = _load_x(X + xb + HALF + j, m, EMULATE_RTNE == 3)
        c1 = _load_x(C + cb + j, m, EMULATE_RTNE == 3)
        s1 = _load_x(S + sb + j, m, EMULATE_RTNE == 3)
        if FORM == 0:  # rotate-half: cos/sin span the rotated width (the halves may differ)
            c2 = _load_x(C + cb + HALF + j, m, EMULATE_RTNE == 3)
            s2 = _load_x(S + sb + HALF + j, m, EMULATE_RTNE == 3)
        else:
            c2 = c1
            s2 = s1
        if EMULATE_RTNE == 3:  # x1·c1 + (−x2)·s1 = x1·c1 − x2·s1 exactly (negation and RN are symmetric)
            y1 = _pair_native(x1, c1, x2, s1, True, CODE)
            y2 = _pair_native(x2, c2, x1, s2, False, CODE)
        else:
            y1 = round_as(round_as(x1 * c1, CODE, EMULATE_RTNE) - round_as(x2 * s1, CODE, EMULATE_RTNE), CODE, EMULATE_RTNE)
            y2 = round_as(round_as(x2 * c2, CODE, EMULATE_RTNE) + round_as(x1 * s2, CODE, EMULATE_RTNE), CODE, EMULATE_RTNE)
        if FORM == 4:  # interleaved output (GPT-J): pairs joined in registers, one contiguous store
            yy = tl.reshape(tl.join(y1, y2), (ROWS, 2 * BLOCK))
            if CODE != OUT_CODE:  # fp32 math (``rotate_pairs_fp32``): the one rounding, at the store
                yy = for_store(yy, OUT_CODE, EMULATE_RTNE)
            tl.store(Y + yb + jj, yy, mask=mm)
        else:
            tl.store(Y + yb + j, y1, mask=m)
            tl.store(Y + yb + HALF + j, y2, mask=m)
    if ROT < D:  # partial rotary: the other channels pass through
        p = ROT + tl.arange(0, PASS_BLOCK)[None, :]
        pm = rmask[:, None] & (p < D)
        tl.store(Y + yb + p, tl.load(X + xb + p, mask=pm, other=0.0), mask=pm)


@triton.jit
def rope_jit(
    Q, QY, K, KY, C, S, P,
    q_progs, q_rows, q_n1, q_n2, k_rows, k_n1, k_n2,
    qx0, qx1, qx2, qy0, qy1, qy2, qc0, qc1, qc2, qs0, qs1, qs2,
    kx0, kx1, kx2, ky0, ky1, ky2, kc0, kc1, kc2, ks0, ks1, ks2, s_cache,
    HALF: tl.constexpr, ROT: tl.constexpr, D: tl.constexpr, FORM: tl.constexpr, CODE: tl.constexpr,
    OUT_CODE: tl.constexpr, BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr, ROWS: tl.constexpr,
    HAS_K: tl.constexpr, EMULATE_RTNE: tl.constexpr, IDX32: tl.constexpr, HAS_POS: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < q_progs:
        _rope_rows(Q, QY, C, S, P, pid * ROWS, q_rows, q_n1, q_n2, qx0, qx1, qx2, qy0, qy1, qy2, qc0, qc1, qc2,
                   qs0, qs1, qs2, s_cache, HALF, ROT, D, FORM, CODE, OUT_CODE, BLOCK, PASS_BLOCK, ROWS,
                   EMULATE_RTNE, IDX32, HAS_POS)
    elif HAS_K:
        _rope_rows(K, KY, C, S, P, (pid - q_progs) * ROWS, k_rows, k_n1, k_n2, kx0, kx1, kx2, ky0, ky1, ky2,
                   kc0, kc1, kc2, ks0, ks1, ks2, s_cache, HALF, ROT, D, FORM, CODE, OUT_CODE, BLOCK, PASS_BLOCK,
                   ROWS, EMULATE_RTNE, IDX32, HAS_POS)


def rows_per_program(d: int, native: bool = True) -> int:
    """Head vectors per program. Packed bf16/fp16 path (a GPU sweep of 8-64 rows x 1-4 warps): 16 rows with
    2 warps for D >= 64 (q32+k8 D128 at T16384: 89.4 us; q128+k128 D64: 257.7 us). fp32 math: 16 rows for
    D >= 128 (111 us vs 138 us with 64 rows), else ~16 KB per program (D64: 64 rows)."""
    if d >= 128 or (native and d >= 64):
        return 16
    return max(1, min(64, 8192 // max(d, 1)))


def warps_for(d: int, native: bool = True) -> int:
    return 2 if d >= 128 or (native and d >= 64) else 4

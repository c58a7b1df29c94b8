"""Triton JIT helpers shared by every Triton kernel of the package (the Triton provider's kernels, the EP
``all_to_all`` packing kernels, DeepGEMM's quant epilogue): dtype codes, exact rounding, the interpreter flag.

Imported only by kernel modules (it imports ``triton``): set ``TRITON_INTERPRET=1`` before the first import to run
the kernels on the CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ep_fuse.runtime import triton_interpret

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""The ``CODE`` constexpr of a kernel's dtype (``round_as``, ``for_store``)."""
INTERPRET = triton_interpret()
"""Whether the kernels run under the Triton interpreter (fixed when the kernels are defined)."""


@triton.jit
def rn_bf16(x):
    # cvt.rn in inline PTX: an exact bf16 rounding the compiler cannot fold into a neighbouring FMA
    return tl.inline_asm_elementwise(
        asm="{ .reg .b16 t; cvt.rn.bf16.f32 t, $1; cvt.f32.bf16 $0, t; }",
        constraints="=f,f", args=[x], dtype=tl.float32, is_pure=True, pack=1,
    )


@triton.jit
def round_as(x, CODE: tl.constexpr, EMULATE_RTNE: tl.constexpr):
    """fp32 ``x`` rounded (nearest-even) to the dtype ``CODE`` (0 fp32, 1 bf16, 2 fp16), as fp32.

    ``EMULATE_RTNE`` picks how bf16 rounds: 0 a plain conversion round trip; 1 on the bits (the
    interpreter truncates fp32 -> bf16 conversions); 2 inline PTX ``cvt.rn`` (GPU, never contracted).
    """
    if CODE == 1:
        if EMULATE_RTNE == 1:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
        elif EMULATE_RTNE == 2:
            return rn_bf16(x)
        return x.to(tl.bfloat16).to(tl.float32)
    elif CODE == 2:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def for_store(x, CODE: tl.constexpr, EMULATE_RTNE: tl.constexpr):
    """``x`` ready for a store into dtype ``CODE`` (stores round themselves; only the interpreter needs help)."""
    if EMULATE_RTNE == 1 and CODE == 1:
        return round_as(x, CODE, EMULATE_RTNE)
    return x

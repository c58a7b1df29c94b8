"""DeepGEMM provider (optional): the FP8 grouped GEMM stages of ``quant="fp8_block"`` on Hopper, through
`DeepGEMM <https://github.com/deepseek-ai/DeepGEMM>`_'s ``m_grouped_fp8_gemm_nt_contiguous``.

DeepGEMM is not on PyPI and is not a dependency: ``tools/build_deepgemm.sh`` builds it from its source on a
CUDA machine (README, "DeepGEMM"). It is imported lazily; without it, or off sm_90, this provider is not
available and the Triton provider runs the stages.

What it runs (``grouped_gemm_fp8_swiglu_quant``, ``grouped_gemm_fp8``): the codes and 1 x 128 scales of the
permuted rows times each expert's E4M3 weights with 128 x 128 block scales (DeepSeek-V3's recipe, which is
DeepGEMM's SM90 FP8 recipe), output bf16; for gate|up, a Triton kernel then applies SwiGLU and requantizes
(:mod:`~ep_fuse.providers.deepgemm.swiglu_quant_kernel`). DeepGEMM tiles each expert by 128 rows, so it
only takes calls on the aligned layout (``align == 128``, :mod:`ep_fuse.ops.fp8`): the expert
segments come straight from ``seg_indptr`` as DeepGEMM's prefix-sum layout, no rows are copied. The quant
pass asks whether to build that layout through the registry (question ``aligned_layout`` of ``moe_experts_fp8``,
answered by :func:`aligned_layout`).

Numerics: DeepGEMM promotes each 128-deep K block's FP8 MMA result to fp32 with both scales, like the Triton
kernel; its gate|up output is bf16, so SwiGLU sees gate and up rounded to bf16 (the reference keeps fp32).
Checked on a GPU against the reference (``tests/gpu/test_gpu_deepgemm.py``).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
from typing import Any

import torch

from ep_fuse.ops import fp8 as fp8_ops
from ep_fuse.ops.fp8 import FP8, aligned_rows
from ep_fuse.ops.registry import mark_sparse, register_provider, register_rule
from ep_fuse.providers.triton.unverified import gpu_unverified

log = logging.getLogger("ep_fuse.providers")

NAME = "deepgemm"
VARIANT = "fp8:deepgemm"
ALIGN = 128
"""DeepGEMM's M alignment for the contiguous layout on SM90 (its BLOCK_M there; ``get_mk_alignment_for_contiguous_
layout()``'s default, which this provider never changes)."""
BLOCK = 128
"""The weight block (N and K) and activation group DeepGEMM's SM90 FP8 recipe takes."""


def _module() -> Any:
    return importlib.import_module("deep_gemm")


@functools.lru_cache(maxsize=1)
def available() -> str | None:
    """``None`` when DeepGEMM can run here, else why not."""
    if importlib.util.find_spec("deep_gemm") is None:
        return "DeepGEMM is not installed (optional: tools/build_deepgemm.sh builds it, see the README)"
    if not torch.cuda.is_available():
        return "no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        return f"this provider runs DeepGEMM's SM90 FP8 kernels; this GPU is sm_{major}{minor}"
    try:
        dg = _module()
    except Exception as exc:  # a build for another torch/CUDA
        return f"deep_gemm does not import ({type(exc).__name__}: {exc})"
    if not hasattr(dg, "m_grouped_fp8_gemm_nt_contiguous"):
        return "this deep_gemm has no m_grouped_fp8_gemm_nt_contiguous"
    if dg.get_mk_alignment_for_contiguous_layout() != ALIGN:
        return f"deep_gemm's contiguous-layout alignment is {dg.get_mk_alignment_for_contiguous_layout()}, not {ALIGN}"
    return None


def _devices() -> frozenset[str]:
    return frozenset({"cuda"})


def _shapes_ok(k: int, n: int) -> str | None:
    if k % BLOCK or n % BLOCK or k == 0 or n == 0:
        return f"K {k} and N {n} must be non-zero multiples of {BLOCK}"
    return None


def check_call(args: tuple[Any, ...], swiglu: bool = False) -> str | None:
    """``None`` when DeepGEMM runs ``(xq, x_scale, w_q, w_scale, seg_indptr, block_n, block_k, [out_dtype,] align)``."""
    xq, xs, wq, ws, seg, bn, bk = args[:7]
    at = 7 if swiglu else 8
    align = args[at] if len(args) > at else 1
    if align != ALIGN:
        return f"needs the aligned layout (align {ALIGN}; this call has align {align})"
    if xq.device.type != "cuda":
        return "not a CUDA tensor"
    if (reason := gpu_unverified(VARIANT, xq)) is not None:
        return reason
    if (bn, bk) != (BLOCK, BLOCK):
        return f"block {bn}x{bk}: DeepGEMM's SM90 FP8 recipe is {BLOCK}x{BLOCK} weights, 1x{BLOCK} activations"
    if xq.dtype != FP8 or wq.dtype != FP8 or xs.dtype != torch.float32 or ws.dtype != torch.float32:
        return "codes must be float8_e4m3fn and scales fp32"
    if xq.dim() != 2 or wq.dim() != 3 or ws.dim() != 3 or xs.dim() != 2:
        return "shapes are not xq [M, K], x_scale [M, K/128], w_q [E, N, K], w_scale [E, N/128, K/128]"
    if not all(isinstance(v, int) for v in (*xq.shape, *wq.shape)):
        return "symbolic sizes"
    e, n, k = wq.shape
    if (reason := _shapes_ok(k, n)) is not None:
        return reason
    if swiglu and (n // 2) % BLOCK:
        return f"the intermediate size {n // 2} is not a multiple of {BLOCK} (one requant group per 128 columns)"
    if (xq.shape[1] != k or tuple(xs.shape) != (xq.shape[0], k // BLOCK)
            or tuple(ws.shape) != (e, n // BLOCK, k // BLOCK)):
        return "operand shapes do not match"
    if not (xq.is_contiguous() and xs.is_contiguous() and wq.is_contiguous() and ws.is_contiguous()):
        return "operands must be contiguous"
    if seg.dtype != torch.int64 or tuple(seg.shape) != (e + 1,):
        return "seg_indptr is not int64 [E + 1]"
    if not swiglu and args[7] != torch.bfloat16:
        return f"output dtype {args[7]}: DeepGEMM writes bf16"
    return None


def check_swiglu_call(args: tuple[Any, ...]) -> str | None:
    return check_call(args, swiglu=True)


def _gemm(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
    """bf16 ``[M, N]``: each expert's aligned segment times its weights; rows past ``seg[E]`` unwritten."""
    m = xq.shape[0]
    e, n, _k = wq.shape
    out = torch.empty((m, n), dtype=torch.bfloat16, device=xq.device)
    if m == 0:
        return out
    ends = seg[1:].to(torch.int32)  # DeepGEMM's prefix-sum layout: group g spans [align(end[g-1]), end[g])
    real = max(1, (m - e * (ALIGN - 1)) // max(e, 1))  # static: the rows per expert the buffers were sized for
    _module().m_grouped_fp8_gemm_nt_contiguous((xq, xs), (wq, ws), out, ends, use_psum_layout=True,
                                               expected_m_for_psum_layout=real)
    return out


def grouped_gemm_fp8_swiglu_quant_kernel(xq, x_scale, w13_q, w13_scale, seg_indptr, block_n, block_k, align=1):
    """``ep_fuse_deepgemm::grouped_gemm_fp8_swiglu_quant``: DeepGEMM gate|up (bf16) -> Triton SwiGLU + requant."""
    from ep_fuse.providers.deepgemm.swiglu_quant_kernel import launch_swiglu_quant  # imports triton

    m, i = xq.shape[0], w13_q.shape[1] // 2
    h = _gemm(xq, x_scale, w13_q, w13_scale, seg_indptr)
    q = torch.empty((m, i), dtype=FP8, device=xq.device)
    s = torch.empty((m, i // block_k), dtype=torch.float32, device=xq.device)
    launch_swiglu_quant(h, seg_indptr, q, s, block_k)
    return q, s


def grouped_gemm_fp8_kernel(xq, x_scale, w_q, w_scale, seg_indptr, block_n, block_k, out_dtype, align=1):
    """``ep_fuse_deepgemm::grouped_gemm_fp8``: DeepGEMM down GEMM, bf16 out."""
    return _gemm(xq, x_scale, w_q, w_scale, seg_indptr)


MIN_ROWS_PER_EXPERT = 64
"""Smallest average rows per expert at which the quant pass builds the aligned layout for DeepGEMM (measured,
``bench/bench_fp8.py --deepgemm``; below it the padding to 128 rows costs more than DeepGEMM saves)."""


def align_for(x: Any, top_k: int, w13: Any, w2: Any) -> int:
    """``ALIGN`` when the quant pass should build the aligned layout (DeepGEMM takes both GEMMs of the block:
    tokens ``x`` [T, H] at a static size on CUDA, at least :data:`MIN_ROWS_PER_EXPERT` rows per expert), else 1."""
    if not all(isinstance(t, torch.Tensor) for t in (x, w13, w2)) or x.device.type != "cuda":
        return 1
    if available() is not None or gpu_unverified(VARIANT, x) is not None:
        return 1
    t = x.shape[0]
    if not isinstance(t, int) or x.dim() != 2:
        return 1
    e, n13, h = w13.shape
    if _shapes_ok(h, n13) or _shapes_ok(w2.shape[2], w2.shape[1]) or (n13 // 2) % BLOCK:
        return 1
    if t * top_k / max(e, 1) < MIN_ROWS_PER_EXPERT:
        return 1
    log.info("ep_fuse: DeepGEMM runs the FP8 expert GEMMs (%d rows per expert on average; %d permuted rows with "
             "the 128-row alignment)", t * top_k // max(e, 1), aligned_rows(t, top_k, e, ALIGN))
    return ALIGN


def aligned_layout(x: Any, top_k: int, w13: Any, w2: Any) -> tuple[int, tuple[int, int]] | None:
    """The quant pass's question ``aligned_layout`` of ``moe_experts_fp8``: ``(align, (block_n, block_k))`` when
    DeepGEMM takes this block's GEMMs on the layout aligned to ``align`` rows (:func:`align_for`), provided its
    weights have ``block_n x block_k`` blocks; ``None`` when it would not take them."""
    align = align_for(x, top_k, w13, w2)
    return (align, (BLOCK, BLOCK)) if align > 1 else None


mark_sparse(NAME)
# module attributes are looked up per call (tests swap the runtime and the rule)
register_rule(fp8_ops.moe_experts_fp8, NAME, "aligned_layout", lambda *a: aligned_layout(*a))
register_provider(fp8_ops.grouped_gemm_fp8_swiglu_quant, NAME, grouped_gemm_fp8_swiglu_quant_kernel,
                  devices=_devices, available=available, supports=check_swiglu_call)
register_provider(fp8_ops.grouped_gemm_fp8, NAME, grouped_gemm_fp8_kernel, devices=_devices, available=available,
                  supports=check_call)

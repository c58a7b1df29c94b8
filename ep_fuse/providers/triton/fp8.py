"""The Triton provider of the FP8 family: ``quant_fp8_group``, ``moe_permute_fp8``,
``grouped_gemm_fp8_swiglu_quant``, ``grouped_gemm_fp8`` (kernels in :mod:`ep_fuse.providers.triton.fp8_kernel`
and :mod:`~ep_fuse.providers.triton.fp8_tma_kernel`): host code, perf rules, registration.

Checked on a GPU against the pure-torch reference (``tests/gpu/test_gpu_fp8.py``) and under the Triton
interpreter on CPU. No tensor value is read on the host (CUDA-graph capturable). Which blocks
``quant="fp8_block"`` quantizes on CUDA is decided by the measured rule :func:`fp8_block_quant_rule`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ep_fuse.ops import fp8 as ops
from ep_fuse.ops.fp8 import FP8, aligned_rows, cdiv
from ep_fuse.ops.registry import register_rule
from ep_fuse.providers.measured import Threshold
from ep_fuse.providers.tensor_checks import KERNEL_DTYPES, static_rows
from ep_fuse.providers.triton.grouped_gemm import expert_weight_limits, quantized_operand_checks, unit_last
from ep_fuse.providers.triton.moe_permute import check_moe_permute_call
from ep_fuse.providers.triton.provider import register
from ep_fuse.providers.triton.unverified import ENV, cleared, gpu_unverified
from ep_fuse.symbolic import same_shape, sym_eq

MAX_GROUP = 1024
"""Largest activation group (``block_k``) one program loads."""


VARIANT = "fp8:triton"
DISPATCH_VARIANT = "ep:fp8_dispatch"
"""The FP8 codes + scales crossing an EP dispatch (``quant_fp8_group`` moved before it by the quant pass)."""
TMA_VARIANT = "fp8:tma"


def _gate(t: torch.Tensor) -> str | None:
    return gpu_unverified(VARIANT, t)


def _group_ok(group: Any) -> str | None:
    if not isinstance(group, int) or group < 16 or group > MAX_GROUP or group & (group - 1):
        return f"group/block_k {group!r} is not a power of two in [16, {MAX_GROUP}]"
    return None


def check_quant_fp8_call(args: tuple[Any, ...]) -> str | None:
    """``None`` when the kernel runs ``quant_fp8_group(x [M, K], group)``."""
    x, group = args
    if (reason := _gate(x)) is not None:
        return reason
    if x.dtype not in KERNEL_DTYPES or x.dim() != 2 or not unit_last(x):
        return f"x must be a 2-D fp16/bf16/fp32 tensor with unit stride along K (got {x.dim()}-D {x.dtype})"
    return _group_ok(group)


def _align_ok(align: Any) -> str | None:
    if not isinstance(align, int) or align < 1:
        return f"align {align!r} is not a positive int"
    return None


def check_permute_fp8_call(args: tuple[Any, ...]) -> str | None:
    x, topk_ids, num_experts, group = args[:4]
    if (reason := _gate(x)) is not None:
        return reason
    align = args[4] if len(args) > 4 else 1
    if (reason := _align_ok(align)) is not None:
        return reason
    if align > 1 and x.shape[-1] == 0:
        return "aligned layout of rows with no channels"
    return check_moe_permute_call((x, topk_ids, num_experts)) or _group_ok(group)


def check_fp8_gemm_call(args: tuple[Any, ...], swiglu: bool = False) -> str | None:
    """``None`` when the FP8 grouped GEMM kernel runs ``(xq, x_scale, w_q, w_scale, seg_indptr, bn, bk, ...)``."""
    xq, xs, wq, ws, seg, bn, bk = args[:7]
    if (reason := _gate(xq)) is not None:
        return reason
    if xq.dtype != FP8 or wq.dtype != FP8:
        return f"codes {xq.dtype}/{wq.dtype} are not float8_e4m3fn"
    if xs.dtype != torch.float32 or ws.dtype != torch.float32:
        return f"scales {xs.dtype}/{ws.dtype} are not fp32"
    if (reason := _group_ok(bk)) is not None:
        return reason
    if not isinstance(bn, int) or bn < 1:
        return f"block_n {bn!r} is not a positive int"
    if xq.dim() != 2 or wq.dim() != 3 or not sym_eq(wq.shape[2], xq.shape[1]):
        return f"shapes xq {tuple(xq.shape)} / w_q {tuple(wq.shape)} are not [M, K] / [E, N, K]"
    if not (isinstance(wq.shape[1], int) and isinstance(wq.shape[2], int)):
        return "symbolic weight shape"
    k = wq.shape[2]
    if not same_shape(xs.shape, [xq.shape[0], cdiv(k, bk)]):
        return "x_scale is not [M, ceil(K / block_k)]"
    if not same_shape(ws.shape, [wq.shape[0], cdiv(wq.shape[1], bn), cdiv(k, bk)]):
        return "w_scale is not [E, ceil(N / block_n), ceil(K / block_k)]"
    why = quantized_operand_checks(xq, xs, wq, ws, seg, swiglu, None if swiglu else args[7])
    if why:
        return why
    if ws.stride(1) != ws.shape[2]:
        return "w_scale is not contiguous over its last two dims"
    align = args[7 if swiglu else 8] if len(args) > (7 if swiglu else 8) else 1
    return _align_ok(align) or expert_weight_limits(wq)


def check_fp8_swiglu_call(args: tuple[Any, ...]) -> str | None:
    return check_fp8_gemm_call(args, swiglu=True)


def quant_fp8_group_kernel(x, group, wrap=None):
    """``ep_fuse_triton::quant_fp8_group``."""
    from ep_fuse.providers.triton.fp8_kernel import launch_quant_group  # imports triton

    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    s = torch.empty((x.shape[0], cdiv(x.shape[1], group)), dtype=torch.float32, device=x.device)
    if q.numel():
        launch_quant_group(x, q, s, group, wrap=wrap)
    return q, s


def moe_permute_fp8_kernel(x, topk_ids, num_experts, group, align=1, wrap=None):
    """``ep_fuse_triton::moe_permute_fp8``: permute + 1 x group quant in one pass over the T tokens (``align > 1``:
    the aligned layout, padding rows zeroed by a second small kernel)."""
    from ep_fuse.providers.triton.fp8_kernel import launch_permute_quant  # imports triton

    t, k = topk_ids.shape
    h = x.shape[1]
    m = aligned_rows(t, k, num_experts, align)
    q = torch.empty((m, h), dtype=FP8, device=x.device)
    s = torch.empty((m, cdiv(h, group)), dtype=torch.float32, device=x.device)
    src2dst = torch.empty((t * k,), dtype=torch.int64, device=x.device)
    seg = torch.empty((num_experts + 1,), dtype=torch.int64, device=x.device)
    if h == 0:
        from ep_fuse.providers.triton.moe_permute_kernel import launch_permute  # imports triton

        launch_permute(x, topk_ids, num_experts, x.new_empty(t * k, 0), src2dst, seg, wrap=wrap)
        return q, s, src2dst, seg
    launch_permute_quant(x, topk_ids, num_experts, group, q, s, src2dst, seg, align=align, wrap=wrap)
    return q, s, src2dst, seg


def gemm_variant(xq: torch.Tensor, wq: torch.Tensor, traced: bool = False) -> str:
    """``"tma"`` (the persistent TMA kernel, :mod:`~ep_fuse.providers.triton.fp8_tma_kernel`) or ``"default"``:
    the FP8 grouped-GEMM kernel that runs this call (static sizes)."""
    from ep_fuse.providers.triton.fp8_tma_kernel import fp8_tma_unsupported  # imports triton

    why = fp8_tma_rule(xq, wq) or gpu_unverified(TMA_VARIANT, xq) or fp8_tma_unsupported(xq, wq, traced)
    return "default" if why else "tma"


def _gemm(xq, xs, wq, ws, seg, bn: int, bk: int, dtype: torch.dtype | None, swiglu: bool,
          wrap: Callable[[Any], Any] | None) -> Any:
    from ep_fuse.providers.triton.fp8_kernel import launch_fp8_gemm  # imports triton
    from ep_fuse.providers.triton.fp8_tma_kernel import launch_fp8_gemm_tma  # imports triton

    m = xq.shape[0]
    n = wq.shape[1] // 2 if swiglu else wq.shape[1]
    if swiglu:
        y = torch.empty((m, n), dtype=FP8, device=xq.device)
        ys = torch.empty((m, cdiv(n, bk)), dtype=torch.float32, device=xq.device)
    else:
        y = torch.empty((m, n), dtype=dtype, device=xq.device)
        ys = None
    if m == 0 or n == 0:
        return (y, ys) if swiglu else y
    if wq.shape[0] == 0 or xq.shape[1] == 0:  # no experts (every row is tail) or an empty K
        y.view(torch.uint8).zero_() if swiglu else y.zero_()
        if ys is not None:
            ys.zero_()
        return (y, ys) if swiglu else y
    launch = launch_fp8_gemm_tma if gemm_variant(xq, wq, traced=wrap is not None) == "tma" else launch_fp8_gemm
    launch(xq, xs, wq, ws, seg, y, ys, bn, bk, swiglu=swiglu, wrap=wrap)
    return (y, ys) if swiglu else y


def grouped_gemm_fp8_swiglu_quant_kernel(xq, x_scale, w13_q, w13_scale, seg_indptr, block_n, block_k, align=1,
                                         wrap=None):
    """``ep_fuse_triton::grouped_gemm_fp8_swiglu_quant``: fp8 GEMM + block dequant + SwiGLU + 1 x block_k requant."""
    return _gemm(xq, x_scale, w13_q, w13_scale, seg_indptr, block_n, block_k, None, True, wrap)


def grouped_gemm_fp8_kernel(xq, x_scale, w_q, w_scale, seg_indptr, block_n, block_k, out_dtype, align=1, wrap=None):
    """``ep_fuse_triton::grouped_gemm_fp8``: fp8 GEMM with block-scale dequant in the K loop."""
    return _gemm(xq, x_scale, w_q, w_scale, seg_indptr, block_n, block_k, out_dtype, False, wrap)


# --------------------------------------------------------------------------- perf rules
FP8_TMA_MIN_ROWS_PER_EXPERT = Threshold(
    64, command="python bench/bench_fp8.py --tma",
    evidence="DeepSeek-V3 routed layer, each GEMM alone, its best config vs the one-tile-per-program kernel's: gate|up + "
             "SwiGLU + requant 1.06x at 64 rows per expert (T2048), 1.09x at 128 (T4096), 1.08x at 512 (T16384); down "
             "1.10x / 1.10x / 1.08x; unmeasured below 64 (decode's swapped small-M tiles)")
"""From this many rows per expert the FP8 grouped GEMMs take the persistent TMA kernel
(:mod:`~ep_fuse.providers.triton.fp8_tma_kernel`); below it the other kernel keeps those sizes."""


def fp8_tma_rule(xq: Any, wq: Any) -> str | None:
    """Per call (static sizes): why not the FP8 TMA variant on these sizes (``None``: take it)."""
    per_expert = xq.shape[0] / max(wq.shape[0], 1)
    if per_expert < FP8_TMA_MIN_ROWS_PER_EXPERT:
        return f"{per_expert:.0f} rows per expert < {FP8_TMA_MIN_ROWS_PER_EXPERT}"
    return None

FP8_BLOCK_MAX_ROWS_PER_EXPERT = Threshold(
    128, command="python bench/bench_fp8.py",
    evidence="DeepSeek-V3 routed layer H7168 I2048 E256 k8, tile configs from --sweep: the Triton FP8 experts ran 1.92x "
             "the bf16 ep_fuse experts at 4 rows per expert (T128), 2.17x at 16, 1.59x at 32, 1.30x at 64, 1.08x at "
             "128 (T4096) and 0.90x at 512 (T16384)")
"""``quant="fp8_block"`` on bf16 weights: above this many rows per expert (unmeasured up to 512) the block stays
bf16."""


def fp8_block_quant_rule(x: Any, top_k: int, experts: int, deepgemm: bool = False) -> str | None:
    """Why ``quant="fp8_block"`` keeps a block (tokens ``x`` [T, H]) with bf16 weights in bf16 on CUDA (``None``:
    quantize it). Models whose experts already hold fp8 weights are not asked: they have no bf16 weights.
    ``deepgemm``: DeepGEMM takes the block's GEMMs (:func:`ep_fuse.providers.deepgemm.fp8.align_for`), measured
    faster than bf16 at every size it takes."""
    if deepgemm:
        return None
    t = static_rows(x)
    if t is None:
        return ("symbolic token count: the FP8 experts measured faster only up to "
                f"{FP8_BLOCK_MAX_ROWS_PER_EXPERT} rows per expert, and bf16 and fp8 weights cannot both be kept")
    rows = t * top_k / max(experts, 1)
    if rows > FP8_BLOCK_MAX_ROWS_PER_EXPERT:
        return (f"{rows:.1f} rows per expert: the Triton FP8 experts measured faster than bf16 only up to "
                f"{FP8_BLOCK_MAX_ROWS_PER_EXPERT} (1.08x at 128; 0.90x at 512)")
    return None


def fp8_experts_not_cleared(device: str) -> str | None:
    """Why the Triton FP8 expert kernels do not run on ``device`` yet (``None``: they may): on CUDA until
    ``fp8:triton`` is cleared for GPUs (:mod:`~ep_fuse.providers.triton.unverified`)."""
    if device == "cuda" and not cleared(VARIANT):
        return f"the Triton FP8 kernels are not cleared for GPUs ({ENV}=1 enables them)"
    return None


def fp8_dispatch_not_cleared(device: str) -> str | None:
    """Why the activation quantization may not move before an EP dispatch on ``device`` (``None``: it may)."""
    if device == "cuda" and not cleared(DISPATCH_VARIANT):
        return f"FP8 dispatch has not run over NCCL yet ({DISPATCH_VARIANT} in providers/triton/unverified.py)"
    return None


# declined on CUDA where a variant is not yet cleared for GPUs (:mod:`~ep_fuse.providers.triton.unverified`)
register(ops.quant_fp8_group, quant_fp8_group_kernel, supports=check_quant_fp8_call)
register(ops.moe_permute_fp8, moe_permute_fp8_kernel, supports=check_permute_fp8_call)
register(ops.grouped_gemm_fp8_swiglu_quant, grouped_gemm_fp8_swiglu_quant_kernel, supports=check_fp8_swiglu_call)
register(ops.grouped_gemm_fp8, grouped_gemm_fp8_kernel, supports=check_fp8_gemm_call)

# what the quant pass asks the providers of the FP8 block (ep_fuse.ops.registry.ask; module attributes are looked
# up per call, so tests that swap a rule or a threshold reach the pass)
register_rule(ops.moe_experts_fp8, "triton", "keep_bf16", lambda *a, **kw: fp8_block_quant_rule(*a, **kw))
register_rule(ops.moe_experts_fp8, "triton", "not_cleared", lambda device: fp8_experts_not_cleared(device))
register_rule(ops.quant_fp8_group, "triton", "not_cleared_before_dispatch",
              lambda device: fp8_dispatch_not_cleared(device))

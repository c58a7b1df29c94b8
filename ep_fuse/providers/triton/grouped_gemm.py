"""Host side of the Triton grouped-GEMM providers (``grouped_gemm``, ``grouped_gemm_swiglu``).

The launch reads no tensor values on the host (the work list is built on the device from
``seg_indptr``), so it is CUDA-graph capturable and Inductor may trace it through ``wrap_triton``.

Two kernels behind each op, chosen per call from static sizes (:func:`kernel_variant`):

* :mod:`~ep_fuse.providers.triton.grouped_gemm_kernel`: one (tile, n-tile) per program, pointer loads;
  decode (swapped 16-row tiles) and every shape the other kernel does not take.
* :mod:`~ep_fuse.providers.triton.grouped_gemm_tma_kernel` (Hopper grouped GEMM): persistent programs over
  a device-built tile table, TMA descriptors, 64x256 / 128x256-class tiles; from 64 rows per expert
  (:func:`grouped_gemm_tma_rule`) on bf16/fp16 operands TMA can address, at
  any larger size (measured faster than ``torch._grouped_mm`` up to 2048 rows per expert).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ep_fuse.ops.moe import SWIGLUOAI_ALPHA, UNGATED_ACTS, act_problem, act_width, full_act
from ep_fuse.providers.measured import Threshold
from ep_fuse.providers.tensor_checks import KERNEL_DTYPES
from ep_fuse.providers.triton.unverified import gpu_unverified
from ep_fuse.symbolic import known, sym_eq

INT32_MAX = 2**31 - 1
TMA_VARIANT = "grouped_gemm:tma"
log = logging.getLogger(__name__)


def unit_last(t: torch.Tensor) -> bool:
    """Unit stride along the last (K) dim (known for every value of symbolic sizes)."""
    return known(t.shape[-1] <= 1) or known(t.stride(-1) == 1)


def quantized_operand_checks(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
                             seg: torch.Tensor, swiglu: bool, out_dtype: Any) -> str | None:
    """The checks the quantized grouped GEMMs (int8 and fp8) share once codes and scales have their shapes:
    the expert offsets, one device, gate|up halves, the output dtype, unit-stride operands."""
    if seg.dtype not in (torch.int32, torch.int64) or seg.dim() != 1 or not sym_eq(seg.shape[0], wq.shape[0] + 1):
        return "seg_indptr is not an int32/int64 vector of E + 1 offsets"
    if len({t.device for t in (xq, xs, wq, ws, seg)}) != 1:
        return "operands on different devices"
    if swiglu and not known(wq.shape[1] % 2 == 0):
        return "w13 has an odd number of rows (not gate|up halves)"
    if not swiglu and out_dtype not in KERNEL_DTYPES:
        return f"out_dtype {out_dtype} (the kernel writes fp16/bf16/fp32)"
    if not (unit_last(xq) and unit_last(wq) and unit_last(xs) and unit_last(ws)):
        return "operands are not unit-stride along their last dim"
    return None


def expert_weight_limits(w: torch.Tensor) -> str | None:
    """What the grouped-GEMM kernels (bf16 and int8) address: ``MAX_EXPERTS`` experts, int32 offsets
    inside one expert's [N, K] weight (expert weights are parameters: static sizes)."""
    from ep_fuse.providers.triton.grouped_gemm_kernel import MAX_EXPERTS  # imports triton

    if not known(w.shape[0] <= MAX_EXPERTS):
        return f"more than {MAX_EXPERTS} experts"
    if not known(w.shape[1] * w.stride(1) <= INT32_MAX):
        return "one expert's weight spans more than 2**31 elements"
    return None


def check_grouped_gemm_call(args: tuple[Any, ...]) -> str | None:
    """``None`` when the kernel runs ``(x [M, K], w [E, N, K], seg_indptr [E+1])``, else why not."""
    x, w, seg = args
    if x.dtype not in KERNEL_DTYPES or w.dtype != x.dtype:
        return f"dtypes {x.dtype}/{w.dtype} (the kernel takes one of fp16/bf16/fp32 for both)"
    if x.dim() != 2 or w.dim() != 3 or not sym_eq(w.shape[2], x.shape[1]):
        return f"shapes x {tuple(x.shape)} / w {tuple(w.shape)} are not [M, K] / [E, N, K]"
    if seg.dtype not in (torch.int32, torch.int64) or seg.dim() != 1 or not sym_eq(seg.shape[0], w.shape[0] + 1):
        return "seg_indptr is not an int32/int64 vector of E + 1 offsets"
    if seg.device != x.device or w.device != x.device:
        return "operands on different devices"
    if not (unit_last(x) and unit_last(w)):
        return "x or w is not unit-stride along K"
    return expert_weight_limits(w)


def act_variant(act: tuple) -> str | None:
    """The kernel variant name (:data:`~ep_fuse.providers.triton.unverified.UNVERIFIED_ON_GPU`) of a gated
    activation other than plain SwiGLU (``act``: the call's trailing ``(name, limit, gate_cap, up_cap)``)."""
    from ep_fuse.ops.moe import act_args, full_act  # ops: below the provider

    rest = act_args(*full_act(act))
    return f"grouped_gemm_swiglu:{rest[0]}" if rest else None


def check_grouped_gemm_swiglu_call(args: tuple[Any, ...]) -> str | None:
    """As :func:`check_grouped_gemm_call`, for ``w13`` [E, 2I, H] (gate rows, then up rows), with the call's
    gated activation (a variant other than SwiGLU is declined on CUDA until its GPU check has run)."""
    reason = check_grouped_gemm_call(args[:3])
    act = full_act(tuple(args[3:]))
    if reason is None and act[0] not in UNGATED_ACTS and not known(args[1].shape[1] % 2 == 0):
        return "w13 has an odd number of rows (not gate|up halves)"
    variant = act_variant(act)
    if reason is None and variant is not None:
        reason = act_problem(*act) or gpu_unverified(variant, args[0])
    return reason


def tma_declined(x: torch.Tensor, w: torch.Tensor, traced: bool = False, swiglu: bool = False,
                 act: tuple = ()) -> str | None:
    """Why this call (``swiglu``: of ``grouped_gemm_swiglu``, ``w`` = [E, 2I, K], with the gated activation
    ``act``) does not take the TMA kernel (``None``: it does)."""
    from ep_fuse.providers.triton.grouped_gemm_tma_kernel import tma_unsupported  # imports triton

    if act_variant(act) is not None:
        return f"{act_variant(act)}: the TMA kernel's epilogue is plain SwiGLU"
    return (grouped_gemm_tma_rule(x, w, swiglu) or gpu_unverified(TMA_VARIANT, x)
            or tma_unsupported(x, w, traced))


def kernel_variant(x: torch.Tensor, w: torch.Tensor, traced: bool = False, swiglu: bool = False,
                   act: tuple = ()) -> str:
    """``"tma"`` or ``"default"``: the kernel that runs this call."""
    reason = tma_declined(x, w, traced, swiglu, act)
    if reason is not None:
        log.debug("grouped GEMM %s x %s: default kernel (%s)", tuple(x.shape), tuple(w.shape), reason)
        return "default"
    return "tma"


def run_grouped(swiglu: bool, x: torch.Tensor, w: torch.Tensor, seg: torch.Tensor, *act: Any,
                wrap: Callable[[Any], Any] | None = None, variant: str | None = None,
                config: Any = None) -> torch.Tensor:
    """Allocate the output and launch the grouped GEMM: ``variant`` (``None``: :func:`kernel_variant` chooses
    from static sizes) with tile ``config`` (``None``: that kernel's ``config_for``); ``act``: the gated
    activation's ``(name, limit, gate_cap, up_cap)`` (empty: SwiGLU; one of ``UNGATED_ACTS``: the single GEMM
    with that activation in its epilogue)."""
    act = full_act(tuple(act))
    gated = act_variant(act) is not None
    ungated = swiglu and act[0] in UNGATED_ACTS
    n = act_width(w.shape[1], act[0]) if swiglu else w.shape[1]
    y = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    if known(x.shape[0] == 0) or known(n == 0):  # an unbacked 0 launches an empty grid
        return y
    if w.shape[0] == 0:  # no experts: every row is tail
        return y.zero_()
    if (variant or kernel_variant(x, w, traced=wrap is not None, swiglu=swiglu, act=act)) == "tma" and not gated:
        # kernel modules import triton: on first launch
        from ep_fuse.providers.triton.grouped_gemm_tma_kernel import (
            launch_grouped_gemm_swiglu_tma,
            launch_grouped_gemm_tma,
        )

        launch = launch_grouped_gemm_swiglu_tma if swiglu else launch_grouped_gemm_tma
    else:
        from ep_fuse.providers.triton.grouped_gemm_kernel import (  # kernel modules import triton
            launch_grouped_gemm,
            launch_grouped_gemm_swiglu,
        )

        launch = launch_grouped_gemm_swiglu if swiglu and not ungated else launch_grouped_gemm
    if act[0] == "swigluoai":  # the kernel's gate-cap slot carries the sigmoid's scale
        act = (act[0], act[1], SWIGLUOAI_ALPHA, None)
    if gated:
        launch(x, w, seg, y, config=config, wrap=wrap, act=act)
    else:
        launch(x, w, seg, y, config=config, wrap=wrap)
    return y


def grouped_gemm_kernel(x, w, seg_indptr, wrap=None):
    """``ep_fuse_triton::grouped_gemm``."""
    return run_grouped(False, x, w, seg_indptr, wrap=wrap)


def grouped_gemm_swiglu_kernel(x, w13, seg_indptr, act="silu", limit=None, gate_cap=None, up_cap=None, wrap=None):
    """``ep_fuse_triton::grouped_gemm_swiglu``."""
    return run_grouped(True, x, w13, seg_indptr, act, limit, gate_cap, up_cap, wrap=wrap)


GROUPED_GEMM_TMA_MIN_ROWS_PER_EXPERT = Threshold(
    64, command="python bench/bench_moe_grouped_gemm_tma.py --shape NAME=T,H,I,E,K",
    evidence="CUDA-graph replays, both GEMMs of a layer against the one-tile-per-program kernel at its configs: 1.06x "
             "(Qwen3-30B-A3B), 1.15x (DeepSeek-V3), 1.06x (Mixtral-8x7B; 1.10x with the many-experts gate|up config) "
             "at 64 rows per expert, 1.13-1.14x at 96 (where that kernel's 128-row tiles ran 0.93-0.97x "
             "torch._grouped_mm); at 32 the kernel was 0.99-1.02x the TMA kernel's best config, at 16 1.01-1.08x; "
             "from 128 to 2048 rows per expert gate|up + SwiGLU 1.10-1.36x torch._grouped_mm followed by the SwiGLU, "
             "down 1.00-1.29x torch._grouped_mm")
"""From this many rows per expert on average the grouped GEMMs take the Hopper TMA persistent kernel
(:mod:`~ep_fuse.providers.triton.grouped_gemm_tma_kernel`), at every larger size, where the GEMM's output
columns fill its column tiles (:func:`grouped_gemm_tma_rule`); below it the other kernel keeps those sizes."""


def grouped_gemm_tma_rule(x: Any, w: Any, swiglu: bool = False) -> str | None:
    """Per call (static sizes): why not the TMA variant on these sizes (``None``: take it). The GEMM's output
    columns (``I`` for gate|up + SwiGLU, ``w.shape[1]`` otherwise) must fill the config's column tiles: on an
    E60 H2880 I1408 model (1408 and 2880 columns on 256-wide tiles) the TMA kernel ran 0.92-0.96x
    ``torch._grouped_mm`` at 205 and 410 rows per expert, every swept config."""
    per_expert = x.shape[0] / max(w.shape[0], 1)
    if per_expert < GROUPED_GEMM_TMA_MIN_ROWS_PER_EXPERT:
        return f"{per_expert:.0f} rows per expert < {GROUPED_GEMM_TMA_MIN_ROWS_PER_EXPERT}"
    return grouped_gemm_tma_columns_rule(x, w, swiglu)


def grouped_gemm_tma_columns_rule(x: Any, w: Any, swiglu: bool = False) -> str | None:
    """The row-count-free part of :func:`grouped_gemm_tma_rule` (``x``'s rows are not read)."""
    from ep_fuse.providers.triton.grouped_gemm_tma_kernel import config_for  # imports triton

    if x.device.type != "cuda":  # a GPU measurement: the interpreter's tiles are not the GPU's
        return None
    n, k, e = (w.shape[1] // 2 if swiglu else w.shape[1]), w.shape[2], w.shape[0]
    bn = config_for(0, n, k, e, swiglu=swiglu, interpret=False).bn
    if n % bn:
        return (f"{n} output columns do not fill the TMA kernel's {bn}-column tiles (measured 0.92-0.96x "
                "torch._grouped_mm on such a shape)")
    return None

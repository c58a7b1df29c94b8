"""The Triton provider of the dense GEMM + SwiGLU family (``gemm_swiglu``): host code, perf rules, size branches,
registration.

Two kernels behind ``gemm_swiglu``, chosen per call from static sizes (:func:`dense_variant`): the
one-tile-per-program kernel (:mod:`~ep_fuse.providers.triton.gemm_swiglu_kernel`, swapped decode tiles), and
from :data:`GEMM_SWIGLU_TMA_MIN_ROWS` rows the Hopper TMA persistent kernel of
the grouped GEMMs run as one expert (:func:`~ep_fuse.providers.triton.grouped_gemm_tma_kernel.launch_gemm_swiglu_tma`,
the gate and up weights read in place).

Perf rules: the one-tile-per-program kernel is faster than cuBLAS + Inductor's SwiGLU only at decode sizes
(:data:`GEMM_SWIGLU_MAX_ROWS`); the Hopper TMA kernel from :data:`GEMM_SWIGLU_TMA_MIN_ROWS` rows on MLPs at least
:data:`GEMM_SWIGLU_TMA_MIN_I` wide. Declined elsewhere under both executors. At a symbolic row count the rule answers
:class:`~ep_fuse.ops.registry.AtRunTime` and ``gemm_swiglu_by_size`` applies :func:`gemm_swiglu_at_run_time` per
call, traced as row-count branches (:func:`gemm_swiglu_branches`)."""

from __future__ import annotations

from typing import Any

import torch

from ep_fuse.ops import gemm_swiglu as ops
from ep_fuse.ops.gemm_swiglu import gemm_swiglu_ref
from ep_fuse.ops.registry import AtRunTime
from ep_fuse.providers.measured import Threshold
from ep_fuse.providers.tensor_checks import KERNEL_DTYPES, row_stride, static_rows
from ep_fuse.providers.triton.provider import register
from ep_fuse.providers.triton.size_branches import ROWS_LIMIT, Branch, Run
from ep_fuse.symbolic import concrete_int


def check_gemm_swiglu_call(args: tuple[Any, ...]) -> str | None:
    x, wg, wu = args[:3]
    if len(args) > 3 and args[3] and x.dtype != torch.float32:
        return "SwiGLU in fp32 of low-precision GEMM outputs (act_fp32): the kernel rounds the silu to the input dtype"
    if x.dtype not in KERNEL_DTYPES or wg.dtype != x.dtype or wu.dtype != x.dtype:
        return f"dtypes {x.dtype}/{wg.dtype}/{wu.dtype} (the kernel takes one of fp16/bf16/fp32 for all)"
    if x.dim() < 1 or wg.dim() != 2 or wu.shape != wg.shape:
        return "weights are not two [I, H] matrices of one shape"
    if row_stride(x) is None:
        return "input rows are not unit-stride rows with one row stride"
    if any(w.shape[-1] > 1 and w.stride(-1) != 1 for w in (wg, wu)):
        return "weight rows are not unit-stride (the kernel walks K contiguously)"
    return None


def dense_variant(x2: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, traced: bool = False) -> str:
    """``"tma"`` or ``"default"``: the kernel that runs ``x2 [M, H]`` (static sizes)."""
    from ep_fuse.providers.triton.grouped_gemm_tma_kernel import dense_tma_unsupported  # imports triton

    if x2.shape[0] < GEMM_SWIGLU_TMA_MIN_ROWS or w_gate.shape[0] == 0:  # the threshold is >= 1 row
        return "default"
    return "default" if dense_tma_unsupported(x2, w_gate, w_up, traced) else "tma"


def run_dense(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, wrap: Any = None,
              variant: str | None = None, config: Any = None) -> torch.Tensor:
    """Allocate the output and launch the GEMM + SwiGLU on ``x``'s rows: ``variant`` (``None``:
    :func:`dense_variant` chooses from static sizes) with tile ``config`` (``None``: that kernel's own)."""
    h = x.shape[-1]
    rs = row_stride(x)
    assert rs is not None  # checked by check_gemm_swiglu_call
    x2 = x.as_strided((x.numel() // max(h, 1), h), (rs, 1)) if x.dim() != 2 else x
    y = torch.empty((*x.shape[:-1], w_gate.shape[0]), dtype=x.dtype, device=x.device)
    if (variant or dense_variant(x2, w_gate, w_up, traced=wrap is not None)) == "tma":
        from ep_fuse.providers.triton.grouped_gemm_tma_kernel import launch_gemm_swiglu_tma as launch  # triton
    else:
        from ep_fuse.providers.triton.gemm_swiglu_kernel import launch  # imports triton: on first launch
    launch(x2, w_gate, w_up, y.view(-1, w_gate.shape[0]), config=config, wrap=wrap)
    return y


def gemm_swiglu_kernel(x, w_gate, w_up, act_fp32=False, wrap=None):  # noqa: ANN001, ANN201 - schema-typed
    """``ep_fuse_triton::gemm_swiglu`` (``act_fp32`` only for fp32 inputs, where it changes nothing:
    :func:`check_gemm_swiglu_call`)."""
    return run_dense(x, w_gate, w_up, wrap)


# --------------------------------------------------------------------------- perf rules
GEMM_SWIGLU_MAX_ROWS = Threshold(
    32, command="python bench/bench_gemm_swiglu.py --part decode",
    evidence="the fused GEMM + SwiGLU (swapped decode tiles) vs cuBLAS + Inductor's SwiGLU: 1.02-1.26x at 1, 16 and 32 "
             "rows on H4096/I11008, H7168/I18432, H7168/I2048, H2048/I5632; 0.85-0.95x at 64 rows on three of them, "
             "0.77-0.87x at 1024 and 8192")
"""Up to this many rows the one-tile-per-program kernel runs (eager cuBLAS was 1-8% slower than Inductor here)."""

GEMM_SWIGLU_TMA_MIN_ROWS = Threshold(
    2048, command="python bench/bench_gemm_swiglu.py --part prefill",
    evidence="the TMA kernel vs cuBLAS + Inductor's SwiGLU: 0.94x at 1024 rows on H4096/I11008, 1.01-1.06x from 2048")
"""From this many rows ``gemm_swiglu`` runs the Hopper TMA kernel (the grouped GEMM as one expert, gate and up
weights read in place) instead of the one-tile-per-program kernel, where TMA can address the operands."""

GEMM_SWIGLU_TMA_MIN_I = Threshold(
    11008, command="python bench/bench_gemm_swiglu.py --part prefill",
    evidence="vs cuBLAS + Inductor's SwiGLU: H4096/I11008 1.04x, 1.06x, 1.01x at 2048, 4096, 8192 rows; H7168/I18432 "
             "1.04x, 1.00x, 1.01x, 1.03x at 1024 to 8192; the narrow DeepSeek-V3 shared expert H7168/I2048 0.95-0.97x "
             "at 1024-4096 (1.00x at 8192); the one-tile-per-program kernel 0.72-0.89x at every one of these sizes")
"""...and the TMA kernel is kept under ``perf_guard`` for MLPs at least this wide (narrower MLPs keep cuBLAS)."""


def dense_tma_size_wins(rows: int, inter: int | None) -> bool:
    """Whether ``rows`` x ``[inter, H]`` gate/up weights is a measured win of the dense TMA kernel."""
    return rows >= GEMM_SWIGLU_TMA_MIN_ROWS and inter is not None and inter >= GEMM_SWIGLU_TMA_MIN_I


def _dense_tma_wins(x: Any, w_gate: Any, w_up: Any, rows: int) -> bool:
    """The measured TMA win (:data:`GEMM_SWIGLU_TMA_MIN_I`, :data:`GEMM_SWIGLU_TMA_MIN_ROWS`) on a CUDA call the
    TMA kernel takes."""
    from torch._subclasses.fake_tensor import is_fake  # private torch module: asked at use

    from ep_fuse.providers.triton.grouped_gemm_tma_kernel import dense_tma_unsupported  # imports triton

    if not dense_tma_size_wins(rows, concrete_int(w_gate.shape[0]) if w_gate is not None else None):
        return False
    if not isinstance(x, torch.Tensor) or x.device.type != "cuda":
        return False
    rs = row_stride(x)
    if rs is None:
        return False
    x2 = x.as_strided((rows, x.shape[-1]), (rs, 1)) if x.dim() != 2 else x  # what the provider launches on
    return dense_tma_unsupported(x2, w_gate, w_up, traced=is_fake(x)) is None


def gemm_swiglu_prefers(args: tuple[Any, ...], executor: str) -> str | AtRunTime | None:
    x, w_gate, w_up = args[:3]
    rows = static_rows(x)
    if rows is None:
        return AtRunTime(f"the kernel up to {GEMM_SWIGLU_MAX_ROWS} rows and on the TMA kernel's measured wins, "
                         "the reference (cuBLAS + SwiGLU) elsewhere")
    if rows > GEMM_SWIGLU_MAX_ROWS and not _dense_tma_wins(x, w_gate, w_up, rows):
        return (f"{rows} rows (H={x.shape[-1]} I={w_gate.shape[0]}): cuBLAS + the unfused SwiGLU "
                f"measured faster above {GEMM_SWIGLU_MAX_ROWS} rows (the TMA kernel only from "
                f"{GEMM_SWIGLU_TMA_MIN_ROWS} rows at I >= {GEMM_SWIGLU_TMA_MIN_I}, on Hopper)")
    return None


def gemm_swiglu_at_run_time(args: tuple[Any, ...]) -> str | None:
    """Per call of ``gemm_swiglu_by_size`` (real tensors): the kernel up to 32 rows or on a TMA win."""
    x, w_gate, w_up = args[:3]
    rows = x.numel() // max(x.shape[-1], 1)
    if rows <= GEMM_SWIGLU_MAX_ROWS or _dense_tma_wins(x, w_gate, w_up, rows):
        return None
    return f"{rows} rows > {GEMM_SWIGLU_MAX_ROWS}"


# --------------------------------------------------------------------------- size branches
def _dense_rows(x: torch.Tensor) -> Any:
    return x.numel() // max(int(x.shape[-1]), 1)


def _dense(variant: str, config: Any) -> Run:
    return lambda args, wrap: run_dense(*args, wrap=wrap, variant=variant, config=config)


def gemm_swiglu_branches(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> list[Branch]:
    """The branches of ``gemm_swiglu_by_size``: the kernel's decode tiles up to
    :data:`GEMM_SWIGLU_MAX_ROWS` rows, the TMA kernel on its measured wins,
    the reference (two cuBLAS GEMMs and the SwiGLU) elsewhere."""
    # kernel modules import triton: asked when a compile traces the branches
    from ep_fuse.providers.triton import grouped_gemm_tma_kernel as tma
    from ep_fuse.providers.triton.gemm_swiglu_kernel import gemm_config  # imports triton

    n, k = int(w_gate.shape[0]), int(w_gate.shape[1])
    reference = Branch("reference", None, lambda args, wrap: gemm_swiglu_ref(*args))
    branches = [Branch("kernel (16-row tiles)", 17, _dense("default", gemm_config(16, n, k))),
                Branch("kernel (32-row tiles)", GEMM_SWIGLU_MAX_ROWS + 1,
                       _dense("default", gemm_config(GEMM_SWIGLU_MAX_ROWS, n, k)))]
    rs = row_stride(x)
    if (x.device.type == "cuda" and isinstance(rs, int) and dense_tma_size_wins(GEMM_SWIGLU_TMA_MIN_ROWS, n)
            and tma.dense_tma_unsupported(x.new_empty_strided((GEMM_SWIGLU_TMA_MIN_ROWS, k), (rs, 1)), w_gate,
                                          w_up, traced=True) is None):
        branches += [Branch("reference", GEMM_SWIGLU_TMA_MIN_ROWS, reference.run),
                     Branch("tma", ROWS_LIMIT, _dense("tma", tma.dense_config_for(0, n, k)))]
    branches.append(reference)
    return branches


register(ops.gemm_swiglu, gemm_swiglu_kernel, supports=check_gemm_swiglu_call, prefers=gemm_swiglu_prefers,
         run_time=gemm_swiglu_at_run_time, branches=(gemm_swiglu_branches, _dense_rows))

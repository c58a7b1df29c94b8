"""Where the Triton kernels measured slower than what the executor runs without them (docs/benchmarks.md).

Consulted with ``perf_guard=True`` (the default). Under the Inductor executor a declined call keeps
the ATen ops, so Inductor generates exactly the code it would have generated without ep_fuse; under
the eager executor the canonical op runs its reference (the unfused ATen ops). The rules come from
H200 runs (GPU time from CUDA-graph replays, 2026-11-29):

* ``add_rms_norm``: faster at 16384x7168 (1.03x, 95.6% of copy bandwidth), 16384x4096 (1.01x),
  4096x7168 (1.01x), 4096x2048 (1.02x), 64x7168 (1.17x) and 1x7168 (1.29x); slower at 512x7168
  (0.91x) and 64x4096 (0.94x). So batches under 4096 rows keep Inductor's kernel, except very small
  batches (< 128 rows) of rows at least 7168 wide. With a symbolic row count the kernel is used: the
  only run-time alternative, the unfused ATen ops, is slower than the kernel at every size.
* ``rms_norm`` (no residual): Inductor's kernel was as fast or faster at every size measured
  (16384x7168: 114.6 vs 167.8 us; 16384x4096: 78.5 vs 79.7 us; 262144x128: 37.1 vs 39.2 us), so
  the provider always declines it under Inductor. It is still used by the eager executor.
* ``rope`` / ``rope_qk`` / ``rope_cache`` / ``rope_qk_cache``: with bf16/fp16 heads (exact rounding by packed
  ``fma.rn``) 1.06-1.19x Inductor on the baseline grid and 1.31-2.35x in the cos/sin-cache form, so used;
  fp32 heads and the complex form decline under Inductor.
* ``gemm_swiglu``: the one-tile-per-program kernel is faster than cuBLAS + Inductor's SwiGLU only at decode
  sizes (<= 32 rows: 1.02-1.26x on four shapes); the Hopper TMA kernel from 2048 rows on MLPs at least 11008
  wide (1.00-1.06x, :data:`GEMM_SWIGLU_TMA_MIN_I`). Declined elsewhere under both executors.

Every rule takes ``(args, executor)``; the eager executor's baseline is the unfused ATen ops.

**Symbolic sizes** (``dynamic=True``, automatic dynamic): a rule never reads a ``SymInt`` (``int()``
would add a guard and recompile the graph per size). Where the faster choice depends on the row count,
the rule answers :class:`~ep_fuse.ops.registry.AtRunTime` and the node runs the provider's
``<op>_by_size`` op, which applies the ``*_at_run_time`` rule below to the real sizes of each call:

* ``gemm_swiglu``: the kernel up to :data:`GEMM_SWIGLU_MAX_ROWS` rows and where the TMA kernel measured
  faster, the reference (two cuBLAS GEMMs, silu, mul) elsewhere;
* ``grouped_gemm`` / ``grouped_gemm_swiglu`` (Inductor executor): the kernel up to
  :data:`GROUPED_GEMM_MAX_ROWS_PER_EXPERT` rows per expert or where the TMA kernel takes the call,
  ``torch._grouped_mm`` (the reference, bf16) elsewhere; where ``torch._grouped_mm`` does not run (fp16/fp32)
  the kernel at every size (the reference would loop over the experts on the host).

``moe_gating`` and ``add_rms_norm`` with a symbolic token count use the kernel: below their thresholds the
faster code is Inductor's, which a run-time choice cannot call, and the reference is slower than the
kernel at every measured size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from ep_fuse.ops.moe_reference import grouped_mm_supported
from ep_fuse.ops.registry import AtRunTime
from ep_fuse.providers.common import row_stride, unpack_norm_args
from ep_fuse.symbolic import concrete_int

LARGE_BATCH_ROWS = 4096
SMALL_BATCH_ROWS = 128
WIDE_ROW = 7168


def _static_rows(x: Any) -> int | None:
    """Row count of ``x`` over its last dim, or ``None`` when it is symbolic (no guard is added)."""
    n, width = x.numel(), x.shape[-1]
    if not (is_concrete_int(n) and is_concrete_int(width)):
        return None
    return int(n) // max(int(width), 1)


def add_rms_norm_prefers(args: tuple[Any, ...], executor: str) -> str | None:
    if executor != "inductor":
        return None
    x, _res, _rest = unpack_norm_args(args)
    rows, width = _static_rows(x), concrete_int(x.shape[-1])
    if rows is None or width is None or rows >= LARGE_BATCH_ROWS:
        return None
    if rows < SMALL_BATCH_ROWS and width >= WIDE_ROW:
        return None
    return f"{rows}x{width}: Inductor's fused kernel measured as fast at this size"


def rms_norm_prefers(args: tuple[Any, ...], executor: str) -> str | None:
    if executor != "inductor":
        return None
    return "plain RMSNorm: Inductor's fused kernel measured as fast or faster"


def _rope_rule(x: Any, form: str, executor: str) -> str | None:
    """bf16/fp16 heads (packed ``fma.rn`` rounding) measured faster than Inductor's kernel: 1.03-1.22x on the
    baseline grid (parity, 0.99-1.14x over two runs, at 16384 tokens x 32+8 heads x 128), 1.15-2.2x on the
    chunk / GPT-J / de-interleaved forms, 1.2-2.4x in the cache form. fp32 heads (fp32 math, 0.81-0.89x
    before the packed path) and the complex form (unmeasured) decline."""
    if executor != "inductor":
        return None
    if form == "complex":
        return "RoPE complex form (fp32 math): not measured against Inductor"
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"RoPE on {x.dtype} heads: Inductor's kernel measured faster (0.81-0.89x)"
    return None


def rope_prefers(args: tuple[Any, ...], executor: str) -> str | None:
    """``rope(x, cos, sin, form, ...)`` / ``rope_qk(q, k, cos, sin, form, ...)``: see :func:`_rope_rule`."""
    return _rope_rule(args[0], args[-3], executor)


def rope_cache_prefers(args: tuple[Any, ...], executor: str) -> str | None:
    """``rope_cache(x, cache, positions, form, rot)`` / ``rope_qk_cache(q, k, ...)``: see :func:`_rope_rule`."""
    return _rope_rule(args[0], args[-2], executor)


GEMM_SWIGLU_MAX_ROWS = 32
"""The fused GEMM + SwiGLU (swapped decode tiles) measured faster than cuBLAS + Inductor's SwiGLU at 1, 16
and 32 rows on all four measured shapes (H4096/I11008, H7168/I18432, H7168/I2048, H2048/I5632:
1.02-1.26x). At 64 rows it was slower on three of them (0.85-0.95x), and slower everywhere from 128 on
(0.77-0.87x at 1024 and 8192). Eager cuBLAS was 1-8% slower than Inductor at these sizes."""


GEMM_SWIGLU_TMA_MIN_ROWS = 2048
"""From this many rows ``gemm_swiglu`` runs the Hopper TMA kernel (the grouped GEMM as one expert, gate and up
weights read in place) instead of the one-tile-per-program kernel, where TMA can address the operands."""

GEMM_SWIGLU_TMA_MIN_I = 11008
"""...and the TMA kernel is kept under ``perf_guard`` for MLPs at least this wide. Measured on H200
(``bench/bench_gemm_swiglu_prefill.py``, 2026-11-30, vs cuBLAS + Inductor's SwiGLU): H4096/I11008 1.04x,
1.06x, 1.01x at 2048, 4096, 8192 rows (0.94x at 1024); H7168/I18432 1.04x, 1.00x, 1.01x, 1.03x at 1024 to
8192; the narrow DeepSeek-V3 shared expert H7168/I2048 0.95-0.97x at 1024-4096 (1.00x at 8192), so narrower
MLPs keep cuBLAS. The one-tile-per-program kernel was 0.72-0.89x at every one of these sizes."""


def dense_tma_size_wins(rows: int, inter: int | None) -> bool:
    """Whether ``rows`` x ``[inter, H]`` gate/up weights is a measured win of the dense TMA kernel."""
    return rows >= GEMM_SWIGLU_TMA_MIN_ROWS and inter is not None and inter >= GEMM_SWIGLU_TMA_MIN_I


def _dense_tma_wins(x: Any, w_gate: Any, w_up: Any, rows: int) -> bool:
    """The measured TMA win (:data:`GEMM_SWIGLU_TMA_MIN_I`, :data:`GEMM_SWIGLU_TMA_MIN_ROWS`) on a CUDA call the
    TMA kernel takes."""
    from torch._subclasses.fake_tensor import is_fake

    from ep_fuse.providers.triton.grouped_gemm_tma_kernel import dense_tma_unsupported

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
    x, w_gate, w_up = args
    rows = _static_rows(x)
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
    x, w_gate, w_up = args
    rows = x.numel() // max(x.shape[-1], 1)
    if rows <= GEMM_SWIGLU_MAX_ROWS or _dense_tma_wins(x, w_gate, w_up, rows):
        return None
    return f"{rows} rows > {GEMM_SWIGLU_MAX_ROWS}"


# --------------------------------------------------------------------------- MoE (H200, 2026-11-29/30)
GROUPED_GEMM_MAX_ROWS_PER_EXPERT = 128
"""The one-tile-per-program grouped GEMMs measured faster than ``torch._grouped_mm`` (eager or under Inductor)
at 4 rows per expert (DeepSeek-V3 decode, T128 k8 E256: 4978 vs 6970 us for both GEMMs, 1.40x), 6 to 102 on
an E60 H2880 I1408 model (1.04-1.52x, ``bench/bench_moe_experts.py``, 2026-11-30) and 128 (DeepSeek-V3 prefill
T4096: 9376 vs 10213 us, 1.09x), and slower at 205 (the E60 model at T2048: best swept config 0.82x) and 1536
(T16384 k6 E64: 3410 vs 3081 us, 0.90x). Above 128 rows per expert the provider declines under Inductor,
unless the Hopper TMA kernel takes the call (:data:`GROUPED_GEMM_TMA_MIN_ROWS_PER_EXPERT`); eager
``torch._grouped_mm`` was slower than the kernel at every size (3475 vs 3410 us at 1536 rows per expert)."""

GROUPED_GEMM_TMA_MIN_ROWS_PER_EXPERT = 128
"""From this many rows per expert on average the grouped GEMMs take the Hopper TMA persistent kernel
(:mod:`~ep_fuse.providers.triton.grouped_gemm_tma_kernel`), at every larger size, where the GEMM's output
columns fill its column tiles (:func:`grouped_gemm_tma_rule`). Measured on H200
(``bench/bench_grouped_gemm_tma.py``, 2026-11-30, CUDA-graph replays) at 128 to 2048 rows per expert on five
prefill shapes with the configs of ``config_for``: gate|up + SwiGLU 1.10-1.36x ``torch._grouped_mm`` followed
by the SwiGLU (0.97-1.30x the GEMM alone), down 1.00-1.29x ``torch._grouped_mm``, and faster than the
one-tile-per-program kernel everywhere (1.12x / 1.27x at 128 rows per expert, DeepSeek-V3 T4096). Below 128
rows per expert it is unmeasured, so the other kernel keeps those sizes."""


def _tma_takes(x: Any, w: Any, swiglu: bool = False) -> bool:
    """Whether a CUDA call on these (fake or real, static-size) tensors runs the TMA grouped GEMM."""
    from torch._subclasses.fake_tensor import is_fake

    from ep_fuse.providers.triton.grouped_gemm import tma_declined

    if not isinstance(x, torch.Tensor) or x.device.type != "cuda":
        return False
    return tma_declined(x, w, traced=is_fake(x), swiglu=swiglu) is None


def _grouped_prefers(args: tuple[Any, ...], executor: str, swiglu: bool) -> str | AtRunTime | None:
    if executor != "inductor":  # eager torch._grouped_mm measured slower than the kernel at every size
        return None
    x, w = args[0], args[1]
    rows, experts = concrete_int(x.shape[0]), concrete_int(w.shape[0])
    if rows is None or experts is None:  # int() would specialize the graph on this row count
        return AtRunTime(f"the kernel up to {GROUPED_GEMM_MAX_ROWS_PER_EXPERT} rows per expert (any size on the "
                         "TMA kernel), torch._grouped_mm above (bf16)")
    per_expert = rows / max(experts, 1)
    if per_expert > GROUPED_GEMM_MAX_ROWS_PER_EXPERT and not _tma_takes(x, w, swiglu):
        return (f"{per_expert:.0f} rows per expert: torch._grouped_mm measured faster above "
                f"{GROUPED_GEMM_MAX_ROWS_PER_EXPERT} (0.82x at 205, 0.90x at 1536) and the TMA kernel does not "
                "take this call")
    return None


def grouped_gemm_prefers(args: tuple[Any, ...], executor: str) -> str | AtRunTime | None:
    return _grouped_prefers(args, executor, swiglu=False)


def grouped_gemm_swiglu_prefers(args: tuple[Any, ...], executor: str) -> str | AtRunTime | None:
    return _grouped_prefers(args, executor, swiglu=True)


def _grouped_at_run_time(args: tuple[Any, ...], swiglu: bool) -> str | None:
    x, w = args[0], args[1]
    per_expert = x.shape[0] / max(w.shape[0], 1)
    if (per_expert <= GROUPED_GEMM_MAX_ROWS_PER_EXPERT or not grouped_mm_supported(x, w)
            or _tma_takes(x, w, swiglu)):
        return None
    return f"{per_expert:.0f} rows per expert > {GROUPED_GEMM_MAX_ROWS_PER_EXPERT}: torch._grouped_mm"


def grouped_gemm_at_run_time(args: tuple[Any, ...]) -> str | None:
    """Per call of ``grouped_gemm_by_size`` (real tensors): the TMA kernel where it takes the call, else the
    kernel up to :data:`GROUPED_GEMM_MAX_ROWS_PER_EXPERT` rows per expert, then the reference
    (``torch._grouped_mm``) where it runs."""
    return _grouped_at_run_time(args, swiglu=False)


def grouped_gemm_swiglu_at_run_time(args: tuple[Any, ...]) -> str | None:
    """As :func:`grouped_gemm_at_run_time`, for ``grouped_gemm_swiglu_by_size``."""
    return _grouped_at_run_time(args, swiglu=True)


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
    from ep_fuse.providers.triton.grouped_gemm_tma_kernel import config_for

    if x.device.type != "cuda":  # a GPU measurement: the interpreter's tiles are not the GPU's
        return None
    n, k, e = (w.shape[1] // 2 if swiglu else w.shape[1]), w.shape[2], w.shape[0]
    bn = config_for(0, n, k, e, swiglu=swiglu, interpret=False).bn
    if n % bn:
        return (f"{n} output columns do not fill the TMA kernel's {bn}-column tiles (measured 0.92-0.96x "
                "torch._grouped_mm on such a shape)")
    return None


FP8_TMA_MIN_ROWS_PER_EXPERT = 64
"""From this many rows per expert the FP8 grouped GEMMs take the persistent TMA kernel
(:mod:`~ep_fuse.providers.triton.fp8_tma_kernel`). Measured on H200 (``bench/bench_fp8.py --tma``, 2026-11-30,
DeepSeek-V3 routed layer, each GEMM alone, its best config vs the one-tile-per-program kernel's): gate|up +
SwiGLU + requant 1.06x at 64 rows per expert (T2048: 2767 vs 2921 us), 1.09x at 128 (T4096: 4138 vs 4495) and
1.08x at 512 (T16384: 13420 vs 14466); down 1.10x / 1.10x / 1.08x (1.01x at 512 with the shipped config).
Below 64 rows per expert (decode's swapped small-M tiles) it is unmeasured, so the other kernel keeps those
sizes."""


def fp8_tma_rule(xq: Any, wq: Any) -> str | None:
    """Per call (static sizes): why not the FP8 TMA variant on these sizes (``None``: take it)."""
    per_expert = xq.shape[0] / max(wq.shape[0], 1)
    if per_expert < FP8_TMA_MIN_ROWS_PER_EXPERT:
        return f"{per_expert:.0f} rows per expert < {FP8_TMA_MIN_ROWS_PER_EXPERT}"
    return None


GATING_MIN_TOKENS = 2048
"""The fused gating kernel measured 4.2x (Mixtral softmax, T4096 E8 k2: 6.0 vs 25.2 us), 5.0x (Qwen3-MoE,
T4096 E128 k8: 9.8 vs 48.7 us) and 1.85x (DeepSeek-V3 grouped sigmoid, T4096 E256 k8: 84.8 vs 156.9 us)
Inductor's router code, but 0.75x at decode size (DeepSeek-V3, T128: 51.2 vs 38.4 us: too few tokens
to fill the GPU). Below 2048 tokens (unmeasured between 128 and 4096) the provider declines."""


def gating_prefers(args: tuple[Any, ...], executor: str) -> str | None:
    if executor != "inductor":  # the eager router ops measured slower at every size (64.3 vs 51.2 us at T128)
        return None
    rows = _static_rows(args[0])
    if rows is None:  # no run-time alternative is faster than the kernel (see the module docstring)
        return None
    if rows < GATING_MIN_TOKENS:
        return f"{rows} tokens: Inductor's router code measured faster at decode sizes (0.75x at 128)"
    return None


FP8_BLOCK_MAX_ROWS_PER_EXPERT = 128
"""``quant="fp8_block"`` on bf16 weights, measured on H200 (``bench/bench_fp8.py``, 2026-11-30, DeepSeek-V3
routed layer H7168 I2048 E256 k8, tile configs from its ``--sweep``): the Triton FP8 experts ran 1.92x the
bf16 ep_fuse experts at 4 rows per expert (T128), 2.17x at 16, 1.59x at 32, 1.30x at 64, 1.08x at 128
(T4096) and 0.90x at 512 (T16384). Above 128 (unmeasured up to 512) the block stays bf16."""


def fp8_block_quant_rule(x: Any, top_k: int, experts: int, deepgemm: bool = False) -> str | None:
    """Why ``quant="fp8_block"`` keeps a block (tokens ``x`` [T, H]) with bf16 weights in bf16 on CUDA (``None``:
    quantize it). Models whose experts already hold fp8 weights are not asked: they have no bf16 weights.
    ``deepgemm``: DeepGEMM takes the block's GEMMs (:func:`ep_fuse.providers.deepgemm.align_for`), measured
    faster than bf16 at every size it takes."""
    if deepgemm:
        return None
    t = _static_rows(x)
    if t is None:
        return ("symbolic token count: the FP8 experts measured faster only up to "
                f"{FP8_BLOCK_MAX_ROWS_PER_EXPERT} rows per expert, and bf16 and fp8 weights cannot both be kept")
    rows = t * top_k / max(experts, 1)
    if rows > FP8_BLOCK_MAX_ROWS_PER_EXPERT:
        return (f"{rows:.1f} rows per expert: the Triton FP8 experts measured faster than bf16 only up to "
                f"{FP8_BLOCK_MAX_ROWS_PER_EXPERT} (1.08x at 128; 0.90x at 512)")
    return None

"""The Triton provider of the routed-expert family: ``moe_permute``, ``moe_unpermute``, ``grouped_gemm`` and
``grouped_gemm_swiglu`` (the stages ``moe_experts`` expands into): perf rules, size branches, registration.

Host code and argument checks live in :mod:`~ep_fuse.providers.triton.moe_permute` and
:mod:`~ep_fuse.providers.triton.grouped_gemm`; the kernels in the ``*_kernel`` modules.

Perf rules of the grouped GEMMs (Inductor executor; eager ``torch._grouped_mm`` measured slower than the kernel at
every size): the kernel up to :data:`GROUPED_GEMM_MAX_ROWS_PER_EXPERT` rows per expert, or at any size where the
TMA kernel takes the call; ``torch._grouped_mm`` above. At a symbolic row count the rule answers
:class:`~ep_fuse.ops.registry.AtRunTime` and ``<op>_by_size`` applies :func:`grouped_gemm_at_run_time` per call
(bf16; where ``torch._grouped_mm`` does not run, fp16/fp32, the kernel at every size), traced as row-count branches
(:func:`grouped_branches`).
"""

from __future__ import annotations

from typing import Any

import torch

from ep_fuse.ops import moe as ops
from ep_fuse.ops.moe import full_act, grouped_gemm_ref, grouped_gemm_swiglu_ref, grouped_mm_supported
from ep_fuse.ops.registry import AtRunTime
from ep_fuse.providers.measured import Threshold
from ep_fuse.providers.triton.grouped_gemm import (
    GROUPED_GEMM_TMA_MIN_ROWS_PER_EXPERT,
    TMA_VARIANT,
    act_variant,
    check_grouped_gemm_call,
    check_grouped_gemm_swiglu_call,
    grouped_gemm_kernel,
    grouped_gemm_swiglu_kernel,
    grouped_gemm_tma_columns_rule,
    run_grouped,
    tma_declined,
)
from ep_fuse.providers.triton.moe_permute import (
    check_moe_permute_call,
    check_moe_unpermute_call,
    moe_permute_kernel,
    moe_unpermute_kernel,
)
from ep_fuse.providers.triton.provider import register
from ep_fuse.providers.triton.size_branches import ROWS_LIMIT, Branch, Run
from ep_fuse.providers.triton.unverified import gpu_unverified
from ep_fuse.symbolic import concrete_int

# --------------------------------------------------------------------------- perf rules
GROUPED_GEMM_MAX_ROWS_PER_EXPERT = Threshold(
    128, command="python bench/bench_moe_experts.py",
    evidence="the one-tile-per-program grouped GEMMs vs torch._grouped_mm (eager or under Inductor): 1.40x at 4 rows per "
             "expert (DeepSeek-V3 decode, T128 k8 E256), 1.04-1.52x at 6 to 102 (E60 H2880 I1408), 1.09x at 128 "
             "(DeepSeek-V3 prefill T4096); 0.82x at 205 (E60 at T2048, best swept config), 0.90x at 1536 "
             "(T16384 k6 E64); eager torch._grouped_mm slower than the kernel at every size")
"""Above this many rows per expert the provider declines under Inductor, unless the Hopper TMA kernel takes the call
(:data:`~ep_fuse.providers.triton.grouped_gemm.GROUPED_GEMM_TMA_MIN_ROWS_PER_EXPERT`)."""


def _tma_takes(x: Any, w: Any, swiglu: bool = False, act: tuple = ()) -> bool:
    """Whether a CUDA call on these (fake or real, static-size) tensors runs the TMA grouped GEMM."""
    from torch._subclasses.fake_tensor import is_fake  # private torch module: asked at use

    if not isinstance(x, torch.Tensor) or x.device.type != "cuda":
        return False
    return tma_declined(x, w, traced=is_fake(x), swiglu=swiglu, act=act) is None


def _grouped_prefers(args: tuple[Any, ...], executor: str, swiglu: bool) -> str | AtRunTime | None:
    if executor != "inductor":  # eager torch._grouped_mm measured slower than the kernel at every size
        return None
    x, w = args[0], args[1]
    rows, experts = concrete_int(x.shape[0]), concrete_int(w.shape[0])
    if rows is None or experts is None:  # int() would specialize the graph on this row count
        return AtRunTime(f"the kernel up to {GROUPED_GEMM_MAX_ROWS_PER_EXPERT} rows per expert (any size on the "
                         "TMA kernel), torch._grouped_mm above (bf16)")
    per_expert = rows / max(experts, 1)
    if per_expert > GROUPED_GEMM_MAX_ROWS_PER_EXPERT and not _tma_takes(x, w, swiglu, tuple(args[3:])):
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
            or _tma_takes(x, w, swiglu, tuple(args[3:]))):
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


# --------------------------------------------------------------------------- size branches
def _grouped(swiglu: bool, variant: str, config: Any) -> Run:
    """The provider's launch with its kernel ``variant`` and tile ``config`` fixed (static sizes picked them)."""
    return lambda args, wrap: run_grouped(swiglu, *args, wrap=wrap, variant=variant, config=config)


def _grouped_reference(swiglu: bool) -> Run:
    ref = grouped_gemm_swiglu_ref if swiglu else grouped_gemm_ref
    return lambda args, wrap: ref(*args)


def _grouped_tma_static(x: torch.Tensor, w: torch.Tensor, swiglu: bool, act: tuple = ()) -> bool:
    """Whether the TMA kernel takes this call at every row count from its threshold on (static facts only:
    dtype, GPU, strides, the column rule, a plain SwiGLU epilogue)."""
    from ep_fuse.providers.triton.grouped_gemm_tma_kernel import tma_unsupported  # imports triton

    return (act_variant(act) is None and grouped_gemm_tma_columns_rule(x, w, swiglu) is None
            and gpu_unverified(TMA_VARIANT, x) is None
            and tma_unsupported(x, w, traced=True, rows_bounded=True) is None)


def grouped_branches(x: torch.Tensor, w: torch.Tensor, swiglu: bool, act: tuple = ()) -> list[Branch]:
    """The branches of ``grouped_gemm[_swiglu]_by_size`` on ``x`` [M, K] (symbolic M), ``w`` [E, N, K]
    (``act``: the gated activation of a ``grouped_gemm_swiglu`` call): the decisions of
    :func:`grouped_gemm_at_run_time` and of the kernel's
    ``config_for`` / :func:`~ep_fuse.providers.triton.grouped_gemm.kernel_variant`, as row bounds."""
    # kernel modules import triton: asked when a compile traces the branches
    from ep_fuse.providers.triton.grouped_gemm_kernel import (
        DECODE_ROWS_PER_EXPERT,
        MID_ROWS_PER_EXPERT,
        WIDE_DECODE_ROWS_PER_EXPERT,
    )
    from ep_fuse.providers.triton.grouped_gemm_kernel import config_for as default  # imports triton
    from ep_fuse.providers.triton.grouped_gemm_tma_kernel import FEW_EXPERT_TILES_MIN_ROWS_PER_EXPERT
    from ep_fuse.providers.triton.grouped_gemm_tma_kernel import config_for as tma  # imports triton

    e, k = max(int(w.shape[0]), 1), int(w.shape[2])
    n = ops.act_width(int(w.shape[1]), full_act(act)[0]) if swiglu else int(w.shape[1])
    mid = MID_ROWS_PER_EXPERT * e  # config_for's regimes change only at these bounds

    def kernel(rows: int) -> Run:
        return _grouped(swiglu, "default", default(rows, n, k, e, swiglu=swiglu))

    if act_variant(act) is not None:  # one launch: cond's operands are tensors, the activation's are not
        return [Branch("kernel (64-row tiles, gated activation)", None, kernel(mid))]
    decode = DECODE_ROWS_PER_EXPERT * e
    branches = [Branch("kernel (decode tiles)", WIDE_DECODE_ROWS_PER_EXPERT * e + 1, kernel(1)),
                Branch("kernel (32-row decode tiles)", decode + 1, kernel(decode))]
    large = kernel(mid + 1)
    reference = Branch("torch._grouped_mm", None, _grouped_reference(swiglu))
    if _grouped_tma_static(x, w, swiglu, act):
        tma_from = int(GROUPED_GEMM_TMA_MIN_ROWS_PER_EXPERT * e)
        branches.append(Branch("kernel (64-row tiles)", min(mid + 1, tma_from), kernel(mid)))
        if tma_from > mid + 1:
            branches.append(Branch("kernel (128-row tiles)", tma_from, large))
        few_from = FEW_EXPERT_TILES_MIN_ROWS_PER_EXPERT * e  # config_for's regimes change only at this bound
        below, above = tma(tma_from, n, k, e, swiglu=swiglu), tma(few_from, n, k, e, swiglu=swiglu)
        if below != above:
            branches.append(Branch("tma", few_from, _grouped(swiglu, "tma", below)))
            branches.append(Branch("tma (few-expert tiles)", ROWS_LIMIT, _grouped(swiglu, "tma", above)))
        else:
            branches.append(Branch("tma", ROWS_LIMIT, _grouped(swiglu, "tma", below)))
        branches.append(reference if grouped_mm_supported(x, w) else Branch("kernel (128-row tiles)", None, large))
        return branches
    branches.append(Branch("kernel (64-row tiles)", mid + 1, kernel(mid)))
    if grouped_mm_supported(x, w):
        branches += [Branch("kernel (128-row tiles)", GROUPED_GEMM_MAX_ROWS_PER_EXPERT * e + 1, large), reference]
    else:  # the reference would loop over the experts on the host: the kernel at every size
        branches.append(Branch("kernel (128-row tiles)", None, large))
    return branches


register(ops.moe_permute, moe_permute_kernel, supports=check_moe_permute_call, symbolic=True)
register(ops.moe_unpermute, moe_unpermute_kernel, supports=check_moe_unpermute_call, symbolic=True)
register(ops.grouped_gemm, grouped_gemm_kernel, supports=check_grouped_gemm_call, prefers=grouped_gemm_prefers,
         run_time=grouped_gemm_at_run_time,
         branches=(lambda x, w, seg: grouped_branches(x, w, False), lambda x: x.shape[0]))
register(ops.grouped_gemm_swiglu, grouped_gemm_swiglu_kernel, supports=check_grouped_gemm_swiglu_call,
         prefers=grouped_gemm_swiglu_prefers, run_time=grouped_gemm_swiglu_at_run_time,
         branches=(lambda x, w, seg, *act: grouped_branches(x, w, True, tuple(act)), lambda x, *rest: x.shape[0]))

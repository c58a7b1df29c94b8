"""The per-call choice of the ``<op>_by_size`` ops traced as host-side branches on the row count.

At a symbolic row count (``dynamic=True``) the fastest code for a grouped GEMM or a dense GEMM + SwiGLU
depends on the real rows: the kernel's decode or prefill tiles, the Hopper TMA kernel, or the reference
(``torch._grouped_mm`` / cuBLAS) where the kernels measured slower (:mod:`~ep_fuse.providers.triton.perf`).
The opaque ``<op>_by_size`` op makes that choice in Python on every call, and pays for it in host time: the
dispatcher, the provider's checks and Triton's JIT launcher (about 65 µs per call more than Inductor's extern
``_grouped_mm``, measured on H200, ``docs/benchmarks.md``), which left dynamic graphs host-bound.

Here the same choice is traced once: :func:`select` nests ``torch.cond`` on ``rows < bound`` predicates whose
bounds are the perf rules' thresholds (static: the experts and widths are parameters), and each branch is one
launch with a fixed tile config, inlined through ``wrap_triton``, or the reference's ATen ops. Inductor
compiles every branch and its generated code picks one with an ``if`` on the size: the same kernels and
configs the static path picks, without the dispatcher or the JIT launcher per call, and without a guard on
the row count (``tests/test_symbolic_launch.py``).

Inductor runs graphs holding ``torch.cond`` without CUDA graphs, so the inline rule keeps the opaque op where
the compile asks for them (``mode="reduce-overhead"``: a graph replay hides the host cost anyway).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ep_fuse.providers.common import row_stride

Wrap = Callable[[Any], Any]
Cond = Callable[[Any, Callable[..., Any], Callable[..., Any], tuple[torch.Tensor, ...]], Any]
ROWS_LIMIT = 2**31
"""Rows the TMA kernels address with int32 coordinates; larger calls take the branch after them."""


@dataclasses.dataclass(frozen=True)
class Branch:
    """One way to run the call: taken for ``rows < below`` when no branch before it took the call (``below``
    ``None``: every remaining call)."""

    name: str
    below: int | None
    run: Callable[[Sequence[torch.Tensor], Wrap | None], torch.Tensor]


# --------------------------------------------------------------------------- grouped GEMMs
def _grouped(swiglu: bool, variant: str, config: Any) -> Callable[[Sequence[torch.Tensor], Wrap | None],
                                                                  torch.Tensor]:
    """The provider's launch with its kernel ``variant`` and tile ``config`` fixed (static sizes picked them)."""
    from ep_fuse.providers.triton.grouped_gemm import run_grouped

    return lambda args, wrap: run_grouped(swiglu, *args, wrap=wrap, variant=variant, config=config)


def _grouped_reference(swiglu: bool) -> Callable[[Sequence[torch.Tensor], Wrap | None], torch.Tensor]:
    from ep_fuse.ops.moe_reference import grouped_gemm_ref, grouped_gemm_swiglu_ref

    ref = grouped_gemm_swiglu_ref if swiglu else grouped_gemm_ref
    return lambda args, wrap: ref(*args)


def _grouped_tma_static(x: torch.Tensor, w: torch.Tensor, swiglu: bool) -> bool:
    """Whether the TMA kernel takes this call at every row count from its threshold on (static facts only:
    dtype, GPU, strides, the column rule)."""
    from ep_fuse.providers.triton.grouped_gemm import TMA_VARIANT
    from ep_fuse.providers.triton.perf import grouped_gemm_tma_columns_rule
    from ep_fuse.providers.triton.unverified import gpu_unverified

    return (grouped_gemm_tma_columns_rule(x, w, swiglu) is None and gpu_unverified(TMA_VARIANT, x) is None
            and importlib.import_module("ep_fuse.providers.triton.grouped_gemm_tma_kernel").tma_unsupported(
                x, w, traced=True, rows_bounded=True) is None)


def grouped_branches(x: torch.Tensor, w: torch.Tensor, swiglu: bool) -> list[Branch]:
    """The branches of ``grouped_gemm[_swiglu]_by_size`` on ``x`` [M, K] (symbolic M), ``w`` [E, N, K]: the
    decisions of :func:`~ep_fuse.providers.triton.perf.grouped_gemm_at_run_time` and of the kernel's
    ``config_for`` / :func:`~ep_fuse.providers.triton.grouped_gemm.kernel_variant`, as row bounds."""
    from ep_fuse.ops.moe_reference import grouped_mm_supported
    from ep_fuse.providers.triton.grouped_gemm_kernel import DECODE_ROWS_PER_EXPERT, MID_ROWS_PER_EXPERT
    from ep_fuse.providers.triton.perf import (
        GROUPED_GEMM_MAX_ROWS_PER_EXPERT,
        GROUPED_GEMM_TMA_MIN_ROWS_PER_EXPERT,
    )

    e, k = max(int(w.shape[0]), 1), int(w.shape[2])
    n = int(w.shape[1]) // 2 if swiglu else int(w.shape[1])
    # by module path: the package attributes ``grouped_gemm_kernel`` etc. are the provider's functions
    default = importlib.import_module("ep_fuse.providers.triton.grouped_gemm_kernel").config_for
    tma = importlib.import_module("ep_fuse.providers.triton.grouped_gemm_tma_kernel").config_for
    mid = MID_ROWS_PER_EXPERT * e  # config_for's regimes change only at these bounds

    def kernel(rows: int) -> Callable[[Sequence[torch.Tensor], Wrap | None], torch.Tensor]:
        return _grouped(swiglu, "default", default(rows, n, k, e, swiglu=swiglu))

    branches = [Branch("kernel (decode tiles)", DECODE_ROWS_PER_EXPERT * e + 1, kernel(1)),
                Branch("kernel (64-row tiles)", mid + 1, kernel(mid))]
    large = kernel(mid + 1)
    reference = Branch("torch._grouped_mm", None, _grouped_reference(swiglu))
    if _grouped_tma_static(x, w, swiglu):
        branches += [Branch("kernel (128-row tiles)", GROUPED_GEMM_TMA_MIN_ROWS_PER_EXPERT * e, large),
                     Branch("tma", ROWS_LIMIT, _grouped(swiglu, "tma", tma(0, n, k, e, swiglu=swiglu)))]
        branches.append(reference if grouped_mm_supported(x, w) else Branch("kernel (128-row tiles)", None, large))
    elif grouped_mm_supported(x, w):
        branches += [Branch("kernel (128-row tiles)", GROUPED_GEMM_MAX_ROWS_PER_EXPERT * e + 1, large), reference]
    else:  # the reference would loop over the experts on the host: the kernel at every size
        branches.append(Branch("kernel (128-row tiles)", None, large))
    return branches


# --------------------------------------------------------------------------- dense GEMM + SwiGLU
def _dense_rows(x: torch.Tensor) -> Any:
    return x.numel() // max(int(x.shape[-1]), 1)


def _dense(variant: str, config: Any) -> Callable[[Sequence[torch.Tensor], Wrap | None], torch.Tensor]:
    from ep_fuse.providers.triton.gemm_swiglu import run_dense

    return lambda args, wrap: run_dense(*args, wrap=wrap, variant=variant, config=config)


def gemm_swiglu_branches(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> list[Branch]:
    """The branches of ``gemm_swiglu_by_size``: the kernel's decode tiles up to
    :data:`~ep_fuse.providers.triton.perf.GEMM_SWIGLU_MAX_ROWS` rows, the TMA kernel on its measured wins,
    the reference (two cuBLAS GEMMs and the SwiGLU) elsewhere."""
    from ep_fuse.ops.reference import gemm_swiglu_ref
    from ep_fuse.providers.triton.gemm_swiglu_kernel import gemm_config
    from ep_fuse.providers.triton.perf import GEMM_SWIGLU_MAX_ROWS, GEMM_SWIGLU_TMA_MIN_ROWS, dense_tma_size_wins

    tma = importlib.import_module("ep_fuse.providers.triton.grouped_gemm_tma_kernel")
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


# --------------------------------------------------------------------------- the traced choice
BRANCHES: dict[str, tuple[Callable[..., list[Branch]], Callable[[torch.Tensor], Any]]] = {
    "grouped_gemm": (lambda x, w, seg: grouped_branches(x, w, False), lambda x: x.shape[0]),
    "grouped_gemm_swiglu": (lambda x, w, seg: grouped_branches(x, w, True), lambda x: x.shape[0]),
    "gemm_swiglu": (gemm_swiglu_branches, _dense_rows),
}
"""Canonical op name -> (its branches from the call's arguments, its row count from the first argument)."""


def _cond(pred: Any, true_fn: Callable[..., Any], false_fn: Callable[..., Any],
          operands: tuple[torch.Tensor, ...]) -> Any:
    from torch._higher_order_ops.cond import cond_op

    return cond_op(pred, true_fn, false_fn, operands)


def branch_for(branches: Sequence[Branch], rows: int) -> Branch:
    """The branch that takes a call of ``rows`` rows (concrete sizes)."""
    return next(b for b in branches if b.below is None or rows < b.below)


def _size_carrier(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """One empty tensor whose sizes are the symbols in the operands' sizes, strides and offsets (sorted by name,
    then a 0), or ``()`` at static sizes. It goes to ``cond`` as an operand so that each branch's subgraph binds
    every symbol from its sizes: a branch input of size ``s27*s52`` (batch times length) does not tell
    Inductor's subgraph what ``s27`` and ``s52`` are. A tensor, not the symbols as ``SymInt`` operands: a
    ``SymInt`` operand is traced as whichever graph input carries that symbol, and when two inputs share it
    (``input_ids`` and ``position_ids`` share the length, one of them Dynamo's replaced alias ``s62 -> s27``)
    Inductor's subgraph bound the alias and failed ("For s27*u0, expected [s27] to have been codegen-ed",
    H200 and CPU)."""
    symbols: dict[str, Any] = {}
    env = None
    for t in tensors:
        for v in (*t.shape, *t.stride(), t.storage_offset()):
            if isinstance(v, torch.SymInt):
                env = v.node.shape_env
                symbols.update((str(s), s) for s in v.node.expr.free_symbols)
    if env is None:
        return ()
    hints = getattr(env, "backed_var_to_val", None) or getattr(env, "var_to_val", {})
    sizes = [env.create_symintnode(s, hint=int(hints[s]) if s in hints else None) for _, s in sorted(symbols.items())]
    return (torch.empty((*sizes, 0), dtype=torch.int8, device=tensors[0].device),)


def select(branches: Sequence[Branch], rows_of: Callable[[torch.Tensor], Any], args: Sequence[torch.Tensor],
           wrap: Wrap | None, cond: Cond = _cond, carrier: tuple[Any, ...] | None = None) -> torch.Tensor:
    """Run ``args`` on the first branch whose bound the row count is below: a nest of ``cond`` on symbolic
    sizes (each branch traced into its own subgraph), the branch itself on concrete sizes."""
    head, rest = branches[0], branches[1:]
    if head.below is None or not rest:
        return head.run(args, wrap)
    rows = rows_of(args[0])
    if isinstance(rows, int):
        return branch_for(branches, rows).run(args, wrap)
    tensors = tuple(args)
    carrier = _size_carrier(tensors) if carrier is None else carrier
    n = len(tensors)

    def take(*a: Any) -> tuple[torch.Tensor]:  # cond's branches return tuples
        return (head.run(a[:n], wrap),)

    def other(*a: Any) -> tuple[torch.Tensor]:
        return (select(rest, rows_of, a[:n], wrap, cond, a[n:]),)

    return cond(rows < head.below, take, other, tensors + tuple(carrier))[0]


def run_by_size(op: str, args: Sequence[Any], wrap: Wrap | None, cond: Cond = _cond) -> torch.Tensor:
    """``<op>_by_size`` on ``args`` through :func:`select` (``op``: a key of :data:`BRANCHES`)."""
    make, rows_of = BRANCHES[op]
    return select(make(*args), rows_of, args, wrap, cond)

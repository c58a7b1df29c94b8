"""The per-call choice of the ``<op>_by_size`` ops traced as host-side branches on the row count.

At a symbolic row count (``dynamic=True``) the fastest code for a grouped GEMM or a dense GEMM + SwiGLU
depends on the real rows: the kernel's decode or prefill tiles, the Hopper TMA kernel, or the reference
(``torch._grouped_mm`` / cuBLAS) where the kernels measured slower (each family's perf rules).
The opaque ``<op>_by_size`` op makes that choice in Python on every call, and pays for it in host time: the
dispatcher, the provider's checks and Triton's JIT launcher (about 65 µs per call more than Inductor's extern
``_grouped_mm``, ``docs/benchmarks.md``), which left dynamic graphs host-bound.

Here the same choice is traced once (the families register their branch builders through
:func:`ep_fuse.providers.triton.provider.register`; this module is the machinery): :func:`select` nests ``torch.cond`` on ``rows < bound`` predicates whose
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
from collections.abc import Callable, Sequence
from typing import Any

import torch

Wrap = Callable[[Any], Any]
Run = Callable[[Sequence[torch.Tensor], "Wrap | None"], torch.Tensor]
"""One way to run a call: ``(args, wrap) -> output``."""
Cond = Callable[[Any, Callable[..., Any], Callable[..., Any], tuple[torch.Tensor, ...]], Any]
ROWS_LIMIT = 2**31
"""Rows the TMA kernels address with int32 coordinates; larger calls take the branch after them."""


@dataclasses.dataclass(frozen=True)
class Branch:
    """One way to run the call: taken for ``rows < below`` when no branch before it took the call (``below``
    ``None``: every remaining call)."""

    name: str
    below: int | None
    run: Run


# --------------------------------------------------------------------------- the traced choice
Branches = tuple[Callable[..., list[Branch]], Callable[[torch.Tensor], Any]]
"""(the branches from a call's arguments, its row count from the first argument)."""

BRANCHES: dict[str, Branches] = {}
"""Canonical op name -> its :data:`Branches` (filled by :func:`ep_fuse.providers.triton.provider.register`)."""


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
    GPU and CPU)."""
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

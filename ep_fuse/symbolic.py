"""Decisions on sizes that may be symbolic (``SymInt``s of a ``dynamic=True`` graph), without guards.

A Python ``==``/``<``/``int()`` on a ``SymInt`` is evaluated on the example sizes and recorded as a
guard: the compiled graph is then only reused for sizes that satisfy it (``int(rows)`` specialises it
to one row count). Compile-time code in ep_fuse -- pattern guards, provider checks, perf rules --
decides with these helpers instead: a comparison is ``True`` only when it holds for *every* value of
the symbols (:func:`~torch.fx.experimental.symbolic_shapes.statically_known_true`); anything that cannot
be decided is treated as "not known", which refuses a match or declines a provider (never a guard).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import is_concrete_int, statically_known_true

SYM_NUMBERS = (torch.SymInt, torch.SymFloat)


def sym_eq(a: Any, b: Any) -> bool:
    """``a == b`` for numbers that may be symbolic: ``True`` only when it holds for all values."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if not isinstance(a, (int, float, *SYM_NUMBERS)) or not isinstance(b, (int, float, *SYM_NUMBERS)):
        return False
    return bool(statically_known_true(a == b))


def known(cond: Any) -> bool:
    """``cond`` (a bool or a ``SymBool`` such as ``rows <= 64``) holds for every value of the symbols."""
    return bool(statically_known_true(cond))


def same_shape(given: Any, *expected: Any) -> bool:
    """``given`` equals one of ``expected`` element-wise (``-1`` only where an expected shape says ``-1``)."""
    if not isinstance(given, (list, tuple)):
        return False
    return any(len(given) == len(e) and all(sym_eq(a, b) for a, b in zip(given, e)) for e in expected)


def concrete_int(v: Any) -> int | None:
    """``v`` as an int when it is one (or a ``SymInt`` with a constant value), else ``None``."""
    if isinstance(v, bool) or not isinstance(v, (int, torch.SymInt)) or not is_concrete_int(v):
        return None
    return int(v)

"""A small declarative language for ATen subgraph patterns.

A pattern is a tree rooted at the output node, written with:

* :class:`Op` -- a call of one of ``targets``; arguments are constrained by schema name, every
  unconstrained argument must keep its default (so ``add(a, b, alpha=2)`` never matches ``add(a, b)``);
* :class:`Cast` -- a pure dtype conversion (``_to_copy`` with at most no-op layout/device kwargs, or
  ``prims.convert_element_type``), binding the target dtype;
* :class:`Var` -- anything (a node or a literal), optionally checked by a predicate;
* :class:`Lit` -- a literal argument value, checked by a predicate;
* :class:`Alt` -- the first alternative that matches;
* :class:`Opt` -- ``Opt(Cast(x))`` matches the cast or ``x`` itself;
* :class:`Item` -- output ``index`` of a multi-output op.

Every pattern may carry ``bind=``: the first match binds the name, later occurrences must be the
same node (this is how "x feeds both pow and mul" is written).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ep_fuse.symbolic import SYM_NUMBERS, sym_eq

Check = Callable[[Any], "str | None"]
"""A predicate returning ``None`` when the value is acceptable, else the reason it is not."""


class Pat:
    bind: str | None = None


@dataclasses.dataclass(eq=False)
class Op(Pat):
    targets: tuple[torch._ops.OpOverload, ...]
    args: dict[str, Any]
    commutative: tuple[str, str] | None = None
    bind: str | None = None
    shared: bool = False
    """Users outside the match are allowed (the node becomes an extra output of the fused op)."""
    ignore: tuple[str, ...] = ()
    """Schema arguments that are not checked against their defaults."""

    def __repr__(self) -> str:
        names = "|".join(str(t) for t in self.targets)
        return f"Op({names})"


def op(
    targets: torch._ops.OpOverload | tuple[torch._ops.OpOverload, ...],
    *,
    commutative: tuple[str, str] | None = None,
    bind: str | None = None,
    shared: bool = False,
    ignore: tuple[str, ...] = (),
    **args: Any,
) -> Op:
    if not isinstance(targets, tuple):
        targets = (targets,)
    return Op(targets, args, commutative, bind, shared, ignore)


@dataclasses.dataclass(eq=False)
class Cast(Pat):
    inner: Any
    dtype: str | torch.dtype | None = None
    """A binding name for the target dtype, or a required dtype."""
    bind: str | None = None


@dataclasses.dataclass(eq=False)
class Var(Pat):
    bind: str | None = None
    check: Check | None = None


@dataclasses.dataclass(eq=False)
class Lit(Pat):
    check: Check
    bind: str | None = None


@dataclasses.dataclass(eq=False)
class Alt(Pat):
    options: tuple[Any, ...]
    bind: str | None = None


def alt(*options: Any, bind: str | None = None) -> Alt:
    return Alt(tuple(options), bind)


@dataclasses.dataclass(eq=False)
class Opt(Pat):
    inner: Any
    bind: str | None = None


@dataclasses.dataclass(eq=False)
class Item(Pat):
    """``operator.getitem(inner, index)``: one output of a multi-output op (``split``, ``topk``...)."""

    inner: Any
    index: int
    bind: str | None = None


# --------------------------------------------------------------------------- literal checks
def check_item(v: Any, expected: Any) -> bool:
    return equals(expected)(v) is None


def equals(expected: Any) -> Check:
    def check(v: Any) -> str | None:
        if isinstance(v, SYM_NUMBERS) or isinstance(expected, SYM_NUMBERS):
            return None if sym_eq(v, expected) else f"expected {expected!r}, got {v!r}"
        if isinstance(expected, (list, tuple)):
            same = isinstance(v, (list, tuple)) and len(v) == len(expected) and all(
                check_item(a, b) for a, b in zip(v, expected))
            return None if same else f"expected {expected!r}, got {v!r}"
        if isinstance(v, bool) or isinstance(expected, bool):
            return None if v is expected else f"expected {expected!r}, got {v!r}"
        if isinstance(v, (int, float)) and isinstance(expected, (int, float)) and v == expected:
            return None
        return f"expected {expected!r}, got {v!r}"

    check.__name__ = f"== {expected!r}"
    return check


def is_number(v: Any) -> str | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return f"expected a number literal, got {type(v).__name__} {v!r}"
    return None

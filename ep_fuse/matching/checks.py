"""Value checks shared by pattern files (each returns ``None`` when the value is acceptable, else why not)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ep_fuse.fx_utils import tensor_val
from ep_fuse.matching.pattern import equals
from ep_fuse.symbolic import concrete_int, same_shape, sym_eq  # noqa: F401  (re-exported for pattern files)

MODEL_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
INT64_MAX = 2**63 - 1


def tensor_of(dtypes: tuple[torch.dtype, ...], what: str = "floating") -> Callable[[Any], str | None]:
    """A check that the value is a graph tensor of one of ``dtypes``."""

    def check(v: Any) -> str | None:
        t = tensor_val(v)
        if t is None:
            return f"expected a tensor, got {v!r}"
        if t.dtype not in dtypes:
            return f"expected a {what} tensor, got {t.dtype}"
        return None

    check.__name__ = f"{what}_tensor"
    return check


def is_int(v: Any) -> str | None:
    """A concrete int (a structural constant: K, E, a split size, a dim). A symbolic size is refused:
    reading it as an int would specialise the graph (see :func:`is_size`)."""
    return None if isinstance(v, int) and not isinstance(v, bool) else f"expected an int, got {v!r}"


def is_size(v: Any) -> str | None:
    """An int or a ``SymInt``: a size that may follow the token count of a dynamic-shape graph."""
    if isinstance(v, torch.SymInt) or (isinstance(v, int) and not isinstance(v, bool)):
        return None
    return f"expected a size, got {v!r}"


def is_end(v: Any) -> str | None:
    """A slice end meaning "to the end of the dim"."""
    return None if v is None or (isinstance(v, int) and v >= INT64_MAX) else f"expected the end of the dim, got {v!r}"


def is_shape(v: Any) -> str | None:
    """A list of sizes (ints or ``SymInt``s)."""
    if isinstance(v, (list, tuple)) and all(is_size(d) is None for d in v):
        return None
    return f"expected a shape, got {v!r}"


def is_bool(v: Any) -> str | None:
    return None if isinstance(v, bool) else f"expected a bool, got {v!r}"


def is_dtype(v: Any) -> str | None:
    return None if isinstance(v, torch.dtype) else f"expected a dtype, got {v!r}"


def one_of(*values: Any) -> Callable[[Any], str | None]:
    """A literal equal to one of ``values`` (numbers, or lists compared element-wise)."""

    def check(v: Any) -> str | None:
        return None if any(equals(x)(v) is None for x in values) else f"expected one of {values}, got {v!r}"

    check.__name__ = f"one of {values}"
    return check


def is_value(expected: Any) -> Callable[[Any], str | None]:
    """A literal ``== expected`` (dtypes, memory formats: constants :func:`equals` does not compare)."""

    def check(v: Any) -> str | None:
        return None if v == expected else f"expected {expected}, got {v!r}"

    check.__name__ = f"is {expected}"
    return check


VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default)
"""The ops a ``reshape`` traces to."""

READ_THROUGH = (*VIEWS, torch.ops.aten.unsqueeze.default, torch.ops.aten.squeeze.dim, torch.ops.aten.squeeze.default,
                torch.ops.aten.squeeze.dims)
"""Shape-only ops an anchor predicate looks through to find who reads a value."""


def readers(node: Any, depth: int = 3) -> list[Any]:
    """The users of ``node`` and, through up to ``depth`` views (:data:`READ_THROUGH`), the users of those views.

    For anchor predicates: an anchor decides where a failed match becomes a near miss, so a predicate that
    only looks at direct users misses the look-alike that reads the value through ``view(T, -1)``."""
    out: list[Any] = []
    frontier = list(getattr(node, "users", ()))
    for _ in range(depth + 1):
        nxt = []
        for user in frontier:
            out.append(user)
            if getattr(user, "target", None) in READ_THROUGH:
                nxt.extend(user.users)
        frontier = nxt
    return out

"""Low-overhead ``torch.library`` registration (schema + one Python kernel + fake), used by every ep_fuse op.

``torch.library.custom_op`` adds a Python dispatch layer per call; defining the schema on a
``Library`` fragment and registering the kernel directly keeps a launch at C++-dispatcher cost.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_LIBS: dict[str, torch.library.Library] = {}


def library(namespace: str) -> torch.library.Library:
    if namespace not in _LIBS:
        _LIBS[namespace] = torch.library.Library(namespace, "FRAGMENT")
    return _LIBS[namespace]


def define_op(
    namespace: str,
    name: str,
    schema: str,
    impl: Callable[..., Any],
    fake: Callable[..., Any],
) -> torch._ops.OpOverload:
    """Define ``namespace::name`` with ``schema`` (the part after the name), one kernel for all devices, and a fake."""
    lib = library(namespace)
    lib.define(f"{name}{schema}")
    lib.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{namespace}::{name}", fake, lib=lib)
    return getattr(getattr(torch.ops, namespace), name).default

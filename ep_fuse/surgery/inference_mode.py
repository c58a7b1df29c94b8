"""Forwards decorated with ``@torch.inference_mode()`` made compilable (used by :func:`ep_fuse.prepare`).

With torch 2.13 a module whose ``forward`` is decorated with ``@torch.inference_mode()`` fails to compile for
every backend (``aot_eager`` and Inductor included) as soon as an output is a view of an input: AOT's trace raises
"Cannot set version_counter for inference tensor". ``torch.no_grad()`` compiles. Inside one forward the two modes
compute the same values with the same kernels; they differ in the autograd bookkeeping of the tensors made
(inference tensors have no version counter and cannot enter autograd later) and in what
``torch.is_inference_mode_enabled()`` / ``Tensor.is_inference()`` answer.

:func:`unwrap_inference_mode` therefore rebinds, per module, a forward whose class (or instance) wraps it with
``torch.inference_mode()`` (mode on; ``functools.wraps`` leaves the undecorated function in ``__wrapped__``) to the
undecorated function under ``torch.no_grad()``, as an instance attribute. It refuses, with a WARNING, a forward
whose own code asks about inference mode (its answer would change). Outputs are then ordinary tensors that do
not require grad, instead of inference tensors. The backend sees a graph whose whole body runs with grad off and
fuses it like one called under ``torch.no_grad()``.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

log = logging.getLogger("ep_fuse")

_DECORATOR_CODE = torch.inference_mode()(lambda: None).__code__
"""The code of torch's context-manager decorator wrapper (shared by ``inference_mode``, ``no_grad``, ...)."""

ASKS_INFERENCE_MODE = frozenset({"is_inference_mode_enabled", "is_inference", "inference_mode", "InferenceMode"})
"""Names whose use in a forward's own code makes the rebinding refuse it (their answer would change)."""


def inference_mode_inner(fn: Any) -> Callable[..., Any] | None:
    """The undecorated function if ``fn`` is a function wrapped by ``torch.inference_mode()`` with the mode on,
    else ``None`` (other decorators, ``inference_mode(False)``, generators)."""
    if not isinstance(fn, types.FunctionType) or fn.__code__ is not _DECORATOR_CODE or fn.__closure__ is None:
        return None
    cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__)))
    factory, inner = cells.get("ctx_factory"), cells.get("func")
    owner = getattr(factory, "__self__", None)
    if not isinstance(owner, torch.inference_mode) or not getattr(owner, "mode", False):
        return None
    return inner if isinstance(inner, types.FunctionType) and getattr(fn, "__wrapped__", None) is inner else None


def _names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _forward_function(module: nn.Module) -> Any:
    own = module.__dict__.get("forward")
    if own is None:
        return type(module).forward
    return own.__func__ if isinstance(own, types.MethodType) and own.__self__ is module else None


def unwrap_inference_mode(model: nn.Module, strict: bool = False) -> list[str]:
    """Rebind every ``@torch.inference_mode()`` forward of ``model`` (and of its submodules) to the undecorated
    forward under ``torch.no_grad()`` (see the module docstring); returns the paths of the rebound modules.

    A forward whose own code asks about inference mode is left as it is with a WARNING (``strict=True``: raises
    ``ValueError``)."""
    done = []
    for path, module in model.named_modules():
        inner = inference_mode_inner(_forward_function(module))
        if inner is None:
            continue
        label = path or type(module).__name__
        asked = sorted(_names(inner.__code__) & ASKS_INFERENCE_MODE)
        if asked:
            msg = (f"ep_fuse.prepare: {label} ({type(module).__name__}) keeps its @torch.inference_mode() forward, "
                   f"which torch 2.13 cannot compile when an output views an input: its code asks "
                   f"{', '.join(asked)}, whose answer would change under torch.no_grad(); decorate it with "
                   f"@torch.no_grad() instead, or drop the decorator and call the compiled model inside "
                   f"`with torch.inference_mode():`")
            if strict:
                raise ValueError(msg + " (strict=True)")
            log.warning(msg)
            continue
        module.forward = types.MethodType(torch.no_grad()(inner), module)
        done.append(label)
        log.info("ep_fuse.prepare: %s (%s): its @torch.inference_mode() forward runs under torch.no_grad() "
                 "(compilable; outputs are ordinary tensors that do not require grad)", label, type(module).__name__)
    return done

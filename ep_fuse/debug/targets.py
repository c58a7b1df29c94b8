"""What the CLI compiles: ``file.py:factory``, ``package.module:factory`` or a built-in ``hf:<model>``.

A factory is a callable taking no arguments (or ``device=``) and returning ``(model, inputs)``;
``inputs`` is a tuple/list of positional arguments, a dict of keyword arguments, or ``(args, kwargs)``.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any

from ep_fuse.testing import tiny


class TargetError(Exception):
    """TARGET cannot be resolved (exit code 2)."""


class FactoryError(Exception):
    """The factory raised (exit code 3)."""


@dataclasses.dataclass
class Target:
    spec: str
    model: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def _builtin(name: str, device: str) -> Target:
    if name not in tiny.TINY_MODELS:
        raise TargetError(f"unknown built-in model 'hf:{name}'; choose one of "
                          + ", ".join(f"hf:{m}" for m in tiny.TINY_MODELS))
    try:
        model = tiny.build(name, device=device)
    except ImportError as exc:
        raise TargetError(f"hf:{name} needs transformers ({exc}); pip install 'ep-fuse[test]'") from exc
    return Target(f"hf:{name}", model, (), tiny.example_inputs(device=device))


def _factory(spec: str) -> Any:
    if ":" not in spec:
        raise TargetError(f"TARGET {spec!r} is not 'path/to/file.py:factory', 'package.module:factory' or 'hf:<model>'")
    where, name = spec.rsplit(":", 1)
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise TargetError(f"no such file: {where}")
        mod_name = f"_ep_fuse_target_{abs(hash(str(path.resolve())))}"
        module_spec = importlib.util.spec_from_file_location(mod_name, path)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[mod_name] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as exc:
            raise FactoryError(f"importing {where} raised {type(exc).__name__}: {exc}") from exc
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as exc:
            raise TargetError(f"cannot import module {where!r}: {exc}") from exc
        except Exception as exc:
            raise FactoryError(f"importing {where} raised {type(exc).__name__}: {exc}") from exc
    fn = getattr(module, name, None)
    if not callable(fn):
        raise TargetError(f"{where} has no callable {name!r}")
    return fn


def load(spec: str, device: str = "cpu") -> Target:
    if spec.startswith("hf:"):
        return _builtin(spec[3:], device)
    fn = _factory(spec)
    try:
        takes_device = "device" in inspect.signature(fn).parameters
        out = fn(device=device) if takes_device else fn()
    except Exception as exc:
        raise FactoryError(f"the factory {spec} raised {type(exc).__name__}: {exc}") from exc
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise TargetError(f"the factory {spec} must return (model, inputs), got {type(out).__name__}")
    model, inputs = out
    if isinstance(inputs, dict):
        return Target(spec, model, (), dict(inputs))
    if (isinstance(inputs, (tuple, list)) and len(inputs) == 2 and isinstance(inputs[1], dict)
            and isinstance(inputs[0], (tuple, list))):
        return Target(spec, model, tuple(inputs[0]), dict(inputs[1]))
    if isinstance(inputs, (tuple, list)):
        return Target(spec, model, tuple(inputs), {})
    return Target(spec, model, (inputs,), {})

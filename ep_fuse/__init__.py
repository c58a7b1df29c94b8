"""ep_fuse: a torch.compile backend that fuses MoE inference patterns into Triton / Ascend kernels.

``torch.compile(model, backend="ep_fuse", options={...})`` works once the package is installed
(entry point ``torch_dynamo_backends``). See :class:`ep_fuse.config.EpFuseConfig` for options.

The public names below are loaded on first use, so that importing one layer of the package (the op registry,
say) does not load the others.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_PUBLIC = {
    "ConfigError": "ep_fuse.config",
    "EpFuseConfig": "ep_fuse.config",
    "EpError": "ep_fuse.ops.ep",
    "ep_options": "ep_fuse.ep.shard",
    "shard_experts": "ep_fuse.ep.shard",
    "release_buffers": "ep_fuse.ep",
    "dynamic_batch": "ep_fuse.surgery.prepare",
    "prepare": "ep_fuse.surgery.prepare",
    "GraphReport": "ep_fuse.report",
    "MatchRecord": "ep_fuse.report",
    "last_report": "ep_fuse.report",
    "reports": "ep_fuse.report",
    "reset_reports": "ep_fuse.report",
    "make_backend": "ep_fuse.backend",
}
"""Public name -> the module that defines it."""

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ep_fuse' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})


INTEGRATIONS = {"transformers.distributed.expert_parallel": "ep_fuse.hf.expert_parallel"}
"""Optional integrations, the one place the package loads them: third-party module -> the ep_fuse module whose
``register()`` runs once that module is imported (at once if it already is). Nothing is imported for a
third-party module that is never imported."""


def _register(module: str) -> None:
    try:
        importlib.import_module(INTEGRATIONS[module]).register()
    except Exception as exc:  # an integration must never break the import of the library it extends
        import logging

        logging.getLogger("ep_fuse").warning("ep_fuse: could not register its %s integration: %s", module, exc)


class _Loader:
    """Wraps a module's loader: runs the integration's ``register()`` after the module has executed."""

    def __init__(self, loader: Any, name: str) -> None:
        self.loader, self.name = loader, name

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        _register(self.name)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.loader, attr)


class _AfterImport:
    """A ``sys.meta_path`` finder that hands the integrations' modules :class:`_Loader`s."""

    busy: set[str] = set()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in INTEGRATIONS or fullname in self.busy:
            return None
        import importlib.util

        self.busy.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self.busy.discard(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, fullname)
        return spec


def _install_integrations() -> None:
    import sys

    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
    for module in INTEGRATIONS:
        if module in sys.modules:
            _register(module)


_install_integrations()


class _CheckoutPatterns:
    """A ``sys.meta_path`` finder for ``ep_fuse.patterns`` in a checkout: the package's patterns live in the
    top-level ``patterns/`` directory, which an install puts at ``ep_fuse/patterns`` (pyproject's ``package-dir``);
    run from a checkout (a script at its root, with or without an install), ``ep_fuse.patterns`` is that directory."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "ep_fuse.patterns":
            return None
        import importlib.util
        import os

        return importlib.util.spec_from_file_location(fullname, os.path.join(self.directory, "__init__.py"),
                                                      submodule_search_locations=[self.directory])


def _find_checkout_patterns() -> None:
    """Install :class:`_CheckoutPatterns` when this package is a checkout's ``ep_fuse/`` (no ``patterns/`` in it, a
    ``patterns/`` package beside it); an installed package holds its patterns and needs nothing."""
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    checkout = os.path.join(os.path.dirname(here), "patterns")
    if os.path.isdir(os.path.join(here, "patterns")) or not os.path.isfile(os.path.join(checkout, "__init__.py")):
        return
    if not any(isinstance(f, _CheckoutPatterns) for f in sys.meta_path):
        sys.meta_path.insert(0, _CheckoutPatterns(checkout))


_find_checkout_patterns()

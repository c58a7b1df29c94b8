"""The catalog: the one module that loads every op family, provider, EP engine and pattern.

Registration flows downward. :mod:`ep_fuse.ops.registry` is the floor and imports nothing of the package; each
family defines its ops in ``ep_fuse/ops/<family>.py``; each provider registers its implementation of a family from
``ep_fuse/providers/<provider>/<family>.py``; each EP engine registers from ``ep_fuse/ep/<engine>.py``; patterns
live in ``ep_fuse/patterns/<family>.py``. Importing this module imports them all (the backend, the CLI and config
validation import it), and sets each device's provider order.

Adding a family is its own files plus one line in :data:`FAMILIES`.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from ep_fuse import runtime
from ep_fuse.matching import PairRule, Pattern
from ep_fuse.ops import registry

FAMILIES = ("moe", "moe_gating", "moe_masked", "rms_norm", "rope", "gemm_swiglu", "w8a8", "fp8", "ep",
            "varlen_attention")
"""Op families, in the order their patterns are tried (bigger fusions first). A family has ``ops/<name>.py`` and any
of ``providers/<provider>/<name>.py`` and ``patterns/<name>.py`` (``moe_masked`` and ``ep`` have no pattern: passes
insert their ops), a test file, ``bench/bench_<name>.py`` listed in ``bench/run.py``, and a mention in the README and
``docs/`` (``tests/test_house.py`` checks each)."""

PROVIDERS = ("triton", "npu", "deepgemm", "flash")
"""Fused providers (``ep_fuse/providers/<name>/``)."""

ENGINES = ("all_to_all", "deepep", "npu", "symm_mem")
"""EP dispatch/combine engines (``ep_fuse/ep/<name>.py``)."""

PRIORITY: dict[str, tuple[str, ...]] = {"cuda": ("deepgemm", "triton", "flash"), "npu": ("npu",), "cpu": ()}
"""Provider order per device type (``reference`` is always last); ``options={"providers": ...}`` overrides it."""


def _cpu_priority() -> tuple[str, ...]:
    """The Triton interpreter (``TRITON_INTERPRET=1``) makes ``triton`` a CPU provider too."""
    return ("triton", *PRIORITY["cpu"]) if runtime.triton_interpret() else PRIORITY["cpu"]


def _optional(name: str) -> ModuleType | None:
    """Import module ``name`` where it exists (a family need not have every provider or a pattern file)."""
    return importlib.import_module(name) if importlib.util.find_spec(name) is not None else None


def _load() -> dict[str, ModuleType]:
    patterns: dict[str, ModuleType] = {}
    for family in FAMILIES:
        importlib.import_module(f"ep_fuse.ops.{family}")
        for provider in PROVIDERS:
            _optional(f"ep_fuse.providers.{provider}.{family}")
        mod = _optional(f"ep_fuse.patterns.{family}")
        if mod is not None:
            patterns[family] = mod
    for engine in ENGINES:
        importlib.import_module(f"ep_fuse.ep.{engine}")
    for device, order in PRIORITY.items():
        registry.set_priority(device, _cpu_priority if device == "cpu" else order)
    return patterns


PATTERN_FAMILIES: dict[str, ModuleType] = _load()
"""Family name -> its pattern module (``DESCRIPTION``, ``PATTERNS``, optional ``PAIRS``), in :data:`FAMILIES` order."""


def all_patterns() -> list[Pattern]:
    """Every pattern, in priority order."""
    return [p for mod in PATTERN_FAMILIES.values() for p in mod.PATTERNS]


def all_pairs(enabled: set[str] | None = None) -> list[PairRule]:
    """Pairing rules of the families whose patterns are enabled (all when ``enabled`` is None)."""
    out: list[PairRule] = []
    for mod in PATTERN_FAMILIES.values():
        names = {p.name for p in mod.PATTERNS}
        if enabled is None or names & enabled:
            out.extend(getattr(mod, "PAIRS", []))
    return out


def known_names() -> dict[str, list[str]]:
    """The names options may give, from the loaded registries: ``patterns``, ``providers`` and ``engines``
    (the keyword arguments of :meth:`ep_fuse.config.EpFuseConfig.check_names`)."""
    from ep_fuse.ops.ep import engine_names

    return {"patterns": pattern_names(), "providers": registry.known_providers(), "engines": engine_names()}


def pattern_names() -> list[str]:
    """User-facing pattern names (what ``options={"patterns": [...], "disable": [...]}`` take)."""
    return list(dict.fromkeys(p.name for p in all_patterns()))

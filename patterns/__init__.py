"""The ep_fuse pattern catalog (shipped as ``ep_fuse.patterns``): one module per fusion family.

Each family module declares ``DESCRIPTION`` and ``PATTERNS``, a list of
:class:`ep_fuse.matching.Pattern` in priority order (bigger fusions first), and optionally ``PAIRS``
(:class:`ep_fuse.matching.PairRule`: sibling canonical calls run as one). Families are tried in the
order of :data:`FAMILIES`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ep_fuse.matching import PairRule, Pattern

FAMILIES = ("moe", "router", "rms_norm", "rope", "swiglu")


def families() -> dict[str, ModuleType]:
    return {name: importlib.import_module(f"ep_fuse.patterns.{name}") for name in FAMILIES}


def all_patterns() -> list[Pattern]:
    return [p for mod in families().values() for p in mod.PATTERNS]


def all_pairs(enabled: set[str] | None = None) -> list[PairRule]:
    """Pairing rules of the families whose patterns are enabled (all when ``enabled`` is None)."""
    out: list[PairRule] = []
    for mod in families().values():
        names = {p.name for p in mod.PATTERNS}
        if enabled is None or names & enabled:
            out.extend(getattr(mod, "PAIRS", []))
    return out


def pattern_names() -> list[str]:
    """User-facing pattern names (what ``options={"patterns": [...], "disable": [...]}`` take)."""
    seen: dict[str, None] = {}
    for p in all_patterns():
        seen.setdefault(p.name, None)
    return list(seen)

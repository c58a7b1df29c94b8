"""Hugging Face transformers helpers."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("ep_fuse")

TRACEABLE_EXPERTS = ("grouped_mm", "batched_mm")


def prepare(model: Any, experts_implementation: str = "grouped_mm") -> Any:
    """Make an HF transformers MoE model traceable as one graph; returns the model.

    The default per-expert loop (``experts_implementation="eager"``) breaks the graph 10+ times and
    hides the expert GEMMs from any backend (``traced-graphs.md`` §0); ``grouped_mm`` (default) or
    ``batched_mm`` trace to one graph. Models without experts are returned unchanged.
    """
    if experts_implementation not in TRACEABLE_EXPERTS:
        raise ValueError(
            f"ep_fuse.prepare: experts_implementation={experts_implementation!r}; use one of {TRACEABLE_EXPERTS} "
            "(the eager per-expert loop cannot be captured as one graph)"
        )
    setter = getattr(model, "set_experts_implementation", None)
    can_set = getattr(model, "_can_set_experts_implementation", None)
    if setter is None or (callable(can_set) and not _safe(can_set)):
        log.info("ep_fuse.prepare: %s has no switchable experts; unchanged", type(model).__name__)
        return model
    setter(experts_implementation)
    log.info("ep_fuse.prepare: %s uses experts_implementation=%s", type(model).__name__, experts_implementation)
    return model


def _safe(fn: Any) -> bool:
    try:
        return bool(fn())
    except Exception:
        return False

"""Logging: everything goes through the ``ep_fuse`` logger; ``EP_FUSE_LOG`` switches console output on.

``EP_FUSE_LOG=info`` prints every match and the per-graph summary; ``debug`` adds pattern attempts
and provider decisions; ``warning`` (the default when unset) only prints fallbacks.
"""

from __future__ import annotations

import logging
import os

_configured: str | None = None


def configure_from_env() -> None:
    """Attach one stderr handler to ``ep_fuse`` at the level ``EP_FUSE_LOG`` names (idempotent)."""
    global _configured
    level = os.environ.get("EP_FUSE_LOG", "").strip().upper()
    if not level or level == _configured:
        return
    logger = logging.getLogger("ep_fuse")
    if not any(getattr(h, "_ep_fuse", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(name)s %(levelname)s] %(message)s"))
        handler._ep_fuse = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    logger.setLevel(getattr(logging, level, logging.INFO))
    _configured = level

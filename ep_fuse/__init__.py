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
    "dynamic_batch": "ep_fuse.models.prepare",
    "prepare": "ep_fuse.models.prepare",
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

"""ep_fuse: a torch.compile backend that fuses MoE inference patterns into Triton / Ascend kernels.

``torch.compile(model, backend="ep_fuse", options={...})`` works once the package is installed
(entry point ``torch_dynamo_backends``). See :class:`ep_fuse.config.EpFuseConfig` for options.
"""

from ep_fuse.config import ConfigError, EpFuseConfig
from ep_fuse.ep import EpError, ep_options, release_buffers, shard_experts
from ep_fuse.hf import dynamic_batch, prepare
from ep_fuse.report import GraphReport, MatchRecord, last_report, reports, reset_reports

__version__ = "0.1.0"


def make_backend(**options):  # noqa: ANN003, ANN201 - thin re-export with lazy import
    """A backend callable with ``options`` validated now (see :func:`ep_fuse.backend.make_backend`)."""
    from ep_fuse.backend import make_backend as _make

    return _make(**options)


__all__ = [
    "ConfigError",
    "EpError",
    "EpFuseConfig",
    "GraphReport",
    "MatchRecord",
    "dynamic_batch",
    "ep_options",
    "release_buffers",
    "last_report",
    "make_backend",
    "prepare",
    "reports",
    "reset_reports",
    "shard_experts",
]

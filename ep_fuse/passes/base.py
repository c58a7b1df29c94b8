"""Pass interface and the state passes share while one graph is compiled."""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

import torch.fx as fx

from ep_fuse.config import EpFuseConfig
from ep_fuse.report import GraphReport


@dataclasses.dataclass
class PassContext:
    config: EpFuseConfig
    device: str
    executor: str
    report: GraphReport
    fake_mode: Any = None
    match_by_node: dict[str, list[Any]] = dataclasses.field(default_factory=dict)
    """Fused node name -> the :class:`~ep_fuse.report.MatchRecord` s it carries (lowering fills in the provider)."""
    inputs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Placeholder name -> the real tensor the graph was captured with (parameters included), where the
    backend has them; passes that need weight values (``quant``) read them here, never the activations."""
    current: Any = None
    """What a pass is working on now, named when it fails: ``(pattern, node)`` in canonicalize."""


class GraphPass(abc.ABC):
    """One transformation of the ATen graph; returns how many sites it changed."""

    name: str = "pass"
    runs_on_restored: bool = False
    """Also run on the graph put back after a pass failed (what the executor needs whatever the rewrite did)."""

    @abc.abstractmethod
    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> int: ...

"""Graph dumps: readable ATen code after each pass and the match table, under ``dump_dir``."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import torch.fx as fx

from ep_fuse.config import EpFuseConfig
from ep_fuse.report import GraphReport

log = logging.getLogger("ep_fuse.dump")


class Dumper:
    """Writes nothing unless the config names a ``dump_dir``."""

    def __init__(self, root: Path | None):
        self.root = root

    @classmethod
    def for_config(cls, config: EpFuseConfig, graph_id: str) -> Dumper:
        if not config.dump_dir:
            return cls(None)
        root = Path(config.dump_dir) / ("graph_" + re.sub(r"[^0-9A-Za-z_.-]", "_", graph_id))
        root.mkdir(parents=True, exist_ok=True)
        return cls(root)

    def graph(self, stage: str, gm: fx.GraphModule) -> None:
        if self.root is None:
            return
        text = gm.print_readable(print_output=False, include_stride=True, include_device=True)
        (self.root / f"{stage}.py").write_text(text)

    def text(self, name: str, text: str) -> None:
        if self.root is not None:
            (self.root / name).write_text(text)

    def report(self, report: GraphReport) -> None:
        if self.root is None:
            return
        (self.root / "report.json").write_text(report.to_json())
        (self.root / "summary.txt").write_text(str(report) + os.linesep)
        log.info("ep_fuse: dumped graph %s to %s", report.graph, self.root)

"""Graph dumps: readable code of each stage, graphs as data, the report and an HTML view, under ``dump_dir``.

Layout per captured graph (``<dump_dir>/graph_<id>/``): ``00_dynamo.py`` (Dynamo's graph),
``01_aten.py`` (the ATen graph ep_fuse rewrites), ``NN_<pass>.py`` (the graph after pass NN),
``graph_before.json`` / ``graph_after.json`` (nodes as data), ``report.json``, ``summary.txt``,
``unlowered.txt``. ``<dump_dir>/report.html`` covers every graph in the folder.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import torch.fx as fx

from ep_fuse.config import EpFuseConfig
from ep_fuse.debug.graph_json import graph_to_json
from ep_fuse.debug.html import write_html
from ep_fuse.report import GraphReport

log = logging.getLogger("ep_fuse.dump")


def graph_dir_name(graph_id: str) -> str:
    return "graph_" + re.sub(r"[^0-9A-Za-z_.-]", "_", graph_id)


class Dumper:
    """Writes nothing unless the config names a ``dump_dir``."""

    def __init__(self, root: Path | None, folder: Path | None = None):
        self.root = root
        self.folder = folder

    @classmethod
    def for_config(cls, config: EpFuseConfig, graph_id: str) -> Dumper:
        if not config.dump_dir:
            return cls(None)
        root = Path(config.dump_dir)
        folder = root / graph_dir_name(graph_id)
        folder.mkdir(parents=True, exist_ok=True)
        return cls(root, folder)

    def graph(self, stage: str, gm: fx.GraphModule) -> None:
        if self.folder is None:
            return
        text = gm.print_readable(print_output=False, include_stride=True, include_device=True)
        (self.folder / f"{stage}.py").write_text(text)
        if stage == "00_dynamo":
            return
        data = json.dumps(graph_to_json(gm))
        if stage == "01_aten":
            (self.folder / "graph_before.json").write_text(data)
        (self.folder / "graph_after.json").write_text(data)

    def report(self, report: GraphReport) -> None:
        if self.folder is None or self.root is None:
            return
        (self.folder / "report.json").write_text(report.to_json())
        (self.folder / "summary.txt").write_text(str(report) + os.linesep)
        (self.folder / "unlowered.txt").write_text("".join(n + os.linesep for n in report.unlowered))
        write_html(self.root)
        log.info("ep_fuse: dumped graph %s to %s", report.graph, self.folder)

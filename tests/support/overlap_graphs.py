"""What the EP overlap pass leaves, for ``tests/test_ep_overlap.py`` and ``tests/test_ep_overlap_range.py``: the
graphs it returns (``(node name, target)`` per node, in graph order) and the op counts of a report."""

from __future__ import annotations

from typing import Any

OPS = ("ep_dispatch", "ep_combine", "ep_dispatch_start", "ep_dispatch_wait", "ep_combine_start", "ep_combine_wait")
"""The EP ops whose counts the overlap tests compare."""


def counts(report: Any) -> dict[str, int]:
    """How many of each op of :data:`OPS` the rewritten graph holds."""
    return {op: report.ops_after.get(f"ep_fuse.{op}.default", 0) for op in OPS}


def positions(order: list[tuple[str, Any]], pred: Any) -> list[int]:
    """Indices in ``order`` of the nodes whose target satisfies ``pred`` (a callable) or is ``pred``."""
    test = pred if callable(pred) and not hasattr(pred, "overloadpacket") else (lambda t: t is pred)
    return [i for i, (_name, target) in enumerate(order) if test(target)]


class OverlapGraphs:
    """``with OverlapGraphs() as rec:`` records, in ``rec.graphs``, every graph the overlap pass leaves (its nodes as
    ``(name, target)``). It wraps the pass's ``__call__`` for the block and restores it after."""

    def __enter__(self) -> OverlapGraphs:
        from ep_fuse.passes import ep_overlap

        self.graphs: list[list[tuple[str, Any]]] = []
        self._orig = orig = ep_overlap.EpOverlap.__call__
        graphs = self.graphs

        def spy(pass_: Any, gm: Any, ctx: Any) -> Any:
            changed = orig(pass_, gm, ctx)
            graphs.append([(n.name, n.target) for n in gm.graph.nodes])
            return changed

        ep_overlap.EpOverlap.__call__ = spy
        return self

    def __exit__(self, *exc: Any) -> None:
        from ep_fuse.passes import ep_overlap

        ep_overlap.EpOverlap.__call__ = self._orig

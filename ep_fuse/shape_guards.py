"""Shape guards the rewrite adds to Dynamo's ``ShapeEnv``.

Under ``dynamic=True`` (or automatic dynamic) the graph's sizes are ``SymInt``s. Any decision a pass
takes by evaluating one -- ``int(s)``, ``bool(s == 4)``, ``if rows > 32`` -- records a guard in the
``ShapeEnv``; Dynamo installs it with the compiled graph, so the graph is only reused for sizes that
satisfy it and other sizes recompile. ep_fuse's passes must decide with
:func:`~torch.fx.experimental.symbolic_shapes.statically_known_true` (no guard) and leave size-dependent
choices to run time. :class:`ShapeGuardWatch` records what they added anyway (``GraphReport.shape_guards``),
so a regression shows in the report and the tests instead of as silent recompiles.
"""

from __future__ import annotations

from typing import Any


class ShapeGuardWatch:
    """Counts the guards of the graph's ``ShapeEnv`` at construction; :meth:`added` lists the newer ones."""

    def __init__(self, fake_mode: Any) -> None:
        self.env = getattr(fake_mode, "shape_env", None)
        self.start = len(self.env.guards) if self.env is not None else 0

    def added(self) -> list[str]:
        if self.env is None:
            return []
        return [str(g.expr) for g in self.env.guards[self.start:]]

"""Perf-rule thresholds as data: each is the number a rule compares against, with what was measured and the
command that measures it again (the figures, GPU, versions and date are in ``docs/benchmarks.md``)."""

from __future__ import annotations


class Threshold(int):
    """An ``int`` threshold of a perf rule that carries its evidence.

    Attributes:
        evidence: the measured figures that put the threshold where it is.
        command: the benchmark command that reproduces them.
    """

    evidence: str
    command: str

    def __new__(cls, value: int, *, evidence: str, command: str) -> Threshold:
        obj = super().__new__(cls, value)
        obj.evidence = evidence
        obj.command = command
        return obj

    def describe(self) -> str:
        return f"{int(self)}: {self.evidence} ({self.command})"

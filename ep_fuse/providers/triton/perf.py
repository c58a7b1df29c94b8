"""Where the Triton RMSNorm kernels are not faster than Inductor's own code (measured, see docs/benchmarks.md).

Consulted only for the Inductor executor with ``perf_guard=True``: a declined call keeps the ATen
ops, so Inductor generates the code it would have generated without ep_fuse.
"""

from __future__ import annotations

from typing import Any

from ep_fuse.providers.common import unpack_norm_args

DECLINE_ROWS_BELOW = 0
"""Row counts below this are launch-overhead bound; there Inductor's fused code is kept."""


def _rows(x: Any) -> int | None:
    try:
        return int(x.numel() // max(int(x.shape[-1]), 1))
    except Exception:  # symbolic: decided by the row width alone
        return None


def rms_norm_prefers(args: tuple[Any, ...]) -> str | None:
    x, _res, _rest = unpack_norm_args(args)
    rows = _rows(x)
    if rows is not None and rows < DECLINE_ROWS_BELOW:
        return f"{rows} rows: launch-bound, Inductor's fused kernel is as fast"
    return None


add_rms_norm_prefers = rms_norm_prefers

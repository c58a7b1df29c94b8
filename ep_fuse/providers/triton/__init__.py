"""Triton provider: CUDA GPUs, or the CPU under ``TRITON_INTERPRET=1`` (set before the first launch)."""

from __future__ import annotations

import functools
import importlib.util

from ep_fuse.ops import canonical
from ep_fuse.ops.registry import register_provider, triton_interpret
from ep_fuse.providers.common import check_norm_call
from ep_fuse.providers.triton import perf
from ep_fuse.providers.triton.rms_norm import add_rms_norm_kernel, rms_norm_kernel


def _devices() -> frozenset[str]:
    return frozenset({"cuda", "cpu"}) if triton_interpret() else frozenset({"cuda"})


@functools.lru_cache(maxsize=1)
def _available() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install triton)"
    return None


register_provider(
    canonical.rms_norm, "triton", rms_norm_kernel,
    devices=_devices, available=_available, supports=check_norm_call, prefers=perf.rms_norm_prefers,
)
register_provider(
    canonical.add_rms_norm, "triton", add_rms_norm_kernel,
    devices=_devices, available=_available, supports=check_norm_call, prefers=perf.add_rms_norm_prefers,
)

"""Whether ``torch_npu`` can be used, asked once for every Ascend code path (op providers, EP)."""

from __future__ import annotations

import functools
import importlib
from typing import Any


@functools.lru_cache(maxsize=1)
def available() -> str | None:
    """``None`` when ``torch_npu`` imports, else why not (one cached answer; ``cache_clear`` re-asks)."""
    try:
        importlib.import_module("torch_npu")
    except Exception as exc:  # ImportError, or a CANN library missing
        return f"torch_npu cannot be imported ({type(exc).__name__}: {exc}); install torch_npu with CANN"
    return None


def torch_npu() -> Any:
    return importlib.import_module("torch_npu")

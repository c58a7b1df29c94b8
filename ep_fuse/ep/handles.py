"""Process-local registry for opaque engine handles (DeepEP, Ascend), keyed by the handle tensor.

The graph carries the handle as an explicit int64 tensor from ``ep_dispatch`` to ``ep_combine``
(a graph value, not module state: ``docs/ep.md``, "The ops"). Engines whose native handle is a
Python object (DeepEP's tuple of tensors) keep it here under a fresh integer key written into the
tensor (``handle[1]``) and, to avoid reading that key back from the device (a sync), under the
tensor's storage address; combine pops the entry, so nothing outlives one dispatch/combine pair.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

import torch

_lock = threading.Lock()
_entries: dict[int, Any] = {}
_by_ptr: dict[int, int] = {}
_keys = itertools.count(1)


def put(handle: torch.Tensor, value: Any, write_key: bool = True) -> int:
    """Store ``value`` for the dispatch whose handle tensor is ``handle``; ``write_key`` also writes the
    key into ``handle[1]`` (a device write: engines skip it on GPUs, where lookups go by address)."""
    with _lock:
        key = next(_keys)
        _entries[key] = value
        _by_ptr[handle.data_ptr()] = key
    if write_key:
        handle[1] = key
    return key


def pop(handle: torch.Tensor) -> Any:
    """The value stored by :func:`put` for ``handle``; raises if the dispatch is unknown."""
    with _lock:
        key = _by_ptr.pop(handle.data_ptr(), None)
        if key is None and handle.device.type == "cpu":
            key = int(handle[1])
        if key is None or key not in _entries:
            raise RuntimeError(
                "ep_fuse: ep_combine got a handle no ep_dispatch of this process produced (the dispatch "
                "and combine of one MoE block must run in the same process, combine once per dispatch)"
            )
        return _entries.pop(key)


def pending() -> int:
    """Handles dispatched but not yet combined (tests check this returns to 0)."""
    with _lock:
        return len(_entries)


def clear() -> int:
    """Drop every pending handle (benchmarks that dispatch without combining); returns how many."""
    with _lock:
        n = len(_entries)
        _entries.clear()
        _by_ptr.clear()
        return n

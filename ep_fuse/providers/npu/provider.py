"""The Ascend provider's shared pieces: where it runs, whether ``torch_npu`` can be used, and the torch_npu
release its op contracts were checked against (each family module registers its own ops)."""

from __future__ import annotations

from ep_fuse import runtime

available = runtime.npu_available
"""``None`` when ``torch_npu`` imports, else why not (cached; ``cache_clear`` re-asks)."""
torch_npu = runtime.torch_npu
contracts = runtime.npu_contracts


def devices() -> frozenset[str]:
    return frozenset({"npu"})

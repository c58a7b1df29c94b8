"""Expert weights made at compile time: a weight's real value evaluated from the graph's static inputs, quantized
once per source tensors (:data:`WEIGHT_CACHE`), and entered into the graph as constants.

The static inputs are the parameters and buffers (:attr:`PassContext.inputs`, filled by the backend from Dynamo's
example inputs) and the GraphModule's own tensors. A quantized weight is cached by a weak reference to the source
tensor(s) plus their ``_version``, so a recompile (or a second graph over the same weights) reuses it and an in-place
weight update requantizes. The codes and scales enter the graph as ``get_attr`` nodes of non-persistent buffers of
the GraphModule: the eager executor reads them, Inductor (which then compiles behind AOT's wrapper:
:func:`ep_fuse.backend._not_direct` refuses graphs with constants) embeds them.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import fx
from torch.utils.weak import WeakIdKeyDictionary

from ep_fuse.passes.base import PassContext
from ep_fuse.passes.graph_edit import fake_mode

log = logging.getLogger("ep_fuse.passes.quant")

MAX_CHAIN = 16
"""At most this many ops between a parameter and the expert weight that is evaluated at compile time."""


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """How a weight is quantized at compile time."""

    name: str
    """The cache key's format (``int8``, ``fp8_block``)."""
    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    """weight -> (codes, scales)."""
    description: str
    """For the log (``int8 (per-channel scales)``)."""
    suffixes: tuple[str, str]
    """Buffer-name suffixes of the codes and the scales (``q``, ``scale``)."""


class WeightCache:
    """Codes + scales per source weight and format, held by weak reference to the source tensor(s)."""

    def __init__(self) -> None:
        self._entries: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._lock = threading.Lock()
        self.quantized = 0
        """How many weights were quantized (tests check a recompile adds none)."""

    def get(self, sources: list[torch.Tensor], chain: tuple[Any, ...], value: torch.Tensor, fmt: QuantFormat
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """``value`` (computed from ``sources`` by ``chain``) quantized in ``fmt``: cached, or made now."""
        key = sources[0]
        sig = (fmt.name, chain, tuple(id(s) for s in sources[1:]))
        versions = tuple(s._version for s in sources)
        with self._lock:
            per_source = self._entries.get(key)
            if per_source is None:
                per_source = {}
                self._entries[key] = per_source
            hit = per_source.get(sig)
            if hit is not None and hit[0] == versions:
                return hit[1], hit[2]
        with torch.no_grad():
            q, s = fmt.quantize(value.detach())
        with self._lock:
            per_source[sig] = (versions, q, s)
            self.quantized += 1
        log.info("ep_fuse: quantized expert weight %s %s to %s", tuple(value.shape), value.dtype, fmt.description)
        return q, s

    def clear(self) -> None:
        with self._lock:
            self._entries = WeakIdKeyDictionary()
            self.quantized = 0

    def __len__(self) -> int:
        return sum(len(v) for v in self._entries.values())


WEIGHT_CACHE = WeightCache()


def static_value(gm: fx.GraphModule, ctx: PassContext, node: Any, sources: list[torch.Tensor], chain: list[Any],
                 depth: int = 0) -> Any:
    """The real value of ``node`` from static inputs and constants only (``None`` if it needs anything else).

    Appends the static tensors it reads to ``sources`` and the ops it runs to ``chain`` (the cache key)."""
    if not isinstance(node, fx.Node):
        return node
    if depth > MAX_CHAIN:
        return None
    if node.op == "placeholder":
        t = ctx.inputs.get(node.name)
        if isinstance(t, torch.Tensor):
            sources.append(t)
            chain.append(("input", node.name))
        return t
    if node.op == "get_attr":
        t = getattr(gm, str(node.target), None)
        if isinstance(t, torch.Tensor):
            sources.append(t)
            chain.append(("attr", node.target))
        return t
    if node.op != "call_function":
        return None
    missing = False

    def ev(a: Any) -> Any:
        nonlocal missing
        v = static_value(gm, ctx, a, sources, chain, depth + 1)
        missing |= v is None
        return v

    args = fx.node.map_aggregate(node.args, ev)
    kwargs = fx.node.map_aggregate(node.kwargs, ev)
    if missing:
        return None
    chain.append((str(node.target), tuple(a for a in node.args if not isinstance(a, fx.Node))))
    with torch.no_grad():
        return node.target(*args, **kwargs)


def constant(gm: fx.GraphModule, ctx: PassContext, t: torch.Tensor, label: str) -> fx.Node:
    """A ``get_attr`` node for ``t``, a non-persistent buffer of ``gm`` (Inductor's AOT re-trace lifts
    buffers to inputs; a plain tensor attribute would reach its fake-tensor trace as a real tensor)."""
    i = 0
    while hasattr(gm, f"_ep_fuse_quant_{label}_{i}"):
        i += 1
    name = f"_ep_fuse_quant_{label}_{i}"
    gm.register_buffer(name, t, persistent=False)
    node = gm.graph.get_attr(name)
    node.meta["val"] = fake_mode(ctx).from_tensor(t, static_shapes=True)
    return node


def quantized_constants(gm: fx.GraphModule, ctx: PassContext, weight: fx.Node, block: fx.Node, label: str,
                        fmt: QuantFormat) -> tuple[fx.Node, fx.Node] | None:
    """``(codes, scales)`` constant nodes of ``weight`` evaluated from the parameters it is computed from and
    quantized once in ``fmt`` (:data:`WEIGHT_CACHE`), or ``None`` when it is not computed from parameters."""
    sources: list[torch.Tensor] = []
    chain: list[Any] = []
    value = static_value(gm, ctx, weight, sources, chain)
    if value is None or not sources:
        log.warning("ep_fuse: quant: %s at %s: %s is not computed from parameters the backend can read "
                    "(pass the model's weights as parameters or buffers); the block stays unquantized",
                    block.name, weight.name, label)
        return None
    q, s = WEIGHT_CACHE.get(sources, tuple(chain), value, fmt)
    return constant(gm, ctx, q, f"{label}_{fmt.suffixes[0]}"), constant(gm, ctx, s, f"{label}_{fmt.suffixes[1]}")

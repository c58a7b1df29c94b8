"""HF continuous batching's attention as ``ep_fuse::varlen_attention`` instead of SDPA over a dense mask.

With ``attn_implementation="sdpa"`` (the default; flash-attn is often not installed) HF continuous batching packs
every scheduled request's new tokens into one row, reads all their cached keys into one ``[keys read]`` tensor,
and builds on the host a dense ``[tokens, keys read]`` additive mask (block-diagonal, causal) that it copies to the
device every step; SDPA then scores every query against every key read. On one H200 serving a Qwen3-30B-A3B-sized
model this was half the GPU time of ep_fuse's compiled forward (``docs/benchmarks.md``).

:func:`install` (process-wide, idempotent; called by :func:`ep_fuse.prepare`) puts a wrapper in front of HF's
``sdpa`` attention function: a call from continuous batching (its kwargs carry ``cu_seq_lens_q``/``cu_seq_lens_k``
and the cache's ``read_index``) on a full-attention layer runs ``ep_fuse::varlen_attention`` with those lengths
(on CUDA lowered to FlashAttention-2's varlen kernel, :mod:`ep_fuse.providers.flash.varlen_attention`); every other
call is HF's own SDPA, unchanged. :func:`enable` (per model, by ``prepare``) also stops HF building the mask for that
model, where every layer takes the op (full attention, no soft-capping, no attention sinks, ``sdpa``); without the
mask a layer that cannot take it raises rather than attend across requests.
"""

from __future__ import annotations

import logging
import math
import weakref
from typing import Any

import torch

from ep_fuse.ops.varlen_attention import varlen_attention

log = logging.getLogger("ep_fuse")

_NO_MASK: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
"""``id(config) -> config`` of the models whose continuous batching builds no attention mask (:func:`enable`)."""
_ORIGINALS: dict[str, Any] = {}


def _decline(module: Any, query: torch.Tensor, key: torch.Tensor, dropout: float, kwargs: dict[str, Any]) -> str | None:
    """Why this attention call is not continuous batching's plain causal varlen attention (``None``: it is)."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if not isinstance(cu_q, torch.Tensor) or not isinstance(cu_k, torch.Tensor) or "read_index" not in kwargs:
        return "not a continuous-batching call"
    if kwargs.get("block_table") is not None:
        return "the block-table decode path"
    if query.shape[0] != 1 or key.shape[0] != 1:
        return "not one packed row"
    if dropout:
        return "dropout"
    for name in ("sliding_window", "softcap", "s_aux", "position_bias"):
        if kwargs.get(name) is not None:
            return name
    if getattr(module, "is_causal", True) is False:
        return "not causal"
    return None


def _attention(original: Any, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
               **kwargs: Any) -> tuple[torch.Tensor, None]:
    reason = _decline(module, query, key, dropout, kwargs)
    if reason is not None:
        if attention_mask is None and "read_index" in kwargs and "cu_seq_lens_q" in kwargs:
            raise RuntimeError(
                f"ep_fuse: continuous batching built no attention mask for this model but a layer cannot take "
                f"ep_fuse::varlen_attention ({reason}); call ep_fuse.models.varlen_attention.disable(model) before "
                "init_continuous_batching")
        return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [rows, heads, head_dim]
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    # the longest sequence bounded by the row counts, not HF's max_length_q/k: those are ints that would enter
    # the graph (a recompile per value under automatic dynamic); the row counts are sizes the graph has anyway
    out = varlen_attention(q, k, v, kwargs["cu_seq_lens_q"].to(torch.int32), kwargs["cu_seq_lens_k"].to(torch.int32),
                           q.shape[0], k.shape[0], float(scale))
    return out.unsqueeze(0), None


def _mask_is_needed(original: Any, config: Any) -> bool:
    if _NO_MASK.get(id(config)) is config:
        return False
    return original(config)


def install() -> bool:
    """Route continuous batching's SDPA calls through :data:`varlen_attention` (process-wide, idempotent).

    Returns False when this transformers has no continuous batching."""
    try:
        from transformers.generation.continuous_batching import input_outputs  # optional dependency
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:
        return False
    if _ORIGINALS or not hasattr(input_outputs, "attn_mask_is_needed"):
        return bool(_ORIGINALS)
    sdpa, mask_is_needed = ALL_ATTENTION_FUNCTIONS["sdpa"], input_outputs.attn_mask_is_needed
    _ORIGINALS.update(sdpa=sdpa, mask=mask_is_needed)

    def sdpa_or_varlen(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        return _attention(sdpa, module, query, key, value, attention_mask, dropout, scaling, **kwargs)

    def attn_mask_is_needed(config):
        return _mask_is_needed(mask_is_needed, config)

    sdpa_or_varlen.__doc__ = "HF's sdpa attention; continuous batching's calls as ep_fuse::varlen_attention."
    attn_mask_is_needed.__doc__ = mask_is_needed.__doc__
    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_or_varlen
    input_outputs.attn_mask_is_needed = attn_mask_is_needed
    log.info("ep_fuse: continuous batching's sdpa attention runs as ep_fuse::varlen_attention")
    return True


def uninstall() -> None:
    """Restore HF's own ``sdpa`` attention function and mask decision."""
    if not _ORIGINALS:
        return
    from transformers.generation.continuous_batching import input_outputs  # optional dependency
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS["sdpa"] = _ORIGINALS["sdpa"]
    input_outputs.attn_mask_is_needed = _ORIGINALS["mask"]
    _ORIGINALS.clear()
    _NO_MASK.clear()


def mask_free_reason(model: Any) -> str | None:
    """Why ``model``'s continuous batching must keep HF's attention mask (``None``: every layer takes the op)."""
    config = getattr(model, "config", None)
    if config is None:
        return "no config"
    if getattr(config, "_attn_implementation", None) not in (None, "sdpa"):
        return f"attn_implementation={config._attn_implementation!r}"
    layer_types = getattr(config, "layer_types", None)
    if layer_types and set(layer_types) != {"full_attention"}:
        return f"layer types {sorted(set(layer_types))}"
    if layer_types is None and getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding-window attention"
    for name in ("attn_logit_softcapping", "attention_logit_softcapping"):
        if getattr(config, name, None):
            return name
    for name, _p in model.named_parameters():
        if name.endswith(".sinks") or name.endswith(".s_aux"):
            return "attention sinks"
    for name, module in model.named_modules():
        if getattr(module, "sliding_window", None) is not None and hasattr(module, "layer_idx"):
            return f"sliding-window attention ({name})"
    return None


def enable(model: Any) -> bool:
    """Install the wrapper and, where every layer of ``model`` takes the op, let its continuous batching build no
    attention mask (the host-side build and copy of a ``[tokens, keys read]`` tensor every step). Returns whether
    the mask is dropped."""
    if not install():
        return False
    reason = mask_free_reason(model)
    if reason is not None:
        log.info("ep_fuse: %s keeps HF's continuous-batching attention mask (%s)", type(model).__name__, reason)
        return False
    _NO_MASK[id(model.config)] = model.config
    return True


def disable(model: Any) -> None:
    """Let ``model``'s continuous batching build HF's attention mask again (the wrapper stays installed)."""
    config = getattr(model, "config", None)
    if config is not None and _NO_MASK.get(id(config)) is config:
        del _NO_MASK[id(config)]

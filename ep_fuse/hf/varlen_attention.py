"""HF continuous batching's attention as ``ep_fuse::varlen_attention`` instead of SDPA over a dense mask.

With ``attn_implementation="sdpa"`` (the default; flash-attn is often not installed) HF continuous batching packs
every scheduled request's new tokens into one row, reads all their cached keys into one ``[keys read]`` tensor,
and builds on the host a dense ``[tokens, keys read]`` additive mask (block-diagonal, causal) that it copies to the
device every step; SDPA then scores every query against every key read, the KV heads repeated. Serving a
Qwen3-30B-A3B-sized model, that attention and its mask were most of the GPU time of ep_fuse's compiled forward
(``docs/benchmarks.md``).

:func:`enable` (per model, called by :func:`ep_fuse.prepare`) clears a model whose every layer takes the op (full
attention, no soft-capping, no attention sinks, ``sdpa``). When its continuous batching starts on a device and dtype
where a fused provider runs the op (CUDA fp16/bf16: FlashAttention-2's varlen kernel,
:mod:`ep_fuse.providers.flash.varlen_attention`), HF's ``attn_mask_is_needed`` answers False for it, so no mask is
built, and the wrapper :func:`install` puts in front of HF's ``sdpa`` attention function (process-wide) runs each
such call (no mask; ``cu_seq_lens_q``/``cu_seq_lens_k`` and the cache's ``read_index`` in its kwargs) as the op.
Every call that comes with a mask, or not from continuous batching, is HF's own SDPA unchanged. Without the mask, a
layer that cannot take the op raises rather than attend across requests.
"""

from __future__ import annotations

import logging
import math
import weakref
from typing import Any

import torch

from ep_fuse.ops.varlen_attention import VARLEN_ATTENTION, varlen_attention

log = logging.getLogger("ep_fuse")

_ENABLED: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
"""``id(config) -> model`` of the models :func:`enable` cleared for the op (their continuous batching builds no mask
where a provider runs the op on the model's device and dtype, or everywhere with ``force``)."""
_FORCED: weakref.WeakSet[Any] = weakref.WeakSet()
FAST_DTYPES = (torch.float16, torch.bfloat16)
_ORIGINALS: dict[str, Any] = {}


def _decline(module: Any, query: torch.Tensor, key: torch.Tensor, dropout: float, kwargs: dict[str, Any]) -> str | None:
    """Why this attention call is not continuous batching's plain causal varlen attention (``None``: it is)."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if not isinstance(cu_q, torch.Tensor) or not isinstance(cu_k, torch.Tensor):
        return "cumulative sequence lengths are not tensors"
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
    cb = "read_index" in kwargs and "cu_seq_lens_q" in kwargs
    if attention_mask is not None or not cb:
        # HF built its mask (the op is not cleared for this model here), or not continuous batching
        return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    reason = _decline(module, query, key, dropout, kwargs)
    if reason is not None:
        raise RuntimeError(
            f"ep_fuse: continuous batching built no attention mask for this model but a layer cannot take "
            f"ep_fuse::varlen_attention ({reason}); call ep_fuse.hf.varlen_attention.disable(model) before "
            "init_continuous_batching")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [rows, heads, head_dim]
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    # the longest sequence bounded by the row counts, not HF's max_length_q/k: those are ints that would enter
    # the graph (a recompile per value under automatic dynamic); the row counts are sizes the graph has anyway
    out = varlen_attention(q, k, v, kwargs["cu_seq_lens_q"].to(torch.int32), kwargs["cu_seq_lens_k"].to(torch.int32),
                           q.shape[0], k.shape[0], float(scale))
    return out.unsqueeze(0), None


def runs_fused(model: Any) -> str | None:
    """Why no fused provider of the op runs ``model``'s attention where it is now (``None``: one does)."""
    try:
        param = next(model.parameters())
    except (StopIteration, AttributeError):
        return "no parameters"
    if param.dtype not in FAST_DTYPES:
        return f"dtype {param.dtype} (the fused kernels take fp16/bf16)"
    device = param.device.type
    for prov in VARLEN_ATTENTION.providers.values():
        if device in prov.devices() and prov.available() is None:
            return None
    return f"no varlen_attention provider runs on {device} here"


def _mask_is_needed(original: Any, config: Any) -> bool:
    model = _ENABLED.get(id(config))
    if model is not None and getattr(model, "config", None) is config:
        reason = None if model in _FORCED else runs_fused(model)
        if reason is None:
            return False
        log.info("ep_fuse: continuous batching keeps HF's attention mask and SDPA for %s (%s)",
                 type(model).__name__, reason)
    return original(config)


def builds_no_mask(model: Any) -> bool:
    """Whether ``model``'s continuous batching, started where the model is now, builds no attention mask: the
    answer HF's ``attn_mask_is_needed`` gets from the wrapper :func:`install` puts in front of it (the model cleared
    by :func:`enable` and a fused provider running the op on its device and dtype, or forced)."""
    config = getattr(model, "config", None)
    if config is None or not _ORIGINALS:
        return False
    return not _mask_is_needed(lambda _config: True, config)


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
    _ENABLED.clear()


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


def enable(model: Any, force: bool = False) -> bool:
    """Install the wrapper and clear ``model`` for the op where every one of its layers takes it: its continuous
    batching then builds no attention mask (the host-side build and copy of a ``[tokens, keys read]`` tensor every
    step) and runs the op, when it starts on a device and dtype where a fused provider runs the op (decided at
    ``init_continuous_batching``, after the model moved; elsewhere HF's mask and SDPA, which the reference would not
    beat), or everywhere with ``force`` (tests, debugging). Returns whether ``model`` was cleared."""
    if not install():
        return False
    reason = mask_free_reason(model)
    if reason is not None:
        log.info("ep_fuse: %s keeps HF's continuous-batching attention mask (%s)", type(model).__name__, reason)
        return False
    _ENABLED[id(model.config)] = model
    if force:
        _FORCED.add(model)
    return True


def disable(model: Any) -> None:
    """Let ``model``'s continuous batching build HF's attention mask again (the wrapper stays installed)."""
    config = getattr(model, "config", None)
    if config is not None and _ENABLED.get(id(config)) is model:
        del _ENABLED[id(config)]
    _FORCED.discard(model)

"""Hugging Face continuous batching (CB) compiled as one graph per forward.

HF's paged KV cache (``PagedAttentionCache.update``) is ``@torch.compiler.disable``: under ``torch.compile``
every attention layer ends one graph and the next starts after it, so a 2-layer model is 5+ graphs, fusions
across the break (the residual add + the next layer's RMSNorm) are lost, and each piece is captured and
compiled on its own. :func:`install` (called by :func:`ep_fuse.prepare`) replaces that method by a traceable
one that keeps HF's bookkeeping of the kwargs in Python and does the cache write/read in one opaque
``torch.library`` op, ``ep_fuse_hf::paged_kv_update`` (or ``paged_kv_write`` when the batch reads no cache),
with the cache tensor declared mutated (``Tensor(a!)``) and a fake impl: Dynamo keeps it in the graph,
AOTAutograd functionalizes it (``auto_functionalized``) and Inductor re-inplaces it.

Only the index-based update of HF's full-attention and sliding-window allocators is replaced, for caches whose
per-layer views were checked at construction to be the rows ``[offset:]`` of one ``[tokens, H, D]`` view of the
allocator's cache tensor, and that of transformers 5.25's MLA allocator (``paged_latent_update``: one row
``latent | rope`` per token, the layer's views the column slices of its rows); everything else (the block-table
decode fast path, other allocators) runs HF's own method (a graph break, as before). :func:`cb_compile_configs` gives the ``CompileConfig`` pair for both paths.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ep_fuse.ops.registry import define_op

log = logging.getLogger("ep_fuse")

NAMESPACE = "ep_fuse_hf"
OFFSETS_ATTR = "ep_fuse_kv_offsets"
"""Attribute set on an allocator whose layer views were checked: ``{layer_idx: (k_row, v_row)}``."""


def _kv_views(cache: torch.Tensor, k_row: int, v_row: int) -> tuple[torch.Tensor, torch.Tensor]:
    flat = cache.view(-1, cache.shape[-2], cache.shape[-1])
    return flat[k_row:], flat[v_row:]


def _update_impl(cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, read_index: torch.Tensor,
                 write_index: torch.Tensor, k_row: int, v_row: int, sentinel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Write ``key``/``value`` [T, H, D] at ``write_index`` and return the rows at ``read_index`` [N, H, D].

    ``sentinel < 0``: full attention (write, then read). Otherwise sliding window: read first, put the new
    states where ``read_index == sentinel``, then write (new rows may overwrite old ones in the window)."""
    k_cache, v_cache = _kv_views(cache, k_row, v_row)
    if sentinel < 0:
        k_cache.index_copy_(0, write_index, key)
        v_cache.index_copy_(0, write_index, value)
        return torch.index_select(k_cache, 0, read_index), torch.index_select(v_cache, 0, read_index)
    mask = (read_index == sentinel).unsqueeze(-1).unsqueeze(-1)
    k_out = torch.index_select(k_cache, 0, read_index).masked_scatter_(mask, key)
    v_out = torch.index_select(v_cache, 0, read_index).masked_scatter_(mask, value)
    k_cache.index_copy_(0, write_index, key)
    v_cache.index_copy_(0, write_index, value)
    return k_out, v_out


def _update_fake(cache, key, value, read_index, write_index, k_row, v_row, sentinel):
    # rows of the cache (its dtype and device), whose head count and dim are the written states': those are static
    # sizes of the projections, where the cache's own are symbolic under dynamic=True (a kernel choosing by head
    # dim would see a symbol)
    return cache.new_empty((read_index.shape[0], *key.shape[-2:])), cache.new_empty((read_index.shape[0],
                                                                                      *value.shape[-2:]))


def _write_impl(cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, write_index: torch.Tensor,
                k_row: int, v_row: int) -> None:
    """Write ``key``/``value`` [T, H, D] at ``write_index`` (a batch that reads no cached rows)."""
    k_cache, v_cache = _kv_views(cache, k_row, v_row)
    k_cache.index_copy_(0, write_index, key)
    v_cache.index_copy_(0, write_index, value)


def _write_fake(cache, key, value, write_index, k_row, v_row):
    return None


paged_kv_update = define_op(
    NAMESPACE, "paged_kv_update",
    "(Tensor(a!) cache, Tensor key, Tensor value, Tensor read_index, Tensor write_index, int k_row, int v_row, "
    "int sentinel) -> (Tensor, Tensor)",
    _update_impl, _update_fake)
paged_kv_write = define_op(
    NAMESPACE, "paged_kv_write",
    "(Tensor(a!) cache, Tensor key, Tensor value, Tensor write_index, int k_row, int v_row) -> ()",
    _write_impl, _write_fake)


def _latent_views(cache: torch.Tensor, row: int, split: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = cache[row:]
    return rows[:, :split], rows[:, split:]


def _latent_update_impl(cache: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor, read_index: torch.Tensor,
                        write_index: torch.Tensor, row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA's compressed cache (transformers 5.25's ``MLACacheAllocator``): one row ``latent | rope`` per token of
    ``cache`` [tokens, R + P], the layer's rows from ``row``. Write ``latent`` [T, 1, R] and ``rope`` [T, 1, P] at
    ``write_index``, return both latents at ``read_index`` ([N, 1, R], [N, 1, P])."""
    _latent_write_impl(cache, latent, rope, write_index, row)
    lat_cache, rope_cache = _latent_views(cache, row, latent.shape[-1])
    return (torch.index_select(lat_cache, 0, read_index).unsqueeze(1),
            torch.index_select(rope_cache, 0, read_index).unsqueeze(1))


def _latent_update_fake(cache, latent, rope, read_index, write_index, row):
    return (cache.new_empty((read_index.shape[0], *latent.shape[-2:])),
            cache.new_empty((read_index.shape[0], *rope.shape[-2:])))


def _latent_write_impl(cache: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor, write_index: torch.Tensor,
                       row: int) -> None:
    """Write the latents at ``write_index`` (a batch that reads no cached rows)."""
    lat_cache, rope_cache = _latent_views(cache, row, latent.shape[-1])
    lat_cache.index_copy_(0, write_index, latent.flatten(1))
    rope_cache.index_copy_(0, write_index, rope.flatten(1))


def _latent_write_fake(cache, latent, rope, write_index, row):
    return None


paged_latent_update = define_op(
    NAMESPACE, "paged_latent_update",
    "(Tensor(a!) cache, Tensor latent, Tensor rope, Tensor read_index, Tensor write_index, int row) "
    "-> (Tensor, Tensor)",
    _latent_update_impl, _latent_update_fake)
paged_latent_write = define_op(
    NAMESPACE, "paged_latent_write",
    "(Tensor(a!) cache, Tensor latent, Tensor rope, Tensor write_index, int row) -> ()",
    _latent_write_impl, _latent_write_fake)


def latent_offsets(allocator: Any) -> dict[int, tuple[int, int]] | None:
    """``{layer: (row, kv_lora_rank)}`` if every per-layer latent view HF made is ``cache[row:, :R]`` /
    ``cache[row:, R:]`` of the allocator's ``[tokens, R + P]`` cache tensor, else None."""
    cache = getattr(allocator, "cache_tensor", None)
    views = getattr(allocator, "_latent_token_views", None)
    split = getattr(allocator, "kv_lora_rank", None)
    if (not isinstance(cache, torch.Tensor) or cache.dim() != 2 or not cache.is_contiguous() or not views
            or not isinstance(split, int) or not 0 < split < cache.shape[1]):
        return None
    offsets = {}
    for layer, pair in views.items():
        lat = pair[0]
        delta = lat.storage_offset() - cache.storage_offset()
        if delta % cache.stride(0) or lat.untyped_storage().data_ptr() != cache.untyped_storage().data_ptr():
            return None
        row = delta // cache.stride(0)
        want = _latent_views(cache, row, split)
        if any(v.dtype != w.dtype or v.shape != w.shape or v.stride() != w.stride()
               or v.storage_offset() != w.storage_offset() for v, w in zip(pair, want)):
            return None
        offsets[int(layer)] = (row, split)
    return offsets


def _layer_offsets(allocator: Any) -> dict[int, tuple[int, int]] | None:
    """``{layer: (k_row, v_row)}`` if every per-layer view HF made is ``flat[row:]`` of ``cache_tensor``, else None."""
    cache = getattr(allocator, "cache_tensor", None)
    views = getattr(allocator, "_kv_token_views", None)
    if not isinstance(cache, torch.Tensor) or cache.dim() != 4 or not cache.is_contiguous() or not views:
        return None
    flat = cache.view(-1, cache.shape[-2], cache.shape[-1])
    row = flat.stride(0)
    offsets = {}
    for layer, pair in views.items():
        rows = []
        for view in pair:
            delta = view.storage_offset() - flat.storage_offset()
            if (view.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr() or delta % row
                    or view.dtype != flat.dtype or view.stride() != flat.stride()):
                return None
            rows.append(delta // row)
            if view.shape != flat[rows[-1]:].shape:
                return None
        offsets[int(layer)] = (rows[0], rows[1])
    return offsets


def _traceable_update(original: Any, self: Any, key_states: torch.Tensor, value_states: torch.Tensor,
                      layer_idx: int, kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's ``PagedAttentionCache.update`` with the cache write/read as one opaque op (same results)."""
    allocator = self.layer_to_allocator[layer_idx]
    offsets = getattr(allocator, OFFSETS_ATTR, None)
    if offsets is None or layer_idx not in offsets or kwargs.get("block_table") is not None:
        return original(self, key_states, value_states, layer_idx, kwargs)
    kwargs["cu_seq_lens_k"] = kwargs["cu_seq_lens_k"][allocator.layer_type].to(torch.int32)
    kwargs["max_length_k"] = kwargs["max_length_k"][allocator.layer_type]
    read_index = kwargs["read_index"][allocator.index]
    write_index = kwargs["write_index"][allocator.index]
    k_row, v_row = offsets[layer_idx]
    key, value = (x.squeeze(0).transpose(0, 1) for x in (key_states, value_states))
    if getattr(allocator, "ep_fuse_latents", False):  # MLA: (row, kv_lora_rank)
        if read_index.numel() == 0:
            paged_latent_write(allocator.cache_tensor, key, value, write_index, k_row)
            return key_states, value_states
        key, value = paged_latent_update(allocator.cache_tensor, key, value, read_index, write_index, k_row)
        return key.transpose(0, 1).unsqueeze(0), value.transpose(0, 1).unsqueeze(0)
    if read_index.numel() == 0:
        paged_kv_write(allocator.cache_tensor, key, value, write_index, k_row, v_row)
        return key_states, value_states
    sentinel = allocator.sentinel_index if getattr(allocator, "ep_fuse_sliding", False) else -1
    key, value = paged_kv_update(allocator.cache_tensor, key, value, read_index, write_index, k_row, v_row, sentinel)
    return key.transpose(0, 1).unsqueeze(0), value.transpose(0, 1).unsqueeze(0)


def _checked_init(original_init: Any, self: Any, *args: Any, **kwargs: Any) -> None:
    original_init(self, *args, **kwargs)
    from transformers.generation.continuous_batching.cache_allocators.full_attention import (  # optional dependency
        FullAttentionCacheAllocator)
    from transformers.generation.continuous_batching.cache_allocators.sliding_attention import (
        SlidingAttentionCacheAllocator)

    try:  # transformers >= 5.25: MLA layers cache their compressed latents
        from transformers.generation.continuous_batching.cache_allocators import MLACacheAllocator
    except ImportError:
        MLACacheAllocator = None  # noqa: N806

    for name, allocator in getattr(self, "cache_allocators", {}).items():
        latents = MLACacheAllocator is not None and type(allocator) is MLACacheAllocator
        if not latents and type(allocator) not in (FullAttentionCacheAllocator, SlidingAttentionCacheAllocator):
            log.warning("ep_fuse: continuous-batching allocator %r (%s) is not one ep_fuse knows; its layers "
                        "keep HF's compiler-disabled cache update (one graph break per layer)",
                        name, type(allocator).__name__)
            continue
        offsets = latent_offsets(allocator) if latents else _layer_offsets(allocator)
        if offsets is None:
            log.warning("ep_fuse: the KV views of continuous-batching allocator %r are not row offsets of one "
                        "cache tensor; its layers keep HF's compiler-disabled cache update", name)
            continue
        setattr(allocator, OFFSETS_ATTR, offsets)
        allocator.ep_fuse_sliding = type(allocator) is SlidingAttentionCacheAllocator
        allocator.ep_fuse_latents = latents


_ORIGINALS: dict[str, Any] = {}

BACKEND = "ep_fuse"
"""The ``CompileConfig.backend`` whose compiled CB forwards :func:`compiled_cb_forward` wraps (in ``ModelRunner``)."""


def _storage_slices(batch_data: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors of ``batch_data`` that are slices of HF's preallocated per-IO storages (``t._base`` set)."""
    out: list[torch.Tensor] = []
    for value in batch_data.values():
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
        out.extend(t for t in items if isinstance(t, torch.Tensor) and t._base is not None)
    return out


def compiled_cb_forward(compiled: Any) -> Any:
    """``compiled`` (HF's ``torch.compile`` of ``ModelRunner._forward_process_and_sample``) called so that a CB
    forward is traced once and its one graph serves every later batch.

    * Floats as constants (``torch._dynamo.config.specialize_float``, thread-local, only around this call):
      under ``dynamic=True`` Dynamo turns the model's float attributes into symbolic floats, and one it cannot
      tensorify away makes it trace the whole forward a second time ("Restarting analysis due to
      _tensorify_python_scalars"). Two always do: ``nn.Embedding.forward`` hands ``self.norm_type`` to
      ``F.embedding`` where it is dead code without ``max_norm`` (torch's code), and the attention ``scaling``
      must be a Python float for ``ep_fuse::varlen_attention`` (FlashAttention's ``softmax_scale``), which
      specializes it (a guard, hence the restart). These floats are fixed per model: nothing is lost.
    * Slice sizes not duck-shaped (``maybe_mark_dynamic`` on the slices of HF's preallocated storages: the
      padded ``read_index`` / ``write_index`` / ``input_ids`` ... of this batch): Dynamo gives equal sizes one
      symbol, so a first batch whose padded sizes fill the storage (``read_index`` = the whole row of
      ``read_index_storage``: ``max_batch_tokens`` query tokens, as HF's warmup or a full first batch has)
      compiles a graph guarded on ``read_index._base.size()[1] == read_index.size()[0]``, and every smaller
      batch recompiles."""
    def forward(model: Any, batch_data: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        for t in _storage_slices(batch_data):
            dims = [d for d in range(t.dim()) if t.shape[d] > 1]
            if dims:
                torch._dynamo.maybe_mark_dynamic(t, dims)
        with torch._dynamo.config.patch(specialize_float=True):
            return compiled(model, batch_data, *args, **kwargs)

    forward.__wrapped__ = compiled
    forward.ep_fuse_cb_forward = True
    return forward


def _wrap_compiled_forwards(original_init: Any, self: Any, *args: Any, **kwargs: Any) -> None:
    original_init(self, *args, **kwargs)
    cb_config = getattr(self, "cb_config", None)
    for attr, cfg_name in (("_compiled_varlen", "varlen_compile_config"), ("_compiled_decode", "decode_compile_config")):
        compiled, cfg = getattr(self, attr, None), getattr(cb_config, cfg_name, None)
        if compiled is not None and getattr(cfg, "backend", None) == BACKEND:
            setattr(self, attr, compiled_cb_forward(compiled))


def install() -> bool:
    """Route HF continuous batching's paged cache update through :data:`paged_kv_update` and the forwards it
    compiles with ``backend="ep_fuse"`` through :func:`compiled_cb_forward` (process-wide, idempotent).

    Returns False when this transformers has no continuous batching (nothing to do)."""
    try:
        from transformers.generation.continuous_batching.cache import PagedAttentionCache  # optional dependency
    except ImportError:
        return False
    if _ORIGINALS:
        return True
    from transformers.generation.continuous_batching.model_runner import ModelRunner  # same release as the cache

    update, init, runner_init = PagedAttentionCache.update, PagedAttentionCache.__init__, ModelRunner.__init__
    _ORIGINALS.update(update=update, init=init, runner_init=runner_init)

    def update_in_graph(self, key_states, value_states, layer_idx, kwargs):
        # delegating to HF's (compiler-disabled) method keeps its graph break where the op does not apply
        return _traceable_update(update, self, key_states, value_states, layer_idx, kwargs)

    def init_checked(self, *args, **kwargs):
        _checked_init(init, self, *args, **kwargs)

    def runner_init_wrapping(self, *args, **kwargs):
        _wrap_compiled_forwards(runner_init, self, *args, **kwargs)

    update_in_graph.__doc__ = _traceable_update.__doc__
    init_checked.__doc__ = init.__doc__
    runner_init_wrapping.__doc__ = runner_init.__doc__
    PagedAttentionCache.update = update_in_graph
    PagedAttentionCache.__init__ = init_checked
    # the forwards HF compiles with backend="ep_fuse" run through compiled_cb_forward (one trace, one graph)
    ModelRunner.__init__ = runner_init_wrapping
    log.info("ep_fuse: continuous batching's paged KV-cache update runs as %s::paged_kv_update (one graph per "
             "forward)", NAMESPACE)
    return True


def uninstall() -> None:
    """Restore HF's own ``PagedAttentionCache.update`` / ``__init__`` and ``ModelRunner.__init__`` (caches and
    runners made since keep their offsets and wrapped forwards)."""
    if not _ORIGINALS:
        return
    from transformers.generation.continuous_batching.cache import PagedAttentionCache  # optional dependency
    from transformers.generation.continuous_batching.model_runner import ModelRunner

    PagedAttentionCache.update = _ORIGINALS.pop("update")
    PagedAttentionCache.__init__ = _ORIGINALS.pop("init")
    ModelRunner.__init__ = _ORIGINALS.pop("runner_init")


CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
"""Inductor modes that capture CUDA graphs (``torch._inductor.list_mode_options``: ``triton.cudagraphs``)."""


def cb_compile_configs(options: dict[str, Any] | None = None, mode: str | None = None,
                       dynamic: bool | None = True) -> tuple[Any, Any]:
    """The ``(varlen_compile_config, decode_compile_config)`` pair compiling both CB paths with ep_fuse.

    ``dynamic=True`` (as HF's own default compile): the padded query and KV sizes vary from batch to batch, and
    with ``None`` (automatic dynamic) the first sizes compile static graphs before the dynamic one (3 graphs per
    path instead of 1, each paying a full compile).

    ``options`` are ep_fuse's backend options (``EpFuseConfig``). CUDA-graph modes are refused: Inductor's
    CUDA-graph trees do not run in CB's generation thread; HF captures its own graphs of the padded sizes
    (``ContinuousBatchingConfig(use_cuda_graph=True)``) around the compiled forward instead."""
    from transformers.generation.configuration_utils import CompileConfig  # optional dependency

    opts = dict(options or {})
    mode = opts.pop("mode", mode)
    if mode in CUDA_GRAPH_MODES:
        raise ValueError(
            f"ep_fuse: mode={mode!r} captures CUDA graphs with Inductor's CUDA-graph trees, which do not run in "
            "continuous batching's generation thread; use mode='default' (or 'max-autotune-no-cudagraphs') and "
            "let HF capture the graphs: ContinuousBatchingConfig(use_cuda_graph=True)")
    if mode not in (None, "default"):
        opts["mode"] = mode
    install()

    def one() -> Any:
        # HF's CompileConfig defaults to mode="reduce-overhead"; torch.compile takes mode or options, not both;
        # options must be a dict (HF's CUDA-graph decision reads `options.get(...)` when the mode is None)
        return CompileConfig(backend=BACKEND, fullgraph=False, dynamic=dynamic, mode=None, options=opts)

    return one(), one()

"""Preparing a model for ep_fuse: :func:`prepare` (make an HF transformers MoE model traceable as one graph) and
:func:`dynamic_batch` (mark the batch dim of its inputs so that batch sizes share a graph)."""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

import torch

from ep_fuse.hf.expert_parallel import prepare_loaded as prepare_hf_expert_parallel
from ep_fuse.hf.hub_kernels import restore_plain_forwards
from ep_fuse.hf.paged_attention import install as install_paged_cache_update
from ep_fuse.hf.varlen_attention import enable as enable_varlen_attention
from ep_fuse.surgery.expert_loops import convert_expert_loops, report_refusal
from ep_fuse.surgery.fp8_experts import convert_fp8_experts
from ep_fuse.surgery.hookless_experts import convert_hookless_experts
from ep_fuse.surgery.inference_mode import unwrap_inference_mode
from ep_fuse.surgery.moe_semantics import convert_semantic_blocks

log = logging.getLogger("ep_fuse")

TRACEABLE_EXPERTS = ("grouped_mm", "batched_mm")


def prepare(model: Any, experts_implementation: str = "grouped_mm", strict: bool = False) -> Any:
    """Make an HF transformers MoE model traceable as one graph; returns the model (changed in place).

    * transformers 5.x models: the default per-expert loop (``experts_implementation="eager"``) breaks
      the graph 10+ times and hides the expert GEMMs from any backend;
      ``grouped_mm`` (default) or ``batched_mm`` trace to one graph.
    * MoE blocks that hold their experts as an ``nn.ModuleList`` of SwiGLU MLPs and loop over them in
      Python (remote code such as DeepSeek-V3's ``modeling_deepseek.py``, Mixtral / Qwen2-MoE of
      transformers 4.x): the experts are stacked once into 3-D weights run by the same
      ``experts_implementation`` and the loop is replaced (:mod:`ep_fuse.surgery.expert_loops`); the state
      dict keeps its per-expert keys. Blocks of other layouts (routing in a method of the block or in a
      gate module of any kind, the list under another name) are recognised by tracing what they compute
      (:mod:`ep_fuse.surgery.loop_dataflow`); their router code is kept. Each conversion is logged at INFO; a block that cannot be
      converted is left as it is with a WARNING giving the reason, or, with ``strict=True``, raises
      ``ValueError``.
    * transformers' ``FP8Experts`` (FP8 checkpoints such as DeepSeek-V3): their forward needs the
      ``kernels-community/finegrained-fp8`` hub kernel; they get a forward that dequantizes the
      block-scaled weights (``ep_fuse::fp8_block_dequant``) and runs the same ``experts_implementation``
      (:mod:`ep_fuse.surgery.fp8_experts`). Compile with ``quant="fp8_block"`` to run them in FP8.
    * 3-D experts without transformers' experts-implementation switch (an eager loop over the hit experts: Step-3.7,
      Gemma-4 where its version lacks the hook): they run the same ``experts_implementation`` once it reproduced
      their own forward (:mod:`ep_fuse.surgery.hookless_experts`).
    * continuous batching (``generate_batch``, ``transformers serve``): HF's paged KV-cache update, a graph
      break per layer, becomes one opaque op so each forward is one graph
      (:mod:`ep_fuse.hf.paged_attention`; process-wide, idempotent), and where every layer can take it and
      a fused provider runs it (CUDA, fp16/bf16), its SDPA over a dense host-built ``[tokens, keys read]`` mask
      becomes ``ep_fuse::varlen_attention`` over each request's own keys, no mask built
      (:mod:`ep_fuse.hf.varlen_attention`).
    * ``@torch.inference_mode()`` forwards (torch 2.13 cannot compile them when an output views an input) run
      the undecorated forward under ``torch.no_grad()`` (:mod:`ep_fuse.surgery.inference_mode`).

    Models without experts are returned unchanged.
    """
    if experts_implementation not in TRACEABLE_EXPERTS:
        raise ValueError(
            f"ep_fuse.prepare: experts_implementation={experts_implementation!r}; use one of {TRACEABLE_EXPERTS} "
            "(the eager per-expert loop cannot be captured as one graph)"
        )
    prepare_hf_expert_parallel(model)  # HF's native EP (ep_implementation="ep_fuse"): for_inference, every rank
    restore_plain_forwards(model)  # transformers' Hub kernels on layers ep_fuse fuses (add+RMSNorm, RoPE, SwiGLU)
    setter = getattr(model, "set_experts_implementation", None)
    can_set = getattr(model, "_can_set_experts_implementation", None)
    switched = setter is not None and not (callable(can_set) and not _safe(can_set))
    if switched:
        setter(experts_implementation)
        log.info("ep_fuse.prepare: %s uses experts_implementation=%s", type(model).__name__, experts_implementation)
    unwrapped = unwrap_inference_mode(model, strict)
    fp8 = convert_fp8_experts(model, experts_implementation, strict)
    hookless = convert_hookless_experts(model, experts_implementation, strict)
    install_paged_cache_update()
    enable_varlen_attention(model)
    loops = convert_expert_loops(model, experts_implementation, strict, report_refusals=False)
    semantic = _convert_semantic(model, experts_implementation, loops, strict)
    if not (loops or semantic or switched or fp8 or hookless or unwrapped):
        log.info("ep_fuse.prepare: %s has no switchable experts and no per-expert loops; unchanged",
                 type(model).__name__)
    return model


def _convert_semantic(model: Any, implementation: str, loops: list[Any], strict: bool) -> list[Any]:
    """MoE blocks of any spelling recognised by what they compute (:mod:`ep_fuse.surgery.moe_semantics`), after the
    known loop forms; a loop block refused by both is reported once, with both reasons."""
    if not isinstance(model, torch.nn.Module):
        return []
    converted = {id(c.block) for c in loops if c.converted}
    refused = {id(c.block): c for c in loops if not c.converted}
    semantic = convert_semantic_blocks(model, implementation, skip=converted, strict=strict,
                                       quiet=set(refused))
    by_block = {s.block_id: s for s in semantic}
    for key, loop in refused.items():
        other = by_block.get(key)
        if other is not None and other.converted:
            continue
        reason = loop.reason if other is None else f"{loop.reason}; by what it computes: {other.reason}"
        report_refusal(loop.path, loop.block, reason, strict)
    return semantic


def _safe(fn: Any) -> bool:
    try:
        return bool(fn())
    except Exception:
        return False


BATCH_SHAPE_ID = "ep_fuse_batch"
"""The ``shape_id`` under which :func:`dynamic_batch` marks every batch dim (one unbacked size)."""


def dynamic_batch(inputs: dict[str, Any], names: tuple[str, ...] = ("input_ids", "inputs_embeds", "position_ids",
                                                                    "attention_mask"),
                  force: bool = False) -> dict[str, Any]:
    """Mark the batch dim of a Hugging Face model's inputs so that batch 1 and larger batches share a graph.

    ``torch.compile(..., dynamic=True)`` (and automatic dynamic) specialise sizes 0 and 1: a batch of 1
    and a batch of 3 get different graphs, and so do 1 token and 7 tokens. HF models also branch on
    ``length > 1`` (``is_causal`` of SDPA), so decode (length 1) and prefill need two graphs anyway; the
    batch is what can be shared. This marks the batch dim of each tensor in ``names`` unbacked
    (``torch._dynamo.decorators.mark_unbacked``), all with one ``shape_id`` so they are one size.
    Without a cache HF expands ``position_ids`` ``[1, S]`` to the batch when ``batch != 1`` -- a branch on
    the batch size -- so ``position_ids`` ``[B, S]`` (``arange(S)``, what HF computes) are added when the
    inputs have neither ``position_ids`` nor ``past_key_values``. A KV cache's batch dim is not marked.

    On CUDA the batch is marked only while cuDNN's SDPA backend is off
    (``torch.backends.cuda.enable_cudnn_sdp(False)``) or with ``force=True``; otherwise it is left unmarked,
    with a WARNING. Measured on a GPU with torch 2.11 (``docs/benchmarks.md``), the cuDNN backend guards on the unbacked batch
    (``Eq(u0, 1)``) whenever the attention has a mask, which breaks the graph at every attention layer for
    ``backend="ep_fuse"`` and ``backend="inductor"`` alike (20 graphs for a 2-layer model over the sequence of
    ``experiments/2026-12/check_dynamic.py`` instead of 4 with plain ``dynamic=True``; ``docs/benchmarks.md#dynamic-shapes``).
    With cuDNN's SDPA off both backends compiled 2 graphs there (``docs/benchmarks.md``).

    Call it on the inputs of every call (marks live on the tensors); returns ``inputs`` (updated in place).
    """
    ids = inputs.get("input_ids", inputs.get("inputs_embeds"))
    if ids is None:
        raise ValueError("ep_fuse.dynamic_batch: the inputs have neither input_ids nor inputs_embeds")
    if not (force or batch_can_be_unbacked(ids.device.type)):
        _warn_cuda_once()
        return inputs
    if "position_ids" not in inputs and inputs.get("past_key_values") is None:
        b, s = ids.shape[:2]
        inputs["position_ids"] = torch.arange(s, device=ids.device).expand(b, s).contiguous()
    mark = torch._dynamo.decorators.mark_unbacked
    shared = "shape_id" in inspect.signature(mark).parameters
    if not shared:
        log.warning("ep_fuse.dynamic_batch: this torch has no mark_unbacked(shape_id=...); the batch dims of "
                    "%s become separate sizes and HF's batch checks may break the graph", ", ".join(names))
    for name in names:
        t = inputs.get(name)
        if isinstance(t, torch.Tensor) and t.dim() >= 1:
            if shared:
                mark(t, 0, shape_id=BATCH_SHAPE_ID)
            else:
                mark(t, 0)
    return inputs


def batch_can_be_unbacked(device_type: str) -> bool:
    """Whether an unbacked batch traces without a graph break on ``device_type``: everywhere but CUDA with
    cuDNN's SDPA backend on (it guards ``Eq(u0, 1)`` on masked calls, torch 2.11)."""
    return device_type != "cuda" or not torch.backends.cuda.cudnn_sdp_enabled()


@functools.lru_cache(maxsize=1)
def _warn_cuda_once() -> None:
    log.warning("ep_fuse.dynamic_batch: batch dims left unmarked on CUDA: cuDNN's SDPA guards on an unbacked "
                "batch when attention has a mask and breaks the graph at every attention layer (torch 2.11). "
                "Call torch.backends.cuda.enable_cudnn_sdp(False) before compiling (the batch is then "
                "marked), or use torch.compile(..., dynamic=True) without dynamic_batch.")

"""The Triton provider of the router family (``moe_gating``, ``moe_gating_sink``): argument checks, output
allocation, launch, perf rules and registration.

The kernels implement :func:`ep_fuse.ops.moe_gating.moe_gating_stable_ref` and
:func:`ep_fuse.ops.moe_gating.moe_gating_sink_stable_ref` (stable ties);
see :mod:`ep_fuse.providers.triton.moe_gating_kernel`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ep_fuse.ops import moe_gating as ops
from ep_fuse.ops.moe_gating import check_gating_args, check_sink_args
from ep_fuse.providers.measured import Threshold
from ep_fuse.providers.tensor_checks import contiguous, static_rows
from ep_fuse.providers.triton.provider import register
from ep_fuse.providers.triton.unverified import gpu_unverified

log = logging.getLogger("ep_fuse.providers")

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
WEIGHT_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)
MAX_EXPERTS = 2048
"""Widest expert row held in registers (one token per program at this width)."""
MAX_TOP_K = 32
MAX_GROUPS = 64
"""Top-k and group loops are unrolled: bound the generated code."""


def check_gating_call(args: tuple[Any, ...]) -> str | None:
    """``None`` when the Triton kernel can run these ``moe_gating`` arguments, else why not."""
    logits, bias, top_k, score, n_group, topk_group, group_score, _renorm, _eps, _scale, weight_dtype = args[:11]
    expert_scale = args[12] if len(args) > 12 else None
    if len(args) > 13 and args[13] not in (None, torch.float32):
        return f"scores computed in {args[13]} (the kernel computes them in fp32; the reference rounds as the model)"
    if logits.dim() > 2:  # [..., E] (Zaya): run as rows; the kernel needs them to be one [T, E] view
        if not contiguous(logits):
            return f"logits of shape {list(logits.shape)} do not view as [T, E] rows (not contiguous)"
        reason = gpu_unverified("moe_gating:nd_logits", logits)
        if reason is not None:
            return reason
        logits = logits.reshape(-1, logits.shape[-1])
    try:
        check_gating_args(logits, bias, top_k, score, n_group, topk_group, group_score, expert_scale)
    except ValueError as exc:
        return str(exc)
    if logits.dtype not in LOGIT_DTYPES:
        return f"logits dtype {logits.dtype} is not fp32/bf16/fp16"
    e = logits.shape[1]
    if not statically_known_true(e <= MAX_EXPERTS):
        return f"{e} experts (the kernel holds at most {MAX_EXPERTS} per row)"
    if top_k > MAX_TOP_K or n_group > MAX_GROUPS:
        return f"top-{top_k} of {n_group} groups (unrolled loops are bounded at {MAX_TOP_K} / {MAX_GROUPS})"
    if not (statically_known_true(e == 1) or statically_known_true(logits.stride(1) == 1)):
        return "expert logits are not unit-stride"
    if bias is not None and (bias.dtype not in LOGIT_DTYPES or not statically_known_true(bias.stride(0) == 1)):
        return "bias is not a unit-stride floating vector"
    if bias is not None and score in ops.TOPK_FIRST and torch.promote_types(logits.dtype, bias.dtype) != torch.float32:
        return (f"selection on {logits.dtype} logits + {bias.dtype} bias rounds in "
                f"{torch.promote_types(logits.dtype, bias.dtype)} (the kernel adds in fp32)")
    if expert_scale is not None and (expert_scale.dtype not in LOGIT_DTYPES
                                     or not statically_known_true(expert_scale.stride(0) == 1)):
        return "expert_scale is not a unit-stride floating vector"
    if weight_dtype not in WEIGHT_DTYPES:
        return f"weight dtype {weight_dtype}"
    variants = (score, group_score, *(("renorm_clamp",) if len(args) > 11 and args[11] else ()),
                *(("expert_scale",) if expert_scale is not None else ()),
                *(("topk_bias",) if bias is not None and score in ops.TOPK_FIRST else ()),
                *((f"{score}_{group_score}",) if score == "softmax" and group_score == "sum_top2_fill0" else ()))
    for variant in variants:  # each is a kernel variant of its own (unverified.py)
        reason = gpu_unverified(f"moe_gating:{variant}", logits)
        if reason is not None:
            return reason
    return None


def moe_gating_kernel(logits, bias, top_k, score, n_group, topk_group, group_score, renormalize, renorm_eps,
                      scale, weight_dtype, renorm_clamp=False, expert_scale=None, score_dtype=None,
                      wrap=None):  # noqa: ANN001, ANN201 - schema-typed
    """``ep_fuse_triton::moe_gating``: ``(weights [T, K], ids [T, K] int64)``; ``[..., E]`` logits give
    ``[..., K]`` (the rows of one contiguous view)."""
    if logits.dim() > 2:
        lead = logits.shape[:-1]
        weights, ids = moe_gating_kernel(logits.reshape(-1, logits.shape[-1]), bias, top_k, score, n_group,
                                         topk_group, group_score, renormalize, renorm_eps, scale, weight_dtype,
                                         renorm_clamp, expert_scale, wrap=wrap)
        return weights.view(*lead, top_k), ids.view(*lead, top_k)
    from ep_fuse.providers.triton.moe_gating_kernel import launch  # imports triton: on first launch

    t = logits.shape[0]
    weights = torch.empty((t, top_k), dtype=weight_dtype or torch.float32, device=logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=logits.device)
    if isinstance(t, int) and t == 0:
        return weights, ids
    launch(logits, bias, weights, ids, top_k, score, n_group, topk_group, group_score, renormalize,
           renorm_eps, scale, renorm_clamp=renorm_clamp, expert_scale=expert_scale, wrap=wrap)
    return weights, ids


GATING_MIN_TOKENS = Threshold(
    2048, command="python bench/bench_moe.py",
    evidence="the fused gating kernel vs Inductor's router code: 4.2x (Mixtral softmax, T4096 E8 k2), 5.0x (Qwen3-MoE, "
             "T4096 E128 k8), 1.85x (DeepSeek-V3 grouped sigmoid, T4096 E256 k8), but 0.75x at T128 (too few tokens "
             "to fill the GPU); unmeasured between 128 and 4096 tokens")
"""Below this many tokens the provider declines under Inductor."""


def gating_prefers(args: tuple[Any, ...], executor: str) -> str | None:
    if executor != "inductor":  # the eager router ops measured slower at every size (64.3 vs 51.2 us at T128)
        return None
    rows = static_rows(args[0])
    if rows is None:  # no run-time alternative is faster than the kernel (see the module docstring)
        return None
    if rows < GATING_MIN_TOKENS:
        return f"{rows} tokens: Inductor's router code measured faster at decode sizes (0.75x at 128)"
    return None


register(ops.moe_gating, moe_gating_kernel, supports=check_gating_call, prefers=gating_prefers, symbolic=True)


MAX_SHARED = 32
"""Shared experts of a sink router (an unrolled loop)."""


def check_sink_call(args: tuple[Any, ...]) -> str | None:
    """``None`` when the Triton sink kernel can run these ``moe_gating_sink`` arguments, else why not."""
    logits, bias, top_k, n_shared, _scale, global_scale, weight_dtype = args[:7]
    try:
        check_sink_args(logits, bias, top_k, n_shared, global_scale)
    except ValueError as exc:
        return str(exc)
    if logits.dtype not in LOGIT_DTYPES:
        return f"logits dtype {logits.dtype} is not fp32/bf16/fp16"
    if not statically_known_true(logits.shape[1] <= MAX_EXPERTS):
        return f"{logits.shape[1]} router classes (the kernel holds at most {MAX_EXPERTS} per row)"
    if top_k > MAX_TOP_K or n_shared > MAX_SHARED:
        return f"top-{top_k} with {n_shared} shared experts (unrolled loops are bounded at {MAX_TOP_K} / {MAX_SHARED})"
    if not statically_known_true(logits.stride(1) == 1):
        return "router logits are not unit-stride"
    if bias is not None and (bias.dtype not in LOGIT_DTYPES or not statically_known_true(bias.stride(0) == 1)):
        return "bias is not a unit-stride floating vector"
    if global_scale is not None and global_scale.dtype not in LOGIT_DTYPES:
        return f"global_scale dtype {global_scale.dtype}"
    if weight_dtype not in WEIGHT_DTYPES:
        return f"weight dtype {weight_dtype}"
    return gpu_unverified("moe_gating_sink:triton", logits)


def moe_gating_sink_kernel(logits, bias, top_k, n_shared, scale, global_scale, weight_dtype,
                           wrap=None):  # noqa: ANN001, ANN201 - schema-typed
    """``ep_fuse_triton::moe_gating_sink``: ``(weights [T, K + S], ids [T, K] int64)``."""
    from ep_fuse.providers.triton.moe_gating_kernel import launch_sink  # imports triton: on first launch

    t = logits.shape[0]
    weights = torch.empty((t, top_k + n_shared), dtype=weight_dtype or torch.float32, device=logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=logits.device)
    if isinstance(t, int) and t == 0:
        return weights, ids
    launch_sink(logits, bias, global_scale, weights, ids, top_k, n_shared, scale, wrap=wrap)
    return weights, ids


def sink_prefers(args: tuple[Any, ...], executor: str) -> str | None:
    """Under Inductor the sink kernel is not measured against Inductor's code for the same ops: declined there."""
    if executor == "inductor":
        return "not measured against Inductor's router code yet (python bench/bench_moe.py)"
    return None


register(ops.moe_gating_sink, moe_gating_sink_kernel, supports=check_sink_call, prefers=sink_prefers, symbolic=True)

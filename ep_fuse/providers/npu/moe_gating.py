"""Ascend ``moe_gating`` through ``torch_npu.npu_moe_gating_top_k`` (conventions: ``docs/npu.md``).

Conventions used (from the op-plugin docs; **not run on Ascend hardware by this project**; every call is checked
against torch_npu 2.14.0's schema and meta function: ``docs/npu.md``):

* ``npu_moe_gating_top_k(x, k, *, bias, k_group, group_count, group_select_mode, renorm, norm_type,
  out_flag, routed_scaling_factor, eps) -> (y, expert_idx int32, norm_out)``; ``norm_type`` 0 softmax /
  1 sigmoid, in fp32; ``bias`` selects only; ``group_select_mode`` 0 group max / 1 sum of the top 2;
  kept groups and experts by a stable argsort (ties: lowest index, as the Triton kernel); masked
  experts -inf; y = p[ids] without bias; **sigmoid only**: y /= sum(y) + eps; then y *= scale.
* ``renorm`` must be 0, so a softmax router that renormalises (Mixtral, Qwen3-MoE) gets y unscaled
  and divides (then scales) afterwards; a sigmoid router that does *not* renormalise cannot be
  expressed and is declined.
* The logits are passed in fp32 (as sglang does), ids come back int32 and are widened to int64.

Declined where the documented limits do not fit: logits not 2-D, more than 2048 experts,
E / group_count <= 2, k > (E / group_count) * k_group. Within them the result equals
:func:`ep_fuse.ops.moe_gating.moe_gating_stable_ref` except one corner of DeepSeek-V2's
``max`` grouping: HF masks dropped groups to 0.0 (not -inf), which differs only when a kept expert's
probability underflows to exactly 0.0.
"""

from __future__ import annotations

from typing import Any

import torch

from ep_fuse.ops import moe_gating as ops
from ep_fuse.ops.registry import register_provider
from ep_fuse.ops.moe_gating import check_gating_args, finish_weights
from ep_fuse.providers.npu.provider import available, contracts, devices, torch_npu
from ep_fuse.symbolic import concrete_int

MAX_EXPERTS = 2048
GROUP_SELECT_MODES = {"max": 0, "sum_top2": 1, "none": 0}
NORM_TYPES = {"softmax": 0, "sigmoid": 1}


def gating_supports(args: tuple[Any, ...]) -> str | None:
    """``None`` when ``npu_moe_gating_top_k`` (plus a division for softmax renorm) computes this call."""
    logits, bias, top_k, score, n_group, topk_group, group_score, renorm, _eps, _scale, weight_dtype = args[:11]
    expert_scale = args[12] if len(args) > 12 else None
    if len(args) > 13 and args[13] not in (None, torch.float32):
        return f"scores computed in {args[13]} (npu_moe_gating_top_k computes them in fp32)"
    if len(args) > 11 and args[11]:
        return "npu_moe_gating_top_k renormalises by sum + eps, not by clamp(sum, min=eps)"
    if group_score not in GROUP_SELECT_MODES:
        return f"npu_moe_gating_top_k has no {group_score} group mask (masked experts at 0.0, not -inf)"
    if score in ops.TOPK_FIRST:
        return f"npu_moe_gating_top_k has no {score} score (a score of the K values a top-k of the logits selected)"
    if score not in NORM_TYPES:
        return f"npu_moe_gating_top_k has no {score} score (norm_type is softmax or sigmoid only)"
    try:
        check_gating_args(logits, bias, top_k, score, n_group, topk_group, group_score, expert_scale)
    except ValueError as exc:
        return str(exc)
    e = concrete_int(logits.shape[1])
    if e is None:
        return f"a symbolic expert count {logits.shape[1]}"
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"logits dtype {logits.dtype}"
    if e > MAX_EXPERTS:
        return f"{e} experts (npu_moe_gating_top_k takes at most {MAX_EXPERTS})"
    if e // n_group <= 2:
        return f"{e // n_group} experts per group (npu_moe_gating_top_k needs E / group_count > 2)"
    if top_k > (e // n_group) * topk_group:
        return f"top-{top_k} exceeds the {(e // n_group) * topk_group} experts of the kept groups"
    if score == "sigmoid" and not renorm:
        return "npu_moe_gating_top_k always renormalises sigmoid weights; this router does not"
    if weight_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
        return f"weight dtype {weight_dtype}"
    return None


def moe_gating_kernel(logits, bias, top_k, score, n_group, topk_group, group_score, renormalize, renorm_eps,
                      scale, weight_dtype, renorm_clamp=False, expert_scale=None,
                      score_dtype=None):  # noqa: ANN001, ANN201
    """``ep_fuse_npu::moe_gating`` (``score_dtype`` is declined by :func:`gating_supports`)."""
    divide_after = score == "softmax" and renormalize
    y, ids, _norm = torch_npu().npu_moe_gating_top_k(
        logits.to(torch.float32), int(top_k), bias=bias.to(torch.float32) if bias is not None else None,
        k_group=int(topk_group), group_count=int(n_group), group_select_mode=GROUP_SELECT_MODES[group_score],
        renorm=0, norm_type=NORM_TYPES[score], out_flag=False,
        routed_scaling_factor=1.0 if divide_after else float(scale), eps=float(renorm_eps))
    # softmax + renormalise: the op cannot renormalise softmax (renorm=0 only), so the tail runs here, and
    # Gemma-4's ``* per_expert_scale[ids]`` after it (the op's y is renormalised and scaled by then)
    ids = ids.to(torch.int64)
    y = finish_weights(y.to(torch.float32), divide_after, renorm_eps, scale if divide_after else 1.0, weight_dtype,
                       expert_scale=expert_scale, ids=ids)
    return y, ids


register_provider(ops.moe_gating, "npu", moe_gating_kernel, devices=devices, available=available,
                  supports=gating_supports, contracts=contracts("npu_moe_gating_top_k"))

"""Router hypotheses for MoE blocks recognised by what they compute (used by :mod:`ep_fuse.surgery.moe_semantics`).

A router maps token rows ``[T, H]`` to top-k expert ids and weights. Whatever the spelling of a block, its router is
described by the arguments of the canonical ``ep_fuse::moe_gating`` op (:mod:`ep_fuse.ops.moe_gating`): the logits
(a linear map of the rows by a ``[E, H]`` weight, or ``[H, E]`` used as ``rows @ W``, with an optional bias), the score
(softmax / sigmoid before the top-k, or the top-k of the logits first), an optional selection bias, group-limited
selection, renormalisation, a scale and the weights' dtype. :func:`selection_hypotheses` enumerates those a block's
parameters and attributes allow; :func:`route` computes one, spelled as the Hugging Face routers the ``moe_gating``
patterns match, so that a rebuilt block fuses its router too.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ep_fuse.ops.moe_gating import moe_gating_ref

SELECTION_SCORES = ("softmax", "sigmoid", "topk_softmax", "topk_sigmoid")
"""Scores tried, most common first (``sqrt_softplus`` routers are spelled by HF models only)."""


@dataclass(frozen=True)
class RouterSpec:
    """One router hypothesis. Tensors are named by their path from the block (``"gate.weight"``), so that the
    rebuilt forward reads the block's live parameters (``.to()``, loading and sharding keep working)."""

    weight: str
    transposed: bool  # the weight is [H, E] and the logits are ``rows @ W``
    logit_bias: str | None
    top_k: int
    score: str = "softmax"
    sel_bias: str | None = None
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "none"
    renormalize: bool = False
    renorm_eps: float = 0.0
    scale: float = 1.0
    weights_fp32: bool = True  # False: the weights are cast to the tokens' dtype

    def describe(self) -> str:
        parts = [f"{'rows @ ' + self.weight if self.transposed else 'linear(rows, ' + self.weight + ')'}",
                 f"{self.score} top-{self.top_k}"]
        if self.logit_bias:
            parts.append(f"logit bias {self.logit_bias}")
        if self.sel_bias:
            parts.append(f"selection bias {self.sel_bias}")
        if self.group_score != "none":
            parts.append(f"{self.topk_group} of {self.n_group} groups ({self.group_score})")
        if self.renormalize:
            parts.append("renormalised")
        if self.scale != 1.0:
            parts.append(f"x {self.scale:g}")
        parts.append("fp32 weights" if self.weights_fp32 else "weights in the tokens' dtype")
        return ", ".join(parts)


def resolve(block: torch.nn.Module, path: str | None) -> torch.Tensor | None:
    """The tensor at ``path`` (dotted, from ``block``), or None for no path."""
    if path is None:
        return None
    obj = block
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def logits_of(block: torch.nn.Module, spec: RouterSpec, rows: torch.Tensor) -> torch.Tensor:
    """The router logits ``[T, E]`` in the rows' dtype."""
    weight = resolve(block, spec.weight)
    bias = resolve(block, spec.logit_bias)
    if spec.transposed:
        out = rows @ weight.to(rows.dtype)
        return out if bias is None else out + bias
    return F.linear(rows, weight.to(rows.dtype), None if bias is None else bias.to(rows.dtype))


def route(block: torch.nn.Module, spec: RouterSpec, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, K], ids [T, K])`` of ``spec`` on ``logits`` ``[T, E]``, spelled as the HF routers are."""
    sel_bias = resolve(block, spec.sel_bias)
    weight_dtype = None if spec.weights_fp32 else logits.dtype
    if spec.group_score in ("sum_top2", "sum_top2_fill0"):
        return _grouped_sum_top2(logits, sel_bias, spec, weight_dtype)
    return moe_gating_ref(logits, sel_bias, spec.top_k, spec.score, spec.n_group, spec.topk_group, spec.group_score,
                          spec.renormalize, spec.renorm_eps, spec.scale, weight_dtype)


def selection_scores(block: torch.nn.Module, spec: RouterSpec, logits: torch.Tensor,
                     grouped: bool = True) -> torch.Tensor:
    """``[T, E]`` fp32: the values ``spec`` takes the top-k of (experts outside the kept groups at -inf; with
    ``grouped=False`` before that mask)."""
    sel_bias = resolve(block, spec.sel_bias)
    x = logits.float()
    if spec.score in ("topk_softmax", "topk_sigmoid"):
        return x if sel_bias is None else x + sel_bias
    sel = x.sigmoid() if spec.score == "sigmoid" else x.softmax(dim=-1)
    sel = sel if sel_bias is None else sel + sel_bias
    if spec.group_score == "none" or not grouped:
        return sel
    gscore = group_scores(spec, sel)
    keep = torch.zeros_like(gscore, dtype=torch.bool).scatter(1, gscore.topk(spec.topk_group, dim=-1)[1], True)
    return sel.masked_fill(~keep.repeat_interleave(sel.shape[1] // spec.n_group, dim=1), float("-inf"))


def group_scores(spec: RouterSpec, sel: torch.Tensor) -> torch.Tensor:
    """``[T, n_group]``: each group's score (the sum of its two best, or its best) of ungrouped scores ``sel``."""
    t, e = sel.shape
    grouped = sel.view(t, spec.n_group, e // spec.n_group)
    return grouped.topk(2, dim=-1)[0].sum(-1) if spec.group_score.startswith("sum_top2") else grouped.amax(-1)


def _grouped_sum_top2(logits: torch.Tensor, sel_bias: torch.Tensor | None, spec: RouterSpec,
                      weight_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-limited top-k (group score: the sum of its two best scores), spelled as transformers' DeepSeek-V3."""
    t, e = logits.shape
    probs = logits.float().sigmoid() if spec.score == "sigmoid" else logits.float().softmax(dim=-1)
    choice = probs + sel_bias if sel_bias is not None else probs
    group_scores = choice.view(-1, spec.n_group, e // spec.n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=spec.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, spec.n_group, e // spec.n_group).reshape(-1, e)
    fill = 0.0 if spec.group_score == "sum_top2_fill0" else float("-inf")
    choice = choice.masked_fill(~score_mask.bool(), fill)
    ids = torch.topk(choice, k=spec.top_k, dim=-1, sorted=False)[1]
    weights = probs.gather(1, ids)
    if spec.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + spec.renorm_eps)
    weights = weights * spec.scale
    return (weights if weight_dtype is None else weights.to(weight_dtype)), ids


@dataclass(frozen=True)
class RouterParts:
    """What a block offers a router: weight candidates, selection biases, group sizes and scales."""

    weights: tuple[tuple[str, bool, str | None], ...]  # (path, transposed, logit-bias path)
    sel_biases: tuple[str, ...]
    groups: tuple[tuple[int, int], ...]
    scales: tuple[float, ...]


def selection_hypotheses(parts: RouterParts, top_k: int, num_experts: int) -> Iterator[RouterSpec]:
    """Every (logits, score, selection bias, groups) combination the block allows, ungrouped and unbiased first;
    the weight tail (renormalisation, scale, dtype) is left at its defaults (see :func:`weight_variants`)."""
    for (weight, transposed, logit_bias), score in itertools.product(parts.weights, SELECTION_SCORES):
        base = RouterSpec(weight, transposed, logit_bias, top_k, score)
        for sel_bias in (None, *parts.sel_biases):
            if sel_bias is not None and score in ("topk_softmax",):
                continue
            yield replace(base, sel_bias=sel_bias)
            if score in ("softmax", "sigmoid"):
                for (n_group, topk_group), group_score in itertools.product(
                        parts.groups, ("sum_top2", "max", "sum_top2_fill0")):
                    if num_experts % n_group == 0 and topk_group * (num_experts // n_group) >= top_k:
                        yield replace(base, sel_bias=sel_bias, n_group=n_group, topk_group=topk_group,
                                      group_score=group_score)


def weight_variants(spec: RouterSpec, scales: tuple[float, ...]) -> Iterator[RouterSpec]:
    """The weight tails of one selection: renormalised or not, each scale, fp32 or the tokens' dtype."""
    renorms = (False,) if spec.score == "topk_softmax" else (True, False)
    for renormalize, scale, fp32 in itertools.product(renorms, (1.0, *scales), (True, False)):
        eps = 1e-20 if renormalize and spec.score == "sigmoid" else 0.0
        yield replace(spec, renormalize=renormalize, renorm_eps=eps, scale=scale, weights_fp32=fp32)

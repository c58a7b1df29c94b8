"""The router family: ``ep_fuse::moe_gating`` (schema and pure-torch reference).

``moe_gating(logits, bias, top_k, score, n_group, topk_group, group_score, renormalize, renorm_eps,
scale, weight_dtype, renorm_clamp=False, expert_scale=None, score_dtype=None) -> (weights [T, K], ids [T, K]
int64)`` covers the Hugging Face routers::

    probs   = softmax(logits, -1) | sigmoid(logits)          # fp32 (the router logits are fp32)
    sel     = probs + bias            (bias: selection only, never in the weights)
    groups  (group_score != "none"): sel viewed [T, n_group, E / n_group]; group score = its max
            ("max", DeepSeek-V2) or the sum of its two largest values ("sum_top2", DeepSeek-V3/GLM4);
            the best ``topk_group`` groups are kept:
              "sum_top2": the other experts' ``sel`` become -inf, weights come from ``probs``;
              "sum_top2_fill0": the same with the other experts' ``sel`` set to 0.0 (DeepSeek-V3's
                          remote ``modeling_deepseek.py``): where fewer than top_k kept experts have
                          ``sel > 0`` (a negative bias), masked experts compete at 0.0 and can be chosen
              "max":      the other experts' ``sel`` and ``probs`` become 0.0 and the weights come
                          from those masked values (HF DeepSeek-V2 takes the top-k *values*)
    ids     = the top_k of sel
    weights = probs[ids]  ->  / (sum + renorm_eps) if renormalize  ->  * scale  ->  .to(weight_dtype)
              (renorm_clamp: / clamp(sum, min=renorm_eps), Ernie-4.5-MoE's ``moe_norm_min``)

| model | score | bias | group_score | renormalize | renorm_eps | scale | weight_dtype |
|---|---|---|---|---|---|---|---|
| Mixtral | softmax | - | none | True | 0 | 1 | None (fp32) |
| Qwen3-MoE | softmax | - | none | True | 0 | 1 | bf16 |
| Qwen2-MoE | softmax | - | none | False | 0 | 1 | bf16 |
| DeepSeek-V2 greedy | softmax | - | none | False | 0 | routed_scaling_factor | None |
| DeepSeek-V2 group_limited_greedy | softmax | - | max | False | 0 | routed_scaling_factor | None |
| DeepSeek-V3 / GLM4-MoE | sigmoid | e_score_correction_bias | sum_top2 | norm_topk_prob | 1e-20 | routed_scaling_factor | None |
| softmax + selection bias | softmax | the bias | none | any | any | any | any |
| DeepSeek-V3 remote code | sigmoid | e_score_correction_bias | sum_top2_fill0 | norm_topk_prob | 1e-20 | routed_scaling_factor | None |
| Ernie-4.5-MoE (renorm_clamp) | softmax | moe_statics bias | none | True | moe_norm_min | 1 | the activation dtype |
| Granite-MoE, Cohere2-MoE | topk_softmax | - | none | False | 0 | 1 | the activation dtype |
| Cohere2-MoE ``"sigmoid"`` | topk_sigmoid | - | none | norm_topk_prob | 0 | 1 | the activation dtype |
| Kolibri-1 | topk_sigmoid | e_score_correction_bias | none | norm_topk_prob | 0 | 1 | None |
| Flint | sigmoid | - | none | norm_topk_prob | 0 | 1 | None |
| DeepSeek-V4 | sqrt_softplus | e_score_correction_bias | none | True | 1e-20 | routed_scaling_factor | None |
| Mistral-4 / -Large-4 | softmax | - | sum_top2_fill0 (``none`` for one group) | True | 1e-20 | routed_scaling_factor | None |
| Gemma-4 (+ ``expert_scale=per_expert_scale``) | softmax | - | none | True | 0 | 1 | None |
| Zaya (``[B, S, E+1]`` logits) | softmax | balancing_biases | none | False | 0 | 1 | None |

Inkling's sink router (softmax over the chosen and the shared experts' logits) is its own op of the family,
``moe_gating_sink`` (:func:`moe_gating_sink_ref`): its weights are ``[T, K + S]``.

``logits`` may be ``[..., E]`` (Zaya's ``[B, S, E + 1]`` router probabilities): every row is routed alone and
both outputs are ``[..., K]``; the fused providers take ``[T, E]`` only (``check_gating_args``).

``expert_scale`` (Gemma-4): ``weights * expert_scale[ids]`` after the renormalisation and ``scale``, before the cast
(torch's promotion). ``topk_sigmoid`` with a bias (Kolibri-1): the top-k of ``logits + bias`` (torch's promotion),
the sigmoid of the chosen *logits*.

**``score_dtype``** (bf16/fp16 routers that never upcast: Aria's and GPT-OSS's softmax of the bf16 top-k values,
Mistral-4's and Zaya's softmax of bf16 logits, DeepSeek-V4's bf16 ``sqrt(softplus)``): ``None`` (the default) computes
the scores from fp32 logits (bf16/fp16 logits are upcast first, as the HF routers that call ``.float()`` do); the
logits' own dtype computes every step in that dtype with the same torch ops as the model (each op rounds its output
to bf16/fp16, the selection bias added with torch's promotion), so the reference stays bitwise the model. The fused
providers compute in fp32 and decline it.

**``topk_sigmoid``** (Cohere2-MoE ``expert_selection_fn="sigmoid"``): ``values, ids = topk(logits, K)``,
then ``sigmoid(values)`` (fp32 logits: the sigmoid must run in fp32), optionally renormalised. Sigmoid is
monotonic, so this selects what ``sigmoid`` -> top-k would up to fp32 ties; it is a score of its own for the
same reason as ``topk_softmax``: it selects on the logits.

**``sum_top2_fill0``.** With ``-inf`` the masked experts are never chosen (the kept groups hold at least
``topk_group * E / n_group >= top_k`` experts). With 0.0 they are, whenever fewer than ``top_k`` kept
experts have a positive biased score ``sigmoid + bias`` (possible: the bias is learned and may be
negative). Then several masked experts tie at 0.0 and which one wins is ``torch.topk``'s
implementation-defined tie order (the reference reproduces it, the fused providers take the lowest id);
the weight is the masked expert's own sigmoid score, as in the model. With ``sel > 0`` on every kept
expert (a non-negative bias) the two fills select the same experts.

**``topk_softmax``** (Granite-MoE, Cohere2-MoE ``expert_selection_fn="softmax"``): ``values, ids =
topk(logits, K)`` on the logits in their own dtype (bf16 router logits included), then
``softmax(values.float())`` over the K values. Mathematically this is softmax -> top-k -> renormalise,
but not in floating point, so it is its own score: (1) the weights round differently
(``exp(l_i - m) / sum_K exp(l_j - m)`` once, against a division by the full sum and then by the top-k
sum); (2) the selection can differ -- ``softmax`` is monotonic but not strictly so in fp32: two distinct
logits can round to the same probability (``exp`` underflows to 0.0 about 104 below the maximum logit;
nearby logits can round to one probability), and a top-k of the probabilities then meets a tie
the top-k of the logits does not have. Selecting on the logits keeps the reference bitwise equal to the
model; the fused providers' stable ties apply only to logits that are exactly equal (then the two
experts carry the same weight: a tie inside the top-k only swaps slots, a tie at the K-th place picks
an expert of equal weight).

**Slot order and ties.** The reference selects with ``torch.topk`` exactly as the model does
(experts: ``sorted=True``; groups: ``sorted=False``), so the reference provider stays bitwise equal to
the eager model on every device, exact ties included (bf16 router logits make ties common: two
experts with the same bf16 logit have the same fp32 probability). For ``sorted=True`` routers
(Mixtral, Qwen) the slot order is the model's; for ``sorted=False`` routers (DeepSeek, GLM4) the slot
order within a row is ``sorted=True``'s (descending), which may differ from the model's unspecified
order -- compare routing per token as a set. The renormalising sum runs over the slots in that order:
bitwise equal to the model for K <= 2 and for every sorted=True router, otherwise within an ulp.

``torch.topk``'s order among *equal* values is implementation-defined: on the CPU it follows its
heap / nth_element order (neither lowest nor highest index first); on CUDA the boundary set is the
lowest indices but the sort after it is not stable. The fused providers therefore implement
:func:`moe_gating_stable_ref` instead: every top-k (groups and experts) is *stable* -- descending value,
equal values lowest index first (NaN counts as the largest) -- which is also what
``npu_moe_gating_top_k`` documents ("stable argsort"). Triton and NPU return identical ids on ties;
they differ from the reference (and the eager model) only where a row has an exact tie across the
k-th place or inside the top-k.

Every other step is spelled with the ATen ops the HF code traces to (``_softmax``, ``sigmoid``,
``add``, ``topk``+``sum`` / ``max.dim`` for the group score, ``gather``, ``sum``, ``add``, ``div``,
``mul``, ``_to_copy``), so weights are bitwise equal to the traced model's for the same ids.
"""

from __future__ import annotations

from typing import Any

import torch

from ep_fuse.ops.registry import define_canonical

SCORES = ("softmax", "sigmoid", "topk_softmax", "topk_sigmoid", "sqrt_softplus")
GROUP_SCORES = ("none", "max", "sum_top2", "sum_top2_fill0")
TOPK_FIRST = ("topk_softmax", "topk_sigmoid")
"""Scores computed on the K values the top-k of the logits selected."""


def check_gating_args(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    score: str,
    n_group: int,
    topk_group: int,
    group_score: str,
    expert_scale: torch.Tensor | None = None,
    score_dtype: torch.dtype | None = None,
) -> None:
    """Raise ``ValueError`` for arguments outside the op's contract."""
    if logits.dim() != 2:
        raise ValueError(f"ep_fuse moe_gating: logits must be [T, E], got {list(logits.shape)}")
    if score_dtype is not None and score_dtype != logits.dtype:
        raise ValueError(f"ep_fuse moe_gating: score_dtype {score_dtype} must be None (fp32 scores) or the dtype of "
                         f"the logits ({logits.dtype})")
    e = logits.shape[1]
    if score not in SCORES:
        raise ValueError(f"ep_fuse moe_gating: score {score!r} is not one of {SCORES}")
    if group_score not in GROUP_SCORES:
        raise ValueError(f"ep_fuse moe_gating: group_score {group_score!r} is not one of {GROUP_SCORES}")
    if not 1 <= top_k <= e:
        raise ValueError(f"ep_fuse moe_gating: top_k {top_k} not in [1, {e}]")
    if group_score == "none":
        if n_group != 1 or topk_group != 1:
            raise ValueError("ep_fuse moe_gating: n_group/topk_group must be 1 without a group score")
    else:
        if n_group < 1 or e % n_group or not 1 <= topk_group <= n_group:
            raise ValueError(f"ep_fuse moe_gating: {e} experts do not split into {n_group} groups "
                             f"of which {topk_group} are kept")
        if group_score.startswith("sum_top2") and e // n_group < 2:
            raise ValueError("ep_fuse moe_gating: sum_top2 needs at least 2 experts per group")
    if score in TOPK_FIRST and (group_score != "none" or (bias is not None and score != "topk_sigmoid")):
        raise ValueError(f"ep_fuse moe_gating: score {score!r} (top-k of the logits, then the score of the K "
                         f"values) takes no groups and, but for topk_sigmoid (Kolibri-1), no selection bias")
    if bias is not None and group_score == "max":
        raise ValueError("ep_fuse moe_gating: a selection bias with group_score='max' is not supported "
                         "(DeepSeek-V2's group-max router has none; masked experts would compete at 0.0)")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != e):
        raise ValueError(f"ep_fuse moe_gating: bias must be [E={e}], got {list(bias.shape)}")
    if expert_scale is not None and (expert_scale.dim() != 1 or expert_scale.shape[0] != e):
        raise ValueError(f"ep_fuse moe_gating: expert_scale must be [E={e}], got {list(expert_scale.shape)}")


def stable_topk_ids(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest values per row: descending, ties to the lowest index (int64)."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k].contiguous()


def torch_topk_ids(x: torch.Tensor, k: int) -> torch.Tensor:
    """``torch.topk(x, k, sorted=True)`` ids: the model's own selection (implementation-defined ties)."""
    return torch.topk(x, k, dim=-1)[1]


def _group_keep(sel: torch.Tensor, n_group: int, topk_group: int, group_score: str, stable: bool) -> torch.Tensor:
    """[T, E] bool: experts of the ``topk_group`` best groups of ``sel``."""
    t, e = sel.shape
    grouped = sel.view(t, n_group, e // n_group)
    if group_score.startswith("sum_top2"):
        gscore = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    else:
        gscore = grouped.max(dim=-1).values
    if stable:
        gidx = stable_topk_ids(gscore, topk_group)
    else:
        gidx = torch.topk(gscore, k=topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros(gscore.shape, dtype=torch.bool, device=sel.device).scatter(1, gidx, True)
    return keep.unsqueeze(-1).expand(t, n_group, e // n_group).reshape(t, e)


def _gating(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    score: str,
    n_group: int,
    topk_group: int,
    group_score: str,
    renormalize: bool,
    renorm_eps: float,
    scale: float,
    weight_dtype: torch.dtype | None,
    renorm_clamp: bool,
    expert_scale: torch.Tensor | None,
    stable: bool,
    score_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_gating_args(logits, bias, top_k, score, n_group, topk_group, group_score, expert_scale, score_dtype)
    compute = score_dtype or torch.float32
    if score in TOPK_FIRST:
        # select on the logits in their own dtype, as the model does (an upcast is exact and keeps the order);
        # with a bias (Kolibri-1) on ``logits + bias`` (torch's promotion), the values gathered from the logits
        sel = logits if bias is None else logits + bias
        if stable or bias is not None:
            ids = stable_topk_ids(sel, top_k) if stable else torch_topk_ids(sel, top_k)
            values = logits.gather(1, ids)
        else:
            values, ids = torch.topk(logits, top_k, dim=-1)
        values = values.to(compute)
        weights = torch.softmax(values, dim=-1) if score == "topk_softmax" else torch.sigmoid(values)
        return finish_weights(weights, renormalize, renorm_eps, scale, weight_dtype, renorm_clamp,
                              expert_scale, ids), ids
    x = logits.to(compute)
    probs = scores_of(x, score)
    sel = probs + bias if bias is not None else probs
    src = probs
    if group_score != "none":
        keep = _group_keep(sel, n_group, topk_group, group_score, stable)
        if group_score == "max":
            sel = sel.masked_fill(~keep, 0.0)
            src = sel if bias is None else probs.masked_fill(~keep, 0.0)
        else:  # DeepSeek-V3's remote code fills 0.0 (masked experts compete at 0.0), transformers 5 -inf
            sel = sel.masked_fill(~keep, 0.0 if group_score == "sum_top2_fill0" else float("-inf"))
    ids = stable_topk_ids(sel, top_k) if stable else torch_topk_ids(sel, top_k)
    return finish_weights(src.gather(1, ids), renormalize, renorm_eps, scale, weight_dtype, renorm_clamp,
                          expert_scale, ids), ids


def scores_of(x: torch.Tensor, score: str) -> torch.Tensor:
    """The dense [T, E] score of the logits (fp32, or the model's dtype with ``score_dtype``): ``softmax``, ``sigmoid`` or ``sqrt(softplus(x))`` (DeepSeek-V4)."""
    if score == "softmax":
        return torch.softmax(x, dim=-1)
    if score == "sqrt_softplus":
        return torch.nn.functional.softplus(x).sqrt()
    return torch.sigmoid(x)


def finish_weights(
    weights: torch.Tensor, renormalize: bool, renorm_eps: float, scale: float, weight_dtype: torch.dtype | None,
    renorm_clamp: bool = False, expert_scale: torch.Tensor | None = None, ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The routers' tail in their op order: ``w / (sum(w) [+ eps])`` (``renorm_clamp``: ``w / clamp(sum(w),
    min=eps)``), ``* scale``, ``* expert_scale[ids]`` (Gemma-4, torch's promotion), one cast."""
    if renormalize:
        denom = weights.sum(dim=-1, keepdim=True)
        if renorm_clamp:
            denom = denom.clamp(min=renorm_eps)
        elif renorm_eps != 0.0:
            denom = denom + renorm_eps
        weights = weights / denom
    if scale != 1.0:
        weights = weights * scale
    if expert_scale is not None:
        weights = weights * expert_scale[ids]
    if weight_dtype is not None and weight_dtype != weights.dtype:
        weights = weights.to(weight_dtype)
    return weights


def moe_gating_ref(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    score: str,
    n_group: int,
    topk_group: int,
    group_score: str,
    renormalize: bool,
    renorm_eps: float,
    scale: float,
    weight_dtype: torch.dtype | None,
    renorm_clamp: bool = False,
    expert_scale: torch.Tensor | None = None,
    score_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, K], ids [T, K] int64)`` selected with ``torch.topk`` (the model's ties)."""
    if logits.dim() > 2:  # Zaya's [B, S, E] router: per row over the last dim, outputs [B, S, K]
        return _leading(moe_gating_ref, logits, bias, top_k, score, n_group, topk_group, group_score, renormalize,
                        renorm_eps, scale, weight_dtype, renorm_clamp, expert_scale, score_dtype)
    return _gating(logits, bias, top_k, score, n_group, topk_group, group_score, renormalize, renorm_eps,
                   scale, weight_dtype, renorm_clamp, expert_scale, stable=False, score_dtype=score_dtype)


def moe_gating_stable_ref(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    score: str,
    n_group: int,
    topk_group: int,
    group_score: str,
    renormalize: bool,
    renorm_eps: float,
    scale: float,
    weight_dtype: torch.dtype | None,
    renorm_clamp: bool = False,
    expert_scale: torch.Tensor | None = None,
    score_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused providers' contract: as :func:`moe_gating_ref` with stable, lowest-index-first ties."""
    if logits.dim() > 2:
        return _leading(moe_gating_stable_ref, logits, bias, top_k, score, n_group, topk_group, group_score,
                        renormalize, renorm_eps, scale, weight_dtype, renorm_clamp, expert_scale, score_dtype)
    return _gating(logits, bias, top_k, score, n_group, topk_group, group_score, renormalize, renorm_eps,
                   scale, weight_dtype, renorm_clamp, expert_scale, stable=True, score_dtype=score_dtype)


def _leading(fn: Any, logits: torch.Tensor, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``fn`` on ``logits`` [..., E] viewed as rows [T, E]; both outputs viewed back to [..., K] (contiguous)."""
    lead = logits.shape[:-1]
    w, ids = fn(logits.reshape(-1, logits.shape[-1]), *args)
    return w.view(*lead, w.shape[-1]), ids.view(*lead, ids.shape[-1])


MOE_GATING_SCHEMA = (
    "(Tensor logits, Tensor? bias, int top_k, str score, int n_group, int topk_group, str group_score, "
    "bool renormalize, float renorm_eps, float scale, ScalarType? weight_dtype, bool renorm_clamp=False, "
    "Tensor? expert_scale=None, ScalarType? score_dtype=None) "
    "-> (Tensor, Tensor)"
)
"""``renorm_clamp`` (Ernie-4.5-MoE), ``expert_scale`` (Gemma-4) and ``score_dtype`` (routers computed in bf16/fp16)
are passed only when set: calls keep the 11 arguments otherwise."""
moe_gating = define_canonical("moe_gating", MOE_GATING_SCHEMA, moe_gating_ref)
"""``moe_gating(logits, bias, K, ...) -> (weights, ids int64)``: see :mod:`ep_fuse.ops.moe_gating`."""


def moe_gating_sink_ref(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    n_shared: int,
    scale: float,
    global_scale: torch.Tensor | None,
    weight_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inkling's shared-expert sink router on fp32 logits ``[T, E + S]`` (the last ``S`` columns: shared experts).

    ``ids = topk(sigmoid(logits[:, :E]) [+ bias], K)[1]``; the K chosen routed logits and the S shared logits
    compete in one normalisation, ``w = exp(ls - logsumexp(ls))`` with ``ls = logsigmoid(cat(chosen, shared))``
    (the shared experts are a sink for probability mass), then ``* scale``, ``* global_scale`` (a learned
    1-element tensor), one cast. Returns ``(w [T, K + S], ids [T, K] int64)``: the routed weights are
    ``w[:, :K]``, the shared experts' ``w[:, K:]``. Ids in ``torch.topk(sorted=True)`` order (the model's
    ``sorted=False`` set)."""
    return _sink(logits, bias, top_k, n_shared, scale, global_scale, weight_dtype, stable=False)


def moe_gating_sink_stable_ref(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    n_shared: int,
    scale: float,
    global_scale: torch.Tensor | None,
    weight_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused providers' contract: :func:`moe_gating_sink_ref` with stable, lowest-index-first ties."""
    return _sink(logits, bias, top_k, n_shared, scale, global_scale, weight_dtype, stable=True)


def _sink(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, n_shared: int, scale: float,
          global_scale: torch.Tensor | None, weight_dtype: torch.dtype | None,
          stable: bool) -> tuple[torch.Tensor, torch.Tensor]:
    check_sink_args(logits, bias, top_k, n_shared, global_scale)
    e = logits.shape[1] - n_shared
    sel = torch.sigmoid(logits)[:, :e]
    if bias is not None:
        sel = sel + bias
    ids = stable_topk_ids(sel, top_k) if stable else torch_topk_ids(sel, top_k)
    chosen = torch.cat([logits[:, :e].gather(-1, ids), logits[:, e:]], dim=-1)
    log_p = torch.nn.functional.logsigmoid(chosen)
    w = torch.exp(log_p - torch.logsumexp(log_p, dim=-1, keepdim=True))
    if scale != 1.0:
        w = w * scale
    if global_scale is not None:
        w = w * global_scale
    if weight_dtype is not None and weight_dtype != w.dtype:
        w = w.to(weight_dtype)
    return w, ids


def check_sink_args(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, n_shared: int,
                    global_scale: torch.Tensor | None) -> None:
    """Raise ``ValueError`` for ``moe_gating_sink`` arguments outside the op's contract."""
    if logits.dim() != 2:
        raise ValueError(f"ep_fuse moe_gating_sink: logits must be [T, E + S], got {list(logits.shape)}")
    e = logits.shape[1] - n_shared
    if n_shared < 1 or not 1 <= top_k <= e:
        raise ValueError(f"ep_fuse moe_gating_sink: top-{top_k} of {e} routed experts with {n_shared} shared "
                         f"(needs n_shared >= 1 and 1 <= top_k <= E)")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != e):
        raise ValueError(f"ep_fuse moe_gating_sink: bias must be [E={e}], got {list(bias.shape)}")
    if global_scale is not None and global_scale.numel() != 1:
        raise ValueError(f"ep_fuse moe_gating_sink: global_scale must hold one element, got {list(global_scale.shape)}")


MOE_GATING_SINK_SCHEMA = ("(Tensor logits, Tensor? bias, int top_k, int n_shared, float scale, Tensor? global_scale, "
                          "ScalarType? weight_dtype) -> (Tensor, Tensor)")
moe_gating_sink = define_canonical("moe_gating_sink", MOE_GATING_SINK_SCHEMA, moe_gating_sink_ref)
"""``moe_gating_sink(logits [T, E+S], bias, K, S, scale, global_scale, dtype) -> (weights [T, K+S], ids [T, K])``:
the router whose softmax includes shared experts as a sink (Inkling); see :func:`moe_gating_sink_ref`."""

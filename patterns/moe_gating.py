"""Router top-k gating: router logits -> (routing weights, expert ids) (graph forms: ``docs/patterns.md``).

Matched from the fp32 router logits (the input of ``_softmax``/``sigmoid``; the router GEMM and its
upcast stay outside) to the ``(weights, ids)`` pair the experts consume; both become the two outputs
of ``ep_fuse::moe_gating`` (see :mod:`ep_fuse.ops.moe_gating` for its semantics):

* ``softmax_topk`` (Mixtral, Qwen3-MoE, Qwen2-MoE, DeepSeek-V2 ``greedy``)::

      v, ids = topk(_softmax(logits, -1), K[, sorted=False])   # or _softmax(fp16 logits, -1, half_to_float=True)
      w = [_to_copy](  [mul]( [div(v, [add](sum(v, [-1], True), eps))], scale ), dtype)

* ``softmax_group_max`` (DeepSeek-V2 ``group_limited_greedy``): ``p = _softmax(logits)``; group
  score ``max.dim(view(p, [-1, G, E/G]), -1)[0]``; ``topk(·, topk_group, sorted=False)[1]`` ->
  ``scatter.value(zeros_like, 1, ·, 1)`` -> ``unsqueeze/expand/clone/_unsafe_view`` -> ``_to_copy(bool)``
  -> ``bitwise_not`` -> ``masked_fill(p, ·, 0.0)`` -> ``topk(K, sorted=False)``; the weights are its
  values (then the same tail);
* ``sigmoid_group_sum_top2`` (DeepSeek-V3, GLM4-MoE): ``s = sigmoid(logits)``, ``sel = s + bias``
  (``e_score_correction_bias``; optional), group score ``sum(topk(view(sel), 2)[0], [-1])``, the same
  mask chain with ``masked_fill(sel, ·, -inf)`` (optional: no groups), ``ids = topk(·, K, sorted=False)[1]``,
  weights ``gather(s, 1, ids)`` -- the bias selects, it never weighs -- then the tail.
* ``sigmoid_group_sum_top2_fill0`` (DeepSeek-V3's remote ``modeling_deepseek.py``): the same with
  ``masked_fill(sel, ·, 0.0)`` -- canonical ``group_score="sum_top2_fill0"`` (masked experts compete at 0.0);
  both read the scores through ``view(T, -1)`` and the bias as ``bias.unsqueeze(0)`` if written so, and
  groups viewed ``[T, G, -1]``.
* ``softmax_bias``: the same with ``_softmax`` scores and no groups (the softmax sibling of DeepSeek-V3's
  selection bias; Ernie-4.5-MoE, whose ``div(w, clamp(sum, min=eps))`` tail becomes ``renorm_clamp=True``).
* ``topk_softmax`` (Granite-MoE, Cohere2-MoE): ``v, ids = topk(logits, K)`` on fp32 or bf16 logits,
  ``[_to_copy](_softmax([_to_copy](v, f32), -1), D)``; a softmax in bf16 (no cast: Aria, GPT-OSS) is computed in bf16
  (canonical ``score_dtype``, :func:`score_dtype`).
  Its own score in the canonical op (see :mod:`ep_fuse.ops.moe_gating` for why it is not
  softmax -> top-k -> renormalise, ties included).
* ``topk_sigmoid`` (Cohere2-MoE ``expert_selection_fn="sigmoid"``): ``v, ids = topk(logits, K)``,
  ``sigmoid(v)`` in fp32, then the tail (``norm_topk_prob``: ``div(w, sum(w))``).

* ``sigmoid_topk`` (Flint), ``sqrt_softplus_bias`` (DeepSeek-V4), ``softmax_group_sum_top2_fill0`` (Mistral-4;
  one group becomes the ungrouped router), ``topk_bias_sigmoid`` (Kolibri-1); every tail also takes Gemma-4's
  ``* per_expert_scale[ids]`` (canonical ``expert_scale``).

The ids are not on the weights' path in most forms (they are the other output of the same ``topk``);
in the sigmoid form the weights' ``gather`` reads them. Each pattern's tree is the weights' and the ids'
tree is a second output (:attr:`ep_fuse.matching.Pattern.outputs`), matched on the same bindings; no
interior node of either may be used outside the two outputs.

* ``softmax_bias_3d`` (Zaya): ``softmax_bias`` on ``[B, S, E+1]`` logits, no tail (the skip masking stays);
  ``sigmoid_sink`` (Inkling): ``ep_fuse::moe_gating_sink``, the shared experts' logits in the normalisation.

Scores computed in bf16/fp16 (GPT-OSS's and Aria's softmax of the bf16 top-k values; Mistral-4's, Zaya's and
DeepSeek-V4's scores of bf16 logits) fuse with the canonical ``score_dtype`` set to that dtype: the reference computes
every step in it as the model does; the fused providers (fp32 math) decline it. The sink router (Inkling) still needs
fp32 scores (:func:`_f32_2d`).
Recognised only to say why they are not fused (:data:`DECLINED`): hash routing (DeepSeek-V4), PhiMoE's
sparsemixer, Llama-4's dense [T, E] scores.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ep_fuse.fx_utils import tensor_val
from ep_fuse.matching import Anchor, Cast, Item, Lit, Match, Opt, Pattern, Replacement, Var, alt, op
from ep_fuse.matching.checks import (
    MODEL_FLOATS,
    VIEWS,
    concrete_int,
    is_bool,
    is_int,
    is_shape,
    is_value,
    one_of,
    readers,
    same_shape,
    sym_eq,
)
from ep_fuse.matching.matcher import CAST_TARGETS
from ep_fuse.matching.pattern import equals, is_number
from ep_fuse.ops import moe_gating as moe_gating_ops

aten = torch.ops.aten
log = logging.getLogger("ep_fuse.patterns")

DESCRIPTION = "router top-k gating (softmax/sigmoid, bias, group-limited, renorm, scale) -> ep_fuse::moe_gating"

ARITH = {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor,
         aten.sum.dim_IntList, aten.sum.default}


# --------------------------------------------------------------------------- value checks
def _logits_2d(v: Any) -> tuple[torch.Tensor | None, str | None]:
    """``v``'s value when it is a ``[T, E]`` tensor, else why not."""
    t = tensor_val(v)
    if t is None:
        return None, f"expected a tensor, got {v!r}"
    if t.dim() != 2:
        return None, f"router logits must be a [T, E] tensor, got {t.dim()} dims"
    return t, None


def _f32_2d(v: Any) -> str | None:
    t, why = _logits_2d(v)
    return why or _f32_scores(t)


def _f32_scores(t: torch.Tensor) -> str | None:
    if t.dtype != torch.float32:
        return (f"router scores computed in {t.dtype}: eager rounds the probabilities to {t.dtype} before the "
                f"top-k, which the fused providers (fp32 math) do not reproduce bitwise, and bf16 rounding turns "
                f"distinct scores into ties; upcast the logits (.float()) before the softmax/sigmoid to fuse")
    return None


def _scores_2d(v: Any) -> str | None:
    """[T, E] logits of a dense score: fp32, or bf16/fp16 scored in their own dtype (canonical ``score_dtype``)."""
    t, why = _logits_2d(v)
    if why:
        return why
    if t.dtype not in MODEL_FLOATS:
        return f"router logits in {t.dtype}"
    return None


def _f16_2d(v: Any) -> str | None:
    t = tensor_val(v)
    if t is None or t.dtype != torch.float16 or t.dim() != 2:
        return "logits of a half_to_float softmax must be a fp16 [T, E] tensor"
    return None


def _any_2d(v: Any) -> str | None:
    t = tensor_val(v)
    if t is None or t.dtype not in MODEL_FLOATS or t.dim() != 2:
        return "router logits must be a floating [T, E] tensor"
    return None


def _bias_vector(v: Any) -> str | None:
    t = tensor_val(v)
    if t is None or t.dtype not in MODEL_FLOATS or t.dim() != 1:
        return "a selection bias is a floating [E] vector"
    return None


def _int64_tensor(v: Any) -> str | None:
    t = tensor_val(v)
    return None if t is not None and t.dtype == torch.int64 else "expected int64 top-k ids"


def _neg_inf(v: Any) -> str | None:
    return None if isinstance(v, float) and v == float("-inf") else f"expected -inf, got {v!r}"


def _zero(v: Any) -> str | None:
    return None if isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0 else f"expected 0.0, got {v!r}"


LAST_2D = one_of(-1, 1)
LAST_3D = one_of(-1, 2)


# --------------------------------------------------------------------------- trees
def _probs(kind: str) -> Any:
    logits = Var("logits", _scores_2d)
    if kind == "softmax":
        # ``F.softmax(fp16 logits, dtype=float32)`` traces on CUDA to one ``_softmax(x, dim, half_to_float=True)``
        # (fp32 math and output, as ``_softmax(_to_copy(x, f32))``; the CPU only has the cast form)
        # (the fp32 form last: on a mismatch of both, its reason is the one reported)
        return alt(op(aten._softmax.default, self=Var("logits", _f16_2d), dim=Lit(LAST_2D),
                      half_to_float=Lit(equals(True)), bind="probs"),
                   op(aten._softmax.default, self=logits, dim=Lit(LAST_2D), half_to_float=Lit(equals(False)),
                      bind="probs"))
    if kind == "sqrt_softplus":  # DeepSeek-V4 ``scoring_func="sqrtsoftplus"``: softplus(beta=1, threshold=20)
        return op(aten.sqrt.default, self=op(aten.softplus.default, self=logits), bind="probs")
    return op(aten.sigmoid.default, self=logits, bind="probs")


def _topk(x: Any, bind: str | None = None) -> Any:
    """``topk(x, K, -1, largest=True, sorted=any)`` over the experts."""
    return op(aten.topk.default, self=x, k=Lit(is_int, bind="top_k"), dim=Lit(LAST_2D), largest=Lit(equals(True)),
              sorted=Lit(is_bool), bind=bind)


def _not_in_kept_groups(sel: Any, group_score: str) -> Any:
    """``~mask`` [T, E] (bool) of the experts outside the ``topk_group`` best groups of ``sel``."""
    grouped = op(VIEWS, self=sel, size=Lit(is_shape, bind="group_view"))
    if group_score == "sum_top2":
        top2 = op(aten.topk.default, self=grouped, k=Lit(equals(2)), dim=Lit(LAST_3D), largest=Lit(equals(True)),
                  sorted=Lit(is_bool))
        gscore = op(aten.sum.dim_IntList, self=Item(top2, 0), dim=Lit(one_of([-1], [2])), bind="gscore")
    else:
        gscore = Item(op(aten.max.dim, self=grouped, dim=Lit(LAST_3D)), 0, bind="gscore")
    gidx = Item(op(aten.topk.default, self=gscore, k=Lit(is_int, bind="topk_group"), dim=Lit(LAST_2D),
                   largest=Lit(equals(True)), sorted=Lit(is_bool)), 1)
    mask = op(aten.scatter.value, self=op(aten.zeros_like.default, self=gscore, ignore=("pin_memory",)),
              dim=Lit(LAST_2D), index=gidx, value=Lit(equals(1)))
    expanded = op(aten.expand.default, self=op(aten.unsqueeze.default, self=mask, dim=Lit(LAST_3D)),
                  size=Lit(is_shape, bind="group_expand"))
    flat = op(VIEWS, size=Lit(is_shape, bind="group_flat"), self=alt(
        op(aten.clone.default, self=expanded, memory_format=Lit(is_value(torch.contiguous_format))), expanded))
    return op(aten.bitwise_not.default, self=Cast(flat, torch.bool))


def _tail(w: Any) -> Any:
    """``[_to_copy]([mul]([div(w, [add](sum(w, [-1], True), eps) | clamp(sum(w, [-1], True), min=eps))], scale))``
    (``w`` must carry a bind)."""
    total = op(aten.sum.dim_IntList, self=w, dim=Lit(one_of([-1], [1])), keepdim=Lit(equals(True)))
    denom = alt(op(aten.add.Tensor, self=total, other=Lit(is_number, bind="renorm_eps")),
                op(aten.clamp.default, self=total, min=Lit(is_number, bind="clamp_eps"), max=Lit(is_value(None))),
                op(aten.clamp_min.default, self=total, min=Lit(is_number, bind="clamp_eps")), total)
    renormed = alt(op(aten.div.Tensor, self=w, other=denom, bind="renorm"), w)
    scaled = alt(op((aten.mul.Tensor, aten.mul.Scalar), self=renormed, other=Lit(is_number, bind="scale")), renormed)
    # Gemma-4: ``w * per_expert_scale[ids]`` (the ids are checked to be the router's own: ``router_shapes``)
    per_expert = op(aten.index.Tensor, self=Var("expert_scale", _bias_vector), indices=[Var("scale_ids", _int64_tensor)])
    scaled = alt(op(aten.mul.Tensor, self=scaled, other=per_expert, commutative=("self", "other")), scaled)
    return Opt(Cast(scaled, dtype="weight_dtype"))


def _softmax_topk(kind: str = "softmax") -> tuple[Any, Any]:
    topk = _topk(_probs(kind), bind="topk")
    return _tail(Item(topk, 0, bind="weights_raw")), Item(topk, 1)


def _sigmoid_topk() -> tuple[Any, Any]:
    """``w, ids = topk(sigmoid(logits), K)``, [renorm] (Flint: sigmoid scores, no bias)."""
    return _softmax_topk("sigmoid")


def _softmax_group_max() -> tuple[Any, Any]:
    probs = _probs("softmax")
    masked = op(aten.masked_fill.Scalar, self=probs, mask=_not_in_kept_groups(probs, "max"),
                value=Lit(is_value(0.0)))
    topk = _topk(masked, bind="topk")
    return _tail(Item(topk, 0, bind="weights_raw")), Item(topk, 1)


def _gathered(kind: str, grouped: bool, fill: Any = _neg_inf) -> tuple[Any, Any]:
    """Selection on ``probs [+ bias]`` (masked to the kept groups with ``fill``), weights gathered from ``probs``.

    DeepSeek-V3's remote code reads the scores through ``view(T, -1)`` and adds ``bias.unsqueeze(0)``
    ([1, E]); both are accepted (the view is guarded to keep the [T, E] shape)."""
    probs = _probs(kind)  # also read by the selection: the ids' tree, matched as a second output
    gathered = op(aten.gather.default, self=probs, dim=Lit(LAST_2D), index=Var("ids", _int64_tensor),
                  bind="weights_raw")
    read = alt(op(VIEWS, self=probs, size=Lit(is_shape, bind="probs_view")), probs)
    bias = alt(op(aten.unsqueeze.default, self=Var("bias", _bias_vector), dim=Lit(equals(0))),
               Var("bias", _bias_vector))
    sel = alt(op(aten.add.Tensor, self=read, other=bias, commutative=("self", "other")), read, bind="sel")
    masked = alt(op(aten.masked_fill.Scalar, self=sel, mask=_not_in_kept_groups(sel, "sum_top2"),
                    value=Lit(fill)), sel) if grouped else sel
    return _tail(gathered), Item(_topk(masked), 1)


def _sigmoid_group_sum_top2() -> tuple[Any, Any]:
    return _gathered("sigmoid", grouped=True)


def _sigmoid_group_sum_top2_fill0() -> tuple[Any, Any]:
    """DeepSeek-V3's remote ``modeling_deepseek.py``: ``masked_fill(~mask, 0.0)`` (not -inf)."""
    return _gathered("sigmoid", grouped=True, fill=_zero)


def _softmax_bias() -> tuple[Any, Any]:
    return _gathered("softmax", grouped=False)


def _softmax_group_sum_top2_fill0() -> tuple[Any, Any]:
    """Mistral-4 / Mistral-Large-4: softmax, group sum of top-2 (no bias), ``masked_fill(~mask, 0.0)``, gather."""
    return _gathered("softmax", grouped=True, fill=_zero)


def _sqrt_softplus_bias() -> tuple[Any, Any]:
    """DeepSeek-V4: ``sqrt(softplus(logits))`` [+ bias], topk, gather, renorm, scale."""
    return _gathered("sqrt_softplus", grouped=False)


def _topk_softmax() -> tuple[Any, Any]:
    """``v, ids = topk(logits, K)``; ``[_to_copy](_softmax([_to_copy](v, f32), -1))`` (Granite-MoE, Cohere2-MoE)."""
    topk = _topk(Var("logits", _any_2d), bind="topk")
    values = Item(topk, 0, bind="weights_raw")
    probs = op(aten._softmax.default, self=Opt(Cast(values, torch.float32)), dim=Lit(LAST_2D),
               half_to_float=Lit(equals(False)), bind="probs")
    return Opt(Cast(probs, dtype="weight_dtype")), Item(topk, 1)


def _topk_bias_sigmoid() -> tuple[Any, Any]:
    """Kolibri-1: ``ids = topk(logits + bias, K)[1]``, ``sigmoid(gather(logits, 1, ids))``, [renorm], [cast]."""
    logits = Var("logits", _any_2d)
    bias = alt(op(aten.unsqueeze.default, self=Var("bias", _bias_vector), dim=Lit(equals(0))),
               Var("bias", _bias_vector))
    sel = op(aten.add.Tensor, self=logits, other=bias, commutative=("self", "other"), bind="sel")
    values = op(aten.gather.default, self=logits, dim=Lit(LAST_2D), index=Var("ids", _int64_tensor),
                bind="weights_raw")
    probs = op(aten.sigmoid.default, self=Opt(Cast(values, torch.float32)), bind="probs")
    return _tail(probs), Item(_topk(sel), 1)


def _topk_sigmoid() -> tuple[Any, Any]:
    """``v, ids = topk(logits, K)``; ``sigmoid(v)``, [renorm], [cast] (Cohere2-MoE ``expert_selection_fn="sigmoid"``)."""
    topk = _topk(Var("logits", _any_2d), bind="topk")
    values = Item(topk, 0, bind="weights_raw")
    return _tail(op(aten.sigmoid.default, self=Opt(Cast(values, torch.float32)), bind="probs")), Item(topk, 1)


def _any_3d(v: Any) -> str | None:
    t = tensor_val(v)
    if t is None or t.dtype not in MODEL_FLOATS or t.dim() != 3:
        return "router logits of this form are a floating [B, S, E] tensor"
    return None


def _softmax_bias_3d() -> tuple[Any, Any]:
    """Zaya: ``p = softmax(logits [B, S, E+1], -1)``, ``ids = topk([_to_copy](detach(p), f32) + bias, K)[1]``,
    weights ``gather(p, 2, ids)``, [cast]. The skip-expert masking after it (``masked_fill(ids == E)``) stays."""
    probs = op(aten._softmax.default, self=Var("logits", _any_3d), dim=Lit(LAST_3D),
               half_to_float=Lit(equals(False)), bind="probs")
    read = Opt(Cast(alt(op(aten.detach.default, self=probs), probs), torch.float32))
    sel = op(aten.add.Tensor, self=read, other=Var("bias", _bias_vector), commutative=("self", "other"), bind="sel")
    topk = op(aten.topk.default, self=sel, k=Lit(is_int, bind="top_k"), dim=Lit(LAST_3D), largest=Lit(equals(True)),
              sorted=Lit(is_bool))
    gathered = op(aten.gather.default, self=probs, dim=Lit(LAST_3D), index=Var("ids", _int64_tensor),
                  bind="weights_raw")
    return Opt(Cast(gathered, dtype="weight_dtype")), Item(topk, 1)


def _start(v: Any) -> str | None:
    return None if v is None or (isinstance(v, int) and not isinstance(v, bool)) else f"expected an int, got {v!r}"


def _one_element(v: Any) -> str | None:
    t = tensor_val(v)
    if t is None or not t.dtype.is_floating_point or t.dim() > 1 or t.numel() != 1:
        return "a learned router scale is a floating tensor of one element ([1] or [])"
    return None


def _sink() -> tuple[Any, Any]:
    """Inkling: ``ids = topk(sigmoid(logits)[:, :E] [+ bias], K)[1]``; ``ls = logsigmoid(cat([logits[:, :E].gather(-1,
    ids), logits[:, E:]], -1))``, ``exp(ls - logsumexp(ls, -1, True))`` [* scale] [* global_scale] [cast]."""
    logits = Var("logits", _f32_2d)

    def columns(x: Any, start: str, end: str) -> Any:
        return op(aten.slice.Tensor, self=x, dim=Lit(LAST_2D), start=Lit(_start, bind=start), end=Lit(is_int, bind=end))

    gathered = op(aten.gather.default, self=columns(logits, "routed_start", "routed_end"), dim=Lit(LAST_2D),
                  index=Var("ids", _int64_tensor), bind="weights_raw")
    chosen = op(aten.cat.default, tensors=[gathered, columns(logits, "shared_start", "shared_end")], dim=Lit(LAST_2D))
    log_p = Item(op(aten.log_sigmoid_forward.default, self=chosen), 0, bind="log_p")
    lse = op(aten.logsumexp.default, self=log_p, dim=Lit(one_of([-1], [1])), keepdim=Lit(equals(True)))
    w = op(aten.exp.default, self=op(aten.sub.Tensor, self=log_p, other=lse), bind="sink_probs")
    scaled = alt(op((aten.mul.Tensor, aten.mul.Scalar), self=w, other=Lit(is_number, bind="scale")), w)
    scaled = alt(op(aten.mul.Tensor, self=scaled, other=Var("global_scale", _one_element),
                    commutative=("self", "other")), scaled)
    routed = columns(op(aten.sigmoid.default, self=logits, bind="probs"), "routed_start", "routed_end")
    sel = alt(op(aten.add.Tensor, self=routed, other=Var("bias", _bias_vector), commutative=("self", "other")), routed)
    return Opt(Cast(scaled, dtype="weight_dtype")), Item(_topk(sel), 1)


# --------------------------------------------------------------------------- guards
def sink_shapes(m: Match) -> str | tuple[Any, str] | None:
    """The routed columns are ``[0, E)``, the shared ``[E, E + S)`` with S >= 1, K <= E, a [E] bias."""
    total = concrete_int(tensor_val(m["logits"]).shape[1])
    if total is None:
        return "a symbolic number of router classes"

    def bound(v: Any, default: int) -> int:
        v = default if v is None else v
        return max(0, min(total, v + total if v < 0 else v))

    start, e = bound(m["routed_start"], 0), bound(m["routed_end"], total)
    s_start, s_end = bound(m["shared_start"], 0), bound(m["shared_end"], total)
    if start != 0 or not 0 < e < total or s_start != e or s_end != total:
        return (f"columns [{start}, {e}) are routed and [{s_start}, {s_end}) shared: a sink router splits the "
                f"{total} logits into routed [0, E) and shared [E, {total})")
    if not m["top_k"] <= e:
        return f"top-{m['top_k']} of {e} routed experts"
    if "bias" in m.bindings and tensor_val(m["bias"]).shape[0] != e:
        return m["bias"], f"bias of shape {list(tensor_val(m['bias']).shape)} is not [{e}]"
    return None


def router_shapes(m: Match) -> str | tuple[Any, str] | None:
    """[T, E] logits, K <= E, a [E] bias, groups that tile the experts, [T, K] outputs."""
    logits = tensor_val(m["logits"])
    t, e = logits.shape[0], logits.shape[-1]
    k = m["top_k"]
    if not statically_known_true(k <= e):
        return f"top-{k} of {e} experts"
    if "bias" in m.bindings and not statically_known_true(tensor_val(m["bias"]).shape[0] == e):
        return m["bias"], f"bias of shape {list(tensor_val(m['bias']).shape)} is not [{e}]"
    if "probs_view" in m.bindings and not same_shape(m["probs_view"], [t, e], [-1, e], [t, -1]):
        return f"scores viewed as {list(m['probs_view'])} before the bias, expected [{t}, {e}]"
    if "gscore" in m.bindings:
        view = list(m["group_view"])
        g = concrete_int(view[1]) if len(view) == 3 else None
        per = concrete_int(view[2]) if g else None
        if g and per == -1:  # ``view(T, G, -1)`` (DeepSeek-V3 remote code)
            per = concrete_int(e) // g if concrete_int(e) is not None and concrete_int(e) % g == 0 else None
        if (g is None or per is None or per < 1 or not (sym_eq(view[0], -1) or sym_eq(view[0], t))
                or not statically_known_true(g * per == e)):
            return f"group view {view} does not split [{t}, {e}] into [T, groups, experts per group]"
        if not same_shape(m["group_expand"], [-1, g, per], [t, g, per]):
            return f"group mask expanded to {list(m['group_expand'])}, expected [-1, {g}, {per}]"
        if not same_shape(m["group_flat"], [t, e], [-1, e], [t, -1]):
            return f"group mask flattened to {list(m['group_flat'])}, expected [{t}, {e}]"
        if not 1 <= m["topk_group"] <= g:
            return f"keeps {m['topk_group']} of {g} groups"
    w = tensor_val(m["weights_raw"])
    if w.dim() != logits.dim() or not statically_known_true(w.shape[-1] == k):
        return f"weights of shape {list(w.shape)} are not [..., {k}] beside logits {list(logits.shape)}"
    if "expert_scale" in m.bindings:
        if m["scale_ids"] is not m["ids"]:
            return m["scale_ids"], "the per-expert scale is indexed by other ids than the router's top-k ids"
        if not statically_known_true(tensor_val(m["expert_scale"]).shape[0] == e):
            return m["expert_scale"], f"per-expert scale of shape {list(tensor_val(m['expert_scale']).shape)} is not [{e}]"
    return None


def _scaled_by_tensor(user: Any, w: Any) -> bool:
    """``w * s`` with ``s`` a 0-d floating tensor. Under ``dynamic=True`` Dynamo turns a module's float
    attribute (DeepSeek-V2's ``routed_scaling_factor``) into a graph input, so the scale is a tensor that
    the op's ``float scale`` cannot take: the match ends before the multiply, which stays an ATen op."""
    if user.target is not aten.mul.Tensor or len(user.args) != 2:
        return False
    other = user.args[1] if user.args[0] is w else user.args[0]
    s = tensor_val(other)
    return s is not None and s.dim() == 0 and s.dtype.is_floating_point


def whole_tail(m: Match) -> str | None:
    """A match ending at the raw top-k values must not leave a renormalisation half outside
    (a multiply by a tensor scale may stay outside: :func:`_scaled_by_tensor`)."""
    if m.root is not m["weights_raw"]:
        return None
    arith = [u.name for u in m.root.users if u.target in ARITH and not _scaled_by_tensor(u, m.root)]
    if arith:
        return f"the routing weights feed {', '.join(arith)} (a normalisation this pattern does not cover)"
    return None


VARIANT_SCORES = {"topk_softmax": "topk_softmax", "topk_sigmoid": "topk_sigmoid", "topk_bias_sigmoid": "topk_sigmoid"}
"""Variants whose canonical score is not read off the score node (a top-k of the logits first)."""


def score_dtype(m: Match) -> torch.dtype | None:
    """The canonical ``score_dtype``: ``None`` when the scores are fp32 (fp32 logits, or an upcast first), else the
    dtype the model computes them in (bf16/fp16: Aria's and GPT-OSS's softmax of bf16 top-k values, Mistral-4's and
    Zaya's softmax of bf16 logits, DeepSeek-V4's bf16 ``sqrt(softplus)``), which the op then computes in as well."""
    dtype = tensor_val(m["probs"]).dtype
    return None if dtype == torch.float32 else dtype


def scores_in_model_dtype(m: Match) -> tuple[Any, str] | None:
    """Scores computed in a dtype other than fp32 are the logits' own (what ``score_dtype`` means), and a selection
    bias is added with torch's promotion of the scores and the bias (the reference adds ``probs + bias``; an upcast
    of bf16 scores before a bf16 bias would round elsewhere)."""
    dtype, logits = score_dtype(m), tensor_val(m["logits"]).dtype
    if dtype is not None and dtype != logits:
        return m["probs"], f"scores in {dtype} from {logits} logits (expected fp32 or the logits' dtype)"
    if dtype is not None and "bias" in m.bindings and "sel" in m.bindings:
        want = torch.promote_types(dtype, tensor_val(m["bias"]).dtype)
        if tensor_val(m["sel"]).dtype != want:
            return m["sel"], (f"selection computed in {tensor_val(m['sel']).dtype} from {dtype} scores and a "
                              f"{tensor_val(m['bias']).dtype} bias (torch's promotion gives {want})")
    return None


# --------------------------------------------------------------------------- replacement
def _build(m: Match) -> Replacement:
    probs = m["probs"]
    score = {aten._softmax.default: "softmax", aten.sqrt.default: "sqrt_softplus"}.get(probs.target, "sigmoid")
    score = VARIANT_SCORES.get(m.pattern.variant, score)
    group_score, n_group, topk_group = "none", 1, 1
    if "gscore" in m.bindings and int(m["group_view"][1]) > 1:
        # one group (Mistral-Large-4, DeepSeek-V3 configs with n_group=1) keeps every expert: the mask is a no-op
        # and the router is exactly the ungrouped one
        group_score = "sum_top2" if m["gscore"].target is aten.sum.dim_IntList else "max"
        if m.pattern.variant.endswith("_fill0"):
            group_score = "sum_top2_fill0"
        n_group, topk_group = int(m["group_view"][1]), int(m["topk_group"])
    clamp = "clamp_eps" in m.bindings
    args = (m["logits"], m.get("bias"), int(m["top_k"]), score, n_group, topk_group, group_score,
            "renorm" in m.bindings, float(m.get("clamp_eps" if clamp else "renorm_eps", 0.0)),
            float(m.get("scale", 1.0)), m.get("weight_dtype"))
    low = score_dtype(m)
    # the schema's trailing ``renorm_clamp=False, expert_scale=None, score_dtype=None``: other calls keep 11 arguments
    if clamp or "expert_scale" in m.bindings or low is not None:
        args = (*args, clamp)
    if "expert_scale" in m.bindings or low is not None:
        args = (*args, m.get("expert_scale"))
    if low is not None:
        args = (*args, low)
    log.debug("ep_fuse: moe_gating%s at %s", args[2:], m.root.name)
    return Replacement(moe_gating_ops.moe_gating.op, args, ("root", "ids"))


def _build_sink(m: Match) -> Replacement:
    total = concrete_int(tensor_val(m["logits"]).shape[1])
    e = m["routed_end"] + total if m["routed_end"] < 0 else min(m["routed_end"], total)
    args = (m["logits"], m.get("bias"), int(m["top_k"]), total - e, float(m.get("scale", 1.0)),
            m.get("global_scale"), m.get("weight_dtype"))
    log.debug("ep_fuse: moe_gating_sink%s at %s", args[2:5], m.root.name)
    return Replacement(moe_gating_ops.moe_gating_sink.op, args, ("root", "ids"))


def _router_head(node: Any) -> bool:
    """A 2-D ``_softmax``/``sigmoid`` feeding a ``topk`` (directly or through a bias add), looking through
    views (DeepSeek-V3's remote ``scores.view(T, -1) + bias``): a router. Anchors decide where a failed match
    is reported as a near miss, so they must accept every look-alike the forms could be written as."""
    t = tensor_val(node)
    if t is None or t.dim() != 2:
        return False
    for user in readers(node):
        if user.target is aten.topk.default:
            return True
        if user.target is aten.add.Tensor and any(u.target in (aten.topk.default, *VIEWS) for u in readers(user)):
            return True
    return False


def _topk_then_score(node: Any) -> bool:
    """A 2-D ``topk`` whose values feed a ``_softmax``/``sigmoid`` (directly or through a cast): a Granite- or
    Cohere2-style router."""
    t = tensor_val(node.args[0])
    if t is None or t.dim() != 2:
        return False
    for item in node.users:
        if item.args[1] == 0:
            readers_ = [*item.users, *(u for c in item.users if c.target in CAST_TARGETS for u in c.users)]
            if any(u.target in (aten._softmax.default, aten.sigmoid.default) for u in readers_):
                return True
    return False


def _topk_of_biased_logits(node: Any) -> bool:
    """A 2-D ``topk`` of ``logits + bias`` whose logits (or the sum: a look-alike) are also gathered into a
    ``sigmoid`` (Kolibri-1)."""
    sel = node.args[0]
    if getattr(sel, "target", None) is not aten.add.Tensor or tensor_val(sel) is None or tensor_val(sel).dim() != 2:
        return False
    return any(g.target is aten.gather.default and any(u.target is aten.sigmoid.default or u.target in CAST_TARGETS
                                                        for u in g.users)
               for a in (sel, *sel.args) if hasattr(a, "users") for g in a.users)


ANCHORS = (Anchor(aten._softmax.default, _router_head), Anchor(aten.sigmoid.default, _router_head),
           Anchor(aten.sqrt.default, _router_head), Anchor(aten.topk.default, _topk_then_score),
           Anchor(aten.topk.default, _topk_of_biased_logits))

def _two_dims(node: Any) -> bool:
    t = tensor_val(node.args[0])
    return t is not None and t.dim() == 2


def _router_head_3d(node: Any) -> bool:
    """A 3-D ``_softmax`` read (through ``detach``/a cast) by an add feeding a ``topk``: a [B, S, E] router (Zaya)."""
    t = tensor_val(node)
    if t is None or t.dim() != 3:
        return False
    near, frontier = [], list(node.users)
    for _ in range(3):  # through ``detach`` and a cast, in either order
        near.extend(frontier)
        frontier = [u for c in frontier if c.target in (aten.detach.default, *CAST_TARGETS) for u in c.users]
    return any(u.target is aten.add.Tensor and any(v.target is aten.topk.default for v in u.users) for u in near)


def _sliced_router_head(node: Any) -> bool:
    """A 2-D ``sigmoid`` whose column slice feeds a ``topk`` (directly or through a bias add): the routed part of a
    router whose last columns are shared experts (Inkling)."""
    t = tensor_val(node)
    if t is None or t.dim() != 2:
        return False
    sliced = [u for u in node.users if u.target is aten.slice.Tensor]
    near = [*sliced, *(v for u in sliced for v in u.users if v.target is aten.add.Tensor)]
    return any(v.target is aten.topk.default for u in near for v in u.users)


SINK_ANCHORS = (Anchor(aten.log_sigmoid_forward.default, _two_dims), Anchor(aten.sigmoid.default, _sliced_router_head))
ANCHORS_3D = (Anchor(aten._softmax.default, _router_head_3d),)

_FORMS = {
    "softmax_topk": (_softmax_topk, "softmax -> topk -> [renorm] [scale] [cast] (Mixtral, Qwen, DeepSeek-V2 greedy)"),
    "softmax_group_max": (_softmax_group_max, "softmax, group max, masked_fill 0.0, topk (DeepSeek-V2 group-limited)"),
    "sigmoid_group_sum_top2": (_sigmoid_group_sum_top2,
                               "sigmoid + bias, group sum of top-2, masked_fill -inf, topk, gather (DeepSeek-V3, GLM4)"),
    "softmax_bias": (_softmax_bias, "softmax + selection bias, topk, gather from the unbiased softmax"),
    "topk_softmax": (_topk_softmax, "topk of the logits, softmax of the K values (Granite-MoE, Cohere2-MoE)"),
    "sigmoid_group_sum_top2_fill0": (_sigmoid_group_sum_top2_fill0,
                                     "as sigmoid_group_sum_top2 with masked_fill 0.0 (DeepSeek-V3 remote code)"),
    "topk_sigmoid": (_topk_sigmoid, "topk of the logits, sigmoid of the K values [renorm] (Cohere2-MoE sigmoid)"),
    "sigmoid_topk": (_sigmoid_topk, "sigmoid -> topk -> [renorm] [scale] [cast] (Flint)"),
    "sqrt_softplus_bias": (_sqrt_softplus_bias,
                           "sqrt(softplus) [+ bias], topk, gather, renorm, scale (DeepSeek-V4, Inkling-2 sqrtsoftplus)"),
    "softmax_group_sum_top2_fill0": (_softmax_group_sum_top2_fill0,
                                     "softmax, group sum of top-2, masked_fill 0.0, topk, gather (Mistral-4)"),
    "topk_bias_sigmoid": (_topk_bias_sigmoid, "topk of logits + bias, sigmoid of the chosen logits (Kolibri-1)"),
}


_FORMS["softmax_bias_3d"] = (_softmax_bias_3d, "[B, S, E] softmax + selection bias, topk, gather (Zaya)")


def _pattern(variant: str) -> Pattern:
    make, description = _FORMS[variant]
    weights, ids = make()
    return Pattern(name="moe_gating", variant=variant, tree=weights, build=_build,
                   guards=(router_shapes, whole_tail, scores_in_model_dtype),
                   anchors=ANCHORS_3D if variant.endswith("_3d") else ANCHORS, outputs=(("ids", ids),),
                   description=description, produces="ep_fuse::moe_gating")


def _sink_pattern() -> Pattern:
    weights, ids = _sink()
    return Pattern(name="moe_gating", variant="sigmoid_sink", tree=weights, build=_build_sink, guards=(sink_shapes,),
                   anchors=SINK_ANCHORS, outputs=(("ids", ids),),
                   description="sigmoid + bias, topk; softmax of logsigmoid over [chosen, shared] logits, scale (Inkling)",
                   produces="ep_fuse::moe_gating_sink")


# --------------------------------------------------------------------------- forms recognised and declined
def _hash_routed() -> Any:
    """DeepSeek-V4's hash layers: ``gather(score(logits), 1, [_to_copy](table[token_ids]))`` (no top-k), then the tail."""
    logits = Var("logits", _any_2d)
    scores = alt(op(aten.sqrt.default, self=op(aten.softplus.default, self=logits)),
                 op(aten.sigmoid.default, self=logits),
                 op(aten._softmax.default, self=logits, dim=Lit(LAST_2D), half_to_float=Lit(equals(False))))
    ids = Opt(Cast(op(aten.index.Tensor, self=Var("table", _int64_tensor), indices=[Var("token_ids")],
                         shared=True), torch.int64))
    return _tail(op(aten.gather.default, self=scores, dim=Lit(LAST_2D), index=ids, bind="weights_raw"))


def _sparsemixer() -> Any:
    """PhiMoE's ``sparsemixer`` at inference, one of its two passes: ``m, i = max(x, -1, True)``;
    ``gather(softmax(masked_fill(x, (m - x) / clamp(|x|, min=m) > 2 eps, -inf)), -1, i)`` (``i`` read as an input:
    the argmax ids also feed the second pass and the output)."""
    logits = Var("logits", _any_2d)
    best = op(aten.max.dim, self=Var("scores", _any_2d), dim=Lit(LAST_2D), keepdim=Lit(equals(True)), bind="max",
              shared=True)
    rel = op(aten.div.Tensor, self=op(aten.sub.Tensor, self=Item(best, 0), other=logits),
             other=op(aten.clamp.Tensor, self=op(aten.abs.default, self=logits), min=Item(best, 0)))
    masked = op(aten.masked_fill.Scalar, self=Var("scores", _any_2d), mask=op(aten.gt.Scalar, self=rel, other=Lit(is_number)),
                value=Lit(_neg_inf))
    probs = op(aten._softmax.default, self=masked, dim=Lit(LAST_2D), half_to_float=Lit(equals(False)))
    return op(aten.gather.default, self=probs, dim=Lit(LAST_2D), index=Var("ids", _int64_tensor))


def _dense_topk_sigmoid() -> Any:
    """Llama-4: ``v, i = topk(x, K, 1)``; ``[_to_copy](sigmoid([_to_copy](full_like(x, -inf).scatter(1, i, v))))``."""
    logits = Var("logits", _any_2d)
    topk = op(aten.topk.default, self=logits, k=Lit(is_int), dim=Lit(LAST_2D), bind="topk")
    dense = op(aten.scatter.src, self=op(aten.full_like.default, self=logits, fill_value=Lit(_neg_inf),
                                         ignore=("pin_memory",)),
               dim=Lit(LAST_2D), index=Item(topk, 1), src=Item(topk, 0))
    return op(aten.sigmoid.default, self=Opt(Cast(dense, torch.float32)))


def _reads_table(node: Any) -> bool:
    """A 2-D ``gather`` whose index is (a cast of) an ``index`` into an int64 table: routing by token id."""
    idx = node.args[2] if len(node.args) > 2 else None
    idx = idx.args[0] if getattr(idx, "target", None) in CAST_TARGETS else idx
    table = tensor_val(getattr(idx, "args", (None,))[0]) if getattr(idx, "target", None) is aten.index.Tensor else None
    return table is not None and table.dtype == torch.int64 and _two_dims(node)


def _softmax_of_masked_logits(node: Any) -> bool:
    """A 2-D ``_softmax`` of a ``masked_fill`` read by a ``gather``: a sparsemixer pass (PhiMoE)."""
    src = node.args[0]
    return (getattr(src, "target", None) is aten.masked_fill.Scalar and _two_dims(node)
            and any(u.target is aten.gather.default for u in node.users))


def _topk_scattered(node: Any) -> bool:
    """A 2-D ``topk`` whose values are scattered back into a dense [T, E] tensor (Llama-4)."""
    return _two_dims(node) and any(i.args[1] == 0 and any(u.target is aten.scatter.src for u in i.users)
                                   for i in node.users)


DECLINED = {
    "hash_routed": (_hash_routed, (Anchor(aten.gather.default, _reads_table),),
                    "hash routing: the experts come from a frozen token-id table (table[input_ids]), not a learned "
                    "top-k, so there is no router to fuse; the block's experts fuse with these ids"),
    "sparsemixer": (_sparsemixer, (Anchor(aten._softmax.default, _softmax_of_masked_logits),),
                    "sparsemixer (PhiMoE): two argmax passes, each weighed by a softmax over the experts within a "
                    "relative jitter threshold of that max (the inference half of its training-time gradient "
                    "estimator), not a top-k + normalise router; ep_fuse::moe_gating has no such score"),
    "dense_topk_sigmoid": (_dense_topk_sigmoid, (Anchor(aten.topk.default, _topk_scattered),),
                           "dense router scores (Llama-4): the top-k logits scattered into a [T, E] -inf tensor and "
                           "sigmoided for experts that run on every expert's rows; ep_fuse::moe_gating returns "
                           "(weights [T, K], ids), not a dense [T, E] score"),
}
"""Router forms recognised only to say why they are not fused: each tree matches the form, and its guard names it."""


def _declined_pattern(variant: str) -> Pattern:
    make, anchors, reason = DECLINED[variant]

    def not_fusable(_m: Match) -> str:
        return reason

    def build(_m: Match) -> Replacement:  # pragma: no cover - its guard always declines
        raise AssertionError(f"moe_gating[{variant}] is a declined form")

    return Pattern(name="moe_gating", variant=variant, tree=make(), build=build, guards=(not_fusable,),
                   anchors=anchors, description=f"declined: {reason.split(':')[0]}", produces="(declined)")


PATTERNS = [*(_pattern(v) for v in _FORMS), _sink_pattern(), *(_declined_pattern(v) for v in DECLINED)]

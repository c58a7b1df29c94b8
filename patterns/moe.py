"""Routed MoE experts: permute -> gate|up GEMM -> SwiGLU -> down GEMM -> weighted unpermute.

The whole block becomes ``ep_fuse::moe_experts(x, topk_ids, topk_weights, w13, w2, out_dtype)``
(expanded into the stage ops ``moe_permute`` / ``grouped_gemm_swiglu`` / ``grouped_gemm`` /
``moe_unpermute`` before lowering). Forms (``docs/patterns.md``):

* ``grouped_mm`` (HF transformers 5.x default)::

      perm = sort(view(ids, [-1]))[1]; rows = index(x, [floor_divide(perm, K)])
      offs = cumsum(histc(_to_copy(sort[0]), E, 0, E-1), 0, dtype=int32)
      h = _grouped_mm(rows, transpose(w13, -2, -1), offs); act = silu(split(h, I)[0]) * split(h, I)[1]
      y = _grouped_mm(act, transpose(w2, -2, -1), offs) * unsqueeze(index(view(w, [-1]), [perm]), -1)
      out = sum(view(index(y, [index_put(empty_like(perm), [perm], arange(S))]), [T, K, H]), [1])

  with an optional final cast; HF 5.17 on CUDA also zeroes slots with ids >= E ("sentinels") with
  ``masked_fill(·, unsqueeze(ge(sorted_ids, E), -1), 0.0)`` on the rows and both GEMM outputs; fp32/fp16 models call the opaque ``transformers::grouped_mm_fallback``
  instead of ``_grouped_mm``; the histc input is ``float`` on CPU and ``int`` on CUDA;
* hand-written sort-based forms (Megatron/DeepSpeed/sglang styles, ``tests/support/moe_modules.py``): a stable
  ``argsort`` instead of ``sort``; counts from ``histc``, ``one_hot(ids, E).sum(0)`` or ``scatter_add`` of
  ones; rows gathered with ``index``/``index_select`` or scattered by the inverse permutation
  (``rows[src2dst] = x.repeat_interleave(K)``); outputs returned by the inverse-permutation gather +
  top-k ``sum`` (weights before or after the gather), ``index_add`` on the token index, or
  ``scatter_add`` into ``zeros_like(x)``;
* ``batched_mm`` (HF's decode path; HF 5.17 on CUDA first clamps the ids into [0, E-1], matched only
  when the ids are a top-k output, where the clamp changes nothing): ``x`` repeated K times (``unsqueeze/expand/clone/view``), the
  expert weights gathered per row (``index(w13, [ids])``) into ``bmm`` … ``view(T, K, H).sum(1)``.

The gated activation between the GEMMs is SwiGLU or one of its transformers 5.24 variants (``ops.moe.ACTS``:
clamped before or after the SiLU, fp32, soft-capped, GPT-OSS's clamped ``(up + 1) * g * sigmoid(1.702 g)`` on
gate|up halves (MiniMax-M3), Gemma-4's GeGLU ``gelu(g, approximate="tanh") * up`` and the erf GELU's;
:func:`_swiglu`), or NemotronH's non-gated ``relu(up) ** 2``
on an up projection [E, I, H] (:func:`_relu2`), carried as the block's ``act`` arguments.

Not matched: GPT-OSS (interleaved gate/up halves and per-expert biases; its activation alone is ``swigluoai``) and
Llama4's dense ``bmm`` over all experts (every token through every expert, scores pre-multiplied).
Shared experts and routed-scaling factors live outside these nodes and stay untouched.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ep_fuse.fx_utils import tensor_val
from ep_fuse.matching import Anchor, Cast, Derived, Item, Lit, Match, Pattern, Replacement, Var, op
from ep_fuse.matching.checks import (
    MODEL_FLOATS,
    VIEWS,
    concrete_int,
    is_dtype,
    is_int,
    is_shape,
    is_size,
    is_value,
    one_of,
    same_shape,
    sym_eq,
    tensor_of,
)
from ep_fuse.matching.pattern import Opt, alt, equals
from ep_fuse.ops import moe as moe_ops
from ep_fuse.ops import moe_gating as moe_gating_ops

aten = torch.ops.aten

DESCRIPTION = "routed MoE experts (permute, grouped GEMM + SwiGLU, unpermute) -> ep_fuse::moe_experts"

INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)
_float_tensor = tensor_of(MODEL_FLOATS, "fp16/bf16/fp32")
_int_tensor = tensor_of(INT_DTYPES, "integer")


def _grouped_mm(a: Any, b: Any, offs: Any) -> Any:
    """``aten._grouped_mm(a, b, offs)`` or, when transformers registered it, its fp32/fp16 fallback op."""
    options = [op(aten._grouped_mm.default, self=a, mat2=b, offs=offs)]
    try:
        import transformers.integrations.moe  # noqa: F401  (registers transformers::grouped_mm_fallback)

        options.append(op(torch.ops.transformers.grouped_mm_fallback.default, input=a, weight=b, offs=offs))
    except (ImportError, AttributeError, RuntimeError):
        pass
    return alt(*options)


def _transposed(name: str) -> Any:
    """``transpose(W, -2, -1)`` of a 3-D expert weight (torch Linear layout [E, out, in]), or a weight stored
    [E, in, out] and used as it is (HF ``is_transposed=True``, Aria): bound as ``<name>_kn``."""
    return alt(op(aten.transpose.int, self=Var(name, _float_tensor), dim0=Lit(one_of(-2, 1)), dim1=Lit(one_of(-1, 2))),
               Var(f"{name}_kn", _float_tensor))


def weight(m: Match, name: str) -> Any:
    """The expert weight ``name`` (``w13`` / ``w2``) in torch Linear layout [E, out, in]: the bound node, or a
    ``transpose`` of the [E, in, out] weight the model stores (:func:`_transposed`)."""
    if name in m.bindings:
        return m[name]
    return Derived(aten.transpose.int, (m[f"{name}_kn"], -2, -1))


def weight_val(m: Match, name: str) -> Any:
    """The fake value of :func:`weight` (``[E, out, in]``)."""
    if name in m.bindings:
        return tensor_val(m[name])
    return tensor_val(m[f"{name}_kn"]).transpose(-2, -1)


def is_number(v: Any) -> str | None:
    """A concrete int or float literal (a clamp bound, a soft cap)."""
    ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    return None if ok else f"expected a number, got {v!r}"


def _mul(a: Any, b: Any, **kw: Any) -> Any:
    return op(aten.mul.Tensor, self=a, other=b, commutative=("self", "other"), **kw)


def _clamp(v: Any, lo: str | None, hi: str) -> Any:
    """``v.clamp(max=hi)`` (``lo`` None) or ``v.clamp(min=lo, max=hi)``, the bounds bound as literals."""
    bounds = {"max": Lit(is_number, bind=hi)}
    if lo is not None:
        bounds["min"] = Lit(is_number, bind=lo)
    return op(aten.clamp.default, self=v, **bounds)


def _softcapped(v: Any, cap: str) -> Any:
    """``tanh(v / cap) * cap`` (Inkling-2's ``Softcap``; ``cap * tanh(v / cap)`` traces the same), or ``v``."""
    tanh = op(aten.tanh.default, self=op(aten.div.Tensor, self=v, other=Lit(is_number, bind=cap)))
    return alt(op(aten.mul.Tensor, self=tanh, other=Lit(is_number, bind=f"{cap}_scale")), v)


def _gelu_approximation(v: Any) -> str | None:
    """``approximate`` of ``aten.gelu``: one the kernels compute (``ops.moe.GELU_ACTS``)."""
    known = tuple(moe_ops.GELU_ACTS.values())
    return None if v in known else f"gelu(approximate={v!r}), expected one of {known}"


def _swiglu(h: Any) -> Any:
    """The gated activations of ``ops.moe.ACTS`` on the halves of ``split(h, I, -1)``; which one matched is
    read from the bindings (:func:`activation`)."""
    split = op(aten.split.Tensor, self=h, split_size=Lit(is_int, bind="inter"), dim=Lit(one_of(-1, 1)),
               bind="gate_up")
    gate, up = Item(split, 0), Item(split, 1)
    silu = op(aten.silu.default, self=gate)
    plain = _mul(silu, up)
    # DeepSeek-V4 / GLM-5-Next / HY-V4: clamp both halves, then SwiGLU (``limit`` in the config)
    clamped = _mul(op(aten.silu.default, self=_clamp(gate, None, "gate_max")), _clamp(up, "up_min", "up_max"),
                   bind="act_clamp")
    # Step-3.7: the SiLU output clamped (max only), the up half clamped both ways
    clamped_post = _mul(_clamp(silu, None, "post_max"), _clamp(up, "up_min", "up_max"), bind="act_clamp_post")
    # Beam: ``(silu(gate.float()) * up.float()).to(gate.dtype)``
    # (in an fp32 model ``.float()`` and the cast back trace to nothing)
    g32, u32 = Opt(Cast(gate, dtype=torch.float32), bind="gate32"), Opt(Cast(up, dtype=torch.float32), bind="up32")
    fp32 = Cast(_mul(op(aten.silu.default, self=Cast(gate, dtype=torch.float32)), Cast(up, dtype=torch.float32),
                     bind="act_fp32"), dtype="act_dtype")
    # Inkling-2: ``(softcap(g) * sigmoid(g) * softcap(u)).to(dtype)`` with g, u in fp32
    capped = Opt(Cast(_mul(_mul(_softcapped(g32, "gate_cap"), op(aten.sigmoid.default, self=g32)),
                           _softcapped(u32, "up_cap"), bind="act_softcap"), dtype="act_dtype"))
    # MiniMax-M3 (GPT-OSS's activation on gate|up halves): ``(u.clamp(-L, L) + 1) * (g' * sigmoid(g' * alpha))``
    g_oai = op(aten.clamp.default, self=gate, max=Lit(is_number, bind="gate_max"), bind="oai_gate")
    glu = _mul(g_oai, op(aten.sigmoid.default, self=_mul(g_oai, Lit(is_number, bind="oai_alpha"))))
    oai = _mul(op(aten.add.Tensor, self=_clamp(up, "up_min", "up_max"), other=Lit(equals(1.0))), glu,
               bind="act_oai")
    # Gemma-4 (GeGLU): ``gelu(g, approximate="tanh") * u``, or erf GELU; Python-written GELU formulas do not match
    gelu = _mul(op(aten.gelu.default, self=gate, approximate=Lit(_gelu_approximation, bind="gelu_approximate")), up,
                bind="act_gelu")
    return alt(plain, clamped, clamped_post, fp32, capped, oai, gelu, _relu2(h))


def _relu2(h: Any) -> Any:
    """NemotronH's non-gated experts: ``relu(up) ** 2`` (``torch.square``, ``** 2`` or ``r * r``) on the whole
    up GEMM output (no split: ``w13`` is the up projection [E, I, H])."""
    relu = op(aten.relu.default, self=h, bind="relu_up")
    return alt(op(aten.pow.Tensor_Scalar, self=relu, exponent=Lit(equals(2))),
               op(aten.mul.Tensor, self=relu, other=relu), bind="act_relu2")


def _fill(target: Any, **args: Any) -> Any:
    """A fresh buffer (``empty``/``zeros``/``arange``): device, pinning and layout are free."""
    ignore = args.pop("ignore", ("device", "pin_memory", "layout"))
    return op(target, ignore=ignore, **args)


def _repeat_interleave(x: Any) -> Any:
    """``x.repeat_interleave(K, 0)`` as traced: ``view(clone(expand(unsqueeze(x, 1), [T, K, H])), [T*K, H])``."""
    return op(VIEWS, size=Lit(is_shape), self=op(
        aten.clone.default, memory_format=Lit(is_value(torch.contiguous_format)),
        self=op(aten.expand.default, size=Lit(is_shape, bind="expand_size"),
                self=op(aten.unsqueeze.default, self=x, dim=Lit(equals(1))))))


def _routing_front() -> dict[str, Any]:
    """What every sort-based form shares: the slot order, per-expert offsets, the token of each sorted
    slot, the inverse permutation and the permuted rows (each with its spelling variants)."""
    x = Var("x", _float_tensor)
    flat = op(VIEWS, self=Var("topk_ids", _int_tensor), size=Lit(one_of([-1])), bind="flat_ids", shared=True)
    sort = alt(op(aten.sort.default, self=flat), op(aten.sort.stable, self=flat, stable=Lit(equals(True))),
               bind="sort")
    perm = Item(sort, 1, bind="perm")
    histc = op(aten.histc.default, self=Cast(Item(sort, 0), dtype="histc_dtype"), bins=Lit(is_int, bind="bins"),
               min=Lit(equals(0)), max=Lit(is_int, bind="hist_max"))
    one_hot = op(aten.sum.dim_IntList, dim=Lit(one_of([0])), self=Cast(
        op(aten.eq.Tensor, self=op(aten.unsqueeze.default, self=flat, dim=Lit(equals(-1))),
           other=_fill(aten.arange.default, end=Lit(is_int, bind="bins"), dtype=Lit(is_value(torch.int64)))),
        dtype=torch.int64))
    scattered = op(aten.scatter_add.default, dim=Lit(equals(0)), index=flat,
                   self=_fill(aten.zeros.default, size=Lit(is_shape, bind="count_shape"), dtype=Lit(is_value(torch.int64))),
                   src=op(aten.ones_like.default, self=flat, ignore=("pin_memory",)))
    counts = alt(histc, one_hot, scattered)
    offs = alt(op(aten.cumsum.default, self=counts, dim=Lit(equals(0)), dtype=Lit(is_value(torch.int32))),
               Cast(op(aten.cumsum.default, self=counts, dim=Lit(equals(0))), dtype=torch.int32), bind="offs")
    token = op(aten.floor_divide.default, self=perm, other=Lit(is_size, bind="top_k"), bind="token")
    # under dynamic shapes the slot count T*K is a SymInt node (``arange(mul_608)``): a size literal
    inverse = op(aten.index_put.default, self=op(aten.empty_like.default, self=perm, ignore=("pin_memory",)),
                 indices=[perm], values=_fill(aten.arange.default, end=Lit(is_size, bind="slots"),
                                              ignore=("device", "pin_memory", "dtype", "layout")), bind="inverse")
    rows = alt(op(aten.index.Tensor, self=x, indices=[token]),
               op(aten.index_select.default, self=x, dim=Lit(equals(0)), index=token),
               op(aten.index_put.default, self=_fill(aten.empty.memory_format, size=Lit(is_shape), dtype=Lit(is_dtype)),
                  indices=[inverse], values=_repeat_interleave(x)))
    # HF 5.17 (CUDA): slots routed to ids >= E ("sentinels" of EP) are zeroed around each GEMM
    sentinel = op(aten.unsqueeze.default, dim=Lit(equals(-1)), bind="sentinel",
                  self=op(aten.ge.Scalar, self=Item(sort, 0), other=Lit(is_int, bind="sentinel_e")))

    def masked(p: Any) -> Any:
        return alt(op(aten.masked_fill.Scalar, self=p, mask=sentinel, value=Lit(equals(0.0))), p)

    return {"perm": perm, "offs": offs, "token": token, "inverse": inverse, "rows": masked(rows), "masked": masked}


def _expert_outputs(rows: Any, offs: Any, masked: Any) -> Any:
    gate_up = masked(_grouped_mm(rows, _transposed("w13"), offs))
    return masked(_grouped_mm(_swiglu(gate_up), _transposed("w2"), offs))


def _weighted(y: Any, weights_by_row: Any) -> Any:
    """``y * unsqueeze(w_row, -1)``, the weight optionally cast first (to the activation dtype)."""
    w = Opt(Cast(op(aten.unsqueeze.default, self=weights_by_row, dim=Lit(equals(-1))), dtype="weight_dtype"))
    return op(aten.mul.Tensor, self=y, other=w, commutative=("self", "other"))


def _topk_sum(per_slot: Any) -> Any:
    """``sum(view(per_slot, [T, K, H]), [1])``."""
    return op(aten.sum.dim_IntList, dim=Lit(one_of([1], [-2])),
              self=op(VIEWS, self=per_slot, size=Lit(is_shape, bind="tkh")))


def _grouped_trees() -> dict[str, Any]:
    """Sort-based forms, by how the expert outputs return to their tokens."""
    f = _routing_front()
    y = _expert_outputs(f["rows"], f["offs"], f["masked"])
    w_flat = op(VIEWS, self=Var("topk_weights", _float_tensor), size=Lit(one_of([-1])))
    sorted_weighted = _weighted(y, op(aten.index.Tensor, self=w_flat, indices=[f["perm"]]))
    gathered_back = _topk_sum(op(aten.index.Tensor, self=sorted_weighted, indices=[f["inverse"]]))
    # sglang style: gather back by src2dst first, weight in [T, K] layout
    by_slot = Opt(Cast(op(VIEWS, self=op(aten.index.Tensor, self=y, indices=[f["inverse"]]),
                          size=Lit(is_shape, bind="tkh")), dtype="gathered_dtype"))
    weighted_late = op(aten.sum.dim_IntList, dim=Lit(one_of([1], [-2])), self=op(
        aten.mul.Tensor, self=by_slot, commutative=("self", "other"),
        other=op(aten.unsqueeze.default, self=Var("topk_weights", _float_tensor), dim=Lit(equals(-1)))))
    index_add = op(aten.index_add.default, dim=Lit(equals(0)), index=f["token"], source=sorted_weighted,
                   self=_fill(aten.zeros.default, size=Lit(is_shape, bind="acc_shape"),
                              dtype=Lit(is_dtype, bind="acc_dtype")))
    token_rows = op(aten.expand.default, size=Lit(is_shape, bind="index_shape"),
                    self=op(aten.unsqueeze.default, self=f["token"], dim=Lit(equals(-1))))
    scatter_add = op(aten.scatter_add.default, dim=Lit(equals(0)), index=token_rows, src=sorted_weighted,
                     self=op(aten.zeros_like.default, self=Var("x"), ignore=("pin_memory",)))
    return {
        "grouped_mm": Opt(Cast(gathered_back, dtype="out_dtype")),
        "weights_after_gather": Opt(Cast(weighted_late, dtype="out_dtype")),
        "index_add": Opt(Cast(index_add, dtype="out_dtype")),
        "scatter_add": scatter_add,
    }


def _batched_tree() -> Any:
    """HF ``batched_mm``: no permute; each slot multiplies its gathered expert weights (``bmm``)."""
    flat = op(VIEWS, self=Var("topk_ids", _int_tensor), size=Lit(one_of([-1])))
    # HF 5.17 (CUDA) clamps the ids into [0, E-1] before gathering the weights
    clamped = op(aten.clamp.default, self=flat, min=Lit(equals(0)), max=Lit(is_int, bind="clamp_max"))
    ids_flat = alt(clamped, flat, bind="flat_ids")

    def per_row(w: str, rows: Any) -> Any:
        gathered = op(aten.index.Tensor, self=Var(w, _float_tensor), indices=[ids_flat])
        prod = op(aten.bmm.default, self=gathered, mat2=op(aten.unsqueeze.default, self=rows, dim=Lit(equals(-1))))
        return op(aten.squeeze.dim, self=prod, dim=Lit(equals(-1)))

    y = per_row("w2", _swiglu(per_row("w13", _repeat_interleave(Var("x", _float_tensor)))))
    w_flat = op(VIEWS, self=Var("topk_weights", _float_tensor), size=Lit(one_of([-1])))
    return Opt(Cast(_topk_sum(_weighted(y, w_flat)), dtype="out_dtype"))


# --------------------------------------------------------------------------- guards
def expert_weights(m: Match) -> str | None:
    """w13 [E, 2I, H] (the up projection [E, I, H] without a gate) and w2 [E, H, I] over the tokens' hidden size,
    one dtype with the tokens."""
    x, w13, w2 = tensor_val(m["x"]), weight_val(m, "w13"), weight_val(m, "w2")
    if x.dim() != 2:
        return f"tokens of shape {list(x.shape)} are not [T, H]"
    if w13.dim() != 3 or w2.dim() != 3:
        return "expert weights are not 3-D [E, out, in]"
    e, two_i, h = w13.shape
    gated = "act_relu2" not in m.bindings
    if not (statically_known_true(h == x.shape[1]) and statically_known_true(w2.shape[0] == e)
            and statically_known_true(w2.shape[1] == h)
            and statically_known_true((2 if gated else 1) * w2.shape[2] == two_i)):
        return f"w13 {list(w13.shape)} / w2 {list(w2.shape)} do not fit tokens of width {x.shape[1]}"
    if gated and not statically_known_true(2 * m["inter"] == two_i):
        return f"split of {m['inter']} does not halve the {two_i} gate|up columns"
    if not (x.dtype == w13.dtype == w2.dtype):
        return f"tokens {x.dtype}, w13 {w13.dtype}, w2 {w2.dtype}: mixed dtypes"
    return None


def routing(m: Match) -> str | None:
    """ids and weights are [T, K] of the tokens; counts, token index and the top-k sum use the same T, K, E.

    Under dynamic shapes T (and the slot count T*K, the view/expand/accumulator sizes) are ``SymInt``s:
    every comparison is decided for all values of the symbols (``sym_eq``/``same_shape``) and adds no
    guard; one that cannot be decided refuses the match."""
    x, ids, w = tensor_val(m["x"]), tensor_val(m["topk_ids"]), tensor_val(m["topk_weights"])
    e = weight_val(m, "w13").shape[0]
    if ids.dim() != 2 or not same_shape(w.shape, ids.shape):
        return f"topk ids {list(ids.shape)} and weights {list(w.shape)} are not one [T, K]"
    t, k = ids.shape
    h = x.shape[1]
    if concrete_int(k) is None:  # the block's stages take K as an int: reading a SymInt would specialise it
        return f"a symbolic top-k {k} (the block takes K as a constant)"
    if not sym_eq(t, x.shape[0]):
        return f"{t} routed rows for {x.shape[0]} tokens"
    if "tkh" in m.bindings and not same_shape(m["tkh"], [t, k, h], [t, k, -1], [-1, k, h]):
        return f"top-k sum over a view {list(m['tkh'])}, expected [{t}, {k}, {h}]"
    if "top_k" in m.bindings and not sym_eq(m["top_k"], k):
        return f"slot // {m['top_k']} does not map slots of top-{k} routing to tokens"
    if "bins" in m.bindings and not sym_eq(m["bins"], e):
        return f"counts over {m['bins']} bins for {e} experts"
    if "sentinel_e" in m.bindings and not sym_eq(m["sentinel_e"], e):
        return f"slots with ids >= {m['sentinel_e']} are masked, the block has {e} experts"
    if "hist_max" in m.bindings and not sym_eq(m["hist_max"], e - 1):
        return f"histc(max={m['hist_max']}) does not count experts 0..{e - 1}"
    if "count_shape" in m.bindings and not same_shape(m["count_shape"], [e]):
        return f"counts of shape {list(m['count_shape'])} for {e} experts"
    if "slots" in m.bindings and not sym_eq(m["slots"], t * k):
        return f"inverse permutation over {m['slots']} slots, expected {t * k}"
    if "expand_size" in m.bindings and not same_shape(m["expand_size"], [t, k, h]):
        return f"tokens repeated as {list(m['expand_size'])}, expected [{t}, {k}, {h}]"
    if "acc_shape" in m.bindings and not same_shape(m["acc_shape"], [t, h]):
        return f"accumulator of shape {list(m['acc_shape'])}, expected [{t}, {h}]"
    if "index_shape" in m.bindings and not same_shape(m["index_shape"], [-1, h], [t * k, h]):
        return f"scatter index expanded to {list(m['index_shape'])}, expected [{t * k}, {h}]"
    return None


def _from_topk(node: Any) -> bool:
    """``node`` is the index output of a top-k (``aten.topk`` or the fused router), through views."""
    for _ in range(4):
        if getattr(node, "op", None) != "call_function":
            return False
        if node.target in VIEWS:
            node = node.args[0]
            continue
        if node.target is operator.getitem and node.args[1] == 1:
            src = node.args[0]
            return getattr(src, "target", None) in (aten.topk.default, moe_gating_ops.moe_gating.op)
        return False
    return False


def clamp_is_noop(m: Match) -> str | None:
    """A ``clamp(ids, 0, E-1)`` is accepted only on top-k ids, where it changes nothing.

    The canonical op skips out-of-range ids where the clamp would route them to experts 0 / E-1."""
    if "clamp_max" not in m.bindings:
        return None
    e = weight_val(m, "w13").shape[0]
    if not sym_eq(m["clamp_max"], e - 1):
        return f"ids clamped to [0, {m['clamp_max']}] for {e} experts"
    if not _from_topk(m["topk_ids"]):
        return "ids clamped into range are not a top-k output: out-of-range ids would differ"
    return None


def combine_dtypes(m: Match) -> str | None:
    """The weighted sum runs in the promotion of the expert output and the (cast) routing weight.

    That is the dtype the canonical op accumulates the product in; a narrower accumulator is refused."""
    x, w = tensor_val(m["x"]), tensor_val(m["topk_weights"])
    prod = torch.promote_types(x.dtype, m.get("weight_dtype") or w.dtype)
    for name in ("acc_dtype", "gathered_dtype"):
        if name in m.bindings and torch.promote_types(m[name], prod) != m[name]:
            return f"{name}={m[name]} is narrower than the weighted product ({prod})"
        if name in m.bindings and m[name] != prod:
            return f"the weighted sum runs in {m[name]}, not in the product dtype {prod}"
    if "index_shape" in m.bindings and prod != x.dtype:
        return f"scatter_add into {x.dtype} of a {prod} product"
    return None


def activation(m: Match) -> tuple[str, float | None, float | None, float | None]:
    """``(act, limit, gate_cap, up_cap)`` of the matched activation (``ops.moe.ACTS``)."""
    if "act_relu2" in m.bindings:
        return "relu2", None, None, None
    if "act_oai" in m.bindings:
        return "swigluoai", float(m["gate_max"]), None, None
    if "act_gelu" in m.bindings:
        by_approximate = {v: k for k, v in moe_ops.GELU_ACTS.items()}
        return by_approximate[m["gelu_approximate"]], None, None, None
    for name, bound in (("silu_clamp", "gate_max"), ("silu_clamp_post", "post_max")):
        if f"act_{name[5:]}" in m.bindings:
            limit = float(m[bound])
            # Step-3.7 clamps to +-inf on its unclamped layers: the identity
            return ("silu", None, None, None) if limit == math.inf else (name, limit, None, None)
    if "act_fp32" in m.bindings:
        return "silu_fp32", None, None, None
    if "act_softcap" in m.bindings:
        gate_cap, up_cap = (float(m[c]) if c in m.bindings else None for c in ("gate_cap", "up_cap"))
        return "softcap_fp32", None, gate_cap, up_cap
    return "silu", None, None, None


def activation_form(m: Match) -> str | None:
    """The clamp bounds are one limit (gate ``max=L``, up ``[-L, L]``), a soft cap multiplies by its own
    divisor, the fp32 forms cast back to the activation dtype."""
    act, limit, gate_cap, up_cap = activation(m)
    x = tensor_val(m["x"])
    if "up_min" in m.bindings:
        lo, hi = m["up_min"], m["up_max"]
        limit = float(m.get("gate_max", m.get("post_max")))
        if not (limit > 0 and lo == -limit and hi == limit):
            return f"clamps gate max={limit}, up [{lo}, {hi}]: not one limit L (gate max=L, up [-L, L])"
    if "oai_alpha" in m.bindings and m["oai_alpha"] != moe_ops.SWIGLUOAI_ALPHA:
        return f"sigmoid(gate * {m['oai_alpha']}): the kernels scale by {moe_ops.SWIGLUOAI_ALPHA} only"
    for cap in ("gate_cap", "up_cap"):
        if cap in m.bindings and m[cap] != m[f"{cap}_scale"]:
            return f"soft cap tanh(v / {m[cap]}) * {m[f'{cap}_scale']}: the scale is not the cap"
        if cap in m.bindings and not m[cap] > 0:
            return f"soft cap {m[cap]} is not positive"
    if act in ("silu_fp32", "softcap_fp32") and m.get("act_dtype", torch.float32) != x.dtype:
        return (f"the fp32 activation is cast to {m.get('act_dtype', torch.float32)}, not back to the activation "
                f"dtype {x.dtype}")
    return None


GUARDS = (expert_weights, routing, combine_dtypes, clamp_is_noop, activation_form)


def _build(m: Match) -> Replacement:
    w = m["topk_weights"]
    if m.get("weight_dtype") is not None:
        w = Derived(torch.ops.prims.convert_element_type.default, (w, m["weight_dtype"]))
    return Replacement(moe_ops.moe_experts.op, (m["x"], m["topk_ids"], w, weight(m, "w13"), weight(m, "w2"),
                                                m.get("out_dtype"),
                                                *moe_ops.act_args(*activation(m))))


def _expert_gemm(node: Any) -> bool:
    """A ``sort`` of flattened ids, or a ``bmm`` on gathered 3-D weights: a routed-expert block candidate."""
    if node.target in (aten.sort.default, aten.sort.stable):
        return True
    gathered = node.args[0]
    value = tensor_val(gathered)
    return getattr(gathered, "target", None) is aten.index.Tensor and value is not None and value.dim() == 3


_SORT_ANCHORS = (Anchor(aten.sort.default, _expert_gemm), Anchor(aten.sort.stable, _expert_gemm))
_DESCRIPTIONS = {
    "grouped_mm": "sort, counts, grouped GEMMs, weights in sorted order, inverse-permutation gather + top-k sum (HF)",
    "weights_after_gather": "sort, counts, grouped GEMMs, inverse-permutation gather, weights in [T, K] (sglang style)",
    "index_add": "argsort, counts, grouped GEMMs, weighted rows index_add-ed to their tokens",
    "scatter_add": "argsort, counts, grouped GEMMs, weighted rows scatter_add-ed into zeros_like(x)",
}

PATTERNS = [
    *(Pattern(name="moe_experts", variant=variant, tree=tree, build=_build, guards=GUARDS, anchors=_SORT_ANCHORS,
              description=_DESCRIPTIONS[variant], produces="ep_fuse::moe_experts")
      for variant, tree in _grouped_trees().items()),
    Pattern(name="moe_experts", variant="batched_mm", tree=_batched_tree(), build=_build, guards=GUARDS,
            anchors=(Anchor(aten.bmm.default, _expert_gemm),),
            description="HF batched_mm: per-slot gathered expert weights into bmm, top-k sum",
            produces="ep_fuse::moe_experts"),
]

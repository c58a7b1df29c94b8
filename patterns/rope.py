"""Rotary position embedding, every form HF transformers 5.x traces to (graph forms: ``docs/patterns.md``).

* ``half`` (rotate-half / NeoX; Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3 with ``rope_interleave=False``)::

      add(mul(x, cos), mul(cat([neg(slice(x, -1, D/2, END)), slice(x, -1, 0, D/2)], -1), sin))

* partial rotary (GLM4-MoE, Qwen3-Next): ``cat([half(slice(x, -1, 0, R)), slice(x, -1, R, END)], -1)``
* ``chunk`` (GPT-OSS): ``x1, x2 = split(x, D/2, -1)``; ``cat([x1·c − x2·s, x2·c + x1·s], -1)``
* ``deinterleave`` (DeepSeek-V3 MLA, ``rope_interleave=True``): the same on ``x[..., 0::2]``,
  ``x[..., 1::2]`` (output de-interleaved)
* ``interleave`` (GPT-J, vLLM ``is_neox=False``): the same pairs, ``stack(..., -1).flatten(-2)`` (interleaved)
* ``partial_chunk`` / ``partial_interleave``: those forms on ``x[..., :R]``, concatenated with ``x[..., R:]``
* ``rotate_pairs`` / ``partial_rotate_pairs`` (HF GLM, Cohere): ``x·c2 + stack((−x[1::2], x[0::2]), -1).flatten(-2)·s2``
  with pair-repeated ``c2``/``s2``; ``rotate_pairs_fp32`` (HF Ernie 4.5 / HY-V4-VL): the same on
  ``_to_copy(·, f32)`` of ``x`` and of the rotated copy, then ``[_to_copy](·, D)``
* ``complex`` (DeepSeek-V2, Llama4): ``_to_copy(view(view_as_real(mul(view_as_complex(view(_to_copy(x, f32),
  [..., D/2, 2])), freqs_cis)), x.shape), D)``
* ``select_pairs`` (gpt-fast ``apply_rotary_emb``): the GPT-J pairs taken with ``select`` from
  ``xp = view(x, [..., D/2, 2])`` and a ``[..., D/2, 2]`` (cos, sin) table ``t``:
  ``view(stack([xp[..., 0]·t[..., 0] − xp[..., 1]·t[..., 1], xp[..., 1]·t[..., 0] + xp[..., 0]·t[..., 1]], -1),
  x.shape)``; becomes ``interleave`` with cos = ``t[..., 0]``, sin = ``t[..., 1]``

Each instance becomes ``ep_fuse::rope``; q and k instances that share cos/sin are then paired into
one ``ep_fuse::rope_qk`` (:data:`PAIRS`). A chunk/interleave instance whose cos and sin are the two
halves of one ``cache[positions]`` row gather (vLLM's cos/sin-cache form, :func:`cache_gather`)
becomes ``ep_fuse::rope_cache`` instead, absorbing the gather; pairs become ``rope_qk_cache``.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ep_fuse.fx_utils import literal_value, tensor_val
from ep_fuse.matching import (Anchor, Cast, Derived, Item, Lit, Match, Opt, PairRule, Pattern, Replacement, Var, equals,
                              op)
from ep_fuse.matching.checks import (
    INT64_MAX,
    MODEL_FLOATS,
    VIEWS,
    concrete_int,
    is_end,
    is_int,
    is_shape,
    same_shape,
    tensor_of,
)
from ep_fuse.ops import rope as rope_ops
from ep_fuse.ops.rope import CACHE_FORMS

aten = torch.ops.aten
F32 = torch.float32

DESCRIPTION = ("rotary embedding (rotate-half, partial, chunk, de-interleaved, GPT-J, gpt-fast pairs, complex; "
               "cos/sin cache) -> ep_fuse::rope / rope_qk / rope_cache / rope_qk_cache")


# --------------------------------------------------------------------------- value checks
_float_tensor = tensor_of(MODEL_FLOATS, "fp16/bf16/fp32")
_complex_tensor = tensor_of((torch.complex64,), "complex64 freqs_cis")


# --------------------------------------------------------------------------- trees
def _slice(x: Any, start: Any, end: Any, step: int = 1, bind: str | None = None) -> Any:
    args = dict(self=x, dim=Lit(is_int, bind=f"dim_{bind}" if bind else None), start=start, end=end)
    if step != 1:
        args["step"] = Lit(equals(step))
    return op(aten.slice.Tensor, bind=bind, **args)


def _mul(a: Any, b: Any) -> Any:
    return op(aten.mul.Tensor, self=a, other=b, commutative=("self", "other"))


def _half(xr: Any) -> Any:
    """rotate-half on ``xr`` (a bound pattern for the rotated channels)."""
    x1 = _slice(xr, Lit(equals(0)), Lit(is_int, bind="half"), bind="x1")
    x2 = _slice(xr, Lit(is_int, bind="half"), Lit(is_end), bind="x2")
    rotated = op(aten.cat.default, tensors=[op(aten.neg.default, self=x2), x1], dim=Lit(is_int, bind="cat_dim"))
    return op((aten.add.Tensor,), self=_mul(xr, Var("cos", _float_tensor)), other=_mul(rotated, Var("sin", _float_tensor)),
              commutative=("self", "other"))


def _products(x1: Any, x2: Any) -> tuple[Any, Any]:
    """``x1·c − x2·s`` and ``x2·c + x1·s``: the two rotated halves of the chunk/(de)interleave forms."""
    c, s = Var("cos", _float_tensor), Var("sin", _float_tensor)
    first = op(aten.sub.Tensor, self=_mul(x1, c), other=_mul(x2, s))
    second = op(aten.add.Tensor, self=_mul(x2, c), other=_mul(x1, s), commutative=("self", "other"))
    return first, second


def _pairwise(x1: Any, x2: Any) -> Any:
    """cat([x1·c − x2·s, x2·c + x1·s], -1): chunk and de-interleaved forms."""
    return op(aten.cat.default, tensors=list(_products(x1, x2)), dim=Lit(is_int, bind="cat_dim"))


def _interleaved(x1: Any, x2: Any) -> Any:
    """stack([x1·c − x2·s, x2·c + x1·s], -1).flatten(-2): GPT-J pairs, interleaved output."""
    stacked = op(aten.stack.default, tensors=list(_products(x1, x2)), dim=Lit(is_int, bind="stack_dim"))
    return op(VIEWS, self=stacked, size=Lit(is_shape), bind="flat")


def _rotate_pairs(xr: Any, even: Any, odd: Any) -> Any:
    """``xr·cos + stack((−x2, x1), -1).flatten(-2)·sin`` with full-width, pair-repeated cos/sin (HF GLM/Cohere)."""
    rotated = op(VIEWS, self=op(aten.stack.default, tensors=[op(aten.neg.default, self=odd), even],
                                dim=Lit(is_int, bind="stack_dim")), size=Lit(is_shape), bind="flat")
    return op(aten.add.Tensor, self=_mul(xr, Var("cos_rep", _float_tensor)),
              other=_mul(rotated, Var("sin_rep", _float_tensor)), commutative=("self", "other"))


def _rotate_pairs_fp32(x: Any, even: Any, odd: Any) -> Any:
    """``(x.float()·cos + rotate_pairs(x).float()·sin).to(D)`` (HF Ernie 4.5 / HY-V4-VL, "full precision")."""
    rotated = op(VIEWS, self=op(aten.stack.default, tensors=[op(aten.neg.default, self=odd), even],
                                dim=Lit(is_int, bind="stack_dim")), size=Lit(is_shape), bind="flat")
    body = op(aten.add.Tensor, self=_mul(Cast(x, F32), Var("cos_rep", _float_tensor)),
              other=_mul(Cast(rotated, F32), Var("sin_rep", _float_tensor)), commutative=("self", "other"))
    return Opt(Cast(body, "out_dtype"))


_SIGNS = (aten.sub.Tensor, aten.add.Tensor)


def _select_pairs(x: Any) -> Any:
    """gpt-fast's pairs: ``xp = x.reshape(..., D/2, 2)``, ``t`` a (cos, sin) table of ``[..., D/2, 2]``;
    ``stack([xp0·t0 − xp1·t1, xp1·t0 + xp0·t1], -1).flatten(-2)``. Each ``xp[..., i]`` may be traced
    several times (one ``select`` per Python expression): the selects are not bound, their source and
    dim are."""
    pairs = op(VIEWS, self=x, size=Lit(is_shape), bind="pairs")
    table = Var("pair_table", _float_tensor)

    def xp(i: int) -> Any:
        return op(aten.select.int, self=pairs, dim=Lit(is_int, bind="dim_pair"), index=Lit(equals(i)))

    def t(i: int) -> Any:
        return op(aten.select.int, self=table, dim=Lit(is_int, bind="dim_table"), index=Lit(equals(i)))

    # either sign in both places: select_pairs_layout checks x0·c − x1·s, x1·c + x0·s (and names a swapped sign)
    first = op(_SIGNS, self=_mul(xp(0), t(0)), other=_mul(xp(1), t(1)), bind="pair_first")
    second = op(_SIGNS, self=_mul(xp(1), t(0)), other=_mul(xp(0), t(1)), commutative=("self", "other"),
                bind="pair_second")
    stacked = op(aten.stack.default, tensors=[first, second], dim=Lit(is_int, bind="dim_pair_stack"))
    return op(VIEWS, self=stacked, size=Lit(is_shape), bind="pairs_flat")


def _inner(x: Any) -> dict[str, Any]:
    """The rotation forms on ``x`` (the whole head or its rotated slice)."""
    split = op(aten.split.Tensor, self=x, split_size=Lit(is_int, bind="half"), dim=Lit(is_int, bind="dim_split"),
               bind="split")
    even = _slice(x, Lit(equals(0)), Lit(is_end), 2, bind="xe")
    odd = _slice(x, Lit(equals(1)), Lit(is_end), 2, bind="xo")
    return {"half": _half(x), "chunk": _pairwise(Item(split, 0), Item(split, 1)),
            "deinterleave": _pairwise(even, odd), "interleave": _interleaved(even, odd),
            "rotate_pairs": _rotate_pairs(x, even, odd)}


def _whole_head_only(x: Any) -> dict[str, Any]:
    """Forms with no partial-rotary variant (no model slices the head before them)."""
    even = _slice(x, Lit(equals(0)), Lit(is_end), 2, bind="xe")
    odd = _slice(x, Lit(equals(1)), Lit(is_end), 2, bind="xo")
    return {"rotate_pairs_fp32": _rotate_pairs_fp32(x, even, odd), "select_pairs": _select_pairs(x)}


PARTIAL_FORMS = {"partial": "half", "partial_chunk": "chunk", "partial_interleave": "interleave",
                 "partial_rotate_pairs": "rotate_pairs"}
"""Partial-rotary variants (``cat([form(x[..., :R]), x[..., R:]], -1)``) and the form each rotates with."""

CANONICAL_FORMS = {**PARTIAL_FORMS, "select_pairs": "interleave"}
"""Variants whose canonical ``form`` is not their name."""



def _trees() -> dict[str, Any]:
    x = Var("x", _float_tensor)
    xr = op(aten.slice.Tensor, self=x, dim=Lit(is_int, bind="dim_rot"), start=Lit(equals(0)),
            end=Lit(is_int, bind="rot"), bind="xr")
    passthrough = op(aten.slice.Tensor, self=x, dim=Lit(is_int, bind="dim_pass"), start=Lit(is_int, bind="rot"),
                     end=Lit(is_end))
    xc = op(aten.view_as_complex.default,
            self=op(VIEWS, self=Opt(Cast(x, F32, bind="upcast")), size=Lit(is_shape), bind="pairs"))
    rotated = op(aten.mul.Tensor, self=xc, other=Var("cos", _complex_tensor), commutative=("self", "other"))
    complex_out = op(VIEWS, self=op(aten.view_as_real.default, self=rotated), size=Lit(is_shape), bind="unpairs")
    on_slice = _inner(xr)
    trees = {variant: op(aten.cat.default, tensors=[on_slice[form], passthrough], dim=Lit(is_int, bind="cat_outer"))
             for variant, form in PARTIAL_FORMS.items()}
    return {**trees, **_inner(x), **_whole_head_only(x), "complex": Opt(Cast(complex_out, "out_dtype"))}


# --------------------------------------------------------------------------- guards
def _last(m: Match, dim: int) -> bool:
    nd = tensor_val(m["x"]).dim()
    return dim in (-1, nd - 1)


def rotates_last_dim(m: Match) -> str | None:
    """Every slice/split/cat of the pattern works on the head dim (the last one)."""
    for key in ("dim_x1", "dim_x2", "cat_dim", "dim_rot", "dim_pass", "cat_outer", "dim_split", "dim_xe", "dim_xo",
                "stack_dim"):
        if key in m.bindings and not _last(m, m[key]):
            return f"{key.removeprefix('dim_')} works on dim {m[key]}, not the head dim"
    return None


def _rot_dim(m: Match) -> int:
    """The rotated width (a constant: :func:`static_head_dim` guards it)."""
    return m["rot"] if "rot" in m.bindings else int(tensor_val(m["x"]).shape[-1])


def static_head_dim(m: Match) -> str | None:
    """The head dim is a constant (the canonical op and the kernels take it as an int).

    Token dims may be symbolic (``dynamic=True``); a symbolic head dim -- a module whose heads are a
    graph input -- is not fused: reading it as an int would specialise the graph on it."""
    if concrete_int(tensor_val(m["x"]).shape[-1]) is None:
        return f"symbolic head dim {tensor_val(m['x']).shape[-1]}"
    return None


def halves_the_rotated_dim(m: Match) -> str | None:
    """The two halves (slices, split, or even/odd) cover the rotated channels exactly."""
    rot = _rot_dim(m)
    if rot % 2:
        return f"rotated width {rot} is odd"
    if "half" in m.bindings and m["half"] * 2 != rot:
        return f"halves of {m['half']} do not split {rot} channels in two"
    if m.pattern.variant == "partial" and rot >= int(tensor_val(m["x"]).shape[-1]):
        return "partial rotary with nothing passed through"
    return None


def interleaves_back(m: Match) -> str | None:
    """The GPT-J form flattens its [..., R/2, 2] stack back to the rotated channels' shape."""
    if "flat" not in m.bindings:
        return None
    if m.bindings["stack_dim"] not in (-1, tensor_val(m["xe"]).dim()):
        return f"stack on dim {m['stack_dim']}, not a new last dim"
    rotated = m["xr"] if "xr" in m.bindings else m["x"]
    if not same_shape(tensor_val(m["flat"]).shape, tensor_val(rotated).shape):
        return f"flattened to {list(tensor_val(m['flat']).shape)}, not the rotated shape {list(tensor_val(rotated).shape)}"
    return None


def cos_sin_broadcast(m: Match) -> str | None:
    """cos/sin broadcast to the rotated channels (or their halves) without growing the head tensor."""
    x = tensor_val(m["x"])
    rot = _rot_dim(m)
    want = rot if m.pattern.variant in ("half", "partial") else rot // 2
    if "cos_rep" in m.bindings:
        if not same_shape(tensor_val(m["sin_rep"]).shape, tensor_val(m["cos_rep"]).shape):
            return "cos and sin differ in shape"
        want = rot
    for name in ("cos", "sin", "cos_rep", "sin_rep"):
        if name not in m.bindings:
            continue
        t = tensor_val(m[name])
        if t.dim() > x.dim() or not statically_known_true(t.shape[-1] == want):
            return f"{name} of shape {list(t.shape)} does not broadcast to the {want} rotated channels of {list(x.shape)}"
        lead_x, lead_t = list(x.shape[:-1]), list(t.shape[:-1])
        for i in range(1, len(lead_t) + 1):
            if not (statically_known_true(lead_t[-i] == 1) or statically_known_true(lead_t[-i] == lead_x[-i])):
                return f"{name} of shape {list(t.shape)} does not broadcast to {list(x.shape)}"
    if "sin" in m.bindings and not same_shape(tensor_val(m["sin"]).shape, tensor_val(m["cos"]).shape):
        return "cos and sin differ in shape"
    return None


def complex_views_pair_channels(m: Match) -> str | None:
    """The complex form views the head dim as (D/2, 2) pairs and back to the head shape."""
    if m.pattern.variant != "complex":
        return None
    x = tensor_val(m["x"])
    pairs, unpairs = tensor_val(m["pairs"]), tensor_val(m["unpairs"])
    if not same_shape(pairs.shape, [*x.shape[:-1], x.shape[-1] // 2, 2]) or not same_shape(unpairs.shape, x.shape):
        return f"views {list(pairs.shape)} / {list(unpairs.shape)} do not pair the channels of {list(x.shape)}"
    return None


def _is_last(dim: Any, t: torch.Tensor) -> bool:
    return dim in (-1, t.dim() - 1)


def select_pairs_layout(m: Match) -> tuple[Any, str] | None:
    """gpt-fast's form: ``x`` viewed ``[*x.shape[:-1], D/2, 2]`` and read at its pair dim; a ``[..., D/2, 2]`` table
    read at its last dim whose ``[..., D/2]`` halves broadcast to the pairs without growing them; the products
    stacked on a new last dim and viewed back to ``x``'s shape."""
    if "pair_table" not in m.bindings:
        return None
    x, pairs, table = tensor_val(m["x"]), tensor_val(m["pairs"]), tensor_val(m["pair_table"])
    d = int(x.shape[-1])  # static_head_dim runs first
    if d % 2 or not same_shape(pairs.shape, [*x.shape[:-1], d // 2, 2]):
        return m["pairs"], f"view {list(pairs.shape)} does not pair the channels of {list(x.shape)}"
    if not _is_last(m["dim_pair"], pairs):
        return m["pairs"], f"selects dim {m['dim_pair']} of the pairs {list(pairs.shape)}, not the pair dim"
    if not (_is_last(m["dim_table"], table) and statically_known_true(table.shape[-1] == 2)):
        return m["pair_table"], (f"the cos/sin table {list(table.shape)} is not read as (cos, sin) pairs on its last "
                                 f"dim (select dim {m['dim_table']})")
    half, lead_x = list(table.shape[:-1]), list(x.shape[:-1])
    if len(half) > x.dim() or not statically_known_true(half[-1] == d // 2) or not all(
            statically_known_true(a == 1) or statically_known_true(a == b) for a, b in zip(half[-2::-1], lead_x[::-1])):
        return m["pair_table"], (f"cos/sin of shape {half} do not broadcast to the {d // 2} channel pairs of "
                                 f"{list(x.shape)}")
    signs = (m["pair_first"].target, m["pair_second"].target)
    if signs != (aten.sub.Tensor, aten.add.Tensor):
        got = ["−" if t == aten.sub.Tensor else "+" for t in signs]
        return m["pair_first"], (f"the pair is (x0·c {got[0]} x1·s, x1·c {got[1]} x0·s), not the rotation "
                                 "(x0·c − x1·s, x1·c + x0·s)")
    if m["dim_pair_stack"] not in (-1, pairs.dim() - 1):
        return m["pairs_flat"], f"stack on dim {m['dim_pair_stack']}, not a new last dim"
    if not same_shape(tensor_val(m["pairs_flat"]).shape, x.shape):
        return m["pairs_flat"], f"flattened to {list(tensor_val(m['pairs_flat']).shape)}, not {list(x.shape)}"
    return None


def _views_channel_pairs(node: fx.Node) -> bool:
    """``view(x, [..., D/2, 2])`` read by a ``select`` on the pair dim: gpt-fast's ``x.reshape(..., -1, 2)[..., 0]``."""
    out, src = tensor_val(node), tensor_val(node.args[0]) if node.args else None
    if out is None or src is None or not out.dtype.is_floating_point or out.dim() != src.dim() + 1:
        return False
    if not (statically_known_true(out.shape[-1] == 2) and same_shape(out.shape[:-2], src.shape[:-1])
            and statically_known_true(out.shape[-2] * 2 == src.shape[-1])):
        return False
    return any(u.target is aten.select.int and _is_last(u.args[1], out) for u in node.users)


# --------------------------------------------------------------------------- pair-repeated cos/sin
_ELEMENTWISE = {aten.cos.default, aten.sin.default, aten.neg.default}
"""Unary ops that keep equal inputs equal (the cos/sin of repeated angles)."""
_REPEAT_LIMIT = 16


def _repeat_source(n: Any) -> fx.Node | None:
    """``src`` when ``n`` is ``src.repeat_interleave(2, -1)`` as AOT traces it:
    ``view|_unsafe_view(clone(expand(unsqueeze(src, -1), [..., R/2, 2])), [..., R])``."""
    if not (isinstance(n, fx.Node) and n.target in VIEWS):
        return None
    inner = n.args[0]
    if isinstance(inner, fx.Node) and inner.target == aten.clone.default:
        inner = inner.args[0]
    if not (isinstance(inner, fx.Node) and inner.target == aten.expand.default):
        return None
    unsq = inner.args[0]
    if not (isinstance(unsq, fx.Node) and unsq.target == aten.unsqueeze.default):
        return None
    src = unsq.args[0]
    s, e, out = tensor_val(src), tensor_val(inner), tensor_val(n)
    if s is None or unsq.args[1] not in (-1, s.dim()) or e.dim() != s.dim() + 1:
        return None
    if not (statically_known_true(e.shape[-1] == 2) and same_shape(e.shape[:-1], s.shape)
            and same_shape(out.shape, [*s.shape[:-1], s.shape[-1] * 2])):
        return None
    return src


def _keeps_pairs(n: fx.Node) -> bool:
    """``n`` maps equal neighbours of its first argument's last dim to equal neighbours."""
    if n.target in (aten._to_copy.default, torch.ops.prims.convert_element_type.default, *_ELEMENTWISE):
        return True
    if n.target in (aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar):
        return isinstance(n.args[1], (int, float))
    return n.target == aten.unsqueeze.default and n.args[1] not in (-1, tensor_val(n).dim() - 1)


def _pair_repeated(n: Any) -> tuple[fx.Node | None, str | None]:
    """Whether ``n``'s last dim repeats each value twice (``c[2j] == c[2j+1]``), proven from the graph.

    Returns ``(src, None)`` when ``n`` itself is ``src.repeat_interleave(2, -1)`` (its halves are
    ``src``), ``(None, None)`` when the repeat sits further up behind ops that keep equal elements
    equal (casts, cos/sin/neg, a product with a number, an unsqueeze before the last dim), else
    ``(None, why not)``."""
    direct = True
    for _ in range(_REPEAT_LIMIT):
        src = _repeat_source(n)
        if src is not None:
            return (src if direct else None), None
        if not isinstance(n, fx.Node) or n.op != "call_function":
            return None, f"{getattr(n, 'name', n)} is not computed in the graph"
        if not _keeps_pairs(n):
            return None, f"{n.name} ({n.target}) is not a repeat_interleave(2, -1) or an op that keeps pairs equal"
        n = n.args[0]
        direct = False
    return None, "the repeat is too far up"


def repeated_in_pairs(m: Match) -> tuple[Any, str] | None:
    """The GPT-J pairs written with a rotated copy of the head (``stack((−x2, x1), -1).flatten(-2)``,
    HF GLM/Cohere) equal ``interleave`` only when cos and sin repeat each value in pairs
    (``cos[..., :R/2].repeat_interleave(2, -1)`` or ``cos(freqs.repeat_interleave(2, -1))``)."""
    for name in ("cos_rep", "sin_rep"):
        if name in m.bindings:
            _src, why = _pair_repeated(m[name])
            if why:
                return m[name], f"{name.removesuffix('_rep')} is not provably repeated in pairs: {why}"
    return None


def _halves(m: Match, name: str) -> Any:
    """cos/sin at the even channels: the repeat's source, or a step-2 slice of the repeated tensor."""
    src, _why = _pair_repeated(m[f"{name}_rep"])
    if src is not None:
        return src
    return Derived(aten.slice.Tensor, (m[f"{name}_rep"], -1, 0, INT64_MAX, 2))


GUARDS = (static_head_dim, rotates_last_dim, halves_the_rotated_dim, cos_sin_broadcast, complex_views_pair_channels,
          interleaves_back, repeated_in_pairs, select_pairs_layout)


# --------------------------------------------------------------------------- cos/sin-cache form
_GATHERS = (aten.index_select.default, aten.index.Tensor)


def _strip_to_dtype(n: Any, dtype: torch.dtype) -> Any:
    """``n`` without a trailing cast to ``dtype`` (vLLM's ``.to(x.dtype)``; absent when already that dtype)."""
    if isinstance(n, fx.Node) and n.target in (aten._to_copy.default, torch.ops.prims.convert_element_type.default):
        if tensor_val(n).dtype == dtype and set(n.kwargs) <= {"dtype"}:
            return n.args[0]
    return n


def _gathered_half(n: Any, x_dtype: torch.dtype) -> tuple[fx.Node, int] | None:
    """``(split node, index)`` when ``n`` is ``[cast] unsqueeze(-2) [cast] getitem(split(gather), index)``."""
    n = _strip_to_dtype(n, x_dtype)
    if not (isinstance(n, fx.Node) and n.target == aten.unsqueeze.default):
        return None
    inner = _strip_to_dtype(n.args[0], x_dtype)
    if inner is not n.args[0] and tensor_val(n.args[0]).dtype != x_dtype:
        return None
    if not (isinstance(inner, fx.Node) and inner.target is operator.getitem):
        return None
    split, index = inner.args
    if not (isinstance(split, fx.Node) and split.target == aten.split.Tensor):
        return None
    if n.args[1] not in (-2, tensor_val(n).dim() - 2):
        return None
    return split, int(index)


def cache_gather(m: Match, rot: int) -> tuple[fx.Node, fx.Node] | None:
    """``(cos_sin_cache, positions)`` when cos and sin are the two halves of one cache-row gather
    (``cache[positions].chunk(2, -1)``, unsqueezed before the channels), else ``None`` (tensor form).

    Checked: one split of one gather into two ``rot/2`` halves on the last dim, cos = half 0 and sin =
    half 1, a 2-D ``[max_pos, rot]`` cache gathered on dim 0 by integer positions, and cos/sin in the
    heads' dtype (a cast of the gathered halves to it is absorbed)."""
    x_dtype = tensor_val(m["x"]).dtype
    cos, sin = (_gathered_half(m.get(name), x_dtype) if m.get(name) is not None else None for name in ("cos", "sin"))
    if cos is None or sin is None or cos[0] is not sin[0] or (cos[1], sin[1]) != (0, 1):
        return None
    split = cos[0]
    gather, size = split.args[0], concrete_int(literal_value(split.args[1]))
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if not isinstance(gather, fx.Node) or gather.target not in _GATHERS or size is None or size * 2 != rot:
        return None
    if dim not in (-1, tensor_val(gather).dim() - 1) or len(list(split.users)) > 2:
        return None
    if gather.target == aten.index_select.default:
        cache, gdim, positions = gather.args
        if gdim != 0:
            return None
    else:
        cache, indices = gather.args
        if len(indices) != 1 or indices[0] is None:
            return None
        positions = indices[0]
    c, p = tensor_val(cache), tensor_val(positions)
    if c.dim() != 2 or not statically_known_true(c.shape[-1] == rot) or p.dtype not in (torch.int32, torch.int64):
        return None
    if not same_shape(tensor_val(m["cos"]).shape, [*p.shape, 1, rot // 2]):
        return None
    return cache, positions


def _build(form: str):
    def build(m: Match) -> Replacement:
        rot = _rot_dim(m)
        if "pair_table" in m.bindings:  # cos, sin = table[..., 0], table[..., 1] (views, as the model reads them)
            cos, sin = (Derived(aten.select.int, (m["pair_table"], -1, i)) for i in (0, 1))
            return Replacement(rope_ops.rope.op, (m["x"], cos, sin, form, rot, None))
        if "cos_rep" in m.bindings:
            cos, sin = _halves(m, "cos"), _halves(m, "sin")
            return Replacement(rope_ops.rope.op, (m["x"], cos, sin, form, rot, m.get("out_dtype")))
        cache = cache_gather(m, rot) if form in CACHE_FORMS else None
        if cache is not None:
            return Replacement(rope_ops.rope_cache.op, (m["x"], *cache, form, rot))
        return Replacement(rope_ops.rope.op, (m["x"], m["cos"], m.get("sin"), form, rot, m.get("out_dtype")))

    return build


ANCHORS = (aten.neg.default, aten.view_as_complex.default,
           *(Anchor(target, _views_channel_pairs) for target in VIEWS))
"""Candidate sites (near misses): the rotations' ``neg``, the complex view, gpt-fast's channel-pair view."""


def _patterns() -> list[Pattern]:
    out = []
    for variant, tree in _trees().items():
        form = CANONICAL_FORMS.get(variant, variant)
        out.append(Pattern(name="rope", variant=variant, tree=tree, build=_build(form), guards=GUARDS,
                           anchors=ANCHORS,
                           description=f"rotary embedding, {variant} form",
                           produces="ep_fuse::rope" + (" / rope_cache" if form in CACHE_FORMS else "")))
    return out


PATTERNS = _patterns()


PAIRS = [PairRule("rope_qk", rope_ops.rope.op, rope_ops.rope_qk.op),
         PairRule("rope_qk_cache", rope_ops.rope_cache.op, rope_ops.rope_qk_cache.op)]
"""q and k rotated with the same cos/sin (or cache and positions), form and width run as one call (one launch)."""

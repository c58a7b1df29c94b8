"""Rotary position embedding, every form HF transformers 5.x traces to (``traced-graphs.md`` §4.2, §6.3).

* ``half`` (rotate-half / NeoX; Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3 with ``rope_interleave=False``)::

      add(mul(x, cos), mul(cat([neg(slice(x, -1, D/2, END)), slice(x, -1, 0, D/2)], -1), sin))

* partial rotary (GLM4-MoE, Qwen3-Next): ``cat([half(slice(x, -1, 0, R)), slice(x, -1, R, END)], -1)``
* ``chunk`` (GPT-OSS): ``x1, x2 = split(x, D/2, -1)``; ``cat([x1·c − x2·s, x2·c + x1·s], -1)``
* ``deinterleave`` (DeepSeek-V3 MLA, ``rope_interleave=True``): the same on ``x[..., 0::2]``,
  ``x[..., 1::2]`` (output de-interleaved)
* ``complex`` (DeepSeek-V2, Llama4): ``_to_copy(view(view_as_real(mul(view_as_complex(view(_to_copy(x, f32),
  [..., D/2, 2])), freqs_cis)), x.shape), D)``

Each instance becomes ``ep_fuse::rope``; q and k instances that share cos/sin are then paired into
one ``ep_fuse::rope_qk`` (:data:`PAIRS`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ep_fuse.fx_utils import tensor_val
from ep_fuse.matching import (
    Cast,
    Item,
    Lit,
    Match,
    Opt,
    PairRule,
    Pattern,
    Replacement,
    Var,
    equals,
    op,
)
from ep_fuse.matching.checks import (
    MODEL_FLOATS,
    VIEWS,
    is_end,
    is_int,
    is_shape,
    tensor_of,
)
from ep_fuse.ops import canonical

aten = torch.ops.aten
F32 = torch.float32

DESCRIPTION = "rotary embedding (rotate-half, partial, chunk, de-interleaved, complex) -> ep_fuse::rope / rope_qk"


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


def _pairwise(x1: Any, x2: Any) -> Any:
    """cat([x1·c − x2·s, x2·c + x1·s], -1): chunk and de-interleaved forms."""
    c, s = Var("cos", _float_tensor), Var("sin", _float_tensor)
    first = op(aten.sub.Tensor, self=_mul(x1, c), other=_mul(x2, s))
    second = op(aten.add.Tensor, self=_mul(x2, c), other=_mul(x1, s), commutative=("self", "other"))
    return op(aten.cat.default, tensors=[first, second], dim=Lit(is_int, bind="cat_dim"))


def _trees() -> dict[str, Any]:
    x = Var("x", _float_tensor)
    xr = op(aten.slice.Tensor, self=x, dim=Lit(is_int, bind="dim_rot"), start=Lit(equals(0)),
            end=Lit(is_int, bind="rot"), bind="xr")
    passthrough = op(aten.slice.Tensor, self=x, dim=Lit(is_int, bind="dim_pass"), start=Lit(is_int, bind="rot"),
                     end=Lit(is_end))
    split = op(aten.split.Tensor, self=x, split_size=Lit(is_int, bind="half"), dim=Lit(is_int, bind="dim_split"),
               bind="split")
    xc = op(aten.view_as_complex.default,
            self=op(VIEWS, self=Opt(Cast(x, F32, bind="upcast")), size=Lit(is_shape), bind="pairs"))
    rotated = op(aten.mul.Tensor, self=xc, other=Var("cos", _complex_tensor), commutative=("self", "other"))
    complex_out = op(VIEWS, self=op(aten.view_as_real.default, self=rotated), size=Lit(is_shape), bind="unpairs")
    return {
        "partial": op(aten.cat.default, tensors=[_half(xr), passthrough], dim=Lit(is_int, bind="cat_outer")),
        "half": _half(x),
        "chunk": _pairwise(Item(split, 0), Item(split, 1)),
        "deinterleave": _pairwise(_slice(x, Lit(equals(0)), Lit(is_end), 2, bind="xe"),
                                  _slice(x, Lit(equals(1)), Lit(is_end), 2, bind="xo")),
        "complex": Opt(Cast(complex_out, "out_dtype")),
    }


# --------------------------------------------------------------------------- guards
def _last(m: Match, dim: int) -> bool:
    nd = tensor_val(m["x"]).dim()
    return dim in (-1, nd - 1)


def rotates_last_dim(m: Match) -> str | None:
    """Every slice/split/cat of the pattern works on the head dim (the last one)."""
    for key in ("dim_x1", "dim_x2", "cat_dim", "dim_rot", "dim_pass", "cat_outer", "dim_split", "dim_xe", "dim_xo"):
        if key in m.bindings and not _last(m, m[key]):
            return f"{key.removeprefix('dim_')} works on dim {m[key]}, not the head dim"
    return None


def _rot_dim(m: Match) -> int:
    d = int(tensor_val(m["x"]).shape[-1])
    return int(m["rot"]) if "rot" in m.bindings else d


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


def cos_sin_broadcast(m: Match) -> str | None:
    """cos/sin broadcast to the rotated channels (or their halves) without growing the head tensor."""
    x = tensor_val(m["x"])
    rot = _rot_dim(m)
    want = rot if m.pattern.variant in ("half", "partial") else rot // 2
    for name in ("cos", "sin"):
        if name not in m.bindings:
            continue
        t = tensor_val(m[name])
        if t.dim() > x.dim() or not statically_known_true(t.shape[-1] == want):
            return f"{name} of shape {list(t.shape)} does not broadcast to the {want} rotated channels of {list(x.shape)}"
        lead_x, lead_t = list(x.shape[:-1]), list(t.shape[:-1])
        for i in range(1, len(lead_t) + 1):
            if not (statically_known_true(lead_t[-i] == 1) or statically_known_true(lead_t[-i] == lead_x[-i])):
                return f"{name} of shape {list(t.shape)} does not broadcast to {list(x.shape)}"
    if "sin" in m.bindings and tensor_val(m["sin"]).shape != tensor_val(m["cos"]).shape:
        return "cos and sin differ in shape"
    return None


def complex_views_pair_channels(m: Match) -> str | None:
    """The complex form views the head dim as (D/2, 2) pairs and back to the head shape."""
    if m.pattern.variant != "complex":
        return None
    x = tensor_val(m["x"])
    pairs, unpairs = tensor_val(m["pairs"]), tensor_val(m["unpairs"])
    if list(pairs.shape) != [*x.shape[:-1], x.shape[-1] // 2, 2] or list(unpairs.shape) != list(x.shape):
        return f"views {list(pairs.shape)} / {list(unpairs.shape)} do not pair the channels of {list(x.shape)}"
    return None


GUARDS = (rotates_last_dim, halves_the_rotated_dim, cos_sin_broadcast, complex_views_pair_channels)


def _build(form: str):
    def build(m: Match) -> Replacement:
        return Replacement(canonical.rope.op,
                           (m["x"], m["cos"], m.get("sin"), form, _rot_dim(m), m.get("out_dtype")))

    return build


def _patterns() -> list[Pattern]:
    out = []
    for variant, tree in _trees().items():
        form = "half" if variant == "partial" else variant
        out.append(Pattern(name="rope", variant=variant, tree=tree, build=_build(form), guards=GUARDS,
                           anchors=(aten.neg.default, aten.view_as_complex.default),
                           description=f"rotary embedding, {variant} form", produces="ep_fuse::rope"))
    return out


PATTERNS = _patterns()


PAIRS = [PairRule("rope_qk", canonical.rope.op, canonical.rope_qk.op)]
"""q and k rotated with the same cos/sin, form and width run as one ``rope_qk`` (one launch)."""

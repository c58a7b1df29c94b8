"""GEMM + SwiGLU of dense MLPs and shared experts (graph forms: ``docs/patterns.md``).

* two GEMMs on one input (Llama-style ``gate_proj``/``up_proj``; Qwen2-MoE, DeepSeek-V3 dense layers
  and shared experts)::

      mul(silu(_unsafe_view(mm(view(x, [T, H]), t(Wg)), [..., I])), _unsafe_view(mm(view(x, [T, H]), t(Wu)), [..., I]))

  (without the views for 2-D inputs; ``up * silu(gate)`` too);
* one GEMM over concatenated gate|up weights: ``silu(split(mm(x, t(Wgu)), I)[0]) * split(...)[1]``; on an
  N-D input (Granite-MoE-Shared's ``shared_mlp``) the product is ``_unsafe_view(mm(view(x, [T, H]), t(Wgu)),
  [..., 2I])`` before the ``chunk``.

Both become ``ep_fuse::gemm_swiglu(x, w_gate, w_up)``. The two-GEMM forms also come with the SwiGLU in fp32
(Beam: ``(silu(gate.float()) * up.float()).to(dtype)``, variants ``*_fp32_act``): ``gemm_swiglu(x, w_gate, w_up,
act_fp32=True)``. Only a ``silu`` whose input is a GEMM output
matches: Qwen3-Next's ``RMSNormGated`` (``normed · silu(gate)``) and GPT-OSS's clamped
``sigmoid(1.702·g)·g·(u+1)`` are different functions and stay as they are. Expert GEMMs
(``_grouped_mm``, ``bmm``) belong to the MoE family.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ep_fuse.fx_utils import tensor_val
from ep_fuse.matching import Anchor, Cast, Derived, Item, Lit, Match, Pattern, Replacement, Var, op
from ep_fuse.matching.checks import MODEL_FLOATS, VIEWS, is_shape, same_shape, tensor_of
from ep_fuse.matching.matcher import CAST_TARGETS
from ep_fuse.ops import gemm_swiglu as gemm_swiglu_ops

aten = torch.ops.aten

DESCRIPTION = "dense GEMM + SwiGLU (gate/up projections, shared experts) -> ep_fuse::gemm_swiglu"


_float_tensor = tensor_of(MODEL_FLOATS, "fp16/bf16/fp32")




def _linear(w: str, flat: str) -> Any:
    """``x @ W.T`` as traced from ``F.linear``: 2-D ``mm``, or ``view -> mm -> _unsafe_view`` for N-D."""
    x = Var("x", _float_tensor)
    weight = op(aten.t.default, self=Var(w, _float_tensor))
    flat_mm = op(aten.mm.default, self=op(VIEWS, self=x, size=Lit(is_shape), bind=flat), mat2=weight,
                 bind=f"mm_{w}")
    return (op(VIEWS, self=flat_mm, size=Lit(is_shape)), op(aten.mm.default, self=x, mat2=weight, bind=f"mm_{w}"))


def _trees() -> dict[str, Any]:
    trees = {}
    for form, (g, u) in {"two_gemm": (0, 0), "two_gemm_2d": (1, 1)}.items():
        gate, up = _linear("w_gate", "flat_g")[g], _linear("w_up", "flat_u")[u]
        trees[form] = op(aten.mul.Tensor, self=op(aten.silu.default, self=gate), other=up,
                         commutative=("self", "other"))
        # Beam: ``(silu(gate.float()) * up.float()).to(dtype)`` (bf16/fp16 GEMMs, the SwiGLU in fp32, one rounding)
        gate, up = _linear("w_gate", "flat_g")[g], _linear("w_up", "flat_u")[u]
        product = op(aten.mul.Tensor, self=op(aten.silu.default, self=Cast(gate, torch.float32)),
                     other=Cast(up, torch.float32), commutative=("self", "other"), bind="act_fp32")
        trees[f"{form}_fp32_act"] = Cast(product, dtype="out_dtype")
    x = Var("x", _float_tensor)
    weight = op(aten.t.default, self=Var("w_gate_up", _float_tensor))
    mm = op(aten.mm.default, self=x, mat2=weight, bind="mm_w_gate_up")
    # N-D input (Granite-MoE-Shared's shared_mlp): view -> mm -> _unsafe_view back to [..., 2I], then the chunk
    mm_nd = op(VIEWS, self=op(aten.mm.default, self=op(VIEWS, self=x, size=Lit(is_shape), bind="flat_gu"), mat2=weight,
                              bind="mm_w_gate_up"), size=Lit(is_shape), bind="gu_view")
    for form, gu in {"concat_gemm": mm, "concat_gemm_nd": mm_nd}.items():
        split = op(aten.split.Tensor, self=gu, split_size=Lit(lambda v: None if isinstance(v, int) else "int",
                                                               bind="inter"),
                   dim=Lit(lambda v: None if isinstance(v, int) else "int", bind="split_dim"), bind="split")
        trees[form] = op(aten.mul.Tensor, self=op(aten.silu.default, self=Item(split, 0)), other=Item(split, 1),
                         commutative=("self", "other"))
    return trees


# --------------------------------------------------------------------------- guards
def weights_match_input(m: Match) -> str | None:
    """Gate and up weights are [I, H] matrices over the input's last dim, of one dtype with it."""
    x = tensor_val(m["x"])
    names = ("w_gate", "w_up") if "w_gate" in m.bindings else ("w_gate_up",)
    for name in names:
        w = tensor_val(m[name])
        if w.dim() != 2 or not statically_known_true(w.shape[1] == x.shape[-1]):
            return f"{name} of shape {list(w.shape)} is not [I, {x.shape[-1]}]"
        if w.dtype != x.dtype:
            return f"{name} is {w.dtype}, the input {x.dtype}"
    if len(names) == 2 and not same_shape(tensor_val(m["w_gate"]).shape, tensor_val(m["w_up"]).shape):
        return "gate and up weights differ in shape"
    if len(names) == 1:
        w = tensor_val(m["w_gate_up"])
        if not statically_known_true(w.shape[0] == 2 * m["inter"]):
            return f"split of {m['inter']} does not halve the {w.shape[0]} gate|up rows"
    return None


def views_flatten_tokens(m: Match) -> str | None:
    """The N-D form flattens every leading dim of x into tokens (both GEMMs read the same rows)."""
    x = tensor_val(m["x"])
    for name in ("flat_g", "flat_u"):
        if name in m.bindings:
            v = tensor_val(m[name])
            if v.dim() != 2 or not statically_known_true(v.shape[1] == x.shape[-1]):
                return f"{name} reshapes the input to {list(v.shape)}, not [tokens, {x.shape[-1]}]"
    if "flat_g" not in m.bindings and "flat_gu" not in m.bindings and x.dim() != 2:
        return "mm of a non-2-D input"
    if "flat_gu" in m.bindings:
        v, out = tensor_val(m["flat_gu"]), tensor_val(m["gu_view"])
        if v.dim() != 2 or not statically_known_true(v.shape[1] == x.shape[-1]):
            return f"flat_gu reshapes the input to {list(v.shape)}, not [tokens, {x.shape[-1]}]"
        if not same_shape(out.shape, [*x.shape[:-1], tensor_val(m["mm_w_gate_up"]).shape[-1]]):
            return f"the gate|up product is viewed as {list(out.shape)}, not x's tokens by 2I"
    return None


def splits_the_last_dim(m: Match) -> str | None:
    """The chunk of the gate|up product runs over its last dim (the features)."""
    if "split_dim" in m.bindings and m["split_dim"] not in (-1, tensor_val(m["split"].args[0]).dim() - 1):
        return f"split over dim {m['split_dim']}, not the features"
    return None


def act_rounds_to_input_dtype(m: Match) -> str | None:
    """The fp32 SwiGLU of a low-precision MLP is cast back to the input's dtype (one rounding)."""
    if "act_fp32" not in m.bindings:
        return None
    dtype = tensor_val(m["x"]).dtype
    if dtype == torch.float32:
        return "an fp32 input needs no fp32 activation form"
    if m["out_dtype"] != dtype:
        return f"the fp32 SwiGLU is cast to {m['out_dtype']}, not the input's {dtype}"
    return None


GUARDS = (splits_the_last_dim, views_flatten_tokens, weights_match_input, act_rounds_to_input_dtype)


def _build(m: Match) -> Replacement:
    if "w_gate_up" in m.bindings:  # views of the two halves of the concatenated weight
        w, inter = m["w_gate_up"], m["inter"]
        gate = Derived(aten.slice.Tensor, (w, 0, 0, inter))
        up = Derived(aten.slice.Tensor, (w, 0, inter, 2 * inter))
        return Replacement(gemm_swiglu_ops.gemm_swiglu.op, (m["x"], gate, up))
    act = (True,) if "act_fp32" in m.bindings else ()  # the schema's trailing ``act_fp32=False``
    return Replacement(gemm_swiglu_ops.gemm_swiglu.op, (m["x"], m["w_gate"], m["w_up"], *act))


GEMMS = {aten.mm.default, aten.addmm.default}
PASS_THROUGH = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, operator.getitem,
                aten.split.Tensor, aten.split_with_sizes.default}


def _silu_of_dense_gemm(node: Any) -> bool:
    """A silu whose input is (a view, split or cast of) a dense GEMM output: a SwiGLU candidate."""
    cur = node.args[0]
    for _ in range(5):
        if not hasattr(cur, "target"):
            return False
        if cur.target in GEMMS:
            return True
        if cur.target not in PASS_THROUGH and cur.target not in CAST_TARGETS:
            return False
        cur = cur.args[0]
    return False


PATTERNS = [
    Pattern(name="gemm_swiglu", variant=variant, tree=tree, build=_build, guards=GUARDS,
            anchors=(Anchor(aten.silu.default, _silu_of_dense_gemm),), description=f"GEMM + SwiGLU, {variant}",
            produces="ep_fuse::gemm_swiglu")
    for variant, tree in _trees().items()
]

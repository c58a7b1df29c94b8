"""RMSNorm and residual add + RMSNorm (graph forms: ``docs/patterns.md``).

Core, in every variant::

    xf   = x | _to_copy(x, float32)                     # upcast or not
    rstd = rsqrt(mean(pow(xf, 2) | xf*xf, [-1], True) + eps)   # eps literal or 0-d tensor
         | pow(mean(...) + eps, -0.5)                   # the ``_pow`` variants (HF Gemma4 / MuseSpark)
    n    = xf * rstd

Tails (the ``mode`` of ``ep_fuse::rms_norm``):

* ``llama``        ``w * _to_copy(n, D)``          (weight left or right, any ``type_as`` kwargs)
* ``weight_fp32``  ``_to_copy(w * n, D)`` or ``w * n``  (GPT-OSS; plain fp32 models)
* ``gemma``        ``[_to_copy](n * (_to_copy(w, f32) + 1.0), D)``   (Qwen3-Next)
* ``none``         ``_to_copy(n, D)`` or ``n``     (weightless L2 q/k-norm)
* ``weight_fp32_pow`` / ``none_pow``: those tails on the ``pow(·, -0.5)`` statistic (Gemma4-style
  ``with_scale=True`` / ``False``: ``n * w.float()`` in fp32, then ``type_as``)

* ``none_rstd_cast`` ``x * _to_copy(rstd, D)`` with ``D = x.dtype`` and the upcast ``xf``: the statistic rounded
  to the model dtype, multiplied by the unconverted input (DeepSeek-V4's ``DeepseekV4UnweightedRMSNorm``)

``add_rms_norm`` is the same tree with ``x = a + b``; the sum keeps its other users through the
fused op's second output. The reduction may be over hidden or over head_dim of a 4-D view.
The ``<mode>_cast_sum`` variants read ``x = _to_copy(a + b, N)``: the add in the operands' promoted dtype (a bf16
branch plus Zaya's fp32 residual stream), the norm over the sum rounded to ``N`` (``norm_dtype``).

``fused`` / ``fused_none``: ``getitem(aten._fused_rms_norm(x, [D], w | None, eps | None), 0)``, what
``F.rms_norm`` / ``nn.RMSNorm`` trace to on CUDA (PyTorch's own kernel, fp32 inside: ``weight_fp32`` / ``none``
with the upcast of a low-precision input; ``eps=None`` is the input dtype's ``finfo.eps``). On the CPU the same
modules decompose into the core above.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ep_fuse.fx_utils import tensor_val
from ep_fuse.matching import Anchor, Cast, Item, Lit, Match, Opt, Pattern, Replacement, Var, alt, equals, is_number, op
from ep_fuse.matching import Derived
from ep_fuse.matching.checks import tensor_of
from ep_fuse.ops import rms_norm as rms_norm_ops

aten = torch.ops.aten
F32 = torch.float32
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

DESCRIPTION = "RMSNorm and residual add + RMSNorm -> ep_fuse::rms_norm / ep_fuse::add_rms_norm"


# --------------------------------------------------------------------------- value checks
_float_tensor = tensor_of(FLOATS)


def _scalar_float_tensor(v: Any) -> str | None:
    t = tensor_val(v)
    if t is None or t.dtype not in FLOATS or t.dim() != 0:
        return "eps must be a number or a 0-d floating tensor"
    return None


def _dim_list(v: Any) -> str | None:
    if isinstance(v, (list, tuple)) and len(v) == 1 and isinstance(v[0], int):
        return None
    return f"expected a single reduction dim, got {v!r}"


# --------------------------------------------------------------------------- trees
def _trees(x: Any) -> dict[str, Any]:
    """The tail of each ``mode`` over the core on ``x``."""
    xf = alt(Cast(x, F32, bind="upcast_node"), x, bind="xf")
    var_eps = _var_eps(xf)
    rstd = op(aten.rsqrt.default, self=var_eps)
    n = op(aten.mul.Tensor, self=xf, other=rstd, commutative=("self", "other"), bind="n")
    rstd_pow = op(aten.pow.Tensor_Scalar, self=var_eps, exponent=Lit(equals(-0.5)))
    n_pow = op(aten.mul.Tensor, self=xf, other=rstd_pow, commutative=("self", "other"), bind="n")
    w = Var("weight", _float_tensor)
    mul_w = op(aten.mul.Tensor, self=w, other=n, commutative=("self", "other"))
    one_plus_w = op((aten.add.Tensor, aten.add.Scalar), self=Opt(Cast(w, F32)), other=Lit(equals(1.0)),
                    commutative=("self", "other"))
    return {
        "llama": op(aten.mul.Tensor, self=w, other=Cast(n, "out_dtype"), commutative=("self", "other")),
        # gemma before weight_fp32: ``n * (1 + w)`` is also ``w' * n`` with ``w' = 1 + w``
        "gemma": Opt(Cast(op(aten.mul.Tensor, self=n, other=one_plus_w, commutative=("self", "other")),
                          "out_dtype")),
        "weight_fp32": Opt(Cast(mul_w, "out_dtype")),
        "none": Opt(Cast(n, "out_dtype")),
        "weight_fp32_pow": Opt(Cast(op(aten.mul.Tensor, self=w, other=n_pow, commutative=("self", "other")),
                                    "out_dtype")),
        "none_pow": Opt(Cast(n_pow, "out_dtype")),
        # the statistic of an explicit upcast, rounded back, times the input itself (not its upcast)
        "none_rstd_cast": op(aten.mul.Tensor, self=x,
                             other=Cast(op(aten.rsqrt.default, self=_var_eps(Cast(x, F32, bind="upcast_node"))),
                                        "out_dtype"),
                             commutative=("self", "other")),
    }


def _var_eps(xf: Any) -> Any:
    """``mean(xf**2 | xf*xf, [-1], True) + eps``: the statistic before its inverse square root."""
    sq = alt(
        op(aten.pow.Tensor_Scalar, self=xf, exponent=Lit(equals(2))),
        op(aten.mul.Tensor, self=xf, other=xf),
    )
    var = op(aten.mean.dim, self=sq, dim=Lit(_dim_list, bind="dims"), keepdim=Lit(equals(True)), bind="mean")
    eps = alt(Lit(is_number, bind="eps"), Var("eps_t", _scalar_float_tensor))
    return op((aten.add.Tensor, aten.add.Scalar), self=var, other=eps, commutative=("self", "other"))


def _no_value(v: Any) -> str | None:
    return None if v is None else f"expected None, got {v!r}"


def _eps_or_none(v: Any) -> str | None:
    return None if v is None else is_number(v)


def _fused(x: Any, weighted: bool) -> Any:
    """PyTorch's ``_fused_rms_norm`` (CUDA's ``F.rms_norm``): output 0 of the op over the last dim."""
    w = Var("weight", _float_tensor) if weighted else Lit(_no_value)
    return Item(op(aten._fused_rms_norm.default, input=x, normalized_shape=Lit(_dim_list, bind="shape"), weight=w,
                   eps=Lit(_eps_or_none, bind="eps_opt"), bind="fused"), 0)


def _is_inverse_sqrt(node: Any) -> bool:
    """``pow(·, -0.5)``: the statistic of the ``_pow`` variants (``pow(x, 2)`` is no candidate site)."""
    return len(node.args) > 1 and node.args[1] == -0.5


ANCHORS = {"rsqrt": (aten.rsqrt.default,), "pow": (Anchor(aten.pow.Tensor_Scalar, _is_inverse_sqrt),),
           "fused": (aten._fused_rms_norm.default,)}
"""Candidate sites (near misses): the ``rsqrt`` of the rsqrt variants, the ``pow(·, -0.5)`` of the ``_pow`` ones."""


# --------------------------------------------------------------------------- guards
def reduces_last_dim(m: Match) -> tuple[Any, str] | None:
    """The mean runs over the last dim (the one the canonical op normalises); ``_fused_rms_norm`` normalises over
    ``normalized_shape``, which must be the last dim alone."""
    x = tensor_val(m["x"])
    if "shape" in m.bindings:
        (d,) = m["shape"]
        return None if statically_known_true(d == x.shape[-1]) else \
            (m["fused"], f"normalized_shape [{d}] is not the last dim of a {list(x.shape)} tensor")
    (d,) = m["dims"]
    if d not in (-1, x.dim() - 1):
        return m["mean"], f"mean over dim {d} of a {x.dim()}-D tensor is not over the last dim"
    return None


def weight_is_row(m: Match) -> tuple[Any, str] | None:
    """The weight is a vector over the normalised dim, not a tensor broadcast over more dims."""
    if "weight" not in m.bindings:
        return None
    w, x = tensor_val(m["weight"]), tensor_val(m["x"])
    if w.dim() != 1 or not statically_known_true(w.shape[0] == x.shape[-1]):
        return m["weight"], f"weight of shape {list(w.shape)} is not a vector over the normalised dim ({x.shape[-1]})"
    return None


def _without_leading_ones(shape: Any) -> list[Any]:
    dims = list(shape)
    while dims and statically_known_true(dims[0] == 1):
        dims.pop(0)
    return dims


def add_is_plain(m: Match) -> tuple[Any, str] | None:
    """The residual add adds two tensors of one dtype and one shape (no promotion, no broadcast), or of shapes that
    differ only by leading size-1 dims (gpt-fast: ``[1, T, D] + [T, D]``; the same elements, one numel):
    :func:`_build_add` unsqueezes the operand with fewer dims to the sum's shape."""
    a, b = tensor_val(m["a"]), tensor_val(m["b"])
    if a.dtype != b.dtype:
        return m["x"], f"residual add mixes {a.dtype} and {b.dtype}"
    return add_promotes(m)


def add_promotes(m: Match) -> tuple[Any, str] | None:
    """The residual add of the ``_cast_sum`` variants: the operands may differ in dtype (``torch.add`` promotes them,
    and so does the reference; the norm reads the sum rounded to ``norm_dtype``); their shapes are one shape or
    differ only by leading size-1 dims, as in :func:`add_is_plain`."""
    a, b = tensor_val(m["a"]), tensor_val(m["b"])
    if a.dim() == b.dim() and all(statically_known_true(p == q) for p, q in zip(a.shape, b.shape)):
        return None
    core_a, core_b = _without_leading_ones(a.shape), _without_leading_ones(b.shape)
    if a.dim() == b.dim() or len(core_a) != len(core_b) or not all(
            statically_known_true(p == q) for p, q in zip(core_a, core_b)):
        return m["x"], f"residual add broadcasts {list(a.shape)} with {list(b.shape)}"
    return None


def rstd_rounds_to_input_dtype(m: Match) -> tuple[Any, str] | None:
    """``none_rstd_cast``: the statistic is rounded to the norm input's own dtype (DeepSeek-V4's ``.to(x.dtype)``); a
    cast to another dtype is another computation, left alone."""
    x_dtype = _norm_input_dtype(m)
    if m["out_dtype"] != x_dtype:
        return m["upcast_node"], f"the statistic is rounded to {m['out_dtype']}, not to the input's {x_dtype}"
    return None


GUARDS = (reduces_last_dim, weight_is_row)

FUSED_MODES = {"fused": "weight_fp32", "fused_none": "none"}
"""The ``_fused_rms_norm`` variants and the canonical mode each is."""


# --------------------------------------------------------------------------- replacements
def _norm_input_dtype(m: Match) -> torch.dtype:
    """The dtype the norm reads: the ``_cast_sum`` variants' rounding of the sum, else ``x``'s own."""
    return m["norm_dtype"] if "norm_dtype" in m.bindings else tensor_val(m["x"]).dtype


def _norm_args(m: Match, mode: str) -> tuple[Any, ...]:
    if mode in FUSED_MODES:  # PyTorch's kernel: fp32 inside, the input's dtype out
        dtype = _norm_input_dtype(m)
        eps = m["eps_opt"]
        eps = float(torch.finfo(dtype).eps if eps is None else eps)
        low = dtype != F32
        return (m.get("weight"), eps, None, FUSED_MODES[mode], low, dtype if low else None)
    eps_t = m.get("eps_t")
    eps = float(m["eps"]) if eps_t is None else 0.0
    return (m.get("weight"), eps, eps_t, mode, m.get("upcast_node") is not None, m.get("out_dtype"))


def _build_plain(mode: str):
    def build(m: Match) -> Replacement:
        return Replacement(rms_norm_ops.rms_norm.op, (m["x"], *_norm_args(m, mode)))

    return build


def _to_sum_shape(m: Match, name: str) -> Any:
    """Operand ``name`` with the leading size-1 dims it lacks against the sum (:func:`add_is_plain`), as views."""
    t = m[name]
    for _ in range(tensor_val(m["x"]).dim() - tensor_val(t).dim()):
        t = Derived(aten.unsqueeze.default, (t, 0))
    return t


def _build_add(mode: str):
    def build(m: Match) -> Replacement:
        a, b = _to_sum_shape(m, "a"), _to_sum_shape(m, "b")
        norm_dtype = (m["norm_dtype"],) if "norm_dtype" in m.bindings else ()  # the ``_cast_sum`` variants
        return Replacement(rms_norm_ops.add_rms_norm.op, (a, b, *_norm_args(m, mode), *norm_dtype), ("root", "x"))

    return build


CAST_SUM = "_cast_sum"
"""Suffix of the ``add_rms_norm`` variants whose norm reads the sum rounded to ``norm_dtype``."""

MODE_GUARDS = {"none_rstd_cast": (rstd_rounds_to_input_dtype,)}
"""Guards of one mode only."""


def _patterns() -> list[Pattern]:
    out: list[Pattern] = []
    add_x = op(aten.add.Tensor, self=Var("a", _float_tensor), other=Var("b", _float_tensor), bind="x", shared=True)
    cast_sum_x = Cast(add_x, "norm_dtype")
    plain_x = Var("x", _float_tensor)
    for name, suffix, x, build, extra in (
        ("add_rms_norm", "", add_x, _build_add, (add_is_plain,)),
        ("add_rms_norm", CAST_SUM, cast_sum_x, _build_add, (add_promotes,)),
        ("rms_norm", "", plain_x, _build_plain, ()),
    ):
        trees = {**_trees(x), "fused": _fused(x, True), "fused_none": _fused(x, False)}
        for mode, tree in trees.items():
            anchors = ANCHORS["fused" if mode in FUSED_MODES else "pow" if mode.endswith("_pow") else "rsqrt"]
            out.append(
                Pattern(
                    name=name,
                    variant=mode + suffix,
                    tree=tree,
                    build=build(mode),
                    guards=(*GUARDS, *extra, *MODE_GUARDS.get(mode, ())),
                    anchors=anchors,
                    description=(f"{'residual add + ' if name == 'add_rms_norm' else ''}RMSNorm, {mode} weight"
                                 f"{', over the sum rounded to another dtype' if suffix else ''}"),
                    produces=f"ep_fuse::{name}",
                )
            )
    return out


PATTERNS = _patterns()

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

``add_rms_norm`` is the same tree with ``x = a + b``; the sum keeps its other users through the
fused op's second output. The reduction may be over hidden or over head_dim of a 4-D view.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ep_fuse.fx_utils import tensor_val
from ep_fuse.matching import Anchor, Cast, Lit, Match, Opt, Pattern, Replacement, Var, alt, equals, is_number, op
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
    sq = alt(
        op(aten.pow.Tensor_Scalar, self=xf, exponent=Lit(equals(2))),
        op(aten.mul.Tensor, self=xf, other=xf),
    )
    var = op(aten.mean.dim, self=sq, dim=Lit(_dim_list, bind="dims"), keepdim=Lit(equals(True)), bind="mean")
    eps = alt(Lit(is_number, bind="eps"), Var("eps_t", _scalar_float_tensor))
    var_eps = op((aten.add.Tensor, aten.add.Scalar), self=var, other=eps, commutative=("self", "other"))
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
    }


def _is_inverse_sqrt(node: Any) -> bool:
    """``pow(·, -0.5)``: the statistic of the ``_pow`` variants (``pow(x, 2)`` is no candidate site)."""
    return len(node.args) > 1 and node.args[1] == -0.5


ANCHORS = {"rsqrt": (aten.rsqrt.default,), "pow": (Anchor(aten.pow.Tensor_Scalar, _is_inverse_sqrt),)}
"""Candidate sites (near misses): the ``rsqrt`` of the rsqrt variants, the ``pow(·, -0.5)`` of the ``_pow`` ones."""


# --------------------------------------------------------------------------- guards
def reduces_last_dim(m: Match) -> tuple[Any, str] | None:
    """The mean runs over the last dim (the one the canonical op normalises)."""
    x = tensor_val(m["x"])
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


def add_is_plain(m: Match) -> tuple[Any, str] | None:
    """The residual add adds two tensors of one dtype and one shape (no promotion, no broadcast)."""
    a, b = tensor_val(m["a"]), tensor_val(m["b"])
    if a.dtype != b.dtype:
        return m["x"], f"residual add mixes {a.dtype} and {b.dtype}"
    if a.dim() != b.dim() or not all(statically_known_true(p == q) for p, q in zip(a.shape, b.shape)):
        return m["x"], f"residual add broadcasts {list(a.shape)} with {list(b.shape)}"
    return None


GUARDS = (reduces_last_dim, weight_is_row)


# --------------------------------------------------------------------------- replacements
def _norm_args(m: Match, mode: str) -> tuple[Any, ...]:
    eps_t = m.get("eps_t")
    eps = float(m["eps"]) if eps_t is None else 0.0
    return (m.get("weight"), eps, eps_t, mode, m.get("upcast_node") is not None, m.get("out_dtype"))


def _build_plain(mode: str):
    def build(m: Match) -> Replacement:
        return Replacement(rms_norm_ops.rms_norm.op, (m["x"], *_norm_args(m, mode)))

    return build


def _build_add(mode: str):
    def build(m: Match) -> Replacement:
        return Replacement(rms_norm_ops.add_rms_norm.op, (m["a"], m["b"], *_norm_args(m, mode)), ("root", "x"))

    return build


def _patterns() -> list[Pattern]:
    out: list[Pattern] = []
    add_x = op(aten.add.Tensor, self=Var("a", _float_tensor), other=Var("b", _float_tensor), bind="x", shared=True)
    plain_x = Var("x", _float_tensor)
    for name, x, build, extra in (
        ("add_rms_norm", add_x, _build_add, (add_is_plain,)),
        ("rms_norm", plain_x, _build_plain, ()),
    ):
        for mode, tree in _trees(x).items():
            out.append(
                Pattern(
                    name=name,
                    variant=mode,
                    tree=tree,
                    build=build(mode),
                    guards=(*GUARDS, *extra),
                    anchors=ANCHORS["pow" if mode.endswith("_pow") else "rsqrt"],
                    description=f"{'residual add + ' if name == 'add_rms_norm' else ''}RMSNorm, {mode} weight",
                    produces=f"ep_fuse::{name}",
                )
            )
    return out


PATTERNS = _patterns()

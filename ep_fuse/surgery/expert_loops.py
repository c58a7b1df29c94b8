"""Per-expert Python loops made traceable (used by :func:`ep_fuse.prepare`).

MoE blocks written before transformers 5 -- DeepSeek-V2/V3's ``modeling_deepseek.py`` (remote code),
Mixtral / Qwen2-MoE / OLMoE in transformers 4.x, many vendor models -- hold their experts as an
``nn.ModuleList`` of SwiGLU MLPs and loop over it in Python. Dynamo breaks the graph in that loop
(data-dependent expert counts, ``.cpu().numpy()``), so no backend ever sees the expert GEMMs.

:func:`convert_expert_loops` replaces the list by :class:`StackedExperts` -- the same weights stacked
once into ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` -- run by transformers' own
``grouped_mm`` / ``batched_mm`` experts function (the form the ``moe_experts`` pattern matches), and
swaps the loop for a call of it:

* ``moe_infer`` blocks (DeepSeek remote code), or ``moe`` blocks (NemotronH remote code, non-gated
  ``relu(up(x)) ** 2`` experts): the block's ``forward`` and its gate run unchanged; only
  ``moe_infer(x, topk_ids, topk_weight)`` / ``moe(...)`` is replaced;
* softmax top-k blocks (Mixtral / Qwen2-MoE style: an ``nn.Linear`` gate, ``top_k``, optional
  ``norm_topk_prob``, optional ``shared_expert`` with a sigmoid ``shared_expert_gate``): ``forward``
  is replaced by one computing the same routing in the same order;
* any other layout (routing in a method of the block or a gate module of any kind, the list under
  another name): recognised by a trace of what it computes (:mod:`ep_fuse.surgery.loop_dataflow`);
  ``forward`` becomes the block's own router, the stacked experts and the shared experts added.

Every conversion is checked before it is kept: expert 0 must compute ``down(silu(gate(x)) * up(x))``
and the converted block must reproduce the loop on random tokens (eval mode); otherwise the block is
restored and the reason reported. The state dict keeps the per-expert keys (``experts.3.w1.weight``):
:class:`StackedExperts` writes them as slices of the stacked weights and stacks them again on load.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ep_fuse.surgery.moe_expert_storage import ACTIVATIONS, experts_function
from ep_fuse.surgery.loop_dataflow import (LoopNotRecognised, dataflow_forward, infer_layout, recognise_loop,
                                         routed_expert_lists)

log = logging.getLogger("ep_fuse")

EXPERT_LIST_NAMES = ("experts",)
"""Attribute names under which a block holds its per-expert ``nn.ModuleList``."""

UNGATED_LAYOUTS: tuple[tuple[str, ...], ...] = (("up_proj", "down_proj"),)
"""Non-gated expert MLP layouts (NemotronH: ``down(relu(up(x)) ** 2)``), as the Linear names of (up, down)."""

LAYOUTS: tuple[tuple[str, ...], ...] = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"),
                                        ("gate_up_proj", "down_proj")) + UNGATED_LAYOUTS
"""Expert MLP layouts, as the Linear names of (gate, up, down), or (gate|up fused, down), then
:data:`UNGATED_LAYOUTS` (tried last: a gated expert also has an ``up_proj``)."""

CHECK_TOKENS = (2, 16)
"""Shape ``[B, S]`` of the random tokens the converted block is compared on."""


class LoopRefused(Exception):
    """A per-expert loop that cannot be converted; ``str()`` is the reason."""


@dataclass(frozen=True)
class Conversion:
    """What :func:`convert_expert_loops` did (or refused) for one block."""

    path: str
    block_class: str
    form: str | None = None
    num_experts: int = 0
    layout: tuple[str, ...] = ()
    reason: str | None = None
    block: nn.Module | None = field(default=None, compare=False, repr=False)

    @property
    def converted(self) -> bool:
        return self.reason is None


# --------------------------------------------------------------------------- stacked experts
def _experts_function(implementation: str) -> Callable[..., torch.Tensor]:
    try:
        return experts_function(implementation)
    except LookupError as e:
        raise LoopRefused(str(e)) from e


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    """``relu(x) ** 2``, the activation of the non-gated experts (transformers' ``relu2``)."""
    return torch.square(F.relu(x))


class _ExpertView:
    """Expert ``i`` of a :class:`StackedExperts` as a callable, for code that still indexes the list."""

    def __init__(self, experts: StackedExperts, index: int) -> None:
        self.experts, self.index = experts, index

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, self.experts.first[self.index])
        if not self.experts.has_gate:
            return F.linear(relu_squared(h), self.experts.down_proj[self.index])
        gate, up = h.chunk(2, dim=-1)
        return F.linear(self.experts.act_fn(gate) * up, self.experts.down_proj[self.index])


class StackedExperts(nn.Module):
    """``E`` SwiGLU experts as two stacked weights, run by transformers' ``grouped_mm``/``batched_mm``.

    ``forward(hidden [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]`` is
    ``sum_k w[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` with ``e = top_k_index[t, k]``, the
    weighted sum in the promotion of the token and weight dtypes, cast to the token dtype.
    The state dict holds the original per-expert keys (``<i>.<name>.weight``); indexing and iterating
    give per-expert callables (slices of the stacked weights), so code that loops still runs.
    Non-gated experts (a layout of :data:`UNGATED_LAYOUTS`) hold ``up_proj`` [E, I, H] instead of
    ``gate_up_proj`` and compute ``down_e(relu(up_e(x)) ** 2)``.
    """

    def __init__(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, layout: tuple[str, ...],
                 implementation: str = "grouped_mm", key_order: tuple[str, ...] | None = None,
                 act: str = "silu") -> None:
        super().__init__()
        self.has_gate = layout not in UNGATED_LAYOUTS
        self.first_name = "gate_up_proj" if self.has_gate else "up_proj"
        setattr(self, self.first_name, nn.Parameter(gate_up_proj, requires_grad=gate_up_proj.requires_grad))
        self.down_proj = nn.Parameter(down_proj, requires_grad=down_proj.requires_grad)
        self.layout = layout
        self.key_order = key_order or layout  # the order the original expert registered its Linears in
        self.implementation = implementation
        self._experts_forward = _experts_function(implementation)
        # what transformers' experts functions read off their module
        self.num_experts = gate_up_proj.shape[0]
        self.has_bias, self.is_transposed = False, False
        self.has_post_expert_norm, self._is_expert_parallel = False, False
        self.act = act if self.has_gate else "relu2"
        self.act_fn = ACTIVATIONS[act] if self.has_gate else relu_squared

    @property
    def first(self) -> torch.Tensor:
        """The first stacked weight: ``gate_up_proj`` [E, 2I, H], or ``up_proj`` [E, I, H] without a gate."""
        return getattr(self, self.first_name)

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return self._experts_forward(self, hidden, top_k_index, top_k_weights)

    def extra_repr(self) -> str:
        e, rows, h = self.first.shape
        inter = rows // 2 if self.has_gate else rows
        return f"num_experts={e}, hidden={h}, intermediate={inter}, layout={'/'.join(self.layout)}, " \
               f"implementation={self.implementation}"

    # ---- list-like access (the original code's loops and len() keep working, eagerly)
    def __len__(self) -> int:
        return self.num_experts

    def __getitem__(self, index: int) -> _ExpertView:
        if not -self.num_experts <= index < self.num_experts:
            raise IndexError(f"expert {index} of {self.num_experts}")
        return _ExpertView(self, index % self.num_experts)

    def __iter__(self) -> Iterator[_ExpertView]:
        return (self[i] for i in range(self.num_experts))

    # ---- per-expert state dict keys
    def _per_expert(self, i: int, gate_up: torch.Tensor, down: torch.Tensor) -> dict[str, torch.Tensor]:
        """Expert ``i``'s Linear weights by Linear name, as slices of the stacked tensors."""
        if len(self.layout) == 2:  # one fused gate|up Linear, or the up Linear of a non-gated expert
            parts = {self.layout[0]: gate_up[i]}
        else:
            inter = down.shape[2]
            parts = {self.layout[0]: gate_up[i, :inter], self.layout[1]: gate_up[i, inter:]}
        parts[self.layout[-1]] = down[i]
        return parts

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        gate_up, down = self.first, self.down_proj
        if not keep_vars:
            gate_up, down = gate_up.detach(), down.detach()
        for i in range(self.num_experts):
            parts = self._per_expert(i, gate_up, down)
            for name in self.key_order:
                destination[f"{prefix}{i}.{name}.weight"] = parts[name]

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any],
                              strict: bool, missing_keys: list[str], unexpected_keys: list[str],
                              error_msgs: list[str]) -> None:
        for stacked, names in ((self.first_name, self.layout[:-1]), ("down_proj", self.layout[-1:])):
            keys = [[f"{prefix}{i}.{n}.weight" for n in names] for i in range(self.num_experts)]
            flat = [k for per_expert in keys for k in per_expert]
            if prefix + stacked in state_dict or not all(k in state_dict for k in flat):
                continue  # stacked keys (named_parameters()), or incomplete: the stacked key is reported missing
            state_dict[prefix + stacked] = torch.stack([torch.cat([state_dict[k] for k in ks]) for ks in keys])
            for k in flat:
                del state_dict[k]
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)


# --------------------------------------------------------------------------- analysis
def _find_layout(expert: nn.Module) -> tuple[str, ...]:
    for layout in LAYOUTS:
        if all(isinstance(getattr(expert, name, None), nn.Module) for name in layout):
            return layout
    inferred = infer_layout(expert)  # other names: the Linears' roles found by what the expert computes
    if inferred is not None:
        return inferred
    raise LoopRefused(f"experts are {type(expert).__name__} without gate/up/down Linears "
                      f"({', '.join('/'.join(names) for names in LAYOUTS)}, or others computing "
                      "down(silu(gate(x)) * up(x)))")


_ACT_NAMES = ("act_fn", "activation_fn", "act", "activation")


def _computes_relu_squared(act: Any) -> bool:
    probe = torch.linspace(-3, 3, 13)
    try:
        with torch.no_grad():
            return torch.equal(act(probe), relu_squared(probe))
    except Exception:  # noqa: BLE001  (any failure: not this activation)
        return False


def _check_activation(expert: nn.Module, gated: bool = True) -> None:
    for name in _ACT_NAMES:
        act = getattr(expert, name, None)
        if act is None:
            continue
        if not gated:
            if not callable(act) or not _computes_relu_squared(act):
                raise LoopRefused(f"expert activation {name}={type(act).__name__} of a non-gated up/down MLP is not "
                                  "relu(x) ** 2")
            return
        silu = act is F.silu or isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")
        if not silu:
            label = type(act).__name__ if isinstance(act, nn.Module) else getattr(act, "__name__", repr(act))
            raise LoopRefused(f"expert activation {name}={label} is not SiLU (not a SwiGLU MLP)")
        return


def analyze_experts(experts: nn.ModuleList) -> tuple[tuple[str, ...], int, int]:
    """The layout, hidden size and intermediate size of a list of SwiGLU experts; raises :class:`LoopRefused`."""
    if len(experts) < 1:
        raise LoopRefused("the expert list is empty")
    if any(e is None for e in experts):
        raise LoopRefused("some experts are None (expert-parallel remote code with ep_size > 1: load the model "
                          "whole and use ep_fuse's expert parallelism instead)")
    first = experts[0]
    if any(type(e) is not type(first) for e in experts):
        raise LoopRefused(f"experts of mixed classes {sorted({type(e).__name__ for e in experts})}")
    layout = _find_layout(first)
    gated = layout not in UNGATED_LAYOUTS
    if not gated and not any(getattr(first, n, None) is not None for n in _ACT_NAMES):
        raise LoopRefused(f"non-gated experts {type(first).__name__} have no activation attribute "
                          f"({', '.join(_ACT_NAMES)}) to check")
    _check_activation(first, gated)
    shapes = None
    for i, expert in enumerate(experts):
        linears = [getattr(expert, name, None) for name in layout]
        for name, lin in zip(layout, linears):
            if type(lin) is not nn.Linear:
                raise LoopRefused(f"experts[{i}].{name} is {type(lin).__name__}, not torch.nn.Linear "
                                  "(quantized or wrapped projections are not stacked)")
            if lin.bias is not None:
                raise LoopRefused(f"experts[{i}].{name} has a bias (the stacked experts have none)")
            if getattr(lin, "_hf_hook", None) is not None or lin.weight.device.type == "meta":
                raise LoopRefused(f"experts[{i}].{name} is offloaded or not loaded (device {lin.weight.device})")
        these = [tuple(lin.weight.shape) for lin in linears] + [(lin.weight.dtype, lin.weight.device) for lin in linears]
        if shapes is None:
            shapes = these
        elif these != shapes:
            raise LoopRefused(f"experts[{i}] differs from experts[0] in shape, dtype or device")
    state = {k for k, _ in first.named_parameters()} | {k for k, _ in first.named_buffers()}
    others = sorted(state - {f"{name}.weight" for name in layout})
    if others:
        raise LoopRefused(f"experts hold more than their {'/'.join(layout)} weights: {', '.join(others)}")
    weights = [getattr(first, name).weight for name in layout]
    if len({(w.dtype, w.device) for w in weights}) != 1:
        raise LoopRefused("expert projections of mixed dtypes or devices")
    down = weights[-1]
    hidden, inter = down.shape
    gate_up_rows = sum(w.shape[0] for w in weights[:-1])
    if any(w.shape[1] != hidden for w in weights[:-1]) or gate_up_rows != (2 if gated else 1) * inter or \
            (len(layout) == 3 and weights[0].shape != weights[1].shape):
        raise LoopRefused(f"expert projections {'/'.join(layout)} of shapes {[list(w.shape) for w in weights]} "
                          "are not a gate/up/down MLP")
    return layout, hidden, inter


def stack_experts(experts: nn.ModuleList, layout: tuple[str, ...], implementation: str,
                  act: str = "silu") -> StackedExperts:
    """One-time stacked copies of the experts' weights (the list's own tensors are not kept)."""
    with torch.no_grad():
        gate_up = torch.stack([torch.cat([getattr(e, n).weight for n in layout[:-1]], dim=0) for e in experts])
        down = torch.stack([getattr(e, layout[-1]).weight for e in experts])
    gate_up.requires_grad_(getattr(experts[0], layout[0]).weight.requires_grad)
    down.requires_grad_(getattr(experts[0], layout[-1]).weight.requires_grad)
    order = tuple(name for name, _ in experts[0].named_children() if name in layout)
    return StackedExperts(gate_up, down, layout, implementation, order, act)


# --------------------------------------------------------------------------- replacements
LOOP_METHODS = ("moe_infer", "moe")
"""Block methods ``(x [T, H], topk_ids, topk_weights) -> [T, H]`` that hold the per-expert loop (DeepSeek,
NemotronH remote code); the first one present is replaced."""


def _moe_infer(self: nn.Module, x: torch.Tensor, topk_ids: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
    """DeepSeek's ``moe_infer`` (or NemotronH's ``moe``) with the stacked experts: the weighted sum runs in the
    weights' dtype (``.type(topk_weight.dtype).mul_(w).sum(1)``), which transformers' function reproduces when
    that is the promotion of the two dtypes; otherwise the original loop runs (per-expert slices)."""
    if torch.promote_types(x.dtype, topk_weight.dtype) != topk_weight.dtype:
        return self._ep_fuse_loop_moe_infer(x, topk_ids, topk_weight)
    return self.experts(x, topk_ids, topk_weight)


def _loop_method(block: nn.Module) -> str | None:
    """The first of :data:`LOOP_METHODS` that ``block`` defines as a method (not a submodule)."""
    for name in LOOP_METHODS:
        if isinstance(getattr(block, name, None), types.MethodType):
            return name
    return None


def _softmax_topk_forward(self: nn.Module, hidden_states: torch.Tensor) -> Any:
    """Mixtral / Qwen2-MoE (transformers 4.x): fp32 softmax, top-k, optional renormalisation, weights
    cast to the tokens' dtype; Qwen2's shared expert scaled by ``sigmoid(shared_expert_gate(x))``."""
    batch, seq, hidden = hidden_states.shape
    jitter = getattr(self, "jitter_noise", 0)
    if self.training and jitter:
        hidden_states *= torch.empty_like(hidden_states).uniform_(1.0 - jitter, 1.0 + jitter)
    x = hidden_states.view(-1, hidden)
    router_logits = self.gate(x)
    routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
    routing_weights, selected = torch.topk(routing_weights, self._ep_fuse_top_k, dim=-1)
    if getattr(self, "norm_topk_prob", True):
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
    routing_weights = routing_weights.to(x.dtype)
    out = self.experts(x, selected, routing_weights)
    if getattr(self, "shared_expert", None) is not None:
        out = out + F.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
    out = out.reshape(batch, seq, hidden)
    return (out, router_logits) if self._ep_fuse_returns_logits else out


_SOFTMAX_CHILDREN = {"gate", "experts", "shared_expert", "shared_expert_gate"}


def _form(block: nn.Module, num_experts: int) -> str:
    """Which replacement fits ``block``; raises :class:`LoopRefused` for an unknown structure."""
    method = _loop_method(block)
    if method is not None:
        ep_size = getattr(block, "ep_size", 1)
        if ep_size != 1:
            raise LoopRefused(f"expert-parallel remote code (ep_size={ep_size}); load it with ep_size=1 and use "
                              "ep_fuse's expert parallelism")
        if not isinstance(getattr(block, "gate", None), nn.Module):
            raise LoopRefused(f"{method} without a gate module")
        return method
    gate = getattr(block, "gate", None)
    top_k = getattr(block, "top_k", getattr(block, "num_experts_per_tok", None))
    children = {name for name, _ in block.named_children()}
    if type(gate) is nn.Linear and gate.bias is None and gate.out_features == num_experts and isinstance(top_k, int) \
            and children <= _SOFTMAX_CHILDREN and ("shared_expert" in children) == ("shared_expert_gate" in children):
        return "softmax_topk"
    raise LoopRefused(f"unknown forward structure of {type(block).__name__} (children {sorted(children)}; known: a "
                      "moe_infer or moe method, or an nn.Linear gate with top_k and optional "
                      "shared_expert/shared_expert_gate)")


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2


def _max_rel_diff(a: Any, b: Any) -> float:
    """max |a - b| / max |b| over matching tensor outputs; inf when the structures differ."""
    if isinstance(b, torch.Tensor):
        if not isinstance(a, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
            return float("inf")
        scale = b.float().abs().max().item() or 1.0
        return (a.float() - b.float()).abs().max().item() / scale
    if isinstance(b, (tuple, list)) and isinstance(a, (tuple, list)) and len(a) == len(b):
        return max((_max_rel_diff(x, y) for x, y in zip(a, b)), default=0.0)
    return 0.0 if a is b or a == b else float("inf")


def _check_expert(expert: nn.Module, stacked: StackedExperts, hidden: int) -> None:
    w = stacked.first
    x = torch.randn(4, hidden, generator=torch.Generator().manual_seed(0)).to(device=w.device, dtype=w.dtype)
    with torch.no_grad():
        try:
            ref = expert(x)
        except Exception as e:
            raise LoopRefused(f"experts[0] does not run on rows [T, H] ({type(e).__name__}: {e})") from e
        got = stacked[0](x)
    diff = _max_rel_diff(got, ref)
    if not diff <= _tolerance(w.dtype):
        form = "down(silu(gate(x)) * up(x))" if stacked.has_gate else "down(relu(up(x)) ** 2)"
        raise LoopRefused(f"experts[0] does not compute {form} with its "
                          f"{'/'.join(stacked.layout)} (max relative difference {diff:.2e})")


def _training_flags(block: nn.Module) -> list[tuple[nn.Module, bool]]:
    return [(m, m.training) for m in block.modules()]


class _Swap:
    """The block's attributes before conversion, to restore them."""

    def __init__(self, block: nn.Module, list_name: str) -> None:
        self.block, self.list_name = block, list_name
        self.experts = getattr(block, list_name)
        self.instance_attrs = {k: block.__dict__[k] for k in ("forward", *LOOP_METHODS) if k in block.__dict__}

    def restore(self) -> None:
        setattr(self.block, self.list_name, self.experts)
        for k in ("forward", *LOOP_METHODS, "_ep_fuse_loop_moe_infer", "_ep_fuse_top_k", "_ep_fuse_returns_logits",
                  "_ep_fuse_loop_plan"):
            self.block.__dict__.pop(k, None)
        self.block.__dict__.update(self.instance_attrs)


def convert_block(block: nn.Module, list_name: str, implementation: str) -> tuple[str, int, tuple[str, ...]]:
    """Convert one block in place; returns (form, experts, layout). Raises :class:`LoopRefused` and leaves
    the block as it was when it cannot, or when the converted block does not reproduce the loop."""
    experts = getattr(block, list_name)
    layout, hidden, _ = analyze_experts(experts)
    try:
        form, unknown = _form(block, len(experts)), None
    except LoopRefused as e:  # not a known layout: recognised by dataflow below, or refused with both reasons
        if callable(getattr(block, "moe_infer", None)):
            raise  # a moe_infer block refused for what it is (expert-parallel remote code, no gate)
        form, unknown = "dataflow", e
    stacked = stack_experts(experts, layout, implementation)
    flags = _training_flags(block)
    block.eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*CHECK_TOKENS, hidden, generator=g).to(device=stacked.first.device, dtype=stacked.first.dtype)
    swap = _Swap(block, list_name)
    try:
        plan = None
        if unknown is not None:
            try:
                plan = recognise_loop(block, list_name, x.clone())
            except LoopNotRecognised as e:
                raise LoopRefused(f"{unknown}; by its trace (dataflow): {e}") from e
        _check_expert(experts[0], stacked, hidden)
        with torch.no_grad():
            try:
                ref = block(x.clone())
            except Exception as e:
                raise LoopRefused(f"the block does not run on tokens [B, S, H] ({type(e).__name__}: {e})") from e
            setattr(block, list_name, stacked)
            if form in LOOP_METHODS:
                block._ep_fuse_loop_moe_infer = swap.instance_attrs.get(form, getattr(block, form))
                setattr(block, form, types.MethodType(_moe_infer, block))
            elif plan is not None:
                block._ep_fuse_loop_plan = plan
                block.forward = types.MethodType(dataflow_forward, block)
            else:
                block._ep_fuse_top_k = getattr(block, "top_k", getattr(block, "num_experts_per_tok", None))
                block._ep_fuse_returns_logits = isinstance(ref, tuple)
                block.forward = types.MethodType(_softmax_topk_forward, block)
            try:
                got = block(x.clone())
            except Exception as e:
                raise LoopRefused(f"the converted block fails ({type(e).__name__}: {e})") from e
            diff = _max_rel_diff(got, ref)
            if not diff <= _tolerance(x.dtype):
                what = f"the {form} form" if plan is None else f"what its trace shows ({plan.describe()})"
                raise LoopRefused(f"the converted block differs from the loop on random tokens (max relative "
                                  f"difference {diff:.2e}): its routing is not {what}")
    except BaseException:
        swap.restore()
        raise
    finally:
        for m, training in flags:
            m.training = training
    return form, len(stacked), layout


UNFUSED_EXPERTS: dict[str, str] = {
    "GptOssExperts": "gate|up interleaved ([..., ::2] / [..., 1::2]) with per-expert biases on both projections: "
                     "moe_experts takes no biases (its clamped (up + 1) * g * sigmoid(1.702 g) is act='swigluoai')",
    "LongcatFlashExperts": "zero-compute experts (ids >= n_routed_experts return the token itself) in a per-expert "
                           ".item() loop: no moe_experts form adds the identity experts' term",
    "Llama4TextExperts": "every token through every expert (dense bmm) with the router scores multiplied into the "
                         "input: not a routed top-k block",
    "DbrxExperts": "a per-expert loop over [E * I, H] weights that experts_implementation does not switch and prepare "
                   "does not convert",
    "JetMoeParallelExperts": "expert row counts read on the host (split(expert_size) lists) in the MoE and "
                             "mixture-of-attention layers: the graph breaks per layer",
}
"""Expert classes of transformers that get no ``moe_experts`` block, by class name, with the one-line reason (logged
by :func:`convert_expert_loops`, shown by the generality sweep)."""


UNFUSED_ONLY_IF: dict[str, Callable[[nn.Module], bool]] = {
    # transformers 5.25 moved the identity experts out of the module (weight-0 remapped slots): a plain block
    "LongcatFlashExperts": lambda module: hasattr(module, "identity_expert"),
}
"""Classes of :data:`UNFUSED_EXPERTS` that are unfused only in some transformers versions: the test on the module."""


def unfused_experts(model: nn.Module) -> list[tuple[str, str, str]]:
    """``(path, class, reason)`` of the modules of :data:`UNFUSED_EXPERTS` in ``model`` (outermost only)."""
    found: list[tuple[str, str, str]] = []
    for path, module in model.named_modules():
        reason = UNFUSED_EXPERTS.get(type(module).__name__)
        if reason is not None and not UNFUSED_ONLY_IF.get(type(module).__name__, lambda m: True)(module):
            continue
        if reason is not None and not any(path.startswith(p + ".") for p, _, _ in found):
            found.append((path, type(module).__name__, reason))
    return found


def expert_loop_blocks(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(path, block, list attribute) of every module holding its experts as an ``nn.ModuleList``: named
    ``experts``, or under another name when a trace shows its MLPs run on routed subsets of tokens."""
    found = []
    for path, module in model.named_modules():
        for name in EXPERT_LIST_NAMES:
            if isinstance(module.__dict__.get("_modules", {}).get(name), nn.ModuleList):
                found.append((path, module, name))
    return found + routed_expert_lists(model, {id(module) for _, module, _ in found})


_REPLACED = {"moe_infer": "moe_infer", "moe": "moe", "softmax_topk": "forward (softmax top-k)",
             "dataflow": "forward (recognised by dataflow: router, stacked experts, shared experts)"}


def convert_expert_loops(model: nn.Module, implementation: str = "grouped_mm", strict: bool = False,
                         report_refusals: bool = True) -> list[Conversion]:
    """Convert every per-expert loop of ``model`` in place (see the module docstring).

    Logs each converted block at INFO and each refused one at WARNING with the reason; with
    ``strict=True`` a refusal raises ``ValueError`` instead (blocks already converted stay converted:
    each passed its check). ``report_refusals=False`` only returns the refusals (the caller tries the block
    another way, :mod:`ep_fuse.surgery.moe_semantics`, and reports once)."""
    results = []
    for path, cls, reason in unfused_experts(model):
        log.info("ep_fuse.prepare: %s (%s) gets no moe_experts block: %s", path, cls, reason)
    for path, block, name in expert_loop_blocks(model):
        label = path or type(model).__name__
        try:
            form, n, layout = convert_block(block, name, implementation)
        except LoopRefused as e:
            results.append(Conversion(label, type(block).__name__, reason=str(e), block=block))
            if report_refusals:
                report_refusal(label, block, str(e), strict)
            continue
        results.append(Conversion(label, type(block).__name__, form, n, layout, block=block))
        log.info("ep_fuse.prepare: %s (%s): %d experts (%s) stacked into %s.%s/down_proj, %s replaced, "
                 "experts_implementation=%s", label, type(block).__name__, n, "/".join(layout), name,
                 getattr(block, name).first_name, _REPLACED.get(form, f"forward ({form})"), implementation)
    return results


def report_refusal(label: str, block: nn.Module, reason: str, strict: bool) -> None:
    """The WARNING (or, ``strict``, the ``ValueError``) for a per-expert loop that stays."""
    msg = (f"ep_fuse.prepare: {label} ({type(block).__name__}) keeps its per-expert loop, which breaks the "
           f"graph and gets no MoE fusion: {reason}")
    if strict:
        raise ValueError(msg + " (strict=True; pass strict=False to keep the loop)")
    log.warning(msg)

"""3-D expert weights whose forward transformers does not switch, run as one graph (used by :func:`ep_fuse.prepare`).

transformers' MoE experts hold their weights as 3-D tensors (``gate_up_proj`` [E, 2I, H] or the up projection alone,
``down_proj`` [E, H, I], possibly stored transposed [E, in, out]) with an ``act_fn``. Classes decorated with
``@use_experts_implementation`` switch their forward to the ``grouped_mm`` / ``batched_mm`` experts functions, which
trace to one graph; classes without the hook (Step-3.7's experts in transformers 5.24; Gemma-4's in versions that
lacked the hook; remote code written the same way) always run the eager loop over the experts some slot routes to
(``one_hot`` / ``nonzero`` / ``where`` / ``index_add_``), which breaks the graph per expert and hides the expert GEMMs.

:func:`convert_hookless_experts` finds such modules -- 3-D ``gate_up_proj`` (or ``up_proj``) and ``down_proj``, an
``act_fn``, a ``forward(hidden [T, H], top_k_index [T, K], top_k_weights [T, K])``, no experts-implementation switch --
and gives each a forward that runs transformers' experts function of ``implementation`` on the module's own parameters
and activation (its ``_apply_gate`` when it has one). The new forward is kept only after it reproduced the module's
own forward on random tokens, ids (repeated ids, an expert no slot routes to) and weights in the module's dtype;
otherwise the module is left as it is and the reason logged (or raised with ``strict=True``). Parameters and state
dict are unchanged.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import types
from collections.abc import Callable

import torch
from torch import nn

from ep_fuse.surgery.moe_expert_storage import experts_function

log = logging.getLogger("ep_fuse")

CHECK_TOKENS = 24
"""Tokens of the random batch each conversion is checked on."""


@dataclasses.dataclass(frozen=True)
class HooklessConversion:
    """What :func:`convert_hookless_experts` did (or refused) for one module."""

    path: str
    module_class: str
    transposed: bool = False
    reason: str | None = None
    """Why it was refused (``None``: converted)."""

    @property
    def converted(self) -> bool:
        return self.reason is None


class _ExpertsView:
    """What transformers' experts functions read from ``self``: the module's parameters (read at each call, so
    ``.to()`` and ``load_state_dict`` keep working) and activation, in the layout the check chose."""

    has_post_expert_norm = False
    _is_expert_parallel = False

    def __init__(self, module: nn.Module, transposed: bool) -> None:
        self.module = module
        self.is_transposed = transposed
        self.has_gate = isinstance(getattr(module, "gate_up_proj", None), torch.Tensor)
        first = module.gate_up_proj if self.has_gate else module.up_proj
        self.num_experts = first.shape[0]
        self.gate_up_proj = first if self.has_gate else None
        self.up_proj = None if self.has_gate else first
        self.down_proj = module.down_proj
        self.act_fn = module.act_fn
        biases = {n: getattr(module, n, None) for n in ("gate_up_proj_bias", "up_proj_bias", "down_proj_bias")}
        self.has_bias = any(isinstance(b, torch.Tensor) for b in biases.values())
        for name, bias in biases.items():
            setattr(self, name, bias)

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        own = getattr(type(self.module), "_apply_gate", None)
        if own is not None:
            return own(self.module, gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up


def _forward(fn: Callable[..., torch.Tensor], transposed: bool) -> Callable[..., torch.Tensor]:
    def forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return fn(_ExpertsView(self, transposed), hidden_states, top_k_index, top_k_weights)

    forward.ep_fuse_hookless = True  # type: ignore[attr-defined]
    return forward


def has_experts_hook(module: nn.Module) -> bool:
    """The class forward is transformers' ``use_experts_implementation`` switch (or ``prepare`` already converted it)."""
    forward = getattr(type(module), "forward", None)
    hooked = getattr(forward, "__wrapped__", None) is not None and hasattr(module, "_is_expert_parallel")
    return hooked or getattr(getattr(module, "forward", None), "ep_fuse_hookless", False)


def is_candidate(module: nn.Module) -> bool:
    """3-D float ``gate_up_proj`` (or ``up_proj``) and ``down_proj``, an ``act_fn``, a three-argument forward
    (tokens, top-k ids, top-k weights) and no experts-implementation switch."""
    first = getattr(module, "gate_up_proj", None)
    if not isinstance(first, torch.Tensor):
        first = getattr(module, "up_proj", None)
    down = getattr(module, "down_proj", None)
    if not (isinstance(first, torch.Tensor) and isinstance(down, torch.Tensor) and first.dim() == down.dim() == 3):
        return False
    if not (first.dtype.is_floating_point and first.element_size() >= 2) or not callable(getattr(module, "act_fn", None)):
        return False  # (FP8 experts: ep_fuse.surgery.fp8_experts)
    if type(module).__module__.startswith("ep_fuse.") or has_experts_hook(module):
        return False
    try:
        params = [p for p in inspect.signature(module.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return False
    return len(params) == 3


def _layouts(module: nn.Module) -> list[tuple[bool, int]]:
    """``(transposed, hidden size)`` of each layout the weight shapes allow (both when they cannot tell)."""
    gated = isinstance(getattr(module, "gate_up_proj", None), torch.Tensor)
    first = module.gate_up_proj if gated else module.up_proj
    down = module.down_proj
    (e, a, b), (e2, c, d) = first.shape, down.shape
    if e != e2:
        return []
    width = 2 if gated else 1
    out = []
    if a == width * d and b == c:  # [E, 2I, H] / [E, H, I]
        out.append((False, b))
    if b == width * c and a == d:  # [E, H, 2I] / [E, I, H]
        out.append((True, a))
    return out


def _tolerance(dtype: torch.dtype) -> float:
    """Relative to the output's largest magnitude: the eager loop sums the top-k per expert in the module's dtype
    (``index_add_``), the experts functions in fp32 and round once: a few ulps in bf16/fp16."""
    return 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2


def _check_case(module: nn.Module, hidden: int, dtype: torch.dtype, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random tokens, top-2 ids drawn with repeats (the first token routes twice to one expert) from every expert
    but one (never hit), and fp32 weights."""
    g = torch.Generator().manual_seed(0)
    e = _ExpertsView(module, False).num_experts
    k = 2 if e > 1 else 1
    pool = torch.randperm(e, generator=g)[: max(e - 1, 1)]
    ids = pool[torch.randint(len(pool), (CHECK_TOKENS, k), generator=g)]
    ids[0, -1] = ids[0, 0]
    x = torch.randn(CHECK_TOKENS, hidden, generator=g).to(device=device, dtype=dtype)
    w = torch.rand(CHECK_TOKENS, k, generator=g).to(device)
    return x, ids.to(device), w


def _mismatch(module: nn.Module, new: Callable[..., torch.Tensor], hidden: int) -> str | None:
    """Why ``new`` does not reproduce the module's forward (``None``: it does)."""
    w = module.down_proj
    x, ids, weights = _check_case(module, hidden, w.dtype, w.device)
    with torch.no_grad():
        try:
            ref = module(x, ids, weights)
        except Exception as e:
            return f"its forward does not run on (tokens [T, {hidden}], ids [T, K], weights [T, K]) " \
                   f"({type(e).__name__}: {e})"
        try:
            got = new(module, x, ids, weights)
        except Exception as e:
            return f"the experts function fails on its weights ({type(e).__name__}: {e})"
    if not isinstance(ref, torch.Tensor) or ref.shape != got.shape or ref.dtype != got.dtype:
        what = f"{tuple(ref.shape)} {ref.dtype}" if isinstance(ref, torch.Tensor) else type(ref).__name__
        return f"its forward returns {what}, the experts function {tuple(got.shape)} {got.dtype}"
    scale = ref.float().abs().max().item() or 1.0
    diff = (got.float() - ref.float()).abs().max().item() / scale
    if not diff <= _tolerance(w.dtype):
        return f"the experts function differs from its forward by {diff:.2e} (relative to max |out|)"
    return None


def convert_module(module: nn.Module, implementation: str) -> tuple[bool, str | None]:
    """Give one candidate module (:func:`is_candidate`) the experts-function forward: ``(transposed, None)``, or
    ``(False, reason)`` when no layout reproduces its forward (the module is left as it was)."""
    try:
        fn = experts_function(implementation)
    except LookupError as e:
        return False, str(e)
    if module.down_proj.device.type == "meta":
        return False, "its weights are not materialized (meta device)"
    layouts = _layouts(module)
    if not layouts:
        return False, (f"weights {tuple(getattr(module, 'gate_up_proj', getattr(module, 'up_proj', None)).shape)} / "
                       f"{tuple(module.down_proj.shape)} are not [E, 2I, H] / [E, H, I] (or transposed)")
    reasons = []
    for transposed, hidden in layouts:
        forward = _forward(fn, transposed)
        reason = _mismatch(module, forward, hidden)
        if reason is None:
            module.forward = types.MethodType(forward, module)
            return transposed, None
        reasons.append(f"{'[E, in, out]' if transposed else '[E, out, in]'}: {reason}")
    return False, "; ".join(reasons)


def convert_hookless_experts(model: nn.Module, implementation: str = "grouped_mm",
                             strict: bool = False) -> list[HooklessConversion]:
    """Convert every hookless 3-D experts module of ``model`` in place (module docstring); logs each conversion at
    INFO and each refusal at WARNING (``strict=True``: raises ``ValueError``)."""
    from ep_fuse.surgery.expert_loops import UNFUSED_EXPERTS  # its reasons are logged by convert_expert_loops

    done: list[HooklessConversion] = []
    for path, module in model.named_modules():
        if type(module).__name__ in UNFUSED_EXPERTS or not is_candidate(module):
            continue
        label = path or type(model).__name__
        transposed, reason = convert_module(module, implementation)
        if reason is not None:
            msg = (f"ep_fuse.prepare: experts {label} ({type(module).__name__}) keep their per-expert loop, which "
                   f"breaks the graph and gets no MoE fusion: {reason}")
            if strict:
                raise ValueError(msg + " (strict=True; pass strict=False to keep the loop)")
            log.warning(msg)
            done.append(HooklessConversion(label, type(module).__name__, reason=reason))
            continue
        log.info("ep_fuse.prepare: experts %s (%s, no experts-implementation switch) run transformers' %s experts "
                 "function (checked against their own forward)", label, type(module).__name__, implementation)
        done.append(HooklessConversion(label, type(module).__name__, transposed))
    return done

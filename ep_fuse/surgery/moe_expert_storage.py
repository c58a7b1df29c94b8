"""Where a MoE block keeps its experts, and how they bind to the canonical stacked layout
(used by :mod:`ep_fuse.surgery.moe_semantics`).

Two storages are recognised, whatever their names:

* **a list**: an ``nn.ModuleList`` of E MLP modules with 2-3 linear children each (``nn.Linear`` or any module whose
  only parameter is a 2-D ``weight`` and whose output is ``F.linear(x, weight)``, e.g. a code base's own ``Linear``
  subclass for quantized checkpoints). The roles (gate / up / down, or fused gate|up) and the activation are found by
  running expert 0 on random rows; the list becomes :class:`~ep_fuse.surgery.expert_loops.StackedExperts` (per-expert
  state-dict keys kept).
* **stacked parameters**: 2 or 3 three-dimensional parameters with the same leading dim E (``w1/w2/w3``,
  ``gate_up``/``down``, in ``[E, out, in]`` or ``[E, in, out]`` layout). Their roles, layouts, the halves' order of a
  fused gate|up, and the activation cannot be read off one expert, so :func:`stacked_bindings` enumerates what the
  shapes allow and the caller proves one against the block's output. The parameters are replaced by one
  :class:`BoundExperts` holding the canonical ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``; the block's
  state dict keeps the original keys (:func:`keep_original_keys`).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ep_fuse.ops import moe as moe_ops

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}
"""Gated activations tried, by their ``moe_experts`` ``act`` name."""


def experts_function(implementation: str) -> Callable[..., torch.Tensor]:
    """transformers' ``grouped_mm`` / ``batched_mm`` experts function; raises ``LookupError`` saying what is missing."""
    try:
        from transformers.integrations import moe  # optional dependency
    except ImportError as e:  # pragma: no cover - transformers is installed with the tests
        raise LookupError(f"needs transformers >= 5 for its {implementation} experts function ({e})") from e
    fn = {"grouped_mm": getattr(moe, "grouped_mm_experts_forward", None),
          "batched_mm": getattr(moe, "batched_mm_experts_forward", None)}.get(implementation)
    if fn is None:
        raise LookupError(f"this transformers has no {implementation} experts function")
    return fn


def supported_activations() -> tuple[str, ...]:
    """The activations of :data:`ACTIVATIONS` that the ``moe_experts`` op takes in this version."""
    return tuple(a for a in ACTIVATIONS if a in moe_ops.ACTS)


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2


def _close(got: torch.Tensor, ref: torch.Tensor) -> bool:
    if not isinstance(ref, torch.Tensor) or got.shape != ref.shape:
        return False
    got, ref = got.detach().float(), ref.detach()
    scale = float(ref.float().abs().max()) or 1.0
    return float((got - ref.float()).abs().max()) <= _tolerance(ref.dtype) * scale


def linear_weight(module: nn.Module) -> torch.Tensor | None:
    """The 2-D weight of a bias-free linear map: an ``nn.Linear``, or a module whose only parameter is a 2-D
    ``weight`` and which computes ``F.linear(x, weight)`` on random rows. None otherwise."""
    if isinstance(module, nn.Linear):
        return module.weight if module.bias is None else None
    params = dict(module.named_parameters(recurse=True))
    weight = params.get("weight")
    if set(params) != {"weight"} or weight.dim() != 2 or not weight.is_floating_point() or \
            weight.device.type == "meta" or any(True for _ in module.buffers()):
        return None
    x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype).to(weight.device)
    try:
        with torch.no_grad():
            out = module(x)
    except Exception:  # noqa: BLE001 - a module that does not run on rows is no linear map
        return None
    return weight if isinstance(out, torch.Tensor) and _close(out, F.linear(x, weight)) else None


# --------------------------------------------------------------------------- lists of expert modules
@dataclass(frozen=True)
class ListLayout:
    """The roles of an expert module's linear children and its activation."""

    names: tuple[str, ...]  # (gate, up, down) or (gate|up fused, down)
    act: str


def _linear_children(expert: nn.Module) -> dict[str, torch.Tensor] | None:
    children = dict(expert.named_children())
    linears = {n: w for n, c in children.items() if (w := linear_weight(c)) is not None}
    others = [c for n, c in children.items() if n not in linears]
    if len(linears) not in (2, 3) or any(True for c in others for _ in c.parameters()) or \
            set(dict(expert.named_parameters()).keys()) != {f"{n}.weight" for n in linears}:
        return None
    return linears


def is_expert_list(module: nn.Module) -> bool:
    """An ``nn.ModuleList`` of at least two modules of one class and one parameter layout, the first an MLP of 2-3
    linear maps (the others are not run: their structure is compared)."""
    if not isinstance(module, nn.ModuleList) or len(module) < 2 or len({type(e) for e in module}) != 1:
        return False
    layouts = {tuple((n, p.shape, p.dtype) for n, p in e.named_parameters()) for e in module}
    return len(layouts) == 1 and _linear_children(module[0]) is not None


def list_layout(expert: nn.Module) -> tuple[ListLayout | None, str]:
    """The roles and activation under which ``down(act(gate(x)) * up(x))`` reproduces ``expert(x)``; (None, why)."""
    if next(expert.parameters()).dtype not in (torch.float32, torch.float64):
        # low precision cannot tell tanh-GELU from erf-GELU apart: find the roles on an fp32 copy of the expert
        expert = copy.deepcopy(expert).float()
    linears = _linear_children(expert)
    if linears is None:
        return None, f"{type(expert).__name__} is not an MLP of 2-3 bias-free linear maps"
    first = next(iter(linears.values()))
    tried = []
    for names in itertools.permutations(linears):
        ws = [linears[n] for n in names]
        hidden, inter = ws[-1].shape
        if any(w.shape != ((2 if len(ws) == 2 else 1) * inter, hidden) for w in ws[:-1]):
            continue
        xx = torch.randn(5, hidden, generator=torch.Generator().manual_seed(1)).to(first.dtype).to(first.device)
        with torch.no_grad():
            try:
                ref = expert(xx)
            except Exception as e:  # noqa: BLE001
                return None, f"{type(expert).__name__} does not run on rows [T, H] ({type(e).__name__}: {e})"
            gate, up = F.linear(xx, torch.cat(ws[:-1])).chunk(2, dim=-1)
            for act in supported_activations():
                tried.append(act)
                if _close(F.linear(ACTIVATIONS[act](gate) * up, ws[-1]), ref):
                    return ListLayout(names, act), ""
    return None, (f"{type(expert).__name__} does not compute down(act(gate(x)) * up(x)) for act in "
                  f"{', '.join(dict.fromkeys(tried)) or 'any'} with its linear maps {sorted(linears)}")


# --------------------------------------------------------------------------- stacked parameters
@dataclass(frozen=True)
class Role:
    """One canonical weight's source: parameter ``index`` of the storage, used transposed or not."""

    index: int
    transposed: bool  # stored [E, in, out] (used as ``x @ W[e]``) rather than [E, out, in]


@dataclass(frozen=True)
class StackedBinding:
    """How 2-3 stacked parameters make the canonical ``gate_up [E, 2I, H]`` and ``down [E, H, I]``."""

    gate: Role
    up: Role | None  # None: ``gate`` is a fused gate|up parameter
    down: Role
    order: str = "gate_first"  # a fused parameter's halves: "gate_first", "up_first" or "interleaved"
    act: str = "silu"

    def describe(self, names: tuple[str, ...]) -> str:
        def n(r: Role) -> str:
            return names[r.index] + (".T" if r.transposed else "")
        if self.up is None:
            return f"gate|up {n(self.gate)} ({self.order}), down {n(self.down)}, {self.act}"
        return f"gate {n(self.gate)}, up {n(self.up)}, down {n(self.down)}, {self.act}"

    def _linear(self, t: torch.Tensor, role: Role) -> torch.Tensor:
        return t.transpose(1, 2) if role.transposed else t

    def canonical(self, params: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gate_up [E, 2I, H], down [E, H, I])`` in torch Linear layout (views where possible)."""
        down = self._linear(params[self.down.index], self.down)
        if self.up is not None:
            gate_up = torch.cat([self._linear(params[self.gate.index], self.gate),
                                 self._linear(params[self.up.index], self.up)], dim=1)
        else:
            fused = self._linear(params[self.gate.index], self.gate)
            if self.order == "gate_first":
                gate_up = fused
            elif self.order == "up_first":
                half = fused.shape[1] // 2
                gate_up = torch.cat([fused[:, half:], fused[:, :half]], dim=1)
            else:
                gate_up = torch.cat([fused[:, 0::2], fused[:, 1::2]], dim=1)
        return gate_up, down

    def originals(self, gate_up: torch.Tensor, down: torch.Tensor, count: int) -> list[torch.Tensor]:
        """The inverse of :meth:`canonical`: the storage's parameters in their own layouts."""
        out: list[torch.Tensor | None] = [None] * count
        inter = down.shape[2]
        out[self.down.index] = self._linear(down, self.down)
        if self.up is not None:
            out[self.gate.index] = self._linear(gate_up[:, :inter], self.gate)
            out[self.up.index] = self._linear(gate_up[:, inter:], self.up)
        else:
            if self.order == "gate_first":
                fused = gate_up
            elif self.order == "up_first":
                fused = torch.cat([gate_up[:, inter:], gate_up[:, :inter]], dim=1)
            else:
                fused = torch.stack([gate_up[:, :inter], gate_up[:, inter:]], dim=2).flatten(1, 2)
            out[self.gate.index] = self._linear(fused, self.gate)
        return out  # type: ignore[return-value]


def _orientations(shape: torch.Size, rows: int, cols: int) -> list[bool]:
    """Whether a [E, a, b] parameter is [E, rows, cols] (False) or its transpose (True); both when square."""
    found = []
    if (shape[1], shape[2]) == (rows, cols):
        found.append(False)
    if (shape[2], shape[1]) == (rows, cols):
        found.append(True)
    return found


def stacked_bindings(shapes: list[torch.Size], hidden: int) -> Iterator[StackedBinding]:
    """Every binding of 2-3 stacked parameters of ``shapes`` to gate/up/down that the shapes allow (``hidden`` is
    the tokens' width), each with every supported activation."""
    acts = supported_activations()
    for d in range(len(shapes)):
        others = [i for i in range(len(shapes)) if i != d]
        dims = {s for s in (shapes[d][1], shapes[d][2])}
        if hidden not in dims:
            continue
        inter = shapes[d][2] if shapes[d][1] == hidden else shapes[d][1]
        for down_t in _orientations(shapes[d], hidden, inter):
            if len(others) == 2:
                for g, u in (others, others[::-1]):
                    for gt, ut in itertools.product(_orientations(shapes[g], inter, hidden),
                                                    _orientations(shapes[u], inter, hidden)):
                        for act in acts:
                            yield StackedBinding(Role(g, gt), Role(u, ut), Role(d, down_t), act=act)
            else:
                (f,) = others
                for ft in _orientations(shapes[f], 2 * inter, hidden):
                    for order, act in itertools.product(("gate_first", "up_first", "interleaved"), acts):
                        yield StackedBinding(Role(f, ft), None, Role(d, down_t), order, act)


class BoundExperts(nn.Module):
    """Routed experts in the canonical stacked layout, run by transformers' ``grouped_mm`` / ``batched_mm``
    experts function: ``forward(rows [T, H], ids [T, K], weights [T, K]) -> [T, H]`` computes
    ``sum_k w * down_e(act(gate_e(x)) * up_e(x))``. ``compute_dtype`` (e.g. bf16 in an fp32 model whose experts cast
    to bf16 for their GEMMs) runs the GEMMs in that dtype and returns the rows' dtype."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, act: str, experts_forward: Callable[..., Any],
                 compute_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.w13 = nn.Parameter(gate_up.detach().contiguous(), requires_grad=False)
        self.w2 = nn.Parameter(down.detach().contiguous(), requires_grad=False)
        self.act = act
        self.act_fn = ACTIVATIONS[act]
        self.compute_dtype = compute_dtype
        self._experts_forward = experts_forward
        self.num_experts = gate_up.shape[0]
        self.has_gate, self.has_bias, self.is_transposed = True, False, False
        self.has_post_expert_norm, self._is_expert_parallel = False, False

    @property
    def gate_up_proj(self) -> torch.Tensor:
        return self.w13 if self.compute_dtype is None else self.w13.to(self.compute_dtype)

    @property
    def down_proj(self) -> torch.Tensor:
        return self.w2 if self.compute_dtype is None else self.w2.to(self.compute_dtype)

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def forward(self, rows: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.compute_dtype is None or self.compute_dtype == rows.dtype:
            return self._experts_forward(self, rows, ids, weights)
        return self._experts_forward(self, rows.to(self.compute_dtype), ids, weights).to(rows.dtype)

    def extra_repr(self) -> str:
        e, rows, h = self.w13.shape
        return f"num_experts={e}, hidden={h}, intermediate={rows // 2}, act={self.act}, " \
               f"compute_dtype={self.compute_dtype}"


def keep_original_keys(block: nn.Module, experts_path: str, original: list[str], binding: StackedBinding) -> None:
    """Make ``block``'s state dict hold the stacked parameters under their original keys (``original``: paths from
    the block) instead of ``<experts_path>.w13`` / ``.w2``, and load them back from those keys."""
    keys = (f"{experts_path}.w13", f"{experts_path}.w2")

    def save(module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        if prefix + keys[0] not in state:
            return
        gate_up, down = state.pop(prefix + keys[0]), state.pop(prefix + keys[1])
        for path, tensor in zip(original, binding.originals(gate_up, down, len(original))):
            state[prefix + path] = tensor

    def load(module: nn.Module, state: dict[str, Any], prefix: str, *args: Any) -> None:
        if all(prefix + p in state for p in original) and prefix + keys[0] not in state:
            gate_up, down = binding.canonical([state.pop(prefix + p) for p in original])
            state[prefix + keys[0]], state[prefix + keys[1]] = gate_up.contiguous(), down.contiguous()

    block.register_state_dict_post_hook(save)
    block.register_load_state_dict_pre_hook(load)

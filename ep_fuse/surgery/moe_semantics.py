"""MoE blocks recognised by what they compute, whatever their spelling (used by :func:`ep_fuse.prepare`).

A MoE block is a **router** (token rows ``[T, H]`` -> scores over E experts -> top-k ids and weights), **routed
experts** (each (token, expert) pair runs an MLP of the token with that expert's weights), a **combine** (the
routing-weighted sum back per token) and optionally **shared experts** (MLPs on every token, added). Code bases spell
that in many ways -- per-token weight gathers and ``einsum``, loops over an ``nn.ModuleList`` with ``where`` /
``nonzero`` / ``bincount().tolist()``, ``argsort`` + ``gather`` + ``_grouped_mm`` + a custom scatter op, ``bmm`` over
every expert with the unselected scores at 0, 2-D or 3-D logits, packed ``[T, H]`` or batched ``[B, S, H]`` tokens.
This module does not read the spelling. For a candidate block it

1. **finds the parts by their tensors**: the experts' storage (:mod:`ep_fuse.surgery.moe_expert_storage`: a list of
   MLP modules, or 2-3 stacked 3-D parameters with a leading expert dim E), and a router weight (a 2-D parameter
   ``[E, H]`` or ``[H, E]`` outside it) -- the smallest module holding both is the candidate;
2. **runs it once on random tokens under a recorder** that follows which parameters each tensor derives from: the
   top-k over E whose input derives from the router weight gives K and the ids; the 1-D ``[E]`` tensors feeding it are
   selection biases; matrix products on expert weights give the dtype the experts compute in;
3. **binds** the router to the canonical ``moe_gating`` arguments (:mod:`ep_fuse.surgery.moe_routers`: score, bias,
   groups, renormalisation, scale, weights' dtype) that reproduce the recorded ids, and the experts to the canonical
   stacked layout and activation, and the shared experts to the remaining children, choosing the binding whose
   weighted combine reproduces the block's output;
4. **proves** the rebuilt block (the canonical router spelled as transformers' routers, transformers' grouped-GEMM
   experts on the stacked weights, the shared experts added) equal to the block on fresh random tokens (batched and
   single), with rows of zeros (every score tied), in the block's dtype and, for a small fp32 block, on a bf16 copy;
   only then is ``forward`` replaced. Anything that does not prove equal is restored and reported by the semantic
   part that failed (router / experts / combine) with the reason.

The rebuilt forward has no data-dependent Python control flow, so the loops, ``nonzero``, ``.tolist()`` and
``torch._dynamo.disable``'d helpers that broke the graph are gone, and the backend's ``moe_gating`` and
``moe_experts`` patterns match it.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ep_fuse.surgery.expert_loops import stack_experts
from ep_fuse.surgery.loop_dataflow import tensors_in
from ep_fuse.surgery.moe_expert_storage import (BoundExperts, StackedBinding, experts_function, is_expert_list,
                                               keep_original_keys, linear_weight, list_layout, stacked_bindings)
from ep_fuse.surgery.moe_routers import (RouterParts, RouterSpec, group_scores, logits_of, resolve, route,
                                        selection_hypotheses, selection_scores, weight_variants)

log = logging.getLogger("ep_fuse")

EXPERTS_ATTR = "ep_fuse_experts"
"""The attribute under which a block recognised here holds its :class:`BoundExperts` (stacked storages)."""

SMALL_BLOCK = 1 << 24
"""Blocks with at most this many parameters are also proven on a bf16 copy when they run in fp32."""

_MATMULS = frozenset({"mm", "bmm", "matmul", "__matmul__", "__rmatmul__", "einsum", "linear", "_grouped_mm",
                      "addmm", "baddbmm"})


class NotBound(Exception):
    """A candidate that is not (provably) a MoE block; ``part`` is ``"router"``, ``"experts"`` or ``"combine"``.
    ``routed=False``: the trace shows no top-k over the experts at all (3-D parameters that are no experts, e.g.
    convolutions): not a MoE block, so nothing to warn about."""

    def __init__(self, part: str, reason: str, routed: bool = True) -> None:
        super().__init__(f"{part}: {reason}")
        self.part = part
        self.routed = routed


@dataclass(frozen=True)
class Storage:
    """A block's expert storage: a list of expert modules at ``path``, or stacked parameters ``params`` (paths)."""

    kind: str  # "list" or "stacked"
    paths: tuple[str, ...]
    num_experts: int
    hiddens: tuple[int, ...]  # possible token widths


@dataclass(frozen=True)
class MoePlan:
    """How :func:`semantic_forward` rebuilds a block (every tensor by its path from the block)."""

    experts: str
    router: RouterSpec
    shared: tuple[str, ...] = ()
    shared_gate: str | None = None
    output: str = "input"  # "input": the input's shape; "rows": [T, H]
    returns_logits: bool = False  # the block returns ``(out, router_logits [T, E])``

    def describe(self, experts: str | None = None) -> str:
        shared = ", ".join(self.shared) or "none"
        gate = f" (gated by sigmoid({self.shared_gate}))" if self.shared_gate else ""
        return f"router: {self.router.describe()}; experts: {experts or self.experts}; shared experts: {shared}{gate}"


def semantic_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """The block rebuilt from its :class:`MoePlan`: canonical router, stacked experts, shared experts added."""
    plan: MoePlan = self._ep_fuse_moe_plan
    shape = hidden_states.shape
    rows = hidden_states.reshape(-1, shape[-1])
    logits = logits_of(self, plan.router, rows)
    weights, ids = route(self, plan.router, logits)
    out = resolve(self, plan.experts)(rows, ids, weights)
    if plan.shared:
        out = out + _shared_sum(self, plan, rows)
    out = out.reshape(shape) if plan.output == "input" else out
    return (out, logits) if plan.returns_logits else out


def _shared_sum(block: nn.Module, plan: MoePlan, rows: torch.Tensor) -> torch.Tensor:
    total = None
    for path in plan.shared:
        y = resolve(block, path)(rows)
        total = y if total is None else total + y
    if plan.shared_gate is not None:
        total = torch.sigmoid(resolve(block, plan.shared_gate)(rows)) * total
    return total


# --------------------------------------------------------------------------- the recorder
class _Recorder(TorchFunctionMode):
    """Follows which named tensors each tensor derives from; records top-k calls and matrix-product dtypes."""

    def __init__(self, named: dict[int, str]) -> None:
        super().__init__()
        self.tags: dict[int, frozenset[str]] = {k: frozenset({v}) for k, v in named.items()}
        self.alive: list[Any] = []
        self.topks: list[tuple[torch.Tensor, int, frozenset[str], torch.Tensor]] = []  # (input, dim, tags, ids)
        self.matmul_dtypes: dict[str, set[torch.dtype]] = {}

    def tag(self, value: Any) -> frozenset[str]:
        out: frozenset[str] = frozenset()
        for t in tensors_in(value):
            out |= self.tags.get(id(t), frozenset())
        return out

    def __torch_function__(self, func: Callable[..., Any], types_: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        tags = self.tag((args, kwargs))
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if tags:
            for t in tensors_in(out):
                self.alive.append(t)
                self.tags[id(t)] = self.tags.get(id(t), frozenset()) | tags
            if args and isinstance(args[0], torch.Tensor) and name.endswith("_") and not name.startswith("__"):
                self.tags[id(args[0])] = self.tags.get(id(args[0]), frozenset()) | tags
        if name == "topk" and isinstance(out, tuple) and len(out) == 2:
            src = args[0]
            dim = kwargs.get("dim", args[2] if len(args) > 2 else -1)
            self.alive.append(out)
            self.topks.append((src, dim % src.dim(), tags, out[1]))
        if name in _MATMULS:
            for t in tensors_in((args, kwargs)):
                if t.is_floating_point():
                    for source in self.tags.get(id(t), ()):
                        self.matmul_dtypes.setdefault(source, set()).add(t.dtype)
        return out


@dataclass
class _Probe:
    x: torch.Tensor
    output: torch.Tensor
    ids: torch.Tensor | None  # [T, K] top-k ids of the router, as recorded
    topk_tags: frozenset[str]
    matmul_dtypes: dict[str, set[torch.dtype]]
    extras: tuple[Any, ...] = ()  # what a tuple-returning block returns after its output
    group_topks: tuple[tuple[int, int], ...] = ()  # (size, k) of top-ks over fewer than E values (expert groups)


def _run(fn: Callable[[torch.Tensor], Any], x: torch.Tensor, named: dict[int, str], num_experts: int,
         router_weights: set[str]) -> _Probe:
    rec = _Recorder(named)
    with torch.no_grad(), rec:
        out = fn(x)
    extras: tuple[Any, ...] = ()
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        out, extras = out[0], out[1:]
    if not isinstance(out, torch.Tensor):
        raise NotBound("combine", f"the block returns {type(out).__name__}, not a tensor or a tuple starting with one")
    result = out
    ids, tags = None, frozenset()
    for src, dim, t, idx in rec.topks:  # the last top-k over the E experts that derives from a router weight
        if src.shape[dim] == num_experts and t & router_weights:
            ids = idx.movedim(dim, -1).reshape(-1, idx.shape[dim])
            tags = t
    groups = tuple({(src.shape[dim], idx.shape[dim]) for src, dim, t, idx in rec.topks
                    if 1 < src.shape[dim] < num_experts and idx.shape[dim] < src.shape[dim] and t & router_weights})
    return _Probe(x, result, ids, tags, rec.matmul_dtypes, extras, groups)


# --------------------------------------------------------------------------- finding candidates
def _storages(block: nn.Module) -> list[Storage]:
    found: list[Storage] = []
    in_lists: set[int] = set()
    for path, module in block.named_modules():
        if path and is_expert_list(module):
            first = module[0]
            widths = tuple(sorted({w.shape[1] for c in first.children() if (w := linear_weight(c)) is not None}))
            found.append(Storage("list", (path,), len(module), widths))
            in_lists |= {id(p) for p in module.parameters()}
    by_experts: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for path, p in block.named_parameters():
        if p.dim() == 3 and p.shape[0] >= 2 and id(p) not in in_lists and p.is_floating_point():
            by_experts.setdefault(p.shape[0], []).append((path, p))
    for e, params in by_experts.items():
        if len(params) in (2, 3):
            dims = [set(p.shape[1:]) for _, p in params]
            widths = tuple(sorted(set.intersection(*dims))) if len(params) == 3 else tuple(sorted(set.union(*dims)))
            found.append(Storage("stacked", tuple(n for n, _ in params), e, widths))
    return found


def _router_weights(block: nn.Module, storage: Storage, used: set[int]) -> list[tuple[str, bool, str | None, int]]:
    """(path, transposed, logit bias path, H) of the 2-D parameters ``[E, H]`` / ``[H, E]`` outside the storage."""
    e = storage.num_experts
    biases: dict[int, str] = {}
    for path, module in block.named_modules():
        if isinstance(module, nn.Linear) and module.bias is not None:
            biases[id(module.weight)] = f"{path}.bias" if path else "bias"
    found = []
    for path, p in block.named_parameters():
        if id(p) in used or p.dim() != 2:
            continue
        for h in storage.hiddens:
            if tuple(p.shape) == (e, h):
                found.append((path, False, biases.get(id(p)), h))
            elif tuple(p.shape) == (h, e):
                found.append((path, True, None, h))
    return found


def candidates(model: nn.Module, skip: set[int]) -> list[tuple[str, nn.Module, Storage]]:
    """The smallest modules (not in ``skip``, not inside one) holding an expert storage and a router weight."""
    found: dict[str, tuple[nn.Module, Storage]] = {}
    for path, module in model.named_modules():
        if id(module) in skip or type(module).__module__.startswith("transformers."):
            continue
        if type(module).forward is nn.Module.forward:  # a container (ModuleList / ModuleDict): nothing it runs
            continue
        for storage in _storages(module):
            used = _storage_param_ids(module, storage)
            if _router_weights(module, storage, used):
                found.setdefault(path, (module, storage))
                break
    minimal = [p for p in found if not any(q != p and q.startswith(f"{p}.") or (p == "" and q) for q in found)]
    out = []
    for path in minimal:
        if any(path.startswith(f"{s}.") for s in minimal if s != path):
            continue
        module, storage = found[path]
        out.append((path, module, storage))
    return out


def _storage_param_ids(block: nn.Module, storage: Storage) -> set[int]:
    if storage.kind == "list":
        return {id(p) for p in resolve(block, storage.paths[0]).parameters()}
    return {id(resolve(block, p)) for p in storage.paths}


# --------------------------------------------------------------------------- binding
def _experts_function(implementation: str) -> Callable[..., Any]:
    try:
        return experts_function(implementation)
    except LookupError as e:
        raise NotBound("experts", str(e)) from e


def _tolerance(dtypes: set[torch.dtype]) -> float:
    return 1e-4 if dtypes <= {torch.float32, torch.float64} else 3e-2


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    if got.shape != ref.shape:
        return float("inf")
    scale = float(ref.float().abs().max()) or 1.0
    diff = (got.float() - ref.float()).abs().max()
    return float(diff) / scale if bool(torch.isfinite(diff)) else float("inf")


def _probe_inputs(hidden: int, dtype: torch.dtype, device: torch.device, rows_only: bool,
                  seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(16, hidden), (1, hidden)] if rows_only else [(2, 8, hidden), (1, 1, hidden)]
    xs = [torch.randn(*s, generator=g).to(dtype=dtype, device=device) for s in shapes]
    xs[0].view(-1, hidden)[0].zero_()  # a row whose scores all tie
    return xs


def _parts(block: nn.Module, storage: Storage, probe: _Probe, weights: list[tuple[str, bool, str | None, int]],
           used: set[int], hidden: int) -> RouterParts:
    e = storage.num_experts
    names = dict(block.named_parameters()) | dict(block.named_buffers())
    sel = tuple(n for n in probe.topk_tags if n in names and names[n].dim() == 1 and names[n].shape[0] == e
                and id(names[n]) not in used and all(n != w[2] for w in weights))
    ints, floats = set(), set()
    for value in _settings(block):
        if isinstance(value, bool):
            continue
        if isinstance(value, int) and 1 < value < e:
            ints.add(value)
        elif isinstance(value, float) and value not in (0.0, 1.0) and value == value:
            floats.add(value)
    groups = {(n, k) for n in ints for k in ints if e % n == 0 and k < n}
    groups |= {g for g in probe.group_topks if e % g[0] == 0}  # a top-k over G < E groups in the router's dataflow
    groups = tuple(sorted(groups))
    ws = tuple(w[:3] for w in weights if w[0] in probe.topk_tags and w[3] == hidden)
    return RouterParts(ws, sel, groups, tuple(sorted(floats)))


TIE_RTOL = {torch.float32: 0.0, torch.float64: 0.0, torch.bfloat16: 2.0 ** -6, torch.float16: 2.0 ** -9}
"""Selection scores closer than this (relative) to the k-th one count as tied: a router computing in that dtype
rounds them apart in either order (fp32 and fp64 routers must choose exactly what the canonical one does)."""


def _near(values: torch.Tensor, kth: torch.Tensor, rtol: float) -> torch.Tensor:
    return (values - kth).abs() <= rtol * kth.abs().clamp(min=1e-3) + 1e-6


def _settings(block: nn.Module) -> Iterator[Any]:
    """Plain values a block's modules hold: their attributes and those of a config object (one level down)."""
    for module in block.modules():
        for value in vars(module).values():
            if isinstance(value, (bool, int, float)):
                yield value
            elif not isinstance(value, (torch.Tensor, nn.Module, dict, list, tuple)) and hasattr(value, "__dict__") \
                    and not callable(value):
                yield from (v for v in vars(value).values() if isinstance(v, (bool, int, float)))


def _differing_rows(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, block: nn.Module, spec: RouterSpec,
                    logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """Rows whose expert sets differ; None when one of them is not a tie. Rows of zeros tie everywhere; in low
    precision a row may also differ among experts whose selection scores (or, group-limited, whose groups' scores)
    are within :data:`TIE_RTOL` of the k-th."""
    if got.shape != want.shape:
        return None
    want = want.to(got.device, got.dtype)
    differ = (got.sort(dim=-1).values != want.sort(dim=-1).values).any(dim=-1)
    zero = x.reshape(-1, x.shape[-1]).abs().amax(dim=-1) == 0
    rtol = TIE_RTOL.get(dtype, 2.0 ** -6)
    tied = zero
    if rtol and bool(differ.any()):
        both = torch.cat([got, want], dim=1)
        other = torch.cat([want, got], dim=1)
        shared = (both.unsqueeze(-1) == other.unsqueeze(-2)).any(dim=-1)  # chosen by both: no tie needed
        sel = selection_scores(block, spec, logits, grouped=False)
        near = _near(sel.gather(1, both), sel.topk(got.shape[1], dim=-1).values[:, -1:], rtol)
        if spec.group_score != "none":
            gs = group_scores(spec, sel)
            size = sel.shape[1] // spec.n_group
            gnear = _near(gs.gather(1, both // size), gs.topk(spec.topk_group, dim=-1).values[:, -1:], rtol)
            masked = selection_scores(block, spec, logits)
            kept = _near(masked.gather(1, both), masked.topk(got.shape[1], dim=-1).values[:, -1:], rtol)
            near = near | gnear | kept
        tied = zero | (near | shared).all(dim=-1)
    return differ if bool((tied | ~differ).all()) else None


def _selection_differs(block: nn.Module, spec: RouterSpec, probe: _Probe, hidden: int,
                       dtype: torch.dtype) -> torch.Tensor | None:
    """The rows where ``spec`` selects other experts than the block did (all ties), or None (a real difference)."""
    logits = logits_of(block, spec, probe.x.reshape(-1, hidden))
    ids = route(block, spec, logits)[1]
    return _differing_rows(ids, probe.ids, probe.x, block, spec, logits, dtype)


def _shared_options(block: nn.Module, storage: Storage, router: RouterSpec,
                    x: torch.Tensor) -> list[tuple[tuple[str, ...], str | None]]:
    """(shared experts, gate) choices: every child with parameters outside the router and the experts must be one."""
    taken = {router.weight, router.logit_bias, router.sel_bias, *storage.paths}
    rows = x.reshape(-1, x.shape[-1])
    shared, gates = [], []
    for name, child in block.named_children():
        params = [f"{name}.{p}" for p, _ in child.named_parameters()]
        if not params or any(t and (p == t or p.startswith(f"{t}.")) for p in params for t in taken):
            continue
        try:
            with torch.no_grad():
                y = child(rows)
        except Exception as e:  # noqa: BLE001
            raise NotBound("combine", f"{name} ({type(child).__name__}) is neither router, experts nor a shared "
                                      f"expert on the tokens ({type(e).__name__}: {e})") from e
        if isinstance(y, torch.Tensor) and y.shape == rows.shape:
            shared.append(name)
        elif isinstance(y, torch.Tensor) and y.shape == (rows.shape[0], 1):
            gates.append(name)
        else:
            raise NotBound("combine", f"{name} ({type(child).__name__}) is neither router, experts nor a shared expert")
    options: list[tuple[tuple[str, ...], str | None]] = [(tuple(shared), None)]
    if len(gates) == 1 and shared:
        options.insert(0, (tuple(shared), gates[0]))
    elif gates:
        raise NotBound("combine", f"{', '.join(gates)}: gates of the shared experts that are not one sigmoid gate")
    return options


@dataclass
class _Bound:
    plan: MoePlan
    experts: nn.Module
    binding: StackedBinding | None
    error: float
    hidden: int = 0
    rows_only: bool = False
    label: str = ""
    tol: float = 1e-4


def _expert_choices(block: nn.Module, storage: Storage, implementation: str, hidden: int,
                    compute: torch.dtype | None) -> Iterator[tuple[nn.Module, StackedBinding | None, str]]:
    fn = _experts_function(implementation)
    if storage.kind == "list":
        experts = resolve(block, storage.paths[0])
        layout, why = list_layout(experts[0])
        if layout is None:
            raise NotBound("experts", why)
        stacked = stack_experts(experts, layout.names, implementation, act=layout.act)
        yield stacked, None, f"{storage.paths[0]} ({len(experts)} x {type(experts[0]).__name__}, " \
                             f"{'/'.join(layout.names)}, {layout.act})"
        return
    params = [resolve(block, p) for p in storage.paths]
    for binding in stacked_bindings([p.shape for p in params], hidden):
        gate_up, down = binding.canonical(params)
        yield BoundExperts(gate_up, down, binding.act, fn, compute), binding, binding.describe(storage.paths)


def _slot_outputs(experts: nn.Module, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[T, K, H]``: each slot's expert output (unweighted), one small GEMM per expert hit, in the experts'
    compute dtype (cheaper than the grouped-GEMM function on a few probe rows)."""
    gate_up = experts.gate_up_proj if isinstance(experts, BoundExperts) else experts.first
    down = experts.down_proj
    x = rows.to(gate_up.dtype)
    out = torch.zeros(*ids.shape, down.shape[1], dtype=rows.dtype, device=rows.device)
    for e in ids.unique().tolist():
        t, k = torch.where(ids == e)
        gate, up = torch.nn.functional.linear(x[t], gate_up[e]).chunk(2, dim=-1)
        out[t, k] = torch.nn.functional.linear(experts.act_fn(gate) * up, down[e]).to(rows.dtype)
    return out


def bind(block: nn.Module, storage: Storage, implementation: str) -> _Bound:
    """Find and prove the binding of ``block`` (see the module docstring); raises :class:`NotBound`."""
    others = [p for p in list(inspect.signature(block.forward).parameters.values())[1:]
              if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if others:
        raise NotBound("combine", f"its forward takes more than the tokens ({', '.join(p.name for p in others)})")
    used = _storage_param_ids(block, storage)
    weights = _router_weights(block, storage, used)
    named = {id(t): n for n, t in [*block.named_parameters(), *block.named_buffers()]}
    some = next(iter(block.parameters()))
    dtype, device = some.dtype, some.device
    router_names = {w[0] for w in weights}
    probes, hidden, errors, rows_only = None, None, [], False
    for h in sorted({w[3] for w in weights}):
        for rows_only in (False, True):
            try:
                probes = [_run(block, x, named, storage.num_experts, router_names)
                          for x in _probe_inputs(h, dtype, device, rows_only, seed=0)]
            except NotBound:
                raise
            except Exception as e:  # noqa: BLE001 - try the next token layout
                errors.append(f"[{'T' if rows_only else 'B, S'}, {h}]: {type(e).__name__}: {e}")
                continue
            hidden = h
            break
        if probes is not None:
            break
    if probes is None:
        raise NotBound("combine", "the block does not run on token rows: " + "; ".join(errors[:2]))
    if any(p.ids is None for p in probes):
        raise NotBound("router", f"no top-k over its {storage.num_experts} experts derives from a router weight "
                                 f"({', '.join(sorted(router_names))})", routed=False)
    top_k = probes[0].ids.shape[1]
    parts = _parts(block, storage, probes[0], weights, used, hidden)
    if not parts.weights:
        raise NotBound("router", "the top-k does not derive from any [E, H] weight")
    selections = []
    for spec in selection_hypotheses(parts, top_k, storage.num_experts):
        if parts.sel_biases and spec.sel_bias is None:
            continue  # a bias feeds the top-k: it must be in the selection
        try:
            with torch.no_grad():
                masks = [_selection_differs(block, spec, p, hidden, dtype) for p in probes]
        except ValueError:  # arguments outside the op's contract (e.g. a bias with group_score="max")
            continue
        if all(m is not None for m in masks):
            selections.append((sum(int(m.sum()) for m in masks), spec))
    rows = sum(p.ids.shape[0] for p in probes)
    fewest = min((n for n, _ in selections), default=rows)
    # low-precision routers may round a near tie either way; the true selection differs on the fewest rows
    selections = [spec for n, spec in selections if n == fewest and n <= rows // 4]
    if len({(sp.score, sp.sel_bias, sp.group_score, sp.n_group, sp.topk_group) for sp in selections}) > 1:
        # several selections agree on the probes (few rows, top-1): more tokens tell them apart
        g = torch.Generator().manual_seed(11)
        shape = (128, hidden) if rows_only else (8, 16, hidden)
        extra = _run(block, torch.randn(*shape, generator=g).to(dtype=dtype, device=device), named,
                     storage.num_experts, router_names)
        counted = [(int(m.sum()), sp) for sp in selections
                   if (m := _selection_differs(block, sp, extra, hidden, dtype)) is not None]
        least = min((n for n, _ in counted), default=0)
        selections = [sp for n, sp in counted if n == least] or selections
    if not selections:
        raise NotBound("router", f"no softmax/sigmoid top-{top_k} (bias {', '.join(parts.sel_biases) or 'none'}, "
                                 f"groups {list(parts.groups) or 'none'}) of the logits reproduces its expert choices")
    low = {dt for dts in probes[0].matmul_dtypes.values() for dt in dts}
    expert_dtypes = {dt for p in storage.paths for n, dts in probes[0].matmul_dtypes.items()
                     if n == p or n.startswith(f"{p}.") for dt in dts}
    compute = next(iter(expert_dtypes)) if len(expert_dtypes) == 1 and expert_dtypes != {dtype} else None
    tol = _tolerance({dtype} | low)
    output = "input" if probes[0].output.shape == probes[0].x.shape else "rows"
    returns_logits = _returns_logits(block, selections[0], probes, hidden)
    best: _Bound | None = None
    tried = []
    for experts, binding, label in _expert_choices(block, storage, implementation, hidden, compute):
        with torch.no_grad():
            slots = [_slot_outputs(experts, p.x.reshape(-1, hidden), p.ids) for p in probes]
        for sel in selections:
            shared_options = _shared_options(block, storage, sel, probes[0].x)
            for spec in weight_variants(sel, parts.scales):
                for shared, gate in shared_options:
                    plan = MoePlan(EXPERTS_ATTR, spec, shared, gate, output, returns_logits)
                    err = max(_combine_error(block, plan, p, s) for p, s in zip(probes, slots))
                    tried.append((err, label))
                    if best is None or err < best.error:
                        best = _Bound(plan, experts, binding, err, hidden, rows_only, label, tol)
        if best is not None and best.error <= tol / 10 and tol <= 1e-4:
            break  # (in low precision every choice is tried: rounding hides e.g. tanh- vs erf-GELU)
    if best is None or not best.error <= tol:
        closest = min(tried)[1] if tried else "none"
        raise NotBound("combine", f"no binding reproduces the block's output as the routing-weighted sum of its "
                                  f"experts (closest: {closest}, relative error "
                                  f"{best.error if best else float('inf'):.2e} > {tol:.0e})")
    return best


def _returns_logits(block: nn.Module, spec: RouterSpec, probes: list[_Probe], hidden: int) -> bool:
    """Whether the block returns ``(out, router_logits)``; raises :class:`NotBound` for other extra outputs."""
    if not probes[0].extras:
        return False
    for p in probes:
        with torch.no_grad():
            logits = logits_of(block, spec, p.x.reshape(-1, hidden))
        if len(p.extras) != 1 or not isinstance(p.extras[0], torch.Tensor) or \
                p.extras[0].shape != logits.shape or _rel(logits, p.extras[0]) > 1e-3:
            raise NotBound("combine", "the block returns more than its output and the router logits "
                                      f"({len(p.extras)} extra value(s)), which a rebuilt block cannot reproduce")
    return True


def _combine_error(block: nn.Module, plan: MoePlan, probe: _Probe, slots: torch.Tensor) -> float:
    rows = probe.x.reshape(-1, probe.x.shape[-1])
    with torch.no_grad():
        logits = logits_of(block, plan.router, rows)
        weights, ids = route(block, plan.router, logits)
        # the slots follow the recorded ids' order; the hypothesis may order a row's experts differently
        width = int(max(int(ids.max()), int(probe.ids.max()))) + 1
        dense = torch.zeros(ids.shape[0], width, dtype=weights.dtype, device=weights.device).scatter(1, ids, weights)
        aligned = dense.gather(1, probe.ids.to(ids.device))
        out = (slots * aligned.unsqueeze(-1)).sum(1).to(rows.dtype)
        if plan.shared:
            out = out + _shared_sum(block, plan, rows)
        differ = _differing_rows(ids, probe.ids, probe.x, block, plan.router, logits, rows.dtype)
    if differ is None:
        return float("inf")
    ref = probe.output.reshape(out.shape)
    return _rel(out[~differ], ref[~differ]) if bool((~differ).any()) else 0.0


# --------------------------------------------------------------------------- conversion
@dataclass(frozen=True)
class SemanticConversion:
    """What :func:`convert_semantic_blocks` did (or declined) for one block."""

    path: str
    block_class: str
    description: str | None = None
    part: str | None = None
    reason: str | None = None
    block_id: int = 0

    @property
    def converted(self) -> bool:
        return self.reason is None


def _install(block: nn.Module, storage: Storage, bound: _Bound) -> Callable[[], None]:
    """Swap the block's forward (and storage) for the plan's; returns the undo."""
    saved_forward = block.__dict__.get("forward")
    undo: list[Callable[[], None]] = []
    if storage.kind == "list":
        parent_path, _, name = storage.paths[0].rpartition(".")
        parent = resolve(block, parent_path) if parent_path else block
        old = getattr(parent, name)
        setattr(parent, name, bound.experts)
        undo.append(lambda: setattr(parent, name, old))
        plan = dataclasses.replace(bound.plan, experts=storage.paths[0])
    else:
        setattr(block, EXPERTS_ATTR, bound.experts)
        undo.append(lambda: delattr(block, EXPERTS_ATTR))
        plan = bound.plan
    block._ep_fuse_moe_plan = plan
    block.forward = types.MethodType(semantic_forward, block)

    def restore() -> None:
        for fn in reversed(undo):
            fn()
        block.__dict__.pop("_ep_fuse_moe_plan", None)
        block.__dict__.pop("forward", None)
        if saved_forward is not None:
            block.forward = saved_forward
    return restore


@dataclass(frozen=True)
class _Oracle:
    """What proving needs to run the original block under the recorder."""

    original: Callable[..., Any]
    named: dict[int, str]
    num_experts: int
    router_names: frozenset[str]


def _prove(block: nn.Module, oracle: _Oracle, hidden: int, rows_only: bool, seed: int) -> float:
    """The largest relative difference between the rebuilt block and the original on fresh tokens, over the rows
    both route alike (rows that differ must be ties, else inf)."""
    some = next(iter(block.parameters()))
    plan: MoePlan = block._ep_fuse_moe_plan
    worst = 0.0
    for x in _probe_inputs(hidden, some.dtype, some.device, rows_only, seed):
        probe = _run(oracle.original, x.clone(), oracle.named, oracle.num_experts, set(oracle.router_names))
        if probe.ids is None:
            return float("inf")
        with torch.no_grad():
            got = block(x.clone())
            if isinstance(got, tuple):
                if len(probe.extras) != len(got) - 1 or _rel(got[1], probe.extras[0]) > 1e-3:
                    return float("inf")
                got = got[0]
            rows = x.reshape(-1, hidden)
            logits = logits_of(block, plan.router, rows)
            ids = route(block, plan.router, logits)[1]
        differ = _differing_rows(ids, probe.ids, x, block, plan.router, logits, some.dtype)
        if differ is None:
            return float("inf")
        got, ref = got.reshape(rows.shape[0], -1), probe.output.reshape(rows.shape[0], -1)
        if bool((~differ).any()):
            worst = max(worst, _rel(got[~differ], ref[~differ]))
    return worst


def _drop_stacked_originals(block: nn.Module, storage: Storage, binding: StackedBinding) -> None:
    """Delete the stacked parameters the bound experts replace; the state dict keeps their keys."""
    for path in storage.paths:
        parent_path, _, name = path.rpartition(".")
        parent = resolve(block, parent_path) if parent_path else block
        delattr(parent, name)
    keep_original_keys(block, EXPERTS_ATTR, list(storage.paths), binding)


def _oracle(block: nn.Module, storage: Storage) -> _Oracle:
    used = _storage_param_ids(block, storage)
    named = {id(t): n for n, t in [*block.named_parameters(), *block.named_buffers()]}
    names = frozenset(w[0] for w in _router_weights(block, storage, used))
    return _Oracle(block.forward, named, storage.num_experts, names)


def convert_block(block: nn.Module, storage: Storage, implementation: str) -> str:
    """Bind, install and prove one block in place; returns the plan's description. Raises :class:`NotBound` (the
    block restored) when no binding proves equal."""
    flags = [(m, m.training) for m in block.modules()]
    block.eval()
    restore = None
    try:
        bound = bind(block, storage, implementation)
        hidden, rows_only = bound.hidden, bound.rows_only
        dtype = next(iter(block.parameters())).dtype
        small = sum(p.numel() for p in block.parameters()) <= SMALL_BLOCK
        copy_for_bf16 = copy.deepcopy(block) if small and dtype == torch.float32 else None
        oracle = _oracle(block, storage)
        restore = _install(block, storage, bound)
        tol = bound.tol  # the block's dtype, or the lower precision its experts compute in
        err = max(_prove(block, oracle, hidden, rows_only, seed) for seed in (1, 2))
        if not err <= max(tol, 3 * bound.error):
            raise NotBound("combine", f"the rebuilt block differs from the block on fresh tokens (relative error "
                                      f"{err:.2e}): {bound.plan.describe(bound.label)}")
        if copy_for_bf16 is not None:
            _prove_bf16(copy_for_bf16, storage, bound, implementation, hidden, rows_only)
    except BaseException:
        if restore is not None:
            restore()
        raise
    finally:
        for m, training in flags:
            m.training = training
    if storage.kind == "stacked":
        _drop_stacked_originals(block, storage, bound.binding)
    return bound.plan.describe(bound.label)


def _prove_bf16(block: nn.Module, storage: Storage, bound: _Bound, implementation: str, hidden: int,
                rows_only: bool) -> None:
    """The same binding on a bf16 copy of the block (the dtype models are served in)."""
    block.to(torch.bfloat16)
    oracle = _oracle(block, storage)
    experts = next(e for e, b, _ in _expert_choices(block, storage, implementation, hidden,
                                                     bound.experts.compute_dtype if storage.kind == "stacked"
                                                     else None)
                   if storage.kind == "list" or b == bound.binding)
    _install(block, storage, _Bound(bound.plan, experts, bound.binding, bound.error))
    err = max(_prove(block, oracle, hidden, rows_only, seed) for seed in (1, 2))
    if not err <= 3e-2:
        raise NotBound("combine", f"in bf16 the rebuilt block differs from the block (relative error {err:.2e}): "
                                  f"{bound.plan.describe(bound.label)}")


def convert_semantic_blocks(model: nn.Module, implementation: str = "grouped_mm", skip: set[int] | None = None,
                            strict: bool = False, quiet: set[int] | None = None) -> list[SemanticConversion]:
    """Recognise, prove and rebuild every MoE block of ``model`` outside ``skip`` (module ids) and transformers'
    own classes (module docstring). Logs each at INFO, each declined candidate at WARNING with the semantic part
    and the reason (``strict=True``: raises ``ValueError``); blocks in ``quiet`` (ids) are only returned when
    declined (the caller reports them)."""
    results = []
    for path, block, storage in candidates(model, skip or set()):
        label = path or type(model).__name__
        try:
            description = convert_block(block, storage, implementation)
        except NotBound as e:
            results.append(SemanticConversion(label, type(block).__name__, part=e.part, reason=str(e),
                                              block_id=id(block)))
            if quiet and id(block) in quiet:
                continue
            if not e.routed:
                log.debug("ep_fuse.prepare: %s (%s) is not a routed MoE block: %s", label, type(block).__name__, e)
                continue
            msg = (f"ep_fuse.prepare: {label} ({type(block).__name__}) holds {storage.num_experts} experts but is not "
                   f"rebuilt as a MoE block: {e}")
            if strict:
                raise ValueError(msg + " (strict=True)") from e
            log.warning(msg)
            continue
        results.append(SemanticConversion(label, type(block).__name__, description, block_id=id(block)))
        log.info("ep_fuse.prepare: %s (%s) recognised by what it computes and rebuilt: %s", label,
                 type(block).__name__, description)
    return results

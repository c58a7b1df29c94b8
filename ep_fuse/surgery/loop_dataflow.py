"""Per-expert loop blocks recognised by what they compute (used by :mod:`ep_fuse.surgery.expert_loops`).

A block whose layout :mod:`ep_fuse.surgery.expert_loops` does not know (routing in a method of its own, a
raw ``weight`` parameter instead of an ``nn.Linear`` gate, an inline loop in ``forward``) is run once on a
few random tokens under a recorder: a ``TorchFunctionMode`` that tags every tensor with the sources it
derives from (the block input, the output of each call of a submodule or method of the block, the outputs
of the routed experts), plus hooks on the children and wrappers on the block's methods. From that record:

* **routed experts**: each element of the expert list must run on a subset of the block's token rows, and
  the subsets must be exactly those the top-k ids send it (checked again on single tokens, so a loop that
  skips experts depending on the data is refused);
* **router**: the outermost call of a submodule or method, on the tokens alone, that returns those ids and
  a floating ``[T, K]`` tensor; its code is kept and called as is (so ``moe_gating`` can match it);
* **combine**: an expert output must be multiplied by that floating tensor (the routing weights);
* **shared experts**: the other submodules run on all tokens whose output reaches the block output.

Also here: :func:`routed_expert_lists` (lists of MLPs under names other than ``experts``, kept when a trace
runs them on routed subsets of tokens) and :func:`infer_layout` (an expert's gate/up/down Linears by what
the expert computes, when they have other names).

:func:`recognise_loop` returns a :class:`LoopPlan`; :func:`dataflow_forward` is the replacement ``forward``
(router, stacked experts, shared experts added). What the record cannot place raises
:class:`LoopNotRecognised` with the reason; the caller checks the converted block against the loop.
"""

from __future__ import annotations

import inspect
import itertools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

log = logging.getLogger("ep_fuse")

PROBE_TOKENS = ((1, 1, 1), (1, 1, 2), (1, 1, 3))
"""``(batch, seq, seed)`` of the single-token probes on which each expert's token set is checked again."""

INPUT, EXPERT = 1, 2
"""Tag bits of the block input and of the routed experts' outputs (call outputs get the next bits)."""

_MULTIPLY = frozenset({"mul", "mul_", "__mul__", "__rmul__", "__imul__", "einsum", "bmm", "matmul", "__matmul__",
                       "__rmatmul__", "addcmul", "addcmul_", "baddbmm"})
_IN_PLACE = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "index_put_"})


class LoopNotRecognised(Exception):
    """The record of a block does not show a routed per-expert loop that can be converted; ``str()`` says why."""


@dataclass(frozen=True)
class LoopPlan:
    """How :func:`dataflow_forward` rebuilds a block: which of its attributes route, run and share.

    ``router`` is a method (``router_is_method``) or child module called on the block input
    (``router_arg="input"``) or on its rows ``[T, H]`` (``"rows"``); ``ids_at``/``weights_at`` index its
    outputs; ``shared`` lists (child, argument) pairs added to the routed output; ``output`` is the shape
    returned, the input's (``"input"``) or rows (``"rows"``); ``extra`` the router outputs returned after it
    (a tuple ``(out, *extra)``, e.g. the router logits), None for a plain tensor."""

    experts: str
    router: str
    router_is_method: bool
    router_arg: str
    ids_at: int
    weights_at: int
    shared: tuple[tuple[str, str], ...] = ()
    output: str = "input"
    extra: tuple[int, ...] | None = None

    def describe(self) -> str:
        router = f"self.{self.router}{'()' if self.router_is_method else ''}"
        shared = ", ".join(name for name, _ in self.shared) or "none"
        return f"experts self.{self.experts}, router {router}, shared experts {shared}"


def dataflow_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """The block's own router, the stacked experts on its top-k, the shared experts added (``LoopPlan``)."""
    plan: LoopPlan = self._ep_fuse_loop_plan
    shape = hidden_states.shape
    rows = hidden_states.reshape(-1, shape[-1])
    routed = getattr(self, plan.router)(hidden_states if plan.router_arg == "input" else rows)
    out = getattr(self, plan.experts)(rows, routed[plan.ids_at], routed[plan.weights_at])
    for name, arg in plan.shared:
        out = out + getattr(self, name)(hidden_states if arg == "input" else rows).reshape(out.shape)
    out = out.reshape(shape) if plan.output == "input" else out
    return out if plan.extra is None else (out, *(routed[i] for i in plan.extra))


# --------------------------------------------------------------------------- the recorder
def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``value`` (nested tuples, lists and dict values), in order."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from tensors_in(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors_in(v)


@dataclass(eq=False)
class _Call:
    """One call of a child module, a block method or a routed expert, with its span in the record."""

    name: str
    kind: str  # "module", "method" or "expert"
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    start: int
    end: int = -1
    output: Any = None
    bit: int = 0  # the tag bits of its outputs, together
    bits: tuple[int, ...] = ()  # the tag bit of each output (EXPERT for the routed experts)
    expert: int = -1

    def outputs(self) -> list[Any]:
        return list(self.output) if isinstance(self.output, (tuple, list)) else [self.output]


class _Recorder(TorchFunctionMode):
    """Tags tensors by the sources they derive from; records multiplications and the calls."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: dict[int, int] = {}
        self.storage_tags: dict[int, int] = {}
        self.alive: list[torch.Tensor] = []  # keeps ids unique while the record lives
        self.products: list[list[int]] = []  # the tags of the tensor arguments of each multiplication
        self.calls: list[_Call] = []
        self.clock = 0
        self.next_bit = EXPERT << 1

    def tag(self, t: torch.Tensor) -> int:
        return self.tags.get(id(t), 0) | self.storage_tags.get(_storage(t), 0)

    def add(self, value: Any, bits: int) -> None:
        for t in tensors_in(value):
            self.alive.append(t)
            self.tags[id(t)] = self.tags.get(id(t), 0) | bits

    def new_bit(self) -> int:
        bit, self.next_bit = self.next_bit, self.next_bit << 1
        return bit

    def finish(self, call: _Call, output: Any) -> None:
        """Close ``call``: its span, its output, a new tag bit per output (EXPERT for a routed expert)."""
        self.clock += 1
        call.end, call.output = self.clock, output
        outs = call.outputs()
        call.bits = tuple(EXPERT if call.kind == "expert" else self.new_bit() for _ in outs)
        for out, bit in zip(outs, call.bits):
            self.add(out, bit)
            call.bit |= bit
        self.calls.append(call)

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        self.clock += 1
        arg_tags = [self.tag(t) for t in tensors_in((args, kwargs))]
        out = func(*args, **kwargs)
        union = 0
        for bits in arg_tags:
            union |= bits
        if not union:
            return out
        name = getattr(func, "__name__", "")
        if name in _MULTIPLY:
            self.products.append(arg_tags)
        self.add(out, union)
        mutated = [kwargs["out"]] if "out" in kwargs else []
        if args and isinstance(args[0], torch.Tensor) and (name in _IN_PLACE or (name.endswith("_") and
                                                                                  not name.startswith("__"))):
            mutated.append(args[0])
        for t in tensors_in(mutated):
            self.add(t, union)
            key = _storage(t)
            if key:
                self.storage_tags[key] = self.storage_tags.get(key, 0) | union
        return out


def _storage(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


def _own_methods(block: nn.Module) -> list[str]:
    """Names of the plain methods the block's classes define (not ``nn.Module``'s, not ``forward``)."""
    names = []
    for cls in type(block).__mro__:
        if cls in (nn.Module, object):
            break
        for name, value in vars(cls).items():
            if inspect.isfunction(value) and not name.startswith("__") and name != "forward" and name not in names \
                    and name not in vars(block):
                names.append(name)
    return names


@dataclass
class _Record:
    x: torch.Tensor
    output: Any
    calls: list[_Call]
    tags: Callable[[torch.Tensor], int]
    products: list[list[int]]


def _trace(block: nn.Module, list_name: str, x: torch.Tensor) -> _Record:
    """Run ``block(x)`` once under the recorder (no grad); hooks and wrappers are removed afterwards."""
    rec = _Recorder()
    experts = getattr(block, list_name)
    handles, stack = [], []

    def pre(name: str, kind: str, index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            rec.clock += 1
            stack.append(_Call(name, kind, args, kwargs, rec.clock, expert=index))
        return hook

    def post(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        rec.finish(stack.pop(), output)

    def wrap(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            rec.clock += 1
            call = _Call(name, "method", args, kwargs, rec.clock)
            output = method(*args, **kwargs)
            rec.finish(call, output)
            return output
        return wrapper

    for name, child in block.named_children():
        if child is not experts:
            handles.append(child.register_forward_pre_hook(pre(name, "module", -1), with_kwargs=True))
            handles.append(child.register_forward_hook(post, with_kwargs=True))
    for i, expert in enumerate(experts):
        handles.append(expert.register_forward_pre_hook(pre(f"{list_name}[{i}]", "expert", i), with_kwargs=True))
        handles.append(expert.register_forward_hook(post, with_kwargs=True))
    methods = _own_methods(block)
    for name in methods:
        setattr(block, name, wrap(name, getattr(block, name)))
    try:
        with torch.no_grad(), rec:
            rec.add(x, INPUT)
            output = block(x)
    except Exception as e:
        raise LoopNotRecognised(f"the block does not run on tokens [B, S, H] ({type(e).__name__}: {e})") from e
    finally:
        for h in handles:
            h.remove()
        for name in methods:
            block.__dict__.pop(name, None)
    return _Record(x, output, rec.calls, rec.tag, rec.products)


# --------------------------------------------------------------------------- analysis
def _as_tokens(t: Any, x: torch.Tensor) -> str | None:
    """``"input"`` when ``t`` is the block input, ``"rows"`` when it holds the same rows ``[T, H]``."""
    if t is x:
        return "input"
    rows = x.reshape(-1, x.shape[-1])
    if isinstance(t, torch.Tensor) and t.shape == rows.shape and t.dtype == x.dtype and torch.equal(t, rows):
        return "rows"
    return None


def _token_rows(inp: torch.Tensor, rows: torch.Tensor) -> list[int] | None:
    """The rows of ``rows`` that the expert input ``inp`` holds (in order); None if some row is not one."""
    if inp.numel() == 0:
        return []
    if inp.dim() != 2 or inp.shape[1] != rows.shape[1]:
        return None
    dist = torch.cdist(inp.detach().double(), rows.detach().double())
    best, index = dist.min(dim=1)
    if not bool((best <= 1e-6 * rows.double().norm(dim=1).max().clamp(min=1.0)).all()):
        return None
    return index.tolist()


def _routed_tokens(record: _Record, num_experts: int) -> dict[int, list[int]]:
    rows = record.x.reshape(-1, record.x.shape[-1])
    seen: dict[int, list[int]] = {e: [] for e in range(num_experts)}
    for call in record.calls:
        if call.kind != "expert":
            continue
        if len(call.args) != 1 or call.kwargs or not isinstance(call.args[0], torch.Tensor):
            raise LoopNotRecognised(f"{call.name} is called with more than one tensor of token rows")
        got = _token_rows(call.args[0], rows)
        if got is None:
            raise LoopNotRecognised(f"{call.name} runs on rows that are not the block's tokens (its input is "
                                    f"{list(call.args[0].shape)}, transformed before the expert)")
        seen[call.expert] += got
    return seen


def _mismatch(ids: torch.Tensor, seen: dict[int, list[int]]) -> str | None:
    """Why the experts' token sets are not those ``ids`` route; None if they are."""
    for e, got in seen.items():
        want = sorted((ids == e).any(dim=-1).nonzero().flatten().tolist())
        if sorted(got) != want:
            return (f"expert {e} ran on {len(got)} token(s), not the {len(want)} the top-k ids send it (a loop "
                    "that skips or repeats experts depending on the data, e.g. an early exit)")
    return None


def _calls_within(outer: _Call, calls: list[_Call]) -> list[_Call]:
    return [c for c in calls if c is not outer and outer.start <= c.start and c.end <= outer.end]


def _find_router(record: _Record, seen: dict[int, list[int]]) -> tuple[_Call, int]:
    """The outermost call returning the ``[T, K]`` ids the experts' token sets follow, and their index."""
    tokens = record.x.numel() // record.x.shape[-1]
    found, reasons = [], []
    for call in record.calls:
        if call.kind == "expert":
            continue
        for i, out in enumerate(call.outputs()):
            if isinstance(out, torch.Tensor) and not out.is_floating_point() and out.dim() == 2 \
                    and out.shape[0] == tokens and out.dtype != torch.bool:
                why = _mismatch(out, seen)
                if why is None:
                    found.append((call, i))
                else:
                    reasons.append(why)
    if not found:
        if reasons:
            raise LoopNotRecognised(reasons[0])
        raise LoopNotRecognised("no submodule or method of the block returns the top-k expert ids [T, K] the "
                                "experts' token sets follow (routing computed inline in forward is not reused)")
    # outermost: not inside another candidate's span
    outer = [(c, i) for c, i in found if not any(o is not c and c in _calls_within(o, record.calls) for o, _ in found)]
    return outer[0]


def _weights_index(record: _Record, router: _Call, ids_at: int) -> int:
    outs = router.outputs()
    ids = outs[ids_at]
    for i, out in enumerate(outs):
        if i == ids_at or not isinstance(out, torch.Tensor) or not out.is_floating_point() or out.shape != ids.shape:
            continue
        bit = router.bits[i]
        # the experts' outputs multiplied by a tensor derived from these weights (not from the experts)
        for tags in record.products:
            if any(t & EXPERT for t in tags) and any(t & bit and not t & EXPERT for t in tags):
                return i
    raise LoopNotRecognised(f"the routed experts' outputs are not multiplied by the top-k weights of "
                            f"{router.name} (not a routing-weighted combine)")


def _analyse(block: nn.Module, list_name: str, record: _Record) -> LoopPlan:
    num_experts = len(getattr(block, list_name))
    if not any(c.kind == "expert" for c in record.calls):
        raise LoopNotRecognised(f"no element of {list_name} ran on the sample tokens")
    result = record.output[0] if isinstance(record.output, tuple) and record.output else record.output
    if not isinstance(result, torch.Tensor):
        raise LoopNotRecognised(f"the block returns {type(record.output).__name__}, not a tensor or a tuple of them")
    rows_shape = (record.x.numel() // record.x.shape[-1], record.x.shape[-1])
    if result.shape == record.x.shape:
        output = "input"
    elif tuple(result.shape) == rows_shape:
        output = "rows"
    else:
        raise LoopNotRecognised(f"the block output {list(result.shape)} is neither its input's shape nor rows")
    out_tags = record.tags(result)
    if not out_tags & EXPERT:
        raise LoopNotRecognised("the routed experts' outputs do not reach the block output")
    seen = _routed_tokens(record, num_experts)
    router, ids_at = _find_router(record, seen)
    tensors = list(tensors_in((router.args, router.kwargs)))
    arg = _as_tokens(router.args[0], record.x) if len(router.args) == 1 and not router.kwargs else None
    if arg is None or len(tensors) != 1:
        raise LoopNotRecognised(f"the router {router.name} takes more than the block's tokens")
    weights_at = _weights_index(record, router, ids_at)
    inside = _calls_within(router, record.calls)
    shared = []
    for call in record.calls:
        if call.kind != "module" or call is router or call in inside:
            continue
        kind = _as_tokens(call.args[0], record.x) if len(call.args) == 1 and not call.kwargs else None
        if kind is None or not out_tags & call.bit:
            raise LoopNotRecognised(f"{call.name} ({type(getattr(block, call.name)).__name__}) runs outside the "
                                    "router and is not a shared expert on all tokens added to the output")
        shared.append((call.name, kind))
    return LoopPlan(list_name, router.name, router.kind == "method", arg, ids_at, weights_at, tuple(shared), output,
                    _extra_outputs(record.output, router))


def _extra_outputs(output: Any, router: _Call) -> tuple[int, ...] | None:
    """Which router outputs a tuple-returning block returns after its result; refuses anything else."""
    if not isinstance(output, tuple):
        return None
    outs = router.outputs()
    extra = []
    for i, value in enumerate(output[1:], start=1):
        at = [j for j, out in enumerate(outs) if out is value]
        if not at:
            raise LoopNotRecognised(f"the block returns a tuple whose element {i} is not an output of the router")
        extra.append(at[0])
    return tuple(extra)


# --------------------------------------------------------------------------- an expert's Linears by role
def infer_layout(expert: nn.Module) -> tuple[str, ...] | None:
    """The names of an MLP's bias-free Linear children as (gate, up, down) or (gate|up, down), found by what
    it computes: the assignment, among those the shapes allow, under which ``down(silu(gate(x)) * up(x))``
    reproduces ``expert(x)`` on random rows. None when no assignment does (or the expert does not run)."""
    linears = {name: c for name, c in expert.named_children() if type(c) is nn.Linear}
    if len(linears) not in (2, 3) or any(c.bias is not None for c in linears.values()):
        return None
    weight = next(iter(linears.values())).weight
    if weight.device.type == "meta":
        return None
    tol = 1e-4 if weight.dtype in (torch.float32, torch.float64) else 3e-2
    for names in itertools.permutations(linears):
        ws = [linears[n].weight for n in names]
        hidden, inter = ws[-1].shape
        if any(w.shape != ((2 if len(ws) == 2 else 1) * inter, hidden) for w in ws[:-1]):
            continue
        x = torch.randn(4, hidden, generator=torch.Generator().manual_seed(0)).to(device=weight.device,
                                                                               dtype=weight.dtype)
        with torch.no_grad():
            try:
                ref = expert(x)
            except Exception:  # noqa: BLE001 - an MLP that does not run on rows [T, H] has no layout here
                return None
            gate, up = F.linear(x, torch.cat(ws[:-1])).chunk(2, dim=-1)
            got = F.linear(F.silu(gate) * up, ws[-1])
        if isinstance(ref, torch.Tensor) and ref.shape == got.shape and \
                float((got - ref).abs().max()) <= tol * max(float(ref.abs().max()), 1e-6):
            return names
    return None


# --------------------------------------------------------------------------- lists of experts under other names
def _mlp_like(module: nn.Module) -> bool:
    """2-3 ``nn.Linear`` children and otherwise only parameter-free ones (activations): an expert MLP's shape."""
    children = list(module.children())
    linears = [c for c in children if type(c) is nn.Linear]
    return 2 <= len(linears) <= 3 and all(type(c) is nn.Linear or not any(True for _ in c.parameters())
                                          for c in children)


def _candidate_lists(model: nn.Module, skip: set[int]) -> Iterator[tuple[str, nn.Module, str]]:
    for path, module in model.named_modules():
        if id(module) in skip:
            continue
        for name, child in module.named_children():
            if isinstance(child, nn.ModuleList) and len(child) >= 2 and \
                    len({type(e) for e in child}) == 1 and all(_mlp_like(e) for e in child):
                yield path, module, name


def _runs_routed(block: nn.Module, list_name: str) -> bool:
    """Whether, traced on random tokens in eval mode, the list's elements run on some but not all token rows."""
    experts = getattr(block, list_name)
    weight = next(experts[0].parameters())
    if weight.device.type == "meta":
        return False
    flags = [(m, m.training) for m in block.modules()]
    block.eval()
    try:
        for hidden in sorted({c.in_features for c in experts[0].children() if type(c) is nn.Linear}):
            g = torch.Generator().manual_seed(0)
            x = torch.randn(2, 8, hidden, generator=g).to(device=weight.device, dtype=weight.dtype)
            try:
                seen = _routed_tokens(_trace(block, list_name, x), len(experts))
            except (LoopNotRecognised, RuntimeError) as e:
                log.debug("ep_fuse.prepare: %s.%s not traced on [2, 8, %d] tokens: %s", type(block).__name__,
                          list_name, hidden, e)
                continue
            tokens = x.numel() // hidden
            if any(seen.values()) and any(len(set(rows)) < tokens for rows in seen.values()):
                return True
    finally:
        for m, training in flags:
            m.training = training
    return False


def routed_expert_lists(model: nn.Module, skip: set[int]) -> list[tuple[str, nn.Module, str]]:
    """(path, block, list name) of ``nn.ModuleList`` children, under any name, of modules not in ``skip`` (ids)
    whose elements are MLP-shaped and, traced once, each run on a gathered subset of the block's tokens.
    Lists that run densely, or whose parent does not run on tokens ``[B, S, H]`` alone, are not returned."""
    found = []
    for path, block, name in _candidate_lists(model, skip):
        if _runs_routed(block, name):
            found.append((path, block, name))
        else:
            log.debug("ep_fuse.prepare: %s.%s holds MLPs but does not run them on routed subsets of tokens",
                      path, name)
    return found


def recognise_loop(block: nn.Module, list_name: str, x: torch.Tensor) -> LoopPlan:
    """Trace ``block`` on ``x`` (and on single-token probes) and return its :class:`LoopPlan`.

    Raises :class:`LoopNotRecognised` with the reason when the record shows no routed per-expert loop."""
    others = list(inspect.signature(block.forward).parameters)[1:]
    if others:
        raise LoopNotRecognised(f"its forward takes more than the tokens ({', '.join(others)}), which the "
                                "rebuilt forward would drop")
    plan = _analyse(block, list_name, _trace(block, list_name, x))
    num_experts = len(getattr(block, list_name))
    for batch, seq, seed in PROBE_TOKENS:
        g = torch.Generator().manual_seed(seed)
        probe = torch.randn(batch, seq, x.shape[-1], generator=g).to(device=x.device, dtype=x.dtype)
        record = _trace(block, list_name, probe)
        router = [c for c in record.calls if c.name == plan.router and c.kind != "expert"]
        if not router:
            raise LoopNotRecognised(f"the router {plan.router} does not run on a single token")
        why = _mismatch(router[0].outputs()[plan.ids_at], _routed_tokens(record, num_experts))
        if why is not None:
            raise LoopNotRecognised(f"on a single token, {why}")
    log.debug("ep_fuse.prepare: %s recognised by dataflow: %s", type(block).__name__, plan.describe())
    return plan

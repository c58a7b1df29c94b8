"""transformers' native expert parallelism on ep_fuse's engines: ``DistributedConfig(ep_implementation="ep_fuse")``.

transformers 5.x loads a MoE checkpoint with ``from_pretrained(path, distributed_config=DistributedConfig(
ep_size=W, fsdp_size=W, ep_implementation=...))``: each rank reads only its experts, and every experts module
sends its tokens through the ``EPImplementation`` that ``ep_implementation`` names in
``EPImplementationInterface``. Importing ``ep_fuse`` registers ``"ep_fuse"`` there (once
``transformers.distributed.expert_parallel`` is imported; ``ep_fuse/__init__.py``): :class:`EpFuseEP` runs
``ep_fuse::ep_dispatch`` -> ``ep_fuse::moe_experts`` on the local experts -> ``ep_fuse::ep_combine``, the ops the
EP pass inserts for a model sharded by :func:`ep_fuse.shard_experts`. Compiled with ``backend="ep_fuse"``, the
EP pass re-chooses the engine of each such block from ``ep_engine`` (``docs/ep.md``).

:func:`for_inference` turns the loaded model into plain tensors for inference: the FSDP-sharded dense weights
are gathered once (every rank holds them whole, as data-parallel attention needs) and FSDP's hooks removed, the
expert weights become their local shards. Without it the model stays correct but FSDP's per-layer hooks break
the compiled graph into pieces.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from ep_fuse.ops.ep import EpError, resolve_group

log = logging.getLogger("ep_fuse.hf")

NAME = "ep_fuse"
"""The ``ep_implementation`` name registered in transformers' ``EPImplementationInterface``."""

RECORD = "ep_fuse_hf_ep"
"""Attribute of an experts module that holds its :class:`EpFuseEP` (read by :func:`for_inference`)."""

DEFAULT_TIMEOUT_S = 300.0


@functools.lru_cache(maxsize=None)
def announce(world: int) -> None:
    """Say how to get one compiled graph (logged once per process and world size: the cache remembers)."""
    log.info('ep_fuse: ep_implementation="%s" on %d ranks; after loading, call '
             "ep_fuse.hf.expert_parallel.for_inference(model) on every rank for one compiled "
             "graph (FSDP's hooks split it otherwise)", NAME, world)


def plain_swiglu(experts: torch.nn.Module) -> bool:
    """Whether ``experts`` is a bias-free SwiGLU block in the ``[E, 2I, H]`` / ``[E, H, I]`` layout that
    ``ep_fuse::moe_experts`` computes (else its own forward runs on the received rows)."""
    w13, w2 = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor) and w13.dim() == 3 and w2.dim() == 3):
        return False
    if getattr(experts, "is_transposed", False) or getattr(experts, "has_bias", False):
        return False
    if not getattr(experts, "has_gate", True) or getattr(experts, "has_post_expert_norm", False):
        return False
    gate = getattr(type(experts), "_apply_gate", None)
    if gate is not None and getattr(gate, "__name__", "") != "_default_apply_gate":  # a model's own gating
        return False
    act = getattr(experts, "act_fn", None)
    if act is not None and type(act).__name__ not in ("SiLU", "SiLUActivation"):
        return False
    e, two_i, h = w13.shape
    return w2.shape[0] == e and w2.shape[1] == h and two_i == 2 * w2.shape[2]


@functools.cache
def implementation_class() -> type:
    """:class:`EpFuseEP`, a subclass of transformers' ``EPImplementation`` (built on first use, so that this
    module imports without transformers)."""
    from transformers.distributed.expert_parallel import EPImplementation  # optional dependency

    class EpFuseEP(EPImplementation):
        """Each rank's own tokens to the ranks owning their experts through ``ep_fuse::ep_dispatch``, this
        rank's experts on what it received, and ``ep_fuse::ep_combine`` back (the ``rank`` layout: the
        routing weights are applied once, by the local experts). Data-parallel ranks only (``tp_size=1``)."""

        def __init__(self, experts: torch.nn.Module, ep_mesh: Any, tp_mesh: Any) -> None:
            super().__init__(experts, ep_mesh, tp_mesh)
            if tp_mesh.size() > 1:
                raise ValueError(
                    f'ep_implementation="{NAME}" runs data-parallel ranks that each hold their own batch; '
                    f"got tp_size={tp_mesh.size()}. Use DistributedConfig(ep_size=W, fsdp_size=W) without tp_size.")
            import ep_fuse.catalog  # noqa: F401  (registers the ops and the engines)

            group = ep_mesh.get_group()
            self.group_name: str = group.group_name
            self.world: int = ep_mesh.size()
            self.num_experts: int = self.num_local_experts * self.world
            self.engine = "all_to_all"
            self.capacity = 0
            self.timeout_s = DEFAULT_TIMEOUT_S
            self.fused = plain_swiglu(experts)
            self.experts = experts
            object.__setattr__(experts, RECORD, self)  # not a submodule: a plain attribute
            announce(self.world)

        def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
            ops = torch.ops.ep_fuse
            common = (self.num_experts, self.group_name, self.engine, "rank", self.capacity, float(self.timeout_s))
            recv_x, recv_ids, recv_w, handle = ops.ep_dispatch(hidden_states, top_k_index, top_k_weights, *common)
            y = self.local_experts(recv_x, recv_ids, recv_w, hidden_states.dtype)
            return ops.ep_combine(y, handle, top_k_index, top_k_weights, *common, None)

        def local_experts(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                          dtype: torch.dtype) -> torch.Tensor:
            """This rank's experts on the received rows (local ids, -1 = another rank's expert or padding)."""
            ex = self.experts
            if self.fused:
                return torch.ops.ep_fuse.moe_experts(x, ids, w, ex.gate_up_proj, ex.down_proj, dtype)
            # transformers' own experts forward masks ids >= num_experts (its EP sentinel) as not local
            valid = ids >= 0
            sentinel = torch.where(valid, ids, torch.full_like(ids, self.num_local_experts))
            out = self.experts_forward(x.contiguous(), sentinel, torch.where(valid, w, torch.zeros_like(w)))
            return out.to(dtype)

    return EpFuseEP


def register() -> bool:
    """Register ``ep_implementation="ep_fuse"`` in transformers' ``EPImplementationInterface`` (idempotent);
    ``False`` where this transformers has no native EP."""
    try:
        from transformers.distributed.expert_parallel import EPImplementationInterface  # optional dependency
    except ImportError as exc:
        log.debug("ep_fuse: transformers has no native expert parallelism (%s)", exc)
        return False
    EPImplementationInterface.register(NAME, implementation_class())
    return True


def configure(model: torch.nn.Module, *, engine: str | None = None, capacity: int | None = None,
              timeout_s: float | None = None, backend: str | None = None) -> int:
    """Set the engine (``all_to_all`` and the other ``ep_engine`` names but ``auto``), static capacity and
    timeout that the ``ep_fuse`` EP implementation of every experts module of ``model`` uses when it runs
    outside ``backend="ep_fuse"`` (eager, other compilers); the EP pass re-chooses the engine under
    ``backend="ep_fuse"`` (``backend``: the engine's first name, kept as an alias). Returns the number of experts
    modules set."""
    engine = engine if backend is None else backend
    if engine == "auto":
        raise EpError("ep_fuse: configure(engine='auto') is chosen by the compiler; name an engine, e.g. "
                      "'all_to_all', or leave engine unset")
    impls = ep_implementations(model)
    for impl in impls:
        if engine is not None:
            impl.engine = engine
        if capacity is not None:
            impl.capacity = int(capacity)
        if timeout_s is not None:
            impl.timeout_s = float(timeout_s)
    return len(impls)


def ep_implementations(model: torch.nn.Module) -> list[Any]:
    """The :class:`EpFuseEP` of every experts module of ``model`` (loaded with ``ep_implementation="ep_fuse"``)."""
    return [impl for mod in model.modules() if (impl := getattr(mod, RECORD, None)) is not None]


def is_fsdp_hook(hook: Any) -> bool:
    """A forward hook FSDP2 registered (its state's bound methods, or the wrappers it installs around them)."""
    hook = getattr(hook, "func", hook)  # functools.partial
    owner = getattr(hook, "__self__", None)
    if owner is not None and type(owner).__name__ == "FSDPState":
        return True
    return str(getattr(hook, "__module__", "")).startswith("torch.distributed.fsdp")


def drop_fsdp(module: torch.nn.Module) -> bool:
    """Remove FSDP2's forward hooks from ``module`` and restore its class; whether it was an FSDP module."""
    found = False
    for hooks in (module._forward_pre_hooks, module._forward_hooks):
        for key in [k for k, h in hooks.items() if is_fsdp_hook(h)]:
            del hooks[key]
            found = True
    cls = type(module)
    if cls.__name__.startswith("FSDP") and any(b.__name__ == "FSDPModule" for b in cls.__mro__):
        module.__class__ = next(b for b in cls.__bases__ if b.__name__ != "FSDPModule")
        found = True
    return found


def prepare_loaded(model: torch.nn.Module) -> bool:
    """:func:`ep_fuse.prepare`'s step for a model loaded with HF's native EP (``ep_implementation="ep_fuse"``):
    :func:`for_inference` once (collective: every rank calls ``prepare``), so that ``torch.compile`` sees one
    graph instead of the pieces FSDP's hooks cut. Returns whether it ran; other models and a model already
    prepared (``model.ep_fuse_ep`` recorded) are left as they are."""
    if getattr(model, "ep_fuse_ep", None) is not None or not ep_implementations(model):
        return False
    for_inference(model)
    return True


def for_inference(model: torch.nn.Module) -> torch.nn.Module:
    """Make a model loaded with ``DistributedConfig(ep_size=W, fsdp_size=W, ep_implementation="ep_fuse")``
    plain tensors for inference (in place, collective: call on every rank); returns ``model``.

    Dense parameters sharded by FSDP are gathered once (each rank then holds them whole), FSDP's hooks are
    removed, and the expert weights become this rank's local shard (``[E_r, ...]``, experts
    ``[r*E_r, (r+1)*E_r)``). Records ``model.ep_fuse_ep`` as :func:`ep_fuse.shard_experts` does."""
    from torch.distributed.tensor import DTensor

    impls = ep_implementations(model)
    if not impls:
        raise EpError(f'ep_fuse.for_inference: no experts module runs ep_implementation="{NAME}"; load the model '
                      f'with from_pretrained(..., distributed_config=DistributedConfig(ep_size=W, fsdp_size=W, '
                      f'ep_implementation="{NAME}")) after importing ep_fuse')
    experts = {id(impl.experts): impl for impl in impls}
    dropped = sum(drop_fsdp(m) for m in model.modules())
    done: dict[int, torch.nn.Parameter] = {}
    gathered = local = 0
    for path, mod in model.named_modules():
        for name, p in list(mod._parameters.items()):
            if p is None or not isinstance(p.data if isinstance(p, torch.nn.Parameter) else p, DTensor):
                continue
            if id(p) in done:  # tied weights stay tied
                mod._parameters[name] = done[id(p)]
                continue
            impl = experts.get(id(mod))
            if impl is not None and p.dim() >= 1 and p.shape[0] == impl.num_experts:
                t = p.to_local()
                if t.shape[0] != impl.num_local_experts or t.numel() * impl.world != p.numel():
                    raise EpError(
                        f"ep_fuse.for_inference: {path}.{name} is sharded beyond expert parallelism (local "
                        f"{tuple(t.shape)} of {tuple(p.shape)}); use ep_size = fsdp_size (every expert whole "
                        "on one rank)")
                local += 1
            else:
                t = p.full_tensor()
                gathered += 1
            new = torch.nn.Parameter(t.detach().clone(), requires_grad=False)
            done[id(p)] = mod._parameters[name] = new
    first = impls[0]
    rank = resolve_group(first.group_name).rank()
    setattr(model, "ep_fuse_ep", {"num_experts": first.num_experts, "world": first.world, "rank": rank,
                                  "group": first.group_name, "modules": [n for n, m in model.named_modules()
                                                                         if id(m) in experts]})
    log.info("ep_fuse.for_inference: %d FSDP module(s) unwrapped, %d dense parameter(s) gathered, %d expert "
             "parameter(s) local (%d of %d experts per rank)", dropped, gathered, local,
             first.num_local_experts, first.num_experts)
    return model

"""Shard a model's expert weights over an EP group before ``torch.compile``.

``shard_experts(model, group)`` keeps rank r's contiguous slice ``[r*E_r, (r+1)*E_r)`` of every expert
tensor (HF 5.x ``Experts`` modules: 3-D ``gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I] plus any
per-expert bias; hand-written modules with ``w13`` / ``w2``) and sets the module's expert count
(``num_experts``) to ``E_r``, so the traced block is a consistent *local* block. The routers are
untouched: their top-k ids stay **global**, which only the EP pass makes correct -- compile the
sharded model with ``options={**ep_fuse.ep_options(model), ...}``. Compiling it without EP options
fails with a clear error when the router is visible in the graph (its width != local experts).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ep_fuse.ep import groups

log = logging.getLogger("ep_fuse.ep")

EXPERT_PAIRS = (("gate_up_proj", "down_proj"), ("w13", "w2"))
RECORD = "ep_fuse_ep"


def expert_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, int]]:
    """``(path, module, E)`` for every module holding 3-D expert weights of one expert count."""
    found = []
    for path, mod in model.named_modules():
        for up, down in EXPERT_PAIRS:
            a, b = getattr(mod, up, None), getattr(mod, down, None)
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == 3 and b.dim() == 3:
                if a.shape[0] == b.shape[0]:
                    found.append((path, mod, int(a.shape[0])))
                break
    return found


def shard_experts(model: torch.nn.Module, group: Any = None) -> torch.nn.Module:
    """Keep this rank's slice of every expert module's weights (in place); returns ``model``.

    Records ``model.ep_fuse_ep = {"num_experts": E, "world": W, "rank": r, "group": name,
    "modules": [...]}``. World size 1 leaves the weights whole (and records it).
    """
    if getattr(model, RECORD, None) is not None:
        raise groups.EpError("ep_fuse.shard_experts: this model is already sharded (model.ep_fuse_ep is set)")
    pg = groups.resolve_group(group)
    world, rank = pg.size(), pg.rank()
    mods = expert_modules(model)
    if not mods:
        raise groups.EpError(
            "ep_fuse.shard_experts: no expert module found (looked for 3-D gate_up_proj/down_proj or w13/w2 "
            "parameters [E, ...]); for HF models call ep_fuse.prepare(model) and pass the MoE model itself")
    totals = sorted({e for _p, _m, e in mods})
    for path, mod, e in mods:
        if e % world:
            raise groups.EpError(
                f"ep_fuse.shard_experts: {path or type(mod).__name__} has {e} experts, not divisible by the "
                f"{world} ranks of the EP group; use a group size that divides {e}")
        if world == 1:
            continue
        local = e // world
        lo, hi = rank * local, (rank + 1) * local
        for name, p in list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False)):
            if p.dim() >= 1 and p.shape[0] == e:
                p.data = p.data[lo:hi].clone()
                log.debug("ep_fuse.shard_experts: %s.%s -> experts [%d, %d)", path, name, lo, hi)
        if isinstance(getattr(mod, "num_experts", None), int):
            mod.num_experts = local
        setattr(mod, RECORD, {"num_experts": e, "world": world, "rank": rank, "first_expert": lo})
    record = {"num_experts": totals[0] if len(totals) == 1 else totals, "world": world, "rank": rank,
              "group": pg.group_name, "modules": [p for p, _m, _e in mods]}
    setattr(model, RECORD, record)
    log.info("ep_fuse.shard_experts: %d expert module(s), %s experts over %d ranks (rank %d)",
             len(mods), record["num_experts"], world, rank)
    return model


def ep_options(model: torch.nn.Module | None = None, group: Any = None, engine: str = "auto",
               capacity: int | None = None, timeout_s: float | None = None, *,
               backend: str | None = None) -> dict[str, Any]:
    """Backend options enabling EP for ``model`` (sharded by :func:`shard_experts` on ``group``) with the EP
    ``engine`` (``backend``: its first name, kept as an alias)."""
    if backend is not None:
        if engine not in ("auto", backend):
            raise groups.EpError(f"ep_fuse.ep_options: engine={engine!r} and backend={backend!r}; give one (backend "
                                 "is the engine's first name)")
        engine = backend
    record = getattr(model, RECORD, None) if model is not None else None
    if model is not None and record is None:
        raise groups.EpError("ep_fuse.ep_options: the model's experts are not sharded; call "
                             "ep_fuse.shard_experts(model, group) first (every rank, before compiling)")
    pg = groups.resolve_group(group if group is not None else (record or {}).get("group"))
    if record is not None and record["world"] != pg.size():
        raise groups.EpError(f"ep_fuse.ep_options: the model was sharded over {record['world']} ranks but the "
                             f"group has {pg.size()}")
    opts: dict[str, Any] = {"ep": True, "ep_group": pg, "ep_engine": engine}
    if capacity is not None:
        opts["ep_capacity"] = capacity
    if timeout_s is not None:
        opts["ep_timeout_s"] = timeout_s
    return opts

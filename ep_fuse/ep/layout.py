"""Shapes and pure-torch layout computations shared by the EP providers (``op-contracts.md`` §8).

Two layouts of the tokens a rank receives (``W`` ranks, ``E`` global experts, ``E_r = E / W`` local
experts, ``T`` local tokens, ``K`` top-k, ``C`` capacity in tokens per rank):

* ``"rank"`` (DeepEP normal): a token goes **once** to every rank owning one of its experts. The
  receiver gets ``R = W * (C or T)`` rows (a static bound; rows past the real count are padding),
  ids ``[R, K]`` rebased to local experts with **-1** for slots owned elsewhere, and the routing
  weights ``[R, K]`` (**0** where not local). Weights are applied in the local unpermute; combine is
  an unweighted sum over destination ranks.
* ``"expert"`` (DeepEP low-latency, Ascend ``npu_moe_distribute_*``): every (token, expert) pair is
  one row, expert-major: ``R = E_r * W * C`` rows, block ``e`` (rows ``[e*W*C, (e+1)*W*C)``) holds
  local expert ``e``'s rows in a provider-defined order; ids ``[R, 1]`` are ``e`` or -1 (padding),
  weights ``[R, 1]`` are 1 (0 for padding). Weights are applied in combine, on the source rank.

The dispatch handle is one int64 tensor ``[3 + ...]``: ``[code, key, n_recv, payload...]``
(:data:`CODES`); providers that keep an opaque object store it in :mod:`ep_fuse.ep.handles`.
"""

from __future__ import annotations

import torch

LAYOUTS = ("rank", "expert")
CODES = {"all_to_all": 0, "deepep": 1, "deepep_low_latency": 2, "npu": 3, "symm_mem": 4}
HEADER = 3


def capacity_rows(layout: str, tokens: int, capacity: int) -> int:
    """Tokens per rank the receive buffer is sized for: ``capacity``, or the local ``T`` (0 = data-dependent)."""
    if layout == "expert" or capacity > 0:
        return capacity if capacity > 0 else tokens
    return tokens


def recv_rows(layout: str, world: int, num_experts: int, tokens: int, capacity: int):
    """Static row count ``R`` of the receive buffers."""
    c = capacity_rows(layout, tokens, capacity)
    if layout == "rank":
        return world * c
    return (num_experts // world) * world * c


def symm_mem_chunks(world: int) -> int:
    """Splits per destination rank of the ``symm_mem`` provider: ``all_to_all_vdev_2d`` copies one split
    per thread block and launches ``min(W * splits, 64)`` blocks, so ``W * chunks <= 64`` keeps every
    block busy with exactly one split (at most 16 per rank: the op's tile limit). Above 8 ranks the ops
    launch 8 blocks only (internode tuning): one split per rank."""
    return 1 if world > 8 else max(1, min(16, 64 // max(world, 1)))


def handle_len(layout: str, world: int, num_experts: int, tokens: int, top_k: int, capacity: int,
               backend: str = ""):
    if layout == "rank":
        rows = recv_rows(layout, world, num_experts, tokens, capacity)
        if backend == "symm_mem":  # [slot of every (token, rank) (T*W <= R), received splits (W*chunks)]
            return HEADER + rows + world * symm_mem_chunks(world)
        return HEADER + 2 * world + rows
    return HEADER + tokens * top_k


def valid_slots(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    return (topk_ids >= 0) & (topk_ids < num_experts)


def dispatch_layout(
    topk_ids: torch.Tensor, num_experts: int, world: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepEP ``get_dispatch_layout`` semantics (§8.4) in torch:
    ``(num_tokens_per_rank int32 [W], num_tokens_per_expert int32 [E], is_token_in_rank bool [T, W])``;
    ids outside ``[0, E)`` count nowhere; a token counts once per destination rank."""
    per_rank = num_experts // world
    valid = valid_slots(topk_ids, num_experts)
    dest = torch.where(valid, topk_ids.long() // per_rank, world)  # invalid -> an extra column, dropped
    hit = torch.zeros(topk_ids.shape[0], world + 1, dtype=torch.bool, device=topk_ids.device)
    hit.scatter_(1, dest, True)
    is_token_in_rank = hit[:, :world]
    flat = torch.where(valid, topk_ids.long(), num_experts).reshape(-1)
    per_expert = torch.zeros(num_experts + 1, dtype=torch.int64, device=topk_ids.device)
    per_expert.scatter_add_(0, flat, torch.ones_like(flat))
    return (is_token_in_rank.sum(0).to(torch.int32), per_expert[:num_experts].to(torch.int32), is_token_in_rank)


def local_slots(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, dest_rank: torch.Tensor, num_experts: int, world: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows sent to ``dest_rank`` [S] (ids/weights [S, K] of the sent tokens): ids rebased to the
    destination's local experts (-1 elsewhere) and weights (0 elsewhere)."""
    per_rank = num_experts // world
    ids = topk_ids.long()
    mine = valid_slots(ids, num_experts) & (ids // per_rank == dest_rank.unsqueeze(-1))
    local = torch.where(mine, ids - dest_rank.unsqueeze(-1) * per_rank, -1)
    weights = torch.where(mine, topk_weights, torch.zeros((), dtype=topk_weights.dtype, device=ids.device))
    return local, weights


def pair_positions(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(valid [T*K], pos [T*K])``: for each valid slot, its index among the slots of the same expert
    in flat (token, slot) order -- the row it takes in that expert's block from this source rank."""
    flat = topk_ids.reshape(-1).long()
    valid = valid_slots(flat, num_experts)
    key = torch.where(valid, flat, num_experts)
    sorted_key, order = torch.sort(key, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device).scatter_add_(
        0, key, torch.ones_like(key))
    start = torch.cumsum(counts, 0) - counts
    pos_sorted = torch.arange(flat.numel(), device=flat.device) - start[sorted_key]
    pos = torch.empty_like(pos_sorted).scatter_(0, order, pos_sorted)
    return valid, pos


def pack_meta(ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """ids [S, K] and weights [S, K] as one int64 [S, 2K] message (weights bit-cast, so lossless)."""
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[weights.element_size()]
    return torch.cat([ids.long(), weights.contiguous().view(bits).long()], dim=1)


def unpack_meta(meta: torch.Tensor, top_k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[torch.empty((), dtype=dtype).element_size()]
    return meta[:, :top_k], meta[:, top_k:].to(bits).view(dtype)

"""Shapes and pure-torch layout computations shared by the EP providers (the EP ops' contract, ``docs/ep.md``).

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

``all_to_all`` rank layout (:func:`packed_row`): one message per direction. A dispatch row is the token
row followed by its metadata -- ``[x (H) | pad to 16 B | ids (K int32 words) | weights (K words of
bits) | pad]``, ``Hp`` elements of x's dtype, a multiple of 16 elements -- and the receiver's ``recv_x``
is the ``[:, :H]`` view of the ``[R, Hp]`` receive buffer (row stride ``Hp``). Handle payload:
``[send_counts (W), recv_counts (W), slot (T*W)]``, ``slot[t, r]`` the row of token ``t``'s copy for rank
``r`` in the send buffer (= in the buffer combine receives back), -1 when ``t`` does not go to ``r``.
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
               engine: str = ""):
    """Length of the int64 dispatch handle. Rank layout: ``[header, per-peer counts (2W), [T, W] slot
    table]`` (DeepEP leaves the payload unused); ``symm_mem`` appends its received splits (W x chunks)."""
    if layout == "rank":
        extra = world * symm_mem_chunks(world) if engine == "symm_mem" else 0
        return HEADER + 2 * world + tokens * world + extra
    return HEADER + tokens * top_k


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def weight_words(dtype: torch.dtype) -> int:
    """int32 words of one routing weight in the packed row (16-bit weights are zero-extended)."""
    return max(1, dtype.itemsize // 4)


def packed_row(hidden: int, x_dtype: torch.dtype, top_k: int, w_dtype: torch.dtype) -> tuple[int, int]:
    """``(Hp, moff)``: elements per packed dispatch row (a multiple of 16 elements and of 16 bytes, so
    Triton specializes the row stride for 16-byte vectors) and the int32 word where the metadata starts."""
    elt = x_dtype.itemsize
    x_bytes = _round_up(hidden * elt, 16)
    row_bytes = _round_up(x_bytes + 4 * top_k * (1 + weight_words(w_dtype)), 16 * elt)
    return row_bytes // elt, x_bytes // 4


def weight_bits(weights: torch.Tensor) -> torch.Tensor:
    """Routing weights [S, K] as int32 words [S, K * weight_words] (bit patterns, lossless)."""
    elt = weights.element_size()
    w = weights.contiguous()
    if elt >= 4:
        return w.view(torch.int32)
    return w.view({1: torch.uint8, 2: torch.int16}[elt]).to(torch.int32) & ((1 << (8 * elt)) - 1)


def bits_to_weights(words: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`weight_bits`."""
    elt = dtype.itemsize
    if elt >= 4:
        return words.contiguous().view(dtype)
    return words.to({1: torch.uint8, 2: torch.int16}[elt]).view(dtype)


def pack_rows(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, hp: int, moff: int) -> torch.Tensor:
    """Reference packing: rows ``x`` [S, H], local ids [S, K] and weights [S, K] -> packed rows [S, Hp]."""
    s, k = ids.shape
    out = x.new_zeros(s, hp)
    out[:, :x.shape[1]] = x
    words = out.view(torch.int32)
    words[:, moff:moff + k] = ids.to(torch.int32)
    bits = weight_bits(weights)
    words[:, moff + k:moff + k + bits.shape[1]] = bits
    return out


def unpack_rows(recv: torch.Tensor, n_valid: int, hidden: int, top_k: int, w_dtype: torch.dtype,
                moff: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference unpacking of the receive buffer [R, Hp]: ``(recv_x [R, H] view, ids int64 [R, K],
    weights [R, K])``; rows from ``n_valid`` on are padding (ids -1, weights 0)."""
    words = recv.view(torch.int32)
    ids = words[:, moff:moff + top_k].long()
    bits = words[:, moff + top_k:moff + top_k * (1 + weight_words(w_dtype))]
    weights = bits_to_weights(bits, w_dtype)
    ids[n_valid:] = -1
    weights[n_valid:] = 0
    return recv[:, :hidden], ids, weights


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

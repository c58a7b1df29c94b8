"""The masked expert layout of the routed-expert family: ``ep_fuse::moe_experts_masked``.

``moe_experts_masked(x [E, M, H], counts [E], w13 [E, 2I, H], w2 [E, H, I], max_rows=0, act=...) -> y [E, M, H]``:
expert ``e`` runs its gated MLP (``ep_fuse.ops.moe`` conventions: each GEMM output rounded to ``x``'s dtype, the gated
activation ``act`` in that dtype) on rows ``[0, counts[e])`` of ``x[e]``; no routing weight is applied.

This is the receive layout of the expert-major EP dispatch (DeepEP low-latency: ``[E_r, W*C, H]`` with a
per-expert count): the experts read it in place, so no permute/unpermute runs over the padding rows.

**Rows past a count are not computed and their content is unspecified**: the reference writes zeros there, the
fused kernels leave them unwritten. Only consumers that read rows below the counts may take the output (the
expert-layout EP combine reads exactly those). ``counts`` is clamped to ``[0, M]``. ``max_rows`` (0: none) is
the caller's bound on ``sum(counts)``, a launch-size hint for the kernels (never a cut-off: rows beyond it are
computed all the same).
"""

from __future__ import annotations

import torch

from ep_fuse.ops.moe import ACT_SCHEMA, act_problem, gated_act
from ep_fuse.ops.registry import define_canonical


def valid_rows(counts: torch.Tensor, m: int) -> torch.Tensor:
    """``[E, M]`` bool: row ``r`` of expert ``e`` is below its count."""
    return torch.arange(m, device=counts.device).unsqueeze(0) < counts.to(torch.int64).unsqueeze(1)


def counts_from_ids(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int32 ``[E]`` counts of an expert-major receive layout whose ids ``[E*M, 1]`` are the expert or -1
    (valid rows first in each block: DeepEP low-latency)."""
    return (ids.reshape(num_experts, -1) >= 0).sum(1, dtype=torch.int32)


def moe_experts_masked_ref(x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                           max_rows: int = 0, act: str = "silu", limit: float | None = None,
                           gate_cap: float | None = None, up_cap: float | None = None) -> torch.Tensor:
    """Batched GEMMs over every row, then rows past each count set to zero (the semantics; the kernels skip them)."""
    inter = w13.shape[1] // 2
    h = torch.bmm(x, w13.transpose(1, 2))
    gate, up = h.split(inter, -1)
    y = torch.bmm(gated_act(gate, up, act, limit, gate_cap, up_cap), w2.transpose(1, 2))
    keep = valid_rows(counts, x.shape[1]).unsqueeze(-1)
    return torch.where(keep, y, torch.zeros((), dtype=y.dtype, device=y.device))


def moe_experts_masked_fake(x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                            max_rows: int = 0, act: str = "silu", limit: float | None = None,
                            gate_cap: float | None = None, up_cap: float | None = None) -> torch.Tensor:
    reason = act_problem(act, limit, gate_cap, up_cap)
    if reason is not None:
        raise ValueError(f"ep_fuse: {reason}")
    if x.dim() != 3 or counts.shape != (x.shape[0],) or w13.shape[0] != x.shape[0] or w2.shape[0] != x.shape[0]:
        raise ValueError(f"ep_fuse: moe_experts_masked takes x [E, M, H], counts [E], w13 [E, 2I, H], w2 [E, H, I]; "
                         f"got {tuple(x.shape)}, {tuple(counts.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}")
    return x.new_empty(x.shape[0], x.shape[1], w2.shape[1])


moe_experts_masked = define_canonical(
    "moe_experts_masked",
    f"(Tensor x, Tensor counts, Tensor w13, Tensor w2, int max_rows=0, {ACT_SCHEMA}) -> Tensor",
    moe_experts_masked_ref, fake=moe_experts_masked_fake)
"""``moe_experts_masked(x [E, M, H], counts [E], w13, w2, max_rows=0, act=...)``: the experts on the first ``counts[e]``
rows of each ``x[e]`` (module docstring)."""

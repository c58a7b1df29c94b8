"""MoE blocks generated from a description, for ``tests/test_moe_semantics.py``: one ``nn.Module`` per combination of
router (score, selection bias, groups, renormalisation, scale, 2-D or transposed weight), expert storage (stacked
``[E, out, in]`` / ``[E, in, out]`` parameters, separate or fused gate|up in either half order, or a list of MLPs),
activation, dispatch spelling (per-token weight gather + einsum, dense over all experts, loop with ``where``), and
shared expert. The spelling is chosen independently of the semantics, so a recogniser that reads spelling fails
somewhere in the product.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

ACTS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


@dataclass(frozen=True)
class Spec:
    experts: int = 8
    top_k: int = 2
    hidden: int = 32
    inter: int = 16
    score: str = "softmax"  # softmax | sigmoid | topk_softmax (top-k of the logits, then softmax over K)
    bias: bool = False  # a selection bias [E] (top-k of score + bias, weights from the score)
    groups: tuple[int, int] | None = None  # (n_group, topk_group): group score = sum of its two best
    renormalize: bool = True
    scale: float = 1.0
    router_transposed: bool = False  # the router weight is [H, E] (logits = x @ W)
    storage: str = "stacked"  # stacked | fused | list
    transposed: bool = False  # stacked weights stored [E, in, out]
    fused_order: str = "gate_first"  # gate_first | up_first (fused storage)
    act: str = "silu"
    dispatch: str = "einsum"  # einsum (per-token gathered weights) | dense (every expert on every token) | loop
    shared: bool = False
    packed: bool = False  # the block takes rows [T, H] only


class SharedMLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, inter, bias=False)
        self.up = nn.Linear(hidden, inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class ListExpert(nn.Module):
    def __init__(self, hidden: int, inter: int, act: str) -> None:
        super().__init__()
        self.fc_in = nn.Linear(hidden, 2 * inter, bias=False)  # gate rows, then up rows
        self.fc_out = nn.Linear(inter, hidden, bias=False)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.fc_in(x).chunk(2, dim=-1)
        return self.fc_out(ACTS[self.act](gate) * up)


class GeneratedMoE(nn.Module):
    """A routed MoE block as :class:`Spec` describes it."""

    def __init__(self, spec: Spec, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        e, h, i = spec.experts, spec.hidden, spec.inter
        self.spec = spec

        def rand(*shape: int, std: float = 0.2) -> nn.Parameter:
            return nn.Parameter(torch.randn(*shape, generator=g) * std)

        self.router = rand(h, e) if spec.router_transposed else rand(e, h)
        if spec.bias:
            self.register_buffer("score_bias", torch.randn(e, generator=g) * 0.1)
        if spec.storage == "list":
            self.mlps = nn.ModuleList(ListExpert(h, i, spec.act) for _ in range(e))
        elif spec.storage == "fused":
            self.gate_up = rand(e, h, 2 * i) if spec.transposed else rand(e, 2 * i, h)
            self.down = rand(e, i, h) if spec.transposed else rand(e, h, i)
        else:
            self.w_gate = rand(e, h, i) if spec.transposed else rand(e, i, h)
            self.w_up = rand(e, h, i) if spec.transposed else rand(e, i, h)
            self.w_down = rand(e, i, h) if spec.transposed else rand(e, h, i)
        if spec.shared:
            self.shared = SharedMLP(h, i)

    # ---- routing
    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.spec
        logits = x @ self.router if s.router_transposed else F.linear(x, self.router)
        if s.score == "topk_softmax":
            values, ids = torch.topk(logits, s.top_k, dim=-1)
            return values.float().softmax(dim=-1), ids
        scores = logits.float().softmax(-1) if s.score == "softmax" else logits.float().sigmoid()
        choice = scores + self.score_bias if s.bias else scores
        if s.groups:
            n, k = s.groups
            grouped = choice.view(choice.shape[0], n, -1)
            keep = grouped.topk(2, dim=-1).values.sum(-1).topk(k, dim=-1).indices
            mask = torch.ones(choice.shape[0], n, dtype=torch.bool).scatter(1, keep, False)
            choice = grouped.masked_fill(mask.unsqueeze(-1), float("-inf")).flatten(1)
        ids = torch.topk(choice, s.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if s.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights * s.scale, ids

    # ---- experts
    def _weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """gate, up [E, I, H] and down [E, H, I] in Linear layout, for the spellings below."""
        s = self.spec
        if s.storage == "fused":
            gu = self.gate_up.transpose(1, 2) if s.transposed else self.gate_up
            down = self.down.transpose(1, 2) if s.transposed else self.down
            a, b = gu.chunk(2, dim=1)
            return (a, b, down) if s.fused_order == "gate_first" else (b, a, down)
        t = (lambda w: w.transpose(1, 2)) if s.transposed else (lambda w: w)
        return t(self.w_gate), t(self.w_up), t(self.w_down)

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        s = self.spec
        act = ACTS[s.act]
        if s.storage == "list" or s.dispatch == "loop":
            out = torch.zeros_like(x)
            for e in range(s.experts):
                rows, slot = torch.where(ids == e)
                if s.storage == "list":
                    y = self.mlps[e](x[rows])
                else:
                    gate, up, down = (w[e] for w in self._weights())
                    y = F.linear(act(F.linear(x[rows], gate)) * F.linear(x[rows], up), down)
                out[rows] += (weights[rows, slot, None] * y).to(x.dtype)
            return out
        gate, up, down = self._weights()
        if s.dispatch == "einsum":
            h = act(torch.einsum("th,tkih->tki", x, gate[ids])) * torch.einsum("th,tkih->tki", x, up[ids])
            y = torch.einsum("tki,tkhi->tkh", h, down[ids])
            return torch.einsum("tkh,tk->th", y, weights.to(y.dtype))
        dense = torch.zeros(x.shape[0], s.experts, dtype=weights.dtype).scatter(1, ids, weights)
        xe = x.unsqueeze(0).expand(s.experts, -1, -1)
        y = torch.bmm(act(torch.bmm(xe, gate.transpose(1, 2))) * torch.bmm(xe, up.transpose(1, 2)),
                      down.transpose(1, 2))
        return (dense.t().unsqueeze(-1).to(y.dtype) * y).sum(0)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.spec.packed and hidden.dim() != 2:
            raise ValueError("this block takes packed rows [T, H]")
        x = hidden.reshape(-1, hidden.shape[-1])
        weights, ids = self._route(x)
        out = self._experts(x, weights, ids)
        if self.spec.shared:
            out = out + self.shared(x)
        return out.view(hidden.shape)


class InputScaledMoE(GeneratedMoE):
    """Scores multiply the experts' *inputs* (``expert(w * x)``): not a weighted combine of expert outputs."""

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        gate, up, down = self._weights()
        act = ACTS[self.spec.act]
        out = torch.zeros_like(x)
        for k in range(ids.shape[1]):
            xs = x * weights[:, k:k + 1].to(x.dtype)
            h = act(torch.einsum("th,tih->ti", xs, gate[ids[:, k]])) * torch.einsum("th,tih->ti", xs, up[ids[:, k]])
            out = out + torch.einsum("ti,thi->th", h, down[ids[:, k]])
        return out


class UnweightedMoE(GeneratedMoE):
    """The routed experts' outputs summed without their routing weights."""

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return super()._experts(x, torch.ones_like(weights), ids)


class SquaredWeightsMoE(GeneratedMoE):
    """Weighted by the square of the routing weights: no canonical router tail computes that."""

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return super()._experts(x, weights * weights, ids)


class AuxLossMoE(GeneratedMoE):
    """Returns ``(out, aux_loss)``: a rebuilt block could not return the loss."""

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return super().forward(hidden), hidden.float().pow(2).mean()

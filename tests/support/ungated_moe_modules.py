"""Hand-written non-gated MoE experts in the shapes of NemotronH (transformers 5.24 ``modeling_nemotron_h.py`` and
its remote code): ``down(relu(up(x)) ** 2)``, no gate projection.

* :class:`UngatedExperts`: 3-D ``up_proj`` [E, I, H] / ``down_proj`` [E, H, I] run through transformers'
  ``grouped_mm`` / ``batched_mm`` experts function with ``has_gate=False`` (so the traced code is HF's), or
  ``impl="eager"``: the model's own per-expert loop, which reads each hit expert's index with ``.item()``;
* look-alikes that must not fuse (another power, another activation, no ReLU);
* :class:`NemotronHLoopMoE`: a block holding its experts as an ``nn.ModuleList`` of ``up_proj``/``down_proj``
  MLPs, a sigmoid top-k router module and a ``moe(x, topk_ids, topk_weights)`` loop that counts tokens per
  expert on the host (``.item()``), plus a shared expert (for ``ep_fuse.prepare``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ReLUSquared(nn.Module):
    """``relu(x)`` squared, as ``ACT2FN["relu2"]`` computes it (``torch.square``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.square(F.relu(x))


class UngatedExperts(nn.Module):
    """NemotronH's experts: ``down_e(act(up_e(x)))`` with ``act`` = relu², weighted and summed over the top-k."""

    def __init__(self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype = torch.bfloat16,
                 impl: str = "grouped_mm", scale: float = 1.0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.num_experts, self.impl = num_experts, impl
        self.up_proj = nn.Parameter((scale * torch.randn(num_experts, inter, hidden, generator=g) / hidden**0.5).to(dtype))
        self.down_proj = nn.Parameter((torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5).to(dtype))
        self.act_fn = ReLUSquared()
        self.has_gate, self.has_bias, self.is_transposed = False, False, False
        self.has_post_expert_norm, self._is_expert_parallel = False, False

    def _loop(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x, dtype=weights.dtype)
        with torch.no_grad():
            mask = F.one_hot(ids, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero().squeeze(-1)
        for e in hit:
            e = e.item()
            slot, token = torch.where(mask[e])
            if token.numel() == 0:
                continue
            h = F.linear(self.act_fn(F.linear(x[token], self.up_proj[e])), self.down_proj[e])
            out.index_add_(0, token, (h * weights[token, slot, None]).to(out.dtype))
        return out.to(x.dtype)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if self.impl == "eager":
            return self._loop(x, topk_ids, topk_weights)
        from transformers.integrations import moe as hf_moe

        fn = {"grouped_mm": hf_moe.grouped_mm_experts_forward, "batched_mm": hf_moe.batched_mm_experts_forward}
        return fn[self.impl](self, x, topk_ids, topk_weights)


class _Act(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def relu_cubed(dtype: torch.dtype = torch.bfloat16, **kw) -> UngatedExperts:
    """Look-alike: ``relu(x) ** 3``."""
    mod = UngatedExperts(4, 32, 16, dtype=dtype, **kw)
    mod.act_fn = _Act(lambda v: F.relu(v) ** 3)
    return mod


def gelu_squared(dtype: torch.dtype = torch.bfloat16, **kw) -> UngatedExperts:
    """Look-alike: ``gelu(x) ** 2``."""
    mod = UngatedExperts(4, 32, 16, dtype=dtype, **kw)
    mod.act_fn = _Act(lambda v: torch.square(F.gelu(v)))
    return mod


def squared_no_relu(dtype: torch.dtype = torch.bfloat16, **kw) -> UngatedExperts:
    """Look-alike: ``x ** 2`` (no ReLU)."""
    mod = UngatedExperts(4, 32, 16, dtype=dtype, **kw)
    mod.act_fn = _Act(lambda v: v * v)
    return mod


def relu_times_up(dtype: torch.dtype = torch.bfloat16, **kw) -> UngatedExperts:
    """Look-alike: ``relu(x) * x`` (not the square of one ReLU)."""
    mod = UngatedExperts(4, 32, 16, dtype=dtype, **kw)
    mod.act_fn = _Act(lambda v: F.relu(v) * v)
    return mod


LOOKALIKES = {"relu_cubed": relu_cubed, "gelu_squared": gelu_squared, "squared_no_relu": squared_no_relu,
              "relu_times_up": relu_times_up}


# --------------------------------------------------------------------------- remote-code style loop block
class NemotronHMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, act: nn.Module | None = None) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.act_fn = act if act is not None else ReLUSquared()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(x)))


class SigmoidTopkRouter(nn.Module):
    """Sigmoid scores, ``e_score_correction_bias`` picks, renormalised chosen scores times a scale; returns
    ``(topk_indices, topk_weights)`` (fp32 weights)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.top_k = top_k
        self.weight = nn.Parameter(torch.randn(num_experts, hidden, generator=g) / hidden**0.5)
        self.e_score_correction_bias = nn.Parameter(0.1 * torch.randn(num_experts, generator=g))
        self.routed_scaling_factor = 2.5

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = hidden_states.view(-1, hidden_states.shape[-1])
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        ids = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False)[1]
        w = scores.gather(1, ids)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, w * self.routed_scaling_factor


class NemotronHLoopMoE(nn.Module):
    """Experts as a list of non-gated MLPs, looped in ``moe`` with per-expert counts read on the host."""

    def __init__(self, hidden: int = 32, inter: int = 16, num_experts: int = 8, top_k: int = 2,
                 act: nn.Module | None = None) -> None:
        super().__init__()
        self.experts = nn.ModuleList([NemotronHMLP(hidden, inter, act) for _ in range(num_experts)])
        self.gate = SigmoidTopkRouter(hidden, num_experts, top_k)
        self.shared_experts = NemotronHMLP(hidden, 24)

    def moe(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x, dtype=topk_weights.dtype)
        mask = F.one_hot(topk_ids, num_classes=len(self.experts)).permute(2, 0, 1)
        counts = mask.sum(dim=(1, 2))
        for e, expert in enumerate(self.experts):
            if counts[e].item() == 0:
                continue
            token, slot = torch.where(mask[e])
            y = expert(x[token]) * topk_weights[token, slot].unsqueeze(-1)
            out.index_add_(0, token, y)
        return out.type(x.dtype)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        ids, w = self.gate(hidden_states)
        out = self.moe(hidden_states.view(-1, shape[-1]), ids, w).view(*shape)
        return out + self.shared_experts(hidden_states)


class LoopModel(nn.Module):
    """Residual layers of :class:`NemotronHLoopMoE` blocks (``x = x + block(x)``)."""

    def __init__(self, layers: int = 2, **kw) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([NemotronHLoopMoE(**kw) for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x

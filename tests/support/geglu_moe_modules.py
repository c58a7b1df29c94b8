"""GeGLU experts for the ``gelu_tanh`` / ``gelu`` activations of ``moe_experts`` (test support).

* :class:`GeGLUExperts`: transformers-style 3-D experts run through HF's own ``grouped_mm`` / ``batched_mm`` experts
  functions, with the activation an ``ACT2FN`` name (Gemma-4: ``gelu_pytorch_tanh``);
* look-alikes that must not fuse: the GELU on the up half (:class:`GeluOnUp`), and the GELU names whose Python
  formulas round differently from ``F.gelu`` (``gelu_new``, ``gelu_fast``: build :class:`GeGLUExperts` with them);
* :class:`HooklessGeGLUExperts`: Gemma-4's experts as transformers writes them without the experts-implementation
  hook (a Python loop over the hit experts, ``one_hot`` / ``where`` / ``index_add_``), for
  ``ep_fuse.surgery.hookless_experts``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from support.moe_modules import HFExperts


class GeGLUExperts(HFExperts):
    """``act_fn(gate) * up`` between HF's grouped GEMMs, ``act_fn = ACT2FN[act]``."""

    def __init__(self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype = torch.bfloat16,
                 impl: str = "grouped_mm", scale: float = 1.0, act: str = "gelu_pytorch_tanh") -> None:
        from transformers.activations import ACT2FN

        super().__init__(num_experts, hidden, inter, dtype=dtype, impl=impl, scale=scale)
        self.act_fn = ACT2FN[act]


class GeluOnUp(GeGLUExperts):
    """Look-alike: the GELU applied to the up half, the gate half left linear."""

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return gate * self.act_fn(up)


class HooklessGeGLUExperts(torch.nn.Module):
    """3-D experts (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I], ``act_fn``) whose forward loops over the
    experts that some slot routes to, as Gemma-4's experts do in transformers' eager path; no experts-implementation
    switch. ``transposed``: the weights stored [E, H, 2I] / [E, I, H] and used as they are."""

    def __init__(self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype = torch.float32,
                 act: str = "gelu_pytorch_tanh", transposed: bool = False, seed: int = 0) -> None:
        from transformers.activations import ACT2FN

        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.num_experts, self.transposed = num_experts, transposed
        gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
        down = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
        if transposed:
            gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
        self.gate_up_proj = torch.nn.Parameter(gate_up.to(dtype))
        self.down_proj = torch.nn.Parameter(down.to(dtype))
        self.act_fn = ACT2FN[act]

    def _linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x @ w if self.transposed else F.linear(x, w)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            e = e[0]
            if e == self.num_experts:
                continue
            slot, token = torch.where(mask[e])
            gate, up = self._linear(hidden_states[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = self._linear(self.act_fn(gate) * up, self.down_proj[e])
            y = y * top_k_weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


class UpHalfHookless(HooklessGeGLUExperts):
    """Hookless look-alike: the activation on the up half (grouped_mm's ``_apply_gate`` would differ)."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            gate, up = self._linear(hidden_states[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = self._linear(gate * self.act_fn(up), self.down_proj[e]) * top_k_weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out

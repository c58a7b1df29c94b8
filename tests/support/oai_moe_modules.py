"""Hand-written experts with GPT-OSS's clamped activation on gate|up halves, as MiniMax-M3 writes it (transformers
5.24 ``modeling_minimax_m3_vl.py``): ``g = gate.clamp(max=L)``, ``u = up.clamp(-L, L)``,
``(u + 1) * (g * sigmoid(g * alpha))``, run through transformers' ``grouped_mm`` / ``batched_mm`` experts function;
and look-alikes that must not fuse."""

from __future__ import annotations

import torch
from support.moe_modules import HFExperts


class OaiSwiGLU(HFExperts):
    """MiniMax-M3's experts (``swiglu_limit``, ``swiglu_alpha``; concatenated gate|up halves, no biases)."""

    limit, alpha, shift = 0.75, 1.702, 1.0

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return (up + self.shift) * glu


class OtherAlpha(OaiSwiGLU):
    """Look-alike: another sigmoid scale (the kernels take 1.702 only)."""

    alpha = 1.5


class OtherShift(OaiSwiGLU):
    """Look-alike: ``up + 2``."""

    shift = 2.0


class UnclampedGate(OaiSwiGLU):
    """Look-alike: the gate half is not clamped."""

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1.0) * (gate * torch.sigmoid(gate * self.alpha))

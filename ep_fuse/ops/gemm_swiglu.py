"""The dense GEMM + SwiGLU family: ``ep_fuse::gemm_swiglu`` (schema and pure-torch reference)."""

from __future__ import annotations

import torch

from ep_fuse.ops.registry import define_canonical


def gemm_swiglu_ref(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """``silu(x @ w_gate.T) * (x @ w_up.T)`` over the last dim of ``x``; weights are ``[I, H]``.

    Each GEMM output, the silu and the product are rounded to the input dtype, as the two-linear MLP
    (Llama-style ``down(act(gate(x)) * up(x))`` without the down projection) computes them.
    """
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    g = torch.mm(x2, w_gate.t())
    u = torch.mm(x2, w_up.t())
    return (torch.nn.functional.silu(g) * u).view(*lead, w_gate.shape[0])


GEMM_SWIGLU_SCHEMA = "(Tensor x, Tensor w_gate, Tensor w_up) -> Tensor"

gemm_swiglu = define_canonical("gemm_swiglu", GEMM_SWIGLU_SCHEMA, gemm_swiglu_ref)
"""``gemm_swiglu(x, w_gate, w_up) = silu(x @ w_gate.T) * (x @ w_up.T)``: see :func:`ep_fuse.ops.reference.gemm_swiglu_ref`."""

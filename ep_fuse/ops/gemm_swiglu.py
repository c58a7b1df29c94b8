"""The dense GEMM + SwiGLU family: ``ep_fuse::gemm_swiglu`` (schema and pure-torch reference)."""

from __future__ import annotations

import torch

from ep_fuse.ops.registry import define_canonical


def gemm_swiglu_ref(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, act_fp32: bool = False) -> torch.Tensor:
    """``silu(x @ w_gate.T) * (x @ w_up.T)`` over the last dim of ``x``; weights are ``[I, H]``.

    Each GEMM output, the silu and the product are rounded to the input dtype, as the two-linear MLP
    (Llama-style ``down(act(gate(x)) * up(x))`` without the down projection) computes them. ``act_fp32``
    (Beam's MLP: ``(silu(g.float()) * u.float()).to(dtype)``): the GEMM outputs are rounded to the input dtype,
    the silu and the product run in fp32 and round once (a no-op for fp32 inputs).
    """
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    g = torch.mm(x2, w_gate.t())
    u = torch.mm(x2, w_up.t())
    if act_fp32 and x.dtype != torch.float32:
        y = (torch.nn.functional.silu(g.float()) * u.float()).to(x.dtype)
    else:
        y = torch.nn.functional.silu(g) * u
    return y.view(*lead, w_gate.shape[0])


GEMM_SWIGLU_SCHEMA = "(Tensor x, Tensor w_gate, Tensor w_up, bool act_fp32=False) -> Tensor"
"""``act_fp32`` is passed only when set: other calls keep their 3 arguments."""

gemm_swiglu = define_canonical("gemm_swiglu", GEMM_SWIGLU_SCHEMA, gemm_swiglu_ref)
"""``gemm_swiglu(x, w_gate, w_up) = silu(x @ w_gate.T) * (x @ w_up.T)``: see :func:`ep_fuse.ops.gemm_swiglu.gemm_swiglu_ref`."""

"""Argument builders shared by the RMSNorm op tests."""

from __future__ import annotations

import torch

MODES = ("llama", "weight_fp32", "gemma", "none", "weight_fp32_pow", "none_pow")
TOL = {torch.bfloat16: (1e-2, 1e-2), torch.float16: (2e-3, 2e-3), torch.float32: (2e-5, 2e-5)}


def norm_args(rows: int, n: int, dtype: torch.dtype, mode: str, residual: bool, *, eps_tensor: bool = False,
              out_dtype: torch.dtype | None = "auto", w_dtype: torch.dtype | None = None, seed: int = 0,
              shape: tuple[int, ...] | None = None):
    g = torch.Generator().manual_seed(seed)
    shape = shape or (rows, n)
    x = torch.randn(shape, generator=g).to(dtype)
    r = torch.randn(shape, generator=g).to(dtype) if residual else None
    w = None if mode.startswith("none") else (torch.randn(shape[-1], generator=g) * 0.5 + 1).to(w_dtype or dtype)
    if out_dtype == "auto":
        out_dtype = dtype if (mode == "llama" or dtype != torch.float32) else None
    eps = 1e-6
    eps_t = torch.tensor(1e-5, dtype=torch.float32) if eps_tensor else None
    upcast = True
    rest = (w, eps, eps_t, mode, upcast, out_dtype)
    return ((x, r, *rest) if residual else (x, *rest))


def ulp_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    rtol, atol = TOL.get(dtype, TOL[torch.float32])
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol)

"""Host side of the Triton RMSNorm provider: output allocation and the launch."""

from __future__ import annotations

import torch

from ep_fuse.providers.common import rms_norm_out_dtype, rows_2d


def _eps(eps: float, eps_t: torch.Tensor | None) -> float:
    # a dynamic-shape eps arrives as a 0-d CPU tensor: reading it does not sync the GPU
    return float(eps_t.item()) if eps_t is not None else float(eps)


def rms_norm_kernel(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    eps_t: torch.Tensor | None,
    mode: str,
    upcast: bool,
    out_dtype: torch.dtype | None,
) -> torch.Tensor:
    from ep_fuse.providers.triton.rms_norm_kernel import launch

    n = x.shape[-1]
    y = torch.empty(x.shape, dtype=rms_norm_out_dtype(x, weight, mode, upcast, out_dtype), device=x.device)
    launch(rows_2d(x), None, weight, y.view(-1, n), None, _eps(eps, eps_t), mode, out_dtype)
    return y


def add_rms_norm_kernel(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    eps_t: torch.Tensor | None,
    mode: str,
    upcast: bool,
    out_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    from ep_fuse.providers.triton.rms_norm_kernel import launch

    n = x.shape[-1]
    y = torch.empty(x.shape, dtype=rms_norm_out_dtype(x, weight, mode, upcast, out_dtype), device=x.device)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    launch(rows_2d(x), rows_2d(residual), weight, y.view(-1, n), s.view(-1, n),
           _eps(eps, eps_t), mode, out_dtype)
    return y, s

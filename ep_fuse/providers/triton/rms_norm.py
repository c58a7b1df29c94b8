"""Host side of the Triton RMSNorm provider: output allocation and the launch.

The same host code serves the opaque provider op (eager executor, or Inductor calling the op) and,
with ``wrap_triton``, the traced form Inductor inlines into its own generated code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ep_fuse.providers.common import host_eps, rms_norm_out_dtype, row_stride


def _run(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
    mode: str,
    upcast: bool,
    out_dtype: torch.dtype | None,
    wrap: Callable[[Any], Any] | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    from ep_fuse.providers.triton.rms_norm_kernel import launch

    y = torch.empty(x.shape, dtype=rms_norm_out_dtype(x, weight, mode, upcast, out_dtype), device=x.device)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    sx = row_stride(x)
    sr = row_stride(residual) if residual is not None else 0
    assert sx is not None and sr is not None, "checked by the provider's supports()"
    launch(x, residual, weight, y, s, eps, mode, out_dtype, sx, sr, wrap=wrap)
    return y, s


def rms_norm_kernel(x, weight, eps, eps_t, mode, upcast, out_dtype, wrap=None):  # noqa: ANN001, ANN201
    """``ep_fuse_triton::rms_norm`` (canonical schema)."""
    return _run(x, None, weight, host_eps(eps, eps_t), mode, upcast, out_dtype, wrap)[0]


def add_rms_norm_kernel(x, residual, weight, eps, eps_t, mode, upcast, out_dtype, wrap=None):  # noqa: ANN001, ANN201
    """``ep_fuse_triton::add_rms_norm`` (canonical schema)."""
    return _run(x, residual, weight, host_eps(eps, eps_t), mode, upcast, out_dtype, wrap)

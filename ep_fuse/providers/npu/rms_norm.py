"""Ascend RMSNorm family: ``npu_rms_norm`` / ``npu_add_rms_norm`` (conventions: :mod:`ep_fuse.providers.npu`)."""

from __future__ import annotations

import functools
from typing import Any

import torch

from ep_fuse.ops import rms_norm as ops
from ep_fuse.ops.registry import register_provider
from ep_fuse.ops.rms_norm import (ROUNDED_RSTD, base_mode, host_eps, norm_input_dtype, rms_norm_out_dtype,
                                  unpack_norm_args)
from ep_fuse.providers.npu.provider import available, contracts, devices, torch_npu
from ep_fuse.providers.rms_norm import check_norm_call
from ep_fuse.symbolic import known


def supports(args: tuple[Any, ...]) -> str | None:
    reason = check_norm_call(args)
    if reason:
        return reason
    x, residual, (weight, _eps, _eps_t, mode, upcast, out_dtype) = unpack_norm_args(args)
    if mode in ROUNDED_RSTD:
        return f"mode {mode!r} rounds the statistic to {out_dtype} before the multiply; npu_rms_norm does not"
    norm_dtype = norm_input_dtype(args)
    if norm_dtype is not None:
        return f"the norm reads the residual sum rounded to {norm_dtype}; npu_add_rms_norm normalises the sum itself"
    if not 1 <= x.dim() <= 8:
        return "npu_rms_norm takes 1-D to 8-D inputs"
    if known(x.numel() == 0):  # a symbolic size may be empty at run time: re-checked per call
        return "npu_(add_)rms_norm rejects empty tensors"
    if rms_norm_out_dtype(x, weight, mode, upcast, out_dtype) != x.dtype:
        return "the NPU ops return the input dtype; this call produces another"
    gamma_dtype = _gamma_dtype(x, weight, mode)
    if residual is not None and gamma_dtype != x.dtype:
        return f"npu_add_rms_norm needs gamma in {x.dtype}, this call needs {gamma_dtype}"
    if residual is None and gamma_dtype not in (x.dtype, torch.float32):
        return f"npu_rms_norm does not take ({x.dtype}, {gamma_dtype}) inputs"
    return None


def _gamma_dtype(x: torch.Tensor, weight: torch.Tensor | None, mode: str) -> torch.dtype:
    if base_mode(mode) == "gemma":
        return torch.float32 if x.dtype != torch.float32 else x.dtype
    return weight.dtype if weight is not None else x.dtype


def gamma(x: torch.Tensor, weight: torch.Tensor | None, mode: str) -> torch.Tensor:
    """The ``gamma`` the NPU op multiplies by for ``mode`` (a ``_pow`` mode's ``pow(·, -0.5)`` is the op's rsqrt)."""
    mode = base_mode(mode)
    if mode == "gemma":
        assert weight is not None
        return weight.to(torch.float32) + 1.0
    if mode == "none":
        return _ones(x.shape[-1], x.dtype, x.device)
    assert weight is not None
    return weight


@functools.lru_cache(maxsize=64)
def _ones(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.ones(n, dtype=dtype, device=device)


def rms_norm_kernel(x, weight, eps, eps_t, mode, upcast, out_dtype):  # noqa: ANN001, ANN201 - schema-typed
    y, _rstd = torch_npu().npu_rms_norm(x, gamma(x, weight, mode), epsilon=host_eps(eps, eps_t))
    return y


def add_rms_norm_kernel(x, residual, weight, eps, eps_t, mode, upcast, out_dtype,  # noqa: ANN001, ANN201
                        norm_dtype=None):  # noqa: ANN001
    if norm_dtype is not None:  # declined by check_norm_call
        raise ValueError("ep_fuse npu add_rms_norm: norm_dtype is not implemented (the reference runs it)")
    y, _rstd, s = torch_npu().npu_add_rms_norm(x, residual, gamma(x, weight, mode), epsilon=host_eps(eps, eps_t))
    return y, s


register_provider(ops.rms_norm, "npu", rms_norm_kernel, devices=devices, available=available,
                  supports=supports, contracts=contracts("npu_rms_norm"))
register_provider(ops.add_rms_norm, "npu", add_rms_norm_kernel, devices=devices, available=available,
                  supports=supports, contracts=contracts("npu_add_rms_norm"))

"""The ``flash`` provider of ``varlen_attention``: PyTorch's FlashAttention-2 varlen kernel.

``aten._flash_attention_forward`` with ``cum_seq_q``/``cum_seq_k`` is FlashAttention-2's varlen forward as PyTorch
ships it (the kernel SDPA's flash backend runs, here with packed sequences): each query block reads only its own
sequence's keys, grouped-query heads natively, causal aligned at the end of each sequence (FlashAttention >= 2.1's
convention, the op's). Rows past ``cu_q[-1]`` (padding) are not written by the kernel; they are zeroed here, as the
reference does. It runs fp16/bf16 with equal query/value head dims up to 256 on sm_80 and newer.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from ep_fuse.ops import varlen_attention as ops
from ep_fuse.ops.registry import mark_sparse, register_provider
from ep_fuse.providers.triton.unverified import gpu_unverified

NAME = "flash"
VARIANT = "varlen_attention:flash"
MAX_HEAD_DIM = 256


@functools.lru_cache(maxsize=1)
def available() -> str | None:
    """``None`` when PyTorch's flash kernels can run here, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    major, _minor = torch.cuda.get_device_capability()
    if major < 8:
        return f"FlashAttention-2 needs sm_80 or newer; this GPU is sm_{major}{_minor}"
    if not hasattr(torch.ops.aten, "_flash_attention_forward"):
        return "this torch has no aten._flash_attention_forward"
    return None


def _devices() -> frozenset[str]:
    return frozenset({"cuda"})


def supports(args: tuple[Any, ...]) -> str | None:
    q, k, v, cu_q, cu_k = args[:5]
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes {q.dtype}/{k.dtype}/{v.dtype}; FlashAttention-2 takes fp16 or bf16, all equal"
    if cu_q.dtype != torch.int32 or cu_k.dtype != torch.int32:
        return "cumulative sequence lengths must be int32"
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        return "q, k, v must be [rows, heads, head_dim]"
    dims = (q.shape[-1], k.shape[-1], v.shape[-1], q.shape[1], k.shape[1], v.shape[1])
    if not all(is_concrete_int(d) for d in dims):
        return "symbolic head counts or head dims"
    d, dk, dv, hq, hk, hv = (int(x) for x in dims)
    if not d == dk == dv or d > MAX_HEAD_DIM or d % 8:
        return f"head dims q {d} / k {dk} / v {dv}: FlashAttention-2 takes equal dims, multiples of 8, up to 256"
    if hk != hv or hk == 0 or hq % hk:
        return f"{hq} query heads over {hk} key / {hv} value heads"
    for t in (q, k, v):
        s = t.stride(-1)
        if not (is_concrete_int(s) and int(s) == 1):
            return "the head dim is not unit-stride"
    return gpu_unverified(VARIANT, q)


def varlen_attention_flash(q, k, v, cu_q, cu_k, max_q, max_k, scale):  # noqa: ANN001, ANN201
    """``ep_fuse_flash::varlen_attention`` (canonical schema)."""
    out = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False,
                                                  scale=scale)[0]
    valid = torch.arange(q.shape[0], device=q.device) < cu_q[-1]
    return torch.where(valid[:, None, None], out, 0)


mark_sparse(NAME)
register_provider(ops.VARLEN_ATTENTION, NAME, varlen_attention_flash, devices=_devices, available=available,
                  supports=supports, contracts={"_flash_attention_forward": "torch 2.11"})

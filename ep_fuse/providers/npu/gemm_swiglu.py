"""Ascend dense GEMM + SwiGLU family: one GEMM over the concatenated gate|up weight, then ``npu_swiglu``."""

from __future__ import annotations

import collections
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ep_fuse.ops import gemm_swiglu as ops
from ep_fuse.ops.registry import register_provider
from ep_fuse.providers.npu.provider import available, contracts, devices, torch_npu
from ep_fuse.symbolic import known, same_shape


# --------------------------------------------------------------------------- GEMM + SwiGLU
# One GEMM over the concatenated [2I, H] gate|up weight, then npu_swiglu(y, dim=-1) = silu(y[:I]) * y[I:].
# The concatenation is made once per pair of weight tensors (and remade if either is modified in place). Keyed
# on the weights' storages by weak reference (a freed weight's address is never mistaken for a new weight's),
# offsets, shapes, strides and dtype; inference tensors track no version and count as never modified.
_CONCAT: collections.OrderedDict[tuple[Any, ...], tuple[tuple[int, int], torch.Tensor]] = collections.OrderedDict()
_CONCAT_MAX = 256


def _weight_key(w: torch.Tensor) -> tuple[Any, ...]:
    return (StorageWeakRef(w.untyped_storage()), w.storage_offset(), tuple(w.shape), w.stride(), w.dtype)


def _version(w: torch.Tensor) -> int:
    return -1 if w.is_inference() else w._version


def concat_weights(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    key = (_weight_key(w_gate), _weight_key(w_up))
    version = (_version(w_gate), _version(w_up))
    hit = _CONCAT.get(key)
    if hit is not None and hit[0] == version:
        _CONCAT.move_to_end(key)
        return hit[1]
    cat = torch.cat((w_gate, w_up), dim=0)
    _CONCAT[key] = (version, cat)
    _CONCAT.move_to_end(key)
    for stale in [k for k in _CONCAT if k[0][0].expired() or k[1][0].expired()]:
        del _CONCAT[stale]
    while len(_CONCAT) > _CONCAT_MAX:
        _CONCAT.popitem(last=False)
    return cat


def gemm_swiglu_supports(args: tuple[Any, ...]) -> str | None:
    x, w_gate, w_up = args[:3]
    if len(args) > 3 and args[3] and x.dtype != torch.float32:
        return "SwiGLU in fp32 of low-precision GEMM outputs (act_fp32) is not checked against npu_swiglu"
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32) or w_gate.dtype != x.dtype:
        return f"dtype {x.dtype} / {w_gate.dtype}"
    if w_gate.dim() != 2 or not same_shape(w_up.shape, w_gate.shape):
        return "weights are not two [I, H] matrices of one shape"
    if known(x.numel() == 0):
        return "npu_swiglu rejects empty tensors"
    return None


def gemm_swiglu_kernel(x, w_gate, w_up, act_fp32=False):  # noqa: ANN001, ANN201 - schema-typed
    y = torch.matmul(x, concat_weights(w_gate, w_up).t())
    return torch_npu().npu_swiglu(y, dim=-1)


register_provider(ops.gemm_swiglu, "npu", gemm_swiglu_kernel, devices=devices, available=available,
                  supports=gemm_swiglu_supports, contracts=contracts("npu_swiglu"))

"""Triton provider: CUDA GPUs, or the CPU under ``TRITON_INTERPRET=1`` (set before the first launch).

Two ways a lowered call runs:

* as the opaque op ``torch.ops.ep_fuse_triton.<name>`` (eager executor; any call Inductor cannot
  inline), whose kernel re-checks its arguments and falls back to the reference if the launch fails;
* inlined by Inductor: when Inductor's AOT pass functionalizes the op on CUDA tensors, the launch is
  traced through ``wrap_triton`` so Inductor emits the kernel call in its own generated code (no
  Python dispatch per call). Calls with a tensor ``eps`` (``dynamic=True``) stay opaque.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch

from ep_fuse.ops import canonical
from ep_fuse.ops.registry import register_provider, triton_interpret
from ep_fuse.providers.common import check_norm_call
from ep_fuse.providers.triton import perf
from ep_fuse.providers.triton.rms_norm import add_rms_norm_kernel, rms_norm_kernel

INLINE_IN_INDUCTOR = True
"""Let Inductor inline the Triton launches (set False to keep the opaque op everywhere)."""


def _devices() -> frozenset[str]:
    return frozenset({"cuda", "cpu"}) if triton_interpret() else frozenset({"cuda"})


@functools.lru_cache(maxsize=1)
def _available() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install triton)"
    return None


def _inline_rule(kernel: Any) -> Any:
    def rule(mode: Any, op: Any, types: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        x = args[0]
        eps_t = args[-4]
        if (not INLINE_IN_INDUCTOR or triton_interpret() or eps_t is not None or x.device.type != "cuda"
                or check_norm_call(args) is not None):
            return mode.__torch_dispatch__(op, types, args, kwargs)
        from torch.library import wrap_triton

        with mode:
            return kernel(*args, wrap=wrap_triton)

    return rule


def _register(canon: Any, kernel: Any, prefers: Any) -> None:
    prov = register_provider(canon, "triton", kernel, devices=_devices, available=_available,
                             supports=check_norm_call, prefers=prefers)
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    torch.library.register_torch_dispatch(prov.op, FunctionalTensorMode, _inline_rule(kernel))


_register(canonical.rms_norm, rms_norm_kernel, perf.rms_norm_prefers)
_register(canonical.add_rms_norm, add_rms_norm_kernel, perf.add_rms_norm_prefers)

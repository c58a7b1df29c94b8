"""transformers' Hub kernels (``kernels`` library) on layers ep_fuse fuses better: their plain forwards restored.

transformers >= 5.25 loads models with ``use_kernels`` on by default (``USE_HUB_KERNELS`` turns it off): on CUDA,
``kernelize`` gives every layer whose class is registered under a Hub layer name (``kernel_layer_name``) an
instance ``forward`` bound to the Hub kernel's, and swaps the functions a module holds in ``_kernel_funcs`` (RoPE's
``apply_rotary_pos_emb``) the same way. Those kernels reach ``torch.compile`` as opaque calls where ep_fuse's
patterns expect the unfused ops (the residual add + RMSNorm, the rotary embedding, the SiLU/GELU of the SwiGLU /
GeGLU experts and MLPs), so :func:`restore_plain_forwards` removes the instance ``forward`` of exactly those layers
(what ``kernels``' own fallback does); Hub kernels on other layers (linear attention, Mamba, ...) stay.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger("ep_fuse")

FUSED_BY_EP_FUSE = {
    "RMSNorm": "add_rms_norm / rms_norm",
    "rotary_pos_emb": "rope",
    "SiLU": "moe_experts / gemm_swiglu (SwiGLU)",
    "GeLU": "moe_experts (GeGLU)",
    "GeluTanh": "moe_experts (GeGLU)",
    "NewGELU": "moe_experts (GeGLU)",
    "FastGELU": "moe_experts (GeGLU)",
}
"""Hub layer name (transformers' ``use_kernel_forward_from_hub``) -> the ep_fuse pattern that fuses its site."""


def _kernelized(obj: Any) -> str | None:
    """The Hub layer name of ``obj`` if ``kernelize`` replaced its forward (an instance ``forward`` other than its
    class's own), else ``None``."""
    name = getattr(type(obj), "kernel_layer_name", None)
    forward = vars(obj).get("forward") if hasattr(obj, "__dict__") else None
    if name is None or forward is None:
        return None
    if getattr(forward, "__func__", None) is getattr(type(obj), "forward", None):
        return None  # kernels' fallback: the class's own forward, bound
    return str(name)


def restore_plain_forwards(model: torch.nn.Module) -> dict[str, int]:
    """Give the layers (and the functions held in ``_kernel_funcs``) of ``model`` that ``kernelize`` replaced with a
    Hub kernel listed in :data:`FUSED_BY_EP_FUSE` their class's own forward again; returns how many per Hub layer
    name. One INFO line says what was restored and which Hub kernels were kept."""
    restored: dict[str, int] = {}
    kept: dict[str, int] = {}
    seen: set[int] = set()
    for module in model.modules():
        for obj in (module, *vars(module).get("_kernel_funcs", {}).values()):
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            name = _kernelized(obj)
            if name is None:
                continue
            if name in FUSED_BY_EP_FUSE:
                del obj.__dict__["forward"]
                restored[name] = restored.get(name, 0) + 1
            else:
                kept[name] = kept.get(name, 0) + 1
    if restored or kept:
        log.info("ep_fuse.prepare: %s: Hub kernels replaced by transformers' own forwards so that ep_fuse fuses "
                 "them: %s; kept: %s", type(model).__name__,
                 ", ".join(f"{k} x{v}" for k, v in sorted(restored.items())) or "none",
                 ", ".join(f"{k} x{v}" for k, v in sorted(kept.items())) or "none")
    return restored

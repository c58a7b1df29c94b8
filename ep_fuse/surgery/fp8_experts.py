"""transformers' ``FP8Experts`` run without the hub kernel, as one traceable graph (used by :func:`ep_fuse.prepare`).

transformers 5.x loads FP8 checkpoints (DeepSeek-V3/R1, Qwen3 FP8, ...) into ``FP8Experts`` modules
(``transformers/integrations/finegrained_fp8.py``): ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]
in ``float8_e4m3fn`` with per-block dequant scales ``gate_up_proj_scale_inv`` [E, ceil(2I/bn), ceil(H/bk)]
and ``down_proj_scale_inv`` [E, ceil(H/bn), ceil(I/bk)] (``block_size = (bn, bk)``, 128 x 128 for
DeepSeek-V3). Every forward of theirs -- the eager loop, ``grouped_mm``, ``batched_mm`` -- calls the
``kernels-community/finegrained-fp8`` Triton kernel through the ``kernels`` package, which an offline
machine cannot fetch.

:func:`convert_fp8_experts` gives each such module a forward that dequantizes its weights with
``ep_fuse::fp8_block_dequant`` (exact fp32 product, one rounding to the activation dtype) and runs
transformers' own bf16 ``grouped_mm`` / ``batched_mm`` experts function on them -- the form the
``moe_experts`` pattern matches. Compiled with ``quant="fp8_block"``, the quant pass finds the
dequantization and runs the block on the fp8 codes and scales themselves (``moe_experts_fp8``);
without it the dequantized weights run as a bf16 block (weight-only FP8: activations are not
quantized, unlike HF's kernel path). Parameters and state dict are unchanged.

Refused (left as they are, with the reason): no gate or with biases, static activation scales, clamped
or soft-capped gates (GPT-OSS / SwiGLU-OAI style), activations other than SiLU, FP4 (int8-packed) weights,
transposed or interleaved layouts, expert-parallel sentinels, post-expert norms, and scale tensors whose
shape is not the block grid (transformers pads the gate|up scales to two rows when ``2I < block_n``).
"""

from __future__ import annotations

import dataclasses
import logging
import types
from typing import Any

import torch

from ep_fuse.ops import fp8 as fp8_ops

log = logging.getLogger("ep_fuse")

FP8 = torch.float8_e4m3fn
SILU_NAMES = ("silu", "swish")


@dataclasses.dataclass(frozen=True)
class Fp8Conversion:
    """What :func:`convert_fp8_experts` did (or refused) for one module."""

    path: str
    block: tuple[int, int] | None = None
    reason: str | None = None
    """Why it was refused (``None``: converted)."""


def is_fp8_experts(module: Any) -> bool:
    """A transformers ``FP8Experts`` (any subclass, e.g. the one ``use_experts_implementation`` wraps)."""
    return any(c.__name__ == "FP8Experts" for c in type(module).__mro__) and hasattr(module, "down_proj_scale_inv")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _block(module: Any, weight: torch.Tensor) -> tuple[int, int]:
    bs = getattr(module, "block_size", None)
    return (int(bs[0]), int(bs[1])) if bs is not None else (weight.shape[1], weight.shape[2])


def _refusal(module: Any) -> str | None:
    """Why ``module`` cannot take the dequantizing forward (``None``: it can)."""
    if not getattr(module, "has_gate", True):
        return "experts without a gate (up_proj only) are not the SwiGLU block"
    if getattr(module, "has_bias", False):
        return "expert biases are not supported"
    if getattr(module, "activation_scheme", "dynamic") != "dynamic":
        return f"activation_scheme={module.activation_scheme!r} (static activation scales) is not supported"
    for attr in ("swiglu_alpha", "limit", "gate_softcap", "up_softcap"):
        if attr == "limit" and getattr(module, "limit_after_act", False):
            # transformers 5.25's act(gate).clamp(max=L) * up.clamp(-L, L) (ops' "silu_clamp_post"); a layer whose
            # per-layer limit is 0 ("no clamp") reaches FP8Experts as None: plain SwiGLU
            limit = getattr(module, "limit", None)
            if limit is not None and not limit > 0:
                return (f"limit={limit!r} with limit_after_act: FP8Experts' own forward clamps to it (a model's "
                        "per-layer 0 means 'no clamp' only once the model turns it into None)")
            continue
        if getattr(module, attr, None) is not None:
            return f"{attr}={getattr(module, attr)!r}: a clamped or soft-capped gate is not SwiGLU"
    config = getattr(module, "config", None)
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if act not in SILU_NAMES:
        return f"activation {act!r} is not SiLU"
    if getattr(module, "is_transposed", False) or not getattr(module, "is_concatenated", True):
        return "transposed or interleaved gate|up layouts are not supported"
    if getattr(module, "_is_expert_parallel", False):
        return "expert-parallel sentinel handling (transformers' EP) is not supported; use ep_fuse's EP"
    if getattr(module, "has_post_expert_norm", False):
        return "post-expert norms are not supported"
    for name in ("gate_up_proj", "down_proj"):
        w = getattr(module, name, None)
        s = getattr(module, f"{name}_scale_inv", None)
        if not isinstance(w, torch.Tensor) or not isinstance(s, torch.Tensor):
            return f"{name} or {name}_scale_inv is missing"
        if w.dtype != FP8:
            return f"{name} is {w.dtype}, not float8_e4m3fn (FP4-packed experts are not supported)"
        if w.dim() != 3 or s.dim() != 3:
            return f"{name} {tuple(w.shape)} / its scales {tuple(s.shape)} are not [E, N, K] / [E, nb, kb]"
        bn, bk = _block(module, w)
        grid = (w.shape[0], _cdiv(w.shape[1], bn), _cdiv(w.shape[2], bk))
        if tuple(s.shape) != grid:
            return (f"{name}_scale_inv {tuple(s.shape)} is not the {bn}x{bk} block grid {grid} "
                    "(transformers pads gate|up scales when 2I < block_n)")
        if not s.dtype.is_floating_point:
            return f"{name}_scale_inv dtype {s.dtype} is not a float"
    if module.gate_up_proj.shape[1] % 2:
        return "gate_up_proj has an odd number of rows"
    return None


class _Dequantized:
    """What transformers' bf16 experts functions read from ``self``, with the dequantized weights."""

    has_gate = True
    has_bias = False
    is_transposed = False
    has_post_expert_norm = False
    _is_expert_parallel = False

    def __init__(self, module: Any, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> None:
        self.num_experts = module.num_experts
        self.act_fn = module.act_fn
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self.gate_up_proj_bias = None
        self.down_proj_bias = None
        self.limit = getattr(module, "limit", None) if getattr(module, "limit_after_act", False) else None

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        if self.limit is not None:  # limit_after_act, as FP8Experts computes it
            return self.act_fn(gate).clamp(max=self.limit) * up.clamp(min=-self.limit, max=self.limit)
        return self.act_fn(gate) * up


def dequantized_weights(module: Any, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gate_up_proj, down_proj)`` of an ``FP8Experts`` module in ``dtype``, through ``ep_fuse::fp8_block_dequant``."""
    op = fp8_ops.fp8_block_dequant.op
    out = []
    for name in ("gate_up_proj", "down_proj"):
        w, s = getattr(module, name), getattr(module, f"{name}_scale_inv")
        bn, bk = _block(module, w)
        out.append(op(w, s, bn, bk, dtype))
    return out[0], out[1]


def _forward(impl: str) -> Any:
    from transformers.integrations import moe  # optional dependency

    fn = moe.grouped_mm_experts_forward if impl == "grouped_mm" else moe.batched_mm_experts_forward

    def forward(self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        w13, w2 = dequantized_weights(self, hidden_states.dtype)
        return fn(_Dequantized(self, w13, w2), hidden_states, top_k_index, top_k_weights)

    return forward


def convert_fp8_experts(model: Any, experts_implementation: str = "grouped_mm",
                        strict: bool = False) -> list[Fp8Conversion]:
    """Give every ``FP8Experts`` module of ``model`` the dequantizing forward (module docstring).

    Logs each conversion at INFO and each refusal at WARNING (``strict=True``: raises ``ValueError``)."""
    done: list[Fp8Conversion] = []
    for path, module in model.named_modules():
        if not is_fp8_experts(module):
            continue
        reason = _refusal(module)
        if reason is not None:
            msg = f"ep_fuse.prepare: FP8 experts {path} left as they are: {reason}"
            if strict:
                raise ValueError(msg)
            log.warning("%s (their forward needs the kernels-community/finegrained-fp8 hub kernel)", msg)
            done.append(Fp8Conversion(path, reason=reason))
            continue
        module.forward = types.MethodType(_forward(experts_implementation), module)
        block = _block(module, module.gate_up_proj)
        log.info("ep_fuse.prepare: FP8 experts %s (%sx%s blocks) run through ep_fuse::fp8_block_dequant + %s; "
                 "compile with quant='fp8_block' to keep them in FP8", path, *block, experts_implementation)
        done.append(Fp8Conversion(path, block=block))
    return done

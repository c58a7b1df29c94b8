"""The Triton provider of ``moe_experts_masked`` (the masked expert layout, :mod:`ep_fuse.ops.moe_masked`): argument
checks, host code, registration. The kernels: :mod:`~ep_fuse.providers.triton.moe_masked_kernel`.

The launch reads no tensor values on the host (the work list is built on the device from ``counts``), so it is
CUDA-graph capturable and Inductor may trace it through ``wrap_triton``. Not yet run on a GPU: listed in
:data:`~ep_fuse.providers.triton.unverified.UNVERIFIED_ON_GPU` (declined on CUDA until
``tests/gpu/test_gpu_moe_masked.py`` has run).
"""

from __future__ import annotations

from typing import Any

import torch

from ep_fuse.ops import moe_masked as ops
from ep_fuse.ops.moe import act_problem, full_act
from ep_fuse.providers.tensor_checks import KERNEL_DTYPES
from ep_fuse.providers.triton.grouped_gemm import expert_weight_limits, unit_last
from ep_fuse.providers.triton.provider import register
from ep_fuse.providers.triton.unverified import gpu_unverified
from ep_fuse.symbolic import known, sym_eq

VARIANT = "moe_experts_masked:triton"


def check_moe_experts_masked_call(args: tuple[Any, ...]) -> str | None:
    """``None`` when the kernels run ``(x [E, M, H], counts [E], w13 [E, 2I, H], w2 [E, H, I], max_rows, act...)``."""
    x, counts, w13, w2 = args[:4]
    if x.dtype not in KERNEL_DTYPES or w13.dtype != x.dtype or w2.dtype != x.dtype:
        return f"dtypes {x.dtype}/{w13.dtype}/{w2.dtype} (the kernels take one of fp16/bf16/fp32 for all three)"
    if x.dim() != 3 or w13.dim() != 3 or w2.dim() != 3:
        return "x, w13 and w2 must be 3-D ([E, M, H], [E, 2I, H], [E, H, I])"
    e, _m, h = x.shape
    if not (sym_eq(w13.shape[0], e) and sym_eq(w2.shape[0], e) and sym_eq(w13.shape[2], h)
            and sym_eq(w2.shape[1], h) and known(w13.shape[1] == 2 * w2.shape[2])):
        return f"shapes x {tuple(x.shape)} / w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not chain"
    if not known(w2.shape[2] > 0):
        return "no intermediate columns"
    if counts.dtype not in (torch.int32, torch.int64) or counts.dim() != 1 or not sym_eq(counts.shape[0], e):
        return "counts is not an int32/int64 vector of E counts"
    if len({t.device for t in (x, counts, w13, w2)}) != 1:
        return "operands on different devices"
    if not (unit_last(x) and unit_last(w13) and unit_last(w2)):
        return "x, w13 or w2 is not unit-stride along its last dim"
    act = full_act(tuple(args[5:]))
    return (expert_weight_limits(w13) or expert_weight_limits(w2) or act_problem(*act) or gpu_unverified(VARIANT, x)
            or gpu_unverified(f"moe_experts_masked:{act[0]}", x))


def moe_experts_masked_kernel(x, counts, w13, w2, max_rows=0, act="silu", limit=None, gate_cap=None, up_cap=None,
                              wrap=None):
    """``ep_fuse_triton::moe_experts_masked``: rows past each count are left unwritten."""
    e, m, _h = x.shape
    inter, hidden = w13.shape[1] // 2, w2.shape[1]
    y = torch.empty((e, m, hidden), dtype=x.dtype, device=x.device)
    if known(e * m == 0):
        return y
    h = torch.empty((e, m, inter), dtype=x.dtype, device=x.device)
    from ep_fuse.providers.triton.moe_masked_kernel import launch_moe_experts_masked  # imports triton

    launch_moe_experts_masked(x, counts, w13, w2, h, y, int(max_rows), (act, limit, gate_cap, up_cap), wrap=wrap)
    return y


register(ops.moe_experts_masked, moe_experts_masked_kernel, supports=check_moe_experts_masked_call)

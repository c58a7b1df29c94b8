"""Kernel variants that have run under the Triton interpreter but not yet on a GPU.

On CUDA the Triton provider declines them (the call keeps the reference, which Inductor compiles) until
``tests/gpu/`` has checked them on a GPU and they are removed from :data:`UNVERIFIED_ON_GPU`;
``EP_FUSE_UNVERIFIED_KERNELS=1`` enables them anyway (what the GPU checks set).
"""

from __future__ import annotations

import os
from typing import Any

UNVERIFIED_ON_GPU: dict[str, str] = {
    "moe_gating:topk_softmax": "tests/gpu/test_gpu_forms.py::test_router_forms_match_the_stable_reference",
    "moe_gating:topk_sigmoid": "tests/gpu/test_gpu_forms.py::test_router_forms_match_the_stable_reference",
    "moe_gating:sum_top2_fill0": "tests/gpu/test_gpu_forms.py::test_router_forms_match_the_stable_reference",
    "moe_gating:renorm_clamp": "tests/gpu/test_gpu_forms.py::test_router_forms_match_the_stable_reference",
    "rope:rotate_pairs": "tests/gpu/test_gpu_forms.py::test_rotate_pairs_rope_is_bitwise_the_reference",
    "grouped_gemm:tma": "tests/gpu/test_gpu_grouped_gemm_tma.py",
    "fp8:triton": "tests/gpu/test_gpu_fp8.py",
}
"""``"<op>:<variant>" -> the GPU check that clears it``."""

ENV = "EP_FUSE_UNVERIFIED_KERNELS"


def cleared(variant: str) -> bool:
    """Whether ``variant`` may run on CUDA: it has passed its GPU check, or ``EP_FUSE_UNVERIFIED_KERNELS=1``."""
    return variant not in UNVERIFIED_ON_GPU or os.environ.get(ENV) == "1"


def gpu_unverified(variant: str, t: Any) -> str | None:
    """Why the kernel variant ``variant`` is declined for tensor ``t`` (``None`` when it may run)."""
    if t.device.type != "cuda" or cleared(variant):
        return None
    return f"{variant}: this kernel variant has not run on a GPU yet ({UNVERIFIED_ON_GPU[variant]}; {ENV}=1 enables it)"

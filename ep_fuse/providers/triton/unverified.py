"""Kernel variants that are not yet cleared for GPUs: not checked on one, or checked but not measured faster.

On CUDA the Triton provider declines them (the call keeps the reference, which Inductor compiles) until
``tests/gpu/`` has checked them on a GPU (and, for a variant chosen for speed, a bench has measured it) and
they are removed from :data:`UNVERIFIED_ON_GPU`; the config's ``unverified_kernels=True`` (default from
``EP_FUSE_UNVERIFIED_KERNELS=1``, what the GPU checks set) enables them anyway.
"""

from __future__ import annotations

from typing import Any

from ep_fuse import runtime

UNVERIFIED_ON_GPU: dict[str, str] = {
}
"""``"<op>:<variant>" -> what it still lacks``. Cleared after their ``tests/gpu/`` checks passed on a GPU
(``docs/benchmarks.md`` says when and where): the GeGLU epilogues (``grouped_gemm_swiglu`` and
``moe_experts_masked`` ``:gelu_tanh`` / ``:gelu``, ``tests/gpu/test_gpu_moe_forms.py``, 2026-12-03), the router forms (``moe_gating:topk_softmax/topk_sigmoid/sum_top2_fill0/renorm_clamp``,
``tests/gpu/test_gpu_forms.py``), ``rope:rotate_pairs`` (same file), ``fp8:triton``
(``tests/gpu/test_gpu_fp8.py``), ``grouped_gemm:tma`` (``tests/gpu/test_gpu_moe_grouped_gemm_tma.py``, then
measured faster than ``torch._grouped_mm`` by ``bench/bench_moe_grouped_gemm_tma.py``), ``ep:fp8_dispatch``
(``tests/gpu/test_gpu_fp8_dispatch.py``: 2 NCCL ranks, bit-identical to the bf16 dispatch) and ``fp8:tma``
(``tests/gpu/test_gpu_fp8.py``, then measured faster than the one-tile-per-program FP8 kernel by
``bench/bench_fp8.py --tma``), ``fp8:deepgemm`` (the DeepGEMM provider,
``tests/gpu/test_gpu_deepgemm.py``, then measured faster than the Triton FP8 kernels from 64 rows per
expert by ``bench/bench_fp8.py --deepgemm``), and the forms of the MoE decoders transformers 5.24 added:
``rope:rotate_pairs_fp32`` (``tests/gpu/test_gpu_norm_rope_forms.py``), ``moe_gating:sqrt_softplus/topk_bias/
expert_scale/softmax_sum_top2_fill0`` (``tests/gpu/test_gpu_moe_gating_forms.py``) and
``grouped_gemm_swiglu:silu_clamp/silu_clamp_post/silu_fp32/softcap_fp32`` (``tests/gpu/test_gpu_moe_forms.py``),
``moe_experts_masked:triton`` (the masked expert layout's grouped GEMMs, ``tests/gpu/test_gpu_moe_masked.py``, then
measured faster than the permute over padding by ``bench/bench_moe_experts.py --masked``), and the forms of issue 35's
second round: ``grouped_gemm_swiglu:relu2/swigluoai`` (``tests/gpu/test_gpu_moe_forms.py``), ``moe_gating:nd_logits``
and ``moe_gating_sink:triton`` (``tests/gpu/test_gpu_moe_gating_forms.py``), and ``varlen_attention:flash``
(``tests/gpu/test_gpu_varlen_attention.py``, then measured faster than HF's masked SDPA and Inductor's compile of
the reference by ``bench/bench_varlen_attention.py``), and issue 45's rounded RMSNorm forms:
``rms_norm:none_rstd_cast``, ``add_rms_norm:none_rstd_cast`` and ``add_rms_norm:norm_dtype``
(``tests/gpu/test_gpu_norm_rope_forms.py``, 2026-12-03; ``norm_dtype`` then timed by ``bench/bench_rms_norm.py
--norm-dtype``: 1.01-1.05x Inductor where the add+RMSNorm size rule takes the kernel). A new variant is added here until its GPU
check has run."""

ENV = "EP_FUSE_UNVERIFIED_KERNELS"
"""The environment variable that sets the default of the config's ``unverified_kernels``."""


def cleared(variant: str) -> bool:
    """Whether ``variant`` may run on CUDA: it has passed its GPU check, or the active config's
    ``unverified_kernels`` is on (``EP_FUSE_UNVERIFIED_KERNELS=1``)."""
    return variant not in UNVERIFIED_ON_GPU or runtime.active_config().unverified_kernels


def gpu_unverified(variant: str, t: Any) -> str | None:
    """Why the kernel variant ``variant`` is declined for tensor ``t`` (``None`` when it may run)."""
    if t.device.type != "cuda" or cleared(variant):
        return None
    return (f"{variant}: this kernel variant is not cleared for GPUs yet ({UNVERIFIED_ON_GPU[variant]}; "
            f"unverified_kernels=True or {ENV}=1 enables it)")

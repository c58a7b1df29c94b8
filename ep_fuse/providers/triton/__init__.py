"""Triton provider: CUDA GPUs, or the CPU under ``TRITON_INTERPRET=1`` (set before the first launch).

One module per op family (``rms_norm``, ``rope``, ``gemm_swiglu``, ``moe``, ``moe_gating``, ``moe_masked``, ``w8a8``,
``fp8``)
holds the host code, argument checks, perf rules and registration of that family's ops (:mod:`.provider` is the
shared registration machinery); ``*_kernel.py`` modules hold the ``@triton.jit`` kernels and are imported on
first launch, so importing the provider needs no Triton. Nothing here is imported for its side effects:
:mod:`ep_fuse.catalog` imports the family modules.
"""

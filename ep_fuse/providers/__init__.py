"""Fused providers of the canonical ops: Triton (CUDA, or CPU under ``TRITON_INTERPRET=1``), Ascend torch_npu, and
DeepGEMM (optional, Hopper FP8 expert GEMMs). Each provider's family modules register from their own module;
:mod:`ep_fuse.catalog` imports them (nothing here is imported for its side effects)."""

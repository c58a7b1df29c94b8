"""Fused providers of the canonical ops: Triton (CUDA, or CPU under ``TRITON_INTERPRET=1``), Ascend torch_npu, and
DeepGEMM (optional, Hopper FP8 expert GEMMs)."""

from ep_fuse.providers import deepgemm, npu, triton  # noqa: F401  (registration side effects)

"""Fused providers of the canonical ops: Triton (CUDA, or CPU under ``TRITON_INTERPRET=1``) and Ascend torch_npu."""

from ep_fuse.providers import npu, triton  # noqa: F401  (registration side effects)

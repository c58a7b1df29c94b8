"""PyTorch's own FlashAttention-2 kernels (``aten._flash_attention_forward``, CUDA): the varlen attention of
continuous batching (:mod:`.varlen_attention`). Nothing to build or install: the kernels ship in PyTorch's CUDA wheels."""

"""One GPU: the flash provider of ``varlen_attention`` (PyTorch's FlashAttention-2 varlen kernel) against the
reference, over continuous batching's batch forms (decode steps, prefill chunks over a cached past, new prompts,
CUDA-graph padding: empty sequences and rows past the last one), grouped-query heads and head dims."""

import itertools

import pytest
import torch

from ep_fuse.ops.registry import choose
from ep_fuse.ops.varlen_attention import VARLEN_ATTENTION, varlen_attention_ref
from ep_fuse.providers.flash import varlen_attention as flash

BF16 = torch.bfloat16


def _cu(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")


BATCHES = {
    "decode_64": ([1] * 64, [100 + 11 * i for i in range(64)]),
    "prefill_chunk_and_decodes": ([256] + [1] * 15, [300] + [40 * i for i in range(15)]),
    "new_prompts": ([17, 3, 120, 64], [0, 0, 0, 0]),
    "padded_for_cuda_graphs": ([5, 1, 0, 0], [9, 30, 0, 0]),
}


@pytest.mark.parametrize("heads", [(32, 8, 128), (32, 4, 128), (16, 16, 64), (8, 1, 256)], ids=str)
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_flash_varlen_equals_reference(heads, batch, dtype, monkeypatch):
    monkeypatch.setenv("EP_FUSE_UNVERIFIED_KERNELS", "1")
    hq, hk, d = heads
    lq, past = BATCHES[batch]
    lk = [a + b for a, b in zip(lq, past)]
    pad_q, pad_k = (7, 13) if batch.startswith("padded") else (0, 0)
    g = torch.Generator(device="cuda").manual_seed(sum(lk))
    q = torch.randn(sum(lq) + pad_q, hq, d, device="cuda", generator=g, dtype=dtype)
    k = torch.randn(sum(lk) + pad_k, hk, d, device="cuda", generator=g, dtype=dtype)
    v = torch.randn(sum(lk) + pad_k, hk, d, device="cuda", generator=g, dtype=dtype)
    args = (q, k, v, _cu(lq), _cu(lk), q.shape[0], k.shape[0], d ** -0.5)
    assert flash.supports(args) is None
    assert choose(VARLEN_ATTENTION, args, "cuda").provider == "flash"
    got = flash.varlen_attention_flash(*args)
    want = varlen_attention_ref(*args)
    assert got.shape == want.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(got[sum(lq):], torch.zeros_like(got[sum(lq):]))
    # the guarded provider op (what a lowered graph calls) gives the same
    torch.testing.assert_close(VARLEN_ATTENTION.providers["flash"].op(*args), got, rtol=0, atol=0)


def test_flash_runs_under_a_cuda_graph(monkeypatch):
    """HF captures the padded forward in a CUDA graph: the kernel reads the lengths from device memory, so a
    replay with new lengths in the same buffers gives the new batch's attention."""
    monkeypatch.setenv("EP_FUSE_UNVERIFIED_KERNELS", "1")
    hq, hk, d, rows, keys = 32, 8, 128, 64, 2048
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(rows, hq, d, device="cuda", generator=g, dtype=BF16)
    k = torch.randn(keys, hk, d, device="cuda", generator=g, dtype=BF16)
    v = torch.randn(keys, hk, d, device="cuda", generator=g, dtype=BF16)
    cu_q, cu_k = torch.zeros(9, dtype=torch.int32, device="cuda"), torch.zeros(9, dtype=torch.int32, device="cuda")
    cu_q.copy_(_cu([1] * 8))
    cu_k.copy_(_cu([200] * 8))
    args = (q, k, v, cu_q, cu_k, rows, keys, d ** -0.5)
    flash.varlen_attention_flash(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash.varlen_attention_flash(*args)
    for lq, lk in (([4, 1, 1, 30, 1, 1, 0, 0], [40, 90, 1, 500, 7, 8, 0, 0]), ([1] * 8, [255] * 8)):
        cu_q.copy_(_cu(lq))
        cu_k.copy_(_cu(lk))
        graph.replay()
        torch.testing.assert_close(out.float(), varlen_attention_ref(*args).float(), rtol=2e-2, atol=2e-2)

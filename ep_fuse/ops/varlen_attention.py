"""The varlen attention family: ``ep_fuse::varlen_attention``, causal attention over packed sequences.

The queries of ``B`` sequences are packed along dim 0 (``q[cu_q[b]:cu_q[b+1]]`` is sequence ``b``), and so are
their keys and values (``k[cu_k[b]:cu_k[b+1]]``). Query ``i`` of a sequence of ``lq`` queries and ``lk`` keys sees
keys ``0 .. i + lk - lq`` of its own sequence (causal, aligned at the end: the queries are the sequence's last
``lq`` tokens, its earlier keys come from the cache). Rows of ``q`` past ``cu_q[-1]`` (padding) are zeros. Grouped
queries: query head ``h`` reads key/value head ``h // (Hq // Hkv)``.

This is the attention of HF continuous batching, where a batch is every scheduled request's new tokens packed
into one row and HF's SDPA path builds a dense ``[tokens, keys read]`` mask for it
(:mod:`ep_fuse.hf.varlen_attention` calls this op instead). The reference is that masked SDPA, in fp32. Where no
provider takes a call it stays the opaque op (its kernel the reference) instead of being inlined: traced on fake
CUDA tensors at symbolic sizes, SDPA's mask padding for its memory-efficient kernel does not trace.
"""

from __future__ import annotations

import torch

from ep_fuse.ops.registry import define_canonical, never_traceable


def sequence_ids(cu: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For ``rows`` packed rows: each row's sequence (clamped to the last), its position in it, and whether it
    belongs to a sequence at all (rows past ``cu[-1]`` do not); ``cu`` may hold empty sequences (equal steps)."""
    cu = cu.to(torch.int64)
    idx = torch.arange(rows, device=cu.device)
    # the number of sequences ending at or before each row (a compare-and-sum rather than searchsorted over
    # cu[1:], which Inductor's CUDA lowering of a sliced boundary tensor does not take)
    seq = (idx[:, None] >= cu[None, 1:]).sum(-1).clamp(max=cu.numel() - 2)
    return seq, idx - cu[seq], idx < cu[-1]


def varlen_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                         max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """``q`` [T, Hq, D], ``k`` [N, Hkv, D], ``v`` [N, Hkv, Dv], ``cu_q``/``cu_k`` [B + 1] -> [T, Hq, Dv] in
    ``q``'s dtype (``max_q``/``max_k``: the longest sequence, for kernels that size their grid by it)."""
    t, n = q.shape[0], k.shape[0]
    sq, pq, valid_q = sequence_ids(cu_q, t)
    sk, pk, valid_k = sequence_ids(cu_k, n)
    cu_q64, cu_k64 = cu_q.to(torch.int64), cu_k.to(torch.int64)
    past = (cu_k64[1:] - cu_k64[:-1]) - (cu_q64[1:] - cu_q64[:-1])
    allowed = ((sq[:, None] == sk[None, :]) & valid_q[:, None] & valid_k[None, :]
               & (pk[None, :] <= pq[:, None] + past[sq][:, None]))
    qf, kf, vf = (x.to(torch.float32).transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        kf, vf = kf.repeat_interleave(groups, dim=1), vf.repeat_interleave(groups, dim=1)
    # a row with no allowed key (padding) gives NaN here and is zeroed below
    out = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, attn_mask=allowed, scale=scale)
    out = out.squeeze(0).transpose(0, 1)
    return torch.where(valid_q[:, None, None], out, 0.0).to(q.dtype)


def _fake(q, k, v, cu_q, cu_k, max_q, max_k, scale):  # noqa: ANN001, ANN202
    return q.new_empty((q.shape[0], q.shape[1], v.shape[-1]))


VARLEN_ATTENTION = define_canonical(
    "varlen_attention",
    "(Tensor q, Tensor k, Tensor v, Tensor cu_q, Tensor cu_k, SymInt max_q, SymInt max_k, float scale) -> Tensor",
    varlen_attention_ref, fake=_fake, traceable=never_traceable)
varlen_attention = VARLEN_ATTENTION.op

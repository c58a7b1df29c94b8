"""GPU check of dropped zero-weight slots (``ep_fuse.passes.moe_zero_slots``): LongCat-Flash's remap (transformers
5.25) in front of the routed-expert block, compiled with the Triton providers, vs the block on every slot (eager)."""

from __future__ import annotations

import pytest
import torch

import ep_fuse
from ep_fuse.ops.moe import moe_experts_ref  # (and registers ep_fuse::moe_experts)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

E, Z, K, H, I = 16, 8, 4, 512, 256


def _remapped(x, ids, w, w13, w2):
    mask = ids >= E
    ids = torch.where(mask, (ids - E) * E // Z, ids)
    return torch.ops.ep_fuse.moe_experts(x, ids, w.masked_fill(mask, 0.0), w13, w2, x.dtype)


@pytest.mark.parametrize("tokens", [3, 300])
def test_remapped_slots_dropped_on_cuda_equal_eager(tokens):
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.rand(tokens, E + Z, generator=g, device="cuda").topk(K, dim=-1).indices
    w = torch.rand(tokens, K, generator=g, device="cuda")
    x = torch.randn(tokens, H, generator=g, device="cuda").to(torch.bfloat16)
    w13 = (torch.randn(E, 2 * I, H, generator=g, device="cuda") / H**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g, device="cuda") / I**0.5).to(torch.bfloat16)
    mask = ids >= E  # the reference computes every slot, the remapped ones with weight 0
    ref = moe_experts_ref(x, torch.where(mask, (ids - E) * E // Z, ids), w.masked_fill(mask, 0.0), w13, w2, x.dtype)
    with torch.no_grad():
        out = torch.compile(_remapped, backend="ep_fuse")(x, ids, w, w13, w2)
    rep = ep_fuse.last_report()
    assert next(p.changes for p in rep.passes if p.name == "drop_zero_slots") == 1
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.float().abs().max().item())

"""The GQA pass on CUDA: tiny HF models in bf16 at one token, without a cache (HF's mask folded away) and over a
static cache (its mask kept, one row shared by the heads), run SDPA on the un-repeated K/V with the query heads as
rows. The fused kernels take the packed shapes (a bias broadcast to every packed head), every layer packs, and the
logits match the compile with the pass off within bf16 noise."""

from __future__ import annotations

import pytest
import torch

import ep_fuse
from ep_fuse.testing import tiny as tiny_models

EFFICIENT = "aten._scaled_dot_product_efficient_attention.default"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _compiled(model, inputs_fn, pack: bool):
    torch._dynamo.reset()
    ep_fuse.reset_reports()
    with torch.no_grad():
        out = torch.compile(model, backend="ep_fuse", options={"pack_gqa": pack})(**inputs_fn()).logits
    return out, ep_fuse.last_report()


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_one_token_packs_on_cuda(name):
    model = tiny_models.build(name, dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(0, model.config.vocab_size, (8, 1), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(0))
    inputs = lambda: {"input_ids": ids, "use_cache": False}  # noqa: E731
    with torch.no_grad():
        fp32 = model.float()(**inputs()).logits
        model.bfloat16()
    packed, report = _compiled(model, inputs, True)
    kept, _ = _compiled(model, inputs, False)
    layers = model.config.num_hidden_layers
    g = model.config.num_attention_heads // model.config.num_key_value_heads
    assert list(report.attention_gqa.values()) == [f"packed G={g}"] * layers, report.attention_gqa
    assert report.ops_after.get(EFFICIENT, 0) + report.ops_after.get(
        "aten._scaled_dot_product_flash_attention.default", 0) == layers
    assert _rel(packed, fp32) <= 1.25 * _rel(kept, fp32) + 1e-3


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_decode_over_a_static_cache_packs_with_its_mask(name):
    """A decode step over a static cache: HF's mask reads the cache position (kept by the mask pass) and is
    one row per sequence; the efficient kernel runs with it broadcast to the packed heads."""
    from transformers import StaticCache

    model = tiny_models.build(name, dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (4, 11), device="cuda", generator=gen)
    token = torch.randint(0, model.config.vocab_size, (4, 1), device="cuda", generator=gen)

    def step() -> dict:
        cache = StaticCache(config=model.config, max_cache_len=64)
        with torch.no_grad():
            model(input_ids=prompt, past_key_values=cache, use_cache=True)
        return {"input_ids": token, "past_key_values": cache, "use_cache": True,
                "cache_position": torch.tensor([11], device="cuda")}

    with torch.no_grad():
        ref = model(**step()).logits
    packed, report = _compiled(model, step, True)
    kept, _ = _compiled(model, step, False)
    layers = model.config.num_hidden_layers
    sdpa = {op: n for op, n in report.ops_after.items() if "scaled_dot_product" in op}
    assert [r for r in report.attention_gqa.values() if r.startswith("packed")] == \
        [f"packed G={model.config.num_attention_heads // model.config.num_key_value_heads}"] * layers, \
        (report.attention_gqa, report.attention_masks, sdpa)
    assert all(r.startswith("kept") for r in report.attention_masks.values())
    assert sum(sdpa.values()) == layers
    assert _rel(packed, kept) <= 1e-2 and _rel(packed, ref) <= 1.25 * _rel(kept, ref) + 1e-3

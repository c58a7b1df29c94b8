"""The attention-mask pass on CUDA: tiny HF models in bf16 trace SDPA as cuDNN / memory-efficient attention with
HF's mask as ``attn_bias``; compiled, every layer's mask is folded (``is_causal`` at prefill, dropped for one-token
forwards) and the logits stay as close to eager as with the mask kept."""

from __future__ import annotations

import pytest
import torch

import ep_fuse
from ep_fuse.testing import tiny as tiny_models

CUDA_SDPA = ("aten._scaled_dot_product_cudnn_attention.default", "aten._scaled_dot_product_efficient_attention.default",
             "aten._scaled_dot_product_flash_attention.default")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("shape", [(2, 64), (8, 1)], ids=["prefill", "one_token"])
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_masks_fold_on_cuda(name, shape):
    model = tiny_models.build(name, dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(0, model.config.vocab_size, shape, device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(0))
    inputs = {"input_ids": ids, "use_cache": False}
    with torch.no_grad():
        ref = model(**inputs).logits
        fp32 = model.float()(**inputs).logits
        model.bfloat16()
        outs, reports = {}, {}
        for fold in (True, False):
            torch._dynamo.reset()
            ep_fuse.reset_reports()
            compiled = torch.compile(model, backend="ep_fuse", options={"fold_attention_masks": fold})
            outs[fold] = compiled(**inputs).logits
            reports[fold] = ep_fuse.last_report()
    layers = model.config.num_hidden_layers
    want = "is_causal" if shape[1] > 1 else "no mask"
    assert list(reports[True].attention_masks.values()) == [want] * layers, reports[True].attention_masks
    assert sum(reports[True].ops_after.get(op, 0) for op in CUDA_SDPA) == layers
    # as close to fp32 as eager and the compiled model with its mask kept are (bf16 rounding elsewhere dominates)
    assert _rel(outs[True], fp32) <= 1.25 * max(_rel(ref, fp32), _rel(outs[False], fp32)) + 1e-3

"""Real-sized Hugging Face MoE models with random weights (built from configs; nothing is downloaded).

Shared by the serving-loop benchmarks (``bench_generate.py``, ``accuracy_decode.py``, ``bench_ep.py``).
Layer shapes are the published ones; only the layer count is cut:

* ``qwen3_30b_a3b``: Qwen3-30B-A3B, 4 layers (H2048, 32/4 heads x 128, 128 experts top-8, I768);
* ``mixtral_8x7b``: Mixtral-8x7B, 2 layers (H4096, 32/8 heads x 128, 8 experts top-2, I14336);
* ``deepseek_v3``: DeepSeek-V3, a dense layer + a MoE layer (H7168, MLA, 256 experts top-8, I2048,
  one shared expert, group-limited routing 8/4).
"""

from __future__ import annotations

from typing import Any

import torch

MODELS = ("qwen3_30b_a3b", "mixtral_8x7b", "deepseek_v3")


def config(name: str, layers: int | None = None) -> Any:
    import transformers as tf

    if name == "qwen3_30b_a3b":
        return tf.Qwen3MoeConfig(
            vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
            num_hidden_layers=layers or 4, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
            num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=4096,
            rms_norm_eps=1e-6, tie_word_embeddings=False)
    if name == "mixtral_8x7b":
        return tf.MixtralConfig(
            vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers or 2,
            num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
            max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)
    if name == "deepseek_v3":
        return tf.DeepseekV3Config(
            vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
            num_hidden_layers=layers or 2, first_k_dense_replace=1, num_attention_heads=128,
            num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256, num_experts_per_tok=8,
            routed_scaling_factor=2.5, n_group=8, topk_group=4, norm_topk_prob=True, q_lora_rank=1536,
            kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
            max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False)
    raise ValueError(f"unknown model {name!r}; one of {MODELS}")


def build(name: str, device: str = "cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 0,
          layers: int | None = None) -> Any:
    """The model in eval mode on ``device``, HF's random init, ``ep_fuse.prepare``-d (one traceable graph)."""
    import transformers as tf

    import ep_fuse

    torch.manual_seed(seed)
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(config(name, layers), dtype=dtype)
    model.eval()
    model.generation_config.pad_token_id = 0
    return ep_fuse.prepare(model)

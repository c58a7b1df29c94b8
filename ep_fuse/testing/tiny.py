"""Tiny Hugging Face MoE models built from configs with random weights (nothing is downloaded).

Used by the example, the tests and the debug tools. Each has 2 decoder layers (NemotronH: 4 single-mixer layers),
hidden 64, 4 heads (2 KV heads), top-2 routing and a vocabulary of 128.
"""

from __future__ import annotations

from typing import Any

import torch

from ep_fuse.surgery.prepare import prepare

TINY_MODELS = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "deepseek_v2", "glm4_moe", "gpt_oss", "llama4",
               "granitemoe", "granitemoeshared", "cohere2_moe", "nemotron_h")

EXPECTED_SITES = {
    # name: fused sites per pattern in the one inference graph of the 2-layer model, and the RoPE form
    "mixtral": ({"add_rms_norm": 4, "rms_norm": 1, "rope": 4, "moe_experts": 2, "moe_gating": 2}, "half"),
    "qwen2_moe": ({"add_rms_norm": 4, "rms_norm": 1, "rope": 4, "gemm_swiglu": 2, "moe_experts": 2, "moe_gating": 2}, "half"),  # shared experts
    "qwen3_moe": ({"add_rms_norm": 4, "rms_norm": 5, "rope": 4, "moe_experts": 2, "moe_gating": 2}, "half"),  # + q/k-norm over head_dim
    # + q_a/kv_a norms; SwiGLU: the dense MLP of layer 0 and the shared expert of layer 1
    "deepseek_v3": ({"add_rms_norm": 4, "rms_norm": 5, "rope": 4, "gemm_swiglu": 2, "moe_experts": 1, "moe_gating": 1}, "deinterleave"),
    "deepseek_v2": ({"add_rms_norm": 4, "rms_norm": 5, "rope": 4, "gemm_swiglu": 2, "moe_experts": 1, "moe_gating": 1}, "complex"),
    "glm4_moe": ({"add_rms_norm": 4, "rms_norm": 5, "rope": 4, "gemm_swiglu": 2, "moe_experts": 1, "moe_gating": 1}, "partial"),  # + q/k-norm
    # its GLU is not SwiGLU; its routers take a bf16 softmax of the top-k values (moe_gating with score_dtype=bf16)
    "gpt_oss": ({"add_rms_norm": 4, "rms_norm": 1, "rope": 4, "moe_gating": 2}, "chunk"),
    "llama4": ({"add_rms_norm": 4, "rms_norm": 5, "rope": 4, "gemm_swiglu": 2}, "complex"),  # + L2 q/k-norm
    # router: top-k of the logits, softmax of the K values
    "granitemoe": ({"add_rms_norm": 4, "rms_norm": 1, "rope": 4, "moe_experts": 2, "moe_gating": 2}, "half"),
    # + shared MLP: one gate|up projection of the 3-D input, chunked
    "granitemoeshared": ({"add_rms_norm": 4, "rms_norm": 1, "rope": 4, "gemm_swiglu": 2, "moe_experts": 2,
                          "moe_gating": 2}, "half"),
    # parallel attention + MoE on one input norm per layer; GPT-J pairs (HF rotate_half), bf16 router logits
    "cohere2_moe": ({"add_rms_norm": 2, "rms_norm": 1, "rope": 4, "gemm_swiglu": 2, "moe_experts": 2,
                     "moe_gating": 2}, "rotate_pairs"),
    # attention / MoE / attention / MoE blocks (one mixer per layer), no RoPE; non-gated relu(up) ** 2 experts,
    # sigmoid router with one group; the shared expert is non-gated too (no gemm_swiglu)
    "nemotron_h": ({"add_rms_norm": 4, "rms_norm": 1, "moe_experts": 2, "moe_gating": 2}, None),
}
"""Each layer's q and k RoPE sites are paired into one ``rope_qk`` call (2 per model). ``moe_experts``:
one block per MoE layer (DeepSeek/GLM4 layer 0 is dense); GPT-OSS's clamped GLU experts and Llama4's
dense all-experts ``bmm`` are not this block (``NOT_MOE_BLOCKS``). The RoPE form is ``None`` for a model
without RoPE."""

NOT_MOE_BLOCKS = {"gpt_oss": 2}
"""Models whose expert blocks are candidates (a ``sort`` of routed ids) that must not match: near misses, at the
``sort`` and as ``routed experts`` (``ep_fuse/passes/moe_probe.py``), one of each per MoE layer."""

DECLINED_ROUTERS = {"llama4": 2}
"""Models whose routers are candidates declined on purpose (near misses at their ``topk``): Llama-4's dense [T, E]
scores are a form recognised to say why it is not fused (``moe_gating[dense_topk_sigmoid]``). (GPT-OSS's bf16
softmax of its top-k values fuses with ``score_dtype=bf16``; the fused providers decline that, the reference runs.)"""


def _config(name: str, **overrides: Any) -> Any:
    import transformers as tf  # optional dependency

    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)
    if name == "mixtral":
        cfg = tf.MixtralConfig(**common, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2)
    elif name == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(**common, intermediate_size=96, moe_intermediate_size=48,
                                shared_expert_intermediate_size=96, num_experts=8, num_experts_per_tok=2)
    elif name == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**common, head_dim=16, intermediate_size=96, moe_intermediate_size=48,
                                num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
    elif name == "deepseek_v3":
        common["num_key_value_heads"] = common["num_attention_heads"]  # MLA: no grouped KV heads
        cfg = tf.DeepseekV3Config(**common, intermediate_size=96, moe_intermediate_size=48, n_routed_experts=8,
                                  n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                                  first_k_dense_replace=1, q_lora_rank=48, kv_lora_rank=32,
                                  qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16)
    elif name == "deepseek_v2":
        common["num_key_value_heads"] = common["num_attention_heads"]
        cfg = tf.DeepseekV2Config(**common, intermediate_size=96, moe_intermediate_size=48, n_routed_experts=8,
                                  n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                                  first_k_dense_replace=1, q_lora_rank=48, kv_lora_rank=32,
                                  qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16)
    elif name == "glm4_moe":
        cfg = tf.Glm4MoeConfig(**common, head_dim=16, intermediate_size=96, moe_intermediate_size=48,
                               n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
                               topk_group=1, first_k_dense_replace=1, partial_rotary_factor=0.5, use_qk_norm=True)
    elif name == "gpt_oss":
        cfg = tf.GptOssConfig(**common, head_dim=16, intermediate_size=96, num_local_experts=4,
                              num_experts_per_tok=2, layer_types=["full_attention", "full_attention"])
    elif name == "llama4":
        cfg = tf.Llama4TextConfig(**common, head_dim=16, intermediate_size=96, intermediate_size_mlp=96,
                                  num_local_experts=4, num_experts_per_tok=1)
    elif name == "granitemoe":
        cfg = tf.GraniteMoeConfig(**common, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)
    elif name == "granitemoeshared":
        cfg = tf.GraniteMoeSharedConfig(**common, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                                        shared_intermediate_size=64)
    elif name == "cohere2_moe":
        cfg = tf.Cohere2MoeConfig(**common, head_dim=16, intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                                  num_shared_experts=1)
    elif name == "nemotron_h":  # one mixer per layer: 4 layers make 2 attention + 2 MoE blocks
        common["num_hidden_layers"] = 4
        cfg = tf.NemotronHConfig(**common, head_dim=16, intermediate_size=96, moe_intermediate_size=48,
                                 moe_shared_expert_intermediate_size=48, n_routed_experts=8, num_experts_per_tok=2,
                                 n_group=1, topk_group=1,
                                 layers_block_type=["full_attention", "moe", "full_attention", "moe"])
        cfg.layer_norm_epsilon = common["rms_norm_eps"]
    else:
        raise ValueError(f"unknown tiny model {name!r}; choose one of {', '.join(TINY_MODELS)}")
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def build(
    name: str,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    seed: int = 0,
    experts_implementation: str = "grouped_mm",
    **config_overrides: Any,
) -> torch.nn.Module:
    """A tiny causal-LM ``name`` in eval mode with seeded random weights."""
    import transformers as tf  # optional dependency

    cls = {
        "mixtral": tf.MixtralForCausalLM,
        "qwen2_moe": tf.Qwen2MoeForCausalLM,
        "qwen3_moe": tf.Qwen3MoeForCausalLM,
        "deepseek_v3": tf.DeepseekV3ForCausalLM,
        "deepseek_v2": tf.DeepseekV2ForCausalLM,
        "glm4_moe": tf.Glm4MoeForCausalLM,
        "gpt_oss": tf.GptOssForCausalLM,
        "llama4": tf.Llama4ForCausalLM,
        "granitemoe": tf.GraniteMoeForCausalLM,
        "granitemoeshared": tf.GraniteMoeSharedForCausalLM,
        "cohere2_moe": tf.Cohere2MoeForCausalLM,
        "nemotron_h": tf.NemotronHForCausalLM,
    }[name]
    torch.manual_seed(seed)
    attn = "eager" if name == "gpt_oss" else "sdpa"  # GPT-OSS's sinks need eager attention
    model = cls._from_config(_config(name, **config_overrides), dtype=dtype, attn_implementation=attn)
    prepare(model, experts_implementation)
    return model.to(device).eval()


def qwen2_moe_sized(
    hidden: int = 72,
    head_dim: int = 12,
    heads: int = 6,
    kv_heads: int = 2,
    experts: int = 60,
    top_k: int = 6,
    moe_intermediate: int = 24,
    shared_intermediate: int = 40,
    layers: int = 2,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> torch.nn.Module:
    """A Qwen2-MoE causal LM of the given sizes with seeded random weights (shared expert with a sigmoid
    gate, ``norm_topk_prob=False``), prepared for one graph (``grouped_mm`` experts).

    The defaults are a CPU-sized copy of an odd-sized model (hidden 2880, head_dim 80, 60 experts, top-6):
    widths that are not powers of two, many experts, a wide top-k. ``torch._grouped_mm`` needs rows of
    a multiple of 16 bytes, so ``hidden`` and ``moe_intermediate`` are multiples of 8 for bf16."""
    import transformers as tf  # optional dependency

    cfg = tf.Qwen2MoeConfig(vocab_size=128, hidden_size=hidden, head_dim=head_dim, num_attention_heads=heads,
                            num_key_value_heads=kv_heads, num_hidden_layers=layers, intermediate_size=4 * hidden,
                            moe_intermediate_size=moe_intermediate, shared_expert_intermediate_size=shared_intermediate,
                            num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=False,
                            max_position_embeddings=4096, rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    model = tf.Qwen2MoeForCausalLM._from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    prepare(model)
    return model.to(device).eval()


QWEN2_MOE_SITES = {"add_rms_norm": 2, "rms_norm": 1, "rope": 2, "gemm_swiglu": 1, "moe_experts": 1, "moe_gating": 1}
"""Fused sites per decoder layer of :func:`qwen2_moe_sized` (the final norm counted once)."""


def qwen2_moe_expected(layers: int) -> dict[str, int]:
    """Fused sites in one graph of a :func:`qwen2_moe_sized` model with ``layers`` layers."""
    return {k: (1 if k == "rms_norm" else v * layers) for k, v in QWEN2_MOE_SITES.items()}


def example_inputs(batch: int = 2, seq: int = 16, device: str | torch.device = "cpu", seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (batch, seq), generator=g).to(device)
    return {"input_ids": ids, "use_cache": False}

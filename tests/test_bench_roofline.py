"""``bench/roofline.py``: the floor of a forward (FLOPs and bytes per stage) and the stage of a profiled kernel."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parents[1] / "bench" / "roofline.py"


@pytest.fixture(scope="module")
def roofline():
    spec = importlib.util.spec_from_file_location("roofline_under_test", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("experts,k,tokens", [(8, 2, 1), (128, 8, 64), (256, 8, 2048), (64, 6, 3)])
def test_expected_experts_hit_matches_sampling(roofline, experts, k, tokens):
    g = torch.Generator().manual_seed(0)
    trials = 400
    hits = [torch.rand(tokens, experts, generator=g).topk(k, dim=-1).indices.unique().numel() for _ in range(trials)]
    assert roofline.expected_experts_hit(experts, k, tokens) == pytest.approx(sum(hits) / trials, rel=0.03)


def test_expected_experts_hit_bounds(roofline):
    assert roofline.expected_experts_hit(128, 8, 1) == pytest.approx(8)
    assert roofline.expected_experts_hit(128, 8, 10**6) == pytest.approx(128)


def _qwen3_moe_tiny():
    import transformers as tf

    cfg = tf.Qwen3MoeConfig(vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=8, num_experts_per_tok=2, tie_word_embeddings=False)
    return tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()


def test_forward_costs_count_each_parameter_once_per_stage(roofline):
    model = _qwen3_moe_tiny()
    batch, seq = 2, 5
    tokens = batch * seq
    c = roofline.forward_costs(model, batch, seq)
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    per_expert = sum(p.numel() for p in experts) // 2 // 8  # 2 layers of 8 experts
    hit = roofline.expected_experts_hit(8, 2, tokens)
    assert c["experts"].bytes == pytest.approx(2 * hit * per_expert * 2)
    assert c["experts"].flops == pytest.approx(2 * 2 * tokens * 2 * per_expert)
    assert c["lm_head"].bytes == 96 * 32 * 2 and c["lm_head"].flops == 2 * tokens * 96 * 32
    dense = [p for n, p in model.named_parameters()
             if p.dim() == 2 and ".experts." not in n and "embed" not in n and "lm_head" not in n]
    assert {n.rsplit(".", 2)[-2] for n, p in model.named_parameters()
            if p.dim() == 2 and ".experts." not in n and "embed" not in n and "lm_head" not in n} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate"}
    assert c["dense"].bytes == sum(p.numel() * 2 for p in dense)
    assert c["dense"].flops == 2 * tokens * sum(p.numel() for p in dense)
    # causal attention: per sequence and layer 2 * heads * S(S+1)/2 * (d_qk + d_v)
    assert c["attention"].flops == 2 * batch * 2 * 4 * (seq * (seq + 1) / 2) * 16
    assert c["other"].bytes == tokens * 32 * 2  # the embedding rows looked up


def test_floor_takes_the_binding_ceiling(roofline):
    cost = roofline.Cost(flops=790e12 * 1e-3, bytes=4275e9 * 2e-3)  # 1 ms of compute, 2 ms of bytes
    assert cost.floor_us(790, 4275) == pytest.approx(2000)
    assert cost.bound(790, 4275) == "memory"
    assert roofline.Cost(flops=790e12 * 3e-3).bound(790, 4275) == "compute"


def test_moe_layer_floor_turns_compute_bound_past_the_ridge(roofline):
    # Qwen3-30B-A3B-sized: 128 rows per expert at T2048 is under the ridge (790 / 4.275 ~ 185 FLOPs per byte, i.e.
    # rows per expert for bf16 weights), 512 at T8192 above it
    small, large = roofline.moe_layer_cost(2048, 2048, 768, 128, 8), roofline.moe_layer_cost(8192, 2048, 768, 128, 8)
    assert small.flops == 2 * 2048 * 8 * 3 * 2048 * 768
    weights = 3 * 2048 * 768 * 2 * roofline.expected_experts_hit(128, 8, 2048)
    assert small.bytes == pytest.approx(weights + 2 * (2 * 2048 * 2048 + 2 * 2048 * 8 * (2048 + 768)))
    assert small.bound(790, 4275) == "memory" and large.bound(790, 4275) == "compute"
    assert large.floor_us(790, 4275) == pytest.approx(large.flops / 790e12 * 1e6)


@pytest.mark.parametrize("name,stage", [
    ("_row_kernel", "norms/RoPE"),
    ("_grouped_gemm_tma_kernel_0", "experts"),
    ("_unpermute_kernel", "experts"),
    ("_gating_kernel", "router"),
    ("_gemm_swiglu_kernel", "dense"),
    ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNN", "dense"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8>", "dense"),
    ("triton_tem_fused_mm_4", "dense"),
    ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64>>", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norms/RoPE"),
    ("triton_poi_fused_cat_cos_mul_neg_sin_3", "norms/RoPE"),
    ("triton_per_fused__softmax_topk_2", "router"),
    ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>", "router"),
    ("triton_poi_fused_add_1", "other"),
    ("void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cutlass::gemm::GroupProblemShape<cute::tuple"
     "<int, int, int>>, cutlass::gemm::collective::CollectiveMma<cutlass::gemm::MainloopSm90ArrayTmaGmmaWarpSpecialized",
     "experts"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "other"),
])
def test_kernels_fall_into_their_stage(roofline, name, stage):
    assert roofline.KernelStages().classify(name) == stage


def test_the_last_dense_gemm_of_a_forward_is_the_lm_head(roofline):
    kernels = [("nvjet_a", 5.0), ("_row_kernel", 1.0), ("nvjet_b", 7.0), ("triton_poi_fused_add_1", 2.0),
               ("nvjet_c", 30.0), ("triton_poi_fused__to_copy_9", 3.0)]
    split = roofline.stage_split(kernels, roofline.KernelStages())
    assert split["lm_head"] == 30.0 and split["dense"] == 12.0
    assert split["norms/RoPE"] == 1.0 and split["other"] == 5.0
    assert sum(split.values()) == sum(us for _, us in kernels)


def test_expert_kernels_before_the_first_router_are_a_dense_layers(roofline):
    """DeepSeek-V3's dense layer 0 runs the TMA kernel of the grouped GEMMs: before any router, it is dense."""
    kernels = [("_row_kernel", 1.0), ("_grouped_gemm_tma_kernel", 40.0), ("_gating_kernel", 2.0),
               ("_grouped_gemm_tma_kernel", 50.0), ("nvjet_head", 9.0)]
    stages = roofline.KernelStages()
    assert roofline.stage_labels(kernels, stages) == ["norms/RoPE", "dense", "router", "experts", "lm_head"]
    split = roofline.stage_split(kernels, stages)
    assert split["dense"] == 40.0 and split["experts"] == 50.0 and split["lm_head"] == 9.0
    top = roofline.top_kernels(kernels, stages, n=2)
    assert top == [["experts", 50.0, "_grouped_gemm_tma_kernel"], ["dense", 40.0, "_grouped_gemm_tma_kernel"]]

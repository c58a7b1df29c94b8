"""Pinned results of the generality sweep (``tests/test_sweep.py``), measured with transformers 5.24.0 and torch
2.13 (CPU, fp32, eager executor, Triton providers under the interpreter).

``EXPECTED``: family -> minimum routed MoE blocks / ``moe_experts`` / ``moe_gating`` sites over all graphs of one
forward (more fusion passes; a loss fails), or ``"skip: <reason>"`` for a family that cannot be built tiny.
Regenerate from ``python tools/sweep_models.py --json PATH``; lower a pin only with the reason in the commit."""

EXPECTED: dict[str, dict[str, int | str] | str] = {
    'afmoe': {'moe_blocks': 1, 'moe_experts': 1, 'moe_gating': 1},
    'aria': {'moe_blocks': 2, 'moe_experts': 2, 'moe_gating': 2},
    'axk1': {'moe_blocks': 1, 'moe_experts': 1, 'moe_gating': 1},
    'axk2': {'moe_blocks': 1, 'moe_experts': 1, 'moe_gating': 1},
    'bailing_hybrid': {'moe_blocks': 2, 'moe_experts': 2, 'moe_gating': 2},
    'beam': {'moe_blocks': 2, 'moe_experts': 2, 'moe_gating': 2},
    'cohere2_moe': {'moe_blocks': 2, 'moe_experts': 2, 'moe_gating': 2},
    'dbrx': {'moe_blocks': 2, 'moe_experts': 0, 'moe_gating': 0},  # gating: / norm(v, p) renorm (near miss at linalg_vector_norm)
    'deepseek_v2': {'moe_blocks': 2, 'moe_experts': 2, 'moe_gating': 2},
    'deepseek_v3': {'moe_blocks': 1, 'moe_experts': 1, 'moe_gating': 1},
    'deepseek_v32': {'moe_blocks': 1, 'moe_experts': 1, 'moe_gating': 1},
    'deepseek_v4': {'moe_blocks': 3, 'moe_experts': 3, 'moe_gating': 2},  # gating: the 3rd is hash-routed (near miss hash_routed)
    'doge': {'moe_blocks': 0, 'moe_experts': 0, 'moe_gating': 0},
    'dots1': "skip: TypeError: unsupported operand type(s) for *: 'int' and 'NoneType'",
    'dots3_note': "skip: AmbiguousGlobalPerLayerAttributeError: 'num_attention_heads' is a per-layer attribute and may vary across layers. Access it via the individual layer c",
    'ernie4_5_moe': {'moe_blocks': 2, 'moe_experts': 2, 'moe_gating': 2},
    'exaone_moe': {'moe_blocks': 2, 'moe_experts': 2, 'moe_gating': 2},
    'flex_olmo': {'moe_blocks': 2, 'moe_experts': 2, 'moe_gating': 2},
    'flint': {'moe_blocks': 2, 'moe_experts': 2, 'moe_gating': 2},
    'gemma4': "skip: AmbiguousGlobalPerLayerAttributeError: 'head_dim' is a per-layer attribute and may vary across layers. Access it via the individual layer configs inst",
    'glm4_moe': {'moe_blocks': 1, 'moe_experts': 1, 'moe_gating': 1},
    'glm4_moe_lite': {'moe_blocks': 1, 'moe_experts': 1, 'moe_gating': 1},
    'glm_moe_dsa': {'moe_blocks': 1, 'moe_experts': 1, 'moe_gating': 1},
    'gpt_oss': {'moe_blocks': 2, 'moe_experts': 0, 'moe_gating': 2},
    'granitemoe': {'moe_blocks': 2, 'moe_experts': 2, 'moe_gating': 2},
    'granitemoe_swa': {'moe_blocks': 2, 'moe_experts': 2, 'moe_gating': 2},
    'granitemoehybrid': {'moe_blocks': 2, 'moe_experts': 2, 'moe_gating': 2},
    'granitemoeshared': {'moe_blocks': 2, 'moe_experts': 2, 'moe_gating': 2},
    'hunyuan_v1_moe': {'moe_blocks': 2, 'moe_experts': 2, 'moe_gating': 2},
    'hy_v3': {'moe_blocks': 1, 'moe_experts': 1, 'moe_gating': 1},
    'hy_v4': {'moe_blocks': 2, 'moe_experts': 2, 'moe_gating': 2},
    'inkling': {'moe_blocks': 2, 'moe_experts': 2, 'moe_gating': 2},
    'inkling2': {'moe_blocks': 2, 'moe_experts': 2, 'moe_gating': 2},
    'inkling2_loop': {'moe_blocks': 3, 'moe_experts': 4, 'moe_gating': 4},
    'jamba': {'moe_blocks': 2, 'moe_experts': 2, 'moe_gating': 2},
    'jetmoe': {'moe_blocks': 8, 'moe_experts': 0, 'moe_gating': 1},  # gating: 1 router frame run by all 4 routers
    'kimi_linear': {'moe_blocks': 2, 'moe_experts': 2, 'moe_gating': 2},
    'kolibri1': {'moe_blocks': 2, 'moe_experts': 2, 'moe_gating': 2},
    'laguna': {'moe_blocks': 1, 'moe_experts': 1, 'moe_gating': 1},
    'lara_mini': {'moe_blocks': 3, 'moe_experts': 3, 'moe_gating': 3},
    'lfm2_moe': {'moe_blocks': 2, 'moe_experts': 2, 'moe_gating': 2},
    'llama4': {'moe_blocks': 6, 'moe_experts': 0, 'moe_gating': 0},  # gating: dense [T, E] scores (dense_topk_sigmoid)
    'longcat_flash': {'moe_blocks': 1, 'moe_experts': 0, 'moe_gating': 1},
    'mellum': {'moe_blocks': 2, 'moe_experts': 2, 'moe_gating': 2},
    'mimo_v2_flash': {'moe_blocks': 2, 'moe_experts': 2, 'moe_gating': 2},
    'minimax': {'moe_blocks': 2, 'moe_experts': 2, 'moe_gating': 2},
    'minimax_m2': {'moe_blocks': 2, 'moe_experts': 2, 'moe_gating': 2},
    'minimax_m3_vl': {'moe_blocks': 2, 'moe_experts': 2, 'moe_gating': 2},
    'mistral4': {'moe_blocks': 2, 'moe_experts': 2, 'moe_gating': 2},
    'mixtral': {'moe_blocks': 2, 'moe_experts': 2, 'moe_gating': 2},
    'nemotron_h': {'moe_blocks': 1, 'moe_experts': 1, 'moe_gating': 1},
    'olmoe': {'moe_blocks': 2, 'moe_experts': 2, 'moe_gating': 2},
    'phimoe': {'moe_blocks': 2, 'moe_experts': 2, 'moe_gating': 0},  # gating: sparsemixer (near miss sparsemixer)
    'qwen2_moe': {'moe_blocks': 2, 'moe_experts': 2, 'moe_gating': 2},
    'qwen3_5_moe': {'moe_blocks': 2, 'moe_experts': 2, 'moe_gating': 2},
    'qwen3_moe': {'moe_blocks': 2, 'moe_experts': 2, 'moe_gating': 2},
    'qwen3_next': {'moe_blocks': 2, 'moe_experts': 2, 'moe_gating': 2},
    'qwen4_exp': "skip: TypeError: unsupported operand type(s) for //: 'NoneType' and 'NoneType'",
    'solar_open': {'moe_blocks': 2, 'moe_experts': 2, 'moe_gating': 2},
    'zaya': {'moe_blocks': 2, 'moe_experts': 2, 'moe_gating': 2},
}

FAST = ('afmoe', 'dbrx', 'deepseek_v3', 'gpt_oss', 'inkling2_loop', 'jetmoe', 'mixtral', 'qwen3_moe', 'qwen3_next', 'zaya')
"""Run by default (52 s of sweep time measured on 2 shared CPU cores, plus start-up); the other families are
``-m slow`` (deselect with ``-m "not slow"``)."""

INDUCTOR_EXECUTOR_CHECKS = ("inkling2_loop",)
"""Families compiled with ``executor="inductor"`` in bf16 by the tests, against ``backend="inductor"``.
inkling2_loop crashed there: an empty operand of ``torch.cat`` (its message attention at one pre-loop block);
Inductor's ``cat`` decomposition returns a clone of the other operand with that operand's strides, where ATen gives a
contiguous result, so an ``aten.view`` recorded in the captured ATen graph became invalid when ``compile_fx``
re-traced it (fixed: ``backend._views_as_reshapes``)."""

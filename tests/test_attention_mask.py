"""The attention-mask pass: masks computed from sizes alone, proved causal or all true, become SDPA's flags.

Readings of hand-made masks (hypothesis over sizes and mask forms), the rewrite of the CUDA SDPA ops on fake
tensors (their mask is positional), and tiny HF models: every attention layer folded where the mask is a function
of sizes, none where it reads an input (padding, a cache), logits equal to eager.
"""

from __future__ import annotations

import math
import operator

import pytest
import torch
import torch.fx as fx
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

import ep_fuse
from ep_fuse.config import EpFuseConfig
from ep_fuse.fx_utils import op_args
from ep_fuse.passes.attention_mask import CAUSAL, NO_MASK, FoldAttentionMasks, read_mask
from ep_fuse.passes.base import PassContext
from ep_fuse.passes.graph_edit import set_fake_vals
from ep_fuse.report import GraphReport
from ep_fuse.testing import tiny as tiny_models
from support.compiling import compile_logits

aten = torch.ops.aten
SDPA_CPU = "aten._scaled_dot_product_flash_attention_for_cpu.default"


def _causal(b: int, length: int) -> torch.Tensor:
    return torch.ones(length, length, dtype=torch.bool).tril().expand(b, 1, length, length)


def _additive(mask: torch.Tensor, low: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.where(mask, torch.tensor(0.0, dtype=dtype), torch.tensor(low, dtype=dtype))


@settings(max_examples=60, deadline=None)
@given(b=st.integers(1, 3), length=st.integers(2, 24),
       form=st.sampled_from(["bool", "-inf", "finfo.min", "bf16 -inf", "bf16 finfo.min", "cudnn -65504"]))
def test_causal_masks_read_as_causal(b, length, form):
    mask = _causal(b, length)
    if form != "bool":
        dtype = torch.bfloat16 if form.startswith(("bf16", "cudnn")) else torch.float32
        low = {"-inf": -math.inf, "min": torch.finfo(dtype).min, "-65504": -65504.0}[form.split()[-1].split(".")[-1]]
        mask = _additive(mask, low, dtype)
    assert read_mask(mask, length, length) == CAUSAL


@settings(max_examples=60, deadline=None)
@given(b=st.integers(1, 3), q=st.integers(1, 8), kv=st.integers(1, 8), heads=st.sampled_from([1, 4]))
def test_all_true_masks_are_dropped(b, q, kv, heads):
    assert read_mask(torch.ones(b, heads, q, kv, dtype=torch.bool), q, kv) == NO_MASK
    assert read_mask(torch.ones(b, 1, 1, kv, dtype=torch.bool), q, kv) == NO_MASK  # broadcast over queries
    assert read_mask(torch.zeros(b, 1, q, kv), q, kv) == NO_MASK


@settings(max_examples=60, deadline=None)
@given(b=st.integers(1, 3), length=st.integers(3, 24), data=st.data())
def test_other_masks_are_kept(b, length, data):
    pad = _causal(b, length).clone()
    row = data.draw(st.integers(0, b - 1))
    pad[row, :, :, 0] = False  # left padding of one sequence
    window = torch.ones(length, length, dtype=torch.bool).tril().triu(-1).expand(b, 1, length, length)
    bias = _additive(_causal(b, length), -math.inf)
    bias[0, 0, -1, 0] = -1e4  # a finite bias, above the cuDNN path's -65504
    for mask in (pad, window, bias, _causal(b, length)[..., :-1, :]):
        reading = read_mask(mask, mask.shape[-2], mask.shape[-1])
        assert reading not in (CAUSAL, NO_MASK), (mask.shape, reading)
    # bottom-right causal over more keys than queries: SDPA's flag means the top-left triangle
    wide = torch.ones(length - 1, length, dtype=torch.bool).tril(1)
    assert read_mask(wide, length - 1, length) not in (CAUSAL, NO_MASK)
    assert read_mask(torch.ones(2, length, length, dtype=torch.int64), length, length) == "a torch.int64 mask"


def _sdpa_graph(target, fake: FakeTensorMode, mask_value: torch.Tensor, positional: bool) -> fx.GraphModule:
    """q, k, v placeholders (fake CUDA bf16, [B, H, S, D] views of [B, S, H, D] as traced), the mask a constant
    buffer (fake CUDA in the metadata), one fused SDPA op whose attention output is the graph's output."""
    gm = fx.GraphModule(torch.nn.Module(), fx.Graph())
    gm.register_buffer("mask", mask_value)
    g = gm.graph
    with fake:
        qkv = [torch.empty(2, 16, 4, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3)]
        fake_mask = torch.empty(mask_value.shape, device="cuda", dtype=torch.bfloat16)
    inputs = [g.placeholder(n) for n in ("q", "k", "v")]
    for node, v in zip(inputs, qkv):
        node.meta["val"] = v
    m = g.get_attr("mask")
    m.meta["val"] = fake_mask
    rest = (False, 0.0, False, False) if target is aten._scaled_dot_product_cudnn_attention.default else \
        (False, 0.0, False)
    if positional:
        args, kwargs = (*inputs, m, *rest), {"scale": 0.125}
    else:
        args, kwargs = tuple(inputs), {"attn_bias": m, "compute_log_sumexp": False, "scale": 0.125}
    sdpa = g.call_function(target, args, kwargs)
    set_fake_vals(PassContext(config=EpFuseConfig(), device="cuda", executor="eager",
                              report=GraphReport("g", "cuda", "eager"), fake_mode=fake), sdpa)
    out = g.call_function(operator.getitem, (sdpa, 0))
    out.meta["val"] = sdpa.meta["val"][0]
    g.output(out)
    gm.recompile()
    return gm


@pytest.mark.parametrize("positional", [True, False], ids=["positional", "keyword"])
@pytest.mark.parametrize("target", [aten._scaled_dot_product_cudnn_attention.default,
                                    aten._scaled_dot_product_efficient_attention.default], ids=["cudnn", "efficient"])
@pytest.mark.parametrize("mask", ["causal", "all_true", "padded"])
def test_cuda_sdpa_ops_take_the_flag(target, positional, mask):
    """The CUDA ops carry the mask as ``attn_bias`` (positional in the traced graph): the pass sets it to None and
    ``is_causal`` where proved, keeps the op, its output layout and the other arguments."""
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    causal = _additive(_causal(2, 16), -math.inf, torch.bfloat16)
    value = {"causal": causal, "all_true": torch.zeros(2, 1, 16, 16, dtype=torch.bfloat16),
             "padded": causal.clone().index_fill_(-1, torch.tensor([0]), -math.inf)}[mask]
    gm = _sdpa_graph(target, fake, value, positional)
    (sdpa,) = gm.graph.find_nodes(op="call_function", target=target)
    before = sdpa.meta["val"][0]
    report = GraphReport("g", "cuda", "eager")
    ctx = PassContext(config=EpFuseConfig(), device="cuda", executor="eager", report=report, fake_mode=fake)
    changed = FoldAttentionMasks()(gm, ctx)
    args = op_args(sdpa)
    assert sdpa.target is target
    if mask == "padded":
        assert changed == 0 and report.attention_masks[sdpa.name].startswith("kept: neither causal")
        assert isinstance(args["attn_bias"], fx.Node)
        return
    assert changed == 1 and report.attention_masks[sdpa.name] == (CAUSAL if mask == "causal" else NO_MASK)
    assert args["attn_bias"] is None and args["is_causal"] is (mask == "causal")
    assert args["scale"] == 0.125 and args["dropout_p"] == 0.0
    after = sdpa.meta["val"][0]
    assert (after.shape, after.stride(), after.dtype) == (before.shape, before.stride(), before.dtype)


SDPA_MODELS = ["qwen3_moe", "mixtral", "qwen2_moe", "glm4_moe", "granitemoe"]
"""Tiny models whose attention traces as CPU SDPA (DeepSeek's q/k and v head dims differ: its CPU SDPA
decomposes; GPT-OSS runs eager attention)."""


@pytest.mark.hf
@pytest.mark.parametrize("shape", [(2, 8), (3, 1)], ids=["prefill", "one_token"])
@pytest.mark.parametrize("name", SDPA_MODELS)
def test_hf_masks_fold_on_every_layer(name, shape):
    model = tiny_models.build(name, dtype=torch.float32)
    ids = torch.randint(0, model.config.vocab_size, shape, generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "use_cache": False}
    with torch.no_grad():
        ref = model(**inputs).logits
    out, report = compile_logits(model, inputs)
    want = CAUSAL if shape[1] > 1 else NO_MASK
    assert list(report.attention_masks.values()) == [want] * model.config.num_hidden_layers, report.attention_masks
    assert f"attention masks folded: {want} x{model.config.num_hidden_layers}" in report.summary()
    assert report.ops_after.get(SDPA_CPU, 0) == model.config.num_hidden_layers
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.hf
def test_the_option_turns_the_pass_off():
    model = tiny_models.build("qwen3_moe", dtype=torch.float32)
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "use_cache": False}
    with torch.no_grad():
        ref = model(**inputs).logits
    off, report = compile_logits(model, inputs, fold_attention_masks=False)
    assert report.attention_masks == {} and "attention_mask" not in [p.name for p in report.passes]
    assert report.ops_after.get(SDPA_CPU, 0) == 2 and report.ops_after.get("aten.bitwise_and.Tensor", 0) > 0
    torch.testing.assert_close(off, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.hf
def test_masks_that_read_inputs_are_kept():
    """A caller's attention mask (padding or not) and a cache position are graph inputs: the mask stays."""
    model = tiny_models.build("qwen3_moe", dtype=torch.float32)
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    pad = torch.ones(2, 8, dtype=torch.int64)
    pad[1, :3] = 0
    for attention_mask in (torch.ones(2, 8, dtype=torch.int64), pad):
        inputs = {"input_ids": ids, "attention_mask": attention_mask, "use_cache": False}
        with torch.no_grad():
            ref = model(**inputs).logits
        out, report = compile_logits(model, inputs)
        readings = list(report.attention_masks.values())
        assert len(readings) == 2 and all(r.startswith("kept: it reads the graph input") for r in readings), readings
        keep = attention_mask.bool()[:, None, :, None]  # padded query rows are garbage in both
        torch.testing.assert_close(out * keep[:, 0], ref * keep[:, 0], rtol=1e-5, atol=1e-5)


@pytest.mark.hf
def test_dynamic_sizes_keep_the_mask():
    model = tiny_models.build("mixtral", dtype=torch.float32)
    torch._dynamo.reset()
    ep_fuse.reset_reports()
    compiled = torch.compile(model, backend="ep_fuse", dynamic=True)
    with torch.no_grad():
        for seq in (6, 9):
            ids = torch.randint(0, 100, (2, seq), generator=torch.Generator().manual_seed(seq))
            torch.testing.assert_close(compiled(input_ids=ids, use_cache=False).logits,
                                       model(input_ids=ids, use_cache=False).logits, rtol=1e-5, atol=1e-5)
    readings = [r for rep in ep_fuse.reports() for r in rep.attention_masks.values()]
    assert readings and all(r.startswith("kept") for r in readings), readings


def test_a_mask_that_cannot_be_read_is_kept():
    """A mask whose value cannot be read at compile time (here: computed on the meta device) stays, with the
    reason; the compile goes on."""
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    gm = _sdpa_graph(aten._scaled_dot_product_efficient_attention.default, fake,
                     torch.zeros(2, 1, 16, 16, dtype=torch.bfloat16), positional=True)
    g = gm.graph
    (sdpa,) = g.find_nodes(op="call_function", target=aten._scaled_dot_product_efficient_attention.default)
    (const,) = g.find_nodes(op="get_attr")
    with g.inserting_before(sdpa):
        meta = g.call_function(aten.zeros.default, ([2, 1, 16, 16],), {"dtype": torch.bfloat16, "device": "meta"})
    meta.meta["val"] = const.meta["val"]
    sdpa.replace_input_with(const, meta)
    report = GraphReport("g", "cuda", "eager")
    ctx = PassContext(config=EpFuseConfig(), device="cuda", executor="eager", report=report, fake_mode=fake)
    assert FoldAttentionMasks()(gm, ctx) == 0
    assert report.attention_masks[sdpa.name].startswith("kept: its evaluation failed"), report.attention_masks
    assert op_args(sdpa)["attn_bias"] is meta

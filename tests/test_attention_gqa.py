"""The GQA pass: one-query-row SDPA over repeated K/V heads runs on the un-repeated K/V, query heads as rows.

Hand-made ATen graphs (hypothesis over sizes, repeat spellings, masks, and the calls that must stay), the CUDA
memory-efficient op on fake tensors (its mask is positional and must name every head), and tiny HF models at one
token, without and with a KV cache and a caller's mask: logits equal to eager, one packed call per layer.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import ep_fuse
from ep_fuse.config import EpFuseConfig
from ep_fuse.fx_utils import fake_mode_of, op_args
from ep_fuse.passes.attention_gqa import PackGqaHeads, head_repeat
from ep_fuse.passes.base import PassContext
from ep_fuse.passes.graph_edit import set_fake_vals
from ep_fuse.report import GraphReport
from ep_fuse.testing import tiny as tiny_models
from support.compiling import compile_logits

aten = torch.ops.aten
SDPA_CPU = aten._scaled_dot_product_flash_attention_for_cpu.default


def _repeat_kv(x: torch.Tensor, g: int, spelling: str) -> torch.Tensor:
    b, h, n, d = x.shape
    if spelling == "repeat_interleave":
        return x.repeat_interleave(g, dim=1)
    if spelling == "seq-major expand":  # Llama's reference: repeat on [B, N, H, D], then put the heads second
        y = x.transpose(1, 2)
        return y[:, :, :, None, :].expand(b, n, h, g, d).reshape(b, n, h * g, d).transpose(1, 2)
    if spelling == "seq-major repeat_interleave":  # Mistral's reference
        return x.transpose(1, 2).repeat_interleave(g, dim=2).transpose(1, 2)
    return x[:, :, None, :, :].expand(b, h, g, n, d).reshape(b, h * g, n, d)


def _run_pass(gm: fx.GraphModule, device: str = "cpu", fake: FakeTensorMode | None = None) -> GraphReport:
    report = GraphReport("g", device, "eager")
    ctx = PassContext(config=EpFuseConfig(), device=device, executor="eager", report=report,
                      fake_mode=fake or fake_mode_of(gm))
    PackGqaHeads()(gm, ctx)
    gm.graph.lint()
    gm.recompile()
    return report


def _layout(t: torch.Tensor) -> tuple:
    """dtype, shape and the strides that address memory (a size-1 dim's stride does not; CPU kernels and their
    meta functions disagree there)."""
    return t.dtype, tuple(t.shape), tuple(st if sz != 1 else None for sz, st in zip(t.shape, t.stride()))


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 3), hkv=st.integers(1, 3), g=st.integers(2, 4), n=st.integers(1, 9), d=st.sampled_from([8, 16]),
       spelling=st.sampled_from(["repeat_kv", "repeat_interleave", "seq-major expand", "seq-major repeat_interleave"]),
       mask=st.sampled_from(["none", "bool row", "float row", "row expanded to heads", "per head"]),
       q_len=st.sampled_from([1, 1, 2]), causal=st.sampled_from([False, False, True]))
def test_packed_equals_repeated(b, hkv, g, n, d, spelling, mask, q_len, causal):
    hq = hkv * g
    gen = torch.Generator().manual_seed(b * 100 + n)
    q = torch.randn(b, q_len, hq, d, generator=gen).transpose(1, 2)
    k = torch.randn(b, n, hkv, d, generator=gen).transpose(1, 2)
    v = torch.randn(b, n, hkv, d, generator=gen).transpose(1, 2)
    keep = torch.rand(b, 1, q_len, n, generator=gen) < 0.7
    keep[..., 0] = True
    masks = {"none": None, "bool row": keep, "float row": torch.zeros(b, 1, q_len, n).masked_fill(~keep, -1e9),
             "row expanded to heads": torch.zeros(b, 1, q_len, n).masked_fill(~keep, -1e9).expand(b, hq, q_len, n),
             "per head": torch.rand(b, hq, q_len, n, generator=gen) < 2.0}  # (all true, but a tensor per head)
    m = masks[mask]
    causal = causal and m is None

    def attend(q, k, v, *m):
        k, v = _repeat_kv(k, g, spelling), _repeat_kv(v, g, spelling)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m[0] if m else None, is_causal=causal)

    inputs = (q, k, v) + ((m,) if m is not None else ())
    gm = make_fx(attend, tracing_mode="fake")(*inputs)
    ref = gm(*inputs)
    sdpa = [n_ for n_ in gm.graph.nodes if n_.target in (SDPA_CPU, aten.scaled_dot_product_attention.default)]
    assert len(sdpa) == 1, gm.graph
    report = _run_pass(gm)
    packs = q_len == 1 and not causal and mask != "per head"
    reading = report.attention_gqa.get(sdpa[0].name)
    assert reading == (f"packed G={g}" if packs else reading) and (reading or "").startswith("packed") == packs, \
        (reading, q_len, causal, mask)
    if packs:  # the repeat is gone: the op reads the un-repeated K/V
        (new,) = [n_ for n_ in gm.graph.nodes if n_.target in (SDPA_CPU, aten.scaled_dot_product_attention.default)]
        assert tuple(op_args(new)["key"].meta["val"].shape) == (b, hkv, n, d)
        assert not any(n_.target in (aten.expand.default, aten.repeat_interleave.self_int)
                       and len(n_.meta["val"].shape) == 5 for n_ in gm.graph.nodes)
    out = gm(*inputs)
    assert _layout(out) == _layout(ref)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_head_repeat_reads_only_a_repeat_of_whole_heads():
    """A broadcast of a new dim in another place, or a reshape that does not merge (kv heads, G), is no repeat."""
    x = torch.randn(2, 3, 5, 8)

    def other_axis(x):  # repeats along the sequence, not the heads
        return x[:, :, :, None, :].expand(2, 3, 5, 2, 8).reshape(2, 3, 10, 8)

    def heads(x):
        return _repeat_kv(x, 2, "repeat_kv")

    def seq_major_heads(x):
        return _repeat_kv(x, 3, "seq-major expand")

    def seq_major_other_axis(x):  # [B, N, H, D] repeated along N, then transposed: no head repeat
        y = x.transpose(1, 2)
        return y[:, :, None].expand(2, 5, 2, 3, 8).reshape(2, 10, 3, 8).transpose(1, 2)

    for fn, want in ((other_axis, None), (heads, 2), (seq_major_heads, 3), (seq_major_other_axis, None)):
        gm = make_fx(fn, tracing_mode="fake")(x)
        (out,) = [n for n in gm.graph.nodes if n.op == "output"]
        found = head_repeat(out.args[0][0] if isinstance(out.args[0], (list, tuple)) else out.args[0])
        assert (found.g if found else None) == want, fn.__name__


def _efficient_graph(fake: FakeTensorMode, b: int = 3, hkv: int = 2, g: int = 4, n: int = 32, d: int = 64,
                     target=aten._scaled_dot_product_efficient_attention.default) -> fx.GraphModule:
    """HF's decode attention on fake CUDA bf16 as traced with a mask: repeat_kv on K and V, the memory-efficient
    op with a ``[B, Hq, 1, N]`` bias that is one row expanded over the heads (positional, as traced)."""
    gm = fx.GraphModule(torch.nn.Module(), fx.Graph())
    gr = gm.graph
    ctx = PassContext(config=EpFuseConfig(), device="cuda", executor="eager", report=GraphReport("g", "cuda", "eager"),
                      fake_mode=fake)
    with fake:
        vals = {"q": torch.empty(b, 1, hkv * g, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2),
                "k": torch.empty(b, n, hkv, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2),
                "v": torch.empty(b, n, hkv, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2),
                "mask": torch.empty(b, 1, 1, n, device="cuda", dtype=torch.bfloat16)}
    ph = {}
    for name, value in vals.items():
        ph[name] = gr.placeholder(name)
        ph[name].meta["val"] = value
    added = []
    rep = {}
    for name in ("k", "v"):
        u = gr.call_function(aten.unsqueeze.default, (ph[name], 2))
        e = gr.call_function(aten.expand.default, (u, [b, hkv, g, n, d]))
        c = gr.call_function(aten.clone.default, (e,), {"memory_format": torch.contiguous_format})
        rep[name] = gr.call_function(aten._unsafe_view.default, (c, [b, hkv * g, n, d]))
        added += [u, e, c, rep[name]]
    bias = gr.call_function(aten.expand.default, (ph["mask"], [b, hkv * g, 1, n]))
    rest = (False, 0.0, False, False) if target is aten._scaled_dot_product_cudnn_attention.default else (False,)
    sdpa = gr.call_function(target, (ph["q"], rep["k"], rep["v"], bias, *rest), {"scale": 0.125})
    out = gr.call_function(operator.getitem, (sdpa, 0))
    set_fake_vals(ctx, *added, bias, sdpa, out)
    gr.output(out)
    gm.recompile()
    return gm


@pytest.mark.parametrize("target", [aten._scaled_dot_product_efficient_attention.default,
                                    aten._scaled_dot_product_cudnn_attention.default], ids=["efficient", "cudnn"])
def test_cuda_ops_take_packed_heads_and_a_full_bias(target):
    """The memory-efficient kernel wants its bias to name every head of the call: the pass broadcasts the shared
    mask row to ``[B, Hkv, G, N]``; the op's output is laid back out exactly as before."""
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    gm = _efficient_graph(fake, target=target)
    before = gm.graph.output_node().args[0].meta["val"]
    report = _run_pass(gm, "cuda", fake)
    assert list(report.attention_gqa.values()) == ["packed G=4"]
    (new,) = gm.graph.find_nodes(op="call_function", target=target)
    args = op_args(new)
    assert tuple(args["query"].meta["val"].shape) == (3, 2, 4, 64)
    assert args["key"].op == "placeholder" and args["value"].op == "placeholder"
    assert tuple(args["attn_bias"].meta["val"].shape) == (3, 2, 4, 32)
    assert args["scale"] == 0.125 and args["compute_log_sumexp"] is False
    assert not gm.graph.find_nodes(op="call_function", target=aten.clone.default) or all(
        len(c.meta["val"].shape) == 4 for c in gm.graph.find_nodes(op="call_function", target=aten.clone.default))
    after = gm.graph.output_node().args[0].meta["val"]
    assert (after.shape, after.stride(), after.dtype) == (before.shape, before.stride(), before.dtype)


def test_statistics_read_keep_the_call():
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    gm = _efficient_graph(fake)
    (sdpa,) = gm.graph.find_nodes(op="call_function", target=aten._scaled_dot_product_efficient_attention.default)
    with gm.graph.inserting_after(sdpa):
        lse = gm.graph.call_function(operator.getitem, (sdpa, 1))
    lse.meta["val"] = sdpa.meta["val"][1]
    out = gm.graph.output_node()
    out.args = ((out.args[0], lse),)
    report = _run_pass(gm, "cuda", fake)
    assert report.attention_gqa == {sdpa.name: "kept: more than the attention output is read"}


GQA_MODELS = ["qwen3_moe", "mixtral", "qwen2_moe", "glm4_moe", "granitemoe"]
"""Tiny models with 4 query heads over 2 K/V heads whose attention traces as CPU SDPA."""


@pytest.mark.hf
@pytest.mark.parametrize("name", GQA_MODELS)
def test_hf_one_token_packs_every_layer(name):
    model = tiny_models.build(name, dtype=torch.float32)
    layers = model.config.num_hidden_layers
    ids = torch.randint(0, model.config.vocab_size, (3, 1), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "use_cache": False}
    with torch.no_grad():
        ref = model(**inputs).logits
    out, report = compile_logits(model, inputs)
    assert list(report.attention_gqa.values()) == ["packed G=2"] * layers, report.attention_gqa
    assert f"one-row attention on un-repeated K/V heads x{layers}" in report.summary()
    assert report.ops_after.get(str(SDPA_CPU), 0) == layers
    assert report.ops_after.get("aten.expand.default", 0) < report.ops_after_pass("attention_mask").get(
        "aten.expand.default", 0)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    prefill, report = compile_logits(model, {"input_ids": torch.cat([ids, ids], 1), "use_cache": False})
    assert set(report.attention_gqa.values()) == {"kept: more than one query row"}


@pytest.mark.hf
def test_hf_decode_over_a_cache_with_padding_packs():
    """A decode step over a KV cache with a caller's padding mask: the mask is an input (kept by the mask pass),
    one row shared by the heads, so the call packs; logits equal eager at every unpadded row."""
    from transformers import DynamicCache

    model = tiny_models.build("qwen3_moe", dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (2, 6), generator=gen)
    pad = torch.ones(2, 7, dtype=torch.int64)
    pad[1, :2] = 0
    token = torch.randint(0, model.config.vocab_size, (2, 1), generator=gen)

    def step() -> dict:  # the prompt in a fresh cache (eager), then the step's inputs over it
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=prompt, attention_mask=pad[:, :6], past_key_values=cache, use_cache=True)
        return {"input_ids": token, "attention_mask": pad, "past_key_values": cache, "use_cache": True}

    with torch.no_grad():
        ref = model(**step()).logits
    out, report = compile_logits(model, step())
    assert list(report.attention_gqa.values()) == ["packed G=2"] * 2, report.attention_gqa
    assert all(r.startswith("kept") for r in report.attention_masks.values())
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.hf
def test_the_option_turns_the_pass_off():
    model = tiny_models.build("mixtral", dtype=torch.float32)
    ids = torch.randint(0, 100, (2, 1), generator=torch.Generator().manual_seed(0))
    out, report = compile_logits(model, {"input_ids": ids, "use_cache": False}, pack_gqa=False)
    assert report.attention_gqa == {} and "attention_gqa" not in [p.name for p in report.passes]
    with torch.no_grad():
        torch.testing.assert_close(out, model(input_ids=ids, use_cache=False).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.hf
def test_a_symbolic_batch_packs_without_guards():
    """``dynamic=True``: the batch is symbolic; the pass decides on the static head counts only (no guard on the
    batch), one graph serves every batch size, logits equal to eager."""
    model = tiny_models.build("mixtral", dtype=torch.float32)
    torch._dynamo.reset()
    ep_fuse.reset_reports()
    compiled = torch.compile(model, backend="ep_fuse", dynamic=True)
    with torch.no_grad():
        for b in (2, 3, 5):
            ids = torch.randint(0, 100, (b, 1), generator=torch.Generator().manual_seed(b))
            torch.testing.assert_close(compiled(input_ids=ids, use_cache=False).logits,
                                       model(input_ids=ids, use_cache=False).logits, rtol=1e-5, atol=1e-5)
    (report,) = ep_fuse.reports()
    assert list(report.attention_gqa.values()) == ["packed G=2"] * 2 and report.shape_guards == []


class ReferenceDecodeAttention(torch.nn.Module):
    """Decode attention written the way reference implementations (Llama's, Mistral's) write it: a ``[B, N, H, D]``
    cache, the K/V heads repeated on that layout, then the heads put second for SDPA, a key mask per sequence."""

    def __init__(self, dim: int = 64, heads: int = 8, kv_heads: int = 2, spelling: str = "seq-major expand"):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.spelling = heads, kv_heads, dim // heads, spelling
        self.wq = torch.nn.Linear(dim, dim, bias=False)
        self.wk = torch.nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = torch.nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x, cache_k, cache_v, keep):
        b = x.shape[0]
        q = self.wq(x).view(b, 1, self.heads, self.head_dim)
        k = torch.cat([cache_k, self.wk(x).view(b, 1, self.kv_heads, self.head_dim)], 1)
        v = torch.cat([cache_v, self.wv(x).view(b, 1, self.kv_heads, self.head_dim)], 1)
        g = self.heads // self.kv_heads
        k = _repeat_kv(k.transpose(1, 2), g, self.spelling)
        v = _repeat_kv(v.transpose(1, 2), g, self.spelling)
        mask = torch.zeros(keep.shape, dtype=x.dtype).masked_fill(~keep, float("-inf"))[:, None, None, :]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(b, 1, -1))


@pytest.mark.parametrize("spelling", ["seq-major expand", "seq-major repeat_interleave", "repeat_kv"])
def test_reference_decode_attention_packs(spelling):
    torch.manual_seed(0)
    mod = ReferenceDecodeAttention(spelling=spelling).eval()
    b, n = 3, 7
    x = torch.randn(b, 1, 64)
    cache_k, cache_v = torch.randn(b, n, 2, 8), torch.randn(b, n, 2, 8)
    keep = torch.rand(b, n + 1) < 0.8
    keep[:, -1] = True
    torch._dynamo.reset()
    ep_fuse.reset_reports()
    with torch.no_grad():
        ref = mod(x, cache_k, cache_v, keep)
        out = torch.compile(mod, backend="ep_fuse")(x, cache_k, cache_v, keep)
    assert list(ep_fuse.last_report().attention_gqa.values()) == ["packed G=4"]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)

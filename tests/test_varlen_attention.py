"""``ep_fuse::varlen_attention``: the reference against a per-sequence loop, HF's SDPA over the mask HF's continuous
batching builds, the wrapper in ``generate_batch`` (no mask built, tokens equal to eager ``generate``, one graph), the
cases that keep HF's mask, and the flash provider's limits (its kernel runs in ``tests/gpu``)."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ep_fuse
from ep_fuse.hf import paged_attention
from ep_fuse.testing import tiny
from ep_fuse.hf import varlen_attention
from ep_fuse.ops.registry import choose
from ep_fuse.ops.varlen_attention import VARLEN_ATTENTION, varlen_attention_ref
from ep_fuse.providers.flash import varlen_attention as flash

pytest.importorskip("transformers.generation.continuous_batching")
from transformers.generation.continuous_batching import input_outputs  # noqa: E402
from transformers.generation.continuous_batching.utils import build_attention_mask  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from support.cb_requests import NEW, cb_config as _cb, eager_generate as _generate  # noqa: E402
from support.cb_requests import gen_config as _gen, tokens_of as _tokens  # noqa: E402

FAST = {"executor": "eager", "providers": {"cpu": ("reference",)}}


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def _loop(q, k, v, lq, lk, scale):
    """Attention one sequence, one query, one head at a time: the definition."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    cq, ck, groups = _cu(lq), _cu(lk), q.shape[1] // k.shape[1]
    for b in range(len(lq)):
        for i in range(lq[b]):
            seen = lk[b] - lq[b] + i + 1
            for h in range(q.shape[1]):
                keys = k[ck[b]:ck[b] + seen, h // groups].double()
                p = torch.softmax(keys @ q[cq[b] + i, h].double() * scale, dim=0)
                out[cq[b] + i, h] = p @ v[ck[b]:ck[b] + seen, h // groups].double()
    return out


@settings(max_examples=40, deadline=None)
@given(data=st.data(), heads=st.sampled_from([(1, 1), (4, 2), (8, 1), (6, 3)]), dim=st.sampled_from([4, 8, 16]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), pad_q=st.integers(0, 3), pad_k=st.integers(0, 3))
def test_reference_equals_the_per_sequence_loop(data, heads, dim, dtype, pad_q, pad_k):
    """Any lengths (empty sequences, a cached past longer than the queries, padding rows after the last sequence)."""
    lq = data.draw(st.lists(st.integers(0, 6), min_size=1, max_size=5))
    lk = [n + data.draw(st.integers(0, 7)) for n in lq]
    g = torch.Generator().manual_seed(len(lq) * 31 + sum(lk))
    hq, hk = heads
    q = torch.randn(sum(lq) + pad_q, hq, dim, generator=g).to(dtype)
    k = torch.randn(sum(lk) + pad_k, hk, dim, generator=g).to(dtype)
    v = torch.randn(sum(lk) + pad_k, hk, dim, generator=g).to(dtype)
    scale = dim ** -0.5
    got = varlen_attention_ref(q, k, v, _cu(lq), _cu(lk), max(lq), max(lk), scale)
    assert got.dtype == dtype and got.shape == (q.shape[0], hq, dim)
    want = _loop(q, k, v, lq, lk, scale)
    tol = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=8e-3)
    torch.testing.assert_close(got.double(), want, **tol)
    assert torch.equal(got[sum(lq):], torch.zeros_like(got[sum(lq):]))


def test_opcheck():
    q, k, v = torch.randn(7, 4, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 8)
    torch.library.opcheck(VARLEN_ATTENTION.op, (q, k, v, _cu([3, 4]), _cu([4, 5]), 4, 5, 0.3))


def _module(groups: int) -> torch.nn.Module:
    m = torch.nn.Module()
    m.num_key_value_groups, m.is_causal = groups, True
    return m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wrapper_without_a_mask_equals_hf_sdpa_over_the_mask_hf_builds(dtype):
    """HF's own ``build_attention_mask`` for a batch of a decode step, a prefill chunk with a past and a new prompt,
    then HF's SDPA with it, against the wrapper given no mask (what continuous batching passes once :func:`enable`
    dropped it)."""
    varlen_attention.install()
    lq, past = [1, 5, 4], [9, 6, 0]
    lk = [a + b for a, b in zip(lq, past)]
    t, n, hq, hk, d = sum(lq), sum(lk), 4, 2, 16
    g = torch.Generator().manual_seed(3)
    query = torch.randn(1, hq, t, d, generator=g).to(dtype)
    key, value = (torch.randn(1, hk, n, d, generator=g).to(dtype) for _ in range(2))
    mask = torch.empty(1, 1, t, n, dtype=dtype)
    mask.fill_(torch.finfo(dtype).min)
    build_attention_mask(mask, _cu(lq).tolist(), _cu(lk).tolist())
    kwargs = dict(cu_seq_lens_q=_cu(lq), cu_seq_lens_k=_cu(lk), max_length_q=max(lq), max_length_k=max(lk),
                  read_index=[torch.arange(n)], write_index=[torch.arange(t)], is_causal=True)
    want, _ = sdpa_attention_forward(_module(2), query, key, value, mask, scaling=0.25, **{**kwargs, "is_causal": False})
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    got, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](_module(2), query, key, value, None, scaling=0.25, **kwargs)
    assert got.shape == want.shape == (1, t, hq, d) and got.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(got, want, **tol)


def test_wrapper_leaves_other_calls_to_hf():
    varlen_attention.install()
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
    got, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](_module(2), q, k, k, None, scaling=0.3)
    want, _ = sdpa_attention_forward(_module(2), q, k, k, None, scaling=0.3)
    assert torch.equal(got, want)


def test_a_layer_that_cannot_take_the_op_without_a_mask_raises():
    """Never attention across requests: no mask and a sliding-window layer is an error, not HF's SDPA unmasked."""
    varlen_attention.install()
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8)
    kwargs = dict(cu_seq_lens_q=_cu([3]), cu_seq_lens_k=_cu([5]), read_index=[torch.arange(5)], sliding_window=4)
    with pytest.raises(RuntimeError, match="sliding_window.*disable"):
        ALL_ATTENTION_FUNCTIONS["sdpa"](_module(2), q, k, k, None, **kwargs)


# -- generate_batch ---------------------------------------------------------------------------------------------

PROMPTS = [list(range(5, 5 + n)) for n in (3, 9, 12, 17)]


@pytest.fixture(scope="module")
def model():
    m = tiny.build("qwen3_moe", dtype=torch.float32)  # prepared
    assert varlen_attention.runs_fused(m) is not None  # fp32 on CPU: HF's mask and SDPA unless forced
    assert input_outputs.attn_mask_is_needed(m.config) is True
    assert varlen_attention.enable(m, force=True)
    return m


def _spy(monkeypatch) -> list:
    """Record each call of the op and the mask continuous batching handed the attention."""
    calls = []
    op = varlen_attention.varlen_attention

    def counting(*args):
        calls.append(args[0].shape[0])
        return op(*args)

    monkeypatch.setattr(varlen_attention, "varlen_attention", counting)
    return calls


def test_prepare_drops_the_mask_and_generate_batch_equals_generate(model, monkeypatch):
    assert varlen_attention.mask_free_reason(model) is None
    assert input_outputs.attn_mask_is_needed(model.config) is False
    calls = _spy(monkeypatch)
    out = model.generate_batch(PROMPTS, generation_config=_gen(), continuous_batching_config=_cb())
    assert _tokens(out) == _generate(model, PROMPTS)
    layers = model.config.num_hidden_layers
    assert len(calls) >= layers * NEW and len(calls) % layers == 0  # every layer of every step


def test_compiled_generate_batch_is_one_graph_with_the_op_in_every_layer(model):
    from torch._dynamo.utils import counters

    frames = counters["stats"]["unique_graphs"]
    out = model.generate_batch(PROMPTS, generation_config=_gen(),
                               continuous_batching_config=_cb(*paged_attention.cb_compile_configs(FAST)))
    assert _tokens(out) == _generate(model, PROMPTS)
    assert counters["stats"]["unique_graphs"] - frames == 1
    (report,) = ep_fuse.reports()
    assert report.ops_after.get("ep_fuse.varlen_attention.default") == model.config.num_hidden_layers
    assert report.counts() == tiny.EXPECTED_SITES["qwen3_moe"][0]


def test_a_sliding_window_model_keeps_hf_mask_and_equals_generate(monkeypatch):
    """A model with sliding-window layers is not cleared: HF builds its mask and every layer is HF's SDPA."""
    m = tiny.build("cohere2_moe", dtype=torch.float32, sliding_window=8,
                   layer_types=["sliding_attention", "full_attention"])
    assert {layer.self_attn.sliding_window for layer in m.model.layers} == {8, None}
    assert not varlen_attention.enable(m, force=True)
    assert "sliding_attention" in varlen_attention.mask_free_reason(m)
    assert input_outputs.attn_mask_is_needed(m.config) is True
    calls = _spy(monkeypatch)
    prompts = [list(range(5, 5 + n)) for n in (3, 12, 17)]
    out = m.generate_batch(prompts, generation_config=_gen(), continuous_batching_config=_cb())
    assert _tokens(out) == _generate(m, prompts)
    assert not calls, "a layer ran the op over HF's mask"


def test_disable_and_uninstall_restore_hf(model):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    varlen_attention.disable(model)
    assert input_outputs.attn_mask_is_needed(model.config) is True
    varlen_attention.uninstall()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
    assert input_outputs.attn_mask_is_needed.__module__ == "transformers.generation.continuous_batching.utils"
    out = model.generate_batch(PROMPTS, generation_config=_gen(), continuous_batching_config=_cb())
    assert _tokens(out) == _generate(model, PROMPTS)
    assert varlen_attention.enable(model, force=True) and input_outputs.attn_mask_is_needed(model.config) is False


# -- the flash provider's limits --------------------------------------------------------------------------------


def test_flash_provider_limits():
    def args(dtype=torch.bfloat16, d=128, hq=8, hk=2, cu=torch.int32, device="meta"):
        q = torch.empty(10, hq, d, dtype=dtype, device=device)
        k = torch.empty(12, hk, d, dtype=dtype, device=device)
        c = torch.zeros(3, dtype=cu, device=device)
        return (q, k, k, c, c, 5, 6, 0.1)

    assert "fp16 or bf16" in flash.supports(args(dtype=torch.float32))
    assert "int32" in flash.supports(args(cu=torch.int64))
    assert "up to 256" in flash.supports(args(d=320))
    assert "query heads" in flash.supports(args(hq=6, hk=4))
    assert flash.supports(args()) is None  # off CUDA nothing is unverified
    choice = choose(VARLEN_ATTENTION, args(device="cpu"), "cpu")
    assert choice.provider == "reference"
    if not torch.cuda.is_available():
        assert flash.available() == "no CUDA device"
        choice = choose(VARLEN_ATTENTION, args(), "cuda")
        assert choice.provider == "reference" and ("flash", "no CUDA device") in choice.declined


def test_lowering_picks_the_flash_provider_in_the_cb_graph(monkeypatch, caplog):
    """With the provider available on this device (as on CUDA), the varlen forward's attention lowers to it: the
    head counts and dims it decides on are static in the graph (the cache-update op's fake takes them from the
    written states, not from the cache tensor, whose sizes are symbolic under dynamic=True). Its aten kernel does
    not run on CPU: the guarded op falls back to the reference with one warning, and the tokens stay right."""
    import dataclasses

    prov = VARLEN_ATTENTION.providers["flash"]
    monkeypatch.setitem(VARLEN_ATTENTION.providers, "flash", dataclasses.replace(
        prov, devices=lambda: frozenset({"cpu", "cuda"}), available=lambda: None))
    m = tiny.build("qwen3_moe", dtype=torch.bfloat16)
    assert varlen_attention.runs_fused(m) is None  # the provider "runs on CPU" here: cleared without force
    prompts = PROMPTS[:2]
    want = _generate(m, prompts)
    opts = {"executor": "eager", "providers": {"cpu": ("flash", "reference")}}
    out = m.generate_batch(prompts, generation_config=_gen(),
                           continuous_batching_config=_cb(*paged_attention.cb_compile_configs(opts)))
    (report,) = ep_fuse.reports()
    assert report.ops_after.get("ep_fuse_flash.varlen_attention.default") == m.config.num_hidden_layers
    assert _tokens(out) == want
    warned = [r for r in caplog.records if "provider 'flash' failed for varlen_attention" in r.getMessage()]
    assert len(warned) <= 1

"""HF continuous batching (``generate_batch``) compiled by ep_fuse: one graph per forward with every fusion of the
static-cache path, outputs equal to eager, no recompile for new prompt lengths, and CUDA-graph modes declined."""

import threading
import types

import pytest
import torch

import ep_fuse
from ep_fuse.backend import cudagraphs_off_thread
from ep_fuse.hf import paged_attention
from ep_fuse.testing import tiny

pytest.importorskip("transformers.generation.continuous_batching")
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402
from transformers.generation.continuous_batching.cache_allocators.full_attention import (  # noqa: E402
    FullAttentionCacheAllocator)
from transformers.generation.continuous_batching.cache_allocators.sliding_attention import (  # noqa: E402
    SlidingAttentionCacheAllocator)

from support.cb_requests import cb_config as _cb, eager_generate as _generate  # noqa: E402
from support.cb_requests import gen_config as _gen, tokens_of as _tokens  # noqa: E402
FAST = {"executor": "eager", "providers": {"cpu": ("reference",)}}
"""ep_fuse's whole pipeline, the fused ops run as their references (no Triton interpreter): seconds, not minutes."""
PROMPTS = [list(range(5, 5 + n)) for n in (3, 9, 12, 17)]
OTHER_PROMPTS = [list(range(20, 20 + n)) for n in (4, 7, 15, 21, 2)]
"""More requests of new lengths, inside the padded sizes of the first run (64 query tokens, 8 requests)."""


@pytest.fixture(scope="module")
def model():
    return tiny.build("qwen3_moe", dtype=torch.float32)


def _frames() -> int:
    """Graphs Dynamo compiled in this process (``torch._dynamo.reset()`` keeps the counters: take differences)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


# -- the op against HF's own allocators -----------------------------------------------------------------------


@pytest.mark.parametrize("cls,sentinel", [(FullAttentionCacheAllocator, -1), (SlidingAttentionCacheAllocator, 1)])
def test_paged_kv_update_equals_hf_allocator_update(cls, sentinel):
    """The op writes and reads the same rows as HF's ``update`` of that allocator, on views of one cache tensor."""
    g = torch.Generator().manual_seed(0)
    tokens, heads, dim, page = 40, 2, 8, 4
    theirs = torch.randn(tokens, 2, heads, dim, generator=g)
    ours = theirs.clone()
    key, value = torch.randn(5, heads, dim, generator=g), torch.randn(5, heads, dim, generator=g)
    write = torch.tensor([9, 10, 11, 12, 13])
    read = torch.tensor([2, 3, 0, 1, 1, 1, 1, 1, 6]) if sentinel >= 0 else torch.tensor([2, 3, 0, 9, 10, 11, 12, 13])
    k_row, v_row = 2 * page, 3 * page  # layer 1 of an allocator with two layers
    flat = theirs.view(-1, heads, dim)
    fake_alloc = types.SimpleNamespace(_kv_token_views={1: (flat[k_row:], flat[v_row:])}, sentinel_index=1)
    want = cls.update(fake_alloc, key, value, 1, read, write)
    got = paged_attention.paged_kv_update(ours, key, value, read, write, k_row, v_row, sentinel)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_paged_kv_ops_pass_opcheck():
    cache = torch.randn(16, 2, 2, 4)
    key, value = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    write, read = torch.tensor([4, 5, 6]), torch.tensor([0, 4, 5, 6])
    torch.library.opcheck(paged_attention.paged_kv_update, (cache, key, value, read, write, 0, 4, -1))
    torch.library.opcheck(paged_attention.paged_kv_write, (cache, key, value, write, 0, 4))


def _mla_allocator():
    """transformers 5.25's MLA allocator class (one row ``latent | rope`` per token), or a skip."""
    mod = pytest.importorskip("transformers.generation.continuous_batching.cache_allocators")
    if not hasattr(mod, "MLACacheAllocator"):
        pytest.skip("this transformers caches no MLA latents in continuous batching (5.25 does)")
    return mod.MLACacheAllocator


@pytest.mark.parametrize("reads", [True, False], ids=["update", "write-only"])
def test_paged_latent_update_equals_hf_mla_allocator_update(reads):
    """The MLA op writes and reads the same rows and columns as HF's ``MLACacheAllocator.update``, on the column views
    of one ``[tokens, R + P]`` cache tensor (layer 1's rows from row 8); and the allocator check finds those views."""
    cls = _mla_allocator()
    g = torch.Generator().manual_seed(0)
    rank, rope, page = 6, 4, 8
    theirs = torch.randn(40, rank + rope, generator=g)
    ours = theirs.clone()
    latent, rotated = torch.randn(5, 1, rank, generator=g), torch.randn(5, 1, rope, generator=g)
    write = torch.tensor([9, 10, 11, 12, 13])
    read = torch.tensor([2, 3, 0, 9, 10, 11, 12, 13]) if reads else torch.tensor([], dtype=torch.long)
    views = {layer: (theirs[layer * page:, :rank], theirs[layer * page:, rank:]) for layer in (0, 1)}
    fake_alloc = types.SimpleNamespace(_latent_token_views=views, cache_tensor=theirs, kv_lora_rank=rank)
    assert paged_attention.latent_offsets(fake_alloc) == {0: (0, rank), 1: (page, rank)}
    want = cls.update(fake_alloc, latent, rotated, 1, read, write)
    if reads:
        got = paged_attention.paged_latent_update(ours, latent, rotated, read, write, page)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    else:
        paged_attention.paged_latent_write(ours, latent, rotated, write, page)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    fake_alloc._latent_token_views = {0: (theirs[:, :rank], theirs[1:, rank:])}  # not one row offset: refused
    assert paged_attention.latent_offsets(fake_alloc) is None


def test_paged_latent_ops_pass_opcheck():
    cache = torch.randn(16, 10)
    latent, rope = torch.randn(3, 1, 6), torch.randn(3, 1, 4)
    write, read = torch.tensor([4, 5, 6]), torch.tensor([0, 4, 5, 6])
    torch.library.opcheck(paged_attention.paged_latent_update, (cache, latent, rope, read, write, 2))
    torch.library.opcheck(paged_attention.paged_latent_write, (cache, latent, rope, write, 2))


@pytest.mark.slow  # 20-30 s on a shared 2-core machine (the trace of HF's CB forward), as the Qwen3 test above
def test_mla_generate_batch_is_one_graph_with_every_fusion():
    """transformers 5.25 caches DeepSeek-V3's compressed MLA latents (``MLACacheAllocator``): its update runs as
    ``paged_latent_update`` in the graph, so one CB forward is one graph with the static-cache path's fusions, and
    the tokens equal eager ``generate``."""
    _mla_allocator()
    mla = tiny.build("deepseek_v3", dtype=torch.float32)
    mla.generation_config.eos_token_id = None  # the oracle must not stop where CB does not
    prompts = PROMPTS[:1] + PROMPTS[-1:]
    frames, breaks = _frames(), _breaks()
    out = mla.generate_batch(prompts, generation_config=_gen(),
                             continuous_batching_config=_cb(*paged_attention.cb_compile_configs(FAST)))
    assert _frames() - frames == 1 and _breaks() == breaks
    (report,) = ep_fuse.reports()
    assert report.counts() == tiny.EXPECTED_SITES["deepseek_v3"][0]
    assert _tokens(out) == _generate(mla, prompts)


def test_prepare_installs_the_update_once():
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    assert paged_attention.install() and paged_attention.install()
    assert PagedAttentionCache.update.__name__ == "update_in_graph"


# -- generate_batch ---------------------------------------------------------------------------------------------


def test_eager_generate_batch_through_the_op_equals_generate(model):
    out = model.generate_batch(PROMPTS, generation_config=_gen(), continuous_batching_config=_cb())
    assert _tokens(out) == _generate(model, PROMPTS)


def test_generate_batch_is_one_graph_with_every_fusion_and_no_recompile(model):
    """ep_fuse's pipeline with the eager executor (references): one graph, the static-cache path's fusions
    (add_rms_norm across both layers), tokens equal to eager ``generate``, and new prompt lengths inside the
    padded sizes compile nothing."""
    frames, breaks = _frames(), _breaks()
    varlen, decode = paged_attention.cb_compile_configs(FAST)
    out = model.generate_batch(PROMPTS, generation_config=_gen(), continuous_batching_config=_cb(varlen, decode))
    assert _tokens(out) == _generate(model, PROMPTS)
    assert _frames() - frames == 1 and _breaks() == breaks
    (report,) = ep_fuse.reports()
    assert report.counts() == tiny.EXPECTED_SITES["qwen3_moe"][0]
    out = model.generate_batch(OTHER_PROMPTS, generation_config=_gen(),
                               continuous_batching_config=_cb(*paged_attention.cb_compile_configs(FAST)))
    assert _tokens(out) == _generate(model, OTHER_PROMPTS)
    assert _frames() - frames == 1, "a new prompt length recompiled"


@pytest.mark.slow
def test_generate_batch_under_inductor_executor_equals_eager(model):
    """The default executor: Inductor compiles the graph with the op in place (the Triton providers inlined on CUDA;
    on CPU tests they run in the interpreter)."""
    frames = _frames()
    out = model.generate_batch(PROMPTS, generation_config=_gen(),
                               continuous_batching_config=_cb(*paged_attention.cb_compile_configs()))
    assert _tokens(out) == _generate(model, PROMPTS)
    (report,) = ep_fuse.reports()
    assert report.counts() == tiny.EXPECTED_SITES["qwen3_moe"][0]
    assert report.inductor is not None and report.inductor.direct, report.inductor
    assert _frames() - frames == 1


@pytest.mark.slow
def test_backend_inductor_keeps_the_op_in_one_graph(model):
    from transformers.generation.configuration_utils import CompileConfig

    frames = _frames()
    cfg = CompileConfig(backend="inductor", fullgraph=True, mode="default")
    out = model.generate_batch(PROMPTS, generation_config=_gen(), continuous_batching_config=_cb(cfg, cfg))
    assert _tokens(out) == _generate(model, PROMPTS)
    assert _frames() - frames == 1


# -- first-call compile: one trace, one graph per request stream -----------------------------------------------

STREAM_TAIL = [3, 30, 12, 50, 9, 70, 5, 22]
"""Requests added once the first batch ran: batches mixing their prefills with decodes, 128 then 64 padded tokens."""


def _restarts() -> int:
    """Dynamo analyses restarted in this process (the second attempt of a frame is timed as ``compile_attempt_1``)."""
    from torch._dynamo.utils import compilation_time_metrics

    return len(compilation_time_metrics.get("compile_attempt_1", []))


def test_cb_forward_is_traced_once(model):
    """Under ``dynamic=True`` the model's float attributes (``nn.Embedding.norm_type``, the attention ``scaling``
    that ``ep_fuse::varlen_attention`` needs as a Python float) made Dynamo restart the analysis of every CB
    forward ("Restarting analysis due to _tensorify_python_scalars"): the forward was traced twice."""
    torch._dynamo.reset()  # a fresh trace (the compiled frame is cached on HF's method's code object)
    frames, restarts = _frames(), _restarts()
    out = model.generate_batch(PROMPTS, generation_config=_gen(),
                               continuous_batching_config=_cb(*paged_attention.cb_compile_configs(FAST)))
    assert _tokens(out) == _generate(model, PROMPTS)
    assert _frames() - frames == 1
    assert _restarts() == restarts, "Dynamo restarted the analysis of the CB forward"


def _stream(model, first: list[int], later: list[int]) -> tuple[dict, list[tuple[int, int]]]:
    """A server's request stream on one manager: ``first`` alone in the first batch, ``later`` added after it ran.
    Returns ``{request_id: output}`` and the padded ``(query tokens, cache rows read)`` of every batch."""
    from transformers.generation.continuous_batching.model_runner import ModelRunner

    sizes = []
    compute_batch = ModelRunner.compute_batch

    def recording(self, model_, batch_data):
        sizes.append((batch_data["input_ids"].shape[-1], batch_data["read_index"][0].shape[0]))
        return compute_batch(self, model_, batch_data)

    varlen, decode = paged_attention.cb_compile_configs(FAST)
    cfg = ContinuousBatchingConfig(num_blocks=16, page_size=32, max_batch_tokens=128, varlen_compile_config=varlen,
                                   decode_compile_config=decode)
    ModelRunner.compute_batch = recording
    manager = model.init_continuous_batching(generation_config=_gen(), continuous_batching_config=cfg)
    try:
        ids = [manager.add_request(list(range(5, 5 + n)), streaming=True) for n in first]
        manager.start()
        while (res := manager.get_result(timeout=120)) is not None and res.request_id != ids[0]:
            pass
        assert res is not None, "the first batch produced nothing"
        ids += [manager.add_request(list(range(5, 5 + n)), streaming=True) for n in later]
        done = {}
        while len(done) < len(ids) and (res := manager.get_result(timeout=120)) is not None:
            if res.is_finished():
                done[res.request_id] = res
    finally:
        manager.stop(block=True, timeout=60)
        ModelRunner.compute_batch = compute_batch
    return {i: done[i] for i in ids if i in done}, sizes


@pytest.fixture(scope="module")
def varlen_model():
    """The path CB takes on CUDA in bf16: ``ep_fuse::varlen_attention``, no mask (forced here on CPU). With HF's mask
    (CPU, fp32) a stream can compile a second graph on a contiguity guard of HF's mask slice
    (``attention_mask.stride()[2] != attention_mask.size()[3]``), not addressed."""
    from ep_fuse.hf import varlen_attention

    m = tiny.build("qwen3_moe", dtype=torch.float32)
    assert varlen_attention.enable(m, force=True)
    return m


@pytest.mark.parametrize("first", [[7], [40, 50]], ids=["one-request-first-batch", "full-first-batch"])
def test_request_stream_compiles_one_graph(varlen_model, first):
    """A stream whose batches pad to different sizes (64 and 128 query tokens) is one graph, whichever comes
    first. A first batch filling the padded sizes (``read_index`` = a whole row of HF's ``read_index_storage``)
    compiled a graph where duck sizing made the slice's size the storage's symbol, guarded
    ``read_index._base.size()[1] == read_index.size()[0]``, and the next smaller batch recompiled."""
    model = varlen_model
    torch._dynamo.reset()
    frames = _frames()
    out, sizes = _stream(model, first, STREAM_TAIL)
    prompts = [list(range(5, 5 + n)) for n in first + STREAM_TAIL]
    assert [o.generated_tokens for o in out.values()] == _generate(model, prompts)
    assert {q for q, _ in sizes} == {64, 128}, sizes  # both paddings were run
    assert (sizes[0][0] == 128) == (len(first) > 1), sizes
    assert _frames() - frames == 1, f"{_frames() - frames} graphs for batches {sizes}"


def test_warmup_graph_serves_smaller_batches(varlen_model):
    """HF's warmup (``generate_batch``'s default) compiles at the largest padded sizes; the batches after it, padded
    smaller, run that graph (they recompiled: the duck-sized guard of :func:`test_request_stream_compiles_one_graph`)."""
    model = varlen_model
    torch._dynamo.reset()
    frames, restarts = _frames(), _restarts()
    varlen, decode = paged_attention.cb_compile_configs(FAST)
    cfg = ContinuousBatchingConfig(num_blocks=16, page_size=32, max_batch_tokens=128, varlen_compile_config=varlen,
                                   decode_compile_config=decode)
    out = model.generate_batch(PROMPTS, generation_config=_gen(), continuous_batching_config=cfg)
    assert _tokens(out) == _generate(model, PROMPTS)
    assert _frames() - frames == 1 and _restarts() == restarts


def test_compiled_cb_forwards_are_wrapped_for_ep_fuse_only(model):
    from transformers.generation.configuration_utils import CompileConfig

    manager = model.init_continuous_batching(
        generation_config=_gen(), continuous_batching_config=_cb(*paged_attention.cb_compile_configs(FAST)))
    runner = manager._create_batch_processor().model_runner
    assert getattr(runner._compiled_varlen, "ep_fuse_cb_forward", False)
    other = CompileConfig(backend="inductor", fullgraph=True, mode="default")
    manager = model.init_continuous_batching(generation_config=_gen(), continuous_batching_config=_cb(other, other))
    runner = manager._create_batch_processor().model_runner
    assert not hasattr(runner._compiled_varlen, "ep_fuse_cb_forward")


# -- CUDA-graph modes -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_cb_compile_configs_decline_cuda_graph_modes(mode):
    with pytest.raises(ValueError, match="use_cuda_graph=True"):
        paged_attention.cb_compile_configs(mode=mode)
    with pytest.raises(ValueError, match="generation thread"):
        paged_attention.cb_compile_configs({"mode": mode})


def test_cb_compile_configs_pass_options_without_hf_default_mode():
    varlen, decode = paged_attention.cb_compile_configs({"executor": "eager"}, mode="max-autotune-no-cudagraphs")
    for cfg in (varlen, decode):
        d = cfg.to_dict()
        assert d["backend"] == "ep_fuse" and d["mode"] is None and not d["fullgraph"]
        assert d["options"] == {"executor": "eager", "mode": "max-autotune-no-cudagraphs"}


def test_backend_drops_cuda_graphs_outside_the_main_thread():
    patches = {"triton.cudagraphs": True, "max_autotune": False}
    assert cudagraphs_off_thread(patches, "cuda") is patches  # main thread: kept
    assert cudagraphs_off_thread(patches, "cpu") is patches
    seen = []
    t = threading.Thread(target=lambda: seen.append(cudagraphs_off_thread(patches, "cuda")), name="cb-loop")
    t.start()
    t.join()
    assert seen == [{"triton.cudagraphs": False, "max_autotune": False}]
    assert patches["triton.cudagraphs"] is True

"""One GPU: the serving loop keeps CUDA graphs, and the tiny HF models fuse and match eager on CUDA."""

import pytest
import torch

import ep_fuse
from ep_fuse.models import tiny as tiny_models

BF16 = torch.bfloat16


def _step():
    from test_generate import StaticCacheStep  # HF's static-cache update in miniature (tests/test_generate.py)

    return StaticCacheStep(h=256, slots=32, device="cuda")


def _cudagraph_skips() -> int:
    from torch._dynamo.utils import counters

    return sum(v for k, v in counters["inductor"].items() if "cudagraph_skips" in k)


def test_mutating_graph_keeps_cuda_graphs_under_ep_fuse():
    from torch._dynamo.utils import counters

    counters.clear()
    torch.manual_seed(0)
    ref, mod = _step(), _step()
    mod.load_state_dict(ref.state_dict())
    fn = torch.compile(mod, backend="ep_fuse", options={"mode": "reduce-overhead"})
    g = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for i in range(6):
            x = torch.randn(1, 256, device="cuda", generator=g, dtype=BF16)
            r = torch.randn(1, 256, device="cuda", generator=g, dtype=BF16)
            pos = torch.tensor([i], device="cuda")
            torch.testing.assert_close(fn(x, r, pos).float(), ref(x, r, pos).float(), rtol=0.02, atol=0.05)
    rep = ep_fuse.last_report()
    assert rep.inductor.direct and rep.inductor.cudagraph_safe_mutations, rep.inductor
    assert _cudagraph_skips() == 0, dict(counters["inductor"])
    assert int(mod.count) == int(ref.count) == 6
    torch.testing.assert_close(mod.cache.float(), ref.cache.float(), rtol=0.02, atol=0.05)


def test_generate_static_cache_keeps_cuda_graphs_and_matches_eager():
    transformers = pytest.importorskip("transformers")
    from torch._dynamo.utils import counters

    counters.clear()
    model = ep_fuse.prepare(tiny_models.build("qwen3_moe", dtype=BF16, device="cuda", seed=1))
    model.generation_config.pad_token_id = 0
    ids = torch.randint(1, 128, (4, 12), device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, cache_implementation="static",
              return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        ref = model.generate(ids, disable_compile=True, **kw)

        class Force:
            def __call__(self, input_ids, scores):
                tok = ref.sequences[:, input_ids.shape[1]]
                return torch.full_like(scores, float("-inf")).scatter_(1, tok[:, None], 0.0)

        cc = transformers.CompileConfig(backend="ep_fuse", mode="reduce-overhead")
        out = model.generate(ids, compile_config=cc, logits_processor=transformers.LogitsProcessorList([Force()]),
                             **kw)
    reps = ep_fuse.reports()
    assert reps and all(r.inductor.direct and r.inductor.cudagraph_safe_mutations for r in reps), reps
    assert reps[0].counts() == tiny_models.EXPECTED_SITES["qwen3_moe"][0]
    assert _cudagraph_skips() == 0, dict(counters["inductor"])
    # Inductor's analyses of repeated launch signatures (per layer, per tracing) come from ep_fuse's memo: every
    # signature here is launched in both layers and traced more than once, so most analyses are served
    done = reps[0].kernel_analyses
    assert 0 < done["computed"] < done["served"], done
    errs = [((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(out.logits, ref.logits)]
    # bf16 with random weights: an ulp difference can flip one token's top-k expert choice at a step, which
    # moves that step's error to ~2e-2 (seen on H200); typical steps stay near 5e-3
    errs_sorted = sorted(errs)
    assert errs_sorted[len(errs) // 2] < 1e-2 and max(errs) < 5e-2, f"per-step logits relative L2 {errs}"


@pytest.mark.parametrize("name", tiny_models.TINY_MODELS)
def test_tiny_hf_model_fuses_expected_sites_on_cuda(name):
    model = tiny_models.build(name, device="cuda")
    inp = tiny_models.example_inputs(device="cuda")
    with torch.no_grad():
        ref = model(**inp).logits
        out = torch.compile(model, backend="ep_fuse")(**inp).logits
    rep = ep_fuse.last_report()
    assert rep.counts() == tiny_models.EXPECTED_SITES[name][0], rep
    scale = ref.float().abs().max().item()
    torch.testing.assert_close(out.float(), ref.float(), rtol=0.03, atol=0.03 * scale)

"""The serving loop: graphs that mutate inputs (static KV cache) reach Inductor as Dynamo's graph, and
HF ``generate()`` with a static cache through ``backend="ep_fuse"`` equals eager."""

import pytest
import torch
from torch import nn

import ep_fuse

BF16 = torch.bfloat16


class StaticCacheStep(nn.Module):
    """A decode step in the shape of HF's static cache: ``index_copy_`` into a static-address buffer,
    an in-place counter, an add+RMSNorm the backend fuses."""

    def __init__(self, h: int = 64, slots: int = 16, device: str = "cpu") -> None:
        super().__init__()
        self.weight = nn.Parameter((torch.randn(h, device=device) * 0.1 + 1).to(BF16))
        self.cache = torch.zeros(slots, h, dtype=BF16, device=device)
        self.count = torch.zeros(1, dtype=torch.int64, device=device)
        torch._dynamo.mark_static_address(self.cache)
        torch._dynamo.mark_static_address(self.count)

    def forward(self, x: torch.Tensor, r: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        s = x + r
        hf = s.float()
        n = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * self.weight
        self.cache.index_copy_(0, pos, n)
        self.count.add_(1)
        return self.cache.sum(0, keepdim=True) + n


def _run(mod, backend_kwargs, steps=3):
    g = torch.Generator().manual_seed(0)
    fn = torch.compile(mod, **backend_kwargs) if backend_kwargs is not None else mod
    outs = []
    with torch.no_grad():
        for i in range(steps):
            x, r = torch.randn(1, 64, generator=g).to(BF16), torch.randn(1, 64, generator=g).to(BF16)
            outs.append(fn(x, r, torch.tensor([i])))
    return outs


def test_mutating_graph_reaches_inductor_directly_with_static_mutations():
    torch.manual_seed(0)
    ref_mod = StaticCacheStep()
    mod = StaticCacheStep()
    mod.load_state_dict(ref_mod.state_dict())
    ref = _run(ref_mod, None)
    out = _run(mod, dict(backend="ep_fuse", options={"executor": "inductor"}))
    rep = ep_fuse.last_report()
    assert rep.count("add_rms_norm") + rep.count("rms_norm") == 1
    hand = rep.inductor
    assert hand is not None and hand.direct, hand
    # the two buffers are mutated; Inductor sees them as static addresses, as backend="inductor" would,
    # so the mutations do not disqualify CUDA graphs (mode="reduce-overhead")
    assert len(hand.mutated_inputs) == 2 and hand.cudagraph_safe_mutations, hand
    for a, b in zip(out, ref):
        torch.testing.assert_close(a.float(), b.float(), rtol=0.02, atol=0.05)
    torch.testing.assert_close(mod.cache.float(), ref_mod.cache.float(), rtol=0.02, atol=0.05)
    assert int(mod.count) == int(ref_mod.count) == 3


def test_inductor_alone_sees_the_same_static_inputs():
    """ep_fuse's hand-off gives Inductor the same mutated/static input facts as backend="inductor"."""
    from torch._inductor import compile_fx as cfx

    seen = {}
    orig = cfx.compile_fx_inner

    def spy(gm, example_inputs, **kwargs):
        seen.setdefault("static", []).append(sorted(kwargs.get("static_input_idxs") or ()))
        return orig(gm, example_inputs, **kwargs)

    no_cache = {"fx_graph_cache": False}
    with torch._functorch.config.patch(enable_autograd_cache=False):  # a cache hit skips inner_compile
        _run(StaticCacheStep(), dict(backend=lambda gm, ex: cfx.compile_fx(gm, ex, inner_compile=spy,
                                                                          config_patches=no_cache)))
    torch._dynamo.reset()
    _run(StaticCacheStep(), dict(backend="ep_fuse", options={"executor": "inductor"}))
    assert ep_fuse.last_report().inductor.static_inputs == seen["static"][0]


def test_inductor_caches_are_keyed_on_this_ep_fuse(monkeypatch):
    """A graph cached by another ep_fuse (other fake-impl strides, say) must not be reused: ep_fuse adds
    a hash of its sources to torch.compiler.config.cache_key_tag while Inductor compiles."""
    from torch._inductor import compile_fx as cfx

    from ep_fuse.backend import ep_fuse_cache_tag

    seen = []
    orig = cfx.compile_fx

    def spy(*a, **k):
        seen.append(torch.compiler.config.cache_key_tag)
        return orig(*a, **k)

    monkeypatch.setattr(cfx, "compile_fx", spy)
    tag = ep_fuse_cache_tag()
    assert tag.startswith("ep_fuse-") and len(tag.split("-")[-1]) == 16
    _run(StaticCacheStep(), dict(backend="ep_fuse", options={"executor": "inductor"}), steps=1)
    # (compile_fx re-enters itself once to apply ep_fuse's Inductor config patches)
    assert seen and set(seen) == {tag} and torch.compiler.config.cache_key_tag == ""
    # the inline switches change how Inductor traces the provider ops: a graph cached under others is not reused
    from ep_fuse.config import EpFuseConfig

    assert ep_fuse_cache_tag(EpFuseConfig.from_options({"size_branches": False})) == tag + "-no-branches"
    seen.clear()
    torch._dynamo.reset()
    _run(StaticCacheStep(), dict(backend="ep_fuse", options={"executor": "inductor", "size_branches": False}), steps=1)
    assert seen and set(seen) == {tag + "-no-branches"}


class ReturnsAView(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.t(), x * 2


def test_output_aliasing_an_input_stays_behind_the_aot_wrapper():
    x = torch.randn(4, 3)
    with torch.no_grad():
        view, double = torch.compile(ReturnsAView(), backend="ep_fuse", options={"executor": "inductor"})(x)
    hand = ep_fuse.last_report().inductor
    assert not hand.direct and "alias" in hand.reason
    assert view._base is x or view.data_ptr() == x.data_ptr()
    torch.testing.assert_close(view, x.t())
    torch.testing.assert_close(double, x * 2)


@pytest.mark.hf
@pytest.mark.slow
def test_generate_static_cache_through_ep_fuse_equals_eager():
    transformers = pytest.importorskip("transformers")
    from ep_fuse.testing import tiny as tiny_models

    torch.manual_seed(0)
    model = ep_fuse.prepare(tiny_models.build("qwen3_moe", dtype=torch.float32))
    model.generation_config.pad_token_id = 0
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=6, do_sample=False, cache_implementation="static", return_dict_in_generate=True,
              output_logits=True)
    cc = transformers.CompileConfig(backend="ep_fuse", fullgraph=True, mode="default")
    cc._compile_all_devices = True  # HF compiles the decode step on CUDA only unless told otherwise
    with torch.no_grad():
        ref = model.generate(ids, disable_compile=True, **kw)
        out = model.generate(ids, compile_config=cc, **kw)
    reps = ep_fuse.reports()
    assert len(reps) == 1, [r.summary() for r in reps]  # the decode step, one graph
    rep = reps[0]
    assert rep.counts() == tiny_models.EXPECTED_SITES["qwen3_moe"][0]
    assert rep.inductor.direct and rep.inductor.mutated_inputs and rep.inductor.cudagraph_safe_mutations
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)

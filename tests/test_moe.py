"""The MoE experts family: reference semantics, every traced form, guards, HF models."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.moe_modules import MODULES, ArgsortIndexAdd

import ep_fuse
from ep_fuse.testing import tiny as tiny_models
pass
from ep_fuse.ops.moe import moe_experts_ref, moe_permute_ref, moe_unpermute_ref
from support.compiling import compile_and_run

BF16 = torch.bfloat16


def _routing(t, e, k, seed=0, invalid=0.0):
    g = torch.Generator().manual_seed(seed)
    w, ids = torch.randn(t, e, generator=g).softmax(-1).topk(k)
    if invalid:
        ids = torch.where(torch.rand(t, k, generator=g) < invalid, -1, ids)
    return w, ids


def _loop_oracle(x, ids, w, w13, w2):
    """Per token and slot, in fp64: sum_k w * down(silu(gate) * up)."""
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if not 0 <= e < w13.shape[0]:
                continue
            h = w13[e].double() @ x[t].double()
            act = torch.nn.functional.silu(h[:inter]) * h[inter:]
            out[t] += float(w[t, k]) * (w2[e].double() @ act)
    return out


# --------------------------------------------------------------------------- reference semantics
@settings(max_examples=25, deadline=None)
@given(t=st.integers(1, 9), k=st.integers(1, 4), e=st.integers(1, 6), invalid=st.sampled_from([0.0, 0.3, 1.0]),
       seed=st.integers(0, 100))
def test_permute_reference_is_stable_expert_major(t, k, e, invalid, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, e, (t, k), generator=g)
    ids = torch.where(torch.rand(t, k, generator=g) < invalid, -1, ids)
    x = torch.randn(t, 5, generator=g)
    rows, src2dst, seg = moe_permute_ref(x, ids, e)
    flat = ids.reshape(-1).tolist()
    expected_order = [j for ex in range(e) for j, v in enumerate(flat) if v == ex]  # stable, expert-major
    assert src2dst.dtype == torch.int64 and seg.dtype == torch.int64
    assert seg.tolist() == [0] + [sum(1 for v in flat if 0 <= v < ex + 1) for ex in range(e)]
    for dst, j in enumerate(expected_order):
        assert src2dst[j] == dst
        assert torch.equal(rows[dst], x[j // k])
    assert all(src2dst[j] == -1 for j, v in enumerate(flat) if not 0 <= v < e)
    assert not rows[len(expected_order):].any(), "tail rows are zero"


def test_unpermute_reference_weights_and_skips():
    y = torch.arange(12.0).reshape(6, 2)
    src2dst = torch.tensor([2, -1, 0, 5, -1, -1])  # T=3, K=2; token 2 has no valid slot
    w = torch.tensor([[0.5, 9.0], [2.0, 1.0], [7.0, 7.0]])
    out = moe_unpermute_ref(y, src2dst, w, 2, None)
    torch.testing.assert_close(out, torch.stack([0.5 * y[2], 2.0 * y[0] + y[5], torch.zeros(2)]))
    assert torch.equal(moe_unpermute_ref(y, src2dst, None, 2, None)[1], y[0] + y[5])


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_experts_reference_matches_loop_oracle(dtype):
    t, h, e, i, k = 7, 16, 5, 8, 3
    g = torch.Generator().manual_seed(1)
    x = torch.randn(t, h, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / 4).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) / 3).to(dtype)
    w, ids = _routing(t, e, k, invalid=0.2)
    out = moe_experts_ref(x, ids, w, w13, w2, None)
    assert out.dtype == torch.float32  # product of a bf16/fp32 output with fp32 weights
    oracle = _loop_oracle(x, ids, w, w13, w2)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), oracle, rtol=tol, atol=tol * oracle.abs().max().item())


def test_canonical_ops_pass_opcheck():
    t, h, e, i, k = 5, 8, 3, 4, 2
    x = torch.randn(t, h).to(BF16)
    w, ids = _routing(t, e, k, invalid=0.2)
    w13, w2 = torch.randn(e, 2 * i, h).to(BF16), torch.randn(e, h, i).to(BF16)
    rows, src2dst, seg = moe_permute_ref(x, ids, e)
    ops = torch.ops.ep_fuse
    torch.library.opcheck(ops.moe_permute.default, (x, ids, e))
    torch.library.opcheck(ops.grouped_gemm_swiglu.default, (rows, w13, seg))
    torch.library.opcheck(ops.grouped_gemm.default, (rows[:, :i].contiguous(), w2, seg))
    torch.library.opcheck(ops.grouped_gemm.default, (rows.float()[:, :i].contiguous(), w2.float(), seg))
    torch.library.opcheck(ops.moe_unpermute.default, (rows, src2dst, w, k, BF16))
    torch.library.opcheck(ops.moe_experts.default, (x, ids, w, w13, w2, BF16))


# --------------------------------------------------------------------------- hand-written forms
def _module_inputs(t=13, h=32, e=4, k=2):
    g = torch.Generator().manual_seed(3)
    w, ids = _routing(t, e, k, seed=3)
    return torch.randn(t, h, generator=g).to(BF16), ids, w


@pytest.mark.parametrize("name, variant", [("argsort_index_add", "index_add"), ("scatter_add", "scatter_add"),
                                           ("sglang_layout", "weights_after_gather"),
                                           ("sentinel_masked", "grouped_mm")])
def test_hand_written_forms_fuse_to_one_block(name, variant):
    mod = MODULES[name](4, 32, 16)
    args = _module_inputs()
    with torch.no_grad():
        ref = mod(*args)
    out = compile_and_run(mod, *args, executor="eager", providers={"cpu": ["reference"]})
    rep = ep_fuse.last_report()
    assert rep.counts() == {"moe_experts": 1}
    assert [m.variant for m in rep.matches] == [variant]
    canon = rep.ops_after_pass("canonicalize")
    assert canon.get("ep_fuse.moe_experts.default") == 1
    for gone in ("aten._grouped_mm.default", "aten.sort.stable", "aten.index_add.default", "aten.scatter_add.default",
                 "aten.masked_fill.Scalar", "aten.sort.default"):
        assert canon.get(gone, 0) == 0, gone
    after = rep.ops_after
    for stage in ("moe_permute", "grouped_gemm_swiglu", "grouped_gemm", "moe_unpermute"):
        assert after.get(f"ep_fuse.{stage}.default") == 1, after
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)


class _IndexAddIntoInput(ArgsortIndexAdd):
    """Accumulates into the tokens themselves (a residual add), not into zeros: a different function."""

    def forward(self, x, topk_ids, topk_weights):
        k = topk_ids.shape[1]
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        offs = torch.nn.functional.one_hot(flat, self.num_experts).sum(0).cumsum(0).to(torch.int32)
        y = self._experts(x[order // k], offs) * topk_weights.reshape(-1)[order].unsqueeze(-1).to(x.dtype)
        return x.clone().index_add_(0, order // k, y)


class _WrongTopK(ArgsortIndexAdd):
    """Maps slots to tokens with the wrong K (``order // 1``): rows of other tokens."""

    def forward(self, x, topk_ids, topk_weights):
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        offs = torch.nn.functional.one_hot(flat, self.num_experts).sum(0).cumsum(0).to(torch.int32)
        token = (order // 1).clamp(max=x.shape[0] - 1)
        y = self._experts(x[token], offs) * topk_weights.reshape(-1)[order].unsqueeze(-1)
        out = torch.zeros(x.shape, dtype=y.dtype)
        return out.index_add_(0, token, y).to(x.dtype)


class _CountsOfOtherExperts(ArgsortIndexAdd):
    """Counts over E+1 bins: offsets that do not describe the experts' segments."""

    def forward(self, x, topk_ids, topk_weights):
        k = topk_ids.shape[1]
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        offs = torch.nn.functional.one_hot(flat, self.num_experts + 1).sum(0).cumsum(0).to(torch.int32)[1:]
        y = self._experts(x[order // k], offs) * topk_weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros(x.shape, dtype=y.dtype).index_add_(0, order // k, y).to(x.dtype)


def test_clamped_batched_form_needs_topk_ids():
    """``clamp(ids, 0, E-1)`` is a no-op only for top-k ids: fused with a router, refused with raw ids."""
    from support.moe_modules import ClampedBatched, RoutedClampedBatched

    args = _module_inputs()
    routed = RoutedClampedBatched(4, 32, 16)
    with torch.no_grad():
        ref = routed(*args)
    out = compile_and_run(routed, *args, executor="eager", providers={"cpu": ["reference"]})
    rep = ep_fuse.last_report()
    assert [m.variant for m in rep.matches if m.pattern == "moe_experts"] == ["batched_mm"]
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)

    torch._dynamo.reset()
    raw = ClampedBatched(4, 32, 16)
    compile_and_run(raw, *args, executor="eager")
    rep = ep_fuse.last_report()
    assert "moe_experts" not in rep.counts()
    assert any("not a top-k output" in m.explain() for m in rep.near_misses), [m.explain() for m in rep.near_misses]


@pytest.mark.parametrize("cls", [_IndexAddIntoInput, _WrongTopK, _CountsOfOtherExperts])
def test_lookalikes_are_not_fused(cls):
    mod = cls(4, 32, 16)
    args = _module_inputs()
    with torch.no_grad():
        ref = mod(*args)
    out = compile_and_run(mod, *args, executor="eager")
    rep = ep_fuse.last_report()
    assert "moe_experts" not in rep.counts(), rep.summary()
    assert rep.ops_after_pass("canonicalize").get("aten._grouped_mm.default") == 2
    assert torch.equal(out, ref)


# --------------------------------------------------------------------------- HF models
HF_CASES = [("mixtral", "grouped_mm", BF16), ("mixtral", "grouped_mm", torch.float32),
            ("mixtral", "batched_mm", BF16), ("qwen2_moe", "grouped_mm", BF16), ("qwen3_moe", "batched_mm", BF16),
            ("deepseek_v3", "grouped_mm", BF16), ("deepseek_v3", "grouped_mm", torch.float32),
            ("deepseek_v3", "batched_mm", torch.float32)]


@pytest.mark.hf
@pytest.mark.parametrize("name, impl, dtype", HF_CASES)
def test_hf_experts_fuse_once_per_moe_layer(name, impl, dtype):
    model = tiny_models.build(name, dtype=dtype, experts_implementation=impl)
    inputs = tiny_models.example_inputs()
    with torch.no_grad():
        ref = model(**inputs).logits
        out = torch.compile(model, backend="ep_fuse", options={"executor": "eager",
                                                               "providers": {"cpu": ["reference"]}})(**inputs).logits
    rep = ep_fuse.last_report()
    expected = tiny_models.EXPECTED_SITES[name][0]["moe_experts"]
    blocks = [m for m in rep.matches if m.pattern == "moe_experts"]
    assert len(blocks) == expected
    assert {m.variant for m in blocks} == {impl}
    assert all(m.module_path.endswith("mlp.experts") for m in blocks)
    assert all(set(m.stages) == {"moe_permute", "grouped_gemm_swiglu", "grouped_gemm", "moe_unpermute"}
               for m in blocks)
    gemm = {"grouped_mm": "aten._grouped_mm.default", "batched_mm": "aten.bmm.default"}[impl]
    if dtype == torch.float32 and impl == "grouped_mm":
        gemm = "transformers.grouped_mm_fallback.default"
    assert rep.ops_before[gemm] - rep.ops_after.get(gemm, 0) == 2 * expected, "both expert GEMMs of each block"
    for gone in ("aten.histc.default", "aten.index_put.default", "aten.sort.default"):
        assert rep.ops_after.get(gone, 0) == 0, gone
    # bf16: a GEMM with another accumulation order than HF's (bmm per slot) moves logits by a few ulps
    tol = 1e-4 if dtype == torch.float32 else 4e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * ref.float().abs().max().item())


@pytest.mark.hf
def test_hf_experts_under_inductor_on_cpu():
    """Under Inductor without a fused provider the block's reference is inlined: Inductor compiles it."""
    model = tiny_models.build("mixtral", experts_implementation="grouped_mm")
    inputs = tiny_models.example_inputs()
    with torch.no_grad():
        ref = model(**inputs).logits
        out = torch.compile(model, backend="ep_fuse", options={"executor": "inductor",
                                                               "providers": {"cpu": ["reference"]}})(**inputs).logits
    rep = ep_fuse.last_report()
    assert rep.counts()["moe_experts"] == 2
    assert rep.ops_after.get("aten._grouped_mm.default") == 4  # bf16: the traceable reference
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.float().abs().max().item())


@pytest.mark.hf
def test_gpt_oss_glu_experts_are_not_swiglu():
    model = tiny_models.build("gpt_oss")
    with torch.no_grad():
        torch.compile(model, backend="ep_fuse", options={"executor": "eager"})(**tiny_models.example_inputs())
    rep = ep_fuse.last_report()
    assert "moe_experts" not in rep.counts()
    assert rep.ops_after.get("aten._grouped_mm.default") == 4
    # the experts' sorts (the routers fuse: their bf16 softmax with score_dtype=bf16), and each layer's routed
    # experts named by the backend: the fused router, the ids selecting experts through a sort and grouped GEMMs
    assert [m.explain().split(" ")[0] for m in rep.near_misses if m.anchor_op != "routed experts"] == ["sort", "sort_1"]
    routed = [m.explain() for m in rep.near_misses if m.anchor_op == "routed experts"]
    assert len(routed) == 2 and all("router: fused: moe_gating" in r and "_grouped_mm" in r for r in routed), routed
    assert rep.count("moe_gating") == 2


# --------------------------------------------------------------------------- gated activations (transformers 5.24)
GATED_CASES = [(act, impl) for act in ("silu_clamp", "silu_clamp_post", "silu_fp32", "softcap_fp32")
               for impl in ("grouped_mm", "batched_mm")]


def _gated_args(dtype, t=13, h=32, e=4, k=2):
    g = torch.Generator().manual_seed(3)
    w, ids = _routing(t, e, k, seed=3)
    return torch.randn(t, h, generator=g).to(dtype), ids, w


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("act, impl", GATED_CASES)
@pytest.mark.parametrize("provider", ["reference", "triton"])
def test_gated_activation_forms_fuse(act, impl, dtype, provider):
    from support.moe_modules import GATED

    mod = GATED[act](4, 32, 16, dtype=dtype, impl=impl, scale=3.0)  # large enough that clamps and caps bind
    args = _gated_args(dtype)
    with torch.no_grad():
        ref = mod(*args)
    out = compile_and_run(mod, *args, executor="eager", providers={"cpu": [provider]})
    rep = ep_fuse.last_report()
    assert rep.count("moe_experts") == 1, rep.summary()
    assert [m.variant for m in rep.matches] == [impl]
    assert rep.matches[0].stages == {s: provider for s in ("moe_permute", "grouped_gemm_swiglu", "grouped_gemm",
                                                           "moe_unpermute")}
    assert out.dtype == ref.dtype and out.shape == ref.shape and out.stride() == ref.stride()
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.float().abs().max().item())
    if provider == "reference" and impl == "grouped_mm" and dtype != torch.float32:
        # bf16: the same rounding points as HF, bit for bit; fp32 (checked at 1e-5 above) differs by an ulp on CPUs
        # whose GEMM kernels sum _grouped_mm's fallback and mm in different orders (seen on AMD EPYC)
        assert torch.equal(out, ref), "the reference rounds as HF does"
    # the block carries the activation: plain SwiGLU on the same weights differs (fp32 SwiGLU in fp32 is SwiGLU)
    x, ids, w = args
    plain = moe_experts_ref(x, ids, w.to(x.dtype) if impl == "batched_mm" else w, mod.gate_up_proj, mod.down_proj,
                            x.dtype)
    if act != "silu_fp32":
        assert not torch.allclose(plain.float(), ref.float(), rtol=1e-2, atol=1e-2)


def test_step37_unclamped_layers_are_plain_swiglu():
    """Step-3.7 clamps to +-inf on its unclamped layers: matched as plain SwiGLU (quant and EP keep it)."""
    from support.moe_modules import ClampedAfterSiLU

    mod = ClampedAfterSiLU(4, 32, 16)
    mod.limit = float("inf")
    args = _gated_args(BF16)
    with torch.no_grad():
        ref = mod(*args)
    out = compile_and_run(mod, *args, executor="eager", providers={"cpu": ["reference"]}, quant="w8a8_int8")
    rep = ep_fuse.last_report()
    assert rep.count("moe_experts") == 1
    assert rep.ops_after.get("ep_fuse.grouped_gemm_w8a8_swiglu_quant.default") == 1, rep.ops_after
    assert out.shape == ref.shape and out.dtype == ref.dtype


class _Step37Layers(torch.nn.Module):
    """Step-3.7's sparse MoE blocks of every layer of ``cfg``, each run on the same tokens, summed."""

    def __init__(self, cfg) -> None:
        from transformers.models.step3p7.modeling_step3p7 import Step3p7SparseMoeBlock

        super().__init__()
        self.layers = torch.nn.ModuleList(Step3p7SparseMoeBlock(cfg, i) for i in range(cfg.num_hidden_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(layer(x) for layer in self.layers)


@pytest.mark.hf
def test_step37_per_layer_limits_fuse_each_layer_with_its_own_limit(monkeypatch):
    """Step-3.7's per-layer ``swiglu_limits`` with 0 = no clamp (transformers 5.25: the layer's ``limit`` is None;
    5.24: +inf): every layer's experts fuse, the 0 layer as plain SwiGLU (not clamped to 0), each other layer with
    its own limit; equal to eager, and the limits bind (swapping them changes the output)."""
    from transformers.models.step3p7.configuration_step3p7 import Step3p7TextConfig

    from ep_fuse.ops import moe as moe_ops

    limits = [0.0, 0.05, 0.2]
    cfg = Step3p7TextConfig(hidden_size=32, moe_intermediate_size=16, share_expert_dim=16, n_routed_experts=4,
                            num_experts_per_tok=2, num_hidden_layers=3, swiglu_limits=limits)
    cfg._experts_implementation = "grouped_mm"  # what prepare sets on a transformers 5.25 model
    torch.manual_seed(0)
    mod = _Step37Layers(cfg).eval()
    with torch.no_grad():
        for name, p in mod.named_parameters():  # routed experts large enough that both limits bind
            p.copy_(torch.randn(p.shape) * (3.0 if ".experts." in name else 1.0) / p.shape[-1] ** 0.5)
    x = torch.randn(1, 11, 32)
    with torch.no_grad():
        ref = mod(x)
    ep_fuse.prepare(mod)
    seen = []
    gated_act = moe_ops.gated_act

    def spy(gate, up, act="silu", limit=None, *caps):
        seen.append((act, limit))
        return gated_act(gate, up, act, limit, *caps)

    monkeypatch.setattr(moe_ops, "gated_act", spy)
    out = compile_and_run(mod, x, executor="eager", providers={"cpu": ["reference"]}, patterns=["moe_experts"])
    assert ep_fuse.last_report().count("moe_experts") == 3, ep_fuse.last_report().summary()
    assert sorted(seen, key=str) == [("silu", None), ("silu_clamp_post", 0.05), ("silu_clamp_post", 0.2)]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    layer1, layer2 = mod.layers[1].experts, mod.layers[2].experts
    layer1.limit, layer2.limit = layer2.limit, layer1.limit
    with torch.no_grad():
        swapped = mod(x)
    assert (swapped - ref).abs().max() > 100 * (out - ref).abs().max() + 1e-3


@pytest.mark.parametrize("cls_name, dtype, reason", [
    ("AsymmetricClamp", BF16, "not one limit L"),
    ("AsymmetricClamp", torch.float32, "not one limit L"),
    ("Fp64Up", BF16, "cast to torch.float64, expected torch.float32"),
    ("MiscappedSwiGLU", BF16, "the scale is not the cap"),
    ("MiscappedSwiGLU", torch.float32, "the scale is not the cap"),
])
def test_gated_lookalikes_are_not_fused(cls_name, dtype, reason):
    from support import moe_modules

    mod = getattr(moe_modules, cls_name)(4, 32, 16, dtype=dtype, scale=3.0)
    args = _gated_args(dtype)
    with torch.no_grad():
        ref = mod(*args)
    out = compile_and_run(mod, *args, executor="eager")
    rep = ep_fuse.last_report()
    assert "moe_experts" not in rep.counts(), rep.summary()
    assert any(reason in m.explain() for m in rep.near_misses), [m.explain() for m in rep.near_misses]
    assert torch.equal(out, ref)


@pytest.mark.parametrize("quant", ["w8a8_int8", "fp8_block"])
def test_gated_activation_stays_unquantized_under_quant(quant):
    """The quantized expert blocks compute SwiGLU only: a clamped block is fused and kept in bf16, never rewritten
    into a quantized block that would drop its clamp."""
    from support.moe_modules import ClampedSwiGLU

    mod = ClampedSwiGLU(4, 32, 16, scale=3.0)
    args = _gated_args(BF16)
    with torch.no_grad():
        ref = mod(*args)
    out = compile_and_run(mod, *args, executor="eager", quant=quant)
    rep = ep_fuse.last_report()
    assert rep.counts().get("moe_experts") == 1, rep.summary()
    stages = {s for m in rep.matches for s in m.stages}
    assert not any("w8a8" in s or "fp8" in s for s in stages), stages
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.float().abs().max().item())


# --------------------------------------------------------------------------- block layouts (transformers 5.24)
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("layout", ["scaled", "parallel", "shared_bmm"])
@pytest.mark.parametrize("act", ["silu", "silu_clamp"])
def test_routed_experts_fuse_inside_block_layouts(layout, act, dtype):
    """Routed scaling on the experts' output + RMSNorm (Beam, Laguna, Step-3.7), a parallel dense MLP (summed),
    3-D shared experts on ``bmm`` (Inkling): the routed experts fuse; the rest stays as it was."""
    from support.moe_modules import GATED, HFExperts, RoutedBlock

    experts = (HFExperts if act == "silu" else GATED[act])(4, 32, 16, dtype=dtype, scale=3.0)
    mod = RoutedBlock(experts, 32, layout)
    x = _gated_args(dtype)[0]
    with torch.no_grad():
        ref = mod(x)
    out = compile_and_run(mod, x, executor="eager", providers={"cpu": ["reference"]})
    rep = ep_fuse.last_report()
    assert rep.count("moe_experts") == 1, rep.summary()
    assert [m.variant for m in rep.matches if m.pattern == "moe_experts"] == ["grouped_mm"]
    if layout == "shared_bmm":
        assert rep.ops_after.get("aten.bmm.default") == 3, "the shared experts' bmm stay"
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.float().abs().max().item())

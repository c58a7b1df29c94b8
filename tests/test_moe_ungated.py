"""Non-gated relu² experts (NemotronH, ``down(relu(up(x)) ** 2)``, ``act="relu2"`` of ``moe_experts``): the reference,
the Triton epilogue, the traced HF forms and look-alikes, the eager ``.item()`` loop and remote-code style
``nn.ModuleList`` loops converted by ``prepare`` (``tests/support/ungated_moe_modules.py``)."""

import logging
from types import SimpleNamespace

import pytest
import torch
from support import ungated_moe_modules as U
from support.compiling import compile_and_run
from support.norm_cases import ulp_close

import ep_fuse
import ep_fuse.providers  # noqa: F401  (registers torch.ops.ep_fuse_triton.*)
from ep_fuse.surgery.expert_loops import StackedExperts
from ep_fuse.ops.moe import act_problem, grouped_gemm_swiglu_ref, moe_experts_ref
from ep_fuse.providers.npu.moe import gemm_swiglu_supports
from ep_fuse.providers.triton import unverified
from ep_fuse.providers.triton.grouped_gemm import check_grouped_gemm_swiglu_call, grouped_gemm_swiglu_kernel

BF16, F32 = torch.bfloat16, torch.float32
RELU2 = ("relu2", None, None, None)
STAGES = ("moe_permute", "grouped_gemm_swiglu", "grouped_gemm", "moe_unpermute")


def _case(counts, tail, n, k, dtype, seed=0):
    """``(x [M, k], w_up [E, n, k], seg_indptr)``."""
    g = torch.Generator().manual_seed(seed)
    seg = torch.tensor([0, *counts], dtype=torch.int64).cumsum(0)
    x = torch.randn(sum(counts) + tail, k, generator=g).to(dtype)
    w = (2 * torch.randn(len(counts), n, k, generator=g) / k**0.5).to(dtype)
    return x, w, seg


def _routed(dtype, t=13, h=32, e=4, k=2, seed=3):
    g = torch.Generator().manual_seed(seed)
    w, ids = torch.randn(t, e, generator=g).softmax(-1).topk(k)
    return torch.randn(t, h, generator=g).to(dtype), ids, w


# --------------------------------------------------------------------------- reference and kernel
def test_reference_is_relu_squared_of_the_up_gemm():
    x, ids, w = _routed(F32)
    mod = U.UngatedExperts(4, 32, 16, dtype=F32)
    out = moe_experts_ref(x, ids, w, mod.up_proj, mod.down_proj, F32, *RELU2)
    oracle = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            h = torch.relu(mod.up_proj[e].double() @ x[t].double()) ** 2
            oracle[t] += float(w[t, s]) * (mod.down_proj[e].double() @ h)
    torch.testing.assert_close(out.double(), oracle, rtol=1e-5, atol=1e-5)
    x, wu, seg = _case([2, 0, 3], 2, 16, 32, F32)
    y = grouped_gemm_swiglu_ref(x, wu, seg, *RELU2)
    assert y.shape == (7, 16) and torch.equal(y[5:], torch.zeros(2, 16)) and (y >= 0).all()


def test_activation_arguments_are_checked():
    assert act_problem(*RELU2) is None
    assert "limit" in act_problem("relu2", 1.0, None, None)
    assert "soft caps" in act_problem("relu2", None, 1.0, None)
    x, wu, seg = _case([2], 0, 8, 16, BF16)
    with pytest.raises(ValueError, match="limit"):
        grouped_gemm_swiglu_ref(x, wu, seg, "relu2", 1.0)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("regime", ["decode", "prefill"])
def test_triton_epilogue_matches_the_reference(dtype, regime):
    counts = [1, 0, 2, 1] if regime == "decode" else [9, 0, 20, 3]
    x, wu, seg = _case(counts, 3, 24, 32, dtype, seed=1)  # 24 up rows: no gate|up halves
    assert check_grouped_gemm_swiglu_call((x, wu, seg, *RELU2)) is None
    out, ref = grouped_gemm_swiglu_kernel(x, wu, seg, *RELU2), grouped_gemm_swiglu_ref(x, wu, seg, *RELU2)
    assert out.shape == ref.shape == (x.shape[0], 24) and out.dtype == ref.dtype and out.stride() == ref.stride()
    end = int(seg[-1])
    assert torch.equal(out[end:], torch.zeros_like(out[end:])), "tail rows must be zero"
    if dtype == F32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        ulp_close(out, ref, dtype)
    assert not torch.allclose(ref.float(), torch.relu(ref.float()).sqrt(), atol=1e-2), "the square is applied"


def test_relu2_is_declined_on_cuda_until_checked(monkeypatch):
    """Cleared by tests/gpu/test_gpu_moe_forms.py; listed again here, the provider declines it on CUDA only."""
    monkeypatch.delenv(unverified.ENV, raising=False)
    assert "grouped_gemm_swiglu:relu2" not in unverified.UNVERIFIED_ON_GPU
    monkeypatch.setitem(unverified.UNVERIFIED_ON_GPU, "grouped_gemm_swiglu:relu2", "not run on a GPU")
    x, wu, seg = _case([2], 0, 8, 16, BF16)
    cuda = SimpleNamespace(dtype=x.dtype, shape=x.shape, device=torch.device("cuda"), dim=x.dim, stride=x.stride)
    assert "not cleared for GPUs" in unverified.gpu_unverified("grouped_gemm_swiglu:relu2", cuda)
    assert unverified.gpu_unverified("grouped_gemm_swiglu:relu2", x) is None  # the interpreter runs it


def test_npu_declines_relu2():
    x, wu, seg = _case([2, 3], 1, 8, 16, BF16)
    assert "npu_swiglu computes plain SwiGLU only" in gemm_swiglu_supports((x, wu, seg, *RELU2))


# --------------------------------------------------------------------------- traced forms
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("provider", ["reference", "triton"])
def test_hf_ungated_experts_fuse(impl, dtype, provider):
    mod = U.UngatedExperts(4, 32, 16, dtype=dtype, impl=impl)
    args = _routed(dtype)
    with torch.no_grad():
        ref = mod(*args)
    out = compile_and_run(mod, *args, executor="eager", providers={"cpu": [provider]})
    rep = ep_fuse.last_report()
    assert rep.count("moe_experts") == 1, rep.summary()
    assert [m.variant for m in rep.matches] == [impl]
    assert rep.matches[0].stages == {s: provider for s in STAGES}
    assert out.dtype == ref.dtype and out.shape == ref.shape and out.stride() == ref.stride()
    for gone in ("aten.relu.default", "aten.pow.Tensor_Scalar"):
        assert rep.ops_after.get(gone, 0) == 0, gone
    if dtype == F32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.float().abs().max().item())
    if provider == "reference" and impl == "grouped_mm" and dtype != torch.float32:
        # bf16: the same rounding points as HF, bit for bit; fp32 (checked at 1e-5 above) differs by an ulp on CPUs
        # whose GEMM kernels sum _grouped_mm's fallback and mm in different orders (seen on AMD EPYC)
        assert torch.equal(out, ref), "the reference rounds as HF does"


@pytest.mark.parametrize("name, reason", [
    ("relu_cubed", "expected 2, got 3"),
    ("gelu_squared", "expected aten.relu.default, got aten.gelu.default"),
    ("squared_no_relu", "expected aten.relu.default"),
    ("relu_times_up", "must be the same node as 'relu'"),
])
def test_ungated_lookalikes_are_not_fused(name, reason):
    mod = U.LOOKALIKES[name]()
    args = _routed(BF16)
    with torch.no_grad():
        ref = mod(*args)
    out = compile_and_run(mod, *args, executor="eager")
    rep = ep_fuse.last_report()
    assert "moe_experts" not in rep.counts(), rep.summary()
    assert any(reason in m.explain() for m in rep.near_misses), [m.explain() for m in rep.near_misses]
    assert torch.equal(out, ref)


@pytest.mark.parametrize("quant", ["w8a8_int8", "fp8_block"])
def test_relu2_block_stays_unquantized(quant):
    """The quantized blocks compute SwiGLU only: the relu² block is fused and kept in bf16."""
    mod = U.UngatedExperts(4, 32, 16)
    args = _routed(BF16)
    with torch.no_grad():
        ref = mod(*args)
    out = compile_and_run(mod, *args, executor="eager", quant=quant)
    rep = ep_fuse.last_report()
    assert rep.counts().get("moe_experts") == 1, rep.summary()
    assert not any("w8a8" in s or "fp8" in s for m in rep.matches for s in m.stages)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.float().abs().max().item())


# --------------------------------------------------------------------------- loops
def test_item_loop_breaks_the_graph_and_gets_no_block():
    """The model's own per-expert loop (``expert_idx.item()``): what ``prepare`` switches away from."""
    mod = U.UngatedExperts(4, 32, 16, impl="eager")
    args = _routed(BF16)
    with torch.no_grad():
        ref = mod(*args)
    out = compile_and_run(mod, *args, executor="eager")
    assert sum(r.count("moe_experts") for r in ep_fuse.reports()) == 0
    assert torch.equal(out, ref)


@pytest.mark.hf
@pytest.mark.slow
def test_tiny_nemotron_h_eager_loop_is_switched_by_prepare():
    from ep_fuse.testing import tiny

    model = tiny.build("nemotron_h")
    inputs = tiny.example_inputs()
    with torch.no_grad():
        model.set_experts_implementation("grouped_mm")
        ref = model(**inputs).logits
        model.set_experts_implementation("eager")  # the .item() loop
        loop = model(**inputs).logits
    ep_fuse.prepare(model)
    out = compile_and_run(lambda: model(**inputs).logits, executor="eager", providers={"cpu": ["reference"]})
    assert len(ep_fuse.reports()) == 1
    assert ep_fuse.last_report().counts() == tiny.EXPECTED_SITES["nemotron_h"][0]
    assert {m.stages["grouped_gemm_swiglu"] for m in ep_fuse.last_report().matches if m.pattern == "moe_experts"} \
        == {"reference"}
    # bitwise HF's grouped_mm; from 5.25 on, HF's own loop sums the experts in bf16 (5.24: fp32), so it differs from
    # grouped_mm by that rounding
    assert torch.equal(out, ref)
    torch.testing.assert_close(out, loop, rtol=2e-2, atol=1e-2)


@pytest.mark.hf
@pytest.mark.parametrize("dtype, provider", [(F32, "reference"),
                                             pytest.param(BF16, "triton", marks=pytest.mark.slow)])
def test_module_list_loop_converts_and_fuses(dtype, provider, caplog):
    model = U.LoopModel().to(dtype).eval()
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        ref = model(x)
    keys, numel = list(model.state_dict()), sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        expert1 = model.layers[0].experts[1](x[0])
    with caplog.at_level(logging.INFO, logger="ep_fuse"):
        ep_fuse.prepare(model)
    converted = [r.getMessage() for r in caplog.records if "stacked into" in r.getMessage()]
    assert len(converted) == 2 and all("experts.up_proj/down_proj, moe replaced" in m for m in converted), caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    experts = model.layers[0].experts
    assert isinstance(experts, StackedExperts) and not experts.has_gate and experts.up_proj.shape == (8, 16, 32)
    assert list(model.state_dict()) == keys and sum(p.numel() for p in model.parameters()) == numel
    with torch.no_grad():
        assert torch.equal(experts[1](x[0]), expert1), "indexing the stacked experts still runs one expert"
    out = compile_and_run(model, x, executor="eager", providers={"cpu": [provider]})
    assert len(ep_fuse.reports()) == 1, "one graph"
    rep = ep_fuse.last_report()
    assert rep.count("moe_experts") == 2 and rep.count("moe_gating") == 2, rep.summary()
    tol = 1e-5 if dtype == F32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * ref.float().abs().max().item())


@pytest.mark.hf
def test_module_list_loop_with_another_activation_is_refused(caplog):
    model = U.LoopModel(layers=1, act=torch.nn.GELU()).eval()
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(x)
    with caplog.at_level(logging.INFO, logger="ep_fuse"):
        ep_fuse.prepare(model)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "is not relu(x) ** 2" in warnings[0], caplog.text
    assert type(model.layers[0].experts) is torch.nn.ModuleList and "moe" not in vars(model.layers[0])
    with torch.no_grad():
        assert torch.equal(model(x), ref)

"""W8A8 int8 routed experts (``quant="w8a8_int8"``): references, Triton kernels, the quant pass, NPU chain.

* references (``ep_fuse/ops/w8a8.py``) against a direct fp64 computation of the quantized math;
* Triton kernels (interpreter) against the references;
* the quant pass on a hand-written module and a tiny HF Mixtral, eager and Inductor executors: op counts,
  output close to bf16, weights quantized once (a recompile reuses the cache);
* an already-int8 module (the accepted convention, :class:`Int8Experts`) used as it is;
* the Ascend chain (``ep_fuse/providers/npu/w8a8.py``) on the documented-semantics double.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from support.moe_modules import routed_case

import ep_fuse
from ep_fuse.testing import tiny as tiny_models
from ep_fuse.config import ConfigError, EpFuseConfig
from ep_fuse.ops import w8a8 as R
from ep_fuse.ops.moe import moe_permute_ref
from ep_fuse.passes.weight_eval import WEIGHT_CACHE
from ep_fuse.providers.triton import w8a8 as T
from support.compiling import compile_and_run

BF16 = torch.bfloat16
W8A8_OPS = ("quant_per_token", "grouped_gemm_w8a8_swiglu_quant", "grouped_gemm_w8a8")


def op_count(hist: dict[str, int], name: str) -> int:
    """Calls of canonical/provider op ``name`` (any namespace) in an op histogram."""
    return sum(v for op, v in hist.items() if op.count(".") >= 2 and op.split(".")[1] == name)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def routed(t: int, k: int, e: int, h: int, seed: int = 0, invalid: bool = True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(BF16)
    ids = torch.randint(0, e, (t, k), generator=g)
    if invalid and t > 1:
        ids[0, 0] = -1
        ids[-1, -1] = e + 2  # another rank's expert
    rows, src2dst, seg = moe_permute_ref(x, ids, e)
    return x, ids, rows, src2dst, seg


def weights(e: int, h: int, i: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    return R.quantize_weight(w13), R.quantize_weight(w2)


# --------------------------------------------------------------------------- references vs fp64 math
def test_quantize_rows_convention():
    x = torch.tensor([[0.0, 0.0, 0.0], [1.0, -0.5, 0.25], [-3.0, 1.5, 0.0119]], dtype=torch.float32)
    q, s = R.quantize_rows(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    assert q[0].tolist() == [0, 0, 0] and s[0] == 0
    assert q[1].tolist() == [127, -64, 32]  # 63.5 -> 64 (half to even), 31.75 -> 32
    assert torch.allclose(s, torch.tensor([0.0, 1 / 127, 3 / 127]))
    assert int(q.abs().max()) == 127


def test_references_match_fp64_quantized_math():
    t, k, e, h, i = 12, 2, 4, 48, 24
    _x, _ids, rows, _src, seg = routed(t, k, e, h)
    (w13q, w13s), (w2q, w2s) = weights(e, h, i)
    xq, xs = R.quant_per_token_ref(rows)
    aq, a_s = R.grouped_gemm_w8a8_swiglu_quant_ref(xq, xs, w13q, w13s, seg)
    y = R.grouped_gemm_w8a8_ref(aq, a_s, w2q, w2s, seg, torch.float32)
    # direct fp64: dequantized operands, per-row expert lookup
    bounds = seg.tolist()
    expert = torch.full((rows.shape[0],), -1)
    for ei in range(e):
        expert[bounds[ei]:bounds[ei + 1]] = ei
    xd = xq.double() * xs.double()[:, None]
    h1 = torch.zeros(rows.shape[0], 2 * i, dtype=torch.float64)
    y2 = torch.zeros(rows.shape[0], h, dtype=torch.float64)
    ad = aq.double() * a_s.double()[:, None]
    for r in range(rows.shape[0]):
        ei = int(expert[r])
        if ei >= 0:
            h1[r] = (w13q[ei].double() * w13s[ei].double()[:, None]) @ xd[r]
            y2[r] = (w2q[ei].double() * w2s[ei].double()[:, None]) @ ad[r]
    act = F.silu(h1[:, :i]) * h1[:, i:]
    # requant codes: within one code of the fp64 rounding (fp32 epilogue), scales to fp32 precision
    amax = act.abs().amax(-1)
    torch.testing.assert_close(a_s.double(), amax / 127, rtol=1e-5, atol=1e-12)
    codes = torch.where(amax[:, None] > 0, torch.round(act * 127 / amax.clamp(min=1e-30)[:, None]), 0)
    assert (aq.double() - codes).abs().max() <= 1
    torch.testing.assert_close(y.double(), y2, rtol=1e-5, atol=1e-6)
    tail = bounds[-1]
    assert not aq[tail:].any() and not a_s[tail:].any() and not y[tail:].any()
    # quantization error vs the unquantized math is that of 8 bits
    w13 = R.dequantize_weight(w13q, w13s).double()
    h_exact = torch.stack([w13[max(int(expert[r]), 0)] @ rows[r].double() for r in range(tail)])
    assert rel_l2(h1[:tail], h_exact) < 0.02


def test_canonical_ops_pass_opcheck():
    t, k, e, h, i = 6, 2, 3, 32, 16
    _x, _ids, rows, _src, seg = routed(t, k, e, h)
    (w13q, w13s), (w2q, w2s) = weights(e, h, i)
    ops = torch.ops.ep_fuse
    xq, xs = ops.quant_per_token(rows)
    aq, a_s = ops.grouped_gemm_w8a8_swiglu_quant(xq, xs, w13q, w13s, seg)
    for op, args in ((ops.quant_per_token.default, (rows,)),
                     (ops.grouped_gemm_w8a8_swiglu_quant.default, (xq, xs, w13q, w13s, seg)),
                     (ops.grouped_gemm_w8a8.default, (aq, a_s, w2q, w2s, seg, BF16))):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


# --------------------------------------------------------------------------- Triton (interpreter) vs reference
TRITON_CASES = [(5, 2, 4, 64, 32), (40, 2, 4, 96, 48), (3, 1, 8, 70, 24), (1, 2, 2, 32, 16)]


@pytest.mark.parametrize("t, k, e, h, i", TRITON_CASES)
def test_triton_kernels_match_reference(t, k, e, h, i):
    _x, _ids, rows, _src, seg = routed(t, k, e, h, seed=t)
    (w13q, w13s), (w2q, w2s) = weights(e, h, i, seed=t + 1)
    q, s = T.quant_per_token_kernel(rows)
    qr, sr = R.quant_per_token_ref(rows)
    torch.testing.assert_close(s, sr)
    assert (q.int() - qr.int()).abs().max() <= 1 and (q != qr).float().mean() < 0.01
    aq, a_s = T.grouped_gemm_w8a8_swiglu_quant_kernel(qr, sr, w13q, w13s, seg)
    aqr, asr = R.grouped_gemm_w8a8_swiglu_quant_ref(qr, sr, w13q, w13s, seg)
    torch.testing.assert_close(a_s, asr, rtol=1e-5, atol=1e-8)
    assert (aq.int() - aqr.int()).abs().max() <= 1 and (aq != aqr).float().mean() < 0.01
    for dtype in (BF16, torch.float32):
        y = T.grouped_gemm_w8a8_kernel(aqr, asr, w2q, w2s, seg, dtype)
        yr = R.grouped_gemm_w8a8_ref(aqr, asr, w2q, w2s, seg, dtype)
        assert y.dtype == dtype
        torch.testing.assert_close(y, yr, rtol=1e-5 if dtype == torch.float32 else 8e-3, atol=1e-6)


def test_triton_quant_wide_rows_two_pass(monkeypatch):
    from ep_fuse.providers.triton import w8a8_kernel

    monkeypatch.setattr(w8a8_kernel, "QUANT_BLOCK", 32)
    x = torch.randn(3, 100).to(BF16)
    x[1] = 0
    q, s = T.quant_per_token_kernel(x)
    qr, sr = R.quant_per_token_ref(x)
    torch.testing.assert_close(s, sr)
    assert (q.int() - qr.int()).abs().max() <= 1


# --------------------------------------------------------------------------- the quant pass
def test_quant_option_is_validated():
    assert EpFuseConfig.from_options({"quant": "w8a8_int8"}).quant == "w8a8_int8"
    with pytest.raises(ConfigError, match="quant"):
        EpFuseConfig.from_options({"quant": "w8a8"})


@pytest.mark.parametrize("executor", ["eager", "inductor"])
def test_quant_pass_on_module(executor):
    mod, args = routed_case()
    WEIGHT_CACHE.clear()
    with torch.no_grad():
        ref = mod(*args)
    out = compile_and_run(mod, *args, executor=executor, quant="w8a8_int8")
    rep = ep_fuse.last_report()
    assert rep.counts() == {"moe_experts": 1}
    for name in W8A8_OPS:
        assert op_count(rep.ops_after, name) == 1, (name, rep.ops_after)
    assert not any("grouped_gemm_swiglu" in op for op in rep.ops_after)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    err = rel_l2(out, ref)
    assert err < 0.03, err  # measured ~0.016 (random activations, per-channel/per-token int8)
    assert WEIGHT_CACHE.quantized == 2
    # a recompile (new Dynamo frame) reuses the int8 weights; an in-place update requantizes
    torch._dynamo.reset()
    out2 = compile_and_run(mod, *args, executor=executor, quant="w8a8_int8")
    assert WEIGHT_CACHE.quantized == 2
    torch.testing.assert_close(out2, out)
    with torch.no_grad():
        mod.w2.mul_(2.0)
    torch._dynamo.reset()
    compile_and_run(mod, *args, executor=executor, quant="w8a8_int8")
    assert WEIGHT_CACHE.quantized == 3


def test_without_quant_option_nothing_changes():
    mod, args = routed_case()
    compile_and_run(mod, *args, executor="eager")
    assert not any(name in op for op in ep_fuse.last_report().ops_after for name in W8A8_OPS)


class Int8Experts(torch.nn.Module):
    """The accepted already-quantized convention: int8 ``gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I]
    with fp32 per-output-channel ``gate_up_proj_scale`` [E, 2I] / ``down_proj_scale`` [E, H] (buffers),
    dequantized in ``forward`` as ``q.to(x.dtype) * scale.unsqueeze(-1).to(x.dtype)``."""

    def __init__(self, e: int, h: int, i: int) -> None:
        super().__init__()
        (q13, s13), (q2, s2) = weights(e, h, i, seed=5)
        self.num_experts = e
        self.register_buffer("gate_up_proj", q13)
        self.register_buffer("gate_up_proj_scale", s13)
        self.register_buffer("down_proj", q2)
        self.register_buffer("down_proj_scale", s2)

    def forward(self, x, topk_ids, topk_weights):
        w13 = self.gate_up_proj.to(x.dtype) * self.gate_up_proj_scale.unsqueeze(-1).to(x.dtype)
        w2 = self.down_proj.to(x.dtype) * self.down_proj_scale.unsqueeze(-1).to(x.dtype)
        k = topk_ids.shape[1]
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // k
        offs = F.one_hot(flat, self.num_experts).sum(0).cumsum(0).to(torch.int32)
        gate, up = torch._grouped_mm(x[token], w13.transpose(1, 2), offs=offs).chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=offs)
        y = y * topk_weights.reshape(-1)[order].unsqueeze(-1)
        out = torch.zeros(x.shape, dtype=y.dtype, device=x.device)
        out.index_add_(0, token, y)
        return out.to(x.dtype)


@pytest.mark.parametrize("executor", ["eager", "inductor"])
def test_prequantized_module_is_used_as_is(executor):
    mod = Int8Experts(4, 64, 32)
    _m, args = routed_case()
    WEIGHT_CACHE.clear()
    with torch.no_grad():
        ref = mod(*args)
    out = compile_and_run(mod, *args, executor=executor, quant="w8a8_int8")
    rep = ep_fuse.last_report()
    assert rep.counts() == {"moe_experts": 1}
    assert WEIGHT_CACHE.quantized == 0  # the model's own int8 weights and scales
    assert any("grouped_gemm_w8a8" in op for op in rep.ops_after)
    assert rel_l2(out, ref) < 0.03


@pytest.mark.hf
@pytest.mark.parametrize("executor", ["eager", "inductor"])
def test_tiny_mixtral_logits_close_to_bf16(executor):
    model = tiny_models.build("mixtral")
    inputs = tiny_models.example_inputs()
    WEIGHT_CACHE.clear()
    with torch.no_grad():
        ref = model(**inputs).logits
        out = torch.compile(model, backend="ep_fuse", options={"executor": executor, "quant": "w8a8_int8"})(
            **inputs).logits
    rep = ep_fuse.last_report()
    assert rep.counts()["moe_experts"] == 2
    for name in W8A8_OPS:
        assert op_count(rep.ops_after, name) == 2, (name, rep.ops_after)
    assert WEIGHT_CACHE.quantized == 4  # two layers x (w13, w2)
    err = rel_l2(out, ref)
    assert err < 0.05, err  # measured ~0.01 (docs/benchmarks.md)


# --------------------------------------------------------------------------- Ascend chain on the double
@pytest.fixture
def npu_w8a8(torch_npu_double):
    from ep_fuse.providers.npu import w8a8 as npu_w8a8

    return npu_w8a8


@pytest.mark.parametrize("t, k, e, h, i", [(9, 2, 4, 32, 16), (12, 4, 8, 64, 32), (1, 2, 2, 32, 16)])
def test_npu_chain_matches_reference(npu_w8a8, t, k, e, h, i):
    _x, _ids, rows, _src, seg = routed(t, k, e, h, seed=t)
    (w13q, w13s), (w2q, w2s) = weights(e, h, i, seed=t)
    qr, sr = R.quant_per_token_ref(rows)
    assert npu_w8a8.quant_supports((rows,)) is None
    q, s = npu_w8a8.quant_per_token_kernel(rows)
    torch.testing.assert_close(s, sr)
    assert (q.int() - qr.int()).abs().max() <= 1
    args = (qr, sr, w13q, w13s, seg)
    assert npu_w8a8.swiglu_quant_supports(args) is None
    aq, a_s = npu_w8a8.grouped_gemm_w8a8_swiglu_quant_kernel(*args)
    aqr, asr = R.grouped_gemm_w8a8_swiglu_quant_ref(*args)
    torch.testing.assert_close(a_s, asr, rtol=1e-5, atol=1e-8)
    assert (aq.int() - aqr.int()).abs().max() <= 1
    args = (aqr, asr, w2q, w2s, seg, BF16)
    assert npu_w8a8.gemm_supports(args) is None
    y = npu_w8a8.grouped_gemm_w8a8_kernel(*args)
    torch.testing.assert_close(y, R.grouped_gemm_w8a8_ref(*args), rtol=8e-3, atol=1e-6)


def test_npu_chain_is_chosen_and_emits_the_seed_ops(npu_w8a8, monkeypatch):
    from ep_fuse.ops import choose
    from ep_fuse.ops import w8a8 as Q

    _x, _ids, rows, _src, seg = routed(8, 2, 4, 32)
    (w13q, w13s), _ = weights(4, 32, 16)
    xq, xs = R.quant_per_token_ref(rows)
    assert choose(Q.grouped_gemm_w8a8_swiglu_quant, (xq, xs, w13q, w13s, seg), "npu").provider == "npu"
    calls = []
    mod = sys.modules["torch_npu"]
    for name in ("npu_dynamic_quant", "npu_grouped_matmul", "npu_dequant_swiglu_quant"):
        fn = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, __fn=fn, __n=name, **kw: calls.append((__n, kw)) or __fn(*a, **kw))
    torch.ops.ep_fuse_npu.quant_per_token(rows)
    torch.ops.ep_fuse_npu.grouped_gemm_w8a8_swiglu_quant(xq, xs, w13q, w13s, seg)
    names = [c[0] for c in calls]
    assert names == ["npu_dynamic_quant", "npu_grouped_matmul", "npu_dequant_swiglu_quant"]
    assert calls[1][1]["output_dtype"] == torch.int32
    assert calls[2][1]["activate_left"] is True and calls[2][1]["quant_mode"] == 1

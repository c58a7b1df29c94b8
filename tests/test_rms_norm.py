"""RMSNorm / add+RMSNorm: the canonical ops, providers and the Triton kernel (interpreted on the CPU) against the
reference; the pattern variants on hand-written modules: op counts before/after, numerics, look-alikes."""

import logging

import pytest
import torch
from support.norm_cases import MODES, norm_args, ulp_close
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import ep_fuse
from ep_fuse.ops import choose
from ep_fuse.ops import rms_norm as rms_norm_ops
from ep_fuse.ops.rms_norm import add_rms_norm_ref, rms_norm_ref
from ep_fuse.ops.rms_norm import rms_norm_out_dtype
from support.compiling import capture_aten, compile_and_run
from ep_fuse.matching import Mismatch, try_match
from ep_fuse.patterns.rms_norm import PATTERNS

OPS = {
    False: (torch.ops.ep_fuse.rms_norm.default, torch.ops.ep_fuse_triton.rms_norm.default, rms_norm_ref),
    True: (torch.ops.ep_fuse.add_rms_norm.default, torch.ops.ep_fuse_triton.add_rms_norm.default, add_rms_norm_ref),
}


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_opcheck_canonical_and_triton(mode, residual):
    args = norm_args(5, 40, torch.bfloat16, mode, residual)
    canon, tri, _ = OPS[residual]
    torch.library.opcheck(canon, args)
    torch.library.opcheck(tri, args)


def test_reference_modes_spell_out_model_numerics():
    """Each mode reproduces the model code it replaces, including where it rounds."""
    x = torch.randn(4, 32).to(torch.bfloat16)
    w = torch.randn(32).to(torch.bfloat16)
    xf = x.float()
    n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(rms_norm_ref(x, w, 1e-6, None, "llama", True, torch.bfloat16), w * n.to(torch.bfloat16),
                               rtol=0, atol=0)
    torch.testing.assert_close(rms_norm_ref(x, w, 1e-6, None, "weight_fp32", True, torch.bfloat16),
                               (w * n).to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(rms_norm_ref(x, w, 1e-6, None, "gemma", True, torch.bfloat16),
                               (n * (1.0 + w.float())).to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(rms_norm_ref(x, None, 1e-6, None, "none", True, None), n, rtol=0, atol=0)
    # llama rounds n before the weight; weight_fp32 does not: they differ somewhere on random data
    a = rms_norm_ref(x, w, 1e-6, None, "llama", True, torch.bfloat16)
    b = rms_norm_ref(x, w, 1e-6, None, "weight_fp32", True, torch.bfloat16)
    assert not torch.equal(a, b)


def test_reference_pow_modes_keep_the_models_pow():
    """The ``_pow`` modes spell Gemma4's ``xf * pow(mean(xf**2) + eps, -0.5)``, bitwise, and are not rsqrt's."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 48, generator=g).to(torch.bfloat16), torch.randn(48, generator=g).to(torch.bfloat16)
    xf = x.float()
    n = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + 1e-6, -0.5)
    torch.testing.assert_close(rms_norm_ref(x, w.float(), 1e-6, None, "weight_fp32_pow", True, torch.bfloat16),
                               (n * w.float()).to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(rms_norm_ref(x, None, 1e-6, None, "none_pow", True, None), n, rtol=0, atol=0)
    assert rms_norm_out_dtype(x, w.float(), "weight_fp32_pow", True, torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError, match="takes no weight"):
        rms_norm_ref(x, w, 1e-6, None, "none_pow", True, None)


def test_reference_rejects_inconsistent_arguments():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="needs weight"):
        rms_norm_ref(x, None, 1e-6, None, "llama", True, torch.float32)
    with pytest.raises(ValueError, match="needs out_dtype"):
        rms_norm_ref(x, torch.ones(8), 1e-6, None, "llama", True, None)
    with pytest.raises(ValueError, match="not one of"):
        rms_norm_ref(x, torch.ones(8), 1e-6, None, "layer", True, None)


@settings(max_examples=30, deadline=None)
@given(
    shape=st.sampled_from([(1, 1), (3, 7), (2, 5, 64), (4, 100), (1, 3, 2, 16)]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    eps=st.sampled_from([1e-6, 1e-5, 0.1]),
    seed=st.integers(0, 2**16),
)
def test_reference_rounded_forms_spell_out_model_numerics(shape, dtype, eps, seed):
    """``none_rstd_cast`` is DeepSeek-V4's ``x * rsqrt(mean(x.float()²) + eps).to(x.dtype)`` and ``norm_dtype`` Zaya's
    ``norm(s.to(D))`` of an fp32 sum ``s = x + r32``, bit for bit, with eager's dtypes; neither is another mode."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    r32 = torch.randn(shape, generator=g) * 3
    w = (torch.randn(shape[-1], generator=g) * 0.1 + 1).to(dtype)
    rstd = torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps)
    out = rms_norm_ref(x, None, eps, None, "none_rstd_cast", True, dtype)
    assert out.dtype == dtype == rms_norm_out_dtype(x, None, "none_rstd_cast", True, dtype)
    assert torch.equal(out, x * rstd.to(dtype))
    s = x + r32
    hf = s.to(dtype).float()
    y, s_out = add_rms_norm_ref(x, r32, w, eps, None, "llama", True, dtype, dtype)
    assert s_out.dtype == torch.float32 and torch.equal(s_out, s)
    assert y.dtype == dtype and torch.equal(y, w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype))
    y_no_rounding, _ = add_rms_norm_ref(x, r32, w, eps, None, "llama", True, dtype)
    if x.numel() >= 256:  # rounding the sum first changes some outputs (on hundreds of elements, surely)
        assert not torch.equal(y, y_no_rounding)


def _rounded_args(rows, n, dtype, form, seed=0, chunk_dtype=None):
    """Arguments of the two rounded forms: DeepSeek-V4's ``none_rstd_cast`` (``rstd``, ``rstd_add``: over a residual
    sum) and Zaya's ``norm_dtype`` (a ``dtype`` branch plus an fp32 residual, the norm over the sum rounded)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, n, generator=g) * 3).to(dtype)
    if form == "rstd":
        return (x, None, 1e-6, None, "none_rstd_cast", True, dtype)
    if form == "rstd_add":
        return (x, torch.randn(rows, n, generator=g).to(dtype), None, 1e-6, None, "none_rstd_cast", True, dtype)
    w = (torch.randn(n, generator=g) * 0.1 + 1).to(dtype)
    return (x, torch.randn(rows, n, generator=g) * 3, w, 1e-6, None, "llama", True, dtype, dtype)


def _close_to_reference(out, ref, dtype):
    """The kernel's statistic may differ from torch's in the last fp32 bit, which a rounding can carry one ulp on;
    the residual sum is bitwise."""
    if isinstance(ref, tuple):
        assert out[1].dtype == ref[1].dtype and torch.equal(out[1], ref[1]), "the sum rounds as x + residual"
        out, ref = out[0], ref[0]
    assert out.dtype == ref.dtype and out.shape == ref.shape
    ulp_close(out, ref, dtype)


FORMS = ("rstd", "rstd_add", "norm_dtype")


@pytest.mark.parametrize("form", FORMS)
def test_rounded_forms_opcheck_and_who_takes_them(form):
    """The schemas hold the new arguments; the Triton kernel runs both forms (cleared for CUDA only after
    ``tests/gpu/test_gpu_norm_rope_forms.py``: ``unverified.py``), NPU declines them with the reason."""
    from types import SimpleNamespace

    from ep_fuse.providers.npu.rms_norm import supports as npu_supports
    from ep_fuse.providers.triton.rms_norm import rounded_variant
    from ep_fuse.providers.triton.unverified import gpu_unverified

    args = _rounded_args(5, 40, torch.bfloat16, form)
    canon = rms_norm_ops.add_rms_norm if form != "rstd" else rms_norm_ops.rms_norm
    torch.library.opcheck(canon.op, args)
    torch.library.opcheck(getattr(torch.ops.ep_fuse_triton, canon.name).default, args)
    why = "rounds the statistic" if form != "norm_dtype" else "residual sum rounded to torch.bfloat16"
    assert why in npu_supports(args)
    assert choose(canon, args, "cpu").provider == "triton"  # the interpreter
    variant = rounded_variant(args)
    assert variant == {"rstd": "rms_norm:none_rstd_cast", "rstd_add": "add_rms_norm:none_rstd_cast",
                       "norm_dtype": "add_rms_norm:norm_dtype"}[form]
    assert gpu_unverified(variant, SimpleNamespace(device=torch.device("cuda"))) is None  # cleared 2026-12-03


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(0, 9),
    n=st.sampled_from([1, 7, 64, 100, 257]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    form=st.sampled_from(FORMS),
    seed=st.integers(0, 2**16),
)
def test_triton_rounded_forms_match_reference(rows, n, dtype, form, seed):
    args = _rounded_args(rows, n, dtype, form, seed)
    canon = rms_norm_ops.add_rms_norm if form != "rstd" else rms_norm_ops.rms_norm
    _close_to_reference(getattr(torch.ops.ep_fuse_triton, canon.name)(*args), canon.reference(*args), dtype)


@pytest.mark.parametrize("form", FORMS)
def test_triton_rounded_forms_on_the_chunked_path(form):
    from ep_fuse.providers.triton.rms_norm_kernel import LaunchConfig, launch

    args = _rounded_args(6, 300, torch.bfloat16, form)
    x, r = args[0], args[1] if form != "rstd" else None
    w, eps, _, mode, _, out_dtype = args[2:8] if r is not None else args[1:]
    norm_dtype = args[8] if form == "norm_dtype" else None
    y = torch.empty_like(x)
    s = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, r.dtype)) if r is not None else None
    launch(x, r, w, y, s, eps, mode, out_dtype, 300, 300, config=LaunchConfig(64, 1, 4, chunked=True),
           norm_dtype=norm_dtype)
    ref = rms_norm_ops.add_rms_norm.reference(*args) if r is not None else rms_norm_ref(*args)
    _close_to_reference((y, s) if r is not None else y, ref, torch.bfloat16)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(0, 37),
    n=st.sampled_from([1, 7, 16, 33, 64, 100, 257, 1024]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    mode=st.sampled_from(MODES),
    residual=st.booleans(),
    eps_tensor=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_triton_matches_reference(rows, n, dtype, mode, residual, eps_tensor, seed):
    args = norm_args(rows, n, dtype, mode, residual, eps_tensor=eps_tensor, seed=seed)
    _, tri, ref_fn = OPS[residual]
    out, ref = tri(*args), ref_fn(*args)
    if residual:
        assert torch.equal(out[1], ref[1]), "the residual sum is rounded exactly like x + residual"
        out, ref = out[0], ref[0]
    assert out.dtype == ref.dtype and out.shape == ref.shape
    ulp_close(out, ref, out.dtype)


@pytest.mark.parametrize("w_dtype, out_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, None)])
def test_triton_mixed_weight_dtypes(w_dtype, out_dtype):
    for mode in ("llama", "weight_fp32"):
        if mode == "llama" and out_dtype is None:
            continue
        args = norm_args(9, 48, torch.bfloat16, mode, True, w_dtype=w_dtype, out_dtype=out_dtype)
        out, ref = OPS[True][1](*args), add_rms_norm_ref(*args)
        assert out[0].dtype == ref[0].dtype == rms_norm_out_dtype(args[0], args[2], mode, True, out_dtype)
        ulp_close(out[0], ref[0], out[0].dtype)


def test_triton_chunked_path_for_wide_rows():
    from ep_fuse.providers.triton.rms_norm_kernel import LaunchConfig, launch

    x, r, w, eps, _, mode, _, out_dtype = norm_args(6, 300, torch.bfloat16, "llama", True)
    y, s = torch.empty_like(x), torch.empty_like(x)
    launch(x, r, w, y, s, eps, mode, out_dtype, 300, 300, config=LaunchConfig(64, 1, 4, chunked=True))
    ref_y, ref_s = add_rms_norm_ref(x, r, w, eps, None, mode, True, out_dtype)
    assert torch.equal(s, ref_s)
    ulp_close(y, ref_y, torch.bfloat16)


def test_triton_on_4d_head_dim_view():
    x = torch.randn(2, 5, 4, 16).to(torch.bfloat16)
    w = torch.randn(16).to(torch.bfloat16)
    args = (x, w, 1e-6, None, "llama", True, torch.bfloat16)
    ulp_close(OPS[False][1](*args), rms_norm_ref(*args), torch.bfloat16)


def test_failing_kernel_falls_back_with_one_warning(monkeypatch, caplog):
    import ep_fuse.providers.triton.rms_norm_kernel as k

    def boom(*a, **kw):
        raise RuntimeError("simulated launch failure")

    monkeypatch.setattr(k, "launch", boom)
    args = norm_args(4, 32, torch.bfloat16, "llama", True)
    with caplog.at_level(logging.WARNING, logger="ep_fuse"):
        out1 = OPS[True][1](*args)
        out2 = OPS[True][1](*args)
    ref = add_rms_norm_ref(*args)
    assert torch.equal(out1[0], ref[0]) and torch.equal(out2[1], ref[1])
    warnings = [r for r in caplog.records if "simulated launch failure" in r.getMessage()]
    assert len(warnings) == 1 and "using the reference implementation" in warnings[0].getMessage()


def test_unsupported_call_runs_reference_at_run_time():
    x = torch.randn(8, 6).t()  # not contiguous
    args = (x, torch.ones(8), 1e-6, None, "weight_fp32", True, None)
    torch.testing.assert_close(OPS[False][1](*args), rms_norm_ref(*args), rtol=0, atol=0)


def test_choose_by_device_priority_and_support():
    args = norm_args(4, 32, torch.bfloat16, "llama", False)
    assert choose(rms_norm_ops.rms_norm, args, "cpu").provider == "triton"  # interpreter on
    assert choose(rms_norm_ops.rms_norm, args, "cpu", ("reference",)).provider == "reference"
    bad = (args[0].t().contiguous().t(), *args[1:])
    c = choose(rms_norm_ops.rms_norm, bad, "cpu")
    assert c.provider == "reference" and c.declined == (("triton", "input rows are not unit-stride rows with one row stride"),)
    c = choose(rms_norm_ops.rms_norm, args, "npu")
    assert c.provider == "reference" and c.declined[0][0] == "npu" and "torch_npu" in c.declined[0][1]
    no_upcast = (args[0], args[1], args[2], None, "llama", False, torch.bfloat16)
    assert "no upcast" in choose(rms_norm_ops.rms_norm, no_upcast, "cpu").declined[0][1]


@pytest.mark.parametrize("seq", [7, 1], ids=["prefill", "decode"])
def test_triton_on_row_slices_of_a_wider_projection(seq):
    """DeepSeek kv_a_layernorm reads split(kv_a_proj(x), [kv_lora, rope])[0]: strided rows. At decode the
    sequence dim has size 1 and the rows are 48 apart along the batch dim (a size-1 dim places nothing)."""
    proj = torch.randn(2, seq, 48).to(torch.bfloat16)
    x, _rope = proj.split([32, 16], dim=-1)
    r = torch.randn(2, seq, 48).to(torch.bfloat16)[..., 8:40]
    w = torch.randn(32).to(torch.bfloat16)
    for args, ref_fn, op in (
        ((x, w, 1e-6, None, "llama", True, torch.bfloat16), rms_norm_ref, OPS[False][1]),
        ((x, r, w, 1e-6, None, "llama", True, torch.bfloat16), add_rms_norm_ref, OPS[True][1]),
    ):
        out, ref = op(*args), ref_fn(*args)
        out, ref = (out, ref) if isinstance(out, tuple) else ((out,), (ref,))
        for o, e in zip(out, ref):
            assert o.stride() == e.stride(), "provider output layout equals the reference layout"
            ulp_close(o, e, torch.bfloat16)
    assert choose(rms_norm_ops.rms_norm, (x, w, 1e-6, None, "llama", True, torch.bfloat16), "cpu").provider == "triton"
    permuted = torch.randn(7, 2, 32).to(torch.bfloat16).transpose(0, 1)
    c = choose(rms_norm_ops.rms_norm, (permuted, w, 1e-6, None, "llama", True, torch.bfloat16), "cpu")
    assert c.provider == "reference"


def test_perf_rules_from_the_h200_measurements():
    from ep_fuse.providers.triton import rms_norm as triton_rms_norm

    def args(rows, h):
        return norm_args(1, 1, torch.bfloat16, "llama", True, shape=(rows, h))

    assert triton_rms_norm.add_rms_norm_prefers(args(16384, 7168), "inductor") is None
    assert triton_rms_norm.add_rms_norm_prefers(args(64, 7168), "inductor") is None
    assert "measured as fast" in triton_rms_norm.add_rms_norm_prefers(args(512, 7168), "inductor")
    assert "measured as fast" in triton_rms_norm.add_rms_norm_prefers(args(64, 4096), "inductor")
    assert triton_rms_norm.add_rms_norm_prefers(args(512, 7168), "eager") is None, "always beats unfused eager ops"
    assert triton_rms_norm.rms_norm_prefers(norm_args(4, 64, torch.bfloat16, "llama", False), "inductor") is not None
    c = choose(rms_norm_ops.add_rms_norm, args(512, 7168), "cpu", executor="inductor")
    assert c.provider == "reference" and c.declined[0][0] == "triton"


# Pattern variants on hand-written modules (the fused graph, not the op)

BF16 = torch.bfloat16
EPS = 1e-6


def _n(hf, eps=EPS):
    return hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)


class Llama(nn.Module):
    """HF LlamaRMSNorm: upcast, cast n, weight on the left."""

    def __init__(self, h, eps=EPS, right=False, add=False):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(h) * 0.1 + 1)
        self.eps, self.right, self.add = eps, right, add

    def forward(self, x, r):
        h = x + r if self.add else x
        y = _n(h.to(torch.float32), self.eps).to(x.dtype)
        out = y * self.weight if self.right else self.weight * y
        return (out, h) if self.add else out


class WeightFp32(nn.Module):
    """GPT-OSS: weight multiply in fp32, then the cast."""

    def __init__(self, h, add=False):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(h) * 0.1 + 1)
        self.add = add

    def forward(self, x, r):
        h = x + r if self.add else x
        out = (self.weight * _n(h.to(torch.float32))).to(x.dtype)
        return (out, h) if self.add else out


class Gemma(nn.Module):
    """Qwen3-Next: n * (1 + w.float()), type_as."""

    def __init__(self, h, add=False):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(h) * 0.1)
        self.add = add

    def forward(self, x, r):
        h = x + r if self.add else x
        out = (_n(h.float()) * (1.0 + self.weight.float())).type_as(x)
        return (out, h) if self.add else out


class NoWeight(nn.Module):
    """Llama4 L2 q/k-norm: type_as, no weight."""

    def forward(self, x, r):
        return _n(x.float()).type_as(x)


class Fp32Model(nn.Module):
    """fp32 model: no casts at all; squares via x*x."""

    def __init__(self, h):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(h))

    def forward(self, x, r):
        h = x + r
        var = (h * h).mean(-1, keepdim=True)
        return self.weight * (h * torch.rsqrt(var + EPS)), h


class HeadDimNorm(nn.Module):
    """Qwen3-MoE q_norm: reduce over head_dim of a [B, S, H, D] view, then transpose."""

    def __init__(self, d):
        super().__init__()
        self.q = nn.Linear(4 * d, 4 * d, bias=False)
        self.norm = Llama(d)

    def forward(self, x, r):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, -1, self.norm.weight.shape[0])
        return self.norm(q, None).transpose(1, 2)


class NoUpcastBf16(nn.Module):
    """Statistics in bf16: matched (reference semantics), fused kernels decline."""

    def __init__(self, h):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(h))

    def forward(self, x, r):
        return self.weight * _n(x)


class Gemma4Norm(nn.Module):
    """HF Gemma4 / MuseSpark / DiffusionGemma ``RMSNorm``: ``pow(·, -0.5)`` in fp32, ``with_scale`` weight
    ``.float()``, ``type_as``; ``add``: the decoder's ``residual + hidden_states`` before ``pre_feedforward_layernorm``."""

    def __init__(self, h=None, with_scale=True, add=False):
        super().__init__()
        self.with_scale, self.add = with_scale, add
        if with_scale:
            self.weight = nn.Parameter(torch.randn(h) * 0.1 + 1)

    def _norm(self, hidden_states):
        mean_squared = hidden_states.pow(2).mean(-1, keepdim=True) + EPS
        return hidden_states * torch.pow(mean_squared, -0.5)

    def forward(self, x, r):
        h = r + x if self.add else x
        normed = self._norm(h.float())
        if self.with_scale:
            normed = normed * self.weight.float()
        out = normed.type_as(h)
        return (out, h) if self.add else out


class Fp32ResidualStream(nn.Module):
    """Zaya (``residual_in_fp32``): a bf16 branch added to the fp32 residual stream, the norm reading the sum rounded
    to the weight's dtype (``norm(residual.to(w.dtype))``, HF Llama norm inside); ``fp32_weight``: GPT-OSS's tail."""

    def __init__(self, h, fp32_weight=False):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(h) * 0.1 + 1)
        self.fp32_weight = fp32_weight

    def forward(self, x, r):
        s = x + r.float()  # the fp32 residual stream
        h = s.to(x.dtype)
        hf = h.to(torch.float32)
        if self.fp32_weight:
            return (self.weight.float() * _n(hf)).to(x.dtype), s
        return self.weight * _n(hf).to(h.dtype), s


class RoundedRstd(nn.Module):
    """DeepSeek-V4's ``DeepseekV4UnweightedRMSNorm``: the fp32 statistic rounded to ``x.dtype``, times ``x`` itself;
    ``add``: over a residual sum; ``rstd_dtype``: round the statistic to another dtype (a look-alike)."""

    def __init__(self, add=False, rstd_dtype=None):
        super().__init__()
        self.add, self.rstd_dtype = add, rstd_dtype

    def forward(self, x, r):
        h = x + r if self.add else x
        out = h * torch.rsqrt(h.float().square().mean(-1, keepdim=True) + EPS).to(self.rstd_dtype or h.dtype)
        return (out, h) if self.add else out


def _inputs(shape, dtype=BF16):
    g = torch.Generator().manual_seed(1)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


CASES = [
    # module factory, dtype, shape, expected {(pattern, variant): count}
    (lambda: Llama(64), BF16, (3, 7, 64), {("rms_norm", "llama"): 1}),
    (lambda: Llama(64, right=True), BF16, (5, 64), {("rms_norm", "llama"): 1}),
    (lambda: Llama(64, add=True), BF16, (5, 64), {("add_rms_norm", "llama"): 1}),
    (lambda: Llama(64, add=True), torch.float16, (5, 64), {("add_rms_norm", "llama"): 1}),
    (lambda: WeightFp32(48), BF16, (5, 48), {("rms_norm", "weight_fp32"): 1}),
    (lambda: WeightFp32(48, add=True), BF16, (5, 48), {("add_rms_norm", "weight_fp32"): 1}),
    (lambda: Gemma(40), BF16, (6, 40), {("rms_norm", "gemma"): 1}),
    (lambda: Gemma(40, add=True), BF16, (6, 40), {("add_rms_norm", "gemma"): 1}),
    (lambda: NoWeight(), BF16, (2, 3, 4, 16), {("rms_norm", "none"): 1}),
    (lambda: Fp32Model(32), torch.float32, (9, 32), {("add_rms_norm", "weight_fp32"): 1}),
    (lambda: HeadDimNorm(16), BF16, (2, 5, 64), {("rms_norm", "llama"): 1}),
    (lambda: NoUpcastBf16(32), BF16, (4, 32), {("rms_norm", "weight_fp32"): 1}),
    (lambda: Gemma4Norm(48), BF16, (5, 48), {("rms_norm", "weight_fp32_pow"): 1}),
    (lambda: Gemma4Norm(48, add=True), BF16, (5, 48), {("add_rms_norm", "weight_fp32_pow"): 1}),
    (lambda: Gemma4Norm(with_scale=False), BF16, (2, 3, 4, 16), {("rms_norm", "none_pow"): 1}),
    (lambda: Gemma4Norm(32), torch.float32, (9, 32), {("rms_norm", "weight_fp32_pow"): 1}),
    (lambda: Gemma4Norm(with_scale=False, add=True), torch.float32, (9, 32), {("add_rms_norm", "none_pow"): 1}),
    (lambda: Fp32ResidualStream(64), BF16, (3, 5, 64), {("add_rms_norm", "llama_cast_sum"): 1}),
    (lambda: Fp32ResidualStream(64), torch.float16, (7, 64), {("add_rms_norm", "llama_cast_sum"): 1}),
    (lambda: Fp32ResidualStream(48, fp32_weight=True), BF16, (5, 48), {("add_rms_norm", "weight_fp32_cast_sum"): 1}),
    (lambda: Fp32ResidualStream(32), torch.float32, (9, 32), {("add_rms_norm", "weight_fp32"): 1}),  # casts vanish
    (lambda: RoundedRstd(), BF16, (2, 3, 4, 16), {("rms_norm", "none_rstd_cast"): 1}),
    (lambda: RoundedRstd(), torch.float16, (5, 48), {("rms_norm", "none_rstd_cast"): 1}),
    (lambda: RoundedRstd(add=True), BF16, (5, 48), {("add_rms_norm", "none_rstd_cast"): 1}),
    (lambda: RoundedRstd(), torch.float32, (5, 48), {("rms_norm", "none"): 1}),  # casts vanish
]
DECLINED_BY_KERNELS = (NoUpcastBf16,)
"""Matched, and every fused kernel declines them (reference semantics)."""


def _check(report, expected):
    got = {(m.pattern, m.variant): report.count(m.pattern, m.variant) for m in report.matches}
    assert got == expected, report
    n_sites = sum(expected.values())
    if all(variant.endswith("_pow") for _name, variant in expected):  # pow(x, 2) and pow(·, -0.5) per site
        assert report.ops_before.get("aten.pow.Tensor_Scalar", 0) == 2 * n_sites
        assert report.ops_before.get("aten.rsqrt.default", 0) == 0
        assert report.ops_after.get("aten.pow.Tensor_Scalar", 0) == 0
    else:
        assert report.ops_before.get("aten.rsqrt.default", 0) == n_sites
    assert report.ops_after.get("aten.rsqrt.default", 0) == 0
    fused = sum(v for k, v in report.ops_after.items() if k.startswith("ep_fuse"))
    assert fused == n_sites


@pytest.mark.parametrize("case", range(len(CASES)))
def test_variant_matches_and_is_bitwise_with_reference(case):
    factory, dtype, shape, expected = CASES[case]
    torch.manual_seed(0)
    mod = factory().to(dtype if dtype != torch.float32 else torch.float32)
    x, r = _inputs(shape, dtype)
    with torch.no_grad():
        ref = mod(x, r)
    out = compile_and_run(mod, x, r, executor="eager", providers={"cpu": ["reference"]})
    _check(ep_fuse.last_report(), expected)
    for o, e in zip(*(t if isinstance(t, tuple) else (t,) for t in (out, ref))):
        assert torch.equal(o, e), "the reference provider computes exactly what the model computes"


@pytest.mark.parametrize("case", range(len(CASES)))
def test_variant_with_triton_kernel(case):
    factory, dtype, shape, expected = CASES[case]
    torch.manual_seed(0)
    mod = factory().to(dtype)
    x, r = _inputs(shape, dtype)
    with torch.no_grad():
        ref = mod(x, r)
    out = compile_and_run(mod, x, r, executor="eager")
    rep = ep_fuse.last_report()
    _check(rep, expected)
    want = "reference" if isinstance(mod, DECLINED_BY_KERNELS) else "triton"
    assert all(m.provider == want for m in rep.matches), rep
    for o, e in zip(*(t if isinstance(t, tuple) else (t,) for t in (out, ref))):
        ulp_close(o, e, o.dtype)


def test_dynamic_shapes_eps_as_tensor_input():
    mod = Llama(64, add=True).to(BF16)
    x, r = _inputs((4, 64))
    with torch.no_grad():
        ref = mod(x, r)
        compiled = torch.compile(mod, backend="ep_fuse", options={"executor": "eager"}, dynamic=True)
        out = compiled(x, r)
        x2, r2 = _inputs((7, 64))
        out2, ref2 = compiled(x2, r2), mod(x2, r2)
    assert ep_fuse.last_report().count("add_rms_norm") == 1
    ulp_close(out[0], ref[0], BF16)
    ulp_close(out2[0], ref2[0], BF16)
    assert torch.equal(out2[1], ref2[1])


def test_eps_attribute_becomes_tensor_input_under_dynamic():
    """HF stores eps as a float attribute; dynamic=True turns it into an f64[] graph input. (Every site on its
    reference: the matching is the subject; the kernels' symbolic launches are ``tests/test_symbolic_launch.py``'s.)"""
    from ep_fuse.testing import tiny as tiny_models

    model = tiny_models.build("mixtral")
    inp = tiny_models.example_inputs()
    opts = {"executor": "eager", "providers": {"cpu": ["reference"]}}
    with torch.no_grad():
        ref = model(**inp).logits
        out = torch.compile(model, backend="ep_fuse", options=opts, dynamic=True)(**inp).logits
    rep = ep_fuse.last_report()
    assert rep.count("add_rms_norm") == 4 and rep.count("rms_norm") == 1
    torch.testing.assert_close(out.float(), ref.float(), rtol=0.05, atol=0.05)


# --------------------------------------------------------------------------- look-alikes
class MeanOverOtherDim(nn.Module):
    def forward(self, x, r):
        hf = x.float()
        return (hf * torch.rsqrt(hf.pow(2).mean(0, keepdim=True) + EPS)).to(x.dtype)


class RsqrtReused(nn.Module):
    def forward(self, x, r):
        hf = x.float()
        rstd = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS)
        return (hf * rstd).to(x.dtype), rstd


class CubeNotSquare(nn.Module):
    def forward(self, x, r):
        hf = x.float()
        return (hf * torch.rsqrt(hf.abs().pow(3).mean(-1, keepdim=True) + EPS)).to(x.dtype)


class OtherTensorScaled(nn.Module):
    def forward(self, x, r):
        hf = x.float()
        return (r.float() * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


class PerRowEps(nn.Module):
    def forward(self, x, r):
        hf = x.float()
        eps = r.float().abs()[..., :1]  # [T, 1] tensor "eps"
        return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class OtherTensorRoundedRstd(nn.Module):
    """DeepSeek-V4's spelling with another tensor scaled: ``r * rsqrt(mean(x.float()²) + eps).to(x.dtype)``."""

    def forward(self, x, r):
        return r * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + EPS).to(x.dtype)


@pytest.mark.parametrize(
    "mod, why",
    [
        (MeanOverOtherDim(), "failed at mean: guard reduces_last_dim: mean over dim 0 of a 2-D tensor"),
        (RsqrtReused(), "failed at rsqrt: is also used outside the pattern (by output)"),
        (CubeNotSquare(), "failed at abs_1: must be the same node as '_to_copy' (xf)"),
        (OtherTensorScaled(), "failed at _to_copy: must be the same node as '_to_copy_1' (xf)"),
        (PerRowEps(), "failed at slice_1: eps must be a number or a 0-d floating tensor"),
        (RoundedRstd(rstd_dtype=torch.float16),
         "guard rstd_rounds_to_input_dtype: the statistic is rounded to torch.float16, not to the input's "
         "torch.bfloat16"),
        (OtherTensorRoundedRstd(), "must be the same node as 'arg1_1' (x)"),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else "",
)
def test_look_alikes_do_not_match(mod, why):
    x, r = _inputs((6, 32))
    with torch.no_grad():
        ref = mod(x, r)
    out = compile_and_run(mod, x, r, executor="eager")
    rep = ep_fuse.last_report()
    assert rep.matches == [], rep
    assert len(rep.near_misses) == 1 and rep.near_misses[0].anchor.startswith("rsqrt")
    assert why in rep.near_misses[0].explain()
    for o, e in zip(*(t if isinstance(t, tuple) else (t,) for t in (out, ref))):
        assert torch.equal(o, e)


class PowQuarter(nn.Module):
    """``pow(mean(x²) + eps, -0.25)``: not an RMSNorm (and no candidate site: only ``pow(·, -0.5)`` is one)."""

    def forward(self, x, r):
        hf = x.float()
        return (hf * torch.pow(hf.pow(2).mean(-1, keepdim=True) + EPS, -0.25)).type_as(x)


class PowMeanOverOtherDim(nn.Module):
    def forward(self, x, r):
        hf = x.float()
        return (hf * torch.pow(hf.pow(2).mean(0, keepdim=True) + EPS, -0.5)).type_as(x)


class PowOtherTensorScaled(nn.Module):
    """``y * pow(mean(x²) + eps, -0.5)`` with ``y != x``."""

    def forward(self, x, r):
        hf = x.float()
        return (r.float() * torch.pow(hf.pow(2).mean(-1, keepdim=True) + EPS, -0.5)).type_as(x)


@pytest.mark.parametrize(
    "mod, why",
    [
        (PowQuarter(), None),
        (PowMeanOverOtherDim(), "failed at mean: guard reduces_last_dim: mean over dim 0 of a 2-D tensor"),
        (PowOtherTensorScaled(), "failed at _to_copy: must be the same node as '_to_copy_1' (xf)"),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else "",
)
def test_pow_look_alikes_do_not_match(mod, why):
    x, r = _inputs((6, 32))
    with torch.no_grad():
        ref = mod(x, r)
    out = compile_and_run(mod, x, r, executor="eager")
    rep = ep_fuse.last_report()
    assert rep.matches == [], rep
    if why is None:
        assert rep.near_misses == [], rep
    else:
        assert len(rep.near_misses) == 1 and rep.near_misses[0].anchor.startswith("pow"), rep
        best = rep.near_misses[0].best
        assert best is not None and best.pattern.endswith("_pow]"), rep.near_misses[0].explain()
        assert why in rep.near_misses[0].explain()
    assert torch.equal(out, ref)


class BroadcastWeight(nn.Module):
    """A [T, H] 'weight' is not an RMSNorm weight: the norm fuses, the multiply stays."""

    def forward(self, x, r):
        return r * _n(x.float()).to(x.dtype)


class BroadcastResidual(nn.Module):
    """x + bias[H] broadcasts: no add+norm; the plain norm of the sum fuses."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(32))
        self.weight = nn.Parameter(torch.randn(32))

    def forward(self, x, r):
        h = x + self.bias
        return self.weight * _n(h.float()).to(x.dtype), h


class ScaledAdd(nn.Module):
    """torch.add(x, r, alpha=2) is not a residual add."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(32))

    def forward(self, x, r):
        h = torch.add(x, r, alpha=2)
        return self.weight * _n(h.float()).to(x.dtype), h


class MixedDtypeAdd(nn.Module):
    """bf16 + fp32 residual (promotes): no add+norm."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(32))

    def forward(self, x, r):
        h = x + r.float()
        return (self.weight * _n(h)), h


class Fp32StreamBiasAdd(Fp32ResidualStream):
    """Zaya's form over ``x + bias[H]`` (a broadcasting add): the norm of the rounded sum fuses, the add stays."""

    def __init__(self):
        super().__init__(32)
        self.bias = nn.Parameter(torch.randn(32, dtype=torch.float32))

    def forward(self, x, r):
        return super().forward(x, self.bias.float())


class Fp32StreamRoundedSumReused(Fp32ResidualStream):
    """Zaya's form whose rounded sum is also returned: fusing the add would compute the rounding twice."""

    def __init__(self):
        super().__init__(32)

    def forward(self, x, r):
        s = x + r.float()
        h = s.to(x.dtype)
        return self.weight * _n(h.float()).to(h.dtype), s, h


@pytest.mark.parametrize(
    "mod, expected",
    [
        (Fp32StreamBiasAdd(), {("rms_norm", "llama"): 1}),
        (Fp32StreamRoundedSumReused(), {("rms_norm", "llama"): 1}),
        (BroadcastWeight(), {("rms_norm", "none"): 1}),
        (BroadcastResidual(), {("rms_norm", "llama"): 1}),
        (ScaledAdd(), {("rms_norm", "llama"): 1}),
        (MixedDtypeAdd(), {("rms_norm", "weight_fp32"): 1}),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else "",
)
def test_partial_look_alikes_fuse_only_the_safe_part(mod, expected):
    mod = mod.to(BF16) if not isinstance(mod, (MixedDtypeAdd, Fp32ResidualStream)) else mod.to(torch.float32)
    x, r = _inputs((6, 32))
    with torch.no_grad():
        ref = mod(x, r)
    out = compile_and_run(mod, x, r, executor="eager", providers={"cpu": ["reference"]})
    rep = ep_fuse.last_report()
    assert {(m.pattern, m.variant): 1 for m in rep.matches} == expected, rep
    for o, e in zip(*(t if isinstance(t, tuple) else (t,) for t in (out, ref))):
        assert torch.equal(o, e)


def test_disable_and_patterns_options():
    mod = Llama(64, add=True).to(BF16)
    x, r = _inputs((4, 64))
    compile_and_run(mod, x, r, executor="eager", disable=["add_rms_norm"])
    rep = ep_fuse.last_report()
    assert rep.count("add_rms_norm") == 0 and rep.count("rms_norm") == 1
    torch._dynamo.reset()
    compile_and_run(mod, x, r, executor="eager", patterns=["add_rms_norm"])
    assert ep_fuse.last_report().counts() == {"add_rms_norm": 1}


# --------------------------------------------------------------------------- residual adds over leading size-1 dims
class LeadingOnesResidual(nn.Module):
    """gpt-fast: the MoE block returns ``[T, H]`` rows, added to the ``[1, T, H]`` residual (``h + ffn(norm(h))``),
    then the next RMSNorm (``mean(x * x)`` in fp32, cast back before the weight). ``rows``: the rows' shape, the
    residual's shape is ``[*lead, T, H]``; ``rows_first``: ``rows + h`` instead of ``h + rows``."""

    def __init__(self, h=32, lead=(1,), rows_first=False):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(h) * 0.1 + 1)
        self.lead, self.rows_first = lead, rows_first

    def forward(self, x, r):
        h = x.view(*self.lead, *x.shape)
        s = r + h if self.rows_first else h + r
        sf = s.float()
        return (sf * torch.rsqrt(torch.mean(sf * sf, dim=-1, keepdim=True) + EPS)).type_as(s) * self.weight, s


LEADING_ONES = [
    ((1,), False, BF16, "llama"), ((1,), True, BF16, "llama"), ((1, 1), False, BF16, "llama"),
    ((1,), False, torch.float32, "weight_fp32"), ((1,), False, torch.float16, "llama"),
]


@pytest.mark.parametrize("provider", ["reference", "triton"])
@pytest.mark.parametrize("lead, rows_first, dtype, variant", LEADING_ONES,
                         ids=[f"{len(c[0])}x1-{'rows_first' if c[1] else 'h_first'}-{c[2]}" for c in LEADING_ONES])
def test_add_over_leading_ones_fuses(lead, rows_first, dtype, variant, provider):
    """``[1, T, H] + [T, H]`` (either order, one or two leading ones): one ``add_rms_norm``, the rows unsqueezed to the
    sum's shape; both outputs (the normed value, the sum) in eager's dtype, shape and strides; the reference bitwise,
    the kernel within rounding."""
    torch.manual_seed(0)
    mod = LeadingOnesResidual(lead=lead, rows_first=rows_first).to(dtype)
    x, r = _inputs((6, 32), dtype)
    r = r.view(*lead, 6, 32)
    with torch.no_grad():
        ref = mod(x, r)
    out = compile_and_run(mod, x, r, executor="eager", providers={"cpu": [provider, "reference"]})
    rep = ep_fuse.last_report()
    _check(rep, {("add_rms_norm", variant): 1})
    assert rep.ops_after.get("aten.add.Tensor", 0) == 0 and rep.ops_after.get("aten.mul.Tensor", 0) == 0
    assert all(m.provider == provider for m in rep.matches), rep
    for o, e in zip(out, ref):
        assert o.dtype == e.dtype and o.shape == e.shape and o.stride() == e.stride()
        if provider == "reference":
            assert torch.equal(o, e)
        else:
            ulp_close(o, e, dtype)


class RealBroadcastResidual(LeadingOnesResidual):
    """``[B, T, H] + [T, H]`` with B = 2, or ``[1, T, H] + [T, 1, H]``: a broadcast that grows an operand."""

    def __init__(self, other):
        super().__init__()
        self.other = other

    def forward(self, x, r):
        s = r + x.view(self.other)
        sf = s.float()
        return (sf * torch.rsqrt(torch.mean(sf * sf, dim=-1, keepdim=True) + EPS)).type_as(s) * self.weight, s


@pytest.mark.parametrize("r_shape, x_view, why", [
    ((2, 6, 32), (6, 32), "residual add broadcasts [2, 6, 32] with [6, 32]"),
    ((1, 6, 32), (6, 1, 32), "residual add broadcasts [1, 6, 32] with [6, 1, 32]"),
])
def test_add_that_really_broadcasts_keeps_the_add(r_shape, x_view, why):
    """Operands of different numel: no add+norm (the plain norm of the sum fuses), the guard says why."""
    torch.manual_seed(0)
    mod = RealBroadcastResidual(x_view).to(BF16)
    g = torch.Generator().manual_seed(2)
    x, r = torch.randn(6 * 32, generator=g).to(BF16), torch.randn(r_shape, generator=g).to(BF16)
    with torch.no_grad():
        ref = mod(x, r)
    out = compile_and_run(mod, x, r, executor="eager", providers={"cpu": ["reference"]})
    rep = ep_fuse.last_report()
    assert {(m.pattern, m.variant) for m in rep.matches} == {("rms_norm", "llama")} and rep.count() == 1, rep
    assert rep.ops_after.get("aten.add.Tensor") == 1
    for o, e in zip(out, ref):
        assert torch.equal(o, e)
    # the plain norm took the rsqrt, so no near miss is left to read: ask the add_rms_norm variants themselves
    (gm, _inputs_), = capture_aten(mod, x, r)
    reasons = [str(res) for p in PATTERNS if p.name == "add_rms_norm" for n in gm.graph.nodes
               if n.op == "call_function" and n.target in p.root_targets()
               for res in [try_match(p, n)] if isinstance(res, Mismatch)]
    assert any(f"guard add_is_plain: {why}" in reason for reason in reasons), reasons

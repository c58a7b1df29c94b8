"""Dynamic shapes (``dynamic=True`` / automatic dynamic): the same sites fuse as in a static compile, the
rewrite adds no shape guards, size-dependent provider choices are made at run time, and an odd-sized
Qwen2-MoE-style model runs a decode/prefill shape sequence in at most two graphs."""

import pytest
import torch
from support.moe_modules import MODULES, RoutedClampedBatched
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

import ep_fuse
from ep_fuse.testing import tiny as tiny_models
from ep_fuse.matching import Lit, Mismatch, op
from ep_fuse.matching.checks import is_int, is_size
from ep_fuse.matching.matcher import State, match_tree
from ep_fuse.ops import moe as moe_ops
from ep_fuse.ops.registry import AtRunTime, canonical_ops
from ep_fuse.providers.triton import gemm_swiglu as triton_gemm_swiglu
from ep_fuse.providers.triton import moe as triton_moe
from ep_fuse.symbolic import concrete_int, known, same_shape, sym_eq
from support.compiling import capture_aten

BF16, F16 = torch.bfloat16, torch.float16
aten = torch.ops.aten


# --------------------------------------------------------------------------- symbolic sizes
def _env(unbacked: bool):
    """A ShapeEnv, its fake mode and a token count ``T`` (backed, hint 7; or unbacked)."""
    from torch._dynamo.source import ConstantSource

    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    if unbacked:
        t = env.create_unbacked_symint()
        torch._check(t >= 0)
    else:
        t = env.create_symintnode(env.create_symbol(7, ConstantSource("T"), DimDynamic.DYNAMIC), hint=7)
    return env, mode, t


@pytest.mark.parametrize("unbacked", [False, True], ids=["backed", "unbacked"])
def test_symbolic_helpers_decide_without_guards(unbacked):
    env, _mode, t = _env(unbacked)
    assert sym_eq(t * 6, 6 * t) and not sym_eq(t, 7) and not sym_eq(t, 1) and sym_eq(3, 3)
    assert same_shape([t, 6, 360], [t, 6, 360]) and same_shape([t, 6], [-1, 6], [t, 6])
    assert not same_shape([t, 6], [t, 7]) and not same_shape([t * 2, 6], [t, 6])
    assert concrete_int(t) is None and concrete_int(5) == 5 and concrete_int(True) is None
    assert known(t * 2 >= t) and not known(t <= 32) and not known(t > 32)
    assert env.guards == [], "deciding on symbolic sizes must add no guard"


def test_size_literals_may_be_symint_nodes():
    """``arange(x.shape[0] * 2)`` under dynamic shapes: the end is a node computing a SymInt."""
    (gm, _), = capture_aten(lambda x: torch.arange(x.shape[0] * 2) + x.sum().long(), torch.ones(5, 3),
                            dynamic=True)
    arange = next(n for n in gm.graph.nodes if n.target is aten.arange.default)
    assert isinstance(arange.args[0], torch.fx.Node), "the size is computed in the graph"
    res = match_tree(op(aten.arange.default, end=Lit(is_size, bind="n"), ignore=("device", "pin_memory")),
                     arange, State())
    assert not isinstance(res, Mismatch), res
    x = next(n for n in gm.graph.nodes if n.op == "placeholder" and isinstance(n.meta["val"], torch.Tensor))
    assert sym_eq(res.bindings["n"], 2 * x.meta["val"].shape[0])
    refused = match_tree(op(aten.arange.default, end=Lit(is_int), ignore=("device", "pin_memory")), arange, State())
    assert isinstance(refused, Mismatch) and "expected an int" in refused.reason, "a structural int stays concrete"


def _provider_args(mode, t):
    """Well-formed arguments of every canonical op with a provider, over ``t`` tokens."""
    h, e, i, k = 64, 8, 32, 2
    with mode:
        x, w = torch.empty(t, h, dtype=BF16), torch.empty(h, dtype=BF16)
        heads, cos = torch.empty(t, 4, 16, dtype=BF16), torch.empty(t, 1, 16, dtype=BF16)
        cache, pos = torch.empty(128, 16, dtype=BF16), torch.empty(t, dtype=torch.int64)
        wg = torch.empty(i, h, dtype=BF16)
        ids, tw = torch.empty(t, k, dtype=torch.int64), torch.empty(t, k, dtype=torch.float32)
        w13, w2 = torch.empty(e, 2 * i, h, dtype=BF16), torch.empty(e, h, i, dtype=BF16)
        rows, act = torch.empty(t * k, h, dtype=BF16), torch.empty(t * k, i, dtype=BF16)
        seg, s2d = torch.empty(e + 1, dtype=torch.int64), torch.empty(t * k, dtype=torch.int64)
        logits = torch.empty(t, e, dtype=torch.float32)
    return {
        "rms_norm": (x, w, 1e-6, None, "llama", True, BF16),
        "add_rms_norm": (x, x, w, 1e-6, None, "llama", True, BF16),
        "rope": (heads, cos, cos, "half", 16, None), "rope_qk": (heads, heads, cos, cos, "half", 16, None),
        "rope_cache": (heads, cache, pos, "interleave", 16),
        "rope_qk_cache": (heads, heads, cache, pos, "interleave", 16),
        "gemm_swiglu": (x, wg, wg), "grouped_gemm": (act, w2, seg), "grouped_gemm_swiglu": (rows, w13, seg),
        "moe_permute": (x, ids, e), "moe_unpermute": (rows, s2d, tw, k, BF16),
        "moe_gating": (logits, None, k, "softmax", 1, 1, "none", True, 0.0, 1.0, BF16),
    }


@pytest.mark.parametrize("unbacked", [False, True], ids=["backed", "unbacked"])
def test_provider_checks_and_perf_rules_on_symbolic_rows(unbacked):
    """Every provider accepts symbolic token counts without a guard (unbacked: without raising); the
    size-dependent perf rules defer to run time instead of declining."""
    import ep_fuse.catalog  # noqa: F401  (registers the NPU provider too)

    env, mode, t = _env(unbacked)
    calls = _provider_args(mode, t)
    verdicts = {}
    for name, canon in canonical_ops().items():
        if name not in calls:
            continue
        for pname, prov in canon.providers.items():
            assert prov.supports(calls[name]) is None, (name, pname)
            for executor in ("inductor", "eager"):
                if prov.prefers is not None:
                    verdicts[name, pname, executor] = prov.prefers(calls[name], executor)
    assert env.guards == [], [str(g.expr) for g in env.guards]
    assert isinstance(verdicts["gemm_swiglu", "triton", "inductor"], AtRunTime)
    assert isinstance(verdicts["gemm_swiglu", "triton", "eager"], AtRunTime)
    for op_name in ("grouped_gemm", "grouped_gemm_swiglu"):
        assert isinstance(verdicts[op_name, "triton", "inductor"], AtRunTime)
        assert verdicts[op_name, "triton", "eager"] is None, "eager torch._grouped_mm is slower at every size"
    for op_name in ("moe_gating", "add_rms_norm", "rope", "rope_qk_cache"):
        assert verdicts[op_name, "triton", "inductor"] is None, op_name
    assert "Inductor's fused kernel" in verdicts["rms_norm", "triton", "inductor"], "size-independent rule"


def test_run_time_rules_use_the_measured_thresholds():
    x = torch.empty(triton_gemm_swiglu.GEMM_SWIGLU_MAX_ROWS, 8, dtype=BF16)
    assert triton_gemm_swiglu.gemm_swiglu_at_run_time((x, None, None)) is None
    assert "rows > 32" in triton_gemm_swiglu.gemm_swiglu_at_run_time((torch.empty(33, 8, dtype=BF16), None, None))
    w = torch.empty(4, 16, 8, dtype=BF16)
    at = triton_moe.GROUPED_GEMM_MAX_ROWS_PER_EXPERT * 4
    assert triton_moe.grouped_gemm_at_run_time((torch.empty(at, 8, dtype=BF16), w)) is None
    assert "torch._grouped_mm" in triton_moe.grouped_gemm_at_run_time((torch.empty(at + 4, 8, dtype=BF16), w))
    assert triton_moe.grouped_gemm_at_run_time((torch.empty(at + 4, 8, dtype=F16), w.half())) is None, \
        "no torch._grouped_mm for fp16: the kernel beats the reference's host loop"


def test_dense_tma_wins_keep_gemm_swiglu_at_prefill(monkeypatch):
    """The dense TMA kernel's measured wins (>= 2048 rows, I >= 11008) keep ``gemm_swiglu`` at prefill sizes,
    at compile time and per call; CPU tensors and narrow MLPs keep cuBLAS + SwiGLU."""
    assert triton_gemm_swiglu.dense_tma_size_wins(2048, 11008) and triton_gemm_swiglu.dense_tma_size_wins(8192, 18432)
    assert not triton_gemm_swiglu.dense_tma_size_wins(1024, 11008)  # 0.94x
    assert not triton_gemm_swiglu.dense_tma_size_wins(8192, 2048)  # the DeepSeek-V3 shared expert: 0.95-1.00x
    x, wg = torch.empty(4096, 64, dtype=BF16), torch.empty(11008, 64, dtype=BF16)
    assert "cuBLAS" in triton_gemm_swiglu.gemm_swiglu_prefers((x, wg, wg), "inductor"), "CPU tensors: no TMA win"
    assert triton_gemm_swiglu.gemm_swiglu_at_run_time((x, wg, wg)) is not None
    monkeypatch.setattr(triton_gemm_swiglu, "_dense_tma_wins", lambda x, wg, wu, rows: True)
    assert triton_gemm_swiglu.gemm_swiglu_prefers((x, wg, wg), "inductor") is None
    assert triton_gemm_swiglu.gemm_swiglu_at_run_time((x, wg, wg)) is None


def test_tma_kernel_lifts_the_grouped_mm_threshold(monkeypatch):
    """Above 128 rows per expert the provider keeps the call where the TMA kernel takes it (measured faster
    than torch._grouped_mm up to 2048 rows per expert), at compile time and per call; CPU tensors never count."""
    w = torch.empty(4, 16, 8, dtype=BF16)
    x = torch.empty(triton_moe.GROUPED_GEMM_MAX_ROWS_PER_EXPERT * 4 + 4, 8, dtype=BF16)
    assert not triton_moe._tma_takes(x, w), "CPU tensors: the rule is about CUDA"
    monkeypatch.setattr(triton_moe, "_tma_takes", lambda x, w, swiglu=False, act=(): True)
    assert triton_moe.grouped_gemm_at_run_time((x, w)) is None
    assert triton_moe.grouped_gemm_prefers((x, w, None), "inductor") is None
    monkeypatch.setattr(triton_moe, "_tma_takes", lambda x, w, swiglu=False, act=(): False)
    assert "torch._grouped_mm" in triton_moe.grouped_gemm_at_run_time((x, w))
    assert "TMA kernel does not take" in triton_moe.grouped_gemm_prefers((x, w, None), "inductor")


def test_by_size_ops_run_the_kernel_or_the_reference():
    from ep_fuse.ops.moe import grouped_gemm_ref
    from ep_fuse.ops.gemm_swiglu import gemm_swiglu_ref

    g = torch.Generator().manual_seed(0)
    ops = torch.ops.ep_fuse_triton
    wg, wu = (torch.randn(16, 32, generator=g).to(BF16) for _ in range(2))
    for rows in (3, 40):  # the kernel, then the reference (bitwise)
        x = torch.randn(rows, 32, generator=g).to(BF16)
        out = ops.gemm_swiglu_by_size(x, wg, wu)
        torch.testing.assert_close(out.float(), gemm_swiglu_ref(x, wg, wu).float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(out, gemm_swiglu_ref(x, wg, wu))
    w = torch.randn(2, 16, 32, generator=g).to(BF16)
    rows = 2 * triton_moe.GROUPED_GEMM_MAX_ROWS_PER_EXPERT + 2
    x = torch.randn(rows, 32, generator=g).to(BF16)
    seg = torch.tensor([0, rows // 2, rows])
    assert torch.equal(ops.grouped_gemm_by_size(x, w, seg), grouped_gemm_ref(x, w, seg))
    torch.library.opcheck(ops.gemm_swiglu_by_size.default, (x[:5], wg, wu))
    torch.library.opcheck(ops.grouped_gemm_by_size.default, (x[:6], w, torch.tensor([0, 2, 6])))


# --------------------------------------------------------------------------- patterns on symbolic tokens
class Routed(nn.Module):
    """A softmax top-k router in front of a hand-written expert block: one token count for x, ids, weights."""

    def __init__(self, block, e=4, h=32, k=2):
        super().__init__()
        self.block, self.k = block, k
        self.gate = nn.Linear(h, e, bias=False, dtype=BF16)

    def forward(self, x):
        w, ids = self.gate(x).float().softmax(-1).topk(self.k)
        return self.block(x, ids, w)


def _compile_over(mod, sizes, make, **options):
    """Compile once with ``dynamic=True``, run every size; (outputs, eager outputs)."""
    f = torch.compile(mod, backend="ep_fuse", dynamic=True, options={"executor": "eager", **options})
    outs, refs = [], []
    with torch.no_grad():
        for n in sizes:
            args = make(n)
            outs.append(f(*args))
            refs.append(mod(*args))
    return outs, refs


def _x(n, h=32, seed=None):
    g = torch.Generator().manual_seed(n if seed is None else seed)
    return (torch.randn(n, h, generator=g).to(BF16),)


@pytest.mark.parametrize("name", [*MODULES, "routed_clamped_batched"])
def test_expert_blocks_fuse_on_a_symbolic_token_count(name):
    block = RoutedClampedBatched(4, 32, 16) if name == "routed_clamped_batched" else MODULES[name](4, 32, 16)
    mod = Routed(block) if name != "routed_clamped_batched" else _SelfRouted(block)
    outs, refs = _compile_over(mod, (13, 5, 40), _x, providers={"cpu": ["reference"]})
    (rep,) = ep_fuse.reports()
    assert rep.counts().get("moe_experts") == 1, [m.explain() for m in rep.near_misses]
    assert rep.counts().get("moe_gating") == 1
    assert not rep.shape_guards
    for o, r in zip(outs, refs):
        torch.testing.assert_close(o.float(), r.float(), rtol=2e-2, atol=2e-2)


class _SelfRouted(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        ids = torch.zeros(x.shape[0], 2, dtype=torch.int64)  # unused: the block routes itself
        return self.block(x, ids, ids.float())


def test_inductor_executor_on_symbolic_tokens():
    """Under Inductor the inlined references (expand, lower) trace on symbolic sizes: one graph, no guard."""
    mod = Routed(MODULES["sentinel_masked"](4, 32, 16))
    outs, refs = _compile_over(mod, (13, 5, 40), _x, executor="inductor", providers={"cpu": ["reference"]})
    (rep,) = ep_fuse.reports()
    assert rep.counts() == {"moe_experts": 1, "moe_gating": 1} and not rep.shape_guards
    for o, r in zip(outs, refs):
        torch.testing.assert_close(o.float(), r.float(), rtol=2e-2, atol=2e-2)


def test_symbolic_top_k_is_refused_not_specialised():
    """Routing inputs of a graph with ``dynamic=True`` make K a symbol: the block is not fused (the stage
    ops take K as an int) and no guard pins K."""
    mod = MODULES["argsort_index_add"](4, 32, 16)

    def make(n):
        g = torch.Generator().manual_seed(n)
        w, ids = torch.randn(n, 4, generator=g).softmax(-1).topk(3)
        return (*_x(n), ids, w)

    outs, refs = _compile_over(mod, (13, 40), make)
    (rep,) = ep_fuse.reports()
    assert "moe_experts" not in rep.counts() and not rep.shape_guards
    assert any("symbolic top-k" in m.explain() for m in rep.near_misses), [m.explain() for m in rep.near_misses]
    assert all(torch.equal(o, r) for o, r in zip(outs, refs))


class HalfToFloatRouter(nn.Module):
    """The CUDA trace of ``F.softmax(fp16 logits, dtype=float32)``: one ``_softmax(x, -1, half_to_float=True)``.
    (The CPU has no such kernel; ``upcast=True`` writes the same function as the CPU traces it.)"""

    def __init__(self, upcast=False):
        super().__init__()
        self.upcast = upcast

    def forward(self, logits):
        if self.upcast:
            p = torch.ops.aten._softmax(logits.float(), -1, False)
        else:
            p = torch.ops.aten._softmax(logits, -1, True)
        w, ids = torch.topk(p, 2, dim=-1)
        return w.to(F16), ids


def test_fp16_half_to_float_softmax_router_fuses():
    logits = torch.randn(9, 8, generator=torch.Generator().manual_seed(0)).to(F16)
    with torch.no_grad():
        ref = HalfToFloatRouter(upcast=True)(logits)
        out = torch.compile(HalfToFloatRouter(), backend="ep_fuse", dynamic=True,
                            options={"executor": "eager", "providers": {"cpu": ["reference"]}})(logits)
    rep = ep_fuse.last_report()
    assert [(m.pattern, m.variant) for m in rep.matches] == [("moe_gating", "softmax_topk")]
    assert rep.ops_after.get("aten._softmax.default", 0) == 0 and not rep.shape_guards
    assert all(torch.equal(a, b) for a, b in zip(out, ref))


class TensorScaleRouter(nn.Module):
    """DeepSeek-V2 greedy under ``dynamic=True``: the routed scaling factor is a 0-d tensor input."""

    def forward(self, logits, scale):
        w, ids = torch.topk(logits.softmax(-1), 2, dim=-1)
        return w * scale, ids


def test_tensor_scale_stays_outside_the_router():
    logits = torch.randn(9, 8, generator=torch.Generator().manual_seed(1))
    for scale, fused in ((torch.tensor(2.5), True), (torch.full((2,), 2.5), False)):
        torch._dynamo.reset()
        mod = TensorScaleRouter()
        with torch.no_grad():
            ref = mod(logits, scale)
            out = torch.compile(mod, backend="ep_fuse", options={"executor": "eager",
                                                                 "providers": {"cpu": ["reference"]}})(logits, scale)
        rep = ep_fuse.last_report()
        assert rep.counts() == ({"moe_gating": 1} if fused else {}), [m.explain() for m in rep.near_misses]
        if fused:
            assert rep.ops_after.get("aten.mul.Tensor") == 1, "the scale multiplies the fused op's weights"
        else:  # a [2] "scale" broadcasts over the slots: not a scalar the op may leave outside
            assert rep.ops_after.get("aten._softmax.default") == 1
        assert all(torch.equal(a, b) for a, b in zip(out, ref))


# --------------------------------------------------------------------------- an odd-sized Qwen2-MoE-style model
SHAPES = [(1, 1), (3, 7), (5, 1), (16, 1), (2, 33), (1, 64)]
"""(batch, length): decode and prefill, batch 1 and larger (the issue's sequence, shrunk)."""


REFERENCE = {"executor": "eager", "providers": {"cpu": ["reference"]}}
"""The Triton interpreter is too slow for 60 experts; provider choices on symbolic sizes are tested above."""


def _run_sequence(model, dynamic, mark):
    f = torch.compile(model, backend="ep_fuse", dynamic=dynamic, options=REFERENCE)
    errors = []
    with torch.no_grad():
        for b, s in SHAPES:
            g = torch.Generator().manual_seed(b * 1000 + s)
            inputs = {"input_ids": torch.randint(0, 128, (b, s), generator=g), "use_cache": False}
            if mark:
                ep_fuse.dynamic_batch(inputs)
            ref = model(**inputs).logits.float()
            out = f(**inputs).logits.float()
            errors.append(((out - ref).norm() / ref.norm()).item())
    return ep_fuse.reports(), errors


@pytest.mark.hf
@pytest.mark.parametrize("dtype, dynamic", [(BF16, True), (F16, True), (BF16, None)],
                         ids=["bf16-dynamic", "fp16-dynamic", "bf16-automatic"])
def test_odd_sized_qwen2_moe_decode_prefill_in_two_graphs(dtype, dynamic):
    model = tiny_models.qwen2_moe_sized(dtype=dtype)
    expected = tiny_models.qwen2_moe_expected(layers=2)
    with torch.no_grad():  # the static compile fuses these sites
        torch.compile(model, backend="ep_fuse", options=REFERENCE)(input_ids=torch.ones(2, 5).long(), use_cache=False)
    assert ep_fuse.last_report().counts() == expected
    torch._dynamo.reset()
    ep_fuse.reset_reports()
    reports, errors = _run_sequence(model, dynamic, mark=True)
    assert len(reports) <= 2, [r.graph for r in reports]
    for rep in reports:
        assert rep.counts() == expected, (rep.graph, rep.counts(), [m.explain() for m in rep.near_misses])
        assert not rep.shape_guards, rep.shape_guards
    assert max(errors) < 0.02, errors


@pytest.mark.hf
def test_unmarked_batch_recompiles_but_every_graph_fuses():
    """Without ``dynamic_batch`` Dynamo specialises batch 1 and length 1 (4 graphs over SHAPES, as with
    ``backend="inductor"``); each graph still fuses every site."""
    model = tiny_models.qwen2_moe_sized()
    reports, errors = _run_sequence(model, True, mark=False)
    assert len(reports) == 4
    expected = tiny_models.qwen2_moe_expected(layers=2)
    assert all(r.counts() == expected and not r.shape_guards for r in reports), [r.summary() for r in reports]
    assert max(errors) < 0.02, errors


def test_canonical_block_keeps_symbolic_rows():
    """The MoE block's fake value follows the token count (no specialisation by the expand pass)."""
    env, mode, t = _env(False)
    with mode:
        x = torch.empty(t, 32, dtype=BF16)
        ids, w = torch.empty(t, 2, dtype=torch.int64), torch.empty(t, 2, dtype=torch.float32)
        w13, w2 = torch.empty(4, 32, 32, dtype=BF16), torch.empty(4, 32, 16, dtype=BF16)
        out = moe_ops.moe_experts.op(x, ids, w, w13, w2, BF16)
    assert sym_eq(out.shape[0], t) and env.guards == []


def test_dynamic_batch_marks_cuda_inputs_only_with_cudnn_sdpa_off(monkeypatch):
    """On CUDA the batch is marked while cuDNN's SDPA is off (it guards ``Eq(u0, 1)`` on an unbacked batch,
    torch 2.11) or with ``force=True``; elsewhere always."""
    from ep_fuse.surgery.prepare import batch_can_be_unbacked

    for enabled, want in ((True, False), (False, True)):
        monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda enabled=enabled: enabled)
        assert batch_can_be_unbacked("cuda") is want
        assert batch_can_be_unbacked("cpu")
    marked = ep_fuse.dynamic_batch({"input_ids": torch.zeros(3, 5, dtype=torch.long)})
    assert 0 in getattr(marked["input_ids"], "_dynamo_unbacked_indices", ())  # mark_unbacked's record

"""The masked expert layout (``ep_fuse::moe_experts_masked``, issue 38 item 1): the Triton kernels (under
``TRITON_INTERPRET=1``) against the reference, the reference against the unmasked ``moe_experts`` path on the valid
rows, the provider's checks, and EP on 2 gloo ranks with the DeepEP double in low-latency mode: every rank equals the
unsharded block, and the graph holds the masked op and no permute over the padding."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ep_fuse
from ep_fuse.ops.moe import moe_experts_ref
from ep_fuse.ops.moe_masked import counts_from_ids, moe_experts_masked_ref, valid_rows
from ep_fuse.providers.triton.moe_masked import check_moe_experts_masked_call, moe_experts_masked_kernel

BF16 = torch.bfloat16
SENTINEL = 12345.0


def _weights(e, h, i, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) / i**0.5).to(dtype)
    return w13, w2


def _layout(e, m, h, counts, dtype, seed=1):
    """A receive buffer ``[E, M, H]`` whose padding rows are NaN (what DeepEP leaves there may be anything)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(e, m, h, generator=g).to(dtype)
    c = torch.tensor(counts, dtype=torch.int32)
    x[~valid_rows(c, m)] = float("nan")
    return x, c


def _tol(dtype):
    return 1e-5 if dtype == torch.float32 else 2e-2


def _close_valid(out, ref, counts, dtype):
    keep = valid_rows(counts, out.shape[1])
    a, b = out[keep].float(), ref[keep].float()
    assert torch.isfinite(a).all(), "the kernel read a padding row"
    tol = _tol(dtype)
    torch.testing.assert_close(a, b, rtol=tol, atol=tol * max(b.abs().max().item() if b.numel() else 0.0, 1e-3))


# =========================================================================== kernel vs reference
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    e=st.integers(1, 4),
    m=st.sampled_from([1, 7, 16, 33]),
    data=st.data(),
    dtype=st.sampled_from([torch.float32, BF16]),
    bound=st.sampled_from([0, 1, 24]),
)
def test_kernel_matches_reference(e, m, data, dtype, bound):
    counts = data.draw(st.lists(st.one_of(st.just(0), st.just(m), st.integers(0, m)), min_size=e, max_size=e))
    h, i = 24, 16  # H not a multiple of the interpreter's BK: the masked K tail
    w13, w2 = _weights(e, h, i, dtype)
    x, c = _layout(e, m, h, counts, dtype)
    out = moe_experts_masked_kernel(x, c, w13, w2, bound)  # bound 1: far below sum(counts), still every row
    assert out.shape == (e, m, h) and out.dtype == dtype and out.is_contiguous()
    _close_valid(out, moe_experts_masked_ref(x, c, w13, w2), c, dtype)


def test_kernel_leaves_the_padding_unwritten():
    from ep_fuse.providers.triton.moe_masked_kernel import launch_moe_experts_masked

    e, m, h, i = 3, 20, 32, 16
    w13, w2 = _weights(e, h, i, BF16)
    x, c = _layout(e, m, h, [0, 20, 5], BF16)
    hbuf = torch.full((e, m, i), SENTINEL, dtype=BF16)
    y = torch.full((e, m, h), SENTINEL, dtype=BF16)
    launch_moe_experts_masked(x, c, w13, w2, hbuf, y, 0, ("silu", None, None, None))
    pad = ~valid_rows(c, m)
    assert (y[pad] == SENTINEL).all() and (hbuf[pad] == SENTINEL).all()
    _close_valid(y, moe_experts_masked_ref(x, c, w13, w2), c, BF16)


def test_counts_outside_the_block_are_clamped():
    e, m, h, i = 2, 8, 16, 16
    w13, w2 = _weights(e, h, i, torch.float32)
    x = torch.randn(e, m, h)
    c = torch.tensor([-3, 99], dtype=torch.int64)
    out = moe_experts_masked_kernel(x, c, w13, w2)
    ref = moe_experts_masked_ref(x, c, w13, w2)
    torch.testing.assert_close(out[1], ref[1], rtol=1e-5, atol=1e-5)
    assert (ref[0] == 0).all()


@pytest.mark.parametrize("act", [("silu_clamp", 1.5, None, None), ("softcap_fp32", None, 3.0, 2.0)])
def test_kernel_gated_activations(act):
    e, m, h, i = 2, 12, 32, 16
    w13, w2 = _weights(e, h, i, BF16)
    x, c = _layout(e, m, h, [12, 3], BF16)
    _close_valid(moe_experts_masked_kernel(x, c, w13, w2, 0, *act), moe_experts_masked_ref(x, c, w13, w2, 0, *act),
                 c, BF16)


# =========================================================================== reference vs the unmasked path
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_reference_equals_moe_experts_on_the_valid_rows(dtype):
    """The expert layout through ``moe_experts`` (ids e or -1, unit weights: what the EP pass ran before) gives the
    masked op's rows below each count, and zeros below none."""
    e, m, h, i = 3, 10, 32, 16
    w13, w2 = _weights(e, h, i, dtype)
    x, c = _layout(e, m, h, [10, 0, 4], dtype)
    keep = valid_rows(c, m)
    ids = torch.where(keep, torch.arange(e).unsqueeze(1), -1).reshape(-1, 1)
    assert torch.equal(counts_from_ids(ids, e), c)
    flat = torch.where(keep.unsqueeze(-1), x, torch.zeros((), dtype=dtype)).reshape(e * m, h)
    unmasked = moe_experts_ref(flat, ids, keep.reshape(-1, 1).to(torch.float32), w13, w2, dtype).reshape(e, m, h)
    masked = moe_experts_masked_ref(x, c, w13, w2)
    _close_valid(masked, unmasked, c, dtype)
    assert (masked[~keep] == 0).all() and (unmasked[~keep] == 0).all()


# =========================================================================== provider checks
def test_the_provider_declines_what_it_cannot_run():
    e, m, h, i = 2, 4, 16, 8
    w13, w2 = _weights(e, h, i, BF16)
    x, c = _layout(e, m, h, [1, 2], BF16)
    assert check_moe_experts_masked_call((x, c, w13, w2)) is None
    assert "dtypes" in check_moe_experts_masked_call((x.float(), c, w13, w2))
    assert "counts" in check_moe_experts_masked_call((x, c.float(), w13, w2))
    assert "counts" in check_moe_experts_masked_call((x, c[:1], w13, w2))
    assert "chain" in check_moe_experts_masked_call((x, c, w13, w2[:, :, :4]))
    assert "unit-stride" in check_moe_experts_masked_call((x.transpose(1, 2).contiguous().transpose(1, 2), c, w13, w2))
    assert "3-D" in check_moe_experts_masked_call((x.reshape(e * m, h), c, w13, w2))
    assert "unknown activation" in check_moe_experts_masked_call((x, c, w13, w2, 0, "gelu_new"))


def test_unverified_on_cuda(monkeypatch):
    """The provider asks the unverified list (cleared since its GPU check ran: put back here to test the wiring)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ep_fuse.providers.triton import unverified
    from ep_fuse.providers.triton.unverified import ENV

    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setitem(unverified.UNVERIFIED_ON_GPU, "moe_experts_masked:triton", "not run on a GPU")
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(2, 4, 16, dtype=BF16, device="cuda")
        c = torch.empty(2, dtype=torch.int32, device="cuda")
        w13 = torch.empty(2, 16, 16, dtype=BF16, device="cuda")
        w2 = torch.empty(2, 16, 8, dtype=BF16, device="cuda")
    assert "not cleared for GPUs" in check_moe_experts_masked_call((x, c, w13, w2))


def test_the_ep_pass_keeps_moe_experts_on_cuda_until_cleared(monkeypatch):
    """On a CUDA graph the masked layout waits for its GPU check while the kernels are in UNVERIFIED_ON_GPU (put
    back here: cleared since the check ran), unless ``unverified_kernels`` is on; the decision needs no process
    group."""
    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import FakeTensorMode

    from ep_fuse import runtime
    from ep_fuse.config import EpFuseConfig
    from ep_fuse.passes.ep_masked import masked_decline
    from ep_fuse.providers.triton import unverified
    from ep_fuse.providers.triton.unverified import ENV

    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setitem(unverified.UNVERIFIED_ON_GPU, "moe_experts_masked:triton", "not run on a GPU")
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        x = torch.empty(8, 2048, dtype=BF16, device="cuda")
        ids = torch.empty(8, 4, dtype=torch.int64, device="cuda")
        w13 = torch.empty(2, 32, 2048, dtype=BF16, device="cuda")
        w2 = torch.empty(2, 2048, 16, dtype=BF16, device="cuda")
    for unverified, expect in ((False, "not cleared for GPUs"), (True, None)):
        cfg = EpFuseConfig(unverified_kernels=unverified)
        ctx = SimpleNamespace(config=cfg, device="cuda", executor="inductor", fake_mode=mode)
        with runtime.use_config(cfg):
            why = masked_decline("deepep_low_latency", "expert", x, ids, w13, w2, 2, 8, (), ctx)
        assert why is None if expect is None else expect in why, why


def test_opcheck():
    e, m, h, i = 2, 5, 16, 8
    w13, w2 = _weights(e, h, i, torch.float32)
    x = torch.randn(e, m, h)
    c = torch.tensor([m, m], dtype=torch.int32)  # full blocks: the output is defined everywhere
    for op in (torch.ops.ep_fuse.moe_experts_masked.default, torch.ops.ep_fuse_triton.moe_experts_masked.default):
        torch.library.opcheck(op, (x, c, w13, w2), test_utils=("test_schema", "test_faketensor"))


# =========================================================================== EP on 2 ranks (DeepEP double, LL)
LL_HIDDEN = 2048  # DeepEP's low-latency kernels exist for a few hidden sizes only


class _Block(torch.nn.Module):
    def __init__(self, num_experts, hidden=LL_HIDDEN, inter=16):
        super().__init__()
        self.num_experts = num_experts
        w13, w2 = _weights(num_experts, hidden, inter, BF16)
        self.w13, self.w2 = torch.nn.Parameter(w13), torch.nn.Parameter(w2)

    def forward(self, x, topk_ids, topk_weights):
        return torch.ops.ep_fuse.moe_experts(x, topk_ids, topk_weights, self.w13, self.w2, BF16)


def _ll_case(world, *, executor, providers, expect_masked, t=12, k=2, e_per_rank=2, capacity=16, invalid=0.2):
    import torch.distributed as dist

    e = e_per_rank * world
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(300 + rank)
    w, ids = torch.randn(t, e, generator=g).softmax(-1).topk(k)
    ids = torch.where(torch.rand(t, k, generator=g) < invalid, -1, ids)
    x = torch.randn(t, LL_HIDDEN, generator=g).to(BF16)
    full = _Block(e)
    with torch.no_grad():
        ref = full(x, ids, w)
    model = ep_fuse.shard_experts(copy.deepcopy(full))
    opts = ep_fuse.ep_options(model, engine="deepep_low_latency", capacity=capacity, timeout_s=60.0)
    compiled = torch.compile(model, backend="ep_fuse",
                             options={"executor": executor, "providers": {"cpu": providers}, **opts})
    with torch.no_grad():
        out = compiled(x, ids, w)
    rep = ep_fuse.last_report()
    (site,) = rep.ep
    assert site.engine == "deepep_low_latency" and site.layout == "expert"
    ops = rep.ops_after
    if expect_masked:
        assert site.local_block == "moe_experts_masked" and "masked experts" in rep.summary()
        assert ops.get("ep_fuse_triton.moe_experts_masked.default") == 1, ops
        assert not any("moe_permute" in o or "moe_unpermute" in o or "grouped_gemm" in o for o in ops), ops
    else:
        assert site.local_block == "moe_experts" and not any("masked" in o for o in ops), ops
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def _with_deepep_double(world, cases):
    from support import deepep_double

    from ep_fuse.ep import deepep, handles

    sys.modules["deep_ep"] = deepep_double.make_module()
    deepep.available.cache_clear()
    deepep._BUFFERS.clear()
    try:
        for case in cases:
            torch._dynamo.reset()
            _ll_case(world, **case)
        assert handles.pending() == 0
    finally:
        deepep.destroy_buffers()
        sys.modules.pop("deep_ep", None)
        deepep.available.cache_clear()


def sc_deepep_ll_masked(world):
    triton = dict(executor="eager", providers=["triton"], expect_masked=True)
    _with_deepep_double(world, [triton, dict(triton, t=16, invalid=0.0, k=3),  # full batch, 3 experts per token
                                dict(triton, e_per_rank=8, k=6, t=8, capacity=8, invalid=0.05),  # many experts
                                dict(triton, providers=["reference"], expect_masked=False)])  # no fused provider


def sc_deepep_ll_masked_inductor(world):
    _with_deepep_double(world, [dict(executor="inductor", providers=["triton"], expect_masked=True, t=16, invalid=0.0)])


def sc_quant_keeps_moe_experts(world):
    """``quant`` blocks run on permuted rows: the masked layout is declined (decided before anything runs)."""
    from types import SimpleNamespace

    from ep_fuse.passes.ep_masked import masked_decline

    ctx = SimpleNamespace(config=SimpleNamespace(quant="fp8_block"))
    why = masked_decline("deepep_low_latency", "expert", None, None, None, None, world, 16, (), ctx)
    assert "quant" in why
    assert "rank layout" in masked_decline("deepep", "rank", None, None, None, None, world, 16, (), ctx)
    assert "valid rows first" in masked_decline("all_to_all", "expert", None, None, None, None, world, 16, (), ctx)


SCENARIOS = [sc_deepep_ll_masked, sc_quant_keeps_moe_experts]


def _run(scenarios):
    from support.dist_harness import check, run_ranks

    results = run_ranks(__name__, [f.__name__ for f in scenarios], 2, "gloo", 300.0)
    for f in scenarios:
        check(results, f.__name__)


def test_two_ranks_deepep_low_latency():
    _run(SCENARIOS)


@pytest.mark.slow
def test_two_ranks_deepep_low_latency_inductor():
    _run([sc_deepep_ll_masked_inductor])


@pytest.mark.slow
def test_bench_masked_case_at_the_tiny_shape():
    """``bench/bench_moe_masked.py`` on a CPU: masked, padded and one-GPU paths run, and agree."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "bench_moe_masked.py"
    spec = importlib.util.spec_from_file_location("bench_moe_masked", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    (row,) = bench.run(bench.TINY, "cpu")
    assert row["rel_l2_masked_vs_padded"] < 2e-2 and 0 < row["valid_rows"] <= row["rows"]
    assert all(row[k] > 0 for k in ("masked_us", "padded_us", "one_gpu_us"))

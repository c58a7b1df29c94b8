"""GPU check of the masked expert layout's kernels (``moe_experts_masked:triton`` in ``UNVERIFIED_ON_GPU``).

One GPU: the Triton kernels vs the canonical reference (``ep_fuse.ops.moe_masked.moe_experts_masked_ref``) in bf16
at DeepSeek-V3-like sizes (H7168, I2048; E_r 32 x 1024 rows and E_r 128 x 256 rows, the DeepEP low-latency receive
buffers of 2 ranks at C 512 / 128), uniform and skewed counts (empty and full experts), NaN padding that must never
be read; replayed from a CUDA graph with counts changed in place between replays (no host sync); Inductor inlining
the launch. Two GPUs with ``deep_ep``: a DeepSeek-V3 routed layer through the compiler with DeepEP low-latency under
CUDA graphs, the graph holding ``moe_experts_masked``, every rank equal to the unsharded layer. Passing clears the
variant (remove it from ``UNVERIFIED_ON_GPU``)."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

BF16 = torch.bfloat16
H, I = 7168, 2048
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def _cleared(monkeypatch):
    monkeypatch.setenv("EP_FUSE_UNVERIFIED_KERNELS", "1")


def _counts(e: int, m: int, kind: str, g: torch.Generator) -> torch.Tensor:
    if kind == "uniform":
        c = torch.randint(0, m // 8 + 1, (e,), generator=g)
    else:  # skewed: a few full experts, many empty, the rest small
        c = torch.zeros(e, dtype=torch.int64)
        c[: max(1, e // 16)] = m
        c[e // 16: e // 2] = torch.randint(1, 17, (e // 2 - e // 16,), generator=g)
    return c.to(torch.int32).cuda()


def _case(e: int, m: int, kind: str):
    from ep_fuse.ops.moe_masked import valid_rows

    g = torch.Generator().manual_seed(e + m)
    counts = _counts(e, m, kind, g)
    x = torch.randn(e, m, H, device="cuda").to(BF16)
    x[~valid_rows(counts, m)] = float("nan")
    w13 = (torch.randn(e, 2 * I, H, device="cuda") / H**0.5).to(BF16)
    w2 = (torch.randn(e, H, I, device="cuda") / I**0.5).to(BF16)
    return x, counts, w13, w2


def _check(out, x, counts, w13, w2):
    from ep_fuse.ops.moe_masked import moe_experts_masked_ref, valid_rows

    keep = valid_rows(counts, x.shape[1])
    ref = moe_experts_masked_ref(torch.nan_to_num(x), counts, w13, w2)
    a, b = out[keep].float(), ref[keep].float()
    assert torch.isfinite(a).all(), "a padding row was read"
    err = ((a - b).norm() / b.norm().clamp(min=1e-6)).item()
    assert err < 1e-2, f"relative L2 {err}"


@pytest.mark.parametrize("kind", ["uniform", "skewed"])
@pytest.mark.parametrize("e,m", [(32, 1024), (128, 256)])
def test_kernel_matches_reference(e, m, kind):
    from ep_fuse.providers.triton.moe_masked import check_moe_experts_masked_call, moe_experts_masked_kernel

    x, counts, w13, w2 = _case(e, m, kind)
    assert check_moe_experts_masked_call((x, counts, w13, w2)) is None
    for bound in (0, 2 * m * 8):  # no bound; the LL bound W*C*K (C = m/2, K 8)
        _check(moe_experts_masked_kernel(x, counts, w13, w2, bound), x, counts, w13, w2)


def test_cuda_graph_replay_with_new_counts():
    from ep_fuse.providers.triton.moe_masked import moe_experts_masked_kernel

    x, counts, w13, w2 = _case(128, 256, "uniform")
    x = torch.nan_to_num(x)
    moe_experts_masked_kernel(x, counts, w13, w2, 4096)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_experts_masked_kernel(x, counts, w13, w2, 4096)
    for kind in ("uniform", "skewed"):
        counts.copy_(_counts(128, 256, kind, torch.Generator().manual_seed(7)))
        torch.cuda.set_sync_debug_mode("error")
        try:
            graph.replay()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        _check(out, x, counts, w13, w2)


def test_under_inductor():
    x, counts, w13, w2 = _case(32, 1024, "skewed")
    x = torch.nan_to_num(x)

    def f(x, counts):
        return torch.ops.ep_fuse_triton.moe_experts_masked(x, counts, w13, w2, 8192)

    out = torch.compile(f, backend="inductor")(x, counts)
    _check(out, x, counts, w13, w2)


# ----------------------------------------------------------------------------------- 2 GPUs, real DeepEP LL
class _Block(torch.nn.Module):
    def __init__(self, e: int, h: int, i: int) -> None:
        super().__init__()
        g = torch.Generator(device="cuda").manual_seed(0)
        self.num_experts = e
        self.w13 = torch.nn.Parameter((torch.randn(e, 2 * i, h, device="cuda", generator=g) / h**0.5).to(BF16))
        self.w2 = torch.nn.Parameter((torch.randn(e, h, i, device="cuda", generator=g) / i**0.5).to(BF16))

    def forward(self, x, ids, w):
        return torch.ops.ep_fuse.moe_experts(x, ids, w, self.w13, self.w2, BF16)


def sc_deepseek_v3_ll_masked(world):
    import torch.distributed as dist

    import ep_fuse

    t, e, k = 128, 256, 8
    g = torch.Generator(device="cuda").manual_seed(10 + dist.get_rank())
    x = torch.randn(t, H, device="cuda", generator=g).to(BF16)
    w, ids = torch.randn(t, e, device="cuda", generator=g).softmax(-1).topk(k)
    full = _Block(e, H, I)
    with torch.no_grad():
        ref = full(x, ids, w)
    model = ep_fuse.shard_experts(copy.deepcopy(full))
    del full
    opts = {**ep_fuse.ep_options(model, engine="deepep_low_latency", capacity=t), "executor": "inductor",
            "mode": "reduce-overhead", "unverified_kernels": True}
    fn = torch.compile(model, backend="ep_fuse", options=opts)
    with torch.no_grad():
        for _ in range(3):  # warm-up, capture, replay
            out = fn(x, ids, w)
    (site,) = ep_fuse.last_report().ep
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    errs = [torch.zeros(1, device="cuda") for _ in range(world)]
    dist.all_gather(errs, torch.tensor([err], device="cuda"))
    assert site.local_block == "moe_experts_masked", site
    assert all(v.item() < 1e-2 for v in errs), [v.item() for v in errs]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.skipif(importlib.util.find_spec("deep_ep") is None, reason="deep_ep is not installed")
def test_deepep_low_latency_two_gpus():
    from support.dist_harness import check, run_ranks

    results = run_ranks("test_gpu_moe_masked", ["sc_deepseek_v3_ll_masked"], world=2, backend="nccl", timeout_s=600.0)
    check(results, "sc_deepseek_v3_ll_masked")

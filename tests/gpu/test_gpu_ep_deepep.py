"""Two GPUs, real DeepEP (V1, commit 29d31c0): normal and low-latency dispatch/combine through the compiler.

Skipped below 2 GPUs or when ``deep_ep`` does not import (``tools/build_deepep.sh`` builds it). Every
rank runs its own tokens through its shard of the experts; its output must equal the unsharded model's
output on the same tokens: relative L2 of the logits below 2e-2 (bf16; EP adds one bf16 rounding of
each rank's partial sum, which DeepEP's BF16 combine takes), 1e-2 for a single layer."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

BF16 = torch.bfloat16
SCENARIOS = ["sc_tiny_hf_normal", "sc_tiny_hf_normal_capacity", "sc_tiny_hf_low_latency_cuda_graphs",
             "sc_deepseek_v3_layer", "sc_low_latency_limit_declines_to_normal", "sc_teardown"]

needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
needs_deep_ep = pytest.mark.skipif(importlib.util.find_spec("deep_ep") is None, reason="deep_ep is not installed")


# ----------------------------------------------------------------------------------- in the workers
def _agree_close(out, ref, tol=2e-2):
    """Relative L2 of ``out`` vs ``ref`` below ``tol`` on every rank; all ranks raise together (a rank
    that raised alone would leave its peers waiting inside the next DeepEP call)."""
    import torch.distributed as dist

    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    errs = [torch.zeros(1, device="cuda") for _ in range(dist.get_world_size())]
    dist.all_gather(errs, torch.tensor([err], device="cuda"))
    errs = [e.item() for e in errs]
    assert all(e < tol for e in errs), f"relative L2 per rank {errs} (bound {tol})"


def _sites():
    import ep_fuse
    from ep_fuse.passes.ep import ep_sites

    return ep_sites(ep_fuse.last_report())


def _hf(name, backend, capacity=None, mode=None, batch=2, seq=8, **overrides):
    import torch.distributed as dist

    import ep_fuse
    from ep_fuse.testing import tiny as tiny_models

    model = tiny_models.build(name, device="cuda", **overrides)
    inp = tiny_models.example_inputs(batch=batch, seq=seq, device="cuda", seed=dist.get_rank())
    with torch.no_grad():
        ref = model(**inp).logits
    ep_fuse.shard_experts(model)
    opts = {**ep_fuse.ep_options(model, engine=backend, capacity=capacity), "executor": "inductor"}
    if mode:
        opts["mode"] = mode
    fn = torch.compile(model, backend="ep_fuse", options=opts)
    with torch.no_grad():
        for _ in range(3 if mode else 1):  # reduce-overhead: warm-up, capture, replay
            out = fn(**inp).logits
    sites = _sites()
    assert sites and {s.engine for s in sites} == {backend}, sites
    _agree_close(out, ref)


def sc_tiny_hf_normal(world):
    for name in ("mixtral", "qwen3_moe", "deepseek_v3"):
        torch._dynamo.reset()
        _hf(name, "deepep")  # data-dependent receive counts (host sync), dynamic=None


def sc_tiny_hf_normal_capacity(world):
    for name in ("mixtral", "qwen3_moe", "deepseek_v3"):
        torch._dynamo.reset()
        _hf(name, "deepep", capacity=16)  # num_worst_tokens: no host sync


def sc_tiny_hf_low_latency_cuda_graphs(world):
    big = dict(hidden_size=2048)  # DeepEP's LL kernels exist for a few hidden sizes only
    for name in ("mixtral", "qwen3_moe", "deepseek_v3"):
        torch._dynamo.reset()
        _hf(name, "deepep_low_latency", capacity=16, mode="reduce-overhead", **big)


class _Block(torch.nn.Module):
    def __init__(self, e, h, i):
        super().__init__()
        g = torch.Generator(device="cuda").manual_seed(0)
        self.num_experts = e
        self.w13 = torch.nn.Parameter((torch.randn(e, 2 * i, h, device="cuda", generator=g) / h**0.5).to(BF16),
                                      requires_grad=False)
        self.w2 = torch.nn.Parameter((torch.randn(e, h, i, device="cuda", generator=g) / i**0.5).to(BF16),
                                     requires_grad=False)

    def forward(self, x, ids, w):
        return torch.ops.ep_fuse.moe_experts(x, ids, w, self.w13, self.w2, BF16)


def _layer(t, backend, capacity, e=256, h=7168, i=2048, k=8, mode=None):
    import torch.distributed as dist

    import ep_fuse

    g = torch.Generator(device="cuda").manual_seed(10 + dist.get_rank())
    x = torch.randn(t, h, device="cuda", generator=g).to(BF16)
    w, ids = torch.randn(t, e, device="cuda", generator=g).softmax(-1).topk(k)
    full = _Block(e, h, i)
    with torch.no_grad():
        ref = full(x, ids, w)
    model = ep_fuse.shard_experts(copy.deepcopy(full))
    del full
    opts = {**ep_fuse.ep_options(model, engine=backend, capacity=capacity), "executor": "inductor"}
    if mode:
        opts["mode"] = mode
    fn = torch.compile(model, backend="ep_fuse", options=opts)
    with torch.no_grad():
        for _ in range(3 if mode else 1):
            out = fn(x, ids, w)
    _agree_close(out, ref, 1e-2)
    return _sites()


def sc_deepseek_v3_layer(world):
    sites = _layer(128, "deepep_low_latency", 128, mode="reduce-overhead")  # decode: LL under CUDA graphs
    assert sites[0].engine == "deepep_low_latency", sites
    torch._dynamo.reset()
    sites = _layer(512, "deepep", 512)  # prefill-like: normal, num_worst_tokens
    assert sites[0].engine == "deepep", sites
    torch._dynamo.reset()
    sites = _layer(256, "deepep", None)  # data-dependent
    assert sites[0].engine == "deepep", sites


def sc_low_latency_limit_declines_to_normal(world):
    # 4096 tokens per rank at H7168 x 256 experts: beyond the LL buffer / QP depth limits
    sites = _layer(4096, "deepep_low_latency", 4096)
    assert sites[0].engine == "deepep" and sites[0].declined[0][0] == "deepep_low_latency", sites
    torch._dynamo.reset()
    sites = _layer(4096, "auto", 4096)  # auto follows the measured order for this group size (never LL here)
    from ep_fuse.passes.ep import auto_order

    assert sites[0].engine == auto_order("cuda", 4096, world)[0] != "deepep_low_latency", sites


def sc_teardown(world):
    from ep_fuse.ep import deepep, release_buffers

    assert deepep._BUFFERS, "the scenarios above created a buffer"
    release_buffers()
    release_buffers()
    assert not deepep._BUFFERS
    torch._dynamo.reset()
    _hf("mixtral", "deepep", capacity=16)  # a new buffer after release


# ----------------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def results():
    from support.dist_harness import run_ranks

    return run_ranks("test_gpu_ep_deepep", SCENARIOS, world=2, backend="nccl", timeout_s=600.0)


@needs_two
@needs_deep_ep
@pytest.mark.parametrize("name", SCENARIOS)
def test_deepep_two_gpus(results, name):
    from support.dist_harness import check

    check(results, name)

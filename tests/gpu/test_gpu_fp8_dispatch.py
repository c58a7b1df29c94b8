"""GPU check of the FP8 EP dispatch (``quant="fp8_block"`` behind ``all_to_all`` and DeepEP normal) on 2 processes.

    python -m pytest -q tests/gpu/test_gpu_fp8_dispatch.py

It clears ``ep:fp8_dispatch`` in ``ep_fuse/providers/triton/unverified.py`` (this file sets
``EP_FUSE_UNVERIFIED_KERNELS=1`` in the workers). Per rank, the DeepSeek-V3 routed layer at decode size
(T128, capacity, Inductor executor): the output with fp8 codes + scales on the wire equals, bit for bit, the
output with bf16 on the wire and the quantization after the dispatch (both run the same Triton FP8 stage
kernels), the EP record says what was sent, and both stay close to the unsharded bf16 layer. The DeepEP
scenario needs ``deep_ep`` importable (``bash tools/device_run.sh deepep`` builds it) and is skipped without it.
"""

from __future__ import annotations

import copy

import pytest
import torch

BF16 = torch.bfloat16
SCENARIOS = ["sc_fp8_dispatch_decode", "sc_fp8_dispatch_decode_deepep"]

needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
needs_sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                reason="FP8 tensor cores need sm90+")


class _Block(torch.nn.Module):
    def __init__(self, e: int, h: int, i: int) -> None:
        super().__init__()
        g = torch.Generator(device="cuda").manual_seed(0)
        self.num_experts = e
        self.w13 = torch.nn.Parameter(torch.randn(e, 2 * i, h, device="cuda", generator=g).mul_(h**-0.5).to(BF16))
        self.w2 = torch.nn.Parameter(torch.randn(e, h, i, device="cuda", generator=g).mul_(i**-0.5).to(BF16))

    def forward(self, x, ids, w):
        return torch.ops.ep_fuse.moe_experts(x, ids, w, self.w13, self.w2, BF16)


def sc_fp8_dispatch_decode(world, backend="all_to_all"):
    import os

    import torch.distributed as dist

    import ep_fuse
    from ep_fuse.passes.ep import ep_sites
    from ep_fuse.providers.triton import fp8 as triton_fp8

    os.environ["EP_FUSE_UNVERIFIED_KERNELS"] = "1"
    t, e, h, i, k = 128, 256, 7168, 2048, 8
    g = torch.Generator(device="cuda").manual_seed(10 + dist.get_rank())
    x = torch.randn(t, h, device="cuda", generator=g).to(BF16)
    w, ids = torch.randn(t, e, device="cuda", generator=g).softmax(-1).topk(k)
    full = _Block(e, h, i)
    with torch.no_grad():
        ref = full(x, ids, w)
    model = ep_fuse.shard_experts(copy.deepcopy(full))
    del full
    opts = {**ep_fuse.ep_options(model, engine=backend, capacity=t), "executor": "inductor",
            "quant": "fp8_block"}
    outs, payloads = {}, {}
    rule = triton_fp8.FP8_BLOCK_MAX_ROWS_PER_EXPERT
    triton_fp8.FP8_BLOCK_MAX_ROWS_PER_EXPERT = 1 << 30  # this checks the wire format, not the speed rule
    try:
        for on in (True, False):
            torch._dynamo.reset()
            with torch.no_grad():
                outs[on] = torch.compile(model, backend="ep_fuse", options={**opts, "ep_fp8_dispatch": on})(x, ids, w)
            (site,) = ep_sites(ep_fuse.last_report())
            assert site.engine == backend, site
            payloads[on] = site.payload
    finally:
        triton_fp8.FP8_BLOCK_MAX_ROWS_PER_EXPERT = rule
    assert payloads == {True: "fp8 e4m3 + 1x128 fp32 scales", False: ""}, payloads
    same = torch.tensor([float(torch.equal(outs[True], outs[False]))], device="cuda")
    rel = ((outs[True].float() - ref.float()).norm() / ref.float().norm()).reshape(1)
    both = torch.cat([same, rel])
    gathered = [torch.zeros(2, device="cuda") for _ in range(world)]
    dist.all_gather(gathered, both)  # every rank raises together
    assert all(v[0].item() == 1.0 for v in gathered), f"fp8 vs bf16 dispatch differ: {gathered}"
    assert all(v[1].item() < 0.1 for v in gathered), f"rel-L2 vs the bf16 layer: {gathered}"


def sc_fp8_dispatch_decode_deepep(world):
    """The same through DeepEP's normal dispatch with ``num_worst_tokens`` (codes + scales as one uint8 row of
    7392 bytes); the test below skips it when ``deep_ep`` cannot be imported."""
    try:
        sc_fp8_dispatch_decode(world, backend="deepep")
    finally:
        from ep_fuse.ep import deepep

        deepep.destroy_buffers()


# ----------------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def results():
    from support.dist_harness import run_ranks

    return run_ranks("test_gpu_fp8_dispatch", SCENARIOS, world=2, backend="nccl", timeout_s=400.0)


@needs_two
@needs_sm90
@pytest.mark.parametrize("name", SCENARIOS)
def test_fp8_dispatch_two_gpus(results, name):
    import importlib.util

    from support.dist_harness import check

    if name.endswith("_deepep") and importlib.util.find_spec("deep_ep") is None:
        pytest.skip("deep_ep is not importable (bash tools/device_run.sh deepep builds it)")
    check(results, name)

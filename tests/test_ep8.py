"""Expert parallelism at DeepSeek's own rank count, on CPUs: 8 gloo ranks (issue 18 without the GPUs).

8 processes (about 50 s on a 2-core machine): the DeepSeek-V3 routed-layer
layout (256 experts, top-8, 32 experts per rank; small hidden sizes) and a tiny HF DeepSeek-V3 model, each
rank's output against the unsharded model on its own tokens, data-dependent and with a capacity, through
the all_to_all engine and the DeepEP test double. The GPU run (8 × H200, DeepEP, symm_mem) is issue 18.
"""

from __future__ import annotations

import pytest
import torch
from test_ep import _block_case, _hf_case, _install


def sc_deepseek_v3_layout(world):
    """256 experts, top-8, 32 per rank, 24 tokens per rank with some -1 slots; data-dependent, then capacity."""
    assert world == 8
    _block_case(world, e_per_rank=32, k=8, t=24, invalid=0.05, hidden=64)
    torch._dynamo.reset()
    _block_case(world, e_per_rank=32, k=8, t=24, capacity=24, out_dtype=None, hidden=64)


def sc_deepseek_v3_layout_deepep_double(world):
    """The same layout through the DeepEP test double: normal (data-dependent) and low-latency (capacity,
    hidden 2048: DeepEP's LL kernels exist for a few hidden sizes only)."""
    from support import deepep_double

    from ep_fuse.ep import deepep

    _install("deep_ep", deepep_double.make_module())
    deepep.available.cache_clear()
    deepep._BUFFERS.clear()
    _block_case(world, backend="deepep", e_per_rank=32, k=8, t=24, invalid=0.05, hidden=64)
    torch._dynamo.reset()
    _block_case(world, backend="deepep_low_latency", e_per_rank=32, k=8, t=24, capacity=24, hidden=2048)


def sc_tiny_hf_deepseek_v3(world):
    _hf_case("deepseek_v3", torch.float32, capacity=16)


SCENARIOS = [sc_deepseek_v3_layout, sc_deepseek_v3_layout_deepep_double, sc_tiny_hf_deepseek_v3]


@pytest.fixture(scope="module")
def ep8():
    from support.dist_harness import run_ranks

    return run_ranks(__name__, [f.__name__ for f in SCENARIOS], 8, "gloo", 900.0, ())


@pytest.mark.parametrize("name", [f.__name__ for f in SCENARIOS])
def test_eight_ranks(ep8, name):
    from support.dist_harness import check

    check(ep8, name)

"""DeepEP past one node, by contract: 4 gloo ranks as 2 fake nodes of 2 (``docs/ep.md``, "Past one node").

The DeepEP double (``support/deepep_double.py``) is made with 2 ranks per node (real DeepEP: 8, compiled in)
and ep_fuse's engine is told the same (``deepep.NVL_RANKS``); each rank's host name is faked as its node.
Outputs must equal the unsharded block, the double must have run its internode kernels on an RDMA buffer
sized from ``Config.get_rdma_buffer_size_hint``, and a group whose hosts do not match DeepEP's node layout must
fail with ``EpError`` before any buffer exists. Not real DeepEP, not more than one machine.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.distributed as dist

import ep_fuse

BF16 = torch.bfloat16
PER_NODE = 2


class Block(torch.nn.Module):
    """The canonical MoE block as a module (ids may hold -1)."""

    def __init__(self, num_experts: int, hidden: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.num_experts = num_experts
        self.w13 = torch.nn.Parameter((torch.randn(num_experts, 32, hidden, generator=g) / hidden**0.5).to(BF16))
        self.w2 = torch.nn.Parameter((torch.randn(num_experts, hidden, 16, generator=g) / 4).to(BF16))

    def forward(self, x, topk_ids, topk_weights):
        return torch.ops.ep_fuse.moe_experts(x, topk_ids, topk_weights, self.w13, self.w2, BF16)


def _case(world: int, backend: str, capacity: int | None = None, hidden: int = 64, t: int = 10, seed: int = 0):
    """Sharded block under EP vs the whole block on this rank's tokens; returns the EP site."""
    from ep_fuse.passes.ep import ep_sites

    e = 2 * world
    full = Block(e, hidden)
    g = torch.Generator().manual_seed(100 + seed + dist.get_rank())
    w, ids = torch.randn(t, e, generator=g).softmax(-1).topk(2)
    ids = torch.where(torch.rand(t, 2, generator=g) < 0.2, -1, ids)  # some empty slots
    x = torch.randn(t, hidden, generator=g).to(BF16)
    with torch.no_grad():
        ref = full(x, ids, w)
    model = ep_fuse.shard_experts(copy.deepcopy(full))
    opts = ep_fuse.ep_options(model, engine=backend, capacity=capacity, timeout_s=60)
    options = {"executor": "eager", "providers": {"cpu": ["reference"]}, **opts}
    with torch.no_grad():
        out = torch.compile(model, backend="ep_fuse", options=options)(x, ids, w)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    (site,) = ep_sites(ep_fuse.last_report())
    return site


class _FakeNodes:
    """The DeepEP double with ``PER_NODE`` ranks per node, ep_fuse told the same, hosts named by node."""

    def __init__(self, hosts=None) -> None:
        self.hosts = hosts or (lambda rank: f"node{rank // PER_NODE}")

    def __enter__(self):
        from support import deepep_double

        from ep_fuse.ep import deepep

        self.deepep, self.double = deepep, deepep_double
        self.saved = deepep.NVL_RANKS, deepep.host_name
        sys.modules["deep_ep"] = deepep_double.make_module(nvl_peers=PER_NODE)
        deepep.NVL_RANKS = PER_NODE
        rank = dist.get_rank()
        deepep.host_name = lambda: self.hosts(rank)
        deepep.available.cache_clear()
        deepep.destroy_buffers()
        deepep_double.Buffer.created.clear()
        torch._dynamo.reset()
        return self

    def __exit__(self, *exc):
        try:
            self.deepep.destroy_buffers()
        finally:
            self.deepep.NVL_RANKS, self.deepep.host_name = self.saved
            self.double.make_module()  # back to 8 ranks per node
            sys.modules.pop("deep_ep", None)
            self.deepep.available.cache_clear()


def sc_internode_normal(world):
    """Data-dependent DeepEP normal on 2 x 2 ranks: the internode kernels, equal outputs, RDMA buffer hint."""
    with _FakeNodes() as f:
        hidden = 64
        site = _case(world, "deepep", hidden=hidden)
        assert site.engine == "deepep" and not site.declined, site
        (buf,) = f.double.Buffer.created
        assert buf.runtime.get_num_rdma_ranks() == world // PER_NODE
        assert buf.calls == ["internode_dispatch", "internode_combine"], buf.calls
        deep_ep = sys.modules["deep_ep"]
        hints = [cfg.get_rdma_buffer_size_hint(hidden * 2, world)
                 for cfg in (deep_ep.Buffer.get_dispatch_config(world), deep_ep.Buffer.get_combine_config(world))]
        assert buf.num_rdma_bytes == max(hints) > 0, (buf.num_rdma_bytes, hints)
        assert f.deepep._BUFFERS[dist.group.WORLD.group_name].num_rdma_ranks == 2
        # a second layer shape reuses the buffer (its size hints do not grow) and runs internode again
        torch._dynamo.reset()
        _case(world, "deepep", hidden=32, seed=1)
        assert len(f.double.Buffer.created) == 1 and buf.calls.count("internode_dispatch") == 2
        from ep_fuse.ep import handles

        assert handles.pending() == 0


def sc_internode_capacity_declines(world):
    """``ep_capacity`` (num_worst_tokens) is intranode only: DeepEP normal declines at compile time; LL runs."""
    with _FakeNodes() as f:
        site = _case(world, "deepep", capacity=12, seed=2)
        assert site.engine == "all_to_all", site
        assert site.declined[0][0] == "deepep" and "intranode only" in site.declined[0][1], site.declined
        assert f.double.Buffer.created == []
        # decode with a capacity: low-latency (RDMA kernels on any group) runs on the same split
        torch._dynamo.reset()
        site = _case(world, "deepep_low_latency", capacity=16, hidden=2048, seed=4)
        assert site.engine == "deepep_low_latency" and not site.declined, site
        (buf,) = f.double.Buffer.created
        assert buf.low_latency_mode and buf.runtime.get_num_rdma_ranks() == 2
        assert buf.calls == ["low_latency_dispatch", "low_latency_combine"], buf.calls


def sc_internode_wrong_hosts(world):
    """Hosts that do not form DeepEP's nodes (all on one host): EpError before a buffer is made."""
    with _FakeNodes(hosts=lambda rank: "onehost") as f:
        try:
            _case(world, "deepep", seed=3)
            raise AssertionError("expected EpError")
        except Exception as exc:  # raised inside the compiled call
            assert "DeepEP assumes node n holds EP ranks" in str(exc), exc
        assert f.double.Buffer.created == [] and not f.deepep._BUFFERS


SCENARIOS = [sc_internode_normal, sc_internode_capacity_declines, sc_internode_wrong_hosts]


@pytest.fixture(scope="module")
def ep4():
    from support.dist_harness import run_ranks

    return run_ranks(__name__, [f.__name__ for f in SCENARIOS], world=4, timeout_s=300)


@pytest.mark.parametrize("name", [f.__name__ for f in SCENARIOS])
def test_fake_two_nodes(ep4, name):
    from support.dist_harness import check

    check(ep4, name)


def test_internode_guards():
    """Compile-time reasons for DeepEP's internode limits (single process, real node size 8)."""
    from ep_fuse.ep import deepep

    assert deepep.node_split(8) == (1, 8) and deepep.node_split(32) == (4, 8) and deepep.node_split(2) == (1, 2)
    assert deepep.internode_reason(8, 64) is None  # intranode: num_worst_tokens allowed
    assert deepep.internode_reason(16, 0) is None and deepep.internode_reason(64, 0) is None
    assert "multiple of 8" in deepep.internode_reason(12, 0)
    assert "nodes, not 5" in deepep.internode_reason(40, 0)
    assert "intranode only" in deepep.internode_reason(16, 128)

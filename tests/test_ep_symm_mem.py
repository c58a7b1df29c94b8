"""The symm_mem EP engine (``ep_fuse/ep/symm_mem.py``) on CPU: gloo processes run it against
``support/symm_mem_double.py``, a double of PyTorch's NVSHMEM ``all_to_all_vdev_2d`` / ``_offset`` contract (not the
real ops; ``tests/gpu/test_ep_symm_mem_gpu.py`` runs those). Results must equal the ``all_to_all``
reference provider and the single-process model.

One group of processes per world size runs a list of scenarios (``test_ep.py`` pattern).
"""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch
import torch.distributed as dist

import ep_fuse
from ep_fuse.config import EpFuseConfig

BF16 = torch.bfloat16
TIMEOUT_S = 60.0


# =========================================================================== helpers (run in the workers)
@contextlib.contextmanager
def _double():
    from support import symm_mem_double

    with symm_mem_double.installed():
        yield symm_mem_double


def _rt():
    from ep_fuse.ep import symm_mem

    return symm_mem.runtime()


def _routing(t, e, k, seed, kind="random", dtype=BF16, hidden=16, w_dtype=torch.float32):
    """x [T, H] (last column = token index, so received rows are identifiable), ids [T, K], weights [T, K]."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seed * 100 + rank)
    ids = torch.randn(t, e, generator=g).topk(k).indices
    if kind == "minus_one":
        ids = torch.where(torch.rand(t, k, generator=g) < 0.4, -1, ids)
        ids[0] = -1  # a token without any expert
    elif kind == "to_rank0":  # every token to rank 0's experts: the other ranks receive nothing
        ids = torch.stack([torch.randperm(e // world, generator=g)[:k] for _ in range(t)]) if t else ids
    elif kind == "one_rank":  # all tokens of every rank to the last rank's first expert(s)
        ids = torch.full((t, k), e - e // world)
        ids[:, 1:] = -1
    elif kind == "all_invalid":
        ids = torch.full((t, k), -1)
    x = torch.randn(t, hidden, generator=g)
    x[:, -1] = torch.arange(t) + 64 * rank  # exact in bf16 (< 256)
    return x.to(dtype), ids, torch.rand(t, k, generator=g).to(w_dtype)


def _fake_experts(rx, rids, rw):
    """A row-wise stand-in for the local experts: y = x * (1 + sum of local weights); -1 rows give 0."""
    live = rids >= 0
    scale = 1 + torch.where(live, rw.float(), 0.0).sum(1, keepdim=True)
    return torch.where(live.any(1, keepdim=True), rx.float() * scale, 0.0).to(rx.dtype)


def _exchange(backend, x, ids, w, e, cap, out_dtype=None):
    """``ep_dispatch`` -> fake experts -> ``ep_combine``: (received {row: (ids, weights)}, output)."""
    ops, name = torch.ops.ep_fuse, dist.group.WORLD.group_name
    rx, rids, rw, hd = ops.ep_dispatch(x, ids, w, e, name, backend, "rank", cap, TIMEOUT_S)
    world = dist.get_world_size()
    rows = world * (cap or ids.shape[0])
    assert rx.shape == (rows, x.shape[1]) and rids.shape == (rows, ids.shape[1]) and rw.shape == rids.shape
    assert rids.dtype == torch.int64 and rw.dtype == w.dtype and rx.dtype == x.dtype
    live = rids >= 0
    assert not rw[~live].any(), "non-local slots and padding rows carry weight 0"
    received = {}
    for i in live.any(1).nonzero().flatten().tolist():
        key = tuple(rx[i].float().tolist())
        assert key not in received, "a (token, rank) pair arrives once"
        received[key] = (rids[i].tolist(), rw[i].tolist())
    y = _fake_experts(rx, rids, rw)
    if out_dtype is not None:
        y = y.to(out_dtype)
    out = ops.ep_combine(y, hd, ids, w, e, name, backend, "rank", cap, TIMEOUT_S, None)
    return received, out


def _same_as_reference(x, ids, w, e, cap, exact=True, out_dtype=None):
    ref_recv, ref_out = _exchange("all_to_all", x, ids, w, e, cap, out_dtype)
    got_recv, got_out = _exchange("symm_mem", x, ids, w, e, cap, out_dtype)
    assert got_recv == ref_recv, "symm_mem received other rows / ids / weights than all_to_all"
    assert got_out.dtype == ref_out.dtype and got_out.shape == ref_out.shape
    if exact:
        assert torch.equal(got_out, ref_out), (got_out.float() - ref_out.float()).abs().max()
    else:  # >= 3 summands: fp32 addition order may differ in the last bit
        torch.testing.assert_close(got_out.float(), ref_out.float(), rtol=1e-2, atol=1e-2)


# =========================================================================== scenarios
def sc_double_contract(world):
    """The double against the documented contract (the checks of upstream ``test_nvshmem.py``)."""
    with _double() as dbl:
        rt = _rt()
        symm, name, rank = rt.symm, dist.group.WORLD.group_name, dist.get_rank()
        with pytest.raises(dbl.SymmMemError, match="set_backend"):
            symm.empty(4, dtype=torch.int64)
        symm.set_backend("NVSHMEM")
        symm.enable_symm_mem_for_group(name)
        ne, k = 3, 5
        g = torch.Generator().manual_seed(rank)
        splits = torch.randint(0, k, (world * ne,), generator=g)
        splits[0] = 0  # empty chunks: expert 0 from this rank
        inp = symm.empty(k * world * ne, 4, dtype=torch.float32)
        inp.copy_(torch.arange(inp.numel(), dtype=torch.float32).view_as(inp) + 10000 * rank)
        in_splits = symm.empty(world * ne, dtype=torch.int64).copy_(splits)
        for align in (1, 8):
            out = symm.empty(k * world * ne * world + ne * align, 4, dtype=torch.float32).fill_(-1)
            so = symm.empty(2, world * ne, dtype=torch.int64)
            rt.ops.all_to_all_vdev_2d(inp, out, in_splits, so, name, major_align=align)
            allsp = [torch.zeros_like(splits) for _ in range(world)]
            dist.all_gather(allsp, splits)
            got = torch.stack(allsp).view(world, world, ne)[:, rank]  # [src, e]
            assert torch.equal(so[0], got.t().reshape(-1)), "output splits: expert-major [e * W + s]"
            start = 0
            for e in range(ne):
                length = int(got[:, e].sum())
                exp = start + torch.cat([torch.zeros(1, dtype=torch.int64), got[:, e].cumsum(0)[:-1]])
                assert torch.equal(so[1].view(ne, world)[e], exp), "offsets: exclusive, per aligned expert block"
                start += max(-(-length // align) * align, align)
            for s in range(world):  # chunk (e, s) = source s's rows for expert e (packed rank-major at s)
                src_splits = allsp[s]
                src_off = torch.cumsum(src_splits, 0) - src_splits
                for e in range(ne):
                    n, o = int(got[s, e]), int(so[1].view(ne, world)[e, s])
                    first = int(src_off[rank * ne + e]) * 4 + 10000 * s
                    want = torch.arange(first, first + 4 * n, dtype=torch.float32).view(n, 4)
                    assert torch.equal(out[o:o + n], want)
        # the reverse: chunks at padded offsets (gaps not sent) come back rank-major, packed
        iso = symm.empty(2, world * ne, dtype=torch.int64)
        sp = splits.view(world, ne).t().reshape(-1)  # expert-major [e * W + p]
        iso[0].copy_(sp)
        iso[1].copy_(torch.arange(world * ne) * k)
        back = symm.empty(k * world * ne * world, 4, dtype=torch.float32).fill_(-1)
        oso = symm.empty(2, world * ne, dtype=torch.int64)
        rt.ops.all_to_all_vdev_2d_offset(inp, back, iso, oso, name)
        allsp = [torch.zeros_like(sp) for _ in range(world)]
        dist.all_gather(allsp, sp)
        got = torch.stack([a.view(ne, world)[:, rank] for a in allsp])  # [src, e]
        flat = got.reshape(-1)
        assert torch.equal(oso[0], flat) and torch.equal(oso[1], flat.cumsum(0) - flat), "rank-major, packed"
        row = 0
        for s in range(world):
            for e in range(ne):
                n, first = int(got[s, e]), (e * world + rank) * k * 4 + 10000 * s
                want = torch.arange(first, first + 4 * n, dtype=torch.float32).view(n, 4)
                assert torch.equal(back[row:row + n], want), "chunk (source s, expert e)"
                row += n
        # errors (raised identically on every rank, before any data moves)
        plain = torch.zeros(4, dtype=torch.int64)
        with pytest.raises(dbl.SymmMemError, match="not allocated by symmetric memory"):
            rt.ops.all_to_all_vdev_2d(inp, out, plain, so, name)
        with pytest.raises(dbl.SymmMemError, match="major_align must be positive"):
            rt.ops.all_to_all_vdev_2d(inp, out, in_splits, so, name, major_align=0)
        big = symm.empty(world * ne, dtype=torch.int64).fill_(10**6)
        with pytest.raises(dbl.SymmMemError, match="larger than input dim"):
            rt.ops.all_to_all_vdev_2d(inp, out, big, so, name)
        with pytest.raises(dbl.SymmMemError, match="Backend can not be changed"):
            symm.set_backend("CUDA")


def sc_roundtrip_vs_reference(world):
    """Direct dispatch/combine: the same received rows (ids rebased, weights) and the same output as
    all_to_all, on edge routings, odd token counts, both modes."""
    e, k = 3 * world, 3
    with _double():
        for kind in ("random", "minus_one", "to_rank0", "one_rank", "all_invalid"):
            for t in (7, 1):
                x, ids, w = _routing(t, e, k, seed=len(kind) + t, kind=kind)
                for cap in (0, 9):
                    _same_as_reference(x, ids, w, e, cap, exact=world == 2)
        # capacity mode with unequal batches (one rank may even have none)
        for t in (0, 5 - dist.get_rank() % 2 * 3):
            x, ids, w = _routing(t, e, k, seed=9)
            _same_as_reference(x, ids, w, e, 5, exact=world == 2)
        # other dtypes: fp32 tokens with bf16 weights; fp32 block output (combine regrows the buffers)
        x, ids, w = _routing(5, e, k, seed=3, dtype=torch.float32, w_dtype=BF16)
        _same_as_reference(x, ids, w, e, 0, exact=world == 2)
        x, ids, w = _routing(6, e, 2, seed=4, kind="minus_one")
        _same_as_reference(x, ids, w, e, 6, exact=world == 2, out_dtype=torch.float32)


def sc_buffers_and_order(world):
    """Buffers allocated once and reused; grown collectively; two dispatches (or combines) in a row
    (parallel MoE branches) stay correct; destroy_buffers releases them; nothing left in the registry."""
    from ep_fuse.ep import handles, symm_mem

    e, name, ops = 2 * world, dist.group.WORLD.group_name, torch.ops.ep_fuse
    with _double():
        symm = _rt().symm
        x, ids, w = _routing(8, e, 2, seed=1, kind="minus_one")
        _same_as_reference(x, ids, w, e, 8, exact=world == 2)
        first = symm.allocated
        assert first == 6, "send + receive + four split tensors"
        for _ in range(2):
            _same_as_reference(x, ids, w, e, 8, exact=world == 2)
        assert symm.allocated == first, "buffers are reused"
        big = _routing(64, e, 2, seed=2, hidden=4096)  # > 1 MiB (the allocation grain)
        _same_as_reference(*big, e, 0, exact=world == 2)
        assert symm.allocated == first + 2, "grown once (send + receive)"
        # parallel branches: dispatch A, dispatch B, combine A, combine B
        xa, ida, wa = _routing(8, e, 2, seed=5)
        xb, idb, wb = _routing(8, e, 2, seed=6, kind="minus_one")
        da = ops.ep_dispatch(xa, ida, wa, e, name, "symm_mem", "rank", 8, TIMEOUT_S)
        db = ops.ep_dispatch(xb, idb, wb, e, name, "symm_mem", "rank", 8, TIMEOUT_S)
        oa = ops.ep_combine(_fake_experts(*da[:3]), da[3], ida, wa, e, name, "symm_mem", "rank", 8, TIMEOUT_S, None)
        ob = ops.ep_combine(_fake_experts(*db[:3]), db[3], idb, wb, e, name, "symm_mem", "rank", 8, TIMEOUT_S, None)
        assert torch.equal(oa, _exchange("all_to_all", xa, ida, wa, e, 8)[1])
        assert torch.equal(ob, _exchange("all_to_all", xb, idb, wb, e, 8)[1])
        symm_mem.destroy_buffers()
        assert not symm_mem._BUFFERS
        _same_as_reference(x, ids, w, e, 8, exact=world == 2)
        assert symm.allocated == first + 2 + 6, "allocated again after destroy_buffers"
        assert handles.pending() == 0


def sc_opcheck(world):
    with _double():
        x, ids, w = _routing(6, 2 * world, 2, seed=0, kind="minus_one")
        args = (x, ids, w, 2 * world, dist.group.WORLD.group_name, "symm_mem", "rank", 6, TIMEOUT_S)
        torch.library.opcheck(torch.ops.ep_fuse.ep_dispatch.default, args,
                              test_utils=("test_schema", "test_faketensor"))


def sc_blocks(world):
    """The canonical block compiled with ep_engine='symm_mem' equals the full single-process block."""
    import test_ep

    with _double():
        test_ep._block_case(world, backend="symm_mem")  # data-dependent sizes
        if world > 2:
            return
        torch._dynamo.reset()
        test_ep._block_case(world, backend="symm_mem", capacity=12, out_dtype=None, invalid=0.3, seed_extra=1)
        torch._dynamo.reset()
        test_ep._block_case(world, backend="symm_mem", t=5, k=3, e_per_rank=3, seed_extra=2)  # odd sizes


def sc_hf_mixtral(world):
    import test_ep

    with _double():
        test_ep._hf_case("mixtral", BF16, backend="symm_mem")


def sc_selection(world):
    """auto never picks symm_mem (measured slower than all_to_all); an explicit request without the ops is
    one compile-time error; a block over the NVSHMEM heap falls back to all_to_all with the reason."""
    import test_ep

    from ep_fuse.ep import deepep, symm_mem

    sys.modules.pop("deep_ep", None)
    deepep.available.cache_clear()
    symm_mem.available.cache_clear()
    model = ep_fuse.shard_experts(test_ep.CanonicalBlock(2 * world))
    x, ids, w = test_ep._routing(6, 2 * world, 2, seed=0)
    with pytest.raises(Exception, match="ep_engine='symm_mem' but CUDA is not available"), torch.no_grad():
        test_ep._compile(model, **ep_fuse.ep_options(model, engine="symm_mem"))(x, ids, w)
    torch._dynamo.reset()
    test_ep._block_case(world, backend="auto", expect_backend="all_to_all")  # CPU, no double: the reference
    with _double():
        torch._dynamo.reset()
        site = test_ep._block_case(world, backend="auto", expect_backend="all_to_all", seed_extra=1)
        assert site.requested == "auto" and not site.declined
        torch._dynamo.reset()
        site = test_ep._block_case(world, backend="symm_mem", expect_backend="symm_mem", seed_extra=1)
        assert site.layout == "rank"
        old = os.environ.get("NVSHMEM_SYMMETRIC_SIZE")
        os.environ["NVSHMEM_SYMMETRIC_SIZE"] = "2K"
        try:
            torch._dynamo.reset()
            site = test_ep._block_case(world, backend="symm_mem", expect_backend="all_to_all", seed_extra=2)
            assert site.declined[0][0] == "symm_mem" and "NVSHMEM_SYMMETRIC_SIZE" in site.declined[0][1]
        finally:
            if old is None:
                os.environ.pop("NVSHMEM_SYMMETRIC_SIZE")
            else:
                os.environ["NVSHMEM_SYMMETRIC_SIZE"] = old


def sc_property(world):
    """Hypothesis over routings (both ranks draw the same examples: derandomized, no shrinking)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    rank = dist.get_rank()

    @settings(max_examples=12, derandomize=True, deadline=None, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck), database=None)
    @given(t=st.integers(1, 9), per_rank=st.integers(1, 3), k=st.integers(1, 3), p_invalid=st.sampled_from([0, .3]),
           cap_extra=st.sampled_from([None, 0, 2]), seed=st.integers(0, 2**16))
    def check(t, per_rank, k, p_invalid, cap_extra, seed):
        e = per_rank * world
        k = min(k, e)
        g = torch.Generator().manual_seed(seed + 7919 * rank)
        ids = torch.rand(t, e, generator=g).topk(k).indices
        ids = torch.where(torch.rand(t, k, generator=g) < p_invalid, -1, ids)
        x = torch.randn(t, 8, generator=g).to(BF16)
        x[:, -1] = torch.arange(t) + 100 * rank
        w = torch.rand(t, k, generator=g)
        cap = 0 if cap_extra is None else t + cap_extra
        _same_as_reference(x, ids, w, e, cap, exact=world == 2)

    with _double():
        check()


SCENARIOS_2 = [sc_double_contract, sc_roundtrip_vs_reference, sc_buffers_and_order, sc_opcheck, sc_blocks,
               sc_hf_mixtral, sc_selection, sc_property]
SCENARIOS_4 = [sc_roundtrip_vs_reference, sc_blocks]


@pytest.fixture(scope="module")
def symm2():
    import test_ep

    return test_ep.run_ranks(2, SCENARIOS_2, timeout_s=300.0)


@pytest.fixture(scope="module")
def symm4():
    import test_ep

    return test_ep.run_ranks(4, SCENARIOS_4, timeout_s=300.0)


def _check(results, name):
    for rank, res in enumerate(results):
        assert name in res, f"rank {rank} never finished {name} (hang or crash): {sorted(res)}"
        assert res[name] == "ok", f"rank {rank}:\n{res[name]}"


@pytest.mark.parametrize("name", [f.__name__ for f in SCENARIOS_2])
def test_two_ranks(symm2, name):
    _check(symm2, name)


@pytest.mark.parametrize("name", [f.__name__ for f in SCENARIOS_4])
def test_four_ranks(symm4, name):
    _check(symm4, name)


# =========================================================================== single process
def test_backend_option():
    assert EpFuseConfig.from_options({"ep": True, "ep_engine": "symm_mem"}).ep_engine == "symm_mem"
    # ep_backend: the option's first name, an alias
    assert EpFuseConfig.from_options({"ep_backend": "symm_mem"}) == EpFuseConfig(ep_engine="symm_mem")
    assert EpFuseConfig(ep_engine="npu").ep_backend == "npu"


def test_unavailable_without_cuda_and_guards():
    from ep_fuse.ep import symm_mem
    from ep_fuse.ops.ep_layout import handle_len, symm_mem_chunks

    symm_mem.available.cache_clear()
    assert "CUDA is not available" in symm_mem.available()
    x, ids = torch.zeros(4, 16), torch.zeros(4, 2, dtype=torch.int64)
    assert "cpu" in symm_mem.supports(x, ids, torch.float32, 2, 0)
    assert [symm_mem_chunks(w) for w in (2, 4, 8, 16)] == [16, 16, 8, 1]
    assert handle_len("rank", 2, 4, 5, 2, 0, "symm_mem") == 3 + 4 + 10 + 2 * 16  # the rank layout + splits
    assert handle_len("rank", 2, 4, 5, 2, 0) == 3 + 4 + 10


def test_auto_on_cuda_without_runtimes_keeps_the_reference():
    """No DeepEP, no CUDA: auto on a CUDA block declines both with their reasons (compile time, no group)."""
    import sys

    from ep_fuse.ep import deepep, symm_mem
    from ep_fuse.passes.ep import choose_engine

    sys.modules.pop("deep_ep", None)
    deepep.available.cache_clear()
    symm_mem.available.cache_clear()
    x, ids = torch.zeros(4, 16, dtype=BF16), torch.zeros(4, 2, dtype=torch.int64)
    backend, layout, declined = choose_engine("auto", "cuda", x, ids, BF16, 2, 4, 0)
    assert (backend, layout) == ("all_to_all", "rank")
    assert [d[0] for d in declined] == ["deepep"] and "deep_ep" in declined[0][1]  # 2 ranks, data-dependent
    backend, _, declined = choose_engine("auto", "cuda", x, ids, BF16, 2, 4, 8)
    assert backend == "all_to_all" and not declined, "2 ranks with a capacity: measured fastest"
    backend, _, declined = choose_engine("auto", "cuda", x, ids, BF16, 4, 4, 8)
    assert backend == "all_to_all" and [d[0] for d in declined] == ["deepep_low_latency", "deepep"]


def test_supports_and_heap(monkeypatch):
    from support import symm_mem_double

    from ep_fuse.ep import symm_mem

    with symm_mem.use_runtime(symm_mem_double.runtime()):
        x, ids = torch.zeros(8, 64, dtype=BF16), torch.zeros(8, 2, dtype=torch.int64)
        assert symm_mem.supports(x, ids, BF16, 2, 0) is None
        assert "2..8 ranks" in symm_mem.supports(x, ids, BF16, 16, 0)
        assert "empty batch" in symm_mem.supports(x[:0], ids[:0], BF16, 2, 0)
        monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", "2G")
        assert symm_mem.heap_bytes() == 2 << 30
        monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", "1000")
        assert symm_mem.heap_bytes() == 1000 and "NVSHMEM_SYMMETRIC_SIZE" in symm_mem.supports(x, ids, BF16, 2, 0)

"""Triton kernels of the ``all_to_all`` EP engine's rank layout (interpreter) vs the torch reference.

Single process: W ranks simulated (the collectives are block copies), every local half (pack, unpack,
combine) of the kernels compared with the reference -- same handle, same metadata bytes, same token
rows, bitwise the same combine. Two gloo processes: the provider ops with the kernels active equal the
reference, ranks mixing the two paths interoperate, and the data-dependent combine reuses dispatch's
splits.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ep_fuse import runtime
from ep_fuse.config import EpFuseConfig
from ep_fuse.ep import a2a_kernels
from ep_fuse.ep import all_to_all as a2a
from ep_fuse.ops.ep_layout import HEADER, packed_row

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
TINY = a2a_kernels.A2aConfig(block_t=4, block_bytes=16, pad_rows=4, unpack_rows=4)
"""Several routing blocks, row chunks, padding and unpack programs even for a handful of tokens."""


def _routing(t, k, world, per_rank, mode, seed, x_dtype, w_dtype, h):
    g = torch.Generator().manual_seed(seed)
    e = world * per_rank
    ids = torch.randint(0, e, (t, k), generator=g)  # duplicates in a row included
    if mode == "invalid":  # -1 slots and ids of no rank (>= E)
        bad = torch.where(torch.rand(t, k, generator=g) < 0.5, -1, e + torch.randint(0, 3, (t, k), generator=g))
        ids = torch.where(torch.rand(t, k, generator=g) < 0.4, bad, ids)
    elif mode == "one_rank":  # every token on rank 1: the others receive nothing
        ids = per_rank + torch.randint(0, per_rank, (t, k), generator=g)
    elif mode == "empty":
        ids = torch.full((t, k), -1)
    x = torch.randn(t, h, generator=g).to(x_dtype)
    w = torch.rand(t, k, generator=g).to(w_dtype)
    return x, ids, w


def simulate(inputs, num_experts, world, capacity, kernels, cfg=None):
    """Dispatch, identity-ish experts (rank r scales by r+1), combine on ``world`` simulated ranks."""
    if kernels:
        pack = lambda *a: a2a.pack_rank(*a, cfg=cfg)  # noqa: E731
        unpack = lambda *a: a2a.unpack_rank(*a, cfg=cfg)  # noqa: E731
        comb = lambda *a: a2a.combine_rank(*a, cfg=cfg)  # noqa: E731
    else:
        pack, unpack, comb = a2a.pack_rank_reference, a2a.unpack_rank_reference, a2a.combine_rank_reference
    x0, ids0, w0 = inputs[0]
    t, h = x0.shape
    k = ids0.shape[1]
    hp, _ = packed_row(h, x0.dtype, k, w0.dtype)
    packs = [pack(x, ids, w, num_experts, world, capacity) for x, ids, w in inputs]
    if capacity:
        split = [[capacity] * world for _ in range(world)]
    else:
        split = [p[1][HEADER:HEADER + world].tolist() for p in packs]  # split[s][r]: rows s sends r
    for r, (_, handle) in enumerate(packs):
        handle[HEADER + world:HEADER + 2 * world] = torch.tensor([split[s][r] for s in range(world)])
    rows = world * (capacity or t)
    received = []
    for r in range(world):
        chunks = [packs[s][0][sum(split[s][:r]):sum(split[s][:r + 1])] for s in range(world)]
        recv = torch.full((rows, hp), float("nan")).to(x0.dtype)  # poisoned: the tail must be rewritten
        n = sum(c.shape[0] for c in chunks)
        recv[:n] = torch.cat(chunks)
        received.append(unpack(recv, n, h, k, w0.dtype, packs[r][1], capacity == 0))
    ys = [(u[0].float() * (r + 1)).to(x0.dtype) for r, u in enumerate(received)]
    outs = []
    for s in range(world):
        back = torch.cat([ys[r][sum(split[q][r] for q in range(s)):][:split[s][r]] for r in range(world)])
        outs.append(comb(back, packs[s][1], t, world, x0.dtype))
    return packs, received, outs, split


def _assert_same(kern, ref, k, capacity, world):
    (pk, uk, ok, split), (pr, ur, orf, _) = kern, ref
    for r in range(world):
        (send_k, hk), (send_r, hr) = pk[r], pr[r]
        assert torch.equal(hk, hr), f"rank {r} handle\n{hk}\n{hr}"
        _, moff = packed_row(uk[r][0].shape[1], send_k.dtype, k, uk[r][2].dtype)
        used = send_k.shape[0] if capacity else sum(split[r])
        mk, mr = send_k.view(torch.int32)[:used], send_r.view(torch.int32)[:used]
        assert torch.equal(mk[:, moff:moff + 2 * k], mr[:, moff:moff + 2 * k]), f"rank {r} metadata"
        real = mr[:, moff:moff + k].max(1).values >= 0  # rows that carry a token
        h = uk[r][0].shape[1]
        xk, xr = send_k[:used][real, :h], send_r[:used][real, :h]
        assert torch.equal(xk.view(torch.uint8), xr.view(torch.uint8)), f"rank {r} token rows"
        (xk, ik, wk), (xr, ir, wr) = uk[r], ur[r]
        assert torch.equal(ik, ir) and torch.equal(wk, wr), f"rank {r} received ids / weights"
        live = ir.max(1).values >= 0 if capacity else slice(None)  # capacity padding rows: x is undefined
        assert torch.equal(xk[live].view(torch.uint8), xr[live].view(torch.uint8)), f"rank {r} received rows"
        assert torch.equal(ok[r].view(torch.uint8), orf[r].view(torch.uint8)), f"rank {r} combine"


@settings(max_examples=40, deadline=None)
@given(world=st.sampled_from([2, 4]), per_rank=st.integers(1, 3), t=st.integers(1, 13), k=st.integers(1, 5),
       h=st.sampled_from([8, 20, 33, 48]), mode=st.sampled_from(["random", "invalid", "one_rank", "empty"]),
       extra=st.sampled_from([None, 0, 3]), x_dtype=st.sampled_from([BF16, FP32, FP16]),
       w_dtype=st.sampled_from([FP32, BF16]), tiny=st.booleans(), seed=st.integers(0, 2**16))
def test_kernels_equal_reference(world, per_rank, t, k, h, mode, extra, x_dtype, w_dtype, tiny, seed):
    e = world * per_rank
    inputs = [_routing(t, k, world, per_rank, mode, seed + r, x_dtype, w_dtype, h) for r in range(world)]
    capacity = 0 if extra is None else t + extra
    kern = simulate(inputs, e, world, capacity, True, TINY if tiny else None)
    ref = simulate(inputs, e, world, capacity, False)
    _assert_same(kern, ref, k, capacity, world)
    # the oracle's own round trip: rank r's copy comes back scaled by r + 1
    for s, (x, ids, _w) in enumerate(inputs):
        valid = (ids >= 0) & (ids < e)
        dest = torch.where(valid, ids // per_rank, world)
        hit = torch.zeros(t, world + 1, dtype=torch.bool).scatter_(1, dest, True)[:, :world]
        expect = torch.zeros(t, h)
        for r in range(world):
            expect += torch.where(hit[:, r:r + 1], (x.float() * (r + 1)).to(x_dtype).float(), 0.0)
        assert torch.equal(ref[2][s], expect.to(x_dtype)), "reference round trip"


@pytest.mark.parametrize("world,per_rank,t,k,capacity,tiny", [
    (8, 2, 5, 1, 11, True),  # W 8, K 1, capacity far above T
    (1, 4, 9, 2, 0, True),  # one rank (a loopback)
    (2, 3, 150, 2, 0, False),  # default tiles: several routing blocks
    (2, 3, 150, 2, 160, False),
])
def test_shapes(world, per_rank, t, k, capacity, tiny):
    inputs = [_routing(t, k, world, per_rank, "invalid", r, BF16, FP32, 16) for r in range(world)]
    kern = simulate(inputs, world * per_rank, world, capacity, True, TINY if tiny else None)
    ref = simulate(inputs, world * per_rank, world, capacity, False)
    _assert_same(kern, ref, k, capacity, world)


def test_splits_are_reused():
    """The data-dependent combine takes dispatch's host splits for the same handle (no second read)."""
    handle = torch.full((HEADER + 4 + 6,), 99, dtype=torch.int64)
    a2a._remember_splits(handle, [1, 2], [3, 0])
    assert a2a._splits(handle, 2) == ([1, 2], [3, 0])
    assert a2a._splits(handle[:], 2) == ([1, 2], [3, 0]), "a view of the same storage"
    other = handle.clone()
    assert a2a._splits(other, 2) == ([99, 99], [99, 99]), "unknown handle: read from the tensor"


def test_fake_matches_the_packed_view():
    from ep_fuse.ops.ep_layout import weight_words

    hp, moff = packed_row(7168, BF16, 8, FP32)
    assert (hp, moff) == (7200, 3584) and hp % 16 == 0 and weight_words(FP32) == 1
    hp, moff = packed_row(33, FP32, 3, BF16)
    assert hp * 4 % 64 == 0 and moff * 4 >= 33 * 4 and (moff + 6) * 4 <= hp * 4


# --------------------------------------------------------------------------- two gloo processes
TIMEOUT_S = 60.0


def _gloo_checks(rank: int, world: int) -> None:
    import torch.distributed as dist

    import ep_fuse.catalog  # noqa: F401  (defines every op and provider)

    name = dist.group.WORLD.group_name
    ops = torch.ops.ep_fuse
    per_rank, t, k, h = 3, 11, 3, 36
    e = per_rank * world
    for mode, capacity, x_dtype, w_dtype in (("invalid", 0, BF16, FP32), ("random", 13, FP32, BF16),
                                             ("one_rank", 0, FP16, FP32), ("one_rank", 11, BF16, FP32)):
        x, ids, w = _routing(t, k, world, per_rank, mode, 10 + rank, x_dtype, w_dtype, h)
        assert a2a._dispatch_kernels(x, ids, w, world), "the interpreter runs the kernels here"
        runs = []
        for use in (True, False, rank == 0):  # kernels, reference, then rank 0 kernels + rank 1 reference
            with runtime.use_config(EpFuseConfig(ep_a2a_kernels=use)):
                rx, rids, rw, hd = ops.ep_dispatch(x, ids, w, e, name, "all_to_all", "rank", capacity, TIMEOUT_S)
                y = (rx.float() * 2).to(x_dtype)
                out = ops.ep_combine(y, hd, ids, w, e, name, "all_to_all", "rank", capacity, TIMEOUT_S, None)
            hp, _ = packed_row(h, x_dtype, k, w_dtype)
            assert rx.stride() == (hp, 1), "recv_x is the packed buffer's view"
            live = rids.max(1).values >= 0
            runs.append((rx[live], rids, rw, hd, out))
        for got in runs[1:]:
            for a, b in zip(runs[0], got):
                assert torch.equal(a.view(torch.uint8) if a.is_floating_point() else a,
                                   b.view(torch.uint8) if b.is_floating_point() else b), (mode, capacity)
        # identity experts times two: combine = 2 x * #ranks(t)
        valid = (ids >= 0) & (ids < e)
        dest = torch.where(valid, ids // per_rank, world)
        n_ranks = torch.zeros(t, world + 1).scatter_(1, dest, 1.0)[:, :world].sum(1, keepdim=True)
        assert torch.equal(runs[0][4].float(), (x.float() * 2 * n_ranks).to(x_dtype).float())


def sc_gloo_checks(world: int) -> None:
    import torch.distributed as dist

    _gloo_checks(dist.get_rank(), world)


def test_gloo_provider_kernels_equal_reference():
    from support.dist_harness import check, run_ranks

    assert os.environ.get("TRITON_INTERPRET") == "1", "conftest sets the interpreter for the workers"
    check(run_ranks(__name__, ["sc_gloo_checks"], world=2, timeout_s=240.0), "sc_gloo_checks")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))

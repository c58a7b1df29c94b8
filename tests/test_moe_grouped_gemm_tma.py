"""Hopper TMA grouped GEMM (persistent, device-built tile table) under the Triton interpreter.

The interpreter runs tensor descriptors (device-side ``tl.make_tensor_descriptor`` and host-side
``TensorDescriptor``) with TMA's bounds and alignment rules, so the descriptor paths run here as well as
the pointer path; what it cannot show is GPU behaviour (``tests/gpu/test_gpu_moe_grouped_gemm_tma.py``).
"""

import dataclasses
import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_moe_grouped_gemm import assert_matches, case, loop_ref

import ep_fuse.providers  # noqa: F401  (registers torch.ops.ep_fuse_triton.*)
from ep_fuse.providers.triton import grouped_gemm as host
from ep_fuse.providers.triton import grouped_gemm as triton_grouped_gemm
from ep_fuse.providers.triton import moe as triton_moe
from ep_fuse.providers.triton.unverified import ENV

tk = importlib.import_module("ep_fuse.providers.triton.grouped_gemm_tma_kernel")
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
DESCS = sorted(tk.DESC_MODES)


def cfg_for(swiglu, desc="device", **kw):
    return dataclasses.replace(tk.config_for(10**6, 1, 1, 1, swiglu=swiglu, interpret=True), desc=desc, **kw)


def run(x, w, seg, swiglu, cfg):
    """The TMA launch into a NaN-filled output (unwritten rows stay NaN)."""
    n = w.shape[1] // 2 if swiglu else w.shape[1]
    y = torch.full((x.shape[0], n), float("nan"), dtype=x.dtype)
    (tk.launch_grouped_gemm_swiglu_tma if swiglu else tk.launch_grouped_gemm_tma)(x, w, seg, y, config=cfg)
    return y


def table_ref(counts, tail, bm):
    """The tile table of the module docstring, built on the host."""
    entries, lo = [], 0
    for e, c in enumerate(counts):
        entries += [(e, s, min(s + bm, lo + c)) for s in range(lo, lo + c, bm)]
        lo += c
    entries += [(-1, s, min(s + bm, lo + tail)) for s in range(lo, lo + tail, bm)]
    return entries


@settings(max_examples=25, deadline=None)
@given(counts=st.lists(st.sampled_from([0, 0, 0, 1, 5, 16, 31, 32, 33, 100]), min_size=1, max_size=300),
       tail=st.sampled_from([0, 1, 17, 64]), bm=st.sampled_from([16, 32, 128]), idx64=st.booleans())
def test_tile_table_matches_the_host_walk(counts, tail, bm, idx64):
    """Across expert chunks (128) and tile blocks (64): every expert's tiles in order, then the tail's."""
    seg = torch.tensor([0, *counts], dtype=torch.int64 if idx64 else torch.int32).cumsum(0)
    m = sum(counts) + tail
    table = tk.build_tile_table(seg, m, len(counts), bm)
    expect = table_ref(counts, tail, bm)
    assert table.shape[0] == tk.TABLE_HEADER + 4 * tk.max_tiles(m, len(counts), bm)
    assert int(table[0]) == len(expect)
    assert int(table[1]) == sum(1 for t in expect if t[0] >= 0), "the experts' tiles, listed before the tail's"
    got = table[tk.TABLE_HEADER:].view(-1, 4)[:len(expect), :3]
    assert got.tolist() == [list(t) for t in expect]


ROUTINGS = {"one_expert_all_rows": ([0, 0, 150, 0], 0), "ragged_zero_rows_tail": ([0, 70, 0, 5, 33], 9),
            "all_tail": ([0, 0, 0], 6), "many_experts": ([0] * 60 + [40, 0, 3] + [0] * 70 + [65], 3)}


WALKS = {"bm_tiles": {}, "expert_groups_small_last_tiles": {"small_bm": 16, "expert_groups": True},
         "flattened": {"flatten": True}}


@pytest.mark.parametrize("walk", sorted(WALKS))
@pytest.mark.parametrize("desc", DESCS)
@pytest.mark.parametrize("routing", sorted(ROUTINGS))
@pytest.mark.parametrize("swiglu", [False, True], ids=["gemm", "swiglu"])
def test_edge_routings(routing, desc, swiglu, walk):
    """Rows not a multiple of the 32-row tile, K = 40 not a multiple of BK = 16 (TMA zero fill); with
    ``small_bm`` the last tiles of at most 16 rows (5, 6 and 1 rows here, and the short tails) run swapped, in
    groups cut at expert boundaries; ``flatten`` walks the experts' tiles, then stores the tail's zeros in a loop
    of its own (the interpreter runs both loops as written)."""
    counts, tail = ROUTINGS[routing]
    x, w, seg = case(counts, tail, 18, 40, BF16)
    cfg = cfg_for(swiglu, desc, **WALKS[walk])
    assert_matches(run(x, w, seg, swiglu, cfg), loop_ref(x, w, seg, swiglu), seg, BF16)


@settings(max_examples=20, deadline=None)
@given(counts=st.lists(st.sampled_from([0, 0, 1, 16, 33, 80]), min_size=1, max_size=6),
       tail=st.sampled_from([0, 0, 5, 40]), n=st.sampled_from([8, 13, 40]), k=st.sampled_from([8, 24, 64]),
       dtype=st.sampled_from([BF16, F16]), swiglu=st.booleans(), desc=st.sampled_from(DESCS),
       programs=st.sampled_from([0, 1, 7]), group_m=st.sampled_from([1, 2, 8]), small_bm=st.sampled_from([0, 16]),
       expert_groups=st.booleans(), flatten=st.booleans(), seed=st.integers(0, 2**16))
def test_kernel_matches_expert_loop(counts, tail, n, k, dtype, swiglu, desc, programs, group_m, small_bm,
                                    expert_groups, flatten, seed):
    if swiglu and n % 2:
        n += 1
    x, w, seg = case(counts, tail, n, k, dtype, seed)
    if x.shape[0] == 0:
        return
    cfg = cfg_for(swiglu, desc, programs=programs, group_m=group_m, small_bm=small_bm, expert_groups=expert_groups,
                  flatten=flatten)  # the interpreter runs the loops as written: flatten reaches the launch only
    assert_matches(run(x, w, seg, swiglu, cfg), loop_ref(x, w, seg, swiglu), seg, dtype)


def test_provider_takes_the_tma_kernel_at_prefill_rows_only(monkeypatch):
    calls = []
    for name in ("launch_grouped_gemm_tma", "launch_grouped_gemm_swiglu_tma"):
        real = getattr(tk, name)
        monkeypatch.setattr(tk, name, lambda *a, _real=real, _name=name, **kw: (calls.append(_name), _real(*a, **kw)))
    rows = triton_grouped_gemm.GROUPED_GEMM_TMA_MIN_ROWS_PER_EXPERT
    x, w, seg = case([rows + 9, rows - 20, rows + 30], 5, 16, 32, BF16)  # mean >= the threshold
    assert host.kernel_variant(x, w) == "tma"
    assert_matches(host.grouped_gemm_kernel(x, w, seg), loop_ref(x, w, seg), seg, BF16)
    assert_matches(host.grouped_gemm_swiglu_kernel(x, w, seg), loop_ref(x, w, seg, True), seg, BF16)
    assert calls == ["launch_grouped_gemm_tma", "launch_grouped_gemm_swiglu_tma"]
    calls.clear()
    small = case([rows // 2, 0, rows // 2], 0, 16, 32, BF16)
    assert host.kernel_variant(small[0], small[1]) == "default"
    assert_matches(host.grouped_gemm_kernel(*small), loop_ref(*small), small[2], BF16)
    assert calls == []
    assert "rows per expert" in host.tma_declined(small[0], small[1])


def test_tma_declines_what_it_cannot_address():
    x, w, seg = case([100, 100], 0, 16, 32, BF16)
    assert tk.tma_unsupported(x, w) is None
    assert "bf16/fp16" in tk.tma_unsupported(x.float(), w.float())
    x36, w36, _ = case([100, 100], 0, 16, 36, BF16)  # 72-byte rows
    assert "16 bytes" in tk.tma_unsupported(x36, w36)
    assert "one [E * rows, K]" in tk.tma_unsupported(x, w[:, :8])
    assert "contiguous along K" in tk.tma_unsupported(x, w.transpose(1, 2).contiguous().transpose(1, 2))
    shifted = torch.empty(x.numel() + 1, dtype=BF16)[1:].view_as(x)
    assert "16-byte aligned" in tk.tma_unsupported(shifted, w)
    assert "16-byte aligned" in tk.tma_unsupported(shifted, w, traced=True)  # storage offset 1 element
    assert "meta tensors" in tk.tma_unsupported(x.to("meta"), w.to("meta"))
    assert host.kernel_variant(x.float(), w.float()) == "default"


def test_cleared_on_cuda_and_taken_by_size(monkeypatch):
    """Cleared for CUDA (GPU check passed, measured faster than torch._grouped_mm on H200): on CUDA tensors
    the size rule is what declines it."""
    from types import SimpleNamespace

    from ep_fuse.providers.triton.unverified import gpu_unverified

    monkeypatch.delenv(ENV, raising=False)
    x = SimpleNamespace(shape=(4096, 64), device=torch.device("cuda"))
    assert gpu_unverified(host.TMA_VARIANT, x) is None
    w = SimpleNamespace(shape=(128, 32, 64))  # 32 rows per expert
    assert "rows per expert < 64" in host.tma_declined(x, w)


@pytest.mark.parametrize("columns, swiglu, takes", [
    ((2048, 7168), True, True), ((7168, 2048), False, True),     # DeepSeek-V3: measured 1.07-1.30x
    ((768, 2048), True, True), ((2048, 768), False, True),       # Qwen3-30B-A3B
    ((14336, 4096), True, True), ((4096, 14336), False, True),   # Mixtral (E8: 128-wide gate|up tiles)
    ((1408, 2880), True, False), ((2880, 1408), False, False),   # E60 H2880 I1408: measured 0.92-0.96x
])
def test_tma_rule_takes_only_shapes_whose_columns_fill_its_tiles(columns, swiglu, takes):
    """On CUDA from 64 rows per expert the TMA kernel takes a GEMM only where its output columns are a
    multiple of the config's column tile: where they are not (1408 and 2880 on 256-wide tiles) H200 measured
    it slower than ``torch._grouped_mm`` at every swept config, and the default kernel slower above 128 rows
    per expert, so such calls keep Inductor's code there."""
    from types import SimpleNamespace

    n, k = columns
    e = 8 if n in (14336, 4096) and k in (4096, 14336) else 64
    x = SimpleNamespace(shape=(256 * e, k), device=torch.device("cuda"))  # 256 rows per expert
    w = SimpleNamespace(shape=(e, 2 * n if swiglu else n, k))
    reason = triton_grouped_gemm.grouped_gemm_tma_rule(x, w, swiglu)
    assert (reason is None) == takes, reason
    if not takes:
        assert "column tiles" in reason
        assert "does not take" in triton_moe._grouped_prefers((x, w), "inductor", swiglu)
    cpu = SimpleNamespace(shape=x.shape, device=torch.device("cpu"))  # the interpreter keeps its own tiles
    assert triton_grouped_gemm.grouped_gemm_tma_rule(cpu, w, swiglu) is None


@pytest.mark.parametrize("i,h,e,walk", [(2048, 7168, 256, True), (768, 2048, 128, False), (14336, 4096, 8, False),
                                        (1408, 2880, 60, False)])
def test_expert_groups_where_an_experts_weights_outgrow_l2(i, h, e, walk):
    """The measured rule: DeepSeek-V3's gate|up (58.7 MB per expert) walks expert groups with swapped 32-row
    last tiles; Qwen3-30B-A3B (6.3 MB), Mixtral (few experts) and the down GEMMs keep the plain walk. The down
    GEMM flattens its K loop into the walk where there are more than 16 experts; gate|up never does."""
    up = tk.config_for(4096 * 8, i, h, e, swiglu=True, interpret=False)
    down = tk.config_for(4096 * 8, h, i, e, interpret=False)
    assert (up.expert_groups, up.small_bm) == ((True, 32) if walk else (False, 0))
    assert not down.expert_groups and not down.small_bm
    assert not up.flatten and down.flatten == (e > 16)


def test_few_large_experts_take_many_expert_tiles_at_few_rows():
    """Few large experts (Mixtral-8x7B-sized): below 256 rows per expert gate|up + SwiGLU runs the many-experts
    64 x 256 tiles (with expert groups: 235 MB of gate|up weights per expert), from there 128 x 128; a symbolic row
    count, columns the 256-wide tiles do not fill, the down GEMM and the dense GEMM + SwiGLU keep their configs."""
    few = tk.TmaGemmConfig(128, 128, 64, 8, 3, 8)
    many = tk.config_for(128 * 8, 14336, 4096, 8, swiglu=True, interpret=False)
    assert (many.bm, many.bn, many.expert_groups, many.small_bm) == (64, 256, True, 32)
    assert tk.config_for(256 * 8, 14336, 4096, 8, swiglu=True, interpret=False) == few
    assert tk.config_for(128 * 8, 1408, 4096, 8, swiglu=True, interpret=False) == few  # 1408 % 256 != 0
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    rows = ShapeEnv().create_unbacked_symint()
    assert tk.config_for(rows, 14336, 4096, 8, swiglu=True, interpret=False) == few
    down = tk.config_for(128 * 8, 4096, 14336, 8, interpret=False)
    assert down == tk.config_for(4096 * 8, 4096, 14336, 8, interpret=False) and down.group_m == 16
    assert tk.dense_config_for(64, 14336, 4096, interpret=False) == few


@pytest.mark.parametrize("small_bm", [8, 24, 64, 128])
def test_small_bm_must_be_a_power_of_two_below_bm(small_bm):
    with pytest.raises(ValueError, match="power of two from 16 up, below bm=64"):
        tk.TmaGemmConfig(64, 256, 64, 8, 3, small_bm=small_bm)


def test_launch_reads_no_host_values():
    """Table and grid sizes come from static shapes: both launches run on meta tensors (what ``wrap_triton``
    traces), and the grid never exceeds the items the table can hold."""
    launches = []

    class Stub:
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((grid, args, kw))

    x, w13 = torch.empty(1000, 64, dtype=BF16, device="meta"), torch.empty(8, 96, 64, dtype=BF16, device="meta")
    seg = torch.empty(9, dtype=torch.int64, device="meta")
    y = torch.empty(1000, 48, dtype=BF16, device="meta")
    cfg = tk.TmaGemmConfig(128, 128, 64, 8, 4, programs=132)
    tk.launch_grouped_gemm_swiglu_tma(x, w13, seg, y, config=cfg, wrap=lambda k: Stub())
    (prep_grid, prep_args, _), (grid, args, kw) = launches
    bound = -(-1000 // 128) + 8
    assert prep_grid == (-(-bound // tk.TABLE_BLOCK_T),) and prep_args[1].shape == (tk.TABLE_HEADER + 4 * bound,)
    assert grid == (min(132, bound * 1),) and kw["SWIGLU"] and kw["DESC"] == tk.DESC_MODES["device"]
    assert args[4] is prep_args[1] and args[5] is seg  # the GEMM walks the table the first launch fills
    assert args[3] is args[2] and not kw["SPLIT_UP"]  # no separate up weight: gate|up halves of w13
    assert args[1] is args[0] and kw["SMALL_BM"] == 0 and not kw["EXPERT_GROUPS"]


def test_opcheck_on_the_tma_path(monkeypatch):
    from ep_fuse.ops import registry

    def no_fallback(provider, op, error):
        raise AssertionError(f"{provider} {op} fell back to the reference: {error}")

    monkeypatch.setattr(registry, "_warn_once", no_fallback)
    x, w, seg = case([190, 0, 210], 4, 16, 32, BF16)  # 135 rows per expert (>= 128)
    assert host.kernel_variant(x, w) == "tma"
    ops = torch.ops.ep_fuse_triton
    for op, swiglu in ((ops.grouped_gemm.default, False), (ops.grouped_gemm_swiglu.default, True)):
        torch.library.opcheck(op, (x, w, seg))
        assert_matches(op(x, w, seg), loop_ref(x, w, seg, swiglu), seg, BF16)


# --------------------------------------------------------------------------- dense GEMM + SwiGLU (one expert)
@pytest.mark.parametrize("desc", DESCS)
@pytest.mark.parametrize("m,h,i", [(37, 32, 48), (70, 48, 16), (1, 32, 32), (129, 16, 40)])
def test_dense_gemm_swiglu_matches_the_reference(desc, m, h, i):
    """The one-expert launch with the gate and up weights read in place (two descriptors): bitwise the
    reference in bf16 (each GEMM output, the silu and the product rounded like the unfused model), with each
    GEMM accumulated in fp32 and rounded once. (The reference's own CPU bf16 ``mm`` rounds differently in
    single elements on some CPUs -- oneDNN's AMX path -- so the GEMMs are taken in fp32 here.)"""
    from ep_fuse.ops.gemm_swiglu import gemm_swiglu_ref

    g = torch.Generator().manual_seed(m * h + i)
    x = torch.randn(m, h, generator=g).to(BF16)
    wg, wu = ((torch.randn(i, h, generator=g) * 0.2).to(BF16) for _ in range(2))
    y = torch.full((m, i), float("nan"), dtype=BF16)
    tk.launch_gemm_swiglu_tma(x, wg, wu, y, config=dataclasses.replace(tk.dense_config_for(m, i, h), desc=desc))
    gate, up = ((x.float() @ w.float().t()).to(BF16) for w in (wg, wu))
    assert torch.equal(y, torch.nn.functional.silu(gate) * up)
    torch.testing.assert_close(y, gemm_swiglu_ref(x, wg, wu), rtol=1e-2, atol=1e-5)


def test_dense_provider_takes_the_tma_kernel_from_the_row_threshold(monkeypatch):
    """``gemm_swiglu`` runs the TMA kernel from ``GEMM_SWIGLU_TMA_MIN_ROWS`` rows (fp16 within rounding, row
    slices of a wider input included), the one-tile-per-program kernel below."""
    from ep_fuse.ops.gemm_swiglu import gemm_swiglu_ref
    from ep_fuse.providers.triton import gemm_swiglu as dense

    calls = []
    real = tk.launch_gemm_swiglu_tma
    monkeypatch.setattr(tk, "launch_gemm_swiglu_tma", lambda *a, **kw: (calls.append(1), real(*a, **kw)))
    monkeypatch.setattr(dense, "GEMM_SWIGLU_TMA_MIN_ROWS", 40)
    g = torch.Generator().manual_seed(3)
    wg, wu = ((torch.randn(24, 32, generator=g) * 0.2).to(F16) for _ in range(2))
    wide = torch.randn(45, 48, generator=g).to(F16)
    for x, tma in ((wide[:, :32], True), (wide[:39, :32], False), (wide[:2, :32].reshape(1, 2, 32), False)):
        x2 = x.reshape(-1, 32)
        assert dense.dense_variant(x2, wg, wu) == ("tma" if tma else "default")
        calls.clear()
        out = torch.ops.ep_fuse_triton.gemm_swiglu(x, wg, wu)
        assert calls == ([1] if tma else [])
        torch.testing.assert_close(out, gemm_swiglu_ref(x, wg, wu), rtol=2e-3, atol=2e-3)

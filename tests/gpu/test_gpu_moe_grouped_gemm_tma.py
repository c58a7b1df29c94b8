"""GPU check of the Hopper TMA grouped GEMM (``grouped_gemm:tma``, ``providers/triton/grouped_gemm_tma_kernel.py``).

It passed on H200 (2026-11-30), which (with ``bench/bench_moe_grouped_gemm_tma.py``) cleared the variant from
``UNVERIFIED_ON_GPU``; the tests still set ``EP_FUSE_UNVERIFIED_KERNELS=1``. bf16 (and fp16 on the edge
cases) against an fp32 per-expert loop, relative L2 error, outputs poisoned with NaN before each launch:
model shapes (DeepSeek-V3, Qwen3-30B-A3B, Mixtral-8x7B experts; gate|up + SwiGLU and down), ragged
routings (0-row experts, one expert taking every row, row counts off the tile, a zero tail), the three
descriptor modes, the flattened walk against the nested one, CUDA-graph replay with a new routing, and the
launch inlined by Inductor.
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                reason="needs a Hopper (sm90+) GPU")

BF16, F16 = torch.bfloat16, torch.float16
SHAPES = {  # name: (tokens T, hidden H, intermediate I, experts E, top-k K)
    "deepseek_v3_T4096": (4096, 7168, 2048, 256, 8),
    "deepseek_v3_T16384": (16384, 7168, 2048, 256, 8),
    "qwen3_30b_a3b_T4096": (4096, 2048, 768, 128, 8),
    "mixtral_8x7b_T2048": (2048, 4096, 14336, 8, 2),
    "mixtral_8x7b_T8192": (8192, 4096, 14336, 8, 2),
}
_WEIGHTS: dict[tuple[int, int, int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}


@pytest.fixture(autouse=True)
def _unverified_on(monkeypatch):
    from ep_fuse.providers.triton.unverified import ENV

    monkeypatch.setenv(ENV, "1")


def tk():
    return importlib.import_module("ep_fuse.providers.triton.grouped_gemm_tma_kernel")


def gk():
    return importlib.import_module("ep_fuse.providers.triton.grouped_gemm_kernel")


def weights(h: int, i: int, e: int, dtype=BF16) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w13 [E, 2I, H], w2 [E, H, I])``, one set on the GPU at a time (DeepSeek-V3's take 22 GB)."""
    key = (h, i, e, dtype)
    if key not in _WEIGHTS:
        _WEIGHTS.clear()
        torch.cuda.empty_cache()
        g = torch.Generator(device="cuda").manual_seed(h + i + e)
        w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=dtype, generator=g).mul_(h**-0.5)
        w2 = torch.randn(e, h, i, device="cuda", dtype=dtype, generator=g).mul_(i**-0.5)
        _WEIGHTS[key] = (w13, w2)
    return _WEIGHTS[key]


def routed(t: int, h: int, e: int, k: int, dtype=BF16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``t`` tokens routed by top-k of random logits, expert-major; ``seg_indptr``."""
    from ep_fuse.ops.moe import moe_permute_ref

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, h, device="cuda", dtype=dtype, generator=g)
    ids = torch.randn(t, e, device="cuda", generator=g).topk(k, dim=-1).indices
    rows, _src2dst, seg = moe_permute_ref(x, ids, e)
    return rows, seg


def from_counts(counts: list[int], tail: int, h: int, dtype=BF16) -> tuple[torch.Tensor, torch.Tensor]:
    seg = torch.tensor([0, *counts], dtype=torch.int64, device="cuda").cumsum(0)
    return torch.randn(sum(counts) + tail, h, device="cuda", dtype=dtype), seg


def loop_ref(x: torch.Tensor, w: torch.Tensor, seg: torch.Tensor, swiglu: bool) -> torch.Tensor:
    """fp32 per-expert GEMMs (SwiGLU in fp32); rows from ``seg[E]`` on are zero."""
    n = w.shape[1] // 2 if swiglu else w.shape[1]
    out = torch.zeros(x.shape[0], n, device="cuda")
    b = seg.tolist()
    for e in range(w.shape[0]):
        if b[e + 1] > b[e]:
            h = x[b[e]:b[e + 1]].float() @ w[e].float().T
            out[b[e]:b[e + 1]] = torch.nn.functional.silu(h[:, :n]) * h[:, n:] if swiglu else h
    return out


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def launch(x, w, seg, swiglu, config=None, kernel="tma") -> torch.Tensor:
    n = w.shape[1] // 2 if swiglu else w.shape[1]
    y = torch.full((x.shape[0], n), float("nan"), device="cuda", dtype=x.dtype)
    mod = tk() if kernel == "tma" else gk()
    if kernel == "tma":
        fn = mod.launch_grouped_gemm_swiglu_tma if swiglu else mod.launch_grouped_gemm_tma
    else:
        fn = mod.launch_grouped_gemm_swiglu if swiglu else mod.launch_grouped_gemm
    fn(x, w, seg, y, config=config)
    torch.cuda.synchronize()
    return y


def check(x, w, seg, swiglu, config=None, compare_default=True) -> float:
    """TMA output: every row written, exact zero tail, rel L2 < 1e-2 and within 25 % of the existing kernel's."""
    assert tk().tma_unsupported(x, w) is None
    out = launch(x, w, seg, swiglu, config)
    end = int(seg[-1])
    assert not out.isnan().any(), "unwritten or NaN output"
    assert torch.equal(out[end:], torch.zeros_like(out[end:])), "tail rows must be zero"
    ref = loop_ref(x, w, seg, swiglu)
    err = rel_l2(out, ref)
    assert err < 1e-2, err
    if compare_default:
        base = rel_l2(launch(x, w, seg, swiglu, kernel="default"), ref)
        assert err <= 1.25 * base + 1e-4, (err, base)
    return err


@pytest.mark.parametrize("shape", list(SHAPES))
def test_model_shapes_gate_up_swiglu_and_down(shape):
    t, h, i, e, k = SHAPES[shape]
    w13, w2 = weights(h, i, e)
    rows, seg = routed(t, h, e, k)
    check(rows, w13, seg, True)
    act = launch(rows, w13, seg, True)
    check(act, w2, seg, False)


ROUTINGS = {
    "one_expert_takes_every_row": lambda e: [0] * 5 + [4096 * 8 - 3] + [0] * (e - 6),
    "zero_row_experts_and_odd_counts": lambda e: [[0, 1, 127, 129, 333, 0, 64, 0][j % 8] for j in range(e)],
    "last_expert_only": lambda e: [0] * (e - 1) + [1000],
}


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("routing", sorted(ROUTINGS))
@pytest.mark.parametrize("tail", [0, 77])
def test_ragged_routings(routing, tail, dtype):
    """Qwen3-30B-A3B expert dims (H2048, I768, E128); ``tail`` spare rows past ``seg[E]`` must come out zero."""
    h, i, e = 2048, 768, 128
    w13, w2 = weights(h, i, e, dtype)
    x, seg = from_counts(ROUTINGS[routing](e), tail, h, dtype)
    check(x, w13, seg, True)
    check(x[:, :i].contiguous(), w2, seg, False)


@pytest.mark.parametrize("swiglu", [False, True], ids=["down", "gate_up_swiglu"])
def test_flattened_walk_matches_the_nested_walk(swiglu):
    """``flatten`` (the K loop fused into the walk; ``config_for`` takes it for the down GEMM with more than 16
    experts): bit-identical to the nested walk, with 0-row experts, odd counts and a 77-row zero tail."""
    h, i, e = 2048, 768, 128
    w13, w2 = weights(h, i, e)
    x, seg = from_counts(ROUTINGS["zero_row_experts_and_odd_counts"](e), 77, h)
    if not swiglu:
        x = x[:, :i].contiguous()
    w = w13 if swiglu else w2
    cfg = tk().config_for(x.shape[0], w.shape[1] // 2 if swiglu else w.shape[1], x.shape[1], e, swiglu=swiglu)
    assert cfg.flatten == (not swiglu)
    if swiglu:  # the fused loop needs more shared memory: 64 x 256 SwiGLU tiles fit 2 stages, not 3
        cfg = dataclasses.replace(cfg, num_stages=2)
    flat = launch(x, w, seg, swiglu, dataclasses.replace(cfg, flatten=True))
    nested = launch(x, w, seg, swiglu, dataclasses.replace(cfg, flatten=False))
    assert torch.equal(flat, nested)
    check(x, w, seg, swiglu, dataclasses.replace(cfg, flatten=True), compare_default=False)


@pytest.mark.parametrize("desc", ["device", "host", "pointer"])
def test_descriptor_modes(desc):
    t, h, i, e, k = SHAPES["qwen3_30b_a3b_T4096"]
    w13, w2 = weights(h, i, e)
    rows, seg = routed(t, h, e, k, seed=1)
    for swiglu, x, w in ((True, rows, w13), (False, rows[:, :i].contiguous(), w2)):
        cfg = dataclasses.replace(tk().config_for(x.shape[0], w.shape[1], x.shape[1], e, swiglu=swiglu), desc=desc)
        check(x, w, seg, swiglu, cfg, compare_default=False)


SMALL = {"bm64_small32": (64, 32), "bm64_small16": (64, 16), "bm128_small32": (128, 32), "bm128_small64": (128, 64)}


@pytest.mark.parametrize("desc", ["device", "host", "pointer"])
@pytest.mark.parametrize("tiles", sorted(SMALL))
def test_small_last_tiles(tiles, desc):
    """``small_bm``: an expert's last tile of at most ``small_bm`` rows runs with the operands swapped, in groups
    cut at expert boundaries (``expert_groups``). Counts that leave every remainder (0, 1, small_bm,
    small_bm + 1, bm - 1) and a ragged tail; then top-k routing."""
    bm, small = SMALL[tiles]
    h, i, e = 2048, 768, 128
    w13, w2 = weights(h, i, e)
    rems = [0, 1, small - 1, small, small + 1, bm - 1, 0]
    counts = [[0, bm, 2 * bm][j % 3] + rems[j % 7] for j in range(e)]
    x, seg = from_counts(counts, 13, h)
    rows, rseg = routed(4096, h, e, 8, seed=7)
    for xx, ss in ((x, seg), (rows, rseg)):
        for swiglu, xi, w in ((True, xx, w13), (False, xx[:, :i].contiguous(), w2)):
            base = tk().config_for(xi.shape[0], w.shape[1], xi.shape[1], e, swiglu=swiglu)
            bn = 256 if bm == 64 else 128
            cfg = dataclasses.replace(base, bm=bm, bn=bn, num_stages=3 if bm == 64 else 4, small_bm=small, desc=desc,
                                      expert_groups=True)
            check(xi, w, ss, swiglu, cfg, compare_default=False)


def test_provider_dispatch(monkeypatch):
    from ep_fuse.providers.triton import grouped_gemm as host
    from ep_fuse.providers.triton.unverified import ENV

    t, h, i, e, k = SHAPES["qwen3_30b_a3b_T4096"]
    w13, _w2 = weights(h, i, e)
    rows, seg = routed(t, h, e, k, seed=2)
    assert host.kernel_variant(rows, w13) == "tma"
    assert rel_l2(host.grouped_gemm_swiglu_kernel(rows, w13, seg), loop_ref(rows, w13, seg, True)) < 1e-2
    decode_rows, decode_seg = routed(16, h, e, k, seed=3)
    assert host.kernel_variant(decode_rows, w13) == "default"
    monkeypatch.delenv(ENV)  # cleared (2026-11-30): taken without the override
    assert host.kernel_variant(rows, w13) == "tma"


def test_cuda_graph_replay_with_a_new_routing():
    """The launch reads no device values on the host: a captured graph follows new offsets and rows."""
    from ep_fuse.providers.triton.grouped_gemm import grouped_gemm_swiglu_kernel

    t, h, i, e, k = SHAPES["qwen3_30b_a3b_T4096"]
    w13, _w2 = weights(h, i, e)
    rows, seg = routed(t, h, e, k, seed=4)
    out = grouped_gemm_swiglu_kernel(rows, w13, seg)  # warm-up: compile outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        grouped_gemm_swiglu_kernel(rows, w13, seg)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = grouped_gemm_swiglu_kernel(rows, w13, seg)
    new_rows, new_seg = routed(t, h, e, k, seed=5)
    rows.copy_(new_rows)
    seg.copy_(new_seg)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_l2(out, loop_ref(rows, w13, seg, True)) < 1e-2


def test_inlined_in_inductor():
    """Under ``torch.compile`` the ops are traced through ``wrap_triton``: the generated code launches the TMA
    kernel (device-side descriptors: Triton's scratch allocator) and matches the eager op."""
    from torch._inductor.utils import run_and_get_code

    import ep_fuse.providers  # noqa: F401  (registers torch.ops.ep_fuse_triton.*)

    t, h, i, e, k = SHAPES["qwen3_30b_a3b_T4096"]
    w13, w2 = weights(h, i, e)
    rows, seg = routed(t, h, e, k, seed=6)
    ops = torch.ops.ep_fuse_triton

    def experts(r, a, b, s):
        return ops.grouped_gemm(ops.grouped_gemm_swiglu(r, a, s), b, s)

    torch._dynamo.reset()
    out, code = run_and_get_code(torch.compile(experts, dynamic=False), rows, w13, w2, seg)
    assert any("_grouped_gemm_tma_kernel" in c for c in code), "the TMA kernel was not inlined"
    torch.testing.assert_close(out, experts(rows, w13, w2, seg))


# --------------------------------------------------------------------------- dense GEMM + SwiGLU (one expert)
@pytest.mark.parametrize("h,i,m", [(4096, 11008, 4096), (7168, 2048, 1000), (7168, 18432, 1024)])
@pytest.mark.parametrize("desc", ["device", "host"])
def test_dense_gemm_swiglu(h, i, m, desc):
    """The one-expert launch, gate and up weights read in place, against an fp32 reference; through the
    provider op at the row threshold, and inlined by Inductor."""
    from ep_fuse.providers.triton import gemm_swiglu as dense
    from ep_fuse.providers.triton import gemm_swiglu as triton_gemm_swiglu

    g = torch.Generator(device="cuda").manual_seed(m + i)
    x = torch.randn(m, h, device="cuda", dtype=BF16, generator=g)
    wg, wu = (torch.randn(i, h, device="cuda", generator=g).mul_(h**-0.5).to(BF16) for _ in range(2))
    ref = torch.nn.functional.silu(x.float() @ wg.float().T) * (x.float() @ wu.float().T)
    y = torch.full((m, i), float("nan"), device="cuda", dtype=BF16)
    cfg = dataclasses.replace(tk().dense_config_for(m, i, h), desc=desc)
    tk().launch_gemm_swiglu_tma(x, wg, wu, y, config=cfg)
    assert not y.isnan().any() and rel_l2(y, ref) < 1e-2
    if desc == "device" and m >= triton_gemm_swiglu.GEMM_SWIGLU_TMA_MIN_ROWS:
        assert dense.dense_variant(x, wg, wu) == "tma"
        assert rel_l2(torch.ops.ep_fuse_triton.gemm_swiglu(x, wg, wu), ref) < 1e-2
        torch._dynamo.reset()
        out = torch.compile(lambda a: torch.ops.ep_fuse_triton.gemm_swiglu(a, wg, wu), dynamic=False)(x)
        assert rel_l2(out, ref) < 1e-2

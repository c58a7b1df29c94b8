"""One Hopper GPU with DeepGEMM built (``tools/build_deepgemm.sh``; skipped without it): the DeepGEMM provider's
FP8 GEMM stages on the 128-row aligned layout against the pure-torch reference (DeepSeek-V3 expert shapes,
ragged routing with empty experts, one expert taking every row), the whole FP8 block, CUDA-graph replay, and
``torch.compile(..., quant="fp8_block")`` choosing it. Sets ``EP_FUSE_UNVERIFIED_KERNELS=1``."""

import pytest
import torch

from ep_fuse.ops import fp8 as R
from ep_fuse.ops.moe import moe_unpermute_ref
from ep_fuse.providers.deepgemm import fp8 as D

pytestmark = pytest.mark.skipif(D.available() is not None, reason=f"DeepGEMM provider: {D.available()}")
BF16 = torch.bfloat16
H, I, E, K = 7168, 2048, 256, 8


def bits(a: torch.Tensor) -> torch.Tensor:
    return a.view(torch.uint8)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return q.float() * s.repeat_interleave(128, dim=-1)[:, : q.shape[-1]]


@pytest.fixture(autouse=True)
def _enable(monkeypatch):
    monkeypatch.setenv("EP_FUSE_UNVERIFIED_KERNELS", "1")


@pytest.fixture(scope="module")
def weights():
    g = torch.Generator(device="cuda").manual_seed(1)
    w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=BF16, generator=g) * H**-0.5
    w2 = torch.randn(E, H, I, device="cuda", dtype=BF16, generator=g) * I**-0.5
    return R.quantize_weight_fp8(w13), R.quantize_weight_fp8(w2)


def routing(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(len(kind))
    t = {"random": 2048, "skewed": 515, "one_expert": 300}[kind]
    x = torch.randn(t, H, device="cuda", dtype=BF16, generator=g)
    x[:, 3] *= 50  # an outlier channel
    if kind == "random":
        ids = torch.randn(t, E, device="cuda", generator=g).topk(K, dim=-1).indices
        ids[0, 0] = -1
    elif kind == "skewed":  # experts 0..15 only (240 empty), odd token count, a dropped slot
        ids = torch.randn(t, 16, device="cuda", generator=g).topk(K, dim=-1).indices
        ids[5, 2] = -1
    else:  # every slot to expert 5
        ids = torch.full((t, K), 5, device="cuda", dtype=torch.int64)
    return x, ids


@pytest.mark.parametrize("kind", ["random", "skewed", "one_expert"])
def test_deepgemm_stages_match_reference(kind, weights):
    from ep_fuse.providers.triton import fp8 as T

    (q13, s13), (q2, s2) = weights
    x, ids = routing(kind)
    got, want = T.moe_permute_fp8_kernel(x, ids, E, 128, D.ALIGN), R.moe_permute_fp8_ref(x, ids, E, 128, D.ALIGN)
    n = int(want[3][-1])
    assert torch.equal(got[3], want[3]) and torch.equal(got[2], want[2])
    assert not (want[3] % D.ALIGN).any()
    assert torch.equal(bits(got[0][:n]), bits(want[0][:n])) and torch.equal(got[1][:n], want[1][:n])
    xq, xs, src2dst, seg = want
    args = (xq, xs, q13, s13, seg, 128, 128, D.ALIGN)
    assert D.check_swiglu_call(args) is None
    aq, a_s = D.grouped_gemm_fp8_swiglu_quant_kernel(*args)
    aqr, asr = R.grouped_gemm_fp8_swiglu_quant_ref(*args)
    # gate and up reach SwiGLU rounded to bf16 (DeepGEMM's output), on top of the fp8 MMA's per-block
    # accumulation (tests/gpu/test_gpu_fp8.py): group scales within 2 %, dequantized values within 2 % rel-L2
    torch.testing.assert_close(a_s[:n], asr[:n], rtol=2e-2, atol=1e-9)
    assert rel_l2(dequant(aq[:n], a_s[:n]), dequant(aqr[:n], asr[:n])) < 2e-2
    y = D.grouped_gemm_fp8_kernel(aqr, asr, q2, s2, seg, 128, 128, BF16, D.ALIGN)
    yr = R.grouped_gemm_fp8_ref(aqr, asr, q2, s2, seg, 128, 128, BF16)
    assert rel_l2(y[:n], yr[:n]) < 1e-2
    # the block's output (the rows summed back per token) against the reference block on the plain layout
    out = moe_unpermute_ref(D.grouped_gemm_fp8_kernel(aq, a_s, q2, s2, seg, 128, 128, BF16, D.ALIGN), src2dst,
                            None, K, torch.float32)
    c = R.moe_permute_fp8_ref(x, ids, E, 128)
    ac, acs = R.grouped_gemm_fp8_swiglu_quant_ref(c[0], c[1], q13, s13, c[3], 128, 128)
    ref = moe_unpermute_ref(R.grouped_gemm_fp8_ref(ac, acs, q2, s2, c[3], 128, 128, BF16), c[2], None, K,
                            torch.float32)
    assert rel_l2(out, ref) < 2e-2


def test_deepgemm_chain_replays_from_a_cuda_graph(weights):
    """Routing changes between replays (seg_indptr is read on the device only)."""
    from ep_fuse.providers.triton import fp8 as T

    (q13, s13), (q2, s2) = weights
    x, ids = routing("random")
    x2, ids2 = routing("skewed")
    xs_in, ids_in = x[: x2.shape[0]].clone(), ids[: x2.shape[0]].clone()

    def chain() -> tuple[torch.Tensor, torch.Tensor]:
        xq, xs, src, seg = T.moe_permute_fp8_kernel(xs_in, ids_in, E, 128, D.ALIGN)
        aq, a_s = D.grouped_gemm_fp8_swiglu_quant_kernel(xq, xs, q13, s13, seg, 128, 128, D.ALIGN)
        return D.grouped_gemm_fp8_kernel(aq, a_s, q2, s2, seg, 128, 128, BF16, D.ALIGN), src

    eager = moe_unpermute_ref(*chain(), None, K, torch.float32)
    chain()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, src = chain()
    graph.replay()
    torch.testing.assert_close(moe_unpermute_ref(y, src, None, K, torch.float32), eager, rtol=0, atol=0)
    xs_in.copy_(x2)
    ids_in.copy_(ids2)
    want = moe_unpermute_ref(*chain(), None, K, torch.float32)
    graph.replay()
    torch.testing.assert_close(moe_unpermute_ref(y, src, None, K, torch.float32), want, rtol=0, atol=0)


def test_quant_fp8_block_lowers_the_gemms_to_deepgemm():
    from support.moe_modules import compile_routed_case  # tests/support/moe_modules.py

    import ep_fuse

    # 512 tokens x top-2 over 8 experts: 128 rows per expert on average, at least D.MIN_ROWS_PER_EXPERT
    out, ref = compile_routed_case(512, "cuda", quant="fp8_block")
    rep = ep_fuse.last_report()
    assert sum("ep_fuse_deepgemm.grouped_gemm_fp8" in op for op in rep.ops_after) == 2, rep.ops_after
    assert rel_l2(out, ref) < 0.08

"""GPU check of the ``<op>_by_size`` choice traced as branches on the row count
(``providers/triton/size_branches.py``): each branch on CUDA with its real tile config, and a
``dynamic=True`` compile of a Qwen2-MoE-style model through ``backend="ep_fuse"`` whose symbolic graph runs
token counts in every branch it has on Hopper (decode tiles, 64-row tiles, the TMA kernel) with Inductor's
generated code choosing the branch (no ``_by_size`` op left) and no recompile.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                reason="needs a Hopper (sm90+) GPU")

BF16 = torch.bfloat16


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("e, n, k", [(8, 256, 256), (60, 1408, 2880 // 2)])
def test_every_grouped_branch_on_cuda(swiglu: bool, e: int, n: int, k: int) -> None:
    from ep_fuse.ops.moe import grouped_gemm_ref, grouped_gemm_swiglu_ref
    from ep_fuse.providers.triton import size_branches as sb
    from ep_fuse.providers.triton import moe as triton_moe

    torch.manual_seed(0)
    counts = torch.randint(0, 40, (e,))
    counts[1] = 0
    m = int(counts.sum()) + 5  # a zero tail
    x = torch.randn(m, k, dtype=BF16, device="cuda")
    w = (torch.randn(e, 2 * n if swiglu else n, k, dtype=BF16, device="cuda") / k**0.5)
    seg = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).cuda()
    ref = (grouped_gemm_swiglu_ref if swiglu else grouped_gemm_ref)(x, w, seg)
    for b in triton_moe.grouped_branches(x, w, swiglu):
        out = b.run((x, w, seg), None)
        assert rel_l2(out, ref) < 1e-2, b.name
        assert out[int(seg[-1]):].abs().max() == 0, b.name


def test_dynamic_compile_takes_every_branch_in_one_graph(monkeypatch) -> None:
    from torch._inductor.utils import run_and_get_code

    import ep_fuse
    from ep_fuse.testing.tiny import qwen2_moe_sized

    # 8 experts, top-2: rows = 2 * tokens; decode tiles up to 128 rows, 64-row tiles below 512, the TMA kernel
    # from 512 (64 rows per expert; 256 and 128 columns fill its tiles)
    model = qwen2_moe_sized(hidden=256, head_dim=32, heads=8, kv_heads=2, experts=8, top_k=2, moe_intermediate=128,
                            shared_intermediate=256, layers=1, device="cuda")
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)  # the generated code is read below
    compiled = torch.compile(model, backend="ep_fuse", dynamic=True)
    shapes = [(2, 3), (2, 40), (2, 200), (2, 700)]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        codes: list[str] = []
        for i, (b, s) in enumerate(shapes):
            ids = torch.randint(0, 128, (b, s), generator=g).cuda()
            if i == 0:
                out, codes = run_and_get_code(compiled, input_ids=ids, use_cache=False)
                graphs = len(ep_fuse.reports())
            else:
                out = compiled(input_ids=ids, use_cache=False)
            ref = model(input_ids=ids, use_cache=False)
            assert rel_l2(out.logits, ref.logits) < 2e-2, (b, s)
        assert len(ep_fuse.reports()) == graphs, "a token count recompiled the symbolic graph"
    rep = ep_fuse.last_report()
    assert rep.count("moe_experts") == 1 and rep.count("gemm_swiglu") == 1, rep.summary()
    code = "\n".join(codes)
    assert code, "no generated code captured"
    assert "_by_size" not in code, "an opaque <op>_by_size call is left in the generated code"
    assert "true_graph" in code, "no branches in the generated code"


@pytest.mark.parametrize("batch", ["backed", "unbacked"])
def test_dynamic_compile_with_a_shared_length(batch: str) -> None:
    """``position_ids`` share the length with ``input_ids``: after a (1, 1) call Dynamo makes one of the two
    lengths an alias of the other, which the branches' subgraphs must not bind (they failed with "For s27*u0,
    expected [s27] to have been codegen-ed" on H200). ``unbacked``: the batch marked by
    ``ep_fuse.dynamic_batch`` (which marks it on CUDA because cuDNN's SDPA is off), 2 graphs (decode, prefill)
    over batch 1 and 3; the TMA kernels inlined at the unbacked size get it as an int64 argument."""
    import ep_fuse
    from ep_fuse.testing.tiny import qwen2_moe_sized

    torch._dynamo.reset()
    ep_fuse.reset_reports()
    model = qwen2_moe_sized(hidden=256, head_dim=32, heads=8, kv_heads=2, experts=8, top_k=2, moe_intermediate=128,
                            shared_intermediate=256, layers=1, device="cuda")
    compiled = torch.compile(model, backend="ep_fuse", dynamic=True)
    shapes = [(1, 1), (3, 7), (2, 40)] + ([(1, 9), (3, 1)] if batch == "unbacked" else [])
    cudnn = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(batch == "backed")
    g = torch.Generator().manual_seed(0)
    try:
        with torch.no_grad():
            for b, s in shapes:
                ids = torch.randint(0, 128, (b, s), generator=g).cuda()
                inputs = {"input_ids": ids, "position_ids": torch.arange(s, device="cuda").expand(b, s).contiguous()}
                ref = model(**inputs, use_cache=False)
                if batch == "unbacked":
                    ep_fuse.dynamic_batch(inputs)
                    assert 0 in getattr(inputs["input_ids"], "_dynamo_unbacked_indices", ()), "batch not marked"
                out = compiled(**inputs, use_cache=False)
                assert rel_l2(out.logits, ref.logits) < 2e-2, (b, s)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
    reports = ep_fuse.reports()
    assert len(reports) == 2, [r.graph for r in reports]
    assert all(r.count("moe_experts") == 1 for r in reports), [r.summary() for r in reports]

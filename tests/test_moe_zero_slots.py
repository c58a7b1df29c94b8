"""Zero-weight remapped slots (``ep_fuse.passes.moe_zero_slots``): transformers 5.25's LongCat-Flash remaps its
identity experts' top-k slots onto real experts with routing weight 0; those slots are not dispatched."""

import pytest
import torch
import transformers
from packaging.version import Version
from torch import fx

import ep_fuse
from ep_fuse.config import EpFuseConfig
from ep_fuse.fx_utils import fake_mode_of
from ep_fuse.passes.base import PassContext
from ep_fuse.passes.moe_zero_slots import DropZeroWeightSlots
from ep_fuse.report import GraphReport
from support.compiling import capture_aten, compile_and_run

E, Z, T, K, H, I = 4, 2, 12, 2, 32, 16


def _remapped(x, ids, w, w13, w2, fill=0.0, same_mask=True):
    """LongCat-Flash's remap (transformers 5.25) in front of the routed-expert block."""
    mask = ids >= E
    dummy = (ids - E) * E // Z
    ids = torch.where(mask, dummy, ids)
    w = w.masked_fill(mask if same_mask else mask | (ids < 0), fill)  # the same values, another node
    return torch.ops.ep_fuse.moe_experts(x, ids, w, w13, w2, None)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E + Z, generator=g)[:K] for _ in range(T)])
    return (torch.randn(T, H, generator=g), ids, torch.rand(T, K, generator=g),
            torch.randn(E, 2 * I, H, generator=g) / H**0.5, torch.randn(E, H, I, generator=g) / I**0.5)


def _block_ids(gm, args):
    """The ``topk_ids`` the ``moe_experts`` node of ``gm`` receives when it runs on ``args``."""
    seen = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            if n.op == "call_function" and n.target is torch.ops.ep_fuse.moe_experts.default:
                seen["ids"] = self.env[n.args[1]]
            return super().run_node(n)

    out = Recorder(gm).run(*args)
    return seen["ids"], out[0] if isinstance(out, (tuple, list)) else out


def _pass(gm):
    ctx = PassContext(config=EpFuseConfig.from_options({"executor": "eager"}), device="cpu", executor="eager",
                      report=GraphReport(graph="zero-slots", device="cpu", executor="eager"),
                      fake_mode=fake_mode_of(gm))
    return DropZeroWeightSlots()(gm, ctx)


def test_remapped_zero_weight_slots_are_not_dispatched():
    """The remapped slots become -1 (skipped by every MoE op): the grouped GEMMs see only the real experts' slots,
    the block's output is what it was."""
    args = _inputs()
    identity = args[1] >= E
    assert 0 < int(identity.sum()) < T * K
    ((gm, example),) = capture_aten(_remapped, *args)
    ids_before, ref = _block_ids(gm, example)
    assert int(((ids_before >= 0) & (ids_before < E)).sum()) == T * K  # every slot computed, for nothing
    assert _pass(gm) == 1
    gm.recompile()
    ids_after, out = _block_ids(gm, example)
    assert torch.equal(ids_after, torch.where(identity, -1, args[1]))
    # fp32 on a CPU: each expert's GEMM runs on fewer rows, which may block the sums differently (an ulp)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, _remapped(*args), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kw", [{"fill": 0.5}, {"same_mask": False}], ids=["weight_not_zero", "another_mask"])
def test_slots_without_the_proof_stay(kw):
    """A nonzero fill, or weights zeroed by a mask other than the one that remapped the ids: nothing dropped."""
    args = _inputs(1)
    ((gm, example),) = capture_aten(lambda *a: _remapped(*a, **kw), *args)
    assert _pass(gm) == 0


@pytest.mark.hf
@pytest.mark.skipif(Version(transformers.__version__) < Version("5.25"),
                    reason="transformers < 5.25 runs LongCat-Flash's identity experts inside its experts loop")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_longcat_flash_identity_slots_are_dropped_and_the_block_equals_eager(dtype):
    from transformers import LongcatFlashConfig
    from transformers.models.longcat_flash.modeling_longcat_flash import LongcatFlashMoE

    cfg = LongcatFlashConfig(hidden_size=H, expert_ffn_hidden_size=I, n_routed_experts=E, zero_expert_num=Z,
                             num_experts_per_tok=K)
    cfg._experts_implementation = "grouped_mm"  # what prepare sets on the model
    torch.manual_seed(0)
    moe = LongcatFlashMoE(cfg).eval()
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    moe = moe.to(dtype)
    x = torch.randn(1, T, H, dtype=dtype)
    with torch.no_grad():
        ids = moe.router(x.view(T, H))[2]
        ref = moe(x)
    assert 0 < int((ids >= E).sum()) < T * K  # some slots go to identity experts
    out = compile_and_run(moe, x, executor="eager", providers={"cpu": ["reference"]})
    (rec,) = [m for m in ep_fuse.last_report().matches if m.pattern == "moe_experts"]
    assert rec.dropped_zero_slots
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(out, ref)  # the reference rounds as HF's grouped_mm does; a dropped slot adds 0

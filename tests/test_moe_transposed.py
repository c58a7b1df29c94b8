"""Expert weights stored ``[E, in, out]`` and used as they are (HF ``is_transposed=True``, Aria): the ``grouped_mm``
form fuses with ``transpose`` views of the weights as the block's ``w13`` / ``w2``; look-alikes with weights that do
not fit stay unfused."""

import pytest
import torch
from support.compiling import compile_and_run
from support.moe_modules import HFExperts

import ep_fuse

BF16, F32 = torch.bfloat16, torch.float32


class TransposedExperts(HFExperts):
    """Aria's experts: ``gate_up_proj`` [E, H, 2I], ``down_proj`` [E, I, H], ``is_transposed=True``."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        with torch.no_grad():
            self.gate_up_proj = torch.nn.Parameter(self.gate_up_proj.transpose(1, 2).contiguous())
            self.down_proj = torch.nn.Parameter(self.down_proj.transpose(1, 2).contiguous())
        self.is_transposed = True


def _routed(dtype, t=13, h=32, e=4, k=2, seed=3):
    g = torch.Generator().manual_seed(seed)
    w, ids = torch.randn(t, e, generator=g).softmax(-1).topk(k)
    return torch.randn(t, h, generator=g).to(dtype), ids, w


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("provider", ["reference", "triton"])
def test_transposed_weights_fuse(dtype, provider):
    mod = TransposedExperts(4, 32, 16, dtype=dtype)
    args = _routed(dtype)
    with torch.no_grad():
        ref = mod(*args)
    out = compile_and_run(mod, *args, executor="eager", providers={"cpu": [provider]})
    rep = ep_fuse.last_report()
    assert rep.count("moe_experts") == 1, rep.summary()
    block = rep.matches[0]
    assert block.variant == "grouped_mm"
    # the Triton grouped GEMMs read weights unit-stride along K: the transposed views keep the reference
    assert block.stages["grouped_gemm_swiglu"] == block.stages["grouped_gemm"] == "reference"
    assert block.stages["moe_permute"] == provider
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if dtype == F32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(out, ref), "the reference runs HF's grouped_mm on the same weights"


class HalfTransposed(HFExperts):
    """Only ``gate_up_proj`` stored [E, H, 2I] (read as it is); ``down_proj`` in Linear layout (transposed in the
    graph): each weight is taken in its own layout."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        with torch.no_grad():
            self.gate_up_proj = torch.nn.Parameter(self.gate_up_proj.transpose(1, 2).contiguous())

    def forward(self, x, topk_ids, topk_weights):
        k = topk_ids.shape[1]
        ids_sorted, perm = torch.sort(topk_ids.reshape(-1))
        rows = x[perm // k]
        offs = torch.cumsum(torch.histc(ids_sorted.float(), bins=self.num_experts, min=0, max=self.num_experts - 1),
                            0, dtype=torch.int32)
        from transformers.integrations.moe import _grouped_mm

        h = self._apply_gate(_grouped_mm(rows, self.gate_up_proj, offs=offs))
        y = _grouped_mm(h, self.down_proj.transpose(-2, -1), offs=offs) * topk_weights.reshape(-1)[perm].unsqueeze(-1)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel())
        return y[inv].view(x.shape[0], k, -1).sum(1).to(x.dtype)


def test_each_weight_keeps_its_own_layout():
    mod = HalfTransposed(4, 32, 16, dtype=F32)
    args = _routed(F32)
    with torch.no_grad():
        ref = mod(*args)
    out = compile_and_run(mod, *args, executor="eager", providers={"cpu": ["reference"]})
    assert ep_fuse.last_report().count("moe_experts") == 1, ep_fuse.last_report().summary()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)

"""transformers' Hub kernels (``kernelize``) on layers ep_fuse fuses: ``ep_fuse.prepare`` restores their plain
forwards. ``kernels`` is not installed on CPU machines, so the test doubles what it does: the class carries its Hub
layer name (``use_kernel_forward_from_hub`` with ``kernels`` installed) and ``kernelize`` binds the Hub layer's
``forward`` to each instance; the Hub kernels are opaque custom ops, as ``torch.compile`` sees registered ones."""

from __future__ import annotations

import logging
from types import MethodType

import pytest
import torch

transformers = pytest.importorskip("transformers")

import ep_fuse  # noqa: E402
from ep_fuse.hf import hub_kernels  # noqa: E402
from ep_fuse.testing import tiny  # noqa: E402

pytestmark = pytest.mark.hf


@torch.library.custom_op("ep_fuse_test_hub::rms_norm", mutates_args=())
def _hub_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    var = x.float().pow(2).mean(-1, keepdim=True)
    return (w * (x.float() * torch.rsqrt(var + eps)).to(x.dtype))


@_hub_rms_norm.register_fake
def _(x, w, eps):
    return torch.empty_like(x)


@torch.library.custom_op("ep_fuse_test_hub::silu", mutates_args=())
def _hub_silu(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(x)


@_hub_silu.register_fake
def _(x):
    return torch.empty_like(x)


class HubRMSNorm(torch.nn.Module):
    """The Hub layer (LigerRMSNorm's role): its forward is bound to transformers' RMSNorm instances."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return _hub_rms_norm(hidden_states, self.weight, self.variance_epsilon)


class HubSiLU(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _hub_silu(x)


class HubOther(torch.nn.Module):
    """A Hub kernel on a layer ep_fuse has no pattern for: kept (here the rotary embedding's cos/sin, unchanged)."""

    def forward(self, *args, **kwargs):
        return type(self).forward(self, *args, **kwargs)


def kernelize(model: torch.nn.Module, mapping: dict[str, type]) -> int:
    """``kernels.kernelize``'s replacement: each layer whose class has a mapped ``kernel_layer_name`` gets the Hub
    layer's forward bound to it; returns how many."""
    n = 0
    for module in model.modules():
        layer = mapping.get(getattr(type(module), "kernel_layer_name", None))
        if layer is not None:
            module.forward = MethodType(layer.forward, module)
            n += 1
    return n


@pytest.fixture
def kernelized(monkeypatch):
    """A tiny Qwen3-MoE whose RMSNorms, SiLUs (its experts' SwiGLU) and rotary embedding run Hub kernels."""
    from transformers.activations import SiLUActivation
    from transformers.models.qwen3_moe import modeling_qwen3_moe as m

    monkeypatch.setattr(m.Qwen3MoeRMSNorm, "kernel_layer_name", "RMSNorm", raising=False)
    monkeypatch.setattr(SiLUActivation, "kernel_layer_name", "SiLU", raising=False)
    monkeypatch.setattr(m.Qwen3MoeRotaryEmbedding, "kernel_layer_name", "SomeOtherLayer", raising=False)
    torch.manual_seed(0)
    model = tiny.build("qwen3_moe", dtype=torch.float32).eval()
    model.set_experts_implementation("grouped_mm")
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    n = kernelize(model, {"RMSNorm": HubRMSNorm, "SiLU": HubSiLU, "SomeOtherLayer": HubOther})
    assert n > 0
    return model, ids, ref


def _compiled_counts(model, ids, ref) -> dict[str, int]:
    torch._dynamo.reset()
    ep_fuse.reset_reports()
    opts = {"executor": "eager", "providers": {"cpu": ["reference"]}}
    with torch.no_grad():
        out = torch.compile(model, backend="ep_fuse", options=opts)(input_ids=ids).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    reports = ep_fuse.reports()
    assert len(reports) == 1
    return reports[0].counts()


def test_prepare_restores_the_layers_ep_fuse_fuses_and_keeps_the_others(kernelized, caplog):
    model, ids, ref = kernelized
    want = tiny.EXPECTED_SITES["qwen3_moe"][0]
    before = _compiled_counts(model, ids, ref)
    # the Hub kernels are opaque: no RMSNorm site, no experts' SwiGLU (its SiLU is a Hub call)
    assert "rms_norm" not in before and "add_rms_norm" not in before and "moe_experts" not in before, before
    with caplog.at_level(logging.INFO, logger="ep_fuse"):
        ep_fuse.prepare(model)
    lines = [r.getMessage() for r in caplog.records if "Hub kernels" in r.getMessage()]
    n_norms = sum(type(m).__name__ == "Qwen3MoeRMSNorm" for m in model.modules())
    n_silu = sum(type(m).__name__ == "SiLUActivation" for m in model.modules())
    assert len(lines) == 1 and f"RMSNorm x{n_norms}" in lines[0] and f"SiLU x{n_silu}" in lines[0], lines
    assert "kept: SomeOtherLayer x1" in lines[0], lines
    rotary = model.model.rotary_emb
    assert "forward" in vars(rotary)  # a Hub kernel ep_fuse does not fuse stays
    assert not any("forward" in vars(m) for m in model.modules() if type(m).__name__ == "Qwen3MoeRMSNorm")
    assert _compiled_counts(model, ids, ref) == want
    assert hub_kernels.restore_plain_forwards(model) == {}  # nothing left to restore


def test_kernels_fallback_forward_counts_as_plain():
    """``kernelize``'s fallback binds the class's own forward: nothing to restore there."""

    class Norm(torch.nn.Module):
        kernel_layer_name = "RMSNorm"

        def forward(self, x):
            return x

    plain = Norm()
    plain.forward = MethodType(Norm.forward, plain)
    model = torch.nn.Sequential(plain)
    assert hub_kernels.restore_plain_forwards(model) == {} and "forward" in vars(plain)


def test_a_kernelized_function_held_by_a_module_is_restored():
    """RoPE's ``apply_rotary_pos_emb``: ``use_kernel_forward_from_hub`` on a function makes it a module instance
    that ``use_kernelized_func`` holds in the attention's ``_kernel_funcs``; ``kernelize`` swaps its forward."""

    class RotaryFunc(torch.nn.Module):
        kernel_layer_name = "rotary_pos_emb"

        def forward(self, q, k):
            return q, k

    func = RotaryFunc()
    func.forward = MethodType(lambda self, q, k: (q + 1, k + 1), func)
    attn = torch.nn.Module()
    attn.__dict__["_kernel_funcs"] = {"apply_rotary_pos_emb": func}
    model = torch.nn.Sequential(attn, torch.nn.Module())
    model[1].__dict__["_kernel_funcs"] = {"apply_rotary_pos_emb": func}  # shared by every layer: restored once
    assert hub_kernels.restore_plain_forwards(model) == {"rotary_pos_emb": 1}
    q = torch.zeros(2)
    assert func(q, q)[0] is q

"""``@torch.inference_mode()`` forwards (``ep_fuse/surgery/inference_mode.py``): torch 2.13 cannot compile them when an
output views an input; ``ep_fuse.prepare`` rebinds them to the undecorated forward under ``torch.no_grad()``, and the
backend fuses a graph whose whole body runs with grad off although it was entered with grad mode on."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.fx as fx
from torch import nn

import ep_fuse
from ep_fuse.backend import drop_grad_off_frame
from ep_fuse.surgery.inference_mode import inference_mode_inner, unwrap_inference_mode

EAGER = {"executor": "eager"}


class Body(nn.Module):
    """A residual add + RMSNorm (one ``add_rms_norm`` site); the second output views the input."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(16, generator=torch.Generator().manual_seed(0)))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x + self.proj(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        return h, x.view(-1)


class Decorated(Body):
    @torch.inference_mode()
    def forward(self, x):
        return super().forward(x)


class AsksMode(Body):
    @torch.inference_mode()
    def forward(self, x):
        h, flat = super().forward(x)
        return (h * 2 if torch.is_inference_mode_enabled() else h), flat


class ModeOff(Body):
    @torch.inference_mode(False)
    def forward(self, x):
        return super().forward(x)


class NoGrad(Body):
    @torch.no_grad()
    def forward(self, x):
        return super().forward(x)


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Decorated()

    def forward(self, x):
        return self.inner(x)


def test_torch_cannot_compile_the_decorated_forward():
    """The failure the rebinding works around, in a process of its own (it leaves the dispatcher's thread state
    broken for later compiles). When this fails, torch compiles such forwards: the rebinding may go."""
    code = textwrap.dedent("""
        import torch
        class M(torch.nn.Module):
            @torch.inference_mode()
            def forward(self, x):
                return x * 2, x.view(-1)
        try:
            torch.compile(M(), backend="aot_eager")(torch.randn(2, 3))
        except Exception as e:
            print("raised:", e)
        else:
            print("compiled")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300).stdout
    assert "Cannot set version_counter for inference tensor" in out, out[-2000:]


def test_prepare_rebinds_the_forward_and_the_backend_fuses_it(caplog):
    model = Outer().eval()
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
    ref = model(x)
    assert ref[0].is_inference()
    with caplog.at_level(logging.INFO, logger="ep_fuse"):
        ep_fuse.prepare(model)
    assert "inner (Decorated): its @torch.inference_mode() forward runs under torch.no_grad()" in caplog.text
    assert "unchanged" not in caplog.text
    assert torch.is_grad_enabled()
    out = torch.compile(model, backend="ep_fuse", options=EAGER)(x)
    rep = ep_fuse.reports()
    assert len(rep) == 1 and rep[0].skipped is None, [r.summary() for r in rep]
    assert rep[0].counts() == {"add_rms_norm": 1}, rep[0].summary()
    assert not out[0].requires_grad and not out[0].is_inference()
    torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-6)
    assert torch.equal(out[1], x.view(-1))
    torch.testing.assert_close(model(x)[0], ref[0], rtol=0, atol=0)  # the rebound eager forward computes the same


def test_forwards_that_ask_about_inference_mode_are_kept(caplog):
    model = AsksMode().eval()
    with caplog.at_level(logging.WARNING, logger="ep_fuse"):
        assert unwrap_inference_mode(model) == []
    assert "asks is_inference_mode_enabled" in caplog.text
    assert "forward" not in model.__dict__
    with pytest.raises(ValueError, match="strict=True"):
        unwrap_inference_mode(model, strict=True)


def test_only_inference_mode_on_is_unwrapped():
    assert inference_mode_inner(Decorated.forward) is Decorated.forward.__wrapped__
    for cls in (ModeOff, NoGrad, Body):
        assert inference_mode_inner(cls.forward) is None, cls
        assert unwrap_inference_mode(cls()) == []


def test_a_no_grad_forward_fuses_with_grad_mode_on():
    model = NoGrad().eval()
    x = torch.randn(3, 16)
    out = torch.compile(model, backend="ep_fuse", options=EAGER)(x)
    rep = ep_fuse.last_report()
    assert rep.skipped is None and rep.counts() == {"add_rms_norm": 1}, rep.summary()
    assert not out[0].requires_grad
    torch.testing.assert_close(out[0], model(x)[0], rtol=1e-5, atol=1e-6)


def _graph(modes: list[bool | None]) -> fx.GraphModule:
    """``x`` through ``relu`` calls, with ``_set_grad_enabled(mode)`` where ``modes`` says (``None``: a relu)."""
    g = fx.Graph()
    x = g.placeholder("x")
    for m in modes:
        if m is None:
            x = g.call_function(torch.relu, (x,))
        else:
            g.call_function(torch._C._set_grad_enabled, (m,))
    g.output(x)
    return fx.GraphModule(nn.Module(), g)


@pytest.mark.parametrize("modes, body", [
    ([False, None, True], True),
    ([False, None, None, True], True),
    ([None, False, None, True], False),  # an op with grad on before
    ([False, None, True, None], False),  # and after
    ([False, None, True, None, False, None, True], False),  # grad on in between
    ([True, None, False], False),
    ([None], False),
])
def test_grad_off_frame(modes, body):
    gm = _graph(modes)
    before = len(gm.graph.nodes)
    assert drop_grad_off_frame(gm) is body
    assert len(gm.graph.nodes) == before - (2 if body else 0)
    assert not any(n.target is torch._C._set_grad_enabled for n in gm.graph.nodes) or not body

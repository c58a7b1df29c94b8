"""Never a silent wrong rewrite, never a broken compile: a replacement keeps the replaced node's strides (or the
rewrite is declined with the reason), a pass that raises leaves the graph as Dynamo gave it with one warning
naming the pass and the pattern, and a graph that needs gradients says why nothing is fused."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

import ep_fuse
from ep_fuse.matching.spec import Match, Replacement
from ep_fuse.passes import canonicalize
from ep_fuse.passes.canonicalize import Canonicalize

aten = torch.ops.aten


class Norm(nn.Module):
    def __init__(self, h: int = 64):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(v + 1e-6)).to(x.dtype)


def _match_with(root: fx.Node, pattern) -> Match:
    return Match(pattern=pattern, root=root, bindings={}, nodes=[root])


def test_a_replacement_with_other_strides_is_declined_with_the_reason():
    fake = FakeTensorMode()
    graph = fx.Graph()
    x = graph.placeholder("x")
    t = graph.call_function(aten.t.default, (x,))
    with fake:
        xv = torch.empty(4, 8)
        x.meta["val"] = xv
        t.meta["val"] = aten.t.default(xv)  # [8, 4], strides (1, 8)
    pattern = Canonicalize([]).patterns  # any pattern object works for the check; the record is not built
    m = _match_with(t, pattern)
    same = Replacement(aten.t.default, (x,))
    assert canonicalize._same_result(m, same, fake)[0] is None
    copy = Replacement(aten.permute_copy.default, (x, [1, 0]))  # same values and shape, contiguous (4, 1)
    reason, _ = canonicalize._same_result(m, copy, fake)
    assert reason is not None and "strides [4, 1] where the graph has [1, 8]" in reason


def test_size_one_dims_do_not_count():
    fake = FakeTensorMode()
    with fake:
        a = torch.empty(2, 1, 8)
        b = torch.empty_strided((2, 1, 8), (8, 123, 1))
    assert canonicalize._same_strides(a, b)


def test_a_failing_pass_leaves_the_dynamo_graph_and_warns_once(monkeypatch, caplog):
    def boom(*_args, **_kwargs):
        raise RuntimeError("a bug in a pattern's build")

    from ep_fuse import catalog

    for pattern in catalog.all_patterns():
        if pattern.name == "rms_norm":  # (frozen dataclasses: their field, replaced)
            monkeypatch.setitem(vars(pattern), "build", lambda m: boom())
    model = Norm().eval()
    x = torch.randn(3, 64)
    with torch.no_grad():
        ref = model(x)
        with caplog.at_level(logging.WARNING, logger="ep_fuse"):
            out = torch.compile(model, backend="ep_fuse", options={"executor": "eager"})(x)
    torch.testing.assert_close(out, ref)
    report = ep_fuse.last_report()
    assert report.matches == [] and "the rewrite failed in pass canonicalize, pattern rms_norm" in report.skipped
    assert "RuntimeError: a bug in a pattern's build" in report.skipped
    warnings = [r for r in caplog.records if "the rewrite failed" in r.getMessage()]
    assert len(warnings) == 1


def test_a_configuration_error_still_raises(monkeypatch):
    """An error that says what the user must change (EpError, ConfigError) is raised, not swallowed."""
    from ep_fuse.ops.ep import EpError
    from ep_fuse.passes.canonicalize import Canonicalize

    def refuse(self, gm, ctx):
        raise EpError("ep_fuse: the EP group cannot run this block")

    monkeypatch.setattr(Canonicalize, "__call__", refuse)
    with torch.no_grad(), pytest.raises(Exception, match="the EP group cannot run this block"):
        torch.compile(Norm().eval(), backend="ep_fuse", options={"executor": "eager"})(torch.randn(3, 64))


def test_a_graph_that_needs_gradients_says_why_nothing_is_fused(caplog):
    from ep_fuse import backend

    backend._WARNED.discard("autograd")
    model = Norm()
    x = torch.randn(3, 64)
    with caplog.at_level(logging.WARNING, logger="ep_fuse"):
        out = torch.compile(model, backend="ep_fuse", options={"executor": "eager"})(x)
        out.sum().backward()
    assert model.weight.grad is not None
    report = ep_fuse.last_report()
    assert report.matches == [] and "inference-only" in report.skipped
    assert "not rewritten" in report.summary()
    assert sum("inference-only" in r.getMessage() for r in caplog.records) == 1
    with torch.no_grad():  # the same model under no_grad fuses
        torch._dynamo.reset()
        torch.compile(model, backend="ep_fuse", options={"executor": "eager"})(x)
    assert ep_fuse.last_report().count("rms_norm") == 1


@pytest.mark.parametrize("executor", ["eager", "inductor"])
def test_the_stride_contract_holds_on_a_transposed_input(executor):
    """RMSNorm of a transposed activation: the fused op keeps the graph's layout, so a later ``view`` works."""

    class T(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = Norm(16)

        def forward(self, x):  # x [2, 16, 64]: normalise over a dim that is not contiguous
            y = self.norm(x.transpose(1, 2))  # [2, 64, 16], strides (1024, 1, 64)
            return y.view(2, 64 * 16) if y.is_contiguous() else y.reshape(2, 64 * 16)

    model = T().eval()
    x = torch.randn(2, 16, 64)
    with torch.no_grad():
        ref = model(x)
        out = torch.compile(model, backend="ep_fuse", options={"executor": executor})(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_views_become_reshapes_as_a_recorded_pass_under_inductor_only(monkeypatch):
    """``views_as_reshapes`` is the last pass under the Inductor executor (in the report and the dumps), absent under
    the eager one, and still runs on the graph put back after a failing pass."""
    from ep_fuse import catalog

    class NormThenView(Norm):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x * 2).reshape(3, 8, 8).sum(-1)  # a view of a computed tensor

    model, x = NormThenView().eval(), torch.randn(3, 64)

    def views(rep) -> int:
        return rep.passes[-1].ops.get("aten.view.default", 0)

    with torch.no_grad():
        torch._dynamo.reset()
        torch.compile(model, backend="ep_fuse", options={"executor": "eager"})(x)
        eager_rep = ep_fuse.last_report()
        torch._dynamo.reset()
        torch.compile(model, backend="ep_fuse", options={"executor": "inductor"})(x)
        rep = ep_fuse.last_report()
    assert "views_as_reshapes" not in [p.name for p in eager_rep.passes] and views(eager_rep) >= 1
    assert [p.name for p in rep.passes][-2:] == ["cleanup", "views_as_reshapes"]
    assert views(rep) == 0 and rep.passes[-1].changes >= 1 and rep.count("rms_norm") == 1
    for pattern in catalog.all_patterns():
        if pattern.name == "rms_norm":
            monkeypatch.setitem(vars(pattern), "build", lambda m: (_ for _ in ()).throw(RuntimeError("boom")))
    with torch.no_grad():
        torch._dynamo.reset()
        out = torch.compile(model, backend="ep_fuse", options={"executor": "inductor"})(x)
        torch.testing.assert_close(out, model(x))
    rep = ep_fuse.last_report()
    assert rep.skipped and [p.name for p in rep.passes] == ["views_as_reshapes"]

"""The backend: executors, side-effect freedom, autograd graphs, reports, logging and dumps."""

import logging
import os

import pytest
import torch
from torch import nn

import ep_fuse
from ep_fuse.backend import ep_fuse_backend, resolve_executor
from ep_fuse.config import ConfigError, EpFuseConfig
from support.compiling import compile_and_run

BF16 = torch.bfloat16


class Block(nn.Module):
    def __init__(self, h=64):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(h) * 0.1 + 1)
        self.proj = nn.Linear(h, h, bias=False)

    def forward(self, x, r):
        s = x + r
        hf = s.float()
        n = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        return self.proj(self.weight * n) + s


def _inputs(t=8, h=64):
    g = torch.Generator().manual_seed(0)
    return torch.randn(t, h, generator=g).to(BF16), torch.randn(t, h, generator=g).to(BF16)


def _dynamo_graph(mod, *args):
    captured = {}

    def grab(gm, example_inputs):
        captured["gm"], captured["ex"] = gm, example_inputs
        return gm.forward

    with torch.no_grad():
        torch.compile(mod, backend=grab)(*args)
    return captured["gm"], captured["ex"]


def test_backend_is_side_effect_free_when_called_twice():
    mod = Block().to(BF16)
    x, r = _inputs()
    gm, ex = _dynamo_graph(mod, x, r)
    code_before = gm.code
    with torch.no_grad():
        ref = mod(x, r)
        outs = [ep_fuse_backend(gm, ex, options={"executor": "eager"})(*ex) for _ in range(2)]
    assert gm.code == code_before, "the Dynamo graph is not modified"
    assert len(ep_fuse.reports()) == 1 and ep_fuse.last_report().count("add_rms_norm") == 1
    for out in outs:
        torch.testing.assert_close(out[0].float(), ref.float(), rtol=0.02, atol=0.05)


def test_graph_needing_autograd_is_compiled_unchanged():
    mod = Block().to(BF16)
    x, r = _inputs()
    out = torch.compile(mod, backend="ep_fuse", options={"executor": "eager"})(x, r)
    out.float().sum().backward()
    rep = ep_fuse.last_report()
    assert rep.matches == [] and "autograd" in rep.skipped
    assert mod.weight.grad is not None


@pytest.mark.slow
def test_inductor_executor_calls_the_fused_op():
    from torch._inductor.utils import run_and_get_code

    mod = Block().to(BF16)
    x, r = _inputs()
    with torch.no_grad():
        ref = mod(x, r)
        compiled = torch.compile(mod, backend="ep_fuse", options={"executor": "inductor", "perf_guard": False})
        out, codes = run_and_get_code(compiled, x, r)
    rep = ep_fuse.last_report()
    assert rep.executor == "inductor" and rep.matches[0].provider == "triton"
    assert any("ep_fuse_triton.add_rms_norm" in c for c in codes), "the provider op survives Inductor"
    torch.testing.assert_close(out.float(), ref.float(), rtol=0.02, atol=0.05)
    # where the compile time went: each phase timed once, the passes' own records inside "rewrite"
    spent = rep.compile_seconds
    assert list(spent) == ["capture", "rewrite", "inductor"] and all(v > 0 for v in spent.values())
    assert sum(p.seconds for p in rep.passes) <= spent["rewrite"]

    from ep_fuse.report import compile_totals

    phases, analyses = compile_totals([rep, rep])  # summed over graphs
    assert phases == {k: 2 * v for k, v in spent.items()}
    assert analyses == {k: 2 * int(rep.kernel_analyses.get(k, 0)) for k in ("computed", "served")}


@pytest.mark.slow
def test_inductor_executor_inlines_declined_sites():
    """With only the reference provider, Inductor sees the original ATen math again."""
    mod = Block().to(BF16)
    x, r = _inputs()
    with torch.no_grad():
        plain = torch.compile(mod, backend="inductor")(x, r)
        torch._dynamo.reset()
        out = torch.compile(mod, backend="ep_fuse", options={"providers": {"cpu": ["reference"]}})(x, r)
    rep = ep_fuse.last_report()
    assert rep.matches[0].provider == "reference"
    assert rep.ops_after.get("aten.rsqrt.default") == 1 and not any(k.startswith("ep_fuse") for k in rep.ops_after)
    assert torch.equal(out, plain), "declining a site leaves Inductor's own code"


@pytest.mark.slow
def test_perf_guard_keeps_inductor_code_where_the_kernel_is_not_faster():
    mod = Block().to(BF16)
    x, r = _inputs(t=512, h=64)  # a batch size where Inductor's own kernel measured as fast
    with torch.no_grad():
        ref = mod(x, r)
        out = torch.compile(mod, backend="ep_fuse")(x, r)
    m = ep_fuse.last_report().matches[0]
    assert m.provider == "reference" and m.declined[0][0] == "triton"
    assert "measured as fast" in m.declined[0][1]
    assert ep_fuse.last_report().ops_after.get("aten.rsqrt.default") == 1
    torch.testing.assert_close(out.float(), ref.float(), rtol=0.02, atol=0.05)


@pytest.mark.slow
def test_mode_is_passed_to_inductor():
    mod = Block().to(BF16)
    x, r = _inputs()
    with torch.no_grad():
        ref = mod(x, r)
        out = torch.compile(mod, backend="ep_fuse", mode="reduce-overhead")(x, r)
    torch.testing.assert_close(out.float(), ref.float(), rtol=0.02, atol=0.05)
    assert ep_fuse.last_report().executor == "inductor"


def test_executor_resolution():
    cfg = EpFuseConfig.from_options({})
    assert resolve_executor(cfg, "cpu") == "inductor"
    assert resolve_executor(cfg, "npu") == "eager"
    with pytest.raises(ConfigError, match="does not support device 'npu'"):
        resolve_executor(EpFuseConfig.from_options({"executor": "inductor"}), "npu")


def test_parameters_stay_static_inputs_for_inductor():
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    from ep_fuse.backend import copy_dynamo_metadata

    mod = Block().to(BF16)
    gm, ex = _dynamo_graph(mod, *_inputs())
    seen = {}

    def fw(g, _i):
        seen["g"] = g
        return make_boxed_func(g.forward)

    with torch.no_grad():
        aot_module_simplified(gm, ex, fw_compiler=fw, inference_compiler=fw, decompositions={})
    aten = seen["g"]
    copy_dynamo_metadata(gm, aten)
    src = [n._dynamo_source for n in gm.graph.find_nodes(op="placeholder")]
    dst = [n._dynamo_source for n in aten.graph.find_nodes(op="placeholder")]
    assert src == dst and aten.meta["dynamo_compile_id"] == gm.meta["dynamo_compile_id"]
    static = [n.name for n in aten.graph.find_nodes(op="placeholder")
              if n.meta.get("tensor_dict", {}).get("_dynamo_static_input_type")]
    assert len(static) == 2, "weight and proj.weight are parameters"


def test_report_logged_through_logging(caplog):
    mod = Block().to(BF16)
    with caplog.at_level(logging.INFO, logger="ep_fuse"):
        compile_and_run(mod, *_inputs(), executor="eager")
    text = caplog.text
    assert "add_rms_norm[llama]" in text and "-> triton" in text


def test_env_switch_attaches_a_handler(monkeypatch):
    from ep_fuse import log

    monkeypatch.setenv("EP_FUSE_LOG", "debug")
    monkeypatch.setattr(log, "_configured", None)
    log.configure_from_env()
    logger = logging.getLogger("ep_fuse")
    assert logger.level == logging.DEBUG and any(getattr(h, "_ep_fuse", False) for h in logger.handlers)
    logger.setLevel(logging.NOTSET)


def test_dump_dir_writes_graphs_and_report(tmp_path):
    mod = Block().to(BF16)
    compile_and_run(mod, *_inputs(), executor="eager", dump_dir=str(tmp_path))
    (graph_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    names = sorted(p.name for p in graph_dir.iterdir())
    assert names == ["00_dynamo.py", "01_aten.py", "02_attention_mask.py", "03_attention_gqa.py",
                     "04_canonicalize.py", "05_pair.py", "06_cleanup.py", "07_ep.py", "08_drop_zero_slots.py",
                     "09_expand.py", "10_lower.py", "11_cleanup.py",
                     "graph_after.json", "graph_before.json", "report.json", "summary.txt", "unlowered.txt"]
    assert "ep_fuse.add_rms_norm" in (graph_dir / "04_canonicalize.py").read_text()
    assert "ep_fuse_triton.add_rms_norm" in (graph_dir / "10_lower.py").read_text()
    assert "rsqrt" in (graph_dir / "01_aten.py").read_text()
    assert (tmp_path / "report.html").is_file()


def test_env_dump_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("EP_FUSE_DUMP_DIR", str(tmp_path))
    assert EpFuseConfig.from_options({}).dump_dir == str(tmp_path)
    assert os.environ["EP_FUSE_DUMP_DIR"] == str(tmp_path)


@pytest.mark.parametrize("executor", ["eager", "inductor"])
def test_the_rewritten_graph_is_what_runs(executor, monkeypatch):
    import ep_fuse.providers.triton.rms_norm_kernel as k

    calls = []
    real = k.launch

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(k, "launch", counting)
    mod = Block().to(BF16)
    x, r = _inputs()
    with torch.no_grad():
        ref = mod(x, r)
        opts = {"executor": executor, "perf_guard": False}
        out = torch.compile(mod, backend="ep_fuse", options=opts)(x, r)
        calls.clear()
        out = torch.compile(mod, backend="ep_fuse", options=opts)(x, r)
    assert len(calls) == 1, "the fused kernel ran exactly once per call"
    torch.testing.assert_close(out.float(), ref.float(), rtol=0.02, atol=0.05)


class MutatesInput(nn.Module):
    """An in-place update of an input (KV-cache style): Inductor runs behind AOT's mutation epilogue."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(64) * 0.1 + 1)

    def forward(self, x, r, cache):
        cache.add_(1)
        hf = (x + r).float()
        return self.weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


@pytest.mark.parametrize("executor", ["eager", "inductor"])
def test_input_mutation_is_replayed(executor):
    mod = MutatesInput().to(BF16)
    x, r = _inputs()
    cache = torch.zeros(4)
    with torch.no_grad():
        ref = mod(x, r, torch.zeros(4))
        out = torch.compile(mod, backend="ep_fuse", options={"executor": executor})(x, r, cache)
    assert torch.equal(cache, torch.ones(4))
    assert ep_fuse.last_report().count("add_rms_norm") == 1
    torch.testing.assert_close(out.float(), ref.float(), rtol=0.02, atol=0.05)


def test_inlined_kernels_use_inductors_static_launcher_unless_turned_off():
    from ep_fuse.backend import STATIC_LAUNCH, inductor_patches

    assert inductor_patches(EpFuseConfig())[STATIC_LAUNCH] is True
    off = EpFuseConfig.from_options({"inductor_config": {STATIC_LAUNCH: False}})
    assert inductor_patches(off)[STATIC_LAUNCH] is False

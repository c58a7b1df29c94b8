"""Options: typed config, validation with helpful messages, and the entry point."""

import dataclasses

import pytest
import torch

import ep_fuse
from ep_fuse.config import ConfigError, EpFuseConfig


def test_defaults():
    cfg = EpFuseConfig.from_options(None)
    assert cfg.executor == "auto" and cfg.patterns is None and cfg.perf_guard
    assert cfg.pattern_enabled("add_rms_norm") and cfg.pattern_enabled("rms_norm")


def test_unknown_option_lists_valid_ones_and_suggests():
    with pytest.raises(ConfigError) as e:
        EpFuseConfig.from_options({"executer": "eager"})
    msg = str(e.value)
    assert "unknown option 'executer'" in msg and "Did you mean 'executor'" in msg
    for name in ("executor", "patterns", "disable", "providers", "perf_guard", "mode", "inductor_config"):
        assert name in msg


@pytest.mark.parametrize(
    "options, fragment",
    [
        ({"executor": "tvm"}, "executor='tvm' is not one of auto, inductor, eager"),
        ({"patterns": ["rmsnorm"]}, "Did you mean 'rms_norm'"),
        ({"disable": "add_rms"}, "Known patterns: moe_experts, moe_gating, add_rms_norm, rms_norm, rope, gemm_swiglu"),
        ({"providers": {"cuda": ["tritonn"]}}, "Did you mean 'triton'"),
        ({"providers": {"tpu": ["triton"]}}, "unknown device 'tpu'"),
        ({"providers": ["triton"]}, "providers must map a device"),
        ({"perf_guard": "yes"}, "perf_guard must be True or False"),
        ({"mode": "fast"}, "mode='fast' is not one of"),
        ({"inductor_config": 3}, "inductor_config must be a dict"),
        ({"inductor_config": {"no_such_knob": 1}}, "unknown Inductor config 'no_such_knob'"),
    ],
)
def test_bad_values(options, fragment):
    with pytest.raises(ConfigError) as e:
        EpFuseConfig.from_options(options)
    assert fragment in str(e.value)


def test_config_is_frozen_and_hashable():
    cfg = EpFuseConfig.from_options({"providers": {"cuda": "reference"}, "disable": ["rms_norm"]})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.executor = "eager"  # type: ignore[misc]
    assert cfg.provider_order("cuda") == ("reference",)
    assert cfg.provider_order("cpu") is None
    assert not cfg.pattern_enabled("rms_norm") and cfg.pattern_enabled("add_rms_norm")
    assert cfg.compute_hash() == EpFuseConfig.from_options({"disable": "rms_norm", "providers": {"cuda": ["reference"]}}).compute_hash()
    hash(cfg)


def test_mode_from_torch_compile_and_options_conflict():
    assert EpFuseConfig.from_options(None, "reduce-overhead").mode == "reduce-overhead"
    assert EpFuseConfig.from_options({"mode": "default"}).mode is None
    with pytest.raises(ConfigError, match="mode given twice"):
        EpFuseConfig.from_options({"mode": "max-autotune"}, "reduce-overhead")


def test_entry_point_resolves_string_backend():
    from torch._dynamo.backends.registry import lookup_backend

    from ep_fuse.backend import ep_fuse_backend

    assert lookup_backend("ep_fuse") is ep_fuse_backend


def test_bad_option_fails_on_first_compile():
    def f(x):
        return x + 1

    compiled = torch.compile(f, backend="ep_fuse", options={"executr": "eager"})
    with pytest.raises(Exception) as e:
        compiled(torch.ones(2))
    assert "unknown option 'executr'" in str(e.value)


def test_make_backend_validates_immediately():
    with pytest.raises(ConfigError):
        ep_fuse.make_backend(executor="nope")
    backend = ep_fuse.make_backend(executor="eager")
    out = torch.compile(lambda x: x * 2, backend=backend)(torch.ones(3))
    assert torch.equal(out, torch.full((3,), 2.0))

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
        ({"inline_in_inductor": "no"}, "inline_in_inductor must be True or False"),
        ({"inline_symbolic": 0}, "inline_symbolic must be True or False"),
        ({"size_branches": "0"}, "size_branches must be True or False"),
        ({"ep_a2a_kernels": None}, "ep_a2a_kernels must be True or False"),
        ({"unverified_kernels": 1}, "unverified_kernels must be True or False"),
        ({"npu_gmm_weight": "transposed"}, "npu_gmm_weight='transposed' is not one of 'copy', 'view'"),
        ({"npu_gmm_weight": True}, "npu_gmm_weight=True is not one of"),
    ],
)
def test_bad_values(options, fragment):
    from ep_fuse.backend import build_config

    with pytest.raises(ConfigError) as e:
        build_config(options)
    assert fragment in str(e.value)


def test_the_config_is_a_leaf_and_names_are_checked_against_given_registries():
    """Importing the config loads no op, provider, engine or pattern; names are checked by ``check_names`` against
    what the caller gives (the backend: the catalog's registries), values at construction."""
    code = ("import sys, ep_fuse.config as c\n"
            "loaded = sorted(m for m in sys.modules if m.startswith('ep_fuse'))\n"
            "assert loaded == ['ep_fuse', 'ep_fuse.config', 'ep_fuse.runtime'], loaded\n"
            "cfg = c.EpFuseConfig.from_options({'patterns': ['x'], 'ep_backend': 'e1'})\n"
            "assert cfg.check_names(patterns=['x'], providers=['reference'], engines=['e1']) is cfg\n"
            "for kw, frag in (({'patterns': ['y']}, \"unknown pattern 'x'\"), ({'engines': ['e2']}, \"'e1' is not one\")):\n"
            "    names = {'patterns': ['x'], 'providers': [], 'engines': ['e1'], **kw}\n"
            "    try:\n"
            "        cfg.check_names(**names)\n"
            "    except c.ConfigError as exc:\n"
            "        assert frag in str(exc), exc\n"
            "    else:\n"
            "        raise AssertionError(kw)\n")
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", code], check=True)


def test_switches_are_declared_once_and_module_switches_are_options():
    from ep_fuse import runtime

    assert issubclass(EpFuseConfig, runtime.Switches)
    own = set(EpFuseConfig.__annotations__)
    assert not own & set(runtime.SWITCHES), "a switch declared twice"
    cfg = EpFuseConfig.from_options({"ep_fp8_dispatch": False, "ep_overlap_rules": ["rule"]})
    assert cfg.ep_fp8_dispatch is False and cfg.ep_overlap_rules == ("rule",)
    assert EpFuseConfig().ep_fp8_dispatch is True and EpFuseConfig().ep_overlap_rules == ()
    with pytest.raises(ConfigError, match="ep_fp8_dispatch must be True or False"):
        EpFuseConfig.from_options({"ep_fp8_dispatch": "no"})


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


# --------------------------------------------------------------------------- behaviour switches
SWITCH_ENV = ("EP_FUSE_DUMP_DIR", "EP_FUSE_SIZE_BRANCHES", "EP_FUSE_UNVERIFIED_KERNELS", "EP_FUSE_NPU_GMM_WEIGHT")


@pytest.fixture
def no_switch_env(monkeypatch):
    for var in SWITCH_ENV:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_switch_defaults_and_cache_key(no_switch_env):
    from ep_fuse.config import ENV_DEFAULTS, SWITCHES

    cfg = EpFuseConfig.from_options({})
    assert (cfg.inline_in_inductor, cfg.inline_symbolic, cfg.size_branches, cfg.ep_a2a_kernels) == (True,) * 4
    assert cfg.unverified_kernels is False and cfg.npu_gmm_weight == "copy" and cfg.dump_dir is None
    assert cfg == EpFuseConfig() and cfg.cache_key() == ""
    assert set(SWITCHES) <= {f.name for f in dataclasses.fields(EpFuseConfig)}
    assert {var for var, _ in ENV_DEFAULTS.values()} == set(SWITCH_ENV)
    # the key names the switches that change how Inductor traces the provider ops; run-time-only ones do not
    assert EpFuseConfig(size_branches=False).cache_key() == "-no-branches"
    assert EpFuseConfig(inline_in_inductor=False, inline_symbolic=False).cache_key() == "-no-inline-symbolic"
    assert EpFuseConfig(unverified_kernels=True, size_branches=False).cache_key() == "-no-branches-unverified"
    assert EpFuseConfig(ep_a2a_kernels=False, npu_gmm_weight="view", perf_guard=False).cache_key() == ""


def test_env_vars_set_the_switch_defaults(no_switch_env, tmp_path):
    mp = no_switch_env
    mp.setenv("EP_FUSE_SIZE_BRANCHES", "0")
    mp.setenv("EP_FUSE_UNVERIFIED_KERNELS", "1")
    mp.setenv("EP_FUSE_NPU_GMM_WEIGHT", "view")
    mp.setenv("EP_FUSE_DUMP_DIR", str(tmp_path))
    cfg = EpFuseConfig.from_options({})
    assert (cfg.size_branches, cfg.unverified_kernels, cfg.npu_gmm_weight, cfg.dump_dir) == (
        False, True, "view", str(tmp_path))
    # an option given explicitly wins over its variable (even over a bad value of it)
    cfg = EpFuseConfig.from_options({"size_branches": True, "unverified_kernels": False, "npu_gmm_weight": "copy"})
    assert (cfg.size_branches, cfg.unverified_kernels, cfg.npu_gmm_weight) == (True, False, "copy")
    mp.setenv("EP_FUSE_NPU_GMM_WEIGHT", "sideways")
    assert EpFuseConfig.from_options({"npu_gmm_weight": "view"}).npu_gmm_weight == "view"
    with pytest.raises(ConfigError, match="EP_FUSE_NPU_GMM_WEIGHT='sideways'"):
        EpFuseConfig.from_options({})
    # the values the variables took before they were options: only 0 turns the branches off, only 1 the
    # unverified kernels on; an empty variable is unset
    for value, branches in (("1", True), ("", True), ("no", True), ("0", False)):
        mp.setenv("EP_FUSE_SIZE_BRANCHES", value)
        mp.setenv("EP_FUSE_UNVERIFIED_KERNELS", value)
        mp.setenv("EP_FUSE_NPU_GMM_WEIGHT", "")
        cfg = EpFuseConfig.from_options({})
        assert (cfg.size_branches, cfg.unverified_kernels, cfg.npu_gmm_weight) == (branches, value == "1", "copy")
    # EpFuseConfig() itself is the plain defaults
    assert EpFuseConfig().unverified_kernels is False


def test_active_config_outside_and_inside_a_compile(no_switch_env):
    from ep_fuse import runtime

    assert runtime.active_config() == runtime.Switches()
    assert all(getattr(runtime.Switches(), n) == getattr(EpFuseConfig(), n) for n in runtime.SWITCHES)
    no_switch_env.setenv("EP_FUSE_SIZE_BRANCHES", "0")  # read when asked, outside any compile
    assert runtime.active_config().size_branches is False
    cfg = EpFuseConfig(ep_a2a_kernels=False)
    with runtime.use_config(cfg):
        assert runtime.active_config() is cfg
        with runtime.use_config(EpFuseConfig()):
            assert runtime.active_config().ep_a2a_kernels
        assert runtime.active_config() is cfg
    assert runtime.active_config().ep_a2a_kernels and runtime.active_config().size_branches is False


_SEEN: list = []


@torch.library.custom_op("ep_fuse_test::switch_probe", mutates_args=())
def _switch_probe(x: torch.Tensor) -> torch.Tensor:
    from ep_fuse import runtime

    _SEEN.append(runtime.active_config().ep_a2a_kernels)
    return x + 1


@_switch_probe.register_fake
def _(x):
    return torch.empty_like(x)


@pytest.mark.parametrize("executor", ["eager", "inductor"])
def test_compiled_graph_runs_under_its_config(executor, no_switch_env):
    """A run-time choice (an op's kernel reading the active config) sees the config the graph was compiled with,
    on every call; outside the call the default applies again."""
    from ep_fuse import runtime

    def f(x):
        return torch.ops.ep_fuse_test.switch_probe(x) * 2

    _SEEN.clear()
    compiled = torch.compile(f, backend="ep_fuse", options={"executor": executor, "ep_a2a_kernels": False})
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(compiled(torch.ones(3)), torch.full((3,), 4.0))
    assert _SEEN and set(_SEEN) == {False}
    assert runtime.active_config().ep_a2a_kernels

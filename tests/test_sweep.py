"""The generality sweep (``ep_fuse.testing.sweep``, ``tools/sweep_models.py``) as a CI check: every MoE causal-LM
family of the installed transformers, built tiny, compiled with ``backend="ep_fuse"`` (eager executor) in fp32, bf16
and fp16.

A family fails on a compile crash inside ep_fuse, on a graph the rewrite had to give up on, on logits that differ
from eager by more than ``RTOL[dtype]`` of their scale, or on fewer routed MoE blocks, or fewer sites of any pattern
in any dtype, than pinned in ``tests/support/sweep_expected.py`` (minimums: more fusion passes). fp32 runs every
provider (the Triton kernels under the interpreter); bf16 and fp16 lower every site to its reference (the same sites,
several times faster on a CPU), so their check is the count and the rewrite's numerics in that dtype. The families in
``FAST`` (``FAST_LOW_PRECISION`` in bf16/fp16) run without a marker. Every other family runs in bf16 (``slow``: in
the test command) and, marked ``slow`` and ``exhaustive``, in fp32 with every provider and in fp16: the test command
leaves those out (CI time), ``pytest -n auto -m exhaustive tests/test_sweep.py`` runs them.
"""

import pytest
import transformers
from packaging.version import Version

from ep_fuse.testing import sweep
from support.sweep_expected import EXPECTED, FAST, FAST_LOW_PRECISION, INDUCTOR_EXECUTOR_CHECKS, installed_sites

pytestmark = pytest.mark.hf

RTOL = {"fp32": 1e-4, "bf16": 1e-2, "fp16": 2e-3}
"""``max |compiled - eager| / max |eager|`` of the logits. bf16/fp16 run the references, which round as the models
do (most families are bitwise eager); the slack covers accumulation-order differences (a top-k sum, a batched GEMM)."""

LOW_PRECISION = ("bf16", "fp16")


def _param(family, fast=FAST):
    return pytest.param(family, marks=() if family in fast else (pytest.mark.slow, pytest.mark.exhaustive))


def _added_later(pin: dict | str) -> str | None:
    """Why a pinned family is not in the installed transformers (its pin's ``since`` is newer), else ``None``."""
    since = pin.get("since") if isinstance(pin, dict) else None
    if since is not None and Version(transformers.__version__) < Version(since):
        return f"added in transformers {since} (installed: {transformers.__version__})"
    return None


def test_every_discovered_family_is_pinned():
    found = set(sweep.discover())
    assert sorted(found - set(EXPECTED)) == [], "new MoE families: pin them in tests/support/sweep_expected.py"
    here = {f for f, pin in EXPECTED.items() if _added_later(pin) is None}
    assert sorted(here - found) == [], "pinned families this transformers no longer has (or a pin's 'since' is wrong)"


def test_a_pin_for_a_newer_transformers_names_a_release():
    for family, pin in EXPECTED.items():
        if isinstance(pin, dict) and "since" in pin:
            assert Version(pin["since"]) > Version("5.24"), f"{family}: 'since' {pin['since']!r} (pins start at 5.24)"


def test_every_pin_names_each_dtype_and_pattern():
    for family, pin in EXPECTED.items():
        if isinstance(pin, str):
            continue
        for counts in (pin, *(pin[k] for k in pin if k[:1].isdigit())):  # the base pin and each release's
            for dt in ("fp32", *LOW_PRECISION):
                assert dt in counts, f"{family}: no {dt} pin (a dict of counts, or 'skip: <why>')"
                if isinstance(counts[dt], dict):
                    assert set(sweep.PINNED) <= set(counts[dt]), f"{family} {dt}: pin {sorted(sweep.PINNED)} (0 incl.)"


def test_shrinking_keeps_every_kind_of_layer():
    lists = {"layer_types": ["linear", "linear", "linear", "full"] * 3, "mlp_layer_types": ["dense"] + ["moe"] * 11}
    assert sweep._keep_layers(lists, 12) == [0, 1, 3]


@pytest.mark.parametrize("default, tiny, value, want", [
    (256, 16, 512, 32),  # Gemma-4's full-attention head dim: twice the global one, twice the tiny one
    (128, 4, 64, 2),     # half the heads
    (128, 16, 192, 16),  # 1.5x: no whole factor, the tiny value
    (128, 16, 128, 16),  # the global value
    (None, None, 7, 7),  # a size the sweep does not shrink
])
def test_per_layer_values_shrink_by_their_factor(default, tiny, value, want):
    assert sweep._tiny_layer_value(default, tiny, value) == want


def test_heterogeneous_configs_build_tiny_per_layer():
    """Gemma-4 (per-layer ``head_dim``) and Dots-3-Note (per-layer heads and ranks): the global values read through
    transformers' heterogeneous config, the kept layers' own values shrunk by the same factor."""
    cfg = sweep.tiny_config("gemma4")
    assert cfg.layer_types == ["sliding_attention", "full_attention"]
    assert [cfg.per_layer_config[i].head_dim for i in range(2)] == [16, 32]
    cfg = sweep.tiny_config("dots3_note")
    heads = [cfg.per_layer_config[i].num_attention_heads for i in range(cfg.num_hidden_layers)]
    kinds = dict(zip(cfg.layer_types, heads))
    assert kinds == {"indexed_attention": 4, "sliding_attention": 2}, (cfg.layer_types, heads)


def _check(family, res, dtype, pin):
    run = res.run("ep_fuse/eager", dtype)
    assert run is not None, f"{family} {dtype} did not run: {res.skip}"
    assert run.error is None, f"ep_fuse crashed on {family} in {dtype}: {run.error}"
    assert not run.fallbacks, run.fallbacks
    close = run.rel is not None and run.rel <= RTOL[dtype]
    if dtype == "fp32" and "known_mismatch" in pin:  # strict: a fix shows up at once
        assert not close, f"{family} matches eager now: drop known_mismatch from its pin"
        pytest.xfail(f"{pin['known_mismatch']} (max |Δ| {run.max_abs:.2e})")
    assert close, f"{family}: {dtype} max |Δ| {run.max_abs:.2e} ({run.rel:.2e} of the logits' scale) vs eager"
    assert res.moe_blocks >= pin["moe_blocks"], f"{family}: {res.moe_blocks} routed MoE blocks, pinned {pin['moe_blocks']}"
    lost = {k: (run.counts.get(k, 0), v) for k, v in installed_sites(pin, dtype).items() if run.counts.get(k, 0) < v}
    assert not lost, f"{family} {dtype}: fewer sites than pinned (got, pinned): {lost}; all sites {run.counts}"


@pytest.mark.parametrize("family", [_param(f) for f in sorted(EXPECTED)])
def test_sweep_family(family):
    """fp32, every provider: the sites pinned, the logits within ``RTOL`` of eager."""
    pin = EXPECTED[family]
    if _added_later(pin):
        pytest.skip(_added_later(pin))
    res = sweep.sweep_family(family, ("fp32",), executor="eager")
    if isinstance(pin, str):
        assert not res.built, f"{family} builds now (it was {pin!r}): pin its counts"
        pytest.skip(pin)
    assert res.built, f"{family} no longer builds tiny: {res.skip}"
    _check(family, res, "fp32", pin)


def _low_precision_param(family, dtype):
    """``FAST_LOW_PRECISION`` without a marker; bf16 (the dtype models are served in, every site on its reference: the
    cheapest compile) ``slow`` for every other family; fp16 there ``slow`` and ``exhaustive`` (every fp16 pin equals
    the bf16 pin today)."""
    if family in FAST_LOW_PRECISION:
        marks = ()
    elif dtype == "bf16":
        marks = pytest.mark.slow
    else:
        marks = (pytest.mark.slow, pytest.mark.exhaustive)
    return pytest.param(family, dtype, marks=marks, id=f"{family}-{dtype}")


@pytest.mark.parametrize("family, dtype", [_low_precision_param(f, dt) for dt in LOW_PRECISION for f in sorted(EXPECTED)])
def test_sweep_family_in_bf16_and_fp16(family, dtype):
    """bf16 and fp16 (where the family runs in it), every site lowered to its reference: no site of any pattern lost
    against the pin of that dtype, the logits within that dtype's ``RTOL`` of eager."""
    pin = EXPECTED[family]
    if isinstance(pin, str):
        pytest.skip(pin)
    if _added_later(pin):
        pytest.skip(_added_later(pin))
    if not isinstance(pin[dtype], dict):
        pytest.skip(f"{family}: {pin[dtype]}")  # (no family today)
    res = sweep.sweep_family(family, (dtype,), executor="eager", providers={dtype: sweep.REFERENCE_ONLY})
    assert res.built, f"{family} no longer builds tiny: {res.skip}"
    _check(family, res, dtype, pin)


@pytest.mark.slow
@pytest.mark.parametrize("family", INDUCTOR_EXECUTOR_CHECKS)
def test_the_inductor_executor_compiles_and_stays_within_inductors_error(family):
    """bf16 under ``executor="inductor"``: no crash, no fallback, and the logits no further from eager than 1.5x
    what ``backend="inductor"`` gives (plus one bf16 ulp of the logits' scale, for an exact Inductor)."""
    res = sweep.sweep_family(family, ("bf16",), executor="inductor", inductor=True)
    ours, theirs = res.run("ep_fuse/inductor", "bf16"), res.run("inductor", "bf16")
    assert ours.error is None and not ours.fallbacks, ours.error or ours.fallbacks
    assert theirs.error is None, theirs.error
    assert ours.rel <= 1.5 * theirs.rel + 2**-8, (ours.rel, theirs.rel)

"""The generality sweep (``ep_fuse.models.sweep``, ``tools/sweep_models.py``) as a CI check: every MoE causal-LM
family of the installed transformers, built tiny, compiled with ``backend="ep_fuse"`` (eager executor, fp32).

A family fails on a compile crash inside ep_fuse, on a graph the rewrite had to give up on, on fp32 logits that
differ from eager by more than ``RTOL`` of their scale, or on fewer routed MoE blocks / ``moe_experts`` /
``moe_gating`` sites than pinned in ``tests/support/sweep_expected.py`` (minimums: more fusion passes). The
families in ``FAST`` run by default; the rest are marked ``slow`` (``pytest -m slow tests/test_sweep.py``).
"""

import pytest

from ep_fuse.models import sweep
from support.sweep_expected import EXPECTED, FAST, INDUCTOR_EXECUTOR_CHECKS

pytestmark = pytest.mark.hf

RTOL = 1e-4


def _param(family):
    return pytest.param(family, marks=() if family in FAST else pytest.mark.slow)


def test_every_discovered_family_is_pinned():
    found = set(sweep.discover())
    assert sorted(found - set(EXPECTED)) == [], "new MoE families: pin them in tests/support/sweep_expected.py"
    assert sorted(set(EXPECTED) - found) == [], "pinned families this transformers no longer has"


def test_shrinking_keeps_every_kind_of_layer():
    lists = {"layer_types": ["linear", "linear", "linear", "full"] * 3, "mlp_layer_types": ["dense"] + ["moe"] * 11}
    assert sweep._keep_layers(lists, 12) == [0, 1, 3]


@pytest.mark.parametrize("family", [_param(f) for f in sorted(EXPECTED)])
def test_sweep_family(family):
    pin = EXPECTED[family]
    res = sweep.sweep_family(family, ("fp32",), executor="eager")
    if isinstance(pin, str):
        assert not res.built, f"{family} builds now (it was {pin!r}): pin its counts"
        pytest.skip(pin)
    assert res.built, f"{family} no longer builds tiny: {res.skip}"
    run = res.run("ep_fuse/eager", "fp32")
    assert run.error is None, f"ep_fuse crashed on {family}: {run.error}"
    assert not run.fallbacks, run.fallbacks
    close = run.rel is not None and run.rel <= RTOL
    if "known_mismatch" in pin:  # strict: a fix shows up at once
        assert not close, f"{family} matches eager now: drop known_mismatch from its pin"
        pytest.xfail(f"{pin['known_mismatch']} (max |Δ| {run.max_abs:.2e})")
    assert close, f"{family}: fp32 max |Δ| {run.max_abs:.2e} ({run.rel:.2e} of the logits' scale) vs eager"
    got = {"moe_blocks": res.moe_blocks, **{k: run.counts.get(k, 0) for k in sweep.MOE_SITES}}
    lost = {k: (got[k], v) for k, v in pin.items() if k in got and got[k] < v}
    assert not lost, f"{family}: fewer than pinned (got, pinned): {lost}; all sites {run.counts}"


@pytest.mark.slow
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

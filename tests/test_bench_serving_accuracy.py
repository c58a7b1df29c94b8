"""``bench/bench_serving.py``'s teacher-forced accuracy: the prefixes it builds and how it scores them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

_PATH = Path(__file__).resolve().parents[1] / "bench" / "bench_serving.py"


@pytest.fixture(scope="module")
def bench():
    """The bench module as ``python bench/bench_serving.py`` loads it: its folder first on ``sys.path`` (for
    ``hf_models``), only while it is imported."""
    spec = importlib.util.spec_from_file_location("bench_serving_under_test", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(_PATH.parent))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(_PATH.parent))
    return mod


def out(tokens, logprobs):
    return SimpleNamespace(generated_tokens=list(tokens), logprobs=list(logprobs))


def test_forced_requests_extend_prompts_by_eagers_tokens_at_each_cut(bench):
    reqs = [([1, 2], 8), ([3], 4), ([5, 6, 7], 4)]
    ref = {0: out([10, 11, 12, 13], [0.0] * 4), 2: out([20, 21], [0.0] * 2)}
    forced = bench.forced_requests(reqs, ref, n=16, cuts=(0.0, 0.5, 0.75))
    assert forced == [([1, 2], 2), ([1, 2, 10, 11], 2), ([1, 2, 10, 11, 12], 2),
                      ([5, 6, 7], 2), ([5, 6, 7, 20], 2), ([5, 6, 7, 20], 2)]
    assert len(bench.forced_requests(reqs, ref, n=1)) == 4  # the first n eager outputs only


def test_forced_accuracy_counts_flips_and_stops_at_the_first(bench):
    ref = {0: out([1, 2], [-0.5, -1.0]), 1: out([3, 4], [-0.2, -0.3]), 2: out([5, 6], [-1.0, -2.0])}
    outs = {0: out([1, 2], [-0.25, -1.5]),  # both agree: differences 0.25 and 0.5
            1: out([9, 4], [-0.2, -0.3]),   # first token flips: the second saw another prefix, not compared
            2: out([5, 7], [-1.0, -9.0])}   # second flips: the first (0.0) counts
    acc = bench.forced_accuracy(outs, ref)
    assert acc["forced_steps"] == 5 and acc["forced_flips"] == 2
    assert acc["forced_logprob_diff_max"] == pytest.approx(0.5)
    assert acc["forced_logprob_diff_mean"] == pytest.approx(0.75 / 3)


def test_forced_cell_reports_the_mean_as_a_multiple_of_hfs(bench):
    hf = dict(model="m", mode="hf", forced_steps=10, forced_flips=1, forced_logprob_diff_max=0.1,
              forced_logprob_diff_mean=0.02)
    ep = dict(model="m", mode="ep_fuse+graphs", forced_steps=10, forced_flips=0, forced_logprob_diff_max=0.05,
              forced_logprob_diff_mean=0.01)
    assert bench.forced_cell(ep, [hf, ep]) == "0/10, 5.00e-02 / 1.00e-02 (0.50x)"
    assert bench.forced_cell(dict(model="m", mode="eager"), [hf]) is None

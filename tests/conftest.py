"""Test setup: the Triton interpreter on CPU machines (before any kernel module is imported), one share of the
cores per ``pytest -n`` worker, and quiet Dynamo. On a CUDA machine the kernels run for real (``tests/gpu``)."""

import os
import warnings

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:  # pytest -n N: the cores shared by N workers, not N x all of them
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

import pytest  # noqa: E402

import ep_fuse.catalog  # noqa: E402,F401  (every op, provider and engine, as the backend loads them)

warnings.filterwarnings("ignore", message=".*functools.lru_cache.*")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch and sees only its own reports."""
    import ep_fuse

    torch._dynamo.reset()
    ep_fuse.reset_reports()
    yield
    torch._dynamo.reset()


@pytest.fixture
def torch_npu_double(monkeypatch):
    """``import torch_npu`` yields the test double of the documented op semantics (``support/npu_double.py``),
    bound to torch_npu's real op schemas and meta functions (``support/npu_conformance.py``; skips when the pinned
    wheel is unavailable). A provider kernel that raises fails the test instead of falling back to the reference."""
    import sys

    from support import npu_conformance
    from support import npu_double

    npu_conformance.require()

    from ep_fuse.ops import registry
    from ep_fuse.providers.npu import provider as npu_provider

    warn_once = registry._warn_once

    def no_silent_fallback(provider: str, op: str, error: str) -> None:
        if provider == "npu":  # a call that does not bind to the schema must fail the test, not run the reference
            raise AssertionError(f"the npu provider of {op} raised ({error}) and would fall back to the reference")
        warn_once(provider, op, error)

    monkeypatch.setattr(registry, "_warn_once", no_silent_fallback)
    monkeypatch.setitem(sys.modules, "torch_npu", npu_double.make_module())
    npu_provider.available.cache_clear()
    yield
    npu_provider.available.cache_clear()

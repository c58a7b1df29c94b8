"""Test setup: the Triton interpreter on CPU machines (before any kernel module is imported) and quiet
Dynamo. On a CUDA machine the kernels run for real (``tests/gpu``)."""

import os
import warnings

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

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
    """``import torch_npu`` yields the test double of the documented op semantics (``npu_double.py``)."""
    import sys

    import npu_double

    from ep_fuse.providers import npu

    monkeypatch.setitem(sys.modules, "torch_npu", npu_double.make_module())
    npu._available.cache_clear()
    yield
    npu._available.cache_clear()

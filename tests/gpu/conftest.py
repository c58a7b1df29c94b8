"""GPU checks (README, "Run on a GPU"): skipped without CUDA; multi-GPU ones need the GPU count they name.

Run on a GPU machine: ``python -m pytest -q tests/gpu`` (with ``deep_ep`` on ``PYTHONPATH`` for the
DeepEP checks; ``tools/build_deepep.sh`` builds it)."""

import os
import sys

import pytest
import torch

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_k] = _v  # NVLink multicast stays off in every process these tests start

sys.path.insert(0, os.path.dirname(__file__))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "tests/gpu" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)

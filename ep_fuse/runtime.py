"""Facts about the run-time environment that several layers ask (a leaf: it imports nothing of the package).

* :func:`active_config`: the :class:`~ep_fuse.config.EpFuseConfig` whose behaviour switches apply now: the one
  :func:`use_config` set (the backend sets a graph's config while it rewrites and compiles the graph, and
  around every call of the compiled graph), else the default config with its environment-variable defaults.
* :func:`triton_interpret`: whether Triton kernels run under its CPU interpreter (``TRITON_INTERPRET=1``, which
  must be set before the first kernel is defined).
* ``torch_npu`` for every Ascend code path (op providers, EP): whether it can be used (asked once), and which
  torch_npu release the op contracts of those paths were checked against.

No Ascend hardware runs in this project's tests. What is checked instead (``tests/test_npu_conformance.py``,
``docs/npu.md``): every ``torch_npu.npu_*`` call the providers and the EP engine make is bound to the op's
real schema (``npu_native_functions_by_codegen.yaml``) and run under ``FakeTensorMode`` through torch_npu's
own meta function (``op_plugin/meta/_meta_registrations.py``), both read from the wheel of
:data:`TORCH_NPU_CONTRACT_VERSION`. Compile reports list each torch_npu op a graph calls with that version
(``GraphReport.contracts``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ep_fuse.config import EpFuseConfig


def triton_interpret() -> bool:
    """Whether Triton runs under its CPU interpreter (``TRITON_INTERPRET=1``): its kernels then run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


TORCH_NPU_CONTRACT_VERSION = "2.14.0"
"""The torch_npu release whose schemas and meta functions the NPU calls were checked against."""

CHECKED_AGAINST = f"torch_npu {TORCH_NPU_CONTRACT_VERSION}"


@functools.lru_cache(maxsize=1)
def npu_available() -> str | None:
    """``None`` when ``torch_npu`` imports, else why not (one cached answer; ``cache_clear`` re-asks)."""
    try:
        importlib.import_module("torch_npu")
    except Exception as exc:  # ImportError, or a CANN library missing
        return f"torch_npu cannot be imported ({type(exc).__name__}: {exc}); install torch_npu with CANN"
    return None


def torch_npu() -> Any:
    return importlib.import_module("torch_npu")


def npu_contracts(*ops: str) -> dict[str, str]:
    """``{op: "torch_npu X.Y.Z"}`` for the torch_npu ops one provider calls (the compile report shows them)."""
    return dict.fromkeys(ops, CHECKED_AGAINST)


ACTIVE_CONFIG: contextvars.ContextVar[EpFuseConfig | None] = contextvars.ContextVar("ep_fuse_config", default=None)
"""The config :func:`use_config` set (``None``: none)."""


@contextlib.contextmanager
def use_config(config: EpFuseConfig) -> Iterator[EpFuseConfig]:
    """Make ``config``'s switches the ones :func:`active_config` returns in this context (this thread/task)."""
    token = ACTIVE_CONFIG.set(config)
    try:
        yield config
    finally:
        ACTIVE_CONFIG.reset(token)


def active_config() -> EpFuseConfig:
    """The config set by :func:`use_config`, else :func:`ep_fuse.config.default_config` (the field defaults
    with the environment variables' defaults applied, read now)."""
    config = ACTIVE_CONFIG.get()
    if config is not None:
        return config
    from ep_fuse.config import default_config  # (the config module imports the whole package)

    return default_config()

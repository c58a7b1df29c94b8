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
import dataclasses
import functools
import importlib
import os
from collections.abc import Callable, Collection, Iterator
from typing import Any



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


@dataclasses.dataclass(frozen=True)
class Switches:
    """The behaviour switches run-time code reads, declared once: :class:`ep_fuse.config.EpFuseConfig` inherits
    them (they are options too). Outside a compile, run-time code sees these defaults with the environment's applied.

    Defaults from the environment variables of :data:`ENV_DEFAULTS` where set; each applies while the backend
    rewrites and compiles a graph and while the compiled graph runs (the graph's config, :func:`use_config`).

    Attributes:
        inline_in_inductor: Inductor inlines the Triton providers' launches (``wrap_triton``) where it can;
            ``False`` keeps the opaque ``ep_fuse_triton`` op everywhere.
        inline_symbolic: the launches of the ops registered ``symbolic=True`` are inlined at symbolic sizes
            too (``dynamic=True``; the unbacked batch of ``ep_fuse.dynamic_batch``).
        size_branches: the ``<op>_by_size`` choice is traced as ``torch.cond`` branches on the row count;
            ``False`` keeps the opaque ``<op>_by_size`` op, which chooses per call in Python
            (also ``EP_FUSE_SIZE_BRANCHES=0``).
        ep_a2a_kernels: the local work of the rank-layout EP engines (``all_to_all``'s routing, pack, unpack
            and combine sum; ``symm_mem``'s combine sum) runs as Triton kernels wherever Triton runs;
            ``False``: always the pure-torch reference (same bytes).
        unverified_kernels: kernel variants not yet cleared for GPUs
            (:data:`ep_fuse.providers.triton.unverified.UNVERIFIED_ON_GPU`) run on CUDA anyway
            (also ``EP_FUSE_UNVERIFIED_KERNELS=1``).
        npu_gmm_weight: the [E, K, N] weight of ``npu_grouped_matmul``: ``"copy"`` (a contiguous transposed
            copy made once per weight) or ``"view"`` (the transposed view; also ``EP_FUSE_NPU_GMM_WEIGHT``).
    """

    inline_in_inductor: bool = True
    inline_symbolic: bool = True
    size_branches: bool = True
    ep_a2a_kernels: bool = True
    unverified_kernels: bool = False
    npu_gmm_weight: str = "copy"


SWITCHES = tuple(f.name for f in dataclasses.fields(Switches))
NPU_GMM_WEIGHTS = ("copy", "view")


def _env_size_branches(value: str) -> bool:
    return value != "0"


def _env_flag(value: str) -> bool:
    return value == "1"


def _env_str(value: str) -> str:
    return value


ENV_DEFAULTS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "dump_dir": ("EP_FUSE_DUMP_DIR", _env_str),
    "size_branches": ("EP_FUSE_SIZE_BRANCHES", _env_size_branches),
    "unverified_kernels": ("EP_FUSE_UNVERIFIED_KERNELS", _env_flag),
    "npu_gmm_weight": ("EP_FUSE_NPU_GMM_WEIGHT", _env_str),
}
"""Config field -> (environment variable that sets its default, parser). Read when a config is built
(:meth:`ep_fuse.config.EpFuseConfig.from_options`) and by :func:`active_config` outside a compile; an option given
explicitly wins. An unset or empty variable leaves the field's default. ``EP_FUSE_SIZE_BRANCHES``: ``0`` turns the
branches off; ``EP_FUSE_UNVERIFIED_KERNELS``: ``1`` turns the variants on. (``EP_FUSE_LOG`` is diagnostic only:
:mod:`ep_fuse.log`.)"""


def env_defaults(skip: Collection[str] = ()) -> dict[str, Any]:
    """The option values the environment variables of :data:`ENV_DEFAULTS` set now (but for the fields in ``skip``,
    given explicitly). Raises ``ValueError`` for a value no field takes."""
    out: dict[str, Any] = {}
    for field, (var, parse) in ENV_DEFAULTS.items():
        value = None if field in skip else os.environ.get(var)
        if value:
            out[field] = parse(value)
    if "npu_gmm_weight" in out and out["npu_gmm_weight"] not in NPU_GMM_WEIGHTS:
        raise ValueError(f"ep_fuse: {ENV_DEFAULTS['npu_gmm_weight'][0]}={out['npu_gmm_weight']!r}: use "
                         f"{' or '.join(repr(m) for m in NPU_GMM_WEIGHTS)}.")
    return out


@functools.lru_cache(maxsize=8)
def _env_switches(_env: tuple[str | None, ...]) -> Switches:
    values = env_defaults()
    return Switches(**{k: v for k, v in values.items() if k in SWITCHES})


ACTIVE_CONFIG: contextvars.ContextVar[Any] = contextvars.ContextVar("ep_fuse_config", default=None)
"""The config :func:`use_config` set (``None``: none)."""


@contextlib.contextmanager
def use_config(config: Any) -> Iterator[Any]:
    """Make ``config``'s switches (an :class:`~ep_fuse.config.EpFuseConfig`, or :class:`Switches`) the ones
    :func:`active_config` returns in this context (this thread/task)."""
    token = ACTIVE_CONFIG.set(config)
    try:
        yield config
    finally:
        ACTIVE_CONFIG.reset(token)


def active_config() -> Any:
    """The config set by :func:`use_config`, else the default :class:`Switches` with the environment variables'
    defaults applied (read now). Either has every field of :class:`Switches`."""
    config = ACTIVE_CONFIG.get()
    if config is not None:
        return config
    return _env_switches(tuple(os.environ.get(var) for var, _parse in ENV_DEFAULTS.values()))

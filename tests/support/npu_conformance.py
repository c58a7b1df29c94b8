"""torch_npu's own op contracts on the CPU, for the Ascend tests (test support, not library code).

``import torch_npu`` needs the CANN runtime, so nothing here imports it. The pinned wheel
(``torch_npu==TORCH_NPU_CONTRACT_VERSION``, fetched once with ``pip download`` into a cache) ships

* ``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml``: the ``func:`` schema of every op;
* ``torch_npu/op_plugin/meta/_meta_registrations.py``: their meta (shape / dtype) functions;
* ``torch_npu/_op_plugin_docs.py``: their documentation.

:func:`define` defines ``npu::<op>`` on a CPU ``torch.library`` fragment from the real schema (the namespace
torch_npu itself uses, so ``torch.ops.npu.<op>`` is the very object ``torch_npu.<op>`` is bound to) and
registers torch_npu's meta function as its Meta kernel, which ``FakeTensorMode`` runs. The meta file is
executed statement by statement with small stand-ins for its imports (``torch.library.impl`` records the
function instead of registering it; ``torch_npu`` and its error-code / SoC helpers are shims); a statement
that still fails is kept in :attr:`Contracts.meta_failures` with its reason. :func:`register_cpu` makes a
test double the op's CPU kernel, so a call binds to the real schema (argument names, keyword-only
arguments, defaults, output arity) before the double's numerics run.

The wheel: ``$EP_FUSE_TORCH_NPU_WHEEL`` (a downloaded ``.whl``), else the cache
``$EP_FUSE_CACHE_DIR/torch_npu-<version>/`` (default ``~/.cache/ep_fuse/``), else ``pip download`` into it.
When none works, :func:`require` skips the calling test with the reason (it never passes silently).
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import types
import warnings
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from ep_fuse.runtime import TORCH_NPU_CONTRACT_VERSION

VERSION = TORCH_NPU_CONTRACT_VERSION
WHEEL_ENV = "EP_FUSE_TORCH_NPU_WHEEL"
CACHE_ENV = "EP_FUSE_CACHE_DIR"
SCHEMA_FILE = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
META_FILE = "torch_npu/op_plugin/meta/_meta_registrations.py"
DOCS_FILE = "torch_npu/_op_plugin_docs.py"
VERSION_FILE = "torch_npu/version.py"
PIP_PLATFORM = ("--python-version", "3.12", "--platform", "manylinux_2_28_x86_64", "--only-binary=:all:")
"""Any published build holds the same three text files; one fixed target keeps the download independent
of the interpreter running the tests."""
DOWNLOAD_TIMEOUT_S = 300


class Unavailable(RuntimeError):
    """The pinned torch_npu wheel could not be found or fetched."""


# --------------------------------------------------------------------------- the wheel
def cache_dir() -> Path:
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "ep_fuse")
    return root / f"torch_npu-{VERSION}"


def _explain(why: str) -> Unavailable:
    return Unavailable(
        f"torch_npu {VERSION} wheel unavailable ({why}); the Ascend contract checks need its op schemas and "
        f"meta functions: let `pip download` reach PyPI, or set {WHEEL_ENV} to a downloaded "
        f"torch_npu-{VERSION}-*.whl"
    )


@functools.lru_cache(maxsize=1)
def wheel() -> Path:
    """Path of the pinned wheel: ``$EP_FUSE_TORCH_NPU_WHEEL``, the cache, or a fresh ``pip download``."""
    env = os.environ.get(WHEEL_ENV)
    if env:
        if not Path(env).is_file():
            raise _explain(f"{WHEEL_ENV}={env} is not a file")
        return Path(env)
    cache = cache_dir()
    hits = sorted(cache.glob(f"torch_npu-{VERSION}-*.whl"))
    if hits:
        return hits[0]
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="download-", dir=cache))
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
               f"torch_npu=={VERSION}", *PIP_PLATFORM, "-d", str(tmp)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S,
                                  check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise _explain(f"pip download failed: {exc}") from exc
        got = sorted(tmp.glob("torch_npu-*.whl"))
        if done.returncode != 0 or not got:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no wheel written"]
            raise _explain(f"pip download exited {done.returncode}: {tail[0]}")
        target = cache / got[0].name
        os.replace(got[0], target)  # atomic: concurrent test processes never see a partial wheel
        return target
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------- reading it
@dataclasses.dataclass(repr=False)
class Contracts:
    version: str
    """``__version__`` from the wheel's ``torch_npu/version.py``."""
    schemas: dict[str, str]
    """``"name"`` / ``"name.overload"`` -> the full schema string (``name(args) -> returns``)."""
    meta: dict[str, Callable[..., Any]]
    """Op name (as registered by ``@impl(m, name)``) -> torch_npu's meta function."""
    meta_failures: dict[str, str]
    """Top-level statements of the meta file that could not run here -> why (``"line N (what)"``)."""
    docs: dict[str, str]
    """Op name -> its documentation text."""

    def __repr__(self) -> str:
        return (f"Contracts(torch_npu {self.version}: {len(self.schemas)} schemas, {len(self.meta)} meta functions, "
                f"{len(self.meta_failures)} statements not loaded)")

    def schema(self, op: str) -> str:
        if op not in self.schemas:
            raise KeyError(f"torch_npu {self.version} has no op {op!r} in {SCHEMA_FILE}")
        return self.schemas[op]

    def meta_for(self, op: str) -> Callable[..., Any]:
        fn = self.meta.get(op) or self.meta.get(op.split(".")[0])
        if fn is None:
            raise KeyError(f"torch_npu {self.version} registers no meta function for {op!r} in {META_FILE}"
                           f"{self._failure_note(op)}")
        return fn

    def _failure_note(self, op: str) -> str:
        hits = [f"{k}: {v}" for k, v in self.meta_failures.items() if op.split(".")[0] in k]
        return f" (failed to load: {'; '.join(hits)})" if hits else ""


def _schemas(text: str) -> dict[str, str]:
    """``func:`` entries of the codegen YAML (one per line); a name listed twice must carry one schema."""
    out: dict[str, str] = {}
    for m in re.finditer(r"^\s*-?\s*func:\s*(\S.*?)\s*$", text, re.MULTILINE):
        schema = m.group(1)
        name = schema.split("(", 1)[0]
        if out.setdefault(name, schema) != schema:
            raise ValueError(f"{SCHEMA_FILE}: {name} has two schemas:\n  {out[name]}\n  {schema}")
    return out


def _parse(source: str) -> ast.Module:
    """torch_npu's files hold docstrings with invalid escapes (``'\\s'``): parse them without the warnings."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", (DeprecationWarning, SyntaxWarning))
        return ast.parse(source)


def _docs(source: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for node in ast.walk(_parse(source)):
        if (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "_add_torch_npu_docstr"
                and len(node.args) == 2 and all(isinstance(a, ast.Constant) for a in node.args)):
            out[node.args[0].value] = node.args[1].value
    return out


class _AnyCode:
    """``ErrCode.VALUE`` etc.: the name itself."""

    def __getattr__(self, name: str) -> str:
        return name


def _no_runtime(name: str) -> Callable[..., Any]:
    def call(*_args: Any, **_kwargs: Any) -> Any:
        raise NotImplementedError(f"{name} needs the Ascend runtime (not available to the conformance checks)")

    return call


def _load_meta(source: str) -> tuple[dict[str, Callable[..., Any]], dict[str, str]]:
    """Run the meta file with shims for its imports; ``({op: meta fn}, {statement: why it failed})``."""
    registered: dict[str, Callable[..., Any]] = {}
    failures: dict[str, str] = {}

    class Library:  # records the namespace; nothing is registered with torch
        def __init__(self, ns: str, kind: str, key: str = "") -> None:
            self.ns = ns

    def impl(lib: Library, name: str, *_a: Any, **_k: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def record(fn: Callable[..., Any]) -> Callable[..., Any]:
            if lib.ns == "npu":
                registered.setdefault(name, fn)
            return fn

        return record

    torch_npu = types.ModuleType("torch_npu")  # dtype constants are filled in below
    shims = {
        "torch_npu": torch_npu,
        "torch.library": types.SimpleNamespace(Library=Library, impl=impl),
        "torch.fx.node": types.SimpleNamespace(has_side_effect=lambda *_a: None),
        "torch_npu.utils._error_code": types.SimpleNamespace(
            ErrCode=_AnyCode(), ops_error=lambda code, *_a: f" (torch_npu error code {code})"),
        "torch_npu.npu.utils": types.SimpleNamespace(get_cann_version=_no_runtime("get_cann_version")),
        "torch_npu.npu._backends": types.SimpleNamespace(get_soc_version=_no_runtime("get_soc_version")),
    }

    def shimmed_import(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
        if level == 0 and name in shims and (fromlist or "." not in name):
            return shims[name]
        if level == 0 and name.split(".")[0] == "torch_npu":
            raise ImportError(f"no shim for {name} (torch_npu is not imported)")
        return builtins.__import__(name, globals, locals, fromlist, level)

    scope: dict[str, Any] = {"__name__": "torch_npu_meta_registrations",
                             "__builtins__": {**vars(builtins), "__import__": shimmed_import}}
    for node in _parse(source).body:
        try:
            exec(compile(ast.Module([node], []), META_FILE, "exec"), scope)  # noqa: S102 - torch_npu's own file
        except Exception as exc:  # noqa: BLE001 - one statement: the rest still loads
            what = getattr(node, "name", type(node).__name__)
            failures[f"line {node.lineno} ({what})"] = f"{type(exc).__name__}: {exc}"
    for enum, name in scope.get("TORCH_NPU_DTYPE_TO_STRING_MAP", {}).items():  # torch_npu.hifloat8 == 290, ...
        setattr(torch_npu, name.split(".")[-1], enum)
    return registered, failures


_FAILED: list[Unavailable] = []


def contracts() -> Contracts:
    """The schemas, meta functions and docs of the pinned wheel (raises :class:`Unavailable`; a failure is
    remembered, so an offline run tries the download once, not once per test)."""
    if _FAILED:
        raise _FAILED[0]
    try:
        return _read()
    except Unavailable as exc:
        _FAILED.append(exc)
        raise


@functools.lru_cache(maxsize=1)
def _read() -> Contracts:
    path = wheel()
    try:
        with zipfile.ZipFile(path) as z:
            text = {f: z.read(f).decode("utf-8") for f in (SCHEMA_FILE, META_FILE, DOCS_FILE, VERSION_FILE)}
    except (OSError, KeyError, zipfile.BadZipFile) as exc:
        raise _explain(f"{path} cannot be read: {exc}") from exc
    version = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", text[VERSION_FILE])
    meta, failures = _load_meta(text[META_FILE])
    return Contracts(version.group(1) if version else "?", _schemas(text[SCHEMA_FILE]), meta, failures,
                     _docs(text[DOCS_FILE]))


def require() -> Contracts:
    """:func:`contracts`, or skip the calling test with the reason the wheel is unavailable."""
    import pytest

    try:
        return contracts()
    except Unavailable as exc:
        pytest.skip(str(exc))


# --------------------------------------------------------------------------- torch.ops.npu
_LIB: torch.library.Library | None = None
_DEFINED: set[str] = set()
_CPU: dict[str, Callable[..., Any]] = {}


def define(ops: Iterable[str]) -> None:
    """Define each ``npu::<op>`` (``name`` or ``name.overload``) from its torch_npu schema, with torch_npu's
    meta function as its Meta kernel (once per process)."""
    global _LIB
    c = contracts()
    for op in ops:
        if op in _DEFINED:
            continue
        if _LIB is None:
            _LIB = torch.library.Library("npu", "FRAGMENT")
        _LIB.define(c.schema(op))
        _LIB.impl(op, c.meta_for(op), "Meta")
        _DEFINED.add(op)


def register_cpu(op: str, kernel: Callable[..., Any]) -> None:
    """Make ``kernel`` (a test double) the CPU kernel of ``npu::<op>``: the dispatcher binds every call to the
    real schema first and passes the kernel what torch_npu's kernel would get (``ScalarType`` arguments
    declared ``int`` arrive as their enum value, defaulted keyword-only arguments are left out)."""
    define([op])
    if op in _CPU:
        if _CPU[op] is not kernel:
            raise RuntimeError(f"npu::{op} already has another CPU kernel in this process")
        return
    assert _LIB is not None
    _LIB.impl(op, kernel, "CPU")
    _CPU[op] = kernel


def bound(kernels: dict[str, Callable[..., Any]]) -> dict[str, Any]:
    """Register ``{op: double}`` as CPU kernels; ``{op: torch.ops.npu.<op>}`` (what ``torch_npu.<op>`` is)."""
    for op, kernel in kernels.items():
        register_cpu(op, kernel)
    return {op: getattr(torch.ops.npu, op.split(".")[0]) for op in kernels}


SCALAR_TYPES = {5: torch.float16, 15: torch.bfloat16, 6: torch.float32, 3: torch.int32, 1: torch.int8,
                4: torch.int64}
"""c10 ``ScalarType`` enum values an ``int? *_dtype`` argument carries (``torch.bfloat16`` binds as 15)."""


def scalar_type(value: Any) -> torch.dtype | None:
    """The dtype an ``int?`` dtype argument names (doubles also accept a ``torch.dtype`` when called directly)."""
    if value is None or isinstance(value, torch.dtype):
        return value
    if value not in SCALAR_TYPES:
        raise RuntimeError(f"dtype enum {value} is not modelled by the test double")
    return SCALAR_TYPES[value]

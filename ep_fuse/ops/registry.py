"""Canonical ops, their providers, and how a provider is chosen for a call.

A *canonical op* (``torch.ops.ep_fuse.<name>``) is device-neutral; its kernel is the pure-torch
reference. A *provider* (``triton``, ``npu``) is a second op with the same schema in its own
namespace (``torch.ops.ep_fuse_triton.<name>``) whose kernel launches fused code; it declares the
devices it runs on and which calls it supports. Lowering replaces a canonical node by the first
provider, in the device's priority order, that is available and supports the call; ``reference``
is always last. At run time a provider op re-checks its inputs and falls back to the reference
(with a warning) when its kernel raises.

This module is the floor: it imports nothing of the package. Op families (:mod:`ep_fuse.ops.rms_norm`, ...)
define their ops here, providers register from their own modules, and :mod:`ep_fuse.catalog` loads them all
and sets each device's provider order (:func:`set_priority`). What a pass must ask the providers of an op at compile
time (DeepGEMM's layout for an FP8 block, a measured perf rule) it asks here (:func:`ask`), answered by rules the
providers register beside their implementations (:func:`register_rule`), so passes import no provider.

Ops are defined on ``torch.library`` fragments directly (schema + one Python kernel + fake) instead of
``torch.library.custom_op``, which adds a Python dispatch layer per call: a launch stays at C++-dispatcher cost.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger("ep_fuse.ops")

_LIBS: dict[str, torch.library.Library] = {}


def library(namespace: str) -> torch.library.Library:
    if namespace not in _LIBS:
        _LIBS[namespace] = torch.library.Library(namespace, "FRAGMENT")
    return _LIBS[namespace]


def define_op(
    namespace: str,
    name: str,
    schema: str,
    impl: Callable[..., Any],
    fake: Callable[..., Any],
) -> torch._ops.OpOverload:
    """Define ``namespace::name`` with ``schema`` (the part after the name), one kernel for all devices, and a fake."""
    lib = library(namespace)
    lib.define(f"{name}{schema}")
    lib.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{namespace}::{name}", fake, lib=lib)
    return getattr(getattr(torch.ops, namespace), name).default


REFERENCE = "reference"
Check = Callable[[tuple[Any, ...]], "str | None"]
PerfCheck = Callable[[tuple[Any, ...], str], "str | AtRunTime | None"]


@dataclasses.dataclass(frozen=True)
class AtRunTime:
    """A perf rule's answer when the faster choice depends on a size that is symbolic at compile time
    (``dynamic=True``): lowering picks the provider's ``by_size`` op, which applies the provider's
    ``run_time`` rule to the real arguments of every call and runs the reference where the rule says
    the kernel is slower. Deciding at compile time would need the size: reading a ``SymInt`` adds a
    guard (a recompile per size) and declining would lose the sizes where the kernel is faster."""

    rule: str
    """The choice made per call, for the report (``"the kernel up to 32 rows, the reference ... above"``)."""


@dataclasses.dataclass
class CanonicalOp:
    name: str
    schema: str
    reference: Callable[..., Any]
    op: torch._ops.OpOverload
    providers: dict[str, Provider] = dataclasses.field(default_factory=dict)
    traceable: Callable[[tuple[Any, ...]], bool] | None = None
    """Whether the reference traces to ATen ops for these arguments (``None``: always). Where it does
    not (a host loop), an unlowered call stays the opaque canonical op."""
    fake: Callable[..., Any] | None = None
    engine: bool = False
    """Its kernel is the implementation (a communication engine such as ``all_to_all``), not a fallback:
    a call left as the canonical op is not reported as unlowered."""
    block: bool = False
    """A composite of other canonical ops (the MoE block): expanded into them before lowering."""
    stages: tuple[str, ...] = ()
    """For a block: the canonical ops it expands into (each lowered to its own provider)."""


@dataclasses.dataclass
class Provider:
    """A fused implementation of one canonical op.

    Attributes:
        name: provider name (``triton``, ``npu``).
        canonical: the canonical op it implements.
        op: the provider op (same schema as the canonical op).
        devices: device types it runs on right now.
        available: ``None`` when its runtime (triton, torch_npu) can be used, else why not.
        supports: ``None`` when it can run these arguments (fake or real tensors), else why not.
        prefers: ``(args, executor) -> None`` when it measured at least as fast as what that executor
            would run without it (Inductor's code, or eager ATen ops), else why not (``perf_guard``);
            :class:`AtRunTime` when that depends on a symbolic size.
        run_time: ``args -> None`` when the kernel should run these real arguments, else why the
            reference is faster (used by ``by_size``; ``None``: no size-dependent choice).
        by_size: the op that applies ``run_time`` per call (same schema, ``<op>_by_size``).
        contracts: the external ops its kernel calls, each with the release whose contract it was checked
            against (``{"npu_rms_norm": "torch_npu 2.14.0"}``); shown in the compile report.
    """

    name: str
    canonical: CanonicalOp
    op: torch._ops.OpOverload
    devices: Callable[[], frozenset[str]]
    available: Callable[[], str | None]
    supports: Check
    prefers: PerfCheck | None = None
    run_time: Check | None = None
    by_size: torch._ops.OpOverload | None = None
    contracts: dict[str, str] = dataclasses.field(default_factory=dict)


_OPS: dict[str, CanonicalOp] = {}
_PROVIDER_NAMES: list[str] = [REFERENCE]
_PRIORITY: dict[str, tuple[str, ...] | Callable[[], tuple[str, ...]]] = {}
"""Device type -> the order providers are tried in (or a function giving it per call); set by the catalog."""
_SPARSE: set[str] = set()
"""Providers that implement a few ops only (``deepgemm``): the default order skips them without a note where they
have no implementation (every other op's report would otherwise list them)."""
_warned: set[tuple[str, str, str]] = set()
_warn_lock = threading.Lock()


def mark_sparse(name: str) -> None:
    """Declare provider ``name`` one that implements a few ops only (:data:`_SPARSE`)."""
    _SPARSE.add(name)


def set_priority(device: str, order: tuple[str, ...] | Callable[[], tuple[str, ...]]) -> None:
    """Try providers on ``device`` in ``order`` (a function: asked per choice, for orders that depend on the
    run-time environment such as the Triton interpreter); ``reference`` always comes last."""
    _PRIORITY[device] = order


def default_priority(device: str) -> tuple[str, ...]:
    """Provider order for ``device`` (:func:`set_priority`), then ``reference``."""
    order = _PRIORITY.get(device, ())
    return (*(order() if callable(order) else order), REFERENCE)


def never_traceable(args: tuple[Any, ...]) -> bool:
    """``traceable`` of an op whose reference does not trace to ATen ops (a host loop, a collective)."""
    return False


def define_canonical(
    name: str,
    schema: str,
    reference: Callable[..., Any],
    *,
    fake: Callable[..., Any] | None = None,
    traceable: Callable[[tuple[Any, ...]], bool] | None = None,
    block: bool = False,
    engine: bool = False,
    stages: tuple[str, ...] = (),
) -> CanonicalOp:
    """Define ``torch.ops.ep_fuse.<name>`` whose kernel is ``reference`` and fake impl ``fake``
    (default: the reference itself, which must then run on fake tensors)."""
    if name in _OPS:
        return _OPS[name]
    op = define_op("ep_fuse", name, schema, reference, fake or reference)
    _OPS[name] = CanonicalOp(name, schema, reference, op, traceable=traceable, fake=fake,
                             block=block, engine=engine, stages=stages)
    return _OPS[name]


def inlinable(canonical: CanonicalOp, args: tuple[Any, ...]) -> bool:
    return canonical.traceable is None or bool(canonical.traceable(args))


def register_provider(
    canonical: CanonicalOp,
    name: str,
    kernel: Callable[..., Any],
    *,
    devices: Callable[[], frozenset[str]],
    available: Callable[[], str | None],
    supports: Check,
    prefers: PerfCheck | None = None,
    run_time: Check | None = None,
    contracts: dict[str, str] | None = None,
) -> Provider:
    """Define ``torch.ops.ep_fuse_<name>.<op>`` running ``kernel`` with a guarded fallback to the reference
    (and, with a ``run_time`` rule, ``<op>_by_size``, which also runs the reference where the rule says so)."""
    if name in canonical.providers:
        return canonical.providers[name]
    if name not in _PROVIDER_NAMES:
        _PROVIDER_NAMES.insert(len(_PROVIDER_NAMES) - 1, name)
    reference = canonical.reference

    def guarded(*args: Any) -> Any:
        reason = supports(args)
        if reason is None:
            try:
                return kernel(*args)
            except Exception as exc:  # a provider must never crash the model
                _warn_once(name, canonical.name, f"{type(exc).__name__}: {exc}")
        else:
            log.debug("ep_fuse: %s %s declined at run time: %s", name, canonical.name, reason)
        return reference(*args)

    op = define_op(f"ep_fuse_{name}", canonical.name, canonical.schema, guarded, canonical.fake or reference)
    by_size = None
    if run_time is not None:
        def sized(*args: Any) -> Any:
            reason = run_time(args)
            if reason is None:
                return guarded(*args)
            log.debug("ep_fuse: %s %s: the reference at run time: %s", name, canonical.name, reason)
            return reference(*args)

        by_size = define_op(f"ep_fuse_{name}", f"{canonical.name}_by_size", canonical.schema, sized,
                            canonical.fake or reference)
    prov = Provider(name, canonical, op, devices, available, supports, prefers, run_time, by_size, dict(contracts or {}))
    canonical.providers[name] = prov
    return prov


def _warn_once(provider: str, op: str, error: str) -> None:
    key = (provider, op, error.split(":")[0])
    with _warn_lock:
        if key in _warned:
            return
        _warned.add(key)
    log.warning("ep_fuse: provider %r failed for %s (%s); using the reference implementation", provider, op, error)


def canonical_ops() -> dict[str, CanonicalOp]:
    """Every op defined so far (:mod:`ep_fuse.catalog` defines them all)."""
    return dict(_OPS)


def canonical_for(target: Any) -> CanonicalOp | None:
    for c in canonical_ops().values():
        if c.op is target:
            return c
    return None


def known_providers() -> list[str]:
    """Every provider name registered so far, ``reference`` last."""
    return list(_PROVIDER_NAMES)


@dataclasses.dataclass(frozen=True)
class Choice:
    provider: str
    op: torch._ops.OpOverload
    declined: tuple[tuple[str, str], ...] = ()
    """(provider, reason) for every provider tried before the chosen one."""
    run_time: str | None = None
    """Set when ``op`` is the provider's ``by_size`` op: the choice it makes per call."""


def choose(
    canonical: CanonicalOp,
    args: tuple[Any, ...],
    device: str,
    order: tuple[str, ...] | None = None,
    executor: str | None = None,
) -> Choice:
    """First provider in ``order`` (default: the device's) that is available, runs on ``device``,
    supports ``args`` and, given an ``executor``, measured at least as fast as what that executor
    runs without it; else the reference."""
    given = order is not None
    order = tuple(order) if order is not None else default_priority(device)
    declined: list[tuple[str, str]] = []
    for name in order:
        if name == REFERENCE:
            break
        prov = canonical.providers.get(name)
        if prov is None:
            if given or name not in _SPARSE:
                declined.append((name, f"no {name} implementation of {canonical.name}"))
            continue
        reason = prov.available()
        if reason is None and device not in prov.devices():
            reason = f"does not run on {device}"
        if reason is None:
            reason = prov.supports(args)
        if reason is None and executor is not None and prov.prefers is not None:
            reason = prov.prefers(args, executor)
        if isinstance(reason, AtRunTime):
            if prov.by_size is not None:
                return Choice(name, prov.by_size, tuple(declined), reason.rule)
            reason = f"{reason.rule} (no run-time choice registered)"
        if reason is not None:
            declined.append((name, reason))
            continue
        return Choice(name, prov.op, tuple(declined))
    return Choice(REFERENCE, canonical.op, tuple(declined))


# --------------------------------------------------------------------------- provider rules
_RULES: dict[tuple[str, str], dict[str, Callable[..., Any]]] = {}
"""``(op name, question) -> provider -> rule``: compile-time questions a pass asks about an op that only its
providers can answer (:func:`register_rule`, :func:`ask`)."""


def _op_name(op: CanonicalOp | str) -> str:
    return op if isinstance(op, str) else op.name


def register_rule(op: CanonicalOp | str, provider: str, question: str, rule: Callable[..., Any]) -> None:
    """Let ``provider`` answer ``question`` about ``op`` with ``rule`` (called by the provider's module at
    registration, beside :func:`register_provider`). The question's arguments and answer are the contract between
    the pass that asks and the providers that answer; its docstring belongs where the pass asks it."""
    _RULES.setdefault((_op_name(op), question), {})[provider] = rule


def ask(op: CanonicalOp | str, question: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Every registered provider's answer to ``question`` about ``op`` (``{provider: answer}``, in registration
    order; empty when no provider answers it), so that a pass asks providers without importing them."""
    rules = _RULES.get((_op_name(op), question), {})
    return {provider: rule(*args, **kwargs) for provider, rule in list(rules.items())}

"""Every torch_npu call of the Ascend providers and the EP engine, checked against torch_npu itself.

No Ascend hardware here. ``support/npu_conformance.py`` reads the pinned torch_npu wheel (never imported) and defines
each ``npu::<op>`` from its real schema with torch_npu's own meta function; the doubles of ``support/npu_double.py`` /
``support/npu_ep_double.py`` are the ops' CPU kernels. For every provider this module runs

* the real call on CPU tensors: each ``torch_npu.npu_*`` call binds to the schema, then the double runs;
* the same call under ``FakeTensorMode``: torch_npu's meta functions compute the shapes and dtypes the
  provider then post-processes;

and checks that the outputs agree with each other and with the canonical op's reference, that the double of
every call returns what the meta function says (outputs, shapes, dtypes), and that the ops called are the
ones the provider declares (the compile report lists them with the torch_npu version).
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Callable
from typing import Any

from support import npu_conformance as C
from support import npu_double
from support import npu_ep_double
import pytest
import torch
from support.norm_cases import norm_args
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

from ep_fuse import runtime as npu_runtime
from ep_fuse.ops.registry import canonical_ops
from ep_fuse.ops import ep as ep_ops
from ep_fuse.ops import registry
from ep_fuse.ops import moe as moe_ref
from ep_fuse.ops import w8a8 as Q
from ep_fuse.ops import w8a8 as QR
from ep_fuse.ops.rope import CACHE_FORMS

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
CALLED = {
    "npu_rms_norm", "npu_add_rms_norm", "npu_rotary_mul", "npu_mrope", "npu_swiglu", "npu_grouped_matmul",
    "npu_moe_init_routing_v2", "npu_moe_finalize_routing", "npu_moe_gating_top_k", "npu_dynamic_quant",
    "npu_dequant_swiglu_quant", "npu_moe_distribute_dispatch", "npu_moe_distribute_combine",
}
"""What the library calls today (the issue's list); a new call must be added here and get a case below."""
UNDOCUMENTED = {"npu_add_rms_norm", "npu_moe_distribute_dispatch", "npu_moe_distribute_combine"}
"""Called ops without an entry in the wheel's ``_op_plugin_docs.py`` (their schema and meta function exist)."""


@pytest.fixture(scope="module")
def contracts() -> C.Contracts:
    return C.require()


def _npu_providers() -> dict[str, registry.Provider]:
    """NPU providers with a kernel (the FP8 stages' providers only decline: ``providers/npu/fp8.py``)."""
    from ep_fuse.providers.npu.fp8 import DECLINED

    return {name: op.providers["npu"] for name, op in registry.canonical_ops().items()
            if "npu" in op.providers and name not in DECLINED}


def _declared() -> dict[str, str]:
    from ep_fuse.ep import npu as ep_npu

    out: dict[str, str] = dict(ep_npu.CONTRACTS)
    for prov in _npu_providers().values():
        out.update(prov.contracts)
    return out


# --------------------------------------------------------------------------- the contracts themselves
def test_the_wheel_is_the_library_contract_version(contracts):
    assert contracts.version == npu_runtime.TORCH_NPU_CONTRACT_VERSION
    assert npu_runtime.CHECKED_AGAINST == f"torch_npu {contracts.version}"


def test_every_called_op_has_a_schema_and_a_meta_function(contracts):
    declared = _declared()
    assert set(declared) == CALLED
    assert set(declared.values()) == {npu_runtime.CHECKED_AGAINST}
    for op in CALLED:
        assert contracts.schema(op).startswith(f"{op}(")
        assert callable(contracts.meta_for(op))
        assert (op in contracts.docs) == (op not in UNDOCUMENTED), op
    # what the shims could not run are module-level side-effect marks of other ops, never a meta function
    assert contracts.meta_failures, "expected the has_side_effect(torch.ops.npu.<undefined op>) marks to fail"
    for where, why in contracts.meta_failures.items():
        assert "(Expr)" in where and "has no attribute" in why, (where, why)


def _schema_params(schema: str) -> list[tuple[str, bool, Any]]:
    parsed = torch._C.parse_schema(schema)
    return [(a.name, a.kwarg_only, a.default_value if a.has_default_value() else inspect.Parameter.empty)
            for a in parsed.arguments]


def _params(fn: Callable[..., Any]) -> list[tuple[str, bool, Any]]:
    out = []
    for p in inspect.signature(fn).parameters.values():
        default = list(p.default) if isinstance(p.default, tuple) else p.default
        out.append((p.name, p.kind is inspect.Parameter.KEYWORD_ONLY, default))
    return out


@pytest.mark.parametrize("op", sorted(CALLED))
def test_the_double_takes_the_real_signature(contracts, op):
    """Names, keyword-only arguments and defaults of the double equal the schema's (the CPU kernel gets them)."""
    double = {**npu_double.kernels(), **npu_ep_double.kernels()}[op]
    assert _params(double) == _schema_params(contracts.schema(op))


# --------------------------------------------------------------------------- provider cases
def _g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rope(form: str, qk: bool) -> tuple[Any, ...]:
    g = _g(1)
    x = torch.randn(2, 5, 3, 16, generator=g).to(BF16).transpose(1, 2)  # [B, H, S, D] view, as HF
    if form == "complex":
        f = torch.randn(1, 1, 5, 8, generator=g)
        cos, sin, out = torch.polar(torch.ones_like(f), f), None, BF16
    else:
        ang = torch.randn(1, 1, 5, 16 if form == "half" else 8, generator=g)
        cos, sin, out = ang.cos().to(BF16), ang.sin().to(BF16), None
    heads = (x, x[:, :1].contiguous()) if qk else (x,)
    return (*heads, cos, sin, form, 16, out)


def _rope_cache(form: str, qk: bool, rot: int) -> tuple[Any, ...]:
    g = _g(2)
    q, k = torch.randn(11, 4, 64, generator=g).to(BF16), torch.randn(11, 1, 64, generator=g).to(BF16)
    cache, pos = torch.randn(64, rot, generator=g).to(BF16), torch.randint(0, 64, (11,), generator=g)
    return (q, k, cache, pos, form, rot) if qk else (q, cache, pos, form, rot)


def _moe() -> dict[str, tuple[Any, ...]]:
    g = _g(3)
    t, k, e, h, i = 9, 2, 4, 32, 16
    x = torch.randn(t, h, generator=g).to(BF16)
    ids = torch.randint(0, e, (t, k), generator=g)
    ids[0, 0], ids[-1, -1] = -1, e + 2  # a dropped slot and another rank's expert
    w = torch.softmax(torch.randn(t, k, generator=g), -1)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(BF16)
    w2 = (torch.randn(e, h, i, generator=g) / i**0.5).to(BF16)
    rows, src2dst, seg = moe_ref.moe_permute_ref(x, ids, e)
    act = moe_ref.grouped_gemm_swiglu_ref(rows, w13, seg)
    y = moe_ref.grouped_gemm_ref(act, w2, seg)
    xq, xs = QR.quant_per_token_ref(rows)
    (w13q, w13s), (w2q, w2s) = QR.quantize_weight(w13.float()), QR.quantize_weight(w2.float())
    aq, a_s = QR.grouped_gemm_w8a8_swiglu_quant_ref(xq, xs, w13q, w13s, seg)
    return {
        "moe_permute": (x, ids, e), "grouped_gemm_swiglu": (rows, w13, seg), "grouped_gemm": (act, w2, seg),
        "moe_unpermute": (y, src2dst, w, k, BF16), "moe_unpermute/unweighted": (y, src2dst, None, k, None),
        "moe_unpermute/fp32_out": (y, src2dst, w, k, None),
        "quant_per_token": (rows,), "grouped_gemm_w8a8_swiglu_quant": (xq, xs, w13q, w13s, seg),
        "grouped_gemm_w8a8": (aq, a_s, w2q, w2s, seg, BF16), "grouped_gemm_w8a8/fp16": (aq, a_s, w2q, w2s, seg, F16),
    }


def _gating() -> dict[str, tuple[Any, ...]]:
    x = torch.randn(13, 16, generator=_g(4))
    b = torch.linspace(-0.2, 0.2, 16)
    return {"moe_gating/softmax_renorm": (x, None, 2, "softmax", 1, 1, "none", True, 0.0, 1.0, None),
            "moe_gating/grouped_max": (x.to(BF16), None, 3, "softmax", 4, 2, "max", False, 0.0, 16.0, None),
            "moe_gating/sigmoid_bias": (x, b, 4, "sigmoid", 2, 1, "sum_top2", True, 1e-20, 2.5, BF16)}


def _cases() -> dict[str, tuple[Any, ...]]:
    g = _g(5)
    cases: dict[str, tuple[Any, ...]] = {
        "rms_norm/llama": norm_args(7, 64, BF16, "llama", False, out_dtype=BF16),
        "rms_norm/fp32_gamma_3d": norm_args(0, 64, F16, "weight_fp32", False, out_dtype=F16, shape=(2, 3, 64)),
        "rms_norm/gemma": norm_args(7, 64, BF16, "gemma", False, out_dtype=BF16),
        "add_rms_norm/llama": norm_args(7, 64, BF16, "llama", True),
        "add_rms_norm/fp32": norm_args(5, 48, F32, "llama", True, out_dtype=F32),
        "gemm_swiglu": (torch.randn(2, 3, 32, generator=g).to(BF16), *(torch.randn(40, 32, generator=g).to(BF16)
                                                                       / 6 for _ in range(2))),
    }
    for form in ("half", "chunk", "interleave", "complex"):
        cases[f"rope/{form}"] = _rope(form, qk=False)
        cases[f"rope_qk/{form}"] = _rope(form, qk=True)
    for form in CACHE_FORMS:
        cases[f"rope_cache/{form}"] = _rope_cache(form, qk=False, rot=64)
        cases[f"rope_qk_cache/{form}/partial"] = _rope_cache(form, qk=True, rot=32)
    return {**cases, **_moe(), **_gating()}


CASES = _cases()


def test_every_npu_provider_has_a_case():
    assert {name.split("/")[0] for name in CASES} == set(_npu_providers())


def _layout(out: Any) -> Any:
    """Shapes and dtypes of a (nested) result."""
    return tree_map(lambda t: (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t, out)


class Spy:
    """Records every ``torch_npu.npu_*`` call made through the installed stand-in module."""

    def __init__(self, module: types.ModuleType, names: set[str]) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any], Any]] = []
        for name in names & set(vars(module)):
            setattr(module, name, self._wrap(name, getattr(module, name)))

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            self.calls.append((name, args, kwargs, out))
            return out

        return call


def _fake(mode: FakeTensorMode, tree: Any) -> Any:
    return tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, tree)


@pytest.mark.parametrize("case", sorted(CASES))
def test_provider_calls_bind_and_agree_with_torch_npu_meta(contracts, torch_npu_double, case):
    from ep_fuse.providers.npu import gemm_swiglu as npu_gemm_swiglu
    from ep_fuse.providers.npu import rms_norm as npu_rms_norm
    from ep_fuse.providers.npu import rope as npu_rope

    name = case.split("/")[0]
    op = canonical_ops()[name]
    prov = op.providers["npu"]
    args = CASES[case]
    assert prov.supports(args) is None, prov.supports(args)
    spy = Spy(sys.modules["torch_npu"], CALLED)
    real = prov.op(*args)  # the provider op; a raise here fails the test (no fallback: conftest)
    assert _layout(real) == _layout(op.reference(*args))
    assert {c[0] for c in spy.calls} == set(prov.contracts), "the report would list other ops than those called"
    # each call: the double returns what torch_npu's meta function says for the same arguments
    for opname, cargs, ckwargs, out in spy.calls:
        with FakeTensorMode() as mode:
            meta = getattr(torch.ops.npu, opname)(*_fake(mode, cargs), **_fake(mode, ckwargs))
        assert _layout(meta) == _layout(out), opname
    # the whole provider on fake tensors: argument binding and output conventions through the meta functions
    spy.calls.clear()
    kernel_fn = _kernel(prov)
    with FakeTensorMode() as mode:
        fake_out = kernel_fn(*_fake(mode, args))
    npu_rms_norm._ones.cache_clear()  # may hold a tensor made under the fake mode
    assert _layout(fake_out) == _layout(real)
    assert {c[0] for c in spy.calls} == set(prov.contracts)


def _kernel(prov: registry.Provider) -> Callable[..., Any]:
    """The provider's kernel itself (the registered op would run the canonical fake impl under FakeTensorMode)."""
    from ep_fuse.providers.npu import gemm_swiglu as npu_gemm_swiglu
    from ep_fuse.providers.npu import rms_norm as npu_rms_norm
    from ep_fuse.providers.npu import rope as npu_rope
    from ep_fuse.providers.npu import moe, moe_gating as router, w8a8

    return {
        "rms_norm": npu_rms_norm.rms_norm_kernel, "add_rms_norm": npu_rms_norm.add_rms_norm_kernel, "rope": npu_rope.rope_kernel,
        "rope_qk": npu_rope.rope_qk_kernel, "rope_cache": npu_rope.rope_cache_kernel, "rope_qk_cache": npu_rope.rope_qk_cache_kernel,
        "gemm_swiglu": npu_gemm_swiglu.gemm_swiglu_kernel, "moe_permute": moe.moe_permute_kernel,
        "grouped_gemm_swiglu": moe.grouped_gemm_swiglu_kernel, "grouped_gemm": moe.grouped_gemm_kernel,
        "moe_unpermute": moe.moe_unpermute_kernel, "moe_gating": router.moe_gating_kernel,
        "quant_per_token": w8a8.quant_per_token_kernel,
        "grouped_gemm_w8a8_swiglu_quant": w8a8.grouped_gemm_w8a8_swiglu_quant_kernel,
        "grouped_gemm_w8a8": w8a8.grouped_gemm_w8a8_kernel,
    }[prov.canonical.name]


# --------------------------------------------------------------------------- EP: dispatch / combine
class _Group:
    def __init__(self, world: int, rank: int) -> None:
        self._world, self._rank, self.group_name = world, rank, "ep_conformance"

    def size(self) -> int:
        return self._world

    def rank(self) -> int:
        return self._rank


class _Handles:
    """``ep_fuse.ep.handles`` for fake tensors (the real one keys on data pointers)."""

    def __init__(self) -> None:
        self.entries: dict[int, Any] = {}

    def put(self, handle: torch.Tensor, value: Any, write_key: bool = True) -> int:
        self.entries[id(handle)] = value
        return id(handle)

    def pop(self, handle: torch.Tensor) -> Any:
        return self.entries.pop(id(handle))


@pytest.mark.parametrize("world,rank,capacity,k", [(2, 1, 0, 2), (4, 0, 6, 3), (8, 5, 0, 8)])
def test_ep_dispatch_combine_through_torch_npu_meta(contracts, monkeypatch, world, rank, capacity, k):
    """The EP engine's ``npu_moe_distribute_dispatch`` / ``_combine`` calls bind to the real schemas, and the
    meta functions' outputs give the receive buffers and result ``ep_dispatch`` / ``ep_combine`` promise."""
    from ep_fuse.ep import groups
    from ep_fuse.ep import npu as ep_npu
    from ep_fuse.ops.ep import ep_combine_fake, ep_dispatch_fake

    monkeypatch.setitem(sys.modules, "torch_npu", npu_ep_double.make_module())
    monkeypatch.setattr(groups, "resolve_group", lambda _name: _Group(world, rank))
    monkeypatch.setattr(ep_ops, "resolve_group", lambda _name: _Group(world, rank))  # (the ops' fake impls)
    monkeypatch.setattr(ep_npu, "handles", _Handles())
    spy = Spy(sys.modules["torch_npu"], CALLED)
    t, h, e = 5, 64, 4 * world
    g = _g(6)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    ids[0, -1] = -1  # a dropped slot: replaced by an absent expert, weight 0
    common = (e, "ep_conformance", "expert", capacity, 30.0)
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(t, h, generator=g).to(BF16))
        fids, w = mode.from_tensor(ids), mode.from_tensor(torch.rand(t, k, generator=g))
        got = ep_npu.dispatch(x, fids, w, *common)
        want = ep_dispatch_fake(x, fids, w, e, "ep_conformance", "npu", "expert", capacity, 30.0)
        assert _layout(got) == _layout(want)
        y = torch.empty(got[0].shape, dtype=BF16)
        for out_dtype in (BF16, None):
            if out_dtype is None:
                got = ep_npu.dispatch(x, fids, w, *common)
            out = ep_npu.combine(y, got[3], fids, w, *common, out_dtype)
            want = ep_combine_fake(y, got[3], fids, w, e, "ep_conformance", "npu", "expert", capacity, 30.0,
                                   out_dtype)
            assert _layout(out) == _layout(want)
    names = [c[0] for c in spy.calls]
    assert names == ["npu_moe_distribute_dispatch", "npu_moe_distribute_combine"] * 2
    assert set(names) == set(ep_npu.CONTRACTS)
    dispatch_out = spy.calls[0][3]
    a = (world * (capacity or t)) * min(e // world, k)  # A = global BS x min(local experts, K) (meta)
    assert dispatch_out[0].shape == (a, h) and dispatch_out[1].shape == (a,) and dispatch_out[1].dtype == F32

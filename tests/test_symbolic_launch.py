"""The Triton launches Inductor inlines at symbolic sizes (``dynamic=True``) add no shape guard.

Each op registered ``symbolic=True`` in ``ep_fuse.providers.triton`` has its host code (output allocation,
grid, launch arguments) run here on fake tensors whose token count is a symbol, with a recording stand-in
for ``wrap_triton`` that also checks each launch argument has no size that may be 1: torch 2.11's contiguity
check guards on such a size (a ``[chunks, E]`` buffer guarded ``chunks == 1`` that way, seen on H200 as a
recompile past 256 slots; torch 2.13 no longer guards there, so the test checks the sizes themselves).
A guard would mean a recompile for every new token count (or a silently specialised graph), so the test
fails on any. The grid must stay a function of the symbol.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import (
    DimDynamic,
    ShapeEnv,
    StatelessSymbolicContext,
    statically_known_true,
)

from ep_fuse import runtime
from ep_fuse.config import EpFuseConfig
from ep_fuse.providers.triton import provider

BF16 = torch.bfloat16
T, H, D, NH, KVH, E, K = 37, 256, 64, 4, 2, 16, 4
"""``T`` (and ``T*K``) mark the dims that become the symbolic token count."""

CASES: dict[str, tuple[Callable[[], tuple[Any, ...]], ...]] = {
    "rms_norm": (lambda: (torch.randn(T, H, dtype=BF16), torch.randn(H, dtype=BF16), 1e-6, None, "llama", True,
                          BF16),),
    "add_rms_norm": (lambda: (torch.randn(T, H, dtype=BF16), torch.randn(T, H, dtype=BF16), torch.randn(H, dtype=BF16),
                              1e-6, None, "llama", True, BF16),
                     lambda: (torch.randn(2, T, H, dtype=BF16), torch.randn(2, T, H, dtype=BF16), None, 1e-5, None,
                              "none", True, None)),
    "rope": (lambda: (torch.randn(2, T, NH, D, dtype=BF16), torch.randn(2, T, 1, D, dtype=BF16),
                      torch.randn(2, T, 1, D, dtype=BF16), "half", D, None),),
    "rope_qk": (  # HF's [B, heads, S, D] transposes of [B, S, heads, D] projections
        lambda: (torch.randn(2, T, NH, D, dtype=BF16).transpose(1, 2), torch.randn(2, T, KVH, D, dtype=BF16)
                 .transpose(1, 2), torch.randn(2, 1, T, D, dtype=BF16), torch.randn(2, 1, T, D, dtype=BF16), "half",
                 D, None),
        lambda: (torch.randn(1, NH, T, D, dtype=BF16), torch.randn(1, KVH, T, D, dtype=BF16),
                 torch.randn(1, T, D // 4, dtype=BF16), torch.randn(1, T, D // 4, dtype=BF16), "interleave", D // 2,
                 None)),
    "rope_cache": (lambda: (torch.randn(T, NH, D, dtype=BF16), torch.randn(512, D), torch.randint(0, 512, (T,)),
                            "chunk", D),),
    "rope_qk_cache": (lambda: (torch.randn(T, NH, D, dtype=BF16), torch.randn(T, KVH, D, dtype=BF16),
                               torch.randn(512, D), torch.randint(0, 512, (T,)), "interleave", D),),
    "moe_gating": (lambda: (torch.randn(T, E), None, K, "softmax", 1, 1, "none", True, 1e-20, 1.0, None, False),
                   lambda: (torch.randn(T, 64), torch.randn(64), 8, "sigmoid", 8, 4, "sum_top2", True, 1e-20, 2.5,
                            None, False)),
    "moe_gating_sink": (lambda: (torch.randn(T, E + 2), None, K, 2, 2.5, torch.rand(1), None),
                        lambda: (torch.randn(T, E + 1), torch.randn(E), K, 1, 1.0, None, BF16)),
    "moe_permute": (lambda: (torch.randn(T, H, dtype=BF16), torch.randint(0, E, (T, K)), E),),
    "moe_unpermute": (lambda: (torch.randn(T * K, H, dtype=BF16), torch.randint(0, T * K, (T * K,)),
                               torch.rand(T, K), K, None),),
}


class _Recorder:
    """Stands in for ``torch.library.wrap_triton``: records ``(kernel name, grid)`` per launch in ``launches``
    and ``(kernel, args, kwargs)`` in ``calls`` (and, with ``probe``, asks each tensor argument what
    functionalization asks)."""

    def __init__(self, probe: bool = True) -> None:
        self.launches: list[tuple[str, tuple[Any, ...]]] = []
        self.calls: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []
        self.probe = probe

    def __call__(self, kernel: Any) -> Any:
        launches, calls, probe = self.launches, self.calls, self.probe

        class _Launch:
            def __getitem__(self, grid: tuple[Any, ...]) -> Callable[..., None]:
                def run(*args: Any, **kwargs: Any) -> None:
                    for a in args:
                        if probe and isinstance(a, torch.Tensor):
                            a.is_contiguous()  # what functionalization asks of every tensor the launch takes
                            # torch 2.11 answers that with a guard on any size that may be 1 (2.13 does not)
                            maybe_one = [d for d in a.shape
                                         if isinstance(d, torch.SymInt) and not statically_known_true(d >= 2)]
                            assert not maybe_one, f"{kernel.__name__}: a size that may be 1: {tuple(a.shape)}"
                    launches.append((kernel.__name__, grid))
                    calls.append((kernel, args, kwargs))
                return run

        return _Launch()


def _symbolic_like(t: torch.Tensor, tokens: Any) -> torch.Tensor:
    """A fake tensor like ``t`` (same strides pattern) with ``T``/``T*K`` dims replaced by the symbol."""
    shape = [tokens if d == T else tokens * K if d == T * K else d for d in t.shape]
    order = sorted(range(t.dim()), key=lambda i: t.stride(i))  # innermost first: rebuild the same layout
    base = torch.empty([shape[i] for i in reversed(order)], dtype=t.dtype)
    return base.permute([list(reversed(order)).index(i) for i in range(t.dim())])


@pytest.mark.parametrize("op, i", [(op, i) for op, makers in CASES.items() for i in range(len(makers))])
def test_symbolic_launch_adds_no_guard(op: str, i: int) -> None:
    kernel = provider.SYMBOLIC_INLINE[op]
    args = CASES[op][i]()
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    seed = mode.from_tensor(torch.empty(T, 3), symbolic_context=StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC]))
    rec = _Recorder()
    with mode:
        tokens = seed.shape[0]
        fake = [_symbolic_like(a, tokens) if isinstance(a, torch.Tensor) and a.dim() else a for a in args]
        assert provider.SYMBOLIC_INLINE[op] is kernel and all(
            not isinstance(a, torch.Tensor) or a.stride() == _symbolic_like(b, tokens).stride()
            for a, b in zip(fake, args))
        before = len(env.guards)
        kernel(*fake, wrap=rec)
    assert [str(g.expr) for g in env.guards[before:]] == []
    assert rec.launches, "no launch recorded"
    symbols = {str(s) for _, grid in rec.launches for g in grid if isinstance(g, torch.SymInt)
               for s in g.node.expr.free_symbols}
    assert symbols, f"every grid was specialised: {rec.launches}"


def test_every_symbolic_inline_op_is_checked() -> None:
    assert set(provider.SYMBOLIC_INLINE) == set(CASES)


def test_unbacked_sizes_are_recognised() -> None:
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    backed = mode.from_tensor(torch.empty(T, 3), symbolic_context=StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC]))
    with mode:
        unbacked = torch.empty(env.create_unbacked_symint(), 3)
    assert not provider._unbacked((backed, 1e-6, None))
    assert provider._unbacked((backed, unbacked))
    assert not provider._unbacked((torch.empty(2, 3),))


@pytest.mark.parametrize("op, i", [(op, i) for op, makers in CASES.items() for i in range(len(makers))])
def test_host_code_traces_at_an_unbacked_token_count(op: str, i: int) -> None:
    """``ep_fuse.dynamic_batch``'s batch is unbacked (it may be 0 or 1): the host code still decides nothing on
    it (a decision would raise a data-dependent error here), and the grid stays a function of it."""
    args = CASES[op][i]()
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    rec = _Recorder(probe=False)
    with mode:
        tokens = env.create_unbacked_symint()
        fake = [_symbolic_like(a, tokens) if isinstance(a, torch.Tensor) and a.dim() else a for a in args]
        provider.SYMBOLIC_INLINE[op](*fake, wrap=rec)
    assert [str(g.expr) for g in env.guards] == []
    symbols = {str(s) for _, grid in rec.launches for g in grid if isinstance(g, torch.SymInt)
               for s in g.node.expr.free_symbols}
    assert str(tokens) in symbols, rec.launches


class _Mode:
    """Stands in for the FunctionalTensorMode a rule runs under: the opaque op's dispatch is recorded."""

    def __init__(self) -> None:
        self.dispatched: list[Any] = []

    def __enter__(self) -> "_Mode":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def __torch_dispatch__(self, op: Any, types: Any, args: Any, kwargs: Any) -> str:
        self.dispatched.append(op)
        return "opaque"


@pytest.mark.parametrize("fails", [None, "guard", "other"])
def test_unbacked_launch_that_cannot_be_traced_keeps_the_opaque_op(monkeypatch, fails) -> None:
    """At unbacked sizes the launch is tried; a data-dependent guard (or any other failure) in its host code
    leaves the opaque op, which is always a correct lowering. At backed sizes a failure is not hidden."""
    import types

    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    monkeypatch.setattr(runtime, "triton_interpret", lambda: False)
    env = ShapeEnv()
    with FakeTensorMode(shape_env=env):
        unbacked = torch.empty(env.create_unbacked_symint(), 3)

    def kernel(*args: Any, wrap: Any) -> str:
        if fails == "guard":
            raise GuardOnDataDependentSymNode(args[1].shape[0] == 0, "Could not guard on data-dependent expression")
        if fails == "other":
            raise RuntimeError("some tracing failure")
        return "inlined"

    rule = provider._inline_rule(kernel, lambda a: None, lambda a: None, symbolic=True)
    cuda = types.SimpleNamespace(device=torch.device("cuda"))  # the rule reads args[0].device only
    mode = _Mode()
    out = rule(mode, "op", (), (cuda, unbacked), {})
    assert (out, mode.dispatched) == (("inlined", []) if fails is None else ("opaque", ["op"]))
    if fails is not None:
        backed = FakeTensorMode(shape_env=ShapeEnv()).from_tensor(
            torch.empty(T, 3), symbolic_context=StatelessSymbolicContext(
                dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC]))
        with pytest.raises((GuardOnDataDependentSymNode, RuntimeError)):
            rule(mode, "op", (), (cuda, backed), {})


# --------------------------------------------------------------------------- the <op>_by_size branches
def _grouped_args(dtype: torch.dtype, swiglu: bool) -> tuple[torch.Tensor, ...]:
    return (torch.randn(T * K, H, dtype=dtype), torch.randn(E, 2 * 64 if swiglu else 64, H, dtype=dtype),
            torch.zeros(E + 1, dtype=torch.int64))


BY_SIZE_CASES: dict[str, Callable[[], tuple[Any, ...]]] = {
    "grouped_gemm bf16": lambda: ("grouped_gemm", _grouped_args(BF16, False)),
    "grouped_gemm_swiglu bf16": lambda: ("grouped_gemm_swiglu", _grouped_args(BF16, True)),
    "grouped_gemm_swiglu fp16": lambda: ("grouped_gemm_swiglu", _grouped_args(torch.float16, True)),
    "gemm_swiglu": lambda: ("gemm_swiglu", (torch.randn(2, T, H, dtype=BF16), torch.randn(96, H, dtype=BF16),
                                            torch.randn(96, H, dtype=BF16))),
}


@pytest.mark.parametrize("case", sorted(BY_SIZE_CASES))
def test_size_branches_trace_every_branch_without_a_guard(case: str) -> None:
    """``<op>_by_size`` at a symbolic row count becomes a nest of conds on ``rows < bound``: every branch is
    traced (here: run on fake tensors by a recording ``cond``) and none adds a guard."""
    from ep_fuse.providers.triton import size_branches as sb
    from ep_fuse.providers.triton import gemm_swiglu as triton_gemm_swiglu
    from ep_fuse.providers.triton import moe as triton_moe

    op, args = BY_SIZE_CASES[case]()
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    seed = mode.from_tensor(torch.empty(T, 3), symbolic_context=StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC]))
    preds: list[Any] = []

    def record_cond(pred: Any, take: Callable[..., Any], other: Callable[..., Any], ops: tuple[Any, ...]) -> Any:
        preds.append(pred)
        out, alt = take(*ops), other(*ops)
        assert out[0].shape == alt[0].shape and out[0].dtype == alt[0].dtype
        return out

    rec = _Recorder()
    with mode:
        tokens = seed.shape[0]
        fake = tuple(_symbolic_like(a, tokens) for a in args)
        branches = sb.BRANCHES[op][0](*fake)
        before = len(env.guards)
        sb.run_by_size(op, fake, rec, cond=record_cond)
    assert [str(g.expr) for g in env.guards[before:]] == []
    assert len(preds) == len(branches) - 1 and all(isinstance(p, torch.SymBool) for p in preds)
    kernel_branches = sum(b.name.startswith(("kernel", "tma")) for b in branches)
    assert len(rec.launches) >= kernel_branches  # the TMA branch launches the tile table and the GEMM
    symbols = {str(s) for _, grid in rec.launches for g in grid if isinstance(g, torch.SymInt)
               for s in g.node.expr.free_symbols}
    assert symbols, f"every grid was specialised: {rec.launches}"


def test_size_branches_follow_the_run_time_rules() -> None:
    """The bounds are the rules the opaque op applies per call: decode tiles up to 16 rows per expert (32-row
    tiles above 4), the 64-row config below 64, then the TMA kernel from 64 rows per expert (where it takes the shape),
    ``torch._grouped_mm`` at sizes too large for it (bf16), the kernel at every size where ``_grouped_mm`` does not
    run."""
    from ep_fuse.providers.triton import size_branches as sb
    from ep_fuse.providers.triton import gemm_swiglu as triton_gemm_swiglu
    from ep_fuse.providers.triton import moe as triton_moe
    from ep_fuse.providers.triton.grouped_gemm_kernel import is_decode

    x, w, _ = _grouped_args(BF16, True)
    e = w.shape[0]
    names = {rows: sb.branch_for(triton_moe.grouped_branches(x, w, True), rows).name
             for rows in (1, 4 * e, 4 * e + 1, 16 * e, 16 * e + 1, 64 * e - 1, 64 * e, 128 * e, 2**31)}
    assert names == {1: "kernel (decode tiles)", 4 * e: "kernel (decode tiles)", 4 * e + 1: "kernel (32-row decode tiles)",
                     16 * e: "kernel (32-row decode tiles)", 16 * e + 1: "kernel (64-row tiles)",
                     64 * e - 1: "kernel (64-row tiles)", 64 * e: "tma", 128 * e: "tma",
                     2**31: "torch._grouped_mm"}  # TMA takes any width under the interpreter
    for rows in (1, 4 * e + 1, 16 * e, 16 * e + 1, 300):
        assert ("decode tiles" in sb.branch_for(triton_moe.grouped_branches(x, w, True), rows).name) == \
            is_decode(rows, e)
    xh, wh, _ = _grouped_args(torch.float16, False)
    assert sb.branch_for(triton_moe.grouped_branches(xh, wh, False), 2**31).name == "kernel (128-row tiles)"
    dense = triton_gemm_swiglu.gemm_swiglu_branches(*BY_SIZE_CASES["gemm_swiglu"]()[1])  # CPU: no TMA branch
    assert [(b.name, b.below) for b in dense] == [("kernel (16-row tiles)", 17), ("kernel (32-row tiles)", 33),
                                                   ("reference", None)]


def test_few_expert_gate_up_takes_two_tma_branches(monkeypatch) -> None:
    """With the GPU's configs (not the interpreter's), few large experts' gate|up + SwiGLU runs the many-experts
    tiles from 64 to 256 rows per expert and its own 128 x 128 tiles from there: two TMA branches split where
    ``config_for`` changes; the down GEMM (one config) and many experts keep one."""
    import functools

    from ep_fuse.providers.triton import grouped_gemm_tma_kernel as tk
    from ep_fuse.providers.triton import moe as triton_moe
    from ep_fuse.providers.triton import size_branches as sb

    monkeypatch.setattr(tk, "config_for", functools.partial(tk.config_for, interpret=False))
    monkeypatch.setattr(triton_moe, "_grouped_tma_static", lambda *a, **kw: True)
    e = 8
    x, w13, w2 = torch.empty(4, 512, dtype=BF16), torch.empty(e, 2 * 1024, 512, dtype=BF16), torch.empty(e, 512, 1024)
    up = triton_moe.grouped_branches(x, w13, True)
    assert [b.name for b in up][-3:] == ["tma", "tma (few-expert tiles)", "torch._grouped_mm"]
    assert [sb.branch_for(up, r).name for r in (64 * e - 1, 64 * e, 256 * e - 1, 256 * e)] == [
        "kernel (64-row tiles)", "tma", "tma", "tma (few-expert tiles)"]
    assert [b.name for b in triton_moe.grouped_branches(torch.empty(4, 1024, dtype=BF16), w2.to(BF16), False)][-2:] \
        == ["tma", "torch._grouped_mm"]
    many = triton_moe.grouped_branches(x, torch.empty(64, 2 * 1024, 512, dtype=BF16), True)
    assert [b.name for b in many][-2:] == ["tma", "torch._grouped_mm"]


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_every_size_branch_computes_the_op(swiglu: bool, dtype: torch.dtype) -> None:
    """Each branch (its own tile config, the TMA kernel, ``torch._grouped_mm``) gives the reference's result,
    ragged experts with an empty one and a zero tail included (Triton interpreter)."""
    from ep_fuse.ops.moe import grouped_gemm_ref, grouped_gemm_swiglu_ref
    from ep_fuse.providers.triton import size_branches as sb
    from ep_fuse.providers.triton import gemm_swiglu as triton_gemm_swiglu
    from ep_fuse.providers.triton import moe as triton_moe

    torch.manual_seed(0)
    e, n, k = 4, 32, 32
    counts = [9, 0, 21, 5]
    m = sum(counts) + 3
    x = torch.randn(m, k, dtype=dtype)
    w = torch.randn(e, 2 * n if swiglu else n, k, dtype=dtype) / k**0.5
    seg = torch.tensor([0, *counts]).cumsum(0)
    ref = (grouped_gemm_swiglu_ref if swiglu else grouped_gemm_ref)(x, w, seg)
    branches = triton_moe.grouped_branches(x, w, swiglu)
    assert len({b.name for b in branches}) >= 3
    for b in branches:
        torch.testing.assert_close(b.run((x, w, seg), None).float(), ref.float(), rtol=2e-2, atol=2e-2,
                                   msg=lambda s, b=b: f"branch {b.name}: {s}")


def test_dense_size_branches_compute_the_op() -> None:
    from ep_fuse.ops.gemm_swiglu import gemm_swiglu_ref
    from ep_fuse.providers.triton import size_branches as sb
    from ep_fuse.providers.triton import gemm_swiglu as triton_gemm_swiglu
    from ep_fuse.providers.triton import moe as triton_moe

    torch.manual_seed(0)
    x = torch.randn(3, 7, 32, dtype=BF16)
    wg, wu = torch.randn(48, 32, dtype=BF16) / 6, torch.randn(48, 32, dtype=BF16) / 6
    ref = gemm_swiglu_ref(x, wg, wu)
    for b in triton_gemm_swiglu.gemm_swiglu_branches(x, wg, wu):
        torch.testing.assert_close(b.run((x, wg, wu), None).float(), ref.float(), rtol=2e-2, atol=2e-2)


@torch.library.custom_op("ep_fuse_test::by_rows", mutates_args=())
def _by_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    from ep_fuse.providers.triton import size_branches as sb
    from ep_fuse.providers.triton import gemm_swiglu as triton_gemm_swiglu
    from ep_fuse.providers.triton import moe as triton_moe

    return sb.select(_ROW_BRANCHES, lambda t: t.shape[0], (x, w), None)


@_by_rows.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[0]))


def _row_branches() -> list[Any]:
    from ep_fuse.providers.triton.size_branches import Branch

    return [Branch("a", 17, lambda a, wrap: a[0] @ a[1].T + 1), Branch("b", 65, lambda a, wrap: a[0] @ a[1].T + 2),
            Branch("c", None, lambda a, wrap: a[0] @ a[1].T - 1)]


_ROW_BRANCHES = _row_branches()


def _by_rows_rule(mode: Any, op: Any, types: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    from ep_fuse.providers.triton import size_branches as sb
    from ep_fuse.providers.triton import gemm_swiglu as triton_gemm_swiglu
    from ep_fuse.providers.triton import moe as triton_moe

    with mode:
        return sb.select(_ROW_BRANCHES, lambda t: t.shape[0], args, None)


from torch._subclasses.functional_tensor import FunctionalTensorMode  # noqa: E402

torch.library.register_torch_dispatch(torch.ops.ep_fuse_test.by_rows.default, FunctionalTensorMode, _by_rows_rule)


@pytest.mark.parametrize("sizes", ["backed", "unbacked batch"])
def test_size_branches_compile_in_inductor_at_a_product_of_symbols(sizes: str) -> None:
    """Inductor compiles the nested conds once for every row count, including a row count that is a product
    of symbols (batch x length) whose length is shared with another input (``position_ids``: Dynamo makes
    one of the two an alias, ``s62 -> s27``), backed (``dynamic=True``) or with the batch unbacked
    (``ep_fuse.dynamic_batch``), compiled after a (1, 1) call. Each branch's subgraph binds the symbols from an
    empty carrier tensor: without
    any, Inductor failed with "For s27*s77, expected [s27, s77] to have been codegen-ed" (H200); with the
    symbols as ``SymInt`` operands it bound the alias and failed with "For s27*u0, expected [s27] ..." (H200
    and here)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from ep_fuse.providers.triton import size_branches as sb
    from ep_fuse.providers.triton import gemm_swiglu as triton_gemm_swiglu
    from ep_fuse.providers.triton import moe as triton_moe

    def f(x: torch.Tensor, pos: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x.sin() + pos.unsqueeze(-1)
        return torch.ops.ep_fuse_test.by_rows(h.reshape(-1, x.shape[-1]), w) * 2

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(f, backend=counter, dynamic=True)
    w = torch.randn(8, 4)
    taken = set()
    # (1, 1) first: Dynamo specialises it, and the recompile makes the length of one input an alias
    shapes = [(1, 1), (2, 3), (3, 7), (4, 10), (5, 40), (2, 5)] + ([(1, 9), (1, 70)] if sizes != "backed" else [])
    for b, s in shapes:
        x = torch.randn(b, s, 4)
        pos = torch.arange(s, dtype=torch.float32).expand(b, s).contiguous()
        if sizes != "backed":
            for t in (x, pos):
                torch._dynamo.decorators.mark_unbacked(t, 0, shape_id="batch")
        branch = sb.branch_for(_ROW_BRANCHES, b * s)
        taken.add(branch.name)
        want = branch.run(((x.sin() + pos.unsqueeze(-1)).reshape(-1, 4), w), None) * 2
        torch.testing.assert_close(compiled(x, pos, w), want)
    assert taken == {"a", "b", "c"} and counter.frame_count == 2  # (1, 1), then one graph for every other shape


def test_by_size_rule_traces_branches_only_where_they_pay(monkeypatch) -> None:
    """The FunctionalTensorMode rule registered for ``grouped_gemm_swiglu_by_size`` traces the branches on CUDA
    (at unbacked sizes too), and keeps the opaque op under CUDA graphs (Inductor would drop them for a graph
    holding ``torch.cond``) and with the switch off. Fake CUDA tensors; the tracing itself is recorded."""
    from ep_fuse.ops import moe as moe_ops
    from ep_fuse.providers.triton import size_branches as sb
    from ep_fuse.providers.triton import gemm_swiglu as triton_gemm_swiglu
    from ep_fuse.providers.triton import moe as triton_moe

    prov = moe_ops.grouped_gemm_swiglu.providers["triton"]
    from torch._library.simple_registry import find_torch_dispatch_rule

    rule = find_torch_dispatch_rule(prov.by_size, FunctionalTensorMode)  # the rule the provider registered
    assert rule is not None
    traced: list[str] = []
    monkeypatch.setattr(runtime, "triton_interpret", lambda: False)
    monkeypatch.setattr(sb, "run_by_size", lambda name, args, wrap: traced.append(name) or "branches")

    class Mode:
        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: Any) -> None:
            return None

        def __torch_dispatch__(self, op: Any, types: Any, args: Any, kwargs: Any) -> str:
            return "opaque"

    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    seed = mode.from_tensor(torch.empty(T, 3), symbolic_context=StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC]))
    with mode:
        w = torch.empty(E, 128, H, dtype=BF16, device="cuda")
        seg = torch.empty(E + 1, dtype=torch.int64, device="cuda")
        symbolic = (torch.empty(seed.shape[0] * K, H, dtype=BF16, device="cuda"), w, seg)
        static = (torch.empty(T * K, H, dtype=BF16, device="cuda"), w, seg)

        def run(args: tuple[Any, ...]) -> str:
            return rule(Mode(), prov.by_size, (), args, {})

        assert run(symbolic) == "branches" and run(static) == "branches"
        unbacked = (torch.empty(env.create_unbacked_symint() * seed.shape[0] * K, H, dtype=BF16, device="cuda"), w,
                    seg)  # dynamic_batch's batch times a length
        assert run(unbacked) == "branches"
        with torch._inductor.config.patch({"triton.cudagraphs": True}):
            assert run(symbolic) == "opaque"
        with runtime.use_config(EpFuseConfig(size_branches=False)):  # the switch off, in the compile's config
            assert run(symbolic) == "opaque"
    assert traced == ["grouped_gemm_swiglu"] * 3

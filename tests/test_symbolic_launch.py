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

import ep_fuse.providers.triton as P

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
    "moe_permute": (lambda: (torch.randn(T, H, dtype=BF16), torch.randint(0, E, (T, K)), E),),
    "moe_unpermute": (lambda: (torch.randn(T * K, H, dtype=BF16), torch.randint(0, T * K, (T * K,)),
                               torch.rand(T, K), K, None),),
}


class _Recorder:
    """Stands in for ``torch.library.wrap_triton``: records ``(kernel name, grid)`` per launch."""

    def __init__(self) -> None:
        self.launches: list[tuple[str, tuple[Any, ...]]] = []

    def __call__(self, kernel: Any) -> Any:
        launches = self.launches

        class _Launch:
            def __getitem__(self, grid: tuple[Any, ...]) -> Callable[..., None]:
                def run(*args: Any, **kwargs: Any) -> None:
                    for a in args:
                        if isinstance(a, torch.Tensor):
                            a.is_contiguous()  # what functionalization asks of every tensor the launch takes
                            # torch 2.11 answers that with a guard on any size that may be 1 (2.13 does not)
                            maybe_one = [d for d in a.shape
                                         if isinstance(d, torch.SymInt) and not statically_known_true(d >= 2)]
                            assert not maybe_one, f"{kernel.__name__}: a size that may be 1: {tuple(a.shape)}"
                    launches.append((kernel.__name__, grid))
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
    kernel = P.SYMBOLIC_INLINE[op]
    args = CASES[op][i]()
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    seed = mode.from_tensor(torch.empty(T, 3), symbolic_context=StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC]))
    rec = _Recorder()
    with mode:
        tokens = seed.shape[0]
        fake = [_symbolic_like(a, tokens) if isinstance(a, torch.Tensor) and a.dim() else a for a in args]
        assert P.SYMBOLIC_INLINE[op] is kernel and all(
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
    assert set(P.SYMBOLIC_INLINE) == set(CASES)


def test_unbacked_sizes_keep_the_opaque_op() -> None:
    """``ep_fuse.dynamic_batch`` sizes are unbacked: host code that branches on a size could not be traced."""
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    backed = mode.from_tensor(torch.empty(T, 3), symbolic_context=StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC]))
    with mode:
        unbacked = torch.empty(env.create_unbacked_symint(), 3)
    assert not P._unbacked((backed, 1e-6, None))
    assert P._unbacked((backed, unbacked))
    assert not P._unbacked((torch.empty(2, 3),))

"""The memo of Inductor's Triton access analysis (``ep_fuse.kernel_analysis``): one analysis per signature."""

import types

import sympy
import torch

from ep_fuse import kernel_analysis as ka


def _kernel(module: str):
    fn = types.FunctionType((lambda: None).__code__, {}, "k")
    fn.__module__ = module
    return types.SimpleNamespace(fn=fn)  # shaped like a JITFunction: .fn is the Python function


class Analysis:
    def __init__(self):
        self.calls = 0

    def __call__(self, kernel, kwargs, tma):
        self.calls += 1
        return {"writes": sorted(k for k in kwargs if k.startswith("out"))}


def _args(dtype=torch.bfloat16, n=64, rows=sympy.Symbol("s0")):
    return {"x": torch.empty(2, dtype=dtype), "out": torch.empty(2, dtype=dtype), "N": n, "M": rows, "BLOCK": 32}


def test_one_analysis_per_signature():
    ka._memo.clear()
    analysis = Analysis()
    memo = ka.memoized(analysis)
    k = _kernel("ep_fuse.providers.triton.fake")
    first = memo(k, _args(), {})
    again = memo(k, _args(rows=sympy.Symbol("s7") * 3), {})  # any symbolic size: TTIR sees the constant 2
    assert analysis.calls == 1 and first == again and first is not again  # a copy, not the cached object
    memo(k, _args(dtype=torch.float16), {})
    memo(k, _args(n=128), {})
    memo(k, {**_args(), "BLOCK": 64}, {})
    memo(_kernel("ep_fuse.providers.triton.fake"), _args(), {})  # another kernel
    assert analysis.calls == 5


def test_tma_metadata_is_part_of_the_key():
    ka._memo.clear()
    analysis = Analysis()
    memo = ka.memoized(analysis)
    k = _kernel("ep_fuse.providers.triton.fake")
    memo(k, _args(), {"x": ("stable", ([64, 64],))})
    memo(k, _args(), {"x": ("stable", ([64, 128],))})
    memo(k, _args(), {"x": ("stable", ([64, 64],))})
    assert analysis.calls == 2


def test_other_kernels_and_unkeyable_arguments_are_not_memoized():
    ka._memo.clear()
    analysis = Analysis()
    memo = ka.memoized(analysis)
    theirs = _kernel("user_code")
    memo(theirs, _args(), {})
    memo(theirs, _args(), {})
    ours = _kernel("ep_fuse.providers.triton.fake")
    memo(ours, {**_args(), "shape": [1, 2]}, {})
    memo(ours, {**_args(), "shape": [1, 2]}, {})
    assert analysis.calls == 4


def test_context_patches_torch_and_restores_it():
    from torch._higher_order_ops import triton_kernel_wrap as tkw

    names = [n for n in ka._ANALYSES if hasattr(tkw, n)]
    assert names, "torch renamed its Triton access analysis: update ep_fuse.kernel_analysis._ANALYSES"
    before = {n: getattr(tkw, n) for n in names}
    with ka.memoized_access_analysis() as block:
        assert all(getattr(tkw, n).__wrapped__ is before[n] for n in names)
        with ka.memoized_access_analysis():  # nested: no second wrapper
            assert all(getattr(tkw, n).__wrapped__ is before[n] for n in names)
        assert all(getattr(tkw, n).__wrapped__ is before[n] for n in names)
    assert {n: getattr(tkw, n) for n in names} == before
    assert (block.computed, block.served) == (0, 0)

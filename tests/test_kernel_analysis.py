"""The memo of Inductor's Triton access analysis (``ep_fuse.kernel_analysis``): one analysis per signature."""

import types

import sympy
import torch

from ep_fuse import kernel_analysis as ka


def _kernel(module: str, src: str | None = None):
    fn = types.FunctionType((lambda: None).__code__, {}, "k")
    fn.__module__ = module
    # shaped like a JITFunction: .fn is the Python function, .src its source (an Autotuner has no .src)
    return types.SimpleNamespace(fn=fn, **({"src": src} if src is not None else {}))


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


class Box:
    """Like Inductor's TensorBox: get_dtype() works, .dtype does not, and it hashes by identity."""

    def __init__(self, dtype):
        self._dtype = dtype

    def get_dtype(self):
        return self._dtype


def test_inductor_buffers_key_like_the_tensors_they_stand_for():
    ka._memo.clear()
    analysis = Analysis()
    memo = ka.memoized(analysis)
    k = _kernel("ep_fuse.providers.triton.fake")
    memo(k, _args(), {})
    boxed = {**_args(), "x": Box(torch.bfloat16), "out": Box(torch.bfloat16)}
    memo(k, boxed, {})
    memo(k, {**boxed, "x": Box(torch.bfloat16)}, {})
    assert analysis.calls == 1
    memo(k, {**boxed, "x": Box(torch.float32)}, {})
    assert analysis.calls == 2


def test_copies_of_a_jit_function_share_analyses_and_other_sources_do_not():
    """Inductor analyses copies of the kernel object (one per tracing): a JITFunction keys on its name and
    source, an object without source (an Autotuner) on its identity."""
    ka._memo.clear()
    analysis = Analysis()
    memo = ka.memoized(analysis)
    src = "def k(X, out, N, M, BLOCK):\n    pass\n"
    memo(_kernel("ep_fuse.providers.triton.fake", src), _args(), {})
    memo(_kernel("ep_fuse.providers.triton.fake", src), _args(), {})
    assert analysis.calls == 1
    memo(_kernel("ep_fuse.providers.triton.fake", src + "    # edited\n"), _args(), {})
    memo(_kernel("ep_fuse.providers.triton.other", src), _args(), {})
    assert analysis.calls == 3
    tuner = _kernel("ep_fuse.providers.triton.fake")
    memo(tuner, _args(), {})
    memo(tuner, _args(), {})
    memo(_kernel("ep_fuse.providers.triton.fake"), _args(), {})
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

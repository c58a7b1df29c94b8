"""The memo of Inductor's Triton access analysis (``ep_fuse.kernel_analysis``): one analysis per signature."""

import types

import pytest
import sympy
import torch

from ep_fuse import kernel_analysis as ka

SRC = "def k(X, out, N, M, BLOCK):\n    pass\n"
OURS = "ep_fuse.providers.triton.fake"


def _kernel(module: str = OURS, src: str | None = SRC):
    """Shaped like a JITFunction: .fn is the Python function, .src its source (``src=None``: neither)."""
    fn = types.FunctionType((lambda: None).__code__, {}, "k")
    fn.__module__ = module
    return types.SimpleNamespace(fn=fn, **({"src": src} if src is not None else {}))


def _tuner(jit, num_warps=4, **kwargs):
    """Shaped like the one-config Autotuner wrap_triton makes of a launch with launch options."""
    cfg = types.SimpleNamespace(kwargs=kwargs, num_warps=num_warps, num_stages=3, num_ctas=1, maxnreg=None)
    return types.SimpleNamespace(fn=jit, configs=[cfg])


class Analysis:
    def __init__(self):
        self.calls = 0

    def __call__(self, kernel, kwargs, tma):
        self.calls += 1
        return {"writes": sorted(k for k in kwargs if k.startswith("out"))}


@pytest.fixture
def memo():
    """(the memoized stand-in analysis, its call counter), on an empty memo."""
    ka._memo.clear()
    analysis = Analysis()
    yield ka.memoized(analysis), analysis
    ka._memo.clear()


def _args(dtype=torch.bfloat16, n=64, rows=sympy.Symbol("s0")):
    return {"x": torch.empty(2, dtype=dtype), "out": torch.empty(2, dtype=dtype), "N": n, "M": rows, "BLOCK": 32}


def test_one_analysis_per_signature(memo):
    run, analysis = memo
    k = _kernel()
    first = run(k, _args(), {})
    again = run(k, _args(rows=sympy.Symbol("s7") * 3), {})  # any symbolic size: TTIR sees the constant 2
    assert analysis.calls == 1 and first == again and first is not again  # a copy, not the cached object
    run(k, _args(dtype=torch.float16), {})
    run(k, _args(n=128), {})
    run(k, {**_args(), "BLOCK": 64}, {})
    assert analysis.calls == 4


def _params(*names: str, constexpr: tuple[str, ...] = ("BLOCK",)):
    return [types.SimpleNamespace(name=n, is_constexpr=n in constexpr) for n in names]


def test_plain_ints_key_on_their_triton_specialization(memo):
    """Static sizes and strides of a non-constexpr parameter enter the TTIR only through their
    specialization: graphs at other static batch sizes share the analysis; a constexpr keys on its value."""
    run, analysis = memo
    k = _kernel()
    k.params = _params("x", "out", "N", "M", "BLOCK")
    run(k, _args(n=64, rows=32), {})
    run(k, _args(n=4096, rows=512), {})
    run(_tuner(k), _args(n=64, rows=32), {})
    run(_tuner(k), _args(n=128, rows=48), {})  # the Autotuner's inner kernel gives the constexprs
    assert analysis.calls == 2
    for n in (1, 0, 24, 7, 2**31, 2**63):  # Triton's constant 1, other divisibilities, wider types
        run(k, _args(n=n, rows=32), {})
    assert analysis.calls == 8
    run(k, {**_args(n=64, rows=32), "BLOCK": 64}, {})
    assert analysis.calls == 9
    k.params = _params("x", "out", "N", "M", "BLOCK", constexpr=("BLOCK", "N"))  # N constexpr: its value
    run(k, _args(n=64, rows=32), {})
    run(k, _args(n=128, rows=32), {})
    assert analysis.calls == 11


class Box:
    """Like Inductor's TensorBox: get_dtype() works, .dtype does not, and it hashes by identity."""

    def __init__(self, dtype):
        self._dtype = dtype

    def get_dtype(self):
        return self._dtype


def test_inductor_buffers_key_like_the_tensors_they_stand_for(memo):
    run, analysis = memo
    run(_kernel(), _args(), {})
    boxed = {**_args(), "x": Box(torch.bfloat16), "out": Box(torch.bfloat16)}
    run(_kernel(), boxed, {})
    run(_kernel(), {**boxed, "x": Box(torch.bfloat16)}, {})
    assert analysis.calls == 1
    run(_kernel(), {**boxed, "x": Box(torch.float32)}, {})
    assert analysis.calls == 2


def test_kernels_key_on_module_name_and_source_not_identity(memo):
    """Inductor hands the analysis a new object per launch: copies of one source share the analysis."""
    run, analysis = memo
    run(_kernel(), _args(), {})
    run(_kernel(), _args(), {})
    assert analysis.calls == 1
    run(_kernel(src=SRC + "    # edited\n"), _args(), {})
    run(_kernel("ep_fuse.providers.triton.other"), _args(), {})
    assert analysis.calls == 3


def test_one_config_autotuners_key_on_their_kernel_and_config(memo):
    run, analysis = memo
    run(_tuner(_kernel()), _args(), {})
    run(_tuner(_kernel()), _args(), {})  # a fresh wrapper of the same launch
    assert analysis.calls == 1
    run(_tuner(_kernel(), num_warps=8), _args(), {})
    run(_tuner(_kernel(), BLOCK_K=64), _args(), {})  # config kwargs enter the TTIR
    run(_kernel(), _args(), {})  # the bare JITFunction
    assert analysis.calls == 4


def test_tma_metadata_is_part_of_the_key(memo):
    run, analysis = memo
    run(_kernel(), _args(), {"x": ("stable", ([64, 64],))})
    run(_kernel(), _args(), {"x": ("stable", ([64, 128],))})
    run(_kernel(), _args(), {"x": ("stable", ([64, 64],))})
    assert analysis.calls == 2


@pytest.mark.parametrize("kernel, args", [
    (_kernel("user_code"), _args()),  # not ep_fuse's
    (_kernel(src=None), _args()),  # neither a JITFunction nor a wrapper of one
    (_kernel(), {**_args(), "shape": [1, 2]}),  # an unhashable argument
], ids=["theirs", "no-source", "unhashable"])
def test_what_cannot_be_keyed_is_analysed_every_time(memo, kernel, args):
    run, analysis = memo
    run(kernel, args, {})
    run(kernel, args, {})
    assert analysis.calls == 2


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


def _launch_sites_share_one_analysis() -> None:
    import importlib

    from torch._higher_order_ops import triton_kernel_wrap as tkw
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.library import wrap_triton

    pk = importlib.import_module("ep_fuse.providers.triton.moe_permute_kernel")
    kernels = []

    def analysis(kernel, kwargs, tma):  # stands in for TTIR generation, which needs a GPU target
        kernels.append(kernel)
        if name == "identify_mutated_tensors":
            return ["OUT"]
        from torch._inductor.dependencies import ReadWrites, StarDep
        from torch.utils._ordered_set import OrderedSet

        return tkw.TensorAccesses(ReadWrites(reads=OrderedSet(), writes=OrderedSet([StarDep("OUT")]),
                                             index_exprs=OrderedSet()), can_fuse_epilogue=False)

    name = next(n for n in ka._ANALYSES if hasattr(tkw, n))
    setattr(tkw, name, analysis)
    bf16 = torch.bfloat16

    def layers(y, s2d, w):
        outs = []
        for _ in range(3):
            out = torch.empty(4, 64, dtype=bf16, device=y.device)
            pk.launch_unpermute(y, s2d, w, 2, out, bf16, wrap=wrap_triton)
            outs.append(out)
        return outs

    def args(row_stride: int):  # the rows of ``y`` read through their stride, an int argument of the kernel
        with FakeTensorMode():
            y = torch.empty_strided((8, 64), (row_stride, 1), dtype=bf16, device="cuda")
            return (y, torch.zeros(8, dtype=torch.int64, device="cuda"), torch.empty(4, 2, dtype=bf16, device="cuda"))

    ka._memo.clear()
    with ka.memoized_access_analysis() as block:
        for row_stride in (64, 128):  # two static strides, both i32 and multiples of 16: one specialization
            make_fx(torch.func.functionalize(layers), tracing_mode="fake")(*args(row_stride))
    assert (block.computed, block.served) == (1, 5), block
    with ka.memoized_access_analysis() as block:
        make_fx(torch.func.functionalize(layers), tracing_mode="fake")(*args(72))  # 16 does not divide 72
    assert (block.computed, block.served) == (1, 2), block
    assert type(kernels[0]).__name__ == "Autotuner" and kernels[0].fn is pk._unpermute_kernel


def test_launches_with_options_share_one_analysis_across_sites_and_traces():
    """A real ep_fuse launch through ``wrap_triton`` (fake CUDA tensors, functionalized like AOT does, twice):
    torch hands the analysis a fresh one-config Autotuner per launch (the launch's ``num_warps``); the memo
    still computes one analysis for the three identical sites over two traces at two row strides that
    Triton specializes alike, and a new one for a stride it does not. Run in a process without the
    Triton interpreter (``wrap_triton`` takes ``triton.jit`` kernels only; defining them needs no GPU)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            "import test_kernel_analysis as t; t._launch_sites_share_one_analysis(); print('ok')")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]

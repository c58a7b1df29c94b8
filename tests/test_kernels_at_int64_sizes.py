"""The kernels Inductor inlines at symbolic sizes compile when it passes those sizes as 64-bit integers.

Inductor types a symbolic size argument of an inlined (``wrap_triton``) launch ``i64`` unless it can prove the
size fits int32, which it cannot for the unbacked batch of ``ep_fuse.dynamic_batch``. A kernel that mixes
such an argument into an int32 loop-carried value, or into a TMA coordinate, then fails to compile in
Inductor's worker (seen on H200: the tile-table kernel, "Loop-carried variable tiles_before has initial type
int32 but is re-assigned to int64"). Here every launch of the symbolic-inline ops, of the ``<op>_by_size``
branches and of the Hopper TMA kernels (at their GPU configs) is recorded at an unbacked token count and its
TTIR generated for an sm_90 target with every symbolic argument typed ``i64``, as Inductor types it.

TTIR generation needs ``triton.jit`` kernels (not the interpreter's) but no GPU: it runs in a subprocess
without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

_TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64",
                 torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}


def _signature(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[dict[str, str], dict[Any, Any]]:
    """Triton's ``(signature, constexprs)`` of a launch, a symbolic integer typed ``i64`` as Inductor types it."""
    bound = dict(zip(fn.arg_names, args))
    bound.update({n: v for n, v in kwargs.items() if n in fn.arg_names})
    sig: dict[str, str] = {}
    consts: dict[Any, Any] = {}
    for i, (name, param) in enumerate(zip(fn.arg_names, fn.params)):
        v = bound[name] if name in bound else param.default
        if param.is_constexpr or v is None:
            sig[name], consts[(i,)] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[name] = "*" + _TRITON_TYPES[v.dtype]
        elif isinstance(v, torch.SymInt):
            sig[name] = "i64"
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            sig[name] = "i32" if -2**31 <= v < 2**31 else "i64"
        elif isinstance(v, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {name} of type {type(v).__name__}")
    return sig, consts


def _ttir(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Generate the launch's TTIR for sm_90 (raises Triton's compilation error)."""
    import triton
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    fn = kernel if isinstance(kernel, triton.JITFunction) else kernel.fn  # an Autotuner wraps the JITFunction
    target = GPUTarget("cuda", 90, 32)
    backend = triton.compiler.compiler.make_backend(target)
    options = backend.parse_options({k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    sig, consts = _signature(fn, args, kwargs)
    ASTSource(fn, sig, consts, {}).make_ir(target, options, backend.get_codegen_implementation(options),
                                           backend.get_module_map(), context)


def _record_all() -> list[tuple[str, Any, tuple[Any, ...], dict[str, Any]]]:
    """Every launch of the inlined kernels at an unbacked token count: ``(case, kernel, args, kwargs)``."""
    import test_symbolic_launch as tsl
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    import ep_fuse.catalog  # noqa: F401  (registers every kernel, as the backend does)
    from ep_fuse.providers.triton import provider
    from ep_fuse.providers.triton import size_branches as sb

    tma = importlib.import_module("ep_fuse.providers.triton.grouped_gemm_tma_kernel")
    bf16 = torch.bfloat16

    def symbolic_op(op: str, args: tuple[Any, ...]) -> Callable[[Any, Any], None]:
        def call(tokens: Any, rec: tsl._Recorder) -> None:
            fake = [tsl._symbolic_like(a, tokens) if isinstance(a, torch.Tensor) and a.dim() else a for a in args]
            provider.SYMBOLIC_INLINE[op](*fake, wrap=rec)
        return call

    def by_size(op: str, args: tuple[Any, ...]) -> Callable[[Any, Any], None]:
        def call(tokens: Any, rec: tsl._Recorder) -> None:
            fake = tuple(tsl._symbolic_like(a, tokens) for a in args)
            sb.run_by_size(op, fake, rec, cond=lambda pred, take, other, ops: (take(*ops), other(*ops))[0])
        return call

    def grouped_tma(e: int, swiglu: bool) -> Callable[[Any, Any], None]:  # the GPU config, not the interpreter's
        def call(tokens: Any, rec: tsl._Recorder) -> None:
            m, n, k = tokens * 4, 128, 256
            x, y = torch.empty(m, k, dtype=bf16), torch.empty(m, n, dtype=bf16)
            w = torch.empty(e, 2 * n if swiglu else n, k, dtype=bf16)
            seg = torch.empty(e + 1, dtype=torch.int64)
            launch = tma.launch_grouped_gemm_swiglu_tma if swiglu else tma.launch_grouped_gemm_tma
            launch(x, w, seg, y, tma.config_for(4096, n, k, e, swiglu=swiglu, interpret=False), wrap=rec)
        return call

    def dense_tma(tokens: Any, rec: tsl._Recorder) -> None:
        x, y = torch.empty(tokens * 3, 256, dtype=bf16), torch.empty(tokens * 3, 128, dtype=bf16)
        wg, wu = torch.empty(128, 256, dtype=bf16), torch.empty(128, 256, dtype=bf16)
        tma.launch_gemm_swiglu_tma(x, wg, wu, y, tma.dense_config_for(4096, 128, 256, interpret=False), wrap=rec)

    cases = {f"{op}[{i}]": symbolic_op(op, make()) for op, makers in tsl.CASES.items()
             for i, make in enumerate(makers)}
    cases.update({case: by_size(*make()) for case, make in tsl.BY_SIZE_CASES.items()})
    cases.update({f"tma E{e}{' swiglu' if swiglu else ''}": grouped_tma(e, swiglu)
                  for e in (8, 64) for swiglu in (False, True)})
    cases["dense tma"] = dense_tma
    out = []
    for case, call in cases.items():
        env = ShapeEnv()
        rec = tsl._Recorder(probe=False)
        with FakeTensorMode(shape_env=env):
            call(env.create_unbacked_symint(), rec)
        assert rec.calls, f"{case}: no launch recorded"
        out += [(case, kernel, args, kwargs) for kernel, args, kwargs in rec.calls]
    return out


def _check_all() -> None:
    """Subprocess body: print one tab-separated line per launch (``ok`` or ``FAIL``, case, kernel, the
    arguments typed ``i64``, the compile error), then ``done``."""
    import triton

    for case, kernel, args, kwargs in _record_all():
        fn = kernel if isinstance(kernel, triton.JITFunction) else kernel.fn
        wide = [n for n, t in _signature(fn, args, kwargs)[0].items() if t == "i64"]
        try:
            _ttir(kernel, args, kwargs)
            print(f"ok\t{case}\t{fn.__name__}\ti64={','.join(wide)}")
        except Exception as exc:  # noqa: BLE001 -- reported to the test
            print(f"FAIL\t{case}\t{fn.__name__}\ti64={','.join(wide)}: {' '.join(str(exc).split())[-600:]}")
    print("done")


def _in_subprocess(body: str) -> list[str]:
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import {Path(__file__).stem} as t; {body}"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    lines = run.stdout.strip().splitlines()
    assert run.returncode == 0 and lines and lines[-1] == "done", run.stderr[-3000:]
    return lines[:-1]


def test_inlined_kernels_compile_with_64_bit_sizes() -> None:
    lines = _in_subprocess("t._check_all()")
    rows = [ln.split("\t") for ln in lines]
    failed = [ln for ln, row in zip(lines, rows) if row[0] != "ok"]
    assert not failed, "\n".join(failed)
    kernels = {row[2] for row in rows}
    assert {"_row_kernel", "rope_jit", "_gating_kernel", "_scatter_rows_kernel", "_unpermute_kernel",
            "_grouped_gemm_kernel", "_gemm_swiglu_kernel", "_tile_table_kernel",
            "_grouped_gemm_tma_kernel"} <= kernels, kernels
    # the check means something only where a symbolic size reaches the kernel as an argument
    wide = {row[2] for row in rows if row[3] != "i64="}
    assert {"_tile_table_kernel", "_grouped_gemm_tma_kernel", "_grouped_gemm_kernel", "_row_kernel"} <= wide, lines


def _int32_carry_kernel_source() -> str:
    return inspect.cleandoc('''
        import triton
        import triton.language as tl


        @triton.jit
        def carry(OUT, M, BLOCK: tl.constexpr):
            acc = tl.zeros([BLOCK], dtype=tl.int32)
            for i in range(4):
                acc += tl.minimum(tl.arange(0, BLOCK) + i, M)
            tl.store(OUT + tl.arange(0, BLOCK), acc)
        ''')


def _check_negative(path: str) -> None:
    """Subprocess body: the int32 loop-carried kernel compiles with ``M`` as an int, fails with it symbolic."""
    spec = importlib.util.spec_from_file_location("carry_kernel", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    out = torch.empty(16, dtype=torch.int32)
    _ttir(mod.carry, (out, 37), {"BLOCK": 16})
    print("ok int")
    try:
        _ttir(mod.carry, (out, ShapeEnv().create_unbacked_symint()), {"BLOCK": 16})
        print("ok symbolic")
    except Exception as exc:  # noqa: BLE001
        print("FAIL symbolic", " ".join(str(exc).split())[-300:])
    print("done")


def test_the_check_catches_an_int32_loop_carry(tmp_path) -> None:
    """The check is not vacuous: the pattern that failed on H200 (an int32 accumulator meeting an i64 size
    in a loop) fails it, and passes with a plain int."""
    path = tmp_path / "carry_kernel.py"  # a file: triton.jit reads the kernel's source
    path.write_text(_int32_carry_kernel_source() + "\n")
    lines = _in_subprocess(f"t._check_negative({str(path)!r})")
    assert lines[0] == "ok int" and lines[1].startswith("FAIL symbolic") and "int64" in lines[1], lines

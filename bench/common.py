"""Shared helpers for the GPU benchmarks: arguments, JSON results, timing, ceilings, environment, tables.

Every ``bench_<family>.py`` builds its parser with :func:`bench_parser` (its docstring as ``--help``, plus
``--json PATH``), calls :func:`start` after parsing (records the JSON path, and exits with
:data:`NO_CUDA_EXIT` and a one-line message where the bench needs CUDA and there is none), and writes its
results with :func:`write_json` (``$OUT/<name>``; with ``--json`` also every payload of the run in one file).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import platform
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


ROOT = Path(__file__).resolve().parent.parent
"""The repository root (the benches run from a checkout; they import the installed ``ep_fuse``)."""


def test_support(name: str) -> types.ModuleType:
    """The module ``tests/support/<name>.py`` (the hand-written model forms the tests compile), loaded from its file:
    benches time the same forms the tests check, without putting ``tests/`` on ``sys.path``."""
    path = ROOT / "tests" / "support" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"ep_fuse_bench_support_{name}", path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"{path}: run the bench from a checkout of the repository (tests/support/ is not installed)")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def out_dir() -> Path:
    p = Path(os.environ.get("OUT", "bench_out"))
    p.mkdir(parents=True, exist_ok=True)
    return p


def env_info() -> dict[str, Any]:
    import triton

    info = {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, sms=p.multi_processor_count, mem_gib=round(p.total_memory / 2**30))
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except Exception:
        pass
    try:
        from importlib.metadata import version

        import liger_kernel  # noqa: F401

        info["liger_kernel"] = version("liger-kernel")
    except Exception:
        pass
    return info


def bench_us(fn: Callable[[], Any], warmup_ms: int = 50, rep_ms: int = 300) -> float:
    """Median time of ``fn()`` in µs (CUDA events, ``triton.testing.do_bench``)."""
    from triton.testing import do_bench

    return 1000.0 * do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def bench_graph_us(fn: Callable[[], Any]) -> float:
    """Median GPU time of ``fn`` replayed from a captured CUDA graph (no CPU launch overhead)."""
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench_us(graph.replay)


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    us = bench_us(lambda: dst.copy_(src))
    return 2 * nbytes / (us * 1e-6) / 1e9


def dense_gemm_tflops(shapes: tuple[tuple[int, int, int], ...] = ((8192, 8192, 8192), (16384, 16384, 8192),
                                                                   (4096, 16384, 16384))) -> float:
    """Dense bf16 GEMM throughput (cuBLAS), the best of ``(m, n, k)`` shapes, in TF/s: the compute ceiling of a run."""
    best = 0.0
    for m, n, k in shapes:
        a = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        b = torch.randn(k, n, dtype=torch.bfloat16, device="cuda")
        us = bench_us(lambda a=a, b=b: a @ b)
        best = max(best, 2 * m * n * k / (us * 1e-6) / 1e12)
        del a, b
    return best


NO_CUDA_EXIT = 77
"""Exit status of a bench that needs CUDA on a machine without it (``bench/run.py`` reports it as skipped)."""

_json_path: Path | None = None
_json_payloads: dict[str, Any] = {}


def add_json_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--json", metavar="PATH", default=None,
                    help="also write every result of this run as one JSON file "
                         "({'script', 'argv', 'results': {name: payload}}; bench/run.py reads it)")


def bench_parser(doc: str | None = None, **kw: Any) -> argparse.ArgumentParser:
    """An argument parser whose ``--help`` prints ``doc`` (the bench's module docstring), with ``--json PATH``."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter, **kw)
    add_json_arg(ap)
    return ap


def set_json_path(path: str | os.PathLike[str] | None) -> None:
    """Every later :func:`write_json` also (re)writes ``path`` with all payloads of this run so far."""
    global _json_path
    _json_path = Path(path) if path else None
    if _json_path is not None:
        _json_path.parent.mkdir(parents=True, exist_ok=True)


def require_cuda(what: str | None = None) -> None:
    """Exit with :data:`NO_CUDA_EXIT` and a clear message when CUDA is not available."""
    if not torch.cuda.is_available():
        name = what or Path(sys.argv[0]).name
        print(f"{name}: needs a CUDA GPU, and torch {torch.__version__} sees none "
              f"(torch.cuda.is_available() is False); on this machine only --help runs", file=sys.stderr)
        raise SystemExit(NO_CUDA_EXIT)


def start(args: argparse.Namespace, needs_cuda: bool = True) -> None:
    """After parsing: record ``--json`` and check for CUDA (see the module docstring)."""
    set_json_path(getattr(args, "json", None))
    if needs_cuda:
        require_cuda()


def write_json(name: str, payload: Any) -> Path:
    """``$OUT/<name>``; with ``--json PATH`` also PATH, holding every payload written so far in this run."""
    path = out_dir() / name
    path.write_text(json.dumps(payload, indent=2, default=str))
    if _json_path is not None:
        _json_payloads[name.removesuffix(".json")] = payload
        _json_path.write_text(json.dumps({"script": Path(sys.argv[0]).name, "argv": sys.argv[1:],
                                          "results": _json_payloads}, indent=2, default=str))
    return path


def balanced_topk_ids(t: int, k: int, e: int, device: Any) -> torch.Tensor:
    """Top-k expert ids ``[t, k]`` that give every expert exactly ``t * k / e`` rows: token ``i``'s ``j``-th
    expert is ``(i * k + j) mod e`` (distinct per token for ``k <= e``). The no-ragged-groups routing of
    ``--balanced``."""
    assert (t * k) % e == 0 and k <= e, f"balanced routing needs e | t*k and k <= e (t={t}, k={k}, e={e})"
    return (torch.arange(t, device=device)[:, None] * k + torch.arange(k, device=device)) % e


def tma_config_fields(items: list[str]) -> dict[str, Any]:
    """``["field=value", ...]`` -> ``TmaGemmConfig`` field values (bools as 0/1, ints, strings as given)."""
    from ep_fuse.providers.triton.grouped_gemm_tma_kernel import TmaGemmConfig

    kinds = {f.name: f.type for f in dataclasses.fields(TmaGemmConfig)}
    out: dict[str, Any] = {}
    for item in items:
        key, value = item.split("=")
        kind = kinds[key]  # KeyError: not a TmaGemmConfig field
        out[key] = value if kind in (str, "str") else bool(int(value)) if kind in (bool, "bool") else int(value)
    return out


def markdown_table(head: list[str], rows: list[list[Any]]) -> str:
    def fmt(v: Any) -> str:
        if v is None:
            return "—"
        if isinstance(v, float):
            return f"{v:.1f}"
        return str(v)

    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(fmt(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def check_hf_models(runs: list[tuple[str, bool]], options: dict[str, Any] | None = None, rtol: float = 0.03) -> list[str]:
    """Compile tiny HF models on CUDA with ep_fuse; check site counts and logits against eager.

    ``runs`` lists ``(model name, dynamic)``. Returns one line per run, with any provider declines.
    """
    import ep_fuse
    from ep_fuse.testing import tiny as tiny_models

    done = []
    for name, dynamic in runs:
        torch._dynamo.reset()
        ep_fuse.reset_reports()
        model = tiny_models.build(name, device="cuda")
        inp = tiny_models.example_inputs(device="cuda")
        with torch.no_grad():
            ref = model(**inp).logits
            out = torch.compile(model, backend="ep_fuse", dynamic=dynamic, options=options)(**inp).logits
        rep = ep_fuse.last_report()
        sites, _variant = tiny_models.EXPECTED_SITES[name]
        assert rep.counts() == sites, rep
        scale = ref.float().abs().max().item()
        torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=rtol * scale)
        declined = sorted({f"{m.pattern}[{m.variant}]: {m.declined}" for m in rep.matches if m.provider != "triton"})
        done.append(f"{name} dynamic={dynamic}: {rep.summary()} maxdiff={(out.float() - ref.float()).abs().max().item():.4f}"
                    + (f" declined: {declined}" if declined else ""))
    return done

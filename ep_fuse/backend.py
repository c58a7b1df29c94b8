"""The ``torch.compile`` backend: Dynamo graph -> AOT ATen graph -> ep_fuse passes -> executor.

Matching happens on the functionalized ATen graph *before* any decomposition (``docs/architecture.md``:
Inductor's own custom-pass hooks only see decomposed forms such as ``silu`` -> ``neg/exp/add/div``). The rewritten graph then goes to an executor:

* ``inductor``: ``compile_fx`` on the rewritten ATen graph. Inductor re-traces it with its own
  decompositions; ep_fuse ops are opaque custom ops and survive. Dynamo's input metadata is copied
  over so parameters stay static inputs (CUDA graphs do not copy them each replay).
* ``eager``: the rewritten ATen graph runs op by op (Ascend, debugging).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

import ep_fuse
import ep_fuse.catalog  # noqa: F401  (every op, provider, engine and pattern)
from ep_fuse import runtime
from ep_fuse.config import ConfigError, EpFuseConfig, default_config
from ep_fuse.dump import Dumper
from ep_fuse.kernel_analysis import memoized_access_analysis
from ep_fuse.log import configure_from_env
from ep_fuse.pipeline import run_passes
from ep_fuse.report import GraphReport, InductorHandoff, record

log = logging.getLogger("ep_fuse")
_graph_counter = itertools.count()

INDUCTOR_DEVICES = ("cpu", "cuda")


def build_config(options: dict[str, Any] | None = None, mode: str | None = None) -> EpFuseConfig:
    """``options`` (and ``torch.compile``'s ``mode``) as a config, every value and name checked, the names against
    the catalog's registries (:meth:`EpFuseConfig.check_names`); raises :class:`ConfigError`."""
    return EpFuseConfig.from_options(options, mode).check_names(**ep_fuse.catalog.known_names())


def ep_fuse_backend(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    mode: str | None = None,
    options: dict[str, Any] | None = None,
) -> Callable[..., Any]:
    """Entry point of ``torch.compile(model, backend="ep_fuse", mode=..., options={...})``."""
    config = build_config(options, mode)
    return compile_graph(gm, example_inputs, config)


def make_backend(**options: Any) -> Callable[..., Any]:
    """A backend with ``options`` validated now: ``torch.compile(m, backend=ep_fuse.make_backend(executor="eager"))``."""
    config = build_config(options)

    def backend(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
        cfg = config
        if kwargs.get("mode") or kwargs.get("options"):
            cfg = build_config({**_as_options(config), **(kwargs.get("options") or {})}, kwargs.get("mode"))
        return compile_graph(gm, example_inputs, cfg)

    backend.__name__ = "ep_fuse"
    return backend


def _as_options(config: EpFuseConfig) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in config.__dataclass_fields__:
        value = getattr(config, name)
        if name == "providers":
            value = {d: list(o) for d, o in value}
        elif name == "inductor_config":
            value = dict(value)
        out[name] = value
    return out


def graph_device(example_inputs: Sequence[Any]) -> str:
    """The accelerator the graph runs on: cuda or npu if any input lives there, else cpu."""
    types = {x.device.type for x in example_inputs if isinstance(x, torch.Tensor)}
    for dev in ("cuda", "npu"):
        if dev in types:
            return dev
    return "cpu" if types <= {"cpu"} else sorted(types - {"cpu"})[0]


def resolve_executor(config: EpFuseConfig, device: str) -> str:
    if config.executor == "auto":
        return "inductor" if device in INDUCTOR_DEVICES else "eager"
    if config.executor == "inductor" and device not in INDUCTOR_DEVICES:
        raise ConfigError(
            f"ep_fuse: executor='inductor' does not support device {device!r}; use executor='eager' or 'auto'."
        )
    return config.executor


def _graph_id(gm: fx.GraphModule) -> str:
    """Dynamo's compile id (``frame/recompile``): a re-run of the backend on the same frame keeps it."""
    from torch._guards import CompileContext

    cid = gm.meta.get("dynamo_compile_id") or CompileContext.current_compile_id()
    return str(cid) if cid is not None else f"g{next(_graph_counter)}"


def _needs_autograd(example_inputs: Sequence[Any]) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs
    )


def drop_grad_off_frame(gm: fx.GraphModule) -> bool:
    """Whether the whole body of a graph compiled with grad mode on runs with grad off -- its first call is
    ``_set_grad_enabled(False)``, its last ``_set_grad_enabled(True)`` and no other call sets grad mode (a forward
    decorated with ``torch.no_grad()``, or rebound to one by ``ep_fuse.prepare``). If so, both calls are removed
    from ``gm`` (the caller compiles and runs it under ``torch.no_grad()``)."""
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    modes = [n for n in calls if n.op == "call_function" and n.target is torch._C._set_grad_enabled]
    if (len(calls) < 3 or modes != [calls[0], calls[-1]] or calls[0].args != (False,) or calls[-1].args != (True,)
            or calls[0].users or calls[-1].users):
        return False
    for n in modes:
        gm.graph.erase_node(n)
    gm.recompile()
    return True


def compile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], config: EpFuseConfig) -> Callable[..., Any]:
    """Compile one Dynamo graph with ``config`` (no global state is changed).

    ``config``'s behaviour switches (:data:`ep_fuse.config.SWITCHES`) are the active ones
    (:func:`ep_fuse.runtime.use_config`) while the graph is rewritten and compiled, and around every call of the
    compiled graph (the run-time choices of its ops: the EP engines' kernels, the NPU weight layout, ...). A graph
    whose whole body runs with grad off (:func:`drop_grad_off_frame`) is compiled and run under ``torch.no_grad()``,
    so it is fused although it was entered with grad mode on."""
    no_grad = _needs_autograd(example_inputs) and drop_grad_off_frame(gm)
    with runtime.use_config(config), torch.set_grad_enabled(not no_grad and torch.is_grad_enabled()):
        compiled = _compile_graph(gm, example_inputs, config)
    return _runs_under(config, compiled, no_grad)


def _runs_under(config: EpFuseConfig, compiled: Callable[..., Any], no_grad: bool = False) -> Callable[..., Any]:
    """``compiled``, called with ``config`` active (same calling convention, boxed or not), with grad off if
    ``no_grad``."""

    active = runtime.ACTIVE_CONFIG

    def run(*args: Any) -> Any:  # (use_config without the generator: this runs on every call)
        token = active.set(config)
        try:
            if no_grad:
                with torch.no_grad():
                    return compiled(*args)
            return compiled(*args)
        finally:
            active.reset(token)

    if getattr(compiled, "_boxed_call", False):
        run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _compile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], config: EpFuseConfig) -> Callable[..., Any]:
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    configure_from_env()
    device = graph_device(example_inputs)
    executor = resolve_executor(config, device)
    if config.mode and executor != "inductor":
        log.warning("ep_fuse: mode=%r only applies to the Inductor executor; executor=%s ignores it",
                    config.mode, executor)
    report = GraphReport(graph=_graph_id(gm), device=device, executor=executor)

    if _needs_autograd(example_inputs):
        report.skipped = ("the graph needs autograd (an input requires grad and grad mode is on): ep_fuse's fusions "
                          "are inference-only and its ops have no backward, so nothing is fused (run under "
                          "torch.no_grad() / torch.inference_mode(), or model.eval() with requires_grad_(False))")
        record(report)
        _warn_once_per_process(f"ep_fuse: graph {report.graph}: {report.skipped}")
        if executor == "inductor":
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs, config_patches=inductor_patches(config))
        from torch._dynamo.backends.common import aot_autograd

        return aot_autograd(fw_compiler=_boxed_forward)(gm, example_inputs)

    # 1. capture: AOT traces the functional ATen graph; its compiler only records it and hands
    #    back a forwarding stub, so no decision about execution is taken inside AOT.
    captured: dict[str, Any] = {}
    impl: list[Callable[..., Any]] = []

    def capture(aten_gm: fx.GraphModule, aten_inputs: Sequence[Any]) -> Callable[..., Any]:
        from torch._guards import TracingContext

        ctx = TracingContext.try_get()
        captured.update(gm=aten_gm, inputs=list(aten_inputs), meta=ctx.fw_metadata if ctx else None)
        return make_boxed_func(lambda *args: impl[0](*args))

    t0 = time.perf_counter()
    wrapped = aot_module_simplified(
        gm, example_inputs, fw_compiler=capture, inference_compiler=capture, decompositions={},
        keep_inference_input_mutations=True,
    )
    # 2. rewrite
    report.compile_seconds["capture"] = time.perf_counter() - t0
    aten_gm = captured["gm"]
    dumper = Dumper.for_config(config, report.graph)
    dumper.graph("00_dynamo", gm)
    t0 = time.perf_counter()
    run_passes(aten_gm, config, report, dumper, inputs=_static_inputs(captured, example_inputs))
    report.compile_seconds["rewrite"] = time.perf_counter() - t0
    record(report)
    if executor == "eager":
        impl.append(aten_gm.forward)  # bound after the rewrite recompiled the module
        return wrapped
    # 3. Inductor. When the ATen graph has Dynamo's signature (its inputs in order, fresh outputs, and
    #    any input mutation -- static KV cache, counters -- kept in the graph as a copy_), hand it to
    #    Inductor directly: one runtime wrapper and the same static-input / CUDA-graph decisions as
    #    backend="inductor". Otherwise Inductor compiles behind AOT's wrapper, which replays mutations
    #    and aliasing it cannot express in the graph.
    from torch._inductor.compile_fx import compile_fx

    patches = cudagraphs_off_thread(inductor_patches(config), device)
    tag = torch.compiler.config.cache_key_tag
    cache_tag = f"{tag}|{ep_fuse_cache_tag(config)}" if tag else ep_fuse_cache_tag(config)
    why = _not_direct(captured, example_inputs)
    report.inductor = _handoff(captured, why)
    if not report.inductor.cudagraph_safe_mutations:
        log.info("ep_fuse: graph %s mutates inputs %s that are not static addresses %s: Inductor skips CUDA "
                 "graphs for it (as backend='inductor' would)", report.graph, report.inductor.mutated_inputs,
                 report.inductor.static_inputs)
    t0 = time.perf_counter()
    with torch.compiler.config.patch(cache_key_tag=cache_tag), memoized_access_analysis() as analyses:
        # (no cached graph of another ep_fuse; one Triton access analysis per kernel signature)
        if why is None:
            copy_dynamo_metadata(gm, aten_gm)
            compiled = compile_fx(aten_gm, captured["inputs"], config_patches=patches)
        else:
            log.info("ep_fuse: graph %s: Inductor compiles behind ep_fuse's AOT wrapper: %s", report.graph, why)
            impl.append(compile_fx(aten_gm, captured["inputs"], config_patches=patches))
            compiled = wrapped
    report.compile_seconds["inductor"] = time.perf_counter() - t0
    report.kernel_analyses = dict(computed=analyses.computed, served=analyses.served, seconds=analyses.seconds)
    log.info("ep_fuse: graph %s compiled in %s (Triton access analyses: %d computed in %.2f s, %d from the memo)",
             report.graph, ", ".join(f"{k} {v:.2f} s" for k, v in report.compile_seconds.items()),
             analyses.computed, analyses.seconds, analyses.served)
    return compiled


_WARNED: set[str] = set()


def _warn_once_per_process(message: str, kind: str = "autograd") -> None:
    """One WARNING for the first graph of ``kind`` in a process (the report of every such graph says it too)."""
    if kind not in _WARNED:
        _WARNED.add(kind)
        log.warning("%s", message)


@functools.lru_cache(maxsize=1)
def _source_tag() -> str:
    """``ep_fuse-<version>-<hash of its sources>``."""
    import ep_fuse.patterns as patterns  # the package's own modules, read as files

    digest = hashlib.sha256()
    for root in {Path(ep_fuse.__file__).parent, Path(patterns.__file__).parent}:
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return f"ep_fuse-{getattr(ep_fuse, '__version__', '0')}-{digest.hexdigest()[:16]}"


def ep_fuse_cache_tag(config: EpFuseConfig | None = None) -> str:
    """``ep_fuse-<version>-<hash of its sources><config.cache_key()>``, added to
    ``torch.compiler.config.cache_key_tag`` while Inductor compiles a graph rewritten under ``config`` (``None``:
    the default config, :func:`ep_fuse.config.default_config`): Inductor's FX-graph and AOTAutograd caches key
    a graph on its code, not on the fake (meta) functions of the custom ops in it nor on how their launches are
    traced, so a graph cached by another ep_fuse (other output strides of an op, say), or under other inline
    switches of the config (``size_branches=False``: the opaque ``<op>_by_size`` op instead of branches), would
    otherwise be reused and fail, or be wrong."""
    return _source_tag() + (config if config is not None else default_config()).cache_key()


def _handoff(captured: dict[str, Any], why: str | None) -> InductorHandoff:
    """What Inductor will see of the graph's inputs: the mutated ones, and the static ones (Dynamo's
    marks reach Inductor only through the direct hand-off, which copies them onto the ATen graph)."""
    meta = captured.get("meta")
    mutated = [i for i, info in enumerate(meta.input_info) if info.mutates_data] if meta is not None else []
    static = sorted(int(i) for i in getattr(meta, "static_input_indices", None) or ()) if why is None else []
    return InductorHandoff(direct=why is None, reason=why or "", mutated_inputs=mutated, static_inputs=static)


def _not_direct(captured: dict[str, Any], example_inputs: Sequence[Any]) -> str | None:
    """Why the rewritten ATen graph cannot stand in for Dynamo's graph (``None``: it can).

    It can when it takes Dynamo's inputs in order, returns fresh tensors, and every input mutation is
    a data mutation AOT kept inside the graph (``MUTATED_IN_GRAPH``): running the graph then does what
    Dynamo's graph does, and Inductor re-derives the same mutation and static-input facts from it."""
    meta = captured.get("meta")
    if meta is None:
        return "no AOT metadata"
    if len(captured["inputs"]) != len(example_inputs):
        return "AOT lifted inputs Dynamo does not pass"
    gm = captured["gm"]
    if any(n.op == "get_attr" for n in gm.graph.nodes) or next(gm.named_buffers(), None) is not None:
        return "lifted constants"
    from torch._functorch._aot_autograd.schemas import MutationType, OutputType

    for i, info in enumerate(meta.input_info):
        if info.mutates_metadata or getattr(info, "mutation_inductor_storage_resize", False):
            return f"input {i} has its metadata or storage size mutated"
        if info.mutates_data and info.mutation_type != MutationType.MUTATED_IN_GRAPH:
            return f"input {i} is mutated outside the graph ({info.mutation_type.name})"
    if getattr(meta, "num_intermediate_bases", 0) or getattr(meta, "tokens", None):
        return "intermediate bases or effect tokens"
    if not all(o.output_type == OutputType.non_alias for o in meta.output_info):
        return "an output aliases an input or another output"
    return None


def _static_inputs(captured: dict[str, Any], example_inputs: Sequence[Any]) -> list[Any] | None:
    """Dynamo's real tensors for the ATen graph's *static* inputs (parameters, buffers), ``None`` for
    the others; ``None`` when the placeholders do not line up with Dynamo's inputs. Passes that need
    weight values at compile time (``quant``) read these; activations are never exposed."""
    meta, fakes = captured.get("meta"), captured["inputs"]
    static = set(getattr(meta, "static_input_indices", None) or ())
    if len(fakes) != len(example_inputs) or not static:
        return None
    out: list[Any] = []
    for i, (fake, real) in enumerate(zip(fakes, example_inputs)):
        if i in static and isinstance(fake, torch.Tensor) and isinstance(real, torch.Tensor):
            if real.dtype != fake.dtype or real.dim() != fake.dim():
                return None
            out.append(real)
        else:
            out.append(None)
    return out


def _boxed_forward(gm: fx.GraphModule, _inputs: Sequence[Any]) -> Callable[..., Any]:
    from functorch.compile import make_boxed_func

    return make_boxed_func(gm.forward)


STATIC_LAUNCH = "static_launch_user_defined_triton_kernels"
"""Inductor launches ep_fuse's inlined (user-defined) Triton kernels with its static CUDA launcher, as it does
its own kernels, instead of building Triton's C launcher for each new signature (a host compiler run of about
0.2 s each on a cold cache). Kernels the static launcher does not take (global scratch, launch attributes)
fall back to Triton's launcher inside Inductor; ``inductor_config={STATIC_LAUNCH: False}`` turns it off."""


def inductor_patches(config: EpFuseConfig) -> dict[str, Any]:
    import torch._inductor.config as inductor_config

    patches: dict[str, Any] = {}
    if hasattr(inductor_config, STATIC_LAUNCH):
        patches[STATIC_LAUNCH] = True
    if config.mode:
        from torch._inductor import list_mode_options

        patches.update(list_mode_options(config.mode))
    patches.update(config.inductor_patches())
    return patches


def cudagraphs_off_thread(patches: dict[str, Any], device: str) -> dict[str, Any]:
    """``patches`` without ``triton.cudagraphs`` (one warning) when CUDA graphs are asked for outside the main
    thread on CUDA: Inductor's CUDA-graph trees keep thread-local state and assert in a worker thread such as
    Hugging Face continuous batching's generation loop, whose own ``use_cuda_graph`` is the path there."""
    main = threading.current_thread() is threading.main_thread()
    if device != "cuda" or not patches.get("triton.cudagraphs") or main:
        return patches
    _warn_once_per_process(
        "ep_fuse: CUDA graphs (mode='reduce-overhead'/'max-autotune') are declined in thread "
        f"{threading.current_thread().name!r}: Inductor's CUDA-graph trees do not run outside the main thread. "
        "The graph is compiled without them; for HF continuous batching use mode='default' and "
        "ContinuousBatchingConfig(use_cuda_graph=True)", kind="cudagraphs_thread")
    return {**patches, "triton.cudagraphs": False}


def copy_dynamo_metadata(dynamo_gm: fx.GraphModule, aten_gm: fx.GraphModule) -> None:
    """Let Inductor see which ATen inputs are parameters (static for CUDA graphs).

    In an inference graph without lifted parameters the AOT placeholders are Dynamo's, in order;
    where the counts differ nothing is copied and Inductor treats every input as dynamic.
    """
    if "dynamo_compile_id" not in dynamo_gm.meta:
        return
    src = list(dynamo_gm.graph.find_nodes(op="placeholder"))
    dst = list(aten_gm.graph.find_nodes(op="placeholder"))
    if len(src) != len(dst) or not all(hasattr(n, "_dynamo_source") for n in src):
        return
    aten_gm.meta["dynamo_compile_id"] = dynamo_gm.meta["dynamo_compile_id"]
    aten_gm._param_name_to_source = {}  # type: ignore[assignment]
    for s, d in zip(src, dst):
        d._dynamo_source = s._dynamo_source  # type: ignore[attr-defined]
        if "tensor_dict" in s.meta:
            d.meta["tensor_dict"] = s.meta["tensor_dict"]

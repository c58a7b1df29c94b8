"""``ep-fuse serve MODEL [options]``: Hugging Face's OpenAI-compatible server (``transformers serve``) with
continuous batching compiled by ep_fuse.

    ep-fuse serve MODEL [--ep-fuse-option KEY=VALUE ...] [any option of ``transformers serve``]
    python -m ep_fuse.serve MODEL [...]

The model is loaded by HF's own model manager, then :func:`prepare_for_serving` applies
:func:`ep_fuse.prepare` and makes both continuous-batching paths (varlen/prefill and decode) compile with
``backend="ep_fuse"`` (:func:`cb_compile_configs`). Every other option (``--cb-*``, ``--attn-implementation``,
``--host``, ``--port``, ``--device``, ``--dtype``, ...) is HF's and is passed through unchanged;
``--continuous-batching`` is implied. On CUDA, HF's own CUDA graphs are on unless ``--cb-use-cuda-graph``
says otherwise, and with them asynchronous batching where the model's attention needs no mask
(:func:`with_ep_fuse_compile`). Needs the ``serving`` extra (``pip install ep-fuse[serving]``).

Two server assemblies of transformers are supported (:data:`SUPPORTED_TRANSFORMERS`): 5.24's, which runs the model
in the server's process (:func:`start` returns HF's ``Serve``, running in a thread), and 5.25's, which runs each
model in a spawned engine process (``EngineClient.start_process``) that loads it with a copy of the server's
``ModelLoader``: there the loader is :class:`EngineLoader` (module-level, picklable), which prepares the model in the
engine, where HF builds the continuous-batching manager and runs its ``warmup()`` (both paths compiled at load);
:func:`start` runs the whole server in a process of its own (:class:`ServerProcess`).

Exit codes: 0 stopped cleanly; 2 bad or unknown option; 3 the model could not be loaded or prepared.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import ep_fuse
from ep_fuse.config import ConfigError, EpFuseConfig, parse_key_values
from ep_fuse.hf import paged_attention

log = logging.getLogger("ep_fuse")

EXIT_OK, EXIT_USAGE, EXIT_MODEL = 0, 2, 3
SUPPORTED_TRANSFORMERS = ("5.24", "5.25")
"""The transformers releases whose ``Serve`` assembly :func:`_hf_serve` was written against and tested with (the
``serving`` extra's bounds in pyproject.toml say the same)."""

_HOOK_LOCK = threading.Lock()
_PREPARE_LOCK = threading.Lock()


class ServeError(Exception):
    """A usage or model error of ``ep-fuse serve``; ``code`` is the exit code."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


# --------------------------------------------------------------------------- compile configs
def cb_compile_configs(options: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """The ``CompileConfig`` of the varlen and of the decode path (the one place the server decides them):
    :func:`ep_fuse.hf.paged_attention.cb_compile_configs` -- ``backend="ep_fuse"``, ``fullgraph=False``,
    no CUDA-graph mode (CUDA graphs are HF's own capture, ``use_cuda_graph``), ``options`` as ep_fuse's options."""
    return paged_attention.cb_compile_configs(options)


def with_ep_fuse_compile(cb_config: Any, options: dict[str, Any] | None = None,
                         use_cuda_graph: bool | None = None, model: Any = None) -> Any:
    """A copy of ``cb_config`` (a ``ContinuousBatchingConfig`` or ``None``) whose unset varlen / decode compile
    configs are :func:`cb_compile_configs`; compile configs the caller set are kept. ``use_cuda_graph`` is the
    value for HF's own CUDA graphs where the caller left ``cb_config.use_cuda_graph`` unset (``None``: HF decides).

    With ``model``: where the caller left ``use_async_batching`` unset, CUDA graphs are on and ``model``'s
    continuous batching builds no attention mask (``ep_fuse::varlen_attention``), asynchronous batching is turned on
    -- HF's own rule (graphs on and no mask), which HF applies only to flash-attention models because it decides
    "no mask" from ``attn_implementation``. The host then prepares batch N+1 while the GPU runs batch N."""
    import copy

    from transformers import ContinuousBatchingConfig

    out = ContinuousBatchingConfig() if cb_config is None else copy.deepcopy(cb_config)
    varlen, decode = cb_compile_configs(options)
    if out.varlen_compile_config is None:
        out.varlen_compile_config = varlen
    if out.decode_compile_config is None:
        out.decode_compile_config = decode
    if out.use_cuda_graph is None and use_cuda_graph is not None:
        out.use_cuda_graph = use_cuda_graph
    if model is not None and getattr(out, "use_async_batching", False) is None:
        reason = async_batching_reason(out, model)
        if reason is None:
            out.use_async_batching = True
            log.info("ep_fuse.serve: asynchronous batching on (CUDA graphs, no attention mask)")
        else:
            log.info("ep_fuse.serve: asynchronous batching left to HF (%s)", reason)
    return out


def async_batching_reason(cb_config: Any, model: Any) -> str | None:
    """Why ``model``'s continuous batching under ``cb_config`` does not take asynchronous batching by default
    (``None``: it does): it needs HF's CUDA graphs set on (a ``bool`` or a per-path pair) and no attention mask."""
    from ep_fuse.hf import varlen_attention

    graphs = cb_config.use_cuda_graph
    if not (graphs is True or (isinstance(graphs, (tuple, list)) and any(graphs))):
        return "CUDA graphs not set on"
    if not _on_cuda(model):
        return "not on CUDA"
    if not varlen_attention.builds_no_mask(model):
        return "the attention needs HF's mask"
    return None


def _on_cuda(model: Any) -> bool:
    try:
        return next(model.parameters()).device.type == "cuda"
    except (StopIteration, AttributeError, TypeError):
        return False


def prepare_for_serving(model: Any, options: dict[str, Any] | None = None, http: bool = False) -> Any:
    """Apply :func:`ep_fuse.prepare` to ``model`` and make its ``init_continuous_batching`` (hence
    ``generate_batch`` and HF's server) compile both paths with ep_fuse (on CUDA with HF's own CUDA graphs
    where the caller's config leaves ``use_cuda_graph`` unset), its managers guarded by
    :func:`guard_cache_capacity` (``http``: refusals are HTTP 400s). Idempotent; returns the model."""
    if not callable(getattr(model, "init_continuous_batching", None)):
        raise ServeError(f"{type(model).__name__} has no continuous batching (init_continuous_batching): "
                         "ep-fuse serve needs a causal language model of transformers 5.x", EXIT_MODEL)
    with _PREPARE_LOCK:
        if getattr(model, "_ep_fuse_serving", None) is not None:
            return model
        ep_fuse.prepare(model)
        init_cb = model.init_continuous_batching
        opts = dict(options or {})

        def init_continuous_batching(generation_config: Any = None, continuous_batching_config: Any = None,
                                     workload_hints: Any = None, **kwargs: Any) -> Any:
            # HF's CUDA graphs of the padded sizes: HF turns them off for attention that needs a mask (paged|sdpa);
            # around ep_fuse's one graph per forward they were faster at every measured point (docs/serving.md)
            cfg = with_ep_fuse_compile(continuous_batching_config, opts,
                                       use_cuda_graph=True if _on_cuda(model) else None, model=model)
            manager = init_cb(generation_config=generation_config, continuous_batching_config=cfg,
                              workload_hints=workload_hints, **kwargs)
            return guard_cache_capacity(manager, http)

        model.init_continuous_batching = init_continuous_batching
        model._ep_fuse_serving = opts
        log.info("ep_fuse.serve: %s prepared; continuous batching compiles with backend='ep_fuse' options=%s",
                 type(model).__name__, opts)
    return model


class PromptTooLong(ValueError):
    """A request whose prompt and ``max_new_tokens`` cannot fit in the continuous-batching KV cache."""


def guard_cache_capacity(manager: Any, http: bool = False) -> Any:
    """Make ``manager.add_request`` (a ``ContinuousBatchingManager``) refuse a request that cannot fit in the
    paged KV cache even alone, instead of queueing it: HF's scheduler then stops its generation loop for every
    request ("No requests can be scheduled"). Raises :class:`PromptTooLong`, or with ``http`` FastAPI's
    ``HTTPException`` 400 (what HF's server answers with). Idempotent."""
    if getattr(manager, "_ep_fuse_guarded", False):
        return manager
    add_request = manager.add_request

    def guarded(input_ids: list[int], *args: Any, **kwargs: Any) -> Any:
        cfg = manager.continuous_batching_config
        num_blocks, page = getattr(cfg, "num_blocks", None), getattr(cfg, "page_size", None)
        new = kwargs.get("max_new_tokens")
        new = manager.generation_config.max_new_tokens if new is None else new
        if num_blocks and page:
            need = len(input_ids) + int(new or 0)
            if -(-need // page) > num_blocks:
                msg = (f"prompt of {len(input_ids)} tokens + max_new_tokens {new} needs {need} tokens of KV cache; "
                       f"the continuous-batching cache holds {num_blocks * page} ({num_blocks} blocks of {page}): "
                       "shorten the prompt, lower max_tokens, or raise --cb-num-blocks")
                if http:
                    from fastapi import HTTPException

                    raise HTTPException(status_code=400, detail=msg)
                raise PromptTooLong(msg)
        return add_request(input_ids, *args, **kwargs)

    manager.add_request = guarded
    manager._ep_fuse_guarded = True
    return manager


def model_manager_class(options: dict[str, Any], http: bool = True) -> type:
    """A subclass of HF's serving ``ModelManager`` whose models go through :func:`prepare_for_serving`."""
    from transformers.cli.serving.model_manager import ModelManager

    class EpFuseModelManager(ModelManager):
        """HF's model manager; every model it hands out is prepared for ep_fuse."""

        def load_model_and_processor(self, model_id_and_revision: str, *args: Any, **kwargs: Any) -> Any:
            model, processor = super().load_model_and_processor(model_id_and_revision, *args, **kwargs)
            return prepare_for_serving(model, options, http=http), processor

    return EpFuseModelManager


class EngineLoader:
    """HF's ``ModelLoader`` (transformers >= 5.25) whose models go through :func:`prepare_for_serving` in the
    engine process that loads them. Module-level and holding only HF's loader and ep_fuse's options, it pickles into
    the process HF spawns; every other attribute (``load_config``, ``load_processor``, ...) is the HF loader's."""

    def __init__(self, loader: Any, options: dict[str, Any] | None = None) -> None:
        self.loader, self.options = loader, dict(options or {})

    def load_model_and_processor(self, model_id: str, *args: Any, **kwargs: Any) -> Any:
        model, processor = self.loader.load_model_and_processor(model_id, *args, **kwargs)
        # in the engine a request's ValueError is answered with a 400 by the API server
        return prepare_for_serving(model, self.options, http=False), processor

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("loader", "options"):  # unpickling: before __dict__ is set
            raise AttributeError(name)
        return getattr(self.loader, name)


def _assembly() -> str:
    """Which server assembly the installed transformers has: ``"manager"`` (5.24: ``Serve`` builds a
    ``ModelManager`` that loads in-process) or ``"engine"`` (5.25: ``Serve`` builds a ``ModelLoader`` that a
    spawned engine process loads with). Raises :class:`ServeError` naming the supported releases otherwise."""
    import transformers
    from transformers.cli import serve as hf_serve
    from transformers.cli.serving import model_manager

    source = inspect.getsource(hf_serve.Serve.__init__)
    engine = getattr(getattr(model_manager, "EngineClient", None), "start_process", None)
    if hasattr(model_manager, "ModelLoader") and "ModelLoader(" in source and callable(engine):
        return "engine"
    if hasattr(model_manager, "ModelManager") and "ModelManager(" in source and "non_blocking" in source:
        return "manager"
    versions = " or ".join(f"transformers=={v}.*" for v in SUPPORTED_TRANSFORMERS)
    raise ServeError(f"transformers {transformers.__version__} builds its server differently from "
                     f"{' and '.join(SUPPORTED_TRANSFORMERS)}, the releases ep_fuse.serve supports: install "
                     f"{versions}, or use ep_fuse.serve.prepare_for_serving in your own server", EXIT_USAGE)


@contextlib.contextmanager
def _hf_serve(options: dict[str, Any], http: bool = True) -> Iterator[type]:
    """HF's ``Serve``, whose models are prepared for ep_fuse while it is constructed.

    ``Serve.__init__`` constructs HF's ``ModelManager`` (5.24) or ``ModelLoader`` (5.25) itself, looked up in
    ``transformers.cli.serving.model_manager``, and has no parameter for it: this is the one private hook. While the
    block runs (under a lock) that name is bound to ours: for 5.24 :func:`model_manager_class`; for 5.25 a factory
    that builds HF's loader wrapped in :class:`EngineLoader` and unbinds itself at once (5.25's ``Serve.__init__``
    runs the server, so the block lasts as long as it does)."""
    from transformers.cli import serve as hf_serve
    from transformers.cli.serving import model_manager

    assembly = _assembly()
    with _HOOK_LOCK:
        name = "ModelLoader" if assembly == "engine" else "ModelManager"
        original = getattr(model_manager, name)
        if assembly == "manager":
            setattr(model_manager, name, model_manager_class(options, http))
        else:
            def engine_loader(*args: Any, **kwargs: Any) -> EngineLoader:
                if getattr(model_manager, name) is engine_loader:
                    setattr(model_manager, name, original)
                return EngineLoader(original(*args, **kwargs), options)

            setattr(model_manager, name, engine_loader)
        try:
            yield hf_serve.Serve
        finally:
            if getattr(model_manager, name) is not original:
                setattr(model_manager, name, original)


def _load_error(model: str, exc: BaseException) -> ServeError:
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return ServeError(f"cannot load {model!r}: {type(exc).__name__}: {first}", EXIT_MODEL)


LOAD_ERRORS = (OSError, ValueError, KeyError, TypeError, ImportError, RuntimeError)
"""What HF's server raises for a model it cannot load or prepare (5.25 relays the engine's as ``RuntimeError``)."""


def _check(options: dict[str, Any]) -> None:
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        raise ServeError("serving needs fastapi, uvicorn, pydantic and openai: pip install 'ep-fuse[serving]'",
                         EXIT_USAGE)
    from ep_fuse.catalog import known_names  # every pattern, provider and engine: names to check the options by

    try:
        EpFuseConfig.from_options(options).check_names(**known_names())
    except ConfigError as exc:
        raise ServeError(str(exc).removeprefix("ep_fuse: "), EXIT_USAGE) from exc


def serve_forever(model: str, options: dict[str, Any] | None = None, **serve_kwargs: Any) -> None:
    """Run HF's server for ``model`` in this thread until it stops (Ctrl-C / SIGTERM on 5.25, where uvicorn runs in
    ``Serve``'s constructor); ``serve_kwargs`` as for :func:`start`."""
    opts = dict(options or {})
    _check(opts)
    serve_kwargs.setdefault("continuous_batching", True)
    if _assembly() == "manager":
        server = start(model, opts, **serve_kwargs)
        try:
            wait(server)
        finally:
            stop(server)
        return
    with _hf_serve(opts) as serve_cls:
        try:
            serve_cls(force_model=model, **serve_kwargs)
        except ServeError:
            raise
        except LOAD_ERRORS as exc:
            raise _load_error(model, exc) from exc


class ServerProcess:
    """A server :func:`start` runs in a process of its own (transformers >= 5.25); ``port`` where it listens."""

    def __init__(self, process: Any, host: str, port: int) -> None:
        self.process, self.host, self.port = process, host, port


def _serve_in_process(model: str, options: dict[str, Any], serve_kwargs: dict[str, Any], errors: Any) -> None:
    """A :class:`ServerProcess`'s target: :func:`serve_forever`, its error (code, message) sent on ``errors``."""
    try:
        serve_forever(model, options, **serve_kwargs)
    except ServeError as exc:
        errors.send((exc.code, str(exc)))
        sys.exit(exc.code)
    except KeyboardInterrupt:
        pass


def _listening(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


def start(model: str, options: dict[str, Any] | None = None, timeout: float = 900.0, **serve_kwargs: Any) -> Any:
    """Start HF's server for ``model`` and return once it listens; stop it with :func:`stop`. ``serve_kwargs`` are
    ``transformers serve``'s options by their Python names (``port=8000``, ``cb_num_blocks=64``, ...);
    ``continuous_batching`` defaults to ``True``. On transformers 5.24 the server runs in a thread and HF's ``Serve``
    is returned; on 5.25 it runs in a process of its own (its model in HF's engine process, loaded, prepared and
    warmed up within ``timeout`` s) and a :class:`ServerProcess` is returned."""
    opts = dict(options or {})
    _check(opts)
    serve_kwargs.setdefault("continuous_batching", True)
    if _assembly() == "engine":
        host, port = serve_kwargs.get("host", "localhost"), int(serve_kwargs.get("port", 8000))
        spawn = multiprocessing.get_context("spawn")
        reader, writer = spawn.Pipe(duplex=False)
        process = spawn.Process(target=_serve_in_process, args=(model, opts, serve_kwargs, writer),
                                name="ep-fuse-serve")
        process.start()
        writer.close()
        deadline = time.monotonic() + timeout
        while not _listening(host, port):
            if reader.poll(0.5):
                code, message = reader.recv()
                process.join(30)
                raise ServeError(message, code)
            if not process.is_alive():
                raise ServeError(f"the server process for {model!r} exited with code {process.exitcode}",
                                 EXIT_MODEL)
            if time.monotonic() > deadline:
                stop(ServerProcess(process, host, port))
                raise ServeError(f"the server for {model!r} was not listening after {timeout:.0f} s", EXIT_MODEL)
        return ServerProcess(process, host, port)
    serve_kwargs["non_blocking"] = True
    with _hf_serve(opts) as serve_cls:
        try:
            server = serve_cls(force_model=model, **serve_kwargs)
        except ServeError:
            raise
        except LOAD_ERRORS as exc:
            raise _load_error(model, exc) from exc
    return server


def stop(server: Any, timeout: float = 30.0) -> None:
    """Stop a server :func:`start` returned and wait up to ``timeout`` s for it: a :class:`ServerProcess` gets
    SIGINT (uvicorn's graceful shutdown; its engine process exits with it), then SIGKILL; 5.24's ``Serve`` its
    ``kill_server`` (which waits 2 s only, short for uvicorn's graceful shutdown on a busy machine)."""
    if isinstance(server, ServerProcess):
        process = server.process
        if process.is_alive():
            os.kill(process.pid, signal.SIGINT)
            process.join(timeout)
        if process.is_alive():
            log.warning("ep_fuse.serve: the server process is still running %.0f s after SIGINT: killing it", timeout)
            process.kill()
            process.join()
        return
    server.kill_server()
    thread = getattr(server, "_thread", None)  # HF's Serve keeps its uvicorn thread there (no public name)
    if thread is not None:
        thread.join(timeout)
        if thread.is_alive():
            log.warning("ep_fuse.serve: the server thread is still running %.0f s after shutdown", timeout)


def wait(server: Any) -> None:
    """Block until the server stops (Ctrl-C raises ``KeyboardInterrupt`` here)."""
    if isinstance(server, ServerProcess):
        while server.process.is_alive():
            server.process.join(0.5)
        return
    thread = getattr(server, "_thread", None)
    while thread is not None and thread.is_alive():
        thread.join(0.5)


# --------------------------------------------------------------------------- command line
def parse_options(pairs: list[str]) -> dict[str, Any]:
    """``["KEY=VALUE", ...]`` -> ep_fuse options (values parsed as JSON where they are JSON)."""
    try:
        return parse_key_values(pairs, "--ep-fuse-option")
    except ConfigError as e:
        raise ServeError(str(e), EXIT_USAGE) from e


def _hf_options(argv: list[str]) -> dict[str, Any]:
    """Parse ``argv`` with ``transformers serve``'s own option definitions; returns its keyword arguments."""
    import typer
    from transformers.cli.serve import Serve

    sig = inspect.signature(Serve.__init__)
    params = [p for name, p in sig.parameters.items() if name != "self"]
    parsed: dict[str, Any] = {}

    def command(**kwargs: Any) -> None:
        parsed.update(kwargs)

    command.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    command.__annotations__ = {k: v for k, v in Serve.__init__.__annotations__.items() if k != "return"}
    command.__doc__ = Serve.__doc__
    app = typer.Typer(add_completion=False)
    app.command()(command)
    try:
        result = typer.main.get_command(app).main(argv, prog_name="ep-fuse serve", standalone_mode=False)
    except Exception as exc:  # typer's (vendored) click exceptions: usage errors, --help's exit
        if type(exc).__name__ == "Exit" or not hasattr(exc, "format_message"):
            if type(exc).__name__ == "Exit":
                raise ServeError("", EXIT_OK) from exc
            raise
        raise ServeError(exc.format_message(), EXIT_USAGE) from exc
    if not parsed:  # --help printed, nothing to run
        raise ServeError("", EXIT_OK if result in (None, 0) else EXIT_USAGE)
    return parsed


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ep-fuse serve", add_help=False,
                                 description="HF's OpenAI-compatible server, continuous batching compiled by ep_fuse")
    ap.add_argument("--ep-fuse-option", action="append", default=[], metavar="KEY=VALUE",
                    help="ep_fuse option (JSON value) for both compiled paths, repeatable")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run the server until interrupted; every option but ``--ep-fuse-option`` is ``transformers serve``'s."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        ours, rest = build_parser().parse_known_args(argv)
        options = parse_options(ours.ep_fuse_option)
        if any(a in ("-h", "--help") for a in rest):
            print("ep-fuse serve MODEL [--ep-fuse-option KEY=VALUE ...] [transformers serve options]\n"
                  "  --ep-fuse-option KEY=VALUE  an ep_fuse option (JSON value) for both compiled paths, repeatable;\n"
                  "  --continuous-batching is implied. transformers serve's options:")
        kwargs = _hf_options(rest)
        if kwargs.get("force_model") is None:
            raise ServeError("name the model to serve: ep-fuse serve MODEL [...]", EXIT_USAGE)
        if kwargs.get("non_blocking"):
            raise ServeError("--non-blocking is for tests; use ep_fuse.serve.start() in-process", EXIT_USAGE)
        kwargs["continuous_batching"] = True
        serve_forever(kwargs.pop("force_model"), options, **kwargs)
    except ServeError as exc:
        if str(exc):
            print(f"ep-fuse serve: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        print("ep-fuse serve: stopped", file=sys.stderr)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())

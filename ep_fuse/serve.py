"""``ep-fuse serve MODEL [options]``: Hugging Face's OpenAI-compatible server (``transformers serve``) with
continuous batching compiled by ep_fuse.

    ep-fuse serve MODEL [--ep-fuse-option KEY=VALUE ...] [any option of ``transformers serve``]
    python -m ep_fuse.serve MODEL [...]

The model is loaded by HF's own model manager, then :func:`prepare_for_serving` applies
:func:`ep_fuse.prepare` and makes both continuous-batching paths (varlen/prefill and decode) compile with
``backend="ep_fuse"`` (:func:`cb_compile_configs`). Every other option (``--cb-*``, ``--attn-implementation``,
``--host``, ``--port``, ``--device``, ``--dtype``, ...) is HF's and is passed through unchanged;
``--continuous-batching`` is implied. On CUDA, HF's own CUDA graphs are on unless ``--cb-use-cuda-graph``
says otherwise. Needs the ``serving`` extra (``pip install ep-fuse[serving]``).

Exit codes: 0 stopped cleanly; 2 bad or unknown option; 3 the model could not be loaded or prepared.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import logging
import sys
import threading
from collections.abc import Iterator
from typing import Any

import ep_fuse
from ep_fuse.config import ConfigError, EpFuseConfig, parse_key_values
from ep_fuse.models import paged_attention

log = logging.getLogger("ep_fuse")

EXIT_OK, EXIT_USAGE, EXIT_MODEL = 0, 2, 3
TESTED_TRANSFORMERS = "5.24"
"""The transformers release whose ``Serve`` assembly :func:`_hf_serve` was written against."""

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
    :func:`ep_fuse.models.paged_attention.cb_compile_configs` -- ``backend="ep_fuse"``, ``fullgraph=False``,
    no CUDA-graph mode (CUDA graphs are HF's own capture, ``use_cuda_graph``), ``options`` as ep_fuse's options."""
    return paged_attention.cb_compile_configs(options)


def with_ep_fuse_compile(cb_config: Any, options: dict[str, Any] | None = None,
                         use_cuda_graph: bool | None = None) -> Any:
    """A copy of ``cb_config`` (a ``ContinuousBatchingConfig`` or ``None``) whose unset varlen / decode compile
    configs are :func:`cb_compile_configs`; compile configs the caller set are kept. ``use_cuda_graph`` is the
    value for HF's own CUDA graphs where the caller left ``cb_config.use_cuda_graph`` unset (``None``: HF decides)."""
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
    return out


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
                                     workload_hints: Any = None) -> Any:
            # HF's CUDA graphs of the padded sizes: HF turns them off for attention that needs a mask (paged|sdpa);
            # around ep_fuse's one graph per forward they were faster at every measured point (docs/serving.md)
            cfg = with_ep_fuse_compile(continuous_batching_config, opts,
                                       use_cuda_graph=True if _on_cuda(model) else None)
            manager = init_cb(generation_config=generation_config, continuous_batching_config=cfg,
                              workload_hints=workload_hints)
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


def model_manager_class(options: dict[str, Any]) -> type:
    """A subclass of HF's serving ``ModelManager`` whose models go through :func:`prepare_for_serving`."""
    from transformers.cli.serving.model_manager import ModelManager

    class EpFuseModelManager(ModelManager):
        """HF's model manager; every model it hands out is prepared for ep_fuse."""

        def load_model_and_processor(self, model_id_and_revision: str, *args: Any, **kwargs: Any) -> Any:
            model, processor = super().load_model_and_processor(model_id_and_revision, *args, **kwargs)
            return prepare_for_serving(model, options, http=True), processor

    return EpFuseModelManager


# --------------------------------------------------------------------------- HF's server
@contextlib.contextmanager
def _hf_serve(manager_cls: type) -> Iterator[type]:
    """HF's ``Serve`` building its model manager from ``manager_cls``.

    ``Serve.__init__`` constructs ``transformers.cli.serving.model_manager.ModelManager`` itself and has no
    parameter for it; this is the one private hook: the module's name is bound to ``manager_cls`` while a
    ``Serve`` is constructed (under a lock), after checking that this transformers builds it that way."""
    import transformers
    from transformers.cli import serve as hf_serve
    from transformers.cli.serving import model_manager

    source = inspect.getsource(hf_serve.Serve.__init__)
    if not hasattr(model_manager, "ModelManager") or "ModelManager(" not in source:
        raise ServeError(f"transformers {transformers.__version__} builds its server differently from "
                         f"{TESTED_TRANSFORMERS}, the release ep_fuse.serve supports: install transformers=="
                         f"{TESTED_TRANSFORMERS}.* or use ep_fuse.serve.prepare_for_serving in your own server",
                         EXIT_USAGE)
    with _HOOK_LOCK:
        original = model_manager.ModelManager
        model_manager.ModelManager = manager_cls
        try:
            yield hf_serve.Serve
        finally:
            model_manager.ModelManager = original


def start(model: str, options: dict[str, Any] | None = None, **serve_kwargs: Any) -> Any:
    """Start HF's server for ``model`` in a background thread; returns HF's ``Serve`` (stop it with
    :func:`stop`). ``serve_kwargs`` are ``transformers serve``'s options by their Python names
    (``port=8000``, ``cb_num_blocks=64``, ...); ``continuous_batching`` defaults to ``True``."""
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        raise ServeError("serving needs fastapi, uvicorn, pydantic and openai: pip install 'ep-fuse[serving]'",
                         EXIT_USAGE)
    opts = dict(options or {})
    try:
        EpFuseConfig.from_options(opts)
    except ConfigError as exc:
        raise ServeError(str(exc).removeprefix("ep_fuse: "), EXIT_USAGE) from exc
    serve_kwargs.setdefault("continuous_batching", True)
    serve_kwargs["non_blocking"] = True
    with _hf_serve(model_manager_class(opts)) as serve_cls:
        try:
            server = serve_cls(force_model=model, **serve_kwargs)
        except ServeError:
            raise
        except (OSError, ValueError, KeyError, TypeError, ImportError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ServeError(f"cannot load {model!r}: {type(exc).__name__}: {first}", EXIT_MODEL) from exc
    return server


def stop(server: Any, timeout: float = 30.0) -> None:
    """Stop a server :func:`start` returned and wait up to ``timeout`` s for its thread: HF's ``kill_server``
    waits 2 s only, short for uvicorn's graceful shutdown on a busy machine."""
    server.kill_server()
    thread = getattr(server, "_thread", None)  # HF's Serve keeps its uvicorn thread there (no public name)
    if thread is not None:
        thread.join(timeout)
        if thread.is_alive():
            log.warning("ep_fuse.serve: the server thread is still running %.0f s after shutdown", timeout)


def wait(server: Any) -> None:
    """Block until the server's thread ends (Ctrl-C raises ``KeyboardInterrupt`` here)."""
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
        server = start(kwargs.pop("force_model"), options, **kwargs)
    except ServeError as exc:
        if str(exc):
            print(f"ep-fuse serve: {exc}", file=sys.stderr)
        return exc.code
    try:
        wait(server)
    except KeyboardInterrupt:
        print("ep-fuse serve: stopping", file=sys.stderr)
    finally:
        stop(server)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())

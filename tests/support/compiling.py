"""Compiling in tests: capture the ATen graphs ep_fuse sees (:func:`capture_aten`), count calls of an op
(:func:`count`), compile with ep_fuse and run (:func:`compile_and_run`; an HF model's logits and report from a
fresh compile: :func:`compile_logits`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from functorch.compile import make_boxed_func
from torch._functorch.aot_autograd import aot_module_simplified

from ep_fuse.fx_utils import target_name


def capture_aten(
    fn: Callable[..., Any], *args: Any, dynamic: bool | None = False, **kwargs: Any
) -> list[tuple[fx.GraphModule, list[Any]]]:
    """The functionalized ATen inference graphs of ``fn(*args, **kwargs)`` before any ep_fuse pass,
    each with the real inputs (parameters included) it takes, in placeholder order."""
    graphs: list[tuple[fx.GraphModule, list[Any]]] = []

    def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        def fw(g: fx.GraphModule, _inputs: list[Any]) -> Callable[..., Any]:
            graphs.append((g, list(example_inputs)))
            return make_boxed_func(g.forward)

        return aot_module_simplified(gm, example_inputs, fw_compiler=fw, inference_compiler=fw,
                                     decompositions={}, keep_inference_input_mutations=True)

    with torch.no_grad():
        torch.compile(fn, backend=backend, dynamic=dynamic, fullgraph=False)(*args, **kwargs)
    return graphs


def count(gm_or_hist: fx.GraphModule | dict[str, int], target: Any) -> int:
    """Calls of ``target`` in a graph (or in an op histogram from a report)."""
    if isinstance(gm_or_hist, dict):
        return gm_or_hist.get(target if isinstance(target, str) else target_name(target), 0)
    return sum(1 for n in gm_or_hist.graph.nodes if n.op == "call_function" and n.target is target)


def compile_and_run(fn: Callable[..., Any], *args: Any, dynamic: bool | None = False, **options: Any) -> Any:
    """``torch.compile(fn, backend="ep_fuse", options=options)(*args)`` under ``torch.no_grad()``."""
    with torch.no_grad():
        return torch.compile(fn, backend="ep_fuse", options=options or None, dynamic=dynamic)(*args)


def compile_logits(model: Any, inputs: dict[str, Any], **options: Any) -> tuple[torch.Tensor, Any]:
    """An HF causal LM's logits from a fresh ep_fuse compile (Dynamo and the reports reset), and its last report."""
    import ep_fuse

    torch._dynamo.reset()
    ep_fuse.reset_reports()
    with torch.no_grad():
        out = torch.compile(model, backend="ep_fuse", options=options or None)(**inputs).logits
    return out, ep_fuse.last_report()

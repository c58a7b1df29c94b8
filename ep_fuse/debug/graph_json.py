"""FX graphs as plain data (node name, op, inputs, dtype/shape, module path) for reports and diffs."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from ep_fuse.fx_utils import module_path, target_name, val

_SHORT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
          torch.int64: "i64", torch.int32: "i32", torch.bool: "b8"}


def describe_value(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"{_SHORT.get(v.dtype, str(v.dtype).replace('torch.', ''))}[{', '.join(str(s) for s in v.shape)}]"
    if isinstance(v, (list, tuple)):
        return f"{len(v)} outputs"
    return "" if v is None else type(v).__name__


def graph_to_json(gm: fx.GraphModule) -> list[dict[str, Any]]:
    nodes = []
    for n in gm.graph.nodes:
        nodes.append({
            "name": n.name,
            "op": n.op,
            "target": target_name(n.target) if n.op == "call_function" else str(n.target),
            "inputs": [i.name for i in n.all_input_nodes],
            "value": describe_value(val(n)),
            "module": module_path(n),
        })
    return nodes

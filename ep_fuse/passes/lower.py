"""Lower: bind each canonical op node to a provider for the graph's device.

* A fused provider (``triton``, ``npu``) replaces the node's target with the provider op.
* Where none is taken, the node keeps the reference: under the Inductor executor its ATen ops are
  inlined back into the graph, so Inductor generates the code it would have generated anyway
  (this is how a provider "declines" a shape where it is not faster); under the eager executor the
  canonical op runs its reference kernel.
* Where the faster choice depends on a size that is symbolic (``dynamic=True``), the provider's perf rule
  answers :class:`~ep_fuse.ops.registry.AtRunTime` and the node gets the provider's ``<op>_by_size`` op,
  which makes the choice per call on the real sizes.
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from ep_fuse.fx_utils import val
from ep_fuse.ops.registry import REFERENCE, canonical_for, choose, inlinable
from ep_fuse.passes.base import GraphPass, PassContext

log = logging.getLogger("ep_fuse.passes")


class Lower(GraphPass):
    name = "lower"

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> int:
        changes = 0
        perf_executor = ctx.executor if ctx.config.perf_guard else None
        for node in list(gm.graph.nodes):
            if node.op != "call_function":
                continue
            canon = canonical_for(node.target)
            if canon is None:
                continue
            fake_args = tuple(val(a) if isinstance(a, fx.Node) else a for a in node.args)
            device = ctx.device
            choice = choose(canon, fake_args, device, ctx.config.provider_order(device), perf_executor)
            for record in ctx.match_by_node.get(node.name, []):
                record.set_provider(canon.name, choice.provider, choice.declined, choice.run_time)
            for prov, reason in choice.declined:
                log.info("ep_fuse: %s at %s: provider %s declined: %s", canon.name, node.name, prov, reason)
            if choice.run_time:
                log.info("ep_fuse: %s at %s: provider %s chooses per call: %s", canon.name, node.name,
                         choice.provider, choice.run_time)
            if choice.provider != REFERENCE:
                node.target = choice.op
                ctx.report.contracts.update(canon.providers[choice.provider].contracts)
                changes += 1
            elif ctx.executor == "inductor" and inlinable(canon, fake_args):
                inline_reference(gm, node, canon.reference, ctx.fake_mode)
                changes += 1
        return changes


def inline_reference(gm: fx.GraphModule, node: fx.Node, fn: Any, fake_mode: Any) -> None:
    """Replace ``node`` by the ATen ops of ``fn`` traced on the node's fake arguments."""
    graph = gm.graph
    tensor_pos = [i for i, a in enumerate(node.args) if isinstance(a, fx.Node)]
    consts = list(node.args)

    def body(*tensors: torch.Tensor) -> Any:
        args = list(consts)
        for i, t in zip(tensor_pos, tensors):
            args[i] = t
        return fn(*args)

    fakes = [val(node.args[i]) for i in tensor_pos]
    with fake_mode:
        traced = make_fx(body, tracing_mode="real", record_module_stack=False)(*fakes)
    env: dict[fx.Node, Any] = {}
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    for ph, i in zip(placeholders, tensor_pos):
        env[ph] = node.args[i]
    result: Any = None
    keep = {k: node.meta[k] for k in ("nn_module_stack", "stack_trace") if k in node.meta}
    with graph.inserting_before(node):
        for n in traced.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                result = torch.fx.map_arg(n.args[0], lambda a: env[a])
                continue
            if n.op == "get_attr":  # constants created by the reference (none today)
                raise RuntimeError(f"ep_fuse: reference of {node.target} created a constant; cannot inline")
            new = graph.node_copy(n, lambda a: env[a])
            new.meta.update(keep)
            env[n] = new
    if isinstance(result, (tuple, list)):
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(result[user.args[1]])
                graph.erase_node(user)
    else:
        node.replace_all_uses_with(result)
    graph.erase_node(node)

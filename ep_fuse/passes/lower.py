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

import torch.fx as fx

from ep_fuse.fx_utils import val
from ep_fuse.ops.registry import REFERENCE, canonical_for, choose, inlinable
from ep_fuse.passes.base import GraphPass, PassContext
from ep_fuse.passes.graph_edit import fake_mode, inline_reference

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
                inline_reference(gm, node, canon.reference, fake_mode(ctx))
                changes += 1
        return changes

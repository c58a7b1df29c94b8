"""Model surgery: what ``ep_fuse.prepare`` does to a model before it is compiled.

* :mod:`ep_fuse.surgery.prepare` -- :func:`~ep_fuse.surgery.prepare.prepare` (make an MoE model traceable as one
  graph) and :func:`~ep_fuse.surgery.prepare.dynamic_batch` (mark the batch dim of its inputs);
* :mod:`ep_fuse.surgery.moe_semantics`, :mod:`~ep_fuse.surgery.moe_expert_storage`,
  :mod:`~ep_fuse.surgery.moe_routers`, :mod:`~ep_fuse.surgery.loop_dataflow` -- MoE blocks recognised by what they
  compute (router, expert storage, combine), each binding proved numerically before it is replaced;
* :mod:`ep_fuse.surgery.expert_loops` -- per-expert Python loops over an ``nn.ModuleList`` converted into stacked
  3-D expert weights; :mod:`~ep_fuse.surgery.hookless_experts` -- 3-D experts without transformers' experts hook;
* :mod:`ep_fuse.surgery.fp8_experts` -- transformers' ``FP8Experts`` given a forward that dequantizes through
  ``ep_fuse::fp8_block_dequant``; :mod:`~ep_fuse.surgery.inference_mode` -- ``@torch.inference_mode()`` forwards.

Nothing is imported here: the public names are ``ep_fuse.prepare`` / ``ep_fuse.dynamic_batch``.
"""

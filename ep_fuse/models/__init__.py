"""Model surgery: what is done to a model before it is compiled, and the tiny models the CLI and tests build.

* :mod:`ep_fuse.models.prepare` -- :func:`~ep_fuse.models.prepare.prepare` (make an HF MoE model traceable as one
  graph) and :func:`~ep_fuse.models.prepare.dynamic_batch` (mark the batch dim of its inputs);
* :mod:`ep_fuse.models.expert_loops` -- per-expert Python loops over an ``nn.ModuleList`` converted into
  stacked 3-D expert weights (:class:`~ep_fuse.models.expert_loops.StackedExperts`);
* :mod:`ep_fuse.models.fp8_experts` -- transformers' ``FP8Experts`` given a forward that dequantizes through
  ``ep_fuse::fp8_block_dequant``;
* :mod:`ep_fuse.models.tiny` -- tiny HF MoE models with random weights (``ep-fuse dump hf:<name>``, tests, example).

Nothing is imported here: ``import ep_fuse.models.prepare`` loads what ``prepare`` needs, and the public names
are ``ep_fuse.prepare`` / ``ep_fuse.dynamic_batch``.
"""

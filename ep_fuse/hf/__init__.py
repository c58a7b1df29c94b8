"""Hugging Face transformers integrations (transformers is imported by each module, when it is used).

* :mod:`ep_fuse.hf.expert_parallel` -- ``ep_implementation="ep_fuse"`` for transformers' native expert parallelism;
* :mod:`ep_fuse.hf.paged_attention` -- continuous batching's paged KV-cache update as one in-graph op
  (``ep_fuse_hf::paged_kv_update``) and ``cb_compile_configs``;
* :mod:`ep_fuse.hf.varlen_attention` -- continuous batching's attention over packed sequences;
* :mod:`ep_fuse.hf.hub_kernels` -- Hub-kernel layers given their plain forwards back.
"""

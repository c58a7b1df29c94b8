"""Expert parallelism: compiler-inserted dispatch/combine around each MoE block (``docs/ep.md``).

* :func:`shard_experts` / :func:`ep_options`: shard a model's experts over a process group and get the
  backend options that enable the EP pass (``ep_fuse/passes/ep.py``).
* :mod:`ep_fuse.ops.ep`: the canonical ``ep_dispatch`` / ``ep_combine`` ops.
* Engines (the implementations of the two ops, named by the option ``ep_engine``; each registers itself with
  :func:`ep_fuse.ops.ep.register_engine`, and :func:`ep_fuse.ops.ep.engine_names` lists them):
  :mod:`~ep_fuse.ep.all_to_all` (default, the reference), :mod:`~ep_fuse.ep.deepep`, :mod:`~ep_fuse.ep.npu`,
  :mod:`~ep_fuse.ep.symm_mem`.
"""

from ep_fuse.ep.groups import EpError
from ep_fuse.ep.shard import ep_options, shard_experts


def release_buffers() -> None:
    """Release the communication buffers EP engines keep per process group (DeepEP ``Buffer``s,
    symmetric-memory workspaces). Collective: call on every rank, before ``destroy_process_group``."""
    from ep_fuse.ep import deepep, symm_mem  # engines load through the catalog; asked only here, at release

    try:
        deepep.destroy_buffers()
    finally:
        symm_mem.destroy_buffers()


__all__ = ["EpError", "ep_options", "release_buffers", "shard_experts"]

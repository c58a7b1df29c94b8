"""The former home of model surgery, the HF integrations and the tiny models, now in :mod:`ep_fuse.surgery`,
:mod:`ep_fuse.hf` and :mod:`ep_fuse.testing`. The modules the docs named here keep their old names
(``ep_fuse.models.tiny``, ``.paged_attention``, ``.varlen_attention``, ``.hf_expert_parallel``): each is the moved
module itself, not a copy.
"""

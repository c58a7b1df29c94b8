"""Moved to :mod:`ep_fuse.hf.expert_parallel`; this old name gives that module itself."""

import sys

from ep_fuse.hf import expert_parallel as moved

sys.modules[__name__] = moved

"""Moved to :mod:`ep_fuse.hf.varlen_attention`; this old name gives that module itself."""

import sys

from ep_fuse.hf import varlen_attention as moved

sys.modules[__name__] = moved

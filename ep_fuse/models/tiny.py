"""Moved to :mod:`ep_fuse.testing.tiny`; this old name gives that module itself."""

import sys

from ep_fuse.testing import tiny as moved

sys.modules[__name__] = moved

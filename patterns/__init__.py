"""The ep_fuse pattern catalog (shipped as ``ep_fuse.patterns``): one module per op family.

Each family module declares ``DESCRIPTION`` and ``PATTERNS``, a list of :class:`ep_fuse.matching.Pattern` in
priority order (bigger fusions first), and optionally ``PAIRS`` (:class:`ep_fuse.matching.PairRule`: sibling
canonical calls run as one). :mod:`ep_fuse.catalog` loads them, in its family order.
"""

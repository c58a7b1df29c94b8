"""Debugging tools: graph dumps as data, the HTML report, the ``ep-fuse`` command line."""

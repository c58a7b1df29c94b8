"""Tiny models and the model sweep: what the CLI (``ep-fuse dump hf:<name>``), the example and the tests build.

* :mod:`ep_fuse.testing.tiny` -- tiny HF MoE models with random weights and their site pins (``EXPECTED_SITES``);
* :mod:`ep_fuse.testing.sweep` -- every MoE family of the installed transformers built tiny, compiled, counted.
"""

"""Canonical ops, reference implementations and the provider registry."""

from ep_fuse.ops.registry import CanonicalOp, Choice, Provider, canonical_ops, choose, known_providers

__all__ = ["CanonicalOp", "Choice", "Provider", "canonical_ops", "choose", "known_providers"]

"""Declarative ATen pattern language, matcher and rewrite helpers used by the pattern catalog."""

from ep_fuse.matching.matcher import Mismatch
from ep_fuse.matching.pattern import Alt, Cast, Item, Lit, Op, Opt, Var, alt, equals, is_number, op
from ep_fuse.matching.spec import Anchor, Derived, Match, PairRule, Pattern, Replacement, try_match

__all__ = [
    "Alt", "Anchor", "Cast", "Derived", "Item", "Lit", "Match", "Mismatch", "Op", "Opt", "PairRule", "Pattern", "Replacement", "Var",
    "alt", "equals", "is_number", "op", "try_match",
]

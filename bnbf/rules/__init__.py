"""The registry of update rules: one row per rule (see :mod:`bnbf.rules.base` for what a row holds)."""

from __future__ import annotations

from bnbf.rules.adam import ADAM, ADAMW
from bnbf.rules.base import Rule, StateSlot

RULES: dict[str, Rule] = {r.name: r for r in (ADAM, ADAMW)}


def get_rule(name: str) -> Rule:
    try:
        return RULES[name]
    except KeyError:
        raise ValueError(f"unknown rule {name!r}; known rules: {sorted(RULES)}") from None


__all__ = ["RULES", "Rule", "StateSlot", "get_rule"]

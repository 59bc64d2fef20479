"""The registry of update rules: one row per rule (see :mod:`bnbf.rules.base` for what a row holds)."""

from __future__ import annotations

from bnbf.rules.adagrad import ADAGRAD
from bnbf.rules.adam import ADAM, ADAMW
from bnbf.rules.adan import ADAN
from bnbf.rules.ademamix import ADEMAMIX
from bnbf.rules.base import Rule, StateSlot
from bnbf.rules.lamb import LAMB
from bnbf.rules.lars import LARS
from bnbf.rules.lion import LION
from bnbf.rules.rmsprop import RMSPROP
from bnbf.rules.sgd import SGD

RULES: dict[str, Rule] = {r.name: r for r in (ADAM, ADAMW, LION, SGD, RMSPROP, ADAGRAD, ADEMAMIX, LAMB, LARS, ADAN)}


def get_rule(name: str) -> Rule:
    try:
        return RULES[name]
    except KeyError:
        raise ValueError(f"unknown rule {name!r}; known rules: {sorted(RULES)}") from None


__all__ = ["RULES", "Rule", "StateSlot", "get_rule"]

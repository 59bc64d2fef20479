"""The registry of update rules: one row per rule (see :mod:`bnbf.rules.base` for what a row holds)."""

from __future__ import annotations

from bnbf.rules.adagrad import ADAGRAD
from bnbf.rules.adam import ADAM, ADAMW
from bnbf.rules.adan import ADAN
from bnbf.rules.ademamix import ADEMAMIX
from bnbf.rules.base import Rule, StateSlot, validate_rule
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


def register_rule(rule: Rule) -> Rule:
    """Add a rule to the registry at run time, after checking it (:func:`bnbf.rules.base.validate_rule`).

    A mistake (no ``math`` or ``reference``, a wrong arity, a bad state declaration, a reference that fails
    on a small tensor) raises here, naming the rule, instead of at the first step inside a kernel.

    Args:
        rule: the :class:`Rule` row; its ``name`` becomes the ``OptimSpec(rule=...)`` name.

    Returns:
        ``rule``.

    Raises:
        ValueError: the name is already registered (state classes and compiled kernels are made per name:
            register a changed rule under a new name), or the rule is malformed (also TypeError).

    Example:
        >>> import dataclasses
        >>> from bnbf.rules.lion import LION
        >>> _ = register_rule(dataclasses.replace(LION, name="my_lion"))
        >>> "my_lion" in RULES
        True
        >>> del RULES["my_lion"]
    """
    validate_rule(rule)
    if rule.name in RULES:
        raise ValueError(f"a rule named {rule.name!r} is already registered; register a changed rule under a new name")
    RULES[rule.name] = rule
    return rule


__all__ = ["RULES", "Rule", "StateSlot", "get_rule", "register_rule", "validate_rule"]

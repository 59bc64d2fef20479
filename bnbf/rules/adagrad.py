"""Adagrad as ``torch.optim.Adagrad``: lr_decay, L2 weight decay, initial_accumulator_value, eps.

    g   = g + wd·p
    clr = lr / (1 + (t − 1)·lr_decay)
    sum = sum + g²
    p   = p − clr · g / (√sum + ε)

State: ``sum`` (unsigned: never negative), starting at ``initial_accumulator_value``.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import triton
import triton.language as tl

from bnbf.kernels.codec import fast_div
from bnbf.rules.base import (
    Number,
    Rule,
    StateSlot,
    check_eps,
    check_lr,
    check_nonneg,
    check_weight_decay,
    start_value,
)
from bnbf.rules.decay import decay_term, decay_term_reference


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdagradHparams:
    lr: Number = 1e-2
    lr_decay: Number = 0.0
    weight_decay: Number = 0.0
    initial_accumulator_value: float = 0.0
    eps: Number = 1e-10

    def __post_init__(self):
        check_lr(self.lr)
        check_nonneg(self.lr_decay, "lr_decay")  # torch: `if not 0.0 <= lr_decay`, so NaN too
        check_weight_decay(self.weight_decay)
        check_nonneg(self.initial_accumulator_value, "initial_accumulator_value")
        check_eps(self.eps)


class AdagradScalars(NamedTuple):
    clr: Number  # lr / (1 + (t - 1)·lr_decay)
    wd: Number
    eps: Number


def scalars(h: AdagradHparams, step: Number) -> AdagradScalars:
    return AdagradScalars(clr=h.lr / (1 + (step - 1) * h.lr_decay), wd=h.weight_decay, eps=h.eps)


@triton.jit
def adagrad_math(p, g, s, hp, nrm):
    h = AdagradScalars(*hp)
    (acc,) = s
    g = g + decay_term(h.wd, p)
    acc = acc + g * g
    p = p - h.clr * fast_div(g, tl.sqrt(acc) + h.eps)
    return p, (acc,)


def adagrad_reference(p, g, states, h: AdagradScalars):
    (acc,) = states
    g = g + decay_term_reference(h.wd, p)
    acc = acc + g * g
    return p - h.clr * g / (acc.sqrt() + h.eps), [acc]


ADAGRAD = Rule(
    "adagrad",
    AdagradHparams,
    (StateSlot("sum", signed=False),),
    AdagradScalars,
    scalars,
    adagrad_math,
    adagrad_reference,
    initial=lambda h: (start_value(h.initial_accumulator_value, "initial_accumulator_value"),),
)

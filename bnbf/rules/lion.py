"""Lion (Chen et al., 2023), as ``lion_pytorch.Lion``: the sign of an interpolation, decoupled decay.

    p = p·(1 − lr·wd)
    p = p − lr · sign(β1·m + (1 − β1)·g)
    m = β2·m + (1 − β2)·g

State: ``exp_avg`` (signed).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import triton
import triton.language as tl

from bnbf.rules.base import Number, Rule, StateSlot, check_betas_of, check_lr, check_weight_decay


@dataclasses.dataclass(frozen=True, kw_only=True)
class LionHparams:
    lr: Number = 1e-4
    betas: tuple[Number, Number] = (0.9, 0.99)
    weight_decay: Number = 0.0

    def __post_init__(self):
        check_lr(self.lr)
        check_betas_of(self, 2)
        check_weight_decay(self.weight_decay)


class LionScalars(NamedTuple):
    lr: Number
    b1: Number
    b2: Number
    decay: Number  # 1 - lr·wd
    # 1 - beta in double precision here, not from the float32 beta in the kernel (see adam.py)
    omb1: Number
    omb2: Number


def scalars(h: LionHparams, step: Number) -> LionScalars:
    b1, b2 = h.betas
    return LionScalars(lr=h.lr, b1=b1, b2=b2, decay=1 - h.lr * h.weight_decay, omb1=1 - b1, omb2=1 - b2)


@triton.jit
def lion_math(p, g, s, hp, nrm):
    h = LionScalars(*hp)
    (m,) = s
    c = h.b1 * m + h.omb1 * g
    sign = tl.where(c > 0, 1.0, tl.where(c < 0, -1.0, 0.0))
    p = p * h.decay - h.lr * sign
    m = h.b2 * m + h.omb2 * g
    return p, (m,)


def lion_reference(p, g, states, h: LionScalars):
    (m,) = states
    p = p * h.decay - h.lr * (h.b1 * m + h.omb1 * g).sign()
    m = h.b2 * m + h.omb2 * g
    return p, [m]


LION = Rule("lion", LionHparams, (StateSlot("exp_avg", signed=True),), LionScalars, scalars, lion_math, lion_reference)

"""Lion (Chen et al., 2023), as ``lion_pytorch.Lion``: the sign of an interpolation, decoupled decay.

    p = p·(1 − lr·wd)
    p = p − lr · sign(β1·m + (1 − β1)·g)
    m = β2·m + (1 − β2)·g

State: ``exp_avg`` (signed).
"""

from __future__ import annotations

import dataclasses

import triton
import triton.language as tl

from bnbf.rules.base import Number, Rule, StateSlot, check_betas, check_lr, check_weight_decay


@dataclasses.dataclass(frozen=True, kw_only=True)
class LionHparams:
    lr: Number = 1e-4
    betas: tuple[Number, Number] = (0.9, 0.99)
    weight_decay: Number = 0.0

    def __post_init__(self):
        check_lr(self.lr)
        if len(self.betas) != 2:
            raise ValueError(f"betas must be a pair, got {self.betas}")
        check_betas(self.betas)
        check_weight_decay(self.weight_decay)


def scalars(h: LionHparams, step: Number):
    b1, b2 = h.betas
    # 1 - beta in double precision here, not from the float32 beta in the kernel (see adam.py)
    return (h.lr, b1, b2, 1 - h.lr * h.weight_decay, 1 - b1, 1 - b2)


@triton.jit
def lion_math(p, g, m, unused1, unused2, hp, nrm):
    lr = hp[0]
    b1 = hp[1]
    b2 = hp[2]
    decay = hp[3]
    omb1 = hp[4]
    omb2 = hp[5]
    c = b1 * m + omb1 * g
    sign = tl.where(c > 0, 1.0, tl.where(c < 0, -1.0, 0.0))
    p = p * decay - lr * sign
    m = b2 * m + omb2 * g
    return p, m, unused1, unused2


def lion_reference(p, g, states, s):
    (m,) = states
    lr, b1, b2, decay, omb1, omb2 = s
    p = p * decay - lr * (b1 * m + omb1 * g).sign()
    m = b2 * m + omb2 * g
    return p, [m]


LION = Rule("lion", LionHparams, (StateSlot("exp_avg", signed=True),), scalars, lion_math, lion_reference)

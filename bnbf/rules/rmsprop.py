"""RMSprop as ``torch.optim.RMSprop``: alpha, eps, L2 weight decay, momentum and centered.

    g   = g + wd·p
    sq  = α·sq + (1 − α)·g²                   (not centered)
    var = α·var + α(1 − α)·(g − ga)²          (centered: var = sq − ga², updated directly)
    ga  = α·ga + (1 − α)·g                    (centered)
    avg = √var + ε   (centered)   or   √sq + ε
    buf = μ·buf + g / avg;  p = p − lr·buf    (momentum > 0)
    p   = p − lr·g / avg                      (otherwise)

States: ``square_avg`` (unsigned: never negative), ``momentum_buffer`` (signed, when momentum > 0),
``grad_avg`` (signed, when centered). When centered, the ``square_avg`` slot stores the centered variance
sq − ga² itself (the same quantity in exact arithmetic): quantized separately, sq and ga² cancel in 8 bits
(the difference went negative and the step blew up). ``dequantize_state`` reports torch's
``square_avg`` = var + ga².
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
    _value,
    check_eps,
    check_flag,
    check_lr,
    check_momentum,
    check_nonneg,
    check_weight_decay,
)
from bnbf.rules.decay import decay_term, decay_term_reference


@dataclasses.dataclass(frozen=True, kw_only=True)
class RMSpropHparams:
    lr: Number = 1e-2
    alpha: Number = 0.99
    eps: Number = 1e-8
    weight_decay: Number = 0.0
    momentum: Number = 0.0
    centered: bool = False

    def __post_init__(self):
        check_lr(self.lr)
        check_eps(self.eps)
        check_momentum(self.momentum)
        check_weight_decay(self.weight_decay)
        check_nonneg(self.alpha, "alpha")  # torch: `if not 0.0 <= alpha`, so NaN too
        check_flag(self.centered, "centered")


class RMSpropScalars(NamedTuple):
    lr: Number
    alpha: Number
    eps: Number
    wd: Number
    momentum: Number
    centered: Number  # 1.0 or 0.0
    oma: Number  # 1 - alpha in double precision (see adam.py)


def scalars(h: RMSpropHparams, step: Number) -> RMSpropScalars:
    return RMSpropScalars(
        lr=h.lr,
        alpha=h.alpha,
        eps=h.eps,
        wd=h.weight_decay,
        momentum=h.momentum,
        centered=1.0 if h.centered else 0.0,
        oma=1 - h.alpha,
    )


def present(h: RMSpropHparams) -> tuple[bool, ...]:
    m = _value(h.momentum)
    return (True, m is None or m != 0.0, bool(h.centered))


@triton.jit
def rmsprop_math(p, g, s, hp, nrm):
    h = RMSpropScalars(*hp)
    sq, buf, ga = s
    alpha = h.alpha
    oma = h.oma
    g = g + decay_term(h.wd, p)
    d = g - ga
    sq = tl.where(h.centered != 0, alpha * sq + alpha * oma * d * d, alpha * sq + oma * g * g)
    ga = alpha * ga + oma * g
    step = fast_div(g, tl.sqrt(sq) + h.eps)
    buf = h.momentum * buf + step
    p = p - h.lr * tl.where(h.momentum != 0, buf, step)
    return p, (sq, buf, ga)


def rmsprop_reference(p, g, states, h: RMSpropScalars):
    sq, buf, ga = states
    alpha, oma = h.alpha, h.oma
    g = g + decay_term_reference(h.wd, p)
    if ga is not None:  # sq holds the centered variance
        sq = alpha * sq + alpha * oma * (g - ga) ** 2
        ga = alpha * ga + oma * g
    else:
        sq = alpha * sq + oma * g * g
    avg = sq.sqrt() + h.eps
    if buf is not None:
        buf = h.momentum * buf + g / avg
        return p - h.lr * buf, [sq, buf, ga]
    return p - h.lr * g / avg, [sq, buf, ga]


_STATES = (
    StateSlot("square_avg", signed=False),
    StateSlot("momentum_buffer", signed=True, kept_by=(("momentum", 0.5),)),
    StateSlot("grad_avg", signed=True, kept_by=(("centered", True),)),
)


def export(states: dict) -> dict:
    """torch.optim's view: with centered, square_avg = stored variance + grad_avg²."""
    if "grad_avg" in states:
        states = dict(states, square_avg=states["square_avg"] + states["grad_avg"] ** 2)
    return states


RMSPROP = Rule(
    "rmsprop",
    RMSpropHparams,
    _STATES,
    RMSpropScalars,
    scalars,
    rmsprop_math,
    rmsprop_reference,
    present=present,
    export=export,
)

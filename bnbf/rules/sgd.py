"""SGD with momentum, dampening, Nesterov and L2 weight decay, exactly as ``torch.optim.SGD``.

    g   = g + wd·p
    buf = g                                   (first step)
    buf = μ·buf + (1 − dampening)·g           (later steps)
    d   = g + μ·buf  (nesterov)   or   buf
    p   = p − lr·d

State: ``momentum_buffer`` (signed), only when momentum > 0 (plain SGD keeps no state).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from bnbf.rules.base import (
    Number,
    Rule,
    StateSlot,
    _value,
    check_finite,
    check_flag,
    check_lr,
    check_momentum,
    check_weight_decay,
)
from bnbf.rules.decay import decay_term, decay_term_reference


@dataclasses.dataclass(frozen=True, kw_only=True)
class SGDHparams:
    lr: Number = 1e-3
    momentum: Number = 0.0
    dampening: Number = 0.0
    weight_decay: Number = 0.0
    nesterov: bool = False

    def __post_init__(self):
        check_lr(self.lr)
        check_momentum(self.momentum)
        check_weight_decay(self.weight_decay)
        check_finite(self.dampening, "dampening")  # torch leaves dampening unchecked: any finite value steps
        check_flag(self.nesterov, "nesterov")  # a truthy "False" would step with Nesterov momentum
        m, d = _value(self.momentum), _value(self.dampening)
        if self.nesterov and ((m is not None and m <= 0) or (d is not None and d != 0)):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")


class SGDScalars(NamedTuple):
    lr: Number
    wd: Number
    momentum: Number
    one_minus_damp: Number
    nesterov: Number  # 1.0 or 0.0
    first: Number  # 1.0 at the first step: the buffer starts as the direction itself


def scalars(h: SGDHparams, step: Number) -> SGDScalars:
    # 1 // step: 1 at the first step, 0 after, with no comparison (a traced symbolic step stays unguarded)
    first = (step == 1).float() if isinstance(step, torch.Tensor) else 1 // step
    return SGDScalars(
        lr=h.lr,
        wd=h.weight_decay,
        momentum=h.momentum,
        one_minus_damp=1 - h.dampening,
        nesterov=1.0 if h.nesterov else 0.0,
        first=first,
    )


def present(h: SGDHparams) -> tuple[bool, ...]:
    m = _value(h.momentum)
    return (m is None or m != 0.0,)


@triton.jit
def momentum_step(d, buf, h):
    """The step taken for direction ``d`` with torch's momentum buffer (``h``: scalars with SGD's
    momentum, one_minus_damp, nesterov and first); shared by SGD and LARS. Returns (step, new buffer)."""
    buf = tl.where(h.first != 0, d, h.momentum * buf + h.one_minus_damp * d)
    step = tl.where(h.nesterov != 0, d + h.momentum * buf, buf)
    step = tl.where(h.momentum != 0, step, d)  # momentum 0: plain steps (no state is kept)
    return step, buf


def momentum_step_reference(d, buf, h):
    """:func:`momentum_step` in torch; ``buf`` is None when no momentum buffer is kept."""
    if buf is None:
        return d, None
    if isinstance(h.first, torch.Tensor):  # a tensor step: no host read (and no data-dependent branch to trace)
        buf = torch.where(h.first != 0, d, h.momentum * buf + h.one_minus_damp * d)
    else:
        buf = d.clone() if h.first else h.momentum * buf + h.one_minus_damp * d
    if isinstance(h.nesterov, torch.Tensor):
        return torch.where(h.nesterov != 0, d + h.momentum * buf, buf), buf
    return (d + h.momentum * buf if h.nesterov else buf), buf


@triton.jit
def sgd_math(p, g, s, hp, nrm):
    h = SGDScalars(*hp)
    (buf,) = s
    step, buf = momentum_step(g + decay_term(h.wd, p), buf, h)
    return p - h.lr * step, (buf,)


def sgd_reference(p, g, states, h: SGDScalars):
    step, buf = momentum_step_reference(g + decay_term_reference(h.wd, p), states[0], h)
    return p - h.lr * step, [buf]


SGD = Rule(
    "sgd",
    SGDHparams,
    (StateSlot("momentum_buffer", signed=True, kept_by=(("momentum", 0.5),)),),
    SGDScalars,
    scalars,
    sgd_math,
    sgd_reference,
    present=present,
)

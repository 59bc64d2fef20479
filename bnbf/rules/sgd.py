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

import triton
import triton.language as tl

from bnbf.rules.base import Number, Rule, StateSlot, _value, check_finite, check_lr, check_momentum, check_weight_decay


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
        m, d = _value(self.momentum), _value(self.dampening)
        if self.nesterov and ((m is not None and m <= 0) or (d is not None and d != 0)):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")


def scalars(h: SGDHparams, step: Number):
    first = step == 1 if not hasattr(step, "dtype") else (step == 1).float()
    return (h.lr, h.weight_decay, h.momentum, 1 - h.dampening, 1.0 if h.nesterov else 0.0, first)


def present(h: SGDHparams) -> tuple[bool, ...]:
    m = _value(h.momentum)
    return (m is None or m != 0.0,)


@triton.jit
def momentum_step(d, buf, hp):
    """The step taken for direction ``d`` with torch's momentum buffer (scalars 2..5 of ``hp``: momentum,
    1 - dampening, nesterov, first step); shared by SGD and LARS. Returns (step, new buffer)."""
    momentum = hp[2]
    one_minus_damp = hp[3]
    nesterov = hp[4]
    first = hp[5]
    buf = tl.where(first != 0, d, momentum * buf + one_minus_damp * d)
    step = tl.where(nesterov != 0, d + momentum * buf, buf)
    step = tl.where(momentum != 0, step, d)  # momentum 0: plain steps (no state is kept)
    return step, buf


def momentum_step_reference(d, buf, s):
    """:func:`momentum_step` in torch; ``buf`` is None when no momentum buffer is kept."""
    _, _, momentum, one_minus_damp, nesterov, first = s[:6]
    if buf is None:
        return d, None
    buf = d.clone() if bool(first) else momentum * buf + one_minus_damp * d
    return (d + momentum * buf if bool(nesterov) else buf), buf


@triton.jit
def sgd_math(p, g, buf, unused1, unused2, hp, nrm):
    lr = hp[0]
    wd = hp[1]
    step, buf = momentum_step(g + wd * p, buf, hp)
    return p - lr * step, buf, unused1, unused2


def sgd_reference(p, g, states, s):
    lr, wd = s[0], s[1]
    step, buf = momentum_step_reference(g + wd * p, states[0], s)
    return p - lr * step, [buf]


SGD = Rule("sgd", SGDHparams, (StateSlot("momentum_buffer", signed=True),), scalars, sgd_math, sgd_reference,
           present=present)  # fmt: skip

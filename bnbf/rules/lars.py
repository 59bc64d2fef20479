"""LARS (You et al., 2017): SGD with momentum whose step is scaled per tensor by a local learning rate.

    d     = g + wd·p
    local = η · ‖p‖ / (‖g‖ + wd·‖p‖ + ε)   (1 where ‖p‖ or ‖g‖ is 0)
    buf   = local·d  (first step)   or   μ·buf + (1 − dampening)·local·d
    p     = p − lr · (local·d + μ·buf  (nesterov)   or   buf)

η is ``trust_coefficient``. The norms come from a norm pass over all tensors before the step.
State: ``momentum_buffer`` (signed), only when momentum > 0.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from bnbf.kernels.codec import fast_div
from bnbf.rules.base import Number, Rule, StateSlot, _value, check_eps, check_lr, check_weight_decay


@dataclasses.dataclass(frozen=True, kw_only=True)
class LarsHparams:
    lr: Number = 1e-3
    momentum: Number = 0.0
    dampening: Number = 0.0
    weight_decay: Number = 0.0
    nesterov: bool = False
    trust_coefficient: Number = 1e-3
    eps: Number = 1e-8

    def __post_init__(self):
        check_lr(self.lr)
        m = _value(self.momentum)
        if m is not None and m < 0.0:
            raise ValueError(f"Invalid momentum value: {self.momentum}")
        check_weight_decay(self.weight_decay)
        check_eps(self.eps)
        tc = _value(self.trust_coefficient)
        if tc is not None and tc <= 0.0:
            raise ValueError(f"Invalid trust_coefficient value: {self.trust_coefficient}")
        d = _value(self.dampening)
        if self.nesterov and ((m is not None and m <= 0) or (d is not None and d != 0)):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")


def scalars(h: LarsHparams, step: Number):
    first = step == 1 if not hasattr(step, "dtype") else (step == 1).float()
    return (h.lr, h.weight_decay, h.momentum, 1 - h.dampening, 1.0 if h.nesterov else 0.0, first,
            h.trust_coefficient, h.eps)  # fmt: skip


def present(h: LarsHparams) -> tuple[bool, ...]:
    m = _value(h.momentum)
    return (m is None or m != 0.0,)


@triton.jit
def lars_norm_terms(p, g, buf, unused1, unused2, hp):
    return p * p, g * g, g * 0.0


@triton.jit
def lars_math(p, g, buf, unused1, unused2, hp, nrm):
    lr = tl.load(hp + 0)
    wd = tl.load(hp + 1)
    momentum = tl.load(hp + 2)
    one_minus_damp = tl.load(hp + 3)
    nesterov = tl.load(hp + 4)
    first = tl.load(hp + 5)
    trust = tl.load(hp + 6)
    eps = tl.load(hp + 7)
    p_norm = tl.sqrt(tl.load(nrm + 0))
    g_norm = tl.sqrt(tl.load(nrm + 1))
    local = tl.where((p_norm > 0) & (g_norm > 0), fast_div(trust * p_norm, g_norm + wd * p_norm + eps), 1.0)
    d = local * (g + wd * p)
    buf = tl.where(first != 0, d, momentum * buf + one_minus_damp * d)
    step = tl.where(nesterov != 0, d + momentum * buf, buf)
    step = tl.where(momentum != 0, step, d)
    p = p - lr * step
    return p, buf, unused1, unused2


def lars_norm_terms_ref(p, g, states, s):
    return p * p, g * g, torch.zeros_like(g)


def lars_reference(p, g, states, s, sums):
    lr, wd, momentum, one_minus_damp, nesterov, first, trust, eps = s
    p_norm, g_norm = sums[0].sqrt(), sums[1].sqrt()
    ok = (p_norm > 0) & (g_norm > 0)
    local = torch.where(ok, trust * p_norm / (g_norm + wd * p_norm + eps), torch.ones_like(p_norm))
    d = local * (g + wd * p)
    (buf,) = states
    if buf is None:
        return p - lr * d, [None]
    buf = d.clone() if bool(first) else momentum * buf + one_minus_damp * d
    step = d + momentum * buf if bool(nesterov) else buf
    return p - lr * step, [buf]


LARS = Rule("lars", LarsHparams, (StateSlot("momentum_buffer", signed=True),), scalars, lars_math, lars_reference,
            present=present, norms=(lars_norm_terms, lars_norm_terms_ref))  # fmt: skip

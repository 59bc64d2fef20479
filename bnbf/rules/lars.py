"""LARS (You et al., 2017): SGD with momentum whose step is scaled per tensor by a local learning rate.

    d     = g + wd·p
    local = η · ‖p‖ / (‖g‖ + wd·‖p‖ + ε)   (1 where ‖p‖ or ‖g‖ is 0)
    buf   = local·d  (first step)   or   μ·buf + (1 − dampening)·local·d
    p     = p − lr · (local·d + μ·buf  (nesterov)   or   buf)

η is ``trust_coefficient``. The norms come from a norm pass over all tensors before the step. ‖p‖² does not
depend on the grads and ‖g‖² scales with their square, and the third term is free: gradient clipping takes the
total norm from this pass (``norm_grad_powers``, see :mod:`bnbf.rules.base`).
State: ``momentum_buffer`` (signed), only when momentum > 0.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from bnbf.kernels.codec import fast_div
from bnbf.rules.base import Number, Rule, StateSlot, _value, check_eps, finite, norm_of
from bnbf.rules.decay import decay_term, decay_term_reference
from bnbf.rules.sgd import SGDHparams, SGDScalars, momentum_step, momentum_step_reference, present
from bnbf.rules.sgd import scalars as sgd_scalars


@dataclasses.dataclass(frozen=True, kw_only=True)
class LarsHparams(SGDHparams):
    trust_coefficient: Number = 1e-3
    eps: Number = 1e-8

    def __post_init__(self):
        super().__post_init__()  # lr, momentum, dampening, nesterov, weight_decay as SGD checks them
        check_eps(self.eps)
        tc = _value(self.trust_coefficient)
        if tc is not None and not (tc > 0.0 and finite(tc)):
            raise ValueError(f"Invalid trust_coefficient value: {self.trust_coefficient}")


# SGD's scalars, then LARS' own
LarsScalars = NamedTuple("LarsScalars", [(f, Number) for f in (*SGDScalars._fields, "trust", "eps")])


def scalars(h: LarsHparams, step: Number) -> LarsScalars:
    return LarsScalars(*sgd_scalars(h, step), trust=h.trust_coefficient, eps=h.eps)


@triton.jit
def lars_norm_terms(p, g, s, hp):
    return p * p, g * g, g * 0.0


@triton.jit
def lars_math(p, g, s, hp, nrm):
    h = LarsScalars(*hp)
    (buf,) = s
    p_norm = tl.sqrt(nrm[0])
    g_norm = tl.sqrt(nrm[1])
    local = tl.where((p_norm > 0) & (g_norm > 0), fast_div(h.trust * p_norm, g_norm + h.wd * p_norm + h.eps), 1.0)
    step, buf = momentum_step(local * (g + decay_term(h.wd, p)), buf, h)
    return p - h.lr * step, (buf,)


def lars_norm_terms_ref(p, g, states, h: LarsScalars):
    return p * p, g * g, torch.zeros_like(g)


def lars_reference(p, g, states, h: LarsScalars, sums):
    p_norm, g_norm = norm_of(sums[0]), norm_of(sums[1])
    ok = (p_norm > 0) & (g_norm > 0)
    local = torch.where(ok, h.trust * p_norm / (g_norm + h.wd * p_norm + h.eps), torch.ones_like(p_norm))
    step, buf = momentum_step_reference(local * (g + decay_term_reference(h.wd, p)), states[0], h)
    return p - h.lr * step, [buf]


LARS = Rule(
    "lars",
    LarsHparams,
    (StateSlot("momentum_buffer", signed=True, kept_by=(("momentum", 0.5),)),),
    LarsScalars,
    scalars,
    lars_math,
    lars_reference,
    present=present,
    norms=(lars_norm_terms, lars_norm_terms_ref),
    norm_grad_powers=(0, 2),
)

"""LAMB (You et al., 2019) as ``torch_optimizer.Lamb``: Adam's step scaled per tensor by a trust ratio.

    m = β1·m + (1 − β1)·g;  v = β2·v + (1 − β2)·g²
    u = m / (√v + ε) + wd·p
    r = min(‖p‖, clamp_value) / ‖u‖   (1 where either norm is 0, or with adam=True)
    p = p − lr · c · r · u,   c = √(1 − β2^t) / (1 − β1^t) with debias=True, else 1

The norms come from a norm pass over all tensors before the step (one launch each).
States: ``exp_avg`` (signed), ``exp_avg_sq`` (unsigned).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from bnbf.kernels.codec import fast_div
from bnbf.rules.adam import AdamMomentsHparams
from bnbf.rules.base import Number, Rule, StateSlot, _value, check_flag, finite, norm_of
from bnbf.rules.decay import decay_term, decay_term_reference


@dataclasses.dataclass(frozen=True, kw_only=True)
class LambHparams(AdamMomentsHparams):
    eps: Number = 1e-6  # torch_optimizer.Lamb's default
    clamp_value: float = 10.0
    adam: bool = False
    debias: bool = False

    def __post_init__(self):
        super().__post_init__()  # lr, eps, betas, weight_decay as Adam checks them
        check_flag(self.adam, "adam")
        check_flag(self.debias, "debias")
        c = _value(self.clamp_value, "clamp_value")
        if c is not None and not (c >= 0.0 and finite(c)):
            raise ValueError(f"Invalid clamp value: {self.clamp_value}")


class LambScalars(NamedTuple):
    step_size: Number  # lr, times sqrt(1 - β2^t) / (1 - β1^t) with debias
    b1: Number
    b2: Number
    eps: Number
    wd: Number
    clamp_value: Number
    adam: Number  # 1.0: no trust ratio
    omb1: Number  # 1 - beta in double precision (see adam.py)
    omb2: Number


def scalars(h: LambHparams, step: Number) -> LambScalars:
    b1, b2 = h.betas
    c = (1 - b2**step) ** 0.5 / (1 - b1**step) if h.debias else 1.0
    return LambScalars(
        step_size=h.lr * c,
        b1=b1,
        b2=b2,
        eps=h.eps,
        wd=h.weight_decay,
        clamp_value=h.clamp_value,
        adam=1.0 if h.adam else 0.0,
        omb1=1 - b1,
        omb2=1 - b2,
    )


@triton.jit
def _direction(p, g, s, h):
    m, v = s
    m = h.b1 * m + h.omb1 * g
    v = h.b2 * v + h.omb2 * g * g
    u = fast_div(m, tl.sqrt(v) + h.eps) + decay_term(h.wd, p)
    return u, m, v


@triton.jit
def lamb_norm_terms(p, g, s, hp):
    u, m, v = _direction(p, g, s, LambScalars(*hp))
    return p * p, u * u, u * 0.0


@triton.jit
def lamb_math(p, g, s, hp, nrm):
    h = LambScalars(*hp)
    u, m, v = _direction(p, g, s, h)
    w_norm = tl.minimum(tl.sqrt(nrm[0]), h.clamp_value)
    u_norm = tl.sqrt(nrm[1])
    ratio = tl.where((w_norm > 0) & (u_norm > 0) & (h.adam == 0), w_norm / tl.maximum(u_norm, 1e-30), 1.0)
    p = p - h.step_size * ratio * u
    return p, (m, v)


def _direction_ref(p, g, states, h: LambScalars):
    m, v = states
    m = h.b1 * m + h.omb1 * g
    v = h.b2 * v + h.omb2 * g * g
    return m / (v.sqrt() + h.eps) + decay_term_reference(h.wd, p), m, v


def lamb_norm_terms_ref(p, g, states, h: LambScalars):
    u, _, _ = _direction_ref(p, g, states, h)
    return p * p, u * u, torch.zeros_like(u)


def lamb_reference(p, g, states, h: LambScalars, sums):
    u, m, v = _direction_ref(p, g, states, h)
    w_norm = norm_of(sums[0]).clamp(max=h.clamp_value)
    u_norm = norm_of(sums[1])
    ok = (w_norm > 0) & (u_norm > 0) & (h.adam == 0)
    ratio = torch.where(ok, w_norm / u_norm.clamp_min(1e-30), torch.ones_like(w_norm))
    return p - h.step_size * ratio * u, [m, v]


_STATES = (StateSlot("exp_avg", signed=True), StateSlot("exp_avg_sq", signed=False))
LAMB = Rule(
    "lamb",
    LambHparams,
    _STATES,
    LambScalars,
    scalars,
    lamb_math,
    lamb_reference,
    norms=(lamb_norm_terms, lamb_norm_terms_ref),
)

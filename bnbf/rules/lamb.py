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

import torch
import triton
import triton.language as tl

from bnbf.kernels.codec import fast_div
from bnbf.rules.adam import AdamMomentsHparams
from bnbf.rules.base import Number, Rule, StateSlot, _value, finite


@dataclasses.dataclass(frozen=True, kw_only=True)
class LambHparams(AdamMomentsHparams):
    eps: Number = 1e-6  # torch_optimizer.Lamb's default
    clamp_value: float = 10.0
    adam: bool = False
    debias: bool = False

    def __post_init__(self):
        super().__post_init__()  # lr, eps, betas, weight_decay as Adam checks them
        c = _value(self.clamp_value, "clamp_value")
        if c is not None and not (c >= 0.0 and finite(c)):
            raise ValueError(f"Invalid clamp value: {self.clamp_value}")


def scalars(h: LambHparams, step: Number):
    b1, b2 = h.betas
    c = (1 - b2**step) ** 0.5 / (1 - b1**step) if h.debias else 1.0
    # 7, 8: 1 - beta in double precision (see adam.py)
    return (h.lr * c, b1, b2, h.eps, h.weight_decay, h.clamp_value, 1.0 if h.adam else 0.0, 1 - b1, 1 - b2)


@triton.jit
def _direction(p, g, m, v, hp):
    b1 = hp[1]
    b2 = hp[2]
    eps = hp[3]
    wd = hp[4]
    m = b1 * m + hp[7] * g
    v = b2 * v + hp[8] * g * g
    u = fast_div(m, tl.sqrt(v) + eps) + wd * p
    return u, m, v


@triton.jit
def lamb_norm_terms(p, g, m, v, unused, hp):
    u, m, v = _direction(p, g, m, v, hp)
    return p * p, u * u, u * 0.0


@triton.jit
def lamb_math(p, g, m, v, unused, hp, nrm):
    u, m, v = _direction(p, g, m, v, hp)
    step_size = hp[0]
    clamp_value = hp[5]
    adam = hp[6]
    w_norm = tl.minimum(tl.sqrt(nrm[0]), clamp_value)
    u_norm = tl.sqrt(nrm[1])
    ratio = tl.where((w_norm > 0) & (u_norm > 0) & (adam == 0), w_norm / tl.maximum(u_norm, 1e-30), 1.0)
    p = p - step_size * ratio * u
    return p, m, v, unused


def _direction_ref(p, g, states, s):
    m, v = states
    _, b1, b2, eps, wd, _, _, omb1, omb2 = s
    m = b1 * m + omb1 * g
    v = b2 * v + omb2 * g * g
    return m / (v.sqrt() + eps) + wd * p, m, v


def lamb_norm_terms_ref(p, g, states, s):
    u, _, _ = _direction_ref(p, g, states, s)
    return p * p, u * u, torch.zeros_like(u)


def lamb_reference(p, g, states, s, sums):
    u, m, v = _direction_ref(p, g, states, s)
    step_size, clamp_value, adam = s[0], s[5], s[6]
    w_norm = sums[0].sqrt().clamp(max=clamp_value)
    u_norm = sums[1].sqrt()
    ok = (w_norm > 0) & (u_norm > 0) & (adam == 0)
    ratio = torch.where(ok, w_norm / u_norm.clamp_min(1e-30), torch.ones_like(w_norm))
    return p - step_size * ratio * u, [m, v]


_STATES = (StateSlot("exp_avg", signed=True), StateSlot("exp_avg_sq", signed=False))
LAMB = Rule("lamb", LambHparams, _STATES, scalars, lamb_math, lamb_reference,
            norms=(lamb_norm_terms, lamb_norm_terms_ref))  # fmt: skip

"""Adan (Xie et al., 2022, "Adan: Adaptive Nesterov Momentum Algorithm"), as the authors' implementation:

    Δ  = g − g_prev                  (0 at the first step)
    m  = β1·m + (1 − β1)·g
    d  = β2·d + (1 − β2)·Δ
    n  = β3·n + (1 − β3)·(g + β2·Δ)²
    u  = (lr/(1 − β1^t)·m + lr·β2/(1 − β2^t)·d) / (√n / √(1 − β3^t) + ε)
    p  = (p − u) / (1 + lr·wd)       (proximal decay, the default)
    p  = p·(1 − lr·wd) − u           (no_prox=True)

States: ``exp_avg`` (m, signed), ``exp_avg_sq`` (n, unsigned), ``exp_avg_diff`` (d, signed) and
``neg_pre_grad`` (−g_prev, signed), under the authors' names. The global gradient clipping of their
``max_grad_norm`` is not a per-tensor rule and is not provided.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from bnbf.kernels.codec import fast_div
from bnbf.rules.base import Number, Rule, StateSlot, check_betas_of, check_eps, check_flag, check_lr, check_weight_decay
from bnbf.rules.decay import decay_term, decay_term_reference


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdanHparams:
    lr: Number = 1e-3
    betas: tuple[Number, Number, Number] = (0.98, 0.92, 0.99)
    eps: Number = 1e-8
    weight_decay: Number = 0.0
    no_prox: bool = False

    def __post_init__(self):
        check_lr(self.lr)
        check_eps(self.eps)
        check_betas_of(self, 3)
        check_weight_decay(self.weight_decay)
        check_flag(self.no_prox, "no_prox")


class AdanScalars(NamedTuple):
    # the two step sizes, lr/(1 - β1^t) and lr·β2/(1 - β2^t), times 1/(1 + lr·wd) for the proximal decay
    step_size: Number
    step_size_diff: Number
    b1: Number
    b2: Number
    b3: Number
    eps: Number
    inv_bc3_sqrt: Number  # 1 / sqrt(1 - β3^t)
    # the decay's share of p: lr·wd/(1 + lr·wd), or lr·wd with no_prox. Applied as p - decay·p: as p·(1 - decay)
    # the float32 factor keeps a decay of 6e-6 to 0.5%, and p came out 2 ulps apart with float and with 0-d
    # tensor hyperparameters. Taken with the update, p − (decay·p + u): p rounded after its decay rounds by nearly
    # the same amount every step, and drifted from the float64 reference
    decay: Number
    not_first: Number  # 0.0 at the first step: there is no previous gradient, the difference is 0
    # 1 - beta in double precision (see adam.py)
    omb1: Number
    omb2: Number
    omb3: Number


def scalars(h: AdanHparams, step: Number) -> AdanScalars:
    b1, b2, b3 = h.betas
    lr_wd = h.lr * h.weight_decay
    # proximal: (p - u)/(1 + lr·wd) = p - p·lr·wd/(1 + lr·wd) - u/(1 + lr·wd), the last factor folded into the
    # step sizes
    prox = 1.0 if h.no_prox else 1 / (1 + lr_wd)
    return AdanScalars(
        step_size=h.lr / (1 - b1**step) * prox,
        step_size_diff=h.lr * b2 / (1 - b2**step) * prox,
        b1=b1,
        b2=b2,
        b3=b3,
        eps=h.eps,
        inv_bc3_sqrt=1 / (1 - b3**step) ** 0.5,
        decay=lr_wd * prox,
        not_first=(step != 1).float() if isinstance(step, torch.Tensor) else 1 - 1 // step,  # unguarded when traced
        omb1=1 - b1,
        omb2=1 - b2,
        omb3=1 - b3,
    )


@triton.jit
def adan_math(p, g, s, hp, nrm):
    h = AdanScalars(*hp)
    m, n, d, neg_prev = s
    diff = (g + neg_prev) * h.not_first
    m = h.b1 * m + h.omb1 * g
    d = h.b2 * d + h.omb2 * diff
    u = g + h.b2 * diff
    n = h.b3 * n + h.omb3 * u * u
    denom = tl.sqrt(n) * h.inv_bc3_sqrt + h.eps
    p = p - (decay_term(h.decay, p) + fast_div(h.step_size * m + h.step_size_diff * d, denom))
    return p, (m, n, d, -g)


def adan_reference(p, g, states, h: AdanScalars):
    m, n, d, neg_prev = states
    diff = (g + neg_prev) * h.not_first
    m = h.b1 * m + h.omb1 * g
    d = h.b2 * d + h.omb2 * diff
    u = g + h.b2 * diff
    n = h.b3 * n + h.omb3 * u * u
    u = (h.step_size * m + h.step_size_diff * d) / (n.sqrt() * h.inv_bc3_sqrt + h.eps)
    p = p - (decay_term_reference(h.decay, p) + u)
    return p, [m, n, d, -g]


_STATES = (
    StateSlot("exp_avg", signed=True),
    StateSlot("exp_avg_sq", signed=False),
    StateSlot("exp_avg_diff", signed=True),
    StateSlot("neg_pre_grad", signed=True),
)
ADAN = Rule("adan", AdanHparams, _STATES, AdanScalars, scalars, adan_math, adan_reference)

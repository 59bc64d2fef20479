"""AdEMAMix (Pagliardini et al., 2024): Adam plus a slow EMA of the gradient, decoupled weight decay.

    m1 = β1·m1 + (1 − β1)·g
    m2 = β3(t)·m2 + (1 − β3(t))·g
    ν  = β2·ν + (1 − β2)·g²
    p  = p·(1 − lr·wd) − lr · (m1/(1 − β1^t) + α(t)·m2) / (√(ν/(1 − β2^t)) + ε)

with the optional warm-ups of the paper: α(t) = min(t·α/T_α, α) and
β3(t) = min(exp(ln β1 · ln β3 / ((1 − t/T_β3)·ln β3 + (t/T_β3)·ln β1)), β3).

States: ``exp_avg`` (m1, signed), ``exp_avg_slow`` (m2, signed), ``exp_avg_sq`` (ν, unsigned). Each is its
own quantized tensor with its own per-block absmax.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from bnbf.kernels.codec import fast_div
from bnbf.rules.base import (
    Number,
    Rule,
    StateSlot,
    check_betas_of,
    check_eps,
    check_lr,
    check_nonneg,
    check_weight_decay,
    finite,
)
from bnbf.rules.decay import decay_term, decay_term_reference


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdEMAMixHparams:
    lr: Number = 1e-3
    betas: tuple[Number, Number, Number] = (0.9, 0.999, 0.9999)
    alpha: Number = 5.0
    t_alpha: float | None = None  # steps of the warm-ups: numbers (bitsandbytes' 2.5e5 as well as 250000)
    t_beta3: float | None = None
    eps: Number = 1e-8
    weight_decay: Number = 1e-2

    def __post_init__(self):
        check_lr(self.lr)
        check_eps(self.eps)
        check_betas_of(self, 3)
        check_weight_decay(self.weight_decay)
        check_nonneg(self.alpha, "alpha")
        for name in ("t_alpha", "t_beta3"):
            v = getattr(self, name)
            # beyond float32 as every hyperparameter (beyond float64 the warm-ups' divisions raised OverflowError)
            if v is not None and (type(v) not in (int, float) or v < 1 or not finite(v)):
                raise ValueError(f"Invalid {name} value: {v} (a positive number of steps, or None)")


def _inv_ln(x):
    # 1/ln x, and 1/ln 0 = -0.0: its limit, so that a β1 or β3 of 0 gives the warm-up's limit, not a log error or NaN
    if isinstance(x, torch.Tensor):
        return 1 / x.log()
    if isinstance(x, (int, float)) and x == 0:
        return -0.0
    # log2, not log: Dynamo traces math.log2 of a traced Python number symbolically, where math.log specializes
    # on its value (a new graph at every step whose β1 or β3 changes)
    return _LOG2_E / math.log2(x)


_LOG2_E = math.log2(math.e)


def _min(a, b):
    # sym_min: a traced symbolic number stays unguarded (a comparison would guard, and on floats that fails); and
    # clamp_max, not minimum with torch.as_tensor(b), which makes a traced number a constant (a compile per value)
    return torch.clamp_max(a, b) if isinstance(a, torch.Tensor) else torch.sym_min(a, b)


def _alpha(h: AdEMAMixHparams, step):
    return h.alpha if h.t_alpha is None else _min(step * h.alpha / h.t_alpha, h.alpha)


def _beta3(h: AdEMAMixHparams, step):
    b1, _, b3 = h.betas
    if h.t_beta3 is None:
        return b3
    if isinstance(b3, (int, float)) and b3 == 0:
        return b3  # min(·, 0); the formula below would divide by zero
    frac = step / h.t_beta3
    # ln β1·ln β3 / ((1 − f)·ln β3 + f·ln β1) written as 1 / ((1 − f)/ln β1 + f/ln β3): the same number, finite
    # where β1 or β3 is 0 (there the paper's form takes log 0)
    x = 1 / ((1 - frac) * _inv_ln(b1) + frac * _inv_ln(b3))
    if isinstance(x, torch.Tensor):
        return _min(x.exp(), b3)
    # exp(x) as e ** x: a traced symbolic step stays symbolic through a power, where math.exp would make it a
    # constant (a compile per step)
    return _min(math.e**x, b3)


class AdEMAMixScalars(NamedTuple):
    lr1: Number  # step size of m1: lr / (1 - β1^t)
    lr2: Number  # step size of m2: lr·α(t)
    b1: Number
    b2: Number
    b3: Number  # β3(t)
    eps: Number
    inv_bc2_sqrt: Number  # 1 / sqrt(1 - β2^t)
    # the decoupled decay's share of p, lr·wd, taken with the step as p − (decay·p + u), the paper's θ − η(u + λθ):
    # as p·(1 − lr·wd) the float32 factor is off by up to 3e-8 (1.3% of a decay of 1e-6 a step, all of one below
    # 3e-8), and as (p − decay·p) − u p rounds twice, the first time by nearly the same amount every step (drift)
    decay: Number
    # 1 - beta in double precision (from the float32 beta3 = 0.9999, 1 - beta3 is 2e-4 off)
    omb1: Number
    omb2: Number
    omb3: Number


def scalars(h: AdEMAMixHparams, step: Number) -> AdEMAMixScalars:
    b1, b2, _ = h.betas
    b3 = _beta3(h, step)
    return AdEMAMixScalars(
        lr1=h.lr / (1 - b1**step),
        lr2=h.lr * _alpha(h, step),
        b1=b1,
        b2=b2,
        b3=b3,
        eps=h.eps,
        inv_bc2_sqrt=1 / (1 - b2**step) ** 0.5,
        decay=h.lr * h.weight_decay,
        omb1=1 - b1,
        omb2=1 - b2,
        omb3=1 - b3,
    )


@triton.jit
def ademamix_math(p, g, s, hp, nrm):
    h = AdEMAMixScalars(*hp)
    m1, m2, nu = s
    m1 = h.b1 * m1 + h.omb1 * g
    m2 = h.b3 * m2 + h.omb3 * g
    nu = h.b2 * nu + h.omb2 * g * g
    p = p - (decay_term(h.decay, p) + fast_div(h.lr1 * m1 + h.lr2 * m2, tl.sqrt(nu) * h.inv_bc2_sqrt + h.eps))
    return p, (m1, m2, nu)


def ademamix_reference(p, g, states, h: AdEMAMixScalars):
    m1, m2, nu = states
    m1 = h.b1 * m1 + h.omb1 * g
    m2 = h.b3 * m2 + h.omb3 * g
    nu = h.b2 * nu + h.omb2 * g * g
    p = p - (decay_term_reference(h.decay, p) + (h.lr1 * m1 + h.lr2 * m2) / (nu.sqrt() * h.inv_bc2_sqrt + h.eps))
    return p, [m1, m2, nu]


_STATES = (
    StateSlot("exp_avg", signed=True),
    StateSlot("exp_avg_slow", signed=True),
    StateSlot("exp_avg_sq", signed=False),
)
ADEMAMIX = Rule("ademamix", AdEMAMixHparams, _STATES, AdEMAMixScalars, scalars, ademamix_math, ademamix_reference)

"""Adam (L2 weight decay, as ``torch.optim.Adam``) and AdamW (decoupled, as ``torch.optim.AdamW``).

    g  = g + wd·p                      (adam)      p = p·(1 − lr·wd)   (adamw)
    m  = β1·m + (1 − β1)·g
    v  = β2·v + (1 − β2)·g²
    v̂  = max(v̂, v)   (amsgrad; v̂ = v otherwise)
    p  = p − lr/(1 − β1^t) · m / (√v̂ / √(1 − β2^t) + ε)

States: ``exp_avg`` (the format's signed map), ``exp_avg_sq`` (its unsigned map: it is never negative) and, only with
``amsgrad=True``, ``max_exp_avg_sq`` (unsigned; torch.optim's name).
"""

from __future__ import annotations

import dataclasses
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
    check_flag,
    check_lr,
    check_weight_decay,
)
from bnbf.rules.decay import decay_term, decay_term_reference


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdamMomentsHparams:
    """What Adam and LAMB share: lr, betas, eps, weight_decay (LAMB's hparams extend this, not Adam's, so that
    they have no amsgrad)."""

    lr: Number = 1e-3
    betas: tuple[Number, Number] = (0.9, 0.999)
    eps: Number = 1e-8
    weight_decay: Number = 0.0

    def __post_init__(self):
        check_lr(self.lr)
        check_eps(self.eps)
        check_betas_of(self, 2)
        check_weight_decay(self.weight_decay)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdamHparams(AdamMomentsHparams):
    amsgrad: bool = False

    def __post_init__(self):
        super().__post_init__()
        check_flag(self.amsgrad, "amsgrad")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdamWHparams(AdamHparams):
    weight_decay: Number = 1e-2


class AdamScalars(NamedTuple):
    step_size: Number  # lr / (1 - β1^t)
    b1: Number
    b2: Number
    eps: Number
    inv_bc2_sqrt: Number  # 1 / sqrt(1 - β2^t)
    l2: Number  # L2 coefficient added to the gradient (Adam)
    decay: Number  # decoupled decay factor 1 - lr·wd (AdamW)
    # 1 - beta in double precision on the host. Formed in the kernel from the float32 beta, 1 - 0.999 is
    # 0.00099998713 (1.3e-5 off), enough to move a quantization code across a midpoint
    omb1: Number
    omb2: Number


def _scalars(decoupled: bool):
    def scalars(h: AdamMomentsHparams, step: Number) -> AdamScalars:
        b1, b2 = h.betas
        wd = h.weight_decay
        return AdamScalars(
            step_size=h.lr / (1 - b1**step),
            b1=b1,
            b2=b2,
            eps=h.eps,
            inv_bc2_sqrt=1 / (1 - b2**step) ** 0.5,
            l2=0.0 if decoupled else wd,
            decay=1 - h.lr * wd if decoupled else 1.0,
            omb1=1 - b1,
            omb2=1 - b2,
        )

    return scalars


def present(h: AdamHparams) -> tuple[bool, ...]:
    return (True, True, h.amsgrad)


@triton.jit
def adam_math(p, g, s, hp, nrm):
    h = AdamScalars(*hp)
    return _moments_step(p, g + decay_term(h.l2, p), s, h)


@triton.jit
def adamw_math(p, g, s, hp, nrm):
    # AdamW's l2 is always 0: its own math leaves out the multiply-add (one instruction per element)
    return _moments_step(p, g, s, AdamScalars(*hp))


@triton.jit
def _moments_step(p, g, s, h):
    m, v, vmax = s
    m = h.b1 * m + h.omb1 * g
    v = h.b2 * v + h.omb2 * g * g
    # amsgrad: the running maximum. Without it the slot is not kept and arrives as the scalar 0.0 (a 0-d value where a
    # kept slot is a tile), and v itself is the maximum: the shape is known when the kernel compiles
    if len(vmax.shape) > 0:
        vmax = tl.maximum(vmax, v)
    else:
        vmax = v
    denom = tl.sqrt(vmax) * h.inv_bc2_sqrt + h.eps
    p = p * h.decay - h.step_size * fast_div(m, denom)
    return p, (m, v, vmax)


def adam_reference(p, g, states, h: AdamScalars):
    return _moments_reference(p, g + decay_term_reference(h.l2, p), states, h)


def adamw_reference(p, g, states, h: AdamScalars):
    # as adamw_math, no l2 term
    return _moments_reference(p, g, states, h)


def _moments_reference(p, g, states, h: AdamScalars):
    m, v, vmax = states
    m = h.b1 * m + h.omb1 * g
    v = h.b2 * v + h.omb2 * g * g
    if vmax is not None:  # amsgrad
        vmax = torch.maximum(vmax, v)
    p = p * h.decay - h.step_size * m / ((v if vmax is None else vmax).sqrt() * h.inv_bc2_sqrt + h.eps)
    return p, [m, v, vmax]


_STATES = (
    StateSlot("exp_avg", signed=True),
    StateSlot("exp_avg_sq", signed=False),
    StateSlot("max_exp_avg_sq", signed=False, kept_by=(("amsgrad", True),)),
)

ADAM = Rule("adam", AdamHparams, _STATES, AdamScalars, _scalars(False), adam_math, adam_reference, present=present)
ADAMW = Rule("adamw", AdamWHparams, _STATES, AdamScalars, _scalars(True), adamw_math, adamw_reference, present=present)

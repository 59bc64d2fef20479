"""Adam (L2 weight decay, as ``torch.optim.Adam``) and AdamW (decoupled, as ``torch.optim.AdamW``).

    g  = g + wd·p                      (adam)      p = p·(1 − lr·wd)   (adamw)
    m  = β1·m + (1 − β1)·g
    v  = β2·v + (1 − β2)·g²
    v̂  = max(v̂, v)   (amsgrad; v̂ = v otherwise)
    p  = p − lr/(1 − β1^t) · m / (√v̂ / √(1 − β2^t) + ε)

States: ``exp_avg`` (signed dynamic map), ``exp_avg_sq`` (unsigned map: it is never negative) and, only with
``amsgrad=True``, ``max_exp_avg_sq`` (unsigned; torch.optim's name).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from bnbf.kernels.codec import fast_div
from bnbf.rules.base import (
    Number,
    Rule,
    StateSlot,
    check_betas,
    check_eps,
    check_flag,
    check_lr,
    check_weight_decay,
)  # fmt: skip


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
        if len(self.betas) != 2:
            raise ValueError(f"betas must be a pair, got {self.betas}")
        check_betas(self.betas)
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


def _scalars(decoupled: bool):
    def scalars(h: AdamMomentsHparams, step: Number):
        b1, b2 = h.betas
        wd = h.weight_decay
        return (
            h.lr / (1 - b1**step),  # 0: step size
            b1,  # 1
            b2,  # 2
            h.eps,  # 3
            1 / (1 - b2**step) ** 0.5,  # 4: 1 / sqrt(bias correction 2)
            0.0 if decoupled else wd,  # 5: L2 coefficient added to the gradient
            1 - h.lr * wd if decoupled else 1.0,  # 6: decoupled decay factor
            # 7, 8: 1 - beta in double precision on the host. Formed in the kernel from the float32 beta,
            # 1 - 0.999 is 0.00099998713 (1.3e-5 off), enough to move a quantization code across a midpoint
            1 - b1,
            1 - b2,
        )

    return scalars


def present(h: AdamHparams) -> tuple[bool, ...]:
    return (True, True, h.amsgrad)


@triton.jit
def adam_math(p, g, m, v, vmax, hp, nrm):
    step_size = hp[0]
    b1 = hp[1]
    b2 = hp[2]
    eps = hp[3]
    inv_bc2_sqrt = hp[4]
    l2 = hp[5]
    decay = hp[6]
    omb1 = hp[7]
    omb2 = hp[8]
    g = g + l2 * p
    m = b1 * m + omb1 * g
    v = b2 * v + omb2 * g * g
    # amsgrad: the running maximum. Without it the slot is not kept and arrives as the scalar 0.0, and
    # max(0, v) is v (v >= 0): one max instruction instead of a second kernel variant
    vmax = tl.maximum(vmax, v)
    denom = tl.sqrt(vmax) * inv_bc2_sqrt + eps
    p = p * decay - step_size * fast_div(m, denom)
    return p, m, v, vmax


def adam_reference(p, g, states, s):
    m, v, vmax = states
    step_size, b1, b2, eps, inv_bc2_sqrt, l2, decay, omb1, omb2 = s
    g = g + l2 * p
    m = b1 * m + omb1 * g
    v = b2 * v + omb2 * g * g
    if vmax is not None:  # amsgrad
        vmax = torch.maximum(vmax, v)
    p = p * decay - step_size * m / ((v if vmax is None else vmax).sqrt() * inv_bc2_sqrt + eps)
    return p, [m, v, vmax]


_STATES = (
    StateSlot("exp_avg", signed=True),
    StateSlot("exp_avg_sq", signed=False),
    StateSlot("max_exp_avg_sq", signed=False),
)

ADAM = Rule("adam", AdamHparams, _STATES, _scalars(False), adam_math, adam_reference, present=present)
ADAMW = Rule("adamw", AdamWHparams, _STATES, _scalars(True), adam_math, adam_reference, present=present)

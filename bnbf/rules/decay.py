"""The weight-decay term ``c·p`` the rules add, as torch.optim adds it: a coefficient of 0 adds nothing.

torch skips the term when weight decay is 0, so a param element that is already ±inf or NaN keeps its value and
its states step from the gradient alone; ``0·p`` would be NaN there (and, in 8-bit state, spoil the element's
states). Where the coefficient is 0 and the element is finite the product is kept, so a derivative with
respect to the coefficient stays ``p`` (the differentiable step) and finite params step bit for bit as before.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def decay_term(c, p):
    """``c·p``; 0 where ``c`` is 0 and ``p`` is ±inf or NaN (``c``: a scalar, ``p``: a float32 tile)."""
    cp = c * p
    return tl.where(tl.abs(p) < float("inf"), cp, tl.where(c != 0, cp, 0.0))  # (no | of a scalar: the interpreter)


def decay_term_reference(c, p):
    """:func:`decay_term` in torch (``c``: a number or a 0-d tensor)."""
    return torch.where(torch.isfinite(p) | (c != 0), c * p, 0.0)

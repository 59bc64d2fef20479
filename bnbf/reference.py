"""The pure-torch optimizer step: the CPU path and the oracle the Triton kernels are tested against.

Per tensor: dequantize the states to float32, run the rule's ``reference`` math (:func:`step_math`), apply the
non-finite gradient rule, write the param in its dtype and requantize the states (stochastic rounding, see
bnbf.quant). :func:`step_math` is written in differentiable torch ops only (no in-place writes, no reads of
values on the host), so ``bnbf.update(..., differentiable=True)`` runs it as it is.
"""

from __future__ import annotations

import torch

from bnbf._dispatch import NORM_REDUCE
from bnbf.quant import dequantize_state_reference, quantize_state_reference, state_dither
from bnbf.rules import get_rule


def step_math(rule, p, g, states, scalars, max_unorm, lr, skip_zeros=False, clip=False):
    """One tensor's step on dequantized values: ``(new_p, new_states, finite)``.

    Args:
        rule: the rule (``bnbf.RULES[name]``).
        p, g: the param and the gradient (already negated for ``maximize``), in the compute dtype.
        states: one tensor per rule slot (``None`` for a slot the state does not keep).
        scalars: the rule's scalars NamedTuple (0-d tensors or numbers).
        max_unorm, lr: the clipping pair, read only with ``clip``.

    Returns:
        The new param (non-finite gradient elements keep their old value), the new states (not yet zeroed
        where the gradient is non-finite) and the mask of finite gradient elements.
    """
    finite = torch.isfinite(g)
    counted = finite & (g != 0) if skip_zeros else finite
    if rule.norms is not None:  # per-tensor sums of the rule's terms over the counted elements
        terms = rule.norms[1](p, g, states, scalars)
        sums = _reduced([torch.where(counted, t, torch.zeros_like(t)).sum() for t in terms])
        new_p, new_states = rule.reference(p, g, states, scalars, sums)
    else:
        new_p, new_states = rule.reference(p, g, states, scalars)
        if clip:  # ||update|| <= max_unorm * ||p||, update = change per unit of lr
            zero = torch.zeros_like(p)
            d = (new_p - p) / lr
            pnorm, unorm = (x.sqrt() for x in _reduced([torch.where(counted, x * x, zero).sum() for x in (p, d)]))
            limit = max_unorm * pnorm
            scale = torch.where(unorm > limit, limit / unorm.clamp_min(1e-30), torch.ones_like(unorm))
            new_p = p + scale * (new_p - p)
    if skip_zeros:  # an exactly-zero gradient element leaves its param element and states alone
        keep = g == 0
        new_p = torch.where(keep, p, new_p)
        new_states = [s if s is None else torch.where(keep, old, s) for s, old in zip(new_states, states)]
    return torch.where(finite, new_p, p), new_states, finite


def _reduced(sums: list) -> list:
    """Per-tensor sums, summed across the shards of a sharded tensor where bnbf.distributed asks for it."""
    reduce = NORM_REDUCE.get()
    if reduce is None:
        return sums
    both = torch.stack(sums)
    reduce(both)
    return list(both.unbind())


def reference_step(p_in, p_out, grads, s_in, s_out, hp, layout, skip_zeros=False, clip=False) -> None:
    rule = get_rule(layout.rule)
    fmt, block_size = layout.format, layout.block_size
    quant = layout.quantized
    slots = [j for j in range(len(rule.states)) if (layout.present >> j) & 1]
    per = 2 * len(slots) if quant else len(slots)
    *scalars, grad_sign, seed, max_unorm, lr = hp.unbind()  # the rule's scalars, then the four the step adds
    scalars = rule.scalar_names(*scalars)
    for i, (p, g) in enumerate(zip(p_in, grads)):
        p32 = p.float()
        g32 = g.float() * grad_sign
        fields = s_in[i * per : (i + 1) * per]
        states: list = [None] * len(rule.states)
        for k, j in enumerate(slots):
            signed = rule.states[j].signed
            if quant:
                states[j] = dequantize_state_reference(fields[2 * k], fields[2 * k + 1], fmt, signed, block_size)
            else:
                states[j] = fields[k].float()
        # a non-finite gradient element leaves its param element alone and zeroes its states
        new_p, new_states, finite = step_math(rule, p32, g32, states, scalars, max_unorm, lr, skip_zeros, clip)
        out = s_out[i * per : (i + 1) * per]
        p_out[i].copy_(new_p.to(p.dtype))
        # stochastic rounding, as the kernels: one offset per element, shared by its states
        d = state_dither(p.numel(), int(seed), block_size, p.device) if quant else None
        for k, j in enumerate(slots):
            s = torch.where(finite, new_states[j], torch.zeros_like(new_states[j]))
            if quant:
                codes, absmax = quantize_state_reference(s, fmt, rule.states[j].signed, block_size, d)
                out[2 * k].copy_(codes)
                out[2 * k + 1].copy_(absmax)
            else:
                out[k].copy_(s)

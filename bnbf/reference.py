"""The pure-torch optimizer step: the CPU path and the oracle the Triton kernels are tested against.

Per tensor: dequantize the states to float32, run the rule's ``reference`` math, apply the non-finite
gradient rule, write the param in its dtype and requantize the states with nearest-code rounding.
"""

from __future__ import annotations

import torch

from bnbf.quant import dequantize_state_reference, quantize_state_reference
from bnbf.rules import get_rule


def reference_step(p_in, p_out, grads, s_in, s_out, hp, hp_rows, rule_name, fmt, block_size) -> None:
    rule = get_rule(rule_name)
    n = len(rule.states)
    quant = fmt != "fp32"
    per = 2 * n if quant else n
    signed = [slot.signed for slot in rule.states]
    for i, (p, g) in enumerate(zip(p_in, grads)):
        scalars = list(hp[hp_rows[i]].unbind())
        p32 = p.float()
        g32 = g.float()
        fields = s_in[i * per : (i + 1) * per]
        if quant:
            states = [
                dequantize_state_reference(fields[2 * j], fields[2 * j + 1], fmt, signed[j], block_size)
                for j in range(n)
            ]
        else:
            states = [f.float() for f in fields]
        new_p, new_states = rule.reference(p32, g32, states, scalars)
        # a non-finite gradient element leaves its param element alone and zeroes its states
        finite = torch.isfinite(g32)
        new_p = torch.where(finite, new_p, p32)
        new_states = [torch.where(finite, s, torch.zeros_like(s)) for s in new_states]
        out = s_out[i * per : (i + 1) * per]
        p_out[i].copy_(new_p.to(p.dtype))
        for j, s in enumerate(new_states):
            if quant:
                codes, absmax = quantize_state_reference(s, fmt, signed[j], block_size)
                out[2 * j].copy_(codes)
                out[2 * j + 1].copy_(absmax)
            else:
                out[j].copy_(s)

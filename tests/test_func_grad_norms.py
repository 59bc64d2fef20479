"""Derivatives through steps that take a tensor's norm (LAMB, LARS, ``max_unorm``) where that norm is 0: a
zero-initialized bias, a gradient that is all zeros. The step picks another branch there (ratio 1, no
clipping); its derivative must be that branch's, as in the same step written with torch.linalg.vector_norm
(whose derivative at 0 is 0), never NaN. Finite differences cannot check these points: the step is not
continuous across a zero norm (LAMB's ratio jumps from 1 to ~0)."""

from __future__ import annotations

import pytest
import torch
from conftest import triton_mode

import bnbf

F64 = torch.float64
pytestmark = pytest.mark.skipif(triton_mode(), reason="the differentiable step is plain torch: the plain pass runs it")


def _lamb(p, g, lr, b1=0.9, b2=0.999, eps=1e-6, clamp=10.0):  # one step from zero state (torch_optimizer.Lamb)
    u = (1 - b1) * g / (((1 - b2) * g * g).sqrt() + eps)
    wn, un = torch.linalg.vector_norm(p).clamp(0, clamp), torch.linalg.vector_norm(u)
    return p - lr * torch.where((wn > 0) & (un > 0), wn / un, torch.ones_like(wn)) * u


def _lars(p, g, lr, trust=1e-3, eps=1e-8):  # one step, no momentum (You et al., 2017)
    pn, gn = torch.linalg.vector_norm(p), torch.linalg.vector_norm(g)
    return p - lr * torch.where((pn > 0) & (gn > 0), trust * pn / (gn + eps), torch.ones_like(pn)) * g


def _sgd_clipped(p, g, lr, max_unorm):
    pn, un = torch.linalg.vector_norm(p), torch.linalg.vector_norm(g)
    limit = max_unorm * pn
    return p - lr * torch.where(un > limit, limit / un.clamp_min(1e-30), torch.ones_like(un)) * g


CASES = {
    "lamb": ({"lr": 0.1}, {}, lambda p, g: _lamb(p, g, 0.1)),
    "lars": ({"lr": 0.1}, {}, lambda p, g: _lars(p, g, 0.1)),
    "sgd": ({"lr": 0.1}, {"max_unorm": 0.1}, lambda p, g: _sgd_clipped(p, g, 0.1, 0.1)),
}


@pytest.mark.parametrize("zero", ["param", "grad"])
@pytest.mark.parametrize("rule", list(CASES))
def test_a_zero_norm_has_the_other_branchs_derivative(rule, zero):
    if (rule, zero) == ("lamb", "grad"):
        pytest.skip("Adam's direction m / (sqrt(v) + eps) has no derivative at g = 0 (torch's Adam gives NaN too)")
    hp, kw, ref = CASES[rule]
    gen = torch.Generator().manual_seed(0)
    p0, g0 = torch.randn(5, generator=gen, dtype=F64), torch.randn(5, generator=gen, dtype=F64)
    (p0 if zero == "param" else g0).zero_()
    weights = torch.arange(1.0, 6.0, dtype=F64)
    state = bnbf.init_state(torch.zeros(5), bnbf.OptimSpec(rule=rule, state_bits=32), hp)
    state = type(state)._make(f.double() for f in state)
    got, want = [], []
    for fn, out in ((lambda p, g: bnbf.update(p, g, state, hp, 1, differentiable=True, **kw)[0], got), (ref, want)):
        p, g = p0.clone().requires_grad_(), g0.clone().requires_grad_()
        y = fn(p, g)
        out += [y.detach(), *torch.autograd.grad((y * weights).sum(), (p, g))]
    for name, a, b in zip(("step", "d/dparam", "d/dgrad"), got, want):
        assert torch.isfinite(a).all(), f"{name}: {a.tolist()}"
        torch.testing.assert_close(a, b, rtol=1e-12, atol=0, msg=f"{name}: {a.tolist()} vs {b.tolist()}")

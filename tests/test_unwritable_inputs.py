"""Tensors whose memory is not what the kernels may read or write are refused before anything is written, on the
reference path and on the kernels' (this file runs in both CPU passes and on CUDA):

- a lazily negated view (the negative bit, ``x.conj().imag``): its memory holds the negated values (the kernels
  stepped the param the wrong way);
- an efficient zero tensor: it has no memory (the kernels crashed the process reading address 0);
- inference tensors stepped in place outside inference mode (torch refuses such writes; the kernels wrote them,
  the reference path wrote part of the step before torch's error);
- a param whose strides make its elements share memory (one location would keep one of two steps);
- and ``update_(..., differentiable=True)`` refuses the aliasing ``update_`` refuses (a param listed twice lost
  one of its two steps there).
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICES, assert_untouched, snapshot

import bnbf

HP = {"lr": 0.1, "weight_decay": 0.0}


def _state(p: torch.Tensor, bits: int, rule: str = "adamw"):
    return bnbf.init_state(p, bnbf.OptimSpec(rule=rule, state_bits=bits, min_8bit_size=0))


def _negated(n: int, device: str) -> torch.Tensor:
    """A contiguous float32 tensor of -1, -2, ..., -n whose memory holds 1, 2, ..., n (its negative bit set, as
    ``x.conj().imag`` of a complex ``x`` has it)."""
    t = torch._neg_view(torch.arange(1, n + 1, dtype=torch.float32, device=device))
    assert t.is_neg() and t.is_contiguous() and t[0].item() == -1.0
    return t


def _calls(p, g, s):
    """update, update_ (twice: the second call takes the cached plan where there is one) and a plan's step."""
    yield "update", lambda: bnbf.update(p, g, s, HP, 1)
    yield "update_", lambda: bnbf.update_(p, g, s, HP, 1)
    yield "plan", lambda: bnbf.plan(p, s).step(g, HP, 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [8, 32])
def test_a_negated_or_zero_tensor_grad_is_refused(device, bits):
    p = torch.randn(300, device=device)
    s = _state(p, bits)
    good = torch.randn(300, device=device)
    bnbf.update_(p, good, s, HP, 1)  # a cached plan for these params: its grad checks must refuse them too
    for g, match in (
        (_negated(300, device), "negative bit set .* grad.resolve_neg"),
        (torch._efficientzerotensor(300, device=device), "efficient zero tensor"),
    ):
        snap = snapshot(p, s)
        for what, call in _calls(p, g, s):
            with pytest.raises(TypeError, match=match):
                call()
            assert_untouched(snap, what)
        # the values it stands for step as any grad: the same step as the resolved tensor's
        want_p, want_s = bnbf.update(p, g.resolve_neg() if g.is_neg() else torch.zeros_like(g), s, HP, 1)
        assert torch.isfinite(want_p).all()


@pytest.mark.parametrize("device", DEVICES)
def test_a_negated_param_is_refused(device):
    p = _negated(300, device)
    s = _state(p.resolve_neg(), 32)
    g = torch.ones(300, device=device)
    snap = snapshot(p.resolve_neg(), s)
    for what, call in _calls(p, g, s):
        with pytest.raises((TypeError, ValueError), match="negative bit set"):
            call()
        assert_untouched(snap, what)
    assert torch.equal(p, -torch.arange(1, 301, dtype=torch.float32, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [8, 32])
@pytest.mark.parametrize("made", ["param", "state"])
def test_inference_tensors_are_not_stepped_in_place_outside_inference_mode(device, bits, made):
    with torch.inference_mode():
        inf_p = torch.randn(300, device=device)
        inf_s = _state(inf_p, bits)
    p = inf_p if made == "param" else inf_p.clone()
    s = inf_s if made == "state" else type(inf_s)(*[t.clone() for t in inf_s])
    g = torch.randn(300, device=device)
    snap = snapshot(p, s)
    for what, call in list(_calls(p, g, s))[1:]:
        with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
            call()
        assert_untouched(snap, what)
    new_p, _ = bnbf.update(p, g, s, HP, 1)  # the pure step writes new tensors: allowed, as torch allows reads
    with torch.inference_mode():  # inside inference mode the in-place step is torch's to allow
        bnbf.update_(p, g, s, HP, 1)
    assert torch.equal(p, new_p)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [8, 32])
def test_a_param_whose_rows_overlap_is_not_stepped_in_place(device, bits):
    base = torch.zeros(20, device=device)
    p = base.as_strided((5, 4), (2, 1))  # row i and row i + 1 share two elements
    s = _state(p.contiguous(), bits)
    g = torch.randn(5, 4, device=device)
    snap = snapshot(base, s)
    with pytest.raises(ValueError, match=r"strides \(2, 1\) .* may share memory"):
        bnbf.update_(p, g, s, HP, 1)
    assert_untouched(snap, "update_")
    bnbf.update(p, g, s, HP, 1)  # the pure step reads it: fine
    ok = torch.zeros(8, 6, device=device)[::2, ::3]  # strided without overlap: stepped in place
    bnbf.update_(ok, torch.ones_like(ok), _state(ok.contiguous(), bits), HP, 1)
    assert (ok != 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_differentiable_in_place_step_refuses_what_update__refuses(device):
    p = torch.randn(6, device=device, dtype=torch.float64)
    s = bnbf.init_state(p.float(), bnbf.OptimSpec(rule="sgd", state_bits=32))
    s = type(s)(*[t.double() for t in s])
    g = torch.ones(6, device=device, dtype=torch.float64)
    cases = [
        ({"a": p, "b": p}, "the same tensor"),
        ({"a": p[:4], "b": p[2:]}, "overlap in memory"),
    ]
    for params, match in cases:
        states = {k: type(s)(*[t[: v.numel()].clone() for t in s]) for k, v in params.items()}
        grads = {k: g[: v.numel()] for k, v in params.items()}
        before = p.clone()
        with pytest.raises(ValueError, match=match):
            bnbf.update_(params, grads, states, {"lr": 0.1, "momentum": 0.9}, 1, differentiable=True)
        assert torch.equal(p, before)


@pytest.mark.parametrize("device", DEVICES)
def test_a_vmapped_negated_grad_is_refused(device):
    """Under vmap the checks see torch.func's wrappers, which carry the members' negative bit."""
    p = torch.randn(4, 300, device=device)
    s = torch.vmap(lambda q: _state(q, 32))(p)
    g = _negated(1200, device).view(4, 300)
    with pytest.raises(TypeError, match="grad has its negative bit set"):
        torch.vmap(lambda q, r, u: bnbf.update(q, r, u, HP, 1))(p, g, s)

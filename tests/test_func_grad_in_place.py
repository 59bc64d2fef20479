"""``update_`` (and a plan's step) asked for a derivative it cannot give, on both paths: the fused launch the GPU
takes (the interpreter pass) stepped forward-mode duals and states with history silently, dropping the tangents
or giving wrong derivatives, where the reference path raised. Each case raises the error naming
``differentiable=True`` with nothing written, also after earlier plain steps of the same tensors (a cached plan)."""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from conftest import DEVICES, assert_untouched, snapshot

import bnbf

SPEC = bnbf.OptimSpec(rule="adamw", state_bits=32)
HP = {"lr": 0.1, "weight_decay": 0.5}


def _setup(device: str, warm: bool):
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(300, generator=gen).to(device), "b": torch.randn(7, generator=gen).to(device)}
    grads = {k: torch.randn(v.shape, generator=gen).to(device) for k, v in params.items()}
    state = bnbf.init_state(params, SPEC)
    if warm:  # a plan for these very tensors is cached now
        bnbf.update_(params, grads, state, HP, 1)
    return params, grads, state


def _refused(call, *trees):
    before = snapshot(*trees)
    with pytest.raises(RuntimeError, match="differentiable=True"):
        call()
    assert_untouched(before)


@pytest.mark.parametrize("warm", [False, True], ids=["first", "after-steps"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("how", ["update_", "plan"])
def test_dual_param_or_grad_is_refused(device, how, warm):
    params, grads, state = _setup(device, warm)
    for dual in ("param", "grad"):
        with fwAD.dual_level():
            p = dict(params)
            g = dict(grads)
            if dual == "param":
                p["b"] = fwAD.make_dual(params["b"], torch.ones_like(params["b"]))
            else:
                g["b"] = fwAD.make_dual(grads["b"], torch.ones_like(grads["b"]))
            if how == "update_":
                _refused(lambda p=p, g=g: bnbf.update_(p, g, state, HP, 2), params, grads, state)
            else:
                plan = bnbf.plan(p, state)
                _refused(lambda plan=plan, g=g: plan.step(g, HP, 2), params, grads, state)


@pytest.mark.parametrize("device", DEVICES)
def test_a_state_with_history_is_refused_in_place(device):
    params, grads, state = _setup(device, warm=True)
    leaf = torch.zeros(300, device=device, requires_grad=True)
    tracked = {"w": type(state["w"])(leaf * 1.0, state["w"].exp_avg_sq), "b": state["b"]}
    _refused(lambda: bnbf.update_(params, grads, tracked, HP, 2), params, grads, tracked)


@pytest.mark.parametrize("rule", ["sgd", "adamw"])
def test_differentiable_update__of_a_dual_param_carries_its_tangent(rule):
    """fwAD.make_dual's result is a view of a primal without a tangent: written through that base, the param's
    values stepped but its tangent stayed the input's. Its tangent after the step is the pure step's."""
    gen = torch.Generator().manual_seed(1)
    p0 = torch.randn(257, generator=gen, dtype=torch.float64)
    g0 = torch.randn(257, generator=gen, dtype=torch.float64)
    tangent = torch.randn(257, generator=gen, dtype=torch.float64)
    hp = {"lr": 0.1, "momentum": 0.9} if rule == "sgd" else {"lr": 0.1}
    spec = bnbf.OptimSpec(rule=rule, state_bits=32)
    out = []
    for pure in (True, False):
        state = bnbf.init_state(p0, spec, hp)
        with fwAD.dual_level():
            p = fwAD.make_dual(p0.clone(), tangent)
            for step in (1, 2):
                g = g0 + p  # a grad that depends on the param: the tangent moves with the step
                if pure:
                    p, state = bnbf.update(p, g, state, hp, step, differentiable=True)
                else:
                    bnbf.update_(p, g, state, hp, step, differentiable=True)
            out.append(tuple(t.clone() for t in fwAD.unpack_dual(p)))
    assert out[0][1] is not None
    for a, b in zip(out[0], out[1]):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.mark.parametrize("where", ["param", "state"])
def test_differentiable_update__refuses_a_leaf_before_writing_any(where):
    """autograd refuses to write a leaf that requires grad in place: the leaves before it were written first."""
    gen = torch.Generator().manual_seed(2)
    params = {k: torch.randn(257, generator=gen, requires_grad=True).clone() for k in "ab"}
    grads = {k: torch.randn(257, generator=gen) for k in "ab"}
    state = bnbf.init_state({k: v.detach() for k, v in params.items()}, SPEC)
    if where == "param":
        params["b"] = torch.nn.Parameter(params["b"].detach())
    else:  # a learned initial state
        state["b"] = type(state["b"])._make(t.clone().requires_grad_() for t in state["b"])
    before = snapshot(params, state)
    with pytest.raises(RuntimeError, match=rf"{where}\['b'\].* is a leaf that requires grad"):
        bnbf.update_(params, grads, state, HP, 1, differentiable=True)
    assert_untouched(before)

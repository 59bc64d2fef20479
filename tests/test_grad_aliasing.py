"""Grads that share memory with what an in-place step writes, on both paths (the fused launch is the GPU's): a
grad in another leaf's param or in a state field is refused before anything is written; a grad that is its own
param, or one grad for two params, steps as the pure step does."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICES, assert_untouched, snapshot
from torch.utils._pytree import tree_leaves

import bnbf


def _aliased_grads(kind: str, params: dict, state: dict) -> dict:
    grads = {k: torch.full_like(v, 0.5) for k, v in params.items()}
    if kind == "other-param":
        grads["b"] = params["a"][:300]  # the same address as param a, as a tied buffer's view would be
    elif kind == "part-of-other-param":  # a view reaching into another leaf's memory
        grads["b"] = params["a"][3 : 3 + params["b"].numel()]
    elif kind == "state":
        grads["b"] = state["b"].exp_avg_sq
    return grads


@pytest.mark.parametrize("warm", [False, True], ids=["first", "after-steps"])
@pytest.mark.parametrize("kind", ["other-param", "part-of-other-param", "state"])
@pytest.mark.parametrize("how", ["update_", "plan"])
@pytest.mark.parametrize("device", DEVICES)
def test_an_in_place_step_refuses_a_grad_it_would_write(device, how, kind, warm):
    """A grad sharing memory with another leaf's param or a state field: the fused step would read it while
    writing it (the result depends on the kernels' order), so ``update_`` refuses it with nothing written, also
    once a plan for these tensors exists (grads moved into a written tensor after plain steps)."""
    gen = torch.Generator().manual_seed(0)
    params = {"a": torch.randn(600, generator=gen).to(device), "b": torch.randn(300, generator=gen).to(device)}
    state = bnbf.init_state(params, bnbf.OptimSpec(rule="adamw", state_bits=32))
    plan = bnbf.plan(params, state) if how == "plan" else None
    step = (
        (lambda g, t: plan.step(g, {"lr": 0.1}, t))
        if plan
        else (lambda g, t: bnbf.update_(params, g, state, {"lr": 0.1}, t))
    )
    if warm:
        step({k: torch.randn_like(v) for k, v in params.items()}, 1)
    grads = _aliased_grads(kind, params, state)
    before = snapshot(params, state)
    with pytest.raises(ValueError, match=r"grad\['b'\] shares memory with (param\['a'\]|state\['b'\]\.exp_avg_sq)"):
        step(grads, 2)
    assert_untouched(before)


@pytest.mark.parametrize("device", DEVICES)
def test_a_grad_that_is_its_own_param_or_shared_between_params_steps(device):
    """What stays allowed: a grad that is its own param (read before the write, element by element) and one grad
    tensor for two params (only read): the same as the pure step on copies."""
    gen = torch.Generator().manual_seed(0)
    params = {"a": torch.randn(300, generator=gen).to(device), "b": torch.randn(300, generator=gen).to(device)}
    state = bnbf.init_state(params, bnbf.OptimSpec(rule="adamw", state_bits=32))
    shared = torch.randn(300, generator=gen).to(device)
    for grads in ({"a": params["a"], "b": shared}, {"a": shared, "b": shared}):
        want = bnbf.update(params, {k: v.clone() for k, v in grads.items()}, state, {"lr": 0.1}, 1)
        bnbf.update_(params, grads, state, {"lr": 0.1}, 1)
        for got, exp in zip(tree_leaves((params, state)), tree_leaves(want)):
            assert torch.equal(got, exp)

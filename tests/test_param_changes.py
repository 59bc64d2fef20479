"""A model changed under an existing optimizer: a param of a later param group given other memory between steps
(``.data =`` a tensor of another shape, another dtype, an expanded tensor) is refused before any group steps, on
the cached fast step and on the general one (step hooks, params without grad), on the reference path as on the
Triton path; nothing moves. torch.optim.AdamW raises for these too, after stepping the groups before it."""

from __future__ import annotations

import copy

import pytest
import torch
from tolerances import STATE32

import bnbf_nn

TOL = STATE32[(torch.float32, 32)]


def _other_shape(p):
    p.data = torch.randn(50, 8)


def _float64(p):
    p.data = p.data.double()


def _expanded(p):
    p.data = torch.randn(1, 8).expand(40, 8)


CHANGES = [
    (_other_shape, ValueError, r"exp_avg does not fit the param: expected \S+ \(50, 8\)"),
    (_float64, TypeError, r"dtype torch.float64: float64 params are not supported"),
    (_expanded, ValueError, r"has a zero stride \(an expanded tensor\)"),
]


def _refused_with_nothing_moved(opt, params, exc, match, later=True):
    """``opt.step()`` raises ``exc`` (naming param group 1 where ``later``), with no param and no state changed."""
    before = [p.detach().clone() for p in params]
    saved = copy.deepcopy(opt.state_dict()["state"])
    with pytest.raises(exc, match=match) as info:
        opt.step()
    assert not later or "param group 1" in str(info.value) + "".join(getattr(info.value, "__notes__", []))
    assert all(p.dtype == b.dtype and torch.equal(p.detach(), b) for p, b in zip(params, before))
    now = opt.state_dict()["state"]
    for a, b in zip(torch.utils._pytree.tree_leaves(now), torch.utils._pytree.tree_leaves(saved)):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.mark.parametrize("at", [2, 0], ids=["later group", "first group"])  # the first's own step checks it
@pytest.mark.parametrize("bits", [8, 32])
@pytest.mark.parametrize("route", ["fast", "step hook", "a param without grad"])
@pytest.mark.parametrize("change, exc, match", CHANGES, ids=[c[0].__name__.strip("_") for c in CHANGES])
def test_a_param_of_a_later_group_changed_between_steps_is_refused_before_any_group_steps(
    bits, route, change, exc, match, at
):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(40, 8, generator=gen)) for _ in range(4)]
    opt = bnbf_nn.AdamW8bit([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2, optim_bits=bits, min_8bit_size=0)
    if route == "step hook":  # torch's hook wrapper: the general step every time
        opt.register_step_pre_hook(lambda *_: None)

    def grads():
        for p in params:
            p.grad = torch.randn(p.shape, dtype=p.dtype, generator=gen)
        if route == "a param without grad":  # each group steps the params that have one
            params[1].grad = None

    for _ in range(3):  # the third step takes the cached plans (and the fast step where it applies)
        grads()
        opt.step()
    change(params[at])
    grads()
    _refused_with_nothing_moved(opt, params, exc, match, later=at > 1)


@pytest.mark.parametrize("bits", [8, 32])
@pytest.mark.parametrize("change, exc, match", CHANGES, ids=[c[0].__name__.strip("_") for c in CHANGES])
def test_a_changed_param_is_refused_before_any_group_steps_when_its_group_first_lacks_a_grad(bits, change, exc, match):
    """The step where a later group first has a param without grad makes that group's subsets of params with
    grads only when it steps it: a changed param among them is refused before the first group steps, as above."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(40, 8, generator=gen)) for _ in range(4)]
    opt = bnbf_nn.AdamW8bit([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2, optim_bits=bits, min_8bit_size=0)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    change(params[2])
    for p in params:
        p.grad = torch.randn(p.shape, dtype=p.dtype, generator=gen)
    params[3].grad = None  # a pattern of grads group 1 has not stepped before
    _refused_with_nothing_moved(opt, params, exc, match)


@pytest.mark.parametrize("bits", [8, 32])
def test_a_changed_param_without_grad_is_skipped_as_torch_skips_it(bits):
    """A param given another shape that has no grad is not stepped, so not refused: the others step as torch's."""
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(40, 8, generator=gen) for _ in range(3)]
    grads = [[torch.randn(40, 8, generator=gen) for _ in range(3)] for _ in range(4)]
    out = []
    hp = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    ours = bnbf_nn.AdamW32bit if bits == 32 else lambda ps, **kw: bnbf_nn.AdamW8bit(ps, min_8bit_size=0, **kw)
    for make in (torch.optim.AdamW, ours):
        params = [torch.nn.Parameter(t.clone()) for t in init]
        opt = make([{"params": params[:1]}, {"params": params[1:]}], **hp)
        for i, gs in enumerate(grads):
            if i == 3:  # after the cached steps
                params[1].data = torch.zeros(50, 8)
            for p, g in zip(params, gs):
                p.grad = None if p.shape != g.shape else g.clone()
            opt.step()
        out.append(params)
    (want, got) = out
    assert torch.equal(got[1], torch.zeros(50, 8))
    if bits == 32:
        for a, b, t in zip(got, want, init):
            if a.shape == t.shape:
                torch.testing.assert_close(a - t, b - t, atol=TOL.atol, rtol=TOL.rtol)
    else:  # the 8-bit state rounds: the same params move
        assert [torch.equal(a, t) for a, t in zip(got, init)] == [torch.equal(b, t) for b, t in zip(want, init)]


def test_a_param_made_non_contiguous_between_steps_steps_as_torch_steps_it():
    """A param of a later group given a non-contiguous tensor of its shape (``.data = w.t()``) is planned again
    for the generic path and stepped, as torch steps it. On the Triton path the fast step read the grads through
    the direct plan's tables after that plan had been made generic (no launch groups left): an IndexError after
    the first group had stepped."""
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(16, 16, generator=gen) for _ in range(2)]
    grads = [[torch.randn(16, 16, generator=gen) for _ in range(2)] for _ in range(5)]
    out = []
    hp = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    for make in (torch.optim.AdamW, bnbf_nn.AdamW32bit):
        params = [torch.nn.Parameter(t.clone()) for t in init]
        opt = make([{"params": params[:1]}, {"params": params[1:]}], **hp)
        for i, gs in enumerate(grads):
            if i == 3:  # after the cached steps
                params[1].data = params[1].data.t()
            for p, g in zip(params, gs):
                p.grad = g.clone()
            opt.step()
        out.append(params)
    (want, got) = out
    assert not got[1].is_contiguous()
    for a, b, t in zip(got, want, init):
        torch.testing.assert_close(a - t, b - t, atol=TOL.atol, rtol=TOL.rtol)

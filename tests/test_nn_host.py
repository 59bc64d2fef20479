"""bnbf_nn's per-step host work: a bucket's validated settings are reused while its group holds the very
objects they were made from, and every change a step can see (a new lr from a schedule, a flag switched, a
tensor setting changed in place) is checked and takes effect as on a step without that reuse."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_untouched, snapshot

import bnbf
import bnbf_nn
import bnbf_nn.optim as optim

# argument handling, not kernel numerics: the interpreter pass skips them (conftest)
pytestmark = pytest.mark.surface


def _model(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((300,), (16, 40), (7,))]


def _grads(params, step: int):
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def test_settings_are_validated_once_while_the_group_is_unchanged(monkeypatch):
    params = _model()
    opt = bnbf_nn.AdamW8bit(params, lr=1e-2, min_8bit_size=256)
    calls = []
    real = optim.check_update_options
    monkeypatch.setattr(optim, "check_update_options", lambda *a: calls.append(a) or real(*a))
    for step in range(1, 5):
        if step == 3:  # the states and buckets are made in the first step
            calls.clear()
        _grads(params, step)
        opt.step()
    assert calls == []  # steps 3 and 4 reused step 2's settings
    opt.param_groups[0]["lr"] = 5e-3  # a schedule's new value: a new object, the only one
    _grads(params, 5)
    opt.step()
    assert calls == []  # only the lr was checked (test_a_bad_value_set_between_steps...: a bad one is refused)
    opt.param_groups[0]["max_unorm"] = 0.5
    _grads(params, 6)
    opt.step()
    assert len(calls) == 1


@pytest.mark.parametrize(
    "change",
    [
        ("lr", 3e-2),
        ("betas", (0.5, 0.9)),
        ("weight_decay", 0.5),
        ("maximize", True),
        ("max_unorm", 0.05),
        ("eps", 1e-3),
    ],
    ids=lambda c: c[0],
)
def test_a_setting_changed_between_steps_takes_effect(change):
    """bnbf_nn's steps equal bnbf.update_'s with the settings of each step (32-bit state: bit for bit)."""
    name, value = change
    params = _model()
    ref = [p.detach().clone() for p in params]
    state = bnbf.init_state(ref, bnbf.OptimSpec(rule="adamw", state_bits=32))
    opt = bnbf_nn.AdamW32bit(params, lr=1e-2, weight_decay=0.01)
    hp = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    kw = {"maximize": False, "max_unorm": 0.0}
    for step in range(1, 5):
        if step == 3:
            opt.param_groups[0][name] = value
            (kw if name in kw else hp)[name] = value
        _grads(params, step)
        opt.step()
        bnbf.update_(ref, [p.grad for p in params], state, hp, step, **kw)
        for p, r in zip(params, ref):
            assert torch.equal(p.detach(), r), (name, step)


def test_a_bad_value_set_between_steps_is_refused_before_anything_is_written():
    params = _model()
    opt = bnbf_nn.AdamW8bit(params, lr=1e-2, min_8bit_size=256)
    _grads(params, 1)
    opt.step()
    for name, value, match in [("lr", -1.0, "Invalid learning rate: -1.0"), ("betas", (1.0, 0.9), "beta")]:
        good = opt.param_groups[0][name]
        opt.param_groups[0][name] = value
        snap = snapshot(params, [opt.state[p] for p in params])
        with pytest.raises(ValueError, match=match):
            opt.step()
        assert_untouched(snap)
        opt.param_groups[0][name] = good
    opt.step()


def test_a_tensor_setting_changed_in_place_is_checked_every_step():
    """A CPU tensor lr may change in place (the same object): it is validated every step, never reused."""
    params = _model()
    lr = torch.tensor(1e-2)
    opt = bnbf_nn.AdamW8bit(params, lr=lr, min_8bit_size=256)
    _grads(params, 1)
    opt.step()
    lr.fill_(-1.0)
    snap = snapshot(params)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        opt.step()
    assert_untouched(snap)
    lr.fill_(0.0)  # lr 0: AdamW moves nothing
    opt.step()
    assert_untouched(snap)


def test_a_new_lr_with_another_setting_changed_checks_everything():
    """A schedule's new lr in the step where another setting also changed (capturable switched on): the whole
    check, not only the lr's."""
    params = _model()
    opt = bnbf_nn.AdamW8bit(params, lr=1e-2, min_8bit_size=256)
    for step in (1, 2):
        _grads(params, step)
        opt.step()
    opt.param_groups[0]["lr"] = 5e-3
    opt.param_groups[0]["capturable"] = True
    opt.step()
    assert all(isinstance(opt.state[p]["step"], torch.Tensor) for p in params)  # the capturable step ran
    opt.param_groups[0]["lr"] = 4e-3
    opt.param_groups[0]["betas"] = (0.9, 2.0)
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1"):
        opt.step()

"""bnbf_nn's per-step host work: a bucket's validated settings are reused while its group holds the very
objects they were made from, and every change a step can see (a new lr from a schedule, a flag switched, a
tensor setting changed in place) is checked and takes effect as on a step without that reuse."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_untouched, snapshot, triton_mode

import bnbf
import bnbf_nn
import bnbf_nn.optim as optim

# argument handling, not kernel numerics: the interpreter pass skips the tests marked surface (conftest); the
# fast path's parity with the general path runs in both passes (the interpreter's plans take the direct path)
surface = pytest.mark.surface


def _model(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((300,), (16, 40), (7,))]


def _grads(params, step: int):
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


@surface
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


@surface
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


@surface
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


@surface
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


@surface
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


# ---- the fast path of the usual step (Optimizer8bit._fast_step) ---------------------------------------------

ODD = ((1,), (255,), (257,), (4097,), (16, 40))  # 8-bit from 256 elements: 1 keeps 32-bit state


def _counting(monkeypatch):
    """Counts of the steps that took the general path and of those the fast path took, over every optimizer."""
    seen = {"general": 0, "fast": 0}
    general, fast = optim.Optimizer8bit._step, optim.Optimizer8bit._fast_step

    def count_general(self, *a, **k):
        seen["general"] += 1
        return general(self, *a, **k)

    def count_fast(self):
        took = fast(self)
        seen["fast"] += took
        return took

    monkeypatch.setattr(optim.Optimizer8bit, "_step", count_general)
    monkeypatch.setattr(optim.Optimizer8bit, "_fast_step", count_fast)
    return seen


@surface
def test_the_usual_step_takes_the_fast_path_and_anything_else_the_general_one(monkeypatch):
    seen = _counting(monkeypatch)
    params = _model()
    opt = bnbf_nn.AdamW8bit(params, lr=1e-2, min_8bit_size=256)
    for step in (1, 2, 3, 4):
        _grads(params, step)
        opt.step()
    # the first step makes the states, the second the plans: then every step is the usual one
    assert seen == {"general": 2, "fast": 2}
    opt.param_groups[0]["lr"] = 5e-3  # a schedule: still the fast path
    opt.step()
    assert seen == {"general": 2, "fast": 3}
    hooked = []
    for change in (
        lambda: setattr(params[1], "grad", None),  # a param without a grad
        lambda: opt.param_groups[0].update(betas=(0.8, 0.99)),  # a setting other than the lr
        lambda: bnbf_nn.GlobalOptimManager.get_instance().override_config(params[0], "lr", 1e-3),
        lambda: opt.register_step_pre_hook(lambda *a: hooked.append(1)),  # torch's wrapper runs the step
    ):
        _grads(params, 9)
        change()
        before = dict(seen)
        opt.step()
        assert seen["fast"] == before["fast"], change
        assert seen["general"] == before["general"] + (not opt._optimizer_step_pre_hooks), change
    assert hooked == [1]
    opt._optimizer_step_pre_hooks.clear()
    bnbf_nn.GlobalOptimManager.get_instance().initialize()
    loss = opt.step(lambda: torch.tensor(2.0))  # a closure: the general path, which returns its loss
    assert float(loss) == 2.0 and seen["fast"] == 3


def _same_states(a, b) -> None:
    assert len(a) == len(b)  # params are keyed by identity: compared in order
    for p, q in zip(a, b):
        assert a[p].keys() == b[q].keys()
        for key, x in a[p].items():
            y = b[q][key]
            if key in ("step", optim._checkpoint.BITS_KEY):
                assert type(x) is type(y) is int and x == y
            elif isinstance(x, torch.Tensor):
                assert x.dtype == y.dtype and torch.equal(x, y), key
            elif isinstance(x, dict):  # the views again, nested as in a saved entry
                assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), key
            else:  # the state NamedTuple
                assert type(x) is type(y) and all(map(torch.equal, x, y)), key


def _same_state_dicts(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"] and a.keys() == b.keys() and a["state"].keys() == b["state"].keys()
    for k, x in a["state"].items():
        y = b["state"][k]
        assert torch.equal(x["step"], y["step"])
        qa, qb = x[optim._checkpoint.QUANT_KEY], y[optim._checkpoint.QUANT_KEY]
        assert qa.keys() == qb.keys()
        for name in qa:
            assert type(qa[name]) is type(qb[name])
            assert torch.equal(qa[name], qb[name]) if isinstance(qa[name], torch.Tensor) else qa[name] == qb[name]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_fast_path_steps_exactly_as_the_general_path(monkeypatch, dtype):
    """Two optimizers over equal params and grads, one with the fast path switched off: bit-equal params and
    states, and identical state dicts, through two groups, a schedule's new lr every step, a param that loses
    its grad (and gets it back), a group added mid-run and a frozen param. (The interpreter pass, where plans
    take the direct path and the grads are read by ``own_grads_at``, runs bf16 only: the plumbing is the same.)"""
    if dtype == torch.float32 and triton_mode():
        pytest.skip("the interpreter pass runs the bf16 case")
    seen = _counting(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    made = [torch.randn(s, generator=gen).to(dtype) for s in ODD + ((300,), (9,))]
    runs = []
    for fast in (True, False):
        ps = [torch.nn.Parameter(t.clone()) for t in made]
        opt = bnbf_nn.AdamW8bit(
            [{"params": ps[:3]}, {"params": ps[3:5], "weight_decay": 0.1, "lr": 3e-3}], lr=1e-2, min_8bit_size=256
        )
        if not fast:
            opt._fast_jobs = lambda jobs: None  # this one never finds the usual case: every step is general
        runs.append((ps, opt))
    for step in range(1, 10):
        gen = torch.Generator().manual_seed(100 + step)
        grads = [torch.randn(t.shape, generator=gen).to(dtype) for t in made]
        fast_before = seen["fast"]
        for ps, opt in runs:
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            if step == 4:
                opt.add_param_group({"params": ps[5:], "lr": 2e-3})
            if step == 7:
                ps[1].grad = None  # not stepped this step; back (one step behind the others) from step 8
            if step == 9:
                ps[6].grad = None  # a frozen param
            for k, group in enumerate(opt.param_groups):  # a schedule: a new lr every step
                group["lr"] = 1e-2 / (k + 1) / step
            opt.step()
        # every group in the usual case (steps 1 and 4 make states, 2 and 5 plans; from 7 params are out of step)
        assert seen["fast"] == fast_before + (step in (3, 6)), step
        (ps_a, a), (ps_b, b) = runs
        for p, q in zip(ps_a, ps_b):
            assert torch.equal(p.detach(), q.detach()), step
        _same_states(a.state, b.state)
        _same_state_dicts(a.state_dict(), b.state_dict())
    assert seen["general"] == 9 + 7  # the second optimizer stepped every step generally


@surface
def test_the_fast_path_checks_every_group_before_any_steps():
    """A bad lr (set as a schedule would, a new number) in the second group: refused before the first group
    steps, by the fast path's check of the new lr."""
    params = _model()
    opt = bnbf_nn.AdamW8bit([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2, min_8bit_size=256)
    for step in (1, 2):
        _grads(params, step)
        opt.step()
    assert opt._fast is not None
    opt.param_groups[1]["lr"] = float("nan")
    snap = snapshot(params, [opt.state[p] for p in params])
    with pytest.raises(ValueError, match="Invalid learning rate: nan"):
        opt.step()
    assert_untouched(snap)
    assert all(opt.state[p]["step"] == 2 for p in params)
    opt.param_groups[1]["lr"] = 1e-3
    opt.step()
    assert all(opt.state[p]["step"] == 3 for p in params)


@surface
@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_the_fast_path_runs_without_the_extension(monkeypatch, native):
    """The fast path's grads and step counts in both twins: the extension's grads_of and set_each, and plain
    Python where it was not built."""
    if native and optim.NATIVE is None:
        pytest.skip("the C++ host checks were not built (pip install --no-build-isolation builds them)")
    if not native:
        monkeypatch.setattr(optim, "NATIVE", None)
    seen = _counting(monkeypatch)
    params = _model()
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, ref_opt = (bnbf_nn.AdamW32bit(ps, lr=1e-2) for ps in (params, ref))
    ref_opt._fast_jobs = lambda jobs: None
    for step in range(1, 5):
        _grads(params, step)
        _grads(ref, step)
        opt.step()
        ref_opt.step()
    assert seen["fast"] == 2
    assert all(torch.equal(p.detach(), r.detach()) for p, r in zip(params, ref))
    assert [opt.state[p]["step"] for p in params] == [4, 4, 4]
    params[0].grad = None  # the fast path's grads tell it: the general path steps the other two
    opt.step()
    assert [opt.state[p]["step"] for p in params] == [4, 5, 5] and seen["fast"] == 2


@surface
def test_the_python_grads_of_finds_a_missing_grad_by_identity(monkeypatch):
    """Without the extension, whether every param has a grad is asked by identity: ``None in grads`` called each
    tensor's ``__eq__`` (1.9 ms of GPT-2's 2.5 ms eager step host time on the CPU)."""
    monkeypatch.setattr(optim, "NATIVE", None)
    params = _model()
    _grads(params, 1)

    def no_eq(self, other):
        raise AssertionError("a tensor was compared with ==")

    monkeypatch.setattr(torch.Tensor, "__eq__", no_eq)
    grads, every = optim._grads_of(params)
    assert every and all(g is p.grad for g, p in zip(grads, params))
    params[1].grad = None
    grads, every = optim._grads_of(params)
    assert not every and grads[1] is None and grads[0] is params[0].grad


@surface
@pytest.mark.parametrize("family", ["AdamW", "Lion", "SGD", "LAMB"])
def test_a_schedule_steps_as_the_functional_step_with_each_lr(family):
    """A new lr every step (a schedule), taken as the last step's validated settings with the lr replaced:
    bit for bit bnbf.update_ given the group's settings as a mapping every step (32-bit state), on the fast
    path and the general one; a bad new lr is refused with torch's message, nothing written."""
    params = _model()
    ref = [p.detach().clone() for p in params]
    opt = getattr(bnbf_nn, family + "32bit")(params, lr=1e-2)
    keys = opt._hkeys
    state = bnbf.init_state(ref, bnbf.OptimSpec(rule=opt._rule.name, state_bits=32), {k: opt.defaults[k] for k in keys})
    for step in range(1, 7):
        group = opt.param_groups[0]
        group["lr"] = 1e-2 * 0.7**step if step != 4 else 3  # an int: kept as the int it is
        _grads(params, step)
        opt.step()
        bnbf.update_(ref, [p.grad for p in params], state, {k: group[k] for k in keys}, step)
        for p, r in zip(params, ref):
            assert torch.equal(p.detach(), r), step
    assert opt._fast is not None
    opt.param_groups[0]["lr"] = -0.5
    snap = snapshot(params, [opt.state[p] for p in params])
    with pytest.raises(ValueError, match="Invalid learning rate: -0.5"):
        opt.step()
    assert_untouched(snap)

"""Settings switched after the states exist, params bnbf cannot step, load_state_dict's pre-hooks: as torch.optim.

A schedule (CyclicLR/OneCycleLR with ``cycle_momentum=True, base_momentum=0.0``) or a hand sets SGD's, RMSprop's or
LARS's momentum to 0, or Adam's amsgrad off, after the first step: torch.optim keeps training, with plain steps,
and leaves the unused momentum buffer (amsgrad's maximum) untouched; switched back on, the kept buffer steps again.
SGD switching momentum on creates its buffer at that step (torch: the step's direction itself). RMSprop's momentum
and Adam's amsgrad switched on fail in torch (KeyError); bnbf_nn adds the slot at its initial value, and the torch
reference here is given the same zero slot at the switch. Each switch runs against torch.optim on the same grads:
32-bit classes within ``STATE32`` (torch's CPU ``add_(x, alpha=-lr)`` rounds as an FMA: a plain step already differs
by an ulp here and there), the untouched buffer bit for bit; 8-bit classes re-synced to torch every step, within
``STATE8``, the untouched codes bit for bit.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from resync import assert_within_code_gap
from tolerances import STATE8, STATE32, assert_close_report, assert_equal_report, count_outside

import bnbf
import bnbf_nn

SHAPES = [(64, 80), (80,), (10, 64)]
STEPS = 6
T32 = STATE32[(torch.float32, 32)]
T8 = STATE8[(torch.float32, 8)]


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _grads(t: int, params: list) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + t)
    return [torch.randn(p.shape, generator=g) * 0.01 for p in params]


def _set_grads(params: list, t: int) -> None:
    for p, g in zip(params, _grads(t, params)):
        p.grad = g


def _step_each(pairs, steps) -> None:
    """For each step number, every (params, optimizer) pair gets step ``t``'s grads and steps."""
    for t in steps:
        for ps, opt in pairs:
            _set_grads(ps, t)
            opt.step()


def _zero_slot(name: str):
    """What torch lacks after a switch it cannot make (KeyError): the slot at its initial value, zeros."""

    def fill(opt):
        for p in opt.param_groups[0]["params"]:
            opt.state[p][name] = torch.zeros_like(p)

    return fill


# id, torch class, our family, constructor kwargs, {step: group edits}, {step: names the new settings leave
# unused, until the next switch}, what torch needs at a switch it cannot make
CASES = [
    ("sgd-off-on", torch.optim.SGD, "SGD", dict(lr=1e-2, momentum=0.9, weight_decay=0.01),
     {2: {"momentum": 0.0}, 4: {"momentum": 0.9}}, {2: ["momentum_buffer"]}, None),
    ("sgd-on", torch.optim.SGD, "SGD", dict(lr=1e-2), {2: {"momentum": 0.9}}, {}, None),
    ("sgd-nesterov-off-on", torch.optim.SGD, "SGD", dict(lr=1e-2, momentum=0.9, nesterov=True),
     {2: {"momentum": 0.0}, 4: {"momentum": 0.9}}, {2: ["momentum_buffer"]}, None),
    ("rmsprop-off-on", torch.optim.RMSprop, "RMSprop", dict(lr=1e-2, momentum=0.9, alpha=0.9),
     {2: {"momentum": 0.0}, 4: {"momentum": 0.9}}, {2: ["momentum_buffer"]}, None),
    ("rmsprop-on", torch.optim.RMSprop, "RMSprop", dict(lr=1e-2, alpha=0.9), {2: {"momentum": 0.9}}, {},
     _zero_slot("momentum_buffer")),
    ("adam-amsgrad-off-on", torch.optim.Adam, "Adam", dict(lr=1e-2, betas=(0.9, 0.9), amsgrad=True),
     {2: {"amsgrad": False}, 4: {"amsgrad": True}}, {2: ["max_exp_avg_sq"]}, None),
    ("adamw-amsgrad-off", torch.optim.AdamW, "AdamW", dict(lr=1e-2, betas=(0.9, 0.9), amsgrad=True),
     {2: {"amsgrad": False}}, {2: ["max_exp_avg_sq"]}, None),
    ("adam-amsgrad-on", torch.optim.Adam, "Adam", dict(lr=1e-2, betas=(0.9, 0.9)), {2: {"amsgrad": True}}, {},
     _zero_slot("max_exp_avg_sq")),
]  # fmt: skip


def _field(opt, p, name: str) -> torch.Tensor:
    s = opt.state[p]["state"]
    return getattr(s, name) if name in s._fields else None


def _resync(ref, ours, pt, po, frozen) -> None:
    """torch's params and states set to ours (dequantized), but for the unused buffers: the next step compares one
    step from equal inputs."""
    with torch.no_grad():
        for i, (q, p) in enumerate(zip(pt, po)):
            q.copy_(p)
            for key, v in bnbf.dequantize_state(ours.state[p]["state"]).items():
                if key in ref.state[q] and (i, key) not in frozen:
                    ref.state[q][key].copy_(v)


def _run_switches(case, bits: int) -> tuple:
    _, tcls, family, kw, edits, unused, fill = case
    pt, po = _params(), _params()
    ref = tcls(pt, **kw)
    ours = getattr(bnbf_nn, f"{family}{bits}bit")(po, **kw, **({"min_8bit_size": 0} if bits == 8 else {}))
    frozen: dict = {}  # (param index, name) -> our field and torch's as the switch left them
    for t in range(STEPS):
        for key, value in edits.get(t, {}).items():
            ref.param_groups[0][key] = value
            ours.param_groups[0][key] = value
        if t in edits:
            frozen = {
                (i, name): (_field(ours, p, name).clone(), ref.state[q][name].clone())
                for name in unused.get(t, [])
                for i, (p, q) in enumerate(zip(po, pt))
            }
            if fill is not None:
                fill(ref)
        if bits == 8 and t > 0:
            _resync(ref, ours, pt, po, frozen)
        before = [p.detach().clone() for p in po]
        for q, p, g in zip(pt, po, _grads(t, po)):
            q.grad, p.grad = g.clone(), g.clone()
        ref.step()
        ours.step()
        for i, (p, q, p0) in enumerate(zip(po, pt, before)):
            what = f"{case[0]} {bits}-bit step {t} param {i}"
            if bits == 32:
                assert_close_report(p.detach() - p0, q.detach() - p0, T32.atol, T32.rtol, f"{what}: change")
            elif p.numel() >= 4096:  # bitsandbytes' mean bars, where a mean says something
                err = (p.detach() - q.detach()).abs()
                assert err.mean() < T8.mean_abs, f"{what}: mean |p - p_torch| {err.mean():.3g}"
                assert (err / (q.detach().abs() + 1e-9)).mean() < T8.mean_rel, f"{what}: mean relative error"
            moments = bnbf.dequantize_state(ours.state[p]["state"])
            for key, v in ref.state[q].items():
                if key == "step" or (i, key) in frozen:
                    continue
                if bits == 32:
                    assert_close_report(moments[key], v, T32.atol, T32.rtol, f"{what}: state {key}")
                else:  # each value within one code gap of torch's; bitsandbytes' bar but for RMSprop's momentum
                    assert_within_code_gap(ours.state[p]["state"], key, v, f"{what}: state {key}")
                    n = count_outside(moments[key], v, T8.atol, T8.rtol)
                    exempt = family == "RMSprop" and key == "momentum_buffer"  # g/avg: of order 1 (optim_table's row)
                    assert exempt or n < T8.max_outside, f"{what}: state {key} has {n} elements outside STATE8"
        for (i, name), (mine, theirs) in frozen.items():  # the unused buffer, untouched (codes and scales too)
            assert_equal_report(_field(ours, po[i], name), mine, f"{case[0]} step {t}: our unused {name} of param {i}")
            assert_equal_report(ref.state[pt[i]][name], theirs, f"torch's unused {name}")
        if t + 1 in edits:
            frozen = {}
    return ours, po


@pytest.mark.parametrize("bits", [32, 8])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_switches_after_the_first_step_train_as_torch(case, bits):
    ours, params = _run_switches(case, bits)
    # the state keeps each slot it ever had (torch keeps its buffer too), under bitsandbytes' names, and
    # state_dict writes it and loads it back into a twin that continues bit for bit
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    kw = {**case[3], **({"min_8bit_size": 0} if bits == 8 else {})}
    other = getattr(bnbf_nn, f"{case[2]}{bits}bit")(twin, **kw)
    buf = io.BytesIO()
    torch.save(ours.state_dict(), buf)
    buf.seek(0)
    other.load_state_dict(torch.load(buf, weights_only=False))
    for key in case[4].get(2, {}):  # the switched settings, as the saved group holds them
        assert other.param_groups[0][key] == ours.param_groups[0][key]
    _step_each(((params, ours), (twin, other)), range(STEPS, STEPS + 2))
    for i, (p, q) in enumerate(zip(params, twin)):
        assert_equal_report(q.detach(), p.detach(), f"param {i} after loading")
        a, b = ours.state[p]["state"], other.state[q]["state"]
        assert type(a) is type(b)
        for name, x, y in zip(a._fields, a, b):
            assert_equal_report(y, x, f"param {i} state {name} after loading")


@pytest.mark.parametrize("bits", [32, 8])
def test_a_switched_off_slot_steps_as_a_state_made_without_it(bits):
    """After momentum 0.9 -> 0 the step is the plain step of an optimizer made with momentum 0, bit for bit."""
    kw = dict(lr=1e-2, weight_decay=0.01, **({"min_8bit_size": 0} if bits == 8 else {}))
    params = _params()
    opt = getattr(bnbf_nn, f"SGD{bits}bit")(params, momentum=0.9, **kw)
    _step_each(((params, opt),), range(2))
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    plain = getattr(bnbf_nn, f"SGD{bits}bit")(twin, momentum=0.0, **kw)
    opt.param_groups[0]["momentum"] = 0.0
    _step_each(((params, opt), (twin, plain)), range(2, 4))
    for i, (p, q) in enumerate(zip(params, twin)):
        assert_equal_report(p.detach(), q.detach(), f"param {i}")


def _snapshot(opt, params) -> list:
    return [
        (
            p.detach().clone(),
            copy.deepcopy(dict(opt.state[p])) if p in opt.state else None,
            sorted(opt.state.get(p, {})),
        )
        for p in params
    ]


def _assert_unchanged(opt, params, snap) -> None:
    for i, (p, (p0, rec, keys)) in enumerate(zip(params, snap)):
        assert_equal_report(p.detach(), p0, f"param {i}")
        now = sorted(opt.state.get(p, {}))
        assert now == keys, f"param {i}: record keys {now}, were {keys}"
        if rec is not None:
            assert opt.state[p]["step"] == rec["step"]
            for name, a, b in zip(rec["state"]._fields, rec["state"], opt.state[p]["state"]):
                assert_equal_report(b, a, f"param {i} state {name}")


@pytest.mark.parametrize(
    ("family", "kw", "edit", "match"),
    [
        ("SGD", dict(lr=1e-2, dampening=0.1), {"momentum": 0.9},
         r"SGD32bit: param group 0's momentum changed from 0 to 0\.9 .*dampening=0\.1"),
        ("LARS", dict(lr=1e-2, dampening=0.1), {"momentum": 0.9},
         r"LARS32bit: param group 0's momentum changed from 0 to 0\.9 .*dampening=0\.1"),
        ("RMSprop", dict(lr=1e-2, centered=True), {"centered": False},
         r"RMSprop32bit: param group 0's centered changed from True to False"),
    ],
)  # fmt: skip
def test_switches_bnbf_would_step_otherwise_than_torch_raise_changing_nothing(family, kw, edit, match):
    """SGD's (LARS') momentum switched on with dampening: torch starts the buffer as the direction d, a zero buffer
    would give (1 - dampening)·d; RMSprop's centered switched off: bnbf's square_avg holds the centered variance.
    A clear error naming the group key and its values, and nothing changed."""
    params = _params()
    opt = getattr(bnbf_nn, f"{family}32bit")(params, **kw)
    _step_each(((params, opt),), [0])
    opt.param_groups[0].update(edit)
    _set_grads(params, 1)
    snap = _snapshot(opt, params)
    with pytest.raises(ValueError, match=match):
        opt.step()
    _assert_unchanged(opt, params, snap)


def test_a_slot_switched_on_is_added_only_once_every_group_is_checked():
    """amsgrad switched on in group 0 and a bad lr in group 1: the step raises and group 0's states gain no
    max_exp_avg_sq (state3); with the lr fixed, it is added and the step goes on."""
    params = _params()
    opt = bnbf_nn.Adam8bit([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2, min_8bit_size=0)
    _step_each(((params, opt),), [0])
    opt.param_groups[0]["amsgrad"] = True
    opt.param_groups[1]["lr"] = -1.0
    _set_grads(params, 1)
    snap = _snapshot(opt, params)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        opt.step()
    _assert_unchanged(opt, params, snap)
    opt.param_groups[1]["lr"] = 1e-2
    opt.step()
    assert "state3" in opt.state[params[0]] and "state3" not in opt.state[params[2]]
    assert opt.state[params[0]]["state3"].data_ptr() == opt.state[params[0]]["state"].max_exp_avg_sq.data_ptr()


def test_nesterov_with_momentum_set_to_zero_later_steps_plainly():
    """torch checks nesterov only in its constructor: momentum set to 0 later (or a group added with nesterov and
    momentum 0) steps plainly; the constructor keeps torch's check and words."""
    with pytest.raises(ValueError, match="Nesterov momentum requires a momentum and zero dampening"):
        bnbf_nn.SGD32bit(_params(), lr=1e-2, nesterov=True)
    pt, po = _params(), _params()
    ref = torch.optim.SGD(pt[:2], lr=1e-2, momentum=0.9, nesterov=True)
    ours = bnbf_nn.SGD32bit(po[:2], lr=1e-2, momentum=0.9, nesterov=True)
    for opt, ps in ((ref, pt), (ours, po)):
        opt.add_param_group({"params": ps[2:], "momentum": 0.0})  # nesterov=True from the defaults
    for t in range(4):
        if t == 2:
            ref.param_groups[0]["momentum"] = ours.param_groups[0]["momentum"] = 0.0
        for q, p, g in zip(pt, po, _grads(t, po)):
            q.grad, p.grad = g.clone(), g.clone()
        ref.step()
        ours.step()
    for i, (p, q, p0) in enumerate(zip(po, pt, _params())):
        assert_close_report(p.detach() - p0, q.detach() - p0, T32.atol, T32.rtol, f"param {i}")


def _one_cycle_run(make, steps: int = 10) -> tuple:
    params = _params()
    opt = make(params)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=1e-2, total_steps=steps, pct_start=0.3, cycle_momentum=True, base_momentum=0.0
    )
    seen = []
    p0 = [p.detach().clone() for p in params]
    for t in range(steps):
        _set_grads(params, t)
        seen.append(opt.param_groups[0]["momentum"])
        opt.step()
        sched.step()
    return [p.detach() - q for p, q in zip(params, p0)], seen


@pytest.mark.parametrize("family", ["SGD", "RMSprop", "LARS"])
def test_one_cycle_lr_with_base_momentum_zero(family):
    """OneCycleLR(cycle_momentum=True, base_momentum=0.0) sets momentum to exactly 0 at the lr's peak (step 2 of 10
    with pct_start=0.3), then back up: the 8-bit
    class trains through it, within 5% (test_torch_contract's 8-bit bound) of torch's change (SGD, RMSprop) or
    of its 32-bit class's (LARS, which torch.optim lacks); the 32-bit class within STATE32 of torch's."""
    kw = dict(lr=1e-2, momentum=0.9) if family != "LARS" else dict(lr=1e-2, momentum=0.9, trust_coefficient=0.02)
    ours8, seen = _one_cycle_run(lambda ps: getattr(bnbf_nn, f"{family}8bit")(ps, **kw, min_8bit_size=0))
    assert 0.0 in seen
    ours32, _ = _one_cycle_run(lambda ps: getattr(bnbf_nn, f"{family}32bit")(ps, **kw))
    if family == "LARS":
        ref = ours32
    else:
        ref, _ = _one_cycle_run(lambda ps: getattr(torch.optim, family)(ps, **kw))
        for i, (a, b) in enumerate(zip(ours32, ref)):
            assert_close_report(a, b, T32.atol, T32.rtol, f"{family}32bit param {i}")
    for i, (a, b) in enumerate(zip(ours8, ref)):
        err = ((a - b).norm() / b.norm()).item()
        assert err <= 0.05, f"{family}8bit param {i}: change {err:.2%} away from the reference's"


# ---- params bnbf cannot step ------------------------------------------------------------------------------


def _override_bits(bits):
    return lambda opt, p: opt.mng.override_config(p, key_value_dict={"optim_bits": bits, "min_8bit_size": 0})


@pytest.mark.parametrize(
    "make, edit, made, wanted",
    [
        (lambda ps: bnbf_nn.AdamW8bit(ps, min_8bit_size=0), _override_bits(32), torch.uint8, torch.float32),
        (lambda ps: bnbf_nn.AdamW(ps), _override_bits(8), torch.float32, torch.uint8),
        (
            lambda ps: bnbf_nn.AdamW8bit(ps, min_8bit_size=0),
            lambda opt, p: opt.param_groups[0].update(optim_bits=32),
            torch.uint8,
            torch.float32,
        ),
        (
            lambda ps: bnbf_nn.AdamW8bit(ps, min_8bit_size=0),
            lambda opt, p: opt.param_groups[0].update(min_8bit_size=10**9),
            torch.uint8,
            torch.float32,
        ),
    ],
    ids=["override-32", "override-8", "group-optim_bits", "group-min_8bit_size"],
)
def test_a_made_state_keeps_its_bits_until_it_is_deleted(make, edit, made, wanted):
    """``optim_bits`` or ``min_8bit_size`` changed after a param's state was made (a manager override, the group's
    settings): get_config reports the new settings, but the state keeps the bits it was made with (as a loaded state
    does), stepping bit for bit as an optimizer that never had the change. ``del opt.state[p]`` restarts it at the new
    bits: its next step makes that state at step 1, as an optimizer made with get_config's settings does."""
    ps, twin = _params(), _params()
    opt, ref = make(ps), make(twin)
    _step_each([(ps, opt), (twin, ref)], range(2))
    edit(opt, ps[0])
    c = opt.get_config(0, 0, opt.param_groups[0])
    assert (c["optim_bits"] == 8 and ps[0].numel() >= c["min_8bit_size"]) == (wanted == torch.uint8)
    _step_each([(ps, opt), (twin, ref)], range(2, 4))
    assert opt.state[ps[0]]["state1"].dtype == made
    for p, q in zip(ps, twin):
        assert_equal_report(p.detach(), q.detach(), "a state kept at its bits")
    restarted = [torch.nn.Parameter(ps[0].detach().clone())]
    kw = {k: c[k] for k in ("lr", "betas", "eps", "weight_decay", "optim_bits", "min_8bit_size")}
    fresh = bnbf_nn.AdamW(restarted, **kw)
    del opt.state[ps[0]]
    _set_grads(ps, 4)
    restarted[0].grad = ps[0].grad.clone()
    opt.step()
    fresh.step()
    assert opt.state[ps[0]]["state1"].dtype == wanted and opt.state[ps[0]]["step"] == 1
    assert_equal_report(ps[0].detach(), restarted[0].detach(), "a state restarted at the new bits")


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64, torch.int64], ids=str)
def test_params_bnbf_cannot_step_are_refused_when_added(dtype):
    w = torch.nn.Parameter(torch.randn(8, 8))
    bad = torch.zeros(3, dtype=dtype)
    with pytest.raises(TypeError, match=rf"can only optimize .*but param 1 of param group 1 is a {dtype} Tensor"):
        bnbf_nn.AdamW8bit([{"params": [w]}, {"params": [torch.zeros(2), bad]}], lr=1e-2)
    opt = bnbf_nn.AdamW8bit([w], lr=1e-2)
    with pytest.raises(TypeError, match=rf"param 0 of param group 1 is a {dtype} Tensor"):
        opt.add_param_group({"params": [bad]})
    assert len(opt.param_groups) == 1
    # float64 with differentiable=True (float64 state) is accepted, as before
    bnbf_nn.AdamW32bit([torch.zeros(3, dtype=torch.float64, requires_grad=True)], differentiable=True)


def test_a_param_whose_dtype_changed_before_its_first_state_is_refused_before_any_group_steps():
    params = _params()
    opt = bnbf_nn.AdamW8bit([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2)
    params[2].data = params[2].data.double()  # a dtype changed through .data, before its first step
    for p, g in zip(params, _grads(0, params)):
        p.grad = g.to(p.dtype)
    snap = _snapshot(opt, params)
    with pytest.raises(TypeError, match=r"param 0 of param group 1 is a torch.float64 Tensor"):
        opt.step()
    _assert_unchanged(opt, params, snap)
    assert not opt.state


# ---- load_state_dict's pre-hooks --------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [torch.optim.AdamW, bnbf_nn.AdamW8bit], ids=lambda c: c.__name__)
def test_load_pre_hooks_edit_a_shallow_copy(cls):
    """torch.optim's load_state_dict hands its pre-hooks a shallow copy: one that edits the dict in place leaves the
    caller's as it was (a retry, a second replica loading the same dict)."""
    p = torch.nn.Parameter(torch.randn(64, 64))
    opt = cls([p], lr=1e-3)
    p.grad = torch.randn(64, 64)
    opt.step()
    sd = opt.state_dict()
    sd["my_meta"] = {"epoch": 3}
    opt.register_load_state_dict_pre_hook(lambda o, d: d.pop("my_meta", None) and None)
    opt.load_state_dict(sd)
    assert "my_meta" in sd
    opt.load_state_dict(sd)

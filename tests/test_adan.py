"""Adan (bnbf/rules/adan.py) against a plain-torch float64 reference (``optim_table.AdanReference``) written
from the paper and the authors' implementation (sail-sg/Adan), not from bnbf:

- 32-bit state: fp32, fp16 and bf16 params of 1, 255, 257 and 4097 elements in one call, weight decay off,
  proximal (the default) and ``no_prox=True``; param changes and every state within ``tolerances.STATE32``;
- 8-bit state re-synced every step (``tests/resync.py``, bitsandbytes' bar ``tolerances.STATE8`` and each
  stored state within one code gap of the reference's new value), both formats;
- the first step's ``neg_pre_grad`` (no previous gradient: the difference is 0);
- ``bnbf_nn.Adan``/``Adan32bit``/``Adan8bit`` against the reference, with the authors' argument names;
- bad hyperparameters rejected with the authors' (torch's) wording, nothing written;
- the zero point for Adan's 8-bit state: tests/test_zero_point.py's property, which covers every rule.

``ROWS`` are Adan's rows as tests/optim_table.py writes them (the proximal decay, and ``no_prox``), for
the table-driven tests (they are in ``optim_table.ROWS``). In the Triton interpreter
(``TRITON_INTERPRET=1``) the same tests run fewer steps and dtypes.
"""

from __future__ import annotations

import inspect
import math
import re

import pytest
import torch
from conftest import DEVICES, assert_untouched, init_params, make_grad, snapshot
from optim_table import ADAN_ROWS, ADAN_STATES, AdanReference, Bad, Row  # noqa: F401
from resync import Ref, _check_param, _check_states, assert_within_code_gap, run_resync
from tolerances import DTYPES, NOT_VACUOUS, STATE8, STATE32, STATE_ULPS, assert_close_report, half_ulp

import bnbf
import bnbf_nn
from bnbf._dispatch import interpreting

INTERP = interpreting()
F32 = torch.float32
STATES = ADAN_STATES


ROWS = ADAN_ROWS
ROW = {r.id: r for r in ROWS}
NAMES = {name: name for name in STATES}
NAN, INF = math.nan, math.inf


def dname(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_param(p, ref_p, p_start, p0, dtype, what: str) -> None:
    """fp32 params by their change since the start; 16-bit params (the reference re-synced to ours every
    step) by value, never more than one ulp of the dtype from the reference's float result."""
    t = STATE32[(dtype, 32)]
    if dtype == F32:
        assert_close_report(p.float() - p0, ref_p - p0, t.atol, t.rtol, f"{what}: param change")
        return
    assert_close_report(p.float(), ref_p, t.atol, t.rtol, f"{what}: param ({dname(dtype)})")
    off = (p.float() - ref_p).abs() > 2 * half_ulp(torch.maximum(ref_p.abs(), p_start.abs()), dtype)
    assert not bool(off.any()), f"{what}: {int(off.sum())} params more than one {dname(dtype)} ulp off"


def check_states(moments: dict, ref_state: dict, dtype, what: str) -> None:
    """32-bit states: the dtype's atol/rtol, atol at least STATE_ULPS float32 ulps of the state's largest value."""
    t = STATE32[(dtype, 32)]
    assert set(moments) == set(STATES), sorted(moments)
    for name in STATES:
        scale = ref_state[name].abs().max().item()
        atol = max(t.atol, STATE_ULPS * torch.finfo(F32).eps * scale)
        assert_close_report(moments[name], ref_state[name], atol, t.rtol, f"{what} {name}")


# ------------------------------------------------------------------------------------------------
# 32-bit state

# (row, weight decay)
DECAYS = [("adan", 0.0), ("adan", 0.02), ("adan-no_prox", 0.02)]


def _parity32():
    out = []
    for dtype in DTYPES:
        for rid, wd in DECAYS:
            steps = 20
            if INTERP:  # interpreter budget: 16-bit params with the proximal decay only, fewer steps
                if dtype != F32 and (rid, wd) != ("adan", 0.02):
                    continue
                steps = 3 if dtype == F32 else 2
            out.append(pytest.param(dtype, rid, wd, steps, id=f"{dname(dtype)}-{rid}-wd{wd}"))
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("dtype", "rid", "wd", "steps"), _parity32())
def test_32bit_matches_reference(device, dtype, rid, wd, steps):
    """Tensors of 1, 255, 257 and 4097 elements in one call (one launch)."""
    shapes = {"a": (1,), "b": (255,), "c": (257,), "d": (4097,)}
    row = ROW[rid]
    hp = {**row.hparams, "weight_decay": wd}
    params = {k: init_params(s, dtype, device) for k, s in shapes.items()}
    p0 = {k: v.float().clone() for k, v in params.items()}
    ref = Ref(row, params, hp)
    state = bnbf.init_state(params, bnbf.OptimSpec(rule="adan", state_bits=32, min_8bit_size=0), hp)
    for step in range(1, steps + 1):
        grads = {k: make_grad(s, dtype, device) for k, s in shapes.items()}
        ref.step(grads)
        starts = {k: v.float() for k, v in params.items()}
        params, state = bnbf.update(params, grads, state, hp, step)
        moments = bnbf.dequantize_state(state)
        for k in shapes:
            assert params[k].dtype == dtype and params[k].shape == shapes[k]
            check_states(moments[k], ref.state(k), dtype, f"step {step} {k}")
            check_param(params[k], ref.p(k), starts[k], p0[k], dtype, f"step {step} {k}")
        if dtype != F32:
            ref.sync(params)


@pytest.mark.parametrize("device", DEVICES)
def test_no_prox_and_weight_decay_matter(device):
    """The decay rows are not vacuous: the proximal and the plain decay differ from each other and from no
    decay by over NOT_VACUOUS times the parity test's tolerance, in 5 steps with lr·wd = 0.01."""
    p = init_params((257,), F32, device)
    grads = [make_grad((257,), F32, device) for _ in range(5)]
    t = STATE32[(F32, 32)]

    def change(**hp):
        q, s = p, bnbf.init_state(p, bnbf.OptimSpec(rule="adan", state_bits=32), hp)
        for step, g in enumerate(grads, 1):
            q, s = bnbf.update(q, g, s, hp, step)
        return q - p

    none, prox = change(lr=1e-2), change(lr=1e-2, weight_decay=1.0)
    plain = change(lr=1e-2, weight_decay=1.0, no_prox=True)
    for a, b, what in ((none, prox, "decay"), (prox, plain, "no_prox")):
        moved = (a - b).abs().max().item()
        tol = t.atol + t.rtol * a.abs().max().item()
        assert moved > NOT_VACUOUS * tol, f"{what} moves 5 steps' change by {moved:.3g} only"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [8, 32])
def test_first_step_has_no_gradient_difference(device, bits):
    """At step 1 there is no previous gradient: exp_avg_diff stays 0, neg_pre_grad becomes −g and the step is
    lr·g/(|g| + eps) (m/(1 − β1) = g, √(n/(1 − β3)) = |g|); at step 2 the difference is g2 − g1."""
    p = init_params((300,), F32, device)
    g1, g2 = make_grad((300,), F32, device), make_grad((300,), F32, device)
    hp = {"lr": 1e-3}
    spec = bnbf.OptimSpec(rule="adan", state_bits=bits, min_8bit_size=0)
    state = bnbf.init_state(p, spec, hp)
    p1, state = bnbf.update(p, g1, state, hp, 1)
    s1 = bnbf.dequantize_state(state)
    assert bool((s1["exp_avg_diff"] == 0).all()), "exp_avg_diff moved at the first step"
    t = STATE32[(F32, 32)]
    assert_close_report(p1 - p, -1e-3 * g1 / (g1.abs() + 1e-8), t.atol, t.rtol, "first step")
    if bits == 32:
        assert_close_report(s1["neg_pre_grad"], -g1, 0.0, 0.0, "neg_pre_grad after step 1")
    _, state = bnbf.update(p1, g2, state, hp, 2)
    # from the stored −g1 (its 8-bit value when 8-bit): d = (1 − β2)·(g2 − g1)
    want = (1 - 0.92) * (g2 + s1["neg_pre_grad"])
    got = bnbf.dequantize_state(state)["exp_avg_diff"]
    if bits == 32:
        assert_close_report(got, want, t.atol, t.rtol, "exp_avg_diff at step 2")
    else:
        assert_within_code_gap(state, "exp_avg_diff", want, "step 2")


# ------------------------------------------------------------------------------------------------
# 8-bit state, re-synced every step


def _resync():
    """Both formats and both rows with fp32 params; 16-bit params with the power format and the proximal
    decay (each run is 3 tensors x 50 steps: 5-7 s in the plain pass)."""
    out = []
    for dtype in DTYPES:
        for fmt in ("power", "dynamic"):
            for rid in ROW:
                if dtype != F32 and (fmt, rid) != ("power", "adan"):
                    continue
                sizes, steps = (1, 257, 4097), 50
                if INTERP:  # interpreter budget
                    if dtype == torch.float16:
                        continue
                    sizes, steps = (1, 257), 5
                out.append(pytest.param(dtype, fmt, rid, sizes, steps, id=f"{dname(dtype)}-{fmt}-{rid}"))
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("dtype", "fmt", "rid", "sizes", "steps"), _resync())
def test_8bit_resynced_matches_reference(device, dtype, fmt, rid, sizes, steps):
    """1, 257 and 4097 elements in one call, weight decay 0.02, bitsandbytes' 50 steps (20 on CUDA)."""
    run_resync(device, ROW[rid], [((n,), dtype) for n in sizes], fmt, steps if device == "cpu" else 20)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["power", "dynamic"])
def test_8bit_resynced_no_weight_decay(device, fmt):
    if INTERP and fmt != "power":
        pytest.skip("interpreter budget: the power format (both run in plain mode)")
    run_resync(device, ROW["adan"], [((2, 257), F32), ((4097,), F32)], fmt, 3 if INTERP else 50, wd=0.0)


# ------------------------------------------------------------------------------------------------
# bnbf_nn


def test_nn_classes_take_the_authors_arguments():
    """Adan(params, lr=1e-3, betas=(0.98, 0.92, 0.99), eps=1e-8, weight_decay=0.0, max_grad_norm=0.0,
    no_prox=False, foreach, fused) as the authors' class; their global gradient clipping is refused."""
    theirs = {
        "lr": 1e-3,
        "betas": (0.98, 0.92, 0.99),
        "eps": 1e-8,
        "weight_decay": 0.0,
        "max_grad_norm": 0.0,
        "no_prox": False,
    }
    for name in ("Adan", "Adan8bit", "Adan32bit"):
        ours = inspect.signature(getattr(bnbf_nn, name)).parameters
        assert {k: ours[k].default for k in theirs} == theirs, name
        assert {"foreach", "fused"} <= set(ours), name
    p = [torch.nn.Parameter(torch.zeros(3))]
    assert bnbf_nn.Adan(p).param_groups[0]["optim_bits"] == 32
    assert bnbf_nn.Adan8bit(p).param_groups[0]["optim_bits"] == 8
    bnbf_nn.Adan(p, foreach=True, fused=False)
    with pytest.raises(NotImplementedError, match="max_grad_norm"):
        bnbf_nn.Adan(p, max_grad_norm=1.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["Adan", "Adan32bit"])
def test_nn_32bit_classes_match_reference(device, name):
    """Two param groups (the proximal decay, and no_prox) against the reference's same groups."""
    shapes = [(300,), (16, 40), (7,)]
    steps = 3 if INTERP else 10
    params = [torch.nn.Parameter(init_params(s, F32, device)) for s in shapes]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    p0 = [p.detach().clone() for p in params]

    def groups(ps):
        return [{"params": ps[:2], "weight_decay": 0.02}, {"params": ps[2:], "weight_decay": 0.05, "no_prox": True}]

    opt = getattr(bnbf_nn, name)(groups(params), lr=1e-3, min_8bit_size=0)
    ref = AdanReference(groups(twins), lr=1e-3)
    for step in range(1, steps + 1):
        for p, t in zip(params, twins):
            p.grad = make_grad(p.shape, F32, device)
            t.grad = p.grad.clone()
        opt.step()
        ref.step()
        for i, (p, t) in enumerate(zip(params, twins)):
            check_param(p.detach(), t.detach(), None, p0[i], F32, f"{name} step {step} param {i}")
            check_states(bnbf.dequantize_state(opt.state[p]["state"]), ref.state[t], F32, f"step {step} param {i}")


@pytest.mark.parametrize("device", DEVICES)
def test_nn_8bit_class_resynced_matches_reference(device):
    """Adan8bit stepped, then the reference from the same params and dequantized states, every step, held to
    tests/resync.py's checks (bitsandbytes' bar per state, each stored state within one code gap, the
    params within the bar's means)."""
    shapes = {"w": (16, 40), "v": (300,)}
    steps = 3 if INTERP else 20
    bar = STATE8[(F32, 8)]
    params = {k: torch.nn.Parameter(init_params(s, F32, device)) for k, s in shapes.items()}
    hp = {"lr": 1e-3, "weight_decay": 0.02}
    opt = bnbf_nn.Adan8bit(list(params.values()), **hp, min_8bit_size=256)
    ref = Ref(ROW["adan"], {k: p.detach() for k, p in params.items()}, hp)
    for step in range(1, steps + 1):
        grads = {k: make_grad(s, F32, device) for k, s in shapes.items()}
        for k, p in params.items():
            p.grad = grads[k].clone()
        opt.step()
        ref.step(grads)
        moments = {}
        for k, p in params.items():
            state = opt.state[p]["state"]
            assert all(getattr(state, name).dtype == torch.uint8 for name in STATES)
            moments[k] = bnbf.dequantize_state(state)
            what = f"step {step}, {k}"
            _check_states(ROW["adan"], bar, state, moments[k], ref.state(k), what)
            _check_param(ROW["adan"], bar, p.detach().float(), ref.p(k), F32, None, hp["lr"], what)
        ref.sync({k: p.detach() for k, p in params.items()}, moments, NAMES)


# ------------------------------------------------------------------------------------------------
# bad hyperparameters

# beyond the rows': a pair of betas (the authors' class fails to index it)
EXTRA_BAD = (Bad({"betas": (0.9, 0.99)}, "betas must be a triple (beta1, beta2, beta3), got (0.9, 0.99)", "-"),)
ALL_BAD = [b for r in ROWS for b in r.bad] + list(EXTRA_BAD)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", ALL_BAD, ids=[b.message for b in ALL_BAD])
def test_bad_hparams_rejected_with_the_authors_wording(device, bad):
    if INTERP and device == "cpu" and bad is not ALL_BAD[0] and bad is not EXTRA_BAD[0]:
        # the checks are the rule's make_hparams, the same code on every path (as test_rules'
        # test_bad_hparams_refused): two values here, every value in the plain pass
        pytest.skip("interpreter budget: two bad values (every value in plain mode and on CUDA)")
    exact = "^" + re.escape(bad.message)
    if bad.reference == "raises":  # the authors' class checks it, in these words
        with pytest.raises(ValueError, match=exact):
            AdanReference([torch.zeros(2, requires_grad=True)], **bad.hparams)
    elif bad.reference == "accepts":
        AdanReference([torch.zeros(2, requires_grad=True)], **bad.hparams)
    with pytest.raises(ValueError, match=exact):
        bnbf.hparams_for("adan", bad.hparams)
    with pytest.raises(ValueError, match=exact):
        bnbf_nn.Adan([torch.nn.Parameter(torch.zeros(2, device=device))], **bad.hparams)
    params = {"w": init_params((300,), F32, device), "b": init_params((1,), F32, device)}
    grads = {k: make_grad(v.shape, F32, device) for k, v in params.items()}
    for bits in (8, 32):
        state = bnbf.init_state(params, bnbf.OptimSpec(rule="adan", state_bits=bits, min_8bit_size=0))
        bnbf.update_(params, grads, state, {}, 1)  # a valid call first (an in-place plan may be cached)
        snap = snapshot(params, grads, state)
        with pytest.raises(ValueError, match=exact):
            bnbf.update(params, grads, state, bad.hparams, 2)
        with pytest.raises(ValueError, match=exact):
            bnbf.update_(params, grads, state, bad.hparams, 2)
        assert_untouched(snap, f"adan {bits}-bit after a rejected call")


def test_no_prox_must_be_a_bool():
    with pytest.raises(TypeError, match="no_prox must be a bool, got int"):
        bnbf.hparams_for("adan", {"no_prox": 1})

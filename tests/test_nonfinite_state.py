"""A non-finite value reaching an 8-bit state stays in its own element.

A block's codes are fractions of its absmax, so a NaN or an infinity cannot be stored: left in, it made the
block's absmax NaN or inf and its other 255 elements decode as NaN at the next step. Finite gradients can
still produce one: a NaN param element under a rule whose state takes ``weight_decay · p``, or a finite
gradient whose square overflows float32. Such an element steps as a non-finite gradient element does
(tests/test_rules.py): its param kept, its states zeroed; 32-bit states keep the value, as torch.optim's do.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICES, init_params, make_grad
from optim_table import ROWS
from resync import Ref
from tolerances import assert_equal_report
from torch.utils._pytree import tree_leaves

import bnbf
from bnbf._dispatch import interpreting
from bnbf.quant import STATE_FORMATS

INTERP = interpreting()
F32 = torch.float32
N = 600  # three blocks, the last partial
BAD = 5  # the element that goes non-finite, in the first block
ELEMENTWISE = [r for r in ROWS if bnbf.RULES[r.name].norms is None and r.state_names]
# one row per rule (the one keeping the most states) for the interpreter's budget
RICHEST = list({r.name: r for r in sorted(ELEMENTWISE, key=lambda r: len(r.state_names))}.values())


def _rows():
    return RICHEST if INTERP else ELEMENTWISE


def _spec(row, fmt: str, bits: int = 8) -> bnbf.OptimSpec:
    return bnbf.OptimSpec(rule=row.name, state_bits=bits, min_8bit_size=0, state_format=fmt)


def _formats():
    return ["power"] if INTERP else list(STATE_FORMATS)


def _steps(row, spec, p, grads, wd: float = 0.0):
    hp = {**row.hparams, "weight_decay": wd}
    state = bnbf.init_state(p, spec, hp)
    for t, g in enumerate(grads, 1):
        p, state = bnbf.update(p, g, state, hp, t)
    return p, state


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", _formats())
@pytest.mark.parametrize("row", _rows(), ids=lambda r: r.id)
def test_a_nan_param_element_leaves_its_block_alone(device, row, fmt):
    """A NaN param element with a zero gradient, weight decay 0.01: every other element's param, and every state
    leaf (codes and absmax), equal the same steps with that element 0. Adam, SGD, RMSprop and Adagrad take
    weight_decay · p into their states (NaN there), which made the block's absmax NaN on the CPU path."""
    gen = torch.Generator().manual_seed(0)
    grads = [(torch.randn(N, generator=gen) * 0.01).to(device) for _ in range(3)]
    for g in grads:
        g[BAD] = 0.0
    p = init_params((N,), F32, device)
    nan_p, zero_p = p.clone(), p.clone()
    nan_p[BAD], zero_p[BAD] = float("nan"), 0.0
    p_a, s_a = _steps(row, _spec(row, fmt), nan_p, grads, wd=0.01)
    p_b, s_b = _steps(row, _spec(row, fmt), zero_p, grads, wd=0.01)
    others = torch.arange(N, device=device) != BAD
    assert_equal_report(p_a[others], p_b[others], f"{row.id}: the other params")
    for i, (a, b) in enumerate(zip(tree_leaves(s_a), tree_leaves(s_b), strict=True)):
        if isinstance(a, torch.Tensor):  # codes at the other elements, and every block's absmax
            keep = others if a.shape == (N,) else torch.ones_like(a, dtype=torch.bool)
            assert_equal_report(a[keep], b[keep], f"{row.id}: state leaf {i} ({a.dtype}, {tuple(a.shape)})")
    for name, values in bnbf.dequantize_state(s_a).items():  # NaN reached some of them: 0 there, never NaN
        assert float(values[BAD]) in (0.0, float(bnbf.dequantize_state(s_b)[name][BAD])), f"{row.id}: {name}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", _formats())
@pytest.mark.parametrize("row", _rows(), ids=lambda r: r.id)
def test_a_state_overflowing_to_inf_leaves_its_block_alone(device, row, fmt):
    """Two finite gradients of 3e38 at one element overflow a state there (g² for Adam's second moment, the
    sum for SGD's momentum); the next step with ordinary gradients leaves every other param and every state
    finite. Rows whose 32-bit states stay finite under the same gradients (Lion's interpolation) are skipped."""
    grads = [make_grad((N,), F32, device) for _ in range(3)]
    grads[0][BAD] = grads[1][BAD] = 3e38
    p = init_params((N,), F32, device)
    _, wide = _steps(row, _spec(row, fmt, bits=32), p.clone(), grads[:2])
    if all(bool(torch.isfinite(t).all()) for t in tree_leaves(wide) if isinstance(t, torch.Tensor)):
        pytest.skip(f"{row.id}: no state overflows under these gradients")
    p_new, state = _steps(row, _spec(row, fmt), p.clone(), grads)
    others = torch.arange(N, device=device) != BAD
    assert bool(torch.isfinite(p_new[others]).all()), f"{row.id}: the overflow reached other params"
    # the element itself steps as after a non-finite gradient (kept, its states zeroed), never far beyond the
    # 32-bit step (not by its surviving moments over a second moment started again from 0: 3e37 where 32-bit
    # Adam keeps it in place); SGD's first step moves it by lr · 3e38 in both widths
    p_wide, _ = _steps(row, _spec(row, fmt, bits=32), p.clone(), grads)
    moved, bar = (p_new - p).abs()[BAD], (p_wide - p).abs()[BAD] * 2 + 10 * (p_new - p).abs()[others].max()
    assert not bool(moved > bar), f"{row.id}: the element stepped {float(moved):.3e}, over the bar {float(bar):.3e}"
    for leaf in tree_leaves(state):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            assert bool(torch.isfinite(leaf).all()), f"{row.id}: a block's absmax is not finite"
    # (centered RMSprop reports torch's square_avg, variance + grad_avg², which overflows at the element itself)
    for name, values in bnbf.dequantize_state(state).items():
        assert bool(torch.isfinite(values[others]).all()), f"{row.id}: {name} holds non-finite values"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rule", ["adam", "adamw"])
def test_a_nan_32bit_second_moment_steps_as_torch(device, rule):
    """A NaN in a 32-bit second moment (amsgrad off) gives a NaN param element, as torch.optim does; every other
    element steps as torch's. The kernel once read the moment through max(0, v), which turned NaN into 0."""
    gen = torch.Generator().manual_seed(1)
    p = torch.randn(N, generator=gen).to(device)
    g = (torch.randn(N, generator=gen) * 0.01).to(device)
    hp = {"lr": 1e-2, "weight_decay": 0.01}
    state = bnbf.init_state(p, bnbf.OptimSpec(rule=rule, state_bits=32))
    state.exp_avg_sq[BAD] = float("nan")
    ref = p.clone().requires_grad_(True)
    opt = (torch.optim.Adam if rule == "adam" else torch.optim.AdamW)([ref], **hp)
    ref.grad = g.clone()
    opt.step()  # torch's state starts at zero: give it the NaN too, then step again with both
    opt.state[ref]["exp_avg_sq"].copy_(state.exp_avg_sq)
    opt.state[ref]["exp_avg"].zero_()
    ref.data.copy_(p)
    opt.state[ref]["step"].fill_(0)
    opt.step()
    new_p, _ = bnbf.update(p, g, state, hp, 1)
    assert bool(torch.isnan(new_p[BAD])), f"{rule}: the NaN second moment did not reach the param"
    others = torch.arange(N, device=device) != BAD
    torch.testing.assert_close(new_p[others], ref.detach()[others], rtol=1e-6, atol=1e-7)


BADS = {5: float("inf"), 6: float("-inf"), 7: float("nan")}  # in the first block


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [8, 32])
@pytest.mark.parametrize("row", _rows(), ids=lambda r: r.id)
def test_a_non_finite_param_element_at_weight_decay_0_steps_as_torch(device, row, bits):
    """With weight_decay=0, param elements already +inf, -inf and NaN stay so and their states step from the
    gradient alone, as the row's reference does (torch.optim skips a zero weight decay's term): every param and
    state leaf equals the same steps with those elements 0, but the non-finite params themselves. The rules once
    added 0 · p, which is NaN there: the param went NaN (32-bit) or its states were zeroed (8-bit)."""
    gen = torch.Generator().manual_seed(2)
    grads = [(torch.randn(N, generator=gen) * 0.01).to(device) for _ in range(3)]
    p = init_params((N,), F32, device)
    bad_p, zero_p = p.clone(), p.clone()
    for i, v in BADS.items():
        bad_p[i], zero_p[i] = v, 0.0
    spec = _spec(row, "power", bits)
    p_a, s_a = _steps(row, spec, bad_p, grads)
    p_b, s_b = _steps(row, spec, zero_p, grads)
    ref = Ref(row, {"w": bad_p}, {**row.hparams, "weight_decay": 0.0})
    for g in grads:
        ref.step({"w": g})
    idx = torch.tensor(list(BADS), device=device)
    # AdEMAMix's plain-torch reference, written from the paper's code, adds 0 · p (NaN): its params are not compared
    for what, q in (("bnbf", p_a), ("the reference", ref.p("w")))[: 1 if row.name == "ademamix" else 2]:
        assert q[idx].tolist()[:2] == [float("inf"), float("-inf")] and bool(q[7].isnan()), f"{what}: {q[idx]}"
    others = torch.ones(N, dtype=torch.bool, device=device)
    others[idx] = False
    assert_equal_report(p_a[others], p_b[others], f"{row.id}: the other params")
    for i, (a, b) in enumerate(zip(tree_leaves(s_a), tree_leaves(s_b), strict=True)):
        if isinstance(a, torch.Tensor):
            assert_equal_report(a, b, f"{row.id}: state leaf {i} ({a.dtype}, {tuple(a.shape)})")
    ref_zero = Ref(row, {"w": zero_p}, {**row.hparams, "weight_decay": 0.0})
    for g in grads:
        ref_zero.step({"w": g})
    for name, theirs in row.state_names.items():  # the reference's states there step from the gradient alone too
        assert_equal_report(ref.state("w")[theirs][idx], ref_zero.state("w")[theirs][idx], f"reference {name}")

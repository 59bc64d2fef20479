"""The 8-bit re-synced comparison for every row of ``optim_table.ROWS`` (bitsandbytes' test_optimizer8bit,
made stricter), and the reference optimizer wrapper the rule tests share.

Each step: the row's reference (on float32 copies) and ``bnbf.update`` take the same gradients from the same
params and states, for all the call's tensors at once (one multi-tensor call); then the reference is
re-synced to our params and dequantized states. Checked every step, for each tensor:

- each state: bitsandbytes' bar (``tolerances.STATE8``: fewer than ``max_outside`` elements outside
  atol/rtol), except the states a row names ``code_checked_only``; and, stricter, element by element, the
  stored value lies within one code gap of the reference's new value (:func:`assert_within_code_gap`);
- the params: 16-bit params element by element within their rounding plus the bar's ``mean_abs``; and the
  bar's means (``mean_abs``, ``mean_rel``) wherever the tensor is large enough for a mean to say something.

Two kinds of element are ties, where two correct float32 evaluations may take different steps: Lion's sign
input zero up to rounding (:func:`sign_ties`: a step of lr either way), and an L2-decayed gradient g + wd·p
zero up to rounding (:func:`l2_ties`: the reference's outcome, or the one from that gradient evaluated
unfused, exactly 0 at an exact tie).
"""

from __future__ import annotations

import copy
import functools

import torch
from conftest import init_params, make_grad
from optim_table import UnormClipped
from tolerances import (
    CODE_GAP_SLACK_REL,
    CODE_GAP_SLACK_ULPS,
    L2_TIE_ULPS,
    L2_TIES_MAX,
    L2_TIES_MAX_FRACTION,
    MEAN_MIN_NUMEL,
    ON_CODE_REL,
    SIGN_TIE_ULPS,
    STATE8,
    assert_close_report,
    count_outside,
    half_ulp,
)

import bnbf
from bnbf.quant import POWER_FLOOR, state_map

F32 = torch.float32
# bnbf rules whose weight decay is L2, added to the gradient (as torch's Adam, SGD, RMSprop and Adagrad do);
# AdamW's, Lion's, AdEMAMix's and Adan's are decoupled, and LAMB's and LARS's enter through a trust ratio
L2_RULES = ("adam", "sgd", "rmsprop", "adagrad")


class Ref:
    """The reference optimizer on float32 copies of a dict of params."""

    def __init__(self, row, params: dict, hp: dict, max_unorm: float = 0.0):
        self.t = {k: v.detach().float().clone().requires_grad_(True) for k, v in params.items()}
        opt = row.torch_opt(list(self.t.values()), **hp)
        self.opt = UnormClipped(opt, max_unorm) if max_unorm else opt

    def step(self, grads: dict) -> None:
        for k, g in grads.items():
            self.t[k].grad = g.detach().float().clone()
        self.opt.step()

    def p(self, k) -> torch.Tensor:
        return self.t[k].detach()

    def state(self, k) -> dict:
        return self.opt.state[self.t[k]]

    def sync(self, params: dict, moments: dict | None = None, names: dict | None = None) -> None:
        """Our params (and dequantized states) into the reference."""
        with torch.no_grad():
            for k, v in params.items():
                self.t[k].copy_(v.float())
                if moments is not None:
                    for ours, theirs in names.items():
                        self.state(k)[theirs].copy_(moments[k][ours])


def stored_reference(row, name: str, ref_state: dict, theirs: str) -> torch.Tensor:
    """The reference's value of what bnbf's slot ``name`` stores: its state ``theirs``, or what the row's
    ``stored`` derives from the reference's states (centered RMSprop keeps the variance in square_avg)."""
    derive = row.stored.get(name)
    return ref_state[theirs] if derive is None else derive(ref_state)


@functools.cache
def _double_map(fmt: str, signed: bool, device: torch.device) -> torch.Tensor:
    return state_map(fmt, signed, device).double()


def assert_within_code_gap(state, name: str, expected: torch.Tensor, what: str) -> None:
    """The stored value of slot ``name`` (its code times its block's absmax) lies within one code gap of
    ``expected`` (the reference's new value computed from the same synced inputs):
    |ours - ref| <= (c_hi - c_lo) * absmax, where c_lo <= ref/absmax <= c_hi are neighbouring values of the
    format's map (the step rounds stochastically between them), or up to the floor code of a non-negative
    state (bnbf.quant's zero point), plus float32 slack for two evaluations of the same formula. Computed on
    the state's device (4M elements x 50 steps in float64 took minutes on a CPU)."""
    layout = type(state).layout
    signed = next(sl for sl in bnbf.RULES[layout.rule].states if sl.name == name).signed
    codes = getattr(state, name)
    dev = codes.device
    c = _double_map(layout.format, signed, dev)
    n = codes.numel()
    am = getattr(state, name + "_absmax").double().repeat_interleave(layout.block_size)[:n]
    ours = c[codes.reshape(-1).long()] * am
    ref = expected.detach().double().to(dev).reshape(-1)
    x = torch.where(am > 0, ref / am, torch.zeros_like(am))
    xn = x.clamp(float(c[0]), float(c[-1]))
    hi = torch.searchsorted(c, xn).clamp(1, 255)
    gap = c[hi] - c[hi - 1]
    slack = CODE_GAP_SLACK_REL * ref.abs() + CODE_GAP_SLACK_ULPS * torch.finfo(F32).eps * am
    if bool(((ours - ref).abs() <= gap * am + slack).all()):
        return  # within the plain gap: the allowances below only widen it (most calls stop here)
    if not signed:  # a nonzero value is stored at least at the floor code
        floor = c[POWER_FLOOR if layout.format == "power" else 1]
        gap = torch.where(ref != 0, torch.maximum(gap, floor), gap)
    # a value on a code (a state the step left as it was: amsgrad's maximum, mostly), or within the float32 slack
    # of one (a momentum whose terms of order absmax cancel near a code: the kernel's and the reference's sums then
    # fall on either side of it), reaches the rounding at its code position plus float32 error, so the dither can
    # take it to either neighbour of that code: the larger side gap
    near = torch.where((xn - c[hi - 1]).abs() <= (c[hi] - xn).abs(), hi - 1, hi)
    to_code = (xn - c[near]).abs()
    on_code = (to_code <= ON_CODE_REL * c[near].abs()) | (to_code * am <= slack)
    sides = torch.maximum(c[(near + 1).clamp(max=255)] - c[near], c[near] - c[(near - 1).clamp(min=0)])
    gap = torch.where(on_code, torch.maximum(gap, sides), gap)
    # beyond the map's ends (the signed dynamic map stops at -0.99297; float32 rounding puts the block's largest
    # value a hair above its absmax), the end code's gap plus the excess: the GPU's approximate roots put the
    # largest value's code position a hair below the top code, from where the dither can round it down one
    gap = torch.where(x != xn, (x - xn).abs() + gap, gap)
    bad = (ours - ref).abs() > gap * am + slack
    if bool(bad.any()):
        i = int(((ours - ref).abs() - gap * am - slack).argmax())
        raise AssertionError(
            f"{what} {name}: {int(bad.sum())} of {n} elements more than a code gap from the reference; worst "
            f"at flat {i}: ours {ours[i].item():.9g} reference {ref[i].item():.9g} absmax {am[i].item():.6g} "
            f"allowed {(gap[i] * am[i] + slack[i]).item():.3e}"
        )


def sign_ties(hp: dict, m: torch.Tensor | None, g: torch.Tensor) -> torch.Tensor:
    """For a row with ``sign_step``: elements where the sign input β1·m + (1 − β1)·g (Lion's) is zero up to
    float32 rounding of its terms: two correct float32 evaluations (ours fused in the kernel, the
    reference's in torch) may disagree on its sign there. ``m`` is the reference's first moment before the
    step (synced to ours), None at step 1."""
    b1 = hp["betas"][0]
    g = g.float()
    m = torch.zeros_like(g) if m is None else m
    c = b1 * m + (1 - b1) * g
    return c.abs() <= SIGN_TIE_ULPS * torch.finfo(F32).eps * (b1 * m.abs() + (1 - b1) * g.abs())


def l2_ties(row, hp: dict, params: dict, grads: dict) -> dict:
    """For a row whose weight decay is L2 (wd > 0): per tensor with any, the elements where the decayed
    gradient g + wd·p is zero up to float32 rounding of its terms. There a fused multiply-add (torch's CUDA
    reference) keeps a residual of ~1e-11 where an unfused evaluation (the kernel) gets exactly 0, and
    RMSprop and Adagrad, dividing by that gradient's own root, turn the residual into a step of order lr.
    Asserts they are few (``tolerances.L2_TIES_MAX``), so that the rule cannot hide a defect."""
    wd = hp.get("weight_decay", 0.0)
    if row.name not in L2_RULES or not wd:
        return {}
    out = {}
    for k, g in grads.items():
        g, wp = g.double(), wd * params[k].double()
        ties = (g + wp).abs() <= L2_TIE_ULPS * torch.finfo(F32).eps * torch.maximum(g.abs(), wp.abs())
        n = int(ties.sum())
        if n:
            allowed = max(L2_TIES_MAX, int(L2_TIES_MAX_FRACTION * ties.numel()))
            assert n <= allowed, f"tensor {k}: {n} of {ties.numel()} elements are L2 ties (at most {allowed})"
            out[k] = ties
    return out


def l2_tie_alternative(ref: Ref, params: dict, grads: dict, wd: float) -> Ref:
    """A copy of the reference before this step, stepped (its own weight decay 0) with g + wd·p evaluated
    unfused, a product and a sum each rounded to float32, as the kernel does: exactly 0 at a tie of exact
    terms. At :func:`l2_ties` it gives the other correct outcome."""
    alt = copy.deepcopy(ref)
    opt = alt.opt.opt if isinstance(alt.opt, UnormClipped) else alt.opt
    for group in opt.param_groups:
        group["weight_decay"] = 0.0
    alt.step({k: g.float() + wd * params[k].float() for k, g in grads.items()})  # two torch ops: unfused
    return alt


def _take_alt(ours: torch.Tensor, ref: torch.Tensor, alt: torch.Tensor, ties: torch.Tensor) -> torch.Tensor:
    """The ``ties`` where ``ours`` is nearer to the alternative outcome ``alt`` than to ``ref``'s: there it
    is compared with ``alt`` (either outcome is right)."""
    ours, ref, alt = ours.float(), ref.float(), alt.float()
    return ties & ((ours - alt).abs() < (ours - ref).abs())


def resync_step(
    row, hp: dict, ref: Ref, params: dict, grads: dict, state: dict, step: int, max_unorm: float = 0.0
) -> tuple[dict, dict]:
    """One step of the reference and ``bnbf.update`` from the same params and states, checked (see the
    module's docstring), and the reference re-synced to ours; returns our new params and state."""
    ties = {k: sign_ties(hp, ref.state(k).get("exp_avg"), g) for k, g in grads.items()} if row.sign_step else {}
    l2 = l2_ties(row, hp, params, grads)
    alt = l2_tie_alternative(ref, params, grads, hp["weight_decay"]) if l2 else None
    ref.step(grads)
    params, state = bnbf.update(params, grads, state, hp, step, max_unorm=max_unorm)
    moments = bnbf.dequantize_state(state)
    for k, p in params.items():
        bar = STATE8[(p.dtype, 8)]
        what = f"step {step}, tensor {k}"
        alt_k = (alt.state(k), alt.p(k), l2[k]) if k in l2 else None
        _check_states(row, bar, state[k], moments[k], ref.state(k), what, alt_k)
        _check_param(row, bar, p.float(), ref.p(k), p.dtype, ties.get(k), hp["lr"], what, alt_k)
    ref.sync(params, moments, row.state_names)
    return params, state


def run_resync(device, row, tensors, fmt, steps: int, wd: float | None = None, max_unorm: float = 0.0) -> Ref:
    """``steps`` re-synced steps of ``row`` (an ``optim_table`` row) with 8-bit state in format ``fmt``, on
    ``tensors``: a list of ``(shape, dtype)``, all stepped in one call; each is held to its dtype's bar.
    Returns the reference (its optimizer counts clipped tensor-steps with max_unorm)."""
    wd = row.weight_decays[-1] if wd is None else wd
    hp = {**row.hparams, "weight_decay": wd}
    params = {
        f"{i}:{dname(dtype)}{tuple(shape)}": init_params(shape, dtype, device)
        for i, (shape, dtype) in enumerate(tensors)
    }
    ref = Ref(row, params, hp, max_unorm)
    spec = bnbf.OptimSpec(rule=row.name, state_bits=8, min_8bit_size=0, state_format=fmt)
    state = bnbf.init_state(params, spec, hp)
    for k in params:
        for name in row.state_names:
            assert getattr(state[k], name).dtype == torch.uint8, "min_8bit_size=0 must give 8-bit state"
    for step in range(1, steps + 1):
        grads = {k: make_grad(p.shape, p.dtype, device) for k, p in params.items()}
        params, state = resync_step(row, hp, ref, params, grads, state, step, max_unorm)
    return ref


def dname(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_states(row, bar, state, moments: dict, ref_state: dict, what: str, alt=None) -> None:
    """One tensor's 8-bit ``state`` (dequantized: ``moments``) against the reference's states after the same
    step: bitsandbytes' bar ``bar`` (except the row's ``code_checked_only``), and within one code gap. ``alt``:
    ``(states, param, ties)`` of :func:`l2_tie_alternative`, whose states are as right at the ties."""
    for ours, theirs in row.state_names.items():
        theirs_t, expected = ref_state[theirs], stored_reference(row, ours, ref_state, theirs)
        if alt is not None:
            alt_state, _, ties = alt
            take = _take_alt(moments[ours], theirs_t, alt_state[theirs], ties)
            theirs_t = torch.where(take, alt_state[theirs], theirs_t)
            expected = torch.where(take, stored_reference(row, ours, alt_state, theirs), expected)
        outside = count_outside(moments[ours], theirs_t, bar.atol, bar.rtol)
        if outside >= bar.max_outside and ours not in row.code_checked_only:
            msg = f"{what} {ours}: {outside} elements outside (bar: < {bar.max_outside})"
            assert_close_report(moments[ours], theirs_t, bar.atol, bar.rtol, msg)
        assert_within_code_gap(state, ours, expected, what)


def _check_param(row, bar, p: torch.Tensor, p_ref: torch.Tensor, dtype, ties, lr: float, what: str, alt=None) -> None:
    """One tensor's param (as float32; ``dtype`` its own) against the reference's after the same step:
    16-bit params element by element (a step of ``lr`` either way where ``ties``), and the bar's means.
    ``alt``: ``(states, param, ties)`` of :func:`l2_tie_alternative`, whose param is as right at the ties."""
    if alt is not None:
        p_ref = torch.where(_take_alt(p, p_ref, alt[1], alt[2]), alt[1], p_ref)
    err = (p - p_ref).abs()
    if dtype != F32:  # every 16-bit param within its rounding plus the bar's allowance
        allowed = half_ulp(p_ref, dtype) + bar.mean_abs
        if ties is not None:  # there float rounding picks the sign: a step of lr either way
            allowed = torch.where(ties, allowed + 2 * lr, allowed)
        if not bool((err <= allowed).all()):
            i = int((err - allowed).reshape(-1).argmax())
            raise AssertionError(
                f"{what}: |p - p_ref| = {err.reshape(-1)[i].item():.3e} at flat {i} (p "
                f"{p.reshape(-1)[i].item()!r}, p_ref {p_ref.reshape(-1)[i].item()!r}) above half an ulp + "
                f"{bar.mean_abs:g} = {allowed.reshape(-1)[i].item():.3e}"
            )
    # bitsandbytes' means (over 4M elements there), on enough elements to be means: a few hundred 16-bit
    # params measure their own rounding (fp16, 257 elements, Adagrad: mean rel 6.15e-4 against 6e-4),
    # and the per-element bound above is the check there
    if dtype == F32 or p.numel() >= MEAN_MIN_NUMEL:
        mean_abs, mean_rel = err.mean().item(), (err / (p_ref.abs() + 1e-9)).mean().item()
        if dtype == torch.bfloat16 and not row.bf16_mean_rel:
            mean_rel = 0.0  # see Row.bf16_mean_rel
        ok = (
            (mean_abs < bar.mean_abs and mean_rel < bar.mean_rel)
            if bar.strict
            else (mean_abs <= bar.mean_abs and mean_rel <= bar.mean_rel)
        )
        assert ok, (
            f"{what}: mean |p - p_ref| {mean_abs:.3e} (bar {bar.mean_abs:g}), "
            f"mean rel {mean_rel:.3e} (bar {bar.mean_rel:g})"
        )

"""Every tolerance the suite uses, in one place, with where each figure comes from.

Keys are ``(param dtype, state_bits)``. The dtype-keyed figures are bitsandbytes' own test tolerances
(its test_optimizer32bit, test_optimizer8bit and test_dynamic_blockwise); the rest are float32 rounding
allowances, each with what it measures. Do not loosen one to get a test green.

* 32-bit state against the torch reference (``STATE32``): compare the *change* of the parameters from
  their initial values and the moments, both in float32.
* 8-bit state against the torch reference re-synced every step (``STATE8``): per state, fewer than
  ``max_outside`` elements outside ``atol``/``rtol``; mean ``|p - p_ref|`` below ``mean_abs`` and mean
  relative error below ``mean_rel`` (``strict`` says whether the bar is ``<`` or ``<=``, as bitsandbytes
  writes it).
* The quantizer (``QUANT``): mean errors of a signed-map round trip of ``randn``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Close:
    atol: float
    rtol: float


@dataclass(frozen=True)
class Resync8:
    atol: float  # per-state element tolerance (dequantized state vs the reference's state)
    rtol: float
    max_outside: int  # fewer than this many elements may lie outside atol/rtol, per state, per step
    mean_abs: float  # mean |p - p_ref| after one step from synced params and states
    mean_rel: float  # mean |p - p_ref| / (|p_ref| + 1e-9)
    strict: bool  # True: mean < bar; False: mean <= bar


F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DTYPES = (F32, F16, BF16)

# 32-bit state vs torch.optim (bitsandbytes test_optimizer32bit)
STATE32: dict[tuple[torch.dtype, int], Close] = {
    (F32, 32): Close(atol=1e-6, rtol=1e-5),
    (F16, 32): Close(atol=1e-4, rtol=1e-3),
    (BF16, 32): Close(atol=1e-3, rtol=1e-2),
}

# 8-bit state vs torch.optim, re-synced every step, 50 steps (bitsandbytes test_optimizer8bit)
STATE8: dict[tuple[torch.dtype, int], Resync8] = {
    (F32, 8): Resync8(atol=3e-3, rtol=1e-3, max_outside=20, mean_abs=6e-5, mean_rel=6e-4, strict=True),
    (F16, 8): Resync8(atol=3e-3, rtol=1e-3, max_outside=20, mean_abs=6e-5, mean_rel=6e-4, strict=True),
    (BF16, 8): Resync8(atol=3e-3, rtol=1e-3, max_outside=20, mean_abs=1.7e-4, mean_rel=1.6e-3, strict=False),
}


# Quantizer round trip of randn with the signed dynamic map, block 256 (bitsandbytes test_dynamic_blockwise)
QUANT_SIGNED_MEAN_ABS = 0.011
QUANT_SIGNED_MEAN_REL = 0.018

# Round trip of one value: |x - dq(q(x))| <= half the local code gap * absmax + QUANT_ULPS float32 ulps of
# absmax (x * (1/absmax) is one rounding away from x / absmax, and the product code * absmax another).
QUANT_ULPS = 4

# Two float32 evaluations of the same formula that differ only in how a hyperparameter reaches the
# arithmetic (a Python float, rounded once to float32, vs a float32 0-d tensor; bias corrections in double
# vs float32). The difference is a few float32 ulps per step of the *update*, so the 32-bit figure applies.
SAME_MATH = STATE32[(F32, 32)]

# Convergence of a small torch.func training loop: final loss relative to torch.optim.AdamW's.
CONVERGENCE_REL = {32: 0.02, 8: 0.05}

# ---- allowances of the rule tests (tests/test_rules.py), each with what it measures -------------------
# 32-bit state vs the reference: atol at least this many float32 ulps of the state's largest value (a state
# whose terms are of order 1 carries their rounding into elements where they cancel).
STATE_ULPS = 8
# 16-bit params with 32-bit state: this step's change equals the reference's rounded to the dtype except
# where the two float32 results straddle a rounding boundary: at most this fraction of the changes.
ROUNDED_CHANGES_DIFFER = 0.01
# Tensor vs float hyperparameters (a float32 tensor's arithmetic rounds at each op, a Python float once): two
# bars, both asserted. SAME_MATH, and one scaled to the compared values: |Δ| <= atol·s + rtol·|expected|, s the
# largest magnitude compared, at least the floor of its kind below.
TENSOR_HPARAMS_SCALED = Close(atol=1e-6, rtol=1e-4)
TENSOR_HPARAMS_FLOORS = {"param": 1e-3, "state": 1e-6}


@dataclass(frozen=True)
class Codes:
    """Two evaluations of the same math on 8-bit state: codes at most ``apart`` apart (a value on a rounding
    boundary goes either way), and at most ``count`` codes differ, or one per ``per`` elements where that is
    more (``per`` 0: never)."""

    apart: int
    count: int
    per: int = 0


TENSOR_HPARAMS_CODES = Codes(apart=1, count=2)  # one step from the same state
# The Triton step vs the torch reference path on the same inputs: 8-bit codes, block absmaxes (relative),
# and the fraction of 16-bit params that round to the same value (at most one ulp apart everywhere).
KERNEL_VS_REFERENCE_CODES = Codes(apart=1, count=2, per=1000)
KERNEL_VS_REFERENCE_ABSMAX_RTOL = 1e-6
# Two compiled variants of the same step (e.g. with and without the clipping factor): the compiler contracts the
# rule's multiply-adds into FMAs per variant, so float results may differ by this many float32 ulps of the
# tensor's largest value (codes then by KERNEL_VS_REFERENCE_CODES); the reference and the interpreter do not.
CONTRACTION_ULPS = 2
KERNEL_VS_REFERENCE_SAME = 0.99
# The same values rounded with other dither offsets (blocks of other indices): codes at most this far apart.
OTHER_DITHER_CODES_APART = 1
# A non-vacuity bar: a row's distinguishing hyperparameter moves the result by more than this many times the
# parity test's tolerance.
NOT_VACUOUS = 20
# (1 - beta)·g of a first moment update within this many float32 roundings of the float64 value.
ONE_MINUS_ULPS = 4
# A limit far above the update norm: the step within this many ulps of the param's dtype of the unclipped one.
LOOSE_CLIP_ULPS = 1
# The norm pass's per-tensor sums: one float32 ulp of the float64 sum.
NORM_SUMS_RTOL = 2**-23


# Gradient clipping folded into a rule's norm pass (LARS, tests/test_clip_fused.py). The total norm adds the
# same float32 squares q = fl(g²) as torch._foreach_norm, in another order: float32 within each tile of W elements
# (the norm pass's tile: the block size of 8-bit states, 256 for float32 states), float64 across tiles and tensors,
# the root in float64, rounded once to float32. With u = 2^-24 and non-negative terms, a float32 sum of k terms
# in any order is within (k - 1)·u of their exact sum (first order), so each tile's sum is within (W - 1)·u of
# the exact sum of the g² of its elements, the squares' own rounding adding u: W·u in all. The float64 additions
# of fewer than 2^20 tiles add less than 2^-32 (below u). The root halves the relative error, and its rounding
# to float32 adds u: the folded total is within (W/2 + 1)·u of the float64 total of the same grads.
# Since issue 13's H5 every eager clipped call takes its total this way (LARS in its norm pass, every other rule
# in a grads-only pass over the same tiles).
def folded_total_ulps(tile: int) -> int:
    return tile // 2 + 1


def folded_total_rtol(tile: int, dtype: torch.dtype) -> float:
    """The folded total's relative bound against the float64 total, for grads of ``dtype``: the tiles' and the
    root's (W/2)·u as above, then one rounding into the total's dtype (torch's total is in the grads' dtype):
    float32's u, or a 16-bit dtype's unit roundoff (eps / 2). For float32, ``folded_total_ulps(W)·u``."""
    return (tile // 2) * 2.0**-24 + torch.finfo(dtype).eps / 2


# torch's total is given (its bits, measured against the float64 total in the test, not ours to bound); each
# coefficient is then max_norm / (total + 1e-6), clamped, in the total's dtype: the addition rounds once, and
# torch's Python-number max_norm / x is a reciprocal then a product (Tensor.__rtruediv__), two more (a 0-d
# tensor max_norm divides once); the clamp is exact. Three roundings of the dtype's unit roundoff in each path,
# six in all.
FOLDED_COEF_EXTRA_ULPS = 6
# A LARS step's update per unit of lr, local·d with d = c·g + wd·p and local = η‖p‖ / (c‖g‖ + wd‖p‖ + ε), moves
# by at most r·local·(2|c·g| + wd|p|) per element when c, or c‖g‖, moves by a relative r (the derivative of
# local·d by c, times c, is local·(c·g − d·c‖g‖/den), and c‖g‖ <= den); r adds the two coefficients' bound and
# the two evaluations of ‖c·g‖ (the fold's c²·Σg², the clipped copies' Σ(c·g)²: each within the folded sum's
# bound of exact). Each path then rounds what depends on c on its own: ‖c·g‖'s root, local's two additions and
# its division (two roundings where it is a reciprocal and a product), c·g and d, local·d, lr·(local·d): at
# most 9 roundings of u each per path, FOLDED_STEP_ROUNDINGS·u·local·(|c·g| + wd|p|) between the two; and the
# new param p − lr·update, rounded by each to half an ulp of the param: one ulp between them.
FOLDED_STEP_ROUNDINGS = 18
# skip_zeros with 8-bit state: an unchanged value requantized with a new block absmax moves at most the map's
# widest gap times absmax, times (1 + REL), plus ABS (float32 rounding).
REQUANT_SLACK_REL = 1e-4
REQUANT_SLACK_ABS = 1e-12
# The small training problem: 32-bit state trains (the end below this fraction of the first loss) and 8-bit
# state's losses around step 50 and at the end within this relative gap of 32-bit's.
TRAINS = 0.5
TRAINS_8_VS_32 = 0.05

# ---- the 8-bit re-synced harness (tests/resync.py) ----------------------------------------------------
# A stored state lies within one code gap of the reference's new value, plus float32 slack for two
# evaluations of the same formula: this relative part of the value plus this many float32 ulps of the
# block's absmax.
CODE_GAP_SLACK_REL = 1e-5
CODE_GAP_SLACK_ULPS = 8
# A value within this relative distance of a code counts as on it (the step's dither may then take it to
# either neighbour).
ON_CODE_REL = 1e-6
# Lion's sign input counts as zero within this many float32 ulps of its terms' magnitudes (there two
# correct evaluations may disagree on the sign).
SIGN_TIE_ULPS = 16
# An L2-decayed gradient g + wd·p counts as zero within this many float32 ulps of its terms' magnitudes: there a
# fused and an unfused evaluation differ by the product's rounding (~1e-11 against exactly 0 at an exact tie),
# which RMSprop and Adagrad divide by its own root into a step of order lr: either step is right.
L2_TIE_ULPS = 2
# The rule excuses at most this many such elements per tensor and step, or this fraction of its elements where
# that is more (1024x4097 bf16 params and grads of the suite's N(0, 0.1²), N(0, 0.01²) have ~35 a step: 8e-6).
L2_TIES_MAX = 4
L2_TIES_MAX_FRACTION = 1e-4
# bitsandbytes' mean bars are checked on tensors of at least this many elements (and always in float32):
# the mean of a few hundred 16-bit params measures their rounding, not the step.
MEAN_MIN_NUMEL = 4096


def assert_close_report(
    actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, what: str, show: int = 5
) -> None:
    """``|actual - expected| <= atol + rtol * |expected|`` elementwise (in float32), else fail with the
    number of offending elements and the worst ``show`` of them (index, actual, expected, error)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a = actual.detach().float().cpu()
    e = expected.detach().float().cpu()
    err = (a - e).abs()
    allowed = atol + rtol * e.abs()
    bad = ~(err <= allowed)  # NaN counts as bad
    if not bool(bad.any()):
        return
    excess = torch.where(bad, (err - allowed).nan_to_num(nan=float("inf")), torch.full_like(err, -1.0))
    k = min(show, int(bad.sum()))
    worst = excess.reshape(-1).topk(k).indices
    lines = [
        f"{what}: {int(bad.sum())} of {a.numel()} elements outside atol={atol:g} rtol={rtol:g} "
        f"(max abs err {float(err.nan_to_num(nan=float('inf')).max()):.3e})"
    ]
    for flat in worst.tolist():
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape)) if a.dim() else ()
        lines.append(
            f"  at {idx}: actual {a.reshape(-1)[flat].item():.9g} expected {e.reshape(-1)[flat].item():.9g} "
            f"err {err.reshape(-1)[flat].item():.3e} allowed {allowed.reshape(-1)[flat].item():.3e}"
        )
    raise AssertionError("\n".join(lines))


def count_outside(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> int:
    """Number of elements not within ``atol + rtol * |expected|`` (NaN counts), compared in float32."""
    a = actual.detach().float()
    e = expected.detach().float()
    return int((~torch.isclose(a, e, atol=atol, rtol=rtol)).sum())


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s raw bits as an integer tensor of the same shape (so NaN payloads compare too)."""
    t = t.detach()
    if t.is_sparse:
        t = t.to_dense()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    if not t.is_floating_point():
        return t
    return t.contiguous().view(_BITS[t.element_size()])


def assert_equal_report(actual: torch.Tensor, expected: torch.Tensor, what: str, show: int = 5) -> None:
    """Bitwise equality (same shape, dtype and bits), else fail listing the first differing elements."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    a_bits, e_bits = bits(actual), bits(expected)
    if a_bits.device != e_bits.device:
        e_bits = e_bits.to(a_bits.device)
    if torch.equal(a_bits, e_bits):
        return
    a = (actual.to_dense() if actual.is_sparse else actual).detach().cpu().reshape(-1)
    e = (expected.to_dense() if expected.is_sparse else expected).detach().cpu().reshape(-1)
    diff = (a_bits != e_bits).cpu().reshape(-1) if not actual.is_complex() else (a != e)
    where = diff.nonzero().reshape(-1)[:show].tolist()
    lines = [f"{what}: {int(diff.sum())} of {a.numel()} elements differ bitwise"]
    for flat in where:
        lines.append(f"  flat index {flat}: actual {a[flat].item()!r} expected {e[flat].item()!r}")
    raise AssertionError("\n".join(lines))


def half_ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half the spacing of ``dtype`` numbers at |x|: the most a round-to-nearest store moves x."""
    x = x.float().abs()
    fi = torch.finfo(dtype)
    return torch.exp2(torch.floor(torch.log2(torch.clamp(x, min=fi.tiny)))) * fi.eps / 2


def codes_differ(actual: torch.Tensor, expected: torch.Tensor, bound: Codes, what: str) -> None:
    """8-bit codes of two evaluations of the same math within ``bound`` (:class:`Codes`)."""
    diff = (actual.cpu().long() - expected.cpu().long()).abs()
    apart = int(diff.max()) if diff.numel() else 0
    assert apart <= bound.apart, f"{what}: codes differ by up to {apart} (bar {bound.apart})"
    n_diff = int((diff > 0).sum())
    allowed = max(bound.count, diff.numel() // bound.per if bound.per else 0)
    assert n_diff <= allowed, f"{what}: {n_diff} of {diff.numel()} codes differ (bar {allowed})"


def assert_same_variant(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """One step through two compiled variants of its kernel (another dither offset, the clip folded in, the
    scalars as a row): the same bits off CUDA (the reference and the interpreter do not contract); on CUDA 8-bit
    codes within ``KERNEL_VS_REFERENCE_CODES``, 16-bit values within one ulp of their dtype, and float32 within
    ``CONTRACTION_ULPS`` ulps of the tensor's largest value."""
    if actual.device.type != "cuda":
        assert_equal_report(actual, expected, what)
    elif actual.dtype == torch.uint8:
        codes_differ(actual, expected, KERNEL_VS_REFERENCE_CODES, what)
    elif actual.dtype in (torch.bfloat16, torch.float16):  # one fp32 value rounded to the dtype twice
        off = (actual.float() - expected.float()).abs() > 2 * half_ulp(expected, actual.dtype)
        assert not bool(off.any()), f"{what}: {int(off.sum())} values more than one ulp apart"
    else:
        scale = expected.float().abs().max() if expected.numel() else torch.tensor(0.0)
        atol = CONTRACTION_ULPS * 2 * float(half_ulp(scale, torch.float32))
        assert_close_report(actual.float(), expected.float(), atol=atol, rtol=0.0, what=what)


def assert_trees_same_variant(actual, expected, what: str) -> None:
    """:func:`assert_same_variant` leaf by leaf over two pytrees of the same structure (dict keys in order,
    dtypes and shapes equal)."""
    la, spec_a = torch.utils._pytree.tree_flatten(actual)
    lb, spec_b = torch.utils._pytree.tree_flatten(expected)
    assert spec_a == spec_b, f"{what}: tree {spec_a} against {spec_b}"
    for i, (x, y) in enumerate(zip(la, lb)):
        assert (x.dtype, x.shape) == (y.dtype, y.shape), f"{what} (leaf {i}): {x.dtype} {x.shape}, {y.dtype} {y.shape}"
        assert_same_variant(x, y, f"{what} (leaf {i})")

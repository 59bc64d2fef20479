"""Gradient clipping inside the step (issue 13): ``bnbf.update(..., max_grad_norm=c)`` and ``update_``.

Every eager call takes the total norm from its own pass over the grads (LARS in its norm pass, every other rule
in one grads-only launch per group; the reference path adds as the kernels do), never ``torch._foreach_norm``:

- (a) the total within the folded sum's bound of the float64 total (tests/tolerances.py) and the coefficient
  within that plus torch's own error of torch's, for float32, float16 and bfloat16 grads;
- (b) the step bit for bit the unclipped step on the grads scaled by that coefficient (torch's float32
  multiply), pure and in place, for AdamW (8-bit and 32-bit, ``maximize``, ``max_unorm``'s norm pass), Lion,
  LAMB, Adan, LARS beside SGD and a mixed-rule tree, from non-zero states (where the grads' scale matters);
- (c) grads whose norms are exact (every order of adding gives the same total): the same bits as torch's
  ``clip_grad_norm_`` then the step, the coefficient's bits included; inf and NaN grads: torch's bits too;
- 16-bit grads against float64 references; ``max_grad_norm`` is a runtime value (no new kernel), bad values
  raise before anything is written, the grads are not modified, and a clipped step of a GPT-2-like tree adds
  two launches per group (the grads' squares, their per-tensor sums) and a few small ops (no host
  synchronisation on CUDA).
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_untouched, kernel_runs, snapshot
from tolerances import (
    FOLDED_COEF_EXTRA_ULPS,
    FOLDED_STEP_ROUNDINGS,
    KERNEL_VS_REFERENCE_CODES,
    NOT_VACUOUS,
    SAME_MATH,
    STATE32,
    assert_close_report,
    assert_equal_report,
    assert_trees_same_variant,
    codes_differ,
    folded_total_rtol,
    folded_total_ulps,
    half_ulp,
)

import bnbf
from bnbf import compose
from bnbf._dispatch import interpreting
from bnbf.reference import GradClip

INTERP = interpreting()
MAX = 0.5  # the grads below have a global norm of about 2-3: clipping is active


def _random_state(state):
    """Non-zero states: random 8-bit codes and scales, or random non-negative float32 values (valid for
    signed and unsigned slots), so that the step depends on the grads' scale for every rule."""
    out = []
    for t in state:
        if t.dtype == torch.uint8:
            out.append(torch.randint(0, 256, t.shape, dtype=torch.uint8).to(t.device))
        else:
            out.append((torch.rand(t.shape) * 0.05 + 0.01).to(t.device))
    return type(state)._make(out)


SHAPES = {"w": (9, 31), "b": (257,), "one": (1,), "emb": (20, 13)}


def _setup(device, specs, hp=None, dtype=torch.float32):
    """Params, grads (~N(0, 0.1^2), norm ~2), non-zero states; ``specs`` names the leaves."""
    params = {k: (torch.randn(SHAPES[k]) * 0.5).to(dtype).to(device) for k in specs}
    grads = {k: (torch.randn(SHAPES[k]) * 0.1).to(dtype).to(device) for k in specs}
    state = compose.init_state(params, specs, hp)
    return params, grads, {k: _random_state(s) for k, s in state.items()}


# Pythagorean tuples by leaf count: integer norms whose root sum of squares is an integer
PYTHAGOREAN = {2: ((3, 4), 5), 3: ((2, 3, 6), 7), 4: ((2, 4, 5, 6), 9)}


def _exact_grads(params, scale, norms=None, dtype=None):
    """Grads whose per-tensor norms are integers times ``scale`` (a power of 2) and whose total norm is one too
    (:data:`PYTHAGOREAN`): leaf k holds (r/m)² elements ±m·scale at random places (the largest such count that
    fits), zeros elsewhere. Every square and every partial sum is exact in float32, and so is each root: torch's
    total (per-tensor norms, then their norm) and ours (tiles, then float64) are the same number."""
    norms = norms or PYTHAGOREAN[len(params)][0]
    out = {}
    for (k, p), r in zip(params.items(), norms):
        n = p.numel()
        m = min(d for d in range(1, r + 1) if r % d == 0 and (r // d) ** 2 <= n)
        count = (r // m) ** 2
        g = torch.zeros(n)
        g[torch.randperm(n)[:count]] = m * (torch.randint(0, 2, (count,)) * 2.0 - 1.0)
        out[k] = (g * scale).reshape(p.shape).to(dtype or p.dtype).to(p.device)
    return out


def _clones(params, state):
    return {k: p.clone() for k, p in params.items()}, {k: type(s)(*(t.clone() for t in s)) for k, s in state.items()}


def _eq(got, want, what):
    """The same bits on the reference path and under the interpreter. Compiled kernels (CUDA) contract the rule's
    multiply-adds into FMAs as the compiler chooses for each variant, and the clipped step is another variant
    than the unclipped one: there float tensors agree within CONTRACTION_ULPS float32 ulps of their largest
    value and 8-bit codes within KERNEL_VS_REFERENCE_CODES (seen on the H200: 1 ulp)."""
    assert_trees_same_variant(got, want, what)


def _record_folds(monkeypatch) -> list:
    """The folded clips of the calls that follow, each after its total and coefficient are computed."""
    seen = []
    real = GradClip.finish

    def finish(self):
        folding = self.folding
        real(self)
        if folding:
            seen.append(self)

    monkeypatch.setattr(GradClip, "finish", finish)
    return seen


def _no_foreach_norm(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("torch._foreach_norm was called: the total norm was not taken by our own pass")

    monkeypatch.setattr(torch, "_foreach_norm", refuse)


def _total64(grads) -> torch.Tensor:
    return torch.sqrt(sum((g.double().cpu() ** 2).sum() for g in grads.values()))


def _scaled(grads, coef):
    """(b)'s grads: each times the coefficient with torch's multiply (float32 grads: one float32 product, which
    the step forms as it loads them)."""
    return {k: g * coef.to(g.device) for k, g in grads.items()}


def _assert_total_and_coef(clip, grads, max_norm, what, tile=256):
    """(a): the folded total within ``folded_total_rtol`` of the float64 total, in the grads' dtype; the
    coefficient within that, torch's measured error (its bits, not ours to bound) and FOLDED_COEF_EXTRA_ULPS of
    the dtype of torch's coefficient."""
    dtype = next(iter(grads.values())).dtype
    total64 = float(_total64(grads))
    assert clip.total.dtype == dtype and clip.value.dtype == dtype, (clip.total.dtype, clip.value.dtype)
    bound = folded_total_rtol(tile, dtype)
    assert abs(float(clip.total) / total64 - 1) <= bound, (what, float(clip.total), total64)
    total_torch = torch.nn.utils.get_total_norm([g.cpu() for g in grads.values()])
    torch_err = abs(float(total_torch) / total64 - 1)
    limit = max_norm.cpu() if torch.is_tensor(max_norm) else max_norm
    c_torch = torch.clamp(limit / (total_torch + 1e-6), max=1.0)
    r = bound + torch_err + FOLDED_COEF_EXTRA_ULPS * torch.finfo(dtype).eps / 2
    assert abs(float(clip.value) / float(c_torch) - 1) <= r, (what, float(clip.value), float(c_torch))


_SPEC = lambda rule, bits=8: bnbf.OptimSpec(rule=rule, state_bits=bits, min_8bit_size=256)
# (specs by leaf, hparams, options); the interpreter runs the norm-pass rules on two leaves
CASES = {
    "adamw8": ({k: _SPEC("adamw") for k in ("w", "b", "one")}, {"lr": 1e-2, "weight_decay": 0.1}, {}),
    "adamw32_maximize": ({k: _SPEC("adamw", 32) for k in ("w", "one")}, {"lr": 1e-2}, {"maximize": True}),
    "adamw8_max_unorm": ({k: _SPEC("adamw") for k in ("w", "one")}, {"lr": 1e-2}, {"max_unorm": 0.01}),
    "lion": ({k: _SPEC("lion") for k in ("w", "b", "one")}, {"lr": 1e-3, "weight_decay": 0.1}, {}),
    "lamb": ({k: _SPEC("lamb") for k in ("w", "one")}, {"lr": 1e-2, "weight_decay": 0.01}, {}),
    "adan": ({k: _SPEC("adan") for k in ("w", "b")}, {"lr": 1e-2, "weight_decay": 0.02}, {}),
    # LARS beside another rule: LARS's groups take their sums in their norm pass, SGD's in the grads-only pass
    "lars_mixed": (
        {"w": _SPEC("lars"), "one": _SPEC("lars"), "b": _SPEC("sgd")},
        {"lars": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1}, "sgd": {"lr": 0.1, "momentum": 0.9}},
        {},
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_max_grad_norm_steps_with_its_coefficient(device, case, monkeypatch):
    """(a) and (b), float32 grads, pure and in place, without ``torch._foreach_norm``: the same coefficient
    both ways, within the bound of torch's, and the step bit for bit the unclipped step on the grads scaled by
    it; nothing but the outputs written."""
    specs, hp, opts = CASES[case]
    params, grads, state = _setup(device, specs, hp)
    folds = _record_folds(monkeypatch)
    _no_foreach_norm(monkeypatch)
    snap = snapshot(params, grads, state)
    got = bnbf.update(params, grads, state, hp, 3, max_grad_norm=MAX, **opts)
    assert_untouched(snap)
    in_p, in_s = _clones(params, state)
    g_snap = snapshot(grads)
    out = bnbf.update_(in_p, grads, in_s, hp, 3, max_grad_norm=MAX, **opts)
    assert out[0] is in_p and out[1] is in_s
    assert_untouched(g_snap, "grad")  # clipped as they are loaded, not in place
    monkeypatch.undo()
    clip, clip_ = folds
    assert_equal_report(clip_.value, clip.value, f"{case}: in-place coefficient vs pure")
    assert float(clip.value) < 0.5  # clipping is active
    _assert_total_and_coef(clip, grads, MAX, case)
    want = bnbf.update(params, _scaled(grads, clip.value), state, hp, 3, **opts)
    _eq(got, want, f"{case}: update(max_grad_norm=) vs update(grads * its coefficient)")
    _eq((in_p, in_s), want, f"{case}: update_(max_grad_norm=) vs update(grads * its coefficient)")
    # not vacuous: the unclipped step differs (the interpreter leaves this to the reference pass: the same inputs)
    if not (INTERP and case in ("lamb", "lars_mixed", "adamw8_max_unorm")):
        plain = bnbf.update(params, grads, state, hp, 3, **opts)
        assert not torch.equal(plain[0]["w"], want[0]["w"]), "clipping did not change the step"


@pytest.mark.parametrize("case", sorted(c for c in CASES if not c.startswith("lars")))
def test_exact_norms_give_torchs_bits(device, case, monkeypatch):
    """(c): grads whose norms are exact, so that torch's total and ours are the same number: the same bits as
    torch's clipping (``clip_grad_norm``, torch's bits) then the step, pure with a number limit and in place
    with a 0-d tensor one (the coefficient by torch's ops from our total; under the interpreter for adamw8
    only). (LARS's clipped norms come from its unclipped ones, c²·Σg², not from Σ(c·g)²: bounded below.)"""
    specs, hp, opts = CASES[case]
    params, _, state = _setup(device, specs, hp)
    grads = _exact_grads(params, 0.25)
    _no_foreach_norm(monkeypatch)
    limits = (MAX, torch.tensor(MAX, device=device))
    for limit in limits[:1] if INTERP and case != "adamw8" else limits:  # (the interpreter's time)
        monkeypatch.undo()
        clipped, total = compose.clip_grad_norm(grads, limit)
        assert float(total) == PYTHAGOREAN[len(params)][1] / 4 and float(total) > 2 * MAX
        want = bnbf.update(params, clipped, state, hp, 3, **opts)
        _no_foreach_norm(monkeypatch)
        if isinstance(limit, float):
            got = bnbf.update(params, grads, state, hp, 3, max_grad_norm=limit, **opts)
        else:
            got = _clones(params, state)
            bnbf.update_(got[0], grads, got[1], hp, 3, max_grad_norm=limit, **opts)
        _eq(got, want, f"{case}, limit {type(limit).__name__}: vs torch's clip then the step")


def test_mixed_tree_steps_with_its_coefficient(device, monkeypatch):
    """AdamW on matrices, Lion on embeddings, no decay on 1-d leaves, in one call (one launch per rule and
    layout on the Triton path, each tensor with its own scalars), pure and in place, number and 0-d tensor
    limits: (a) and (b), no ``torch._foreach_norm``; exact norms: torch's bits (c)."""
    specs = {"w": _SPEC("adamw"), "b": _SPEC("adamw", 32), "one": _SPEC("adamw"), "emb": _SPEC("lion")}
    hp = lambda path, p: {"lr": 1e-3} if path == "emb" else {"lr": 1e-2, "weight_decay": 0.1 * (p.ndim > 1)}
    params, grads, state = _setup(device, specs)
    folds = _record_folds(monkeypatch)
    _no_foreach_norm(monkeypatch)
    got = bnbf.update(params, grads, state, hp, 2, max_grad_norm=MAX)
    in_p, in_s = _clones(params, state)
    t_max = torch.tensor(MAX, device=device)
    bnbf.update_(in_p, grads, in_s, hp, 2, max_grad_norm=t_max)
    exact = _exact_grads(params, 0.25)
    got_exact = bnbf.update(params, exact, state, hp, 2, max_grad_norm=MAX)
    monkeypatch.undo()
    clip, clip_t, _ = folds
    _assert_total_and_coef(clip, grads, MAX, "mixed tree")
    _assert_total_and_coef(clip_t, grads, t_max, "mixed tree, tensor max_grad_norm")
    _eq(got, bnbf.update(params, _scaled(grads, clip.value), state, hp, 2), "mixed tree: update(max_grad_norm=)")
    want_t = bnbf.update(params, _scaled(grads, clip_t.value), state, hp, 2)
    _eq((in_p, in_s), want_t, "mixed tree: update_(max_grad_norm=tensor)")
    want_exact = bnbf.update(params, compose.clip_grad_norm(exact, MAX)[0], state, hp, 2)
    _eq(got_exact, want_exact, "mixed tree, exact norms: vs torch's clip then the step")


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16))
def test_coefficient_against_torchs(device, dtype, monkeypatch):
    """The coefficient itself, read out through a probe leaf (SGD, lr 1, param 0, grad a power of 2: the new
    param is minus the coefficient times the grad, exactly): with exact norms over totals and limits where the
    dtype's roundings of ``max_norm / (total + 1e-6)`` differ from float32's (and one below the limit), torch's
    bits (``torch.nn.utils.clip_grad_norm_``'s clipped probe); with random grads, within (a)'s bound."""
    spec = bnbf.OptimSpec(rule="sgd", state_bits=32)
    hp = {"lr": 1.0}
    # (the probe's, then two leaves' norms; their total), scale, max_norm
    for (norms, total), scale, max_norm in (
        (((1, 2, 2), 3), 1.0, 0.1),
        (((2, 3, 6), 7), 0.5, 1.3),
        (((1, 4, 8), 9), 2.0**-9, 0.5),
        (((8, 9, 12), 17), 2.0**8, 7.0),
    ):
        params = {k: torch.zeros(n, dtype=dtype, device=device) for k, n in (("probe", 1), ("r", 300), ("s", 300))}
        grads = _exact_grads(params, scale, norms)
        state = bnbf.init_state(params, spec)
        new, _ = bnbf.update(params, grads, state, hp, 1, max_grad_norm=max_norm)
        leaves = [torch.nn.Parameter(p.clone()) for p in params.values()]
        for p, g in zip(leaves, grads.values()):
            p.grad = g.clone()
        assert float(torch.nn.utils.clip_grad_norm_(leaves, max_norm)) == total * scale
        assert_equal_report(-new["probe"], leaves[0].grad, f"{dtype} total {total * scale} max_norm {max_norm}")
    folds = _record_folds(monkeypatch)
    _no_foreach_norm(monkeypatch)
    cases = []
    for scale, max_norm in ((1.0, 0.1), (3.7, 1.3), (250.0, 7.0)):
        params = {k: torch.zeros(n, dtype=dtype, device=device) for k, n in (("r", 300), ("s", 257))}
        grads = {k: (torch.randn(p.shape) * scale).to(dtype).to(device) for k, p in params.items()}
        bnbf.update(params, grads, bnbf.init_state(params, spec), hp, 1, max_grad_norm=max_norm)
        cases.append((grads, max_norm, f"{dtype} scale {scale}"))
    monkeypatch.undo()  # torch's total for the bound
    for clip, (grads, max_norm, what) in zip(folds, cases, strict=True):
        _assert_total_and_coef(clip, grads, max_norm, what)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
def test_16bit_grads_against_float64(device, dtype, monkeypatch):
    """16-bit params and grads, SGD with momentum (32-bit state): the float32 update (``bnbf.updates``) is
    within the dtype's tolerance of torch's clipping and torch.optim.SGD in float64, and within float32
    rounding (SAME_MATH) of its coefficient applied in float64: the step multiplies the 16-bit grad by the
    coefficient in float32, where a clipped 16-bit copy rounds the product to the dtype (farther, checked)."""
    lr, hp = 0.1, {"lr": 0.1, "momentum": 0.9}
    params = {"w": (torch.randn(9, 31) * 0.5).to(dtype).to(device), "b": (torch.randn(257) * 0.5).to(dtype).to(device)}
    grads = {k: (torch.randn(p.shape) * 0.2).to(dtype).to(device) for k, p in params.items()}
    state = bnbf.init_state(params, bnbf.OptimSpec(rule="sgd", state_bits=32), hp)
    folds = _record_folds(monkeypatch)
    u, _ = compose.updates(params, grads, state, hp, 1, max_grad_norm=MAX)
    (clip,) = folds
    _assert_total_and_coef(clip, grads, MAX, str(dtype))

    p64 = [torch.nn.Parameter(p.double()) for p in params.values()]
    for p, g in zip(p64, grads.values()):
        p.grad = g.double()
    torch.nn.utils.clip_grad_norm_(p64, MAX)
    torch.optim.SGD(p64, lr=lr, momentum=0.9).step()
    tol = STATE32[(dtype, 32)]
    coef = clip.value.double()
    assert float(coef) < 0.5
    u_copy, _ = compose.updates(params, _scaled(grads, clip.value), state, hp, 1)  # 16-bit clipped copies
    err_fused, err_copy = 0.0, 0.0
    for (k, p), p_new, g in zip(params.items(), p64, grads.values()):
        assert_close_report(u[k], p_new.detach() - p.double(), tol.atol, tol.rtol, f"{k}: vs float64 torch")
        exact = -lr * g.double() * coef
        assert_close_report(u[k].double(), exact, SAME_MATH.atol, SAME_MATH.rtol, f"{k}: vs its coefficient")
        err_fused = max(err_fused, float((u[k].double() - exact).abs().max()))
        err_copy = max(err_copy, float((u_copy[k].double() - exact).abs().max()))
    assert err_copy > 10 * err_fused, (err_copy, err_fused)
    # the params are that update rounded once into the dtype
    new, _ = bnbf.update(params, grads, state, hp, 1, max_grad_norm=MAX)
    _eq(new, compose.apply_updates(params, u), "update vs apply_updates(updates)")


def test_max_grad_norm_is_a_runtime_value(device, monkeypatch):
    """Other limits (numbers, then 0-d tensors) launch the kernel they launched: no compile. Both forms take
    the coefficient from the device (CLIP 2): the same kernels, other than the unclipped step's."""
    if not kernel_runs(device):
        pytest.skip("the reference path compiles nothing; run with TRITON_INTERPRET=1 or on CUDA")
    from test_no_recompile import LaunchRecorder, compiled_count

    import bnbf.kernels.launcher as mt

    params, grads, state = _setup(device, {k: _SPEC("adamw") for k in ("w", "one")})
    hp = {"lr": 1e-2}
    on_cuda = device == "cuda"
    keys = []
    for limits in ((None,), (1.0, 0.3, 7.5), tuple(torch.tensor(v, device=device) for v in (0.2, 3.0))):
        if not on_cuda:
            recorder = LaunchRecorder(mt._step_kernel, run=False)
            monkeypatch.setattr(mt, "_step_kernel", recorder)
        bnbf.update(params, grads, state, hp, 2, max_grad_norm=limits[0])
        before = compiled_count() if on_cuda else set(mt.LAUNCH_KEYS)
        first = None if on_cuda else set(recorder.keys)  # two launch groups: 8-bit "w", 32-bit "one"
        for i, c in enumerate(limits[1:]):
            bnbf.update(params, grads, state, hp, 3 + i, max_grad_norm=c)
        if on_cuda:
            torch.cuda.synchronize()
            assert compiled_count() == before, f"another max_grad_norm compiled a kernel ({limits})"
        else:
            assert len(first) == 2 and set(recorder.keys) == first, "launch keys changed with max_grad_norm"
            assert set(mt.LAUNCH_KEYS) == before
            keys.append(first)
            monkeypatch.undo()
    if not on_cuda:  # a number and a tensor limit: the same kernels, not the unclipped step's
        assert keys[1] == keys[2] and not keys[0] & keys[1]


NONFINITE_CASES = {
    "adamw8": ({k: _SPEC("adamw") for k in ("w", "one")}, {"lr": 1e-2}),
    "lamb": ({k: _SPEC("lamb") for k in ("w", "one")}, {"lr": 1e-2}),
    "mixed": (
        {"w": _SPEC("adamw"), "b": _SPEC("adamw", 32), "one": _SPEC("lion")},
        {"adamw": {"lr": 1e-2, "weight_decay": 0.1}, "lion": {"lr": 1e-3}},
    ),
}


@pytest.mark.parametrize("bad", (-math.inf, math.nan))
@pytest.mark.parametrize("case", sorted(NONFINITE_CASES))
def test_nonfinite_grad_as_torch_clips(device, case, bad, monkeypatch):
    """One inf or NaN grad element: our total is inf or NaN as torch's is, so the coefficient is 0 or NaN, and
    the step does what torch's clipping then the step does (the element's param kept and its state zeroed; with
    inf the other grads clipped to 0, with NaN every grad NaN): the same bits, pure and in place."""
    specs, hp = NONFINITE_CASES[case]
    params, grads, state = _setup(device, specs, hp)
    grads["w"][1, 2] = bad
    want = bnbf.update(params, compose.clip_grad_norm(grads, MAX)[0], state, hp, 2)
    folds = _record_folds(monkeypatch)
    _no_foreach_norm(monkeypatch)
    got = bnbf.update(params, grads, state, hp, 2, max_grad_norm=MAX)
    in_p, in_s = _clones(params, state)
    bnbf.update_(in_p, grads, in_s, hp, 2, max_grad_norm=MAX)
    for clip in folds:
        assert float(clip.value) == 0.0 if math.isinf(bad) else math.isnan(float(clip.value))
    assert len(folds) == 2
    _eq(got, want, f"{case}: grad element {bad}")
    _eq((in_p, in_s), want, f"{case}: grad element {bad}, in place")


# a float32 leaf beside float16 ones: one through the grads-only pass (AdamW), one through LARS's norm pass
MIXED_DTYPES = {
    "adamw": ({"w": _SPEC("adamw"), "b": _SPEC("adamw")}, {"lr": 1e-2}),
    "lars": ({"w": _SPEC("adamw"), "b": _SPEC("lars")}, {"adamw": {"lr": 1e-2}, "lars": {"lr": 0.1, "momentum": 0.9}}),
}


@pytest.mark.parametrize("overflow", (False, True), ids=("finite", "fp16 norm overflows"))
@pytest.mark.parametrize("case", sorted(MIXED_DTYPES))
def test_mixed_dtype_grads_take_each_norm_in_its_dtype(device, case, overflow, monkeypatch):
    """float32 and float16 grads in one call: torch.nn.utils.clip_grad_norm_ takes each grad's norm in the grad's
    dtype and the total of those (promoted to float32). A float16 grad whose norm passes 65504 has an inf norm, so
    torch's total is inf and every grad is zeroed: the step equals torch's clipping then the step, bit for bit (our
    total was finite and the grads were scaled to the limit). Finite, the total is within the folded bound of
    torch's (the float16 norm rounded to float16 before it joins). ``bnbf.updates`` then ``apply_updates`` give
    the same params (its total came from float32 copies of the float16 grads)."""
    specs, hp = MIXED_DTYPES[case]
    params, grads, state = _setup(device, specs, hp)
    params["b"], grads["b"] = params["b"].half(), grads["b"].half()
    state = {**state, "b": _random_state(compose.init_state({"b": params["b"]}, {"b": specs["b"]}, hp)["b"])}
    if overflow:
        grads["b"][:4] = 4e4  # ||g_b|| = 8e4 > 65504; the float32 total of the squares is finite
    clones = [torch.nn.Parameter(g.clone()) for g in grads.values()]
    for c, g in zip(clones, grads.values()):
        c.grad = g.clone()
    total = torch.nn.utils.clip_grad_norm_(clones, MAX)
    assert math.isinf(float(total)) == overflow
    want = bnbf.update(params, {k: c.grad for k, c in zip(grads, clones)}, state, hp, 2)
    # updates steps float32 copies: its total is torch's norms of the grads as given (torch._foreach_norm)
    u, u_state = bnbf.updates(params, grads, state, hp, 2, max_grad_norm=MAX)
    folds = _record_folds(monkeypatch)
    _no_foreach_norm(monkeypatch)
    got = bnbf.update(params, grads, state, hp, 2, max_grad_norm=MAX)
    in_p, in_s = _clones(params, state)
    bnbf.update_(in_p, grads, in_s, hp, 2, max_grad_norm=MAX)
    assert len(folds) == 2 and all(c.total.dtype == torch.float32 for c in folds)
    _eq((bnbf.apply_updates(params, u), u_state), got, f"{case}: apply_updates(updates(max_grad_norm=))")
    if overflow:
        assert all(math.isinf(float(c.total)) and float(c.value) == 0.0 for c in folds)
        _eq(got, want, f"{case}: a float16 norm past 65504")
        _eq((in_p, in_s), want, f"{case}: a float16 norm past 65504, in place")
    else:
        norms = [g.double().norm().to(g.dtype).double() for g in grads.values()]  # torch's, each in its dtype
        exact = float(torch.stack(norms).square().sum().sqrt())
        for c in folds:
            assert abs(float(c.total) / exact - 1) <= folded_total_rtol(256, torch.float32), (float(c.total), exact)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("rule, bits", (("adamw", 8), ("lamb", 32), ("lion", 8)))
def test_odd_sizes_skip_zeros_and_bf16(device, rule, bits, dtype, monkeypatch):
    """Odd sizes (1, 255, 257, 4097: 32-bit state below 256 elements) and a numel-0 leaf, a third of the grad
    elements exactly 0 with ``skip_zeros``: (a), and (b) bit for bit: float32 grads scaled by the coefficient
    then the step; bfloat16 grads: the float32 updates (``bnbf.updates``) of the float32 grads scaled by the
    coefficient in float32 (the step's product; a bf16 copy would round it). Zero grad elements keep their
    param."""
    sizes = {"a": (1,), "b": (255,), "c": (257,), "z": (0,), "d": (4097,)}
    if INTERP:
        sizes.pop("d")  # the interpreter's time; the reference pass and CUDA take it
    params = {k: (torch.randn(s) * 0.5).to(dtype).to(device) for k, s in sizes.items()}
    grads = {k: (torch.randn(s) * 0.2).to(dtype).to(device) for k, s in sizes.items()}
    for g in grads.values():
        g.view(-1)[::3] = 0.0
    hp = {"lr": 1e-2, "weight_decay": 0.1}
    state = {k: _random_state(s) for k, s in bnbf.init_state(params, _SPEC(rule, bits), hp).items()}
    folds = _record_folds(monkeypatch)
    _no_foreach_norm(monkeypatch)
    if dtype == torch.float32:
        got = bnbf.update(params, grads, state, hp, 2, max_grad_norm=MAX, skip_zeros=True)
    else:
        got = compose.updates(params, grads, state, hp, 2, max_grad_norm=MAX, skip_zeros=True)
    monkeypatch.undo()
    (clip,) = folds
    _assert_total_and_coef(clip, grads, MAX, f"{rule} {dtype}")
    assert float(clip.value) < 0.5
    if dtype == torch.float32:
        want = bnbf.update(params, _scaled(grads, clip.value), state, hp, 2, skip_zeros=True)
        for k, p in params.items():
            zero = grads[k] == 0
            assert torch.equal(got[0][k][zero], p[zero]), f"{k}: a zero grad element moved its param"
    else:
        p32 = {k: p.float() for k, p in params.items()}
        g32 = {k: g.float() * clip.value.float() for k, g in grads.items()}
        want = compose.updates(p32, g32, state, hp, 2, skip_zeros=True)
        for k in params:
            assert not bool(got[0][k][grads[k] == 0].any()), f"{k}: a zero grad element has an update"
        # compared as the step's float32 new values (u = new - p is exact, so p + u gives them back): a CUDA
        # kernel variant's contraction moves the new value by an ulp of it, which u shows at the params' scale
        got = ({k: p32[k] + u for k, u in got[0].items()}, got[1])
        want = ({k: p32[k] + u for k, u in want[0].items()}, want[1])
    _eq(got, want, f"{rule} {bits}-bit {dtype}: vs the grads scaled by its coefficient")


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (-1.0, ValueError, "Invalid max_grad_norm value: -1.0"),
        (math.nan, ValueError, "Invalid max_grad_norm value: nan"),
        (math.inf, ValueError, "Invalid max_grad_norm value: inf"),
        (1e39, ValueError, "Invalid max_grad_norm value: 1e\\+39"),
        (torch.tensor(-2.0), ValueError, "Invalid max_grad_norm value: -2.0"),
        (torch.tensor([1.0, 2.0]), ValueError, "Tensor max_grad_norm must be 1-element"),
        (torch.tensor(1), TypeError, "max_grad_norm must be a floating point tensor"),
        ("1.0", TypeError, "max_grad_norm must be a number or a 1-element tensor, got str"),
        (True, TypeError, "max_grad_norm must be a number or a 1-element tensor, got bool"),
    ],
)
def test_bad_max_grad_norm_raises_before_writing(device, bad, error, match):
    params, grads, state = _setup(device, {k: _SPEC("adamw") for k in ("w", "one")})
    snap = snapshot(params, grads, state)
    for fn in (bnbf.update, bnbf.update_, compose.updates):
        with pytest.raises(error, match=match):
            fn(params, grads, state, {"lr": 1e-2}, 2, max_grad_norm=bad)
    assert_untouched(snap)


def test_bad_grad_with_clipping_raises_before_writing(device):
    """The norm is taken before the core checks the grads; a wrong grad still raises the core's error with
    nothing written."""
    params, grads, state = _setup(device, {k: _SPEC("adamw") for k in ("w", "one")})
    grads["w"] = grads["w"].t()  # another shape
    snap = snapshot(params, grads, state)
    for fn in (bnbf.update, bnbf.update_):
        with pytest.raises(ValueError, match="shape"):
            fn(params, grads, state, {"lr": 1e-2}, 2, max_grad_norm=MAX)
    assert_untouched(snap)


def _gpt2_like(device):
    """GPT-2's 148 leaves (embeddings, 12 blocks of norms, attention and MLP, final norm), tiny."""
    d, shapes = 8, [("wte.weight", (64, 8)), ("wpe.weight", (16, 8))]
    for i in range(12):
        h = f"h.{i}."
        for name, shape in (("ln_1", (d,)), ("attn.c_attn", (d, 3 * d)), ("attn.c_proj", (d, d)), ("ln_2", (d,))):
            shapes += [(h + name + ".weight", shape), (h + name + ".bias", (shape[-1],))]
        for name, shape in (("mlp.c_fc", (d, 4 * d)), ("mlp.c_proj", (4 * d, d))):
            shapes += [(h + name + ".weight", shape), (h + name + ".bias", (shape[-1],))]
    shapes += [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
    params = {k: torch.randn(s, device=device) for k, s in shapes}
    return params, {k: torch.randn_like(p) for k, p in params.items()}


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """The aten ops a call runs that could launch a kernel (views and metadata queries excluded)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not (torch.Tag.view_copy in func.tags or func.is_view or func.overloadpacket.__name__ in _META):
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


_META = {"detach", "alias", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_contiguous"}


@pytest.mark.parametrize("tree", ("adamw", "mixed"))
def test_clipped_step_adds_only_the_norm_ops(device, tree, monkeypatch):
    """A clipped in-place step of a GPT-2-like tree (148 leaves; AdamW, or AdamW on matrices with Lion on the
    embeddings and no decay on 1-d leaves): per launch group, two launches before the unclipped step's (the
    grads' squares, their per-tensor sums) and one small op (the tensors' sums); then the total and the
    coefficient in a few small ops for the whole call (no ``torch._foreach_norm``, no op per tensor). The
    launches are counted, not run."""
    if not kernel_runs(device):
        pytest.skip("launch groups exist on the Triton path (TRITON_INTERPRET=1 or CUDA)")
    from bnbf.kernels import launcher

    params, grads = _gpt2_like(device)
    if tree == "adamw":
        state, hp = bnbf.init_state(params, bnbf.OptimSpec(rule="adamw", min_8bit_size=64)), {"lr": 1e-3}
    else:
        emb = lambda path: path.startswith(("wte", "wpe"))
        spec = lambda path, p: bnbf.OptimSpec(rule="lion" if emb(path) else "adamw", min_8bit_size=64)
        state = compose.init_state(params, spec)
        hp = lambda path, p: {"lr": 1e-4} if emb(path) else {"lr": 1e-3, "weight_decay": 0.1 * (p.ndim > 1)}
    launched = []
    monkeypatch.setattr(launcher, "launch", lambda compiled, device, key, *a: launched.append(key))
    counts = {}
    for max_grad_norm in (None, 1.0):
        bnbf.update_(params, grads, state, hp, 1, max_grad_norm=max_grad_norm)  # warm: plans built, tables uploaded
        launched.clear()
        with _Ops() as seen:
            bnbf.update_(params, grads, state, hp, 2, max_grad_norm=max_grad_norm)
        counts[max_grad_norm] = (list(launched), seen.ops)
    (plain_launches, plain_ops), (clip_launches, clip_ops) = counts[None], counts[1.0]
    groups = 2 if tree == "adamw" else 3
    assert len(plain_launches) == groups and len(clip_launches) == 3 * groups, (plain_launches, clip_launches)
    # every group's squares and sums first, then the steps (once the coefficient is known), in the group order
    assert clip_launches[: 2 * groups] == ["squares", "sums"] * groups
    step_keys = clip_launches[2 * groups :]
    assert [k[:-1] for k in step_keys] == [k[:-1] for k in plain_launches]  # the same variants ...
    assert all(k[-1] == 0 for k in plain_launches) and all(k[-1] == (2, torch.float32) for k in step_keys)  # CLIP 2
    extra = list(clip_ops)
    for op in plain_ops:
        extra.remove(op)
    per_group = ["sum"] * groups  # each group's per-tensor sums of its parts
    total = ["cat", "sum", "sqrt", "_to_copy", "add", "reciprocal", "mul", "clamp"]  # the total, the coefficient
    assert sorted(extra) == sorted(per_group + total), extra


@pytest.mark.gpu
@pytest.mark.parametrize("rule", ("lamb", "adamw"))
def test_clipped_step_does_not_synchronise(rule):
    params = {"w": torch.randn(4096, device="cuda"), "b": torch.randn(7, device="cuda")}
    grads = {k: torch.randn_like(p) for k, p in params.items()}
    state = bnbf.init_state(params, bnbf.OptimSpec(rule=rule))
    _clipped_steps_without_sync(params, grads, state, {"lr": 1e-3})


def _clipped_steps_without_sync(params, grads, state, hp):
    """Clipped pure and in-place steps, a number and a 0-d tensor limit, under CUDA's sync debug mode "error"
    after a warm-up (whose first builds may synchronise)."""
    for limit in (1.0, torch.tensor(0.5, device="cuda")):
        bnbf.update_(params, grads, state, hp, 1, max_grad_norm=limit)
        bnbf.update(params, grads, state, hp, 1, max_grad_norm=limit)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            bnbf.update_(params, grads, state, hp, 2, max_grad_norm=limit)
            bnbf.update(params, grads, state, hp, 2, max_grad_norm=limit)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.slow
def test_total_of_a_tensor_beyond_2_31_elements(monkeypatch):
    """The grads-only pass's offsets are int64: a bf16 grad of 2**31 + 300 elements (ones, and 64 in its last
    element, beyond element 2**31) beside a small one; the total within (a)'s bound of the exact one, and the
    coefficient within it of torch's (stateless SGD: 8 GB in all)."""
    n = 2**31 + 300
    params = {"big": torch.zeros(n, dtype=torch.bfloat16, device="cuda"), "small": torch.zeros(3, device="cuda")}
    params["small"] = params["small"].bfloat16()
    grads = {"big": torch.ones(n, dtype=torch.bfloat16, device="cuda"), "small": torch.full_like(params["small"], 2)}
    grads["big"][-1] = 64.0
    state = bnbf.init_state(params, bnbf.OptimSpec(rule="sgd", state_bits=32))
    folds = _record_folds(monkeypatch)
    _no_foreach_norm(monkeypatch)
    bnbf.update_(params, grads, state, {"lr": 1.0}, 1, max_grad_norm=1.0)
    monkeypatch.undo()
    (clip,) = folds
    exact = math.sqrt(n - 1 + 64.0**2 + 3 * 4.0)
    assert abs(float(clip.total) / exact - 1) <= folded_total_rtol(256, torch.bfloat16), (float(clip.total), exact)
    total_torch = torch.nn.utils.get_total_norm(list(grads.values()))
    c_torch = torch.clamp(1.0 / (total_torch + 1e-6), max=1.0)
    torch_err = abs(float(total_torch) / exact - 1)  # torch's bits: measured
    r = (
        folded_total_rtol(256, torch.bfloat16)
        + torch_err
        + FOLDED_COEF_EXTRA_ULPS * torch.finfo(torch.bfloat16).eps / 2
    )
    assert abs(float(clip.value) / float(c_torch) - 1) <= r
    assert float(params["big"][-1]) == -64.0 * float(clip.value)  # the last element stepped with it


# ------------------------------------------------------------------------------------------------
# clipping folded into LARS's own norm pass: an all-LARS call takes the total norm from it


U = 2.0**-24  # float32's unit roundoff
LARS_HP = {"lr": 0.5, "momentum": 0.9, "weight_decay": 0.1, "trust_coefficient": 0.02}
ODD = {"a": (1,), "b": (255,), "c": (257,), "d": (4097,)}  # 1 and 255 below min_8bit_size: 32-bit state


def _lars_tree(device, bits=8, zero_state=True, keys=tuple(ODD)):
    """Params and grads of the odd sizes, LARS states (8-bit where numel >= 256 with ``bits`` 8); from zero
    states (the first step: the update is local·d, which the float64 reference below writes out)."""
    params = {k: (torch.randn(ODD[k]) * 0.5).to(device) for k in keys}
    grads = {k: (torch.randn(ODD[k]) * 0.1).to(device) for k in keys}
    state = bnbf.init_state(params, _SPEC("lars", bits), LARS_HP)
    if not zero_state:
        state = {k: _random_state(s) for k, s in state.items()}
    return params, grads, state


def _lars64(params, grads, max_norm, hp=LARS_HP):
    """LARS's first step with clipped grads in float64, written from the paper (You et al., 2017) and
    torch.nn.utils.clip_grad_norm_'s formula: g ← g·min(1, max_norm / (||G|| + 1e-6)) over all grads G;
    d = g + wd·p, local = η‖p‖ / (‖g‖ + wd‖p‖ + ε) (1 where a norm is 0), the buffer local·d, p − lr·buffer."""
    coef = torch.clamp(float(max_norm) / (_total64(grads) + 1e-6), max=1.0)
    out = {}
    for k, p in params.items():
        p64, g64 = p.double(), grads[k].double() * coef
        pn, gn = p64.norm(), g64.norm()
        wd = hp["weight_decay"]
        local = hp["trust_coefficient"] * pn / (gn + wd * pn + 1e-8) if pn > 0 and gn > 0 else torch.tensor(1.0)
        out[k] = p64 - hp["lr"] * local * (g64 + wd * p64)
    return out


def _run_update(in_place, params, grads, state, hp, max_grad_norm, **opts):
    if in_place:
        p, s = _clones(params, state)
        bnbf.update_(p, grads, s, hp, 1, max_grad_norm=max_grad_norm, **opts)
        return p, s
    return bnbf.update(params, grads, state, hp, 1, max_grad_norm=max_grad_norm, **opts)


def _assert_fold_bounds(clip, total_torch, params, grads, got, want, what, hp=LARS_HP):
    """The folded clip's total within the folded sum's bound of the float64 total (tolerances.py), its
    coefficient within that plus torch's measured error of torch's coefficient, and each param within the
    step's sensitivity to those errors of ``want`` (the step of the clipped copies). Returns, per leaf, the
    bound on the difference of the update per unit of lr (local·d, the first step's momentum buffer)."""
    total64 = _total64(grads)
    assert float(total64) > 2 * MAX  # clipping is active
    bound = folded_total_ulps(256) * U  # the widest tile of these groups: 256 elements
    assert abs(float(clip.total.double()) / float(total64) - 1) <= bound, (what, float(clip.total), float(total64))
    torch_err = abs(float(total_torch.double()) / float(total64) - 1)  # torch's bits: measured, not bounded
    c_torch = torch.clamp(MAX / (total_torch + 1e-6), max=1.0).double()
    r_coef = bound + torch_err + FOLDED_COEF_EXTRA_ULPS * U
    assert abs(float(clip.value.double()) / float(c_torch) - 1) <= r_coef, (what, float(clip.value), float(c_torch))
    # ||c·g|| enters local: the fold's c²·Σg² and the clipped copies' Σ(c·g)² each within the bound of exact
    r = r_coef + 2 * bound
    wd, lr, eta = hp["weight_decay"], hp["lr"], hp["trust_coefficient"]
    slacks = {}
    for k, p in params.items():
        p0, g_c = p.double().cpu(), grads[k].double().cpu() * float(c_torch)
        local = eta * p0.norm() / (g_c[torch.isfinite(g_c)].norm() + wd * p0.norm() + 1e-8)
        a, b = g_c.abs(), wd * p0.abs()
        slacks[k] = float(local) * (r * (2 * a + b) + FOLDED_STEP_ROUNDINGS * U * (a + b))  # tolerances.py
        err = (got[k].double().cpu() - want[k].double().cpu()).abs()
        bar = lr * slacks[k] + 2 * half_ulp(p0, torch.float32).double()
        assert bool((err <= bar).all()), f"{what} {k}: {float((err - bar).max()):.3g} beyond the bound"
    return slacks


@pytest.mark.parametrize(
    "bits, limit, in_place", [(8, "number", False), (8, "tensor", True), (32, "number", True), (32, "tensor", False)]
)
def test_folded_lars_against_torch_and_float64(device, bits, limit, in_place, monkeypatch):
    """An all-LARS call (odd sizes, 8-bit and 32-bit leaves, two launch groups) clipped through the fold, with
    no ``torch._foreach_norm``: its total within the folded sum's bound of the float64 total, its coefficient
    within that plus torch's own measured error of torch's, the step within the coefficient's error of
    clipping first (``clip_grad_norm``, torch's bits) and stepping, and within float32's tolerance of LARS with
    clipping in float64."""
    params, grads, state = _lars_tree(device, bits)
    max_norm = MAX if limit == "number" else torch.tensor(MAX, device=device)
    clipped, total_torch = compose.clip_grad_norm(grads, max_norm)
    want, want_s = bnbf.update(params, clipped, state, LARS_HP, 1)
    folds = _record_folds(monkeypatch)
    _no_foreach_norm(monkeypatch)
    snap = snapshot(grads)
    got, got_s = _run_update(in_place, params, grads, state, LARS_HP, max_norm)
    assert_untouched(snap, "grad")
    (clip,) = folds
    slacks = _assert_fold_bounds(clip, total_torch, params, grads, got, want, f"{bits}-bit {limit}")
    p64 = _lars64(params, grads, MAX)
    t = STATE32[(torch.float32, 32)]
    for k, p in params.items():
        change = p64[k].cpu() - p.double().cpu()
        assert_close_report(got[k].double().cpu() - p.double().cpu(), change, t.atol, t.rtol, f"{k}: vs float64")
        assert float(change.abs().max()) > NOT_VACUOUS * t.atol  # the step is far larger than the tolerance
    for k in params:  # the new momentum buffers (local·d): within the bound above, 8-bit ones requantized
        a, b = got_s[k].momentum_buffer, want_s[k].momentum_buffer
        if a.dtype == torch.uint8:
            codes_differ(a, b, KERNEL_VS_REFERENCE_CODES, f"{k}: momentum_buffer codes")
        else:
            bar = slacks[k]
            err = (a.double().cpu() - b.double().cpu()).abs()
            assert bool((err <= bar).all()), f"{k}: momentum_buffer {float((err - bar).max()):.3g} beyond the bound"


def test_folded_lars_options(device, monkeypatch):
    """skip_zeros (zero grad elements leave their param), maximize, and non-zero 8-bit states through the fold,
    against clipping first, within the same bounds."""
    params, grads, state = _lars_tree(device, 8, zero_state=False, keys=("a", "c"))
    for g in grads.values():
        g.view(-1)[::3] = 0.0
    clipped, total_torch = compose.clip_grad_norm(grads, MAX)
    for opts in ({"skip_zeros": True}, {"maximize": True}):
        want, _ = bnbf.update(params, clipped, state, LARS_HP, 1, **opts)
        folds = _record_folds(monkeypatch)
        _no_foreach_norm(monkeypatch)
        got, _ = bnbf.update(params, grads, state, LARS_HP, 1, max_grad_norm=MAX, **opts)
        monkeypatch.undo()
        (clip,) = folds
        _assert_fold_bounds(clip, total_torch, params, grads, got, want, str(opts))
        if "skip_zeros" in opts:
            for k, p in params.items():
                zero = grads[k] == 0
                assert torch.equal(got[k][zero], p[zero]), f"{k}: a zero grad element moved its param"


@pytest.mark.parametrize("bad", (-math.inf, math.nan))
def test_folded_nonfinite_grad_as_torch_clips(device, bad, monkeypatch):
    """One inf or NaN grad element: the fold's total is inf or NaN as torch's is, so the coefficient is 0 or
    NaN, and the step does what clipping first and stepping does (the element's param kept and its state
    zeroed; with inf the other grads clipped to 0, with NaN every grad NaN): the same bits."""
    params, grads, state = _lars_tree(device, 8, zero_state=False, keys=("a", "c"))
    grads["c"][7] = bad
    want = bnbf.update(params, compose.clip_grad_norm(grads, MAX)[0], state, LARS_HP, 1)
    folds = _record_folds(monkeypatch)
    _no_foreach_norm(monkeypatch)
    got = bnbf.update(params, grads, state, LARS_HP, 1, max_grad_norm=MAX)
    (clip,) = folds
    assert float(clip.value) == 0.0 if math.isinf(bad) else math.isnan(float(clip.value))
    _eq(got, want, f"grad element {bad}")


def test_no_foreach_norm_for_any_rule(device, monkeypatch):
    """torch._foreach_norm is not called for a LARS, LAMB, AdamW, or LARS beside AdamW call (pure, in place,
    ``updates``, 0-d tensor limit), whose results are the unclipped step on the grads scaled by the call's
    coefficient. Where a distributed reduction sums the norms across shards (bnbf.distributed sets it) the
    total stays torch's (``torch._foreach_norm``), and the step is then clipping first's, bit for bit."""
    from bnbf._dispatch import NORM_REDUCE

    params, grads, state = _lars_tree(device, 8)
    small = {k: v for k, v in params.items() if k in ("a", "b")}
    sg, ss = {k: grads[k] for k in small}, {k: state[k] for k in small}
    mixed = compose.init_state(small, {"a": _SPEC("adamw"), "b": _SPEC("lars")}, {"b": LARS_HP, "a": {}})
    calls = [
        (ss, LARS_HP),
        (bnbf.init_state(small, _SPEC("lamb")), {"lr": 1e-2}),
        (bnbf.init_state(small, _SPEC("adamw")), {"lr": 1e-2}),
        (mixed, {"adamw": {"lr": 1e-2}, "lars": LARS_HP}),
    ]
    for st, hp in calls:
        folds = _record_folds(monkeypatch)
        _no_foreach_norm(monkeypatch)
        got = bnbf.update(small, sg, st, hp, 1, max_grad_norm=MAX)
        p_, s_ = _clones(small, st)
        bnbf.update_(p_, sg, s_, hp, 1, max_grad_norm=torch.tensor(MAX, device=device))
        compose.updates(small, sg, st, hp, 1, max_grad_norm=MAX)
        monkeypatch.undo()
        assert len(folds) == 3
        if st is not ss and st is not mixed:  # (LARS's clipped norms come from its own sums: bounded above)
            _eq(got, bnbf.update(small, _scaled(sg, folds[0].value), st, hp, 1), f"{hp}: vs its coefficient")
    calls = []
    real = torch._foreach_norm
    monkeypatch.setattr(torch, "_foreach_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    st = bnbf.init_state(small, _SPEC("adamw"))
    token = NORM_REDUCE.set(lambda sums: None)  # a reduction over one shard: the sums as they are
    try:
        got = bnbf.update(small, sg, st, {"lr": 1e-2}, 1, max_grad_norm=MAX)
    finally:
        NORM_REDUCE.reset(token)
    assert calls, "a distributed call: no torch._foreach_norm"
    _eq(got, bnbf.update(small, compose.clip_grad_norm(sg, MAX)[0], st, {"lr": 1e-2}, 1), "distributed: clip first")


@pytest.mark.parametrize("rule", ("lars", "adamw", "lamb"))
def test_fold_arithmetic_reference_equals_interpreter(rule, monkeypatch):
    """The reference path and the kernels (under the interpreter) do the same arithmetic after the squares (LARS
    in its norm pass, AdamW and LAMB in the grads-only pass): with grads whose squares add exactly in any order
    (multiples of 1/16 below 1: every partial sum fits float32), the totals and the coefficients have the same
    bits, and so do LARS's steps (32-bit state)."""
    if not kernel_runs("cpu"):
        pytest.skip("compares the interpreter with the reference path: TRITON_INTERPRET=1")
    import bnbf.ops

    keys = tuple(ODD) if rule == "lars" else ("a", "b", "c")  # (the interpreter's time)
    params = {k: torch.randint(-16, 17, ODD[k]) / 16.0 for k in keys}
    grads = {k: torch.randint(-15, 16, ODD[k]) / 16.0 for k in keys}
    hp = LARS_HP if rule == "lars" else {"lr": 1e-2, "weight_decay": 0.1}
    state = bnbf.init_state(params, _SPEC(rule, 32), hp)
    folds = _record_folds(monkeypatch)
    kernel = bnbf.update(params, grads, state, hp, 1, max_grad_norm=MAX)
    monkeypatch.setattr(bnbf.ops, "use_triton", lambda t: False)
    ref = bnbf.update(params, grads, state, hp, 1, max_grad_norm=MAX)
    k_clip, r_clip = folds
    assert_equal_report(k_clip.total, r_clip.total, "total norm")
    assert_equal_report(k_clip.value, r_clip.value, "coefficient")
    assert float(k_clip.value) < 0.5
    if rule == "lars":  # (the other rules' kernels and references round their math differently: not compared)
        _eq(kernel, ref, "interpreter vs reference")


def test_rule_fold_declaration_is_checked():
    """``norm_grad_powers`` is validated at registration: only with norms, a pair of non-negative ints."""
    import dataclasses

    from bnbf.rules import RULES
    from bnbf.rules.base import validate_rule

    lars = RULES["lars"]
    validate_rule(lars)
    with pytest.raises(ValueError, match="norm_grad_powers needs norms"):
        validate_rule(dataclasses.replace(RULES["sgd"], norm_grad_powers=(0, 2)))
    for bad in ((0, 2, 2), (0, -2), (0, 2.0), [0, 2]):
        with pytest.raises(TypeError, match="norm_grad_powers must be a pair"):
            validate_rule(dataclasses.replace(lars, norm_grad_powers=bad))


@pytest.mark.gpu
def test_folded_step_does_not_synchronise(monkeypatch):
    params = {"w": torch.randn(4096, device="cuda"), "b": torch.randn(7, device="cuda")}
    grads = {k: torch.randn_like(p) for k, p in params.items()}
    state = bnbf.init_state(params, bnbf.OptimSpec(rule="lars"), LARS_HP)
    _no_foreach_norm(monkeypatch)
    _clipped_steps_without_sync(params, grads, state, LARS_HP)


def test_clipped_subnormal_grads_keep_their_value(device, monkeypatch):
    """A clipped grad element whose product is subnormal is the float32 product torch's clipped copy holds, not
    zero (libdevice's mul_rn, as Triton links it, flushed subnormals to zero on CUDA)."""
    g = torch.tensor([3.0, 4.0] + [1e-39, -3e-40, 4e-44, 5e-39] * 64, device=device)
    params = {"w": torch.zeros_like(g)}
    state = bnbf.init_state(params, bnbf.OptimSpec(rule="sgd", state_bits=32))
    folds = _record_folds(monkeypatch)
    new_p, _ = bnbf.update(params, {"w": g}, state, {"lr": 1.0}, 1, max_grad_norm=1.0)
    monkeypatch.undo()
    (clip,) = folds
    assert float(clip.total) == 5.0  # the subnormals' squares are 0 in float32
    want = params["w"] - g * clip.value
    assert (want[2:] != 0).all() and (want[2:].abs() < torch.finfo(torch.float32).tiny).all()  # subnormal
    assert_equal_report(new_p["w"], want, "SGD on clipped subnormal grads vs torch's clipped products")

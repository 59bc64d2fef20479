"""bnbf.compose (issue 13): updates in float32, gradient clipping, schedules, mixed rules in one call.

- ``updates``/``apply_updates``: the fused step's states and params bit for bit, and the update itself
  against a float64 AdamW written from torch's documented algorithm (bf16 params, where ``new_p - p`` is 0);
- ``clip_grad_norm``: ``torch.nn.utils.clip_grad_norm_`` bit for bit (fp32/fp16/bf16, norms 2, 1, inf) and the
  total norm against float64;
- schedules: each callable evaluated once per call, the same bits as the values it returns;
- mixed trees: every hparams form, mixed rules/bits/formats/block sizes, equal to separate ``bnbf.update``
  calls bit for bit (pure and in place), one core call per (rule, hyperparameters) and one kernel launch per
  (device, dtype, layout) within it, and errors raised before anything is written.

Under ``TRITON_INTERPRET=1`` the same tests run the Triton kernels (fewer launches: small trees).
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from conftest import DEVICES, assert_untouched, snapshot
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerances import assert_equal_report, assert_trees_same_variant
from torch.utils._pytree import tree_leaves, tree_map

import bnbf
from bnbf import compose
from bnbf._dispatch import interpreting

INTERP = interpreting()
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _tree(device, dtype=torch.float32, away_from_zero=False):
    """Odd sizes; ``away_from_zero``: magnitudes in [0.5, 1.5] so that a small step keeps every new value within a
    factor 2 of the old (then ``new - p`` is exact in float32, Sterbenz)."""
    shapes = {"w": (64, 65), "b": (257,), "one": (1,), "odd": (255,)}
    out = {}
    for k, shape in shapes.items():
        x = torch.randn(shape)
        if away_from_zero:
            x = torch.sign(x) * (0.5 + torch.rand(shape))
        out[k] = x.to(dtype).to(device)
    return out


def _grads(params):
    return {k: (torch.randn(p.shape) * 0.1).to(p.dtype).to(p.device) for k, p in params.items()}


def _eq_tree(a, b, what):
    assert type(a) is type(b) and (not isinstance(a, dict) or list(a) == list(b)), what
    for x, y in zip(torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)):
        assert_equal_report(x, y, what)


# ---- 1. updates ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES if not INTERP else (torch.bfloat16,))
def test_updates_equal_the_fused_step(device, dtype):
    params = _tree(device, dtype, away_from_zero=True)
    grads = _grads(params)
    spec = lambda path, p: bnbf.OptimSpec(rule="lion" if path == "b" else "adamw", min_8bit_size=256)
    state = compose.init_state(params, spec)
    hp = {"adamw": {"lr": 1e-3, "weight_decay": 0.1}, "lion": {"lr": 1e-4}}
    snap = snapshot(params, grads, state)
    new_p, new_s = compose.update(params, grads, state, hp, 3)
    u, s2 = compose.updates(params, grads, state, hp, 3)
    assert_untouched(snap)
    assert all(t.dtype == torch.float32 for t in u.values())
    _eq_tree(s2, new_s, "updates' state vs update's")
    _eq_tree(compose.apply_updates(params, u), new_p, "apply_updates(updates) vs update")
    in_place = {k: p.clone() for k, p in params.items()}
    assert compose.apply_updates_(in_place, u) is in_place
    _eq_tree(in_place, new_p, "apply_updates_ vs update")
    if dtype == torch.float32:  # the update is the float32 difference itself
        _eq_tree(u, {k: new_p[k] - params[k] for k in params}, "updates vs new - p")


def test_updates_keep_what_bf16_rounds_away(device):
    """bf16 params near 1, lr 1e-4: ``new_p - p`` in bf16 is 0 everywhere, the float32 update is AdamW's step
    (float64, from torch.optim.AdamW's documented algorithm) to float32's resolution at |p|."""
    lr, wd, b1, b2, eps = 1e-4, 0.01, 0.9, 0.999, 1e-8
    p = (1 + 0.01 * torch.rand(4097)).bfloat16().to(device)
    g = torch.randn(4097).bfloat16().to(device)
    state = compose.init_state(p, bnbf.OptimSpec(rule="adamw", state_bits=32))
    hp = {"lr": lr, "weight_decay": wd, "betas": (b1, b2), "eps": eps}
    new_p, _ = compose.update(p, g, state, hp, 1)
    assert torch.equal(new_p, p)  # the update is lost in the param dtype
    u, _ = compose.updates(p, g, state, hp, 1)
    p64, g64 = p.double().cpu(), g.double().cpu()
    m, v = (1 - b1) * g64, (1 - b2) * g64 * g64
    expected = -lr * wd * p64 - lr / (1 - b1) * m / (v.sqrt() / math.sqrt(1 - b2) + eps)
    err = (u.double().cpu() - expected).abs()
    bound = 2 * torch.finfo(torch.float32).eps * p64.abs()  # two float32 ulps at |p|: the new value's rounding
    assert (expected.abs() > 1e-5).all()  # not vacuous: a real step
    assert (err <= bound).all(), f"worst {float((err / bound).max()):.2f} x the bound"


def test_updates_and_apply_errors_modify_nothing():
    params = _tree("cpu", torch.bfloat16)
    state = compose.init_state(params, bnbf.OptimSpec(rule="sgd", state_bits=32))
    grads = _grads(params)
    grads["b"] = grads["b"].float()
    snap = snapshot(params, grads, state)
    with pytest.raises(TypeError, match=r"grad\['b'\] has dtype torch.float32 but the param has dtype torch.bfloat16"):
        compose.updates(params, grads, state, {"lr": 0.1}, 1)
    u = {k: torch.zeros(p.shape) for k, p in params.items()}
    u["odd"] = torch.zeros(254)
    with pytest.raises(ValueError, match=r"updates\['odd'\] has shape \(254,\)"):
        compose.apply_updates_(params, u)
    with pytest.raises(ValueError, match="updates structure"):
        compose.apply_updates(params, [u["w"]])
    assert_untouched(snap)


@pytest.mark.surface
def test_apply_updates_in_place_checks_everything_before_writing():
    """apply_updates_ wrote param after param, so a param listed twice took the update twice,
    overlapping views took both on the shared part, and a bad leaf raised with the earlier params written.
    Now each is refused before anything is written, aliasing in update_'s own words."""
    first, base = torch.zeros(4), torch.zeros(6)
    snap = snapshot(first, base)
    ones = torch.ones(4)
    with pytest.raises(ValueError, match=r"param\[1\] and param\[2\] are the same tensor") as twice:
        compose.apply_updates_([first, base, base], [ones, torch.ones(6), torch.ones(6)])
    views = {"x": first, "a": base[:4], "b": base[2:]}
    with pytest.raises(ValueError, match=r"param\['a'\] and param\['b'\] overlap in memory") as overlap:
        compose.apply_updates_(views, {k: ones for k in views})
    # update_ refuses the same trees with the same words
    for tree, err in (([first, base, base], twice), (views, overlap)):
        state = bnbf.init_state(tree, bnbf.OptimSpec(rule="sgd", state_bits=32))
        with pytest.raises(ValueError) as core:
            bnbf.update_(tree, torch.utils._pytree.tree_map(torch.ones_like, tree), state, {"lr": 0.1}, 1)
        assert str(core.value) == str(err.value)
    # torch's add_ raised after param[0]; the advice names the out-of-place twin of the call that raised
    with pytest.raises(ValueError, match=r"param\[1\] has a zero stride.*or use bnbf.apply_updates$"):
        compose.apply_updates_([first, torch.zeros(1).expand(4)], [ones, ones])
    with pytest.raises(ValueError, match=r"param\['c'\]\[0\] and param\['d'\]\['e'\] overlap in memory"):
        compose.apply_updates_({"c": [base[:4]], "d": {"e": base[3:5]}}, {"c": [ones], "d": {"e": ones[:2]}})
    with torch.inference_mode():
        made_there = torch.zeros(4)
    with pytest.raises(RuntimeError, match=r"param\[1\] was made under torch.inference_mode\(\)"):
        compose.apply_updates_([first, made_there], [ones, ones])
    with pytest.raises(TypeError, match=r"param\[1\] must be a dense \(strided\) tensor, got layout torch.sparse_coo"):
        compose.apply_updates_([first, torch.zeros(4).to_sparse()], [ones, ones])
    # an update that is another param: b took a + its update or a's old value, by the order of the keys
    for order in (("a", "b"), ("b", "a")):
        tree = {k: (first if k == "a" else base[:4]) for k in order}
        with pytest.raises(ValueError, match=r"update\['b'\] shares memory with param\['a'\], which apply_updates_"):
            compose.apply_updates_(tree, {k: (first if k == "b" else ones) for k in order})
    assert_untouched(snap)


def test_apply_updates_in_place_takes_what_does_not_alias():
    """What shares no written memory is applied, as torch's ``p + u``: one update for two params, an update that
    is its own param, an expanded update, interleaved strided params (no element in common), empty leaves."""
    u, w, p = torch.randn(5), torch.randn(5, 2), torch.randn(5)
    params = [torch.randn(5), torch.randn(5), p, w[:, 0], w[:, 1], torch.randn(5), torch.zeros(0)]
    updates = [u, u, p, torch.randn(5), torch.randn(5), torch.randn(1).expand(5), torch.zeros(0)]
    want = [x + y for x, y in zip(params, updates)]
    assert compose.apply_updates_(params, updates) is params
    for i, (got, ref) in enumerate(zip(params, want)):
        assert_equal_report(got, ref, f"param {i} vs torch's p + u")


# ---- 2. clipping ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_type", (2.0, 1.0, math.inf))
@pytest.mark.parametrize("max_norm", (0.5, 1e4))  # clips, and leaves the grads (times a factor of 1)
def test_clip_grad_norm_equals_torch(device, dtype, norm_type, max_norm):
    grads = {k: g * 3 for k, g in _grads(_tree(device, dtype)).items()}
    grads["spike"] = torch.tensor([0.0, -7.0, 2.0], dtype=dtype, device=device)
    ts = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads.values()]
    for t, g in zip(ts, grads.values()):
        t.grad = g.clone()
    expected_norm = torch.nn.utils.clip_grad_norm_(ts, max_norm, norm_type)
    snap = snapshot(grads)
    clipped, total = compose.clip_grad_norm(grads, max_norm, norm_type)
    assert_untouched(snap)
    assert_equal_report(total, expected_norm, "total norm vs torch")
    for t, c in zip(ts, clipped.values()):
        assert_equal_report(c, t.grad, "clipped grad vs torch")
    # in place: the same bits
    in_place = {k: g.clone() for k, g in grads.items()}
    assert_equal_report(compose.clip_grad_norm_(in_place, max_norm, norm_type), expected_norm, "in-place norm")
    _eq_tree(in_place, clipped, "in place vs pure")
    if dtype == torch.float32:  # and the norm itself against float64
        flat = torch.cat([g.double().reshape(-1) for g in grads.values()])
        want = flat.abs().max() if norm_type == math.inf else flat.abs().pow(norm_type).sum() ** (1 / norm_type)
        assert abs(float(total) - float(want)) <= 1e-6 * float(want)
        if max_norm < float(want):
            got = torch.cat([c.double().reshape(-1) for c in clipped.values()])
            n = got.abs().max() if norm_type == math.inf else got.abs().pow(norm_type).sum() ** (1 / norm_type)
            assert abs(float(n) - max_norm) <= 1e-5 * max_norm


def test_clip_grad_norm_of_mixed_dtypes_equals_torch_bit_for_bit(device):
    """Grads of three dtypes: the per-group norms are stacked in the order torch's clip groups them (its grouping
    function's order, not the grads' first appearance), so the total and the clipped grads are torch's bits (in
    the order of first appearance the total differed from torch's in its last bit); pure and in place."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(300, generator=gen)
    a[0] = 1e5
    grads = {
        "a": a.to(device),
        "h": torch.randn(300, generator=gen).half().to(device),
        "b": torch.randn(300, generator=gen).bfloat16().to(device),
    }
    ts = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads.values()]
    for t, g in zip(ts, grads.values()):
        t.grad = g.clone()
    expected = torch.nn.utils.clip_grad_norm_(ts, 1.0)
    clipped, total = compose.clip_grad_norm(grads, 1.0)
    assert_equal_report(total, expected, "total norm vs torch")
    for t, c in zip(ts, clipped.values()):
        assert_equal_report(c, t.grad, "clipped grad vs torch")
    in_place = {k: g.clone() for k, g in grads.items()}
    assert_equal_report(compose.clip_grad_norm_(in_place, 1.0), expected, "in-place norm")
    _eq_tree(in_place, clipped, "in place vs pure")


def test_clip_grad_norm_nonfinite():
    grads = [torch.tensor([1.0, math.inf])]
    with pytest.raises(RuntimeError, match="non-finite"):
        compose.clip_grad_norm(grads, 1.0, error_if_nonfinite=True)
    ts = [torch.nn.Parameter(torch.zeros(2))]
    ts[0].grad = grads[0].clone()
    expected = torch.nn.utils.clip_grad_norm_(ts, 1.0)
    clipped, total = compose.clip_grad_norm(grads, 1.0)
    assert_equal_report(total, expected, "inf norm")
    assert_equal_report(clipped[0], ts[0].grad, "grads scaled by an inf norm, as torch")


# ---- 3. schedules ----------------------------------------------------------------------------------------


def test_schedules_evaluated_once_per_call(device):
    params = _tree(device)
    grads = _grads(params)
    calls = []

    def lr(step):
        calls.append(step)
        return 1e-3 * min(1.0, step / 10)

    no_decay = lambda path, p: {"lr": lr, "weight_decay": 0.0 if p.ndim == 1 else 0.1}
    state = compose.init_state(params, bnbf.OptimSpec(rule="adamw", state_bits=32))
    got, _ = compose.update(params, grads, state, no_decay, 4)
    assert calls == [4]  # four leaves, two groups: one evaluation
    plain = lambda path, p: {"lr": 4e-4, "weight_decay": 0.0 if p.ndim == 1 else 0.1}
    want, _ = compose.update(params, grads, state, plain, 4)
    _eq_tree(got, want, "scheduled vs plain lr")
    calls.clear()
    got, _ = compose.update(params, grads, state, {"lr": lr, "betas": (lambda s: 0.9, 0.999)}, 4)
    want, _ = bnbf.update(params, grads, state, {"lr": 4e-4, "betas": (0.9, 0.999)}, 4)
    assert calls == [4]
    _eq_tree(got, want, "schedule in a shared mapping")


def test_a_scheduled_mapping_of_one_rule_is_the_cores_call(device, monkeypatch):
    """One mapping with a schedule for one rule's leaves (a warmup on lr), pure and in place: the core's call on this
    step's values, with no split (its records of a loop serve; host times in
    benchmarks/results/2026-12-06_cpu_session49.md), bit for bit the core's call with the values given; a schedule's
    bad value gets the core's error, nothing written."""
    params = _tree(device)
    state = compose.init_state(params, bnbf.OptimSpec(rule="adamw", min_8bit_size=1))
    splits = _count_splits(monkeypatch)
    warmup = lambda step: 1e-2 * min(1.0, step / 3)
    p, s = params, state
    in_p, in_s = tree_map(torch.clone, (params, state))
    want_p, want_s = tree_map(torch.clone, (params, state))
    for t in range(1, 5):
        grads = _grads(params)
        hp = {"lr": warmup, "betas": (0.9, lambda step: 0.99), "weight_decay": 0.1}
        p, s = compose.update(p, grads, s, hp, t)
        compose.update_(in_p, grads, in_s, hp, t)
        values = {"lr": 1e-2 * min(1.0, t / 3), "betas": (0.9, 0.99), "weight_decay": 0.1}
        want_p, want_s = bnbf.update(want_p, grads, want_s, values, t)
        for got in ((p, s), (in_p, in_s)):
            _eq_tree(got[0], want_p, f"step {t}: params")
            _eq_tree(got[1], want_s, f"step {t}: states")
    assert not splits
    snap = snapshot(in_p, in_s)
    with pytest.raises(ValueError, match=re.escape("Invalid learning rate: -0.001")):
        compose.update_(in_p, grads, in_s, {"lr": lambda step: -1e-3}, 5)
    assert_untouched(snap)


def test_schedule_of_a_tensor_step():
    """A schedule written with tensor ops gets the 0-d step tensor and returns a 0-d tensor: the core takes it
    as a runtime value (on a GPU, not read: tests/test_compose.py::test_schedule_no_sync_cuda)."""
    p = torch.randn(300)
    state = compose.init_state(p, bnbf.OptimSpec(rule="adamw", state_bits=32))
    warmup = lambda step: 1e-2 * torch.clamp(step / 10, max=1.0)
    got, _ = compose.update(p, p * 0.1, state, {"lr": warmup}, torch.tensor(5))
    want, _ = bnbf.update(p, p * 0.1, state, {"lr": torch.tensor(5e-3)}, torch.tensor(5))
    assert_equal_report(got, want, "tensor schedule")
    assert compose.resolve_hparams({"adamw": {"lr": warmup}}, torch.tensor(20))["adamw"]["lr"] == torch.tensor(1e-2)


@pytest.mark.gpu
def test_schedule_no_sync_cuda():
    params = {"w": torch.randn(4096, device="cuda"), "b": torch.randn(7, device="cuda")}
    grads = {k: torch.randn_like(p) for k, p in params.items()}
    spec = lambda path, p: bnbf.OptimSpec(rule="lion" if path == "b" else "adamw")
    state = compose.init_state(params, spec)
    step = torch.tensor(3, device="cuda")
    hp = {"adamw": {"lr": lambda s: 1e-3 * torch.clamp(s / 10, max=1.0)}, "lion": {"lr": lambda s: 1e-4 / s}}
    compose.update_(params, grads, state, hp, step)  # warm: first-time builds may synchronise
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        compose.update_(params, grads, state, hp, step)
        compose.clip_grad_norm(grads, 1.0)
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ---- 4. mixed rules in one call --------------------------------------------------------------------------------


def _mixed(device):
    """Four leaves, three rules, both 8-bit formats, a block size of 128 and 32-bit state, three dtypes."""
    params = {
        "0.weight": torch.randn(40, 110).to(device),
        "0.bias": torch.randn(257).to(device),
        "emb.weight": torch.randn(33, 130).bfloat16().to(device),
        "norm.weight": torch.randn(255).half().to(device),
    }
    specs = {
        "0.weight": bnbf.OptimSpec(rule="adamw", min_8bit_size=256, block_size=128),
        "0.bias": bnbf.OptimSpec(rule="adamw", state_bits=32),
        "emb.weight": bnbf.OptimSpec(rule="lion", min_8bit_size=256, state_format="dynamic"),
        "norm.weight": bnbf.OptimSpec(rule="sgd", state_bits=32),
    }
    hp = {
        "adamw": {"lr": 1e-2, "weight_decay": 0.1},
        "lion": {"lr": 1e-3, "weight_decay": 0.5},
        "sgd": {"lr": 0.1, "momentum": 0.9},
    }
    return params, specs, hp


def test_init_state_forms(device):
    params, specs, hp = _mixed(device)
    by_callable = compose.init_state(params, lambda path, p: specs[path], hp)
    by_tree = compose.init_state(params, specs, hp)
    for k, p in params.items():
        want = bnbf.init_state(p, specs[k], hp[specs[k].rule])
        for got in (by_callable[k], by_tree[k]):
            assert type(got) is type(want)
            _eq_tree(list(got), list(want), f"state {k}")
    # a prefix: one spec for a whole subtree
    nested = {"enc": {"w": params["0.weight"], "b": params["0.bias"]}, "emb": params["emb.weight"]}
    st = compose.init_state(nested, {"enc": specs["0.bias"], "emb": specs["emb.weight"]})
    assert type(st["enc"]["w"]).layout.bits == 32 and type(st["emb"]).layout.rule == "lion"
    seen = []
    compose.init_state(nested, lambda path, p: seen.append(path) or specs["0.bias"])
    assert seen == ["enc.w", "enc.b", "emb"]  # functional_call's names, in the dicts' order
    with pytest.raises(ValueError, match="has entries that match no param: \\['dec'\\]"):
        compose.init_state(nested, {"enc": specs["0.bias"], "emb": specs["0.bias"], "dec": specs["0.bias"]})
    with pytest.raises(ValueError, match="has no entry for param 'emb'"):
        compose.init_state(nested, {"enc": specs["0.bias"]})
    with pytest.raises(TypeError, match="not an OptimSpec"):
        compose.init_state(nested, lambda path, p: "adamw")


def _separate(params, grads, state, hp_of, step, **kw):
    """Each leaf stepped by its own bnbf.update call: the oracle for the mixed calls."""
    out_p, out_s = {}, {}
    for k in params:
        out_p[k], out_s[k] = bnbf.update(params[k], grads[k], state[k], hp_of(k), step, **kw)
    return out_p, out_s


def _separate_(params, grads, state, hp_of, step, **kw):
    """Each leaf of copies stepped by its own bnbf.update_ call: the in-place oracle. On CUDA the in-place call
    passes numbers as kernel arguments and the pure one a row of them: two kernel variants, which the compiler
    may contract into FMAs differently (tests/tolerances.py, CONTRACTION_ULPS), so each call has its own twin."""
    out_p = {k: p.clone() for k, p in params.items()}
    out_s = {k: type(s)(*(t.clone() for t in s)) for k, s in state.items()}
    for k in params:
        bnbf.update_(out_p[k], grads[k], out_s[k], hp_of(k), step, **kw)
    return out_p, out_s


# the three forms differ only in the host's partition: the reference pass runs each, the interpreter one
@pytest.mark.parametrize("form", ("by_rule", "callable", "tree") if not INTERP else ("callable",))
def test_mixed_update_equals_separate_calls(device, form, monkeypatch):
    params, specs, hp = _mixed(device)
    grads = _grads(params)
    state = compose.init_state(params, specs, hp)
    # per-leaf: no decay for 1-d leaves (biases, norms), the rest by rule
    leaf_hp = {k: dict(hp[specs[k].rule], **({"weight_decay": 0.0} if p.ndim == 1 else {})) for k, p in params.items()}
    hparams = {
        "by_rule": hp,
        "callable": lambda path, p: leaf_hp[path],
        "tree": leaf_hp,
    }[form]
    want_hp = (lambda k: hp[specs[k].rule]) if form == "by_rule" else leaf_hp.__getitem__
    want_p, want_s = _separate(params, grads, state, want_hp, 2)

    core_calls, launches = [], []
    real_update, real_step = bnbf.update, bnbf.ops.step
    monkeypatch.setattr(bnbf, "update", lambda *a, **k: core_calls.append(1) or real_update(*a, **k))
    monkeypatch.setattr(bnbf.ops, "step", lambda *a, **k: launches.append(a[4]) or real_step(*a, **k))
    snap = snapshot(params, grads, state)
    got_p, got_s = compose.update(params, grads, state, hparams, 2)
    assert_untouched(snap)
    monkeypatch.undo()
    assert_trees_same_variant(got_p, want_p, "mixed update's params vs separate calls")
    assert_trees_same_variant(got_s, want_s, "mixed update's states vs separate calls")
    # one core call per (rule, hyperparameters) on the reference path: adamw's two leaves share theirs only
    # "by_rule"; on the Triton path a rule's leaves share one launch per layout whatever their hyperparameters,
    # with no core call (adamw's two sets here, and the rules of one set)
    if bnbf._dispatch.use_triton(params["0.weight"]):
        assert len(core_calls) == 0
    else:
        assert len(core_calls) == (3 if form == "by_rule" else 4)
    assert len(launches) == 4 and len(set(launches)) == 4  # one per (device, dtype, layout): 4 layouts here

    # in place, through bnbf.update_ (plans): the same bits
    in_p = {k: p.clone() for k, p in params.items()}
    in_s = {k: type(s)(*(t.clone() for t in s)) for k, s in state.items()}
    out = compose.update_(in_p, grads, in_s, hparams, 2)
    assert out[0] is in_p and out[1] is in_s
    assert_trees_same_variant(in_p, want_p, "mixed update_'s params")
    assert_trees_same_variant(in_s, want_s, "mixed update_'s states")


def _count_launches(monkeypatch):
    """The launch groups run (one kernel launch each, three for a rule with norms), on every path to the
    launcher: the plans' in-place steps and the pure call's."""
    import sys

    from bnbf.kernels import launcher

    seen = []
    real = launcher.launch_group

    def counted(group, *a, **k):
        seen.append((group.layout, group.dtype, group.table.shape[0]))
        return real(group, *a, **k)

    monkeypatch.setattr(launcher, "launch_group", counted)
    monkeypatch.setattr(sys.modules["bnbf.plan"], "launch_group", counted)
    return seen


def test_per_leaf_hparams_share_one_launch(device, monkeypatch):
    """Issue 13: three hyperparameter sets of AdamW (default, no decay, an lr multiplier given as a 0-d tensor)
    over leaves of one layout, and two sets of LAMB (norm pass with per-tensor scalars): one launch group per
    rule on the Triton path, bit for bit the separate calls, pure and in place (two steps: the plan's cached
    rows, other values at the second step without a new kernel)."""
    torch.manual_seed(3)
    shapes = {"w": (20, 15), "b": (257,), "one": (1,), "odd": (255,), "l.w": (9, 31), "l.b": (257,)}
    params = {k: torch.randn(s).to(device) for k, s in shapes.items()}
    specs = {k: bnbf.OptimSpec(rule="lamb" if k.startswith("l.") else "adamw", min_8bit_size=1) for k in params}
    state = compose.init_state(params, specs)
    in_p = {k: p.clone() for k, p in params.items()}
    in_s = {k: type(s)(*(t.clone() for t in s)) for k, s in state.items()}
    triton = bnbf._dispatch.use_triton(params["w"])
    for step in (1, 2):
        lr = 1e-2 / step  # other values at step 2: no other kernel (LAUNCH_KEYS)
        leaf_hp = {
            "w": {"lr": lr, "weight_decay": 0.1},
            "b": {"lr": lr, "weight_decay": 0.0},
            "one": {"lr": torch.tensor(0.3 * lr, device=device), "weight_decay": 0.1},
            "odd": {"lr": lr, "weight_decay": 0.1},
            "l.w": {"lr": lr, "weight_decay": 0.01},
            "l.b": {"lr": 2 * lr, "weight_decay": 0.0},
        }
        keys = set(bnbf.kernels.launcher.LAUNCH_KEYS)
        grads = _grads(params)
        want_p, want_s = _separate(params, grads, state, leaf_hp.__getitem__, step)
        seen = _count_launches(monkeypatch)
        got_p, got_s = compose.update(params, grads, state, leaf_hp, step)
        compose.update_(in_p, grads, in_s, leaf_hp, step)
        monkeypatch.undo()
        if triton:  # pure then in place: one launch group per rule each (every leaf of a rule in one table)
            assert [n for *_, n in seen] == [4, 2, 4, 2]
            if step > 1:
                assert set(bnbf.kernels.launcher.LAUNCH_KEYS) == keys, "new hyperparameter values compiled a kernel"
        assert_trees_same_variant(got_p, want_p, f"step {step}: params vs separate calls")
        assert_trees_same_variant(got_s, want_s, f"step {step}: states vs separate calls")
        assert_trees_same_variant(in_p, want_p, f"step {step}: in-place params vs separate calls")
        assert_trees_same_variant(in_s, want_s, f"step {step}: in-place states vs separate calls")
        params, state = want_p, want_s


_RULE_HP = {"adamw": {"lr": 1e-2}, "lion": {"lr": 1e-3}, "sgd": {"lr": 0.1, "momentum": 0.5}}


# the interpreter runs a few: leaves of one rule with other hyperparameters share a launch there
@settings(max_examples=3 if INTERP else 10)
@given(
    leaves=st.lists(
        st.tuples(
            st.sampled_from(sorted(_RULE_HP)),
            st.sampled_from((8, 32)),
            st.sampled_from((1, 255, 257, 300)),
            st.sampled_from((torch.float32, torch.bfloat16)),
            st.sampled_from((0.0, 0.1)),  # weight decay, shared or not between leaves
        ),
        min_size=1,
        max_size=6,
    )
)
def test_any_partition_equals_separate_calls(leaves):
    """Random trees of rules, bits, sizes, dtypes and per-leaf weight decay: the mixed call (one core call per
    (rule, hyperparameters) on the reference path, one launch per rule and layout on the Triton path) returns
    what each leaf's own call returns, bit for bit."""
    params = {f"l{i}": torch.randn(n).to(dt) for i, (_, _, n, dt, _) in enumerate(leaves)}
    specs = {f"l{i}": bnbf.OptimSpec(rule=r, state_bits=b, min_8bit_size=200) for i, (r, b, *_) in enumerate(leaves)}
    leaf_hp = {f"l{i}": dict(_RULE_HP[r], weight_decay=wd) for i, (r, _, _, _, wd) in enumerate(leaves)}
    state = compose.init_state(params, specs, leaf_hp)
    grads = _grads(params)
    got = compose.update(params, grads, state, leaf_hp, 3)
    want = _separate(params, grads, state, leaf_hp.__getitem__, 3)
    _eq_tree(got[0], want[0], "params")
    _eq_tree(got[1], want[1], "states")


def test_one_rule_tree_goes_straight_to_the_core(monkeypatch):
    params = _tree("cpu")
    state = compose.init_state(params, bnbf.OptimSpec(rule="adamw", state_bits=32))
    seen = []
    real = bnbf.update
    monkeypatch.setattr(bnbf, "update", lambda p, *a, **k: seen.append(p) or real(p, *a, **k))
    compose.update(params, _grads(params), state, {"lr": 1e-3}, 1)
    assert len(seen) == 1 and seen[0] is params  # the caller's own tree: the core's fast path and error names


def _nested_mixed(device):
    params = {
        "enc": {"w": torch.randn(300).to(device), "b": torch.randn(7).to(device)},
        "head": [torch.randn(5, 5).to(device), torch.randn(1).to(device)],
    }
    specs = {"enc": bnbf.OptimSpec(rule="adamw", min_8bit_size=256), "head": bnbf.OptimSpec(rule="lion")}
    return params, specs


def test_nested_mixed_tree_with_one_mapping_equals_its_subtrees(device):
    """A nested tree of two rules with one flat mapping looked like one rule to compose (it read
    only the top dict's values), which sent it to the core, whose MixedRulesError sent it back: RecursionError.
    Each subtree is now stepped with its rule and the mapping, bit for bit its own call, pure and in place."""
    tree_map = torch.utils._pytree.tree_map
    params, specs = _nested_mixed(device)
    grads = tree_map(lambda p: torch.randn_like(p) * 0.1, params)
    state = compose.init_state(params, specs)
    hp = {"lr": 1e-3, "weight_decay": 0.1}  # both rules take these
    want = {k: bnbf.update(params[k], grads[k], state[k], hp, 2) for k in params}
    want_p, want_s = {k: w[0] for k, w in want.items()}, {k: w[1] for k, w in want.items()}
    snap = snapshot(params, grads, state)
    for fn in (bnbf.update, compose.update):  # the core hands the tree to compose
        got_p, got_s = fn(params, grads, state, hp, 2)
        _eq_tree(got_p, want_p, f"{fn.__module__}.update: params vs each subtree's own call")
        _eq_tree(got_s, want_s, f"{fn.__module__}.update: states vs each subtree's own call")
    assert_untouched(snap)
    u, got_s = compose.updates(params, grads, state, hp, 2)
    _eq_tree(got_s, want_s, "updates' states")
    for fn in (bnbf.update_, compose.update_):
        in_p, in_s = tree_map(torch.clone, params), tree_map(torch.clone, state)
        assert fn(in_p, grads, in_s, hp, 2) == (in_p, in_s)
        _eq_tree(in_p, want_p, f"{fn.__module__}.update_: params")
        _eq_tree(in_s, want_s, f"{fn.__module__}.update_: states")


_A32 = bnbf.OptimSpec(rule="adamw", state_bits=32)
_LION, _SGD = bnbf.OptimSpec(rule="lion", state_bits=32), bnbf.OptimSpec(rule="sgd", state_bits=32)
# (params, spec prefix) of other shapes: nested lists and tuples, dicts several levels deep, a top dict holding a
# leaf beside a subtree, one leaf
_SHAPES = {
    "lists": (lambda r: [[r(3), r(2)], [r(4)]], [[_A32, _LION], _SGD]),
    "tuples": (lambda r: (r(3), (r(2), [r(4)])), (_A32, (_LION, _SGD))),
    "deep dicts": (
        lambda r: {"a": {"b": {"c": {"d": r(3)}}, "e": (r(2),)}, "f": r(4)},
        {"a": {"b": _A32, "e": _SGD}, "f": _LION},
    ),
    "leaf beside a subtree": (lambda r: {"x": r(3), "y": {"z": r(2)}}, {"x": _A32, "y": _LION}),
    "one leaf": (lambda r: r(3), _A32),
}


@pytest.mark.parametrize("shape", list(_SHAPES))
def test_mixed_trees_of_any_shape_with_one_mapping(shape):
    """Whatever the nesting, a tree of mixed rules with one mapping steps (no RecursionError), each leaf as its
    own call bit for bit, pure and in place."""
    tree_map, leaves_of = torch.utils._pytree.tree_map, torch.utils._pytree.tree_leaves
    states_of = lambda t: leaves_of(t, is_leaf=bnbf.state.is_state)
    make, spec = _SHAPES[shape]
    params = make(lambda n: torch.randn(n))
    grads = tree_map(torch.randn_like, params)
    state = compose.init_state(params, spec)
    want = [bnbf.update(*leaf, {"lr": 1e-2}, 1) for leaf in zip(leaves_of(params), leaves_of(grads), states_of(state))]
    in_p, in_s = tree_map(torch.clone, params), tree_map(torch.clone, state)
    for fn, (got_p, got_s) in (
        ("update", bnbf.update(params, grads, state, {"lr": 1e-2}, 1)),
        ("update_", bnbf.update_(in_p, grads, in_s, {"lr": 1e-2}, 1)),
    ):
        for k, (p, s) in enumerate(zip(leaves_of(got_p), states_of(got_s))):
            _eq_tree(p, want[k][0], f"{fn}: param {k} vs its own call")
            _eq_tree(list(s), list(want[k][1]), f"{fn}: state {k} vs its own call")


def test_mixed_errors_raise_before_writing(device):
    params, specs, hp = _mixed(device)
    state = compose.init_state(params, specs, hp)
    grads = _grads(params)
    snap = snapshot(params, grads, state)
    with pytest.raises(ValueError, match=r"no entry for rule\(s\) \['sgd'\]"):
        compose.update_(params, grads, state, {"adamw": hp["adamw"], "lion": hp["lion"]}, 1)
    with pytest.raises(ValueError, match="Invalid learning rate: -1"):  # the last group's, found first
        compose.update_(params, grads, state, dict(hp, sgd={"lr": -1.0, "momentum": 0.9}), 1)
    bad = dict(grads, **{"norm.weight": grads["norm.weight"].float()})  # the last group's grad
    with pytest.raises(TypeError, match=r"grad\['norm.weight'\] has dtype torch.float32"):
        compose.update_(params, bad, state, hp, 1)
    bad_state = dict(state, **{"norm.weight": bnbf.init_state(torch.zeros(3), specs["norm.weight"], hp["sgd"])})
    with pytest.raises(ValueError, match="does not fit the param"):
        compose.update_(params, grads, bad_state, hp, 1)
    lamb = dict(specs, **{"norm.weight": bnbf.OptimSpec(rule="lamb", state_bits=32)})
    lamb_state = compose.init_state(params, lamb, dict(hp, lamb={}))
    with pytest.raises(ValueError, match="max_unorm does not combine with lamb"):
        compose.update_(params, grads, lamb_state, dict(hp, lamb={}), 1, max_unorm=0.1)
    # two groups sharing memory: a param that is a view of another group's
    shared = dict(params, **{"0.bias": params["0.weight"].reshape(-1)[:257]})
    shared_state = compose.init_state(shared, specs, hp)
    with pytest.raises(ValueError, match="overlap in memory"):
        compose.update_(shared, _grads(shared), shared_state, hp, 1)
    # the last group's param with autograd history: a gradient asked through a step that is not differentiable
    last = "norm.weight"
    tracked = dict(params, **{last: params[last].detach().requires_grad_() * 1.0})
    with pytest.raises(RuntimeError, match=r"param\['norm.weight'\] takes part in a gradient computation"):
        compose.update_(tracked, grads, state, hp, 1)
    assert_untouched(snap)
    with pytest.raises(ValueError, match="hparams has entries that match no param"):
        compose.update(params, grads, state, {k: {} for k in [*params, "extra"]}, 1)


def test_overlap_between_groups_is_refused():
    """A view shared by two groups is refused before anything is written, also when the overlapping spans are
    not neighbours in address order (a long span of one group covering a short one of another); on the Triton
    path too, where each rule's leaves have a plan of their own (nothing is launched: it raises first)."""
    big = torch.zeros(2000)
    params = {"a": big[0:1000], "c": big[1000:1010], "b": big[500:510], "d": torch.zeros(7)}
    spec = {k: bnbf.OptimSpec(rule="lion" if k == "b" else "sgd", state_bits=32) for k in params}
    state = compose.init_state(params, spec)
    grads = {k: torch.ones_like(p) for k, p in params.items()}
    snap = snapshot(params, state)
    with pytest.raises(ValueError, match=r"param\['a'\] and param\['b'\] overlap in memory"):
        compose.update_(params, grads, state, {"sgd": {"lr": 0.1}, "lion": {"lr": 0.1}}, 1)
    assert_untouched(snap)


def _two_groups(device, route):
    """Three leaves, ``a`` in one group and ``b``, ``c`` in another: by rule (``mixed``: AdamW with 8-bit state, SGD)
    or by per-leaf hyperparameters of one rule (``per_leaf``); and each leaf's own mapping."""
    params = {k: torch.randn(n).to(device) for k, n in (("a", 300), ("b", 257), ("c", 300))}
    sgd, momentum = bnbf.OptimSpec(rule="sgd", state_bits=32), {"lr": 1.0, "momentum": 0.9}
    if route == "mixed":
        spec = {"a": bnbf.OptimSpec(rule="adamw", min_8bit_size=256), "b": sgd, "c": sgd}
        hp = {"adamw": {"lr": 0.1}, "sgd": momentum}
        of = {"a": hp["adamw"], "b": momentum, "c": momentum}
    else:
        spec, hp = sgd, {"a": {"lr": 0.1, "momentum": 0.9}, "b": momentum, "c": momentum}
        of = hp
    return params, compose.init_state(params, spec, hp), hp, of


@pytest.mark.parametrize("route", ["mixed", "per_leaf"])
def test_grad_sharing_another_groups_leaf_is_refused_in_place(device, route):
    """The groups of an in-place call step one after another, so a grad sharing memory with another group's param
    or state would be read after that group wrote it: refused before anything is written, in the words of the core
    (which refuses it within one call), on a first call and on one whose checks, plans and partition are kept
    (grads that moved since). A grad that is its own param, or one grad read by two groups, steps as the pure
    update does."""
    params, state, hp, _ = _two_groups(device, route)
    good = _grads(params)
    for grads, where in (
        (dict(good, c=params["a"]), r"grad\['c'\] shares memory with param\['a'\]"),
        (dict(good, a=state["c"].momentum_buffer), r"grad\['a'\] shares memory with state\['c'\].momentum_buffer"),
    ):
        for step in (1, 3):  # a first call; then, after two good ones, with everything kept
            snap = snapshot(params, state)
            with pytest.raises(ValueError, match=where + ", which this in-place step writes"):
                compose.update_(params, grads, state, hp, step)
            assert_untouched(snap)
            for k in range(2):
                compose.update_(params, good, state, hp, step + k)
    for grads in (dict(good, c=params["c"]), dict(good, c=good["a"])):  # its own param; a grad read twice
        want = compose.update(params, {k: g.clone() for k, g in grads.items()}, state, hp, 5)
        compose.update_(params, grads, state, hp, 5)
        assert_trees_same_variant((params, state), want, f"{route}: update_ vs update")  # (bit for bit off CUDA)


@pytest.mark.parametrize("route", ["mixed", "per_leaf"])
def test_leaf_shared_between_groups_is_refused_by_the_pure_update(device, route):
    """The pure update of several groups: a param listed twice, one state for two leaves, or views of one tensor
    in different groups are refused as the core refuses them within one call (the same tensor would come back with
    two new values); views whose elements interleave without touching step, as in the core."""
    params, state, hp, of = _two_groups(device, route)
    grads = _grads(params)
    snap = snapshot(params, grads, state)
    with pytest.raises(ValueError, match=r"param\['a'\] and param\['c'\] are the same tensor: a param may appear"):
        compose.update(dict(params, c=params["a"]), grads, state, hp, 1)
    # "b" and "c" apart by their hyperparameters only (one rule, one state class)
    split = lambda path, p: dict(of[path], lr=0.5) if path == "c" else of[path]
    twin = dict(params, c=params["b"].clone()), dict(grads, c=grads["b"]), dict(state, c=state["b"])
    with pytest.raises(ValueError, match=r"state\['b'\] and state\['c'\] are the same state: each param needs"):
        compose.update(*twin, split, 1)
    big = torch.randn(400, device=device)
    with pytest.raises(ValueError, match=r"param\['a'\] and param\['c'\] overlap in memory \(views of one"):
        compose.update(dict(params, a=big[:300], c=big[100:]), grads, state, hp, 1)
    assert_untouched(snap)
    w = torch.randn(300, 2, device=device)
    apart = dict(params, a=w[:, 0], c=w[:, 1])  # interleaved, no element shared
    got = compose.update(apart, grads, state, hp, 1)
    for k, p in apart.items():
        want = bnbf.update(p, grads[k], state[k], of[k], 1)
        assert_trees_same_variant((got[0][k], got[1][k]), want, f"{route}: {k} vs its own call")


def test_checks_are_kept_weakly_and_redone_when_a_tensor_changes():
    import gc
    import weakref

    params, specs, hp = _mixed("cpu")
    state = compose.init_state(params, specs, hp)
    grads = _grads(params)
    compose.update_(params, grads, state, hp, 1)  # checked, and the checks kept
    # the last group's state field given other memory, or its param resized, in place (the same objects): the
    # next call checks again and raises before any group is written
    buf = state["norm.weight"].momentum_buffer
    saved = buf.clone()
    buf.set_(torch.zeros(3))
    snap = snapshot(params, state)
    with pytest.raises(ValueError, match="does not fit the param"):
        compose.update_(params, grads, state, hp, 2)
    assert_untouched(snap)
    buf.set_(saved)
    compose.update_(params, grads, state, hp, 2)  # fits again
    params["norm.weight"].resize_(254)
    snap = snapshot(params, state)
    with pytest.raises(ValueError, match=r"grad\['norm.weight'\] has shape \(255,\)"):
        compose.update_(params, grads, state, hp, 3)
    grads["norm.weight"] = grads["norm.weight"][:254].clone()
    with pytest.raises(ValueError, match="does not fit the param"):
        compose.update_(params, grads, state, hp, 3)
    assert_untouched(snap)
    ref = weakref.ref(params["0.weight"])
    del params, state, grads, snap
    gc.collect()
    assert ref() is None  # the kept checks hold no tensor


def test_max_grad_norm_option(device, monkeypatch):
    """A mixed tree clipped inside the step: bit for bit the step on the grads times the call's coefficient
    (its total is our pass's, not torch's: tests/test_clip_fused.py compares the two)."""
    from bnbf.reference import GradClip

    params, specs, hp = _mixed(device)
    params = {k: p.float() for k, p in params.items()}
    grads = _grads(params)
    state = compose.init_state(params, specs, hp)
    seen, real = [], GradClip.finish
    monkeypatch.setattr(GradClip, "finish", lambda self: (self.folding and seen.append(self), real(self)))
    got = compose.update(params, grads, state, hp, 1, max_grad_norm=0.05)
    monkeypatch.undo()
    (clip,) = seen
    assert clip.value < 1  # the limit clips
    want = compose.update(params, {k: g * clip.value for k, g in grads.items()}, state, hp, 1)
    _eq_tree(got, want, "max_grad_norm= vs the grads scaled by its coefficient, then update")


@pytest.mark.skipif("cpu" not in DEVICES or INTERP, reason="host-side cost of the split, reference path")
def test_forms_are_recognised():
    assert compose.is_shared_hparams(None) and compose.is_shared_hparams({"lr": 1e-3, "betas": (0.9, 0.99)})
    assert not compose.is_shared_hparams({"adamw": {"lr": 1e-3}})
    assert not compose.is_shared_hparams({"lr": lambda s: 1e-3})
    assert not compose.is_shared_hparams({"betas": (lambda s: 0.9, 0.99)})
    assert not compose.is_shared_hparams(lambda path, p: {})
    assert compose.resolve_hparams({"lr": 1e-3}, 1) == {"lr": 1e-3}


# ---- 5. the in-place call's partition, kept between calls -----------------------------------------------------


def _count_splits(monkeypatch) -> list:
    splits = []
    real_split = compose._split
    monkeypatch.setattr(compose, "_split", lambda *a: splits.append(1) or real_split(*a))
    return splits


def _kept_check(params: dict, state: dict, spec, splits: list):
    """``check(step, want_splits, hparams)``: ``compose.update_`` with ``hparams`` (a callable, by param name or by
    rule) splits the call ``want_splits`` times and equals the separate calls bit for bit."""

    def check(step, want_splits, hparams):
        grads = _grads(params)
        if callable(hparams):
            of = lambda k: hparams(k, params[k])
        else:  # by param name or by rule
            of = hparams.__getitem__ if set(hparams) == set(params) else lambda k: hparams[spec(k, params[k]).rule]
        want = _separate(params, grads, state, of, step)
        splits.clear()
        compose.update_(params, grads, state, hparams, step)
        assert len(splits) == want_splits, f"step {step}: {len(splits)} splits, expected {want_splits}"
        assert_trees_same_variant(params, want[0], f"step {step}: params")
        assert_trees_same_variant(state, want[1], f"step {step}: states")

    return check


def test_partition_is_kept_and_redone_on_any_difference(device, monkeypatch):
    """``update_`` on flat dicts with the callable or by-rule form: a call with the same leaves and the same
    hyperparameter objects holding the same values reuses the last call's split (no walk of the leaves), bit for
    bit the separate calls; a value changed in place, another object or a bad grad is seen."""
    if not bnbf._dispatch.use_triton(torch.zeros(1, device=device)):
        pytest.skip("the kept partition serves the plans' route (Triton path)")
    params = {"w": torch.randn(20, 15).to(device), "b": torch.randn(257).to(device), "e": torch.randn(9, 7).to(device)}
    spec = lambda path, p: bnbf.OptimSpec(rule="lion" if path == "e" else "adamw", min_8bit_size=1)
    decay, no_decay, lion = {"lr": 1e-2, "weight_decay": 0.1}, {"lr": 1e-2, "weight_decay": 0.0}, {"lr": 1e-3}
    hp = lambda path, p: lion if path == "e" else decay if p.ndim > 1 else no_decay
    by_rule = {"adamw": decay, "lion": lion}
    state = compose.init_state(params, spec)
    splits = _count_splits(monkeypatch)

    check = _kept_check(params, state, spec, splits)
    check(1, 1, hp)  # split, the partition kept
    check(2, 0, hp)  # the kept partition
    decay["lr"] = 5e-3  # a value changed in place: split again
    check(3, 1, hp)
    check(4, 0, lambda k, p: hp(k, p))  # another callable returning the same objects
    check(5, 1, by_rule)  # another form
    check(6, 0, by_rule)
    check(7, 0, {"adamw": dict(decay), "lion": lion})  # another object of the same numbers: kept
    check(7, 1, {"adamw": {**decay, "lr": 4e-3}, "lion": lion})  # another value
    tree = {k: hp(k, p) for k, p in params.items()}  # by param name: kept as the callable form is
    check(8, 1, tree)
    check(9, 0, tree)
    no_decay["weight_decay"] = -0.0  # equal to 0.0, but another value: split again
    check(10, 1, tree)
    check(11, 1, dict(reversed(tree.items())))  # another order: the general walk, not kept
    check(12, 1, dict(reversed(tree.items())))
    grads = _grads(params)
    grads["w"] = grads["w"].t()  # a bad grad on the kept path: the plan's error, nothing written
    snap = snapshot(params, state)
    with pytest.raises(ValueError, match=r"grad\['w'\] has shape"):
        compose.update_(params, grads, state, by_rule, 13)
    assert_untouched(snap)


def test_partition_is_kept_for_new_dicts_of_the_same_numbers(device, monkeypatch):
    """A callable (or a tree by param name) that builds new dicts every call, the usual ``lambda path, p:
    {"weight_decay": ...}``, finds the kept partition while each leaf's numbers are those of the call that made it
    (each new dict was a miss: the whole split every call; host times in
    benchmarks/results/2026-12-06_cpu_session49.md); a number of another type or sign, another betas, a key order, or
    a schedule in the dicts splits again. Each call bit for bit the separate calls."""
    if not bnbf._dispatch.use_triton(torch.zeros(1, device=device)):
        pytest.skip("the kept partition serves the plans' route (Triton path)")
    params = {"w": torch.randn(20, 15).to(device), "b": torch.randn(257).to(device), "e": torch.randn(9, 7).to(device)}
    spec = lambda path, p: bnbf.OptimSpec(rule="lion" if path == "e" else "adamw", min_8bit_size=1)
    state = compose.init_state(params, spec)
    splits = _count_splits(monkeypatch)

    def made(wd=0.0, betas=(0.9, 0.99), lr=1e-2):  # a callable whose every answer is a new dict
        def hp(path, p):
            if path == "e":
                return {"lr": 1e-3, "betas": betas}
            return {"lr": lr, "weight_decay": 0.1 if p.ndim > 1 else wd}

        return hp

    check = _kept_check(params, state, spec, splits)

    check(1, 1, made())
    check(2, 0, made())  # another callable, new dicts, the same numbers
    check(3, 0, made())
    check(4, 1, made(wd=-0.0))  # == 0.0, another value
    check(5, 1, made(wd=0))  # an int: another type
    check(6, 1, made(betas=(0.9, 0.98)))  # Lion's betas
    check(7, 0, made(betas=(0.9, 0.98)))
    check(8, 1, made(lr=lambda s: 1e-2))  # a schedule: not kept (the partition would hold it)
    check(9, 1, made(lr=lambda s: 1e-2))
    check(10, 1, lambda path, p: dict(reversed(made()(path, p).items())))  # another key order
    check(11, 1, {k: made()(k, p) for k, p in params.items()})  # by param name
    check(12, 0, {k: made()(k, p) for k, p in params.items()})


def test_kept_partition_refuses_what_the_split_refuses_and_holds_no_tensor(device, monkeypatch):
    """max_unorm with a rule that has its own norms raises on the kept path as on the split; the kept partition
    keeps no tensor alive. Launches stubbed: only the host's path is under test."""
    import gc
    import sys
    import weakref

    if not bnbf._dispatch.use_triton(torch.zeros(1, device=device)):
        pytest.skip("the kept partition serves the plans' route (Triton path)")
    monkeypatch.setattr(sys.modules["bnbf.plan"], "launch_group", lambda *a, **k: None)
    params = {"w": torch.randn(20, 15).to(device), "l": torch.randn(257).to(device)}
    spec = lambda path, p: bnbf.OptimSpec(rule="lamb" if path == "l" else "adamw")
    state = compose.init_state(params, spec)
    grads = _grads(params)
    hp = {"adamw": {"lr": 1e-2}, "lamb": {"lr": 1e-3}}
    splits = _count_splits(monkeypatch)
    for step in (1, 2):
        compose.update_(params, grads, state, hp, step)
    assert len(splits) == 1
    with pytest.raises(ValueError, match="max_unorm does not combine with lamb"):
        compose.update_(params, grads, state, hp, 3, max_unorm=0.5)
    assert len(splits) == 1  # refused on the kept path
    refs = [weakref.ref(t) for t in (*params.values(), *grads.values(), *state["w"])]
    del params, state, grads
    gc.collect()
    assert all(r() is None for r in refs)


def test_kept_scalar_rows_follow_every_value(device, monkeypatch):
    """Per-leaf hyperparameter sets take a row of scalars per tensor, uploaded once per device for all of a
    rule's groups (here 8-bit and 32-bit AdamW states: two groups) and kept by the plan with the float32 bits
    they were made from: the same call again uploads nothing, and an lr changed in place (within one step or
    with a new one) is seen at once; each call bit for bit the separate calls."""
    import sys

    torch.manual_seed(5)
    shapes = {"w": (20, 15), "b": (257,), "one": (1,), "odd": (255,), "e": (9, 7)}
    params = {k: torch.randn(s).to(device) for k, s in shapes.items()}
    spec = lambda path, p: bnbf.OptimSpec(rule="lion" if path == "e" else "adamw", min_8bit_size=256)
    decay, no_decay, lion = {"lr": 1e-2, "weight_decay": 0.1}, {"lr": 1e-2, "weight_decay": 0.0}, {"lr": 1e-3}
    hp = lambda path, p: lion if path == "e" else decay if p.ndim > 1 or path == "odd" else no_decay
    state = compose.init_state(params, spec)
    plan_mod = sys.modules["bnbf.plan"]
    uploads = []
    real = plan_mod._picked
    monkeypatch.setattr(plan_mod, "_picked", lambda t, i, d: uploads.append((len(i), t.shape[1])) or real(t, i, d))
    triton = bnbf._dispatch.use_triton(params["w"])

    def check(step, change, want_uploads):
        change()
        grads = _grads(params)
        want = _separate(params, grads, state, lambda k: hp(k, params[k]), step)
        uploads.clear()
        compose.update_(params, grads, state, hp, step)
        assert_trees_same_variant(params, want[0], f"step {step}: params")
        assert_trees_same_variant(state, want[1], f"step {step}: states")
        if triton:  # adamw's four leaves, each group from a 16-byte aligned row: one copy per device
            assert len(uploads) == want_uploads, f"step {step}: {uploads}"
            assert all(n >= 4 for n, _ in uploads)

    check(1, lambda: None, 1)
    check(1, lambda: None, 0)  # the same values again: the kept rows
    check(1, lambda: decay.update(lr=5e-3), 1)  # a value changed in place within the step
    check(2, lambda: None, 1)  # a new step: new bias corrections and seed
    check(2, lambda: no_decay.update(lr=2e-2), 1)
    check(3, lambda: lion.update(lr=2e-3), 1)  # lion's own set (kernel arguments) changed, adamw's rows new too
    if not triton:
        return
    # the key is the float32 bits: -0.0 is not 0.0, and a row's value is never stale
    plan = bnbf.plan({k: params[k] for k in ("w", "b")}, {k: state[k] for k in ("w", "b")})
    v0, v1 = (0.5, 0.0, 1.0), (0.25, 0.0, 1.0)
    first = plan._set_rows((0, 1), [v0, v1])
    assert plan._set_rows((0, 1), [v0, v1]) is first
    neg = plan._set_rows((0, 1), [v0, (0.25, -0.0, 1.0)])
    assert neg is not first and torch.signbit(neg[0][1, 1]) and not torch.signbit(first[0][1, 1])
    assert plan._set_rows((1, 0), [v0, v1])[0].tolist() == [list(v1), list(v0)]


def test_sets_are_keyed_by_exact_values(device, monkeypatch):
    """Hyperparameter values that ``==`` conflates are separate sets: weight decay 0.0 and -0.0 (SGD's
    ``g + wd * p`` keeps a -0.0 grad's sign in the momentum buffer only with -0.0), dampening 0.0 and -0.0. Each leaf
    as its own call, bit for bit (the sign of every zero included), pure and in place; on the in-place path a
    value changed in place from 0.0 to -0.0 is a new partition."""
    params = {k: (0.5 + torch.rand(n)).to(device) for k, n in (("a", 257), ("b", 255), ("c", 1), ("d", 300))}
    grads = {k: torch.where(torch.rand(p.shape, device=device) < 0.5, -0.0, 0.1) for k, p in params.items()}
    base = {"lr": 0.1, "momentum": 0.9}
    leaf_hp = {
        "a": dict(base, weight_decay=0.0),
        "b": dict(base, weight_decay=-0.0),
        "c": dict(base, nesterov=True),
        "d": dict(base, dampening=-0.0),
    }
    hp = lambda path, p: leaf_hp[path]
    state = compose.init_state(params, bnbf.OptimSpec(rule="sgd", state_bits=32), hp)
    assert len(compose._split(params, grads, state, hp, 1).groups) == 4
    want_p, want_s = _separate(params, grads, state, leaf_hp.__getitem__, 1)
    negative = grads["a"] == 0  # the -0.0 grads: the buffer's zeros are -0.0 with wd -0.0 only
    assert not torch.signbit(want_s["a"].momentum_buffer[negative]).any()
    assert torch.signbit(want_s["b"].momentum_buffer[grads["b"] == 0]).all()
    got_p, got_s = compose.update(params, grads, state, hp, 1)
    _eq_tree(got_p, want_p, "params")
    _eq_tree(got_s, want_s, "states")
    in_p = {k: p.clone() for k, p in params.items()}
    in_s = {k: type(s)(*(t.clone() for t in s)) for k, s in state.items()}
    compose.update_(in_p, grads, in_s, hp, 1)
    _eq_tree(in_p, want_p, "in-place params")
    _eq_tree(in_s, want_s, "in-place states")
    # step 2 twice: the partition is kept, then a value changed in place to -0.0 is seen (a split again)
    splits = _count_splits(monkeypatch)
    for change, want_splits in ((lambda: None, 0), (lambda: leaf_hp["a"].update(weight_decay=-0.0), 1)):
        change()
        want = _separate(in_p, grads, in_s, leaf_hp.__getitem__, 2)
        splits.clear()
        compose.update_(in_p, grads, in_s, hp, 2)
        _eq_tree(in_p, want[0], "in-place params, step 2")
        _eq_tree(in_s, want[1], "in-place states, step 2")
        if bnbf._dispatch.use_triton(in_p["a"]):  # the kept partition serves the plans' route only
            assert len(splits) == want_splits


def test_groups_of_one_set_take_the_sets_scalars(device, monkeypatch):
    """bench_func's mixed partition in small: decay on the matrices (8-bit states), none on the 1-d leaves (32-bit
    states: below min_8bit_size), Lion on the embedding. Each launch group's tensors then take one set, so each
    launch takes that set's scalars as its own call would (kernel arguments, pure and in place): no
    rows of scalars are made; bit for bit the separate calls, pure and in place, over two steps."""
    import sys

    torch.manual_seed(7)
    shapes = {"wte": (20, 64), "h.w": (32, 40), "h.b": (40,), "ln.w": (32,), "h2.w": (40, 32), "ln2.b": (32,)}
    params = {k: torch.randn(s).to(device) for k, s in shapes.items()}
    spec = lambda path, p: bnbf.OptimSpec(rule="lion" if path == "wte" else "adamw", min_8bit_size=1024)
    decay, no_decay, lion = {"lr": 1e-2, "weight_decay": 0.1}, {"lr": 1e-2, "weight_decay": 0.0}, {"lr": 1e-3}
    hp = lambda path, p: lion if path == "wte" else decay if p.ndim > 1 else no_decay
    state = compose.init_state(params, spec)
    plan_mod = sys.modules["bnbf.plan"]
    picked = []
    real = plan_mod._picked
    monkeypatch.setattr(plan_mod, "_picked", lambda *a: picked.append(1) or real(*a))
    from bnbf.kernels import launcher

    seen = []  # per launch of the mixed calls: (in place, its scalars)
    for mod, in_place in ((launcher, False), (plan_mod, True)):
        real_launch = mod.launch_group

        def counted(g, gs, hp, *a, _real=real_launch, _in_place=in_place, **k):
            if recording:
                seen.append((_in_place, hp))
            return _real(g, gs, hp, *a, **k)

        monkeypatch.setattr(mod, "launch_group", counted)
    in_p = {k: p.clone() for k, p in params.items()}
    in_s = {k: type(s)(*(t.clone() for t in s)) for k, s in state.items()}
    leaf_hp = {k: hp(k, p) for k, p in params.items()}
    for step in (1, 2):
        grads = _grads(params)
        recording = False
        want = _separate(params, grads, state, leaf_hp.__getitem__, step)
        want_in = _separate_(in_p, grads, in_s, leaf_hp.__getitem__, step)
        recording = True
        got = compose.update(params, grads, state, hp, step)
        compose.update_(in_p, grads, in_s, hp, step)
        for what, (p, s), (wp, ws) in (("pure", got, want), ("in place", (in_p, in_s), want_in)):
            _eq_tree(p, wp, f"step {step}, {what}: params")
            _eq_tree(s, ws, f"step {step}, {what}: states")
        params, state = want
    assert not picked  # no group of several sets: no rows picked or uploaded
    if bnbf._dispatch.use_triton(in_p["h.w"]):  # per step and call: lion's group, adamw's 8-bit and 32-bit groups
        assert len(seen) == 12
        assert all(type(hp) is tuple for _, hp in seen), seen  # Python numbers: kernel arguments, pure or in place


@pytest.mark.parametrize("form", ["per-leaf callable", "mixed rules", "max_grad_norm"])
@pytest.mark.parametrize("fn", ["update", "update_"])
def test_vmap_of_the_composing_forms_equals_a_loop(device, form, fn):
    """``vmap`` of the composing forms over an ensemble: each member steps as its own call does. ``update_`` of
    several groups took the addresses of vmap's tensors (a RuntimeError from torch) and ``max_grad_norm`` torch's
    ``_foreach`` norms, which vmap cannot batch; the groups' pure step is now written back, and the clip takes its
    norms tensor by tensor (each member's grads clipped as ``torch.nn.utils.clip_grad_norm_`` clips them)."""
    members = 3
    gen = torch.Generator().manual_seed(7)
    stacked = lambda *shape: torch.randn(members, *shape, generator=gen).to(device)  # noqa: E731
    params, grads = {"a": stacked(16, 20), "b": stacked(257)}, {"a": stacked(16, 20), "b": stacked(257)}
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=256)
    hp, clip = {"lr": 0.01}, None
    if form == "per-leaf callable":
        hp = lambda path, p: {"lr": 0.02 if path == "a" else 0.01}  # noqa: E731
    elif form == "mixed rules":
        spec = lambda path, p: bnbf.OptimSpec(rule="lion" if path == "a" else "adamw", min_8bit_size=256)  # noqa: E731
        hp = {"lion": {"lr": 1e-3}, "adamw": {"lr": 0.01}}
    elif device == "cuda":
        pytest.skip("torch's CUDA _foreach_norm and vmap's batched norms add the squares in other orders")
    else:
        clip = 0.5
    state = torch.vmap(lambda p: compose.init_state(p, spec, hp))(params)
    member = lambda tree, m: torch.utils._pytree.tree_map(lambda t: t[m].clone(), tree)  # noqa: E731
    loop = [(member(params, m), member(state, m)) for m in range(members)]
    call = lambda p, g, s: getattr(compose, fn)(p, g, s, hp, 1, max_grad_norm=clip)  # noqa: E731
    out = torch.vmap(call)(params, grads, state)
    got = (params, state) if fn == "update_" else out
    for m, (p, s) in enumerate(loop):
        g = member(grads, m)
        if clip is not None:  # torch's clip arithmetic on the member's grads, then the plain step
            total = torch.nn.utils.get_total_norm(list(g.values()))
            g = {k: v * torch.clamp(clip / (total + 1e-6), max=1.0) for k, v in g.items()}
        want = compose.update(p, g, s, hp, 1)
        assert_trees_same_variant(member(got, m), want, f"{form} {fn}: member {m}")  # (bit for bit off CUDA)


def test_vmap_of_update__refuses_an_unbatched_param_before_writing():
    """vmap of the composing forms' update_: a param that vmap does not batch (one tensor for every member) cannot
    take each member's step in place; refused in words before any param or state is written."""
    params = {"a": torch.randn(3, 300), "b": torch.randn(3, 20)}
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    hp = lambda path, p: {"lr": 0.1 if path == "a" else 0.2}  # noqa: E731 - two groups
    state = torch.vmap(lambda q: compose.init_state(q, bnbf.OptimSpec(rule="adamw", min_8bit_size=256), hp))(params)
    shared = params["b"][0].clone()
    snap = snapshot(params, state, shared)
    with pytest.raises(RuntimeError, match=r"cannot write param\['b'\]: it is not batched"):
        torch.vmap(lambda a, g, s: compose.update_({"a": a, "b": shared}, g, s, hp, 1))(params["a"], grads, state)
    assert_untouched(snap)


@pytest.mark.parametrize("seq", [list, tuple])
def test_a_tree_of_hparams_through_lists_and_tuples_of_the_params(seq):
    """hparams as a pytree matching params whose subtrees are lists or tuples (``{"a": [{...}, {...}]}``): each
    leaf takes its own mapping, in init_state, update and update_, equal to separate calls."""
    t = lambda: torch.linspace(-1, 1, 300)  # noqa: E731
    params = {"enc": {"w": seq([t(), t() * 2])}, "b": t()}
    hp = {"enc": {"w": seq([{"lr": 0.1}, {"lr": 0.2, "weight_decay": 0.0}])}, "b": {"lr": 0.3}}
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=0)
    tree_map, tree_leaves = torch.utils._pytree.tree_map, torch.utils._pytree.tree_leaves
    grads = tree_map(lambda x: torch.cos(x * 3), params)
    state = bnbf.init_state(params, spec, hp)
    new_p, _ = bnbf.update(params, grads, state, hp, 1)
    hps = [hp["enc"]["w"][0], hp["enc"]["w"][1], hp["b"]]
    order = [("enc", "w", 0), ("enc", "w", 1), ("b",)]
    for path, p, h in zip(order, [params["enc"]["w"][0], params["enc"]["w"][1], params["b"]], hps):
        g = grads["enc"]["w"][path[2]] if path[0] == "enc" else grads["b"]
        want, _ = bnbf.update(p, g, bnbf.init_state(p, spec, h), h, 1)
        got = new_p["enc"]["w"][path[2]] if path[0] == "enc" else new_p["b"]
        assert torch.equal(got, want), path
    bnbf.update_(params, grads, state, hp, 1)
    assert all(torch.equal(a, b) for a, b in zip(tree_leaves(params), tree_leaves(new_p)))


@pytest.mark.parametrize("in_place", [False, True], ids=["update", "update_"])
@pytest.mark.parametrize(
    ("hparams", "error", "match"),
    [
        (lambda path, p: {"lr": float("nan") if path == "enc.1.y" else 1e-3}, ValueError, "Invalid learning rate: nan"),
        (lambda path, p: {"lr": 1e-3, "momentum": 0.9} if path == "enc.1.y" else {"lr": 1e-3}, ValueError, "unknown"),
        ({"adamw": {"lr": 1e-3}, "lion": {"betas": (0.9, 1.5)}}, ValueError, "Invalid beta parameter at index 1"),
        (
            lambda path, p: {"amsgrad": True} if path == "enc.1.y" else {},
            ValueError,
            "need .*'max_exp_avg_sq'",
        ),  # a slot it lacks
    ],
    ids=["per-leaf nan lr", "per-leaf unknown key", "per-rule beta", "per-leaf slot"],
)
def test_a_bad_hyperparameter_names_its_leaf(hparams, error, match, in_place):
    """Per-leaf and per-rule hyperparameters: the error names the leaf (the first of its group) and the rule, then
    torch's words; nothing is written (it said torch's words alone, which leaf's value was bad unsaid)."""
    import collections

    pair = collections.namedtuple("pair", "x y")
    params = {"enc": [torch.randn(300), pair(torch.randn(5), torch.randn(7))], "head": (torch.randn(3),)}
    spec = lambda path, p: bnbf.OptimSpec(rule="lion" if path.startswith("head") else "adamw", min_8bit_size=256)
    state = compose.init_state(params, spec)
    grads = tree_map(torch.randn_like, params)
    before = [t.clone() for t in tree_leaves((params, state))]
    leaf = "head.0" if isinstance(hparams, dict) else "enc.1.y"
    rule = "lion" if isinstance(hparams, dict) else "adamw"
    with pytest.raises(error, match=rf"hyperparameters of '{leaf}' \({rule}\): .*{match}"):
        (compose.update_ if in_place else compose.update)(params, grads, state, hparams, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, tree_leaves((params, state))))

"""The pure step of the composing forms fed its own outputs (``params, state = bnbf.update(params, grads, state,
hparams, step)`` with per-leaf hyperparameters or several rules, a torch.func loop): a call whose params and state
are a recent call's outputs, as that call made them, with that call's hyperparameters (the same objects holding the
same values, or new dicts of exactly the same numbers) steps each rule's leaves as then, without splitting the call
again (``bnbf.compose._PURE_KEPT``). Such a loop equals the same steps on fresh copies bit for bit; an output edited
between calls gets the very answer a fresh call gets, with nothing modified; the record keeps no tensor alive.
"""

from __future__ import annotations

import gc
import re
import weakref

import pytest
import torch
from conftest import assert_untouched, snapshot
from test_pure_feedback import NEW_TREES, _copy, _edits, _grads, _nested_edits, _tree, answers_as_fresh

import bnbf
from bnbf import compose

# "c" (5 elements) steps with Lion, the others with AdamW: two rules, each one launch
SPEC = lambda path, p: bnbf.OptimSpec(rule="lion" if path == "c" else "adamw", min_8bit_size=256)  # noqa: E731


def _per_leaf(lr: float = 1e-2):
    """The usual per-leaf form: a new dict for each leaf every call, no weight decay on 1-d leaves."""
    return lambda path, p: {"lr": lr, "weight_decay": 0.0 if p.ndim == 1 else 0.1}


FORMS = {
    "callable": _per_leaf,
    "by_rule": lambda lr=1e-2: {"adamw": {"lr": lr, "weight_decay": 0.01}, "lion": {"lr": lr / 10}},
    "tree": lambda lr=1e-2: {k: {"lr": lr, "weight_decay": 0.1 * i} for i, k in enumerate("abc")},
}


@pytest.fixture
def splits(monkeypatch) -> list:
    """Counts the full splits (``compose._split``), which a fed-back call skips."""
    calls = []
    full = compose._split
    monkeypatch.setattr(compose, "_split", lambda *a: calls.append(1) or full(*a))
    return calls


def _on(tree, device):
    return torch.utils._pytree.tree_map(lambda t: t.to(device), tree)


def _triton(device) -> None:
    if not bnbf.use_triton(torch.zeros(1, device=device)):
        pytest.skip("the kept partition serves the Triton path's merged launches")


@pytest.mark.parametrize("form", [*FORMS, "callable, clipped"])
def test_a_fed_back_composed_loop_equals_fresh_calls(device, splits, form):
    """Each form, the hyperparameters made anew every call (new dicts, equal numbers): one split, then every call
    fed its outputs back skips it; a new lr splits once more. Bit for bit the same calls on fresh copies (with
    ``max_grad_norm``: the kernels clip on the kept path as on the split's)."""
    clip = 1.0 if form.endswith("clipped") else None
    form = form.split(",")[0]
    _triton(device)
    params = _on(_tree("dict"), device)
    state = bnbf.init_state(params, SPEC)
    fresh_p, fresh_s = _copy(params), _copy(state)
    lrs = [1e-2, 1e-2, 1e-2, 5e-3, 5e-3]
    for k, lr in enumerate(lrs, 1):
        grads = _on(_grads(params, k), device)
        grads = {n: g * 100 for n, g in grads.items()} if clip else grads  # a norm the clip scales down
        params, state = bnbf.update(params, grads, state, FORMS[form](lr), k, max_grad_norm=clip)
        fresh_p, fresh_s = bnbf.update(
            _copy(fresh_p), _copy(grads), _copy(fresh_s), FORMS[form](lr), k, max_grad_norm=clip
        )
    assert len(splits) == 2 * len(lrs) - 3, "the loop split on its first call and where lr changed only"
    assert sorted({type(s).layout.rule for s in state.values()}) == ["adamw", "lion"]
    for a, b in zip(*(torch.utils._pytree.tree_leaves(t) for t in ([params, state], [fresh_p, fresh_s]))):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)


@pytest.mark.parametrize("name, edit", _edits(), ids=[n for n, _ in _edits()])
def test_an_edited_output_gets_a_fresh_calls_answer(device, name, edit):
    """Each edit of test_pure_feedback's, between two calls of a by-rule loop: the fed-back call answers what a
    fresh call on the same tensors answers (error or bits), nothing modified."""
    _triton(device)
    params = _on(_tree("dict"), device)
    state = bnbf.init_state(params, SPEC)
    hp = FORMS["by_rule"]()
    params, state = bnbf.update(params, _on(_grads(params, 1), device), state, hp, 1)
    p, g, s, h, k = edit(params, _on(_grads(params, 2), device), state, dict(hp), 2)
    assert (id(p), id(s)) in compose._PURE_KEPT or name in NEW_TREES  # the kept path is asked
    answers_as_fresh(name, p, g, s, h, k)


@pytest.mark.parametrize("name, edit", _nested_edits(), ids=[n for n, _ in _nested_edits()])
def test_an_edited_nested_output_gets_a_fresh_calls_answer(device, name, edit):
    """test_pure_feedback's edits of a nested tree's inner containers and leaves, between two calls of a by-rule loop
    (the nested tree's record: its walked structure), answered as a fresh call answers them."""
    _triton(device)
    spec = lambda path, p: bnbf.OptimSpec(rule="lion" if path.endswith("c") else "adamw", min_8bit_size=256)
    params = _on(_tree("nested"), device)
    hp = FORMS["by_rule"]()
    params, state = bnbf.update(params, _on(_grads(params, 1), device), bnbf.init_state(params, spec), hp, 1)
    assert (id(params), id(state)) in compose._PURE_KEPT
    answers_as_fresh(name, *edit(params, _on(_grads(params, 2), device), state, dict(hp), 2))


def test_a_fed_back_call_refuses_what_a_fresh_call_refuses(device, splits):
    """The checks that read the call's step and options run on the kept path too, in the full path's order: a step
    of 0, max_unorm with a rule of its own norms (LAMB), a bad skip_zeros."""
    _triton(device)
    spec = lambda path, p: bnbf.OptimSpec(rule="lamb" if path == "c" else "adamw", min_8bit_size=256)
    params = _on(_tree("dict"), device)
    hp = {"adamw": {"lr": 1e-2}, "lamb": {"lr": 1e-3}}
    params, state = bnbf.update(params, _on(_grads(params, 1), device), bnbf.init_state(params, spec), hp, 1)
    grads = _on(_grads(params, 2), device)
    cases = [
        ({"step": 0}, ValueError, "step"),
        ({"max_unorm": 0.5}, ValueError, "max_unorm does not combine with lamb"),
        ({"skip_zeros": 1}, TypeError, "skip_zeros"),
    ]
    snap = snapshot(params, state)
    for opts, error, words in cases:
        step = opts.pop("step", 2)
        with pytest.raises(error, match=words) as fresh:
            bnbf.update(dict(params), grads, dict(state), hp, step, **opts)
        splits.clear()
        with pytest.raises(error, match=re.escape(str(fresh.value))):
            bnbf.update(params, grads, state, hp, step, **opts)
        assert not splits, f"{opts}: refused by the full path, not the kept one"
    assert_untouched(snap)


def test_the_kept_record_holds_no_tensor(device):
    _triton(device)
    params = _on(_tree("dict"), device)
    state = bnbf.init_state(params, SPEC)
    for k in (1, 2):
        params, state = bnbf.update(params, _on(_grads(params, k), device), state, _per_leaf(), k)
    assert compose._PURE_KEPT
    refs = [weakref.ref(t) for t in torch.utils._pytree.tree_leaves([params, state])]
    del params, state
    gc.collect()
    assert all(r() is None for r in refs)

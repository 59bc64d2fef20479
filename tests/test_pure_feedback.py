"""The pure step fed its own outputs (a torch.func training loop: ``params, state = bnbf.update(params, grads, state,
...)``): a call whose params and state are a recent call's outputs, exactly as that call made them, skips the checks
those outputs already passed (``bnbf.functional._PURE``). Such a loop equals the same steps on fresh copies bit for
bit; an output edited between calls in any way the checks would refuse (listed twice, resized, given other memory,
set to require grad...) gets the very error a fresh call gets, with nothing modified; the record keeps no tensor
alive. Both twins of the record's check (the C++ ``leaves_fit`` and its plain-Python twin) answer alike.
"""

from __future__ import annotations

import gc
import importlib
import re
import weakref

import pytest
import torch
from conftest import assert_untouched, snapshot
from torch.autograd import forward_ad

import bnbf
from bnbf import functional as F

P = importlib.import_module("bnbf.plan")  # the module (``bnbf.plan`` is the function that makes a plan)
HP = {"lr": 1e-2, "weight_decay": 0.01}
SPEC = bnbf.OptimSpec(rule="adamw", min_8bit_size=256)  # the 300-element leaves 8-bit, the small one 32-bit
SPEC32 = bnbf.OptimSpec(rule="adamw", state_bits=32)


class Sub(torch.Tensor):
    pass


def _tree(kind: str, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(0)
    leaves = [torch.randn(300, generator=g).to(dtype), torch.randn(2, 150, generator=g).to(dtype)]
    leaves.append(torch.randn(5, generator=g).to(dtype))
    if kind == "leaf":
        return leaves[0]
    if kind == "dict":
        return {"a": leaves[0], "b": leaves[1], "c": leaves[2]}
    if kind == "nested":
        return {"a": leaves[0], "m": [leaves[1], {"c": leaves[2]}]}
    return leaves if kind == "list" else tuple(leaves)


def _grads(params, k: int):
    g = torch.Generator().manual_seed(100 + k)
    return torch.utils._pytree.tree_map(
        lambda p: (torch.randn(p.shape, generator=g) * 10 ** (k % 3)).to(p.dtype), params
    )


def _copy(tree):
    """New containers and new tensors with the same values: a call the record cannot know."""
    leaves, spec = torch.utils._pytree.tree_flatten(tree, is_leaf=bnbf.state.is_state)
    copied = [type(x)._make(t.clone() for t in x) if bnbf.state.is_state(x) else x.clone() for x in leaves]
    return torch.utils._pytree.tree_unflatten(copied, spec)


@pytest.fixture
def prepared(monkeypatch):
    """Counts the full checks (``_prepare``), which a fed-back call skips."""
    calls = []
    full = F._prepare

    def counted(*a, **k):
        calls.append(1)
        return full(*a, **k)

    monkeypatch.setattr(F, "_prepare", counted)
    return calls


@pytest.mark.parametrize("kind", ["dict", "list", "tuple", "leaf", "nested"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_fed_back_loop_equals_fresh_calls(prepared, kind, dtype):
    params = _tree(kind, dtype)
    state = bnbf.init_state(params, SPEC)
    fresh_p, fresh_s = _copy(params), _copy(state)
    for k in range(1, 5):
        grads = _grads(params, k)
        hp = {"lr": 1e-2 / k, "weight_decay": 0.01, "betas": (0.9, 0.99 if k % 2 else 0.999)}
        params, state = bnbf.update(params, grads, state, hp, k)
        fresh_p, fresh_s = bnbf.update(_copy(fresh_p), _copy(grads), _copy(fresh_s), hp, k)
    assert len(prepared) == 1 + 4, "every call after the first fed its outputs back skips the full checks"
    for a, b in zip(
        torch.utils._pytree.tree_leaves([params, state]), torch.utils._pytree.tree_leaves([fresh_p, fresh_s])
    ):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)


def _edits():
    """Edits between two calls: (name, edit of (params, grads, state, hparams, step) returning them)."""

    def twice(p, g, s, h, k):
        p = dict(p)
        p["b"] = p["a"].view(2, 150)
        return p, g, s, h, k

    def field(name, fn):
        def edit(p, g, s, h, k):
            fn(s["a"])
            return p, g, s, h, k

        return name, edit

    def param(name, fn):
        def edit(p, g, s, h, k):
            fn(p)
            return p, g, s, h, k

        return name, edit

    return [
        param("param given another's memory", lambda p: p["b"].set_(p["a"].view(2, 150))),
        ("param listed twice (a view)", twice),
        param("param resized", lambda p: p["a"].resize_(299)),
        param("param transposed", lambda p: p["b"].t_()),
        param("param requires grad", lambda p: p["a"].requires_grad_()),
        param("param a negative view", lambda p: p.__setitem__("a", p["a"]._neg_view())),
        param("param another dtype", lambda p: p.__setitem__("a", p["a"].double())),
        field("state field resized", lambda s: s.exp_avg.resize_(100)),
        field("state field other memory", lambda s: setattr(s.exp_avg_sq, "data", s.exp_avg.data.clone())),
        field("state field a dtype view", lambda s: setattr(s.exp_avg, "data", s.exp_avg.data.view(torch.int8))),
        field("state field requires grad", lambda s: s.exp_avg_absmax.requires_grad_()),
        ("state of another layout", lambda p, g, s, h, k: (p, g, {**s, "a": bnbf.init_state(p["a"], SPEC32)}, h, k)),
        ("grad of another dtype", lambda p, g, s, h, k: (p, {**g, "a": g["a"].double()}, s, h, k)),
        ("grad requires grad", lambda p, g, s, h, k: (p, {**g, "a": g["a"].clone().requires_grad_()}, s, h, k)),
        ("grad non-contiguous", lambda p, g, s, h, k: (p, {**g, "b": g["b"].t().contiguous().t()}, s, h, k)),
        ("grad missing", lambda p, g, s, h, k: (p, {"a": g["a"], "b": g["b"]}, s, h, k)),
        ("hparams need another slot", lambda p, g, s, h, k: (p, g, s, {**h, "amsgrad": True}, k)),
        (
            "hparam requires grad",
            lambda p, g, s, h, k: (p, g, s, {**h, "lr": torch.tensor(0.01, requires_grad=True)}, k),
        ),
        ("step 0", lambda p, g, s, h, k: (p, g, s, h, 0)),
        ("states swapped", lambda p, g, s, h, k: (p, g, {**s, "a": s["b"], "b": s["a"]}, h, k)),
    ]


def _outcome(fn):
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 - the outcome compared is the exception itself
        return type(e), str(e)
    return "ok", [t.clone() for t in torch.utils._pytree.tree_leaves(out)]


@pytest.mark.parametrize("name, edit", _edits(), ids=[n for n, _ in _edits()])
def test_an_edited_output_gets_a_fresh_calls_answer(name, edit):
    params = _tree("dict")
    state = bnbf.init_state(params, SPEC)
    params, state = bnbf.update(params, _grads(params, 1), state, HP, 1)  # recorded: the next call could skip checks
    p, g, s, h, k = edit(params, _grads(params, 2), state, dict(HP), 2)
    assert (id(p), id(s)) in F._PURE or name in NEW_TREES
    answers_as_fresh(name, p, g, s, h, k)


NEW_TREES = ("param listed twice (a view)", "state of another layout", "states swapped")  # edits making new dicts


def answers_as_fresh(name: str, p, g, s, h, k) -> None:
    """``bnbf.update(p, g, s, h, k)`` answers what a fresh call on the same tensors answers (the error, or the bits),
    and neither modifies anything."""
    # a negative view's memory, read without the bit (the snapshot compares raw bits)
    snap = snapshot(*(torch.utils._pytree.tree_map(lambda t: t._neg_view() if t.is_neg() else t, x) for x in (p, s)))
    # a fresh call: new containers (the records are keyed by the returned trees), the same tensors
    fresh = _outcome(lambda: bnbf.update(dict(p), dict(g), dict(s), h, k))
    assert_untouched(snap)
    got = _outcome(lambda: bnbf.update(p, g, s, h, k))
    assert_untouched(snap)
    assert got[0] == fresh[0], (name, got, fresh)
    if fresh[0] == "ok":
        assert all(torch.equal(a, b) for a, b in zip(got[1], fresh[1])), name
    else:
        assert got[1] == fresh[1], name


def _nested_edits():
    """Edits of a nested tree's inner containers and leaves (``_tree("nested")``: ``{"a", "m": [t, {"c"}]}``), the
    outer containers kept (the record is looked up by their ids)."""

    def inner(fn):
        def edit(p, g, s, h, k):
            fn(p, g, s)
            return p, g, s, h, k

        return edit

    return [
        ("inner param another dtype", inner(lambda p, g, s: p["m"][1].__setitem__("c", p["m"][1]["c"].double()))),
        ("inner param resized", inner(lambda p, g, s: p["m"][0].resize_(10))),
        ("inner param a view of another", inner(lambda p, g, s: p["m"][1].__setitem__("c", p["a"][:5]))),
        ("inner key added", inner(lambda p, g, s: p["m"][1].__setitem__("d", torch.zeros(5)))),
        ("inner list made a tuple", inner(lambda p, g, s: p.__setitem__("m", tuple(p["m"])))),
        ("inner states swapped", inner(lambda p, g, s: s["m"].reverse())),
        ("inner state field resized", inner(lambda p, g, s: s["m"][1]["c"].exp_avg.resize_(2))),
        ("inner grad missing", inner(lambda p, g, s: g["m"].__setitem__(1, {}))),
        ("inner grad another shape", inner(lambda p, g, s: g["m"][1].__setitem__("c", torch.zeros(6)))),
        ("inner grad a None", inner(lambda p, g, s: g["m"][1].__setitem__("c", None))),
        ("nothing edited", inner(lambda p, g, s: None)),
    ]


@pytest.mark.parametrize("name, edit", _nested_edits(), ids=[n for n, _ in _nested_edits()])
def test_an_edited_nested_output_gets_a_fresh_calls_answer(name, edit):
    """Nested trees are recorded too (their structure read by the core's own walk): an edit of an inner container or
    leaf is answered as a fresh call answers it."""
    params = _tree("nested")
    state = bnbf.init_state(params, SPEC)
    params, state = bnbf.update(params, _grads(params, 1), state, HP, 1)
    assert (id(params), id(state)) in F._PURE
    answers_as_fresh(name, *edit(params, _grads(params, 2), state, dict(HP), 2))


def test_an_edited_output_is_refused_as_a_fresh_call_refuses_it():
    """The edits that must raise do raise (the comparison above would also pass if neither call checked)."""
    params = _tree("dict")
    state = bnbf.init_state(params, SPEC)
    params, state = bnbf.update(params, _grads(params, 1), state, HP, 1)
    params["b"].set_(params["a"].view(2, 150))
    snap = snapshot(params, state)
    with pytest.raises(ValueError, match=re.escape("param['a'] and param['b'] overlap in memory")):
        bnbf.update(params, _grads(params, 2), state, HP, 2)
    assert_untouched(snap)
    params, state = bnbf.update(_tree("dict"), _grads(params, 1), bnbf.init_state(_tree("dict"), SPEC), HP, 1)
    state["a"].exp_avg.resize_(100)
    with pytest.raises(ValueError, match=re.escape("state['a'].exp_avg does not fit the param")):
        bnbf.update(params, _grads(params, 2), state, HP, 2)
    params, state = bnbf.update(_tree("dict"), _grads(params, 1), bnbf.init_state(_tree("dict"), SPEC), HP, 1)
    params["a"].requires_grad_()
    with pytest.raises(RuntimeError, match="differentiable=True"):
        bnbf.update(params, _grads(params, 2), state, HP, 2)


def test_a_dual_grad_is_refused_on_a_fed_back_call():
    params = _tree("dict")
    state = bnbf.init_state(params, SPEC)
    params, state = bnbf.update(params, _grads(params, 1), state, HP, 1)
    grads = _grads(params, 2)
    fresh = None
    with forward_ad.dual_level():
        g = {**grads, "a": forward_ad.make_dual(grads["a"], torch.ones_like(grads["a"]))}
        fresh = _outcome(lambda: bnbf.update(dict(params), g, dict(state), HP, 2))
        got = _outcome(lambda: bnbf.update(params, g, state, HP, 2))
    assert fresh[0] is RuntimeError and got == fresh


@pytest.mark.surface  # the record's bookkeeping, the same on both paths: 126 interpreted launches would take 9 s
def test_other_calls_between_two_of_a_loop_keep_its_record(prepared):
    """A pure call on fresh trees between every two of a fed-back loop (another model) adds a record each time; past
    the record's capacity the oldest go, never the loop's latest: every fed-back call after the first hits."""
    params = _tree("dict")
    state = bnbf.init_state(params, SPEC)
    other = _tree("list")
    for k in range(1, F._PURE.size):
        params, state = bnbf.update(params, _grads(params, k), state, HP, k)
        bnbf.update(_copy(other), _grads(other, k), bnbf.init_state(other, SPEC), HP, 1)
    assert len(prepared) == 1 + (F._PURE.size - 1)


def test_the_record_keeps_no_tensor_alive():
    params = _tree("dict")
    state = bnbf.init_state(params, SPEC)
    for k in (1, 2):
        params, state = bnbf.update(params, _grads(params, k), state, HP, k)
    refs = [weakref.ref(t) for t in torch.utils._pytree.tree_leaves([params, state])]
    assert F._PURE
    del params, state
    gc.collect()
    assert all(r() is None for r in refs)


def test_leaves_fit_twins_agree(twin):
    """``leaves_fit`` in each twin: yes for the recorded outputs and fitting grads; no for each way the full checks
    would refuse them or would need to look again."""
    params = list(_tree("list"))
    states = bnbf.init_state(params, SPEC)
    grads = [torch.randn(p.shape) for p in params]
    planned = P.fields_planned([tuple(params), *states])
    assert (type(planned) is bytes) == (twin == "native")
    fit = P.leaves_fit
    assert fit(params, grads, states, planned, True) is True
    assert fit(params, grads, states[:2], planned, True) is False
    assert fit(params[:2], grads[:2], states, planned, True) is False
    assert fit(params, grads[:2], states, planned, True) is False
    assert fit(params, [g.double() for g in grads], states, planned, True) is False
    assert fit(params, [grads[0], grads[1].t().contiguous().t(), grads[2]], states, planned, True) is False
    assert fit(params, [grads[0].requires_grad_(), *grads[1:]], states, planned, True) is False
    assert fit(params, grads, states, planned, False) is True  # requires grad counts under grad mode only
    grads[0].requires_grad_(False)
    params[0].requires_grad_()
    assert fit(params, grads, states, planned, True) is False
    params[0].requires_grad_(False)
    states[0].exp_avg_absmax.requires_grad_()
    assert fit(params, grads, states, planned, True) is False
    states[0].exp_avg_absmax.requires_grad_(False)
    assert fit(params, grads, states, planned, True) is True
    edits = {
        "neg view": lambda: params.__setitem__(0, params[0]._neg_view()),
        "param clone": lambda: params.__setitem__(1, params[1].clone()),
        "param subclass": lambda: params.__setitem__(2, params[2].as_subclass(Sub)),
        "field resized": lambda: states[0].exp_avg.resize_(100),
        "field transposed": lambda: states[1].exp_avg.t_(),
        "state a list": lambda: states.__setitem__(2, list(states[2])),
    }
    for name, edit in edits.items():
        params = list(_tree("list"))
        states = bnbf.init_state(params, SPEC)
        grads = [torch.randn(p.shape) for p in params]
        planned = P.fields_planned([tuple(params), *states])
        edit()
        assert fit(params, grads, states, planned, True) is False, name

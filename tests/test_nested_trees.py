"""Nested trees of params (a module's params by submodule: dicts of dicts, lists, tuples, OrderedDicts as
``state_dict()`` gives them, in their own order): the core reads their
structure by its own walk (``bnbf._host_checks._flatten``: pytree's leaves and an equal spec, one spec object per
structure), so ``update_`` steps them through a cached plan and the pure ``update`` records its outputs, as for flat
dicts, and the composing forms keep its partition. A nested loop equals the same loop on a flat dict bit for bit
(fixed and random trees, clipped, compiled); an edit of an inner container or leaf between two calls gets the answer
of a call that takes every check (its error, or its bits), nothing modified on an error; the spec cache holds no
caller's object.
"""

from __future__ import annotations

import collections
import gc
import weakref
from typing import NamedTuple

import pytest
import torch
from conftest import DEVICES, assert_untouched, kernel_runs, snapshot
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils import _pytree as pytree

import bnbf
from bnbf import _host_checks as H
from bnbf import functional as F
from bnbf._bounded import Bounded
from bnbf.state import State, is_state

SPEC = bnbf.OptimSpec(rule="adamw", min_8bit_size=256)  # the 300-element leaves 8-bit, the small ones 32-bit
HP = {"lr": 1e-2, "weight_decay": 0.01}


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


def _leaves(n: int, seed: int = 0, device: str = "cpu") -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(300 if i % 2 == 0 else 5, generator=g).to(device) for i in range(n)]


def _nested(leaves: list) -> dict:
    return {"a": leaves[0], "m": [leaves[1], {"c": leaves[2], "d": (leaves[3],)}], "e": {"f": {"g": leaves[4]}}}


def _moved(tree: collections.OrderedDict, key: str) -> collections.OrderedDict:
    """``tree`` with ``key`` moved to its end: an OrderedDict's order that its dict's insertion order is not."""
    tree.move_to_end(key)
    return tree


TREES = {
    "nested": lambda ls: _nested(ls),
    "empty inner dict": lambda ls: {"a": ls[0], "z": {}, "b": [ls[1]]},
    "OrderedDict node": lambda ls: {"a": ls[0], "o": collections.OrderedDict(x=ls[1])},
    "OrderedDict reordered": lambda ls: _moved(collections.OrderedDict(x=ls[0], y=[ls[1]], z=ls[2]), "x"),
    # pytree's own walk (the core's does not read them): the same leaves and spec
    "namedtuple node": lambda ls: {"a": ls[0], "p": Pair(ls[1], ls[2])},
    "int keys": lambda ls: {"a": ls[0], "m": {0: ls[1], 1: ls[2]}},
    "None leaf": lambda ls: {"a": ls[0], "m": [ls[1], None]},
    "top-level list": lambda ls: [ls[0], [ls[1], (ls[2],)]],
}


OWN_WALK = ["nested", "empty inner dict", "OrderedDict node", "OrderedDict reordered", "top-level list"]


@pytest.mark.parametrize("name, make", TREES.items(), ids=TREES.keys())
def test_the_walk_gives_pytrees_leaves_and_spec(name, make):
    tree = make(_leaves(5))
    leaves, spec = H._flatten(tree)
    assert H.walked(spec) is (name in OWN_WALK)
    want, want_spec = pytree.tree_flatten(tree)
    assert len(leaves) == len(want) and all(a is b for a, b in zip(leaves, want))
    assert spec == want_spec
    again = H._unflatten(list(leaves), spec)
    assert pytree.tree_flatten(again)[1] == want_spec and all(a is b for a, b in zip(pytree.tree_leaves(again), want))
    assert type(again) is type(tree)


def test_one_spec_object_per_structure_and_the_state_trees_share_it():
    params = _nested(_leaves(5))
    state = bnbf.init_state(params, SPEC)
    p_spec = H._flatten(params)[1]
    assert H._flatten(_nested(_leaves(5, seed=1)))[1] is p_spec  # another tree of the same structure
    assert H._flatten(state, is_leaf=is_state)[1] is p_spec
    assert H.walked(p_spec)


def test_leaves_of_a_known_structure_are_the_walks_or_none():
    """``leaves_of`` (the plans' and records' read of a tree of a known walked structure) gives the walk's leaves
    where the tree has that structure, and None for another structure, another container type, a state tree read
    as tensors, or a spec the core did not walk."""
    params = _nested(_leaves(5))
    state = bnbf.init_state(params, SPEC)
    leaves, spec = H._flatten(params)
    assert all(a is b for a, b in zip(H.leaves_of(params, spec), leaves, strict=True))
    assert H.leaves_of(state, spec, states=True) == H._flatten(state, is_leaf=is_state)[0]
    assert H.leaves_of(state, spec) is None
    other = {**params, "e": {"f": {"h": params["e"]["f"]["g"]}}}  # another key
    assert H.leaves_of(other, spec) is None
    assert H.leaves_of(collections.OrderedDict(params), spec) is None
    assert H.leaves_of(params, H._flatten({"a": params["a"], "p": Pair(params["a"], params["a"])})[1]) is None


def test_the_spec_cache_keeps_no_callers_object():
    params = _nested(_leaves(5))
    refs = [weakref.ref(t) for t in pytree.tree_leaves(params)]
    H._flatten(params)
    del params
    gc.collect()
    assert all(r() is None for r in refs)


def _copy(tree):
    leaves, spec = pytree.tree_flatten(tree, is_leaf=is_state)
    return pytree.tree_unflatten(
        [type(x)._make(t.clone() for t in x) if is_state(x) else x.clone() for x in leaves], spec
    )


def _grads(params, k: int):
    g = torch.Generator().manual_seed(100 + k)
    return pytree.tree_map(lambda p: (torch.randn(p.shape, generator=g) * 10 ** (k % 3)).to(p.device), params)


@pytest.fixture
def generic_steps(monkeypatch):
    """Counts the in-place steps that take every check (``_step_generic``), which a cached plan skips."""
    calls = []
    full = F._step_generic
    monkeypatch.setattr(F, "_step_generic", lambda *a, **k: calls.append(1) or full(*a, **k))
    return calls


IN_PLACE_TREES = {
    "nested": _nested,
    # model.state_dict()'s type, reordered: its leaves in its own order
    "flat OrderedDict": lambda ls: _moved(collections.OrderedDict((str(i), t) for i, t in enumerate(ls)), "0"),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make", IN_PLACE_TREES.values(), ids=IN_PLACE_TREES.keys())
def test_a_nested_in_place_loop_steps_through_one_plan_and_equals_a_flat_one(generic_steps, monkeypatch, device, make):
    _in_place_loops(generic_steps, monkeypatch, device, make)


@pytest.mark.parametrize("device", DEVICES)
def test_containers_remembered_among_many_keep_their_route(generic_steps, monkeypatch, device):
    """update_'s table of containers full of others' (dead ids of containers made anew each call): the loops'
    containers, remembered one after the other, keep their route; a full table had been cleared at the second
    one, sending the first through the full lookup again (found in CI, where earlier tests had filled it)."""
    dead = Bounded(F._LAST.size)
    for i in range(dead.size - 1):
        dead.put((-1 - i, -1), lambda: None)
    monkeypatch.setattr(F, "_LAST", dead)
    _in_place_loops(generic_steps, monkeypatch, device, _nested)
    if kernel_runs(device):  # the two loops' containers in, the oldest dead id out
        assert len(F._LAST) == F._LAST.size and (-1, -1) not in F._LAST


def _in_place_loops(generic_steps, monkeypatch, device, make):
    """A nested (or flat) tree's in-place loop beside the flat dict of its leaves: equal results, and on the Triton
    path one plan lookup each, the calls after the first taking their containers' route."""
    lookups = []  # update_'s full plan lookups: its containers' own route (_last_plan) serves the calls after the first
    full = F._cached
    monkeypatch.setattr(F, "_cached", lambda *a: lookups.append(a[0]) or full(*a))
    leaves = _leaves(5, device=device)
    params = make(leaves)
    flat = {str(i): t.clone() for i, t in enumerate(pytree.tree_leaves(params))}
    state, flat_state = bnbf.init_state(params, SPEC), bnbf.init_state(flat, SPEC)
    for k in range(1, 5):
        grads = _grads(params, k)
        hp = {"lr": 1e-2 / k, "weight_decay": 0.01}
        bnbf.update_(params, grads, state, hp, k)
        bnbf.update_(flat, dict(zip(flat, pytree.tree_leaves(grads))), flat_state, hp, k)
    if kernel_runs(device):  # plans take the direct launch on the Triton path (the reference path's steps are generic)
        assert len(generic_steps) == 0, "a nested tree's plan is cached from its first call"
        # each tree's first call only (the nested one, then the flat dict): the others by their containers
        assert [x is params for x in lookups] == [True, False]
    got = pytree.tree_leaves([params, state], is_leaf=is_state)
    want = [flat[k] for k in flat] + [flat_state[k] for k in flat_state]
    for a, b in zip(pytree.tree_leaves(got), pytree.tree_leaves(want)):
        assert torch.equal(a, b)


def _edits():
    """Edits between two in-place calls of inner containers and leaves: (name, edit of (params, grads, state))."""
    return [
        ("nothing edited", lambda p, g, s: None),
        ("inner param replaced", lambda p, g, s: p["m"][1].__setitem__("c", p["m"][1]["c"].clone() + 1)),
        ("inner param another dtype", lambda p, g, s: p["m"][1].__setitem__("c", p["m"][1]["c"].double())),
        ("inner param a view of another", lambda p, g, s: p["e"]["f"].__setitem__("g", p["a"][:5])),
        ("inner param resized", lambda p, g, s: p["m"][0].resize_(4)),
        ("inner param transposed memory", lambda p, g, s: setattr(p["a"], "data", p["a"].data.clone())),
        ("inner key added", lambda p, g, s: p["e"]["f"].__setitem__("h", p["a"].new_zeros(5))),
        ("inner tuple made a list", lambda p, g, s: p["m"][1].__setitem__("d", list(p["m"][1]["d"]))),
        ("inner states swapped", lambda p, g, s: s["m"].reverse()),
        ("inner state replaced", lambda p, g, s: s["e"]["f"].__setitem__("g", bnbf.init_state(p["e"]["f"]["g"], SPEC))),
        ("inner state field resized", lambda p, g, s: s["m"][1]["c"].exp_avg.resize_(2)),
        ("inner grad another shape", lambda p, g, s: g["m"][1].__setitem__("c", g["a"].new_zeros(6))),
        ("inner grad non-contiguous", lambda p, g, s: g.__setitem__("a", torch.stack([g["a"], g["a"]], 1)[:, 0])),
        ("inner grad a None", lambda p, g, s: g["e"]["f"].__setitem__("g", None)),
        ("inner grad missing", lambda p, g, s: g["m"].__setitem__(1, {"c": g["m"][1]["c"]})),
    ]


def _outcome(fn, tree):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the outcome compared is the exception itself
        return type(e), str(e)
    return "ok", [t.clone() for t in pytree.tree_leaves(tree)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name, edit", _edits(), ids=[n for n, _ in _edits()])
def test_an_edited_nested_tree_steps_in_place_as_a_fully_checked_call(monkeypatch, name, edit, device):
    """The same two steps on two copies, one through update_'s cached plan, the other with every check each call
    (no plan found); the edit made to both between them: the same error (nothing modified) or the same bits."""
    _steps_as_fully_checked(monkeypatch, name, edit, SPEC, HP, F, "_cached", None, device)


def _steps_as_fully_checked(monkeypatch, name, edit, spec, hp, module, attr, miss, device) -> None:
    """Two in-place steps on two copies of a nested tree, ``edit`` made to both between them; the second copy's
    second step with ``module.attr`` answering ``miss`` (nothing kept found: every check); the same error (nothing
    modified) or the same bits."""
    params = _nested(_leaves(5, device=device))
    state = bnbf.init_state(params, spec)
    trees = [(params, state), (_copy(params), _copy(state))]
    for p, s in trees:
        bnbf.update_(p, _grads(p, 1), s, hp, 1)
    outcomes = []
    for i, (p, s) in enumerate(trees):
        g = _grads(p, 2)
        edit(p, g, s)
        snap = snapshot(p, s)
        with monkeypatch.context() as m:
            if i == 1:
                m.setattr(module, attr, lambda *a: miss)
            outcomes.append(_outcome(lambda p=p, g=g, s=s: bnbf.update_(p, g, s, hp, 2), [p, s]))
        if outcomes[-1][0] != "ok":
            assert_untouched(snap)
    (kind, got), (fresh_kind, fresh) = outcomes
    assert kind == fresh_kind, (name, got, fresh)
    if kind == "ok":
        assert all(torch.equal(a, b) for a, b in zip(got, fresh)), name
    else:
        assert got == fresh, name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("in_place", [False, True], ids=["update", "update_"])
def test_a_nested_tree_is_clipped_as_the_flat_dict_of_its_leaves(device, in_place):
    """``max_grad_norm`` on a nested tree takes the folded clip of its leaves, as a flat dict of them does (the clip
    had read a nested tree's first level as its leaves, found dicts and clipped copies of the grads by torch's
    norm instead: other bits)."""
    out = []
    for make in (_nested, lambda ls: {str(i): t for i, t in enumerate(ls)}):
        params = make(_leaves(5, device=device))
        state = bnbf.init_state(params, SPEC)
        for k in (1, 2, 3):
            grads = make(pytree.tree_leaves(_grads(params, k)))
            if in_place:
                bnbf.update_(params, grads, state, HP, k, max_grad_norm=1.0)
            else:
                params, state = bnbf.update(params, grads, state, HP, k, max_grad_norm=1.0)
        out.append(pytree.tree_leaves([params, state]))
    assert len(out[0]) == len(out[1]) and all(torch.equal(a, b) for a, b in zip(*out))


TWO_RULES = lambda path, p: bnbf.OptimSpec(rule="lion" if path.startswith("m") else "adamw", min_8bit_size=256)  # noqa: E731
FORMS = {
    "per-leaf callable": (SPEC, lambda path, p: {"lr": 1e-2, "weight_decay": 0.1 if path.endswith("c") else 0.0}),
    "by rule": (TWO_RULES, {"adamw": {"lr": 1e-2}, "lion": {"lr": 1e-3}}),
    "schedule": (SPEC, {"lr": lambda t: 1e-2 / t}),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("in_place", [False, True], ids=["update", "update_"])
@pytest.mark.parametrize("form", FORMS, ids=FORMS.keys())
def test_the_composing_forms_step_a_nested_tree_as_the_flat_dict_of_its_leaves(monkeypatch, device, in_place, form):
    """The composing forms read a nested tree by the core's walk, its leaves' names (those the callable and the
    spec see: ``m.1.c``) made once per structure: pytree's keyed walk runs on the first call only."""
    spec, hp = FORMS[form]
    walks = []
    keyed = pytree.tree_flatten_with_path
    monkeypatch.setattr(pytree, "tree_flatten_with_path", lambda *a, **k: walks.append(1) or keyed(*a, **k))
    out = []
    for make in (_nested, lambda ls: {"a": ls[0], "m.0": ls[1], "m.1.c": ls[2], "m.1.d.0": ls[3], "e.f.g": ls[4]}):
        params = make(_leaves(5, device=device))
        state = bnbf.init_state(params, spec)
        walks.clear()
        for k in (1, 2, 3):
            grads = make(pytree.tree_leaves(_grads(params, k)))
            if in_place:
                bnbf.update_(params, grads, state, hp, k)
            else:
                params, state = bnbf.update(params, grads, state, hp, k)
        if make is _nested:
            assert len(walks) <= 1, "a nested tree's names are made once per structure"
        out.append(pytree.tree_leaves([params, state]))
    assert len(out[0]) == len(out[1]) and all(torch.equal(a, b) for a, b in zip(*out))


def _triton(device) -> None:
    if not bnbf.use_triton(torch.zeros(1, device=device)):
        pytest.skip("the kept partition serves the Triton path's merged launches")


def _per_leaf(path, p):  # a new dict for each leaf every call
    return {"lr": 1e-2, "weight_decay": 0.0 if p.ndim == 1 or path.endswith("g") else 0.1}


KEPT_FORMS = {"per-leaf callable": _per_leaf, "by rule": lambda: {"adamw": {"lr": 1e-2}, "lion": {"lr": 1e-3}}}


@pytest.fixture
def splits(monkeypatch) -> list:
    """Counts the composing forms' full splits (``compose._split``), which a kept partition skips."""
    calls = []
    full = bnbf.compose._split
    monkeypatch.setattr(bnbf.compose, "_split", lambda *a: calls.append(1) or full(*a))
    return calls


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("in_place", [False, True], ids=["update", "update_"])
@pytest.mark.parametrize("form", KEPT_FORMS, ids=KEPT_FORMS.keys())
def test_a_nested_composed_loop_keeps_its_partition(splits, device, in_place, form):
    """A composed loop on a nested tree (two rules) or a flat OrderedDict, in place or fed its outputs back, splits on
    its first call only, as a flat dict's does; bit for bit the same loop on a flat dict of its leaves."""
    _triton(device)
    hp = _per_leaf if form == "per-leaf callable" else KEPT_FORMS[form]()
    out = []
    flat = lambda ls: {"a": ls[0], "m.0": ls[1], "m.1.c": ls[2], "m.1.d.0": ls[3], "e.f.g": ls[4]}  # noqa: E731
    for make in (_nested, lambda ls: collections.OrderedDict(flat(ls)), flat):
        params = make(_leaves(5, device=device))
        state = bnbf.init_state(params, TWO_RULES)
        splits.clear()
        for k in (1, 2, 3, 4):
            grads = make(pytree.tree_leaves(_grads(params, k)))
            if in_place:
                bnbf.update_(params, grads, state, hp, k)
            else:
                params, state = bnbf.update(params, grads, state, hp, k)
        assert len(splits) == 1, f"{make}: split on the first call only"
        out.append(pytree.tree_leaves([params, state]))
    for got in out[:2]:
        assert len(got) == len(out[2]) and all(torch.equal(a, b) for a, b in zip(got, out[2]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name, edit", _edits(), ids=[n for n, _ in _edits()])
def test_an_edited_nested_tree_composed_in_place_steps_as_a_split_call(monkeypatch, device, name, edit):
    """test_an_edited_nested_tree_steps_in_place_as_a_fully_checked_call's edits, by rule (two rules): the kept
    partition's step against a split of every call (no partition found)."""
    _triton(device)
    hp = KEPT_FORMS["by rule"]()
    _steps_as_fully_checked(monkeypatch, name, edit, TWO_RULES, hp, bnbf.compose, "_known_update_", False, device)


_LEAF = st.builds(lambda n: torch.zeros(n), st.integers(1, 3))
_KEYS = st.one_of(st.text(max_size=3), st.integers(0, 3))  # int keys: pytree's own walk
_TREES = st.recursive(
    _LEAF | st.none(),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(_KEYS, inner, max_size=3),
        st.builds(Pair, inner, inner),
        st.dictionaries(st.text(max_size=3), inner, max_size=3).map(collections.OrderedDict),
    ),
    max_leaves=12,
)


@given(_TREES)
def test_any_tree_walks_as_pytree_walks_it(tree):
    """Random trees of dicts (str or int keys), lists, tuples, namedtuples, OrderedDicts, tensors and None: the core's
    walk gives pytree's leaves and an equal spec, and its unflatten pytree's tree."""
    leaves, spec = H._flatten(tree)
    want, want_spec = pytree.tree_flatten(tree)
    assert len(leaves) == len(want) and all(a is b for a, b in zip(leaves, want))
    if isinstance(spec, pytree.TreeSpec):
        assert spec == want_spec
    else:  # one leaf, or a flat dict, list or tuple of leaves: the core's own structure key
        assert spec == "leaf" or type(spec) is tuple
    again = H._unflatten(list(leaves), spec)
    assert pytree.tree_flatten(again)[1] == want_spec
    assert all(a is b for a, b in zip(pytree.tree_leaves(again), want))


_STATE = bnbf.init_state(torch.zeros(2), bnbf.OptimSpec(rule="adamw", state_bits=32))
_OF_KIND = {  # leaves of the walk's type (a Parameter: an isinstance past the exact type), then others
    torch.Tensor: [torch.zeros(1), torch.nn.Parameter(torch.zeros(2))],
    State: [_STATE, bnbf.init_state(torch.zeros(300), bnbf.OptimSpec(rule="lion"))],
}


def _mixed(leaf_type: type):
    """Trees mostly of ``leaf_type``'s leaves in dicts (str keys, int keys now and then), lists and tuples, with now
    and then a namedtuple node, None, a number or a leaf of the other kind."""
    other = next(v for k, v in _OF_KIND.items() if k is not leaf_type)[0]
    return st.recursive(
        st.sampled_from(_OF_KIND[leaf_type] * 8 + [None, 3.0, other]),
        lambda inner: st.one_of(
            st.lists(inner, max_size=3),
            st.lists(inner, max_size=3).map(tuple),
            st.dictionaries(st.text(max_size=2), inner, max_size=3),
            st.dictionaries(st.text(max_size=2), inner, max_size=3),
            st.dictionaries(st.one_of(st.text(max_size=2), st.integers(0, 1)), inner, min_size=1, max_size=2),
            st.dictionaries(st.text(max_size=2), inner, max_size=3).map(collections.OrderedDict),
            st.builds(Pair, inner, inner),
        ),
        max_leaves=10,
    ).filter(lambda t: type(t) in (dict, list, tuple))


@pytest.mark.surface  # host code only: the same in both passes
@pytest.mark.skipif(H.NATIVE is None, reason="the C++ host checks were not built")
@settings(max_examples=150)  # about 10 ms an example
@given(st.sampled_from(list(_OF_KIND)).flatmap(lambda t: st.tuples(st.just(t), _mixed(t))))
def test_the_compiled_walk_answers_as_its_python_twin(drawn):
    """The compiled walk (bnbf/csrc/host_checks.cpp) gives its Python twin's answer, leaves and structure for trees
    of tensors or of states, with other leaves, None, int keys, OrderedDicts and namedtuple nodes among them."""
    leaf_type, tree = drawn
    got, want = ([], []), ([], [])
    answer = H.NATIVE.walk(tree, leaf_type, *got)
    assert answer is H._walk(tree, leaf_type, *want)
    if answer:  # a "no" leaves a part in the lists, which the caller drops
        assert len(got[0]) == len(want[0]) and all(a is b for a, b in zip(got[0], want[0]))
        assert got[1] == want[1]


@pytest.mark.surface
@pytest.mark.skipif(H.NATIVE is None, reason="the C++ host checks were not built")
@settings(max_examples=60)
@given(_mixed(torch.Tensor))
def test_the_compiled_unwalk_rebuilds_as_its_python_twin(tree):
    """The compiled unwalk rebuilds a walked tree as its Python twin does: the same containers (new objects), keys
    and leaves (the very objects) as the tree walked."""
    leaves, shape = [], []
    if not H._walk(tree, torch.Tensor, leaves, shape):
        return
    got, want = H.NATIVE.unwalk(tuple(shape), leaves), H._unwalk(tuple(shape), iter(leaves))
    assert pytree.tree_flatten(got)[1] == pytree.tree_flatten(want)[1] == pytree.tree_flatten(tree)[1]
    assert all(a is b for a, b in zip(pytree.tree_leaves(got), leaves, strict=True))
    assert type(tree) is tuple or got is not tree  # a new container (the empty tuple is one object)


@pytest.mark.surface
@pytest.mark.skipif(H.NATIVE is None, reason="the C++ host checks were not built")
def test_the_compiled_unwalk_refuses_a_shape_not_walks():
    """A shape that is not walk's, or leaves that do not fill it, raise ValueError (no read past either's end)."""
    t = torch.zeros(1)
    assert H.NATIVE.unwalk((dict, 2, "a", "b", None, list, 1, None), [t, t]) == {"a": t, "b": [t]}
    bad = {
        "shape cut short": ((dict, 2, "a", "b", None), [t, t]),
        "a length past the end": ((list, 5, None), [t]),
        "a negative length": ((tuple, -1), []),
        "no length": ((list,), []),
        "a type walk never writes": ((set, 1, None), [t]),
        "too few leaves": ((list, 2, None, None), [t]),
        "leaves left over": ((list, 1, None), [t, t]),
        "entries left over": ((list, 1, None, None), [t, t]),
    }
    for shape, leaves in bad.values():
        with pytest.raises(ValueError, match="unwalk"):
            H.NATIVE.unwalk(shape, leaves)


class _Editor:
    """An object whose ``__class__`` (which isinstance reads for a type that is not its own) empties a container
    of the tree being walked and claims to be a tensor."""

    def __init__(self, victim):
        self.victim = victim

    @property
    def __class__(self):
        self.victim.clear()
        return torch.Tensor


@pytest.mark.surface
@pytest.mark.skipif(H.NATIVE is None, reason="the C++ host checks were not built")
@pytest.mark.parametrize("victim", ["parent list", "parent dict", "root"])
def test_the_compiled_walk_survives_a_tree_edited_under_it(victim):
    """Python code run by an isinstance during the walk (a ``__class__`` property) empties a container being walked,
    the one holding the object or the root: the walk holds what it reads (no freed object read, no crash) and says
    no (its shape would not be the tree's), as its Python twin does; a tree deeper than the recursion limit is a
    "no" with no error left set (pytree's walk answers it)."""
    for walk in (H.NATIVE.walk, H._walk):
        inner = [torch.zeros(1), None, torch.zeros(2), torch.zeros(3)]
        tree = {"a": {"b": inner, "c": torch.zeros(1)}, "d": [torch.zeros(1)] * 3}
        inner[1] = _Editor({"parent list": inner, "parent dict": tree["a"], "root": tree}[victim])
        assert walk(tree, torch.Tensor, [], []) is False
    deep: list = [torch.zeros(1)]
    for _ in range(10_000):
        deep = [deep]
    assert H.NATIVE.walk(deep, torch.Tensor, [], []) is False
    with pytest.raises(RecursionError):
        H._flatten(deep)


_SIZES = st.sampled_from([1, 5, 255, 257, 300])
_PARAM_TREES = st.recursive(
    st.builds(lambda n: n, _SIZES),  # a leaf's numel (the tensors are made from the draw)
    lambda inner: st.one_of(
        st.lists(inner, min_size=1, max_size=3),
        st.lists(inner, min_size=1, max_size=3).map(tuple),
        st.dictionaries(st.text("abc", min_size=1, max_size=2), inner, min_size=1, max_size=3),
        st.dictionaries(st.text("abc", min_size=1, max_size=2), inner, min_size=1, max_size=3).map(
            lambda d: _moved(collections.OrderedDict(d), next(iter(d)))
        ),
    ),
    max_leaves=6,
)


@settings(max_examples=8)
@given(_PARAM_TREES.filter(lambda t: not isinstance(t, int)), st.booleans())
def test_any_nested_tree_steps_as_the_flat_dict_of_its_leaves(shape, in_place):
    """Random nested trees of params (odd sizes, 8-bit and 32-bit state): two steps, pure or in place, equal the
    same steps on a flat dict of the leaves bit for bit."""
    g = torch.Generator().manual_seed(0)
    sizes, spec = pytree.tree_flatten(shape)
    leaves = [torch.randn(n, generator=g) * 10.0 ** torch.randint(-6, 6, (n,), generator=g) for n in sizes]
    out = []
    for make in (lambda ls: pytree.tree_unflatten(ls, spec), lambda ls: {str(i): t for i, t in enumerate(ls)}):
        params = make([t.clone() for t in leaves])
        state = bnbf.init_state(params, SPEC)
        for k in (1, 2):
            grads = make([(t * k).sin() for t in leaves])
            if in_place:
                bnbf.update_(params, grads, state, HP, k)
            else:
                params, state = bnbf.update(params, grads, state, HP, k)
        out.append(pytree.tree_leaves([params, state]))
    assert len(out[0]) == len(out[1]) and all(torch.equal(a, b) for a, b in zip(*out))


def test_a_full_table_of_structures_keeps_the_ones_walked_last(monkeypatch):
    """The table of walked structures full of others': two trees walked one after the other keep their spec objects
    (what plans and the vmap memo are keyed by, and how a spec is known as walked); a full table had been cleared
    at the second, so the first came back as a new spec and its plan was no longer found."""
    specs = Bounded(H._SPECS.size, H._SPECS.evicted)
    for i in range(specs.size - 1):
        specs.put(("dead", i), object())
    monkeypatch.setattr(H, "_SPECS", specs)
    monkeypatch.setattr(H, "_SHAPES", {})
    a, b = _nested(_leaves(5)), {"x": _nested(_leaves(5))}
    _, spec_a = H._flatten(a)
    _, spec_b = H._flatten(b)
    assert H._flatten(a)[1] is spec_a and H._flatten(b)[1] is spec_b
    assert H.walked(spec_a) and H.walked(spec_b) and ("dead", 0) not in H._SPECS


COMPILED = {
    "update": lambda p, g, s, k: bnbf.update(p, g, s, HP, k),
    "update_": lambda p, g, s, k: bnbf.update_(p, g, s, HP, k),
    "per-leaf callable": lambda p, g, s, k: bnbf.update(p, g, s, _per_leaf, k),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("step", COMPILED, ids=COMPILED.keys())
def test_a_nested_tree_compiles_whole_as_on_its_first_call(fresh_dynamo, monkeypatch, device, step):
    """``torch.compile(fullgraph=True)`` of a step on a nested tree whose structure the core has not walked yet: no
    graph break (the walk's lock and ids are not traced: pytree's walk instead), Dynamo's one recompile at most, and
    the eager steps' bits."""
    from torch._dynamo.testing import CompileCounter

    monkeypatch.setattr(H, "_SPECS", Bounded(H._SPECS.size, H._SPECS.evicted))
    monkeypatch.setattr(H, "_SHAPES", {})
    cnt = CompileCounter()
    compiled = torch.compile(COMPILED[step], fullgraph=True, backend=cnt)
    out = []
    for fn in (compiled, COMPILED[step]):
        params = _nested(_leaves(5, device=device))
        state = bnbf.init_state(params, SPEC)
        for k in (1, 2, 3):
            got = fn(params, _grads(params, k), state, k)
            params, state = got if step != "update_" else (params, state)
        out.append(pytree.tree_leaves([params, state]))
    assert cnt.frame_count <= 2
    assert all(torch.equal(a, b) for a, b in zip(*out))

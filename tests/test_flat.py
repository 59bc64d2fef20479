"""Flat params (:mod:`bnbf.flat`): the leaves as views of a few buffers.

The claim the module makes: stepping the buffers equals stepping the leaves one by one, bit for bit (params and
state), for every elementwise rule, with each block's stochastic rounding drawn for its place in the buffer
(``FIRST_BLOCKS``, as for a shard), because blocks never span two leaves and the padding's params stay zero. Checked
here against the per-leaf step on hostile grads (spikes to 1e6 over a 1e-12 floor, exact zeros) and odd sizes,
on the reference path and the Triton kernels (interpreter on CPU, CUDA in the GPU run); then the grads through
``unflatten``, vmap over stacked buffers against a loop, a compiled step without recompiles, and the errors.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io

import pytest
import torch
from conftest import DEVICES, triton_mode
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerances import assert_equal_report, assert_trees_same_variant
from torch._dynamo.testing import CompileCounter
from torch.func import grad, grad_and_value
from torch.utils._pytree import tree_leaves, tree_map

import bnbf
from bnbf.flat import flat_layout
from bnbf.reference import FIRST_BLOCKS

INTERP = triton_mode()
SIZES = {"a": (1,), "b": (255,), "c": (257,), "d": (4097,), "e": (20, 15), "f": (3000,)}
HP = {"lr": 1e-2, "weight_decay": 0.01}
# hyperparameters that keep more states, and a nonzero initial state (the padding's state still starts at zero)
RULE_HP = {
    "sgd": {**HP, "momentum": 0.9},
    "rmsprop": {**HP, "momentum": 0.5},
    "adagrad": {**HP, "initial_accumulator_value": 0.1},
}


def _hostile(shape, gen, dtype, device):
    """Gaussian, with exact zeros, a 1e-12 floor and spikes up to 1e6 in the same blocks."""
    g = torch.randn(shape, generator=gen)
    kind = torch.randint(0, 4, shape, generator=gen)
    g = torch.where(kind == 0, 0.0, g)
    g = torch.where(kind == 1, 1e-12 * torch.rand(shape, generator=gen), g)
    spike = torch.rand(shape, generator=gen) < 0.01
    g = torch.where(spike, 10 ** torch.randint(3, 7, shape, generator=gen).float(), g)
    return g.to(device, dtype)


def _tree(sizes, dtypes, gen, device, scale=0.1):
    return {
        k: (torch.randn(s, generator=gen) * scale).to(device, dtypes[i % len(dtypes)])
        for i, (k, s) in enumerate(sizes.items())
    }


def _offset(layout, leaf):
    return sum(layout.pieces[leaf.key][: leaf.index])


@contextlib.contextmanager
def _dither_at(layout, params):
    """The per-leaf step with each leaf's stochastic rounding drawn at its blocks' places in its buffer."""
    blocks = {params[lf.path].data_ptr(): _offset(layout, lf) // layout.spec.block_size for lf in layout.leaves}
    token = FIRST_BLOCKS.set(blocks)
    try:
        yield
    finally:
        FIRST_BLOCKS.reset(token)


def _assert_same_as_per_leaf(rule, sizes, dtypes, bits, device, steps=3, seed=0, hp=None, grads_of=None):
    """Steps of the buffers against steps of their leaves (views of the buffers' params and states, cloned, before
    each step): bit for bit where the math is exact (reference path, interpreter); on the GPU within what two
    compiled variants of the step may differ by (the per-leaf step's dither at the buffer's blocks is another
    variant; tests/tolerances.py, CONTRACTION_ULPS)."""
    gen = torch.Generator().manual_seed(seed)
    spec = bnbf.OptimSpec(rule=rule, state_bits=bits, min_8bit_size=300)  # a and b keep 32-bit state
    hp = RULE_HP.get(rule, HP) if hp is None else hp
    grads_of = grads_of or _hostile
    params = _tree(sizes, dtypes, gen, device)
    layout = flat_layout(params, spec)
    flat = first = layout.flatten(params)
    state_flat = layout.init_state(flat, hp)
    clone = lambda tree: tree_map(torch.clone, tree)  # noqa: E731
    for t in range(1, steps + 1):
        params, state = clone(layout.unflatten(flat)), clone(layout.unflatten_state(state_flat))
        grads = {k: grads_of(p.shape, gen, p.dtype, device) for k, p in params.items()}
        with _dither_at(layout, params):
            params, state = bnbf.update(params, grads, state, hp, t)
        flat, state_flat = bnbf.update(flat, layout.flatten(grads), state_flat, hp, t)
        got = (layout.unflatten(flat), layout.unflatten_state(state_flat))
        assert_trees_same_variant(got, (params, state), f"{rule} step {t}: params then states")
    for key, sizes_ in layout.pieces.items():  # the padding stays zero
        pad = torch.ones(sum(sizes_), dtype=torch.bool, device=device)
        for leaf in layout.leaves:
            if leaf.key == key:
                pad[_offset(layout, leaf) : _offset(layout, leaf) + sizes_[leaf.index]] = False
        if grads_of is _hostile:  # (the padding's param steps as a zero-gradient element: eps 0 makes it NaN)
            assert not flat[key][pad].any(), f"{rule}: padding of {key} moved"
        assert not torch.equal(flat[key][~pad], first[key][~pad]), f"{rule}: the steps did not move {key}"


ELEMENTWISE = [r for r in bnbf.RULES if bnbf.RULES[r].norms is None]
# the interpreter takes seconds a launch configuration: there AdamW and Lion (both state widths, both dtypes)
_slow_in_interpreter = pytest.mark.skipif(INTERP, reason="covered on the reference path; slow in the interpreter")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [8, 32])
@pytest.mark.parametrize(
    "rule", [r if r in ("adamw", "lion") else pytest.param(r, marks=_slow_in_interpreter) for r in ELEMENTWISE]
)
def test_flat_step_equals_the_per_leaf_step(rule, bits, device):
    _assert_same_as_per_leaf(rule, SIZES, [torch.float32, torch.bfloat16], bits, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "rule",
    [
        r if r == "adam" else pytest.param(r, marks=_slow_in_interpreter)
        for r in ELEMENTWISE
        if hasattr(bnbf.RULES[r].make_hparams({}), "eps")
    ],
)
def test_eps_zero_padding_stays_out_of_the_leaves(rule, device):
    """With ``eps=0`` the padding's zero gradient over its zero state steps it to 0/0 = NaN, and under Adam's
    ``0 · p`` the NaN reaches its state: the leaves sharing the padding's blocks still step as on their own (an
    element whose new 8-bit state is non-finite steps as a non-finite gradient's, its states zeroed, so it never
    reaches its block's absmax)."""
    gaussian = lambda shape, gen, dtype, device: torch.randn(shape, generator=gen).to(device, dtype)  # noqa: E731
    hp = {**RULE_HP.get(rule, HP), "eps": 0.0, "weight_decay": 0.0}
    _assert_same_as_per_leaf(rule, {"a": (300,), "b": (257,)}, [torch.float32], 8, device, hp=hp, grads_of=gaussian)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [8, 32])
def test_a_rule_that_keeps_no_state_steps_as_the_leaves(bits, device):
    """SGD without momentum keeps no state tensor: its buffers' states unflatten to the leaves' (empty) states and
    flatten back, and the flat step is the leaves' step."""
    hp = {**RULE_HP.get("sgd", HP), "momentum": 0.0}
    _assert_same_as_per_leaf("sgd", SIZES, [torch.float32, torch.bfloat16], bits, device, hp=hp)
    params = _tree(SIZES, [torch.float32], torch.Generator().manual_seed(5), device)
    layout = flat_layout(params, bnbf.OptimSpec(rule="sgd", state_bits=bits))
    state_flat = layout.init_state(layout.flatten(params), hp)
    per_leaf = layout.unflatten_state(state_flat)
    assert all(len(s) == 0 for s in tree_leaves(per_leaf, is_leaf=bnbf.state.is_state))
    back = layout.flatten_state(per_leaf)
    assert {k: type(s) for k, s in back.items()} == {k: type(s) for k, s in state_flat.items()}


@pytest.mark.skipif(INTERP, reason="many shapes: the reference path")
@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.integers(1, 5000), min_size=1, max_size=6),
    st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    st.sampled_from(["adam", "adamw", "lion", "ademamix"]),
    st.integers(0, 2**16),
)
def test_flat_step_equals_the_per_leaf_step_any_sizes(numels, dtype, rule, seed):
    _assert_same_as_per_leaf(rule, {f"p{i}": (n,) for i, n in enumerate(numels)}, [dtype], 8, "cpu", 2, seed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rule", ["adamw", pytest.param("adagrad", marks=_slow_in_interpreter)])
def test_a_per_leaf_state_flattened_steps_on_as_the_leaves(rule, device):
    """A per-leaf state (a checkpoint of the per-param layout) moved into the buffers by ``flatten_state``: the
    flat step from it is the leaves' step, as in the test above; ``unflatten_state`` gives it back."""
    gen = torch.Generator().manual_seed(4)
    spec = bnbf.OptimSpec(rule=rule, min_8bit_size=300)
    hp = RULE_HP.get(rule, HP)
    params = _tree(SIZES, [torch.float32, torch.bfloat16], gen, device)
    state = bnbf.init_state(params, spec, hp)
    for t in range(1, 3):
        grads = {k: _hostile(p.shape, gen, p.dtype, device) for k, p in params.items()}
        params, state = bnbf.update(params, grads, state, hp, t)
    layout = flat_layout(params, spec)
    flat, state_flat = layout.flatten(params), layout.flatten_state(state)
    for a, b in zip(tree_leaves(layout.unflatten_state(state_flat)), tree_leaves(state), strict=True):
        assert_equal_report(a, b, "unflatten_state(flatten_state(state))")
    grads = {k: _hostile(p.shape, gen, p.dtype, device) for k, p in params.items()}
    with _dither_at(layout, params):
        params, state = bnbf.update(params, grads, state, hp, 3)
    flat, state_flat = bnbf.update(flat, layout.flatten(grads), state_flat, hp, 3)
    got = (layout.unflatten(flat), layout.unflatten_state(state_flat))
    assert_trees_same_variant(got, (params, state), f"{rule}: params then states")


@pytest.mark.parametrize("device", DEVICES)
def test_adagrads_initial_accumulator_stays_out_of_the_padding(device):
    """Adagrad's nonzero initial accumulator with small grads (g² far below it): stochastic rounding takes a leaf's
    8-bit values below the initial value, so a padding that started at it held its leaf's last block absmax and
    the flat step drifted from the leaves' (step 2 of this run). ``init_state`` starts the padding at zero, as
    ``flatten_state`` does: the leaves' steps bit for bit."""
    gen = torch.Generator().manual_seed(0)
    hp = {"lr": 1e-2, "initial_accumulator_value": 0.1}
    params = {f"l{i}": (torch.randn(257, generator=gen) * 0.1).to(device) for i in range(12)}
    spec = bnbf.OptimSpec(rule="adagrad", min_8bit_size=1)
    layout = flat_layout(params, spec)
    flat, state_flat = layout.flatten(params), layout.init_state(layout.flatten(params), hp)
    state = bnbf.init_state(params, spec, hp)
    for a, b in zip(tree_leaves(layout.unflatten_state(state_flat)), tree_leaves(state), strict=True):
        assert_equal_report(a, b, "the leaves' initial states")
    for t in range(1, 9):
        grads = {k: (torch.randn(257, generator=gen) * 0.01).to(device) for k in params}
        with _dither_at(layout, params):
            params, state = bnbf.update(params, grads, state, hp, t)
        flat, state_flat = bnbf.update(flat, layout.flatten(grads), state_flat, hp, t)
        got = (layout.unflatten(flat), layout.unflatten_state(state_flat))
        assert_trees_same_variant(got, (params, state), f"step {t}: params then states")


def test_layout_groups_and_alignment():
    params = {"w": torch.zeros(70, 70), "b": torch.zeros(70), "h": torch.zeros(5000, dtype=torch.bfloat16)}
    layout = flat_layout(params, bnbf.OptimSpec(block_size=512), group=lambda path, p: "decay" if p.dim() > 1 else "no")
    # each leaf from a block boundary; each buffer whole groups of 4 blocks (the last padding takes the rest)
    assert layout.pieces == {
        "decay/float32/8bit": (4900, 1244),
        "no/float32/32bit": (70, 1978),
        "no/bfloat16/8bit": (5000, 1144),
    }
    assert layout.specs["no/float32/32bit"].state_bits == 32 and layout.specs["no/bfloat16/8bit"].min_8bit_size == 0
    flat = layout.flatten(params)
    views = layout.unflatten(flat)
    for k, v in views.items():  # views of the buffers, not copies
        assert v.untyped_storage().data_ptr() == flat[next(lf.key for lf in layout.leaves if lf.path == k)].data_ptr()
    nested = {"enc": {"w": torch.randn(3, 4)}, "head": [torch.randn(2)]}
    layout = flat_layout(nested, bnbf.OptimSpec())
    assert [lf.path for lf in layout.leaves] == ["enc.w", "head.0"]
    out = layout.unflatten(layout.flatten(nested))
    assert torch.equal(out["enc"]["w"], nested["enc"]["w"]) and torch.equal(out["head"][0], nested["head"][0])


@pytest.mark.parametrize("how", ["torch.save", "deepcopy"])
def test_a_saved_layout_loads_with_torch_loads_defaults(how):
    """A checkpoint holding the layout beside its buffers and their state loads with torch.load's default
    ``weights_only=True``, as the buffers and state alone do (the layout's dataclasses, OptimSpecs and TreeSpec were
    refused): the loaded layout has the saved one's leaves, buffers and specs, and gives the loaded buffers' and
    state's leaves as the saved layout gives the saved ones'."""
    gen = torch.Generator().manual_seed(4)
    params = {
        "enc": {"w": torch.randn(30, 20, generator=gen)},
        "head": [torch.randn(300, generator=gen), torch.randn(7, generator=gen).to(torch.bfloat16)],
        "t": (torch.randn(5, generator=gen),),
    }
    spec = bnbf.OptimSpec(min_8bit_size=256, block_size=128)
    layout = flat_layout(params, spec, group=lambda path, p: "no" if p.dim() == 1 else "decay")
    flat = layout.flatten(params)
    grads = layout.flatten(tree_map(torch.randn_like, params))
    flat, state = bnbf.update(flat, grads, layout.init_state(flat), {"lr": 0.1}, 1)
    saved = {"layout": layout, "flat": flat, "state": state}
    if how == "deepcopy":
        back = copy.deepcopy(saved)
    else:
        buf = io.BytesIO()
        torch.save(saved, buf)
        buf.seek(0)
        back = torch.load(buf)  # torch's default: weights_only=True
    got = back["layout"]
    assert type(got) is type(layout) and got is not layout
    for name in ("spec", "treespec", "leaves", "pieces", "specs"):
        assert getattr(got, name) == getattr(layout, name), name
    pairs = [
        (layout.unflatten(flat), got.unflatten(back["flat"])),
        (layout.unflatten_state(state), got.unflatten_state(back["state"])),
    ]
    for want, have in pairs:
        assert torch.utils._pytree.tree_structure(want) == torch.utils._pytree.tree_structure(have)
        assert all(torch.equal(a, b) for a, b in zip(tree_leaves(want), tree_leaves(have), strict=True))
    # the next step through the loaded layout, from the loaded buffers and state, is the saved one's bit for bit
    step_grads = tree_map(torch.randn_like, params)
    want = bnbf.update(flat, layout.flatten(step_grads), state, {"lr": 0.1}, 2)
    have = bnbf.update(back["flat"], got.flatten(step_grads), back["state"], {"lr": 0.1}, 2)
    assert all(torch.equal(a, b) for a, b in zip(tree_leaves(want), tree_leaves(have), strict=True))
    assert all(
        torch.equal(a, b) for a, b in zip(tree_leaves(layout.unflatten(want[0])), tree_leaves(got.unflatten(have[0])))
    )


def test_a_pickled_layout_of_other_kinds_is_refused():
    """The values a pickled layout is rebuilt from are a file's: kinds other than a layout's are refused by name."""
    from bnbf.flat import _rebuild_layout

    layout = flat_layout({"w": torch.zeros(300)}, bnbf.OptimSpec())
    args = layout.__reduce__()[1]
    assert list(layout.pieces) == list(layout.specs) == ["float32/32bit"]
    assert _rebuild_layout(*args).pieces == layout.pieces
    for i, bad in (
        (2, (("w", "float32/8bit", 0, "300", torch.float32),)),  # a shape that is not ints
        (2, ()),  # fewer leaves than the structure
        (3, {"other": (300, 212)}),  # a leaf's buffer missing
        (4, {"float32/32bit": bnbf.OptimSpec()}),  # a spec not in its plain form
    ):
        with pytest.raises(ValueError, match="not a bnbf FlatLayout"):
            _rebuild_layout(*args[:i], bad, *args[i + 1 :])


def test_a_malformed_pickled_layout_is_refused_as_not_a_layout():
    """A crafted file's values: its structure was decoded before any kind was checked (bad JSON, a non-string raised
    json's or torch's errors), and a leaf's piece was never measured against the leaf, so a layout whose pieces
    did not hold its leaves loaded, to give views of other leaves' elements. Each is refused as not a layout, and
    nothing short of a layout :func:`flat_layout` could have made gets through."""
    from bnbf.flat import _rebuild_layout

    layout = flat_layout({"a": torch.zeros(300), "b": torch.zeros(40)}, bnbf.OptimSpec(min_8bit_size=4096))
    args = layout.__reduce__()[1]
    assert args[3] == {"float32/32bit": (300, 212, 40, 472)}
    (a, b), key = args[2], "float32/32bit"
    spec = dataclasses.asdict(bnbf.OptimSpec())
    for i, bad in (
        (1, ("treespec", "{not json")),  # structure JSON that does not parse
        (1, ("treespec", '{"protocol": 1, "tree": 5}')),  # JSON that is no structure
        (1, ("treespec", 7)),  # a structure that is no string
        (1, "leaf"),  # a packed state's structure key, not a layout's
        (0, {**spec, "colour": "red"}),  # a field no spec has
        (0, {**spec, "state_bits": 5}),  # a value the spec refuses
        (0, "adamw"),
        (3, {key: (200, 312, 40, 472)}),  # a piece smaller than its leaf
        (3, {key: (300, 212, 40)}),  # the last leaf's padding missing
        (3, {key: (300, 212, 40, -528)}),
        (3, {key: [300, 212, 40, 472]}),
        (3, {key: (300, 213, 40, 471)}),  # the second leaf starting inside a block
        (3, {key: (300, 212, 40, 473)}),  # not whole groups of 4 blocks
        (3, {key: (300, 212, 40, 216, 0, 256)}),  # a leaf's piece that no leaf holds
        (2, (a, (b[0], "float32/8bit", *b[2:]))),  # a leaf whose key names no piece
        (2, (a, (b[0], b[1], 4, *b[3:]))),  # an index past its buffer's pieces
        (2, (a, (b[0], b[1], 1, *b[3:]))),  # an index of a padding piece
        (2, ((b[0], b[1], 0, *b[3:]), (a[0], a[1], 2, *a[3:]))),  # leaves swapped: their pieces no longer fit
        (2, (a, (*b[:4], torch.int32))),  # a dtype no param has
        (2, (a, (*b[:4], torch.bfloat16))),  # two dtypes in one buffer
        (2, (a, (*b[:3], (-40,), b[4]))),
        (2, (a, b, b)),  # more leaves than the structure
        (2, [a, b]),
        (4, {key: spec, "other": spec}),  # a spec of no buffer
        (4, {key: {**spec, "block_size": 64}}),  # a buffer's spec of another block size
    ):
        with pytest.raises(ValueError, match="not a bnbf FlatLayout"):
            _rebuild_layout(*args[:i], bad, *args[i + 1 :])
    got = _rebuild_layout(*args)
    for name in ("spec", "treespec", "leaves", "pieces", "specs"):
        assert getattr(got, name) == getattr(layout, name), name


def _mlp_loss(params, x):
    h = torch.tanh(x @ params["w1"] + params["b1"])
    return ((h @ params["w2"]) ** 2).mean()


def _mlp(gen, members=None):
    lead = () if members is None else (members,)
    return {
        "w1": torch.randn(*lead, 16, 300, generator=gen) * 0.1,
        "b1": torch.randn(*lead, 300, generator=gen) * 0.1,
        "w2": torch.randn(*lead, 300, 3, generator=gen) * 0.1,
    }


def test_grads_through_unflatten_are_the_leaf_grads():
    gen = torch.Generator().manual_seed(1)
    params, x = _mlp(gen), torch.randn(8, 16, generator=gen)
    layout = flat_layout(params, bnbf.OptimSpec(min_8bit_size=1000))
    g_flat = grad(lambda f: _mlp_loss(layout.unflatten(f), x))(layout.flatten(params))
    g = grad(_mlp_loss)(params, x)
    for k, v in layout.flatten(g).items():  # the leaves' grads where they lie, zeros in the padding
        assert torch.equal(g_flat[k], v)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("in_place", [False, True])
def test_vmap_of_a_flat_ensemble_equals_a_loop(in_place, device):
    """An ensemble's stacked buffers: vmapped grads (the model called on ``unflatten`` of each member's buffers),
    then a vmapped step, against a loop of the step over the members with the same grads (the batched forward
    pass may round other than a member's own, the step may not)."""
    gen = torch.Generator().manual_seed(2)
    members = 3
    stacked = {k: v.to(device) for k, v in _mlp(gen, members).items()}
    x = torch.randn(members, 8, 16, generator=gen).to(device)
    spec = bnbf.OptimSpec(min_8bit_size=1000)
    layout = flat_layout({k: v[0] for k, v in stacked.items()}, spec)
    flat = torch.func.vmap(layout.flatten)(stacked)
    state = torch.func.vmap(layout.init_state)(flat)
    grads_of = torch.func.vmap(lambda f, xb: grad(lambda f: _mlp_loss(layout.unflatten(f), xb))(f))

    def step(f, g, s, t):
        if in_place:
            bnbf.update_(f, g, s, HP, t)
            return f, s
        return bnbf.update(f, g, s, HP, t)

    ref = [{k: v[b].clone() for k, v in flat.items()} for b in range(members)]
    ref = [(f, layout.init_state(f)) for f in ref]
    for t in range(1, 3):
        g = grads_of(flat, x)
        flat, state = torch.func.vmap(step, in_dims=(0, 0, 0, None))(flat, g, state, t)
        ref = [step(f, {k: v[b] for k, v in g.items()}, s, t) for b, (f, s) in enumerate(ref)]
    for b, (f, s) in enumerate(ref):
        for k in f:
            assert torch.equal(flat[k][b], f[k]), f"member {b} buffer {k}"
            for got, want in zip(state[k], s[k]):
                assert torch.equal(got[b], want), f"member {b} state of {k}"


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_flat_step_compiles_once(device, fresh_dynamo):
    gen = torch.Generator().manual_seed(3)
    params = {k: v.to(device) for k, v in _mlp(gen).items()}
    x = torch.randn(8, 16, generator=gen).to(device)
    layout = flat_layout(params, bnbf.OptimSpec(min_8bit_size=1000))

    def step(f, s, lr, t):
        g, loss = grad_and_value(lambda f: _mlp_loss(layout.unflatten(f), x))(f)
        bnbf.update_(f, g, s, {"lr": lr, "weight_decay": 0.01}, t)
        return loss

    counter = CompileCounter()
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    flat, eager_flat = layout.flatten(params), layout.flatten(params)
    state, eager_state = layout.init_state(flat), layout.init_state(eager_flat)
    for t in range(1, 5):
        lr, tt = torch.tensor(1e-2 / t, device=device), torch.tensor(t, device=device)
        compiled(flat, state, lr, tt)
        step(eager_flat, eager_state, lr, tt)
    assert counter.frame_count == 1
    for k in flat:
        assert torch.equal(flat[k], eager_flat[k])


def test_errors_name_the_problem():
    params = {"w": torch.randn(70, 70), "b": torch.randn(10)}
    layout = flat_layout(params, bnbf.OptimSpec())
    flat = layout.flatten(params)
    with pytest.raises(ValueError, match="layout's buffers"):
        layout.unflatten({"float32/8bit": flat["float32/32bit"]})
    with pytest.raises(ValueError, match=r"'float32/32bit' must be 1-D with 1024 elements, got shape \(2, 1024\)"):
        layout.unflatten({**flat, "float32/32bit": flat["float32/32bit"].expand(2, 1024)})
    with pytest.raises(TypeError, match="must be torch.float32, got torch.bfloat16"):
        layout.init_state({**flat, "float32/32bit": flat["float32/32bit"].bfloat16()})
    with pytest.raises(ValueError, match="dict of bnbf states keyed like this layout's buffers"):
        layout.unflatten_state({"float32/8bit": layout.init_state(flat)["float32/8bit"]})
    st = layout.init_state(flat)
    swapped = {"float32/8bit": st["float32/32bit"], "float32/32bit": st["float32/8bit"]}
    with pytest.raises(
        ValueError, match=r"state 'float32/8bit' is adamw_state_32bit_s3 of \(1024,\), not the buffer's"
    ):
        layout.unflatten_state(swapped)
    with pytest.raises(ValueError, match="the state of 'w' is adamw_state_32bit_s3, not the layout's for its buffer"):
        layout.flatten_state(bnbf.init_state(params, bnbf.OptimSpec(state_bits=32)))
    # a state of other params' shapes (of one layout: 8-bit and 32-bit as here) put nowhere: it would have filled
    # the padding and the other leaves' places
    other = bnbf.init_state({"w": torch.randn(71, 69), "b": torch.randn(10)}, bnbf.OptimSpec())
    with pytest.raises(ValueError, match=r"the state of 'w': exp_avg does not fit the leaf, expected torch.uint8 \(70"):
        layout.flatten_state(other)
    with pytest.raises(ValueError, match="structure"):
        layout.flatten({"w": params["w"]})
    with pytest.raises(ValueError, match=r"leaf 'b' is \(11,\) torch.float32; the layout has \(10,\)"):
        layout.flatten({"w": params["w"], "b": torch.zeros(11)})
    with pytest.raises(ValueError, match="rule 'lamb' scales each tensor's update by the tensor's norms"):
        flat_layout(params, bnbf.OptimSpec(rule="lamb"))
    with pytest.raises(TypeError, match="floating point"):
        flat_layout({"i": torch.zeros(3, dtype=torch.int64)}, bnbf.OptimSpec())
    with pytest.raises(TypeError, match="non-empty str"):
        flat_layout(params, bnbf.OptimSpec(), group=lambda path, p: 3)

"""The packed state (``init_state(..., packed=True)``, :mod:`bnbf.packed`): the state of a whole tree in a few flat
buffers, stepped by the same kernels and reference code as the per-param state.

Every step here is compared bit for bit with the per-param state's step on the same inputs (which the rest of the
suite compares with torch.optim, torch-optimizer, lion-pytorch and the papers' formulas): eager ``update`` and
``update_``, under ``torch.func.vmap`` (each member against a loop over members), and under
``torch.compile(fullgraph=True)`` with Dynamo's counters. Runs on the reference path and under
``TRITON_INTERPRET=1`` (the Triton kernels), and on CUDA in the GPU run.
"""

from __future__ import annotations

import io
import pickle
import types

import pytest
import torch
from conftest import DEVICES, assert_untouched, snapshot, triton_mode
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerances import assert_trees_same_variant
from torch._dynamo.testing import CompileCounter
from torch.utils._pytree import tree_leaves, tree_map

import bnbf
from bnbf._host_checks import NATIVE

INTERP = triton_mode()
# leaves of odd sizes (1, 255, 257, 4097), 2-D and 0-d, both sides of min_8bit_size: two layout groups
SHAPES = {"w": (33, 17), "one": (1,), "b": (255,), "c": (257,), "big": (4097,), "s": ()}
HP = {"adam": {}, "adamw": {}, "lion": {}, "sgd": {"momentum": 0.9}, "rmsprop": {"momentum": 0.5, "centered": True},
      "adagrad": {}, "ademamix": {}, "lamb": {}, "lars": {"momentum": 0.9}, "adan": {}}  # fmt: skip
RULES = ["adamw", "lion", "ademamix", "lamb"] if INTERP else list(HP)


def _tree(dtype, device, seed=0, lead=()):
    gen = torch.Generator().manual_seed(seed)
    return {k: (torch.randn((*lead, *s), generator=gen)).to(device, dtype) for k, s in SHAPES.items()}


def _grads(dtype, device, step, lead=()):
    """Hostile grads: a spike and exact zeros in the first step, magnitudes from 1e-12 to 1e6 in one tensor."""
    g = _tree(dtype, device, seed=100 + step, lead=lead)
    scale = torch.logspace(-12, 6, steps=g["big"].shape[-1]).to(device, dtype)
    g["big"] = g["big"] * scale
    if step == 1:
        g["c"][..., 7] = 1e4
        g["w"][..., :3, :] = 0
    return g


def _same(a, b) -> bool:
    la, lb = tree_leaves(a), tree_leaves(b)
    return len(la) == len(lb) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(la, lb))


def _member(tree, m):
    return tree_map(lambda t: t[m], tree)


def _hp(rule, t):
    return {"lr": 1e-2 / t, **HP[rule]}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("bits", [8, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_packed_steps_equal_the_per_param_state(device, rule, bits, dtype):
    if INTERP and (bits == 32 or dtype == torch.float16 or (dtype == torch.bfloat16 and rule != "adamw")):
        pytest.skip("the interpreter runs the 8-bit cases in fp32, and AdamW's in bf16 (the reference pass: all)")
    spec = bnbf.OptimSpec(rule=rule, state_bits=bits, min_8bit_size=256)
    p0 = _tree(dtype, device)
    s_ref = bnbf.init_state(p0, spec, HP[rule])
    s_pk = bnbf.init_state(p0, spec, HP[rule], packed=True)
    assert _same(s_pk.unpack(), s_ref)
    p_ref, p_pk = p0, p0
    # in place: against the per-param state's update_ (its plan passes the scalars as kernel arguments, the pure
    # step as a row on the device: two variants of the kernel, which may round a state's last bit differently)
    p_in, p_ref_in = {k: v.clone() for k, v in p0.items()}, {k: v.clone() for k, v in p0.items()}
    s_in = bnbf.init_state(p_in, spec, HP[rule], packed=True)
    s_ref_in = bnbf.init_state(p_ref_in, spec, HP[rule])
    for t in (1, 2):
        g = _grads(dtype, device, t)
        snap = snapshot(p_pk, g, s_pk.buffers)
        p_ref, s_ref = bnbf.update(p_ref, g, s_ref, _hp(rule, t), t)
        p_pk, s_pk = bnbf.update(p_pk, g, s_pk, _hp(rule, t), t)
        assert_untouched(snap)  # the pure step modifies nothing
        assert bnbf.update_(p_in, g, s_in, _hp(rule, t), t)[1] is s_in
        bnbf.update_(p_ref_in, g, s_ref_in, _hp(rule, t), t)
    assert _same(p_pk, p_ref) and _same(s_pk.unpack(), s_ref)
    assert _same(p_in, p_ref_in) and _same(s_in.unpack(), s_ref_in)


@pytest.mark.parametrize("device", DEVICES)
def test_in_place_steps_through_the_plan_of_its_views(device):
    """Eager update_ of a packed state, once a step checked its params and buffers, is update_'s plan of the
    per-param views (the per-param state's launches): equal to the per-param update_ at every step, and a plan
    hit still refuses a bad grad, and follows buffers or params given other memory."""
    from bnbf import functional

    # the cache of recent plans starts over when full: emptied here, the earlier tests of this worker cannot fill it
    # between the two calls of step 1 (and drop the entry checked below)
    functional._LAST.clear()
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=256)
    p, p_ref = _tree(torch.float32, device), _tree(torch.float32, device)
    s, s_ref = bnbf.init_state(p, spec, packed=True), bnbf.init_state(p_ref, spec)

    def step(t, g=None):
        g = _grads(torch.float32, device, t) if g is None else g
        bnbf.update_(p, g, s, _hp("adamw", t), t)
        bnbf.update_(p_ref, g, s_ref, _hp("adamw", t), t)
        assert _same(p, p_ref) and _same(s.unpack(), s_ref)

    step(1)
    # the reference path steps the buffers' views directly; without the compiled host checks the packed step checks
    planned = bnbf.use_triton(p["w"]) and NATIVE is not None
    views = s.plan_views()
    assert (views is not None and (id(p), id(views[0])) in functional._LAST) == planned
    step(2)
    snap = snapshot(p, s.buffers)
    with pytest.raises(ValueError, match="shape"):
        bnbf.update_(p, {**_grads(torch.float32, device, 3), "b": torch.zeros(3, device=device)}, s, {"lr": 0.1}, 3)
    assert_untouched(snap)
    old = s.buffers
    s.buffers = tuple(b.clone() for b in old)  # other memory: the step writes it, not the first buffers
    snap = snapshot(old)
    step(3)
    assert_untouched(snap)
    s.buffers[0].data = s.buffers[0].clone()  # .data = on one buffer
    p["w"].data = p["w"].clone()  # and on one param
    step(4)
    back = pickle.loads(pickle.dumps(s))  # the views kept for the plan are not part of the state
    assert _same(back.buffers, s.buffers) and (back.plan_views() is not None) == (NATIVE is not None)


@pytest.mark.parametrize("device", DEVICES)
def test_layout_and_round_trips(device):
    p = _tree(torch.bfloat16, device)
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=256)
    s = bnbf.init_state(p, spec)
    packed = bnbf.pack_state(s, p)
    # one buffer per (dtype, layout, field): 8-bit codes and absmax of two moments, 32-bit moments
    assert [b.dtype for b in packed.buffers] == [torch.float32] * 2 + [torch.uint8, torch.float32] * 2 or [
        b.dtype for b in packed.buffers
    ] == [torch.uint8, torch.float32] * 2 + [torch.float32] * 2
    views = packed.unpack()
    assert _same(views, s)
    for leaf in tree_leaves(views):  # each leaf's part starts 256 bytes into its buffer's storage, or a multiple
        assert leaf.storage_offset() * leaf.element_size() % 256 == 0
    assert _same(bnbf.dequantize_state(views), bnbf.dequantize_state(s))
    again = pickle.loads(pickle.dumps(packed))
    assert again.meta.key != packed.meta.key and _same(again.unpack(), s)
    g = _grads(torch.bfloat16, device, 1)
    (p1, s1), (p2, s2) = bnbf.update(p, g, again, {"lr": 0.1}, 1), bnbf.update(p, g, packed, {"lr": 0.1}, 1)
    assert _same(p1, p2) and _same(s1.buffers, s2.buffers)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [8, 32])
def test_vmap_members_equal_a_loop(device, bits):
    """Each member is stepped as its own state (its own blocks and absmax): members of very different
    magnitudes give what a loop of per-param steps gives, pure and in place, step by step: bit for bit off
    CUDA, within two compiled variants' bound on CUDA."""
    members = 3
    spec = bnbf.OptimSpec(rule="adamw", state_bits=bits, min_8bit_size=256)
    scale = torch.tensor([1e-3, 1.0, 50.0], device=device)
    p = tree_map(
        lambda t: t * scale.view(-1, *[1] * (t.dim() - 1)).to(t.dtype), _tree(torch.float32, device, lead=(3,))
    )
    init = torch.func.vmap(lambda q: bnbf.init_state(q, spec, packed=True))
    step = torch.func.vmap(lambda q, g, s, i: bnbf.update(q, g, s, {"lr": 0.01}, i), in_dims=(0, 0, 0, None))
    step_ = torch.func.vmap(lambda q, g, s, i: bnbf.update_(q, g, s, {"lr": 0.01}, i)[0]["w"], in_dims=(0, 0, 0, None))
    s = init(p)
    assert all(b.shape[0] == members for b in s.buffers)
    p_in = {k: v.clone() for k, v in p.items()}
    s_in = init(p_in)
    loop_p = [{k: v[m] for k, v in p.items()} for m in range(members)]
    loop_s = [bnbf.init_state(q, spec) for q in loop_p]
    pv = p
    for t in (1, 2):
        g = _grads(torch.float32, device, t, lead=(3,))
        pv, s = step(pv, g, s, t)
        step_(p_in, g, s_in, t)
        stacked, stacked_in = s.unpack(), s_in.unpack()
        for m in range(members):
            want = bnbf.update(loop_p[m], {k: v[m] for k, v in g.items()}, loop_s[m], {"lr": 0.01}, t)
            assert_trees_same_variant({k: v[m] for k, v in pv.items()}, want[0], f"step {t} member {m}: params")
            assert_trees_same_variant(
                {k: v[m] for k, v in p_in.items()}, want[0], f"step {t} member {m}: params in place"
            )
            assert_trees_same_variant(_member(stacked, m), want[1], f"step {t} member {m}: states")
            assert_trees_same_variant(_member(stacked_in, m), want[1], f"step {t} member {m}: states in place")
        # every route starts the next step from the same values: on CUDA each is its own compiled variant
        for x, y in zip(tree_leaves((p_in, s_in.buffers)), tree_leaves((pv, s.buffers))):
            x.copy_(y)
        loop_p = [{k: v[m].clone() for k, v in pv.items()} for m in range(members)]
        loop_s = [tree_map(torch.clone, _member(stacked, m)) for m in range(members)]


def _junk(buffers, members=()):
    """Fill and free tensors of the buffers' sizes, so that a step's fresh buffers are likely to get memory holding
    NaN (floats) and 0x77 bytes where the step writes nothing."""
    junk = [torch.full((*members, *b.shape[-1:]), float("nan"), dtype=torch.float32, device=b.device) for b in buffers]
    junk += [torch.full((*members, *b.shape[-1:]), 0x77, dtype=torch.uint8, device=b.device) for b in buffers]
    del junk


@pytest.mark.parametrize("device", DEVICES)
def test_the_pure_steps_buffers_equal_the_in_place_steps_byte_for_byte(device):
    """The bytes between the leaves' parts (each part starts 256-byte aligned), which no step writes, are zero in
    the pure step's fresh buffers as in the in-place step's (pack_state's zeros): they held whatever the allocator
    gave, NaN in a float buffer among them (eager and vmapped)."""
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=256)
    p = _tree(torch.float32, device)
    s = bnbf.init_state(p, spec, packed=True)
    assert any(sum(n) < b.numel() for g in s.meta.groups for n, b in zip(g.numels, s.buffers[g.first :]))
    q, s_in = tree_map(torch.clone, p), bnbf.PackedState([b.clone() for b in s.buffers], s.meta)
    for t in (1, 2):
        g = _grads(torch.float32, device, t)
        _junk(s.buffers)
        p, s = bnbf.update(p, g, s, {"lr": 0.01}, t)
        bnbf.update_(q, g, s_in, {"lr": 0.01}, t)
        assert _same(p, q) and _same(s.buffers, s_in.buffers)
    members = 2
    p = _tree(torch.float32, device, lead=(members,))
    s = torch.func.vmap(lambda x: bnbf.init_state(x, spec, packed=True))(p)
    s_in = bnbf.PackedState([b.clone() for b in s.buffers], s.meta)
    q = tree_map(torch.clone, p)
    g = _grads(torch.float32, device, 1, lead=(members,))
    _junk(s.buffers, (members,))
    p, s = torch.func.vmap(lambda a, b, c: bnbf.update(a, b, c, {"lr": 0.01}, 1))(p, g, s)
    torch.func.vmap(lambda a, b, c: bnbf.update_(a, b, c, {"lr": 0.01}, 1)[0]["w"])(q, g, s_in)
    assert _same(s.buffers, s_in.buffers)


def test_vmap_with_a_hyperparameter_per_member():
    members = 3
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=256)
    p = _tree(torch.float32, "cpu", lead=(members,))
    g = _grads(torch.float32, "cpu", 2, lead=(members,))
    lrs = torch.tensor([1e-3, 1e-2, 1e-1])
    s = torch.func.vmap(lambda q: bnbf.init_state(q, spec, packed=True))(p)
    step = torch.func.vmap(lambda q, gg, ss, lr: bnbf.update(q, gg, ss, {"lr": lr}, 1))
    pv, sv = step(p, g, s, lrs)
    for m in range(members):
        q = {k: v[m] for k, v in p.items()}
        want = bnbf.update(q, {k: v[m] for k, v in g.items()}, bnbf.init_state(q, spec), {"lr": lrs[m]}, 1)
        assert _same({k: v[m] for k, v in pv.items()}, want[0])
        assert _same(_member(sv.unpack(), m), want[1])


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("in_place", [False, True], ids=["update", "update_"])
@pytest.mark.parametrize("numbers", ["tensors", "python"])
def test_compile_fullgraph_without_recompiles(device, in_place, numbers):
    """One graph, no break; hyperparameters and step as 0-d tensors compile once, as Python numbers that change
    every call at most twice (Dynamo's automatic dynamic, as for the per-param state); equal to the eager step.
    The interpreter pass runs the tensor case (how numbers are traced is Dynamo's, the same on either path)."""
    if INTERP and numbers == "python":
        pytest.skip("Python-number tracing: the reference pass and CUDA")
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=256)

    def pure(q, g, s, lr, t):
        return bnbf.update(q, g, s, {"lr": lr, "weight_decay": 0.01}, t)

    def inplace(q, g, s, lr, t):
        bnbf.update_(q, g, s, {"lr": lr, "weight_decay": 0.01}, t)
        return q, s

    fn = inplace if in_place else pure
    cnt = CompileCounter()
    compiled = torch.compile(fn, fullgraph=True, backend=cnt)
    p0 = _tree(torch.float32, device)
    got_p, got_s = {k: v.clone() for k, v in p0.items()}, bnbf.init_state(p0, spec, packed=True)
    want_p, want_s = {k: v.clone() for k, v in p0.items()}, bnbf.init_state(p0, spec)
    for t in range(1, 5):
        lr, step = 1e-2 / t, t
        if numbers == "tensors":
            lr, step = torch.tensor(lr, device=device), torch.tensor(step, device=device)
        g = _grads(torch.float32, device, t)
        got_p, got_s = compiled(got_p, g, got_s, lr, step)
        want_p, want_s = fn(want_p, g, want_s, lr, step)
    assert cnt.frame_count == (1 if numbers == "tensors" else 2)
    assert _same(got_p, want_p) and _same(got_s.unpack(), want_s)


def _bad_inputs():
    p = _tree(torch.float32, "cpu")
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=256)
    s = bnbf.init_state(p, spec, packed=True)
    g = _grads(torch.float32, "cpu", 2)
    return p, g, s


@pytest.mark.parametrize(
    ("mutate", "error", "match"),
    [
        (lambda p, g, s: ({**p, "extra": torch.zeros(3)}, {**g, "extra": torch.zeros(3)}, s), ValueError, "structure"),
        (
            lambda p, g, s: ({**p, "w": torch.zeros(17, 33)}, {**g, "w": torch.zeros(17, 33)}, s),
            ValueError,
            "built for",
        ),
        (lambda p, g, s: ({**p, "b": p["b"].double()}, {**g, "b": g["b"].double()}, s), TypeError, "dtype"),
        (lambda p, g, s: ({**p, "b": p["b"].half()}, {**g, "b": g["b"].half()}, s), ValueError, "built for"),
        (lambda p, g, s: (p, {**g, "b": g["b"][:3]}, s), ValueError, "shape"),
        (lambda p, g, s: (p, {**g, "b": g["b"].half()}, s), TypeError, "dtype"),
        (lambda p, g, s: (p, g, bnbf.PackedState(s.buffers[:-1], s.meta)), ValueError, "buffers"),
        (lambda p, g, s: (p, g, bnbf.PackedState([b[:-1] for b in s.buffers], s.meta)), ValueError, "buffer 0"),
        (lambda p, g, s: (p, g, bnbf.PackedState([b.expand(2, -1) for b in s.buffers], s.meta)), ValueError, "vmap"),
        (lambda p, g, s: (p, g, bnbf.PackedState(["x", *s.buffers[1:]], s.meta)), ValueError, "buffer 0 is str"),
    ],
    ids=[
        "structure",
        "shape",
        "float64",
        "param dtype",
        "grad shape",
        "grad dtype",
        "buffers",
        "size",
        "stacked",
        "not a tensor",
    ],  # fmt: skip
)
@pytest.mark.parametrize("in_place", [False, True])
def test_bad_input_raises_and_modifies_nothing(mutate, error, match, in_place):
    p, g, s = mutate(*_bad_inputs())
    snap = snapshot(p, g, s.buffers)
    with pytest.raises(error, match=match):
        (bnbf.update_ if in_place else bnbf.update)(p, g, s, {"lr": 0.1}, 1)
    assert_untouched(snap)


@pytest.mark.parametrize("in_place", [False, True])
def test_a_schedule_steps_a_packed_state_as_its_value(in_place):
    """A schedule (a callable of the step) in the one mapping a packed state takes is its value at the step, as for
    the per-param state (it was refused as a per-leaf mapping)."""
    p, g, s = _bad_inputs()
    step = bnbf.update_ if in_place else bnbf.update
    runs = []
    for lr in (lambda t: 0.05 * t, 0.1):
        q, st = tree_map(torch.clone, p), bnbf.PackedState([b.clone() for b in s.buffers], s.meta)
        new_p, new_s = step(q, g, st, {"lr": lr, "betas": (0.9, lambda t: 0.999)}, 2)
        runs.append(tree_leaves((new_p, new_s.buffers)))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_options_a_packed_state_does_not_take_are_refused():
    p, g, s = _bad_inputs()
    snap = snapshot(p, g, s.buffers)
    with pytest.raises(ValueError, match="differentiable=True takes the per-param state"):
        bnbf.update(p, g, s, {"lr": 0.1}, 1, differentiable=True)
    with pytest.raises(ValueError, match="max_grad_norm"):
        bnbf.update_(p, g, s, {"lr": 0.1}, 1, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="one mapping"):
        bnbf.update(p, g, s, {"adamw": {"lr": 0.1}}, 1)
    with pytest.raises(ValueError, match="Invalid step: 0"):
        bnbf.update(p, g, s, {"lr": 0.1}, 0)
    sgd = bnbf.init_state(p, bnbf.OptimSpec(rule="sgd"), {"momentum": 0.9}, packed=True)
    with pytest.raises(ValueError, match="keeps"):  # the state keeps what these hyperparameters use
        bnbf.update_(p, g, sgd, {"lr": 0.1, "momentum": 0.0}, 1)
    with pytest.raises(RuntimeError, match="not differentiable"):
        bnbf.update(p, g, s, {"lr": torch.tensor(0.1, requires_grad=True)}, 1)
    with pytest.raises(TypeError, match="packed must be a bool"):
        bnbf.init_state(p, bnbf.OptimSpec(), packed=1)
    with pytest.raises(ValueError, match="not paged"):
        bnbf.init_state(p, bnbf.OptimSpec(paged=True), packed=True)
    mixed = {"a": bnbf.init_state(p["w"], bnbf.OptimSpec(rule="lion")), "b": bnbf.init_state(p["b"], bnbf.OptimSpec())}
    with pytest.raises(ValueError, match="one rule"):
        bnbf.pack_state(mixed, {"a": p["w"], "b": p["b"]})
    q = dict(p, c=p["w"].view(-1)[:257])  # "c" a view of "w": the in-place step would write both
    state_q = bnbf.init_state(q, bnbf.OptimSpec(min_8bit_size=256), packed=True)
    with pytest.raises(ValueError, match="in-place step of a packed state overlap in memory"):
        bnbf.update_(q, dict(g, c=torch.zeros(257)), state_q, {"lr": 0.1}, 1)
    assert_untouched(snap)


def _two_groups(device, **tensors):
    """A packed AdamW state of ``tensors``' shapes: 8-bit state for those of 256 elements or more, 32-bit for the
    rest (two layout groups, in the order of their first leaf)."""
    s = bnbf.init_state({k: torch.zeros(v.shape, device=device) for k, v in tensors.items()},
                        bnbf.OptimSpec(rule="adamw", min_8bit_size=256), packed=True)  # fmt: skip
    assert len(s.meta.groups) == 2
    return s


@pytest.mark.parametrize("device", DEVICES)
def test_params_sharing_memory_across_layout_groups_are_refused(device):
    """Two params of different layout groups (8-bit and 32-bit state) sharing memory: update_ refuses them before
    any group is written (each group's own check saw no overlap, and both groups stepped the shared memory); also
    where each group's memory was checked at other calls, never together. The pure step refuses them too (two new
    values for the same memory), as the per-param state's update does."""
    base = torch.randn(1024, device=device)
    p = {"big": base[:512], "small": base[:200]}  # "small" a view of "big": 32-bit state, "big" 8-bit
    s = _two_groups(device, **p)
    g = {"big": torch.randn(512, device=device), "small": torch.randn(200, device=device)}
    snap = snapshot(base, g, s.buffers)
    with pytest.raises(ValueError, match=r"param\['big'\] and param\['small'\] of this in-place step of a packed"):
        bnbf.update_(p, g, s, {"lr": 0.1}, 1)
    assert_untouched(snap)
    with pytest.raises(ValueError, match=r"param\['big'\] and param\['small'\] overlap in memory"):
        bnbf.update(p, g, s, {"lr": 0.1}, 1)
    assert_untouched(snap)
    # each group's params at addresses a step checked (the Triton path caches its launch groups by address), then
    # both at once, overlapping
    bnbf.update_({"big": base[:512], "small": base[600:800]}, g, s, {"lr": 0.1}, 1)
    bnbf.update_({"big": base[512:], "small": base[:200]}, g, s, {"lr": 0.1}, 2)
    snap = snapshot(base, s.buffers)
    with pytest.raises(ValueError, match="in-place step of a packed state overlap in memory"):
        bnbf.update_({"big": base[:512], "small": base[:200]}, g, s, {"lr": 0.1}, 3)
    assert_untouched(snap)


@pytest.mark.parametrize("device", DEVICES)
def test_an_overlap_in_a_later_group_is_refused_before_the_earlier_groups_are_written(device):
    """Two overlapping params of the second layout group: refused before the first group (a leaf of its own) was
    stepped (it had been, then the second group's check raised)."""
    base = torch.randn(768, device=device)
    p = {"small": torch.randn(100, device=device), "x": base[:512], "y": base[256:]}
    s = _two_groups(device, **p)
    assert [len(grp.leaves) for grp in s.meta.groups] == [1, 2]  # "small" first
    g = {k: torch.randn(v.shape, device=device) for k, v in p.items()}
    snap = snapshot(p["small"], base, g, s.buffers)
    with pytest.raises(ValueError, match="in-place step of a packed state overlap in memory") as raised:
        bnbf.update_(p, g, s, {"lr": 0.1}, 1)
    assert_untouched(snap)
    assert "param['x'] and param['y']" in str(raised.value)


@pytest.mark.parametrize("device", DEVICES)
def test_a_grad_sharing_memory_with_what_update__writes_is_refused(device):
    """update_ of a packed state refuses a grad sharing memory with another leaf's param (here of the other
    layout group) or a state field, as the per-param state's update_ does: the step would read it while writing
    it. Nothing is written, also once the plan of the buffers' views steps the loop. A grad that is its own param
    steps; the pure step writes nothing in place and takes any grad, as the per-param state's pure step."""
    p = {"a": torch.randn(300, device=device), "b": torch.randn(200, device=device)}
    s = _two_groups(device, **p)
    s_ref = bnbf.init_state(p, bnbf.OptimSpec(rule="adamw", min_8bit_size=256))
    field = s.unpack()["b"]._fields[0]
    other = torch.randn(300, device=device)
    for g, match in [
        ({"a": other, "b": p["a"][100:]}, r"grad\['b'\] shares memory with param\['a'\]"),
        ({"a": other, "b": getattr(s.unpack()["b"], field)}, rf"grad\['b'\] shares memory with state\['b'\]\.{field}"),
    ]:  # fmt: skip
        snap = snapshot(p, g, s.buffers)
        with pytest.raises(ValueError, match=match):
            bnbf.update_(p, g, s, {"lr": 0.1}, 1)
        assert_untouched(snap)
        got, want = bnbf.update(p, g, s, {"lr": 0.1}, 1), bnbf.update(p, g, s_ref, {"lr": 0.1}, 1)
        assert_untouched(snap)
        assert _same(got[0], want[0]) and _same(got[1].unpack(), want[1])
    # the same containers stepped twice (the plan's route on the Triton path), then a grad on a param
    g = {"a": torch.randn(300, device=device), "b": torch.randn(200, device=device)}
    for t in (1, 2):
        bnbf.update_(p, g, s, {"lr": 0.1}, t)
    bad = {"a": g["a"], "b": p["a"][:200]}
    snap = snapshot(p, bad, s.buffers)
    with pytest.raises(ValueError, match=r"grad\['b'\] shares memory with param\['a'\]"):
        bnbf.update_(p, bad, s, {"lr": 0.1}, 3)
    assert_untouched(snap)
    # a grad that is its own param: read and written element by element, as the per-param update_ steps it
    q = {k: v.clone() for k, v in p.items()}
    s, s_q = _two_groups(device, **p), bnbf.init_state(q, bnbf.OptimSpec(rule="adamw", min_8bit_size=256))
    bnbf.update_(p, {"a": p["a"], "b": g["b"]}, s, {"lr": 0.1}, 1)
    bnbf.update_(q, {"a": q["a"], "b": g["b"]}, s_q, {"lr": 0.1}, 1)
    assert _same(p, q) and _same(s.unpack(), s_q)


@settings(max_examples=8 if INTERP else 25, deadline=None)
@given(
    numels=st.lists(st.sampled_from([1, 3, 64, 255, 256, 257, 1000, 4097]), min_size=1, max_size=5),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    rule=st.sampled_from(["adamw", "lion", "adan"]),
    magnitude=st.sampled_from([1e-12, 1e-3, 1.0, 1e6]),
)
def test_hypothesis_packed_equals_per_param(numels, dtype, rule, magnitude):
    spec = bnbf.OptimSpec(rule=rule, min_8bit_size=256, block_size=64)
    gen = torch.Generator().manual_seed(len(numels))
    p = [torch.randn(n, generator=gen).to(dtype) for n in numels]
    g = [(torch.randn(n, generator=gen) * magnitude).to(dtype) for n in numels]
    want = bnbf.update(p, g, bnbf.init_state(p, spec), {"lr": 1e-3}, 1)
    got = bnbf.update(p, g, bnbf.init_state(p, spec, packed=True), {"lr": 1e-3}, 1)
    assert _same(got[0], want[0]) and _same(got[1].unpack(), want[1])


def test_nested_vmap_is_refused():
    """vmap of vmap (inputs still wrapped by the outer transform) raises a clear error, never a wrong result."""
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=0)
    p = {"w": torch.randn(2, 3, 300)}
    g = {"w": torch.randn(2, 3, 300)}
    s = torch.func.vmap(torch.func.vmap(lambda q: bnbf.init_state(q, spec, packed=True)))(p)
    step = torch.func.vmap(torch.func.vmap(lambda q, gg, ss: bnbf.update(q, gg, ss, {"lr": 0.1}, 1)))
    with pytest.raises(RuntimeError, match="nested torch.func transforms"):
        step(p, g, s)


@pytest.mark.parametrize("device", DEVICES)
def test_a_step_inside_vmap_of_tensors_it_does_not_batch(device):
    """update_ of params and a packed state that a vmapped function closes over (nothing batched at that level):
    one step, as outside vmap (the per-param state's behaviour), equal to the pure step."""
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=256)
    p, g = _tree(torch.float32, device), _grads(torch.float32, device, 1)
    s = bnbf.init_state(p, spec, packed=True)
    want_p, want_s = bnbf.update(p, g, s, {"lr": 0.1}, 1)

    def body(x):
        bnbf.update_(p, g, s, {"lr": 0.1}, 1)
        return x * 2

    torch.func.vmap(body)(torch.ones(3, device=device))
    assert _same(p, want_p) and _same(s.unpack(), want_s.unpack())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-graph capture")
def test_capture_is_refused():
    p = {"w": torch.randn(4096, device="cuda")}
    g = {"w": torch.randn(4096, device="cuda")}
    s = bnbf.init_state(p, bnbf.OptimSpec(), packed=True)
    lr, t = torch.tensor(0.1, device="cuda"), torch.tensor(1, device="cuda")
    bnbf.update_(p, g, s, {"lr": lr}, t)  # warm: the same call eager works
    with pytest.raises(RuntimeError, match="cannot be captured"), torch.cuda.graph(torch.cuda.CUDAGraph()):
        bnbf.update_(p, g, s, {"lr": lr}, t)


@pytest.mark.parametrize("rule", ["sgd", "lars"])
def test_a_configuration_without_state_is_refused_by_name(rule):
    """SGD or LARS without momentum keeps no state: a packed state would have no buffers, and its steps failed with
    an unrelated ValueError (update) or an IndexError (update_). Refused when made, naming the per-param state."""
    p = {"w": torch.randn(300), "b": torch.randn(4)}
    with pytest.raises(ValueError, match="keeps no state with these hyperparameters.*without packed=True"):
        bnbf.init_state(p, bnbf.OptimSpec(rule=rule), {"lr": 0.1}, packed=True)
    with pytest.raises(ValueError, match="keeps no state with these hyperparameters"):
        bnbf.pack_state(bnbf.init_state(p, bnbf.OptimSpec(rule=rule), {"lr": 0.1}), p)


_SAVED_TREES = {
    "dict": lambda w, b: {"w": w, "b": b},
    "list": lambda w, b: [w, b],
    "tuple": lambda w, b: (w, b),
    "nested": lambda w, b: {"enc": {"w": w}, "head": [b]},
}


@pytest.mark.parametrize("tree", sorted(_SAVED_TREES))
def test_a_saved_packed_state_loads_with_torch_loads_defaults(tree):
    """``torch.load``'s default ``weights_only=True`` takes a saved packed state (its classes are registered as the
    per-param states' are), and the loaded state steps as the saved one; of a list, a tuple or a nested tree too
    (their structure was pickled as the list and tuple types and torch's TreeSpec, which the default refuses)."""
    import io

    params = _SAVED_TREES[tree](torch.randn(300), torch.randn(7, dtype=torch.bfloat16))
    state = bnbf.init_state(params, bnbf.OptimSpec(rule="adamw", min_8bit_size=0), packed=True)
    grads = tree_map(torch.randn_like, params)
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf)
    assert type(loaded) is type(state)
    (p1, s1), (p2, s2) = (bnbf.update(params, grads, s, {"lr": 0.1}, 1) for s in (state, loaded))
    for x, y in zip(tree_leaves((p1, s1.unpack())), tree_leaves((p2, s2.unpack()))):
        assert torch.equal(x, y)


# every kind of layout a packed state holds, saved and loaded with torch.load's default
_SAVED_LAYOUTS = {
    "8-bit power": ("adamw", {"min_8bit_size": 0}, {}),
    "8-bit dynamic, blocks of 64": ("adamw", {"min_8bit_size": 0, "state_format": "dynamic", "block_size": 64}, {}),
    "32-bit": ("adamw", {"state_bits": 32}, {}),
    "amsgrad, blocks of 4096": ("adamw", {"min_8bit_size": 512, "block_size": 4096}, {"amsgrad": True}),
    **{rule: (rule, {"min_8bit_size": 512}, HP[rule]) for rule in HP if rule != "adamw"},
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(_SAVED_LAYOUTS))
def test_every_layout_round_trips_through_torch_loads_defaults(case):
    """A packed state of each layout (8-bit power and dynamic, 32-bit, amsgrad's third slot, each rule; params of
    three dtypes, a 0-d and an empty one) loads with ``weights_only=True`` as it was saved: the same buffers and
    meta, and an in-place step from it equals one from the saved state bit for bit."""
    import io

    rule, spec, hp = _SAVED_LAYOUTS[case]
    if INTERP and rule not in RULES + ["adam"]:
        pytest.skip("the interpreter steps a few rules (the reference pass: all)")
    gen = torch.Generator().manual_seed(3)
    shapes = {"w": ((33, 17), torch.float32), "big": ((1031,), torch.bfloat16), "h": ((300,), torch.float16),
              "s": ((), torch.float32), "z": ((0,), torch.float32)}  # fmt: skip
    params = {k: torch.randn(s, generator=gen).to(d) for k, (s, d) in shapes.items()}
    state = bnbf.init_state(params, bnbf.OptimSpec(rule=rule, **spec), hp, packed=True)
    bnbf.update_(params, tree_map(torch.randn_like, params), state, {"lr": 0.1, **hp}, 1)  # states not at zero
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf)
    assert type(loaded) is bnbf.PackedState and loaded.meta._plain() == state.meta._plain()
    assert _same(loaded.buffers, state.buffers)
    again = {k: v.clone() for k, v in params.items()}
    grads = tree_map(torch.randn_like, params)
    bnbf.update_(params, grads, state, {"lr": 0.1, **hp}, 2)
    bnbf.update_(again, grads, loaded, {"lr": 0.1, **hp}, 2)
    assert _same(again, params) and _same(loaded.buffers, state.buffers)


def test_a_state_stacked_by_vmap_round_trips_through_torch_loads_defaults():
    """An ensemble's packed state (buffers ``[members, n]``) loads with ``weights_only=True`` as it was saved."""
    import io

    stacked = {"w": torch.randn(3, 4096), "b": torch.randn(3, 7)}
    state = torch.vmap(lambda p: bnbf.init_state(p, bnbf.OptimSpec(rule="adamw"), packed=True))(stacked)
    assert state.buffers[0].dim() == 2
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf)
    assert loaded.meta._plain() == state.meta._plain() and _same(loaded.buffers, state.buffers)


def _crafted_file(tamper, pickle_module=pickle) -> io.BytesIO:
    """A saved packed state (three layout groups: ``big``'s 8-bit state in buffers 0-3, ``w`` and ``v``'s 32-bit
    state in buffers 4-5 at offsets 0 and 320, ``h``'s (bfloat16) in buffers 6-7) with ``tamper(meta, buffers)``
    applied to its meta and buffers before it is written, as a file made to mislead the loader could be."""
    params = {"big": torch.randn(4096), "w": torch.randn(300), "v": torch.randn(300), "h": torch.randn(7).bfloat16()}
    state = bnbf.init_state(params, bnbf.OptimSpec(rule="adamw"), packed=True)
    meta, buffers = state.meta, list(state.buffers)
    assert [g.leaves for g in meta.groups] == [(0,), (1, 2), (3,)] and meta.groups[1].offsets[0] == (0, 320)
    assert [n for _, n in meta.sizes] == [4096, 64, 4096, 64, 640, 640, 64, 64]
    tamper(meta, buffers)
    state.buffers = tuple(buffers)
    out = io.BytesIO()
    torch.save(state, out, pickle_module=pickle_module)
    out.seek(0)
    return out


def _group(gi, **fields):
    """A tampering that replaces fields of layout group ``gi`` (``layout`` a dict: fields of its layout)."""

    def tamper(meta, buffers):
        groups = list(meta.groups)
        layout = groups[gi].layout._replace(**fields.pop("layout", {}))
        groups[gi] = groups[gi]._replace(layout=layout, **fields)
        meta.groups = tuple(groups)

    return tamper


def _meta(**fields):
    def tamper(meta, buffers):
        for name, value in fields.items():
            setattr(meta, name, value)

    return tamper


def _as_uint8(k):
    """Buffer ``k`` (float32) recorded and saved as uint8 of as many elements: the kernels would write 4 bytes to
    each of its 1-byte elements (under TRITON_INTERPRET=1 an in-place step wrote past it, a pure one aborted)."""

    def tamper(meta, buffers):
        n = meta.sizes[k][1]
        meta.sizes = (*meta.sizes[:k], (torch.uint8, n), *meta.sizes[k + 1 :])
        buffers[k] = torch.zeros(n, dtype=torch.uint8)

    return tamper


_CRAFTED = {
    "32-bit field saved as uint8": (_as_uint8(4), "buffer 4 is torch.uint8, its field of layout group 1 torch.float32"),
    "absmax saved as uint8": (_as_uint8(1), "buffer 1 is torch.uint8"),
    "part past its buffer": (_group(1, offsets=((0, 384), (0, 320))), r"buffer 4 \(elements 384 to 684\) ends past"),
    "parts overlapping": (_group(1, offsets=((0, 64), (0, 320))), "parts of buffer 4 overlap"),
    "part not aligned": (_group(1, offsets=((0, 321), (0, 320))), r"buffer 4 \(elements 321 to 621\) does not start"),
    "part of another size": (_group(1, numels=((300, 299), (300, 300))), "has 299 elements, its field 300"),
    "float offset": (_group(1, offsets=((0.0, 320), (0, 320))), "group 1 field 0: not an offset and a size"),
    "leaf in two groups": (_group(1, leaves=(1, 1)), r"leaves \[0, 1, 1, 3\] of 4"),
    "group of two param dtypes": (_meta(dtypes=(torch.float32,) * 2 + (torch.bfloat16,) * 2), "several dtypes"),
    "block size no spec makes": (_group(0, layout={"block_size": 32}), r"block_size must be a power of two .*, got 32"),
    "unknown 8-bit format": (_group(0, layout={"format": "bogus"}), r"state_format must be one of .*, got 'bogus'"),
    "16-bit state": (_group(1, layout={"bits": 16}), "state_bits must be 8 or 32, got 16"),
    "32-bit state with a block size": (_group(1, layout={"block_size": 256}), "is not the layout its spec makes"),
    "slots beyond the rule's": (_group(1, layout={"present": 8}), "kept slots 8 are not a mask"),
    "another rule's layout": (_group(1, layout={"rule": "lion", "present": 1}), "group 1 is of rule 'lion'"),
    "fields from another buffer": (_group(2, first=5), "group 2's fields start at buffer 5, not at 6"),
    "unknown rule": (_meta(rule="nadam"), "unknown rule 'nadam'"),
    "int param dtype": (_meta(dtypes=(torch.int32,) + (torch.float32,) * 2 + (torch.bfloat16,)), "param dtypes"),
    "negative dim": (_meta(shapes=((4096,), (300,), (300,), (-7,))), "shapes are not tuples of non-negative"),
    "structure of other leaves": (_meta(spec=("dict", ("big", "w", "v"))), "structure has 3 leaves, its shapes 4"),
    "buffer shorter than its size": (
        lambda meta, buffers: buffers.__setitem__(5, buffers[5][:576]),
        r"buffer 5 is torch.float32 \[576\], its layout gives torch.float32 \[640\]",
    ),
    "buffer missing": (lambda meta, buffers: buffers.pop(), "it has 7 buffers, its layout 8"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(_CRAFTED))
def test_a_crafted_packed_state_is_refused_when_loaded(case):
    """``torch.load``'s default built a packed state from whatever a file said: offsets, sizes, dtypes and layouts
    that do not fit the buffers, which the kernels (raw addresses: the buffer's plus the part's offset, read as the
    layout's dtype) would read and write past. Each is now refused by name when loaded, nothing made."""
    tamper, match = _CRAFTED[case]
    with pytest.raises(ValueError, match=f"not a bnbf packed state: .*{match}"):
        torch.load(_crafted_file(tamper))


def _writing(reduce):
    """A pickle module whose Pickler writes packed states and metas as ``reduce(obj)`` says (an older bnbf's form,
    or a file's own)."""
    from bnbf.packed import PackedMeta

    class Pickler(pickle.Pickler):
        def reducer_override(self, obj):
            return reduce(obj) if type(obj) in (bnbf.PackedState, PackedMeta) else NotImplemented

    return types.SimpleNamespace(__name__="pickle", Pickler=Pickler, Unpickler=pickle.Unpickler)


def test_a_packed_state_or_meta_built_field_by_field_does_not_load():
    """The classes were registered with torch's safe globals themselves, so a file could make a meta without its
    constructor and set each field: here the key of another live meta, by which the ops find a meta and the
    launcher its cached tables (another state's offsets). Only the checking function is registered now."""
    import copyreg

    from bnbf.packed import PackedMeta

    live = bnbf.init_state({"w": torch.randn(8192)}, bnbf.OptimSpec(rule="adamw"), packed=True)

    def fields(obj):
        if type(obj) is bnbf.PackedState:
            return copyreg.__newobj__, (bnbf.PackedState,), (None, {"buffers": obj.buffers, "meta": obj.meta})
        names = ("spec", "shapes", "dtypes", "rule", "groups", "sizes")
        return copyreg.__newobj__, (PackedMeta,), (None, {"key": live.meta.key, **{k: getattr(obj, k) for k in names}})

    with pytest.raises(pickle.UnpicklingError, match="GLOBAL bnbf.packed.PackedState"):
        torch.load(_crafted_file(lambda meta, buffers: None, _writing(fields)))
    meta_only = io.BytesIO()
    torch.save(live.meta, meta_only, pickle_module=_writing(fields))
    meta_only.seek(0)
    with pytest.raises(pickle.UnpicklingError, match="GLOBAL bnbf.packed.PackedMeta"):
        torch.load(meta_only)


def test_a_packed_state_saved_in_the_earlier_form_loads_only_from_a_trusted_file():
    """bnbf pickled a packed state as its class called with the buffers and a meta rebuilt from its fields (written
    two days before, promised nowhere): that form is the hole (the class constructs unchecked), so ``torch.load``'s
    default refuses it; ``weights_only=False`` (a file one trusts) still loads it, its meta checked."""
    from bnbf.packed import PackedMeta, _plain_spec, _rebuild_meta

    def earlier(obj):
        if type(obj) is bnbf.PackedState:
            return bnbf.PackedState, (obj.buffers, obj.meta)
        return _rebuild_meta, (_plain_spec(obj.spec), obj.shapes, obj.dtypes, obj.rule, obj.groups, obj.sizes)

    with pytest.raises(pickle.UnpicklingError, match="GLOBAL bnbf.packed.PackedState"):
        torch.load(_crafted_file(lambda meta, buffers: None, _writing(earlier)))
    params = {"big": torch.randn(4096), "w": torch.randn(300), "v": torch.randn(300), "h": torch.randn(7).bfloat16()}
    state = bnbf.init_state(params, bnbf.OptimSpec(rule="adamw"), packed=True)
    buf = io.BytesIO()
    torch.save(state, buf, pickle_module=_writing(earlier))
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert type(loaded.meta) is PackedMeta and loaded.meta._plain() == state.meta._plain()
    grads = tree_map(torch.randn_like, params)
    (p1, s1), (p2, s2) = (bnbf.update(params, grads, s, {"lr": 0.1}, 1) for s in (state, loaded))
    assert _same(p1, p2) and _same(s1.buffers, s2.buffers)
    with pytest.raises(ValueError, match="not a bnbf packed state: .*buffer 4 is torch.uint8"):
        torch.load(_crafted_file(_as_uint8(4), _writing(earlier)), weights_only=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_updates_of_16bit_params_with_a_packed_state(dtype):
    """``bnbf.updates`` steps float32 copies of the params: with a packed state made for 16-bit params it equals the
    per-param state's ``updates`` (the updates, and the new state unpacked), and returns a packed state."""
    params = {"w": torch.randn(4097).to(dtype), "b": torch.randn(7).to(dtype), "f": torch.randn(300)}
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=0)
    per_param = bnbf.init_state(params, spec)
    packed = bnbf.init_state(params, spec, packed=True)
    before = [t.clone() for t in packed.buffers]
    u1, s1 = bnbf.updates(params, grads, per_param, {"lr": 0.1}, 1)
    u2, s2 = bnbf.updates(params, grads, packed, {"lr": 0.1}, 1)
    assert type(s2) is type(packed)
    for x, y in zip(tree_leaves((u1, s1)), tree_leaves((u2, s2.unpack()))):
        assert torch.equal(x, y)
    assert all(torch.equal(a, b) for a, b in zip(packed.buffers, before))


@pytest.mark.parametrize("case", ["twice", "overlapping"])
def test_the_pure_step_refuses_a_param_listed_twice_or_overlapping(case):
    """The packed state's pure ``update`` of one tensor listed twice (or two overlapping views) returned two
    different new values for the same memory; refused as the per-param state's ``update`` refuses it (the in-place
    step already did), with the per-param state's words."""
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=0)
    w = torch.randn(600)
    params = {"a": w[:300], "b": w[:300] if case == "twice" else w[100:400]}
    if case == "twice":
        params["b"] = params["a"]
    grads = {"a": torch.randn(300), "b": torch.randn(300)}
    state = bnbf.init_state({"a": torch.zeros(300), "b": torch.zeros(300)}, spec, packed=True)
    match = "are the same tensor" if case == "twice" else "overlap in memory"
    for packed in (state, bnbf.init_state({"a": torch.zeros(300), "b": torch.zeros(300)}, spec)):
        with pytest.raises(ValueError, match=rf"param\['a'\] and param\['b'\] {match}"):
            bnbf.update(params, grads, packed, {"lr": 1e-2}, 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["set_", "same tensor", "param in a buffer"])
def test_the_pure_step_refuses_buffers_sharing_memory(device, case):
    """The pure ``update`` of a packed state whose exp_avg_sq buffer was ``set_`` to its exp_avg buffer stepped
    them as one (NaN params), where ``update_`` and the per-param state's ``update`` refuse states sharing memory.
    Refused with the per-param state's words before anything is computed; nothing written."""
    params = {"a": torch.randn(4, 300, device=device), "b": torch.randn(300, device=device)}
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    params, state = bnbf.update(params, grads, bnbf.init_state(params, bnbf.OptimSpec(state_bits=32), packed=True),
                                {"lr": 1e-2}, 1)  # fmt: skip
    if case == "set_":
        state.buffers[1].set_(state.buffers[0])
    elif case == "same tensor":
        state = type(state)((state.buffers[0], state.buffers[0]), state.meta)
    else:
        params["b"] = state.buffers[1][:300]
    snap = snapshot(params, grads, state.buffers)
    if case == "param in a buffer":
        match = r"^param\['b'\] and packed state buffer 1 \(exp_avg_sq\) overlap in memory: a param and a state"
    else:
        match = r"^packed state buffer 0 \(exp_avg\) and packed state buffer 1 \(exp_avg_sq\) overlap in memory: the st"
    with pytest.raises(ValueError, match=match):
        bnbf.update(params, grads, state, {"lr": 1e-2}, 2)
    assert_untouched(snap, f"the pure update of buffers sharing memory ({case})")
    with pytest.raises(ValueError, match="overlap in memory"):  # as the per-param state's update refuses it
        bnbf.update(params, grads, state.unpack(), {"lr": 1e-2}, 2)

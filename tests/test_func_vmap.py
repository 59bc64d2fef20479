"""``torch.func.vmap`` over ensembles: ``init_state``, ``update`` and ``update_`` of stacked params.

Each member is quantized on its own (its own blocks and absmax), so the results equal a loop over the members
bit for bit, on the reference path and under ``TRITON_INTERPRET=1`` (the Triton kernels). The op's batching
rule hands all members of all tensors to one call of the step (one launch on the Triton path); a whole
``grad_and_value`` + ``update`` step of an ensemble of models (torch.func's model-ensembling recipe) matches the
members trained one by one (to the rounding of the batched forward pass).
"""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import DEVICES, triton_mode
from torch._C._functorch import is_batchedtensor
from torch.func import functional_call, grad_and_value, stack_module_state
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

import bnbf
import bnbf._vmap_memo
import bnbf.kernels.launcher as launcher
import bnbf.kernels.members as members
import bnbf.ops
import bnbf.rules
from bnbf._bounded import Bounded
from bnbf.plan import _scalars, scalar_row

B = 3
SCALES = torch.tensor([1e-3, 1.0, 50.0])  # members of very different magnitudes: one shared absmax would show


def _stack(numels=(1, 257, 300), dtype=torch.float32, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    shapes = {f"t{n}": (n,) if n != 300 else (20, 15) for n in numels}
    scaled = lambda s: (torch.randn(B, *s, generator=gen) * SCALES.view(B, *[1] * len(s))).to(device, dtype)
    p = {k: scaled(s) for k, s in shapes.items()}
    g = {k: scaled(s) for k, s in shapes.items()}
    return p, g


def _member(tree, b):
    return tree_map(lambda t: t[b], tree)


def _same(a, b) -> bool:
    la, lb = tree_leaves(a), tree_leaves(b)
    return len(la) == len(lb) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(la, lb))


@pytest.mark.parametrize("bits", [8, 32])
def test_vmap_init_state_gives_each_member_its_own_state(bits):
    p, _ = _stack()
    spec = bnbf.OptimSpec(rule="adamw", state_bits=bits, min_8bit_size=0)
    s = torch.vmap(lambda q: bnbf.init_state(q, spec))(p)
    for b in range(B):
        assert _same(_member(s, b), bnbf.init_state(_member(p, b), spec))
    for t in tree_leaves(s):  # own memory per member, not one state expanded over the members
        assert t.stride(0) != 0 and t.untyped_storage().nbytes() >= t.numel() * t.element_size()


INTERP = triton_mode()
# the interpreter takes seconds a launch configuration: there one of each state width (the batching rule is the
# same on both paths; the kernels' other rules and dtypes are tested against the reference elsewhere)
_slow_in_interpreter = pytest.mark.skipif(INTERP, reason="covered on the reference path; slow in the interpreter")
CASES = [
    ("adamw", 8, torch.float32),
    ("adamw", 32, torch.float32),
    pytest.param("adamw", 8, torch.bfloat16, marks=_slow_in_interpreter),
    pytest.param("lamb", 8, torch.float32, marks=_slow_in_interpreter),
    pytest.param("sgd", 8, torch.bfloat16, marks=_slow_in_interpreter),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("rule", "bits", "dtype"), CASES)
def test_vmap_update_equals_a_loop_over_members(rule, bits, dtype, device):
    p, g = _stack(dtype=dtype, device=device)
    hp = {"lr": 0.01, "momentum": 0.9} if rule == "sgd" else {"lr": 0.01}
    spec = bnbf.OptimSpec(rule=rule, state_bits=bits, min_8bit_size=0)
    s = torch.vmap(lambda q: bnbf.init_state(q, spec, hp))(p)
    loop = [(_member(p, b), bnbf.init_state(_member(p, b), spec, hp)) for b in range(B)]
    for step in (1,) if INTERP else (1, 2):
        p, s = torch.vmap(lambda q, r, u, t=step: bnbf.update(q, r, u, hp, t))(p, g, s)
        loop = [bnbf.update(q, _member(g, b), u, hp, step) for b, (q, u) in enumerate(loop)]
        for b in range(B):
            assert _same((_member(p, b), _member(s, b)), loop[b])


@pytest.mark.parametrize("device", DEVICES)
def test_vmap_update_of_a_rule_without_state(device):
    """SGD without momentum keeps no state: the stacked step has params and grads alone, and equals the loop."""
    p, g = _stack(numels=(1, 257), device=device)
    spec = bnbf.OptimSpec(rule="sgd", min_8bit_size=0)
    s = torch.vmap(lambda q: bnbf.init_state(q, spec))(p)
    assert not tree_leaves(s)
    got = torch.vmap(lambda q, r, u: bnbf.update(q, r, u, {"lr": 0.1}, 1))(p, g, s)
    for b in range(B):
        assert _same(_member(got, b), bnbf.update(_member(p, b), _member(g, b), _member(s, b), {"lr": 0.1}, 1))


def test_vmap_update_in_place_and_per_member_lr():
    p, g = _stack()
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=0)
    s = torch.vmap(lambda q: bnbf.init_state(q, spec))(p)
    lrs = torch.tensor([0.1, 0.01, 0.001])
    want = [bnbf.update(_member(p, b), _member(g, b), _member(s, b), {"lr": lrs[b]}, 1) for b in range(B)]
    p_, s_ = tree_map(torch.clone, (p, s))
    torch.vmap(lambda q, r, u, lr: bnbf.update_(q, r, u, {"lr": lr}, 1))(p_, g, s_, lrs)
    for b in range(B):
        assert _same((_member(p_, b), _member(s_, b)), want[b])


@pytest.mark.parametrize("device", DEVICES)
def test_vmap_with_one_tensor_lr_and_step_for_every_member(device):
    """0-d tensor lr and step passed unbatched (one for all members; their scalars made outside torch.func's
    dispatch): each member's step equals its own call with the same tensors, pure and in place."""
    p, g = _stack(numels=(257, 300), device=device)
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=0)
    s = torch.vmap(lambda q: bnbf.init_state(q, spec))(p)
    lr, step = torch.tensor(0.01, device=device), torch.tensor(3, device=device)
    hp = {"lr": lr, "weight_decay": torch.tensor(0.1, device=device)}
    want = [bnbf.update(_member(p, b), _member(g, b), _member(s, b), hp, step) for b in range(B)]
    got = torch.vmap(lambda q, r, u, t: bnbf.update(q, r, u, hp, t), in_dims=(0, 0, 0, None))(p, g, s, step)
    p_, s_ = tree_map(torch.clone, (p, s))
    torch.vmap(lambda q, r, u, t: bnbf.update_(q, r, u, hp, t), in_dims=(0, 0, 0, None))(p_, g, s_, step)
    for b in range(B):
        assert _same(_member(got, b), want[b])
        assert _same((_member(p_, b), _member(s_, b)), want[b])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("per_member_lr", [False, True])
def test_vmap_steps_all_members_in_one_call(monkeypatch, device, per_member_lr):
    """The batching rule: one call of the step for all members of all tensors of a group (one launch on the
    Triton path, with a table row per member, per-member hyperparameters as a row per member), not a loop over
    members (the reference, which steps tensor by tensor anyway, takes a call per member's row)."""
    calls = []
    ref = bnbf.ops.reference_step
    monkeypatch.setattr(bnbf.ops, "reference_step", lambda p_in, *a: (calls.append(len(p_in)), ref(p_in, *a))[1])
    launch = launcher.launch_group
    monkeypatch.setattr(launcher, "launch_group", lambda g, *a: (calls.append(g.table.shape[0]), launch(g, *a))[1])
    p, g = _stack(numels=(257, 300), device=device)
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=0)
    s = torch.vmap(lambda q: bnbf.init_state(q, spec))(p)
    lrs = torch.tensor([0.1, 0.01, 0.001], device=device)
    if per_member_lr:
        got = torch.vmap(lambda q, r, u, lr: bnbf.update(q, r, u, {"lr": lr}, 1))(p, g, s, lrs)
    else:
        got = torch.vmap(lambda q, r, u: bnbf.update(q, r, u, {"lr": 0.01}, 1))(p, g, s)
    triton_path = INTERP or device == "cuda"
    assert calls == ([2] * B if per_member_lr and not triton_path else [2 * B])
    if per_member_lr:
        for b in range(B):
            want = bnbf.update(_member(p, b), _member(g, b), _member(s, b), {"lr": lrs[b]}, 1)
            assert _same(_member(got, b), want)


_TRITON_TABLES = pytest.mark.skipif(not INTERP and "cuda" not in DEVICES, reason="the Triton path's tables")


def _clear_member_caches():
    members._GROUPS.clear()
    members._STRUCTURES.clear()
    members._PROBES.clear()


@_TRITON_TABLES
def test_vmap_host_work_does_not_grow_with_members(monkeypatch):
    """The Triton path runs the launcher's build_group once per structure (sizes, member strides), on stand-ins
    at two places, and never per call: a call with new addresses gathers them and makes the table of every
    member in tensor ops, with no view per member or per tensor; a group is cached by the exact addresses its
    table holds. The batched params and grads reach the step as they are (no batched op per tensor in
    bnbf.update)."""
    device = "cuda" if "cuda" in DEVICES else "cpu"
    built, views = [], []
    build = members.build_group
    monkeypatch.setattr(members, "build_group", lambda p_in, *a: (built.append(len(p_in)), build(p_in, *a))[1])
    member = members._member
    monkeypatch.setattr(members, "_member", lambda x, b: (views.append(len(x[0])), member(x, b))[1])
    _clear_member_caches()
    p, g = _stack(numels=(257, 300), device=device)
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=0)
    s = torch.vmap(lambda q: bnbf.init_state(q, spec))(p)
    step = torch.vmap(lambda q, r, u: bnbf.update(q, r, u, {"lr": 0.01}, 1))
    out = step(p, g, s)
    assert built == [2, 2] and views == []  # the structure: the stand-ins at two places
    builds = members.BUILDS["group"]
    kept = [out]  # every call's outputs held: the allocator cannot hand a call the addresses of an earlier one
    for _ in range(3):  # new addresses each call (the outputs fed back), the same structure: no build
        out = step(out[0], g, out[1])
        kept.append(out)
    assert built == [2, 2] and views == [] and members.BUILDS["group"] == builds + 3
    layout = type(s["t257"]).layout
    stacked = lambda ts: (list(ts), (True,) * len(ts))
    ps, ss = stacked(p.values()), stacked([t for k in p for t in s[k]])
    first = members.stacked_group(ps, ps, ss, ss, layout, B)
    assert members.stacked_group(ps, ps, ss, ss, layout, B) is first  # the same addresses: the cached group
    other = stacked([t.clone() for t in p.values()])
    assert members.stacked_group(other, other, ss, ss, layout, B) is not first
    assert members.stacked_group(ps, ps, ss, ss, layout, B - 1) is not first
    assert built == [2] * 4  # one new structure (another member count)


@_TRITON_TABLES
@pytest.mark.parametrize("size", [1, 2, 5])
def test_stacked_group_table_is_the_launchers_table_of_every_member(size):
    """The table made from member 0 and the member strides equals the launcher's own table of every member's
    view, row for row (member-major): batched and shared tensors, members apart by more than their size, odd
    sizes, absent state slots, in place and out of place."""
    device = "cuda" if "cuda" in DEVICES else "cpu"
    gen = torch.Generator().manual_seed(size)
    spec = bnbf.OptimSpec(rule="sgd", min_8bit_size=0)  # momentum kept: one slot of codes and absmax
    shapes = [(257,), (1,), (20, 15)]
    batched = (True, False, True)
    padded = torch.randn(size, 300, generator=gen).to(device)[:, :257]  # members 300 elements apart
    params = [padded, torch.randn(1, generator=gen).to(device), torch.randn(size, 20, 15, generator=gen).to(device)]
    states = [bnbf.init_state(torch.zeros(sh, device=device), spec, {"momentum": 0.9}) for sh in shapes]
    layout = type(states[0]).layout
    fields = [
        torch.stack([f] * size) if b else f.clone() for st, b in zip(states, batched) for f in st
    ]  # stacked states of each batched param, one member's state for the shared one
    f_batched = tuple(b for st, b in zip(states, batched) for _ in st)
    outs = [torch.empty((size, *sh), device=device) for sh in shapes]
    s_outs = [
        torch.empty(f.shape if b else (size, *f.shape), dtype=f.dtype, device=device) for f, b in zip(fields, f_batched)
    ]
    p_in, s_in = (params, batched), (fields, f_batched)
    for p_out, s_out in (((outs, (True,) * 3), (s_outs, (True,) * len(s_outs))), (p_in, s_in)):
        _clear_member_caches()
        group = members.stacked_group(p_in, p_out, s_in, s_out, layout, size)
        # the launcher's group of the loop over members: every member's view, member-major
        each = [[t[b] if on else t for b in range(size) for t, on in zip(*x)] for x in (p_in, p_out, s_in, s_out)]
        want = launcher.build_group(*each, layout)
        assert torch.equal(group.table.cpu(), want.table.cpu())
        assert torch.equal(group.tasks.cpu(), want.tasks.cpu()) and torch.equal(group.ranges.cpu(), want.ranges.cpu())


class _BatchedOps(TorchFunctionMode):
    """The torch functions called on a tensor that vmap has batched."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(isinstance(a, torch.Tensor) and is_batchedtensor(a) for a in tree_leaves((args, kwargs))):
            self.names.append(getattr(func, "__name__", repr(func)))
        return func(*args, **kwargs)


def test_vmap_update_makes_no_batched_op_per_tensor():
    """Under vmap, bnbf.update reads the batched tensors' metadata (the checks) and hands them to the step, which
    unwraps them: no op on a batched tensor (detach, contiguous... each a trip through torch.func's dispatch)."""
    p, g = _stack(numels=(1, 257))
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=0)
    s = torch.vmap(lambda q: bnbf.init_state(q, spec))(p)
    seen = _BatchedOps()

    def step(q, r, u):
        with seen:
            return bnbf.update(q, r, u, {"lr": 0.01}, 1)

    got = torch.vmap(step)(p, g, s)
    assert seen.names and set(seen.names) <= {"__get__", "is_contiguous", "is_neg", "_is_zerotensor"}  # metadata
    for b in range(B):
        assert _same(_member(got, b), bnbf.update(_member(p, b), _member(g, b), _member(s, b), {"lr": 0.01}, 1))


@_TRITON_TABLES
def test_vmap_step_with_a_scalar_row_per_tensor():
    """The op under vmap with a row of scalars per tensor (bnbf.compose's per-leaf hyperparameters, on the Triton
    path): each member's tensors take their own tensor's row, as the op called on that member alone gives them."""
    device = "cuda" if "cuda" in DEVICES else "cpu"
    p, g = _stack(numels=(257, 300), device=device)
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=0)
    s = torch.vmap(lambda q: bnbf.init_state(q, spec))(p)
    layout = type(s["t257"]).layout
    rule = bnbf.rules.get_rule("adamw")
    rows = torch.stack(
        [
            scalar_row(_scalars(rule, rule.make_hparams({"lr": lr}), 1, False, 0.0, False)[0], torch.device(device))
            for lr in (0.1, 1e-3)
        ]
    )

    def step(ps, gs, ss):
        return bnbf.ops.step(ps, gs, ss, rows, layout, False, False)

    fields = lambda tree: [t for k in p for t in tree[k]]
    got = torch.vmap(step)(list(p.values()), list(g.values()), fields(s))
    for b in range(B):
        want = step(list(_member(p, b).values()), list(_member(g, b).values()), fields(_member(s, b)))
        assert _same(_member(got, b), want)


@pytest.mark.parametrize("device", DEVICES)
def test_vmap_members_along_another_dim_with_shared_grads(device):
    """Params batched along their last dim (each member strided: one copy makes the members contiguous), grads
    shared by every member (unbatched), odd sizes: the step equals the loop bit for bit."""
    numels = (1, 257) if INTERP else (1, 255, 4097)
    p, _ = _stack(numels=numels, device=device)
    g = {k: v[0] * 3.0 for k, v in _stack(numels=numels, device=device, seed=1)[1].items()}
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=0)
    s = torch.vmap(lambda q: bnbf.init_state(q, spec))(p)
    p_last = {k: v.movedim(0, -1).contiguous() for k, v in p.items()}  # [..., B]
    step = lambda q, r, u: bnbf.update(q, r, u, {"lr": 0.01}, 1)
    got = torch.vmap(step, in_dims=(-1, None, 0))(p_last, g, s)
    for b in range(B):
        assert _same(_member(got, b), step(_member(p, b), g, _member(s, b)))


def test_nested_vmap_takes_the_op_per_member():
    """vmap of vmap (members of members): the inner tensors are still wrapped by the outer transform, so the
    step goes through the op's batching rule member by member; the result is still the loop's."""
    p, g = _stack(numels=(1, 257))
    p2, g2 = tree_map(lambda t: torch.stack([t, -2 * t]), (p, g))  # [2, B, ...]
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=0)
    s2 = torch.vmap(torch.vmap(lambda q: bnbf.init_state(q, spec)))(p2)
    step = lambda q, r, u: bnbf.update(q, r, u, {"lr": 0.01}, 1)
    got = torch.vmap(torch.vmap(step))(p2, g2, s2)
    for a in range(2):
        for b in range(B):
            one = lambda t, a=a, b=b: t[a][b]
            assert _same(tree_map(one, got), step(tree_map(one, p2), tree_map(one, g2), tree_map(one, s2)))


def test_vmap_over_no_members():
    """An ensemble of no members steps nothing and returns empty stacked results of the right shapes."""
    p, g = {"a": torch.randn(0, 300)}, {"a": torch.randn(0, 300)}
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=0)
    s = torch.vmap(lambda q: bnbf.init_state(q, spec))(p)
    new_p, new_s = torch.vmap(lambda q, r, u: bnbf.update(q, r, u, {"lr": 0.01}, 1))(p, g, s)
    assert new_p["a"].shape == (0, 300)
    assert [(t.shape, t.dtype) for t in new_s["a"]] == [(t.shape, t.dtype) for t in s["a"]]


def _in_place_case(device, dtype=torch.float32):
    gen = torch.Generator().manual_seed(3)
    shapes = [(1,), (257,), (20, 15)]
    p = [(torch.randn(B, *sh, generator=gen) * SCALES.view(B, *[1] * len(sh))).to(device, dtype) for sh in shapes]
    g = [torch.randn(B, *sh, generator=gen).to(device, dtype) for sh in shapes]
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=0)
    states = [torch.vmap(lambda q: bnbf.init_state(q, spec))(x) for x in p]
    fields = [t for st in states for t in st]
    return p, g, fields, type(states[0]).layout


def _row(lr, device):
    rule = bnbf.rules.get_rule("adamw")
    return scalar_row(_scalars(rule, rule.make_hparams({"lr": lr}), 1, False, 0.0, False)[0], torch.device(device))


def _op_in_place(ps, gs, ss, hp, layout):
    bnbf.ops.step_(ps, gs, ss, hp, layout, False, False)
    return ps


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("per_member_lr", [False, True])
def test_vmap_in_place_op_writes_the_stacked_tensors(device, per_member_lr):
    """The in-place op under vmap (update_ of an ensemble) steps the stacked params and states where they are, one
    call for all members (no outputs, no copy back), bumping their versions; equal bit for bit to the pure op on
    each member alone. Members that are not contiguous (batched along the last dim) take the pure step written
    back: the same values."""
    p, g, fields, layout = _in_place_case(device)
    rows = torch.stack([_row(lr, device) for lr in (0.1, 0.01, 0.001)]) if per_member_lr else _row(0.01, device)
    member_row = (lambda b: rows[b]) if per_member_lr else (lambda b: rows)
    want = [
        bnbf.ops.step([x[b] for x in p], [x[b] for x in g], [t[b] for t in fields], member_row(b), layout, False, False)
        for b in range(B)
    ]
    ps, ss = [x.clone() for x in p], [t.clone() for t in fields]
    ptrs, versions = [t.data_ptr() for t in ps + ss], [t._version for t in ps + ss]
    torch.vmap(_op_in_place, in_dims=(0, 0, 0, 0 if per_member_lr else None, None))(ps, g, ss, rows, layout)
    assert [t.data_ptr() for t in ps + ss] == ptrs
    assert all(t._version > v for t, v in zip(ps + ss, versions))
    for b in range(B):
        assert _same(([x[b] for x in ps], [t[b] for t in ss]), want[b])
    last = [x.movedim(0, -1).contiguous() for x in p]  # [..., B]: each member strided
    ss = [t.clone() for t in fields]
    in_dims = (-1, 0, 0, 0 if per_member_lr else None, None)
    torch.vmap(_op_in_place, in_dims=in_dims)(last, g, ss, rows, layout)
    for b in range(B):
        assert _same(([x[..., b] for x in last], [t[b] for t in ss]), want[b])


@pytest.mark.parametrize("packed", [False, True], ids=["per-param", "packed"])
@pytest.mark.parametrize("fn", ["update", "update_"])
def test_vmap_refuses_a_bad_step_or_member_hyperparameter_as_eager_calls_do(fn, packed):
    """Under vmap the step and the per-member hyperparameter tensors (on the CPU: readable without a sync) are
    checked as an eager call checks its numbers: a step of 0 made every param NaN (and update_ wrote them), a
    member's lr of NaN or betas of 1 stepped unchecked. Each is refused in the eager call's words, nothing written."""
    p, g = _stack()
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=256)
    s = torch.vmap(lambda q: bnbf.init_state(q, spec, packed=packed))(p)
    bad = lambda v: torch.tensor([0.01, v, 0.01])  # noqa: E731 - member 1's value
    cases = [
        ({"lr": 0.01}, 0, None, ValueError, r"Invalid step: 0 \(steps count from 1\)"),
        ({"lr": 0.01}, torch.tensor(0), None, ValueError, r"Invalid step: 0"),
        ({"lr": 0.01}, torch.tensor([1, 0, 2]), 0, ValueError, r"Invalid step: 0"),
        ({"lr": 0.01}, torch.tensor([1.0, 2.0, 3.0]), 0, TypeError, r"step must be an int or a 0-d int32/int64"),
        ({"lr": 0.01}, torch.tensor([[1], [2], [3]]), 0, TypeError, r"step must be an int or a 0-d int32/int64"),
        ({"lr": bad(float("nan"))}, 1, None, ValueError, r"Invalid learning rate: nan"),
        ({"lr": 0.01, "betas": (bad(1.0), 0.999)}, 1, None, ValueError, r"Invalid beta parameter at index 0: 1.0"),
        ({"lr": 0.01, "weight_decay": bad(-5.0)}, 1, None, ValueError, r"Invalid weight_decay value: -5.0"),
    ]
    for hp, step, step_dim, error, match in cases:
        dim = lambda v: 0 if isinstance(v, torch.Tensor) else None  # noqa: E731 - a member per row of a tensor
        batched = {k: tuple(map(dim, v)) if isinstance(v, tuple) else dim(v) for k, v in hp.items()}
        call = lambda q, r, u, h, t: getattr(bnbf, fn)(q, r, u, h, t)  # noqa: E731
        before = [t.clone() for t in tree_leaves((p, s))]
        with pytest.raises(error, match=match):
            torch.vmap(call, in_dims=(0, 0, 0, batched, step_dim))(p, g, s, hp, step)
        assert all(torch.equal(a, b) for a, b in zip(tree_leaves((p, s)), before)), f"{hp}, step {step}: written"
    good = torch.vmap(call, in_dims=(0, 0, 0, {"lr": 0}, 0))(p, g, s, {"lr": bad(0.02)}, torch.tensor([1, 2, 3]))
    if fn == "update":
        for b in range(B):  # each member as its own eager call: the checks changed no value
            hp_b, step_b = {"lr": bad(0.02)[b]}, torch.tensor(b + 1)  # the member's own 0-d tensors
            want = bnbf.update(_member(p, b), _member(g, b), _member(s, b), hp_b, step_b)
            leaves = lambda st: st.unpack() if packed else st  # noqa: E731 - a packed buffer's padding is not state
            got = (_member(good[0], b), leaves(_member(good[1], b)))
            assert _same(got, (want[0], leaves(want[1]))), f"member {b}"


@pytest.mark.parametrize("fmt", ["power", "dynamic"])
def test_dequantize_state_of_an_ensemble_is_each_members(fmt):
    """``dequantize_state`` of a state stacked by vmap (its fields and scales have a members dim), and vmap of it:
    each member's values, as of that member's own state (both raised: a 1-D absmax was assumed, and written into)."""
    p, g = _stack()
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=0, state_format=fmt)
    s = torch.vmap(lambda q: bnbf.init_state(q, spec))(p)
    _, s = torch.vmap(lambda q, r, u: bnbf.update(q, r, u, {"lr": 1e-3}, 1))(p, g, s)
    for got in (bnbf.dequantize_state(s), torch.vmap(bnbf.dequantize_state)(s)):
        for b in range(B):
            want = bnbf.dequantize_state(_member(s, b))
            assert _same(_member(got, b), want), f"member {b}"


def test_vmap_in_place_op_refuses_before_writing():
    """A param shared by every member (unbatched) cannot take each member's step in place, and params or states
    sharing memory would be written over each other: both raise, and nothing is written."""
    p, g, fields, layout = _in_place_case("cpu")
    row = _row(0.01, "cpu")
    ps, ss = [x.clone() for x in p], [t.clone() for t in fields]
    before = [t.clone() for t in ps + ss]
    with pytest.raises(RuntimeError, match="param 0: it is not batched"):
        torch.vmap(_op_in_place, in_dims=(None, 0, 0, None, None))([x[0] for x in ps], g, ss, row, layout)
    with pytest.raises(RuntimeError, match="state field 0: it is not batched"):
        torch.vmap(_op_in_place, in_dims=(0, 0, None, None, None))(ps, g, [t[0] for t in ss], row, layout)
    both = torch.randn(B, 2 * 257)
    overlapping = [ps[0], both[:, :257], both[:, 200:457]]  # two params sharing 57 elements
    grads = [g[0], g[1], g[1]]
    states = ss[:4] + [t.clone() for t in ss[4:8]] + [t.clone() for t in ss[4:8]]  # states apart
    with pytest.raises(ValueError, match="overlap in memory"):
        torch.vmap(_op_in_place, in_dims=(0, 0, 0, None, None))(overlapping, grads, states, row, layout)
    assert all(torch.equal(a, b) for a, b in zip(ps + ss, before))


def _two_groups(device, packed=False, overlap=False):
    """Stacked params of two layout groups (8-bit state for "a", float32 for "b", by min_8bit_size), sharing
    memory where ``overlap``, their states and grads."""
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=4096)
    if overlap:
        w = torch.randn(B, 5000, device=device)
        p = {"a": w[:, :4096], "b": w[:, 4000:]}  # 96 elements of every member in both
    else:
        p = {"a": torch.randn(B, 4096, device=device), "b": torch.randn(B, 100, device=device)}
    s = torch.vmap(lambda q: bnbf.init_state(q, spec, packed=packed))(p)
    return p, {k: torch.randn_like(v) for k, v in p.items()}, s


_IN_PLACE_FORMS = {
    "per-param": lambda p, g, s: bnbf.update_(p, g, s, {"lr": 0.01}, 1),
    "composed": lambda p, g, s: bnbf.update_(p, g, s, lambda path, q: {"lr": 0.01 if path == "a" else 0.02}, 1),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["per-param", "composed", "packed"])
def test_vmap_in_place_refuses_memory_shared_across_groups_as_eager_does(device, form):
    """What an eager ``update_`` refuses over all of a call's layout groups, the vmapped one refuses too, before
    anything is written: params of two groups sharing memory (each would be written over the other), and a grad
    that is another leaf's param or state (read while the step writes it), found at the first call or after
    calls that were apart (grads elsewhere each call, as a training loop makes them)."""
    step = torch.vmap(_IN_PLACE_FORMS.get(form, _IN_PLACE_FORMS["per-param"]))
    packed = form == "packed"

    def refused(p, g, s, match):
        before = [t.clone() for t in tree_leaves((p, s))]
        with pytest.raises(ValueError, match=match):
            step(p, g, s)
        assert all(torch.equal(a, b) for a, b in zip(tree_leaves((p, s)), before))

    p, g, s = _two_groups(device, packed, overlap=True)
    refused(p, g, s, r"param\['a'\] and param\['b'\].* overlap in memory")
    p, g, s = _two_groups(device, packed)
    for _ in range(3):  # apart: stepped, with new grads each call
        step(p, {k: v + 1 for k, v in g.items()}, s)
    refused(p, {"a": g["a"], "b": p["a"][:, :100]}, s, r"grad\['b'\] shares memory with param\['a'\]")
    refused(p, {"a": p["b"].repeat(1, 41)[:, :4096], "b": p["a"][:, 50:150]}, s, r"grad\['b'\] shares memory")
    field = s.buffers[-1] if packed else s["b"].exp_avg  # a float32 state field
    refused(p, {"a": g["a"], "b": field[:, :100]}, s, r"grad\['b'\] shares memory with (state|packed state)")


def test_vmap_in_place_compares_memory_once_per_ensemble(monkeypatch):
    """Two ensembles stepped in turn (a GAN's two models), each with its grads at the same place: after each one's
    first call, the memory is found apart by its addresses alone, without the comparison of every pair."""
    from bnbf._host_checks import NATIVE

    if NATIVE is None:  # the address match is the compiled pass's; the Python checks compare every call
        pytest.skip("the compiled host checks are not built")
    compared = []
    real = bnbf.ops._check_no_overlap
    monkeypatch.setattr(bnbf.ops, "_check_no_overlap", lambda *a: compared.append(1) or real(*a))
    monkeypatch.setattr(bnbf.ops, "_APART", Bounded(8))
    step = torch.vmap(_IN_PLACE_FORMS["per-param"])
    first, second = _two_groups("cpu"), _stack(numels=(1, 257))
    second = (*second, torch.vmap(lambda q: bnbf.init_state(q, bnbf.OptimSpec(rule="adamw")))(second[0]))
    for _ in range(3):
        step(*first)
        step(*second)
    assert len(compared) == 2


def test_nested_vmap_in_place_refuses_a_grad_sharing_memory_with_a_param():
    """Under vmap of vmap the memory is compared on the tensors under both levels of wrappers."""
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=4096)
    p = {"a": torch.randn(2, B, 4096), "b": torch.randn(2, B, 100)}
    s = torch.vmap(torch.vmap(lambda q: bnbf.init_state(q, spec)))(p)
    step = torch.vmap(torch.vmap(_IN_PLACE_FORMS["per-param"]))
    before = [t.clone() for t in tree_leaves((p, s))]
    with pytest.raises(ValueError, match=r"grad\['b'\] shares memory with param\['a'\]"):
        step(p, {"a": torch.randn(2, B, 4096), "b": p["a"][:, :, :100]}, s)
    assert all(torch.equal(a, b) for a, b in zip(tree_leaves((p, s)), before))
    step(p, {k: torch.randn_like(v) for k, v in p.items()}, s)  # apart: stepped
    assert not torch.equal(p["a"], before[0])


def test_member_addresses_native_and_python_agree():
    """The stacked step's address gather: the compiled pass and its pure-Python twin give the same table, key and
    alignment."""
    from bnbf._host_checks import NATIVE

    if NATIVE is None:
        pytest.skip("the compiled host checks are not built")
    p, _, fields, _ = _in_place_case("cpu")
    odd = torch.zeros(9)[1:]  # 4-byte aligned, not 16
    for lists in (((p, ()), (p, ()), (fields, ()), (fields, ())), (([odd, *p], ()), ((), ()), ((), ()), ((), ()))):
        native = members._addresses(lists)
        flat = [t for ts, _ in lists for t in ts]
        python = members._addresses_python(flat, torch.zeros(len(flat) + 1, dtype=torch.int64))
        assert torch.equal(native[0], python[0]) and native[1:] == python[1:]
        assert native[0][:-1].tolist() == [t.data_ptr() for t in flat] and native[0][-1] == 0
    assert native[2] is False


class _MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 33)
        self.fc2 = torch.nn.Linear(33, 1)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


@_slow_in_interpreter
def test_vmap_of_a_whole_training_step_over_an_ensemble():
    torch.manual_seed(0)
    models = [_MLP() for _ in range(B)]
    params, _ = stack_module_state(models)
    params = {k: v.detach() for k, v in params.items()}
    base = _MLP().to("meta")
    x, y = torch.randn(8, 6), torch.randn(8, 1)
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=0)
    hp = {"lr": 1e-2, "weight_decay": 0.01}

    def loss_fn(p, x, y):
        return ((functional_call(base, p, (x,)) - y) ** 2).mean()

    def train_step(p, s, x, y, step):
        g, loss = grad_and_value(loss_fn)(p, x, y)
        p, s = bnbf.update(p, g, s, hp, step)
        return p, s, loss

    state = torch.vmap(lambda q: bnbf.init_state(q, spec))(params)
    singles = [(_member(params, b), bnbf.init_state(_member(params, b), spec)) for b in range(B)]
    for step in (1, 2):
        params, state, losses = torch.vmap(train_step, in_dims=(0, 0, None, None, None))(params, state, x, y, step)
        for b, (q, u) in enumerate(singles):
            q, u, loss = train_step(q, u, x, y, step)
            singles[b] = (q, u)
            # the batched forward (a batched matmul) may round otherwise than one member's: close, not equal
            torch.testing.assert_close(losses[b], loss, rtol=1e-5, atol=0)
    for b in range(B):
        torch.testing.assert_close(_member(params, b), singles[b][0], rtol=1e-5, atol=1e-6)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("packed", [False, True], ids=["per-param", "packed"])
@pytest.mark.parametrize("in_place", [False, True], ids=["update", "update_"])
def test_compiled_vmap_equals_eager_vmap(device, packed, in_place):
    """``torch.compile(vmap(step), fullgraph=True)``: Dynamo traces vmap through the ops' batching rules (the
    in-place ops' too: the pure rule's step written back into the stacked inputs), one graph, and each member's
    result equals the eager vmapped step's bit for bit."""
    from torch._dynamo.testing import CompileCounter

    p, g = _stack(device=device)
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=256)
    init = torch.vmap(lambda q: bnbf.init_state(q, spec, packed=packed))
    step = bnbf.update_ if in_place else bnbf.update
    fn = lambda q, gg, ss: step(q, gg, ss, {"lr": 0.01}, 1)  # noqa: E731 - update_ returns its (stepped) inputs
    want_p, want_s = {k: v.clone() for k, v in p.items()}, init(p)
    got_p, got_s = {k: v.clone() for k, v in p.items()}, init(p)
    eager = torch.vmap(fn)(want_p, g, want_s)
    cnt = CompileCounter()
    out = torch.compile(torch.vmap(fn), backend=cnt, fullgraph=True)(got_p, g, got_s)
    assert cnt.frame_count == 1
    if not in_place:
        (want_p, want_s), (got_p, got_s) = eager, out
    unpack = (lambda s: s.unpack()) if packed else (lambda s: s)
    assert _same(got_p, want_p) and _same(unpack(got_s), unpack(want_s))
    assert not _same(got_p, p)  # a step was taken


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("in_place", [False, True], ids=["update", "update_"])
def test_compiled_nested_vmap_is_not_taken_for_a_derivative(in_place):
    """The traced check of a derivative looks below the innermost vmap for a grad transform: two vmaps (an
    ensemble of ensembles) have none, and their compiled step equals the eager one bit for bit."""
    p = torch.randn(2, 3, 300)
    g = torch.randn(2, 3, 300)
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=256)
    init = torch.vmap(torch.vmap(lambda q: bnbf.init_state(q, spec)))
    step = bnbf.update_ if in_place else bnbf.update
    fn = torch.vmap(torch.vmap(lambda q, gg, ss: step(q, gg, ss, {"lr": 0.01}, 1)))
    want_p, want_s = p.clone(), init(p)
    got_p, got_s = p.clone(), init(p)
    eager = fn(want_p, g, want_s)
    out = torch.compile(fn, backend="eager", fullgraph=True)(got_p, g, got_s)
    if not in_place:
        (want_p, want_s), (got_p, got_s) = eager, out
    assert torch.equal(got_p, want_p) and all(map(torch.equal, got_s, want_s))
    assert not torch.equal(got_p, p)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("packed", [False, True], ids=["per-param", "packed"])
def test_compiled_vmap_in_place_refuses_an_unbatched_param(packed):
    p, g = _stack()
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=256)
    s = torch.vmap(lambda q: bnbf.init_state(q, spec, packed=packed))(p)
    shared = {k: v[0].clone() for k, v in p.items()}
    before = [t.clone() for t in tree_leaves((shared, s))]
    step = torch.vmap(lambda q, gg, ss: bnbf.update_(q, gg, ss, {"lr": 0.01}, 1)[1], in_dims=(None, 0, 0))
    with pytest.raises(Exception) as info:  # noqa: PT011 - Dynamo wraps the op's error: its cause is checked
        torch.compile(step, backend="eager", fullgraph=True)(shared, g, s)
    causes = []
    e = info.value
    while e is not None:
        causes.append(str(e))
        e = e.__cause__ or e.__context__
    assert any("it is not batched" in c for c in causes), causes
    assert all(torch.equal(a, b) for a, b in zip(tree_leaves((shared, s)), before))


def test_vmap_of_update__names_the_unbatched_leaf():
    """``vmap(update_)`` of a tree with one param, or one state field, shared by every member (not batched) is refused
    before anything is written, naming the leaf (and the field) as eager errors do, not its place in the call."""
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=0)
    params = {"a": torch.randn(B, 300), "b": torch.randn(B, 20)}
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    state = torch.vmap(lambda q: bnbf.init_state(q, spec))(params)
    shared_p = params["b"][0].clone()
    shared_s = type(state["b"])(*[t[0].clone() for t in state["b"]])
    before = [t.clone() for t in (*params.values(), *state["a"], *state["b"], shared_p, *shared_s)]
    with pytest.raises(RuntimeError, match=r"cannot write param\['b'\]: it is not batched"):
        torch.vmap(lambda a, g, s: bnbf.update_({"a": a, "b": shared_p}, g, s, {"lr": 0.1}, 1))(
            params["a"], grads, state
        )
    with pytest.raises(RuntimeError, match=r"cannot write the state of param\['b'\] \(its field '\w+'\): it is not"):
        torch.vmap(lambda p, g, sa: bnbf.update_(p, g, {"a": sa, "b": shared_s}, {"lr": 0.1}, 1))(
            params, grads, state["a"]
        )
    after = (*params.values(), *state["a"], *state["b"], shared_p, *shared_s)
    assert all(torch.equal(x, y) for x, y in zip(before, after))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("packed", [False, True], ids=["per-param", "packed"])
def test_vmap_of_update__refuses_what_eager_update__cannot_write(device, packed):
    """Stacked params or states whose members share memory (expanded over the members, or members strided closer than
    they are long) would each keep one member's step, and inference tensors cannot be written outside inference
    mode: ``vmap(update_)`` refuses them as eager ``update_`` refuses such tensors, before anything is written, also
    after calls of the same structure took the memo of checked calls."""
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=0, block_size=64)
    step = torch.vmap(lambda p, g, s: bnbf.update_(p, g, s, {"lr": 0.01}, 1))
    g = {"w": torch.randn(B, 300, device=device)}

    def refused(p, s, error, match):
        before = [t.clone() for t in tree_leaves((p, s))]
        with pytest.raises(error, match=match):
            step(p, g, s)
        assert all(torch.equal(a, b) for a, b in zip(tree_leaves((p, s)), before))

    def state_of(p):
        return torch.vmap(lambda q: bnbf.init_state(q, spec, packed=packed))(p)

    fresh = {"w": torch.randn(B, 300, device=device)}
    step(fresh, g, state_of(fresh))  # a checked call of this structure first
    one = torch.randn(300, device=device)
    expanded = {"w": one.expand(B, 300)}
    refused(expanded, state_of({"w": one.clone().expand(B, 300).contiguous()}), ValueError, r"strides \(0, 1\)")
    buf = torch.randn(2 * 300, device=device)
    overlapping = {"w": buf.as_strided((B, 300), (100, 1))}  # member b at 100 b: 200 elements in two members
    refused(overlapping, state_of({"w": torch.randn(B, 300, device=device)}), ValueError, r"strides \(100, 1\)")
    if not packed:  # one member's state shared by every member
        s1 = bnbf.init_state(one, spec)
        shared = {"w": type(s1)._make(f.expand(B, *f.shape) for f in s1)}
        refused({"w": torch.randn(B, 300, device=device)}, shared, ValueError, "cannot write state field 0")
    with torch.inference_mode():
        made = {"w": torch.randn(B, 300, device=device)}
        made_state = state_of(made)
    ordinary = {"w": made["w"].clone()}
    refused(made, state_of(ordinary), RuntimeError, "param 0 was made under torch.inference_mode")
    refused(ordinary, made_state, RuntimeError, "state field 0 was made under torch.inference_mode")


@pytest.mark.parametrize("form", ["per-leaf", "by-rule", "callable", "per-leaf betas"])
@pytest.mark.parametrize("in_place", [False, True], ids=["update", "update_"])
def test_vmap_checks_member_values_given_through_composing_forms(form, in_place):
    """A per-member hyperparameter tensor given through a per-leaf mapping, ``{rule: mapping}`` or a callable is
    checked member by member as the shared mapping's is (each member's value as an eager call's number): a member's
    invalid lr or beta raises before anything is written (the composed groups had passed it unread)."""
    spec = bnbf.OptimSpec(rule="adamw", state_bits=32)
    p = {"a": torch.randn(B, 50), "b": torch.randn(B, 7)}
    g = {k: torch.randn_like(v) for k, v in p.items()}
    s = torch.vmap(lambda q: bnbf.init_state(q, spec))(p)
    make = {
        "per-leaf": lambda v: {"a": {"lr": v}, "b": {"lr": 0.1}},
        "by-rule": lambda v: {"adamw": {"lr": v}},
        "callable": lambda v: lambda path, q: {"lr": v},
        "per-leaf betas": lambda v: {"a": {"betas": (v, 0.999)}, "b": {}},
    }[form]
    bad = torch.tensor([0.9, 0.9, 1.5]) if form == "per-leaf betas" else torch.tensor([0.1, 0.1, -1.0])
    fn = bnbf.update_ if in_place else bnbf.update
    before = [t.clone() for t in tree_leaves((p, s))]
    with pytest.raises(ValueError, match="Invalid beta parameter at index 0: 1.5|Invalid learning rate: -1.0"):
        torch.vmap(lambda a, b, c, v: fn(a, b, c, make(v), 1))(p, g, s, bad)
    assert all(torch.equal(x, y) for x, y in zip(before, tree_leaves((p, s))))
    good = torch.tensor([0.9, 0.8, 0.7]) if form == "per-leaf betas" else torch.tensor([0.1, 0.2, 0.3])
    torch.vmap(lambda a, b, c, v: fn(a, b, c, make(v), 1))(p, g, s, good)  # valid members step


def test_packed_and_flat_states_of_no_members():
    """An ensemble of no members: the packed state and the flat layout's buffers and state are made (they raised
    torch's reshape(-1) error), as the per-param state is."""
    p = {"w": torch.randn(0, 16, 20), "b": torch.randn(0, 20)}
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=256)
    packed = torch.vmap(lambda q: bnbf.init_state(q, spec, packed=True))(p)
    assert all(b.shape[0] == 0 for b in packed.buffers)
    layout = bnbf.flat_layout({k: torch.zeros(v.shape[1:]) for k, v in p.items()}, spec)
    flat = torch.vmap(layout.flatten)(p)
    state = torch.vmap(layout.init_state)(flat)
    assert all(t.shape[0] == 0 for t in tree_leaves((flat, state)))


@pytest.mark.parametrize("case", ["max_grad_norm", "max_unorm", "differentiable lr", "differentiable beta1"])
def test_a_members_value_an_eager_call_refuses_is_refused(case):
    """Per-member CPU tensors are checked as an eager call checks its numbers: a negative ``max_grad_norm`` flipped
    that member's grads (an ascent step), a negative ``max_unorm`` stepped unclipped, and the differentiable step
    took a negative lr or a beta of 1.5. Nothing is written."""
    p, g = _stack()
    diff = case.startswith("differentiable")
    if diff:
        p, g = tree_map(torch.Tensor.double, p), tree_map(torch.Tensor.double, g)
    s = torch.vmap(lambda q: bnbf.init_state(q, bnbf.OptimSpec(rule="adamw", state_bits=32)))(p)
    before = [t.clone() for t in tree_leaves((p, g, s))]
    bad = {"max_grad_norm": -1.0, "max_unorm": -1.0, "differentiable lr": -0.1, "differentiable beta1": 1.5}[case]
    good = {"max_grad_norm": 1.0, "max_unorm": 1.0, "differentiable lr": 0.1, "differentiable beta1": 0.9}[case]
    x = torch.tensor([good, bad, good], dtype=torch.float64 if diff else torch.float32)
    kw = {
        "max_grad_norm": lambda v: ({"lr": 0.1}, {"max_grad_norm": v}),
        "max_unorm": lambda v: ({"lr": 0.1}, {"max_unorm": v}),
        "differentiable lr": lambda v: ({"lr": v}, {"differentiable": True}),
        "differentiable beta1": lambda v: ({"lr": 0.1, "betas": (v, 0.999)}, {"differentiable": True}),
    }[case]
    step = torch.vmap(lambda q, r, u, v: bnbf.update(q, r, u, kw(v)[0], 1, **kw(v)[1]))
    with pytest.raises(ValueError, match=f"Invalid .*{bad}"):
        step(p, g, s, x)
    assert all(torch.equal(a, b) for a, b in zip(before, tree_leaves((p, g, s))))
    step(p, g, s, torch.full_like(x, good))  # the same call with every member's value valid steps


@pytest.mark.parametrize("rule", ["adamw", "ademamix", "adagrad"])
def test_differentiable_step_with_a_step_per_member(rule):
    """``differentiable=True`` under vmap with a step count per member (it raised torch's .item() error under vmap):
    each member equals its own eager step with its step as a 0-d tensor; a member's step 0 is refused."""
    p, g = tree_map(torch.Tensor.double, _stack())
    spec = bnbf.OptimSpec(rule=rule, state_bits=32)
    s = torch.vmap(lambda q: bnbf.init_state(q, spec))(p)
    s = tree_map(torch.Tensor.double, s)
    steps = torch.tensor([1, 5, 40])
    hp = {"lr": 0.01}
    step = torch.vmap(lambda q, r, u, t: bnbf.update(q, r, u, hp, t, differentiable=True))
    got = step(p, g, s, steps)
    for b in range(B):
        want = bnbf.update(_member(p, b), _member(g, b), _member(s, b), hp, steps[b], differentiable=True)
        assert _same(_member(got, b), want), b
    with pytest.raises(ValueError, match="Invalid step: 0"):
        step(p, g, s, torch.tensor([1, 0, 2]))


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_vmap_with_max_grad_norm():
    """torch.compile of a vmapped step with ``max_grad_norm`` (it failed: Dynamo does not show the vmap, and the
    clip took ``_foreach_norm``, which vmap cannot batch): one graph, equal to the eager vmapped step."""
    from torch._dynamo.testing import CompileCounter

    p, g = _stack()
    s = torch.vmap(lambda q: bnbf.init_state(q, bnbf.OptimSpec(rule="adamw", min_8bit_size=0)))(p)
    fn = lambda a, b, c: torch.vmap(lambda x, y, z: bnbf.update(x, y, z, {"lr": 0.1}, 1, max_grad_norm=1.0))(a, b, c)
    counter = CompileCounter()
    got = torch.compile(fn, backend=counter, fullgraph=True)(p, g, s)
    assert counter.frame_count == 1 and _same(got, fn(p, g, s))


# ---- a repeated vmapped pure call: the memo of its checks (bnbf.functional._vmapped_hit) --------------------------

_memo_needs_native = pytest.mark.skipif(
    bnbf._vmap_memo.NATIVE is None, reason="the memo confirms the stacked tensors in the compiled host checks"
)


def _vmapped_update(hp, in_dims=(0, 0, 0, None)):
    return torch.vmap(lambda q, r, u, t: bnbf.update(q, r, u, hp, t), in_dims=in_dims)


def _outcome(fn):
    """``("ok", result)`` or ``("raised", type, message)``."""
    try:
        return ("ok", fn())
    except Exception as e:  # noqa: BLE001 - compared as outcomes
        return ("raised", type(e), str(e))


def _full_checks_counted(monkeypatch) -> list:
    """A list that the vmapped step's full checks (pure and in place) append to each time they run."""
    ran: list = []
    for module in (bnbf.functional, sys.modules["bnbf.plan"]):
        real = module._prepare_traced
        monkeypatch.setattr(module, "_prepare_traced", lambda *x, real=real, **k: ran.append(1) or real(*x, **k))
    return ran


def _without_memo(fn):
    """``fn()`` with the memo off: every check on vmap's batched tensors (the path the memo must equal)."""
    saved = bnbf.functional._vmapped_hit
    bnbf.functional._vmapped_hit = lambda *a, **k: None
    try:
        return _outcome(fn)
    finally:
        bnbf.functional._vmapped_hit = saved


@_memo_needs_native
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("rule", "bits", "dtype"), CASES)
@pytest.mark.parametrize("fn", ["update", "update_"])
def test_a_repeated_vmapped_step_takes_the_memo_and_equals_the_full_checks(monkeypatch, fn, rule, bits, dtype, device):
    """The second vmapped call of a loop skips the checks on batched tensors (a memo of the first call's, its stacked
    tensors confirmed) and gives the full path's result bit for bit, and each member's own call's; in place, the
    stacked tensors written as the full path writes them."""
    p, g = _stack(dtype=dtype, device=device)
    hp = {"lr": 0.01, "momentum": 0.9} if rule == "sgd" else {"lr": 0.01, "weight_decay": 0.1}
    spec = bnbf.OptimSpec(rule=rule, state_bits=bits, min_8bit_size=256)  # two groups: 8-bit and 32-bit states
    s = torch.vmap(lambda q: bnbf.init_state(q, spec, hp))(p)
    call = getattr(bnbf, fn)
    step = torch.vmap(lambda q, r, u, t: call(q, r, u, hp, t), in_dims=(0, 0, 0, None))
    bnbf._vmap_memo.MEMOS.clear()
    p1, s1 = tree_map(torch.clone, step(p, g, s, 1))  # the full checks, remembered
    assert bnbf._vmap_memo.MEMOS
    copy = lambda: tree_map(torch.clone, (p1, s1))  # noqa: E731
    a, b_ = copy(), copy()
    want = _without_memo(lambda: step(*a[:1], g, a[1], 2))
    traced = _full_checks_counted(monkeypatch)
    got = step(b_[0], g, b_[1], 2)
    assert not traced, "the repeated call ran the full checks"
    assert want[0] == "ok", want
    assert _same(got, want[1])
    if fn == "update_":
        assert _same(b_, a)  # both wrote the stacked tensors alike
    for b in range(B):
        one = bnbf.update(_member(p1, b), _member(g, b), _member(s1, b), hp, 2)
        assert _same(_member(got, b), one)
    held = [t for m in bnbf._vmap_memo.MEMOS.values() for ts in m.twins for t in ts]
    assert held and all(t.device.type == "meta" for t in held)  # no caller tensor kept


_TENSOR_SCALARS = {
    "lr": lambda device: ({"lr": torch.tensor(0.01, device=device), "weight_decay": 0.1}, lambda k: k),
    "step": lambda device: ({"lr": 0.01, "weight_decay": 0.1}, lambda k: torch.tensor(k, device=device)),
    "lr on the cpu, step": lambda device: (
        {"lr": torch.tensor(0.01), "betas": (0.9, torch.tensor(0.99, device=device))},
        lambda k: torch.tensor(k, device=device),
    ),
}


@_memo_needs_native
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(  # the interpreter takes the mix of both (the row's route through the kernels is one)
    "scalars",
    [k if k == "lr on the cpu, step" else pytest.param(k, marks=_slow_in_interpreter) for k in _TENSOR_SCALARS],
)
@pytest.mark.parametrize("fn", ["update", "update_"])
def test_a_repeated_vmapped_step_with_tensor_scalars_takes_the_memo(monkeypatch, fn, scalars, device):
    """0-d tensor hyperparameters and steps the same for every member (a schedule's tensors): the repeated call
    takes the memo as numbers do, and equals the full path bit for bit, each step's scalars their own."""
    p, g = _stack(device=device)
    hp, step_of = _TENSOR_SCALARS[scalars](device)
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=256)
    s = torch.vmap(lambda q: bnbf.init_state(q, spec, hp))(p)
    call = getattr(bnbf, fn)
    step = torch.vmap(lambda q, r, u, t: call(q, r, u, hp, t), in_dims=(0, 0, 0, None))
    bnbf._vmap_memo.MEMOS.clear()
    p1, s1 = tree_map(torch.clone, step(p, g, s, step_of(1)))  # the full checks, remembered
    assert bnbf._vmap_memo.MEMOS
    a, b = tree_map(torch.clone, (p1, s1)), tree_map(torch.clone, (p1, s1))
    if isinstance(hp["lr"], torch.Tensor):
        hp["lr"].fill_(0.02)  # a schedule's next value, in place
    want = _without_memo(lambda: step(a[0], g, a[1], step_of(2)))
    traced = _full_checks_counted(monkeypatch)
    got = step(b[0], g, b[1], step_of(2))
    assert not traced, "the repeated call ran the full checks"
    assert want[0] == "ok", want
    assert _same(got, want[1])
    if fn == "update_":
        assert _same(b, a)


@_memo_needs_native
@pytest.mark.parametrize("device", DEVICES)
def test_two_ensembles_in_a_full_memo_table_both_keep_their_memo(monkeypatch, device):
    """The memo table full of other structures' memos: two ensembles stepped in turn each keep theirs, so their
    repeated calls skip the full checks. A full table had been cleared whole at the second ensemble's memo."""
    memos = Bounded(bnbf._vmap_memo.MEMOS.size)
    for i in range(memos.size - 1):
        memos.put(("dead", i), None)
    monkeypatch.setattr(bnbf._vmap_memo, "MEMOS", memos)
    hp = {"lr": 0.01}
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=256)
    step = _vmapped_update(hp)
    loops = []
    for numels in ((1, 257, 300), (1, 257)):
        p, g = _stack(numels=numels, device=device)
        loops.append([p, g, torch.vmap(lambda q: bnbf.init_state(q, spec))(p)])
    for loop in loops:
        loop[0], loop[2] = step(*loop, 1)  # the full checks, remembered
    traced = _full_checks_counted(monkeypatch)
    for p, g, s in loops:
        step(p, g, s, 2)
    assert not traced, "a repeated call ran the full checks"
    assert ("dead", 0) not in memos and len(memos) == memos.size


@_memo_needs_native
@_slow_in_interpreter  # the memo's decisions do not depend on the path; the Triton route's steps: the test above
def test_a_vmapped_call_the_memo_cannot_confirm_takes_the_full_checks():
    """After a call has left its memo, calls that differ from it in any way the memo records or the call's own
    options get the full path's outcome: its result, or its error in its words. Nothing is modified."""
    p, g = _stack()
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=256)
    s = torch.vmap(lambda q: bnbf.init_state(q, spec))(p)
    hp = {"lr": 0.01}
    other = bnbf.OptimSpec(rule="adamw", state_bits=32)
    k = next(iter(p))
    cases = {
        "bad lr": lambda: _vmapped_update({"lr": -1.0})(p, g, s, 1),
        "unknown hyperparameter": lambda: _vmapped_update({"lr": 0.01, "alpha": 3.0})(p, g, s, 1),
        "step 0": lambda: _vmapped_update(hp)(p, g, s, 0),
        "step -1": lambda: _vmapped_update(hp)(p, g, s, -1),
        "bool step": lambda: _vmapped_update(hp)(p, g, s, True),
        "bad max_unorm": lambda: torch.vmap(lambda q, r, u: bnbf.update(q, r, u, hp, 1, max_unorm=-1.0))(p, g, s),
        "grads of another dtype": lambda: _vmapped_update(hp)(p, tree_map(lambda t: t.double(), g), s, 1),
        "a grad of another shape": lambda: _vmapped_update(hp)(p, {**g, k: g[k][:, :1]}, s, 1),
        "state of another layout": lambda: _vmapped_update(hp)(
            p, g, torch.vmap(lambda q: bnbf.init_state(q, other))(p), 1
        ),
        "state of another rule, the same fields": lambda: _vmapped_update(hp)(
            p, g, torch.vmap(lambda q: bnbf.init_state(q, bnbf.OptimSpec(rule="adam", min_8bit_size=256)))(p), 1
        ),
        "another structure": lambda: _vmapped_update(hp)(
            {**p, "extra": p[k]}, {**g, "extra": g[k]}, {**s, "extra": s[k]}, 1
        ),  # fmt: skip
        "members along dim 1": lambda: _vmapped_update(hp, in_dims=(1, 1, 0, None))(
            tree_map(lambda t: t.movedim(0, -1), p), tree_map(lambda t: t.movedim(0, -1), g), s, 1
        ),
        "a param requiring grad": lambda: _vmapped_update(hp)({**p, k: p[k].clone().requires_grad_()}, g, s, 1),
        "a grad requiring grad": lambda: _vmapped_update(hp)(p, {**g, k: g[k].clone().requires_grad_()}, s, 1),
        "a member's lr": lambda: torch.vmap(lambda q, r, u, lr: bnbf.update(q, r, u, {"lr": lr}, 1))(
            p, g, s, torch.tensor([0.1, 0.01, 0.001])
        ),
        "a 0-d tensor lr": lambda: _vmapped_update({"lr": torch.tensor(0.01)})(p, g, s, 1),
        "a 0-d tensor step": lambda: _vmapped_update(hp)(p, g, s, torch.tensor(3)),
        "a negative 0-d tensor lr": lambda: _vmapped_update({"lr": torch.tensor(-0.01)})(p, g, s, 1),
        "a 1-d tensor lr": lambda: _vmapped_update({"lr": torch.tensor([0.01])})(p, g, s, 1),
        "a meta lr": lambda: _vmapped_update({"lr": torch.tensor(0.01, device="meta")})(p, g, s, 1),
        "an lr requiring grad": lambda: _vmapped_update({"lr": torch.tensor(0.01, requires_grad=True)})(p, g, s, 1),
        "a float step tensor": lambda: _vmapped_update(hp)(p, g, s, torch.tensor(2.0)),
        "a 0-d tensor step 0": lambda: _vmapped_update(hp)(p, g, s, torch.tensor(0)),
        "a member's step": lambda: _vmapped_update(hp, in_dims=(0, 0, 0, 0))(p, g, s, torch.tensor([1, 2, 3])),
        "a tensor max_unorm": lambda: torch.vmap(
            lambda q, r, u: bnbf.update(q, r, u, hp, 1, max_unorm=torch.tensor(0.5))
        )(p, g, s),
        "grad of a vmapped step": lambda: torch.func.grad(
            lambda q: sum(t.sum() for t in tree_leaves(_vmapped_update(hp)(q, g, s, 1)[0]))
        )(p),
    }

    def in_place(shared: bool):  # on copies: what the step writes; with a grad at a param's memory, or a leaf
        q, u = tree_map(torch.clone, (p, s))
        r = {**g, k: q[k]} if shared else g
        if not shared:
            q[k].requires_grad_()
        return torch.vmap(lambda a, b, c: bnbf.update_(a, b, c, hp, 1))(q, r, u)

    cases["in place, a grad sharing a param's memory"] = lambda: in_place(True)
    cases["in place, a param requiring grad"] = lambda: in_place(False)
    before = [t.clone() for t in tree_leaves((p, g, s))]
    for name, call in cases.items():
        bnbf._vmap_memo.MEMOS.clear()
        _vmapped_update(hp)(p, g, s, 1)  # the memo this call is compared with
        assert bnbf._vmap_memo.MEMOS, name
        got = _outcome(call)
        want = _without_memo(call)
        assert got[0] == want[0] and got[1:] == want[1:] if got[0] == "raised" else _same(got[1], want[1]), name
    assert all(torch.equal(a, b) for a, b in zip(tree_leaves((p, g, s)), before))


_LOOK_THE_SAME = ["members along dim 1", "slots the hyperparameters drop", "step -1", "grads keyed in another order"]
if torch.cuda.is_available():
    _LOOK_THE_SAME.append("grads on another device")


@_memo_needs_native
@pytest.mark.parametrize("case", _LOOK_THE_SAME)
def test_the_memo_is_not_taken_where_the_tensors_alone_look_the_same(case):
    """What the stacked tensors' shapes and dtypes cannot tell: square params whose members lie along dim 1 (the
    same shape, contiguous), SGD's momentum slot that momentum 0 drops (the same state tensors), a step SGD's
    scalars do not read, grads of equal shapes under each other's keys, grads on another device. The full path's
    outcome each time."""
    gen = torch.Generator().manual_seed(0)
    p = {"a": torch.randn(B, B, generator=gen), "b": torch.randn(B, B, generator=gen)}
    g = {"a": torch.randn(B, B, generator=gen), "b": torch.randn(B, B, generator=gen)}
    hp = {"lr": 0.01, "momentum": 0.9}
    s = torch.vmap(lambda q: bnbf.init_state(q, bnbf.OptimSpec(rule="sgd", min_8bit_size=0), hp))(p)
    calls = {
        "members along dim 1": lambda: _vmapped_update(hp, in_dims=(1, 1, 0, None))(p, g, s, 1),
        "slots the hyperparameters drop": lambda: _vmapped_update({"lr": 0.01, "momentum": 0.0})(p, g, s, 1),
        "step -1": lambda: _vmapped_update(hp)(p, g, s, -1),
        "grads keyed in another order": lambda: _vmapped_update(hp)(p, {"b": g["b"], "a": g["a"]}, s, 1),
        "grads on another device": lambda: _vmapped_update(hp)(p, tree_map(lambda t: t.cuda(), g), s, 1),
    }
    call = calls[case]
    bnbf._vmap_memo.MEMOS.clear()
    _vmapped_update(hp)(p, g, s, 1)
    assert bnbf._vmap_memo.MEMOS
    got, want = _outcome(call), _without_memo(call)
    assert got[0] == want[0]
    assert got[1:] == want[1:] if got[0] == "raised" else _same(got[1], want[1])


@_memo_needs_native
@pytest.mark.parametrize("fn", ["update", "update_"])
def test_a_repeated_vmapped_step_over_no_members(fn):
    """An ensemble of no members, stepped again (its memo taken): nothing to step, no error (the in-place step
    reached the launcher's table with no rows)."""
    p, g = {"a": torch.randn(0, 300)}, {"a": torch.randn(0, 300)}
    s = torch.vmap(lambda q: bnbf.init_state(q, bnbf.OptimSpec(rule="adamw", min_8bit_size=256)))(p)
    step = torch.vmap(lambda q, r, u, t: getattr(bnbf, fn)(q, r, u, {"lr": 0.01}, t), in_dims=(0, 0, 0, None))
    bnbf._vmap_memo.MEMOS.clear()
    for t in (1, 2, 3):
        new_p, new_s = step(p, g, s, t)
        assert new_p["a"].shape == (0, 300) and all(x.shape[0] == 0 for x in new_s["a"])
    assert bnbf._vmap_memo.MEMOS


@_memo_needs_native
@pytest.mark.skipif(INTERP, reason="every rule on the reference path; the interpreter runs CASES above")
@pytest.mark.parametrize("bits", [8, 32])
@pytest.mark.parametrize("rule", list(bnbf.RULES))
def test_every_rule_steps_alike_with_the_memo_and_without(rule, bits):
    """Each rule's repeated vmapped step, pure and in place, with the memo taken and with the full checks: the same
    outputs and the same stacked tensors written, bit for bit."""
    p, g = _stack(numels=(7, 300))
    hp = {"lr": 0.01}
    spec = bnbf.OptimSpec(rule=rule, state_bits=bits, min_8bit_size=256)
    s = torch.vmap(lambda q: bnbf.init_state(q, spec, hp))(p)
    for fn in (bnbf.update, bnbf.update_):
        step = torch.vmap(lambda q, r, u, t, fn=fn: fn(q, r, u, hp, t), in_dims=(0, 0, 0, None))
        bnbf._vmap_memo.MEMOS.clear()
        first = tree_map(torch.clone, (p, s))
        step(first[0], g, first[1], 1)  # remembered
        a, b = tree_map(torch.clone, first), tree_map(torch.clone, first)
        got = step(a[0], g, a[1], 2)
        want = _without_memo(lambda step=step, b=b: step(b[0], g, b[1], 2))
        assert want[0] == "ok" and _same(got, want[1]) and _same(a, b), fn.__name__


@_memo_needs_native
@pytest.mark.parametrize("fn", ["update", "update_"])
def test_a_nested_tree_takes_the_memo(monkeypatch, fn):
    """A tree nested by module (the core's walk: its spec one object per structure, the state tree's the params'):
    the repeated vmapped step takes the memo and equals the full checks."""
    p, g = _stack(numels=(7, 300))
    nest = lambda t: {"blk": {"w": t["t300"]}, "bias": [t["t7"]]}  # noqa: E731
    p, g = nest(p), nest(g)
    s = torch.vmap(lambda q: bnbf.init_state(q, bnbf.OptimSpec(rule="adamw", min_8bit_size=256)))(p)
    call = getattr(bnbf, fn)
    step = torch.vmap(lambda q, r, u, t: call(q, r, u, {"lr": 0.01}, t), in_dims=(0, 0, 0, None))
    bnbf._vmap_memo.MEMOS.clear()
    first = tree_map(torch.clone, (p, s))
    step(first[0], g, first[1], 1)
    a, b = tree_map(torch.clone, first), tree_map(torch.clone, first)
    want = _without_memo(lambda: step(b[0], g, b[1], 2))
    traced = _full_checks_counted(monkeypatch)
    got = step(a[0], g, a[1], 2)
    assert not traced, "the repeated call ran the full checks"
    assert want[0] == "ok" and _same(got, want[1]) and _same(a, b)

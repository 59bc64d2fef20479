"""The per-step host checks of an in-place step (bnbf/plan.py: ``Plan._grads_fit``, ``Plan._confirm`` and
``Plan._same``) and the grads' address tables (``Plan._grad_tables``), in both twins: plain Python, and the
C++ extension built at install time (bnbf/csrc/host_checks.cpp; skipped where it was not built). Every input
either twin sends down the slow path is refused with the precise error and nothing written (or, for
non-contiguous and subclass grads, stepped as the generic path steps it); both twins answer alike; nothing is
compiled or built at run time.

The checks run on the direct path only (CUDA, or CPU under ``TRITON_INTERPRET=1``); the ``direct`` fixture
takes that path on CPU in both modes with the launch recorded instead of run, so these tests are quick.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_untouched, snapshot

import bnbf

# argument checks, errors and plumbing, not kernel numerics: the interpreter pass skips them (conftest)
pytestmark = pytest.mark.surface
P = importlib.import_module("bnbf.plan")  # the module (``bnbf.plan`` is the function that makes a plan)
HP = {"lr": 1e-2, "weight_decay": 0.0}
SPEC = bnbf.OptimSpec(rule="adamw", min_8bit_size=8)
SHAPES = [(3, 4), (1,), (257,), (2, 0), (5, 1, 2)]


class Sub(torch.Tensor):
    pass


@pytest.fixture
def direct(monkeypatch):
    """Plans take the direct path for CPU tensors; launches are recorded, not run: (group, the addresses in its
    grad table, which are what the kernel reads; a plan makes the table current before it launches)."""
    launches: list = []

    def record(group, grads, hp, *a, grads_placed=False, **k):
        assert grads_placed, "a plan passes the grads through their table"
        launches.append((group, group.grad_table.tolist()))

    monkeypatch.setattr(P, "use_triton", lambda t: True)
    monkeypatch.setattr(P, "launch_group", record)
    return launches


def leaf_addresses(opt, launches: list) -> list[int]:
    """The grad addresses the recorded launches of one step read, in leaf order."""
    out = [None] * len(opt.params)
    for (pick, _), (_, addresses) in zip(opt.groups, launches, strict=True):
        leaves = range(len(out)) if pick is None else pick(range(len(out)))
        for i, a in zip(leaves, addresses, strict=True):
            out[i] = a
    return out


def problem():
    params = [torch.randn(s) for s in SHAPES]
    return params, bnbf.init_state(params, SPEC), [torch.randn(s) for s in SHAPES]


def grad_cases():
    """(name, grads -> grads, None if the grads are fine, else (exception, message)). The fine ones that
    are not plain contiguous tensors take the slow path (``_grads_fit`` False) and step all the same."""
    return [
        ("same", lambda g: g, None),
        ("tuple", lambda g: tuple(g), (ValueError, "grad structure")),  # the params are a list
        ("parameter grad", lambda g: [torch.nn.Parameter(g[0]), *g[1:]], None),
        ("non-contiguous", lambda g: [torch.randn(4, 3).t(), *g[1:]], None),
        ("subclass", lambda g: [g[0].as_subclass(Sub), *g[1:]], None),
        ("transposed shape", lambda g: [torch.randn(4, 3), *g[1:]], (ValueError, r"grad\[0\] has shape \(4, 3\)")),
        ("extra dim", lambda g: [g[0], torch.randn(1, 1), *g[2:]], (ValueError, r"grad\[1\] has shape \(1, 1\)")),
        ("dtype", lambda g: [g[0].double(), *g[1:]], (TypeError, r"grad\[0\] has dtype torch.float64")),
        ("bf16", lambda g: [*g[:2], g[2].bfloat16(), *g[3:]], (TypeError, r"grad\[2\] has dtype torch.bfloat16")),
        ("device", lambda g: [torch.empty(3, 4, device="meta"), *g[1:]], (ValueError, r"grad\[0\] is on meta")),
        ("sparse", lambda g: [torch.randn(3, 4).to_sparse(), *g[1:]], (RuntimeError, "sparse gradients")),
        ("sparse csr", lambda g: [torch.randn(3, 4).to_sparse_csr(), *g[1:]], (RuntimeError, "sparse gradients")),
        *[("mkldnn", lambda g: [torch.randn(3, 4).to_mkldnn(), *g[1:]], (RuntimeError, "layout torch._mkldnn"))]
        * torch.backends.mkldnn.is_available(),  # strided-looking (contiguous, a shape) but no data pointer
        # memory that is not the values: a negative bit (x.conj().imag), an efficient zero tensor (address 0)
        ("negated", lambda g: [torch._neg_view(g[0]), *g[1:]], (TypeError, r"grad\[0\] has its negative bit set")),
        ("zero tensor", lambda g: [torch._efficientzerotensor(3, 4), *g[1:]], (TypeError, "efficient zero tensor")),
        ("not a tensor", lambda g: [g[0], None, *g[2:]], (ValueError, r"grad\[1\] is None")),
        ("a number", lambda g: [*g[:-1], 1.0], (TypeError, r"grad\[\d+\] must be a Tensor, got float")),
        ("a dict", lambda g: dict(enumerate(g)), (ValueError, "grad structure")),
        ("one short", lambda g: g[:-1], (ValueError, "grad structure")),
        ("one more", lambda g: [*g, torch.randn(1)], (ValueError, "grad structure")),
        ("not a list", lambda g: iter(g), (ValueError, "grad structure")),
    ]


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("name,mutate,error", grad_cases(), ids=[c[0] for c in grad_cases()])
def test_grads(twin, direct, name, mutate, error):
    params, state, grads = problem()
    opt = bnbf.plan(params, state)
    assert opt.groups, "the direct path was not taken"
    mutated = mutate(grads)
    fits = opt._grads_fit(list(mutated), opt.params) if isinstance(mutated, list | tuple) else False
    assert fits is (name in ("same", "tuple", "parameter grad"))
    if twin == "native" and isinstance(mutated, list | tuple):  # the check with the grads' addresses: same answer

        def packed(gs):
            return b"".join(g.data_ptr().to_bytes(8, sys.byteorder) for g in gs)

        got = P.NATIVE.grads_fit_at(opt.params, list(mutated), packed(grads))
        moved = fits and packed(mutated) != packed(grads)
        assert got == (packed(mutated) if moved else fits) and type(got) is (bytes if moved else bool)
        if fits:  # somewhere else: their addresses
            assert P.NATIVE.grads_fit_at(opt.params, list(mutated), b"") == packed(mutated)
    snap = snapshot(params, state, [g for g in grads if g.layout == torch.strided])
    if error is None:
        given = mutate(grads)
        opt.step(given, HP, 1)
        # each leaf's grad where it is contiguous, else a contiguous copy of it (another address)
        for i, (g, at) in enumerate(zip(given, leaf_addresses(opt, direct), strict=True)):
            assert (at == g.data_ptr()) is g.is_contiguous(), i
        return
    with pytest.raises(error[0], match=error[1]):
        opt.step(mutate(grads), HP, 1)
    assert direct == []  # nothing launched
    assert_untouched(snap)


def test_confirm_notices_what_can_change_between_steps(twin, direct):
    """A param or state field given other memory, shape, dtype or strides in place: the plan's per-step
    confirmation says no (the plan then checks and builds itself again). A state field resized or restrided in
    place keeps its address: the confirmation compares its shape, dtype and contiguity too."""
    changes = {
        "nothing": lambda ps, ss: None,
        "resize_": lambda ps, ss: ps[0].resize_(2, 4),
        "t_": lambda ps, ss: ps[0].t_(),
        "square .data = t()": lambda ps, ss: setattr(ps[5], "data", ps[5].data.t()),
        ".data = new memory": lambda ps, ss: setattr(ps[2], "data", ps[2].data.clone()),
        ".data = dtype view": lambda ps, ss: setattr(ps[2], "data", ps[2].data.view(torch.int32)),
        "set_": lambda ps, ss: ps[1].set_(torch.zeros(1)),
        "storage resized": lambda ps, ss: ps[2].untyped_storage().resize_(4 * 300),
        "state field .data": lambda ps, ss: setattr(ss[2].exp_avg, "data", ss[2].exp_avg.data.clone()),
        "state field resize_": lambda ps, ss: ss[2].exp_avg.resize_(100),
        "state scales as_strided_": lambda ps, ss: ss[2].exp_avg_absmax.as_strided_((1,), (1,)),
        "state field set_": lambda ps, ss: ss[0].exp_avg.set_(ss[0].exp_avg.untyped_storage(), 0, (2, 4), (4, 1)),
        "square state field t_": lambda ps, ss: ss[5].exp_avg.t_(),
        "state field .data = dtype view": lambda ps, ss: setattr(
            ss[2].exp_avg, "data", ss[2].exp_avg.data.view(torch.int8)
        ),
        "another device": lambda ps, ss: torch.utils.swap_tensors(ps[0], torch.empty(3, 4, device="meta")),
        "a subclass": lambda ps, ss: setattr(ps[0], "__class__", Sub),
    }
    for name, change in changes.items():
        params = [torch.randn(s) for s in SHAPES] + [torch.randn(3, 3)]
        state = bnbf.init_state(params, SPEC)
        opt = bnbf.plan(params, state)
        change(params, state)
        assert opt._confirm(params, state) is (name == "nothing"), name


def test_meta_match_with_addresses_checks_both_in_one_pass():
    """The compiled confirmation of the params (``meta_match`` with their packed addresses): yes only where every
    param has its twin's shape, dtype and contiguity and its planned address; no for a moved param, a short or
    malformed address list."""
    if P.NATIVE is None:
        pytest.skip("the C++ host checks were not built (pip install --no-build-isolation builds them)")
    import array

    params = [torch.randn(3, 4), torch.randn(5)]
    twins = [torch.empty_like(p, device="meta") for p in params]
    packed = array.array("Q", [p.data_ptr() for p in params]).tobytes()
    assert P.NATIVE.meta_match(params, twins, packed) is True
    assert P.NATIVE.meta_match(params, twins) is True
    moved = array.array("Q", [params[0].data_ptr(), params[1].data_ptr() + 4]).tobytes()
    assert P.NATIVE.meta_match(params, twins, moved) is False
    assert P.NATIVE.meta_match(params, twins, packed[:8]) is False
    assert P.NATIVE.meta_match(params, twins, None) is False
    params[1].data = params[1].data.clone()  # same shape and dtype, other memory
    assert P.NATIVE.meta_match(params, twins) is True
    assert P.NATIVE.meta_match(params, twins, packed) is False


def test_fields_match_checks_each_field_of_each_state():
    """The compiled confirmation of the state fields (``fields_match`` with the record ``fields_packed`` made when
    the plan was built): yes only where every field is at its planned address with its planned shape and dtype,
    contiguous; no for a field resized, restrided or given other memory, and for a short or malformed list."""
    if P.NATIVE is None:
        pytest.skip("the C++ host checks were not built (pip install --no-build-isolation builds them)")
    states = bnbf.init_state([torch.randn(300), torch.randn(4, 4)], SPEC)
    packed = P.NATIVE.fields_packed(states)
    assert P.fields_planned(states) == packed
    match = P.NATIVE.fields_match
    assert match(states, packed) is True
    assert match(states[:1], packed) is False  # a state short
    assert match(states, packed[:-8]) is False  # a size short
    assert match(states, packed + packed[:8]) is False  # a word more
    assert match(states, None) is False
    assert match([list(states[0]), states[1]], packed) is False  # a state is a tuple
    assert P.NATIVE.fields_packed([list(states[0])]) is None
    assert P.NATIVE.fields_packed([(torch.zeros(1), 1)]) is None
    edits = {
        "resize_": lambda s: s[0].exp_avg.resize_(100),
        "resize_ same numel": lambda s: s[1].exp_avg.resize_(2, 8),
        "as_strided_": lambda s: s[1].exp_avg.as_strided_((4, 4), (1, 4)),
        ".data = clone": lambda s: setattr(s[0].exp_avg_sq, "data", s[0].exp_avg_sq.data.clone()),
        ".data = dtype view": lambda s: setattr(s[0].exp_avg, "data", s[0].exp_avg.data.view(torch.int8)),
    }
    for name, edit in edits.items():
        states = bnbf.init_state([torch.randn(300), torch.randn(4, 4)], SPEC)
        packed = P.NATIVE.fields_packed(states)
        edit(states)
        assert match(states, packed) is False, name


def test_own_grads_are_read_and_checked_in_one_call(direct):
    """``own_grads_at`` (bnbf_nn's read of its params' own grads, ``Plan._grads_held``): None where a param has no
    grad or one the step's check refuses (non-contiguous, a subclass), True where every grad is at the tables'
    addresses, else the grads and their addresses; ``_step_held`` launches from the same tables as ``step``."""
    if P.NATIVE is None:
        pytest.skip("the C++ host checks were not built (pip install --no-build-isolation builds them)")
    import array

    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = bnbf.plan(params, bnbf.init_state(params, SPEC))
    assert opt._grads_held() is None  # no grads yet
    for p in params[:-1]:
        p.grad = torch.randn_like(p)
    assert opt._grads_held() is None  # one param without a grad
    params[-1].grad = torch.randn_like(params[-1])
    grads, packed = opt._grads_held()
    assert all(a is p.grad for a, p in zip(grads, params, strict=True))
    assert packed == array.array("Q", [p.grad.data_ptr() for p in params]).tobytes()
    opt._step_held((grads, packed), HP, 1)
    assert leaf_addresses(opt, direct) == [p.grad.data_ptr() for p in params]
    assert opt._grads_held() is True  # where the step's tables have them
    opt._step_held(True, HP, 2)
    assert leaf_addresses(opt, direct[-len(opt.groups) :]) == [p.grad.data_ptr() for p in params]
    for bad in (torch.randn(4, 3).t(), torch.randn(3, 4).as_subclass(Sub)):
        params[0].grad = bad
        assert opt._grads_held() is None, type(bad)
    params[0].grad = torch.randn(3, 4)
    assert opt._grads_held() is not None
    held = P.NATIVE.own_grads_at
    assert held(params, b"") is not True and held(tuple(params), b"") is not None
    assert held("not a list", b"") is None and held(params, None) is None


def test_cached_plans_know_their_objects(twin, direct):
    """update_'s cached plan steps only the very params and states it was built for: the same leaves in new
    lists are it, a new state object at the same place or a param swapped for another is not."""
    params, state, grads = problem()
    bnbf.update_(params, grads, state, HP, 1)
    key = (id(params[0]), id(params[-1]), id(state[0]), id(state[-1]), len(params))
    plan = P._PLANS[key]
    assert plan._same(list(params), list(state))
    assert not plan._same([*params[:2], torch.randn(257), *params[3:]], state)
    assert not plan._same(params, [*state[:1], type(state[1])(*state[1]), *state[2:]])  # equal fields, new tuple
    assert not plan._same(params[:-1], state[:-1])


def test_a_param_cannot_become_sparse_in_place():
    """Why a step does not check the params' layout: torch refuses it."""
    p = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match="incompatible tensor type"):
        p.data = p.data.to_sparse()


def test_nothing_is_compiled_or_built_at_run_time(tmp_path):
    """Importing bnbf and bnbf_nn and stepping both spawns no process (no compiler) and writes no cache."""
    script = """
import subprocess, sys
spawned = []
real = subprocess.Popen.__init__
def record(self, args, *a, **k):
    spawned.append(args)
    return real(self, args, *a, **k)
subprocess.Popen.__init__ = record
import torch, bnbf, bnbf_nn

p = {"w": torch.randn(300), "b": torch.randn(3)}
s = bnbf.init_state(p, bnbf.OptimSpec(rule="adamw", min_8bit_size=256))
for step in (1, 2):
    bnbf.update_(p, {k: torch.randn_like(v) for k, v in p.items()}, s, {"lr": 1e-3}, step)
model = torch.nn.Linear(4, 4)
opt = bnbf_nn.AdamW8bit(model.parameters(), min_8bit_size=0)
for _ in range(2):
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
compilers = [a for a in spawned if any(c in str(a) for c in ("c++", "g++", "gcc", "clang", "nvcc", "cl.exe"))]
assert not compilers, compilers
"""
    env = dict(os.environ, HOME=str(tmp_path), XDG_CACHE_HOME=str(tmp_path / "cache"), CXX="/bin/false")
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=Path(__file__).parent.parent,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (tmp_path / "cache" / "bnbf").exists() and not (tmp_path / ".cache" / "bnbf").exists()


def test_only_the_install_compiles():
    """The C++ sources are the host checks' and the CPU codec's (setup.py builds both at install time), and no
    module of the package compiles or builds anything."""
    root = Path(bnbf.__file__).parent
    cpp = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.cpp"))
    assert cpp == ["csrc/cpu_codec.cpp", "csrc/host_checks.cpp"]
    for path in root.rglob("*.py"):
        text = path.read_text()
        for needle in ("subprocess", "cpp_extension", "ExtensionFileLoader", "BNBF_NATIVE"):
            assert needle not in text, f"{path.relative_to(root)} mentions {needle}"


def _tables_hold(opt, grads) -> bool:
    """Each group's grad table holds its grads' addresses (and what launch_group compares them with), from a
    16-byte aligned row."""
    for pick, group in opt.groups:
        picked = grads if pick is None else pick(grads)
        ptrs = [g.data_ptr() for g in picked]
        assert group.grad_table.data_ptr() % 16 == 0
        assert group.grad_table.tolist() == ptrs
        assert list(group.grad_ptrs) == (ptrs if P.NATIVE is None else [])  # the Python twin's comparison
        assert group.grad_packed == b"".join(p.to_bytes(8, sys.byteorder) for p in ptrs)
        assert group.grads_aligned is all(p % 16 == 0 for p in ptrs)
    return True


def test_grad_tables_are_written_once_per_place_of_the_grads(twin, direct):
    """All groups' grad-address tables are written in one pass when the grads move (a training loop that
    allocates new grads every step) and kept while they stay; their rows are the grads' addresses."""
    params, state, grads = problem()
    opt = bnbf.plan(params, state)
    assert len(opt.groups) == 2, "8-bit and 32-bit states: two launch groups, one table"
    opt.step(grads, HP, 1)
    assert _tables_hold(opt, grads)
    kept = [group.grad_table for _, group in opt.groups]
    assert kept[0]._base is kept[1]._base is not None  # one table: one upload per device
    opt.step(list(grads), HP, 2)  # the same tensors in a new list
    assert all(group.grad_table is t for (_, group), t in zip(opt.groups, kept))
    others = [g.clone() for g in grads]
    for step, gs in enumerate([others, grads, others[:2] + grads[2:]], start=3):  # new places, then mixed
        opt.step(gs, HP, step)
        assert _tables_hold(opt, gs)


def test_grad_table_twins_agree_and_refuse_what_they_cannot_write():
    """The compiled grad_table writes what the Python twin writes (padding rows zero) and leaves ``out``
    untouched, answering None, for anything it cannot write."""
    if P.NATIVE is None:
        pytest.skip("the C++ host checks were not built (pip install --no-build-isolation builds them)")
    seqs = [[torch.randn(3), torch.randn(2)[1:]], (torch.randn(5),), [torch.randn(1), torch.randn(2), torch.randn(4)]]
    rows = 2 + 1 + 1 + 3  # each seq from an even row: row 3 pads
    out, twin = torch.full((rows,), -1, dtype=torch.int64), torch.full((rows,), -1, dtype=torch.int64)
    ptrs = [[t.data_ptr() for t in s] for s in seqs]
    assert P.NATIVE.grad_table(seqs, out) == P._grad_table(ptrs, twin)
    assert torch.equal(out, twin) and out[3].item() == 0
    assert out[2].item() == seqs[1][0].data_ptr()
    assert P._grad_table(ptrs, twin)[0] == b"".join(p.to_bytes(8, sys.byteorder) for s in ptrs for p in s)
    bad = {
        "too short": (seqs, torch.empty(rows - 1, dtype=torch.int64)),
        "int32": (seqs, torch.empty(rows, dtype=torch.int32)),
        "strided": (seqs, torch.empty(2 * rows, dtype=torch.int64)[::2]),
        "not a tensor": ([[torch.randn(1), 3]], torch.empty(2, dtype=torch.int64)),
        "a subclass": ([[torch.randn(1).as_subclass(Sub)]], torch.empty(1, dtype=torch.int64)),
        "not a sequence": ([iter(seqs[0])], torch.empty(2, dtype=torch.int64)),
    }
    for name, (s, o) in bad.items():
        before = o.clone()
        assert P.NATIVE.grad_table(s, o) is None, name
        assert torch.equal(o, before), name


@pytest.mark.parametrize("keys", [["w", "b", "odd"], [0, 1, 2]], ids=["str", "int"])
def test_dict_grads_are_taken_by_their_keys(twin, direct, keys):
    """A plan of a dict takes a dict of grads with its keys in its order (equal keys that are other objects
    too), and refuses other keys or another order with the structure error, nothing written."""
    params = dict(zip(keys, [torch.randn(3, 4), torch.randn(1), torch.randn(257)]))
    state = bnbf.init_state(params, SPEC)
    opt = bnbf.plan(params, state)
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    copied = {(k if isinstance(k, int) else "".join(list(k))): g for k, g in grads.items()}  # equal, new objects
    opt.step(grads, HP, 1)
    opt.step(copied, HP, 2)
    stepped = sorted(a for _, addresses in direct for a in addresses)
    assert stepped == sorted(g.data_ptr() for g in list(grads.values()) * 2)  # each grad once per step, none other
    snap = snapshot(params, state)
    for bad in (
        dict(reversed(grads.items())),  # another order
        {**grads, "extra": torch.randn(1)},
        dict(list(grads.items())[:-1]),
        {(k, 0): g for k, g in grads.items()},
    ):
        with pytest.raises(ValueError, match="grad structure"):
            opt.step(bad, HP, 3)
    assert_untouched(snap)


def test_plain_dict_twins_tell_apart_every_number_that_differs():
    """``same_plain_dicts`` (a kept partition's hyperparameters given again as new dicts): equal dicts of the same
    numbers match; a value of another type (``0`` against ``0.0``, ``1`` against ``True``), a zero of the other
    sign, another tuple item, another key order or key, or anything not a plain number does not; the compiled
    function and its Python twin agree on each."""
    from bnbf import _host_checks as H

    base = {"lr": 1e-3, "weight_decay": 0.0, "betas": (0.9, 0.99), "maximize": False, "k": 3}
    nan = {"lr": float("nan")}
    drop_k = {k: v for k, v in base.items() if k != "k"}
    cases = {
        "equal": ([dict(base), dict(nan)], True),
        "int for float": ([{**base, "weight_decay": 0}, nan], False),
        "-0.0 for 0.0": ([{**base, "weight_decay": -0.0}, nan], False),
        "1 for False": ([{**base, "maximize": 0}, nan], False),
        "float for int": ([{**base, "k": 3.0}, nan], False),
        "tuple item": ([{**base, "betas": (0.9, 0.98)}, nan], False),
        "int in a tuple": ([{**base, "betas": (0.9, 1)}, nan], False),
        "list for tuple": ([{**base, "betas": [0.9, 0.99]}, nan], False),
        "nested tuple": ([{**base, "betas": ((0.9,), 0.99)}, nan], False),
        "key order": ([dict(reversed(base.items())), nan], False),
        "other key": ([{**drop_k, "j": 3}, nan], False),
        "tensor": ([{**base, "lr": torch.tensor(1e-3)}, nan], False),
        "schedule": ([{**base, "lr": lambda s: 1e-3}, nan], False),
        "not a dict": ([list(base.items()), nan], False),
        "fewer": ([dict(base)], False),
        "the nan's other bits": ([dict(base), {"lr": -float("nan")}], False),
    }
    for name, (dicts, same) in cases.items():
        got = [H._same_plain_dicts(dicts, [base, nan])]
        if H.NATIVE is not None:
            got.append(H.NATIVE.same_plain_dicts(dicts, [base, nan]))
        assert got == [same] * len(got), f"{name}: {got}, expected {same}"

"""The explicit plan (``bnbf.plan``): the same steps as ``bnbf.update_`` and ``bnbf.update``, every check of
the params and states made when it is built, and a plan that notices params and states changed in place
between steps. Runs on both paths (on the reference path a plan takes ``update_``'s generic path)."""

from __future__ import annotations

import doctest
import functools
import gc
import importlib
import re
import weakref

import pytest
import torch
from conftest import DEVICES, assert_untouched, kernel_runs, snapshot

import bnbf
import bnbf_nn

P = importlib.import_module("bnbf.plan")  # the module (``bnbf.plan`` is the function that makes a plan)
HPS = [{"lr": 1e-2, "weight_decay": 0.01}, {"lr": 3e-3, "betas": (0.8, 0.95)}, {"lr": 1e-3, "eps": 1e-6}]
SPEC8 = bnbf.OptimSpec(rule="adamw", min_8bit_size=256)
SPEC32 = bnbf.OptimSpec(rule="adamw", state_bits=32)
direct_path = pytest.mark.skipif(not kernel_runs("cpu"), reason="plans take the direct launch on the Triton path")


def test_the_docstring_example_runs():
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner()
    for test in finder.find(P.plan, "plan", globs={}):
        runner.run(test)
    assert runner.failures == 0 and runner.tries > 0


def _params(seed: int = 0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    shapes = {"emb": (40, 16), "w": (16, 17), "b": (17,), "one": (1,), "odd": (257,)}
    return {k: torch.randn(s, generator=gen).to(dtype) for k, s in shapes.items()}


def _grads(params, step):
    gen = torch.Generator().manual_seed(100 + step)
    return {k: torch.randn(v.shape, generator=gen).to(v.dtype) for k, v in params.items()}


def _clone(tree):
    return {k: type(v)(*(t.clone() for t in v)) if bnbf.state.is_state(v) else v.clone() for k, v in tree.items()}


def _equal(a, b):
    for k in a:
        if bnbf.state.is_state(a[k]):
            assert all(torch.equal(x, y) for x, y in zip(a[k], b[k])), k
        else:
            assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("spec", [SPEC8, SPEC32], ids=["8bit", "32bit"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_plan_step_is_update_and_update_(spec, dtype):
    """Three steps with changing hyperparameters (8-bit: the small tensors in a second, 32-bit group)."""
    params = _params(dtype=dtype)
    state = bnbf.init_state(params, spec)
    ref_p, ref_s = _clone(params), _clone(state)
    in_p, in_s = _clone(params), _clone(state)
    opt = bnbf.plan(params, state)
    for step, hp in enumerate(HPS, 1):
        g = _grads(params, step)
        opt.step(g, hp, step)
        bnbf.update_(in_p, g, in_s, hp, step)
        ref_p, ref_s = bnbf.update(ref_p, g, ref_s, hp, step)
    for a, b in ((params, ref_p), (state, ref_s), (in_p, ref_p), (in_s, ref_s)):
        _equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_grads_at_new_places_step_as_the_pure_update(device):
    """Grads that move between steps (new tensors every step, as ``zero_grad(set_to_none=True)`` leaves them),
    come back to an earlier place, or stay: each step reads this step's grads (the grad-address table is
    rewritten and uploaded only when they move)."""
    params = {k: v.to(device) for k, v in _params().items()}
    state = bnbf.init_state(params, SPEC8)
    ref_p, ref_s = _clone(params), _clone(state)
    opt = bnbf.plan(params, state)
    sets = [{k: v.to(device) for k, v in _grads(params, k).items()} for k in range(2)]  # kept: distinct places
    for step, k in enumerate([0, 1, 1, 0], 1):  # moved, stayed, back
        opt.step(sets[k], HPS[0], step)
        ref_p, ref_s = bnbf.update(ref_p, sets[k], ref_s, HPS[0], step)
        _equal(params, ref_p)
        _equal(state, ref_s)
    tables = [group.grad_table for _, group in opt.groups]  # none on the reference path (generic steps)
    assert all(t.device.type == torch.device(device).type and t._base is tables[0]._base for t in tables)  # one upload


@pytest.mark.parametrize(
    "tree",
    [
        lambda p: p["w"],  # one tensor
        lambda p: list(p.values()),
        lambda p: tuple(p.values()),
        lambda p: {"layer": {"w": p["w"], "b": p["b"]}, "emb": [p["emb"]]},  # nested
    ],
    ids=["leaf", "list", "tuple", "nested"],
)
def test_any_pytree(tree):
    params = _params()
    pt = tree(params)
    state = bnbf.init_state(pt, SPEC8)
    ref_p, ref_s = bnbf.update(tree(_clone(params)), tree(_grads(params, 1)), state, HPS[0], 1)
    opt = bnbf.plan(pt, state)
    opt.step(tree(_grads(params, 1)), HPS[0], 1)
    leaves = torch.utils._pytree.tree_leaves
    assert all(torch.equal(a, b) for a, b in zip(leaves(pt), leaves(ref_p)))
    assert all(torch.equal(a, b) for a, b in zip(leaves(state), leaves(ref_s)))


@pytest.mark.parametrize(
    "make,exc,match",
    [
        (lambda w, v: ([w, w], None), ValueError, r"param\[0\] and param\[1\] are the same tensor"),
        (lambda w, v: ([w, w[1]], None), ValueError, r"param\[0\] and param\[1\] overlap in memory"),
        (lambda w, v: ([w[:, :3], w[:, 2:]], None), ValueError, r"param\[0\] and param\[1\] overlap in memory"),
        (lambda w, v: ([w, v], "other spec"), ValueError, r"state\[1\]\.exp_avg does not fit the param"),
        (lambda w, v: ([w, v], "other rule"), ValueError, r"state\[1\] is for rule 'lion'"),
        (lambda w, v: ([w, v], "not a state"), TypeError, r"state\[1\] is not a bnbf state"),
        (lambda w, v: ([w, v.long()], None), TypeError, r"param\[1\] has dtype torch.int64"),
        (lambda w, v: ([], None), ValueError, "at least one tensor"),
    ],
    ids=[
        "same tensor",
        "row view",
        "column views",
        "state of another param",
        "mixed rules",
        "not a state",
        "integer param",
        "empty",
    ],
)
def test_every_check_of_params_and_states_is_made_when_the_plan_is_built(make, exc, match):
    w, v = torch.randn(4, 8), torch.randn(8)
    params, how = make(w, v)
    states = [bnbf.init_state(p, SPEC32) if p.is_floating_point() else None for p in params]
    if how == "other spec":
        states[1] = bnbf.init_state(torch.randn(9), SPEC32)
    elif how == "other rule":
        states[1] = bnbf.init_state(v, bnbf.OptimSpec(rule="lion", state_bits=32))
    elif how == "not a state":
        states[1] = torch.zeros(8)
    elif params and not params[-1].is_floating_point():
        states[-1] = bnbf.init_state(v, SPEC32)
    snap = snapshot(w, v)
    with pytest.raises(exc, match=match):
        bnbf.plan(params, states)
    assert_untouched(snap)


@direct_path
def test_hyperparameters_and_steps_never_rebuild_the_plan(monkeypatch):
    builds = []
    real = P.build_group
    monkeypatch.setattr(P, "build_group", lambda *a: builds.append(1) or real(*a))
    params = _params()
    opt = bnbf.plan(params, bnbf.init_state(params, SPEC8))
    n = len(builds)
    assert n == len(opt.groups) == 2
    for step, hp in enumerate([*HPS, {"lr": torch.tensor(1e-3)}, {"lr": 0.5, "weight_decay": 0.0}], 1):
        opt.step(_grads(params, step), hp, step, maximize=step % 2 == 0)
    opt.step(_grads(params, 9), HPS[0], torch.tensor(9))
    assert len(builds) == n


def _three_steps(change):
    """Two steps, ``change(params, state)``, a third step; the plan's third step against ``update`` on
    copies of what the third step is given."""
    params = {"sq": torch.randn(32, 32), "v": torch.randn(300), "s": torch.randn(5)}
    state = bnbf.init_state(params, SPEC8)
    opt = bnbf.plan(params, state)
    for step in (1, 2):
        opt.step(_grads(params, step), HPS[0], step)
    change(params, state)
    g = _grads(params, 3)
    want_p, want_s = bnbf.update({k: v.contiguous() for k, v in params.items()}, g, _clone(state), HPS[0], 3)
    opt.step(g, HPS[0], 3)
    _equal(params, want_p)
    _equal(state, want_s)


@pytest.mark.parametrize(
    "change",
    [
        lambda p, s: p["sq"].t_(),  # same shape, new strides: stepped as the new view
        lambda p, s: setattr(p["sq"], "data", p["sq"].data.t()),
        lambda p, s: setattr(p["v"], "data", p["v"].data.clone()),  # new memory (model.to(), FSDP...)
        lambda p, s: setattr(p["v"], "data", p["v"].data.to(torch.bfloat16)),  # another dtype: its state still fits
        lambda p, s: setattr(s["v"].exp_avg, "data", s["v"].exp_avg.data.clone()),  # a state field's new memory
    ],
    ids=["t_", ".data = t()", ".data = clone", ".data = bf16", "state field .data"],
)
def test_a_plan_steps_params_and_states_changed_in_place_as_they_are_now(change):
    _three_steps(change)


def test_a_plan_refuses_a_param_resized_in_place():
    p = torch.randn(4, 96)
    state = bnbf.init_state(p, SPEC8)
    opt = bnbf.plan([p], [state])
    opt.step([torch.randn(4, 96)], HPS[0], 1)
    p.resize_(2, 96)
    snap = snapshot(p, state)
    for _ in range(2):
        with pytest.raises(ValueError, match=re.escape("state[0].exp_avg does not fit the param")):
            opt.step([torch.randn(2, 96)], HPS[0], 2)
    assert_untouched(snap)


def test_bad_input_to_a_step_writes_nothing():
    params = _params()
    state = bnbf.init_state(params, SPEC8)
    opt = bnbf.plan(params, state)
    opt.step(_grads(params, 1), HPS[0], 1)
    snap = snapshot(params, state)
    bad = [
        ({**_grads(params, 2), "b": torch.randn(18)}, HPS[0], 2, ValueError, r"grad\['b'\] has shape"),
        (_grads(params, 2), {"lr": -1.0}, 2, ValueError, "Invalid learning rate: -1.0"),
        (_grads(params, 2), {"lr": float("nan")}, 2, ValueError, "Invalid learning rate: nan"),
        (_grads(params, 2), HPS[0], 0, ValueError, "Invalid step: 0"),
        (_grads(params, 2), {"lr": 1e-3, "amsgrad": True}, 2, ValueError, "the state keeps"),
    ]
    for grads, hp, step, exc, match in bad:
        with pytest.raises(exc, match=match):
            opt.step(grads, hp, step)
    assert_untouched(snap)


def test_a_plan_holds_its_tensors_and_the_update__cache_does_not():
    params = {"w": torch.randn(300)}
    state = bnbf.init_state(params, SPEC8)
    opt = bnbf.plan(params, state)
    ref = weakref.ref(params["w"])
    del params, state
    gc.collect()
    assert ref() is not None  # the plan keeps what it steps (as torch.optim keeps its params)
    opt.step({"w": torch.randn(300)}, HPS[0], 1)
    assert opt.params[0] is ref()
    del opt
    gc.collect()
    assert ref() is None


def test_bnbf_nn_steps_each_bucket_through_one_plan():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    opt = bnbf_nn.AdamW8bit(model.parameters(), lr=1e-3, min_8bit_size=256)
    for _ in range(2):
        model(torch.randn(3, 16)).square().mean().backward()
        opt.step()
    (buckets,) = opt._plans.values()
    (bucket,) = buckets.buckets
    assert isinstance(bucket.plan, bnbf.Plan)
    assert bucket.plan.params == list(model.parameters())
    assert all(opt.state[p]["step"] == 2 for p in model.parameters())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_update__frees_a_dropped_models_cuda_memory():
    """The update_ cache holds no tensor: after ``del params, state`` the memory is free again (up to the
    kernels' task lists, kept by tensor sizes, far smaller than the params)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    params = {f"w{i}": torch.randn(1 << 20, device="cuda") for i in range(8)}  # 32 MiB
    state = bnbf.init_state(params, SPEC8)
    for step in (1, 2):
        bnbf.update_(params, {k: torch.randn_like(v) for k, v in params.items()}, state, HPS[0], step)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before > 32 << 20
    del params, state
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before < 1 << 20


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("how", ["update_", "plan"])
def test_a_grad_subclass_with_its_own_dispatch_is_refused_in_place(device, how):
    """A grad such as torch's TwoTensor (its own __torch_dispatch__; data_ptr 0) beside plain params: the fused step
    cannot address it (it crashed the process: the kernel read address 0), and a copy of its step into the plain
    param keeps only one of its halves. Refused, nothing written."""
    from torch.testing._internal.two_tensor import TwoTensor

    params = {"a": torch.randn(300, device=device), "b": torch.randn(257, device=device)}
    state = bnbf.init_state(params, bnbf.OptimSpec(rule="adamw", min_8bit_size=0))
    grads = {k: torch.randn_like(p) for k, p in params.items()}
    grads["b"] = TwoTensor(grads["b"], 2 * grads["b"])
    before = snapshot(params, state)
    with pytest.raises(TypeError, match="TwoTensor"):
        if how == "plan":
            bnbf.plan(params, state).step(grads, {"lr": 0.1}, 1)
        else:
            bnbf.update_(params, grads, state, {"lr": 0.1}, 1)
    assert_untouched(before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("what", ["lr", "betas", "per-leaf lr", "step", "max_unorm", "max_grad_norm"])
def test_a_scalar_subclass_with_its_own_dispatch_is_refused_before_any_write(device, what):
    """A 0-d hyperparameter, step or bound of a subclass with its own dispatch (TwoTensor) beside plain params: the
    kernels read a scalar's memory (the launch crashed reading a TwoTensor), a plain param cannot hold its step's
    two halves, and max_grad_norm's coefficient reached the codec as a TwoTensor (a crash after the param was
    written). The in-place step refuses each, and the pure step max_grad_norm, naming it, before anything is
    written; the pure step of the others runs the subclass's dispatch (its outputs are TwoTensors)."""
    from torch.testing._internal.two_tensor import TwoTensor

    def two(v):
        return TwoTensor(torch.tensor(v, device=device), torch.tensor(v, device=device))

    params = {"a": torch.randn(300, device=device), "b": torch.randn(257, device=device)}
    grads = {k: torch.randn_like(p) for k, p in params.items()}
    state = bnbf.init_state(params, bnbf.OptimSpec(rule="adamw", min_8bit_size=0))
    hp, step, opts = {"lr": 0.1}, 1, {}
    if what == "lr":
        hp = {"lr": two(0.1)}
    elif what == "betas":
        hp = {"lr": 0.1, "betas": (two(0.9), 0.999)}
    elif what == "per-leaf lr":
        hp = {"a": {"lr": 0.1}, "b": {"lr": two(0.1)}}
    elif what == "step":
        step = two(1)
    else:
        opts = {what: two(0.5)}
    before = snapshot(params, state)
    name = {"per-leaf lr": r"hparams\['b'\]\['lr'\]", "betas": r"betas\[0\]"}.get(what, what)
    with pytest.raises(TypeError, match=rf"{name} is a TwoTensor, a tensor subclass"):
        bnbf.update_(params, grads, state, hp, step, **opts)
    assert_untouched(before)
    if what == "max_grad_norm":
        with pytest.raises(TypeError, match="max_grad_norm is a TwoTensor"):
            bnbf.update(params, grads, state, hp, step, **opts)
    elif what == "lr":
        new_p, _ = bnbf.update(params, grads, state, hp, step, **opts)
        assert type(new_p["a"]) is TwoTensor
    assert_untouched(before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("what", ["lr", "step", "max_unorm"])
def test_a_plans_step_refuses_a_scalar_subclass_with_its_own_dispatch(device, what):
    """Plan.step (bnbf_nn's step) with a TwoTensor hyperparameter, step or bound, as bnbf.update_ refuses them: the
    reference path stepped with 2.34 times the lr, the kernels crashed reading its storage."""
    from torch.testing._internal.two_tensor import TwoTensor

    def two(v):
        return TwoTensor(torch.tensor(v, device=device), torch.tensor(v, device=device))

    params = {"a": torch.randn(300, device=device), "b": torch.randn(257, device=device)}
    grads = {k: torch.randn_like(p) for k, p in params.items()}
    state = bnbf.init_state(params, bnbf.OptimSpec(rule="adamw", min_8bit_size=0))
    plan = bnbf.plan(params, state)
    hp, step, opts = {"lr": 0.1}, 1, {}
    if what == "lr":
        hp = {"lr": two(0.1)}
    elif what == "step":
        step = two(1)
    else:
        opts = {what: two(0.5)}
    before = snapshot(params, state)
    with pytest.raises(TypeError, match=rf"{what} is a TwoTensor, a tensor subclass"):
        plan.step(grads, hp, step, **opts)
    assert_untouched(before)


@pytest.mark.parametrize("device", DEVICES)
def test_an_expanded_param_is_refused_in_place_before_any_write(device):
    """A param with a zero stride (expanded) cannot be written in place; torch refuses at the write, after the
    other params and states were stepped. Refused first, nothing written; the pure step takes it."""
    params = {"a": torch.randn(300, device=device), "b": torch.randn(1, device=device).expand(300)}
    state = bnbf.init_state({k: p.clone() for k, p in params.items()}, bnbf.OptimSpec(rule="adamw", min_8bit_size=0))
    grads = {k: torch.randn(300, device=device) for k in params}
    before = snapshot(params, state)
    with pytest.raises(ValueError, match=r"param\['b'\] has a zero stride"):
        bnbf.update_(params, grads, state, {"lr": 0.1}, 1)
    assert_untouched(before)
    new_p, _ = bnbf.update(params, grads, state, {"lr": 0.1}, 1)
    assert new_p["b"].is_contiguous() and not torch.equal(new_p["b"], params["b"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rule, hp", [("adamw", {}), ("sgd", {"momentum": 0.9})], ids=["two-fields", "one-field"])
def test_state_fields_of_a_subclass_with_its_own_dispatch_are_named(device, rule, hp):
    """A state whose fields are TwoTensors (no storage at their address) beside plain params and grads: a
    TypeError naming the field, not 'the same state' (their addresses, 0, overlap), nor a kernel reading 0."""
    from torch.testing._internal.two_tensor import TwoTensor

    p = torch.randn(300, device=device)
    s = bnbf.init_state(p, bnbf.OptimSpec(rule=rule, state_bits=32), hp)
    s = type(s)(*[TwoTensor(t.clone(), t.clone()) for t in s])
    before = snapshot(p, s)
    for step in (bnbf.update, bnbf.update_):
        with pytest.raises(TypeError, match=rf"state\.{s._fields[0]} is a TwoTensor"):
            step(p, torch.randn_like(p), s, {"lr": 0.1, **hp}, 1)
    assert_untouched(before)


def test_a_missing_grad_and_a_float64_param_are_named():
    """A None grad for one param is named (the flattened structures differ in a way their printouts hide), and a
    float64 param's errors name its dtype and the route that takes it: init_state makes its float64 32-bit state
    (refusing 8-bit state), and only the differentiable step steps it."""
    params = {"a": torch.randn(3), "b": torch.randn(3)}
    state = bnbf.init_state(params, bnbf.OptimSpec(rule="adamw", state_bits=32))
    for step in (bnbf.update, bnbf.update_):
        with pytest.raises(ValueError, match=r"grad\['b'\] is None: every param of the call needs a grad"):
            step(params, {"a": torch.randn(3), "b": None}, state, {}, 1)
    with pytest.raises(TypeError, match="dtype torch.float64: float64 params take 32-bit state only"):
        bnbf.init_state(torch.randn(4096, dtype=torch.float64), bnbf.OptimSpec(rule="adamw"))
    # in a nested tree a None is a leaf to pytree, so the structures agree: the leaf checks name it (they had
    # raised AssertionError, taking the None for "no grads to check")
    nested = {"a": torch.randn(3), "m": [torch.randn(3), {"c": torch.randn(3)}]}
    n_state = bnbf.init_state(nested, bnbf.OptimSpec(rule="adamw", state_bits=32))
    n_grad = {"a": torch.randn(3), "m": [torch.randn(3), {"c": None}]}
    no_state = {"a": n_state["a"], "m": [n_state["m"][0], {"c": None}]}
    snap = snapshot(nested, n_state)
    for step in (bnbf.update, bnbf.update_, functools.partial(bnbf.update, differentiable=True)):
        with pytest.raises(ValueError, match=r"grad\['m'\]\[1\]\['c'\] is None: every param of the call needs a grad"):
            step(nested, n_grad, n_state, {}, 1)
        with pytest.raises(ValueError, match=r"state\['m'\]\[1\]\['c'\] is None: every param of the call needs a st"):
            step(nested, nested, no_state, {}, 1)
    assert_untouched(snap)
    p64 = torch.randn(3, dtype=torch.float64)
    s64 = bnbf.init_state(p64, bnbf.OptimSpec(rule="adagrad", state_bits=32), {"initial_accumulator_value": 0.3})
    assert s64.sum.dtype == torch.float64 and torch.equal(s64.sum, torch.full((3,), 0.3, dtype=torch.float64))
    for step in (bnbf.update, bnbf.update_):
        with pytest.raises(TypeError, match="float64 params step only with differentiable=True"):
            step(p64, torch.ones_like(p64), s64, {}, 1)
    new, _ = bnbf.update(p64, torch.ones_like(p64), s64, {"lr": 0.1}, 1, differentiable=True)
    torch.testing.assert_close(new, p64 - 0.1 / (1.3**0.5 + 1e-10), rtol=1e-15, atol=0)  # Adagrad's first step
    with pytest.raises(
        TypeError, match=r"param\['w'\] has dtype torch.float64: .*per-param state \(init_state without"
    ):
        bnbf.init_state(
            {"w": p64}, bnbf.OptimSpec(rule="adamw", state_bits=32), packed=True
        )  # the advice was this call


def test_a_plan_made_under_a_torch_func_transform_is_refused_in_words():
    """A plan records its tensors' addresses, which vmap's and grad's tensors do not have: making one under a
    transform raised torch's 'Cannot access data pointer'; now the error says what to use instead."""
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=0)
    params = {"w": torch.randn(3, 40)}
    states = torch.func.vmap(lambda p: bnbf.init_state(p, spec))(params)
    with pytest.raises(RuntimeError, match="cannot be made under a torch.func transform.*bnbf.update_"):
        torch.func.vmap(lambda p, s: bnbf.plan(p, s))(params, states)
    p, s = torch.randn(40), bnbf.init_state(torch.randn(40), spec)
    with pytest.raises(RuntimeError, match="cannot be made under a torch.func transform"):
        torch.func.grad(lambda q: (bnbf.plan([q], [s]), q.sum())[1])(p)


@pytest.mark.parametrize("device", DEVICES)
def test_overlapping_views_of_a_plain_subclass_are_refused_in_place(device):
    """A subclass without a dispatch of its own (``as_subclass``) has its storage where a plain tensor's is: it
    takes the full checks, so two overlapping views of one such tensor are refused before any write (they went
    the route of subclasses with their own dispatch, which skips the address checks, and were written twice)."""

    class Sub(torch.Tensor):
        pass

    base = torch.randn(600, device=device)
    params = {"a": base[:400].as_subclass(Sub), "b": base[200:].as_subclass(Sub)}
    state = bnbf.init_state({k: torch.zeros(400, device=device) for k in params}, bnbf.OptimSpec(rule="adamw"))
    grads = {k: torch.randn(400, device=device) for k in params}
    before = snapshot(base, state)
    with pytest.raises(ValueError, match=r"param\['a'\] and param\['b'\] overlap in memory"):
        bnbf.update_(params, grads, state, {"lr": 0.1}, 1)
    assert_untouched(before)


@pytest.mark.parametrize("device", DEVICES)
def test_update__keeps_no_hyperparameter_tensor_alive(device):
    """A 0-d tensor lr of an ``update_`` call is the caller's: once dropped it is freed, while the params, states and
    their cached plan live on (the plan held the last validated hyperparameters, and so the tensor, strongly)."""
    params = {k: v.to(device) for k, v in _params().items()}
    state = bnbf.init_state(params, SPEC8)
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    lr = torch.tensor(1e-2, device=device)
    ref = weakref.ref(lr)
    bnbf.update_(params, grads, state, {"lr": lr}, 1)
    del lr
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("how", ["deepcopy", "torch.save", "copy"])
def test_a_copied_or_pickled_plan_steps_its_copies(device, how):
    """A plan copied or pickled with its params and states (a training loop's bundle) is a plan of the copies:
    stepping it moves them exactly as the original moves its own (copy.copy: a second plan of the same tensors).
    torch.load's default (weights_only=True) takes the saved bundle, as it takes the params and states alone.
    update_'s cached plans hold no tensor: copying one raises, naming bnbf.plan."""
    import copy
    import io

    gen = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randn(n, generator=gen).to(device)  # noqa: E731
    params = {"w": rand(300), "b": rand(7)}
    state = bnbf.init_state(params, SPEC8)
    bundle = {"params": params, "state": state, "plan": bnbf.plan(params, state)}
    bundle["plan"].step({"w": rand(300), "b": rand(7)}, HPS[0], 1)
    if how == "deepcopy":
        other = copy.deepcopy(bundle)
    elif how == "torch.save":
        buf = io.BytesIO()
        torch.save(bundle, buf)
        buf.seek(0)
        other = torch.load(buf)  # torch's default: weights_only=True
    else:
        other = {**bundle, "plan": copy.copy(bundle["plan"])}
    same = how == "copy"
    assert all(a is b for a, b in zip(other["plan"].params, other["params"].values()))
    assert all((a is b) == same for a, b in zip(other["plan"].params, params.values()))
    grads = {"w": rand(300), "b": rand(7)}
    bundle["plan"].step(grads, HPS[0], 2)
    if not same:
        other["plan"].step(grads, HPS[0], 2)
        leaves = torch.utils._pytree.tree_leaves
        for a, b in zip(leaves((params, state)), leaves((other["params"], other["state"])), strict=True):
            assert torch.equal(a, b), "the copy's plan stepped its copies otherwise"
    if not kernel_runs(device):  # update_ caches plans on the Triton path only
        return
    bnbf.update_(params, grads, state, HPS[0], 3)
    cached = importlib.import_module("bnbf.functional")._LAST[id(params), id(state)]()
    with pytest.raises(TypeError, match=r"bnbf\.plan\(params, state\)"):
        copy.deepcopy(cached)


@pytest.mark.parametrize("how", ["update_", "plan"])
def test_a_tensor_momentum_switched_on_in_place_is_refused_as_a_new_one_is(how):
    """Hyperparameters holding a tensor whose value decides the state's slots (SGD's momentum) are checked every
    step: the plan skipped the check for the same object, so momentum filled from 0 to 0.9 in place stepped
    plain SGD without a momentum buffer, where a fresh plan (and the pure step) refuses it. The CPU only: a CUDA
    tensor's value is not read (a synchronisation), so its state keeps the momentum buffer from the start."""
    device = "cpu"
    p = torch.randn(300, device=device)
    momentum = torch.tensor(0.0, device=device)
    h = bnbf.RULES["sgd"].hparams(lr=0.1, momentum=momentum)
    state = bnbf.init_state(p, bnbf.OptimSpec(rule="sgd", state_bits=32), h)
    g = torch.randn(300, device=device)
    plan = bnbf.plan(p, state) if how == "plan" else None
    step = (lambda t: plan.step(g, h, t)) if plan is not None else (lambda t: bnbf.update_(p, g, state, h, t))
    step(1)
    momentum.fill_(0.9)
    before = p.clone()
    with pytest.raises(ValueError, match=r"need \['momentum_buffer'\]"):
        step(2)
    assert torch.equal(p, before)

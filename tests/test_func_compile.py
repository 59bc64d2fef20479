"""``torch.compile(fullgraph=True)`` of a whole training step through ``bnbf.update`` and ``bnbf.update_``.

A graph break fails the test (fullgraph=True raises on one, and Dynamo's break counter must stay empty); the
graphs are counted with a CompileCounter backend: hyperparameters and the step as 0-d tensors that change
every call compile once; as Python numbers they compile once with ``dynamic=True``, and with Dynamo's default
(automatic dynamic: a number is a constant at the first compile, an input from the first change on) at most
twice, never again after the second call. Results equal the eager step bit for bit (the CompileCounter
backend runs the traced graph as it is, aot_eager functionalizes the in-place op). Runs on the reference path
and under ``TRITON_INTERPRET=1`` (the custom ops then launch the Triton kernels in the interpreter).
"""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch
from conftest import DEVICES, triton_mode
from torch._dynamo.testing import CompileCounter
from torch.func import grad_and_value
from torch.utils._pytree import tree_leaves, tree_map

import bnbf
import bnbf.kernels.launcher as launcher
import bnbf.kernels.members as members


def _loss(p, x):
    return ((x @ p["w"] + p["b"]) ** 2).mean()


def _pure_step(params, state, x, lr, t):
    g, loss = grad_and_value(_loss)(params, x)
    params, state = bnbf.update(params, g, state, {"lr": lr, "weight_decay": 0.01}, t)
    return params, state, loss


def _in_place_step(params, state, x, lr, t):
    g, loss = grad_and_value(_loss)(params, x)
    bnbf.update_(params, g, state, {"lr": lr, "weight_decay": 0.01}, t)
    return params, state, loss


STEPS = {"update": _pure_step, "update_": _in_place_step}


def _run(fn, bits: int, numbers: str, calls: int = 4, device: str = "cpu"):
    torch.manual_seed(0)
    params = {"w": torch.randn(37, 9, device=device), "b": torch.randn(9, device=device)}  # 333, 9: partial blocks
    x = torch.randn(5, 37, device=device)
    state = bnbf.init_state(params, bnbf.OptimSpec(rule="adamw", state_bits=bits, min_8bit_size=0))
    for t in range(1, calls + 1):
        lr, step = 1e-2 / t, t
        if numbers == "tensors":
            lr, step = torch.tensor(lr, device=device), torch.tensor(step, device=device)
        params, state, _ = fn(params, state, x, lr, step)
    return params, state


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(tree_leaves(a), tree_leaves(b), strict=True))


@pytest.fixture(autouse=True)
def _fresh_dynamo(fresh_dynamo):
    yield


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(STEPS))
def test_tensor_hparams_compile_once(kind, device):
    cnt = CompileCounter()
    compiled = torch.compile(STEPS[kind], fullgraph=True, backend=cnt)
    got = _run(compiled, 8, "tensors", device=device)
    assert cnt.frame_count == 1
    assert _equal(got, _run(STEPS[kind], 8, "tensors", device=device))


def _inductor_cuda_code(update) -> str:
    """Inductor's generated code for ``update`` (``bnbf.update`` or ``bnbf.update_``) of a small CUDA tree, lr and
    step as 0-d tensors."""
    from torch._inductor.utils import run_and_get_code

    params = {"w": torch.randn(37, 9, device="cuda"), "b": torch.randn(9, device="cuda")}
    state = bnbf.init_state(params, bnbf.OptimSpec(rule="adamw", min_8bit_size=0))
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    step = torch.compile(lambda p, g, s, lr, t: update(p, g, s, {"lr": lr}, t), fullgraph=True)
    lr, t = torch.tensor(0.1, device="cuda"), torch.tensor(1, device="cuda")
    _, codes = run_and_get_code(step, params, grads, state, lr, t)
    return "\n".join(codes)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="inductor's CUDA graph of the step")
@pytest.mark.parametrize("kind", list(STEPS))
def test_inductor_on_cuda_matches_eager(kind):
    """Inductor compiles the loss and its grads (its own kernels round otherwise than eager torch); the step is
    the opaque op, so the params match the eager loop closely, and one graph serves every call."""
    cnt = torch._dynamo.utils.counters
    compiled = torch.compile(STEPS[kind], fullgraph=True)
    got = _run(compiled, 32, "tensors", device="cuda")
    assert cnt["stats"]["unique_graphs"] == 1
    torch.testing.assert_close(got[0], _run(STEPS[kind], 32, "tensors", device="cuda")[0], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dynamic", [None, True], ids=["default", "dynamic"])
def test_python_numbers(dynamic):
    """With ``dynamic=True`` one compile. Dynamo's default (automatic dynamic) takes the numbers as constants
    at the first compile and as inputs from the first change on: two compiles, then none, whatever the values
    (bnbf reads none of them while tracing)."""
    cnt = CompileCounter()
    compiled = torch.compile(_in_place_step if dynamic else _pure_step, fullgraph=True, backend=cnt, dynamic=dynamic)
    got = _run(compiled, 32, "numbers", calls=5)
    assert cnt.frame_count == (1 if dynamic else 2)
    assert _equal(got, _run(_in_place_step if dynamic else _pure_step, 32, "numbers", calls=5))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(STEPS))
def test_python_numbers_under_inductor(kind, device):
    """Inductor (the default backend) with the numbers as Python values changing every call: two compiles at
    most and none after the second call, as above. Inductor keeps a float input a graph input only where every
    use of it is a tensor op ("tensorify"); a float given to a tensor factory (``scalar_tensor``, ``full``)
    becomes a constant instead, a compile per learning rate, which the backend-less counter above cannot see."""
    if triton_mode() and kind == "update":
        pytest.skip("interpreter pass: update_ (both share the traced scalar row)")
    graphs = []
    compiled = torch.compile(STEPS[kind], fullgraph=True)
    for calls in range(1, 6):
        torch.manual_seed(0)
        got = _run(compiled, 8, "numbers", calls=calls, device=device)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[-1] <= 2 and graphs[-1] == graphs[1], f"graphs after runs of 1 to 5 calls: {graphs}"
    # the params only: Inductor compiles the loss and its grads too, whose kernels round otherwise than eager
    # torch (so a state's code may land one apart), as in test_inductor_on_cuda_matches_eager
    want = _run(STEPS[kind], 8, "numbers", calls=5, device=device)
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-6)


def _given_grads(params, grads, state, lr, t):  # the step alone: Inductor compiles no loss or grads of its own
    bnbf.update_(params, grads, state, {"lr": lr, "weight_decay": 0.01}, t)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("packed", [False, True], ids=["per_param", "packed"])
@pytest.mark.parametrize("rule", ["adamw", "lion", "lamb"])
def test_compiled_numbers_reach_the_kernel_as_numbers(rule, packed, device, monkeypatch):
    """Python numbers changing every call, under Inductor: the traced scalars reach the op as a float64 row on the
    host, which it passes on as the Python floats an eager call passes (kernel arguments: the step kernel an eager
    step with numbers runs, not the one reading a row on the device), and the step equals the eager one bit for
    bit (LAMB: its norm pass too)."""
    from bnbf import ops

    seen = []  # what each launch (launcher) and reference step (ops) took, outside tracing
    real = ops.host_numbers

    def spy(hp, d):
        out = real(hp, d)
        if not torch.compiler.is_compiling():
            seen.append(out)
        return out

    monkeypatch.setattr(launcher, "host_numbers", spy)
    monkeypatch.setattr(ops, "host_numbers", spy)

    def run(fn):
        torch.manual_seed(0)
        params = {"w": torch.randn(37, 9, device=device), "b": torch.randn(9, device=device)}
        grads = [tree_map(torch.randn_like, params) for _ in range(3)]
        state = bnbf.init_state(params, bnbf.OptimSpec(rule=rule, min_8bit_size=0), packed=packed)
        for t in range(1, 4):  # numbers as constants, then as graph inputs (Dynamo's recompile), then reused
            fn(params, grads[t - 1], state, 3e-2 / t**0.7, t)
        return params, state

    got = run(torch.compile(_given_grads, fullgraph=True))
    assert seen and all(type(hp) is tuple for hp in seen)
    assert _equal(got, run(_given_grads))


_EXTRA = {"sgd": {"momentum": 0.9}, "lars": {"momentum": 0.9}, "ademamix": {"t_alpha": 10, "t_beta3": 10}}


@pytest.mark.parametrize("rule", sorted(bnbf.rules.RULES))
def test_every_rule_compiles_with_a_python_number_step_that_changes(rule):
    """Every rule's scalars traced from a Python-number step that changes every call (a symbolic int from
    Dynamo's first recompile on): no graph break, two compiles at most and none after the second call, and the
    eager steps bit for bit. A scalar that compares the step (SGD's and Adan's first-step flags) would put a
    guard on its value, or break the graph."""
    hp = {"lr": 1e-2, "weight_decay": 0.01, **_EXTRA.get(rule, {})}

    _compiles_twice_at_most(rule, hp, lambda t: ({**hp, "lr": hp["lr"] / t}, t), calls=4)


def _compiles_twice_at_most(rule: str, hp: dict, call, calls: int) -> None:
    """``update_`` of ``rule`` compiled (fullgraph) and called ``calls`` times with ``call(t) -> (hparams, step)``:
    two compiles at most, none after the second call, and the eager steps bit for bit."""

    def run(fn):
        torch.manual_seed(0)
        params = {"w": torch.randn(37, 9), "b": torch.randn(9)}
        state = bnbf.init_state(params, bnbf.OptimSpec(rule=rule, min_8bit_size=0), hp)
        for t in range(1, calls + 1):
            fn(params, tree_map(torch.randn_like, params), state, *call(t))
        return params, state

    def step(params, grads, state, h, t):
        bnbf.update_(params, grads, state, h, t)

    cnt = CompileCounter()
    graphs = []
    compiled = torch.compile(step, fullgraph=True, backend=cnt)

    def counted(*args):
        compiled(*args)
        graphs.append(cnt.frame_count)

    got = run(counted)
    assert graphs[-1] <= 2 and graphs[-1] == graphs[1], f"{rule}: graphs after each call {graphs}"
    assert _equal(got, run(step)), f"{rule}: the compiled steps differ from the eager ones"


def _moved(v, t: int):
    """Hyperparameter value ``v`` (a float, or a tuple of them) moved a little at call ``t``; ints, bools, None and
    zeros (the switches, AdEMAMix's warm-up lengths) as they are."""
    if type(v) is tuple:
        return tuple(_moved(x, t) for x in v)
    return v * (1 - 1e-3 * t) if type(v) is float and v != 0 else v


@pytest.mark.surface  # the rules' scalars are traced the same on both paths; the interpreter pass has the lr test
@pytest.mark.parametrize("step_kind", ["number", "tensor"])
@pytest.mark.parametrize("rule", sorted(bnbf.rules.RULES))
def test_every_float_hyperparameter_may_change_every_call(rule, step_kind):
    """Every float hyperparameter of every rule (betas, eps, alpha... not only lr) a Python number that changes every
    call, the step a Python number or a 0-d tensor: two compiles at most, none after the second call, and the eager
    steps bit for bit. AdEMAMix's β3 warm-up took math.log of β1 and β3 and torch.as_tensor of β3, which made them
    constants: a compile at every call, until Dynamo's limit failed the fullgraph call."""
    import dataclasses

    h = bnbf.hparams_for(rule, {"weight_decay": 0.01, **_EXTRA.get(rule, {})})
    hp = {f.name: getattr(h, f.name) for f in dataclasses.fields(h)}

    def call(t):
        return {k: _moved(v, t) for k, v in hp.items()}, (t if step_kind == "number" else torch.tensor(t))

    _compiles_twice_at_most(rule, hp, call, calls=5)


@pytest.mark.parametrize(
    "schedule",
    [
        lambda s: 1e-2 * 0.5 * (1 + math.cos(math.pi * s / 20)),  # Dynamo failed its own guard at the second call
        lambda s: 1e-3 / s,  # compiled again at every call
        lambda s: min(1, s / 10) * 1e-3,
    ],
    ids=["cosine", "inverse", "warmup"],
)
def test_a_schedule_of_a_python_number_step_compiles_twice_at_most(schedule):
    """A schedule (a callable hyperparameter) of a Python-number step returns a symbolic float from Dynamo's first
    recompile on. Grouping the leaves by their hyperparameters read its exact value (``float.hex``): a guard on it,
    so a compile at every call, or (the cosine) Dynamo's assertion that a guard failed on the frame that made it.
    Traced floats are now keyed by identity: two compiles at most, the eager steps bit for bit."""

    def run(fn):
        torch.manual_seed(0)
        params = {"w": torch.randn(37, 9), "b": torch.randn(9)}
        state = bnbf.init_state(params, bnbf.OptimSpec(rule="adamw", min_8bit_size=0))
        for t in range(1, 6):
            params, state = fn(params, tree_map(torch.randn_like, params), state, t)
        return params, state

    def step(params, grads, state, t):
        return bnbf.update(params, grads, state, {"lr": schedule, "weight_decay": 0.0}, t)

    cnt = CompileCounter()
    got = run(torch.compile(step, fullgraph=True, backend=cnt))
    assert cnt.frame_count <= 2, f"{cnt.frame_count} compiles in 5 calls"
    assert _equal(got, run(step))


@pytest.mark.parametrize("device", DEVICES)
def test_a_compiled_step_launches_its_two_groups_as_one(device, monkeypatch):
    """With Python numbers, the traced in-place step's two groups (8-bit states, and the 32-bit states of a tensor
    under min_8bit_size) reach the kernels through one op call and one launch of the pair kernel, as the eager
    step's plan launches them, and the steps equal the eager ones bit for bit. The reference path steps them in
    turn."""
    launches = []
    real = launcher.launch_pair
    monkeypatch.setattr(launcher, "launch_pair", lambda *a, **k: launches.append(1) or real(*a, **k))

    def run(fn):
        torch.manual_seed(0)
        # the smaller group's tiles within launcher.PAIR_SHARE of the larger's
        params = {"w": torch.randn(64, 130, device=device), "b": torch.randn(130, device=device)}
        grads = [tree_map(torch.randn_like, params) for _ in range(3)]
        state = bnbf.init_state(params, bnbf.OptimSpec(rule="adamw"))
        assert {s.layout.bits for s in state.values()} == {8, 32}
        for t in range(1, 4):
            fn(params, grads[t - 1], state, 3e-2 / t, t)
        return params, state

    got = run(torch.compile(_given_grads, fullgraph=True))
    assert len(launches) == (3 if triton_mode() or device == "cuda" else 0)
    assert _equal(got, run(_given_grads))


def test_aot_eager_functionalizes_the_in_place_step():
    compiled = torch.compile(_in_place_step, fullgraph=True, backend="aot_eager")
    assert _equal(_run(compiled, 8, "tensors", calls=2), _run(_in_place_step, 8, "tensors", calls=2))


def test_a_traced_step_still_refuses_bad_input():
    """The trace raises where eager raises (fullgraph=True reports it as Dynamo's "Observed exception" with
    the message; without fullgraph the frame falls back to eager, which raises the error itself)."""
    params = {"w": torch.randn(4, 3)}
    state = bnbf.init_state(params, bnbf.OptimSpec(rule="adamw", state_bits=32))
    bad_hparams = lambda p, g, s: bnbf.update(p, g, s, {"lr": 0.1, "bogus": 1.0}, 1)
    with pytest.raises(Exception, match="unknown hyperparameters for rule 'adamw'"):
        torch.compile(bad_hparams, fullgraph=True)(params, {"w": torch.randn(4, 3)}, state)
    with pytest.raises(Exception, match="has shape"):
        torch.compile(lambda p, g, s: bnbf.update(p, g, s, {"lr": 0.1}, 1), fullgraph=True)(
            params, {"w": torch.randn(3, 4)}, state
        )


def test_plan_step_compiles_without_a_break():
    """A plan's step traced by torch.compile takes the generic path (bnbf_nn's compiled step goes through it)."""
    torch.manual_seed(0)
    params = {"w": torch.randn(37, 9), "b": torch.randn(9)}
    state = bnbf.init_state(params, bnbf.OptimSpec(rule="adamw", min_8bit_size=0))
    twin_p, twin_s = tree_map(torch.clone, (params, state))
    grads = [{k: torch.randn_like(v) for k, v in params.items()} for _ in range(3)]
    opt, twin = bnbf.plan(params, state), bnbf.plan(twin_p, twin_s)
    cnt = CompileCounter()
    step = torch.compile(lambda g, lr, t: opt.step(g, {"lr": lr}, t), fullgraph=True, backend=cnt)
    for t in (1, 2, 3):
        step(grads[t - 1], torch.tensor(1e-2 / t), torch.tensor(t))
        twin.step(grads[t - 1], {"lr": torch.tensor(1e-2 / t)}, torch.tensor(t))
    assert cnt.frame_count == 1
    assert _equal((params, state), (twin_p, twin_s))


def test_fake_tensors_never_reach_a_kernel():
    """Under FakeTensorMode (what tracers use) the step takes the op's fake implementation: outputs of the
    right types, shapes and dtypes, no kernel launched and no address read."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    params = {"w": torch.randn(300), "b": torch.randn(7)}
    state = bnbf.init_state(params, bnbf.OptimSpec(rule="adamw", min_8bit_size=0))
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    with FakeTensorMode() as mode:
        fp, fg, fs = tree_map(mode.from_tensor, (params, grads, state))
        new_p, new_s = bnbf.update(fp, fg, fs, {"lr": 0.1}, 1)
        bnbf.update_(fp, fg, fs, {"lr": torch.tensor(0.1)}, 2)
    assert all(isinstance(t, FakeTensor) for t in tree_leaves((new_p, new_s)))
    assert [(t.shape, t.dtype) for t in tree_leaves(new_s)] == [(t.shape, t.dtype) for t in tree_leaves(state)]


# the rules' reference math with a tensor step (SGD's first-step buffer, Nesterov) and the norm passes (LAMB, LARS,
# max_unorm), each of which once broke the graph
_DIFF_CASES = {
    "adamw": ("adamw", {}, {}),
    "sgd-momentum": ("sgd", {"momentum": 0.9, "dampening": 0.1}, {}),
    "sgd-nesterov": ("sgd", {"momentum": 0.9, "nesterov": True}, {}),
    "lars-momentum": ("lars", {"momentum": 0.9}, {}),
    "lamb": ("lamb", {}, {}),
    "adamw-max_unorm": ("adamw", {}, {"max_unorm": 0.01}),
}


@pytest.mark.parametrize("case", list(_DIFF_CASES))
def test_a_compiled_meta_gradient_through_differentiable_steps(case):
    """torch.func.grad of a loss after two ``update(..., differentiable=True)`` steps, compiled whole: one graph
    for every lr and step (the first step's included), equal to the eager meta-gradient."""
    rule, hp, kw = _DIFF_CASES[case]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4, generator=gen)
    y = x @ torch.randn(4, generator=gen)
    p0 = torch.randn(4, generator=gen)
    s0 = bnbf.init_state(p0, bnbf.OptimSpec(rule=rule, state_bits=32), hp)
    loss = lambda p: ((x @ p - y) ** 2).mean()

    def meta(lr, t):
        p, s = p0, s0
        for k in range(2):
            p, s = bnbf.update(p, torch.func.grad(loss)(p), s, {**hp, "lr": lr}, t + k, differentiable=True, **kw)
        return loss(p)

    cnt = CompileCounter()
    compiled = torch.compile(torch.func.grad(meta), fullgraph=True, backend=cnt)
    for t in (1, 3):
        lr = torch.tensor(0.05 / t)
        got, want = compiled(lr, torch.tensor(t)), torch.func.grad(meta)(lr, torch.tensor(t))
        assert want != 0
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert cnt.frame_count == 1


def test_the_in_place_op_bumps_the_versions_of_what_it_writes():
    """The in-place op's version bump (its own ADInplaceOrView kernel, a list at a time): autograd's check of
    tensors saved for backward and modified in place sees the params and states written, never the grads."""
    params = {"w": torch.randn(37, 9), "b": torch.randn(9)}
    state = bnbf.init_state(params, bnbf.OptimSpec(rule="adamw", min_8bit_size=0))
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    written, read = [*params.values(), *tree_leaves(state)], list(grads.values())
    before, before_read = [t._version for t in written], [t._version for t in read]
    step = torch.compile(lambda p, g, s, lr: bnbf.update_(p, g, s, {"lr": lr}, 1), fullgraph=True, backend="eager")
    step(params, grads, state, torch.tensor(0.1))
    assert all(t._version > v for t, v in zip(written, before))
    assert [t._version for t in read] == before_read
    w = torch.randn(9, requires_grad=True)
    y = (w * params["b"]).sum()  # saves params["b"] for backward
    step(params, grads, state, torch.tensor(0.1))  # the same graph
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_state_fields_are_static_inputs_of_a_compiled_step():
    """Every state field is torch.compile's static input (what Dynamo makes of an nn.Parameter): Inductor then
    skips its per-call alignment check and CUDA-graph trees its copy. Dynamo must read bnbf's mark (set without
    importing Dynamo) as its own ``mark_static_address``; the params stay ordinary inputs."""
    from torch._dynamo.utils import get_static_address_type

    params = {"w": torch.randn(64, 80), "b": torch.randn(9)}
    state = bnbf.init_state(params, bnbf.OptimSpec(rule="adamw", min_8bit_size=100))
    assert {type(s).layout.bits for s in state.values()} == {8, 32}
    fields = tree_leaves(state)
    assert {get_static_address_type(t) for t in fields} == {"unguarded"}
    seen = []

    def backend(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                seen.append(node.meta.get("tensor_dict", {}).get("_dynamo_static_input_type"))
        return gm.forward

    @torch.compile(backend=backend, fullgraph=True)
    def touch(params, state):
        return [t.sum() for t in tree_leaves(params)] + [t.float().sum() for t in tree_leaves(state)]

    touch(params, state)
    assert seen == [None] * len(params) + ["unguarded"] * len(fields)


def test_the_ops_take_bnbfs_own_kernels_not_torch_librarys(monkeypatch):
    """The ops' Autograd kernels (and the in-place op's version bump) are bnbf's own, registered over
    torch.library's, which bump each written tensor's version in a Python call of its own and convert the
    ~700-tensor lists three times (torch 2.11 refuses the override unless asked with ``allow_override``): a
    compiled in-place step and a pure step make no per-tensor ``increment_version`` call."""
    calls = []
    real = torch.autograd.graph.increment_version
    monkeypatch.setattr(torch.autograd.graph, "increment_version", lambda t: (calls.append(1), real(t))[1])
    params = {"w": torch.randn(37, 9), "b": torch.randn(9)}
    state = bnbf.init_state(params, bnbf.OptimSpec(rule="adamw", min_8bit_size=0))
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    written = [*params.values(), *tree_leaves(state)]
    before = [t._version for t in written]
    step = torch.compile(lambda p, g, s, lr: bnbf.update_(p, g, s, {"lr": lr}, 1), fullgraph=True, backend="eager")
    step(params, grads, state, torch.tensor(0.1))
    bnbf.update(params, grads, state, {"lr": 0.1}, 2)
    assert all(t._version > v for t, v in zip(written, before))  # bumped, a list at a time
    assert calls == []


@pytest.mark.skipif(not triton_mode() and not torch.cuda.is_available(), reason="the Triton path's tables")
def test_traced_steps_reuse_their_group_and_hold_no_tensor(monkeypatch):
    """A traced in-place step calls the op afresh every time: its group (address table, task list, compiled
    launchers) comes from a cache keyed by the table's contents, built once, holding none of the tensors."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    params = {"w": torch.randn(37, 9, device=device), "b": torch.randn(9, device=device)}
    state = bnbf.init_state(params, bnbf.OptimSpec(rule="adamw", min_8bit_size=0))
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    numbers = [(torch.tensor(0.1 / t, device=device), torch.tensor(t, device=device)) for t in (1, 2)]
    twin_p, twin_s = tree_map(torch.clone, (params, state))
    for lr, t in numbers:  # the eager steps (a plan), before the builds are counted
        bnbf.update_(twin_p, grads, twin_s, {"lr": lr}, t)
    built = []
    make = members._group_of  # a group's table made from its tensors' structure (bnbf.ops._group's builds)
    monkeypatch.setattr(members, "_group_of", lambda *a: (built.append(a[0].group.table.shape[0]), make(*a))[1])
    bnbf.ops._GROUPS.clear()
    step = torch.compile(
        lambda p, g, s, lr, t: bnbf.update_(p, g, s, {"lr": lr}, t), fullgraph=True, backend=CompileCounter()
    )
    for lr, t in numbers:
        step(params, grads, state, lr, t)
    assert built == [2]  # one group of two tensors, built at the first call
    assert _equal((params, state), (twin_p, twin_s))
    alive = weakref.ref(params["w"])
    del params, state, step
    gc.collect()
    assert alive() is None and len(bnbf.ops._GROUPS) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="inductor's CUDA code of the step")
def test_inductor_runs_the_in_place_op_in_place():
    """Inductor re-inplaces the functionalized in-place op: its code calls ``bnbf.step_`` on the inputs
    themselves, with no copy of the params and states (a clone and a copy back per tensor would cost two
    launches each and the bandwidth of the whole state)."""
    code = _inductor_cuda_code(bnbf.update_)
    assert "torch.ops.bnbf.step_.default(" in code
    assert "auto_functionalized" not in code and "clone" not in code and "copy_(" not in code


@pytest.mark.surface
def test_traced_scalar_row_is_one_kernel():
    """The traced step's scalar row is one Inductor kernel (a stack of more than 8 scalars lowers to a kernel per
    scalar: 13 launches a step for AdamW on a GPU), with the values of the eager row (numbers rounded from
    float64 once, tensors cast)."""
    from torch._inductor import metrics

    def values(lr, t):
        return (lr / (1 - 0.9**t), 0.9, 0.999, 1e-8, lr * 0.01, 1 / 3, 1.0 - 0.999**t, 2.0, t % 7, -1.0, 0.0, lr, 1e-3)

    row = torch.compile(lambda lr, t: bnbf.ops.traced_scalar_row(values(lr, t), lr.device), fullgraph=True)
    lr, t = torch.tensor(3e-3), torch.tensor(5)
    metrics.reset()
    got = row(lr, t)
    assert metrics.generated_kernel_count == 1
    want = torch.stack(
        [
            v.to(torch.float32) if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=torch.float64).float()
            for v in values(lr, t)
        ]
    )
    assert torch.equal(got, want), (got, want)


def test_a_compiled_pure_step_is_one_inductor_kernel_and_the_op():
    """Inductor's code for a compiled ``bnbf.update`` holds one kernel (the scalar row) beside the step's op, and
    the step equals the eager one up to the rounding of the scalars Inductor computes."""
    from torch._inductor import metrics

    params = {"w": torch.randn(37, 9), "b": torch.randn(9)}
    state = bnbf.init_state(params, bnbf.OptimSpec(rule="adamw", min_8bit_size=0))
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    step = torch.compile(
        lambda p, g, s, lr, t: bnbf.update(p, g, s, {"lr": lr, "weight_decay": 0.01}, t), fullgraph=True
    )
    lr, t = torch.tensor(0.05), torch.tensor(3)
    metrics.reset()
    got = step(params, grads, state, lr, t)
    assert metrics.generated_kernel_count == 1
    want = bnbf.update(params, grads, state, {"lr": lr, "weight_decay": 0.01}, t)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="inductor's CUDA code of the step")
def test_inductor_launches_one_kernel_beside_the_pure_step():
    """On CUDA, Inductor's code for a compiled ``bnbf.update`` defines one Triton kernel (the scalar row), not one
    per scalar (each a launch and its host time every step)."""
    code = _inductor_cuda_code(bnbf.update)
    assert code.count("async_compile.triton(") == 1, code
    assert "torch.ops.bnbf.step.default(" in code


def test_the_ops_direct_route_keeps_torch_librarys_other_routes():
    """The ops' Autograd kernels step plain tensors directly; a dispatch mode, a fake tensor or a derivative
    asked for still takes torch.library's route: the mode sees the op, and a backward through the pure op
    raises (never a silent zero gradient)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    layout = ("adamw", 32, 256, "fp32", 3)
    values, clip = bnbf.functional._scalars(bnbf.RULES["adamw"], bnbf.hparams_for("adamw", lr=0.1), 1, False, 0, False)
    row = bnbf.rules.base.as_scalar_row(values, torch.device("cpu"))
    p, g = torch.randn(37), torch.randn(37)
    s = [torch.zeros(37), torch.zeros(37)]
    want_p, want_s = torch.ops.bnbf.step.default([p], [g], s, row, *layout, False, clip)

    class Seen(TorchDispatchMode):
        ops: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Seen() as mode:
        got_p, got_s = torch.ops.bnbf.step.default([p], [g], s, row, *layout, False, clip)
    assert "bnbf.step.default" in mode.ops
    assert torch.equal(got_p[0], want_p[0]) and all(map(torch.equal, got_s, want_s))
    wp = p.clone().requires_grad_()
    out_p, _ = torch.ops.bnbf.step.default([wp], [g], s, row, *layout, False, clip)
    assert out_p[0].requires_grad
    with pytest.raises(RuntimeError, match="no autograd formula"):
        out_p[0].sum().backward()


@pytest.mark.skipif(not triton_mode() and not torch.cuda.is_available(), reason="the Triton path's tables")
@pytest.mark.parametrize("rule", ["adamw", "lamb"])
@pytest.mark.parametrize("bits", [8, 32])
@pytest.mark.parametrize("in_place", [False, True], ids=["pure", "in_place"])
def test_a_group_made_from_the_structure_is_the_launchers(rule, bits, in_place):
    """A call no plan serves makes a missed group from its tensors' structure (bnbf.kernels.members.plain_group):
    every field the launch reads (table, tasks, ranges, alignment, norms...) is what the launcher's own
    build_group makes of the same tensors: odd sizes, one param not 16-byte aligned, pure and in place."""
    import dataclasses

    from bnbf.kernels.members import plain_group

    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = bnbf.OptimSpec(rule=rule, state_bits=bits, min_8bit_size=0)
    buf = torch.randn(4200, device=device)
    for offset in (0, 1):  # aligned, then the last param a view 4 bytes into its buffer
        params = [torch.randn(n, device=device) for n in (1, 255, 257, 4097)] + [buf[offset : offset + 300]]
        states = [bnbf.init_state(p, spec) for p in params]
        s_in = [t for s in states for t in s]
        layout = type(states[0]).layout
        p_out = params if in_place else [torch.empty_like(p) for p in params]
        s_out = s_in if in_place else [torch.empty_like(t) for t in s_in]
        want = launcher.build_group(params, p_out, s_in, s_out, layout)
        got = plain_group(params, p_out, s_in, s_out, layout)
        assert got.aligned == (offset == 0)
        for f in dataclasses.fields(launcher.Group):
            a, b = getattr(got, f.name), getattr(want, f.name)
            if f.name == "compiled":  # the direct launchers, shared by a structure's groups
                continue
            same = torch.equal(a, b) if isinstance(b, torch.Tensor) else a == b
            assert same, f"{f.name}: {a} from the structure, {b} from build_group"


@pytest.mark.skipif(not triton_mode() and not torch.cuda.is_available(), reason="the Triton path's tables")
def test_pure_steps_of_many_groups_keep_their_structures():
    """The structures a missed group is made from outlast bnbf.ops' group cache: pure steps of 12 trees in turn (a
    launch group each, more than the member caches' 8 entries) make each structure once, and later calls with new
    addresses make groups from the kept structures (no build of the launcher's on stand-ins)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=0)
    trees = [{"w": torch.randn(100 + 7 * i, device=device)} for i in range(12)]
    states = [bnbf.init_state(p, spec) for p in trees]
    grads = [{"w": torch.randn_like(p["w"])} for p in trees]
    made = members.BUILDS["structure"]
    for step in (1, 2, 3):
        for i in range(len(trees)):
            trees[i], states[i] = bnbf.update(trees[i], grads[i], states[i], {"lr": 0.01}, step)
        if step == 1:
            assert members.BUILDS["structure"] - made <= len(trees)
            made = members.BUILDS["structure"]
    assert members.BUILDS["structure"] == made, "a structure was made again"


@pytest.mark.skipif(not triton_mode() and not torch.cuda.is_available(), reason="the Triton path's tables")
def test_a_group_is_reused_only_for_the_same_addresses_and_sizes():
    """The group cache of calls no plan serves answers by addresses compared in C++ and the params' sizes: the
    same memory with another size (a view of fewer elements) or other outputs builds another table."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    layout = bnbf.state.Layout("adamw", 32, 256, "fp32", 3)
    buf, states = torch.zeros(600, device=device), [torch.zeros(600, device=device) for _ in range(2)]

    def group(n, p_out=None, s_out=None):
        ps, ss = [buf[:n]], [s[:n] for s in states]
        return bnbf.ops._group(ps, p_out or ps, ss, s_out or ss, layout)

    bnbf.ops._GROUPS.clear()
    first = group(300)
    assert group(300) is first
    smaller = group(200)  # the same addresses, fewer elements
    assert smaller is not first and smaller.table.tolist() != first.table.tolist()
    pure = group(300, [torch.empty(300, device=device)], [torch.empty(300, device=device) for _ in states])
    assert pure is not first and len(bnbf.ops._GROUPS) == 3
    assert group(300) is first


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("in_place", [False, True], ids=["update", "update_"])
def test_a_tensor_max_grad_norm_compiles_once(device, in_place):
    """``max_grad_norm`` as a 0-d tensor that changes every call (the traced checks called functions Dynamo cannot
    trace: no compile at all): one graph, each call equal to bnbf.clip_grad_norm then the unclipped step; a
    ``max_grad_norm`` that requires grad is still refused by name."""
    torch.manual_seed(0)
    p = {"w": torch.randn(37, 9, device=device), "b": torch.randn(9, device=device)}
    g = {k: torch.randn_like(v) * 3 for k, v in p.items()}
    s = bnbf.init_state(p, bnbf.OptimSpec(rule="adamw", min_8bit_size=0))

    def step(p, g, s, m):
        if in_place:
            bnbf.update_(p, g, s, {"lr": 0.01}, 1, max_grad_norm=m)
            return p, s
        return bnbf.update(p, g, s, {"lr": 0.01}, 1, max_grad_norm=m)

    counter = CompileCounter()
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    for m in (1.0, 0.5, 2.0):
        got = compiled(*tree_map(torch.clone, (p, g, s)), torch.tensor(m, device=device))
        want = step(*tree_map(torch.clone, (p, bnbf.clip_grad_norm(g, m)[0], s)), None)
        assert _equal(got, want), m
    assert counter.frame_count == 1
    with pytest.raises(Exception, match="max_grad_norm takes part in a gradient computation"):
        compiled(*tree_map(torch.clone, (p, g, s)), torch.tensor(1.0, device=device, requires_grad=True))


def test_a_compiled_meta_gradient_through_a_tensor_max_grad_norm():
    """``differentiable=True`` with a 0-d tensor ``max_grad_norm``, compiled: the derivatives equal eager ones."""
    p, g = torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64) * 3
    s = bnbf.init_state(p, bnbf.OptimSpec(rule="adamw", state_bits=32))
    s = type(s)._make(f.double() for f in s)
    step = lambda lr, m: bnbf.update(p, g, s, {"lr": lr}, 1, differentiable=True, max_grad_norm=m)[0].sum()  # noqa: E731
    fn = torch.func.grad(step, argnums=(0, 1))
    lr, m = torch.tensor(0.1, dtype=torch.float64), torch.tensor(0.5, dtype=torch.float64)
    got, want = torch.compile(fn, backend="eager", fullgraph=True)(lr, m), fn(lr, m)
    assert all(torch.allclose(a, b, rtol=1e-12, atol=0) for a, b in zip(got, want)) and float(want[1]) != 0.0

"""bnbf_nn's optimizers with torch.optim's ``differentiable=True`` and ``capturable=True``, and under
``torch.compile(opt.step)``.

- differentiable: the optimizer's steps are recorded by autograd; gradients through two steps with respect
  to the initial params, the grads and lr are checked against finite differences in float64 (gradcheck), and
  the values against torch.optim's differentiable steps; 8-bit state raises naming 32-bit state.
- capturable: step counts are 0-d int64 tensors on the params' device, a tensor lr (which torch's schedulers
  ``fill_``) is read on the device; the result equals the same run with Python steps (bias correction in
  float32 on the device, so to float32 rounding), and checkpoints keep the tensor step on the device. On CUDA
  a captured ``opt.step()`` replayed with a scheduler changing lr between replays equals the eager steps bit
  for bit, and without capturable=True capturing raises.
- torch.compile: ``torch.compile(opt.step)`` of every family in a loop with an LR scheduler compiles no more
  graphs than torch.optim.AdamW in the same loop (Dynamo's CompileCounter), never again after the calls that
  torch's compile too, and equals the eager steps bit for bit (the counting backend runs the traced graph as
  it is). A group whose settings are all numbers compiles no graph (its eager fused step runs in the compiled
  call), its step counts ints; with a tensor lr or capturable=True the step is traced and equals the eager
  capturable steps, its counts tensors on the device; compiled and eager steps interleave.
"""

from __future__ import annotations

import functools
import inspect
import warnings

import pytest
import torch
from conftest import DEVICES, assert_untouched, snapshot, triton_mode
from test_nn_optim import HPARAMS
from torch._dynamo.testing import CompileCounter

import bnbf
import bnbf_nn
from bnbf_nn.optim import Optimizer1State, Optimizer2State, Optimizer8bit

CLASSES = [getattr(bnbf_nn, n) for n in bnbf_nn.optim.__all__ if isinstance(getattr(bnbf_nn, n), type)]
CLASSES = [c for c in CLASSES if issubclass(c, Optimizer8bit) and c not in (Optimizer8bit,)]
FAMILIES = [f.name for f in bnbf_nn.FAMILIES]


def _make(name: str, params, bits: int = 8, **kw):
    cls = getattr(bnbf_nn, f"{name}{bits}bit")
    return cls(params, **{**HPARAMS[name], **kw}, min_8bit_size=0)


# ---- the arguments ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_class_takes_capturable_and_differentiable(cls):
    if cls in (Optimizer1State, Optimizer2State):
        params = inspect.signature(cls.__init__).parameters
        make = lambda **kw: cls("lion" if cls is Optimizer1State else "adam", [torch.nn.Parameter(torch.ones(3))], **kw)
    else:
        params = inspect.signature(cls).parameters
        lr = {"lr": 0.1} if params["lr"].default is inspect.Parameter.empty else {}
        make = lambda **kw: cls([torch.nn.Parameter(torch.ones(3))], **lr, **kw)
    for flag in ("capturable", "differentiable"):
        assert params[flag].kind == inspect.Parameter.KEYWORD_ONLY and params[flag].default is False
        opt = make(**{flag: True})
        assert opt.param_groups[0][flag] is True and opt.defaults[flag] is True
        with pytest.raises(TypeError, match=f"{flag} must be a bool"):
            make(**{flag: 1})


def test_fused_with_differentiable_is_refused_in_torchs_words():
    with pytest.raises(RuntimeError, match="`fused` does not support `differentiable`"):
        bnbf_nn.AdamW([torch.nn.Parameter(torch.ones(3))], fused=True, differentiable=True)


# ---- differentiable=True -----------------------------------------------------------------------------------

DIFF_CASES = ["Adam", "AdamW", "SGD", "Lion", "RMSprop", "Adagrad", "Adan", "LAMB", "LARS", "AdEMAMix"]
assert set(DIFF_CASES) == {f.name for f in bnbf_nn.FAMILIES}, "every family is checked"


def _two_steps(name: str, p0, g, lr, **kw):
    p = p0.clone()  # a non-leaf, written in place with its history (torch.optim's differentiable idiom)
    opt = _make(name, [p], bits=32, lr=lr, differentiable=True, **kw)
    for k in range(2):
        p.grad = g * (1.0 + k)
        opt.step()
    return p


@pytest.mark.parametrize("name", DIFF_CASES)
def test_differentiable_steps_have_the_true_gradients(name):
    torch.manual_seed(0)
    p0 = torch.randn(5, dtype=torch.float64, requires_grad=True)
    g = torch.randn(5, dtype=torch.float64, requires_grad=True)
    lr = torch.tensor(HPARAMS[name]["lr"], dtype=torch.float64, requires_grad=True)
    # finite differences in float64 of the whole two-step map: params, grads and lr
    assert torch.autograd.gradcheck(lambda a, b, c: _two_steps(name, a, b, c), (p0, g, lr))


def test_a_differentiable_step_reads_a_tensor_lr_without_warning():
    """The range checks read a CPU tensor lr's value: one that requires grad (a meta-learned lr) gave torch's
    "Converting a tensor with requires_grad=True to a scalar" warning at every step."""
    p = torch.randn(5, requires_grad=True).clone()
    lr = torch.tensor(0.1, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = _make("AdamW", [p], bits=32, lr=lr, differentiable=True)
        p.grad = torch.ones(5)
        opt.step()
        bnbf.update(p.detach(), p.grad, opt.state[p]["state"], {"lr": lr}, 2, differentiable=True)


def test_differentiable_ademamix_keeps_float64_state_in_its_stacked_rows():
    """bnbf_nn's AdEMAMix keeps its two first moments as rows of one tensor (bitsandbytes' layout). Those rows
    were made float32 for a float64 param, so the differentiable step rounded its moments, and gradcheck with
    respect to the grads failed on that rounding: the state is float64 and the params equal the functional
    step's (float64 state throughout) bit for bit."""
    torch.manual_seed(0)
    p0 = torch.randn(5, dtype=torch.float64)
    g = torch.randn(5, dtype=torch.float64)
    p = p0.clone()
    opt = _make("AdEMAMix", [p], bits=32, differentiable=True)
    s = bnbf.init_state(p0.float(), bnbf.OptimSpec(rule="ademamix", state_bits=32))
    s = type(s)._make(t.double() for t in s)
    want = p0.clone()
    names = ("lr", "betas", "alpha", "eps", "weight_decay", "t_alpha", "t_beta3")
    hp = {k: v for k, v in opt.defaults.items() if k in names}
    for k in range(2):
        p.grad = g * (1.0 + k)
        opt.step()
        want, s = bnbf.update(want, g * (1.0 + k), s, hp, k + 1, differentiable=True)
    assert all(t.dtype == torch.float64 for t in opt.state[p]["state"])
    assert torch.equal(p, want)


@pytest.mark.parametrize("name", ["AdamW", "AdEMAMix"])
def test_float64_differentiable_state_dict_round_trip(name):
    """float64 params of a differentiable optimizer keep float64 32-bit state: its own state_dict loads back (it
    was refused as 'expected float32 values'), and the loaded optimizer continues as the saved one does."""
    torch.manual_seed(0)
    leaves = [torch.randn(5, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    params = [p.clone() for p in leaves]  # non-leaves written in place with their history, as torch's idiom
    twin = [p.clone() for p in leaves]
    opt = _make(name, params, bits=32, differentiable=True)
    grads = [[torch.randn(5, dtype=torch.float64) for _ in params] for _ in range(3)]
    for gs in grads[:2]:
        for p, g in zip(params, gs):
            p.grad = g
        opt.step()
    with torch.no_grad():
        for p, q in zip(params, twin):
            q.copy_(p)
    again = _make(name, twin, bits=32, differentiable=True)
    again.load_state_dict(opt.state_dict())
    for o, ps in ((opt, params), (again, twin)):
        for p, g in zip(ps, grads[2]):
            p.grad = g
        o.step()
    for p, q in zip(params, twin):
        assert torch.equal(p.detach(), q.detach())
    assert again.state[twin[0]]["state"].exp_avg.dtype == opt.state[params[0]]["state"].exp_avg.dtype


# torch's differentiable SGD with momentum cannot be differentiated here (its in-place buffer update trips
# autograd's version check): SGD's derivatives are checked by gradcheck above
@pytest.mark.parametrize("torch_cls, name", [(torch.optim.AdamW, "AdamW"), (torch.optim.Adam, "Adam")])
def test_differentiable_steps_equal_torch_optims(torch_cls, name):
    torch.manual_seed(0)
    p0 = torch.randn(7, dtype=torch.float64, requires_grad=True)
    g = torch.randn(7, dtype=torch.float64)
    lr = torch.tensor(0.05, dtype=torch.float64, requires_grad=True)
    hp = dict(betas=(0.8, 0.99), weight_decay=0.1)
    ours = p0.clone()
    opt = getattr(bnbf_nn, f"{name}32bit")([ours], lr=lr, differentiable=True, **hp)
    theirs = p0.clone()
    ref = torch_cls([theirs], lr=lr, differentiable=True, **hp)
    for k in range(3):
        ours.grad, theirs.grad = g * (k + 1), g * (k + 1)
        opt.step()
        ref.step()
    d_ours = torch.autograd.grad(ours.square().sum(), (p0, lr))
    d_ref = torch.autograd.grad(theirs.square().sum(), (p0, lr))
    # torch's differentiable Adam keeps its step as a float32 tensor, so its bias corrections are float32
    # (5.6e-8 from its own float-lr result here); bnbf's are float64: float32 rounding apart, no more
    torch.testing.assert_close(ours, theirs, rtol=2e-6, atol=0)
    for a, b in zip(d_ours, d_ref):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-12)
    exact = p0.detach().clone()  # and equal to torch's float64 steps where torch computes them in float64
    ref = torch_cls([exact], lr=0.05, **hp)
    for k in range(3):
        exact.grad = g * (k + 1)
        ref.step()
    torch.testing.assert_close(ours.detach(), exact, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("capturable", [False, True], ids=["int_step", "tensor_step"])
def test_float64_state_starts_at_float64_initial_values(capturable):
    """A float64 param's state starts at its initial value in float64 (Adagrad's accumulator at 0.3, not float32's
    0.30000001) and steps in float64 with a tensor step too: three steps equal torch's float64 Adagrad."""
    torch.manual_seed(0)
    p0 = torch.randn(7, dtype=torch.float64, requires_grad=True)
    g = torch.randn(7, dtype=torch.float64)
    ours, theirs = p0.clone(), p0.detach().clone()  # a non-leaf, stepped with its history; torch's plain step
    kw = dict(lr=0.1, initial_accumulator_value=0.3)
    opt = bnbf_nn.Adagrad32bit([ours], differentiable=True, **kw)
    if capturable:  # Adagrad has no capturable; its tensor steps come from a bnbf_nn AdamW, checked against torch's
        opt = bnbf_nn.AdamW32bit([ours], differentiable=True, capturable=True, lr=0.1)
        ref = torch.optim.AdamW([theirs], lr=0.1)
    else:
        ref = torch.optim.Adagrad([theirs], **kw)
    for k in range(3):
        ours.grad, theirs.grad = g * (k + 1), g * (k + 1)
        opt.step()
        ref.step()
    torch.testing.assert_close(ours.detach(), theirs, rtol=1e-13, atol=0)


def test_differentiable_with_8bit_state_raises_naming_32bit_and_writes_nothing():
    p = torch.nn.Parameter(torch.randn(300))
    opt = bnbf_nn.AdamW8bit([p], differentiable=True, min_8bit_size=0)
    p.grad = torch.randn(300)
    before = p.detach().clone()
    with pytest.raises(ValueError, match="differentiable=True in param group 0 needs 32-bit state"):
        opt.step()
    assert torch.equal(p.detach(), before)
    assert "state" not in opt.state.get(p, {})


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("warm", [False, True], ids=["first step", "later step"])
def test_a_differentiable_step_refuses_a_leaf_param_before_any_step(groups, warm):
    """torch refuses to write a leaf that requires grad in place under grad mode: the params before it (of its
    group or of earlier groups) were stepped, and its own step count taken, before torch's error."""
    a = torch.randn(257, requires_grad=True).clone()  # a non-leaf: the differentiable idiom
    b = torch.randn(257, requires_grad=True).clone()
    params = [a, b] if groups == 1 else [{"params": [a]}, {"params": [b]}]
    opt = bnbf_nn.AdamW32bit(params, lr=0.1, differentiable=True)
    a.grad, b.grad = torch.randn(257), torch.randn(257)
    if warm:
        opt.step()
    leaf = torch.nn.Parameter(b.detach().clone())
    leaf.grad = b.grad
    opt.param_groups[-1]["params"][-1] = leaf
    opt.state[leaf] = opt.state.pop(b, {})
    before = snapshot([a, leaf], [opt.state[a], opt.state[leaf]])
    with pytest.raises(RuntimeError, match=f"param {2 - groups} of param group {groups - 1} is a leaf that requires"):
        opt.step()
    assert_untouched(before)


@pytest.mark.parametrize("capturable", [False, True], ids=["plain", "capturable"])
@pytest.mark.parametrize("when", ["first step", "later step", "compiled step"])
@pytest.mark.parametrize("cls", [bnbf_nn.SGD32bit, bnbf_nn.AdamW8bit], ids=lambda c: c.__name__)
def test_without_differentiable_a_gradient_through_the_step_raises_naming_the_class(cls, when, capturable):
    """A tensor lr that requires grad (in grad mode) asks for a derivative through the step. Without
    differentiable=True the core refuses it, in words that named its own option (``bnbf.update_``) and were raised
    in the group's step, after the groups before it had stepped; the error names the class and group now (and
    32-bit state, for 8-bit state), before any group steps: every param, state and step count as it was."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in ((257,), (4, 9))]
    kw = {"momentum": 0.9} if cls is bnbf_nn.SGD32bit else {"min_8bit_size": 0}
    opt = cls([{"params": params[:1]}, {"params": params[1:]}], 0.1, capturable=capturable, **kw)
    step = torch.compile(opt.step, backend=CompileCounter()) if when == "compiled step" else opt.step
    for p in params:
        p.grad = torch.randn_like(p)
    if when != "first step":
        step()
    opt.param_groups[1]["lr"] = torch.tensor(0.1, requires_grad=True)
    before = snapshot(params, [opt.state[p] for p in params])
    counts = [opt.state[p].get("step") for p in params]
    where = rf"pass differentiable=True to {cls.__name__} \(as its argument, or in param group 1\) to differentiate"
    bits = r" through the step, with 32-bit state \(optim_bits=32, or AdamW32bit\)" if "8bit" in cls.__name__ else ""
    # torch may warn about the lr that requires grad (once per process: not asserted)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises(RuntimeError, match=where + bits):
            step()
    torch._dynamo.reset()
    assert_untouched(before, "params and states")
    assert [opt.state[p].get("step") for p in params] == counts


# ---- capturable=True (CPU bookkeeping) ---------------------------------------------------------------------


def _run_with_scheduler(name, capturable, lr, steps=4, bits=8, device="cpu"):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device=device)) for s in ((257,), (16, 9), (1,))]
    opt = _make(name, params, bits=bits, lr=lr, capturable=capturable)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        sched.step()
    return opt, params


@pytest.mark.parametrize("name", ["AdamW", "Lion", "SGD"])
def test_capturable_keeps_steps_on_the_device_and_follows_the_scheduler(name):
    lr0 = HPARAMS[name]["lr"]
    opt, params = _run_with_scheduler(name, True, torch.tensor(lr0))
    plain, ref = _run_with_scheduler(name, False, lr0)
    for p in params:
        step = opt.state[p]["step"]
        assert isinstance(step, torch.Tensor) and step.dtype == torch.int64 and step.device == p.device
        assert int(step) == 4 and plain.state[ref[0]]["step"] == 4
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)  # filled in place by the scheduler
    torch.testing.assert_close(opt.param_groups[0]["lr"].item(), plain.param_groups[0]["lr"])
    for p, q in zip(params, ref):
        # the scheduler's lr as a float32 tensor against Python floats: float32 rounding of lr
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


def test_capturable_state_dict_keeps_a_tensor_step_loaded_onto_the_device():
    opt, params = _run_with_scheduler("AdamW", True, torch.tensor(1e-2), steps=2)
    sd = opt.state_dict()
    assert all(torch.equal(e["step"], torch.tensor(2.0)) for e in sd["state"].values())
    again = bnbf_nn.AdamW8bit(params, lr=torch.tensor(1e-2), capturable=True, min_8bit_size=0)
    again.load_state_dict(sd)
    for p in params:
        step = again.state[p]["step"]
        assert isinstance(step, torch.Tensor) and step.dtype == torch.int64 and step.device == p.device
        assert int(step) == 2
    # the saved group's settings load with it, capturable included (as torch.optim's load_state_dict)
    plain = bnbf_nn.AdamW8bit(params, min_8bit_size=0)
    plain.load_state_dict(sd)
    assert plain.param_groups[0]["capturable"] is True
    assert all(plain.state[p]["step"].dtype == torch.int64 for p in params)
    sd["param_groups"][0]["capturable"] = False
    plain.load_state_dict(sd)
    assert all(plain.state[p]["step"] == 2 and type(plain.state[p]["step"]) is int for p in params)


# ---- torch.compile(opt.step) -------------------------------------------------------------------------------


def _loop(make, lr=1e-3, steps=3, compiled_at=None, inductor=False, after=None):
    """``steps`` steps of ``make(params, lr)`` with an LR scheduler on seeded params and grads: the steps numbered
    in ``compiled_at`` (from 0; default all) by ``torch.compile(opt.step)``, counted by a CompileCounter backend
    (or Dynamo's counters under Inductor), the others eagerly; ``after(k, params, opt, graphs)`` called after
    each. The graphs compiled after each step, the params and the optimizer."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters["stats"].clear()
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in ((257,), (4, 9))]
    opt = make(params, lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    cnt = CompileCounter()
    step = torch.compile(opt.step) if inductor else torch.compile(opt.step, backend=cnt)
    frames = []
    for k in range(steps):
        for p in params:
            p.grad = torch.randn_like(p)
        (step if compiled_at is None or k in compiled_at else opt.step)()
        sched.step()
        frames.append(torch._dynamo.utils.counters["stats"]["unique_graphs"] if inductor else cnt.frame_count)
        if after is not None:
            after(k, params, opt, frames[-1])
    torch._dynamo.reset()
    return frames, params, opt


@functools.cache
def _torch_adamw_graphs(tensor_lr: bool) -> list[int]:
    return _loop(lambda ps, lr: torch.optim.AdamW(ps, lr=torch.tensor(lr) if tensor_lr else lr))[0]


@pytest.mark.parametrize("tensor_lr", [True, False], ids=["tensor_lr", "float_lr"])
@pytest.mark.parametrize("name", FAMILIES)
def test_compiled_step_compiles_no_more_than_torchs_adamw(name, tensor_lr):
    if not tensor_lr and name not in ("AdamW", "SGD"):
        pytest.skip("float lr: two families keep the pass short")
    if triton_mode() and name not in ("AdamW", "Lion", "AdEMAMix"):
        pytest.skip("the interpreter pass compiles three families (every family compiles in the reference pass)")
    lr0 = HPARAMS[name]["lr"]
    as_lr = (lambda v: torch.tensor(v)) if tensor_lr else (lambda v: v)
    ref = _torch_adamw_graphs(tensor_lr)
    ours, params, _ = _loop(lambda ps, lr: _make(name, ps, lr=as_lr(lr)), lr0)
    assert ours[-1] <= ref[-1], f"{name}8bit compiled {ours} graphs by call, torch's AdamW {ref}"
    assert ours[-1] == ours[1], f"{name}8bit recompiled after its second call: {ours}"
    # the same steps eagerly: equal bit for bit (with a tensor lr the compiled step keeps tensor step counts on
    # the device, as capturable=True does)
    eager_params = _loop(lambda ps, lr: _make(name, ps, lr=as_lr(lr), capturable=tensor_lr), lr0, compiled_at=())[1]
    for p, q in zip(params, eager_params):
        assert torch.equal(p, q), f"{name}8bit: the compiled steps differ from the eager ones"


@pytest.mark.parametrize("capturable", [False, True], ids=["int_steps", "capturable"])
def test_compiled_step_keeps_the_eager_step_counts_and_interleaves_with_eager_steps(capturable):
    """The compiled step keeps the counts as the eager step of the same group does (ints; 0-d int64 tensors with
    capturable=True), so eager steps after compiled ones continue the same run: three compiled then two eager
    steps equal five eager steps bit for bit. With numbers only, no graph is compiled: the step runs eagerly
    within the compiled call (one fused launch either way, without torch's host work for each tensor input)."""
    make = lambda ps, lr: _make("AdamW", ps, lr=lr, capturable=capturable)
    params = _loop(make)[1]
    ref, ref_opt = _loop(make, steps=5, compiled_at=())[1:]

    def after(k, again, opt, graphs):
        if k == 2:  # after the compiled steps: the counts as the eager step keeps them
            for p, q in zip(again, params):
                assert torch.equal(p, q)
            counts = [opt.state[p]["step"] for p in again]
            assert all(isinstance(c, torch.Tensor) if capturable else type(c) is int for c in counts), counts
            assert [int(c) for c in counts] == [3, 3]
            assert (graphs > 0) == capturable, f"{graphs} graphs compiled"

    _, again, opt = _loop(make, steps=5, compiled_at=(0, 1, 2), after=after)
    for p, q in zip(again, ref):
        assert torch.equal(p, q), "three compiled then two eager steps differ from five eager steps"
    assert [int(opt.state[p]["step"]) for p in again] == [int(ref_opt.state[p]["step"]) for p in ref] == [5, 5]


def test_compiled_step_after_eager_steps_compiles_nothing_and_continues_the_run():
    """Eager steps first (they arm the adapter's fast path), then compiled ones: Dynamo runs ``opt.step``'s frame
    eagerly (it holds no tensor) and would compile each callee of the fast path on its own; the fast path steps
    aside inside a compiled call, so nothing is compiled, and two eager then three compiled steps equal five
    eager steps bit for bit."""
    make = lambda ps, lr: _make("AdamW", ps, lr=lr)
    ref = _loop(make, steps=5, compiled_at=())[1]
    graphs, params, opt = _loop(make, steps=5, compiled_at=(2, 3, 4))
    assert graphs[-1] == 0, f"{graphs[-1]} graphs compiled"
    for p, q in zip(params, ref):
        assert torch.equal(p, q), "two eager then three compiled steps differ from five eager steps"
    assert [opt.state[p]["step"] for p in params] == [5, 5]


def test_compiled_step_of_a_plain_group_beside_a_capturable_one():
    """One group of numbers (stepped eagerly inside the compiled call) and one capturable group with a tensor lr
    (traced: one graph, never recompiled): both equal the eager steps bit for bit, their counts as eager keeps them."""
    make = lambda ps, lr: _make(
        "AdamW", [{"params": ps[:1]}, {"params": ps[1:], "capturable": True, "lr": torch.tensor(2e-3)}], lr=lr
    )
    graphs, ours, opt = _loop(make, steps=4)
    ref, ref_opt = _loop(make, steps=4, compiled_at=())[1:]
    assert graphs[-1] == 1, f"{graphs[-1]} graphs compiled"
    for p, q in zip(ours, ref):
        assert torch.equal(p, q), "the compiled steps differ from the eager ones"
    counts = [opt.state[p]["step"] for p in ours]
    assert type(counts[0]) is int and isinstance(counts[1], torch.Tensor)
    assert [int(c) for c in counts] == [int(ref_opt.state[p]["step"]) for p in ref] == [4, 4]


def test_compiled_step_refuses_a_bad_setting_and_changes_nothing():
    """A bad lr in the last group under a compiled step (stepped eagerly inside the compiled call) raises torch's
    error before any group steps: every param, state tensor and step count as it was."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in ((257,), (4, 9))]
    opt = _make("AdamW", [{"params": params[:1]}, {"params": params[1:]}], lr=1e-3)
    step = torch.compile(opt.step, backend=CompileCounter())
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        step()
    before = snapshot(params, [opt.state[p] for p in params])
    opt.param_groups[1]["lr"] = -1.0
    with pytest.raises(ValueError, match="Invalid learning rate: -1.0"):
        step()
    torch._dynamo.reset()
    assert_untouched(before, "params and states")
    assert [opt.state[p]["step"] for p in params] == [2, 2]


@functools.cache
def _torch_adamw_inductor_graphs(tensor_lr: bool) -> list[int]:
    make = lambda ps, lr: torch.optim.AdamW(ps, lr=torch.tensor(lr) if tensor_lr else lr)
    return _loop(make, steps=4, inductor=True)[0]


@pytest.mark.parametrize("tensor_lr", [True, False], ids=["tensor_lr", "float_lr"])
@pytest.mark.parametrize("name", FAMILIES)
def test_compiled_step_under_inductor_compiles_no_more_than_torchs_adamw(name, tensor_lr):
    """The loop above with Inductor (the default backend): Inductor makes a float a constant where it cannot keep
    it a graph input, which the CompileCounter backend does not show (AdamW8bit compiled 3 graphs with a float
    lr where torch's AdamW compiles 2, before the scalar row added the numbers to a tensor)."""
    if triton_mode():
        pytest.skip("reference pass and the GPU run: the compile is the same in the interpreter")
    if "cuda" not in DEVICES and name not in ("AdamW", "SGD"):
        pytest.skip("CPU-only run: two families keep it short (every family in the GPU run)")
    ref = _torch_adamw_inductor_graphs(tensor_lr)
    make = lambda ps, lr: _make(name, ps, lr=torch.tensor(lr) if tensor_lr else lr)
    ours = _loop(make, HPARAMS[name]["lr"], steps=4, inductor=True)[0]
    assert ours[-1] <= ref[-1] and ours[-1] == ours[1], f"{name}8bit compiled {ours} graphs by call, torch's {ref}"


def test_compiled_step_keeps_step_hooks():
    torch._dynamo.reset()
    p = torch.nn.Parameter(torch.randn(9))
    opt = bnbf_nn.AdamW8bit([p], min_8bit_size=0)
    seen = []
    opt.register_step_post_hook(lambda o, a, k: seen.append(1))
    p.grad = torch.randn(9)
    torch.compile(opt.step, backend="eager")()
    assert seen == [1] and int(opt.state[p]["step"]) == 1
    torch._dynamo.reset()


# ---- CUDA graphs -------------------------------------------------------------------------------------------


def _cuda_setup(name, capturable, seed=0):
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in ((4097,), (64, 33), (1,))]
    lr = torch.tensor(HPARAMS[name]["lr"], device="cuda") if capturable else HPARAMS[name]["lr"]
    opt = _make(name, params, lr=lr, capturable=capturable)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    grads = [torch.zeros_like(p) for p in params]
    for p, g in zip(params, grads):
        p.grad = g  # the graph reads these tensors: every step's grads are copied into them
    return params, grads, opt, sched


@pytest.mark.gpu
@pytest.mark.parametrize("name", FAMILIES)
def test_captured_step_replayed_equals_eager_steps(name):
    n = 5
    torch.manual_seed(1)
    feed = [[torch.randn(s, device="cuda") for s in ((4097,), (64, 33), (1,))] for _ in range(n + 2)]
    params, grads, opt, sched = _cuda_setup(name, True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # torch's warm-up on a side stream: tables built, buckets known uniform
        for k in range(2):
            torch._foreach_copy_(grads, feed[k])
            opt.step()
            sched.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    for k in range(2, n + 2):
        torch._foreach_copy_(grads, feed[k])
        graph.replay()
        sched.step()
    torch.cuda.synchronize()
    ref_params, ref_grads, ref_opt, ref_sched = _cuda_setup(name, True)
    for k in range(n + 2):
        torch._foreach_copy_(ref_grads, feed[k])
        ref_opt.step()
        ref_sched.step()
    for p, q in zip(params, ref_params):
        assert torch.equal(p, q), f"{name}8bit: the replayed steps differ from the eager ones"
    assert int(opt.state[params[0]]["step"]) == n + 2


@pytest.mark.gpu
def test_capture_without_capturable_raises():
    params, grads, opt, _ = _cuda_setup("AdamW", False)
    opt.step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"), torch.cuda.graph(graph):
        opt.step()

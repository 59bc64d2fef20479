"""The in-place step's host work (issue 11's budget): what a plan's step hands the launcher, and the shortcuts that
keep that work small, are exact. The usual launch (Python-number scalars, no norm pass, no clipping) is built
from arguments kept per grad table (``bnbf.kernels.launcher._plain_args``): the same arguments, configuration key
and kernel call as the launcher's general path, following the grads when they move; validated hyperparameters are
reused only for the very value objects they were made from; a step whose grads stay runs no torch operation on
the host. CPU tensors take the direct path with the launch recorded, not run.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import bnbf
from bnbf.kernels import launcher
from bnbf.kernels.step_kernel import HP_MAX, _step_kernel

# argument plumbing and caches, not kernel numerics: the interpreter pass skips them (conftest)
pytestmark = pytest.mark.surface
P = importlib.import_module("bnbf.plan")  # the module (``bnbf.plan`` is the function that makes a plan)
SHAPES = {"w": (40, 16), "b": (17,), "one": (1,), "odd": (257,), "big": (4097,)}


class General(tuple):
    """Scalars as a tuple subclass: the launcher's general path takes them (its usual path takes exact tuples)."""


def _problem(rule="adamw", dtype=torch.bfloat16, bits=8):
    gen = torch.Generator().manual_seed(0)
    params = {k: torch.randn(s, generator=gen).to(dtype) for k, s in SHAPES.items()}
    state = bnbf.init_state(params, bnbf.OptimSpec(rule=rule, state_bits=bits, min_8bit_size=256))
    grads = {k: torch.randn(s, generator=gen).to(dtype) for k, s in SHAPES.items()}
    return params, state, grads


class Kernel:
    """Stands in for ``_step_kernel``: ``kernel[grid](*args, **kwargs)`` records what Triton's dispatch gets."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


@pytest.fixture
def recorded(monkeypatch):
    """Plans take the direct path for CPU tensors; each launch is recorded (key, grid, args, dispatch), not run."""
    launches: list = []
    monkeypatch.setattr(P, "use_triton", lambda t: True)
    monkeypatch.setattr(launcher, "launch", lambda compiled, device, *rest: launches.append(rest))
    monkeypatch.setattr(launcher, "_step_kernel", Kernel())
    return launches


def _as_bound(args: tuple) -> list:
    """A kernel call's positional arguments as comparable values: a tensor by its address and dtype, a number
    with its type (1 and 1.0 compile other kernels)."""
    return [(a.data_ptr(), a.dtype) if isinstance(a, torch.Tensor) else (type(a), a) for a in args]


def _dispatched(dispatch, monkeypatch) -> tuple:
    """What ``dispatch()`` hands Triton's dispatch, and the launch key it records (LAUNCH_KEYS)."""
    keys: set = set()
    monkeypatch.setattr(launcher, "LAUNCH_KEYS", keys)
    kernel = launcher._step_kernel
    kernel.calls.clear()
    dispatch()
    ((grid, args, kwargs),) = kernel.calls
    return grid, _as_bound(args), kwargs, keys


@pytest.mark.parametrize(
    "rule,dtype,bits",
    [
        ("adamw", torch.bfloat16, 8),
        ("adamw", torch.float32, 32),
        ("lion", torch.float16, 8),
        ("adam", torch.float32, 8),
    ],
    ids=["adamw-bf16-8bit", "adamw-fp32-32bit", "lion-fp16-8bit", "adam-fp32-8bit"],
)
@pytest.mark.parametrize("skip_zeros", [False, True], ids=["", "skip_zeros"])
def test_the_usual_launch_is_the_general_paths_launch(recorded, monkeypatch, rule, dtype, bits, skip_zeros):
    """Per launch group, the usual path's kernel arguments, configuration key, grid and Triton call are the general
    path's for the same scalars, bit for bit, and the arguments are laid out as the kernel's contract has them:
    runtime arguments (the table, tasks, grad table, scalar row, code tables, norm sums, tiles, 18 scalars, the
    clipping pointer and bound) first, None for each constexpr after them."""
    params, state, grads = _problem(rule, dtype, bits)
    opt = bnbf.plan(params, state)
    hp = {"lr": 1e-2, "weight_decay": 0.1}
    opt.step(grads, hp, 3, skip_zeros=skip_zeros)
    assert len(recorded) == len(opt.groups) >= 1
    r = opt.rule
    h = r.make_hparams(hp)
    scalars = tuple(map(float, (*r.scalars(h, 3), 1.0, 3, 0.0, h.lr)))
    for (_, group), (key, grid, args, dispatch) in zip(opt.groups, recorded, strict=True):
        table = group.table.data_ptr()
        code = launcher._code_tables(group.device).data_ptr() if group.layout.quantized else table
        n_tiles = group.tasks.shape[0] * launcher.ITERS[group.fmt][group.dtype]
        head = (table, group.tasks.data_ptr(), group.grad_table.data_ptr(), table, code, table, n_tiles)
        constexprs = len(_step_kernel.arg_names) - 9 - HP_MAX
        assert args == (*head, *scalars, *(0.0,) * (HP_MAX - len(scalars)), table, 0.0, *(None,) * constexprs)
        assert list(map(type, args)) == [int] * 7 + [float] * HP_MAX + [int, float] + [type(None)] * constexprs
        aligned = group.aligned and group.grads_aligned
        assert key == (0, aligned, skip_zeros, len(scalars), False, False, group.shifted, 0)
        assert grid == (group.tasks.shape[0], 1, 1)
        fast = _dispatched(dispatch, monkeypatch)
        # the same launch through the general path
        group.plain_args = None
        general: list = []
        monkeypatch.setattr(launcher, "launch", lambda compiled, device, *rest, _to=general: _to.append(rest))
        launcher.launch_group(group, (), General(scalars), skip_zeros, False, grads_placed=True)
        assert group.plain_args is None, "the general path was not taken"
        ((g_key, g_grid, g_args, g_dispatch),) = general
        assert (g_key, g_grid, g_args) == (key, grid, args)
        assert list(map(type, g_args)) == list(map(type, args))
        assert _dispatched(g_dispatch, monkeypatch) == fast


def test_the_usual_launch_follows_the_grads(recorded):
    """New grads (a new grad table), grads at an address that is not 16-byte aligned, then aligned ones again,
    and a rule with another number of scalars: each launch has the current table's address and alignment."""
    params, state, grads = _problem("adamw", torch.float32, 32)
    opt = bnbf.plan(params, state)
    ((_, group),) = opt.groups
    hp = {"lr": 1e-2}

    def step(gs, n):
        recorded.clear()
        opt.step(gs, hp, n)
        ((key, _, args, _),) = recorded
        assert group.grad_table.tolist() == [g.data_ptr() for g in gs.values()]
        assert args[2] == group.grad_table.data_ptr()
        return key

    assert step(grads, 1)[1] is group.aligned
    moved = {k: g.clone() for k, g in grads.items()}
    assert step(moved, 2)[1] is group.aligned
    odd = {k: torch.randn(g.numel() + 1)[1:].view(g.shape) for k, g in grads.items()}  # 4 bytes past 16-byte
    assert step(odd, 3)[1] is False
    assert step(moved, 4)[1] is group.aligned
    lion_params, lion_state, lion_grads = _problem("lion", torch.float32, 32)
    recorded.clear()
    bnbf.plan(lion_params, lion_state).step(lion_grads, hp, 1)
    ((key, _, args, _),) = recorded
    n = len(bnbf.RULES["lion"].scalars(bnbf.RULES["lion"].make_hparams(hp), 1)) + 4
    assert key[3] == n and args[7 + n : 7 + HP_MAX] == (0.0,) * (HP_MAX - n)
    # the launcher's own contract, beyond what a plan passes: any number of scalars, a group given a new table
    for scalars in ((0.5,) * 5, (0.25,) * HP_MAX):
        recorded.clear()
        launcher.launch_group(group, (), scalars, grads_placed=True)
        ((key, _, args, _),) = recorded
        assert key[3] == len(scalars) and args[7 : 7 + HP_MAX] == scalars + (0.0,) * (HP_MAX - len(scalars))
    group.table = group.table.clone()
    recorded.clear()
    launcher.launch_group(group, (), (0.5,) * 5, grads_placed=True)
    ((_, _, args, _),) = recorded
    assert args[0] == args[3] == args[4] == args[5] == args[7 + HP_MAX] == group.table.data_ptr()


def test_validated_hparams_are_reused_only_for_the_same_values():
    """A rule's validated hyperparameters come back for the very value objects they were made from; a dict changed
    in place, a value of another type or sign, another rule, and tensors (read every call) are validated again."""
    adamw, adam = bnbf.RULES["adamw"], bnbf.RULES["adam"]
    hp = {"lr": 0.1, "weight_decay": 0.0}
    first = adamw.make_hparams(hp)
    assert adamw.make_hparams(hp) is first and adamw.make_hparams(dict(hp)) is first
    assert type(adam.make_hparams(hp)) is type(first).__mro__[1]  # Adam's class, not AdamW's
    hp["lr"] = 0.2
    assert adamw.make_hparams(hp).lr == 0.2
    hp["lr"] = -1.0
    with pytest.raises(ValueError, match="Invalid learning rate: -1.0"):
        adamw.make_hparams(hp)
    hp["lr"] = 0.0
    assert str(adamw.make_hparams(hp).lr) == "0.0"
    hp["lr"] = -0.0
    assert str(adamw.make_hparams(hp).lr) == "-0.0"
    flags = {"amsgrad": True}
    assert adamw.make_hparams(flags).amsgrad is True
    with pytest.raises(TypeError, match="amsgrad must be a bool"):
        adamw.make_hparams({"amsgrad": 1})
    hp = {"lr": 0.1}
    adamw.make_hparams(hp)
    hp["eps"] = -1.0  # a key added in place
    with pytest.raises(ValueError, match="Invalid epsilon value: -1.0"):
        adamw.make_hparams(hp)
    # a name deleted from the registry and registered again for a rule with other hyperparameters
    lion = dataclasses.replace(bnbf.RULES["lion"], name="h13_again")
    bnbf.register_rule(lion)
    hp = {"lr": 0.1, "weight_decay": 0.0}
    try:
        assert type(bnbf.RULES["h13_again"].make_hparams(hp)) is lion.hparams
        del bnbf.RULES["h13_again"]
        again = bnbf.register_rule(dataclasses.replace(adamw, name="h13_again"))
        assert type(again.make_hparams(hp)) is adamw.hparams
        assert type(again.make_hparams(dict(hp))) is adamw.hparams
    finally:
        bnbf.RULES.pop("h13_again", None)
    lr = torch.tensor(0.1)
    tensor_hp = {"lr": lr}
    assert adamw.make_hparams(tensor_hp).lr is lr
    lr.fill_(-1.0)  # changed in place: read again at the next call
    with pytest.raises(ValueError, match="Invalid learning rate"):
        adamw.make_hparams(tensor_hp)
    ref = weakref.ref(lr)
    del lr, tensor_hp
    gc.collect()
    assert ref() is None, "a tensor hyperparameter was kept"


def test_a_step_reads_the_hparams_dict_it_is_given_every_step(device):
    """The same hyperparameter dict changed in place between a plan's steps: the step takes the new values (the
    same params as steps given fresh dicts), and refuses a bad one before anything is written."""
    params, state, grads = _problem("adamw", torch.float32, 8)
    params = {k: v.to(device) for k, v in params.items()}
    grads = {k: v.to(device) for k, v in grads.items()}
    state = bnbf.init_state(params, bnbf.OptimSpec(rule="adamw", min_8bit_size=256))
    twin_p = {k: v.clone() for k, v in params.items()}
    twin_s = {k: type(s)(*(t.clone() for t in s)) for k, s in state.items()}
    opt = bnbf.plan(params, state)
    hp = {"lr": 1e-2, "weight_decay": 0.1}
    for step, lr in ((1, 1e-2), (2, 3e-2), (3, 5e-3)):
        hp["lr"] = lr
        opt.step(grads, hp, step)
        bnbf.update_(twin_p, grads, twin_s, {"lr": lr, "weight_decay": 0.1}, step)
        for k in params:
            assert torch.equal(params[k], twin_p[k]), (step, k)
    hp["lr"] = float("nan")
    before = {k: v.clone() for k, v in params.items()}
    with pytest.raises(ValueError, match="Invalid learning rate: nan"):
        opt.step(grads, hp, 4)
    assert all(torch.equal(params[k], before[k]) for k in params)


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_a_step_whose_grads_stay_runs_no_torch_op(recorded):
    """The per-step work of a plan's step, ``update_`` and a bnbf_nn step whose grads stay where they were, with
    Python-number hyperparameters: checks, scalars and launch arguments, no torch operation on the host (each
    would be a dispatch, and on a GPU possibly a synchronisation)."""
    import bnbf_nn

    params, state, grads = _problem()
    opt = bnbf.plan(params, state)
    hp = {"lr": 1e-2, "weight_decay": 0.1}
    leaves = [torch.nn.Parameter(p.clone()) for p in params.values()]
    for p, g in zip(leaves, grads.values(), strict=True):
        p.grad = g
    nn_opt = bnbf_nn.AdamW8bit(leaves, lr=1e-2, weight_decay=0.1, min_8bit_size=256)
    steps = {
        "plan.step": lambda i: opt.step(grads, hp, i),
        "update_": lambda i: bnbf.update_(params, grads, state, hp, i),
        "bnbf_nn": lambda i: nn_opt.step(),
    }
    for name, step in steps.items():
        step(1)  # builds the plan and its tables (bnbf_nn: the states)
        step(2)  # (bnbf_nn: the plan)
        recorded.clear()
        with Ops() as mode:
            step(3)
        assert recorded, name
        assert mode.ops == [], f"{name}: {mode.ops}"

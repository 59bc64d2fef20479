"""0-d tensor scalars in one launch (bnbf.kernels.scalar_program): a rule's arithmetic on a tensor lr, step or beta,
recorded and run in float64, gives the float32 scalars the host computes from the same numbers; what it cannot
record falls back to torch ops; a step with tensor scalars equals the step with numbers bit for bit."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from conftest import kernel_runs
from hypothesis import given
from hypothesis import strategies as st

import bnbf
from bnbf._host_checks import hparam_tensors
from bnbf.kernels import scalar_program as sp
from bnbf.quant import DITHER_SEED_MOD
from bnbf.rules import RULES, get_rule

P = sys.modules["bnbf.plan"]  # the module: bnbf.plan is also a function's name on the package

TRACED = sorted(RULES)  # every built-in rule's default arithmetic records (AdEMAMix's warm-ups do not: below)


@pytest.fixture
def program_device(device, monkeypatch):
    """A device whose steps run the kernels (CUDA, or the CPU under the interpreter), the program route on."""
    if not kernel_runs(device):
        pytest.skip("the program runs where the Triton kernels run (CUDA, or TRITON_INTERPRET=1)")
    monkeypatch.setattr(P, "PROGRAM_DEVICES", {"cuda", "cpu"})
    return torch.device(device)


def _counted(monkeypatch) -> list:
    runs = []
    real = sp.run

    def run(*a, **k):
        runs.append(a[0])
        return real(*a, **k)

    monkeypatch.setattr(sp, "run", run)
    return runs


def _traced(monkeypatch) -> list:
    """The recordings of programs from here on (each call's arguments after the function), none kept before."""
    traced = []
    real = sp.trace
    monkeypatch.setattr(sp, "trace", lambda *a: traced.append(a[2:]) or real(*a))
    P._PROGRAMS.clear()
    return traced


def _hparams(name: str, lr: float, betas: tuple, wd: float) -> dict:
    h: dict = {"lr": lr, "weight_decay": wd}
    if "betas" in {f for f in get_rule(name).hparams.__dataclass_fields__}:
        n = len(get_rule(name).hparams().betas)
        h["betas"] = (*betas, 0.9999)[:n] if n == 3 else betas
    if name in ("sgd", "lars", "rmsprop"):
        h["momentum"] = 0.9
    return h


def _host(name: str, hp: dict, step: int) -> tuple:
    rule = get_rule(name)
    values, _ = P._scalar_values(rule, rule.make_hparams(hp), step, False, 0.0, False)
    return values


def _program(rule, h, step):
    """The program route's scalars (None where it does not apply), as a step with these inputs takes them."""
    return P._program_values(rule, h, step, 0.0, False, [t for _, t in hparam_tensors(h, step, 0.0)])


def _run(program, xs, number=0):
    """The program's outputs for inputs ``xs`` (and the launch's ``number``), its row uploaded as a step uploads it."""
    return sp.run(program, P._program_row(program, xs[0].device, False), xs, number)


def _as_f32(v) -> float:
    return torch.tensor(float(v), dtype=torch.float64).float().item()


@pytest.mark.parametrize("name", TRACED)
@given(
    step=st.integers(1, 10**7),
    lr=st.floats(1e-8, 1.0),
    b1=st.floats(0.0, 0.9999),
    b2=st.floats(0.0, 0.9999),
    wd=st.floats(0.0, 0.1),
)
def test_program_matches_host_numbers(program_device, name, step, lr, b1, b2, wd):
    """Float64 tensors holding the same numbers: every scalar equals the host's float64 value rounded to float32
    (what a kernel argument gets), the step's rounding seed included."""
    hp = _hparams(name, lr, (b1, b2), wd)
    rule = get_rule(name)
    expected = _host(name, hp, step)
    tensor = lambda x: torch.tensor(x, dtype=torch.float64, device=program_device)  # noqa: E731
    hp_t = {**hp, "lr": tensor(lr)}
    if "betas" in hp:
        hp_t["betas"] = tuple(map(tensor, hp["betas"][:2])) + tuple(hp["betas"][2:])
    step_t = torch.tensor(step, device=program_device)
    got = _program(rule, rule.make_hparams(hp_t), step_t)
    assert got is not None, f"{name}'s scalars were not recorded"
    assert got.row.dtype == torch.float32 and got.row.device.type == program_device.type
    row = got.row.tolist()
    assert len(row) == len(expected)
    for k, (g, e) in enumerate(zip(row, expected)):
        assert g == _as_f32(e) or (math.isnan(g) and math.isnan(e)), (k, g, e)
    assert row[-3] == step % DITHER_SEED_MOD


@pytest.mark.parametrize(
    "x, y",
    [
        (0.9, 1.0), (0.9, 2.0), (0.999, 10**6), (0.5, 0.5), (2.0, 0.5), (0.0, 0.5), (0.0, 3.0), (0.0, -1.0),
        (-2.0, 3.0), (-2.0, 2.0), (-2.0, 0.5), (1.0, float("nan")), (float("nan"), 0.0), (3.0, -2.0),
        (0.3, 1.7), (10.0, -0.25), (float("inf"), 2.0), (0.5, float("inf")), (7.0, 0.0),
    ],
)  # fmt: skip
def test_power_as_torch(program_device, x, y):
    """The program's x ** y against torch.pow in float64, both rounded to float32: exact for whole exponents and
    square roots; exp(y·log x) for any other, within one float32 rounding of the libm result."""
    program = sp.program_of(*sp.trace(lambda a, b: (a**b,), 2))
    xs = [torch.tensor(x, dtype=torch.float64, device=program_device), torch.tensor(y, dtype=torch.float64,
          device=program_device)]  # fmt: skip
    got = _run(program, xs)[0].item()
    want = torch.pow(xs[0], xs[1]).float().item()
    if math.isnan(want):
        assert math.isnan(got)
    elif float(y).is_integer() or y == 0.5 or math.isinf(want) or want == 0.0:
        assert got == want
    else:
        assert got == pytest.approx(want, rel=2**-23, abs=0)


@pytest.mark.parametrize("x", [7.0, -7.0, 16777217.0, 3.5, -0.5, 0.0, 123456789.0])
@pytest.mark.parametrize("y", [2.0, -2.0, 16777216.0, 0.75, 1.0])
def test_mod_and_floordiv_as_python(program_device, x, y):
    """``%`` and ``//`` with Python's (and torch's) signs: the remainder takes the divisor's."""
    program = sp.program_of(*sp.trace(lambda a, b: (a % b, a // b, b - a, -a, a / b), 2))
    xs = [torch.tensor(v, dtype=torch.float64, device=program_device) for v in (x, y)]
    got = _run(program, xs).tolist()
    assert got == [_as_f32(x % y), _as_f32(x // y), _as_f32(y - x), _as_f32(-x), _as_f32(x / y)]


def test_stand_ins_record_arithmetic_only():
    """A comparison, truth, a conversion or a torch function on a stand-in ends the recording (the caller's torch
    ops then compute it): never a silent guess."""
    (a,), _ = sp.trace(lambda s: (s,), 1)
    for op in (lambda: a < 1, lambda: a == 1, lambda: bool(a), lambda: float(a), lambda: int(a), lambda: min(a, 2),
               lambda: math.log(a), lambda: a + "1", lambda: a + torch.tensor(1.0)):  # fmt: skip
        with pytest.raises((sp.Untraceable, TypeError)):
            op()


def _step_pair(device, name, hp, steps, in_place, tensor_betas=False, tensor_step=True):
    """The params after ``steps`` steps with numbers, and with lr (and betas) float64 tensors and a tensor step (or
    the int step)."""
    torch.manual_seed(0)
    p0 = torch.randn(257, device=device)
    grads = [torch.randn(257, device=device) for _ in range(steps)]
    spec = bnbf.OptimSpec(rule=name)
    out = []
    for tensors in (False, True):
        p, s = p0.clone(), bnbf.init_state(p0, spec, hp)
        h = dict(hp)
        if tensors:
            h["lr"] = torch.tensor(hp["lr"], dtype=torch.float64, device=device)
            if tensor_betas and "betas" in hp:
                h["betas"] = tuple(torch.tensor(b, dtype=torch.float64, device=device) for b in hp["betas"])
        for k in range(1, steps + 1):
            step = torch.tensor(k, device=device) if tensors and tensor_step else k
            if in_place:
                bnbf.update_(p, grads[k - 1], s, h, step)
            else:
                p, s = bnbf.update(p, grads[k - 1], s, h, step)
        out.append((p, s))
    return out


@pytest.mark.parametrize("name", ["adamw", "adan", "lamb", "sgd", "ademamix"])
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("tensor_step", [True, False])
def test_step_with_tensor_scalars_equals_numbers(program_device, monkeypatch, name, in_place, tensor_step):
    runs = _counted(monkeypatch)
    traced = _traced(monkeypatch)
    hp = _hparams(name, 1e-2, (0.9, 0.99), 0.01)
    pair = _step_pair(program_device, name, hp, 3, in_place, tensor_betas=name == "adamw", tensor_step=tensor_step)
    (p_num, s_num), (p_t, s_t) = pair
    assert len(runs) == 3, "each tensor step's scalars took the program"
    assert len(traced) == 1, "one program for the three steps (an int step is the launch's number)"
    assert torch.equal(p_num, p_t)
    for a, b in zip(s_num, s_t):
        assert torch.equal(a, b)


def test_unrecorded_arithmetic_falls_back(program_device, monkeypatch):
    """AdEMAMix's warm-ups take a minimum of the step's schedule: not recorded, so the small torch ops compute the
    scalars (in float64: the step equals the one with numbers), as they do where the program route is off."""
    runs = _counted(monkeypatch)
    hp = {"lr": 1e-2, "t_alpha": 10, "t_beta3": 10}
    (p_num, _), (p_t, s_t) = _step_pair(program_device, "ademamix", hp, 2, False)
    assert runs == []
    assert torch.equal(p_num, p_t)  # the torch ops in float64, as the host's numbers
    monkeypatch.setattr(P, "PROGRAM_DEVICES", set())
    _, (p_off, s_off) = _step_pair(program_device, "ademamix", hp, 2, False)
    assert torch.equal(p_t, p_off)
    for a, b in zip(s_t, s_off):
        assert torch.equal(a, b)


def test_int_step_folded_where_its_arithmetic_is_not_recorded(program_device, monkeypatch):
    """AdEMAMix's warm-ups with an int step beside a tensor lr: the minimum of the step's schedule cannot be recorded
    on a stand-in for the step, but the int folds into the program as a number (one program a step); the steps
    equal the ones with numbers."""
    runs = _counted(monkeypatch)
    traced = _traced(monkeypatch)
    hp = {"lr": 1e-2, "t_alpha": 10, "t_beta3": 10}
    (p_num, s_num), (p_t, s_t) = _step_pair(program_device, "ademamix", hp, 3, False, tensor_step=False)
    assert len(runs) == 3
    assert traced == [(True,), (False,), (False,), (False,)]  # the number's attempt once, then a program a step
    assert torch.equal(p_num, p_t)
    for a, b in zip(s_num, s_t):
        assert torch.equal(a, b)


@pytest.mark.parametrize("step", [1, 2, 2**31 - 1, 2**31, 2**40 + 3])
def test_int_step_beside_tensors_matches_host_numbers(program_device, step):
    """An int step is the launch's int32 number below 2**31 and folds into the program beyond: both give the
    host's scalars, the rounding's seed included; the kernel refuses a number beyond int32."""
    rule = get_rule("adamw")
    hp = {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.01}
    expected = _host("adamw", hp, step)
    got = _program(rule, rule.make_hparams({**hp, "lr": torch.tensor(1e-3, dtype=torch.float64,
                                                                       device=program_device)}), step)  # fmt: skip
    assert got is not None
    assert got.row.tolist() == [_as_f32(e) for e in expected]
    program = sp.program_of(*sp.trace(lambda a, n: (a * n,), 1, True))
    with pytest.raises(ValueError, match="number"):
        _run(program, [torch.ones((), device=program_device)], 2**31)
    assert _run(program, [torch.ones((), device=program_device)], 2**31 - 1).tolist() == [_as_f32(2**31 - 1)]


def test_not_taken_where_the_kernel_cannot_read_them(program_device, monkeypatch):
    """A tensor in a derivative, a subclass, or more tensors than the kernel's pointers: the torch ops."""
    rule = get_rule("adamw")
    lr = torch.tensor(1e-3, device=program_device)
    step = torch.tensor(3, device=program_device)
    assert _program(rule, rule.make_hparams({"lr": lr}), step) is not None
    grad_lr = lr.clone().requires_grad_()
    assert _program(rule, rule.make_hparams({"lr": grad_lr.detach()}), step) is not None
    with torch.enable_grad():
        h = rule.make_hparams({"lr": grad_lr})
        assert _program(rule, h, step) is None
    param = torch.nn.Parameter(lr.clone(), requires_grad=False)
    assert _program(rule, rule.make_hparams({"lr": param}), step) is None
    many = {"lr": lr, "betas": (lr * 0 + 0.9, lr * 0 + 0.99), "eps": lr * 0 + 1e-8}
    assert _program(rule, rule.make_hparams(many), step) is None  # 5 tensors


@pytest.mark.parametrize("in_place", [False, True])
def test_lazy_tensors_take_the_torch_ops_and_their_values(program_device, in_place):
    """A float64 lr with torch's negative bit (``x.conj().imag``: its memory holds -lr) and an efficient zero tensor
    weight decay (no memory): the kernel would read their memory, so the torch ops compute the scalars, and the step
    equals the one with their numbers (a program read the negated lr's bytes, before its check, as -lr)."""
    rule = get_rule("adamw")
    z = torch.complex(torch.zeros((), dtype=torch.float64), torch.tensor(-1e-2, dtype=torch.float64))
    lr = torch.imag(z.to(program_device).conj())  # 1e-2, negative bit set
    wd = torch._efficientzerotensor((), dtype=torch.float32, device=program_device)
    assert lr.is_neg() and wd._is_zerotensor() and lr.item() == 1e-2
    step = torch.tensor(2, device=program_device)
    assert _program(rule, rule.make_hparams({"lr": lr, "weight_decay": wd}), step) is None
    torch.manual_seed(0)
    p0, g = torch.randn(257, device=program_device), torch.randn(257, device=program_device)
    out = []
    for h, t in (({"lr": 1e-2, "weight_decay": 0.0}, 2), ({"lr": lr, "weight_decay": wd}, step)):
        p, s = p0.clone(), bnbf.init_state(p0, bnbf.OptimSpec(rule="adamw"))
        if in_place:
            bnbf.update_(p, g, s, h, t)
        else:
            p, s = bnbf.update(p, g, s, h, t)
        out.append((p, s))
    assert torch.equal(out[0][0], out[1][0])
    for a, b in zip(out[0][1], out[1][1]):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
@pytest.mark.parametrize("new_program", [False, True])
def test_captured_program_replays_like_eager(monkeypatch, new_program):
    """A step captured after a warm-up that uploaded its program, or with hyperparameters whose program is new (its
    row then filled inside the graph): replays with lr and the step changing equal the eager steps bit for bit."""
    runs = _counted(monkeypatch)
    torch.manual_seed(0)
    p0 = torch.randn(4097, device="cuda")
    grads = [torch.randn_like(p0) for _ in range(4)]
    spec = bnbf.OptimSpec(rule="adamw")
    wd = [0.01, 0.02 if new_program else 0.01]  # the warm-up's, the capture's
    lrs = [1e-2 / t for t in range(1, 5)]

    p, s = p0.clone(), bnbf.init_state(p0, spec)
    lr, step, g = torch.tensor(lrs[0], device="cuda"), torch.tensor(1, device="cuda"), grads[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        bnbf.update_(p, g, s, {"lr": lr, "weight_decay": wd[0]}, step)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        bnbf.update_(p, g, s, {"lr": lr, "weight_decay": wd[1]}, step)
    assert len(runs) == 2, "the captured step's scalars came from a program"
    for t in range(2, 5):
        lr.fill_(lrs[t - 1])
        step.fill_(t)
        g.copy_(grads[t - 1])
        graph.replay()
    torch.cuda.synchronize()

    q, r = p0.clone(), bnbf.init_state(p0, spec)
    for t in range(1, 5):
        hp = {"lr": torch.tensor(lrs[t - 1], device="cuda"), "weight_decay": wd[0] if t == 1 else wd[1]}
        bnbf.update_(q, grads[t - 1], r, hp, torch.tensor(t, device="cuda"))
    assert torch.equal(p, q)
    for a, b in zip(s, r):
        assert torch.equal(a, b)


def test_programs_are_kept_by_what_decides_them(program_device, monkeypatch):
    """A second step with the same numbers (tensors' values aside) runs the kept program, recorded once; another
    number, or the same number with the other sign of zero, records its own."""
    traced = _traced(monkeypatch)
    rule = get_rule("adamw")
    step = torch.tensor(2, device=program_device)
    for lr, wd in ((1e-3, 0.01), (2e-3, 0.01), (1e-3, 0.02), (1e-3, 0.0), (1e-3, -0.0), (5e-3, -0.0)):
        h = rule.make_hparams({"lr": torch.tensor(lr, device=program_device), "weight_decay": wd})
        values = _program(rule, h, step)
        assert P.scalar_row(values, step.device) is values.row  # the row a kernel reads, as made
    assert len(traced) == 4  # wd 0.01, 0.02, 0.0, -0.0: lr a tensor, its value no part of the program


@pytest.mark.parametrize("dtypes", [
    (torch.float32, torch.float64, torch.int64, torch.bfloat16), (torch.float16, torch.int32, torch.int16, torch.int8),
    (torch.uint8, torch.float32, torch.bool, torch.int64),
])  # fmt: skip
@pytest.mark.parametrize("view", ["offset", "strided"])
def test_inputs_of_every_dtype_are_read(program_device, dtypes, view):
    """Each input's value, whatever its dtype (read as it is, by a code of the launch, so a new mix of dtypes
    compiles nothing; bool made float64 first), including 1-element tensors of other shapes: a view at an offset,
    one whose stride is not 1."""
    values = [3.5, -2.25, 7, 1.5]
    xs = []
    for v, dt in zip(values, dtypes):
        if dt in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool):
            v = int(abs(v))
        base = torch.tensor([0, 0, v, 0, 0, 0], dtype=dt, device=program_device)
        xs.append(base[2:3] if view == "offset" else base[::2][1:2])  # (1,) at element 2, strides 1 or 2
    program = sp.program_of(*sp.trace(lambda a, b, c, d: (a, b, c, d, a * b + c - d), 4))
    got = _run(program, xs).tolist()
    read = [float(x.double().item()) for x in xs]
    assert got == [_as_f32(r) for r in read] + [_as_f32(read[0] * read[1] + read[2] - read[3])]


def test_inputs_take_no_conversion(program_device, monkeypatch):
    """The inputs of the dtypes the kernel reads reach it as they are: at their own addresses, with no op before the
    launch but the views (a conversion would be one more launch a step on a GPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen, given = [], []
    real = sp._program_kernel

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not given:  # before the launch (the interpreter copies tensors of its own)
                seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    class Kernel:
        def __getitem__(self, grid):
            return lambda *a, **k: given.extend(x.data_ptr() for x in a[1:5]) or real[grid](*a, **k)

    monkeypatch.setattr(sp, "_program_kernel", Kernel())
    monkeypatch.setattr(sp, "_COMPILED", {})  # every launch through the dispatch (CUDA)
    program = sp.program_of(*sp.trace(lambda a, b, c, d: (a + b, c * d), 4))
    dts = (torch.float32, torch.int64, torch.bfloat16, torch.float64)
    xs = [torch.tensor(k + 2, dtype=dt, device=program_device) for k, dt in enumerate(dts)]
    row = P._program_row(program, xs[0].device, False)  # the tensors' device (cuda:0: a stream's)
    with Ops():
        got = sp.run(program, row, xs)
    assert set(seen) <= {"empty", "as_strided", "view", "detach"}, seen  # views and the output: no copy
    assert given == [x.data_ptr() for x in xs]
    assert got.tolist() == [5.0, 20.0]


def test_one_kernel_signature_for_every_mix_of_inputs(program_device, monkeypatch):
    """Programs of other sizes and inputs of other dtypes reach the kernel with the same argument types and
    constexprs: changing which hyperparameters are tensors, or their dtypes, compiles nothing new."""
    seen = set()
    real = sp._program_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                kinds = tuple(a.dtype if isinstance(a, torch.Tensor) else type(a) for a in args)
                seen.add((kinds, tuple(sorted(kwargs.items()))))
                return real[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(sp, "_program_kernel", Recorder())
    monkeypatch.setattr(sp, "_COMPILED", {})  # every launch through the dispatch (CUDA)
    P._PROGRAMS.clear()
    t = lambda v, dt=torch.float32: torch.tensor(v, dtype=dt, device=program_device)  # noqa: E731
    sgd = get_rule("sgd")
    for rule, hp, step in (
        (get_rule("adamw"), {"lr": t(1e-3)}, t(3, torch.int64)),
        (get_rule("adamw"), {"lr": t(1e-3, torch.float64), "betas": (t(0.9, torch.bfloat16), 0.99)}, 5),
        (sgd, {"lr": t(1e-2), "momentum": t(0.9), "dampening": t(0.1)}, t(2, torch.int32)),
        (get_rule("lion"), {"lr": t(1e-4, torch.float16)}, 7),
    ):
        assert _program(rule, rule.make_hparams(hp), step) is not None
    assert len(seen) == 1, seen


def test_replace_hparam_tensors_keeps_hparam_tensors_order():
    """The tensors of a rule's hyperparameters, the step and max_unorm replaced in hparam_tensors' order (the
    original left as it was); a mapping holding tensors is refused rather than misaligned."""
    from bnbf._host_checks import replace_hparam_tensors

    rule = get_rule("adamw")
    lr, b1, step = torch.tensor(1e-3), torch.tensor(0.9), torch.tensor(4)
    h = rule.make_hparams({"lr": lr, "betas": (b1, 0.999)})
    found = hparam_tensors(h, step, 0.0)
    h2, s2, u2 = replace_hparam_tensors(h, step, 0.0, iter(["a", "b", "c"]))
    assert [n for n, _ in found] == ["lr", "betas[0]", "step"]
    assert (h2.lr, h2.betas, s2, u2) == ("a", ("b", 0.999), "c", 0.0)
    assert h.lr is lr and h.betas[0] is b1
    with pytest.raises(TypeError, match="cannot be replaced"):
        replace_hparam_tensors({"lr": lr}, step, 0.0, iter(["a", "b"]))
    assert replace_hparam_tensors({"lr": 1e-3}, 3, 0.0, iter([])) == ({"lr": 1e-3}, 3, 0.0)

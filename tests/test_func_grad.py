"""Derivatives through the step: ``bnbf.update(..., differentiable=True)``, and a clear error otherwise.

- Without ``differentiable=True`` (and for 8-bit state, or ``update_``, always) every way of asking for a
  derivative through the step raises RuntimeError naming the option: eager autograd, torch.func's grad, vjp,
  jacrev and jvp, and forward-mode duals; never a silent zero. Normal loops are not affected: leaves that
  require grad stepped under ``torch.no_grad()`` and ``update_`` of ``nn.Parameter`` leaves.
- With it (plain torch on every path, so in the plain pass only), for every row of the optimizer table
  (every registered rule, tests/optim_table.py): derivatives of two steps with respect to the param, both
  grads, the states and every float hyperparameter (0-d float64 tensors) checked against finite differences in
  float64 by ``torch.autograd.gradcheck`` (reverse and forward mode), torch.func's grad and jvp equal to those,
  a meta-gradient through a three-step training loop against central differences, and the float32 step equal
  bit for bit to the non-differentiable reference step.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import triton_mode
from optim_table import ROW_IDS, ROWS
from torch.utils._pytree import tree_map

import bnbf

F64 = torch.float64
# the differentiable step is plain torch on every path: the interpreter pass would run the same code again
_plain_only = pytest.mark.skipif(triton_mode(), reason="plain torch on every path; runs in the plain pass")


def _float_fields(rule, hp: dict) -> dict:
    """The rule's hparams from the row, with weight decay switched on and every float field (and each float of
    a tuple) a 0-d float64 tensor requiring grad: the inputs a meta-gradient is taken with respect to."""
    h = dict(hp)
    if "weight_decay" in {f.name for f in dataclasses.fields(rule.hparams)}:
        h["weight_decay"] = 0.03
    full = dataclasses.asdict(rule.make_hparams(h))
    out = {}
    for k, v in full.items():
        if type(v) is float and v != 0.0:
            out[k] = _tensor(v)
        elif type(v) is tuple and all(type(x) is float for x in v):
            out[k] = tuple(map(_tensor, v))
        else:
            out[k] = v  # a flag, a step count, or 0.0 (which may decide the state slots; a difference would leave
            # the valid range)
    return out


def _tensor(v: float) -> torch.Tensor:
    # finite differences step 1e-6: eps-like values raised to 1e-3 stay valid (and matter) on both sides
    return torch.tensor(max(v, 1e-3), dtype=F64, requires_grad=True)


def _leaves(hp: dict) -> list:
    return [t for v in hp.values() for t in (v if type(v) is tuple else (v,)) if isinstance(t, torch.Tensor)]


def _rebuild(hp: dict, values: list) -> dict:
    it = iter(values)
    out = {}
    for k, v in hp.items():
        if type(v) is tuple and v and isinstance(v[0], torch.Tensor):
            out[k] = tuple(next(it) for _ in v)
        elif isinstance(v, torch.Tensor):
            out[k] = next(it)
        else:
            out[k] = v
    return out


def _state64(row, hp: dict, n: int):
    plain = lambda x: float(x.detach()) if isinstance(x, torch.Tensor) else x
    detached = {k: (tuple(map(plain, v)) if type(v) is tuple else plain(v)) for k, v in hp.items()}
    s = bnbf.init_state(torch.zeros(n), bnbf.OptimSpec(rule=row.name, state_bits=32), detached)
    return tree_map(lambda t: t.double(), s), detached


def _two_steps(row, hp: dict, n: int = 3):
    """f(p, g1, g2, *states, *hparams) -> (p after two steps, *its states), and the inputs (float64)."""
    state, _ = _state64(row, hp, n)
    gen = torch.Generator().manual_seed(hash(row.id) % 2**31)
    p = torch.randn(n, generator=gen, dtype=F64)
    g1, g2 = (torch.randn(n, generator=gen, dtype=F64) for _ in range(2))
    # a nonzero state, so its derivative is not taken at the kinks of a zero second moment
    s0 = [(torch.rand(n, generator=gen, dtype=F64) + 0.5) * 0.1 for _ in state]
    hps = _leaves(hp)

    def f(p, g1, g2, *rest):
        st = type(state)._make(rest[: len(s0)])
        h = _rebuild(hp, list(rest[len(s0) :]))
        p1, s1 = bnbf.update(p, g1, st, h, 1, differentiable=True)
        p2, s2 = bnbf.update(p1, g2, s1, h, 2, differentiable=True)
        return (p2, *s2)

    inputs = [x.requires_grad_() for x in (p, g1, g2, *s0)] + hps
    return f, inputs, 3 + len(s0)


@_plain_only
@pytest.mark.parametrize("row", ROWS, ids=ROW_IDS)
def test_gradcheck_two_steps(row):
    """Reverse and forward mode against finite differences (float64), w.r.t. every input."""
    rule = bnbf.RULES[row.name]
    hp = _float_fields(rule, row.hparams)
    f, inputs, _ = _two_steps(row, hp)
    assert torch.autograd.gradcheck(f, inputs, check_forward_ad=True, check_batched_grad=False)


def test_every_rule_has_a_row():
    assert {r.name for r in ROWS} == set(bnbf.RULES)


@_plain_only
@pytest.mark.parametrize("row", ROWS, ids=ROW_IDS)
def test_func_grad_and_jvp_equal_autograd(row):
    """torch.func.grad (w.r.t. the param and the hyperparameters) and torch.func.jvp equal eager autograd,
    which gradcheck tied to finite differences."""
    rule = bnbf.RULES[row.name]
    hp = _float_fields(rule, row.hparams)
    f, inputs, first_hp = _two_steps(row, hp)
    weight = torch.linspace(0.5, 1.5, inputs[0].numel(), dtype=F64)
    scalar = lambda *xs: (f(*xs)[0] * weight).sum()
    expected = torch.autograd.grad(scalar(*inputs), inputs, allow_unused=True)
    expected = [torch.zeros_like(x) if e is None else e for x, e in zip(inputs, expected)]
    plain = [x.detach() for x in inputs]
    argnums = (0, *range(first_hp, len(plain)))  # the param and the hyperparameters
    got = torch.func.grad(scalar, argnums=argnums)(*plain)
    for i, gi in zip(argnums, got):
        torch.testing.assert_close(gi, expected[i], rtol=1e-10, atol=1e-12)
    tangents = [torch.linspace(-1, 1, x.numel(), dtype=F64).reshape(x.shape) for x in plain]
    _, jv = torch.func.jvp(scalar, tuple(plain), tuple(tangents))
    torch.testing.assert_close(jv, sum((e * t).sum() for e, t in zip(expected, tangents)), rtol=1e-10, atol=1e-12)


@_plain_only
@pytest.mark.parametrize("row", ROWS, ids=ROW_IDS)
def test_meta_gradient_of_lr_through_training(row):
    """d(loss after 3 steps)/d(lr), the grads taken by torch.func.grad inside the loop, against a central
    difference of the whole loop in float64."""
    rule = bnbf.RULES[row.name]
    base = {k: (tuple(float(x) for x in v) if type(v) is tuple else v) for k, v in row.hparams.items()}
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, 4, generator=gen, dtype=F64)
    y = x @ torch.randn(4, generator=gen, dtype=F64)
    p0 = torch.randn(4, generator=gen, dtype=F64)
    loss = lambda p: ((x @ p - y) ** 2).mean()
    s0 = tree_map(
        lambda t: t.double(), bnbf.init_state(torch.zeros(4), bnbf.OptimSpec(rule=row.name, state_bits=32), base)
    )
    lr0 = float(rule.make_hparams(base).lr)

    def run(lr):
        p, s = p0, s0
        for t in (1, 2, 3):
            p, s = bnbf.update(p, torch.func.grad(loss)(p), s, {**base, "lr": lr}, t, differentiable=True)
        return loss(p)

    got = torch.func.grad(run)(torch.tensor(lr0, dtype=F64))
    h = lr0 * 1e-4
    fd = (run(torch.tensor(lr0 + h, dtype=F64)) - run(torch.tensor(lr0 - h, dtype=F64))) / (2 * h)
    assert got != 0
    torch.testing.assert_close(got, fd, rtol=1e-5, atol=1e-9)


@_plain_only
@pytest.mark.parametrize("row", ROWS, ids=ROW_IDS)
def test_non_finite_grad_elements_leave_finite_derivatives(row):
    """A non-finite grad element keeps its param element and is left out of the norms, so the other elements step
    as a tensor of them alone would: the derivatives of the step with respect to the param, the finite grads and
    every float hyperparameter are those of that smaller step, and the kept elements' are the identity's (not
    0 · inf = NaN through the discarded step)."""
    rule = bnbf.RULES[row.name]
    hp = _float_fields(rule, row.hparams)
    state, _ = _state64(row, hp, 6)
    gen = torch.Generator().manual_seed(3)
    p = torch.randn(6, generator=gen, dtype=F64)
    g = torch.randn(6, generator=gen, dtype=F64)
    g[[1, 4]] = torch.tensor([float("inf"), float("nan")], dtype=F64)
    keep = torch.tensor([0, 2, 3, 5])
    small = type(state)._make(t[keep] for t in state)
    weight = torch.linspace(0.5, 1.5, 6, dtype=F64)
    hps = _leaves(hp)

    def loss(p, g, st, w, *hs):
        new_p, _ = bnbf.update(p, g, st, _rebuild(hp, list(hs)), 1, differentiable=True)
        return (new_p * w).sum()

    def grads(p, g, st, w):
        p, g = p.clone().requires_grad_(), g.clone().requires_grad_()
        out = torch.autograd.grad(loss(p, g, st, w, *hps), [p, g, *hps], allow_unused=True)
        return [torch.zeros_like(x) if d is None else d for x, d in zip([p, g, *hps], out)]

    got, want = grads(p, g, state, weight), grads(p[keep], g[keep], small, weight[keep])
    torch.testing.assert_close(got[0][keep], want[0], rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(got[0][[1, 4]], weight[[1, 4]], rtol=0, atol=0)
    torch.testing.assert_close(got[1][keep], want[1], rtol=1e-12, atol=1e-15)
    assert torch.equal(got[1][[1, 4]], torch.zeros(2, dtype=F64))
    for a, b in zip(got[2:], want[2:]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)


@_plain_only
@pytest.mark.parametrize("row", ROWS, ids=ROW_IDS)
def test_a_tensor_step_is_a_float64_step_as_an_int_is(row):
    """float64 params step in float64 throughout with a 0-d integer tensor step too (its powers of a beta would be
    float32): the same params, states and meta-gradients as the Python int step."""
    rule = bnbf.RULES[row.name]
    hp = _float_fields(rule, row.hparams)
    f_int, inputs, first_hp = _two_steps(row, hp)

    def f_tensor(p, g1, g2, *rest):
        st = type(_state64(row, hp, 3)[0])._make(rest[: first_hp - 3])
        h = _rebuild(hp, list(rest[first_hp - 3 :]))
        p1, s1 = bnbf.update(p, g1, st, h, torch.tensor(1), differentiable=True)
        p2, s2 = bnbf.update(p1, g2, s1, h, torch.tensor(7), differentiable=True)
        return (p2, *s2)

    def f_seven(p, g1, g2, *rest):
        st = type(_state64(row, hp, 3)[0])._make(rest[: first_hp - 3])
        h = _rebuild(hp, list(rest[first_hp - 3 :]))
        p1, s1 = bnbf.update(p, g1, st, h, 1, differentiable=True)
        p2, s2 = bnbf.update(p1, g2, s1, h, 7, differentiable=True)
        return (p2, *s2)

    for a, b in zip(f_tensor(*inputs), f_seven(*inputs)):
        assert torch.equal(a, b)
    lr = inputs[first_hp]
    got = torch.autograd.grad(f_tensor(*inputs)[0].sum(), lr)
    want = torch.autograd.grad(f_seven(*inputs)[0].sum(), lr)
    assert torch.equal(got[0], want[0])


@_plain_only
@pytest.mark.parametrize("row", ROWS, ids=ROW_IDS)
def test_float32_tensor_hyperparameters_step_as_their_numbers(row):
    """float32 params with every float hyperparameter a float32 0-d tensor requiring grad and a tensor step: the
    scalars are computed in float64 as from the same numbers, so the params and states equal the number steps bit
    for bit (computed in float32, 1 - beta2**t alone would lose digits)."""
    rule = bnbf.RULES[row.name]
    tensors = {}
    for k, v in _float_fields(rule, row.hparams).items():
        f32 = lambda t: torch.tensor(float(t.detach()), dtype=torch.float32, requires_grad=True)  # noqa: E731
        tensors[k] = tuple(map(f32, v)) if type(v) is tuple else f32(v) if isinstance(v, torch.Tensor) else v
    numbers = {k: tree_map(lambda t: t.item() if isinstance(t, torch.Tensor) else t, v) for k, v in tensors.items()}
    gen = torch.Generator().manual_seed(5)
    p0 = torch.randn(257, generator=gen)
    grads = [torch.randn(257, generator=gen) for _ in range(3)]
    state0 = bnbf.init_state(p0, bnbf.OptimSpec(rule=row.name, state_bits=32), numbers)
    out = []
    for hp, as_tensor in ((numbers, False), (tensors, True)):
        p, s = p0, state0
        for k, g in enumerate(grads, start=1):
            p, s = bnbf.update(p, g, s, hp, torch.tensor(k * 1000) if as_tensor else k * 1000, differentiable=True)
        out.append((p, s))
    for a, b in zip(torch.utils._pytree.tree_leaves(out[0]), torch.utils._pytree.tree_leaves(out[1])):
        assert torch.equal(a.detach(), b.detach())
    assert torch.autograd.grad(out[1][0].sum(), tensors["lr"])[0].isfinite()


@pytest.mark.parametrize("row", ROWS, ids=ROW_IDS)
def test_float32_equals_the_reference_step(row):
    """In float32 the differentiable step is the reference path's step, bit for bit (one implementation)."""
    if bnbf.use_triton(torch.zeros(1)):
        pytest.skip("the plain reference path runs only without TRITON_INTERPRET")
    gen = torch.Generator().manual_seed(2)
    p = {n: torch.randn(*shape, generator=gen) for n, shape in (("a", (3, 5)), ("b", (257,)))}
    g = {n: torch.randn(t.shape, generator=gen) for n, t in p.items()}
    g["b"][3] = float("nan")
    state = bnbf.init_state(p, bnbf.OptimSpec(rule=row.name, state_bits=32), row.hparams)
    for step in (1, 2):
        want = bnbf.update(p, g, state, row.hparams, step)
        got = bnbf.update(p, g, state, row.hparams, step, differentiable=True)
        for a, b in zip(torch.utils._pytree.tree_leaves(want), torch.utils._pytree.tree_leaves(got)):
            assert torch.equal(a, b)
        p, state = want


# torch.optim's own differentiable steps, where they are a faithful reference: its SGD with momentum detaches
# the first momentum buffer (grad.detach().clone(), so its derivative misses the first grad's dependence; ours
# is checked against finite differences above), and its amsgrad and centered RMSprop steps raise ("modified by
# an inplace operation") when the grads depend on the params
TORCH_DIFFERENTIABLE = [
    "adam",
    "adamw",
    "sgd-plain",
    "rmsprop-plain",
    "rmsprop-momentum",
    "adagrad-plain",
    "adagrad-decay",
]


@_plain_only
@pytest.mark.parametrize("row", [r for r in ROWS if r.id in TORCH_DIFFERENTIABLE], ids=str)
def test_in_place_differentiable_matches_torch_optim(row):
    """``update_(..., differentiable=True)`` is torch.optim's ``differentiable=True``: three in-place steps with
    grads that depend on the params, d(loss)/d(initial params) (and d/d(lr) where torch takes a tensor lr) equal
    to torch.optim's, all in float64."""
    gen = torch.Generator().manual_seed(3)
    p0 = torch.randn(5, generator=gen, dtype=F64, requires_grad=True)
    grads = [torch.randn(5, generator=gen, dtype=F64) for _ in range(3)]
    w = torch.randn(5, generator=gen, dtype=F64)
    tensor_lr = row.name.startswith("adam")  # torch's RMSprop and Adagrad take no tensor lr here
    lr = torch.tensor(0.01, dtype=F64, requires_grad=True) if tensor_lr else 0.01
    hp = {k: v for k, v in row.hparams.items() if k != "lr"}
    wrt = (p0, lr) if tensor_lr else (p0,)

    p = p0.clone()
    default = torch.get_default_dtype()
    torch.set_default_dtype(F64)  # torch.optim then counts steps in float64 (else its bias corrections are float32)
    try:
        opt = row.torch_cls([p], lr=lr, differentiable=True, **hp, **row.torch_kwargs)
        for g in grads:
            p.grad = g + 0.5 * p
            opt.step()
    finally:
        torch.set_default_dtype(default)
    want = torch.autograd.grad((p * w).sum(), wrt)

    q = p0.clone()
    s32 = bnbf.init_state(torch.zeros(5), bnbf.OptimSpec(rule=row.name, state_bits=32), row.hparams)
    rule = bnbf.RULES[row.name]
    # the initial values in float64 (Adagrad's initial_accumulator_value=0.1 in float32 is 1.5e-9 off)
    initial = [v for v, keep in zip(rule.initial_values(rule.make_hparams(row.hparams)), _kept(type(s32))) if keep]
    state = type(s32)._make(torch.full((5,), float(v), dtype=F64) for v in initial)
    for t, g in enumerate(grads, 1):
        bnbf.update_(q, g + 0.5 * q, state, {**hp, "lr": lr}, t, differentiable=True)
    torch.testing.assert_close(q, p, rtol=1e-12, atol=1e-14)
    for a, b in zip(torch.autograd.grad((q * w).sum(), wrt), want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def _kept(state_class) -> list[bool]:
    return [bool((state_class.layout.present >> j) & 1) for j in range(len(bnbf.RULES[state_class.layout.rule].states))]


# ---- refusals -----------------------------------------------------------------------------------------------


def _setup(bits: int = 32):
    p = torch.randn(300)
    g = torch.randn(300)
    s = bnbf.init_state(p, bnbf.OptimSpec(rule="adamw", state_bits=bits, min_8bit_size=0))
    return p, g, s


ASKS = {
    "eager lr": lambda p, g, s, up: up(p, g, s, {"lr": torch.tensor(0.1, requires_grad=True)}, 1),
    "eager beta": lambda p, g, s, up: up(p, g, s, {"betas": (torch.tensor(0.9, requires_grad=True), 0.99)}, 1),
    # betas as a list (a JSON or YAML config's): its tensors were not looked at, and the step gave a zero derivative
    "eager beta in a list": lambda p, g, s, up: up(
        p, g, s, {"betas": [0.9, torch.tensor(0.99, requires_grad=True)]}, 1
    ),
    "func.grad beta in a list": lambda p, g, s, up: torch.func.grad(
        lambda b: up(p, g, s, {"betas": [0.9, b]}, 1)[0].sum()
    )(torch.tensor(0.99)),
    "eager grad": lambda p, g, s, up: up(p, g.clone().requires_grad_(), s, {"lr": 0.1}, 1),
    "eager param with history": lambda p, g, s, up: up(p.clone().requires_grad_() * 1.0, g, s, {"lr": 0.1}, 1),
    "compiled grad": lambda p, g, s, up: torch.compile(
        lambda q: up(p, q, s, {"lr": 0.1}, 1), backend="eager", fullgraph=True
    )(g.clone().requires_grad_()),
    "func.grad lr": lambda p, g, s, up: torch.func.grad(lambda lr: up(p, g, s, {"lr": lr}, 1)[0].sum())(
        torch.tensor(0.1)
    ),
    "func.grad param": lambda p, g, s, up: torch.func.grad(lambda q: up(q, g, s, {"lr": 0.1}, 1)[0].sum())(p.clone()),
    "func.grad grad": lambda p, g, s, up: torch.func.grad(lambda q: up(p, q, s, {"lr": 0.1}, 1)[0].sum())(g),
    "func.vjp param": lambda p, g, s, up: torch.func.vjp(lambda q: up(q, g, s, {"lr": 0.1}, 1)[0], p.clone()),
    "func.jacrev lr": lambda p, g, s, up: torch.func.jacrev(lambda lr: up(p, g, s, {"lr": lr}, 1)[0])(
        torch.tensor(0.1)
    ),
    "func.jvp lr": lambda p, g, s, up: torch.func.jvp(
        lambda lr: up(p, g, s, {"lr": lr}, 1)[0], (torch.tensor(0.1),), (torch.tensor(1.0),)
    ),
    "func.jvp param": lambda p, g, s, up: torch.func.jvp(lambda q: up(q, g, s, {"lr": 0.1}, 1)[0], (p.clone(),), (g,)),
    "forward-AD dual lr": lambda p, g, s, up: _dual(lambda lr: up(p, g, s, {"lr": lr}, 1)),
    # vmap's batched wrappers hide what they batch: a gradient through vmap(update) gave zeros
    "func.grad param through vmap": lambda p, g, s, up: torch.func.grad(
        lambda q: torch.func.vmap(lambda a, b, c: up(a, b, c, {"lr": 0.1}, 1)[0])(q, *_two(g, s)).sum()
    )(_two(p)[0]),
    "eager param with history through vmap": lambda p, g, s, up: torch.func.vmap(
        lambda a, b, c: up(a, b, c, {"lr": 0.1}, 1)
    )(_two(p)[0].requires_grad_() * 1.0, *_two(g, s)),
    # a state field is an input too: a gradient with respect to one gave zeros
    "func.grad state": lambda p, g, s, up: torch.func.grad(
        lambda f: up(p, g, _with_field(s, f), {"lr": 0.1}, 1)[0].sum()
    )(s[_float_field(s)].clone()),
    # traced by torch.compile, torch.func.grad's tensors do not show requires_grad: the transform is seen
    "compiled func.grad param": lambda p, g, s, up: torch.compile(
        lambda q: torch.func.grad(lambda x: up(x, g, s, {"lr": 0.1}, 1)[0].sum())(q), backend="eager", fullgraph=True
    )(p.clone()),
    # traced, a param with history was stepped in place (its history silently kept): refused as eagerly
    "compiled param with history": lambda p, g, s, up: torch.compile(
        lambda q: up(q * 1.0, g, s, {"lr": 0.1}, 1), backend="eager", fullgraph=True
    )(p.clone().requires_grad_()),
    "compiled lr": lambda p, g, s, up: torch.compile(
        lambda lr: up(p, g, s, {"lr": lr}, 1), backend="eager", fullgraph=True
    )(torch.tensor(0.1, requires_grad=True)),
    # ... also where the innermost transform is vmap (the transforms below it are looked at): this gave zeros
    "compiled func.grad param through vmap": lambda p, g, s, up: torch.compile(
        lambda q: torch.func.grad(
            lambda x: torch.func.vmap(lambda a, b, c: up(a, b, c, {"lr": 0.1}, 1)[0])(x, *_two(g, s)).sum()
        )(q),
        backend="eager",
        fullgraph=True,
    )(_two(p)[0]),
}


def _two(*xs):
    """Each of ``xs`` (a tensor or a state) stacked twice: a two-member ensemble for vmap."""
    two = lambda t: torch.stack([t, t])
    return tuple(type(x)._make(map(two, x)) if isinstance(x, tuple) else two(x) for x in xs)


def _float_field(s) -> int:
    return next(i for i, t in enumerate(s) if t.is_floating_point())


def _with_field(s, f):
    return type(s)._make(f if i == _float_field(s) else t for i, t in enumerate(s))


def _dual(fn):
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        return fn(fwAD.make_dual(torch.tensor(0.1), torch.tensor(1.0)))


def _in_place(p, g, s, h, step, **kw):
    return bnbf.update_(p, g, s, h, step, **kw)


@_plain_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("how", ["update", "update_", "updates", "schedule"])
def test_max_grad_norm_with_differentiable_scales_16bit_grads_as_the_default_step(dtype, how):
    """The default step scales a 16-bit grad by max_grad_norm's factor as it loads it (in float32); the
    differentiable step multiplied in the grad's dtype first, rounding the clipped grad: Adam's exp_avg_sq 0.7%
    off in bfloat16, bf16 SGD params apart after three steps. Now the same values (the reference path)."""
    gen = torch.Generator().manual_seed(4)
    params = {"a": torch.randn(300, generator=gen).to(dtype), "b": torch.randn(7, generator=gen).to(dtype)}
    hp = {"lr": 0.05, "momentum": 0.9}
    if how == "schedule":
        hp = {"lr": lambda step: 0.05 / step, "momentum": 0.9}
    state0 = bnbf.init_state(params, bnbf.OptimSpec(rule="sgd", state_bits=32), {"momentum": 0.9})
    out = []
    for differentiable in (False, True):
        p, s = dict(params), state0
        if how == "update_":
            p, s = {k: v.clone() for k, v in p.items()}, tree_map(torch.clone, s)
        for t in (1, 2, 3):
            g = {
                k: (torch.randn(v.shape, generator=torch.Generator().manual_seed(t)) * 3).to(dtype)
                for k, v in p.items()
            }
            kw = {"max_grad_norm": 0.5, "differentiable": differentiable}
            if how == "update_":
                bnbf.update_(p, g, s, hp, t, **kw)
            elif how == "updates":
                u, s = bnbf.updates(p, g, s, hp, t, **kw)
                p = bnbf.apply_updates(p, u)
            else:
                p, s = bnbf.update(p, g, s, hp, t, **kw)
        out.append((p, s))
    for a, b in zip(torch.utils._pytree.tree_leaves(out[0]), torch.utils._pytree.tree_leaves(out[1])):
        assert torch.equal(a, b.detach())


@pytest.mark.parametrize("bits", [32, 8])
@pytest.mark.parametrize("pure", [True, False], ids=["update", "update_"])
@pytest.mark.parametrize("ask", list(ASKS))
def test_asking_for_a_gradient_raises(ask, pure, bits):
    if ask in ("eager grad", "compiled grad") and not pure:
        pytest.skip("update_ detaches grads that require grad, as torch.optim does (test_update__detaches_grads)")
    p, g, s = _setup(bits)
    before = [t.clone() for t in (p, g, *s)]
    up = bnbf.update if pure else _in_place
    with pytest.raises(RuntimeError, match="not differentiable") as info:
        ASKS[ask](p, g, s, up)
    msg = str(info.value)
    assert "differentiable=True" in msg
    if bits == 8:
        assert "32-bit" in msg
    if not pure:
        assert "update_" in msg
    for a, b in zip(before, (p, g, *s)):  # nothing written
        assert torch.equal(a, b)


@_plain_only
@pytest.mark.parametrize("rule", ["adamw", "lion", "adan"])
def test_betas_in_a_list_step_and_differentiate_as_a_tuple(rule):
    """A list of betas holding float32 tensors is widened to float64 as a tuple is (it stepped in float32: values
    1.2e-6 off after three steps), and its derivative is the tuple's."""
    gen = torch.Generator().manual_seed(3)
    p0 = torch.randn(257, generator=gen)
    grads = [torch.randn(257, generator=gen) for _ in range(3)]
    numbers = dataclasses.asdict(bnbf.RULES[rule].hparams())["betas"]
    state0 = bnbf.init_state(p0, bnbf.OptimSpec(rule=rule, state_bits=32))
    out = {}
    for form in (tuple, list):
        betas = form(torch.tensor(b, dtype=torch.float32, requires_grad=True) for b in numbers)
        p, s = p0, state0
        for k, g in enumerate(grads, start=1):
            p, s = bnbf.update(p, g, s, {"lr": 0.01, "betas": betas}, k, differentiable=True)
        out[form] = (p, torch.autograd.grad(p.sum(), betas))
    p, s = p0, state0
    for k, g in enumerate(grads, start=1):
        p, s = bnbf.update(p, g, s, {"lr": 0.01, "betas": tuple(float(torch.tensor(b)) for b in numbers)}, k)
    assert torch.equal(out[list][0].detach(), p)
    assert torch.equal(out[list][0].detach(), out[tuple][0].detach())
    for a, b in zip(out[list][1], out[tuple][1]):
        assert torch.equal(a, b)


def test_update__detaches_grads():
    """Grads that require grad (``backward(create_graph=True)``) are stepped detached by ``update_``, as by
    torch.optim's steps: the same result as detached grads."""
    p, g, s = _setup(8)
    p2, s2 = p.clone(), tuple(t.clone() for t in s)
    bnbf.update_(p, g.clone().requires_grad_(), s, {"lr": 0.1}, 1)
    bnbf.update_(p2, g, type(s)._make(s2), {"lr": 0.1}, 1)
    assert torch.equal(p, p2) and all(torch.equal(a, b) for a, b in zip(s, s2))


def test_compiled_update__detaches_grads():
    """Traced by torch.compile, ``update_`` takes a grad that requires grad detached, as eagerly (it refused it)."""
    p, g, s = _setup(8)
    p2, s2 = p.clone(), type(s)._make(t.clone() for t in s)
    step = torch.compile(lambda p, g, s: bnbf.update_(p, g, s, {"lr": 0.1}, 1), backend="aot_eager", fullgraph=True)
    step(p, g.clone().requires_grad_(), s)
    bnbf.update_(p2, g, s2, {"lr": 0.1}, 1)
    assert not torch.equal(p, g) and torch.equal(p, p2) and all(torch.equal(a, b) for a, b in zip(s, s2))


def test_a_leaf_param_is_refused_by_the_pure_step_under_grad_mode():
    p, g, s = _setup()
    with pytest.raises(RuntimeError, match="param takes part in a gradient computation"):
        bnbf.update(p.clone().requires_grad_(), g, s, {"lr": 0.1}, 1)


def test_normal_loops_keep_working():
    """Leaves requiring grad under no_grad (pure and in place), update_ of nn.Parameters with grad mode on,
    0-d tensor hyperparameters that do not require grad."""
    p, g, s = _setup()
    leaf = torch.nn.Parameter(p.clone())
    with torch.no_grad():
        new, _ = bnbf.update(leaf, g, s, {"lr": torch.tensor(0.1)}, 1)
    assert not new.requires_grad
    s8 = bnbf.init_state(leaf, bnbf.OptimSpec(rule="adamw", min_8bit_size=0))
    params = {"w": leaf}
    bnbf.update_(params, {"w": g}, {"w": s8}, {"lr": 0.1}, 1)  # grad mode on
    bnbf.update_(params, {"w": g}, {"w": s8}, {"lr": torch.tensor(0.1)}, 2)
    opt = bnbf.plan(params, {"w": s8})
    opt.step({"w": g}, {"lr": torch.tensor(0.1)}, 3)
    assert leaf.requires_grad and leaf.is_leaf and not torch.equal(leaf, p)
    with torch.no_grad():
        bnbf.update_(params, {"w": g}, {"w": s8}, {"lr": torch.tensor(0.1, requires_grad=True)}, 4)


def test_plan_refuses_a_hyperparameter_that_requires_grad():
    p, g, s = _setup(8)
    opt = bnbf.plan([p], [s])
    before = p.clone()
    with pytest.raises(RuntimeError, match="lr takes part"):
        opt.step([g], {"lr": torch.tensor(0.1, requires_grad=True)}, 1)
    assert torch.equal(p, before)


def test_differentiable_refusals():
    p, g, s8 = _setup(8)
    with pytest.raises(ValueError, match="differentiable=True needs 32-bit state"):
        bnbf.update(p, g, s8, {"lr": 0.1}, 1, differentiable=True)
    with pytest.raises(ValueError, match="differentiable=True needs 32-bit state"):
        bnbf.update_(p, g, s8, {"lr": 0.1}, 1, differentiable=True)
    p, g, s = _setup()
    leaf = p.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):  # torch's own error, as torch.optim
        bnbf.update_(leaf, g, s, {"lr": 0.1}, 1, differentiable=True)
    with pytest.raises(TypeError, match="differentiable must be a bool"):
        bnbf.update(p, g, s, {"lr": 0.1}, 1, differentiable=1)
    with pytest.raises(ValueError, match="Invalid learning rate: -1.0"):
        bnbf.update(p, g, s, {"lr": torch.tensor(-1.0, requires_grad=True)}, 1, differentiable=True)


@_plain_only
def test_max_grad_norm_with_differentiable():
    """``max_grad_norm`` under ``differentiable=True`` clips (it was once ignored there): the float32 step
    equals the fused clipped step up to the norm's summation order, and in float64 the derivative through the
    clipping matches finite differences."""
    from tolerances import SAME_MATH

    def tuple_clone(tree):
        return tree_map(lambda t: t.clone(), tree)

    torch.manual_seed(0)
    params = {"a": torch.randn(3, 5), "b": torch.randn(7)}
    grads = {"a": torch.randn(3, 5) * 4, "b": torch.randn(7)}
    spec = bnbf.OptimSpec(rule="adamw", state_bits=32)
    hp = {"lr": 0.1, "weight_decay": 0.0}
    # moments from a first step with other grads: Adam's first step alone does not see the grads' scale
    _, state = bnbf.update(
        params, {k: torch.randn_like(g) for k, g in grads.items()}, bnbf.init_state(params, spec), hp, 1
    )
    want, _ = bnbf.update(params, grads, state, hp, 2, max_grad_norm=0.5)
    got, _ = bnbf.update(params, grads, state, hp, 2, max_grad_norm=0.5, differentiable=True)
    unclipped, _ = bnbf.update(params, grads, state, hp, 2, differentiable=True)
    inplace = {k: v.clone() for k, v in params.items()}
    bnbf.update_(inplace, grads, tuple_clone(state), hp, 2, max_grad_norm=0.5, differentiable=True)
    for k in params:
        torch.testing.assert_close(got[k], want[k], atol=SAME_MATH.atol, rtol=SAME_MATH.rtol)
        torch.testing.assert_close(inplace[k], want[k], atol=SAME_MATH.atol, rtol=SAME_MATH.rtol)
    assert not torch.allclose(got["a"], unclipped["a"], atol=1e-3)  # the clipping took effect

    p64 = {k: v.double() for k, v in params.items()}
    g64 = {k: v.double() for k, v in grads.items()}
    s1 = tree_map(lambda t: t.double(), state)  # float32 state built for the float32 params, in float64

    def second_step(ga):  # moments from a first step, so the update is not only the grads' sign
        out, _ = bnbf.update(p64, {"a": ga, "b": g64["b"]}, s1, hp, 2, max_grad_norm=0.5, differentiable=True)
        return out["a"]

    assert torch.autograd.gradcheck(second_step, (g64["a"].clone().requires_grad_(),))
    with pytest.raises(ValueError, match="Invalid max_grad_norm value: -1.0"):
        bnbf.update(params, grads, state, hp, 1, max_grad_norm=-1.0, differentiable=True)


def test_vmap_of_meta_gradients_over_learning_rates_equals_a_loop():
    """Per-member meta-gradients, ``vmap(grad(meta_loss))(lrs)``, through ``differentiable=True``: the batched lr is
    not read as a number (``item()`` cannot read a batched tensor), and each member's gradient is the loop's."""
    torch.manual_seed(0)
    p, g = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    s = bnbf.init_state(torch.zeros(8), bnbf.OptimSpec(rule="adamw", state_bits=32))
    s = type(s)._make(t.double() for t in s)
    lrs = torch.tensor([0.01, 0.05, 0.1], dtype=torch.float64)

    def meta_loss(lr):
        q, _ = bnbf.update(p, g, s, {"lr": lr, "betas": (0.9, 0.99)}, 3, differentiable=True)
        return (q**2).sum()

    loop = torch.stack([torch.func.grad(meta_loss)(lr) for lr in lrs])
    torch.testing.assert_close(torch.func.vmap(torch.func.grad(meta_loss))(lrs), loop, rtol=1e-12, atol=0)
    steps = torch.func.vmap(lambda lr: bnbf.update(p, g, s, {"lr": lr}, 1, differentiable=True)[0])(lrs)
    torch.testing.assert_close(
        steps, torch.stack([bnbf.update(p, g, s, {"lr": lr}, 1, differentiable=True)[0] for lr in lrs])
    )


def _stacked_rows_steps(compiled: bool, history: bool):
    """Two differentiable in-place AdEMAMix steps on a state whose first moments are rows of one tensor (bnbf_nn's
    layout), eager or compiled with ``fullgraph=True``: the params and the gradients of a loss on them."""
    from bnbf.state import relaid

    torch.manual_seed(0)
    s = relaid(bnbf.init_state(torch.randn(300), bnbf.OptimSpec(rule="ademamix", state_bits=32)), ((0, 1), (2,)))
    q0 = torch.randn(300, requires_grad=True)
    g0 = torch.randn(300, requires_grad=history)
    fn = lambda q, g, s: bnbf.update_(q, g, s, {"lr": 0.01}, 1, differentiable=True)  # noqa: E731
    if compiled:
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
    q = q0 * 1.0
    for k in range(2):
        fn(q, g0 * (k + 1), s)
    return q.detach(), torch.autograd.grad((q * q).sum(), (q0, g0) if history else (q0,))


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_differentiable_update__through_stacked_rows():
    """The in-place differentiable step reads view fields through views of their base made under grad mode (eager);
    traced, a view's base is not reachable, so it compiled to an AttributeError. Compiled it equals the eager step;
    with grads that carry a history it is refused in words (the eager step supports it)."""
    want, got = _stacked_rows_steps(False, False), _stacked_rows_steps(True, False)
    assert torch.equal(want[0], got[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=0)
    assert _stacked_rows_steps(False, True)[1][1].abs().sum() > 0  # eager: through the grads too
    with pytest.raises(Exception, match="rows of one tensor") as info:  # noqa: PT011 - Dynamo wraps our error
        _stacked_rows_steps(True, True)
    assert "the eager step supports it" in str(info.value)


def _flat_rows_step(no_grad_views: bool) -> torch.Tensor:
    """A differentiable in-place SGD step of params that are slices of one buffer with a history (a flat layout's
    views), made under grad mode or under no_grad; the gradient of a loss on the buffer after the step."""
    torch.manual_seed(0)
    p0 = torch.randn(10, dtype=torch.float64, requires_grad=True)
    g = torch.randn(10, dtype=torch.float64)
    buf = p0 * 1.0
    with torch.set_grad_enabled(not no_grad_views):
        params = {"a": buf[:4], "b": buf[4:]}
    hp = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.5}
    spec = bnbf.OptimSpec(rule="sgd", state_bits=32)
    s = bnbf.init_state({k: v.detach().float() for k, v in params.items()}, spec, hp)
    s = {k: type(x)._make(t.double() for t in x) for k, x in s.items()}
    bnbf.update_(params, {"a": g[:4], "b": g[4:]}, s, hp, 1, differentiable=True)
    return torch.autograd.grad((buf**2).sum(), p0)[0]


def test_differentiable_update__of_param_views_made_under_no_grad():
    """Params that are views made under no_grad (slices of a flat buffer) are read and written through views of
    their base made under grad mode, as view state fields are: autograd refused the write ("A view was created in
    no_grad mode"); the gradient equals the one through views made under grad mode, and the analytic one."""
    want = _flat_rows_step(False)
    torch.testing.assert_close(_flat_rows_step(True), want, rtol=0, atol=0)
    # p1 = p0 - lr * (g + wd * p0): d/dp0 of sum(p1^2) = 2 * p1 * (1 - lr * wd)
    torch.manual_seed(0)
    p0, g = torch.randn(10, dtype=torch.float64), torch.randn(10, dtype=torch.float64)
    torch.testing.assert_close(want, 2 * (p0 - 0.1 * (g + 0.5 * p0)) * (1 - 0.05))


@pytest.mark.parametrize("bits", [8, 32])
@pytest.mark.parametrize("in_place", [False, True])
def test_a_gradient_through_max_grad_norm_needs_differentiable(bits, in_place):
    """max_grad_norm as a tensor that requires grad, without differentiable=True: the step raises in the words of
    every other refusal (it returned params carrying a gradient, even with 8-bit state), with nothing written."""
    p = torch.randn(64, 4).requires_grad_(False)
    g = torch.randn(64, 4)
    s = bnbf.init_state(p, bnbf.OptimSpec(rule="adamw", state_bits=bits, min_8bit_size=0))
    clip = torch.tensor(0.5, requires_grad=True)
    before = [p.clone(), *[t.clone() for t in s]]
    step = bnbf.update_ if in_place else bnbf.update
    with pytest.raises(RuntimeError, match="max_grad_norm .*" + ("8-bit" if bits == 8 else "differentiable=True")):
        step(p, g, s, {"lr": 0.01}, 1, max_grad_norm=clip)
    assert all(torch.equal(a, b) for a, b in zip([p, *s], before))
    with torch.no_grad():  # no gradient asked: the clip's value is read
        step(p, g, s, {"lr": 0.01}, 1, max_grad_norm=clip)


@pytest.mark.parametrize("hp", ["one mapping", "per leaf"])
@pytest.mark.parametrize("how", ["update", "update_", "torch.func.grad", "torch.compile"])
def test_differentiable_steps_refuse_a_leaf_listed_twice(how, hp):
    """As the plain step: a param listed twice (the same tensor back with two new values, or in place one of its
    steps lost), a state shared by two leaves, or views of one tensor are refused, also where the tensors have no
    address to compare (torch.func's wrappers, values made inside a compiled graph: by identity) and across the
    groups of per-leaf hyperparameters."""
    spec = bnbf.OptimSpec(rule="adamw", state_bits=32)
    hps = {"lr": 0.1} if hp == "one mapping" else (lambda path, p: {"lr": 0.1 if path == "a" else 0.2})
    w, base = torch.randn(300), torch.randn(400)
    g = {"a": torch.randn(300), "b": torch.randn(300)}
    fresh = bnbf.init_state({"a": w, "b": w}, spec)
    cases = [
        ({"a": w, "b": w}, fresh, r"param\['a'\] and param\['b'\] are the same tensor"),
        ({"a": w, "b": w.clone()}, {"a": fresh["a"], "b": fresh["a"]}, r"state\['a'\] and state\['b'\] are the same"),
    ]
    if how not in ("torch.func.grad", "torch.compile"):  # views: only addressable tensors are compared by memory
        cases.append(({"a": base[:300], "b": base[100:]}, fresh, r"overlap in memory"))
    for params, state, match in cases:
        before = [t.clone() for t in (w, base, *fresh["a"], *fresh["b"])]
        with pytest.raises(ValueError, match=match):
            if how == "torch.func.grad":
                keys = list(params)
                same = params[keys[0]] is params[keys[1]]

                def loss(q, params=params, state=state, same=same):
                    tree = {"a": q, "b": q if same else params["b"]}
                    return bnbf.update(tree, g, state, hps, 1, differentiable=True)[0]["a"].sum()

                torch.func.grad(loss)(params["a"])
            elif how == "torch.compile":  # leaves made in the graph (no source): torch 2.11 takes no id() of them
                same = params["a"] is params["b"]

                def traced(q, r, state=state, same=same):
                    q, r = q * 1, r * 1
                    return bnbf.update({"a": q, "b": q if same else r}, g, state, hps, 1, differentiable=True)[0]

                torch._dynamo.reset()
                try:  # fullgraph: the check itself must trace (Dynamo reports the refusal it traced)
                    torch.compile(traced, backend="eager", fullgraph=True)(params["a"], params["b"])
                except torch._dynamo.exc.Unsupported as e:
                    raise ValueError(str(e)) from e
            else:
                getattr(bnbf, how)(params, g, state, hps, 1, differentiable=True)
        assert all(torch.equal(a, b) for a, b in zip(before, (w, base, *fresh["a"], *fresh["b"])))


@pytest.mark.parametrize("rule", ["sgd", "rmsprop", "lars"])
def test_a_derivative_at_a_momentum_that_keeps_no_buffer_is_refused(rule):
    """At momentum 0 the state keeps no buffer and the step does not depend on momentum: torch.func.grad returned
    0 where the one-sided difference is 0.12 (SGD, two steps). Refused, naming it; a momentum that is a tensor
    without a derivative asked, or one at which the buffer is kept, steps."""
    p = torch.randn(16, dtype=torch.float64)
    g = torch.randn(16, dtype=torch.float64)

    def run(mu, at):
        state = bnbf.init_state(p.float(), bnbf.OptimSpec(rule=rule, state_bits=32), {"momentum": at})
        state = type(state)._make(t.double() for t in state)
        q, state = bnbf.update(p, g, state, {"lr": 0.1, "momentum": mu}, 1, differentiable=True)
        return bnbf.update(q, g, state, {"lr": 0.1, "momentum": mu}, 2, differentiable=True)[0].sum()

    zero = torch.tensor(0.0, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"derivative is asked with respect to momentum, whose value 0.0 keeps no"):
        torch.func.grad(run)(zero, 0.0)
    with pytest.raises(ValueError, match="momentum, whose value 0.0"):
        run(zero.clone().requires_grad_(), 0.0)
    assert torch.isfinite(run(zero, 0.0))  # no derivative asked
    assert torch.func.grad(run)(torch.tensor(0.5, dtype=torch.float64), 0.5) != 0

"""Derivatives and torch.compile through the composing API (bnbf/compose.py).

- ``clip_grad_norm`` and ``apply_updates`` differentiate where a derivative is asked (eager autograd,
  ``torch.func.grad``/``jvp``), against plain torch and finite differences in float64, with the forward values of
  the non-differentiated call; ``updates`` refuses a derivative it would cut, and takes ``differentiable=True``.
- ``update(..., differentiable=True)`` takes every hparams form (schedules, per-leaf callables, ``{rule: mapping}``,
  trees of mappings, states of several rules): each equals the same steps written per leaf, and its derivatives
  match finite differences.
- ``torch.compile(fullgraph=True)`` of the composing forms (``max_grad_norm``, schedules, per-leaf callables,
  per-rule mappings, mixed rules): one graph for a 0-d tensor lr that changes every call, no graph break, the
  eager step's values.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from torch.utils._pytree import tree_leaves, tree_map

import bnbf

F64 = torch.float64


def _plain_clip(grads: dict, max_norm):
    """torch.nn.utils.clip_grad_norm_'s arithmetic in differentiable plain torch."""
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return {k: g * coef for k, g in grads.items()}


def _grads64():
    torch.manual_seed(0)
    return {"a": torch.randn(5, dtype=F64) * 3, "b": torch.randn(3, dtype=F64) * 3}


# ---- A: clip_grad_norm, apply_updates, updates ----------------------------------------------------------------


def test_clip_grad_norm_differentiates_under_torch_func():
    g0 = _grads64()
    w = {k: torch.randn_like(v) for k, v in g0.items()}
    mn = torch.tensor(1.0, dtype=F64)
    loss = lambda clipped: sum((v * w[k]).sum() for k, v in clipped.items())
    got = torch.func.grad(lambda g: loss(bnbf.clip_grad_norm(g, 1.0)[0]))(g0)
    want = torch.func.grad(lambda g: loss(_plain_clip(g, 1.0)))(g0)
    for k in g0:
        assert got[k].abs().sum() > 0  # never zeros
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
    got_m = torch.func.grad(lambda m: loss(bnbf.clip_grad_norm(g0, m)[0]))(mn)
    want_m = torch.func.grad(lambda m: loss(_plain_clip(g0, m)))(mn)
    assert got_m != 0
    torch.testing.assert_close(got_m, want_m, rtol=0, atol=0)
    # forward mode: the jvp of the clip equals plain torch's
    tangent = {k: torch.randn_like(v) for k, v in g0.items()}
    out, t_out = torch.func.jvp(lambda g: bnbf.clip_grad_norm(g, 1.0)[0], (g0,), (tangent,))
    p_out, p_t = torch.func.jvp(lambda g: _plain_clip(g, 1.0), (g0,), (tangent,))
    for k in g0:
        torch.testing.assert_close(out[k], p_out[k], rtol=0, atol=0)
        torch.testing.assert_close(t_out[k], p_t[k], rtol=0, atol=0)


def test_clip_grad_norm_eager_autograd_matches_finite_differences():
    g0 = _grads64()
    a = g0["a"].clone().requires_grad_()
    mn = torch.tensor(0.7, dtype=F64, requires_grad=True)

    def f(a, mn):
        clipped, total = bnbf.clip_grad_norm({"a": a, "b": g0["b"]}, mn)
        return clipped["a"], clipped["b"], total

    assert torch.autograd.gradcheck(f, (a, mn))
    # a vmap of per-example gradients through it (torch.func's batching of the differentiable ops)
    rows = torch.stack([g0["a"], 2 * g0["a"]])
    got = torch.func.vmap(torch.func.grad(lambda x: bnbf.clip_grad_norm({"a": x, "b": g0["b"]}, 1.0)[0]["a"].sum()))(
        rows
    )
    want = torch.stack(
        [torch.func.grad(lambda x: _plain_clip({"a": x, "b": g0["b"]}, 1.0)["a"].sum())(r) for r in rows]
    )
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clip_grad_norm_differentiated_keeps_the_values(dtype):
    """The differentiable route returns the values of the default route, bit for bit (one ``vector_norm`` per grad
    is what ``torch._foreach_norm`` runs on the CPU), and torch's own clip's values."""
    torch.manual_seed(1)
    grads = {"a": torch.randn(64, 3, dtype=dtype) * 5, "b": torch.randn(17, dtype=dtype), "c": torch.randn(2)}
    plain, total = bnbf.clip_grad_norm(grads, 0.5)
    tracked = {k: v.clone().requires_grad_() for k, v in grads.items()}
    diff, d_total = bnbf.clip_grad_norm(tracked, 0.5)
    assert all(v.requires_grad for v in diff.values())
    assert torch.equal(d_total, total)
    for k in grads:
        assert torch.equal(diff[k], plain[k])
    ref = [torch.nn.Parameter(torch.zeros_like(v)) for v in grads.values()]
    for r, v in zip(ref, grads.values()):
        r.grad = v.clone()
    torch_total = torch.nn.utils.clip_grad_norm_(ref, 0.5, foreach=False)
    assert torch.equal(torch_total, total)
    for k, r in zip(grads, ref):
        assert torch.equal(diff[k], r.grad)


def test_apply_updates_differentiates():
    torch.manual_seed(0)
    p0, g = torch.randn(5, dtype=F64), torch.randn(5, dtype=F64)
    lr = torch.tensor(0.1, dtype=F64)
    got = torch.func.grad(lambda lr: bnbf.apply_updates(p0, -lr * g).sum())(lr)
    torch.testing.assert_close(got, -g.sum(), rtol=0, atol=0)
    lr_e = lr.clone().requires_grad_()
    (eager,) = torch.autograd.grad(bnbf.apply_updates({"p": p0}, {"p": -lr_e * g})["p"].sum(), lr_e)
    torch.testing.assert_close(eager, -g.sum(), rtol=0, atol=0)
    p = p0.clone().requires_grad_()
    u = torch.randn(5, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda p, u: bnbf.apply_updates([p], [u])[0] ** 2, (p, u))
    _, tangent = torch.func.jvp(lambda u: bnbf.apply_updates(p0, u), (g,), (torch.ones(5, dtype=F64),))
    torch.testing.assert_close(tangent, torch.ones(5, dtype=F64), rtol=0, atol=0)


def test_apply_updates_differentiated_keeps_the_values():
    """A 16-bit param plus a float32 update: one rounding into the param dtype, as the default route."""
    torch.manual_seed(2)
    ps = {"w": torch.randn(33, dtype=torch.bfloat16), "v": torch.randn(7)}
    us = {"w": torch.randn(33) * 1e-2, "v": torch.randn(7) * 1e-3}
    plain = bnbf.apply_updates(ps, us)
    diff = bnbf.apply_updates(ps, {k: u.clone().requires_grad_() for k, u in us.items()})
    for k in ps:
        assert diff[k].requires_grad and diff[k].dtype == ps[k].dtype
        assert torch.equal(diff[k], plain[k])
        assert torch.equal(diff[k], (ps[k].float() + us[k]).to(ps[k].dtype))


def _sgd_setup():
    torch.manual_seed(0)
    p0, g = torch.randn(5, dtype=F64), torch.randn(5, dtype=F64)
    s = bnbf.init_state(torch.zeros(5), bnbf.OptimSpec(rule="sgd", state_bits=32))
    return p0, g, tree_map(torch.Tensor.double, s)


@pytest.mark.parametrize("ask", ["eager_param", "eager_grad", "func_grad_param", "max_grad_norm"])
def test_updates_refuses_a_derivative_it_would_cut(ask):
    """``updates`` steps detached float32 copies: a param or grad that takes part in a derivative raises the core's
    'not differentiable' error naming ``bnbf.updates`` (it returned a step with the param's history cut)."""
    p0, g, s = _sgd_setup()
    s8 = bnbf.init_state(torch.zeros(64, 4), bnbf.OptimSpec(rule="adamw", min_8bit_size=0))
    before = [t.clone() for t in s8]
    match = "pass differentiable=True to bnbf.updates"
    with pytest.raises(RuntimeError, match=match):
        if ask == "eager_param":
            bnbf.updates(p0.clone().requires_grad_(), g, s, {"lr": 0.1}, 1)
        elif ask == "eager_grad":
            bnbf.updates(p0, g.clone().requires_grad_(), s, {"lr": 0.1}, 1)
        elif ask == "func_grad_param":
            torch.func.grad(lambda p: bnbf.updates(p, g, s, {"lr": 0.1}, 1)[0].sum())(p0)
        else:
            p, gg = torch.randn(64, 4), torch.randn(64, 4)
            bnbf.updates(p, gg, s8, {"lr": 0.1}, 1, max_grad_norm=torch.tensor(0.5, requires_grad=True))
    assert all(torch.equal(a, b) for a, b in zip(s8, before))
    with torch.no_grad():  # no derivative asked: the step runs
        bnbf.updates(p0.clone().requires_grad_(), g, s, {"lr": 0.1}, 1)


def test_updates_differentiable():
    """``updates(..., differentiable=True)`` (it died with a TypeError): ``apply_updates(p, u)`` is the
    differentiable step, derivatives with respect to the lr and the params match plain torch and finite
    differences."""
    p0, g, s = _sgd_setup()
    lr = torch.tensor(0.1, dtype=F64)

    def new_params(p, lr):
        u, _ = bnbf.updates(p, g, s, {"lr": lr}, 1, differentiable=True)
        return bnbf.apply_updates(p, u)

    assert torch.func.grad(lambda lr: new_params(p0, lr).sum())(lr) == -g.sum()
    torch.testing.assert_close(torch.func.grad(lambda p: (new_params(p, lr) ** 2).sum())(p0), 2 * (p0 - 0.1 * g))
    assert torch.autograd.gradcheck(new_params, (p0.clone().requires_grad_(), lr.clone().requires_grad_()))
    # AdamW with weight decay and max_grad_norm, two steps: plain torch's AdamW on the clipped grads
    torch.manual_seed(3)
    params = {"w": torch.randn(4, 3, dtype=F64), "b": torch.randn(3, dtype=F64)}
    grads = [{k: torch.randn_like(v) * 3 for k, v in params.items()} for _ in range(2)]
    spec = bnbf.OptimSpec(rule="adamw", state_bits=32)
    state = tree_map(torch.Tensor.double, bnbf.init_state({k: v.float() for k, v in params.items()}, spec))
    hp = {"lr": 0.05, "weight_decay": 0.1}
    ref = {k: v.clone().requires_grad_() for k, v in params.items()}
    opt = torch.optim.AdamW(list(ref.values()), **hp)
    p = params
    for t, gr in enumerate(grads, 1):
        u, state = bnbf.updates(p, gr, state, hp, t, max_grad_norm=1.0, differentiable=True)
        assert all(v.dtype == F64 for v in u.values())
        p = bnbf.apply_updates(p, u)
        for k, r in ref.items():
            r.grad = gr[k].clone()
        torch.nn.utils.clip_grad_norm_(list(ref.values()), 1.0)
        opt.step()
    for k in params:
        torch.testing.assert_close(p[k], ref[k].detach())


def test_updates_differentiable_16bit_params():
    """16-bit params and grads are stepped as float32 (exact casts): u in float32, with its history."""
    torch.manual_seed(4)
    p = {"w": torch.randn(8, dtype=torch.bfloat16)}
    g = {"w": torch.randn(8, dtype=torch.bfloat16)}
    s = bnbf.init_state(p, bnbf.OptimSpec(rule="sgd", state_bits=32))
    lr = torch.tensor(1e-4, requires_grad=True)
    u, _ = bnbf.updates(p, g, s, {"lr": lr}, 1, differentiable=True)
    assert u["w"].dtype == torch.float32
    pw = p["w"].float()
    torch.testing.assert_close(u["w"], (pw - 1e-4 * g["w"].float()) - pw)  # plain torch's float32 step
    (d,) = torch.autograd.grad(u["w"].sum(), lr)
    torch.testing.assert_close(d, -g["w"].float().sum(), rtol=1e-6, atol=0)


# ---- B: differentiable=True with every hparams form ----------------------------------------------------------


def _tree64(mixed: bool):
    torch.manual_seed(5)
    params = {"w": torch.randn(4, 3, dtype=F64), "b": torch.randn(3, dtype=F64)}
    rule = (lambda path, p: "lion" if path == "b" else "adamw") if mixed else (lambda path, p: "adamw")
    spec = lambda path, p: bnbf.OptimSpec(rule=rule(path, p), state_bits=32)
    state = bnbf.init_state({k: v.float() for k, v in params.items()}, spec)
    # a first step (moments not zero), in float64
    state = tree_map(torch.Tensor.double, state)
    g1 = {k: torch.randn_like(v) for k, v in params.items()}
    _, state = bnbf.update(params, g1, state, {"adamw": {"lr": 0.01}, "lion": {"lr": 0.01}} if mixed else None, 1,
                           differentiable=True)  # fmt: skip
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    return params, grads, state


# each form: (mixed rules?, hparams of lr as given, each leaf's hparams as a separate call takes them)
FORMS = {
    "schedule": (
        False,
        lambda lr: {"lr": lambda t: lr / t, "weight_decay": 0.1},
        lambda lr, k, t: {"lr": lr / t, "weight_decay": 0.1},
    ),
    "per_leaf_callable": (
        False,
        lambda lr: lambda path, p: {"lr": lr, "weight_decay": 0.0 if p.ndim == 1 else 0.1},
        lambda lr, k, t: {"lr": lr, "weight_decay": 0.0 if k == "b" else 0.1},
    ),
    "by_rule": (
        True,
        lambda lr: {"adamw": {"lr": lr, "weight_decay": 0.1}, "lion": {"lr": lr * 0.1}},
        lambda lr, k, t: {"lr": lr * 0.1} if k == "b" else {"lr": lr, "weight_decay": 0.1},
    ),
    "tree": (
        False,
        lambda lr: {"w": {"lr": lr}, "b": {"lr": lr * 2, "betas": (0.8, lambda t: 0.99)}},
        lambda lr, k, t: {"lr": lr * 2, "betas": (0.8, 0.99)} if k == "b" else {"lr": lr},
    ),
    "mixed_rules_shared": (True, lambda lr: {"lr": lr}, lambda lr, k, t: {"lr": lr}),
}


def _per_leaf(params, grads, state, leaf_hp, lr, step, **kw):
    """The same step written per leaf: one differentiable call per leaf with its own hyperparameters."""
    new_p, new_s = {}, {}
    for k in params:
        new_p[k], new_s[k] = bnbf.update(params[k], grads[k], state[k], leaf_hp(lr, k, step), step,
                                         differentiable=True, **kw)  # fmt: skip
    return new_p, new_s


@pytest.mark.parametrize("clip", [None, 0.5])
@pytest.mark.parametrize("form", list(FORMS))
def test_differentiable_update_takes_every_hparams_form(form, clip):
    mixed, given, leaf_hp = FORMS[form]
    params, grads, state = _tree64(mixed)
    lr = torch.tensor(0.01, dtype=F64)
    kw = {} if clip is None else {"max_grad_norm": clip}
    leaf_grads = grads if clip is None else bnbf.clip_grad_norm(grads, clip)[0]  # clipped over the whole tree
    got = bnbf.update(params, grads, state, given(lr), 2, differentiable=True, **kw)
    want = _per_leaf(params, leaf_grads, state, leaf_hp, lr, 2)
    for a, b in zip(tree_leaves(got), tree_leaves(want), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # the derivative with respect to lr (through the schedule's output too), against the per-leaf steps
    loss = lambda out: sum((v**2).sum() for v in out[0].values())
    d = torch.func.grad(lambda lr: loss(bnbf.update(params, grads, state, given(lr), 2, differentiable=True, **kw)))
    d_want = torch.func.grad(lambda lr: loss(_per_leaf(params, leaf_grads, state, leaf_hp, lr, 2)))
    assert d(lr) != 0
    torch.testing.assert_close(d(lr), d_want(lr))

    # finite differences in float64, with respect to the lr, the params and the grads
    def f(lr, w, gw):
        out, new_s = bnbf.update({"w": w, "b": params["b"]}, {"w": gw, "b": grads["b"]}, state, given(lr), 2,
                                 differentiable=True, **kw)  # fmt: skip
        return out["w"], out["b"], *tree_leaves(new_s)

    args = (lr.clone().requires_grad_(), params["w"].clone().requires_grad_(), grads["w"].clone().requires_grad_())
    if mixed or form == "per_leaf_callable":  # Lion's sign has no derivative in the grads: only lr and params
        args[2].requires_grad_(False)
    assert torch.autograd.gradcheck(f, args)


@pytest.mark.parametrize("form", ["by_rule", "per_leaf_callable"])
def test_differentiable_update__takes_every_hparams_form(form):
    """The in-place differentiable step computes every group before it writes any: equal to the pure step."""
    mixed, given, _ = FORMS[form]
    params, grads, state = _tree64(mixed)
    lr = torch.tensor(0.01, dtype=F64, requires_grad=True)
    want_p, want_s = bnbf.update(params, grads, state, given(lr), 2, differentiable=True)
    p0 = {k: v.clone().requires_grad_() for k, v in params.items()}
    p = {k: v.clone() for k, v in p0.items()}  # non-leaves: written in place with their history
    s = tree_map(torch.clone, state)
    bnbf.update_(p, grads, s, given(lr), 2, differentiable=True)
    for a, b in zip(tree_leaves((p, s)), tree_leaves((want_p, want_s)), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    (d,) = torch.autograd.grad(sum((v**2).sum() for v in p.values()), lr)
    (d_want,) = torch.autograd.grad(sum((v**2).sum() for v in want_p.values()), lr)
    torch.testing.assert_close(d, d_want)
    # a bad group's hyperparameters raise before any write
    bad = (
        {"adamw": {"lr": -1.0}, "lion": {"lr": 0.1}}
        if mixed
        else (lambda path, q: {"lr": -1.0 if path == "b" else 0.1})
    )
    before = [t.detach().clone() for t in tree_leaves((p, s))]
    with pytest.raises(ValueError, match="Invalid learning rate"):
        bnbf.update_(p, grads, s, bad, 3, differentiable=True)
    assert all(torch.equal(a, b) for a, b in zip(tree_leaves((p, s)), before))


def test_updates_differentiable_with_composing_forms():
    mixed, given, leaf_hp = FORMS["by_rule"]
    params, grads, state = _tree64(mixed)
    lr = torch.tensor(0.01, dtype=F64)
    u, _ = bnbf.updates(params, grads, state, given(lr), 2, differentiable=True)
    want, _ = _per_leaf(params, grads, state, leaf_hp, lr, 2)
    for k in params:
        torch.testing.assert_close(u[k], want[k] - params[k], rtol=0, atol=0)


def test_differentiable_composing_errors_are_clear():
    params, grads, state = _tree64(True)
    with pytest.raises(ValueError, match=r"no entry for rule\(s\) \['lion'\]"):
        bnbf.update(params, grads, state, {"adamw": {"lr": 0.1}}, 2, differentiable=True)
    with pytest.raises(TypeError, match="the hparams callable returned int"):
        bnbf.update(params, grads, state, lambda path, p: 3, 2, differentiable=True)
    s8 = bnbf.init_state({"w": torch.zeros(64, 4)}, lambda path, p: bnbf.OptimSpec(rule="adamw", min_8bit_size=0))
    with pytest.raises(ValueError, match="8-bit: differentiable=True needs 32-bit state"):
        bnbf.update({"w": torch.zeros(64, 4)}, {"w": torch.zeros(64, 4)}, s8, {"lr": lambda t: 0.1}, 1,
                    differentiable=True)  # fmt: skip


# ---- C: torch.compile of the composing forms -------------------------------------------------------------------


def _mixed_tree():
    torch.manual_seed(0)
    p = {"emb": torch.randn(64, 32), "w": torch.randn(32, 32), "b": torch.randn(32)}
    spec = lambda path, q: bnbf.OptimSpec(rule="lion" if path == "emb" else "adamw", min_8bit_size=512)
    return p, bnbf.init_state(p, spec)


COMPILED = {
    "max_grad_norm": lambda lr: {"lr": lr},
    "schedule": lambda lr: {"lr": lambda t: lr * torch.clamp(t / 3.0, max=1.0), "weight_decay": 0.01},
    "per_leaf_callable": lambda lr: lambda path, q: {"lr": lr, "weight_decay": 0.0 if q.ndim == 1 else 0.1},
    "by_rule": lambda lr: {"adamw": {"lr": lambda t: lr / t}, "lion": {"lr": lr * 0.1}},
    # two closures over the traced lr: Dynamo could not compare them with ``is`` (the schedules' memo)
    "two_schedules": lambda lr: {"lr": lambda t: lr * torch.clamp(t / 3.0, max=1.0), "weight_decay": lambda t: lr * 10},
    "shared_schedule": lambda lr: (lambda f: {"adamw": {"lr": f}, "lion": {"lr": f, "weight_decay": lambda t: lr}})(
        lambda t: lr / t
    ),
}


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("form", list(COMPILED))
def test_compiled_composing_forms(form, in_place, fresh_dynamo):
    """fullgraph compile (a break raises; fresh_dynamo fails on one), one graph while a 0-d tensor lr and step
    change, the eager step's values bit for bit (with max_grad_norm: the traced route clips with torch's ops,
    as ``clip_grad_norm`` then the step)."""
    clip = 1.0 if form == "max_grad_norm" else None
    make = COMPILED[form]

    def step(p, g, s, lr, t):
        if in_place:
            bnbf.update_(p, g, s, make(lr), t, max_grad_norm=clip)
            return p, s
        return bnbf.update(p, g, s, make(lr), t, max_grad_norm=clip)

    def eager(p, g, s, lr, t):
        if clip is not None:
            g = bnbf.clip_grad_norm(g, clip)[0]
        if in_place:
            bnbf.update_(p, g, s, make(lr), t)
            return p, s
        return bnbf.update(p, g, s, make(lr), t)

    cnt = CompileCounter()
    compiled = torch.compile(step, backend=cnt, fullgraph=True)
    p, s = _mixed_tree()
    ep, es = tree_map(torch.clone, (p, s))
    for t in range(1, 5):
        g = {k: torch.randn_like(v) * 3 for k, v in p.items()}
        lr, tt = torch.tensor(1e-2 / t), torch.tensor(t)
        p, s = compiled(p, g, s, lr, tt)
        ep, es = eager(ep, g, es, lr, tt)
        for a, b in zip(tree_leaves((p, s)), tree_leaves((ep, es)), strict=True):
            assert torch.equal(a, b)
    assert cnt.frame_count == 1


def test_compiled_hparams_given_as_inputs_compile_once(fresh_dynamo):
    """A per-leaf tree of mappings passed into the compiled step, new objects each call with a new lr tensor: no
    recompile (the groups are keyed without id(), which Dynamo would guard on)."""
    cnt = CompileCounter()
    compiled = torch.compile(lambda p, g, s, h, t: bnbf.update(p, g, s, h, t), backend=cnt, fullgraph=True)
    p, s = _mixed_tree()
    for t in range(1, 4):
        lr = torch.tensor(1e-2 / t)
        h = {"emb": {"lr": lr * 0.1}, "w": {"lr": lr}, "b": {"lr": lr, "weight_decay": 0.0}}
        g = {k: torch.randn_like(v) for k, v in p.items()}
        want = bnbf.update(p, g, s, h, torch.tensor(t))
        p, s = compiled(p, g, s, h, torch.tensor(t))
        assert all(torch.equal(a, b) for a, b in zip(tree_leaves((p, s)), tree_leaves(want), strict=True))
    assert cnt.frame_count == 1


def test_compiled_clip_grad_norm_and_apply_updates(fresh_dynamo):
    cnt = CompileCounter()

    def f(g, u, p, m):
        clipped, total = bnbf.clip_grad_norm(g, m)
        return clipped, total, bnbf.apply_updates(p, u)

    compiled = torch.compile(f, backend=cnt, fullgraph=True)
    torch.manual_seed(0)
    for m in (0.5, 0.25):
        g = {"a": torch.randn(10) * 3, "b": torch.randn(4, dtype=torch.bfloat16)}
        p = {"a": torch.randn(10), "b": torch.randn(4, dtype=torch.bfloat16)}
        u = {"a": torch.randn(10), "b": torch.randn(4)}
        got, want = compiled(g, u, p, torch.tensor(m)), f(g, u, p, torch.tensor(m))
        assert all(torch.equal(a, b) for a, b in zip(tree_leaves(got), tree_leaves(want), strict=True))
    assert cnt.frame_count == 1

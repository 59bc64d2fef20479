"""Bad input raises a clear error before any tensor is written.

Every case runs through both ``bnbf.update`` and ``bnbf.update_`` with a snapshot (clones) of every
param, grad and state leaf taken before the call, compared bitwise after it.
"""

from __future__ import annotations

import re

import pytest
import torch
from conftest import DEVICES, HAS_CUDA, assert_untouched, snapshot
from torch.utils import _pytree as pytree

import bnbf
from bnbf.state import is_state

# argument checks, errors and plumbing, not kernel numerics: the interpreter pass skips them (conftest)
pytestmark = pytest.mark.surface

UPDATES = [bnbf.update, bnbf.update_]
GRAD_STRUCTURE = r"(?s)grad structure .* does not match param structure"
STATE_STRUCTURE = r"(?s)state structure .* does not match param structure"
UPDATE_IDS = ["update", "update_"]


def spec(rule="adamw", bits=8, min_8bit_size=1, block_size=256):
    return bnbf.OptimSpec(rule=rule, state_bits=bits, min_8bit_size=min_8bit_size, block_size=block_size)


def warm(p, s, rule="adamw"):
    """A state with non-zero moments (so an accidental write is visible) and the param after one step."""
    p, s = bnbf.update(p, torch.randn_like(p) * 0.01, s, {}, 1)
    return p, s


def expect_error(fn, exc, match, param, grad, state, hparams=None, step=2, **options):
    snap = snapshot(param, grad, state)
    with pytest.raises(exc, match=match or None):
        fn(param, grad, state, hparams if hparams is not None else {}, step, **options)
    assert_untouched(snap, f"{fn.__name__} after a {exc if isinstance(exc, type) else exc[0]}")


@pytest.fixture(params=[8, 32], ids=["8bit", "32bit"])
def bits(request):
    return request.param


@pytest.fixture
def setup(device, bits):
    p = torch.randn(4, 300, device=device)
    s = bnbf.init_state(p, spec(bits=bits))
    p, s = warm(p, s)
    return p, torch.randn(4, 300, device=device) * 0.01, s


# ------------------------------------------------------------------------------------------------
# grads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", UPDATES, ids=UPDATE_IDS)
def test_grad_of_another_shape(setup, fn):
    p, g, s = setup
    expect_error(fn, (ValueError, TypeError), "shape", p, g.reshape(300, 4), s)
    expect_error(fn, (ValueError, TypeError), "shape", p, g[:, :299].contiguous(), s)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", UPDATES, ids=UPDATE_IDS)
def test_grad_of_another_dtype(setup, fn):
    p, g, s = setup
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        expect_error(fn, (ValueError, TypeError), "dtype", p, g.to(dtype), s)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", UPDATES, ids=UPDATE_IDS)
def test_grad_on_another_device(setup, fn, device):
    p, g, s = setup
    other = "meta" if not HAS_CUDA else ("cpu" if device == "cuda" else "cuda")
    expect_error(fn, ValueError, "is on .* but the param is on", p, g.to(other), s)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", UPDATES, ids=UPDATE_IDS)
def test_sparse_grad(setup, fn):
    p, g, s = setup
    expect_error(fn, RuntimeError, "does not support sparse gradients", p, g.to_sparse(), s)


@pytest.mark.parametrize("fn", UPDATES, ids=UPDATE_IDS)
def test_grads_and_settings_the_step_cannot_read_are_named(fn):
    """A nested or mkldnn grad, a complex or bool tensor lr: each error says what the input is (they raised torch's
    internal error, or called an mkldnn tensor sparse)."""
    p = torch.randn(2, 16)
    s = bnbf.init_state(p, spec(bits=32))
    g = torch.randn(2, 16)
    nested = torch.nested.nested_tensor([torch.randn(16), torch.randn(16)])
    cases = [(nested, "does not support nested gradients")]
    if torch.backends.mkldnn.is_available():
        cases.append((g.to_mkldnn(), "non-strided layout .*mkldnn"))
    snap = snapshot(p, s)  # (such grads cannot be cloned for a snapshot of their own)
    for bad, match in cases:
        with pytest.raises(RuntimeError, match=match):
            fn(p, bad, s, {}, 2)
        assert_untouched(snap, match)
    for lr in (torch.tensor(0.1 + 0.5j), torch.tensor(True)):
        expect_error(fn, TypeError, f"lr must be a real number, got a {lr.dtype} tensor", p, g, s, {"lr": lr})
    with pytest.raises(TypeError, match="got a nested tensor"):
        bnbf.init_state(nested, spec())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", UPDATES, ids=UPDATE_IDS)
def test_error_names_the_key(device, fn):
    params = {"encoder.weight": torch.randn(300, device=device), "decoder.bias": torch.randn(7, device=device)}
    state = bnbf.init_state(params, spec())
    grads = {"encoder.weight": torch.randn(300, device=device), "decoder.bias": torch.randn(8, device=device)}
    expect_error(fn, (ValueError, TypeError), "decoder.bias", params, grads, state)
    as_list = [params["encoder.weight"], params["decoder.bias"]]
    expect_error(
        fn,
        (ValueError, TypeError),
        r"\[1\]",
        as_list,
        [grads["encoder.weight"], grads["decoder.bias"]],
        bnbf.init_state(as_list, spec()),
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", UPDATES, ids=UPDATE_IDS)
def test_bad_second_leaf_leaves_first_untouched(device, fn):
    # all checks run before any write: a bad grad in the last leaf must not let the first leaf update
    params = {
        "a": torch.randn(300, device=device),
        "b": torch.randn(300, device=device, dtype=torch.bfloat16),
        "c": torch.randn(5, device=device),
    }
    state = bnbf.init_state(params, spec(min_8bit_size=256))
    grads = {
        "a": torch.randn(300, device=device),
        "b": torch.randn(300, device=device, dtype=torch.bfloat16),
        "c": torch.randn(5, device=device, dtype=torch.float16),
    }
    expect_error(fn, (ValueError, TypeError), "c", params, grads, state)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", UPDATES, ids=UPDATE_IDS)
def test_structure_mismatch(device, fn):
    params = {"a": torch.randn(10, device=device), "b": torch.randn(10, device=device)}
    state = bnbf.init_state(params, spec())
    expect_error(fn, ValueError, GRAD_STRUCTURE, params, {"a": torch.randn(10, device=device)}, state)
    expect_error(fn, ValueError, STATE_STRUCTURE, params, params, {"a": state["a"]})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", UPDATES, ids=UPDATE_IDS)
@pytest.mark.parametrize("form", ["core", "per_leaf", "differentiable"])
@pytest.mark.parametrize("container", [dict, list])
def test_a_leaf_that_is_no_tensor_or_state_is_named(device, fn, form, container):
    """A number or an array where a flat dict or list holds a param, grad or state: the error names that leaf (it
    once reported the two structures as differing, printed alike: a pytree structure against the flat key)."""
    tensors = {"a": torch.randn(300, device=device), "b": torch.randn(30, device=device)}
    state = bnbf.init_state(tensors, spec(bits=32 if form == "differentiable" else 8))
    hparams = (lambda path, p: {"lr": 0.01}) if form == "per_leaf" else {"lr": 0.01}
    kw = {"differentiable": True} if form == "differentiable" else {}
    tree = (lambda d: d) if container is dict else (lambda d: list(d.values()))
    where = r"\['b'\]" if container is dict else r"\[1\]"
    grads = {k: torch.randn_like(v) for k, v in tensors.items()}
    for what, bad, match in [
        ("param", 1.0, f"param{where} must be a"),
        ("grad", 0, f"grad{where} must be a Tensor, got int"),
        ("grad", grads["b"].cpu().numpy(), f"grad{where} must be a Tensor, got ndarray"),
        ("state", 3, f"state{where} is not a bnbf state"),
    ]:
        p, g, s = (tree(dict(t, b=bad) if what == name else t) for name, t in
                   [("param", tensors), ("grad", grads), ("state", state)])  # fmt: skip
        snap = snapshot(p, g, s)
        with pytest.raises(TypeError, match=match):
            fn(p, g, s, hparams, 1, **kw)
        assert_untouched(snap, f"{fn.__name__} after a bad {what}")


@pytest.mark.parametrize("device", DEVICES)
def test_a_plan_names_a_leaf_that_is_no_tensor(device):
    params = {"a": torch.randn(300, device=device), "b": torch.randn(30, device=device)}
    state = bnbf.init_state(params, spec())
    with pytest.raises(TypeError, match=re.escape("param['b'] must be a Tensor, got float")):
        bnbf.plan(dict(params, b=1.0), state)
    with pytest.raises(TypeError, match=re.escape("state['b'] is not a bnbf state")):
        bnbf.plan(params, dict(state, b=1))
    snap = snapshot(params, state)
    with pytest.raises(TypeError, match=re.escape("grad['b'] must be a Tensor, got int")):
        bnbf.plan(params, state).step({"a": torch.randn(300, device=device), "b": 0}, {"lr": 0.01}, 1)
    assert_untouched(snap)


# every path that names a leaf: the core's, bnbf.compose's (per-rule, per-leaf and callable hyperparameters,
# schedules, mixed rules, max_grad_norm), the differentiable step's, the packed state's
NAMING_FORMS = {
    "shared": ({"lr": 1e-3}, {}),
    "per_rule": ({"adamw": {"lr": 1e-3}}, {}),
    "per_leaf": (None, {}),  # a tree of mappings like the params
    "callable": (lambda path, p: {"lr": 1e-3}, {}),
    "schedule": ({"lr": lambda t: 1e-3}, {}),
    "max_grad_norm": ({"lr": 1e-3}, {"max_grad_norm": 1.0}),
    "differentiable": ({"lr": 1e-3}, {"differentiable": True}),
    "differentiable_per_leaf": (None, {"differentiable": True}),
    "packed": ({"lr": 1e-3}, {}),
    "mixed_rules": ({"lr": 1e-3}, {}),
}
NAMED_TREES = {  # (params from two tensors, their name for the second leaf)
    "list": (lambda a, b: [a, b], "[1]"),
    "tuple": (lambda a, b: (a, b), "[1]"),
    "nested": (lambda a, b: {"m": [a, b]}, "['m'][1]"),
    "dict": (lambda a, b: {"a": a, "b": b}, "['b']"),
    "int_keys": (lambda a, b: {0: a, 1: b}, "[1]"),  # a dict's key, printed as pytree's keystr prints it: [1]
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", UPDATES, ids=UPDATE_IDS)
@pytest.mark.parametrize("form", list(NAMING_FORMS))
@pytest.mark.parametrize("tree", list(NAMED_TREES))
def test_a_leaf_is_named_alike_on_every_path(device, fn, form, tree):
    """A list or tuple index as [1], a dict key as ['b'] (torch.utils._pytree.keystr's style), whichever path steps
    the call: bnbf.compose once named a list's leaf grad['1'] and a nested one grad['m.1'], the core grad[1]."""
    make, name = NAMED_TREES[tree]
    a, b = torch.randn(300, device=device), torch.randn(30, device=device)
    params = make(a, b)
    hparams, kw = NAMING_FORMS[form]
    if hparams is None:
        hparams = make({"lr": 1e-3}, {"lr": 2e-3})
    state = bnbf.init_state(params, spec(bits=32 if "differentiable" in form else 8), packed=form == "packed")
    if form == "mixed_rules":
        state = make(bnbf.init_state(a, spec("sgd")), pytree.tree_leaves(state, is_leaf=is_state)[1])
    grads = make(torch.randn_like(a), torch.randn(31, device=device))
    expect_error(fn, ValueError, re.escape(f"grad{name} has shape (31,) but the param has shape (30,)"),
                 params, grads, state, hparams, **kw)  # fmt: skip


@pytest.mark.parametrize("tree", list(NAMED_TREES))
@pytest.mark.parametrize("spec_form", ["one", "per_leaf", "callable", "packed"])
def test_init_state_and_plans_name_a_leaf_alike(tree, spec_form):
    make, name = NAMED_TREES[tree]
    one = spec(bits=32)
    specs = {"one": one, "per_leaf": make(one, one), "callable": lambda path, p: one, "packed": one}[spec_form]
    bad = make(torch.randn(300), torch.ones(30, dtype=torch.int32))
    with pytest.raises(TypeError, match=re.escape(f"param{name} has dtype torch.int32")):
        bnbf.init_state(bad, specs, packed=spec_form == "packed")
    params = make(torch.randn(300), torch.randn(30))
    state = bnbf.init_state(params, specs, packed=spec_form == "packed")
    if spec_form == "one":  # a plan: its leaves' checks, and a step's of the grads
        with pytest.raises(TypeError, match=re.escape(f"param{name} has dtype torch.int32")):
            bnbf.plan(bad, state)
        grads = make(torch.randn(300), torch.randn(31))
        with pytest.raises(ValueError, match=re.escape(f"grad{name} has shape (31,)")):
            bnbf.plan(params, state).step(grads, {"lr": 1e-3}, 1)


# ------------------------------------------------------------------------------------------------
# params


BAD_PARAM_DTYPES = [torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", BAD_PARAM_DTYPES, ids=str)
def test_init_state_rejects_integer_and_complex_params(device, dtype):
    p = torch.ones(300, device=device).to(dtype)
    snap = snapshot(p)
    with pytest.raises(TypeError):
        bnbf.init_state(p, spec())
    with pytest.raises(TypeError):
        bnbf.init_state({"w": torch.randn(3, device=device), "bad": p}, spec())
    assert_untouched(snap)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", BAD_PARAM_DTYPES, ids=str)
@pytest.mark.parametrize("fn", UPDATES, ids=UPDATE_IDS)
def test_update_rejects_integer_and_complex_params(device, dtype, fn, bits):
    s = bnbf.init_state(torch.zeros(300, device=device), spec(bits=bits))
    _, s = warm(torch.zeros(300, device=device), s)
    p = torch.ones(300, device=device).to(dtype)
    expect_error(fn, TypeError, "params are not supported", p, torch.ones(300, device=device).to(dtype), s)


# ------------------------------------------------------------------------------------------------
# states


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", UPDATES, ids=UPDATE_IDS)
def test_state_for_another_shape(setup, fn, device, bits):
    p, g, s = setup
    other = bnbf.init_state(torch.zeros(300, 4, device=device), spec(bits=bits))  # same numel
    expect_error(fn, ValueError, "does not fit the param", p, g, other)
    bigger = bnbf.init_state(torch.zeros(4, 301, device=device), spec(bits=bits))
    expect_error(fn, ValueError, "does not fit the param", p, g, bigger)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", UPDATES, ids=UPDATE_IDS)
def test_state_layouts_mismatched(device, fn):
    p = torch.randn(4, 300, device=device)
    g = torch.randn(4, 300, device=device)
    s8 = warm(p, bnbf.init_state(p, spec(bits=8)))[1]
    s32 = warm(p, bnbf.init_state(p, spec(bits=32)))[1]
    s8_64 = warm(p, bnbf.init_state(p, spec(bits=8, block_size=64)))[1]
    # 32-bit layout holding 8-bit codes
    expect_error(fn, ValueError, "does not fit the param", p, g, s32._replace(exp_avg=s8.exp_avg))
    # 8-bit layout holding float32 moments
    expect_error(fn, ValueError, "does not fit the param", p, g, s8._replace(exp_avg_sq=s32.exp_avg_sq))
    # absmax of another block size (the layout says 256)
    expect_error(
        fn,
        ValueError,
        "does not fit the param",
        p,
        g,
        s8._replace(exp_avg_absmax=s8_64.exp_avg_absmax, exp_avg_sq_absmax=s8_64.exp_avg_sq_absmax),
    )
    # an 8-bit state's fields in a 32-bit-layout tuple of the right length
    expect_error(fn, ValueError, "does not fit the param", p, g, type(s32)(s8.exp_avg, s8.exp_avg_sq))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", UPDATES, ids=UPDATE_IDS)
def test_states_of_two_rules_in_one_call(device, fn):
    """Once refused; now bnbf.compose steps such a tree: each leaf as its own call steps it, bit for bit."""
    params = {"a": torch.randn(300, device=device), "b": torch.randn(300, device=device)}
    state = {"a": bnbf.init_state(params["a"], spec("adam")), "b": bnbf.init_state(params["b"], spec("adamw"))}
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    alone = {k: bnbf.update(params[k], grads[k], state[k], {"lr": 0.01}, 1) for k in params}
    clone = lambda t: {k: v.clone() for k, v in t.items()} if isinstance(t, dict) else t.clone()
    p2, s2 = fn(
        {k: v.clone() for k, v in params.items()},
        grads,
        {k: type(s)(*map(clone, s)) for k, s in state.items()},
        {"lr": 0.01},
        1,
    )
    for k in params:
        assert torch.equal(p2[k], alone[k][0]), k
        assert all(torch.equal(a, b) for a, b in zip(s2[k], alone[k][1])), k


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", UPDATES, ids=UPDATE_IDS)
def test_not_a_state(setup, fn):
    p, g, s = setup
    expect_error(fn, ValueError, STATE_STRUCTURE, p, g, tuple(s))
    expect_error(fn, ValueError, STATE_STRUCTURE, p, g, {"exp_avg": s[0], "exp_avg_sq": s[1]})


# ------------------------------------------------------------------------------------------------
# hyperparameters and step (torch.optim's wording)

# Bad hyperparameter values of every rule (torch.optim's wording, checked against the rule's reference, and
# nothing written): test_rules.test_bad_hparams_refused, from each row's ``bad`` in optim_table.


@pytest.mark.parametrize("device", DEVICES)
def test_one_hparams_dict_edited_between_calls(device):
    """Validated hparams are reused for a dict of the same numbers (bnbf.rules.base): editing the dict in
    place must change the step, and a bad value after good ones must still raise."""
    p = torch.randn(300, device=device)
    g = torch.randn(300, device=device) * 0.01
    hp = {"lr": 0.1, "weight_decay": 0.0}
    s = bnbf.init_state(p, spec(bits=32))
    p1, _ = bnbf.update(p, g, s, hp, 1)
    hp["lr"] = 0.2
    p2, _ = bnbf.update(p, g, s, hp, 1)
    # the first AdamW step moves each element by lr * g / (|g| + eps)
    step1 = g / (g.abs() + 1e-8)
    torch.testing.assert_close(p - p1, 0.1 * step1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(p - p2, 0.2 * step1, rtol=1e-5, atol=1e-6)
    hp["lr"] = -1.0
    expect_error(bnbf.update_, ValueError, re.escape("Invalid learning rate: -1.0"), p, g, s, hparams=hp)


BIG = 2**1100  # an int beyond float64


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", UPDATES, ids=UPDATE_IDS)
@pytest.mark.parametrize(
    ("hparams", "exc", "match"),
    [
        ({"lr": BIG}, ValueError, "Invalid learning rate: 1358298529"),
        ({"betas": (BIG, 0.999)}, ValueError, "Invalid beta parameter at index 0: 1358298529"),
        ({"weight_decay": -BIG}, ValueError, "Invalid weight_decay value: -1358298529"),
        ({"amsgrad": BIG}, TypeError, "amsgrad must be a bool, got int"),
        ({"adamw": {"lr": BIG}}, ValueError, "Invalid learning rate: 1358298529"),  # by rule: bnbf.compose
    ],
    ids=["lr", "betas", "weight_decay", "amsgrad", "by-rule"],
)
def test_int_beyond_float64_refused_in_torch_wording(setup, fn, hparams, exc, match):
    """The validated-hparams caches key a number by its float sign, which such an int has not: they raised a
    bare OverflowError ("int too large to convert to float") instead of the value's own error."""
    p, g, s = setup
    expect_error(fn, exc, re.escape(match), p, g, s, hparams=hparams)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["t_alpha", "t_beta3"])
def test_ademamix_warmup_beyond_float32_refused(device, name):
    """The warm-ups' lengths are refused beyond float32 as every hyperparameter is: a t_alpha beyond float64 raised
    OverflowError in the step's division (such a t_beta3 was taken, a warm-up that never ends)."""
    p = torch.randn(300, device=device)
    s = bnbf.init_state(p, spec(rule="ademamix", bits=32))
    expect_error(bnbf.update_, ValueError, f"Invalid {name} value: 1358298529", p, p * 0.01, s, hparams={name: BIG})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", UPDATES, ids=UPDATE_IDS)
def test_unknown_hparam(setup, fn):
    p, g, s = setup
    expect_error(fn, (ValueError, TypeError), "learning_rate", p, g, s, hparams={"learning_rate": 1e-3})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", UPDATES, ids=UPDATE_IDS)
@pytest.mark.parametrize("step", [0, -1, "tensor0"])
def test_invalid_step(setup, fn, step, device):
    p, g, s = setup
    if step == "tensor0":
        if device != "cpu":
            pytest.skip("a device step tensor is not read on the host (that would synchronise)")
        step = torch.tensor(0)
    expect_error(fn, ValueError, r"Invalid step: .* \(steps count from 1\)", p, g, s, step=step)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", UPDATES, ids=UPDATE_IDS)
def test_a_meta_step_is_named(setup, fn):
    """A meta tensor has no value to step with: refused naming the step, where torch's copy raised "Cannot copy out
    of meta tensor" naming nothing. (A meta hyperparameter: test_a_meta_hparam_is_named.)"""
    p, g, s = setup
    expect_error(fn, ValueError, "step is a meta tensor", p, g, s, step=torch.tensor(3, device="meta"))


def _meta(v: float) -> torch.Tensor:
    return torch.tensor(v, device="meta")


META_HPARAMS = [
    ({"lr": _meta(1e-3)}, "lr"),
    ({"weight_decay": _meta(0.1)}, "weight_decay"),
    ({"betas": (_meta(0.9), 0.999)}, re.escape("betas[0]")),
    ({"lr": torch.tensor(1e-3), "eps": _meta(1e-8)}, "eps"),  # beside a tensor that has a value
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", UPDATES, ids=UPDATE_IDS)
@pytest.mark.parametrize(("hparams", "name"), META_HPARAMS, ids=["lr", "weight_decay", "betas", "eps"])
def test_a_meta_hparam_is_named(setup, fn, hparams, name):
    """A meta hyperparameter has no value either: refused where the step reads its hyperparameters' values (torch's
    copy to the params' device raised "Cannot copy out of meta tensor" naming nothing). make_hparams takes one: the
    capture checks stand meta tensors for a device's (tests/test_capture_checks.py). update_ also through the plan
    its earlier steps of these very containers made."""
    p, g, s = setup
    expect_error(fn, ValueError, f"^{name} is a meta tensor: it has no value to step with$", p, g, s, hparams)
    params, grads, states = {"w": p}, {"w": g}, {"w": s}
    for step in (2, 3):  # update_'s cached plan of these containers
        fn(params, grads, states, {"lr": 1e-3}, step)
    expect_error(fn, ValueError, f"^{name} is a meta tensor", params, grads, states, hparams)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [8, 32])
def test_a_meta_starting_value_is_named(device, bits):
    """A state made from a meta hyperparameter's value (Adagrad's initial_accumulator_value) is refused naming it,
    where torch's float() raised "Tensor.item() cannot be called on meta tensors"; a meta hyperparameter the state
    does not start from (lr) is taken, as the capture checks take one."""
    p = torch.randn(300, device=device)
    snap = snapshot(p)
    spec = bnbf.OptimSpec(rule="adagrad", state_bits=bits, min_8bit_size=0)
    with pytest.raises(ValueError, match="^initial_accumulator_value is a meta tensor: it has no value to start"):
        bnbf.init_state(p, spec, {"initial_accumulator_value": _meta(0.1)})
    assert_untouched(snap, "after a refused init_state")
    s = bnbf.init_state(p, spec, {"lr": _meta(0.1), "initial_accumulator_value": 0.1})
    assert bool((bnbf.dequantize_state(s)["sum"] > 0).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", UPDATES, ids=UPDATE_IDS)
def test_a_meta_hparam_is_named_on_every_path(device, fn):
    """The packed state, per-leaf hyperparameters and mixed rules (bnbf.compose), the differentiable step, and a
    meta max_unorm or max_grad_norm: refused naming it, nothing written (compose checks every leaf's before it
    steps the first)."""
    p = {"a": torch.randn(300, device=device), "b": torch.randn(4, 300, device=device)}
    g = {k: torch.randn_like(v) * 0.01 for k, v in p.items()}
    meta_lr = {"lr": _meta(1e-3)}
    packed = bnbf.init_state(p, spec(), packed=True)
    expect_error(fn, ValueError, "^lr is a meta tensor", p, g, packed, meta_lr)
    s = bnbf.init_state(p, spec())
    per_leaf = {"a": {"lr": 1e-3}, "b": meta_lr}
    expect_error(fn, ValueError, "^lr is a meta tensor", p, g, s, per_leaf)
    mixed = {"a": bnbf.init_state(p["a"], spec("sgd")), "b": s["b"]}
    expect_error(fn, ValueError, "^lr is a meta tensor", p, g, mixed, {"sgd": {"lr": 1e-3}, "adamw": meta_lr})
    s32 = bnbf.init_state(p, spec(bits=32))
    for state, hparams, options, name in [
        (s, {"lr": 1e-3}, {"max_unorm": _meta(1.0)}, "max_unorm"),
        (s, {"lr": 1e-3}, {"max_grad_norm": _meta(1.0)}, "max_grad_norm"),
        (s32, meta_lr, {"differentiable": True}, "lr"),
        (s32, {"lr": 1e-3}, {"differentiable": True, "max_unorm": _meta(1.0)}, "max_unorm"),
    ]:
        snap = snapshot(p, g, state)
        with pytest.raises(ValueError, match=f"^{name} is a meta tensor"):
            fn(p, g, state, hparams, 2, **options)
        assert_untouched(snap, f"{fn.__name__} with a meta {name}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", UPDATES, ids=UPDATE_IDS)
@pytest.mark.parametrize("value", ["1", None, True, 1j, [1.0]], ids=["str", "None", "bool", "complex", "list"])
def test_a_max_unorm_of_another_type_is_named_on_every_path(device, fn, value):
    """max_unorm="1" (a config's string) failed a bare comparison ("'>=' not supported between instances of 'str'
    and 'float'"), None a float() deep in the step: refused naming max_unorm, as max_grad_norm is (bool too, as
    there), on the per-param and packed states, per-leaf and mixed-rule calls (compose), the differentiable step
    and with max_grad_norm; nothing written."""
    p = {"a": torch.randn(300, device=device), "b": torch.randn(4, 300, device=device)}
    g = {k: torch.randn_like(v) * 0.01 for k, v in p.items()}
    s = bnbf.init_state(p, spec())
    mixed = {"a": bnbf.init_state(p["a"], spec("sgd")), "b": s["b"]}
    match = f"^max_unorm must be a number or a 1-element tensor, got {type(value).__name__}$"
    for state, hparams, options in [
        (s, {"lr": 1e-3}, {}),
        (bnbf.init_state(p, spec(), packed=True), {"lr": 1e-3}, {}),
        (s, {"a": {"lr": 1e-3}, "b": {"lr": 1e-2}}, {}),
        (mixed, {"sgd": {"lr": 1e-3}, "adamw": {"lr": 1e-3}}, {}),
        (s, {"lr": 1e-3}, {"max_grad_norm": 1.0}),
        (bnbf.init_state(p, spec(bits=32)), {"lr": 1e-3}, {"differentiable": True}),
    ]:
        expect_error(fn, TypeError, match, p, g, state, hparams, max_unorm=value, **options)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", UPDATES, ids=UPDATE_IDS)
@pytest.mark.parametrize("step", [1.0, 2.5, "float_tensor", "shape_1", torch.uint8, torch.int8, torch.int16])
def test_non_integer_step(setup, fn, step, device):
    p, g, s = setup
    if step == "float_tensor":
        step = torch.tensor(2.0, device=device)
    elif step == "shape_1":  # one element but not 0-d: torch's own step tensors are 0-d
        step = torch.tensor([2], device=device)
    elif isinstance(step, torch.dtype):  # a count that wraps (the step hashes step % 2**24, which is 0 there)
        step = torch.tensor(2, dtype=step, device=device)
    expect_error(fn, TypeError, "step must be an int or a 0-d int32/int64 tensor", p, g, s, step=step)


def test_invalid_spec():
    # a number of another type is refused as block_size=256.0 always was (8.0 and True passed as state_bits and
    # min_8bit_size), whatever the value would compare as
    bad = ({"rule": "nope"}, {"state_bits": 4}, {"block_size": 100}, {"min_8bit_size": -1}, {"state_bits": 8.0},
           {"state_bits": True}, {"min_8bit_size": True}, {"block_size": 256.0})  # fmt: skip
    for kw in bad:
        with pytest.raises(ValueError, match="unknown rule" if "rule" in kw else f"{next(iter(kw))} must be"):
            bnbf.OptimSpec(**kw)


def test_state_nbytes_counts_the_tensors():
    """The bytes of a state's tensors, of a tree of states, of a packed state's buffers, and of any tree of
    tensors (torch.optim's state, which the notebooks compare with)."""
    params = {"w": torch.randn(300), "b": torch.randn(7)}
    state = bnbf.init_state(params, bnbf.OptimSpec(min_8bit_size=256))
    fields = [t for s in state.values() for t in s]
    assert bnbf.state_nbytes(state) == sum(t.numel() * t.element_size() for t in fields)
    packed = bnbf.init_state(params, bnbf.OptimSpec(min_8bit_size=256), packed=True)
    assert bnbf.state_nbytes(packed) == sum(t.numel() * t.element_size() for t in packed.buffers)
    torch_state = {0: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(300)}}
    assert bnbf.state_nbytes(torch_state) == 4 + 1200 and bnbf.state_nbytes({}) == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", UPDATES, ids=UPDATE_IDS)
@pytest.mark.parametrize(
    "kw,exc,match",
    [
        ({"skip_zeros": "yes"}, TypeError, "skip_zeros must be a bool"),
        ({"max_unorm": -1.0}, ValueError, "Invalid max_unorm value: -1.0"),
    ],
)
def test_bad_update_options(setup, fn, kw, exc, match):
    p, g, s = setup
    snap = snapshot(p, g, s)
    with pytest.raises(exc, match=match):
        fn(p, g, s, {}, 2, **kw)
    assert_untouched(snap, f"{fn.__name__} after {kw}")


@pytest.mark.parametrize(
    "rule, key, extra",
    [
        ("sgd", "nesterov", {"momentum": 0.9}),
        ("lars", "nesterov", {"momentum": 0.9}),
        ("rmsprop", "centered", {}),
        ("lamb", "adam", {}),
        ("lamb", "debias", {}),
        ("adam", "amsgrad", {}),
        ("adan", "no_prox", {}),
    ],
)
@pytest.mark.parametrize("value", ["False", 1])
def test_switches_must_be_bools(rule, key, extra, value):
    """A rule's switches decide its arithmetic (and for some, which states exist): a string "False" read by truth
    value stepped SGD with Nesterov momentum (0.37 off after one step at lr 0.1). Refused in words, as amsgrad was,
    nothing written."""
    p, g = torch.randn(300), torch.randn(300)
    s = bnbf.init_state(p, bnbf.OptimSpec(rule=rule, min_8bit_size=0), extra)
    before = [p.clone(), *(t.clone() for t in s)]
    with pytest.raises(TypeError, match=f"{key} must be a bool, got {type(value).__name__}"):
        bnbf.update_(p, g, s, {**extra, key: value}, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, [p, *s]))


def test_two_fields_of_one_state_sharing_memory_are_named():
    """exp_avg and exp_avg_sq as one tensor: the error named the leaf twice ("state['w'] and state['w'] are the
    same state"); it names the two fields."""
    p = torch.randn(300)
    s = bnbf.init_state(p, bnbf.OptimSpec(rule="adamw", state_bits=32))
    s = type(s)(s.exp_avg, s.exp_avg)
    for fn in (bnbf.update, bnbf.update_):
        with pytest.raises(ValueError, match=r"state\['w'\].exp_avg and state\['w'\].exp_avg_sq overlap in memory"):
            fn({"w": p}, {"w": torch.randn(300)}, {"w": s}, {}, 1)


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        ({"dtype": "float32"}, TypeError, "dtype must be a floating-point torch.dtype"),  # "Invalid device string"
        ({"dtype": torch.int64}, TypeError, "dtype must be a floating-point torch.dtype"),  # truncated the values
        ({"block_size": True}, ValueError, "block_size must be a positive power of two, got True"),  # read as 1
    ],
)
def test_dequantize_blockwise_refuses_what_it_cannot_return(kw, exc, match):
    codes, absmax = bnbf.quantize_blockwise(torch.randn(300))
    with pytest.raises(exc, match=match):
        bnbf.dequantize_blockwise(codes, absmax, **kw)


@pytest.mark.parametrize("where", ["maximize", "amsgrad"])
def test_a_numpy_bool_flag_is_named_with_its_module(where):
    """numpy 2 names its bool type ``bool``: the error read "must be a bool, got bool"."""
    np = pytest.importorskip("numpy")
    p = torch.randn(3)
    s = bnbf.init_state(p, bnbf.OptimSpec(rule="adamw", state_bits=32))
    kw, hp = ({"maximize": np.True_}, {}) if where == "maximize" else ({}, {"amsgrad": np.True_})
    with pytest.raises(TypeError, match=rf"^{where} must be a bool, got numpy\.bool"):
        bnbf.update(p, p.clone(), s, hp, 1, **kw)

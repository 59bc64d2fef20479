"""bnbf_nn's torch-named classes against torch's own optimizer test data.

torch keeps, per optimizer, the constructor arguments its generic tests run (``OptimizerInfo.optim_inputs_func``)
and bad arguments with the error each must raise (``optim_error_inputs_func``), in
``torch.testing._internal.common_optimizers.optim_db`` of the installed wheel. Every entry of the families
bnbf_nn shares with torch (Adam, AdamW, SGD, RMSprop, Adagrad) runs here against our ``X32bit`` and ``X8bit``
classes:

- each input: our class and torch's with the same arguments train the same small model on the same batches;
  32-bit: every param change and state element within ``tolerances.STATE32`` (bitsandbytes' 32-bit bar) of
  torch's, or within 4 times torch's own float32-vs-float64 difference where rounding makes that larger
  (:func:`noise`); 8-bit (``min_8bit_size=0``, every tensor 8-bit): each tensor's change within ``BOUND8`` of
  torch's change, relative;
- each error input: our class raises torch's error type with torch's message (regex), torch itself too.

Where bnbf_nn differs on purpose, :data:`KNOWN` names the difference and why (README.md's "Migrating from
bitsandbytes" lists them), and the test checks the difference itself. Also here: torch's conventions for
``optimizer.state`` keys that are not params (state-dict hooks), and the signatures against torch's.

Under ``TRITON_INTERPRET=1`` (every step a kernel launch in the interpreter) only the inputs with
``maximize`` or ``amsgrad``, the switches added for this contract, run, for 3 steps; the error inputs all run.
"""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch
from tolerances import STATE32, assert_close_report

import bnbf
import bnbf_nn
from bnbf._dispatch import interpreting

# argument checks, errors and plumbing, not kernel numerics: the interpreter pass skips them (conftest)
pytestmark = pytest.mark.surface

# torch's harness imports expecttest (our test extra installs it; the GPU machine's image lacks it)
pytest.importorskip("expecttest", reason="torch's optimizer test harness needs expecttest (pip install expecttest)")
with warnings.catch_warnings():  # the harness module adds warning filters of its own when imported
    from torch.testing._internal import common_optimizers as harness

INTERP = interpreting()
NAMES = ("Adam", "AdamW", "SGD", "RMSprop", "Adagrad")
INFOS = {info.optim_cls.__name__: info for info in harness.optim_db if info.optim_cls.__name__ in NAMES}
assert set(INFOS) == set(NAMES), f"optim_db lacks {set(NAMES) - set(INFOS)}"

# differences kept on purpose: (family or "*", what) -> why. Each is checked below, not just skipped.
KNOWN = {
    ("SGD", "lr"): "bitsandbytes' SGD has no default lr, and bnbf_nn keeps bitsandbytes' signatures: inputs "
    "without lr pass torch's default, 1e-3",
    ("*", "duplicate parameters"): "a tensor listed twice in one param group raises ValueError (torch warns): "
    "a group is one fused bnbf.update_ call, which would write the tensor twice",
    ("Adam", "decoupled_weight_decay"): "not an argument of bnbf_nn.Adam: use bnbf_nn.AdamW",
    ("*", "keyword-only"): "arguments after lr are keyword-only (torch's RMSprop and Adagrad take foreach, "
    "capturable positionally): bitsandbytes' positional orders differ between its classes",
}
KNOWN_ERRORS = {"a param group cannot have duplicate parameters": ValueError}  # torch: a UserWarning
SGD_LR = 1e-3  # torch.optim.SGD's default lr

# 8-bit bound: each tensor's change after the steps within 5% of torch's (relative L2). Seen: at most 1.6%
# (Adam, 8 steps). An option ignored moves the change by 50-800% in most inputs; where one moves it by less
# in 8 steps (amsgrad 0.004%: with torch's β2 0.999 exp_avg_sq hardly falls; AdamW's weight decay 0.01 -> 0.1
# 4.5%; RMSprop centered 0.8%), the 32-bit pass (every state too, max_exp_avg_sq included) and
# tests/test_rules.py (amsgrad with β2 0.9) pin it
BOUND8 = 0.05
SCALES = (1.0, 3.0, 1.0, 0.3, 1.0, 0.1, 0.3, 0.1)  # batch scales: gradients that grow and shrink
STEPS = 3 if INTERP else len(SCALES)


def _interp_subset(desc: str) -> bool:
    return "maximize" in desc or "amsgrad" in desc


def _inputs():
    out = []
    for name in NAMES:
        for k, oi in enumerate(INFOS[name].optim_inputs_func(device="cpu")):
            if INTERP and not _interp_subset(oi.desc):
                continue
            for bits in (32, 8):
                out.append(pytest.param(name, bits, k, id=f"{name}{bits}bit-{oi.desc}"))
    return out


def _error_inputs():
    out = []
    for name in NAMES:
        for k, e in enumerate(INFOS[name].optim_error_inputs_func(device="cpu", dtype=torch.float32)):
            for bits in (32, 8):
                out.append(pytest.param(name, bits, k, id=f"{name}{bits}bit-{e.optimizer_error_input.desc}"))
    return out


def our_kwargs(name: str, kwargs: dict) -> dict:
    kw = copy.deepcopy(kwargs)
    if name == "SGD":  # KNOWN[("SGD", "lr")]
        kw.setdefault("lr", SGD_LR)
    return kw


def make_params(dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    """A 16-32-4 MLP's weights and biases (512, 32, 128, 4 elements)."""
    g = torch.Generator().manual_seed(0)
    shapes = [(32, 16), (32,), (4, 32), (4,)]
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.3).to(dtype)) for s in shapes]


def train(opt: torch.optim.Optimizer, params: list) -> None:
    """``STEPS`` steps on fixed batches (the same numbers whatever the params' dtype)."""
    g = torch.Generator().manual_seed(1)
    dtype = params[0].dtype
    for scale in SCALES[:STEPS]:
        x, y = (torch.randn(64, 16, generator=g) * scale).to(dtype), torch.randn(64, 4, generator=g).to(dtype)
        w1, b1, w2, b2 = params
        loss = ((torch.tanh(x @ w1.T + b1) @ w2.T + b2 - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


# ------------------------------------------------------------------------------------------------
# torch's inputs: the same training as torch's optimizer


def noise(float32: torch.Tensor, float64: torch.Tensor) -> float:
    """4 times the largest difference between torch's float32 and float64 results: the error float32 rounding
    alone makes here, which some inputs amplify far past STATE32's bar (centered RMSprop divides by
    sqrt(square_avg - grad_avg²); with maximize and weight decay, -g + wd·p cancels), so that a correct
    float32 step with another order of operations differs by about twice that; 4 for margin. On most
    inputs it is below STATE32's atol, which then applies."""
    return 4 * (float32.double() - float64).abs().max().item()


@pytest.mark.parametrize(("name", "bits", "k"), _inputs())
def test_torch_inputs_train_like_torch(name, bits, k):
    oi = INFOS[name].optim_inputs_func(device="cpu")[k]
    ours, theirs = make_params(), make_params()
    p0 = [p.detach().clone() for p in ours]
    cls = getattr(bnbf_nn, f"{name}{bits}bit")
    opt = cls(ours, **our_kwargs(name, oi.kwargs), **({"min_8bit_size": 0} if bits == 8 else {}))
    ref = INFOS[name].optim_cls(theirs, **copy.deepcopy(oi.kwargs))
    train(opt, ours)
    train(ref, theirs)
    if bits == 32:  # torch in float64 too: how far float32 rounding alone moves this run (see noise())
        exact = make_params(torch.float64)
        kw64 = {k: v.double() if isinstance(v, torch.Tensor) else v for k, v in copy.deepcopy(oi.kwargs).items()}
        ref64 = INFOS[name].optim_cls(exact, **kw64)
        train(ref64, exact)
    for i, (p, q, start) in enumerate(zip(ours, theirs, p0)):
        what = f"{name}{bits}bit({oi.kwargs}) param {i}"
        ours_change, torch_change = p.detach() - start, q.detach() - start
        if bits == 32:
            t = STATE32[(torch.float32, 32)]
            exact_change = exact[i].detach() - start.double()
            atol = max(t.atol, noise(torch_change, exact_change))
            assert_close_report(ours_change, torch_change, atol, t.rtol, f"{what}: change")
            moments = bnbf.dequantize_state(opt.state[p]["state"])
            kept = {k: v for k, v in ref.state[q].items() if k != "step"}
            assert set(moments) == set(kept), f"{what}: states {sorted(moments)}, torch's {sorted(kept)}"
            for key, v in kept.items():
                atol = max(t.atol, noise(v, ref64.state[exact[i]][key]))
                assert_close_report(moments[key], v, atol, t.rtol, f"{what}: state {key}")
        else:
            s = opt.state[p]["state"]
            assert not s or all(f.dtype == torch.uint8 for f in s[::2]), f"{what}: state {type(s).__name__}"
            err = ((ours_change - torch_change).norm() / torch_change.norm()).item()
            assert err <= BOUND8, f"{what}: change {err:.2%} away from torch's (bound {BOUND8:.0%})"
        assert opt.state[p]["step"] == STEPS


# ------------------------------------------------------------------------------------------------
# torch's error inputs: the same error


@pytest.mark.parametrize(("name", "bits", "k"), _error_inputs())
def test_torch_error_inputs_raise_the_same(name, bits, k):
    e = INFOS[name].optim_error_inputs_func(device="cpu", dtype=torch.float32)[k]
    oi = e.optimizer_error_input
    cls = getattr(bnbf_nn, f"{name}{bits}bit")

    def expect(make, kind):
        check = pytest.warns if issubclass(kind, Warning) else pytest.raises
        if e.error_on == harness.OptimizerErrorEnum.STEP_ERROR:
            opt = make()
            for group in opt.param_groups:
                for p in group["params"]:
                    p.grad = torch.ones_like(p)
            with check(kind, match=e.error_regex):
                opt.step()
        else:
            with check(kind, match=e.error_regex):
                make()

    # torch's own optimizer first: the data applies to the installed torch
    expect(lambda: INFOS[name].optim_cls(oi.params, **copy.deepcopy(oi.kwargs)), e.error_type)
    expect(lambda: cls(oi.params, **our_kwargs(name, oi.kwargs)), KNOWN_ERRORS.get(oi.desc, e.error_type))


def test_known_differences_hold():
    """What KNOWN says, checked (the harness tests above adapt their inputs to it)."""
    p = torch.nn.Parameter(torch.randn(2, 3))
    with pytest.raises(TypeError, match="lr"):
        bnbf_nn.SGD8bit([p])
    torch.optim.SGD([p])  # torch has a default
    with pytest.raises(TypeError, match="decoupled_weight_decay"):
        bnbf_nn.Adam([p], decoupled_weight_decay=True)
    with pytest.raises(TypeError):
        bnbf_nn.RMSprop([p], 1e-2, 0.99, 1e-8, 0.0, 0.0, False, False)
    torch.optim.RMSprop([p], 1e-2, 0.99, 1e-8, 0.0, 0.0, False, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no torch warning before our error
        with pytest.raises(ValueError, match="duplicate parameters"):
            bnbf_nn.Adagrad([p, p])
    with pytest.warns(UserWarning, match="duplicate parameters"):
        torch.optim.Adagrad([p, p])


@pytest.mark.parametrize("name", NAMES)
def test_signature_has_torch_arguments_and_defaults(name):
    """Every argument of the torch class, with its default, except the differences named in KNOWN."""
    theirs = inspect.signature(INFOS[name].optim_cls).parameters
    ours = inspect.signature(getattr(bnbf_nn, name)).parameters
    for arg, p in theirs.items():
        if arg == "params" or (name, arg) in KNOWN:
            continue
        assert arg in ours, f"bnbf_nn.{name} lacks torch's argument {arg!r}"
        assert ours[arg].default == p.default, f"{name}({arg}=...): default {ours[arg].default!r} != {p.default!r}"


# ------------------------------------------------------------------------------------------------
# torch's implementation switches: capturable and differentiable are taken with torch's meaning (what they do:
# tests/test_nn_func.py), foreach and fused are accepted and change nothing


@pytest.mark.parametrize("name", NAMES)
def test_implementation_switches(name):
    cls = getattr(bnbf_nn, f"{name}8bit")
    flags = inspect.signature(INFOS[name].optim_cls).parameters
    kw = our_kwargs(name, {})
    for flag in ("differentiable", "capturable"):
        if flag in flags:
            opt = cls([torch.nn.Parameter(torch.randn(3))], **kw, **{flag: True})
            assert opt.param_groups[0][flag] is True, flag
    accepted = [{"foreach": True}, {"foreach": False}]
    if "fused" in flags:  # bnbf's step is fused anyway; torch runs fused steps on the CPU too
        accepted.append({"fused": True})
        with pytest.raises(RuntimeError, match="`fused` and `foreach` cannot be `True` together"):
            cls([torch.nn.Parameter(torch.randn(3))], **kw, fused=True, foreach=True)
    for extra in accepted:
        params = make_params()
        opt = cls(params, **kw, **extra, min_8bit_size=0)
        # the switches are checked and kept, never read by the step: in the interpreter pass one family trains
        # with them (its steps launch the kernels), every family in the plain pass
        if not INTERP or name == "Adam":
            plain = make_params()
            train(opt, params)
            train(cls(plain, **kw, min_8bit_size=0), plain)
            for p, q in zip(params, plain):
                assert torch.equal(p, q), f"{name}8bit({extra}) stepped otherwise than without it"
        assert all(g[k] == v for g in opt.param_groups for k, v in extra.items())  # kept, as torch keeps them


# ------------------------------------------------------------------------------------------------
# optimizer.state keys that are not params: torch keeps them in state_dict() and load_state_dict()


def _hooked_session(opt, params) -> dict:
    """What torch's state-dict hook tests observe, for any optimizer."""
    out = {}
    train(opt, params)
    h = opt.register_state_dict_pre_hook(lambda o: o.state.__setitem__("test", 1))
    sd = opt.state_dict()
    out["saved"] = sd["state"].get("test")

    def post(o, sd):
        sd["ran_pre_hook"] = sd["state"].pop("test", None) == 1
        return sd

    hp = opt.register_state_dict_post_hook(post)
    sd2 = opt.state_dict()
    out["after_post"] = ("test" in sd2["state"], sd2.get("ran_pre_hook"))
    hp.remove()
    h.remove()
    del opt.state["test"]
    sd = opt.state_dict()
    sd["state"]["note"] = {"epoch": 3}  # a key that is not a param index
    opt.register_load_state_dict_pre_hook(lambda o, d: d["param_groups"][0].__setitem__("lr", 0.002))
    opt.register_load_state_dict_post_hook(lambda o: o.state.__setitem__("loaded", o.param_groups[0]["lr"]))
    opt.load_state_dict(sd)
    out["loaded"] = (opt.state["note"], opt.state["loaded"], opt.param_groups[0]["lr"])
    train(opt, params)  # and it still steps
    return out


@pytest.mark.parametrize("name", ["Adam8bit", "SGD32bit"])
def test_non_param_state_keys_like_torch(name):
    ours = getattr(bnbf_nn, name)
    torch_cls = getattr(torch.optim, name.removesuffix("8bit").removesuffix("32bit"))
    kw = {"lr": 0.01, "momentum": 0.9} if name.startswith("SGD") else {"lr": 0.01}
    params = make_params()
    got = _hooked_session(ours(params, **kw, min_8bit_size=0), params)
    theirs = make_params()
    want = _hooked_session(torch_cls(theirs, **kw), theirs)
    assert got == want == {"saved": 1, "after_post": (False, True), "loaded": ({"epoch": 3}, 0.002, 0.002)}


def test_int_state_keys_refused():
    """An int key would come back as a param index: refused when saving (torch would mix it up the same way)."""
    params = make_params()
    opt = bnbf_nn.AdamW8bit(params, min_8bit_size=0)
    train(opt, params)
    opt.state[7] = "x"
    with pytest.raises(ValueError, match=r"int keys \[7\]"):
        opt.state_dict()

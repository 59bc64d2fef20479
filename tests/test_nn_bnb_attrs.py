"""bitsandbytes' public optimizer attributes that user code written for it reads: ``args``, ``optimizer_name``,
``initialized``, ``name2qmap``/``fill_qmap()``, ``mng``, ``non_castable_tensor_keys`` and ``get_config``, each
checked against what the optimizer does (its settings, the states its step makes, what loading keeps), plus
deepcopy and pickles, old ones included."""

from __future__ import annotations

import copy
import inspect
import math
import pickle
from types import SimpleNamespace

import pytest
import torch
from tolerances import assert_equal_report

import bnbf
import bnbf_nn
from bnbf_nn._checkpoint import QUANT_KEY

BNB_CONFIG_KEYS = [  # bitsandbytes' get_config, in its order
    "betas", "eps", "weight_decay", "lr", "alpha", "t_alpha", "t_beta3",
    "optim_bits", "min_8bit_size", "max_unorm", "skip_zeros",
]  # fmt: skip
# bitsandbytes' Optimizer8bit.non_castable_tensor_keys
BNB_NON_CASTABLE = {
    "qmap1", "qmap2", "max1", "max2", "new_max1", "new_max2", "state1", "state2",
    "gnorm_vec", "absmax1", "absmax2", "unorm_vec",
}  # fmt: skip


def _params(*shapes, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def _step(opt, params, seed=1):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.device, p.dtype)
    opt.step()


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda ps: bnbf_nn.Adam(ps), "adam"),  # bitsandbytes' Adam and AdamW both step "adam"
        (lambda ps: bnbf_nn.AdamW8bit(ps), "adam"),
        (lambda ps: bnbf_nn.PagedAdamW32bit(ps), "adam"),
        (lambda ps: bnbf_nn.Lion(ps), "lion"),
        (lambda ps: bnbf_nn.SGD8bit(ps, 0.1, 0.9), "momentum"),
        (lambda ps: bnbf_nn.RMSprop(ps), "rmsprop"),
        (lambda ps: bnbf_nn.Adagrad32bit(ps), "adagrad"),
        (lambda ps: bnbf_nn.LAMB(ps), "lamb"),
        (lambda ps: bnbf_nn.LARS(ps, 0.1), "lars"),
        (lambda ps: bnbf_nn.AdEMAMix(ps), "ademamix"),
        (lambda ps: bnbf_nn.Adan(ps), None),  # not in bitsandbytes
        (lambda ps: bnbf_nn.Optimizer1State("momentum", ps), "momentum"),
        (lambda ps: bnbf_nn.Optimizer2State("lamb", ps), "lamb"),
    ],
)
def test_optimizer_name_is_bitsandbytes_name(make, name):
    assert make(_params(8)).optimizer_name == name


def test_args_reports_the_settings_the_optimizer_uses():
    """``args`` has bitsandbytes' four attributes as the optimizer resolved them (the arguments, the caller's
    ``args`` winning where it has one), the state follows them, and a write is refused (it would change nothing)."""
    ps = _params((64, 80))
    opt = bnbf_nn.AdamW(ps, optim_bits=32, max_unorm=0.5, args=SimpleNamespace(optim_bits=8, min_8bit_size=100.0))
    a = opt.args
    assert (a.optim_bits, a.min_8bit_size, a.max_unorm, a.skip_zeros) == (8, 100, 0.5, False)
    _step(opt, ps)
    assert opt.state[ps[0]]["state1"].dtype == torch.uint8
    plain = bnbf_nn.Lion32bit(_params(8), skip_zeros=True, min_8bit_size=7)
    assert (plain.args.optim_bits, plain.args.min_8bit_size, plain.args.skip_zeros) == (32, 7, True)
    with pytest.raises(AttributeError, match="read-only"):
        opt.args.optim_bits = 32
    with pytest.raises(AttributeError, match="percentile_clipping"):
        opt.args.percentile_clipping  # noqa: B018
    assert opt.args.optim_bits == 8 and copy.copy(opt.args).min_8bit_size == 100


def test_initialized_and_name2qmap_as_bitsandbytes_sets_them(device):
    """``initialized`` turns True at the first step; ``name2qmap`` is filled at construction with 8-bit state,
    else when a step makes the first 8-bit state (here an override's), on that param's device."""
    ps = _params((64, 80))
    eight = bnbf_nn.AdamW8bit(ps)
    assert eight.initialized is False and sorted(eight.name2qmap) == ["dynamic", "udynamic"]
    _step(eight, ps)
    assert eight.initialized is True
    qs = _params((64, 80), 8)
    opt = bnbf_nn.AdamW(qs)
    assert opt.name2qmap == {} and opt.initialized is False
    _step(opt, qs)  # 32-bit state only
    assert opt.name2qmap == {} and opt.initialized is True
    late = [torch.nn.Parameter(p.detach().to(device)) for p in _params((64, 80))]
    opt.add_param_group({"params": late})
    bnbf_nn.GlobalOptimManager.get_instance().override_config(late[0], "optim_bits", 8)
    _step(opt, qs + late)
    assert opt.state[late[0]]["state1"].dtype == torch.uint8
    assert sorted(opt.name2qmap) == ["dynamic", "udynamic"]
    assert {m.device for m in opt.name2qmap.values()} == {late[0].device}


def test_fill_qmap_makes_bitsandbytes_dynamic_maps():
    """The two maps: 256 sorted float32 values, the signed one in [-1, 1] with negatives, the unsigned one in [0, 1],
    both holding 0 and 1; bnbf's dynamic map (tests/test_quant.py checks it against bitsandbytes'), which a
    ``state_format="dynamic"`` optimizer's states carry as their qmaps."""
    ps = _params((64, 80))
    opt = bnbf_nn.AdamW(ps, optim_bits=8, state_format="dynamic")
    opt.name2qmap.clear()
    opt.fill_qmap()
    for key, signed in (("dynamic", True), ("udynamic", False)):
        m = opt.name2qmap[key]
        assert m.dtype == torch.float32 and m.shape == (256,), key
        assert torch.equal(m, m.sort().values), key
        assert float(m.min()) >= (-1.0 if signed else 0.0) and float(m.max()) == 1.0, key
        assert (float(m.min()) < 0) == signed and bool((m == 0).any()), key
        assert_equal_report(m, bnbf.create_dynamic_map(signed=signed), key)
    _step(opt, ps)
    assert_equal_report(opt.state[ps[0]]["qmap1"], opt.name2qmap["dynamic"], "qmap1")
    assert_equal_report(opt.state[ps[0]]["qmap2"], opt.name2qmap["udynamic"], "qmap2")


def test_mng_is_the_manager_the_step_reads():
    ps = _params((64, 80))
    opt = bnbf_nn.AdamW8bit(ps)
    assert opt.mng is bnbf_nn.GlobalOptimManager.get_instance()
    hooks = ("init_state", "update_step", "to_gpu", "check_overrides", "prefetch_state", "get_state_buffer")
    absent = ("page_mng", *hooks)
    assert not [name for name in absent if hasattr(opt, name)]  # not faked: nothing here would call them
    opt.mng.override_config(ps[0], "optim_bits", 32)
    _step(opt, ps)
    assert opt.state[ps[0]]["state1"].dtype == torch.float32


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: bnbf_nn.AdamW(ps, optim_bits=8, amsgrad=True, min_8bit_size=0),
        lambda ps: bnbf_nn.AdamW32bit(ps, amsgrad=True),
        lambda ps: bnbf_nn.RMSprop8bit(ps, momentum=0.9, centered=True, min_8bit_size=0),
        lambda ps: bnbf_nn.AdEMAMix8bit(ps, min_8bit_size=0),
    ],
)
def test_non_castable_tensor_keys_are_what_loading_keeps_uncast(make):
    """bitsandbytes' set and every state entry this optimizer saves (state3 of amsgrad and RMSprop's buffers too)
    are in it, ``step`` is not; loading into bfloat16 params keeps each such entry's dtype (uint8 codes, float32
    values, maps and scales), where a cast to the params' dtype would have made them bfloat16."""
    ps = _params((16, 40), dtype=torch.bfloat16)
    opt = make(ps)
    keys = opt.non_castable_tensor_keys
    assert keys >= BNB_NON_CASTABLE and "step" not in keys
    _step(opt, ps)
    saved = opt.state_dict()["state"][0][QUANT_KEY]
    assert set(saved) <= keys
    assert "state3" in saved or "AdEMAMix" in type(opt).__name__  # amsgrad's maximum, RMSprop's third buffer
    dtypes = {k: v.dtype for k, v in saved.items()}
    twin = make(_params((16, 40), dtype=torch.bfloat16))
    twin.load_state_dict(opt.state_dict())
    loaded = twin.state_dict()["state"][0][QUANT_KEY]
    assert {k: v.dtype for k, v in loaded.items()} == dtypes
    assert torch.bfloat16 not in dtypes.values()


def test_get_config_without_overrides_spells_settings_as_bitsandbytes():
    """bitsandbytes' keys in its order, and its spelling of each family's settings."""
    p = _params((8,))
    cfg = lambda opt: opt.get_config(0, 0, opt.param_groups[0])  # noqa: E731
    adamw = cfg(bnbf_nn.AdamW8bit(p, lr=0.01))
    assert list(adamw) == BNB_CONFIG_KEYS
    assert adamw == dict(zip(BNB_CONFIG_KEYS, [(0.9, 0.999), 1e-8, 1e-2, 0.01, 0.0, None, None, 8, 4096, 0.0, False]))
    sgd = cfg(bnbf_nn.SGD(p, 0.1, 0.9, 0.2))
    assert (sgd["betas"], sgd["eps"], sgd["optim_bits"]) == ((0.9, 0.2), 0.0, 32)
    rms = cfg(bnbf_nn.RMSprop(p, alpha=0.95, momentum=0.5))
    assert (rms["betas"], rms["alpha"]) == ((0.95, 0.5), 0.0)  # bitsandbytes' one-state groups have no alpha
    assert cfg(bnbf_nn.Adagrad(p))["betas"] == (0.0, 0.0)
    assert cfg(bnbf_nn.Lion(p))["eps"] == 0.0
    ademamix = cfg(bnbf_nn.AdEMAMix(p, alpha=4.0, t_alpha=10, t_beta3=20))
    assert (ademamix["alpha"], ademamix["t_alpha"], ademamix["t_beta3"]) == (4.0, 10, 20)
    assert cfg(bnbf_nn.LAMB(p))["max_unorm"] == 0.0  # its trust ratio stands for bitsandbytes' clipping


def test_get_config_reports_storage_overrides_the_step_makes():
    """optim_bits overrides (a module override, a parameter override): get_config reports them and each param's
    state is what they say, 8-bit only at min_8bit_size elements."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 80), torch.nn.Linear(80, 64))
    mng = bnbf_nn.GlobalOptimManager.get_instance()
    mng.register_module_override(model[0], "weight", {"optim_bits": 32})
    opt = bnbf_nn.AdamW(model.parameters())
    mng.override_config(model[1].weight, "optim_bits", 8)
    configs = [opt.get_config(0, i, opt.param_groups[0]) for i in range(4)]
    assert [c["optim_bits"] for c in configs] == [32, 32, 8, 32]
    model(torch.randn(4, 64)).square().mean().backward()
    opt.step()
    for p, c in zip(model.parameters(), configs):
        eight = c["optim_bits"] == 8 and p.numel() >= c["min_8bit_size"]
        assert opt.state[p]["state1"].dtype == (torch.uint8 if eight else torch.float32), tuple(p.shape)


def test_get_config_reports_the_hyperparameters_the_step_uses():
    """A param's betas, lr and weight_decay overrides: get_config's values step it as a group of its own with them
    does, bit for bit, also after the group's lr changed (an lr override is relative to it)."""
    ps = _params((64, 80), 8)
    opt = bnbf_nn.AdamW(ps, lr=1e-2)
    opt.mng.override_config(ps[0], key_value_dict={"betas": (0.5, 0.6), "lr": 4e-3, "weight_decay": 0.0})
    twin_p = _params((64, 80))
    twin = None
    for i in range(3):
        c = opt.get_config(0, 0, opt.param_groups[0])
        if i == 0:
            assert (c["betas"], c["lr"], c["weight_decay"]) == ((0.5, 0.6), 4e-3, 0.0)
            twin = bnbf_nn.AdamW(twin_p, lr=c["lr"], betas=c["betas"], eps=c["eps"], weight_decay=c["weight_decay"])
        twin.param_groups[0]["lr"] = c["lr"]
        _step(opt, ps, seed=i)
        _step(twin, twin_p, seed=i)
        assert_equal_report(ps[0], twin_p[0], f"step {i}")
        opt.param_groups[0]["lr"] *= 0.5
    assert c["lr"] == pytest.approx(1e-3)
    sgd = bnbf_nn.SGD(_params(8), 0.1, 0.9)
    sgd.mng.override_config(sgd.param_groups[0]["params"][0], "betas", (0.5, 0.0))  # bitsandbytes' spelling
    assert sgd.get_config(0, 0, sgd.param_groups[0])["betas"] == (0.5, 0.0)


def test_override_config_takes_bitsandbytes_calling_forms():
    """bitsandbytes' override_config: key and value; key_value_dict; a dict beside a key whose value is None (the key
    ignored, the dict applied); a key with a None value alone overrides nothing. A key with a value and a dict too is
    refused, as is a call with neither, and such a call changes no setting."""
    mng = bnbf_nn.GlobalOptimManager.get_instance()
    p, q = torch.nn.Parameter(torch.zeros(8)), torch.nn.Parameter(torch.zeros(8))
    opt = bnbf_nn.AdamW([p, q], lr=1e-2)
    mng.override_config(p, "lr", None, {"optim_bits": 32, "betas": (0.5, 0.6)})
    mng.override_config(q, "eps", None)
    c = opt.get_config(0, 0, opt.param_groups[0])
    assert (c["optim_bits"], c["betas"], c["lr"]) == (32, (0.5, 0.6), 1e-2)
    assert opt.get_config(0, 1, opt.param_groups[0])["eps"] == opt.param_groups[0]["eps"]
    with pytest.raises(ValueError, match="not both"):
        mng.override_config(p, "lr", 1e-3, {"optim_bits": 8})
    with pytest.raises(ValueError, match="needs key and value"):
        mng.override_config(p)
    assert opt.get_config(0, 0, opt.param_groups[0])["optim_bits"] == 32


@pytest.mark.parametrize(
    "cls,key,value,error,match",
    [
        (bnbf_nn.LAMB8bit, "amsgrad", True, NotImplementedError, "amsgrad=True in param group 1 is not supported"),
        (bnbf_nn.Adan, "max_grad_norm", 1.0, NotImplementedError, "max_grad_norm=1.0 in param group 1 is not"),
        (bnbf_nn.LAMB, "bias_correction", "yes", TypeError, "debias must be a bool"),
        (bnbf_nn.AdamW8bit, "decoupled_weight_decay", False, ValueError, "steps AdamW's weight decay only"),
    ],
    ids=lambda v: getattr(v, "__name__", None) if isinstance(v, type) else None,
)
def test_get_config_refuses_a_hand_edit_the_next_step_refuses(cls, key, value, error, match):
    """A group setting written by hand that the next step reads and refuses (one bnbf's rule lacks, LAMB's
    bias_correction as its debias, torch's decoupled_weight_decay opposite to the class): get_config answered as if
    the group did not hold it; it reads the group as that step will, raising the step's error (which names the
    group), with the group kept."""
    ps = _params(8, 8)
    opt = cls([{"params": ps[:1]}, {"params": ps[1:]}])
    _step(opt, ps)
    group = opt.param_groups[1]
    group[key] = value
    kept = dict(group)
    with pytest.raises(error, match=match):
        opt.get_config(1, 0, group)
    with pytest.raises(error, match=match) as e:
        _step(opt, ps)
    assert "param group 1" in " ".join([str(e.value), *getattr(e.value, "__notes__", ())])  # (on the fast path too)
    assert group == kept
    assert list(opt.get_config(0, 0, opt.param_groups[0])) == BNB_CONFIG_KEYS  # the other group reads as it did


@pytest.mark.parametrize(
    "make, edit, error, match",
    [
        (lambda ps: bnbf_nn.AdamW8bit(ps), {"optim_bits": 7}, ValueError, "optim_bits must be 8 or 32"),
        (lambda ps: bnbf_nn.AdamW8bit(ps), {"min_8bit_size": -1}, ValueError, "min_8bit_size must be a non-neg"),
        (lambda ps: bnbf_nn.Lion(ps), {"state_format": "fancy"}, ValueError, "state_format must be one of"),
        (lambda ps: bnbf_nn.AdamW(ps), {"capturable": "yes"}, TypeError, "capturable must be a bool"),
        (lambda ps: bnbf_nn.Adam(ps), {"foreach": True, "lr": torch.tensor(1e-3)}, ValueError, "lr as a Tensor"),
        (lambda ps: bnbf_nn.Adam(ps), {"betas": (torch.tensor(0.9), 0.99)}, ValueError, "betas must be either"),
        (lambda ps: bnbf_nn.AdamW(ps), {"fused": True, "foreach": True}, RuntimeError, "cannot be `True` together"),
        (lambda ps: bnbf_nn.SGD(ps, 0.1, 0.9), {"fused": True, "differentiable": True}, RuntimeError, "`fused` does"),
    ],
    ids=["optim_bits", "min_8bit_size", "state_format", "capturable", "foreach-lr", "betas", "fused-foreach", "diff"],
)
def test_a_hand_edit_the_checks_refuse_is_refused_at_every_step_and_by_get_config(make, edit, error, match):
    """A group setting the constructor refuses, written by hand after steps (a storage setting, one of torch's
    switches, in torch's words): the step had taken it where its settings were memoized and refused it only once
    something made its plans again, while get_config (the plans' checks) refused it. Now each step refuses it, as
    get_config does, with nothing stepped."""
    ps = _params(8, (64, 80))
    opt = make([{"params": ps[:1]}, {"params": ps[1:]}])
    _step(opt, ps)
    _step(opt, ps, seed=2)  # the settings memoized, the fast path taken
    opt.param_groups[1].update(edit)
    kept = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    before = [p.detach().clone() for p in ps]
    with pytest.raises(error, match=match) as got:
        opt.get_config(1, 0, opt.param_groups[1])
    for seed in (3, 4):
        with pytest.raises(error, match=match) as want:
            _step(opt, ps, seed=seed)
        assert str(got.value) == str(want.value)
        assert getattr(got.value, "__notes__", None) == getattr(want.value, "__notes__", None)
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == kept
    for p, b in zip(ps, before):
        assert_equal_report(p.detach(), b, "a refused step's param")


# manager overrides the step refuses (keys that are not settings of the class, values out of range), each of which
# get_config had reported as a setting
_REFUSED_OVERRIDES = [
    pytest.param(lambda ps: bnbf_nn.LAMB8bit(ps), {"bias_correction": False}, id="LAMB8bit-bias_correction"),
    pytest.param(lambda ps: bnbf_nn.LAMB(ps), {"amsgrad": False}, id="LAMB-amsgrad"),
    pytest.param(lambda ps: bnbf_nn.Adan(ps), {"max_grad_norm": 0.0}, id="Adan-max_grad_norm"),
    pytest.param(lambda ps: bnbf_nn.Adagrad(ps), {"betas": (0.9, 0.99)}, id="Adagrad-betas"),  # a constant there
    pytest.param(lambda ps: bnbf_nn.Lion8bit(ps), {"eps": 1e-3}, id="Lion8bit-eps"),
    pytest.param(lambda ps: bnbf_nn.AdamW8bit(ps), {"is_paged": True}, id="AdamW8bit-is_paged"),
    pytest.param(lambda ps: bnbf_nn.AdamW(ps), {"capturable": True}, id="AdamW-capturable"),
    pytest.param(lambda ps: bnbf_nn.Adam(ps), {"decoupled_weight_decay": False}, id="Adam-decoupled"),
    pytest.param(lambda ps: bnbf_nn.AdamW(ps), {"lr": -1.0}, id="AdamW-lr"),
    pytest.param(lambda ps: bnbf_nn.AdamW(ps), {"weight_decay": 0.1, "eps": math.nan}, id="AdamW-eps-of-two"),
    pytest.param(lambda ps: bnbf_nn.SGD8bit(ps, 0.1, 0.9), {"momentum": 1.5}, id="SGD8bit-momentum"),
    pytest.param(lambda ps: bnbf_nn.SGD(ps, 0.1, 0.9, nesterov=True), {"betas": (0.9, 0.5)}, id="SGD-nesterov"),
    pytest.param(lambda ps: bnbf_nn.RMSprop(ps), {"betas": (1.0, 0.0)}, id="RMSprop-alpha"),
    pytest.param(lambda ps: bnbf_nn.LAMB(ps), {"max_unorm": 0.5}, id="LAMB-max_unorm"),
    pytest.param(lambda ps: bnbf_nn.LARS(ps, 0.1), {"max_unorm": 0.5}, id="LARS-max_unorm"),
    pytest.param(lambda ps: bnbf_nn.AdamW(ps), {"optim_bits": 7}, id="AdamW-optim_bits"),
]


@pytest.mark.parametrize("stepped", [False, True], ids=["fresh", "stepped"])
@pytest.mark.parametrize("route", ["override_config", "register_module_override"])
@pytest.mark.parametrize("make, settings", _REFUSED_OVERRIDES)
def test_get_config_refuses_the_overrides_the_step_refuses(make, settings, route, stepped):
    """An override the step refuses (LAMB8bit's bias_correction, a key its groups read as debias but no setting of
    it; a value out of range), set through either of the manager's ways: get_config answered with the group's
    settings; it reads the override with the step's own checks, raising the step's error and note."""
    lin = torch.nn.Linear(8, 8, bias=False)
    ps = [*_params(8), lin.weight]
    opt = make([{"params": ps[:1]}, {"params": ps[1:]}])
    if stepped:
        _step(opt, ps)
    if route == "override_config":
        opt.mng.override_config(lin.weight, key_value_dict=settings)
    else:
        opt.mng.register_module_override(lin, "weight", settings)
    kept = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    with pytest.raises((TypeError, ValueError)) as got:
        opt.get_config(1, 0, opt.param_groups[1])
    before = [p.detach().clone() for p in ps]
    with pytest.raises((TypeError, ValueError)) as want:
        _step(opt, ps, seed=2)
    assert type(got.value) is type(want.value)
    assert str(got.value) == str(want.value)
    assert getattr(got.value, "__notes__", None) == getattr(want.value, "__notes__", None)
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == kept
    for p, b in zip(ps, before):
        assert_equal_report(p.detach(), b, "a refused step's param")
    assert list(opt.get_config(0, 0, opt.param_groups[0])) == BNB_CONFIG_KEYS  # the other group's param reads


def _twin_from_config(opt, ps, c):
    """An optimizer of ``opt``'s class over ``ps`` whose one group holds, as plain arguments, the settings that
    ``get_config`` reported (``c``), over the group's others (RMSprop's centered...): bitsandbytes' betas of SGD,
    LARS and RMSprop as their torch names, its keys the class has no argument for (Lion's eps, Adagrad's betas:
    constants) left out, LAMB's debias as bias_correction."""
    fam = opt.family
    takes = inspect.signature(type(opt)).parameters
    named = {v: k for k, v in fam.renames}
    kw = {named.get(k, k): v for k, v in opt.param_groups[0].items() if named.get(k, k) in takes and k != "params"}
    skip = {"betas", "alpha", "t_alpha", "t_beta3"} if fam.nstates == 1 else set()  # bitsandbytes' constants there
    kw.update((named.get(k, k), v) for k, v in c.items() if named.get(k, k) in takes and k not in skip)
    spelled = dict(fam.bnb_group).get("betas")
    if isinstance(spelled, tuple) and any(isinstance(n, str) for n in spelled):
        kw.update((n, v) for n, v in zip(spelled, c["betas"]) if isinstance(n, str))
    elif "betas" in takes:
        kw["betas"] = c["betas"]
    return type(opt)(ps, **kw)


# overrides the step takes, each class's own and bitsandbytes' spellings, storage ones among them
_ACCEPTED_OVERRIDES = [
    pytest.param(
        lambda ps: bnbf_nn.AdamW8bit(ps, lr=1e-2, min_8bit_size=0),
        {"betas": (0.5, 0.6), "lr": 4e-3, "weight_decay": 0.0, "eps": 1e-6},
        id="AdamW8bit",
    ),
    pytest.param(lambda ps: bnbf_nn.AdamW(ps), {"amsgrad": True, "maximize": True, "max_unorm": 0.5}, id="AdamW"),
    pytest.param(
        lambda ps: bnbf_nn.AdamW(ps), {"optim_bits": 8, "min_8bit_size": 0, "state_format": "dynamic"}, id="storage"
    ),
    pytest.param(lambda ps: bnbf_nn.Adam(ps), {"is_sparse": True, "percentile_clipping": 100}, id="Adam-bnb-unread"),
    pytest.param(lambda ps: bnbf_nn.SGD8bit(ps, 0.1, 0.9, min_8bit_size=0), {"betas": (0.5, 0.1)}, id="SGD8bit-betas"),
    pytest.param(lambda ps: bnbf_nn.SGD(ps, 0.1, 0.9, nesterov=True), {"momentum": 0.0}, id="SGD-nesterov"),
    pytest.param(lambda ps: bnbf_nn.RMSprop(ps, centered=True), {"betas": (0.9, 0.5)}, id="RMSprop-betas"),
    pytest.param(lambda ps: bnbf_nn.LARS(ps, 0.1, 0.9, eps=1.0), {"trust_coefficient": 0.01}, id="LARS"),
    pytest.param(lambda ps: bnbf_nn.Lion8bit(ps, min_8bit_size=0), {"betas": (0.8, 0.95)}, id="Lion8bit"),
    pytest.param(lambda ps: bnbf_nn.Adagrad(ps), {"lr_decay": 0.1, "eps": 1e-6}, id="Adagrad"),
    pytest.param(lambda ps: bnbf_nn.LAMB(ps), {"debias": False, "weight_decay": 0.1}, id="LAMB"),
    pytest.param(lambda ps: bnbf_nn.AdEMAMix(ps), {"alpha": 3.0, "t_alpha": 10, "t_beta3": 20}, id="AdEMAMix"),
    pytest.param(lambda ps: bnbf_nn.Adan(ps), {"no_prox": True, "betas": (0.9, 0.9, 0.9)}, id="Adan"),
]


# the manager's second way reaches the step as the first: the interpreter pass steps the kernels through one
@pytest.mark.parametrize(
    "route", ["override_config", pytest.param("register_module_override", marks=pytest.mark.surface)]
)
@pytest.mark.parametrize("make, settings", _ACCEPTED_OVERRIDES)
def test_get_config_reports_what_the_step_steps_with(make, settings, route):
    """Every override the step takes, through either of the manager's ways: a twin optimizer given get_config's
    values as plain arguments steps the param bit for bit as the step does, over steps with the group's lr changed
    between them (an lr override is relative to it, also where get_config is given a copy of the group). get_config
    had reported LARS's eps as bitsandbytes' constant 0, and SGD's nesterov as the group holds it at momentum 0."""
    lin = torch.nn.Linear(64, 80, bias=False)
    ps = [lin.weight, *_params(8)]
    opt = make(ps)
    if route == "override_config":
        opt.mng.override_config(lin.weight, key_value_dict=settings)
    else:
        opt.mng.register_module_override(lin, "weight", settings)
    twin_p = [torch.nn.Parameter(lin.weight.detach().clone())]
    twin = None
    for i in range(3):
        c = opt.get_config(0, 0, opt.param_groups[0])
        assert opt.get_config(0, 0, dict(opt.param_groups[0])) == c  # a copy of the group reads as the group
        twin = twin or _twin_from_config(opt, twin_p, c)
        twin.param_groups[0]["lr"] = c["lr"]
        _step(opt, ps, seed=i)
        _step(twin, twin_p, seed=i)
        assert_equal_report(lin.weight, twin_p[0], f"step {i}")
        opt.param_groups[0]["lr"] *= 0.5
    layout = type(opt.state[lin.weight]["state"]).layout
    assert layout.bits == c["optim_bits"] == type(twin.state[twin_p[0]]["state"]).layout.bits


def _override(key, value):
    return lambda opt, p: opt.mng.override_config(p, key, value)


# settings the step refuses for the state a param has (or its first step would make): a switch the kept state
# cannot follow as torch.optim would, differentiable with 8-bit state, a tensor asking for a derivative
_REFUSED_FOR_THE_STATE = [
    pytest.param(lambda ps: bnbf_nn.SGD(ps, 0.1, 0.0, 0.5), True, _override("momentum", 0.9), id="SGD-momentum-on"),
    pytest.param(lambda ps: bnbf_nn.RMSprop(ps, centered=True), True, _override("centered", False), id="RMSprop"),
    pytest.param(
        # group 0's param a leaf that does not require grad: a differentiable step cannot write an nn.Parameter
        lambda gs: bnbf_nn.AdamW(
            [{"params": [gs[0]["params"][0].requires_grad_(False)]}, gs[1]], differentiable=True, min_8bit_size=0
        ),
        False,
        _override("optim_bits", 8),
        id="differentiable-8bit-override",
    ),
    pytest.param(
        lambda ps: bnbf_nn.AdamW8bit(ps, min_8bit_size=0),
        True,
        lambda opt, p: opt.param_groups[1].update(differentiable=True),
        id="differentiable-8bit-state",
    ),
    pytest.param(
        lambda ps: bnbf_nn.AdamW(ps), False, _override("lr", torch.tensor(1e-3, requires_grad=True)), id="lr-grad"
    ),
    pytest.param(
        lambda ps: bnbf_nn.AdamW(ps), True, _override("lr", torch.tensor(1e-3, requires_grad=True)), id="lr-grad-made"
    ),
]


@pytest.mark.parametrize("make, stepped, edit", _REFUSED_FOR_THE_STATE)
def test_get_config_refuses_what_the_step_refuses_for_the_state(make, stepped, edit):
    """Settings the step refuses for the param's state (SGD's momentum switched on with dampening after states were
    made without it, RMSprop's centered off, differentiable over 8-bit state, a tensor lr that requires grad):
    get_config had reported them; it checks them as the step does, raising its error, changing nothing."""
    ps = _params(8, (64, 80))
    opt = make([{"params": ps[:1]}, {"params": ps[1:]}])
    if stepped:
        _step(opt, ps)
    edit(opt, ps[1])
    kept = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    with pytest.raises((TypeError, ValueError, RuntimeError)) as got:
        opt.get_config(1, 0, opt.param_groups[1])
    before = [p.detach().clone() for p in ps]
    with pytest.raises((TypeError, ValueError, RuntimeError)) as want:
        _step(opt, ps, seed=2)
    assert (type(got.value), str(got.value)) == (type(want.value), str(want.value))
    assert getattr(got.value, "__notes__", None) == getattr(want.value, "__notes__", None)
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == kept
    for p, b in zip(ps, before):
        assert_equal_report(p.detach(), b, "a refused step's param")


@pytest.mark.parametrize(
    "make, names",
    [
        (lambda ps: bnbf_nn.SGD8bit(ps, 0.1, 0.9, min_8bit_size=0), ("momentum", "dampening")),
        (lambda ps: bnbf_nn.LARS(ps, 0.1, 0.9), ("momentum", "dampening")),
        (lambda ps: bnbf_nn.RMSprop(ps, momentum=0.5), ("alpha", "momentum")),
    ],
    ids=["SGD8bit", "LARS", "RMSprop"],
)
def test_get_config_reads_bitsandbytes_spelling_in_a_group_as_the_step(make, names):
    """A group holding bitsandbytes' betas (a schedule written for its optimizer cycles betas[0]): the step moves
    the setting it spells; get_config had reported the group's old one. It reads the group as the next step will,
    writing nothing, so a twin given its values steps bit for bit alike; where both spellings changed, it raises
    the step's error."""
    ps, twin_p = _params((64, 80)), _params((64, 80))
    opt, twin = make(ps), make(twin_p)
    group = opt.param_groups[0]
    group["betas"] = tuple(group[n] for n in names)  # as bitsandbytes' groups hold them
    for i, first in enumerate([None, 0.5, 0.6]):
        if first is not None:
            group["betas"] = (first, group["betas"][1])
        kept = dict(group)
        c = opt.get_config(0, 0, group)
        assert group == kept
        assert opt.get_config(0, 0, dict(group)) == c
        twin.param_groups[0].update(zip(names, c["betas"]))
        _step(opt, ps, seed=i)
        _step(twin, twin_p, seed=i)
        assert_equal_report(ps[0], twin_p[0], f"step {i}")
        assert group[names[0]] == c["betas"][0]
    group.update({"betas": (0.3, group["betas"][1]), names[0]: 0.2})
    kept = dict(group)
    with pytest.raises(ValueError, match="holds bitsandbytes' betas") as got:
        opt.get_config(0, 0, group)
    with pytest.raises(ValueError) as want:
        _step(opt, ps)
    assert str(got.value) == str(want.value)
    assert group == kept


# classes with the four settings bitsandbytes' get_config reads from the group it is given, in its spelling (SGD's,
# LARS's and RMSprop's betas spell their momentum...; Adagrad's and Lion's constants there), as its code passes them
_BNB_KEYS_ONLY = [
    pytest.param(
        lambda ps: bnbf_nn.AdamW8bit(ps, min_8bit_size=0, max_unorm=0.5),
        {"lr": 4e-3, "betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.1},
        id="AdamW8bit",
    ),
    pytest.param(
        lambda ps: bnbf_nn.SGD8bit(ps, 0.1, 0.9, min_8bit_size=0),
        {"lr": 0.05, "betas": (0.5, 0.1), "eps": 1e-8, "weight_decay": 0.01},
        id="SGD8bit",
    ),
    pytest.param(
        lambda ps: bnbf_nn.RMSprop(ps, centered=True, optim_bits=8, min_8bit_size=0),
        {"lr": 1e-3, "betas": (0.95, 0.5), "eps": 1e-6, "weight_decay": 0.0},
        id="RMSprop",
    ),
    pytest.param(
        lambda ps: bnbf_nn.Adagrad32bit(ps, lr_decay=0.1),
        {"lr": 0.1, "betas": (0.0, 0.0), "eps": 1e-6, "weight_decay": 0.0},
        id="Adagrad32bit",
    ),
    pytest.param(
        lambda ps: bnbf_nn.Lion8bit(ps, min_8bit_size=0),
        {"lr": 1e-4, "betas": (0.8, 0.95), "eps": 0.0, "weight_decay": 0.1},
        id="Lion8bit",
    ),
    pytest.param(
        lambda ps: bnbf_nn.LAMB8bit(ps, min_8bit_size=0, bias_correction=False),
        {"lr": 1e-3, "betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.01},
        id="LAMB8bit",
    ),
    pytest.param(
        lambda ps: bnbf_nn.LARS(ps, 0.1, 0.9),
        {"lr": 0.05, "betas": (0.5, 0.0), "eps": 1e-8, "weight_decay": 0.01},
        id="LARS",
    ),
    pytest.param(
        lambda ps: bnbf_nn.AdEMAMix8bit(ps, alpha=4.0, t_alpha=10, t_beta3=20, min_8bit_size=0),
        {"lr": 1e-3, "betas": (0.8, 0.9, 0.99), "eps": 1e-8, "weight_decay": 0.0},
        id="AdEMAMix8bit",
    ),
    pytest.param(
        lambda ps: bnbf_nn.Adan(ps, no_prox=True),
        {"lr": 1e-3, "betas": (0.9, 0.9, 0.9), "eps": 1e-6, "weight_decay": 0.01},
        id="Adan",
    ),
]


@pytest.mark.parametrize("make, given", _BNB_KEYS_ONLY)
def test_get_config_of_a_group_of_bitsandbytes_keys_only(make, given):
    """bitsandbytes' get_config reads ``lr``, ``betas``, ``eps`` and ``weight_decay`` from the group it is given and
    ``optim_bits``, ``min_8bit_size``, ``max_unorm`` and ``skip_zeros`` from its ``args``, so code written for it may
    pass a dict of the four: here that raised a bare ``KeyError: 'optim_bits'``. The others are now the optimizer's
    settings (the live group's edits count for nothing, as in bitsandbytes): the config is that of a param group
    made from the dict (AdEMAMix's ``alpha``... its defaults, which bitsandbytes' get_config would read as 0 from such
    a dict, though its step never sees one), which steps as a twin given the config's values does; the dict is left
    as it was."""
    lin = torch.nn.Linear(16, 8, bias=False)
    opt = make([lin.weight])
    opt.param_groups[0]["skip_zeros"] = True  # the live group's own: not the optimizer's settings
    kept = dict(given)
    c = opt.get_config(0, 0, given)
    assert given == kept
    ps, twin_p = _params((8, 16)), _params((8, 16))
    made = make([{"params": ps, **given}])
    assert c == made.get_config(0, 0, made.param_groups[0])
    assert c["skip_zeros"] is False and c["optim_bits"] == made.defaults["optim_bits"]
    twin = _twin_from_config(made, twin_p, c)
    for i in range(2):
        _step(made, ps, seed=i)
        _step(twin, twin_p, seed=i)
        assert_equal_report(ps[0], twin_p[0], f"step {i}")


@pytest.mark.parametrize(
    "make, given, lacks",
    [
        (lambda ps: bnbf_nn.AdamW8bit(ps), {"lr": 1e-3, "eps": 1e-8, "weight_decay": 0.0}, "'betas'"),
        (
            lambda ps: bnbf_nn.SGD(ps, 0.1, 0.9),
            {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.0},
            "'betas' (or 'momentum' and 'dampening')",
        ),
        (lambda ps: bnbf_nn.LARS(ps, 0.1), {"betas": (0.9, 0.0), "weight_decay": 0.0}, "'lr', 'eps'"),  # its own eps
        (lambda ps: bnbf_nn.Lion(ps), {"betas": (0.9, 0.99)}, "'lr', 'weight_decay'"),  # its eps a constant there
    ],
    ids=["AdamW8bit", "SGD", "LARS", "Lion"],
)
def test_get_config_names_what_a_partial_group_lacks(make, given, lacks):
    """A dict without one of the settings bitsandbytes' get_config reads from the group: ``KeyError`` naming each,
    not a bare key (nor the first of the optimizer's own settings the dict lacks), the dict left as it was."""
    opt = make(_params(8))
    kept = dict(given)
    with pytest.raises(KeyError) as e:
        opt.get_config(0, 0, given)
    assert f"param group 0 lacks {lacks}, which get_config reads from the group" in str(e.value)
    assert given == kept


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "old pickle"])
def test_attributes_survive_deepcopy_and_pickles(how, monkeypatch):
    """``initialized`` and ``name2qmap`` are kept; an optimizer pickled before they existed gets them as its
    states say (stepped: initialized; an 8-bit state: the maps), and every attribute reads and steps after."""
    ps = _params((64, 80), 8)
    opt = bnbf_nn.AdamW(ps, min_8bit_size=0)
    opt.mng.override_config(ps[1], "optim_bits", 8)
    _step(opt, ps)
    if how == "old pickle":
        current = bnbf_nn.Optimizer8bit.__getstate__
        drop = ("initialized", "name2qmap")
        monkeypatch.setattr(
            bnbf_nn.Optimizer8bit,
            "__getstate__",
            lambda self: {k: v for k, v in current(self).items() if k not in drop},
        )
    twin = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    monkeypatch.undo()
    assert twin.initialized is True and sorted(twin.name2qmap) == ["dynamic", "udynamic"]
    for key, m in opt.name2qmap.items():
        assert twin.name2qmap[key] is not m
        assert_equal_report(twin.name2qmap[key], m, key)
    assert (twin.args.optim_bits, twin.optimizer_name, twin.mng) == (32, "adam", opt.mng)
    assert twin.get_config(0, 1, twin.param_groups[0])["lr"] == 1e-3  # (overrides are of the original's params)
    _step(twin, twin.param_groups[0]["params"])
    fresh = pickle.loads(pickle.dumps(bnbf_nn.AdamW(_params(8))))
    assert (fresh.initialized, fresh.name2qmap) == (False, {})

"""Checkpoints: bitsandbytes' layout, interop with bitsandbytes itself (CPU), and bad state dicts.

Interop: bitsandbytes (its 8-bit optimizers run on the CPU) trains a few steps, saves; bnbf_nn loads and
both continue on the same gradients; and the other way round from a bnbf_nn optimizer (dynamic and power
formats). The two libraries' kernels round differently, so they are compared with bitsandbytes' own 8-bit
bars (tests/tolerances.py STATE8): per state fewer than ``max_outside`` elements outside atol/rtol, and
mean |p - p_bnb| below ``mean_abs``.
"""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import numpy
import pytest
import torch
from test_nn_optim import MIN8, make_grads, make_params, run_adapter
from tolerances import STATE8, assert_equal_report

import bnbf
import bnbf_nn
from bnbf._dispatch import interpreting
from bnbf_nn._checkpoint import QUANT_KEY

SHAPES = [(32, 40), (7,)]  # 8-bit and 32-bit state (min_8bit_size=MIN8)

# bitsandbytes class -> hyperparameters (bitsandbytes ignores SGD's dampening: keep it 0)
INTEROP = {
    "AdamW8bit": dict(lr=1e-3, weight_decay=1e-2),
    "Lion8bit": dict(lr=1e-4, weight_decay=0.1),
    "SGD8bit": dict(lr=1e-2, momentum=0.9, weight_decay=1e-2),
    "AdEMAMix8bit": dict(lr=1e-3),
}


def reload(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def bnb_moments(entry) -> dict[str, torch.Tensor]:
    """Float32 values of a bitsandbytes per-param entry: qmap[codes] * absmax[block] (or the float32 state)."""
    quant = {**entry, **entry.get(QUANT_KEY, {})}
    out = {}
    for k in ("1", "2"):
        s = quant.get("state" + k)
        if s is None:
            continue
        if s.dtype == torch.uint8:
            absmax = quant["absmax" + k]  # (nblocks,), or (2, nblocks) for AdEMAMix's stacked moments
            flat = s.reshape(absmax.shape[:-1] + (-1,)).long()
            blocks = torch.arange(flat.shape[-1]) // 256
            s = (quant["qmap" + k][flat] * absmax[..., blocks]).reshape(s.shape)
        out["state" + k] = s.float()
    return out


def assert_within_8bit_bars(ours_sd, theirs_sd, ours_params, theirs_params, what, steps=3):
    """Params within bitsandbytes' mean bar; states within bitsandbytes' atol/rtol bar, or, element by
    element, within ``steps`` widest code gaps of its value times the block's absmax: bnbf rounds states
    stochastically (bnbf.quant's zero point) where bitsandbytes rounds to nearest, so after ``steps`` steps
    from the same state each element may differ by up to one code gap per step (SGD's momentum buffer, of
    order 0.1 here, is above the atol of 3e-3 that bitsandbytes wrote for Adam's moments)."""
    bar = STATE8[(torch.float32, 8)]
    for i, (a, b) in enumerate(zip(ours_params, theirs_params)):
        mean = (a.detach() - b.detach()).abs().mean().item()
        assert mean < bar.mean_abs, f"{what}: param {i}: mean |p - p_bnb| = {mean:.3e} >= {bar.mean_abs}"
    for key, entry in theirs_sd["state"].items():
        ours, theirs = bnb_moments(ours_sd["state"][key]), bnb_moments(entry)
        assert ours.keys() == theirs.keys()
        quant = {**entry, **entry.get(QUANT_KEY, {})}
        for k in ours:
            outside = ~torch.isclose(ours[k], theirs[k], rtol=bar.rtol, atol=bar.atol)
            if "qmap" + k[-1] in quant:
                qmap = quant["qmap" + k[-1]]
                gap = float((qmap[1:] - qmap[:-1]).max())
                absmax = quant["absmax" + k[-1]].float()
                am = absmax[..., torch.arange(ours[k].reshape(absmax.shape[:-1] + (-1,)).shape[-1]) // 256]
                allowed = (steps * gap * am).reshape(ours[k].shape)
                outside &= (ours[k] - theirs[k]).abs() > allowed
            n = int(outside.sum())
            assert n < bar.max_outside, f"{what}: param {key} {k}: {n} elements outside atol/rtol and the code gaps"


@pytest.mark.parametrize("name", list(INTEROP))
def test_bitsandbytes_checkpoint_loads_and_training_continues(name):
    bnb = pytest.importorskip("bitsandbytes.optim")
    kw = INTEROP[name]
    theirs = make_params(shapes=SHAPES)
    ours = [torch.nn.Parameter(p.detach().clone()) for p in theirs]
    grads = make_grads(theirs, 5)
    bnb_opt = getattr(bnb, name)(theirs, **kw, min_8bit_size=MIN8)
    run_adapter(bnb_opt, theirs, grads[:2])
    sd = reload(bnb_opt.state_dict())
    for p, q in zip(ours, theirs):
        p.data.copy_(q.data)
    opt = getattr(bnbf_nn, name)(ours, **kw, min_8bit_size=MIN8)  # state_format comes from the checkpoint
    opt.load_state_dict(sd)
    saved = sd["state"][0][QUANT_KEY]
    state = opt.state[ours[0]]["state"]
    assert type(state).layout.format == "dynamic" and opt.state[ours[0]]["step"] == 2
    mine = opt.state_dict()["state"][0][QUANT_KEY]
    for k, v in saved.items():  # codes and absmax restored bit for bit, dtypes kept
        assert_equal_report(mine[k], v, f"{name} {k} after loading bitsandbytes' checkpoint")
    run_adapter(bnb_opt, theirs, grads[2:])
    run_adapter(opt, ours, grads[2:])
    assert_within_8bit_bars(opt.state_dict(), bnb_opt.state_dict(), ours, theirs, f"{name} bnb -> bnbf_nn")


# bitsandbytes' own format is "dynamic"; bitsandbytes 0.50's CPU kernels quantize through the checkpoint's qmap,
# so they also continue from "power" codes (noticed here if that changes; not for Lion, whose sign update would
# hide a misread map)
LOADS = [(n, f) for n in INTEROP for f in ("dynamic", "power") if (n, f) != ("Lion8bit", "power")]


@pytest.mark.parametrize("name, fmt", LOADS, ids=[f"{n}-{f}" for n, f in LOADS])
def test_bitsandbytes_loads_our_checkpoint(name, fmt):
    bnb = pytest.importorskip("bitsandbytes.optim")
    kw = INTEROP[name]
    ours = make_params(shapes=SHAPES)
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    grads = make_grads(ours, 5)
    opt = getattr(bnbf_nn, name)(ours, **kw, min_8bit_size=MIN8, state_format=fmt)
    run_adapter(opt, ours, grads[:2])
    sd = reload(opt.state_dict())
    for p, q in zip(theirs, ours):
        p.data.copy_(q.data)
    bnb_opt = getattr(bnb, name)(theirs, **kw, min_8bit_size=MIN8)
    bnb_opt.load_state_dict(sd)
    for k, v in sd["state"][0][QUANT_KEY].items():
        assert_equal_report(bnb_opt.state[theirs[0]][k], v, f"{name} {k} as bitsandbytes loaded it")
    run_adapter(bnb_opt, theirs, grads[2:])
    run_adapter(opt, ours, grads[2:])
    assert_within_8bit_bars(opt.state_dict(), bnb_opt.state_dict(), ours, theirs, f"{name} bnbf_nn -> bnb")


@pytest.mark.parametrize("name, kw", [("LAMB8bit", {}), ("LAMB32bit", {}), ("LARS8bit", dict(lr=1e-2, momentum=0.9))])
def test_bitsandbytes_steps_after_loading_our_lamb_and_lars(name, kw):
    """bitsandbytes' LAMB and LARS clip the update by default (max_unorm 1.0 and 0.02), so their states hold the
    scratch buffer ``unorm_vec`` (made for 8- and 32-bit state alike; its 32-bit step reads it): every state of ours
    carries it (zeros), so the layouts match and bitsandbytes loads and steps on. (The two libraries' LAMB and LARS
    are different algorithms: README.)"""
    ours = make_params(shapes=SHAPES)
    opt = getattr(bnbf_nn, name)(ours, **kw, min_8bit_size=MIN8, state_format="dynamic")
    run_adapter(opt, ours, make_grads(ours, 2))
    sd = reload(opt.state_dict())
    for key, entry in sd["state"].items():
        assert torch.equal(entry[QUANT_KEY]["unorm_vec"], torch.zeros(1)), f"{name} param {key}"
    bnb = pytest.importorskip("bitsandbytes.optim")
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    bnb_opt = getattr(bnb, name)(theirs, **kw, min_8bit_size=MIN8)
    bnb_opt.load_state_dict(sd)
    run_adapter(bnb_opt, theirs, make_grads(ours, 1, seed=5))
    assert all(bool(torch.isfinite(p).all()) for p in theirs)
    assert all(bnb_opt.state[p]["step"] == 3 for p in theirs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_for_bitsandbytes_writes_int_steps(dtype):
    """``step`` is a float32 tensor in our state dicts (torch.distributed.checkpoint needs it); bitsandbytes casts
    every tensor it loads to the param's dtype, where a step stops counting (bfloat16 from 256, float16 from 2048).
    ``for_bitsandbytes`` gives ints (a new dict, the same tensors, the state dict itself unchanged), bitsandbytes
    counts on from them, and ours still loads the result."""
    ours = make_params(dtype=dtype, shapes=SHAPES)
    opt = bnbf_nn.AdamW8bit(ours, min_8bit_size=MIN8, state_format="dynamic")
    run_adapter(opt, ours, make_grads(ours, 2))
    sd = reload(opt.state_dict())
    for entry in sd["state"].values():  # as if after 3001 steps
        entry["step"] = torch.tensor(3001.0)
    out = bnbf_nn.for_bitsandbytes(sd)
    for key, entry in out["state"].items():
        assert type(entry["step"]) is int and entry["step"] == 3001
        assert entry[QUANT_KEY]["state1"] is sd["state"][key][QUANT_KEY]["state1"]
        assert isinstance(sd["state"][key]["step"], torch.Tensor)
    assert out["param_groups"] is sd["param_groups"]
    again = bnbf_nn.AdamW8bit([torch.nn.Parameter(p.detach().clone()) for p in ours], min_8bit_size=MIN8)
    again.load_state_dict(out)
    assert [r["step"] for r in again.state.values()] == [3001] * len(SHAPES)
    for bad in ([], {"state": [1]}):
        with pytest.raises(ValueError, match="expects an optimizer state dict"):
            bnbf_nn.for_bitsandbytes(bad)
    broken = {**out, "state": {0: {"step": torch.tensor(-1.0)}}}
    with pytest.raises(ValueError, match="'step' must be a non-negative int"):
        bnbf_nn.for_bitsandbytes(broken)
    bnb = pytest.importorskip("bitsandbytes.optim")
    for given, counted in ((sd, None), (out, 3003)):
        theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
        bnb_opt = bnb.AdamW8bit(theirs, min_8bit_size=MIN8)
        bnb_opt.load_state_dict(given)
        run_adapter(bnb_opt, theirs, make_grads(ours, 2, seed=5))
        steps = {float(bnb_opt.state[p]["step"]) for p in theirs}
        if counted is None:  # the reason: the cast step does not reach 3003
            assert 3003 not in steps, steps
        else:
            assert steps == {counted}


def test_load_state_dict_takes_move_to_device():
    """bitsandbytes' ``move_to_device`` keyword: True (its default) loads; False, which would leave states off
    their params' devices, is refused and changes nothing."""
    params = make_params(shapes=SHAPES)
    opt = bnbf_nn.AdamW8bit(params, min_8bit_size=MIN8)
    run_adapter(opt, params, make_grads(params, 2))
    sd = reload(opt.state_dict())
    twin = bnbf_nn.AdamW8bit([torch.nn.Parameter(p.detach().clone()) for p in params], min_8bit_size=MIN8)
    with pytest.raises(NotImplementedError, match="move_to_device=False"):
        twin.load_state_dict(sd, move_to_device=False)
    assert not twin.state
    twin.load_state_dict(sd, move_to_device=True)
    assert [r["step"] for r in twin.state.values()] == [2] * len(SHAPES)


def test_power_format_writes_its_own_qmap():
    params = make_params(shapes=SHAPES)
    opt = bnbf_nn.AdamW8bit(params, min_8bit_size=MIN8)
    run_adapter(opt, params, make_grads(params, 1))
    quant = opt.state_dict()["state"][0][QUANT_KEY]
    assert_equal_report(quant["qmap1"], bnbf.quant.state_map("power", True), "qmap1")
    assert_equal_report(quant["qmap2"], bnbf.quant.state_map("power", False), "qmap2")
    # a reader that only knows bitsandbytes' layout dequantizes our codes exactly
    want = bnbf.dequantize_state(opt.state[params[0]]["state"])
    got = bnb_moments(opt.state_dict()["state"][0])
    assert_equal_report(got["state1"], want["exp_avg"], "exp_avg via qmap1")
    assert_equal_report(got["state2"], want["exp_avg_sq"], "exp_avg_sq via qmap2")


def test_live_qmaps_are_the_optimizers_own():
    """The live ``qmap`` views: one tensor per optimizer (its params share it, as bitsandbytes' do), never another
    optimizer's: a write into one optimizer's changed what every other's state showed and refused their loads."""
    params, others = make_params(shapes=[(32, 40), (40, 32)]), make_params(shapes=SHAPES)
    opt, other = bnbf_nn.AdamW8bit(params, min_8bit_size=MIN8), bnbf_nn.AdamW8bit(others, min_8bit_size=MIN8)
    run_adapter(opt, params, make_grads(params, 1))
    run_adapter(other, others, make_grads(others, 1))
    maps = [r["qmap1"] for r in opt.state.values() if "qmap1" in r]
    assert len(maps) > 1 and all(m is maps[0] for m in maps)
    assert opt.state[params[0]]["qmap1"] is not other.state[others[0]]["qmap1"]
    sd = other.state_dict()
    with torch.no_grad():
        opt.state[params[0]]["qmap1"].mul_(2.0)
    assert_equal_report(other.state[others[0]]["qmap1"], bnbf.quant.state_map("power", True), "the other's qmap1")
    bnbf_nn.AdamW8bit(others, min_8bit_size=MIN8).load_state_dict(sd)  # a fresh optimizer loads it
    copied = copy.deepcopy(opt)  # a copy's views have their own maps too
    assert copied.state[copied.param_groups[0]["params"][0]]["qmap1"] is not opt.state[params[0]]["qmap1"]


def test_ademamix_stacks_its_first_moments_like_bitsandbytes():
    params = make_params(shapes=SHAPES)
    opt = bnbf_nn.AdEMAMix8bit(params, min_8bit_size=MIN8)
    run_adapter(opt, params, make_grads(params, 1))
    quant = opt.state_dict()["state"][0][QUANT_KEY]
    s = opt.state[params[0]]["state"]
    assert quant["state1"].shape == (2, 32, 40) and quant["absmax1"].shape == (2, 5)
    assert_equal_report(quant["state1"][1], s.exp_avg_slow, "state1[1] is the slow EMA")
    assert quant["state2"].shape == (32, 40)


# ---- bad state dicts ----------------------------------------------------------------------------------------


def snapshot(opt):
    return copy.deepcopy(
        {
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
            "state": {id(p): dict(r) for p, r in opt.state.items()},
        }
    )


def assert_unchanged(opt, snap):
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == snap["groups"]
    assert {id(p) for p in opt.state} == set(snap["state"])
    for p, rec in opt.state.items():
        before = snap["state"][id(p)]
        assert rec["step"] == before["step"]
        for name, a, b in zip(rec["state"]._fields, rec["state"], before["state"]):
            assert_equal_report(a, b, f"state {name} after a failed load")


def _entry(sd, i=0):
    return sd["state"][i][QUANT_KEY]


def _as_bitsandbytes(sd: dict) -> dict:
    """``sd`` as bitsandbytes writes it: without bnbf's "bnbf" entry in each group (and at the top, where older
    bnbf_nn state dicts kept it)."""
    groups = [{k: v for k, v in g.items() if k != "bnbf"} for g in sd["param_groups"]]
    return {**{k: v for k, v in sd.items() if k != "bnbf"}, "param_groups": groups}


BAD = {
    "another optimizer": (lambda sd, lion: lion, "rule 'lion'"),
    "bitsandbytes-layout dict of another optimizer": (
        lambda sd, lion: _as_bitsandbytes(lion),
        "missing 'state2'",
    ),
    "missing absmax": (lambda sd, _: (_entry(sd).pop("absmax1"), sd)[1], "absmax1 must be"),
    "float16 absmax": (lambda sd, _: _entry(sd).update(absmax2=_entry(sd)["absmax2"].half()) or sd, "absmax2"),
    "int8 codes": (lambda sd, _: _entry(sd).update(state1=_entry(sd)["state1"].to(torch.int8)) or sd, "dtype"),
    "float16 fp32 state": (lambda sd, _: _entry(sd, 1).update(state1=_entry(sd, 1)["state1"].half()) or sd, "dtype"),
    "unknown qmap": (lambda sd, _: _entry(sd).update(qmap1=_entry(sd)["qmap1"] * 0.5) or sd, "neither"),
    "other shapes": (lambda sd, _: _entry(sd).update(state1=_entry(sd)["state1"][:16]) or sd, "shape"),
    "bad step": (lambda sd, _: sd["state"][1].update(step=-3) or sd, "step"),
    "unknown entry": (lambda sd, _: _entry(sd).update(max1=torch.zeros(1)) or sd, "non-blockwise"),
    "state for no param": (lambda sd, _: sd["state"].update({9: sd["state"][0]}) or sd, "param 9"),
    "bad hyperparameter": (lambda sd, _: sd["param_groups"][0].update(lr=-1.0) or sd, "Invalid learning rate"),
    "group count": (lambda sd, _: sd.update(param_groups=sd["param_groups"] * 2) or sd, "param groups"),
    "group size": (lambda sd, _: sd["param_groups"][0].update(params=[0]) or sd, "has 1 params"),
    "not a state dict": (lambda sd, _: {"state": {}}, "'state' and 'param_groups'"),
    "group not a dict": (lambda sd, _: sd.update(param_groups=[["params"]]) or sd, "a list of dicts"),
    "state not a dict": (lambda sd, _: sd.update(state=[1]) or sd, "'state' must be a dict"),
    "bad starting lr": (lambda sd, _: sd["param_groups"][0]["bnbf"].update(lr0="1e-3") or sd, r"bnbf\['lr0'\]"),
    # a negative block scale flips its block's sign; NaN or inf turns the next step's params into NaN
    "negative absmax": (lambda sd, _: _entry(sd)["absmax1"].__setitem__(0, -0.5) or sd, "negative, NaN or inf"),
    "NaN absmax": (lambda sd, _: _entry(sd)["absmax2"].__setitem__(1, float("nan")) or sd, "negative, NaN or inf"),
    "inf absmax": (lambda sd, _: _entry(sd)["absmax1"].__setitem__(-1, float("inf")) or sd, "negative, NaN or inf"),
    # 32-bit moments as no step writes them: a NaN turns the params NaN, a negative second moment's root is NaN
    "NaN 32-bit moment": (
        lambda sd, _: _entry(sd, 1)["state1"].view(-1).__setitem__(3, float("nan")) or sd,
        r"state1 holds 1 values that are NaN or inf",
    ),
    "negative 32-bit second moment": (
        lambda sd, _: _entry(sd, 1)["state2"].view(-1).__setitem__(0, -1.0) or sd,
        r"state2 holds 1 values that are negative, NaN or inf",
    ),
    # a meta tensor (a state dict made or loaded on the meta device) has no values: torch's item() and copy_
    # errors named no entry; a quant state that is no dict failed dict.update's conversion
    "meta step": (lambda sd, _: sd["state"][1].update(step=torch.tensor(1.0, device="meta")) or sd, "'step' is a meta"),
    "meta codes": (lambda sd, _: _entry(sd).update(state1=_entry(sd)["state1"].to("meta")) or sd, "state1 is a meta"),
    "meta qmap": (lambda sd, _: _entry(sd).update(qmap2=_entry(sd)["qmap2"].to("meta")) or sd, "qmap2 is a meta"),
    "meta absmax": (lambda sd, _: _entry(sd).update(absmax1=_entry(sd)["absmax1"].to("meta")) or sd, "absmax1 is a"),
    "meta 32-bit state": (
        lambda sd, _: _entry(sd, 1).update(state2=_entry(sd, 1)["state2"].to("meta")) or sd,
        r"^cannot load the optimizer state of param 1 \(shape \(7,\)\): state2 is a meta tensor, which holds no data$",
    ),
    "quant state not a dict": (
        lambda sd, _: sd["state"][0].update({QUANT_KEY: [1, 2]}) or sd,
        rf"^cannot load the optimizer state of param 0 \(shape \(32, 40\)\): '{QUANT_KEY}' must be a dict .* list$",
    ),
}


# interpreter budget: three cases. load_state_dict's checks are host code, the same on every path; what the
# kernel path adds (an optimizer whose cached plans still step after a refused load) any case runs. Every case
# runs in the plain pass
BAD_CASES = list(BAD)[:3] if interpreting() else list(BAD)


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_state_dict_raises_and_leaves_optimizer_unchanged(case):
    damage, match = BAD[case]
    params = make_params(shapes=SHAPES)
    grads = make_grads(params, 1)
    source = bnbf_nn.AdamW8bit([torch.nn.Parameter(p.detach().clone()) for p in params], min_8bit_size=MIN8)
    run_adapter(source, source.param_groups[0]["params"], grads)
    lion = bnbf_nn.Lion8bit([torch.nn.Parameter(p.detach().clone()) for p in params], min_8bit_size=MIN8)
    run_adapter(lion, lion.param_groups[0]["params"], grads)
    opt = bnbf_nn.AdamW8bit(params, min_8bit_size=MIN8)
    run_adapter(opt, params, grads)
    snap = snapshot(opt)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(damage(reload(source.state_dict()), reload(lion.state_dict())))
    assert_unchanged(opt, snap)
    run_adapter(opt, params, grads)  # and it still steps
    assert opt.state[params[0]]["step"] == 2


@pytest.mark.parametrize("how", ["8bit_into_32bit", "32bit_into_8bit", "override_gone", "bitsandbytes_layout"])
def test_a_loaded_state_keeps_the_bits_it_was_saved_with(how):
    """As bitsandbytes' load does, a state keeps its saved bits whatever the loading optimizer would give a new
    one (its class, optim_bits, min_8bit_size, a GlobalOptimManager override that is gone: Trainer's
    ``adamw_bnb_8bit`` keeps embeddings in 32 bits, a run resumed with bnbf_nn and no override must load it). It
    was refused. Training then goes on bit for bit as in the saving optimizer, and the state saves and loads
    again with those bits."""
    params = make_params(shapes=SHAPES)
    grads = make_grads(params, 4)
    mng = bnbf_nn.GlobalOptimManager.get_instance()
    save_cls, load_cls = {
        "8bit_into_32bit": (bnbf_nn.AdamW8bit, bnbf_nn.AdamW32bit),
        "32bit_into_8bit": (bnbf_nn.AdamW32bit, bnbf_nn.AdamW8bit),
    }.get(how, (bnbf_nn.AdamW8bit, bnbf_nn.AdamW8bit))
    a = save_cls(params, min_8bit_size=MIN8)
    if how in ("override_gone", "bitsandbytes_layout"):
        mng.override_config(params[0], "optim_bits", 32)
    run_adapter(a, params, grads[:2])
    saved_bits = [type(a.state[p]["state"]).layout.bits for p in params]
    sd = reload(a.state_dict())
    if how == "bitsandbytes_layout":  # saved by bitsandbytes: no bnbf entry in the groups; its min_8bit_size 4096
        for g in sd["param_groups"]:
            del g["bnbf"]
        sd["param_groups"][0]["min_8bit_size"] = 4096
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    assigned = [torch.nn.Parameter(p.detach().clone()) for p in params]
    b = load_cls(twin, min_8bit_size=MIN8)
    b.load_state_dict(sd)
    assert [type(b.state[p]["state"]).layout.bits for p in twin] == saved_bits
    if how == "bitsandbytes_layout":
        return  # (its group's settings are bitsandbytes' now: the steps differ)
    by_hand = load_cls(assigned, min_8bit_size=MIN8)  # entries assigned as ZeroRedundancyOptimizer's load writes them
    for q, entry in zip(assigned, reload(sd)["state"].values()):
        by_hand.state[q] = entry
    run_adapter(a, params, grads[2:])
    run_adapter(b, twin, grads[2:])
    run_adapter(by_hand, assigned, grads[2:])
    assert [type(by_hand.state[p]["state"]).layout.bits for p in assigned] == saved_bits
    for i, (p, q, r) in enumerate(zip(params, twin, assigned)):
        assert_equal_report(q.detach(), p.detach(), f"param {i} after loading")
        assert_equal_report(r.detach(), p.detach(), f"param {i} after loading by assignment")
    c = load_cls([torch.nn.Parameter(p.detach().clone()) for p in twin], min_8bit_size=MIN8)
    c.load_state_dict(reload(b.state_dict()))  # and again, from the loading optimizer's own state dict
    for p, q in zip(twin, c.param_groups[0]["params"]):
        for field, x, y in zip(b.state[p]["state"]._fields, b.state[p]["state"], c.state[q]["state"]):
            assert_equal_report(y, x, f"{field} saved again")


@pytest.mark.parametrize("name", ["Adam8bit", "AdamW32bit"])
def test_amsgrad_keeps_its_maximum_in_state3(name):
    """amsgrad's third state (max_exp_avg_sq) continues bitsandbytes' numbering: state3, and with 8-bit state
    qmap3 (the unsigned map) and absmax3; it loads back and training continues bit for bit. A checkpoint
    saved with amsgrad sets it in the loading optimizer's groups (torch.optim loads group settings)."""
    params = make_params(shapes=SHAPES)
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    grads = make_grads(params, 4)
    cls = getattr(bnbf_nn, name)
    opt = cls(params, lr=1e-2, amsgrad=True, min_8bit_size=MIN8)
    run_adapter(opt, params, grads[:2])
    sd = reload(opt.state_dict())
    quant = sd["state"][0][QUANT_KEY]
    state = opt.state[params[0]]["state"]
    assert_equal_report(quant["state3"], state.max_exp_avg_sq, "state3")
    if name.endswith("8bit"):
        assert quant["state3"].dtype == torch.uint8
        assert_equal_report(quant["qmap3"], bnbf.quant.state_map("power", False), "qmap3")
        assert_equal_report(quant["absmax3"], state.max_exp_avg_sq_absmax, "absmax3")
    else:
        assert quant["state3"].dtype == torch.float32 and "qmap3" not in quant
    for p, q in zip(twin, params):
        p.data.copy_(q.data)
    opt2 = cls(twin, lr=1e-2, min_8bit_size=MIN8)  # amsgrad comes with the checkpoint's group
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["amsgrad"] is True
    run_adapter(opt, params, grads[2:])
    run_adapter(opt2, twin, grads[2:])
    for i, (p, q) in enumerate(zip(params, twin)):
        assert_equal_report(q.detach(), p.detach(), f"param {i} after loading")
        for field, a, b in zip(opt.state[p]["state"]._fields, opt.state[p]["state"], opt2.state[q]["state"]):
            assert_equal_report(b, a, f"param {i} state {field} after loading")
    # amsgrad's maximum beside amsgrad=False in the group (an optimizer that switched amsgrad off after its states
    # were made saves this): loaded and kept untouched, as torch.optim keeps it
    off = copy.deepcopy(sd)
    off["param_groups"][0]["amsgrad"] = False
    opt3 = cls(make_params(shapes=SHAPES), lr=1e-2, min_8bit_size=MIN8)
    opt3.load_state_dict(off)
    kept = opt3.state[opt3.param_groups[0]["params"][0]]["state"].max_exp_avg_sq
    assert_equal_report(kept, off["state"][0][QUANT_KEY]["state3"], "state3 loaded with amsgrad=False")
    run_adapter(opt3, opt3.param_groups[0]["params"], grads[2:])
    assert_equal_report(kept, off["state"][0][QUANT_KEY]["state3"], "state3 untouched by amsgrad=False steps")


# ---- torch.distributed.checkpoint ----------------------------------------------------------------------------


def test_plain_dcp_round_trip_of_state_dict(tmp_path):
    """dcp.save / dcp.load of ``optimizer.state_dict()`` itself (one process, no process group): every leaf
    of a param's entry is a tensor (``step`` as torch.optim stores it), so DCP loads it back into a state
    dict of the same structure, and training continues bit for bit."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    params = make_params(shapes=SHAPES)
    grads = make_grads(params, 4)
    opt = bnbf_nn.AdEMAMix8bit(params, min_8bit_size=MIN8)  # stacked state1 and a 32-bit param
    run_adapter(opt, params, grads[:2])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.save(opt.state_dict(), checkpoint_id=str(tmp_path))
        twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
        opt2 = bnbf_nn.AdEMAMix8bit(twin, min_8bit_size=MIN8)
        run_adapter(opt2, twin, make_grads(params, 1, seed=7))  # state of the right structure, other values
        target = opt2.state_dict()
        dcp.load(target, checkpoint_id=str(tmp_path))
    opt2.load_state_dict(target)
    for p, q in zip(params, twin):
        q.data.copy_(p.data)  # the params are the model's to restore; the optimizer's state came from DCP
        assert opt2.state[q]["step"] == 2
        for field, a, b in zip(opt.state[p]["state"]._fields, opt.state[p]["state"], opt2.state[q]["state"]):
            assert_equal_report(b, a, f"{field} after dcp.load")
    run_adapter(opt, params, grads[2:])
    run_adapter(opt2, twin, grads[2:])
    for i, (p, q) in enumerate(zip(params, twin)):
        assert_equal_report(q.detach(), p.detach(), f"param {i} continued after dcp.load")


def test_a_resumed_lr_override_stays_relative_to_the_starting_lr():
    """An lr override is relative to the group's starting lr. With no scheduler (no initial_lr) and the group's lr
    halved by hand, the override is halved too; a resumed optimizer must keep it halved, as the run that went on
    does (the starting lr used to be lost: the resumed override stepped at its full value)."""
    params = make_params(shapes=SHAPES)
    grads = make_grads(params, 3)
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for ps in (params, twin):
        bnbf_nn.GlobalOptimManager.get_instance().override_config(ps[1], "lr", 1e-3)
    opt = bnbf_nn.AdamW32bit(params, lr=1e-2)
    run_adapter(opt, params, grads[:1])
    opt.param_groups[0]["lr"] = 5e-3
    resumed = bnbf_nn.AdamW32bit(twin, lr=1e-2)
    resumed.load_state_dict(reload(opt.state_dict()))
    for p, q in zip(params, twin):
        q.data.copy_(p.data)
    run_adapter(opt, params, grads[1:])
    run_adapter(resumed, twin, grads[1:])
    for i, (p, q) in enumerate(zip(params, twin)):
        assert_equal_report(q.detach(), p.detach(), f"param {i} resumed")


@pytest.mark.parametrize("number", [int, numpy.int64, numpy.float32])
def test_checkpoints_with_int_steps_still_load(number):
    """Checkpoints written before ``step`` became a tensor (and bitsandbytes' own) hold a Python int; converted
    ones may hold numpy's integral numbers (they were refused as "must be a non-negative int")."""
    params = make_params(shapes=SHAPES)
    opt = bnbf_nn.AdamW8bit(params, min_8bit_size=MIN8)
    run_adapter(opt, params, make_grads(params, 3))
    sd = reload(opt.state_dict())
    for entry in sd["state"].values():
        entry["step"] = number(int(entry["step"].item()))
    opt2 = bnbf_nn.AdamW8bit([torch.nn.Parameter(p.detach().clone()) for p in params], min_8bit_size=MIN8)
    opt2.load_state_dict(sd)
    assert [r["step"] for r in opt2.state.values()] == [3] * len(SHAPES)


def test_a_bitsandbytes_placeholder_setting_does_not_overwrite_ours():
    """bitsandbytes' LARS groups hold eps 0.0, a constant it never reads; bnbf's LARS guards its trust ratio with
    eps. A state dict of bitsandbytes' (no "bnbf" entry) keeps ours; one of ours restores our value."""
    params = make_params(shapes=SHAPES)
    opt = bnbf_nn.LARS8bit(params, lr=0.1, momentum=0.9, min_8bit_size=MIN8, eps=1e-6)
    run_adapter(opt, params, make_grads(params, 1))
    theirs = _as_bitsandbytes(reload(opt.state_dict()))
    theirs["param_groups"][0]["eps"] = 0.0
    twin = bnbf_nn.LARS8bit(
        [torch.nn.Parameter(p.detach().clone()) for p in params], lr=0.1, momentum=0.9, min_8bit_size=MIN8, eps=1e-6
    )
    twin.load_state_dict(theirs)
    assert twin.param_groups[0]["eps"] == 1e-6
    ours = reload(opt.state_dict())
    ours["param_groups"][0]["eps"] = 1e-5
    twin.load_state_dict(ours)
    assert twin.param_groups[0]["eps"] == 1e-5


def test_a_checkpoint_without_the_amsgrad_maximum_says_why():
    """bitsandbytes accepts amsgrad=True and ignores it, so its checkpoints hold no maximum (state3): loading one
    into an optimizer with amsgrad=True is refused, saying so, with nothing changed. bnbf_nn's own checkpoint of
    a run without amsgrad is refused too, without blaming bitsandbytes."""
    params = make_params(shapes=SHAPES)
    opt = bnbf_nn.AdamW8bit(params, min_8bit_size=MIN8)
    run_adapter(opt, params, make_grads(params, 1))
    amsgrad = bnbf_nn.AdamW8bit(
        [torch.nn.Parameter(p.detach().clone()) for p in params], amsgrad=True, min_8bit_size=MIN8
    )
    theirs = reload(opt.state_dict())  # as bitsandbytes' AdamW8bit(amsgrad=True) saves: the flag, no maximum
    theirs = _as_bitsandbytes(bnbf_nn.for_bitsandbytes(theirs))
    theirs["param_groups"][0]["amsgrad"] = True
    with pytest.raises(ValueError, match=r"missing 'state3'.*bitsandbytes' holds no such state.*amsgrad"):
        amsgrad.load_state_dict(theirs)
    assert not amsgrad.state
    ours = reload(opt.state_dict())  # bnbf_nn's own, its group switched to amsgrad: not blamed on bitsandbytes
    ours["param_groups"][0]["amsgrad"] = True
    with pytest.raises(ValueError, match=r"missing 'state3'.*; the optimizer that saved it kept no such state") as e:
        amsgrad.load_state_dict(ours)
    assert "bitsandbytes" not in str(e.value) and not amsgrad.state


def test_a_state_dict_in_torch_optims_layout_is_named():
    """bitsandbytes' PytorchLARS is a plain torch optimizer: its state dict holds ``momentum_buffer`` (and clips with
    max_unorm, which our LARS refuses). Loading one says what it is, not what its groups' settings break; nothing
    changes."""
    params = make_params(shapes=SHAPES)
    opt = bnbf_nn.PytorchLARS(params, lr=0.01, momentum=0.9, min_8bit_size=MIN8)
    run_adapter(opt, params, make_grads(params, 1))
    before = reload(opt.state_dict())
    theirs = {
        "state": {i: {"momentum_buffer": torch.zeros(s)} for i, s in enumerate(SHAPES)},
        "param_groups": [{**before["param_groups"][0], "max_unorm": 0.02}],
    }
    with pytest.raises(ValueError, match=r"param 0 holds \['momentum_buffer'\]: torch.optim's layout"):
        opt.load_state_dict(theirs)
    after = reload(opt.state_dict())
    for k, entry in before["state"].items():
        for f, v in entry[QUANT_KEY].items():
            assert_equal_report(after["state"][k][QUANT_KEY][f], v, f"param {k} {f}")


def test_bitsandbytes_pytorchlars_settings_without_state_load():
    """A state dict of bitsandbytes' PytorchLARS before its first step holds only its groups, ``max_unorm=0.02`` (its
    default clipping) among them: the settings load, the default read as the constructor reads it (our LARS's trust
    ratio stands for it), and the next step starts the state as a first step does."""
    params = make_params(shapes=SHAPES)
    opt = bnbf_nn.PytorchLARS(params, lr=0.01, momentum=0.0, min_8bit_size=MIN8)
    group = {"lr": 0.05, "momentum": 0.9, "dampening": 0, "weight_decay": 0, "nesterov": False, "max_unorm": 0.02}
    opt.load_state_dict({"state": {}, "param_groups": [{**group, "params": list(range(len(SHAPES)))}]})
    assert {k: opt.param_groups[0][k] for k in ("lr", "momentum", "max_unorm")} == {
        "lr": 0.05, "momentum": 0.9, "max_unorm": 0.0
    }  # fmt: skip
    twin_params = make_params(shapes=SHAPES)
    twin = bnbf_nn.PytorchLARS(twin_params, lr=0.05, momentum=0.9, min_8bit_size=MIN8)
    grads = make_grads(params, 2)
    run_adapter(opt, params, grads)
    run_adapter(twin, twin_params, grads)
    for a, b in zip(params, twin_params):
        assert_equal_report(a.detach(), b.detach(), "param")
    other = {**group, "max_unorm": 0.5, "params": list(range(len(SHAPES)))}
    with pytest.raises(ValueError, match="max_unorm does not combine with lars"):  # not its default: refused
        opt.load_state_dict({"state": {}, "param_groups": [other]})


def test_a_state_dict_carries_its_own_qmaps():
    """The live ``qmap1`` of every optimizer is one cached tensor per format, sign and device; a write into one
    optimizer's (a tool rescaling its state tensors in place) changed every optimizer's checkpoints, which then no
    longer loaded. A state dict's qmaps are its own copies of the format's map, shared by its entries (as
    bitsandbytes shares one optimizer's)."""

    def trained(seed):
        torch.manual_seed(seed)
        model = torch.nn.Linear(16, 16)
        opt = bnbf_nn.AdamW8bit(model.parameters(), lr=1e-3, min_8bit_size=0)
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
        return model, opt

    model_a, opt_a = trained(0)
    _, opt_b = trained(1)
    live = opt_a.state[model_a.weight]["qmap1"]
    kept = live.clone()
    live.mul_(0.5)
    try:
        sd = opt_b.state_dict()
    finally:
        live.copy_(kept)  # the cached map is every optimizer's in this process
    entries = [e["__bnb_optimizer_quant_state__"] for e in sd["state"].values()]
    assert entries[0]["qmap1"] is entries[1]["qmap1"]
    assert entries[0]["qmap1"] is not opt_b.state[next(iter(opt_b.state))]["qmap1"]
    fresh = bnbf_nn.AdamW8bit(torch.nn.Linear(16, 16).parameters(), lr=1e-3, min_8bit_size=0)
    fresh.load_state_dict(sd)  # raised "qmap1 is neither the signed dynamic map nor the signed power map"


# ---- saved entries assigned into optimizer.state (ZeroRedundancyOptimizer.load_state_dict) ------------------


def test_a_saved_entry_assigned_into_state_loads_as_load_state_dict():
    """ZeroRedundancyOptimizer.load_state_dict writes each saved entry straight into ``optimizer.state[p]``
    (torch.optim's records are what they save). The step loads such an entry as load_state_dict loads it, and
    training continues bit for bit (it used to drop it for a fresh state at step 1); state_dict shows it before
    any step. A bad entry is refused as load_state_dict refuses it, before anything steps; so is torch.optim's own
    layout."""
    params = make_params(shapes=SHAPES)
    grads = make_grads(params, 4)
    opt = bnbf_nn.AdamW8bit(params, min_8bit_size=MIN8)
    run_adapter(opt, params, grads[:2])
    sd = reload(opt.state_dict())

    def fresh(entries=None):
        twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
        o = bnbf_nn.AdamW8bit(twin, min_8bit_size=MIN8)
        for i, q in enumerate(twin):
            if entries is not None and i in entries:
                o.state[q] = entries[i]
        return twin, o

    loaded, by_load = fresh()
    by_load.load_state_dict(reload(sd))
    assigned, by_hand = fresh(reload(sd)["state"])
    run_adapter(by_load, loaded, grads[2:])
    run_adapter(by_hand, assigned, grads[2:])
    for i, (p, q) in enumerate(zip(loaded, assigned)):
        assert by_hand.state[q]["step"] == by_load.state[p]["step"] == 4
        assert_equal_report(q.detach(), p.detach(), f"param {i} after loading by assignment")
        for field, a, b in zip(by_load.state[p]["state"]._fields, by_load.state[p]["state"], by_hand.state[q]["state"]):
            assert_equal_report(b, a, f"param {i} state {field} after loading by assignment")
    _, shown = fresh(reload(sd)["state"])
    for i, entry in shown.state_dict()["state"].items():
        assert float(entry["step"]) == 2
        for k, v in sd["state"][i][QUANT_KEY].items():
            assert_equal_report(entry[QUANT_KEY][k], v, f"param {i} {k} in state_dict after assignment")

    bad = reload(sd)
    bad["state"][1][QUANT_KEY]["state1"] = bad["state"][1][QUANT_KEY]["state1"][:3]
    torch_layout = {0: {"step": torch.tensor(2.0), "exp_avg": torch.zeros(SHAPES[0])}}
    cases = [(bad["state"], r"state1 has shape \(3,\), the parameter needs \(7,\)")]
    cases += [(torch_layout, r"holds \['exp_avg'\]: torch.optim's layout")]
    for entries, match in cases:
        (twin, refused), (_, other) = fresh(entries), fresh()
        before = [q.detach().clone() for q in twin]
        for q, g in zip(twin, grads[2]):
            q.grad = g.clone()
        with pytest.raises(ValueError, match=match):
            refused.step()
        assert all(torch.equal(q.detach(), b) for q, b in zip(twin, before)), match
        assert not any("state" in r for r in refused.state.values()), match
        with pytest.raises(ValueError, match=match):  # load_state_dict: the same words
            other.load_state_dict({"state": entries, "param_groups": sd["param_groups"]})


def test_a_refused_load_into_the_live_state_refuses_the_next_step():
    """torch.distributed.checkpoint's resume (get_state_dict, dcp.load, set_state_dict) writes the checkpoint into the
    tensors ``state_dict()`` returns, the live state, before ``load_state_dict`` can refuse it: a refused load left
    the refused checkpoint's values in the state (8-bit codes read as 32-bit moments moved a weight by 3.3e7 at lr
    1e-3). Such a refusal says so, and stepping is refused until a load succeeds; a refused dict of other tensors
    leaves the optimizer steppable."""
    params = make_params()
    opt = bnbf_nn.AdamW8bit(params, min_8bit_size=MIN8)
    run_adapter(opt, params, make_grads(params, 2))
    good = copy.deepcopy(opt.state_dict())
    bad = copy.deepcopy(good)
    bad["param_groups"][0]["lr"] = -1.0
    with pytest.raises(ValueError, match="Invalid learning rate"):
        opt.load_state_dict(bad)  # tensors of its own: the state is as it was
    run_adapter(opt, params, make_grads(params, 1, seed=3))
    live = opt.state_dict()
    for entry in live["state"].values():  # as dcp.load writes a checkpoint into them
        for t in entry[QUANT_KEY].values():
            if isinstance(t, torch.Tensor) and t.dtype == torch.uint8:
                t.fill_(255)
    live["param_groups"][0]["lr"] = -1.0
    with pytest.raises(ValueError, match="Invalid learning rate") as refused:
        opt.load_state_dict(live)
    assert "stepping is refused until a load_state_dict succeeds" in "\n".join(getattr(refused.value, "__notes__", []))
    before = [p.detach().clone() for p in params]
    with pytest.raises(RuntimeError, match="the state may hold the refused checkpoint's values"):
        run_adapter(opt, params, make_grads(params, 1, seed=4))
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    opt.load_state_dict(good)
    run_adapter(opt, params, make_grads(params, 1, seed=4))
    assert not all(torch.equal(p.detach(), b) for p, b in zip(params, before))


def test_a_checkpoint_cast_into_a_state_of_other_bits_is_refused():
    """torch.distributed.checkpoint loads a checkpoint into the loading optimizer's own state dict, casting each
    tensor to the dtype found there: 8-bit codes become float32 "moments" (0-255) where that optimizer keeps 32-bit
    state for the param. The groups' record of each param's saved bits tells such a load from a checkpoint saved
    at 32 bits (which would keep its bits), and it is refused, naming the way out; nothing is loaded."""
    params = make_params(shapes=SHAPES)
    a = bnbf_nn.AdamW8bit(params, min_8bit_size=MIN8)
    run_adapter(a, params, make_grads(params, 2))
    saved = reload(a.state_dict())
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    b = bnbf_nn.AdamW8bit(twin, min_8bit_size=MIN8)
    bnbf_nn.GlobalOptimManager.get_instance().override_config(twin[0], "optim_bits", 32)
    run_adapter(b, twin, make_grads(twin, 1, seed=5))  # its own state: 32-bit for param 0
    template = reload(b.state_dict())
    for key, entry in template["state"].items():  # as dcp.load fills it: the saved values, cast to its dtypes
        for name, t in [*entry[QUANT_KEY].items(), ("state_bits", entry["state_bits"])]:
            src = saved["state"][key][QUANT_KEY].get(name, saved["state"][key].get(name))
            t.copy_(src.to(t.dtype))
    template["param_groups"] = saved["param_groups"]
    before = [[t.clone() for t in b.state[q]["state"]] for q in twin]
    with pytest.raises(ValueError, match=r"holds 8-bit state but its tensors arrived as 32-bit ones .*optim_bits"):
        b.load_state_dict(template)
    for q, kept in zip(twin, before):
        assert all(torch.equal(x, y) for x, y in zip(b.state[q]["state"], kept))


def _dcp_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(100, 64), torch.nn.Linear(64, 80))


def _dcp_train(m, opt, seeds):
    for s in seeds:
        opt.zero_grad()
        x = torch.randint(0, 100, (16,), generator=torch.Generator().manual_seed(s))
        m(x).square().mean().backward()
        opt.step()


DCP_RESUMES = {  # 8-bit and 32-bit state (the bias); AdEMAMix's stacked state1; amsgrad's state3, beyond bitsandbytes'
    "AdamW8bit": dict(lr=1e-2),
    "AdEMAMix8bit": dict(lr=1e-2),
    "Adam8bit": dict(lr=1e-2, amsgrad=True),
}


# torch.distributed.checkpoint's plumbing is the same whatever route steps: the interpreter pass (2-11 s a case
# there) leaves these tests to the reference pass and the GPU run; its resumes are test_nn_optim's round trips
@pytest.mark.surface
@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flattened"])
@pytest.mark.parametrize("name", list(DCP_RESUMES))
def test_a_dcp_resume_through_get_and_set_state_dict_continues_bit_for_bit(tmp_path, name, flatten):
    """get_state_dict/set_state_dict with ``flatten_optimizer_state_dict=True`` (torchtitan's setting) rebuild
    each loaded entry from the keys of ``optimizer.state[p]``, not from the checkpoint's: every load was refused
    ("unexpected entry 'state'") while the records lacked a saved entry's ``state_bits`` and
    ``__bnb_optimizer_quant_state__``. Flattened or not, the resume restores the state exactly and continues bit
    for bit with the run that went on."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    cls, kw = getattr(bnbf_nn, name), DCP_RESUMES[name]
    a = _dcp_model()
    opt_a = cls(a.parameters(), **kw, min_8bit_size=MIN8)
    _dcp_train(a, opt_a, (1, 2))
    msd, osd = get_state_dict(a, opt_a, options=options)
    assert flatten == ("state" not in osd)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path), no_dist=True)
    b = _dcp_model()
    opt_b = cls(b.parameters(), **kw, min_8bit_size=MIN8)
    msd_b, osd_b = get_state_dict(b, opt_b, options=options)
    dcp.load({"model": msd_b, "optim": osd_b}, checkpoint_id=str(tmp_path), no_dist=True)
    set_state_dict(b, opt_b, model_state_dict=msd_b, optim_state_dict=osd_b, options=options)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        ra, rb = opt_a.state[p], opt_b.state[q]
        assert rb["step"] == 2 and type(rb["state"]).layout == type(ra["state"]).layout, n
        for field, x, y in zip(ra["state"]._fields, ra["state"], rb["state"]):
            assert_equal_report(y, x, f"{n} {field} after the resume")
    _dcp_train(a, opt_a, (3, 4))
    _dcp_train(b, opt_b, (3, 4))
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert_equal_report(q.detach(), p.detach(), f"{n} after the resume")


@pytest.mark.surface  # DCP's plumbing, as above
@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flattened"])
@pytest.mark.parametrize("change", ["params reordered", "override added"])
def test_a_dcp_resume_keeps_or_refuses_bits_by_param_name(tmp_path, change, flatten):
    """torch.distributed.checkpoint matches optimizer state by the param's name, not its index: a loader that lists
    its params in another order resumes bit for bit (each entry carries its state's bits; a list by position in the
    groups had refused it, naming a cast that did not happen), and one whose new override keeps 32-bit state for a
    param saved with 8-bit state is refused (its codes would load cast to float32 moments); flattened state dicts
    (``flatten_optimizer_state_dict``) alike."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    model, train = _dcp_model, _dcp_train
    a = model()
    order = ["0.weight", "1.weight", "1.bias"]
    pa = dict(a.named_parameters())
    opt_a = bnbf_nn.AdamW8bit([pa[n] for n in order], lr=1e-2, min_8bit_size=MIN8)
    train(a, opt_a, (1, 2))
    msd, osd = get_state_dict(a, opt_a, options=options)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path), no_dist=True)
    b = model()
    pb = dict(b.named_parameters())
    if change == "override added":
        bnbf_nn.GlobalOptimManager.get_instance().override_config(pb["0.weight"], "optim_bits", 32)
    opt_b = bnbf_nn.AdamW8bit([pb[n] for n in order[::-1]], lr=1e-2, min_8bit_size=MIN8)
    msd_b, osd_b = get_state_dict(b, opt_b, options=options)
    dcp.load({"model": msd_b, "optim": osd_b}, checkpoint_id=str(tmp_path), no_dist=True)
    if change == "override added":
        with pytest.raises(ValueError, match="holds 8-bit state but its tensors arrived as 32-bit ones"):
            set_state_dict(b, opt_b, model_state_dict=msd_b, optim_state_dict=osd_b, options=options)
        return
    set_state_dict(b, opt_b, model_state_dict=msd_b, optim_state_dict=osd_b, options=options)
    train(a, opt_a, (3, 4))
    train(b, opt_b, (3, 4))
    for n in order:
        assert_equal_report(pb[n].detach(), pa[n].detach(), f"{n} after the resume")


@pytest.mark.surface  # DCP's plumbing, as above
@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flattened"])
def test_a_dcp_resume_keeps_the_groups_origin(tmp_path, flatten):
    """The groups' "bnbf" entry (the saving optimizer's rule, each group's starting lr) reaches load_state_dict
    through get/set_state_dict, flattened or not: ``flatten_optimizer_state_dict`` loads a group's keys only where
    the live group has them, and without it an SGD8bit checkpoint loaded into Lion8bit (one state each, the same
    names) and a hand-set lr resumed as the group's starting lr (what GlobalOptimManager's lr overrides scale)."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    a = _dcp_model()
    opt_a = bnbf_nn.SGD8bit(a.parameters(), lr=1e-2, momentum=0.9, min_8bit_size=MIN8)
    opt_a.param_groups[0]["lr"] = 5e-3  # by hand, no scheduler: the starting lr stays 1e-2
    _dcp_train(a, opt_a, (1, 2))
    msd, osd = get_state_dict(a, opt_a, options=options)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path), no_dist=True)

    def loaded(cls, **kw):
        b = _dcp_model()
        opt = cls(b.parameters(), lr=1e-2, min_8bit_size=MIN8, **kw)
        msd_b, osd_b = get_state_dict(b, opt, options=options)
        dcp.load({"optim": osd_b}, checkpoint_id=str(tmp_path), no_dist=True)
        return b, opt, osd_b

    b, lion, osd_b = loaded(bnbf_nn.Lion8bit)
    with pytest.raises(ValueError, match=r"from SGD8bit \(rule 'sgd'\); Lion8bit uses rule 'lion'"):
        set_state_dict(b, lion, model_state_dict={}, optim_state_dict=osd_b, options=options)
    b, sgd, osd_b = loaded(bnbf_nn.SGD8bit, momentum=0.9)
    set_state_dict(b, sgd, model_state_dict={}, optim_state_dict=osd_b, options=options)
    assert sgd.param_groups[0]["lr"] == 5e-3
    assert sgd.param_groups[0]["bnbf"] == {"optimizer": "SGD8bit", "rule": "sgd"}
    assert sgd.state_dict()["param_groups"][0]["bnbf"]["lr0"] == 1e-2


@pytest.mark.surface  # DCP's plumbing, as above
def test_a_flattened_dcp_rollback_keeps_a_param_without_state_stateless(tmp_path):
    """``flatten_optimizer_state_dict`` rebuilds each param's entry from the keys of the live ``optimizer.state[p]``,
    so a param without state (requires_grad, but no grad yet) arrives as an empty entry. torch.optim loads it as no
    state; bnbf_nn refused the whole load ("'step' must be a non-negative int, got None") and, the state dict's
    tensors being the live state, then refused every step. A rollback of the live optimizer to a flattened DCP
    checkpoint (torchtitan's setting) now loads, and training goes on bit for bit as after the save."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    m = _dcp_model()
    unused = torch.nn.Parameter(torch.randn(64, 64))  # in the optimizer, never in the loss
    m.register_parameter("unused", unused)
    opt = bnbf_nn.AdamW8bit(m.parameters(), lr=1e-2, min_8bit_size=MIN8)
    _dcp_train(m, opt, (1, 2))
    msd, osd = get_state_dict(m, opt, options=options)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path), no_dist=True)
    _dcp_train(m, opt, (3, 4))
    went_on = [p.detach().clone() for p in m.parameters()]
    msd, osd = get_state_dict(m, opt, options=options)  # the live model and optimizer: rolled back in place
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path), no_dist=True)
    set_state_dict(m, opt, model_state_dict=msd, optim_state_dict=osd, options=options)
    assert "state" not in opt.state.get(unused, {}) and all(r["step"] == 2 for r in opt.state.values() if r)
    _dcp_train(m, opt, (3, 4))
    for p, q in zip(m.parameters(), went_on):
        assert_equal_report(p.detach(), q, "after the rollback")


# ---- the user's entries of optimizer.state[p] (timm's Lookahead keeps its slow weights there) -----------------

USERS = ("lookahead_slow_buff", "count", "ticks")  # a Lookahead-like slow-weight copy, an int, an int64 tensor


def _lookahead_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def _with_users_entries(cls, **kw):
    """A model and ``cls``'s optimizer after two steps, each param's state holding the :data:`USERS` entries
    beside the optimizer's own, as user code writes them."""
    model = _lookahead_model()
    opt = cls(model.parameters(), lr=1e-2, **kw)
    for seed in range(2):
        opt.zero_grad()
        torch.manual_seed(seed)
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
    for i, p in enumerate(model.parameters()):
        # the same values for every optimizer (the params differ by rounding)
        opt.state[p]["lookahead_slow_buff"] = torch.randn(p.shape, generator=torch.Generator().manual_seed(i))
        opt.state[p]["count"] = i + 7
        opt.state[p]["ticks"] = torch.tensor(i + 3)
    return model, opt


def _users_entries(model, opt):
    return [{k: opt.state[p][k] for k in USERS if k in opt.state[p]} for p in model.parameters()]


def _assert_same_entries(got, want, what):
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys(), f"{what}: param {i} holds {sorted(g)}, torch.optim's {sorted(w)}"
        for k, v in w.items():
            if isinstance(v, torch.Tensor):
                assert (g[k].dtype, g[k].device) == (v.dtype, v.device), f"{what}: param {i} {k}"
                assert_equal_report(g[k], v, f"{what}: param {i} {k}")
            else:
                assert type(g[k]) is type(v) and g[k] == v, f"{what}: param {i} {k}: {g[k]!r} != {v!r}"


@pytest.mark.parametrize("name, kw", [("AdamW8bit", dict(min_8bit_size=0)), ("AdamW32bit", {})])
@pytest.mark.parametrize("how", ["state_dict", "assigned", "deepcopy", "pickle"])
def test_the_users_entries_of_a_param_state_are_kept_as_torch_optim_keeps_them(name, kw, how):
    """User code writes entries of its own into ``optimizer.state[p]``: timm's Lookahead keeps its slow weights in its
    base optimizer's state and checkpoints them through that optimizer's state_dict. torch.optim and bitsandbytes keep
    them through state_dict/load_state_dict (torch.save and torch.load(weights_only=True) between, into a fresh
    optimizer, tensors cast as torch casts them: the int64 tensor to the param's dtype), entries assigned into
    ``optimizer.state[p]`` (ZeroRedundancyOptimizer's load), deepcopy and pickle; bnbf_nn dropped them (a resumed
    Lookahead diverged). Each comes through as torch.optim.AdamW's does, and the state steps on beside them."""

    def copied(cls, **kw):
        model, opt = _with_users_entries(cls, **kw)
        if how in ("deepcopy", "pickle"):
            return copy.deepcopy((model, opt)) if how == "deepcopy" else pickle.loads(pickle.dumps((model, opt)))
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        buf.seek(0)
        saved = torch.load(buf, weights_only=True)
        model = _lookahead_model()
        opt = cls(model.parameters(), lr=1e-2, **kw)
        if how == "assigned":
            for i, p in enumerate(model.parameters()):
                opt.state[p] = saved["state"][i]
            opt.state_dict()  # (bnbf_nn loads assigned entries at its next step or state_dict)
        else:
            opt.load_state_dict(saved)
        return model, opt

    torch_model, torch_opt = copied(torch.optim.AdamW)
    model, opt = copied(getattr(bnbf_nn, name), **kw)
    want = _users_entries(torch_model, torch_opt)
    _assert_same_entries(_users_entries(model, opt), want, f"{name} after {how}")
    assert all("state" in opt.state[p] and opt.state[p]["step"] == 2 for p in model.parameters())
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    _assert_same_entries(_users_entries(model, opt), want, f"{name} after {how} and a step")
    saved = opt.state_dict()["state"]
    assert all(set(USERS) < set(saved[i]) and float(saved[i]["step"]) == 3 for i in range(len(want)))


@pytest.mark.parametrize("name", ["SGD8bit", "SGD32bit"])
def test_an_entry_written_before_the_first_step_stays_beside_its_state(name):
    """A wrapper may write its entry into ``optimizer.state[p]`` before the param's first step. bnbf_nn read a tensor
    there as a checkpoint in torch.optim's layout (step and state_dict raised "holds ['slow']: torch.optim's
    layout") and dropped any other value at the first step. As torch.optim.SGD does, state_dict saves the entries
    alone, a load (into a fresh optimizer) keeps them, and the first step makes the state beside them, stepping as
    an optimizer without them does."""
    cls, kw = getattr(bnbf_nn, name), dict(momentum=0.9, min_8bit_size=0)

    def run(cls, entries, **kw):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        opt = cls(model.parameters(), lr=1e-2, **kw)
        if entries:
            opt.state[model.weight]["slow"] = torch.ones(4, 8)
            opt.state[model.weight]["count"] = 7
        before = reload(opt.state_dict())
        fresh = cls(model.parameters(), lr=1e-2, **kw)
        fresh.load_state_dict(before)
        for o in (opt, fresh):
            model.zero_grad()
            torch.manual_seed(1)
            model(torch.randn(3, 8)).sum().backward()
            o.step()
        return model, opt, fresh, before

    torch_model, torch_opt, torch_fresh, torch_before = run(torch.optim.SGD, True, momentum=0.9)
    model, opt, fresh, before = run(cls, True, **kw)
    assert {i: sorted(e) for i, e in before["state"].items()} == {
        i: sorted(e) for i, e in torch_before["state"].items()
    }
    want = [{k: torch_opt.state[p][k] for k in ("slow", "count")} for p in (torch_model.weight,)]
    for o in (opt, fresh):
        got = [{k: o.state[p][k] for k in ("slow", "count") if k in o.state[p]} for p in (model.weight,)]
        _assert_same_entries(got, want, f"{name} after its first step")
        assert all("state" in o.state[p] and o.state[p]["step"] == 1 for p in model.parameters())
        assert {"slow", "count"} < set(o.state_dict()["state"][0])
    twin_model, *_ = run(cls, False, **kw)
    for p, q in zip(model.parameters(), twin_model.parameters()):
        assert_equal_report(p.detach(), q.detach(), f"{name}: param stepped beside the entries")

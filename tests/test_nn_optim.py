"""bnbf_nn's optimizers against the functional core and torch.optim's conventions, one table over all classes.

Every class X, X8bit, X32bit of every family in ``bnbf_nn.FAMILIES`` gets: construction with defaults and
bitsandbytes' argument names, bit-for-bit parity with ``bnbf.update_`` called directly (fp32, fp16, bf16
params), and a state-dict round trip after which training continues bit for bit. The conventions (param
groups, schedulers, GradScaler, hooks, closures, params without grad, skip_zeros, deepcopy, pickle) run on
a few classes. Shapes are a few hundred elements so the Triton-interpreter pass stays fast; there the
32-bit classes run fp32 only (8-bit classes run every dtype).
"""

from __future__ import annotations

import copy
import dataclasses
import fractions
import inspect
import io
import json
import pickle
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import DEVICES
from tolerances import assert_equal_report

import bnbf
import bnbf_nn
from bnbf._dispatch import interpreting
from bnbf_nn import _checkpoint

MIN8 = 256  # min_8bit_size in these tests: the (300,) and (16, 40) params get 8-bit state, (7,) 32-bit
SHAPES = [(300,), (16, 40), (7,)]

# family -> non-default hyperparameters the parity tests use (bitsandbytes' argument names)
HPARAMS = {
    "Adam": dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
    "AdamW": dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
    "Lion": dict(lr=1e-3, betas=(0.8, 0.95), weight_decay=0.1),
    "SGD": dict(lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=0.01),
    "RMSprop": dict(lr=1e-2, alpha=0.9, eps=1e-6, weight_decay=0.01, momentum=0.5, centered=True),
    "Adagrad": dict(lr=1e-2, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1, eps=1e-8),
    "LAMB": dict(lr=1e-2, bias_correction=False, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, clamp_value=5.0),
    "LARS": dict(lr=1e-2, momentum=0.9, weight_decay=0.01, trust_coefficient=0.01),
    "AdEMAMix": dict(lr=1e-2, betas=(0.8, 0.99, 0.999), alpha=4.0, t_alpha=10, t_beta3=10, eps=1e-6, weight_decay=0.1),
    "Adan": dict(lr=1e-2, betas=(0.9, 0.8, 0.95), eps=1e-6, weight_decay=0.1, no_prox=True),
}
assert set(HPARAMS) == {f.name for f in bnbf_nn.FAMILIES}, "every family needs a row here"

CLASSES = [(f, bits) for f in bnbf_nn.FAMILIES for bits in (None, 8, 32)]


def cls_name(case) -> str:
    family, bits = case
    return family.name + (f"{bits}bit" if bits else "")


def get_cls(case):
    return getattr(bnbf_nn, cls_name(case))


def make_params(dtype=torch.float32, shapes=SHAPES, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device, dtype)) for s in shapes]


def make_grads(params, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(p.shape, generator=g) * 0.1).to(p.device, p.dtype) for p in params] for _ in range(steps)]


def run_adapter(opt, params, grads):
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()


def core_hparams(cls, kw: dict) -> dict:
    """The rule's hyperparameters among ``kw`` (bitsandbytes' names renamed as the family says)."""
    fields = {f.name for f in dataclasses.fields(bnbf.RULES[cls.family.rule].hparams)}
    renames = dict(cls.family.renames)
    return {renames.get(k, k): v for k, v in kw.items() if renames.get(k, k) in fields}


def run_core(opt, params0, grads, bits, fmt="power", min8=MIN8, hp=None, **update_kw):
    """The same steps through bnbf.init_state/bnbf.update_ directly."""
    group = opt.param_groups[0]
    hp = hp if hp is not None else core_hparams(type(opt), {k: group[k] for k in group if k != "params"})
    if group["max_unorm"]:
        update_kw.setdefault("max_unorm", group["max_unorm"])
    ps = [p.detach().clone() for p in params0]
    spec = bnbf.OptimSpec(rule=type(opt).family.rule, state_bits=bits, min_8bit_size=min8, state_format=fmt)
    states = bnbf.init_state(ps, spec, hp)
    for t, gs in enumerate(grads, start=1):
        bnbf.update_(ps, gs, states, hp, t, **update_kw)
    return ps, states


def assert_same(opt, params, ref_params, ref_states, what=""):
    for i, (p, rp, rs) in enumerate(zip(params, ref_params, ref_states)):
        assert_equal_report(p.detach(), rp, f"{what}param {i}")
        s = opt.state[p]["state"]
        assert type(s) is type(rs), f"{what}param {i}: state {type(s).__name__} != {type(rs).__name__}"
        for name, a, b in zip(s._fields, s, rs):
            assert_equal_report(a, b, f"{what}param {i} state {name}")


# ---- the table ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CLASSES, ids=cls_name)
def test_constructs_with_defaults_and_bnb_names(case):
    family, bits = case
    name = cls_name(case)
    cls = getattr(bnbf_nn, name)
    opt = cls(make_params()) if family.lr is not None else cls(make_params(), lr=0.1)
    group = opt.param_groups[0]
    assert group["optim_bits"] == (bits or 32) and group["min_8bit_size"] == 4096
    assert isinstance(opt, torch.optim.Optimizer)
    assert isinstance(opt, bnbf_nn.Optimizer2State if family.nstates == 2 else bnbf_nn.Optimizer1State)
    ours = inspect.signature(cls).parameters
    positional = [n for n, p in ours.items() if p.kind != p.KEYWORD_ONLY]
    assert positional[:2] == ["params", "lr"] and positional[2 : 2 + len(family.args)] == [k for k, _ in family.args]
    bnb = pytest.importorskip("bitsandbytes.optim")
    if not hasattr(bnb, name):  # a family bitsandbytes lacks (Adan: its own tests check the authors' arguments)
        return
    theirs = inspect.signature(getattr(bnb, name)).parameters
    for n, p in theirs.items():
        if n in ("self", "params"):
            continue
        assert n in ours, f"{name} lacks bitsandbytes' argument {n!r}"
        assert ours[n].default == p.default, f"{name}({n}=...): default {ours[n].default!r} != {p.default!r}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CLASSES, ids=cls_name)
def test_matches_core_bitwise(case, dtype, device):
    cls = get_cls(case)
    family, bits = case
    if interpreting() and bits != 8 and dtype != torch.float32:
        pytest.skip("interpreter pass: 32-bit classes run fp32 only")
    if interpreting() and dtype != torch.float32 and family.name not in ("Adam", "SGD"):
        # the adapter hands every dtype to bnbf.update_ alike; the kernels' 16-bit params are pinned in
        # test_rules (each rule) and test_adam. Here a two-state and a one-state family with 16-bit params
        pytest.skip("interpreter pass: 16-bit params with Adam8bit and SGD8bit (every family in the plain pass)")
    if interpreting() and bits == 32:
        # X32bit is X with optim_bits fixed at X's default, 32 (test_constructs_with_defaults_and_bnb_names): the
        # same groups, plans and kernels as X, which runs here; both run in the plain pass and on CUDA
        pytest.skip("interpreter pass: X32bit steps as X, which runs here")
    kw = HPARAMS[family.name]
    params = make_params(dtype, device=device)
    params0 = [p.detach().clone() for p in params]
    grads = make_grads(params, 2)
    opt = cls(params, **kw, min_8bit_size=MIN8)
    run_adapter(opt, params, grads)
    ref_p, ref_s = run_core(opt, params0, grads, bits or 32, hp=core_hparams(cls, kw))
    assert_same(opt, params, ref_p, ref_s)
    assert all(opt.state[p]["step"] == 2 for p in params)


@pytest.mark.parametrize("case", CLASSES, ids=cls_name)
def test_state_dict_round_trip_continues_bitwise(case, device):
    cls = get_cls(case)
    family, bits = case
    if interpreting() and bits != 8:
        pytest.skip("interpreter pass: the round trip runs on the 8-bit classes")
    kw = HPARAMS[family.name]
    params = make_params(device=device)
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    grads = make_grads(params, 3)
    opt, opt2 = cls(params, **kw, min_8bit_size=MIN8), cls(twin, **kw, min_8bit_size=MIN8)
    run_adapter(opt, params, grads[:2])
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    for entry in sd["state"].values():  # the layout bitsandbytes writes
        quant = entry["__bnb_optimizer_quant_state__"]
        # step as torch.optim stores it: a float32 tensor (so torch.distributed.checkpoint loads it back)
        assert isinstance(entry["step"], torch.Tensor) and entry["step"].dtype == torch.float32
        assert entry["step"].item() == 2
        assert {t.dtype for k, t in quant.items() if k.startswith(("absmax", "qmap"))} <= {torch.float32}
    for p, q in zip(params, twin):
        q.data.copy_(p.data)
    opt2.load_state_dict(sd)
    assert_same(opt2, twin, [p.detach() for p in params], [opt.state[p]["state"] for p in params], "loaded ")
    run_adapter(opt, params, grads[2:])
    run_adapter(opt2, twin, grads[2:])
    assert_same(opt2, twin, [p.detach() for p in params], [opt.state[p]["state"] for p in params], "continued ")


@pytest.mark.parametrize("case", CLASSES, ids=cls_name)
def test_state_has_bitsandbytes_names_as_live_views(case):
    """``optimizer.state[p]`` holds bitsandbytes' ``state{k}``/``qmap{k}``/``absmax{k}`` beside bnbf's state:
    the same values a state dict writes, as views of the tensors the kernels step (a write through them is a
    write to the optimizer), so summing the tensors in ``optimizer.state`` counts the state's true bytes."""
    family, bits = case
    cls = get_cls(case)
    if interpreting() and (bits != 8 or family.name not in ("AdamW", "AdEMAMix")):
        pytest.skip("interpreter pass: the layout (host code) on AdamW8bit and AdEMAMix8bit (all in the plain pass)")
    params = make_params()
    opt = cls(params, **HPARAMS[family.name], min_8bit_size=MIN8)
    run_adapter(opt, params, make_grads(params, 1))
    for i, p in enumerate(params):
        rec = opt.state[p]
        s = rec["state"]
        packed = _checkpoint.pack(s, family.bnb_slots)
        nested = (_checkpoint.QUANT_KEY, _checkpoint.BITS_KEY)
        views = {k: v for k, v in rec.items() if k not in ("step", "state", *nested)}
        assert set(views) == set(packed) - {"unorm_vec"}, f"param {i}: {sorted(views)} != {sorted(packed)}"
        # also nested as in a saved entry (the same tensors), beside the bits: a saved entry's keys
        assert rec[_checkpoint.QUANT_KEY].keys() == views.keys(), f"param {i}"
        assert all(rec[_checkpoint.QUANT_KEY][k] is v for k, v in views.items()), f"param {i}"
        assert rec[_checkpoint.BITS_KEY] == type(s).layout.bits, f"param {i}"
        for k, v in views.items():
            assert_equal_report(v, packed[k], f"param {i} {k}")
        # true bytes: the state's own tensors, counted once (the 256-value qmaps are shared maps, as bitsandbytes')
        held = sum(v.numel() * v.element_size() for k, v in views.items() if not k.startswith("qmap"))
        assert held == bnbf.state_nbytes(s), (
            f"param {i}: {held} bytes in state[p], the state holds {bnbf.state_nbytes(s)}"
        )
        # live: a write through each view reaches the field the kernels read
        for k, v in views.items():
            if k.startswith("qmap"):
                continue
            rows = v if family.bnb_slots and v.dim() > (1 if k.startswith("absmax") else p.dim()) else v[None]
            for r in range(rows.shape[0]):
                flat = rows[r].reshape(-1)
                before = flat[0].clone()
                with torch.no_grad():
                    flat[0] = before + 1 if v.dtype == torch.uint8 else before + 0.5
                assert any(
                    f.data_ptr() == rows[r].data_ptr() and not torch.equal(f.reshape(-1)[0], before) for f in s
                ), f"param {i}: {k}[{r}] is not a view of a state field"
                with torch.no_grad():
                    flat[0] = before


@pytest.mark.parametrize("name", ["AdamW8bit", "AdEMAMix8bit", "Lion32bit"])
def test_replacing_a_view_writes_the_state(name):
    """A loop that replaces ``optimizer.state[p]``'s tensors (``state[k] = v.to(device)``, bitsandbytes' own
    ``to_gpu`` does so) writes the new values into the state the kernels step: the next step continues from
    them, as from the same values written in place. A tensor the state cannot take (another dtype, shape or
    device; a qmap of other values) raises and changes nothing, through ``update`` too."""
    params, twin = make_params(), make_params()
    opt, ref = getattr(bnbf_nn, name)(params, min_8bit_size=MIN8), getattr(bnbf_nn, name)(twin, min_8bit_size=MIN8)
    grads = make_grads(params, 2)
    run_adapter(opt, params, grads[:1])
    run_adapter(ref, twin, grads[:1])
    for p, q in zip(params, twin):
        rec = opt.state[p]
        for k, v in list(rec.items()):
            if isinstance(v, torch.Tensor) and not k.startswith("qmap"):
                first = (0,) * v.dim()
                new = v.clone()
                new[first] += 1 if v.dtype == torch.uint8 else 0.25
                rec[k] = new  # replaced: the values land in the state
                with torch.no_grad():
                    ref.state[q][k][first] = new[first]  # the twin: the same write, in place
        assert all(rec[k] is v for k, v in opt.state[p].items())
        before = [t.clone() for t in rec["state"]]
        key = "state1"
        bad = [rec[key].to(torch.float16 if rec[key].dtype != torch.float16 else torch.float32), rec[key][:1].clone()]
        if "qmap1" in rec:
            bad.append(rec["qmap1"].flip(0))
        for value in bad:
            target = "qmap1" if value.numel() == 256 and "qmap1" in rec and value.dtype == rec["qmap1"].dtype else key
            with pytest.raises(ValueError, match="is a view of the state the optimizer steps"):
                rec.update({target: value})
        for a, b in zip(rec["state"], before):
            assert_equal_report(a, b, f"{name}: state after a refused write")
    run_adapter(opt, params, grads[1:])
    run_adapter(ref, twin, grads[1:])
    assert_same(opt, params, [q.detach() for q in twin], [ref.state[q]["state"] for q in twin])


@pytest.mark.parametrize("name", ["AdamW8bit", "AdEMAMix8bit", "Lion32bit"])
def test_replacing_the_nested_views_or_the_state_writes_the_state(name):
    """A loop that rebuilds a record's containers (``rec.update(tree_map(move, dict(rec)))``, a recursive mover)
    replaces the nested views under ``__bnb_optimizer_quant_state__`` with a plain dict and ``state`` with a
    new NamedTuple: their values are written into the state the kernels step (replaced instead, the flat views
    would go on pointing at tensors no step reads), and the next step continues from them. A mapping of other
    keys, a state of another type, a tensor that does not fit or another ``state_bits`` raises and changes nothing."""
    params, twin = make_params(), make_params()
    opt, ref = getattr(bnbf_nn, name)(params, min_8bit_size=MIN8), getattr(bnbf_nn, name)(twin, min_8bit_size=MIN8)
    grads = make_grads(params, 2)
    run_adapter(opt, params, grads[:1])
    run_adapter(ref, twin, grads[:1])

    def bump(key, t):  # new values for a view (a qmap takes only its own)
        return t.clone() if key.startswith("qmap") else t + (1 if t.dtype == torch.uint8 else 0.25)

    for i, (p, q) in enumerate(zip(params, twin)):
        rec = opt.state[p]
        held = dict(rec)
        nested, state = rec[_checkpoint.QUANT_KEY], rec["state"]
        if i % 2:  # the nested views: every view's values moved
            moved = {k: bump(k, v) for k, v in nested.items()}
            rec.update({_checkpoint.QUANT_KEY: moved, "state_bits": rec["state_bits"]})
            for k, v in moved.items():
                with torch.no_grad():
                    ref.state[q][_checkpoint.QUANT_KEY][k].copy_(v)
        else:  # the state, as torch's tree_map rebuilds it
            moved = torch.utils._pytree.tree_map(lambda t: t.clone() + 1 if t.dtype == torch.uint8 else t * 1.5, state)
            rec["state"] = moved
            for a, b in zip(ref.state[q]["state"], moved):
                with torch.no_grad():
                    a.copy_(b)
        assert all(rec[k] is v for k, v in held.items()), "the record's tensors, nested views and state stay live"
        before = [t.clone() for t in state]
        first = next(iter(nested))
        refused = [
            (_checkpoint.QUANT_KEY, {k: v for k, v in nested.items() if k != first}, "holds views of the state"),
            (_checkpoint.QUANT_KEY, {**nested, first: nested[first][:1].clone()}, "is a view of the state"),
            ("state", tuple(state), "assign a state of that type"),
            ("state", state._replace(**{state._fields[-1]: state[-1].double()}), "is a tensor of the state"),
            ("state_bits", 40 - rec["state_bits"], "records the bits of the state"),
        ]
        if i % 2:  # a good tensor before the bad one is not written either
            key = sorted(nested)[-1]
            refused.append(
                (
                    _checkpoint.QUANT_KEY,
                    {**{k: bump(k, v) for k, v in nested.items()}, key: nested[key].half()},
                    "is a view",
                )
            )
        for key, value, match in refused:
            with pytest.raises(ValueError, match=match):
                rec[key] = value
            assert all(rec[k] is v for k, v in held.items()), f"{name}: a refused {key} replaced the record's entry"
            for a, b in zip(rec["state"], before):
                assert_equal_report(a, b, f"{name}: state after a refused write of {key}")
    run_adapter(opt, params, grads[1:])
    run_adapter(ref, twin, grads[1:])
    assert_same(opt, params, [q.detach() for q in twin], [ref.state[q]["state"] for q in twin])


def _moved(x, top=None, device=None):
    """``x`` rebuilt by a recursive mover (Lightning's ``apply_to_collection`` with ``Tensor.to``): each tensor
    copied on its own (to ``device``; None: a clone stands for a move), each mapping and NamedTuple made again
    (``top``: the outer type)."""
    if isinstance(x, torch.Tensor):
        return x.clone() if device is None else x.to(device)
    if isinstance(x, dict):
        return (top or type(x))({k: _moved(v, device=device) for k, v in x.items()})
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(_moved(v, device=device) for v in x))
    return x


@pytest.mark.skipif(not torch.cuda.is_available(), reason="moves state between the GPU and the CPU")
@pytest.mark.parametrize("name", ["AdamW8bit", "AdEMAMix8bit", "Lion32bit"])
def test_state_moved_key_by_key_to_the_cpu_and_back_continues(name):
    """Lightning moves optimizer state key by key (``rec[k] = apply_to_collection(rec[k], Tensor, to)``, every key
    but ``step``): to the CPU at a fit's teardown (the model with it), back to the GPU on restore. Moved to the
    CPU, the run goes on there as the same optimizer saved and loaded on the CPU does; moved back, as one
    never moved."""
    params, twin = make_params(device="cuda"), make_params(device="cuda")
    opt, ref = getattr(bnbf_nn, name)(params, min_8bit_size=MIN8), getattr(bnbf_nn, name)(twin, min_8bit_size=MIN8)
    grads = make_grads(params, 4)
    run_adapter(opt, params, grads[:1])
    run_adapter(ref, twin, grads[:1])

    def move(device):
        for rec in opt.state.values():
            for k, v in rec.items():
                if k != "step":
                    rec[k] = _moved(v, device=device)

    move("cpu")
    for p in params:
        p.data = p.data.cpu()  # Module.cpu(): the same Parameter objects
    saved = copy.deepcopy(opt.state_dict())
    cpu_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    loaded = getattr(bnbf_nn, name)(cpu_params, min_8bit_size=MIN8)
    loaded.load_state_dict(saved)
    cpu_grads = [[g.cpu() for g in gs] for gs in grads[1:2]]
    run_adapter(opt, params, cpu_grads)
    run_adapter(loaded, cpu_params, cpu_grads)
    assert_same(opt, params, [q.detach() for q in cpu_params], [loaded.state[q]["state"] for q in cpu_params], "cpu: ")
    run_adapter(ref, twin, grads[1:2])  # the twin took step 2 on the GPU: start the round trip from its values
    with torch.no_grad():
        for p, q in zip(params, twin):
            p.data = q.detach().cpu().clone()
    for p, q in zip(params, twin):
        for a, b in zip(opt.state[p]["state"], ref.state[q]["state"]):
            a.copy_(b)
    move("cuda")
    for p in params:
        p.data = p.data.cuda()
    run_adapter(opt, params, grads[2:])
    run_adapter(ref, twin, grads[2:])
    assert_same(opt, params, [q.detach() for q in twin], [ref.state[q]["state"] for q in twin], "back on cuda: ")
    for p in params:
        rec = opt.state[p]
        homes = {t.untyped_storage().data_ptr() for t in rec["state"]}
        assert all(rec[k] is v for k, v in rec[_checkpoint.QUANT_KEY].items())
        assert all(
            v.untyped_storage().data_ptr() in homes
            for k, v in rec.items()
            if _checkpoint._VIEW.fullmatch(k) and not k.startswith("qmap")
        )


@pytest.mark.parametrize("name", ["AdamW8bit", "Lion32bit", "RMSprop8bit"])
def test_state_moved_key_by_key_to_another_device_is_kept(name):
    """Lightning's mover on a machine without a second device (``meta`` stands for it; tests/test_integrations.py
    runs Lightning's own, where it is installed): every entry but ``step`` given a copy on the other device, the
    state first, is kept; the next state_dict makes bitsandbytes' names views of the moved state, and the next
    step refuses the state left on another device than its param, changing nothing. A view given a copy
    elsewhere while its state stays, or after the state was deleted by hand, is refused as before."""
    params = make_params()
    opt = getattr(bnbf_nn, name)(params, min_8bit_size=MIN8)
    run_adapter(opt, params, make_grads(params, 1))
    rec = opt.state[params[0]]
    with pytest.raises(ValueError, match="is a view of the state"):
        rec["state1"] = rec["state1"].to("meta")
    other = copy.deepcopy(rec)
    del other["state"]
    with pytest.raises(ValueError, match="is a view of the state"):
        other["state1"] = other["state1"].to("meta")
    for rec in opt.state.values():
        for k, v in rec.items():
            if k != "step":
                rec[k] = _moved(v, device="meta")
    saved = opt.state_dict()["state"]
    for p in params:
        rec = opt.state[p]
        assert all(t.device.type == "meta" for t in rec["state"]), name
        assert all(rec[k] is v and v.device.type == "meta" for k, v in rec[_checkpoint.QUANT_KEY].items()), name
    assert all(t.device.type == "meta" for e in saved.values() for t in e[_checkpoint.QUANT_KEY].values())
    for p, g in zip(params, make_grads(params, 1, seed=2)[0]):
        p.grad = g
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match="is on meta but the param is on cpu"):
        opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))


@pytest.mark.parametrize("name", ["AdamW8bit", "AdEMAMix8bit"])
def test_a_record_update_checks_every_entry_before_writing_any(name):
    """``rec.update(entries)`` writes as ``rec[k] = v`` does, but a refused entry leaves the others unwritten: a
    state, nested views or a view that fit are not written where a later entry raises (they were, then it
    raised). An update moving the whole record to another device, the state first, is kept as item by item."""
    params = make_params()
    opt = getattr(bnbf_nn, name)(params, min_8bit_size=MIN8)
    run_adapter(opt, params, make_grads(params, 1))
    rec = opt.state[params[0]]
    before = [t.clone() for t in rec["state"]]
    held = dict(rec)
    state, nested = rec["state"], rec[_checkpoint.QUANT_KEY]
    bumped = type(state)(*(t + 1 if t.dtype == torch.uint8 else t * 2 for t in state))
    bad = rec["state1"][:1].clone()
    for good in (
        {"state": bumped},
        {_checkpoint.QUANT_KEY: {k: v.clone() + (0 if k.startswith("qmap") else 1) for k, v in nested.items()}},
        {"state1": rec["state1"] + 1},
    ):
        for last in ({"state1": bad}, {_checkpoint.BITS_KEY: 40 - rec[_checkpoint.BITS_KEY]}):
            if "state1" in good and "state1" in last:
                last = {"absmax1": rec["absmax1"].double()}
            with pytest.raises(ValueError):
                rec.update({**good, **last})
            assert all(rec[k] is v for k, v in held.items())
            for a, b in zip(rec["state"], before):
                assert_equal_report(a, b, f"{name}: state after a refused update of {sorted(good)}")
    rec.update(_moved(dict(rec), device="meta"))
    assert all(t.device.type == "meta" for t in rec["state"])


@pytest.mark.parametrize("top", [dict, None], ids=["plain dict", "record type"])
@pytest.mark.parametrize("name", ["AdamW8bit", "AdEMAMix8bit", "Lion32bit"])
def test_a_record_rebuilt_by_a_mover_gets_views_of_its_state_again(name, top):
    """A mover that rebuilds ``optimizer.state[p]`` (``opt.state[p] = apply_to_collection(...)``, as Lightning
    moves optimizer state) copies the state and each of bitsandbytes' views apart, so the views were no longer
    views of the state the kernels step: stale after the next step, and writes to them lost. The next step
    (or state_dict) makes them views of the record's state again; the run continues as one never moved."""
    params, twin = make_params(), make_params()
    opt, ref = getattr(bnbf_nn, name)(params, min_8bit_size=MIN8), getattr(bnbf_nn, name)(twin, min_8bit_size=MIN8)
    grads = make_grads(params, 3)
    run_adapter(opt, params, grads[:1])
    run_adapter(ref, twin, grads[:1])
    for p in params:
        opt.state[p] = _moved(opt.state[p], top)
    run_adapter(opt, params, grads[1:2])
    run_adapter(ref, twin, grads[1:2])
    for p, q in zip(params, twin):
        rec = opt.state[p]
        assert type(rec) is _checkpoint.Record and type(rec[_checkpoint.QUANT_KEY]) is _checkpoint.Record
        for k, v in rec[_checkpoint.QUANT_KEY].items():
            assert rec[k] is v, f"{name}: flat and nested {k} are one view"
            if not k.startswith("qmap"):
                bump = 1 if v.dtype == torch.uint8 else 0.25
                with torch.no_grad():
                    v.reshape(-1)[0] += bump  # through the view: into the state, as on the twin
                    ref.state[q][k].reshape(-1)[0] += bump
    run_adapter(opt, params, grads[2:])
    run_adapter(ref, twin, grads[2:])
    assert_same(opt, params, [q.detach() for q in twin], [ref.state[q]["state"] for q in twin])


@pytest.mark.parametrize("name", ["PagedAdamW8bit", "PagedAdEMAMix32bit", "PagedLion", "PagedAdam8bit"])
def test_paged_classes_on_the_cpu_step_as_unpaged(name):
    """On the CPU paged state is ordinary memory: a Paged* class, and ``is_paged=True`` on any class, steps
    bit for bit as its unpaged class (tests/test_paged.py checks managed memory on CUDA)."""
    if interpreting():
        pytest.skip("interpreter pass: paged or not, the same kernels step (plain pass: this test; CUDA: test_paged)")
    unpaged = getattr(bnbf_nn, name.removeprefix("Paged"))
    params, twin, third = make_params(), make_params(), make_params()
    grads = make_grads(params, 2)
    a = getattr(bnbf_nn, name)(params, min_8bit_size=MIN8)
    b = unpaged(twin, min_8bit_size=MIN8)
    c = bnbf_nn.SGD8bit(third, 0.1, 0.9, is_paged=True, min_8bit_size=MIN8)
    assert a.is_paged and not b.is_paged and c.is_paged
    with warnings.catch_warnings(record=True) as caught:  # once per optimizer, as bitsandbytes warns
        warnings.simplefilter("always")
        run_adapter(a, params, grads)
    said = [w for w in caught if "paged state (is_paged=True) needs CUDA params" in str(w.message)]
    assert len(said) == 1 and said[0].filename == __file__, [str(w.message) for w in caught]
    run_adapter(b, twin, grads)
    assert_same(a, params, [p.detach() for p in twin], [b.state[p]["state"] for p in twin])
    run_adapter(c, third, grads)
    ref = make_params()
    run_adapter(bnbf_nn.SGD8bit(ref, 0.1, 0.9, min_8bit_size=MIN8), ref, grads)
    for p, q in zip(third, ref):
        assert_equal_report(p.detach(), q.detach(), "is_paged=True on the CPU")


# ---- arguments --------------------------------------------------------------------------------------------


def test_positional_arguments_bind_as_bitsandbytes():
    """bitsandbytes' positional order (torch.optim's for the hyperparameters), then its storage arguments;
    bnbf's own arguments are keyword-only. tests/test_bnb_conformance.py compares every signature."""
    a = bnbf_nn.SGD8bit(make_params(), 0.01, 0.9, 0.0, 0.01, False, None, 100, block_wise=True)
    g = a.param_groups[0]
    assert (g["lr"], g["momentum"], g["weight_decay"], g["min_8bit_size"], g["optim_bits"]) == (0.01, 0.9, 0.01, 100, 8)
    b = bnbf_nn.RMSprop8bit(make_params(), 0.01, 0.9, 1e-6, 0.0, 0.5, True)
    g = b.param_groups[0]
    assert (g["alpha"], g["eps"], g["momentum"], g["centered"]) == (0.9, 1e-6, 0.5, True)
    c = bnbf_nn.Adam8bit(make_params(), 1e-3, (0.8, 0.9), 1e-6, 0.0, False, 32, None, 64, True)
    g = c.param_groups[0]
    assert (g["betas"], g["optim_bits"], g["min_8bit_size"], c.is_paged) == ((0.8, 0.9), 8, 64, True)
    d = bnbf_nn.Lion(make_params(), 1e-4, (0.9, 0.99), 0.0, 8, None, 64)
    assert d.param_groups[0]["optim_bits"] == 8
    with pytest.raises(TypeError):
        bnbf_nn.Adam8bit(make_params(), 1e-3, (0.9, 0.99), 1e-8, 0.0, False, 32, None, 64, False, 0.0)
    with pytest.raises(TypeError, match="lr"):
        bnbf_nn.SGD8bit(make_params())  # lr is required, as in bitsandbytes


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda ps: bnbf_nn.AdamW8bit(ps, is_paged="False"), TypeError, "is_paged must be a bool"),
        (lambda ps: bnbf_nn.AdamW8bit(ps, block_wise=0.0), TypeError, "block_wise must be a bool"),
        (lambda ps: bnbf_nn.PagedAdamW(ps, is_paged=False), TypeError, r"PagedAdamW.__init__\(\) got an unexp"),
        (lambda ps: bnbf_nn.Adam8bit(ps, block_wise=False), ValueError, "block_wise=False"),
        (lambda ps: bnbf_nn.Lion8bit(ps, args=SimpleNamespace(block_wise=False)), ValueError, "block_wise=False"),
        (
            lambda ps: bnbf_nn.SGD8bit(ps, 0.1, args=SimpleNamespace(percentile_clipping=5)),
            NotImplementedError,
            "percentile",
        ),
        (lambda ps: bnbf_nn.LAMB(ps, amsgrad=True), NotImplementedError, "amsgrad"),
        (lambda ps: bnbf_nn.Adam(ps, amsgrad=1), TypeError, "amsgrad must be a bool"),
        (lambda ps: bnbf_nn.AdamW8bit(ps, differentiable=1), TypeError, "differentiable must be a bool"),
        (lambda ps: bnbf_nn.RMSprop8bit(ps, capturable="yes"), TypeError, "capturable must be a bool"),
        (lambda ps: bnbf_nn.Lion8bit(ps, maximize="yes"), TypeError, "maximize must be a bool"),
        (lambda ps: bnbf_nn.AdamW(ps, lr=float("nan")), ValueError, "Invalid learning rate: nan"),
        (lambda ps: bnbf_nn.SGD(ps, lr=1e39), ValueError, r"Invalid learning rate: 1e\+39"),
        (lambda ps: bnbf_nn.RMSprop(ps, alpha=float("nan")), ValueError, "Invalid alpha value: nan"),
        (lambda ps: bnbf_nn.SGD8bit(ps, lr=0.1, momentum=float("inf")), ValueError, "Invalid momentum value: inf"),
        (lambda ps: bnbf_nn.Adam([ps[0], ps[1], ps[0]]), ValueError, "duplicate parameters"),
        (lambda ps: bnbf_nn.Adam([{"params": ps[:2]}, {"params": ps[1:]}]), ValueError, "more than one"),
        (lambda ps: bnbf_nn.Lion8bit(ps, optim_bits=32), ValueError, "8-bit state"),
        (lambda ps: bnbf_nn.Adagrad8bit(ps, optim_bits=32), ValueError, "8-bit state"),
        (lambda ps: bnbf_nn.Adam32bit(ps, optim_bits=8), ValueError, "32-bit state"),
        (lambda ps: bnbf_nn.Adam(ps, optim_bits=16), ValueError, "optim_bits must be 8 or 32"),
        (lambda ps: bnbf_nn.AdamW(ps, lr=-1.0), ValueError, "Invalid learning rate: -1.0"),
        (lambda ps: bnbf_nn.AdamW(ps, betas=(1.0, 0.9)), ValueError, "Invalid beta parameter at index 0"),
        (lambda ps: bnbf_nn.SGD(ps, lr=0.1, nesterov=True), ValueError, "Nesterov"),
        # what bitsandbytes' one-state classes take as betas, in [0, 1) there (torch.optim lets them through)
        (lambda ps: bnbf_nn.SGD8bit(ps, 0.1, 1.0), ValueError, r"Invalid momentum value: 1.0 \(SGD8bit takes 0 <="),
        (lambda ps: bnbf_nn.SGD(ps, 0.1, 0.9, -0.5), ValueError, "Invalid dampening value: -0.5"),
        (lambda ps: bnbf_nn.LARS32bit(ps, 0.1, 0.9, 1.5), ValueError, "Invalid dampening value: 1.5"),
        (lambda ps: bnbf_nn.RMSprop8bit(ps, alpha=1.0), ValueError, "Invalid alpha value: 1.0"),
        (lambda ps: bnbf_nn.RMSprop(ps, momentum=1.5), ValueError, "Invalid momentum value: 1.5"),
        (lambda ps: bnbf_nn.Optimizer1State("rmsprop", ps, betas=(1.0, 0.0)), ValueError, "Invalid alpha value"),
        (lambda ps: bnbf_nn.AdamW8bit(ps, state_format="fp4"), ValueError, "state_format"),
        (lambda ps: bnbf_nn.Optimizer2State("adamax", ps), ValueError, "optimizer_name"),
        (lambda ps: bnbf_nn.LAMB8bit(ps, max_unorm=0.5), NotImplementedError, "trust ratio"),
        (lambda ps: bnbf_nn.LAMB8bit(ps, max_unorm=0.5), ValueError, "trust ratio"),  # bitsandbytes' type
        (lambda ps: bnbf_nn.LAMB(ps, amsgrad=True), NotImplementedError, "amsgrad=True is not supported"),
        (lambda ps: bnbf_nn.LAMB32bit(ps, adam_w_mode=False), NotImplementedError, "adam_w_mode=False is not"),
        # torch.optim.Adam's group setting (AdamW's decay where True; AdamW's L2 where False): was ignored
        (lambda ps: bnbf_nn.Adam8bit([dict(params=ps, decoupled_weight_decay=True)]), ValueError, "use the AdamW c"),
        (lambda ps: bnbf_nn.AdamW([dict(params=ps, decoupled_weight_decay=False)]), ValueError, "use the Adam c"),
        # LAMB's arguments its groups lack, refused in a param group as by the constructor (they were ignored there)
        (lambda ps: bnbf_nn.LAMB8bit([dict(params=ps, amsgrad=True)]), NotImplementedError, "amsgrad=True in a p"),
        (lambda ps: bnbf_nn.LAMB([dict(params=ps, adam_w_mode=False)]), NotImplementedError, "adam_w_mode=False in"),
        (lambda ps: bnbf_nn.LAMB([dict(params=ps, bias_correction=False, debias=True)]), ValueError, "hold as debias"),
    ],
)
def test_bad_arguments(make, error, match):
    with pytest.raises(error, match=match):
        make(make_params())


def test_bitsandbytes_ranges_of_one_state_betas_end_where_its_own_do():
    """The largest momentum, dampening and alpha below 1 are taken, as bitsandbytes takes them; its PytorchLARS, a
    torch optimizer, takes a momentum of 1.5 (it checks momentum >= 0 only), and so does this one."""
    ps = make_params()
    bnbf_nn.SGD8bit(ps, 0.1, 0.999, 0.999)
    bnbf_nn.RMSprop32bit(ps, alpha=0.0, momentum=0.999)
    assert bnbf_nn.PytorchLARS(ps, momentum=1.5).param_groups[0]["momentum"] == 1.5


def test_bnb_base_classes_keep_positional_order():
    params, twin = make_params(), make_params()
    grads = make_grads(params, 2)
    # bitsandbytes' "adam" decays decoupled: AdamW; "momentum" is SGD with betas = (momentum, dampening)
    a = bnbf_nn.Optimizer2State("adam", params, 1e-2, (0.8, 0.99), 1e-6, 0.1, 8, None, MIN8)
    b = bnbf_nn.AdamW8bit(twin, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, min_8bit_size=MIN8)
    run_adapter(a, params, grads)
    run_adapter(b, twin, grads)
    assert_same(a, params, [p.detach() for p in twin], [b.state[p]["state"] for p in twin])
    sgd = bnbf_nn.Optimizer1State("momentum", make_params(), 0.1, (0.9, 0.0), 0.0, 0.0, 8)
    assert (sgd.family.rule, sgd.param_groups[0]["momentum"]) == ("sgd", 0.9)


# ---- torch.optim conventions -----------------------------------------------------------------------------


def test_param_groups_with_their_own_settings():
    a, b = make_params(seed=0), make_params(seed=1)
    a0, b0 = [p.detach().clone() for p in a], [p.detach().clone() for p in b]
    opt = bnbf_nn.AdamW8bit(
        [{"params": a}, {"params": b, "lr": 3e-2, "weight_decay": 0.0, "optim_bits": 32, "betas": (0.5, 0.9)}],
        lr=1e-2,
        min_8bit_size=MIN8,
    )
    ga, gb = make_grads(a, 2, seed=2), make_grads(b, 2, seed=3)
    for t in range(2):
        for p, g in zip(a + b, ga[t] + gb[t]):
            p.grad = g.clone()
        opt.step()
    ra = run_core(opt, a0, ga, 8, hp=dict(lr=1e-2, weight_decay=0.01))
    rb = run_core(opt, b0, gb, 32, hp=dict(lr=3e-2, weight_decay=0.0, betas=(0.5, 0.9)))
    assert_same(opt, a, *ra, "group 0 ")
    assert_same(opt, b, *rb, "group 1 ")


def test_a_group_given_lambs_bias_correction_steps_with_it():
    """LAMB's bias_correction is its rule's debias in the groups: a param group given it in the constructor's name (as
    torch code gives a group its own settings) was ignored, the group stepping with bias correction."""
    a, b = make_params(), make_params()
    grads = make_grads(a, 2)
    opt = bnbf_nn.LAMB8bit([{"params": a, "bias_correction": False}], min_8bit_size=MIN8)
    twin = bnbf_nn.LAMB8bit(b, bias_correction=False, min_8bit_size=MIN8)
    run_adapter(opt, a, grads)
    run_adapter(twin, b, grads)
    assert opt.param_groups[0]["debias"] is False and "bias_correction" not in opt.param_groups[0]
    assert_same(opt, a, [p.detach() for p in b], [twin.state[p]["state"] for p in b])


def test_lambs_bias_correction_set_in_a_group_later_steps_with_it():
    """LAMB's bias_correction written into a live group by hand (as torch code sets a group's setting between steps)
    was ignored: only a group being made, added or loaded read it as debias. The next step reads it (the group's
    debias is older), on the fast path too, and steps as a twin whose debias was set at the same step."""
    a, b = make_params(), make_params()
    grads = make_grads(a, 5)
    opt, twin = bnbf_nn.LAMB8bit(a, min_8bit_size=MIN8), bnbf_nn.LAMB8bit(b, min_8bit_size=MIN8)
    run_adapter(opt, a, grads[:3])
    run_adapter(twin, b, grads[:3])
    opt.param_groups[0]["bias_correction"] = False
    twin.param_groups[0]["debias"] = False
    run_adapter(opt, a, grads[3:])
    run_adapter(twin, b, grads[3:])
    assert opt.param_groups[0]["debias"] is False and "bias_correction" not in opt.param_groups[0]
    assert_same(opt, a, [p.detach() for p in b], [twin.state[p]["state"] for p in b])
    with pytest.raises(TypeError, match="debias must be a bool"):  # the rule's check of debias, before it is written
        opt.param_groups[0]["bias_correction"] = "yes"
        opt.step()
    assert opt.param_groups[0]["debias"] is False and opt.param_groups[0]["bias_correction"] == "yes"


@pytest.mark.parametrize("cls", [bnbf_nn.Adam8bit, bnbf_nn.AdamW32bit], ids=lambda c: c.__name__)
@pytest.mark.parametrize("held", [False, True], ids=["key added", "key flipped"])
def test_decoupled_weight_decay_set_in_a_group_later_is_refused_at_the_next_step(cls, held):
    """torch.optim.Adam's and AdamW's decoupled_weight_decay written into a live group by hand (absent from it, or
    held at the class's value since add_param_group) was ignored: only a group being made, added or loaded was
    checked. The next step refuses the value opposite to the class, on the fast path too, with nothing stepped;
    the class's value steps again."""
    decoupled = cls.family.rule == "adamw"
    params = make_params()
    opt = cls([{"params": params[:1]}], min_8bit_size=MIN8)
    opt.add_param_group({"params": params[1:], **({"decoupled_weight_decay": decoupled} if held else {})})
    grads = make_grads(params, 3)
    run_adapter(opt, params, grads[:2])
    opt.param_groups[1]["decoupled_weight_decay"] = not decoupled
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match=f"decoupled_weight_decay={not decoupled}: {cls.__name__} steps"):
        run_adapter(opt, params, grads[2:])
    assert all(torch.equal(p.detach(), q) for p, q in zip(params, before))
    assert [opt.state[p]["step"] for p in params] == [2] * len(params)
    opt.param_groups[1]["decoupled_weight_decay"] = decoupled
    run_adapter(opt, params, grads[2:])
    assert [opt.state[p]["step"] for p in params] == [3] * len(params)


# the family arguments bnbf's rule lacks, which the constructor and add_param_group take at one value only:
# (class, key, a value they refuse, the value they take)
RULELESS_ARGS = [
    (bnbf_nn.LAMB8bit, "amsgrad", True, False),
    (bnbf_nn.LAMB32bit, "adam_w_mode", False, True),
    (bnbf_nn.Adan8bit, "max_grad_norm", 1.0, 0.0),
]


def _kept(opt, params) -> tuple:
    """What a refused call must leave as it was: the params, the states, the step counts and the group dicts."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    states = [[t.clone() for t in opt.state[p]["state"]] for p in params]
    return [p.detach().clone() for p in params], states, [opt.state[p]["step"] for p in params], copy.deepcopy(groups)


def _assert_kept(opt, params, kept: tuple) -> None:
    now = _kept(opt, params)
    for what, a, b in zip(("param", "state"), now[:2], kept[:2]):
        for i, (x, y) in enumerate(zip(a, b)):
            assert all(map(torch.equal, x, y)) if what == "state" else torch.equal(x, y), f"{what} {i}"
    assert now[2:] == kept[2:]


@pytest.mark.parametrize("held", [False, True], ids=["key added", "key flipped"])
@pytest.mark.parametrize("cls,key,refused,taken", RULELESS_ARGS, ids=lambda v: getattr(v, "__name__", repr(v)))
def test_an_argument_the_rule_lacks_set_in_a_group_later_is_refused_at_the_next_step(cls, key, refused, taken, held):
    """LAMB's amsgrad and adam_w_mode and Adan's max_grad_norm, which bnbf's rules lack (the constructor and
    add_param_group take them at one value), written into a live group by hand were ignored: the step reads the
    rule's keys. The next step refuses another value as the constructor does, naming the key and the group, on the
    fast path and the general one, with nothing changed; the one value steps as a twin whose group lacks the key."""
    a, b = make_params(), make_params()
    grads = make_grads(a, 4)
    opt = cls([{"params": a[:1]}, {"params": a[1:], **({key: taken} if held else {})}], min_8bit_size=MIN8)
    twin = cls([{"params": b[:1]}, {"params": b[1:]}], min_8bit_size=MIN8)
    run_adapter(opt, a, grads[:2])
    run_adapter(twin, b, grads[:2])
    opt.param_groups[1][key] = refused
    kept = _kept(opt, a)
    message = f"^{cls.__name__}: {key}={refused!r} in param group 1 is not supported"
    for args in ((), (lambda: None,)):  # the fast path, then the general one (a closure)
        with pytest.raises(NotImplementedError, match=message):
            opt.step(*args)
        _assert_kept(opt, a, kept)
    opt.param_groups[1][key] = taken
    run_adapter(opt, a, grads[2:])
    run_adapter(twin, b, grads[2:])
    assert_same(opt, a, [p.detach() for p in b], [twin.state[p]["state"] for p in b])


def test_an_argument_the_rule_lacks_held_as_a_tensor_is_read_at_every_step():
    """A tensor there (Adan's max_grad_norm=torch.tensor(0.0), its one value) may change in place, as a scheduler
    fills a tensor lr: the settings of a group holding it are not memoized, and a value filled in later is refused at
    the next step (memoized with them, it was ignored)."""
    params = make_params()
    opt = bnbf_nn.Adan8bit([{"params": params, "max_grad_norm": torch.tensor(0.0)}], min_8bit_size=MIN8)
    run_adapter(opt, params, make_grads(params, 2))
    opt.param_groups[0]["max_grad_norm"].fill_(1.0)
    with pytest.raises(NotImplementedError, match=r"max_grad_norm=tensor\(1\.\) in param group 0 is not supported"):
        run_adapter(opt, params, make_grads(params, 1))


@pytest.mark.parametrize("cls,key,refused,taken", RULELESS_ARGS, ids=lambda v: getattr(v, "__name__", repr(v)))
def test_a_state_dict_group_with_a_refused_argument_is_refused_at_load(cls, key, refused, taken):
    """A saved group holding one of them at a value the constructor refuses (saved after a hand edit) loaded, and
    was ignored from then on; the load refuses it as the step does, before anything is loaded."""
    a = make_params()
    opt = cls(a, min_8bit_size=MIN8)
    run_adapter(opt, a, make_grads(a, 1))
    sd = opt.state_dict()
    sd["param_groups"][0][key] = refused
    kept = _kept(opt, a)
    with pytest.raises(NotImplementedError, match=f"{key}={refused!r} in param group 0 of the state dict"):
        opt.load_state_dict(sd)
    _assert_kept(opt, a, kept)
    sd["param_groups"][0][key] = taken
    opt.load_state_dict(sd)
    assert opt.param_groups[0][key] == taken


@pytest.mark.parametrize("bad", ["meta", "TwoTensor"])
def test_an_unreadable_tensor_lr_is_refused_at_construction_and_load(bad):
    """An lr the step cannot read (a meta tensor, a tensor subclass dispatching on its own) is refused by the
    constructor and by a load, before anything is loaded; a saved group's meta lr loaded and failed at the next step."""
    from torch.testing._internal.two_tensor import TwoTensor

    lr = torch.tensor(1e-2, device="meta") if bad == "meta" else TwoTensor(torch.tensor(1e-2), torch.tensor(1e-2))
    match = f"lr is a {'meta tensor' if bad == 'meta' else 'TwoTensor'}"
    a = make_params()
    with pytest.raises((TypeError, ValueError), match=match):
        bnbf_nn.AdamW8bit(a, lr=lr, min_8bit_size=MIN8)
    opt = bnbf_nn.AdamW8bit(a, lr=1e-2, min_8bit_size=MIN8)
    run_adapter(opt, a, make_grads(a, 1))
    sd = opt.state_dict()
    sd["param_groups"][0]["lr"] = lr
    kept = _kept(opt, a)
    with pytest.raises((TypeError, ValueError), match=match):
        opt.load_state_dict(sd)
    _assert_kept(opt, a, kept)
    assert opt.param_groups[0]["lr"] == 1e-2


def test_a_load_replaces_lambs_bias_correction_set_by_hand_before_it():
    """A live group's bias_correction set by hand and not yet stepped outlived a load (whose group holds debias):
    the next step read it over the loaded debias. The saved group states the settings, as in torch.optim; a saved
    group's own bias_correction is read as its debias, and one that is not a bool is refused at the load."""
    a, b = make_params(), make_params()
    grads = make_grads(a, 4)
    opt, twin = bnbf_nn.LAMB8bit(a, min_8bit_size=MIN8), bnbf_nn.LAMB8bit(b, min_8bit_size=MIN8)
    run_adapter(opt, a, grads[:2])
    sd = copy.deepcopy(opt.state_dict())  # debias True
    with torch.no_grad():
        for p, q in zip(b, a):
            p.copy_(q)
    opt.param_groups[0]["bias_correction"] = False
    opt.load_state_dict(sd)
    twin.load_state_dict(sd)
    assert "bias_correction" not in opt.param_groups[0] and opt.param_groups[0]["debias"] is True
    run_adapter(opt, a, grads[2:3])
    run_adapter(twin, b, grads[2:3])
    assert_same(opt, a, [p.detach() for p in b], [twin.state[p]["state"] for p in b])
    sd["param_groups"][0]["bias_correction"] = False
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["debias"] is False and "bias_correction" not in opt.param_groups[0]
    sd["param_groups"][0]["bias_correction"] = "yes"
    with pytest.raises(ValueError, match="param group 0 of the state dict: .*debias must be a bool"):
        opt.load_state_dict(sd)
    assert opt.param_groups[0]["debias"] is False


def test_add_param_group_and_its_validation():
    opt = bnbf_nn.Lion8bit(make_params(), min_8bit_size=MIN8)
    later = make_params(seed=5)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        opt.add_param_group({"params": later, "lr": -1.0})
    assert len(opt.param_groups) == 1
    adam = bnbf_nn.Adam32bit(make_params())
    with pytest.raises(ValueError, match="decoupled_weight_decay=True"):
        adam.add_param_group({"params": later, "decoupled_weight_decay": True})
    assert len(adam.param_groups) == 1
    adam.add_param_group({"params": later, "decoupled_weight_decay": False})  # what it steps: taken
    opt.add_param_group({"params": later, "lr": 1e-3})
    run_adapter(opt, later, make_grads(later, 1))
    assert all(opt.state[p]["step"] == 1 for p in later)


def _snapshot_opt(opt) -> list:
    return [
        (t, t.detach().clone())
        for g in opt.param_groups
        for p in g["params"]
        for t in [p, *opt.state.get(p, {}).get("state", ())]
    ]


def _assert_unchanged(snap, what):
    for i, (t, before) in enumerate(snap):
        assert_equal_report(t.detach(), before, f"{what}: tensor {i}")


@pytest.mark.parametrize("bad", [-1.0, float("nan"), 1e39, "momentum"], ids=["neg", "nan", "1e39", "momentum"])
def test_bad_setting_in_any_group_steps_no_group(bad):
    """Every group's settings are checked before any group steps: a bad value in the second group, set after
    the plans were cached, raises with every param, state and step count of both groups as they were."""
    a, b = make_params(seed=0), make_params(seed=1)
    # the second group's states are built without momentum, with dampening: momentum switched on there is refused
    # (torch would start the buffer as the direction, bnbf's step at (1 - dampening) times it)
    second = {"params": b, "momentum": 0.0, "dampening": 0.1} if bad == "momentum" else {"params": b}
    opt = bnbf_nn.SGD8bit([{"params": a}, second], lr=1e-2, momentum=0.5, min_8bit_size=MIN8)
    grads = make_grads(a + b, 2)
    run_adapter(opt, a + b, grads[:1])
    if bad == "momentum":
        opt.param_groups[1]["momentum"], match = 0.5, "momentum changed from 0 to 0.5"
    else:
        opt.param_groups[1]["lr"], match = bad, "Invalid learning rate"
    snap = _snapshot_opt(opt)
    for p, g in zip(a + b, grads[1]):
        p.grad = g.clone()
    with pytest.raises(ValueError, match=match):
        opt.step()
    _assert_unchanged(snap, f"after a bad {bad!r} in the second group")
    assert all(opt.state[p]["step"] == 1 for p in a + b)
    opt.param_groups[1].update(lr=1e-2, momentum=0.0 if bad == "momentum" else 0.5)
    opt.step()  # and it steps again
    assert all(opt.state[p]["step"] == 2 for p in a + b)


def test_bad_setting_before_the_first_step_creates_no_state():
    a, b = make_params(seed=0), make_params(seed=1)
    opt = bnbf_nn.AdamW8bit([{"params": a}, {"params": b}], lr=1e-2, min_8bit_size=MIN8)
    opt.param_groups[1]["betas"] = (0.9, float("nan"))
    run_grads = make_grads(a + b, 1)[0]
    for p, g in zip(a + b, run_grads):
        p.grad = g.clone()
    snap = _snapshot_opt(opt)
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1: nan"):
        opt.step()
    _assert_unchanged(snap, "after a bad beta")
    assert not any(opt.state.get(p) for p in a + b)


def _bad_second_group(kind: str, device: str):
    """The params of a second group that its step refuses, and what the refusal says."""
    if kind == "expanded":
        return [torch.nn.Parameter(torch.randn(1, 300, device=device).expand(4, 300))], "zero stride"
    if kind == "overlapping":
        base = torch.randn(400, device=device)
        return [torch.nn.Parameter(base[:200]), torch.nn.Parameter(base[100:])], "overlap in memory"
    if kind == "negative bit":
        return [torch.nn.Parameter(torch.randn(300, device=device)._neg_view())], "negative bit"
    return [torch.nn.Parameter(torch.randn(300, device="meta"))], "meta tensor"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["expanded", "overlapping", "negative bit", "meta"])
def test_a_later_groups_refused_param_steps_no_group(device, kind):
    """A param of the second group that its core call refuses (first step: no state yet) is refused before the
    first group steps: the first group's params, states and step counts as they were, no state made. The first
    group was once stepped (and its count advanced) before the second group's call raised."""
    a = make_params(seed=0, device=device)
    bad, match = _bad_second_group(kind, device)
    opt = bnbf_nn.AdamW8bit([{"params": a}, {"params": bad}], lr=1e-2, min_8bit_size=MIN8)
    for p in a + bad:
        p.grad = torch.ones(p.shape, device=p.device)
    snap = [(p, p.detach().clone()) for p in a]  # (no state yet)
    with pytest.raises((TypeError, ValueError), match=match):
        opt.step()
    _assert_unchanged(snap, f"{kind} param in the second group")
    assert not any(opt.state.get(p) for p in a + bad)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [8, 32])
@pytest.mark.parametrize("later", [False, True], ids=["first step", "later step"])
@pytest.mark.parametrize("bad", ["grad alias", "grad of the first group", "meta lr", "TwoTensor lr"])
def test_a_later_groups_refused_grad_or_setting_steps_no_group(device, bits, later, bad):
    """A grad of the second group that is another of its params' memory, or a setting its step cannot read (a meta
    tensor, a tensor subclass dispatching on its own), is refused before the first group steps, at the first step
    and at a later one (the fast step's, on the GPU's direct launch); every param, state and step count as it was."""
    from torch.testing._internal.two_tensor import TwoTensor

    a, b = make_params(seed=0, device=device), make_params(seed=1, device=device)
    opt = bnbf_nn.AdamW8bit([{"params": a}, {"params": b}], lr=1e-2, min_8bit_size=MIN8, optim_bits=bits)
    if later:
        run_adapter(opt, a + b, make_grads(a + b, 2))
    for p, g in zip(a + b, make_grads(a + b, 1, seed=5)[0]):
        p.grad = g
    if bad == "grad alias":
        b[2].grad = b[0].detach()[:7]  # the (7,) param's grad is the (300,) param's memory
    elif bad == "grad of the first group":
        b[2].grad = a[0].detach()[:7]  # another group's param: no group's own call sees it
    match = {
        "grad alias": "shares memory",
        "grad of the first group": "shares memory",
        "meta lr": "lr is a meta tensor",
        "TwoTensor lr": "lr is a TwoTensor",
    }[bad]
    if bad == "meta lr":
        opt.param_groups[1]["lr"] = torch.tensor(1e-2, device="meta")
    elif bad == "TwoTensor lr":
        opt.param_groups[1]["lr"] = TwoTensor(torch.tensor(1e-2), torch.tensor(1e-2))
    snap = _snapshot_opt(opt)
    steps = [opt.state[p]["step"] if p in opt.state else None for p in a + b]
    with pytest.raises((TypeError, ValueError), match=match):
        opt.step()
    _assert_unchanged(snap, f"a {bad} in the second group")
    assert [opt.state[p]["step"] if p in opt.state else None for p in a + b] == steps


@pytest.mark.parametrize("device", DEVICES)
def test_a_grad_of_another_group_is_refused_beside_a_frozen_param(device):
    """Steps where a param has no grad (a frozen one) keep the check across groups between steps (by the plans of the
    subsets with grads, and the grads' addresses): a grad made another group's param's memory there is refused."""
    a, b = make_params(seed=0, device=device), make_params(seed=1, device=device)
    opt = bnbf_nn.AdamW8bit([{"params": a}, {"params": b}], lr=1e-2, min_8bit_size=MIN8)
    run_adapter(opt, a + b, make_grads(a + b, 1))
    for gs in make_grads(a + b, 2, seed=3):
        for p, g in zip(a + b, gs):
            p.grad = g
        a[1].grad = None
        opt.step()
    b[2].grad = a[0].detach()[:7]
    snap = _snapshot_opt(opt)
    with pytest.raises(ValueError, match=r"grad\[2\] of param group 1 shares memory with param\[0\] of param group 0"):
        opt.step()
    _assert_unchanged(snap, "a grad of group 1 that is group 0's param")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("general", [False, True], ids=["fast step", "general step"])
@pytest.mark.parametrize("change", [".data = another group's param", ".data = another group's grad", "strided grad"])
def test_leaves_changed_between_steps_are_checked_across_groups(device, general, change):
    """A change between steps that makes two groups share memory, where each group's own call sees only its leaves:
    a param's .data made another group's param (stepped twice, silently) or another group's grad (rewritten before
    that group read it), and a strided grad at its old grad's address reaching into another group's param. The fast
    step once checked only grads across groups, against a key of stale marks or of addresses alone, and its key then
    let the general step skip the check too. Refused on either step, nothing written."""
    buf = torch.zeros(1024, device=device)
    a = torch.nn.Parameter(torch.randn(2, 128, device=device))
    a.data = buf[256:512].view(2, 128)
    a.data.normal_()
    b = torch.nn.Parameter(torch.randn(2, 128, device=device))
    opt = bnbf_nn.AdamW8bit([{"params": [a]}, {"params": [b]}], lr=0.1, min_8bit_size=1)
    a.grad = torch.ones_like(a)
    b.grad = buf[0:256].view(2, 128)  # apart from a, kept in place between steps
    buf[0:256] = 1.0
    opt.step()
    opt.step()
    if general:
        opt.param_groups[1]["weight_decay"] = 0.02  # another setting: the general step
    if change == ".data = another group's param":
        b.data = a.data
        match = r"param\[0\] of param group 0 and param\[0\] of param group 1 overlap"
    elif change == ".data = another group's grad":
        a.data = b.grad
        match = r"grad\[0\] of param group 1 shares memory with param\[0\] of param group 0"
    else:
        b.grad = buf.as_strided((2, 128), (256, 1), 0)  # its second row is a's first
        match = r"grad\[0\] of param group 1 shares memory with param\[0\] of param group 0"
    snap = [(t, t.detach().clone()) for t in (buf, *opt.state[a]["state"], *opt.state[b]["state"])]
    with pytest.raises(ValueError, match=match):
        opt.step()
    _assert_unchanged(snap, change)


@pytest.mark.parametrize("device", DEVICES)
def test_params_of_two_groups_sharing_memory_are_refused(device):
    """A param that is a view of another group's param: each group is its own core call, which checks its own
    leaves only, so the shared elements were stepped twice (SGD: 2 lr where the other rows moved lr). Refused
    before anything is written, as two such params in one group are."""
    base = torch.randn(4, 300, device=device)
    a, b = torch.nn.Parameter(base), torch.nn.Parameter(base[0])
    opt = bnbf_nn.SGD8bit([{"params": [a]}, {"params": [b]}], lr=0.1, momentum=0.0, min_8bit_size=1)
    a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    before = base.clone()
    with pytest.raises(ValueError, match=r"param\[0\] of param group 0 and param\[0\] of param group 1 overlap"):
        opt.step()
    assert_equal_report(base, before, "the shared memory")


def test_a_tensor_listed_twice_is_refused():
    ps = make_params()
    opt = bnbf_nn.Adam8bit(ps[:2], min_8bit_size=MIN8)
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
        opt.add_param_group({"params": [ps[1]]})
    with pytest.raises(ValueError, match="duplicate parameters"):
        opt.add_param_group({"params": [ps[2], ps[2]]})
    assert len(opt.param_groups) == 1
    run_adapter(opt, ps[:2], make_grads(ps[:2], 1))
    opt.param_groups[0]["params"] = [ps[0], ps[1], ps[0]]  # edited in place of add_param_group
    snap = _snapshot_opt(opt)
    with pytest.raises(ValueError, match="duplicate parameters"):
        opt.step()
    _assert_unchanged(snap, "after a step refused for a duplicate")


@pytest.mark.parametrize("case", CLASSES, ids=cls_name)
def test_maximize_steps_along_the_gradient(case):
    """maximize=True (torch.optim's switch, on every class) takes the step the same optimizer takes for the
    negated gradient, bit for bit; tests/test_torch_contract.py compares the torch-named classes with torch."""
    family, bits = case
    if interpreting() and bits != 8:
        pytest.skip("interpreter pass: the 8-bit classes")
    cls, kw = get_cls(case), HPARAMS[family.name]
    params, twin = make_params(), make_params()
    grads = make_grads(params, 2)
    opt, ref = cls(params, **kw, min_8bit_size=MIN8, maximize=True), cls(twin, **kw, min_8bit_size=MIN8)
    run_adapter(opt, params, grads)
    run_adapter(ref, twin, [[-g for g in gs] for gs in grads])
    assert_same(opt, params, [p.detach() for p in twin], [ref.state[p]["state"] for p in twin])


def test_params_without_grad_are_skipped_and_steps_split():
    params = make_params()
    params0 = [p.detach().clone() for p in params]
    grads = make_grads(params, 2)
    opt = bnbf_nn.Adam8bit(params, lr=1e-2, min_8bit_size=MIN8)
    params[1].grad = None
    for p, g in zip([params[0], params[2]], [grads[0][0], grads[0][2]]):
        p.grad = g.clone()
    opt.step()
    assert "state" not in opt.state.get(params[1], {})
    run_adapter(opt, params, grads[1:])  # params[1] now at step 1, the others at step 2: two calls
    assert [opt.state[p]["step"] for p in params] == [2, 1, 2]
    ref = run_core(opt, [params0[0], params0[2]], [[grads[0][0], grads[0][2]], [grads[1][0], grads[1][2]]], 8)
    assert_same(opt, [params[0], params[2]], *ref)
    ref1 = run_core(opt, [params0[1]], [[grads[1][1]]], 8)
    assert_same(opt, [params[1]], *ref1)


def test_frozen_param_every_step():
    """A param that never gets a grad (a frozen layer): the others step as the core does, every step, on
    the subsets cached for that grad pattern; unfreezing it later starts its state at step 1."""
    params = make_params()
    params0 = [p.detach().clone() for p in params]
    grads = make_grads(params, 5)
    opt = bnbf_nn.Adam8bit(params, lr=1e-2, min_8bit_size=MIN8)
    live = [params[0], params[2]]
    for gs in grads[:4]:
        params[1].grad = None
        for p, g in zip(live, [gs[0], gs[2]]):
            p.grad = g.clone()
        opt.step()
    assert "state" not in opt.state.get(params[1], {}) and torch.equal(params[1].detach(), params0[1])
    ref = run_core(opt, [params0[0], params0[2]], [[gs[0], gs[2]] for gs in grads[:4]], 8)
    assert_same(opt, live, *ref)
    run_adapter(opt, params, grads[4:])
    assert [opt.state[p]["step"] for p in params] == [5, 1, 5]


def test_lr_scheduler_changes_lr_each_step():
    params = make_params()
    params0 = [p.detach().clone() for p in params]
    grads = make_grads(params, 3)
    opt = bnbf_nn.AdamW8bit(params, lr=1e-2, min_8bit_size=MIN8)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5**epoch)
    for gs in grads:
        run_adapter(opt, params, [gs])
        sched.step()
    ps = [p.clone() for p in params0]
    states = bnbf.init_state(ps, bnbf.OptimSpec(rule="adamw", min_8bit_size=MIN8), {})
    for t, gs in enumerate(grads, start=1):
        bnbf.update_(ps, gs, states, {"lr": 1e-2 * 0.5 ** (t - 1)}, t)
    assert_same(opt, params, ps, states)


def test_grad_scaler_skips_non_finite_steps():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = bnbf_nn.AdamW8bit(model.parameters(), lr=1e-2, min_8bit_size=MIN8)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    x = torch.randn(8, 16)

    def backward():
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().square().mean()
        scaler.scale(loss).backward()

    backward()
    model[0].weight.grad[0, 0] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**7  # the overflow halved the scale
    for p, b in zip(model.parameters(), before):
        assert_equal_report(p.detach(), b, "param after a skipped step")
    assert not opt.state or all(r.get("step", 0) == 0 for r in opt.state.values())
    backward()
    params0 = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)  # unscales the grads in place, then steps
    grads = [[p.grad.clone() for p in model.parameters()]]
    ref = run_core(opt, params0, grads, 8)
    assert_same(opt, list(model.parameters()), *ref)


def test_closure_hooks_and_zero_grad():
    params = make_params()
    opt = bnbf_nn.SGD8bit(params, lr=0.1, momentum=0.9, min_8bit_size=MIN8)
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append("post"))

    def closure():
        opt.zero_grad()
        loss = sum(p.square().sum() for p in params)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and calls == ["pre", "post"]
    assert all(opt.state[p]["step"] == 1 for p in params)
    opt.zero_grad()
    assert all(p.grad is None for p in params)


def test_step_wrapper_as_torchs():
    """The step takes torch's wrapper only where it does something, and then does all it does: global step hooks,
    a pre-hook's new arguments, and the profiler's "Optimizer.step#<class>.step" range; without them the step
    runs unwrapped (the range alone costs ~12 us of host time per step)."""
    import torch.optim.optimizer as torch_optimizer

    params = make_params()
    for p in params:
        p.grad = torch.ones_like(p)
    opt = bnbf_nn.AdamW8bit(params, lr=0.1, min_8bit_size=MIN8)
    calls = []
    pre = torch_optimizer.register_optimizer_step_pre_hook(lambda o, a, k: calls.append(("pre", type(o).__name__)))
    post = torch_optimizer.register_optimizer_step_post_hook(lambda o, a, k: calls.append(("post", len(a))))
    try:
        opt.step()
    finally:
        pre.remove()
        post.remove()
    assert calls == [("pre", "AdamW8bit"), ("post", 1)]
    # a pre-hook may replace the arguments: here it adds a closure, whose loss the step returns
    h = opt.register_step_pre_hook(lambda o, a, k: (a, {"closure": lambda: torch.tensor(3.0)}))
    assert float(opt.step()) == 3.0
    h.remove()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
    assert "Optimizer.step#AdamW8bit.step" in {e.name for e in prof.events()}
    assert all(opt.state[p]["step"] == 3 for p in params)
    assert getattr(type(opt).step, "hooked", False), "torch would wrap the step in its profiler range every call"


# a subclass whose step calls super().step(), stepped with a step pre-hook and a post-hook: the hooks' calls, in a
# process that made no optimizer of the base class, and in one that made one first
_SUBCLASS_STEP = """
import json, sys, torch, bnbf_nn


def calls(base, make_base=False):
    class Sub(base):
        def step(self, closure=None):
            return super().step(closure)

    if make_base:
        base([torch.nn.Parameter(torch.ones(1))])
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    opt, seen = Sub([p]), []
    opt.register_step_pre_hook(lambda *a: seen.append("pre"))
    opt.register_step_post_hook(lambda *a: seen.append("post"))
    opt.step()
    return seen


base = torch.optim.AdamW if sys.argv[1] == "torch" else bnbf_nn.AdamW8bit
print(json.dumps([calls(base), calls(base, make_base=True)]))
"""


def _subclass_step_calls(which: str, script: str = _SUBCLASS_STEP) -> list:
    run = subprocess.run(
        [sys.executable, "-c", script, which],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parent.parent,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_a_subclass_overriding_step_runs_torchs_step_hooks_once():
    """A subclass whose step calls super().step() ran torch's step hooks twice: torch wraps the subclass's step, and
    the base class's step ran them again within it. A subclass of torch.optim.AdamW runs them once, in a process that
    made no AdamW (making one wraps AdamW's own step too, and then torch runs them twice: torch's class patching, not
    a contract); ours runs them once either way."""
    once = ["pre", "post"]
    assert _subclass_step_calls("torch") == [once, ["pre", "pre", "post", "post"]]
    assert _subclass_step_calls("bnbf_nn") == [once, once]


# a subclass whose step is assigned after the class is made, before or after an instance of it is made, calling the
# base class's step through super() or by name: the hooks' and the step's calls for that instance and for one made
# after the assignment, in a process that made no optimizer of the base class, then in one that made one first
_LATE_STEP = """
import json, sys, torch, bnbf_nn


def calls(base, when, how, make_base=False):
    class Sub(base):
        pass

    def step(self, closure=None):
        seen.append("step")
        return super(Sub, self).step(closure) if how == "super" else base.step(self, closure)

    def stepped(opt):
        seen.clear()
        opt.register_step_pre_hook(lambda *a: seen.append("pre"))
        opt.register_step_post_hook(lambda *a: seen.append("post"))
        opt.param_groups[0]["params"][0].grad = torch.ones(3)
        opt.step()
        return list(seen)

    if make_base:
        base([torch.nn.Parameter(torch.ones(1))])
    seen = []
    if when == "before":
        Sub.step = step
    made = Sub([torch.nn.Parameter(torch.ones(3))])
    if when == "after":
        Sub.step = step
    return [stepped(made), stepped(Sub([torch.nn.Parameter(torch.ones(3))]))]


cases = [(w, h) for w in ("before", "after") for h in ("super", "base")]
bases = {"torch": torch.optim.AdamW, "bnbf_nn": bnbf_nn.AdamW8bit}  # neither's instances patch the other's class
print(json.dumps({
    name: [calls(base, w, h) for w, h in cases] + [calls(base, w, h, make_base=True) for w, h in cases]
    for name, base in bases.items()
}))
"""


def test_a_step_assigned_to_a_subclass_later_runs_torchs_step_hooks_once():
    """``Sub.step = f`` after ``class Sub(AdamW8bit): pass``, f calling the base class's step: torch wraps f where it
    makes an instance, and the base class's step ran the hooks again within it (a step defined in the class body ran
    them once). Now once, around f, for every instance made after the assignment; an instance made before it, whose
    class's step torch had found marked, runs them around the base class's step f calls. torch.optim.AdamW's
    subclass, for comparison: once around f in a process that made no AdamW, twice where one was made, and for the
    instance made before the assignment none at all (its class's wrapper replaced), or once where an AdamW was made."""
    whole, inner, twice = ["pre", "step", "post"], ["step", "pre", "post"], ["pre", "step", "pre", "post", "post"]
    seen = _subclass_step_calls("both", _LATE_STEP)
    made_none, made_one = 2 * [[whole, whole]] + 2 * [[["step"], whole]], 2 * [[twice, twice]] + 2 * [[inner, twice]]
    assert seen["torch"] == made_none + made_one
    assert seen["bnbf_nn"] == 2 * (2 * [[whole, whole]] + 2 * [[inner, whole]])


def test_a_step_from_a_mixin_or_a_parent_assigned_later_runs_the_hooks_once():
    """A step that torch wraps where it makes an instance, which the class body of the instance's class never
    defined: a mixin's (a class outside bnbf_nn, left as it is), or one assigned to a parent class after it was
    made. Each ran torch's step hooks twice; once now, around that step."""
    order = []

    class Mixin:
        def step(self, closure=None):
            order.append("step")
            return super().step(closure)

    class Mixed(Mixin, bnbf_nn.AdamW8bit):
        pass

    class Parent(bnbf_nn.AdamW8bit):
        pass

    def step(self, closure=None):
        order.append("step")
        return super(Parent, self).step(closure)

    Parent.step = step

    class Child(Parent):
        pass

    mixin_step = Mixin.__dict__["step"]
    for cls in (Mixed, Child):
        params = make_params()
        opt = cls(params, min_8bit_size=MIN8)
        opt.register_step_pre_hook(lambda *a: order.append("pre"))
        opt.register_step_post_hook(lambda *a: order.append("post"))
        order.clear()
        run_adapter(opt, params, make_grads(params, 1))
        assert order == ["pre", "step", "post"], cls.__name__
        assert all(opt.state[p]["step"] == 1 for p in params) and not opt._in_step
    assert Mixin.__dict__["step"] is mixin_step


def test_a_subclass_of_a_subclass_overriding_step_runs_the_hooks_once_around_the_outermost():
    """Hooks around the outermost overridden step only: a subclass of a subclass, each overriding step; a pre-hook's
    new arguments reach the outer step, which returns the closure's loss."""
    order = []

    class Inner(bnbf_nn.AdamW8bit):
        def step(self, closure=None):
            order.append("inner")
            return super().step(closure)

    class Outer(Inner):
        def step(self, closure=None):
            order.append("outer")
            return super().step(closure)

    params = make_params()
    for p in params:
        p.grad = torch.ones_like(p)
    opt = Outer(params, min_8bit_size=MIN8)
    opt.step()
    opt.register_step_pre_hook(lambda o, a, k: (order.append("pre"), (a, {"closure": lambda: torch.tensor(3.0)}))[1])
    opt.register_step_post_hook(lambda o, a, k: order.append("post"))
    assert float(opt.step()) == 3.0
    assert order == ["outer", "inner", "pre", "outer", "inner", "post"]
    assert all(opt.state[p]["step"] == 2 for p in params) and not opt._in_step


@pytest.mark.parametrize("bits", [8, 32])
def test_skip_zeros_leaves_zero_grad_elements(bits):
    params = make_params()
    params0 = [p.detach().clone() for p in params]
    grads = make_grads(params, 2)
    for gs in grads:
        for g in gs:
            g.view(-1)[::3] = 0.0
    cls = bnbf_nn.Adam8bit if bits == 8 else bnbf_nn.Adam32bit
    opt = cls(params, lr=1e-2, weight_decay=0.1, skip_zeros=True, min_8bit_size=MIN8)
    run_adapter(opt, params, grads)
    for p, p0 in zip(params, params0):
        assert_equal_report(p.detach().view(-1)[::3], p0.view(-1)[::3], "param elements whose grad was 0")
    ref = run_core(opt, params0, grads, bits, hp=dict(lr=1e-2, weight_decay=0.1), skip_zeros=True)
    assert_same(opt, params, *ref)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_are_independent_and_step_alike(how):
    params = make_params()
    grads = make_grads(params, 2)
    opt = bnbf_nn.AdEMAMix8bit(params, lr=1e-2, min_8bit_size=MIN8)
    run_adapter(opt, params, grads[:1])
    twin = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    twin_params = twin.param_groups[0]["params"]
    assert all(a is not b for a, b in zip(twin_params, params))
    run_adapter(opt, params, grads[1:])
    run_adapter(twin, twin_params, grads[1:])
    assert_same(twin, twin_params, [p.detach() for p in params], [opt.state[p]["state"] for p in params])


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_keep_bitsandbytes_views_live_and_compact(how):
    """A copied optimizer's bitsandbytes names are views of its own state again (AdEMAMix's stack included),
    and a pickle holds each state tensor once, not the whole stack per field."""
    params = make_params(shapes=[(64, 65)])
    opt = bnbf_nn.AdEMAMix8bit(params, min_8bit_size=MIN8)
    run_adapter(opt, params, make_grads(params, 1))
    blob = pickle.dumps(opt)
    held = bnbf.state_nbytes(opt.state[params[0]]["state"]) + params[0].numel() * 4  # and the param itself
    assert len(blob) < held * 1.2, f"pickle of {len(blob)} bytes for {held} bytes of state and param"
    twin = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(blob)
    p = twin.param_groups[0]["params"][0]
    rec, s = twin.state[p], twin.state[p]["state"]
    assert rec["state1"][1].data_ptr() == s.exp_avg_slow.data_ptr() and rec["absmax1"][0].data_ptr() == (
        s.exp_avg_absmax.data_ptr()
    )
    for k, v in opt.state[params[0]].items():
        if isinstance(v, torch.Tensor):
            assert_equal_report(rec[k], v, f"{how}: {k}")


def test_is_paged_read_by_truth_value_as_bitsandbytes_reads_it():
    """bitsandbytes tests ``is_paged`` for truth: an int or a numpy bool works there, and here (it was refused)."""
    np = pytest.importorskip("numpy")
    for v, want in ((1, True), (0, False), (np.bool_(True), True), (np.int64(0), False)):
        opt = bnbf_nn.AdamW8bit(make_params(), is_paged=v)
        assert opt.is_paged is want, v
        if want:
            bnbf_nn.Adam8bit(make_params(), block_wise=v)
        else:  # read as False: refused for 8-bit state
            with pytest.raises(ValueError, match="block_wise=False"):
                bnbf_nn.Adam8bit(make_params(), block_wise=v)


def test_bitsandbytes_args_object_wins():
    """bitsandbytes' config object: each attribute it has wins over the argument (as in bitsandbytes, whose
    get_config reads ``args``), those it lacks leave the arguments alone. Not ``is_paged``: bitsandbytes pages by
    the argument alone (``args.is_paged`` paged against the argument, and the reverse)."""
    args = SimpleNamespace(optim_bits=32, min_8bit_size=100, max_unorm=0.0, skip_zeros=False)
    opt = bnbf_nn.Adam(make_params(), optim_bits=8, args=args)
    assert (opt.param_groups[0]["optim_bits"], opt.param_groups[0]["min_8bit_size"]) == (32, 100)
    full = SimpleNamespace(
        optim_bits=8,
        min_8bit_size=64,
        percentile_clipping=100,
        block_wise=True,
        max_unorm=0.5,
        skip_zeros=True,
        is_paged=True,
    )
    opt = bnbf_nn.Lion(make_params(), args=full)
    g = opt.param_groups[0]
    assert (g["optim_bits"], g["min_8bit_size"], g["max_unorm"], g["skip_zeros"], opt.is_paged) == (
        8,
        64,
        0.5,
        True,
        False,
    )
    assert bnbf_nn.AdamW8bit(make_params(), is_paged=True, args=SimpleNamespace(is_paged=False)).is_paged is True
    assert bnbf_nn.PagedLion(make_params(), args=SimpleNamespace()).is_paged is True  # Paged* always pages
    assert bnbf_nn.PagedLion(make_params(), args=SimpleNamespace(is_paged=False)).is_paged
    partial = bnbf_nn.SGD(make_params(), 0.1, args=SimpleNamespace(min_8bit_size=7), optim_bits=8)
    assert (partial.param_groups[0]["optim_bits"], partial.param_groups[0]["min_8bit_size"]) == (8, 7)


@pytest.mark.parametrize("cls", ["AdamW8bit", "LAMB8bit", "AdEMAMix8bit", "Optimizer2State"])
def test_betas_as_bitsandbytes_string(cls):
    """bitsandbytes' two-state classes take betas as the string '(b1, b2)' (config files pass them so); a
    string that is not numbers is refused in words that say it was a string."""
    make = (lambda **kw: bnbf_nn.Optimizer2State("adam", make_params(), **kw)) if cls[0] == "O" else None
    make = make or (lambda **kw: getattr(bnbf_nn, cls)(make_params(), **kw))
    betas = "(0.8, 0.99, 0.999)" if cls.startswith("AdEMAMix") else "(0.8, 0.99)"
    assert make(betas=betas).param_groups[0]["betas"] == tuple(float(b) for b in betas[1:-1].split(","))
    with pytest.raises(ValueError, match="betas '0.9 0.99' is not a tuple of numbers"):
        make(betas="0.9 0.99")


@pytest.mark.parametrize(
    "cls, kw, spelled",
    [
        ("SGD8bit", dict(lr=0.1, momentum=0.9), (0.95, 0.0)),
        ("RMSprop8bit", dict(lr=0.01), (0.5, 0.0)),
        ("LARS8bit", dict(lr=0.1, momentum=0.9), (0.8, 0.0)),
    ],
)
def test_a_group_in_bitsandbytes_spelling_is_read_or_refused(cls, kw, spelled):
    """bitsandbytes' groups spell SGD's and LARS's momentum and dampening as ``betas`` (RMSprop's alpha and momentum
    too), and a schedule written for bitsandbytes sets ``group["betas"]``. Where it agrees with the group's own
    settings the step runs; where only one spelling changed since they last agreed, the other follows (stepping
    as a twin whose own settings were set so); where both changed, or they never agreed, and they differ, one would
    be ignored: refused in words, nothing written."""
    params, twin = make_params(), make_params()
    opt = getattr(bnbf_nn, cls)(params, **kw, min_8bit_size=MIN8)
    ref = getattr(bnbf_nn, cls)(twin, **kw, min_8bit_size=MIN8)
    both = lambda seed: (
        run_adapter(opt, params, make_grads(params, 1, seed)),
        run_adapter(ref, twin, make_grads(twin, 1, seed)),
    )  # noqa: E731
    both(1)
    group = opt.param_groups[0]
    names = {"RMSprop8bit": ("alpha", "momentum")}.get(cls, ("momentum", "dampening"))
    group["betas"] = (0.3, 0.0)  # never agreed with the group's settings
    with pytest.raises(ValueError, match=rf"bitsandbytes' betas=\(0.3, 0.0\).*set those \({names[0]}"):
        run_adapter(opt, params, make_grads(params, 1, seed=2))
    group["betas"] = tuple(group[n] for n in names)
    both(2)
    group["betas"] = spelled  # a bitsandbytes schedule's move: the settings follow
    ref.param_groups[0].update(zip(names, spelled))
    both(3)
    assert tuple(group[n] for n in names) == spelled
    for p, q in zip(params, twin):
        assert_equal_report(p.detach(), q.detach(), f"{cls}: betas moved")
    group[names[0]] = 0.7  # torch's name moved: the spelling follows
    ref.param_groups[0][names[0]] = 0.7
    both(4)
    assert group["betas"] == (0.7, spelled[1])
    for p, q in zip(params, twin):
        assert_equal_report(p.detach(), q.detach(), f"{cls}: {names[0]} moved")
    group["betas"], group[names[0]] = (0.6, spelled[1]), 0.65  # both moved, differently
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match=rf"bitsandbytes' betas=\(0.6, {spelled[1]}\).*set those \({names[0]}"):
        run_adapter(opt, params, make_grads(params, 1, seed=5))
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    assert all(opt.state[p]["step"] == 4 for p in params)


@pytest.mark.parametrize(
    "cls, spelled, names",
    [
        ("SGD8bit", (0.5, 0.1), ("momentum", "dampening")),
        ("LARS8bit", (0.5, 0.1), ("momentum", "dampening")),
        ("RMSprop8bit", (0.95, 0.5), ("alpha", "momentum")),
    ],
)
def test_a_group_given_in_bitsandbytes_spelling_only_takes_its_settings(cls, spelled, names):
    """A param group given as bitsandbytes' code gives it, with ``betas`` (SGD's momentum and dampening...) and not
    the settings it spells: torch filled those from the optimizer's defaults, which the group's betas then never
    agreed with, so the step refused it. The group takes the settings its betas spell, as a loaded bitsandbytes
    group does, and steps as a twin given them by name; a schedule moving torch's name before the first step is
    followed (the spelling as given counts as agreed)."""
    params, twin = make_params(), make_params()
    given = {"params": params, "lr": 0.01, "betas": spelled, "weight_decay": 0.0}
    opt = getattr(bnbf_nn, cls)([given], lr=0.1, min_8bit_size=MIN8)
    ref = getattr(bnbf_nn, cls)(twin, lr=0.01, min_8bit_size=MIN8, **dict(zip(names, spelled)))
    assert tuple(opt.param_groups[0][n] for n in names) == spelled
    grads = make_grads(params, 2)
    run_adapter(opt, params, grads[:1])
    run_adapter(ref, twin, grads[:1])
    late, late_twin = make_params(seed=1), make_params(seed=1)
    opt.add_param_group({"params": late, "lr": 0.01, "betas": (0.6, 0.0)})
    ref.add_param_group({"params": late_twin, names[0]: 0.6, names[1]: 0.0})
    assert opt.param_groups[1][names[0]] == 0.6
    for g, r in zip(opt.param_groups, ref.param_groups):
        g[names[0]] = r[names[0]] = 0.7  # a schedule's move before the new group's first step
    run_adapter(opt, params + late, [grads[1] + make_grads(late, 1)[0]])
    run_adapter(ref, twin + late_twin, [grads[1] + make_grads(late, 1)[0]])
    assert [g["betas"] for g in opt.param_groups] == [(0.7, spelled[1]), (0.7, 0.0)]
    for p, q in zip(params + late, twin + late_twin):
        assert_equal_report(p.detach(), q.detach(), f"{cls}: a group in bitsandbytes' spelling")


def test_a_bitsandbytes_run_with_a_momentum_schedule_resumes():
    """bitsandbytes' SGD, LARS and RMSprop groups hold ``betas``, so torch's OneCycleLR made for them cycles
    ``betas[0]`` (its saved state says ``use_beta1``). Resumed here from bitsandbytes' layout (what
    ``for_bitsandbytes`` writes, without bnbf_nn's marks), the groups keep ``betas`` and the schedule's
    momentum reaches the step: the same params as a run that sets SGD's momentum by hand each step."""
    params, twin = make_params(), make_params()
    opt = bnbf_nn.SGD8bit(params, 0.1, 0.9, min_8bit_size=MIN8)
    ref = bnbf_nn.SGD8bit(twin, 0.1, 0.9, min_8bit_size=MIN8)
    grads = make_grads(params, 6)
    run_adapter(opt, params, grads[:1])
    run_adapter(ref, twin, grads[:1])
    saved = bnbf_nn.for_bitsandbytes(opt.state_dict())
    for g in saved["param_groups"]:
        del g["bnbf"]  # as bitsandbytes saves it
    resumed = bnbf_nn.SGD8bit(params, 0.1, 0.9, min_8bit_size=MIN8)
    sched = torch.optim.lr_scheduler.OneCycleLR(resumed, max_lr=0.1, total_steps=10)  # made, then both loaded
    schedule = {**sched.state_dict(), "use_beta1": True}  # as saved with bitsandbytes' SGD
    resumed.load_state_dict(saved)
    sched.load_state_dict(schedule)
    assert resumed.param_groups[0]["betas"] == (0.9, 0.0)
    for gs in grads[1:]:
        ref.param_groups[0].update(lr=resumed.param_groups[0]["lr"], momentum=resumed.param_groups[0]["betas"][0])
        run_adapter(resumed, params, [gs])
        run_adapter(ref, twin, [gs])
        sched.step()
    for p, q in zip(params, twin):
        assert_equal_report(p.detach(), q.detach(), "resumed under a betas[0] schedule")
    run_adapter(resumed, params, grads[:1])  # the last schedule step's betas reach the group's momentum
    assert resumed.param_groups[0]["momentum"] == resumed.param_groups[0]["betas"][0] != 0.9
    again = bnbf_nn.SGD8bit(make_params(), 0.1, 0.9, min_8bit_size=MIN8)
    again.load_state_dict(resumed.state_dict())  # bnbf_nn's own checkpoint keeps the spelling the group held
    assert again.param_groups[0]["betas"] == resumed.param_groups[0]["betas"]
    copied = (
        resumed.state_dict()
    )  # ZeroRedundancyOptimizer's: copies of the live groups, whose bnbf entry lists no spelling
    for g, live in zip(copied["param_groups"], resumed.param_groups):
        g["bnbf"] = dict(live["bnbf"])
    zero = bnbf_nn.SGD8bit(make_params(), 0.1, 0.9, min_8bit_size=MIN8)
    zero.load_state_dict(copied)
    assert zero.param_groups[0]["betas"] == resumed.param_groups[0]["betas"]
    assert "betas" not in ref.param_groups[0] and "betas" not in _loaded(ref).param_groups[0]
    older = ref.state_dict()  # saved before bnbf entries listed the spellings: the group held none
    for g in older["param_groups"]:
        del g["bnbf"]["spelled"]
    assert "betas" not in _loaded(ref, older).param_groups[0]


def _loaded(opt, saved=None):
    new = type(opt)(
        [p.detach().clone().requires_grad_() for g in opt.param_groups for p in g["params"]], lr=0.1, min_8bit_size=MIN8
    )
    new.load_state_dict(opt.state_dict() if saved is None else saved)
    return new


class _Int(int):  # an integral scalar that is not an int (numpy's int64 behaves so; numpy is no test dependency)
    pass


@pytest.mark.parametrize(
    "given, same",
    [
        (dict(t_alpha=50.0, t_beta3=_Int(60)), dict(t_alpha=50, t_beta3=60)),
        (dict(t_alpha=fractions.Fraction(50), min_8bit_size=100.0), dict(t_alpha=50, min_8bit_size=100)),
        (dict(optim_bits=_Int(32), min_8bit_size=_Int(100)), dict(optim_bits=32, min_8bit_size=100)),
    ],
)
def test_numbers_are_read_as_bitsandbytes_compares_them(given, same):
    """bitsandbytes only compares or divides by ``t_alpha``, ``t_beta3``, ``optim_bits`` and ``min_8bit_size``, so a
    config's 2.5e5 or numpy int64 works there: here too, stepping as the Python ints do."""
    params = make_params()
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    base = dict(optim_bits=8, min_8bit_size=MIN8)
    opt, ref = bnbf_nn.AdEMAMix(params, **{**base, **given}), bnbf_nn.AdEMAMix(twin, **{**base, **same})
    grads = make_grads(params, 3)
    run_adapter(opt, params, grads)
    run_adapter(ref, twin, grads)
    assert [opt.state[p]["state1"].dtype for p in params] == [ref.state[p]["state1"].dtype for p in twin]
    for p, q in zip(params, twin):
        assert torch.equal(p.detach(), q.detach())
    for bad, match in [(dict(t_alpha=0.5), "Invalid t_alpha value: 0.5"), (dict(optim_bits=8.5), "optim_bits")]:
        with pytest.raises((ValueError, TypeError), match=match):
            bnbf_nn.AdEMAMix(make_params(), **bad)


@pytest.mark.parametrize("key", ["t_alpha", "t_beta3"])
def test_ademamix_warmup_of_zero_means_none(key):
    """bitsandbytes' AdEMAMix takes 0 for no warm-up (it tests the value's truth), as None."""
    params = make_params()
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = bnbf_nn.AdEMAMix8bit(params, **{key: 0})
    ref = bnbf_nn.AdEMAMix8bit(twin)
    assert opt.param_groups[0][key] is None
    grads = make_grads(params, 2)
    run_adapter(opt, params, grads)
    run_adapter(ref, twin, grads)
    for p, q in zip(params, twin):
        assert torch.equal(p.detach(), q.detach())


def test_bnb_base_classes_take_every_documented_argument():
    """Optimizer2State's positional arguments through t_beta3, Optimizer1State's through is_paged, and the
    keyword-only block_wise: each lands where bitsandbytes documents it."""
    params = make_params()
    a = bnbf_nn.Optimizer2State(
        "ademamix", params, 1e-2, (0.8, 0.9, 0.99), 1e-6, 0.1, 8, None, MIN8, 0.0, True, True, 4.0, 10, 20
    )
    g = a.param_groups[0]
    assert (g["betas"], g["eps"], g["weight_decay"], g["optim_bits"], g["min_8bit_size"]) == (
        (0.8, 0.9, 0.99),
        1e-6,
        0.1,
        8,
        MIN8,
    )
    assert (g["skip_zeros"], a.is_paged, g["alpha"], g["t_alpha"], g["t_beta3"]) == (True, True, 4.0, 10, 20)
    b = bnbf_nn.Optimizer1State("lion", make_params(), 1e-3, (0.9, 0.99), 0.0, 0.0, 8, None, MIN8, 0.3, False, True)
    g = b.param_groups[0]
    assert (g["betas"], g["max_unorm"], b.is_paged) == ((0.9, 0.99), 0.3, True)
    with pytest.raises(ValueError, match="block_wise=False"):
        bnbf_nn.Optimizer1State("lion", make_params(), optim_bits=8, block_wise=False)
    bnbf_nn.Optimizer1State("lion", make_params(), optim_bits=32, block_wise=False)  # ignored for 32-bit state


def test_max_unorm_clips_like_the_core():
    params = make_params()
    params0 = [p.detach().clone() for p in params]
    grads = make_grads(params, 2)
    opt = bnbf_nn.AdamW8bit(params, lr=0.5, max_unorm=0.01, min_8bit_size=MIN8)
    run_adapter(opt, params, grads)
    assert_same(opt, params, *run_core(opt, params0, grads, 8, hp=dict(lr=0.5), max_unorm=0.01))
    unclipped = run_core(opt, params0, grads, 8, hp=dict(lr=0.5), max_unorm=0.0)[0]
    assert not torch.equal(unclipped[0], params[0].detach())  # the clipping did something


def test_repr_is_torchs_without_the_groups_marks_of_origin():
    """``repr(optimizer)`` lists each group's settings as torch.optim's does; the groups' ``bnbf`` entry (which
    optimizer and rule saved them, for load_state_dict) is no setting and is left out."""
    params = make_params()
    opt = bnbf_nn.AdamW8bit([{"params": params[:1]}, {"params": params[1:], "lr": 0.5}], min_8bit_size=MIN8)
    assert all("bnbf" in g for g in opt.param_groups)
    plain = torch.optim.SGD(params, lr=0.1)
    plain.param_groups = [{k: v for k, v in g.items() if k != "bnbf"} for g in opt.param_groups]
    assert repr(opt) == repr(plain).replace("SGD", "AdamW8bit", 1) and "bnbf" not in repr(opt)


@pytest.mark.parametrize("key", ["maximize", "amsgrad", "capturable", "differentiable"])
def test_a_numpy_bool_switch_is_refused_naming_numpy(key):
    """The README's documented difference: torch.optim takes a numpy bool for its switches, bnbf_nn refuses it
    with a TypeError that names numpy.bool (it read "must be a bool, got bool")."""
    np = pytest.importorskip("numpy")
    with pytest.raises(TypeError, match=rf"{key} must be a bool, got numpy\.bool"):
        bnbf_nn.AdamW8bit([torch.nn.Parameter(torch.randn(8))], **{key: np.True_})

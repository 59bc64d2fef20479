"""One launch for a plan's two groups (``bnbf.kernels.launcher.pair_of``, ``launch_pair``): a model's 8-bit states
and the 32-bit states of its small tensors (bitsandbytes' ``min_8bit_size``) stepped by one kernel launch instead of
two. The paired step must write exactly the bits of the groups' own launches (the pure ``update``, which launches
each group alone), for every rule, both 8-bit formats, 16-bit params and ``skip_zeros``; what it cannot run (norm
passes, clipping, tensor hyperparameters) takes the groups' own launches.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from conftest import DEVICES, kernel_runs
from optim_table import ROWS

import bnbf
from bnbf.kernels import launcher
from bnbf.quant import dequantize_state_reference

P = importlib.import_module("bnbf.plan")  # the module (``bnbf.plan`` is the function that makes a plan)
RICHEST = [
    max((r for r in ROWS if r.name == n), key=lambda r: len(r.state_names)) for n in dict.fromkeys(r.name for r in ROWS)
]
# 8-bit: the first three (odd sizes, a partial last block); 32-bit: the rest (under min_8bit_size)
SHAPES = {"w": (24, 40), "odd": (257,), "big": (4097,), "b": (255,), "ln": (33,), "one": (1,)}
MIN_8BIT = 256
# the rules the interpreter pass steps paired: one state, four, a sign step, a norm pass (not paired)
INTERPRETED = {"adamw", "adan", "lion", "lamb"}


def _kernel_devices():
    return [d for d in DEVICES if kernel_runs(d)]


@pytest.fixture
def counted(monkeypatch):
    """Every pair launch a plan makes, counted; the pair rule's share opened so that test-sized groups pair."""
    calls = []
    real = P.launch_pair
    monkeypatch.setattr(launcher, "PAIR_SHARE", 1.0)
    monkeypatch.setattr(P, "launch_pair", lambda *a, **k: (calls.append(a[0]), real(*a, **k)))
    return calls


def _problem(row, dtype, device, fmt="power"):
    gen = torch.Generator().manual_seed(1)
    dt = {k: dtype if isinstance(dtype, torch.dtype) else dtype[k] for k in SHAPES}  # one, or one per tensor
    params = {k: (torch.randn(s, generator=gen) * 0.5).to(dt[k]).to(device) for k, s in SHAPES.items()}
    grads = [
        {k: (torch.randn(s, generator=gen) * 0.1).to(dt[k]).to(device) for k, s in SHAPES.items()} for _ in range(2)
    ]
    grads[1]["w"][:3] = 0.0  # exact zeros (skip_zeros) and a spike
    grads[1]["big"][7] = 40.0
    spec = bnbf.OptimSpec(rule=row.name, min_8bit_size=MIN_8BIT, state_format=fmt)
    return params, grads, spec


def _run_both(row, dtype, device, fmt="power", **kw):
    """The same two steps by the pure update (each group its own launch) and by update_ (a plan), compared after
    each step and re-synced (the in-place tensors take the pure step's values)."""
    params, grads, spec = _problem(row, dtype, device, fmt)
    hp = dict(row.hparams)
    pure_p = {k: v.clone() for k, v in params.items()}
    pure_s = bnbf.init_state(pure_p, spec, hp)
    state = bnbf.init_state(params, spec, hp)
    for i, g in enumerate(grads):
        pure_p, pure_s = bnbf.update(pure_p, g, pure_s, hp, i + 1, **kw)
        bnbf.update_(params, g, state, hp, i + 1, **kw)
        for k in SHAPES:
            _assert_same_step(row, hp, params[k], pure_p[k], k)
            _assert_same_state(row, state[k], pure_s[k], k)
            for a, b in zip(state[k], pure_s[k]):
                a.copy_(b)
            params[k].copy_(pure_p[k])
    return params, state


def _assert_same_step(row, hp, p, ref, name):
    """Bit-equal params; for a sign step (Lion), where ptxas may contract β1·m + (1 − β1)·g into an FMA in one
    kernel and not in the other, two correct evaluations may take opposite signs where that input is zero up to
    rounding: such an element may differ by one or two lr, and only a few may."""
    if not row.sign_step:
        assert torch.equal(p, ref), name
        return
    diff = (p - ref).abs()
    off = diff > 0
    lr = hp["lr"]
    assert int(off.sum()) <= max(1, p.numel() // 500), name
    assert ((diff[off] > 0.9 * lr) & (diff[off] < 2.1 * lr)).all(), name


def _assert_same_state(row, state, ref, name):
    """Bit-equal state fields; for a sign step, whose momentum β2·m + (1 − β2)·g ptxas may also contract
    differently (seen on the H200: blocks whose absmax is a rounding apart, so that every decoded value of such
    a block differs by that rounding), the same state up to it: absmax to 1e-6, at most 2% of the codes another
    code, and every decoded value within 2% of its block's absmax (one code of the formats' coarsest step)."""
    if not row.sign_step:
        for a, b in zip(state, ref):
            assert torch.equal(a, b), name
        return
    layout = type(state).layout
    if not layout.quantized:
        for a, b in zip(state, ref):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=0, msg=name)
        return
    for j, slot in enumerate(layout.slots()):
        codes, absmax, ref_codes, ref_absmax = state[2 * j], state[2 * j + 1], ref[2 * j], ref[2 * j + 1]
        torch.testing.assert_close(absmax, ref_absmax, rtol=1e-6, atol=0, msg=name)
        assert int((codes != ref_codes).sum()) <= max(1, codes.numel() // 50), name
        args = (layout.format, slot.signed, layout.block_size)
        v = dequantize_state_reference(codes, absmax, *args).flatten()
        w = dequantize_state_reference(ref_codes, ref_absmax, *args).flatten()
        bound = ref_absmax.repeat_interleave(layout.block_size)[: v.numel()] * 0.02
        assert ((v - w).abs() <= bound).all(), name


@pytest.mark.parametrize("device", _kernel_devices())
@pytest.mark.parametrize("row", RICHEST, ids=str)
def test_one_launch_steps_both_groups_exactly(row, device, counted):
    if torch.device(device).type == "cpu" and row.name not in INTERPRETED:
        pytest.skip("the interpreter computes both kernels alike: four rules check the plumbing, CUDA runs every rule")
    _, state = _run_both(row, torch.float32, device)
    layouts = {type(s).layout.format for s in state.values()}
    assert layouts == {"power", "fp32"}
    paired = get_norms(row.name) is None
    assert len(counted) == (2 if paired else 0), "rules with a norm pass keep their groups' own launches"


@pytest.mark.parametrize("device", _kernel_devices())
@pytest.mark.parametrize(
    "dtype, fmt, skip_zeros",
    [
        (torch.bfloat16, "power", False),
        (torch.float16, "dynamic", True),
        (torch.bfloat16, "dynamic", False),
        (torch.float16, "power", True),
    ],
)
def test_one_launch_16_bit_params_formats_skip_zeros(dtype, fmt, skip_zeros, device, counted):
    if torch.device(device).type == "cpu" and (dtype, fmt) in ((torch.bfloat16, "dynamic"), (torch.float16, "power")):
        pytest.skip("the interpreter pass runs two of the four cases (each dtype and format once)")
    row = next(r for r in ROWS if r.name == "adamw")
    _run_both(row, dtype, device, fmt, skip_zeros=skip_zeros)
    assert len(counted) == 2


@pytest.mark.parametrize("device", _kernel_devices())
def test_one_launch_of_groups_with_different_param_dtypes(device, counted):
    """float32 params with 8-bit states, bfloat16 params with 32-bit states: each half reads its own dtype."""
    row = next(r for r in ROWS if r.name == "adamw")
    dtypes = {k: torch.float32 if k in ("w", "odd", "big") else torch.bfloat16 for k in SHAPES}
    _run_both(row, dtypes, device)
    assert len(counted) == 2 and counted[0].a.dtype == torch.float32 and counted[0].b.dtype == torch.bfloat16


@pytest.mark.parametrize("device", _kernel_devices())
def test_what_one_launch_cannot_run_takes_the_groups_launches(device, counted):
    """Update clipping (a norm pass) and 0-d tensor hyperparameters (a scalar row on the device) launch each
    group; a step of plain numbers after them pairs again."""
    row = next(r for r in ROWS if r.name == "adamw")
    _run_both(row, torch.float32, device, max_unorm=0.5)
    assert counted == []
    params, grads, spec = _problem(row, torch.float32, device)
    state = bnbf.init_state(params, spec)
    bnbf.update_(params, grads[0], state, {"lr": torch.tensor(1e-3, device=device)}, 1)
    assert counted == []
    bnbf.update_(params, grads[1], state, {"lr": 1e-3}, 2)
    assert len(counted) == 1


def get_norms(rule: str):
    return bnbf.RULES[rule].norms


@pytest.mark.parametrize("device", _kernel_devices())
def test_which_groups_pair(device, monkeypatch):
    """Two groups of one device and rule pair where the smaller holds at most PAIR_SHARE of the elements; not one
    group, not a rule with a norm pass, not a smaller group that is not small."""

    def plan_of(shapes, rule="adamw", min_8bit=MIN_8BIT):
        params = {k: torch.zeros(s, device=device) for k, s in shapes.items()}
        state = bnbf.init_state(params, bnbf.OptimSpec(rule=rule, min_8bit_size=min_8bit))
        return bnbf.plan(params, state)

    model = {"w": (128, 512), "b": (255,), "ln": (33,)}  # 65536 elements in 8 bits, 288 in 32 bits
    pair = plan_of(model)._pair
    assert pair is not None and pair.a.layout.quantized and not pair.b.layout.quantized
    assert plan_of(model, "lamb")._pair is None
    assert plan_of({"w": (128, 512)})._pair is None  # one group
    assert plan_of({"w": (16, 64), "b": (255,)})._pair is None  # 1024 + 256: the 32-bit group is not small
    monkeypatch.setattr(launcher, "PAIR_SHARE", 1.0)
    assert plan_of({"w": (16, 64), "b": (255,)})._pair is not None

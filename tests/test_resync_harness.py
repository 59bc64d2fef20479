"""tests/resync.py's tie rule for L2 weight decay (:func:`resync.l2_ties`), on data built to hit it: the
re-synced tests' random data meets a tie about once in 10^5 16-bit elements, so at bitsandbytes' 1024x4097
shape (CUDA only) every step.

At p = 0.244140625 and g = -0.00244140625 (fp16 values) with wd 0.01, float32(0.01)·p rounds to exactly -g:
g + wd·p evaluated unfused (bnbf's kernels and reference path) is 0, and a fused multiply-add (torch's CUDA
reference) keeps -5.5e-11, which RMSprop and Adagrad, dividing by that gradient's own root, turn into a step
of order lr. The reference here fuses on every device (:func:`fused`), whatever this CPU's torch does.
"""

from __future__ import annotations

import dataclasses

import pytest
import resync
import torch
from conftest import DEVICES, init_params, make_grad
from optim_table import ROW
from resync import Ref, l2_ties, resync_step

import bnbf

F16 = torch.float16
WD = 0.01
N = 257
P_TIE, G_TIE = 0.244140625, -0.00244140625
TIES = [3, 100, 200]  # elements where g + wd·p is 0 up to rounding
NEAR = 150  # g one fp16 ulp off the tie: the decayed gradient is 1.9e-6, an ordinary element
G_NEAR = G_TIE + 2.0**-19
# rows and state formats where the tie fails the re-synced checks without the rule (adagrad-plain in both
# formats and the RMSprop rows with momentum in the dynamic format failed so on CUDA at 1024x4097)
BROKEN = [
    ("adagrad-plain", "power"),
    ("adagrad-plain", "dynamic"),
    ("rmsprop-momentum", "power"),
    ("rmsprop-momentum", "dynamic"),
    ("rmsprop-both", "dynamic"),
]


def fused(row):
    """``row`` with a reference that adds its weight decay to the gradient as a fused multiply-add does (the
    exact product, one rounding), as torch's CUDA kernels do: CPU torch may fuse or not."""

    class Fused(row.torch_cls):
        @torch.no_grad()
        def step(self, closure=None):
            wds = [group["weight_decay"] for group in self.param_groups]
            for group, wd in zip(self.param_groups, wds, strict=True):
                wd32 = float(torch.tensor(wd, dtype=torch.float32))  # torch's float32 kernels take it so
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad = (p.grad.double() + wd32 * p.double()).float()
                group["weight_decay"] = 0.0
            try:
                return super().step(closure)
            finally:
                for group, wd in zip(self.param_groups, wds, strict=True):
                    group["weight_decay"] = wd

    return dataclasses.replace(row, torch_cls=Fused)


def tie_data(device):
    """fp16 params and grads of the suite's distributions, with ties at ``TIES`` and a near miss at ``NEAR``."""
    p, g = init_params((N,), F16, "cpu"), make_grad((N,), F16, "cpu")
    p[TIES + [NEAR]] = P_TIE
    g[TIES] = G_TIE
    g[NEAR] = G_NEAR
    return {"w": p.to(device)}, {"w": g.to(device)}


def run(device, rid: str, fmt: str, steps: int = 2) -> None:
    """``steps`` re-synced steps of row ``rid`` on the tie data (the same grads each step: the ties stay)."""
    row = fused(ROW[rid])
    hp = {**row.hparams, "weight_decay": WD}
    params, grads = tie_data(device)
    ref = Ref(row, params, hp)
    state = bnbf.init_state(params, bnbf.OptimSpec(rule=row.name, state_bits=8, min_8bit_size=0, state_format=fmt), hp)
    for step in range(1, steps + 1):
        params, state = resync_step(row, hp, ref, params, grads, state, step)


def test_the_data_has_exactly_the_ties():
    """The rule finds the built ties and nothing else (not the near miss); the fused reference really
    disagrees with an unfused evaluation there."""
    params, grads = tie_data("cpu")
    hp = {**ROW["adagrad-plain"].hparams, "weight_decay": WD}
    ties = l2_ties(ROW["adagrad-plain"], hp, params, grads)
    assert ties["w"].nonzero().reshape(-1).tolist() == TIES
    p, g = torch.tensor([P_TIE]), torch.tensor([G_TIE])
    assert float(g + float(torch.tensor(WD)) * p) == 0.0
    assert float((g.double() + float(torch.tensor(WD)) * p.double()).float()) < 0.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("rid", "fmt"), BROKEN)
def test_l2_ties_accept_either_outcome(device, rid, fmt):
    run(device, rid, fmt)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("rid", "fmt"), BROKEN)
def test_l2_tie_rule_is_needed(device, rid, fmt, monkeypatch):
    """Without the rule the same run fails at a tie (on the CPU paths, which evaluate g + wd*p unfused; the
    compiled CUDA kernel fuses it as torch's reference does there, and the two may then agree)."""
    if device == "cuda":
        pytest.skip("the compiled kernel's fused multiply-add may agree with the reference at these ties")
    monkeypatch.setattr(resync, "l2_ties", lambda *args: {})
    with pytest.raises(AssertionError, match=f"flat ({'|'.join(map(str, TIES))})"):
        run(device, rid, fmt, steps=1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("rid", "fmt"), BROKEN)
def test_l2_tie_rule_still_rejects_an_ordinary_element(device, rid, fmt, monkeypatch):
    """Our step given the exact tie at the near miss (so its decayed gradient is 0 there, the outcome the
    rule accepts at ties) is rejected at that element."""
    update = bnbf.update

    def wrong(params, grads, *args, **kwargs):
        g = grads["w"].clone()
        g[NEAR] = G_TIE
        return update(params, {"w": g}, *args, **kwargs)

    monkeypatch.setattr(bnbf, "update", wrong)
    with pytest.raises(AssertionError, match=f"flat {NEAR}"):
        run(device, rid, fmt, steps=1)


def test_l2_ties_only_for_l2_decay_and_few():
    """No ties for decoupled weight decay or wd 0; a tensor of ties is refused, not excused."""
    params, grads = tie_data("cpu")
    assert l2_ties(ROW["adamw"], {**ROW["adamw"].hparams, "weight_decay": WD}, params, grads) == {}
    assert l2_ties(ROW["adagrad-plain"], {**ROW["adagrad-plain"].hparams, "weight_decay": 0.0}, params, grads) == {}
    params = {"w": torch.full((N,), P_TIE, dtype=F16)}
    grads = {"w": torch.full((N,), G_TIE, dtype=F16)}
    with pytest.raises(AssertionError, match="L2 ties"):
        l2_ties(ROW["adagrad-plain"], {**ROW["adagrad-plain"].hparams, "weight_decay": WD}, params, grads)


def test_code_gap_near_a_code():
    """resync.assert_within_code_gap: a reference value within the float32 slack of a code (a momentum whose terms
    of order absmax cancel there) may be stored one code beyond that code, as the kernels' own sum may fall on the
    other side of it; a value farther from the code may not (the H200's failure at 1024x4097: reference 3.24e-6 of
    the absmax, 0.01e-6 below the signed dynamic map's code 3.25e-6, stored at the next code, 7.75e-6)."""
    from bnbf.quant import dynamic_map

    spec = bnbf.OptimSpec(rule="rmsprop", state_format="dynamic", min_8bit_size=0)
    hp = {"lr": 1e-2, "momentum": 0.9, "centered": True}
    state = bnbf.init_state(torch.zeros(256), spec, hp)
    code = dynamic_map(True)
    hi = int(torch.searchsorted(code, torch.tensor(3.0e-6)))  # the code at 3.25e-6
    absmax = 8.2347
    codes = torch.full((256,), 127, dtype=torch.uint8)  # zero
    codes[0] = 255  # the block's absmax element
    codes[1] = hi + 1  # stored one code above the code nearest the reference
    state = state._replace(momentum_buffer=codes, momentum_buffer_absmax=torch.tensor([absmax]))
    expected = torch.zeros(256, dtype=torch.float64)
    expected[0] = absmax * float(code[255])
    expected[1] = absmax * (float(code[hi]) - 1e-8)  # within the slack (8 float32 ulps of the absmax) below it
    resync.assert_within_code_gap(state, "momentum_buffer", expected, "near a code")
    expected[1] = absmax * float(code[hi - 1] + code[hi]) / 2  # midway between codes: farther than the slack
    with pytest.raises(AssertionError, match="more than a code gap"):
        resync.assert_within_code_gap(state, "momentum_buffer", expected, "off a code")

"""bitsandbytes' per-parameter checkpoint layout, to and from bnbf states.

Per parameter, bitsandbytes saves ``{"step": int, "__bnb_optimizer_quant_state__": {...}}`` whose inner
dict holds ``state1``/``state2`` (uint8 codes of the param's shape, or float32 values), and for 8-bit
state ``qmap1``/``qmap2`` (the 256 values the codes stand for) and ``absmax1``/``absmax2`` (float32, one
per block of 256). State k holds the rule's slot k-1 (AdEMAMix stacks its two first moments in ``state1``,
shape ``(2, *param.shape)``, as bitsandbytes does). Slots bitsandbytes does not have (RMSprop's momentum
and centered buffers, Adam's amsgrad maximum) continue the numbering: RMSprop keeps ``square_avg``,
``momentum_buffer``, ``grad_avg`` in ``state1``, ``state2``, ``state3``; Adam and AdamW with
``amsgrad=True`` keep ``max_exp_avg_sq`` in ``state3`` (``qmap3``, ``absmax3``).

The qmap says which 8-bit format the codes are in: bitsandbytes' dynamic map (``state_format="dynamic"``,
the only map bitsandbytes itself creates) or bnbf's power map (``"power"``, bnbf's default). Loading reads
the format from the qmap. bitsandbytes 0.50's CPU kernels quantize and dequantize through the qmap of the
checkpoint, so they continue from either format (tests/test_nn_checkpoint.py checks both); its CUDA kernels
are not tested here with any map but the dynamic one, so write checkpoints meant for bitsandbytes with
``state_format="dynamic"``.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

import bnbf
from bnbf.quant import STATE_FORMATS, state_map

QUANT_KEY = "__bnb_optimizer_quant_state__"  # bitsandbytes (>= 0.48) nests the state tensors under it
BLOCK = 256  # bitsandbytes' block size
_IGNORED = {"unorm_vec", "gnorm_vec"}  # bitsandbytes' scratch buffers, recomputed every step


@functools.cache
def qmap(fmt: str, signed: bool, device: torch.device) -> Tensor:
    """The 256 values the codes of ``fmt`` stand for, as state dicts carry them (one tensor per device,
    apart from the maps the quantizer itself uses)."""
    return state_map(fmt, signed, device).clone()


def _slots(rule: Any, stacks: tuple | None) -> tuple[tuple[int, ...], ...]:
    return stacks if stacks is not None else tuple((j,) for j in range(len(rule.states)))


def pack(state: Any, stacks: tuple | None, max_unorm: float = 0.0) -> dict[str, Tensor]:
    """bitsandbytes' ``state{k}``/``qmap{k}``/``absmax{k}`` tensors of one bnbf state."""
    layout = type(state).layout
    rule = bnbf.RULES[layout.rule]
    out: dict[str, Tensor] = {}
    for k, slots in enumerate(_slots(rule, stacks), start=1):
        kept = [j for j in slots if (layout.present >> j) & 1]
        if not kept:
            continue
        names = [rule.states[j].name for j in kept]
        join = (lambda ts: ts[0]) if len(slots) == 1 else torch.stack
        out[f"state{k}"] = join([getattr(state, n) for n in names])
        if layout.quantized:
            out[f"qmap{k}"] = qmap(layout.format, rule.states[kept[0]].signed, out[f"state{k}"].device)
            out[f"absmax{k}"] = join([getattr(state, n + "_absmax") for n in names])
    if max_unorm and not layout.quantized:  # bitsandbytes' 32-bit steps expect this scratch buffer
        out["unorm_vec"] = torch.zeros(1, device=out["state1"].device)
    return out


def _fail(where: str, msg: str) -> None:
    raise ValueError(f"cannot load the optimizer state of {where}: {msg}")


def read_step(entry: Mapping, where: str) -> int:
    step = entry.get("step")
    if isinstance(step, Tensor) and step.numel() == 1 and not step.is_complex():
        step = step.item()
    if isinstance(step, float) and step.is_integer():
        step = int(step)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        _fail(where, f"'step' must be a non-negative int, got {entry.get('step')!r}")
    return step


def unpack(
    entry: Mapping, param: Tensor, rule: Any, stacks: tuple | None, hparams: Any, want_bits: int, where: str
) -> Any:
    """A new bnbf state (on ``param``'s device) holding exactly the checkpoint's values; raises ValueError
    naming what does not fit before anything is built."""
    entry = dict(entry)
    entry.update(entry.pop(QUANT_KEY, None) or {})
    present = rule.slots_present(bnbf.hparams_for(rule.name, hparams))
    slots = _slots(rule, stacks)
    expected = {f"state{k}": [j for j in js if present[j]] for k, js in enumerate(slots, start=1)}
    expected = {key: kept for key, kept in expected.items() if kept}
    tensors = {k: v for k, v in entry.items() if k != "step" and k not in _IGNORED}
    for key in sorted(set(tensors) - {f"{p}{k[5:]}" for k in expected for p in ("state", "qmap", "absmax")}):
        hint = " (bitsandbytes' non-blockwise 8-bit state is not supported)" if key.startswith(("max", "new_")) else ""
        slot = re.fullmatch(r"(?:state|qmap|absmax)(\d+)", key)
        if slot and 1 <= int(slot[1]) <= len(slots):  # e.g. amsgrad's maximum loaded with amsgrad=False
            names = [rule.states[j].name for j in slots[int(slot[1]) - 1]]
            hint = f" (the {rule.name} state {names}, which these hyperparameters do not keep)"
        _fail(where, f"unexpected entry {key!r}{hint}; a {rule.name} state here holds {sorted(expected)}")
    bits = set()
    fmts = set()
    n, nblocks = param.numel(), math.ceil(param.numel() / BLOCK)
    for key, kept in expected.items():
        k = key[5:]
        t = tensors.get(key)
        if not isinstance(t, Tensor):
            _fail(where, f"missing {key!r} (the {rule.name} state {[rule.states[j].name for j in kept]})")
        lead = (len(slots[int(k) - 1]),) if len(slots[int(k) - 1]) > 1 else ()
        if tuple(t.shape) != lead + tuple(param.shape):
            _fail(where, f"{key} has shape {tuple(t.shape)}, the parameter needs {lead + tuple(param.shape)}")
        if t.dtype not in (torch.uint8, torch.float32):
            _fail(where, f"{key} has dtype {t.dtype}; expected uint8 codes or float32 values")
        bits.add(8 if t.dtype == torch.uint8 else 32)
        if t.dtype != torch.uint8:
            continue
        q, a = tensors.get("qmap" + k), tensors.get("absmax" + k)
        if not isinstance(q, Tensor) or q.dtype != torch.float32 or tuple(q.shape) != (256,):
            _fail(where, f"8-bit {key} needs qmap{k}, a float32 tensor of 256 values")
        if not isinstance(a, Tensor) or a.dtype != torch.float32 or tuple(a.shape) != lead + (nblocks,):
            got = f"{a.dtype} {tuple(a.shape)}" if isinstance(a, Tensor) else repr(a)
            _fail(where, f"absmax{k} must be float32 of shape {lead + (nblocks,)} for {n} elements, got {got}")
        signed = rule.states[kept[0]].signed
        match = [f for f in STATE_FORMATS if torch.equal(q.detach().cpu(), state_map(f, signed))]
        if not match:
            kind = "signed" if signed else "unsigned"
            other = [f for f in STATE_FORMATS if torch.equal(q.detach().cpu(), state_map(f, not signed))]
            hint = (
                (
                    f"; it is the {'unsigned' if signed else 'signed'} {other[0]} map (bitsandbytes quantizes "
                    f"RMSprop's and Adagrad's non-negative state with its signed map), so these codes cannot be "
                    f"restored as bnbf's {kind} {rule.states[kept[0]].name}"
                )
                if other
                else ""
            )
            _fail(where, f"qmap{k} is neither the {kind} dynamic map nor the {kind} power map{hint}")
        fmts.add(match[0])
    if len(bits) > 1 or len(fmts) > 1:
        _fail(where, "its state tensors mix 8-bit and 32-bit storage or 8-bit formats")
    got_bits = bits.pop() if bits else want_bits
    if got_bits != want_bits:
        _fail(
            where,
            f"the checkpoint holds {got_bits}-bit state but this optimizer keeps {want_bits}-bit state "
            f"for it (check optim_bits, min_8bit_size and GlobalOptimManager overrides)",
        )
    fmt = fmts.pop() if fmts else "power"
    spec = bnbf.OptimSpec(rule=rule.name, state_bits=got_bits, block_size=BLOCK, min_8bit_size=0, state_format=fmt)
    state = bnbf.init_state(param.detach(), spec, hparams)
    with torch.no_grad():
        for key, kept in expected.items():
            k = key[5:]
            for i, j in enumerate(kept):
                name = rule.states[j].name
                src = tensors[key][i] if len(slots[int(k) - 1]) > 1 else tensors[key]
                getattr(state, name).copy_(src)
                if got_bits == 8:
                    absmax = tensors["absmax" + k]
                    getattr(state, name + "_absmax").copy_(absmax[i] if len(slots[int(k) - 1]) > 1 else absmax)
    return state

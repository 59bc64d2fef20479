"""bitsandbytes' per-parameter checkpoint layout, to and from bnbf states.

Per parameter, bitsandbytes saves ``{"step": int, "__bnb_optimizer_quant_state__": {...}}`` whose inner
dict holds ``state1``/``state2`` (uint8 codes of the param's shape, or float32 values), and for 8-bit
state ``qmap1``/``qmap2`` (the 256 values the codes stand for) and ``absmax1``/``absmax2`` (float32, one
per block of 256). State k holds the rule's slot k-1 (AdEMAMix stacks its two first moments in ``state1``,
shape ``(2, *param.shape)``, as bitsandbytes does). Slots bitsandbytes does not have (RMSprop's momentum
and centered buffers, Adam's amsgrad maximum) continue the numbering: RMSprop keeps ``square_avg``,
``momentum_buffer``, ``grad_avg`` in ``state1``, ``state2``, ``state3``; Adam and AdamW with
``amsgrad=True`` keep ``max_exp_avg_sq`` in ``state3`` (``qmap3``, ``absmax3``).

The same names, as views of the live state tensors (:func:`views`), are in ``optimizer.state[p]`` beside
the bnbf state (:func:`record`), and again under ``__bnb_optimizer_quant_state__`` beside ``state_bits`` (an
int): torch.distributed.checkpoint's ``flatten_optimizer_state_dict`` rebuilds a loaded entry from the record's
keys. In a state dict ``step`` is a float32 tensor, as torch.optim writes it (torch.distributed.checkpoint needs
every leaf a tensor); :func:`read_step` also takes the ints of older checkpoints and of bitsandbytes', and
:func:`for_bitsandbytes` writes ints for bitsandbytes to load. bnbf_nn's entries also hold ``state_bits``
(:data:`BITS_KEY`): a load keeps each state's saved bits, and where torch.distributed.checkpoint cast its tensors
into the loader's state of other bits, the load is refused. Loading refuses absmax values that are negative, NaN
or inf. Any other entry of ``optimizer.state[p]`` is the user's (:func:`own_key`; timm's Lookahead keeps its slow
weights there): saved beside these and loaded back as torch.optim and bitsandbytes keep it.

The qmap says which 8-bit format the codes are in: bitsandbytes' dynamic map (``state_format="dynamic"``,
the only map bitsandbytes itself creates) or bnbf's power map (``"power"``, bnbf's default). Loading reads
the format from the qmap. bitsandbytes 0.50's CPU kernels quantize and dequantize through the qmap of the
checkpoint, so they continue from either format (tests/test_nn_checkpoint.py checks both); its CUDA kernels
are not tested here with any map but the dynamic one, so write checkpoints meant for bitsandbytes with
``state_format="dynamic"``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import numbers
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

import bnbf
from bnbf._dispatch import is_dtensor
from bnbf._host_checks import _check_param
from bnbf.quant import STATE_FORMATS, state_map
from bnbf.rules import get_rule
from bnbf.state import new_state as new_state_of
from bnbf.state import present_mask, relaid

QUANT_KEY = "__bnb_optimizer_quant_state__"  # bitsandbytes (>= 0.48) nests the state tensors under it
BLOCK = 256  # bitsandbytes' block size
_IGNORED = frozenset({"unorm_vec", "gnorm_vec"})  # bitsandbytes' scratch buffers, recomputed every step
BITS_KEY = "state_bits"  # bnbf_nn's record of a state's bits in its saved entry (a 0-d int32 tensor)
_PER_TENSOR = frozenset({"max1", "max2", "new_max1", "new_max2"})  # bitsandbytes' non-blockwise 8-bit state


def qmap(maps: dict, fmt: str, signed: bool, device: torch.device) -> Tensor:
    """The 256 values the codes of ``fmt`` stand for, as bitsandbytes' state carries them: ``maps``' copy, made
    on first use. One optimizer's live views share its ``maps``, and each state dict has its own, as bitsandbytes
    shares one optimizer's; never the quantizer's own maps, nor another optimizer's (a write into one would
    change what every other shows and loads)."""
    key = (fmt, signed, device)
    if key not in maps:
        maps[key] = state_map(fmt, signed, device).clone()
    return maps[key]


def _slots(rule: Any, stacks: tuple | None) -> tuple[tuple[int, ...], ...]:
    return stacks if stacks is not None else tuple((j,) for j in range(len(rule.states)))


def uncast_keys(rule: Any, stacks: tuple | None) -> frozenset[str]:
    """bitsandbytes' ``non_castable_tensor_keys`` for a state of ``rule`` in ``stacks``: the entries of a param's
    state that loading never casts to the param's dtype. :func:`unpack` loads every ``state{k}``, ``qmap{k}`` and
    ``absmax{k}`` as saved (uint8 codes, float32 values and scales; another dtype is refused), ignores the scratch
    buffers and refuses the non-blockwise state; bitsandbytes' own ``state2``... are in for every rule, as there."""
    ks = range(1, max(len(_slots(rule, stacks)), 2) + 1)
    return frozenset(f"{n}{k}" for n in ("state", "qmap", "absmax") for k in ks) | _IGNORED | _PER_TENSOR


def portable(states: list) -> list:
    """The states in a form that does not depend on the mesh: a DTensor param's state as
    :func:`bnbf.distributed.state_dict` gives it (codes and float32 states as DTensors of the param's global
    shape, 8-bit scales of the unsharded blocks, replicated), others as they are. Every rank must call it
    with the same states, in the same order (8-bit sharded states gather their scales: a collective each)."""
    at = [i for i, s in enumerate(states) if any(is_dtensor(t) for t in s)]
    if not at:
        return states
    import bnbf.distributed

    out = list(states)
    for i, entry in zip(at, bnbf.distributed.state_dict([states[i] for i in at])):
        s = states[i]
        out[i] = type(s)(*(entry[f] for f in s._fields))
    return out


def pack(state: Any, stacks: tuple | None, max_unorm: float = 0.0, maps: dict | None = None) -> dict[str, Tensor]:
    """bitsandbytes' ``state{k}``/``qmap{k}``/``absmax{k}`` tensors of one bnbf state (for a DTensor
    param's, pass it through :func:`portable` first). ``maps``: one state dict's own qmaps (:func:`qmap`)."""
    maps = {} if maps is None else maps
    layout = type(state).layout
    rule = bnbf.RULES[layout.rule]
    out: dict[str, Tensor] = {}
    for k, slots in enumerate(_slots(rule, stacks), start=1):
        kept = [j for j in slots if (layout.present >> j) & 1]
        if not kept:
            continue
        names = [rule.states[j].name for j in kept]
        join = (lambda ts: ts[0]) if len(slots) == 1 else _stack
        out[f"state{k}"] = join([getattr(state, n) for n in names])
        if layout.quantized:
            out[f"qmap{k}"] = qmap(maps, layout.format, rule.states[kept[0]].signed, out[f"state{k}"].device)
            out[f"absmax{k}"] = join([getattr(state, n + "_absmax") for n in names])
    if max_unorm and out:  # bitsandbytes' scratch buffer, which it makes for 8- and 32-bit state where max_unorm > 0
        out["unorm_vec"] = torch.zeros(1, device=out["state1"].device)
    return out


def _stack(ts: list[Tensor]) -> Tensor:
    """``torch.stack`` of a stack's fields; DTensors by their local tensors, the fields' ``Shard(d)`` becoming
    ``Shard(d + 1)`` (what loading reads back by rows)."""
    if not is_dtensor(ts[0]):
        return torch.stack(ts)
    return distributed_module().stacked(torch.stack([t.to_local() for t in ts]), ts[0])


def views(state: Any, stacks: tuple | None, maps: dict) -> dict[str, Tensor]:
    """bitsandbytes' ``state{k}``/``qmap{k}``/``absmax{k}`` of one bnbf state as views of its live tensors
    (writing them writes the state). A stacked ``state{k}`` (AdEMAMix's) is one view over its slots' fields,
    which must be equally spaced rows of one storage (:func:`bnbf.state.new_state` with ``stacks`` makes
    them so); the qmaps are the optimizer's own (``maps``, :func:`qmap`)."""
    layout = type(state).layout
    rule = bnbf.RULES[layout.rule]
    out: dict[str, Tensor] = {}
    for k, slots in enumerate(_slots(rule, stacks), start=1):
        names = [rule.states[j].name for j in slots if (layout.present >> j) & 1]
        if not names:
            continue
        out[f"state{k}"] = _rows(state, names, len(slots) > 1)
        if layout.quantized:
            out[f"qmap{k}"] = qmap(maps, layout.format, rule.states[slots[0]].signed, out[f"state{k}"].device)
            out[f"absmax{k}"] = _rows(state, [n + "_absmax" for n in names], len(slots) > 1)
    return out


def _rows(state: Any, names: list[str], stack: bool) -> Tensor:
    ts = [getattr(state, n) for n in names]
    if not stack:
        return ts[0]
    if is_dtensor(ts[0]):  # the local rows, shown as one DTensor (bnbf.distributed.relaid lays them out)
        return distributed_module().stacked(_local_rows([t._local_tensor for t in ts], names), ts[0])
    return _local_rows(ts, names)


def _local_rows(ts: list[Tensor], names: list[str]) -> Tensor:
    t0 = ts[0]
    # by storage offsets: an empty field's data_ptr() is 0 (an empty shard's, say)
    gap = ts[1].storage_offset() - t0.storage_offset() if len(ts) > 1 else t0.numel()
    rows = t0.as_strided((len(ts), *t0.shape), (gap, *t0.stride()), t0.storage_offset())
    for i, t in enumerate(ts):
        if t.untyped_storage().data_ptr() != t0.untyped_storage().data_ptr() or not rows[i].is_set_to(t):
            raise RuntimeError(f"state fields {names} are not rows of one tensor: cannot show them as a stack")
    return rows


def _row_of(t: Tensor, i: int) -> Tensor:
    """Row ``i`` of a stacked checkpoint tensor (a DTensor's by its local rows: ``Shard(d + 1)`` becomes
    ``Shard(d)``)."""
    if not is_dtensor(t):
        return t[i]
    from torch.distributed.tensor import DTensor, Shard

    if any(isinstance(pl, Shard) and pl.dim % t.ndim == 0 for pl in t.placements):
        raise ValueError(f"a stacked state sharded along its stack dim ({t.placements}) cannot be loaded")
    placements = [Shard(pl.dim % t.ndim - 1) if isinstance(pl, Shard) else pl for pl in t.placements]
    return DTensor.from_local(
        t.to_local()[i], t.device_mesh, placements, run_check=False, shape=t.shape[1:], stride=t.stride()[1:]
    )


def distributed_module() -> Any:
    """:mod:`bnbf.distributed`, for the state of a DTensor param (imported on first use: it imports
    torch.distributed.tensor)."""
    import bnbf.distributed

    return bnbf.distributed


def with_slots(rule: Any, hparams: Any, mask: int) -> Any:
    """The rule's hyperparameter dataclass ``hparams`` changed where needed to keep the state slots of ``mask``
    too (bit j: slot j), with every initial value as ``hparams`` gives it: what a state is made from that keeps a
    slot the current settings do not step (a momentum buffer kept after momentum was switched off, as
    torch.optim keeps it), or one they add."""
    h = rule.make_hparams(hparams)
    have = present_mask(rule, h)
    changes: dict = {}
    for j in range(len(rule.states)):
        if (mask >> j) & 1 and not (have >> j) & 1:
            changes.update(rule.states[j].kept_by)
    if changes:
        h = dataclasses.replace(h, **changes)
    if present_mask(rule, h) != mask | have:
        raise NotImplementedError(f"bnbf_nn cannot make a {rule.name} state keeping the slots {mask:#b}")
    return h


def new_state(param: Tensor, spec: Any, hparams: Any, family: Any, wide: bool = False) -> Any:
    """A new bnbf state for ``param`` through :func:`bnbf.init_state`, with the family's bitsandbytes stacks
    (AdEMAMix's first moments) as rows of one tensor, so that :func:`views` can show them (a copy, at
    creation only). A DTensor param (FSDP2) gets the state of its local shard as DTensors
    (:func:`bnbf.distributed.init_state`), its stacks as rows of one local tensor
    (:func:`bnbf.distributed.relaid`). ``wide``: a float64 param (a differentiable optimizer's) gets float64
    32-bit state; otherwise :func:`bnbf.init_state` refuses it."""
    if is_dtensor(param):
        return restacked(distributed_module().init_state(param.detach(), spec, hparams), family)
    return _fresh(param, spec, hparams, family.bnb_slots, spec.paged, wide)


def _fresh(param: Tensor, spec: Any, hparams: Any, stacks: tuple | None, paged: bool, wide: bool) -> Any:
    """:func:`new_state` of a plain param, its stacks ``stacks``, laid out in them from the start. ``wide`` (a
    float64 param): float64 32-bit state, as bnbf.init_state makes it."""
    if not stacks:
        return bnbf.init_state(param.detach(), spec, hparams)
    # laid out in its stacks from the start: a copy would hold the whole state twice during the first step
    _check_param(param, "", wide=wide)
    get_rule(spec.rule).make_hparams(hparams)
    return new_state_of(param.detach(), dataclasses.replace(spec, paged=paged), hparams, stacks)


def restacked(state: Any, family: Any, paged: bool = False) -> Any:
    """A copy of ``state`` with the family's bitsandbytes stacks as rows of one tensor (the state itself where the
    family has none): :func:`bnbf.state.relaid`, or :func:`bnbf.distributed.relaid` for a DTensor param's."""
    if not family.bnb_slots:
        return state
    if is_dtensor(state[0]):
        return distributed_module().relaid(state, family.bnb_slots)
    return relaid(state, family.bnb_slots, paged)


_VIEW = re.compile(r"(?:state|qmap|absmax)\d+")
_OWN = frozenset({"step", "state", QUANT_KEY, BITS_KEY}) | _IGNORED | _PER_TENSOR


def own_key(key: Any) -> bool:
    """Whether ``key`` is one of the optimizer's own entries of a record or a saved entry (bnbf_nn's or
    bitsandbytes'). Any other is the user's (timm's Lookahead keeps ``lookahead_slow_buff`` there), kept beside
    the state through state_dict, load_state_dict, deepcopy and pickle, as torch.optim keeps it."""
    return isinstance(key, str) and (key in _OWN or bool(_VIEW.fullmatch(key)))


def users(entry: Mapping) -> dict:
    """The user's entries of a record or a saved entry (:func:`own_key`)."""
    return {k: v for k, v in entry.items() if not own_key(k)}


def as_torch_loads(value: Any, param: Tensor, key: Any = None, step_moved: bool = False) -> Any:
    """A user's entry as torch.optim.Optimizer.load_state_dict casts it: each tensor onto the param's device and,
    where the param is floating-point, to its dtype; a ``step`` kept as it is, or a float32 one on that device
    where the saved group is fused or capturable (``step_moved``); dicts, lists and tuples entry by entry (torch
    rebuilds any iterable, a string into a generator's repr: strings are kept); anything else as it is."""
    if isinstance(value, Tensor):
        if key == "step":
            return value.to(dtype=torch.float32, device=param.device) if step_moved else value
        return value.to(dtype=param.dtype if param.is_floating_point() else value.dtype, device=param.device)
    if isinstance(value, dict):
        return {k: as_torch_loads(v, param, k, step_moved) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(as_torch_loads(v, param, None, step_moved) for v in value)
    return value


# Bumped by every edit of an optimizer's ``state`` or of a param's record made from outside bnbf_nn (bnbf_nn
# writes its own with dict's methods): the optimizers' cached plans and fast step are valid while it is unchanged,
# so a reset state (``opt.state.clear()``, ``del opt.state[p]``) or a step count set by hand is seen at the next step.
EDITS = [0]


def _edited(method: Any) -> Any:
    @functools.wraps(method)
    def edit(self: Any, *args: Any, **kwargs: Any) -> Any:
        EDITS[0] += 1
        return method(self, *args, **kwargs)

    return edit


class _Counted:
    """The edits of a dict (besides ``__setitem__`` and ``update``, which each class counts itself) that count in
    :data:`EDITS`."""

    __slots__ = ()

    def __ior__(self, other: Any) -> Any:
        self.update(other)
        return self

    __delitem__ = _edited(dict.__delitem__)
    clear = _edited(dict.clear)
    pop = _edited(dict.pop)
    popitem = _edited(dict.popitem)
    setdefault = _edited(dict.setdefault)


class Record(_Counted, dict):
    """``optimizer.state[p]`` of bnbf_nn: ``step`` (int), ``state`` (the bnbf state NamedTuple the kernels
    step) and bitsandbytes' names for the same tensors (:func:`views`), also nested as in a saved entry
    (:func:`named`).

    The kernels step ``state``, so a view replaced by another tensor (``rec["state1"] = t``, as loops that move
    optimizer state do) would be left out of every later step. Instead ``t``'s values are written into the
    state, where ``t`` has the view's shape, dtype and device, and any other tensor raises (a qmap, which
    names the 8-bit format, only takes its own values). The nested views (:data:`QUANT_KEY`) replaced by a
    mapping (what a loop moving nested state makes) and ``state`` replaced by a state of its type (a
    ``tree_map`` over the record makes one) are written so too, all checked before any is written, and
    :data:`BITS_KEY` takes only its own value (the load changes the bits). Copies of these on another device (a
    mover's, as Lightning's teardown moves state to the CPU) are kept as given, and the next step or state_dict
    makes the views of the moved state (:func:`stale`). Any other edit (a step count set, the record cleared)
    counts in :data:`EDITS`."""

    __slots__ = ()

    def __setitem__(self, key: Any, value: Any) -> None:
        self._write(key, value, self.get("state"))()

    def _write(self, key: Any, value: Any, state: Any) -> Any:
        """What ``self[key] = value`` does, checked (raising before anything is written), as a call that does it;
        ``state``: the record's ``state`` when it is done (a mover's, where an earlier entry moves it)."""
        live = self.get(key)
        kind = _kind(key, live) if value is not live else None
        # another entry, or a mover taking the state to another device key by key (Lightning's teardown moves it
        # to the CPU): kept as given; the record is then stale, and the next step or state_dict makes the views again
        if kind is None or _moved(kind, live, value, state):
            return functools.partial(self._kept, key, value)
        check, write = _WRITES[kind]
        check(key, live, value)
        return functools.partial(write, key, live, value)

    def _kept(self, key: Any, value: Any) -> None:
        EDITS[0] += 1
        dict.__setitem__(self, key, value)

    def update(self, *args: Any, **kwargs: Any) -> None:
        """Each entry as ``self[key] = value``, all checked before any is written (a refused one changes nothing)."""
        state, writes = self.get("state"), []
        for key, value in dict(*args, **kwargs).items():
            writes.append(self._write(key, value, state))
            if key == "state" and writes[-1].func == self._kept:  # kept as given: later entries follow it
                state = value
        for write in writes:
            write()


def _kind(key: Any, live: Any) -> str | None:
    """Which of the record's own entries ``key`` is (a view, the nested views, the state, its bits), by its live
    value; None for any other entry (a step count, a hook's note), which an assignment replaces."""
    if isinstance(live, Tensor) and isinstance(key, str) and _VIEW.fullmatch(key):
        return "view"
    if key == QUANT_KEY and isinstance(live, Record):
        return "nested"
    if key == "state" and hasattr(type(live), "layout"):
        return "state"
    return "bits" if key == BITS_KEY and isinstance(live, int) else None


class States(_Counted, collections.defaultdict):
    """``optimizer.state`` of bnbf_nn: torch's ``defaultdict(dict)`` whose edits count in :data:`EDITS`."""

    def __init__(self, *args: Any) -> None:
        super().__init__(dict, *args)

    def __reduce__(self) -> Any:  # pickled as torch's defaultdict(dict), which is what __setstate__ receives
        return (collections.defaultdict, (dict,), None, None, iter(self.items()))

    def update(self, *args: Any, **kwargs: Any) -> None:
        EDITS[0] += 1
        dict.update(self, *args, **kwargs)

    __setitem__ = _edited(dict.__setitem__)


def _moved(kind: str, live: Any, value: Any, state: Any) -> bool:
    """Whether ``value`` is the record's entry ``live`` (of :func:`_kind` ``kind``) as a mover copies it to another
    device: every tensor of the same shape and dtype, all on one device other than ``live``'s. The state moves first
    (a record's keys come in that order); views or nested views on another device than the record's ``state`` are
    refused as before, their values would be lost when the views are made again."""
    if kind == "view":
        pairs = [(live, value)]
    elif kind == "nested" and isinstance(value, Mapping) and set(value) == set(live):
        pairs = [(live[k], value[k]) for k in live]
    elif kind == "state" and type(value) is type(live):
        pairs = list(zip(live, value))
    else:
        return False
    fits = all(isinstance(b, Tensor) and (b.shape, b.dtype) == (a.shape, a.dtype) for a, b in pairs)
    to = {b.device for _, b in pairs if isinstance(b, Tensor)}
    if not (pairs and fits and len(to) == 1 and pairs[0][0].device not in to):
        return False
    return kind == "state" or (state is not None and all(t.device in to for t in state))


def _check_view(key: str, live: Tensor, value: Any, what: str = "") -> None:
    """ValueError unless ``value`` can be written into the view ``live`` (:func:`_write_view`)."""
    what = what or f"optimizer.state[p][{key!r}] is a view of the state the optimizer steps"
    where = lambda t: (t.shape, t.dtype, t.device)  # noqa: E731
    if not isinstance(value, Tensor) or where(value) != where(live):
        got = f"{tuple(value.shape)}, {value.dtype}, on {value.device}" if isinstance(value, Tensor) else type(value)
        raise ValueError(
            f"{what} ({tuple(live.shape)}, {live.dtype}, on {live.device}): assign a tensor of that shape, dtype and "
            f"device (its values are written into the state), not ({got}); a state lives on its param's device"
        )
    if key.startswith("qmap") and not torch.equal(value, live):
        raise ValueError(f"{what}: its qmap names the 8-bit format, which load_state_dict changes, not a write")


def _write_view(key: Any, live: Tensor, value: Tensor) -> None:
    if not key.startswith("qmap"):  # a qmap took only its own values
        live.copy_(value)


def _check_nested(_: Any, live: Record, value: Any) -> None:
    """ValueError unless ``value`` can be written into the nested views ``live`` (:func:`_write_nested`): it must
    hold exactly their keys, each fitting its view."""
    what = f"optimizer.state[p][{QUANT_KEY!r}] holds views of the state the optimizer steps ({sorted(live)})"
    if not isinstance(value, Mapping) or set(value) != set(live):
        got = sorted(value) if isinstance(value, Mapping) else type(value)
        raise ValueError(f"{what}: assign a mapping of those keys (their values are written into the state), not {got}")
    for key in live:
        if value[key] is not live[key]:
            _check_view(key, live[key], value[key])


def _write_nested(_: Any, live: Record, value: Any) -> None:
    """``value``'s tensors written into the nested views ``live`` (checked by :func:`_check_nested`)."""
    for key in live:
        if value[key] is not live[key]:
            _write_view(key, live[key], value[key])


def _check_new_state(_: Any, live: Any, value: Any) -> None:
    """ValueError unless ``value`` can be written into the state ``live`` (:func:`_write_state`): a state of the
    same type (layout), each field fitting its own. Replacing it instead would leave the views stale."""
    if type(value) is not type(live):
        raise ValueError(
            f"optimizer.state[p]['state'] is the state the optimizer steps (a {type(live).__name__} of fields "
            f"{list(live._fields)}): assign a state of that type (its tensors are written into it), not "
            f"{type(value).__name__}"
        )
    for name, a, b in zip(live._fields, live, value):
        if a is not b:
            _check_view(name, a, b, f"optimizer.state[p]['state'].{name} is a tensor of the state the optimizer steps")


def _write_state(_: Any, live: Any, value: Any) -> None:
    """``value``'s tensors written into the state ``live`` (checked by :func:`_check_new_state`)."""
    for a, b in zip(live, value):
        if a is not b:
            a.copy_(b)


def _check_bits(_: Any, live: int, value: Any) -> None:
    given = value.item() if isinstance(value, Tensor) and value.numel() == 1 else value
    if not (isinstance(given, numbers.Integral) and not isinstance(given, bool) and given == live):
        raise ValueError(
            f"optimizer.state[p][{BITS_KEY!r}] records the bits of the state the optimizer steps ({live}), not a "
            f"setting (got {value!r}): a state takes its bits from optim_bits or a GlobalOptimManager override when "
            "it is made, or from the checkpoint load_state_dict loads"
        )


def _unchanged(*_: Any) -> None:  # the bits take only their own value: nothing to write
    pass


# each kind of the record's own entries (:func:`_kind`): its check, then its write (key, live value, new value)
_WRITES = {
    "view": (_check_view, _write_view),
    "nested": (_check_nested, _write_nested),
    "state": (_check_new_state, _write_state),
    "bits": (_check_bits, _unchanged),
}


def record(step: int, state: Any, family: Any, maps: dict, extra: Mapping | None = None) -> Record:
    """A param's record of ``state``; ``extra``: the user's entries (:func:`users`), kept beside it."""
    return Record({"step": step, "state": state, **named(state, family.bnb_slots, maps), **(extra or {})})


def named(state: Any, stacks: tuple | None, maps: dict) -> dict[str, Any]:
    """What a record holds besides ``step`` and ``state``: the :func:`views`, and the same views under
    :data:`QUANT_KEY` beside the state's bits (:data:`BITS_KEY`, an int), so that the record has every key of a
    saved entry: torch.distributed.checkpoint's ``flatten_optimizer_state_dict`` rebuilds each entry it loads from
    the keys of ``optimizer.state[p]``, and would leave out any other."""
    v = views(state, stacks, maps)
    return {**v, QUANT_KEY: Record(v), BITS_KEY: type(state).layout.bits}


def stale(rec: Mapping) -> bool:
    """Whether ``rec`` (holding a bnbf ``state``) is not a :class:`Record` whose bitsandbytes names are views of
    that state: a plain dict, or views a mover copied apart from it (flat and nested then other tensors, or
    tensors of other storages). Cheap (it makes no view): movers copy every tensor, so it looks at one."""
    nested = rec.get(QUANT_KEY)
    if type(rec) is not Record or type(nested) is not Record:
        return True
    if any(rec.get(k) is not v for k, v in nested.items()):
        return True
    first = next((v for k, v in nested.items() if not k.startswith("qmap")), None)  # a mover copies every one
    return first is not None and (not isinstance(first, Tensor) or _home(first) not in map(_home, rec["state"]))


def _home(t: Tensor) -> tuple:
    t = t.to_local() if is_dtensor(t) else t
    return t.device, t.untyped_storage().data_ptr()


def _unflattened(entry: Mapping) -> dict:
    """``entry`` without the empty dicts that torch.distributed.checkpoint's unflattening makes of the keys of a live
    record that the checkpoint does not hold (``state``, the views beside :data:`QUANT_KEY`'s): absent, not
    refused as unexpected entries."""
    live = lambda k: k in ("state", "step", QUANT_KEY, BITS_KEY) or bool(_VIEW.fullmatch(k))  # noqa: E731
    return {k: v for k, v in entry.items() if not (isinstance(k, str) and live(k) and isinstance(v, Mapping) and not v)}


def _check_values(where: str, key: str, t: Tensor, nonneg: bool, checks: list) -> None:
    """A 32-bit state's values or block scales: finite, and non-negative for a second moment or a scale (the step
    divides by a second moment's root; it zeroes the states of a non-finite gradient, so no step writes NaN or
    inf). A DTensor's rank sees only its rows: its verdict is appended to ``checks``, which :func:`settle` makes
    the same on every rank (else one rank refuses a load that the others take)."""
    local = t.to_local() if is_dtensor(t) else t
    bad = ~torch.isfinite(local) | (local < 0) if nonneg else ~torch.isfinite(local)
    what = "negative, NaN or inf" if nonneg else "NaN or inf"
    if is_dtensor(t):
        found = _Found(where, key, what, t.device_mesh, _sharded_dims(t), local.device)
        if bool(bad.any()):
            i = int(bad.reshape(-1).nonzero()[0])
            found.stats = (int(bad.sum()), _global_index(t, local.shape, i), local.reshape(-1)[i].item())
        checks.append(found)
        return
    if bool(bad.any()):
        i = int(bad.reshape(-1).nonzero()[0])
        _bad_values(where, key, what, int(bad.sum()), i, t.reshape(-1)[i].item())


def _bad_values(where: str, key: str, what: str, count: int, index: int, value: float) -> None:
    at = f"first at flat index {index}: " if index >= 0 else "first: "
    _fail(where, f"{key} holds {count} values that are {what} ({at}{value!r})")


@dataclasses.dataclass
class _Found:
    """One rank's verdict on a DTensor's values (:func:`_check_values`): ``stats`` = (how many are bad, the global
    flat index of the first, -1 where unknown, its value)."""

    where: str
    key: str
    what: str
    mesh: Any
    dims: tuple[int, ...]  # the mesh dims the tensor is split along (its replicas agree along the others)
    device: torch.device
    stats: tuple = (0, -1, 0.0)


def _sharded_dims(t: Any) -> tuple[int, ...]:
    from torch.distributed.tensor import Replicate

    return tuple(d for d, pl in enumerate(t.placements) if not isinstance(pl, Replicate))


def _global_index(t: Any, local_shape: Any, i: int) -> int:
    """The flat index in ``t``'s global shape of flat index ``i`` of its local tensor; -1 where its placements
    do not make the local tensor one box of the global one (a strided shard)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(isinstance(pl, Shard) and type(pl) is not Shard for pl in t.placements):
        return -1
    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    coords = []
    for size in reversed(tuple(local_shape)):
        i, c = divmod(i, size)
        coords.append(c)
    out = 0
    for c, start, n in zip(reversed(coords), offset, t.shape):
        out = out * n + start + c
    return out


def settle(checks: list) -> None:
    """Raise the first failed check of ``checks`` (:func:`_check_values`' verdicts on DTensors) on every rank
    alike: the ranks' counts summed and the first bad value found by global index, through one all-gather per
    mesh dim the tensors are split along (a load checks all its states, then settles once). Every rank of the
    meshes must call it with the same checks, in the same order, as every rank loads the same state dict."""
    if not checks:  # no DTensor state: no collective
        return
    import torch.distributed as dist

    groups: dict = {}
    for found in checks:
        groups.setdefault((found.mesh, found.dims, found.device), []).append(found)
    for (mesh, dims, device), found in groups.items():
        rows = [list(f.stats) for f in found]
        for d in dims:
            mine = torch.tensor(rows, dtype=torch.float64, device=device)
            parts = [torch.empty_like(mine) for _ in range(mesh.size(d))]
            dist.all_gather(parts, mine, group=mesh.get_group(d))
            ranks = torch.stack(parts).tolist()
            rows = [_merged([r[j] for r in ranks]) for j in range(len(found))]
        for f, row in zip(found, rows):
            f.stats = (int(row[0]), int(row[1]), row[2])
    for f in checks:
        if f.stats[0]:
            _bad_values(f.where, f.key, f.what, *f.stats)


def _merged(stats: list) -> list:
    """One check's stats over ranks: the counts summed, the first bad value the one of least global index (the
    lowest rank's where the index is unknown)."""
    hit = [s for s in stats if s[0]]
    if not hit:
        return [0, -1, 0.0]
    first = min(hit, key=lambda s: s[1] if s[1] >= 0 else math.inf)
    return [sum(s[0] for s in hit), first[1], first[2]]


def _fail(where: str, msg: str) -> None:
    raise ValueError(f"cannot load the optimizer state of {where}: {msg}")


def _check_has_data(where: str, key: str, t: Tensor) -> None:
    """Refuse a meta tensor (a checkpoint saved or loaded under a meta device) before its values are read or
    copied: torch's own errors there ("Cannot copy out of meta tensor") name no entry."""
    if t.device.type == "meta":
        _fail(where, f"{key} is a meta tensor, which holds no data")


def for_bitsandbytes(state_dict: Mapping) -> dict:
    """``state_dict`` with each param's ``step`` an int, as bitsandbytes writes it (a new dict; the tensors are
    the same objects). bitsandbytes casts every floating-point tensor of a state it loads but its state entries
    (``state1``, ``absmax1``...) to the param's dtype, ``step`` included, and a bfloat16 or float16 step stops
    counting (bfloat16: from 256 on), so Adam's bias correction freezes: pass a bnbf_nn state dict through this
    before bitsandbytes loads it.

    Example::

        torch.save(bnbf_nn.for_bitsandbytes(opt.state_dict()), path)  # then bitsandbytes' load_state_dict
    """
    if not isinstance(state_dict, Mapping) or not isinstance(state_dict.get("state"), Mapping):
        raise ValueError("for_bitsandbytes expects an optimizer state dict: a dict whose 'state' is a dict")
    state = {}
    for key, entry in state_dict["state"].items():
        if isinstance(entry, Mapping) and "step" in entry:
            entry = {k: v for k, v in entry.items() if k != BITS_KEY}  # (bnbf_nn's own record)
            entry["step"] = read_step(entry, f"param {key!r}")
        state[key] = entry
    return {**state_dict, "state": state}


def _saved_bits(v: Any, where: str) -> int | None:
    """An entry's record of its state's bits (None where it has none: bitsandbytes' entries, older bnbf_nn ones)."""
    if v is None:
        return None
    bits = _count(v, BITS_KEY, where)
    if bits not in (8, 32):
        _fail(where, f"{BITS_KEY} must be 8 or 32, got {v!r}")
    return bits


def read_step(entry: Mapping, where: str) -> int:
    return _count(entry.get("step"), "'step'", where)


def _count(v: Any, name: str, where: str) -> int:
    """A saved count as an int: a one-element tensor's value (a float32 step, as torch writes it), numpy's ints,
    integral floats; anything else, or a negative count, refused naming ``name``."""
    given = v
    if isinstance(v, Tensor) and v.device.type == "meta":  # item() would raise torch's bare meta error
        _fail(where, f"{name} is a meta tensor, which holds no data")
    if isinstance(v, Tensor) and v.numel() == 1 and not v.is_complex():
        v = v.item()
    if isinstance(v, numbers.Integral) and not isinstance(v, bool):  # numpy's ints, as converted checkpoints hold
        v = int(v)
    if isinstance(v, numbers.Real) and not isinstance(v, (int, bool)) and float(v).is_integer():
        v = int(float(v))
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        _fail(where, f"{name} must be a non-negative int, got {given!r}")
    return v


def unpack(
    entry: Mapping,
    param: Tensor,
    rule: Any,
    stacks: tuple | None,
    hparams: Any,
    want_bits: int,
    where: str,
    paged: bool = False,
    checks: list | None = None,
) -> Any:
    """A new bnbf state (on ``param``'s device; in managed memory with ``paged``, see :mod:`bnbf.paged`)
    holding exactly the checkpoint's values, at the bits its tensors hold (``want_bits``, the loading optimizer's,
    only where they hold none); raises ValueError naming what does not fit before anything is built, among it
    tensors whose bits differ from the entry's record of them (:data:`BITS_KEY`: its values were cast).
    Block scales must be finite and non-negative: a negative one flips the sign of its block's values, and NaN
    or inf makes the next step's params NaN. ``checks``: where the verdicts on DTensor values
    go, for the caller to :func:`settle` once for the whole load (None: settled here, a collective each)."""
    own = checks is None
    checks = [] if own else checks
    entry = _unflattened(entry)
    saved_bits = _saved_bits(entry.pop(BITS_KEY, None), where)
    quant = entry.pop(QUANT_KEY, None) or {}
    if not isinstance(quant, Mapping):  # dict.update would fail on it with a message that names nothing
        _fail(where, f"{QUANT_KEY!r} must be a dict of bitsandbytes' state tensors, got {type(quant).__name__}")
    entry.update(quant)
    hparams = bnbf.hparams_for(rule.name, hparams)
    present = list(rule.slots_present(hparams))
    slots = _slots(rule, stacks)
    tensors = {k: v for k, v in entry.items() if k != "step" and k not in _IGNORED}
    # a slot these settings do not step, that the saving optimizer kept (momentum or amsgrad switched off after
    # its states were made): loaded and kept untouched, as torch.optim keeps an unused momentum buffer
    extra = 0
    for k, js in enumerate(slots, start=1):
        optional = all(rule.states[j].kept_by for j in js)
        if f"state{k}" in tensors and not any(present[j] for j in js) and optional:
            extra |= sum(1 << j for j in js)
            present = [keep or j in js for j, keep in enumerate(present)]
    if extra:
        hparams = with_slots(rule, hparams, extra)
    expected = {f"state{k}": [j for j in js if present[j]] for k, js in enumerate(slots, start=1)}
    expected = {key: kept for key, kept in expected.items() if kept}
    for key in sorted(set(tensors) - {f"{p}{k[5:]}" for k in expected for p in ("state", "qmap", "absmax")}):
        hint = " (bitsandbytes' non-blockwise 8-bit state is not supported)" if key in _PER_TENSOR else ""
        slot = re.fullmatch(r"(?:state|qmap|absmax)(\d+)", key)
        if slot and 1 <= int(slot[1]) <= len(slots):  # e.g. amsgrad's maximum loaded with amsgrad=False
            names = [rule.states[j].name for j in slots[int(slot[1]) - 1]]
            hint = f" (the {rule.name} state {names}, which these hyperparameters do not keep)"
        _fail(where, f"unexpected entry {key!r}{hint}; a {rule.name} state here holds {sorted(expected)}")
    bits = set()
    fmts = set()
    n, nblocks = param.numel(), math.ceil(param.numel() / BLOCK)
    wide = param.dtype == torch.float64  # a differentiable optimizer's float64 params keep float64 32-bit state
    for key, kept in expected.items():
        k = key[5:]
        t = tensors.get(key)
        if not isinstance(t, Tensor):
            # an option the saving optimizer was made without; bitsandbytes never keeps these slots: it ignores
            # amsgrad (Adam, AdamW) and RMSprop's momentum, refuses centered
            optional = int(k) > 2 or (rule.name == "rmsprop" and int(k) > 1)
            hint = (
                "; a checkpoint of bitsandbytes' holds no such state (it ignores amsgrad and RMSprop's momentum, "
                "and refuses centered): load it into an optimizer made without that option"
                if optional and saved_bits is None
                else "; the optimizer that saved it kept no such state: load it into one made without that option"
                if optional
                else ""
            )
            _fail(where, f"missing {key!r} (the {rule.name} state {[rule.states[j].name for j in kept]}){hint}")
        _check_has_data(where, key, t)
        lead = (len(slots[int(k) - 1]),) if len(slots[int(k) - 1]) > 1 else ()
        if tuple(t.shape) != lead + tuple(param.shape):
            _fail(where, f"{key} has shape {tuple(t.shape)}, the parameter needs {lead + tuple(param.shape)}")
        if t.dtype not in (torch.uint8, torch.float32) and not (wide and t.dtype == torch.float64):
            _fail(where, f"{key} has dtype {t.dtype}; expected uint8 codes or float32 values")
        bits.add(8 if t.dtype == torch.uint8 else 32)
        if t.dtype != torch.uint8:
            _check_values(where, key, t, not any(rule.states[j].signed for j in kept), checks)
            continue
        q, a = tensors.get("qmap" + k), tensors.get("absmax" + k)
        if not isinstance(q, Tensor) or q.dtype != torch.float32 or tuple(q.shape) != (256,):
            _fail(where, f"8-bit {key} needs qmap{k}, a float32 tensor of 256 values")
        if not isinstance(a, Tensor) or a.dtype != torch.float32 or tuple(a.shape) != lead + (nblocks,):
            got = f"{a.dtype} {tuple(a.shape)}" if isinstance(a, Tensor) else repr(a)
            _fail(where, f"absmax{k} must be float32 of shape {lead + (nblocks,)} for {n} elements, got {got}")
        _check_has_data(where, f"qmap{k}", q)
        _check_has_data(where, f"absmax{k}", a)
        if is_dtensor(a):  # a DTensor param's scales, replicated (portable): every rank checks all of them
            a = a.full_tensor()
        _check_values(where, f"absmax{k}", a, True, checks)  # a negative scale flips its block's sign
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
    if own:
        settle(checks)
    if len(bits) > 1 or len(fmts) > 1:
        _fail(where, "its state tensors mix 8-bit and 32-bit storage or 8-bit formats")
    got_bits = bits.pop() if bits else saved_bits or want_bits
    if saved_bits is not None and got_bits != saved_bits:
        # torch.distributed.checkpoint loads into the loading optimizer's own state, casting 8-bit codes to its
        # float32 values (or the reverse): such a state cannot take the checkpoint's values
        _fail(
            where,
            f"the checkpoint holds {saved_bits}-bit state but its tensors arrived as {got_bits}-bit ones (cast by "
            f"torch.distributed.checkpoint into this optimizer's own state, {want_bits}-bit for it): make the "
            f"optimizer keep {saved_bits}-bit state for it (optim_bits, min_8bit_size, GlobalOptimManager "
            f"overrides) before loading",
        )
    fmt = fmts.pop() if fmts else "power"
    spec = bnbf.OptimSpec(
        rule=rule.name, state_bits=got_bits, block_size=BLOCK, min_8bit_size=0, state_format=fmt, paged=paged
    )
    if is_dtensor(param):
        # the checkpoint holds the portable form (see portable): codes of the global shape, scales of the
        # unsharded blocks; bnbf.distributed takes this shard's rows and re-expresses split blocks
        dist = distributed_module()
        state = dist.init_state(param.detach(), spec, hparams)
        state = dist.relaid(state, stacks) if stacks else state
        saved = {}
        for key, kept in expected.items():
            stack = len(slots[int(key[5:]) - 1]) > 1
            for i, n in enumerate(rule.states[j].name for j in kept):
                saved[n] = _row_of(tensors[key], i) if stack else tensors[key]
                if got_bits == 8:
                    a = tensors["absmax" + key[5:]]
                    saved[n + "_absmax"] = _row_of(a, i) if stack else a
        return dist.load_state_dict_(state, saved)
    state = _fresh(param, spec, hparams, stacks, paged, wide)  # as the optimizer makes it at its first step
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

"""Optimizer specs and state containers.

A state is a NamedTuple of plain tensors. Its class carries the static layout (rule, bits, block size,
format) as a class attribute, so in a pytree the layout is part of the node type (the static context)
and every leaf is a tensor. Classes are made on demand, one per layout, and can be pickled: the module's
``__getattr__`` rebuilds a class from its name.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import threading
from typing import Any

import torch
from torch import Tensor

from bnbf import paged
from bnbf.quant import STATE_FORMATS, quantize_state_reference, zero_code
from bnbf.rules import RULES, get_rule


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimSpec:
    """The static choice of update rule and state storage.

    Args:
        rule: name of a registered rule (``bnbf.RULES``), e.g. ``"adamw"``.
        state_bits: 8 for block-wise quantized state, 32 for float32 state.
        block_size: elements per quantization block (a power of two, 64 to 4096).
        min_8bit_size: tensors with fewer elements keep float32 state even when ``state_bits=8``
            (bitsandbytes' rule; small tensors gain nothing from 8 bits).
        state_format: the 8-bit format (:data:`bnbf.quant.STATE_FORMATS`). ``"power"`` (the default)
            decodes with a few multiplies; ``"dynamic"`` is bitsandbytes' dynamic map, for exchanging
            checkpoints with bitsandbytes.
        paged: keep the state of CUDA tensors of at least :data:`bnbf.paged.PAGED_MIN_NUMEL` elements in
            CUDA managed (unified) memory, which the driver pages between host and GPU (see
            :mod:`bnbf.paged`); ``bnbf.paged.prefetch`` moves it to the GPU ahead of a step. On the CPU it
            changes nothing.
    """

    rule: str = "adamw"
    state_bits: int = 8
    block_size: int = 256
    min_8bit_size: int = 4096
    state_format: str = "power"
    paged: bool = False

    def __post_init__(self):
        get_rule(self.rule)
        if type(self.state_bits) is not int or self.state_bits not in (8, 32):  # 8.0, True: refused as 256.0 is
            raise ValueError(f"state_bits must be 8 or 32, got {self.state_bits!r}")
        bs = self.block_size
        if not isinstance(bs, int) or bs < 64 or bs > 4096 or bs & (bs - 1):
            raise ValueError(f"block_size must be a power of two between 64 and 4096, got {bs!r}")
        if type(self.min_8bit_size) is not int or self.min_8bit_size < 0:  # not a bool
            raise ValueError(f"min_8bit_size must be a non-negative int, got {self.min_8bit_size!r}")
        if self.state_format not in STATE_FORMATS:
            raise ValueError(f"state_format must be one of {STATE_FORMATS}, got {self.state_format!r}")
        if not isinstance(self.paged, bool):
            raise TypeError(f"paged must be a bool, got {self.paged!r}")

    def layout_for(self, numel: int, present: int | None = None) -> Layout:
        """The layout of a tensor with ``numel`` elements under this spec (``present``: bit j set when
        the rule's state slot j is kept; all slots by default)."""
        if present is None:
            present = (1 << len(get_rule(self.rule).states)) - 1
        if self.state_bits == 8 and numel >= self.min_8bit_size:
            return Layout(self.rule, 8, self.block_size, self.state_format, present)
        return Layout(self.rule, 32, 0, "fp32", present)


class Layout(collections.namedtuple("Layout", "rule bits block_size format present")):
    """Static storage of one tensor's state: rule name, 8 or 32 bits, block size, 8-bit format, and which
    of the rule's state slots are kept (bit j for slot j)."""

    __slots__ = ()

    def slots(self):
        """The rule's state slots this layout keeps, in order."""
        return [slot for j, slot in enumerate(get_rule(self.rule).states) if (self.present >> j) & 1]

    @property
    def quantized(self) -> bool:
        return self.bits == 8

    @property
    def class_name(self) -> str:
        full = (1 << len(get_rule(self.rule).states)) - 1
        suffix = "" if self.present == full else f"_s{self.present}"
        if self.quantized:
            return f"{self.rule}_state_8bit_{self.format}_b{self.block_size}{suffix}"
        return f"{self.rule}_state_32bit{suffix}"

    def field_names(self) -> tuple[str, ...]:
        names: list[str] = []
        for slot in self.slots():
            names.append(slot.name)
            if self.quantized:
                names.append(slot.name + "_absmax")
        return tuple(names)

    def expected(self, shape: torch.Size) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Field name -> (shape, dtype) for a param of ``shape``."""
        numel = shape.numel()
        out = {}
        for slot in self.slots():
            if self.quantized:
                out[slot.name] = (tuple(shape), torch.uint8)
                out[slot.name + "_absmax"] = ((-(-numel // self.block_size),), torch.float32)
            else:
                out[slot.name] = (tuple(shape), torch.float32)
        return out


def layout_problem(values: Any) -> str | None:
    """What makes ``values`` a layout no :class:`OptimSpec` makes (None where one does), in the spec's own words:
    the loaders check a checkpoint's layouts, since the kernels take a layout's block size and format as the spec
    checked them."""
    if not (isinstance(values, tuple) and len(values) == 5):
        return f"a layout is (rule, bits, block_size, format, present), got {type(values).__name__}"
    rule, bits, block_size, fmt, present = values
    if tuple(map(type, values[:4])) != (str, int, int, str):
        return f"rule, bits, block size and format of kinds str, int, int, str, got {values!r}"
    try:  # the spec that would make it (its rule, bits, and an 8-bit layout's block size and format) checks them
        eight = {"block_size": block_size, "state_format": fmt} if bits == 8 else {}
        spec = OptimSpec(rule=rule, state_bits=bits, **eight)
    except (ValueError, TypeError) as e:
        return str(e)
    n = len(RULES[rule].states)
    if type(present) is not int or not 0 <= present < 1 << n:
        return f"kept slots {present!r} are not a mask of the {rule} rule's {n} slots"
    made = spec.layout_for(spec.min_8bit_size, present)
    return None if Layout(*values) == made else f"{tuple(values)!r} is not the layout its spec makes, {tuple(made)!r}"


_CLASSES: dict[Layout, type] = {}
_CLASSES_LOCK = threading.Lock()
_NAME = re.compile(r"^(?P<rule>\w+?)_state_(?:8bit_(?P<fmt>[a-z0-9]+)_b(?P<bs>\d+)|32bit)(?:_s(?P<present>\d+))?$")


def state_class(layout: Layout) -> type:
    """The NamedTuple class holding states of ``layout`` (made once, then cached)."""
    cls = _CLASSES.get(layout)
    if cls is None:
        with _CLASSES_LOCK:  # one class per layout, also when threads make their first states at once
            cls = _CLASSES.get(layout)
            if cls is None:
                base = collections.namedtuple(layout.class_name, layout.field_names())
                cls = type(
                    layout.class_name,
                    (base, State),
                    {"__slots__": (), "layout": layout, "__module__": __name__, "__doc__": _doc(layout)},
                )
                _CLASSES[layout] = cls
    return cls


def _doc(layout: Layout) -> str:
    fields = ", ".join(
        f"{n}: {dt} {list(s) if s else 'param.shape'}" for n, (s, dt) in layout.expected(torch.Size([])).items()
    )
    return f"Optimizer state, layout {tuple(layout)}: {fields}"


def _layout_named(name: str) -> Layout | None:
    """The layout a state class name spells (:attr:`Layout.class_name`), unchecked; None where it spells none."""
    m = _NAME.match(name)
    if m is None:
        return None
    rule = RULES.get(m["rule"])  # unknown: no mask (layout_problem names the rule)
    full = 0 if rule is None else (1 << len(rule.states)) - 1
    present = int(m["present"]) if m["present"] else full
    if m["fmt"] is None:
        return Layout(m["rule"], 32, 0, "fp32", present)
    return Layout(m["rule"], 8, int(m["bs"]), m["fmt"], present)


def __getattr__(name: str) -> Any:  # rebuilds pickled state classes
    layout = _layout_named(name)
    if layout is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    get_rule(layout.rule)  # an unknown rule's ValueError
    return state_class(layout)


class State:
    """Base of every state class (a marker: ``isinstance(x, State)``)."""

    __slots__ = ()
    layout: Layout

    def __reduce__(self) -> tuple:
        # pickled as (class name, fields) through one registered function: torch.load's default (weights_only)
        # takes it, where it refuses the classes this module makes by name
        return _rebuild_state, (type(self).layout.class_name, tuple(self))


def _rebuild_state(name: str, fields: tuple) -> State:
    """A pickled state (:meth:`State.__reduce__`): its class rebuilt from its name, which is checked (a layout no
    spec makes is refused before its class is made: the kernels take its block size and format as checked)."""
    layout = _layout_named(name) if isinstance(name, str) else None
    problem = "no state class has this name" if layout is None else layout_problem(layout)
    if problem is not None:
        raise ValueError(f"not a bnbf state: {name!r}: {problem}")
    if not isinstance(fields, tuple) or len(fields) != len(layout.field_names()):
        raise ValueError(f"not a bnbf state: {name!r} with {type(fields).__name__}")
    return state_class(layout)(*fields)


torch.serialization.add_safe_globals([_rebuild_state])


def is_state(x: Any) -> bool:
    """True for a bnbf state NamedTuple."""
    return isinstance(x, State)


def present_mask(rule, hparams: Any) -> int:
    """Bit j set when the rule keeps state slot j under these hyperparameters."""
    return sum(1 << j for j, keep in enumerate(rule.slots_present(hparams)) if keep)


def new_state(param: Tensor, spec: OptimSpec, hparams: Any = None, stacks: tuple | None = None) -> tuple:
    """Initial state for one tensor: each kept slot at the rule's initial value (zero by default).

    ``hparams`` (a mapping or the rule's dataclass) decides which slots are kept and their initial values,
    for rules where that depends on them (SGD's momentum, RMSprop's momentum and centered, Adagrad's
    initial_accumulator_value). With ``spec.paged`` on CUDA (and a large enough tensor) all of the state is
    one managed allocation (:mod:`bnbf.paged`). ``stacks``: as :func:`relaid`'s, made so from the start (no copy).
    """
    rule = get_rule(spec.rule)
    h = rule.make_hparams(hparams)
    layout = spec.layout_for(param.numel(), present_mask(rule, h))
    initial = rule.initial_values(h)
    wide = param.dtype == torch.float64  # the differentiable step's float64 32-bit state (init_state checked)
    fields = _allocate(layout, tuple(param.shape), param.device, stacks, spec.paged, torch.float64 if wide else None)
    for j, slot in enumerate(rule.states):
        if not (layout.present >> j) & 1:
            continue
        codes = fields[slot.name]
        if not layout.quantized:
            codes.fill_(float(initial[j]))
        elif initial[j] == 0:
            codes.fill_(zero_code(layout.format, slot.signed))
            fields[slot.name + "_absmax"].zero_()
        else:  # every block of a constant holds the same code and absmax: one element's, without a float32 copy
            one = torch.full((1,), float(initial[j]), dtype=torch.float32, device=param.device)
            c, a = quantize_state_reference(one, layout.format, slot.signed, layout.block_size)
            codes.fill_(c.reshape(()))
            fields[slot.name + "_absmax"].fill_(a.reshape(()))
    return state_class(layout)(**fields)


def relaid(state: Any, stacks: tuple | None = None, paged_: bool = False) -> Any:
    """A copy of ``state`` (same values) with the fields of each stack as rows of one tensor, and paged as
    :func:`new_state` pages: how ``bnbf_nn`` lays out AdEMAMix's first moments so that bitsandbytes' stacked
    ``state1`` is a live view, and re-pages a state that was unpickled into plain tensors.

    Args:
        state: a bnbf state.
        stacks: tuples of the rule's slot indices, e.g. ``((0, 1), (2,))``: each tuple's fields become the
            rows of one tensor of shape ``(len(tuple), *param.shape)`` (absmax ``(len(tuple), nblocks)``),
            each row starting 256-byte aligned.
        paged_: as ``OptimSpec.paged``.

    Returns:
        The new state.

    Example::

        s2 = relaid(s, stacks=((0, 1), (2,)))  # AdEMAMix's first moments as rows of one tensor
    """
    layout = type(state).layout
    first = state[0]
    # the codes' dtype kept: a differentiable float64 step's 32-bit state is float64 (float32 rows rounded it)
    fields = _allocate(layout, tuple(first.shape), first.device, stacks, paged_, first.dtype)
    with torch.no_grad():
        for name, t in fields.items():
            t.copy_(getattr(state, name))
    return type(state)(**fields)


def stack_groups(layout: Layout, stacks: tuple | None) -> list[list[int]]:
    """The kept state slots of ``layout`` grouped as ``stacks`` lays them out (each group's fields rows of one
    tensor; a slot of its own where ``stacks`` is None); ``ValueError`` unless every kept slot is in one group."""
    rule = get_rule(layout.rule)
    kept = [j for j in range(len(rule.states)) if (layout.present >> j) & 1]
    groups = [[j for j in g if j in kept] for g in (stacks or [(j,) for j in range(len(rule.states))])]
    groups = [g for g in groups if g]
    if sorted(j for g in groups for j in g) != kept:
        raise ValueError(f"stacks {stacks} must hold each of the {rule.name} state slots once")
    return groups


def _allocate(
    layout: Layout,
    shape: tuple,
    device: torch.device,
    stacks: tuple | None,
    paged_: bool,
    code_dtype: torch.dtype | None = None,
) -> dict:
    """Uninitialised fields of a state of ``layout`` for a param of ``shape``: each stack's fields rows of
    one tensor, all of it one managed allocation when paged (CUDA, large enough); ``code_dtype``: the fields'
    dtype where not the layout's (uint8 codes, float32 values)."""
    rule = get_rule(layout.rule)
    groups = stack_groups(layout, stacks)
    numel = int(torch.Size(shape).numel())
    nblocks = -(-numel // max(layout.block_size, 1))
    code_dtype = code_dtype or (torch.uint8 if layout.quantized else torch.float32)
    wants: list[tuple[tuple[int, ...], torch.dtype]] = []
    for g in groups:
        wants.append(_rows_of(len(g), shape, code_dtype))
        if layout.quantized:
            wants.append(_rows_of(len(g), (nblocks,), torch.float32))
    if paged_ and torch.device(device).type == "cuda" and numel >= paged.PAGED_MIN_NUMEL:
        bufs = paged.allocate(wants, device)
    else:
        bufs = [torch.empty(s, dtype=dt, device=device) for s, dt in wants]
    fields: dict[str, Tensor] = {}
    per = 2 if layout.quantized else 1
    for gi, g in enumerate(groups):
        for i, j in enumerate(g):
            name = rule.states[j].name
            fields[name] = _row(bufs[per * gi], i, shape, len(g))
            if layout.quantized:
                fields[name + "_absmax"] = _row(bufs[per * gi + 1], i, (nblocks,), len(g))
    for t in fields.values():
        _mark_static(t)
    return fields


def _mark_static(t: Tensor) -> None:
    """Mark a state field as torch.compile's static input, as Dynamo marks an ``nn.Parameter`` (and torch.optim's
    compiled step its states): an in-place step keeps the field's address, so Inductor need not check its alignment
    at every call, nor CUDA-graph trees copy it. What ``torch._dynamo.mark_static_address(t, guard=False)`` sets
    (torch 2.11 to 2.13; tests/test_func_compile.py checks that Dynamo reads it), set here so that making a state
    does not import Dynamo (~1.4 s)."""
    t._dynamo_static_input_type = "unguarded"


_ROW_ALIGN = 256  # bytes: each row of a stack starts aligned, so the kernels keep their aligned variant


def _rows_of(k: int, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[tuple[int, ...], torch.dtype]:
    """The buffer holding ``k`` stacked fields of ``shape``: one padded row each (the field itself when 1)."""
    if k == 1:
        return shape, dtype
    n, size = max(1, int(torch.Size(shape).numel())), torch.empty((), dtype=dtype).element_size()
    return (k, -(-n * size // _ROW_ALIGN) * _ROW_ALIGN // size), dtype


def _row(buf: Tensor, i: int, shape: tuple[int, ...], k: int) -> Tensor:
    return buf if k == 1 else buf[i, : torch.Size(shape).numel()].view(shape)


def state_nbytes(state: Any) -> int:
    """Bytes held by the tensors of a state, a pytree of states or a packed state; of any pytree of tensors too
    (torch.optim's state, for a comparison)."""
    from torch.utils._pytree import tree_leaves

    from bnbf.packed import PackedState

    if type(state) is PackedState:
        return sum(t.numel() * t.element_size() for t in state.buffers)
    return sum(t.numel() * t.element_size() for t in tree_leaves(state) if isinstance(t, Tensor))

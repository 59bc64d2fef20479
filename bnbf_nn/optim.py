"""torch.optim optimizers with bitsandbytes' class names, arguments, defaults and checkpoint layout.

Every class is a ``torch.optim.Optimizer`` whose ``step`` steps each param group through one
:func:`bnbf.plan` (more only where parameters of a group carry different per-parameter overrides or step
counts); all the math lives in :mod:`bnbf`. ``X``, ``X8bit`` and ``X32bit`` exist for X in Adam, AdamW, Lion,
SGD, RMSprop, Adagrad, LAMB, LARS, AdEMAMix and Adan, generated from one table (:data:`FAMILIES`).

    >>> import torch, bnbf_nn
    >>> model = torch.nn.Linear(64, 64)
    >>> opt = bnbf_nn.AdamW8bit(model.parameters(), lr=1e-3, min_8bit_size=0)
    >>> model(torch.randn(8, 64)).square().mean().backward()
    >>> opt.step()
    >>> opt.state[model.weight]["state"].exp_avg.dtype
    torch.uint8
    >>> opt.state[model.weight]["state1"].data_ptr() == opt.state[model.weight]["state"].exp_avg.data_ptr()
    True

Arguments. Every class takes bitsandbytes' arguments in bitsandbytes' positional order for that class
(``SGD8bit(params, lr, momentum, dampening, weight_decay, nesterov, args, min_8bit_size)``,
``Adam8bit(params, lr, betas, eps, weight_decay, amsgrad, optim_bits, args, min_8bit_size, is_paged)``...:
torch.optim's order for the hyperparameters, then bitsandbytes' storage arguments, which differ between
``X``, ``X8bit`` and ``Paged*``; tests/test_bnb_conformance.py compares every signature with
bitsandbytes'). bnbf's own arguments, and bitsandbytes' that the class of that name lacks there, are
keyword-only after them: ``optim_bits`` (``X8bit``/``X32bit`` keep their bits; bitsandbytes' ``Adam8bit``
default of 32 is accepted and means 8-bit state, as there), ``args``, ``min_8bit_size``, ``max_unorm``
(bnbf's update clipping), ``is_paged``, ``skip_zeros``, ``block_wise`` (accepted; ``False`` is refused
for 8-bit state: bnbf's 8-bit state is block-wise), ``state_format`` (``"power"``, the default, or
``"dynamic"``, bitsandbytes' map), torch.optim's ``maximize``, and the rule's hyperparameters bitsandbytes
lacks (LAMB's ``clamp_value``, LARS' ``trust_coefficient``...). ``args`` is bitsandbytes' config object:
each of its attributes ``optim_bits``, ``min_8bit_size``, ``max_unorm``, ``skip_zeros``, ``block_wise`` and
``percentile_clipping`` (100 only) that it has wins over the argument (not ``is_paged``: bitsandbytes pages by the
argument alone). ``is_paged`` and ``block_wise`` are read as bitsandbytes reads them, by truth value (``1``,
numpy's bools), and refused when neither bool nor integer. The classes of
torch's families (Adam, AdamW, SGD, RMSprop, Adagrad) also take their torch class's ``foreach``
and ``fused``, which change nothing (bnbf's step is one fused launch per group; CPU params run the reference
path) and are refused only in the combinations torch refuses. Every class takes torch's ``capturable`` and
``differentiable`` (keyword-only, False by default). Every setting is checked before the params are read, with
torch's messages where torch has them (tests/test_torch_contract.py runs torch's own optimizer test data
against these classes).

``capturable=True``: as in torch.optim, each param's ``step`` is a 0-d tensor on its device (int64 here) that
the step adds to there, and a tensor ``lr`` (which torch's schedulers ``fill_``) is read on the device, so a
step captured in a CUDA graph and replayed follows the step count and the scheduler. Without it capturing a
step raises (a Python step would replay its captured value). ``differentiable=True``: the group steps through
``bnbf.update_(..., differentiable=True)`` under grad mode, so autograd records the step (derivatives with
respect to the params, the grads and tensor hyperparameters, over several steps); it needs 32-bit state
(``X32bit``, ``optim_bits=32``), and float64 params get float64 state. ``torch.compile(opt.step)`` steps a
group whose settings are all numbers eagerly inside the compiled call (no graph); a group with
``capturable``, ``differentiable`` or a tensor setting is traced, each bucket's ``bnbf.update_`` with the step
counts as 0-d tensors, the bookkeeping (checks, new states) run eagerly before it: no more graphs than
torch.optim's AdamW compiles in the same loop.

Paged optimizers. ``PagedX``, ``PagedX8bit``, ``PagedX32bit`` (X in Adam, AdamW, Lion, AdEMAMix, as in
bitsandbytes) and ``is_paged=True`` on any class keep the state of large CUDA params (bitsandbytes'
threshold: 100k elements) in CUDA managed memory (:mod:`bnbf.paged`), prefetched to the GPU before each
step when it fits; it is freed with the state. On the CPU it changes nothing but a warning (once per
optimizer, as bitsandbytes warns). ``PytorchLARS`` is LARS with
32-bit state and bitsandbytes' defaults for it.

FSDP2. DTensor params (``fully_shard``) are stepped through :mod:`bnbf.distributed`: each rank keeps the
state of its local shard, as DTensors, and steps its shards in one core call per bucket; ``state_dict()``
(which every rank must call) writes the mesh-independent layout, so DCP's ``get_state_dict``/
``set_state_dict`` and plain ``dcp.save``/``dcp.load`` of it load on any mesh, or unsharded
(docs/DESIGN.md, "Beyond one GPU"). AdEMAMix's stacked state is sharded like the others. Paged state,
``capturable``/``differentiable`` steps, a compiled ``step`` of a group with a tensor setting, and norm rules
over sharded params beside params of another process group or unsharded ones raise ``NotImplementedError`` at
step, before anything is written.

Arguments bitsandbytes ignores or refuses are honoured (SGD's ``dampening`` and ``nesterov``, SGD and LARS
without momentum, RMSprop's ``momentum`` and ``centered``, Adagrad's ``lr_decay`` and
``initial_accumulator_value``, Adam's and AdamW's ``amsgrad``, ``max_unorm`` for 8-bit state); ones bnbf has no
rule for (LAMB's ``amsgrad=True`` and ``adam_w_mode=False``, Adan's ``max_grad_norm`` other than 0, also in a param
group, where LAMB's ``bias_correction`` is read as its groups' ``debias``) raise ``NotImplementedError`` instead of
being ignored, also where a hand edit sets them in a live group (at its next step, and in ``get_config``) or a loaded
state dict's group holds them. ``Adam`` is ``torch.optim.Adam`` (L2 weight decay): bitsandbytes' ``Adam`` applies
decoupled decay, so use ``AdamW`` for its behaviour when ``weight_decay > 0``; torch's ``decoupled_weight_decay``
opposite to the class is refused in a param group, where a hand edit sets it too (at the next step).

Settings live in the param groups (``optim_bits``, ``min_8bit_size``, ``state_format``, ``skip_zeros``,
``max_unorm``, ``maximize`` included), so each group may set its own, and :class:`GlobalOptimManager` overrides
them per parameter; ``step`` checks every group's settings, params and grads (memory shared between groups included)
before it steps any group. Settings that decide which states exist may change between steps, as in torch.optim:
with momentum (SGD, RMSprop, LARS) or amsgrad (Adam, AdamW) switched off the state keeps its buffer untouched
(``state_dict`` saves it and loading keeps it), switched on the missing buffer is added at its initial value;
SGD's or LARS's momentum switched on with dampening and RMSprop's centered switched off, where bnbf's step would
differ from torch's, raise ``ValueError``. A param of a dtype bnbf cannot step (float64 but in a differentiable
group, complex, integer) is refused when its group is added. A tensor may appear once
among all groups (torch refuses it in two groups and only warns for twice in one; a group is one fused call,
which would write it twice).

``optimizer.state[p]`` is ``{"step": int, "state": <bnbf state NamedTuple>, "state1": ..., "qmap1": ...,
"absmax1": ..., "state2": ...}`` (``step`` a 0-d int64 tensor with ``capturable=True``, on the param's
device, or ``differentiable=True``, on the CPU): the NamedTuple is what the kernels step, and bitsandbytes' names are
views of the same tensors (made when the state is, so the step does no extra work), which
``bitsandbytes.functional.dequantize_blockwise(A=state1, absmax=absmax1, code=qmap1, blocksize=256)``
reads; AdEMAMix's ``state1``/``absmax1`` stack its two first moments as bitsandbytes' do. A write through
them is a write to the optimizer's state, and the tensors of ``optimizer.state`` count its true bytes
(the 256-value qmaps are one tensor per optimizer, format and device, as bitsandbytes shares one per
optimizer). ``state_dict()`` writes bitsandbytes' layout
(see :mod:`bnbf_nn._checkpoint`) with ``step`` as torch.optim stores it (a float32 tensor, so that
``torch.distributed.checkpoint`` round-trips it; int steps load too) and, as torch.optim, keeps the keys
of ``optimizer.state`` that are not params (not ints, which it reserves for param indices).

bitsandbytes.optim's submodules are here too, importable: ``bnbf_nn.optim.optimizer`` (the bases,
``GlobalOptimManager``, ``MockArgs``), ``bnbf_nn.optim.adamw`` (the AdamW classes)... (tests/test_bnb_conformance.py).

bitsandbytes' public attributes, which code written for its optimizers reads (tests/test_nn_bnb_attrs.py):
``args`` (``optim_bits``, ``min_8bit_size``, ``max_unorm``, ``skip_zeros`` as the constructor resolved them, the
caller's ``args`` winning: a read-only view of ``optimizer.defaults``), ``optimizer_name`` (bitsandbytes' ``"adam"``,
``"momentum"``...; None for Adan), ``initialized`` (True from the first ``step``), ``name2qmap`` and
``fill_qmap()`` (bitsandbytes' ``"dynamic"`` and ``"udynamic"`` maps, filled at construction with 8-bit state or
when a step makes the first 8-bit state; a state's own map is its ``qmap1``..., bnbf's power map by default),
``mng`` (the :class:`GlobalOptimManager`), ``non_castable_tensor_keys`` (the state entries ``load_state_dict``
keeps in their saved dtype) and ``get_config(gindex, pindex, group)`` (a param's settings in bitsandbytes' keys and
spelling with its overrides applied, as the step uses them: an ``lr`` override relative to the group's lr,
LAMB's and LARS's ``max_unorm`` 0, their trust ratio standing for it). A subclass defining one of bitsandbytes'
per-parameter hooks (``get_config``, ``init_state``, ``update_step``...) is refused: a group's step is one fused
call, which would never call it. Absent: those other hooks (``init_state``,
``update_step``, ``to_gpu``, ``check_overrides``, ``prefetch_state``, ``get_state_buffer``), and
``page_mng``, bitsandbytes' GlobalPageManager: bnbf's paged state (:mod:`bnbf.paged`) has no page manager.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import functools
import inspect
import itertools
import math
import numbers
import operator
import os
import sys
import types
import typing
import warnings
from collections import defaultdict
from collections.abc import Mapping
from copy import deepcopy
from typing import Any

import torch
import torch.optim.optimizer as _torch_optimizer
from torch import Tensor

import bnbf
import bnbf.paged
from bnbf import _host_checks
from bnbf._host_checks import NATIVE, _check_grad, _grads_ok, check_update_options, own_dispatch, packed_identities
from bnbf.plan import _checked, not_capturable
from bnbf.rules.base import type_name
from bnbf.state import present_mask, relaid, state_class
from bnbf_nn import _checkpoint
from bnbf_nn.manager import GlobalOptimManager

__all__ = ["FAMILIES", "Family", "GlobalOptimManager", "Optimizer1State", "Optimizer2State", "Optimizer8bit"]

_STORAGE = {"optim_bits": 32, "min_8bit_size": 4096, "state_format": "power"}  # read when a state is created
# in each group: the optimizer and rule, and in a saved group also its starting lr (see state_dict). Live groups hold
# it too: torch.distributed.checkpoint's flatten_optimizer_state_dict loads only the keys the live groups have
_ORIGIN = "bnbf"
_CALL = {"skip_zeros": False, "max_unorm": 0.0, "maximize": False}  # keyword arguments of bnbf.update_
# torch.optim's meanings, on every class: step count and lr on the device (capturable), a step autograd records
_MODES = {"capturable": False, "differentiable": False}
_BNB_GROUP_KEYS = ("betas", "eps", "weight_decay")  # how bitsandbytes' groups spell every optimizer's settings
_BNB_2STATE_KEYS = ("alpha", "t_alpha", "t_beta3")  # in every bitsandbytes two-state group (AdEMAMix's settings)
_STEP = operator.itemgetter("step")
_ABSENT = object()  # a group's value of a key it does not hold (see Optimizer8bit._watched)
_ABSENTS = itertools.repeat(_ABSENT)  # map(group.get, keys, _ABSENTS): each key's value, or _ABSENT
# torch's global step hooks (private to torch.optim.optimizer; absent: torch's wrapper runs every step)
_GLOBAL_HOOKS = tuple(
    getattr(_torch_optimizer, name, None) for name in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")
)


_compiling = torch.compiler.is_compiling  # Dynamo reads it as True while it traces
# Dynamo's eval-frame callback: set while a compiled call runs, also in the frames it runs eagerly (a frame with no
# tensor in it, such as opt.step's), whose callees it then compiles frame by frame; None in plain eager code and in
# torch.compiler.disable'd calls
_callback = getattr(torch._C._dynamo.eval_frame, "get_eval_frame_callback", lambda: None)
_profiling = torch._C._autograd._profiler_enabled


def _plain_step(opt: torch.optim.Optimizer) -> bool:
    """Whether torch's step wrapper would only add its profiler range: no profiler running, no step hooks."""
    return (
        None not in _GLOBAL_HOOKS
        and not any(_GLOBAL_HOOKS)
        and not opt._optimizer_step_pre_hooks
        and not opt._optimizer_step_post_hooks
        and not _profiling()
    )


_STEPPABLE = frozenset({torch.float32, torch.float16, torch.bfloat16})  # param dtypes bnbf's steps take
_GRAD = operator.attrgetter("grad")
_IS_NONE = functools.partial(operator.is_, None)
_NUMBER = frozenset({float, int})
_INT = {int}
_SCALAR = frozenset({float, int, bool, str, type(None)})
_CONSTANT = _SCALAR | {tuple}


def _constant_mark(mark: Any) -> bool:
    """Whether the watched keys' values (:meth:`Optimizer8bit._settings`' mark) cannot change while the group holds
    the same objects: absent, or numbers (a tensor's value may change in place)."""
    marks = mark if type(mark) is tuple else (mark,)
    return all(m is None or m is _ABSENT or _immutable(m) for m in marks)


def _immutable(v: Any) -> bool:
    """A setting that cannot change while the group holds the same object: a number, or a tuple of numbers."""
    return type(v) in _SCALAR or (type(v) is tuple and all(type(x) in _SCALAR for x in v))


@dataclasses.dataclass(frozen=True)
class Family:
    """One row of the class table: an optimizer family, its bnbf rule and bitsandbytes' defaults."""

    name: str  # class name stem: X, X8bit, X32bit
    rule: str  # key of bnbf.RULES
    nstates: int  # bitsandbytes' state tensors: the base class is Optimizer1State or Optimizer2State
    lr: float | None  # default lr; None: required (bitsandbytes' SGD and LARS)
    args: tuple[tuple[str, Any], ...]  # the hyperparameters after lr, bitsandbytes' names and defaults
    max_unorm: float | None = None  # bitsandbytes' default, for the families where it has the argument (else 0)
    bnb_group: tuple[tuple[str, Any], ...] = ()  # bitsandbytes' group key -> our key, or tuple of keys/constants
    bnb_slots: tuple[tuple[int, ...], ...] | None = None  # rule slots in state1, state2... (None: one each)
    renames: tuple[tuple[str, str], ...] = ()  # bitsandbytes' argument -> the rule's hyperparameter
    # torch.optim's implementation switches the torch class of this name takes (besides maximize, which every
    # class has): accepted as torch accepts them, see _check_torch_flags
    torch_flags: tuple[str, ...] = ()
    # bitsandbytes' positional arguments after the hyperparameters (see _bnb_tail): whether its X8bit and
    # X32bit also take optim_bits (and X8bit's default), take ``args``, and take ``is_paged`` (then its Paged*
    # classes exist, which take ``is_paged`` too only where paged_takes_is_paged)
    bnb_bits_arg: bool = False
    bnb_bits8_default: int = 8
    bnb_args: bool = True
    pageable: bool = False
    paged_classes: bool = False
    paged_takes_is_paged: bool = False
    in_bitsandbytes: bool = True  # bitsandbytes.optim has the family's classes (Adan: its authors' arguments)

    def extra_args(self) -> tuple[tuple[str, Any], ...]:
        """The rule's hyperparameters bitsandbytes has no argument for (LAMB's clamp_value...), with the rule's
        defaults: keyword arguments of the classes after bitsandbytes' own."""
        rule = bnbf.RULES[self.rule]
        taken = {"lr"} | {k for k, _ in self.args} | {v for _, v in self.renames}
        return tuple((f.name, f.default) for f in dataclasses.fields(rule.hparams) if f.name not in taken)

    def hparam_of(self, key: str, value: Any, default: Any, who: str, where: str = "") -> str | None:
        """The rule's hyperparameter that the argument ``key`` sets (its rename, or ``key``), or None where the rule
        has no such option and ``value`` is the argument's default; another value raises (``who``: the class, and
        ``where`` the value was given)."""
        rule = bnbf.RULES[self.rule]
        ours = dict(self.renames).get(key, key)
        if ours in {f.name for f in dataclasses.fields(rule.hparams)}:
            return ours
        if not _same(value, default):
            raise NotImplementedError(
                f"{who}: {key}={value!r}{where} is not supported (bnbf's {rule.name!r} rule has no such option)"
            )
        return None


_ADAM = (("betas", (0.9, 0.999)), ("eps", 1e-8), ("weight_decay", 0.0), ("amsgrad", False))
_SGD = (("momentum", 0.0), ("dampening", 0.0), ("weight_decay", 0.0), ("nesterov", False))
_SGD_GROUP = (("betas", ("momentum", "dampening")), ("eps", 0.0))
_TORCH_FLAGS = {"foreach": None, "fused": None, "capturable": False, "differentiable": False}  # torch's defaults
_ADAM_FLAGS = tuple(_TORCH_FLAGS)
_NO_CAPTURABLE = ("foreach", "fused", "differentiable")  # torch's SGD and Adagrad
# bitsandbytes' Adam8bit takes optim_bits=32 (its default, "for compatibility") and keeps 8-bit state
_PAGED_ADAM = dict(
    bnb_bits_arg=True, bnb_bits8_default=32, pageable=True, paged_classes=True, paged_takes_is_paged=True
)

FAMILIES: tuple[Family, ...] = (
    Family("Adam", "adam", 2, 1e-3, _ADAM, torch_flags=_ADAM_FLAGS, **_PAGED_ADAM),
    Family(
        "AdamW",
        "adamw",
        2,
        1e-3,
        _ADAM[:2] + (("weight_decay", 1e-2),) + _ADAM[3:],
        torch_flags=_ADAM_FLAGS,
        **{**_PAGED_ADAM, "paged_takes_is_paged": False},
    ),
    Family(
        "Lion",
        "lion",
        1,
        1e-4,
        (("betas", (0.9, 0.99)), ("weight_decay", 0.0)),
        bnb_group=(("eps", 0.0),),
        pageable=True,
        paged_classes=True,
    ),
    Family("SGD", "sgd", 1, None, _SGD, bnb_group=_SGD_GROUP, torch_flags=_NO_CAPTURABLE),
    Family(
        "RMSprop",
        "rmsprop",
        1,
        1e-2,
        (("alpha", 0.99), ("eps", 1e-8), ("weight_decay", 0.0), ("momentum", 0.0), ("centered", False)),
        bnb_group=(("betas", ("alpha", "momentum")),),
        torch_flags=("foreach", "capturable", "differentiable"),
    ),
    Family(
        "Adagrad",
        "adagrad",
        1,
        1e-2,
        (("lr_decay", 0.0), ("weight_decay", 0.0), ("initial_accumulator_value", 0.0), ("eps", 1e-10)),
        bnb_group=(("betas", (0.0, 0.0)),),
        torch_flags=_NO_CAPTURABLE,
        bnb_bits_arg=True,
    ),
    Family(
        "LAMB",
        "lamb",
        2,
        1e-3,
        (("bias_correction", True),) + _ADAM + (("adam_w_mode", True),),
        max_unorm=1.0,
        renames=(("bias_correction", "debias"),),
    ),
    Family("LARS", "lars", 1, None, _SGD, max_unorm=0.02, bnb_group=_SGD_GROUP),
    Family(
        "AdEMAMix",
        "ademamix",
        2,
        1e-3,
        (
            ("betas", (0.9, 0.999, 0.9999)),
            ("alpha", 5.0),
            ("t_alpha", None),
            ("t_beta3", None),
            ("eps", 1e-8),
            ("weight_decay", 1e-2),
        ),
        bnb_slots=((0, 1), (2,)),
        bnb_args=False,
        pageable=True,
        paged_classes=True,
    ),
    # not in bitsandbytes: the arguments of the authors' Adan (sail-sg/Adan); its global max_grad_norm only at 0
    Family(
        "Adan",
        "adan",
        4,
        1e-3,
        (
            ("betas", (0.98, 0.92, 0.99)),
            ("eps", 1e-8),
            ("weight_decay", 0.0),
            ("max_grad_norm", 0.0),
            ("no_prox", False),
        ),
        torch_flags=("foreach", "fused"),
        pageable=True,  # positional as Lion's, but no Paged* classes (bitsandbytes has no Adan)
        in_bitsandbytes=False,
    ),
)
_BY_NAME = {f.name: f for f in FAMILIES}
# bitsandbytes' optimizer_name (Optimizer1State/2State's first argument) -> family; its "adam" decays decoupled
_BNB_NAMES = {
    "adam": "AdamW",
    "lamb": "LAMB",
    "ademamix": "AdEMAMix",
    "momentum": "SGD",
    "lars": "LARS",
    "rmsprop": "RMSprop",
    "adagrad": "Adagrad",
    "lion": "Lion",
}


def _bnb_name(family: Family) -> str | None:
    """bitsandbytes' ``optimizer_name`` of the family's classes: its key in :data:`_BNB_NAMES`, or the family's own
    name where that is a key (bitsandbytes' Adam steps "adam", as its AdamW); None for Adan (not in bitsandbytes)."""
    return next((k for k, v in _BNB_NAMES.items() if family.name == v or family.name.lower() == k), None)


def _distributed() -> Any:
    """:mod:`bnbf.distributed` (imported where DTensor params are met: it imports torch.distributed.tensor)."""
    import bnbf.distributed

    return bnbf.distributed


def _not_differentiable(opt: Any, gi: int) -> ValueError:
    return ValueError(
        f"{type(opt).__name__}: differentiable=True in param group {gi} needs 32-bit state (optim_bits=32, or a "
        "32-bit class such as AdamW32bit): 8-bit states are rounded to codes, which have no gradient"
    )


def _check_apart(groups: list) -> None:
    """torch's refusal of a param in two groups (add_param_group's), for params lists edited in place since: each
    group is one fused call, so such a param would be stepped twice."""
    seen = set()
    for g in groups:
        ids = set(map(id, g["params"]))
        if not seen.isdisjoint(ids):
            raise ValueError("some parameters appear in more than one parameter group")
        seen |= ids


class _NoState(typing.NamedTuple):
    """The fields of a param without state yet (its first step makes them): none to compare."""


class _Label:
    """A key-path entry printed as it is: the core's messages then name a param as torch's do here."""

    def __init__(self, text: str):
        self.text = text

    def __str__(self) -> str:
        return self.text


def _one_call(job: tuple) -> bool:
    """Whether a prepared group (:meth:`Optimizer8bit._prepare_group`'s tuple) steps in one core call, which checks
    its own leaves before it writes: every param with state and a grad, one bucket, at one step count."""
    _, plan, _, every = job
    return plan.complete and every and len(plan.buckets) == 1 and plan.buckets[0].uniform


def _across_key(jobs: list) -> tuple | None:
    """What :meth:`Optimizer8bit._check_across` found apart, while it holds: the mark of the plan of each bucket this
    step takes (or of its subset with grads, where some params have none: a frozen layer's), which the plans
    confirm before (:meth:`Optimizer8bit._prepare_group`), and the grads' addresses; None where a param has no
    state yet or a subset no plan (no plans to confirm them)."""
    marks, at = [], []
    for _, plan, gs, every in jobs:
        if plan.dist or not any(g is not None for g in gs):  # a group with no grad (frozen) writes nothing
            continue
        if not plan.complete:
            return None
        if every:
            steps = plan.buckets
        elif plan.partial and plan.has_grad == tuple(g is not None for g in gs):
            steps = [sub for _, sub in plan.partial]
        else:
            return None
        if any(b.plan is None for b in steps):
            return None
        marks.extend(b.plan._mark for b in steps)
        present = [g for g in gs if g is not None]
        if not all(map(Tensor.is_contiguous, present)):  # an address alone does not say what a strided grad spans
            return None
        at.append(array.array("Q", map(Tensor.data_ptr, present)).tobytes())
    return tuple(marks), b"".join(at)


def _refuse_shared(names: list, params: list, grads: list, states: list) -> None:
    """The core's refusals of leaves sharing memory (params and states; a grad and a param or state), over the leaves
    of several core calls; ``names``: (group index, index in the group) of each param, for the messages only."""
    if _host_checks._overlap(params, states) is None and _host_checks._grad_overlap(params, grads, states) is None:
        return
    tree = dict(zip(itertools.starmap(_leaf_name, names), params))
    _host_checks._check_no_overlap(tree, params, states)
    _host_checks._check_grads_apart(tree, params, grads, states)


def _leaf_name(gi: int, i: int) -> str:
    """A key by which the core's messages name param ``i`` of param group ``gi`` as bnbf_nn's own do."""
    name = _host_checks.LeafName(f"{gi}.{i}")
    name.keypath = (_Label(f"[{i}] of param group {gi}"),)
    return name


def _check_unique(params: list) -> None:
    if len(set(map(id, params))) != len(params):
        raise ValueError(
            "optimizer contains a parameter group with duplicate parameters (a tensor listed twice): "
            "bnbf steps a group's tensors in one fused call, which would write it twice"
        )


def _check_adam_betas(betas: Any, tensor_refused: bool) -> None:
    """torch.optim.Adam's checks of tensor betas, in its words (a float/Tensor mix; Tensors with foreach)."""
    if not isinstance(betas, tuple | list) or len(betas) != 2:
        return  # the rule's own check names it
    if isinstance(betas[0], Tensor) != isinstance(betas[1], Tensor):
        raise ValueError("betas must be either both floats or both Tensors")
    for i, b in enumerate(betas):
        if isinstance(b, Tensor) and tensor_refused:
            raise ValueError(f"betas[{i}] as a Tensor is not supported for capturable=False and foreach=True")


def _check_adam_lr(settings: Mapping) -> None:
    """torch.optim.Adam's check of a tensor lr, in its words (with foreach, the lr must be a float or capturable)."""
    if isinstance(settings["lr"], Tensor) and settings["foreach"] and not settings["capturable"]:
        raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True")


def _check_torch_flags(settings: Mapping) -> None:
    """torch.optim's implementation switches, where the class has them. bnbf always runs one fused step per
    group (on CPU, the reference path), so ``foreach`` and ``fused`` change nothing and are accepted where
    torch accepts them, ``fused=True`` with CPU params included (torch runs a fused CPU kernel there);
    ``capturable`` and ``differentiable`` (every class has them) are bools with torch's meaning."""
    get = settings.get
    if get("fused") and get("differentiable"):
        raise RuntimeError("`fused` does not support `differentiable`")
    if get("fused") and get("foreach"):
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
    for name in _MODES:
        if not isinstance(get(name, False), bool):
            raise TypeError(f"{name} must be a bool, got {type_name(get(name))}")


def _new_step(step: int, param: Tensor, group: Mapping) -> int | Tensor:
    """A param's step count as a group keeps it: a 0-d int64 tensor on the param's device with capturable=True
    (torch.optim's capturable steps), on the CPU with differentiable=True (torch.optim keeps tensor steps
    there too), else an int."""
    if group["capturable"]:
        return torch.tensor(step, dtype=torch.int64, device=param.device)
    if group["differentiable"]:
        return torch.tensor(step, dtype=torch.int64)
    return step


def _tensor_steps(bucket: Any, capturable: bool) -> None:
    """The bucket's step counts as int64 tensors (ints of states made or loaded before capturable/differentiable
    was set, float tensors set by hand, as torch.optim keeps its steps; once: later steps find them), on the params'
    devices for capturable=True."""
    for r, p in zip(bucket.records, bucket.params):
        step = r["step"]
        if type(step) is int or step.is_floating_point() or (capturable and step.device != p.device):
            _put(r, "step", torch.tensor(int(step), dtype=torch.int64, device=p.device if capturable else "cpu"))


def _lr_value(lr: Any) -> Any:
    """A group's lr as it is now, kept as the starting lr that lr overrides are relative to: a copy of a tensor lr,
    which schedulers change in place (``fill_``; torch's copy their ``initial_lr`` for the same reason); the lr
    tensor itself would follow them, and the override stay at its starting value."""
    return lr.detach().clone() if isinstance(lr, Tensor) else lr


def _detached(v: Any) -> Any:
    """Hyperparameters with tensors detached, for their checks."""
    if isinstance(v, Tensor):
        return v.detach()
    if isinstance(v, dict):
        return {k: _detached(x) for k, x in v.items()}
    if type(v) is tuple:
        return tuple(map(_detached, v))
    return v


def _to_bnb_group(family: Family, group: Mapping) -> dict:
    """bitsandbytes' spelling of a group's settings (``betas`` holds SGD's momentum and dampening...)."""
    spell = dict(family.bnb_group)
    out = {}
    for key in _BNB_GROUP_KEYS:
        how = spell.get(key, key)
        if isinstance(how, tuple):
            out[key] = tuple(group[k] if isinstance(k, str) else k for k in how)
        elif isinstance(how, str):
            if how in group:
                out[key] = group[how]
        else:
            out[key] = how
    return out


def _spelled_value(v: Any) -> tuple | None:
    """A group's value of a bitsandbytes spelling as a tuple (a schedule writes tuples, a checkpoint may hold
    lists), None where it is not a sequence."""
    return tuple(v) if isinstance(v, (tuple, list)) else None


def _same(a: Any, b: Any) -> bool:
    """``a == b`` for settings, False where the comparison has no truth value (tensors of several values)."""
    try:
        return bool(a == b)
    except (TypeError, RuntimeError):
        return False


def _from_bnb_group(family: Family, saved: Mapping, ours: set) -> dict:
    """Our settings that ``saved`` (a bitsandbytes group) only holds in its own spelling."""
    out = {}
    for key, how in family.bnb_group:
        if isinstance(how, tuple) and isinstance(saved.get(key), (tuple, list)):
            out.update({k: v for k, v in zip(how, saved[key]) if isinstance(k, str) and k in ours and k not in saved})
    return out


# override keys of bitsandbytes' docs (the example's is_sparse, its options' percentile_clipping and block_wise) that
# bitsandbytes 0.50 takes and never reads per parameter: the value that changes nothing (any, for is_sparse)
_BNB_UNREAD_OVERRIDES = {"is_sparse": None, "percentile_clipping": 100, "block_wise": True}

# bitsandbytes' Optimizer8bit methods that its step calls per parameter (or per step), which subclasses override
_BNB_HOOKS = frozenset(
    {"get_config", "init_state", "update_step", "check_overrides", "to_gpu", "prefetch_state", "fill_qmap",
     "get_state_buffer"}
)  # fmt: skip


_ARGS = ("optim_bits", "min_8bit_size", "max_unorm", "skip_zeros")  # the attributes of bitsandbytes' args
_BNB_2STATE_DEFAULTS = dict(zip(_BNB_2STATE_KEYS, (0.0, None, None)))  # what bitsandbytes' get_config reads for them


class _Args:
    """bitsandbytes' ``optimizer.args`` (what its ``get_config`` reads ``optim_bits``, ``min_8bit_size``,
    ``max_unorm`` and ``skip_zeros`` from) as a read-only view of the optimizer's ``defaults``: one source of truth,
    the settings its constructor resolved from the arguments and the caller's ``args``, which its groups start with."""

    __slots__ = ("_defaults",)

    def __init__(self, defaults: Mapping) -> None:
        object.__setattr__(self, "_defaults", defaults)

    def __getattr__(self, name: str) -> Any:
        if name in _ARGS:
            return self._defaults[name]
        raise AttributeError(f"optimizer.args has bitsandbytes' attributes {_ARGS}, not {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        # a write here would change nothing: the groups took their settings at construction
        raise AttributeError(
            f"optimizer.args is read-only in bnbf_nn (a view of optimizer.defaults): set {name!r} in the param groups, "
            "or per parameter with GlobalOptimManager.override_config"
        )

    def __reduce__(self) -> tuple:  # copy and pickle make it through __init__ (their default sets the slot)
        return (_Args, (self._defaults,))

    def __repr__(self) -> str:
        return f"args({', '.join(f'{k}={self._defaults[k]!r}' for k in _ARGS)})"


class Optimizer8bit(torch.optim.Optimizer):
    """Base of every bnbf_nn optimizer: a ``torch.optim.Optimizer`` that steps with :func:`bnbf.plan`.

    Args:
        params: an iterable of tensors or of param-group dicts.
        defaults: every group's settings: ``lr`` and the rule's hyperparameters (torch.optim names), plus
            ``optim_bits``, ``min_8bit_size``, ``state_format``, ``skip_zeros``, ``max_unorm`` and ``maximize``.
        optim_bits: 8 or 32 (the default of ``defaults["optim_bits"]``).
        is_paged: keep the state of large CUDA params in CUDA managed memory (:mod:`bnbf.paged`), prefetched
            to the GPU before each step when it fits; on the CPU it changes nothing.
        family: the row of :data:`FAMILIES` (subclasses set it as a class attribute).

    bitsandbytes' public attributes: :attr:`args`, :attr:`optimizer_name`, :attr:`mng`,
    :attr:`non_castable_tensor_keys`, :meth:`get_config`, :meth:`fill_qmap`, ``initialized`` (False until the
    first ``step``) and ``name2qmap`` (bitsandbytes' ``"dynamic"``/``"udynamic"`` maps: filled at construction
    with ``optim_bits=8`` and when the first 8-bit state is made, on its param's device, as bitsandbytes fills it).
    """

    family: Family
    _bnb_ranges = False  # whether the constructor refuses what bitsandbytes' does of its betas (then steps too)
    _in_step = False  # set while a subclass's own step runs, whose wrapper runs torch's step hooks (_outermost)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # a subclass overriding one of bitsandbytes' per-param hooks expects it to be called: bnbf_nn's step is
        # one fused call per group and never calls them, so the override would be ignored silently
        hooks = sorted(_BNB_HOOKS & vars(cls).keys())
        if hooks:
            raise TypeError(
                f"{cls.__name__} defines {hooks}, bitsandbytes' per-parameter hook(s), which bnbf_nn never calls "
                "(its step is one fused call per param group): set per-parameter settings with "
                "GlobalOptimManager.override_config or param groups instead"
            )
        super().__init_subclass__(**kwargs)
        _hook_outermost(cls, vars(cls).get("step"))

    def _patch_step_function(self) -> None:
        # torch wraps the class's step in its hook wrapper here (construction, unpickling) where it is unmarked: a
        # step assigned to the class after it was made (Sub.step = f), which __init_subclass__ never saw, then ran the
        # hooks twice (f calls ours, which runs them too); it gets _outermost, as a step defined in the class body
        _hook_outermost(type(self), type(self).step)
        super()._patch_step_function()

    def __init__(self, params, defaults: dict, optim_bits: int = 32, is_paged: bool = False, *, family=None):
        self.is_paged = _flag(is_paged, "is_paged", type(self).__name__)
        self.family = family or getattr(type(self), "family", None)
        if self.family is None:
            raise TypeError(f"{type(self).__name__} needs a family (use a named optimizer such as AdamW8bit)")
        self._set_rule(defaults)
        self._init_caches()
        defaults = {**_STORAGE, "optim_bits": optim_bits, **_CALL, **_MODES, **defaults}
        # before torch.optim reads params: bad settings say so, whatever params are; nesterov checked as given (torch
        # checks it in the constructor only)
        self._check_group(defaults, as_given=True)
        super().__init__(params, defaults)
        self.state = _checkpoint.States(self.state)
        self.initialized = False
        self.name2qmap: dict[str, Tensor] = {}
        if self.defaults["optim_bits"] == 8:  # as bitsandbytes' constructor
            self.fill_qmap()

    # ---- torch.optim plumbing --------------------------------------------------------------------------

    def _set_rule(self, defaults: Mapping) -> None:
        self._rule = bnbf.RULES[self.family.rule]
        names = (f.name for f in dataclasses.fields(self._rule.hparams))
        self._hkeys = ("lr", *(k for k in names if k in defaults and k != "lr"))
        # what the step checks of a group beside its settings (the storage settings, torch's foreach and fused where
        # the class has them), then what a bucket's settings are made from, the lr last: an edit of any misses the
        # memo (see _settings)
        fixed = (*_STORAGE, *(k for k in ("foreach", "fused") if k in defaults))
        self._seen_keys = (*fixed, *_MODES, *(k for k in self._hkeys if k != "lr"), *_CALL, "lr")
        self._nfixed = len(fixed)
        self._seen = operator.itemgetter(*self._seen_keys)  # a group's values of them, in one C-level call
        # the group keys besides the rule's own that the step reads, which a group need not hold: torch.optim.Adam's
        # decoupled_weight_decay (refused opposite to the class), and the family's arguments that the rule has under
        # another name (LAMB's bias_correction: its groups' debias) or not at all (LAMB's amsgrad and adam_w_mode,
        # Adan's max_grad_norm: taken at one value). Checked where a group is made, added or loaded, and by the step
        # where a hand edit set one (_read_watched); memoized settings hold their values (see _settings)
        adamish = self.family.rule in ("adam", "adamw")
        fields = {f.name for f in dataclasses.fields(self._rule.hparams)}
        renamed = dict(self.family.renames)
        args = tuple(k for k, _ in self.family.args if k in renamed or k not in fields)
        self._watched = (("decoupled_weight_decay",) if adamish else ()) + args
        # how _settings reads them: one key by one dict lookup; several by one C-level test, which finds none
        # held in the usual case (LAMB's three), their values read only where the group holds one
        self._watch = None if not self._watched else self._watched[0] if len(self._watched) == 1 else self._watched
        # bitsandbytes' spellings of this family's settings that are not its own keys (SGD's betas = (momentum,
        # dampening)...): a group holding one is checked against the settings it spells (_check_bnb_spelling;
        # not the constants bitsandbytes never reads, Adagrad's betas and Lion's eps)
        self._bnb_spelled = {
            k: how
            for k, how in self.family.bnb_group
            if k not in self._hkeys and isinstance(how, tuple) and any(isinstance(n, str) for n in how)
        }

    def _init_caches(self) -> None:
        self._plans: dict[int, _Buckets] = {}  # id(group) -> its buckets (each with its bnbf.Plan)
        # id(group) -> (group, the lr it started with) for lr overrides: the group held to tell a dict made later at a
        # freed one's address from it; entries of groups no longer in param_groups go at the next general step
        self._lr0: dict[int, tuple] = {}
        # id(group) -> (group, {bitsandbytes' spelling: its value when it last agreed with the group's settings})
        self._spelled: dict[int, tuple] = {}
        # paged state: the GPU's free bytes before its states were made, by device (see _paged_slices)
        self._paged_free: dict[int, int] = {}
        self._fast: _Fast | None = None  # what the last general step found steppable by _fast_step
        self._across: tuple | None = None  # the last step's leaves and grads checked across its calls (_check_across)
        self._stale: str | None = None  # why the state cannot be stepped (a refused load that wrote into it)
        self._adding: list = []  # (group, bucket, hparams) whose states lack a slot the settings step (_relayout)
        self._qmaps: dict = {}  # the live views' qmaps, this optimizer's own (_checkpoint.qmap)
        # the states and _checkpoint.EDITS that _load_assigned last scanned (it scans again after an edit)
        self._assigned: Any = None
        self._assigned_edits = -1

    def _origin(self) -> dict:
        """A group's :data:`_ORIGIN` entry: which optimizer and rule its state is for."""
        return {"optimizer": type(self).__name__, "rule": self._rule.name}

    def _lr0_of(self, group: Mapping) -> Any:
        """The lr ``group`` started with: for a group added to param_groups by hand, its lr when first read here,
        kept from then on (read anew each time, its later lrs would leave its lr overrides where they started)."""
        entry = self._lr0.get(id(group))
        if entry is None or entry[0] is not group:
            entry = self._lr0[id(group)] = (group, _lr_value(group["lr"]))
        return entry[1]

    def _prune(self) -> None:
        """Drop the cached plans and starting lrs of groups no longer in param_groups (removed by hand): they hold
        the groups' params and states, which torch.optim frees with the group."""
        live = {id(g): g for g in self.param_groups}
        for cache in (self._lr0, self._spelled):
            for key in [k for k, (g, _) in cache.items() if live.get(k) is not g]:
                del cache[key]
        for key in [k for k in self._plans if k not in live]:
            del self._plans[key]

    def __getstate__(self) -> dict:  # what copy.deepcopy and pickle keep (not the cached plans)
        lr0 = [self._lr0_of(g) for g in self.param_groups]
        # each state field as its own tensor, without the views: pickle copies every tensor's whole storage,
        # so views into one stack or one managed block would each carry all of it (__setstate__ relays them)
        state = defaultdict(dict)
        for p, rec in self.state.items():
            if isinstance(p, Tensor) and isinstance(rec, dict) and "state" in rec:
                s = rec["state"]
                rec = {"step": rec["step"], "state": type(s)(*[t.clone() for t in s]), **_checkpoint.users(rec)}
            state[p] = rec
        return {
            "defaults": self.defaults,
            "state": state,
            "param_groups": self.param_groups,
            "family": self.family,
            "is_paged": self.is_paged,
            "initialized": self.initialized,
            "name2qmap": self.name2qmap,
            "_lr0": lr0,
        }

    def __repr__(self) -> str:  # torch's layout, without the groups' bnbf entry (marks of origin, not settings)
        groups = (
            f"\nParameter Group {i}\n"
            + "".join(f"    {k}: {g[k]}\n" for k in sorted(g) if k not in ("params", _ORIGIN))
            for i, g in enumerate(self.param_groups)
        )
        return f"{type(self).__name__} ({''.join(groups)})"

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        lr0 = state.pop("_lr0", [])
        state.setdefault("is_paged", False)  # pickled before paged optimizers existed
        super().__setstate__(state)
        self.state = _checkpoint.States(self.state)
        for group in [self.defaults, *self.param_groups]:  # pickled before a bnbf.update_ option existed
            for key, off in {**_CALL, **_MODES}.items():
                group.setdefault(key, off)
        self._set_rule(self.defaults)
        for group in self.param_groups:  # pickled before live groups held it
            group.setdefault(_ORIGIN, self._origin())
        self._init_caches()
        self._lr0 = {id(g): (g, v) for g, v in zip(self.param_groups, lr0)}
        self._note_spelling()
        stacks = self.family.bnb_slots
        if self.is_paged:  # the unpickled states are in memory already: a lower bound of the free memory before
            self._note_free([p for g in self.param_groups for p in g["params"] if isinstance(p, Tensor)])
        for p, rec in self.state.items():  # as __getstate__ leaves them, or pickled before the views existed
            if isinstance(p, Tensor) and isinstance(rec, dict) and "state" in rec and "state1" not in rec:
                s = rec["state"]
                if stacks or self.is_paged:  # the stacks as rows of one tensor again, paged state paged again
                    s = relaid(s, stacks, self.is_paged)
                _put(
                    self.state, p, _checkpoint.record(rec["step"], s, self.family, self._qmaps, _checkpoint.users(rec))
                )
        if self.is_paged:
            bnbf.paged.seal()
        if "name2qmap" not in state:  # pickled before bitsandbytes' attributes existed: as its steps left them
            self.initialized, self.name2qmap = False, {}
            if self.defaults["optim_bits"] == 8:
                self.fill_qmap()
            for p, rec in self.state.items():
                if isinstance(p, Tensor) and isinstance(rec, dict) and "state" in rec:
                    self.initialized = True
                    self._made(p, rec["state"])

    def add_param_group(self, param_group: dict) -> None:
        """torch.optim's, then bnbf's checks of the group's settings; a tensor listed twice in the group is
        refused (torch only warns: a group is one fused step, which would write it twice). A group given in
        bitsandbytes' spelling only (SGD's ``betas``, no ``momentum``) takes the settings it spells, as a loaded
        bitsandbytes group does, not the optimizer's defaults (which it would then never have agreed with)."""
        spelled = {}
        if isinstance(param_group, dict):  # (torch's TypeError for anything else)
            self._read_args_in_group(param_group)
            spelled = _from_bnb_group(self.family, param_group, set(self._hkeys))
        with warnings.catch_warnings():  # torch's warning for it precedes the error below
            warnings.filterwarnings("ignore", message=".*duplicate parameters", category=UserWarning)
            super().add_param_group(param_group)  # torch refuses a tensor already in another group
        group = self.param_groups[-1]
        try:
            group.update(spelled)
            _check_unique(group["params"])
            self._check_group(group)
            for i, p in enumerate(group["params"]):
                self._check_steppable(group, len(self.param_groups) - 1, i, p)
        except Exception:
            self.param_groups.pop()
            raise
        group[_ORIGIN] = self._origin()
        self._lr0[id(group)] = (group, _lr_value(group["lr"]))
        self._note_group_spelling(group)  # as given: a schedule moving one spelling before its first step is followed

    def _read_args_in_group(self, group: dict) -> None:
        """A group given with one of the class's arguments that groups hold under the rule's name (LAMB's
        ``bias_correction``: ``debias``) or not at all (LAMB's ``amsgrad``, ``adam_w_mode``), read as the
        constructor reads the argument: renamed, or refused at a value the constructor refuses (the step would
        ignore the key)."""
        for key, default in self.family.args:
            if key not in group:
                continue
            ours = self.family.hparam_of(key, group[key], default, type(self).__name__, " in a param group")
            if ours is None or ours == key:
                continue
            if ours in group and not _same(group[ours], group[key]):
                raise ValueError(
                    f"a param group gives {key}={group[key]!r} and {ours}={group[ours]!r}, which "
                    f"{type(self).__name__}'s groups hold as {ours}: give one"
                )
            group[ours] = group.pop(key)

    def _check_group(self, group: Mapping, override: Mapping | None = None, as_given: bool = False) -> None:
        """A group's settings (with a parameter's manager overrides) as bnbf checks them, and torch's switches
        where the family has torch's class (in torch's order and wording where torch checks them); ``as_given``:
        the constructor's arguments, where torch also checks nesterov (see :meth:`_hparams`)."""
        settings = {**group, **(override or {})}
        adamish = self.family.rule in ("adam", "adamw")
        adam = adamish and "foreach" in settings
        if adam:
            _check_adam_lr(settings)
        if adamish:
            self._check_decoupled(settings)
        h = bnbf.hparams_for(self._rule.name, _detached(self._hparams(group, override, as_given)))
        if _host_checks.hparam_tensors(h, None, settings["max_unorm"]):  # a meta or TwoTensor lr: refused here too
            self._check_readable(settings, h, settings["max_unorm"])
        if adam:
            _check_adam_betas(settings["betas"], settings["foreach"] and not settings["capturable"])
        self._spec(group, override)
        if self._bnb_ranges:  # a new state's, before any group steps (_settings checks a made state's)
            _check_bnb_betas(self.family, settings, type(self).__name__)
        check_update_options(self._rule, settings["skip_zeros"], settings["max_unorm"], settings["maximize"])
        _check_torch_flags(settings)

    def _check_torch_settings(self, settings: Mapping) -> None:
        """The checks of :meth:`_check_group` that torch's classes make of their own switches (tensor lr and betas
        with foreach, fused with foreach or differentiable, capturable and differentiable bools), for the step of a
        group whose settings changed since (:meth:`_settings`): the group's other settings are the rule's checks."""
        if self.family.rule in ("adam", "adamw") and "foreach" in settings:
            _check_adam_lr(settings)
            _check_adam_betas(settings["betas"], settings["foreach"] and not settings["capturable"])
        _check_torch_flags(settings)

    def _check_decoupled(self, settings: Mapping) -> None:
        """torch.optim.Adam's and AdamW's ``decoupled_weight_decay``, in a group of the Adam or AdamW classes: torch
        steps by it (AdamW's L2 decay where False), so a value opposite to the class is refused, not ignored."""
        decoupled = self.family.rule == "adamw"
        if settings.get("decoupled_weight_decay", decoupled) != decoupled:
            ours, other = ("AdamW", "Adam") if decoupled else ("Adam", "AdamW")
            raise ValueError(
                f"decoupled_weight_decay={settings['decoupled_weight_decay']!r}: {type(self).__name__} steps {ours}'s "
                f"weight decay only; use the {other} classes (bnbf_nn.{other}, ...8bit, ...32bit) for the other"
            )

    def _read_watched(self, group: dict, where: str | None = None) -> None:
        """The :attr:`_watched` keys the group holds (set by hand since the group was added, or loaded), read as the
        step reads them (:meth:`_watched_settings`); a renamed one (LAMB's ``bias_correction``) is then moved into
        the rule's key (``debias``: the group's value of it is older, this step had dropped it). Nothing is written
        where one is refused."""
        read = self._watched_settings(group, where)
        for key, ours in self.family.renames:
            if ours in read:
                del group[key]
        group.update(read)

    def _watched_settings(self, group: Mapping, where: str | None = None) -> dict:
        """What the step reads from the :attr:`_watched` keys ``group`` holds, refusing as the constructor refuses:
        ``decoupled_weight_decay`` opposite to the class, an argument the rule lacks at another value than its
        one (``NotImplementedError`` naming the key and ``where``, by default the group's index), a renamed one
        checked as the rule's key. Returns the renamed ones under the rule's keys (``{"debias": ...}``)."""
        held = [k for k in self._watched if k in group]
        if not held:
            return {}
        if where is None:
            where = f" in param group {_index_of(self.param_groups, group)}"
        defaults = dict(self.family.args)
        read = {}
        for key in held:
            if key in defaults:
                ours = self.family.hparam_of(key, group[key], defaults[key], type(self).__name__, where)
                if ours is not None:
                    read[ours] = group[key]
        try:
            if "decoupled_weight_decay" in held:
                self._check_decoupled(group)
            if read:
                self._check_group({**group, **read})
        except (TypeError, ValueError) as e:  # the words of a check that names no group
            self._note_where(e, where)
            raise
        return read

    def _note_where(self, e: Exception, where: str) -> None:
        """A check's error in torch's words, which name no group, noted with ``where`` (" in param group 1")."""
        if "param group" not in str(e) and not getattr(e, "__notes__", None):
            e.add_note(f"({where.strip()} of {type(self).__name__})")

    def _spec(self, group: Mapping, override: Mapping | None = None) -> bnbf.OptimSpec:
        """The storage a parameter's state gets: the group's settings, with its manager overrides."""
        storage = {k: (override or {}).get(k, group[k]) for k in _STORAGE}
        bits = _whole(storage["optim_bits"])
        if type(bits) is not int or bits not in (8, 32):  # bnbf_nn's name for the core's state_bits
            raise ValueError(f"optim_bits must be 8 or 32, got {bits!r}")
        return bnbf.OptimSpec(
            rule=self._rule.name,
            state_bits=bits,
            block_size=_checkpoint.BLOCK,
            min_8bit_size=_whole(storage["min_8bit_size"]),
            state_format=storage["state_format"],
            paged=self.is_paged,
        )

    def _hparams(self, group: Mapping, override: Mapping | None = None, as_given: bool = False) -> dict:
        hp = {k: group[k] for k in self._hkeys}
        if override:
            lr = override.get("lr")
            hp.update((k, v) for k, v in override.items() if k in hp)
            # relative to the group's lr (see bnbf_nn.manager); a value that is no number is left to the rule's check,
            # which names it (a str times a float raised Python's words, naming nothing)
            if lr is not None and (type(lr) in _NUMBER or isinstance(lr, (Tensor, numbers.Number))):
                base = group["initial_lr"] if "initial_lr" in group else self._lr0_of(group)
                hp["lr"] = lr * (group["lr"] / base) if isinstance(base, Tensor) or base else lr
        if not as_given and hp.get("nesterov") is True and type(hp["momentum"]) in _NUMBER and hp["momentum"] == 0:
            # torch checks nesterov only in its constructor: a momentum a schedule (or a hand) sets to 0 later steps
            # plainly, where nesterov changes nothing; the core's hyperparameters would refuse the pair
            hp["nesterov"] = False
        return hp

    def _check_steppable(self, group: Mapping, gi: int, i: int, p: Any) -> None:
        """A param of a dtype bnbf steps (float64 only in a differentiable group, whose state is float64 then):
        refused when it joins a group, and before any group steps where it gets its first state (``.data`` may have
        changed its dtype), rather than in the middle of a step."""
        if p.dtype in _STEPPABLE or (p.dtype == torch.float64 and group["differentiable"] is True):
            return
        raise TypeError(
            f"{type(self).__name__} can only optimize float32, float16 and bfloat16 Tensors (float64 ones with "
            f"differentiable=True), but param {i} of param group {gi} is a {p.dtype} Tensor"
        )

    # ---- bitsandbytes' public attributes (none is read by the step) ------------------------------------

    @property
    def args(self) -> _Args:
        """bitsandbytes' ``args``: ``optim_bits``, ``min_8bit_size``, ``max_unorm`` and ``skip_zeros`` as the
        optimizer's ``defaults`` hold them (the arguments, or the caller's ``args`` where it has them), read-only.
        A param's own settings (its group's, its overrides): :meth:`get_config`."""
        return _Args(self.defaults)

    @property
    def optimizer_name(self) -> str | None:
        """bitsandbytes' name of the update (``"adam"``, ``"momentum"``, ``"lion"``...); None for Adan."""
        return _bnb_name(self.family)

    @property
    def mng(self) -> GlobalOptimManager:
        """The :class:`GlobalOptimManager` whose overrides the step reads."""
        return GlobalOptimManager.get_instance()

    @property
    def non_castable_tensor_keys(self) -> frozenset[str]:
        """bitsandbytes' names of the state entries ``load_state_dict`` never casts to the param's dtype (see
        :func:`bnbf_nn._checkpoint.uncast_keys`): this optimizer's ``state{k}``/``qmap{k}``/``absmax{k}`` and
        bitsandbytes' scratch and non-blockwise entries."""
        return _checkpoint.uncast_keys(self._rule, self.family.bnb_slots)

    def fill_qmap(self) -> None:
        """bitsandbytes' 8-bit maps into ``name2qmap``: ``"dynamic"`` (signed) and ``"udynamic"`` (unsigned), 256
        float32 values each (:func:`bnbf.create_dynamic_map`). A state's own map is its ``qmap1``...: bnbf's power
        map unless ``state_format="dynamic"``."""
        self.name2qmap["dynamic"] = bnbf.create_dynamic_map(signed=True)
        self.name2qmap["udynamic"] = bnbf.create_dynamic_map(signed=False)

    def _made(self, p: Tensor, state: Any) -> None:
        """``name2qmap`` as bitsandbytes leaves it after making an 8-bit state: filled, on the param's device."""
        if type(state).layout.quantized:
            if "dynamic" not in self.name2qmap:
                self.fill_qmap()
            for key in ("dynamic", "udynamic"):
                self.name2qmap[key] = self.name2qmap[key].to(p.device)

    def get_config(self, gindex: int, pindex: int, group: Mapping) -> dict:
        """bitsandbytes' config of param ``pindex`` of group ``gindex`` (``group``) as the step uses it: ``betas``,
        ``eps`` and ``weight_decay`` in bitsandbytes' spelling where the rule lacks the key (SGD's ``betas`` =
        (momentum, dampening)...; LARS's ``eps`` is its own), ``lr``, ``alpha``, ``t_alpha``, ``t_beta3``,
        ``optim_bits``, ``min_8bit_size``, ``max_unorm`` and ``skip_zeros``, then every other setting the param's
        :class:`GlobalOptimManager` overrides or the step reads otherwise than given (SGD's ``nesterov`` at momentum
        0); each with the param's overrides applied, through the functions the step reads them with (an ``lr``
        override relative to the lr the group started with, also for a copy of the group). The step never calls it
        (one fused call per group). A group holding a key set by hand that the next step reads (LAMB's
        ``bias_correction`` as its ``debias``, SGD's ``betas`` that a schedule written for bitsandbytes moved as its
        momentum...) is read as that step reads it, writing nothing, and a setting or override the step refuses (a
        key that is not a setting of the class, a value out of range) raises here too, with the step's error.
        ``group`` may lack settings, as bitsandbytes' ``get_config`` takes it (:meth:`_config_group`)."""
        where = f" in param group {gindex}"
        live = self.param_groups[gindex]
        group = self._config_group(group, gindex)
        if self._bnb_spelled and not self._bnb_spelled.keys().isdisjoint(group):  # as _settings reads it first
            moved = self._spelling_read(group, live)[0]
            group = {**group, **moved} if moved else group
        read = self._watched_settings(group, where)
        group = {**group, **read} if read else group
        if group is not live and "initial_lr" not in group:  # a copy: lr overrides are relative to the group's start
            group = {**group, "initial_lr": self._lr0_of(live)}
        p = live["params"][pindex]
        state = self.state.get(p, {}).get("state")
        hp = None
        try:  # the step's own checks: its plan's of the overrides (_plan), then its first state's or made state's
            override = self._checked_overrides(group, [p]).get(id(p), {})
            if state is None:
                self._check_first_state(group, gindex, p, override)
            else:  # as _plan checks each bucket, then _settings (or _mode_settings) the states it steps
                self._check_group(group, override)
                self._check_differentiable(group, [type(state).layout], gindex)
                hp = self._hparams(group, override)
                self._check_not_differentiated(group, hp, {**group, **override}["max_unorm"], [state], gindex)
                h = self._rule.make_hparams(_detached(hp))
                self._check_switch(group, h, type(state).layout.present, present_mask(self._rule, h), gindex)
        except (TypeError, ValueError) as e:
            self._note_where(e, where)
            raise
        spec = self._spec(group, override)
        if hp is None:
            hp = self._hparams(group, override)
        used = {**group, **{k: override.get(k, group[k]) for k in _CALL}, **hp}
        used.update(optim_bits=spec.state_bits, min_8bit_size=spec.min_8bit_size, state_format=spec.state_format)
        # bitsandbytes' spelling of the keys the rule lacks (SGD's betas, Lion's eps); a key the rule has is its own
        # (LARS's eps, which bitsandbytes' LARS holds at 0 and never reads)
        config = {**_to_bnb_group(self.family, used), "lr": used["lr"]}
        config.update((k, used[k]) for k in _BNB_GROUP_KEYS if k in hp)
        # AdEMAMix's settings, in every bitsandbytes two-state group; its one-state groups lack them (RMSprop's
        # alpha is its betas[0] there)
        two = self.family.nstates == 2
        config.update((k, used.get(k, d) if two else d) for k, d in _BNB_2STATE_DEFAULTS.items())
        # then the overridden settings, and those the step reads otherwise than the group or override holds them
        # (SGD's nesterov at momentum 0)
        given = {**group, **override}
        adjusted = [k for k in hp if k != "lr" and hp[k] is not given.get(k)]
        config.update((k, used[k]) for k in (*_ARGS, *override, *adjusted) if k in used)
        return config

    def _config_group(self, group: Mapping, gindex: int) -> Mapping:
        """``group`` as :meth:`get_config` reads it where it lacks settings. bitsandbytes' ``get_config`` reads
        ``lr``, ``betas``, ``eps`` and ``weight_decay`` from the group (``KeyError`` where it lacks one; here one
        naming them) and the others from the optimizer (``args``), or at constants (AdEMAMix's ``alpha``...). Here
        the others are the optimizer's ``defaults``, and the settings the group holds in bitsandbytes' spelling only
        are read from it, as a group given so steps (:meth:`add_param_group`); a key that bitsandbytes' groups hold
        at a constant (SGD's ``eps``) is not needed."""
        missing = [k for k in self.defaults if k not in group]
        if not missing:
            return group
        lacks = []
        for key in ("lr", *_BNB_GROUP_KEYS):
            names = self._bnb_spelled.get(key)
            if key in group or (names is not None and all(n in group for n in names if isinstance(n, str))):
                continue
            if key in self._hkeys:
                lacks.append(repr(key))
            elif names is not None:
                lacks.append(f"{key!r} (or {' and '.join(repr(n) for n in names if isinstance(n, str))})")
        if lacks:
            raise KeyError(
                f"{type(self).__name__}.get_config: the group given for param group {gindex} lacks "
                f"{', '.join(lacks)}, which get_config reads from the group (as bitsandbytes' does); the others "
                "come from the optimizer's settings"
            )
        return {**{k: self.defaults[k] for k in missing}, **group, **_from_bnb_group(self.family, group, set(missing))}

    # ---- step ------------------------------------------------------------------------------------------

    def step(self, *args, **kwargs):
        """One optimizer step for every parameter that has a gradient (``closure``: re-evaluates the model and
        returns the loss, which ``step`` returns)."""
        if self._fast is not None and not args and not kwargs and self._fast_step():
            return None
        if self._stale is not None:  # (never set while _fast is)
            raise RuntimeError(self._stale)
        if self._in_step:  # called by a subclass's step, around which the hooks run (see _outermost)
            return self._step(*args, **kwargs)
        if _plain_step(self):
            out = self._step(*args, **kwargs)
            self._optimizer_step_code()
            return out
        return self._hooked_step(*args, **kwargs)

    # torch.optim.Optimizer wraps an unmarked step in its profile_hook_step, which enters a profiler range on
    # every call (~12 us of host time); this step takes torch's wrapper only where it does something: while a
    # profiler runs or step hooks are registered
    step.hooked = True

    def _step(self, closure=None):  # no torch.no_grad(): a plan's direct launch needs none, its generic path has it
        # torch.compile(opt.step) traces this frame (or resumes into it after _plain_step's profiler check, which
        # Dynamo runs eagerly); torch's hook wrapper, where hooks are registered, is traced around it
        if _compiling():
            return self._traced_step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # every group's settings are checked before any group steps, so that an error (a bad lr in the last
        # group) leaves every param and state as it was
        self._fast = None  # rebuilt below where this step finds every group in the usual case
        jobs = self._prepare_groups()
        self._step_groups(jobs)
        self._fast = self._fast_jobs(jobs)
        return loss

    def _step_groups(self, jobs: list) -> None:
        """The eager step of prepared groups (:meth:`_prepare_group`'s tuples)."""
        self.initialized = True  # bitsandbytes' flag, set by its first step (the fast path follows a step like this)
        if self.is_paged:  # ask the driver to bring paged state to the GPU ahead of the kernels (asynchronous)
            for job in jobs:
                if job[1].ranges and not job[1].slices:
                    bnbf.paged.prefetch(job[1].ranges)
        for job in jobs:
            self._step_group(*job)

    def _fast_step(self) -> bool:
        """The step of the usual case in the least host work, or False (nothing done) where the general
        :meth:`_step` must run. The usual case is what the last general step found (:meth:`_fast_jobs`), still
        so: the same groups, params lists, states and overrides, every param with a grad, the settings those
        of the last step (or only a new number as lr: a schedule), no step hooks, profiler or tracing. Every
        group is checked, and its settings validated, before any steps; then each group is one plan step and
        one write of its params' step counts, as :meth:`_run` does."""
        # first: all that Dynamo traces of this frame. Run eagerly inside a compiled call, leave the step to _step,
        # which Dynamo traces (_traced_step), rather than have the fast path's callees compiled one by one
        if _compiling() or _callback() is not None:
            return False
        fast = self._fast
        groups = self.param_groups
        mng = GlobalOptimManager._instance
        if (
            groups is not fast.groups
            or len(groups) != len(fast.jobs)
            or self.state is not fast.state
            or _checkpoint.EDITS[0] != fast.edits
            or mng is not fast.mng
            or mng.version != fast.version
            or not _plain_step(self)  # step hooks or a profiler: torch's wrapper (_fast_jobs: torch has them)
        ):
            return False
        ready = []
        for group, (kept, params, identities, bucket, records, plan) in zip(groups, fast.jobs):
            if group is not kept or group["params"] is not params or bucket.memo is None:
                return False
            if not _same_params(params, identities):
                return False
            try:  # the memoized check (a schedule's new lr validated), raising first, named as the general step does
                call = self._settings(group, bucket)
            except (TypeError, ValueError) as e:
                self._note_where(e, f" in param group {_index_of(groups, group)}")
                raise
            t = records[0]["step"]
            if bucket.memo is None or type(t) is not int:  # settings checked every step, or tensor step counts
                return False
            # the grads read and checked in one call where the plan can (a direct plan, the extension built)
            try:  # confirms the planned params: one changed since raises, before any group steps
                held = plan._grads_held()
            except (TypeError, ValueError, RuntimeError) as e:
                self._note_group(e, group, bucket)
                raise
            if held is not None:
                ready.append((bucket, records, plan._step_held, held, call, t + 1))
                continue
            grads, every = _grads_of(params)
            if not every:
                return False
            # as _grads_held confirms: a changed param raises before any steps (a lone group's step checks first;
            # with several, every plan's mark must be current for _check_fast_across)
            if ready or len(groups) > 1:
                self._leaves_checked(group, bucket)
            self._check_grads(group, grads, True)  # before any group steps (_grads_held checked the others')
            ready.append((bucket, records, plan.step, grads, call, t + 1))
        if len(ready) > 1:  # the leaves of every group apart, as the general step checks them (kept while unchanged)
            self._check_fast_across(ready)
        # no profiler runs (checked above): torch's _optimizer_step_code, the profiler's entry point, has no reader
        for bucket, records, plan_step, grads, call, t in ready:
            bucket.call = call
            if call[1]:
                plan_step(grads, call[0], t, **call[1])
            else:
                plan_step(grads, call[0], t)
            _set_steps(records, t)
        return True

    def _fast_jobs(self, jobs: list) -> _Fast | None:
        """What :meth:`_fast_step` needs to step these groups again, where each is the usual case: one bucket
        of the whole group (no overrides) with memoized settings (no tensor settings, no capturable or
        differentiable), its plan made, every param with a grad and at one int step count, not DTensors, no
        paged state; else None."""
        out = []
        for group, plan, _, every in jobs:
            if not (every and plan.complete and len(plan.buckets) == 1) or plan.dist or plan.ranges or plan.slices:
                return None
            (bucket,) = plan.buckets
            if not bucket.whole or bucket.memo is None or not bucket.uniform or bucket.plan is None:
                return None
            if type(bucket.records[0]["step"]) is not int:
                return None
            if plan.edits != _checkpoint.EDITS[0]:
                return None
            out.append((group, plan.params, plan.identities, bucket, bucket.records, bucket.plan))
        if None in _GLOBAL_HOOKS:
            return None
        mng = GlobalOptimManager.get_instance()
        return _Fast(self.param_groups, self.state, _checkpoint.EDITS[0], mng, mng.version, tuple(out))

    def _traced_step(self, closure=None):
        """The step as torch.compile traces it. The bookkeeping (checks, new states, buckets) runs eagerly in
        :meth:`_traced_jobs`, which also steps eagerly every group whose settings are all numbers: its step is
        already one fused launch, and tracing it would only add torch's host work for each of its tensors.
        The traced part is each remaining bucket's :func:`bnbf.update_`, for groups with capturable=True,
        differentiable=True or a tensor setting (a tensor lr: a graph input, no recompile), whose step counts
        are 0-d tensors added to in the graph, as torch.optim's compiled steps keep them."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, bucket in self._traced_jobs():
            hp = self._hparams(group, bucket.override)
            kw = {k: bucket.override.get(k, group[k]) for k in _CALL}
            steps = [r["step"] for r in bucket.records]
            torch._foreach_add_(steps, 1)
            grads = [p.grad for p in bucket.params]
            if group["differentiable"]:
                with torch.enable_grad():
                    bnbf.update_(bucket.params, grads, bucket.states, hp, steps[0], differentiable=True, **kw)
                continue
            bnbf.update_(bucket.params, grads, bucket.states, hp, steps[0], **kw)
        return loss

    @torch.compiler.disable
    def _traced_jobs(self) -> list:
        """Eagerly, for :meth:`_traced_step`: every group checked and prepared as an eager step prepares it; the
        groups whose settings are all numbers stepped as the eager step steps them (after every group's checks);
        for each other group, its step counts made 0-d int64 tensors on the params' devices and a (group,
        bucket) pair for each bucket to step in the graph."""
        if self._fast is not None and self._fast_step():  # every group as the last step found them: plain
            return []
        self._fast = None
        jobs, eager = [], []
        for group, plan, grads, every in self._prepare_groups():
            if not (group["capturable"] or group["differentiable"] or self._tensor_settings(group, plan)):
                eager.append((group, plan, grads, every))
                continue
            if plan.complete and every:
                pairs = [(group, b) for b in plan.buckets]
            else:
                pairs = [(group, sub) for _, sub in self._partial(group, grads, plan).partial]
            for g, bucket in pairs:
                if bucket.dist:
                    raise NotImplementedError(
                        f"{type(self).__name__}: torch.compile of step on DTensor params (FSDP2) is not supported"
                    )
                if bucket.call is None:
                    bucket.call = self._settings(g, bucket)
                # 0-d int64 tensors the graph adds to: on the params' devices, but a differentiable (not capturable)
                # step's on the CPU, as its eager step keeps them
                _tensor_steps(bucket, g["capturable"] or not g["differentiable"])
                steps = [int(r["step"]) for r in bucket.records] if not bucket.uniform else ()
                if steps and steps.count(steps[0]) != len(steps):
                    raise NotImplementedError(
                        f"{type(self).__name__}: a compiled step of params at different step counts (some had no "
                        "grad in an earlier step) is not supported; step them eagerly"
                    )
                bucket.uniform = True
                jobs.append((g, bucket))
        self._step_groups(eager)
        if not jobs:  # every group stepped eagerly: the next call may take the fast path
            self._fast = self._fast_jobs(eager)
        return jobs

    def _tensor_settings(self, group: dict, plan: _Buckets) -> bool:
        """Whether some setting of the group, or an override of one of its params, is a tensor."""
        overrides = [v for cfg in plan.configs.values() for k, v in cfg.items() if k not in _STORAGE]
        return any(isinstance(v, Tensor) for v in torch.utils._pytree.tree_leaves((*self._seen(group), *overrides)))

    def _prepare_groups(self) -> list:
        """Every group prepared (:meth:`_prepare_group`), so checked, before any steps; then the state slots that
        settings switched on since the states were made (momentum, amsgrad) added, and the groups prepared again
        over the new states (rare: at a switch)."""
        self._adding = []
        if not _compiling():  # a traced step leaves it to the next eager one (Dynamo cannot trace `is` of dicts)
            self._prune()
            self._load_assigned()  # before any group steps: a bad entry raises with nothing stepped
        kept = [self._plans.get(id(g)) for g in self.param_groups]
        jobs = []
        for gi, group in enumerate(self.param_groups):
            try:
                jobs.append(self._prepare_group(group))
            except (TypeError, ValueError) as e:  # torch's words for a bad setting name no group
                self._note_where(e, f" in param group {gi}")
                raise
        if any(job[1] is not plan for job, plan in zip(jobs, kept)):  # a params list changed since (or new)
            _check_apart(self.param_groups)
        for gi, (group, plan, grads, every) in enumerate(jobs):
            if not plan.dist:
                self._check_grads(group, grads, every)
            elif gi or not _one_call(jobs[0]):  # DTensor grads: one core call checks its own before writing
                try:
                    _distributed().check_grads(group["params"], grads)
                except (TypeError, ValueError, NotImplementedError) as e:
                    raise type(e)(f"param group {gi}: {e}") from None
        if len(jobs) > 1 or not _one_call(jobs[0]):
            self._check_across(jobs)
        if self._adding:  # the states change only now, every group checked
            self._add_slots()
            jobs = [self._prepare_group(group) for group in self.param_groups]
        return jobs

    def _check_grads(self, group: Mapping, grads: list, every: bool) -> None:
        """The error a group's step would raise for a grad it cannot step (sparse, nested, a subclass whose
        storage the kernels cannot address), raised before any group steps or gets its first states, so that
        a bad grad in the last group leaves every param and state as it was. Named by its index in the group."""
        params = group["params"]
        if every:
            ps, gs = params, grads
        else:
            kept = [(p, g) for p, g in zip(params, grads) if g is not None]
            ps, gs = [p for p, _ in kept], [g for _, g in kept]
        # the usual grads (plain, dense, contiguous, their params' shapes, dtypes and devices) in one compiled pass
        if NATIVE is not None and NATIVE.grads_match(ps, gs):
            return
        plain = group["differentiable"] is not True  # a differentiable step runs torch ops, which any subclass has
        if _grads_ok(ps, gs) and not (plain and any(map(own_dispatch, gs))):
            return
        pairs = [(i, p, g) for i, (p, g) in enumerate(zip(params, grads)) if g is not None]
        gi = _index_of(self.param_groups, group)
        for i, p, g in pairs:
            name = f"[{i}] of param group {gi}"
            _check_grad(name, p, g)
            if plain and own_dispatch(g):
                raise TypeError(
                    f"grad{name} is a {type(g).__name__}, a tensor subclass that dispatches on its own: the fused "
                    "step cannot address its storage; pass a plain tensor"
                )

    def _check_no_leaf_stepped(self, group: Mapping, params: list, grads: list) -> None:
        """A differentiable group steps under grad mode, where autograd refuses to write a leaf that requires grad
        (an nn.Parameter) in place: refused before any group steps or counts a step (torch.optim raises as it
        writes it)."""
        for i, (p, g) in enumerate(zip(params, grads)):
            if g is not None:
                where = f"{type(self).__name__}: param {i} of param group {_index_of(self.param_groups, group)}"
                _host_checks.check_leaf_writable(where, p)

    def _prepare_group(self, group: dict) -> tuple:
        """A group's grads and plan, each bucket's validated settings (``bucket.call``), and the settings of
        params that get their first state this step checked; nothing is written."""
        params = group["params"]
        grads, every = _grads_of(params)
        plan = self._plans.get(id(group))
        if plan is None or not plan.valid(self, params):
            plan = self._plan(group)
        if plan.dist:  # FSDP2: what a sharded step cannot do raises here, before anything is written
            self._check_dist(group, plan)
        for bucket in plan.buckets:
            self._check_step_counts(group, bucket)
            bucket.call = self._settings(group, bucket)
            if bucket.plan is not None and plan.complete and every:  # a param changed since: raises before any steps
                self._leaves_checked(group, bucket)
            # checked (and built) before any group steps; a differentiable step takes no plan
            elif bucket.plan is None and plan.complete and every and not group["differentiable"]:
                try:
                    bucket.plan = bucket.make_plan()
                except (TypeError, ValueError) as e:
                    self._note_group(e, group, bucket)
                    raise
        if not (plan.complete and every):
            has_grad = tuple(map(operator.is_not, grads, itertools.repeat(None)))
            if plan.partial and plan.has_grad == has_grad:  # the subsets this step takes, made: checked as above
                subs = [sub for _, sub in plan.partial]
            else:  # a new pattern: its subsets are made when the group steps, their params with state checked now
                keeps = ([k for k, i in enumerate(b.idx) if has_grad[i]] for b in plan.buckets)
                subs = [b.subset(keep) for b, keep in zip(plan.buckets, keeps) if keep]
            for sub in subs:
                if sub.plan is not None:
                    self._leaves_checked(group, sub)
                elif not (sub.dist or group["differentiable"]):  # as making its plan checks them
                    try:
                        _checked(sub.params, sub.states)
                    except (TypeError, ValueError, RuntimeError) as e:
                        self._note_group(e, group, sub)
                        raise
            checked = set()
            gi = _index_of(self.param_groups, group)
            for i, (p, g) in enumerate(zip(params, grads)):
                if g is None or "state" in self.state.get(p, {}):
                    continue
                self._check_steppable(group, gi, i, p)
                self._check_first_state(group, gi, p, plan.configs.get(id(p)), checked)
        if group["differentiable"]:
            self._check_no_leaf_stepped(group, params, grads)
        return group, plan, grads, every

    def _check_first_state(self, group: Mapping, gi: Any, p: Tensor, cfg: Mapping | None, checked=None) -> None:
        """A param's settings (the group's, its overrides ``cfg``) against the state its first step makes, before
        any group steps: 32-bit state where differentiable, the group's checks with ``cfg`` (once per ``cfg`` in
        ``checked``), no tensor setting asking for a derivative of a step that gives none. ``gi``: the group's
        index, for the errors. The step's, and :meth:`get_config`'s for a param without state."""
        layout = self._spec(group, cfg).layout_for(p.numel())
        self._check_differentiable(group, [layout], gi)
        if checked is None or id(cfg) not in checked:
            self._check_group(group, cfg)
            max_unorm = (cfg or {}).get("max_unorm", group["max_unorm"])
            hp = self._hparams(group, cfg)
            self._check_not_differentiated(group, hp, max_unorm, [layout], gi)
            if _host_checks.hparam_tensors(hp, None, max_unorm):
                self._check_readable(group, self._rule.make_hparams(_detached(hp)), max_unorm)
            if checked is not None:
                checked.add(id(cfg))

    def _check_differentiable(self, group: Mapping, layouts: Any, gi: Any = None) -> None:
        """differentiable=True with 8-bit state (``layouts``: of the states stepped or to be made), refused naming
        the group (``gi``, else found by identity)."""
        if group["differentiable"] and any(layout.quantized for layout in layouts):
            raise _not_differentiable(self, _index_of(self.param_groups, group) if gi is None else gi)

    def _leaves_checked(self, group: dict, bucket: _Bucket) -> None:
        """A made plan's params and states checked as its next step checks them (a param given another shape or
        dtype with ``.data =``), so that a param of the last group raises before the first group steps."""
        if bucket.dist:  # bnbf.distributed's plans check their shards when they step
            return
        try:
            bucket.plan._leaves_checked()
        except (TypeError, ValueError, RuntimeError) as e:
            self._note_group(e, group, bucket)
            raise

    def _note_group(self, e: Exception, group: Mapping, bucket: _Bucket) -> None:
        """A bucket's plan's error named in the group: its words count the bucket's params, not the group's."""
        gi = _index_of(self.param_groups, group)
        e.add_note(f"(the index above is a position in {list(bucket.idx)}, param group {gi}'s params this call steps)")

    def _check_step_counts(self, group: dict, bucket: _Bucket) -> None:
        """Each made state's step count as the step reads it: an int >= 0, or a 0-d tensor of one (int32 or int64,
        as capturable or differentiable steps keep it, or floating point, as torch.optim keeps its steps: a whole
        value, the step made int then, see :meth:`_run`); a count set by hand to -3, 0.5, ``torch.tensor(2.5)`` or
        "x" is refused before any group steps. Once per bucket: a hand edit counts in _checkpoint.EDITS, which
        makes the group's buckets again."""
        if bucket.counted:
            return
        for k, r in zip(bucket.idx, bucket.records):
            v = r["step"]
            if type(v) is int and v >= 0:
                continue
            tensor = isinstance(v, Tensor) and v.dim() == 0 and v.device.type != "meta"
            if tensor and v.dtype in (torch.int32, torch.int64):
                if v.device.type != "cpu" or _compiling() or int(v) >= 0:  # a device count is not read
                    continue
            elif tensor and v.is_floating_point():  # read wherever it is (once): 2.5 has no int to step from
                value = v.item()
                if value >= 0 and value.is_integer():
                    continue
            raise ValueError(
                f"{type(self).__name__}: optimizer.state[p]['step'] of param {k} of param group "
                f"{_index_of(self.param_groups, group)} is {v!r}: a step count is a whole number >= 0, an int or a "
                f"0-d tensor (int32 or int64, or floating point as torch.optim keeps it)"
            )
        bucket.counted = True

    def _check_dist(self, group: dict, plan: _Buckets) -> None:
        """A group with DTensor params (FSDP2): refuse what has no sharded implementation (paged state,
        capturable and differentiable steps, whole-tensor norms of params on several process groups)."""
        name = type(self).__name__
        if self.is_paged:
            raise NotImplementedError(f"{name}: paged state (is_paged=True) of DTensor params (FSDP2) is not supported")
        if group["capturable"] or group["differentiable"]:  # before any state is made (_run_modes refuses too)
            raise NotImplementedError(
                f"{name}: capturable=True or differentiable=True on DTensor params (FSDP2) is not supported"
            )
        mus = {group["max_unorm"]} | {c["max_unorm"] for c in plan.configs.values() if "max_unorm" in c}
        for mu in mus:
            _distributed().check_step(group["params"], self._rule, mu)

    def _sync_bnb_spelling(self, group: dict) -> None:
        """A group that holds bitsandbytes' spelling of a setting (SGD's ``betas`` = (momentum, dampening)...:
        loaded from bitsandbytes' checkpoint, or written by a schedule made for its optimizer) steps with the
        spelling that changed since the two last agreed: a schedule cycling ``betas[0]`` (torch's OneCycleLR
        resumed from a bitsandbytes run) moves the momentum, one cycling ``momentum`` moves ``betas``. Where both
        changed, or they never agreed, and they differ: ValueError naming both (else one would be ignored)."""
        moved, agreed = self._spelling_read(group, group)
        group.update(moved)
        self._spelled[id(group)] = (group, agreed)

    def _spelling_read(self, group: Mapping, live: Mapping) -> tuple[dict, dict]:
        """What :meth:`_sync_bnb_spelling` writes into ``group`` (the settings or the spelling that follow the one
        that moved) and the values that then agree, writing nothing; ``live``: the optimizer's group whose last
        agreed values count (``group`` itself, or the group :meth:`get_config` was given a copy of)."""
        want = _to_bnb_group(self.family, group)
        entry = self._spelled.get(id(live))
        agreed = dict(entry[1]) if entry is not None and entry[0] is live else {}
        moved = {}
        for key in sorted(self._bnb_spelled.keys() & group.keys()):
            names, value, last = self._bnb_spelled[key], _spelled_value(group[key]), agreed.get(key)
            if not _same(value, want[key]):
                own = [i for i, n in enumerate(names) if isinstance(n, str)]
                if last is not None and _same(value, last):  # the group's own settings moved: the spelling follows
                    moved[key] = want[key]
                elif (
                    last is not None
                    and value is not None
                    and _same(want[key], last)
                    and len(value) == len(names)
                    and all(_same(value[i], names[i]) for i in range(len(names)) if i not in own)
                ):  # only bitsandbytes' spelling moved: the settings it spells follow
                    moved.update((names[i], value[i]) for i in own)
                else:
                    raise ValueError(
                        f"param group holds bitsandbytes' {key}={group[key]!r}, which for {type(self).__name__} "
                        f"spells {names!r}, but the group's own settings are {want[key]!r}: bnbf_nn steps with "
                        f"torch's names, set those ({', '.join(names[i] for i in own)})"
                    )
            agreed[key] = _spelled_value(moved.get(key, group[key]))
        return moved, agreed

    def _note_spelling(self) -> None:
        """Where a group's bitsandbytes spelling agrees with its settings (a load, an unpickle), the agreed value
        :meth:`_sync_bnb_spelling` tells later changes from."""
        for group in self.param_groups:
            self._note_group_spelling(group)

    def _note_group_spelling(self, group: Mapping) -> None:
        """:meth:`_note_spelling` of one group."""
        if not self._bnb_spelled.keys().isdisjoint(group):
            want = _to_bnb_group(self.family, group)
            agreed = {k: _spelled_value(group[k]) for k in self._bnb_spelled.keys() & group.keys()}
            self._spelled[id(group)] = (group, {k: v for k, v in agreed.items() if _same(v, want[k])})

    def _own_spelling(self, cfg: dict) -> dict:
        """A manager override in bnbf_nn's names: bitsandbytes' spelling of this family's settings (SGD's
        ``betas`` = (momentum, dampening)...) read as bitsandbytes reads it, beside the settings' own names only
        where they agree (ValueError naming both). Keys of bitsandbytes' docs that it never reads per parameter
        (:data:`_BNB_UNREAD_OVERRIDES`) are dropped at the values that change nothing, refused at others."""
        for key in _BNB_UNREAD_OVERRIDES.keys() & cfg.keys():
            keep = _BNB_UNREAD_OVERRIDES[key]
            if keep is not None and not _same(cfg[key], keep):
                raise ValueError(
                    f"GlobalOptimManager override {key}={cfg[key]!r} is not supported by {type(self).__name__} (only "
                    f"{keep!r}, which changes nothing; bitsandbytes 0.50 does not read it per parameter either)"
                )
            cfg = {k: v for k, v in cfg.items() if k != key}
        for key in self._bnb_spelled.keys() & cfg.keys():
            names, value = self._bnb_spelled[key], cfg[key]
            if not isinstance(value, (tuple, list)) or len(value) != len(names):
                raise ValueError(f"GlobalOptimManager override {key}={value!r} must be a pair {names!r}")
            spelled = {n: v for n, v in zip(names, value) if isinstance(n, str)}
            clash = {n: cfg[n] for n in spelled.keys() & cfg.keys() if cfg[n] != spelled[n]}
            if clash:
                raise ValueError(
                    f"GlobalOptimManager override {key}={value!r} spells {names!r} for {type(self).__name__}, "
                    f"but the override also sets {clash!r}"
                )
            cfg = {**{k: v for k, v in cfg.items() if k != key}, **spelled}
        return cfg

    def _overrides(self, params: list) -> dict[int, dict]:
        """``{id(p): overrides}`` of the manager for those of ``params`` that have some, in bnbf_nn's names."""
        return {i: self._own_spelling(cfg) for i, cfg in GlobalOptimManager.get_instance().configs_for(params).items()}

    def _checked_overrides(self, group: Mapping, params: list) -> dict[int, dict]:
        """:meth:`_overrides` of ``params`` (of ``group``), each refused as the step refuses it: a key that is not a
        setting of this class, storage settings no state could be made with. The step's reading (:meth:`_plan`) and
        :meth:`get_config`'s, so that the two refuse alike."""
        configs = self._overrides(params)
        allowed = set(self._hkeys) | set(_STORAGE) | set(_CALL)
        for i, p in enumerate(params):
            cfg = configs.get(id(p), {})
            unknown = sorted(set(cfg) - allowed)
            if unknown:
                # bitsandbytes ignores these per param (they are its optimizer's); say so rather than "not a setting"
                own = sorted({"is_paged", "args"} & set(unknown))
                hint = f" ({own}: arguments of the optimizer as a whole, not per-parameter settings)" if own else ""
                raise ValueError(
                    f"GlobalOptimManager override {unknown} is not a setting of {type(self).__name__}{hint}; "
                    f"known: {sorted(allowed)}"
                )
            if not cfg.keys().isdisjoint(_STORAGE):  # buckets leave storage out (a made state's is fixed): each checked
                try:
                    self._spec(group, cfg)
                except (TypeError, ValueError) as e:
                    where = f"param {i} in param group {_index_of(self.param_groups, group)}"
                    e.add_note(f"(GlobalOptimManager's override {cfg} of {where} of {type(self).__name__})")
                    raise
        return configs

    def _watched_mark(self, group: Mapping) -> Any:
        """The group's values of the :attr:`_watched` keys, which memoized settings hold (see :meth:`_settings`):
        None where the class watches none, ``_ABSENT`` where the group holds none; one key's value by one dict
        lookup, several keys' as a tuple after one C-level test (which finds none held in the usual case)."""
        watch = self._watch
        if watch is None:
            return None
        if type(watch) is str:
            return group.get(watch, _ABSENT)
        return _ABSENT if group.keys().isdisjoint(watch) else tuple(map(group.get, watch, _ABSENTS))

    def _settings(self, group: dict, bucket: _Bucket) -> tuple[Any, dict]:
        """A bucket's hyperparameters, validated into the rule's dataclass (which the bucket's plan then takes
        as it is: the check costs nothing extra), and the step's keywords. The last step's, where the group
        holds the very objects it was made from (numbers and tuples of them, which cannot change in place);
        where only the lr is another number (a schedule), the last step's with the new lr validated."""
        if self._bnb_spelled and not self._bnb_spelled.keys().isdisjoint(group):
            self._sync_bnb_spelling(group)
        mark = self._watched_mark(group)  # so that a hand edit of a watched key is read at this step
        seen = self._seen(group)
        memo = bucket.memo
        # several keys' values are a new tuple at each read: the very same objects as the memo's (none edited)
        if memo is not None and (
            mark is memo[2]
            or (type(mark) is tuple and type(memo[2]) is tuple and all(map(operator.is_, mark, memo[2])))
        ):
            if all(map(operator.is_, seen, memo[0])):
                return memo[1]
            if type(seen[-1]) in _NUMBER and all(map(operator.is_, seen[:-1], memo[0][:-1])):
                # only the lr changed (a schedule): the last step's dataclass made again with it runs its checks
                # (3.3 against 8.5 us for remaking it from the group's mapping, CPU)
                call = (dataclasses.replace(memo[1][0], lr=seen[-1]), memo[1][1])
                bucket.memo = (seen, call, mark)
                return call
        bucket.memo = None
        if mark is not None and mark is not _ABSENT:
            self._read_watched(group)
            mark = self._watched_mark(group)
            seen = self._seen(group)
        # the storage settings written into the group later (optim_bits=7; made states keep theirs) and torch's own
        # refusals of its switches, as a plan's making checks them: again where the group's values changed since they
        # passed (a bucket's overrides are fixed; a tensor edited in place keeps its type, all these checks read)
        if bucket.checked is None or not all(map(operator.is_, seen, bucket.checked)):
            self._spec(group)
            self._check_torch_settings({**group, **bucket.override} if bucket.override else group)
            bucket.checked = seen
        if self._bnb_ranges:  # what the constructor refuses, written into the group (or an override) later
            _check_bnb_betas(self.family, {**group, **bucket.override}, type(self).__name__)
        if group["capturable"] or group["differentiable"]:
            return self._mode_settings(group, bucket)
        override = bucket.override
        hp = self._hparams(group, override)
        kw = {}
        for key, off in _CALL.items():
            v = override.get(key, group[key])
            if isinstance(v, Tensor) or v != off:  # no host sync for a tensor setting
                kw[key] = v
        # the group's settings and the overrides numbers (or tuples of them): no tensor a derivative is asked of
        settings = seen[self._nfixed :]  # (not the storage settings and torch's switches, which the call never reads)
        numbers = set(map(type, settings)) <= _CONSTANT and all(map(_immutable, (*settings, *override.values())))
        if not numbers:
            self._check_not_differentiated(group, hp, kw.get("max_unorm"), bucket.states)
        h = self._rule.make_hparams(hp)
        if not numbers:
            self._check_readable(group, h, kw.get("max_unorm", 0.0))
        check_update_options(
            self._rule, kw.get("skip_zeros", False), kw.get("max_unorm", 0.0), kw.get("maximize", False)
        )
        if present_mask(self._rule, h) != bucket.present:  # momentum or amsgrad switched since the states were made
            self._relayout(group, bucket, h)
            # not memoized: the fast step holds the bucket's old plan; the next step's checks memoize the new layout
            return h, kw
        if not override and numbers and _constant_mark(mark):
            bucket.memo = (seen, (h, kw), mark)  # a tensor may change in place: such settings are checked every step
        return h, kw

    def _check_not_differentiated(
        self, group: Mapping, hp: Mapping, max_unorm: Any, states: list, gi: Any = None
    ) -> None:
        """A tensor setting that asks for a derivative (a tensor lr that requires grad, in grad mode) in a group
        whose step is not differentiable: the core's refusal (:func:`check_not_differentiated`, which the step
        would raise naming ``bnbf.update_``, after the groups before it stepped), raised before any group steps and
        naming this class's option. Read only where a group's settings are (tensors are never memoized). ``gi``: the
        group's index (else found by identity)."""
        if group["differentiable"]:
            return
        found = [t for _, t in _host_checks.hparam_tensors(hp, None, max_unorm)]
        if found and _host_checks.differentiated(found):
            gi = _index_of(self.param_groups, group) if gi is None else gi
            where = f"{type(self).__name__} (as its argument, or in param group {gi})"
            ask = (where, f"optim_bits=32, or {self.family.name}32bit")
            _host_checks.check_not_differentiated(None, [], [], hp, None, max_unorm, states, in_place=True, ask=ask)

    def _check_across(self, jobs: list) -> None:
        """What each core call checks of its own leaves, over every call of the step, before the first writes: a
        later call's refusal must find nothing stepped, and memory shared between calls would be stepped twice (a
        view of another group's param, a grad that is another group's param or state). Params getting their first
        state are checked as the core would check them. DTensor groups (checked by bnbf.distributed's calls on
        their shards) and subclasses with their own dispatch (no addresses to compare) are left to their calls.
        Kept while every bucket's plan holds its mark (the same leaves) and the grads their addresses."""
        key = _across_key(jobs)
        if key is not None and key == self._across:
            return
        names, params, grads, states = [], [], [], []
        for gi, (group, plan, gs, _every) in enumerate(jobs):
            if plan.dist:
                continue
            state_of = {i: st for b in plan.buckets for i, st in zip(b.idx, b.states)}
            for i, (p, g) in enumerate(zip(group["params"], gs)):
                if g is None:
                    continue
                names.append((gi, i))
                params.append(p)
                grads.append(g)
                st = state_of.get(i)
                if st is None:
                    _host_checks._check_param(p, f"[{i}] of param group {gi}", wide=group["differentiable"] is True)
                    st = _NoState()
                states.append(st)
        if not params or _host_checks.unaddressable(params, grads):
            return
        tree = dict(zip(itertools.starmap(_leaf_name, names), params))
        _host_checks._check_writable(tree, params, states, pure="bnbf.update")
        _refuse_shared(names, params, grads, states)
        self._across = key

    def _check_fast_across(self, ready: list) -> None:
        """:meth:`_check_across` for the fast step's groups (``ready``: one entry per group, each (bucket, records,
        step function, the grads as ``Plan._grads_held`` found them or a list, ...), every plan confirmed), with the
        same key: each plan's mark (a param's ``.data`` or a state field changed since makes a new one) and the
        grads' addresses (held grads are contiguous, of their params' shapes; a list with a strided grad is checked
        every step)."""
        at = []
        for bucket, _, _, held, *_ in ready:
            if held is True:
                at.append(bucket.plan._grad_at)
            elif type(held) is tuple:
                at.append(held[1])
            elif all(map(Tensor.is_contiguous, held)):
                at.append(array.array("Q", map(Tensor.data_ptr, held)).tobytes())
            else:
                at = None
                break
        key = None if at is None else (tuple(r[0].plan._mark for r in ready), b"".join(at))
        if key is not None and key == self._across:
            return
        params, states, names = [], [], []
        for gi, (bucket, *_) in enumerate(ready):
            params.extend(bucket.params)
            states.extend(bucket.states)
            names.extend((gi, i) for i in bucket.idx)
        _refuse_shared(names, params, [p.grad for p in params], states)
        self._across = key

    def _check_readable(self, group: Mapping, h: Any, max_unorm: Any) -> None:
        """A tensor setting the step cannot read, refused before any group steps (the core's call refuses it only
        after the groups before it stepped): a meta tensor, which has no value, and outside a differentiable step
        a subclass with its own dispatch (TwoTensor), whose memory the kernels would read as its value."""
        found = _host_checks.hparam_tensors(h, None, max_unorm)
        if any(t.device.type == "meta" for _, t in found):
            _host_checks.check_hparam_values(self._rule.scalars(h, 1), h, max_unorm)
        if not group["differentiable"]:
            _host_checks.check_scalars_plain(h, None, max_unorm)

    def _mode_settings(self, group: dict, bucket: _Bucket) -> tuple[Any, dict]:
        """:meth:`_settings` of a group with capturable=True or differentiable=True (which :meth:`_run_modes`
        steps, its step counts made tensors there): the hyperparameters checked on detached values (reading a
        tensor that requires grad warns), and for a differentiable step the mapping with the caller's tensors, so
        that derivatives reach them."""
        self._check_differentiable(group, (type(s).layout for s in bucket.states))
        override = bucket.override
        hp = self._hparams(group, override)
        kw = {k: override.get(k, group[k]) for k in _CALL}
        self._check_not_differentiated(group, hp, kw["max_unorm"], bucket.states)
        h = self._rule.make_hparams(_detached(hp))
        check_update_options(self._rule, kw["skip_zeros"], kw["max_unorm"], kw["maximize"])
        self._check_readable(group, h, kw["max_unorm"])
        if present_mask(self._rule, h) != bucket.present:  # momentum or amsgrad switched: as in _settings
            self._relayout(group, bucket, h)
        if not group["differentiable"]:
            return self._rule.make_hparams(hp), kw
        return hp, kw

    def _relayout(self, group: dict, bucket: _Bucket, h: Any) -> None:
        """A bucket whose states keep other state slots than the settings ``h`` step (momentum or amsgrad switched
        since they were made). A slot the settings do not step stays in the state untouched, as torch.optim leaves an
        unused momentum buffer: the bucket steps states of the settings' layout whose fields are the kept tensors
        themselves. A slot they step that a state lacks is added at its initial value once every group is checked
        (:meth:`_add_slots`). Where either would step otherwise than torch.optim, ValueError (nothing changed)."""
        want = present_mask(self._rule, h)
        haves = {type(r["state"]).layout.present for r in bucket.records}
        for have in haves:
            self._check_switch(group, h, have, want)
        if any(want & ~have for have in haves):
            self._adding.append((group, bucket, h))
            return
        states = []
        for r in bucket.records:
            s = r["state"]
            layout = type(s).layout
            if layout.present != want:
                cls = state_class(layout._replace(present=want))
                s = cls._make(getattr(s, name) for name in cls._fields)
            states.append(s)
        bucket.states, bucket.present, bucket.plan = states, want, None
        plan = self._plans.get(id(group))
        if plan is not None:  # its cached subsets (of params with grads, of paged state's slices) hold the old states
            plan.has_grad = ()
            if plan.slices:
                plan.slices = self._paged_slices(plan)

    def _check_switch(self, group: Mapping, h: Any, have: int, want: int, gi: Any = None) -> None:
        """Refuse the switches of settings after which bnbf's step would differ from torch.optim's: SGD's and LARS'
        momentum switched on with dampening (torch starts the new buffer as the direction itself, bnbf's kept-slot
        step from a zero buffer gives (1 - dampening) times it), RMSprop's centered switched off (bnbf keeps the
        centered variance in square_avg, which a plain step would read as the mean square). ``gi``: the group's
        index (else found by identity)."""
        rule, name = self._rule.name, type(self).__name__
        where = f"{name}: param group {_index_of(self.param_groups, group) if gi is None else gi}"
        if rule in ("sgd", "lars") and want & ~have & 1:
            damp = h.dampening.item() if isinstance(h.dampening, Tensor) else h.dampening
            if damp != 0:
                raise ValueError(
                    f"{where}'s momentum changed from 0 to {h.momentum} after its states were made without a "
                    f"momentum buffer: torch.optim starts the new buffer as the step's direction, where bnbf's step "
                    f"would start it at (1 - dampening) times that with dampening={damp}. Set dampening to 0 for the "
                    f"step that switches momentum on (then back), or clear the state (optimizer.state[p].clear())"
                )
        if rule == "rmsprop" and have & ~want & 4:
            raise ValueError(
                f"{where}'s centered changed from True to False after its states were made: bnbf keeps the centered "
                f"variance (square_avg - grad_avg²) in the square_avg slot, which a step without centered would read "
                f"as torch's square_avg. Keep centered=True, or clear the state (optimizer.state[p].clear())"
            )

    def _add_slots(self) -> None:
        """The state slots that :meth:`_relayout` found missing (momentum or amsgrad switched on), each at its
        initial value (as :func:`bnbf.init_state` makes it), in the params' records: the state keeps its own slots'
        tensors (values, format and bits), and bitsandbytes' names follow (state2, state3...). The groups' plans are
        made again."""
        for group, bucket, h in self._adding:
            want = present_mask(self._rule, h)
            for r, p in zip(bucket.records, bucket.params):
                s = r["state"]
                layout = type(s).layout
                if not want & ~layout.present:
                    continue
                spec = bnbf.OptimSpec(
                    rule=self._rule.name,
                    state_bits=layout.bits,
                    block_size=layout.block_size or _checkpoint.BLOCK,
                    min_8bit_size=0,
                    state_format=layout.format if layout.quantized else "power",
                    paged=self.is_paged,
                )
                hu = _checkpoint.with_slots(self._rule, h, layout.present | want)
                wide = p.dtype == torch.float64 and group["differentiable"] is True
                fresh = _checkpoint.new_state(p, spec, hu, self.family, wide)
                if self.is_paged or self.family.bnb_slots or _checkpoint.is_dtensor(p):
                    # one allocation (paged, stacked) or shards: the kept values copied into the new state, bit for bit
                    with torch.no_grad():
                        for name in s._fields:
                            getattr(fresh, name).copy_(getattr(s, name))
                    new = fresh
                else:  # the kept slots' tensors themselves, so their views stay live
                    kept = s._asdict()
                    new = type(fresh)._make(kept.get(n, t) for n, t in zip(fresh._fields, fresh))
                _put(r, "state", new)
                for key, view in _checkpoint.named(new, self.family.bnb_slots, self._qmaps).items():
                    _put(r, key, view)
            self._plans.pop(id(group), None)
        self._adding = []

    def _step_group(self, group: dict, plan: _Buckets, grads: list, every: bool) -> None:
        if plan.slices and plan.complete and every:  # paged state larger than the GPU's free memory
            for bucket, slices in zip(plan.buckets, plan.slices):
                for sub, ranges in slices:
                    bnbf.paged.prefetch(ranges, force=True)
                    self._run(group, sub, [grads[i] for i in sub.idx], bucket.call)
            return
        if plan.complete and every:
            for bucket in plan.buckets:
                self._run(group, bucket, grads if bucket.whole else [grads[i] for i in bucket.idx], bucket.call)
            return
        for bucket, sub in self._partial(group, grads, plan).partial:
            # a plan rebuilt for new states has buckets the checks above did not see: same settings, checked
            call = bucket.call if bucket.call is not None else self._settings(group, bucket)
            self._run(group, sub, [grads[i] for i in sub.idx], call)
            bucket.uniform = bucket.uniform and len(sub.idx) == len(bucket.idx)

    def _partial(self, group: dict, grads: list, plan: _Buckets) -> _Buckets:
        """The plan with ``partial`` for this step's grads: some params have no grad (frozen, or unused this
        step), so each bucket steps its subset with grads; kept in the plan while the pattern repeats (a frozen
        layer's every step). States are made first for params with a first grad (the plan may be rebuilt)."""
        has_grad = tuple(map(operator.is_not, grads, itertools.repeat(None)))
        if plan.has_grad != has_grad:
            plan = self._create_states(group, grads, plan)
            plan.has_grad = has_grad
            plan.partial = []
            for bucket in plan.buckets:
                keep = [k for k, i in enumerate(bucket.idx) if has_grad[i]]
                if keep:
                    plan.partial.append((bucket, bucket.subset(keep)))
        return plan

    def _run(self, group: dict, bucket: _Bucket, grads: list, call: tuple[Any, dict]) -> None:
        records = bucket.records
        t = records[0]["step"]
        # capturable=True or differentiable=True, or tensor step counts (set by hand, or kept from such a step): the
        # counts are made what the group keeps there, only now that every group is checked
        if type(t) is not int or group["capturable"] or group["differentiable"]:
            self._run_modes(group, bucket, grads, call)
            return
        if not bucket.uniform:
            steps = list(map(_STEP, records))
            if set(map(type, steps)) != _INT:  # another param's count a tensor (set by hand): as the first's would be
                self._run_modes(group, bucket, grads, call)
                return
            if steps.count(t) != len(records):  # params of the group out of step: split
                by_step: dict[int, list[int]] = defaultdict(list)
                for k, r in enumerate(records):
                    by_step[r["step"]].append(k)
                update_ = _distributed().update_ if bucket.dist else bnbf.update_
                for keep in by_step.values():  # rare: bnbf.update_'s cached plans, not one kept per split
                    sub = bucket.subset(keep)
                    update_(
                        sub.params, [grads[k] for k in keep], sub.states, call[0], sub.records[0]["step"] + 1, **call[1]
                    )
                    for r in sub.records:
                        _put(r, "step", r["step"] + 1)
                return
            bucket.uniform = True  # until a step leaves some of its params out
        if bucket.plan is None:
            bucket.plan = bucket.make_plan()
        bucket.plan.step(grads, call[0], t + 1, **call[1])
        _set_steps(records, t + 1)

    def _run_modes(self, group: dict, bucket: _Bucket, grads: list, call: tuple[Any, dict]) -> None:
        """A bucket's step with capturable=True (step counts as 0-d int64 tensors on the params' device, added
        to there, and the group's lr as it is: a tensor lr is read on the device, so a captured step replays
        with the current step and lr) or differentiable=True (:func:`bnbf.update_`'s differentiable step under
        grad mode)."""
        records = bucket.records
        capturable = group["capturable"]
        if not (capturable or group["differentiable"]):  # tensor steps of a group that turned both off (or of
            for r in records:  # compiled steps, or set by hand): ints again, one read each
                _put(r, "step", int(r["step"]))
            self._run(group, bucket, grads, call)
            return
        if bucket.dist:
            raise NotImplementedError(
                f"{type(self).__name__}: capturable=True or differentiable=True on DTensor params (FSDP2) is not "
                "supported"
            )
        _tensor_steps(bucket, capturable)
        steps = list(map(_STEP, records))
        if not bucket.uniform:
            if capturable and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise not_capturable(
                    "the params of this group may be at different steps (some had no grad in an earlier step): "
                    "run a step with every grad before capturing"
                )
            at = [int(s) for s in steps]  # reads device steps: only until the bucket is known to be uniform
            if at.count(at[0]) != len(at):  # params of the group out of step: each step count on its own
                for value in dict.fromkeys(at):
                    keep = [k for k, v in enumerate(at) if v == value]
                    sub = bucket.subset(keep)
                    sub.uniform = True
                    self._run_modes(group, sub, [grads[k] for k in keep], call)
                return
            bucket.uniform = True
        h, kw = call
        torch._foreach_add_(steps, 1)  # one launch for the bucket, as torch.optim's capturable steps
        if group["differentiable"]:
            # a CPU step as the int it holds: a number, not a CPU tensor that each scalar derived from it would
            # copy to the params' device
            step = steps[0] if capturable else int(steps[0])
            with torch.enable_grad():  # torch.optim steps a differentiable group under grad mode too
                bnbf.update_(bucket.params, grads, bucket.states, h, step, differentiable=True, **kw)
            return
        if bucket.plan is None:
            bucket.plan = bucket.make_plan()
        bucket.plan.step(grads, h, steps[0], **kw)

    def _plan(self, group: dict) -> _Buckets:
        """Group the parameters that have state by their overrides: one bnbf plan each."""
        mng = GlobalOptimManager.get_instance()
        params = group["params"]
        _check_unique(params)  # also for a params list edited in place after add_param_group
        if type(self.state) is not _checkpoint.States:  # replaced by a plain dict: its edits must count too
            self.state = _checkpoint.States(self.state)
        edits = _checkpoint.EDITS[0]
        configs = self._checked_overrides(group, params)
        buckets: dict[tuple, list[int]] = {}
        for i, p in enumerate(params):
            cfg = configs.get(id(p), {})
            if "state" in self.state.get(p, {}):
                key = tuple(sorted((k, repr(v)) for k, v in cfg.items() if k not in _STORAGE))
                buckets.setdefault(key, []).append(i)
        made = []
        for idx in buckets.values():  # every bucket checked before any steps: no half-applied step
            self._check_group(group, configs.get(id(params[idx[0]]), {}))
            cfg = {k: v for k, v in configs.get(id(params[idx[0]]), {}).items() if k not in _STORAGE}
            made.append(
                _Bucket(
                    idx, [params[i] for i in idx], [self.state[params[i]] for i in idx], cfg, len(idx) == len(params)
                )
            )
        complete = sum(map(len, buckets.values())) == len(params)
        plan = _Buckets(params, self.state, mng.version, _identities(params), edits, made, complete, configs)
        plan.dist = any(map(_checkpoint.is_dtensor, params))
        if self.is_paged:
            plan.ranges = bnbf.paged.ranges_of(t for b in made for s in b.states for t in s)
            plan.slices = self._paged_slices(plan)
        self._plans[id(group)] = plan
        return plan

    def _paged_slices(self, plan: _Buckets) -> list:
        """For paged state larger than the GPU memory that was free before it was made: each bucket's params
        in slices of at most half that memory, each with its managed ranges, so that a step prefetches a
        slice and steps it before the next (as bitsandbytes' per-tensor launches do). One launch over all of
        it would instead fault every page in: 3.5x bitsandbytes' step time, measured. [] when it fits."""
        free = self._paged_free
        total = sum(r.nbytes for r in plan.ranges)
        if not plan.ranges or not free or total <= min(free.values()):
            return []
        budget = max(min(free.values()) // 2, 1)
        slices = []
        for bucket in plan.buckets:
            cut, size, keep = [], 0, []
            for k, s in enumerate(bucket.states):
                nbytes = sum(t.nbytes for t in s)
                if keep and size + nbytes > budget:
                    cut.append(keep)
                    keep, size = [], 0
                keep.append(k)
                size += nbytes
            cut.append(keep)
            slices.append(
                [(bucket.subset(c), bnbf.paged.ranges_of(t for k in c for t in bucket.states[k])) for c in cut]
            )
        return slices

    def _note_free(self, params: list) -> None:
        """The GPU's free bytes before paged states are made (the lowest seen, by device): _paged_slices's
        budget. Made states take memory once touched, so free memory read later would count them. A load
        notes it too (before its states are made): a resumed run steps in the slices of a fresh one."""
        for dev, free in _free_memory(params).items():
            self._paged_free[dev] = min(free, self._paged_free.get(dev, free))

    def _create_states(self, group: dict, grads: list, plan: _Buckets) -> _Buckets:
        """States for the parameters that got their first gradient; returns the (re)built plan."""
        new = False
        for p, g in zip(group["params"], grads):
            if g is None or "state" in self.state.get(p, {}):
                continue
            if self.is_paged and not new:
                self._note_free(group["params"])
            if self.is_paged and p.device.type == "cpu" and not getattr(self, "_cpu_paged_warned", False):
                # as bitsandbytes does, once per optimizer: the state is made, but not paged
                warnings.warn(
                    f"{type(self).__name__}: paged state (is_paged=True) needs CUDA params; the state of CPU "
                    f"params is kept in ordinary memory",
                    stacklevel=_caller_level(),
                )
                self._cpu_paged_warned = True
            cfg = plan.configs.get(id(p), {})
            spec = self._spec(group, cfg)
            hp = self._hparams(group, cfg)
            step = _new_step(0, p, group)
            wide = p.dtype == torch.float64 and group["differentiable"]  # (gradcheck, torch.func): float64 state
            s = _checkpoint.new_state(p, spec, _detached(hp) if wide else hp, self.family, wide)
            # the user's entries written before this first step (a wrapper's buffer) stay beside it, as in torch.optim
            extra = _checkpoint.users(self.state.get(p, {}))
            _put(self.state, p, _checkpoint.record(step, s, self.family, self._qmaps, extra))
            self._made(p, s)
            new = True
        if new:
            plan = self._plan(group)
        return plan

    # ---- checkpoints -----------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """bitsandbytes' layout: per parameter index ``{"step": <float32 tensor>, "state_bits": <int32 tensor>,
        "__bnb_optimizer_quant_state__": {"state1", "qmap1", "absmax1", "state2", ...}}`` (``step`` a tensor
        as in torch.optim, for torch.distributed.checkpoint; ``state_bits`` bnbf_nn's, 8 or 32, which a load
        keeps), and the user's entries of ``optimizer.state[p]`` (timm's Lookahead's slow weights) beside them, as
        torch.optim and bitsandbytes keep them (alone for a param without state yet); groups also spell their settings
        as bitsandbytes does (SGD's ``betas`` = (momentum, dampening)...). Tensors are the live ones, as in
        torch.optim."""
        for hook in getattr(self, "_optimizer_state_dict_pre_hooks", {}).values():
            hook(self)
        index = {}
        groups = []
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed.update({k: v for k, v in _to_bnb_group(self.family, group).items() if k not in group})
            packed["params"] = [index.setdefault(id(p), len(index)) for p in group["params"]]
            groups.append(packed)
        # keys of optimizer.state that are not tensors (a hook's "test" entry...) are kept as they are, as
        # torch.optim keeps them; ints are refused: load_state_dict reads an int key as a param index
        state = {k: v for k, v in self.state.items() if not isinstance(k, Tensor)}
        ints = [k for k in state if isinstance(k, int) and not isinstance(k, bool)]
        if ints:
            raise ValueError(
                f"optimizer.state has the int keys {sorted(ints)}, which a state dict reserves for "
                f"param indices: use other keys (strings, say)"
            )
        self._load_assigned()  # else a saved entry assigned into optimizer.state[p] would be left out
        have = [(p, group) for group in self.param_groups for p in group["params"] if "state" in self.state.get(p, ())]
        _check_states_on_every_rank(self.param_groups, self.state)  # before the gathers, which would not line up
        # DTensor params' states in their mesh-independent form (every rank makes this call: a collective
        # per sharded 8-bit state), so that a checkpoint saved on one mesh loads on any other
        portable = _checkpoint.portable([self.state[p]["state"] for p, _ in have])
        maps: dict = {}  # this state dict's qmaps
        for (p, group), st in zip(have, portable):
            # LAMB's and LARS's groups say 0 (their trust ratio stands for it), but bitsandbytes' classes clip at
            # their default and then read the 32-bit state's scratch buffer: write it for them
            quant = _checkpoint.pack(
                st, self.family.bnb_slots, group["max_unorm"] or self.family.max_unorm or 0.0, maps
            )
            # step as torch.optim stores it (a float32 tensor): torch.distributed.checkpoint needs every leaf
            # of a state entry to be a tensor to load it back
            step = torch.tensor(float(self.state[p]["step"]), dtype=torch.float32)
            # the state's bits, which a load keeps: torch.distributed.checkpoint casts the tensors into the loading
            # optimizer's own state (matched by the param's name), so there the tensors alone may no longer tell
            bits = torch.tensor(type(self.state[p]["state"]).layout.bits, dtype=torch.int32)
            # the user's entries (Lookahead's slow weights) beside them, as torch.optim and bitsandbytes save them
            extra = _checkpoint.users(self.state[p])
            state[index[id(p)]] = {"step": step, _checkpoint.BITS_KEY: bits, _checkpoint.QUANT_KEY: quant, **extra}
        for p, rec in self.state.items():  # a param without state yet: the user's entries alone, as torch saves them
            if isinstance(p, Tensor) and id(p) in index and isinstance(rec, Mapping) and rec and "state" not in rec:
                state[index[id(p)]] = dict(rec)
        # each group's starting lr, which lr overrides are relative to: a group without initial_lr (no scheduler)
        # whose lr was changed by hand would otherwise resume with its overrides at their starting values
        lr0 = [self._lr0_of(g) for g in self.param_groups]
        for packed, v, group in zip(groups, lr0, self.param_groups):
            # in the groups: torch.distributed.checkpoint's get_state_dict keeps only "state" and "param_groups",
            # and without it a checkpoint of another rule loaded where its state names agree
            packed[_ORIGIN] = {**self._origin(), "lr0": v}
            # which of bitsandbytes' spellings the group itself holds (the rest are written for bitsandbytes)
            packed[_ORIGIN]["spelled"] = sorted(self._bnb_spelled.keys() & group.keys())
        out = {"state": state, "param_groups": groups}
        for hook in getattr(self, "_optimizer_state_dict_post_hooks", {}).values():
            out = hook(self, out) or out
        return out

    def load_state_dict(self, state_dict: Mapping, move_to_device: bool = True) -> None:
        """Load a state dict of this class's family, ours or bitsandbytes' (8-bit codes are copied bit for bit,
        their format read from the qmap). Everything is checked first: on any error (another optimizer,
        other shapes, missing or mistyped entries) a ``ValueError`` says what, and the optimizer is unchanged.
        The user's entries of a param's state (not the optimizer's own) are kept, cast as torch.optim casts them.
        ``move_to_device`` is bitsandbytes' argument: each state is built on its param's device, where the
        kernels read it, so ``False`` (keep the states where the state dict holds them) is refused."""
        if move_to_device is not True:
            raise NotImplementedError(
                f"{type(self).__name__}.load_state_dict(move_to_device={move_to_device!r}): bnbf_nn keeps each "
                f"state on its param's device (its kernels read it there); pass move_to_device=True"
            )
        # a shallow copy, as torch.optim takes one: a pre-hook editing the dict in place must not edit the caller's
        if isinstance(state_dict, Mapping) and hasattr(state_dict, "copy"):
            state_dict = state_dict.copy()
        for hook in getattr(self, "_optimizer_load_state_dict_pre_hooks", {}).values():
            state_dict = hook(self, state_dict) or state_dict
        try:
            self._load(state_dict)
        except Exception as e:
            if _holds_live_state(state_dict, self.state):
                # torch.distributed.checkpoint's load writes into the tensors state_dict() returned (the live
                # state) before this call: the refused checkpoint's values are in the state now
                self._stale = (
                    f"{type(self).__name__}: a load_state_dict was refused ({e}), and the state dict's tensors are "
                    f"this optimizer's own state (state_dict() returns the live tensors, and "
                    f"torch.distributed.checkpoint's load writes the checkpoint into them first): the state may hold "
                    f"the refused checkpoint's values, so stepping is refused until a load_state_dict succeeds"
                )
                self._fast = None
                e.add_note(self._stale)
            raise

    def _load(self, state_dict: Any) -> None:
        name = type(self).__name__
        if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
            raise ValueError(f"{name}.load_state_dict expects a dict with 'state' and 'param_groups'")
        if not isinstance(state_dict["state"], Mapping) or not all(
            isinstance(g, Mapping) for g in state_dict["param_groups"]
        ):
            raise ValueError(f"{name}.load_state_dict: 'state' must be a dict and 'param_groups' a list of dicts")
        # bnbf_nn's state dicts before the groups held it kept it at the top (without lr0)
        origin = _origin_in_groups(state_dict["param_groups"]) or state_dict.get("bnbf") or {}
        if origin.get("rule", self._rule.name) != self._rule.name:
            raise ValueError(
                f"this state dict is from {origin.get('optimizer')} (rule {origin['rule']!r}); "
                f"{name} uses rule {self._rule.name!r}"
            )
        for key, entry in state_dict["state"].items():
            # said first, rather than failing on a setting of its groups
            if type(key) is int:
                self._check_layout(f"param {key!r}", entry)
        saved_groups = list(state_dict["param_groups"])
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"the state dict has {len(saved_groups)} param groups, {name} has {len(self.param_groups)}"
            )
        groups, id_map = [], {}
        for gi, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            if len(saved.get("params", ())) != len(group["params"]):
                raise ValueError(
                    f"param group {gi} of the state dict has {len(saved.get('params', ()))} params, "
                    f"{name}'s has {len(group['params'])}"
                )
            ours = set(group) - {"params", _ORIGIN} - set(_STORAGE)  # how states are stored stays this optimizer's
            if not origin:  # bitsandbytes' own: a setting it fills with a constant says nothing
                ours -= {k for k, how in self.family.bnb_group if not isinstance(how, (str, tuple))}
            # the live group's settings that the state dict lacks stay (bitsandbytes' lack some); not its watched keys,
            # which the saved group states (absent: the value a group steps without them), but a renamed one set by
            # hand since the live group last stepped, which that step would have read as the rule's key
            new = {k: v for k, v in group.items() if k != "params" and k not in self._watched}
            new.update((ours, group[key]) for key, ours in self.family.renames if key in group)
            new.update(
                {
                    k: deepcopy(v)
                    for k, v in saved.items()
                    if k in ours or k not in {"params", _ORIGIN, *_STORAGE, *_BNB_GROUP_KEYS, *_BNB_2STATE_KEYS}
                }
            )
            new.update(_from_bnb_group(self.family, saved, ours))
            # bitsandbytes' spelling of settings that are not this class's keys, where the saving optimizer's
            # group held it (bitsandbytes' always does): a schedule resumed with the run may write it
            held = origin["spelled"][gi] if origin else _UNSAVED
            held = self._bnb_spelled.keys() if held is _UNSAVED else held  # a live group's copy holds its own keys
            new.update((k, deepcopy(saved[k])) for k in self._bnb_spelled.keys() & set(held) & saved.keys())
            if self._rule.norms is not None and new.get("max_unorm") == self.family.max_unorm:
                new["max_unorm"] = 0.0  # bitsandbytes' default (its PytorchLARS' groups hold it), read as _storage does
            new[_ORIGIN], new["params"] = self._origin(), group["params"]
            try:
                self._read_watched(new, f" in param group {gi} of the state dict")
                self._check_group(new)
            except (ValueError, TypeError) as e:
                raise ValueError(f"param group {gi} of the state dict: {e}") from None
            groups.append(new)
            id_map.update({k: (p, new, saved) for k, p in zip(saved["params"], group["params"])})
        lr0 = _saved_lr0(origin, groups)
        configs = self._load_overrides(groups, lr0)
        state: defaultdict = defaultdict(dict)
        checks: list = []  # the verdicts on DTensor states' values, settled once for the load (a collective)
        free = _free_memory([p for g in groups for p in g["params"]]) if self.is_paged else {}
        try:
            self._load_entries(state_dict, state, id_map, configs, checks, origin)
        finally:  # this load's states in chunks of their own (a failed load's too, freed with them)
            if self.is_paged:
                bnbf.paged.seal()
        _checkpoint.settle(checks)
        self.state = _checkpoint.States(state)
        self.param_groups = groups
        self._init_caches()
        self._paged_free = free
        self._lr0 = {id(g): (g, v) for g, v in zip(groups, lr0)}
        self._note_spelling()
        for hook in getattr(self, "_optimizer_load_state_dict_post_hooks", {}).values():
            hook(self)

    def _load_overrides(self, groups: list, lr0: list) -> dict[int, dict]:
        """The manager's overrides of the loaded groups' params, refused as the next step would refuse them (with
        its error), so that a load never leaves an optimizer that cannot step. ``lr0``: each group's starting lr,
        which an lr override is relative to (read here, not from the live groups' record, which stays as it is)."""
        configs: dict[int, dict] = {}
        for gi, (group, base) in enumerate(zip(groups, lr0)):
            got = self._checked_overrides(group, group["params"])
            at = group if "initial_lr" in group else {**group, "initial_lr": base}
            seen = set()
            for cfg in got.values():  # once per distinct override, as the step checks once per bucket
                key = tuple(sorted((k, repr(v)) for k, v in cfg.items()))
                if key not in seen:
                    seen.add(key)
                    try:
                        self._check_group(at, cfg)
                    except (TypeError, ValueError) as e:
                        self._note_where(e, f" in param group {gi}")
                        raise
            configs.update(got)
        return configs

    def _load_entries(self, state_dict: Mapping, state: dict, id_map: dict, configs: dict, checks: list, origin):
        """:meth:`load_state_dict`'s records of the saved entries, into ``state``."""
        for key, entry in state_dict["state"].items():
            if key not in id_map:
                if not isinstance(key, int) or isinstance(key, bool):  # not a param index: kept, as torch does
                    state[key] = entry
                    continue
                raise ValueError(f"the state dict has state for param {key!r}, which none of its param groups lists")
            if isinstance(entry, Mapping) and not entry:
                # no state, as torch.optim loads it: torch.distributed.checkpoint's flatten_optimizer_state_dict makes
                # an empty entry for each param without live state (one that has had no grad yet), torch's own
                # state_dict() one for a record only read (a defaultdict's); the param gets a fresh state at its grad
                continue
            p, group, saved = id_map[key]
            if isinstance(entry, Mapping):  # the user's entries cast as torch.optim casts them
                moved = bool(saved.get("fused") or saved.get("capturable"))
                entry = {
                    k: v if _checkpoint.own_key(k) else _checkpoint.as_torch_loads(v, p, k, moved)
                    for k, v in entry.items()
                }
                if not self._saved_entry(entry):  # the user's entries alone (saved before the param's first step)
                    state[p] = entry
                    continue
            where = f"param {key} (shape {tuple(p.shape)})"
            state[p] = self._load_entry(entry, p, group, configs.get(id(p), {}), where, checks)

    def _saved_entry(self, entry: Mapping) -> bool:
        """Whether a param's entry without bnbf state is a saved one to load (bitsandbytes' layout, or torch.optim's,
        which :meth:`_check_layout` refuses) rather than the user's entries alone (a wrapper's buffer written before
        the param's first step), which stay beside the state that step makes."""
        return any(_checkpoint.own_key(k) or k in self._torch_names for k in entry)

    @property
    def _torch_names(self) -> frozenset:
        """The rule's states as torch.optim names them in its per-param state (``exp_avg``, ``momentum_buffer``...)."""
        return frozenset(s.name for s in self._rule.states)

    def _check_layout(self, where: str, entry: Any) -> None:
        """Refuse torch.optim's layout (bitsandbytes' PytorchLARS, a plain torch optimizer, saves it) by name: tensors
        without bitsandbytes' state beside a step or the rule's states by torch.optim's names. The user's tensors
        alone (no step) are not refused: they stay beside the state the param's first step makes."""
        if isinstance(entry, Mapping) and _checkpoint.QUANT_KEY not in entry and "state1" not in entry:
            named = sorted((k for k, v in entry.items() if isinstance(v, Tensor) and k != "step"), key=str)
            if named and ("step" in entry or not self._torch_names.isdisjoint(named)):
                raise ValueError(
                    f"the state of {where} holds {named}: torch.optim's layout (bitsandbytes' PytorchLARS saves it), "
                    f"not bitsandbytes' state1/qmap1/absmax1 layout that {type(self).__name__} loads"
                )

    def _load_entry(
        self, entry: Any, p: Tensor, group: Mapping, cfg: Mapping, where: str, checks: list
    ) -> _checkpoint.Record:
        """The record of one param's saved entry, made with its group's settings and manager overrides ``cfg``:
        :meth:`load_state_dict`'s, and :meth:`_load_assigned`'s. The state keeps the bits it was saved with,
        as bitsandbytes' does (the entry's record of them, else its tensors'), whatever this optimizer would give
        a new one. ``checks``: the verdicts on DTensor values, for the caller to settle."""
        if not isinstance(entry, Mapping):
            raise ValueError(f"cannot load the optimizer state of {where}: expected a dict, got {type(entry)}")
        want = self._spec(group, cfg).layout_for(p.numel()).bits
        hp = self._hparams(group, {k: v for k, v in cfg.items() if k not in _STORAGE and k != "lr"})
        step = _new_step(_checkpoint.read_step(entry, where), p, group)
        own = {k: v for k, v in entry.items() if _checkpoint.own_key(k)}
        s = _checkpoint.unpack(own, p, self._rule, self.family.bnb_slots, hp, want, where, self.is_paged, checks)
        return _checkpoint.record(step, s, self.family, self._qmaps, _checkpoint.users(entry))

    def _load_assigned(self) -> None:
        """Load the saved entries assigned into ``optimizer.state[p]`` as :meth:`load_state_dict` loads them:
        ZeroRedundancyOptimizer.load_state_dict writes each of its rank's so (torch.optim's records are what it
        saved), and the step would otherwise replace it with a fresh state. A record without ``state`` holding a
        step, bitsandbytes' state or the rule's states by torch.optim's names is such an entry (refused if it does not
        load); one holding only the user's entries (a hook's note, a wrapper's buffer) or none gets a fresh state
        beside them at the param's first grad. Every entry is checked
        before any is written. A record whose bitsandbytes names are no longer views of its ``state`` is made
        again around that state. Run by the general step and state_dict; the assignment counted in
        :data:`_checkpoint.EDITS`, so the fast step never runs it, and it scans only after one."""
        if type(self.state) is not _checkpoint.States:  # replaced by a plain dict: its edits must count too
            self.state = _checkpoint.States(self.state)
        if self._assigned is self.state and self._assigned_edits == _checkpoint.EDITS[0]:
            return
        found = [
            p
            for p, rec in self.state.items()
            if isinstance(p, Tensor) and isinstance(rec, Mapping) and "state" not in rec and self._saved_entry(rec)
        ]
        if found:
            configs = self._overrides([p for g in self.param_groups for p in g["params"]])
            at = {id(p): (gi, i, g) for gi, g in enumerate(self.param_groups) for i, p in enumerate(g["params"])}
            loaded, checks = [], []
            for p in found:
                if id(p) not in at:  # not a param of this optimizer: nothing steps it
                    continue
                gi, i, group = at[id(p)]
                where = f"param [{i}] of param group {gi} (shape {tuple(p.shape)}), assigned to optimizer.state[p]"
                self._check_layout(where, self.state[p])
                loaded.append((p, self._load_entry(self.state[p], p, group, configs.get(id(p), {}), where, checks)))
            _checkpoint.settle(checks)
            for p, rec in loaded:
                _put(self.state, p, rec)
            _checkpoint.EDITS[0] += 1  # the plans built over the entries are stale
        # a record replaced by a mover's rebuilt one (Lightning's, a tree_map: a plain dict, views copied apart
        # from the state): bitsandbytes' names made views of the state the kernels step again
        for p, rec in list(self.state.items()):
            state = rec.get("state") if isinstance(p, Tensor) and isinstance(rec, Mapping) else None
            if hasattr(type(state), "layout") and _checkpoint.stale(rec):
                try:
                    fresh = _checkpoint.named(state, self.family.bnb_slots, self._qmaps)
                except RuntimeError:  # its stacks (AdEMAMix's) copied row by row: laid out as rows again
                    state = _checkpoint.restacked(state, self.family, self.is_paged)
                    fresh = _checkpoint.named(state, self.family.bnb_slots, self._qmaps)
                _put(self.state, p, _checkpoint.Record({**rec, "state": state, **fresh}))
                _checkpoint.EDITS[0] += 1  # the plans hold the records they write the step count into
        self._assigned, self._assigned_edits = self.state, _checkpoint.EDITS[0]


def _check_states_on_every_rank(groups: list, state: Mapping) -> None:
    """ValueError where a sharded (DTensor) param has state on some ranks of its mesh and not on others (it got a
    grad on some ranks only): ``state_dict()`` gathers every sharded 8-bit state's scales, a collective per state,
    which would then not line up across the ranks (a crash, or a hang). One small all-reduce per mesh dim, over
    that dim's group: a mesh of several dims (HSDP's) may be a sub-mesh of the world's (torchtitan's stages under
    pipeline parallelism each have their own), and a collective over the default group would pair one stage's
    params with another's (refusing a stage's own params, or crashing where the stages' counts differ)."""
    by_mesh: dict = {}
    for i, p in enumerate(p for g in groups for p in g["params"]):
        if _checkpoint.is_dtensor(p):
            by_mesh.setdefault(p.device_mesh, []).append((i, p))
    for mesh, params in by_mesh.items():
        device = params[0][1].to_local().device
        has = torch.tensor([float("state" in state.get(p, ())) for _, p in params], device=device)
        both = torch.cat([has, -has])  # one MAX gives the max and (negated) the min
        for d in range(mesh.ndim):  # the max along each dim in turn: the max over the whole mesh's ranks
            torch.distributed.all_reduce(both, torch.distributed.ReduceOp.MAX, group=mesh.get_group(d))
        differ = (both[: len(params)] != -both[len(params) :]).nonzero()
        if differ.numel():
            i = params[int(differ[0])][0]
            raise ValueError(
                f"param {i} (a DTensor) has optimizer state on some ranks and not on others (it got a grad on some "
                f"ranks only): state_dict() gathers each sharded state on every rank. Give it a grad on every rank "
                f"(FSDP2's reduce-scatter does), or none"
            )


def _holds_live_state(state_dict: Any, state: Mapping) -> bool:
    """Whether a state dict's tensors share memory with the states of ``state`` (a load could have written them)."""

    def storages(x: Any):
        for t in torch.utils._pytree.tree_leaves(x):
            if isinstance(t, Tensor):
                t = t.to_local() if _checkpoint.is_dtensor(t) else t
                if t.device.type != "meta" and t.untyped_storage().nbytes():
                    yield (t.device, t.untyped_storage().data_ptr())

    live = set(storages([rec["state"] for rec in state.values() if isinstance(rec, Mapping) and "state" in rec]))
    entries = state_dict.get("state") if isinstance(state_dict, Mapping) else None
    return bool(live) and isinstance(entries, Mapping) and not live.isdisjoint(storages(entries))


def _origin_in_groups(saved_groups: Any) -> dict:
    """The optimizer and rule that saved the groups, and each group's starting lr (``lr0``: a list, :data:`_UNSAVED`
    for a group whose entry lacks it) and bitsandbytes spellings it held (``spelled``: likewise); empty where a
    group lacks them (bitsandbytes' state dicts, older ones of bnbf_nn). A live group's entry has neither, and
    state dicts made of the live groups hold it so: ZeroRedundancyOptimizer's state_dict() saves its own groups,
    copies of the local optimizer's."""
    found = [g.get(_ORIGIN) if isinstance(g, Mapping) else None for g in saved_groups]
    if not found or not all(isinstance(o, Mapping) for o in found):
        return {}
    lr0 = [o.get("lr0", _UNSAVED) for o in found]
    # a saved group without "spelled" (state dicts of before it was saved) held none; a live group's copy has no lr0
    spelled = [o.get("spelled", () if "lr0" in o else _UNSAVED) for o in found]
    return {**found[0], "lr0": lr0, "spelled": spelled}


# lr0 or spelled missing from a group's "bnbf" entry (a live group's copy, as ZeRO saves): its initial_lr or lr, and
# the loader's own bitsandbytes spellings
_UNSAVED = object()


def _saved_lr0(origin: Mapping, groups: list) -> list:
    """Each group's starting lr (what lr overrides are relative to) as bnbf_nn's state_dict saved it; where the
    state dict has none (bitsandbytes', older ones), the group's ``initial_lr`` or its ``lr``."""
    lr0 = origin.get("lr0")
    if lr0 is None:
        return [_lr_value(g.get("initial_lr", g["lr"])) for g in groups]

    def ok(v: Any) -> bool:
        if v is _UNSAVED:
            return True
        if isinstance(v, Tensor):
            return v.numel() == 1
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0

    if not isinstance(lr0, (list, tuple)) or len(lr0) != len(groups) or not all(map(ok, lr0)):
        raise ValueError(
            f"the state dict's bnbf['lr0'] (each param group's starting lr) must be {len(groups)} non-negative "
            f"numbers, got {[None if v is _UNSAVED else v for v in lr0]!r}"
        )
    return [_lr_value(g.get("initial_lr", g["lr"])) if v is _UNSAVED else deepcopy(v) for v, g in zip(lr0, groups)]


# the step with torch's wrapper (profiler range, step hooks), where _plain_step says it is needed
Optimizer8bit._hooked_step = torch.optim.Optimizer.profile_hook_step(Optimizer8bit._step)


def _hook_outermost(cls: type, step: Any) -> None:
    """``cls.step`` set to :func:`_outermost` of ``step`` where it is a plain function torch would wrap (unmarked)."""
    if isinstance(step, types.FunctionType) and not getattr(step, "hooked", False):
        cls.step = _outermost(step)


def _outermost(step: Any) -> Any:
    """A subclass's own ``step`` with torch's wrapper (step hooks, profiler range) around it once: torch wraps an
    unmarked ``step`` of the class it makes (this one), and the base class's step, which the subclass's calls,
    would run the hooks again inside it (torch.optim.AdamW's subclasses run them once, unless an AdamW was made
    too). Where :func:`_plain_step` finds nothing to run, as the base class's step, without the range."""
    hooked = torch.optim.Optimizer.profile_hook_step(step)

    @functools.wraps(step)
    def outermost(self, *args, **kwargs):
        if self._in_step:  # within another overridden step (a subclass of a subclass, or a step calling itself)
            return step(self, *args, **kwargs)
        self._in_step = True
        try:
            if not _plain_step(self):
                return hooked(self, *args, **kwargs)
            out = step(self, *args, **kwargs)
            self._optimizer_step_code()
            return out
        finally:
            self._in_step = False

    outermost.hooked = True  # (torch's _patch_step_function wraps a step without it)
    return outermost


@dataclasses.dataclass
class _Bucket:
    """Parameters of one group that share their overrides: one step of one bnbf plan."""

    idx: list[int]  # positions in group["params"]
    params: list[Tensor]
    records: list[dict]  # optimizer.state[p] of each: {"step": int, "state": NamedTuple, "state1": view...}
    override: dict  # GlobalOptimManager settings (not storage) shared by these params
    whole: bool  # the bucket is the whole group, in order
    uniform: bool = False  # every param is known to be at the same step (only this class writes steps)
    call: tuple | None = None  # this step's (validated hparams, the step's keywords), see _prepare_group
    # (the group's values, the settings made from them, its watched key's value) where reusable, see _settings
    memo: tuple | None = None
    plan: bnbf.Plan | None = None  # made at the bucket's first step
    # what the plan steps: the records' states, or states of the settings' layout over their tensors (_relayout)
    states: list | None = None
    counted: bool = False  # its records' step counts checked (an edit by hand makes the group's buckets again)
    checked: tuple | None = None  # the group's values (_seen) whose storage and torch checks passed, see _settings

    def __post_init__(self):
        if self.states is None:
            self.states = [r["state"] for r in self.records]
        presents = {type(s).layout.present for s in self.states}
        self.present = presents.pop() if len(presents) == 1 else -1  # the state slots all of them keep
        # DTensor params (FSDP2): decided once here, so the single-device step pays nothing for it
        self.dist = any(map(_checkpoint.is_dtensor, self.params))

    def make_plan(self) -> Any:
        """The bucket's plan: :func:`bnbf.plan`, or :func:`bnbf.distributed.plan` for DTensor params (it
        steps their local shards in one core call)."""
        if self.dist:
            return _distributed().plan(self.params, self.states)
        return bnbf.plan(self.params, self.states)

    def subset(self, keep: list[int]) -> _Bucket:
        return _Bucket(
            [self.idx[k] for k in keep],
            [self.params[k] for k in keep],
            [self.records[k] for k in keep],
            self.override,
            False,
            states=[self.states[k] for k in keep],
        )


class _Fast(typing.NamedTuple):
    """What the last general step found steppable by :meth:`Optimizer8bit._fast_step`, and what it was found
    with (the optimizer's groups list, states and manager overrides)."""

    groups: list  # optimizer.param_groups, the very list
    state: Any  # optimizer.state
    edits: int  # _checkpoint.EDITS
    mng: GlobalOptimManager
    version: int  # the manager's version
    jobs: tuple  # per group: (the group, its params list, their _identities, its one bucket, its records, its plan)


def _grads_of(params: list) -> tuple[list, bool]:
    """Each param's ``.grad`` (None where it has none) and whether every param has one: one compiled call where
    the extension was built."""
    if NATIVE is not None:
        return NATIVE.grads_of(params)
    grads = list(map(_GRAD, params))
    # by identity: `None in grads` would call each tensor's __eq__ (~13 us apiece, 1.9 ms for GPT-2's 148)
    return grads, not any(map(_IS_NONE, grads))


_put = dict.__setitem__  # bnbf_nn's own writes of records and states: not edits (_checkpoint.EDITS)


def _index_of(groups: list, group: Any) -> int | str:
    """A group's index in ``groups``, by identity (for error messages), or "?"."""
    return next((i for i, g in enumerate(groups) if g is group), "?")


def _identities(params: list) -> Any:
    """What :func:`_same_params` compares a params list with: the very tensors (each held by the cache that keeps
    this, so an equal address is the same object)."""
    return packed_identities(params) if NATIVE is not None else list(map(id, params))


def _same_params(params: list, identities: Any) -> bool:
    """Whether ``params`` holds the tensors it held (a list edited in place, ``group["params"][0] = q``, does not)."""
    if NATIVE is not None:
        return NATIVE.same_objects(params, identities)
    return list(map(id, params)) == identities


def _set_steps(records: list, t: int) -> None:
    """Every record's step set to ``t`` in one call: the extension's set_each, or a C-level loop (a deque of
    length 0 consumes the map). Both pass by the records' ``__setitem__``, which guards only the views."""
    if NATIVE is not None:
        NATIVE.set_each(records, "step", t)
    else:
        collections.deque(map(dict.__setitem__, records, itertools.repeat("step"), itertools.repeat(t)), maxlen=0)


@dataclasses.dataclass
class _Buckets:
    """A group's cached buckets, valid while the group's params list (the same list, holding the same tensors),
    the optimizer's states (the same dict, no state or record edited from outside: :data:`_checkpoint.EDITS`)
    and the manager's overrides are the ones it was built from."""

    params: list
    state_obj: Any
    mng_version: int
    identities: Any  # of the params (_identities)
    edits: int  # _checkpoint.EDITS when built
    buckets: list[_Bucket]
    complete: bool  # every param of the group has state
    configs: dict
    has_grad: tuple = ()  # the grad pattern `partial` was built for (steps where some params have none)
    partial: list = dataclasses.field(default_factory=list)  # (bucket, its subset with grads)
    ranges: list = dataclasses.field(default_factory=list)  # managed allocations of paged states (bnbf.paged)
    slices: list = dataclasses.field(default_factory=list)  # per bucket, (subset, ranges) when paged state overflows
    dist: bool = False  # some param is a DTensor (FSDP2)

    def valid(self, opt: Optimizer8bit, params: list) -> bool:
        return (
            self.state_obj is opt.state
            and self.edits == _checkpoint.EDITS[0]
            and self.mng_version == GlobalOptimManager.get_instance().version
            and self.params is params
            and _same_params(params, self.identities)
        )


# ---- bitsandbytes' base classes -------------------------------------------------------------------------


def _as_bnb_reads(a: dict, family: Family, name: str) -> dict:
    """Constructor arguments as bitsandbytes reads them: a two-state class's ``betas`` may be the string
    ``"(b1, b2)"``, and AdEMAMix's ``t_alpha`` or ``t_beta3`` of 0 means no warm-up, as None does."""
    a = dict(a)
    if family.nstates == 2 and isinstance(a.get("betas"), str):
        text = a["betas"]
        try:
            a["betas"] = tuple(float(b) for b in text.replace("(", "").replace(")", "").split(","))
        except ValueError:
            raise ValueError(f"{name}: betas {text!r} is not a tuple of numbers such as '(0.9, 0.999)'") from None
    for key in ("t_alpha", "t_beta3"):
        a[key] = _plain(a.get(key))
        if type(a[key]) in _NUMBER and a[key] == 0:
            a[key] = None
    return a


def _check_bnb_betas(family: Family, a: Mapping, name: str) -> None:
    """bitsandbytes' one-state classes pass SGD's and LARS' momentum and dampening, and RMSprop's alpha and momentum,
    as its ``betas``, which it takes in [0, 1) only (torch.optim checks them for >= 0 at most): a momentum of 1.5
    or an alpha of 1 diverges. ``a``: the settings by name (a bool, tensor or other type is the core's to name)."""
    names = dict(family.bnb_group).get("betas", ())
    for key in names if isinstance(names, tuple) else ():
        v = _plain(a.get(key))
        if isinstance(key, str) and type(v) in _NUMBER and not 0.0 <= v < 1.0:
            raise ValueError(f"Invalid {key} value: {v} ({name} takes 0 <= {key} < 1, as bitsandbytes does)")


def _plain(v: Any) -> Any:
    """A numpy (or other) integral or real scalar as the Python int or float bitsandbytes compares it as (YAML
    and numpy configs give such values); anything else, bools included, as it is, for the checks to name."""
    if isinstance(v, bool) or type(v) in _NUMBER or not isinstance(v, numbers.Real):
        return v
    return operator.index(v) if isinstance(v, numbers.Integral) else float(v)


def _whole(v: Any) -> Any:
    """A count bitsandbytes compares as a number (``optim_bits``, ``min_8bit_size``): an integral value as an int,
    so that 4096.0 or numpy's int64 means 4096; anything else as it is, for the checks to name."""
    v = _plain(v)
    return int(v) if type(v) is float and v.is_integer() else v


class _UnsupportedValue(NotImplementedError, ValueError):
    """A value bnbf_nn does not support where bitsandbytes refuses it too, with ValueError (LAMB8bit's max_unorm):
    caught as either."""


def _from_bnb_args(optimizer_name: str, nstates: int, lr, betas, eps, weight_decay, **extra) -> tuple[Family, dict]:
    family = _BY_NAME.get(_BNB_NAMES.get(optimizer_name, ""))
    if family is None or family.nstates != nstates:
        known = sorted(k for k, v in _BNB_NAMES.items() if _BY_NAME[v].nstates == nstates)
        raise ValueError(f"unknown optimizer_name {optimizer_name!r} for a {nstates}-state optimizer; known: {known}")
    rule = bnbf.RULES[family.rule]
    ours = {f.name for f in dataclasses.fields(rule.hparams)}
    read = _as_bnb_reads({"betas": betas, **extra}, family, optimizer_name)
    spelled = {"betas": tuple(read.pop("betas")), "eps": eps, "weight_decay": weight_decay, **read}
    hp = {k: v for k, v in spelled.items() if k in ours and k not in dict(family.bnb_group)}
    hp.update(_from_bnb_group(family, spelled, ours))
    _check_bnb_betas(family, hp, f"Optimizer{nstates}State({optimizer_name!r})")
    return family, {"lr": lr, **hp}


class Optimizer2State(Optimizer8bit):
    """bitsandbytes' two-state base class, with its positional arguments (for subclasses written for it).

    ``optimizer_name`` is bitsandbytes' name: ``"adam"`` (decoupled weight decay, i.e. AdamW), ``"lamb"`` or
    ``"ademamix"``. The other arguments are bitsandbytes' (``args``: an object whose ``optim_bits``,
    ``min_8bit_size``, ``max_unorm``, ``skip_zeros``, ``block_wise`` and ``percentile_clipping`` attributes,
    those it has, win over the arguments; not ``is_paged``, as in bitsandbytes); ``block_wise``,
    ``state_format``, ``capturable`` and ``differentiable`` (torch.optim's meanings) are keyword-only.
    """

    _bnb_ranges = True

    def __init__(
        self,
        optimizer_name,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        optim_bits=32,
        args=None,
        min_8bit_size=4096,
        max_unorm=0.0,
        skip_zeros=False,
        is_paged=False,
        alpha=0.0,
        t_alpha=None,
        t_beta3=None,
        *,
        block_wise=True,
        state_format="power",
        capturable=False,
        differentiable=False,
    ):
        # alpha, t_alpha, t_beta3: kept only by rules that have them (AdEMAMix), as every bitsandbytes argument
        family, hp = _from_bnb_args(
            optimizer_name, 2, lr, betas, eps, weight_decay, alpha=alpha, t_alpha=t_alpha, t_beta3=t_beta3
        )
        _init_bnb_base(self, "Optimizer2State", optimizer_name, params, family, hp, dict(locals()))


class Optimizer1State(Optimizer8bit):
    """bitsandbytes' one-state base class, with its positional arguments (for subclasses written for it).

    ``optimizer_name`` is bitsandbytes' name: ``"momentum"`` (SGD; ``betas`` = (momentum, dampening)),
    ``"lars"``, ``"rmsprop"`` (``betas`` = (alpha, momentum)), ``"adagrad"`` or ``"lion"``. ``args``,
    ``block_wise``, ``state_format``, ``capturable`` and ``differentiable`` as in :class:`Optimizer2State`.
    """

    _bnb_ranges = True

    def __init__(
        self,
        optimizer_name,
        params,
        lr=1e-3,
        betas=(0.9, 0.0),
        eps=1e-8,
        weight_decay=0.0,
        optim_bits=32,
        args=None,
        min_8bit_size=4096,
        max_unorm=0.0,
        skip_zeros=False,
        is_paged=False,
        *,
        block_wise=True,
        state_format="power",
        capturable=False,
        differentiable=False,
    ):
        family, hp = _from_bnb_args(optimizer_name, 1, lr, betas, eps, weight_decay)
        _init_bnb_base(self, "Optimizer1State", optimizer_name, params, family, hp, dict(locals()))


def _init_bnb_base(opt, base: str, optimizer_name: str, params, family: Family, hp: dict, a: dict) -> None:
    """The shared body of bitsandbytes' two bases: ``a`` holds the constructor's arguments by name."""
    settings = {k: a[k] for k in ("optim_bits", "min_8bit_size", "max_unorm", "skip_zeros", "state_format")}
    storage, paged = _storage(
        a["args"], settings, a["is_paged"], a["block_wise"], family, f"{base}({optimizer_name!r})"
    )
    modes = {"capturable": a["capturable"], "differentiable": a["differentiable"]}
    Optimizer8bit.__init__(opt, params, {**hp, **storage, **modes}, storage["optim_bits"], paged, family=family)


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside bnbf, bnbf_nn and torch (the caller's ``opt.step()``,
    however many wrappers torch.optim adds around it)."""
    ours = tuple(os.path.dirname(m.__file__) + os.sep for m in (bnbf, sys.modules[__package__], torch))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(ours):
        frame, level = frame.f_back, level + 1
    return level


def _free_memory(params: list) -> dict[int, int]:
    """The free bytes of each GPU holding any of ``params``, by device index."""
    return {dev.index: torch.cuda.mem_get_info(dev)[0] for dev in {p.device for p in params if p.is_cuda}}


_NP_BOOLS = ("bool", "bool_")  # numpy 2's name, numpy 1's


def _flag(value: Any, what: str, name: str) -> bool:
    """A bool setting as bitsandbytes reads it (its truth value), of a bool or an integer (numpy's too); anything
    else (a string: "False" is true) is refused."""
    if isinstance(value, numbers.Integral) or (type(value).__module__ == "numpy" and type(value).__name__ in _NP_BOOLS):
        return bool(value)
    raise TypeError(f"{name}: {what} must be a bool, got {value!r}")


def _storage(args, settings: dict, is_paged, block_wise, family: Family, name: str):
    """The group settings that are not hyperparameters of the rule, and whether the state is paged.

    bitsandbytes' ``args`` object wins over the arguments for each of these attributes it has:
    ``optim_bits``, ``min_8bit_size``, ``max_unorm``, ``skip_zeros``, ``state_format``, ``block_wise`` and
    ``percentile_clipping``. Not ``is_paged``: bitsandbytes pages by the argument alone."""
    out = dict(settings)
    if args is not None:
        out.update({k: getattr(args, k) for k in out if hasattr(args, k)})
        block_wise = getattr(args, "block_wise", block_wise)
        clip = getattr(args, "percentile_clipping", 100)
        if clip != 100:
            raise NotImplementedError(
                f"{name}: args.percentile_clipping={clip!r} is not supported (bnbf has no percentile "
                f"clipping; 100 turns it off). Clip the gradients before step (torch.nn.utils.clip_grad_norm_)"
            )
    out["optim_bits"] = bits = _whole(out["optim_bits"])
    out["min_8bit_size"] = _whole(out["min_8bit_size"])
    if isinstance(bits, bool) or not isinstance(bits, int):  # e.g. torch's RMSprop(..., centered, capturable)
        raise TypeError(
            f"{name}: optim_bits must be an int (8 or 32), got {bits!r}; the arguments after the "
            f"hyperparameters are bitsandbytes' ({', '.join(_bnb_tail(family, None, False))}), not torch's"
        )
    is_paged, block_wise = _flag(is_paged, "is_paged", name), _flag(block_wise, "block_wise", name)
    if not block_wise and out["optim_bits"] == 8:
        raise ValueError(
            f"{name}: block_wise=False (one scale per tensor) is not supported: bnbf's 8-bit state is "
            f"block-wise (256 elements per scale); pass block_wise=True, or optim_bits=32"
        )
    rule = bnbf.RULES[family.rule]
    if rule.norms is not None:  # LAMB, LARS: their trust ratio stands for bitsandbytes' update clipping
        if out["max_unorm"] not in (0.0, family.max_unorm):
            raise _UnsupportedValue(
                f"{name}: max_unorm={out['max_unorm']} is not supported: bnbf's {rule.name!r} "
                f"rule scales its update by its own trust ratio"
            )
        out["max_unorm"] = 0.0
    return out, is_paged


# ---- the generated classes ------------------------------------------------------------------------------

_P = inspect.Parameter


def _bnb_tail(family: Family, bits: int | None, paged: bool) -> tuple[str, ...]:
    """bitsandbytes' positional arguments of the class after the hyperparameters, in its order."""
    tail = []
    if bits is None or family.bnb_bits_arg:
        tail.append("optim_bits")
    if family.bnb_args:
        tail.append("args")
    tail.append("min_8bit_size")
    if family.max_unorm is not None:
        tail.append("max_unorm")
    if family.pageable and (not paged or family.paged_takes_is_paged):
        tail.append("is_paged")
    return tuple(tail)


def _signature(
    family: Family, bits: int | None, paged: bool = False, lr: Any = None, tail: tuple | None = None
) -> inspect.Signature:
    """params, lr, the hyperparameters and bitsandbytes' tail positional in bitsandbytes' order; bnbf's own
    arguments (and bitsandbytes' that this class of bitsandbytes lacks) keyword-only after them."""
    lr = (_P.empty if family.lr is None else family.lr) if lr is None else lr
    bits_default = bits or 32
    if bits == 8 and family.bnb_bits_arg:
        bits_default = family.bnb_bits8_default
    storage = {
        "optim_bits": bits_default,
        "args": None,
        "min_8bit_size": 4096,
        "max_unorm": family.max_unorm or 0.0,
        "is_paged": False,
    }
    tail = _bnb_tail(family, bits, paged) if tail is None else tail
    pos = _P.POSITIONAL_OR_KEYWORD
    ps = [_P("self", pos), _P("params", pos), _P("lr", pos, default=lr)]
    ps += [_P(k, pos, default=v) for k, v in family.args]
    ps += [_P(k, pos, default=storage[k]) for k in tail]
    kw = [(k, v) for k, v in storage.items() if k not in tail and not (paged and k == "is_paged")]
    kw += list(family.extra_args())
    kw += [("skip_zeros", False), ("block_wise", True), ("state_format", "power"), ("maximize", False)]
    kw += [(k, _TORCH_FLAGS[k]) for k in family.torch_flags]
    kw += [(k, off) for k, off in _MODES.items() if k not in family.torch_flags]
    ps += [_P(k, _P.KEYWORD_ONLY, default=v) for k, v in kw]
    return inspect.Signature(ps)


def _make_class(
    family: Family, bits: int | None, paged: bool = False, name: str | None = None, bnb_ranges=True, **sig_kw: Any
) -> type:
    """The class ``name`` of ``family`` (``bits``-bit state, paged); ``bnb_ranges``: refuse what bitsandbytes'
    constructor refuses of the settings it takes as ``betas`` (its PytorchLARS, a torch optimizer, does not)."""
    name = name or ("Paged" if paged else "") + family.name + (f"{bits}bit" if bits else "")
    sig = _signature(family, bits, paged, **sig_kw)
    # bitsandbytes' Adam8bit takes optim_bits=32 ("for compatibility") and keeps 8-bit state: both accepted
    bits_ok = {bits, family.bnb_bits8_default} if bits == 8 and family.bnb_bits_arg else {bits}

    def __init__(self, *args, **kwargs):
        try:
            a = sig.bind(self, *args, **kwargs)
        except TypeError as e:  # as Python words it for a def: the class named
            raise TypeError(f"{name}.__init__() {e}") from None
        a.apply_defaults()
        a = _as_bnb_reads(a.arguments, family, name)
        if bnb_ranges:
            _check_bnb_betas(family, a, name)
        if bits is not None and a["optim_bits"] not in bits_ok:
            raise ValueError(
                f"{name} keeps {bits}-bit state; got optim_bits={a['optim_bits']} "
                f"(use {family.name}(optim_bits=...) to choose)"
            )
        hp = {"lr": a["lr"]}
        for key, default in family.args + family.extra_args():
            ours = family.hparam_of(key, a[key], default, name)
            if ours is not None:
                hp[ours] = a[key]
        settings = {
            "optim_bits": bits or a["optim_bits"],
            "min_8bit_size": a["min_8bit_size"],
            "max_unorm": a["max_unorm"],
            "skip_zeros": a["skip_zeros"],
            "state_format": a["state_format"],
        }
        is_paged = True if paged else a["is_paged"]  # a Paged* class pages whatever is_paged says, as bnb's
        storage, is_paged = _storage(a["args"], settings, is_paged, a["block_wise"], family, name)
        # group settings, as torch.optim keeps them
        flags = {k: a[k] for k in ("maximize", *family.torch_flags, *_MODES)}
        Optimizer8bit.__init__(self, a["params"], {**hp, **storage, **flags}, storage["optim_bits"], is_paged)

    __init__.__signature__ = sig
    base = Optimizer2State if family.nstates == 2 else Optimizer1State
    what = {None: "8-bit or 32-bit state (optim_bits, 32 by default)", 8: "8-bit state", 32: "32-bit state"}[bits]
    where = " in CUDA managed (paged) memory" if paged else ""
    need_lr = family.lr is None and sig.parameters["lr"].default is _P.empty
    origin = (
        f"bitsandbytes.optim.{name}'s arguments and defaults"
        if family.in_bitsandbytes
        else f"bitsandbytes' argument layout (bitsandbytes has no {family.name}; the defaults are its authors')"
    )
    doc = (
        f"{family.name} with {what}{where}: {origin}, stepping with bnbf's {family.rule!r} rule.\n\n"
        f"Signature: {name}{str(sig).replace('(self, ', '(')}\n\nArgs are "
        f"bitsandbytes' and torch.optim's (see the module docstring of bnbf_nn.optim for what differs).\n\n"
        f"Example::\n\n    opt = bnbf_nn.{name}(model.parameters(){', lr=0.1' if need_lr else ''})\n"
        f"    loss.backward()\n    opt.step()\n    opt.zero_grad()\n"
    )
    cls = type(
        name,
        (base,),
        {
            "__init__": __init__,
            "family": family,
            "_bnb_ranges": bnb_ranges,
            "__doc__": doc,
            "__module__": __name__,
            "__qualname__": name,
        },
    )
    return cls


def _rule_doc(cls: type) -> str:
    mod = sys.modules.get(bnbf.RULES[cls.family.rule].hparams.__module__)
    return (mod.__doc__ or "") if mod else ""


def _register(cls: type) -> None:
    cls.__doc__ += "\nUpdate (bnbf." + cls.family.rule + "):\n" + _rule_doc(cls)
    globals()[cls.__name__] = cls
    __all__.append(cls.__name__)


for _family in FAMILIES:
    for _paged in (False, True) if _family.paged_classes else (False,):
        for _bits in (None, 8, 32):
            _register(_make_class(_family, _bits, _paged))
# bitsandbytes' LARS as a plain torch optimizer (32-bit state, lr 0.01 by default); here a 32-bit LARS
_register(_make_class(_BY_NAME["LARS"], 32, name="PytorchLARS", bnb_ranges=False, lr=0.01, tail=("max_unorm",)))
del _family, _bits, _paged


class MockArgs:
    """bitsandbytes' ``args`` object made from a dict (``MockArgs({"optim_bits": 8, ...})``): its keys as
    attributes, which the constructors' ``args`` reads."""

    def __init__(self, initial_data: Mapping) -> None:
        self.__dict__.update(initial_data)


def _bnb_submodules() -> None:
    """bitsandbytes.optim's submodules, which code written for it names (``bnb.optim.optimizer.Optimizer2State`` in an
    ``issubclass``, ``from bitsandbytes.optim.adamw import AdamW8bit``): ``bnbf_nn.optim.<name>`` holds bnbf_nn's
    classes of the bitsandbytes module of that name (a family's classes in its lower-cased name's), importable."""
    this = sys.modules[__name__]
    found: dict[str, list] = {
        "optimizer": [Optimizer8bit, Optimizer1State, Optimizer2State, GlobalOptimManager, MockArgs]
    }
    for name in __all__:
        cls = globals()[name]
        family = getattr(cls, "family", None)  # the bases have none
        if isinstance(cls, type) and issubclass(cls, Optimizer8bit) and family is not None and family.in_bitsandbytes:
            classes = found.setdefault(family.name.lower(), [])
            classes.append(cls)
            # and the base its bitsandbytes module imports (``from bitsandbytes.optim.adam import Optimizer2State``)
            base = Optimizer2State if issubclass(cls, Optimizer2State) else Optimizer1State
            if issubclass(cls, base) and base not in classes:
                classes.append(base)
    for sub, classes in found.items():
        module = types.ModuleType(f"{__name__}.{sub}", f"bitsandbytes.optim.{sub}'s classes, as bnbf_nn has them.")
        module.__dict__.update({c.__name__: c for c in classes})
        sys.modules[module.__name__] = module
        setattr(this, sub, module)


_bnb_submodules()

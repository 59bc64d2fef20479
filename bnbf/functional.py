"""The functional core: ``init_state``, ``update`` (pure), ``update_`` (in place), ``dequantize_state``.

Every check runs before any tensor is written, so a call that raises leaves params, grads and states
exactly as they were.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import operator
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from bnbf import _host_checks as host_checks
from bnbf import ops
from bnbf._dispatch import BUILD_LOCK, INTERPRETER_LOCK, use_triton
from bnbf._host_checks import _DEVICE, _DTYPE, _LAYOUT, _SHAPE, _is_plain
from bnbf.kernels.multi_tensor import build_group, launch_group
from bnbf.quant import DITHER_SEED_MOD, dequantize_state_reference
from bnbf.rules import get_rule
from bnbf.rules.base import as_scalar_row
from bnbf.state import Layout, OptimSpec, State, is_state, new_state, present_mask

_PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_param(p: Any, where: str) -> None:
    if not isinstance(p, Tensor):
        raise TypeError(f"param{where} must be a Tensor, got {type(p).__name__}")
    if p.dtype not in _PARAM_DTYPES:
        kind = "complex" if p.is_complex() else ("integer" if not p.is_floating_point() else "this")
        raise TypeError(
            f"param{where} has dtype {p.dtype}: {kind} params are not supported "
            f"(bnbf optimizes float32, float16 and bfloat16 params)"
        )
    if p.layout != torch.strided:
        raise TypeError(f"param{where} must be a dense (strided) tensor, got layout {p.layout}")


def init_state(param: Any, spec: OptimSpec, hparams: Any = None) -> Any:
    """Zero optimizer state for a tensor or a pytree of tensors.

    Args:
        param: a tensor, or a dict/list/tuple pytree of tensors (e.g. ``dict(model.named_parameters())``).
        spec: the :class:`OptimSpec` (rule and storage).
        hparams: the hyperparameters the state will be updated with, where they decide which states are
            kept or their initial values (SGD/RMSprop momentum, RMSprop centered, Adagrad's
            initial_accumulator_value); the rule's defaults otherwise.

    Returns:
        A state NamedTuple per tensor, in the same pytree structure. 8-bit states hold uint8 codes and
        float32 per-block absmax; tensors smaller than ``spec.min_8bit_size`` get float32 state.

    Example:
        >>> p = torch.zeros(4096)
        >>> s = init_state(p, OptimSpec(rule="adamw"))
        >>> type(s).__name__, s.exp_avg.dtype
        ('adamw_state_8bit_power_b256_s3', torch.uint8)
    """
    if not isinstance(spec, OptimSpec):
        raise TypeError(f"spec must be an OptimSpec, got {type(spec).__name__}")
    leaves, treespec = pytree.tree_flatten_with_path(param)
    if not leaves:
        raise ValueError("init_state needs at least one tensor")
    for path, p in leaves:
        _check_param(p, pytree.keystr(path))
    get_rule(spec.rule).make_hparams(hparams)  # bad hyperparameters fail before anything is built
    return pytree.tree_unflatten([new_state(p.detach(), spec, hparams) for _, p in leaves], treespec)


@dataclasses.dataclass
class _Call:
    """A validated call: flat lists and the rule's hparams."""

    params: list[Tensor]
    grads: list[Tensor]
    states: list[tuple]
    spec: Any  # structure key from _flatten
    rule: Any
    hparams: Any
    step: Any


def _check_present(rule: Any, h: Any, states: list) -> None:
    """The states keep exactly the slots these hyperparameters use (e.g. a momentum buffer)."""
    want = present_mask(rule, h)
    for s in states:
        have = type(s).layout.present
        if have != want:
            names = lambda mask: [slot.name for j, slot in enumerate(rule.states) if (mask >> j) & 1]
            raise ValueError(
                f"the state keeps {names(have)} but these {rule.name} hyperparameters need {names(want)}; "
                f"build the state with bnbf.init_state(params, spec, hparams) using the same hyperparameters"
            )


def _check_step(step: Any) -> None:
    if isinstance(step, Tensor):
        if step.numel() != 1 or step.is_floating_point() or step.is_complex() or step.dtype == torch.bool:
            raise TypeError(f"step must be an int or a 0-d integer tensor, got {step.dtype} {tuple(step.shape)}")
        if step.device.type == "cpu" and int(step) < 1:
            raise ValueError(f"Invalid step: {int(step)} (steps count from 1)")
        return
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an int or a 0-d integer tensor, got {type(step).__name__}")
    if step < 1:
        raise ValueError(f"Invalid step: {step} (steps count from 1)")


def _flatten(tree: Any, is_leaf=None) -> tuple[list, Any]:
    """Leaves and a structure key; flat dicts and lists of leaves skip the generic pytree walk."""
    leaf_type = State if is_leaf is is_state else Tensor
    if type(tree) is dict:
        values = list(tree.values())
        if all(map(isinstance, values, itertools.repeat(leaf_type))):
            return values, ("dict", tuple(tree))
    elif type(tree) in (list, tuple) and all(map(isinstance, tree, itertools.repeat(leaf_type))):
        return list(tree), (type(tree), len(tree))
    elif isinstance(tree, leaf_type):
        return [tree], "leaf"
    return pytree.tree_flatten(tree, is_leaf=is_leaf)


def _fast_leaves(tree: Any) -> tuple[list | None, Any]:
    """:func:`_flatten`'s leaves and key for a flat dict, list or tuple, without checking the leaves' types
    (``(None, None)`` for any other tree)."""
    t = type(tree)
    if t is dict:
        return list(tree.values()), ("dict", tuple(tree))
    if t is list or t is tuple:
        return tree, (t, len(tree))
    return None, None


def _unflatten(leaves: list, spec: Any) -> Any:
    if spec == "leaf":
        return leaves[0]
    if isinstance(spec, tuple) and spec[0] == "dict":
        return dict(zip(spec[1], leaves))
    if isinstance(spec, tuple) and spec[0] in (list, tuple):
        return spec[0](leaves)
    return pytree.tree_unflatten(leaves, spec)


def _names(param: Any) -> list[str]:
    """Key strings of the leaves (only needed for error messages)."""
    return [pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(param)[0]]


@functools.lru_cache(maxsize=4096)
def _expected(layout: Layout, shape: torch.Size) -> tuple:
    return tuple(layout.expected(shape).values())


def _states_ok(params: list, states: list) -> bool:
    """Float params (strided) with bnbf states whose fields fit them: shape, dtype, the param's device,
    contiguous. In C-level loops over all leaves (a pure call's host time is mostly these checks); a list
    of one leaf checks that leaf. False: :func:`_check_leaf` names what is wrong."""
    try:
        if not (all(map(isinstance, params, itertools.repeat(Tensor)))
                and all(map(isinstance, states, itertools.repeat(State)))):  # fmt: skip
            return False
        devices = list(map(_DEVICE, params))
        one_device = len(set(devices)) == 1
        fields = [t for s in states for t in s]
        expected = [e for s, shape in zip(states, map(_SHAPE, params)) for e in _expected(type(s).layout, shape)]
        return (
            set(map(_DTYPE, params)) <= _PARAM_DTYPE_SET
            and set(map(_LAYOUT, params)) == _STRIDED
            and list(map(_SHAPE_DTYPE, fields)) == expected
            and (set(map(_DEVICE, fields)) <= {devices[0]} if one_device else
                 list(map(_DEVICE, fields)) == [d for d, s in zip(devices, states) for _ in s])  # fmt: skip
            and all(map(Tensor.is_contiguous, fields))
        )
    except (AttributeError, TypeError):  # a state field that is not a Tensor
        return False


def _grads_ok(params: list, grads: list) -> bool:
    """Strided tensors of their params' shapes, dtypes and devices (params already checked)."""
    return (
        all(map(isinstance, grads, itertools.repeat(Tensor)))
        and set(map(_LAYOUT, grads)) == _STRIDED
        and list(map(_SHAPE, grads)) == list(map(_SHAPE, params))
        and list(map(_DTYPE, grads)) == list(map(_DTYPE, params))
        and list(map(_DEVICE, grads)) == list(map(_DEVICE, params))
    )


def _check_leaf(name: str, p: Any, g: Any, s: Any) -> None:
    """Raise the precise error for a leaf that failed :func:`_states_ok` or :func:`_grads_ok`."""
    _check_param(p, name)
    if not isinstance(g, Tensor):
        raise TypeError(f"grad{name} must be a Tensor, got {type(g).__name__}")
    if g.is_sparse or g.layout != torch.strided:
        raise RuntimeError(f"bnbf does not support sparse gradients (grad{name} has layout {g.layout})")
    if g.shape != p.shape:
        raise ValueError(f"grad{name} has shape {tuple(g.shape)} but the param has shape {tuple(p.shape)}")
    if g.dtype != p.dtype:
        raise TypeError(f"grad{name} has dtype {g.dtype} but the param has dtype {p.dtype}")
    if g.device != p.device:
        raise ValueError(f"grad{name} is on {g.device} but the param is on {p.device}")
    if not is_state(s):
        raise TypeError(f"state{name} is not a bnbf state (make it with bnbf.init_state), got {type(s)}")
    layout: Layout = type(s).layout
    for field, (shape, dtype) in layout.expected(p.shape).items():
        t = getattr(s, field)
        if not isinstance(t, Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(
                f"state{name}.{field} does not fit the param: expected {dtype} {shape}, got {got} "
                f"(was the state built for another param or spec?)"
            )
        if t.device != p.device:
            raise ValueError(f"state{name}.{field} is on {t.device} but the param is on {p.device}")
        if not t.is_contiguous():
            raise ValueError(f"state{name}.{field} must be contiguous")
    raise AssertionError(f"unexpected input at {name}")  # the checks and _check_leaf disagree


_NBYTES = operator.attrgetter("nbytes")
_EXACT_MAX_BYTES = 1 << 26  # above this, two strided views whose ranges overlap count as overlapping


def _span(t: Tensor) -> int:
    """Bytes from a tensor's first element to the end of its last (its strides may skip memory between)."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


def _share_memory(a: Tensor, b: Tensor) -> bool:
    """Whether two tensors whose byte ranges overlap have a byte in common. Contiguous tensors cover their
    whole range; strided views (``w[:, 0]`` and ``w[:, 1]``) may interleave without touching: marked
    byte by byte on the host (addresses only, nothing is read from the device)."""
    if a.is_contiguous() and b.is_contiguous():
        return True
    lo = min(a.data_ptr(), b.data_ptr())
    hi = max(a.data_ptr() + _span(a), b.data_ptr() + _span(b))
    if hi - lo > _EXACT_MAX_BYTES:
        return True
    mask = torch.zeros(hi - lo, dtype=torch.bool)
    views = []
    for t in (a, b):
        k = t.element_size()
        shape = [1 if s == 0 else n for n, s in zip(t.shape, t.stride())]  # a broadcast dim adds no memory
        views.append(mask.as_strided((*shape, k), (*(s * k for s in t.stride()), 1), t.data_ptr() - lo))
    try:
        views[0].fill_(True)
    except RuntimeError:  # a layout fill_ refuses (elements of a itself overlapping): count it as shared
        return True
    return bool(views[1].any())


def _first_overlap(tensors: list, starts: list, ends: list, idx: list) -> tuple[int, int] | None:
    """Two of ``idx`` (positions in ``tensors``, one device, none empty) whose memory overlaps, lowest first,
    else None: a sweep over the byte ranges in address order, exact for strided views."""
    active: list[int] = []  # earlier tensors whose range reaches past the current start
    for k in sorted(idx, key=starts.__getitem__):
        active = [j for j in active if ends[j] > starts[k]]
        for j in active:
            if _share_memory(tensors[j], tensors[k]):
                return min(j, k), max(j, k)
        active.append(k)
    return None


def _overlap(params: list, states: list) -> tuple[int, int] | None:
    """Positions ``i < j`` in ``[*params, *fields of the states]`` of two tensors sharing memory (the same
    tensor twice, views of one storage), or None. An update writes each param and state once from its own
    inputs, so two that share memory would be stepped twice, or one over the other. Params and states are
    valid (:func:`_states_ok`). Every pure call runs it: C-level maps and two sorts over all leaves."""
    if len(set(map(id, params))) < len(params):  # the same param twice (also an empty one): named as such
        seen: dict[int, int] = {}
        for j, p in enumerate(params):
            if id(p) in seen:
                return seen[id(p)], j
            seen[id(p)] = j
    tensors = [*params, *itertools.chain.from_iterable(states)]
    starts = list(map(Tensor.data_ptr, tensors))
    sizes = list(map(_NBYTES, tensors))
    if not all(map(Tensor.is_contiguous, params)):  # the states' fields are contiguous (checked)
        sizes = [s if t.is_contiguous() else _span(t) for t, s in zip(tensors, sizes)]
    # disjoint ranges <=> with starts and ends sorted on their own, the k-th end is at most the (k+1)-th start
    # (the number of ranges covering an address is #starts <= it minus #ends <= it); empty ranges, and
    # addresses of several devices compared as one, can only make this fail: then the exact sweep decides
    if not any(map(operator.lt, sorted(starts)[1:], sorted(map(operator.add, starts, sizes)))):
        return None
    ends = list(map(operator.add, starts, sizes))
    owner = [p.device for p in params] + [p.device for p, s in zip(params, states) for _ in s]
    found = []
    for device in set(owner):  # addresses compare only within one device
        idx = [k for k in range(len(tensors)) if owner[k] == device and sizes[k]]  # an empty tensor has no memory
        pair = _first_overlap(tensors, starts, ends, idx)
        if pair is not None:
            found.append(pair)
    return min(found) if found else None


def _check_no_overlap(param: Any, params: list, states: list) -> None:
    """ValueError naming two leaves of one call that share memory (see :func:`_overlap`)."""
    pair = _overlap(params, states)
    if pair is None:
        return
    names = _names(param)
    where = [(i, None) for i in range(len(params))]
    where += [(i, f) for i, s in enumerate(states) for f in type(s)._fields]
    (i, fi), (j, fj) = where[pair[0]], where[pair[1]]
    if fi is None and fj is None:
        if params[i] is params[j]:
            raise ValueError(f"param{names[i]} and param{names[j]} are the same tensor: a param may appear only "
                             f"once in a call (torch.optim refuses a param in two groups)")  # fmt: skip
        raise ValueError(f"param{names[i]} and param{names[j]} overlap in memory (views of one tensor?): the "
                         f"params of one call must not share memory, each would be stepped on its own")  # fmt: skip
    if fi is None:
        raise ValueError(f"param{names[i]} and state{names[j]}.{fj} overlap in memory: a param and a state must "
                         f"not share memory")  # fmt: skip
    if states[i] is states[j]:
        raise ValueError(f"state{names[i]} and state{names[j]} are the same state: each param needs a state of "
                         f"its own (bnbf.init_state)")  # fmt: skip
    raise ValueError(f"state{names[i]}.{fi} and state{names[j]}.{fj} overlap in memory: the states of one call "
                     f"must not share memory")  # fmt: skip


def _prepare(param, grad, state, hparams, step) -> _Call:
    params, p_spec = _flatten(param)
    grads, g_spec = _flatten(grad)
    states, s_spec = _flatten(state, is_leaf=is_state)
    if not params:
        raise ValueError("update needs at least one tensor")
    if g_spec != p_spec:
        raise ValueError(f"grad structure {g_spec} does not match param structure {p_spec}")
    if s_spec != p_spec:
        raise ValueError(f"state structure {s_spec} does not match param structure {p_spec}")
    if not (_states_ok(params, states) and _grads_ok(params, grads)):
        for i, (p, g, s) in enumerate(zip(params, grads, states)):
            if not (_states_ok([p], [s]) and _grads_ok([p], [g])):
                _check_leaf(_names(param)[i], p, g, s)
    _check_no_overlap(param, params, states)
    rule_name = type(states[0]).layout.rule
    for i, s in enumerate(states):
        if type(s).layout.rule != rule_name:
            raise ValueError(f"state{_names(param)[i]} is for rule {type(s).layout.rule!r} but other states are "
                             f"for {rule_name!r}")  # fmt: skip
    rule = get_rule(rule_name)
    h = rule.make_hparams(hparams)
    _check_present(rule, h, states)
    _check_step(step)
    return _Call(params, grads, states, p_spec, rule, h, step)


def _groups(params: list, states: list):
    """Indices grouped by (device, dtype, layout): one kernel launch each."""
    groups: dict[tuple, list[int]] = {}
    for i, (p, s) in enumerate(zip(params, states)):
        groups.setdefault((p.device, p.dtype, type(s).layout), []).append(i)
    return groups.items()


def check_update_options(rule: Any, skip_zeros: Any, max_unorm: Any, maximize: Any = False) -> bool:
    """Check ``update``'s ``skip_zeros``, ``max_unorm`` and ``maximize`` for ``rule``; returns whether clipping
    is on."""
    if not isinstance(skip_zeros, bool):
        raise TypeError(f"skip_zeros must be a bool, got {type(skip_zeros).__name__}")
    if not isinstance(maximize, bool):
        raise TypeError(f"maximize must be a bool, got {type(maximize).__name__}")
    if isinstance(max_unorm, Tensor):
        clip = True
    else:
        if not max_unorm >= 0.0:
            raise ValueError(f"Invalid max_unorm value: {max_unorm}")
        clip = max_unorm > 0
    if clip and rule.norms is not None:
        raise ValueError(f"max_unorm does not combine with {rule.name}, which scales its update by its own norms")
    return clip


def _scalars(rule: Any, h: Any, step: Any, skip_zeros: Any, max_unorm: Any, maximize: Any) -> tuple[tuple, bool]:
    """The rule's scalars followed by the four the step adds: the gradient's sign (-1 with ``maximize``), the
    seed of the states' stochastic rounding (the step mod 2**24, see bnbf.quant), and the clipping pair
    (max_unorm, lr); and whether clipping is on."""
    clip = check_update_options(rule, skip_zeros, max_unorm, maximize)
    seed = step % DITHER_SEED_MOD  # an int, or a device op on a tensor step (no host sync)
    return (*rule.scalars(h, step), -1.0 if maximize else 1.0, seed, max_unorm, h.lr), clip


def _scalar_rows(
    call: _Call, skip_zeros: Any, max_unorm: Any, maximize: Any
) -> tuple[dict[torch.device, Tensor], bool]:
    values, clip = _scalars(call.rule, call.hparams, call.step, skip_zeros, max_unorm, maximize)
    devices = {p.device for p in call.params}
    return {d: as_scalar_row(values, d) for d in devices}, clip


def update(
    param: Any, grad: Any, state: Any, hparams: Any = None, step: Any = 1, *, skip_zeros: bool = False,
    max_unorm: float = 0.0, maximize: bool = False,
) -> tuple[Any, Any]:
    """One optimizer step, purely: returns ``(new_param, new_state)`` and modifies no input.

    Args:
        param: a tensor or pytree of tensors (float32, float16 or bfloat16).
        grad: gradients in the same structure, each of its param's shape, dtype and device.
        state: from :func:`init_state` (or a previous ``update``), same structure.
        hparams: a mapping with torch.optim's names (``lr``, ``betas``, ``eps``, ``weight_decay``...) or
            the rule's hparams dataclass; Python numbers or 0-d tensors. Missing keys take defaults.
        step: 1-based index of this update (int or 0-d integer tensor), for bias correction.
        skip_zeros: (a bool) gradient elements that are exactly 0 leave their param element and states unchanged
            (sparse updates such as embedding rows; for 8-bit states "unchanged" is up to requantization
            with the block's new absmax).
        max_unorm: if > 0, each tensor's update is scaled down so that its norm is at most
            ``max_unorm * ||p||`` (bitsandbytes' update clipping; the update is measured per unit of
            learning rate, ``(p_new - p) / lr``). Costs a norm pass. Not for rules with their own norms
            (LAMB, LARS).
        maximize: step along the gradient instead of against it (torch.optim's ``maximize``).

    Returns:
        ``(new_param, new_state)`` in the input structures, all new tensors.

    Raises:
        ValueError: among others, for a param (or state) listed twice, or params or states sharing memory
            (views of one tensor): each leaf is stepped on its own.

    Example:
        >>> p, g = torch.ones(3), torch.ones(3)
        >>> s = init_state(p, OptimSpec(rule="adamw", state_bits=32))
        >>> p2, s2 = update(p, g, s, {"lr": 0.1, "weight_decay": 0.0}, step=1)
        >>> p2
        tensor([0.9000, 0.9000, 0.9000])
    """
    call = _prepare(param, grad, state, hparams, step)
    rows, clip = _scalar_rows(call, skip_zeros, max_unorm, maximize)
    new_params: list[Tensor | None] = [None] * len(call.params)
    new_states: list[tuple | None] = [None] * len(call.params)
    with torch.no_grad():
        for (device, _, layout), idx in _groups(call.params, call.states):
            ps = list(map(Tensor.contiguous, map(Tensor.detach, map(call.params.__getitem__, idx))))
            gs = list(map(Tensor.contiguous, map(Tensor.detach, map(call.grads.__getitem__, idx))))
            ss = [t for i in idx for t in call.states[i]]
            out_p, out_s = ops.step(
                ps, gs, ss, rows[device], layout.rule, layout.format, layout.block_size,
                layout.present, skip_zeros, clip,
            )
            per = len(layout.field_names())
            make = type(call.states[idx[0]])._make
            for k, i in enumerate(idx):
                new_params[i] = out_p[k]  # the op's outputs have their inputs' shapes
                new_states[i] = make(out_s[k * per : (k + 1) * per])
    return _unflatten(new_params, call.spec), _unflatten(new_states, call.spec)


def update_(
    param: Any, grad: Any, state: Any, hparams: Any = None, step: Any = 1, *, skip_zeros: bool = False,
    max_unorm: float = 0.0, maximize: bool = False,
) -> tuple[Any, Any]:
    """The same step as :func:`update`, written into ``param`` and ``state`` in place.

    Returns ``(param, state)`` (the same objects) for symmetry with :func:`update`. Repeated calls on
    the same params and states reuse the validated plan and its address tables (see :func:`_plan`); the
    cache of plans keeps no tensor alive.
    """
    # flat dicts and lists without a type check of each leaf: a cached plan confirms its params and states
    # (their classes, addresses and shapes), a new plan checks them, and the grad checks below fail on
    # anything not a Tensor
    params, p_spec = _fast_leaves(param)
    states, s_spec = _fast_leaves(state)
    if params is None or states is None:
        params, p_spec = _flatten(param)
        states, s_spec = _flatten(state, is_leaf=is_state)
    plan = _plan(params, states, p_spec, s_spec) if params else None
    if plan is None:
        return _update_generic_(param, grad, state, hparams, step, skip_zeros, max_unorm, maximize)
    grads, g_spec = _fast_leaves(grad)
    if grads is None:
        grads, g_spec = _flatten(grad)
    # the common case in one call over all grads (compiled where possible: see bnbf/_host_checks.py); the
    # per-tensor checks below name what is wrong, and make non-contiguous grads contiguous
    ok = g_spec == p_spec and plan.fits(grads)
    if not ok:
        grads, g_spec = _flatten(grad)
        if g_spec != p_spec:
            raise ValueError(f"grad structure {g_spec} does not match param structure {p_spec}")
        for i, (p, g) in enumerate(zip(params, grads)):
            if not _grads_ok([p], [g]):
                _check_leaf(_names(param)[i], p, g, states[i])
        grads = [g if g.is_contiguous() else g.contiguous() for g in grads]
    h = plan.rule.make_hparams(hparams)
    if present_mask(plan.rule, h) != plan.present:
        _check_present(plan.rule, h, states)
    _check_step(step)
    values, clip = _scalars(plan.rule, h, step, skip_zeros, max_unorm, maximize)
    if any(isinstance(v, Tensor) for v in values):
        rows = {d: as_scalar_row(values, d) for d in plan.devices}
    else:  # Python numbers reach the kernel as arguments: nothing to upload
        floats = tuple(map(float, values))
        rows = dict.fromkeys(plan.devices, floats)
    with torch.no_grad():
        if plan.interpreted:  # Triton's interpreter runs one launch at a time (see bnbf._dispatch)
            with INTERPRETER_LOCK:
                _launch_plan(plan, grads, rows, skip_zeros, clip)
        else:
            _launch_plan(plan, grads, rows, skip_zeros, clip)
    return param, state


def _launch_plan(plan: _Plan, grads: list, rows: dict, skip_zeros: bool, clip: bool) -> None:
    for pick, group in plan.groups:
        launch_group(group, grads if pick is None else pick(grads), rows[group.device], skip_zeros, clip)


@dataclasses.dataclass(eq=False)
class _Plan:
    """Validated params and states of an in-place call, grouped, with their kernel address tables.

    Holds none of the params and states (a cache that kept them would keep a dropped model's memory): a
    plan is reused for the tensors it was built for, as far as it can tell, i.e. the tensors it reads and
    writes: params and state fields at the planned addresses, the params (and grads) of the planned shapes,
    dtypes and devices and contiguous, states of the planned classes (layouts). Weak references to the
    planned tensors mark it dead when one of them is freed; the cache then drops it.
    """

    refs: list  # weakref.ref to each param, then to each state field
    n_params: int
    ptrs: tuple[int, ...]  # data_ptr of each param
    field_ptrs: tuple[int, ...]  # data_ptr of each state field, state by state
    types: tuple  # the class (layout) of each state
    rule: Any
    devices: set
    groups: list
    present: int  # the state slots every state of the plan keeps
    host: Any  # the per-step checks (bnbf._host_checks.impl())
    fits: Any  # params or grads -> whether they have the planned shapes, dtypes, devices and are contiguous
    states_match: Any  # (states, types, field ptrs) -> bool (bnbf._host_checks.states_matcher)
    interpreted: bool  # CPU tensors under TRITON_INTERPRET=1: launches go through Triton's interpreter
    alive: bool = True  # False once a planned tensor was freed

    @property
    def params(self) -> list:
        """The planned params (None for one since freed)."""
        return [r() for r in self.refs[: self.n_params]]

    def confirms(self, params: list, states: list) -> bool:
        """Whether this plan steps these params and states correctly: C-level checks only (per step)."""
        return (
            self.alive
            and self.host.ptrs_equal(params, self.ptrs)
            and self.fits(params)  # a param resized or transposed in place keeps its address
            and self.states_match(states, self.types, self.field_ptrs)
        )


_SHAPE_DTYPE = operator.attrgetter("shape", "dtype")
_STRIDED = {torch.strided}
_PARAM_DTYPE_SET = set(_PARAM_DTYPES)


_PLANS: collections.OrderedDict = collections.OrderedDict()
_PLAN_CACHE_SIZE = 32  # one per (optimizer, param group, override bucket) in use
_PLANS_LOCK = threading.Lock()  # threads stepping different params share the cache
_DEAD: list = []  # keys of plans marked dead by a weakref callback, dropped at the next lookup
_TEMPLATE_BASES: dict = {}  # (dtype, device) -> a one-element tensor the templates expand


def _died(plan_ref: weakref.ref, key: tuple, _tensor_ref: Any) -> None:
    # runs wherever a planned tensor is freed (possibly inside a cache update of this very thread), so it
    # takes no lock and leaves the cache alone: the next _plan call drops the plan
    plan = plan_ref()
    if plan is not None and plan.alive:
        plan.alive = False
        _DEAD.append(key)


def _drop_dead() -> None:
    with _PLANS_LOCK:
        while _DEAD:
            key = _DEAD.pop()
            plan = _PLANS.get(key)
            if plan is not None and not plan.alive:
                del _PLANS[key]


def _templates(params: list) -> list[Tensor]:
    """Stand-ins with each param's shape, dtype and device and no memory of their own (an expanded
    one-element tensor): the plan checks later params and grads against them without holding the params."""
    out = []
    for p in params:
        key = (p.dtype, p.device)
        base = _TEMPLATE_BASES.get(key)
        if base is None:
            base = _TEMPLATE_BASES.setdefault(key, torch.empty((), dtype=p.dtype, device=p.device))
        out.append(base.expand(p.shape))
    return out


def _plan(params: list, states: list, p_spec: Any, s_spec: Any) -> _Plan | None:
    """The cached plan for these params and states, or None where the generic path must run (CPU
    reference, non-contiguous params, tracing, or anything to report as an error)."""
    if torch.compiler.is_compiling() or s_spec != p_spec or len(states) != len(params):
        return None
    if _DEAD:
        _drop_dead()
    # found by a few ids (a hint only: an id may be reused once its object is freed), then confirmed
    key = (id(params[0]), id(params[-1]), id(states[0]), id(states[-1]), len(params))
    plan = _PLANS.get(key)
    if plan is not None:
        if plan.confirms(params, states):
            with _PLANS_LOCK:
                if _PLANS.get(key) is plan:
                    _PLANS.move_to_end(key)
            return plan
        with _PLANS_LOCK:
            if _PLANS.get(key) is plan:
                del _PLANS[key]
    # plain tensors only: the per-step checks read other subclasses' metadata differently (generic path)
    if not (all(map(_is_plain, params)) and _states_ok(params, states) and all(map(use_triton, params))
            and all(map(Tensor.is_contiguous, params))):  # fmt: skip
        return None
    rules = {type(s).layout.rule for s in states}
    if len(rules) != 1:
        return None
    rule_name = rules.pop()
    presents = {type(s).layout.present for s in states}
    if len(presents) != 1:
        return None
    if _overlap(params, states) is not None:  # checked once per plan; the generic path names the two
        return None
    built = []
    with BUILD_LOCK:
        for (_, _, layout), idx in _groups(params, states):
            ps = [params[i].detach() for i in idx]
            ss = [t for i in idx for t in states[i]]
            group = build_group(ps, ps, ss, ss, layout.rule, layout.format, layout.block_size, layout.present)
            built.append((idx, group))
    devices = {p.device for p in params}
    if len(built) == 1:
        built = [(None, built[0][1])]  # one group of every tensor in order: the grads list as it is
    else:  # each group's grads picked in one C-level call (a tuple, also for one index)
        built = [(_picker(idx), group) for idx, group in built]
    fields = list(itertools.chain.from_iterable(states))
    plan = _Plan(
        [], len(params), tuple(map(Tensor.data_ptr, params)), tuple(map(Tensor.data_ptr, fields)),
        tuple(map(type, states)), get_rule(rule_name), devices, built, presents.pop(), host_checks.impl(),
        host_checks.grads_matcher(_templates(params)), host_checks.states_matcher(),
        any(d.type == "cpu" for d in devices),
    )  # fmt: skip
    died = functools.partial(_died, weakref.ref(plan), key)
    plan.refs = [weakref.ref(t, died) for t in (*params, *fields)]
    with _PLANS_LOCK:
        _PLANS[key] = plan
        _PLANS.move_to_end(key)
        while len(_PLANS) > _PLAN_CACHE_SIZE:
            _PLANS.popitem(last=False)
    return plan


def _picker(idx: list[int]):
    get = operator.itemgetter(*idx)
    return get if len(idx) > 1 else (lambda items: (get(items),))


def _update_generic_(
    param: Any, grad: Any, state: Any, hparams: Any, step: Any, skip_zeros: bool, max_unorm: Any, maximize: Any
) -> tuple[Any, Any]:
    """In-place step without a cached plan: every check, then one op call per group."""
    call = _prepare(param, grad, state, hparams, step)
    rows, clip = _scalar_rows(call, skip_zeros, max_unorm, maximize)
    with torch.no_grad():
        for (device, _, layout), idx in _groups(call.params, call.states):
            ps = [call.params[i].detach() for i in idx]
            work = [p if p.is_contiguous() else p.contiguous() for p in ps]
            gs = [call.grads[i].detach().contiguous() for i in idx]
            ss = [t for i in idx for t in call.states[i]]
            ops.step_(
                work, gs, ss, rows[device], layout.rule, layout.format, layout.block_size,
                layout.present, skip_zeros, clip,
            )  # fmt: skip
            for p, w in zip(ps, work):
                if w is not p:
                    p.copy_(w)
    return param, state


def dequantize_state(state: Any) -> Any:
    """Float32 view of a state: ``{"exp_avg": ..., "exp_avg_sq": ...}`` per tensor (torch.optim's names).

    For a pytree of states, returns the same structure with a dict in place of each state.
    """
    if is_state(state):
        layout: Layout = type(state).layout
        out = {}
        for slot in layout.slots():
            t = getattr(state, slot.name)
            if layout.quantized:
                absmax = getattr(state, slot.name + "_absmax")
                out[slot.name] = dequantize_state_reference(t, absmax, layout.format, slot.signed, layout.block_size)
            else:
                out[slot.name] = t.clone()
        export = get_rule(layout.rule).export
        return out if export is None else export(out)
    leaves, spec = pytree.tree_flatten(state, is_leaf=is_state)
    if not leaves or not all(is_state(s) for s in leaves):
        raise TypeError("dequantize_state expects a bnbf state or a pytree of them")
    return pytree.tree_unflatten([dequantize_state(s) for s in leaves], spec)


def hparams_for(rule: str, hparams: Mapping | None = None, **kwargs) -> Any:
    """The validated hyperparameter dataclass of ``rule`` from a mapping and/or keywords."""
    merged = dict(hparams or {}, **kwargs)
    return get_rule(rule).make_hparams(merged)

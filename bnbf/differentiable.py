"""The differentiable step: ``bnbf.update(..., differentiable=True)`` (torch.optim's name for it).

The step of every rule written in differentiable torch ops: the rule's own pure-torch reference
(:func:`bnbf.reference.step_math`, the same math the reference path runs), with no in-place write, no
``torch.no_grad`` and no read of a value on the host. Eager autograd, ``torch.func.grad``/``vjp``/``jacrev``
and ``jvp`` then give the true derivatives of the new params and states with respect to the params, the grads,
the states and the hyperparameters (0-d tensors), through one step or several (TorchOpt's MetaAdam is the
model). Only 32-bit states: an 8-bit state is rounded to codes, which have no derivative.

The rule's scalars are computed in float64, from numbers as from 0-d tensors (a tensor lr or step steps as the same
number does); the step itself runs in the params' dtype promoted to at least float32, so float64 params with float64
state (``torch.func``/``gradcheck`` style) are stepped in float64 throughout.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor
from torch._C import _functorch

from bnbf._host_checks import (
    _check_grad,
    _check_is_state,
    _check_members,
    _check_no_overlap,
    _check_present,
    _check_writable,
    _flatten,
    _hparams_traced,
    _names,
    _structures,
    _unflatten,
    check_hparam_values,
    check_leaf_writable,
    check_no_repeats,
    check_steps,
    check_update_options,
    differentiated,
    hparam_tensors,
    replace_hparam_tensors,
    unaddressable,
)
from bnbf.reference import step_math
from bnbf.rules import get_rule
from bnbf.state import is_state

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_STATE_FLOATS = (torch.float32, torch.float64)


def update(
    param: Any,
    grad: Any,
    state: Any,
    hparams: Any = None,
    step: Any = 1,
    *,
    skip_zeros: bool = False,
    max_unorm: Any = 0.0,
    maximize: bool = False,
    grad_scale: Tensor | None = None,
) -> tuple[Any, Any]:
    """:func:`bnbf.update` with ``differentiable=True``: the same step as new tensors that keep their history.

    Args:
        param: a tensor or pytree of tensors (float16, bfloat16, float32 or float64).
        grad: gradients in the same structure, each of its param's shape, dtype and device.
        state: 32-bit states from :func:`bnbf.init_state` (``OptimSpec(state_bits=32)``), same structure;
            their fields may be float64 (e.g. ``tree_map(torch.Tensor.double, state)``) for float64 params.
        hparams: a mapping with torch.optim's names or the rule's hparams dataclass; Python numbers or 0-d
            tensors, which may require grad (meta-gradients).
        step: 1-based index of this update (int or 0-d int32/int64 tensor).
        skip_zeros, max_unorm, maximize: as for :func:`bnbf.update`.
        grad_scale: max_grad_norm's coefficient, applied to each grad in the compute dtype, as the default step
            scales a grad as it loads it (a 16-bit product would round the clipped grad).

    Returns:
        ``(new_param, new_state)``: new tensors in the inputs' structures, params in their dtypes, state fields
        in theirs; differentiable with respect to every tensor input.

    Example:
        >>> import torch, bnbf
        >>> p = torch.ones(3, dtype=torch.float64, requires_grad=True)
        >>> lr = torch.tensor(0.1, dtype=torch.float64, requires_grad=True)
        >>> s = bnbf.init_state(torch.ones(3), bnbf.OptimSpec(rule="sgd", state_bits=32))
        >>> p2, _ = bnbf.update(p, torch.ones(3, dtype=torch.float64), s, {"lr": lr}, 1, differentiable=True)
        >>> torch.autograd.grad(p2.sum(), lr)[0]
        tensor(-3., dtype=torch.float64)
    """
    from bnbf import compose  # compose builds on bnbf, which imports this module (no functools.cache: Dynamo warns)

    if not compose.is_shared_hparams(hparams) or not compose._one_rule_tree(state):
        # schedules, per-rule, per-leaf and tree forms, mixed rules: resolved and grouped as the default step
        # groups them, each group stepped here
        return compose.differentiable_update(
            param, grad, state, hparams, step, skip_zeros=skip_zeros, max_unorm=max_unorm, maximize=maximize,
            grad_scale=grad_scale,
        )  # fmt: skip
    params, grads, states, p_spec = _structures(param, grad, state)
    names = _names(param) if len(params) > 1 or p_spec != "leaf" else [""]
    for name, p, g, s in zip(names, params, grads, states):
        _check_leaf(name, p, g, s)
    check_apart(param, params, states)
    rules = {type(s).layout.rule for s in states}
    if len(rules) != 1:
        raise ValueError(f"the states are for several rules ({sorted(rules)}); one call steps one rule")
    rule = get_rule(rules.pop())
    checked, h = _make_hparams(rule, hparams)
    _check_present(rule, checked, states)
    _check_no_slot_dropped(rule, checked, h)
    check_steps(step)
    clip = check_update_options(rule, skip_zeros, max_unorm, maximize)
    # tensors among them computed in float64 as the host computes numbers (a number's power of an int tensor would
    # be float32: 1 - 0.999**t loses digits), so a tensor lr or step steps as the number does; .double() is derivable
    found = hparam_tensors(h, step, max_unorm)
    if found:
        h, step, max_unorm = replace_hparam_tensors(h, step, max_unorm, iter([t.double() for _, t in found]))
    scalars = rule.scalars(h, step)
    check_hparam_values((*scalars, max_unorm, h.lr), h, max_unorm)  # the values _as reads
    new_params, new_states = [], []
    for p, g, s in zip(params, grads, states):
        dt = torch.promote_types(p.dtype, torch.float32)
        sc = rule.scalar_names(*(_as(v, dt, p.device) for v in scalars))
        slots = [j for j in range(len(rule.states)) if (type(s).layout.present >> j) & 1]
        values: list = [None] * len(rule.states)
        for j, field in zip(slots, s):
            values[j] = field.to(dt)
        g = g.to(dt)
        if grad_scale is not None:
            g = g * grad_scale.to(p.device)
        if maximize:
            g = -g
        new_p, out, finite = step_math(
            rule,
            p.to(dt),
            g,
            values,
            sc,
            _as(max_unorm, dt, p.device),
            _as(h.lr, dt, p.device),
            skip_zeros,
            clip,
            derivable=True,
        )
        new_params.append(new_p.to(p.dtype))
        # a non-finite gradient element zeroes its states (as the kernels and the reference path)
        fields = [torch.where(finite, out[j], torch.zeros_like(out[j])).to(f.dtype) for j, f in zip(slots, s)]
        new_states.append(type(s)._make(fields))
    return _unflatten(new_params, p_spec), _unflatten(new_states, p_spec)


def check_apart(param: Any, params: list, states: list) -> None:
    """The core's refusal of a param listed twice, a state shared by two leaves, or leaves sharing memory (the same
    tensor would come back with two new values, or lose one of its steps in place). Tensors without addresses to
    compare (under a torch.func transform, traced, subclasses) are compared by identity."""
    if unaddressable(params, [t for s in states if is_state(s) for t in s]):
        check_no_repeats(param, params, states)
    else:
        _check_no_overlap(param, params, states)


def _check_no_leaf_written(param: Any, params: list, states: list) -> None:
    """Before the first write: autograd refuses to write a leaf that requires grad (or a view of one) in place, and
    raised on it after the leaves before it were written."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return
    for name, p, s in zip(_names(param), params, states):
        for where, t in ((f"param{name}", p), *((f"state{name}.{f}", x) for f, x in zip(s._fields, s))):
            check_leaf_writable(where, t, ", or use bnbf.update")


def _as(v: Any, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A scalar as a 0-d tensor of the compute dtype (a tensor keeps its history)."""
    if isinstance(v, Tensor):
        return v.to(device=device, dtype=dtype).reshape(())
    return torch.scalar_tensor(v, dtype=dtype, device=device)  # a traced SymFloat too, unread


def _check_leaf(name: str, p: Any, g: Any, s: Any) -> None:
    if not isinstance(p, Tensor) or p.dtype not in _FLOATS or p.layout != torch.strided:
        got = f"{p.dtype} {p.layout}" if isinstance(p, Tensor) else type(p).__name__
        raise TypeError(f"param{name} must be a dense float16, bfloat16, float32 or float64 tensor, got {got}")
    _check_grad(name, p, g)
    _check_is_state(name, s)
    layout = type(s).layout
    if layout.quantized:
        raise ValueError(
            f"state{name} is 8-bit: differentiable=True needs 32-bit state (OptimSpec(state_bits=32)); 8-bit "
            "states are rounded to codes, which have no gradient"
        )
    for field, t in zip(type(s)._fields, s):
        if not isinstance(t, Tensor) or tuple(t.shape) != tuple(p.shape) or t.dtype not in _STATE_FLOATS:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(
                f"state{name}.{field} does not fit the param: expected float32 or float64 {tuple(p.shape)}, got {got}"
            )
        if t.device != p.device:
            raise ValueError(f"state{name}.{field} is on {t.device} but the param is on {p.device}")


def _detached(v: Any) -> Any:
    if isinstance(v, Tensor):
        return v.detach()
    if type(v) is tuple:
        return tuple(map(_detached, v))
    return v


def _check_no_slot_dropped(rule: Any, checked: Any, h: Any) -> None:
    """Refuse a derivative asked with respect to a hyperparameter whose value drops a state slot (SGD's momentum
    at 0 keeps no buffer): the step would not depend on it, and its derivative came back zero under torch.func.
    ``checked``: the detached hyperparameters, ``h``: the same with the caller's tensors."""
    present = rule.slots_present(checked)
    if all(present) or torch.compiler.is_compiling():
        return
    live, values = hparam_tensors(h), hparam_tensors(checked)
    if len(live) != len(values):  # values read per member under vmap: present() kept every slot there
        return
    for (name, t), (_, v) in zip(live, values):
        if not differentiated([t]):
            continue
        nan = iter([torch.full_like(x, float("nan")) if x is v else x for _, x in values])
        if rule.slots_present(replace_hparam_tensors(checked, None, 0.0, nan)[0]) != present:
            dropped = [slot.name for slot, keep in zip(rule.states, present) if not keep]
            raise ValueError(
                f"a derivative is asked with respect to {name}, whose value {float(v)} keeps no {dropped} in the "
                f"state: the step does not depend on it there, so its derivative would be lost (zero); ask at "
                "another value, or pass it as a number"
            )


def _make_hparams(rule: Any, hparams: Any) -> tuple[Any, Any]:
    """The rule's hparams validated on detached values (reading a value of a tensor that requires grad warns),
    and the same holding the caller's tensors, so derivatives reach them."""
    if torch.compiler.is_compiling():  # traced: the values stay graph inputs, unread (see _prepare_traced)
        h = _hparams_traced(rule, hparams)
        return h, h
    if hparams is None or dataclasses.is_dataclass(hparams) or not isinstance(hparams, Mapping):
        h = rule.make_hparams(hparams)
        return h, h
    items = dict(hparams)
    checked = rule.make_hparams({k: _detached(v) for k, v in items.items()})
    batched = [t for _, t in hparam_tensors(items) if _functorch.is_batchedtensor(t)]
    if batched:  # per-member values under vmap, which make_hparams cannot read: each checked as a number
        _check_members(rule, items, batched)
    h = copy.copy(checked)
    for k, v in items.items():
        object.__setattr__(h, k, v)  # the frozen dataclass, checked, with the caller's values
    return checked, h


def _live(t: Any) -> Any:
    """A state field or param that is a view (rows of one tensor: bnbf_nn's AdEMAMix stacks its first moments; a
    param a slice of a flat buffer) as a view of its base made now, under grad mode: autograd forbids writing
    through a view made under no_grad (as states are made), and reading one would lose its base's history."""
    if isinstance(t, Tensor) and t._base is not None and not torch.compiler.is_compiling():  # traced: no _base
        base = t._base
        # fwAD.make_dual's result is a view of a primal without a tangent: written through that base, the new
        # values would land but the view's tangent would stay the old one
        if base.dtype == t.dtype and base.device == t.device and not _tangent_only_on(t, base):
            return base.as_strided(t.size(), t.stride(), t.storage_offset())  # a dtype view stays as it is
    return t


def _tangent_only_on(view: Tensor, base: Tensor) -> bool:
    return fwAD.unpack_dual(view).tangent is not None and fwAD.unpack_dual(base).tangent is None


def update_(
    param: Any,
    grad: Any,
    state: Any,
    hparams: Any = None,
    step: Any = 1,
    *,
    skip_zeros: bool = False,
    max_unorm: Any = 0.0,
    maximize: bool = False,
    grad_scale: Tensor | None = None,
) -> tuple[Any, Any]:
    """:func:`bnbf.update_` with ``differentiable=True``: torch.optim's differentiable in-place step.

    The step of :func:`update` on clones of the inputs, written into the params and the state fields with
    ``copy_``, which autograd records: the params and states afterwards carry the step's history, as after a
    ``torch.optim`` step with ``differentiable=True``. As there, a param that is a leaf requiring grad cannot be
    written in place under grad mode (torch's error); step a non-leaf (e.g. ``p = p0.clone()``) or a
    ``torch.func.functional_call`` copy.

    Args:
        param, grad, state, hparams, step, skip_zeros, max_unorm, maximize: as for :func:`update`.

    Returns:
        ``(param, state)``, the same objects, written.

    Example:
        >>> import torch, bnbf
        >>> p0 = torch.ones(3, dtype=torch.float64, requires_grad=True)
        >>> p = p0.clone()  # a non-leaf: written in place, with its history
        >>> s = bnbf.init_state(torch.ones(3), bnbf.OptimSpec(rule="sgd", state_bits=32))
        >>> _ = bnbf.update_(p, 2 * p, s, {"lr": 0.1}, 1, differentiable=True)  # p = p0 - 0.1 * 2 * p0
        >>> torch.autograd.grad(p.sum(), p0)[0]
        tensor([0.8000, 0.8000, 0.8000], dtype=torch.float64)
    """
    clone = lambda t: t.clone() if isinstance(t, Tensor) else t
    params, p_spec = _flatten(param)
    states, s_spec = _flatten(state, is_leaf=is_state)
    fields = [t for s in states if is_state(s) for t in s]
    if all(map(is_state, states)) and all(isinstance(t, Tensor) for t in params + fields):  # else update's error
        # as the in-place step without differentiable=True: a param listed twice would lose one of its steps, a
        # state field that is a param would overwrite it
        check_apart(param, params, states)
        if not unaddressable(params, fields):
            _check_writable(param, params, states)
        _check_no_leaf_written(param, params, states)
    copies_p = _unflatten([clone(_live(p)) for p in params], p_spec)
    copies_s = _unflatten([type(s)._make(clone(_live(t)) for t in s) if is_state(s) else s for s in states], s_spec)
    new_p, new_s = update(
        copies_p, grad, copies_s, hparams, step, skip_zeros=skip_zeros, max_unorm=max_unorm, maximize=maximize,
        grad_scale=grad_scale,
    )  # fmt: skip
    new_states = _flatten(new_s, is_leaf=is_state)[0]
    if torch.compiler.is_compiling():
        for s, n in zip(states, new_states):
            if any(a._base is not None and b.requires_grad for a, b in zip(s, n)):
                # traced, a view's base is not reachable (_live), and writing stale views is autograd's error
                raise NotImplementedError(
                    "differentiable=True under torch.compile through a state whose fields are rows of one tensor "
                    "(bnbf_nn's AdEMAMix keeps its two first moments so), with grads that carry a history: not "
                    "supported; the eager step supports it"
                )
    for p, n in zip(params, _flatten(new_p)[0]):
        _live(p).copy_(n)  # a param that is a view (rows of a flat buffer) written as the states' rows are
    for s, n in zip(states, new_states):
        for a, b in zip(s, n):
            _live(a).copy_(b)  # each view made just before its write: an earlier row's write changed the base
    return param, state

"""The functional core: ``init_state``, ``update`` (pure), ``update_`` (in place), ``dequantize_state``.

Every check runs before any tensor is written, so a call that raises leaves params, grads and states
exactly as they were. The checks are :mod:`bnbf._host_checks`; ``update_`` steps through a
:class:`bnbf.plan.Plan` (see :func:`bnbf.plan`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import weakref
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch._C import _functorch
from torch.autograd import forward_ad
from torch.utils import _pytree as pytree

from bnbf import _vmap_memo, ops
from bnbf._bounded import Bounded
from bnbf._dispatch import is_dtensor, use_triton
from bnbf._host_checks import (
    NATIVE,
    MixedRulesError,
    _Call,
    _check_param,
    _check_present,
    _check_step,
    _fast_leaves,
    _flatten,
    _groups,
    _plain,
    _prepare,
    _prepare_traced,
    _unflatten,
    check_clip_not_differentiated,
    check_not_differentiated,
    differentiated,
    hparam_tensors,
    keystr,
    leaves_of,
    own_dispatch,
    subclass_scalar_error,
    type_name,
    unaddressable,
    walked,
)
from bnbf.differentiable import update as differentiable_update
from bnbf.differentiable import update_ as differentiable_update_
from bnbf.packed import PackedState, pack_state
from bnbf.packed import update as packed_update
from bnbf.plan import (  # noqa: F401 - _PLANS: tests read update_'s cache
    _DEAD,
    _NUMBERS,
    _PLANS,
    OutputRecords,
    _cached,
    _drop_dead,
    _one_set,
    _scalars,
    _step_generic,
    call_scalars,
    fed_back,
    fields_planned,
)
from bnbf.quant import dequantize_state_reference
from bnbf.rules import get_rule
from bnbf.state import Layout, OptimSpec, is_state, new_state, present_mask


def init_state(param: Any, spec: OptimSpec, hparams: Any = None, *, packed: bool = False) -> Any:
    """Zero optimizer state for a tensor or a pytree of tensors.

    Args:
        param: a tensor, or a dict/list/tuple pytree of tensors (e.g. ``dict(model.named_parameters())``).
            float64 params (gradcheck, meta-learning in float64) get float64 32-bit state, for
            ``update(..., differentiable=True)``; 8-bit state of them is refused.
        spec: the :class:`OptimSpec` (rule and storage).
        hparams: the hyperparameters the state will be updated with, where they decide which states are
            kept or their initial values (SGD/RMSprop momentum, RMSprop centered, Adagrad's
            initial_accumulator_value); the rule's defaults otherwise.
        packed: return a :class:`bnbf.packed.PackedState`, the same state in a few flat buffers (one per param
            dtype, layout and field), which ``torch.func.vmap`` and ``torch.compile`` handle at a cost per buffer
            rather than per tensor; ``update``/``update_`` take it as they take the per-param state. One
            ``OptimSpec`` (one rule), one device, not paged.

    Returns:
        A state NamedTuple per tensor, in the same pytree structure. 8-bit states hold uint8 codes and
        float32 per-block absmax; tensors smaller than ``spec.min_8bit_size`` get float32 state.

    Example:
        >>> p = torch.zeros(4096)
        >>> s = init_state(p, OptimSpec(rule="adamw"))
        >>> type(s).__name__, s.exp_avg.dtype
        ('adamw_state_8bit_power_b256_s3', torch.uint8)
    """
    if packed is not False:
        if packed is not True:
            raise TypeError(f"packed must be a bool, got {type_name(packed)}")
        if not isinstance(spec, OptimSpec) or spec.paged:
            raise ValueError("a packed state takes one OptimSpec (one rule), not paged")
        if any(map(is_dtensor, _flatten(param)[0])):
            raise ValueError("a packed state does not hold DTensor (FSDP2) params' state; use bnbf.distributed")
        wide = [
            keystr(k) for k, p in pytree.tree_flatten_with_path(param)[0] if getattr(p, "dtype", None) == torch.float64
        ]
        if wide:  # they step only differentiably, which the packed state does not
            raise TypeError(
                f"param{wide[0]} has dtype torch.float64: float64 params step only with differentiable=True, which "
                f"takes the per-param state (init_state without packed=True)"
            )
        return pack_state(init_state(param, spec, hparams), param)
    if not isinstance(spec, OptimSpec) or not _shared(hparams):
        if isinstance(spec, OptimSpec) or callable(spec) or isinstance(spec, (Mapping, list, tuple)):
            return _compose().init_state(param, spec, hparams)  # per-leaf specs or hyperparameters
        raise TypeError(f"spec must be an OptimSpec, a pytree of them or a callable, got {type(spec).__name__}")
    leaves, treespec = pytree.tree_flatten_with_path(param)
    if not leaves:
        raise ValueError("init_state needs at least one tensor")
    if any(map(is_dtensor, (p for _, p in leaves))):
        return _distributed().init_state(param, spec, hparams)  # FSDP2's sharded params: the local shards' state
    for path, p in leaves:
        _check_param(p, keystr(path), wide=True)
        if p.dtype == torch.float64 and spec.layout_for(p.numel()).quantized:
            raise TypeError(
                f"param{keystr(path)} has dtype torch.float64: float64 params take 32-bit state only (their "
                f"step is the differentiable one); pass OptimSpec(state_bits=32) (bnbf_nn: a 32-bit class or "
                f"optim_bits=32)"
            )
    get_rule(spec.rule).make_hparams(hparams)  # bad hyperparameters fail before anything is built
    return pytree.tree_unflatten([_new_state(p.detach(), spec, hparams) for _, p in leaves], treespec)


def _new_state(p: Tensor, spec: OptimSpec, hparams: Any) -> tuple:
    """A param's initial state; under ``vmap`` one of its own per member (not one state expanded over the
    members, sharing memory): a member's initial state is the same for every member, so each field is made
    for one member and given the batch by adding the zeros that ``new_zeros`` makes per member."""
    if not _functorch.is_batchedtensor(p):
        return new_state(p, spec, hparams)
    one = new_state(torch.empty(p.shape, dtype=p.dtype, device=p.device), spec, hparams)
    return type(one)._make(f + p.new_zeros(f.shape, dtype=f.dtype) for f in one)


def update(
    param: Any,
    grad: Any,
    state: Any,
    hparams: Any = None,
    step: Any = 1,
    *,
    skip_zeros: bool = False,
    max_unorm: float = 0.0,
    maximize: bool = False,
    differentiable: bool = False,
    max_grad_norm: Any = None,
) -> tuple[Any, Any]:
    """One optimizer step, purely: returns ``(new_param, new_state)`` and modifies no input.

    Args:
        param: a tensor or pytree of tensors (float32, float16 or bfloat16).
        grad: gradients in the same structure, each of its param's shape, dtype and device.
        state: from :func:`init_state` (or a previous ``update``), same structure; or a
            :class:`bnbf.packed.PackedState` (``init_state(..., packed=True)``), returned as one.
        hparams: a mapping with torch.optim's names (``lr``, ``betas``, ``eps``, ``weight_decay``...) or
            the rule's hparams dataclass; Python numbers or 0-d tensors. Missing keys take defaults.
        step: 1-based index of this update (int or 0-d int32/int64 tensor), for bias correction.
        skip_zeros: (a bool) gradient elements that are exactly 0 leave their param element and states unchanged
            (sparse updates such as embedding rows; for 8-bit states "unchanged" is up to requantization
            with the block's new absmax).
        max_unorm: if > 0, each tensor's update is scaled down so that its norm is at most
            ``max_unorm * ||p||`` (bitsandbytes' update clipping; the update is measured per unit of
            learning rate, ``(p_new - p) / lr``). Costs a norm pass. Not for rules with their own norms
            (LAMB, LARS). A number or a 0-d tensor; a tensor on a device is not read (no host sync), so a
            negative one is not refused there: the step clips where it is > 0.
        maximize: step along the gradient instead of against it (torch.optim's ``maximize``).
        differentiable: write the step in differentiable torch ops (torch.optim's name), so that autograd and
            ``torch.func`` give the true derivatives of the outputs with respect to params, grads, states and
            0-d tensor hyperparameters (:mod:`bnbf.differentiable`). Needs 32-bit state; accepts float64
            params and states. Without it, asking for such a derivative raises (never a silent zero).
        max_grad_norm: if given, the grads are clipped to this global norm, as
            ``torch.nn.utils.clip_grad_norm_`` clips them, inside the step: the total norm from one pass of ours
            over the grads (LARS: its own norm pass; within (W/2 + 1) float32 ulps of the float64 total, for
            tiles of W elements), each grad scaled by the coefficient as the kernels load it (see
            :func:`bnbf.compose.update`).

    The state tree may mix rules, bit widths, formats and block sizes (:func:`init_state` with a tree or a
    callable of specs), and ``hparams`` may be ``{rule_name: mapping}``, a callable ``(path, param) ->
    mapping``, a pytree of mappings, and any value a schedule (a callable of the step): such calls go through
    :mod:`bnbf.compose`: one launch per (rule, state layout) on the Triton path, each tensor with its own scalars;
    elsewhere one core call per (rule, hyperparameters); equal to separate calls bit for bit.

    Returns:
        ``(new_param, new_state)`` in the input structures, all new tensors.

    Raises:
        ValueError: among others, for a param (or state) listed twice, or params or states whose memory
            overlaps (overlapping views of one tensor; disjoint views step): each leaf is stepped on its own.
        RuntimeError: where a derivative is asked for through the step without ``differentiable=True``
            (an input requires grad under grad mode, or torch.func's grad/jvp wraps it).

    Example:
        >>> p, g = torch.ones(3), torch.ones(3)
        >>> s = init_state(p, OptimSpec(rule="adamw", state_bits=32))
        >>> p2, s2 = update(p, g, s, {"lr": 0.1, "weight_decay": 0.0}, step=1)
        >>> p2
        tensor([0.9000, 0.9000, 0.9000])
    """
    if max_grad_norm is not None:
        _check_scalars_readable(param, hparams, step, max_unorm, max_grad_norm, in_place=False)
    if type(state) is PackedState:
        return _packed_update(param, grad, state, hparams, step, skip_zeros, max_unorm, maximize, differentiable,
                              max_grad_norm, in_place=False)  # fmt: skip
    if differentiable is not False:
        _check_differentiable(differentiable)
        return differentiable_update(
            param, grad, state, hparams, step, skip_zeros=skip_zeros, max_unorm=max_unorm, maximize=maximize,
            grad_scale=_compose().grad_scale_of(grad, max_grad_norm),
        )  # fmt: skip
    opts = {"skip_zeros": skip_zeros, "max_unorm": max_unorm, "maximize": maximize}
    if max_grad_norm is not None or not _shared(hparams):
        check_clip_not_differentiated(max_grad_norm, state, in_place=False)
        return _compose().update(param, grad, state, hparams, step, max_grad_norm=max_grad_norm, **opts)
    if not torch.compiler.is_compiling() and _vmap_memo.MEMOS and _functorch.maybe_current_level() is not None:
        out = _vmapped_hit(param, grad, state, hparams, step, skip_zeros, max_unorm, maximize)
        if out is not None:
            return out
    hit = _pure_hit(param, grad, state)
    leaves = None if hit is not None else _flatten(param)[0]
    if leaves is not None and any(map(is_dtensor, leaves)):
        return _distributed().update(param, grad, state, hparams, step, **opts)
    try:
        return _update(param, grad, state, hparams, step, hit, leaves, skip_zeros, max_unorm, maximize)
    except MixedRulesError:  # raised by the checks, before anything is computed
        return _compose().update(param, grad, state, hparams, step, **opts)


def _update(param, grad, state, hparams, step, hit, leaves, skip_zeros, max_unorm, maximize):
    groups = None
    if hit is not None:  # this call's params and states are a recent pure call's outputs, as they were made
        call, groups = _checked_hit(hit, param, hparams, step, max_unorm)
    elif unaddressable(leaves, _flatten(grad)[0]):
        # traced (Dynamo-friendly checks, hyperparameters as graph values), or under vmap (no addresses)
        call = _prepare_traced(param, grad, state, hparams, step, max_unorm)
    else:
        call = _prepare(param, grad, state, hparams, step, max_unorm)
    vmapped = ops.vmap_level() is not None
    # Python numbers as kernel arguments, with no row to upload before the launch (traced: graph values)
    rows, clip = call_scalars(call, vmapped, skip_zeros, max_unorm, maximize)
    new_params: list[Tensor | None] = [None] * len(call.params)
    new_states: list[tuple | None] = [None] * len(call.params)
    if groups is None:
        groups = list(_groups(call.params, call.states))
    # vmap's batched tensors go as they are: the batching rule lays out the members itself and writes new tensors,
    # and detach and contiguous would be two batched ops a tensor (0.5 ms of a GPT-2 ensemble's call, CPU)
    with torch.no_grad():
        for (device, _, layout), idx in groups:
            if vmapped:
                ps, gs = [_vmap_input(call.params[i]) for i in idx], [_vmap_input(call.grads[i]) for i in idx]
            else:
                ps = [_plain(call.params[i]) for i in idx]
                gs = [_plain(call.grads[i]) for i in idx]
            ss = [t for i in idx for t in call.states[i]]
            out_p, out_s = ops.step(ps, gs, ss, rows[device], layout, skip_zeros, clip)
            _file(new_params, new_states, idx, out_p, out_s, type(call.states[idx[0]])._make)
    out = _unflatten(new_params, call.spec), _unflatten(new_states, call.spec)
    if not vmapped and not torch.compiler.is_compiling():
        _remember_pure(out, new_params, new_states, call, groups)
    elif vmapped:
        _vmap_memo.remember(call, groups, step, rows)
    return out


def _file(new_params: list, new_states: list, idx, out_p: list, out_s: list, make) -> None:
    """A launch group's outputs under their leaves' positions ``idx``: a param each, its state's fields (one layout:
    as many a state) made into its state type by ``make``."""
    per = len(out_s) // len(idx)
    for k, i in enumerate(idx):
        new_params[i] = out_p[k]  # the op's outputs have their inputs' shapes
        new_states[i] = make(out_s[k * per : (k + 1) * per])


_ZERO = itertools.repeat(0)  # the batch dim of every output a vmapped step wraps


def _vmapped_hit(param, grad, state, hparams, step, skip_zeros, max_unorm, maximize, in_place=False) -> Any:
    """The step under ``vmap`` of trees a recent vmapped call's full checks passed (:mod:`bnbf._vmap_memo`), with
    hyperparameters and a step (numbers, or plain 0-d tensors the same for every member) checked as every call
    checks them; then the stacked step of each
    launch group, as the full path's batching rules run it: pure, the new ``(params, states)``; in place (the
    memory checks of the full path first: params, states and grads apart), written into the stacked tensors, True.
    None where anything differs or a check fails: the full path then runs (and raises its own error)."""
    found = _vmap_memo.confirm(param, grad, state, step)
    if found is None:
        return None
    memo, level, size, (ps, gs, fs), (params, grads, states, fields) = found
    rule = memo.rule
    try:  # every call's checks of its options: an error is the full path's to raise, with its words
        tensors = hparam_tensors(hparams, step, max_unorm)
        if tensors:  # the full path's checks of 0-d tensors: none a member's, none asked a gradient of
            if _vmap_memo.wrapped_scalars(tensors):
                return None
            check_not_differentiated(param, params, grads, hparams, step, max_unorm, states, in_place=in_place)
        h = rule.make_hparams(hparams)
        if present_mask(rule, h) != memo.present:
            return None
        _check_step(step)
        with torch._C._DisableFuncTorch():  # plain tensors: their small ops pass no vmap layer (call_scalars too)
            values, clip = _scalars(rule, h, step, skip_zeros, max_unorm, maximize)
            scalars = _one_set(values, memo.device)
    except Exception:  # noqa: BLE001 - the full path raises it again, as an uncached call would
        return None
    if in_place:  # as the full path after its checks: memory apart (its own memo of the addresses), then the steps
        ops.check_vmapped_leaves_apart(param, params, grads, states, fields)
        for layout, idx, field_idx in memo.groups if size else ():  # an ensemble of no members: nothing to step
            p_in, g_in, f_in = _vmap_memo.pick(ps, gs, fs, idx, field_idx)
            with torch._C._DisableFuncTorch():
                ops._stacked_step_(p_in, g_in, [0] * len(g_in), f_in, scalars, None, layout, skip_zeros, clip, size,
                                   checked=True)  # fmt: skip
        return True
    new_params: list = [None] * len(ps)
    new_states: list = [None] * len(ps)
    add, levels = _functorch._add_batch_dim, itertools.repeat(level)
    for layout, idx, field_idx in memo.groups:
        p_in, g_in, f_in = _vmap_memo.pick(ps, gs, fs, idx, field_idx)
        zeros_p, zeros_f = [0] * len(p_in), [0] * len(f_in)
        out_p, out_s = ops._step_stacked(
            p_in, zeros_p, g_in, zeros_p, f_in, zeros_f, scalars, None, layout, skip_zeros, clip, size
        )
        out_p, out_s = list(map(add, out_p, _ZERO, levels)), list(map(add, out_s, _ZERO, levels))
        _file(new_params, new_states, idx, out_p, out_s, memo.types[idx[0]]._make)
    return _unflatten(new_params, memo.spec), _unflatten(new_states, memo.spec)


class _PureMemo(NamedTuple):
    """What a pure call's checks established of its outputs, which the next call takes as its inputs (a
    torch.func training loop): the structure, the states' types (their layouts: the rule, the kept slots), every
    output's address, dtype and sizes (one bytes object) and the launch groups. Holds no tensor."""

    spec: Any
    types: list
    planned: Any
    groups: list


# The pure step's outputs by the ids of the (param, state) trees it returned. An id is only where to look: a hit
# confirms the trees' keys, the leaves' types, and every tensor at its recorded address with its dtype and sizes,
# contiguous (one compiled pass), and checks the grads; then the outputs' checks (each leaf fits its param, no two
# share memory: fresh allocations at their recorded ranges) hold for the inputs. GPT-2's 148 tensors: the checks
# 657 -> 18 us a call (CPU, launch stubbed). A mutated, moved, resized or replaced leaf misses.
_PURE = OutputRecords()


def _remember_pure(out: tuple, params: list, states: list, call: Any, groups: list) -> None:
    if type(call.spec) is pytree.TreeSpec and not walked(call.spec):  # a tree of other nodes: the full checks
        return
    _PURE.record(out, _PureMemo(call.spec, list(map(type, states)), fields_planned([tuple(params), *states]), groups))


def _pure_hit(param: Any, grad: Any, state: Any) -> tuple | None:
    """``(memo, params, grads, states)`` where ``param`` and ``state`` hold a recent pure call's outputs as that call
    made them and the grads fit them (:data:`_PURE`), else None (the full checks)."""
    if torch.compiler.is_compiling() or not _PURE:  # traced: nothing here for Dynamo to guard on
        return None
    memo = _PURE.get((id(param), id(state)))
    if memo is None or _functorch.maybe_current_level() is not None:
        return None
    found = fed_back(memo.spec, memo.planned, memo.types, param, grad, state)
    return None if found is None else (memo, *found)


def _checked_hit(hit: tuple, param: Any, hparams: Any, step: Any, max_unorm: Any) -> tuple:
    """The rest of :func:`bnbf._host_checks._prepare`'s checks, in its order, for a :func:`_pure_hit`: those that
    read the call's hyperparameters and step, and forward-mode duals. Returns the call and its launch groups."""
    memo, params, grads, states = hit
    # no param, grad or state field requires grad under grad mode (leaves_fit): a hyperparameter or a dual can ask
    if forward_ad._current_level >= 0 or differentiated([t for _, t in hparam_tensors(hparams, step, max_unorm)]):
        check_not_differentiated(param, params, grads, hparams, step, max_unorm, states, in_place=False)
    layout = memo.types[0].layout  # every state's rule and kept slots (one rule: the recorded call's checks)
    rule = get_rule(layout.rule)
    h = rule.make_hparams(hparams)
    if present_mask(rule, h) != layout.present:
        _check_present(rule, h, states)
    _check_step(step)
    return _Call(params, grads, states, memo.spec, rule, h, step), memo.groups


def _vmap_input(t: Tensor) -> Tensor:
    """A tensor for the op under vmap: batched as it is (the batching rule lays it out), others as outside."""
    return t if _functorch.is_batchedtensor(t) else _plain(t)


def update_(
    param: Any,
    grad: Any,
    state: Any,
    hparams: Any = None,
    step: Any = 1,
    *,
    skip_zeros: bool = False,
    max_unorm: float = 0.0,
    maximize: bool = False,
    differentiable: bool = False,
    max_grad_norm: Any = None,
) -> tuple[Any, Any]:
    """The same step as :func:`update`, written into ``param`` and ``state`` in place.

    Args:
        param, grad, state, hparams, step: as for :func:`update`; ``param`` and ``state`` are written.
        skip_zeros, max_unorm, maximize, differentiable, max_grad_norm: as for :func:`update` (see below).

    Returns:
        ``(param, state)`` (the same objects) for symmetry with :func:`update`.

    Repeated calls on the same params and states step through one :class:`bnbf.plan.Plan`, kept in a small
    cache that holds no tensor alive (a plan whose tensor is freed is dropped); the same param and state
    containers (dicts, lists) passed again find their plan directly, their contents confirmed on every call
    (the keys, the very param and state objects, their memory): a container changed in place steps as a fresh
    call. A loop that owns its params and states can hold the plan itself (:func:`bnbf.plan`).

    Example:
        >>> p = {"w": torch.ones(3)}
        >>> s = init_state(p, OptimSpec(rule="adamw", state_bits=32))
        >>> _ = update_(p, {"w": torch.ones(3)}, s, {"lr": 0.1, "weight_decay": 0.0}, step=1)
        >>> p["w"]
        tensor([0.9000, 0.9000, 0.9000])

    ``differentiable=True`` has torch.optim's meaning (:func:`bnbf.differentiable.update_`): the step of
    ``update(..., differentiable=True)`` written into the params and states with ``copy_``, which autograd
    records (32-bit state; a param that is a leaf requiring grad cannot be written so under grad mode, torch's
    error). Without it a derivative asked for through the step raises (a hyperparameter tensor or a param with
    history that requires grad under grad mode, or an input wrapped by torch.func's grad/jvp); params that are
    leaves requiring grad (``nn.Parameter``) are stepped as torch.optim steps them, and grads that require
    grad are taken detached, as torch.optim takes them.
    """
    _check_scalars_readable(param, hparams, step, max_unorm, max_grad_norm, in_place=True)
    if type(state) is PackedState:
        return _packed_update(param, grad, state, hparams, step, skip_zeros, max_unorm, maximize, differentiable,
                              max_grad_norm, in_place=True)  # fmt: skip
    if differentiable is not False:
        _check_differentiable(differentiable)
        return differentiable_update_(
            param, grad, state, hparams, step, skip_zeros=skip_zeros, max_unorm=max_unorm, maximize=maximize,
            grad_scale=_compose().grad_scale_of(grad, max_grad_norm),
        )  # fmt: skip
    if max_grad_norm is not None or not _shared(hparams):
        opts = {"skip_zeros": skip_zeros, "max_unorm": max_unorm, "maximize": maximize}
        check_clip_not_differentiated(max_grad_norm, state, in_place=True)
        return _compose().update_(param, grad, state, hparams, step, max_grad_norm=max_grad_norm, **opts)
    if not torch.compiler.is_compiling():  # traced: no ids (the generic path's Dynamo-friendly checks)
        vmapped = _vmap_memo.MEMOS and _functorch.maybe_current_level() is not None
        if vmapped and _vmapped_hit(param, grad, state, hparams, step, skip_zeros, max_unorm, maximize, True):
            return param, state
        hit = _last_plan(param, state)
        if hit is not None:
            hit[0]._step(hit[1], hit[2], param, grad, hparams, step, skip_zeros, max_unorm, maximize)
            return param, state
    # flat dicts and lists without a type check of each leaf: a cached plan confirms its params and states
    # (the same objects, at their planned addresses), a new plan checks them, the step checks the grads
    params, spec = _fast_leaves(param)
    states, s_spec = _fast_leaves(state)
    if params is None or states is None:  # nested containers too: walked to their leaves, their plan cached
        params, spec = _flatten(param)
        states, s_spec = _flatten(state, is_leaf=is_state)
    found = _cached(param, params, states, spec, s_spec)
    if found is None:
        opts = {"skip_zeros": skip_zeros, "max_unorm": max_unorm, "maximize": maximize}
        if any(map(is_dtensor, params)):
            return _distributed().update_(param, grad, state, hparams, step, **opts)
        try:
            _step_generic(param, grad, state, hparams, step, skip_zeros, max_unorm, maximize)
        except MixedRulesError:  # raised by the checks, before anything is written
            return _compose().update_(param, grad, state, hparams, step, **opts)
    else:
        found._step(params, states, param, grad, hparams, step, skip_zeros, max_unorm, maximize)
        _remember(param, state, found)
    return param, state


def _remember(param: Any, state: Any, plan: Any) -> None:
    """``plan`` as update_'s last for these containers (:func:`_last_plan` finds it)."""
    key = id(param), id(state)
    ref = _LAST.get(key)
    if ref is None or ref() is not plan:  # a loop's next calls find their plan here already
        _LAST.put(key, weakref.ref(plan))


# update_'s last plan per (param container, state container), by their ids: a weak reference to the plan that
# bnbf.plan's cache owns (the plan itself holds no tensor). An id is only where to look: every call confirms
# the containers' contents against the plan (_last_plan), so a mutated or reused container is never trusted.
# Containers made anew each call leave dead ids, which the bound drops oldest first.
_LAST = Bounded(64)


def _last_plan(param: Any, state: Any) -> tuple | None:
    """``(plan, params, states)`` where the plan of update_'s last call with these containers is theirs now: the
    same keys in order (a flat dict), length (a list or tuple) or structure (a nested tree: :func:`leaves_of`
    the params and the states), the very param and state objects
    (their ids and types, in C), at their planned addresses, shapes and dtypes; else None (``update_``'s full lookup).
    This skips building two leaf lists and key tuples and the cache's id key, the lookup's own cost."""
    ref = _LAST.get((id(param), id(state)))
    if ref is None:
        return None
    found = ref()
    if found is None or not found.alive:
        return None
    t = type(param)
    if t is dict and found._keys is not None:
        if NATIVE is None:
            return None
        params, states = NATIVE.values_if_keys(param, found._keys), NATIVE.values_if_keys(state, found._keys)
        if params is None or states is None:
            return None
    elif (t is list or t is tuple) and found._spec == (t, len(param)):
        if type(state) is not t or len(state) != len(param):
            return None
        params, states = param, state
    elif found._spec == "leaf":
        params, states = [param], [state]
    elif walked(found._spec):  # nested: the params and states walked, their structure the plan's
        params, states = leaves_of(param, found._spec), leaves_of(state, found._spec, states=True)
        if params is None or states is None:
            return None
    else:
        return None
    if _DEAD:
        _drop_dead()
    if not (found._same(params, states) and found._confirm(params, states)):
        return None
    # the most recently used in the cache that owns it (as update_'s full lookup leaves it), so that other
    # plans made meanwhile evict idle plans first; one C call (KeyError: evicted by another thread just now)
    try:  # noqa: SIM105 - contextlib.suppress costs a context manager per call
        _PLANS.move_to_end(found._key)  # the key of these very objects (confirmed above), as _cached made it
    except KeyError:
        pass
    return found, params, states


def dequantize_state(state: Any) -> Any:
    """Float32 copies of a state's moments: ``{"exp_avg": ..., "exp_avg_sq": ...}`` per tensor (torch.optim's names).

    For a pytree of states, returns the same structure with a dict in place of each state.
    """
    if is_state(state):
        if any(map(is_dtensor, state)):
            return _distributed().dequantize_state(state)
        layout: Layout = type(state).layout
        out = {}
        for slot in layout.slots():
            t = getattr(state, slot.name)
            if layout.quantized:
                absmax = getattr(state, slot.name + "_absmax")
                decode = functools.partial(
                    dequantize_state_reference, fmt=layout.format, signed=slot.signed, block_size=layout.block_size
                )
                for _ in range(absmax.dim() - 1):  # a state stacked by vmap (an ensemble's): each member's blocks
                    decode = torch.vmap(decode)
                out[slot.name] = decode(t, absmax)
            else:
                out[slot.name] = t.clone()
        export = get_rule(layout.rule).export
        return out if export is None else export(out)
    leaves, spec = pytree.tree_flatten(state, is_leaf=is_state)
    if not leaves or not all(is_state(s) for s in leaves):
        raise TypeError("dequantize_state expects a bnbf state or a pytree of them")
    return pytree.tree_unflatten([dequantize_state(s) for s in leaves], spec)


_PLAIN_SCALARS = _NUMBERS | {type(None), Tensor}


def _subclass_scalar(values: Any) -> tuple[str, Tensor] | None:
    """The first ``(name, tensor)`` among hyperparameters (a mapping, nested ones, tuples, a rule's dataclass) and
    ``values``' other scalars (``(name, value)`` pairs) that is of a tensor subclass dispatching on its own
    (TwoTensor, DTensor...), else None. Callables (schedules, per-leaf functions) are not called here."""
    stack = [((name,) if name else (), v) for name, v in values]
    while stack:
        path, v = stack.pop()
        if type(v) in _NUMBERS or v is None:
            continue
        if isinstance(v, Tensor):
            if own_dispatch(v):
                if any(type(k) is not int for k in path[1:]):  # in a per-leaf or per-rule mapping
                    return "hparams" + "".join(f"[{k!r}]" for k in path), v
                return path[0] + "".join(f"[{k}]" for k in path[1:]), v
        elif isinstance(v, dict):
            stack.extend(((*path, k), x) for k, x in v.items())
        elif type(v) is tuple or type(v) is list:
            stack.extend(((*path, i), x) for i, x in enumerate(v))
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            stack.extend(((*path, f.name), getattr(v, f.name)) for f in dataclasses.fields(v))
    return None


def _check_scalars_readable(param: Any, hparams: Any, step: Any, max_unorm: Any, max_grad_norm: Any, in_place: bool):
    """TypeError, before anything is computed, for a hyperparameter, step or clipping bound of a tensor subclass with
    its own dispatch that the step cannot take: in place beside plain params (the kernels read a scalar's memory,
    which is not such a tensor's value, and the results could not be written back as plain tensors; torch's ops
    would run once per inner tensor), and ``max_grad_norm`` in either step (the norm's coefficient is computed into
    plain memory). Traced calls (torch.compile's fake tensors) take their own route."""
    plain = _PLAIN_SCALARS
    if type(step) in plain and type(max_unorm) in plain and type(max_grad_norm) in plain and type(hparams) is dict:
        for v in hparams.values():  # the usual call: numbers and plain tensors, betas a tuple of them
            if type(v) not in plain and not (type(v) is tuple and all(type(x) in plain for x in v)):
                break
        else:
            return
    if torch.compiler.is_compiling():
        return
    found = _subclass_scalar([("max_grad_norm", max_grad_norm)])
    if found is None and in_place:
        found = _subclass_scalar([("", hparams), ("step", step), ("max_unorm", max_unorm)])
        if found is not None and any(map(own_dispatch, _flatten(param)[0])):
            found = None  # subclass params take the pure step, written back: the subclass's dispatch answers
    if found is not None:
        raise subclass_scalar_error(*found, in_place)


def _check_differentiable(differentiable: Any) -> None:
    if differentiable is not True:
        raise TypeError(f"differentiable must be a bool, got {type_name(differentiable)}")


def _shared(hparams: Any) -> bool:
    """Hyperparameters the core takes as they are (one mapping of numbers and tensors for every leaf); others
    (per rule, per leaf, schedules) go through :mod:`bnbf.compose`. The common dict of numbers costs a loop."""
    if hparams is None:
        return True
    if type(hparams) is dict:
        for v in hparams.values():
            number = type(v) is float or type(v) is int or type(v) is bool or isinstance(v, Tensor)
            # a tuple of numbers (betas) is one setting; of schedules or mappings (a tuple subtree's), not
            if not number and (type(v) is not tuple or any(map(callable, v)) or any(isinstance(x, Mapping) for x in v)):
                break
        else:
            return True
    return _compose().is_shared_hparams(hparams)


@functools.cache  # an import statement per call costs ~1 us of the mixed step's host time
def _compose():
    from bnbf import compose  # compose builds on this module

    return compose


def _packed_update(param, grad, state, hparams, step, skip_zeros, max_unorm, maximize, differentiable, max_grad_norm,
                   *, in_place):  # fmt: skip
    """``update``/``update_`` of a :class:`bnbf.packed.PackedState`: the options it does not take refused first."""
    if differentiable is not False:
        _check_differentiable(differentiable)
        raise ValueError("differentiable=True takes the per-param state (init_state without packed=True)")
    if max_grad_norm is not None:
        raise ValueError("max_grad_norm is not supported with a packed state; clip the grads before the step")
    if not _shared(hparams):
        resolved = _compose().resolve_hparams(hparams, step) if isinstance(hparams, Mapping) else hparams
        if resolved is hparams or not _shared(resolved):  # per-leaf (or per-rule) mappings, not schedules
            raise ValueError(
                "a packed state takes one mapping of hyperparameters for every leaf (no per-leaf ones; schedules, "
                "callables of the step, are fine)"
            )
        hparams = resolved
    if not in_place or torch.compiler.is_compiling() or _functorch.maybe_current_level() is not None:
        return packed_update(param, grad, state, hparams, step, skip_zeros, max_unorm, maximize, in_place=in_place)
    # eager in place: the per-param views of the buffers stepped by update_'s plan (the per-param state's
    # launches and host cost), once a step of the packed state's own checked these params and buffers
    capturing = torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()  # the packed step refuses
    views = None if capturing else state.plan_views()  # None for buffers the packed step's checks refuse
    if views is not None and not use_triton(state.buffers[0]):
        views = None  # the reference path steps the buffers' views itself
    if views is not None:
        hit = _last_plan(param, views[0])
        if hit is not None:
            hit[0]._step(hit[1], hit[2], param, grad, hparams, step, skip_zeros, max_unorm, maximize)
            return param, state
    packed_update(param, grad, state, hparams, step, skip_zeros, max_unorm, maximize, in_place=True)
    if views is not None:
        params, spec = _flatten(param)
        found = _cached(param, params, views[1], spec, spec)
        if found is not None:
            _remember(param, views[0], found)
    return param, state


@functools.cache
def _distributed():
    from bnbf import distributed  # distributed builds on this module

    return distributed


def hparams_for(rule: str, hparams: Mapping | None = None, **kwargs) -> Any:
    """The validated hyperparameter dataclass of ``rule`` from a mapping and/or keywords."""
    merged = dict(hparams or {}, **kwargs)
    return get_rule(rule).make_hparams(merged)

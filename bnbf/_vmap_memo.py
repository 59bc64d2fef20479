"""What a vmapped step's full checks established, for the next call of the same trees (an ensemble's loop).

Under ``torch.func.vmap`` the checks of :func:`bnbf.update` and :func:`bnbf.update_` run on vmap's batched tensors,
each small op passing through torch.func's layer: GPT-2-sized members with flat params spent about two thirds of
bnbf's host time before the first launch there (CPU). A call that passes them leaves a memo of its trees'
structures, its states' types and its stacked tensors (under vmap's wrappers: plain, batched along dim 0,
contiguous, their shapes and dtypes as meta twins, on one device); the next call of the same trees confirms those in
compiled passes and skips the checks they decide. What every call checks anyway (the hyperparameters' and the
step's values, the memory of an in-place step) stays with the caller (:func:`bnbf.functional._vmapped_hit`). No
caller tensor is held.
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch._C import _functorch
from torch.autograd import forward_ad
from torch.utils import _pytree as pytree

from bnbf import ops
from bnbf._bounded import Bounded
from bnbf._host_checks import NATIVE, _field_positions, _flatten, hparam_tensors, walked
from bnbf.state import is_state, present_mask

_CHAIN = itertools.chain.from_iterable


class Memo(NamedTuple):
    spec: Any  # the params' structure key (the grads' and the states' too: a walked state tree has its params' spec)
    types: tuple  # each state's type (its layout)
    twins: tuple  # meta twins of the stacked params, grads and state fields
    device: torch.device
    rule: Any
    present: int  # the kept slots' mask the checked hyperparameters gave
    groups: tuple  # (layout, param indices, field indices) per launch group


# by the params' structure key: a flat tree's key tuple, a nested one's spec by id (confirmed by identity)
MEMOS = Bounded(8)


def _key(spec: Any) -> Any:
    return spec if type(spec) is tuple or type(spec) is str else id(spec)


def remember(call: Any, groups: list, step: Any, rows: dict) -> None:
    """A memo of this checked vmapped call (``groups``: its launch groups, ``rows``: its scalars by device), where
    a later call can take it: the compiled checks built, scalars for one device, none a member's own tensor, a tree
    whose structure key lasts, stacked tensors as a memo records them; and none of its structure holds them already
    (a call the memo's user declined for its scalars, say)."""
    if NATIVE is None or len(rows) != 1 or wrapped_scalars(hparam_tensors(call.hparams, step)):
        return
    found = ops.vmap_level()
    if found is None or (type(call.spec) is pytree.TreeSpec and not walked(call.spec)):
        return  # a tree of other nodes: its spec is made anew each call, a later call would not find it
    level = found[0]
    fields = list(_CHAIN(call.states))
    unwrapped = ops._unwrap(call.params, level), ops._unwrap(call.grads, level), ops._unwrap(fields, level)
    tensors = [ts for ts, _ in unwrapped]
    if any(dims.count(0) != len(dims) for _, dims in unwrapped) or not ops._unwrapped(*tensors):
        return
    if not all(map(Tensor.is_contiguous, _CHAIN(tensors))):
        return
    held = MEMOS.get(_key(call.spec))
    same = held is not None and held.types == tuple(map(type, call.states))
    if same and all(map(NATIVE.meta_match, tensors, held.twins)):
        return
    device = tensors[0][0].device
    if any(t.device != device for t in _CHAIN(tensors)):
        return
    plan = tuple((layout, tuple(idx), tuple(_field_positions(call.states, idx))) for (_, _, layout), idx in groups)
    twins = tuple([torch.empty(t.shape, dtype=t.dtype, device="meta") for t in ts] for ts in tensors)
    memo = Memo(call.spec, tuple(map(type, call.states)), twins, device, call.rule,
                present_mask(call.rule, call.hparams), plan)  # fmt: skip
    MEMOS.put(_key(call.spec), memo)


def confirm(param: Any, grad: Any, state: Any, step: Any) -> tuple | None:
    """``(memo, level, size, (params, grads, fields) unwrapped, (params, grads, states, fields) as given)`` where a
    memo's trees and stacked tensors are this call's: the same structures and state types; the stacked tensors
    plain, batched along dim 0 at the innermost vmap's level, contiguous, each with its recorded shape and dtype, on
    the recorded device, none requiring grad under grad mode; an int or plain tensor step, no forward-mode dual, no
    tracing, no CUDA graph being captured. Else None."""
    if forward_ad._current_level >= 0 or torch.compiler.is_compiling():
        return None
    if type(step) is not int and type(step) is not Tensor:  # a member's count, a subclass: the full path
        return None
    found = ops.vmap_level()
    if found is None:
        return None
    level, size = found
    params, spec = _flatten(param)
    memo = MEMOS.get(_key(spec))
    if memo is None or not (memo.spec is spec or memo.spec == spec):
        return None
    grads, g_spec = _flatten(grad)
    states, s_spec = _flatten(state, is_leaf=is_state)
    if not (g_spec is spec or g_spec == spec) or not (s_spec is spec or s_spec == spec):
        return None
    if tuple(map(type, states)) != memo.types:
        return None
    fields = list(_CHAIN(states))
    (ps, p_dims), (gs, g_dims), (fs, f_dims) = (
        ops._unwrap(params, level),
        ops._unwrap(grads, level),
        ops._unwrap(fields, level),
    )
    if p_dims.count(0) != len(p_dims) or g_dims.count(0) != len(g_dims) or f_dims.count(0) != len(f_dims):
        return None
    p_twins, g_twins, f_twins = memo.twins
    match = NATIVE.meta_match
    if not (match(ps, p_twins) and match(gs, g_twins) and match(fs, f_twins) and ops._unwrapped(ps, gs, fs)):
        return None
    device = memo.device
    if any(t.device != device for t in itertools.chain(ps, gs, fs)):
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in itertools.chain(ps, gs, fs)):
        return None
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():  # the full path's capture checks
        return None
    return memo, level, size, (ps, gs, fs), (params, grads, states, fields)


def wrapped_scalars(tensors: list) -> bool:
    """Whether any of a call's tensor hyperparameters, step or max_unorm (``tensors``: :func:`hparam_tensors`' pairs)
    is one a transform wraps (a member's own value under vmap) or of a subclass: the memo steps plain 0-d tensors
    only, one row for every member."""
    return any(type(t) is not Tensor or _functorch.is_functorch_wrapped_tensor(t) for _, t in tensors)


def pick(ps: list, gs: list, fs: list, idx: tuple, field_idx: tuple) -> tuple:
    """The unwrapped params, grads and fields of one launch group (the lists as they are for one group)."""
    if len(idx) == len(ps):
        return ps, gs, fs
    return [ps[i] for i in idx], [gs[i] for i in idx], [fs[f] for f in field_idx]

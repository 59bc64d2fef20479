"""The explicit step plan: a set of params and states checked once, with their kernel groups and tables.

:func:`plan` checks params and states as :func:`bnbf.update_` does (float params, states that fit them,
no tensor listed twice, no two leaves sharing memory, one rule) and groups them by (device, param dtype,
state layout): one kernel launch per group, whose address table (every param and state address) is
uploaded once. :meth:`Plan.step` then checks only what a step brings or what can change between steps,
in C-level loops over the lists: the grads (type, shape, dtype, device, layout, contiguity), and whether a
param or state field was given other memory or another shape (``.data =``, ``resize_``, ``t_``...), in
which case the plan checks and builds itself again. :func:`bnbf.update_` is a plan kept in a small cache
that holds no tensor alive (:func:`_cached`).
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import functools
import itertools
import math
import operator
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch._C import _functorch
from torch.autograd import forward_ad
from torch.utils._python_dispatch import _get_current_dispatch_mode as _dispatch_mode
from torch.utils._pytree import TreeSpec

from bnbf import _vmap_memo, ops
from bnbf._bounded import Bounded
from bnbf._dispatch import BUILD_LOCK, interpreting, is_dtensor, launch_lock, use_triton
from bnbf._host_checks import (
    _REQUIRES_GRAD,
    _SHAPE_DTYPE,
    NATIVE,
    _any_lazy,
    _check_grad,
    _check_grads_apart,
    _check_leaves,
    _check_no_overlap,
    _check_present,
    _check_step,
    _check_writable,
    _field_positions,
    _flatten,
    _grads_ok,
    _groups,
    _is_plain,
    _names,
    _none_leaf,
    _overlap,
    _prepare,
    _prepare_traced,
    _rule_of,
    _states_ok,
    _unflatten,
    _values_of,
    check_hparam_values,
    check_not_differentiated,
    check_scalars_plain,
    check_update_options,
    differentiated,
    hparam_tensors,
    leaves_of,
    own_dispatch,
    packed_identities,
    replace_hparam_tensors,
    unaddressable,
)
from bnbf.kernels import scalar_program
from bnbf.kernels.direct_launch import _current_stream
from bnbf.kernels.launcher import (
    _to_device,
    build_group,
    first_blocks_of,
    launch_group,
    launch_pair,
    not_capturable,
    pair_of,
)
from bnbf.quant import DITHER_SEED_MOD
from bnbf.reference import FIRST_BLOCKS, GRAD_CLIP
from bnbf.rules import get_rule
from bnbf.rules.base import as_scalar_row
from bnbf.state import is_state, present_mask

__all__ = ["Plan", "plan"]

_PLAIN_TYPES = frozenset({Tensor, torch.nn.Parameter})
_NUMBERS = frozenset({float, int, bool})  # scalars passed as kernel arguments; anything else is a 0-d tensor
_GRAD_META = operator.attrgetter("shape", "dtype", "device", "layout")
_CHAIN = itertools.chain.from_iterable


def plan(params: Any, state: Any) -> Plan:
    """Check ``params`` and ``state`` once and return a :class:`Plan` that steps them in place.

    Args:
        params: a tensor or a dict/list/tuple pytree of tensors (float32, float16 or bfloat16), as
            :func:`bnbf.update_` takes them.
        state: from :func:`bnbf.init_state`, in the same structure.

    Returns:
        A :class:`Plan` holding the params and states (their leaves as they are now).

    Raises:
        ValueError, TypeError: as :func:`bnbf.update_` would for these params and states (a tensor listed
            twice, leaves sharing memory, a state built for another param, mixed rules...).

    Example:
        >>> import torch, bnbf
        >>> params = {"w": torch.ones(2, 3), "b": torch.ones(3)}
        >>> state = bnbf.init_state(params, bnbf.OptimSpec(rule="adamw", state_bits=32))
        >>> opt = bnbf.plan(params, state)
        >>> for step in (1, 2):
        ...     opt.step({"w": torch.ones(2, 3), "b": torch.ones(3)}, {"lr": 0.1, "weight_decay": 0.0}, step)
        >>> params["b"]
        tensor([0.8000, 0.8000, 0.8000])
    """
    return Plan(params, state)


class Plan:
    """In-place optimizer steps of a fixed set of params and states, checked once (see :func:`plan`).

    ``plan.step(grads, hparams, step)`` is ``bnbf.update_(params, grads, state, hparams, step)`` for the
    params and states the plan was built with, minus the checks that cannot change from one step to the
    next. Per step it checks the grads (each a plain, dense tensor of its param's shape, dtype and device;
    non-contiguous ones are copied) and that every param and state field still has its planned memory,
    shape, dtype and contiguity; if one does not (a param resized or transposed in place, moved with
    ``.data =`` or ``model.to()``), it checks everything again and rebuilds its tables, raising as
    ``update_`` would where the leaves no longer make a valid step (a resized param no longer fits its
    state). Params and states that cannot use the direct launch (CPU tensors on the reference path,
    non-contiguous params, tensor subclasses, inside ``torch.compile``) take ``update_``'s generic path,
    all checks included, every step.

    A plan keeps its params and states alive (as a ``torch.optim.Optimizer`` keeps its params) and steps
    the leaves it was built with: replacing an entry of the ``params`` dict afterwards does not change
    the plan; build a new one. One thread at a time may step a plan.

    Attributes:
        params: the planned param tensors, in leaf order.
        states: their states, in the same order.
        rule: the :class:`~bnbf.rules.base.Rule` (``bnbf.RULES[name]``) of the states.
        groups: ``(pick, group)`` per kernel launch: the group's address table and task list
            (:class:`bnbf.kernels.launcher.Group`) and how its grads are picked from the flat list
            (``None``: all of them, in order); empty on the generic path.
    """

    def __init__(self, params: Any, state: Any):
        _outside_transforms()
        leaves, spec = _flatten(params)
        states, s_spec = _flatten(state, is_leaf=is_state)
        _validate(params, leaves, states, spec, s_spec)
        self._hold = True
        self._tree = params  # for the names in error messages
        self._params, self._states = leaves, states
        self.alive = True
        self._setup(leaves, states, spec)

    @classmethod
    def _weak(cls, tree: Any, params: list, states: list, spec: Any) -> Plan | None:
        """A plan for :func:`bnbf.update_`'s cache: it holds weak references only and trusts the caller to
        pass the planned objects (:meth:`_same`). None where the direct path does not apply or a check
        fails (the generic path then steps, or raises the precise error)."""
        if not _plannable(params, states) or not _states_ok(params, states) or _overlap(params, states) is not None:
            return None
        if any(t.is_inference() for s in states for t in s):  # the generic path's checks refuse them
            return None
        if len({type(s).layout.rule for s in states}) != 1:
            return None
        self = cls.__new__(cls)
        self._hold = False
        self._tree = self._params = self._states = None
        self.alive = True
        self._setup(params, states, spec)
        self._pids, self._sids, self._types = list(map(id, params)), list(map(id, states)), list(map(type, states))
        if NATIVE is not None:  # (address, type address) of every param then every state, packed
            self._objs = packed_identities([*params, *states])
        return self

    def _setup(self, params: list, states: list, spec: Any) -> None:
        """Groups, address tables and the planned metadata of checked leaves."""
        self._spec = spec
        # replaced whenever the planned leaves are checked anew: a caller's check over several plans (bnbf_nn's
        # groups) holds still while every plan's mark is the one it saw
        self._mark = object()
        self._keys = spec[1] if type(spec) is tuple and spec[0] == "dict" else None  # a flat dict's keys
        self._n = len(params)
        self.rule = get_rule(type(states[0]).layout.rule)
        presents = {type(s).layout.present for s in states}
        self._present = presents.pop() if len(presents) == 1 else -1  # -1: mixed, refused by the first step
        # the last hparams whose state slots matched the states, weakly: they may hold a caller's tensor (a 0-d lr)
        self._checked_h = _NO_REF
        self._direct = _plannable(params, states)
        self.groups: list = []
        self._pair = None
        # the dither's first block of each param (shards of larger tensors, bnbf.distributed), baked into the tables
        self._first_blocks = first_blocks_of(params) if self._direct else None
        # per-leaf hyperparameters: set assignment -> [how its rows are laid out (rows_layout), and where they are
        # numbers: the sets' float32 rows last made and the groups' rows made from them (ours: no caller's tensor)]
        self._set_layout = Bounded(4)
        self._last_layout = None  # (set assignment, its entry of _set_layout) of the last multi-set step
        # the last (assignment, kept-slot masks, the sets weakly) whose states were found to match
        self._checked_sets = None
        self._cuda = False
        # the generic path checks every leaf when it steps; what :meth:`_leaves_checked` compares to check them sooner
        self._generic_meta = None if self._direct else _leaf_meta(params, states)
        if not self._direct:
            return
        if any(p.device.type == "cuda" for p in params) and torch.cuda.is_current_stream_capturing():
            raise not_capturable(
                "the first step of these params builds their kernel tables (copies from the host); run a step "
                "before capturing (torch's warm-up on a side stream)"
            )
        built = []
        with BUILD_LOCK:
            for (_, _, layout), idx in _groups(params, states):
                ps = [params[i].detach() for i in idx]
                ss = [t for i in idx for t in states[i]]
                group = build_group(ps, ps, ss, ss, layout)
                built.append((idx, group))
        # one group of every tensor in order: the grads list as it is; else each group's grads picked in one
        # C-level call (a tuple, also for one index)
        self.groups = [(None, built[0][1])] if len(built) == 1 else [(_picker(idx), g) for idx, g in built]
        # two groups (a model's 8-bit states, and the 32-bit states of its small tensors) in one launch where the
        # usual step allows (launcher.pair_of): one driver launch fewer a step
        self._pair = pair_of([g for _, g in self.groups])
        # the grads' address table: per device one tensor with every group's rows, each group's from an even
        # row (its view is 16-byte aligned, as a kernel argument must stay), written and uploaded only when the
        # grads move (_grad_tables)
        spans: dict = {}
        for k, (_, group) in enumerate(self.groups):
            rows, members = spans.setdefault(group.device, (0, []))
            start = rows + rows % 2
            members.append((k, start, group.table.shape[0]))
            spans[group.device] = (start + group.table.shape[0], members)
        self._grad_spans = [(device, rows, members) for device, (rows, members) in spans.items()]
        self._grad_at = b""  # the addresses of the grads in the tables, in leaf order (native uint64)
        self._devices = {p.device for p in params}
        self._interpreted = any(d.type == "cpu" for d in self._devices)
        self._cuda = any(d.type == "cuda" for d in self._devices)  # a step may be captured in a CUDA graph
        # what a step compares: the params' addresses, shapes and dtypes, the fields' (fields_planned), and what
        # each grad must be (the param's shape, dtype, device, strided)
        self._ptrs = tuple(map(Tensor.data_ptr, params))
        self._meta = list(map(_SHAPE_DTYPE, params))
        self._grad_meta = list(map(_GRAD_META, params))
        self._fields = fields_planned(states)
        if NATIVE is not None:  # the compiled checks: packed addresses, shape-and-dtype twins (grads vs the params)
            self._packed = array.array("Q", self._ptrs).tobytes()
            self._twins = [torch.empty(p.shape, dtype=p.dtype, device="meta") for p in params]

    def __reduce__(self) -> tuple:
        # pickle, copy.deepcopy and copy.copy: a plan of the params and states it holds, built anew (their memo
        # keeps them the very objects the rest of the copy refers to); its tables are addresses of this process.
        # Through a function registered with torch's safe globals, so that torch.load's default (weights_only=True)
        # takes a checkpoint holding the plan beside its params and states, as it takes them
        if not self._hold:
            raise TypeError(
                "bnbf.update_'s cached plans hold no tensor and cannot be pickled or copied; "
                "make one that holds its params and states with bnbf.plan(params, state)"
            )
        return (_rebuild_plan, (_unflatten(self._params, self._spec), _unflatten(self._states, self._spec)))

    # ---- the public step --------------------------------------------------------------------------------

    @property
    def params(self) -> list:
        if self._hold:
            return self._params
        return [r() for r in self._refs[: self._n]]  # None for one since freed

    @property
    def states(self) -> list:
        return self._states if self._hold else []  # update_'s plans hold no state (a tuple has no weak reference)

    def step(
        self,
        grads: Any,
        hparams: Any = None,
        step: Any = 1,
        *,
        skip_zeros: bool = False,
        max_unorm: Any = 0.0,
        maximize: bool = False,
    ) -> None:
        """One in-place step of the planned params and states: :func:`bnbf.update_`'s semantics.

        Args:
            grads: gradients in the structure of the plan's params, each of its param's shape, dtype and
                device (non-contiguous grads are copied).
            hparams: a mapping with torch.optim's names or the rule's hparams dataclass; Python numbers
                or 0-d tensors (changing them never compiles a kernel).
            step: 1-based index of this update (int or 0-d int32/int64 tensor).
            skip_zeros, max_unorm, maximize: as for :func:`bnbf.update`.

        Raises:
            ValueError, TypeError, RuntimeError: for a bad grad, hyperparameter, step or option, before
                anything is written.
        """
        # traced by torch.compile: the generic path (the compiled checks are opaque to Dynamo)
        if self._direct and not torch.compiler.is_compiling():
            self._confirmed()
        self._step(self._params, self._states, self._tree, grads, hparams, step, skip_zeros, max_unorm, maximize)

    def _grads_held(self) -> Any:
        """For bnbf_nn, which steps its params' own ``.grad`` (private: :meth:`_step_held` trusts what this returned,
        nothing between the two calls may move a grad): the planned params confirmed (as
        :meth:`step` confirms them) and their grads read and checked in one call: True where every grad sits
        where the grad-address tables have it, ``(grads, addresses)`` where they moved, None where a param has no
        grad or one a step would refuse, or where this plan has no such call (no extension, the generic path,
        shards, a clip in force): the caller then takes :meth:`step`. Nothing is written."""
        if NATIVE is None or not self._hold or not self._direct or torch.compiler.is_compiling():
            return None
        if forward_ad._current_level >= 0:  # duals: the generic path's checks see them
            return None
        if self._first_blocks is not None or FIRST_BLOCKS.get() is not None or GRAD_CLIP.get() is not None:
            return None
        if not self._confirm(self._params, self._states):
            if any(p.grad is None for p in self._params):  # not stepped this time (torch skips it): not refused either
                return None
            self._rebuild()
            if not self._direct:  # planned again for the generic path (a param made non-contiguous): step() takes it
                return None
        return NATIVE.own_grads_at(self._params, self._grad_at)

    def _step_held(self, held: Any, hparams: Any = None, step: Any = 1, **options: Any) -> None:
        """:meth:`step` with the grads :meth:`_grads_held` just found (not None; nothing may change the params
        or their grads between the two calls). ``options``: skip_zeros, max_unorm, maximize as for
        :meth:`step`."""
        grads, at = ((), True) if held is True else held
        if at is not True:  # the grads moved since the tables were made
            _check_grads_apart(self._tree, self._params, grads, self._states)
        self._checked_step(
            self._params,
            self._states,
            self._tree,
            grads,
            at,
            hparams,
            step,
            options.get("skip_zeros", False),
            options.get("max_unorm", 0.0),
            options.get("maximize", False),
        )

    def __repr__(self) -> str:
        path = f"{len(self.groups)} launch group(s)" if self._direct else "generic path"
        return f"<bnbf.Plan: {self._n} tensors, rule {self.rule.name!r}, {path}>"

    # ---- per step ------------------------------------------------------------------------------------------

    def _same(self, params: list, states: list) -> bool:
        """Whether ``params`` and ``states`` are the planned objects, of the planned state classes (a cached
        plan: while none of its tensors was freed, an equal id is the same object; a state, a tuple, cannot be
        referenced weakly, but its fields can and their addresses are confirmed)."""
        if NATIVE is not None:
            return self.alive and NATIVE.same_objects(params, states, self._objs)
        return (
            self.alive
            and list(map(id, params)) == self._pids
            and list(map(id, states)) == self._sids
            and list(map(type, states)) == self._types
        )

    def _confirm(self, params: list, states: list) -> bool:
        """Whether the planned params and state fields still have their planned memory, shapes, dtypes and
        contiguity: what an in-place ``resize_``, ``t_``, ``as_strided_``, ``set_`` or ``.data =`` changes. (A
        tensor's device is its memory's: another device is another address. Its layout cannot change: torch refuses
        ``.data =`` a sparse tensor.)"""
        if NATIVE is not None:
            return NATIVE.meta_match(params, self._twins, self._packed) and fields_as_planned(states, self._fields)
        try:
            return (
                tuple(map(Tensor.data_ptr, params)) == self._ptrs
                and set(map(type, params)) <= _PLAIN_TYPES
                and list(map(_SHAPE_DTYPE, params)) == self._meta
                and all(map(Tensor.is_contiguous, params))
                and fields_as_planned(states, self._fields)
            )
        except RuntimeError:  # e.g. a tensor without storage
            return False

    def _confirmed(self) -> None:
        """The planned leaves confirmed (:meth:`_confirm`), else checked and planned again (raises where they no
        longer make a valid step)."""
        if not self._confirm(self._params, self._states):
            self._rebuild()

    def _leaves_checked(self) -> None:
        """The planned leaves checked as this plan's next step checks them, raising its error now: for a caller that
        steps several plans in turn (bnbf_nn's param groups) and must refuse a changed leaf of the last before the
        first steps. Unchanged leaves cost a confirmation: the direct path's, or the planned addresses, shapes,
        strides and dtypes of the generic path's leaves."""
        if self._direct:
            self._confirmed()
        elif self._generic_meta is not None and _leaf_meta(self._params, self._states) != self._generic_meta:
            _validate(self._tree, self._params, self._states, self._spec, self._spec)
            self._generic_meta = _leaf_meta(self._params, self._states)
            self._mark = object()

    def _rebuild(self) -> None:
        _validate(self._tree, self._params, self._states, self._spec, self._spec)
        self._setup(self._params, self._states, self._spec)

    def _grads_fit(self, grads: list, params: list) -> bool:
        """Each grad a plain tensor with its param's shape, dtype, device and strided layout, contiguous
        (``params``: the planned params, confirmed this step)."""
        if NATIVE is not None:
            return NATIVE.grads_match(params, grads)
        try:
            return (
                len(grads) == self._n
                and set(map(type, grads)) <= _PLAIN_TYPES
                and list(map(_GRAD_META, grads)) == self._grad_meta
                and all(map(Tensor.is_contiguous, grads))
                and not _any_lazy(grads)
            )
        except RuntimeError:  # is_contiguous of a sparse compressed tensor
            return False

    def _step(
        self,
        params: list,
        states: list,
        tree: Any,
        grad: Any,
        hparams: Any,
        step: Any,
        skip_zeros: Any,
        max_unorm: Any,
        maximize: Any,
    ) -> None:
        # under a torch.func transform the generic path's checks refuse a gradient asked for through the step
        if (
            not self._direct
            or torch.compiler.is_compiling()
            or _functorch.maybe_current_level() is not None
            or forward_ad._current_level >= 0  # duals: the direct launch would drop their tangents
        ):
            _step_generic(
                _unflatten(params, self._spec),
                grad,
                _unflatten(states, self._spec),
                hparams,
                step,
                skip_zeros,
                max_unorm,
                maximize,
            )
            return
        grads, at = self._grads(params, states, tree, grad)
        self._checked_step(params, states, tree, grads, at, hparams, step, skip_zeros, max_unorm, maximize)

    def _checked_step(
        self,
        params: list,
        states: list,
        tree: Any,
        grads: Any,
        at: Any,
        hparams: Any,
        step: Any,
        skip_zeros: Any,
        max_unorm: Any,
        maximize: Any,
    ) -> None:
        """The direct step with checked grads and their tables' state ``at`` (:meth:`_grads`; ``grads`` may be
        empty where ``at`` is True and no clip is set: the tables carry them)."""
        rule = self.rule
        h = rule.make_hparams(hparams)
        if h is not self._checked_h():  # make_hparams hands back the same object for the same plain numbers
            if present_mask(rule, h) != self._present:
                _check_present(rule, h, states)
            self._checked_h = _checked_ref(h)
        _check_step(step)
        if self._cuda and torch.cuda.is_current_stream_capturing():
            self._check_capture(grads, at, h, step)
        values, clip = _scalar_values(rule, h, step, skip_zeros, max_unorm, maximize)
        if set(map(type, values)) <= _NUMBERS:  # Python numbers reach the kernel as arguments: nothing to upload
            scalars = tuple(map(float, values))
        else:
            check_hparam_values(values, h, max_unorm)  # a meta one has no value to read
            check_scalars_plain(h, step, max_unorm)
            if differentiated([t for _, t in hparam_tensors(h, step, max_unorm)]):
                check_not_differentiated(tree, params, grads, h, step, max_unorm, states, in_place=True)
            with torch.no_grad():  # 0-d tensor hyperparameters: stacked on each device, no host sync
                scalars = {d: scalar_row(values, d) for d in self._devices}
        with launch_lock(self._interpreted):
            self._launch(grads, at, scalars, skip_zeros, clip)

    def _grads(self, params: list, states: list, tree: Any, grad: Any, listed: bool = False) -> tuple[list, Any]:
        """The grads as a list in leaf order, checked (the precise error for a bad one), and whether they are
        where the grad-address tables have them (:meth:`_grad_tables`' ``at``); also where the tables must be
        built again because the dither's first blocks changed (a shard stepped outside or inside
        bnbf.distributed's context). ``listed``: ``grad`` is a list of a flat dict plan's grads in its keys' order
        (bnbf.compose's, which took them from a dict of these keys; ``tree`` may then be None)."""
        if (self._first_blocks is not None or FIRST_BLOCKS.get() is not None) and first_blocks_of(
            params
        ) != self._first_blocks:
            self._setup(params, states, self._spec)
        t = type(grad)
        if listed:
            grads, g_spec = grad, self._spec
        elif (
            t is dict
            and self._keys is not None
            and NATIVE is not None
            # a dict with the planned keys: its values without building the key tuple (one compiled call)
            and (grads := NATIVE.values_if_keys(grad, self._keys)) is not None
        ):
            g_spec = self._spec
        elif type(self._spec) is TreeSpec:  # nested containers: walked to their leaves
            grads = leaves_of(grad, self._spec)  # a walked structure: no spec lookup
            grads, g_spec = (grads, self._spec) if grads is not None else _flatten(grad)
        elif t is dict:
            grads, g_spec = list(grad.values()), ("dict", tuple(grad))
        elif t is list or t is tuple:
            grads, g_spec = grad, (t, len(grad))
        elif t in _PLAIN_TYPES:
            grads, g_spec = [grad], "leaf"
        else:
            grads, g_spec = None, None
        if g_spec != self._spec:
            at = False
        elif NATIVE is not None:  # the grads' check and their addresses' comparison in one pass
            at = NATIVE.grads_fit_at(params, grads, self._grad_at)
        else:
            at = None if self._grads_fit(grads, params) else False
        if at is False:
            if listed:  # the dict the grads came from, for the precise error
                grad = dict(zip(self._keys, grad))
                tree = grad if tree is None else tree
            grads, at = self._checked_grads(params, tree, grad), None
        if at is None:
            at = array.array("Q", map(Tensor.data_ptr, grads)).tobytes()
            if at == self._grad_at:
                return grads, True
        if at is not True:  # grads elsewhere than the tables have them (checked apart when the tables were made)
            _check_grads_apart(tree if tree is not None else dict(zip(self._keys, grads)), params, grads, states)
        return grads, at

    def _prepare_sets(
        self,
        params: list,
        states: list,
        tree: Any,
        grad: Any,
        sets: list,
        set_of: tuple,
        step: Any,
        skip_zeros: Any,
        max_unorm: Any,
        maximize: Any,
    ) -> Callable[[], None]:
        """Check an in-place step of the planned leaves where they take different hyperparameters (per-leaf
        weight decay, lr multipliers) and return what runs it: ``sets`` holds the rule's validated
        hyperparameters (its dataclass) of each set, ``set_of[i]`` the set of leaf ``i``. Everything is checked
        here, nothing is written until the returned function runs (bnbf.compose checks every rule of a call
        before it steps the first). The launches are those of one set: each tensor reads its own row of scalars
        (the kernel's HP_PER_TENSOR), made on the host and uploaded in one copy per device where the
        hyperparameters are numbers (:meth:`_set_rows`), on the device where some are 0-d tensors; bit for
        bit one call per set. One set, and each launch group whose tensors all take one set, takes
        :meth:`step`'s scalars (kernel arguments). The rows are made when the returned function runs (after
        every check, so that a rule's launches start while the next rule's rows are made). For params on the direct
        path (a plan from :func:`_cached` or :func:`plan` that is ``_direct``), eager and not captured, with
        hyperparameters no derivative is asked through (bnbf.compose checks). ``grad`` may be a list in leaf
        order where the plan is for a flat dict (``tree`` then None: the names are the plan's keys)."""
        listed = type(grad) is list and self._keys is not None and len(grad) == self._n
        grads, at = self._grads(params, states, tree, grad, listed)
        checked_at = self._grad_at
        rule = self.rule
        last = self._checked_sets
        # the very set objects (frozen dataclasses) of the last check, held weakly: their slots are known to match
        if (
            last is None
            or last[0] is not set_of
            or len(last[2]) != len(sets)
            or any(r() is not h for r, h in zip(last[2], sets))
        ):
            wants = tuple(present_mask(rule, h) for h in sets)
            if last is None or (set_of, wants) != last[:2]:
                for k, want in enumerate(wants):
                    mine = [s for s, j in zip(states, set_of) if j == k]
                    if any(type(s).layout.present != want for s in mine):
                        _check_present(rule, sets[k], mine)
            refs = tuple(map(_checked_ref, sets))
            self._checked_sets = (set_of, wants, () if any(r is _NO_REF for r in refs) else refs)
        _check_step(step)
        clip = False
        values = []
        for h in sets:
            v, clip = _scalars(rule, h, step, skip_zeros, max_unorm, maximize)
            if not set(map(type, v)) <= _NUMBERS:
                check_scalars_plain(h, step, max_unorm)
            values.append(v)

        def run() -> None:
            # at: as the check found the grads, unless a step of this plan since changed the tables (then compared)
            moved = at if self._grad_at is checked_at else None
            if moved is not True:
                self._grad_tables(grads, moved)
            # the scalars' rows made here, after every check of the call: a rule's launches then start while the
            # next rule's rows are made (bnbf.compose runs the rules one after another)
            if len(values) == 1:  # one set: as a plain step (kernel arguments, or one row per device)
                made = {d: _one_set(values[0], d) for d in self._devices}
                rows = [made[group.device] for _, group in self.groups]
            else:
                rows = self._set_rows(set_of, values)
            held = _held(grads)
            launches = [(group, r) for (_, group), r in zip(self.groups, rows)]
            with launch_lock(self._interpreted):
                for group, r in launches:
                    launch_group(group, held, r, skip_zeros, clip, grads_placed=True)

        # for bnbf.compose, which checks the grads against its other rules' leaves before any rule runs, and only
        # when they moved: the grads as launched (non-contiguous ones copied), and whether the tables lack them
        run.grads, run.moved = grads, at is not True  # type: ignore[attr-defined]
        return run

    def _set_rows(self, set_of: tuple, values: list) -> list:
        """Each group's [tensors, k] float32 rows of scalars on its device (:func:`group_rows`), the layout kept
        per assignment. Where every set's scalars are numbers the last result is kept with the exact float32
        bits it was made from (a changed value, -0.0 for 0.0 included, misses): a call with the same values (the
        same step again) uploads nothing. Training steps change the bias corrections and the rounding's seed,
        so there the cost is one pick and one copy per device."""
        last = self._last_layout
        if last is not None and last[0] is set_of:  # bnbf.compose's kept partition passes the very tuple
            kept = last[1]
        else:
            kept = self._set_layout.get(set_of)
            if kept is None:
                sets = [(group.device, set_of if pick is None else pick(set_of)) for pick, group in self.groups]
                kept = self._set_layout.put(set_of, [rows_layout(sets, len(values[0])), None, None])
            self._last_layout = (set_of, kept)
        if not kept[0][0]:  # every group of one set: its scalars as that set's call takes them, nothing to keep
            return group_rows(kept[0], values, None, _one_set)
        packed = packed_rows(values)
        if packed is None:  # some 0-d tensors: made and picked on the device, not kept
            return group_rows(kept[0], values, None, _one_set)
        if kept[1] != packed:
            kept[1:] = packed, group_rows(kept[0], values, packed, _one_set)
        return kept[2]

    def _check_capture(self, grads: list, at: Any, h: Any, step: Any) -> None:
        """A step captured in a CUDA graph replays what it captured: refuse what would replay frozen or read
        freed memory (:func:`check_capture_scalars`). The grads must sit where a step before the capture had them:
        their address table is uploaded from the host only when they move."""
        check_capture_scalars(h, step, next(iter(self._devices)))
        if at is not True and self._grads_moved(grads):
            raise not_capturable(
                "the grads are not where the last step before the capture had them (their address table "
                "would be copied from the host); warm up with the grad tensors the graph will use"
            )

    def _launch(self, grads: list, at: Any, scalars: tuple | dict, skip_zeros: bool, clip: bool) -> None:
        """Each group's launch with the grads' tables made current; ``scalars``: Python floats for every group,
        or a row per device."""
        if at is not True:
            self._grad_tables(grads, at)
        numbers = type(scalars) is tuple
        if self._pair is not None and numbers and not clip and GRAD_CLIP.get() is None:
            launch_pair(self._pair, scalars, skip_zeros)
            return
        held = _held(grads)
        for _, group in self.groups:
            hp = scalars if numbers else scalars[group.device]
            launch_group(group, held, hp, skip_zeros, clip, grads_placed=True)

    def _grads_moved(self, grads: list) -> bool:
        """Whether the grads (in leaf order) are not where the grad-address tables have them."""
        if NATIVE is not None:
            return not NATIVE.ptrs_equal(grads, self._grad_at)
        return array.array("Q", map(Tensor.data_ptr, grads)).tobytes() != self._grad_at

    def _grad_tables(self, grads: list, at: Any) -> None:
        """Each group's grad-address table for ``grads`` (in leaf order): kept while the grads stay where they
        were (the caching allocator usually gives a training loop's grads the same blocks every step), else
        written in one pass and uploaded in one copy per device. ``at``: True where the grads are known to be at
        the tables' addresses, their addresses packed (leaf order) where they are known to have moved, None where
        not known. Sets what :func:`bnbf.kernels.launcher.launch_group` reads (``grad_table``, ``grad_packed``,
        ``grad_ptrs`` where the extension was not built, ``grads_aligned``), so that it finds its table current."""
        if at is True:
            return
        ptrs = None  # the Python twin's: each grad's address, read once
        if at is None:
            ptrs = list(map(Tensor.data_ptr, grads))
            at = array.array("Q", ptrs).tobytes()
            if at == self._grad_at:
                return
        by_group = [grads if pick is None else pick(grads) for pick, _ in self.groups]
        for device, rows, members in self._grad_spans:
            # pinned: the copy is asynchronous, and torch keeps the block until the copy has read it
            host = torch.empty(rows, dtype=torch.int64, pin_memory=device.type == "cuda")
            made = NATIVE.grad_table([by_group[k] for k, _, _ in members], host) if NATIVE is not None else None
            if made is None:
                ptrs = list(map(Tensor.data_ptr, grads)) if ptrs is None else ptrs
                picks = [self.groups[k][0] for k, _, _ in members]
                made = _grad_table([ptrs if pick is None else pick(ptrs) for pick in picks], host)
            packed, aligned = made
            table = host if device.type == "cpu" else host.to(device, non_blocking=True)
            done = 0
            for (k, start, n), ok in zip(members, aligned):
                group = self.groups[k][1]
                group.grad_table = table[start : start + n]
                group.grad_packed = packed[8 * done : 8 * (done + n)]
                # the Python twin compares the addresses as ints; the extension compares grad_packed
                group.grad_ptrs = tuple(array.array("Q", group.grad_packed)) if NATIVE is None else ()
                group.grads_aligned = ok
                done += n
        self._grad_at = at

    def _checked_grads(self, params: list, tree: Any, grad: Any) -> list:
        """The slow path of the grads: raise the precise error for the first wrong grad, else return them
        with non-contiguous ones copied."""
        grads, g_spec = _flatten(grad)
        if g_spec != self._spec:
            _none_leaf("grad", grad)
            raise ValueError(f"grad structure {g_spec} does not match param structure {self._spec}")
        names = None
        for i, (p, g) in enumerate(zip(params, grads)):
            if not _grads_ok([p], [g]):
                names = names or _names(tree)
                _check_grad(names[i], p, g)
                raise AssertionError(f"unexpected grad at {names[i]}")  # _grads_ok and _check_grad disagree
            if own_dispatch(g):  # its data_ptr is not its data (0 for TwoTensor)
                names = names or _names(tree)
                raise TypeError(
                    f"grad{names[i]} is a {type(g).__name__}, a tensor subclass that dispatches on its own: the "
                    f"fused step cannot address its storage; pass a plain tensor"
                )
        with torch.no_grad():
            return [g if g.is_contiguous() else g.contiguous() for g in grads]


def _rebuild_plan(params: Any, state: Any) -> Plan:
    """A pickled plan (:meth:`Plan.__reduce__`): the plan of the loaded params and states, checked and built as
    :func:`plan` builds one (nothing of the pickled plan but its params and states is taken)."""
    return Plan(params, state)


torch.serialization.add_safe_globals([_rebuild_plan])


def _outside_transforms() -> None:
    """RuntimeError where a plan is made under a torch.func transform: a plan records the addresses of the tensors
    it holds, and the tensors of vmap, grad or jvp have none ('Cannot access data pointer' from torch before). A
    plan made outside steps under a transform through the generic path (:meth:`Plan._step`)."""
    if _functorch.maybe_current_level() is not None:
        raise RuntimeError(
            "a bnbf.plan cannot be made under a torch.func transform (vmap, grad, jvp...): it steps the addresses "
            "of the tensors it holds, which the transform's tensors do not have; use bnbf.update_ or bnbf.update "
            "there (with differentiable=True for gradients)"
        )


def _NO_REF() -> None:  # the dead weak reference: nothing checked yet
    return None


def _held(grads: list) -> Any:
    """What a plan hands each launch as its grads: the launches read them through their address tables, so nothing,
    except for a folded clip, whose deferred launches must hold them (they may be copies no one else holds)."""
    return grads if GRAD_CLIP.get() is not None else ()


def _checked(params: list, states: list) -> None:
    """The checks :func:`plan` makes of ``params`` (a list) and their ``states``, building nothing: for a caller
    that steps several plans in turn and must refuse, before the first steps, leaves of a later one it makes
    only when it steps them (bnbf_nn's subsets of params with grads)."""
    leaves, spec = _flatten(params)
    flat, s_spec = _flatten(states, is_leaf=is_state)
    _validate(params, leaves, flat, spec, s_spec)


def fields_planned(states: list) -> Any:
    """What :func:`fields_as_planned` compares the states' fields with later: their addresses, shapes and dtypes
    (packed in one bytes object for the compiled check)."""
    if NATIVE is not None:
        packed = NATIVE.fields_packed(states)
        if packed is not None:
            return packed
    fields = list(_CHAIN(states))
    return tuple(map(Tensor.data_ptr, fields)), list(map(_SHAPE_DTYPE, fields))


def fields_as_planned(states: list, planned: Any) -> bool:
    """Whether every field of ``states`` is contiguous, at its planned address with its planned shape and dtype
    (``planned``: from :func:`fields_planned`). ``resize_``, ``as_strided_``, ``set_`` and ``t_`` can change a
    field's shape or strides and keep its address, and the kernels would step it at its planned size and layout."""
    if type(planned) is bytes:
        return NATIVE is not None and NATIVE.fields_match(states, planned)
    fields = list(_CHAIN(states))
    try:
        return (
            tuple(map(Tensor.data_ptr, fields)) == planned[0]
            and list(map(_SHAPE_DTYPE, fields)) == planned[1]
            and all(map(Tensor.is_contiguous, fields))
        )
    except RuntimeError:  # e.g. a tensor without storage
        return False


def leaves_fit(params: list, grads: list, states: list, planned: Any, grad_mode: bool) -> bool:
    """Whether a pure step's inputs are exactly as an earlier pure step made them (``planned``:
    :func:`fields_planned` of ``[tuple(params), *states]``, its outputs): the params plain tensors, each param and
    state field contiguous at its planned address with its planned shape and dtype, its memory its values; the
    grads plain, contiguous, of their params' shapes, dtypes and devices; with ``grad_mode``, none of them requiring
    grad. One compiled pass where :data:`~bnbf._host_checks.NATIVE` is built (its ``leaves_fit``)."""
    if type(planned) is bytes:
        return NATIVE is not None and NATIVE.leaves_fit(params, grads, states, planned, grad_mode)
    try:
        fields = list(_CHAIN(states))
        return (
            all(isinstance(s, tuple) for s in states)
            and set(map(type, params)) <= _PLAIN_TYPES
            and set(map(type, grads)) <= _PLAIN_TYPES
            and fields_as_planned([tuple(params), *states], planned)
            and _grads_ok(params, grads)
            and all(map(Tensor.is_contiguous, grads))
            and not _any_lazy(params)
            and not _any_lazy(fields)
            and not (grad_mode and any(map(_REQUIRES_GRAD, [*params, *grads, *fields])))
        )
    except (AttributeError, TypeError, RuntimeError):  # a field that is not a tensor; one without storage
        return False


class OutputRecords(Bounded):
    """What pure calls established of their outputs, by the ids of the (params, state) trees they returned, which a
    torch.func loop hands the next call as its inputs. An id is only where to look: :func:`fed_back` confirms the
    leaves. Past ``size`` entries the oldest goes (another loop's latest stays). The entries hold no tensor."""

    def __init__(self, size: int = 64):
        super().__init__(size)

    def record(self, out: tuple, memo: Any) -> None:
        self.put((id(out[0]), id(out[1])), memo)


def fed_back(spec: Any, planned: Any, types: list, param: Any, grad: Any, state: Any) -> tuple | None:
    """``(params, grads, states)`` where trees ``param`` and ``state`` of structure ``spec`` (``"leaf"``, ``("dict",
    keys)``, ``(list or tuple, length)`` or a pytree spec) hold a pure call's outputs as it made them (``planned``: its
    :func:`fields_planned`; ``types``: its states' classes) and the grads fit them (:func:`leaves_fit`); else None."""
    found = leaves_by(spec, param, grad, state)
    if found is None:
        return None
    params, grads, states = found
    if not (leaves_fit(params, grads, states, planned, torch.is_grad_enabled()) and list(map(type, states)) == types):
        return None
    return params, grads, states


def leaves_by(spec: Any, param: Any, grad: Any, state: Any) -> tuple | None:
    """``(params, grads, states)``: the leaves of three trees of the known structure ``spec`` (``"leaf"``, ``("dict",
    keys)``, ``(list or tuple, length)`` or a spec of the core's walk), else None (a tree of another structure)."""
    if spec == "leaf":
        params, grads, states = [param], [grad], [state]
    elif type(spec) is TreeSpec:  # nested containers: walked to their leaves
        params, grads, states = leaves_of(param, spec), leaves_of(grad, spec), leaves_of(state, spec, states=True)
        if params is None or grads is None or states is None:
            return None
    elif spec[0] == "dict":
        params, grads, states = (_values_of(t, spec[1]) for t in (param, grad, state))
        if params is None or grads is None or states is None:
            return None
    else:
        t = spec[0]
        if not (type(param) is type(grad) is type(state) is t and len(param) == len(grad) == len(state) == spec[1]):
            return None
        params, grads, states = list(param), list(grad), list(state)
    return params, grads, states


def _leaf_meta(params: list, states: list) -> tuple | None:
    """What a ``.data =``, ``resize_``, ``as_strided_`` or ``model.to()`` changes of a generic plan's leaves (the
    params' inference mode too); None where a leaf has no address to read (a subclass): then only its step checks."""
    try:
        leaves = [*params, *_CHAIN(states)]
        return (
            tuple(map(Tensor.data_ptr, leaves)),
            tuple(map(_SHAPE_DTYPE, leaves)),
            tuple(map(Tensor.stride, leaves)),
            tuple(map(Tensor.is_inference, params)),
        )
    except (RuntimeError, TypeError, NotImplementedError):
        return None


def _plannable(params: list, states: list) -> bool:
    """Whether params can take the direct launch: plain tensors (other subclasses read their metadata
    differently), contiguous, on a device the Triton kernels run on, outside tracing."""
    return (
        not torch.compiler.is_compiling()
        and _functorch.maybe_current_level() is None  # torch.func's wrappers have no storage to address
        and all(map(_is_plain, params))
        # a param or state with history: the generic path's checks refuse it under grad mode (the step would cut it)
        and not any(p.requires_grad and not p.is_leaf for p in params)
        and not any(t.requires_grad for s in states if is_state(s) for t in s)
        and all(map(use_triton, params))
        and all(map(Tensor.is_contiguous, params))
        # inference tensors: the generic path's checks refuse an in-place step of them outside inference mode
        and not any(map(Tensor.is_inference, params))
    )


def _validate(tree: Any, params: list, states: list, spec: Any, s_spec: Any) -> None:
    """Every check of a call's params and states (not its grads), raising the precise error."""
    if not params:
        raise ValueError("a plan needs at least one tensor")
    if s_spec != spec:
        raise ValueError(f"state structure {s_spec} does not match param structure {spec}")
    if not set(map(type, params)) <= _PLAIN_TYPES:
        _check_not_dtensor(tree, params)
    _check_leaves(tree, params, states)
    _check_no_overlap(tree, params, states)
    _check_writable(tree, params, states)  # a plan steps in place
    _rule_of(tree, states)


def _check_not_dtensor(tree: Any, params: list) -> None:
    """TypeError naming a DTensor param (FSDP2's): a plan holds its tensors' addresses, and a DTensor's data_ptr
    is 0 (its data is its local shard's, which bnbf.distributed.plan plans; bnbf.update_ takes DTensors itself)."""
    for i, p in enumerate(params):
        if is_dtensor(p):
            raise TypeError(
                f"param{_names(tree)[i]} is a DTensor (FSDP2's sharded param): bnbf.plan plans plain tensors; "
                f"use bnbf.distributed.plan(params, state), which plans the local shards"
            )


def _picker(idx: list[int]):
    get = operator.itemgetter(*idx)
    return get if len(idx) > 1 else (lambda items: (get(items),))


def _grad_table(seqs: list, host: Tensor) -> tuple[bytes, tuple[bool, ...]]:
    """The Python twin of the compiled ``grad_table``, given the addresses: each ``seqs[k]`` (data pointers, ints)
    written into the int64 tensor ``host``, seq k from the first even row after seq k - 1's (zeros between);
    returns the pointers without the padding (native uint64) and per seq whether all are 16-byte aligned."""
    rows: list[int] = []
    aligned = []
    for ptrs in seqs:
        rows += [0] * (len(rows) % 2)
        rows += ptrs
        aligned.append(functools.reduce(operator.or_, ptrs, 0) % 16 == 0)
    host.copy_(torch.frombuffer(array.array("q", rows), dtype=torch.int64))
    return array.array("Q", _CHAIN(seqs)).tobytes(), tuple(aligned)


def _scalars(rule: Any, h: Any, step: Any, skip_zeros: Any, max_unorm: Any, maximize: Any) -> tuple[tuple, bool]:
    """:func:`_scalar_values`, with a meta tensor among them refused naming its hyperparameter (the step reads
    their values: :func:`bnbf._host_checks.check_hparam_values`)."""
    values, clip = _scalar_values(rule, h, step, skip_zeros, max_unorm, maximize)
    if not set(map(type, values)) <= _NUMBERS:  # 0-d tensors among them
        check_hparam_values(values, h, max_unorm)
    return values, clip


def _checked_ref(h: Any) -> Any:
    """A weak reference to hyperparameters whose state slots were checked, by which the next step with the very
    object skips the check; ``_NO_REF`` (checked every step) where it holds a tensor, whose value (SGD's momentum
    switched on in place) can change which slots a step needs, or where its class has ``__slots__``."""
    if hparam_tensors(h):
        return _NO_REF
    try:
        return weakref.ref(h)
    except TypeError:
        return _NO_REF


def _scalar_values(rule: Any, h: Any, step: Any, skip_zeros: Any, max_unorm: Any, maximize: Any) -> tuple[tuple, bool]:
    """The rule's scalars followed by the four the step adds: the gradient's sign (-1 with ``maximize``), the
    seed of the states' stochastic rounding (the step mod 2**24, see bnbf.quant), and the clipping pair
    (max_unorm, lr); and whether clipping is on. Not checked for meta tensors (:func:`_scalars` checks them):
    for :meth:`Plan._checked_step`, which tells numbers from tensors anyway. Where 0-d tensors are among the
    inputs, computed from their values in float64 as the host computes numbers (Python floats), so a step with a
    tensor lr or step equals the step with those numbers: in one launch (:func:`_program_values`), else with torch
    ops on the tensors made float64 (traced, vmapped per-member values, arithmetic a program does not record)."""
    clip = check_update_options(rule, skip_zeros, max_unorm, maximize)
    found = hparam_tensors(h, step, max_unorm)
    if found:
        tensors = [t for _, t in found]
        made = _program_values(rule, h, step, max_unorm, maximize, tensors)
        if made is not None:
            return made, clip
        h, step, max_unorm = replace_hparam_tensors(h, step, max_unorm, iter([t.double() for t in tensors]))
    seed = step % DITHER_SEED_MOD  # an int, or a device op on a tensor step (no host sync)
    return (*rule.scalars(h, step), -1.0 if maximize else 1.0, seed, max_unorm, h.lr), clip


# where 0-d tensor scalars take one program launch: the devices whose steps run Triton kernels
PROGRAM_DEVICES = {"cuda", "cpu"} if interpreting() else {"cuda"}


def _program_values(rule: Any, h: Any, step: Any, max_unorm: Any, maximize: Any, tensors: list) -> tuple | None:
    """:func:`_scalar_values` from the 0-d ``tensors`` among the inputs (lr, the step...): the rule's arithmetic
    on them recorded and run in one launch (:mod:`bnbf.kernels.scalar_program`), every scalar a 0-d view of the
    float32 row it makes (:class:`ProgramValues`); an int step beside them is an argument of that launch. None
    where that route does not apply: tensors of a kind the kernel does not read as they are (subclasses,
    torch.func's wrappers, a dispatch mode, tensors in a derivative, lazily negated or efficient zero tensors,
    several devices, more than its pointers),
    tracing by torch.compile, or arithmetic a program cannot record; the caller's torch ops then compute them."""
    device = tensors[0].device
    if device.type not in PROGRAM_DEVICES or len(tensors) > scalar_program.MAX_INPUTS:
        return None
    if torch.compiler.is_compiling() or _dispatch_mode() is not None or not dataclasses.is_dataclass(h):
        return None
    for t in tensors:
        if type(t) is not Tensor or t.device != device or _functorch.is_functorch_wrapped_tensor(t):
            return None
    if differentiated(tensors):  # a derivative through them: the torch ops, which autograd records
        return None
    if _any_lazy(tensors):  # memory that is not their values (negative bit, efficient zeros): the torch ops
        return None

    # an int step beside the tensors is the launch's number: one program for every step (folded into the program,
    # each step would record and upload another); folded where the rule's arithmetic on it cannot be recorded
    number = type(step) is int and 0 <= step < scalar_program.MAX_NUMBER
    for as_number in (True, False) if number else (False,):
        program = _program(rule, h, _NUMBER if as_number else step, max_unorm, maximize, len(tensors))
        if program is not None:
            row = _program_row(program, device, _capturing({device}))
            return ProgramValues(scalar_program.run(program, row, tensors, step if as_number else 0))
    return None


def _program(rule: Any, h: Any, step: Any, max_unorm: Any, maximize: Any, n_tensors: int) -> Any:
    """The program of a step's scalars (kept in :data:`_PROGRAMS`), with ``step`` :data:`_NUMBER` where it is the
    launch's number; None where the arithmetic cannot be recorded."""
    key = _program_key(rule, h, step, max_unorm, maximize)
    program = _PROGRAMS.get(key, _MISSING) if key is not None else _MISSING
    if program is _MISSING:

        def scalars(*syms: Any) -> tuple:
            h2, s, u = replace_hparam_tensors(h, step, max_unorm, iter(syms))
            s = syms[-1] if step is _NUMBER else s
            return (*rule.scalars(h2, s), -1.0 if maximize else 1.0, s % DITHER_SEED_MOD, u, h2.lr)

        try:
            program = scalar_program.program_of(*scalar_program.trace(scalars, n_tensors, step is _NUMBER))
        except Exception:  # noqa: BLE001 - arithmetic the program cannot record: the torch ops compute it
            program = None
        if key is not None:
            _PROGRAMS.put(key, program)
    return program


# the programs' rows (constants, code, outputs; float64) on the device, kept as _NUMBER_ROWS are (below)
_PROGRAM_ROWS = Bounded(32)
_HELD_PROGRAM_ROWS: dict = {}


def _program_row(program: Any, device: torch.device, capturing: bool) -> Tensor:
    """:attr:`scalar_program.Program.row` on ``device`` (:func:`_kept_row`). Captured where none was made before
    the capture: filled inside the graph, a fill per value, and held for its replays only."""
    host = lambda: _to_device(torch.frombuffer(bytearray(program.data), dtype=torch.float64), device)  # noqa: E731
    row = _kept_row(_PROGRAM_ROWS, _HELD_PROGRAM_ROWS, (device, program.data), host, device, capturing)
    if row is None:
        row = torch.empty(len(program.row), dtype=torch.float64, device=device)
        for k, v in enumerate(program.row):
            row[k].fill_(v)
        _HELD_PROGRAM_ROWS[id(row)] = row
    return row


class ProgramValues(tuple):
    """A step's scalars made by one program: 0-d views of ``row``, the float32 row a kernel reads (which
    :func:`scalar_row` hands on as it is)."""

    def __new__(cls, row: Tensor) -> ProgramValues:
        values = super().__new__(cls, row.unbind())
        values.row = row
        return values


# the programs recorded, by what they were recorded from (a rule's hyperparameters with their tensors as _TENSOR);
# None: arithmetic that cannot be recorded
_PROGRAMS = Bounded(64)
_TENSOR = object()
_NUMBER = object()  # where an int step stands as the program's number
_MISSING = object()


def _program_key(rule: Any, h: Any, step: Any, max_unorm: Any, maximize: Any) -> tuple | None:
    """What decides a rule's program: its name, the hyperparameters' type and their numbers (a float with its sign:
    0.0 and -0.0 are other constants), where the tensors (and the launch's number) stand; None where a value is of
    another kind."""

    def part(v: Any) -> Any:
        if v is _NUMBER:
            return v
        if isinstance(v, Tensor):
            return _TENSOR
        t = type(v)
        if t is float:
            return (v, math.copysign(1.0, v))
        if t is int or t is bool or v is None:
            return (t, v)
        if t is tuple:
            return tuple(map(part, v))
        raise TypeError

    try:
        fields = tuple(part(getattr(h, f.name)) for f in dataclasses.fields(h))
        return (rule.name, type(h), fields, part(step), part(max_unorm), maximize)
    except TypeError:
        return None


def check_capture_scalars(h: Any, step: Any, device: torch.device) -> None:
    """Refuse scalars that a step captured in a CUDA graph would replay frozen: the step and lr must be tensors on
    the params' device (a Python number would replay its captured value: bias correction, the rounding's seed and a
    schedule's lr frozen); other Python numbers replay as the constants they are."""
    for name, v in (("step", step), ("lr", h.lr)):
        if not (isinstance(v, Tensor) and v.device == device):
            raise not_capturable(
                f"{name} must be a 0-d tensor on {device} to capture a step in a CUDA graph (a Python "
                f"number{' or a tensor on another device' if isinstance(v, Tensor) else ''} would be "
                f"replayed as its captured value); got {type(v).__name__}"
                + (f" on {v.device}" if isinstance(v, Tensor) else "")
            )
    for name, v in hparam_tensors(h):
        if v.device != device:
            raise not_capturable(f"the hyperparameter {name} is on {v.device}, the params on {device}")


# The Python numbers among a step's scalars, as float32 rows on the device, by (device, stream, where the tensors
# stand, the numbers): a step with a tensor lr or step then stacks its row from these and its tensors in one kernel,
# with no copy from the host (and a captured step with no fill per number). By stream: a row is uploaded and freed
# on the stream that reads it, so no other stream reads it before its copy or after its memory is reused. Rows read
# by a captured step are held for good, as the launch tables are.
_NUMBER_ROWS = Bounded(16)
_HELD_NUMBER_ROWS: dict = {}


def _number_row(values: Any, device: torch.device, capturing: bool) -> tuple | None:
    """The numbers of ``values`` (0 where a tensor stands) as a float32 row on ``device``, unbound into its
    elements: cached (a copy from the host at the first call of these numbers on this stream). While capturing a
    CUDA graph, a row made on any stream before the capture (which begins with a synchronize, so its copy is done),
    else None (a copy cannot be captured)."""
    # keyed by the numbers' exact bits (0.0 and -0.0 differ; a NaN matches itself) and where the tensors stand
    tensors = tuple(k for k, v in enumerate(values) if isinstance(v, Tensor))
    numbers = [0.0 if isinstance(v, Tensor) else v for v in values]
    what = (device, tensors, array.array("d", numbers).tobytes())

    def made() -> tuple:
        row = as_scalar_row(numbers, device)
        return row, row.unbind()

    entry = _kept_row(_NUMBER_ROWS, _HELD_NUMBER_ROWS, what, made, device, capturing)
    return None if entry is None else entry[1]


def _kept_row(cache: Bounded, held: dict, what: tuple, make: Callable[[], Any], device: torch.device,
              capturing: bool) -> Any:  # fmt: skip
    """What ``make()`` uploads from the host for ``what`` (its device first), kept in ``cache`` by stream: made at
    the first call on the stream that reads it. While capturing a CUDA graph, one made on any stream before the
    capture (which begins with a synchronize, so its copy is done), held in ``held`` for the replays whatever the
    cache evicts; else None (a copy cannot be captured)."""
    if capturing:
        found = next(((k, e) for k, e in reversed(cache.items()) if k[1:] == what), None)
        if found is None:
            return None
        held[found[0]] = found[1]
        return found[1]
    key = (_stream_of(device), *what)
    entry = cache.get(key)
    if entry is None:
        entry = cache.put(key, make())
    return entry


def _plain_scalars(values: Any) -> bool:
    """Whether a row of cached numbers may join these scalars: their tensors are plain and no dispatch mode (such
    as FakeTensorMode) is active, under which a cached row would be a tensor of the other kind (a fake row made
    there, or a real one entering it)."""
    return _dispatch_mode() is None and all(type(v) in _PLAIN_TYPES for v in values if isinstance(v, Tensor))


def _stream_of(device: torch.device) -> int:
    """The current stream's handle on a CUDA ``device`` (0 elsewhere)."""
    return _current_stream(device.index) if device.type == "cuda" else 0


def scalar_row(values: Any, device: torch.device) -> Tensor:
    """The step's scalars as one float32 row on ``device`` (:func:`bnbf.rules.base.as_scalar_row`); the numbers
    beside tensors come from :func:`_number_row`. In a call traced by torch.compile, numbers traced as inputs
    (SymInt/SymFloat) stay graph values, never read on the host (reading one would make it a guarded constant: a
    compile per value)."""
    if torch.compiler.is_compiling():
        return ops.traced_scalar_row(values, device)  # one Inductor kernel; a stack of >8 scalars is one per scalar
    if type(values) is ProgramValues and values.row.device == device:
        return values.row
    capturing = _capturing((device,))
    cached = any(isinstance(v, Tensor) for v in values) and _plain_scalars(values)
    if not (capturing or cached):
        return as_scalar_row(values, device)
    numbers = _number_row(values, device, capturing) if cached else None
    parts = []
    for k, v in enumerate(values):
        if isinstance(v, Tensor):
            parts.append(v.to(device=device, dtype=torch.float32).reshape(()))
        elif numbers is not None:
            parts.append(numbers[k])
        else:  # captured without a row made before: filled in on the device (a copy cannot be captured)
            parts.append(torch.full((), float(v), dtype=torch.float32, device=device))
    return torch.stack(parts)


def _one_set(values: tuple, device: torch.device) -> Any:
    """The scalars of a launch whose tensors all take one set, as :meth:`Plan.step` passes them: Python numbers as
    kernel arguments, else one float32 row on the device (no host synchronisation). Traced: the row as graph values
    (:func:`bnbf.ops.traced_scalar_row`; a number read on the host would be a guarded constant, a compile a value);
    where every scalar is a number, a float64 row on the host, which the op reads as the numbers an eager call
    passes (:func:`bnbf.ops.host_numbers`): the step kernel that takes them as arguments, faster than the one
    reading a row (benchmarks/results/2026-12-03_h200_session23.md)."""
    if torch.compiler.is_compiling():
        if not any(isinstance(v, Tensor) for v in values):
            return ops.traced_scalar_row(values, ops.HOST, torch.float64)
        return ops.traced_scalar_row(values, device)
    if set(map(type, values)) <= _NUMBERS:
        return tuple(map(float, values))
    with torch.no_grad():
        return scalar_row(values, device)


def packed_rows(values: list) -> bytes | None:
    """Each set's scalars (``values[k]``: set k's, as :func:`_scalars` gives them) as float32 rows, native bytes
    (float64 host values rounded once to float32, as a kernel argument or :func:`scalar_row` rounds them);
    None where some are 0-d tensors."""
    if not set(map(type, _CHAIN(values))) <= _NUMBERS:
        return None
    return array.array("f", _CHAIN(values)).tobytes()


def rows_layout(sets: list, k: int) -> tuple[list, list]:
    """How :func:`group_rows` gives launch groups of tensors with different hyperparameter sets their scalars:
    ``sets[g]`` is group g's (device, the set of each of its tensors). Returns (per device (device, the set of
    each row as a host int64 index, each group's (g, first row, rows), the index on the device once needed), and
    (g, set, device) of each group whose tensors all take one set: that group takes the set's scalars as a call
    of that set alone would, no rows; e.g. the 1-d leaves without weight decay, whose small states are 32-bit,
    beside the 8-bit matrices with it). Each group of rows starts at a 16-byte aligned row (padding rows repeat
    set 0), as a kernel argument must."""
    by_device: dict = {}
    singles = []
    for g, (device, mine) in enumerate(sets):
        if len(set(mine)) == 1:
            singles.append((g, mine[0], device))
            continue
        order, views = by_device.setdefault(device, ([], []))
        while len(order) * k % 4:
            order.append(0)
        views.append((g, len(order), len(mine)))
        order.extend(mine)
    entries = [[d, torch.tensor(order, dtype=torch.int64), views, None] for d, (order, views) in by_device.items()]
    return entries, singles


def _picked(table: Tensor, index: Tensor, device: torch.device) -> Tensor:
    """Rows ``index`` of the host matrix ``table``, on ``device`` (one copy; on CUDA picked straight into pinned
    memory: one host copy fewer than ``pin_memory()`` of the picked rows)."""
    if device.type != "cuda":
        return _to_device(table.index_select(0, index), device)
    host = torch.empty(table.shape[1] * len(index), dtype=torch.float32, pin_memory=True)
    return torch.index_select(table, 0, index, out=host.view(len(index), -1)).to(device, non_blocking=True)


def group_rows(layout: tuple, values: list, packed: bytes | None, one: Callable) -> list:
    """Each group's scalars as :func:`rows_layout` lays them out: for a group of several sets, [tensors, k]
    float32 rows on its device, row t for the group's tensor t (the kernel's HP_PER_TENSOR); ``packed``
    (:func:`packed_rows`): every device's rows picked on the host from the sets' rows and uploaded in one copy
    per device; None (0-d tensors among the values): the sets' rows stacked on each device (:func:`scalar_row`)
    and picked there, no host synchronisation. A group of one set takes ``one(values[set], device)``, what a
    call of that set takes. Bit for bit the scalars of one call per set."""
    entries, singles = layout
    out: list = [None] * (sum(len(entry[2]) for entry in entries) + len(singles))
    for g, s, device in singles:
        out[g] = one(values[s], device)
    if packed is not None and entries:
        table = torch.frombuffer(bytearray(packed), dtype=torch.float32).view(len(values), -1)
    for entry in entries:
        device, index, views, _ = entry
        if packed is not None:
            rows = _picked(table, index, device)
        else:
            if entry[3] is None:
                entry[3] = _to_device(index, device)
            with torch.no_grad():
                rows = torch.stack([scalar_row(v, device) for v in values])[entry[3]]
        for g, start, n in views:
            out[g] = rows[start : start + n]
    return out


def call_scalars(call: Any, vmapped: bool, skip_zeros: Any, max_unorm: Any, maximize: Any) -> tuple[dict, bool]:
    """A checked call's scalars on each of its params' devices (:func:`_one_set`) and whether it clips. Under
    ``vmap`` they are made with torch.func's dispatch off where no hyperparameter is a tensor a transform wraps (a
    member's lr...): each small op on a 0-d tensor hyperparameter would pass through vmap's layer."""
    plain = vmapped and not any(
        _functorch.is_functorch_wrapped_tensor(t) for _, t in hparam_tensors(call.hparams, call.step)
    )
    with torch._C._DisableFuncTorch() if plain else contextlib.nullcontext():
        values, clip = _scalars(call.rule, call.hparams, call.step, skip_zeros, max_unorm, maximize)
        return {d: _one_set(values, d) for d in {p.device for p in call.params}}, clip


def _capturing(devices: set) -> bool:
    """Whether a CUDA graph is being captured on the current stream of a step on ``devices``."""
    return any(d.type == "cuda" for d in devices) and torch.cuda.is_current_stream_capturing()


def _step_generic(
    param: Any, grad: Any, state: Any, hparams: Any, step: Any, skip_zeros: Any, max_unorm: Any, maximize: Any
) -> None:
    """The in-place step without a plan's tables: every check, then one op call per group (the reference
    path, non-contiguous params, subclasses, tracing)."""
    # under vmap, ops.step_ steps the stacked tensors in place (bnbf.ops._step_vmapped_): no outputs, no copy back
    # and no batched op per tensor (the detach/contiguous below would be one each)
    vmapped = ops.vmap_level() is not None and not torch.compiler.is_compiling()
    if torch.compiler.is_compiling() or vmapped:  # Dynamo-friendly checks, hyperparameters as graph values
        call = _prepare_traced(param, grad, state, hparams, step, max_unorm, in_place=True)
        if vmapped:  # memory, which the traced checks cannot see: compared on the stacked tensors
            fields = [t for s in call.states for t in s]
            unwrapped = ops.check_vmapped_leaves_apart(param, call.params, call.grads, call.states, fields)
    elif unaddressable(_flatten(param)[0], _flatten(grad)[0]):
        # with subclasses such as FakeTensor: the pure step (the op's fake implementation...), written back into
        # the params and states
        from bnbf.functional import update

        _prepare_traced(param, grad, state, hparams, step, max_unorm, in_place=True)  # refuses torch.func.grad
        new_p, new_s = update(
            param, grad, state, hparams, step, skip_zeros=skip_zeros, max_unorm=max_unorm, maximize=maximize
        )
        pairs = list(zip(_flatten(param)[0], _flatten(new_p)[0]))
        pairs += [
            (a, b)
            for old, new in zip(_flatten(state, is_leaf=is_state)[0], _flatten(new_s, is_leaf=is_state)[0])
            for a, b in zip(old, new)
        ]
        for old, new in pairs:  # all checked before any is written: a copy into another type may keep part of it
            if type(new) is not type(old) and not {type(new), type(old)} <= _PLAIN_TYPES:
                raise TypeError(
                    f"the step of these {type(new).__name__} values cannot be written in place into a "
                    f"{type(old).__name__}: params, grads and states must be of one tensor type (or use bnbf.update)"
                )
        with torch.no_grad():
            for old, new in pairs:
                old.copy_(new)
        return
    else:
        call = _prepare(param, grad, state, hparams, step, max_unorm, in_place=True)
        check_scalars_plain(call.hparams, step, max_unorm)  # plain params: the kernels or the codec read each scalar
    devices = {p.device for p in call.params}
    if not torch.compiler.is_compiling() and _capturing(devices):  # the tables are checked at the launch
        for device in devices:
            check_capture_scalars(call.hparams, call.step, device)
    rows, clip = call_scalars(call, vmapped, skip_zeros, max_unorm, maximize)
    groups = list(_groups(call.params, call.states))
    with torch.no_grad():
        steps = []
        for (device, _, layout), idx in groups:
            if vmapped:
                if len(idx) == len(call.params):  # one group: the call's lists as they are
                    ps, gs, ss, mine = call.params, call.grads, fields, unwrapped
                else:
                    ps, gs = [call.params[i] for i in idx], [call.grads[i] for i in idx]
                    at = _field_positions(call.states, idx)
                    ss, mine = [fields[k] for k in at], ops.unwrapped_at(unwrapped, idx, at)
                ops.step_(ps, gs, ss, rows[device], layout, skip_zeros, clip, mine)
                continue
            ss = [t for i in idx for t in call.states[i]]
            ps = [call.params[i].detach() for i in idx]
            work = [p if p.is_contiguous() else p.contiguous() for p in ps]
            steps.append((ps, work, [call.grads[i].detach().contiguous() for i in idx], ss, layout, device))
        devices = {entry[5] for entry in steps}
        if len(steps) == 2 and len(devices) == 1 and not clip and ops.is_host_row(rows[steps[0][5]]):
            (_, work, gs, ss, layout, _), (_, work2, gs2, ss2, layout2, device) = steps
            ops.step_pair_(work, gs, ss, work2, gs2, ss2, rows[device], layout, layout2, skip_zeros)
        else:
            for _, work, gs, ss, layout, device in steps:
                ops.step_(work, gs, ss, rows[device], layout, skip_zeros, clip)
        for ps, work, *_ in steps:
            for p, w in zip(ps, work):
                if w is not p:
                    p.copy_(w)
    if vmapped:  # the next call of these trees may skip the checks on batched tensors
        _vmap_memo.remember(call, groups, step, rows)


# ---- bnbf.update_'s plans -----------------------------------------------------------------------------------

# one per (optimizer, param group, override bucket) in use; threads stepping different params share it (its lock)
_PLANS = Bounded(32)
_DEAD: list = []  # keys of plans marked dead by a weakref callback, dropped at the next lookup


def _died(plan_ref: weakref.ref, key: tuple, _tensor_ref: Any) -> None:
    # runs wherever a planned tensor is freed (possibly inside a cache update of this very thread), so it
    # takes no lock and leaves the cache alone: the next _cached call drops the plan
    p = plan_ref()
    if p is not None and p.alive:
        p.alive = False
        p.groups = []  # its device tables and scratch go now, not at the next call
        _DEAD.append(key)


def _drop_dead() -> None:
    with _PLANS.lock:
        while _DEAD:
            key = _DEAD.pop()
            p = _PLANS.get(key)
            if p is not None and not p.alive:
                del _PLANS[key]


def _confirmed(plan: Plan, params: list, states: list) -> bool:
    """Whether ``plan``, made by :func:`_cached` and kept (weakly) by a caller that thus skips the lookup, is for
    these very ``params`` and ``states`` at their planned memory, shapes and dtypes: what :func:`_cached` confirms
    of the plan it finds (the plan then moves to the cache's end, as a found one does)."""
    if not (plan._same(params, states) and plan._confirm(params, states)):
        return False
    _PLANS.touch(plan._key)  # whatever plan is there now is the newest: moving it is harmless
    return True


def _cached(tree: Any, params: list, states: list, spec: Any, s_spec: Any) -> Plan | None:
    """:func:`bnbf.update_`'s plan for these params and states: found by a few ids, confirmed to be for
    these very objects (ids, while none of its tensors was freed) with their planned memory and shapes,
    else built. The cache holds only weak references to tensors: a plan whose tensor is freed is dropped.
    None where the generic path must run (the reference path, non-contiguous params, tracing, or anything
    to report as an error)."""
    if s_spec != spec or len(states) != len(params) or not params or torch.compiler.is_compiling():
        return None
    if _DEAD:
        _drop_dead()
    key = (id(params[0]), id(params[-1]), id(states[0]), id(states[-1]), len(params))
    found = _PLANS.get(key)
    if found is not None:
        # the same tensors in another container (a dict, then a list) are another call: its own plan
        if found._spec == spec and found._same(params, states) and found._confirm(params, states):
            _PLANS.touch(key)
            return found
        with _PLANS.lock:
            if _PLANS.get(key) is found:
                del _PLANS[key]
    made = Plan._weak(tree, params, states, spec)
    if made is None:
        return None
    made._key = key
    died = functools.partial(_died, weakref.ref(made), key)
    made._refs = [weakref.ref(t, died) for t in itertools.chain(params, _CHAIN(states))]
    return _PLANS.put(key, made)

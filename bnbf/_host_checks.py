"""Checks of a step's inputs on the host, all made before anything is written: plain Python.

- The leaves of a call (:func:`_states_ok`, :func:`_check_no_overlap`...): float params, bnbf states that
  fit them, no two leaves sharing memory. A pure :func:`bnbf.update` runs them every call; an in-place step
  runs them once, when its :class:`bnbf.plan.Plan` is built.
- The grads of a call (:func:`_grads_ok`, :func:`_check_grad`), the step number, the update options and the
  state slots the hyperparameters need.

Each ``*_ok`` function answers in C-level loops over all leaves (``map`` of attribute getters, list
comparisons); on "no", the ``_check_*`` functions walk the leaves one by one and raise the precise error.
The per-step checks of a plan live with it (:meth:`bnbf.plan.Plan.step`); where the optional C++ extension
was built at install time (:data:`NATIVE`), each is one compiled call over all tensors.
"""

from __future__ import annotations

import array
import bisect
import collections
import copy
import dataclasses
import functools
import itertools
import numbers
import operator
import os
import struct
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torch._C import _functorch
from torch._functorch import pyfunctorch
from torch.autograd import forward_ad
from torch.utils import _pytree as pytree

from bnbf._bounded import Bounded
from bnbf.rules import RULES, get_rule
from bnbf.rules.base import _value, member_values, members, type_name
from bnbf.rules.base import no_value as _no_value
from bnbf.state import Layout, State, is_state, present_mask


def _native() -> Any:
    """The compiled twins of the plan's per-step checks (bnbf/csrc/host_checks.cpp), built at install time;
    None where they were not built, were built against another torch or from an older source (without a check
    this one calls), or ``BNBF_HOST_CHECKS=python``."""
    if os.environ.get("BNBF_HOST_CHECKS", "native") == "python":
        return None
    try:
        from bnbf import _host_checks_native as native
    except ImportError:  # not built (an isolated build without torch, no compiler), or another torch's symbols
        return None
    if getattr(native, "torch_version", None) != torch.__version__ or not hasattr(native, "same_plain_dicts"):
        return None
    return native


NATIVE = _native()


def packed_identities(objs: list) -> bytes:
    """(address, type address) of each object as native uint64: what ``NATIVE.same_objects`` compares a list
    with (the very objects, while whoever keeps this keeps them alive)."""
    return array.array("Q", itertools.chain.from_iterable(zip(map(id, objs), map(id, map(type, objs))))).tobytes()


_PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_PARAM_DTYPE_SET = set(_PARAM_DTYPES)
_STRIDED = {torch.strided}
_NESTED = operator.attrgetter("is_nested")
_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")
_DEVICE = operator.attrgetter("device")
_LAYOUT = operator.attrgetter("layout")
_SHAPE_DTYPE = operator.attrgetter("shape", "dtype")
_NBYTES = operator.attrgetter("nbytes")


def _is_plain(t: object) -> bool:
    """A torch.Tensor or nn.Parameter itself: other subclasses may answer metadata reads differently."""
    return type(t) is Tensor or type(t) is torch.nn.Parameter


def _check_param(p: Any, where: str, wide: bool = False) -> None:
    """``wide``: float64 params pass too (init_state: their 32-bit state serves the differentiable step)."""
    if not isinstance(p, Tensor):
        raise TypeError(f"param{where} must be a Tensor, got {type(p).__name__}")
    if p.dtype not in _PARAM_DTYPES and not (wide and p.dtype == torch.float64):
        kind = "complex" if p.is_complex() else ("integer" if not p.is_floating_point() else str(p.dtype)[6:])
        also = (
            "; float64 params step only with differentiable=True, with float64 32-bit state from "
            "bnbf.init_state(..., OptimSpec(state_bits=32))"
            if p.dtype == torch.float64
            else ""
        )
        raise TypeError(
            f"param{where} has dtype {p.dtype}: {kind} params are not supported "
            f"(bnbf optimizes float32, float16 and bfloat16 params{also})"
        )
    if p.layout != torch.strided or p.is_nested:
        got = "a nested tensor" if p.is_nested else f"layout {p.layout}"
        raise TypeError(f"param{where} must be a dense (strided) tensor, got {got}")
    _check_lazy(p, f"param{where}")


def _any_lazy(ts: list) -> bool:
    """Whether a tensor's memory is not its values: a lazily negated view (the negative bit: ``x.conj().imag``) or
    an efficient zero tensor (no memory at all); the kernels would read or write the memory as it is. C-level maps:
    the pure step checks every leaf each call."""
    return any(map(Tensor.is_neg, ts)) or any(map(Tensor._is_zerotensor, ts))


def _check_lazy(t: Tensor, what: str) -> None:
    if torch.compiler.is_compiling():  # traced values: the compiled graph's inputs are materialized for its ops
        return
    if t._is_zerotensor():
        raise TypeError(f"{what} is an efficient zero tensor, which has no memory to read: pass torch.zeros_like(it)")
    if t.is_neg():
        raise TypeError(
            f"{what} has its negative bit set (a lazily negated view, such as x.conj().imag): its memory holds the "
            f"negated values; pass {what.split('[')[0]}.resolve_neg()"
        )


def _check_present(rule: Any, h: Any, states: list) -> None:
    """The states keep exactly the slots these hyperparameters use (e.g. a momentum buffer)."""
    want = present_mask(rule, h)
    for s in states:
        have = _layout(s).present
        if have != want:
            names = lambda mask: [slot.name for j, slot in enumerate(rule.states) if (mask >> j) & 1]
            raise ValueError(
                f"the state keeps {names(have)} but these {rule.name} hyperparameters need {names(want)}; "
                f"build the state with bnbf.init_state(params, spec, hparams) using the same hyperparameters"
            )


def _layout(s: Any) -> Layout:
    """A state's layout; a layout as it is (a packed state's checks pass its groups' layouts)."""
    return s if isinstance(s, Layout) else s.layout


def _check_step(step: Any) -> None:
    if isinstance(step, Tensor):
        _check_step_tensor(step)
        if step.device.type == "cpu" and not torch.compiler.is_compiling() and int(step) < 1:  # traced: unread
            raise ValueError(f"Invalid step: {int(step)} (steps count from 1)")
        return
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an int or a 0-d int32/int64 tensor, got {type(step).__name__}")
    if step < 1:
        raise ValueError(f"Invalid step: {step} (steps count from 1)")


def _check_step_tensor(step: Tensor) -> None:
    """A step tensor's kind, its value not read: 0-d int32 or int64 (a narrower count wraps: the step hashes
    step % 2**24, 0 in int16), with a value (not meta)."""
    if step.dim() != 0 or step.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"step must be an int or a 0-d int32/int64 tensor, got {step.dtype} {tuple(step.shape)}")
    if step.device.type == "meta":
        raise _no_value("step")


def check_hparam_values(values: tuple, h: Any, max_unorm: Any = None) -> None:
    """ValueError naming a meta hyperparameter (or max_unorm) among those a step's scalars (``values``: the rule's
    scalars of ``h``, :func:`bnbf.plan._scalars`) are made of: the step reads their values, which a meta tensor has
    not (torch's copy to the params' device raised "Cannot copy out of meta tensor", naming nothing). The
    hyperparameters' own checks (``make_hparams``) take meta tensors, as stand-ins for a device's (the capture
    checks), and a meta hyperparameter that no scalar is made of (Adagrad's initial_accumulator_value) has nothing
    read; a meta step tensor is refused by :func:`_check_step_tensor`."""
    if any(isinstance(v, Tensor) and v.device.type == "meta" for v in values):
        for name, t in hparam_tensors(h, None, max_unorm):
            if t.device.type == "meta":
                raise _no_value(name)


def subclass_scalar_error(name: str, t: Tensor, in_place: bool) -> TypeError:
    """The refusal of a hyperparameter, step or bound of a tensor subclass with its own dispatch where the step reads
    scalars from memory (the kernels' row or arguments), which is not such a tensor's value."""
    return TypeError(
        f"bnbf: {name} is a {type(t).__name__}, a tensor subclass that dispatches on its own: the "
        f"{'in-place ' if in_place else ''}step cannot read its value from memory; pass a plain tensor or a number"
    )


def check_scalars_plain(h: Any, step: Any, max_unorm: Any) -> None:
    """:func:`subclass_scalar_error` for the first hyperparameter tensor, step or max_unorm of such a subclass
    (TwoTensor...): for the direct launch's steps (a plan's), which read every scalar's memory."""
    for name, t in hparam_tensors(h, step, max_unorm):
        if own_dispatch(t):
            raise subclass_scalar_error(name, t, True)


def _flatten(tree: Any, is_leaf=None) -> tuple[list, Any]:
    """Leaves and a structure key; flat dicts and lists of leaves skip the generic pytree walk. A flat one with a
    leaf of another type (an int grad, a float param) gets the same key, so that the leaf checks name that leaf
    (a pytree structure for it would differ from its params' key only in form: an error whose printouts agree)."""
    leaf_type = State if is_leaf is is_state else Tensor
    if type(tree) is dict:
        values = list(tree.values())
        if all(map(isinstance, values, itertools.repeat(leaf_type))) or _all_leaves(values, is_leaf):
            return values, ("dict", tuple(tree))
    elif type(tree) in (list, tuple) and (
        all(map(isinstance, tree, itertools.repeat(leaf_type))) or _all_leaves(tree, is_leaf)
    ):
        return list(tree), (type(tree), len(tree))
    elif isinstance(tree, leaf_type):
        return [tree], "leaf"
    leaves: list = []
    shape: list = []
    if (
        (is_leaf is None or is_leaf is is_state)
        and type(tree) in _NESTS
        and not torch.compiler.is_compiling()  # traced: pytree's walk (Dynamo traces no lock, no id())
        and (_walk if NATIVE is None else NATIVE.walk)(tree, leaf_type, leaves, shape)
    ):
        key = tuple(shape)  # a param tree's and its state tree's: one spec object, compared by identity
        spec = _SPECS.get(key)
        if spec is None:
            spec = pytree.tree_flatten(tree, is_leaf=is_leaf)[1]
            with _SPECS.lock:
                _SHAPES[id(spec)] = (spec, key)
                _SPECS.put(key, spec)
        return leaves, spec
    return pytree.tree_flatten(tree, is_leaf=is_leaf)


# nested dicts, lists and tuples of leaves (a module's params by submodule; OrderedDicts too, as state_dict() gives
# them): their structure read by _walk, each structure's pytree spec made once (and rebuilt from its shape by
# _unwalk). Keys: types, lengths and str keys only (no caller's object is held)
_NESTS = (dict, list, tuple, collections.OrderedDict)
_MAPS = (dict, collections.OrderedDict)
_STR = {str}
_SHAPES: dict = {}  # id(spec) -> (spec, shape), of each spec _SPECS holds
_SPECS = Bounded(64, evicted=lambda spec: _SHAPES.pop(id(spec), None))  # shape -> its pytree spec


def _walk(tree: Any, leaf_type: type, leaves: list, shape: list) -> bool:
    """Append ``tree``'s leaves (instances of ``leaf_type``) in pytree's order and its structure (each container's
    type, length and a dict's keys; None for a leaf); False for anything else in it (another container or leaf type, a
    key that is not a str, None): :func:`_flatten` then takes pytree's own walk. The compiled ``walk`` is its twin
    (one call for a whole tree: this walk of GPT-2's 148 leaves nested by module took 55 us, most of update_'s time)."""
    t, n = type(tree), len(tree)
    if t in _MAPS:
        if tree and set(map(type, tree)) != _STR:
            return False
        shape += (t, n, *tree)
    else:
        shape += (t, n)
    for v in list(tree.values()) if t in _MAPS else tree:
        if isinstance(v, leaf_type):
            leaves.append(v)
            shape.append(None)
        elif type(v) not in _NESTS or not _walk(v, leaf_type, leaves, shape):
            return False
    return len(tree) == n  # a node resized under the walk (by an isinstance's Python code): its shape is stale


def _all_leaves(values: Any, is_leaf: Any) -> bool:
    """Whether every value is a pytree leaf, None excepted (:func:`_none_leaf` names a None where a leaf should be)."""
    return all(v is not None and pytree.tree_is_leaf(v, is_leaf=is_leaf) for v in values)


def _fast_leaves(tree: Any) -> tuple[list | None, Any]:
    """:func:`_flatten`'s leaves and key for a flat dict, list or tuple, without checking the leaves' types
    (``(None, None)`` for any other tree, a nested one included: :func:`_flatten` walks it)."""
    t = type(tree)
    if t is dict:
        values = list(tree.values())
        return (None, None) if any(type(v) in _NESTS for v in values) else (values, ("dict", tuple(tree)))
    if t is list or t is tuple:
        return (None, None) if any(type(v) in _NESTS for v in tree) else (tree, (t, len(tree)))
    return None, None


def same_plain_dicts(dicts: list, wants: list) -> bool:
    """Whether each of ``dicts`` is a dict with the keys of its ``wants`` in that order and its numbers exactly (the
    same type: bool, int and float apart; a float's bits, a zero's sign included; tuples of them item by item):
    hyperparameters given again as new dicts with the same values. One compiled call where it was built."""
    return NATIVE.same_plain_dicts(dicts, wants) if NATIVE is not None else _same_plain_dicts(dicts, wants)


def _same_plain_dicts(dicts: list, wants: list) -> bool:
    """:func:`same_plain_dicts`' Python twin."""
    if len(dicts) != len(wants):
        return False
    for d, w in zip(dicts, wants):
        if type(d) is not dict or len(d) != len(w):
            return False
        for (kd, vd), (kw, vw) in zip(d.items(), w.items()):
            if (kd is not kw and not (type(kd) is str and type(kw) is str and kd == kw)) or not _same_number(vd, vw):
                return False
    return True


def _same_number(v: Any, want: Any, in_tuple: bool = False) -> bool:
    t = type(v)
    if t is not type(want):
        return False
    if t is float:
        return struct.pack("d", v) == struct.pack("d", want)
    if t is bool or t is int:
        return v == want
    if t is tuple and not in_tuple:
        return len(v) == len(want) and all(_same_number(a, b, True) for a, b in zip(v, want))
    return False


def _plain(t: Tensor) -> Tensor:
    """``t`` contiguous, detached where it requires grad: one that does not has nothing to detach, and a detach a
    tensor took 0.5 ms of a pure GPT-2 step's host time on an H100 (scripts/pure_host.py)."""
    return (t.detach() if t.requires_grad else t).contiguous()


def _values_of(tree: Any, keys: tuple) -> list | None:
    """The values of ``tree`` in order where it is a dict whose keys are ``keys`` in that order, else None; one
    compiled call where the keys are the very objects of ``keys``."""
    if type(tree) is not dict:
        return None
    if NATIVE is not None:
        values = NATIVE.values_if_keys(tree, keys)  # None also where a key is an equal string, not the same object
        if values is not None:
            return values
    return list(tree.values()) if tuple(tree) == keys else None


def _unflatten(leaves: list, spec: Any) -> Any:
    if spec == "leaf":
        return leaves[0]
    if isinstance(spec, tuple) and spec[0] == "dict":
        return dict(zip(spec[1], leaves))
    if isinstance(spec, tuple) and spec[0] in (list, tuple):
        return spec[0](leaves)
    shape = None if torch.compiler.is_compiling() else _shape_of(spec)
    if shape is not None:  # a structure of :func:`_walk`'s: rebuilt from its shape (in one call where compiled)
        if NATIVE is not None:
            return NATIVE.unwalk(shape, leaves if type(leaves) is list else list(leaves))
        return _unwalk(shape, iter(leaves))
    return pytree.tree_unflatten(leaves, spec)


def _shape_of(spec: Any) -> tuple | None:
    """The :func:`_walk` shape of a spec :func:`_flatten` made from its own walk, else None."""
    entry = _SHAPES.get(id(spec))
    return entry[1] if entry is not None and entry[0] is spec else None


def walked(spec: Any) -> bool:
    """Whether ``spec`` is a nested structure :func:`_flatten` read by its own walk (str keys: no caller's object
    in it)."""
    return _shape_of(spec) is not None


def leaves_of(tree: Any, spec: Any, states: bool = False) -> list | None:
    """The leaves (tensors, or states where ``states``) of ``tree`` where it has the walked structure ``spec``, else
    None: :func:`_flatten`'s walk with its shape compared to the spec's, without the spec's lookup by shape (a hash
    of the whole shape: about a tenth of a nested in-place step's host time)."""
    shape = _shape_of(spec)
    if shape is None or type(tree) not in _NESTS or torch.compiler.is_compiling():
        return None
    leaves: list = []
    got: list = []
    if not (_walk if NATIVE is None else NATIVE.walk)(tree, State if states else Tensor, leaves, got):
        return None
    return leaves if tuple(got) == shape else None


def _unwalk(shape: tuple, leaves: Any) -> Any:
    """The tree of :func:`_walk`'s ``shape`` with ``leaves`` (an iterator) in it: pytree's unflatten of nested
    dicts, lists and tuples without its per-node calls."""
    pos = 0

    def build() -> Any:
        nonlocal pos
        t = shape[pos]
        if t is None:
            pos += 1
            return next(leaves)
        n = shape[pos + 1]
        pos += 2
        if t in _MAPS:
            keys = shape[pos : pos + n]
            pos += n
            return t((k, build()) for k in keys)
        items = [build() for _ in range(n)]
        return items if t is list else tuple(items)

    return build()


def _names(param: Any) -> list[str]:
    """Key strings of the leaves (only needed for error messages)."""
    return [keystr(path) for path, _ in pytree.tree_flatten_with_path(param)[0]]


class LeafName(str):
    """A leaf's key in the flat dicts that :mod:`bnbf.compose` hands the core (one per group of leaves): the leaf's
    ``functional_call`` name (``"m.1"``), given ``keypath``, the leaf's key path in the caller's tree, by which the
    core's messages name it (:func:`keystr`: ``['m'][1]``, as a call of the whole tree names it)."""

    keypath: tuple


def keystr(path: tuple) -> str:
    """A leaf's key path as ``torch.utils._pytree.keystr`` prints it (``[1]`` for a list's or tuple's index,
    ``['a']`` for a dict's key); a :class:`LeafName` key as its own key path."""
    if len(path) == 1 and type(path[0]) is pytree.MappingKey and type(path[0].key) is LeafName:
        path = path[0].key.keypath
    return pytree.keystr(path)


@functools.lru_cache(maxsize=4096)
def _expected(layout: Layout, shape: torch.Size) -> tuple:
    return tuple(layout.expected(shape).values())


def _states_ok(params: list, states: list) -> bool:
    """Float params (strided) with bnbf states whose fields fit them: shape, dtype, the param's device,
    contiguous. In C-level loops over all leaves (a pure call's host time is mostly these checks); a list
    of one leaf checks that leaf. False: :func:`_check_leaf` names what is wrong."""
    try:
        if not (
            all(map(isinstance, params, itertools.repeat(Tensor)))
            and all(map(isinstance, states, itertools.repeat(State)))
        ):
            return False
        devices = list(map(_DEVICE, params))
        one_device = len(set(devices)) == 1
        fields = [t for s in states for t in s]
        expected = [e for s, shape in zip(states, map(_SHAPE, params)) for e in _expected(type(s).layout, shape)]
        return (
            set(map(_DTYPE, params)) <= _PARAM_DTYPE_SET
            and set(map(_LAYOUT, params)) == _STRIDED
            and not _any_lazy(params)
            and list(map(_SHAPE_DTYPE, fields)) == expected
            and (
                set(map(_DEVICE, fields)) <= {devices[0]}
                if one_device
                else list(map(_DEVICE, fields)) == [d for d, s in zip(devices, states) for _ in s]
            )
            and all(map(Tensor.is_contiguous, fields))
        )
    except (AttributeError, TypeError, RuntimeError):  # a state field that is not a Tensor; a nested tensor's shape
        return False


def _grads_ok(params: list, grads: list) -> bool:
    """Strided tensors of their params' shapes, dtypes and devices (params already checked)."""
    return (
        all(map(isinstance, grads, itertools.repeat(Tensor)))
        and set(map(_LAYOUT, grads)) == _STRIDED
        and not any(map(_NESTED, grads))  # strided, but no shape to read
        and list(map(_SHAPE, grads)) == list(map(_SHAPE, params))
        and list(map(_DTYPE, grads)) == list(map(_DTYPE, params))
        and list(map(_DEVICE, grads)) == list(map(_DEVICE, params))
        and not _any_lazy(grads)
    )


def _structures(param: Any, grad: Any, state: Any, traced: bool = False) -> tuple[list, list, list, Any]:
    """The call's leaves (params, grads, states) and its structure, which the three must share; ``traced``:
    torch's pytree flattening, which Dynamo traces."""
    flat = pytree.tree_flatten if traced else _flatten
    params, p_spec = flat(param)
    grads, g_spec = flat(grad)
    states, s_spec = flat(state, is_leaf=is_state)
    if not params:
        raise ValueError("update needs at least one tensor")
    if g_spec != p_spec:
        _none_leaf("grad", grad)
        raise ValueError(f"grad structure {g_spec} does not match param structure {p_spec}")
    if s_spec != p_spec:
        _none_leaf("state", state)
        raise ValueError(f"state structure {s_spec} does not match param structure {p_spec}")
    return params, grads, states, p_spec


def _none_leaf(what: str, tree: Any) -> None:
    """ValueError naming a None where a param's grad or state should be (flattened, a None is no leaf at all, so
    the structures differ in a way their printouts hide)."""
    leaves = pytree.tree_flatten_with_path(tree, is_leaf=lambda x: x is None or is_state(x))[0]
    for path, leaf in leaves:
        if leaf is None:
            raise _is_none(what, keystr(path))


def _is_none(what: str, name: str) -> ValueError:
    return ValueError(
        f"{what}{name} is None: every param of the call needs a {what} (pass only the params that have one)"
    )


def _check_grad(name: str, p: Tensor, g: Any) -> None:
    """Raise the precise error for a grad that does not fit its (valid) param; return if it does."""
    if g is None:  # a None leaf of a nested tree (pytree's leaf: the structures agree)
        raise _is_none("grad", name)
    if not isinstance(g, Tensor):
        raise TypeError(f"grad{name} must be a Tensor, got {type(g).__name__}")
    if g.is_nested:
        raise RuntimeError(f"bnbf does not support nested gradients (grad{name} is a nested tensor)")
    if g.layout != torch.strided:
        kind = "sparse gradients" if g.is_sparse or "sparse" in str(g.layout) else "gradients of a non-strided layout"
        raise RuntimeError(f"bnbf does not support {kind} (grad{name} has layout {g.layout})")
    if g.shape != p.shape:
        raise ValueError(f"grad{name} has shape {tuple(g.shape)} but the param has shape {tuple(p.shape)}")
    if g.dtype != p.dtype:
        raise TypeError(f"grad{name} has dtype {g.dtype} but the param has dtype {p.dtype}")
    if g.device != p.device:
        raise ValueError(f"grad{name} is on {g.device} but the param is on {p.device}")
    _check_lazy(g, f"grad{name}")


def _check_is_state(name: str, s: Any) -> None:
    """Raise the precise error for a state leaf that is no bnbf state (None: a None leaf of a nested tree, which
    pytree takes for a leaf, so the structures agree)."""
    if s is None:
        raise _is_none("state", name)
    if not is_state(s):
        raise TypeError(f"state{name} is not a bnbf state (make it with bnbf.init_state), got {type(s)}")


def _check_state(name: str, p: Tensor, s: Any) -> None:
    """Raise the precise error for a state that does not fit its (valid) param; return if it does."""
    _check_is_state(name, s)
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


_NO_GRAD = object()  # _check_leaf's grad where a call's grads are not checked (a None grad is a leaf to refuse)


def _check_leaf(name: str, p: Any, g: Any, s: Any) -> None:
    """Raise the precise error for a leaf that failed :func:`_states_ok` or :func:`_grads_ok` (``g``
    :data:`_NO_GRAD`: the param and state only)."""
    _check_param(p, name)
    if g is not _NO_GRAD:
        _check_grad(name, p, g)
    _check_state(name, p, s)
    raise AssertionError(f"unexpected input at {name}")  # the checks and _check_leaf disagree


def _check_leaves(param: Any, params: list, states: list, grads: list | None = None) -> None:
    """Raise the precise error for the first leaf (in order) whose param, grad or state is wrong, if
    :func:`_states_ok` (and :func:`_grads_ok` with ``grads``) said no; return if they said yes."""
    if _states_ok(params, states) and (grads is None or _grads_ok(params, grads)):
        return
    names = _names(param)
    for i, (p, s) in enumerate(zip(params, states)):
        g = _NO_GRAD if grads is None else grads[i]
        if not (_states_ok([p], [s]) and (g is _NO_GRAD or _grads_ok([p], [g]))):
            _check_leaf(names[i], p, g, s)
    raise AssertionError("the checks of all leaves and of each leaf disagree")


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


def _apart(starts: list, ends: list) -> bool:
    """Whether the byte ranges ``[start, end)`` are disjoint, as a sufficient test: with starts and ends sorted on
    their own, the k-th end is at most the (k+1)-th start (the ranges covering an address are the starts at or
    before it less the ends at or before it). Empty ranges, and several devices' addresses compared as one, can only
    make it fail: the caller's exact sweep then decides."""
    return not any(map(operator.lt, sorted(starts)[1:], sorted(ends)))


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
    if 0 in starts:  # no storage at address 0 (a subclass with its own dispatch, as TwoTensor): the caller names it
        bare = [k for k, (st, sz) in enumerate(zip(starts, sizes)) if st == 0 and sz]
        if bare:
            return bare[0], bare[0]
    if not all(map(Tensor.is_contiguous, params)):  # the states' fields are contiguous (checked)
        sizes = [s if t.is_contiguous() else _span(t) for t, s in zip(tensors, sizes)]
    ends = list(map(operator.add, starts, sizes))
    if _apart(starts, ends):
        return None
    owner = [p.device for p in params] + [p.device for p, s in zip(params, states) for _ in s]
    found = []
    for device in set(owner):  # addresses compare only within one device
        idx = [k for k in range(len(tensors)) if owner[k] == device and sizes[k]]  # an empty tensor has no memory
        pair = _first_overlap(tensors, starts, ends, idx)
        if pair is not None:
            found.append(pair)
    return min(found) if found else None


def _grad_overlap(params: list, grads: list, states: list) -> tuple[int, int] | None:
    """``(j, k)``: grad ``j`` shares memory with position ``k`` of ``[*params, *fields of the states]``, which an
    in-place step writes, else None. A grad that is exactly its own param (same address and layout) is read and
    written element by element and counts as apart; grads may share memory with each other (read only). Params
    and states are apart (:func:`_overlap`)."""
    written = [*params, *itertools.chain.from_iterable(states)]
    g_starts = list(map(Tensor.data_ptr, grads))
    # the usual case first, as _overlap's: every range (self-aliased grads left out) apart from every other
    others = [g for g, a, b in zip(grads, g_starts, map(Tensor.data_ptr, params)) if a != b]
    tensors = [*written, *others]
    starts = list(map(Tensor.data_ptr, tensors))
    if _apart(
        starts, [a + (n if t.is_contiguous() else _span(t)) for a, n, t in zip(starts, map(_NBYTES, tensors), tensors)]
    ):
        return None
    owner = [p.device for p in params] + [p.device for p, s in zip(params, states) for _ in s]
    spans = sorted((t.data_ptr(), t.data_ptr() + _span(t), k) for k, t in enumerate(written) if t.numel())
    ends = [e for _, e, _ in spans]  # disjoint ranges sorted by start: their ends are sorted too
    for j, g in enumerate(grads):
        if not g.numel():
            continue
        p = params[j]
        if g.data_ptr() == p.data_ptr() and g.stride() == p.stride() and g.dtype == p.dtype:
            continue  # the grad is its own param (read before the write, element by element)
        start, end = g.data_ptr(), g.data_ptr() + _span(g)
        i = bisect.bisect_right(ends, start)
        while i < len(spans) and spans[i][0] < end:
            k = spans[i][2]
            if owner[k] == g.device and _share_memory(written[k], g):
                return j, k
            i += 1
    return None


def _check_grads_apart(param: Any, params: list, grads: list, states: list) -> None:
    """ValueError naming a grad that shares memory with a param or state an in-place step writes: the fused step
    reads and writes them at once, so the result would depend on the order the kernels run in."""
    pair = _grad_overlap(params, grads, states)
    if pair is None:
        return
    j, k = pair
    names = _names(param)
    where = [f"param{names[i]}" for i in range(len(params))]
    where += [f"state{names[i]}.{f}" for i, s in enumerate(states) for f in type(s)._fields]
    raise grad_shares_memory(f"grad{names[j]}", where[k])


def check_leaf_writable(where: str, t: Tensor, instead: str = "") -> None:
    """Refuse, before an in-place step writes anything, a tensor autograd would refuse to write under grad mode: a
    leaf that requires grad (an nn.Parameter) or a view of one. ``instead``: a further way out for the message."""
    if t.requires_grad and (t if t._base is None else t._base).is_leaf:
        raise RuntimeError(
            f"{where} is a leaf that requires grad (or a view of one), which autograd does not let an in-place step "
            "write under grad mode (a leaf Variable that requires grad is being used in an in-place operation): step "
            f"a non-leaf copy (e.g. p0.clone()){instead}"
        )


def grad_shares_memory(grad: str, written: str) -> ValueError:
    """The error of a grad that shares memory with a param or state an in-place step writes."""
    return ValueError(
        f"{grad} shares memory with {written}, which this in-place step writes: the step would read it while writing "
        "it (pass a copy of the grad, or use bnbf.update)"
    )


# ---- gradients asked for through a step that is not differentiable -------------------------------------------

_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def hparam_tensors(h: Any, step: Any = None, max_unorm: Any = None) -> list[tuple[str, Tensor]]:
    """``(name, tensor)`` of every tensor among the hyperparameters (a rule's dataclass or a mapping; ``betas[0]``...),
    the step and max_unorm: the inputs a meta-gradient is taken with respect to."""
    found = []
    if h is None:
        items = []
    elif dataclasses.is_dataclass(h):
        items = [(f.name, getattr(h, f.name)) for f in dataclasses.fields(h)]
    elif type(h) is _TracedHparams:  # a traced call's (_hparams_traced)
        items = list(h.values.items())
    else:  # a mapping not validated yet: a hyperparameter read while it requires grad would warn first
        try:
            items = list(dict(h).items())
        except (TypeError, ValueError):
            items = []  # make_hparams names the problem
    for name, v in items:
        if isinstance(v, Tensor):
            found.append((name, v))
        elif type(v) is tuple or type(v) is list:  # betas: a list before the rule's dataclass makes it a tuple
            found.extend((f"{name}[{i}]", x) for i, x in enumerate(v) if isinstance(x, Tensor))
    found.extend((n, v) for n, v in (("step", step), ("max_unorm", max_unorm)) if isinstance(v, Tensor))
    return found


def replace_hparam_tensors(h: Any, step: Any, max_unorm: Any, new: Any) -> tuple:
    """``(h, step, max_unorm)`` with each tensor among them (in :func:`hparam_tensors`' order) replaced by
    ``next(new)``; ``h`` a copy (a dataclass's without its checks, which would read the values), or ``h`` itself
    where it holds no tensor."""

    def swap(v: Any) -> Any:
        if isinstance(v, Tensor):
            return next(new)
        if (type(v) is tuple or type(v) is list) and any(isinstance(x, Tensor) for x in v):
            return tuple(next(new) if isinstance(x, Tensor) else x for x in v)
        return v

    if type(h) is _TracedHparams:
        h = _TracedHparams({k: swap(v) for k, v in h.values.items()})
    elif dataclasses.is_dataclass(h):
        h, old = copy.copy(h), h
        for f in dataclasses.fields(old):
            v = getattr(old, f.name)
            w = swap(v)
            if w is not v:
                object.__setattr__(h, f.name, w)
    elif hparam_tensors(h):  # a mapping's tensors would be left in place and the step would take one's value
        raise TypeError(f"tensors in hyperparameters of type {type(h).__name__} cannot be replaced")
    return h, swap(step), swap(max_unorm)


def _tracked(t: Tensor, grad_mode: bool, fwd: bool) -> bool:
    """Whether ``t`` takes part in a derivative: wrapped by torch.func's grad/vjp/jacrev/jvp, requiring grad
    under grad mode, or a forward-mode dual; through vmap's batched wrappers, whose own ``requires_grad`` and
    wrapping say nothing of the tensor they batch."""
    if _functorch.is_gradtrackingtensor(t) or (grad_mode and t.requires_grad):
        return True
    if _functorch.is_batchedtensor(t):
        return _tracked(_functorch.get_unwrapped(t), grad_mode, fwd)
    return fwd and forward_ad.unpack_dual(t).tangent is not None


def _unbatched(t: Tensor) -> Tensor:
    while _functorch.is_batchedtensor(t):
        t = _functorch.get_unwrapped(t)
    return t


def differentiated(tensors: list) -> bool:
    """Whether any of ``tensors`` takes part in a derivative (see :func:`_tracked`); C-level checks first, and
    under a torch.func transform the tensors vmap batches, a level of wrappers at a time."""
    grad_mode = torch.is_grad_enabled()
    fwd = forward_ad._current_level >= 0
    if fwd or (grad_mode and any(map(_REQUIRES_GRAD, tensors))):
        return any(_tracked(t, grad_mode, fwd) for t in tensors)
    if _functorch.maybe_current_level() is None:
        return False
    if any(map(_functorch.is_gradtrackingtensor, tensors)):
        return True
    inner = list(map(_functorch.get_unwrapped, filter(_functorch.is_batchedtensor, tensors)))
    return bool(inner) and differentiated(inner)


def _traced_derivative() -> bool:
    """Whether a call traced by torch.compile runs inside torch.func.grad/vjp/jacrev/jvp, at any level of the
    transforms (vmap's included: grad of a vmapped step). Dynamo shows the tensors such a transform wraps without
    ``requires_grad``, so the transforms are what can be seen: Dynamo traces these calls and the stack's
    ``lower()``, where torch 2.11 refuses the stack depth and the wrapper tests."""
    if not torch._C._are_functorch_transforms_active():
        return False
    interpreter = pyfunctorch.retrieve_current_functorch_interpreter()
    if isinstance(interpreter, (pyfunctorch.GradInterpreter, pyfunctorch.JvpInterpreter)):
        return True
    if interpreter.level() == 1:  # the outermost (levels count the stack); no pop/push nodes in the common graph
        return False
    with interpreter.lower():
        return _traced_derivative()


def check_not_differentiated(
    tree: Any,
    params: list,
    grads: list,
    h: Any,
    step: Any,
    max_unorm: Any,
    states: list,
    *,
    in_place: bool,
    ask: tuple[str, str] | None = None,
) -> None:
    """Raise where a gradient is asked for through a step that is not differentiable (bnbf's default step,
    the fused kernels and 8-bit states): never return a silent zero gradient.

    Asking means: an input wrapped by ``torch.func.grad``/``vjp``/``jacrev``/``jvp``, a forward-mode dual,
    or, under grad mode, a grad or hyperparameter tensor that requires grad. A param that requires grad
    counts for the pure :func:`bnbf.update` (its result would silently lose the param's history); for
    ``update_`` only a param with history (not a leaf) counts: stepping leaves that require grad, such as
    ``nn.Parameter``, is the in-place step's purpose and asks for no gradient. ``update_`` takes grads that
    require grad (``backward(create_graph=True)``) as torch.optim's steps do, detached: a plan's step would
    pay ~5 us a step (GPT-2's 148 grads) to look at each, and the grads' history never reaches the params of
    an in-place step anyway.

    ``ask``: how the caller's API asks for a differentiable step, for the error's words: (what takes
    ``differentiable=True``, how it asks for 32-bit state); bnbf's own (``bnbf.update_``, ``OptimSpec``) by
    default. bnbf_nn's optimizers name their class and options.
    """
    hps = hparam_tensors(h, step, max_unorm)
    # the states' fields in C-level calls (packed states pass layouts, which hold no tensors)
    fields = itertools.chain.from_iterable(filter(State.__instancecheck__, states))
    if not differentiated([*params, *grads, *(t for _, t in hps), *fields]):
        return
    named = [("param", i, p) for i, p in enumerate(params)] + [("grad", i, g) for i, g in enumerate(grads)]
    named += [("state", i, f) for i, s in enumerate(states) if is_state(s) for f in s]
    grad_mode = torch.is_grad_enabled()
    fwd = forward_ad._current_level >= 0
    names = None
    for kind, i, t in named:
        if not _tracked(t, grad_mode, fwd):
            continue
        base = _unbatched(t)
        # a dual grad's tangent would be dropped (torch.optim's steps carry it into the param): refused
        dual = fwd and forward_ad.unpack_dual(base).tangent is not None
        exempt = (kind == "grad" and not dual) or (base.is_leaf and not fwd)
        if in_place and not _functorch.is_gradtrackingtensor(base) and exempt:
            continue
        names = names or _names(tree)
        _refuse(f"{kind}{names[i]}", states, in_place, ask)
    for name, t in hps:
        if _tracked(t, grad_mode, fwd):
            _refuse(f"the hyperparameter {name}", states, in_place, ask)


def check_clip_not_differentiated(
    max_grad_norm: Any, state: Any, *, in_place: bool, ask: tuple[str, str] | None = None
) -> None:
    """:func:`check_not_differentiated` for ``max_grad_norm`` (a tensor the clipping reads before the core's own
    checks see the clipped grads, which carry no history through the fused clip). Traced: what Dynamo shows (grad
    mode and ``requires_grad``, or a torch.func grad/jvp around the call). ``ask``: as there."""
    if torch.compiler.is_compiling():
        grad_mode = torch.is_grad_enabled()
        if isinstance(max_grad_norm, Tensor) and ((grad_mode and max_grad_norm.requires_grad) or _traced_derivative()):
            _refuse("max_grad_norm", _flatten(state, is_leaf=is_state)[0], in_place, ask)
        return
    tracked = isinstance(max_grad_norm, Tensor) and differentiated([max_grad_norm])
    if tracked and _tracked(max_grad_norm, torch.is_grad_enabled(), forward_ad._current_level >= 0):
        _refuse("max_grad_norm", _flatten(state, is_leaf=is_state)[0], in_place, ask)


def _refuse(what: str, states: list, in_place: bool, ask: tuple[str, str] | None = None) -> None:
    """The refusal of a derivative asked through a step that is not differentiable (``ask``: see
    :func:`check_not_differentiated`)."""
    where, bits = ask or (f"bnbf.{'update_' if in_place else 'update'}", "OptimSpec(state_bits=32)")
    fix = f"pass differentiable=True to {where} to differentiate through the step"
    if any(_layout(s).quantized for s in states):
        fix += (
            f", with 32-bit state ({bits}): differentiable=True needs 32-bit state, 8-bit states are rounded to "
            "codes, which have no gradient"
        )
    raise RuntimeError(
        f"{what} takes part in a gradient computation (it requires grad, or torch.func.grad/jvp wraps it), but "
        f"this optimizer step is not differentiable: {fix}; or step detached tensors under torch.no_grad()"
    )


def _check_writable(param: Any, params: list, states: list = (), pure: str = "bnbf.update") -> None:
    """Before anything is written, what an in-place step cannot write: inference tensors outside inference mode
    (torch's error, which the kernels would not raise), and params whose elements share memory (a zero stride, or
    strides that make rows overlap: one memory location would hold only one of its elements' steps). ``pure``:
    the out-of-place twin the error suggests."""
    if not torch.is_inference_mode_enabled():
        fields = [t for st in states for t in st]
        if any(map(Tensor.is_inference, params)) or any(map(Tensor.is_inference, fields)):
            names = _names(param)
            named = [(f"param{n}", p) for n, p in zip(names, params)]
            named += [(f"state{n}.{f}", t) for n, st in zip(names, states) for f, t in zip(st._fields, st)]
            where = next(w for w, t in named if t.is_inference())
            raise RuntimeError(
                f"Inplace update to inference tensor outside InferenceMode is not allowed: {where} was made under "
                f"torch.inference_mode(); step inside it, or clone() the tensor outside it"
            )
    if all(map(Tensor.is_contiguous, params)):  # a contiguous tensor's elements never share memory
        return
    for i, p in enumerate(params):
        if any(st == 0 and n > 1 for st, n in zip(p.stride(), p.shape)):
            raise ValueError(
                f"param{_names(param)[i]} has a zero stride (an expanded tensor): more than one element refers to "
                f"a single memory location, so it cannot be stepped in place; pass a clone(), or use {pure}"
            )
        if _overlaps_itself(p):
            raise ValueError(
                f"param{_names(param)[i]} has strides {p.stride()} for shape {tuple(p.shape)}, by which its elements "
                f"may share memory, so it cannot be stepped in place; pass a clone(), or use {pure}"
            )


def _overlaps_itself(t: Tensor) -> bool:
    """Whether ``t``'s strides may map two elements to one address: each stride, in increasing order, must exceed
    the largest offset the smaller ones reach (a sufficient test of no overlap, exact for the usual layouts)."""
    reach = 0
    for st, n in sorted((st, n) for st, n in zip(t.stride(), t.shape) if n > 1):
        if st <= reach:
            return True
        reach += st * (n - 1)
    return False


def own_dispatch(t: Tensor) -> bool:
    """Whether ``t`` is of a tensor subclass with a ``__torch_dispatch__`` of its own (TwoTensor, FakeTensor,
    DTensor...): its data_ptr is not its data. Subclasses made by ``as_subclass`` keep torch's."""
    return type(t) not in _PLAIN_TYPES and type(t).__torch_dispatch__ is not _OWN_DISPATCH


def _check_fields_addressable(param: Any, states: list) -> None:
    """TypeError naming a state field of a tensor subclass with its own dispatch (torch's TwoTensor...) beside plain
    params and grads: the kernels would read its data_ptr, which is not its data (0 for TwoTensor)."""
    for i, s in enumerate(states):
        for name, f in zip(type(s)._fields, s):
            if own_dispatch(f):
                raise TypeError(
                    f"state{_names(param)[i]}.{name} is a {type(f).__name__}, a tensor subclass that dispatches on "
                    f"its own: the fused step cannot address its storage (bnbf.update and bnbf.update_ take such "
                    f"states where the params and grads are of the subclass too)"
                )


def _listed_twice(what: str, names: list, i: int, j: int) -> ValueError:
    if what == "param":
        why = "the same tensor: a param may appear only once in a call (torch.optim refuses a param in two groups)"
    else:
        why = "the same state: each param needs a state of its own (bnbf.init_state)"
    return ValueError(f"{what}{names[i]} and {what}{names[j]} are {why}")


def check_no_repeats(param: Any, params: list, states: list) -> None:
    """ValueError naming a param or a state listed twice, by identity: for tensors without addresses to compare
    (torch.func's wrappers, traced values), where :func:`_check_no_overlap` compares memory."""
    for what, leaves in (("param", params), ("state", states)):
        if torch.compiler.is_compiling():  # Dynamo (torch 2.11) cannot take id() of a value made inside the graph
            pair = next(((i, j) for j, x in enumerate(leaves) for i in range(j) if leaves[i] is x), None)
            if pair is not None:
                raise _listed_twice(what, _names(param), *pair)
            continue
        seen: dict[int, int] = {}
        for j, x in enumerate(leaves):
            i = seen.setdefault(id(x), j)
            if i != j:
                raise _listed_twice(what, _names(param), i, j)


def _check_no_overlap(param: Any, params: list, states: list) -> None:
    """ValueError naming two leaves of one call that share memory (see :func:`_overlap`)."""
    pair = _overlap(params, states)
    if pair is None:
        return
    _check_fields_addressable(param, states)  # subclass fields at address 0 overlap each other: say what they are
    names = _names(param)
    where = [(i, None) for i in range(len(params))]
    where += [(i, f) for i, s in enumerate(states) for f in type(s)._fields]
    if pair[0] == pair[1]:
        i, f = where[pair[0]]
        t = params[i] if f is None else getattr(states[i], f)
        what = "a meta tensor, which holds no data" if t.device.type == "meta" else f"a {type(t).__name__}"
        raise TypeError(
            f"{'param' if f is None else 'state'}{names[i]}{'' if f is None else '.' + f} has no storage the fused "
            f"step can address: {what}"
        )
    (i, fi), (j, fj) = where[pair[0]], where[pair[1]]
    if fi is None and fj is None:
        if params[i] is params[j]:
            raise _listed_twice("param", names, i, j)
        raise ValueError(
            f"param{names[i]} and param{names[j]} overlap in memory (views of one tensor?): the "
            f"params of one call must not share memory, each would be stepped on its own"
        )
    if fi is None:
        raise ValueError(
            f"param{names[i]} and state{names[j]}.{fj} overlap in memory: a param and a state must not share memory"
        )
    if i != j and states[i] is states[j]:  # (i == j: two fields of one state)
        raise _listed_twice("state", names, i, j)
    raise ValueError(
        f"state{names[i]}.{fi} and state{names[j]}.{fj} overlap in memory: the states of one call must not share memory"
    )


def _groups(params: list, states: list):
    """Indices grouped by (device, dtype, layout): one kernel launch each."""
    groups: dict[tuple, list[int]] = {}
    for i, (p, s) in enumerate(zip(params, states)):
        groups.setdefault((p.device, p.dtype, s.layout), []).append(i)
    return groups.items()


def _field_positions(states: list, idx: list) -> list:
    """Positions in ``[field for state in states for field in state]`` of the fields of the states at ``idx``."""
    starts = list(itertools.accumulate(map(len, states), initial=0))
    return [k for i in idx for k in range(starts[i], starts[i + 1])]


def clips(max_unorm: Any) -> bool:
    """Whether ``max_unorm`` turns update clipping on (> 0); ValueError for a value below 0 or NaN. A CPU tensor's
    value is checked as a number's; a device tensor's is not read (a host sync): the step then clips only where it
    is > 0, so a tensor 0 is off as the number 0 is (and a negative or NaN one clips nothing). Under vmap each
    member's value of a CPU tensor is checked. TypeError for anything but a number or a tensor (as max_grad_norm's):
    a string or None would otherwise fail a comparison, or pass for an unread device tensor."""
    if isinstance(max_unorm, bool) or not isinstance(max_unorm, (numbers.Real, Tensor)):  # numpy's floats pass
        raise TypeError(f"max_unorm must be a number or a 1-element tensor, got {type(max_unorm).__name__}")
    if isinstance(max_unorm, Tensor):
        v = None if torch.compiler.is_compiling() else _value(max_unorm, "max_unorm")
        for m in [] if torch.compiler.is_compiling() else member_values(max_unorm):
            if not m >= 0.0:
                raise ValueError(f"Invalid max_unorm value: {m}")
    else:
        v = max_unorm
    if v is not None and not v >= 0.0:
        raise ValueError(f"Invalid max_unorm value: {v}")
    return v is None or v > 0


def check_update_options(rule: Any, skip_zeros: Any, max_unorm: Any, maximize: Any = False) -> bool:
    """Check ``update``'s ``skip_zeros``, ``max_unorm`` and ``maximize`` for ``rule``; returns whether clipping
    is on."""
    if not isinstance(skip_zeros, bool):
        raise TypeError(f"skip_zeros must be a bool, got {type_name(skip_zeros)}")
    if not isinstance(maximize, bool):
        raise TypeError(f"maximize must be a bool, got {type_name(maximize)}")
    clip = clips(max_unorm)
    if clip and rule.norms is not None:
        raise ValueError(f"max_unorm does not combine with {rule.name}, which scales its update by its own norms")
    return clip


class MixedRulesError(ValueError):
    """States of several rules in one core call: :mod:`bnbf.compose` steps such trees (bnbf.update sends
    them there)."""


def _rule_of(param: Any, states: list) -> Any:
    """The rule module of the states, which must all be for one rule."""
    rule_name = _layout(states[0]).rule
    for i, s in enumerate(states):
        if _layout(s).rule != rule_name:
            raise MixedRulesError(
                f"state{_names(param)[i]} is for rule {s.layout.rule!r} but other states are for {rule_name!r}"
            )
    return get_rule(rule_name)


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


def _prepare(
    param: Any, grad: Any, state: Any, hparams: Any, step: Any, max_unorm: Any = 0.0, *, in_place: bool = False
) -> _Call:
    """Every check of one call, raising the precise error (the pure call's and the generic path's); a gradient
    asked for through the step (:func:`check_not_differentiated`) before anything reads an address."""
    params, grads, states, p_spec = _structures(param, grad, state)
    _check_leaves(param, params, states, grads)
    check_not_differentiated(param, params, grads, hparams, step, max_unorm, states, in_place=in_place)
    if in_place:
        _check_writable(param, params, states)
    rule = _rule_of(param, states)
    h = rule.make_hparams(hparams)
    _check_no_overlap(param, params, states)
    if in_place:
        _check_grads_apart(param, params, grads, states)
    _check_present(rule, h, states)
    _check_step(step)
    return _Call(params, grads, states, p_spec, rule, h, step)


_PLAIN_TYPES = frozenset({Tensor, torch.nn.Parameter})
_OWN_DISPATCH = Tensor.__torch_dispatch__  # a builtin: the same object through every class that keeps it


def unaddressable(*groups: list) -> bool:
    """Whether a call cannot be checked through its tensors' addresses: traced by torch.compile, under a
    torch.func transform, or with a tensor subclass that dispatches on its own (FakeTensor, DTensor...), whose
    storage, if any, is not what the kernels would address. Such a call takes :func:`_prepare_traced`'s checks
    and the custom op's dispatch."""
    if torch.compiler.is_compiling() or _functorch.maybe_current_level() is not None:
        return True
    for ts in groups:
        if not set(map(type, ts)) <= _PLAIN_TYPES and any(own_dispatch(t) for t in ts if isinstance(t, Tensor)):
            return True
    return False


# ---- calls traced by torch.compile -----------------------------------------------------------------------------


def _prepare_traced(
    param: Any, grad: Any, state: Any, hparams: Any, step: Any, max_unorm: Any = 0.0, *, in_place: bool = False
) -> _Call:
    """:func:`_prepare` for a call traced by ``torch.compile`` (plain loops Dynamo traces without a graph break),
    or made under a torch.func transform such as ``vmap``, whose wrappers have no addresses to compare.

    The metadata checks (structure, dtypes, shapes, devices) run at trace time: the compiled graph is guarded
    on them. Not made here: the overlap of leaves (fake tensors have no addresses), and the hyperparameters'
    values (reading a number traced as an input would turn it into a guarded constant, one compile per value);
    only their names are checked.
    """
    compiling = torch.compiler.is_compiling()
    params, grads, states, p_spec = _structures(param, grad, state, traced=compiling)
    if not compiling:  # under a transform: the C-level checks of an eager call, which read only metadata
        _check_leaves(param, params, states, grads)
    else:
        for i in range(len(params)):
            p, g, s = params[i], grads[i], states[i]
            if not (
                isinstance(p, Tensor)
                and p.dtype in _PARAM_DTYPES
                and p.layout == torch.strided
                and isinstance(g, Tensor)
                and g.layout == torch.strided
                and g.shape == p.shape
                and g.dtype == p.dtype
                and g.device == p.device
                and is_state(s)
                and _fits_traced(p, s)
            ):
                _check_leaf(_names(param)[i], p, g, s)
    rule = _rule_of(param, states)
    h = traced_hparams(param, params, grads, rule, hparams, step, max_unorm, states, in_place)
    return _Call(params, grads, states, p_spec, rule, h, step)


def traced_hparams(
    param: Any, params: list, grads: list, rule: Any, hparams: Any, step: Any, max_unorm: Any, states: list, in_place
) -> Any:
    """The checks of a traced call (or one under a torch.func transform) that read no address: a derivative asked
    for through the step, the hyperparameters' names, the kept slots, the step's type; returns the rule's
    hyperparameters, with the values of a traced call (or of per-member tensors under vmap) unread. ``states``: the
    states, or their layouts (a packed state's groups)."""
    if torch.compiler.is_compiling():
        if _traced_derivative():
            _refuse("the step, traced inside torch.func.grad/vjp/jvp,", states, in_place)
        # as eagerly (check_not_differentiated): the pure step refuses a grad or param that requires grad; the
        # in-place step takes grads detached and steps leaves (nn.Parameter), but not a param with history
        grad_mode = torch.is_grad_enabled()
        if grad_mode:
            for i in range(len(params)):
                t, p = grads[i], params[i]
                if in_place and p.requires_grad and not p.is_leaf:
                    _refuse(f"param{_names(param)[i]}", states, in_place)
                if not in_place and (t.requires_grad or p.requires_grad):
                    _refuse(f"{'grad' if t.requires_grad else 'param'}{_names(param)[i]}", states, in_place)
        h = _hparams_traced(rule, hparams)
        for name, t in hparam_tensors(h, step, max_unorm):
            if grad_mode and t.requires_grad:
                _refuse(f"the hyperparameter {name}", states, in_place)
    else:  # under a torch.func transform (vmap): every check but the addresses'
        check_not_differentiated(param, params, grads, hparams, step, max_unorm, states, in_place=in_place)
        traced = _hparams_traced(rule, hparams)
        batched = [t for _, t in hparam_tensors(traced) if _functorch.is_batchedtensor(t)]
        if batched:  # the members' values, where they are on the CPU, checked as numbers; the call keeps tensors
            _check_members(rule, hparams, batched)
            h = traced
        else:
            h = rule.make_hparams(hparams)
        check_steps(step)
    _check_present(rule, h, states)
    if isinstance(step, bool) or not isinstance(step, (int, Tensor, torch.SymInt)):
        raise TypeError(f"step must be an int or a 0-d int32/int64 tensor, got {type(step).__name__}")
    return h


def _check_members(rule: Any, hparams: Any, batched: list) -> None:
    """Each member's value of per-member hyperparameter tensors (vmap), checked as the number an eager call would
    check: each tensor's values in turn, with the other tensors at their first member's."""
    plain = {id(t): members(t) for t in batched}
    if any(u is None for u in plain.values()):
        return
    if dataclasses.is_dataclass(hparams) and not isinstance(hparams, type):  # a composed call's groups pass these
        hparams = {f.name: getattr(hparams, f.name) for f in dataclasses.fields(hparams)}
    elif not isinstance(hparams, Mapping):
        return
    with torch._C._DisableFuncTorch():
        firsts = {k: u.reshape(-1)[0].item() for k, u in plain.items()}

        def one(v: Any, k: int, value: float) -> Any:  # the given value, batched tensors as numbers
            if type(v) in (tuple, list):
                return type(v)(one(x, k, value) for x in v)
            if id(v) not in plain:
                return v
            return value if id(v) == k else firsts[id(v)]

        for k, u in plain.items():
            for value in dict.fromkeys(u.reshape(-1).tolist()):
                rule.make_hparams({name: one(v, k, value) for name, v in hparams.items()})


def check_steps(step: Any) -> None:
    """:func:`_check_step`, or under vmap (a count per member) :func:`_check_member_steps`; a traced SymInt has
    no value to read."""
    if isinstance(step, Tensor) and not torch.compiler.is_compiling() and _functorch.is_functorch_wrapped_tensor(step):
        _check_member_steps(step)
    elif not isinstance(step, torch.SymInt):
        _check_step(step)


def _check_member_steps(step: Tensor) -> None:
    """A per-member step tensor (vmap): int32 or int64, and every member's count at least 1 where it is readable."""
    u = members(step)
    with torch._C._DisableFuncTorch():
        _check_step_tensor(step)
        if u is not None and bool((u < 1).any()):
            raise ValueError(f"Invalid step: {int(u[u < 1].reshape(-1)[0])} (steps count from 1)")


def _fits_traced(p: Tensor, s: Any) -> bool:
    for (shape, dtype), t in zip(s.layout.expected(p.shape).values(), s):
        if tuple(t.shape) != shape or t.dtype != dtype or t.device != p.device or not t.is_contiguous():
            return False
    return len(s) == len(s._fields)


def _hparams_traced(rule: Any, hparams: Any) -> Any:
    """The rule's hyperparameters with the given values unread: a namespace of the defaults (validated) and the
    given values, whose names are checked. (Building the dataclass would validate, that is read, each value.)"""
    if hparams is None or type(hparams) is rule.hparams or dataclasses.is_dataclass(hparams):
        return rule.make_hparams(hparams)  # the dataclass as it is, or another rule's: refused
    defaults = _DEFAULTS[rule.name]
    merged = dict(defaults)
    for k, v in dict(hparams).items():
        if k not in defaults:
            unknown = sorted(k for k in dict(hparams) if k not in defaults)
            raise ValueError(f"unknown hyperparameters for rule {rule.name!r}: {unknown}; known: {sorted(defaults)}")
        merged[k] = v
    return _TracedHparams(merged)


class _TracedHparams:
    """A traced call's hyperparameters: the names a rule's dataclass has, the values unread."""

    def __init__(self, values: dict):
        self.values = values
        for k, v in values.items():
            setattr(self, k, v)


# each rule's default hyperparameters by name, made once: a traced call reads no dataclass machinery
_DEFAULTS = {
    name: {f.name: getattr(r.hparams(), f.name) for f in dataclasses.fields(r.hparams)} for name, r in RULES.items()
}

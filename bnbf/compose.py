"""Composing update rules: mixed rules in one call, per-leaf and scheduled hyperparameters, updates, clipping.

Built on the public core (:func:`bnbf.init_state`, :func:`bnbf.update`, :func:`bnbf.update_`):

- :func:`init_state` takes one :class:`~bnbf.OptimSpec`, a pytree of them matching the params (or a prefix of
  them), or a callable ``(path, param) -> OptimSpec``;
- :func:`update` / :func:`update_` step a tree of mixed rules, formats, bit widths and block sizes with
  hyperparameters given as one mapping, ``{rule_name: mapping}``, a callable ``(path, param) -> mapping`` or a
  pytree of mappings. Leaves are partitioned by rule, and within a rule by hyperparameters: on the Triton path
  the leaves of one rule share one kernel launch per (device, param dtype, state layout) whatever their
  hyperparameters (each tensor reads its own row of scalars, see :meth:`bnbf.plan.Plan`), on the reference
  path (and under tracing, torch.func transforms or capture) the core is called once per (rule,
  hyperparameters); results bit for bit those of separate calls either way;
- any hyperparameter may be a callable of the step (a schedule), evaluated once per call
  (:func:`resolve_hparams`);
- :func:`updates` returns the rule's update in float32 and :func:`apply_updates` / :func:`apply_updates_` add
  it, for transforms that act after the rule;
- :func:`clip_grad_norm` clips a pytree of gradients by their global norm as ``torch.nn.utils.clip_grad_norm_``,
  on the device, without a host synchronisation; ``update(..., max_grad_norm=)`` clips inside the step instead
  (the kernels scale each grad by the coefficient as they load it: no clipped copies, see :func:`_grad_clip`).

``path`` is a leaf's key path as ``torch.func.functional_call`` names it: ``"0.weight"`` for the key
``"0.weight"`` of a flat dict, ``"enc.w"`` for ``{"enc": {"w": ...}}``, ``"1"`` for the second item of a list.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import operator
import types
import weakref
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.autograd import forward_ad
from torch.utils import _pytree as pytree
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

import bnbf
from bnbf import ops
from bnbf._bounded import Bounded
from bnbf._dispatch import NORM_REDUCE, is_dtensor, use_triton
from bnbf._host_checks import (
    _NESTS,
    NATIVE,
    LeafName,
    _check_grad,
    _check_grads_apart,
    _check_no_overlap,
    _check_present,
    _check_step,
    _check_writable,
    _flatten,
    _grad_overlap,
    _grads_ok,
    _groups,
    _no_value,
    _plain,
    _prepare,
    _states_ok,
    _traced_derivative,
    _unflatten,
    _values_of,
    check_clip_not_differentiated,
    check_hparam_values,
    check_not_differentiated,
    differentiated,
    hparam_tensors,
    keystr,
    leaves_of,
    packed_identities,
    same_plain_dicts,
    type_name,
    unaddressable,
    walked,
)
from bnbf.plan import (
    OutputRecords,
    _cached,
    _confirmed,
    _one_set,
    _scalars,
    fed_back,
    fields_as_planned,
    fields_planned,
    group_rows,
    leaves_by,
    packed_rows,
    rows_layout,
)
from bnbf.reference import GRAD_CLIP, GradClip, clip_coefficient
from bnbf.rules import RULES, get_rule
from bnbf.rules.base import check_nonneg
from bnbf.state import OptimSpec, State, is_state, present_mask

__all__ = [
    "apply_updates",
    "apply_updates_",
    "clip_grad_norm",
    "clip_grad_norm_",
    "init_state",
    "is_shared_hparams",
    "path_name",
    "resolve_hparams",
    "update",
    "update_",
    "updates",
]


# ---- paths and prefix trees --------------------------------------------------------------------------------


def _key(entry: Any) -> Any:
    for attr in ("key", "idx", "name"):  # MappingKey, SequenceKey, GetAttrKey
        if hasattr(entry, attr):
            return getattr(entry, attr)
    return entry


def path_name(keypath: tuple) -> str:
    """A pytree key path as ``functional_call`` names the leaf: ``"0.weight"``, ``"enc.w"``, ``"1"``.

    Args:
        keypath: a key path from ``torch.utils._pytree.tree_flatten_with_path``.

    Returns:
        The keys joined by dots (``""`` for a tree that is one tensor).

    Example:
        >>> from torch.utils._pytree import tree_flatten_with_path
        >>> [path_name(k) for k, _ in tree_flatten_with_path({"enc": {"w": 0}, "head": [1]})[0]]
        ['enc.w', 'head.0']
    """
    return ".".join(str(_key(e)) for e in keypath)


def _leaf_names(keypaths: list) -> list[str]:
    """Keys for the per-group dicts handed to the core: functional_call's names where they are unique (always for
    ``dict(model.named_parameters())``), pytree's key strings if not; each a :class:`bnbf._host_checks.LeafName`
    carrying the leaf's key path in the caller's tree, by which the core's messages name it (``grad[1]``,
    ``grad['m'][1]``, as a call of the whole tree names it). Traced, plain strings (Dynamo cannot trace a str
    subclass made in the frame): an error raised while tracing names a list's leaf ``['1']``."""
    names = [path_name(k) for k in keypaths]
    if len(set(names)) != len(names):
        names = [pytree.keystr(k) for k in keypaths]
    if torch.compiler.is_compiling():
        return names
    names = list(map(LeafName, names))
    for name, k in zip(names, keypaths):  # the path kept, its string made only for a message (keystr: 0.3 us a leaf)
        name.keypath = k
    return names


def _broadcast(tree: Any, keypaths: list, is_leaf: Callable[[Any], bool], what: str) -> list:
    """One value of ``tree`` per param leaf, ``tree`` matching the params or a prefix of them (optax's and
    JAX's prefix rule: a leaf of ``tree`` serves every param below its place)."""
    leaves = pytree.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    at = {tuple(k): v for k, v in leaves}
    used: set = set()
    out = []
    for kp in keypaths:
        for n in range(len(kp) + 1):
            if kp[:n] in at:
                out.append(at[kp[:n]])
                used.add(kp[:n])
                break
        else:
            raise ValueError(
                f"{what} has no entry for param {path_name(kp)!r}: give a {what} tree matching the params or a "
                f"prefix of them"
            )
    unused = [path_name(k) for k in at if k not in used]
    if unused:
        raise ValueError(f"{what} has entries that match no param: {unused}")
    return out


# ---- schedules -----------------------------------------------------------------------------------------------


def _is_schedule(v: Any) -> bool:
    """Whether a hyperparameter value is a schedule (a callable of the step). ``callable`` asked last: Dynamo
    cannot trace it on a dict, a tensor or a tuple, which the tests before it answer."""
    return not isinstance(v, (Tensor, Mapping, tuple, list)) and type(v) not in _PLAIN and callable(v)


class _Resolver:
    """Evaluates each schedule (a callable hyperparameter) once per eager call, however many leaves share it."""

    def __init__(self, step: Any):
        self.step = step
        self.memo: dict[int, tuple[Callable, Any]] = {}  # id -> (fn, value): fn held so that its id stays its own

    def value(self, v: Any) -> Any:
        if _is_schedule(v):
            if torch.compiler.is_compiling():
                # evaluated where it appears, not looked up: Dynamo traces neither ``is`` between two closures made
                # in the frame (2.13) nor their id() (2.11), and a dict keyed by id() would guard on the identity
                return v(self.step)
            hit = self.memo.get(id(v))
            if hit is None:
                hit = self.memo[id(v)] = (v, v(self.step))
            return hit[1]
        if type(v) is tuple and any(_is_schedule(x) for x in v):
            return tuple(self.value(x) for x in v)
        return v

    def mapping(self, h: Any) -> Any:
        """``h`` with its schedules evaluated; ``h`` itself when it has none (so that the core's cache of
        validated hyperparameters keeps working)."""
        if not isinstance(h, Mapping):
            return h
        if not any(_is_schedule(v) or (type(v) is tuple and any(_is_schedule(x) for x in v)) for v in h.values()):
            return h
        return {k: self.value(v) for k, v in h.items()}


def resolve_hparams(hparams: Any, step: Any) -> Any:
    """Evaluate the schedules in ``hparams`` at ``step``.

    A hyperparameter given as a callable of the step (or a tuple such as ``betas`` with callables in it) is
    called once with ``step`` (an int or a 0-d int32/int64 tensor, passed as given: a schedule written with
    tensor ops then returns a 0-d tensor on the step's device, which the core reads without a host
    synchronisation and which compiles no new kernel).

    Args:
        hparams: ``None``, a rule's hyperparameter dataclass, a mapping of hyperparameters, or a mapping
            ``{rule_name: mapping}``.
        step: the 1-based step of this call.

    Returns:
        ``hparams`` with every schedule replaced by its value; the same object when it has none.

    Example:
        >>> resolve_hparams({"lr": lambda step: 1e-3 * min(1.0, step / 10), "weight_decay": 0.0}, 5)
        {'lr': 0.0005, 'weight_decay': 0.0}
    """
    r = _Resolver(step)
    if _by_rule(hparams):
        return {name: r.mapping(h) for name, h in hparams.items()}
    return r.mapping(hparams)


# ---- hyperparameter forms ------------------------------------------------------------------------------------


_FUNCTIONS = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, functools.partial)


def _dataclass_instance(x: Any) -> bool:
    """Whether ``x`` is a dataclass instance (a rule's hparams). Functions are answered first: torch 2.11's Dynamo
    cannot trace dataclasses.is_dataclass of one (hasattr on the class ``function``), a per-leaf callable's case."""
    return not isinstance(x, (type, *_FUNCTIONS)) and dataclasses.is_dataclass(x)


def _is_hparams_leaf(x: Any) -> bool:
    """One leaf's hyperparameters: None, a dataclass instance, or a mapping with no mapping among its values, nor
    a list or tuple of mappings (a subtree of the params' list or tuple: ``{"a": [{"lr": 0.1}, {"lr": 0.2}]}``)."""
    if type(x) is dict and all(type(v) in _LEAF_VALUES for v in x.values()):  # the usual dict of numbers
        return True
    if x is None or _dataclass_instance(x):
        return True
    return isinstance(x, Mapping) and not any(map(_holds_mappings, x.values()))


def _holds_mappings(v: Any) -> bool:
    return isinstance(v, Mapping) or (type(v) in (list, tuple) and any(isinstance(x, Mapping) for x in v))


_LEAF_VALUES = frozenset({float, int, bool})  # value types that are no mapping (a tuple may hold mappings)


def _by_rule(h: Any) -> bool:
    return (
        (type(h) is dict or isinstance(h, Mapping))
        and len(h) > 0
        and all(isinstance(k, str) and k in RULES for k in h)
        and all(_is_hparams_leaf(v) for v in h.values())
    )


def is_shared_hparams(hparams: Any) -> bool:
    """True for hyperparameters the core takes as they are: ``None``, a dataclass, or a mapping of plain
    values (no schedule, no per-rule or per-leaf form). The core can send every other form here.

    Example:
        >>> is_shared_hparams({"lr": 1e-3}), is_shared_hparams({"lr": lambda step: 1e-3})
        (True, False)
    """
    if hparams is None or _dataclass_instance(hparams):
        return True
    return (
        isinstance(hparams, Mapping)
        and not _by_rule(hparams)
        and not any(
            _holds_mappings(v) or _is_schedule(v) or (type(v) is tuple and any(_is_schedule(x) for x in v))
            for v in hparams.values()
        )
    )


def _per_leaf_hparams(
    hparams: Any,
    names: list[str],
    keypaths: Callable[[], list],
    params: list,
    rules: list[str],
    r: _Resolver,
    raw: list | None = None,
    flat: bool = False,
) -> tuple[list, str]:
    """Each leaf's hyperparameters (a mapping, a dataclass or None), schedules evaluated, and the form they were
    given in: "callable", "by_rule", "tree" (a flat dict of mappings by param name, ``flat``: the params are a
    flat dict whose keys are ``names``), or "" (one mapping for all, or any other tree). ``names``: the leaves'
    functional_call names; ``keypaths()``: their pytree key paths (only the general tree form needs them).
    ``raw``, if given, receives each leaf's object before its schedules are evaluated, for the callable, by-rule
    and flat tree forms (what :class:`_Partition` recognises a call's partition by)."""
    given = None  # each leaf's object, for the callable and flat tree forms
    if not isinstance(hparams, Mapping) and not _dataclass_instance(hparams) and callable(hparams):
        given, form = [hparams(name, p) for name, p in zip(names, params)], "callable"
    elif _by_rule(hparams):
        missing = sorted(set(rules) - set(hparams))
        if missing:
            raise ValueError(
                f"hparams by rule has no entry for rule(s) {missing} of the states; it has {sorted(hparams)}"
            )
        resolved = {name: r.mapping(h) for name, h in hparams.items()}
        if raw is not None:
            raw.extend(map(hparams.__getitem__, rules))
        return [resolved[name] for name in rules], "by_rule"
    elif _is_hparams_leaf(hparams):
        h = r.mapping(hparams)
        return [h] * len(params), ""
    elif flat and type(hparams) is dict and len(hparams) == len(names):
        # a dict of mappings by param name in the params' order: read as the callable form (no pytree walk)
        # traced: the dict's own order (Dynamo cannot trace the native lookup)
        given = _values_of(hparams, tuple(names)) if not torch.compiler.is_compiling() else None
        if given is None and torch.compiler.is_compiling() and tuple(hparams) == tuple(names):
            given = list(hparams.values())
        form = "tree"
    if given is None:
        return [r.mapping(h) for h in _broadcast(hparams, keypaths(), _is_hparams_leaf, "hparams")], ""
    out = []
    seen: dict[int, tuple] = {}  # id -> (h, its resolved form): a mapping given for many leaves is read once
    # traced: each leaf's mapping read on its own (at trace time only): id() would guard on each object and
    # recompile, and torch 2.11's Dynamo cannot trace ``is`` between two dicts
    traced = torch.compiler.is_compiling()
    for name, h in zip(names, given):
        hit = None if traced else seen.get(id(h))
        if hit is not None and hit[0] is h:
            out.append(hit[1])
            continue
        if not (type(h) is dict and not any(type(v) is dict for v in h.values())) and not _is_hparams_leaf(h):
            if form == "tree":  # a prefix tree or a bad leaf: the general walk and its errors
                return [r.mapping(h) for h in _broadcast(hparams, keypaths(), _is_hparams_leaf, "hparams")], ""
            raise TypeError(
                f"the hparams callable returned {type(h).__name__} for {name!r}; expected a mapping, "
                f"a rule's hparams dataclass or None"
            )
        hit = (h, r.mapping(h))  # h held: its id stays its own for the call
        if not traced:
            seen[id(h)] = hit
        out.append(hit[1])
    if raw is not None:
        raw.extend(given)
    return out, form


_PLAIN = (float, int, bool)
_PLAIN_TYPES = frozenset(_PLAIN)


def _number_key(v: Any) -> Any:
    """A plain number as a key that tells apart what ``==`` does not: ``-0.0`` and ``0.0`` (the sign reaches the
    step: SGD's ``g + wd * p`` keeps a ``-0.0`` grad's sign with ``wd = -0.0`` only), ``True``, ``1`` and ``1.0``."""
    if type(v) is float:
        return (float, v.hex())  # exact: the sign of a zero included
    return (type(v), v)


def _group_key(h: Any) -> Any:
    """:func:`_hkey`, faster for the usual dict of plain numbers (:func:`_plain_items`)."""
    items = _plain_items(h)
    return items if items is not None else _hkey(h)


def _hkey(v: Any) -> Any:
    """A hashable key equal for hyperparameters that are the same values: numbers by type and exact value
    (:func:`_number_key`), tensors by identity (comparing tensors would read them, a host synchronisation on a
    GPU)."""
    if isinstance(v, Tensor):
        return ("tensor", id(v))
    if type(v) in _PLAIN:
        return _number_key(v)
    if type(v) in (tuple, list):
        return (type(v), tuple(map(_hkey, v)))
    if isinstance(v, Mapping):
        return ("map", tuple(sorted((str(k), _hkey(x)) for k, x in v.items())))
    if _dataclass_instance(v):
        return (type(v), tuple((f.name, _hkey(getattr(v, f.name))) for f in dataclasses.fields(v)))
    try:
        hash(v)
    except TypeError:
        return ("id", id(v))
    return (type(v), v)


def _traced_key(v: Any, seen: list) -> Any:
    """:func:`_hkey` for a traced call: a tensor (or another object) keyed by its place among the call's distinct
    ones, found by ``is``, which Dynamo answers while tracing; ``id()`` would make a guard on each input's identity,
    so a new lr tensor each step would compile again. A float by its place too: a schedule of a Python-number step
    returns a symbolic float, whose exact value (``hex()``) Dynamo would guard on (a compile every step)."""
    if type(v) in _PLAIN and type(v) is not float:
        return _number_key(v)
    if type(v) in (tuple, list):
        return (type(v), tuple(_traced_key(x, seen) for x in v))
    if isinstance(v, Mapping):
        return ("map", tuple((str(k), _traced_key(v[k], seen)) for k in sorted(v, key=str)))
    if v is None:
        return None
    for j, x in enumerate(seen):
        if x is v:
            return ("object", j)
    seen.append(v)
    return ("object", len(seen) - 1)


# ---- init_state ------------------------------------------------------------------------------------------


def init_state(params: Any, spec: Any, hparams: Any = None) -> Any:
    """Optimizer state for a pytree of params whose leaves may use different rules and storage.

    Args:
        params: a tensor or a pytree of tensors (e.g. ``dict(model.named_parameters())``).
        spec: an :class:`~bnbf.OptimSpec` for every leaf; or a pytree of them matching ``params`` or a prefix
            of it (``{"encoder": OptimSpec(rule="adamw"), "embed": OptimSpec(rule="lion")}``); or a callable
            ``(path, param) -> OptimSpec``.
        hparams: where they decide which states are kept or their initial values (see
            :func:`bnbf.init_state`), in any form :func:`update` takes; schedules are evaluated at step 1.

    Returns:
        The states in the structure of ``params``, each as :func:`bnbf.init_state` makes it for its spec.

    Example:
        >>> params = {"w": torch.zeros(64, 64), "emb": torch.zeros(100, 8)}
        >>> state = init_state(params, lambda path, p: bnbf.OptimSpec(rule="lion" if path == "emb" else "adamw"))
        >>> [type(s).layout.rule for s in state.values()]
        ['adamw', 'lion']
    """
    if isinstance(spec, OptimSpec) and is_shared_hparams(hparams):
        return bnbf.init_state(params, spec, hparams)
    flat, treespec = pytree.tree_flatten_with_path(params)
    if not flat:
        raise ValueError("init_state needs at least one tensor")
    keypaths = [k for k, _ in flat]
    leaves = [p for _, p in flat]
    if isinstance(spec, OptimSpec):
        specs = [spec] * len(leaves)
    elif callable(spec):
        specs = [spec(path_name(k), p) for k, p in flat]
        for k, s in zip(keypaths, specs):
            if not isinstance(s, OptimSpec):
                raise TypeError(f"the spec callable returned {type(s).__name__} for {path_name(k)!r}, not an OptimSpec")
    else:
        specs = _broadcast(spec, keypaths, lambda x: isinstance(x, OptimSpec), "spec")
        for k, s in zip(keypaths, specs):
            if not isinstance(s, OptimSpec):
                raise TypeError(f"spec for {path_name(k)!r} must be an OptimSpec, got {type(s).__name__}")
    names = _leaf_names(keypaths)
    hps, _ = _per_leaf_hparams(
        hparams, [path_name(k) for k in keypaths], lambda: keypaths, leaves, [s.rule for s in specs], _Resolver(1)
    )
    groups: dict[tuple, list[int]] = {}
    for i, (s, h) in enumerate(zip(specs, hps)):
        groups.setdefault((s, _hkey(h)), []).append(i)
    # every group's hyperparameters are checked before any state is made
    for (s, _), idx in groups.items():
        _named_hparams(s.rule, hps[idx[0]], path_name(keypaths[idx[0]]))
    out: list = [None] * len(leaves)
    for (s, _), idx in groups.items():
        made = bnbf.init_state({names[i]: leaves[i] for i in idx}, s, hps[idx[0]])
        for i in idx:
            out[i] = made[names[i]]
    return pytree.tree_unflatten(out, treespec)


# ---- update / update_ ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Parts:
    """A call split into the core's calls: per (rule, hyperparameters), the leaves' indices."""

    rebuild: Callable[[list], Any]  # leaves -> a tree of the params' structure
    names: list[str]  # the per-group dicts' keys (the core's error messages name them)
    params: list
    grads: list
    states: list
    groups: list[tuple[Any, list[int]]]  # (validated hparams, leaf indices)
    flat: bool = False  # params, grads and state are flat dicts of the same keys in one order
    raw: list | None = None  # each leaf's hyperparameter object as given (callable, by-rule and flat tree forms)
    hps: list | None = None  # each leaf's hyperparameters, schedules evaluated
    form: str = ""  # "callable", "by_rule" or "tree" where ``raw`` is known
    spec: Any = None  # a nested tree's walked spec (bnbf._host_checks._flatten), else None
    paths: list | None = None  # the leaves' paths (``"m.1.c"``: what a per-leaf callable is given)


def _flatten_call(params: Any, grads: Any, state: Any) -> tuple:
    """(rebuild, names, paths, keypaths(), params, grads, states, walked spec) of a call; a flat dict of tensors (the
    usual ``dict(model.named_parameters())``) without pytree's walk, nested dicts, lists and tuples by the core's
    (their spec the last item, else None)."""
    if (
        type(params) is dict
        and type(grads) is dict
        and type(state) is dict
        and params
        and params.keys() == grads.keys() == state.keys()
        and all(isinstance(k, str) for k in params)
        and all(map(isinstance, params.values(), itertools.repeat(Tensor)))
        and all(map(is_state, state.values()))
    ):
        keys = list(params)
        gs = [grads[k] for k in keys]
        ss = [state[k] for k in keys]
        keypaths = lambda: [(pytree.MappingKey(k),) for k in keys]
        return (lambda leaves: dict(zip(keys, leaves))), keys, keys, keypaths, list(params.values()), gs, ss, None
    if not torch.compiler.is_compiling():  # nested containers: the core's walk, the leaves' names made once
        ps, treespec = _flatten(params)
        if walked(treespec) and ps:
            gs, g_spec = _flatten(grads)
            ss, s_spec = _flatten(state, is_leaf=is_state)
            if g_spec is treespec and s_spec is treespec:
                names, paths, kps = _names_of(treespec, params)
                rebuild = lambda leaves: _unflatten(leaves, treespec)  # noqa: E731
                return rebuild, names, paths, lambda: kps, ps, gs, ss, treespec
    flat, treespec = pytree.tree_flatten_with_path(params)
    g_leaves, g_spec = pytree.tree_flatten(grads)
    s_leaves, s_spec = pytree.tree_flatten(state, is_leaf=is_state)
    if not flat:
        raise ValueError("update needs at least one tensor")
    if g_spec != treespec:
        raise ValueError(f"grad structure {g_spec} does not match param structure {treespec}")
    if s_spec != treespec:
        raise ValueError(f"state structure {s_spec} does not match param structure {treespec}")
    kps = [k for k, _ in flat]
    for k, s in zip(kps, s_leaves):
        if not is_state(s):
            raise TypeError(
                f"state{pytree.keystr(k)} is not a bnbf state (make it with bnbf.init_state), got {type(s)}"
            )
    rebuild = lambda leaves: pytree.tree_unflatten(leaves, treespec)
    paths = [path_name(k) for k in kps]
    return rebuild, _leaf_names(kps), paths, lambda: kps, [p for _, p in flat], g_leaves, s_leaves, None


# a walked structure's (spec, leaf names, paths, key paths), by id(spec): made once per structure (names, str keys
# and key paths only: no caller's object)
_NAMES = Bounded(64)


def _names_of(treespec: Any, params: Any) -> tuple:
    """The leaf names, paths and key paths of ``params``, a tree of the walked structure ``treespec``."""
    entry = _NAMES.get(id(treespec))
    if entry is None or entry[0] is not treespec:
        kps = [k for k, _ in pytree.tree_flatten_with_path(params)[0]]
        entry = (treespec, _leaf_names(kps), [path_name(k) for k in kps], kps)
        _NAMES.put(id(treespec), entry)
    return entry[1:]


def _named_hparams(rule: str, h: Any, path: str) -> Any:
    """The rule's hyperparameters of a group of leaves, validated; an error names the group's first leaf (the
    per-leaf and per-rule forms give each leaf its own mapping: torch's words alone would not say whose)."""
    try:
        return get_rule(rule).make_hparams(h)
    except (ValueError, TypeError) as e:
        raise type(e)(f"hyperparameters of {path!r} ({rule}): {e}") from None


def _check_group_present(rule: str, h: Any, idx: list[int], states: list, paths: list) -> None:
    """Each leaf's state keeps the slots its group's hyperparameters use, else the core's error naming the leaf (a
    per-leaf ``amsgrad=True`` on one leaf whose state lacks the slot)."""
    rule_ = get_rule(rule)
    want = present_mask(rule_, h)
    for i in idx:
        s = states[i]
        if is_state(s) and type(s).layout.present != want:
            try:
                _check_present(rule_, h, [s])
            except ValueError as e:
                raise ValueError(f"hyperparameters of {paths[i]!r} ({rule}): {e}") from None


def _split(params: Any, grads: Any, state: Any, hparams: Any, step: Any) -> _Parts:
    rebuild, names, paths, keypaths, ps, gs, ss, walked_spec = _flatten_call(params, grads, state)
    rules = [type(s).layout.rule for s in ss]
    raw: list = []
    hps, form = _per_leaf_hparams(hparams, paths, keypaths, ps, rules, _Resolver(step), raw, names is paths)
    groups: dict[tuple, list[int]] = {}
    keys: dict[int, Any] = {}  # id(mapping) -> its key: a mapping shared by many leaves is keyed once
    traced: list | None = [] if torch.compiler.is_compiling() else None  # the call's tensors, for _traced_key
    for i, (rule, h) in enumerate(zip(rules, hps)):
        if traced is not None:  # keys without id(): Dynamo guards on the id of each input it is asked for
            k = _traced_key(h, traced)
        else:
            k = keys.get(id(h))
            if k is None:
                k = keys[id(h)] = _group_key(h)
        groups.setdefault((rule, k), []).append(i)
    # every group's hyperparameters are validated before anything runs: a bad one raises with nothing written.
    # Traced, the core validates each group's mapping without reading a value (building the dataclass would read
    # them, and Dynamo cannot trace it); an error at trace time runs nothing either
    if torch.compiler.is_compiling():
        validated = [(hps[idx[0]], idx) for idx in groups.values()]
    else:
        validated = [(_named_hparams(rule, hps[idx[0]], paths[idx[0]]), idx) for (rule, _), idx in groups.items()]
        for ((rule, _), idx), (h, _) in zip(groups.items(), validated):
            _check_group_present(rule, h, idx, ss, paths)
    flat = type(params) is dict and names is paths and list(params) == list(grads) == list(state)
    return _Parts(rebuild, names, ps, gs, ss, validated, flat, raw if form else None, hps, form, walked_spec, paths)


def _sub(parts: _Parts, leaves: list, idx: list[int]) -> dict:
    names = parts.names
    return {names[i]: leaves[i] for i in idx}


def differentiable_update(
    params: Any,
    grads: Any,
    state: Any,
    hparams: Any,
    step: Any,
    *,
    skip_zeros: bool = False,
    max_unorm: Any = 0.0,
    maximize: bool = False,
    grad_scale: Tensor | None = None,
) -> tuple[Any, Any]:
    """``bnbf.update(..., differentiable=True)`` of the composing forms (:func:`update`'s hparams forms: schedules,
    ``{rule: mapping}``, a callable ``(path, param) -> mapping``, a tree of mappings; states of several rules).

    The forms are resolved as the default step resolves them (:func:`_per_leaf_hparams`, schedules evaluated once
    a call) and the leaves grouped by (rule, hyperparameters), tensors by identity (never read), then each group
    takes one differentiable step (:func:`bnbf.differentiable.update`, which validates its hyperparameters on
    detached values): bit for bit the steps of separate calls on each group, derivatives through every tensor,
    a schedule's output included. Pure, so a group that raises leaves nothing changed; the in-place step
    (:func:`bnbf.differentiable.update_`) computes every group through here before it writes.
    """
    from bnbf import differentiable  # bnbf.differentiable sends these forms here

    rebuild, names, paths, keypaths, ps, gs, ss, _ = _flatten_call(params, grads, state)
    rules = [type(s).layout.rule for s in ss]
    hps, _ = _per_leaf_hparams(hparams, paths, keypaths, ps, rules, _Resolver(step), None, names is paths)
    groups: dict[tuple, list[int]] = {}
    traced: list = []  # _traced_key's tensors: keyed by identity, with no id() for Dynamo to guard on
    for i, (rule, h) in enumerate(zip(rules, hps)):
        groups.setdefault((rule, _traced_key(h, traced)), []).append(i)
    if len(groups) > 1 and all(isinstance(p, Tensor) for p in ps) and all(map(is_state, ss)):
        differentiable.check_apart(dict(zip(names, ps)), ps, ss)  # each group's call sees its own leaves only
    new_p: list = [None] * len(ps)
    new_s: list = [None] * len(ps)
    for idx in groups.values():
        pick = lambda leaves: {names[i]: leaves[i] for i in idx}  # noqa: B023 - used at once
        out_p, out_s = differentiable.update(
            pick(ps), pick(gs), pick(ss), hps[idx[0]], step, skip_zeros=skip_zeros, max_unorm=max_unorm,
            maximize=maximize, grad_scale=grad_scale,
        )  # fmt: skip
        for i in idx:
            new_p[i] = out_p[names[i]]
            new_s[i] = out_s[names[i]]
    return rebuild(new_p), rebuild(new_s)


def _one_rule_tree(state: Any) -> bool:
    """Whether every state of the tree is for one rule (the core's own case). Every state counts, at any depth:
    the core sends a tree of several rules back here (MixedRulesError), so a rule missed would loop forever."""
    # by class, not by leaf: a tree's states are of a few classes (GPT-2's 148: 140 -> 10 us a call, 2-core CPU)
    kinds = set(map(type, state.values())) if type(state) is dict else None
    if kinds is None or not all(issubclass(kind, State) for kind in kinds):  # not a flat dict of states
        kinds = set(map(type, _flatten(state, is_leaf=is_state)[0]))  # a nested tree: the core's walk
    # compared, not put in a set: torch 2.11's Dynamo (compiled vmap) cannot hash a class attribute's string
    rules = [kind.layout.rule for kind in kinds if issubclass(kind, State)]
    return all(r == rules[0] for r in rules)


def update(
    params: Any,
    grads: Any,
    state: Any,
    hparams: Any = None,
    step: Any = 1,
    *,
    skip_zeros: bool = False,
    max_unorm: float = 0.0,
    maximize: bool = False,
    max_grad_norm: Any = None,
) -> tuple[Any, Any]:
    """:func:`bnbf.update` for trees of mixed rules and per-leaf or scheduled hyperparameters (pure).

    Args:
        params, grads, state, step, skip_zeros, max_unorm, maximize: as :func:`bnbf.update`; the states may be
            for different rules, bit widths, formats and block sizes (:func:`init_state`).
        hparams: one of
            - a mapping of hyperparameters (or a rule's dataclass, or None) for every leaf;
            - ``{rule_name: mapping}``: each rule's hyperparameters (every rule of the states needs an entry; a
              mapping whose keys are all registered rule names, with mappings as values, is read this way);
            - a callable ``(path, param) -> mapping`` (e.g. no weight decay for biases and norms);
            - a pytree of mappings matching ``params`` or a prefix of it.
            Any value may be a schedule, a callable of the step evaluated once per call.
        max_grad_norm: if given (a number >= 0 or a 0-d tensor), the grads are clipped to this global norm as
            :func:`clip_grad_norm` (``torch.nn.utils.clip_grad_norm_``) clips them, inside the step: the total
            norm is taken over every grad of the call from our own pass over them (one launch per group, or
            LARS's norm pass; float32 per tile of W elements, float64 beyond: within (W/2 + 1) float32 ulps of
            the float64 total), and the step scales each grad element by ``min(1, max_norm / (total + 1e-6))``
            as it loads it, in float32 (see :func:`_grad_clip`).

    Returns:
        ``(new_params, new_state)`` in the input structures: bit for bit what separate :func:`bnbf.update`
        calls on the leaves of each (rule, hyperparameters) return. On the Triton path a rule's leaves share
        one launch per (device, dtype, state layout) whatever their hyperparameters (a row of scalars per
        tensor); elsewhere each (rule, hyperparameters) takes a core call of its own.

    Example:
        >>> params = {"w": torch.ones(64, 64), "b": torch.ones(64)}
        >>> state = init_state(params, bnbf.OptimSpec(rule="adamw"))
        >>> grads = {k: torch.ones_like(p) for k, p in params.items()}
        >>> no_decay = lambda path, p: {"lr": 0.1, "weight_decay": 0.0 if p.ndim == 1 else 0.1}
        >>> new, state = update(params, grads, state, no_decay, step=1)
        >>> round(new["w"][0, 0].item(), 6), round(new["b"][0].item(), 6)  # decay on w, none on b
        (0.89, 0.9)
    """
    return _with_clipping(_update, max_grad_norm, params, grads, state, hparams, step, skip_zeros, max_unorm, maximize)


def _with_clipping(fn, max_grad_norm, params, grads, state, *rest):
    """``fn(params, grads, state, *rest)`` (the pure or the in-place step), inside the clipping context of
    ``max_grad_norm`` where the kernels apply it, else on clipped copies of the grads (:func:`_grad_clip`)."""
    if max_grad_norm is not None:
        clip, grads = _grad_clip(grads, max_grad_norm, detach=fn is _update_)
        if clip is not None:
            with _clipping(clip):
                return fn(params, grads, state, *rest)
    return fn(params, grads, state, *rest)


def _scheduled_one_rule(state: Any, hparams: Any, step: Any) -> Any:
    """One mapping with schedules for a tree of one rule's states (a warmup on lr): the mapping of this step's values,
    which the core takes as it is (its own records of a loop serve, no split), else None. Eager only: a traced
    call's schedules are evaluated where they appear (:class:`_Resolver`)."""
    if torch.compiler.is_compiling() or not isinstance(hparams, Mapping) or _by_rule(hparams):
        return None
    if not _is_hparams_leaf(hparams) or not _one_rule_tree(state):
        return None
    resolved = _Resolver(step).mapping(hparams)
    return resolved if is_shared_hparams(resolved) else None


def _update(params, grads, state, hparams, step, skip_zeros, max_unorm, maximize):
    opts = {"skip_zeros": skip_zeros, "max_unorm": max_unorm, "maximize": maximize}
    if is_shared_hparams(hparams) and _one_rule_tree(state):
        return bnbf.update(params, grads, state, hparams, step, **opts)
    resolved = _scheduled_one_rule(state, hparams, step)
    if resolved is not None:
        return bnbf.update(params, grads, state, resolved, step, **opts)
    kept = _kept_pure_update(params, grads, state, hparams, step, opts)
    if kept is not None:
        return kept
    parts = _split(params, grads, state, hparams, step)
    _check_options(parts, max_unorm)
    if len(parts.groups) > 1:
        _check_leaves_apart(parts)
    new_p: list = [None] * len(parts.params)
    new_s: list = [None] * len(parts.params)
    separate, merged = [], []
    for sets, idx in _rule_units(parts):
        if _mergeable(parts, sets, idx, max_unorm):
            merged.append(_merged_update(parts, sets, idx, step, opts, new_p, new_s))
        else:
            separate.extend(sets)
    for h, idx in separate:
        out_p, out_s = bnbf.update(
            _sub(parts, parts.params, idx),
            _sub(parts, parts.grads, idx),
            _sub(parts, parts.states, idx),
            h,
            step,
            **opts,
        )
        for i in idx:
            new_p[i] = out_p[parts.names[i]]
            new_s[i] = out_s[parts.names[i]]
    out = parts.rebuild(new_p), parts.rebuild(new_s)
    if not separate:
        _keep_pure(out, parts, merged, new_p, new_s, max_unorm)
    return out


@dataclasses.dataclass(eq=False)
class _PureKept:
    """A pure call's partition (:class:`_Partition`'s hyperparameter part) and what its checks established of its
    outputs, which a torch.func loop hands the next call as its inputs. Holds no tensor."""

    partition: _Partition
    units: list[_PureUnit]
    types: list  # each leaf's state class
    planned: Any  # the outputs' addresses, dtypes and sizes (bnbf.plan.fields_planned of [params, *states])
    cuda: bool  # a unit steps CUDA tensors (capture is refused here: the full path's route)


# A pure call's kept partition by the ids of the (params, state) dicts it returned, as bnbf.functional._PURE keeps a
# one-rule call's checks: a hit confirms every leaf as that call made it (one compiled pass) and the hyperparameters
# as :func:`_kept_hparams` does, then steps each rule's leaves as :func:`_merged_update` did.
_PURE_KEPT = OutputRecords()


def _keep_pure(out: tuple, parts: _Parts, units: list, new_p: list, new_s: list, max_unorm: Any) -> None:
    entry = _partition_of(parts, max_unorm)
    if entry is None or (entry.spec is None and (type(out[0]) is not dict or type(out[1]) is not dict)):
        return
    cuda = any(device.type == "cuda" for u in units for (device, _), _ in u.groups)
    _PURE_KEPT.record(
        out, _PureKept(entry, units, list(map(type, new_s)), fields_planned([tuple(new_p), *new_s]), cuda)
    )


def _kept_pure_update(params: Any, grads: Any, state: Any, hparams: Any, step: Any, opts: dict) -> tuple | None:
    """The pure step of a call whose params and state are a recent pure call's outputs as it made them, with the
    hyperparameters of that call (:func:`_kept_hparams`): each rule's leaves stepped as then, after the checks that
    read this call's step and options in the full path's order. None where anything differs (the full path)."""
    if torch.compiler.is_compiling():  # traced: nothing here for Dynamo to guard on
        return None
    if not _PURE_KEPT:
        return None
    kept = _PURE_KEPT.get((id(params), id(state)))
    if kept is None or torch._C._functorch.maybe_current_level() is not None:
        return None
    max_unorm = opts["max_unorm"]
    # a tensor step or max_unorm, or forward-mode duals: their derivative checks are the full path's
    if isinstance(step, Tensor) or isinstance(max_unorm, Tensor) or forward_ad._current_level >= 0:
        return None
    entry = kept.partition
    spec = ("dict", entry.keys) if entry.spec is None else entry.spec
    found = fed_back(spec, kept.planned, kept.types, params, grads, state)
    if found is None:
        return None
    ps, gs, ss = found
    if kept.cuda and torch.cuda.is_current_stream_capturing():
        return None
    if not all(use_triton(ps[u.idx[members[0]]]) for u in kept.units for _, members in u.groups):
        return None
    if not _kept_hparams(entry, hparams, ps, step):
        return None
    if entry.refuses_max_unorm is not None and max_unorm > 0:  # as _check_options
        raise ValueError(
            f"max_unorm does not combine with {entry.refuses_max_unorm}, which scales its update by its own norms"
        )
    _check_step(step)
    new_p: list = [None] * len(ps)
    new_s: list = [None] * len(ps)
    for u in kept.units:
        values, clip = [], False
        for h in u.hparams:
            v, clip = _scalars(u.rule, h, step, opts["skip_zeros"], max_unorm, opts["maximize"])
            values.append(v)
        _run_unit(u, values, clip, ps, gs, ss, opts["skip_zeros"], new_p, new_s)
    if entry.spec is None:
        out = dict(zip(entry.keys, new_p)), dict(zip(entry.keys, new_s))
    else:
        out = _unflatten(new_p, entry.spec), _unflatten(new_s, entry.spec)
    _PURE_KEPT.record(out, dataclasses.replace(kept, planned=fields_planned([tuple(new_p), *new_s])))
    return out


def _check_leaves_apart(parts: _Parts) -> None:
    """The core's refusal of a param listed twice, a state shared by two leaves, or params and states sharing
    memory, across the groups of a pure call (each group's core call sees its own leaves only): the same tensor
    would come back with two new values. Skipped where the core skips it (traced, under a torch.func transform,
    subclasses that dispatch on their own) and, as the core checks the leaves first, where a param, grad or state
    is wrong (its group's core call names it)."""
    ps, ss = parts.params, parts.states
    if unaddressable(ps, parts.grads) or not (_states_ok(ps, ss) and _grads_ok(ps, parts.grads)):
        return
    _check_no_overlap(dict(zip(parts.names, ps)), ps, ss)


def update_(
    params: Any,
    grads: Any,
    state: Any,
    hparams: Any = None,
    step: Any = 1,
    *,
    skip_zeros: bool = False,
    max_unorm: float = 0.0,
    maximize: bool = False,
    max_grad_norm: Any = None,
) -> tuple[Any, Any]:
    """The step of :func:`update`, written into ``params`` and ``state`` in place; returns them.

    Every input is checked before any group is stepped, so a call that raises leaves every param and state as
    it was. On the Triton path each rule's leaves step through one plan of :func:`bnbf.update_`'s cache, one
    launch per (device, dtype, state layout) whatever their hyperparameters; elsewhere each (rule,
    hyperparameters) group steps through :func:`bnbf.update_`.

    Example:
        >>> params = {"w": torch.ones(64, 64), "emb": torch.ones(100, 8)}
        >>> state = init_state(params, lambda path, p: bnbf.OptimSpec(rule="lion" if path == "emb" else "adamw"))
        >>> grads = {k: torch.ones_like(p) for k, p in params.items()}
        >>> _ = update_(params, grads, state, {"adamw": {"lr": 0.1}, "lion": {"lr": 0.01}}, step=1)
        >>> params["emb"][0, 0].item()
        0.9900000095367432
    """
    return _with_clipping(_update_, max_grad_norm, params, grads, state, hparams, step, skip_zeros, max_unorm, maximize)


def _update_(params, grads, state, hparams, step, skip_zeros, max_unorm, maximize):
    opts = {"skip_zeros": skip_zeros, "max_unorm": max_unorm, "maximize": maximize}
    # a kept partition first: the call bnbf.update_ hands over has been found not shared (a kept partition is
    # only of the callable, by-rule and flat tree forms, so a shared mapping never matches one)
    if _known_update_(params, grads, state, hparams, step, opts):
        return params, state
    if is_shared_hparams(hparams) and _one_rule_tree(state):
        return bnbf.update_(params, grads, state, hparams, step, **opts)
    resolved = _scheduled_one_rule(state, hparams, step)
    if resolved is not None:
        return bnbf.update_(params, grads, state, resolved, step, **opts)
    parts = _split(params, grads, state, hparams, step)
    _check_options(parts, max_unorm)
    if _planned_update_(parts, step, opts):
        return params, state
    if len(parts.groups) > 1 and not torch.compiler.is_compiling() and ops.vmap_level() is not None:
        return _written_back(params, grads, state, hparams, step, opts)
    # traced: no addresses to compare, and a check that raises at trace time leaves the graph unrun
    if len(parts.groups) > 1 and not torch.compiler.is_compiling():
        _check_before_writing(parts, step, max_unorm)
    for h, idx in parts.groups:
        bnbf.update_(
            _sub(parts, parts.params, idx),
            _sub(parts, parts.grads, idx),
            _sub(parts, parts.states, idx),
            h,
            step,
            **opts,
        )
    return params, state


def _written_back(params, grads, state, hparams, step, opts: dict):
    """The in-place step of several groups under ``vmap``: the pure step of every group, then written into the
    params and state fields, each a batched ``copy_``. Refused before anything is written: a param or field not
    batched at this level (it cannot take each member's value; torch's vmap refuses the write), and memory
    shared as eager ``update_`` refuses it (:func:`bnbf.ops.check_vmapped_leaves_apart`)."""
    p_old, s_old = pytree.tree_leaves(params), pytree.tree_leaves(state, is_leaf=is_state)
    fields = [t for s in s_old for t in s]
    ops.check_vmapped_leaves_apart(params, p_old, pytree.tree_leaves(grads), s_old, fields)
    new_p, new_s = _update(params, grads, state, hparams, step, **opts)
    pairs = list(zip(p_old, pytree.tree_leaves(new_p)))
    pairs += [(a, b) for s, n in zip(s_old, pytree.tree_leaves(new_s, is_leaf=is_state)) for a, b in zip(s, n)]
    level = torch._C._functorch.maybe_current_level()
    for k, (old, _) in enumerate(pairs):
        if torch._C._functorch.maybe_get_level(old) != level:
            what = f"param {k}" if k < len(p_old) else f"a field of state {k - len(p_old)}"
            raise RuntimeError(ops.UNBATCHED_IN_PLACE.format(what=what))
    with torch.no_grad():
        for old, new in pairs:
            old.copy_(new)
    return params, state


# ---- per-leaf hyperparameters in one launch -----------------------------------------------------------------


def _rule_units(parts: _Parts) -> list[tuple[list, list[int]]]:
    """The (rule, hyperparameters) groups of a call gathered by rule: per rule its groups and all its leaves in
    leaf order (one plan, one launch per (device, dtype, layout), whatever the hyperparameters)."""
    by: dict[str, list] = {}
    for h, idx in parts.groups:
        by.setdefault(type(parts.states[idx[0]]).layout.rule, []).append((h, idx))
    out = []
    for sets in by.values():
        idx = sets[0][1] if len(sets) == 1 else sorted(itertools.chain.from_iterable(i for _, i in sets))
        out.append((sets, idx))
    return out


_PLAIN_TENSORS = frozenset({Tensor, torch.nn.Parameter})


def _mergeable(parts: _Parts, sets: list, idx: list[int], max_unorm: Any) -> bool:
    """Whether the leaves ``idx`` of one rule can take one launch per group with a row of scalars per tensor:
    plain tensors on the Triton path, eager (not traced, not under a torch.func transform, not captured) and
    no derivative asked through a hyperparameter. Elsewhere each set takes its own core call (the reference
    path has no launches to save; the others have their own routes and errors)."""
    if torch.compiler.is_compiling() or torch._C._functorch.maybe_current_level() is not None:
        return False
    ps = [parts.params[i] for i in idx]
    gs = [parts.grads[i] for i in idx]
    if not (set(map(type, ps)) <= _PLAIN_TENSORS and set(map(type, gs)) <= _PLAIN_TENSORS):
        return False
    if not set(map(type, itertools.chain.from_iterable(parts.states[i] for i in idx))) <= _PLAIN_TENSORS:
        return False
    one_per_device = {p.device: p for p in ps}  # the path is the device's: one param of each answers
    if not all(map(use_triton, one_per_device.values())):
        return False
    if any(d.type == "cuda" for d in one_per_device) and torch.cuda.is_current_stream_capturing():
        return False
    tensors = [t for h, _ in sets for _, t in hparam_tensors(h, None, max_unorm)]
    return not (tensors and differentiated(tensors))


def _set_of(sets: list, idx: list[int]) -> tuple[int, ...]:
    """Per leaf of ``idx`` (in its order) the index of its hyperparameter set."""
    where = {}
    for k, (_, members) in enumerate(sets):
        for i in members:
            where[i] = k
    return tuple(where[i] for i in idx)


def _planned_update_(parts: _Parts, step: Any, opts: dict) -> bool:
    """The in-place step of a call through one cached plan per rule (:func:`bnbf.plan._cached`, as
    :func:`bnbf.update_` keeps them): each rule's leaves in one launch per (device, dtype, layout) whatever
    their hyperparameters (:meth:`bnbf.plan.Plan._prepare_sets`). Every rule's step is checked before the
    first is run; the plans confirm their own leaves, and the memory between rules is checked once per set of
    plans (:func:`_check_disjoint`, kept while the same plans serve), the grads against the other rules' leaves
    where they moved (:func:`_check_plan_grads`). False, with nothing written, where a rule's
    leaves have no plan (the reference path, non-contiguous params, subclasses...), under tracing, a
    torch.func transform or a CUDA graph capture, or with hyperparameters a derivative is asked through: the
    caller then makes one core call per (rule, hyperparameters)."""
    if torch.compiler.is_compiling() or torch._C._functorch.maybe_current_level() is not None:
        return False
    units = _rule_units(parts)
    plans = []
    for sets, idx in units:
        tensors = [t for h, _ in sets for _, t in hparam_tensors(h, None, opts["max_unorm"])]
        if tensors and differentiated(tensors):
            return False
        ps = [parts.params[i] for i in idx]
        ss = [parts.states[i] for i in idx]
        spec = ("dict", tuple(parts.names[i] for i in idx))
        found = _cached(None, ps, ss, spec, spec)
        if found is None or not found._direct:
            return False
        plans.append(found)
    if any(p._cuda for p in plans) and torch.cuda.is_current_stream_capturing():
        return False
    if len(plans) > 1:
        _check_plans_disjoint(parts, plans)
    runs = [
        plan._prepare_sets(
            [parts.params[i] for i in idx],
            [parts.states[i] for i in idx],
            _sub(parts, parts.params, idx),  # names the leaves in a grad's error
            _sub(parts, parts.grads, idx),
            [h for h, _ in sets],
            _set_of(sets, idx),
            step,
            **opts,
        )
        for plan, (sets, idx) in zip(plans, units)
    ]
    checked = len(plans) > 1 and _plan_grads_moved(plans, runs, _plan_grads_kept(plans))
    if checked:
        leaves = [
            ([parts.names[i] for i in idx], [parts.params[i] for i in idx], [parts.states[i] for i in idx])
            for _, idx in units
        ]
        _check_plan_grads(runs, leaves)
    for run in runs:
        run()
    if checked:
        _keep_plan_grads(plans)
    _remember(parts, units, plans, opts)
    return True


# ---- the in-place call's partition, kept between calls ------------------------------------------------------


@dataclasses.dataclass(eq=False)
class _Unit:
    """One rule's leaves of a kept partition: what :meth:`bnbf.plan.Plan._prepare_sets` takes, as indices."""

    pick: Callable[[list], list]  # the unit's leaves from the call's list of leaves
    names: tuple[str, ...]
    spec: tuple  # the plan's structure key
    sets: list  # each hyperparameter set's validated dataclass (plain numbers)
    set_of: tuple[int, ...]
    plan: weakref.ref


@dataclasses.dataclass(eq=False)
class _Partition:
    """How an in-place call on flat dicts split into rules, hyperparameter sets and plans, kept so that the next
    call with the same leaves and the same hyperparameter objects and values skips the split (:func:`_split`:
    a walk of every leaf) and goes straight to the plans. Holds no tensor: names, ids, plain numbers and weak
    references to the plans (which hold only weak references to the leaves)."""

    keys: tuple[str, ...]  # a flat dict's keys; a nested tree's leaf paths (what a per-leaf callable is given)
    form: str  # "callable", "by_rule" or "tree" (a flat dict of mappings by param name)
    rules: tuple[str, ...]  # the by-rule form: the leaves' rules, each once
    raw_ids: tuple[int, ...]  # id of each leaf's hyperparameter object as given (by-rule: of each rule's)
    raw_packed: bytes  # callable and tree: (id, id of type) of each leaf's object, native uint64 (one C-level pass)
    firsts: tuple[int, ...]  # callable and tree: the first leaf of each distinct object
    content: tuple  # the items of each distinct object's mapping (by-rule: each rule's), schedules evaluated
    refuses_max_unorm: str | None  # the first rule with its own norms (max_unorm > 0 raises), None if none
    units: list[_Unit]
    grads_at: tuple = ()  # the plans' grad tables (Plan._grad_at) when their grads were last found apart
    # each leaf's object (by-rule: each rule's) a dict of plain numbers: a copy of each (one per distinct content),
    # so that new dicts of the same numbers each call (a callable's usual answer) find the partition
    plain: list | None = None
    spec: Any = None  # a nested tree's walked spec (bnbf._host_checks._flatten; one object per structure), else None


_PARTITIONS = Bounded(16)


def _plain_items(h: Any) -> tuple | None:
    """A dict of plain numbers (and tuples of them) as its items with exact values (:func:`_number_key`: ``-0.0``
    is not ``0.0``, nor ``True`` ``1``), else None (tensors, schedules that return tensors, dataclasses: not
    kept)."""
    if type(h) is not dict:
        return None
    values = h.values()
    types = tuple(map(type, values))
    if set(types) <= _PLAIN_TYPES:  # the usual dict: equal items of equal types differ only in a zero's sign
        try:
            return (tuple(h.items()), types, tuple(map(math.copysign, itertools.repeat(1.0), values)))
        except OverflowError:  # an int beyond float64 has no float sign: the keys below hold it (validation refuses)
            pass
    out = []
    for k, v in h.items():
        t = type(v)
        if t in _PLAIN:
            out.append((k, _number_key(v)))
        elif t is tuple and all(type(x) in _PLAIN for x in v):
            out.append((k, tuple(map(_number_key, v))))
        else:
            return None
    return tuple(out)


def _pick(idx: list[int]) -> Callable[[list], list]:
    """The leaves ``idx`` of a list, as a list: a slice where they follow each other (a rule's leaves usually
    do: the embeddings, or all but them)."""
    if idx[-1] - idx[0] == len(idx) - 1:
        return operator.itemgetter(slice(idx[0], idx[-1] + 1))
    get = operator.itemgetter(*idx)
    return (lambda leaves: list(get(leaves))) if len(idx) > 1 else (lambda leaves: [get(leaves)])


def _partition_of(parts: _Parts, max_unorm: Any) -> _Partition | None:
    """The partition of a split call (no units yet), where it can be kept: flat dicts or nested ones the core walks,
    the callable, by-rule or flat tree form with plain numbers (schedules evaluated), a Python number max_unorm;
    else None."""
    if not (parts.flat or parts.spec is not None) or parts.raw is None or isinstance(max_unorm, Tensor):
        return None
    first: dict[int, int] = {}
    if parts.form == "by_rule":
        for i, st in enumerate(parts.states):
            first.setdefault(type(st).layout.rule, i)
        rules, firsts = tuple(first), ()
        raw_ids = tuple(id(parts.raw[i]) for i in first.values())
    else:
        raw_ids = tuple(map(id, parts.raw))
        for i, x in enumerate(raw_ids):
            first.setdefault(x, i)
        rules, firsts = (), tuple(first.values())
    content = tuple(_plain_items(parts.hps[i]) for i in first.values())
    if any(c is None for c in content):
        return None
    refuses = next(
        (r.name for h, idx in parts.groups if (r := get_rule(type(parts.states[idx[0]]).layout.rule)).norms), None
    )
    packed = b""
    if parts.form != "by_rule":
        packed = packed_identities(parts.raw)
    keys = tuple(parts.names if parts.spec is None else parts.paths)
    entry = _Partition(keys, parts.form, rules, raw_ids, packed, firsts, content, refuses, [], spec=parts.spec)
    entry.plain = _plain_copies(parts.raw if parts.form != "by_rule" else [parts.raw[i] for i in first.values()])
    return entry


def _remember(parts: _Parts, units: list, plans: list, opts: dict) -> None:
    """Keep the partition of a call that :func:`_planned_update_` stepped (see :func:`_partition_of`)."""
    entry = _partition_of(parts, opts["max_unorm"])
    if entry is None:
        return
    for plan, (sets, idx) in zip(plans, units):
        names = tuple(parts.names[i] for i in idx)
        entry.units.append(
            _Unit(_pick(idx), names, ("dict", names), [h for h, _ in sets], _set_of(sets, idx), weakref.ref(plan))
        )
    ps, ss = parts.params, parts.states
    entry.grads_at = tuple(map(_GRAD_AT, plans))  # the grads just stepped: apart (checked, or as last checked)
    key = (id(ps[0]), id(ps[-1]), id(ss[0]), id(ss[-1]), len(ps))
    _PARTITIONS.put(key, entry)


def _plain_copies(raw: list) -> list | None:
    """A copy of each dict of ``raw`` (one per distinct content), None unless every one is a dict of plain numbers
    (a schedule or a tensor in it is not copied: the partition would hold it)."""
    copies: dict = {}
    out = []
    for h in raw:
        key = _plain_items(h) if type(h) is dict else None
        if key is None:
            return None
        c = copies.get(key)
        if c is None:
            c = copies[key] = dict(h)
        out.append(c)
    return out


def _kept_hparams(entry: _Partition, hparams: Any, ps: list, step: Any) -> bool:
    """Whether a call's hyperparameters are those of the kept partition ``entry`` (``ps``: the call's params in its
    leaf order): the same form, each leaf with the same object as then holding the same values (schedules
    evaluated: the partition depends on the values only), or with a new dict of exactly the numbers then."""
    if entry.form != "by_rule":
        if entry.form == "tree":  # the leaves' mappings in the params' order
            raw = _values_of(hparams, entry.keys) if type(hparams) is dict else None
            if raw is None:
                return False
        elif not callable(hparams) or isinstance(hparams, Mapping) or _dataclass_instance(hparams):
            return False
        else:
            raw = list(map(hparams, entry.keys, ps))
        if NATIVE is not None:  # the same objects (their ids and types) in one C-level pass
            same = NATIVE.same_objects(raw, entry.raw_packed)
        else:
            same = tuple(map(id, raw)) == entry.raw_ids
        if not same:  # new dicts holding each leaf's numbers as then, exactly: the partition and its values stand
            return entry.plain is not None and same_plain_dicts(raw, entry.plain)
        distinct = [raw[i] for i in entry.firsts]
    else:
        if not _by_rule(hparams):
            return False
        distinct = [hparams.get(rule) for rule in entry.rules]
        if tuple(map(id, distinct)) != entry.raw_ids:
            return entry.plain is not None and same_plain_dicts(distinct, entry.plain)
    r = _Resolver(step)
    # a dict of plain numbers is its own resolved form: the schedules' scan only for the others
    return tuple(_plain_items(h) or _plain_items(r.mapping(h)) for h in distinct) == entry.content


def _kept_leaves(params: Any, grads: Any, state: Any) -> tuple | None:
    """``(partition, params, grads, states)`` where a kept partition's first and last leaves are this call's (by
    id: :func:`_known_update_` confirms them through the plans) in trees of its structure: flat dicts of its keys,
    or nested ones of its walked spec; else None."""
    if type(params) is dict and type(state) is dict and type(grads) is dict and params and len(state) == len(params):
        pv, sv = params.values(), state.values()
        entry = _PARTITIONS.get(
            (id(next(iter(pv))), id(next(reversed(pv))), id(next(iter(sv))), id(next(reversed(sv))), len(pv))
        )
        if entry is not None and entry.spec is None:  # a flat dict: its keys, no walk
            found = leaves_by(("dict", entry.keys), params, grads, state)
            return None if found is None else (entry, *found)
    elif type(params) not in _NESTS:  # lists, tuples, OrderedDicts: walked below
        return None
    ps, spec = _flatten(params)
    if not ps or not walked(spec):
        return None
    ss, s_spec = _flatten(state, is_leaf=is_state)
    entry = _PARTITIONS.get((id(ps[0]), id(ps[-1]), id(ss[0]), id(ss[-1]), len(ps)) if ss else None)
    if entry is None or entry.spec is not spec or s_spec is not spec:
        return None
    gs = leaves_of(grads, spec)
    return None if gs is None else (entry, ps, gs, ss)


def _known_update_(params: Any, grads: Any, state: Any, hparams: Any, step: Any, opts: dict) -> bool:
    """The in-place step of a call whose partition is kept (:class:`_Partition`): the same leaves (by id,
    then confirmed by each rule's plan, as :func:`bnbf.plan._cached` confirms them) in flat dicts of the same
    keys or nested trees of the same structure, each leaf with the same hyperparameter object as then, holding
    the same values (schedules evaluated: the partition depends on the values only). Every check of
    :func:`_planned_update_` that depends on this call is made again (grads, step, states' slots by each plan's
    ``_prepare_sets``; max_unorm; capture). False, with nothing written, on any difference: the caller then
    splits the call afresh."""
    if not _PARTITIONS or torch.compiler.is_compiling():  # traced: no ids (the split's traced route)
        return False
    found = _kept_leaves(params, grads, state)
    if found is None or isinstance(opts["max_unorm"], Tensor):
        return False
    if torch._C._functorch.maybe_current_level() is not None:  # traced calls returned above
        return False
    entry, ps, gs, ss = found
    if not _kept_hparams(entry, hparams, ps, step):
        return False
    max_unorm = opts["max_unorm"]
    if entry.refuses_max_unorm is not None and max_unorm > 0:
        raise ValueError(
            f"max_unorm does not combine with {entry.refuses_max_unorm}, which scales its update by its own norms"
        )
    plans, picked = [], []
    for u in entry.units:
        ps_u, ss_u = u.pick(ps), u.pick(ss)
        found = u.plan()
        if found is None or not _confirmed(found, ps_u, ss_u):  # as _cached confirms the plan it finds
            return False
        plans.append(found)
        picked.append((ps_u, ss_u))
    if any(p._cuda for p in plans) and torch.cuda.is_current_stream_capturing():
        return False
    runs = []
    for plan, u, (ps_u, ss_u) in zip(plans, entry.units, picked):
        # the grads in the plan's leaf order (a dict of its keys is made only for a bad grad's error)
        runs.append(plan._prepare_sets(ps_u, ss_u, None, u.pick(gs), u.sets, u.set_of, step, **opts))
    # the partition's plans are these very plans (confirmed above): its own record of their grads, no look-up
    checked = len(plans) > 1 and _plan_grads_moved(plans, runs, entry.grads_at)
    if checked:
        _check_plan_grads(runs, [(u.names, ps_u, ss_u) for u, (ps_u, ss_u) in zip(entry.units, picked)])
    for run in runs:
        run()
    if checked:
        entry.grads_at = tuple(map(_GRAD_AT, plans))
    return True


# sets of plans whose leaves were found not to share memory between plans: weak references to the plans (a plan
# serves while its leaves keep their memory and shapes; a plan whose tensor is freed is dropped)
_DISJOINT = Bounded(16)


def _check_plans_disjoint(parts: _Parts, plans: list) -> None:
    key = tuple(map(id, plans))
    refs = _DISJOINT.get(key)
    if refs is not None and all(r() is p and p.alive for r, p in zip(refs, plans)):
        return
    _check_disjoint(parts)
    _DISJOINT.put(key, [weakref.ref(p) for p in plans])


# per set of plans stepped together (one per rule) by the split's route: the plans' grad tables (Plan._grad_at) when
# their grads were last found apart from every rule's params and states; weak references to the plans (a kept
# partition holds its own record, _Partition.grads_at)
_GRADS_APART = Bounded(16)
_MOVED, _GRAD_AT = operator.attrgetter("moved"), operator.attrgetter("_grad_at")


def _plan_grads_kept(plans: list) -> tuple:
    """The plans' grad tables when their grads were last found apart together, else ``()``."""
    kept = _GRADS_APART.get(tuple(map(id, plans)))
    if kept is None or not all(map(operator.is_, map(weakref.ref.__call__, kept[0]), plans)):
        return ()
    return kept[1]


def _plan_grads_moved(plans: list, runs: list, kept: tuple) -> bool:
    """Whether the grads of a call must be checked against the other rules' leaves: some plan's grads are not where
    its tables have them (``runs``: the plans' ``_prepare_sets``), or the tables are not those last checked together
    (``kept``; a plan stepped alone since, with other grads). A loop whose grads keep their memory checks once."""
    return True in map(_MOVED, runs) or kept != tuple(map(_GRAD_AT, plans))


def _check_plan_grads(runs: list, leaves: list) -> None:
    """Refuse, before any rule's step runs, a grad sharing memory with another rule's param or state (each plan
    checks its grads against its own leaves only): the rules step one after another, so a later rule would read a
    grad an earlier one already wrote. ``runs``: the plans' ``_prepare_sets`` (their grads as launched: a
    non-contiguous grad is a copy, as in the core's plans); ``leaves``: per plan its (names, params, states)."""
    names, params, states = [], [], []
    for n, ps, ss in leaves:
        names.extend(n)
        params.extend(ps)
        states.extend(ss)
    grads = [g for run in runs for g in run.grads]
    _check_grads_apart(dict(zip(names, params)), params, grads, states)


def _keep_plan_grads(plans: list) -> None:
    """Keep the plans' grad tables after a step whose grads :func:`_check_plan_grads` found apart."""
    key = tuple(map(id, plans))
    _GRADS_APART.put(key, ([weakref.ref(p) for p in plans], tuple(map(_GRAD_AT, plans))))


def _merged_update(parts: _Parts, sets: list, idx: list[int], step: Any, opts: dict, new_p: list, new_s: list) -> None:
    """The pure step of one rule's leaves with their several hyperparameter sets: each set checked as its own
    core call checks it, then one launch per (device, dtype, layout) with a row of scalars per tensor (a launch
    whose tensors all take one set: that set's scalars, as its own call)."""
    max_unorm = opts["max_unorm"]
    calls = [
        _prepare(
            _sub(parts, parts.params, m), _sub(parts, parts.grads, m), _sub(parts, parts.states, m), h, step, max_unorm
        )
        for h, m in sets
    ]
    rule = calls[0].rule
    clip = False
    values = []
    for c in calls:
        v, clip = _scalars(rule, c.hparams, c.step, opts["skip_zeros"], max_unorm, opts["maximize"])
        values.append(v)
    set_of = _set_of(sets, idx)
    ps = [parts.params[i] for i in idx]
    ss = [parts.states[i] for i in idx]
    groups = [((device, layout), members) for (device, _, layout), members in _groups(ps, ss)]
    # the in-place path's rows (Plan._set_rows), laid out afresh: the pure step keeps no plan; a group of one set
    # takes the scalars of a pure call of that set
    at = rows_layout([(device, tuple(set_of[j] for j in members)) for (device, _), members in groups], len(values[0]))
    unit = _PureUnit(idx, rule, [c.hparams for c in calls], at, groups)
    _run_unit(unit, values, clip, parts.params, parts.grads, parts.states, opts["skip_zeros"], new_p, new_s)
    return unit


class _PureUnit(NamedTuple):
    """One rule's leaves of a pure call stepped together (:func:`_merged_update`): what a later call with the same
    partition needs to step them again. Holds no tensor."""

    idx: list[int]  # the leaves, in the call's leaf order
    rule: Any  # the rule (bnbf.rules)
    hparams: list  # each hyperparameter set's validated dataclass
    at: Any  # the rows' layout (bnbf.plan.rows_layout)
    groups: list  # ((device, layout), members): indices into idx


def _run_unit(unit: _PureUnit, values: list, clip: Any, ps: list, gs: list, ss: list, skip_zeros: bool, new_p: list,
              new_s: list) -> None:  # fmt: skip
    """One launch per group of ``unit`` (``values``: each set's scalars), its outputs written into ``new_p`` and
    ``new_s`` at the leaves' indices."""
    idx = unit.idx
    with torch.no_grad():
        by_group = group_rows(unit.at, values, packed_rows(values), _one_set)
        for ((_, layout), members), rows in zip(unit.groups, by_group):
            gp = [_plain(ps[idx[j]]) for j in members]
            gg = [_plain(gs[idx[j]]) for j in members]
            states = [ss[idx[j]] for j in members]
            out_p, out_s = ops.step(gp, gg, [t for st in states for t in st], rows, layout, skip_zeros, clip)
            per = len(layout.field_names())
            for k, (j, st) in enumerate(zip(members, states)):
                new_p[idx[j]] = out_p[k]
                new_s[idx[j]] = type(st)._make(out_s[k * per : (k + 1) * per])


def _check_options(parts: _Parts, max_unorm: Any) -> None:
    if isinstance(max_unorm, Tensor) or (isinstance(max_unorm, (int, float)) and max_unorm > 0):
        for _, idx in parts.groups:
            rule = get_rule(type(parts.states[idx[0]]).layout.rule)
            if rule.norms is not None:
                raise ValueError(
                    f"max_unorm does not combine with {rule.name}, which scales its update by its own norms"
                )


_SHAPE, _STRIDE, _DTYPE, _DEVICE, _LAYOUT = (
    operator.attrgetter(a) for a in ("shape", "stride", "dtype", "device", "layout")
)


@dataclasses.dataclass
class _Checked:
    """A mixed tree whose params and states passed every check, as it was then. Weak references only: the
    cache keeps no tensor alive."""

    refs: list  # weakref.ref to each param and state field
    layout: tuple  # the params' addresses, shapes, strides and dtypes, the state classes, the groups
    fields: Any  # the state fields' addresses, shapes and dtypes (bnbf.plan.fields_planned)
    grads: bytes | None = None  # the addresses of the (contiguous) grads last found apart from them

    def same(self, tensors: list, layout: tuple) -> bool:
        return (
            len(tensors) == len(self.refs)
            and all(map(operator.is_, (r() for r in self.refs), tensors))
            and layout == self.layout
        )


_CHECKED = Bounded(16)  # _Checked by the ids of the tensors checked


def _check_before_writing(parts: _Parts, step: Any, max_unorm: Any = 0.0) -> None:
    """Everything that could make a later group's core call raise after an earlier group was stepped, checked
    before the first: each group's params and states through the core's own checks (``bnbf.plan`` checks them
    as ``update_`` does), the grads' fit, no memory shared between groups and no grad sharing memory with
    another group's param or state (the core checks within a call; the grads once per set of their addresses).

    The params' and states' checks are kept for the next call (by weak reference), which only confirms that
    they are the same tensors at the same addresses (and the params of the same shapes, strides and dtypes),
    in the same groups, as the core's plans confirm theirs: about 0.3 us a tensor instead of a plan per group
    (GPT-2's 148 leaves, 540 tensors with 8-bit AdamW: 0.1 ms on the CI machine's CPU, grads' check included).

    DTensor leaves (FSDP2) are checked as :func:`bnbf.distributed.update_` checks them (global shapes, meshes,
    placements, norms across the mesh), then the local shards stand for them in the core's checks."""
    _check_grads(parts)
    _check_step(step)
    for h, idx in parts.groups:  # a later group's refusal of a gradient asked through the step, before any writes
        ps, gs, ss = ([xs[i] for i in idx] for xs in (parts.params, parts.grads, parts.states))
        names = {parts.names[i]: p for i, p in zip(idx, ps)}
        check_not_differentiated(names, ps, gs, h, step, max_unorm, ss, in_place=True)
    for h, idx in parts.groups:  # the states keep the slots of their hyperparameters (which change per call)
        states = [parts.states[i] for i in idx]
        rule = get_rule(type(states[0]).layout.rule)
        want = present_mask(rule, h)
        if any(type(st).layout.present != want for st in states):
            _check_present(rule, h, states)
        if any(t.device.type == "meta" for _, t in hparam_tensors(h)):  # refused where its group's step reads it
            check_hparam_values(rule.scalars(h, 1), h)  # (max_unorm: refused by the first group's call)
    if not set(map(type, parts.params)) <= _PLAIN_TENSORS and any(map(is_dtensor, parts.params)):
        # a DTensor's data_ptr is 0: the memory the groups' steps write is the local shards'
        ps, gs, ss = bnbf.distributed._local_views(
            parts.params, parts.grads, parts.states, parts.groups, max_unorm, parts.names
        )
        parts = dataclasses.replace(parts, params=ps, grads=gs, states=ss)
    tensors = list(parts.params)
    for st in parts.states:
        tensors.extend(st)
    group_of = [0] * len(parts.params)
    for gi, (_, idx) in enumerate(parts.groups):
        for i in idx:
            group_of[i] = gi
    # what the core's plans confirm between steps: every param's and state field's address, shape and dtype, the
    # params' strides and the fields' contiguity (``resize_``, ``t_``, ``as_strided_``, ``set_``, ``.data =``)
    ps = parts.params
    layout = (
        tuple(map(Tensor.data_ptr, ps)),
        tuple(map(_SHAPE, ps)),
        tuple(map(Tensor.stride, ps)),
        tuple(map(_DTYPE, ps)),
        tuple(map(type, parts.states)),
        tuple(group_of),
    )
    key = tuple(map(id, tensors))
    found = _CHECKED.get(key)
    if found is None or not found.same(tensors, layout) or not fields_as_planned(parts.states, found.fields):
        for _, idx in parts.groups:
            bnbf.plan(_sub(parts, parts.params, idx), _sub(parts, parts.states, idx))
        _check_disjoint(parts)
        found = _Checked([weakref.ref(t) for t in tensors], layout, fields_planned(parts.states))
        _CHECKED.put(key, found)
    _check_grads_between(parts, found)


def _check_grads_between(parts: _Parts, checked: _Checked) -> None:
    """The core's refusal of a grad sharing memory with a param or state the step writes, across groups (each
    group's core call checks its own): the groups step one after another, so a later group would read a grad an
    earlier one already wrote. Where the core checks it (addressable tensors), once per set of grad addresses:
    plain contiguous grads of their params' shapes and dtypes where the last check found them cover its bytes."""
    gs = parts.grads
    # with the extension, two compiled passes: a loop whose grads keep their memory pays ~1 us (148 grads)
    if (
        checked.grads is not None
        and NATIVE is not None
        and NATIVE.grads_match(parts.params, gs)
        and NATIVE.ptrs_equal(gs, checked.grads)
    ):
        return
    if unaddressable(parts.params, gs):  # the core's generic path takes such a call through the pure step
        return
    at = ops._packed(tuple(map(Tensor.data_ptr, gs))) if all(map(Tensor.is_contiguous, gs)) else None
    if at is not None and at == checked.grads:
        return
    _check_grads_apart(dict(zip(parts.names, parts.params)), parts.params, gs, parts.states)
    checked.grads = at


def _check_grads(parts: _Parts) -> None:
    ps, gs = parts.params, parts.grads
    if (
        all(map(isinstance, gs, itertools.repeat(Tensor)))
        and set(map(_LAYOUT, gs)) == {torch.strided}
        and list(map(_SHAPE, gs)) == list(map(_SHAPE, ps))
        and list(map(_DTYPE, gs)) == list(map(_DTYPE, ps))
        and list(map(_DEVICE, gs)) == list(map(_DEVICE, ps))
    ):
        return
    for name, p, g in zip(parts.names, ps, gs):
        _check_grad(keystr((pytree.MappingKey(name),)), p, g)


def _span(t: Tensor) -> tuple[int, int]:
    """The bytes ``t`` may touch: [first, last + 1)."""
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return (t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size())


def _check_disjoint(parts: _Parts) -> None:
    """No param or state field of one group shares memory with another group's, by byte ranges (strided views
    with disjoint elements in different groups are refused too; the core takes them within one call)."""
    spans = []
    for gi, (_, idx) in enumerate(parts.groups):
        for i in idx:
            name = keystr((pytree.MappingKey(parts.names[i]),))
            if parts.params[i].numel():
                spans.append((str(parts.params[i].device), *_span(parts.params[i]), gi, f"param{name}"))
            for field, t in zip(parts.states[i]._fields, parts.states[i]):
                if t.numel():
                    spans.append((str(t.device), *_span(t), gi, f"state{name}.{field}"))
    spans.sort(key=lambda s: (s[0], s[1]))
    # sweep in order of start: y overlaps an earlier span of another group iff the largest end among the other
    # groups' earlier spans passes y's start; the two largest ends of distinct groups answer that
    device, top = None, []  # [(end, group, what)], at most two, distinct groups, largest first
    for dev, start, end, gi, what in spans:
        if dev != device:
            device, top = dev, []
        other = next((t for t in top if t[1] != gi), None)
        if other is not None and other[0] > start:
            raise ValueError(f"{other[2]} and {what} overlap in memory: each leaf is stepped on its own")
        mine = max([t for t in top if t[1] == gi] + [(end, gi, what)])
        top = sorted([t for t in top if t[1] != gi] + [mine], reverse=True)[:2]


# ---- updates -------------------------------------------------------------------------------------------------


def _as_float32(tensors: list[Tensor]) -> list[Tensor]:
    """Float32 copies of 16-bit tensors (one cat and one cast per device, not a launch per tensor); float32
    tensors are returned as they are."""
    out = list(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.dtype != torch.float32:
            by_device.setdefault(t.device, []).append(i)
    for device, idx in by_device.items():
        # cat converts as it copies: one pass, 2 bytes read and 4 written per element
        flat = torch.empty(sum(tensors[i].numel() for i in idx), dtype=torch.float32, device=device)
        torch.cat([tensors[i].reshape(-1) for i in idx], out=flat)
        for i, piece in zip(idx, flat.split([tensors[i].numel() for i in idx])):
            out[i] = piece.view(tensors[i].shape)
    return out


def updates(
    params: Any,
    grads: Any,
    state: Any,
    hparams: Any = None,
    step: Any = 1,
    **options: Any,
) -> tuple[Any, Any]:
    """The rule's update in float32, before rounding into the param dtype, and the new state (pure).

    ``apply_updates(params, u)`` then gives the params :func:`update` would. The step runs on float32 copies
    of 16-bit params and grads (exact: every 16-bit value is a float32 value), so the states and the float32
    new value are the fused step's, and ``u = new - p`` in float32 is exact wherever the new value is within a
    factor 2 of the old (Sterbenz), which covers every step small against its param; where ``new - p`` in the
    param dtype would round to zero (bf16 params, lr 1e-4), ``u`` keeps the update. Cost over :func:`update`,
    per element: one subtraction pass (8 bytes read, 4 written); with 16-bit params also a float32 copy of the
    params and grads (4 bytes read, 8 written; one launch per device each) and a step on float32 params and
    grads (6 bytes more). 8-bit AdamW moves about 40 bytes per element this way against the fused in-place
    step's 10 with bf16 params (28 against 16 with float32 params): ``update_`` stays the fast path.

    Args:
        params, grads, state, hparams, step: as :func:`update` (mixed rules and every hparams form too).
        **options: ``skip_zeros``, ``max_unorm``, ``maximize``, ``max_grad_norm``, as :func:`update`;
            ``differentiable=True`` as for :func:`bnbf.update` (32-bit state): the step in differentiable ops, ``u``
            keeping the history of every input (float64 params give float64 updates). Without it, a param or grad
            that takes part in a derivative raises (the step runs on detached copies), as the core's step does.

    Returns:
        ``(updates, new_state)``: float32 tensors in the structure of ``params``, and the new states.

    Example:
        >>> p = {"w": torch.ones(3, dtype=torch.bfloat16)}
        >>> s = init_state(p, bnbf.OptimSpec(rule="sgd", state_bits=32))
        >>> u, s = updates(p, {"w": torch.ones(3, dtype=torch.bfloat16)}, s, {"lr": 1e-4}, step=1)
        >>> [f"{x:.3g}" for x in u["w"].tolist()]  # bnbf.update's new bf16 params: still 1.0
        ['-0.0001', '-0.0001', '-0.0001']
    """
    flat, treespec = pytree.tree_flatten_with_path(params)
    clip, max_grad_norm = None, options.pop("max_grad_norm", None)
    differentiable = options.pop("differentiable", False)
    if differentiable is not False:
        if differentiable is not True:
            raise TypeError(f"differentiable must be a bool, got {type_name(differentiable)}")
        return _differentiable_updates(flat, treespec, params, grads, state, hparams, step, max_grad_norm, options)
    ps, g_leaves = _updates_leaves(flat, treespec, grads)
    tensors = all(isinstance(p, Tensor) for p in ps) and all(isinstance(g, Tensor) for g in g_leaves)
    if tensors and _asked([*ps, *g_leaves]):
        _refuse_updates(params, ps, g_leaves, state)  # the step below runs on detached copies
    if isinstance(max_grad_norm, Tensor) and _asked([max_grad_norm]):
        _refuse_updates(params, [], [], state, max_grad_norm)
    if max_grad_norm is not None:  # the norm of the grads as given (16-bit ones have 16-bit norms, as torch's)
        # the groups below step float32 copies: a folded total would not see which grads of several dtypes are 16-bit
        fold = not tensors or len({g.dtype for g in g_leaves}) < 2
        clip, grads = _grad_clip(grads, max_grad_norm, fold=fold)
        g_leaves = pytree.tree_leaves(grads)
    if tensors:
        with torch.no_grad():
            p32 = _as_float32([p.detach() for p in ps])
            g32 = _as_float32([g.detach() for g in g_leaves])
    else:  # the core names the leaf that is not a tensor
        p32, g32 = ps, g_leaves
    # a packed state's launch groups are its params' dtypes', which float32 copies of 16-bit params do not have: its
    # per-param views step, packed back for the params as given (the two step alike, bit for bit)
    repack = type(state) is bnbf.packed.PackedState and tensors and any(p.dtype != torch.float32 for p in ps)
    with _clipping(clip) if clip is not None else contextlib.nullcontext():
        new, new_state = update(
            pytree.tree_unflatten(p32, treespec),
            pytree.tree_unflatten(g32, treespec),
            state.unpack() if repack else state,
            hparams,
            step,
            **options,
        )
    if repack:
        new_state = bnbf.packed.pack_state(new_state, params)
    with torch.no_grad():
        u = torch._foreach_sub(pytree.tree_leaves(new), p32)
    return pytree.tree_unflatten(u, treespec), new_state


def _updates_leaves(flat: list, treespec: Any, grads: Any) -> tuple[list, list]:
    """The params' and grads' leaves of an :func:`updates` call, their structures and dtypes checked."""
    g_leaves, g_spec = pytree.tree_flatten(grads)
    if g_spec != treespec:
        raise ValueError(f"grad structure {g_spec} does not match param structure {treespec}")
    for (k, p), g in zip(flat, g_leaves):
        # the casts would hide a grad of another dtype than its param's: checked here, the rest by the core
        if isinstance(p, Tensor) and isinstance(g, Tensor) and g.dtype != p.dtype:
            raise TypeError(f"grad{pytree.keystr(k)} has dtype {g.dtype} but the param has dtype {p.dtype}")
    return [p for _, p in flat], g_leaves


def _refuse_updates(params: Any, ps: list, gs: list, state: Any, max_grad_norm: Any = None) -> None:
    """The core's refusal of a derivative asked through a step that is not differentiable, for :func:`updates`,
    which steps detached float32 copies (the core would not see what is asked): it names the leaf, the option
    and this function."""
    states = pytree.tree_leaves(state, is_leaf=is_state)
    ask = ("bnbf.updates", "OptimSpec(state_bits=32)")
    if max_grad_norm is not None:
        check_clip_not_differentiated(max_grad_norm, state, in_place=False, ask=ask)
    elif not torch.compiler.is_compiling():  # the leaf's name from the eager checks; traced, the error below
        check_not_differentiated(params, ps, gs, None, None, None, states, in_place=False, ask=ask)
    raise RuntimeError(
        "a derivative is asked through bnbf.updates, which is not differentiable by default: pass "
        "differentiable=True to bnbf.updates (32-bit state), or step detached tensors under torch.no_grad()"
    )


def _differentiable_updates(
    flat: list, treespec: Any, params: Any, grads: Any, state: Any, hparams: Any, step: Any, max_grad_norm: Any,
    options: dict,
) -> tuple[Any, Any]:  # fmt: skip
    """:func:`updates` with ``differentiable=True``: the step of ``bnbf.update(..., differentiable=True)`` (every
    hparams form, mixed rules) on the params and grads widened to float32 by differentiable casts (exact), and
    ``u = new - p`` in that dtype; float64 params stay float64 (gradcheck). Every tensor keeps its history."""
    ps, g_leaves = _updates_leaves(flat, treespec, grads)
    widen = lambda t: t.float() if isinstance(t, Tensor) and t.dtype in (torch.float16, torch.bfloat16) else t
    wide, g_wide = list(map(widen, ps)), list(map(widen, g_leaves))
    coef = grad_scale_of(g_leaves, max_grad_norm)  # of the grads as given (16-bit grads: 16-bit norms)
    if coef is not None:  # applied to the widened grads, as the default path applies it as it loads them
        g_wide = [g * coef.to(g.device) for g in g_wide]
    new, new_state = bnbf.update(
        pytree.tree_unflatten(wide, treespec),
        pytree.tree_unflatten(g_wide, treespec),
        state,
        hparams,
        step,
        differentiable=True,
        **options,
    )
    u = [n - p for n, p in zip(pytree.tree_leaves(new), wide)]
    return pytree.tree_unflatten(u, treespec), new_state


def _flatten_updates(params: Any, updates: Any) -> tuple[list, list, Any]:
    flat, treespec = pytree.tree_flatten_with_path(params)
    u_leaves, u_spec = pytree.tree_flatten(updates)
    if u_spec != treespec:
        raise ValueError(f"updates structure {u_spec} does not match param structure {treespec}")
    for (k, p), u in zip(flat, u_leaves):
        where = pytree.keystr(k)
        if not isinstance(p, Tensor) or not p.is_floating_point():
            raise TypeError(
                f"param{where} must be a floating point Tensor, got {getattr(p, 'dtype', type(p).__name__)}"
            )
        if not isinstance(u, Tensor) or not u.is_floating_point():
            raise TypeError(
                f"updates{where} must be a floating point Tensor, got {getattr(u, 'dtype', type(u).__name__)}"
            )
        if u.shape != p.shape:
            raise ValueError(f"updates{where} has shape {tuple(u.shape)} but the param has shape {tuple(p.shape)}")
        if u.device != p.device:
            raise ValueError(f"updates{where} is on {u.device} but the param is on {p.device}")
    return [p for _, p in flat], u_leaves, treespec


def apply_updates(params: Any, updates: Any) -> Any:
    """``params + updates``, computed in float32 and rounded once into each param's dtype (pure).

    Args:
        params: a tensor or pytree of float tensors.
        updates: float tensors of the params' shapes in the same structure (e.g. from :func:`updates`).

    Returns:
        New params in the structure and dtypes of ``params``; where a derivative is asked through a param or an
        update (as ``optax.apply_updates``), the same values computed in differentiable ops.

    Example:
        >>> apply_updates({"w": torch.ones(2, dtype=torch.bfloat16)}, {"w": torch.full((2,), -0.25)})
        {'w': tensor([0.7500, 0.7500], dtype=torch.bfloat16)}
    """
    ps, us, treespec = _flatten_updates(params, updates)
    if _asked([*ps, *us]):
        # p + u in ops torch.func and autograd differentiate (the _foreach ops do not under torch.func): the same
        # elementwise sum in the promoted dtype, then the one rounding
        out = [p + u for p, u in zip(ps, us)]
        return pytree.tree_unflatten([o if o.dtype == p.dtype else o.to(p.dtype) for o, p in zip(out, ps)], treespec)
    with torch.no_grad():
        # a 16-bit param plus a float32 update promotes to float32: one rounding, into the param dtype, after
        out = torch._foreach_add([p.detach() for p in ps], us)
        out = [o if o.dtype == p.dtype else o.to(p.dtype) for o, p in zip(out, ps)]
    return pytree.tree_unflatten(out, treespec)


def apply_updates_(params: Any, updates: Any) -> Any:
    """:func:`apply_updates` written into ``params`` in place (the sum in float32, one rounding); returns them.

    Every leaf is checked before the first param is written, as :func:`bnbf.update_` checks its params: a param
    listed twice, params sharing memory, a param that cannot be written in place (expanded, an inference tensor,
    sparse) raise with nothing written.

    Example:
        >>> p = {"w": torch.ones(2)}
        >>> _ = apply_updates_(p, {"w": torch.full((2,), -0.5)})
        >>> p["w"]
        tensor([0.5000, 0.5000])
    """
    ps, us, _ = _flatten_updates(params, updates)
    _check_apply_in_place(params, ps, us)
    with torch.no_grad():
        torch._foreach_add_(ps, us)  # in-place add computes in the promoted dtype (float32), then rounds
    return params


def _check_apply_in_place(params: Any, ps: list, us: list) -> None:
    """What :func:`apply_updates_` cannot write, refused before the first param is: ``torch._foreach_add_``
    writes param after param, so a later leaf's error would come with the earlier ones stepped. The params are
    checked as ``update_`` checks its own (its checks and words): dense, writable (no inference tensor, no
    elements sharing memory), none listed twice, no two sharing memory."""
    if torch.compiler.is_compiling():  # traced: an error at trace time writes nothing, the graph runs whole
        return
    if set(map(_LAYOUT, ps)) != {torch.strided} or any(p.is_nested for p in ps):
        for (k, _), p in zip(pytree.tree_flatten_with_path(params)[0], ps):
            if p.layout != torch.strided or p.is_nested:  # dense += sparse: torch raises after the earlier adds
                got = "a nested tensor" if p.is_nested else f"layout {p.layout}"
                raise TypeError(f"param{pytree.keystr(k)} must be a dense (strided) tensor, got {got}")
    if unaddressable(ps, us) or any(p.device.type == "meta" for p in ps):  # no addresses to compare
        return
    _check_writable(params, ps, pure="bnbf.apply_updates")
    _check_no_overlap(params, ps, [])
    pair = _grad_overlap(ps, us, [])  # an update that is another param's memory: its value would hang on the order
    if pair is not None:
        names = [pytree.keystr(k) for k, _ in pytree.tree_flatten_with_path(params)[0]]
        raise ValueError(
            f"update{names[pair[0]]} shares memory with param{names[pair[1]]}, which apply_updates_ writes: it would "
            f"read it while writing it (pass a copy of the update, or use bnbf.apply_updates)"
        )


# ---- clipping ------------------------------------------------------------------------------------------------


def _by_device_dtype(gs: list[Tensor]) -> dict[tuple, list[int]]:
    """The grads' indices by (device, dtype), the groups in the order torch's clip_grad_norm_ takes them (its grouping
    function's, not the order of first appearance): the stacked group norms' sum, so the total's bits, follow it."""
    grouped = _group_tensors_by_device_and_dtype([list(gs)], with_indices=True)
    return {key: list(idx) for key, (_, idx) in grouped.items()}


def _per_tensor() -> bool:
    """Whether the ``_foreach`` ops must be one op per tensor (the same arithmetic): vmap has no batching rule for
    them. Traced, ``ops.vmap_level`` is None; any torch.func transform Dynamo traces around the call counts."""
    if torch.compiler.is_compiling():
        return torch._C._are_functorch_transforms_active()
    return ops.vmap_level() is not None


def _refuse_mixed_dtensor(gs: list) -> None:
    """NotImplementedError for DTensor (FSDP2) grads beside plain ones: torch's clip_grad_norm_ fails on them inside
    ``_foreach_norm`` (a sharded norm and a local one do not add up to one total)."""
    if not set(map(type, gs)) <= _PLAIN_TENSORS:
        sharded = list(map(is_dtensor, gs))
        if any(sharded) and not all(sharded):
            raise NotImplementedError(
                "gradient clipping (max_grad_norm, clip_grad_norm) over DTensor (FSDP2) grads and plain grads in one "
                "call is not supported: their norms do not add up to one total; shard every param, or clip the two "
                "kinds yourself"
            )


def _total_norm(gs: list[Tensor], norm_type: float) -> tuple[Tensor, dict]:
    """torch.nn.utils.clip_grad_norm_'s total norm (the same ops, so the same bits), and the grads' indices by
    (device, dtype)."""
    if not torch.compiler.is_compiling():
        _refuse_mixed_dtensor(gs)
    # the usual tree: one group (traced: the loop below, which Dynamo traces and which gives the same ops)
    if not torch.compiler.is_compiling() and len(set(map(_DEVICE, gs))) == 1 and len(set(map(_DTYPE, gs))) == 1:
        by = {(gs[0].device, gs[0].dtype): range(len(gs))}
        if _per_tensor():  # vmap has no batching rule for _foreach_norm: its per-tensor norms
            norms = [torch.linalg.vector_norm(g, norm_type) for g in gs]
            return torch.linalg.vector_norm(torch.stack(norms), norm_type), by
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(gs, norm_type)), norm_type), by
    by = _by_device_dtype(gs)
    norms: list[Tensor] = []
    for idx in by.values():
        if _per_tensor():
            norms.extend(torch.linalg.vector_norm(gs[i], norm_type) for i in idx)
            continue
        norms.extend(torch._foreach_norm([gs[i] for i in idx], norm_type))
    first = gs[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), norm_type), by


def _check_max_grad_norm(max_grad_norm: Any) -> None:
    """A number >= 0 or a 1-element float tensor (read only on the CPU: no host synchronisation); NaN, inf and
    float32 overflows refused (``Invalid max_grad_norm value: -1.0``; torch has no wording, it clips with any
    value: a negative one flips the grads, NaN makes them NaN)."""
    if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float, Tensor)):
        raise TypeError(f"max_grad_norm must be a number or a 1-element tensor, got {type(max_grad_norm).__name__}")
    if isinstance(max_grad_norm, Tensor) and not max_grad_norm.is_floating_point():
        raise TypeError(f"max_grad_norm must be a floating point tensor, got {max_grad_norm.dtype}")
    if isinstance(max_grad_norm, Tensor) and max_grad_norm.device.type == "meta":
        raise _no_value("max_grad_norm")
    if isinstance(max_grad_norm, Tensor) and torch.compiler.is_compiling():
        return  # traced: a graph input, its value unread (as max_unorm's)
    check_nonneg(max_grad_norm, "max_grad_norm")


def _grad_clip(grads: Any, max_grad_norm: Any, detach: bool = True, fold: bool = True) -> tuple[GradClip | None, Any]:
    """Gradient clipping for one call of :func:`update` / :func:`update_` with ``max_grad_norm``.

    Returns ``(clip, grads)``. Eager calls on plain tensors get a folded :class:`bnbf.reference.GradClip`, set
    around the core calls by :func:`_clipping`: the total norm comes from our own pass over the grads, and the
    step scales each grad by the coefficient as it loads it (no clipped copy is written, no
    ``torch._foreach_norm``):

    - each launch group sums its grads' squares over every element (non-finite ones included, so that an inf or
      NaN grad gives torch's total, inf or NaN, and torch's coefficient, 0 or NaN): float32 within each tile of
      the step's tiles (256 elements, or the 8-bit state's block), float64 per tensor in a fixed order. A rule
      whose norm pass can give them (``Rule.norm_grad_powers``: LARS, whose ``||g||`` is linear in the grads)
      sums them in that pass (no read of its own; its norms of the clipped grads, ``coef**2 * ||g||²``, come
      from its sums); any other rule in one grads-only launch per group (``_grad_squares_kernel``; the
      reference path adds the same way, bnbf.reference.tile_squares);
    - every group's launches (LAMB's and ``max_unorm``'s norm pass with the clipped grads, then the step) wait
      until every group has its sums; :meth:`GradClip.finish` then computes the total (float64, rounded to the
      grads' dtype as torch's is; with grads of several dtypes each 16-bit group's norms rounded to its dtype
      first, as torch takes each norm: :func:`bnbf.reference.fold_total`) and the coefficient with torch's ops
      (``min(1, max_norm / (total + 1e-6))``) on the device, and runs them: the kernels multiply each grad by the
      coefficient in float32 (one product, the bits of a float32 grad clipped by that coefficient with torch's
      multiply).

    The total adds the same squares in another order than ``torch._foreach_norm``: its bits may differ from
    torch's by up to (W/2 + 1) float32 ulps for tiles of W elements (tests/tolerances.py,
    ``folded_total_ulps``), and so may the coefficient's.
    Calls whose norms a distributed reduction sums across shards (``bnbf.distributed``) take torch's total
    (``torch._foreach_norm`` per (device, dtype)) and the kernels the coefficient from it.

    Traced calls, torch.func transforms and tensor subclasses (DTensor...) get ``clip`` None and the grads
    clipped into copies by :func:`clip_grad_norm` (their routes do not read the clip), which keep the grads'
    history where a derivative is asked through them: the core then refuses it as it refuses unclipped grads.
    ``detach``: the in-place step takes grads that require grad detached (as torch.optim); the pure step keeps
    them (under grad mode), so that the core names such a grad instead of losing its history. ``fold=False``: the
    total from ``torch._foreach_norm`` of ``grads`` (for :func:`updates` of grads of several dtypes: its groups
    step float32 copies, so they cannot round a 16-bit grad's norm to its dtype as torch does).
    """
    _check_max_grad_norm(max_grad_norm)
    eager = not torch.compiler.is_compiling() and torch._C._functorch.maybe_current_level() is None
    gs = _flatten(grads)[0] if eager else []  # nested trees too (the clip had taken their first level for leaves)
    plain = eager and gs and set(map(type, gs)) <= _PLAIN_TENSORS
    sharded = eager and gs and not plain and any(map(is_dtensor, gs))
    if not plain and not sharded:
        return None, clip_grad_norm(grads, max_grad_norm)[0]
    limit = max_grad_norm.reshape(()) if isinstance(max_grad_norm, Tensor) else max_grad_norm
    with torch.no_grad():
        if sharded:
            # torch's total (a DTensor reduced to every rank; DTensor beside plain grads refused), its coefficient by
            # torch's ops in the total's dtype as the folded clip takes it, applied by the kernels as they load each
            # local grad, as the unsharded step applies it (a clipped 16-bit copy would round the products)
            total = _total_norm(gs, 2.0)[0].full_tensor()
            clip = GradClip(
                clip_coefficient(total, limit.to(total.device) if isinstance(limit, Tensor) else limit), None
            )
        elif fold and _folds():
            dtype = gs[0].dtype  # the total norm's: the stack of torch's per-dtype norms promotes
            dtypes = set(map(_DTYPE, gs))
            if len(dtypes) > 1:
                for d in dtypes:
                    dtype = torch.promote_types(dtype, d)
            clip = GradClip.folded(limit, dtype, gs[0].device)
        elif isinstance(max_grad_norm, Tensor):
            clip = GradClip(clip_coefficient(_total_norm(gs, 2.0)[0], limit), None)
        else:
            clip = GradClip(_total_norm(gs, 2.0)[0], float(max_grad_norm))
    if (detach or not torch.is_grad_enabled()) and any(map(_REQUIRES_GRAD, gs)):  # taken detached, as torch.optim
        grads = pytree.tree_map(Tensor.detach, grads)
    return clip, grads


_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def _folds() -> bool:
    """Whether the total norm of a call can come from its groups' own sums of g²: unless a distributed reduction
    sums the norms (``bnbf.distributed``'s shards need their own total). Every grad of a call the core accepts
    reaches a launch group or the reference step; a call it refuses raises before any group runs."""
    return NORM_REDUCE.get() is None


@contextlib.contextmanager
def _clipping(clip: GradClip):
    """``clip`` for the steps run inside (:data:`bnbf.reference.GRAD_CLIP`, read by the launcher and the
    reference step); a folded clip then computes its coefficient and runs the steps its norm passes deferred
    (nothing is written where the steps raised)."""
    token = GRAD_CLIP.set(clip)
    try:
        yield
        clip.finish()
    finally:
        GRAD_CLIP.reset(token)


def _clip_args(grads: Any, max_norm: Any, norm_type: Any) -> tuple[list, Any, Any, float]:
    gs, treespec = pytree.tree_flatten(grads)
    for i, g in enumerate(gs):
        if not isinstance(g, Tensor):
            raise TypeError(f"grads must be tensors, got {type(g).__name__} at leaf {i}")
    norm_type = float(norm_type)
    if not isinstance(max_norm, Tensor):
        max_norm = float(max_norm)
    return gs, treespec, max_norm, norm_type


def _asked(tensors: list) -> bool:
    """Whether a derivative is asked through ``tensors`` (:func:`bnbf._host_checks.differentiated`: requiring grad
    under grad mode, wrapped by torch.func's grad/jvp, a forward-mode dual). Traced by torch.compile, what Dynamo
    can see: grad mode and ``requires_grad``, or a torch.func grad/jvp transform around the call."""
    if torch.compiler.is_compiling():
        return (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)) or _traced_derivative()
    return differentiated(tensors)


def grad_scale_of(grads: Any, max_grad_norm: Any) -> Tensor | None:
    """For the ``differentiable=True`` steps: ``clip_grad_norm``'s factor for ``grads`` (a tree) in differentiable
    ops, which the step applies to each grad in its compute dtype; None without ``max_grad_norm`` or grads."""
    if max_grad_norm is None:
        return None
    _check_max_grad_norm(max_grad_norm)
    gs = pytree.tree_leaves(grads)
    return clip_coefficient_differentiably(gs, max_grad_norm)[0] if gs else None


def clip_coefficient_differentiably(
    gs: list, max_norm: Any, norm_type: float = 2.0, error_if_nonfinite: bool = False
) -> tuple[Tensor, Tensor, dict]:
    """``(coef, total, by)``: :func:`_clip_differentiably`'s factor and total norm, and the grads' (device, dtype)
    groups, for a step that applies the factor itself (in its compute dtype, as the default step does)."""
    by = _by_device_dtype(gs)
    first = gs[0].device
    norms = [torch.linalg.vector_norm(gs[i], norm_type).to(first) for idx in by.values() for i in idx]
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    _check_finite_norm(total, norm_type, error_if_nonfinite)
    return torch.clamp(max_norm / (total + 1e-6), max=1.0), total, by


def _clip_differentiably(
    gs: list, treespec: Any, max_norm: Any, norm_type: float, error_if_nonfinite: bool
) -> tuple[Any, Tensor]:
    """:func:`clip_grad_norm` where a derivative is asked through it: torch's arithmetic in ops that autograd,
    ``torch.func.grad``/``jvp`` and ``vmap`` all differentiate (the ``_foreach`` ops have no working backward or
    forward derivative under torch.func). One ``vector_norm`` per grad is what ``torch._foreach_norm`` runs on the
    CPU (so the same bits there) and what ``clip_grad_norm_(foreach=False)`` runs; the norms are stacked in the
    same (device, dtype) group order as :func:`_total_norm`, and ``g * coef`` is ``torch._foreach_mul``'s product."""
    coef, total, by = clip_coefficient_differentiably(gs, max_norm, norm_type, error_if_nonfinite)
    out: list = [None] * len(gs)
    for (device, _), idx in by.items():
        c = coef.to(device)
        for i in idx:
            out[i] = gs[i] * c
    return pytree.tree_unflatten(out, treespec), total


def clip_grad_norm(
    grads: Any, max_norm: Any, norm_type: Any = 2.0, error_if_nonfinite: bool = False
) -> tuple[Any, Tensor]:
    """Gradients scaled to a global norm of at most ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` (pure).

    The norm of every gradient's norm, ``total``; each gradient times ``min(1, max_norm / (total + 1e-6))``.
    All on the device, without a host synchronisation (the factor is a tensor, applied also when it is 1);
    the same arithmetic as torch's (per (device, dtype) group ``torch._foreach_norm``, then the norm of the
    norms), so the same bits with a number ``max_norm``. torch reads a tensor ``max_norm`` as a number (a host
    synchronisation); here it stays a tensor, so with 16-bit grads the factor is computed in float32 and may
    differ from torch's by an ulp of the grads' dtype.

    Args:
        grads: a tensor or pytree of tensors.
        max_norm: the largest global norm (a number or a 0-d tensor).
        norm_type: the p of the p-norm, ``math.inf`` for the largest magnitude.
        error_if_nonfinite: raise ``RuntimeError`` if the total norm is nan or inf (reads it: a host
            synchronisation, as in torch).

    Where a derivative is asked through the grads or ``max_norm`` (eager autograd, ``torch.func.grad``/``jvp``) the
    same arithmetic runs in differentiable ops (one ``vector_norm`` per grad, as ``_foreach_norm`` computes on the
    CPU): the derivatives of torch's clip, the same values.

    Returns:
        ``(clipped_grads, total_norm)``: new tensors in the structure of ``grads``, and the total norm before
        clipping (a 0-d tensor in the grads' dtype, on the first grad's device).

    Example:
        >>> clipped, norm = clip_grad_norm({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}, 1.0)
        >>> norm.item(), round(clipped["a"].item(), 4)
        (5.0, 0.6)
    """
    gs, treespec, max_norm, norm_type = _clip_args(grads, max_norm, norm_type)
    if not gs:
        return grads, torch.tensor(0.0)
    if _asked(gs if not isinstance(max_norm, Tensor) else [*gs, max_norm]):
        return _clip_differentiably(gs, treespec, max_norm, norm_type, error_if_nonfinite)
    gs = [g.detach() for g in gs]
    with torch.no_grad():
        total, by = _total_norm(gs, norm_type)
        _check_finite_norm(total, norm_type, error_if_nonfinite)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        out: list = [None] * len(gs)
        for (device, _), idx in by.items():
            # vmap has no batching rule for _foreach_mul: the same products tensor by tensor
            mul = (lambda ts, c: [t * c for t in ts]) if _per_tensor() else torch._foreach_mul
            for i, c in zip(idx, mul([gs[i] for i in idx], coef.to(device))):
                out[i] = c
    return pytree.tree_unflatten(out, treespec), total


def clip_grad_norm_(grads: Any, max_norm: Any, norm_type: Any = 2.0, error_if_nonfinite: bool = False) -> Tensor:
    """:func:`clip_grad_norm` in place: scales the gradient tensors and returns the total norm.

    Example:
        >>> g = [torch.tensor([3.0, 4.0])]
        >>> clip_grad_norm_(g, 1.0).item(), g[0]
        (5.0, tensor([0.6000, 0.8000]))
    """
    gs, _, max_norm, norm_type = _clip_args(grads, max_norm, norm_type)
    if not gs:
        return torch.tensor(0.0)
    gs = [g.detach() for g in gs]  # written in place under no_grad, as torch writes p.grad
    with torch.no_grad():
        total, by = _total_norm(gs, norm_type)
        _check_finite_norm(total, norm_type, error_if_nonfinite)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for (device, _), idx in by.items():
            if _per_tensor():  # vmap has no batching rule for _foreach_mul_
                for i in idx:
                    gs[i].mul_(coef.to(device))
                continue
            torch._foreach_mul_([gs[i] for i in idx], coef.to(device))
    return total


def _check_finite_norm(total: Tensor, norm_type: float, error_if_nonfinite: bool) -> None:
    if error_if_nonfinite and bool(torch.logical_or(total.isnan(), total.isinf())):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
            f"clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            f"`error_if_nonfinite=False`"
        )

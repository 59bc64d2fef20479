"""A packed state: the state of every leaf of a tree in a few flat buffers, for torch.func transforms and
torch.compile.

``torch.func.vmap`` wraps and unwraps every tensor of its inputs and outputs, Dynamo guards every tensor input of
a compiled function and Inductor checks each one at every call: a cost per tensor, and the per-param state is most
of an optimizer step's tensors (GPT-2 small with 8-bit AdamW: 396 state tensors beside 148 params and 148 grads).
:func:`bnbf.init_state` with ``packed=True`` lays the same state out in one buffer per (param dtype, state layout,
field) instead (6 buffers for GPT-2), with each leaf's part at a fixed offset; the step is the same kernel, whose
address table points into the buffers, and the same reference code on views of them, so a packed step equals the
per-param step of the same kind (pure, in place, vmapped, compiled) bit for bit.

A :class:`PackedState` is a pytree whose children are only the buffers; where each leaf's state lies (the tree's
structure, shapes, offsets) is its static part, a :class:`PackedMeta`. :meth:`PackedState.unpack` gives the
per-param state (views of the buffers: checkpoints, :func:`bnbf.dequantize_state`); :func:`pack_state` packs a
per-param state. Each leaf's part starts a multiple of 256 bytes into its buffer; the bytes between parts are
zero (a pure step zeroes them in its new buffers).

The step's ops, ``bnbf::packed_step`` (pure) and ``bnbf::packed_step_`` (in place), take a layout group's params,
grads and buffers and the meta's key. Under ``vmap`` every member of a stacked buffer is stepped as its own state,
all members in one launch on the Triton path (:mod:`bnbf.kernels.members`), as the per-param step does. An eager
``update_`` runs, once a packed step has checked the same params and buffers, as ``update_``'s plan of the per-param
views (:meth:`PackedState.plan_views`): the per-param state's launches and host time.
"""

from __future__ import annotations

import array
import itertools
import math
import operator
import weakref
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch._C import _functorch
from torch.utils import _pytree as pytree

from bnbf import ops
from bnbf._dispatch import BUILD_LOCK, is_dtensor, launch_lock, use_triton
from bnbf._host_checks import (
    _PARAM_DTYPES,
    NATIVE,
    _check_grad,
    _check_grads_apart,
    _check_leaves,
    _check_no_overlap,
    _check_param,
    _check_present,
    _check_step,
    _flatten,
    _grad_overlap,
    _grads_ok,
    _names,
    _overlap,
    _unflatten,
    check_no_repeats,
    check_not_differentiated,
    grad_shares_memory,
    is_state,
    traced_hparams,
)
from bnbf.plan import _one_set, _scalars, scalar_row
from bnbf.reference import reference_step
from bnbf.rules import RULES, get_rule
from bnbf.state import Layout, _mark_static, layout_problem, state_class

_IN_PLACE = "in-place step of a packed state"  # what an overlap error names
_UNBATCHED = ops.UNBATCHED_IN_PLACE.format(what="a param or state buffer")
_ALIGN = 256  # bytes: each leaf's part of a buffer starts aligned, so the kernels keep their aligned variant
_BIG = 1 << 63  # a loaded size, offset or shape at or above it is no tensor's


class PackedGroup(NamedTuple):
    """The leaves stepped by one launch (one param dtype, one state layout: ``meta.dtypes`` says which) and where
    their state lies: buffer
    ``first + f`` holds field ``f`` of every leaf of the group, leaf ``k``'s part at ``offsets[f][k]`` (elements),
    ``numels[f][k]`` long."""

    layout: Layout
    leaves: tuple
    first: int
    offsets: tuple
    numels: tuple


_KEYS = itertools.count()
_METAS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # key -> meta, for the ops (ints only)


class PackedMeta:
    """The static part of a :class:`PackedState`: the params' tree structure, shapes and dtypes, the layout groups
    and the buffers' sizes. Made once per :func:`init_state`/:func:`pack_state`; every state stepped from it shares
    it (the ops name it by ``key``, an int unique in this process)."""

    __slots__ = ("key", "spec", "shapes", "dtypes", "rule", "groups", "sizes", "pick", "twins", "buffer_twins",
                 "checked", "pads", "__weakref__")  # fmt: skip

    def __init__(self, spec: Any, shapes: tuple, dtypes: tuple, rule: str, groups: tuple, sizes: tuple):
        self.spec, self.shapes, self.dtypes = spec, shapes, dtypes
        self.rule, self.groups, self.sizes = rule, groups, sizes
        self.pick = tuple(map(_picker, (g.leaves for g in groups)))  # per group: its leaves of a leaf list
        # meta tensors of the params' shapes and dtypes, for the compiled check of an eager call's params and grads
        self.twins = [torch.empty(s, dtype=d, device="meta") for s, d in zip(shapes, dtypes)]
        self.buffer_twins = [torch.empty((n,), dtype=d, device="meta") for d, n in sizes]  # likewise of the buffers
        # (launcher groups, grads' addresses) of the last eager update_ whose memory checks passed (_step_direct_)
        self.checked: tuple = ((), None)
        self.pads: dict = {}  # (device, group) -> per buffer of the group, the indices of its padding (or None)
        self.key = next(_KEYS)
        _METAS[self.key] = self

    def zero_padding(self, gi: int, bufs: list) -> None:
        """Zero the padding of group ``gi``'s new buffers ``bufs`` (1-D, or ``[members, n]``), which the step
        does not write: a pure step's fresh buffers equal, byte for byte, what the in-place step leaves (pack_state's
        zeros), with no stray values (NaN in a float buffer) for a finiteness check or a checkpoint to carry."""
        device = bufs[0].device
        idx = self.pads.get((device, gi))
        if idx is None:
            g = self.groups[gi]
            idx = []
            for f, (offsets, numels) in enumerate(zip(g.offsets, g.numels)):
                unused = torch.ones(self.sizes[g.first + f][1], dtype=torch.bool)
                for at, n in zip(offsets, numels):
                    unused[at : at + n] = False
                found = unused.nonzero().squeeze(1)
                idx.append(found.to(device) if found.numel() else None)
            self.pads[(device, gi)] = idx
        for b, i in zip(bufs, idx):
            if i is not None:
                b.index_fill_(-1, i, 0)

    def __reduce__(self):  # unpickled: a meta of this process (its own key), its values checked
        return _rebuild_meta, self._plain()

    def _plain(self) -> tuple:
        """The meta as :func:`_checked_meta` takes it: plain tuples, ints, strings and dtypes."""
        groups = tuple((tuple(g.layout), g.leaves, g.first, g.offsets, g.numels) for g in self.groups)
        return _plain_spec(self.spec), tuple(map(tuple, self.shapes)), self.dtypes, self.rule, groups, self.sizes

    def __repr__(self) -> str:
        return f"PackedMeta({len(self.shapes)} leaves, rule {self.rule!r}, {len(self.sizes)} buffers)"


def _plain_spec(spec: Any) -> Any:
    """The params' structure key (``_flatten``'s) in values ``torch.load``'s default (weights_only) takes: a
    list's or tuple's type by name, a pytree structure as its JSON (where torch can write it)."""
    if type(spec) is tuple and spec[0] in (list, tuple):
        return (spec[0].__name__, spec[1])
    if isinstance(spec, pytree.TreeSpec):
        try:
            return ("treespec", pytree.treespec_dumps(spec))
        except (NotImplementedError, TypeError, ValueError):  # a node type without a serialized name
            return spec
    return spec


def _spec_of_plain(spec: Any) -> Any:
    """The structure key :func:`_plain_spec` wrote."""
    if type(spec) is tuple and spec[0] in ("list", "tuple"):
        return ({"list": list, "tuple": tuple}[spec[0]], spec[1])
    if type(spec) is tuple and spec[0] == "treespec":
        return pytree.treespec_loads(spec[1])
    return spec


def _rebuild_meta(*plain: Any) -> PackedMeta:
    """A pickled :class:`PackedMeta` (:meth:`PackedMeta.__reduce__`; also the meta of a packed state saved before
    :func:`_rebuild_packed`, loaded with ``weights_only=False``), its values checked."""
    return PackedMeta(*_checked_meta(*plain))


def _rebuild_packed(buffers: Any, *plain: Any) -> PackedState:
    """A saved :class:`PackedState` (:meth:`PackedState.__reduce__`): the only function of this module that
    ``torch.load``'s default may call. Nothing is made before every value fits the others and the buffers: the
    kernels address each leaf's part by its offset and read it as its layout's dtype, so one that did not fit
    would have the step read and write outside the buffers."""
    return PackedState(buffers, PackedMeta(*_checked_meta(*plain, buffers=buffers)))


def _checked_meta(spec: Any, shapes: Any, dtypes: Any, rule: Any, groups: Any, sizes: Any, buffers: Any = None):
    """:class:`PackedMeta`'s arguments from :meth:`PackedMeta._plain`'s values, each checked as :func:`pack_state`
    makes it (and against ``buffers``, where given); ``ValueError`` naming the first that is not."""

    def bad(what: str) -> ValueError:
        return ValueError(f"not a bnbf packed state: {what}")

    def ints(xs: Any, n: int | None = None) -> bool:
        return type(xs) is tuple and (n is None or len(xs) == n) and all(type(x) is int and 0 <= x < _BIG for x in xs)

    if not (type(shapes) is tuple and shapes and all(isinstance(s, tuple) and ints(tuple(s)) for s in shapes)):
        raise bad("its shapes are not tuples of non-negative ints, one per leaf")
    n, numel = len(shapes), [math.prod(s) for s in shapes]
    if max(numel) >= _BIG:
        raise bad(f"leaf {numel.index(max(numel))} has {max(numel)} elements")
    spec = _checked_spec(spec, n, bad)
    if not (type(dtypes) is tuple and len(dtypes) == n and all(map(_is_dtype, dtypes, [_PARAM_DTYPES] * n))):
        raise bad(f"its param dtypes are not {n} of {[str(d) for d in _PARAM_DTYPES]}")
    if type(rule) is not str or rule not in RULES:
        raise bad(f"unknown rule {rule!r}")
    if not (type(sizes) is tuple and all(type(s) is tuple and len(s) == 2 and _is_dtype(s[0]) for s in sizes)):
        raise bad("its buffer sizes are not (dtype, size) pairs of a state's dtypes")
    if not all(ints(s[1:]) for s in sizes):
        raise bad("a buffer size is not a non-negative int")
    if not (type(groups) is tuple and groups):
        raise bad("it has no layout groups")
    made, seen, used = [], [], 0
    for gi, g in enumerate(groups):
        if not (isinstance(g, tuple) and len(g) == 5):
            raise bad(f"layout group {gi} is not (layout, leaves, first, offsets, numels)")
        layout, leaves, first, offsets, numels = g
        problem = layout_problem(layout)
        if problem is not None:
            raise bad(f"layout group {gi}: {problem}")
        layout = Layout(*layout)
        if layout.rule != rule:
            raise bad(f"layout group {gi} is of rule {layout.rule!r}, the state of {rule!r}")
        if not (ints(leaves) and leaves and max(leaves) < n):
            raise bad(f"layout group {gi}'s leaves are not indices of its {n} leaves")
        if len({dtypes[i] for i in leaves}) > 1:  # one launch reads every param of a group as one dtype
            raise bad(f"layout group {gi} holds params of several dtypes")
        per = len(layout.field_names())
        if first != used:
            raise bad(f"layout group {gi}'s fields start at buffer {first!r}, not at {used}")
        if used + per > len(sizes):
            raise bad(f"its layout groups have more fields than its {len(sizes)} buffers")
        if not (type(offsets) is tuple and type(numels) is tuple and len(offsets) == len(numels) == per):
            raise bad(f"layout group {gi} does not give each of its {per} fields' offsets and sizes")
        fields = [list(layout.expected(torch.Size(shapes[i])).values()) for i in leaves]
        for f in range(per):
            (dtype, size), at, count = sizes[first + f], offsets[f], numels[f]
            if not (ints(at, len(leaves)) and ints(count, len(leaves))):
                raise bad(f"layout group {gi} field {f}: not an offset and a size per leaf")
            if dtype != fields[0][f][1]:
                raise bad(f"buffer {first + f} is {dtype}, its field of layout group {gi} {fields[0][f][1]}")
            spans = []
            for k, i in enumerate(leaves):
                if count[k] != math.prod(fields[k][f][0]):
                    want = math.prod(fields[k][f][0])
                    raise bad(f"leaf {i}'s part of buffer {first + f} has {count[k]} elements, its field {want}")
                where = f"leaf {i}'s part of buffer {first + f} (elements {at[k]} to {at[k] + count[k]})"
                if at[k] + count[k] > size:
                    raise bad(f"{where} ends past the buffer's {size} elements")
                if at[k] % (_ALIGN // dtype.itemsize):  # the kernels' aligned variant is chosen by the buffers' address
                    raise bad(f"{where} does not start {_ALIGN}-byte aligned")
                spans.append((at[k], at[k] + count[k]))
            spans.sort()
            if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
                raise bad(f"leaves' parts of buffer {first + f} overlap")
        seen += leaves
        used += per
        made.append(PackedGroup(layout, leaves, first, offsets, numels))
    if used != len(sizes) or sorted(seen) != list(range(n)):
        raise bad(f"its layout groups hold {used} of its {len(sizes)} buffers and leaves {sorted(seen)} of {n}")
    if buffers is not None:
        _check_buffers(buffers, sizes, bad)
    return spec, tuple(map(torch.Size, shapes)), dtypes, rule, tuple(made), sizes


def _is_dtype(x: Any, of: tuple = (torch.uint8, torch.float32)) -> bool:
    """Whether ``x`` is one of the dtypes ``of`` (by default a state field's: codes, absmax or 32-bit values)."""
    return isinstance(x, torch.dtype) and x in of


def _read_structure(plain: Any, bad) -> Any:
    """The structure ``("treespec", JSON)`` that :func:`_plain_spec` wrote, read back; ``bad(...)`` where it does not
    read (a checkpoint is input)."""
    try:
        return _spec_of_plain(plain)
    except (TypeError, ValueError, KeyError, IndexError, NotImplementedError, RuntimeError) as e:  # treespec_loads'
        raise bad(f"its structure does not read back ({type(e).__name__}: {e})") from None


def _checked_spec(spec: Any, n: int, bad) -> Any:
    """The structure key :func:`_plain_spec` wrote, if it is one of ``n`` leaves."""
    kind = spec[0] if type(spec) is tuple and len(spec) == 2 and type(spec[0]) is str else None
    if kind in ("list", "tuple") and type(spec[1]) is int:
        spec, count = _spec_of_plain(spec), spec[1]
    elif kind == "dict" and type(spec[1]) is tuple:
        try:
            count = len(set(spec[1]))
        except TypeError:
            raise bad("its dict keys are not hashable") from None
        if count != len(spec[1]):
            raise bad("its dict keys repeat")
    elif kind == "treespec" and type(spec[1]) is str:
        spec = _read_structure(spec, bad)
        count = spec.num_leaves
    elif isinstance(spec, pytree.TreeSpec):  # a node type torch cannot write as JSON (pickled with weights_only=False)
        count = spec.num_leaves
    elif type(spec) is str and spec == "leaf":
        count = 1
    else:
        raise bad(f"its structure key is not one bnbf writes: {type(spec).__name__}")
    if count != n:
        raise bad(f"its structure has {count} leaves, its shapes {n}")
    return spec


def _check_buffers(buffers: Any, sizes: tuple, bad) -> None:
    """``ValueError`` unless ``buffers`` are the strided tensors ``sizes`` describes, on one device (each
    ``[..., size]`` with the same leading dims: a state stacked by ``vmap`` is saved so)."""
    if type(buffers) not in (tuple, list):
        raise bad(f"its buffers are a {type(buffers).__name__}")
    if len(buffers) != len(sizes):
        raise bad(f"it has {len(buffers)} buffers, its layout {len(sizes)}")
    for k, (b, (dtype, size)) in enumerate(zip(buffers, sizes)):
        if not isinstance(b, Tensor) or b.layout != torch.strided or b.is_nested:
            raise bad(f"buffer {k} is not a strided tensor")
        if b.dtype != dtype or b.dim() < 1 or b.shape[-1] != size:
            raise bad(f"buffer {k} is {b.dtype} {list(b.shape)}, its layout gives {dtype} [{size}]")
        if b.shape[:-1] != buffers[0].shape[:-1] or b.device != buffers[0].device:
            first = buffers[0]
            raise bad(f"buffer {k} is {list(b.shape)} on {b.device}, buffer 0 {list(first.shape)} on {first.device}")


def _picker(leaves: tuple):
    """``leaves`` of a list, as a list, in C (an itemgetter) where they are more than one."""
    if len(leaves) == 1:
        i = leaves[0]
        return lambda xs: [xs[i]]
    get = operator.itemgetter(*leaves)
    return lambda xs: list(get(xs))


class PackedState:
    """The optimizer state of a tree of params in flat buffers (see the module's docstring).

    Attributes:
        buffers: the buffers, a tuple of 1-D tensors (``[members, n]`` where stacked by ``vmap``).
        meta: the :class:`PackedMeta`.
    """

    __slots__ = ("buffers", "meta", "_views")

    def __init__(self, buffers: Any, meta: PackedMeta):
        self.buffers = tuple(buffers)
        self.meta = meta
        self._views = None  # (buffers, their addresses, unpack(), its leaves): see plan_views

    def __reduce__(self):
        # the buffers and the meta's plain values (not the views kept for update_'s plan) through one function
        # registered with torch's safe globals, which checks them: a registered class could be filled in field by
        # field by a crafted file, with offsets or dtypes the kernels would address outside the buffers
        return _rebuild_packed, (self.buffers, *self.meta._plain())

    def plan_views(self) -> tuple[Any, list] | None:
        """``(tree, leaves)``: :meth:`unpack` and its state leaves, kept while the buffers are these very tensors at
        their memory, shapes and dtypes (an in-place step of the packed state runs as update_'s plan of these
        per-param views: the per-param state's launches). None where the buffers are stacked (vmap's) or not plain
        contiguous tensors, or without the compiled host checks."""
        held, bufs, twins = self._views, self.buffers, self.meta.buffer_twins
        if held is not None and held[0] is bufs and NATIVE.meta_match(bufs, twins, held[1]):
            return held[2], held[3]
        if NATIVE is None or not NATIVE.meta_match(bufs, twins):  # stacked, another size, not plain: see the checks
            return None
        tree = self.unpack()
        leaves = _flatten(tree, is_leaf=is_state)[0]
        self._views = (bufs, array.array("Q", map(Tensor.data_ptr, bufs)).tobytes(), tree, leaves)
        return tree, leaves

    def unpack(self) -> Any:
        """The per-param state (a state NamedTuple per leaf, in the params' structure) as views of the buffers:
        writes to either are seen by the other. Stacked buffers ``[members, n]`` give stacked fields."""
        meta = self.meta
        out: list = [None] * len(meta.shapes)
        for g in meta.groups:
            make = state_class(g.layout)._make
            bufs = self.buffers[g.first : g.first + len(g.offsets)]
            for k, i in enumerate(g.leaves):
                out[i] = make(_views_of(bufs, g, k, meta.shapes[i]))
        return _unflatten(out, meta.spec)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{b.dtype} {list(b.shape)}" for b in self.buffers)
        return f"PackedState({len(self.meta.shapes)} leaves, rule {self.meta.rule!r}, buffers: {shapes})"


pytree.register_pytree_node(
    PackedState,
    lambda s: (list(s.buffers), s.meta),
    lambda buffers, meta: PackedState(buffers, meta),
    serialized_type_name="bnbf.PackedState",
    flatten_with_keys_fn=lambda s: ([(pytree.SequenceKey(i), b) for i, b in enumerate(s.buffers)], s.meta),
)


def _field_shapes(layout: Layout, shape: torch.Size) -> list[tuple]:
    return [s for s, _ in layout.expected(torch.Size(shape)).values()]


def _views_of(bufs: tuple, g: PackedGroup, k: int, shape: torch.Size) -> list[Tensor]:
    """Leaf ``k`` of group ``g``: its fields as views of the buffers (leading dims of stacked buffers kept)."""
    return [
        b.narrow(-1, g.offsets[f][k], g.numels[f][k]).view((*b.shape[:-1], *s))
        for f, (b, s) in enumerate(zip(bufs, _field_shapes(g.layout, shape)))
    ]


def _group_views(bufs: list, g: PackedGroup, shapes: tuple) -> list[Tensor]:
    """Every field of every leaf of ``g`` in :func:`bnbf.kernels.launcher.build_group`'s order."""
    return [v for k, i in enumerate(g.leaves) for v in _views_of(tuple(bufs), g, k, shapes[i])]


def _aligned(n: int, itemsize: int) -> int:
    per = _ALIGN // itemsize
    return -(-n // per) * per


def pack_state(state: Any, param: Any) -> PackedState:
    """The per-param ``state`` of ``param`` (from :func:`bnbf.init_state`) as a :class:`PackedState` (a copy).

    Args:
        state: a state NamedTuple per leaf, in ``param``'s structure, all of one rule.
        param: the params the state is for (their dtypes decide the launch groups).

    Returns:
        A :class:`PackedState` whose :meth:`~PackedState.unpack` equals ``state``.

    Example:
        >>> import torch, bnbf
        >>> p = {"w": torch.zeros(4096), "b": torch.zeros(8)}
        >>> s = bnbf.pack_state(bnbf.init_state(p, bnbf.OptimSpec(rule="adamw")), p)
        >>> [tuple(b.shape) for b in s.buffers]  # w's 8-bit moments and their 16 scales, b's 32-bit moments
        [(4096,), (64,), (4096,), (64,), (64,), (64,)]
    """
    params, spec = _flatten(param)
    states, s_spec = _flatten(state, is_leaf=is_state)
    if not params:
        raise ValueError("pack_state needs at least one tensor")
    if s_spec != spec or not all(map(is_state, states)):
        raise ValueError("pack_state: the state's structure does not match the params' (one state per param)")
    for i, p in enumerate(params):
        if not isinstance(p, Tensor):
            _check_param(p, _names(param)[i])
    _check_leaves(param, params, states)
    rules = {s.layout.rule for s in states}
    if len(rules) > 1:
        raise ValueError(f"a packed state holds one rule's states, got {sorted(rules)} (use the per-param state)")
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(f"a packed state lives on one device, got params on {sorted(map(str, devices))}")
    if not any(len(s) for s in states):  # nothing to pack, and the packed step learns its device from the buffers
        raise ValueError(
            f"the {rules.pop()} rule keeps no state with these hyperparameters (SGD or LARS without momentum): a "
            f"packed state would have no buffers; use the per-param state (init_state without packed=True)"
        )
    by_kind: dict = {}
    for i, (p, s) in enumerate(zip(params, states)):
        by_kind.setdefault((p.dtype, s.layout), []).append(i)
    groups, sizes, pieces = [], [], []
    for (_, layout), leaves in by_kind.items():
        offsets, numels = [], []
        for f, (_, fdtype) in enumerate(layout.expected(torch.Size(params[leaves[0]].shape)).values()):
            itemsize = torch.empty((), dtype=fdtype).element_size()
            at, offs, ns, parts = 0, [], [], []
            for i in leaves:
                field = states[i][f]
                n = field.numel()
                offs.append(at)
                ns.append(n)
                pad = _aligned(n, itemsize) - n
                parts.append(field.detach().reshape(n))
                if pad:
                    parts.append(field.new_zeros(pad))
                at += n + pad
            offsets.append(tuple(offs))
            numels.append(tuple(ns))
            sizes.append((fdtype, at))
            pieces.append(parts)
        first = len(sizes) - len(offsets)
        groups.append(PackedGroup(layout, tuple(leaves), first, tuple(offsets), tuple(numels)))
    shapes = tuple(torch.Size(p.shape) for p in params)
    meta = PackedMeta(spec, shapes, tuple(p.dtype for p in params), rules.pop(), tuple(groups), tuple(sizes))
    buffers = []
    for parts in pieces:
        b = torch.cat(parts)
        _mark_static(b)
        buffers.append(b)
    return PackedState(buffers, meta)


# ---- the step -----------------------------------------------------------------------------------------------------


def update(param, grad, state: PackedState, hparams, step, skip_zeros, max_unorm, maximize, *, in_place: bool):
    """:func:`bnbf.update` (``in_place``: :func:`bnbf.update_`) of a packed state: every check first, then one op
    call per layout group. Returns ``(new_param, new_state)`` (in place: the inputs)."""
    meta = state.meta
    params, spec = _flatten(param)
    grads, g_spec = _flatten(grad)
    buffers = state.buffers
    if (torch.compiler.is_compiling() or not set(map(type, params)) <= ops._PLAIN_TYPES) and any(
        is_dtensor(p) for p in params
    ):
        raise ValueError("a packed state does not hold DTensor (FSDP2) params' state; use bnbf.distributed")
    _check_tree(param, params, spec, grads, g_spec, buffers, meta, in_place)
    if not in_place:  # (in place: _check_apart, every param against every param and buffer)
        _check_pure_apart(param, params, buffers, meta)
    rule = get_rule(meta.rule)
    layouts = [g.layout for g in meta.groups]
    compiling = torch.compiler.is_compiling()
    if compiling or _functorch.maybe_current_level() is not None:
        h = traced_hparams(param, params, grads, rule, hparams, step, max_unorm, layouts, in_place)
    else:
        check_not_differentiated(param, params, grads, hparams, step, max_unorm, layouts, in_place=in_place)
        h = rule.make_hparams(hparams)
        _check_present(rule, h, layouts)
        _check_step(step)
    values, clip = _scalars(rule, h, step, skip_zeros, max_unorm, maximize)
    device = buffers[0].device
    found = ops.vmap_level()
    direct = found is None and ops._direct(params, grads, buffers, buffers[0])
    if compiling or (direct and use_triton(buffers[0])):
        # Python numbers as kernel arguments (no upload), as the per-param state's eager calls pass them; traced,
        # graph values
        row = _one_set(values, device)
    else:
        row = scalar_row(values, device)
    if in_place and direct:
        with torch.no_grad():
            _step_direct_(param, params, grads, state, row, skip_zeros, clip)
        return param, state
    if in_place and found is not None and not compiling:  # every group's memory, before any group is written
        ops.check_vmapped_apart(
            params,
            grads,
            list(buffers),
            lambda bs: [tuple(bs)],
            lambda ps, gs, bs: _check_apart(param, ps, gs, None, buffers=bs),
        )
    new_params: list = [None] * len(params)
    new_buffers: list = [None] * len(buffers)
    with torch.no_grad():
        for gi, g in enumerate(meta.groups):
            if compiling:
                ps, gs = [params[i] for i in g.leaves], [grads[i] for i in g.leaves]
            else:
                ps, gs = meta.pick[gi](params), meta.pick[gi](grads)
            bufs = list(buffers[g.first : g.first + len(g.offsets)])
            if found is not None:  # each member its own state, all in one launch (batched tensors as they are)
                out = _vmapped(ps, gs, bufs, row, meta, gi, skip_zeros, clip, found, in_place=in_place)
            elif direct:  # eager and pure (in place: _step_direct_): straight to the launcher
                if not all(map(Tensor.is_contiguous, gs)):
                    gs = [x.contiguous() for x in gs]
                if not all(map(Tensor.is_contiguous, ps)):
                    ps = [p.contiguous() for p in ps]
                out = _impl(ps, gs, bufs, row, meta.key, gi, skip_zeros, clip)
            else:  # traced, or subclasses: the op's dispatch
                out = _dispatched(ps, gs, bufs, row, meta.key, gi, skip_zeros, clip, in_place)
            if in_place:
                continue
            out_p, out_b = out
            for k, i in enumerate(g.leaves):
                new_params[i] = out_p[k]
            new_buffers[g.first : g.first + len(out_b)] = out_b
    if in_place:
        return param, state
    return _unflatten(new_params, spec), PackedState(new_buffers, meta)


_SHAPE, _DTYPE, _DEVICE = operator.attrgetter("shape"), operator.attrgetter("dtype"), operator.attrgetter("device")


def _check_tree(param, params, spec, grads, g_spec, buffers, meta: PackedMeta, in_place: bool) -> None:
    """The params, grads and buffers fit the packed state: the tree's structure, each leaf's shape and dtype, one
    device, the buffers' sizes; the precise error of the first that does not (nothing has been written). Eager
    calls check all leaves in C-level maps first; a traced call checks each leaf (at trace time)."""
    if spec != meta.spec:
        raise ValueError(
            "the params' tree structure does not match the packed state's (it was built by init_state/pack_state "
            f"for {len(meta.shapes)} leaves in another structure): {spec} vs {meta.spec}"
        )
    if g_spec != spec:
        raise ValueError("grad must have the same structure as param")
    device = buffers[0].device if buffers and isinstance(buffers[0], Tensor) else None
    if len(buffers) != len(meta.sizes):
        raise ValueError(f"the packed state has {len(buffers)} buffers, its layout {len(meta.sizes)}")
    for k, (b, (dtype, n)) in enumerate(zip(buffers, meta.sizes)):
        if not isinstance(b, Tensor) or b.dtype != dtype or tuple(b.shape) != (n,) or b.device != device:
            what = f"{b.dtype} {list(b.shape)} on {b.device}" if isinstance(b, Tensor) else type(b).__name__
            hint = " (a state stacked by vmap is stepped under vmap)" if isinstance(b, Tensor) and b.dim() > 1 else ""
            raise ValueError(f"packed state buffer {k} is {what}, its layout needs {dtype} [{n}] on {device}{hint}")
        if not b.is_contiguous():
            raise ValueError(f"packed state buffer {k} must be contiguous")
    compiling = torch.compiler.is_compiling()
    fast = (  # plain and contiguous, the shapes and dtypes built for: in C
        not compiling
        and NATIVE is not None
        and NATIVE.meta_match(params, meta.twins)
        and NATIVE.grads_match(params, grads)
        and set(map(_DEVICE, params)) == {device}
    )
    if not fast and (
        compiling
        or not (
            all(map(isinstance, itertools.chain(params, grads), itertools.repeat(Tensor)))
            and tuple(map(_SHAPE, params)) == meta.shapes
            and tuple(map(_DTYPE, params)) == meta.dtypes
            and set(map(_DEVICE, params)) == {device}
            and _grads_ok(params, grads)
        )
    ):
        for i, (p, g) in enumerate(zip(params, grads)):
            fits = isinstance(p, Tensor) and p.shape == meta.shapes[i] and p.dtype == meta.dtypes[i]
            fits = fits and p.device == device and p.layout == torch.strided and isinstance(g, Tensor)
            if fits and g.layout == torch.strided and g.shape == p.shape and g.dtype == p.dtype and g.device == device:
                continue
            name = _names(param)[i]
            _check_param(p, name)
            if p.shape != meta.shapes[i] or p.dtype != meta.dtypes[i]:
                raise ValueError(
                    f"param{name} is {p.dtype} {list(p.shape)} but the packed state was built for "
                    f"{meta.dtypes[i]} {list(meta.shapes[i])}"
                )
            if p.device != device:
                raise ValueError(f"param{name} is on {p.device} but the packed state is on {device}")
            _check_grad(name, p, g)
    if in_place and not all(map(Tensor.is_contiguous, params)):
        i = next(i for i, p in enumerate(params) if not p.is_contiguous())
        raise ValueError(f"param{_names(param)[i]} must be contiguous to be stepped in place with a packed state")


def _step_direct_(param, params, grads, state: PackedState, row, skip_zeros, clip) -> None:
    """An eager ``update_`` of plain tensors: every group's params and buffers, and every grad, checked together
    before any group is written (params of two groups may share memory; a grad may be another group's param),
    then one step per group. On the Triton path the check runs when a launcher group is made or the groups or
    the grads' addresses differ from the last checked call's (the usual loop pays a comparison of addresses);
    the reference path checks every call, as it did per group."""
    meta, buffers = state.meta, state.buffers
    parts, dense = [], True
    for gi, g in enumerate(meta.groups):
        ps, gs = meta.pick[gi](params), meta.pick[gi](grads)
        if not all(map(Tensor.is_contiguous, gs)):
            gs, dense = [x.contiguous() for x in gs], False
        parts.append((ps, gs, list(buffers[g.first : g.first + len(g.offsets)])))
    device = buffers[0].device
    ops._refuse_capture(device, ops.PACKED_NOT_CAPTURABLE)
    if not use_triton(buffers[0]):
        _check_apart(param, params, grads, state)
        for gi, (ps, gs, bufs) in enumerate(parts):
            _run(ps, ps, gs, bufs, bufs, row, meta.key, gi, skip_zeros, clip, checked=True)
        return
    from bnbf.kernels.launcher import launch_group

    done: list = []

    def check() -> None:  # before a new launcher group is cached: the whole call's, so a cached group is apart
        if not done:
            _check_apart(param, params, grads, state)
            done.append(True)

    with BUILD_LOCK:
        groups = tuple(_group(ps, ps, bufs, bufs, meta, gi, check) for gi, (ps, _, bufs) in enumerate(parts))
        last, at = meta.checked
        # grads' spans are fixed by their addresses only where contiguous (shapes and dtypes are the params')
        same = dense and (at == tuple(map(Tensor.data_ptr, grads)) if NATIVE is None else NATIVE.ptrs_equal(grads, at))
        if not done and not (len(last) == len(groups) and all(map(operator.is_, groups, last))):
            check()  # groups cached by other calls: each group's memory was apart, not necessarily across them
        elif not done and not same:
            _check_apart(param, params, grads, state, disjoint=False)  # only the grads moved
        if not same:
            ptrs = tuple(map(Tensor.data_ptr, grads))
            at = (ptrs if NATIVE is None else ops._packed(ptrs)) if dense else None
        meta.checked = (groups, at)
    with launch_lock(device.type == "cpu"):
        for group, (_, gs, _) in zip(groups, parts):
            launch_group(group, gs, row, skip_zeros, clip)


def _check_apart(param, params: list, grads: list, state: PackedState | None, disjoint: bool = True, buffers=None):
    """What an in-place step of the packed state refuses, over every layout group at once (nothing written yet):
    params and buffers sharing memory (``disjoint``); a grad sharing memory with a param or a leaf's state, which
    the step writes while reading the grad (the per-param state's check, :func:`_check_grads_apart`).
    ``buffers``: the state's, where given (vmap's stacked ones, ``state`` None: a grad is named by the buffer)."""
    buffers = state.buffers if buffers is None else buffers
    if disjoint:
        pair = _overlap([*params, *buffers], [])  # all as params: spans measured where not contiguous
        if pair is not None:
            what = [f"param{n}" for n in _names(param)] + [f"packed state buffer {k}" for k in range(len(buffers))]
            raise ValueError(
                f"bnbf: {what[pair[0]]} and {what[pair[1]]} of this {_IN_PLACE} overlap in memory (views of one "
                "tensor?): each param and state is written on its own, so they must not share memory"
            )
    # against whole buffers first (cheap); then named by the leaves' parts, which are what the step writes
    pair = _grad_overlap(params, grads, [tuple(buffers)])
    if pair is None:
        return
    if state is not None:
        views = state.plan_views()
        _check_grads_apart(param, params, grads, views[1] if views else _flatten(state.unpack(), is_leaf=is_state)[0])
    names, (j, k) = _names(param), pair
    raise grad_shares_memory(
        f"grad{names[j]}", f"param{names[k]}" if k < len(params) else f"packed state buffer {k - len(params)}"
    )


def _check_pure_apart(param, params: list, buffers: tuple, meta: PackedMeta) -> None:
    """A pure step's refusal of params or buffers sharing memory, in the per-param state's words
    (:func:`_check_no_overlap`): a param twice would get two results, one buffer read as another (an exp_avg as its
    exp_avg_sq) steps to NaN. Addresses are compared for plain eager tensors only, in one pass over params and
    buffers (traced or batched ones have none: the same tensor twice)."""

    def name(k: int) -> str:
        if k < len(params):
            return f"param{_names(param)[k]}"
        b = k - len(params)
        g = next(g for g in meta.groups if g.first <= b < g.first + len(g.offsets))
        return f"packed state buffer {b} ({state_class(g.layout)._fields[b - g.first]})"

    n = len(params)
    addresses = (
        not torch.compiler.is_compiling()
        and _functorch.maybe_current_level() is None
        and set(map(type, itertools.chain(params, buffers))) <= ops._PLAIN_TYPES
    )
    if not addresses:
        check_no_repeats(param, params, [])
    pair = next(((n + i, n + j) for j, x in enumerate(buffers) for i in range(j) if buffers[i] is x), None)
    if pair is None and addresses:
        pair = _overlap([*params, *buffers], [])
    if pair is None:
        return
    i, j = pair
    if j < n:  # two params: named as the per-param state's update names them
        _check_no_overlap(param, params, [])
    if i == j:  # no storage at an address (a meta buffer beside a CPU param's: refused by the checks before)
        raise TypeError(f"{name(i)} has no storage the fused step can address")
    if i < n:
        raise ValueError(f"{name(i)} and {name(j)} overlap in memory: a param and a state must not share memory")
    raise ValueError(f"{name(i)} and {name(j)} overlap in memory: the states of one call must not share memory")


# ---- the ops and their dispatch -------------------------------------------------------------------------------------


def _dispatched(params, grads, buffers, hp, key, gi, skip_zeros, clip, in_place: bool):
    """One layout group's step through the ops' dispatch (traced calls, subclasses, vmap with nothing batched)."""
    grads = [x.detach().contiguous() for x in grads]
    if in_place:
        return _packed_step_op_(params, grads, buffers, hp, key, gi, skip_zeros, clip)
    params = [p.detach().contiguous() for p in params]
    return _packed_step_op(params, grads, buffers, hp, key, gi, skip_zeros, clip)


def _meta(key: int) -> PackedMeta:
    meta = _METAS.get(key)
    if meta is None:
        raise RuntimeError(f"bnbf: no live packed state has key {key} (its PackedState was freed)")
    return meta


def _impl(params, grads, buffers, hp, key, gi, skip_zeros, clip):
    new_params = list(map(torch.empty_like, params))
    new_buffers = list(map(torch.empty_like, buffers))
    _run(params, new_params, grads, buffers, new_buffers, hp, key, gi, skip_zeros, clip)
    _meta(key).zero_padding(gi, new_buffers)
    return new_params, new_buffers


def _run(p_in, p_out, grads, b_in, b_out, hp, key, gi, skip_zeros, clip, checked: bool = False) -> None:
    meta = _meta(key)
    g = meta.groups[gi]
    ops._refuse_capture(p_in[0].device, ops.PACKED_NOT_CAPTURABLE)
    if use_triton(p_in[0]):
        from bnbf.kernels.launcher import launch_group

        with BUILD_LOCK:
            group = _group(p_in, p_out, b_in, b_out, meta, gi)
        with launch_lock(p_in[0].device.type == "cpu"):
            launch_group(group, grads, hp, skip_zeros, clip)
        return
    if p_out is p_in and not checked:  # checked: _step_direct_ checked every group's memory together
        ops._check_disjoint(p_in, b_in, _IN_PLACE)
    s_in = _group_views(b_in, g, meta.shapes)
    s_out = s_in if b_out is b_in else _group_views(b_out, g, meta.shapes)
    reference_step(p_in, p_out, grads, s_in, s_out, ops._as_row(hp, p_in), g.layout, skip_zeros, clip)


def _parts(meta: PackedMeta, gi: int):
    """For :func:`bnbf.kernels.members.packed_group`: group ``gi``'s state tensors as views of stacked buffers
    ``(tensors, batched)``, their batched flags and each one's buffer (made only when a structure is)."""
    g = meta.groups[gi]
    per = len(g.offsets)

    def parts(B: tuple) -> tuple:
        bufs, batched = B
        owners = tuple(f for _ in g.leaves for f in range(per))
        return _group_views(bufs, g, meta.shapes), tuple(batched[f] for f in owners), owners

    return parts


def _group(p_in, p_out, b_in, b_out, meta: PackedMeta, gi: int, check=None):
    """The launcher group of an eager (or compiled) call: the members' machinery with one unbatched member, so that
    a call gathers only the params' and buffers' addresses (cached by them; no view of a buffer once made).
    In place, ``check`` (default: this group's overlap check) runs before a new group is made."""
    from bnbf.kernels.members import packed_group

    unbatched = (False,) * len(p_in)
    P = (p_in, unbatched)
    B = (b_in, (False,) * len(b_in))
    if p_out is p_in:
        if check is None:  # once per set of addresses: a hit is the same memory
            check = lambda: ops._check_disjoint(p_in, b_in, _IN_PLACE)  # noqa: E731
        return packed_group(P, P, B, B, _parts(meta, gi), (meta.key, gi), meta.groups[gi].layout, 1, check)
    out = ((p_out, unbatched), (b_out, B[1]))
    return packed_group(P, out[0], B, out[1], _parts(meta, gi), (meta.key, gi), meta.groups[gi].layout, 1)


@torch.library.custom_op("bnbf::packed_step_", mutates_args=("params", "buffers"))
def _packed_step_op_(
    params: list[Tensor], grads: list[Tensor], buffers: list[Tensor], hp: Tensor, key: int, group: int,
    skip_zeros: bool, clip: bool,
) -> None:  # fmt: skip
    _run(params, params, grads, buffers, buffers, hp, key, group, skip_zeros, clip)


@_packed_step_op_.register_fake
def _(params, grads, buffers, hp, key, group, skip_zeros, clip) -> None:
    return None


@torch.library.custom_op("bnbf::packed_step", mutates_args=())
def _packed_step_op(
    params: list[Tensor], grads: list[Tensor], buffers: list[Tensor], hp: Tensor, key: int, group: int,
    skip_zeros: bool, clip: bool,
) -> tuple[list[Tensor], list[Tensor]]:  # fmt: skip
    return _impl(params, grads, buffers, hp, key, group, skip_zeros, clip)


@_packed_step_op.register_fake
def _(params, grads, buffers, hp, key, group, skip_zeros, clip):
    return [torch.empty_like(p) for p in params], [torch.empty_like(b) for b in buffers]


def _step_in_place(params, grads, buffers, hp, key, group, skip_zeros, clip) -> None:
    ops._BUMP(params)
    ops._BUMP(buffers)
    _run(params, params, grads, buffers, buffers, hp, key, group, skip_zeros, clip)


# a compiled graph's calls of the ops on plain tensors: straight to the step (see ops.register_direct)
ops.register_direct(_packed_step_op_, "packed_step_", _step_in_place)
ops.register_direct(_packed_step_op, "packed_step", _impl)


# ---- vmap -----------------------------------------------------------------------------------------------------------


def _vmapped(params, grads, buffers, hp, meta, gi, skip_zeros, clip, found, *, in_place: bool):
    """The step under a ``vmap`` innermost: every member of the stacked params and buffers stepped as its own
    tensor and state (one launch on the Triton path), written into stacked outputs, or in place into the stacked
    inputs. Refused with a clear error where the inputs are still wrapped by an outer transform."""
    level, size = found
    (ps, p_dims), (gs, g_dims), (bs, b_dims) = (
        ops._unwrap(params, level),
        ops._unwrap(grads, level),
        ops._unwrap(buffers, level),
    )
    hp_u, h_dim = _functorch._unwrap_batched(hp, level)
    if h_dim is None and all(dims.count(None) == len(dims) for dims in (p_dims, g_dims, b_dims)):
        # nothing batched at this level (tensors the vmapped function closes over): a step as outside vmap
        return _dispatched(params, grads, buffers, hp, meta.key, gi, skip_zeros, clip, in_place)
    if not ops._unwrapped(ps, gs, bs, [hp_u]) or not ops._stackable(ps[0], h_dim):
        raise RuntimeError(
            "bnbf: a packed state under nested torch.func transforms (vmap of vmap, grad of vmap) is not supported; "
            "use the per-param state (init_state without packed=True)"
        )
    with torch._C._DisableFuncTorch():
        if in_place:
            unbatched = [k for k, d in enumerate(itertools.chain(p_dims, b_dims)) if d is None]
            if unbatched:
                raise RuntimeError(_UNBATCHED)
            wp, wb = ops._in_place(ps, p_dims), ops._in_place(bs, b_dims)
            if wp is None or wb is None:
                raise RuntimeError("bnbf: the in-place step under vmap needs each member of its params contiguous")
            P = (wp, (True,) * len(wp))
            B = (wb, (True,) * len(wb))
            out_P, out_B = P, B
        else:
            P, B = ops._stack(ps, p_dims), ops._stack(bs, b_dims)
            new_p, new_b = ops._outputs(P, size), ops._outputs(B, size)
            out_P, out_B = (new_p, (True,) * len(new_p)), (new_b, (True,) * len(new_b))
        G = ops._stack(gs, g_dims)
        if size:
            _launch_members(P, out_P, G, B, out_B, hp_u, h_dim, meta, gi, skip_zeros, clip, size, in_place)
            if not in_place:
                meta.zero_padding(gi, new_b)
    if in_place:
        return None
    add, zeros, levels = _functorch._add_batch_dim, itertools.repeat(0), itertools.repeat(level)
    return list(map(add, new_p, zeros, levels)), list(map(add, new_b, zeros, levels))


def _launch_members(P, out_P, G, B, out_B, hp, h_dim, meta, gi, skip_zeros, clip, size, in_place) -> None:
    g = meta.groups[gi]
    device = P[0][0].device
    ops._refuse_capture(device, ops.PACKED_NOT_CAPTURABLE)
    if in_place and ops._BUMP is not None:
        ops._BUMP(P[0])
        ops._BUMP(B[0])
    if not use_triton(P[0][0]):
        if in_place:
            ops._check_disjoint(P[0], B[0], "vmapped " + _IN_PLACE)
        S_in = _parts(meta, gi)(B)[:2]
        S_out = S_in if in_place else _parts(meta, gi)(out_B)[:2]
        ops._reference_members(P, out_P, G, S_in, S_out, hp, h_dim, g.layout, skip_zeros, clip, size)
        return
    from bnbf.kernels.launcher import launch_group
    from bnbf.kernels.members import packed_group, stacked_grads

    check = (lambda: ops._check_disjoint(P[0], B[0], "vmapped " + _IN_PLACE)) if in_place else None
    with BUILD_LOCK:
        group = packed_group(P, out_P, B, out_B, _parts(meta, gi), (meta.key, gi), g.layout, size, check)
        grad_list = stacked_grads(group, G, size)
    rows = ops._member_rows(hp, h_dim, len(P[0]), size)
    with launch_lock(device.type == "cpu"):
        launch_group(group, grad_list, hp if rows is None else rows, skip_zeros, clip)


def _packed_step_vmap(info, in_dims, params, grads, buffers, hp, key, group, skip_zeros, clip):
    """``vmap`` reached through the op's dispatch (vmap traced by torch.compile, inputs wrapped by another
    transform): one call of the pure op per member, stacked."""
    size = info.batch_size
    p_dims, g_dims, b_dims, h_dim = in_dims[:4]

    def member(ts, dims, b):
        return [t if d is None else t.select(d, b) for t, d in zip(ts, dims)]

    outs = [
        _packed_step_op(
            member(params, p_dims, b),
            member(grads, g_dims, b),
            member(buffers, b_dims, b),
            hp if h_dim is None else hp.select(h_dim, b),
            key,
            group,
            skip_zeros,
            clip,
        )  # fmt: skip
        for b in range(size)
    ]
    new_p = [torch.stack([o[0][i] for o in outs]) for i in range(len(params))]
    new_b = [torch.stack([o[1][k] for o in outs]) for k in range(len(buffers))]
    return (new_p, new_b), ([0] * len(new_p), [0] * len(new_b))


_packed_step_op.register_vmap(_packed_step_vmap)


_packed_step_op_.register_vmap(ops.in_place_vmap_rule(_packed_step_vmap, "a param or state buffer"))


# saved packed states load with torch.load's default weights_only=True, as per-param states do (bnbf.state), through
# the one function that checks them (not their classes, which a file could fill in unchecked)
torch.serialization.add_safe_globals([_rebuild_packed])

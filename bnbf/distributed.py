"""bnbf on torch.distributed: DTensor params (FSDP2's ``fully_shard``) and checkpoints that load on any mesh.

FSDP2 gives each rank its params as DTensors whose local tensor is one slice of rows (``Shard(0)``). Here
each rank keeps the state of its local shard only, as DTensors on the param's mesh, and one call of the
functional core steps all local shards (one fused launch per group on GPU, as on one GPU). A DTensor never
reaches a kernel: the core sees the local tensors, whose storage a kernel can address.

State of a sharded param (``W`` shards along the mesh dim that holds ``Shard(0)``):

- float32 states and 8-bit codes: DTensors with the param's mesh, placements and global shape;
- 8-bit block scales (``*_absmax``): a DTensor of global shape ``[W, blocks of the largest shard]``,
  ``Shard(0)`` on the param's shard dim (row r: shard r's scales, zero-padded). Each shard is quantized in
  blocks that start at its own first element, so where a shard starts inside a 256-element block every
  block of that shard is shifted against the unsharded tensor's (not bit-equal to it; a spike can share a
  block with elements it did not share one with unsharded). The stochastic rounding draws
  the dither of the unsharded tensor's blocks (each shard's first global block goes to the core,
  :func:`_first_blocks`): shards of whole blocks step bit for bit as the unsharded tensor.

:func:`state_dict` turns states into a mesh-independent form for ``torch.distributed.checkpoint``: codes as
above and, per 8-bit slot, the scales of the global blocks of the unsharded tensor (replicated, ``numel /
block_size`` floats). A shifted shard's codes are re-expressed in the global blocks' scales (the one
requantization of the round trip, in every block of such a shard); shards that hold whole blocks save and load
bit for bit, on any mesh. :func:`load_state_dict_` loads that form into states on any mesh, or unsharded.

Per-tensor norms (LAMB, LARS, ``max_unorm``) need sums over the whole tensor: a sharded step that reads them
sets the core's ``NORM_REDUCE`` hook to an all-reduce over the shard group, so every shard steps with the
whole tensor's norms (docs/DESIGN.md, Beyond one GPU).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import operator
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils import _pytree as pytree

import bnbf
from bnbf._dispatch import NORM_REDUCE, is_dtensor
from bnbf._host_checks import LeafName, _flatten, _unflatten, check_not_differentiated, clips, keystr
from bnbf.plan import fields_as_planned, fields_planned
from bnbf.quant import quantize_state_reference, state_map
from bnbf.reference import FIRST_BLOCKS
from bnbf.rules import get_rule
from bnbf.state import OptimSpec, State, _row, _rows_of, is_state, stack_groups
from bnbf.state import relaid as _relaid_plain

__all__ = [
    "Plan",
    "check_step",
    "dequantize_state",
    "init_state",
    "is_dtensor",
    "load_state_dict_",
    "plan",
    "relaid",
    "stacked",
    "state_dict",
    "update",
    "update_",
]


# --- where a rank's shard sits in the global tensor ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Shards:
    """How a DTensor param is split: ``world`` shards along mesh dim ``mesh_dim`` (None: replicated), this
    rank's shard ``index``, and per shard its first element and element count in the flattened tensor."""

    mesh: DeviceMesh
    placements: tuple
    mesh_dim: int | None
    world: int
    index: int
    starts: tuple[int, ...]
    counts: tuple[int, ...]

    @property
    def start(self) -> int:
        return self.starts[self.index]

    @property
    def count(self) -> int:
        return self.counts[self.index]

    @property
    def sharded(self) -> bool:
        return self.world > 1

    @functools.cached_property
    def scale_placements(self) -> tuple:
        """The placements of an 8-bit state's block scales: ``Shard(0)`` on the shard dim."""
        return tuple(_scale_placements(self))

    def scale_shape(self, block_size: int) -> torch.Size:
        """The global shape of an 8-bit state's block scales: a row per shard, padded to the largest."""
        return torch.Size((self.world, _blocks(max(self.counts), block_size)))


class _ById:
    """A cache keyed by the identity of live objects, holding them weakly: a lookup is a dict get and one
    weakref call (``WeakIdKeyDictionary`` builds a weakref per lookup, which cost more than the step's own
    host work across a model's params). An entry goes when its key object is freed."""

    def __init__(self):
        self._d: dict = {}

    def get(self, key: Any) -> Any:
        hit = self._d.get(id(key))
        return hit[1] if hit is not None and hit[0]() is key else None

    def __setitem__(self, key: Any, value: Any) -> None:
        self.put(key, value)

    def put(self, key: Any, value: Any, also: Any = ()) -> None:
        """``self[key] = value``, the entry also going when any object of ``also`` is freed (what ``value`` was
        made from: it must not keep their tensors alive after the caller has dropped them)."""
        k = id(key)
        d = self._d
        token = object()  # this entry's (ids are reused)

        def gone(_, k=k, d=d, token=token):  # drop the entry only if it is still this one
            if (e := d.get(k)) is not None and e[2] is token:
                d.pop(k, None)

        d[k] = (weakref.ref(key, gone), value, token, [weakref.ref(o, gone) for o in also])


class _Names:
    """The leaves' key paths as the core's messages print them (``['w']``, ``[1]``, ``['m'][0]``), worked out from
    ``make()`` at the first message that needs one: a step that raises nothing pays for none."""

    __slots__ = ("_make", "_names")

    def __init__(self, make: Any):
        self._make = make
        self._names = None

    def __getitem__(self, i: int) -> str:
        if self._names is None:
            self._names = self._make()
        return self._names[i]


def _names_of(tree: Any) -> _Names:
    return _Names(functools.partial(_names, tree))


def _names_of_spec(spec: Any, n: int) -> _Names:
    """The names of the ``n`` leaves of a structure (:func:`bnbf._host_checks._flatten`'s or pytree's spec)."""
    return _Names(lambda: _names(_unflatten(list(range(n)), spec)))


def _names_of_keys(keys: list) -> _Names:
    """The names of a flat dict's leaves (:mod:`bnbf.compose`'s groups: a :class:`bnbf._host_checks.LeafName` key
    is named by the leaf's key path in the caller's tree)."""
    return _Names(lambda: [keystr((pytree.MappingKey(k),)) for k in keys])


# DTensor param -> its _Shards (the split costs tens of microseconds to work out; a step needs it for every
# param). Weak on the key; an entry is used only while the param keeps its mesh, placements and shape.
_SHARDS = _ById()


def _shards(p: DTensor, names: _Names | None = None, i: int = 0, what: str = "param") -> _Shards:
    """The split of ``p``: only ``Replicate`` and at most one ``Shard(0)`` (FSDP2, HSDP), whose shards are
    contiguous element ranges of the flattened tensor; anything else raises, naming ``p`` as ``what`` and its
    leaf's name ``names[i]`` (nothing where ``names`` is None: a lone tensor or state)."""
    hit = _SHARDS.get(p)
    if hit is not None and hit[0] is p.device_mesh and hit[1] == p.placements and hit[2] == p.shape:
        return hit[3]
    made = _split(p, what + (names[i] if names is not None else ""))
    _SHARDS[p] = (p.device_mesh, p.placements, p.shape, made)
    return made


def _split(p: DTensor, where: str) -> _Shards:
    placements = tuple(p.placements)
    shard_dims = [i for i, pl in enumerate(placements) if not isinstance(pl, Replicate)]
    for i in shard_dims:
        pl = placements[i]
        if type(pl) is not Shard or pl.dim != 0:  # _StridedShard (a Shard) splits rows in another order
            raise NotImplementedError(
                f"{where} has placements {placements}: bnbf steps DTensors that are Replicate or Shard(0) "
                f"(FSDP2's layout); redistribute it first"
            )
    if len(shard_dims) > 1:
        raise NotImplementedError(f"{where} has placements {placements}: at most one Shard(0) is supported")
    shape = tuple(p.shape)
    numel = p.numel()
    if not shard_dims:
        return _Shards(p.device_mesh, placements, None, 1, 0, (0,), (numel,))
    mesh_dim = shard_dims[0]
    world = p.device_mesh.size(mesh_dim)
    index = p.device_mesh.get_local_rank(mesh_dim)
    rows = shape[0]
    per_row = numel // rows if rows else 0
    k = -(-rows // world)  # torch.chunk's split, as DTensor's Shard
    row0 = [min(r * k, rows) for r in range(world + 1)]
    starts = tuple(row0[r] * per_row for r in range(world))
    counts = tuple((row0[r + 1] - row0[r]) * per_row for r in range(world))
    local_shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    if offset[0] * per_row != starts[index] or torch.Size(local_shape).numel() != counts[index]:
        raise NotImplementedError(f"{where}: DTensor's Shard(0) split is not torch.chunk's; unsupported")
    return _Shards(p.device_mesh, placements, mesh_dim, world, index, starts, counts)


def _blocks(n: int, block_size: int) -> int:
    return -(-n // block_size)


def _scale_placements(sh: _Shards) -> list:
    return [Replicate() if i != sh.mesh_dim else Shard(0) for i in range(sh.mesh.ndim)]


# --- local views of DTensor states -------------------------------------------------------------------

# DTensor state field (codes or first float32 state) -> the local state NamedTuple of plain tensors, so
# repeated steps hand the core the same objects (its plan cache finds them by id), and what its scales' local
# tensors were (_scales_planned). Weak on the key: an entry goes with its state (and with any of its fields).
_LOCAL = _ById()


def _local_state(s: Any, sh: _Shards, names: _Names | None = None, i: int = 0) -> Any:
    """The state of the local shard (plain tensors sharing the DTensors' storage); ``names[i]``: the state's name,
    for messages."""
    if not s:  # a rule state with no slots (SGD without momentum)
        return s
    first = s[0]
    hit = _LOCAL.get(first)
    # the same DTensors with the same local tensors (a state rebuilt with _replace, or a field given new
    # memory, is looked at again), whose scales' local tensors are as the entry's views of them were taken
    if (
        hit is not None
        and len(hit[0]) == len(s)
        and all(map(_is_local_of, hit[0], s))
        and (hit[2] is None or fields_as_planned(*hit[2]))
    ):
        return hit[1]
    layout = type(s).layout
    fields = []
    for name, t in zip(s._fields, s):
        if not isinstance(t, DTensor):
            where = names[i] if names is not None else ""
            raise TypeError(f"state{where}.{name} of a DTensor param must be a DTensor, got {type(t).__name__}")
        local = t._local_tensor
        if layout.quantized and name.endswith("_absmax"):
            local = local[0, : _blocks(sh.count, layout.block_size)]  # this shard's row, without padding
        fields.append(local)
    made = type(s)(*fields)
    # the entry goes with any of the state's fields: a field replaced and dropped takes its local tensors along
    _LOCAL.put(first, (tuple(t._local_tensor for t in s), made, _scales_planned([s])), also=s[1:])
    return made


def _scales_planned(states: list) -> tuple | None:
    """``(scales, planned)`` for :func:`bnbf.plan.fields_as_planned`: per 8-bit DTensor state of ``states`` the local
    tensors of its scales, and their addresses, shapes and dtypes now (None where there are none). A local state holds
    views of them (its shard's row, unpadded): a ``resize_``, ``set_`` or ``as_strided_`` of one leaves the view on
    its old memory or layout, so the views are taken again where they changed."""
    scales = [
        tuple(t._local_tensor for name, t in zip(s._fields, s) if name.endswith("_absmax"))
        for s in states
        if s and type(s).layout.quantized
    ]
    return (scales, fields_planned(scales)) if scales else None


def _is_local_of(local: Tensor, t: Any) -> bool:
    return isinstance(t, DTensor) and t._local_tensor is local


def _wrap_state(local: Any, sh: _Shards, shape: torch.Size, stride: tuple) -> Any:
    """DTensor state of a param from the state of its local shard (the inverse of :func:`_local_state`)."""
    layout = type(local).layout
    fields = []
    for name, t in zip(local._fields, local):
        if layout.quantized and name.endswith("_absmax"):
            width = _blocks(max(sh.counts), layout.block_size)
            buf = t.new_zeros(1, width)
            buf[0, : t.numel()] = t
            fields.append(DTensor.from_local(buf, sh.mesh, _scale_placements(sh), run_check=False))
        else:
            fields.append(DTensor.from_local(t, sh.mesh, sh.placements, run_check=False, shape=shape, stride=stride))
    return type(local)(*fields)


# --- the functional core on DTensors -----------------------------------------------------------------


def init_state(param: Any, spec: OptimSpec, hparams: Any = None) -> Any:
    """:func:`bnbf.init_state` for params that may be DTensors: each rank builds the state of its shards only.

    Whether a tensor gets 8-bit state is decided by its global size (``spec.min_8bit_size``), so every
    rank and every mesh picks the layout an unsharded run would.

    Args:
        param: a tensor or pytree of tensors; DTensors must be ``Replicate`` or ``Shard(0)`` (FSDP2).
        spec, hparams: as for :func:`bnbf.init_state`.

    Returns:
        States in the structure of ``param``; a DTensor's state holds DTensors (module docstring).

    Example (on each rank, after ``fully_shard(model)``)::

        state = bnbf.distributed.init_state(dict(model.named_parameters()), bnbf.OptimSpec(rule="adamw"))
    """
    if not isinstance(spec, OptimSpec):
        raise TypeError(f"spec must be an OptimSpec, got {type(spec).__name__}")
    leaves, treespec = pytree.tree_flatten_with_path(param)
    if not any(isinstance(p, DTensor) for _, p in leaves):
        return bnbf.init_state(param, spec, hparams)
    names = _Names(lambda: [keystr(k) for k, _ in leaves])
    shards = [_shards(p, names, i) if isinstance(p, DTensor) else None for i, (_, p) in enumerate(leaves)]
    # the layout of the global tensor: min_8bit_size compared with the global numel, not the shard's
    big = dataclasses.replace(spec, min_8bit_size=0)
    small = dataclasses.replace(spec, state_bits=32)
    # keyed by LeafName, so that the core's messages name each leaf by its key path in ``param``
    local = {_leaf_key(i, k): p.to_local() if isinstance(p, DTensor) else p for i, (k, p) in enumerate(leaves)}
    keys = list(local)
    out = [None] * len(leaves)
    for variant in (big, small):
        idx = [i for i, (_, p) in enumerate(leaves) if (p.numel() >= spec.min_8bit_size) == (variant is big)]
        if idx:
            made = bnbf.init_state({keys[i]: local[keys[i]] for i in idx}, variant, hparams)
            for i, s in zip(idx, made.values()):
                out[i] = s
    for i, (_, p) in enumerate(leaves):
        if shards[i] is not None:
            out[i] = _wrap_state(out[i], shards[i], p.shape, p.stride())
    return pytree.tree_unflatten(out, treespec)


def _leaf_key(i: int, keypath: tuple) -> LeafName:
    """A unique key for leaf ``i`` of a flat dict handed to the core, by which its messages name the leaf
    ``keypath``."""
    key = LeafName(i)
    key.keypath = keypath
    return key


def relaid(state: Any, stacks: tuple | None) -> Any:
    """:func:`bnbf.state.relaid` for the state of a DTensor param (unpaged: paged state of DTensor params is
    refused): a copy whose local fields of each stack are rows of one tensor (the scales' rows ``[1, padded]``,
    as :func:`init_state` pads them), wrapped as before, so that :func:`stacked` can show a stack as one
    DTensor (bnbf_nn's bitsandbytes ``state1`` of AdEMAMix). A plain state goes to :func:`bnbf.state.relaid`.

    Args:
        state: a state from :func:`init_state`.
        stacks: tuples of the rule's slot indices, e.g. ``((0, 1), (2,))``.

    Returns:
        The new state (same values, new storage).

    Example (on each rank)::

        s = bnbf.distributed.relaid(bnbf.distributed.init_state(p, spec), ((0, 1), (2,)))
    """
    like = _param_like(state)
    if not isinstance(like, DTensor):
        return _relaid_plain(state, stacks)
    sh = _shards(like, what="state")
    layout = type(state).layout
    rule = get_rule(layout.rule)
    groups = stack_groups(layout, stacks)
    old = dict(zip(state._fields, state))
    shape = tuple(like._local_tensor.shape)
    fields = {}
    with torch.no_grad():
        for g in groups:
            names = [rule.states[j].name for j in g]
            kinds = [(names, shape, old[names[0]]._local_tensor.dtype)]  # float64 differentiable state kept
            if layout.quantized:  # the scales' local [1, padded] rows, as init_state makes them
                pad = tuple(old[names[0] + "_absmax"]._local_tensor.shape)
                kinds.append(([n + "_absmax" for n in names], pad, torch.float32))
            for ns, sz, dt in kinds:
                size, dtype = _rows_of(len(g), sz, dt)
                buf = torch.empty(size, dtype=dtype, device=like.device)
                for i, n in enumerate(ns):
                    fields[n] = _row(buf, i, sz, len(g))
                    fields[n].copy_(old[n]._local_tensor)
    out = []
    for n in state._fields:
        t = fields[n]
        if layout.quantized and n.endswith("_absmax"):
            out.append(DTensor.from_local(t, sh.mesh, _scale_placements(sh), run_check=False))
        else:
            out.append(
                DTensor.from_local(t, sh.mesh, sh.placements, run_check=False, shape=like.shape, stride=like.stride())
            )
    return type(state)(*out)


def stacked(rows: Tensor, field: DTensor) -> DTensor:
    """A stack of DTensor state fields as one DTensor: ``rows`` (``[k, *local shape]``, a view whose row i is
    the local tensor of field i, see :func:`relaid`) with global shape ``(k, *field.shape)``; each ``Shard(d)``
    of the fields becomes ``Shard(d + 1)``. Writing it writes the fields.

    Args:
        rows: the local rows, stacked (a view of the fields' storage).
        field: one of the stacked fields (its mesh, placements and global shape).

    Returns:
        The DTensor.

    Example (bnbf_nn's ``state1`` of AdEMAMix under FSDP2)::

        state1 = bnbf.distributed.stacked(rows, state.exp_avg)
    """
    placements = [Shard(pl.dim + 1) if isinstance(pl, Shard) else pl for pl in field.placements]
    shape = torch.Size((rows.shape[0], *field.shape))
    return DTensor.from_local(
        rows, field.device_mesh, placements, run_check=False, shape=shape, stride=_contiguous_stride(shape)
    )


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    out, n = [], 1
    for d in reversed(shape):
        out.append(n)
        n *= max(d, 1)
    return tuple(reversed(out))


def _localize(params: list, grads: list, states: list, names: _Names) -> tuple[list, list, list, list]:
    """Local tensors of every leaf; checks the DTensor leaves (all before anything is written)."""
    if not (len(params) == len(grads) == len(states)):
        raise ValueError(f"got {len(params)} params, {len(grads)} grads and {len(states)} states")
    lp, lg, ls, shards = [], [], [], []
    for i, (p, g, s) in enumerate(zip(params, grads, states)):
        sh = _check_leaf(names, i, p, g, s)
        local = (
            (p, g, s, None)
            if sh is None
            else (p._local_tensor, _local_grad(names, i, p, g, sh), _local_state(s, sh), sh)
        )
        for out, x in zip((lp, lg, ls, shards), local):
            out.append(x)
    return lp, lg, ls, shards


def _check_leaf(names: _Names, i: int, p: Any, g: Any, s: Any) -> _Shards | None:
    """A leaf's checks but a DTensor param's grad's (:func:`_check_grad`), from metadata alike on every rank: a
    DTensor param's split and state, a plain param's plain grad and state. Returns the DTensor param's split
    (None for a plain param). ``names[i]``: the leaf's name, for messages."""
    if not is_state(s):
        raise TypeError(f"state{names[i]} must be a bnbf state, got {type(s).__name__}")
    if not isinstance(p, DTensor):
        if isinstance(g, DTensor) or any(isinstance(t, DTensor) for t in s):
            raise TypeError(
                f"param{names[i]}: got mixed torch.Tensor and DTensor (a plain param needs a plain grad and state)"
            )
        return None
    sh = _shards(p, names, i)
    _check_state(names, i, p, s, sh)
    return sh


def _local_views(
    params: list, grads: list, states: list, groups: list, max_unorm: Any, keys: list
) -> tuple[list, list, list]:
    """For :func:`bnbf.compose.update_`, which checks every group of a call before the first steps (each group
    then steps through :func:`update_`): every leaf checked as :func:`update_` checks it and each group's norms as
    :func:`check_step`, with no collective; then each leaf's local tensors, for the core's checks of memory (a
    grad in other placements, ``Partial``: the local tensor its redistribution will read). ``keys``: the leaves'
    keys in the groups' dicts (:func:`_names_of_keys`), for messages."""
    names = _names_of_keys(keys)
    shards = []
    for i, (p, g, s) in enumerate(zip(params, grads, states)):
        sh = _check_leaf(names, i, p, g, s)
        if sh is not None:
            _check_grad(names, i, p, g, sh)
        shards.append(sh)
    for _, idx in groups:
        check_step([params[i] for i in idx], type(states[idx[0]]).layout.rule, max_unorm)
    lp = [p if sh is None else p._local_tensor for p, sh in zip(params, shards)]
    lg = [g if sh is None else g._local_tensor for g, sh in zip(grads, shards)]
    ls = [s if sh is None else _local_state(s, sh) for s, sh in zip(states, shards)]
    return lp, lg, ls


def _check_grad(names: _Names, i: int, p: DTensor, g: Any, sh: _Shards) -> None:
    """A DTensor param's grad: a DTensor on the param's mesh, of its global shape (the local shapes of a (301,)
    grad and a (300,) param agree on one rank of two and not on the other)."""
    if not isinstance(g, DTensor):
        raise TypeError(f"grad{names[i]}: got mixed torch.Tensor and DTensor (a DTensor param needs a DTensor grad)")
    mesh = g.device_mesh
    if mesh is not sh.mesh and mesh != sh.mesh:  # `is` first: DeviceMesh's == compares its whole layout
        raise ValueError(f"grad{names[i]} is on another device mesh than its param")
    if g._spec.shape != p._spec.shape:  # the specs': DTensor.shape costs 3x as much (~0.1 us a leaf)
        raise ValueError(f"grad{names[i]} has shape {tuple(g.shape)} but the param has shape {tuple(p.shape)}")


def _local_grad(names: _Names, i: int, p: DTensor, g: Any, sh: _Shards) -> Tensor:
    """The local tensor of a DTensor param's grad, in the param's placements, after its checks."""
    _check_grad(names, i, p, g, sh)
    if g.placements != sh.placements:
        # e.g. a Partial grad: reduce it to the param's placements (a collective every rank makes)
        g = g.redistribute(sh.mesh, sh.placements)
    # the local tensor itself: to_local() is an autograd Function (tens of microseconds a leaf), and the
    # step reads the grad outside autograd
    return g._local_tensor


# DTensor state field (the first) -> weak references to the state's fields and the split they were found to fit:
# the same DTensors keep their mesh, global shapes and placements, so a loop's state is checked once per param
_FITS = _ById()


def _check_state(names: _Names, i: int, p: DTensor, s: Any, sh: _Shards) -> None:
    """State ``s`` fits DTensor param ``p`` (split ``sh``) on every rank alike: DTensors on its mesh, of its global
    shape and placements (the block scales: a row per shard). The core's check of the local shapes could pass on
    one rank (a state made for a (300,) param given to a (301,) one) and raise on another."""
    hit = _FITS.get(s[0]) if s else None
    if hit is not None and hit[1] is sh and len(hit[0]) == len(s) and all(map(operator.is_, map(_CALL, hit[0]), s)):
        return
    mesh = p.device_mesh
    if any(not isinstance(t, DTensor) or (t.device_mesh is not mesh and t.device_mesh != mesh) for t in s):
        raise TypeError(f"state{names[i]} of a DTensor param must hold DTensors on the param's mesh (from init_state)")
    layout = type(s).layout
    for name, t in zip(s._fields, s):
        if layout.quantized and name.endswith("_absmax"):
            shape, placements = sh.scale_shape(layout.block_size), sh.scale_placements
        else:
            shape, placements = p.shape, sh.placements
        if t.shape != shape or t.placements != placements:
            raise ValueError(
                f"state{names[i]}.{name} does not fit the param: expected global shape {tuple(shape)} with placements "
                f"{placements}, got {tuple(t.shape)} with {t.placements} (was the state built for another param "
                f"or spec?)"
            )
    if s:
        _FITS[s[0]] = (tuple(map(weakref.ref, s)), sh)


_CALL = weakref.ref.__call__


def _norms_needed(rule: Any, max_unorm: Any) -> bool:
    """Whether a step reads per-tensor norms (the rule's own, or max_unorm's clipping)."""
    clip = clips(max_unorm)
    return rule is not None and (rule.norms is not None or clip)


def _norm_reduce(shards: list, rule: Any, max_unorm: Any) -> Any:
    """The all-reduce that makes the shards' norm sums the whole tensors' (None where none is needed):
    every sharded tensor of the call on one process group, and no unsharded tensor beside them."""
    sharded = [sh for sh in shards if sh is not None and sh.sharded]
    if not sharded or not _norms_needed(rule, max_unorm):
        return None
    what = f"{rule.name} scales its step by per-tensor norms" if rule.norms else "max_unorm needs per-tensor norms"
    groups = {id(sh.mesh.get_group(sh.mesh_dim)): sh.mesh.get_group(sh.mesh_dim) for sh in sharded}
    if len(groups) > 1 or len(sharded) != len(shards):
        raise NotImplementedError(
            f"{what}: step sharded params together only with params sharded over the same process group "
            f"(make separate calls)"
        )
    (group,) = groups.values()
    return functools.partial(dist.all_reduce, group=group)


def check_grads(params: list, grads: list) -> None:
    """Raise, before anything is written, what a step of ``params`` with ``grads`` refuses of them before reading
    them: a DTensor param's split (placements other than Replicate and one Shard(0)), and its grad's type, mesh
    and global shape (a grad of None is skipped). For a caller that steps several calls (bnbf_nn's param groups)
    and must refuse a later call's input before an earlier call writes; no collective."""
    names = _names_of(params)
    for i, (p, g) in enumerate(zip(params, grads)):
        if g is not None and isinstance(p, DTensor):
            _check_grad(names, i, p, g, _shards(p, names, i))


def check_step(params: Any, rule: Any, max_unorm: Any = 0.0) -> None:
    """Raise, before anything is written, where a step of ``params`` (one core call) with ``rule`` would need
    whole-tensor norms it cannot reduce across the mesh (see :func:`update_`'s Raises); else do nothing.

    Args:
        params: a tensor or pytree of tensors, some of which may be DTensors.
        rule: a rule name (``"lamb"``) or a registered rule.
        max_unorm: as for :func:`update_` (``> 0`` reads per-tensor norms).

    Example (an optimizer that steps later checks all its groups first)::

        bnbf.distributed.check_step(list(model.parameters()), "lamb")
    """
    rule = get_rule(rule) if isinstance(rule, str) else rule
    if not _norms_needed(rule, max_unorm):
        return
    leaves = pytree.tree_leaves(params)
    names = _names_of(params)
    shards = [_shards(p, names, i) if isinstance(p, DTensor) else None for i, p in enumerate(leaves)]
    _norm_reduce(shards, rule, max_unorm)


def _first_blocks(params: list, states: list, shards: list) -> dict | None:
    """``{local param's data_ptr: global index of its first block}`` for the 8-bit shards that do not start at
    element 0 (None if none): the core draws their stochastic rounding's dither for the unsharded tensor's
    blocks they hold (:data:`bnbf.reference.FIRST_BLOCKS`), so shards of whole blocks step exactly as the
    unsharded tensor. A shard starting inside a block takes the block it starts in (its blocks are its own,
    not the unsharded tensor's, see the module docstring)."""
    out = {}
    for p, s, sh in zip(params, states, shards):
        if sh is not None and sh.start and sh.count and is_state(s) and type(s).layout.quantized:
            out[p.data_ptr()] = sh.start // type(s).layout.block_size
    return out or None


@contextlib.contextmanager
def _reducing(reduce: Any, first_blocks: dict | None = None):
    """While the block runs: the core's norm sums all-reduced by ``reduce`` (nothing where it is None), and the
    shards' first blocks given to the dither (:func:`_first_blocks`)."""
    reduce_token = NORM_REDUCE.set(reduce) if reduce is not None else None
    blocks_token = FIRST_BLOCKS.set(first_blocks) if first_blocks is not None else None
    try:
        yield
    finally:
        if blocks_token is not None:
            FIRST_BLOCKS.reset(blocks_token)
        if reduce_token is not None:
            NORM_REDUCE.reset(reduce_token)


def _rule(states: list) -> Any:
    """The rule of the states (the core checks that they agree); None for no states."""
    return get_rule(type(states[0]).layout.rule) if states and is_state(states[0]) else None


def _several_rules(states: list) -> bool:
    """Whether the states are of several rules: one core call would step them all in the norm context of the
    first one's rule (a LAMB state after an AdamW one: its norms summed over the shard only, silently)."""
    kinds = set(map(type, states))  # a few classes, by a C-level pass
    return len(kinds) > 1 and len({k.layout.rule for k in kinds if issubclass(k, State)}) > 1


def _leaves(param: Any, grad: Any, state: Any) -> tuple[list, Any, list, list]:
    # flat dicts and lists skip the pytree walk; any mismatch is looked at again by pytree, whose messages
    # and leaf checks stay those of the generic trees
    params, spec = _flatten(param)
    grads, g_spec = _flatten(grad)
    states, s_spec = _flatten(state, is_leaf=is_state)
    if spec == g_spec == s_spec:
        return params, spec, grads, states
    params, spec = pytree.tree_flatten(param)
    grads, g_spec = pytree.tree_flatten(grad)
    states, s_spec = pytree.tree_flatten(state, is_leaf=is_state)
    if g_spec != spec:
        raise ValueError("grad must have the structure of param")
    if s_spec != spec:
        raise ValueError("state must have the structure of param (from init_state)")
    return params, spec, grads, states


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
) -> tuple[Any, Any]:
    """:func:`bnbf.update_` for params that may be DTensors: steps every local shard in one core call.

    Args:
        param, grad, state: as for :func:`bnbf.update_`; a DTensor param takes a DTensor grad on its mesh
            (another placement, e.g. ``Partial``, is redistributed to the param's) and a state from
            :func:`init_state`.
        hparams, step, skip_zeros, max_unorm, maximize: as for :func:`bnbf.update_`.

    Returns:
        ``(param, state)``, the same objects, updated in place.

    Raises:
        NotImplementedError: for DTensors that are not ``Replicate``/``Shard(0)``; for LAMB, LARS or
            ``max_unorm > 0`` on sharded params on several process groups, or beside unsharded params in one
            call.

    Example (on each rank, after ``loss.backward()`` under FSDP2)::

        params = dict(model.named_parameters())
        bnbf.distributed.update_(params, {k: p.grad for k, p in params.items()}, state, {"lr": 1e-3}, step=1)
    """
    params, spec, grads, states = _leaves(param, grad, state)
    if not any(isinstance(p, DTensor) for p in params):
        return bnbf.update_(
            param, grad, state, hparams, step, skip_zeros=skip_zeros, max_unorm=max_unorm, maximize=maximize
        )
    if _several_rules(states):  # a call per rule (bnbf.compose), each through here in its own norm context
        return bnbf.compose.update_(
            param, grad, state, hparams, step, skip_zeros=skip_zeros, max_unorm=max_unorm, maximize=maximize
        )
    # the local shards carry no history: a gradient asked through DTensors is refused here, as for plain tensors
    if not torch.compiler.is_compiling():  # traced: the core's traced checks see the transform
        check_not_differentiated(param, params, grads, hparams, step, max_unorm, states, in_place=True)
    opts = {"skip_zeros": skip_zeros, "max_unorm": max_unorm, "maximize": maximize}
    _local_call(bnbf.update_, param, spec, params, grads, states, hparams, step, opts)
    return param, state


def _local_call(fn: Any, param: Any, spec: Any, params: list, grads: list, states: list, *args: Any) -> tuple:
    """``fn`` (:func:`bnbf.update_` or :func:`bnbf.update`) of the leaves' local tensors (checked), in the norm
    context their shards need; ``args``: hparams, step and the options' dict. Returns ``fn``'s result and the
    shards. The local tensors go in the structure of ``param``, so the core's messages name a leaf by its key
    path there."""
    hparams, step, opts = args
    lp, lg, ls, shards = _localize(params, grads, states, _names_of(param))
    with _reducing(_norm_reduce(shards, _rule(states), opts["max_unorm"]), _first_blocks(lp, ls, shards)):
        out = fn(_unflatten(lp, spec), _unflatten(lg, spec), _unflatten(ls, spec), hparams, step, **opts)
    return out, shards


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
) -> tuple[Any, Any]:
    """:func:`bnbf.update` (pure) for params that may be DTensors; arguments and errors as :func:`update_`.

    Returns:
        ``(new_param, new_state)``: new DTensors with the inputs' meshes and placements.
    """
    params, spec, grads, states = _leaves(param, grad, state)
    if not any(isinstance(p, DTensor) for p in params):
        return bnbf.update(
            param, grad, state, hparams, step, skip_zeros=skip_zeros, max_unorm=max_unorm, maximize=maximize
        )
    if _several_rules(states):
        return bnbf.compose.update(
            param, grad, state, hparams, step, skip_zeros=skip_zeros, max_unorm=max_unorm, maximize=maximize
        )
    if not torch.compiler.is_compiling():
        check_not_differentiated(param, params, grads, hparams, step, max_unorm, states, in_place=False)
    opts = {"skip_zeros": skip_zeros, "max_unorm": max_unorm, "maximize": maximize}
    (new_p, new_s), shards = _local_call(bnbf.update, param, spec, params, grads, states, hparams, step, opts)
    new_p, new_s = _flatten(new_p)[0], _flatten(new_s, is_leaf=is_state)[0]
    out_p, out_s = [], []
    for p, sh, np_, ns in zip(params, shards, new_p, new_s):
        if sh is None:
            out_p.append(np_), out_s.append(ns)
            continue
        out_p.append(DTensor.from_local(np_, sh.mesh, sh.placements, run_check=False, shape=p.shape, stride=p.stride()))
        out_s.append(_wrap_state(ns, sh, p.shape, p.stride()))
    return _unflatten(out_p, spec), _unflatten(out_s, spec)


class Plan:
    """:class:`bnbf.Plan` of the local shards of DTensor params (see :func:`plan`).

    Pickled (``torch.save``, ``copy.deepcopy``) it is a plan of the copies of its params and states, made anew where
    it is loaded, as :class:`bnbf.Plan` is: a checkpoint of one rank holding it beside them loads with ``torch.load``'s
    default (``weights_only=True``), as their DTensors do, on that rank of the same process groups."""

    def __init__(self, params: Any, state: Any):
        leaves, self._spec = _flatten(params)
        states, s_spec = _flatten(state, is_leaf=is_state)
        self._fast = s_spec == self._spec  # flat containers: step flattens the grads the same quick way
        if not self._fast:
            leaves, self._spec = pytree.tree_flatten(params)
            states, s_spec = pytree.tree_flatten(state, is_leaf=is_state)
        if s_spec != self._spec:
            raise ValueError("state must have the structure of params (from init_state)")
        # the leaves' names, for messages: from the structure, which the plan keeps (not the caller's containers)
        self._names = names = _names_of_spec(self._spec, len(leaves))
        self._shards = [_shards(p, names, i) if isinstance(p, DTensor) else None for i, p in enumerate(leaves)]
        for i, (p, st, sh) in enumerate(zip(leaves, states, self._shards)):
            if not is_state(st):
                raise TypeError(f"state{names[i]} must be a bnbf state, got {type(st).__name__}")
            if sh is not None:
                _check_state(names, i, p, st, sh)
            elif any(isinstance(t, DTensor) for t in st):
                raise TypeError(
                    f"state{names[i]}: got mixed torch.Tensor and DTensor (a plain param needs a plain state)"
                )
        self.rule = get_rule(type(states[0]).layout.rule) if states else None
        self._params, self._states = leaves, states
        self._setup()

    def _setup(self) -> None:
        """The core's plan of the local shards, and what a step confirms of the scales' local tensors, whose views it
        steps; nothing is kept where the core refuses them."""
        shards = self._shards
        local_p = [p if sh is None else p._local_tensor for p, sh in zip(self._params, shards)]
        local_s = [s if sh is None else _local_state(s, sh) for s, sh in zip(self._states, shards)]
        found = _first_blocks(local_p, local_s, shards)
        with _reducing(None, found):  # the tables carry the shards' first blocks
            # in the structure of ``params``: the core's messages name a leaf by its key path there
            made = bnbf.plan(_unflatten(local_p, self._spec), _unflatten(local_s, self._spec))
        self._plan = made
        # (leaf, first block) of the shards that have one: found again by the local tensors' addresses each step
        self._blocks = [(i, found[p.data_ptr()]) for i, p in enumerate(local_p) if found and p.data_ptr() in found]
        self._scales = _scales_planned([s for s, sh in zip(self._states, shards) if sh is not None])

    def __reduce__(self) -> tuple:
        # pickle, copy.deepcopy and copy.copy: a plan of the params and states it holds, made anew (their memo keeps
        # them the very objects the rest of the copy refers to); its views and tables are of this process's memory.
        # Through a function registered with torch's safe globals, as bnbf.Plan is
        return (_rebuild_plan, (_unflatten(self._params, self._spec), _unflatten(self._states, self._spec)))

    def _first_blocks(self) -> dict | None:
        return {self._params[i]._local_tensor.data_ptr(): b for i, b in self._blocks} or None

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
        """One in-place step: :func:`update_` of the planned params and states (arguments as there)."""
        flat, g_spec = _flatten(grads) if self._fast else pytree.tree_flatten(grads)
        if g_spec != self._spec:
            raise ValueError("grads must have the structure of the plan's params")
        if self._scales is not None and not fields_as_planned(*self._scales):
            self._setup()  # the scales' views taken again and planned, raising as a new plan of them would
        local = []
        names = self._names
        for i, (p, g, sh) in enumerate(zip(self._params, flat, self._shards)):
            if sh is None:
                if isinstance(g, DTensor):
                    raise TypeError(
                        f"grad{names[i]}: got mixed torch.Tensor and DTensor (a plain param needs a plain grad)"
                    )
                local.append(g)
                continue
            local.append(_local_grad(names, i, p, g, sh))
        with _reducing(_norm_reduce(self._shards, self.rule, max_unorm), self._first_blocks()):
            self._plan.step(
                _unflatten(local, self._spec),
                hparams,
                step,
                skip_zeros=skip_zeros,
                max_unorm=max_unorm,
                maximize=maximize,
            )


def plan(params: Any, state: Any) -> Plan:
    """:func:`bnbf.plan` for params that may be DTensors: checked once, then ``plan.step(grads, hparams,
    step)`` steps every local shard in one core call per step (an optimizer that holds its params, such as
    a ``torch.optim`` adapter, keeps one).

    Args:
        params: a tensor or pytree of tensors; DTensors ``Replicate`` or ``Shard(0)`` (FSDP2).
        state: from :func:`init_state`, same structure.

    Returns:
        A :class:`Plan`.

    Example (on each rank, after ``fully_shard(model)``)::

        params = dict(model.named_parameters())
        opt = bnbf.distributed.plan(params, bnbf.distributed.init_state(params, bnbf.OptimSpec(rule="adamw")))
        opt.step({k: p.grad for k, p in params.items()}, {"lr": 1e-3}, step=1)
    """
    return Plan(params, state)


def _rebuild_plan(params: Any, state: Any) -> Plan:
    """A pickled plan (:meth:`Plan.__reduce__`): the plan of the loaded params and states, made as :func:`plan` makes
    one, after each loaded DTensor is found to be what its metadata says (torch's loader takes a DTensor as written):
    on a mesh where this process has the coordinate it was saved with, its local tensor of the shape its global
    shape and placements give there. ``ValueError`` naming the first problem."""
    try:
        meshes: dict = {}
        for t in pytree.tree_leaves((params, state)):
            if isinstance(t, DTensor):
                _check_loaded(t, meshes)
        return Plan(params, state)
    # plan()'s refusals, and what a mesh or placements a file made up raise when read
    except (TypeError, ValueError, NotImplementedError, AttributeError, IndexError, KeyError, RuntimeError) as e:
        raise ValueError(f"a pickled bnbf.distributed Plan does not load: {e}") from e


torch.serialization.add_safe_globals([_rebuild_plan])


def _check_loaded(t: DTensor, meshes: dict) -> None:
    """A loaded DTensor's mesh holds this process where it was saved (a rank's file loaded by that rank; ``meshes``:
    the meshes found so, by id), and its local tensor is the shard its global shape and placements describe."""
    mesh = t.device_mesh
    if id(mesh) not in meshes:
        if not dist.is_initialized():  # the split of a shard reads its process group
            raise ValueError(
                "its DTensors' process groups are not made in this process: call "
                "torch.distributed.init_process_group before torch.load, as before saving"
            )
        found = (mesh.mesh == dist.get_rank()).nonzero()
        here = tuple(found[0].tolist()) if found.numel() else None
        if here != mesh.get_coordinate():
            raise ValueError(
                f"its DTensors were saved at mesh coordinate {mesh.get_coordinate()}, rank {dist.get_rank()} is "
                f"at {here} (a rank loads the file it saved)"
            )
        meshes[id(mesh)] = mesh  # held: an id is not reused while the loop runs
    want = torch.Size(compute_local_shape_and_global_offset(t.shape, mesh, t.placements)[0])
    if t._local_tensor.shape != want:
        raise ValueError(
            f"a DTensor of global shape {tuple(t.shape)} with placements {t.placements} holds a local tensor of "
            f"shape {tuple(t._local_tensor.shape)}, not {tuple(want)}"
        )


def _param_like(s: Any) -> Any:
    """A field of state ``s`` with its param's shape, mesh and placements (None for a state of no slots)."""
    for name, t in zip(s._fields, s):
        if not name.endswith("_absmax"):
            return t
    return None


def _states(state: Any) -> tuple[list, Any]:
    states, spec = pytree.tree_flatten(state, is_leaf=is_state)
    for i, s in enumerate(states):
        if not is_state(s):
            raise TypeError(f"state{_names(state)[i]} must be a bnbf state, got {type(s).__name__}")
    return states, spec


def _names(tree: Any) -> list[str]:
    """Each leaf's path (``['w']``), for messages."""
    return [keystr(k) for k, _ in pytree.tree_flatten_with_path(tree, is_leaf=is_state)[0]]


def dequantize_state(state: Any) -> Any:
    """:func:`bnbf.dequantize_state` for states that may hold DTensors (from :func:`init_state`).

    Args:
        state: a state or a pytree of states.

    Returns:
        Per state a dict of float32 tensors (torch.optim's names); a DTensor param's are DTensors with its
        placements (``.full_tensor()`` gathers them).

    Example (on each rank)::

        exp_avg = bnbf.distributed.dequantize_state(state)["w"]["exp_avg"].full_tensor()
    """
    states, spec = _states(state)
    names = _names_of(state)
    out = []
    for i, s in enumerate(states):
        like = _param_like(s)
        if not isinstance(like, DTensor):
            out.append(bnbf.dequantize_state(s))
            continue
        sh = _shards(like, names, i, "state")
        local = bnbf.dequantize_state(_local_state(s, sh, names, i))
        out.append({k: _like_param(v, sh, like) for k, v in local.items()})
    return pytree.tree_unflatten(out, spec)


def _like_param(local: Tensor, sh: _Shards, like: DTensor) -> DTensor:
    return DTensor.from_local(local, sh.mesh, sh.placements, run_check=False, shape=like.shape, stride=like.stride())


# --- checkpoints that load on any mesh ---------------------------------------------------------------


def _rescale(codes: Tensor, old: Tensor, new: Tensor, fmt: str, signed: bool) -> Tensor:
    """Codes of the values ``map[codes] * old`` re-expressed in scale ``new`` (per element, ``new >= old``),
    rounded to the nearest code; elements whose scale does not change keep their code. Flat tensors."""
    change = old != new
    if not bool(change.any()):
        return codes
    x = state_map(fmt, signed, codes.device)[codes[change].long()] * old[change] / new[change]
    # quantize_state_reference scales each block by its absmax: one value per 64-element block with 1.0
    # beside it gives the scale 1 (|x| <= 1), i.e. the nearest code of x itself
    blocks = torch.zeros(x.numel(), 64, dtype=torch.float32, device=codes.device)
    blocks[:, 0], blocks[:, 1] = x, 1.0
    q, _ = quantize_state_reference(blocks.reshape(-1), fmt, signed, 64)
    out = codes.clone()
    out[change] = q.view(-1, 64)[:, 0]
    return out


def _element_blocks(start: int, count: int, block_size: int, device) -> tuple[Tensor, Tensor]:
    """Per element of a shard: its local block and its global block."""
    i = torch.arange(count, device=device)
    return i // block_size, (i + start) // block_size


def _global_scales(pieces: Tensor, sh: _Shards, numel: int, block_size: int) -> Tensor:
    """Scales of the unsharded tensor's blocks from every shard's own (``pieces`` [W, padded]): the largest
    scale among the pieces of each block."""
    out = torch.zeros(_blocks(numel, block_size), dtype=torch.float32, device=pieces.device)
    for r in range(sh.world):
        n = sh.counts[r]
        if n == 0:
            continue
        local_b, global_b = _element_blocks(sh.starts[r], n, block_size, pieces.device)
        out.scatter_reduce_(0, global_b, pieces[r, local_b], reduce="amax")
    return out


# each entry's layout (rule, bits, format, block size): DCP matches tensors by name and casts them into the
# template's dtype, so an AdamW checkpoint would load into Lion's same-named state, or its codes into floats
LAYOUT_KEY = "layout"


def state_dict(state: Any) -> Any:
    """The mesh-independent form of ``state`` for ``torch.distributed.checkpoint`` (module docstring).

    Every rank must call it (8-bit states of sharded params gather their block scales, one collective
    each). Use it both to save and as the template to load into (then :func:`load_state_dict_`).

    Args:
        state: from :func:`init_state` (DTensors or plain tensors), a state or a pytree of them.

    Returns:
        The structure of ``state`` with a dict ``{field: tensor}`` per state: codes and float32 states
        shaped like the param (DTensors with its placements where it is one), and per 8-bit slot the
        ``numel / block_size`` scales of the unsharded tensor's blocks (replicated); and under ``"layout"``
        the state's class name (rule, bits, format, block size), which :func:`load_state_dict_` checks.

    Example (on each rank)::

        torch.distributed.checkpoint.save({"optim": bnbf.distributed.state_dict(state)}, checkpoint_id=path)
    """
    states, spec = _states(state)
    names = _names_of(state)
    out = []
    for i, s in enumerate(states):
        layout = type(s).layout
        like = _param_like(s)
        if not isinstance(like, DTensor) or not layout.quantized:
            out.append({**dict(zip(s._fields, s)), LAYOUT_KEY: layout.class_name})
            continue
        sh = _shards(like, names, i, "state")
        local = _local_state(s, sh, names, i)
        bs = layout.block_size
        local_b, global_b = _element_blocks(sh.start, sh.count, bs, like.device)
        entry = {LAYOUT_KEY: layout.class_name}
        for slot in layout.slots():
            scales = getattr(s, slot.name + "_absmax")
            pieces = scales.full_tensor() if sh.sharded else scales.to_local()  # [W, padded]: every shard's scales
            full = _global_scales(pieces, sh, like.numel(), bs)
            own = getattr(local, slot.name + "_absmax")
            codes = getattr(local, slot.name)
            codes = _rescale(codes.reshape(-1), own[local_b], full[global_b], layout.format, slot.signed)
            entry[slot.name] = _like_param(codes.view(like.to_local().shape), sh, like)
            entry[slot.name + "_absmax"] = DTensor.from_local(
                full, sh.mesh, [Replicate()] * sh.mesh.ndim, run_check=False
            )
        out.append(entry)
    return pytree.tree_unflatten(out, spec)


def _is_entry(x: Any) -> bool:
    return isinstance(x, dict) and all(isinstance(v, Tensor) for k, v in x.items() if k != LAYOUT_KEY)


def _check_entry(i: str, s: Any, e: Any) -> None:
    """A loaded entry has the fields of state ``s`` in their global shapes, and its layout where it names one
    (``i``: its path, for messages)."""
    fields = set(e) - {LAYOUT_KEY} if isinstance(e, dict) else None
    if fields != set(s._fields):
        raise ValueError(
            f"saved{i} must be a dict with the keys {list(s._fields)}, got "
            + (f"the keys {list(e)}" if isinstance(e, dict) else type(e).__name__)
        )
    like = _param_like(s)
    layout = type(s).layout
    if e.get(LAYOUT_KEY, layout.class_name) != layout.class_name:
        raise ValueError(
            f"saved{i} is a {e[LAYOUT_KEY]!r} state, state{i} a {layout.class_name!r} one: a checkpoint loads "
            f"into states of its rule, bits, format and block size (dcp.load may already have written into the "
            f"state's own tensors: make the state again before stepping it)"
        )
    for name, t in zip(s._fields, s):
        want = torch.Size([_blocks(like.numel(), layout.block_size)]) if name.endswith("_absmax") else like.shape
        got = e[name].shape
        if got != want or e[name].dtype != t.dtype:
            raise ValueError(
                f"saved{i}.{name} is {e[name].dtype} {tuple(got)}; the state needs {t.dtype} {tuple(want)}"
            )
        if isinstance(e[name], DTensor):
            _check_dtensor_entry(f"saved{i}.{name}", e[name])


def _check_dtensor_entry(where: str, t: DTensor) -> None:
    """A DTensor entry is what its metadata says: on a mesh that holds this rank, with the local tensor its global
    shape and placements give here; else its rows or its gather would be wrong, or fail after earlier writes."""
    mesh = t.device_mesh
    if mesh.get_coordinate() is None:
        raise ValueError(f"{where} is a DTensor on a mesh that does not hold rank {dist.get_rank()}: {mesh}")
    want = torch.Size(compute_local_shape_and_global_offset(t.shape, mesh, t.placements)[0])
    if t._local_tensor.shape != want:
        raise ValueError(
            f"{where} is a DTensor of global shape {tuple(t.shape)} with placements {t.placements} whose local "
            f"tensor has shape {tuple(t._local_tensor.shape)}, not {tuple(want)}"
        )


def load_state_dict_(state: Any, saved: Any) -> Any:
    """Write a checkpoint's states (from :func:`state_dict`, loaded in place by DCP) into ``state``.

    ``state`` may live on another mesh than the one that saved, or be unsharded: codes are re-expressed in
    the scales of this mesh's blocks where a block of this mesh spans two saved blocks (never where shards
    hold whole blocks). Every entry is checked before any is written.

    Args:
        state: the live states (from :func:`init_state`), written in place.
        saved: ``state_dict(state)`` after ``dcp.load`` filled it (or the same structure of tensors): plain tensors
            or DTensors of the global shape, on any mesh and placements. A DTensor split otherwise than its state
            (not ``Replicate``) is gathered as it is written, one at a time: then every rank of its mesh must call.

    Returns:
        ``state``.

    Example (on each rank)::

        sd = bnbf.distributed.state_dict(state)
        torch.distributed.checkpoint.load({"optim": sd}, checkpoint_id=path)
        bnbf.distributed.load_state_dict_(state, sd)
    """
    states, spec = _states(state)
    entries, e_spec = pytree.tree_flatten(saved, is_leaf=_is_entry)
    if len(entries) != len(states):
        raise ValueError(f"saved holds {len(entries)} states, state {len(states)}")
    names = _names_of(state)
    for i, (s, e) in enumerate(zip(states, entries)):
        _check_entry(names[i], s, e)
    # each DTensor state's split and local view, which may still refuse it, before the first state is written
    shards, local = [], []
    for i, s in enumerate(states):
        like = _param_like(s)
        sh = _shards(like, names, i, "state") if isinstance(like, DTensor) else None
        shards.append(sh)
        local.append(s if sh is None else _local_state(s, sh, names, i))
    with torch.no_grad():
        for s, e, sh, ls in zip(states, entries, shards, local):
            _load_one(s, e, sh, ls)
    return state


def _load_one(s: Any, e: dict, sh: _Shards | None, local: Any) -> None:
    """Entry ``e`` written into state ``s`` (checked); ``sh``, ``local``: its split and local view (None and ``s``
    for a plain state). A DTensor entry split otherwise than the state is gathered here, one tensor at a time."""
    layout = type(s).layout
    like = _param_like(s)
    if sh is None:
        for name, t in zip(s._fields, s):
            src = _entry_rows(e[name], None, t.device)
            if src.data_ptr() != t.data_ptr() or src.numel() != t.numel():
                t.copy_(src.view(t.shape))
        return
    device = like.device
    if not layout.quantized:
        for name, t in zip(local._fields, local):
            src = _entry_rows(e[name], sh, device)
            if src.data_ptr() != t.data_ptr() or src.numel() != t.numel():
                t.copy_(src.view(t.shape))
        return
    bs = layout.block_size
    local_b, global_b = _element_blocks(sh.start, sh.count, bs, device)
    for slot in layout.slots():
        full = _entry_rows(e[slot.name + "_absmax"], None, device)
        own = getattr(local, slot.name + "_absmax")
        scales = torch.zeros_like(own).scatter_reduce_(0, local_b, full[global_b], reduce="amax")
        live = getattr(local, slot.name)
        new = _rescale(
            _entry_rows(e[slot.name], sh, device), full[global_b], scales[local_b], layout.format, slot.signed
        )
        live.copy_(new.view(live.shape))
        own.copy_(scales)


def _entry_rows(t: Tensor, sh: _Shards | None, device: torch.device) -> Tensor:
    """The elements of shard ``sh`` (all where None) of entry ``t`` of the global shape, flat, on ``device``: a
    DTensor split as the state (same mesh and placements) gives its local tensor; any other gives a slice of the
    whole tensor, which a Replicate DTensor's local tensor already is and any other is gathered into (a collective:
    which way is taken depends on metadata only, so every rank takes the same, in the same order)."""
    if isinstance(t, DTensor):
        if sh is not None and _split_as(t, sh):
            return t.to_local().reshape(-1).to(device)
        t = t.to_local() if all(type(pl) is Replicate for pl in t.placements) else t.full_tensor()
    flat = t.reshape(-1).to(device)
    return flat if sh is None else flat[sh.start : sh.start + sh.count]


def _split_as(t: DTensor, sh: _Shards) -> bool:
    """Whether DTensor ``t`` (of the state's global shape) is split as shard ``sh``'s state: then its local tensor
    holds this shard's elements (the type compared too: a ``_StridedShard`` is a ``Shard`` of other rows)."""
    pls = tuple(t.placements)
    return (
        t.device_mesh == sh.mesh
        and len(pls) == len(sh.placements)
        and all(type(a) is type(b) and a == b for a, b in zip(pls, sh.placements))
    )

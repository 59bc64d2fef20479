"""Launcher groups for the members of stacked tensors: an ensemble's ``[members, ...]`` params, grads and states
stepped in one launch under ``torch.func.vmap`` (:func:`bnbf.ops._step_vmap`).

Each member of each tensor is a tensor of its own to the kernel (its own row of the address table, so its own
blocks, absmax and dither, exactly as in a loop over members), but the host never makes a view per member:
member ``b`` of a stacked tensor sits at its base address plus ``b`` times its member stride, so the table of
all members is the table of member 0 plus ``b`` times the table's step from member 0 to member 1, one tensor
expression. Both come from the launcher's own :func:`~bnbf.kernels.launcher.build_group` (so the columns are
the launcher's): the step once per structure (sizes, member strides, layout), member 0's table once per set of
addresses, from the stacked tensors themselves (a view per param only, for its size).

Stacked tensors of one kind (params in, params out, states in...) are a pair ``(tensors, batched)``: a list of
tensors ``[members, ...]`` with each member contiguous (batched: True), or one member's tensor shared by all
members (batched: False, member stride 0), and a tuple of those flags.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import functools
import itertools
import operator

import torch
from torch import Tensor

from bnbf.kernels.launcher import ITERS, Group, _tasks, _to_device, build_group, first_blocks_of
from bnbf.reference import FIRST_BLOCKS
from bnbf.state import Layout


@dataclasses.dataclass
class MemberGroup(Group):
    """A :class:`Group` of stacked tensors' members, with the stacked grads its grad table was made for."""

    member_grads: tuple = ()  # (addresses, member strides) of the stacked grads


@dataclasses.dataclass
class _Structure:
    """What a group's table takes from sizes and member strides alone, the same for any addresses."""

    step: Tensor | None  # int64 [tensors, columns] on the device: the table's change from member b to b + 1
    tasks: Tensor
    ranges: Tensor
    strides_aligned: bool  # every member stride is a multiple of 16 bytes
    compiled: dict  # the direct launchers (bnbf.kernels.direct_launch), shared by its groups


# a pure step's outputs alternate between a few address sets (the caching allocator reuses blocks); a miss costs
# one build_group of member 0 (its structure is kept)
_GROUPS: collections.OrderedDict = collections.OrderedDict()
_STRUCTURES: collections.OrderedDict = collections.OrderedDict()
_CACHE_SIZE = 8
BUILDS: collections.Counter = collections.Counter()  # "group" and "structure" builds so far (benchmarks read it)
_REPEAT_0 = itertools.repeat(0)
_NBYTES = operator.attrgetter("nbytes")


def member_strides(x: tuple, size: int) -> tuple[int, ...]:
    """Bytes from member ``b`` to member ``b + 1`` of each stacked tensor (0 where shared, or for one member)."""
    ts, batched = x
    if size <= 1:
        return (0,) * len(ts)
    if all(batched):  # the common case in C-level maps; contiguous: a member is a size-th of the bytes
        if all(map(Tensor.is_contiguous, ts)):
            return tuple(map(operator.floordiv, map(_NBYTES, ts), itertools.repeat(size)))
        return tuple(map(operator.mul, map(Tensor.stride, ts, _REPEAT_0), map(Tensor.element_size, ts)))
    return tuple(t.stride(0) * t.element_size() if b else 0 for t, b in zip(ts, batched))


def _member(x: tuple, b: int) -> list[Tensor]:
    return [t[b] if batched else t for t, batched in zip(*x)]


def _cached(cache: collections.OrderedDict, key: tuple, make):
    hit = cache.get(key)
    if hit is not None:
        cache.move_to_end(key)
        return hit
    hit = cache[key] = make()
    if len(cache) > _CACHE_SIZE:
        cache.popitem(last=False)
    return hit


def stacked_group(p_in: tuple, p_out: tuple, s_in: tuple, s_out: tuple, layout: Layout, size: int) -> MemberGroup:
    """The :class:`~bnbf.kernels.launcher.Group` stepping ``size`` members of every stacked tensor in one launch.

    Args:
        p_in, p_out, s_in, s_out: stacked tensors ``(tensors, batched)`` in :func:`build_group`'s order (per
            param, the fields of its kept state slots); outputs are batched. In and out may be the same.
        layout: the states' layout.
        size: the number of members (at least 1).

    Returns:
        A :class:`MemberGroup` whose table has ``size * len(p_in)`` rows, member-major (row ``b * len(p_in) + i`` is
        member ``b`` of tensor ``i``), as :func:`stacked_grads` orders the grads. Cached by the exact table it
        holds (addresses, member strides, sizes, layout, dtype, device, members), so a hit is right whatever
        tensors those addresses belong to; the cache holds no caller tensor.

    Example:
        >>> p = torch.zeros(4, 300)  # 4 members of 300 elements
        >>> s = torch.vmap(lambda q: bnbf.init_state(q, bnbf.OptimSpec(rule="adamw", min_8bit_size=0)))(p)
        >>> ps, ss = ([p], (True,)), (list(s), (True,) * len(s))
        >>> stacked_group(ps, ps, ss, ss, type(s).layout, 4).table.shape[0]
        4
    """
    lists = (p_in, p_out, s_in, s_out)
    t0 = p_in[0][0]
    strides = tuple(member_strides(x, size) for x in lists)
    numels = tuple(t.numel() // size if b else t.numel() for t, b in zip(*p_in))
    shape_key = (layout, t0.dtype, t0.device, size, numels, strides)
    build = functools.partial(_build, lists, layout, size, shape_key, strides, numels)
    if FIRST_BLOCKS.get():  # shards of larger tensors: their first blocks are in the table, not in the key
        return build()
    key = (shape_key, tuple(tuple(map(Tensor.data_ptr, ts)) for ts, _ in lists))
    return _cached(_GROUPS, key, build)


def _build(lists: tuple, layout: Layout, size: int, shape_key: tuple, strides: tuple, numels: tuple) -> MemberGroup:
    # member 0's table: a stacked tensor's address is its member 0's, so only the params (whose sizes the table
    # holds) are viewed; the launcher reads the other tensors' addresses alone
    BUILDS["group"] += 1
    p_in, p_out, s_in, s_out = lists
    p0 = _member(p_in, 0)
    first_blocks = first_blocks_of(p0)  # every member a shard at the same offset (None: all 0)
    base = build_group(p0, p_out[0], s_in[0], s_out[0], layout, first_blocks)
    structure = _cached(_STRUCTURES, shape_key, lambda: _structure(lists, layout, size, base, strides, numels))
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(Group)}
    fields["compiled"] = structure.compiled
    if size > 1:
        members = torch.arange(size, dtype=torch.int64, device=base.device).view(size, 1, 1)
        fields["table"] = (base.table.unsqueeze(0) + members * structure.step.unsqueeze(0)).flatten(0, 1)
        fields.update(tasks=structure.tasks, ranges=structure.ranges)
        fields["aligned"] = base.aligned and structure.strides_aligned
    return MemberGroup(**fields)


def _structure(lists: tuple, layout: Layout, size: int, base: Group, strides: tuple, numels: tuple) -> _Structure:
    BUILDS["structure"] += 1
    if size == 1:
        return _Structure(None, base.tasks, base.ranges, True, {})
    # the launcher's own tables for members 0 and 1: their difference is every column's member stride (0 for
    # shared tensors, sizes, first blocks and absent slots), whatever the columns are
    first = build_group(*(_member(x, 0) for x in lists), layout, [0] * len(numels)).table
    step = build_group(*(_member(x, 1) for x in lists), layout, [0] * len(numels)).table - first
    tasks, ranges = _tasks(numels * size, base.block, ITERS[base.fmt][base.dtype], base.device)
    aligned = functools.reduce(operator.or_, itertools.chain.from_iterable(strides), 0) % 16 == 0
    return _Structure(step, tasks, ranges, aligned, {})


def stacked_grads(group: MemberGroup, grads: tuple, size: int) -> list[Tensor]:
    """Give ``group`` the grad table of every member of the stacked ``grads`` (``(tensors, batched)``, in the
    group's tensor order), member-major like its table.

    Returns:
        The grad tensors to pass to :func:`bnbf.kernels.launcher.launch_group`: the launcher compares their
        addresses with the group's last grads and, equal, uses the group's grad table, the one set here.

    Example:
        >>> p = torch.zeros(4, 300)
        >>> s = torch.vmap(lambda q: bnbf.init_state(q, bnbf.OptimSpec(rule="adamw", min_8bit_size=0)))(p)
        >>> ps, ss = ([p], (True,)), (list(s), (True,) * len(s))
        >>> group = stacked_group(ps, ps, ss, ss, type(s).layout, 4)
        >>> grads = stacked_grads(group, ([torch.ones(4, 300)], (True,)), 4)
        >>> group.grad_table.shape[0]
        4
    """
    ts = grads[0]
    ptrs = tuple(map(Tensor.data_ptr, ts))
    strides = member_strides(grads, size)
    if group.member_grads != (ptrs, strides):
        base = torch.tensor(ptrs, dtype=torch.int64)
        rows = base + torch.arange(size, dtype=torch.int64).view(size, 1) * torch.tensor(strides, dtype=torch.int64)
        group.grad_table = _to_device(rows.flatten(), group.device)
        group.grads_aligned = functools.reduce(operator.or_, ptrs + strides) % 16 == 0
        group.member_grads = (ptrs, strides)
    # the launcher's grad cache: these tensors are "the last grads", so it keeps the table set above
    group.grad_ptrs = ptrs
    group.grad_packed = array.array("Q", ptrs).tobytes()
    return ts

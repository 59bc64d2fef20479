"""Launcher groups for the members of stacked tensors: an ensemble's ``[members, ...]`` params, grads and states
stepped in one launch under ``torch.func.vmap`` (:func:`bnbf.ops._step_vmap`).

Each member of each tensor is a tensor of its own to the kernel (its own row of the address table, so its own
blocks, absmax and dither, exactly as in a loop over members), but the host never makes a view per member:
member ``b`` of a stacked tensor sits at its base address plus ``b`` times its member stride, so the table of
all members is the table of member 0 plus ``b`` times the table's step from member 0 to member 1, one tensor
expression. The host work is that of two members' tables (:func:`bnbf.kernels.launcher.build_group`, so the
columns are the launcher's own), whatever the number of members.

A stacked tensor here is a pair ``(tensor, batched)``: ``tensor`` is ``[members, ...]`` with each member
contiguous (``batched``), or one member's tensor shared by all members (not ``batched``, member stride 0).
"""

from __future__ import annotations

import array
import collections
import dataclasses
import functools
import operator

import torch
from torch import Tensor

from bnbf.kernels.launcher import ITERS, Group, _tasks, _to_device, build_group
from bnbf.state import Layout


@dataclasses.dataclass
class MemberGroup(Group):
    """A :class:`Group` of stacked tensors' members, with the stacked grads its grad table was made for."""

    member_grads: tuple = ()  # (addresses, member strides) of the stacked grads


_GROUPS: collections.OrderedDict = collections.OrderedDict()
_CACHE_SIZE = 8  # a pure step's outputs alternate between a few address sets (the allocator reuses blocks)


def _member(x: tuple[Tensor, bool], b: int) -> Tensor:
    t, batched = x
    return t[b] if batched else t


def _member_stride(x: tuple[Tensor, bool]) -> int:
    t, batched = x
    return t.stride(0) * t.element_size() if batched and t.shape[0] > 1 else 0


def stacked_group(p_in: list, p_out: list, s_in: list, s_out: list, layout: Layout, size: int) -> MemberGroup:
    """The :class:`~bnbf.kernels.launcher.Group` stepping ``size`` members of every stacked tensor in one launch.

    Args:
        p_in, p_out, s_in, s_out: stacked tensors ``(tensor, batched)`` in :func:`build_group`'s order (per
            param, the fields of its kept state slots); outputs are batched. In and out may be the same.
        layout: the states' layout.
        size: the number of members.

    Returns:
        A group whose table has ``size * len(p_in)`` rows, member-major (row ``b * len(p_in) + i`` is member ``b``
        of tensor ``i``), as :func:`stacked_grads` orders the grads. Cached by the exact table it holds
        (addresses, member strides, sizes, layout, dtype, device, members), so a hit is right whatever tensors
        those addresses belong to; the cache holds no caller tensor.

    Example:
        >>> p = torch.zeros(4, 300)  # 4 members of 300 elements
        >>> s = torch.vmap(lambda q: bnbf.init_state(q, bnbf.OptimSpec(rule="adamw", min_8bit_size=0)))(p)
        >>> fields = [(t, True) for t in s]
        >>> stacked_group([(p, True)], [(p, True)], fields, fields, type(s).layout, 4).table.shape[0]
        4
    """
    tensors = (p_in, p_out, s_in, s_out)
    key = (
        layout,
        p_in[0][0].dtype,
        p_in[0][0].device,
        size,
        tuple(tuple(t.data_ptr() for t, _ in xs) for xs in tensors),
        tuple(tuple(map(_member_stride, xs)) for xs in tensors),
        tuple(t.shape[1:] if batched else t.shape for t, batched in p_in),
    )
    hit = _GROUPS.get(key)
    if hit is not None:
        _GROUPS.move_to_end(key)
        return hit
    first = [[_member(x, 0) for x in xs] for xs in tensors]
    base = build_group(*first, layout)
    device = base.device
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(Group)}
    if size == 1:
        group = MemberGroup(**fields)
    else:
        # the launcher's own table for member 1: its difference from member 0's is every column's member stride
        # (0 for shared tensors, sizes and absent slots), whatever the columns are
        step = build_group(*[[_member(x, 1) for x in xs] for xs in tensors], layout).table - base.table
        members = torch.arange(size, dtype=torch.int64, device=device).view(size, 1, 1)
        table = (base.table.unsqueeze(0) + members * step.unsqueeze(0)).flatten(0, 1)
        numels = tuple(t.numel() for t in first[0]) * size
        tasks, ranges = _tasks(numels, base.block, ITERS[base.fmt][base.dtype], device)
        aligned = (
            base.aligned and functools.reduce(operator.or_, (_member_stride(x) for xs in tensors for x in xs)) % 16 == 0
        )
        fields.update(table=table, tasks=tasks, ranges=ranges, aligned=aligned, compiled={})
        group = MemberGroup(**fields)
    _GROUPS[key] = group
    if len(_GROUPS) > _CACHE_SIZE:
        _GROUPS.popitem(last=False)
    return group


def stacked_grads(group: MemberGroup, grads: list, size: int) -> list[Tensor]:
    """Give ``group`` the grad table of every member of the stacked ``grads`` (``(tensor, batched)``, in the
    group's tensor order), member-major like its table.

    Returns:
        The grad tensors to pass to :func:`bnbf.kernels.launcher.launch_group`: the launcher compares their
        addresses with the group's last grads and, equal, uses the group's grad table, the one set here.

    Example:
        >>> p = torch.zeros(4, 300)
        >>> s = torch.vmap(lambda q: bnbf.init_state(q, bnbf.OptimSpec(rule="adamw", min_8bit_size=0)))(p)
        >>> fields = [(t, True) for t in s]
        >>> group = stacked_group([(p, True)], [(p, True)], fields, fields, type(s).layout, 4)
        >>> grads = stacked_grads(group, [(torch.ones(4, 300), True)], 4)
        >>> group.grad_table.shape[0]
        4
    """
    ts = [t for t, _ in grads]
    ptrs = tuple(map(Tensor.data_ptr, ts))
    strides = tuple(map(_member_stride, grads))
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

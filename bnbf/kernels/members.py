"""Launcher groups for the members of stacked tensors: an ensemble's ``[members, ...]`` params, grads and states
stepped in one launch under ``torch.func.vmap`` (:func:`bnbf.ops._step_vmap`).

Each member of each tensor is a tensor of its own to the kernel (its own row of the address table, so its own
blocks, absmax and dither, exactly as in a loop over members), but the host never makes a view per member:
member ``b`` of a stacked tensor sits at its base address plus ``b`` times its member stride. Once per structure
(sizes, member strides, layout) the launcher's own :func:`~bnbf.kernels.launcher.build_group` is run on stand-ins
(views of a small host buffer, at two places) to learn, for each cell of its table, which tensor's address it
holds, or that it is a constant (a size, an absent slot); so the columns stay the launcher's. A call then gathers
every tensor's address in one pass (compiled where :data:`bnbf._host_checks.NATIVE` is built) and makes the table
of all members in two tensor ops: no Python work per tensor or per member, none per table cell.

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

from bnbf._bounded import Bounded
from bnbf._host_checks import NATIVE
from bnbf.kernels.launcher import ITERS, Group, _tasks, _to_device, build_group, first_blocks_of
from bnbf.reference import FIRST_BLOCKS
from bnbf.state import Layout


@dataclasses.dataclass
class MemberGroup(Group):
    """A :class:`Group` of stacked tensors' members, with the stacked grads its grad table was made for."""

    member_grads: tuple = ()  # (packed addresses, member strides) of the stacked grads
    # the params' member strides, and b times them, int64 [members, params] (the grads' usual offsets)
    param_strides: tuple = ()
    param_offsets: Tensor | None = None
    disjoint: bool = False  # its params and states were found not to share memory (an in-place step's check)


@dataclasses.dataclass
class _Structure:
    """What a group's table takes from sizes and member strides alone, the same for any addresses."""

    key: tuple  # (layout, dtype, device, members, param numels, member strides of each list)
    step: Tensor  # int64 [tensors, columns] on the device: the table's change from member b to b + 1
    tasks: Tensor
    ranges: Tensor
    strides_aligned: bool  # every member stride is a multiple of 16 bytes
    compiled: dict  # the direct launchers (bnbf.kernels.direct_launch), shared by its groups
    # member 0's table is addresses[src] + the constants, with addresses every tensor's (p_in, p_out, s_in,
    # s_out in order, then a 0 that constant cells read); src on the host; offsets: the constants plus b times
    # the member strides, int64 [members, tensors, columns] on the device
    src: Tensor
    offsets: Tensor
    group: Group  # the stand-ins' group: what a group takes from the structure (dtype, norms, block...)
    param_offsets: Tensor  # b times each param's member stride, int64 [members, params] on the device
    twins: tuple | None = None  # meta tensors of p_in and s_in, where every tensor is batched and contiguous


# a pure step's outputs alternate between a few address sets (the caching allocator reuses blocks); a miss costs
# one gather of the addresses and two tensor ops (its structure is kept)
_GROUPS = Bounded(8)
# structures by (layout, dtype, device, members, list lengths), found by their meta twins in one compiled
# comparison per list (no numel or stride read in Python); the most recent per key
_PROBES = Bounded(8)
# structures: one per launch group of every pure step no plan serves (bnbf.ops' group cache, 16 entries, makes its
# misses from them), besides the vmapped and packed steps'; a structure holds no caller tensor
_STRUCTURES = Bounded(32)
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
        >>> import torch, bnbf
        >>> p = torch.zeros(4, 300)  # 4 members of 300 elements
        >>> s = torch.vmap(lambda q: bnbf.init_state(q, bnbf.OptimSpec(rule="adamw", min_8bit_size=0)))(p)
        >>> ps, ss = ([p], (True,)), (list(s), (True,) * len(s))
        >>> stacked_group(ps, ps, ss, ss, type(s).layout, 4).table.shape[0]
        4
    """
    lists = (p_in, p_out, s_in, s_out)
    if FIRST_BLOCKS.get():  # shards of larger tensors: their first blocks are in the table, not in the key
        return _build_shards(lists, layout, size, _structure_of(lists, layout, size))
    structure = _structure_of(lists, layout, size)
    addresses, packed, aligned = _addresses(lists)
    return _group_at((structure.key, packed), structure, addresses, aligned)


def _plain_lists(p_in: list, p_out: list, s_in: list, s_out: list) -> tuple:
    unbatched = (False,) * len(p_in)
    P, S = (p_in, unbatched), (s_in, (False,) * len(s_in))
    return P, P if p_out is p_in else (p_out, unbatched), S, S if s_out is s_in else (s_out, S[1])


def plain_addresses(p_in: list, p_out: list, s_in: list, s_out: list) -> tuple[Tensor, bytes, bool]:
    """:func:`_addresses` of plain tensors (in place: the in lists again): what :func:`plain_group` is built at,
    and its packed form the caller's cache key."""
    return _addresses(_plain_lists(p_in, p_out, s_in, s_out))


def plain_group(
    p_in: list, p_out: list, s_in: list, s_out: list, layout: Layout, at: tuple | None = None
) -> MemberGroup:
    """:func:`~bnbf.kernels.launcher.build_group` of plain tensors (one unbatched member) from their structure: a
    gather of the addresses and two tensor ops, where the launcher's build makes a Python row per tensor and the
    tasks anew (a pure step of GPT-2's 148 tensors misses its caller's cache every call: the allocator hands the
    outputs of same-sized tensors out in another order). Not cached here; the caller (:func:`bnbf.ops._group`) is,
    and passes ``at``, the ``(addresses, aligned)`` of :func:`plain_addresses` it already gathered.
    In and out may be the same lists (in place)."""
    lists = _plain_lists(p_in, p_out, s_in, s_out)
    if at is None:
        addresses, _, aligned = _addresses(lists)
    else:
        addresses, aligned = at
    return _group_of(_structure_of(lists, layout, 1), addresses, aligned)


def _group_at(key: tuple, structure: _Structure, addresses: Tensor, aligned: bool, check=None) -> MemberGroup:
    """The cached group of ``key`` (a structure's key and the packed addresses), else ``check()`` (if given) and a
    new one (:func:`_group_of`)."""
    hit = _GROUPS.touch(key)
    if hit is not None:
        return hit
    if check is not None:
        check()
    return _GROUPS.put(key, _group_of(structure, addresses, aligned))


def _group_of(structure: _Structure, addresses: Tensor, aligned: bool) -> MemberGroup:
    """The group of ``structure`` for tensors at ``addresses`` (:func:`_addresses`): member 0's table on the host (a
    gather), every member's on the device, so the host work is the same for any member count."""
    BUILDS["group"] += 1
    n, columns = structure.group.table.shape
    device = structure.key[2]
    first = _to_device(addresses.index_select(0, structure.src).view(1, n, columns), device)
    table = (first + structure.offsets).view(-1, columns)
    base = structure.group
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(Group)}
    fields.update(
        device=device,
        table=table,
        tasks=structure.tasks,
        ranges=structure.ranges,
        aligned=aligned and structure.strides_aligned,
        compiled=structure.compiled,
        shifted=False,
        grad_ptrs=(),
        grad_packed=b"",
        grad_table=None,
        grads_aligned=False,
        partials=None,
        sums=None,
    )
    return MemberGroup(**fields, param_strides=structure.key[5][0], param_offsets=structure.param_offsets)


def packed_group(p_in: tuple, p_out: tuple, b_in: tuple, b_out: tuple, parts, key: tuple, layout: Layout, size: int,
                 check=None) -> MemberGroup:  # fmt: skip
    """:func:`stacked_group` for states held as parts of a few buffers (:mod:`bnbf.packed`): each state tensor's
    address is its buffer's plus a fixed offset, so a call gathers only the params' and the buffers' addresses.

    Args:
        p_in, p_out: stacked params as for :func:`stacked_group` (``size`` 1 and unbatched outside vmap).
        b_in, b_out: the buffers, ``(tensors, batched)`` likewise.
        parts: ``parts(b) -> (views, batched, owners)``: the state tensors in :func:`build_group`'s order as views
            of the buffers ``b``, and each one's buffer index; called only when a structure is made.
        key: what fixes the views' sizes and offsets (the packed state's meta and layout group).
        layout, size: as for :func:`stacked_group`.
        check: called with nothing before a new group is made (an in-place step's overlap check); a raise caches
            nothing.

    Returns:
        A :class:`MemberGroup`, cached by the addresses as :func:`stacked_group`'s.
    """
    lists = (p_in, p_out, b_in, b_out)
    t0 = p_in[0][0]
    skey = (
        key,
        layout,
        t0.dtype,
        t0.device,
        size,
        p_in[1],
        b_in[1],
        p_out is p_in,
        *map(_strides_key, lists, (size,) * 4),
    )
    structure = _STRUCTURES.kept(skey, lambda: _packed_structure(lists, parts, layout, size))
    addresses, packed, aligned = _addresses(lists)
    return _group_at((skey, packed), structure, addresses, aligned, check)


def _strides_key(x: tuple, size: int) -> tuple | None:
    """What decides ``x``'s member strides where its sizes are fixed (a packed state's key fixes them): None where
    every tensor is batched and contiguous (a member is a size-th of its bytes), else the strides."""
    if size <= 1 or (False not in x[1] and all(map(Tensor.is_contiguous, x[0]))):
        return None
    return member_strides(x, size)


def _packed_structure(lists: tuple, parts, layout: Layout, size: int) -> _Structure:
    """:func:`_structure` of the params and the buffers' parts (views), its cells then moved from each view onto its
    buffer: the view's offset in the buffer joins the cell's constant."""
    p_in, p_out, b_in, b_out = lists
    (s_in, si_b, own_in), (s_out, so_b, own_out) = parts(b_in), parts(b_out)
    views = (p_in, p_out, (s_in, si_b), (s_out, so_b))
    t0 = p_in[0][0]
    strides = tuple(member_strides(x, size) for x in views)
    numels = tuple(t.numel() // size if b else t.numel() for t, b in zip(*p_in))
    base = _structure(views, layout, size, (layout, t0.dtype, t0.device, size, numels, strides))
    n, nb = len(p_in[0]), len(b_in[0])
    remap, extra = list(range(2 * n)), [0] * (2 * n)
    for vs, owners, bufs, start in ((s_in, own_in, b_in[0], 2 * n), (s_out, own_out, b_out[0], 2 * n + nb)):
        remap += [start + j for j in owners]
        extra += [v.data_ptr() - bufs[j].data_ptr() for v, j in zip(vs, owners)]
    remap.append(2 * n + 2 * nb)  # the 0 that constant cells read
    extra.append(0)
    src = torch.tensor(remap, dtype=torch.int64)[base.src]
    shift = torch.tensor(extra, dtype=torch.int64)[base.src].view(1, *base.group.table.shape)
    offsets = base.offsets + _to_device(shift, base.offsets.device)
    return dataclasses.replace(base, src=src, offsets=offsets, twins=None)


def _addresses(lists: tuple) -> tuple[Tensor, bytes, bool]:
    """Every tensor's address, p_in, p_out, s_in, s_out in order, then a 0 (int64, host); the same packed as native
    uint64 (the groups' cache key); whether all are 16-byte aligned. One compiled pass where
    :data:`~bnbf._host_checks.NATIVE` is built (its ``grad_table`` writes any tensors' addresses), else
    the same in Python (its twin, which the tests compare)."""
    flat = [*lists[0][0], *lists[1][0], *lists[2][0], *lists[3][0]]
    out = torch.zeros(len(flat) + 1, dtype=torch.int64)
    if NATIVE is not None:
        got = NATIVE.grad_table((flat,), out[:-1])
        if got is not None:
            return out, got[0], got[1][0]
    return _addresses_python(flat, out)


def _addresses_python(flat: list, out: Tensor) -> tuple[Tensor, bytes, bool]:
    ptrs = array.array("q", map(Tensor.data_ptr, flat))
    out[:-1] = torch.frombuffer(ptrs, dtype=torch.int64) if ptrs else out[:0]
    return out, ptrs.tobytes(), functools.reduce(operator.or_, ptrs, 0) % 16 == 0


def _all_batched(lists: tuple) -> bool:
    return all(False not in batched for _, batched in lists)


def _structure_of(lists: tuple, layout: Layout, size: int) -> _Structure:
    """The structure of these stacked tensors: found by their meta twins in compiled comparisons (every tensor
    contiguous, and batched or of one member: its shape and dtype decide its size and member stride), else by its
    key. A pure per-param step's tables are built anew every call, at the outputs' new addresses, with this
    structure: its key is a hash of every tensor's numel and strides (GPT-2's 148 tensors: 30 us a group, CPU)."""
    p_in, p_out, s_in, s_out = lists
    t0 = p_in[0][0]
    probe = (layout, t0.dtype, t0.device, size, len(p_in[0]), len(s_in[0]))
    batched = size == 1 or _all_batched(lists)
    if NATIVE is not None and batched:
        found = _PROBES.get(probe)
        if found is not None:
            ps, ss = found.twins
            match = NATIVE.meta_match
            if (
                match(p_in[0], ps)
                and match(s_in[0], ss)
                and (p_out is p_in or match(p_out[0], ps))
                and (s_out is s_in or match(s_out[0], ss))
            ):
                return found
    strides = tuple(member_strides(x, size) for x in lists)
    numels = tuple(t.numel() // size if b else t.numel() for t, b in zip(*p_in))
    key = (layout, t0.dtype, t0.device, size, numels, strides)
    structure = _STRUCTURES.kept(key, lambda: _structure(lists, layout, size, key))
    if NATIVE is not None and batched and structure.twins is None and _contiguous(lists):
        structure.twins = tuple([torch.empty(t.shape, dtype=t.dtype, device="meta") for t in x[0]] for x in lists[::2])
    if structure.twins is not None:
        _PROBES.put(probe, structure)
    return structure


def _contiguous(lists: tuple) -> bool:
    return all(all(map(Tensor.is_contiguous, ts)) for ts, _ in lists)


def _structure(lists: tuple, layout: Layout, size: int, key: tuple) -> _Structure:
    """A structure's tables: the launcher's :func:`build_group` of stand-ins for the tensors (views of a host buffer,
    element ``k`` for the ``k``-th tensor, the params with their sizes) at two buffers; a cell that moves with the
    buffer holds tensor ``k``'s address, one that does not is a constant."""
    BUILDS["structure"] += 1
    _, dtype, device, _, numels, strides = key
    counts = [len(x[0]) for x in lists]
    total = sum(counts)
    tables, bases = [], []
    buffers = [torch.empty(total, dtype=dtype) for _ in range(2)]  # both alive: at different addresses
    for buf in buffers:
        views = [buf[k : k + 1] for k in range(total)]
        stand = [[torch.as_strided(buf, (n,), (0,), k) for k, n in enumerate(numels)]]  # p_in: numel is read
        start = counts[0]
        for c in counts[1:]:
            stand.append(views[start : start + c])
            start += c
        group = build_group(*stand, layout, [0] * len(numels))
        tables.append(group.table)
        bases.append(buf.data_ptr())
    first, second = tables
    moved = second - first
    is_address = moved == bases[1] - bases[0]
    index = (first - bases[0]).div(buffers[0].element_size(), rounding_mode="floor")
    if not bool(((moved == 0) | is_address).all()) or not bool(((index >= 0) & (index < total))[is_address].all()):
        raise RuntimeError("bnbf: the launcher's address table has a cell bnbf.kernels.members cannot place")
    src = torch.where(is_address, index, total)
    constants = torch.where(is_address, 0, first)
    member_stride = torch.tensor([*itertools.chain.from_iterable(strides), 0], dtype=torch.int64)[src]
    members = torch.arange(size, dtype=torch.int64).view(size, 1, 1)
    offsets = _to_device((constants.unsqueeze(0) + members * member_stride.unsqueeze(0)).contiguous(), device)
    tasks, ranges = _tasks(numels * size, group.block, ITERS[group.fmt][dtype], device)
    aligned = functools.reduce(operator.or_, itertools.chain.from_iterable(strides), 0) % 16 == 0
    step = _to_device(member_stride, device)
    param_offsets = _to_device(members.view(size, 1) * torch.tensor(strides[0], dtype=torch.int64), device)
    return _Structure(key, step, tasks, ranges, aligned, {}, src.flatten(), offsets, group, param_offsets)


def _build_shards(lists: tuple, layout: Layout, size: int, structure: _Structure) -> MemberGroup:
    # shards (bnbf.distributed): member 0's table with its first blocks from the launcher itself (a view per
    # param, for its address), every member's from it and the structure's step; not cached
    BUILDS["group"] += 1
    p_in, p_out, s_in, s_out = lists
    p0 = _member(p_in, 0)
    first_blocks = first_blocks_of(p0)  # every member a shard at the same offset (None: all 0)
    base = build_group(p0, p_out[0], s_in[0], s_out[0], layout, first_blocks)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(Group)}
    fields["compiled"] = structure.compiled
    if size > 1:
        members = torch.arange(size, dtype=torch.int64, device=base.device).view(size, 1, 1)
        fields["table"] = (base.table.unsqueeze(0) + members * structure.step.unsqueeze(0)).flatten(0, 1)
        fields.update(tasks=structure.tasks, ranges=structure.ranges)
        fields["aligned"] = base.aligned and structure.strides_aligned
    return MemberGroup(**fields)


def stacked_grads(group: MemberGroup, grads: tuple, size: int) -> list[Tensor]:
    """Give ``group`` the grad table of every member of the stacked ``grads`` (``(tensors, batched)``, in the
    group's tensor order), member-major like its table.

    Returns:
        The grad tensors to pass to :func:`bnbf.kernels.launcher.launch_group`: the launcher compares their
        addresses with the group's last grads and, equal, uses the group's grad table, the one set here.

    Example:
        >>> import torch, bnbf
        >>> p = torch.zeros(4, 300)
        >>> s = torch.vmap(lambda q: bnbf.init_state(q, bnbf.OptimSpec(rule="adamw", min_8bit_size=0)))(p)
        >>> ps, ss = ([p], (True,)), (list(s), (True,) * len(s))
        >>> group = stacked_group(ps, ps, ss, ss, type(s).layout, 4)
        >>> grads = stacked_grads(group, ([torch.ones(4, 300)], (True,)), 4)
        >>> group.grad_table.shape[0]
        4
    """
    ts = grads[0]
    addresses, packed, aligned = _addresses((grads, ((), ()), ((), ()), ((), ())))
    strides = member_strides(grads, size)
    if group.member_grads != (packed, strides):
        if strides == group.param_strides:  # the grads laid out as the params (the usual case): on the device
            rows = _to_device(addresses[:-1], group.device) + group.param_offsets
        else:
            rows = addresses[:-1] + torch.arange(size, dtype=torch.int64).view(size, 1) * torch.tensor(strides)
            rows = _to_device(rows, group.device)
        group.grad_table = rows.flatten()
        group.grads_aligned = aligned and functools.reduce(operator.or_, strides, 0) % 16 == 0
        group.member_grads = (packed, strides)
        # the launcher's grad cache: these tensors are "the last grads", so it keeps the table set above
        group.grad_ptrs = tuple(addresses[:-1].tolist())
        group.grad_packed = packed
    return ts

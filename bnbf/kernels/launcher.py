"""The launcher of the step kernel (:mod:`bnbf.kernels.step_kernel`): a group's address table and task list,
built once (:func:`build_group`), and the launch(es) of one step with that step's grad pointers and scalars
(:func:`launch_group`). They check nothing: the functional layer validated. Every path to the kernels goes
through here: the plan's in-place steps, the pure call and traced calls (:mod:`bnbf.ops`).

The launch configuration (tile shape, tiles per program, prefetch, register cap) is chosen here, by state
format and param dtype; the measurements behind each choice are in benchmarks/results (H200 sweeps with
scripts/tune_step.py).
"""

from __future__ import annotations

import array
import dataclasses
import functools
import itertools
import operator
from typing import Any, NamedTuple

import torch
import triton.language as tl
from torch import Tensor

from bnbf._bounded import Bounded
from bnbf._dispatch import NORM_REDUCE, interpreting, launch_lock
from bnbf._host_checks import NATIVE
from bnbf.kernels.direct_launch import launch
from bnbf.kernels.step_kernel import (
    FORMATS,
    HP_MAX,
    PER_SLOT,
    _grad_squares_kernel,
    _pair_kernel,
    _step_kernel,
    _tensor_sums_kernel,
)
from bnbf.ops import host_numbers
from bnbf.quant import dynamic_map
from bnbf.reference import FIRST_BLOCKS, GRAD_CLIP, clipped_sums, tile_width
from bnbf.rules import get_rule
from bnbf.state import Layout

# ---- launch configuration --------------------------------------------------------------------------------

# One 256-element block per program and one warp: the block's absmax reduction needs no shared memory or barrier.
ROWS = 1  # quantization blocks per program
NUM_WARPS = 1
# Elements per thread per load: 16-byte fp32 loads for the power format; the dynamic map's larger code runs
# best with one.
VEC = {"fp32": 4, "power": 4, "dynamic": 1}
# Tiles per program, by state format and param dtype. With PREFETCH, whole tiles are unrolled and each issues the
# next tile's loads before its own arithmetic, keeping loads in flight while a program computes (software
# pipelining through shared memory measured slower).
_TWO_BYTE = {torch.bfloat16: 4, torch.float16: 4}
ITERS = {
    "fp32": {torch.float32: 2, **_TWO_BYTE},
    "power": {torch.float32: 4, **_TWO_BYTE},
    "dynamic": {torch.float32: 1, torch.bfloat16: 1, torch.float16: 1},
}
PREFETCH = {"fp32": True, "power": True, "dynamic": False}
# ... and only while tiles x kept states stays small: beyond, the unrolled tiles' registers cost more than the
# loads in flight gain. By NORM_MODE: the plain step, the norm pass, the step after it.
PREFETCH_SLOTS = {0: 8, 1: 8, 2: 4}
# Register cap per thread (ptxas maxnreg), by state format and param dtype; absent leaves it to ptxas. A one-warp
# program is one of at most 32 resident blocks per SM, so registers cost resident warps; float32 states run
# best uncapped, and the dynamic map with bf16 params too (its code spills under a cap).
_CAP_TWO_BYTE = {torch.bfloat16: 64, torch.float16: 64}
MAXNREG = {"fp32": {}, "power": {torch.float32: 80, **_CAP_TWO_BYTE}, "dynamic": {torch.float32: 64}}


def _prefetch(fmt: str, dtype: torch.dtype, present: int, mode: int) -> bool:
    return PREFETCH[fmt] and ITERS[fmt][dtype] * bin(present).count("1") <= PREFETCH_SLOTS[mode]


def _maxnreg(fmt: str, dtype: torch.dtype) -> dict:
    cap = MAXNREG[fmt].get(dtype)
    return {} if cap is None or interpreting() else {"maxnreg": cap}


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
# table, tasks, grads, hp row, codes, norms, n_tiles, h0..h17, clip_ptr, clip_max; then constexprs
_N_RUNTIME_ARGS = 9 + HP_MAX
_CONSTEXPR_SLOTS = (None,) * (len(_step_kernel.arg_names) - _N_RUNTIME_ARGS)  # ignored by the launcher
_NO_FLOATS = (0.0,) * HP_MAX
_SUMS_CHUNK = 1024
SUM_SPLIT = 32  # parts per tensor: one load per lane of the step's one-warp programs
_SUMS_CONSTEXPRS = (None,) * (len(_tensor_sums_kernel.arg_names) - 4)  # after partials, ranges, sums, n_tiles
_SQUARES_CONSTEXPRS = (None,) * (len(_grad_squares_kernel.arg_names) - 5)  # after table, tasks, grads, partials, n
_PAIR_SCALARS_AT = 8  # the pair kernel's two groups' tables, tasks and grads, the split and the code tables first
_PAIR_CONSTEXPRS = (None,) * (len(_pair_kernel.arg_names) - _PAIR_SCALARS_AT - HP_MAX)
# a pair's smaller group runs without prefetch and under the larger's register cap: it may hold at most this share
# of the pair's elements
PAIR_SHARE = 1 / 16
LAUNCH_KEYS: set = set()  # static (compile-relevant) keys launched so far; tests read it

# ---- groups ----------------------------------------------------------------------------------------------

_TASKS = Bounded(16)


def not_capturable(why: str) -> RuntimeError:
    """The error of a step that cannot be captured in a CUDA graph, saying ``why``."""
    return RuntimeError(f"bnbf: this step cannot be captured in a CUDA graph: {why}")


# every table a launch reads reaches the device here: a copy from the host cannot be captured in a CUDA graph (a
# replay would read whatever the host buffer then holds), so a step whose tables are not made yet refuses capture
UPLOAD_WHILE_CAPTURING = (
    "its kernel tables would be copied from the host while capturing (tensors at addresses no step before the "
    "capture used); warm up by running the same step once before capturing, on the tensors the graph will use"
)


# The groups (and grad tables) of every launch captured in a CUDA graph, kept for good: a replay reads their device
# tables, which a cache's eviction or a later step's new grads would otherwise free. Once each: capturing the same
# step again holds nothing more.
HELD_BY_GRAPHS: dict = {}


def _to_device(t: Tensor, device: torch.device) -> Tensor:
    if device.type == "cpu":
        return t
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise not_capturable(UPLOAD_WHILE_CAPTURING)
    return t.pin_memory().to(device, non_blocking=True)


def _tasks(numels: tuple[int, ...], block: int, iters: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(tensor index, chunk index) per program, int32 [programs, 2], and per tensor the range of its
    tiles, int64 [tensors, 2] (the rows of the norm pass's partial sums); cached by the tensor sizes."""
    key = (device, block, ROWS * iters, numels)
    hit = _TASKS.touch(key)
    if hit is not None:
        return hit
    per_chunk = block * ROWS * iters
    chunks = torch.tensor([-(-n // per_chunk) for n in numels], dtype=torch.int64)
    tensor_idx = torch.repeat_interleave(torch.arange(len(numels)), chunks)
    starts = torch.cumsum(chunks, 0) - chunks
    chunk_idx = torch.arange(int(chunks.sum())) - torch.repeat_interleave(starts, chunks)
    tasks = _to_device(torch.stack([tensor_idx, chunk_idx], 1).to(torch.int32).contiguous(), device)
    ranges = _to_device(torch.stack([starts * iters, (starts + chunks) * iters], 1).contiguous(), device)
    return _TASKS.put(key, (tasks, ranges))


@dataclasses.dataclass
class Group:
    """What one launch needs apart from the grads and the scalars: built once, reused every step."""

    layout: Layout  # the states' storage: rule, bits, block size, format, kept slots
    dtype: torch.dtype
    device: torch.device
    table: Tensor  # int64 [tensors, HEAD + PER_SLOT * the rule's slots] on the device
    tasks: Tensor  # int32 [programs, 2] on the device
    ranges: Tensor  # int64 [tensors, 2]: each tensor's tiles (rows of the norm pass's partials)
    aligned: bool  # every param and state address is 16-byte aligned
    norms: bool  # the rule scales its update by per-tensor norms (a norm pass first)
    # some tensor's first block is not 0 (shards): only then does the kernel read the table's first-block
    # column (the load cost the bf16 dynamic-format step 2x on the H200: 6.5 -> 12.5 ms for 1.07B)
    shifted: bool = False
    # the last grad-pointer table uploaded: reused while the grads sit at the same addresses (the
    # caching allocator usually hands a training loop's grads the same blocks every step)
    grad_ptrs: tuple = ()  # (a plan's groups: only where the extension, which compares grad_packed, is not built)
    grad_packed: bytes = b""  # grad_ptrs as native uint64, for the compiled comparison
    grad_table: Tensor | None = None
    grads_aligned: bool = False
    # by launch configuration, what launches this group's compiled kernels without Triton's dispatch
    # (bnbf.kernels.direct_launch)
    compiled: dict = dataclasses.field(default_factory=dict)
    # the norm pass's scratch, made at the first step that needs it: per-tile partial sums [3, tiles] and
    # float64 parts of the per-tensor sums [tensors, 3, SUM_SPLIT]
    partials: Tensor | None = None
    sums: Tensor | None = None
    # launch_group's usual step: its arguments but the scalars, for the grad table they were made with
    plain_args: _PlainArgs | None = None

    @property
    def fmt(self) -> str:
        return self.layout.format  # "fp32" for 32-bit states

    @property
    def block(self) -> int:
        return tile_width(self.layout)


def first_blocks_of(params: list[Tensor]) -> list[int] | None:
    """Each param's first global block for the dither (:data:`bnbf.reference.FIRST_BLOCKS`, set around a step
    of shards by bnbf.distributed); None where every one is 0."""
    given = FIRST_BLOCKS.get()
    if not given:
        return None
    out = [given.get(p.data_ptr(), 0) for p in params]
    return out if any(out) else None


def build_group(p_in, p_out, s_in, s_out, layout: Layout, first_blocks: list[int] | None = None) -> Group:
    """Address table and task list for tensors sharing device, param dtype and state ``layout``.

    ``s_in``/``s_out`` hold, per tensor, the fields of its kept state slots (bit j of ``layout.present``:
    the rule's slot j is kept) in slot order, codes and absmax interleaved for 8-bit formats. In and out
    may be the same tensors (in place). ``first_blocks``: per tensor the global index of its first block
    (the dither's, see step_kernel's table); None takes them from :func:`first_blocks_of` (0 for all where
    none is set).
    """
    quant = layout.quantized
    rule = get_rule(layout.rule)
    slots = [j for j in range(len(rule.states)) if (layout.present >> j) & 1]
    per = 2 * len(slots) if quant else len(slots)
    device = p_in[0].device
    # the table column by column, in C-level loops (a pure call builds it every time)

    def ptrs(ts):
        return list(map(Tensor.data_ptr, ts))

    zeros = [0] * len(p_in)
    columns = [ptrs(p_in), ptrs(p_out)]
    for j in range(len(rule.states)):  # PER_SLOT columns each
        if j not in slots:
            columns += [zeros] * PER_SLOT.value
            continue
        k = slots.index(j)
        if quant:  # codes in, codes out, absmax in, absmax out
            columns += [
                ptrs(s_in[2 * k :: per]),
                ptrs(s_out[2 * k :: per]),
                ptrs(s_in[2 * k + 1 :: per]),
                ptrs(s_out[2 * k + 1 :: per]),
            ]
        else:
            columns += [ptrs(s_in[k::per]), ptrs(s_out[k::per]), zeros, zeros]
    aligned = functools.reduce(operator.or_, itertools.chain.from_iterable(columns)) % 16 == 0
    numels = list(map(Tensor.numel, p_in))
    if first_blocks is None:
        first_blocks = first_blocks_of(p_in) or zeros
    rows = list(zip(columns[0], columns[1], numels, first_blocks, *columns[2:]))
    table = _to_device(torch.tensor(rows, dtype=torch.int64), device)
    tasks, ranges = _tasks(tuple(numels), tile_width(layout), ITERS[layout.format][p_in[0].dtype], device)
    shifted = any(first_blocks)
    return Group(layout, p_in[0].dtype, device, table, tasks, ranges, aligned, rule.norms is not None, shifted=shifted)


def launch_group(
    group: Group,
    grads: list[Tensor],
    hp: Tensor | tuple,
    skip_zeros: bool = False,
    clip: bool = False,
    *,
    grads_placed: bool = False,
) -> None:
    """The step for one group: one launch, or three for rules that need per-tensor norms (LAMB, LARS)
    or with update clipping (``clip``: the last two scalars are max_unorm and lr).

    ``grads`` are contiguous, in the group's order; ``hp`` is the rule's scalars, either a tuple of Python
    floats (passed as kernel arguments), a float32 tensor [k] on the device, or a float32 tensor [tensors, k]
    on the device, one row per tensor of the group in its order (per-leaf hyperparameters in one launch);
    ``skip_zeros``: elements whose gradient is exactly 0 keep their param and states. ``grads_placed``: the
    caller (a plan) has made the group's grad table current, and ``grads`` are only held until the group's
    launches ran (a folded clip defers them; the grads may be copies no one else holds): any sequence holding
    them serves, and one with nothing in it where no clip is set. Where :data:`bnbf.reference.GRAD_CLIP` is set
    (``bnbf.update(..., max_grad_norm=)``), the kernel scales the grads by the clipping coefficient as it loads
    them, in the norm pass and the step alike. A folded clip (:meth:`bnbf.reference.GradClip.folded`, every eager
    clipped call) takes the group's sums of g² now and hands the group's launches to the clip, which runs them
    once every group's sums gave the coefficient (CLIP 2): a rule with ``norm_grad_powers`` (LARS) runs its norm
    pass now, summing every grad's squares too (CLIP 3), and its step takes the rule's sums scaled to the
    clipped grads (:func:`bnbf.reference.clipped_sums`); any other rule reads its grads once in
    ``_grad_squares_kernel`` (:func:`_fold_squares`), then runs its launches as without clipping, the grads
    scaled by the coefficient.
    """
    if type(hp) is not tuple:
        hp = host_numbers(hp, group.device)
    if not grads_placed:
        _place_grads(group, grads)
    grad_table = group.grad_table
    if group.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        HELD_BY_GRAPHS[id(group), id(grad_table)] = group, grad_table  # a replay reads them, whatever steps follow
    if type(hp) is tuple and not (clip or group.norms) and GRAD_CLIP.get() is None:
        # the usual step (scalars as kernel arguments, one launch): every other argument made once per grad
        # table (_plain_args), so that a launch joins three tuples
        made = group.plain_args
        if made is None or made.grad_table is not grad_table or made.table is not group.table or made.n_hp != len(hp):
            made = group.plain_args = _plain_args(group, grad_table, len(hp))
        key = made.key_skip if skip_zeros else made.key
        args = made.head + hp + made.tail
        launch(
            group.compiled,
            group.device,
            key,
            made.grid,
            args,
            lambda: _dispatch(group, grad_table, args, key, False, made.tensors),
        )
        return
    if isinstance(hp, tuple):
        from_ptr, per_tensor, n_hp, floats, hp_row = False, False, len(hp), hp + _NO_FLOATS[len(hp) :], group.table
    else:
        from_ptr, per_tensor, n_hp, floats, hp_row = True, hp.dim() == 2, hp.shape[-1], _NO_FLOATS, hp
    aligned = group.aligned and group.grads_aligned
    code_ptr = _codes(group.device, group.layout.quantized, group.table)
    grad_clip = GRAD_CLIP.get()
    folding = grad_clip is not None and grad_clip.folding
    if grad_clip is None or folding:
        clip_args = (0, group.table, 0.0)  # unused
    else:
        clip_args = grad_clip.kernel_args(group.device)
    iters = ITERS[group.fmt][group.dtype]
    grid = group.tasks.shape[0]
    n_tiles = grid * iters

    def run(norm_ptr, mode, clip_args=clip_args):
        clip_mode, clip_t, clip_max = clip_args
        clip_key = (clip_mode, clip_t.dtype) if clip_mode else 0
        # A step with a norm pass never claims alignment: with it, loads vectorize and each thread holds other
        # elements of a tile, so the tile's sums add in another order and a tensor's norm (then its step) would
        # depend on where it sits (a vmapped member against the same member stepped alone). The step after the
        # norm pass too: its aligned variant rounded bf16 LAMB's params differently in the last bit (H200).
        key = (mode, aligned and mode == 0, skip_zeros, n_hp, from_ptr, per_tensor, group.shifted, clip_key)
        tensors = (hp_row, code_ptr, norm_ptr, clip_t)
        args = _step_args(group, grad_table, tensors, n_tiles, floats, clip_max)
        launch(
            group.compiled,
            group.device,
            key,
            (grid, 1, 1),
            args,
            lambda: _dispatch(group, grad_table, args, key, clip, tensors),
        )

    if not (folding or group.norms or clip):
        run(group.table, 0)  # no norms: any pointer
        return
    if group.partials is None:  # scratch kept with the group: no allocation per step
        group.partials = torch.empty(3 * n_tiles, dtype=torch.float32, device=group.device)  # [3, tiles]
        group.sums = torch.empty(group.ranges.shape[0], 3, SUM_SPLIT, dtype=torch.float64, device=group.device)
    if folding:
        powers = get_rule(group.layout.rule).norm_grad_powers
        if powers is not None:
            _fold(group, grads, n_tiles, powers, grad_clip, run)
        else:
            steps = functools.partial(_launches, group, grads, n_tiles, clip, run)
            _fold_squares(group, grad_table, n_tiles, iters, grad_clip, steps)
        return
    _launches(group, grads, n_tiles, clip, run, clip_args)


def _place_grads(group: Group, grads: list[Tensor]) -> None:
    """Make ``group``'s grad table that of ``grads``: kept while they sit at the addresses of the last grads (the
    caching allocator usually hands a training loop's grads the same blocks every step), else made and uploaded."""
    if NATIVE is not None:
        if NATIVE.ptrs_equal(grads, group.grad_packed):
            return
        ptrs = tuple(map(Tensor.data_ptr, grads))
    elif (ptrs := tuple(map(Tensor.data_ptr, grads))) == group.grad_ptrs:
        return
    group.grad_table = _to_device(torch.tensor(ptrs, dtype=torch.int64), group.device)
    group.grad_ptrs = ptrs
    group.grad_packed = array.array("Q", ptrs).tobytes()
    group.grads_aligned = functools.reduce(operator.or_, ptrs) % 16 == 0


# where the scalars start in the step kernel's arguments (table, tasks, grads, scalar row, code tables, norm sums,
# tiles, then h0..h17, the clipping tensor and clip_max, then the constexprs)
_SCALARS_AT = 7


def _step_args(group: Group, grad_table: Tensor, tensors: tuple, n_tiles: int, floats: tuple, clip_max: float) -> tuple:
    """The step kernel's arguments as a launch takes them (:func:`bnbf.kernels.direct_launch.launch`): pointers as
    ints, the runtime arguments in the kernel's order, then a None per constexpr. ``tensors``: the scalar row, code
    tables, norm sums and clipping tensor; ``floats``: the HP_MAX scalars."""
    hp_row, code, norm, clip_t = tensors
    return (
        group.table.data_ptr(),
        group.tasks.data_ptr(),
        grad_table.data_ptr(),
        hp_row.data_ptr(),
        code.data_ptr(),
        norm.data_ptr(),
        n_tiles,
        *floats,
        clip_t.data_ptr(),
        clip_max,
        *_CONSTEXPR_SLOTS,
    )


class _PlainArgs(NamedTuple):
    """:func:`launch_group`'s usual step (scalars as kernel arguments, no norm pass, no clipping) for one group and
    grad table: its kernel arguments around the scalars, its configuration keys and grid (:func:`_plain_args`)."""

    grad_table: Tensor  # the grad table and group table they were made for
    table: Tensor
    n_hp: int  # the number of scalars
    head: tuple  # the arguments before the scalars
    tail: tuple  # the scalars' zero padding to HP_MAX, then the arguments after them (the constexprs' Nones last)
    key: tuple
    key_skip: tuple  # with skip_zeros
    grid: tuple
    tensors: tuple  # what the addresses in head and tail are of, for the dispatch


def _plain_args(group: Group, grad_table: Tensor, n_hp: int) -> _PlainArgs:
    """The :class:`_PlainArgs` of ``group`` with its current ``grad_table`` and ``n_hp`` scalars: the general path's
    arguments (:func:`_step_args`; the scalar row, norm and clipping pointers are the table's address, unused; the
    code tables' where the states are 8-bit) split around the scalars, and its keys."""
    code = _codes(group.device, group.layout.quantized, group.table)
    tensors = (group.table, code, group.table, group.table)
    grid = group.tasks.shape[0]
    args = _step_args(group, grad_table, tensors, grid * ITERS[group.fmt][group.dtype], _NO_FLOATS, 0.0)
    aligned, shifted = group.aligned and group.grads_aligned, group.shifted
    return _PlainArgs(
        grad_table,
        group.table,
        n_hp,
        args[:_SCALARS_AT],
        (*_NO_FLOATS[n_hp:], *args[_SCALARS_AT + HP_MAX :]),
        (0, aligned, False, n_hp, False, False, shifted, 0),
        (0, aligned, True, n_hp, False, False, shifted, 0),
        (grid, 1, 1),
        tensors,
    )


def _dispatch(group: Group, grad_table: Tensor, args: tuple, key: tuple, clip: bool, tensors: tuple) -> Any:
    """The step kernel through Triton's dispatch (which compiles it at a configuration's first launch), with the
    launch's ``args`` (:func:`_step_args`) and configuration ``key``; returns the compiled kernel. ``tensors``:
    the scalar row, code tables, norm sums and clipping tensor whose addresses ``args`` holds."""
    mode, aligned_loads, skip_zeros, n_hp, from_ptr, per_tensor, shifted, clip_key = key
    layout, fmt = group.layout, group.fmt
    hp_row, code_t, norm_t, clip_t = tensors
    rule = get_rule(layout.rule)
    norm_terms = rule.norms[0] if rule.norms is not None else None
    LAUNCH_KEYS.add(
        (
            layout.rule,
            fmt,
            layout.present,
            group.dtype,
            group.block,
            ROWS,
            NUM_WARPS,
            n_hp,
            from_ptr,
            per_tensor,
            aligned_loads,
            skip_zeros,
            clip,
            shifted,
            clip_key,
        )
    )
    n_tiles, floats = args[_SCALARS_AT - 1], args[_SCALARS_AT : _SCALARS_AT + HP_MAX]
    clip_max = args[_SCALARS_AT + HP_MAX + 1]
    return _step_kernel[(group.tasks.shape[0],)](
        group.table,
        group.tasks,
        grad_table,
        hp_row,
        code_t,
        norm_t,
        n_tiles,
        *floats,
        clip_t,
        clip_max,
        HP_FROM_PTR=from_ptr,
        HP_PER_TENSOR=per_tensor,
        FIRST_BLOCK=shifted,
        MATH=rule.math,
        SLOTS=len(rule.states),
        PRESENT=layout.present,
        SIGNED=rule.signed_mask,
        QUANT=layout.quantized,
        P_DTYPE=_TL_DTYPES[group.dtype],
        HP_STRIDE=n_hp,
        BLOCK=group.block,
        ROWS=ROWS,
        SOFT_BF16=interpreting(),
        FORMAT=FORMATS[fmt],
        ALIGNED=aligned_loads,
        VEC=VEC[fmt],
        ITERS=ITERS[fmt][group.dtype],
        PREFETCH=_prefetch(fmt, group.dtype, layout.present, mode),
        SKIP_ZEROS=skip_zeros,
        NORM_MODE=mode,
        NORM_TERMS=norm_terms,
        SUM_SPLIT=SUM_SPLIT,
        CLIP=clip_key[0] if clip_key else 0,
        num_warps=NUM_WARPS,
        **_maxnreg(fmt, group.dtype),
    )


# ---- two groups in one launch ----------------------------------------------------------------------------


@dataclasses.dataclass
class Pair:
    """Two groups of one plan whose usual steps run in one launch (:func:`launch_pair`): ``a`` the larger."""

    a: Group
    b: Group
    compiled: dict = dataclasses.field(default_factory=dict)  # as Group.compiled
    plain_args: tuple | None = None  # (a's grad table, b's, the number of scalars, head, tail, key, key_skip, grid)


def pair_of(groups: list[Group]) -> Pair | None:
    """The :class:`Pair` of a plan's two groups where one launch can step both: one device and rule with the same
    kept slots, no per-tensor norms, no shard offsets, both with tiles, the smaller holding at most
    :data:`PAIR_SHARE` of the elements (a model's 8-bit states and the 32-bit states of its biases and norms,
    which bitsandbytes keeps for tensors under ``min_8bit_size``); else None."""
    if len(groups) != 2:
        return None
    b, a = sorted(groups, key=_elements)
    la, lb = a.layout, b.layout
    ok = (
        a.device == b.device
        and la.rule == lb.rule
        and la.present == lb.present
        and not (a.norms or a.shifted or b.shifted)
        and a.tasks.shape[0] > 0
        and b.tasks.shape[0] > 0
        and _elements(b) <= PAIR_SHARE * _elements(a)
    )
    return Pair(a, b) if ok else None


def _elements(group: Group) -> int:
    """The elements of ``group``'s tiles, from the host's view of its task list (no read from the device)."""
    return group.tasks.shape[0] * ITERS[group.fmt][group.dtype] * ROWS * group.block


def launch_pair(pair: Pair, hp: tuple, skip_zeros: bool = False) -> None:
    """Both groups' usual step (``hp``: Python floats; no clipping) in one launch of :func:`_pair_kernel`, their
    grad tables made current by the caller (a plan)."""
    a, b = pair.a, pair.b
    made = pair.plain_args
    if made is None or made[0] is not a.grad_table or made[1] is not b.grad_table or made[2] != len(hp):
        made = pair.plain_args = _pair_args(pair, len(hp))
    key = made[6] if skip_zeros else made[5]
    args = made[3] + hp + made[4]
    launch(pair.compiled, a.device, key, made[7], args, lambda: _dispatch_pair(pair, args, key))


def _pair_args(pair: Pair, n_hp: int) -> tuple:
    """:attr:`Pair.plain_args` for the groups' current grad tables and ``n_hp`` scalars."""
    a, b = pair.a, pair.b
    code = _codes(a.device, a.layout.quantized or b.layout.quantized, a.table)
    split = a.tasks.shape[0]
    head = (
        a.table.data_ptr(),
        a.tasks.data_ptr(),
        a.grad_table.data_ptr(),
        b.table.data_ptr(),
        b.tasks.data_ptr(),
        b.grad_table.data_ptr(),
        split,
        code.data_ptr(),
    )
    aligned = (a.aligned and a.grads_aligned, b.aligned and b.grads_aligned)
    key = ("pair", n_hp, False, aligned)
    return (
        a.grad_table,
        b.grad_table,
        n_hp,
        head,
        (*_NO_FLOATS[n_hp:], *_PAIR_CONSTEXPRS),
        key,
        ("pair", n_hp, True, aligned),
        (split + b.tasks.shape[0], 1, 1),
    )


def _dispatch_pair(pair: Pair, args: tuple, key: tuple) -> Any:
    """:func:`_pair_kernel` through Triton's dispatch (its first launch of a configuration compiles it)."""
    _, n_hp, skip_zeros, (aligned_a, aligned_b) = key
    a, b = pair.a, pair.b
    rule = get_rule(a.layout.rule)
    LAUNCH_KEYS.add(("pair", a.layout.rule, a.fmt, b.fmt, a.layout.present, a.dtype, b.dtype, n_hp, skip_zeros))
    code = _codes(a.device, a.layout.quantized or b.layout.quantized, a.table)
    floats = args[_PAIR_SCALARS_AT : _PAIR_SCALARS_AT + HP_MAX]
    grid = (a.tasks.shape[0] + b.tasks.shape[0],)
    return _pair_kernel[grid](
        a.table,
        a.tasks,
        a.grad_table,
        b.table,
        b.tasks,
        b.grad_table,
        a.tasks.shape[0],
        code,
        *floats,
        MATH=rule.math,
        SLOTS=len(rule.states),
        PRESENT=a.layout.present,
        SIGNED=rule.signed_mask,
        HP_STRIDE=n_hp,
        ROWS=ROWS,
        SOFT_BF16=interpreting(),
        SKIP_ZEROS=skip_zeros,
        **_half(a, aligned_a, ""),
        **_half(b, aligned_b, "2"),
        PREFETCH=_prefetch(a.fmt, a.dtype, a.layout.present, 0),
        num_warps=NUM_WARPS,
        **_maxnreg(a.fmt, a.dtype),
    )


def _half(group: Group, aligned: bool, suffix: str) -> dict:
    """The constexprs of one group's half of :func:`_pair_kernel` (names ending in ``suffix``)."""
    values = {
        "QUANT": group.layout.quantized,
        "P_DTYPE": _TL_DTYPES[group.dtype],
        "BLOCK": group.block,
        "FORMAT": FORMATS[group.fmt],
        "ALIGNED": aligned,
        "VEC": VEC[group.fmt],
        "ITERS": ITERS[group.fmt][group.dtype],
    }
    return {name + suffix: v for name, v in values.items()}


def _launches(group: Group, grads: list, n_tiles: int, clip: bool, run, clip_args) -> None:
    """:func:`launch_group`'s launches with the clipping arguments ``clip_args`` (the kernel's CLIP, clip_ptr,
    clip_max): the step, after the norm pass and its sums where the rule or ``clip`` needs norms. ``grads`` only
    held (a deferred call's may be copies that no one else holds)."""
    if not (group.norms or clip):
        run(group.table, 0, clip_args)  # no norms: any pointer
        return
    run(group.partials, 1, clip_args)
    _launch_sums(group, n_tiles)
    reduce = NORM_REDUCE.get()
    if reduce is not None:  # sharded tensors: each shard's sums -> the whole tensor's (bnbf.distributed)
        reduce(group.sums)
    run(group.sums, 2, clip_args)


def _fold_squares(group: Group, grad_table: Tensor, n_tiles: int, iters: int, grad_clip, steps) -> None:
    """A folded clip's share of :func:`launch_group` for a rule whose norm pass cannot give the total (or that has
    none): one launch reading the group's grads (``_grad_squares_kernel``, the step's tiles: each tile's float32
    sum of g², every element) and the per-tensor float64 sums (``_tensor_sums_kernel``), handed to the clip with
    ``steps(clip_args)``, the group's launches, run once the clip has its coefficient (CLIP 2)."""
    grid = group.tasks.shape[0]
    if grid:  # (a group of numel-0 tensors has no tiles: its sums are 0)
        row = group.table.shape[1]
        args = (
            group.table.data_ptr(),
            group.tasks.data_ptr(),
            grad_table.data_ptr(),
            group.partials.data_ptr(),
            n_tiles,
            *_SQUARES_CONSTEXPRS,
        )
        dtype, block = _TL_DTYPES[group.dtype], group.block

        def dispatch():
            LAUNCH_KEYS.add(("squares", group.dtype, block, iters, row))
            return _grad_squares_kernel[(grid,)](
                group.table,
                group.tasks,
                grad_table,
                group.partials,
                n_tiles,
                ROW=row,
                G_DTYPE=dtype,
                BLOCK=block,
                ITERS=iters,
                num_warps=NUM_WARPS,
            )

        launch(group.compiled, group.device, "squares", (grid, 1, 1), args, dispatch)
    _launch_sums(group, n_tiles)
    sq = group.sums[:, 2].sum(-1)  # float64 [tensors], the parts in a fixed order (the scratch is free again)
    grad_clip.fold(sq, group.dtype, functools.partial(_deferred, group.device, grad_clip, steps))


def _deferred(device: torch.device, grad_clip, steps) -> None:
    """A folded clip's deferred launches of a group, with the coefficient (CLIP 2)."""
    args = grad_clip.kernel_args(device)
    with launch_lock(device.type == "cpu"):
        steps(args)


def _fold(group: Group, grads: list, n_tiles: int, powers: tuple, grad_clip, run) -> None:
    """A folded clip's share of :func:`launch_group`: the norm pass (CLIP 3) and the per-tensor sums now; the
    step once the clip has every group's sums (:meth:`bnbf.reference.GradClip.finish`)."""
    run(group.partials, 1, (3, group.table, 0.0))
    _launch_sums(group, n_tiles)
    per = group.sums.sum(-1)  # float64 [tensors, 3], as the step adds the parts (the scratch is free again)
    # the step holds the grads until it has launched: they may be copies that no one else holds
    grad_clip.fold(per[:, 2], group.dtype, functools.partial(_folded_step, group, grads, per, powers, grad_clip, run))


def _folded_step(group: Group, grads: list, per: Tensor, powers: tuple, grad_clip, run) -> None:
    """The step of a folded clip: the rule's sums of the clipped grads, each tensor's in part 0 of its parts
    (the step adds zeros to it), and the grads scaled by the coefficient (CLIP 2)."""
    scaled = clipped_sums(per, powers, grad_clip.coef(group.device))
    folded = torch.nn.functional.pad(scaled[..., None], (0, SUM_SPLIT - 1))
    args = grad_clip.kernel_args(group.device)
    with launch_lock(group.device.type == "cpu"):
        run(folded, 2, args)


def _launch_sums(group: Group, n_tiles: int) -> None:
    """One launch adding every tensor's partials of ``group`` into ``group.sums`` [tensors, 3, SUM_SPLIT]."""
    grid = (group.ranges.shape[0], SUM_SPLIT, 1)
    args = (group.partials.data_ptr(), group.ranges.data_ptr(), group.sums.data_ptr(), n_tiles, *_SUMS_CONSTEXPRS)
    launch(
        group.compiled,
        group.device,
        "sums",
        grid,
        args,
        lambda: _tensor_sums_kernel[grid](
            group.partials, group.ranges, group.sums, n_tiles, CHUNK=_SUMS_CHUNK, SPLIT=SUM_SPLIT
        ),
    )


_CODE_TABLES: dict[torch.device, Tensor] = {}


def _codes(device: torch.device, quantized: bool, unused: Tensor) -> Tensor:
    """The code-tables argument of a launch: the tables where it steps 8-bit states, else ``unused`` (any tensor
    of the device: the kernel does not read it)."""
    return _code_tables(device) if quantized else unused


def _code_tables(device: torch.device) -> Tensor:
    """Signed map then unsigned map, float32[512], cached per device."""
    t = _CODE_TABLES.get(device)
    if t is None:
        t = torch.cat([dynamic_map(True, device), dynamic_map(False, device)]).contiguous()
        _CODE_TABLES[device] = t
    return t

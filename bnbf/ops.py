"""``torch.library`` ops for the optimizer step, and the dispatch between the two paths.

``bnbf::step_`` updates params and states in place; ``bnbf::step`` returns new tensors. Both run the
Triton multi-tensor kernel on GPU tensors (and on CPU tensors under ``TRITON_INTERPRET=1``) through
:mod:`bnbf.kernels.launcher`, and the pure-torch reference (:mod:`bnbf.reference`) otherwise. Their fake
implementations let tracers see them without running a kernel. The states' layout (:class:`bnbf.state.Layout`)
travels as one object; only the ops' schemas, which take no Python objects, spell out its fields.

Calls that no plan serves (the pure step, compiled steps) take their launcher groups from a cache keyed by the
tables' contents. A call of an op on plain CPU or CUDA tensors (what a compiled graph makes) runs the step from the
op's Autograd kernel, without torch.library's two further trips through Python (:func:`register_direct`).
Under ``torch.func.vmap`` the members of stacked tensors are stepped in one call, written into stacked outputs,
with host work that does not grow with the member count (:mod:`bnbf.kernels.members`).
"""

from __future__ import annotations

import array
import contextlib
import functools
import itertools
import operator
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch._C import _functorch
from torch._C._functorch import TransformType

from bnbf._bounded import Bounded
from bnbf._dispatch import BUILD_LOCK, launch_lock, use_triton
from bnbf._host_checks import (
    NATIVE,
    _check_grads_apart,
    _check_no_overlap,
    _grad_overlap,
    _names,
    _overlap,
    _overlaps_itself,
)
from bnbf.reference import FIRST_BLOCKS, GRAD_CLIP, reference_step
from bnbf.rules.base import as_scalar_row
from bnbf.state import Layout

# why a step cannot be captured in a CUDA graph on the GPU, by route (the in-place steps can, once warmed up)
PURE_NOT_CAPTURABLE = (
    "the pure update writes new outputs, whose kernel tables are copied from the host at every step; capture "
    "bnbf.update_ (in place) after a warm-up step"
)
PACKED_NOT_CAPTURABLE = "a packed state's step is not capturable; capture bnbf.update_ of the per-param state"
# a compiled step reaches the op with its scalars computed in the graph, maybe from Python numbers that a replay
# would repeat (a frozen lr); the op cannot tell, so it refuses
OP_NOT_CAPTURABLE = (
    "it runs through the bnbf::step_ op (a compiled step, tensor subclasses), whose scalars may come from Python "
    "numbers a replay would repeat; capture the eager bnbf.update_ with the step and lr as 0-d device tensors"
)


def _refuse_capture(device: torch.device, why: str | None = PURE_NOT_CAPTURABLE) -> None:
    """Raise while a CUDA graph is captured where a replay would not redo the step: tensors stepped on the host, or
    a GPU route that cannot be captured (``why``; None for the in-place steps, whose tables a warm-up made: one not
    made refuses in :func:`bnbf.kernels.launcher._to_device`)."""
    if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():  # (a capture initialises CUDA)
        if device.type != "cuda":
            why = f"its {device.type} tensors are stepped on the host, which a replay of the graph would skip"
        elif why is None:
            return
        from bnbf.kernels.launcher import not_capturable

        raise not_capturable(why)


def _run(p_in, p_out, grads, s_in, s_out, hp, layout: Layout, skip_zeros, clip) -> None:
    _refuse_capture(p_in[0].device, None if p_out is p_in else PURE_NOT_CAPTURABLE)
    if use_triton(p_in[0]):
        from bnbf.kernels.launcher import launch_group

        with BUILD_LOCK:  # see bnbf._dispatch: the build under a lock, the launch outside it
            group = _group(p_in, p_out, s_in, s_out, layout)
        with launch_lock(p_in[0].device.type == "cpu"):
            launch_group(group, grads, hp, skip_zeros, clip)
    else:
        reference_step(p_in, p_out, grads, s_in, s_out, _as_row(hp, p_in), layout, skip_zeros, clip)


# Groups of the calls that no plan serves (the pure step, traced and compiled calls), by the exact contents of
# their tables: a compiled step calls the op afresh each time, and a pure loop's outputs of a few distinct sizes
# (flat params) alternate between a few allocations; many same-sized outputs come back permuted, a miss each call
# (members.plain_group keeps a miss cheap). A hit is right whatever tensors the addresses now belong to, and an
# entry holds no caller tensor.
# Each entry is (group, probe); the probe lets a call be matched against an entry by the compiled host checks
# (addresses compared in C++, no Python int per tensor): GPT-2's two groups 69 -> 37 us a step (CPU, launch stubbed).
_GROUPS = Bounded(16)


class _Probe(NamedTuple):
    """What decides a group's table besides its layout, dtype and device (``sig``): the numels of the params
    and the packed addresses (native uint64) of every tensor; ``p_out``/``s_out`` None where in place."""

    sig: tuple
    numels: tuple
    p_in: bytes
    p_out: bytes | None
    s_in: bytes
    s_out: bytes | None

    def matches(self, p_in, p_out, s_in, s_out) -> bool:
        eq = NATIVE.ptrs_equal
        return (
            eq(p_in, self.p_in)
            and eq(s_in, self.s_in)
            and (self.p_out is None or eq(p_out, self.p_out))
            and (self.s_out is None or eq(s_out, self.s_out))
            and tuple(map(Tensor.numel, p_in)) == self.numels
        )


def _packed(ptrs: tuple | None) -> bytes | None:
    return None if ptrs is None else array.array("Q", ptrs).tobytes()


def _group(p_in, p_out, s_in, s_out, layout: Layout):
    """:func:`bnbf.kernels.launcher.build_group`'s group (made from the tensors' structure,
    :func:`bnbf.kernels.members.plain_group`), cached by the addresses, sizes, layout, dtype and device that decide
    its table (the caller holds BUILD_LOCK)."""
    from bnbf.kernels.launcher import build_group
    from bnbf.kernels.members import plain_addresses, plain_group

    if FIRST_BLOCKS.get():  # shards of a larger tensor: their first blocks are in the table too (bnbf.distributed)
        return build_group(p_in, p_out, s_in, s_out, layout)
    sig = (layout, p_in[0].dtype, p_in[0].device, p_out is p_in, s_out is s_in)
    if NATIVE is not None:
        for key, (group, probe) in reversed(_GROUPS.items()):  # the most recent first
            if probe.sig == sig and probe.matches(p_in, p_out, s_in, s_out):
                _GROUPS.move_to_end(key)  # and out of the loop, whose iterator this invalidates
                return group
    # the addresses gathered in one compiled pass (a pure step's fresh outputs miss every call: no Python int a tensor)
    addresses, packed, aligned = plain_addresses(p_in, p_out, s_in, s_out)
    key = (sig, tuple(map(Tensor.numel, p_in)), packed)
    entry = _GROUPS.touch(key)
    if entry is not None:
        return entry[0]
    group = plain_group(p_in, p_out, s_in, s_out, layout, (addresses, aligned))
    n, m = 8 * len(p_in), 8 * len(s_in)
    cuts = (packed[:n], None if p_out is p_in else packed[n : 2 * n], packed[2 * n : 2 * n + m])
    _GROUPS.put(key, (group, _Probe(sig, key[1], *cuts, None if s_out is s_in else packed[2 * n + m :])))
    return group


_PLAIN_TYPES = frozenset({Tensor, torch.nn.Parameter})


def _direct(params, grads, states, hp) -> bool:
    """Whether a call may skip the op's dispatch: plain tensors outside tracing and torch.func transforms.
    Anything else goes through the op, whose dispatch gives it a supported route or a clear error: tracing
    and FakeTensorMode the fake implementation, ``vmap`` the batching rule (:func:`_step_vmap`), a subclass
    such as DTensor its own handling of custom ops. None of them reaches a kernel without storage."""
    return (
        not torch.compiler.is_compiling()
        and _functorch.maybe_current_level() is None
        and set(map(type, params)) <= _PLAIN_TYPES
        and set(map(type, grads)) <= _PLAIN_TYPES
        and set(map(type, states)) <= _PLAIN_TYPES
        and (type(hp) is tuple or type(hp) in _PLAIN_TYPES)
    )


def step_(params, grads, states, hp, layout: Layout, skip_zeros: bool, clip: bool, unwrapped=None) -> None:
    """In-place step; eager calls go straight to the launcher (the op's dispatch costs ~5 us a tensor), and calls
    under ``vmap`` step the stacked tensors in place (:func:`_step_vmapped_`, given ``unwrapped`` where the caller
    has them)."""
    if not _direct(params, grads, states, hp):
        if _step_vmapped_(params, grads, states, hp, layout, skip_zeros, clip, unwrapped):
            return None
        return _step_op_(params, grads, states, _as_row(hp, params), *layout, skip_zeros, clip)
    _run(params, params, grads, states, states, hp, layout, skip_zeros, clip)


def step(params, grads, states, hp, layout: Layout, skip_zeros: bool, clip: bool):
    """Out-of-place step; eager calls skip the op's dispatch as :func:`step_` does, and so do calls under
    ``vmap`` whose tensors the batching rule would step stacked (:func:`_step_vmapped`)."""
    if not _direct(params, grads, states, hp):
        out = _step_vmapped(params, grads, states, hp, layout, skip_zeros, clip)
        if out is not None:
            return out
        return _step_op(params, grads, states, _as_row(hp, params), *layout, skip_zeros, clip)
    return _step_impl(params, grads, states, hp, layout, skip_zeros, clip)


def _step_impl(params, grads, states, hp, layout, skip_zeros, clip):
    # the inputs are contiguous (update makes its params so and checks its states), so empty_like's
    # default (preserve the strides) gives contiguous outputs; mapped, it costs half a comprehension with
    # keyword arguments (740 tensors for GPT-2's 148 with 8-bit Adam)
    new_params = list(map(torch.empty_like, params))
    new_states = list(map(torch.empty_like, states))
    _run(params, new_params, grads, states, new_states, hp, layout, skip_zeros, clip)
    return new_params, new_states


@torch.library.custom_op("bnbf::step_", mutates_args=("params", "states"))
def _step_op_(
    params: list[Tensor],
    grads: list[Tensor],
    states: list[Tensor],
    hp: Tensor,
    rule: str,
    bits: int,
    block_size: int,
    fmt: str,
    present: int,
    skip_zeros: bool,
    clip: bool,
) -> None:
    _run(params, params, grads, states, states, hp, Layout(rule, bits, block_size, fmt, present), skip_zeros, clip)


@_step_op_.register_fake
def _(params, grads, states, hp, rule, bits, block_size, fmt, present, skip_zeros, clip) -> None:
    return None


def _register_version_bump() -> None:
    """The in-place op's ADInplaceOrView kernel (what a compiled step runs): the params' and states' version
    counters bumped one list at a time. torch.library's own kernel bumps them one Python call per tensor, half of
    the op's dispatch with GPT-2's 740 tensors (0.18 -> 0.09 ms a call, CPU). Where this torch lacks the private
    functions it needs, torch's kernel stays."""
    bump = getattr(torch._C, "_increment_version", None)
    below = getattr(torch._C, "_after_ADInplaceOrView_keyset", None)
    lib = getattr(_step_op_, "_lib", None)
    if bump is None or below is None or lib is None:
        return
    op = torch.ops.bnbf.step_.default

    def version_bump(keyset, params, grads, states, *args):
        bump(params)
        bump(states)
        return op.redispatch(keyset & below, params, grads, states, *args)

    _override(lib, "step_", version_bump, "ADInplaceOrView")


def _override(lib: Any, name: str, kernel: Callable, key: str) -> None:
    """Register ``kernel`` for ``key`` in place of the one torch.library registered for the op. torch 2.11's
    ``Library.impl`` refuses that unless ``allow_override=True`` (torch 2.13 allows it by default); a torch without
    that argument is asked without it; where it still refuses, torch.library's kernel stays (slower, the same
    results)."""
    try:
        lib.impl(name, kernel, key, with_keyset=True, allow_override=True)
    except TypeError:  # a torch without allow_override
        with contextlib.suppress(RuntimeError):
            lib.impl(name, kernel, key, with_keyset=True)
    except RuntimeError:
        pass


_register_version_bump()


@torch.library.custom_op("bnbf::step", mutates_args=())
def _step_op(
    params: list[Tensor],
    grads: list[Tensor],
    states: list[Tensor],
    hp: Tensor,
    rule: str,
    bits: int,
    block_size: int,
    fmt: str,
    present: int,
    skip_zeros: bool,
    clip: bool,
) -> tuple[list[Tensor], list[Tensor]]:
    return _step_impl(params, grads, states, hp, Layout(rule, bits, block_size, fmt, present), skip_zeros, clip)


@_step_op.register_fake
def _(params, grads, states, hp, rule, bits, block_size, fmt, present, skip_zeros, clip):
    return [torch.empty_like(p) for p in params], [torch.empty_like(s) for s in states]


def traced_scalar_row(values, device: torch.device, dtype: torch.dtype = torch.float32) -> Tensor:
    """The step's scalars as one row in a call traced by torch.compile, numbers traced as inputs (SymInt/SymFloat)
    and tensors left unread on the host.

    Built as one elementwise expression (a ``where`` per scalar over an index) rather than a stack: Inductor
    lowers a stack of more than 8 scalars to one kernel per scalar (13 launches for AdamW on a GPU), and the
    expression to a single kernel.

    Args:
        values: the scalars (Python numbers, SymInt/SymFloat, or 0-d tensors), as :func:`bnbf.plan._scalars`
            gives them.
        device: where the row goes.
        dtype: float32 (what the kernels read), or float64 for a host row of numbers (:func:`host_numbers`).

    Returns:
        A tensor ``[len(values)]`` of ``dtype``; numbers rounded from float64 once, as :func:`torch.stack` of
        ``torch.scalar_tensor(v, dtype=torch.float64).to(dtype)`` rounds them.

    Example:
        >>> traced_scalar_row((0.5, torch.tensor(2.0)), torch.device("cpu"))
        tensor([0.5000, 2.0000])
    """
    index = torch.arange(len(values), device=device)
    row = torch.zeros(len(values), dtype=dtype, device=device)
    for k, v in enumerate(values):
        if isinstance(v, Tensor):
            part = v.to(device=device, dtype=dtype).reshape(())
        else:  # a number added to a tensor: Dynamo keeps a float input a graph input ("tensorified"), where
            # scalar_tensor or full of it would make it a constant, one compile per value under Inductor
            part = (torch.zeros((), dtype=torch.float64, device=device) + v).to(dtype)
        row = torch.where(index == k, part, row)
    return row


HOST = torch.device("cpu")


def is_host_row(hp: Any) -> bool:
    """Whether a call's scalars are a host row: float64 on the CPU, what :func:`bnbf.plan._one_set` makes of a traced
    call's numbers (every other row is float32, on the params' device)."""
    return isinstance(hp, Tensor) and hp.dtype == torch.float64 and hp.device.type == "cpu"


def host_numbers(hp: Any, device: torch.device) -> Any:
    """The scalars of a launch on ``device`` as its kernel takes them: a host row (float64 on the CPU: a traced
    call whose scalars are all numbers, :func:`bnbf.plan._one_set`) as the Python floats an eager call passes, so
    that a compiled step runs the kernel an eager step with numbers runs (arguments, not a row read on the
    device); anything else as it is. Every launch (:func:`bnbf.kernels.launcher.launch_group`) and every reference
    step's row (:func:`_as_row`) passes through here. The row is read on the host: no device synchronisation. A
    CUDA graph captured with it would replay the numbers it was captured with, so capturing one raises."""
    if not is_host_row(hp) or torch.compiler.is_compiling():  # traced: the graph's op call reads it when it runs
        return hp
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        from bnbf.kernels.launcher import not_capturable

        raise not_capturable(
            "lr and step must be 0-d tensors on the params' device to capture a compiled step in a CUDA graph "
            "(Python numbers would be replayed as their captured values)"
        )
    return tuple(hp.tolist())


def register_direct(op: Any, name: str, direct: Callable) -> None:
    """Make ``direct`` the Autograd kernel of the custom op ``op`` (``name``: its name in its library) for calls that
    need nothing else: where nothing below autograd but the CPU or CUDA backend remains (no fake, functional or
    subclass tensor, no dispatch mode) and no derivative is asked for, ``direct(*args)`` runs the step as the
    backend kernel would (an in-place op's ``direct`` bumps its outputs' versions itself). This is the kernel a
    compiled graph's call of the op reaches first; torch.library's route crosses from C++ to Python three times
    (autograd, version bump, backend), each converting the op's tensor lists: 215 -> 96 us for GPT-2's two calls of
    the per-param step (CPU). Anything else takes torch.library's kernel. Where this torch lacks the private
    functions used, torch.library's kernel stays."""
    try:
        from torch._library.autograd import make_autograd_impl  # what torch.library registers
    except ImportError:
        return
    below = getattr(torch._C, "_after_ADInplaceOrView_keyset", None)
    any_grad = getattr(torch._C, "_any_requires_grad", None)
    if below is None or any_grad is None or _BUMP is None or getattr(op, "_lib", None) is None:
        return
    backends = (torch._C.DispatchKey.CPU, torch._C.DispatchKey.CUDA)
    grad_enabled = torch.is_grad_enabled
    fallback = make_autograd_impl(op._opoverload, op)

    def autograd_kernel(keyset, *args):
        if (keyset & below).highestPriorityTypeId() in backends and not (grad_enabled() and any_grad(*args)):
            return direct(*args)
        return fallback(keyset, *args)

    _override(op._lib, name, autograd_kernel, "Autograd")


def _step_in_place(params, grads, states, hp, rule, bits, block_size, fmt, present, skip_zeros, clip):
    _refuse_capture(params[0].device, OP_NOT_CAPTURABLE)
    _BUMP(params)
    _BUMP(states)
    layout = Layout(rule, bits, block_size, fmt, present)
    _run(params, params, grads, states, states, hp, layout, skip_zeros, clip)


def _step_pure(params, grads, states, hp, rule, bits, block_size, fmt, present, skip_zeros, clip):
    layout = Layout(rule, bits, block_size, fmt, present)
    return _step_impl(params, grads, states, hp, layout, skip_zeros, clip)


_BUMP = getattr(torch._C, "_increment_version", None)


# ---- two groups in one launch, traced --------------------------------------------------------------------------------


def step_pair_(params, grads, states, params2, grads2, states2, hp: Tensor, layout: Layout, layout2: Layout,
               skip_zeros: bool) -> None:  # fmt: skip
    """Two groups' in-place step through one op call (a traced step's 8-bit states and the 32-bit states of its
    small tensors, on one device, scalars a host row: Python numbers, which the pair kernel takes as arguments; no
    clipping): one launch of the pair kernel where :func:`bnbf.kernels.launcher.pair_of` takes the two groups, as
    the eager step's plan launches them; else one launch each."""
    _step_pair_op_(params, grads, states, params2, grads2, states2, hp, *layout, *layout2, skip_zeros)


@torch.library.custom_op("bnbf::step_pair_", mutates_args=("params", "states", "params2", "states2"))
def _step_pair_op_(
    params: list[Tensor],
    grads: list[Tensor],
    states: list[Tensor],
    params2: list[Tensor],
    grads2: list[Tensor],
    states2: list[Tensor],
    hp: Tensor,
    rule: str,
    bits: int,
    block_size: int,
    fmt: str,
    present: int,
    rule2: str,
    bits2: int,
    block_size2: int,
    fmt2: str,
    present2: int,
    skip_zeros: bool,
) -> None:
    _step_pair_in_place(params, grads, states, params2, grads2, states2, hp, rule, bits, block_size, fmt, present,
                        rule2, bits2, block_size2, fmt2, present2, skip_zeros)  # fmt: skip


def _step_pair_in_place(params, grads, states, params2, grads2, states2, hp, *args) -> None:
    """The pair op's kernel, also its direct one (:func:`register_direct`); :func:`_run_pair` bumps the versions."""
    layouts = Layout(*args[:5]), Layout(*args[5:10])
    _run_pair((params, grads, states), (params2, grads2, states2), hp, layouts, args[10])


@_step_pair_op_.register_fake
def _(params, grads, states, params2, grads2, states2, hp, *args) -> None:
    return None


# pairs of the groups of traced calls (bnbf.kernels.launcher.Pair: its compiled kernels and arguments), by the two
# groups' ids; an entry is used only for the very groups it holds, which hold no caller tensor
_PAIRS = Bounded(8)


def _run_pair(first: tuple, second: tuple, hp: Any, layouts: tuple, skip_zeros: bool) -> None:
    device = first[0][0].device
    _refuse_capture(device, OP_NOT_CAPTURABLE)
    hp = host_numbers(hp, device)
    if use_triton(first[0][0]) and type(hp) is tuple:
        from bnbf.kernels.launcher import _place_grads, launch_pair, pair_of

        with BUILD_LOCK:
            a = _group(first[0], first[0], first[2], first[2], layouts[0])
            b = _group(second[0], second[0], second[2], second[2], layouts[1])
            key = id(a), id(b)
            pair = _PAIRS.get(key)
            if pair is None or {id(pair.a), id(pair.b)} != set(key):
                pair = _PAIRS.put(key, pair_of([a, b]))
        if pair is not None and GRAD_CLIP.get() is None:
            if _BUMP is not None:
                for ts in (first[0], first[2], second[0], second[2]):
                    _BUMP(ts)
            with launch_lock(False):
                _place_grads(a, first[1])
                _place_grads(b, second[1])
                launch_pair(pair, hp, skip_zeros)
            return
    for (params, grads, states), layout in zip((first, second), layouts):
        if _BUMP is not None:
            _BUMP(params)
            _BUMP(states)
        _run(params, params, grads, states, states, hp, layout, skip_zeros, False)


UNBATCHED_IN_PLACE = (
    "bnbf: the in-place step under vmap cannot write {what}: it is not batched (one tensor shared by every member), "
    "so it cannot take each member's own step in place (torch's vmap refuses such in-place writes)"
)
register_direct(_step_op_, "step_", _step_in_place)
register_direct(_step_op, "step", _step_pure)
register_direct(_step_pair_op_, "step_pair_", _step_pair_in_place)


def _members(tensors: list, dims: list, size: int) -> list[list[Tensor]]:
    """Each tensor as ``size`` member tensors (views along its batch dim; the tensor itself where unbatched)."""
    out = []
    for t, d in zip(tensors, dims):
        out.append([t] * size if d is None else [m.contiguous() for m in t.movedim(d, 0).unbind(0)])
    return out


def _row_list(hp: Any) -> list:
    """The scalars' tensor as a list for :func:`_unwrapped`: none where they are Python numbers."""
    return [] if type(hp) is tuple else [hp]


def _as_row(hp: Any, params: list) -> Tensor:
    """The scalars as the op and the reference step take them: Python numbers (kernel arguments elsewhere) and a
    host row of them (:func:`host_numbers`) as one float32 row on the params' device, as kernel arguments round
    them."""
    hp = host_numbers(hp, params[0].device)
    return as_scalar_row(hp, params[0].device) if type(hp) is tuple else hp


def _unwrapped(*groups: list) -> bool:
    """Whether a batching rule's unwrapped inputs are plain tensors with storage: no outer torch.func transform
    wraps them (nested ``vmap``, ``grad``), no tracing, no subclass."""
    return not torch.compiler.is_compiling() and all(
        set(map(type, ts)) <= _PLAIN_TYPES and not any(map(_functorch.is_functorch_wrapped_tensor, ts)) for ts in groups
    )


def _member_contiguous(t: Tensor) -> bool:
    """Whether each ``t[b]`` is contiguous (dims of size 1 take any stride, as in ``is_contiguous``)."""
    expected = 1
    for n, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if n != 1 and stride != expected:
            return False
        expected *= n
    return True


def _stacked(t: Tensor, d: int | None) -> tuple[Tensor, bool]:
    """``(tensor, batched)`` of :mod:`bnbf.kernels.members`: the batch dim first, each member contiguous (one
    copy of the whole tensor where they are not), or the unbatched tensor shared by every member."""
    if d is None:
        return (t if t.is_contiguous() else t.contiguous()), False
    x = t if d == 0 else t.movedim(d, 0)
    return (x if x.is_contiguous() or _member_contiguous(x) else x.contiguous()), True


def _stack(tensors: list, dims: list) -> tuple[list, tuple]:
    """The unwrapped ``tensors`` with their batch dims ``dims`` as :mod:`bnbf.kernels.members` takes them,
    ``(tensors, batched)`` (:func:`_stacked` each); the common case (every tensor batched along dim 0 and
    contiguous) in C-level maps."""
    if dims.count(0) == len(dims) and all(map(Tensor.is_contiguous, tensors)):
        return tensors, (True,) * len(tensors)
    pairs = list(map(_stacked, tensors, dims))
    return [t for t, _ in pairs], tuple(b for _, b in pairs)


def _outputs(x: tuple, size: int) -> list[Tensor]:
    """New contiguous ``[size, ...]`` tensors for the outputs of stacked inputs ``x``: ``empty_like`` of a contiguous
    stacked input costs a third of ``torch.empty`` with a shape (0.8 against 2.2 us a tensor, CPU), and less than
    views of one buffer per dtype (GPT-2's 544 outputs: 0.46 against 0.97 ms with ``as_strided``, CPU)."""
    ts, batched = x
    if all(batched) and all(map(Tensor.is_contiguous, ts)):
        return list(map(torch.empty_like, ts))
    return [
        torch.empty_like(t, memory_format=torch.contiguous_format)
        if b
        else torch.empty((size, *t.shape), dtype=t.dtype, device=t.device)
        for t, b in zip(ts, batched)
    ]


@functools.cache
def _hp_per_tensor() -> bool:
    """Whether the kernel takes a scalar row per tensor (HP_PER_TENSOR): per-member hyperparameters in one launch."""
    from bnbf.kernels.step_kernel import _step_kernel

    return "HP_PER_TENSOR" in _step_kernel.arg_names


def _stackable(t: Tensor, h_dim: int | None) -> bool:
    """Whether :func:`_step_stacked` takes a step on ``t``'s path with hyperparameters batched along ``h_dim``."""
    return h_dim is None or not use_triton(t) or _hp_per_tensor()


def _step_stacked(params, p_dims, grads, g_dims, states, s_dims, hp, h_dim, layout, skip_zeros, clip, size):
    """The pure step of every member of stacked tensors, written into stacked outputs ``[size, ...]``: one launch
    on the Triton path, whose host work does not grow with ``size`` (:mod:`bnbf.kernels.members`); ``hp`` is the
    scalar row (or a row per tensor), with ``h_dim`` batched along that dim (a row, or rows, per member). The
    tensors are plain (:func:`_unwrapped`): torch.func's dispatch layer, which would add its cost to each of the
    small ops a tensor takes here, is off."""
    with torch._C._DisableFuncTorch():
        args = (params, p_dims, grads, g_dims, states, s_dims, hp, h_dim, layout, skip_zeros, clip, size)
        return _stacked_step(*args)


def _member_rows(hp: Tensor, h_dim: int | None, n: int, size: int) -> Tensor | None:
    """The scalars as one row per table row (member-major, as :mod:`bnbf.kernels.members` orders the table), or
    None where one row serves every tensor of every member."""
    if h_dim is None:  # numbers, a row or a row per tensor: the same for every member
        return None if type(hp) is tuple or hp.dim() == 1 else hp.repeat(size, 1)
    rows = hp.movedim(h_dim, 0)  # [size, scalars] or [size, tensors, scalars]
    return (rows.repeat_interleave(n, 0) if rows.dim() == 2 else rows.flatten(0, 1)).contiguous()


def _stacked_step(params, p_dims, grads, g_dims, states, s_dims, hp, h_dim, layout, skip_zeros, clip, size):
    ps, gs, ss = _stack(params, p_dims), _stack(grads, g_dims), _stack(states, s_dims)
    new_p, new_s = _outputs(ps, size), _outputs(ss, size)
    if size == 0:  # an ensemble of no members: nothing to step
        return new_p, new_s
    out_p, out_s = (new_p, (True,) * len(new_p)), (new_s, (True,) * len(new_s))
    device = new_p[0].device
    _refuse_capture(device)
    if use_triton(new_p[0]):
        from bnbf.kernels.launcher import launch_group
        from bnbf.kernels.members import stacked_grads, stacked_group

        with BUILD_LOCK:
            group = stacked_group(ps, out_p, ss, out_s, layout, size)
            grad_list = stacked_grads(group, gs, size)
        rows = _member_rows(hp, h_dim, len(params), size)
        hp = hp if rows is None else rows
        with launch_lock(device.type == "cpu"):
            launch_group(group, grad_list, hp, skip_zeros, clip)
    else:
        _reference_members(ps, out_p, gs, ss, out_s, hp, h_dim, layout, skip_zeros, clip, size)
    return new_p, new_s


def _reference_members(ps, out_p, gs, ss, out_s, hp, h_dim, layout, skip_zeros, clip, size) -> None:
    """The reference step of stacked tensors; it steps tensor by tensor anyway: each member a view, written into
    the stacked outputs (which may be the inputs)."""

    def views(x, members):
        return [t[b] if batched else t for b in members for t, batched in zip(*x)]

    hp = _as_row(hp, ps[0])

    if h_dim is None:
        steps = ((range(size), hp),)
    else:
        steps = (((b,), row) for b, row in enumerate(hp.movedim(h_dim, 0).unbind(0)))
    for members, row in steps:
        ins = views(ps, members), views(out_p, members), views(gs, members)
        reference_step(*ins, views(ss, members), views(out_s, members), row, layout, skip_zeros, clip)


def _unwrap(tensors: list, level: int) -> tuple[tuple, tuple]:
    """The plain tensors under ``vmap``'s wrappers at ``level``, and their batch dims (None: not batched)."""
    pairs = zip(*map(_functorch._unwrap_batched, tensors, itertools.repeat(level)))  # two tuples, in C
    return next(pairs, ()), next(pairs, ())


def vmap_level() -> tuple[int, int] | None:
    """``(level, batch size)`` of the innermost transform where it is a ``vmap`` outside tracing, else None.
    Read from the C interpreter stack (0.6 us; torch.func's Python interpreter objects take 4 us, and a vmapped
    step asks three times)."""
    if torch.compiler.is_compiling() or _functorch.maybe_current_level() is None:
        return None
    interpreter = _functorch.peek_interpreter_stack()
    if interpreter is None or interpreter.key() != TransformType.Vmap:
        return None
    return interpreter.level(), _functorch.CVmapInterpreterPtr(interpreter).batchSize()


def _unwrap_all(params, grads, states, hp) -> tuple | None:
    """Under a ``vmap`` innermost: (level, batch size, then (tensors, batch dims) of the params, grads, states and
    the scalars, unwrapped at that level); None outside vmap."""
    found = vmap_level()
    if found is None:
        return None
    level, size = found
    unwrapped = _unwrap(params, level), _unwrap(grads, level), _unwrap(states, level)
    return level, size, *unwrapped, _unwrap_scalars(hp, level)


def _unwrap_scalars(hp: Any, level: int) -> tuple:
    """The scalars unwrapped at ``level`` and their batch dim: Python numbers (kernel arguments, no row to upload)
    are the same for every member."""
    return (hp, None) if type(hp) is tuple else _functorch._unwrap_batched(hp, level)


def _step_vmapped(params, grads, states, hp, layout: Layout, skip_zeros, clip):
    """:func:`_step_vmap`'s stacked step called directly, without the op's dispatch, under a ``vmap`` whose batched
    tensors wrap plain ones: torch's route to a batching rule walks every tensor through pytrees twice
    (unwrapping the inputs, wrapping the outputs), a third of a vmapped call's host time with GPT-2's 740
    tensors. Unwraps and wraps as that route does; returns None where it does not apply (another transform
    innermost, tracing, tensors an outer transform wraps, nothing batched at this level)."""
    found = _unwrap_all(params, grads, states, hp)
    if found is None:
        return None
    level, size, (ps, p_dims), (gs, g_dims), (ss, s_dims), (hp, h_dim) = found
    n_unbatched = p_dims.count(None) + g_dims.count(None) + s_dims.count(None)
    batched = h_dim is not None or n_unbatched < len(ps) + len(gs) + len(ss)
    if not batched or not _unwrapped(ps, gs, ss, _row_list(hp)) or not _stackable(ps[0], h_dim):
        return None
    new_p, new_s = _step_stacked(ps, p_dims, gs, g_dims, ss, s_dims, hp, h_dim, layout, skip_zeros, clip, size)
    add, dims, levels = _functorch._add_batch_dim, itertools.repeat(0), itertools.repeat(level)
    return list(map(add, new_p, dims, levels)), list(map(add, new_s, dims, levels))


def _in_place(tensors: list, dims: list) -> list | None:
    """The unwrapped ``tensors`` with their batch dim first, where each is batched and its members contiguous (the
    step can write into the caller's memory through them); else None."""
    if dims.count(0) == len(dims) and all(map(Tensor.is_contiguous, tensors)):
        return tensors
    out = []
    for t, d in zip(tensors, dims):
        if d is None:
            return None
        x = t if d == 0 else t.movedim(d, 0)
        if not (x.is_contiguous() or _member_contiguous(x)):
            return None
        out.append(x)
    return out


def _step_vmapped_(params, grads, states, hp, layout: Layout, skip_zeros, clip, unwrapped=None) -> bool:
    """The in-place step under a ``vmap`` (``bnbf.update_`` of an ensemble): where every param and state is batched
    at this level, each member contiguous, the stacked step writes into the caller's stacked tensors themselves
    (one launch on the Triton path; no outputs, no batched op per tensor). Otherwise (members strided, inputs an
    outer transform wraps) the pure step (vmap's route) is written back with ``copy_``, a batched op per tensor.
    Refused before anything is written: a param or state that is not batched (it cannot take each member's value,
    as torch's vmap refuses), params and states sharing memory (each is written on its own; checked on the stacked
    tensors, once per set of addresses on the Triton path). False where no vmap is innermost, or nothing is
    batched at its level (the op's dispatch then decides, as outside vmap). ``unwrapped``: the tensors already
    unwrapped, as :func:`check_vmapped_apart` returns them."""
    if unwrapped is None:
        found = _unwrap_all(params, grads, states, hp)
        if found is None:
            return False
    else:
        found = (*unwrapped, _unwrap_scalars(hp, unwrapped[0]))
    level, size, (ps, p_dims), (gs, g_dims), (ss, s_dims), (hp_u, h_dim) = found
    shared = [k for k, d in enumerate(itertools.chain(p_dims, s_dims)) if d is None]
    if len(shared) == len(p_dims) + len(s_dims) and h_dim is None and g_dims.count(None) == len(g_dims):
        return False  # nothing batched at this level: the op's dispatch, as outside vmap
    if shared:  # before anything is written
        raise RuntimeError(UNBATCHED_IN_PLACE.format(what=_written_name(shared[0], params)))
    if unwrapped is None:
        check_vmapped_writable(params, states)
    plain = _unwrapped(ps, gs, ss, _row_list(hp_u))
    if plain and _stackable(ps[0], h_dim):
        with torch._C._DisableFuncTorch():
            wp, ws = _in_place(ps, p_dims), _in_place(ss, s_dims)
            if wp is not None and ws is not None:
                if size:
                    checked = unwrapped is not None
                    _stacked_step_(wp, gs, g_dims, ws, hp_u, h_dim, layout, skip_zeros, clip, size, checked)
                return True
    if plain and unwrapped is None:  # (given unwrapped, the caller compared the whole call's memory)
        with torch._C._DisableFuncTorch():
            _check_disjoint(ps, ss)
    new_p, new_s = step(params, grads, states, hp, layout, skip_zeros, clip)
    with torch.no_grad():
        for old, new in zip(itertools.chain(params, states), itertools.chain(new_p, new_s)):
            old.copy_(new)
    return True


def _stacked_step_(params, grads, g_dims, states, hp, h_dim, layout, skip_zeros, clip, size, checked=False) -> None:
    """:func:`_stacked_step` written into the stacked ``params`` and ``states`` (batched, members contiguous);
    ``checked``: their memory found apart by the caller (:func:`check_vmapped_apart`)."""
    ps, ss, gs = (params, (True,) * len(params)), (states, (True,) * len(states)), _stack(grads, g_dims)
    device = params[0].device
    _refuse_capture(device, None)
    if use_triton(params[0]):
        from bnbf.kernels.launcher import launch_group
        from bnbf.kernels.members import stacked_grads, stacked_group

        with BUILD_LOCK:
            group = stacked_group(ps, ps, ss, ss, layout, size)
            if not group.disjoint:  # once per set of addresses: a hit is the same memory
                if not checked:
                    _check_disjoint(params, states)
                group.disjoint = True
            grad_list = stacked_grads(group, gs, size)
        rows = _member_rows(hp, h_dim, len(params), size)
        hp = hp if rows is None else rows
        if _BUMP is not None:
            _BUMP(params)
            _BUMP(states)
        with launch_lock(device.type == "cpu"):
            launch_group(group, grad_list, hp, skip_zeros, clip)
        return
    if not checked:
        _check_disjoint(params, states)
    if _BUMP is not None:
        _BUMP(params)
        _BUMP(states)
    _reference_members(ps, ps, gs, ss, ss, hp, h_dim, layout, skip_zeros, clip, size)


def check_vmapped_writable(params: list, fields: list, layers_in: bool = False) -> None:
    """Before an in-place step under ``vmap`` writes anything, what eager ``update_`` refuses to write: tensors made
    under ``torch.inference_mode()`` (outside it), and stacked params or state fields whose members or elements
    share memory (an expanded member dim, members strided closer than they are long): one location would keep only
    one member's step. ``params``, ``fields``: the stacked tensors (under vmap's wrappers; ``layers_in``: already
    under every level of them)."""
    written = [*params, *fields]
    if not layers_in:
        written = list(map(_base, written))
    if not torch.is_inference_mode_enabled() and any(map(Tensor.is_inference, written)):
        k = next(k for k, t in enumerate(written) if t.is_inference())
        raise RuntimeError(
            f"Inplace update to inference tensor outside InferenceMode is not allowed: {_written_name(k, params)} "
            "was made under torch.inference_mode(); step inside it, or clone() the tensor outside it"
        )
    for k, t in enumerate(written):
        if not t.is_contiguous() and _overlaps_itself(t):
            raise ValueError(
                f"bnbf: the in-place step under vmap cannot write {_written_name(k, params)}: its strides "
                f"{t.stride()} for shape {tuple(t.shape)} (batch dims included) map more than one of its members' "
                "elements to one memory location (an expanded tensor?), so it cannot take each member's step in "
                "place; pass a clone(), or use bnbf.update"
            )


def _written_name(k: int, params: list) -> str:
    return f"param {k}" if k < len(params) else f"state field {k - len(params)}"


def _check_disjoint(params: list, states: list, step: str = "vmapped in-place step") -> None:
    """ValueError where two of the (stacked) params and states share memory (what update_ refuses outside vmap)."""
    if _overlap([*params, *states], []) is not None:  # all as params: spans measured where not contiguous
        raise ValueError(
            f"bnbf: params or states of this {step} overlap in memory (views of one tensor?): each param and state "
            "is written on its own, so they must not share memory"
        )


# per structure (numbers of params and fields, the first param's shape and dtype), the last whole vmapped in-place
# call found apart: (meta twins and addresses of the stacked params and state fields, the stacked grads' addresses
# and their addresses the call before: a loop making new grads each step alternates between two places); no
# caller tensor is kept. A few entries: a loop may step two ensembles (a GAN's two models) in turn.
_APART = Bounded(8)


def check_vmapped_apart(params: list, grads: list, fields: list, per_state: Callable, check: Callable) -> tuple:
    """Under a ``vmap`` innermost, before an in-place step writes anything: what eager ``update_`` refuses, params
    or state fields sharing memory (across all of the call's layout groups, where each group's step checks only
    its own) and a grad sharing memory with a param or field the step writes, compared on the stacked tensors
    under every level of vmap's wrappers. Inputs an outer transform other than vmap wraps have no memory to
    compare (that transform's own checks answer). Params and fields at the addresses and shapes of the last
    call of their structure found apart are apart (a compiled pass, where the checks take 2 ms with GPT-2's 740
    tensors), and so are grads at that call's addresses or the call's before; grads elsewhere are compared with
    them alone.

    Args:
        params, grads, fields: the call's batched tensors (``fields``: every state's, in order).
        per_state: ``fields`` unwrapped -> the states as tuples of them, in the order of the params they belong
            to (which device owns each).
        check: ``(params, grads, fields)`` unwrapped -> raises the eager call's error naming the leaves.

    Returns:
        ``(level, size, (params, dims), (grads, dims), (fields, dims))`` unwrapped at vmap's level, which
        :func:`step_` takes as they are.
    """
    level, size = vmap_level()
    unwrapped = level, size, _unwrap(params, level), _unwrap(grads, level), _unwrap(fields, level)
    ps, gs, ss = unwrapped[2][0], unwrapped[3][0], unwrapped[4][0]
    written = [*ps, *ss]
    if not torch.is_inference_mode_enabled() and any(map(Tensor.is_inference, written)):
        check_vmapped_writable(ps, ss)  # raises, naming the tensor
    key = (len(ps), len(ss), *((ps[0].shape, ps[0].dtype) if ps else ()))
    last = _APART.get(key)
    if NATIVE is not None and last is not None and NATIVE.meta_match(written, last[0], last[1]):
        moved = NATIVE.grads_fit_at(ps, gs, last[2])  # True: at the last call's addresses
        if moved is True or moved == last[3]:
            return unwrapped
        if (moved is not False or _unwrapped(gs)) and _grad_overlap(ps, gs, per_state(ss)) is None:
            if moved is not False:  # batched as the params are: the next call may find them here
                _APART[key] = (last[0], last[1], moved, last[2])
            return unwrapped
    bases = [_base(t) for t in (*ps, *gs, *ss)]
    if not _unwrapped(bases):  # a grad or jvp transform between the vmaps
        return unwrapped
    n, m = len(ps), len(gs)
    with torch._C._DisableFuncTorch():
        check_vmapped_writable(bases[:n], bases[n + m :], layers_in=True)
        check(bases[:n], bases[n : n + m], bases[n + m :])
    if all(map(operator.is_, bases, (*ps, *gs, *ss))) and all(map(Tensor.is_contiguous, written)):  # one level
        twins = [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in written]
        at = lambda ts: array.array("Q", map(Tensor.data_ptr, ts)).tobytes()  # noqa: E731
        _APART.put(key, (twins, at(written), at(gs), None))
    return unwrapped


def unwrapped_at(unwrapped: tuple, idx: list, field_idx: list) -> tuple:
    """:func:`check_vmapped_apart`'s unwrapped tensors of the params at ``idx`` and the fields at ``field_idx``."""
    level, size, *lists = unwrapped
    picks = (idx, idx, field_idx)
    return level, size, *(([ts[i] for i in k], [ds[i] for i in k]) for (ts, ds), k in zip(lists, picks))


def check_vmapped_leaves_apart(tree: Any, params: list, grads: list, states: list, fields: list) -> tuple:
    """:func:`check_vmapped_apart` of per-param states (``fields``: every state's, in order), named as eager
    ``update_`` names them (leaves of ``tree``)."""

    def check(ps, gs, fs):
        ss = _per_state(fs, states)
        _check_no_overlap(tree, ps, ss)
        _check_grads_apart(tree, ps, gs, ss)

    found = check_vmapped_apart(params, grads, fields, lambda fs: _per_state(fs, states), check)
    p_dims, g_dims, s_dims = found[2][1], found[3][1], found[4][1]
    if (None in p_dims or None in s_dims) and any(d is not None for d in (*p_dims, *g_dims, *s_dims)):
        # refused as the step would refuse it, here where the leaves have names
        names = _names(tree)
        if None in p_dims:
            what = f"param{names[p_dims.index(None)]}"
        else:
            i, k = 0, s_dims.index(None)
            while k >= len(states[i]):  # the field's state, and its place in it
                k, i = k - len(states[i]), i + 1
            what = f"the state of param{names[i]} (its field {type(states[i])._fields[k]!r})"
        raise RuntimeError(UNBATCHED_IN_PLACE.format(what=what))
    return found


def _per_state(fields: list, states: list) -> list:
    """``fields`` (every state's in order) as states of the types of ``states``."""
    out, k = [], 0
    for s in states:
        out.append(type(s)._make(fields[k : k + len(s)]))
        k += len(s)
    return out


def _base(t: Tensor) -> Tensor:
    """The tensor under every level of vmap's wrappers."""
    while _functorch.is_batchedtensor(t):
        t = _functorch.get_unwrapped(t)
    return t


def _step_vmap(info, in_dims, params, grads, states, hp, rule, bits, block_size, fmt, present, skip_zeros, clip):
    """``vmap`` over members (an ensemble's stacked params): every member of every tensor is a tensor of its own
    to the step, so each member is quantized on its own (its own blocks and absmax), exactly as a loop over
    members. Plain stacked tensors take one call of the step writing into stacked outputs (one launch on the
    Triton path, host work independent of the member count, per-member hyperparameters as a row per member);
    inputs still wrapped by an outer transform take the op per member and a stack."""
    size = info.batch_size
    p_dims, g_dims, s_dims, h_dim = in_dims[:4]
    n, m = len(params), len(states)
    layout = Layout(rule, bits, block_size, fmt, present)
    if _unwrapped(params, grads, states, [hp]) and _stackable(params[0], h_dim):
        out = _step_stacked(params, p_dims, grads, g_dims, states, s_dims, hp, h_dim, layout, skip_zeros, clip, size)
        return out, ([0] * n, [0] * m)
    ps, gs, ss = _members(params, p_dims, size), _members(grads, g_dims, size), _members(states, s_dims, size)
    args = (rule, bits, block_size, fmt, present, skip_zeros, clip)
    if h_dim is None:  # inputs still wrapped (nested transforms)
        flat_p = [ps[i][b] for b in range(size) for i in range(n)]
        flat_g = [gs[i][b] for b in range(size) for i in range(n)]
        flat_s = [ss[k][b] for b in range(size) for k in range(m)]
        rows = hp if hp.dim() == 1 else hp.repeat(size, 1)  # a row per tensor: the same for every member
        out_p, out_s = _step_op(flat_p, flat_g, flat_s, rows, *args)
    else:
        rows = hp.movedim(h_dim, 0).unbind(0)
        out_p, out_s = [], []
        for b in range(size):
            op, os_ = _step_op([x[b] for x in ps], [x[b] for x in gs], [x[b] for x in ss], rows[b], *args)
            out_p += op
            out_s += os_
    new_p = [torch.stack([out_p[b * n + i] for b in range(size)]) for i in range(n)]
    new_s = [torch.stack([out_s[b * m + k] for b in range(size)]) for k in range(m)]
    return (new_p, new_s), ([0] * n, [0] * m)


_step_op.register_vmap(_step_vmap)


def in_place_vmap_rule(pure_rule: Callable, what: str) -> Callable:
    """The batching rule of an in-place op whose args start ``params, grads, states, hp``, from its pure twin's rule
    ``pure_rule``: the batched step written back into the stacked params and states (``vmap`` traced by
    torch.compile reaches it through the op's dispatch); ``what`` names them in the refusal of an unbatched one."""

    def rule(info, in_dims, params, grads, states, hp, *args):
        p_dims, s_dims = in_dims[0], in_dims[2]
        if None in p_dims or None in s_dims:
            raise RuntimeError(UNBATCHED_IN_PLACE.format(what=what))
        (new_p, new_s), _ = pure_rule(info, in_dims, params, grads, states, hp, *args)
        for t, d, new in zip([*params, *states], [*p_dims, *s_dims], [*new_p, *new_s]):
            t.copy_(new.movedim(0, d))
        return None, None

    return rule


_step_op_.register_vmap(in_place_vmap_rule(_step_vmap, "a param or state field"))


def _step_pair_vmap(info, in_dims, params, grads, states, params2, grads2, states2, hp, *args):
    """``vmap`` of :func:`step_pair_` (a compiled ``vmap`` of ``update_``): each group's in-place batching rule."""
    one = in_place_vmap_rule(_step_vmap, "a param or state field")
    layout, layout2, skip_zeros = args[:5], args[5:10], args[10]
    one(info, (*in_dims[:3], in_dims[6]), params, grads, states, hp, *layout, skip_zeros, False)
    one(info, (*in_dims[3:6], in_dims[6]), params2, grads2, states2, hp, *layout2, skip_zeros, False)
    return None, None


_step_pair_op_.register_vmap(_step_pair_vmap)

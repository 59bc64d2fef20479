"""``torch.library`` ops for the optimizer step, and the dispatch between the two paths.

``bnbf::step_`` updates params and states in place; ``bnbf::step`` returns new tensors. Both run the
Triton multi-tensor kernel on GPU tensors (and on CPU tensors under ``TRITON_INTERPRET=1``) through
:mod:`bnbf.kernels.launcher`, and the pure-torch reference (:mod:`bnbf.reference`) otherwise. Their fake
implementations let tracers see them without running a kernel. The states' layout (:class:`bnbf.state.Layout`)
travels as one object; only the ops' schemas, which take no Python objects, spell out its fields.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch._C import _functorch

from bnbf._dispatch import BUILD_LOCK, INTERPRETER_LOCK, use_triton
from bnbf.reference import reference_step
from bnbf.state import Layout


def _run(p_in, p_out, grads, s_in, s_out, hp, layout: Layout, skip_zeros, clip) -> None:
    if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():  # (a capture initialises CUDA)
        why = (
            "it takes the generic path (the pure update, non-contiguous params, tensor subclasses), which copies "
            "its kernel tables from the host every step; capture bnbf.update_ of contiguous params, or a plan's step"
            if p_in[0].device.type == "cuda"
            else f"its {p_in[0].device.type} tensors are stepped on the host, which a replay of the graph would skip"
        )
        raise RuntimeError(f"bnbf: this step cannot be captured in a CUDA graph: {why}")
    if use_triton(p_in[0]):
        from bnbf.kernels.launcher import build_group, launch_group

        with BUILD_LOCK:  # see bnbf._dispatch: the build under a lock, the launch outside it
            group = build_group(p_in, p_out, s_in, s_out, layout)
        if p_in[0].device.type == "cpu":  # Triton's interpreter: one launch at a time
            with INTERPRETER_LOCK:
                launch_group(group, grads, hp, skip_zeros, clip)
        else:
            launch_group(group, grads, hp, skip_zeros, clip)
    else:
        reference_step(p_in, p_out, grads, s_in, s_out, hp, layout, skip_zeros, clip)


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
        and type(hp) in _PLAIN_TYPES
    )


def step_(params, grads, states, hp, layout: Layout, skip_zeros: bool, clip: bool) -> None:
    """In-place step; eager calls go straight to the launcher (the op's dispatch costs ~5 us a tensor)."""
    if not _direct(params, grads, states, hp):
        return _step_op_(params, grads, states, hp, *layout, skip_zeros, clip)
    _run(params, params, grads, states, states, hp, layout, skip_zeros, clip)


def step(params, grads, states, hp, layout: Layout, skip_zeros: bool, clip: bool):
    """Out-of-place step; eager calls skip the op's dispatch as :func:`step_` does."""
    if not _direct(params, grads, states, hp):
        return _step_op(params, grads, states, hp, *layout, skip_zeros, clip)
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


def _members(tensors: list, dims: list, size: int) -> list[list[Tensor]]:
    """Each tensor as ``size`` member tensors (views along its batch dim; the tensor itself where unbatched)."""
    out = []
    for t, d in zip(tensors, dims):
        out.append([t] * size if d is None else [m.contiguous() for m in t.movedim(d, 0).unbind(0)])
    return out


@_step_op.register_vmap
def _step_vmap(info, in_dims, params, grads, states, hp, rule, bits, block_size, fmt, present, skip_zeros, clip):
    """``vmap`` over members (an ensemble's stacked params): every member of every tensor is a tensor of its own
    in one call of the op, so each member is quantized on its own (its own blocks and absmax), exactly as a
    loop over members, and the Triton path steps all of them in one launch, writing each member straight into
    the batched outputs (no stacking copy). Per-member hyperparameters (a batched scalar row) take one call per
    member."""
    size = info.batch_size
    p_dims, g_dims, s_dims, h_dim = in_dims[:4]
    ps, gs, ss = _members(params, p_dims, size), _members(grads, g_dims, size), _members(states, s_dims, size)
    n, m = len(params), len(states)
    args = (rule, bits, block_size, fmt, present, skip_zeros, clip)
    if h_dim is None:
        flat_p = [ps[i][b] for b in range(size) for i in range(n)]
        flat_g = [gs[i][b] for b in range(size) for i in range(n)]
        flat_s = [ss[k][b] for b in range(size) for k in range(m)]
        if _direct(flat_p, flat_g, flat_s, hp):  # the step writes each member straight into the batched outputs
            new_p = [
                torch.empty((size, *ps[i][0].shape), dtype=ps[i][0].dtype, device=ps[i][0].device) for i in range(n)
            ]
            new_s = [
                torch.empty((size, *ss[k][0].shape), dtype=ss[k][0].dtype, device=ss[k][0].device) for k in range(m)
            ]
            out_p = [new_p[i][b] for b in range(size) for i in range(n)]
            out_s = [new_s[k][b] for b in range(size) for k in range(m)]
            layout = Layout(rule, bits, block_size, fmt, present)
            _run(flat_p, out_p, flat_g, flat_s, out_s, hp, layout, skip_zeros, clip)
            return (new_p, new_s), ([0] * n, [0] * m)
        out_p, out_s = _step_op(flat_p, flat_g, flat_s, hp, *args)  # inputs still wrapped (nested transforms)
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

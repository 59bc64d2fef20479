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

from bnbf._dispatch import BUILD_LOCK, INTERPRETER_LOCK, use_triton
from bnbf.reference import reference_step
from bnbf.state import Layout


def _run(p_in, p_out, grads, s_in, s_out, hp, layout: Layout, skip_zeros, clip) -> None:
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


def step_(params, grads, states, hp, layout: Layout, skip_zeros: bool, clip: bool) -> None:
    """In-place step; eager calls go straight to the launcher (the op's dispatch costs ~5 us a tensor)."""
    if torch.compiler.is_compiling():
        return _step_op_(params, grads, states, hp, *layout, skip_zeros, clip)
    _run(params, params, grads, states, states, hp, layout, skip_zeros, clip)


def step(params, grads, states, hp, layout: Layout, skip_zeros: bool, clip: bool):
    """Out-of-place step; eager calls skip the op's dispatch as :func:`step_` does."""
    if torch.compiler.is_compiling():
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

"""The memory a step needs beyond params, grads and state, on CUDA (the allocator's peak; CPU has no such
statistics). 8-bit state exists to fit models that 32-bit Adam cannot: a step, or the state's creation, that
made a float32 copy of a large tensor would undo that on the largest leaf. The bound, 1 MiB, is far below the
largest leaf here (16 MiB in float32) and above what a step legitimately keeps beside the tensors: its
per-call scalars, task lists and per-tensor norms."""

from __future__ import annotations

import pytest
import torch
from optim_table import ROWS

import bnbf
import bnbf_nn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BOUND = 1 << 20
SHAPES = {"one": (1,), "a": (255,), "b": (257,), "c": (4097,), "w": (512, 1024), "big": (2048, 2048), "t": (3, 5000)}


def _tree(dtype: torch.dtype, seed: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return {k: (torch.randn(s, generator=gen, device="cuda") * 0.1).to(dtype) for k, s in SHAPES.items()}


class _Peak:
    """Peak allocated bytes inside the block, less the larger of what was allocated before and after it."""

    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.before = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc):
        torch.cuda.synchronize()
        self.extra = torch.cuda.max_memory_allocated() - max(self.before, torch.cuda.memory_allocated())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("row", ROWS, ids=str)  # each rule's variants keep different states
def test_functional_steps_allocate_no_copy_of_a_tensor(row, dtype):
    params, grads = _tree(dtype, 0), _tree(dtype, 1)
    spec = bnbf.OptimSpec(rule=row.name, min_8bit_size=256)
    with _Peak() as init:
        state = bnbf.init_state(params, spec, row.hparams)
    bnbf.update_(params, grads, state, row.hparams, 1)
    with _Peak() as in_place:
        bnbf.update_(params, grads, state, row.hparams, 2)
    with _Peak() as pure:  # the new params and state are outputs; nothing else may stay at the peak
        out = bnbf.update(params, grads, state, row.hparams, 3)
    del out
    assert max(init.extra, in_place.extra, pure.extra) < BOUND, (
        f"init_state {init.extra / 2**20:.2f} MiB, update_ {in_place.extra / 2**20:.2f} MiB, "
        f"update {pure.extra / 2**20:.2f} MiB beyond the tensors"
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: bnbf_nn.AdamW8bit(ps, lr=1e-3, weight_decay=0.01),
        lambda ps: bnbf_nn.PagedAdamW8bit(ps, lr=1e-3),
        lambda ps: bnbf_nn.Lion8bit(ps, lr=1e-4),
        lambda ps: bnbf_nn.LAMB8bit(ps, lr=1e-3),
        lambda ps: bnbf_nn.Adagrad8bit(ps, lr=1e-2, initial_accumulator_value=0.1),
        lambda ps: bnbf_nn.AdEMAMix8bit(ps, lr=1e-3),
    ],
    ids=["AdamW8bit", "PagedAdamW8bit", "Lion8bit", "LAMB8bit", "Adagrad8bit-initial", "AdEMAMix8bit"],
)
def test_optimizer_steps_allocate_no_copy_of_a_tensor(make):
    params = [torch.nn.Parameter(t) for t in _tree(torch.float32, 0).values()]
    for p, g in zip(params, _tree(torch.float32, 1).values()):
        p.grad = g
    opt = make(params)
    with _Peak() as first:  # builds the state: codes and scales only, no float32 tensor to quantize
        opt.step()
    with _Peak() as second:
        opt.step()
    assert max(first.extra, second.extra) < BOUND, (
        f"first step {first.extra / 2**20:.2f} MiB, second {second.extra / 2**20:.2f} MiB beyond the tensors"
    )

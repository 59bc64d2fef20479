"""The launcher's variants must give the same bits: the in-place step's direct launch (after a group's first,
Triton-dispatched launch, later steps call the compiled kernel's launcher themselves) as Triton's dispatch, and
the norm pass of tensors at unaligned addresses as at 16-byte aligned ones; and the address table's first-block
column gives a slice the whole tensor's dither."""

from __future__ import annotations

import pytest
import torch
from conftest import kernel_runs
from test_no_recompile import compiled_count

import bnbf
import bnbf.functional as F
import bnbf.kernels.direct_launch as direct_launch
from bnbf.kernels import launcher

HPARAMS = [
    {"lr": 1e-2, "weight_decay": 0.0},
    {"lr": 3e-3, "weight_decay": 0.1, "betas": (0.8, 0.95)},
    {"lr": 1e-3, "weight_decay": 0.01, "betas": (0.9, 0.99)},
]


def _run(use_direct: bool, rule: str, bits: int, dtype: torch.dtype, max_unorm: float, monkeypatch):
    monkeypatch.setattr(direct_launch, "DIRECT_LAUNCH", use_direct)
    gen = torch.Generator().manual_seed(0)
    shapes = [(1,), (255,), (257,), (4097,), (64, 129)]
    params = {f"p{i}": torch.randn(s, generator=gen).to("cuda", dtype) for i, s in enumerate(shapes)}
    spec = bnbf.OptimSpec(rule=rule, state_bits=bits, min_8bit_size=256)
    state = bnbf.init_state(params, spec, HPARAMS[0])
    for step in range(1, 7):
        grads = {k: (torch.randn(v.shape, generator=gen) * 0.1).to("cuda", dtype) for k, v in params.items()}
        bnbf.update_(params, grads, state, HPARAMS[step % 3], step, max_unorm=max_unorm)
    torch.cuda.synchronize()
    plan = next(p for p in F._PLANS.values() if p.params[0] is params["p0"])
    launched_directly = any(group.compiled for _, group in plan.groups)
    return params, state, launched_directly


@pytest.mark.gpu
@pytest.mark.parametrize("rule,max_unorm", [("adamw", 0.0), ("adamw", 0.05), ("lion", 0.0), ("lamb", 0.0)])
@pytest.mark.parametrize("bits", [8, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_direct_launch_matches_triton_dispatch(rule, max_unorm, bits, dtype, monkeypatch):
    p_jit, s_jit, used_jit = _run(False, rule, bits, dtype, max_unorm, monkeypatch)
    compiled = compiled_count()
    p_dir, s_dir, used_direct = _run(True, rule, bits, dtype, max_unorm, monkeypatch)
    assert not used_jit and used_direct, "the direct launch was not taken (or taken with BNBF_LAUNCH=jit)"
    assert compiled_count() == compiled, "the direct path compiled a kernel the dispatched path had not"
    for k in p_jit:
        assert torch.equal(p_jit[k], p_dir[k]), k
        for a, b in zip(s_jit[k], s_dir[k]):
            assert torch.equal(a, b), k


def _unaligned(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values one element past the start of a fresh buffer: contiguous, not 16-byte aligned."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = buf[1:].view(t.shape)
    out.copy_(t)
    return out


@pytest.mark.parametrize("rule,bits,max_unorm", [("lamb", 8, 0.0), ("lamb", 32, 0.0), ("adamw", 8, 0.05)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_norm_pass_does_not_depend_on_alignment(device, rule, bits, max_unorm, dtype, monkeypatch):
    """Issue 12: per-tensor norms (LAMB's, max_unorm's) come from per-tile partial sums. With 16-byte aligned
    addresses the loads could vectorize and each thread add other elements of a tile first, so a vmapped member
    (unaligned in the batch) stepped differently from the same member alone. The same values at aligned and at
    unaligned addresses give the same partials and the same step, bit for bit. (Under the interpreter the
    variants share the same numpy sums; the compiled kernels, on CUDA, are what this guards.)"""
    if not kernel_runs(device):
        pytest.skip("the kernels' norm pass")
    if device == "cpu" and (rule, bits, dtype) != ("lamb", 8, torch.bfloat16):
        pytest.skip("the interpreter has no layouts: one case checks the plumbing, CUDA the rest")
    gen = torch.Generator().manual_seed(1)
    # several tiles each, and a partial last tile
    shapes = [(4097,), (64, 129)] if device == "cuda" else [(257,), (3, 129)]
    ps = [torch.randn(s, generator=gen).to(device, dtype) for s in shapes]
    gs = [(torch.randn(s, generator=gen) * 0.1).to(device, dtype) for s in shapes]
    hp = {"lr": 1e-2, "weight_decay": 0.01}
    state = bnbf.init_state(ps, bnbf.OptimSpec(rule=rule, state_bits=bits, min_8bit_size=256), hp)
    ps, state = bnbf.update(ps, gs, state, hp, 1, max_unorm=max_unorm)  # states that are not all zeros
    seen = []
    real = launcher.launch_group

    def keep(group, *a, **k):
        real(group, *a, **k)
        seen.append((group.aligned and group.grads_aligned, group.partials.clone()))

    monkeypatch.setattr(launcher, "launch_group", keep)
    out_aligned = bnbf.update(ps, gs, state, hp, 2, max_unorm=max_unorm)
    out_unaligned = bnbf.update(
        [_unaligned(p) for p in ps], [_unaligned(g) for g in gs], state, hp, 2, max_unorm=max_unorm
    )
    monkeypatch.undo()
    assert [a for a, _ in seen] == [True, False]  # the two variants did run
    assert torch.equal(seen[0][1], seen[1][1]), "norm pass partials differ between aligned and unaligned"
    for a, b in zip(torch.utils._pytree.tree_leaves(out_aligned), torch.utils._pytree.tree_leaves(out_unaligned)):
        assert torch.equal(a, b)


def test_first_block_gives_a_slice_the_whole_tensors_dither(device):
    """Issue 15: a tensor's first block (the address table's column, ``state_dither``'s ``first_block`` on the
    reference path, given through ``bnbf.reference.FIRST_BLOCKS``) makes a slice of whole blocks step exactly as
    those blocks of the whole tensor: the same params, codes and scales bit for bit (8-bit AdamW, two steps);
    without it the slice draws the dither of the whole tensor's first blocks, other codes."""
    from bnbf.reference import FIRST_BLOCKS

    gen = torch.Generator().manual_seed(2)
    start = torch.randn(5 * 256, generator=gen).to(device)
    grads = [(torch.randn(5 * 256, generator=gen) * 0.1).to(device) for _ in range(2)]
    spec, hp, cut = bnbf.OptimSpec(rule="adamw", min_8bit_size=0), {"lr": 1e-2}, 3 * 256  # blocks 3 and 4

    def run(offset):
        whole, part = start.clone(), start[cut:].clone()
        s_whole, s_part = bnbf.init_state(whole, spec), bnbf.init_state(part, spec)
        for step, g in enumerate(grads, start=1):
            bnbf.update_(whole, g, s_whole, hp, step)
            token = FIRST_BLOCKS.set({part.data_ptr(): offset})
            try:
                bnbf.update_(part, g[cut:].clone(), s_part, hp, step)
            finally:
                FIRST_BLOCKS.reset(token)
        sliced = [t[3:] if n.endswith("_absmax") else t[cut:] for n, t in zip(s_whole._fields, s_whole)]
        return [torch.equal(part, whole[cut:])] + [torch.equal(a, b) for a, b in zip(s_part, sliced)]

    assert all(run(3))
    assert not all(run(0))

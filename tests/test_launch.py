"""The launcher's variants must give the same bits: the in-place step's direct launches (after a group's first,
Triton-dispatched launch, later steps launch the compiled kernel themselves: one driver call with the packed
parameter buffer, or Triton's C launcher) as Triton's dispatch, and
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

NATIVE_BUILT = direct_launch.NATIVE_LAUNCH
HPARAMS = [
    {"lr": 1e-2, "weight_decay": 0.0},
    {"lr": 3e-3, "weight_decay": 0.1, "betas": (0.8, 0.95)},
    {"lr": 1e-3, "weight_decay": 0.01, "betas": (0.9, 0.99)},
]


def _run(mode: str, rule: str, bits: int, dtype: torch.dtype, max_unorm: float, monkeypatch):
    monkeypatch.setattr(direct_launch, "DIRECT_LAUNCH", mode != "jit")
    monkeypatch.setattr(direct_launch, "NATIVE_LAUNCH", mode == "direct" and NATIVE_BUILT)
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
    entries = [entry for _, group in plan.groups for entry in group.compiled.values()]
    return params, state, entries


@pytest.mark.gpu
@pytest.mark.parametrize("rule,max_unorm", [("adamw", 0.0), ("adamw", 0.05), ("lion", 0.0), ("lamb", 0.0)])
@pytest.mark.parametrize("bits", [8, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_direct_launch_matches_triton_dispatch(rule, max_unorm, bits, dtype, monkeypatch):
    native = NATIVE_BUILT  # the extension was built: its launch must be what serves
    p_jit, s_jit, used_jit = _run("jit", rule, bits, dtype, max_unorm, monkeypatch)
    compiled = compiled_count()
    for mode in ("triton", "direct"):
        p_dir, s_dir, entries = _run(mode, rule, bits, dtype, max_unorm, monkeypatch)
        assert not used_jit and entries, "the direct launch was not taken (or taken with BNBF_LAUNCH=jit)"
        # an entry's first field is the packer of the extension's launch, None for Triton's launcher
        assert all((e[0] is not None) == (mode == "direct" and native) for e in entries), (mode, direct_launch.REFUSED)
        assert compiled_count() == compiled, "the direct path compiled a kernel the dispatched path had not"
        for k in p_jit:
            assert torch.equal(p_jit[k], p_dir[k]), (mode, k)
            for a, b in zip(s_jit[k], s_dir[k]):
                assert torch.equal(a, b), (mode, k)


@pytest.mark.gpu
def test_direct_launch_errors_and_threads():
    """The extension's launch: a step from a thread that never touched CUDA makes the device's context current
    and steps as the main thread does; a driver error (a null function) raises RuntimeError naming it."""
    if not NATIVE_BUILT:
        pytest.skip("the extension's launch is not built")
    import threading

    gen = torch.Generator().manual_seed(3)
    params = [torch.randn(s, generator=gen).cuda() for s in ((4097,), (300,))]
    grads = [torch.randn(p.shape, generator=gen).cuda() * 0.1 for p in params]
    twins = [p.clone() for p in params]
    spec, hp = bnbf.OptimSpec(rule="adamw", min_8bit_size=256), {"lr": 1e-2}
    state, twin_state = bnbf.init_state(params, spec), bnbf.init_state(twins, spec)
    for step in (1, 2):  # the second step launches directly
        bnbf.update_(twins, grads, twin_state, hp, step)
    bnbf.update_(params, grads, state, hp, 1)
    errors = []

    def second_step():
        try:
            bnbf.update_(params, grads, state, hp, 2)
        except Exception as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    thread = threading.Thread(target=second_step)
    thread.start()
    thread.join()
    torch.cuda.synchronize()
    assert not errors, errors
    assert all(torch.equal(a, b) for a, b in zip(params, twins))
    assert all(torch.equal(a, b) for s, t in zip(state, twin_state) for a, b in zip(s, t))
    with pytest.raises(RuntimeError, match="CUDA driver error"):
        direct_launch.NATIVE.launch(0, 1, 32, 0, 0, b"", 0)


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


def _fake_kernel(signature: dict, meta=(4, 1, 0)):
    """What _packer reads of a compiled Triton kernel: its launcher's options, packed metadata, signature."""
    from types import SimpleNamespace

    run = SimpleNamespace(
        launch_cooperative_grid=False, launch_pdl=False, global_scratch_size=0, profile_scratch_size=0
    )
    return SimpleNamespace(run=run, packed_metadata=meta, src=SimpleNamespace(signature=signature), function=77)


@pytest.mark.parametrize(
    "layout,fmt",
    [
        (((0, 8), (8, 4), (12, 4), (16, 8), (24, 8), (32, 8)), "<QifdQQ"),  # packed as the driver reports
        (((0, 8), (8, 4), (12, 4), (16, 8), (24, 8), (32, 8))[:4], "<Qifd"),  # no scratch pointers
        (((0, 8), (16, 4), (20, 4), (24, 8), (32, 8), (40, 8)), "<Q8xifdQQ"),  # padding between parameters
    ],
)
def test_native_packer_lays_arguments_out_as_the_driver_reports(layout, fmt, monkeypatch):
    """The extension's launch takes one parameter buffer: each runtime argument at the driver's offset, of the
    type Triton compiled it for, the scratch pointers Triton appends zero (checked on CPU with a stand-in kernel;
    the CUDA test above checks the launched bits)."""
    import struct
    from types import SimpleNamespace

    monkeypatch.setattr(direct_launch, "NATIVE", SimpleNamespace(param_layout=lambda f: layout))
    monkeypatch.setattr(direct_launch, "NATIVE_LAUNCH", True)
    kernel = _fake_kernel({"p": "*fp32", "n": "i32", "x": "fp32", "d": "fp64", "K": "constexpr"})
    args = (0x7F00_0000_1230, 7, 0.5, 0.25, None)
    pack, n, function, head = direct_launch._native(kernel, args)
    assert (n, function, head) == (4, 77, (128, 0))
    assert pack(*args[:n]) == struct.pack(fmt, *args[:4], *(0,) * fmt.count("Q", 2))


@pytest.mark.parametrize(
    "signature,args,layout,reason",
    [
        ({"p": "*fp32", "n": "constexpr", "x": "fp32"}, (1, None, 0.5), ((0, 8), (8, 4)), "not first"),
        ({"p": "*fp32", "n": "i32"}, (1, 0.5), ((0, 8), (8, 4)), "type i32 (float)"),
        ({"p": "*fp32", "n": "i32"}, (1, 2), ((0, 8), (8, 8)), "type i32 (int)"),
        ({"p": "*fp32", "n": "i32"}, (1, 2), ((0, 8),), "1 parameters for 2"),
        ({"p": "*fp32", "n": "i32"}, (1, 2), ((0, 8), (8, 4), (16, 4)), "3 parameters for 2"),
        ({"p": "*fp32", "n": "fp16"}, (1, 2.0), ((0, 8), (8, 2)), "type fp16"),
        ({"p": "*fp32"}, (1, None), ((0, 8),), "signature of 1 for 2 args"),
        ({"p": "*fp32"}, (1,), None, "no parameter layout"),
    ],
)
def test_native_packer_refuses_what_it_cannot_lay_out(signature, args, layout, reason, monkeypatch):
    """Anything the packer cannot match to the driver's layout leaves the launch to Triton's launcher, with the
    reason counted: a specialized runtime argument, a value of another type, a size or count that differs."""
    from types import SimpleNamespace

    monkeypatch.setattr(direct_launch, "NATIVE", SimpleNamespace(param_layout=lambda f: layout))
    monkeypatch.setattr(direct_launch, "NATIVE_LAUNCH", True)
    monkeypatch.setattr(direct_launch, "REFUSED", __import__("collections").Counter())
    assert direct_launch._native(_fake_kernel(signature), args) is None
    (why,) = direct_launch.REFUSED
    assert reason in why, why
    for meta in ((4, 2, 0), (4, 1, 0, 2, 1, 1)):  # two CTAs, a cluster: not a plain grid
        assert direct_launch._native(_fake_kernel(signature, meta), args) is None

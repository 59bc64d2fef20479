"""bnbf.distributed on CPU: FSDP2 (``fully_shard``) over two gloo processes, against single-process references.

The two processes are spawned once for the module (a spawn costs seconds); each scenario runs on both
ranks, and its assertions there; the tests below report each scenario's outcome. The model mixes shards
that hold whole 256-element blocks (64 rows of 8, 4 rows of 128), a shard boundary inside a block
(75 rows of 8: rank 1 starts at element 600), float32-state tensors below ``min_8bit_size`` and an empty
shard (a 1 x 300 weight: rank 1 holds no row).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import tempfile
import traceback

import pytest
import torch
from tolerances import STATE8, STATE32

# one spawn serves the whole module: under pytest-xdist its tests stay on one worker (--dist loadgroup)
pytestmark = pytest.mark.xdist_group("spawn_distributed")

WORLD = 2
STEPS = 2
LR = 1e-2
MIN8 = 1024  # min_8bit_size: small 8-bit tensors keep the interpreter pass short
DEVICE = torch.device("cpu")  # the workers' device: cuda:rank in the two-GPU run


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 128),  # weight 128 x 8: 64 rows a rank, 2 whole blocks
        torch.nn.Tanh(),
        torch.nn.Linear(128, 8),  # weight 8 x 128: 4 rows a rank, 2 whole blocks
        torch.nn.Tanh(),
        torch.nn.Linear(8, 150),  # weight 150 x 8: rank 1 starts at element 600, inside block 2
        torch.nn.Tanh(),
        torch.nn.Linear(150, 1),  # weight 1 x 150, float32 state; rank 1's shard is empty
    )


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)


def _aligned(name: str) -> bool:
    """Whether every shard of this param holds whole 256-element blocks (see the module docstring)."""
    return name in ("0.weight", "2.weight")


def mesh():
    """The workers' 1-D mesh, of DEVICE's type: without it fully_shard takes the CUDA mesh wherever CUDA is
    there, and moved the gloo run's CPU model to cuda:0 on the GPU machine (a gloo collective on a CUDA
    tensor then crashed the rank)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(DEVICE.type, (WORLD,))


class _Run:
    """An FSDP2 model with bnbf state, and an unsharded copy stepped on the same averaged grads."""

    def __init__(self, spec, hparams):
        from torch.distributed.fsdp import fully_shard

        import bnbf
        import bnbf.distributed as bd

        self.ref_model = _model().to(DEVICE)
        self.model = _model().to(DEVICE)
        fully_shard(self.model, mesh=mesh())
        self.params = dict(self.model.named_parameters())
        self.ref_params = {k: p.detach().clone() for k, p in self.ref_model.named_parameters()}
        self.spec, self.hparams = spec, hparams
        self.state = bd.init_state(self.params, spec, hparams)
        self.ref_state = bnbf.init_state(self.ref_params, spec, hparams)
        self.step = 0

    def grads(self) -> dict:
        """Backward on this rank's batch; FSDP2 reduce-scatters the average of the ranks' grads."""
        rank = torch.distributed.get_rank()
        self.model.zero_grad(set_to_none=True)
        x, y = (t.to(DEVICE) for t in _batch(rank, self.step))
        torch.nn.functional.mse_loss(self.model(x), y).backward()
        return {k: p.grad for k, p in self.params.items()}

    def advance(self, grads: dict | None = None, reference: bool = True) -> dict:
        import bnbf
        import bnbf.distributed as bd

        self.step += 1
        grads = self.grads() if grads is None else grads
        full = {k: g.full_tensor() for k, g in grads.items()}
        bd.update_(self.params, grads, self.state, self.hparams, self.step)
        if reference:
            bnbf.update_(self.ref_params, full, self.ref_state, self.hparams, self.step)
        return grads


def _gathered(params: dict) -> dict:
    return {k: p.full_tensor() for k, p in params.items()}


def _local_slice(name: str, p, full: torch.Tensor) -> torch.Tensor:
    """The rows of ``full`` that this rank's shard of ``p`` holds."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return full[offset[0] : offset[0] + shape[0]]


def _first_blocks(params: dict, local_p: dict, local_s: dict):
    """The core's dither for copies of the local shards as bnbf.distributed draws it for the shards: each 8-bit
    shard's first global block (its start // 256, the block it starts in), keyed by the copy's address."""
    import contextlib

    from bnbf.reference import FIRST_BLOCKS

    blocks = {}
    for k, p in params.items():
        start = _local_offset(p)
        if start and type(local_s[k]).layout.quantized and local_p[k].numel():
            blocks[local_p[k].data_ptr()] = start // type(local_s[k]).layout.block_size
    if not blocks:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def given():
        token = FIRST_BLOCKS.set(blocks)
        try:
            yield
        finally:
            FIRST_BLOCKS.reset(token)

    return given()


def _local_offset(p) -> int:
    """The flat index of this rank's first element of ``p`` (torch's own split, not bnbf's)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return offset[0] * (p.numel() // p.shape[0] if p.shape[0] else 0)


# --- scenarios (run on every rank) ------------------------------------------------------------------


def scenario_adamw32_exact():
    """32-bit state: sharded training equals the unsharded run bit for bit, and torch.optim.AdamW."""
    import bnbf

    run = _Run(bnbf.OptimSpec(rule="adamw", state_bits=32, min_8bit_size=MIN8), {"lr": LR, "weight_decay": 0.01})
    torch_params = {k: p.clone().requires_grad_() for k, p in run.ref_params.items()}
    opt = torch.optim.AdamW(torch_params.values(), lr=LR, weight_decay=0.01)
    init = {k: p.clone() for k, p in run.ref_params.items()}
    for _ in range(STEPS):
        grads = run.advance()
        for k, p in torch_params.items():
            p.grad = grads[k].full_tensor()
        opt.step()
    ours = _gathered(run.params)
    tol = STATE32[(torch.float32, 32)]
    for k in ours:
        assert torch.equal(ours[k], run.ref_params[k]), k
        torch.testing.assert_close(ours[k] - init[k], torch_params[k].detach() - init[k], atol=tol.atol, rtol=tol.rtol)


def _resync8(rule: str, hparams: dict, torch_step):
    """8-bit state: each step equals a float reference (the rule from its paper, in plain torch) started
    from the sharded run's own dequantized state, within the 8-bit re-synced tolerance. Where every shard
    holds whole blocks, each rank's params, codes and block scales equal the unsharded bnbf run's bit for bit
    (the dither drawn for the unsharded tensor's blocks: the shard's first block, issue 15); where a shard
    starts inside a block, rank 0's whole blocks do."""
    import bnbf
    import bnbf.distributed as bd

    run = _Run(bnbf.OptimSpec(rule=rule, min_8bit_size=MIN8), hparams)
    tol = STATE8[(torch.float32, 8)]
    rank = torch.distributed.get_rank()
    for _ in range(STEPS):
        before = _gathered(run.params)
        deq = {k: {n: t.full_tensor() for n, t in d.items()} for k, d in bd.dequantize_state(run.state).items()}
        grads = run.advance()
        after = _gathered(run.params)
        for k in after:
            want_p, _ = torch_step(before[k], grads[k].full_tensor(), deq[k], run.step)
            diff = (after[k] - want_p).abs()
            assert diff.mean() < tol.mean_abs, (k, diff.mean())
            assert (diff / (want_p.abs() + 1e-9)).mean() < tol.mean_rel, k
    block = 256
    for k, p in run.params.items():
        local = p.to_local().reshape(-1)
        ref = _local_slice(k, p, run.ref_params[k]).reshape(-1)
        if _aligned(k):  # every rank: the unsharded blocks it holds, with their dither
            assert torch.equal(local, ref), (k, rank)
            sh = bd._shards(p)
            first = sh.start // block
            mine, whole = bd._local_state(run.state[k], sh), run.ref_state[k]
            for name, got, want in zip(mine._fields, mine, whole):
                if name.endswith("_absmax"):
                    want = want[first : first + got.numel()]
                else:
                    want = _local_slice(k, p, want)
                assert torch.equal(got, want), (k, name, rank)
        elif rank == 0 and p.numel() >= MIN8:  # rank 0's whole blocks: same blocks, same dither as unsharded
            whole = local.numel() // block * block
            assert torch.equal(local[:whole], ref[:whole]), k
        elif p.numel() < MIN8:  # float32 state: elementwise, bit for bit on every rank
            assert torch.equal(local, ref), k


def _adamw_step(p, g, s, t, lr=LR, wd=0.01, b1=0.9, b2=0.999, eps=1e-8):
    m = b1 * s["exp_avg"] + (1 - b1) * g
    v = b2 * s["exp_avg_sq"] + (1 - b2) * g * g
    p = p * (1 - lr * wd)
    p = p - lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
    return p, (m, v)


def _lion_step(p, g, s, t, lr=LR, wd=0.01, b1=0.9, b2=0.99):
    m = s["exp_avg"]
    p = p * (1 - lr * wd) - lr * torch.sign(b1 * m + (1 - b1) * g)
    return p, (b2 * m + (1 - b2) * g,)


def scenario_adamw8_resync():
    _resync8("adamw", {"lr": LR, "weight_decay": 0.01}, _adamw_step)


def scenario_lion8_resync():
    _resync8("lion", {"lr": LR, "weight_decay": 0.01, "betas": (0.9, 0.99)}, _lion_step)


def scenario_plumbing_exact():
    """Each rank's 8-bit step is the core's step of its local shard (state, codes, scales and param) with the
    shard's first global block for the dither, also for the shard that starts inside a block (the block it
    starts in), for the pure ``update`` and for a held plan."""
    import bnbf
    import bnbf.distributed as bd

    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=MIN8)
    run = _Run(spec, {"lr": LR})
    twin = _Run(spec, {"lr": LR})  # the same model, stepped through a held plan
    held = bd.plan(twin.params, twin.state)
    held.step(run.advance(reference=False), {"lr": LR}, 1)  # a state that is not all zeros
    local_p = {k: p.to_local().detach().clone() for k, p in run.params.items()}
    local_s = {
        k: type(s)(*(t.clone() for t in bd._local_state(s, bd._shards(run.params[k])))) for k, s in run.state.items()
    }
    grads = run.grads()
    with torch.no_grad():  # the params require grad: the pure step refuses them under grad mode, as the core's does
        new_p, new_s = bd.update(run.params, grads, run.state, {"lr": LR}, 2)
    with _first_blocks(run.params, local_p, local_s):
        bnbf.update_(local_p, {k: g.to_local() for k, g in grads.items()}, local_s, {"lr": LR}, 2)
    bd.update_(run.params, grads, run.state, {"lr": LR}, 2)
    held.step(grads, {"lr": LR}, 2)
    for k, p in run.params.items():
        assert torch.equal(p.to_local(), local_p[k]), k
        assert torch.equal(twin.params[k].to_local(), local_p[k]), k
        # a state rebuilt around another tensor is not served from the local views of the old one
        s = run.state[k]
        other = s._replace(**{s._fields[-1]: s[-1].detach().clone()})
        assert bd._local_state(other, bd._shards(p))[-1] is not bd._local_state(s, bd._shards(p))[-1], k
        assert torch.equal(new_p[k].to_local(), local_p[k]), k
        assert new_p[k].placements == p.placements and new_p[k].shape == p.shape
        for got in (bd._local_state(run.state[k], bd._shards(p)), bd._local_state(new_s[k], bd._shards(p))):
            for a, b in zip(got, local_s[k]):
                assert torch.equal(a, b), k


def scenario_state_bytes():
    """Each rank keeps its shards' share of the state: 8-bit states about 1/world of unsharded; over the
    ranks, the unsharded bytes plus the scales' padding and the split block's second scale."""
    import bnbf

    run = _Run(bnbf.OptimSpec(rule="adamw", min_8bit_size=MIN8), {"lr": LR})
    kinds = {type(t).__name__ for s in run.state.values() for t in s}
    assert kinds == {"DTensor"}, kinds
    assert all(type(s).layout == type(r).layout for s, r in zip(run.state.values(), run.ref_state.values()))
    nbytes = lambda s: sum(t.to_local().numel() * t.element_size() for t in s)  # noqa: E731
    quantized = [k for k, s in run.state.items() if type(s).layout.quantized]
    mine8 = sum(nbytes(run.state[k]) for k in quantized)
    whole8 = sum(bnbf.state_nbytes(run.ref_state[k]) for k in quantized)
    assert 0.49 * whole8 < mine8 < 0.51 * whole8, (mine8, whole8)
    total = torch.tensor([sum(nbytes(s) for s in run.state.values())], device=DEVICE)
    torch.distributed.all_reduce(total)
    # per 8-bit slot, 2 + 2 scales for the 4 blocks of 128 x 8 and of 8 x 128; 3 + 3 for the 5 of 150 x 8,
    # whose split block has one scale a piece
    extra = 2 * 4 * ((2 * 2 - 4) + (2 * 2 - 4) + (2 * 3 - 5))
    assert int(total) == bnbf.state_nbytes(run.ref_state) + extra, (int(total), bnbf.state_nbytes(run.ref_state))


def scenario_errors():
    """Bad input raises before anything is written; sharded norm rules raise until the core reduces norms."""
    import bnbf
    import bnbf.distributed as bd

    run = _Run(bnbf.OptimSpec(rule="adamw", min_8bit_size=MIN8), {"lr": LR})
    grads = run.grads()
    before = {k: p.to_local().clone() for k, p in run.params.items()}
    plain = {k: g.full_tensor() for k, g in grads.items()}
    with pytest.raises(TypeError, match="mixed torch.Tensor and DTensor"):
        bd.update_(run.params, plain, run.state, {"lr": LR}, 1)
    for k, p in run.params.items():
        assert torch.equal(p.to_local(), before[k]), k
    saved = {k: dict(v) for k, v in bd.state_dict(run.state).items()}
    saved["4.weight"]["exp_avg_absmax"] = torch.ones(3)  # 150 x 8 has 5 blocks
    kept = {k: [t.to_local().clone() for t in s] for k, s in run.state.items()}
    with pytest.raises(
        ValueError, match=r"saved\['4.weight'\]\.exp_avg_absmax is torch.float32 \(3,\); the state needs"
    ):
        bd.load_state_dict_(run.state, saved)
    for k, s in run.state.items():
        assert all(torch.equal(t.to_local(), c) for t, c in zip(s, kept[k])), k
    # a gradient asked through DTensors: the local shards the core steps carry no history, so it is refused (the
    # pure step gave a result without history, silently)
    with_history = {k: p.detach().requires_grad_() * 1.0 for k, p in run.params.items()}
    for step_fn in (bd.update, bd.update_):
        with pytest.raises(RuntimeError, match="not differentiable"):
            step_fn(with_history, grads, run.state, {"lr": LR}, 1)
    for k, p in run.params.items():
        assert torch.equal(p.to_local(), before[k]), k
    with pytest.raises(TypeError, match=r"param\['0.weight'\] is a DTensor .* use bnbf.distributed.plan"):
        bnbf.plan(run.params, run.state)

    # a grad, or a state, of another global shape whose local shapes fit on rank 1 only ((301,) for (300,): 151
    # and 150 elements on rank 0, 150 and 150 on rank 1): every rank refuses it, naming the global shapes
    from torch.distributed.tensor import Shard, distribute_tensor

    m = mesh()
    shard = lambda n: distribute_tensor(torch.ones(n, device=DEVICE), m, [Shard(0)])  # noqa: E731
    held = lambda p, g, s, h, t: bd.plan(p, s).step(g, h, t)  # noqa: E731
    s = bd.init_state({"w": shard(300)}, bnbf.OptimSpec(rule="adamw", state_bits=32))
    for n_p, n_g, match in (
        (300, 301, r"grad\['w'\] has shape \(301,\) but the param has shape \(300,\)"),
        (301, 301, r"state\['w'\]\.exp_avg does not fit the param: expected global shape \(301,\)"),
    ):
        p, g = {"w": shard(n_p)}, {"w": shard(n_g)}
        for step_fn in (bd.update_, bnbf.update_, bnbf.update, held):
            with pytest.raises(ValueError, match=match):
                step_fn(p, g, s, {"lr": LR}, 1)
        assert torch.equal(p["w"].to_local(), torch.ones_like(p["w"].to_local()))


def scenario_compose_in_place():
    """bnbf.update_ of per-leaf hyperparameters or of a state tree of two rules (bnbf.compose: one core call per
    group) on DTensors: the pure step's and the unsharded run's result; every group checked before the first
    steps, and memory shared between groups refused by the local shards' addresses (a DTensor's are 0)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    import bnbf

    gen = torch.Generator().manual_seed(3)
    full = {k: torch.randn(n, generator=gen).to(DEVICE) for k, n in (("w", (37, 8)), ("b", (37,)), ("v", (300,)))}
    g_full = {k: torch.randn(v.shape, generator=gen).to(DEVICE) for k, v in full.items()}
    m = mesh()
    shard = lambda t: distribute_tensor(t.clone(), m, [Shard(0)])  # noqa: E731
    no_decay = lambda path, p: {"lr": LR, "weight_decay": 0.0 if p.ndim == 1 else 0.1}  # noqa: E731
    by_rule = {"adamw": {"lr": LR}, "lion": {"lr": LR / 10}}
    for spec, hp in (
        (bnbf.OptimSpec(rule="adamw", state_bits=32), no_decay),
        (lambda path, p: bnbf.OptimSpec(rule="lion" if p.ndim == 1 else "adamw", state_bits=32), by_rule),
        (lambda path, p: bnbf.OptimSpec(rule="lion" if p.ndim == 1 else "adamw", min_8bit_size=0), by_rule),
    ):
        params, grads = {k: shard(v) for k, v in full.items()}, {k: shard(v) for k, v in g_full.items()}
        state = bnbf.init_state(params, spec)
        ref, ref_state = {k: v.clone() for k, v in full.items()}, bnbf.init_state(full, spec)
        new, new_state = bnbf.update(params, grads, state, hp, 1)
        bnbf.update_(params, grads, state, hp, 1)
        bnbf.update_(ref, g_full, ref_state, hp, 1)
        for k, p in params.items():
            assert torch.equal(p.to_local(), new[k].to_local()), k
            assert all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(state[k], new_state[k])), k
            if not type(state[k]).layout.quantized:  # elementwise: the unsharded run's, bit for bit
                assert torch.equal(p.full_tensor(), ref[k]), k
    # one mapping for states of two rules, LAMB's after AdamW's: LAMB's norms are summed across the mesh (the
    # step of both in one core call took the first rule's context, which reduces none)
    spec = lambda path, p: bnbf.OptimSpec(rule="adamw" if p.ndim == 2 else "lamb", state_bits=32)  # noqa: E731
    params, grads = {k: shard(v) for k, v in full.items()}, {k: shard(v) for k, v in g_full.items()}
    state, ref = bnbf.init_state(params, spec), {k: v.clone() for k, v in full.items()}
    ref_state = bnbf.init_state(ref, spec)
    new, _ = bnbf.update(params, grads, state, {"lr": LR}, 1)
    bnbf.update_(params, grads, state, {"lr": LR}, 1)
    bnbf.update_(ref, g_full, ref_state, {"lr": LR}, 1)
    tol = STATE32[(torch.float32, 32)]
    for k, p in params.items():
        for got in (p, new[k]):
            torch.testing.assert_close(got.full_tensor() - full[k], ref[k] - full[k], atol=tol.atol, rtol=tol.rtol)

    spec = bnbf.OptimSpec(rule="adamw", state_bits=32)
    two = lambda path, p: {"lr": LR if path == "a" else LR / 2}  # noqa: E731 - a group per leaf
    params = {"a": shard(full["v"]), "c": shard(full["v"])}
    grads = {k: shard(g_full["v"]) for k in params}
    one = bnbf.init_state(params["a"], spec)
    with pytest.raises(ValueError, match=r"state\['a'\]\.exp_avg\w* and state\['c'\]\.exp_avg\w* overlap"):
        bnbf.update_(params, grads, {"a": one, "c": one}, two, 1)
    state = bnbf.init_state(params, spec)
    with pytest.raises(ValueError, match=r"grad\['c'\] shares memory with param\['a'\]"):
        bnbf.update_(params, {"a": grads["a"], "c": params["a"]}, state, two, 1)
    # a later group that would raise in its own step: LAMB's norms across the mesh beside a plain param, a
    # plain grad, a grad of another global shape
    params = {"a": params["a"], "w": shard(full["v"]), "x": full["v"].clone()}
    lamb = lambda path, p: bnbf.OptimSpec(rule="adamw" if path == "a" else "lamb", state_bits=32)  # noqa: E731
    state = bnbf.init_state(params, lamb)
    grads = {"a": grads["a"], "w": shard(g_full["v"]), "x": g_full["v"]}
    hp = {"adamw": {"lr": LR}, "lamb": {"lr": LR}}
    with pytest.raises(NotImplementedError, match="lamb scales its step by per-tensor norms"):
        bnbf.update_(params, grads, state, hp, 1)
    del params["x"], grads["x"], state["x"]
    for bad, err, match in (
        (g_full["v"], TypeError, r"grad\['w'\]: got mixed torch.Tensor and DTensor"),
        (
            shard(torch.ones(301, device=DEVICE)),
            ValueError,
            r"grad\['w'\] has shape \(301,\) but the param has shape \(300,\)",
        ),
    ):
        with pytest.raises(err, match=match):
            bnbf.update_(params, {**grads, "w": bad}, state, hp, 1)
    assert torch.equal(params["a"].full_tensor(), full["v"])  # the first group was not stepped


def scenario_norms():
    """LAMB, LARS and max_unorm on shards step with the whole tensors' norms: 32-bit state equals the
    unsharded run up to the order of the norms' sums (the core's NORM_REDUCE hook all-reduces them)."""
    import bnbf
    import bnbf.distributed as bd

    cases = [
        ("lamb", {"lr": LR, "weight_decay": 0.01}, {}),
        ("lars", {"lr": LR, "momentum": 0.9, "weight_decay": 0.01}, {}),
        ("adamw", {"lr": LR}, {"max_unorm": 0.001}),  # small enough to clip every tensor
    ]
    tol = STATE32[(torch.float32, 32)]
    for rule, hp, kw in cases:
        run = _Run(bnbf.OptimSpec(rule=rule, state_bits=32), hp)
        init = {k: p.detach().clone() for k, p in run.ref_params.items()}
        grads = run.grads()  # one step: the norms of a fresh state's first update
        bd.update_(run.params, grads, run.state, hp, 1, **kw)
        bnbf.update_(run.ref_params, {k: g.full_tensor() for k, g in grads.items()}, run.ref_state, hp, 1, **kw)
        for k, p in _gathered(run.params).items():
            torch.testing.assert_close(p - init[k], run.ref_params[k] - init[k], atol=tol.atol, rtol=tol.rtol)
        if kw:  # the clipping bounds each step's change by lr * max_unorm * ||p|| (Adam alone moves ~lr an element)
            for k, p in run.ref_params.items():
                bound = LR * kw["max_unorm"] * init[k].norm() * 1.01
                assert (p - init[k]).norm() <= bound, (k, (p - init[k]).norm(), bound)


def scenario_clip_sharded():
    """max_grad_norm over sharded 16-bit grads: torch's total of the DTensor grads, applied by the kernels as they
    load each local grad (a clipped bfloat16/float16 copy rounded the products): with grads whose norms every
    order of adding gives alike (integer norms), whole-block shards step as the unsharded tensors bit for bit.
    Sharded and plain grads in one call: a clear NotImplementedError (torch's own clip fails inside
    _foreach_norm), nothing written."""
    from torch.distributed.tensor import Shard, distribute_tensor

    import bnbf
    import bnbf.distributed as bd

    m = mesh()
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=0)
    for dtype in (torch.bfloat16, torch.float16):
        full = {"w": torch.randn(64, 8, generator=torch.Generator().manual_seed(1)), "b": torch.zeros(32, 16)}
        full = {k: v.to(DEVICE, dtype) for k, v in full.items()}
        g_full = {k: torch.zeros_like(v) for k, v in full.items()}
        g_full["w"].view(-1)[::2] = 0.25  # 256 elements: norm 4
        g_full["b"].view(-1)[:9] = 1.0  # norm 3; the total 5
        params = {k: distribute_tensor(v.clone(), m, [Shard(0)]) for k, v in full.items()}
        grads = {k: distribute_tensor(v.clone(), m, [Shard(0)]) for k, v in g_full.items()}
        state, ref_state = bd.init_state(params, spec), bnbf.init_state(full, spec)
        ref = {k: v.clone() for k, v in full.items()}
        for t in (1, 2):
            bnbf.update_(params, grads, state, {"lr": LR}, t, max_grad_norm=1.0)
            bnbf.update_(ref, g_full, ref_state, {"lr": LR}, t, max_grad_norm=1.0)
        for k, p in _gathered(params).items():
            assert torch.equal(p, ref[k]), (dtype, k, (p.float() - ref[k].float()).abs().max())
    mixed = {"w": params["w"], "b": full["b"].clone()}
    mixed_g = {"w": grads["w"], "b": g_full["b"]}
    before = [mixed["w"].to_local().clone(), mixed["b"].clone()]
    with pytest.raises(NotImplementedError, match="DTensor .* and plain grads"):
        bnbf.update_(mixed, mixed_g, {"w": state["w"], "b": ref_state["b"]}, {"lr": LR}, 3, max_grad_norm=1.0)
    assert torch.equal(mixed["w"].to_local(), before[0]) and torch.equal(mixed["b"], before[1])


def scenario_odd_sizes():
    """numel 1, 257 x 3 and 4097 in float32, float16 and bfloat16, sharded over 2 ranks (rank 1 starts inside
    a block, or holds nothing): the step is the core's step of each local shard, and the checkpoint form
    loads into unsharded state equal to the sharded state where blocks are whole, within a code step
    elsewhere."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import bnbf
    import bnbf.distributed as bd
    from bnbf.quant import state_map

    mesh = init_device_mesh(DEVICE.type, (WORLD,))
    gen = torch.Generator().manual_seed(7)
    shapes = {"one": (1,), "rows": (257, 3), "long": (4097,)}
    full = {
        f"{k}_{dt}": torch.randn(s, generator=gen).to(dt).to(DEVICE)
        for k, s in shapes.items()
        for dt in (torch.float32, torch.float16, torch.bfloat16)
    }
    grads_full = {k: torch.randn(v.shape, generator=gen).to(v.dtype).to(DEVICE) for k, v in full.items()}
    params = {k: distribute_tensor(v.clone(), mesh, [Shard(0)]) for k, v in full.items()}
    grads = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in grads_full.items()}
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=0)
    state = bd.init_state(params, spec)
    local_p = {k: p.to_local().clone() for k, p in params.items()}
    local_s = bnbf.init_state(local_p, spec)
    for t in (1, 2):
        bd.update_(params, grads, state, {"lr": LR}, t)
        with _first_blocks(params, local_p, local_s):
            bnbf.update_(local_p, {k: g.to_local() for k, g in grads.items()}, local_s, {"lr": LR}, t)
    for k, p in params.items():
        assert torch.equal(p.to_local(), local_p[k]), k
        assert p.to_local().dtype == full[k].dtype

    sharded = {k: {n: v.full_tensor() for n, v in d.items()} for k, d in bd.dequantize_state(state).items()}
    saved = {
        k: {n: v if n == bd.LAYOUT_KEY else v.full_tensor() for n, v in d.items()}
        for k, d in bd.state_dict(state).items()
    }
    plain = bnbf.init_state({k: v.clone() for k, v in full.items()}, spec)
    bd.load_state_dict_(plain, saved)
    for k, d in bnbf.dequantize_state(plain).items():
        for n, got in d.items():
            want = sharded[k][n]
            if k.startswith("one"):  # one element on rank 0, none on rank 1: nothing is split
                assert torch.equal(got, want), (k, n)
            else:
                gap = state_map("power", n == "exp_avg").diff().max().to(DEVICE)
                scale = getattr(plain[k], n + "_absmax").repeat_interleave(256)[: got.numel()].view(got.shape)
                assert ((got - want).abs() <= gap * scale).all(), (k, n)


def scenario_checkpoint():
    """DCP: saved on 2 ranks; loaded on 2 ranks (bit for bit where shards hold whole blocks, and training
    continues as if uninterrupted) and unsharded on one process (equal to the sharded state where shards
    hold whole blocks, within one code step elsewhere) and on FSDP2 over a mesh of one rank (equal to the
    unsharded load), and training continues."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import bnbf
    import bnbf.distributed as bd
    from bnbf.quant import state_map

    rank = torch.distributed.get_rank()
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=MIN8)
    run = _Run(spec, {"lr": LR})
    for _ in range(STEPS):
        run.advance(reference=False)
    path = os.environ["BNBF_TEST_CKPT"]
    saved_params = {k: p.detach().clone() for k, p in run.params.items()}
    saved_deq = {k: {n: t.full_tensor() for n, t in d.items()} for k, d in bd.dequantize_state(run.state).items()}
    dcp.save({"optim": bd.state_dict(run.state), "params": saved_params}, checkpoint_id=path)
    # training goes on: two more steps, their grads kept for the replays
    kept = [run.advance(reference=False) for _ in range(2)]
    kept = [{k: g.detach().clone() for k, g in gs.items()} for gs in kept]
    final = _gathered(run.params)

    # the same mesh: fresh state, loaded, continued on the kept grads
    fresh = bd.init_state(run.params, spec, {"lr": LR})
    sd = bd.state_dict(fresh)
    dcp.load({"optim": sd}, checkpoint_id=path)
    bd.load_state_dict_(fresh, sd)
    deq = {k: {n: t.full_tensor() for n, t in d.items()} for k, d in bd.dequantize_state(fresh).items()}
    with torch.no_grad():
        for k, p in run.params.items():
            p.to_local().copy_(saved_params[k].to_local())
    for t, gs in enumerate(kept, start=STEPS + 1):
        bd.update_(run.params, gs, fresh, {"lr": LR}, t)
    again = _gathered(run.params)
    for k in final:
        exact = _aligned(k) or run.params[k].numel() < MIN8
        if exact:
            assert all(torch.equal(deq[k][n], saved_deq[k][n]) for n in deq[k]), k
            assert torch.equal(again[k], final[k]), k
    torch.distributed.barrier()

    kept_full = [{k: g.full_tensor() for k, g in gs.items()} for gs in kept]
    one = torch.distributed.new_group([0])  # a mesh of one rank: every rank makes the group
    # one process: unsharded, and FSDP2 on a mesh of one
    if rank == 0:
        model = _model()
        params = {k: p.detach().clone() for k, p in model.named_parameters()}
        state = bnbf.init_state(params, spec, {"lr": LR})
        sd = bd.state_dict(state)
        dcp.load({"optim": sd, "params": params}, checkpoint_id=path, no_dist=True)
        bd.load_state_dict_(state, sd)
        resynced = set()
        for k, d in bnbf.dequantize_state(state).items():
            for n, got in d.items():
                if not torch.equal(got, saved_deq[k][n].cpu()):
                    resynced.add(k)
                want = saved_deq[k][n].cpu()
                if _aligned(k) or params[k].numel() < MIN8:
                    assert torch.equal(got, want), (k, n)
                else:  # split blocks re-expressed in the larger scale: at most one code step apart
                    signed = n == "exp_avg"
                    gap = state_map("power", signed).diff().max()
                    absmax = getattr(state[k], n + "_absmax").repeat_interleave(256)[: got.numel()].view(got.shape)
                    assert ((got - want).abs() <= gap * absmax).all(), (k, n)
        assert resynced == {"4.weight"}, resynced  # only the param whose block is split between shards

        mesh = DeviceMesh.from_group(one, DEVICE.type)
        model = _model().to(DEVICE)
        fully_shard(model, mesh=mesh)
        single = dict(model.named_parameters())
        single_state = bd.init_state(single, spec, {"lr": LR})
        sd = bd.state_dict(single_state)
        dcp.load({"optim": sd, "params": single}, checkpoint_id=path, process_group=one)
        bd.load_state_dict_(single_state, sd)
        for k, d in bd.dequantize_state(single_state).items():  # one shard: the unsharded blocks
            for n, got in d.items():
                assert torch.equal(got.full_tensor().cpu(), bnbf.dequantize_state(state[k])[n]), (k, n)

        for t, gs in enumerate(kept_full, start=STEPS + 1):
            bnbf.update_(params, {k: g.cpu() for k, g in gs.items()}, state, {"lr": LR}, t)
            grads = {k: DTensor.from_local(g, mesh, single[k].placements) for k, g in gs.items()}
            bd.update_(single, grads, single_state, {"lr": LR}, t)
        tol = STATE8[(torch.float32, 8)]
        for k in params:
            assert torch.equal(single[k].full_tensor().cpu(), params[k]), k
            diff = (params[k] - final[k].cpu()).abs()
            assert diff.mean() < tol.mean_abs, (k, diff.mean())
    torch.distributed.barrier()


def _entries(sd: dict, convert) -> dict:
    """``sd`` (from bnbf.distributed.state_dict) with ``convert`` applied to each tensor, the layouts kept."""
    from bnbf.distributed import LAYOUT_KEY

    return {k: {n: v if n == LAYOUT_KEY else convert(v) for n, v in e.items()} for k, e in sd.items()}


def _other_splits() -> dict:
    """Ways to hand load_state_dict_ the tensors of a state_dict: plain (gathered); Replicate on their mesh; Shard(0)
    on another mesh (2-D, HSDP's layout); Shard(1) on their mesh (1-D tensors: Shard(0) on the 2-D mesh). Not a mesh
    of the ranks in reverse order: torch's own Shard(0) of uneven rows there is wrong (full_tensor of 5 rows gave 0,
    1, 0, 3, 4 from arange(5))."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    two_d = init_device_mesh(DEVICE.type, (1, WORLD), mesh_dim_names=("replicate", "shard"))

    def on_2d(v):
        return distribute_tensor(v.full_tensor(), two_d, [Replicate(), Shard(0)])

    return {
        "plain": lambda v: v.full_tensor(),
        "replicate": lambda v: v.redistribute(v.device_mesh, [Replicate()]),
        "other mesh": on_2d,
        "columns": lambda v: v.redistribute(v.device_mesh, [Shard(1)]) if v.ndim > 1 else on_2d(v),
    }


def scenario_load_entries_of_other_splits():
    """load_state_dict_ of entries that are DTensors of the global shape split otherwise than the live state
    (Replicate, a gathered tree; Shard(0) on another mesh; Shard(1)) loads this shard's rows of the whole tensor:
    the states and the steps after equal those of a load of plain tensors. It took the local tensor as this shard's
    rows: a view error after earlier states were written, or other elements (Shard(1) of 8 x 128: 8 x 64)."""
    import bnbf
    import bnbf.distributed as bd

    splits = _other_splits()
    for bits in (8, 32):
        spec = bnbf.OptimSpec(rule="adamw", state_bits=bits, min_8bit_size=MIN8)
        run = _Run(spec, {"lr": LR})
        for _ in range(STEPS):
            run.advance(reference=False)
        sd = bd.state_dict(run.state)
        params, states = {}, {}
        for kind, convert in splits.items():
            params[kind] = {k: p.detach().clone() for k, p in run.params.items()}
            states[kind] = bd.init_state(params[kind], spec, {"lr": LR})
            bd.load_state_dict_(states[kind], _entries(sd, convert))
        for t in range(STEPS + 1, STEPS + 3):
            grads = run.grads()
            run.step += 1
            for kind in splits:
                bd.update_(params[kind], grads, states[kind], {"lr": LR}, t)
        for kind in splits.keys() - {"plain"}:
            for k in run.params:
                want = [f.to_local() for f in states["plain"][k]]
                assert all(torch.equal(f.to_local(), w) for f, w in zip(states[kind][k], want)), (bits, kind, k)
                assert torch.equal(params[kind][k].to_local(), params["plain"][k].to_local()), (bits, kind, k)


def scenario_load_refused_before_writing():
    """load_state_dict_ whose later entry is a DTensor that is not what its metadata says (a local tensor of
    another shape than its global shape and placements give) refuses it before any state is written, the earlier
    entries (plain, Replicate, Shard(1), Shard(0) on another mesh) fine. It wrote those, then raised a view error."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    import bnbf
    import bnbf.distributed as bd

    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=MIN8)
    run = _Run(spec, {"lr": LR})
    for _ in range(STEPS):
        run.advance(reference=False)
    sd = bd.state_dict(run.state)
    splits = _other_splits()
    saved = {k: dict(e) for k, e in sd.items()}
    for k, kind in (("0.weight", "plain"), ("0.bias", "replicate"), ("2.weight", "columns"), ("2.bias", "other mesh")):
        saved[k] = _entries({k: sd[k]}, splits[kind])[k]
    reference = bd.init_state(run.params, spec, {"lr": LR})
    bd.load_state_dict_(reference, _entries(sd, splits["plain"]))
    # 4.weight (150 x 8, 75 rows a rank): its codes as a Shard(0) DTensor holding all 150 rows, or its scales as a
    # Replicate DTensor holding 3 of its 5
    lying = {
        "exp_avg": lambda v: DTensor.from_local(
            v.full_tensor(), v.device_mesh, [Shard(0)], run_check=False, shape=v.shape, stride=v.stride()
        ),
        "exp_avg_sq_absmax": lambda v: DTensor.from_local(
            v.full_tensor()[:3], v.device_mesh, [Replicate()], run_check=False, shape=v.shape, stride=v.stride()
        ),
    }
    for field, lie in lying.items():
        bad = {**saved, "4.weight": {**saved["4.weight"], field: lie(sd["4.weight"][field])}}
        state = bd.init_state(run.params, spec, {"lr": LR})  # zeros: any write shows
        kept = {k: [t.to_local().clone() for t in s] for k, s in state.items()}
        with pytest.raises(ValueError, match=rf"saved\['4.weight'\]\.{field} is a DTensor .* whose local tensor"):
            bd.load_state_dict_(state, bad)
        for k, s in state.items():
            assert all(torch.equal(t.to_local(), c) for t, c in zip(s, kept[k])), (field, k)
        bd.load_state_dict_(state, saved)  # without the lie, the same entries load
        for k, s in state.items():
            assert all(torch.equal(t.to_local(), w.to_local()) for t, w in zip(s, reference[k])), (field, k)


def scenario_ddp_unchanged():
    """DDP: plain params and all-reduced grads go straight to the core; every rank equals the unsharded run
    on the averaged grads bit for bit."""
    import bnbf
    import bnbf.distributed as bd

    rank = torch.distributed.get_rank()
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=MIN8)
    model = torch.nn.parallel.DistributedDataParallel(_model().to(DEVICE))
    params = {k: p for k, p in model.module.named_parameters()}
    ref = {k: p.detach().clone() for k, p in params.items()}
    state, ref_state = bd.init_state(params, spec), bnbf.init_state(ref, spec)
    for t in range(1, STEPS + 1):
        model.zero_grad(set_to_none=True)
        x, y = (v.to(DEVICE) for v in _batch(rank, t))
        torch.nn.functional.mse_loss(model(x), y).backward()
        grads = {k: p.grad for k, p in params.items()}
        with torch.no_grad():
            bd.update_(params, grads, state, {"lr": LR}, t)
        bnbf.update_(ref, {k: g.clone() for k, g in grads.items()}, ref_state, {"lr": LR}, t)
    for k, p in params.items():
        assert torch.equal(p.detach(), ref[k]), k
        others = [torch.empty_like(ref[k]) for _ in range(WORLD)]
        torch.distributed.all_gather(others, p.detach())
        assert all(torch.equal(o, ref[k]) for o in others), k  # every rank holds the same params


def scenario_scales_changed_in_place():
    """A step hands the core a view of an 8-bit state's local scales (the shard's row of its ``[1, padded]`` local
    tensor), kept between steps: update_'s cache of local states, a plan's core plan. A ``set_``, ``resize_`` or
    ``as_strided_`` of that local tensor left the view on its old memory or layout (set_: the new memory never
    stepped; resize_: the step wrote past the shrunk tensor's size). Now the step takes the view again: new memory
    steps as a state no cache has seen steps, and scales that no longer fit raise what such a state raises, with
    nothing written."""
    import re

    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.utils._pytree import tree_leaves, tree_map

    import bnbf
    import bnbf.distributed as bd

    gen = torch.Generator().manual_seed(0)
    full, g_full = (torch.randn(150, 8, generator=gen).to(DEVICE) for _ in range(2))  # rank 1 starts in block 2
    m = mesh()
    hp = {"lr": LR}

    def unseen(tree, clone: bool):  # new DTensors over the same local tensors, or over copies of them
        def wrap(t):
            local = t._local_tensor.clone() if clone else t._local_tensor
            return DTensor.from_local(local, m, t.placements, run_check=False, shape=t.shape, stride=t.stride())

        return tree_map(wrap, tree)

    def local(tree) -> list:
        return [t._local_tensor.clone() for t in tree_leaves(tree)]

    def case(path: str, how: str) -> None:
        params = {"w": distribute_tensor(full, m, [Shard(0)])}
        grads = {"w": distribute_tensor(g_full, m, [Shard(0)])}
        state = bd.init_state(params, bnbf.OptimSpec(rule="adamw", min_8bit_size=0))
        held = bd.plan(params, state) if path == "plan" else None

        def step(t):
            return held.step(grads, hp, t) if held else bd.update_(params, grads, state, hp, t)

        step(1)
        scales = state["w"].exp_avg_absmax._local_tensor
        if how == "set_":
            scales.set_(scales.clone())
            twin = unseen((params, state), clone=True)
            bd.update_(twin[0], grads, twin[1], hp, 2)
            step(2)
            assert all(map(torch.equal, local((params, state)), local(twin))), "not stepped as a new state"
            return
        if how == "resize_":
            scales.resize_(1, 1)
        else:  # its shape kept, not contiguous
            scales.as_strided_(scales.shape, (scales.shape[1], 0))
        with pytest.raises(ValueError) as fresh:
            bd.update_(params, grads, {"w": unseen(state["w"], clone=False)}, hp, 2)
        before = local((params, state))
        with pytest.raises(ValueError, match=re.escape(str(fresh.value))):
            step(2)
        assert all(map(torch.equal, local((params, state)), before)), "written before raising"

    failed = []  # every case's outcome, not the first failure's only
    for path in ("update_", "plan"):
        for how in ("set_", "resize_", "as_strided_"):
            try:
                case(path, how)
            except (AssertionError, pytest.fail.Exception) as e:
                failed.append(f"{path} after {how}: {e}")
    assert not failed, "\n".join(failed)


def scenario_replaced_field_freed():
    """update_'s cache of local states held every field's local tensor in an entry that went only with the state's
    first field: a field replaced (``_replace``) and dropped stayed alive until that state's next step. Now the entry
    goes with any field, and the next step steps the new field as a state no cache has seen."""
    import gc
    import weakref

    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.utils._pytree import tree_leaves

    import bnbf
    import bnbf.distributed as bd

    gen = torch.Generator().manual_seed(0)
    full, g_full = (torch.randn(150, 8, generator=gen).to(DEVICE) for _ in range(2))
    m = mesh()
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=0)

    def tree():
        params = {"w": distribute_tensor(full, m, [Shard(0)])}
        return params, bd.init_state(params, spec)

    grads = {"w": distribute_tensor(g_full, m, [Shard(0)])}
    (params, state), (params2, state2) = tree(), tree()
    bd.update_(params, grads, state, {"lr": LR}, 1)
    bd.update_(params2, grads, state2, {"lr": LR}, 1)
    old = state["w"].exp_avg_sq
    local = weakref.ref(old._local_tensor)
    fresh = DTensor.from_local(
        old._local_tensor.clone(), m, old.placements, run_check=False, shape=old.shape, stride=old.stride()
    )
    state["w"] = state["w"]._replace(exp_avg_sq=fresh)
    del old
    gc.collect()
    assert local() is None, "the replaced field's local tensor is kept alive"
    bd.update_(params, grads, state, {"lr": LR}, 2)
    bd.update_(params2, grads, state2, {"lr": LR}, 2)
    mine, twin = (tree_leaves(t) for t in ((params, state), (params2, state2)))
    assert all(torch.equal(a._local_tensor, b._local_tensor) for a, b in zip(mine, twin))


SCENARIOS = {name[9:]: fn for name, fn in globals().items() if name.startswith("scenario_")}


PHASE = "phase: "  # a line of a rank's crash file: how far the rank got (the last one is where it stopped)
# 1: a rank leaves through interpreter finalization (not os._exit), to re-check the gloo abort in _worker's end
NATURAL_EXIT = os.environ.get("BNBF_TEST_SPAWN_NATURAL_EXIT", "0") not in ("", "0")


def _worker(rank: int, out: str, device: str, module: str = __name__) -> None:
    import faulthandler
    import importlib

    import conftest  # the parent's pytest session set these up; a spawned process starts bare

    global DEVICE
    # the crash file: a line per phase as the rank reaches it (flushed), scenario failures, and faulthandler's
    # stacks if the rank crashes (a SIGSEGV, a SIGABRT); _spawn reports it when a rank dies
    crash_log = open(os.path.join(out, f"crash{rank}.txt"), "w")  # noqa: SIM115 - open while the process runs
    faulthandler.enable(crash_log, all_threads=True)

    def phase(text: str) -> None:
        crash_log.write(f"{PHASE}{text}\n")
        crash_log.flush()

    phase("init")
    torch.set_num_threads(1)
    if device == "cuda":
        DEVICE = torch.device("cuda", rank)
        torch.cuda.set_device(DEVICE)
    if conftest.triton_mode() and os.environ.get("BNBF_TEST_PLAIN_INTERPRETER", "0") in ("", "0"):
        conftest._patch_lang_once_per_launch()
    backend = "nccl" if device == "cuda" else "gloo"
    torch.distributed.init_process_group(  # a file store in the run's folder: no port to race for
        backend,
        init_method=f"file://{os.path.join(out, 'store')}",
        rank=rank,
        world_size=WORLD,
        device_id=DEVICE if device == "cuda" else None,
        # a rank that fails mid-scenario leaves its peer in a collective: an error after this, not a 30-minute hang
        timeout=datetime.timedelta(seconds=180),
    )
    results = {}
    for name, fn in importlib.import_module(module).SCENARIOS.items():
        phase(f"scenario {name}")
        try:
            fn()
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
            # now, not at the end: a rank that fails mid-scenario leaves its peers in a collective it never
            # joins, which gloo can answer with a crash before rank*.json is written
            crash_log.write(f"scenario {name} failed:\n{results[name]}\n")
            crash_log.flush()
        phase(f"barrier after {name}")
        torch.distributed.barrier()  # gloo's barrier also waits for every collective queued before it
    # the results before any teardown: a rank that dies in teardown has still reported every scenario
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    phase("results written; destroy_process_group")
    torch.distributed.destroy_process_group()
    if NATURAL_EXIT:
        import atexit

        phase(f"exit: interpreter finalization; native threads left: {_native_threads()}")
        atexit.register(phase, "exit: atexit handlers ran")  # the last Python code before the interpreter's teardown
        return
    # Leave without the interpreter's teardown: every result is written and the process group destroyed. CI's
    # one abort (SIGABRT, "terminate called without an active exception") was in that teardown: faulthandler
    # found it on a thread other than the main one, whose stack held no Python frame any more. The gloo groups
    # outlive destroy_process_group (their threads still run at exit: the phase line of a
    # BNBF_TEST_SPAWN_NATURAL_EXIT=1 run), a gloo worker that frees a finished collective's tensors waits for the
    # GIL, and CPython ends threads that wait for the GIL while it finalizes (an unwind that noexcept stops).
    phase(f"exit: os._exit(0); native threads left: {_native_threads()}")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _native_threads() -> str:
    """This process's threads other than the main one, by name (Linux): gloo's that outlive destroy_process_group."""
    import collections

    try:
        tasks = [t for t in os.listdir("/proc/self/task") if t != str(os.getpid())]
        names = collections.Counter(_read(f"/proc/self/task/{t}/comm").strip() for t in tasks)
    except OSError:
        return "unknown"
    return ", ".join(f"{n} x{c}" for n, c in sorted(names.items())) or "none"


def _last_phase(text: str) -> str:
    lines = [line[len(PHASE) :] for line in text.splitlines() if line.startswith(PHASE)]
    return lines[-1] if lines else "none (the process died before its first phase)"


def _exit_status(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _crash_report(error: Exception, processes: list, out: str) -> str:
    """Each rank's exit status, the phase it reached, whether it wrote its results, and its crash file (phase lines
    left out): where a spawned rank died. mp.spawn stops the other ranks with SIGTERM once one fails."""
    parts = [str(error)]
    for r, proc in enumerate(processes):
        path = os.path.join(out, f"crash{r}.txt")
        text = _read(path) if os.path.exists(path) else ""
        wrote = os.path.exists(os.path.join(out, f"rank{r}.json"))
        rest = "\n".join(line for line in text.splitlines() if not line.startswith(PHASE)).strip()
        parts.append(
            f"rank {r}: {_exit_status(proc.exitcode)}; last phase: {_last_phase(text)}; "
            f"results {'written' if wrote else 'not written'}" + (f"\n{rest[-6000:]}" if rest else "")
        )
    return "\n".join(parts)


def _spawn(device: str, module: str = __name__) -> list[dict]:
    """Run ``module``'s SCENARIOS on WORLD spawned processes (one spawn); each rank's outcome per scenario.
    A rank that dies fails the whole spawn with each rank's exit status and the phase it reached."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    with tempfile.TemporaryDirectory() as out:
        os.environ["BNBF_TEST_CKPT"] = os.path.join(out, "ckpt")
        ctx = mp.start_processes(_worker, args=(out, device, module), nprocs=WORLD, join=False, start_method="spawn")
        try:
            while not ctx.join():
                pass
        except ProcessException as e:
            raise AssertionError(_crash_report(e, ctx.processes, out)) from e
        found = []
        for r in range(WORLD):
            with open(os.path.join(out, f"rank{r}.json")) as f:
                found.append(json.load(f))
        return found


def _report(results: list[dict], name: str) -> None:
    failed = [f"rank {r}:\n{res[name]}" for r, res in enumerate(results) if res[name] != "ok"]
    assert not failed, "\n".join(failed)


@pytest.fixture(scope="module")
def results():
    return _spawn("cpu")


@pytest.fixture(scope="module")
def results_gpu():
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} CUDA devices")
    return _spawn("cuda")


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario(results, name):
    _report(results, name)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario_two_gpus(results_gpu, name):
    """The same on two GPUs with nccl: the compiled Triton kernels on the local shards."""
    _report(results_gpu, name)


@pytest.mark.parametrize(
    "other",
    [
        {"rule": "lion"},  # the same state names (exp_avg, exp_avg_absmax): DCP filled them from AdamW's
        {"rule": "adamw", "state_bits": 32},  # DCP cast the codes into the float32 template
        {"rule": "adamw", "state_format": "dynamic"},  # the codes decoded with the other map
    ],
    ids=["lion", "32bit", "dynamic"],
)
def test_checkpoint_of_another_layout_refused(tmp_path, other):
    """An 8-bit AdamW checkpoint saved through DCP, loaded (one process) into the template of a state of another
    rule, bit width or format: load_state_dict_ used to take it silently, since DCP matches tensors by name and
    casts them into the template's dtype. Now the entry's layout is saved with it and compared."""
    import torch.distributed.checkpoint as dcp

    import bnbf
    import bnbf.distributed as bd

    params = {"w": torch.randn(300, 20), "b": torch.randn(20)}
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=256)
    state = bnbf.init_state(params, spec)
    bnbf.update_(params, {k: torch.randn_like(p) for k, p in params.items()}, state, {"lr": 1e-3}, 1)
    dcp.save({"optim": bd.state_dict(state)}, checkpoint_id=str(tmp_path), no_dist=True)

    same = bnbf.init_state(params, spec)
    sd = bd.state_dict(same)
    dcp.load({"optim": sd}, checkpoint_id=str(tmp_path), no_dist=True)
    bd.load_state_dict_(same, sd)  # its own layout loads
    assert all(torch.equal(a, b) for k in params for a, b in zip(same[k], state[k]))

    wrong = bnbf.init_state(params, bnbf.OptimSpec(**{"min_8bit_size": 256, **other}))
    sd = bd.state_dict(wrong)
    dcp.load({"optim": sd}, checkpoint_id=str(tmp_path), no_dist=True)
    with pytest.raises(ValueError, match=r"saved\['w'\] is a 'adamw_state_8bit_power_b256_s3' state, state\['w'\] a '"):
        bd.load_state_dict_(wrong, sd)

"""bnbf_nn's torch.optim adapters under FSDP2 (``fully_shard``), DCP and DDP: two gloo processes, one spawn.

The scenarios use tests/test_distributed.py's model (shards with whole 256-element blocks, a shard
boundary inside a block, float32-state tensors, an empty shard) and its spawn harness; each is checked
against a single-process reference stepped on the averaged grads.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import test_distributed as td
import torch
from tolerances import STATE8, STATE32

# one spawn serves the whole module: under pytest-xdist its tests stay on one worker (--dist loadgroup)
pytestmark = pytest.mark.xdist_group("spawn_distributed_nn")

LR = td.LR
MIN8 = td.MIN8


def _fsdp_model() -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = td._model().to(td.DEVICE)
    fully_shard(model, mesh=td.mesh())
    return model


def _loaded_from(path: str, make_opt, options: Any = None) -> tuple:
    """A fresh FSDP2 model and its optimizer (``make_opt(params)``) loaded from the DCP checkpoint at ``path``
    through ``get_state_dict``/``set_state_dict`` (with ``options``, a ``StateDictOptions``); also the optimizer
    state dict that was loaded."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = _fsdp_model()
    opt = make_opt(model.parameters())
    msd, osd = get_state_dict(model, opt, options=options)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd, options=options)
    return model, opt, osd


def _assert_resumed(model: torch.nn.Module, final: dict) -> None:
    """After a checkpoint round trip and the same steps: the params equal the uninterrupted run's where
    shards hold whole blocks (and 32-bit ones), within the 8-bit tolerance where a split block's codes were
    re-expressed in the larger scale once."""
    for k, p in _full(model).items():
        if td._aligned(k) or p.numel() < MIN8:
            assert torch.equal(p, final[k]), k
        else:
            diff = (p - final[k]).abs()
            assert diff.mean() < STATE8[(torch.float32, 8)].mean_abs, (k, diff.mean())


def _backward(model: torch.nn.Module, step: int) -> None:
    """This rank's batch through ``model``: FSDP2 leaves the ranks' average grad, DDP all-reduces it."""
    rank = torch.distributed.get_rank()
    model.zero_grad(set_to_none=True)
    x, y = (t.to(td.DEVICE) for t in td._batch(rank, step))
    torch.nn.functional.mse_loss(model(x), y).backward()


def _two_more_steps(model: torch.nn.Module, opt: Any) -> list:
    """Steps STEPS + 1 and STEPS + 2 after a save; returns their grads, for a resumed run to take the same steps."""
    kept = []
    for t in range(td.STEPS + 1, td.STEPS + 3):
        _backward(model, t)
        kept.append({k: p.grad.detach().clone() for k, p in model.named_parameters()})
        opt.step()
    return kept


def _full(model: torch.nn.Module, grads: bool = False) -> dict:
    """The model's params (or grads) gathered whole, by name."""
    return {k: (p.grad if grads else p).detach().full_tensor() for k, p in model.named_parameters()}


def _deq(opt, model) -> dict:
    """Each param's dequantized state, gathered whole (zeros before the first step)."""
    import bnbf.distributed as bd

    out = {}
    for k, p in model.named_parameters():
        rec = opt.state.get(p, {})
        if "state" not in rec:
            out[k] = {n: torch.zeros(p.shape, device=td.DEVICE) for n in ("exp_avg", "exp_avg_slow", "exp_avg_sq")}
        else:
            out[k] = {n: t.full_tensor() for n, t in bd.dequantize_state(rec["state"]).items()}
    return out


def _local_bytes(opt, params) -> int:
    return sum(t.to_local().numel() * t.element_size() for p in params for t in opt.state[p]["state"])


def _train8(cls, hp: dict, paper_step, drop: str | None = None) -> None:
    """FSDP2 training with ``cls``: each step equals the paper's step (plain torch) from the sharded run's
    own dequantized state within the 8-bit re-synced tolerance; rank 0's whole blocks and every float32
    state equal the unsharded bnbf_nn run on the averaged grads bit for bit; each rank keeps half the 8-bit
    state bytes; bitsandbytes' names are the live DTensor state. ``drop``: a param without grad at step 1,
    so that step 2 steps params at two step counts (the optimizer's split path)."""
    import bnbf

    model, ref_model = _fsdp_model(), td._model().to(td.DEVICE)
    opt = cls(model.parameters(), lr=LR, min_8bit_size=MIN8, **hp)
    ref = cls(ref_model.parameters(), lr=LR, min_8bit_size=MIN8, **hp)
    tol = STATE8[(torch.float32, 8)]
    for t in range(1, td.STEPS + 1):
        _backward(model, t)
        before, grads, deq = _full(model), _full(model, grads=True), _deq(opt, model)
        steps = {k: t for k in grads}
        if t == 1 and drop:
            dict(model.named_parameters())[drop].grad = None
            grads[drop] = None
        elif drop:
            steps[drop] = t - 1
        opt.step()
        for k, p in ref_model.named_parameters():
            p.grad = grads[k]
        ref.step()
        after = _full(model)
        for k in after:
            if grads[k] is None:
                assert torch.equal(after[k], before[k]), k
                continue
            want = paper_step(before[k], grads[k], deq[k], steps[k])[0]
            diff = (after[k] - want).abs()
            assert diff.mean() < tol.mean_abs, (k, diff.mean())
            assert (diff / (want.abs() + 1e-9)).mean() < tol.mean_rel, k
    rank = torch.distributed.get_rank()
    refs = dict(ref_model.named_parameters())
    for k, p in model.named_parameters():
        local, mine = p.detach().to_local().reshape(-1), td._local_slice(k, p, refs[k].detach()).reshape(-1)
        if p.numel() < MIN8:  # float32 state: elementwise, bit for bit on every rank
            assert torch.equal(local, mine), k
        elif rank == 0:  # whole blocks from element 0: the unsharded blocks and their dither
            whole = local.numel() // 256 * 256
            assert torch.equal(local[:whole], mine[:whole]), k
        rec = opt.state[p]
        assert rec["step"] == td.STEPS - (k == drop) and type(rec["state1"]).__name__ == "DTensor", k
        assert rec["state1"].to_local().data_ptr() == rec["state"][0].to_local().data_ptr(), k
    big = [p for p in model.parameters() if p.numel() >= MIN8]
    mine8 = _local_bytes(opt, big)
    whole8 = sum(bnbf.state_nbytes(ref.state[p]["state"]) for p in ref_model.parameters() if p.numel() >= MIN8)
    assert 0.49 * whole8 < mine8 < 0.51 * whole8, (mine8, whole8)


def scenario_nn_adamw8bit():
    import bnbf_nn

    # the param whose shard boundary splits a block misses step 1's grad: its step 2 is its first (debiased
    # as such) while the others' is their second
    _train8(bnbf_nn.AdamW8bit, {"weight_decay": 0.01}, td._adamw_step, drop="4.weight")


def scenario_nn_lion8bit():
    import bnbf_nn

    _train8(bnbf_nn.Lion8bit, {"weight_decay": 0.01, "betas": (0.9, 0.99)}, td._lion_step)


def _ademamix_step(p, g, s, t, lr=LR, wd=0.01, b1=0.9, b2=0.999, b3=0.9999, alpha=5.0, eps=1e-8):
    """AdEMAMix's step as the paper writes it (no schedulers), from the dequantized state ``s``."""
    m1 = b1 * s["exp_avg"] + (1 - b1) * g
    m2 = b3 * s["exp_avg_slow"] + (1 - b3) * g
    nu = b2 * s["exp_avg_sq"] + (1 - b2) * g * g
    p = p - lr * ((m1 / (1 - b1**t) + alpha * m2) / ((nu / (1 - b2**t)).sqrt() + eps) + wd * p)
    return p, (m1, m2, nu)


def scenario_nn_ademamix8bit():
    """AdEMAMix8bit under FSDP2, its two first moments stacked in state1 as bitsandbytes stacks them: the
    paper's step within the 8-bit tolerance, shards of whole blocks bit-equal on every rank to the unsharded
    bnbf_nn run, ``state1``/``absmax1`` live DTensor stacks of the local state; its state_dict saved through
    DCP on 2 ranks loads on 1 process (unsharded AdEMAMix8bit: the same state) and on 2 ranks (training goes
    on exactly as it went on, where shards hold whole blocks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import bnbf
    import bnbf_nn

    hp = {"weight_decay": 0.01}
    _train8(bnbf_nn.AdEMAMix8bit, hp, _ademamix_step)
    model, ref_model = _fsdp_model(), td._model().to(td.DEVICE)
    opt = bnbf_nn.AdEMAMix8bit(model.parameters(), lr=LR, min_8bit_size=MIN8, **hp)
    ref = bnbf_nn.AdEMAMix8bit(ref_model.parameters(), lr=LR, min_8bit_size=MIN8, **hp)
    for t in range(1, td.STEPS + 1):
        _backward(model, t)
        for k, r in ref_model.named_parameters():
            r.grad = dict(model.named_parameters())[k].grad.full_tensor()
        opt.step()
        ref.step()
    refs = dict(ref_model.named_parameters())
    for k, p in model.named_parameters():
        if td._aligned(k):  # whole blocks on every rank: params and codes bit for bit
            assert torch.equal(p.detach().to_local(), td._local_slice(k, p, refs[k].detach())), k
            mine = opt.state[p]["state"]
            whole = ref.state[refs[k]]["state"]
            assert torch.equal(mine.exp_avg_slow.to_local(), td._local_slice(k, p, whole.exp_avg_slow)), k
        rec = opt.state[p]
        if p.numel() < MIN8:
            continue
        st, a1 = rec["state1"], rec["absmax1"]
        assert st.shape == (2, *p.shape) and a1.shape[0] == 2, (k, st.shape, a1.shape)
        assert st.to_local()[1].is_set_to(rec["state"].exp_avg_slow.to_local()), k
        assert a1.to_local()[1].data_ptr() == rec["state"].exp_avg_slow_absmax.to_local().data_ptr(), k
    path = os.environ["BNBF_TEST_CKPT"] + "_ademamix"
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    saved_deq = _deq(opt, model)
    _backward(model, td.STEPS + 1)
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    opt.step()
    final = _full(model)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:  # one process, unsharded: the saved state
        plain = td._model().to(td.DEVICE)
        popt = bnbf_nn.AdEMAMix8bit(plain.parameters(), lr=LR, min_8bit_size=MIN8, **hp)
        msd1, osd1 = get_state_dict(plain, popt)
        dcp.load({"model": msd1, "optim": osd1}, checkpoint_id=path, no_dist=True)
        set_state_dict(plain, popt, model_state_dict=msd1, optim_state_dict=osd1)
        for k, p in plain.named_parameters():
            rec = popt.state[p]
            assert rec["step"] == td.STEPS and rec["state1"].shape == (2, *p.shape), k
            for n, v in bnbf.dequantize_state(rec["state"]).items():
                if td._aligned(k) or p.numel() < MIN8:
                    assert torch.equal(v, saved_deq[k][n]), (k, n)
                else:
                    absmax = getattr(rec["state"], n + "_absmax")
                    assert _code_step_close(v, saved_deq[k][n], absmax, n != "exp_avg_sq"), (k, n)
        msd1, osd1 = get_state_dict(plain, popt)  # unsharded, loaded on 2 ranks below
        dcp.save({"model": msd1, "optim": osd1}, checkpoint_id=path + "_one", no_dist=True)
    torch.distributed.barrier()
    # the unsharded checkpoint on 2 ranks: the saved state again
    model, opt, _ = _loaded_from(path + "_one", lambda ps: bnbf_nn.AdEMAMix8bit(ps, lr=LR, min_8bit_size=MIN8, **hp))
    deq = _deq(opt, model)
    for k, p in model.named_parameters():
        assert opt.state[p]["step"] == td.STEPS, k
        if td._aligned(k) or p.numel() < MIN8:  # split blocks: (1) checks one code step, as nn_dcp (3) does
            assert all(torch.equal(v, saved_deq[k][n]) for n, v in deq[k].items()), k
    model, opt, _ = _loaded_from(
        path, lambda ps: bnbf_nn.AdEMAMix8bit(ps, lr=LR, min_8bit_size=MIN8, **hp)
    )  # two ranks again: the step after the save goes as it went
    for k, p in model.named_parameters():
        p.grad = grads[k]
    opt.step()
    _assert_resumed(model, final)


def scenario_nn_adamw32bit_torch():
    """32-bit state: FSDP2 training with AdamW32bit equals torch.optim.AdamW on the unsharded model fed the
    averaged grads (compared as changes from the initial params)."""
    import bnbf_nn

    _matches_unsharded(
        lambda ps: bnbf_nn.AdamW32bit(ps, lr=LR, weight_decay=0.01),
        lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.01),
        td.STEPS,
    )


def _matches_unsharded(make: Any, make_ref: Any, steps: int) -> None:
    """``steps`` steps of ``make``'s optimizer on an FSDP2 model equal ``make_ref``'s on the unsharded model fed
    the averaged grads, with 32-bit state (compared as changes from the initial params)."""
    model, ref_model = _fsdp_model(), td._model().to(td.DEVICE)
    init = _full(model)
    opt, ref = make(model.parameters()), make_ref(ref_model.parameters())
    for t in range(1, steps + 1):
        _backward(model, t)
        grads = _full(model, grads=True)
        for k, p in ref_model.named_parameters():
            p.grad = grads[k]
        opt.step()
        ref.step()
    tol = STATE32[(torch.float32, 32)]
    for k, p in _full(model).items():
        want = dict(ref_model.named_parameters())[k].detach()
        torch.testing.assert_close(p - init[k], want - init[k], atol=tol.atol, rtol=tol.rtol)


def scenario_nn_lamb():
    """LAMB reads whole-tensor norms: under FSDP2 the sharded step (the core's NORM_REDUCE hook all-reducing the
    norm sums) equals the unsharded run, with 32-bit state."""
    import bnbf_nn

    make = lambda ps: bnbf_nn.LAMB32bit(ps, lr=LR)  # noqa: E731
    _matches_unsharded(make, make, 1)


def scenario_nn_refused():
    """What has no sharded implementation (paged state, capturable and differentiable steps) raises at step, before
    anything is written."""
    import bnbf_nn

    model = _fsdp_model()
    _backward(model, 1)
    before = {k: p.detach().to_local().clone() for k, p in model.named_parameters()}
    for cls, match in ((bnbf_nn.PagedAdamW8bit, "paged state"), (bnbf_nn.PagedAdEMAMix8bit, "paged state")):
        opt = cls(model.parameters(), lr=LR, min_8bit_size=MIN8)
        with pytest.raises(NotImplementedError, match=match):
            opt.step()
        assert not opt.state, cls.__name__
    # capturable and differentiable steps: refused before any state is made (a float64 AdEMAMix param's state,
    # made first, raised torch's "mixed torch.Tensor and DTensor" instead)
    from torch.distributed.tensor import Shard, distribute_tensor

    wide = torch.nn.Parameter(
        distribute_tensor(torch.randn(8, 4, dtype=torch.float64, device=td.DEVICE), td.mesh(), [Shard(0)])
    )
    wide.grad = distribute_tensor(torch.randn(8, 4, dtype=torch.float64, device=td.DEVICE), td.mesh(), [Shard(0)])
    cases = [(bnbf_nn.AdamW8bit, list(model.parameters()), {"capturable": True})]
    cases += [(bnbf_nn.AdEMAMix32bit, ps, {"differentiable": True}) for ps in (list(model.parameters()), [wide])]
    for cls, ps, kw in cases:
        opt = cls(ps, lr=LR, min_8bit_size=MIN8, **kw)
        with pytest.raises(NotImplementedError, match="capturable=True or differentiable=True on DTensor"):
            opt.step()
        assert not opt.state, (cls.__name__, kw)
    # a later group's grad or param the sharded step refuses: raised before the first group steps or gets state
    params = list(model.parameters())
    row = torch.nn.Parameter(distribute_tensor(torch.randn(4, 300, device=td.DEVICE), td.mesh(), [Shard(0)]))
    cols = torch.nn.Parameter(distribute_tensor(torch.randn(4, 300, device=td.DEVICE), td.mesh(), [Shard(1)]))
    for extra, grad, err, match in (
        (row, torch.randn(4, 300, device=td.DEVICE), TypeError, r"param group 1: grad\[0\]: .*mixed torch.Tensor"),
        (cols, distribute_tensor(torch.randn(4, 300, device=td.DEVICE), td.mesh(), [Shard(1)]), NotImplementedError,
         r"param group 1: param\[0\] has placements"),
    ):  # fmt: skip
        extra.grad = grad
        opt = bnbf_nn.AdamW8bit([{"params": params}, {"params": [extra]}], lr=LR, min_8bit_size=MIN8)
        with pytest.raises(err, match=match):
            opt.step()
        assert not opt.state
    assert all(torch.equal(p.detach().to_local(), before[k]) for k, p in model.named_parameters())


def scenario_nn_later_bucket_grad_refused():
    """A first group split into two core calls (a weight_decay override on 0.weight) whose later bucket holds a plain
    grad for a DTensor param: the step raises before anything is written. 0.weight, its state and step count were
    updated first, then torch's "mixed torch.Tensor and DTensor" was raised (naming no param group)."""
    import bnbf_nn

    mng = bnbf_nn.GlobalOptimManager.get_instance()
    try:
        model = _fsdp_model()
        mng.override_config(model[0].weight, "weight_decay", 0.5)
        opt = bnbf_nn.AdamW8bit(model.parameters(), lr=LR, min_8bit_size=MIN8)
        _backward(model, 1)
        opt.step()
        _backward(model, 2)
        model[4].weight.grad = torch.zeros(model[4].weight.shape, device=td.DEVICE)  # a DTensor param's grad
        params = {k: p.detach().to_local().clone() for k, p in model.named_parameters()}
        states = {k: [t.to_local().clone() for t in opt.state[p]["state"]] for k, p in model.named_parameters()}
        steps = {k: opt.state[p]["step"] for k, p in model.named_parameters()}
        try:  # not pytest.raises: its failure is a BaseException, which would end the rank, not this scenario
            opt.step()
        except TypeError as e:
            said = str(e)
        else:
            raise AssertionError("a plain grad for a DTensor param stepped")
        for k, p in model.named_parameters():
            assert torch.equal(p.detach().to_local(), params[k]), k
            assert all(torch.equal(t.to_local(), c) for t, c in zip(opt.state[p]["state"], states[k])), k
            assert opt.state[p]["step"] == steps[k] == 1, k
        assert "param group 0: grad[4]: got mixed torch.Tensor and DTensor" in said, said
    finally:
        mng.initialize()


def _code_step_close(got: torch.Tensor, want: torch.Tensor, absmax: torch.Tensor, signed: bool) -> bool:
    """Whether dequantized states differ by at most one code step of their block's scale."""
    from bnbf.quant import state_map

    gap = state_map("power", signed).diff().max().to(got.device)
    scale = absmax.repeat_interleave(256)[: got.numel()].view(got.shape)
    return bool(((got - want).abs() <= gap * scale).all())


def scenario_nn_state_on_some_ranks_only():
    """A sharded param given a grad on one rank only has state there alone: ``state_dict()`` gathered each sharded
    state's scales on every rank, so the collectives did not line up (gloo aborted a process; nccl would hang).
    Now every rank raises the same error, naming the param, before any gather."""
    import bnbf_nn

    model = _fsdp_model()
    opt = bnbf_nn.AdamW8bit(model.parameters(), lr=LR, min_8bit_size=MIN8)
    names = [k for k, _ in model.named_parameters()]
    big = next(k for k, p in model.named_parameters() if p.numel() >= MIN8)
    _backward(model, 1)
    if torch.distributed.get_rank() == 1:
        dict(model.named_parameters())[big].grad = None
    opt.step()
    with pytest.raises(ValueError, match=rf"param {names.index(big)} \(a DTensor\) has optimizer state on some ranks"):
        opt.state_dict()


def scenario_nn_state_dict_on_sub_meshes():
    """torchtitan's pipeline stages under HSDP: a world mesh (pp=2, dp_replicate=1, dp_shard=1), each rank a stage
    whose part is sharded on its own 2-D sub-mesh. ``state_dict()``'s check that every rank of a mesh has a sharded
    param's state all-reduced over the default group for a mesh of several dims, pairing one stage's params with
    the other's: stage 1's last param, with no grad yet (so no state, on the one rank of its mesh), was refused on
    both ranks, and stages of different param counts aborted gloo's process. Now over each mesh dim's group; on
    HSDP meshes of the whole world, (1, 2) and (2, 1), a param with state on one rank only is still refused on
    both."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import bnbf_nn

    rank = torch.distributed.get_rank()
    names = ("dp_replicate", "dp_shard")
    stage_mesh = init_device_mesh(td.DEVICE.type, (td.WORLD, 1, 1), mesh_dim_names=("pp", *names))[names]
    for counts in ((3, 3), (3, 2)):
        torch.manual_seed(rank)
        part = [
            fully_shard(torch.nn.Linear(32, 32, bias=False).to(td.DEVICE), mesh=stage_mesh) for _ in range(counts[rank])
        ]
        opt = bnbf_nn.AdamW8bit([layer.weight for layer in part], lr=LR, min_8bit_size=MIN8)
        x = torch.randn(4, 32, device=td.DEVICE)  # 32 x 32 weights: 8-bit state (MIN8), scales gathered
        for layer in part[: counts[rank] - (rank == 1 and counts == (3, 3))]:  # stage 1's last: no grad yet
            x = layer(x)
        x.sum().backward()
        opt.step()
        assert len(opt.state_dict()["state"]) == counts[rank] - (rank == 1 and counts == (3, 3)), counts
    for shape in ((1, td.WORLD), (td.WORLD, 1)):
        model = td._model().to(td.DEVICE)
        fully_shard(model, mesh=init_device_mesh(td.DEVICE.type, shape, mesh_dim_names=names))
        opt = bnbf_nn.AdamW8bit(model.parameters(), lr=LR, min_8bit_size=MIN8)
        _backward(model, 1)
        if rank == 1:
            model[0].weight.grad = None
        opt.step()
        with pytest.raises(ValueError, match=r"param 0 \(a DTensor\) has optimizer state on some ranks"):
            opt.state_dict()


def scenario_nn_dcp():
    """DCP with bnbf_nn.AdamW8bit. (1) Saved on 2 ranks through get_state_dict; loaded on one process into
    an unsharded model and a plain AdamW8bit through set_state_dict: the state equals the sharded one where
    shards hold whole blocks, within one code step in the split block, and training continues within the
    8-bit tolerance of the sharded run. (2) Plain dcp.save/dcp.load of optimizer.state_dict() on 2 ranks:
    training resumes exactly as it went on where shards hold whole blocks. (3) The unsharded checkpoint
    saved by (1) loads back on 2 ranks under FSDP2 and training continues."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import bnbf
    import bnbf_nn

    rank = torch.distributed.get_rank()
    path = os.environ["BNBF_TEST_CKPT"] + "_nn"
    model = _fsdp_model()
    opt = bnbf_nn.AdamW8bit(model.parameters(), lr=LR, min_8bit_size=MIN8)
    for t in range(1, td.STEPS + 1):
        _backward(model, t)
        opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path + "_gsd")
    saved_deq = _deq(opt, model)
    # plain DCP of optimizer.state_dict(), with the params, then two more steps whose grads are kept
    saved_params = {k: p.detach().to_local().clone() for k, p in model.named_parameters()}
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=path + "_plain")
    kept = _two_more_steps(model, opt)
    final = _full(model)

    # (2) back to the saved step on the same mesh: a fresh optimizer, its state_dict as the template
    again = bnbf_nn.AdamW8bit(model.parameters(), lr=LR, min_8bit_size=MIN8)
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.to_local().copy_(saved_params[k])
            p.grad = torch.zeros_like(p)
    again.param_groups[0]["lr"] = 0.0
    again.step()  # state to load into (what get_state_dict's helper does; lr 0 changes nothing)
    again.param_groups[0]["lr"] = LR
    sd = again.state_dict()
    dcp.load({"optim": sd}, checkpoint_id=path + "_plain")
    again.load_state_dict(sd)
    assert all(r["step"] == td.STEPS for r in again.state.values())
    for grads in kept:
        for k, p in model.named_parameters():
            p.grad = grads[k]
        again.step()
    _assert_resumed(model, final)
    kept_full = [{k: g.full_tensor() for k, g in gs.items()} for gs in kept]
    torch.distributed.barrier()

    # (1) one process, unsharded
    if rank == 0:
        plain = td._model().to(td.DEVICE)
        popt = bnbf_nn.AdamW8bit(plain.parameters(), lr=LR, min_8bit_size=MIN8)
        msd1, osd1 = get_state_dict(plain, popt)
        dcp.load({"model": msd1, "optim": osd1}, checkpoint_id=path + "_gsd", no_dist=True)
        set_state_dict(plain, popt, model_state_dict=msd1, optim_state_dict=osd1)
        named = dict(plain.named_parameters())
        for k, p in named.items():
            rec = popt.state[p]
            assert rec["step"] == td.STEPS, (k, rec["step"])
            for n, v in bnbf.dequantize_state(rec["state"]).items():
                want = saved_deq[k][n]
                if td._aligned(k) or p.numel() < MIN8:
                    assert torch.equal(v, want), (k, n)
                else:
                    assert _code_step_close(v, want, getattr(rec["state"], n + "_absmax"), n == "exp_avg"), (k, n)
        msd1, osd1 = get_state_dict(plain, popt)  # unsharded, for (3)
        dcp.save({"model": msd1, "optim": osd1}, checkpoint_id=path + "_one", no_dist=True)
        for grads in kept_full:
            for k, p in named.items():
                p.grad = grads[k].to(td.DEVICE)
            popt.step()
        tol = STATE8[(torch.float32, 8)]
        for k, p in named.items():
            diff = (p.detach() - final[k]).abs()
            assert diff.mean() < tol.mean_abs, (k, diff.mean())
        assert all(r["step"] == td.STEPS + 2 for r in popt.state.values())
    torch.distributed.barrier()

    # (3) the unsharded checkpoint of (1) loaded on 2 ranks: the scales of the unsharded blocks, and the
    # sharded run's state within one code step of them; training continues within the 8-bit tolerance
    model, opt, osd = _loaded_from(path + "_one", lambda ps: bnbf_nn.AdamW8bit(ps, lr=LR, min_8bit_size=MIN8))
    deq = _deq(opt, model)
    for k, p in model.named_parameters():
        assert opt.state[p]["step"] == td.STEPS, k
        quant = osd["state"][k]["__bnb_optimizer_quant_state__"]
        for n, v in deq[k].items():
            if td._aligned(k) or p.numel() < MIN8:
                assert torch.equal(v, saved_deq[k][n]), (k, n)
            else:
                absmax = quant["absmax1" if n == "exp_avg" else "absmax2"].full_tensor()
                assert _code_step_close(v, saved_deq[k][n], absmax, n == "exp_avg"), (k, n)
    for grads in kept:
        for k, p in model.named_parameters():
            p.grad = grads[k]
        opt.step()
    for k, p in _full(model).items():
        assert (p - final[k]).abs().mean() < STATE8[(torch.float32, 8)].mean_abs, k


def scenario_nn_dcp_flattened():
    """get_state_dict/set_state_dict with ``flatten_optimizer_state_dict=True`` (torchtitan's setting), which
    rebuild each loaded entry from the keys of ``optimizer.state[p]``: AdamW8bit's and AdEMAMix8bit's (stacked)
    sharded states resume on the same mesh, and training goes on as it went where shards hold whole blocks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    import bnbf_nn

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    for cls in (bnbf_nn.AdamW8bit, bnbf_nn.AdEMAMix8bit):
        path = os.environ["BNBF_TEST_CKPT"] + "_flat_" + cls.__name__
        model = _fsdp_model()
        opt = cls(model.parameters(), lr=LR, min_8bit_size=MIN8)
        for t in range(1, td.STEPS + 1):
            _backward(model, t)
            opt.step()
        msd, osd = get_state_dict(model, opt, options=options)
        assert "state" not in osd, cls.__name__
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        kept = _two_more_steps(model, opt)
        final = _full(model)
        model, opt, _ = _loaded_from(path, lambda ps, cls=cls: cls(ps, lr=LR, min_8bit_size=MIN8), options)
        assert all(r["step"] == td.STEPS for r in opt.state.values()), cls.__name__
        for grads in kept:
            for k, p in model.named_parameters():
                p.grad = grads[k]
            opt.step()
        _assert_resumed(model, final)


def scenario_nn_dcp_keeps_origin():
    """get_state_dict keeps only "state" and "param_groups" of a state dict: what the groups' "bnbf" entries say
    (the rule, each group's starting lr) reaches load_state_dict. An AdamW8bit checkpoint
    loaded through set_state_dict into Lion8bit (same state names) or AdamW32bit (DCP casts the codes into the
    float32 template) is refused, and a hand-set lr resumes with the group's starting lr."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import bnbf_nn

    path = os.environ["BNBF_TEST_CKPT"] + "_origin"
    model = _fsdp_model()
    opt = bnbf_nn.AdamW8bit(model.parameters(), lr=LR, min_8bit_size=MIN8)
    opt.param_groups[0]["lr"] = LR / 2  # by hand, no scheduler: the starting lr stays LR
    _backward(model, 1)
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    model.zero_grad(set_to_none=True)  # else get_state_dict does not make the other optimizers' states (templates)
    for cls, match in ((bnbf_nn.Lion8bit, "rule 'adamw'"), (bnbf_nn.AdamW32bit, "holds 8-bit state but")):
        other = cls(model.parameters(), lr=LR, min_8bit_size=MIN8)
        _, osd = get_state_dict(model, other)
        dcp.load({"optim": osd}, checkpoint_id=path)
        try:  # not pytest.raises: its failure is a BaseException, which would end the rank, not this scenario
            set_state_dict(model, other, model_state_dict={}, optim_state_dict=osd)
        except ValueError as e:
            assert match in str(e), (cls.__name__, str(e))
        else:
            raise AssertionError(f"the AdamW8bit checkpoint loaded into {cls.__name__}")
    model, resumed, _ = _loaded_from(path, lambda ps: bnbf_nn.AdamW8bit(ps, lr=LR, min_8bit_size=MIN8))
    assert resumed.param_groups[0]["lr"] == LR / 2
    assert resumed.param_groups[0]["bnbf"] == {"optimizer": "AdamW8bit", "rule": "adamw"}  # no lr0: saved only
    assert resumed.state_dict()["param_groups"][0]["bnbf"]["lr0"] == LR


def scenario_nn_ddp_unchanged():
    """DDP: plain params and all-reduced grads; AdamW8bit on every rank equals the unsharded run bit for bit."""
    import bnbf_nn

    model = torch.nn.parallel.DistributedDataParallel(td._model().to(td.DEVICE))
    ref_model = td._model().to(td.DEVICE)
    opt = bnbf_nn.AdamW8bit(model.parameters(), lr=LR, min_8bit_size=MIN8)
    ref = bnbf_nn.AdamW8bit(ref_model.parameters(), lr=LR, min_8bit_size=MIN8)
    for t in range(1, td.STEPS + 1):
        _backward(model, t)
        for p, r in zip(model.module.parameters(), ref_model.parameters()):
            r.grad = p.grad.clone()
        opt.step()
        ref.step()
    for p, r in zip(model.module.parameters(), ref_model.parameters()):
        assert torch.equal(p.detach(), r.detach())
        assert type(opt.state[p]["state1"]) is torch.Tensor


def scenario_nn_zero_resumes():
    """ZeroRedundancyOptimizer over AdamW8bit (with DDP): a checkpoint saved after some steps (consolidate_state_dict,
    state_dict, torch.save) loads into a fresh ZeRO-wrapped AdamW8bit, and training continues bit for bit as the
    uninterrupted run. ZeRO's load_state_dict writes each of its rank's saved entries straight into the local
    optimizer's state, which the next step used to drop for a fresh state at step 1. The checkpoint also loads into a
    plain AdamW8bit (a single-process fine-tune of it) and continues alike: ZeRO saves its own param groups, copies of
    the live ones, whose "bnbf" entry has no starting lr (state_dict() adds it), and the load refused it."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    import bnbf_nn

    path = os.environ["BNBF_TEST_CKPT"] + "_zero.pt"
    make = lambda ps: ZeroRedundancyOptimizer(  # noqa: E731
        ps, optimizer_class=bnbf_nn.AdamW8bit, lr=LR, min_8bit_size=MIN8
    )
    model = torch.nn.parallel.DistributedDataParallel(td._model().to(td.DEVICE))
    opt = make(model.parameters())
    for t in range(1, td.STEPS + 1):
        _backward(model, t)
        opt.step()
    opt.consolidate_state_dict(to=0)
    if torch.distributed.get_rank() == 0:
        torch.save(opt.state_dict(), path)
    torch.distributed.barrier()
    saved = [p.detach().clone() for p in model.parameters()]
    kept = []
    for t in range(td.STEPS + 1, td.STEPS + 3):
        _backward(model, t)
        kept.append([p.grad.detach().clone() for p in model.parameters()])
        opt.step()
    resumed_model = td._model().to(td.DEVICE)  # the kept grads are DDP's averaged ones
    with torch.no_grad():
        for p, v in zip(resumed_model.parameters(), saved):
            p.copy_(v)
    resumed = make(resumed_model.parameters())
    resumed.load_state_dict(torch.load(path, map_location=td.DEVICE, weights_only=False))
    for grads in kept:
        for p, g in zip(resumed_model.parameters(), grads):
            p.grad = g
        resumed.step()
    for p, q in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(p.detach(), q.detach())
    mine = [q for q in resumed_model.parameters() if q in resumed.optim.state]
    assert mine and all(resumed.optim.state[q]["step"] == td.STEPS + 2 for q in mine)
    plain_model = td._model().to(td.DEVICE)
    with torch.no_grad():
        for p, v in zip(plain_model.parameters(), saved):
            p.copy_(v)
    plain = bnbf_nn.AdamW8bit(plain_model.parameters(), lr=LR, min_8bit_size=MIN8)
    plain.load_state_dict(torch.load(path, map_location=td.DEVICE, weights_only=True))
    assert plain.state_dict()["param_groups"][0]["bnbf"]["lr0"] == LR
    for grads in kept:
        for p, g in zip(plain_model.parameters(), grads):
            p.grad = g
        plain.step()
    for p, q in zip(model.parameters(), plain_model.parameters()):
        assert torch.equal(p.detach(), q.detach())


def scenario_nn_load_refused_on_every_rank():
    """load_state_dict of a 32-bit state whose bad values (a negative second moment, NaN) lie in rank 1's rows only:
    every rank refuses it with the same error, which names the global index, and no rank changes. Each rank used to
    check its own rows only: rank 1 refused while rank 0 loaded (its lr restored), and the ranks diverged."""
    from torch.distributed.tensor import distribute_tensor

    import bnbf_nn

    # 4.weight is 150 x 8: rank 1 holds rows 75.. (flat 600..); AdEMAMix stacks its first moments, (2, 150, 8)
    cases = [
        (bnbf_nn.AdamW32bit, "state2", {900: -1.0, 1000: float("nan")}, "2 values that are negative, NaN or inf"),
        (bnbf_nn.AdEMAMix32bit, "state1", {1200 + 900: float("nan")}, "1 values that are NaN or inf"),
    ]
    for cls, key, bad, what in cases:
        model = _fsdp_model()
        opt = cls(model.parameters(), lr=LR)
        _backward(model, 1)
        opt.step()
        sd = opt.state_dict()
        quant = sd["state"][[k for k, _ in model.named_parameters()].index("4.weight")]["__bnb_optimizer_quant_state__"]
        t = quant[key]
        values = t.full_tensor().clone()
        for i, v in bad.items():
            values.view(-1)[i] = v
        quant[key] = distribute_tensor(values, t.device_mesh, t.placements)
        opt.param_groups[0]["lr"] = LR / 2  # the load would restore LR
        before = {p: [s.to_local().clone() for s in opt.state[p]["state"]] for p in model.parameters()}
        try:
            opt.load_state_dict(sd)
            said = "loaded"
        except ValueError as e:
            said = str(e)
        every = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(every, said)
        first = min(bad)
        want = f"{key} holds {what} (first at flat index {first}: {bad[first]!r})"
        assert len(set(every)) == 1 and want in said, (cls.__name__, every)
        assert opt.param_groups[0]["lr"] == LR / 2, cls.__name__
        for p, kept in before.items():
            assert all(torch.equal(s.to_local(), k) for s, k in zip(opt.state[p]["state"], kept)), cls.__name__


def _whole_blocks_model() -> torch.nn.Module:
    """An FSDP2 model whose 8-bit states' shards all hold whole 256-element blocks (weights 128 x 8 and 8 x 128)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 128), torch.nn.Tanh(), torch.nn.Linear(128, 8)).to(td.DEVICE)
    fully_shard(model, mesh=td.mesh())
    return model


def scenario_nn_load_replicate_entries():
    """load_state_dict of the optimizer's own state_dict() whose DTensors were redistributed to Replicate (entries of
    the global shape, as README allows): the states equal those of a load of the unmodified state_dict bit for bit,
    and so do the params two steps on. It raised "shape ... is invalid" (the whole tensor read as this shard's)."""
    import copy

    from torch.distributed.tensor import DTensor, Replicate
    from torch.utils._pytree import tree_map

    import bnbf_nn

    def backward(model: torch.nn.Module, step: int) -> None:
        model.zero_grad(set_to_none=True)
        x, _ = (t.to(td.DEVICE) for t in td._batch(torch.distributed.get_rank(), step))
        model(x).square().mean().backward()

    for cls in (bnbf_nn.AdamW8bit, bnbf_nn.AdamW32bit):
        model = _whole_blocks_model()
        opt = cls(model.parameters(), lr=LR, min_8bit_size=MIN8, weight_decay=0.01)
        for t in range(1, td.STEPS + 1):
            backward(model, t)
            opt.step()
        sd = opt.state_dict()
        replicated = tree_map(
            lambda v: v.redistribute(v.device_mesh, [Replicate()]) if isinstance(v, DTensor) else copy.deepcopy(v), sd
        )
        saved = {k: p.detach().to_local().clone() for k, p in model.named_parameters()}
        runs = []
        for entries in (replicated, sd):
            twin = _whole_blocks_model()
            with torch.no_grad():
                for k, p in twin.named_parameters():
                    p.to_local().copy_(saved[k])
            loaded = cls(twin.parameters(), lr=LR, min_8bit_size=MIN8, weight_decay=0.01)
            loaded.load_state_dict(entries)
            runs.append((twin, loaded))
        (rep, rep_opt), (plain, plain_opt) = runs
        for step in range(td.STEPS, td.STEPS + 3):
            if step > td.STEPS:
                for twin, loaded in runs:
                    backward(twin, step)
                    loaded.step()
            for (k, p), q in zip(rep.named_parameters(), plain.parameters()):
                tag = (cls.__name__, step, k)
                assert torch.equal(p.detach().to_local(), q.detach().to_local()), tag
                mine, want = rep_opt.state[p], plain_opt.state[q]
                assert mine["step"] == want["step"] == step, tag
                assert all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(mine["state"], want["state"])), tag


def scenario_nn_overrides_and_fully_shard():
    """GlobalOptimManager's overrides by param object do not survive fully_shard, which makes each param a new
    DTensor param (as bitsandbytes' manager, keyed the same way; README says so): one made before applies to
    nothing, one made after applies; a module override names the module's attribute and follows the new param."""
    from torch.distributed.fsdp import fully_shard

    import bnbf_nn

    mng = bnbf_nn.GlobalOptimManager.get_instance()
    try:
        model = td._model().to(td.DEVICE)
        before = model[0].weight
        mng.override_config(model[0].weight, "optim_bits", 32)
        mng.register_module_override(model[2], "weight", {"optim_bits": 32})
        fully_shard(model, mesh=td.mesh())
        assert model[0].weight is not before
        mng.override_config(model[4].weight, "optim_bits", 32)
        opt = bnbf_nn.AdamW8bit(model.parameters(), lr=LR, min_8bit_size=MIN8)
        _backward(model, 1)
        opt.step()
        bits = {i: type(opt.state[model[i].weight]["state"]).layout.bits for i in (0, 2, 4)}
        assert bits == {0: 8, 2: 32, 4: 32}, bits
    finally:
        mng.initialize()


SCENARIOS = {name[9:]: fn for name, fn in globals().items() if name.startswith("scenario_")}


@pytest.fixture(scope="module")
def results():
    return td._spawn("cpu", __name__)


@pytest.fixture(scope="module")
def results_gpu():
    if torch.cuda.device_count() < td.WORLD:
        pytest.skip(f"needs {td.WORLD} CUDA devices")
    return td._spawn("cuda", __name__)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario(results, name):
    td._report(results, name)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario_two_gpus(results_gpu, name):
    """The same on two GPUs with nccl: the compiled Triton kernels on the local shards."""
    td._report(results_gpu, name)

"""CUDA-graph capture of ``bnbf.update_`` and of ``vmap(bnbf.update_)`` of an ensemble (GPU only: skipped without
CUDA).

With the step and the hyperparameters as 0-d tensors on the device, a captured step replayed N times, with lr,
the step and the grads changed between replays, equals N eager steps bit for bit (the same kernels read the
same values), also after bnbf's table caches were emptied (the tables a capture read are held for it). What
cannot be captured raises while capturing, and writes nothing: a Python-number step or lr (it would replay its
captured value), a first step (it builds its tables from the host), grads at addresses the warm-up did not see,
the pure ``update`` (its new outputs' tables are copied from the host) and a compiled step (its scalars may come
from Python numbers traced into the graph).
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch.utils._pytree import tree_leaves, tree_map

import bnbf

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device"),
]

RULES = [("adamw", {"weight_decay": 0.01}), ("lamb", {}), ("sgd", {"momentum": 0.9})]


def _problem(rule, hp, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    shapes = {"w": (64, 65), "b": (257,), "one": (1,)}  # 4160 elements (partial blocks), 257, 1
    params = {k: torch.randn(*s, generator=gen).to("cuda", dtype) for k, s in shapes.items()}
    spec = bnbf.OptimSpec(rule=rule, state_bits=8, min_8bit_size=0)
    state = bnbf.init_state(params, spec, hp)
    grads = [{k: torch.randn(*s, generator=gen).to("cuda", dtype) for k, s in shapes.items()} for _ in range(6)]
    return params, state, grads


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(tree_leaves(a), tree_leaves(b), strict=True))


def _drop_tables() -> list:
    """Empty bnbf's caches of kernel tables and reuse the memory they freed (small tensors of junk): a replay must
    read the tables its capture saw, which bnbf holds for the graph."""
    from bnbf.kernels import members

    members._GROUPS.clear()
    bnbf.ops._GROUPS.clear()
    bnbf.functional._PLANS.clear()  # update_'s plans: their tables go with them
    bnbf.functional._LAST.clear()
    sys.modules["bnbf.plan"]._NUMBER_ROWS.clear()  # the numbers beside a tensor lr and step
    sys.modules["bnbf.plan"]._PROGRAM_ROWS.clear()  # the programs that derive the scalars from them
    return [torch.full((n,), -1, dtype=torch.int64, device="cuda") for n in (64, 128, 256, 512, 1024, 4096) * 8]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rule", "extra"), RULES, ids=[r for r, _ in RULES])
def test_captured_step_replays_like_eager_steps(rule, extra, dtype):
    params, state, grads = _problem(rule, extra, dtype)
    eager_p, eager_s = tree_map(torch.clone, (params, state))
    lrs = [1e-2, 5e-3, 2e-3, 1e-3, 5e-4, 2e-4]
    lr = torch.tensor(lrs[0], device="cuda")
    step = torch.tensor(1, device="cuda")
    g = tree_map(torch.clone, grads[0])  # the static grads the graph reads
    hp = {"lr": lr, **extra}

    side = torch.cuda.Stream()  # warm-up (step 1) on a side stream, as torch's capture recipe
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        bnbf.update_(params, g, state, hp, step)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        bnbf.update_(params, g, state, hp, step)
    with torch.cuda.stream(side):  # the warm-up made the tables on the side stream, whose memory it reuses
        junk = _drop_tables()
    for t in range(2, len(lrs) + 1):  # replays: steps 2..6, each with its lr and grads
        lr.fill_(lrs[t - 1])
        step.fill_(t)
        for k in g:
            g[k].copy_(grads[t - 1][k])
        graph.replay()
    torch.cuda.synchronize()

    for t in range(1, len(lrs) + 1):  # the same steps eagerly
        bnbf.update_(
            eager_p,
            grads[t - 1],
            eager_s,
            {"lr": torch.tensor(lrs[t - 1], device="cuda"), **extra},
            torch.tensor(t, device="cuda"),
        )
    assert _same((params, state), (eager_p, eager_s))
    del junk


def _warm(rule="adamw", extra=None):
    extra = extra or {}
    params, state, grads = _problem(rule, extra)
    hp = {"lr": torch.tensor(1e-3, device="cuda"), **extra}
    step = torch.tensor(1, device="cuda")
    bnbf.update_(params, grads[0], state, hp, step)
    torch.cuda.synchronize()
    return params, state, grads, hp, step


def _refused(fn, match: str, watched) -> None:
    before = tree_map(torch.clone, watched)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match=match), torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    assert _same(before, watched)


def test_a_python_number_step_or_lr_is_refused_while_capturing():
    params, state, grads, hp, step = _warm()
    watched = (params, state)
    _refused(lambda: bnbf.update_(params, grads[0], state, hp, 2), "step must be a 0-d tensor on cuda", watched)
    _refused(lambda: bnbf.update_(params, grads[0], state, {"lr": 1e-3}, step), "lr must be a 0-d tensor", watched)
    cpu_lr = {"lr": torch.tensor(1e-3)}
    _refused(lambda: bnbf.update_(params, grads[0], state, cpu_lr, step), "lr must be a 0-d tensor", watched)


def test_an_unwarmed_step_or_moved_grads_are_refused_while_capturing():
    params, state, grads, hp, step = _warm()
    _refused(lambda: bnbf.update_(params, grads[1], state, hp, step), "warm up with the grad tensors", (params, state))
    fresh = tree_map(torch.clone, (params, state))
    _refused(lambda: bnbf.update_(fresh[0], grads[0], fresh[1], hp, step), "run a step before capturing", fresh)


def test_the_pure_update_is_refused_while_capturing():
    params, state, grads, hp, step = _warm()
    _refused(lambda: bnbf.update(params, grads[0], state, hp, step), "pure update writes new outputs", (params, state))


MEMBERS = 3


def _ensemble(rule="adamw", extra=None, dtype=torch.float32):
    """An ensemble's stacked params, their state (``vmap(init_state)``) and six sets of stacked grads."""
    extra = extra or {}
    gen = torch.Generator().manual_seed(1)
    shapes = {"w": (64, 65), "b": (257,), "one": (1,)}
    params = {k: torch.randn(MEMBERS, *s, generator=gen).to("cuda", dtype) for k, s in shapes.items()}
    spec = bnbf.OptimSpec(rule=rule, state_bits=8, min_8bit_size=0)
    state = torch.func.vmap(lambda p: bnbf.init_state(p, spec, extra))(params)
    grads = [
        {k: torch.randn(MEMBERS, *s, generator=gen).to("cuda", dtype) for k, s in shapes.items()} for _ in range(6)
    ]
    return params, state, grads


def _vmapped(fn, extra, lr_dim):
    return torch.func.vmap(lambda p, g, s, lr, t: fn(p, g, s, {"lr": lr, **extra}, t), in_dims=(0, 0, 0, lr_dim, None))


@pytest.mark.parametrize("lr_dim", [None, 0], ids=["one_lr", "lr_per_member"])
@pytest.mark.parametrize(("rule", "extra"), RULES, ids=[r for r, _ in RULES])
def test_captured_vmapped_ensemble_replays_like_eager_steps(rule, extra, lr_dim):
    """``vmap(update_)`` of an ensemble, captured once and replayed with lr (one, or one per member), the step and the
    grads changed between replays, equals the same vmapped steps eagerly, bit for bit; also after bnbf's table
    caches were emptied and their memory reused."""
    params, state, grads = _ensemble(rule, extra, torch.bfloat16)
    eager_p, eager_s = tree_map(torch.clone, (params, state))
    step_ = _vmapped(bnbf.update_, extra, lr_dim)

    def lr_of(t):
        base = 1e-2 / t
        return torch.tensor(base if lr_dim is None else [base * (m + 1) for m in range(MEMBERS)], device="cuda")

    lr, step = lr_of(1), torch.tensor(1, device="cuda")
    g = tree_map(torch.clone, grads[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step_(params, g, state, lr, step)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step_(params, g, state, lr, step)
    with torch.cuda.stream(side):  # the warm-up made the tables on the side stream, whose memory it reuses
        junk = _drop_tables()
    for t in range(2, 7):
        lr.copy_(lr_of(t))
        step.fill_(t)
        for k in g:
            g[k].copy_(grads[t - 1][k])
        graph.replay()
    torch.cuda.synchronize()

    for t in range(1, 7):
        step_(eager_p, grads[t - 1], eager_s, lr_of(t), torch.tensor(t, device="cuda"))
    assert _same((params, state), (eager_p, eager_s))
    del junk


def test_vmapped_steps_refused_while_capturing():
    """Under vmap as outside: a Python-number step, an ensemble no step warmed up, grads the warm-up did not see and
    the pure ``vmap(update)`` raise while capturing, and write nothing."""
    params, state, grads = _ensemble()
    step_ = _vmapped(bnbf.update_, {}, None)
    lr, step = torch.tensor(1e-3, device="cuda"), torch.tensor(1, device="cuda")
    step_(params, grads[0], state, lr, step)
    torch.cuda.synchronize()
    watched = (params, state)
    _refused(lambda: step_(params, grads[0], state, lr, 2), "step must be a 0-d tensor on cuda", watched)
    _refused(lambda: step_(params, grads[1], state, lr, step), "warm up by running the same step", watched)
    fresh = tree_map(torch.clone, (params, state))
    _refused(lambda: step_(fresh[0], grads[0], fresh[1], lr, step), "warm up by running the same step", fresh)
    pure = _vmapped(bnbf.update, {}, None)
    _refused(lambda: pure(params, grads[0], state, lr, step), "pure update writes new outputs", watched)


def test_a_compiled_step_is_refused_while_capturing():
    """A compiled step reaches the kernels through the bnbf::step_ op with scalars the graph computed, maybe from
    Python numbers that a replay would repeat: the op refuses while capturing (compiled before the capture)."""
    params, state, grads, hp, step = _warm()
    compiled = torch.compile(lambda p, g, s, t: bnbf.update_(p, g, s, hp, t), backend="aot_eager", fullgraph=True)
    compiled(params, grads[0], state, step)
    torch.cuda.synchronize()
    _refused(lambda: compiled(params, grads[0], state, step), "bnbf::step_ op", (params, state))


def test_cpu_params_are_refused_while_capturing():
    """CPU params are stepped on the host at capture time only: a replay would skip them."""
    params = {"w": torch.randn(300)}
    state = bnbf.init_state(params, bnbf.OptimSpec(rule="adamw", min_8bit_size=0))
    grads = {"w": torch.randn(300)}
    _refused(lambda: bnbf.update_(params, grads, state, {"lr": 0.1}, 1), "stepped on the host", (params, state))

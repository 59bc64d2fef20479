"""Where the host time of one in-place step goes (GPT-2 small's 148 tensors and one 4096x4096 tensor).

    python scripts/host_breakdown.py [--profile]   # on a CUDA machine
    python scripts/host_breakdown.py --cpu         # anywhere: CPU tensors, the launch stubbed out
    python scripts/host_breakdown.py [--cpu] --func [--packed]  # the torch.func rows: vmap ensembles, the compiled
                                                     # step (--packed: the state packed, init_state(packed=True))
    python scripts/host_breakdown.py [--cpu] --mixed [--profile]  # bench_func's mixed row: one call vs three
    --dtype bf16|fp16|fp32                         # the params' dtype (default bf16, as the issue's table)

Prints, per parameter set, the median host microseconds (``--cpu``: the minimum) of: ``plan.step``,
``bnbf.update_`` and ``bnbf_nn.AdamW8bit``'s step (whole call, and with the launch stubbed out: Python only),
each with the same grads every step and with new grad tensors every step (as a training loop's
``zero_grad(set_to_none=True)`` gives); the grads' address table alone (written and uploaded when the grads
move); uploading a scalar row (what a step with 0-d tensor hyperparameters does; Python numbers go as kernel
arguments, no upload); the launches alone through the direct path and through Triton's dispatch; and for
scale, one torch kernel launch and torch's fused AdamW step.

``--cpu`` runs the plans' direct path on CPU tensors (as on CUDA: the per-step checks, the scalars, the
grads' address tables, the grads' address comparison of ``launch_group``) with the kernel launch itself
stubbed out (and the table's copy to the device: there is none): the part of the host time that is bnbf's
Python, on this machine's CPU.
"""

from __future__ import annotations

import array
import cProfile
import importlib
import os
import pstats
import statistics
import sys
import time

import torch
from torch import Tensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchmarks.bench_step as bs  # noqa: E402
import bnbf  # noqa: E402
import bnbf.kernels.direct_launch as direct  # noqa: E402
import bnbf.kernels.launcher as mt  # noqa: E402
import bnbf_nn  # noqa: E402
from benchmarks.bench_step import SETS  # noqa: E402
from bnbf._host_checks import NATIVE  # noqa: E402
from bnbf.rules.base import as_scalar_row  # noqa: E402

P = importlib.import_module("bnbf.plan")  # the module (``bnbf.plan`` is the function)
PACKED = "--packed" in sys.argv
PROFILE = "--profile" in sys.argv
CPU = "--cpu" in sys.argv
DEVICE = "cpu" if CPU else "cuda"
FRESH = 8  # grad sets cycled through for "new grads": new tensor objects (at new addresses) every step
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE = DTYPES[sys.argv[sys.argv.index("--dtype") + 1] if "--dtype" in sys.argv else "bf16"]


def sync() -> None:
    if not CPU:
        torch.cuda.synchronize()


def host_us(fn, n=200, sync_each=False) -> float:
    times = []
    for i in range(n):
        if sync_each:
            sync()
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
        if i % 50 == 49:
            sync()
    sync()
    return summary(times) * 1e6


def summary(times: list) -> float:
    """The median; on CPU the minimum (on a shared CI machine the median mostly measures other processes)."""
    return min(times) if CPU else statistics.median(times)


def _grads_only(group, grads, hp, skip_zeros=False, clip=False, grads_placed=False) -> bool:
    """launch_group without the launch: the grads' address comparison it makes before every launch (the
    group is left as it is, so a real launch after this one uploads what it needs). A plan's launches come with
    their tables placed (``grads_placed``): no comparison."""
    if grads_placed:
        return True
    if NATIVE is not None:
        return NATIVE.ptrs_equal(grads, group.grad_packed)
    return tuple(map(Tensor.data_ptr, grads)) == group.grad_ptrs


def packed(tensors: list) -> bytes:
    return array.array("Q", map(Tensor.data_ptr, tensors)).tobytes()


def _no_launch(pair, hp, skip_zeros=False) -> None:
    """launch_pair without the launch (a plan placed both groups' grad tables before it)."""


class Stubbed:
    """The kernel launch stubbed out (launch_group keeps only its grads' address comparison)."""

    def __enter__(self):
        self.real = P.launch_group, P.launch_pair
        P.launch_group, P.launch_pair = _grads_only, _no_launch

    def __exit__(self, *exc):
        P.launch_group, P.launch_pair = self.real


def breakdown(set_name: str, dtype=DTYPE) -> dict:
    shapes = SETS[set_name]()
    params = {n: (torch.randn(s, device=DEVICE) * 0.1).to(dtype) for n, s in shapes}
    grad_sets = [{k: (torch.randn_like(v) * 0.01) for k, v in params.items()} for _ in range(FRESH)]
    grads = grad_sets[0]
    hp = {"lr": 1e-3, "weight_decay": 0.01}
    state = bnbf.init_state(params, bnbf.OptimSpec(rule="adamw"), hp)
    opt = bnbf.plan(params, state)
    assert opt.groups, "the plan did not take the direct path"
    out = {}
    if not CPU:
        out["plan.step"] = host_us(lambda i: opt.step(grads, hp, i + 1))
        out["update_"] = host_us(lambda i: bnbf.update_(params, grads, state, hp, i + 1))
        out["plan.step, new grads"] = host_us(lambda i: opt.step(grad_sets[i % FRESH], hp, i + 1))
        out["update_, new grads"] = host_us(lambda i: bnbf.update_(params, grad_sets[i % FRESH], state, hp, i + 1))
    # the grads' address tables alone, for grads known to have moved (as the step's check of the grads tells)
    lists = [list(d.values()) for d in grad_sets]
    moved = [(gl, packed(gl)) for gl in lists]
    out["grad tables, new grads (write + upload)"] = host_us(lambda i: opt._grad_tables(*moved[i % FRESH]))
    with Stubbed():
        out["python only: plan.step"] = host_us(lambda i: opt.step(grads, hp, i + 1))
        out["python only: plan.step, new grads"] = host_us(lambda i: opt.step(grad_sets[i % FRESH], hp, i + 1))
        out["python only: update_"] = host_us(lambda i: bnbf.update_(params, grads, state, hp, i + 1))
        out["python only: update_, new grads"] = host_us(
            lambda i: bnbf.update_(params, grad_sets[i % FRESH], state, hp, i + 1)
        )
    leaves = [torch.nn.Parameter(v.detach().clone()) for v in params.values()]
    for p, g in zip(leaves, grads.values()):
        p.grad = g
    ad = bnbf_nn.AdamW8bit(leaves, lr=1e-3, weight_decay=0.01)
    with Stubbed():
        ad.step()
    grad_lists = [list(gs.values()) for gs in grad_sets]

    def nn_step(i, fresh):
        if fresh:  # what zero_grad(set_to_none=True) and backward leave: new grad tensors
            for p, g in zip(leaves, grad_lists[i % FRESH]):
                p.grad = g
        t0 = time.perf_counter()
        ad.step()
        return time.perf_counter() - t0

    def nn_us(fresh):  # as host_us: synchronised every 50 steps, outside the timing (the same GPU backlog)
        times = []
        for i in range(200):
            times.append(nn_step(i, fresh))
            if i % 50 == 49:
                sync()
        sync()
        return summary(times) * 1e6

    def interleaved(prefix):
        """update_ and bnbf_nn's step in alternation, so that both meet the same host and GPU state (issue 11's
        budget: bnbf_nn within 10% of the functional step): their medians and bnbf_nn's as % of update_'s."""
        a, b = [], []
        for i in range(200):
            t0 = time.perf_counter()
            bnbf.update_(params, grads, state, hp, i + 1)
            a.append(time.perf_counter() - t0)
            b.append(nn_step(i, False))
            if i % 50 == 49:
                sync()
        sync()
        ua, ub = summary(a) * 1e6, summary(b) * 1e6
        out[f"{prefix}interleaved: update_"] = ua
        out[f"{prefix}interleaved: bnbf_nn step"] = ub
        out[f"{prefix}interleaved: bnbf_nn as % of update_"] = 100 * ub / ua

    if not CPU:
        out["bnbf_nn.AdamW8bit step"] = nn_us(False)
        out["bnbf_nn.AdamW8bit step, new grads"] = nn_us(True)
        interleaved("")
    with Stubbed():
        out["python only: bnbf_nn step"] = nn_us(False)
        out["python only: bnbf_nn step, new grads"] = nn_us(True)
        interleaved("python only: ")
    if CPU:
        return out
    rule = bnbf.RULES["adamw"]
    h = rule.make_hparams(hp)
    values = (*rule.scalars(h, 5), 1.0, 5, 0.0, h.lr)
    dev = torch.device("cuda")
    out["scalar row upload"] = host_us(lambda i: as_scalar_row(values, dev))
    gl = list(grads.values())
    launches = [(group, gl if pick is None else pick(gl)) for pick, group in opt.groups]
    row = as_scalar_row(values, dev)

    floats = tuple(map(float, values))  # what a step with Python-number hyperparameters passes

    def launch_all(i, hp_arg=row):
        for group, gs in launches:
            mt.launch_group(group, gs, hp_arg)

    # a plan's usual step: both groups in one launch where they pair (launcher.pair_of)
    out["launches"] = 1 if opt._pair is not None else len(launches)
    out["launch (direct)"] = host_us(launch_all)  # the scalars read from a device row (HP_FROM_PTR)
    out["launch (direct, scalars as arguments)"] = host_us(lambda i: launch_all(i, floats))
    if opt._pair is not None:
        out["launch (direct, scalars as arguments, paired)"] = host_us(lambda i: mt.launch_pair(opt._pair, floats))
    # the same with the GPU idle at each launch (synchronized before it, outside the timing): what a backlog of
    # queued work adds to a launch's host time
    out["launch (direct, scalars as arguments), GPU idle"] = host_us(lambda i: launch_all(i, floats), sync_each=True)
    saved = [dict(group.compiled) for group, _ in launches]
    direct.DIRECT_LAUNCH = False
    for group, _ in launches:
        group.compiled.clear()
    out["launch (triton dispatch)"] = host_us(launch_all)
    direct.DIRECT_LAUNCH = True
    for (group, _), kept in zip(launches, saved):
        group.compiled.update(kept)
    x = torch.zeros(1, device="cuda")
    out["torch add_ (1 launch)"] = host_us(lambda i: x.add_(1.0))
    tp = [torch.nn.Parameter(v.detach().clone().float()) for v in params.values()]
    for p, g in zip(tp, grads.values()):
        p.grad = g.float()
    topt = torch.optim.AdamW(tp, lr=1e-3, fused=True)
    topt.step()
    out["torch AdamW fused step"] = host_us(lambda i: topt.step())
    if PROFILE:
        for name, fn in (("plan.step", lambda: opt.step(grads, hp, 7)), ("adapter", ad.step)):
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(200):
                fn()
            pr.disable()
            sync()
            print(f"== {set_name} {name}: cProfile of 200 calls")
            pstats.Stats(pr).sort_stats("tottime").print_stats(12)
    return out


def _stub_launches():
    """The kernel launch stubbed out everywhere it is reached from (plans, the op, the vmapped step)."""
    saved = (P.launch_group, mt.launch_group, P.launch_pair)
    P.launch_group = _grads_only
    mt.launch_group = _grads_only
    P.launch_pair = _no_launch
    return saved


def _vmap_us(shapes, members: int, dtype, hp, spec) -> dict:
    """Host us of ``vmap(bnbf.update)`` (its outputs fed back, as a training loop does: new addresses every call, as
    CUDA's allocator gives them) and of ``vmap(bnbf.update_)``: the whole call, and the time inside the vmapped
    function (bnbf's part; the rest is torch.func's wrapping and unwrapping); and of vmap of a function returning
    its inputs (torch.func's own floor)."""
    params = {n: torch.randn(members, *s, device=DEVICE).to(dtype) for n, s in shapes}
    grads = {n: torch.randn_like(v) for n, v in params.items()}
    state = torch.func.vmap(lambda p: bnbf.init_state(p, spec, packed=PACKED))(params)
    inside: list = []

    def timed(fn):
        def body(p, g, s, i):
            t0 = time.perf_counter()
            out = fn(p, g, s, hp, i)
            inside.append(time.perf_counter() - t0)
            return out

        return torch.func.vmap(body, in_dims=(0, 0, 0, None))

    step, step_ = timed(bnbf.update), timed(bnbf.update_)
    floor = torch.func.vmap(lambda p, g, s, i: (p, s), in_dims=(0, 0, 0, None))
    held = [params, state]

    def pure(i):
        held[:] = step(held[0], grads, held[1], i + 1)

    out = {}
    for name, fn in (("update", pure), ("update_", lambda i: step_(params, grads, state, i + 1))):
        inside.clear()
        out[name] = host_us(fn, 60)
        out[f"{name} inside"] = summary(inside) * 1e6
    out["floor"] = host_us(lambda i: floor(params, grads, state, i), 60)
    return out


def func_breakdown(dtype=torch.bfloat16) -> dict:
    """The host time of the torch.func rows of benchmarks/bench_func.py (GPT-2 small's 148 tensors, 8-bit AdamW),
    the launch stubbed out: ``vmap(bnbf.update)`` (outputs fed back: new addresses, new tables, every call) and
    ``vmap(bnbf.update_)`` over stacked members (1, 2, 8, 32: the host work should not grow with them),
    bnbf's part of each (the time inside the vmapped function), torch.func.vmap's own floor (a vmapped function
    returning its inputs: flattening and wrapping the same pytrees), and ``torch.compile(fullgraph=True)`` of
    ``bnbf.update_`` against the eager call, also with the op's implementation a no-op (what is left: Dynamo's
    guards, the graph's calling code, the op's dispatch).
    ``--cpu``: GPT-2's structure at small sizes (host time depends on the tensor count, not their sizes)."""
    shapes = bs.SMOKE_SETS["gpt2_124M"]() if CPU else bs.SETS["gpt2_124M"]()
    hp = {"lr": 1e-3, "weight_decay": 0.01}
    spec = bnbf.OptimSpec(rule="adamw")
    out = {}
    saved = _stub_launches()
    try:
        for members in (1, 2, 8, 32) if CPU else (1, 2, 8):
            us = _vmap_us(shapes, members, dtype, hp, spec)
            for name in ("update", "update_"):
                out[f"python only: vmap {name}, {members} members"] = us[name]
                out[f"  of which inside bnbf.{name} (bnbf's part), {members} members"] = us[f"{name} inside"]
            out[f"vmap of a function returning its inputs (torch.func's own), {members} members"] = us["floor"]
        params = {n: torch.randn(*s, device=DEVICE).to(dtype) for n, s in shapes}
        grads = {n: torch.randn_like(v) for n, v in params.items()}
        state = bnbf.init_state(params, spec, packed=PACKED)

        @torch.compile(fullgraph=True)
        def compiled(params, grads, state, lr, i):
            bnbf.update_(params, grads, state, {"lr": lr, "weight_decay": 0.01}, i)

        lr, t = torch.tensor(1e-3, device=DEVICE), torch.tensor(1, device=DEVICE)

        def fn(i):
            lr.fill_(1e-3 * 0.999**i)
            t.fill_(i + 1)
            compiled(params, grads, state, lr, t)

        fn(0)  # compiles
        out["python only: compiled update_"] = host_us(fn, 50)
        out["python only: eager update_"] = host_us(lambda i: bnbf.update_(params, grads, state, hp, i + 1), 50)
        where = bnbf.packed if PACKED else bnbf.ops
        run = where._run
        where._run = lambda *a: None
        out["compiled update_, the op's implementation a no-op"] = host_us(fn, 50)
        where._run = run
    finally:
        P.launch_group, mt.launch_group, P.launch_pair = saved
    return out


def mixed_breakdown(dtype=DTYPE) -> dict:
    """The host time of benchmarks/bench_func.py's ``mixed`` row, the launch stubbed out: GPT-2 small's tree with
    AdamW on matrices, Lion on the embeddings and no weight decay on biases and norms, in one ``bnbf.update_``
    call with the hyperparameters as a callable (the row's), as a flat dict of mappings by param name, and by
    rule (no per-leaf decay: AdamW's leaves then share one set, as two core calls on that partition would),
    against three ``bnbf.update_`` calls on the same partition made by hand; and the callable alone (the API
    must call it once per leaf). ``--cpu``: GPT-2's structure at small sizes (host time depends on the tensor
    count, not their sizes). ``--profile``: cProfile of the mixed call with the callable."""
    shapes = bs.SMOKE_SETS["gpt2_124M"]() if CPU else bs.SETS["gpt2_124M"]()
    params = {n: (torch.randn(s, device=DEVICE) * 0.1).to(dtype) for n, s in shapes}
    grads = {n: torch.randn_like(v) * 0.01 for n, v in params.items()}
    emb = lambda path: path.endswith(("wte.weight", "wpe.weight"))
    decay, no_decay = {"lr": 1e-3, "weight_decay": 0.1}, {"lr": 1e-3, "weight_decay": 0.0}
    lion = {"lr": 1e-4, "weight_decay": 0.1}
    hp = lambda path, p: lion if emb(path) else decay if p.ndim > 1 else no_decay
    tree, by_rule = {k: hp(k, p) for k, p in params.items()}, {"adamw": decay, "lion": lion}
    state = bnbf.init_state(params, lambda path, p: bnbf.OptimSpec(rule="lion" if emb(path) else "adamw"))
    sub = lambda keys, h: ({k: params[k] for k in keys}, {k: grads[k] for k in keys}, {k: state[k] for k in keys}, h)
    three = [sub([k for k, p in params.items() if hp(k, p) is h], h) for h in (lion, decay, no_decay)]
    two = [sub([k for k in params if emb(k) == (h is lion)], h) for h in (lion, decay)]
    calls = {
        "mixed update_, hparams callable": lambda i: bnbf.update_(params, grads, state, hp, i + 1),
        "three update_ calls (the same partition)": lambda i: [bnbf.update_(*c, i + 1) for c in three],
        "the hparams callable alone": lambda i: [hp(k, p) for k, p in params.items()],
        "mixed update_, hparams a dict by param name": lambda i: bnbf.update_(params, grads, state, tree, i + 1),
        "mixed update_, hparams by rule": lambda i: bnbf.update_(params, grads, state, by_rule, i + 1),
        "two update_ calls (the by-rule partition)": lambda i: [bnbf.update_(*c, i + 1) for c in two],
    }
    out = {}
    if not CPU:  # launches included
        out.update({f"{k} (launches included)": host_us(fn) for k, fn in calls.items() if "callable alone" not in k})
    saved = _stub_launches()
    try:
        out.update({f"python only: {k}" if "alone" not in k else k: host_us(fn, 400) for k, fn in calls.items()})
        if PROFILE:
            pr = cProfile.Profile()
            pr.enable()
            for i in range(200):
                calls["mixed update_, hparams callable"](i)
            pr.disable()
            print("== mixed update_, hparams callable: cProfile of 200 calls, the launch stubbed out")
            pstats.Stats(pr).sort_stats("tottime").print_stats(15)
    finally:
        P.launch_group, mt.launch_group, P.launch_pair = saved
    return out


if __name__ == "__main__":
    if CPU:  # the direct path (address tables, per-step checks) for CPU tensors, without the interpreter
        P.use_triton = lambda t: True
        print(
            "CPU (launch stubbed out):", torch.__version__, "| host checks:", "native" if NATIVE else "python", end=""
        )
    else:
        print(
            torch.cuda.get_device_name(), torch.__version__, "| host checks:", "native" if NATIVE else "python", end=""
        )
    print(" | params:", DTYPE)
    if "--mixed" in sys.argv:
        for k, v in mixed_breakdown().items():
            print(f"| {k} | {v:.1f} us |")
        sys.exit(0)
    if "--func" in sys.argv:
        # the Triton path's host work, launch stubbed
        P.use_triton = bnbf.ops.use_triton = bnbf.packed.use_triton = lambda t: True
        for k, v in func_breakdown().items():
            print(f"| {k} | {v / 1e3:.2f} ms |")
        sys.exit(0)
    rows = {name: breakdown(name) for name in ("single_4096x4096", "gpt2_124M")}
    keys = list(dict.fromkeys(k for r in rows.values() for k in r))  # a row that one set lacks prints -
    print(f"| host us ({'min' if CPU else 'median'}) | " + " | ".join(rows) + " |")
    print("|---|" + "---|" * len(rows))
    for k in keys:
        print(f"| {k} | " + " | ".join(f"{rows[n][k]:.1f}" if k in rows[n] else "-" for n in rows) + " |")

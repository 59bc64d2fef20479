"""Time the step through PyTorch's transforms and the paged optimizers, beside the plain eager step.

Usage (from the repository root)::

    python benchmarks/bench_func.py                      # every row on the GPU
    python benchmarks/bench_func.py --rows compile,graph --json out.json --markdown out.md
    python benchmarks/bench_func.py --smoke              # tiny shapes on the CPU: checks the script

Rows (8-bit AdamW, the GPT-2 small set unless said otherwise):

- ``eager``: ``bnbf.update_`` with Python-float hyperparameters (the baseline of the rows below);
- ``compile``: the same call inside ``torch.compile(fullgraph=True)``, lr and step as 0-d tensors changing
  every step; the note gives the eager step on the same tensors (the bar: compiled as fast as eager), the
  host time of a call and the part of it that is Dynamo's guard check, the step compiled with Inductor's
  ``size_asserts=False`` (its check of every input's size and stride at each call, which Dynamo's guards
  already make), the device kernels one call runs, and the graphs compiled during the timed steps (0);
  ``scripts/compile_host.py`` breaks the host time down further;
- ``compile_numbers``: ``compile`` with lr and step as Python numbers changing every step (Dynamo's first
  recompile makes them graph inputs; the step kernel takes them as arguments, as the eager step does);
- ``compile_flat_numbers``: ``compile_numbers`` with flat params (as ``compile_flat``, below);
- ``compile_packed``: ``compile`` with the state packed (``init_state(..., packed=True)``: 6 buffers in place
  of 396 state tensors); the note also gives the eager step of the packed state;
- ``compile_flat``: ``compile`` with the params and grads flat too (:func:`bnbf.flat_layout`: 2 param buffers, 2
  grad buffers and 6 state tensors in place of 148, 148 and 396); the note also gives the eager per-param step;
- ``compile_torch``: torch's own AdamW on the same params, its step compiled (foreach, capturable, lr a 0-d
  tensor) against its eager fused and foreach steps: what "compiled as fast as eager" costs torch's optimizer;
- ``compile_nn``: ``torch.compile(opt.step)`` of ``bnbf_nn.AdamW8bit`` with a ``LambdaLR`` scheduler (float lr
  changing every step; a group of numbers steps eagerly inside the compiled call) against the same eager
  ``opt.step()`` and scheduler on the same params, synchronized and back to back, with the graphs compiled
  during the timed steps (0);
- ``train``: a whole training step (forward, backward, ``update_``) of a GPT-2-small-shaped model (12 layers,
  768 wide, untied head: 163M params, 150 tensors), batch 8x256, ``torch.compile(fullgraph=True)`` against the
  same step eager and against the eager step written with ``loss.backward()`` on the module;
- ``train_packed``: ``train`` with the state packed;
- ``train_flat``: ``train`` with flat params (the model called on ``layout.unflatten`` of the buffers); in the
  module's eager step the leaves' grads are copied into flat buffers for the step;
- ``graph``: the step captured in a CUDA graph with lr and step as 0-d device tensors, timed per replay;
- ``vmap``: an ensemble of 8 members in one ``torch.func.vmap(bnbf.update)`` call (bytes: 8 members' fewest;
  the bar is 85% of a copy), with the host time of a call, the part of it torch.func takes on its own (a vmap
  of a function returning its inputs, the same trees) and the device kernels it runs (one step launch per
  state layout expected), against a Python loop of 8 ``bnbf.update`` calls;
- ``vmap_packed``: ``vmap`` with the members' state packed; the note also gives the time a step takes when steps
  run back to back (one synchronize after all of them: what a training loop that never waits sees), torch.func's
  processing of a call's inputs before the vmapped function runs, ``bnbf.update``'s time inside it, and the sum of
  the back-to-back step and that input processing (a synchronized call's time were nothing of bnbf's to come
  before its first launch);
- ``vmap_flat``: ``vmap_packed`` with each member's params, grads and state flat (the buffers stacked over the
  members: 2 param, 2 grad and 6 state tensors);
- ``vmap_graph``: ``vmap_flat``'s in-place step (``vmap(update_)``) captured in a CUDA graph, lr and step 0-d
  device tensors, timed per replay (the step filled first), against the same step eager;
- ``mixed``: AdamW on matrices, Lion on the embeddings and no weight decay on biases and norms, in one
  ``bnbf.update_`` call on a mixed tree, against three calls on the same partition made by hand; the note gives
  each one's host time (a call has no synchronize: a host time near the step's says the step waits on the
  host) and the mixed call with hyperparameters by rule (no per-tensor scalars); the host time alone, the
  launch stubbed out: ``scripts/host_breakdown.py --mixed``;
- ``clip``: ``bnbf.update_(..., max_grad_norm=1.0)`` (the clipping inside the step; bytes: the step's plus
  one read of the grads for their norm), against the unclipped step and ``torch.nn.utils.clip_grad_norm_``
  (foreach, in place) followed by the step;
- ``paged``: ``bnbf_nn.PagedAdamW8bit`` against ``bnbf_nn.AdamW8bit`` (state fits on the GPU), and
  bitsandbytes' pair when importable (``PYTHONPATH=.peers/site``); also the device memory left after
  ``del optimizer``.

Timing as in bench_step.py: warm-up steps, then the median of timed steps, each between two CUDA events
after a synchronize. "% copy" is the effective bandwidth (bench_step.model_bytes over the time) as a
fraction of a device-to-device copy measured in the same run. A row whose feature is missing or fails
prints a note instead of a figure.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_step as bs  # noqa: E402

import bnbf  # noqa: E402

HP = {"lr": 1e-3, "weight_decay": 0.01}
ROWS = (
    "eager", "compile", "compile_numbers", "compile_flat_numbers", "compile_packed", "compile_flat", "compile_torch",
    "compile_nn",
    "train", "train_packed", "train_flat", "graph", "vmap", "vmap_packed", "vmap_flat", "vmap_graph", "paged", "mixed",
    "clip",
)  # fmt: skip
MEMBERS = 8


def timed(device: torch.device, fn: Callable[[int], Any], warmup: int, steps: int, first: int = 1) -> tuple:
    """(median ms of a step, median host ms of its call): on a GPU a host time near the step's says the step
    waits on the host (Python, dispatch, guards), not on the device."""
    for i in range(first, first + warmup):
        fn(i)
    timer = bs.Timer(device)
    for i in range(first + warmup, first + warmup + steps):
        timer.time(functools.partial(fn, i))
    ms = statistics.median(timer.results_ms())
    return ms, statistics.median(timer.host_ms) if timer.host_ms else ms


def median_ms(device: torch.device, fn: Callable[[int], Any], warmup: int, steps: int, first: int = 1) -> float:
    return timed(device, fn, warmup, steps, first)[0]


def kernels(device: torch.device, fn: Callable[[], Any]) -> str:
    """The device kernels and copies one call runs (torch.profiler): their count and the most frequent names,
    which show a step that clones or copies tensor by tensor."""
    if device.type != "cuda":
        return "kernels: n/a"
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = collections.Counter(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    top = ", ".join(f"{n[:40]} x{c}" for n, c in names.most_common(3))
    return f"{sum(names.values())} kernels ({top})"


def fresh(shapes, dtype, device, seed=0):
    params = bs.make_tensors(shapes, dtype, device, 0.1, seed)
    grads = bs.make_tensors(shapes, dtype, device, 0.01, seed + 1)
    return params, grads


def row_eager(ctx) -> dict:
    params, grads = fresh(ctx.shapes, ctx.dtype, ctx.device)
    state = bnbf.init_state(params, bnbf.OptimSpec(rule="adamw"))
    ms = median_ms(ctx.device, lambda i: bnbf.update_(params, grads, state, HP, i), ctx.warmup, ctx.steps)
    holder = [params, state]  # and the pure step, each call's outputs the next one's inputs

    def pure(i: int, g=grads) -> None:
        holder[:] = bnbf.update(holder[0], g, holder[1], HP, i)

    pure_ms, pure_host = timed(ctx.device, pure, ctx.warmup, ctx.steps)
    layout = bnbf.flat_layout(params, bnbf.OptimSpec(rule="adamw"))  # the same, with flat params (2 buffers)
    flat = layout.flatten(params)
    holder[:] = flat, layout.init_state(flat)
    flat_grads = layout.flatten(grads)
    flat_ms, flat_host = timed(ctx.device, lambda i: pure(i, flat_grads), ctx.warmup, ctx.steps)
    note = (
        f"update_ (a plan); pure update {pure_ms:.3f} ms ({_pct(ctx, pure_ms, 1)} of copy, host {pure_host:.3f} ms), "
        f"with flat params {flat_ms:.3f} ms ({_pct(ctx, flat_ms, 1)}, host {flat_host:.3f} ms)"
    )
    return {"ms": ms, "bytes": bs.model_bytes(ctx.shapes, ctx.dtype, "8bit"), "note": note}


def _step(params, grads, state, lr, i):
    bnbf.update_(params, grads, state, {"lr": lr, "weight_decay": 0.01}, i)


def _step_unchecked(params, grads, state, lr, i):  # _step's twin: Dynamo caches compiles by code object
    bnbf.update_(params, grads, state, {"lr": lr, "weight_decay": 0.01}, i)


def _guard_ms(step, f_locals: dict) -> str:
    """The median host time of the compiled frame's guard check alone (Dynamo's guard manager, a private API:
    n/a where this torch lacks it)."""
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

        # the entry these locals pass (the code may hold another row's compile: per-param and packed state)
        checks = [e.guard_manager.check for e in _debug_get_cache_entry_list(step.__code__)]
        (check,) = [c for c in checks if c(f_locals)]
    except Exception:  # noqa: BLE001 - a breakdown figure, not the row
        return "n/a"
    times = []
    for _ in range(50):
        t0 = time.perf_counter()
        check(f_locals)
        times.append((time.perf_counter() - t0) * 1e3)
    return f"{statistics.median(times):.3f} ms"


def _state_of(ctx, mode: str) -> tuple:
    """Params, grads and 8-bit AdamW state of the row's set: per-param (``mode`` "per_param"), packed (the state
    in a few buffers) or flat (params and grads too: :func:`bnbf.flat_layout`), and the per-param params and
    grads they hold."""
    params, grads = fresh(ctx.shapes, ctx.dtype, ctx.device)
    spec = bnbf.OptimSpec(rule="adamw")
    if mode != "flat":
        return params, grads, bnbf.init_state(params, spec, packed=mode == "packed"), params, grads
    layout = bnbf.flat_layout(params, spec)
    flat = layout.flatten(params)
    return flat, layout.flatten(grads), layout.init_state(flat), params, grads


def row_compile(ctx, mode: str = "per_param", numbers: bool = False) -> dict:
    import torch._dynamo

    params, grads, state, leaf_params, leaf_grads = _state_of(ctx, mode)
    torch._dynamo.utils.counters.clear()
    lr = torch.tensor(1e-3, device=ctx.device)
    t = torch.tensor(1, device=ctx.device)
    figures = {}
    for asserts in (True, False):  # Inductor's default, then without its per-input size asserts
        code = _step if asserts else _step_unchecked
        step = torch.compile(code, fullgraph=True, options={"size_asserts": asserts})

        def fn(i: int, step=step) -> None:  # a new lr every step: one graph (numbers: from the second call)
            if numbers:
                step(params, grads, state, 1e-3 * 0.999**i, i)
                return
            lr.fill_(1e-3 * 0.999**i)
            t.fill_(i)
            step(params, grads, state, lr, t)

        for i in range(1, 4):  # compiles here
            fn(i)
        before = sum(torch._dynamo.utils.counters["stats"].values())
        ms, host = timed(ctx.device, fn, ctx.warmup, ctx.steps, first=4)
        after = sum(torch._dynamo.utils.counters["stats"].values())
        figures[asserts] = (ms, host, after - before, fn, code)
    ms, host, moved, fn, code = figures[True]
    ran = kernels(ctx.device, lambda: fn(4 + ctx.warmup + ctx.steps))
    scalars = {"lr": 1e-3 * 0.999**5, "i": 5} if numbers else {"lr": lr, "i": t}
    guards = _guard_ms(code, {"params": params, "grads": grads, "state": state, **scalars})
    bare_ms, bare_host, bare_moved = figures[False][:3]

    # the eager step on the same tensors (Python-float hyperparameters, as the eager row)
    def eager_fn(i: int) -> None:
        bnbf.update_(params, grads, state, HP, i)

    eager = median_ms(ctx.device, eager_fn, ctx.warmup, ctx.steps)
    # back to back (one synchronize after them all), as a training loop runs them: the host's work overlaps the
    # device's wherever it is shorter than the step's kernels. 10x the steps: the first call's host time, before
    # the device starts, is spread over them (over 20 it added ~12 us a step to GPT-2's compiled step)
    first, n_b2b = 4 + ctx.warmup + ctx.steps + 1, 10 * ctx.steps
    b2b = _back_to_back(ctx, fn, n_b2b, first)
    eager_b2b = _back_to_back(ctx, eager_fn, n_b2b, first)
    extra = ""
    if mode != "per_param":  # the bar's eager step: the per-param state's
        per_param = bnbf.init_state(leaf_params, bnbf.OptimSpec(rule="adamw"))
        eager_pp = median_ms(
            ctx.device, lambda i: bnbf.update_(leaf_params, leaf_grads, per_param, HP, i), ctx.warmup, ctx.steps
        )
        extra = f"eager per-param state {eager_pp:.3f} ms (compiled {mode}/eager per-param {ms / eager_pp:.2f}x); "
        if mode == "flat":
            extra = f"{len(params)} param buffers; {extra}"
    return {
        "ms": ms,
        "bytes": bs.model_bytes(ctx.shapes, ctx.dtype, "8bit"),
        "note": f"{extra}eager {eager:.3f} ms (compiled/eager {ms / eager:.2f}x); back to back ({n_b2b} calls) "
        f"compiled {b2b:.3f} ms, eager {eager_b2b:.3f} ({b2b / eager_b2b:.2f}x); host {host:.3f} ms a call, of which "
        f"guards {guards}; "
        f"torch.compile's floor (a one-op function) {_compile_floor(ctx)}; with inductor size_asserts=False "
        f"{bare_ms:.3f} ms (host {bare_host:.3f}); {ran}; dynamo stats moved by {moved}, {bare_moved} in the timed "
        "steps",
    }


def _add_one(x: torch.Tensor) -> None:
    x.add_(1)


def _compile_floor(ctx) -> str:
    """A synchronized call of ``torch.compile(fullgraph=True)`` of a one-op in-place function, and its host time:
    what any compiled step pays before its own work (Dynamo's frame and guards, AOT's and Inductor's wrappers)."""
    x = torch.zeros(1, device=ctx.device)
    step = torch.compile(_add_one, fullgraph=True)
    ms, host = timed(ctx.device, lambda i: step(x), ctx.warmup, ctx.steps)
    return f"{ms:.3f} ms (host {host:.3f})"


def row_compile_numbers(ctx) -> dict:
    return row_compile(ctx, numbers=True)


def row_compile_flat_numbers(ctx) -> dict:
    return row_compile(ctx, "flat", numbers=True)


def row_compile_packed(ctx) -> dict:
    return row_compile(ctx, "packed")


def row_compile_flat(ctx) -> dict:
    return row_compile(ctx, "flat")


def train_case(device: torch.device, dtype: torch.dtype, tiny: bool, mode: str = "per_param") -> tuple:
    """The training step of the ``train`` rows and of scripts/train_host.py: a GPT-2-small-shaped
    ``bnbf.demo.CharTransformer`` (12 layers, 768 wide, untied head; ``tiny``: 2 layers, 32 wide) on ``device`` in
    ``dtype``, its params as a dict, their 8-bit AdamW state (``mode`` "packed": in a few buffers; "flat": the
    params too, and the dict is the flat buffers), a batch (8x256; tiny 2x16), ``train_step(params, state, x, y,
    lr, i)`` (``grad_and_value`` then ``update_``, returning the loss) and the leaves as views of ``params``."""
    from torch.func import functional_call, grad_and_value

    from bnbf.demo import CharTransformer

    dims = {"vocab": 50257, "dim": 768, "context": 1024, "layers": 12, "heads": 12}
    batch, context = 8, 256
    if tiny:
        dims, batch, context = {"vocab": 97, "dim": 32, "context": 16, "layers": 2, "heads": 2}, 2, 16
    torch.manual_seed(0)
    model = CharTransformer(**dims).to(device, dtype)
    params = {k: v.detach() for k, v in model.named_parameters()}
    spec = bnbf.OptimSpec(rule="adamw")
    views = lambda p: p  # noqa: E731
    if mode == "flat":
        layout = bnbf.flat_layout(params, spec)
        params, views = layout.flatten(params), layout.unflatten
        state = layout.init_state(params)
    else:
        state = bnbf.init_state(params, spec, packed=mode == "packed")
    x = torch.randint(0, dims["vocab"], (batch, context), device=device)
    y = torch.randint(0, dims["vocab"], (batch, context), device=device)

    def loss_fn(p, x, y):
        logits = functional_call(model, views(p), (x,))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    def train_step(params, state, x, y, lr, i):
        grads, loss = grad_and_value(loss_fn)(params, x, y)
        bnbf.update_(params, grads, state, {"lr": lr, "weight_decay": 0.01}, i)
        return loss

    return model, params, state, x, y, loss_fn, train_step, views


def row_train(ctx, mode: str = "per_param") -> dict:
    """A whole training step (forward, backward, ``update_``) of a GPT-2-small-shaped model (:func:`train_case`),
    compiled with ``fullgraph=True`` against the same step eager (lr and step 0-d tensors), and against the eager
    step most users write (``loss.backward()`` on the module, then ``update_``). Bytes: the optimizer step's
    alone, so the % column says nothing here; the note gives the times. ``--smoke``: a tiny model on the CPU."""
    import torch._dynamo
    from torch.func import grad_and_value

    model, params, state, x, y, loss_fn, train_step, views = train_case(
        ctx.device, ctx.dtype, ctx.device.type == "cpu", mode
    )
    batch, context = x.shape
    lr = torch.tensor(1e-4, device=ctx.device)
    t = torch.tensor(1, device=ctx.device)
    compiled = torch.compile(train_step, fullgraph=True)

    def run(step, i: int) -> None:
        lr.fill_(1e-4 * 0.999**i)
        t.fill_(i)
        step(params, state, x, y, lr, t)

    t0 = time.perf_counter()
    for i in range(1, 4):  # compiles here
        run(compiled, i)
    compile_s = time.perf_counter() - t0
    torch._dynamo.utils.counters.clear()
    ms, host = timed(ctx.device, functools.partial(run, compiled), ctx.warmup, ctx.steps, first=4)
    recompiles = sum(torch._dynamo.utils.counters["stats"].values())

    # the same step returning its grads instead of stepping: not a clean baseline (returning 150 grads costs host
    # time of its own; session 15 measured it slower than the step with update_); scripts/train_host.py profiles both
    def grads_only(params, state, x, y, lr, i):
        return grad_and_value(loss_fn)(params, x, y)

    bare = torch.compile(grads_only, fullgraph=True)
    bare_ms, _ = timed(ctx.device, functools.partial(run, bare), 3 + ctx.warmup, ctx.steps)
    eager_ms, eager_host = timed(ctx.device, functools.partial(run, train_step), ctx.warmup, ctx.steps)
    # the eager step most users write: the module's own parameters, loss.backward(), then update_ on the grads
    leaves = dict(model.named_parameters())
    for k, v in views(params).items():
        leaves[k].data = v  # the same tensors: the same state fits them
    # flat: the module's grads are leaves, copied into flat buffers for the step
    flatten = bnbf.flat_layout(leaves, bnbf.OptimSpec(rule="adamw")).flatten if mode == "flat" else (lambda g: g)

    def module_step(i: int) -> None:
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        grads = flatten({k: v.grad for k, v in leaves.items()})
        with torch.no_grad():
            bnbf.update_(params, grads, state, {"lr": 1e-4 * 0.999**i, "weight_decay": 0.01}, i)
        for v in leaves.values():
            v.grad = None

    module_ms, module_host = timed(ctx.device, module_step, ctx.warmup, ctx.steps)
    n = sum(p.numel() for p in leaves.values())
    return {
        "ms": ms,
        "bytes": bs.model_bytes([(k, tuple(p.shape)) for k, p in leaves.items()], ctx.dtype, "8bit"),
        "note": f"{len(params)} param tensors, {n / 1e6:.0f}M params, batch {batch}x{context}: compiled {ms:.3f} ms "
        f"(host {host:.3f}), eager {eager_ms:.3f} ms (host {eager_host:.3f}), compiled/eager {ms / eager_ms:.2f}x; "
        f"eager with the module's parameters and loss.backward() {module_ms:.3f} ms (host {module_host:.3f}), "
        f"compiled/that {ms / module_ms:.2f}x; compiled without update_ (grads returned) {bare_ms:.3f} ms; "
        f"first three calls (compiling) {compile_s:.0f} s; dynamo stats moved by {recompiles} in the timed steps",
    }


def row_train_packed(ctx) -> dict:
    return row_train(ctx, "packed")


def row_train_flat(ctx) -> dict:
    return row_train(ctx, "flat")


def row_compile_torch(ctx) -> dict:
    """torch's own AdamW on the same params: ``torch.compile`` of its step (foreach, capturable, lr a 0-d tensor
    changing every step: torch's recipe for a compiled optimizer with a scheduler) against its eager fused and
    foreach steps. Bytes: torch's fewest (moments in the param dtype)."""
    leaves = _leaves(ctx)
    fused = torch.optim.AdamW(leaves, **HP, fused=True)
    fused_ms = median_ms(ctx.device, lambda i: fused.step(), ctx.warmup, ctx.steps)
    foreach = torch.optim.AdamW(leaves, **HP, foreach=True)
    foreach_ms = median_ms(ctx.device, lambda i: foreach.step(), ctx.warmup, ctx.steps)
    lr = torch.tensor(HP["lr"], device=ctx.device)
    opt = torch.optim.AdamW(leaves, lr=lr, weight_decay=HP["weight_decay"], foreach=True, capturable=True)
    compiled = torch.compile(opt.step)

    def fn(i: int) -> None:
        lr.fill_(HP["lr"] * 0.999**i)
        compiled()

    t0 = time.perf_counter()
    for i in range(1, 4):  # compiles here
        fn(i)
    compile_s = time.perf_counter() - t0
    ms, host = timed(ctx.device, fn, ctx.warmup, ctx.steps, first=4)
    return {
        "ms": ms,
        "bytes": bs.model_bytes(ctx.shapes, ctx.dtype, "param"),
        "note": f"compiled {ms:.3f} ms (host {host:.3f}); eager fused {fused_ms:.3f} ms (compiled/fused "
        f"{ms / fused_ms:.2f}x), eager foreach {foreach_ms:.3f} ms; first three calls (compiling) {compile_s:.0f} s",
    }


def row_compile_nn(ctx) -> dict:
    """The adapter compiled as its users compile torch's optimizers: ``torch.compile(opt.step)``, a scheduler
    stepping lr (a float) after each step; the same optimizer class eager beside it."""
    import torch._dynamo

    import bnbf_nn

    leaves = _leaves(ctx)
    ways = {}
    for name in ("compiled", "eager"):
        opt = bnbf_nn.AdamW8bit(leaves, **HP)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.999**s)
        step = torch.compile(opt.step) if name == "compiled" else opt.step

        def fn(i: int, step=step, sched=sched) -> None:
            step()
            sched.step()

        for i in range(1, 4):  # warm-up: Dynamo's frames (the step itself compiles no graph: numbers only)
            fn(i)
        before = sum(torch._dynamo.utils.counters["stats"].values())
        ms, host = timed(ctx.device, fn, ctx.warmup, ctx.steps, first=4)
        moved = sum(torch._dynamo.utils.counters["stats"].values()) - before
        b2b = _back_to_back(ctx, fn, 10 * ctx.steps, 4 + ctx.warmup + ctx.steps)
        ways[name] = ms, host, b2b, moved, fn
    (ms, host, b2b, moved, fn), (e_ms, e_host, e_b2b, _, _) = ways["compiled"], ways["eager"]
    ran = kernels(ctx.device, lambda: fn(10**4))
    return {
        "ms": ms,
        "bytes": bs.model_bytes(ctx.shapes, ctx.dtype, "8bit"),
        "note": f"eager opt.step {e_ms:.3f} ms (compiled/eager {ms / e_ms:.2f}x); host {host:.3f} ms a call, eager "
        f"{e_host:.3f}; back to back ({10 * ctx.steps} calls) compiled {b2b:.3f} ms, eager {e_b2b:.3f} "
        f"({b2b / e_b2b:.2f}x); {ran}; dynamo stats moved by {moved} in the timed steps",
    }


def row_graph(ctx) -> dict:
    if ctx.device.type != "cuda":
        return {"note": "needs CUDA"}
    params, grads = fresh(ctx.shapes, ctx.dtype, ctx.device)
    state = bnbf.init_state(params, bnbf.OptimSpec(rule="adamw"))
    lr = torch.tensor(1e-3, device=ctx.device)
    wd = torch.tensor(0.01, device=ctx.device)
    step_t = torch.tensor(1, device=ctx.device, dtype=torch.int64)
    hp = {"lr": lr, "weight_decay": wd}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compiles, plans) off the capture
        for _ in range(3):
            bnbf.update_(params, grads, state, hp, step_t)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        bnbf.update_(params, grads, state, hp, step_t)

    def replay(i: int) -> None:
        graph.replay()

    ms = median_ms(ctx.device, replay, ctx.warmup, ctx.steps)
    return {"ms": ms, "bytes": bs.model_bytes(ctx.shapes, ctx.dtype, "8bit")}


def _ensemble(ctx, mode: str, members: int = MEMBERS) -> tuple:
    """``members`` members of the row's set, stacked: params, grads and their state (``mode``: per_param, packed or
    flat: each member's leaves in the flat buffers, members stacked)."""
    stacked = [(name, (members, *shape)) for name, shape in ctx.shapes]
    params, grads = fresh(stacked, ctx.dtype, ctx.device)
    spec = bnbf.OptimSpec(rule="adamw")
    if mode == "flat":
        layout = bnbf.flat_layout({k: v[0] for k, v in params.items()}, spec)
        params, grads = torch.func.vmap(layout.flatten)(params), torch.func.vmap(layout.flatten)(grads)
        return params, grads, torch.func.vmap(layout.init_state)(params)
    return params, grads, torch.func.vmap(lambda p: bnbf.init_state(p, spec, packed=mode == "packed"))(params)


def row_vmap(ctx, mode: str = "per_param") -> dict:
    params, grads, state = _ensemble(ctx, mode)
    spec = bnbf.OptimSpec(rule="adamw")
    marks: list = []  # per call: its start, the vmapped function's entry and return (host clock)

    def body(p, g, s, i):
        marks.append(time.perf_counter())
        out = bnbf.update(p, g, s, HP, i)
        marks.append(time.perf_counter())
        return out

    step = torch.func.vmap(body, in_dims=(0, 0, 0, None))
    holder = {"p": params, "s": state}

    def vmapped(i: int) -> None:
        marks.append(time.perf_counter())
        holder["p"], holder["s"] = step(holder["p"], grads, holder["s"], i)

    for i in range(1, 1 + ctx.warmup):
        vmapped(i)
    builds = _member_builds()
    marks.clear()
    ms, host = timed(ctx.device, vmapped, 0, ctx.steps, first=1 + ctx.warmup)
    builds = _member_builds() - builds
    # torch.func's processing of the inputs before the function runs, and bnbf.update's whole time inside it
    wrap_in = statistics.median(marks[k + 1] - marks[k] for k in range(0, len(marks), 3)) * 1e3
    inside = statistics.median(marks[k + 2] - marks[k + 1] for k in range(0, len(marks), 3)) * 1e3
    ran = kernels(ctx.device, lambda: vmapped(1 + ctx.warmup + ctx.steps))
    # torch.func's own share of the host time: the same vmap of a function that returns its inputs
    ident = torch.func.vmap(lambda p, g, s, i: (p, s), in_dims=(0, 0, 0, None))
    _, ident_host = timed(ctx.device, lambda i: ident(params, grads, state, i), ctx.warmup, ctx.steps)
    # the in-place twin: the stacked tensors stepped where they are (no outputs)
    step_ = torch.func.vmap(lambda p, g, s, i: bnbf.update_(p, g, s, HP, i), in_dims=(0, 0, 0, None))
    in_place_ms, in_place_host = timed(ctx.device, lambda i: step_(params, grads, state, i), ctx.warmup, ctx.steps)
    in_place = f"vmap(update_) {in_place_ms:.3f} ms (host {in_place_host:.3f}"
    if mode != "per_param":  # and the steps back to back, as a loop that never waits runs them
        n = 4 * ctx.steps
        back_to_back = _back_to_back(ctx, vmapped, n, 2 + ctx.warmup + ctx.steps)
        in_place_b2b = _back_to_back(ctx, lambda i: step_(params, grads, state, i), n, 1)
        # a synchronized call's floor where nothing of bnbf's came before its first launch: torch.func's input
        # processing, then the kernels (their time back to back)
        floor = back_to_back + wrap_in
        # the step count in a closure, so that in_dims is one 0 (an int step cannot be batched): torch.func's
        # cheaper broadcast of in_dims over the trees; a new vmap each call, as a loop writing it so would
        holder2 = {"p": params, "s": state}

        def by_closure(i: int) -> None:
            run = torch.func.vmap(lambda p, g, s: bnbf.update(p, g, s, HP, i))
            holder2["p"], holder2["s"] = run(holder2["p"], grads, holder2["s"])

        closure_ms, closure_host = timed(ctx.device, by_closure, ctx.warmup, ctx.steps)
        more = (
            f"back to back (mean of {n} steps, one synchronize) {back_to_back:.3f} ms a step "
            f"({_pct(ctx, back_to_back)} of copy); torch.func's input processing {wrap_in:.3f} ms a call, "
            f"bnbf.update inside {inside:.3f} ms; back to back + input processing {floor:.3f} ms "
            f"({_pct(ctx, floor)} of copy); the step count a closure, in_dims 0: {closure_ms:.3f} ms "
            f"({_pct(ctx, closure_ms)} of copy, host {closure_host:.3f}); {in_place}; back to back "
            f"{in_place_b2b:.3f} ms a step, {_pct(ctx, in_place_b2b)} of copy)"
        )
    else:  # and the loop it replaces: one pure call per member
        members = [{k: v[m] for k, v in params.items()} for m in range(MEMBERS)]
        member_grads = [{k: v[m] for k, v in grads.items()} for m in range(MEMBERS)]
        loop_state = [bnbf.init_state(p, spec) for p in members]

        def loop(i: int) -> None:
            for m in range(MEMBERS):
                members[m], loop_state[m] = bnbf.update(members[m], member_grads[m], loop_state[m], HP, i)

        more = (
            f"{in_place}); loop of {MEMBERS} update calls: {median_ms(ctx.device, loop, ctx.warmup, ctx.steps):.3f} ms"
        )
    where = ""
    if mode == "packed":
        where = f", state in {len(state.buffers)} buffers"
    elif mode == "flat":
        where = f", params in {len(params)} buffers, {len(torch.utils._pytree.tree_leaves(state))} state tensors"
    return {
        "ms": ms,
        "bytes": MEMBERS * bs.model_bytes(ctx.shapes, ctx.dtype, "8bit"),
        "note": f"{MEMBERS} members{where}; host {host:.3f} ms a call, of which torch.func's vmap of the same trees "
        f"{ident_host:.3f} ms; address tables built in the {ctx.steps} timed calls: {builds}; {ran}; {more}",
    }


def row_vmap_graph(ctx) -> dict:
    """``vmap_flat``'s in-place step captured in a CUDA graph (lr and step 0-d device tensors, the step filled before
    each replay), against the same step eager in the same process: the host's time before the launch gone."""
    if ctx.device.type != "cuda":
        return {"note": "needs CUDA"}
    params, grads, state = _ensemble(ctx, "flat")
    lr = torch.tensor(HP["lr"], device=ctx.device)
    step_t = torch.tensor(1, device=ctx.device)
    hp = {"lr": lr, "weight_decay": HP["weight_decay"]}
    step_ = torch.func.vmap(lambda p, g, s, i: bnbf.update_(p, g, s, hp, i), in_dims=(0, 0, 0, None))
    eager = lambda i: step_(params, grads, state, step_t.fill_(i))  # noqa: E731
    eager_ms, eager_host = timed(ctx.device, eager, ctx.warmup, ctx.steps)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the warm-up makes the tables the capture needs
        step_(params, grads, state, step_t)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step_(params, grads, state, step_t)

    def replay(i: int) -> None:
        step_t.fill_(i)
        graph.replay()

    ms = median_ms(ctx.device, replay, ctx.warmup, ctx.steps)
    b2b = _back_to_back(ctx, replay, 4 * ctx.steps, 1)
    return {
        "ms": ms,
        "bytes": MEMBERS * bs.model_bytes(ctx.shapes, ctx.dtype, "8bit"),
        "note": f"{MEMBERS} members, flat; a replay with the step filled first; eager vmap(update_) with the same "
        f"tensors {eager_ms:.3f} ms ({_pct(ctx, eager_ms)} of copy, host {eager_host:.3f}); replays back to back "
        f"{b2b:.3f} ms ({_pct(ctx, b2b)})",
    }


def row_vmap_packed(ctx) -> dict:
    return row_vmap(ctx, "packed")


def row_vmap_flat(ctx) -> dict:
    return row_vmap(ctx, "flat")


def _back_to_back(ctx, fn: Callable[[int], Any], n: int, first: int) -> float:
    """Mean ms a step of ``n`` calls with one synchronize after them all (host work overlaps the device's)."""
    bs.sync(ctx.device)
    t0 = time.perf_counter()
    for i in range(first, first + n):
        fn(i)
    bs.sync(ctx.device)
    return (time.perf_counter() - t0) * 1e3 / n


def _pct(ctx, ms: float, members: int = MEMBERS) -> str:
    """A time's effective bandwidth as a percentage of the run's copy (``members`` models' fewest bytes)."""
    gbs = members * bs.model_bytes(ctx.shapes, ctx.dtype, "8bit") / (ms * 1e-3) / 1e9
    return f"{100 * gbs / ctx.copy:.0f}%" if ctx.copy else "n/a"


def _member_builds() -> int:
    """The vmapped step's table builds so far (bnbf.kernels.members; 0 on the reference path): one per group a
    call where the outputs' addresses do not repeat, none where the allocator hands back the same blocks."""
    try:
        from bnbf.kernels import members
    except ImportError:  # no Triton
        return 0
    return members.BUILDS["group"]


def _leaves(ctx) -> list:
    """Fresh params of the row's set as ``nn.Parameter`` leaves, each with its grad (an optimizer's input)."""
    params, grads = fresh(ctx.shapes, ctx.dtype, ctx.device)
    leaves = []
    for k, p in params.items():
        leaf = torch.nn.Parameter(p)
        leaf.grad = grads[k]
        leaves.append(leaf)
    return leaves


def _optim_ms(ctx, factory) -> float:
    leaves = _leaves(ctx)
    opt = factory(leaves)
    ms = median_ms(ctx.device, lambda i: opt.step(), ctx.warmup, ctx.steps)
    return ms  # the optimizer goes with this frame: the caller measures the memory it leaves


def row_paged(ctx) -> dict:
    import bnbf_nn

    if ctx.device.type != "cuda":
        return {"note": "needs CUDA"}
    plain = _optim_ms(ctx, lambda ps: bnbf_nn.AdamW8bit(ps, **HP))
    bs.free_memory(ctx.device)
    free0 = torch.cuda.mem_get_info()[0]
    paged = _optim_ms(ctx, lambda ps: bnbf_nn.PagedAdamW8bit(ps, **HP))
    bs.free_memory(ctx.device)
    free1 = torch.cuda.mem_get_info()[0]
    note = f"AdamW8bit {plain:.3f} ms, paged/unpaged {paged / plain:.2f}x; free memory after del {free1 - free0:+d} B"
    try:
        import bitsandbytes as bnb

        b_plain = _optim_ms(ctx, lambda ps: bnb.optim.AdamW8bit(ps, **HP))
        b_paged = _optim_ms(ctx, lambda ps: bnb.optim.PagedAdamW8bit(ps, **HP))
        note += f"; bitsandbytes AdamW8bit {b_plain:.3f} ms, PagedAdamW8bit {b_paged:.3f} ms"
    except Exception as e:  # noqa: BLE001 - a peer that fails is a note, not a failed run
        note += f"; bitsandbytes: {type(e).__name__}: {e}"
    return {"ms": paged, "bytes": bs.model_bytes(ctx.shapes, ctx.dtype, "8bit"), "note": note}


def row_mixed(ctx) -> dict:
    params, grads = fresh(ctx.shapes, ctx.dtype, ctx.device)
    emb = lambda path: path.endswith(("wte.weight", "wpe.weight"))
    spec = lambda path, p: bnbf.OptimSpec(rule="lion" if emb(path) else "adamw")
    decay = {"lr": 1e-3, "weight_decay": 0.1}
    no_decay = {"lr": 1e-3, "weight_decay": 0.0}
    lion = {"lr": 1e-4, "weight_decay": 0.1}
    hp = lambda path, p: lion if emb(path) else decay if p.ndim > 1 else no_decay
    state = bnbf.init_state(params, spec)
    # the host time of a call (no synchronize in it): near the step's time, the step waits on the host
    ms, host = timed(ctx.device, lambda i: bnbf.update_(params, grads, state, hp, i), ctx.warmup, ctx.steps)
    # by rule: AdamW's leaves share one set (kernel arguments, no per-tensor rows of scalars)
    by_rule = {"adamw": decay, "lion": lion}
    rule_ms, rule_host = timed(
        ctx.device, lambda i: bnbf.update_(params, grads, state, by_rule, i), ctx.warmup, ctx.steps
    )
    parts = []
    for pick, h in ((lambda k, p: emb(k), lion), (lambda k, p: not emb(k) and p.ndim > 1, decay)):
        keys = [k for k, p in params.items() if pick(k, p)]
        parts.append(([params[k] for k in keys], [grads[k] for k in keys], [state[k] for k in keys], h))
    keys = [k for k, p in params.items() if not emb(k) and p.ndim == 1]
    parts.append(([params[k] for k in keys], [grads[k] for k in keys], [state[k] for k in keys], no_decay))

    def three(i: int) -> None:
        for p, g, s, h in parts:
            bnbf.update_(p, g, s, h, i)

    three_ms, three_host = timed(ctx.device, three, ctx.warmup, ctx.steps)
    lion_shapes = [(k, sh) for k, sh in ctx.shapes if emb(k)]
    adamw_shapes = [(k, sh) for k, sh in ctx.shapes if not emb(k)]
    return {
        "ms": ms,
        "bytes": bs.model_bytes(lion_shapes, ctx.dtype, "8bit", 1) + bs.model_bytes(adamw_shapes, ctx.dtype, "8bit"),
        "note": f"host time of the call {host:.3f} ms; three update_ calls on the same partition: {three_ms:.3f} ms "
        f"(host {three_host:.3f} ms); hparams by rule (no per-leaf decay, no per-tensor scalars) {rule_ms:.3f} ms "
        f"(host {rule_host:.3f} ms)",
    }


def row_clip(ctx) -> dict:
    params, grads = fresh(ctx.shapes, ctx.dtype, ctx.device)
    state = bnbf.init_state(params, bnbf.OptimSpec(rule="adamw"))
    clipped = lambda i: bnbf.update_(params, grads, state, HP, i, max_grad_norm=1.0)
    ms, host_ms = timed(ctx.device, clipped, ctx.warmup, ctx.steps)
    launched = kernels(ctx.device, lambda: clipped(ctx.warmup + ctx.steps + 1))
    plain_ms = median_ms(ctx.device, lambda i: bnbf.update_(params, grads, state, HP, i), ctx.warmup, ctx.steps)
    gs = list(grads.values())
    # clip_grad_norm_ reads each parameter's .grad: leaves holding the grads (a list of the grads themselves
    # would be a list of tensors without .grad, which it skips)
    leaves = []
    for p, g in zip(params.values(), gs):
        leaf = torch.nn.Parameter(p, requires_grad=False)
        leaf.grad = g
        leaves.append(leaf)

    def clip_first(i: int) -> None:  # torch's clipping in place, then the step: what the fused option replaces
        torch.nn.utils.clip_grad_norm_(leaves, 1.0, foreach=True)
        bnbf.update_(params, grads, state, HP, i)

    torch_ms = median_ms(ctx.device, clip_first, ctx.warmup, ctx.steps)
    grad_bytes = sum(g.numel() * g.element_size() for g in gs)
    return {
        "ms": ms,
        "bytes": bs.model_bytes(ctx.shapes, ctx.dtype, "8bit") + grad_bytes,  # the step plus one read of the grads
        "note": f"update_(max_grad_norm=1.0), host {host_ms:.3f} ms of the call, {launched}; unclipped "
        f"{plain_ms:.3f} ms; torch.nn.utils.clip_grad_norm_ (foreach, in place) then update_ {torch_ms:.3f} ms",
    }


class Ctx:
    def __init__(self, device, set_name, shapes, dtype, warmup, steps, copy=0.0):
        self.device, self.set_name, self.shapes, self.dtype = device, set_name, shapes, dtype
        self.warmup, self.steps, self.copy = warmup, steps, copy  # copy: the run's copy bandwidth, GB/s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--sets", default="gpt2_124M")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    sets = bs.SMOKE_SETS if args.smoke else bs.SETS
    if args.smoke:
        args.steps, args.warmup = 2, 1
    copy = bs.copy_bandwidth_gbs(device, 1 << (20 if args.smoke else 30))
    rows = []
    for set_name in args.sets.split(","):
        for dname in args.dtypes.split(","):
            ctx = Ctx(device, set_name, sets[set_name](), bs.DTYPES[dname], args.warmup, args.steps, copy)
            for row in args.rows.split(","):
                try:
                    r = globals()[f"row_{row}"](ctx)
                except Exception as e:  # noqa: BLE001 - a failing row is reported, the others still run
                    traceback.print_exc()
                    r = {"note": f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"}
                bs.free_memory(device)
                if "ms" in r:
                    r["gbs"] = r["bytes"] / (r["ms"] * 1e-3) / 1e9
                    r["copy"] = r["gbs"] / copy
                rows.append({"set": set_name, "dtype": dname, "row": row, **r})
                print(rows[-1], flush=True)
    meta = {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": getattr(sys.modules.get("triton"), "__version__", "n/a"),
        "copy_gbs": copy,
    }
    lines = [
        f"{meta['device']}, torch {meta['torch']}, triton {meta['triton']}, copy {copy:.0f} GB/s",
        "",
        "| set | dtype | row | median ms | GB/s | % copy | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ms = f"{r['ms']:.3f}" if "ms" in r else "-"
        gbs = f"{r['gbs']:.0f}" if "gbs" in r else "-"
        pct = f"{100 * r['copy']:.0f}%" if "copy" in r else "-"
        lines.append(f"| {r['set']} | {r['dtype']} | {r['row']} | {ms} | {gbs} | {pct} | {r.get('note', '')} |")
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

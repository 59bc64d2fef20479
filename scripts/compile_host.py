"""Where the host time of a compiled in-place step goes: ``torch.compile(fullgraph=True)`` of ``bnbf.update_``
on GPT-2 small's 148 tensors (8-bit AdamW, 396 state fields; ``--flat``: in 2 flat buffers), against the eager
call, the kernel launch stubbed out.

    TRITON_INTERPRET=1 python scripts/compile_host.py [--dtype bf16] [--calls 300] [--profile] [--flat] [--numbers]
    python scripts/compile_host.py --cuda        # on a GPU: the same rows (medians), launch stubbed out
    python scripts/compile_host.py --cuda --launch   # the kernels launched (and run): host time with the launch
    python scripts/compile_host.py --nn [--cuda] [--profile]   # bnbf_nn.AdamW8bit: torch.compile(opt.step), eager

On the CPU, ``TRITON_INTERPRET=1`` sends CPU tensors through the custom op's Triton route (address tables,
cached groups) as CUDA tensors go; the launch is stubbed out, so what is timed is host work only. Rows, in
microseconds (the minimum over calls on the CPU, a shared machine; medians on a GPU). lr and step are 0-d tensors;
``--numbers``: Python numbers changing every call (the compiled call's scalars then a host row, read by the op):

- ``eager update_``: the cached plan's step (the bar);
- ``compiled``: the whole compiled call;
- ``guards``: the frame's guard check alone (Dynamo's guard manager over the inputs);
- ``graph``: the compiled graph called directly (AOTAutograd's runtime wrapper, Inductor's code, the op);
- ``graph, the op's step a no-op``: the same without ``bnbf.ops._run`` and ``_run_pair`` (what is left of the op
  is its dispatch and version bumps);
- ``frame``: compiled - guards - graph (Dynamo's frame: the transformed bytecode gathering the inputs);
- ``compiled, no size asserts``: compiled with ``torch._inductor.config.size_asserts = False`` (Inductor
  checks every input's size and stride at each call by default);
- ``floor``: ``torch.compile`` of a no-op in-place custom op taking the same tensors (torch's own cost of a
  graph over these inputs: what bnbf cannot remove).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchmarks.bench_step as bs  # noqa: E402
import bnbf  # noqa: E402
import bnbf.kernels.launcher as launcher  # noqa: E402
from bnbf import ops  # noqa: E402

P = sys.modules["bnbf.plan"]


@torch.library.custom_op("bnbf_compile_host::touch_", mutates_args=("params", "states"))
def touch_(params: list[torch.Tensor], grads: list[torch.Tensor], states: list[torch.Tensor]) -> None:
    """The floor's op: the step's tensors in, nothing done."""


def stub_launches() -> None:
    """No kernel runs: the plans' launch (eager) and the op's (compiled) return at once."""
    nothing = lambda *a, **k: None
    launcher.launch_group = launcher.launch_pair = nothing
    P.launch_group = P.launch_pair = nothing


def host_us(fn, n: int, cuda: bool) -> float:
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    if cuda:
        torch.cuda.synchronize()
    return (statistics.median(times) if cuda else min(times)) * 1e6


def graph_of(fn, call) -> tuple:
    """The compiled graph of ``fn`` (its frame's ``__compiled_fn``) and the arguments one call passes it."""
    names = [k for k in fn.__globals__ if k.startswith("__compiled_fn")]  # two with numbers (see main)
    reals, got = {k: fn.__globals__[k] for k in names}, {}

    def spy(name):
        def called(*a):
            got["fn"], got["args"] = reals[name], a
            return reals[name](*a)

        return called

    for k in names:
        fn.__globals__[k] = spy(k)
    call(3)
    fn.__globals__.update(reals)
    return got["fn"], got["args"]


def nn_rows(args, device: str) -> None:
    """``--nn``: the host time of ``torch.compile(opt.step)`` of ``bnbf_nn.AdamW8bit`` with a ``LambdaLR``
    scheduler, and of the eager ``opt.step()``, on GPT-2's 148 params (bf16, launches stubbed unless --launch)."""
    import bnbf_nn

    shapes = bs.SETS["gpt2_124M"]()
    params = [torch.nn.Parameter(torch.zeros(s, dtype=bs.DTYPES[args.dtype], device=device)) for _, s in shapes]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = bnbf_nn.AdamW8bit(params, lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.999**s)
    step = torch.compile(opt.step)

    def call(i):
        step()
        sched.step()

    for i in range(3):  # compiles (again when the lr first changes)
        call(i)
    eager = bnbf_nn.AdamW8bit(params, lr=1e-3, weight_decay=0.01)
    eager.step()
    print(f"| eager opt.step | {host_us(lambda i: eager.step(), args.calls, args.cuda):.0f} us |")
    print(f"| compiled opt.step, then the scheduler's step | {host_us(call, args.calls, args.cuda):.0f} us |")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for i in range(20):
            call(i)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cuda", action="store_true")
    ap.add_argument("--profile", action="store_true", help="cProfile of the compiled call")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--flat", action="store_true", help="params, grads and state flat (bnbf.flat_layout)")
    ap.add_argument("--numbers", action="store_true", help="lr and step as Python numbers changing every call")
    ap.add_argument("--launch", action="store_true", help="GPU: launch the kernels rather than stub them out")
    ap.add_argument("--nn", action="store_true", help="bnbf_nn.AdamW8bit's step compiled with torch.compile")
    args = ap.parse_args()
    device = "cuda" if args.cuda else "cpu"
    if not args.cuda and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1 on the CPU (the Triton route's host work)")
    if not (args.cuda and args.launch):
        stub_launches()
    if args.nn:
        return nn_rows(args, device)
    params = {n: torch.zeros(s, dtype=bs.DTYPES[args.dtype], device=device) for n, s in bs.SETS["gpt2_124M"]()}
    grads = {n: torch.zeros_like(v) for n, v in params.items()}
    state = bnbf.init_state(params, bnbf.OptimSpec(rule="adamw"))
    if args.flat:
        layout = bnbf.flat_layout(params, bnbf.OptimSpec(rule="adamw"))
        params, grads = layout.flatten(params), layout.flatten(grads)
        state = layout.init_state(params)
    n_state = sum(len(s) for s in state.values())
    launches = "launched" if args.cuda and args.launch else "launch stubbed"
    print(f"{device} torch {torch.__version__}, {len(params)} params, {n_state} fields, {args.dtype}, {launches}")
    lr, t = torch.tensor(1e-3, device=device), torch.tensor(1, device=device)
    rows = {}
    hp = {"lr": 1e-3, "weight_decay": 0.01}
    rows["eager update_"] = host_us(lambda i: bnbf.update_(params, grads, state, hp, i + 1), args.calls, args.cuda)

    def step(params, grads, state, lr, i):
        bnbf.update_(params, grads, state, {"lr": lr, "weight_decay": 0.01}, i)

    compiled = torch.compile(step, fullgraph=True)
    scalars = (lambda i: (1e-3 * 0.999 ** (i % 50), i + 2)) if args.numbers else (lambda i: (lr, t))
    call = lambda i: compiled(params, grads, state, *scalars(i))
    call(0)  # compiles (numbers: again at the first change)
    call(1)
    rows["compiled"] = host_us(call, args.calls, args.cuda)
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    entries = _debug_get_cache_entry_list(step.__code__)  # two with numbers: the first call's and the general one
    f_locals = {"params": params, "grads": grads, "state": state, "lr": scalars(3)[0], "i": scalars(3)[1]}
    (entry,) = [e for e in entries if e.guard_manager.check(f_locals)]
    rows["guards"] = host_us(lambda i: entry.guard_manager.check(f_locals), args.calls, args.cuda)
    graph, graph_args = graph_of(step, call)
    print(f"the graph takes {len(graph_args)} inputs")
    rows["graph"] = host_us(lambda i: graph(*graph_args), args.calls, args.cuda)
    run, run_pair = ops._run, ops._run_pair
    ops._run = ops._run_pair = lambda *a: None
    rows["graph, the op's step a no-op"] = host_us(lambda i: graph(*graph_args), args.calls, args.cuda)
    ops._run, ops._run_pair = run, run_pair
    rows["frame (compiled - guards - graph)"] = rows["compiled"] - rows["guards"] - rows["graph"]

    def step2(params, grads, state, lr, i):  # another code object: a compile of its own
        bnbf.update_(params, grads, state, {"lr": lr, "weight_decay": 0.01}, i)

    unchecked = torch.compile(step2, fullgraph=True, options={"size_asserts": False})
    unchecked(params, grads, state, *scalars(0))
    unchecked(params, grads, state, *scalars(1))
    rows["compiled, no size asserts"] = host_us(
        lambda i: unchecked(params, grads, state, *scalars(i)), args.calls, args.cuda
    )

    def floor(params, grads, state):
        states = [f for s in state.values() for f in s]
        touch_(list(params.values()), list(grads.values()), states)

    floored = torch.compile(floor, fullgraph=True)
    floored(params, grads, state)
    rows["a no-op custom op (torch.library) over the same tensors, compiled"] = host_us(
        lambda i: floored(params, grads, state), args.calls, args.cuda
    )
    for k, v in rows.items():
        print(f"| {k} | {v:.0f} us |")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for i in range(50):
            call(i)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
        prof = cProfile.Profile()  # the eager call beside it
        prof.enable()
        for i in range(50):
            bnbf.update_(params, grads, state, hp, i + 1)
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(20)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as tprof:
            for i in range(20):
                call(i)
        print(tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()

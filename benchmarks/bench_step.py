"""Time one optimizer step: bnbf's fused kernels against torch's fused AdamW and the 8-bit peers.

Usage (from the repository root)::

    python benchmarks/bench_step.py                          # every set, fp32 and bf16, every candidate
    python benchmarks/bench_step.py --quick --json out.json --markdown out.md
    python benchmarks/bench_step.py --sets big_1B --dtypes bf16 --candidates bnbf8,torch
    python benchmarks/bench_step.py --rules all               # every rule in bnbf.RULES
    python benchmarks/bench_step.py --smoke                   # tiny shapes on the CPU, checks the script

Peers (bitsandbytes, torchao, FlashOptim) are used when importable, e.g. with ``PYTHONPATH=.peers/site``
(the peers' wheels unpacked into that ignored folder); a peer that fails prints a note and is skipped.

Method (the peers' published H200 anchor figures were measured this way): params ~N(0, 0.1^2), grads
~N(0, 0.01^2), lr 1e-3, weight decay 0.01; 5 warm-up steps, then the median of 20 timed steps, each between
two CUDA events after a device synchronize (so a step's host-side launch cost counts). "GB/s" is effective
bandwidth: the fewest bytes the step must move (read p and g, write p, read and write every state byte once)
over its time; "% copy" compares it with a device-to-device copy measured in the same run.
benchmarks/README.md gives the byte model. "Step transient" (CUDA only) is the allocator's peak during one more
step less what was allocated before it: the memory a step needs beyond params, grads and state.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import functools
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
import typing
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

try:
    import bnbf
except ImportError:  # run as `python benchmarks/bench_step.py` from a checkout that is not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import bnbf

LR = 1e-3
WEIGHT_DECAY = 0.01
BLOCK = 256  # block size of the byte model (absmax: one float32 per 256 elements per moment)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PEERS = ("bnb", "torchao", "flashoptim")
DEFAULT_CANDIDATES = "bnbf8,bnbf8_*,bnbf_nn,bnbf32,torch,bnb,torchao,flashoptim"


# ---------------------------------------------------------------------------------------------------------
# parameter sets: name -> list of (name, shape)


def gpt2_shapes(vocab: int = 50257, ctx: int = 1024, d: int = 768, layers: int = 12) -> list[tuple]:
    """GPT-2 small's parameters in named_parameters() order (Conv1D weights are (in, out))."""
    shapes = [("transformer.wte.weight", (vocab, d)), ("transformer.wpe.weight", (ctx, d))]
    for i in range(layers):
        h = f"transformer.h.{i}."
        shapes += [
            (h + "ln_1.weight", (d,)),
            (h + "ln_1.bias", (d,)),
            (h + "attn.c_attn.weight", (d, 3 * d)),
            (h + "attn.c_attn.bias", (3 * d,)),
            (h + "attn.c_proj.weight", (d, d)),
            (h + "attn.c_proj.bias", (d,)),
            (h + "ln_2.weight", (d,)),
            (h + "ln_2.bias", (d,)),
            (h + "mlp.c_fc.weight", (d, 4 * d)),
            (h + "mlp.c_fc.bias", (4 * d,)),
            (h + "mlp.c_proj.weight", (4 * d, d)),
            (h + "mlp.c_proj.bias", (d,)),
        ]
    shapes += [("transformer.ln_f.weight", (d,)), ("transformer.ln_f.bias", (d,))]
    return shapes


def llama_shapes(vocab: int = 128256, d: int = 2048, ffn: int = 8192, layers: int = 16, kv: int = 512) -> list[tuple]:
    """Llama-3.2-1B's parameters (1.24B in 146 tensors, tied embedding): a model whose step is the device's, not
    the host's, for the compiled-step rows."""
    shapes = [("model.embed_tokens.weight", (vocab, d))]
    for i in range(layers):
        h = f"model.layers.{i}."
        shapes += [
            (h + "self_attn.q_proj.weight", (d, d)),
            (h + "self_attn.k_proj.weight", (kv, d)),
            (h + "self_attn.v_proj.weight", (kv, d)),
            (h + "self_attn.o_proj.weight", (d, d)),
            (h + "mlp.gate_proj.weight", (ffn, d)),
            (h + "mlp.up_proj.weight", (ffn, d)),
            (h + "mlp.down_proj.weight", (d, ffn)),
            (h + "input_layernorm.weight", (d,)),
            (h + "post_attention_layernorm.weight", (d,)),
        ]
    return shapes + [("model.norm.weight", (d,))]


SETS: dict[str, Callable[[], list[tuple]]] = {
    "single_4096x4096": lambda: [("w", (4096, 4096))],
    "gpt2_124M": gpt2_shapes,
    "big_1B": lambda: [(f"w{i}", (8192, 16384)) for i in range(8)],
    "llama_1B": llama_shapes,
}
DEFAULT_SETS = ("single_4096x4096", "gpt2_124M", "big_1B")  # the anchors' sets; others by name
# --smoke: the same structure, tiny (still above min_8bit_size=4096 where the real set is, so both the
# 8-bit and the small-tensor 32-bit layouts run)
SMOKE_SETS: dict[str, Callable[[], list[tuple]]] = {
    "single_4096x4096": lambda: [("w", (128, 128))],
    "gpt2_124M": lambda: gpt2_shapes(vocab=512, ctx=64, d=64, layers=12),
    "big_1B": lambda: [(f"w{i}", (64, 128)) for i in range(8)],
    "llama_1B": lambda: llama_shapes(vocab=512, d=64, ffn=256, layers=2, kv=16),
}


# ---------------------------------------------------------------------------------------------------------
# timing


class Timer:
    """Per-step timing: CUDA events on a GPU (after a synchronize), perf_counter on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: list[Any] = []
        self.cpu_ms: list[float] = []
        self.host_ms: list[float] = []  # on a GPU: the host time of each timed call, for reference

    def time(self, fn: Callable[[], None]) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            fn()
            self.host_ms.append((time.perf_counter() - t0) * 1e3)
            end.record()
            self.pending.append((start, end))
        else:
            t0 = time.perf_counter()
            fn()
            self.cpu_ms.append((time.perf_counter() - t0) * 1e3)

    def results_ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [s.elapsed_time(e) for s, e in self.pending]
        return self.cpu_ms


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth_gbs(device: torch.device, nbytes: int, reps: int = 10) -> float:
    """Device-to-device copy: (bytes read + bytes written) / median time."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    timer = Timer(device)
    for _ in range(3):
        dst.copy_(src)
    for _ in range(reps):
        timer.time(functools.partial(dst.copy_, src))
    ms = statistics.median(timer.results_ms())
    del src, dst
    free_memory(device)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------
# byte model and state size


def model_bytes(shapes: list[tuple], param_dtype: torch.dtype, kind: str, moments: int = 2) -> int:
    """The fewest bytes one step must move: read p and g, write p, read and write each state byte once.

    kind "8bit": uint8 moments + one float32 absmax per 256 elements per moment;
    "32bit": float32 moments; "param": moments in the param dtype (torch.optim).
    For AdamW (2 moments): 8-bit n*(3s+4) + 16*ceil(n/256); 32-bit n*(3s+16); torch n*(3s+4s).
    """
    s = torch.empty((), dtype=param_dtype).element_size()
    total = 0
    for _, shape in shapes:
        n = math.prod(shape)
        if kind == "8bit":
            total += n * (3 * s + 2 * moments) + 2 * moments * 4 * math.ceil(n / BLOCK)
        elif kind == "32bit":
            total += n * (3 * s + 2 * 4 * moments)
        elif kind == "param":
            total += n * (3 * s + 2 * s * moments)
        else:
            raise ValueError(kind)
    return total


def tensors_in(obj: Any, seen: set[int] | None = None, depth: int = 0) -> Iterable[torch.Tensor]:
    """Every tensor reachable from obj (containers, NamedTuples, plain objects' attributes)."""
    if seen is None:
        seen = set()
    if depth > 8 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor) and hasattr(obj, "__tensor_flatten__"):  # wrapper subclass (torchao)
        for attr in obj.__tensor_flatten__()[0]:
            yield from tensors_in(getattr(obj, attr), seen, depth + 1)
    elif isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_in(v, seen, depth + 1)
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            yield from tensors_in(v, seen, depth + 1)
    elif isinstance(obj, (str, bytes, int, float, bool, type(None), torch.dtype, torch.device)):
        return
    else:
        attrs = getattr(obj, "__dict__", None)
        if attrs:
            yield from tensors_in(dict(attrs), seen, depth + 1)
        for slot in getattr(type(obj), "__slots__", ()):
            if hasattr(obj, slot):
                yield from tensors_in(getattr(obj, slot), seen, depth + 1)


def state_nbytes(state: Any) -> int:
    """Bytes held by the tensors in state, each storage counted once (shared code maps too)."""
    storages: dict[tuple, int] = {}
    for t in tensors_in(state):
        st = t.untyped_storage()
        storages[(t.device.type, st.data_ptr())] = st.nbytes()
    return sum(storages.values())


# ---------------------------------------------------------------------------------------------------------
# candidates: each builds a step() closure over freshly made params and the shared grads


@dataclasses.dataclass
class Candidate:
    name: str
    rule: str
    kind: str  # byte model: "8bit", "32bit", "param"
    make: Callable[[dict, dict], tuple[Callable[[int], None], Callable[[], Any]]]
    # make(params, grads) -> (step(i), get_state())
    note: str = ""


def bnbf_candidate(name: str, rule: str, hparams: Any, **spec_kw: Any) -> Candidate:
    spec = bnbf.OptimSpec(rule=rule, **spec_kw)  # fails here (and is noted) for an unknown format

    def make(params: dict, grads: dict):
        holder = {"state": bnbf.init_state(params, spec, hparams)}

        def step(i: int) -> None:
            _, holder["state"] = bnbf.update_(params, grads, holder["state"], hparams, i)

        return step, lambda: holder["state"]

    kind = "8bit" if spec_kw.get("state_bits", 8) == 8 else "32bit"
    return Candidate(name, rule, kind, make)


def optim_candidate(name: str, rule: str, kind: str, factory: Callable[[list], Any], note: str = "") -> Candidate:
    def make(params: dict, grads: dict):
        ps = []
        for k, p in params.items():
            leaf = torch.nn.Parameter(p, requires_grad=True)  # shares p's storage
            leaf.grad = grads[k]
            ps.append(leaf)
        opt = factory(ps)

        def step(i: int) -> None:
            opt.step()

        return step, lambda: opt.state

    return Candidate(name, rule, kind, make, note)


def state_formats() -> list[str]:
    """The state_format values OptimSpec accepts: its Literal annotation or a published constant."""
    for holder in (bnbf, bnbf.OptimSpec, getattr(bnbf, "state", None)):  # bnbf.state.STATE_FORMATS today
        for attr in ("STATE_FORMATS", "state_formats", "FORMATS"):
            v = getattr(holder, attr, None)
            if v is not None and not callable(v):
                return list(v)
    try:
        hints = typing.get_type_hints(bnbf.OptimSpec)
        args = [a for a in typing.get_args(hints.get("state_format")) if isinstance(a, str)]
        if args:
            return args
    except Exception:  # noqa: BLE001 - unusual annotations: fall back to the default alone
        pass
    default = {f.name: f.default for f in dataclasses.fields(bnbf.OptimSpec)}.get("state_format")
    return [default] if isinstance(default, str) else []


def default_format() -> str | None:
    d = {f.name: f.default for f in dataclasses.fields(bnbf.OptimSpec)}.get("state_format")
    return d if isinstance(d, str) else None


# rules benchmarked with the states they are usually run with (SGD and LARS keep a momentum buffer)
RULE_EXTRA = {"sgd": {"momentum": 0.9}, "lars": {"momentum": 0.9}}


def rule_hparams(rule: str) -> Any:
    if rule == "adamw":
        return {"lr": LR, "weight_decay": WEIGHT_DECAY}
    if rule in RULE_EXTRA:
        return {"lr": LR, **RULE_EXTRA[rule]}
    hp_for = getattr(bnbf, "hparams_for", None)
    if hp_for is None:
        return {"lr": LR}
    try:
        return hp_for(rule)
    except (TypeError, ValueError):
        return hp_for(rule, lr=LR)


def rule_moments(rule: str) -> int:
    """How many param-sized moments the rule keeps with the benchmarked hyperparameters."""
    r = getattr(bnbf, "RULES", {}).get(rule)
    if r is not None and hasattr(r, "slots_present"):
        return sum(r.slots_present(r.make_hparams(rule_hparams(rule))))
    try:
        st = bnbf.init_state(torch.zeros(4096), bnbf.OptimSpec(rule=rule, state_bits=32))
        return max(1, sum(1 for t in tensors_in(st) if t.numel() == 4096))
    except Exception:  # noqa: BLE001
        return 2


def build_candidates(rule: str, device: torch.device, notes: list[str]) -> list[Candidate]:
    hp = rule_hparams(rule)
    out: list[Candidate] = [bnbf_candidate("bnbf8", rule, hp, state_bits=8)]
    default = default_format()
    for fmt in state_formats():
        if fmt == default:
            continue
        try:
            out.append(bnbf_candidate(f"bnbf8_{fmt}", rule, hp, state_bits=8, state_format=fmt))
        except Exception as e:  # noqa: BLE001
            notes.append(f"bnbf8_{fmt} ({rule}): {type(e).__name__}: {e}")
    out.append(bnbf_candidate("bnbf32", rule, hp, state_bits=32))

    fused_ok = device.type == "cuda" or device.type == "cpu"
    torch_cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}.get(rule)
    if torch_cls is not None:
        wd = WEIGHT_DECAY if rule == "adamw" else float(getattr(hp, "weight_decay", 0.0))

        def torch_factory(ps, cls=torch_cls):
            try:
                return cls(ps, lr=LR, weight_decay=wd, fused=fused_ok)
            except (RuntimeError, ValueError):  # fused unsupported for this device/dtype
                return cls(ps, lr=LR, weight_decay=wd, foreach=True)

        out.append(optim_candidate("torch", rule, "param", torch_factory, "fused=True"))
    if rule != "adamw":
        return out

    def bnb_factory(ps):
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(ps, lr=LR, weight_decay=WEIGHT_DECAY)

    def torchao_factory(ps):
        try:
            from torchao.optim import AdamW8bit
        except ImportError:
            from torchao.prototype.low_bit_optim import AdamW8bit
        return AdamW8bit(ps, lr=LR, weight_decay=WEIGHT_DECAY)

    def flash_factory(ps):
        from flashoptim import FlashAdamW

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # master_weight_bits=None with bf16 params warns
            # quantize=True: int8 moments; master_weight_bits=None: no error-correction bytes, so the
            # step moves the same bytes as the other 8-bit candidates
            return FlashAdamW(ps, lr=LR, weight_decay=WEIGHT_DECAY, quantize=True, master_weight_bits=None)

    def adapter_factory(ps):
        import bnbf_nn

        return bnbf_nn.AdamW8bit(ps, lr=LR, weight_decay=WEIGHT_DECAY)

    out += [
        optim_candidate("bnbf_nn", rule, "8bit", adapter_factory, "bnbf_nn.AdamW8bit (adapter over bnbf.update_)"),
        optim_candidate("bnb", rule, "8bit", bnb_factory, "bitsandbytes.optim.AdamW8bit"),
        optim_candidate("torchao", rule, "8bit", torchao_factory, "torchao.optim.AdamW8bit"),
        optim_candidate("flashoptim", rule, "8bit", flash_factory, "FlashAdamW(master_weight_bits=None)"),
    ]
    return out


def peer_versions() -> dict[str, str]:
    out = {}
    for mod in ("bitsandbytes", "torchao", "flashoptim"):
        try:
            m = __import__(mod)
            out[mod] = getattr(m, "__version__", "?")
        except Exception as e:  # noqa: BLE001
            out[mod] = f"unavailable ({type(e).__name__})"
    return out


# ---------------------------------------------------------------------------------------------------------
# running


def make_tensors(shapes: list[tuple], dtype: torch.dtype, device: torch.device, std: float, seed: int) -> dict:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    out = {}
    for name, shape in shapes:
        t = torch.empty(shape, dtype=torch.float32, device=device).normal_(0.0, std, generator=g)
        out[name] = t if dtype == torch.float32 else t.to(dtype)
    return out


def run_one(
    cand: Candidate,
    shapes: list[tuple],
    grads: dict,
    dtype: torch.dtype,
    device: torch.device,
    warmup: int,
    steps: int,
) -> dict:
    params = make_tensors(shapes, dtype, device, 0.1, seed=1)
    step, get_state = cand.make(params, grads)
    timer = Timer(device)
    with torch.no_grad():
        for i in range(1, warmup + 1):
            step(i)
        sync(device)
        for i in range(warmup + 1, warmup + steps + 1):
            timer.time(functools.partial(step, i))
    times = timer.results_ms()
    # memory the step allocates beyond what lives across steps (params, grads, state): one more step,
    # measured from the allocator's peak; None on the CPU (no allocator statistics there)
    transient = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        with torch.no_grad():
            step(warmup + steps + 1)
        torch.cuda.synchronize(device)
        transient = torch.cuda.max_memory_allocated(device) - before
    finite = all(bool(torch.isfinite(p).all()) for p in params.values())
    sbytes = state_nbytes(get_state())
    del step, get_state, params
    free_memory(device)
    host = statistics.median(timer.host_ms) if timer.host_ms else None
    return {
        "ms": statistics.median(times),
        "ms_min": min(times),
        "host_ms": host,
        "state_bytes": sbytes,
        "transient_bytes": transient,
        "finite": finite,
    }


def bench_group(
    cands: list[Candidate],
    shapes: list[tuple],
    set_name: str,
    dname: str,
    rule: str,
    moments: int,
    device: torch.device,
    args: argparse.Namespace,
    meta: dict,
) -> list[dict]:
    """All candidates on one (set, dtype, rule): their rows, then the bnbf_vs_torch row."""
    dtype = DTYPES[dname]
    numel = sum(math.prod(s) for _, s in shapes)
    grads = make_tensors(shapes, dtype, device, 0.01, seed=2)
    torch_ms = None
    group: list[dict] = []
    for cand in cands:
        t0 = time.perf_counter()
        try:
            res = run_one(cand, shapes, grads, dtype, device, args.warmup, args.steps)
        except Exception as e:  # noqa: BLE001 - one failing candidate only prints a note
            msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
            meta["notes"].append(f"{cand.name} on {set_name}/{dname}/{rule}: {type(e).__name__}: {msg}")
            print("note:", meta["notes"][-1], flush=True)
            free_memory(device)
            continue
        nbytes = model_bytes(shapes, dtype, cand.kind, moments)
        gbs = nbytes / (res["ms"] * 1e-3) / 1e9
        row = {
            "set": set_name,
            "dtype": dname,
            "rule": rule,
            "candidate": cand.name,
            "ms": res["ms"],
            "ms_min": res["ms_min"],
            "host_ms": res["host_ms"],
            "gbs": gbs,
            "pct_copy": 100 * gbs / meta["copy_gbs"],
            "model_bytes": nbytes,
            "state_bytes": res["state_bytes"],
            "state_bytes_per_param": res["state_bytes"] / numel,
            "transient_bytes": res["transient_bytes"],
            "numel": numel,
            "byte_model": cand.kind,
            "finite": res["finite"],
            "note": cand.note,
            "vs_torch": None,
            "wall_s": time.perf_counter() - t0,
        }
        if cand.name == "torch":
            torch_ms = res["ms"]
        group.append(row)
        print(
            f"{set_name:>16} {dname:>4} {rule:>6} {cand.name:>14}: {res['ms']:9.3f} ms {gbs:7.0f} GB/s "
            f"{row['pct_copy']:5.1f}% copy {row['state_bytes_per_param']:6.3f} B/p ({row['wall_s']:.1f} s)"
            + (f" transient {res['transient_bytes'] / 2**20:.1f} MiB" if res["transient_bytes"] is not None else "")
            + (f" host {res['host_ms']:.3f} ms" if res["host_ms"] is not None else "")
            + ("" if res["finite"] else "  NON-FINITE PARAMS"),
            flush=True,
        )
    del grads
    free_memory(device)
    if torch_ms is None:
        return group
    for row in group:
        row["vs_torch"] = torch_ms / row["ms"]
    b8 = next((r for r in group if r["candidate"] == "bnbf8"), None)
    if b8 is not None:
        speedup = torch_ms / b8["ms"]
        group.append({"set": set_name, "dtype": dname, "rule": rule, "candidate": "bnbf_vs_torch", "speedup": speedup})
        print(f"{'':>16} {dname:>4} {rule:>6} {'bnbf_vs_torch':>14}: {speedup:.2f}x (torch ms / bnbf8 ms)")
    return group


def fmt_num(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:.3f}" if x < 10 else f"{x:.2f}" if x < 100 else f"{x:.1f}"


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        f"# bnbf step benchmark — {meta['gpu']}"
        + (" (SMOKE: tiny shapes, not a measurement)" if meta["smoke"] else ""),
        "",
        f"torch {meta['torch']}, triton {meta['triton']}, bnbf {meta['bnbf']}, peers {meta['peers']}; "
        f"device copy {meta['copy_gbs']:.0f} GB/s; median of {meta['steps']} steps after {meta['warmup']} "
        f"warm-ups; {meta['date']}.",
        "",
    ]
    results = [r for r in rows if r["candidate"] != "bnbf_vs_torch"]
    cands = list(dict.fromkeys(r["candidate"] for r in results))
    keys = list(dict.fromkeys((r["set"], r["dtype"], r["rule"]) for r in results))
    speed = {(r["set"], r["dtype"], r["rule"]): r["speedup"] for r in rows if r["candidate"] == "bnbf_vs_torch"}
    lines += [
        "Median ms (% of copy bandwidth):",
        "",
        "| set | params | rule | " + " | ".join(cands) + " | bnbf8 vs torch |",
        "|---|---|---|" + "---|" * (len(cands) + 1),
    ]
    for k in keys:
        cells = []
        for c in cands:
            r = next((r for r in results if (r["set"], r["dtype"], r["rule"]) == k and r["candidate"] == c), None)
            cells.append("—" if r is None else f"{fmt_num(r['ms'])} ({r['pct_copy']:.0f}%)")
        sp = speed.get(k)
        lines.append(
            f"| {k[0]} | {k[1]} | {k[2]} | " + " | ".join(cells) + f" | {'—' if sp is None else fmt_num(sp) + '×'} |"
        )
    lines += [
        "",
        "| set | params | rule | candidate | ms | GB/s | % copy | state B/param | step transient MiB | vs torch |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["candidate"] == "bnbf_vs_torch":
            lines.append(
                f"| {r['set']} | {r['dtype']} | {r['rule']} | bnbf_vs_torch | | | | | | **{fmt_num(r['speedup'])}×** |"
            )
            continue
        lines.append(
            f"| {r['set']} | {r['dtype']} | {r['rule']} | {r['candidate']} | {fmt_num(r['ms'])} | "
            f"{r['gbs']:.0f} | {r['pct_copy']:.1f} | {r['state_bytes_per_param']:.3f} | "
            f"{'—' if r.get('transient_bytes') is None else format(r['transient_bytes'] / 2**20, '.1f')} | "
            f"{fmt_num(r['vs_torch'])}{'×' if r['vs_torch'] else ''} |" + ("" if r["finite"] else " NON-FINITE PARAMS")
        )
    if meta["notes"]:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in meta["notes"]]
    return "\n".join(lines) + "\n"


def write_outputs(args: argparse.Namespace, rows: list[dict], meta: dict) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(rows, meta))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sets", default=",".join(DEFAULT_SETS), help="comma-separated: " + ", ".join(SETS))
    p.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: " + ", ".join(DTYPES))
    p.add_argument(
        "--candidates",
        default=None,
        help=f"comma-separated names or globs (default {DEFAULT_CANDIDATES}; "
        "with --quick or --smoke the default leaves out torchao)",
    )
    p.add_argument("--rules", default="adamw", help="comma-separated rule names, or 'all' (bnbf.RULES)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 20; --quick 10; --smoke 2)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 5; --quick 3; --smoke 1)")
    p.add_argument("--json", default=None, help="write rows and metadata here")
    p.add_argument("--markdown", default=None, help="write the tables here")
    p.add_argument("--quick", action="store_true", help="fewer steps, no torchao (compiles per shape)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, 2 steps, on the CPU: checks the script")
    p.add_argument("--device", default=None, help="default: cuda if available (cpu with --smoke)")
    a = p.parse_args(argv)
    a.steps = a.steps or (2 if a.smoke else 10 if a.quick else 20)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.smoke else 3 if a.quick else 5)
    if a.candidates is None:
        a.candidates = DEFAULT_CANDIDATES
        if a.quick or a.smoke:
            a.candidates = a.candidates.replace(",torchao", "")
        if a.smoke:  # the peers need CUDA
            a.candidates = ",".join(c for c in a.candidates.split(",") if c not in PEERS)
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device or ("cpu" if args.smoke or not torch.cuda.is_available() else "cuda"))
    set_defs = SMOKE_SETS if args.smoke else SETS
    set_names = [s for s in args.sets.split(",") if s]
    dtype_names = [d for d in args.dtypes.split(",") if d]
    for s in set_names:
        if s not in set_defs:
            sys.exit(f"unknown set {s!r}; known: {', '.join(set_defs)}")
    for d in dtype_names:
        if d not in DTYPES:
            sys.exit(f"unknown dtype {d!r}; known: {', '.join(DTYPES)}")
    rules = list(getattr(bnbf, "RULES", {"adamw": None})) if args.rules == "all" else args.rules.split(",")
    patterns = [c for c in args.candidates.split(",") if c]
    want_peers = any(fnmatch.fnmatchcase(peer, pat) for peer in PEERS for pat in patterns)

    try:
        import triton

        triton_v = triton.__version__
    except ImportError:
        triton_v = "not installed"
    gpu = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU ({platform.processor() or platform.machine()})"
    )
    meta: dict[str, Any] = {
        "gpu": gpu,
        "device": str(device),
        "torch": torch.__version__,
        "triton": triton_v,
        "bnbf": getattr(bnbf, "__version__", "?"),
        "python": platform.python_version(),
        "peers": ", ".join(f"{k} {v}" for k, v in peer_versions().items()) if want_peers else "not asked",
        "steps": args.steps,
        "warmup": args.warmup,
        "date": time.strftime("%Y-%m-%d"),
        "timing": "cuda events after synchronize" if device.type == "cuda" else "time.perf_counter",
        "smoke": args.smoke,
        "notes": [],
    }
    print(f"GPU: {gpu}\ntorch {meta['torch']}  triton {triton_v}  bnbf {meta['bnbf']}", end="")
    print(f"  python {meta['python']}")
    print(f"peers: {meta['peers']}")
    copy_bytes = (64 << 20) if args.smoke else (2 << 30)
    meta["copy_gbs"] = copy_bandwidth_gbs(device, copy_bytes)
    print(f"device copy: {meta['copy_gbs']:.0f} GB/s (read + written, {copy_bytes >> 20} MiB buffer)")
    print(f"timing: {meta['timing']}, median of {args.steps} after {args.warmup} warm-ups\n", flush=True)

    rows: list[dict] = []
    notes: list[str] = meta["notes"]
    t_start = time.perf_counter()
    try:
        for rule in rules:
            try:
                cands = build_candidates(rule, device, notes)
            except Exception as e:  # noqa: BLE001
                notes.append(f"rule {rule}: {type(e).__name__}: {e}")
                print("note:", notes[-1])
                continue
            cands = [c for c in cands if any(fnmatch.fnmatchcase(c.name, pat) for pat in patterns)]
            moments = rule_moments(rule)
            for set_name in set_names:
                shapes = set_defs[set_name]()
                for dname in dtype_names:
                    rows += bench_group(cands, shapes, set_name, dname, rule, moments, device, args, meta)
                    write_outputs(args, rows, meta)  # after every group: a cut-short run keeps its rows
    except KeyboardInterrupt:
        notes.append(f"interrupted after {time.perf_counter() - t_start:.0f} s: the tables are partial")
        print("\nnote:", notes[-1])
    meta["wall_s"] = time.perf_counter() - t_start
    write_outputs(args, rows, meta)
    print()
    md = markdown(rows, meta)
    # the compact table last: the header, the pivot and the notes
    pivot_end = md.index("| set | params | rule | candidate |")
    print(md[:pivot_end].rstrip())
    if notes:
        print("\nNotes:\n" + "\n".join(f"- {n}" for n in notes))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())

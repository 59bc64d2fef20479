"""Training quality of 8-bit state against 32-bit state, per rule: held-out loss and the largest step.

Usage (from the repository root)::

    python benchmarks/quality.py                     # 4 rules x (32-bit, power, dynamic, 32-bit rerun) x 2 variants
    python benchmarks/quality.py --json q.json --markdown q.md
    python benchmarks/quality.py --rules adamw,lion --spikes off --reruns 3
    python benchmarks/quality.py --smoke             # tiny model, a few steps on the CPU: checks the script

The task (the project's accuracy bar): a byte-level GPT, 4 layers, width 256, 4 heads, context 128 (the
demo's ``CharTransformer``, 3.3M parameters), on the Python standard library's ``.py`` files, subpackages
included (up to 16 MB; every 10th file held out: 9.7 MB + 1.0 MB on the H200 machine's Python 3.12, so the
default run reads each training byte about once). Every run starts from the same weights and sees the same
batches; only the optimizer state differs. Each step: the loss and ``torch.autograd.grad`` of the module's
parameters, global grad-norm clipping to 1.0 in plain torch, then ``bnbf.update_`` (the functional API:
``bnbf.init_state(params, bnbf.OptimSpec(rule=..., state_bits=..., state_format=...))``) with the lr of a
cosine schedule (linear warm-up over the first 5% of the steps, then cosine down to 10% of the peak) passed
as a Python float. On CUDA, matmuls use TF32 (``--no-tf32``: full float32) and the forward and backward are
one CUDA graph (``--no-cuda-graph``: eager), the same for every run.

Reported per (rule, variant, state):

- held-out loss: mean cross-entropy (nats/byte) over 32 fixed batches of held-out windows after the last
  step, and its relative difference from the 32-bit run of the same rule and variant. The bar: an 8-bit
  format is at most 1% worse than 32-bit.
- the noise floor: a "32-bit rerun" (``--reruns``, default 1) repeats the 32-bit run from weights multiplied
  by (1 + 1e-6 N(0, 1)). Training is chaotic, so this alone moves the held-out loss: 0.54% and 0.97% RMS
  over the 8 pairs of two default runs on the H200 (2026-12-01), 1.8-2.6% with lrs at the edge of stability,
  which is why the lrs below sit a little under the best ones found. A row more than 1% worse but by less
  than twice that RMS reads "no (noise)".
- max step / lr: the largest single-element change of any parameter in one step, ``|p_new - p_old|``,
  over the lr of that step, over all steps (and the step where it happened). A quantized state that
  rounds a second moment to zero while the first moment is not shows here as a step of thousands of lrs.
  For LAMB and LARS the trust ratio scales each tensor's step, so compare this column between the formats
  of the same rule only. Measured on the device (a copy of the params before each step, a multi-tensor
  max after it, into a per-step buffer read once at the end), so there is no host sync per step.
- steps/s: steps 2..N (step 1 pays for compilation), clipping, injection and measurement included.

The spike variant (``--spikes``): clipping runs first, then on three fixed steps (25%, 50%, 75% of the run)
a fixed 0.1% of the elements of every tensor (a different random set each time, fixed seeds) are multiplied
by 1e4, 1e3 and 1e4. Injecting after the clipping is deliberate: clipping after it would scale the whole
gradient down by the spikes' norm and hide them from the optimizer. At 0.1% most quantization blocks of
256 consecutive elements that get a spike get exactly one: one element's moments become huge once, which
sets the block's absmax (for exp_avg_sq for hundreds of steps), while its 255 neighbours keep normal,
comparatively tiny moments that must still be represented. The variant also has a rare-element pattern: a
fixed 1% of every tensor's elements get a zero gradient except on every 16th step (before clipping), like
rare tokens sharing a block with frequent ones.

Default run: 1200 steps of batch 64 (the bar's setting), 4 rules x 2 variants x 4 runs = 32 runs. On one
H200 a step is bound by the forward/backward's many small kernels, not the optimizer; eager steps are host-bound,
hence the CUDA graph; ``--amp`` (bf16 autocast) is faster but changes the numerics, so it is off.
If time is short, ``--reruns 0`` saves a quarter and ``--steps 600`` half; 1200 is the bar's setting.

Hyperparameters (peak lr; the same for every format of a rule) are in ``rule_hparams``: AdamW 2e-3,
AdEMAMix 1.5e-3 (alpha and beta3 warmed up over the run, as the paper does), LAMB 1e-2, Lion 5e-4 (weight
decay 0.4: the same lr * wd as AdamW's 2e-3 x 0.1). An lr sweep at 32-bit (1200 steps, on the top-level
files only) put the best held-out loss near AdamW 3e-3, AdEMAMix 2e-3, LAMB 2e-2 and Lion 1e-3, with
2-3x the rerun noise there. ``--lr rule=value,...`` overrides a peak lr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import sysconfig
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

try:
    import bnbf
except ImportError:  # run as `python benchmarks/quality.py` from a checkout that is not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import bnbf
from bnbf.demo import CharTransformer

# format name -> (state_bits, state_format); the 32-bit run ignores the format
FORMATS = {"32": (32, "power"), "power": (8, "power"), "dynamic": (8, "dynamic")}
DEFAULT_RULES = "adamw,ademamix,lamb,lion"
TRUST_RATIO_RULES = ("lamb", "lars")  # their step per lr depends on per-tensor norms
BAR = 0.01  # an 8-bit format may be at most 1% worse than 32-bit on held-out loss

# (fraction of the run, factor): three spikes spread over the run, after clipping
SPIKES = ((0.25, 1e4), (0.50, 1e3), (0.75, 1e4))
SPIKE_FRACTION = 1e-3  # of every tensor's elements, a fresh fixed set per spike
RARE_FRACTION = 1e-2  # of every tensor's elements: zero gradient except every --rare-every steps
RERUN_NOISE = 1e-6  # relative perturbation of the initial weights of a 32-bit rerun


@dataclass(frozen=True)
class Setup:
    """Model and data sizes of one invocation."""

    dim: int = 256
    layers: int = 4
    heads: int = 4
    context: int = 128
    batch: int = 64
    steps: int = 1200
    val_batches: int = 32
    max_bytes: int = 16_000_000
    warmup_frac: float = 0.05
    min_lr_frac: float = 0.1
    clip: float = 1.0
    rare_every: int = 16
    amp: bool = False  # bf16 autocast for the forward and backward (CUDA)


# tokens and head (256 x 16) get 8-bit state: 4096 elements, min_8bit_size
SMOKE = dict(dim=16, layers=1, heads=2, context=16, batch=4, steps=8, val_batches=2, max_bytes=200_000)


def rule_hparams(rule: str, steps: int) -> dict[str, Any]:
    """Peak hyperparameters per rule (torch.optim names); ``lr`` is scaled by the schedule each step."""
    table: dict[str, dict[str, Any]] = {
        "adamw": dict(lr=2e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1),
        "adam": dict(lr=2e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0),
        # alpha and beta3 ramp up over the whole run (the paper's schedulers); a short run needs them
        "ademamix": dict(
            lr=1.5e-3, betas=(0.9, 0.99, 0.999), alpha=5.0, t_alpha=steps, t_beta3=steps, eps=1e-8, weight_decay=0.1
        ),
        # trust ratio: every tensor moves by about lr * ||p|| per step
        "lamb": dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01),
        # sign updates: lr 4x smaller than AdamW's, weight decay 4x larger (the same lr * wd)
        "lion": dict(lr=5e-4, betas=(0.9, 0.99), weight_decay=0.4),
        # the rules below are not part of the bar; their values are plausible, not tuned
        "sgd": dict(lr=0.3, momentum=0.9, weight_decay=0.0),
        "rmsprop": dict(lr=1e-3, alpha=0.99, eps=1e-8, weight_decay=0.0),
        "adagrad": dict(lr=1e-2, eps=1e-10, weight_decay=0.0),
        "lars": dict(lr=5.0, momentum=0.9, weight_decay=0.0, trust_coefficient=1e-3),
    }
    if rule not in table:
        raise ValueError(f"no hyperparameters for rule {rule!r}; known: {', '.join(table)}")
    return dict(table[rule])


def lr_at(step: int, steps: int, peak: float, setup: Setup) -> float:
    """Linear warm-up, then cosine from ``peak`` to ``min_lr_frac * peak``; ``step`` counts from 1."""
    warmup = max(1, round(setup.warmup_frac * steps))
    if step <= warmup:
        return peak * step / warmup
    t = (step - warmup) / max(1, steps - warmup)
    floor = setup.min_lr_frac * peak
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * t))


def spike_steps(steps: int) -> dict[int, float]:
    """Step -> factor; steps of a very short run may coincide (the later factor wins)."""
    return {min(steps, max(1, round(f * steps))): scale for f, scale in SPIKES}


# -------------------------------------------------------------------------------------- data and model


@dataclass
class Data:
    train: Tensor  # uint8 on the device
    val: Tensor
    starts: Tensor  # (steps, batch) int64 on the device: every training batch, fixed by the seed
    val_starts: Tensor  # (val_batches * batch,) int64 on the device
    source: str
    files: int


def stdlib_sources(max_bytes: int) -> tuple[bytes, bytes, str, int]:
    """Training and held-out text: the standard library's ``.py`` files (subpackages included, not
    site-packages) in path order up to ``max_bytes``; every 10th file is held out.

    Recursive, unlike the demo's top-level files: the default run reads about 10M bytes of training
    windows, and with less text than that the held-out loss would measure memorisation.
    """
    root = sysconfig.get_paths()["stdlib"]
    paths: list[str] = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__"))
        paths += [os.path.join(folder, f) for f in sorted(files) if f.endswith(".py")]
    train: list[bytes] = []
    val: list[bytes] = []
    total = used = 0
    for i, path in enumerate(paths):
        with open(path, "rb") as f:
            chunk = f.read(max_bytes - total)
        (val if i % 10 == 9 else train).append(chunk)
        total += len(chunk)
        used = i + 1
        if total >= max_bytes:
            break
    if min(sum(map(len, train)), sum(map(len, val))) < 4096:
        raise RuntimeError(f"found only {total} bytes in {used} Python source files under {root}")
    return b"".join(train), b"".join(val), root, used


def load_data(setup: Setup, device: torch.device, seed: int) -> Data:
    train_b, val_b, root, files = stdlib_sources(setup.max_bytes)
    train = torch.frombuffer(bytearray(train_b), dtype=torch.uint8)
    val = torch.frombuffer(bytearray(val_b), dtype=torch.uint8)
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(train) - setup.context - 1, (setup.steps, setup.batch), generator=gen)
    n = setup.val_batches * setup.batch
    val_starts = torch.linspace(0, len(val) - setup.context - 2, n).long()
    # on the device once: a batch is then a gather there, with no host-to-device copy (and sync) per step
    return Data(train.to(device), val.to(device), starts.to(device), val_starts.to(device), root, files)


def windows(data: Tensor, starts: Tensor, context: int) -> tuple[Tensor, Tensor]:
    idx = starts[:, None] + torch.arange(context + 1, device=starts.device)
    chunk = data[idx].long()
    return chunk[:, :-1], chunk[:, 1:]


def make_model(setup: Setup, seed: int) -> tuple[CharTransformer, dict[str, Tensor]]:
    """The module and its initial weights, the same for every run."""
    torch.manual_seed(seed)
    model = CharTransformer(dim=setup.dim, context=setup.context, layers=setup.layers, heads=setup.heads)
    init = {name: p.detach().clone() for name, p in model.named_parameters()}
    return model, init


class Perturb:
    """The spike variant's gradient changes: rare-element masks (before clipping), spikes (after)."""

    def __init__(self, shapes: list[torch.Size], setup: Setup, device: torch.device, seed: int) -> None:
        self.rare_every = setup.rare_every
        self.masks: list[Tensor] = []
        if self.rare_every > 0:
            gen = torch.Generator().manual_seed(seed + 1000)
            self.masks = [(torch.rand(s, generator=gen) >= RARE_FRACTION).float().to(device) for s in shapes]
        self.spikes: dict[int, tuple[float, list[tuple[int, Tensor]]]] = {}
        for k, (step, scale) in enumerate(sorted(spike_steps(setup.steps).items())):
            gen = torch.Generator().manual_seed(seed + 2000 + k)
            picks = []
            for i, s in enumerate(shapes):
                n = s.numel()
                count = int(n * SPIKE_FRACTION + 0.5)  # tensors under 500 elements get none
                if count:
                    picks.append((i, torch.randperm(n, generator=gen)[:count].to(device)))
            self.spikes[step] = (scale, picks)

    def before_clip(self, grads: list[Tensor], step: int) -> None:
        if self.masks and step % self.rare_every:
            torch._foreach_mul_(grads, self.masks)

    def after_clip(self, grads: list[Tensor], step: int) -> None:
        if step in self.spikes:
            scale, picks = self.spikes[step]
            for i, idx in picks:
                flat = grads[i].view(-1)
                flat.index_copy_(0, idx, flat.index_select(0, idx) * scale)


# -------------------------------------------------------------------------------------- one run


@dataclass
class Row:
    rule: str
    variant: str
    format: str
    held_out_loss: float
    train_loss: float  # mean of the last 5% of steps
    max_step_lr: float  # max over steps and elements of |p_new - p_old| / lr_t
    max_step_at: int
    max_step_lr_off_spikes: float  # the same without the spike steps themselves (the aftermath)
    steps_per_s: float
    seconds: float
    state_bytes: int
    finite: bool
    rerun: int = 0  # > 0: a repeat of the 32-bit run from weights perturbed by RERUN_NOISE (the noise floor)
    rel_vs_32: float | None = None  # filled in once the 32-bit row of the rule and variant exists
    hparams: dict = field(default_factory=dict)


def clip_(grads: list[Tensor], max_norm: float) -> None:
    """Global-norm clipping as torch.nn.utils.clip_grad_norm_ does it, without a host sync."""
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    torch._foreach_mul_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))


class Net:
    """The model's forward and backward, shared by every run.

    The module's own parameters are the params bnbf updates in place; a run starts by copying the initial
    weights into them. With ``graph`` (CUDA) the batch gather, forward, loss and backward are one CUDA graph,
    captured once and replayed every step: at this size an eager step is bound by host launch time.
    """

    def __init__(
        self,
        model: CharTransformer,
        init: dict[str, Tensor],
        data: Data,
        setup: Setup,
        device: torch.device,
        graph: bool,
    ) -> None:
        self.model = model.to(device)
        named = list(model.named_parameters())
        self.params = [p for _, p in named]
        self.init = [init[n].to(device) for n, _ in named]
        self.data, self.setup = data, setup
        self.starts = torch.zeros(setup.batch, dtype=torch.long, device=device)  # this step's windows
        self.graph: torch.cuda.CUDAGraph | None = None
        if graph:
            self.reset()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up iterations before capture, as CUDA graphs require
                for _ in range(3):
                    self._forward_backward()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.loss, self.grads = self._forward_backward()

    def _loss(self, text: Tensor, starts: Tensor) -> Tensor:
        x, y = windows(text, starts, self.setup.context)
        # no autocast cache: a CUDA graph must not keep casts of the weights from its capture
        with torch.autocast(x.device.type, torch.bfloat16, enabled=self.setup.amp, cache_enabled=False):
            logits = self.model(x)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))

    def _forward_backward(self) -> tuple[Tensor, list[Tensor]]:
        loss = self._loss(self.data.train, self.starts)
        return loss.detach(), list(torch.autograd.grad(loss, self.params))

    def reset(self, noise: float = 0.0, seed: int = 0) -> None:
        """The initial weights; ``noise`` > 0 multiplies each by (1 + noise * N(0, 1)) (fixed by ``seed``)."""
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.init)
            if noise:
                gen = torch.Generator().manual_seed(seed)
                for p in self.params:
                    p.mul_(1 + noise * torch.randn(p.shape, generator=gen).to(p.device))

    def forward_backward(self, step: int) -> tuple[Tensor, list[Tensor]]:
        """Loss and gradients of training batch ``step`` (1-based). In graph mode the same tensors every
        step, overwritten by the next call."""
        self.starts.copy_(self.data.starts[step - 1])
        if self.graph is None:
            return self._forward_backward()
        self.graph.replay()
        return self.loss, self.grads

    def held_out(self) -> float:
        with torch.no_grad():
            losses = [self._loss(self.data.val, s) for s in self.data.val_starts.split(self.setup.batch)]
            return torch.stack(losses).mean().item()


def train_one(
    rule: str,
    fmt: str,
    variant: str,
    net: Net,
    setup: Setup,
    hparams: dict[str, Any],
    device: torch.device,
    seed: int,
    rerun: int = 0,
) -> Row:
    net.reset(RERUN_NOISE if rerun else 0.0, seed + 3000 + rerun)
    params = net.params
    bits, state_format = FORMATS[fmt]
    state = bnbf.init_state(params, bnbf.OptimSpec(rule=rule, state_bits=bits, state_format=state_format), hparams)
    perturb = Perturb([p.shape for p in params], setup, device, seed) if variant == "spikes" else None
    steps = setup.steps
    lrs = [lr_at(s, steps, hparams["lr"], setup) for s in range(1, steps + 1)]

    # per-step statistics stay on the device until the end: no host sync inside the loop
    losses = torch.zeros(steps, device=device)
    max_delta = torch.zeros(steps, device=device)
    prev = [torch.empty_like(p) for p in params]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    sync()
    t0 = t1 = time.perf_counter()
    for step in range(1, steps + 1):
        loss, grads = net.forward_backward(step)
        if perturb is not None:
            perturb.before_clip(grads, step)
        clip_(grads, setup.clip)
        if perturb is not None:
            perturb.after_clip(grads, step)
        with torch.no_grad():
            torch._foreach_copy_(prev, params)
            bnbf.update_(params, grads, state, dict(hparams, lr=lrs[step - 1]), step)
            torch._foreach_sub_(prev, params)
            torch.amax(torch.stack(torch._foreach_norm(prev, float("inf"))), dim=0, out=max_delta[step - 1])
            losses[step - 1] = loss
        if step == 1:
            sync()  # step 1 pays for warm-up and kernel compilation: steps/s counts from step 2
            t1 = time.perf_counter()
    sync()
    t_end = time.perf_counter()

    held_out = net.held_out()
    per_lr = (max_delta.cpu().double() / torch.tensor(lrs, dtype=torch.float64)).tolist()
    losses_h = losses.cpu()
    tail = max(1, steps // 20)
    spikes = set(spike_steps(steps)) if variant == "spikes" else set()
    off = [v for s, v in enumerate(per_lr, 1) if s not in spikes]
    finite = bool(torch.isfinite(losses_h).all()) and math.isfinite(held_out) and all(map(math.isfinite, per_lr))
    at = max(range(steps), key=lambda i: per_lr[i] if math.isfinite(per_lr[i]) else math.inf) + 1
    return Row(
        rule=rule,
        variant=variant,
        format=fmt,
        held_out_loss=held_out,
        train_loss=losses_h[-tail:].mean().item(),
        max_step_lr=per_lr[at - 1],
        max_step_at=at,
        max_step_lr_off_spikes=max(off) if off else float("nan"),
        steps_per_s=(steps - 1) / (t_end - t1) if steps > 1 else float("nan"),
        seconds=time.perf_counter() - t0,
        state_bytes=bnbf.state_nbytes(state),
        finite=finite,
        rerun=rerun,
        hparams={k: list(v) if isinstance(v, tuple) else v for k, v in hparams.items()},
    )


# -------------------------------------------------------------------------------------- output


def fnum(x: float | None, spec: str = ".4f") -> str:
    if x is None:
        return "—"
    return format(x, spec) if math.isfinite(x) else str(x)


def state_label(r: Row) -> str:
    if r.format == "32":
        return "32-bit rerun" + (f" {r.rerun}" if r.rerun > 1 else "") if r.rerun else "32-bit"
    return f"8-bit {r.format}"


def noise_rms(rows: list[Row]) -> float | None:
    """RMS of the reruns' relative differences from their 32-bit runs, over every rule and variant."""
    rel = [r.rel_vs_32 for r in rows if r.rerun and r.rel_vs_32 is not None and math.isfinite(r.rel_vs_32)]
    return math.sqrt(sum(x * x for x in rel) / len(rel)) if rel else None


def verdict(r: Row, noise: float | None) -> str:
    """yes: at most 1% worse than 32-bit; no (noise): worse, but by less than twice the reruns' RMS."""
    if r.rel_vs_32 is None or r.rerun:
        return "—"
    if r.finite and r.rel_vs_32 <= BAR:
        return "yes"
    if r.finite and noise is not None and r.rel_vs_32 <= 2 * noise:
        return "no (noise)"
    return "**NO**"


def table(rows: list[Row]) -> str:
    head = (
        "| rule | variant | state | held-out loss | vs 32-bit | within 1% | max step / lr | at step "
        "| max step / lr off spike steps | train loss | steps/s | s |"
    )
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    noise = noise_rms(rows)
    for r in rows:
        rule = r.rule + (" †" if r.rule in TRUST_RATIO_RULES else "")
        rel = "—" if r.rel_vs_32 is None else f"{r.rel_vs_32:+.2%}"
        ok = verdict(r, noise)
        off = fnum(r.max_step_lr_off_spikes, ".3g") if r.variant == "spikes" else "—"
        cells = (
            rule,
            r.variant,
            state_label(r),
            fnum(r.held_out_loss),
            rel,
            ok,
            fnum(r.max_step_lr, ".3g"),
            str(r.max_step_at),
            off,
            fnum(r.train_loss),
            fnum(r.steps_per_s, ".1f"),
            f"{r.seconds:.1f}",
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def noise_text(rows: list[Row]) -> str | None:
    """How far a 32-bit rerun lands from its 32-bit run: the scale below which 8-bit differences mean nothing."""
    rms = noise_rms(rows)
    if rms is None:
        return None
    rel = [abs(r.rel_vs_32) for r in rows if r.rerun and r.rel_vs_32 is not None and math.isfinite(r.rel_vs_32)]
    return (
        f"Noise: a 32-bit rerun (initial weights x (1 + {RERUN_NOISE:g} N(0, 1))) lands {rms:.2%} RMS (at most "
        f"{max(rel):.2%}) from its 32-bit run over {len(rel)} pair(s). Training is chaotic: any perturbation, "
        f"8-bit state included, moves the final loss about this much, so 'no (noise)' marks an 8-bit row more "
        f"than 1% worse but by less than twice this RMS."
    )


def notes_text(meta: dict) -> list[str]:
    s = meta["setup"]
    spikes = ", ".join(f"step {k} x{v:g}" for k, v in meta["spike_steps"].items())
    return [
        f"Model: byte-level GPT, {s['layers']} layers, width {s['dim']}, {s['heads']} heads, context "
        f"{s['context']}, {meta['num_params']:,} params; {s['steps']} steps of batch {s['batch']}; cosine lr "
        f"with {s['warmup_frac']:.0%} warm-up to {s['min_lr_frac']:.0%} of the peak; grad clip {s['clip']}; "
        f"TF32 matmuls: {meta['tf32']}; bf16 autocast: {s['amp']}; CUDA graph: {meta['cuda_graph']}. Text: "
        f"{meta['train_bytes']:,} training and {meta['val_bytes']:,} held-out bytes (every 10th of "
        f"{meta['files']} stdlib .py files); held-out loss over {s['val_batches']} fixed batches.",
        "Hyperparameters (peak lr): " + "; ".join(f"{k} {v}" for k, v in meta["hparams"].items()) + ".",
        f"spikes: clip first, then 0.1% of every tensor's elements x factor at {spikes}; plus 1% of the "
        f"elements with a zero gradient except every {s['rare_every']}th step (before clipping).",
        "vs 32-bit: (loss - 32-bit loss) / 32-bit loss of the same rule and variant; within 1%: at most 1% "
        "worse. max step / lr: the largest |p_new - p_old| of one element in one step over that step's lr.",
        "† LAMB/LARS: the trust ratio scales each tensor's step, so their max step / lr compares only with the "
        "other formats of the same rule.",
    ]


def markdown(rows: list[Row], meta: dict) -> str:
    out = [
        f"# Training quality, 8-bit vs 32-bit state ({meta['date']})",
        "",
        f"GPU: {meta['gpu']}; torch {meta['torch']}, triton {meta['triton']}, bnbf {meta['bnbf']}, "
        f"python {meta['python']}; wall {meta.get('wall_s', 0):.0f} s.",
        "",
    ]
    noise = noise_text(rows)
    out += [n + "\n" for n in notes_text(meta) + meta["notes"] + ([noise] if noise else [])]
    out.append(table(rows))
    return "\n".join(out) + "\n"


def write_outputs(args: argparse.Namespace, rows: list[Row], meta: dict) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(rows, meta))


# -------------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rules", default=DEFAULT_RULES, help=f"comma-separated (default {DEFAULT_RULES})")
    p.add_argument("--formats", default="32,power,dynamic", help="comma-separated: " + ", ".join(FORMATS))
    p.add_argument(
        "--spikes",
        choices=("both", "off", "only"),
        default="both",
        help="both: plain and spike variants (default); off: plain only; only: the spike variant only",
    )
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default 1200; --smoke 8)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default 64; --smoke 4)")
    p.add_argument("--lr", default="", help="peak lr overrides, e.g. 'adamw=1e-3,lion=1e-4'")
    p.add_argument("--rare-every", type=int, default=16, help="spike variant: rare elements' period (0: off)")
    p.add_argument("--seed", type=int, default=0, help="weights, batches and injected elements (default 0)")
    p.add_argument("--device", default=None, help="default: cuda if available (cpu with --smoke)")
    p.add_argument("--reruns", type=int, default=1, help="32-bit reruns per rule and variant (noise floor)")
    p.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=True, help="TF32 matmuls on CUDA")
    p.add_argument("--amp", action="store_true", help="bf16 autocast for the forward and backward (CUDA)")
    p.add_argument(
        "--cuda-graph",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="forward and backward as one CUDA graph (on CUDA; the optimizer step stays eager)",
    )
    p.add_argument("--json", default=None, help="write rows and metadata here")
    p.add_argument("--markdown", default=None, help="write the notes and the table here")
    p.add_argument("--smoke", action="store_true", help="tiny model, a few steps, on the CPU: checks the script")
    a = p.parse_args(argv)
    if "32" not in a.formats.split(","):
        p.error("--formats must include 32 (the baseline of every comparison)")
    for f in a.formats.split(","):
        if f not in FORMATS:
            p.error(f"unknown format {f!r}; known: {', '.join(FORMATS)}")
    if a.steps is not None and a.steps < 1:
        p.error("--steps must be at least 1")
    if a.reruns < 0:
        p.error("--reruns must be at least 0")
    return a


def main(argv: Sequence[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    if args.smoke:
        torch.set_num_threads(1)  # tiny tensors: one thread is several times faster than two under load
    try:
        return _main(args)
    finally:
        torch.set_num_threads(threads)


def _main(args: argparse.Namespace) -> list[Row]:
    device = torch.device(args.device or ("cpu" if args.smoke or not torch.cuda.is_available() else "cuda"))
    base = dict(SMOKE) if args.smoke else {}
    if args.steps is not None:
        base["steps"] = args.steps
    if args.batch is not None:
        base["batch"] = args.batch
    amp = bool(args.amp and device.type == "cuda")
    setup = Setup(**base, rare_every=args.rare_every, amp=amp)
    rules = [r for r in args.rules.split(",") if r]
    formats = ["32"] + [f for f in args.formats.split(",") if f and f != "32"]  # the baseline first
    variants = {"both": ["plain", "spikes"], "off": ["plain"], "only": ["spikes"]}[args.spikes]
    overrides = dict(kv.split("=") for kv in args.lr.split(",") if kv)
    hparams = {r: rule_hparams(r, setup.steps) for r in rules}
    for r, v in overrides.items():
        if r not in hparams:
            sys.exit(f"--lr names rule {r!r}, which is not in --rules")
        hparams[r]["lr"] = float(v)

    tf32 = bool(args.tf32 and device.type == "cuda")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
    try:
        import triton

        triton_v = triton.__version__
    except ImportError:
        triton_v = "not installed"
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.machine()})"
    print(f"GPU: {gpu}\ntorch {torch.__version__}  triton {triton_v}  bnbf {bnbf.__version__}", end="")
    print(f"  python {platform.python_version()}  device {device}", flush=True)

    data = load_data(setup, device, args.seed)
    model, init = make_model(setup, args.seed)
    graph = bool(args.cuda_graph and device.type == "cuda")
    net = Net(model, init, data, setup, device, graph=graph)
    meta: dict[str, Any] = {
        "gpu": gpu,
        "device": str(device),
        "torch": torch.__version__,
        "triton": triton_v,
        "bnbf": bnbf.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        "smoke": args.smoke,
        "seed": args.seed,
        "tf32": tf32,
        "cuda_graph": graph,
        "setup": asdict(setup),
        "num_params": sum(p.numel() for p in init.values()),
        "train_bytes": data.train.numel(),
        "val_bytes": data.val.numel(),
        "files": data.files,
        "source": data.source,
        "spike_steps": spike_steps(setup.steps),
        "hparams": hparams,
        "notes": [],
    }
    for line in notes_text(meta):
        print(line)
    print(flush=True)

    rows: list[Row] = []
    t_start = time.perf_counter()
    try:
        for rule in rules:
            for variant in variants:
                base_row = None
                # the 32-bit baseline first, the reruns (the noise floor) last
                for fmt, rerun in [(f, 0) for f in formats] + [("32", k) for k in range(1, args.reruns + 1)]:
                    row = train_one(rule, fmt, variant, net, setup, hparams[rule], device, args.seed, rerun)
                    if fmt == "32" and not rerun:
                        base_row = row
                    elif base_row is not None:
                        row.rel_vs_32 = (row.held_out_loss - base_row.held_out_loss) / base_row.held_out_loss
                    rows.append(row)
                    rel = "" if row.rel_vs_32 is None else f" ({row.rel_vs_32:+.2%} vs 32-bit)"
                    print(
                        f"{rule:<9} {variant:<6} {state_label(row):<14} held-out {row.held_out_loss:.4f}{rel}  "
                        f"max step/lr {row.max_step_lr:.3g} @{row.max_step_at}  {row.steps_per_s:.1f} steps/s  "
                        f"{row.seconds:.1f} s" + ("" if row.finite else "  NON-FINITE"),
                        flush=True,
                    )
                    if not row.finite:
                        meta["notes"].append(f"{rule} {variant} {fmt}: a loss or a step was not finite")
                    meta["wall_s"] = time.perf_counter() - t_start
                    write_outputs(args, rows, meta)  # after every run: a cut-short call keeps its rows
    except KeyboardInterrupt:  # the GPU check's budget ends with SIGINT
        meta["notes"].append(f"interrupted after {time.perf_counter() - t_start:.0f} s: the table is partial")
        print("\nnote:", meta["notes"][-1])
    meta["wall_s"] = time.perf_counter() - t_start
    write_outputs(args, rows, meta)
    meta["noise"] = noise_text(rows)
    write_outputs(args, rows, meta)
    print(f"\nwall {meta['wall_s']:.1f} s")
    if meta["noise"]:
        print(meta["noise"])
    print()
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()

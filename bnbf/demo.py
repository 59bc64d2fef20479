"""Train a small character-level language model with 8-bit and with 32-bit AdamW, side by side.

Run ``python -m bnbf.demo`` (``--help`` for the options). The text is the Python standard library's own
``.py`` sources, so nothing is downloaded. Both runs start from the same weights and see the same batches;
only the optimizer state differs. The training loop uses the functional API only::

    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    state = bnbf.init_state(params, bnbf.OptimSpec(rule="adamw", state_bits=8))
    grads, loss = torch.func.grad_and_value(loss_fn)(params, x, y)   # loss_fn uses functional_call
    bnbf.update_(params, grads, state, hparams, step)

The demo prints the training loss every few steps, a held-out validation loss at the end, the bytes the
optimizer state takes, and the relative difference between the 8-bit and the 32-bit final losses.
"""

from __future__ import annotations

import argparse
import math
import os
import sysconfig
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value

import bnbf

__all__ = ["CharTransformer", "RunResult", "load_stdlib_text", "main", "train"]

CONTEXT = 64  # characters the model sees
VOCAB = 256  # bytes of the UTF-8 text
HPARAMS = {"lr": 3e-3, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.01}  # AdamW, both runs


def load_stdlib_text(max_bytes: int = 1_500_000) -> tuple[bytes, str]:
    """The first ``max_bytes`` bytes of the standard library's top-level ``.py`` files, in name order."""
    root = sysconfig.get_paths()["stdlib"]
    names = sorted(n for n in os.listdir(root) if n.endswith(".py"))
    chunks: list[bytes] = []
    total = 0
    for name in names:
        with open(os.path.join(root, name), "rb") as f:
            data = f.read()
        chunks.append(data[: max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    if total < 100_000:
        raise RuntimeError(f"found only {total} bytes of Python source under {root}")
    return b"".join(chunks), root


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class CharTransformer(nn.Module):
    """A 2-layer, 96-wide byte-level transformer over a 64-character context (about 280k parameters)."""

    def __init__(
        self, vocab: int = VOCAB, dim: int = 96, context: int = CONTEXT, layers: int = 2, heads: int = 4
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(0.02 * torch.randn(context, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


@dataclass
class RunResult:
    label: str
    state_bits: int
    checkpoints: list[tuple[int, float]]  # (step, mean training loss over the steps since the last one)
    val_loss: float
    state_bytes: int
    num_params: int
    seconds: float  # wall time of the whole run, step 1 (warm-up, kernel compilation) included
    ms_per_step: float  # mean over steps 2..N

    @property
    def final_train_loss(self) -> float:
        return self.checkpoints[-1][1]

    @property
    def bytes_per_param(self) -> float:
        return self.state_bytes / self.num_params


def _batches(data: Tensor, steps: int, batch_size: int, seed: int) -> Tensor:
    """Start offsets of every training batch, fixed by ``seed`` so both runs see the same text."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, len(data) - CONTEXT - 1, (steps, batch_size), generator=gen)


def _window(data: Tensor, starts: Tensor, device: torch.device) -> tuple[Tensor, Tensor]:
    idx = starts[:, None] + torch.arange(CONTEXT + 1)
    chunk = data[idx].to(device=device, dtype=torch.long)
    return chunk[:, :-1], chunk[:, 1:]


def train(
    state_bits: int,
    train_data: Tensor,
    val_data: Tensor,
    *,
    steps: int,
    batch_size: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
    device: torch.device | str = "cpu",
    log_every: int = 50,
    val_batches: int = 8,
    verbose: bool = True,
) -> RunResult:
    """Train a fresh :class:`CharTransformer` (seeded) with bnbf AdamW through the functional API."""
    device = torch.device(device)
    label = f"AdamW {state_bits}-bit"
    torch.manual_seed(seed)
    model = CharTransformer().to(device)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    num_params = sum(p.numel() for p in params.values())

    spec = bnbf.OptimSpec(rule="adamw", state_bits=state_bits)
    state = bnbf.init_state(params, spec)
    hparams = dict(HPARAMS, lr=lr)

    def loss_fn(p: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        logits = functional_call(model, p, (x,))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    grad_fn = grad_and_value(loss_fn)
    starts = _batches(train_data, steps, batch_size, seed)
    checkpoints: list[tuple[int, float]] = []
    window: list[Tensor] = []
    t0 = t1 = t_end = time.perf_counter()
    for step in range(1, steps + 1):
        x, y = _window(train_data, starts[step - 1], device)
        grads, loss = grad_fn(params, x, y)
        bnbf.update_(params, grads, state, hparams, step)
        window.append(loss.detach())
        if step == 1:
            loss.item()  # wait for the device: step 1 pays for warm-up and kernel compilation
            t1 = time.perf_counter()
        if step == 1 or step % log_every == 0 or step == steps:
            mean = torch.stack(window).mean().item()
            window.clear()
            if not math.isfinite(mean):
                raise RuntimeError(f"{label}: training loss became {mean} at step {step}")
            checkpoints.append((step, mean))
            t_end = time.perf_counter()
            if verbose:
                print(
                    f"  {label:<13} step {step:>5}  train loss {mean:.4f}  ({time.perf_counter() - t0:.1f} s)",
                    flush=True,
                )

    # Held-out loss: fixed, evenly spaced windows of the validation text.
    n = val_batches * batch_size
    val_starts = torch.linspace(0, len(val_data) - CONTEXT - 2, n).long()
    with torch.no_grad():
        losses = [loss_fn(params, *_window(val_data, s, device)) for s in val_starts.split(batch_size)]
    ms_per_step = 1000 * (t_end - t1) / max(1, steps - 1)
    val_loss = torch.stack(losses).mean().item()
    return RunResult(
        label,
        state_bits,
        checkpoints,
        val_loss,
        bnbf.state_nbytes(state),
        num_params,
        time.perf_counter() - t0,
        ms_per_step,
    )


def format_table(results: Sequence[RunResult]) -> str:
    header = ("optimizer", "train loss", "val loss", "state bytes", "bytes/param", "ms/step", "seconds")
    rows = [header] + [
        (
            r.label,
            f"{r.final_train_loss:.4f}",
            f"{r.val_loss:.4f}",
            f"{r.state_bytes:,}",
            f"{r.bytes_per_param:.3f}",
            f"{r.ms_per_step:.1f}",
            f"{r.seconds:.1f}",
        )
        for r in results
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bnbf.demo", description=__doc__.split("\n\n")[0])
    # 200 steps: both runs in 21 s on an idle 2-core CPU (8-bit 46 ms, 32-bit 38 ms a step), minutes on a busy one
    p.add_argument("--steps", type=int, default=200, help="training steps per optimizer (default 200)")
    p.add_argument(
        "--device",
        default="auto",
        help="'cpu', 'cuda', 'cuda:1', ... or 'auto' (default: cuda when available, else cpu)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for the weights and the batches (default 0)")
    p.add_argument("--batch-size", type=int, default=32, help="sequences of 64 characters per step")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    p.add_argument("--log-every", type=int, default=None, help="steps between loss prints (default steps/5)")
    p.add_argument("--max-bytes", type=int, default=1_500_000, help="bytes of stdlib source to read")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> list[RunResult]:
    args = _parse_args(argv)
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    log_every = args.log_every or max(1, args.steps // 5)

    text, root = load_stdlib_text(args.max_bytes)
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    split = int(0.9 * len(data))
    train_data, val_data = data[:split], data[split:]
    print(f"bnbf demo: byte-level transformer on {len(data):,} bytes of Python source from {root}")
    print(
        f"  train {len(train_data):,} bytes, validation {len(val_data):,} bytes (the last 10%), "
        f"device {device}, seed {args.seed}, {args.steps} steps of {args.batch_size}x{CONTEXT} characters"
    )

    torch.manual_seed(args.seed)
    model = CharTransformer()
    sizes = [p.numel() for p in model.parameters()]
    min_8bit = bnbf.OptimSpec(rule="adamw", state_bits=8).min_8bit_size
    big = [n for n in sizes if n >= min_8bit]
    print(
        f"  model: {sum(sizes):,} parameters in {len(sizes)} tensors; {len(big)} tensors "
        f"({sum(big) / sum(sizes):.1%} of the parameters) have >= {min_8bit} "
        f"elements and get 8-bit state"
    )

    results = []
    for bits in (8, 32):
        print(f"\nAdamW, {bits}-bit state (bnbf functional API), {dict(HPARAMS, lr=args.lr)}")
        results.append(
            train(
                bits,
                train_data,
                val_data,
                steps=args.steps,
                batch_size=args.batch_size,
                lr=args.lr,
                seed=args.seed,
                device=device,
                log_every=log_every,
            )
        )
        r = results[-1]
        print(
            f"  {r.label:<13} validation loss {r.val_loss:.4f}, optimizer state {r.state_bytes:,} bytes "
            f"({r.bytes_per_param:.3f} bytes/param)"
        )

    r8, r32 = results
    print("\n" + format_table(results))
    print(
        f"\nrelative difference, 8-bit vs 32-bit: train loss "
        f"{(r8.final_train_loss - r32.final_train_loss) / r32.final_train_loss:+.2%}, validation loss "
        f"{(r8.val_loss - r32.val_loss) / r32.val_loss:+.2%}; state memory "
        f"{r8.state_bytes / r32.state_bytes:.1%} of 32-bit"
    )
    return results


if __name__ == "__main__":
    main()

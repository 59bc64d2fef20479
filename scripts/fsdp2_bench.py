"""FSDP2 training of a GPT-2-small-shaped model: torch AdamW vs bnbf AdamW 8-bit (vs torchao's, if installed).

Per optimizer and rank: peak memory, optimizer step time, whole training step time, the loss after a fixed
number of steps, and the optimizer step's bandwidth on the local shards against a device copy of the same
bytes measured in the same run. Prints one JSON line per optimizer (rank 0) with the machine and versions.

    python scripts/fsdp2_bench.py --world 2                    # two GPUs, nccl, GPT-2 small
    python scripts/fsdp2_bench.py --world 2 --device cpu --tiny  # the same on CPU with gloo, tiny model
    torchrun --nproc_per_node 2 scripts/fsdp2_bench.py         # or under torchrun

bnbf's step: ``bnbf`` through a :func:`bnbf.distributed.plan` (checked once), ``bnbf_update_`` through
:func:`bnbf.distributed.update_` (checked every call), ``bnbf_nn`` as ``bnbf_nn.AdamW8bit``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bnbf  # noqa: E402
import bnbf.distributed as bd  # noqa: E402

GPT2_SMALL = dict(vocab=50257, seq=1024, layers=12, dim=768, heads=12)
TINY = dict(vocab=512, seq=32, layers=2, dim=64, heads=4)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """GPT-2's shapes (tied embedding and head), enough for memory and time; not a faithful port."""

    def __init__(self, vocab: int, seq: int, layers: int, dim: int, heads: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        for emb in (self.wte, self.wpe):  # GPT-2's initialisation: logits of order 1 at the start
            nn.init.normal_(emb.weight, std=0.02)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.ln(x) @ self.wte.weight.t()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _copy_gbps(nbytes: int, device: torch.device, reps: int = 10) -> float:
    """A device copy of ``nbytes`` (read + write counted), GB/s."""
    src = torch.empty(max(nbytes // 2, 1), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    _sync(device)
    return 2 * src.numel() * reps / (time.perf_counter() - t) / 1e9


class Optim:
    """One optimizer's step on the FSDP2 params: ``step()`` after backward."""

    def __init__(self, kind: str, model: nn.Module, lr: float):
        self.kind, self.params = kind, dict(model.named_parameters())
        self.hp = {"lr": lr, "weight_decay": 0.01}
        self.t = 0
        if kind == "torch":
            self.opt = torch.optim.AdamW(self.params.values(), lr=lr, weight_decay=0.01, foreach=True)
        elif kind == "torchao":
            from torchao.optim import AdamW8bit

            self.opt = AdamW8bit(self.params.values(), lr=lr, weight_decay=0.01)
        elif kind == "bnbf_nn":
            import bnbf_nn

            self.opt = bnbf_nn.AdamW8bit(self.params.values(), lr=lr, weight_decay=0.01)
        else:
            self.state = bd.init_state(self.params, bnbf.OptimSpec(rule="adamw"), self.hp)
            # "bnbf": a plan checked once, as an optimizer holding its params keeps one; "bnbf_update_": the
            # functional bd.update_, which checks every leaf each call
            self.plan = bd.plan(self.params, self.state) if kind == "bnbf" else None

    def step(self) -> None:
        self.t += 1
        if self.kind in ("torch", "torchao", "bnbf_nn"):
            self.opt.step()
        else:
            grads = {k: p.grad for k, p in self.params.items()}
            if self.plan is not None:
                self.plan.step(grads, self.hp, self.t)
            else:
                bd.update_(self.params, grads, self.state, self.hp, self.t)

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds."""
        if self.kind in ("bnbf", "bnbf_update_"):
            return sum(t.to_local().numel() * t.element_size() for s in self.state.values() for t in s)
        total = 0
        for st in self.opt.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    local = v.to_local() if isinstance(v, DTensor) else v
                    total += local.numel() * local.element_size()
        return total

    def moved_bytes(self) -> int:
        """Bytes an optimizer step reads and writes on this rank: params and states in and out, grads in."""
        p = sum(x.to_local().numel() * x.element_size() for x in self.params.values())
        return 3 * p + 2 * self.state_bytes()


def run(rank: int, world: int, args) -> None:
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=rank, world_size=world)
    from torch.distributed.fsdp import fully_shard

    cfg = TINY if args.tiny else GPT2_SMALL
    kinds = ["torch", "bnbf", "bnbf_update_", "bnbf_nn"] + (["torchao"] if args.torchao else [])
    for kind in kinds:
        torch.manual_seed(0)
        model = GPT(**cfg).to(device=device, dtype=torch.float32)
        for blk in model.blocks:
            fully_shard(blk)
        fully_shard(model)
        opt = Optim(kind, model, args.lr)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        g = torch.Generator(device="cpu").manual_seed(1 + rank)
        opt_times, step_times, losses = [], [], []
        for i in range(args.steps):
            idx = torch.randint(0, cfg["vocab"], (args.batch, cfg["seq"] + 1), generator=g).to(device)
            _sync(device)
            t0 = time.perf_counter()
            logits = model(idx[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, cfg["vocab"]), idx[:, 1:].reshape(-1))
            loss.backward()
            _sync(device)
            t1 = time.perf_counter()
            opt.step()
            _sync(device)
            t2 = time.perf_counter()
            model.zero_grad(set_to_none=True)
            if i >= args.warmup:
                opt_times.append(t2 - t1)
                step_times.append(t2 - t0)
            losses.append(float(loss.detach()))
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        moved = opt.moved_bytes()
        median = lambda xs: sorted(xs)[len(xs) // 2] if xs else float("nan")  # noqa: E731
        opt_s = median(opt_times)
        row = {
            "optimizer": kind,
            "rank": rank,
            "peak_memory_bytes": peak,
            "state_bytes": opt.state_bytes(),
            "optimizer_step_ms": 1e3 * opt_s,
            "train_step_ms": 1e3 * median(step_times),
            "loss_first": losses[0],
            "loss_last": losses[-1],
            "optimizer_gbps": moved / opt_s / 1e9 if opt_s > 0 else None,
            "copy_gbps": _copy_gbps(moved, device),
        }
        row["fraction_of_copy"] = row["optimizer_gbps"] / row["copy_gbps"] if row["optimizer_gbps"] else None
        rows = [None] * world
        dist.all_gather_object(rows, row)
        if rank == 0:
            print(json.dumps({"config": "tiny" if args.tiny else "gpt2-small", "steps": args.steps, "ranks": rows}))
        del opt, model
    if rank == 0:
        print(
            json.dumps(
                {
                    "machine": platform.node(),
                    "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
                    "world": world,
                    "torch": torch.__version__,
                    "bnbf": bnbf.__version__,
                    "python": platform.python_version(),
                }
            )
        )
    dist.destroy_process_group()


def _spawned(rank: int, world: int, port: int, args) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    run(rank, world, args)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2, help="processes to spawn (ignored under torchrun)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (CPU check)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the timings")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--torchao", action="store_true", help="also torchao.optim.AdamW8bit")
    args = ap.parse_args(argv)
    if args.warmup >= args.steps:
        ap.error(f"--warmup ({args.warmup}) must be below --steps ({args.steps})")
    if "RANK" in os.environ:  # torchrun
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_spawned, args=(args.world, port, args), nprocs=args.world)


if __name__ == "__main__":
    main()

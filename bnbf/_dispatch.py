"""Which path runs a tensor: the Triton kernels or the pure-torch reference.

CUDA (and other Triton GPU) tensors always take the Triton kernels. CPU tensors take the pure-torch
reference, except when ``TRITON_INTERPRET=1`` is set: then they go through the Triton kernels in the
interpreter, which is how CI exercises the kernels on machines without a GPU.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import sys
import threading
from typing import Any

import torch

_TRITON_DEVICES = ("cuda", "xpu")

# Threads may step different params at once. Building a group fills the kernels' shared task-list cache
# (bnbf.kernels.launcher._tasks): one build at a time. Triton's interpreter patches triton.language's
# module globals for the length of a launch and restores them after, so two interpreted launches at once
# break each other ("Did you forget to add @triton.jit ?"): one interpreted launch at a time. Compiled
# launches take no lock.
BUILD_LOCK = threading.Lock()
INTERPRETER_LOCK = threading.Lock()
_NO_LOCK = contextlib.nullcontext()


def launch_lock(interpreted: bool) -> Any:
    """What a launch holds: INTERPRETER_LOCK where Triton's interpreter runs it (CPU tensors), else nothing."""
    return INTERPRETER_LOCK if interpreted else _NO_LOCK


# Set by bnbf.distributed around a step of sharded tensors: called with each float tensor of per-tensor norm sums
# (LAMB, LARS, max_unorm) between the pass that computes them and the step that reads them, it sums them across
# the shards in place, so a shard steps with the whole tensor's norms. None: no reduction.
NORM_REDUCE: contextvars.ContextVar = contextvars.ContextVar("bnbf_norm_reduce", default=None)


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """True when Triton kernels run in the interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(t: torch.Tensor) -> bool:
    """Whether ``t`` is processed by the Triton kernels (else by the pure-torch reference)."""
    if t.device.type in _TRITON_DEVICES:
        return True
    return t.device.type == "cpu" and interpreting() and triton_available()


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor (FSDP2's params), without importing torch.distributed.tensor: no DTensor
    exists before that module is imported."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)

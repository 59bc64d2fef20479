"""The direct-launch fast path: after a group's first launch of a configuration through Triton's dispatch,
later steps launch that compiled kernel without it. Triton's JIT dispatch (binding ~30 arguments, computing the
specialization key, a pointer query per tensor) costs more host time than the launch.

Two ways, by ``BNBF_LAUNCH``:

- ``direct`` (the default): the install-time extension's ``launch`` (bnbf/csrc/host_checks.cpp), one
  ``cuLaunchKernel`` with the arguments packed in one buffer at the offsets the driver reports for the kernel;
  where the extension, the driver's parameter query or the kernel's signature does not allow it, as ``triton``;
- ``triton``: the compiled kernel's own C launcher, called with the arguments as it parses them;
- ``jit``: Triton's dispatch for every launch.
"""

from __future__ import annotations

import collections
import os
import struct
from collections.abc import Callable
from typing import Any

import torch
import triton

from bnbf._host_checks import NATIVE

MODE = os.environ.get("BNBF_LAUNCH", "direct")
DIRECT_LAUNCH = MODE != "jit"
NATIVE_LAUNCH = MODE == "direct" and hasattr(NATIVE, "launch")

try:  # what Triton's own dispatch reads the stream with
    from torch._C import _cuda_getCurrentRawStream as _current_stream
except ImportError:  # pragma: no cover

    def _current_stream(index: int) -> int:
        return torch.cuda.current_stream(index).cuda_stream


def launch(
    compiled: dict, device: torch.device, key: Any, grid: tuple, args: tuple, dispatch: Callable[[], Any]
) -> None:
    """Launch one kernel of a group. ``compiled``: the group's cache of direct launchers by configuration
    ``key``. The first launch of a configuration goes through Triton's dispatch (``dispatch()``, which returns
    the compiled kernel); later ones launch that kernel directly with ``args`` (the kernel's arguments in its
    order: pointers as ints, its runtime arguments first, None for the constexprs after them). The pointer
    arguments are 16-byte aligned fresh allocations, as when it was compiled."""
    direct = compiled.get(key)
    if direct is not None and _direct_ok(device):
        pack, n, function, head = direct
        if pack is not None:  # one driver call (threads, shared memory in head)
            NATIVE.launch(function, grid[0], *head, _current_stream(device.index), pack(*args[:n]), device.index)
        else:
            head[0](*grid, _current_stream(device.index), function, *head[1:], *args)
        return
    kernel = dispatch()
    if device.type == "cuda" and DIRECT_LAUNCH and hasattr(kernel, "packed_metadata"):
        compiled[key] = _native(kernel, args) or _triton_launcher(kernel)


def _direct_ok(device: torch.device) -> bool:
    """A direct launch needs the group's device to be current (as Triton's dispatch assumes) and no
    launch hooks (profilers such as Proton install them)."""
    rt = triton.knobs.runtime
    return device.index == torch.cuda.current_device() and _idle(rt.launch_enter_hook) and _idle(rt.launch_exit_hook)


def _idle(hook) -> bool:
    return hook is None or getattr(hook, "calls", True) == []  # Triton 3.6 keeps an empty HookChain


def _no_extras(kernel) -> bool:
    """The kernel launches as a plain grid: one CTA per cluster, not cooperative, no PDL, no scratch memory."""
    return _extras(kernel) is None


def _extras(kernel) -> str | None:
    """What keeps the kernel from launching as a plain grid, or None."""
    launcher = kernel.run
    meta = tuple(kernel.packed_metadata)  # (num_warps, num_ctas, shared[, cluster x, y, z]) by Triton's version
    if len(meta) not in (3, 6) or meta[1] != 1 or meta[3:] not in ((), (1, 1, 1)):
        return f"packed metadata {meta}"
    for name, plain in (("launch_cooperative_grid", False), ("launch_pdl", False)):
        if getattr(launcher, name, plain) != plain:
            return name
    for name in ("global_scratch_size", "profile_scratch_size"):
        if getattr(launcher, name, 0) != 0:
            return name
    return None


def _triton_launcher(kernel) -> tuple:
    """(None, 0, CUfunction, (launch function, the arguments before the kernel's own)) of a compiled kernel: the
    launcher's C function itself where the kernel launches as a plain grid (Triton 3.6's Python wrapper around it
    only allocates scratch), else the wrapper."""
    launcher = kernel.run
    meta = (kernel.packed_metadata, None, None, None)  # then launch metadata and enter/exit hooks: none
    c_launch = getattr(launcher, "launch", None)
    if c_launch is not None and _no_extras(kernel):
        # cooperative grid, PDL, global and profile scratch (none), then what the wrapper passes on
        return (
            None,
            0,
            kernel.function,
            (c_launch, launcher.launch_cooperative_grid, launcher.launch_pdl, None, None, *meta),
        )
    return None, 0, kernel.function, (launcher, *meta)


# Triton's argument types -> (struct code, bytes): the kernels' runtime arguments are these
_CODES = {"i32": ("i", 4), "u32": ("I", 4), "i64": ("q", 8), "u64": ("Q", 8), "fp32": ("f", 4), "fp64": ("d", 8)}


def _native(kernel, args: tuple) -> tuple | None:
    """(pack, n, CUfunction, (threads, shared memory)) for the extension's one-call launch, where ``pack(*args[:n])``
    is the kernel's parameter buffer: its runtime arguments (the first ``n`` of ``args``, as Triton's signature of
    the compiled kernel has them) at the offsets and sizes the driver reports, each checked against the type
    Triton compiled it for, and the trailing scratch pointers Triton appends left 0 (the kernel has none). None
    where anything does not match (the reason counted in :data:`REFUSED`): Triton's launcher then serves."""
    if not NATIVE_LAUNCH:
        return None
    made = _packer(kernel, args)
    if isinstance(made, str):
        REFUSED[made] += 1
        return None
    return made


REFUSED: collections.Counter = collections.Counter()  # why a kernel took Triton's launcher, not the extension's


def _packer(kernel, args: tuple) -> tuple | str:
    extras = _extras(kernel)
    if extras is not None:
        return extras
    signature = getattr(getattr(kernel, "src", None), "signature", None)
    layout = NATIVE.param_layout(kernel.function)
    if not isinstance(signature, dict) or len(signature) != len(args):
        return f"signature of {len(signature) if isinstance(signature, dict) else signature} for {len(args)} args"
    if not layout:
        return "the driver gave no parameter layout"
    types = list(signature.values())
    n = sum(t != "constexpr" for t in types)
    # runtime arguments first, constexprs (None) after them: a runtime argument Triton specialized (an int equal
    # to 1 becomes a constant) changes the layout, and the launch stays Triton's
    if any(t == "constexpr" for t in types[:n]) or any(a is not None for a in args[n:]):
        return "runtime arguments not first"
    extra = layout[n:]  # global and profile scratch pointers
    if len(layout) < n or len(extra) > 2 or any(size != 8 for _, size in extra):
        return f"{len(layout)} parameters for {n} runtime arguments"
    fmt, at = ["<"], 0
    for t, a, (offset, size) in zip(types[:n], args[:n], layout[:n]):
        code, want = ("Q", 8) if t.startswith("*") else _CODES.get(t, (None, 0))
        is_int = isinstance(a, int) and not isinstance(a, bool)
        if code is None or size != want or offset < at or not (is_int or (isinstance(a, float) and code in "fd")):
            return f"argument of type {t} ({type(a).__name__}) at offset {offset}, {size} bytes"
        fmt.append("x" * (offset - at) + code)
        at = offset + size
    for offset, size in extra:  # null pointers: struct's pad bytes are zeros
        if offset < at:
            return "scratch pointers overlap"
        fmt.append("x" * (offset + size - at))
        at = offset + size
    meta = kernel.packed_metadata
    return struct.Struct("".join(fmt)).pack, n, kernel.function, (32 * meta[0], meta[2])

"""The direct-launch fast path: after a group's first launch of a configuration through Triton's dispatch,
later steps call that compiled kernel's launcher directly. Triton's JIT dispatch (binding ~30 arguments,
computing the specialization key, a pointer query per tensor) costs more host time than the launch.
``BNBF_LAUNCH=jit`` keeps Triton's dispatch for every launch.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import triton

DIRECT_LAUNCH = os.environ.get("BNBF_LAUNCH", "direct") != "jit"

try:  # what Triton's own dispatch reads the stream with
    from torch._C import _cuda_getCurrentRawStream as _current_stream
except ImportError:  # pragma: no cover

    def _current_stream(index: int) -> int:
        return torch.cuda.current_stream(index).cuda_stream


# the group's tensors are on CUDA, so CUDA is initialised: torch.cuda.current_device's lazy-init check is not needed
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def launch(
    compiled: dict, device: torch.device, key: Any, grid: tuple, args: tuple, dispatch: Callable[[], Any]
) -> None:
    """Launch one kernel of a group. ``compiled``: the group's cache of direct launchers by configuration
    ``key``. The first launch of a configuration goes through Triton's dispatch (``dispatch()``, which returns
    the compiled kernel); later ones call that kernel's launcher directly with ``args`` (the kernel's arguments
    as the launcher takes them: pointers as ints, None for constexprs). The pointer arguments are 16-byte
    aligned fresh allocations, as when it was compiled."""
    direct = compiled.get(key)
    if direct is not None and _direct_ok(device):
        launch_c, function, head = direct
        launch_c(*grid, _current_stream(device.index), function, *head, *args)
        return
    kernel = dispatch()
    if device.type == "cuda" and DIRECT_LAUNCH and hasattr(kernel, "packed_metadata"):
        compiled[key] = _direct_launcher(kernel)


def _direct_ok(device: torch.device) -> bool:
    """A direct launch needs the group's device to be current (as Triton's dispatch assumes) and no
    launch hooks (profilers such as Proton install them)."""
    rt = triton.knobs.runtime
    return device.index == _current_device() and _idle(rt.launch_enter_hook) and _idle(rt.launch_exit_hook)


def _idle(hook) -> bool:
    return hook is None or getattr(hook, "calls", True) == []  # Triton 3.6 keeps an empty HookChain


def _direct_launcher(kernel) -> tuple:
    """(launch function, CUfunction, the arguments before the kernel's own) of a compiled kernel: the
    launcher's C function itself where the kernel needs no scratch memory (Triton 3.6's Python wrapper
    around it only allocates scratch), else the wrapper."""
    launcher = kernel.run
    meta = (kernel.packed_metadata, None, None, None)  # then launch metadata and enter/exit hooks: none
    c_launch = getattr(launcher, "launch", None)
    if (
        c_launch is not None
        and getattr(launcher, "global_scratch_size", 1) == 0
        and getattr(launcher, "profile_scratch_size", 1) == 0
    ):
        # cooperative grid, PDL, global and profile scratch (none), then what the wrapper passes on
        return c_launch, kernel.function, (launcher.launch_cooperative_grid, launcher.launch_pdl, None, None, *meta)
    return launcher, kernel.function, meta

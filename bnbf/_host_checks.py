"""The per-step checks of an in-place call over whole lists of tensors: compiled where possible.

An in-place step on a cached plan must still confirm, every call, that the params and states are the
planned objects with their planned storage and that each grad is a dense, contiguous tensor of its
param's shape, dtype and device. Done with Python attribute reads this is most of a step's host time for
a model with many tensors, and the GPU waits for it before the first launch: for GPT-2's 148 tensors
``update_`` took 137-261 us of the H200 machine's host with these checks in Python and 47-87 us with them
compiled (scripts/host_breakdown.py, five calls). ``csrc/host_checks.cpp`` answers the same questions in
C++; the adapters' step reads its grads and writes its step counts through it too (:func:`grads_of`,
:func:`set_each`).

It is compiled on first use by the machine's C++ compiler (``$CXX``, else ``c++``, ``g++`` or
``clang++``) against the installed torch's headers, into a cache directory
(``$BNBF_CACHE_DIR``, else ``~/.cache/bnbf``) keyed by the source and the torch and Python versions; a
file lock lets parallel processes share one build. Where it cannot be built or loaded (no compiler, no
headers, ``BNBF_NATIVE=0``), the pure-Python twins below give the same answers, only slower;
:func:`status` says which one runs and why.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.machinery
import importlib.util
import itertools
import operator
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

_SOURCE = Path(__file__).parent / "csrc" / "host_checks.cpp"
_MODULE = "bnbf_host_checks"  # the name its PyInit_ function carries
_BUILD_TIMEOUT_S = 600

_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")
_DEVICE = operator.attrgetter("device")
_LAYOUT = operator.attrgetter("layout")
_GRAD = operator.attrgetter("grad")


# ---------------------------------------------------------------------------------------------------------
# the pure-Python twins (the reference for the compiled functions, and the fallback)


def _is_plain(t: object) -> bool:
    return type(t) is Tensor or type(t) is torch.nn.Parameter


def py_grads_match(params: list, grads: list | tuple) -> bool:
    """Each grad a plain, dense, contiguous tensor with its param's shape, dtype and device."""
    if not isinstance(params, list) or not all(map(isinstance, params, itertools.repeat(Tensor))):
        return False
    return py_grads_matcher(params)(grads)


def py_ptrs_equal(tensors: list | tuple, ptrs: tuple) -> bool:
    """``tensors[i].data_ptr() == ptrs[i]`` for every i (tensors of any Tensor subclass)."""
    if not isinstance(tensors, list | tuple) or not isinstance(ptrs, tuple) or len(tensors) != len(ptrs):
        return False
    try:
        return tuple(map(Tensor.data_ptr, tensors)) == ptrs
    except (TypeError, RuntimeError):  # not a Tensor, or one without storage
        return False


def py_states_match(states: list | tuple, types: tuple, ptrs: tuple, ptrs_equal: Callable | None = None) -> bool:
    """``type(states[i]) is types[i]`` for every i (state classes: NamedTuples of tensors) and the states'
    fields, in order, at the data pointers ``ptrs`` (one int a field), compared by ``ptrs_equal``
    (:func:`py_ptrs_equal` by default)."""
    if not isinstance(states, list | tuple) or not isinstance(types, tuple) or tuple(map(type, states)) != types:
        return False
    return (ptrs_equal or py_ptrs_equal)(list(itertools.chain.from_iterable(states)), ptrs)


def py_grads_of(params: list | tuple) -> tuple[list, bool]:
    """Each param's ``.grad`` (None where it has none), and whether every param has one."""
    if not isinstance(params, list | tuple):
        raise TypeError("grads_of expects a list or tuple of params")
    grads = list(map(_GRAD, params))
    return grads, all(map(operator.is_not, grads, itertools.repeat(None)))


def py_set_each(objs: list | tuple, key: Any, value: Any) -> None:
    """``obj[key] = value`` for every obj."""
    if not isinstance(objs, list | tuple):
        raise TypeError("set_each expects a list or tuple")
    for obj in objs:
        obj[key] = value


PYTHON = types.SimpleNamespace(
    grads_match=py_grads_match, ptrs_equal=py_ptrs_equal, grads_of=py_grads_of,
    set_each=py_set_each, states_match=py_states_match,
)


def py_grads_matcher(params: list) -> Callable[[list | tuple], bool]:
    """:func:`py_grads_match` against fixed params, their metadata read once (the fallback's hot path)."""
    params = list(params)
    shapes, dtypes, devices = list(map(_SHAPE, params)), list(map(_DTYPE, params)), list(map(_DEVICE, params))
    n = len(params)

    def match(grads: list | tuple) -> bool:
        if not isinstance(grads, list | tuple) or len(grads) != n or not all(map(_is_plain, grads)):
            return False
        return (
            list(map(_SHAPE, grads)) == shapes
            and list(map(_DTYPE, grads)) == dtypes
            and list(map(_DEVICE, grads)) == devices
            and all(map(operator.is_, map(_LAYOUT, grads), itertools.repeat(torch.strided)))
            and all(map(Tensor.is_contiguous, grads))
        )

    return match


# ---------------------------------------------------------------------------------------------------------
# building and loading the compiled module


def _cache_dir() -> Path:
    if os.environ.get("BNBF_CACHE_DIR"):
        return Path(os.environ["BNBF_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "bnbf"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


_STANDARDS = ("-std=c++20", "-std=c++17")  # torch's extensions use C++20 from torch 2.12 on; older: C++17


def _build_command(cxx: str, out: Path, std: str) -> list[str]:
    torch_dir = Path(torch.__file__).parent
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    return [
        cxx, "-O2", "-shared", "-fPIC", std, "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{torch_dir / 'include'}", f"-I{torch_dir / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
        f"-I{sysconfig.get_paths()['include']}", str(_SOURCE), "-o", str(out),
        f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python",
        f"-Wl,-rpath,{torch_dir / 'lib'}",
    ]  # fmt: skip


def _target(cxx: str) -> Path:
    key = hashlib.sha256()
    key.update(_SOURCE.read_bytes())
    for part in (torch.__version__, str(Path(torch.__file__).parent), sys.version, cxx, *_STANDARDS):
        key.update(part.encode())
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return _cache_dir() / f"host_checks_{key.hexdigest()[:20]}{suffix}"


def _build(cxx: str, target: Path) -> None:
    """Compile into ``target`` once: under a file lock, written to a temporary name and renamed."""
    import fcntl  # POSIX only; elsewhere the import fails and the Python twins run

    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if target.exists():  # another process built it while this one waited
                return
            fd, tmp = tempfile.mkstemp(suffix=target.suffix, dir=target.parent)
            os.close(fd)
            try:
                for std in _STANDARDS:  # the first standard the compiler and torch's headers accept
                    proc = subprocess.run(
                        _build_command(cxx, Path(tmp), std), capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S
                    )
                    if proc.returncode == 0:
                        break
                else:
                    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                    raise RuntimeError(f"{cxx} exited with {proc.returncode}: " + " | ".join(tail))
                os.replace(tmp, target)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _load() -> tuple[types.ModuleType | types.SimpleNamespace, str]:
    if os.environ.get("BNBF_NATIVE", "1") == "0":
        return PYTHON, "python (BNBF_NATIVE=0)"
    cxx = _compiler()
    if cxx is None:
        return PYTHON, "python (no C++ compiler found: set CXX)"
    try:
        target = _target(cxx)
        if not target.exists():
            _build(cxx, target)
        loader = importlib.machinery.ExtensionFileLoader(_MODULE, str(target))
        spec = importlib.util.spec_from_file_location(_MODULE, target, loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - any failure leaves the Python twins in place, with the reason
        return PYTHON, f"python (native build or load failed: {type(e).__name__}: {str(e)[:300]})"
    return module, f"native ({target})"


_IMPL: tuple | None = None


def impl() -> types.ModuleType | types.SimpleNamespace:
    """The module answering the checks: the compiled one (built on first call) or :data:`PYTHON`."""
    global _IMPL
    if _IMPL is None:
        _IMPL = _load()
    return _IMPL[0]


def status() -> str:
    """Which implementation runs, and why (building it first if needed)."""
    impl()
    return _IMPL[1]


def grads_matcher(params: list) -> Callable[[list | tuple], bool]:
    """A function telling whether a list of grads fits ``params`` (see :func:`py_grads_match`)."""
    host = impl()
    if host is PYTHON:
        return py_grads_matcher(params)
    return functools.partial(host.grads_match, list(params))


def states_matcher() -> Callable[[list | tuple, tuple, tuple], bool]:
    """:func:`py_states_match`: compiled where the module has it, else its Python form with the compiled
    ``ptrs_equal`` where there is one."""
    host = impl()
    if hasattr(host, "states_match"):
        return host.states_match
    return functools.partial(py_states_match, ptrs_equal=host.ptrs_equal)


_TORCH_FUNCTION_MODE = torch._C._is_torch_function_mode_enabled


def grads_of(params: list | tuple) -> tuple[list, bool]:
    """Each param's ``.grad`` (None where it has none), and whether every param has one (see
    :func:`py_grads_of`). Under a torch function mode, which sees every ``.grad`` read, read in Python."""
    return (PYTHON if _TORCH_FUNCTION_MODE() else impl()).grads_of(params)


def set_each(objs: list | tuple, key: Any, value: Any) -> None:
    """``obj[key] = value`` for every obj (see :func:`py_set_each`)."""
    impl().set_each(objs, key, value)

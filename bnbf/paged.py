"""Paged optimizer state: CUDA managed (unified) memory through the CUDA driver API.

A paged state (``OptimSpec(paged=True)``) lives in memory from ``cuMemAllocManaged``. The kernels read it
through the same pointers as any CUDA tensor; the driver pages it between host and device, so the state may
exceed the free GPU memory. :func:`prefetch` asks the driver to bring it to the GPU ahead of a step
(asynchronous, on the current stream) when it may have been paged out.

Layout. States are carved, 256-byte aligned, from *chunks*: managed allocations shared by the states
allocated one after another (an optimizer's first step allocates all of its states in a row), so that one
prefetch call covers a whole chunk's states instead of one call per tensor (with a call per tensor, GPT-2's
paged step took 2.35-2.85x the unpaged one on the H200). A chunk is a bump arena: it reserves more than it
was asked for (managed pages take memory only when first touched) and is freed as a whole, with
``cuMemFree``, when the last tensor carved from it dies. A burst of allocations ends at the next
:func:`ranges_of` or :func:`prefetch` (a plan was built, a step runs): later states (a checkpoint loaded,
another optimizer) start a new chunk, so that dropping either set frees its own chunk. Each field is a
storage of its own over its bytes, so ``torch.save`` of one state writes only that state's bytes. (The
driver keeps a few MiB of GPU memory for Unified Memory from a process's first managed allocation on; every
byte bnbf allocates is returned: tests/test_paged.py measures both.)

Prefetching. Managed pages leave the GPU only when its memory runs out (or the CPU touches them, which
bnbf never does). So :func:`prefetch` asks the GPU's free memory (``cudaMemGetInfo``, at most every 50 ms)
and calls the driver only where the GPU is within :data:`PREFETCH_HEADROOM` of full (pages may have been
evicted) or the ranges were never prefetched, and only when they fit: with the state resident and memory to
spare, a step makes no driver call at all.

As in bitsandbytes, only the state of tensors of at least :data:`PAGED_MIN_NUMEL` elements is paged: smaller
ones are not worth the paging. On the CPU ``paged`` changes nothing.

    >>> import torch, bnbf
    >>> p = torch.zeros(1 << 20, device="cuda")  # doctest: +SKIP
    >>> s = bnbf.init_state(p, bnbf.OptimSpec(rule="adamw", paged=True))  # doctest: +SKIP
    >>> bnbf.paged.is_managed(s.exp_avg)  # doctest: +SKIP
    True
"""

from __future__ import annotations

import ctypes
import itertools
import math
import sys
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = [
    "PAGED_MIN_NUMEL",
    "PREFETCH_HEADROOM",
    "Arena",
    "Range",
    "allocate",
    "is_managed",
    "live_bytes",
    "prefetch",
    "ranges_of",
    "seal",
]

PAGED_MIN_NUMEL = 100_000  # bitsandbytes' threshold for paging a tensor's state
# prefetch skips a step's call while the GPU has this much free memory beyond the state's bytes: managed
# pages leave the GPU only when its memory runs out (see prefetch); set it to 1 << 62 to prefetch every step
PREFETCH_HEADROOM = 1 << 30
_FREE_TTL_S = 0.05  # prefetch asks the GPU's free memory at most this often (a cudaMemGetInfo is microseconds)
_ALIGN = 256  # bytes: every field starts on a 256-byte boundary, as the caching allocator's blocks do
_CHUNK_FIRST = 256 << 20  # the first chunk of a burst reserves this much; each next one of the burst twice
_CHUNK_CAP = 8 << 30  # ... up to this (or what one request needs)

_CU_MEM_ATTACH_GLOBAL = 1
_CU_POINTER_ATTRIBUTE_IS_MANAGED = 8
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS = 89


class _MemLocation(ctypes.Structure):  # CUmemLocation
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Driver:
    """The few driver entry points paging needs, loaded once from libcuda (versioned names where the
    driver has them: CUDA 13 changed the unversioned cuMemPrefetchAsync's arguments)."""

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        self.lib = lib
        vp, sz, u, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int
        self.init = self._fn("cuInit", [u])
        self.device_get = self._fn("cuDeviceGet", [ctypes.POINTER(i), i])
        self.attribute = self._fn("cuDeviceGetAttribute", [ctypes.POINTER(i), i, i])
        self.ctx_retain = self._fn("cuDevicePrimaryCtxRetain", [ctypes.POINTER(vp), i])
        self.ctx_push = self._fn("cuCtxPushCurrent_v2", [vp])
        self.ctx_pop = self._fn("cuCtxPopCurrent_v2", [ctypes.POINTER(vp)])
        self.alloc = self._fn("cuMemAllocManaged", [ctypes.POINTER(ctypes.c_uint64), sz, u])
        self.free = self._fn("cuMemFree_v2", [ctypes.c_uint64])
        self.pointer_attr = self._fn("cuPointerGetAttribute", [vp, i, ctypes.c_uint64])
        self.err_name = lib.cuGetErrorName
        self.err_name.argtypes = [i, ctypes.POINTER(ctypes.c_char_p)]
        if hasattr(lib, "cuMemPrefetchAsync_v2"):  # CUDA >= 12.2: (ptr, bytes, CUmemLocation, flags, stream)
            self.prefetch_v2 = self._fn("cuMemPrefetchAsync_v2", [ctypes.c_uint64, sz, _MemLocation, u, vp])
            self.prefetch_v1 = None
        else:  # older drivers: (ptr, bytes, device ordinal, stream)
            self.prefetch_v2 = None
            self.prefetch_v1 = self._fn("cuMemPrefetchAsync", [ctypes.c_uint64, sz, i, vp])
        self.check(self.init(0), "cuInit")
        self.contexts: dict[int, ctypes.c_void_p] = {}
        self.concurrent_access: dict[int, bool] = {}

    def _fn(self, name: str, argtypes: list) -> Any:
        fn = getattr(self.lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
        return fn

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            self.err_name(rc, ctypes.byref(name))
            raise RuntimeError(f"{what} failed: CUDA driver error {rc} ({(name.value or b'?').decode()})")

    def context(self, device: int) -> ctypes.c_void_p:
        """The device's primary context (torch's), retained once for the process."""
        ctx = self.contexts.get(device)
        if ctx is None:
            dev, ctx = ctypes.c_int(), ctypes.c_void_p()
            self.check(self.device_get(ctypes.byref(dev), device), "cuDeviceGet")
            self.check(self.ctx_retain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
            self.contexts[device] = ctx
        return ctx

    def concurrent(self, device: int) -> bool:
        """Whether the device can prefetch managed memory (concurrentManagedAccess)."""
        got = self.concurrent_access.get(device)
        if got is None:
            dev, val = ctypes.c_int(), ctypes.c_int()
            self.check(self.device_get(ctypes.byref(dev), device), "cuDeviceGet")
            self.check(
                self.attribute(ctypes.byref(val), _CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS, dev),
                "cuDeviceGetAttribute",
            )
            got = self.concurrent_access[device] = bool(val.value)
        return got

    def prefetch_all(self, device: int, ranges: list[tuple[int, int]], stream: int) -> None:
        """cuMemPrefetchAsync of each ``(pointer, bytes)`` to ``device`` on ``stream``, one context push."""
        self.check(self.ctx_push(self.context(device)), "cuCtxPushCurrent")
        try:
            handle = ctypes.c_void_p(stream)
            loc = _MemLocation(_CU_MEM_LOCATION_TYPE_DEVICE, device)
            for ptr, nbytes in ranges:
                if self.prefetch_v2 is not None:
                    rc = self.prefetch_v2(ptr, nbytes, loc, 0, handle)
                else:
                    rc = self.prefetch_v1(ptr, nbytes, device, handle)
                self.check(rc, "cuMemPrefetchAsync")
        finally:
            popped = ctypes.c_void_p()
            self.ctx_pop(ctypes.byref(popped))

    def call_in(self, device: int, fn, *args) -> int:
        """``fn(*args)`` with the device's primary context current (a finaliser may run on any thread)."""
        self.check(self.ctx_push(self.context(device)), "cuCtxPushCurrent")
        try:
            return fn(*args)
        finally:
            popped = ctypes.c_void_p()
            self.ctx_pop(ctypes.byref(popped))


_DRIVER: _Driver | None = None
_DRIVER_LOCK = threading.Lock()


def _driver() -> _Driver:
    global _DRIVER
    if _DRIVER is None:
        with _DRIVER_LOCK:
            if _DRIVER is None:
                _DRIVER = _Driver()
    return _DRIVER


class _DriverBackend:
    """Chunks from ``cuMemAllocManaged``; tensors over them through ``__cuda_array_interface__``."""

    def lazy(self, device: int) -> bool:
        # with concurrentManagedAccess pages are backed on first touch, so reserving more costs nothing;
        # without it (Windows, pre-Pascal) an allocation is device memory at once: no reserve then
        return _driver().concurrent(device)

    def alloc(self, nbytes: int, device: int) -> int:
        drv = _driver()
        torch.cuda.init()  # torch's primary context exists before the driver is asked for it
        ptr = ctypes.c_uint64()
        drv.check(
            drv.call_in(device, drv.alloc, ctypes.byref(ptr), max(nbytes, 1), _CU_MEM_ATTACH_GLOBAL),
            f"cuMemAllocManaged({nbytes} bytes)",
        )
        return ptr.value

    def free(self, ptr: int, device: int) -> None:
        drv = _driver()
        drv.check(drv.call_in(device, drv.free, ptr), "cuMemFree")

    def wrap(self, keeper: Any, ptr: int, nbytes: int, device: int) -> Tensor:
        view = _Interface(keeper)
        # no "stream": the memory is new or idle, there is nothing to synchronise with
        view.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }
        with torch.cuda.device(device):
            return torch.as_tensor(view, device=f"cuda:{device}")


class _Interface:
    """An array-interface object that keeps ``keeper`` alive as long as the tensor made from it."""

    def __init__(self, keeper: Any):
        self.keeper = keeper


class Range(NamedTuple):
    """A span of one chunk to prefetch (from :func:`ranges_of`)."""

    ptr: int  # first byte
    nbytes: int
    device: int
    serial: int  # the chunk's serial number: a range of a freed chunk is skipped


_SERIALS = itertools.count(1)


class _Chunk:
    """One allocation, carved from its start; freed when the last tensor made from it dies."""

    def __init__(self, arena: Arena, nbytes: int):
        self.arena, self.size, self.top = arena, nbytes, 0
        self.ptr = arena.backend.alloc(nbytes, arena.device)
        self.serial = next(_SERIALS)
        self.fields: list[int] = []  # addresses of the fields carved from it (keys of arena.fields)
        arena.live[self.serial] = (self.ptr, nbytes)

    def __del__(self):
        arena = self.arena
        if arena.live.pop(getattr(self, "serial", None), None) is None:  # (None: the allocation failed)
            return
        for f in self.fields:
            arena.fields.pop(f, None)
        arena.prefetched.pop(self.serial, None)
        if not sys.is_finalizing():  # at exit the driver may be gone; the process returns the memory anyway
            arena.backend.free(self.ptr, arena.device)


class _Field:
    """Keeps a chunk alive from the storage of one field (the storage's array-interface object holds it)."""

    __slots__ = ("chunk",)

    def __init__(self, chunk: _Chunk):
        self.chunk = chunk


class Arena:
    """Bump allocation of state tensors from chunks of one device (one arena per CUDA device).

    ``backend`` provides ``alloc(nbytes, device) -> pointer``, ``free(pointer, device)``,
    ``wrap(keeper, pointer, nbytes, device) -> uint8 tensor`` (a storage of its own over those bytes that keeps
    ``keeper`` alive) and ``lazy(device) -> bool`` (whether untouched bytes cost nothing, so that a chunk may
    reserve more than asked). The CUDA arenas use the driver; tests use a host stand-in.

    Args:
        backend: as above.
        device: the device index the backend is asked for.
        first: bytes the first chunk of a burst reserves (each next chunk of the burst twice the last).
        cap: the most a chunk reserves beyond what one request needs.

    Example::

        arena = Arena(backend, 0)
        codes, absmax = arena.allocate([((4096,), torch.uint8), ((16,), torch.float32)])
    """

    def __init__(self, backend: Any, device: int, first: int = _CHUNK_FIRST, cap: int = _CHUNK_CAP):
        self.backend, self.device, self.first, self.cap = backend, device, first, cap
        self.live: dict[int, tuple[int, int]] = {}  # serial -> (pointer, bytes) of each live chunk
        self.fields: dict[int, tuple[int, int]] = {}  # field address -> (chunk serial, bytes)
        self.prefetched: dict[int, set[tuple[int, int]]] = {}  # serial -> spans prefetched while it lived
        self.free_seen = (-math.inf, 0)  # (time.monotonic(), bytes) of prefetch's last cudaMemGetInfo
        self._current: weakref.ref | None = None  # the chunk of the burst under way (weak: it dies with its fields)
        self._next = first
        self._lock = threading.Lock()

    def seal(self) -> None:
        """End the burst: the next allocation starts a new chunk."""
        self._current, self._next = None, self.first

    def allocate(self, specs: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> list[Tensor]:
        """Uninitialised tensors of the given ``(shape, dtype)``, each 256-byte aligned, from one chunk."""
        sizes = [_numel(shape) * _itemsize(dtype) for shape, dtype in specs]
        total = sum(_aligned(max(n, 1)) for n in sizes)  # an empty field still gets its byte: no shared address
        with self._lock:
            chunk = None if self._current is None else self._current()
            if chunk is None:  # sealed, or everything of the burst died: a new burst
                self._next = self.first
            if chunk is None or chunk.top + total > chunk.size:
                chunk = self._new_chunk(total)
            start, chunk.top = chunk.top, chunk.top + total
        out, off = [], start
        for (shape, dtype), n in zip(specs, sizes):
            raw = self.backend.wrap(_Field(chunk), chunk.ptr + off, max(n, 1), self.device)
            self.fields[chunk.ptr + off] = (chunk.serial, n)
            chunk.fields.append(chunk.ptr + off)
            out.append(raw[:n].view(dtype).view(shape))
            off += _aligned(max(n, 1))
        return out

    def _new_chunk(self, need: int) -> _Chunk:
        if not self.backend.lazy(self.device):  # every byte reserved is memory: exactly what is asked
            self._current = None
            return _Chunk(self, need)
        want = max(need, min(self._next, self.cap))
        try:
            chunk = _Chunk(self, want)
        except RuntimeError:  # the reserve refused (address space, a driver limit): ask for the need alone
            if want == need:
                raise
            chunk = _Chunk(self, need)
        self._current, self._next = weakref.ref(chunk), min(2 * want, self.cap)
        return chunk

    def ranges_of(self, tensors: Iterable[Any]) -> list[Range]:
        """One :class:`Range` per chunk holding any of ``tensors`` (others are skipped): from its first to
        the end of its last field among them. Ends the burst."""
        spans: dict[int, list[int]] = {}
        for t in tensors:
            if not isinstance(t, Tensor):
                continue
            ptr = t.untyped_storage().data_ptr()
            rec = self.fields.get(ptr)
            if rec is None or rec[0] not in self.live:
                continue
            span = spans.setdefault(rec[0], [ptr, ptr + rec[1]])
            span[0], span[1] = min(span[0], ptr), max(span[1], ptr + rec[1])
        self.seal()
        return [Range(lo, hi - lo, self.device, serial) for serial, (lo, hi) in spans.items()]

    def live_bytes(self) -> int:
        """Bytes of the live chunks (reserved: only the pages touched take memory)."""
        return sum(n for _, n in list(self.live.values()))


_ARENAS: dict[int, Arena] = {}


def _arena(device: int) -> Arena:
    arena = _ARENAS.get(device)
    if arena is None:
        with _DRIVER_LOCK:
            arena = _ARENAS.setdefault(device, Arena(_DriverBackend(), device))
    return arena


def allocate(specs: Sequence[tuple[tuple[int, ...], torch.dtype]], device: torch.device) -> list[Tensor]:
    """Uninitialised tensors of the given shapes and dtypes in managed memory on ``device`` (each 256-byte
    aligned, all from one chunk); the chunk is freed when all tensors carved from it are gone.

    Args:
        specs: ``(shape, dtype)`` of each tensor.
        device: a CUDA device.

    Returns:
        The tensors, in order.

    Example::

        codes, absmax = allocate([((4096,), torch.uint8), ((16,), torch.float32)], torch.device("cuda"))
    """
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"paged (managed) memory is CUDA memory; got device {device}")
    index = torch.cuda.current_device() if device.index is None else device.index
    return _arena(index).allocate(specs)


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def is_managed(t: Tensor) -> bool:
    """Whether ``t``'s memory is CUDA managed memory (asks the driver: cuPointerGetAttribute)."""
    if not t.is_cuda:
        return False
    drv = _driver()
    flag = ctypes.c_uint()
    drv.check(
        drv.call_in(
            t.device.index,
            drv.pointer_attr,
            ctypes.byref(flag),
            _CU_POINTER_ATTRIBUTE_IS_MANAGED,
            t.data_ptr(),
        ),
        "cuPointerGetAttribute",
    )
    return bool(flag.value)


def ranges_of(tensors: Iterable[Any]) -> list[Range]:
    """The spans of managed memory that hold any of ``tensors`` (non-tensors and unpaged tensors are skipped):
    one :class:`Range` per chunk, what :func:`prefetch` takes. Also ends the allocation burst (states
    allocated later go to a new chunk).

    Args:
        tensors: e.g. a state, or the tensors of many states.

    Returns:
        The ranges.

    Example::

        ranges = ranges_of(t for s in states for t in s)
    """
    by_device: dict[int, list[Tensor]] = {}
    for t in tensors:
        if isinstance(t, Tensor) and t.is_cuda and t.device.index in _ARENAS:
            by_device.setdefault(t.device.index, []).append(t)
    return [r for dev, ts in by_device.items() for r in _ARENAS[dev].ranges_of(ts)]


def _should_prefetch(nbytes: int, free: int, new: bool, headroom: int) -> bool:
    """Whether to prefetch ``nbytes`` of state with ``free`` bytes of GPU memory free: never when they do not
    fit (the driver would evict pages of the same state to make room: the kernels fault pages in instead);
    otherwise when the ranges are new, or when free memory is within ``headroom`` of the state's bytes.
    With more free than that, no page is taken to have been evicted: the driver evicts managed pages only
    when the GPU is full, and free memory stays low after such a moment (torch's caching allocator keeps
    what it took). Where that guess is wrong (memory given back to the driver since), one step faults the
    pages back in."""
    if nbytes > free:
        return False
    return new or free < nbytes + headroom


def prefetch(ranges: Sequence[Range], stream: torch.cuda.Stream | None = None, force: bool = False) -> bool:
    """Ask the driver to move paged state to its GPU, asynchronously on ``stream`` (the current stream by
    default), where it may have been paged out and fits: one call per chunk. Skipped when the state does not
    fit in free memory (the kernels then fault pages in) and when the GPU has :data:`PREFETCH_HEADROOM`
    bytes free beyond the state (taken as: nothing evicted; ranges never prefetched are prefetched once).
    Ranges of chunks freed since are skipped. Free memory is asked (``cudaMemGetInfo``) at most every 50 ms
    per device, so a fast step pays nothing for it; no host synchronisation. Also ends the allocation burst.

    Args:
        ranges: from :func:`ranges_of`.
        stream: the stream the next kernels run on.
        force: prefetch whatever the free memory (the driver evicts other managed pages to make room): for
            a slice of a state larger than the GPU's memory, stepped before the next slice is prefetched.

    Returns:
        Whether a prefetch was issued.

    Example::

        prefetch(ranges_of(state))
    """
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        # a driver prefetch cannot be captured (it invalidates the capture): replays fault the pages in
        seal()
        return False
    by_device: dict[int, list[Range]] = {}
    for r in ranges:
        arena = _ARENAS.get(r.device)
        if arena is not None and r.serial in arena.live:
            by_device.setdefault(r.device, []).append(r)
    issued = False
    for dev, rs in by_device.items():
        arena = _ARENAS[dev]
        arena.seal()
        drv = _driver()
        if not drv.concurrent(dev):  # the driver cannot prefetch there: the kernels fault pages in
            continue
        new = any((r.ptr, r.nbytes) not in arena.prefetched.get(r.serial, ()) for r in rs)
        now = time.monotonic()
        if now - arena.free_seen[0] >= _FREE_TTL_S:
            arena.free_seen = (now, torch.cuda.mem_get_info(dev)[0])
        free = arena.free_seen[1]
        if not force and not _should_prefetch(sum(r.nbytes for r in rs), free, new, PREFETCH_HEADROOM):
            continue
        s = torch.cuda.current_stream(dev) if stream is None else stream
        drv.prefetch_all(dev, [(r.ptr, r.nbytes) for r in rs], s.cuda_stream)
        for r in rs:
            arena.prefetched.setdefault(r.serial, set()).add((r.ptr, r.nbytes))
        issued = True
    return issued


def seal() -> None:
    """End the allocation burst on every device: states allocated next start new chunks (a checkpoint loaded
    after another: dropping either frees its own chunk)."""
    for arena in list(_ARENAS.values()):
        arena.seal()


def live_bytes(device: int | None = None) -> int:
    """Bytes of managed memory this module holds now (on ``device``, or on all devices): its live chunks,
    reserved (only the pages touched take memory)."""
    return sum(a.live_bytes() for d, a in list(_ARENAS.items()) if device is None or d == device)

"""Paged optimizer state: CUDA managed (unified) memory through the CUDA driver API.

A paged state (``OptimSpec(paged=True)``) lives in memory from ``cuMemAllocManaged``: one allocation per
tensor's state, carved into the state's fields, wrapped as torch tensors through ``__cuda_array_interface__``.
The kernels read it through the same pointers as any CUDA tensor; the driver pages it between host and
device, so the state may exceed the free GPU memory. :func:`prefetch` asks the driver to bring it to the GPU
ahead of a step (asynchronous, on the current stream). The allocation is freed when its last tensor dies
(unlike bitsandbytes' paged buffers, which are never freed).

As in bitsandbytes, only the state of tensors of at least :data:`PAGED_MIN_NUMEL` elements is paged: smaller
ones would each cost a prefetch call per step for little memory. On the CPU ``paged`` changes nothing.

    >>> import torch, bnbf
    >>> p = torch.zeros(1 << 20, device="cuda")  # doctest: +SKIP
    >>> s = bnbf.init_state(p, bnbf.OptimSpec(rule="adamw", paged=True))  # doctest: +SKIP
    >>> bnbf.paged.is_managed(s.exp_avg)  # doctest: +SKIP
    True
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["PAGED_MIN_NUMEL", "allocate", "is_managed", "live_bytes", "prefetch", "ranges_of"]

PAGED_MIN_NUMEL = 100_000  # bitsandbytes' threshold for paging a tensor's state
_ALIGN = 256  # bytes: every field starts on a 256-byte boundary, as the caching allocator's blocks do

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
_LIVE: dict[int, tuple[int, int]] = {}  # base pointer -> (bytes, device) of every live managed allocation
_FIELDS: dict[int, int] = {}  # a field storage's address -> its allocation's base pointer


def _driver() -> _Driver:
    global _DRIVER
    if _DRIVER is None:
        with _DRIVER_LOCK:
            if _DRIVER is None:
                _DRIVER = _Driver()
    return _DRIVER


class _Managed:
    """One managed allocation; torch tensors made from it keep it alive, and it is freed with the last."""

    def __init__(self, nbytes: int, device: int):
        drv = _driver()
        torch.cuda.init()  # torch's primary context exists before the driver is asked for it
        ptr = ctypes.c_uint64()
        drv.check(
            drv.call_in(device, drv.alloc, ctypes.byref(ptr), max(nbytes, 1), _CU_MEM_ATTACH_GLOBAL),
            f"cuMemAllocManaged({nbytes} bytes)",
        )
        self.ptr, self.nbytes, self.device = ptr.value, nbytes, device
        self.fields: list[int] = []  # the field storages' addresses (_FIELDS keys)
        _LIVE[self.ptr] = (nbytes, device)
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (self.ptr, False),
            "version": 3,
            "strides": None,  # no "stream": the memory is new, there is nothing to synchronise with
        }

    def __del__(self):
        if _LIVE is not None and _LIVE.pop(self.ptr, None) is not None:  # (None: interpreter shutdown)
            for f in self.fields:
                _FIELDS.pop(f, None)
            drv = _driver()
            drv.check(drv.call_in(self.device, drv.free, self.ptr), "cuMemFree")


def allocate(specs: Sequence[tuple[tuple[int, ...], torch.dtype]], device: torch.device) -> list[Tensor]:
    """Uninitialised tensors of the given shapes and dtypes, carved from one managed allocation on
    ``device`` (each 256-byte aligned); the allocation is freed when all of them are gone.

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
    offsets, end = [], 0
    for shape, dtype in specs:
        offsets.append(end)
        n = _numel(shape) * torch.empty((), dtype=dtype).element_size()
        end += -(-n // _ALIGN) * _ALIGN
    owner = _Managed(end, index)
    out = []
    with torch.cuda.device(index):
        for (shape, dtype), off in zip(specs, offsets):
            n = _numel(shape) * torch.empty((), dtype=dtype).element_size()
            raw = torch.as_tensor(_Field(owner, off, max(n, 1)), device=f"cuda:{index}")
            out.append(raw[:n].view(dtype).view(shape))
    return out


class _Field:
    """One tensor's part of a managed allocation as a storage of its own (torch.save refuses one storage
    viewed as two dtypes: uint8 codes beside float32 scales); it keeps the allocation alive."""

    def __init__(self, owner: _Managed, offset: int, nbytes: int):
        self.owner = owner
        _FIELDS[owner.ptr + offset] = owner.ptr
        owner.fields.append(owner.ptr + offset)
        self.__cuda_array_interface__ = dict(owner.__cuda_array_interface__, shape=(nbytes,))
        self.__cuda_array_interface__["data"] = (owner.ptr + offset, False)


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


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


def ranges_of(tensors: Iterable[Any]) -> list[tuple[int, int, int]]:
    """``(pointer, bytes, device)`` of the managed allocations that hold any of ``tensors`` (non-tensors
    are skipped), each once: what :func:`prefetch` takes."""
    seen: dict[int, tuple[int, int, int]] = {}
    for t in tensors:
        if isinstance(t, Tensor) and t.is_cuda:
            base = _FIELDS.get(t.untyped_storage().data_ptr())
            live = None if base is None else _LIVE.get(base)
            if live is not None:
                seen[base] = (base, live[0], live[1])
    return list(seen.values())


def prefetch(ranges: Sequence[tuple[int, int, int]], stream: torch.cuda.Stream | None = None) -> bool:
    """Ask the driver to move managed allocations to their GPU, asynchronously on ``stream`` (the current
    stream by default), when their total size fits in the GPU's free memory; otherwise leave them where the
    driver keeps them (the kernels then fault pages in). Allocations freed since ``ranges`` was taken are
    skipped. No host synchronisation.

    Args:
        ranges: from :func:`ranges_of`.
        stream: the stream the next kernels run on.

    Returns:
        Whether a prefetch was issued.

    Example::

        prefetch(ranges_of(bnbf.state.state_tensors(state)))
    """
    live = [r for r in ranges if _LIVE.get(r[0]) == (r[1], r[2])]
    if not live:
        return False
    drv = _driver()
    by_device: dict[int, list[tuple[int, int, int]]] = {}
    for r in live:
        by_device.setdefault(r[2], []).append(r)
    issued = False
    for dev, rs in by_device.items():
        if not drv.concurrent(dev):  # the driver cannot prefetch there: the kernels fault pages in
            continue
        free, _ = torch.cuda.mem_get_info(dev)  # resident pages are not free: those prefetch as no-ops
        if sum(r[1] for r in rs) > free:
            continue
        s = torch.cuda.current_stream(dev) if stream is None else stream
        drv.prefetch_all(dev, [(ptr, nbytes) for ptr, nbytes, _ in rs], s.cuda_stream)
        issued = True
    return issued


def live_bytes(device: int | None = None) -> int:
    """Bytes of managed memory this module holds now (on ``device``, or on all devices)."""
    return sum(n for n, d in list(_LIVE.values()) if device is None or d == device)

"""The CPU step's native 8-bit codec (bnbf/csrc/cpu_codec.cpp), built at install time.

:data:`NATIVE` is the compiled module, or None where it was not built (an isolated build without torch, no
compiler), was built against another torch, or ``BNBF_CPU_CODEC=torch`` asks for the pure-torch oracle.
:func:`bnbf.reference.reference_step` dequantizes and requantizes CPU states with it when it is there: the same
bits as :func:`bnbf.quant.quantize_state_reference` and :func:`bnbf.quant.dequantize_state_reference` (the
oracle, tests/test_cpu_codec.py), in one fused pass each instead of a dozen torch ops.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor

from bnbf.quant import STATE_FORMATS, state_map


def _native() -> Any:
    if os.environ.get("BNBF_CPU_CODEC", "native") == "torch":
        return None
    try:
        from bnbf import _cpu_codec_native as native
    except ImportError:  # not built, or another torch's symbols
        return None
    return native if getattr(native, "torch_version", None) == torch.__version__ else None


NATIVE = _native()

_TABLES: dict[tuple[str, bool], Tensor] = {}  # (format, signed) -> the format's CPU map (bnbf.quant's own tensor)


def table(fmt: str, signed: bool) -> Tensor:
    """The 256 float32 values of ``fmt``'s codes on the CPU (:func:`bnbf.quant.state_map`), looked up once."""
    t = _TABLES.get((fmt, signed))
    if t is None:
        t = _TABLES[(fmt, signed)] = state_map(fmt, signed, "cpu")
    return t


def _check(t: Tensor, name: str, dtype: torch.dtype, numel: int) -> None:
    # checked here, not only in C++: on the H200 host (torch 2.11) a C++ check whose message formats an integer
    # crashed the process instead of raising
    if t.device.type != "cpu":
        raise RuntimeError(f"{name} must be a CPU tensor, got one on {t.device}")
    if t.dtype != dtype:
        raise RuntimeError(f"{name} must be {dtype}, got {t.dtype}")
    if not t.is_contiguous():
        raise RuntimeError(f"{name} must be contiguous")
    if t.numel() != numel:
        raise RuntimeError(f"{name} must have {numel} elements, got {t.numel()}")


def _blocks(n: int, block_size: int) -> int:
    if not (isinstance(block_size, int) and block_size > 0 and block_size & (block_size - 1) == 0):
        raise RuntimeError(f"block_size must be a positive power of two, got {block_size}")
    return -(-n // block_size)


def dequantize(
    codes: Tensor, absmax: Tensor, fmt: str, signed: bool, block_size: int, out: Tensor | None = None
) -> Tensor:
    """Float32 values of a CPU state's codes: :func:`bnbf.quant.dequantize_state_reference`, bit for bit.

    Args:
        codes: uint8, contiguous, on the CPU; absmax: float32, one per block of ``block_size`` codes.
        fmt, signed, block_size: the state's format (``"power"`` or ``"dynamic"``), map and block size.
        out: float32, contiguous, of ``codes``' numel, to write into (the caller's scratch), or None for a new
            tensor.

    Returns:
        float32 tensor of ``codes``' shape (a view of ``out`` where given).

    Example:
        >>> from bnbf.quant import dequantize_state_reference, quantize_state_reference
        >>> codes, absmax = quantize_state_reference(torch.randn(300), "power", True, 256)
        >>> y = dequantize(codes, absmax, "power", True, 256)  # == dequantize_state_reference(...)
    """
    if fmt not in STATE_FORMATS:
        raise ValueError(f"unknown state format {fmt!r}; known: {STATE_FORMATS}")
    _check(codes, "codes", torch.uint8, codes.numel())
    _check(absmax, "absmax", torch.float32, _blocks(codes.numel(), block_size))
    if out is not None:
        _check(out, "out", torch.float32, codes.numel())
    return NATIVE.dequantize(codes, absmax, table(fmt, signed), block_size, out)


def quantize_(
    x: Tensor,
    keep: Tensor | None,
    codes: Tensor,
    absmax: Tensor,
    fmt: str,
    signed: bool,
    block_size: int,
    seed: int,
    first_block: int = 0,
) -> None:
    """Write the step's codes and absmax of ``keep ? x : 0`` into ``codes`` and ``absmax``: the same bits as
    ``quantize_state_reference(where(keep, x, 0), fmt, signed, block_size, d)`` with
    ``d = state_dither(numel, seed, block_size, first_block=first_block)``.

    Args:
        x: float32 finite values, contiguous, on the CPU (non-finite values are the caller's to mask with keep).
        keep: bool mask of ``x``'s numel (the step's finite gradient elements), or None for all.
        codes: uint8 output of ``x``'s numel; absmax: float32 output, one per block.
        fmt, signed, block_size: the state's format; seed: the step mod 2**24 (:func:`bnbf.quant.state_dither`);
            first_block: the global index of ``x``'s first block (a shard's, else 0).

    Example:
        >>> x = torch.randn(300)
        >>> codes, absmax = torch.empty(300, dtype=torch.uint8), torch.empty(2)
        >>> quantize_(x, None, codes, absmax, "power", True, 256, seed=1)
    """
    if fmt not in STATE_FORMATS:
        raise ValueError(f"unknown state format {fmt!r}; known: {STATE_FORMATS}")
    n = x.numel()
    _check(x, "x", torch.float32, n)
    if keep is not None:
        _check(keep, "keep", torch.bool, n)
    _check(codes, "codes", torch.uint8, n)
    _check(absmax, "absmax", torch.float32, _blocks(n, block_size))
    NATIVE.quantize_(x, keep, codes, absmax, fmt == "power", signed, block_size, seed, first_block)

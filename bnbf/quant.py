"""Block-wise 8-bit quantization with bitsandbytes' dynamic map.

A tensor is cut into blocks of ``block_size`` consecutive elements (in memory order). Each block stores
its largest magnitude (``absmax``, float32) and one uint8 code per element: the index of the map value
nearest to ``x / absmax``, in float32 arithmetic (``x`` times the float32 reciprocal of the absmax; the two
distances compared as float32 values, a tie going to the lower code). The maps are bitsandbytes' "dynamic"
maps, so codes and absmax can be exchanged with bitsandbytes checkpoints.

This module holds the public functions and the pure-torch reference (the CPU path and the test oracle);
the Triton kernels live in :mod:`bnbf.kernels.codec`.
"""

from __future__ import annotations

import functools
import math
import weakref

import torch
from torch import Tensor

from bnbf._dispatch import use_triton

__all__ = [
    "create_dynamic_map",
    "dynamic_map",
    "quantize_blockwise",
    "dequantize_blockwise",
    "quantize_blockwise_reference",
    "dequantize_blockwise_reference",
    "STATE_FORMATS",
    "quantize_state_reference",
    "dequantize_state_reference",
    "zero_code",
    "state_map",
    "state_dither",
]

# The 8-bit formats of optimizer states. Both scale each block of 256 values by its absmax.
# - "dynamic": bitsandbytes' dynamic maps (signed for first moments, unsigned for non-negative states);
#   checkpoints exchange codes with bitsandbytes.
# - "power": linear codes of a companded value, decoded with multiplies only: signed states store
#   128 + round(127 * sign(x) * sqrt|x|), non-negative states round(255 * x ** 0.25), x = value / absmax.
STATE_FORMATS = ("power", "dynamic")


def create_dynamic_map(signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8) -> Tensor:
    """The 256 values of bitsandbytes' dynamic quantization map, sorted, float32.

    The map splits [0.1, 1] into ``2**j`` equal bins per decade (more bins for larger decades), takes the
    bin centres and scales them by ``10**-6 .. 10**0``; 0 and 1 complete it. The unsigned map spends the
    sign bit on twice as many bins per decade. The values are computed in float32 exactly as bitsandbytes
    computes them, so codes mean the same thing in both libraries.

    Args:
        signed: include negative values (first moments) or not (non-negative second moments).
        max_exponent_bits: number of decades.
        total_bits: bits per code; maps with fewer than 8 bits are padded with zeros to 256 entries.

    Returns:
        float32 tensor of 256 sorted values.

    Raises:
        ValueError: for settings whose map does not have ``2**total_bits`` values (bitsandbytes refuses them
            too: an unsigned map needs ``max_exponent_bits == total_bits - 1``), and for ``total_bits`` outside
            1..8 or ``max_exponent_bits`` below 1 (0 is the 1-bit map's).
    """
    for name, v in (("max_exponent_bits", max_exponent_bits), ("total_bits", total_bits)):
        if type(v) is not int:
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    # without an exponent bit only the 1-bit map {0, 1} exists (bitsandbytes fails on the others)
    if not 1 <= total_bits <= 8 or max_exponent_bits < (total_bits > 1):
        raise ValueError(
            f"a dynamic map needs 1 <= total_bits <= 8 and max_exponent_bits >= 1 (0 only with total_bits=1), got "
            f"total_bits={total_bits}, max_exponent_bits={max_exponent_bits}"
        )
    mantissa_bits = total_bits - 1
    values: list[float] = []

    def add_decade(exponent: int, bins: int) -> None:
        edges = torch.linspace(0.1, 1.0, bins + 1, dtype=torch.float32)
        centres = (edges[:-1] + edges[1:]) / 2.0
        decade = (10.0**exponent) * centres
        values.extend(decade.tolist())
        if signed:
            values.extend((-decade).tolist())

    for i in range(max_exponent_bits):
        bins = int(2 ** (i + mantissa_bits - max_exponent_bits + (0 if signed else 1)))  # 0 below one bin
        add_decade(i - (max_exponent_bits - 1), bins)
    leftover = 2 ** (mantissa_bits - max_exponent_bits) - 1
    if leftover > 0:
        add_decade(0, leftover)  # bitsandbytes puts the leftover bins in the top decade
    values += [0.0, 1.0]
    if len(values) != 2**total_bits:  # its codes would not fit total_bits, or leave codes without a value
        raise ValueError(
            f"the dynamic map with signed={signed}, max_exponent_bits={max_exponent_bits}, total_bits={total_bits} "
            f"has {len(values)} values, not 2**total_bits = {2**total_bits}"
        )
    values += [0.0] * (256 - len(values))
    return torch.tensor(sorted(values), dtype=torch.float32)


@functools.cache
def _map_cpu(signed: bool) -> Tensor:
    return create_dynamic_map(signed=signed)


_DEVICE_MAPS: dict[tuple, Tensor] = {}  # (device, signed[, format]) -> map


def dynamic_map(signed: bool, device: torch.device | str = "cpu") -> Tensor:
    """The default (7 exponent bits, 8 bits) dynamic map on ``device``, cached per device."""
    device = torch.device(device)
    key = (device, signed)
    cached = _DEVICE_MAPS.get(key)
    if cached is None:
        cached = _map_cpu(signed).to(device)
        _DEVICE_MAPS[key] = cached
    return cached


def _check_block_size(block_size: int) -> None:
    if type(block_size) is bool or not isinstance(block_size, int) or block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a positive power of two, got {block_size!r}")


def _check_code(code: Tensor, device: torch.device) -> None:
    """Refuse a map that the encoders cannot search: not a 1-D float32 tensor of 256 finite values in ascending
    order (both encoders find the nearest value by binary search), or on another device than the data."""
    if not isinstance(code, Tensor):
        raise TypeError(f"code must be a tensor, got {type(code).__name__}")
    if code.dtype != torch.float32 or code.numel() != 256 or code.dim() != 1:
        raise ValueError(f"code must be a 1-D float32 tensor of 256 values, got {code.dtype} {tuple(code.shape)}")
    if code.device != device:
        raise ValueError(f"code is on {code.device} but the tensor is on {device}")
    if code.device.type == "meta":  # no values to check
        return
    if code.device.type == "cpu":  # cheap enough to check at every call
        if not _sorted_finite_cpu(code):
            raise ValueError(_map_problem(code))
        return
    # elsewhere reading the map back costs a host sync: a map is checked once per version of its values
    stamp = _map_stamp(code)
    entry = _SORTED_MAPS.get(id(code))
    if stamp is not None and entry is not None and entry[0]() is code and entry[1] == stamp:
        return
    problem = _map_problem(code)
    if problem is not None:
        raise ValueError(problem)
    if stamp is not None:
        key = id(code)
        _SORTED_MAPS[key] = (weakref.ref(code, functools.partial(_forget_map, key)), stamp)


# Non-CPU maps found valid, by id: a weak reference (no map kept alive) and the map's version counter and address
# when checked. An in-place change bumps the version, so the map is checked again.
_SORTED_MAPS: dict[int, tuple[weakref.ref, tuple[int, int]]] = {}


def _forget_map(key: int, ref: weakref.ref) -> None:
    entry = _SORTED_MAPS.get(key)
    if entry is not None and entry[0] is ref:
        del _SORTED_MAPS[key]


def _map_stamp(code: Tensor) -> tuple[int, int] | None:
    try:
        return code._version, code.data_ptr()
    except RuntimeError:  # an inference tensor has no version counter: checked at every call
        return None


def _sorted_finite_cpu(code: Tensor) -> bool:
    try:
        a = code.detach().resolve_neg().numpy()
    except (RuntimeError, TypeError):  # a tensor numpy cannot view
        return _map_problem(code) is None
    # sorted with finite ends: finite throughout (a NaN fails the comparison)
    return bool((a[1:] >= a[:-1]).all()) and math.isfinite(a[0]) and math.isfinite(a[-1])


def _map_problem(code: Tensor) -> str | None:
    """Why ``code`` cannot be searched (not finite, not ascending), or None."""
    v = code.detach().cpu()
    bad = (~torch.isfinite(v)).nonzero()
    if bad.numel():
        i = int(bad[0])
        return f"code must hold finite values, but code[{i}] = {v[i].item()}"
    down = (v[1:] < v[:-1]).nonzero()
    if down.numel():
        i = int(down[0])
        return (
            f"code must be sorted in ascending order (the encoder searches it), but code[{i + 1}] = "
            f"{v[i + 1].item()!r} < code[{i}] = {v[i].item()!r}"
        )
    return None


def _check_finite(x: Tensor, absmax: Tensor) -> None:
    """Refuse ``x`` with a NaN or an infinity, found through its blocks' absmax (NaN or inf there)."""
    if math.isfinite(absmax.sum().item()):  # one host read; a sum that overflows is looked at below
        return
    bad = ~torch.isfinite(absmax)
    if not bool(bad.any()):
        return
    flat = x.detach().reshape(-1)
    i = int((~torch.isfinite(flat)).nonzero()[0])
    raise ValueError(
        f"quantize_blockwise needs finite values, but x holds {flat[i].item()} at flat index {i} "
        f"({int(bad.sum())} block(s) affected): 8-bit codes cannot represent it; replace non-finite values "
        f"first (e.g. torch.nan_to_num)"
    )


# --------------------------------------------------------------------------------------------------
# pure-torch reference


def _blocks(x: Tensor, block_size: int) -> tuple[Tensor, Tensor, int]:
    """``x`` in memory order as zero-padded [blocks, block_size] float32, its absmax per block, numel."""
    flat = x.detach().reshape(-1).float()
    n = flat.numel()
    nblocks = -(-n // block_size)
    padded = torch.zeros(nblocks * block_size, dtype=torch.float32, device=flat.device)
    padded[:n] = flat
    blocks = padded.view(nblocks, block_size)
    absmax = blocks.abs().amax(dim=1)
    return blocks, absmax, n


# Below the normal range (absmax < 2**-126) 1 / absmax can overflow: such a block is scaled up by 2**24 first,
# which is exact, so it gets the codes of the same block scaled into the normal range.
_TINY = torch.finfo(torch.float32).tiny
SUBNORMAL_LIFT = 2.0**24


def quantize_blockwise_reference(x: Tensor, code: Tensor, block_size: int = 256) -> tuple[Tensor, Tensor]:
    """Nearest-code block-wise quantization in plain torch (the oracle for the kernels).

    A block holding a NaN gets absmax NaN, one holding an infinity absmax inf (their codes mean nothing):
    :func:`quantize_blockwise` refuses such input."""
    blocks, absmax, n = _blocks(x, block_size)
    scaled = absmax
    if not absmax.min().item() >= _TINY:  # some block is zero, subnormal or NaN: else no extra pass
        factor = torch.where(absmax < _TINY, SUBNORMAL_LIFT, 1.0)
        blocks = blocks * factor[:, None]
        scaled = absmax * factor
    scale = torch.where(scaled > 0, 1.0 / scaled, torch.zeros_like(scaled))
    normed = (blocks * scale[:, None]).clamp_(-1.0, 1.0).reshape(-1)
    return _nearest(normed, code)[:n].to(torch.uint8).view(x.shape), absmax


def _nearest(normed: Tensor, code: Tensor) -> Tensor:
    """Index (int64) of the value of sorted ``code`` nearest to each of ``normed``; ties go to the lower."""
    hi = torch.searchsorted(code, normed).clamp_(1, 255)
    lo = hi - 1
    return torch.where((code[hi] - normed).abs() < (normed - code[lo]).abs(), hi, lo)


def dequantize_blockwise_reference(
    codes: Tensor, absmax: Tensor, code: Tensor, block_size: int = 256, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Inverse of :func:`quantize_blockwise_reference`: ``code[codes] * absmax[block]``."""
    flat = codes.reshape(-1).long()
    n = flat.numel()
    values = code[flat]
    whole = n - n % block_size  # whole blocks broadcast their absmax; the last partial block after
    out = (values[:whole].view(-1, block_size) * absmax[: whole // block_size, None]).reshape(-1)
    if whole < n:  # joined, not written into an empty tensor: vmap (of dequantize_state) refuses such writes
        out = torch.cat([out, values[whole:] * absmax[-1]])
    return out.to(dtype).view(codes.shape)


# --------------------------------------------------------------------------------------------------
# public entry points


def quantize_blockwise(x: Tensor, code: Tensor | None = None, block_size: int = 256) -> tuple[Tensor, Tensor]:
    """Quantize ``x`` block-wise to uint8 codes of a 256-value map.

    Args:
        x: float32, float16 or bfloat16 tensor of any shape (read in memory order; non-contiguous
            tensors are made contiguous first).
        code: the map (float32[256], sorted); defaults to the signed dynamic map.
        block_size: elements per block (a power of two), 256 by default.

    Returns:
        ``(codes, absmax)``: uint8 codes of ``x``'s shape, float32 absmax of ``ceil(numel / block_size)``.

    Raises:
        ValueError: ``x`` holds a NaN or an infinity. A block's codes are fractions of its absmax and cannot
            represent either (the block's absmax would be NaN or inf, and the whole block would decode as
            NaN): replace them first, e.g. with ``torch.nan_to_num``. The check reads the absmax back, so
            on a GPU the call waits for its kernel. Also raised for a ``code`` that is not a 1-D float32
            tensor of 256 finite values in ascending order.

    Blocks whose absmax is subnormal (below 2**-126) are scaled exactly into the normal range first, so they
    get the codes of the same values scaled up by a power of two.

    Example:
        >>> codes, absmax = quantize_blockwise(torch.randn(1000))
        >>> y = dequantize_blockwise(codes, absmax)
    """
    _check_block_size(block_size)
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):  # float64's range would pass the absmax check
        raise TypeError(f"quantize_blockwise expects a float32, float16 or bfloat16 tensor, got {x.dtype}")
    if x.numel() == 0:
        raise ValueError("quantize_blockwise needs a non-empty tensor")
    arithmetic = code is None
    if code is None:
        code = dynamic_map(True, x.device)  # the library's own map: sorted
    else:
        _check_code(code, x.device)
        code = code.contiguous()  # the kernel reads it through its pointer (a strided view read as contiguous)
    if use_triton(x):
        from bnbf.kernels.codec import quantize_blockwise_triton

        codes, absmax = quantize_blockwise_triton(x.contiguous(), code, block_size, arithmetic)
    else:
        codes, absmax = quantize_blockwise_reference(x, code, block_size)
    _check_finite(x, absmax)
    return codes, absmax


def dequantize_blockwise(
    codes: Tensor,
    absmax: Tensor,
    code: Tensor | None = None,
    block_size: int = 256,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Values of ``codes`` under ``code`` scaled by their block's ``absmax``, as ``dtype``.

    Raises ValueError for a ``code`` that is not a 1-D float32 tensor of 256 finite values in ascending order
    (the maps :func:`quantize_blockwise` takes), or an ``absmax`` of the wrong dtype or length."""
    _check_block_size(block_size)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.is_complex:
        raise TypeError(f"dtype must be a floating-point torch.dtype (the values' dtype), got {dtype!r}")
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    nblocks = -(-codes.numel() // block_size)
    if absmax.dtype != torch.float32 or absmax.numel() != nblocks or absmax.dim() != 1:
        raise ValueError(
            f"absmax must be a 1-D float32 tensor of {nblocks} values for {codes.numel()} codes in blocks of "
            f"{block_size}, got {absmax.dtype} of shape {tuple(absmax.shape)}"
        )
    if code is None:
        code = dynamic_map(True, codes.device)
    else:
        _check_code(code, codes.device)
        code = code.contiguous()  # the kernel reads it and absmax through their pointers
    absmax = absmax.contiguous()
    if use_triton(codes):
        from bnbf.kernels.codec import dequantize_blockwise_triton

        return dequantize_blockwise_triton(codes.contiguous(), absmax, code, block_size, dtype)
    return dequantize_blockwise_reference(codes, absmax, code, block_size, dtype)


# --------------------------------------------------------------------------------------------------
# optimizer-state formats (reference implementations)


def state_map(fmt: str, signed: bool, device: torch.device | str = "cpu") -> Tensor:
    """The 256 values (times absmax) that the codes of ``fmt`` stand for: bitsandbytes' ``qmap``.

    For ``"dynamic"`` this is the dynamic map; for ``"power"`` it is ``sign(q) * (q/127)**2`` with
    ``q = code - 128`` (signed) or ``(code/255)**4`` (unsigned). Dequantizing as ``map[codes] * absmax``
    is exact for both, so tools that read bitsandbytes' (codes, qmap, absmax) layout read either.
    """
    if fmt == "dynamic":
        return dynamic_map(signed, device)
    if fmt != "power":
        raise ValueError(f"unknown state format {fmt!r}; known: {STATE_FORMATS}")
    key = (torch.device(device), signed, "power")
    if key not in _DEVICE_MAPS:
        _DEVICE_MAPS[key] = _power_map(signed).to(device)
    return _DEVICE_MAPS[key]


@functools.cache
def _power_map(signed: bool) -> Tensor:
    c = torch.arange(256, dtype=torch.float64)
    values = (c - 128) * (c - 128).abs() / 127.0**2 if signed else (c / 255.0) ** 4
    return values.to(torch.float32)


def zero_code(fmt: str, signed: bool) -> int:
    """The code of 0 in ``fmt`` (what a fresh state holds)."""
    if fmt == "dynamic":
        return 127 if signed else 0
    if fmt == "power":
        return 128 if signed else 0
    raise ValueError(f"unknown state format {fmt!r}; known: {STATE_FORMATS}")


# The zero point. Adam-like rules divide by the square root of a quantized second moment, so a nonzero second
# moment that decodes to 0, or far below its value, while its first moment does not, turns the next update into
# about m / eps: thousands of learning rates. Non-negative states therefore never encode a nonzero value below
# POWER_FLOOR (power: (4/255)**4 = 6e-8 of the absmax) or 1 (dynamic: 3.3e-7), and the dynamic map's round up
# below 1e-5 of the block's absmax, where a code step is 50-140% of the value (nearest rounding in the power
# format too, below code position 8). In the step, stochastic rounding keeps a quantized EMA from sticking at a
# code (a second moment stuck 10-30x below its value, a first moment that never decays to 0); with it the
# power format's floor suffices (the property search of tests/test_zero_point.py, every rule and format).
POWER_CEIL_BELOW = 8.0
POWER_FLOOR = 4  # so a first moment held a few codes up by rounding over a second moment at the floor stays small
DYNAMIC_CEIL_BELOW = 1e-5
_CEIL = 0.5 - 2.0**-17  # round(t + _CEIL) = ceil(t) for t < 8, as the kernels compute it
# The step's power-format code positions are scaled by this: position plus dither then stays below the top code
# plus 1/2 without a clamp per element, whatever the approximate roots' error (~1e-6; the margin is 0.002 codes).
POWER_MARGIN = 1.0 - 2.0**-16
# ... which scales every decoded value by POWER_MARGIN**2 (signed: value ~ position**2) or **4 (non-negative), a bias of
# -3e-5 or -6e-5 a step that a sum (Adagrad's) or a slow average (AdEMAMix's, Adam's second moment) compounds (6% low
# at Adam's equilibrium). The step stores the block's absmax times the inverse (float32, capped at float32's max):
# its decoded values are unbiased again. Nearest rounding (no margin) stores the absmax itself.
POWER_COMP_SIGNED = float(torch.tensor(1.0 / POWER_MARGIN**2, dtype=torch.float32))
POWER_COMP_UNSIGNED = float(torch.tensor(1.0 / POWER_MARGIN**4, dtype=torch.float32))
F32_MAX = float(torch.finfo(torch.float32).max)

# Stochastic rounding in the step: every state of element i (block r = i // block_size, lane i % block_size) at
# step t rounds its code position plus (2k + 1) / 2**23 - 1/2, k the top 22 bits of lane * LANE + block_hash
# (mod 2**32):
#   block_hash = mix(r * BLOCK + (t mod 2**24) * STEP)
# mix(h) is half of a 32-bit integer hash (h ^= h >> 16; h *= MIX; h ^= h >> 15). The kernels hash each block
# once per tile: the dither costs four ops per element, whatever the number of states (sharing it saved 6 of 74
# SASS instructions per element of the bf16 AdamW step; rounding an element's first and second moment in the same
# direction also cancels part of their error in m / sqrt(v)). The step must go through the hash: a Weyl sequence
# in the step (no hash) locked into the phase of a decaying moment's codes and pumped it up four codes.
DITHER_LANE = 0x9E3779B1  # odd constants: 2**32 / golden ratio, and murmur3's and lowbias32's
DITHER_BLOCK = 0x85EBCA77
DITHER_STEP = 0xC2B2AE3D
DITHER_MIX = 0x7FEB352D
DITHER_SEED_MOD = 2**24  # the step travels as a float32 scalar: exact below 2**24
_M32 = 0xFFFFFFFF


def _mix(h: Tensor) -> Tensor:
    h = h ^ (h >> 16)
    h = (h * DITHER_MIX) & _M32
    return h ^ (h >> 15)


def state_dither(
    numel: int, seed: int, block_size: int, device: torch.device | str = "cpu", first_block: int = 0
) -> Tensor:
    """The offsets in (-1/2, 1/2) that the step adds to the code positions of an element's states before rounding
    (``seed``: the step mod 2**24), float32[numel], equal to the kernels' bit for bit: one hash per block,
    added to each lane's multiple of LANE, as the kernels do. ``first_block``: the global index of the
    tensor's first block (a shard of a larger tensor draws the dither of the blocks it holds)."""
    nblocks = -(-numel // block_size)
    lane = torch.arange(block_size, dtype=torch.int64, device=device) * DITHER_LANE & _M32
    block = torch.arange(nblocks, dtype=torch.int64, device=device) * DITHER_BLOCK + (
        int(first_block) * DITHER_BLOCK & _M32
    )
    block = _mix((block + (int(seed) * DITHER_STEP & _M32)) & _M32)
    # in int32 (wrapping, as uint32 in the kernels): the top 22 bits of the sum are k; (2k + 1) / 2**23 - 1/2
    # is exact in float32
    lane, block = (x.where(x < 2**31, x - 2**32).to(torch.int32) for x in (lane, block))
    k = ((lane[None, :] + block[:, None]) >> 10).reshape(-1)[:numel] & 0x3FFFFF
    return (2 * k + 1).to(torch.float32).mul_(2.0**-23).sub_(0.5)


def _dynamic_constants(signed: bool):
    """Per decade (rows 0..6): the lower edge, the scale s and the offset b of encode_dynamic's bin position
    u = a * s - b (float32), for the default dynamic maps."""
    k = 0 if signed else 1
    n = [2 ** (i + k) for i in range(7)]
    edge = torch.tensor([0.0] + [10.0 ** (i - 7) for i in range(1, 7)], dtype=torch.float32)
    s = torch.tensor([10 ** (6 - i) * n[i] / 0.9 for i in range(7)], dtype=torch.float32)
    b = torch.tensor([0.1 * n[i] / 0.9 + 0.5 for i in range(7)], dtype=torch.float32)
    return edge, s, b, torch.tensor(n), k


def _dynamic_rounded(normed: Tensor, signed: bool, d: Tensor) -> Tensor:
    """The kernels' stochastic dynamic-map code (codec.encode_dynamic with STOCHASTIC): round(u + d) in the
    decade's bins, -1 and n reaching the neighbouring decades' codes."""
    edge, s, b, n_of, k_off = _dynamic_constants(signed)
    a = normed.abs().clamp_max(1.0) if signed else normed.clamp(0.0, 1.0)
    i = (a[:, None] >= edge[None, 1:]).sum(1)
    u = a * s[i] - b[i]
    n = n_of[i]
    top = (n - 1).to(torch.float32)
    inv_b0 = torch.tensor(1.0 / (0.1 * (k_off + 1) / 0.9 + 0.5), dtype=torch.float32)
    u = torch.where(u < 0, u * torch.where(i == 0, inv_b0, torch.tensor(1.0 / 0.6, dtype=torch.float32)), u)
    u = torch.where(u > top, top + (u - top) * torch.where(i == 6, 2.0, torch.tensor(1.0 / 3.0)), u)
    k = torch.round(u + d).long().clamp_min(-1)
    k = torch.minimum(k, torch.where((i == 6) & (normed < 0), n - 1, n))
    k = torch.where(a == 0, -1, k)
    rank = n - 1 - k_off + k
    if signed:
        return torch.where(normed < 0, 126 - rank, 128 + rank)
    return 1 + rank


def quantize_state_reference(
    x: Tensor, fmt: str, signed: bool, block_size: int, dither: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Block-wise 8-bit codes of ``x`` in state format ``fmt``, and float32 absmax.

    Codes are the nearest map value, or with ``dither`` (:func:`state_dither`, as the step passes) stochastically
    rounded between the two map values around each value; non-negative states round up near zero and keep
    nonzero values off code 0 (the zero point, above)."""
    if fmt not in STATE_FORMATS:
        raise ValueError(f"unknown state format {fmt!r}; known: {STATE_FORMATS}")
    blocks, absmax, n = _blocks(x, block_size)
    scale = torch.where(absmax > 0, 1.0 / absmax, torch.zeros_like(absmax))
    normed = (blocks * scale[:, None]).clamp_(-1.0, 1.0).reshape(-1)[:n]
    values = blocks.reshape(-1)[:n]
    nonzero = values != 0
    d = torch.zeros_like(normed) if dither is None else dither.to(normed.device).reshape(-1)
    # the step's stochastic rounding scales code positions by POWER_MARGIN (as the kernels: no clamp needed)
    top = 1.0 if dither is None else POWER_MARGIN
    if fmt == "power":
        if signed:
            t = normed.abs().sqrt() * (127.0 * top)
            if dither is not None:  # stochastic: below code 1 unbiased in the value (t**2), as the kernels
                t = torch.where(t < 1.0, t * t, t)
            mag = torch.round((t + d).clamp_max(127.0))
            codes = 128 + mag * normed.sign()
        else:
            t = normed.abs().sqrt().sqrt() * (255.0 * top)
            # nearest rounding rounds up below code position 8; the step's stochastic rounding needs only the floor
            up = torch.where(t < POWER_CEIL_BELOW, _CEIL, d) if dither is None else d
            codes = torch.round((t + up).clamp_max(255.0))
            # the kernels' floor: a nonzero value's float32 bits (as an int) capped at the floor code
            floor = values.float().view(torch.int32).clamp(0, POWER_FLOOR) if dither is not None else POWER_FLOOR
            codes = torch.maximum(codes, torch.where(nonzero, floor, 0).float())
    else:
        # non-negative states round up below the ceiling (the stochastic rounding with its offset at _CEIL, as
        # the kernels) and never store a nonzero value as 0
        low = ~torch.tensor(signed) & (normed < DYNAMIC_CEIL_BELOW)
        if dither is None:
            codes = _nearest(normed, dynamic_map(signed, x.device))
            if bool(low.any()):
                codes = torch.where(low, _dynamic_rounded(normed, signed, torch.full_like(normed, _CEIL)), codes)
        else:
            codes = _dynamic_rounded(normed, signed, torch.where(low, _CEIL, d))
        if not signed:
            codes = torch.maximum(codes, nonzero.long())
    if fmt == "power" and dither is not None:
        absmax = (absmax * (POWER_COMP_SIGNED if signed else POWER_COMP_UNSIGNED)).clamp_max(F32_MAX)
    return codes.to(torch.uint8).view(x.shape), absmax


def dequantize_state_reference(codes: Tensor, absmax: Tensor, fmt: str, signed: bool, block_size: int) -> Tensor:
    """Float32 values of state codes (inverse of :func:`quantize_state_reference`)."""
    if fmt == "dynamic":
        return dequantize_blockwise_reference(codes, absmax, dynamic_map(signed, codes.device), block_size)
    if fmt != "power":
        raise ValueError(f"unknown state format {fmt!r}; known: {STATE_FORMATS}")
    return dequantize_blockwise_reference(codes, absmax, state_map("power", signed, codes.device), block_size)

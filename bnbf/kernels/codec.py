"""Triton encode/decode of the dynamic map, and the stand-alone block-wise quantize/dequantize kernels.

Decoding is one gather from the 256-entry map (1 KiB, stays in L1). Encoding the default dynamic maps is
arithmetic instead of a search: inside decade ``i`` (values in [10**(i-7), 10**(i-6))) the codes are
the centres of ``n_i`` equal bins, so the nearest code is ``floor(t)`` of the position ``t`` of ``|x|`` in
those bins, except near a decade's lower edge where the last code of the decade below (or zero) can be
nearer. A binary search would cost 8 dependent gathers per value; a probe kernel measured table
searches at a third of the copy bandwidth. Ranks are contiguous across decades, which is what makes the
edge cases one ``where`` each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from bnbf import quant
from bnbf._dispatch import interpreting

# Compiled kernels use the hardware's approximate division; the interpreter has no such instruction.
_COMPILED = tl.constexpr(not interpreting())


@triton.jit
def fast_div(a, b):
    """a / b to about 2 ulp: one reciprocal and one multiply (IEEE division costs ~8 instructions more
    per element, 69 -> 61 instructions per element in the AdamW step)."""
    if _COMPILED:
        return libdevice.fast_dividef(a, b)
    else:
        return a / b


@triton.jit
def _round(x):
    """Round-half-even of float32 |x| < 2**22 to int32 with two full-rate instructions (no F2I)."""
    return (x + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000


@triton.jit
def power_root_scale(absmax, SIGNED: tl.constexpr):
    """The multiplier :func:`encode_power_scaled` takes for a block of absmax ``absmax``:
    127 / sqrt(absmax) (signed) or 255 / absmax ** 0.25, and 0 for an all-zero block. One or two
    reciprocal roots per block replace a division per block and a multiply per element."""
    r = tl.where(absmax > 0, tl.rsqrt(tl.where(absmax > 0, absmax, 1.0)), 0.0)
    if SIGNED:
        return r * (127.0 * POWER_MARGIN)
    else:
        return tl.sqrt(r) * (255.0 * POWER_MARGIN)


@triton.jit
def power_absmax(absmax, SIGNED: tl.constexpr):
    """The absmax a block of power codes is stored with: times the inverse of the margin's scaling of its decoded
    values (:data:`bnbf.quant.POWER_COMP_SIGNED`), so that they are unbiased."""
    if SIGNED:
        return tl.minimum(absmax * POWER_COMP_SIGNED, F32_MAX)
    else:
        return tl.minimum(absmax * POWER_COMP_UNSIGNED, F32_MAX)


@triton.jit
def encode_power_scaled(s, root_scale, SIGNED: tl.constexpr, d=0.0):
    """Code of ``s / absmax`` in the "power" format (signed states: 128 + sign(x) * 127 * sqrt|x|, non-negative
    states: 255 * x ** 0.25, rounded as below) given ``root_scale = power_root_scale(absmax)``: the scale
    applies in the root domain (sqrt(|s| / absmax) = sqrt|s| / sqrt(absmax)), folded into the rounding's
    multiply. Non-negative states are read through |s|, which the root instruction takes for free.

    ``d`` in (-0.5, 0.5) offsets the code position before rounding: :func:`dither` rounds stochastically
    (unbiased in the code position); the scale's ``POWER_MARGIN`` keeps position plus offset below the top code
    plus 1/2 without a clamp. Non-negative states never encode a nonzero value below code ``POWER_FLOOR`` (the zero
    point: see :mod:`bnbf.quant`)."""
    if SIGNED:
        t = tl.sqrt(tl.abs(s)) * root_scale
        # below code 1 the value is t**2: rounding t itself would store tiny first moments 1/t too large on average
        t = t * tl.minimum(t, 1.0) + d  # t**2 below 1, t above: no compare and select
        sign = s.to(tl.uint32, bitcast=True) & 0x80000000
        t = (t.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)  # copysign: one logic op
        return (t + (12582912.0 + 128.0)).to(tl.int32, bitcast=True) - 0x4B400000  # 128 + round(t)
    else:
        t = tl.sqrt(tl.sqrt(tl.abs(s))) * root_scale
        # the floor for s > 0, 0 for s == 0 (and for -0.0), in one integer min: a non-negative float's bits, read as an
        # int, are 0 only for 0 (and below 5.6e-45 the floor is those bits: still not 0)
        return tl.maximum(_round(t + d), tl.minimum(s.to(tl.int32, bitcast=True), POWER_FLOOR))


# the zero point's constants (bnbf.quant says why)
_CEIL: tl.constexpr = tl.constexpr(quant._CEIL)
POWER_FLOOR: tl.constexpr = tl.constexpr(quant.POWER_FLOOR)
POWER_MARGIN: tl.constexpr = tl.constexpr(quant.POWER_MARGIN)
POWER_COMP_SIGNED: tl.constexpr = tl.constexpr(quant.POWER_COMP_SIGNED)
POWER_COMP_UNSIGNED: tl.constexpr = tl.constexpr(quant.POWER_COMP_UNSIGNED)
F32_MAX: tl.constexpr = tl.constexpr(quant.F32_MAX)
DYNAMIC_CEIL_BELOW: tl.constexpr = tl.constexpr(quant.DYNAMIC_CEIL_BELOW)


@triton.jit
def mix(h):
    """Half of a 32-bit integer hash (xor-shift, multiply, xor-shift) of uint32 ``h``."""
    h = h ^ (h >> 16)
    h = h * DITHER_MIX
    return h ^ (h >> 15)


@triton.jit
def dither(lane, seed):
    """Offsets in (-0.5, 0.5) for stochastic rounding: the top 22 bits of ``lane`` (uint32, each element's place
    in its block times an odd constant) plus ``seed`` (uint32, a hash of the block and the step: one per tile).
    Three integer ops and one float op per element; bnbf.quant.state_dither is the same in torch."""
    h = lane + seed
    # the float 1 + (2k + 1) / 2**23, k the top 22 bits of h: minus 1.5 strictly inside (-0.5, 0.5), so a value
    # sitting on a code never rounds away (one or-with-constant instead of a mask and an or)
    return ((h >> 9) | 0x3F800001).to(tl.float32, bitcast=True) - 1.5


DITHER_MIX: tl.constexpr = tl.constexpr(quant.DITHER_MIX)


@triton.jit
def _code_bits(q):
    """uint8 codes -> int32 ``0x4B000000 | q``: float32 bits of 2**23 + q. Compiled, one byte permute
    per code (four codes of a 32-bit word at a time) instead of an extract and an or."""
    if _COMPILED:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 hi; mov.b32 hi, 0x4B000000; prmt.b32 $0, $4, hi, 0x7650; prmt.b32 $1, $4, hi, 0x7651;"
            " prmt.b32 $2, $4, hi, 0x7652; prmt.b32 $3, $4, hi, 0x7653; }",
            "=r,=r,=r,=r,r",
            [q],
            dtype=tl.int32,
            is_pure=True,
            pack=4,
        )
    else:
        return q.to(tl.int32) | 0x4B000000


@triton.jit
def widen(x, sign):
    """Loaded param or grad ``x`` as float32, times ``sign`` (1.0 or -1.0: maximize; None: 1). A bfloat16's
    float32 bits are its bits shifted up 16: compiled, one instruction an element of each 32-bit pair, the sign
    flip folded in (shift-add for the low half, and-xor for the high one; a convert takes 1.5, the multiply 1)."""
    if _COMPILED and x.dtype == tl.bfloat16:
        if sign is None:
            y = tl.inline_asm_elementwise(
                "shl.b32 $0, $2, 16; and.b32 $1, $2, 0xFFFF0000;", "=r,=r,r", [x], dtype=tl.int32, is_pure=True, pack=2
            )
        else:
            flip = tl.full(x.shape, 0, tl.int32) | (sign.to(tl.int32, bitcast=True) & -0x80000000)
            y = tl.inline_asm_elementwise(
                "mad.lo.u32 $0, $2, 65536, $3; and.b32 $1, $2, 0xFFFF0000; xor.b32 $1, $1, $4;",
                "=r,=r,r,r,r",
                [x, flip],
                dtype=tl.int32,
                is_pure=True,
                pack=2,
            )
        return y.to(tl.float32, bitcast=True)
    elif sign is None:
        return x.to(tl.float32)
    else:
        return x.to(tl.float32) * sign


@triton.jit
def decode_power(q, absmax, SIGNED: tl.constexpr):
    """Values of uint8 codes ``q`` (a tile's rows) in the "power" format, for blocks of absmax ``absmax`` (one per
    row). The block scale enters in the root domain, sqrt(absmax) / 127 (signed) or / 255**2, and the root is
    squared last: folding absmax / 255**4 into one factor made it subnormal below absmax 5e-29 and 0 below
    5.8e-36 (a second moment of gradients near 1e-18), where only the true value should underflow. Same number
    of multiplies per element; one root per row."""
    f = _code_bits(q).to(tl.float32, bitcast=True)
    root = tl.sqrt(absmax)[:, None]
    if SIGNED:
        t = (f - (8388608.0 + 128.0)) * (root * (1.0 / 127.0))  # (q - 128) * sqrt(absmax) / 127
        return t * tl.abs(t)
    else:
        f = f - 8388608.0  # exactly q
        t = (f * f) * (root * (1.0 / (255.0 * 255.0)))
        return t * t


@triton.jit
def _decade_step(a, edge, s_new, b_new, i_new, s, b, i):
    up = a >= edge
    return tl.where(up, s_new, s), tl.where(up, b_new, b), tl.where(up, i_new, i)


@triton.jit
def encode_dynamic(x, SIGNED: tl.constexpr):
    """Index (int32, 0..255) of the default dynamic-map value nearest to ``x`` (float32 in [-1, 1]).

    Signed map: index 127 is 0, 128 + r the r-th positive value, 126 - r the r-th negative value.
    Unsigned map: index 0 is 0, 1 + r the r-th positive value. Decade i holds n_i = 2**(i + K) values
    (K = 1 for the unsigned map) starting at rank n_i - 1 - K; rank -1 is zero.

    The decade comes from six comparisons and its constants from a select chain; floor() is the float32
    round-to-integer trick (add 1.5 * 2**23, read the bits). Decoding is one gather from the map. A
    log2-based decade and an arithmetic decoder were measured too (H200, 1.07B params): no faster.
    """
    if SIGNED:
        K: tl.constexpr = 0
        a = tl.minimum(tl.abs(x), 1.0)
        s = tl.full(a.shape, 1.0e6 * 1 / 0.9, tl.float32)
        b = tl.full(a.shape, 0.1 / 0.9 + 0.5, tl.float32)
        i = tl.zeros(a.shape, tl.int32)
        s, b, i = _decade_step(a, 1e-6, 1e5 * 2 / 0.9, 0.2 / 0.9 + 0.5, 1, s, b, i)
        s, b, i = _decade_step(a, 1e-5, 1e4 * 4 / 0.9, 0.4 / 0.9 + 0.5, 2, s, b, i)
        s, b, i = _decade_step(a, 1e-4, 1e3 * 8 / 0.9, 0.8 / 0.9 + 0.5, 3, s, b, i)
        s, b, i = _decade_step(a, 1e-3, 1e2 * 16 / 0.9, 1.6 / 0.9 + 0.5, 4, s, b, i)
        s, b, i = _decade_step(a, 1e-2, 1e1 * 32 / 0.9, 3.2 / 0.9 + 0.5, 5, s, b, i)
        s, b, i = _decade_step(a, 1e-1, 64 / 0.9, 6.4 / 0.9 + 0.5, 6, s, b, i)
        thr0: tl.constexpr = 0.19444444444444445 - 0.5
    else:
        K: tl.constexpr = 1
        a = tl.minimum(tl.maximum(x, 0.0), 1.0)
        s = tl.full(a.shape, 1.0e6 * 2 / 0.9, tl.float32)
        b = tl.full(a.shape, 0.2 / 0.9 + 0.5, tl.float32)
        i = tl.zeros(a.shape, tl.int32)
        s, b, i = _decade_step(a, 1e-6, 1e5 * 4 / 0.9, 0.4 / 0.9 + 0.5, 1, s, b, i)
        s, b, i = _decade_step(a, 1e-5, 1e4 * 8 / 0.9, 0.8 / 0.9 + 0.5, 2, s, b, i)
        s, b, i = _decade_step(a, 1e-4, 1e3 * 16 / 0.9, 1.6 / 0.9 + 0.5, 3, s, b, i)
        s, b, i = _decade_step(a, 1e-3, 1e2 * 32 / 0.9, 3.2 / 0.9 + 0.5, 4, s, b, i)
        s, b, i = _decade_step(a, 1e-2, 1e1 * 64 / 0.9, 6.4 / 0.9 + 0.5, 5, s, b, i)
        s, b, i = _decade_step(a, 1e-1, 128 / 0.9, 12.8 / 0.9 + 0.5, 6, s, b, i)
        thr0: tl.constexpr = 0.1388888888888889 - 0.5
    u = a * s - b  # position among the decade's bins, minus one half
    n = tl.full(i.shape, 1, tl.int32) << (i + K)
    k = _round(u)  # = floor(u + 0.5): floor of the position
    k = tl.minimum(k, n - 1)
    k = tl.where(u < tl.where(i == 0, thr0, -0.3), -1, k)
    top = (i == 6) & (u >= n.to(tl.float32) - 0.75)
    if SIGNED:
        top = top & (x > 0)
    k = tl.where(top, n, k)
    rank = n - 1 - K + k
    if SIGNED:
        idx = tl.where(x < 0, 126 - rank, 128 + rank)
    else:
        idx = 1 + rank
    return idx


@triton.jit
def _decade_sn(a, edge, s_new, n_new, s, n):
    up = a >= edge
    return tl.where(up, s_new, s), tl.where(up, n_new, n), up


@triton.jit
def encode_dynamic_stochastic(x, d, SIGNED: tl.constexpr):
    """The step's dynamic-map code of ``x`` (float32 in [-1, 1]): the bin position ``u`` of :func:`encode_dynamic`
    plus ``d`` (from :func:`dither`), rounded, so unbiased in the value: codes are evenly spaced within a decade,
    and the gaps to the neighbouring decades' end codes are scaled to one bin (below code 0 the previous decade's
    last code, or zero, sits at -b; above code n - 1 the next decade's first code at n + 2, the code of 1.0 at
    n - 0.5). Without the scaling, tiny first moments rounded up to decade 0's code 39% of the time and grew.

    Laid out for the instruction count (the AdamW step's sm_90 SASS: 3128 -> 2648 instructions with float32
    params, 3032 -> 2680 with bf16, against a select chain of every constant and clamps on the integer code): the
    chain carries only the scale and n (as a float); b = n / 9 + 1/2 is one exact multiply-add; the clamps act on
    the position before rounding; the rank's offset rides in the rounding's magic constant. Equal to
    bnbf.quant._dynamic_rounded up to the rounding of the gap scaling (a multiply-add here)."""
    # |x| is an operand modifier, free; |x| > 1 by rounding needs no clamp: the clamp of v below covers it
    a = tl.abs(x)
    if SIGNED:
        s = tl.full(a.shape, 1.0e6 * 1 / 0.9, tl.float32)
        n = tl.full(a.shape, 1.0, tl.float32)
        s, n, up = _decade_sn(a, 1e-6, 1e5 * 2 / 0.9, 2.0, s, n)
        # the lower gap's scale, minus 1: decade 0's lower neighbour is zero, at -b
        low_gap = tl.where(up, 1.0 / 0.6 - 1.0, 1.0 / (0.1 / 0.9 + 0.5) - 1.0)
        s, n, up = _decade_sn(a, 1e-5, 1e4 * 4 / 0.9, 4.0, s, n)
        s, n, up = _decade_sn(a, 1e-4, 1e3 * 8 / 0.9, 8.0, s, n)
        s, n, up = _decade_sn(a, 1e-3, 1e2 * 16 / 0.9, 16.0, s, n)
        s, n, up = _decade_sn(a, 1e-2, 1e1 * 32 / 0.9, 32.0, s, n)
        s, n, up = _decade_sn(a, 1e-1, 64 / 0.9, 64.0, s, n)
    else:
        s = tl.full(a.shape, 1.0e6 * 2 / 0.9, tl.float32)
        n = tl.full(a.shape, 2.0, tl.float32)
        s, n, up = _decade_sn(a, 1e-6, 1e5 * 4 / 0.9, 4.0, s, n)
        low_gap = tl.where(up, 1.0 / 0.6 - 1.0, 1.0 / (0.2 / 0.9 + 0.5) - 1.0)
        s, n, up = _decade_sn(a, 1e-5, 1e4 * 8 / 0.9, 8.0, s, n)
        s, n, up = _decade_sn(a, 1e-4, 1e3 * 16 / 0.9, 16.0, s, n)
        s, n, up = _decade_sn(a, 1e-3, 1e2 * 32 / 0.9, 32.0, s, n)
        s, n, up = _decade_sn(a, 1e-2, 1e1 * 64 / 0.9, 64.0, s, n)
        s, n, up = _decade_sn(a, 1e-1, 128 / 0.9, 128.0, s, n)
    high_gap = tl.where(up, 2.0 - 1.0, 1.0 / 3.0 - 1.0)  # the top decade's upper neighbour is 1.0, half a bin above
    b = n * (1.0 / 9.0) + 0.5  # = 0.1 * n / 0.9 + 0.5 exactly in float32 for these n (n a power of two)
    u = a * s - b
    # the gaps scaled to one bin: u * scale below 0 and top + (u - top) * scale above top, as min/max and a
    # multiply-add each (no compare and select)
    u = tl.minimum(u, 0.0) * low_gap + u
    top = n - 1.0
    u = tl.maximum(u - top, 0.0) * high_gap + u
    # k = round(v) in [-1, n]: -1 and n are the neighbouring decades' codes (round commutes with integer clamps)
    v = tl.minimum(tl.maximum(u + d, -1.0), n)
    if SIGNED:
        # 128 + rank (x >= 0) or 126 - rank (x < 0), rank = n - 1 + k: 127 +- (k + n); zero gives k = -1, n = 1
        m = (v + 12582912.0) - 12582912.0 + n  # k + n, an integer in float32
        m = (m.to(tl.uint32, bitcast=True) | (x.to(tl.uint32, bitcast=True) & 0x80000000)).to(tl.float32, bitcast=True)
        m = tl.maximum(m, -127.0)  # the signed map has no code for -1.0
        return (m + (12582912.0 + 127.0)).to(tl.int32, bitcast=True) - 0x4B400000
    else:
        # 1 + rank = n - 1 + k; the rounding's magic constant carries the offset
        return (v + (n + (12582912.0 - 1.0))).to(tl.int32, bitcast=True) - 0x4B400000


@triton.jit
def encode_dynamic_rounded(x, s, d, SIGNED: tl.constexpr):
    """The step's dynamic-map code of ``x`` (= ``s`` / absmax): stochastically rounded by ``d``; non-negative
    states round up below ``DYNAMIC_CEIL_BELOW`` and never encode a nonzero value as 0 (the zero point: see
    :mod:`bnbf.quant`)."""
    if not SIGNED:
        d = tl.where(x < DYNAMIC_CEIL_BELOW, _CEIL, d)
    q = encode_dynamic_stochastic(x, d, SIGNED)
    if not SIGNED:
        # at least code 1 for s > 0: a positive float's bits, read as an int, are >= 1 (0 for 0, < 0 for -0.0)
        q = tl.maximum(q, tl.minimum(s.to(tl.int32, bitcast=True), 1))
    return q


@triton.jit
def to_dtype(x, DTYPE: tl.constexpr, SOFT_BF16: tl.constexpr):
    """float32 -> DTYPE with round-to-nearest-even. The interpreter truncates float32 -> bfloat16, so
    under it (SOFT_BF16) the rounding is done on the bits; compiled kernels use the hardware convert."""
    if SOFT_BF16 and tl.bfloat16 == DTYPE:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def encode_search(x, code_ptr):
    """Index of the nearest value of an arbitrary sorted 256-value map (binary search, 8 gathers)."""
    lo = tl.zeros(x.shape, tl.int32)
    for s in tl.static_range(7, -1, -1):
        cand = lo + (1 << s)
        lo = tl.where(tl.load(code_ptr + cand) <= x, cand, lo)
    hi = tl.minimum(lo + 1, 255)
    c_lo = tl.load(code_ptr + lo)
    c_hi = tl.load(code_ptr + hi)
    return tl.where(tl.abs(c_hi - x) < tl.abs(x - c_lo), hi, lo)


FLOAT32_TINY: tl.constexpr = tl.constexpr(float(torch.finfo(torch.float32).tiny))
SUBNORMAL_LIFT: tl.constexpr = tl.constexpr(quant.SUBNORMAL_LIFT)


@triton.jit
def _max_with_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _quantize_kernel(
    x_ptr,
    codes_ptr,
    absmax_ptr,
    code_ptr,
    numel,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    ARITHMETIC: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = row[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = offs < numel
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # NaN-propagating, as torch.amax: the caller refuses a block holding a NaN by its absmax
    absmax = tl.reduce(tl.abs(x), 1, _max_with_nan)
    # below the normal range 1 / absmax can overflow: such a block is first scaled up by SUBNORMAL_LIFT (exact)
    lift = tl.where(absmax < FLOAT32_TINY, SUBNORMAL_LIFT, 1.0)
    scaled = absmax * lift
    scale = tl.where(scaled > 0, 1.0 / tl.where(scaled > 0, scaled, 1.0), 0.0)
    xn = (x * lift[:, None]) * scale[:, None]
    if ARITHMETIC:
        q = encode_dynamic(xn, True)
    else:
        q = encode_search(xn, code_ptr)
    tl.store(codes_ptr + offs, q.to(tl.uint8), mask=mask)
    tl.store(absmax_ptr + row, absmax, mask=row * BLOCK < numel)


@triton.jit
def _dequantize_kernel(
    codes_ptr,
    absmax_ptr,
    code_ptr,
    out_ptr,
    numel,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    SOFT_BF16: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = row[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = offs < numel
    q = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.int32)
    absmax = tl.load(absmax_ptr + row, mask=row * BLOCK < numel, other=0.0)
    y = tl.load(code_ptr + q) * absmax[:, None]
    tl.store(out_ptr + offs, to_dtype(y, out_ptr.dtype.element_ty, SOFT_BF16), mask=mask)


def _rows(block: int) -> int:
    return max(1, 1024 // block)


def quantize_blockwise_triton(x: torch.Tensor, code: torch.Tensor, block: int, arithmetic: bool):
    """Launcher: ``x`` contiguous; ``arithmetic`` selects the search-free encoder of the default map."""
    n = x.numel()
    nblocks = -(-n // block)
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    absmax = torch.empty(nblocks, dtype=torch.float32, device=x.device)
    rows = _rows(block)
    _quantize_kernel[(triton.cdiv(nblocks, rows),)](
        x, codes, absmax, code, n, BLOCK=block, ROWS=rows, ARITHMETIC=arithmetic
    )
    return codes, absmax


def dequantize_blockwise_triton(codes, absmax, code, block: int, dtype: torch.dtype):
    n = codes.numel()
    out = torch.empty(codes.shape, dtype=dtype, device=codes.device)
    rows = _rows(block)
    nblocks = -(-n // block)
    _dequantize_kernel[(triton.cdiv(nblocks, rows),)](
        codes, absmax, code, out, n, BLOCK=block, ROWS=rows, SOFT_BF16=interpreting()
    )
    return out

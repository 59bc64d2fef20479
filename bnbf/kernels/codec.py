"""Triton encode/decode of the dynamic map, and the stand-alone block-wise quantize/dequantize kernels.

Decoding is one gather from the 256-entry map (1 KiB, stays in L1). Encoding the default dynamic maps is
arithmetic instead of a search: inside decade ``i`` (values in [10**(i-7), 10**(i-6))) the codes are
the centres of ``n_i`` equal bins, so the nearest code is ``floor(t)`` of the position ``t`` of ``|x|`` in
those bins, except near a decade's lower edge where the last code of the decade below (or zero) can be
nearer. A binary search would cost 8 dependent gathers per value; the ANCHORS.md probe measured table
searches at a third of the copy bandwidth. Ranks are contiguous across decades, which is what makes the
edge cases one ``where`` each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bnbf._dispatch import interpreting

_LOG10_2 = tl.constexpr(0.30102999566398120)
_LOG2_10 = tl.constexpr(3.3219280948873623)
_INV_09 = tl.constexpr(1.1111111111111112)


@triton.jit
def encode_dynamic(x, SIGNED: tl.constexpr):
    """Index (int32, 0..255) of the default dynamic-map value nearest to ``x`` (float32 in [-1, 1]).

    Signed map: index 127 is 0, 128 + r the r-th positive value, 126 - r the r-th negative value.
    Unsigned map: index 0 is 0, 1 + r the r-th positive value. Decade i holds n_i = 2**(i + K) values
    (K = 1 for the unsigned map) starting at rank n_i - 1 - K; rank -1 is zero.
    """
    if SIGNED:
        K: tl.constexpr = 0
        a = tl.minimum(tl.abs(x), 1.0)
    else:
        K: tl.constexpr = 1
        a = tl.minimum(tl.maximum(x, 0.0), 1.0)
    # decade from log10; an error of one at a decade edge still lands on the right code (see below)
    d = tl.minimum(tl.maximum(tl.floor(tl.log2(tl.maximum(a, 1e-30)) * _LOG10_2) + 7.0, 0.0), 6.0)
    i = d.to(tl.int32)
    n = tl.full(i.shape, 1, tl.int32) << (i + K)
    nf = n.to(tl.float32)
    t = (a * tl.exp2((6.0 - d) * _LOG2_10) - 0.1) * (nf * _INV_09)
    k = tl.minimum(tl.floor(t).to(tl.int32), n - 1)
    # below this position the previous decade's top code (or zero, for decade 0) is nearer
    if SIGNED:
        thr0: tl.constexpr = 0.19444444444444445
    else:
        thr0: tl.constexpr = 0.1388888888888889
    k = tl.where(t < tl.where(i == 0, thr0, 0.2), -1, k)
    # the map's 1.0 sits above the top decade (positive side only for the signed map)
    top = (i == 6) & (t >= nf - 0.25)
    if SIGNED:
        top = top & (x > 0)
    k = tl.where(top, n, k)
    rank = n - 1 - K + k
    if SIGNED:
        idx = tl.where(x < 0, 126 - rank, 128 + rank)
    else:
        idx = 1 + rank
    return idx


def _decode_constants(K: int):
    """Rows j (0 = zero, e + 1 for w in [2**e, 2**(e+1)), last = the 1.0 code): value = P_j * m + Q_j."""
    rows = [(0.0, 0.0)]
    for e in range(7 + K):
        i = e - K
        if i < 0:  # the unsigned map has no decade below 0: w = 1 is the zero code
            rows.append((0.0, 0.0))
            continue
        rows.append((0.9 * 10.0 ** (i - 6), 10.0 ** (i - 6) * (0.45 / 2**e - 0.8)))
    rows.append((0.0, 1.0))
    while len(rows) < 10:
        rows.append((0.0, 1.0))
    return rows


def decode_tables() -> list[float]:
    """The 2 x 10 (P, Q) rows of :func:`decode_dynamic_arith`, signed first, as a flat float list."""
    out: list[float] = []
    for K in (0, 1):
        for p, q in _decode_constants(K):
            out += [p, q]
    return out


@triton.jit
def _decade_step(a, edge, s_new, b_new, i_new, s, b, i):
    up = a >= edge
    return tl.where(up, s_new, s), tl.where(up, b_new, b), tl.where(up, i_new, i)


@triton.jit
def encode_dynamic_cmp(x, SIGNED: tl.constexpr):
    """Same result as :func:`encode_dynamic`, without transcendental or conversion instructions.

    The decade comes from six comparisons, its constants from a select chain, and floor() from the
    float32 round-to-integer trick (add 1.5 * 2**23, read the bits); those run at full rate where
    log2/exp2/float-to-int run at a quarter.
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
    k = (u + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000  # round(u) = floor(u + 0.5)
    n = tl.full(i.shape, 1, tl.int32) << (i + K)
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
def decode_dynamic_arith(q, pq_ptr, SIGNED: tl.constexpr):
    """Value of code ``q`` (int32) of the default dynamic map, to within 2 ulp of the map's float32 value.

    With w = rank + 1 (+1 more for the unsigned map), codes with 2**e <= w < 2**(e+1) form decade
    e - K, and their values are linear in w / 2**e: P_e * m + Q_e with m the mantissa of float(w).
    ``pq_ptr`` holds the (P, Q) rows (see ``decode_tables``), 80 bytes, always in L1.
    """
    if SIGNED:
        w = tl.abs(q - 127)
        rows = pq_ptr
    else:
        w = q + 1
        rows = pq_ptr + 20
    bits = (w | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0  # float(w), exact
    bits = bits.to(tl.int32, bitcast=True)
    j = tl.maximum((bits >> 23) - 126, 0)
    m = ((bits & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
    v = tl.load(rows + 2 * j) * m + tl.load(rows + 2 * j + 1)
    if SIGNED:
        v = tl.where(q < 127, -v, v)
    return v


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


@triton.jit
def _quantize_kernel(
    x_ptr, codes_ptr, absmax_ptr, code_ptr, numel,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, ARITHMETIC: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = row[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = offs < numel
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    absmax = tl.max(tl.abs(x), axis=1)
    scale = tl.where(absmax > 0, 1.0 / tl.where(absmax > 0, absmax, 1.0), 0.0)
    xn = x * scale[:, None]
    if ARITHMETIC:
        q = encode_dynamic(xn, True)
    else:
        q = encode_search(xn, code_ptr)
    tl.store(codes_ptr + offs, q.to(tl.uint8), mask=mask)
    tl.store(absmax_ptr + row, absmax, mask=row * BLOCK < numel)


@triton.jit
def _dequantize_kernel(
    codes_ptr, absmax_ptr, code_ptr, out_ptr, numel,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, SOFT_BF16: tl.constexpr,
):  # fmt: skip
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

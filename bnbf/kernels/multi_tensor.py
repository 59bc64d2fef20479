"""The fused multi-tensor optimizer step: one Triton launch updates every tensor of a group.

Three layers:

- ``_step_kernel``: each program takes ``ITERS`` tiles of ``ROWS`` quantization blocks of one tensor,
  found through a task list (tensor index, chunk index). It dequantizes the states, runs the rule's
  ``math`` in float32, writes the param in its own dtype and requantizes each state with the block's new
  absmax. Rules that need per-tensor norms (and ``max_unorm``) run it twice: a norm pass writing per-tile
  partial sums, then the step reading the per-tensor sums.
- ``build_group`` / ``launch_group``: the address table and task list of a group (built once; the
  functional layer caches them in its plans), and the launch(es) of one step with that step's grad
  pointers and scalars. They check nothing: the functional layer validated.
- ``bnbf::step_`` / ``bnbf::step`` (:mod:`bnbf.ops`): the ``torch.library`` ops, with fake implementations,
  through which traced calls reach ``launch``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import operator
import os
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from bnbf import quant
from bnbf._dispatch import interpreting
from bnbf.kernels.codec import (
    decode_power,
    dither,
    encode_dynamic_rounded,
    encode_power_scaled,
    mix,
    power_root_scale,
    to_dtype,
)
from bnbf.quant import dynamic_map
from bnbf.rules import get_rule

# stochastic rounding's dither (codec.dither; the constants and their meaning are in bnbf.quant)
DITHER_LANE: tl.constexpr = tl.constexpr(quant.DITHER_LANE)
DITHER_BLOCK: tl.constexpr = tl.constexpr(quant.DITHER_BLOCK)
DITHER_STEP: tl.constexpr = tl.constexpr(quant.DITHER_STEP)
# The address table: a row per tensor of HEAD fields (param in, param out, numel), then PER_SLOT fields for
# each of the rule's state slots (state in, state out, absmax in, absmax out; zeros for a slot not kept)
HEAD: tl.constexpr = tl.constexpr(3)
PER_SLOT: tl.constexpr = tl.constexpr(4)
# Tile: one 256-element block per program and one warp (the block's absmax reduction then needs no
# shared memory or barrier). Measured on the H200, 1.07B params, power format, fp32 params: 1 block x
# 1 warp 4.26 ms, 2 x 1 4.82, 2 x 2 4.62, 4 x 4 4.74.
ROWS = 1  # quantization blocks per program
NUM_WARPS = 1
# Elements per thread per load. The power format runs best with 16-byte fp32 loads (VEC=4: 4.26 ms
# against 4.71 with VEC=1); the dynamic map, with its larger code, with VEC=1 (7.30 ms against 9.19).
VEC = {"fp32": 4, "power": 4, "dynamic": 1}
# Tiles per program, by state format and param dtype, and PREFETCH by state format: whole tiles are
# unrolled and each issues the next tile's loads before its own arithmetic, so a program keeps loads in
# flight while it computes. Re-measured with the stochastic rounding at 59.5 instructions per element
# (scripts/tune_step.py, H200, 1.07B params, AdamW; benchmarks/results/2026-12-01_h200_session8.md): power
# format, fp32 params 4 prefetched tiles under an 80-register cap 4.12 ms (2 tiles 4.17, 1 tile 4.42); bf16
# params 4 prefetched tiles under a 64-register cap 2.78 (cap 72 2.82, cap 80 2.97, no cap 3.50; 2 tiles 2.97;
# 8 unprefetched 2.81); dynamic map, bf16 params, one tile 8.45 ms (4 tiles 23.3, under a cap of 64 21.5: its
# code spills).
# Software pipelining through shared memory (tl.range num_stages > 1) was measured slower (4.4-5.3 ms).
_TWO_BYTE = {torch.bfloat16: 4, torch.float16: 4}
ITERS = {
    "fp32": {torch.float32: 2, **_TWO_BYTE},
    "power": {torch.float32: 4, **_TWO_BYTE},
    "dynamic": {torch.float32: 1, torch.bfloat16: 1, torch.float16: 1},
}
PREFETCH = {"fp32": True, "power": True, "dynamic": False}
# ... and only while tiles x kept states stays small: beyond, the unrolled tiles' registers cost more than
# the loads in flight gain. 1.07B params, bf16 params (4 tiles), H200, bench_step.py, ms without / with
# prefetch: AdamW 3.36 / 3.11 (2 states), RMSprop 2.28 / 2.10, Lion 2.25 / 2.12, Adagrad 2.26 / 2.12 (1 state),
# AdEMAMix 3.91 / 5.48 (3 states), LAMB 5.19 / 5.78 (2 states, norm pass and step); fp32 params (2 tiles):
# AdEMAMix 5.73 / 5.45. Re-measured under the register cap (MAXNREG; scripts/tune_step.py --slots, do_bench,
# ms): LAMB bf16 with the norm pass prefetched 4.74 against 4.85 (the step after it prefetched too: 4.95),
# AdEMAMix bf16 prefetched 3.50 against 3.46, AdamW bf16 unprefetched 3.01 against 2.70.
PREFETCH_SLOTS = {0: 8, 1: 8, 2: 4}  # by NORM_MODE: the plain step, the norm pass, the step after it


def _prefetch(fmt: str, dtype: torch.dtype, present: int, mode: int) -> bool:
    return PREFETCH[fmt] and ITERS[fmt][dtype] * bin(present).count("1") <= PREFETCH_SLOTS[mode]


# Register cap per thread (ptxas maxnreg), by state format and param dtype; absent leaves it to ptxas. A
# one-warp program is one of at most 32 resident blocks per SM, so registers cost resident warps. Measured
# after the stochastic rounding (H200, scripts/tune_step.py, ms without / with the cap): power format, AdamW,
# 1.07B set, fp32 params 4.78 / 4.12 (cap 80), bf16 params 3.74 / 3.31 (cap 64); cap 64 with bf16 params:
# AdEMAMix 7.12 / 4.92, LAMB 5.40 / 5.02, LARS 3.18 / 3.17, Lion 2.14 / 2.17; dynamic map, fp32 params
# 9.43 / 8.81 (cap 64), bf16 params: no cap (above). float32 states are not capped (5.64 / 7.93 with 64
# before). float16 params share bf16's caps.
_CAP_TWO_BYTE = {torch.bfloat16: 64, torch.float16: 64}
MAXNREG = {"fp32": {}, "power": {torch.float32: 80, **_CAP_TWO_BYTE}, "dynamic": {torch.float32: 64}}

FORMATS = {"fp32": 0, "dynamic": 1, "power": 2}  # the FORMAT constexpr of each state format
_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _ld(ptr, mask, other, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptr, mask=mask, other=other)
    return tl.load(ptr)


@triton.jit
def _st(ptr, value, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr, value, mask=mask)
    else:
        tl.store(ptr, value)


@triton.jit
def _addr(table, field, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """Pointer stored in the address table; 16-byte alignment (checked on the host) lets loads vectorize."""
    ptr = tl.load(table + field).to(tl.pointer_type(DTYPE))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def _slot_ptrs(table, SLOT: tl.constexpr, PRESENT: tl.constexpr, QUANT: tl.constexpr, ALIGNED: tl.constexpr):
    """(in, out, absmax in, absmax out) of state slot ``SLOT``: codes and scales for 8-bit formats,
    float32 values (and two unused fields) otherwise; placeholders for a slot the group does not keep."""
    base: tl.constexpr = HEAD + PER_SLOT * SLOT
    if (PRESENT >> SLOT) & 1:
        if QUANT:
            return (_addr(table, base, tl.uint8, ALIGNED), _addr(table, base + 1, tl.uint8, ALIGNED),
                    tl.load(table + base + 2).to(tl.pointer_type(tl.float32)),
                    tl.load(table + base + 3).to(tl.pointer_type(tl.float32)))  # fmt: skip
        else:
            s_in = _addr(table, base, tl.float32, ALIGNED)
            s_out = _addr(table, base + 1, tl.float32, ALIGNED)
            return s_in, s_out, s_in, s_out
    else:
        return table, table, table, table


@triton.jit
def _tile_offsets(chunk, numel, BLOCK: tl.constexpr, ROWS: tl.constexpr, VEC: tl.constexpr):
    rows = chunk * ROWS + tl.arange(0, ROWS)  # int64: tensors may exceed 2**31 elements
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    # the same vector width for every load (fp32, bf16 and uint8) keeps one register layout for the
    # whole tile; otherwise each width gets its own layout and shared-memory conversions between them
    offs = tl.max_contiguous(tl.multiple_of(offs, [BLOCK, VEC]), [1, VEC])
    return rows, offs, offs < numel, rows * BLOCK < numel


@triton.jit
def _load_slot(sp, offs, mask, rows, rmask, KEPT: tl.constexpr, QUANT: tl.constexpr, MASKED: tl.constexpr):
    """A state's stored bytes for one tile: (codes, block absmax) or (float32 values, unused)."""
    if KEPT:
        if QUANT:
            return _ld(sp[0] + offs, mask, 0, MASKED), _ld(sp[2] + rows, rmask, 0.0, MASKED)
        else:
            v = _ld(sp[0] + offs, mask, 0.0, MASKED)
            return v, v
    else:
        return 0.0, 0.0


@triton.jit
def _tile_load(ptrs, chunk, numel, SLOTS: tl.constexpr, PRESENT: tl.constexpr, QUANT: tl.constexpr,
               BLOCK: tl.constexpr, ROWS: tl.constexpr, MASKED: tl.constexpr, VEC: tl.constexpr):  # fmt: skip
    """Everything one tile reads, as stored: (p, g, one pair per state slot). Decoding comes later, so the
    loads of the next tile can be issued before this one's arithmetic."""
    rows, offs, mask, rmask = _tile_offsets(chunk, numel, BLOCK, ROWS, VEC)
    p = _ld(ptrs[0] + offs, mask, 0.0, MASKED)
    g = _ld(ptrs[2] + offs, mask, 0.0, MASKED)
    raw = ()
    for j in tl.static_range(SLOTS):
        raw = raw + (_load_slot(ptrs[3][j], offs, mask, rows, rmask, (PRESENT >> j) & 1, QUANT, MASKED),)
    return p, g, raw


@triton.jit
def _decode(r, code_ptr, KEPT: tl.constexpr, QUANT: tl.constexpr, SIGNED: tl.constexpr, FORMAT: tl.constexpr):
    if KEPT:
        if QUANT:
            absmax = r[1]
            if FORMAT == 2:  # power
                v = decode_power(r[0], SIGNED)
                absmax = absmax * (1.0 / (127.0 * 127.0) if SIGNED else 1.0 / (255.0 * 255.0 * 255.0 * 255.0))
            else:  # dynamic map: one gather from the 1 KiB map
                v = tl.load((code_ptr if SIGNED else code_ptr + 256) + r[0].to(tl.int32))
            return v * absmax[:, None]
        else:
            return r[0]
    else:
        return 0.0


@triton.jit
def _store_state(sp, s, offs, mask, rows, rmask, lane, seed, QUANT: tl.constexpr, SIGNED: tl.constexpr,
                 FORMAT: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """Write one state of a tile: 8-bit codes, stochastically rounded (:func:`dither` of ``lane`` and
    ``seed``), and the block's new absmax; or float32 values."""
    if QUANT:
        if MASKED:
            s = tl.where(mask, s, 0.0)  # padding lanes must not raise the block's absmax
        absmax = tl.max(tl.abs(s), axis=1)
        d = dither(lane, seed)
        if FORMAT == 2:
            q = encode_power_scaled(s, power_root_scale(absmax, SIGNED)[:, None], SIGNED, d)
        else:
            scale = tl.where(absmax > 0, 1.0 / tl.where(absmax > 0, absmax, 1.0), 0.0)
            q = encode_dynamic_rounded(s * scale[:, None], s, d, SIGNED)
        _st(sp[1] + offs, q.to(tl.uint8), mask, MASKED)
        _st(sp[3] + rows, absmax, rmask, MASKED)
    else:
        _st(sp[1] + offs, s, mask, MASKED)


@triton.jit
def _hp_at(hp_ptr, K: tl.constexpr):
    return tl.load(hp_ptr + K)


@triton.jit
def _head(t, N: tl.constexpr):
    """The first N values of tuple ``t``."""
    out = ()
    for i in tl.static_range(N):
        out = out + (t[i],)
    return out


@triton.jit
def _tile_step(
    raw, ptrs, hp, dith, code_ptr, chunk, numel, nrm, part, n_tiles,
    MATH: tl.constexpr, SLOTS: tl.constexpr, PRESENT: tl.constexpr, SIGNED: tl.constexpr, QUANT: tl.constexpr,
    P_DTYPE: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, SOFT_BF16: tl.constexpr,
    FORMAT: tl.constexpr, MASKED: tl.constexpr, VEC: tl.constexpr,
    SKIP_ZEROS: tl.constexpr, NORM_MODE: tl.constexpr, NORM_TERMS: tl.constexpr, HP_STRIDE: tl.constexpr,
):  # fmt: skip
    """One tile's step from its loaded bytes ``raw`` (see :func:`_tile_load`)."""
    rows, offs, mask, rmask = _tile_offsets(chunk, numel, BLOCK, ROWS, VEC)
    p = raw[0].to(tl.float32)
    g = raw[1].to(tl.float32) * hp[HP_STRIDE - 4]  # -1 with maximize
    # the states as the rule's math takes them: one float32 value per slot, the scalar 0.0 for a slot not kept
    s = ()
    for j in tl.static_range(SLOTS):
        s = s + (_decode(raw[2][j], code_ptr, (PRESENT >> j) & 1, QUANT, (SIGNED >> j) & 1, FORMAT),)
    rule_hp = _head(hp, HP_STRIDE - 4)  # the rule's scalars (then come the four the step adds)

    # a non-finite gradient element leaves its param element alone and zeroes its states (bitsandbytes)
    finite = tl.abs(g) < float("inf")
    counted = finite & (g != 0) if SKIP_ZEROS else finite
    if MASKED:  # padding lanes hold arbitrary codes: keep them out of the sums
        counted = counted & mask
    if NORM_MODE == 1:  # norm pass: this tile's share of the tensor's three sums, nothing stored
        if NORM_TERMS is not None:
            a, b, c = NORM_TERMS(p, g, s, rule_hp)
        else:  # update clipping (max_unorm): ||p||^2 and ||update / lr||^2
            p_new, s_new = MATH(p, g, s, rule_hp, nrm)
            d = (p_new - p) / hp[HP_STRIDE - 1]
            a = p * p
            b = d * d
            c = a * 0.0
        tl.store(part, tl.sum(tl.sum(tl.where(counted, a, 0.0), axis=1), axis=0))
        tl.store(part + n_tiles, tl.sum(tl.sum(tl.where(counted, b, 0.0), axis=1), axis=0))
        tl.store(part + 2 * n_tiles, tl.sum(tl.sum(tl.where(counted, c, 0.0), axis=1), axis=0))
        return
    p_new, s_new = MATH(p, g, s, rule_hp, nrm)
    if NORM_MODE == 2 and NORM_TERMS is None:  # max_unorm: ||update|| <= max_unorm * ||p|| per tensor
        max_unorm = hp[HP_STRIDE - 2]
        limit = max_unorm * tl.sqrt(nrm[0])
        unorm = tl.sqrt(nrm[1])
        scale = tl.where(unorm > limit, limit / tl.maximum(unorm, 1e-30), 1.0)
        p_new = p + scale * (p_new - p)
    if SKIP_ZEROS:  # an exactly-zero gradient element leaves its param element and states alone
        p_new = tl.where(g == 0, p, p_new)
        kept = ()
        for j in tl.static_range(SLOTS):
            kept = kept + (tl.where(g == 0, s[j], s_new[j]),)
        s_new = kept
    p_new = tl.where(finite, p_new, p)
    _st(ptrs[1] + offs, to_dtype(p_new, P_DTYPE, SOFT_BF16), mask, MASKED)
    # stochastic rounding of the 8-bit states (bnbf.quant): each element's place in its block times an odd
    # constant, plus a hash of (block, step); one offset per element, shared by its states
    lane = (tl.arange(0, BLOCK).to(tl.uint32) * DITHER_LANE)[None, :]
    seed = mix(rows.to(tl.uint32) * DITHER_BLOCK + dith)[:, None]
    for j in tl.static_range(SLOTS):
        if (PRESENT >> j) & 1:
            _store_state(ptrs[3][j], tl.where(finite, s_new[j], 0.0), offs, mask, rows, rmask, lane, seed, QUANT,
                         (SIGNED >> j) & 1, FORMAT, MASKED)  # fmt: skip


@triton.jit
def _tiles_in_turn(
    ptrs, hp, dith, code_ptr, first, numel, nrm, part, n_tiles,
    MATH: tl.constexpr, SLOTS: tl.constexpr, PRESENT: tl.constexpr, SIGNED: tl.constexpr, QUANT: tl.constexpr,
    P_DTYPE: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, SOFT_BF16: tl.constexpr,
    FORMAT: tl.constexpr, MASKED: tl.constexpr, VEC: tl.constexpr, ITERS: tl.constexpr,
    SKIP_ZEROS: tl.constexpr, NORM_MODE: tl.constexpr, NORM_TERMS: tl.constexpr, HP_STRIDE: tl.constexpr,
):  # fmt: skip
    """A program's tiles one after the other, each loaded then stepped (no prefetch)."""
    for it in tl.range(0, ITERS):
        raw = _tile_load(ptrs, first + it, numel, SLOTS, PRESENT, QUANT, BLOCK, ROWS, MASKED, VEC)
        _tile_step(raw, ptrs, hp, dith, code_ptr, first + it, numel, nrm, part + it, n_tiles,
                   MATH, SLOTS, PRESENT, SIGNED, QUANT, P_DTYPE, BLOCK, ROWS, SOFT_BF16, FORMAT,
                   MASKED, VEC, SKIP_ZEROS, NORM_MODE, NORM_TERMS, HP_STRIDE)  # fmt: skip


@triton.jit
def _step_kernel(
    table_ptr, task_ptr, grad_ptr, hp_ptr, code_ptr, norm_ptr, n_tiles,
    h0, h1, h2, h3, h4, h5, h6, h7, h8, h9, h10, h11, h12, h13, h14, h15, h16, h17, HP_FROM_PTR: tl.constexpr,
    MATH: tl.constexpr, SLOTS: tl.constexpr, PRESENT: tl.constexpr, SIGNED: tl.constexpr, QUANT: tl.constexpr,
    P_DTYPE: tl.constexpr, HP_STRIDE: tl.constexpr,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, SOFT_BF16: tl.constexpr,
    FORMAT: tl.constexpr, ALIGNED: tl.constexpr, VEC: tl.constexpr, ITERS: tl.constexpr, PREFETCH: tl.constexpr,
    SKIP_ZEROS: tl.constexpr, NORM_MODE: tl.constexpr, NORM_TERMS: tl.constexpr, SUM_SPLIT: tl.constexpr,
):  # fmt: skip
    """NORM_MODE 0: the step. 1: the norm pass, writing per-tile partial sums to norm_ptr[3, n_tiles].
    2: the step of a rule that needs per-tensor sums, from norm_ptr[tensor, 3, SUM_SPLIT] (see
    _tensor_sums_kernel). The rule has SLOTS state slots: bit j of PRESENT says slot j is kept, bit j of
    SIGNED that it is quantized with the signed map."""
    pid = tl.program_id(0)
    tensor = tl.load(task_ptr + 2 * pid).to(tl.int64)
    first = tl.load(task_ptr + 2 * pid + 1).to(tl.int64) * ITERS  # first tile of this program
    table = table_ptr + tensor * (HEAD + PER_SLOT * SLOTS)
    numel = tl.load(table + 2)
    # the rule's scalars: kernel arguments (floats given on the host: nothing to upload), or a float32 row
    # on the device (0-d tensor hyperparameters, traced calls)
    if HP_FROM_PTR:
        hp = ()
        for k in tl.static_range(HP_STRIDE):
            hp = hp + (_hp_at(hp_ptr, k),)
    else:
        hp = (h0, h1, h2, h3, h4, h5, h6, h7, h8, h9, h10, h11, h12, h13, h14, h15, h16, h17)
    if NORM_MODE == 2:  # this tensor's three sums, each from SUM_SPLIT partial sums in a fixed order
        base = norm_ptr + tensor * (3 * SUM_SPLIT)
        nrm = (_split_sum(base, SUM_SPLIT), _split_sum(base + SUM_SPLIT, SUM_SPLIT),
               _split_sum(base + 2 * SUM_SPLIT, SUM_SPLIT))  # fmt: skip
    else:
        nrm = (0.0, 0.0, 0.0)
    # every address once per program (param in, param out, grad, then each state slot's four), not per tile:
    # the compiler cannot hoist loads of the table past the tiles' stores
    ptrs = (_addr(table, 0, P_DTYPE, ALIGNED), _addr(table, 1, P_DTYPE, ALIGNED),
            _addr(grad_ptr, tensor, P_DTYPE, ALIGNED))  # grads change every step: their own small table
    slot_ptrs = ()
    for j in tl.static_range(SLOTS):
        slot_ptrs = slot_ptrs + (_slot_ptrs(table, j, PRESENT, QUANT, ALIGNED),)
    ptrs = ptrs + (slot_ptrs,)
    part = norm_ptr + pid * ITERS
    dith = tl.cast(hp[HP_STRIDE - 3], tl.uint32) * DITHER_STEP  # the step's share of the dither's block hashes
    # whole tiles skip the bounds masks, which would otherwise stop the loads from vectorizing
    if (first + ITERS) * (ROWS * BLOCK) <= numel:
        if PREFETCH:  # the next tile's loads are in flight while this tile computes
            raw = _tile_load(ptrs, first, numel, SLOTS, PRESENT, QUANT, BLOCK, ROWS, False, VEC)
            for it in tl.static_range(ITERS):
                if it + 1 < ITERS:
                    nxt = _tile_load(ptrs, first + it + 1, numel, SLOTS, PRESENT, QUANT, BLOCK, ROWS, False, VEC)
                _tile_step(raw, ptrs, hp, dith, code_ptr, first + it, numel, nrm, part + it, n_tiles,
                           MATH, SLOTS, PRESENT, SIGNED, QUANT, P_DTYPE, BLOCK, ROWS, SOFT_BF16, FORMAT,
                           False, VEC, SKIP_ZEROS, NORM_MODE, NORM_TERMS, HP_STRIDE)  # fmt: skip
                if it + 1 < ITERS:
                    raw = nxt
        else:
            _tiles_in_turn(ptrs, hp, dith, code_ptr, first, numel, nrm, part, n_tiles,
                           MATH, SLOTS, PRESENT, SIGNED, QUANT, P_DTYPE, BLOCK, ROWS, SOFT_BF16, FORMAT,
                           False, VEC, ITERS, SKIP_ZEROS, NORM_MODE, NORM_TERMS, HP_STRIDE)  # fmt: skip
    else:
        _tiles_in_turn(ptrs, hp, dith, code_ptr, first, numel, nrm, part, n_tiles,
                       MATH, SLOTS, PRESENT, SIGNED, QUANT, P_DTYPE, BLOCK, ROWS, SOFT_BF16, FORMAT,
                       True, VEC, ITERS, SKIP_ZEROS, NORM_MODE, NORM_TERMS, HP_STRIDE)  # fmt: skip


# ---- launcher ---------------------------------------------------------------------------------------

# After a group's first launch of a configuration, later steps call the compiled kernel's launcher
# directly. Triton's JIT dispatch (binding ~30 arguments, computing the specialization key, a pointer
# query per tensor) costs more host time than the launch. BNBF_LAUNCH=jit keeps Triton's dispatch.
DIRECT_LAUNCH = os.environ.get("BNBF_LAUNCH", "direct") != "jit"
HP_MAX = 18  # scalars a rule may pass (h0..h17), the four the step adds (see bnbf.functional._scalars) included
_N_RUNTIME_ARGS = 7 + HP_MAX  # table, tasks, grads, hp row, codes, norms, n_tiles, h0..h17; then constexprs
_CONSTEXPR_SLOTS = (None,) * (len(_step_kernel.arg_names) - _N_RUNTIME_ARGS)  # ignored by the launcher
_NO_FLOATS = (0.0,) * HP_MAX


def _direct_ok(device: torch.device) -> bool:
    """A direct launch needs the group's device to be current (as Triton's dispatch assumes) and no
    launch hooks (profilers such as Proton install them)."""
    rt = triton.knobs.runtime
    return device.index == torch.cuda.current_device() and _idle(rt.launch_enter_hook) and _idle(rt.launch_exit_hook)


def _idle(hook) -> bool:
    return hook is None or getattr(hook, "calls", True) == []  # Triton 3.6 keeps an empty HookChain


try:  # what Triton's own dispatch reads the stream with
    from torch._C import _cuda_getCurrentRawStream as _current_stream
except ImportError:  # pragma: no cover

    def _current_stream(index: int) -> int:
        return torch.cuda.current_stream(index).cuda_stream

_TASKS: collections.OrderedDict = collections.OrderedDict()
_CACHE_SIZE = 16
LAUNCH_KEYS: set = set()  # static (compile-relevant) keys launched so far; tests read it


def _to_device(t: Tensor, device: torch.device) -> Tensor:
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _tasks(numels: tuple[int, ...], block: int, iters: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(tensor index, chunk index) per program, int32 [programs, 2], and per tensor the range of its
    tiles, int64 [tensors, 2] (the rows of the norm pass's partial sums); cached by the tensor sizes."""
    key = (device, block, ROWS * iters, numels)
    hit = _TASKS.get(key)
    if hit is not None:
        _TASKS.move_to_end(key)
        return hit
    per_chunk = block * ROWS * iters
    chunks = torch.tensor([-(-n // per_chunk) for n in numels], dtype=torch.int64)
    tensor_idx = torch.repeat_interleave(torch.arange(len(numels)), chunks)
    starts = torch.cumsum(chunks, 0) - chunks
    chunk_idx = torch.arange(int(chunks.sum())) - torch.repeat_interleave(starts, chunks)
    tasks = _to_device(torch.stack([tensor_idx, chunk_idx], 1).to(torch.int32).contiguous(), device)
    ranges = _to_device(torch.stack([starts * iters, (starts + chunks) * iters], 1).contiguous(), device)
    _TASKS[key] = tasks, ranges
    if len(_TASKS) > _CACHE_SIZE:
        _TASKS.popitem(last=False)
    return tasks, ranges


@dataclasses.dataclass
class Group:
    """What one launch needs apart from the grads and the scalars: built once, reused every step."""

    rule: str
    fmt: str  # "fp32", "dynamic" or "power"
    block: int
    present: int  # bit j: the rule's state slot j is kept
    dtype: torch.dtype
    device: torch.device
    table: Tensor  # int64 [tensors, HEAD + PER_SLOT * the rule's slots] on the device
    tasks: Tensor  # int32 [programs, 2] on the device
    ranges: Tensor  # int64 [tensors, 2]: each tensor's tiles (rows of the norm pass's partials)
    aligned: bool  # every param and state address is 16-byte aligned
    norms: bool  # the rule scales its update by per-tensor norms (a norm pass first)
    # the last grad-pointer table uploaded: reused while the grads sit at the same addresses (the
    # caching allocator usually hands a training loop's grads the same blocks every step)
    grad_ptrs: tuple = ()
    grad_table: Tensor | None = None
    grads_aligned: bool = False
    # by launch configuration, what launches this group's compiled kernel without Triton's JIT dispatch:
    # (launch function, CUfunction, the arguments before the kernel's own), see _direct_launch
    compiled: dict = dataclasses.field(default_factory=dict)
    # the norm pass's scratch, made at the first step that needs it: per-tile partial sums [3, tiles] and
    # float64 parts of the per-tensor sums [tensors, 3, SUM_SPLIT]
    partials: Tensor | None = None
    sums: Tensor | None = None


def build_group(p_in, p_out, s_in, s_out, rule_name: str, fmt: str, block: int, present: int) -> Group:
    """Address table and task list for tensors sharing device, param dtype and state layout.

    ``s_in``/``s_out`` hold, per tensor, the fields of its present state slots (bit j of ``present``:
    the rule's slot j is kept) in slot order, codes and absmax interleaved for 8-bit formats. In and out
    may be the same tensors (in place).
    """
    quant = fmt != "fp32"
    block = block if quant else 256  # float32 states have no blocks; 256 is only the tile width
    rule = get_rule(rule_name)
    slots = [j for j in range(len(rule.states)) if (present >> j) & 1]
    per = 2 * len(slots) if quant else len(slots)
    device = p_in[0].device
    # the table column by column, in C-level loops (a pure call builds it every time)

    def ptrs(ts):
        return list(map(Tensor.data_ptr, ts))

    zeros = [0] * len(p_in)
    columns = [ptrs(p_in), ptrs(p_out)]
    for j in range(len(rule.states)):  # PER_SLOT columns each
        if j not in slots:
            columns += [zeros] * 4
            continue
        k = slots.index(j)
        if quant:  # codes in, codes out, absmax in, absmax out
            columns += [ptrs(s_in[2 * k :: per]), ptrs(s_out[2 * k :: per]),
                        ptrs(s_in[2 * k + 1 :: per]), ptrs(s_out[2 * k + 1 :: per])]  # fmt: skip
        else:
            columns += [ptrs(s_in[k::per]), ptrs(s_out[k::per]), zeros, zeros]
    aligned = functools.reduce(operator.or_, itertools.chain.from_iterable(columns)) % 16 == 0
    numels = list(map(Tensor.numel, p_in))
    rows = list(zip(columns[0], columns[1], numels, *columns[2:]))
    table = _to_device(torch.tensor(rows, dtype=torch.int64), device)
    tasks, ranges = _tasks(tuple(numels), block, ITERS[fmt][p_in[0].dtype], device)
    norms = rule.norms is not None
    return Group(rule_name, fmt, block, present, p_in[0].dtype, device, table, tasks, ranges, aligned, norms)


def launch_group(
    group: Group, grads: list[Tensor], hp: Tensor | tuple, skip_zeros: bool = False, clip: bool = False
) -> None:
    """The step for one group: one launch, or three for rules that need per-tensor norms (LAMB, LARS)
    or with update clipping (``clip``: the last two scalars are max_unorm and lr).

    ``grads`` are contiguous, in the group's order; ``hp`` is the rule's scalars, either a tuple of Python
    floats (passed as kernel arguments) or a float32 tensor [k] on the device; ``skip_zeros``:
    elements whose gradient is exactly 0 keep their param and states.
    """
    ptrs = tuple(map(Tensor.data_ptr, grads))
    if ptrs != group.grad_ptrs:
        group.grad_table = _to_device(torch.tensor(ptrs, dtype=torch.int64), group.device)
        group.grad_ptrs = ptrs
        group.grads_aligned = functools.reduce(operator.or_, ptrs) % 16 == 0
    aligned = group.aligned and group.grads_aligned
    grad_table = group.grad_table
    if isinstance(hp, tuple):
        from_ptr, n_hp, floats, hp_row = False, len(hp), hp + _NO_FLOATS[len(hp):], group.table
    else:
        from_ptr, n_hp, floats, hp_row = True, hp.shape[0], _NO_FLOATS, hp
    quant = group.fmt != "fp32"
    code_ptr = _code_tables(group.device) if quant else group.table  # unused without quantized states
    iters = ITERS[group.fmt][group.dtype]
    grid = group.tasks.shape[0]
    n_tiles = grid * iters

    def run(norm_ptr, mode):
        def dispatch():
            rule = get_rule(group.rule)
            norm_terms = rule.norms[0] if rule.norms is not None else None
            LAUNCH_KEYS.add((group.rule, group.fmt, group.present, group.dtype, group.block, ROWS, NUM_WARPS,
                             n_hp, from_ptr, aligned, skip_zeros, clip))  # fmt: skip
            return _step_kernel[(grid,)](
                group.table, group.tasks, grad_table, hp_row, code_ptr, norm_ptr, n_tiles, *floats,
                HP_FROM_PTR=from_ptr, MATH=rule.math, SLOTS=len(rule.states), PRESENT=group.present,
                SIGNED=rule.signed_mask, QUANT=quant, P_DTYPE=_TL_DTYPES[group.dtype], HP_STRIDE=n_hp,
                BLOCK=group.block, ROWS=ROWS,
                SOFT_BF16=interpreting(), FORMAT=FORMATS[group.fmt], ALIGNED=aligned, VEC=VEC[group.fmt],
                ITERS=iters, PREFETCH=_prefetch(group.fmt, group.dtype, group.present, mode),
                SKIP_ZEROS=skip_zeros, NORM_MODE=mode, NORM_TERMS=norm_terms, SUM_SPLIT=SUM_SPLIT,
                num_warps=NUM_WARPS, **_maxnreg(group.fmt, group.dtype),
            )  # fmt: skip

        args = (group.table.data_ptr(), group.tasks.data_ptr(), grad_table.data_ptr(), hp_row.data_ptr(),
                code_ptr.data_ptr(), norm_ptr.data_ptr(), n_tiles, *floats, *_CONSTEXPR_SLOTS)  # fmt: skip
        _launch(group, (mode, aligned, skip_zeros, n_hp, from_ptr), (grid, 1, 1), args, dispatch)

    if not (group.norms or clip):
        run(group.table, 0)  # no norms: any pointer
        return
    if group.partials is None:  # scratch kept with the group: no allocation per step
        group.partials = torch.empty(3 * n_tiles, dtype=torch.float32, device=group.device)  # [3, tiles]
        group.sums = torch.empty(group.ranges.shape[0], 3, SUM_SPLIT, dtype=torch.float64, device=group.device)
    run(group.partials, 1)
    _launch_sums(group, n_tiles)
    run(group.sums, 2)


@triton.jit
def _split_sum(ptr, SPLIT: tl.constexpr):
    return tl.sum(tl.load(ptr + tl.arange(0, SPLIT)), 0).to(tl.float32)  # float64 parts


@triton.jit
def _tensor_sums_kernel(partial_ptr, range_ptr, sum_ptr, n_tiles, CHUNK: tl.constexpr, SPLIT: tl.constexpr):
    """Between the norm pass and the step: program (tensor t, part s) adds part s of the SPLIT equal parts
    of t's per-tile partials [3, n_tiles] into sum_ptr[t, :, s], in float64 and in a fixed order, so the
    step's final sums (_split_sum) have the same bits every run (restarted training matches an
    uninterrupted one), unlike atomics. SPLIT parts keep a large tensor's tiles from being added by one
    program alone (GPT-2's embedding: 150k tiles, 0.2 ms)."""
    t = tl.program_id(0)
    part = tl.program_id(1)
    start = tl.load(range_ptr + 2 * t)
    stop = tl.load(range_ptr + 2 * t + 1)
    span = (stop - start + SPLIT - 1) // SPLIT
    i = start + part * span
    end = tl.minimum(i + span, stop)
    acc0 = tl.zeros([CHUNK], dtype=tl.float64)
    acc1 = tl.zeros([CHUNK], dtype=tl.float64)
    acc2 = tl.zeros([CHUNK], dtype=tl.float64)
    while i < end:  # a while loop: Triton's interpreter cannot bound a for loop by a loaded value
        offs = i + tl.arange(0, CHUNK)
        mask = offs < end
        acc0 += tl.load(partial_ptr + offs, mask=mask, other=0.0).to(tl.float64)
        acc1 += tl.load(partial_ptr + n_tiles + offs, mask=mask, other=0.0).to(tl.float64)
        acc2 += tl.load(partial_ptr + 2 * n_tiles + offs, mask=mask, other=0.0).to(tl.float64)
        i += CHUNK
    out = sum_ptr + t * (3 * SPLIT) + part
    tl.store(out, tl.sum(acc0, 0))
    tl.store(out + SPLIT, tl.sum(acc1, 0))
    tl.store(out + 2 * SPLIT, tl.sum(acc2, 0))


_SUMS_CHUNK = 1024
SUM_SPLIT = 32  # parts per tensor: one load per lane of the step's one-warp programs
_SUMS_CONSTEXPRS = (None,) * (len(_tensor_sums_kernel.arg_names) - 4)  # after partials, ranges, sums, n_tiles


def _launch_sums(group: Group, n_tiles: int) -> None:
    """One launch adding every tensor's partials of ``group`` into ``group.sums`` [tensors, 3, SUM_SPLIT]."""
    grid = (group.ranges.shape[0], SUM_SPLIT, 1)
    args = (group.partials.data_ptr(), group.ranges.data_ptr(), group.sums.data_ptr(), n_tiles, *_SUMS_CONSTEXPRS)
    _launch(group, "sums", grid, args, lambda: _tensor_sums_kernel[grid](
        group.partials, group.ranges, group.sums, n_tiles, CHUNK=_SUMS_CHUNK, SPLIT=SUM_SPLIT))  # fmt: skip


def _launch(group: Group, key: Any, grid: tuple, args: tuple, dispatch: Callable[[], Any]) -> None:
    """Launch one of ``group``'s kernels. After its first launch of configuration ``key`` through Triton's
    dispatch (``dispatch()``, which returns the compiled kernel), later ones call that kernel's launcher
    directly with ``args`` (the kernel's arguments as the launcher takes them: pointers as ints, None for
    constexprs): Triton's dispatch costs more host time than the launch itself. The pointer arguments are
    16-byte aligned fresh allocations, as when it was compiled."""
    direct = group.compiled.get(key)
    if direct is not None and _direct_ok(group.device):
        launch_c, function, head = direct
        launch_c(*grid, _current_stream(group.device.index), function, *head, *args)
        return
    compiled = dispatch()
    if group.device.type == "cuda" and DIRECT_LAUNCH and hasattr(compiled, "packed_metadata"):
        group.compiled[key] = _direct_launch(compiled)


def _direct_launch(compiled) -> tuple:
    """(launch function, CUfunction, the arguments before the kernel's own) of a compiled kernel: the
    launcher's C function itself where the kernel needs no scratch memory (Triton 3.6's Python wrapper
    around it only allocates scratch), else the wrapper."""
    launcher = compiled.run
    meta = (compiled.packed_metadata, None, None, None)  # then launch metadata and enter/exit hooks: none
    c_launch = getattr(launcher, "launch", None)
    if (c_launch is not None and getattr(launcher, "global_scratch_size", 1) == 0
            and getattr(launcher, "profile_scratch_size", 1) == 0):  # fmt: skip
        # cooperative grid, PDL, global and profile scratch (none), then what the wrapper passes on
        return c_launch, compiled.function, (launcher.launch_cooperative_grid, launcher.launch_pdl, None, None, *meta)
    return launcher, compiled.function, meta


def _maxnreg(fmt: str, dtype: torch.dtype) -> dict:
    cap = MAXNREG[fmt].get(dtype)
    return {} if cap is None or interpreting() else {"maxnreg": cap}


def launch(p_in, p_out, grads, s_in, s_out, hp, rule_name, fmt, block, present, skip_zeros, clip) -> None:
    """Build the group and launch (the uncached path: out-of-place steps and traced calls)."""
    group = build_group(p_in, p_out, s_in, s_out, rule_name, fmt, block, present)
    launch_group(group, grads, hp, skip_zeros, clip)


_CODE_TABLES: dict[torch.device, Tensor] = {}


def _code_tables(device: torch.device) -> Tensor:
    """Signed map then unsigned map, float32[512], cached per device."""
    t = _CODE_TABLES.get(device)
    if t is None:
        t = torch.cat([dynamic_map(True, device), dynamic_map(False, device)]).contiguous()
        _CODE_TABLES[device] = t
    return t

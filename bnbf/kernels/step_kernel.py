"""The fused multi-tensor optimizer step kernel: one Triton launch updates every tensor of a group.

Each program takes ``ITERS`` tiles of ``ROWS`` quantization blocks of one tensor, found through a task list
(tensor index, chunk index). It dequantizes the states, runs the rule's ``math`` in float32, writes the param
in its own dtype and requantizes each state with the block's new absmax (stochastically rounded, see
:mod:`bnbf.quant`). Rules that need per-tensor norms (and ``max_unorm``) run it twice: a norm pass writing
per-tile partial sums, ``_tensor_sums_kernel`` adding them per tensor, then the step reading those sums. With
gradient clipping folded into the norm pass (``CLIP`` 3), that pass also sums every grad's squares, from which
the total norm comes (:class:`bnbf.reference.GradClip`); other rules' clipping reads the grads once in
``_grad_squares_kernel`` (the same tiles and sums), and their launches then take the coefficient (``CLIP`` 2).

Only Triton code lives here; :mod:`bnbf.kernels.launcher` builds the tables and picks the configuration.
"""

from __future__ import annotations

import triton
import triton.language as tl

from bnbf import quant
from bnbf._dispatch import interpreting
from bnbf.kernels.codec import (
    decode_power,
    dither,
    encode_dynamic_rounded,
    encode_power_scaled,
    mix,
    power_absmax,
    power_root_scale,
    to_dtype,
    widen,
)

_COMPILED = tl.constexpr(not interpreting())

# stochastic rounding's dither (codec.dither; the constants and their meaning are in bnbf.quant)
DITHER_LANE: tl.constexpr = tl.constexpr(quant.DITHER_LANE)
DITHER_BLOCK: tl.constexpr = tl.constexpr(quant.DITHER_BLOCK)
DITHER_STEP: tl.constexpr = tl.constexpr(quant.DITHER_STEP)
# The address table, int64: a row per tensor of HEAD fields (param in, param out, numel, first block), then
# PER_SLOT fields for each of the rule's state slots (state in, state out, absmax in, absmax out; zeros for a
# slot not kept). "first block": the global index of the tensor's first quantization block, added to the block
# index that the stochastic rounding's dither hashes (0 but for a shard of a larger tensor, bnbf.distributed).
# The rule's scalars are not in it: kernel arguments, one float32 row for every tensor (HP_FROM_PTR), or with
# HP_PER_TENSOR one row per tensor, row t of a [tensors, HP_STRIDE] float32 matrix for the table's row t.
HEAD: tl.constexpr = tl.constexpr(4)
PER_SLOT: tl.constexpr = tl.constexpr(4)

FORMATS = {"fp32": 0, "dynamic": 1, "power": 2}  # the FORMAT constexpr of each state format
HP_MAX = 18  # scalars a rule may pass (h0..h17), the four the step adds (see bnbf.plan._scalars) included


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
            return (
                _addr(table, base, tl.uint8, ALIGNED),
                _addr(table, base + 1, tl.uint8, ALIGNED),
                tl.load(table + base + 2).to(tl.pointer_type(tl.float32)),
                tl.load(table + base + 3).to(tl.pointer_type(tl.float32)),
            )
        else:
            s_in = _addr(table, base, tl.float32, ALIGNED)
            s_out = _addr(table, base + 1, tl.float32, ALIGNED)
            return s_in, s_out, s_in, s_out
    else:
        return table, table, table, table


@triton.jit
def _shift_ptrs(ptrs, row0, BLOCK: tl.constexpr, SLOTS: tl.constexpr):
    """``ptrs`` (see :func:`_program`) moved to block ``row0``: element pointers by ``row0 * BLOCK``, absmax pointers
    by ``row0``. A slot's unused fields (placeholders, a 32-bit state's absmax) move too, and stay unread."""
    n = row0 * BLOCK
    slots = ()
    for j in tl.static_range(SLOTS):
        sp = ptrs[3][j]
        slots = slots + ((sp[0] + n, sp[1] + n, sp[2] + row0, sp[3] + row0),)
    return ptrs[0] + n, ptrs[1] + n, ptrs[2] + n, slots


@triton.jit
def _tile_offsets(chunk, numel, BLOCK: tl.constexpr, ROWS: tl.constexpr, VEC: tl.constexpr):
    rows = chunk * ROWS + tl.arange(0, ROWS)  # int64: tensors may exceed 2**31 elements
    # the same vector width for every load (fp32, bf16 and uint8) keeps one register layout for the
    # whole tile; otherwise each width gets its own layout and shared-memory conversions between them. The lane
    # carries them too: where the tile offset is the constant 0 (_program's first whole tile) the sum below folds
    # away, and its hints with it
    lane = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK), VEC), VEC)
    offs = rows[:, None] * BLOCK + lane[None, :]
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
def _tile_load(
    ptrs,
    chunk,
    numel,
    SLOTS: tl.constexpr,
    PRESENT: tl.constexpr,
    QUANT: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    MASKED: tl.constexpr,
    VEC: tl.constexpr,
):
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
            if FORMAT == 2:  # power
                return decode_power(r[0], r[1], SIGNED)
            else:  # dynamic map: one gather from the 1 KiB map
                v = tl.load((code_ptr if SIGNED else code_ptr + 256) + r[0].to(tl.int32))
                return v * r[1][:, None]
        else:
            return r[0]
    else:  # 0-d, where a kept slot is a tile: a rule tells the two apart by shape when the kernel compiles
        return tl.full([], 0.0, tl.float32)


@triton.jit
def _block_absmax(s, VEC: tl.constexpr):
    """max |s| of each row (a quantization block) of a tile, finite values only. Compiled, each thread's elements
    are reduced as floats (|x| folds into the max), then across the warp as the float bits read as integers (the
    same order for non-negative floats): Triton lowers a 32-lane integer max to one ``redux.sync`` where a float max
    takes five shuffles and five maxima (bf16 AdamW: 64.8 -> 62.9 instructions an element). The reshape follows
    the tile's layout (VEC contiguous elements a thread), so it moves no data."""
    ROWS: tl.constexpr = s.shape[0]
    BLOCK: tl.constexpr = s.shape[1]
    if _COMPILED and BLOCK >= 32 * VEC:
        a = tl.reshape(tl.abs(s), [ROWS, BLOCK // (32 * VEC), 32, VEC])
        a = tl.max(tl.max(a, axis=3), axis=1)
        return tl.max(a.to(tl.int32, bitcast=True), axis=1).to(tl.float32, bitcast=True)
    else:
        return tl.max(tl.abs(s), axis=1)


@triton.jit
def _store_state(
    sp,
    s,
    offs,
    mask,
    rows,
    rmask,
    lane,
    seed,
    QUANT: tl.constexpr,
    SIGNED: tl.constexpr,
    FORMAT: tl.constexpr,
    MASKED: tl.constexpr,
    VEC: tl.constexpr,
):
    """Write one state of a tile: 8-bit codes, stochastically rounded (:func:`dither` of ``lane`` and
    ``seed``), and the block's new absmax; or float32 values."""
    if QUANT:
        if MASKED:
            s = tl.where(mask, s, 0.0)  # padding lanes must not raise the block's absmax
        absmax = _block_absmax(s, VEC)
        d = dither(lane, seed)
        if FORMAT == 2:
            q = encode_power_scaled(s, power_root_scale(absmax, SIGNED)[:, None], SIGNED, d)
            absmax = power_absmax(absmax, SIGNED)
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
def _mul_rn(a, b):
    """a * b rounded on its own: never contracted into an FMA with a later add (the clipped gradient must
    have the bits of torch's clipped copy, whatever the rule does with it next). Inline PTX, not libdevice's
    mul_rn, which Triton links flushing subnormals (``mul.rn.ftz``): torch's clipped copy keeps them."""
    if _COMPILED:
        return tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return a * b


@triton.jit
def _in(x, T: tl.constexpr, SOFT_BF16: tl.constexpr):
    """float32 ``x`` rounded to ``T`` (to nearest even) and back: torch's arithmetic in a 16-bit dtype."""
    return to_dtype(x, T, SOFT_BF16).to(tl.float32)


@triton.jit
def _clip_coef(clip_ptr, clip_max, CLIP: tl.constexpr, SOFT_BF16: tl.constexpr):
    """The gradient clipping coefficient (``CLIP`` 1 or 2, see :func:`_step_kernel`) as float32.

    CLIP 1: from the total norm at ``clip_ptr`` (dtype T, the grads' norms' dtype) and ``max_norm``
    (``clip_max``, float32) as torch.nn.utils.clip_grad_norm_ computes it, op by op in T: ``total + 1e-6``,
    ``max_norm / that`` (Tensor.__rtruediv__: a correctly rounded reciprocal, then a multiply), ``clamp(max=1)``
    (NaN stays NaN). CLIP 2: the coefficient itself, computed on the device by torch (a 0-d tensor max_norm)."""
    T: tl.constexpr = clip_ptr.dtype.element_ty
    v = tl.load(clip_ptr).to(tl.float32)
    if CLIP == 1:
        x = _in(v + 1e-6, T, SOFT_BF16)
        x = _in(tl.math.div_rn(1.0, x), T, SOFT_BF16)
        v = _in(x * clip_max, T, SOFT_BF16)
        v = tl.where(v > 1.0, 1.0, v)
    return v


@triton.jit
def _tile_step(
    raw,
    ptrs,
    hp,
    dith,
    gscale,
    code_ptr,
    chunk,
    numel,
    nrm,
    part,
    n_tiles,
    MATH: tl.constexpr,
    SLOTS: tl.constexpr,
    PRESENT: tl.constexpr,
    SIGNED: tl.constexpr,
    QUANT: tl.constexpr,
    P_DTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    SOFT_BF16: tl.constexpr,
    FORMAT: tl.constexpr,
    MASKED: tl.constexpr,
    VEC: tl.constexpr,
    SKIP_ZEROS: tl.constexpr,
    NORM_MODE: tl.constexpr,
    NORM_TERMS: tl.constexpr,
    HP_STRIDE: tl.constexpr,
    CLIP: tl.constexpr,
):
    """One tile's step from its loaded bytes ``raw`` (see :func:`_tile_load`); with ``CLIP`` 1 or 2 the grads
    are scaled by ``gscale``, the sign times the clipping coefficient."""
    rows, offs, mask, rmask = _tile_offsets(chunk, numel, BLOCK, ROWS, VEC)
    p = widen(raw[0], None)
    if CLIP == 1 or CLIP == 2:  # one float32 product, as torch's clipped copy of a float32 grad (the sign is exact)
        g = _mul_rn(raw[1].to(tl.float32), gscale)
    else:
        g = widen(raw[1], hp[HP_STRIDE - 4])  # -1 with maximize
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
        if CLIP == 3:  # clipping folded in: the rule's unused third sum is g² over every element, non-finite
            # ones included (torch's total norm); padding lanes loaded 0
            tl.store(part + 2 * n_tiles, tl.sum(tl.sum(g * g, axis=1), axis=0))
        else:
            tl.store(part + 2 * n_tiles, tl.sum(tl.sum(tl.where(counted, c, 0.0), axis=1), axis=0))
        return
    p_new, s_new = MATH(p, g, s, rule_hp, nrm)
    if NORM_MODE == 2 and NORM_TERMS is None:  # max_unorm: ||update|| <= max_unorm * ||p|| per tensor
        max_unorm = hp[HP_STRIDE - 2]
        limit = max_unorm * tl.sqrt(nrm[0])
        unorm = tl.sqrt(nrm[1])
        # a tensor max_unorm of 0 (or below, unread on a device) is off, as the number 0 is
        scale = tl.where((unorm > limit) & (max_unorm > 0), limit / tl.maximum(unorm, 1e-30), 1.0)
        p_new = p + scale * (p_new - p)
    if SKIP_ZEROS:  # an exactly-zero gradient element leaves its param element and states alone
        p_new = tl.where(g == 0, p, p_new)
        kept = ()
        for j in tl.static_range(SLOTS):
            kept = kept + (tl.where(g == 0, s[j], s_new[j]),)
        s_new = kept
    if QUANT:
        # an 8-bit state holds no NaN or inf (a code is a fraction of its block's absmax, which one would make NaN
        # or inf for the whole block): an element whose new state is one (a NaN param under weight decay, a square that
        # overflows) steps as a non-finite gradient's, its param kept and its states zeroed
        for j in tl.static_range(SLOTS):
            if (PRESENT >> j) & 1:
                finite = finite & (tl.abs(s_new[j]) < float("inf"))
    p_new = tl.where(finite, p_new, p)
    _st(ptrs[1] + offs, to_dtype(p_new, P_DTYPE, SOFT_BF16), mask, MASKED)
    # stochastic rounding of the 8-bit states (bnbf.quant): each element's place in its block times an odd
    # constant, plus a hash of (block, step); one offset per element, shared by its states
    lane = (tl.arange(0, BLOCK).to(tl.uint32) * DITHER_LANE)[None, :]
    seed = mix(rows.to(tl.uint32) * DITHER_BLOCK + dith)[:, None]
    for j in tl.static_range(SLOTS):
        if (PRESENT >> j) & 1:
            _store_state(
                ptrs[3][j],
                tl.where(finite, s_new[j], 0.0),
                offs,
                mask,
                rows,
                rmask,
                lane,
                seed,
                QUANT,
                (SIGNED >> j) & 1,
                FORMAT,
                MASKED,
                VEC,
            )


@triton.jit
def _tiles_in_turn(
    ptrs,
    hp,
    dith,
    gscale,
    code_ptr,
    first,
    numel,
    nrm,
    part,
    n_tiles,
    MATH: tl.constexpr,
    SLOTS: tl.constexpr,
    PRESENT: tl.constexpr,
    SIGNED: tl.constexpr,
    QUANT: tl.constexpr,
    P_DTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    SOFT_BF16: tl.constexpr,
    FORMAT: tl.constexpr,
    MASKED: tl.constexpr,
    VEC: tl.constexpr,
    ITERS: tl.constexpr,
    SKIP_ZEROS: tl.constexpr,
    NORM_MODE: tl.constexpr,
    NORM_TERMS: tl.constexpr,
    HP_STRIDE: tl.constexpr,
    CLIP: tl.constexpr,
):
    """A program's tiles one after the other, each loaded then stepped (no prefetch)."""
    for it in tl.range(0, ITERS):
        raw = _tile_load(ptrs, first + it, numel, SLOTS, PRESENT, QUANT, BLOCK, ROWS, MASKED, VEC)
        _tile_step(
            raw,
            ptrs,
            hp,
            dith,
            gscale,
            code_ptr,
            first + it,
            numel,
            nrm,
            part + it,
            n_tiles,
            MATH,
            SLOTS,
            PRESENT,
            SIGNED,
            QUANT,
            P_DTYPE,
            BLOCK,
            ROWS,
            SOFT_BF16,
            FORMAT,
            MASKED,
            VEC,
            SKIP_ZEROS,
            NORM_MODE,
            NORM_TERMS,
            HP_STRIDE,
            CLIP,
        )


@triton.jit
def _step_kernel(
    table_ptr,
    task_ptr,
    grad_ptr,
    hp_ptr,
    code_ptr,
    norm_ptr,
    n_tiles,
    h0,
    h1,
    h2,
    h3,
    h4,
    h5,
    h6,
    h7,
    h8,
    h9,
    h10,
    h11,
    h12,
    h13,
    h14,
    h15,
    h16,
    h17,
    clip_ptr,
    clip_max,
    HP_FROM_PTR: tl.constexpr,
    HP_PER_TENSOR: tl.constexpr,
    FIRST_BLOCK: tl.constexpr,
    MATH: tl.constexpr,
    SLOTS: tl.constexpr,
    PRESENT: tl.constexpr,
    SIGNED: tl.constexpr,
    QUANT: tl.constexpr,
    P_DTYPE: tl.constexpr,
    HP_STRIDE: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    SOFT_BF16: tl.constexpr,
    FORMAT: tl.constexpr,
    ALIGNED: tl.constexpr,
    VEC: tl.constexpr,
    ITERS: tl.constexpr,
    PREFETCH: tl.constexpr,
    SKIP_ZEROS: tl.constexpr,
    NORM_MODE: tl.constexpr,
    NORM_TERMS: tl.constexpr,
    SUM_SPLIT: tl.constexpr,
    CLIP: tl.constexpr,
):
    """NORM_MODE 0: the step. 1: the norm pass, writing per-tile partial sums to norm_ptr[3, n_tiles].
    2: the step of a rule that needs per-tensor sums, from norm_ptr[tensor, 3, SUM_SPLIT] (see
    _tensor_sums_kernel). The rule has SLOTS state slots: bit j of PRESENT says slot j is kept, bit j of
    SIGNED that it is quantized with the signed map. CLIP 0: the grads as they are (``clip_ptr`` and
    ``clip_max`` unused); 1: scaled by the global-norm clipping coefficient of the total norm at ``clip_ptr``
    and ``clip_max``; 2: by the coefficient at ``clip_ptr`` (:func:`_clip_coef`), in the norm pass and the step
    alike; 3 (norm pass only): clipping folded into the pass, which takes the grads as they are and sums g²
    over every element in the third sum, which the rule leaves unused (``norm_grad_powers``): the total norm
    comes from those sums, and the step after them takes CLIP 2."""
    hp = (h0, h1, h2, h3, h4, h5, h6, h7, h8, h9, h10, h11, h12, h13, h14, h15, h16, h17)
    _program(
        tl.program_id(0),
        table_ptr,
        task_ptr,
        grad_ptr,
        hp_ptr,
        hp,
        code_ptr,
        norm_ptr,
        n_tiles,
        clip_ptr,
        clip_max,
        HP_FROM_PTR,
        HP_PER_TENSOR,
        FIRST_BLOCK,
        MATH,
        SLOTS,
        PRESENT,
        SIGNED,
        QUANT,
        P_DTYPE,
        HP_STRIDE,
        BLOCK,
        ROWS,
        SOFT_BF16,
        FORMAT,
        ALIGNED,
        VEC,
        ITERS,
        PREFETCH,
        SKIP_ZEROS,
        NORM_MODE,
        NORM_TERMS,
        SUM_SPLIT,
        CLIP,
    )


@triton.jit
def _program(
    pid,
    table_ptr,
    task_ptr,
    grad_ptr,
    hp_ptr,
    hp_args,
    code_ptr,
    norm_ptr,
    n_tiles,
    clip_ptr,
    clip_max,
    HP_FROM_PTR: tl.constexpr,
    HP_PER_TENSOR: tl.constexpr,
    FIRST_BLOCK: tl.constexpr,
    MATH: tl.constexpr,
    SLOTS: tl.constexpr,
    PRESENT: tl.constexpr,
    SIGNED: tl.constexpr,
    QUANT: tl.constexpr,
    P_DTYPE: tl.constexpr,
    HP_STRIDE: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    SOFT_BF16: tl.constexpr,
    FORMAT: tl.constexpr,
    ALIGNED: tl.constexpr,
    VEC: tl.constexpr,
    ITERS: tl.constexpr,
    PREFETCH: tl.constexpr,
    SKIP_ZEROS: tl.constexpr,
    NORM_MODE: tl.constexpr,
    NORM_TERMS: tl.constexpr,
    SUM_SPLIT: tl.constexpr,
    CLIP: tl.constexpr,
):
    """One program of :func:`_step_kernel` (program ``pid`` of its group's task list): the kernel's body, also
    each half of :func:`_pair_kernel`. ``hp_args``: the scalars given as kernel arguments."""
    tensor = tl.load(task_ptr + 2 * pid).to(tl.int64)
    first = tl.load(task_ptr + 2 * pid + 1).to(tl.int64) * ITERS  # first tile of this program
    table = table_ptr + tensor * (HEAD + PER_SLOT * SLOTS)
    numel = tl.load(table + 2)
    # the rule's scalars: kernel arguments (floats given on the host: nothing to upload), or a float32 row
    # on the device (0-d tensor hyperparameters, traced calls)
    if HP_FROM_PTR:
        if HP_PER_TENSOR:  # per-leaf hyperparameters: this tensor's own row
            hp_ptr = hp_ptr + tensor * HP_STRIDE
        hp = ()
        for k in tl.static_range(HP_STRIDE):
            hp = hp + (_hp_at(hp_ptr, k),)
    else:
        hp = hp_args
    if NORM_MODE == 2:  # this tensor's three sums, each from SUM_SPLIT partial sums in a fixed order
        base = norm_ptr + tensor * (3 * SUM_SPLIT)
        nrm = (
            _split_sum(base, SUM_SPLIT),
            _split_sum(base + SUM_SPLIT, SUM_SPLIT),
            _split_sum(base + 2 * SUM_SPLIT, SUM_SPLIT),
        )
    else:
        nrm = (0.0, 0.0, 0.0)
    # every address once per program (param in, param out, grad, then each state slot's four), not per tile:
    # the compiler cannot hoist loads of the table past the tiles' stores
    ptrs = (
        _addr(table, 0, P_DTYPE, ALIGNED),
        _addr(table, 1, P_DTYPE, ALIGNED),
        _addr(grad_ptr, tensor, P_DTYPE, ALIGNED),
    )  # grads change every step: their own small table
    slot_ptrs = ()
    for j in tl.static_range(SLOTS):
        slot_ptrs = slot_ptrs + (_slot_ptrs(table, j, PRESENT, QUANT, ALIGNED),)
    ptrs = ptrs + (slot_ptrs,)
    part = norm_ptr + pid * ITERS
    # the step's share of the dither's block hashes, and the tensor's first block's: (rows + first block) *
    # DITHER_BLOCK + step * DITHER_STEP, all mod 2**32, as bnbf.quant.state_dither
    dith = tl.cast(hp[HP_STRIDE - 3], tl.uint32) * DITHER_STEP
    if FIRST_BLOCK:  # a shard's first block (the column is read only where some tensor's is not 0)
        dith = dith + tl.load(table + 3).to(tl.uint32) * DITHER_BLOCK
    # the grads' factor: the sign (-1 with maximize) times the clipping coefficient, once per program
    if CLIP == 1 or CLIP == 2:
        gscale = hp[HP_STRIDE - 4] * _clip_coef(clip_ptr, clip_max, CLIP, SOFT_BF16)
    else:
        gscale = 1.0
    # whole tiles skip the bounds masks, which would otherwise stop the loads from vectorizing
    if (first + ITERS) * (ROWS * BLOCK) <= numel:
        if PREFETCH:  # the next tile's loads are in flight while this tile computes
            # every address moved to the program's first block once: tile ``it`` is then at a constant offset, which
            # the loads and stores take as an immediate (each tile's int64 addresses took ~3 instructions an
            # element); the dither's block index stays the tensor's (mod 2**32 the product distributes)
            row0 = first * ROWS
            at = _shift_ptrs(ptrs, row0, BLOCK, SLOTS)
            left = numel - row0 * BLOCK  # the elements from there on (unread: whole tiles take no masks)
            raw = _tile_load(at, 0, left, SLOTS, PRESENT, QUANT, BLOCK, ROWS, False, VEC)
            for it in tl.static_range(ITERS):
                if it + 1 < ITERS:
                    nxt = _tile_load(at, it + 1, left, SLOTS, PRESENT, QUANT, BLOCK, ROWS, False, VEC)
                _tile_step(
                    raw,
                    at,
                    hp,
                    dith + row0.to(tl.uint32) * DITHER_BLOCK,
                    gscale,
                    code_ptr,
                    it,
                    left,
                    nrm,
                    part + it,
                    n_tiles,
                    MATH,
                    SLOTS,
                    PRESENT,
                    SIGNED,
                    QUANT,
                    P_DTYPE,
                    BLOCK,
                    ROWS,
                    SOFT_BF16,
                    FORMAT,
                    False,
                    VEC,
                    SKIP_ZEROS,
                    NORM_MODE,
                    NORM_TERMS,
                    HP_STRIDE,
                    CLIP,
                )
                if it + 1 < ITERS:
                    raw = nxt
        else:
            _tiles_in_turn(
                ptrs,
                hp,
                dith,
                gscale,
                code_ptr,
                first,
                numel,
                nrm,
                part,
                n_tiles,
                MATH,
                SLOTS,
                PRESENT,
                SIGNED,
                QUANT,
                P_DTYPE,
                BLOCK,
                ROWS,
                SOFT_BF16,
                FORMAT,
                False,
                VEC,
                ITERS,
                SKIP_ZEROS,
                NORM_MODE,
                NORM_TERMS,
                HP_STRIDE,
                CLIP,
            )
    else:
        _tiles_in_turn(
            ptrs,
            hp,
            dith,
            gscale,
            code_ptr,
            first,
            numel,
            nrm,
            part,
            n_tiles,
            MATH,
            SLOTS,
            PRESENT,
            SIGNED,
            QUANT,
            P_DTYPE,
            BLOCK,
            ROWS,
            SOFT_BF16,
            FORMAT,
            True,
            VEC,
            ITERS,
            SKIP_ZEROS,
            NORM_MODE,
            NORM_TERMS,
            HP_STRIDE,
            CLIP,
        )


@triton.jit
def _pair_kernel(
    table_ptr,
    task_ptr,
    grad_ptr,
    table2_ptr,
    task2_ptr,
    grad2_ptr,
    split,
    code_ptr,
    h0,
    h1,
    h2,
    h3,
    h4,
    h5,
    h6,
    h7,
    h8,
    h9,
    h10,
    h11,
    h12,
    h13,
    h14,
    h15,
    h16,
    h17,
    MATH: tl.constexpr,
    SLOTS: tl.constexpr,
    PRESENT: tl.constexpr,
    SIGNED: tl.constexpr,
    HP_STRIDE: tl.constexpr,
    ROWS: tl.constexpr,
    SOFT_BF16: tl.constexpr,
    SKIP_ZEROS: tl.constexpr,
    QUANT: tl.constexpr,
    P_DTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
    FORMAT: tl.constexpr,
    ALIGNED: tl.constexpr,
    VEC: tl.constexpr,
    ITERS: tl.constexpr,
    PREFETCH: tl.constexpr,
    QUANT2: tl.constexpr,
    P_DTYPE2: tl.constexpr,
    BLOCK2: tl.constexpr,
    FORMAT2: tl.constexpr,
    ALIGNED2: tl.constexpr,
    VEC2: tl.constexpr,
    ITERS2: tl.constexpr,
):
    """Two groups of one rule (e.g. a model's 8-bit states and the 32-bit states of its small tensors) in one
    launch: programs below ``split`` run the first group's tasks, the others the second's, each as
    :func:`_step_kernel` would alone (the usual step: scalars as arguments, no norms, no clipping). One driver
    launch fewer per step. The same arithmetic, but another kernel: ptxas may contract a multiply and an add
    into an FMA where the other did not (seen once: Lion's sign input at a tie). The second group's tiles run
    one after the other (no prefetch), so that its code does not raise the registers of the first's."""
    hp = (h0, h1, h2, h3, h4, h5, h6, h7, h8, h9, h10, h11, h12, h13, h14, h15, h16, h17)
    pid = tl.program_id(0)
    if pid < split:
        _usual_program(
            pid,
            table_ptr,
            task_ptr,
            grad_ptr,
            code_ptr,
            hp,
            MATH,
            SLOTS,
            PRESENT,
            SIGNED,
            HP_STRIDE,
            ROWS,
            SOFT_BF16,
            SKIP_ZEROS,
            QUANT,
            P_DTYPE,
            BLOCK,
            FORMAT,
            ALIGNED,
            VEC,
            ITERS,
            PREFETCH,
        )
    else:
        _usual_program(
            pid - split,
            table2_ptr,
            task2_ptr,
            grad2_ptr,
            code_ptr,
            hp,
            MATH,
            SLOTS,
            PRESENT,
            SIGNED,
            HP_STRIDE,
            ROWS,
            SOFT_BF16,
            SKIP_ZEROS,
            QUANT2,
            P_DTYPE2,
            BLOCK2,
            FORMAT2,
            ALIGNED2,
            VEC2,
            ITERS2,
            False,
        )


@triton.jit
def _usual_program(
    pid,
    table_ptr,
    task_ptr,
    grad_ptr,
    code_ptr,
    hp,
    MATH: tl.constexpr,
    SLOTS: tl.constexpr,
    PRESENT: tl.constexpr,
    SIGNED: tl.constexpr,
    HP_STRIDE: tl.constexpr,
    ROWS: tl.constexpr,
    SOFT_BF16: tl.constexpr,
    SKIP_ZEROS: tl.constexpr,
    QUANT: tl.constexpr,
    P_DTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
    FORMAT: tl.constexpr,
    ALIGNED: tl.constexpr,
    VEC: tl.constexpr,
    ITERS: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """:func:`_program` of the usual step: scalars as arguments, no norm pass, no clipping, no shard offsets
    (the pointers for norms and clipping unused)."""
    _program(
        pid,
        table_ptr,
        task_ptr,
        grad_ptr,
        code_ptr,
        hp,
        code_ptr,
        code_ptr,
        0,
        code_ptr,
        0.0,
        HP_FROM_PTR=False,
        HP_PER_TENSOR=False,
        FIRST_BLOCK=False,
        MATH=MATH,
        SLOTS=SLOTS,
        PRESENT=PRESENT,
        SIGNED=SIGNED,
        QUANT=QUANT,
        P_DTYPE=P_DTYPE,
        HP_STRIDE=HP_STRIDE,
        BLOCK=BLOCK,
        ROWS=ROWS,
        SOFT_BF16=SOFT_BF16,
        FORMAT=FORMAT,
        ALIGNED=ALIGNED,
        VEC=VEC,
        ITERS=ITERS,
        PREFETCH=PREFETCH,
        SKIP_ZEROS=SKIP_ZEROS,
        NORM_MODE=0,
        NORM_TERMS=None,
        SUM_SPLIT=1,
        CLIP=0,
    )


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


@triton.jit
def _grad_squares_kernel(
    table_ptr,
    task_ptr,
    grad_ptr,
    part_ptr,
    n_tiles,
    ROW: tl.constexpr,
    G_DTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
    ITERS: tl.constexpr,
):
    """Gradient clipping's read of the grads where the rule's norm pass cannot give the total norm: program
    ``pid`` takes the tiles of the step's program ``pid`` (the group's tasks, address table of ``ROW`` int64
    fields per tensor, grad table) and writes each tile's float32 sum of g² over every element, non-finite ones
    included (padding lanes load 0), into row 2 of the [3, n_tiles] partials, rows 0 and 1 zeroed, for
    _tensor_sums_kernel to add per tensor in float64. Offsets in int64 (tensors beyond 2**31 elements)."""
    pid = tl.program_id(0)
    tensor = tl.load(task_ptr + 2 * pid).to(tl.int64)
    first = tl.load(task_ptr + 2 * pid + 1).to(tl.int64) * ITERS
    numel = tl.load(table_ptr + tensor * ROW + 2)
    g_ptr = tl.load(grad_ptr + tensor).to(tl.pointer_type(G_DTYPE))
    part = part_ptr + pid * ITERS
    for it in tl.static_range(ITERS):
        offs = (first + it) * BLOCK + tl.arange(0, BLOCK)
        g = tl.load(g_ptr + offs, mask=offs < numel, other=0.0).to(tl.float32)
        tl.store(part + it, 0.0)
        tl.store(part + n_tiles + it, 0.0)
        tl.store(part + 2 * n_tiles + it, tl.sum(g * g, 0))

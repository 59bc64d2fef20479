"""The fused multi-tensor optimizer step: one Triton launch updates every tensor of a group.

Three layers:

- ``_step_kernel``: each program takes ``ROWS`` quantization blocks of one tensor, found through a task
  list (tensor index, chunk index). It dequantizes the states, runs the rule's ``math`` in float32,
  writes the param in its own dtype and requantizes each state with the block's new absmax.
- ``launch``: checks nothing (the functional layer validated), builds or reuses the address table and
  the task list, and launches once.
- ``bnbf::step_`` / ``bnbf::step``: the ``torch.library`` ops (in place / out of place) through which the
  functional layer calls it, with fake implementations so that tracing needs no redesign.

The address table (int64, one row of ``NF`` fields per tensor) is cached by the addresses it holds, and
the task list by the tensor sizes, so a training loop on the same tensors rebuilds neither.
"""

from __future__ import annotations

import collections

import torch
import triton
import triton.language as tl
from torch import Tensor

from bnbf._dispatch import interpreting
from bnbf.kernels.codec import decode_dynamic_arith, decode_tables, encode_dynamic, encode_dynamic_cmp, to_dtype
from bnbf.quant import dynamic_map
from bnbf.rules import get_rule

MAX_STATES = 3
NF = 5 + 4 * MAX_STATES  # p_in, p_out, g, numel, hp_row, then per state: s_in, s_out, absmax_in, absmax_out
ROWS = 4  # quantization blocks per program
NUM_WARPS = 4
ENCODER = 1  # 0: log2/exp2 decade (reference design), 1: comparisons + bit tricks
DECODER = 1  # 0: gather from the 256-entry map, 1: arithmetic from the code's bits

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _load_state(table, SLOT: tl.constexpr, offs, mask, rows, rmask, code_ptr,
                QUANT: tl.constexpr, SIGNED: tl.constexpr, DECODER: tl.constexpr):  # fmt: skip
    base: tl.constexpr = 5 + 4 * SLOT
    if QUANT:
        q_ptr = tl.load(table + base).to(tl.pointer_type(tl.uint8))
        a_ptr = tl.load(table + base + 2).to(tl.pointer_type(tl.float32))
        q = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.int32)
        absmax = tl.load(a_ptr + rows, mask=rmask, other=0.0)
        if DECODER == 1:
            v = decode_dynamic_arith(q, code_ptr + 512, SIGNED)
        else:
            map_ptr = code_ptr if SIGNED else code_ptr + 256
            v = tl.load(map_ptr + q)
        return v * absmax[:, None]
    else:
        s_ptr = tl.load(table + base).to(tl.pointer_type(tl.float32))
        return tl.load(s_ptr + offs, mask=mask, other=0.0)


@triton.jit
def _store_state(table, SLOT: tl.constexpr, s, offs, mask, rows, rmask,
                 QUANT: tl.constexpr, SIGNED: tl.constexpr, ENCODER: tl.constexpr):  # fmt: skip
    base: tl.constexpr = 5 + 4 * SLOT
    if QUANT:
        q_ptr = tl.load(table + base + 1).to(tl.pointer_type(tl.uint8))
        a_ptr = tl.load(table + base + 3).to(tl.pointer_type(tl.float32))
        s = tl.where(mask, s, 0.0)  # padding lanes must not raise the block's absmax
        absmax = tl.max(tl.abs(s), axis=1)
        scale = tl.where(absmax > 0, 1.0 / tl.where(absmax > 0, absmax, 1.0), 0.0)
        if ENCODER == 1:
            q = encode_dynamic_cmp(s * scale[:, None], SIGNED)
        else:
            q = encode_dynamic(s * scale[:, None], SIGNED)
        tl.store(q_ptr + offs, q.to(tl.uint8), mask=mask)
        tl.store(a_ptr + rows, absmax, mask=rmask)
    else:
        s_ptr = tl.load(table + base + 1).to(tl.pointer_type(tl.float32))
        tl.store(s_ptr + offs, s, mask=mask)


@triton.jit
def _step_kernel(
    table_ptr, task_ptr, hp_ptr, code_ptr,
    MATH: tl.constexpr, N_STATES: tl.constexpr, QUANT: tl.constexpr,
    SIGNED0: tl.constexpr, SIGNED1: tl.constexpr, SIGNED2: tl.constexpr,
    P_DTYPE: tl.constexpr, HP_STRIDE: tl.constexpr, NF: tl.constexpr,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, SOFT_BF16: tl.constexpr,
    ENCODER: tl.constexpr, DECODER: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    tensor = tl.load(task_ptr + 2 * pid).to(tl.int64)
    chunk = tl.load(task_ptr + 2 * pid + 1).to(tl.int64)
    table = table_ptr + tensor * NF
    numel = tl.load(table + 3)
    hp = hp_ptr + tl.load(table + 4) * HP_STRIDE
    rows = chunk * ROWS + tl.arange(0, ROWS)  # int64: tensors may exceed 2**31 elements
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = offs < numel
    rmask = rows * BLOCK < numel

    p_in = tl.load(table + 0).to(tl.pointer_type(P_DTYPE))
    p_out = tl.load(table + 1).to(tl.pointer_type(P_DTYPE))
    g_ptr = tl.load(table + 2).to(tl.pointer_type(P_DTYPE))
    p = tl.load(p_in + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s0 = 0.0
    s1 = 0.0
    s2 = 0.0
    if N_STATES > 0:
        s0 = _load_state(table, 0, offs, mask, rows, rmask, code_ptr, QUANT, SIGNED0, DECODER)
    if N_STATES > 1:
        s1 = _load_state(table, 1, offs, mask, rows, rmask, code_ptr, QUANT, SIGNED1, DECODER)
    if N_STATES > 2:
        s2 = _load_state(table, 2, offs, mask, rows, rmask, code_ptr, QUANT, SIGNED2, DECODER)

    p_new, s0, s1, s2 = MATH(p, g, s0, s1, s2, hp)

    # a non-finite gradient element leaves its param element alone and zeroes its states (bitsandbytes)
    finite = tl.abs(g) < float("inf")
    p_new = tl.where(finite, p_new, p)
    tl.store(p_out + offs, to_dtype(p_new, P_DTYPE, SOFT_BF16), mask=mask)
    if N_STATES > 0:
        _store_state(table, 0, tl.where(finite, s0, 0.0), offs, mask, rows, rmask, QUANT, SIGNED0, ENCODER)
    if N_STATES > 1:
        _store_state(table, 1, tl.where(finite, s1, 0.0), offs, mask, rows, rmask, QUANT, SIGNED1, ENCODER)
    if N_STATES > 2:
        _store_state(table, 2, tl.where(finite, s2, 0.0), offs, mask, rows, rmask, QUANT, SIGNED2, ENCODER)


# ---- launcher ---------------------------------------------------------------------------------------

_TABLES: collections.OrderedDict = collections.OrderedDict()
_TASKS: collections.OrderedDict = collections.OrderedDict()
_CACHE_SIZE = 16
LAUNCH_KEYS: set = set()  # static (compile-relevant) keys launched so far; tests read it


def _cached(cache: collections.OrderedDict, key, build):
    hit = cache.get(key)
    if hit is not None:
        cache.move_to_end(key)
        return hit
    value = build()
    cache[key] = value
    if len(cache) > _CACHE_SIZE:
        cache.popitem(last=False)
    return value


def _to_device(t: Tensor, device: torch.device) -> Tensor:
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _tasks(numels: tuple[int, ...], block: int, device: torch.device) -> Tensor:
    per_chunk = block * ROWS
    chunks = torch.tensor([-(-n // per_chunk) for n in numels], dtype=torch.int64)
    tensor_idx = torch.repeat_interleave(torch.arange(len(numels)), chunks)
    starts = torch.cumsum(chunks, 0) - chunks
    chunk_idx = torch.arange(int(chunks.sum())) - torch.repeat_interleave(starts, chunks)
    return _to_device(torch.stack([tensor_idx, chunk_idx], 1).to(torch.int32).contiguous(), device)


def launch(p_in, p_out, grads, s_in, s_out, hp: Tensor, hp_rows, rule_name: str, quant: bool, block: int):
    """One launch for tensors sharing device, param dtype and state layout.

    ``s_in``/``s_out`` hold, per tensor, its state fields in layout order (codes and absmax
    interleaved when ``quant``). ``hp`` is a float32 [rows, k] tensor of the rule's scalars and
    ``hp_rows[i]`` the row of tensor ``i``.
    """
    rule = get_rule(rule_name)
    block = block if quant else 256  # float32 states have no blocks; 256 is only the tile width
    n_states = len(rule.states)
    per = 2 * n_states if quant else n_states
    device = p_in[0].device
    rows_of = []
    for i in range(len(p_in)):
        addr = [p_in[i].data_ptr(), p_out[i].data_ptr(), grads[i].data_ptr(), p_in[i].numel(), int(hp_rows[i])]
        for j in range(MAX_STATES):
            if j < n_states and quant:
                a, b = s_in[i * per + 2 * j], s_in[i * per + 2 * j + 1]
                c, d = s_out[i * per + 2 * j], s_out[i * per + 2 * j + 1]
                addr += [a.data_ptr(), c.data_ptr(), b.data_ptr(), d.data_ptr()]
            elif j < n_states:
                addr += [s_in[i * per + j].data_ptr(), s_out[i * per + j].data_ptr(), 0, 0]
            else:
                addr += [0, 0, 0, 0]
        rows_of.append(tuple(addr))
    key = (device, tuple(rows_of))
    table = _cached(_TABLES, key, lambda: _to_device(torch.tensor(rows_of, dtype=torch.int64), device))
    numels = tuple(r[3] for r in rows_of)
    tasks = _cached(_TASKS, (device, block, ROWS, numels), lambda: _tasks(numels, block, device))
    signed = [s.signed for s in rule.states] + [True] * (MAX_STATES - n_states)
    pdtype = _TL_DTYPES[p_in[0].dtype]
    static = (rule_name, quant, p_in[0].dtype, block, ROWS, hp.shape[1], ENCODER, DECODER)
    LAUNCH_KEYS.add(static)
    code_ptr = _code_tables(device) if quant else hp  # unused without quantized states
    _step_kernel[(tasks.shape[0],)](
        table, tasks, hp, code_ptr,
        MATH=rule.math, N_STATES=n_states, QUANT=quant,
        SIGNED0=signed[0], SIGNED1=signed[1], SIGNED2=signed[2],
        P_DTYPE=pdtype, HP_STRIDE=hp.shape[1], NF=NF, BLOCK=block, ROWS=ROWS, SOFT_BF16=interpreting(),
        ENCODER=ENCODER, DECODER=DECODER,
        num_warps=NUM_WARPS,
    )  # fmt: skip


_CODE_TABLES: dict[torch.device, Tensor] = {}


def _code_tables(device: torch.device) -> Tensor:
    """Signed map, unsigned map, then the arithmetic decoder's rows: float32[552], cached per device."""
    t = _CODE_TABLES.get(device)
    if t is None:
        pq = torch.tensor(decode_tables(), dtype=torch.float32, device=device)
        t = torch.cat([dynamic_map(True, device), dynamic_map(False, device), pq]).contiguous()
        _CODE_TABLES[device] = t
    return t

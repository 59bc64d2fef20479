"""A step's scalars from 0-d device tensors (a tensor lr, a tensor step...) in one launch.

A rule derives its kernel's scalars from the hyperparameters and the step with Python arithmetic
(:attr:`bnbf.rules.base.Rule.scalars`). Where some are 0-d device tensors, each operation on them is a small torch
op: AdamW's scalars took 15 launches and about 0.26 ms of an H100 host's time a step
(benchmarks/results/2026-12-07_h100_session56.md). Here the rule's own ``scalars`` runs once on stand-ins for those
tensors (:class:`Sym`) that record the arithmetic, numbers folding on the host as before; the recorded program then
runs in one single-program kernel, in float64, reading the tensors on the device as they are (no conversion
launch, no host synchronization); an int step beside them is an argument of the launch,
so one program serves every step. The rule is written once, for numbers and tensors alike; an operation the
stand-ins do not record (a comparison, a ``float()``, a torch function) ends the recording and the caller takes the
small torch ops instead.
"""

from __future__ import annotations

import array
import struct
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from bnbf.kernels.direct_launch import launch

ADD, SUB, MUL, DIV, POW, MOD, FLOORDIV, NEG = range(8)
MAX_INPUTS = 4  # the kernel's tensor pointers (registers 0-3)
NUMBER = MAX_INPUTS  # register 4: an int argument of the launch (a step that is a Python int), no copy to the device
MAX_NUMBER = 2**31  # the numbers it takes: below, Triton types the argument int32 (one kernel for every step)
MAX_REGISTERS = 64  # inputs, constants and intermediate values of one program
MAX_OUTPUTS = 32  # the scalars of one step (a rule's, at most 14, and the step's four)


class Untraceable(TypeError):
    """An operation on a :class:`Sym` that a program cannot record (its caller then computes with torch ops)."""


class _Tape:
    """What a trace recorded: instructions (op, a, b, out), constants, and how many results."""

    __slots__ = ("code", "consts", "const_at", "n_temps")

    def __init__(self) -> None:
        self.code: list[tuple] = []
        self.consts: list[float] = []
        self.const_at: dict = {}  # a constant's float64 bits -> its register (0.0 and -0.0 differ)
        self.n_temps = 0

    def operand(self, x: Any) -> int:
        if type(x) is Sym and x.tape is self:
            return x.reg
        if type(x) not in (int, float, bool):
            raise Untraceable(f"a {type(x).__name__} in a scalar program")
        value = float(x)  # an int beyond float64 raises OverflowError: not recorded either
        bits = struct.pack("d", value)
        reg = self.const_at.get(bits)
        if reg is None:  # registers: the inputs, then the constants, then the results (numbered by Program)
            reg = self.const_at[bits] = ("c", len(self.consts))
            self.consts.append(value)
        return reg

    def record(self, op: int, a: Any, b: Any) -> Sym:
        out = ("t", self.n_temps)
        self.n_temps += 1
        self.code.append((op, self.operand(a), self.operand(b), out))
        return Sym(self, out)


class Sym:
    """A stand-in for a 0-d tensor while a rule's ``scalars`` runs: its arithmetic with numbers and other stand-ins
    is recorded; anything else (comparisons, truth, conversion to a number) raises :class:`Untraceable`."""

    __slots__ = ("tape", "reg")

    def __init__(self, tape: _Tape, reg: Any) -> None:
        self.tape = tape
        self.reg = reg

    def __add__(self, o):
        return self.tape.record(ADD, self, o)

    def __radd__(self, o):
        return self.tape.record(ADD, o, self)

    def __sub__(self, o):
        return self.tape.record(SUB, self, o)

    def __rsub__(self, o):
        return self.tape.record(SUB, o, self)

    def __mul__(self, o):
        return self.tape.record(MUL, self, o)

    def __rmul__(self, o):
        return self.tape.record(MUL, o, self)

    def __truediv__(self, o):
        return self.tape.record(DIV, self, o)

    def __rtruediv__(self, o):
        return self.tape.record(DIV, o, self)

    def __pow__(self, o):
        return self.tape.record(POW, self, o)

    def __rpow__(self, o):
        return self.tape.record(POW, o, self)

    def __mod__(self, o):
        return self.tape.record(MOD, self, o)

    def __rmod__(self, o):
        return self.tape.record(MOD, o, self)

    def __floordiv__(self, o):
        return self.tape.record(FLOORDIV, self, o)

    def __rfloordiv__(self, o):
        return self.tape.record(FLOORDIV, o, self)

    def __neg__(self):
        return self.tape.record(NEG, self, 0.0)

    def __pos__(self):
        return self

    def _refuse(self, *_: Any) -> Any:
        raise Untraceable("a scalar program records arithmetic only")

    __bool__ = __float__ = __int__ = __index__ = __complex__ = _refuse
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __abs__ = __round__ = _refuse
    __hash__ = None  # type: ignore[assignment]


class Program:
    """A recorded program: ``row`` (float64, host) holds its constants, its code (op, a, b, out per instruction, as
    register numbers) and the register of each output; ``data`` is the row's bytes (what its device copy is found
    by); ``n_ops``, ``n_consts`` and ``n_outputs`` say where each part starts."""

    __slots__ = ("row", "data", "n_ops", "n_consts", "n_outputs")

    def __init__(self, tape: _Tape, outputs: list) -> None:
        n_c = len(tape.consts)

        def number(reg: Any) -> int:  # the inputs' registers first (pointers, the number), then constants, results
            if type(reg) is int:
                return reg
            kind, k = reg
            return NUMBER + 1 + k if kind == "c" else NUMBER + 1 + n_c + k

        code = [x if k == 0 else number(x) for ins in tape.code for k, x in enumerate(ins)]  # op, a, b, out
        self.n_ops, self.n_consts, self.n_outputs = len(tape.code), n_c, len(outputs)
        self.row = array.array("d", [*tape.consts, *code, *map(number, outputs)])
        self.data = self.row.tobytes()

    @property
    def registers(self) -> int:
        return NUMBER + 1 + self.n_consts + self.n_ops


def trace(fn: Any, n_inputs: int, number: bool = False) -> tuple[Any, list]:
    """Run ``fn(*inputs)`` on ``n_inputs`` stand-ins for tensors, and with ``number`` one more for the launch's int
    argument (:func:`run`'s ``number``). Returns what it returned and the stand-ins; raises :class:`Untraceable` (or
    the error the function itself raised on them) where it cannot be recorded."""
    tape = _Tape()
    syms = [Sym(tape, k) for k in range(n_inputs)]  # registers 0..n_inputs-1: the kernel's pointers
    if number:
        syms.append(Sym(tape, NUMBER))
    return fn(*syms), syms


def program_of(values: tuple, inputs: list) -> Program | None:
    """The program computing ``values`` (what a traced function returned: numbers and stand-ins), one output per
    value; None where one is anything else (a container, a tensor, an object of the rule's own) or the program
    needs more registers or outputs than the kernel keeps."""
    if not inputs or len(values) > MAX_OUTPUTS:
        return None
    tape = inputs[0].tape
    outputs = []
    for v in values:
        if type(v) is Sym and v.tape is tape:
            outputs.append(v.reg)
        elif type(v) in (int, float, bool):
            try:
                outputs.append(tape.operand(v))
            except OverflowError:  # an int beyond float64
                return None
        else:
            return None
    program = Program(tape, outputs)
    return program if program.registers <= MAX_REGISTERS else None


def run(program: Program, row: Tensor, tensors: list[Tensor], number: int = 0) -> Tensor:
    """The program's outputs as a float32 row on the tensors' device, one launch. ``row``: :attr:`Program.row` on
    that device; ``tensors``: its inputs, 1-element each, their memory holding their values (no negative bit, no
    efficient zero tensor: the caller's check); ``number``: the int input (0 <= number <
    :data:`MAX_NUMBER`), where it was traced with one."""
    if not 0 <= number < MAX_NUMBER:
        raise ValueError(f"a scalar program's number must be in [0, 2**31), got {number}")
    device = tensors[0].device
    out = torch.empty(program.n_outputs, dtype=torch.float32, device=device)
    # the kernel reads element 0 of each input's memory, by a dtype code of the launch, and makes it float64 (exact:
    # the program computes in float64 anyway): no conversion launch, and which hyperparameters are tensors, of which
    # dtype, compiles no other kernel; another dtype (bool) is made float64 first
    xs = [t if t.dtype in _CODES else t.double() for t in tensors]
    xs += [xs[0]] * (MAX_INPUTS - len(xs))
    codes = sum(_CODES[t.dtype] << (4 * k) for k, t in enumerate(xs))
    sizes = (program.n_ops, program.n_consts, program.n_outputs)

    def dispatch() -> Any:
        return _program_kernel[(1,)](row, *map(_bytes, xs), codes, number, out, *sizes, R=MAX_REGISTERS, KP=MAX_OUTPUTS)

    if device.type != "cuda":  # the interpreter, which warns on what IEEE arithmetic takes silently
        with _quiet():
            dispatch()
        return out
    ptrs = [t.data_ptr() for t in xs]
    key = (device.index, *(a % 16 == 0 for a in ptrs))  # Triton specializes on the inputs' alignment
    launch(
        _COMPILED,
        device,
        key,
        (1, 1, 1),
        (row.data_ptr(), *ptrs, codes, number, out.data_ptr(), *sizes, None, None),
        dispatch,
    )
    return out


def _bytes(t: Tensor) -> Tensor:
    """Element 0 of ``t`` as a uint8 tensor at its address (the kernel's pointers are of one type)."""
    one = t.as_strided((1,), (1,))  # any 1-element view, whatever its strides, at its storage offset
    return one if t.dtype == torch.uint8 else one.view(torch.uint8)


# the dtypes the kernel reads, by their code in the launch's ``codes`` (4 bits an input)
_CODES = {torch.float64: 0, torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.int64: 4, torch.int32: 5,
          torch.int16: 6, torch.int8: 7, torch.uint8: 8}  # fmt: skip


_COMPILED: dict = {}  # direct launchers of the program kernel by configuration (bnbf.kernels.direct_launch)


def _quiet() -> Any:
    """The interpreter computes with NumPy, which warns on a division by zero or a log of 0."""
    import numpy as np

    return np.errstate(all="ignore")


@triton.jit
def _pick(regs, lanes, k):
    # register k as a scalar: -0.0 elsewhere adds nothing to any value, -0.0 and NaN included
    return tl.sum(tl.where(lanes == k, regs, -0.0), axis=0)


@triton.jit
def _floor_mod(x, y):
    # Python's (and torch's) modulo: the remainder takes the divisor's sign; exact for integers below 2**53
    q = tl.floor(x / y)
    r = x - q * y
    r = tl.where((y > 0) & (r < 0), r + y, r)
    r = tl.where((y > 0) & (r >= y), r - y, r)
    r = tl.where((y < 0) & (r > 0), r + y, r)
    return tl.where((y < 0) & (r <= y), r - y, r)


@triton.jit
def _power(x, y):
    """x ** y as torch.pow: an integral y (|y| < 2**53) by repeated squaring (exact for y = 1, signs of a negative
    x kept), 0.5 as a square root, any other y as exp(y·log x) (NaN for a negative x)."""
    integral = (tl.floor(y) == y) & (tl.abs(y) < 9007199254740992.0)
    e = tl.where(integral, tl.abs(y), 0.0)
    acc = e * 0.0 + 1.0  # float64 1 (e is finite; x may be NaN, and NaN ** 0 is 1)
    base = x
    while e > 0:  # a step's bit count of rounds
        half = tl.floor(e * 0.5)
        acc = tl.where(e - 2.0 * half == 1.0, acc * base, acc)
        base = base * base
        e = half
    whole = tl.where(y < 0, 1.0 / acc, acc)
    general = tl.where(x > 0, tl.exp(y * tl.log(x)), tl.where(x == 0, tl.where(y > 0, 0.0, float("inf")), float("nan")))
    general = tl.where(y == 0.5, tl.sqrt(x), general)
    general = tl.where(x == 1.0, 1.0, general)
    return tl.where(integral, whole, general)


@triton.jit
def _read(x, code):
    # element 0 at x (a uint8 pointer) as the dtype its code names (_CODES), in float64
    if code == 0:
        v = tl.load(x.to(tl.pointer_type(tl.float64)))
    elif code == 1:
        v = tl.load(x.to(tl.pointer_type(tl.float32))).to(tl.float64)
    elif code == 2:
        v = tl.load(x.to(tl.pointer_type(tl.float16))).to(tl.float64)
    elif code == 3:
        v = tl.load(x.to(tl.pointer_type(tl.bfloat16))).to(tl.float64)
    elif code == 4:
        v = tl.load(x.to(tl.pointer_type(tl.int64))).to(tl.float64)
    elif code == 5:
        v = tl.load(x.to(tl.pointer_type(tl.int32))).to(tl.float64)
    elif code == 6:
        v = tl.load(x.to(tl.pointer_type(tl.int16))).to(tl.float64)
    elif code == 7:
        v = tl.load(x.to(tl.pointer_type(tl.int8))).to(tl.float64)
    else:
        v = tl.load(x).to(tl.float64)
    return v


# a program's sizes, its number and its inputs' dtypes are data, not a new kernel
@triton.jit(do_not_specialize=["codes", "number", "n_ops", "n_consts", "n_outputs"])
def _program_kernel(
    row, x0, x1, x2, x3, codes, number, out, n_ops, n_consts, n_outputs, R: tl.constexpr, KP: tl.constexpr
):
    lanes = tl.arange(0, R)
    # registers: the four pointers' values, the number, then the constants, then each instruction's result
    regs = tl.load(row + lanes - 5, mask=(lanes >= 5) & (lanes < 5 + n_consts), other=0.0)
    regs = tl.where(lanes == 4, number.to(tl.float64), regs)
    regs = tl.where(lanes == 0, _read(x0, codes & 15), regs)
    regs = tl.where(lanes == 1, _read(x1, (codes >> 4) & 15), regs)
    regs = tl.where(lanes == 2, _read(x2, (codes >> 8) & 15), regs)
    regs = tl.where(lanes == 3, _read(x3, (codes >> 12) & 15), regs)
    for i in range(n_ops):
        at = row + n_consts + 4 * i
        op = tl.load(at).to(tl.int32)
        x = _pick(regs, lanes, tl.load(at + 1).to(tl.int32))
        y = _pick(regs, lanes, tl.load(at + 2).to(tl.int32))
        if op == 0:
            r = x + y
        elif op == 1:
            r = x - y
        elif op == 2:
            r = x * y
        elif op == 3:
            r = x / y
        elif op == 4:
            r = _power(x, y)
        elif op == 5:
            r = _floor_mod(x, y)
        elif op == 6:
            r = tl.floor((x - _floor_mod(x, y)) / y + 0.5)  # Python's x // y: (x - x % y) / y is whole
        else:
            r = -x
        regs = tl.where(lanes == tl.load(at + 3).to(tl.int32), r, regs)
    k = tl.arange(0, KP)
    at = tl.load(row + n_consts + 4 * n_ops + k, mask=k < n_outputs, other=-1.0).to(tl.int32)
    vals = tl.sum(tl.where(lanes[None, :] == at[:, None], regs[None, :], -0.0), axis=1)
    tl.store(out + k, vals.to(tl.float32), mask=k < n_outputs)

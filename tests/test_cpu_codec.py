"""The CPU step's native 8-bit codec (bnbf/csrc/cpu_codec.cpp, loaded by bnbf._cpu_codec) against bnbf.quant's
pure-torch oracle: the same codes, absmax and values bit for bit, on hostile inputs; and whole CPU steps that
are bitwise the same with the codec and without it. Skipped where the extension was not built (it is built by
``pip install --no-build-isolation -e .``, as CI installs).
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import assert_untouched, kernel_runs, snapshot
from hypothesis import given, settings
from hypothesis import strategies as st

import bnbf
from bnbf import _cpu_codec
from bnbf.quant import (
    STATE_FORMATS,
    dequantize_state_reference,
    quantize_state_reference,
    state_dither,
)
from bnbf.reference import FIRST_BLOCKS


@pytest.fixture(autouse=True)
def _needs_the_codec(request):
    if _cpu_codec.NATIVE is None and request.node.name != "test_the_codec_is_built_in_ci":
        pytest.skip(
            "native CPU codec not loaded: not built (pip install --no-build-isolation -e .), or BNBF_CPU_CODEC=torch"
        )


def test_the_codec_is_built_in_ci():
    """CI installs with ``pip install --no-build-isolation``, which builds the codec: there, its absence is a
    broken build, not a reason to skip this file."""
    if os.environ.get("CI", "") not in ("true", "1") or os.environ.get("BNBF_CPU_CODEC") == "torch":
        pytest.skip("only CI requires the extension")
    assert _cpu_codec.NATIVE is not None, "bnbf._cpu_codec_native did not build or load (see the install's log)"


BLOCK_SIZES = [64, 128, 256, 1024, 4096]  # what OptimSpec allows, 64 to 4096
SIZES = [1, 255, 256, 257, 4097]


def oracle(x, keep, fmt, signed, block_size, seed, first_block=0):
    """bnbf.quant's codes and absmax of the step's rounding of ``where(keep, x, 0)``."""
    if keep is not None:
        x = torch.where(keep, x, torch.zeros_like(x))
    d = state_dither(x.numel(), seed, block_size, first_block=first_block)
    return quantize_state_reference(x, fmt, signed, block_size, d)


def native(x, keep, fmt, signed, block_size, seed, first_block=0):
    codes = torch.full(x.shape, 77, dtype=torch.uint8)  # not a value the codec would leave by accident
    absmax = torch.full((-(-x.numel() // block_size),), -1.0)
    _cpu_codec.quantize_(x, keep, codes, absmax, fmt, signed, block_size, seed, first_block)
    return codes, absmax


def assert_same_bits(got, want, what: str) -> None:
    (codes, absmax), (codes_o, absmax_o) = got, want
    assert torch.equal(absmax.view(torch.int32), absmax_o.view(torch.int32)), f"{what}: absmax differs"
    bad = (codes != codes_o).nonzero().flatten()
    assert bad.numel() == 0, (
        f"{what}: {bad.numel()} codes differ, first at {bad[:5].tolist()}: native {codes[bad[:5]].tolist()}, "
        f"oracle {codes_o[bad[:5]].tolist()}"
    )


def hostile(n: int, block_size: int, signed: bool, seed: int, kind: str) -> torch.Tensor:
    """float32 values of ``n`` elements that a state can hold, ``kind`` picking the trouble: magnitudes from 1e-30
    to 1e30 (several decades in one block), spikes of 1e3..1e6 over a 1e-12 floor, denormals, whole-zero blocks
    and scattered zeros."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "decades":
        x = torch.exp(torch.rand(n, generator=gen) * 138.0 - 69.0)  # 1e-30 .. 1e30
    elif kind == "spikes":
        x = 1e-12 * torch.rand(n, generator=gen)
        hits = torch.randint(0, n, (max(1, n // 97),), generator=gen)
        x[hits] = 10.0 ** (3 + 3 * torch.rand(hits.numel(), generator=gen))
    elif kind == "one_block_range":  # 1e-12 .. 1e6 within every block
        x = 10.0 ** (torch.rand(n, generator=gen) * 18.0 - 12.0)
    elif kind == "denormal":
        bits = torch.randint(1, 1 << 23, (n,), generator=gen, dtype=torch.int32)  # below the smallest normal
        x = bits.view(torch.float32).clone()
        x[::5] = 1e-38  # normal neighbours
    else:  # "gaussian"
        x = torch.randn(n, generator=gen)
    if signed:
        x = x * torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    x[torch.rand(n, generator=gen) < 0.1] = 0.0
    if n > block_size:  # a whole block of zeros (and -0.0 in a signed one)
        x[block_size : 2 * block_size] = -0.0 if signed else 0.0
    return x.float()


@settings(max_examples=30)
@given(
    n=st.one_of(st.sampled_from(SIZES), st.integers(1, 5000)),
    block_size=st.sampled_from(BLOCK_SIZES),
    fmt=st.sampled_from(STATE_FORMATS),
    signed=st.booleans(),
    seed=st.integers(0, 2**24 - 1),
    first_block=st.sampled_from([0, 1, 12345, 2**31 + 7]),
    kind=st.sampled_from(["decades", "spikes", "one_block_range", "denormal", "gaussian"]),
    data_seed=st.integers(0, 2**31 - 1),
    masked=st.booleans(),
)
def test_quantize_equals_the_oracle(n, block_size, fmt, signed, seed, first_block, kind, data_seed, masked):
    x = hostile(n, block_size, signed, data_seed, kind)
    keep = torch.rand(n, generator=torch.Generator().manual_seed(data_seed)) < 0.8 if masked else None
    want = oracle(x, keep, fmt, signed, block_size, seed, first_block)
    got = native(x, keep, fmt, signed, block_size, seed, first_block)
    assert_same_bits(got, want, f"{fmt} signed={signed} n={n} block={block_size} seed={seed} kind={kind}")


@pytest.mark.parametrize("fmt", STATE_FORMATS)
@pytest.mark.parametrize("signed", [True, False])
def test_quantize_at_the_boundaries(fmt, signed):
    """Values next to every place a code's rule changes, to the last bit: the dynamic map's decade edges and the
    1e-5 round-up threshold (torch compares float32 with float32(1e-5)), the power format's code positions 1 and
    8 and the floor's bit patterns 0..5, 1/absmax products that land on .5 exactly."""
    points = [1e-7 * 10**k for k in range(8)] + [1e-5, 1.0 / 127**2, (1.0 / 255) ** 4, (8.0 / 255) ** 4, 0.5, 1.0]
    base = torch.tensor(points, dtype=torch.float32)
    near = torch.cat([torch.nextafter(base, torch.tensor(0.0)), base, torch.nextafter(base, torch.tensor(2.0))])
    tiny = torch.arange(0, 6, dtype=torch.int32).view(torch.float32)  # 0 and the first denormals
    values = torch.cat([near, tiny])
    if signed:
        values = torch.cat([values, -values])
    # block 0: absmax 1 (the points are the normed values themselves); then absmax 3 and 1e-20: other scales
    blocks = [torch.cat([values, torch.ones(1)]), torch.cat([values, torch.full((1,), 3.0)]) * 3.0, values * 1e-20]
    x = torch.cat([torch.nn.functional.pad(b, (0, 256 - b.numel())) for b in blocks])
    for seed in (0, 1, 2, 99, 2**24 - 1):
        assert_same_bits(
            native(x, None, fmt, signed, 256, seed), oracle(x, None, fmt, signed, 256, seed), f"seed {seed}"
        )


@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_decade_from_the_exponent(signed):
    """The codec finds the dynamic map's decade from the float's exponent and one compare: values at and 1-2 ulps
    around every float32 decade edge and every power of two from 2**-40 to 1 (the binade boundaries the exponent
    splits at), normed directly (absmax 1) and through scales that put the edge on the product's last bit."""
    edges = torch.tensor([10.0 ** (i - 7) for i in range(1, 7)], dtype=torch.float32)
    twos = torch.tensor([2.0**-k for k in range(41)], dtype=torch.float32)
    base = torch.cat([edges, twos])
    steps = torch.tensor([-2, -1, 0, 1, 2], dtype=torch.int32)
    near = (base.view(torch.int32)[:, None] + steps[None, :]).reshape(-1).view(torch.float32)
    near = torch.cat([near[(near > 0) & (near <= 1)], torch.tensor([0.0, 1e-45, 1e-40, 1.17549435e-38])])
    if signed:
        near = torch.cat([near, -near[::2]])
    rows = []
    for absmax in (1.0, 3.0, 0.7, 1e-30, 2.5e30):  # the block's absmax, first, scales the rest
        rows.append(torch.cat([torch.tensor([absmax]), (near * absmax).clamp(-absmax, absmax)]))
    assert all(r.numel() <= 512 for r in rows)
    x = torch.cat([torch.nn.functional.pad(r, (0, 512 - r.numel())) for r in rows]).float()
    for seed in (0, 3, 2**24 - 1):
        assert_same_bits(
            native(x, None, "dynamic", signed, 512, seed), oracle(x, None, "dynamic", signed, 512, seed), f"{seed}"
        )


@pytest.mark.parametrize("signed", [True, False])
def test_power_codes_take_torchs_roots(signed):
    """The oracle's roots are torch.sqrt's, which with MKL are not all correctly rounded. Values whose code
    differs between torch's root and the correctly rounded one (searched next to each lane's rounding boundary)
    must get torch's: the codec brackets each root and takes torch's sqrt where the bracket straddles a code."""
    seed, scale = 5, (127.0 if signed else 255.0) * (1 - 2**-16)
    d = state_dither(256, seed, 256).double()
    x = torch.rand(256, generator=torch.Generator().manual_seed(3))
    x[0] = 1.0  # absmax 1: normed is the value itself
    flips = 0
    for lane in range(1, 256):
        k = 2 + lane % 100
        root = (k + 0.5 - d[lane]) / scale  # the root at the boundary between codes k and k + 1
        guess = (root**2 if signed else root**4).float()
        a = (guess.view(torch.int32) + torch.arange(-3000, 3000, dtype=torch.int32)).view(torch.float32)
        a = a[(a > 0) & (a < 1)]
        torch_root = a.sqrt() if signed else a.sqrt().sqrt()
        exact_root = a.double().sqrt().float() if signed else a.double().sqrt().float().double().sqrt().float()
        differ = (torch_root.double() * scale + d[lane]).round() != (exact_root.double() * scale + d[lane]).round()
        if differ.any():
            x[lane] = a[differ.nonzero()[0, 0]]
            flips += 1
    if not flips:
        pytest.skip("torch's sqrt is correctly rounded here: no value tells its roots from the hardware's")
    assert_same_bits(native(x, None, "power", signed, 256, seed), oracle(x, None, "power", signed, 256, seed), "roots")


@settings(max_examples=20)
@given(
    n=st.one_of(st.sampled_from(SIZES), st.integers(1, 5000)),
    block_size=st.sampled_from(BLOCK_SIZES),
    fmt=st.sampled_from(STATE_FORMATS),
    signed=st.booleans(),
    data_seed=st.integers(0, 2**31 - 1),
)
def test_dequantize_equals_the_oracle(n, block_size, fmt, signed, data_seed):
    gen = torch.Generator().manual_seed(data_seed)
    codes = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
    codes[: min(n, 256)] = torch.arange(min(n, 256), dtype=torch.uint8)  # every code where there is room
    nblocks = -(-n // block_size)
    absmax = 10.0 ** (torch.rand(nblocks, generator=gen) * 60.0 - 30.0)
    absmax[torch.rand(nblocks, generator=gen) < 0.2] = 0.0
    absmax[-1] = 1e-40  # a denormal scale
    want = dequantize_state_reference(codes, absmax, fmt, signed, block_size)
    got = _cpu_codec.dequantize(codes, absmax, fmt, signed, block_size)
    assert got.dtype == torch.float32 and got.shape == codes.shape
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_dequantize_keeps_the_codes_shape():
    codes = torch.randint(0, 256, (3, 70), dtype=torch.uint8)
    absmax = torch.rand(1)
    got = _cpu_codec.dequantize(codes, absmax, "dynamic", True, 256)
    assert got.shape == (3, 70)
    assert torch.equal(got, dequantize_state_reference(codes, absmax, "dynamic", True, 256))


def _bad_calls():
    x, codes, absmax = torch.rand(300), torch.zeros(300, dtype=torch.uint8), torch.zeros(2)
    return [
        ((x.double(), None, codes, absmax, "power", True, 256, 1), "x must be torch.float32"),
        ((torch.rand(600)[::2], None, codes, absmax, "power", True, 256, 1), "x must be contiguous"),
        ((x, None, codes, torch.zeros(3), "power", True, 256, 1), "absmax must have 2 elements"),
        ((x, None, codes.long(), absmax, "power", True, 256, 1), "codes must be torch.uint8"),
        ((x, torch.ones(300), codes, absmax, "power", True, 256, 1), "keep must be torch.bool"),
        ((x, None, codes, absmax, "power", True, 100, 1), "block_size must be a positive power of two"),
        ((x, None, codes, absmax, "float8", True, 256, 1), "unknown state format 'float8'"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_bad_input_raises_and_writes_nothing(case):
    args, message = _bad_calls()[case]
    snap = snapshot(list(args[:4]))
    with pytest.raises((RuntimeError, ValueError), match=message):
        _cpu_codec.quantize_(*args)
    assert_untouched(snap)


def test_dequantize_bad_input_raises():
    with pytest.raises(RuntimeError, match="absmax must have 2 elements"):
        _cpu_codec.dequantize(torch.zeros(300, dtype=torch.uint8), torch.zeros(1), "power", True, 256)
    with pytest.raises(RuntimeError, match="codes must be torch.uint8"):
        _cpu_codec.dequantize(torch.zeros(300), torch.zeros(2), "power", True, 256)
    with pytest.raises(ValueError, match="unknown state format"):
        _cpu_codec.dequantize(torch.zeros(300, dtype=torch.uint8), torch.zeros(2), "float8", True, 256)


def test_dequantize_into_out():
    """With ``out`` (reference_step's per-call scratch) the values are written there, the oracle's bits, and a
    wrong ``out`` raises before anything is written."""
    gen = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 256, (3, 100), generator=gen, dtype=torch.uint8)
    absmax = torch.rand(2, generator=gen)
    out = torch.full((300,), 7.0)
    got = _cpu_codec.dequantize(codes, absmax, "dynamic", False, 256, out)
    want = dequantize_state_reference(codes, absmax, "dynamic", False, 256)
    assert got.shape == (3, 100) and got.data_ptr() == out.data_ptr()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    for bad, message in [
        (torch.full((301,), 7.0), "out must have 300 elements"),
        (torch.full((300,), 7.0, dtype=torch.float64), "out must be torch.float32"),
        (torch.full((600,), 7.0)[::2], "out must be contiguous"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            _cpu_codec.dequantize(codes, absmax, "dynamic", False, 256, bad)
        assert bool((bad == 7.0).all())


# ---- whole steps: the native codec and the oracle give the same bits -------------------------------------------

STEP_CASES = [("adamw", {"lr": 1e-2, "weight_decay": 0.1}), ("ademamix", {"lr": 1e-2, "alpha": 5.0})]


def _run(rule, hp, fmt, dtype, native_codec: bool, monkeypatch, in_place: bool, first_blocks=None):
    if not native_codec:
        monkeypatch.setattr(_cpu_codec, "NATIVE", None)  # the switch reference_step reads
    gen = torch.Generator().manual_seed(0)
    shapes = {"w": (33, 130), "b": (257,), "one": (1,), "odd": (4097,), "wide": (2, 2100)}
    params = {k: (0.1 * torch.randn(s, generator=gen)).to(dtype) for k, s in shapes.items()}
    spec = bnbf.OptimSpec(rule=rule, state_bits=8, state_format=fmt, block_size=128, min_8bit_size=0)
    state = bnbf.init_state(params, spec, hp)
    token = FIRST_BLOCKS.set({params["w"].data_ptr(): 5} if first_blocks else None)
    try:
        for step in range(1, 5):
            grads = {
                k: (0.01 * torch.randn(s, generator=gen) * 10.0 ** (4 * (step % 2))).to(dtype)
                for k, s in shapes.items()
            }
            grads["w"][1, 7] = float("inf")  # zeroes that element's states
            grads["odd"][100:356] = 0.0  # a whole zero block
            if in_place:
                bnbf.update_(params, grads, state, hp, step)
            else:
                params, state = bnbf.update(params, grads, state, hp, step)
    finally:
        FIRST_BLOCKS.reset(token)
        monkeypatch.undo()
    return params, state


@pytest.mark.skipif(kernel_runs("cpu"), reason="CPU tensors run the Triton interpreter: the codec is not used")
@pytest.mark.parametrize("rule,hp", STEP_CASES, ids=[r for r, _ in STEP_CASES])
@pytest.mark.parametrize("fmt", STATE_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("in_place", [True, False], ids=["update_", "update"])
def test_step_is_bitwise_the_same_without_the_codec(rule, hp, fmt, dtype, in_place, monkeypatch):
    got = _run(rule, hp, fmt, dtype, True, monkeypatch, in_place)
    want = _run(rule, hp, fmt, dtype, False, monkeypatch, in_place)
    for name in got[0]:
        assert torch.equal(got[0][name], want[0][name]), f"param {name} differs"
        for field, a, b in zip(type(got[1][name])._fields, got[1][name], want[1][name]):
            assert torch.equal(a, b), f"state {name}.{field} differs"


@pytest.mark.skipif(kernel_runs("cpu"), reason="CPU tensors run the Triton interpreter: the codec is not used")
def test_step_of_a_shard_draws_its_blocks_dither(monkeypatch):
    """A shard's first global block (bnbf.distributed sets FIRST_BLOCKS) moves the dither in both codecs alike,
    and does move it."""
    got = _run("adamw", STEP_CASES[0][1], "power", torch.float32, True, monkeypatch, True, first_blocks=True)
    want = _run("adamw", STEP_CASES[0][1], "power", torch.float32, False, monkeypatch, True, first_blocks=True)
    plain = _run("adamw", STEP_CASES[0][1], "power", torch.float32, True, monkeypatch, True)
    assert all(torch.equal(a, b) for a, b in zip(got[1]["w"], want[1]["w"]))
    assert not torch.equal(got[1]["w"].exp_avg, plain[1]["w"].exp_avg)


def test_the_compiled_checks_raise_too():
    """The C++ module's own checks (a backstop behind the wrapper's) raise, and leave the process alive."""
    x, codes = torch.rand(300), torch.zeros(300, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="absmax has the wrong number of elements"):
        _cpu_codec.NATIVE.quantize_(x, None, codes, torch.zeros(3), True, True, 256, 1, 0)
    with pytest.raises(RuntimeError, match="block_size must be a positive power of two"):
        _cpu_codec.NATIVE.dequantize(codes, torch.zeros(2), _cpu_codec.table("power", True), 100)

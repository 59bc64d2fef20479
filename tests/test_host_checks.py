"""The per-step host checks of ``update_`` (bnbf/_host_checks.py): the compiled module and its pure-Python
twins give the same answers, on every kind of input that must send a call down the slow path."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bnbf import _host_checks as hc

# On CI and on the GPU machine the compiled module must build (a silent fallback would hide a slower step)
REQUIRE_NATIVE = bool(os.environ.get("CI")) or os.environ.get("BNBF_REQUIRE_NATIVE") == "1"


def test_native_module_builds_where_required():
    status = hc.status()
    if REQUIRE_NATIVE:
        assert status.startswith("native"), status
    elif not status.startswith("native"):
        pytest.skip(status)


def impls():
    out = [pytest.param(hc.PYTHON, id="python")]
    native = hc.impl()
    if native is not hc.PYTHON:
        out.append(pytest.param(native, id="native"))
    return out


class Sub(torch.Tensor):
    pass


SHAPES = [(3, 4), (1,), (257,), (2, 0), (5, 1, 2)]


def base_lists():
    params = [torch.randn(s) for s in SHAPES]
    grads = [torch.randn(s) for s in SHAPES]
    return params, grads


def mutations():
    """(name, grads -> grads, expected answer) for a grads list matching base_lists' params."""
    return [
        ("same", lambda g: g, True),
        ("tuple", lambda g: tuple(g), True),
        ("parameter grad", lambda g: [torch.nn.Parameter(g[0]), *g[1:]], True),
        ("transposed shape", lambda g: [torch.randn(4, 3), *g[1:]], False),
        ("extra dim", lambda g: [g[0], torch.randn(1, 1), *g[2:]], False),
        ("dtype", lambda g: [g[0].double(), *g[1:]], False),
        ("bf16", lambda g: [*g[:2], g[2].bfloat16(), *g[3:]], False),
        ("device", lambda g: [torch.empty(3, 4, device="meta"), *g[1:]], False),
        ("non-contiguous", lambda g: [torch.randn(4, 3).t(), *g[1:]], False),
        ("sparse", lambda g: [torch.randn(3, 4).to_sparse(), *g[1:]], False),
        ("not a tensor", lambda g: [g[0], None, *g[2:]], False),
        ("a number", lambda g: [*g[:-1], 1.0], False),
        ("subclass", lambda g: [g[0].as_subclass(Sub), *g[1:]], False),
        ("one short", lambda g: g[:-1], False),
        ("one more", lambda g: [*g, torch.randn(1)], False),
        ("not a list", lambda g: iter(g), False),
    ]


@pytest.mark.parametrize("host", impls())
@pytest.mark.parametrize("name,mutate,expected", mutations(), ids=[m[0] for m in mutations()])
def test_grads_match(host, name, mutate, expected):
    params, grads = base_lists()
    assert host.grads_match(params, mutate(grads)) is expected
    assert hc.py_grads_matcher(params)(mutate(grads)) is expected  # the fallback's cached form


@pytest.mark.parametrize("host", impls())
def test_ptrs_equal(host):
    ts = [torch.randn(s) for s in SHAPES]
    ptrs = tuple(t.data_ptr() for t in ts)
    assert host.ptrs_equal(ts, ptrs) is True
    assert host.ptrs_equal(tuple(ts), ptrs) is True
    assert host.ptrs_equal([ts[0].as_subclass(Sub), *ts[1:]], ptrs) is True  # same storage
    assert host.ptrs_equal([ts[0].clone(), *ts[1:]], ptrs) is False
    assert host.ptrs_equal(ts[:-1], ptrs) is False
    assert host.ptrs_equal(ts, list(ptrs)) is False
    assert host.ptrs_equal([None, *ts[1:]], ptrs) is False
    assert host.ptrs_equal(ts, (*ptrs[:-1], "x")) is False
    assert host.ptrs_equal(ts, (*ptrs[:-1], -1)) is False
    assert host.ptrs_equal([], ()) is True


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple), min_size=1, max_size=6),
    change=st.tuples(st.integers(0, 5), st.sampled_from(["none", "shape", "dtype", "stride", "none-leaf"])),
)
def test_native_and_python_agree(shapes, change):
    native = hc.impl()
    if native is hc.PYTHON:
        pytest.skip(hc.status())
    params = [torch.zeros(s) for s in shapes]
    grads = [torch.zeros(s) for s in shapes]
    i, kind = change[0] % len(shapes), change[1]
    if kind == "shape":
        grads[i] = torch.zeros((*shapes[i], 1))
    elif kind == "dtype":
        grads[i] = grads[i].half()
    elif kind == "stride" and len(shapes[i]) >= 2:
        grads[i] = torch.zeros(tuple(reversed(shapes[i]))).transpose(0, -1)
    elif kind == "none-leaf":
        grads[i] = None
    assert native.grads_match(params, grads) == hc.PYTHON.grads_match(params, grads)


def test_failed_build_falls_back_to_python(monkeypatch, tmp_path):
    monkeypatch.setenv("BNBF_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(hc, "_compiler", lambda: "/bin/false")
    monkeypatch.setattr(hc, "_IMPL", None)
    assert hc.impl() is hc.PYTHON
    assert hc.status().startswith("python (native build or load failed"), hc.status()
    assert not list(tmp_path.glob("host_checks_*"))  # nothing half-written left in the cache


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("BNBF_NATIVE", "0")
    monkeypatch.setattr(hc, "_IMPL", None)
    assert hc.impl() is hc.PYTHON
    assert hc.status() == "python (BNBF_NATIVE=0)"


@pytest.mark.parametrize("host", impls())
def test_grads_of(host):
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    for p in params[:-1]:
        p.grad = torch.randn_like(p)
    grads, every = host.grads_of(params)
    assert every is False and grads[-1] is None
    assert all(g is p.grad for g, p in zip(grads[:-1], params[:-1]))  # the grad objects themselves
    params[-1].grad = torch.randn_like(params[-1])
    grads, every = host.grads_of(tuple(params))
    assert every is True and all(g is p.grad for g, p in zip(grads, params))
    sub = params[0].detach().as_subclass(Sub).requires_grad_()
    sub.grad = torch.ones_like(sub)
    grads, every = host.grads_of([sub, *params[1:]])  # a subclass: read through Python
    assert every is True and torch.equal(grads[0], torch.ones_like(sub))
    assert host.grads_of([]) == ([], True)
    with pytest.raises(TypeError):
        host.grads_of(iter(params))


@pytest.mark.parametrize("host", impls())
def test_set_each(host):
    class Mapping(dict):
        pass

    objs = [{"step": 1}, Mapping(step=1), {}]
    host.set_each(objs, "step", 7)
    assert [o["step"] for o in objs] == [7, 7, 7]
    with pytest.raises(TypeError):
        host.set_each([{}, 3], "step", 1)  # an int takes no items: the error propagates
    with pytest.raises(TypeError):
        host.set_each(iter(objs), "step", 1)


def test_grads_of_under_a_torch_function_mode_reads_through_python():
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        seen = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func == torch.Tensor.grad.__get__:  # an attribute read: the grad getter
                Count.seen += 1
            return func(*args, **(kwargs or {}))

    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(4)]
    for p in params:
        p.grad = torch.zeros(3)
    with Count():
        grads, every = hc.grads_of(params)
    assert every and Count.seen == len(params), Count.seen

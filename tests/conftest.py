"""Shared fixtures: devices, which path runs (reference or Triton), seeds, hypothesis profiles, snapshots.

The suite runs in two modes on CPU: plain (CPU tensors take the pure-torch reference) and with
``TRITON_INTERPRET=1`` (CPU tensors run the Triton kernels in the interpreter). On a machine with CUDA the
same tests also run on ``cuda`` (Triton kernels compiled). Large shapes are ``@pytest.mark.slow`` and run
only where CUDA is available.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from hypothesis import HealthCheck, settings
from tolerances import assert_equal_report
from torch.utils._pytree import tree_leaves

HAS_CUDA = torch.cuda.is_available()
# BNBF_TEST_DEVICES=cuda lets the GPU run skip the CPU duplicates that CI already runs
DEVICES = (
    os.environ.get("BNBF_TEST_DEVICES", "").split(",")
    if os.environ.get("BNBF_TEST_DEVICES")
    else (["cpu"] + (["cuda"] if HAS_CUDA else []))
)

# deterministic by default so CI failures reproduce; HYPOTHESIS_PROFILE=dev explores more and at random
settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,  # nothing written under the repository
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    print_blob=True,
)
settings.register_profile(
    "dev",
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    print_blob=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def triton_mode() -> bool:
    """True when ``TRITON_INTERPRET=1``: CPU tensors then run the Triton kernels in the interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _patch_lang_once_per_launch() -> bool:
    """Triton's interpreter (3.x) calls ``_patch_lang`` at every call of a ``@triton.jit`` helper inside a
    kernel: it walks triton.language, its tensor class and tl.math with ``inspect.getmembers`` to re-patch
    builtins that the launch already patched (a patched builtin is a lambda, not a builtin, so the walk
    changes nothing; its scope is never restored). The step kernel calls such helpers hundreds of times per
    launch, and the walks were over half of the interpreter pass. Here a helper whose triton.language
    modules the launch in flight has patched skips the walk; the launch's own patch, helpers that see other
    modules, and everything the interpreter computes are as before. Returns False (and changes nothing)
    where the interpreter lacks the functions this relies on. BNBF_TEST_PLAIN_INTERPRETER=1 turns it off;
    tests/test_interpreter_shortcut.py checks the same bits come out with and without it."""
    try:
        import triton.language as tl
        import triton.runtime.interpreter as interp
    except ImportError:
        return False
    if getattr(interp, "_bnbf_patch_once", False):
        return True
    if not all(hasattr(interp, n) for n in ("_patch_lang", "_LangPatchScope", "GridExecutor")):
        return False
    import threading

    original_patch, original_call = interp._patch_lang, interp.GridExecutor.__call__
    local = threading.local()  # per thread: the modules the launch in flight has patched
    seen: dict = {}  # function -> (its globals' size, the triton.language modules among them)

    def langs_of(fn) -> frozenset:
        known = seen.get(fn)
        if known is None or known[0] != len(fn.__globals__):
            mods = fn.__globals__.values()
            known = seen[fn] = (len(fn.__globals__), frozenset(id(v) for v in mods if v is tl or v is tl.core))
        return known[1]

    def patch_lang(fn):
        patched = getattr(local, "launches", None)
        if not patched:  # no launch in flight: as Triton does it
            return original_patch(fn)
        langs = langs_of(fn)
        if langs and langs <= patched[-1]:
            return interp._LangPatchScope()  # nothing to restore
        scope = original_patch(fn)  # the launch's own patch (or a helper that sees another module)
        patched[-1].update(langs)
        return scope

    def launch(self, *args, **kwargs):
        launches = local.__dict__.setdefault("launches", [])
        launches.append(set())
        try:
            return original_call(self, *args, **kwargs)
        finally:
            launches.pop()

    interp._patch_lang = patch_lang
    interp.GridExecutor.__call__ = launch
    interp._bnbf_patch_once = True
    interp._bnbf_originals = (original_patch, original_call)  # for the check in test_interpreter_shortcut
    return True


INTERPRETER_SHORTCUT = (
    triton_mode() and os.environ.get("BNBF_TEST_PLAIN_INTERPRETER", "0") in ("", "0") and _patch_lang_once_per_launch()
)


def kernel_runs(device: str | torch.device) -> bool:
    """Whether tensors on ``device`` take the Triton kernels (else the pure-torch reference)."""
    device = torch.device(device)
    return device.type == "cuda" or (device.type == "cpu" and triton_mode())


def pytest_collection_modifyitems(config, items):
    skip_slow = pytest.mark.skip(reason="large shapes run only where CUDA is available")
    cpu_only = pytest.mark.skip(reason="CPU-only end-to-end run; BNBF_TEST_DEVICES leaves out cpu")
    # what the reference pass and the GPU run check the same way: the interpreter pass keeps to the kernels
    skip_surface = pytest.mark.skip(reason="surface test: run by the reference pass, not again in the interpreter")
    # the device's free memory is shared with the other workers: scripts/gpu_check.sh runs these in its solo pass
    skip_alone = pytest.mark.skip(reason="reads the device's free memory, which parallel workers change")
    for item in items:
        if "cpu" not in DEVICES and item.path.name in ("test_demo.py", "test_notebooks.py"):
            item.add_marker(cpu_only)
        if "slow" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))
        if "surface" in item.keywords and triton_mode():
            item.add_marker(skip_surface)
        if "alone" in item.keywords and int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
            item.add_marker(skip_alone)


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _fresh_manager():
    """GlobalOptimManager is a process-wide singleton: each test starts and ends with it empty, so an override one
    test registers (keyed by a param's id, which a later test's param may reuse) never reaches another."""
    nn = sys.modules.get("bnbf_nn")  # not imported yet: nothing registered
    if nn is not None:
        nn.GlobalOptimManager.get_instance().initialize()
    yield
    nn = sys.modules.get("bnbf_nn")
    if nn is not None:
        nn.GlobalOptimManager.get_instance().initialize()


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    """Single-threaded torch for the whole session, and for the processes tests start (notebook kernels,
    import checks) through OMP_NUM_THREADS. The suite's tensors are small: on a busy 2-core CI machine
    torch's intra-op threads make elementwise ops on a few thousand elements take milliseconds instead of
    microseconds (thread wake-ups), which made the reference path's long runs (test_state_format's 1200
    steps, test_zero_point's 3000, the demo, the notebooks) 2-8x slower than on one thread. What runs is
    the same: only where the work is scheduled changes."""
    before, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    yield
    torch.set_num_threads(before)
    if env is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = env


# ------------------------------------------------------------------------------------------------
# snapshots: "leaves every tensor bitwise untouched"


def _leaves(tree):
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def snapshot(*trees):
    """Clones of every tensor leaf of ``trees`` (meta tensors are kept by reference: they hold no data)."""
    out = []
    for tree in trees:
        for t in _leaves(tree):
            out.append((t, t if t.device.type == "meta" else t.detach().clone()))
    return out


def assert_untouched(snap, what: str = "input") -> None:
    for i, (t, before) in enumerate(snap):
        if t.device.type == "meta":
            continue
        assert t.shape == before.shape, f"{what} leaf {i}: shape changed {tuple(before.shape)} -> {tuple(t.shape)}"
        assert_equal_report(t, before, f"{what} leaf {i} ({t.dtype}, {tuple(t.shape)}) was modified")


def storages(tree) -> set[int]:
    """Data pointers of the storages behind every tensor leaf (to tell new tensors from aliases)."""
    return {t.untyped_storage().data_ptr() for t in _leaves(tree) if t.device.type != "meta" and t.numel()}


def init_params(shape, dtype, device):
    """The benchmarks' conditions (benchmarks/bench_step.py): params ~ N(0, 0.1^2) (grads: :func:`make_grad`,
    N(0, 0.01^2))."""
    return (torch.randn(shape) * 0.1).to(dtype).to(device)


def make_grad(shape, dtype, device):
    return (torch.randn(shape) * 0.01).to(dtype).to(device)


@pytest.fixture
def fresh_dynamo():
    """Dynamo reset and its counters cleared around a test, which fails if the test broke a graph."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch._dynamo.reset()


@pytest.fixture(params=["python", "native"])
def twin(request, monkeypatch):
    """The per-step host checks' twin under test (bnbf.plan's ``NATIVE``): the plain-Python one, or the compiled one
    (bnbf/csrc/host_checks.cpp) where it was built."""
    import importlib

    plan = importlib.import_module("bnbf.plan")  # the module (``bnbf.plan`` is the function that makes a plan)
    if request.param == "python":
        monkeypatch.setattr(plan, "NATIVE", None)
    elif plan.NATIVE is None:
        pytest.skip("the C++ host checks were not built (pip install --no-build-isolation builds them)")
    return request.param

"""Shared fixtures: devices, which path runs (reference or Triton), seeds, hypothesis profiles, snapshots.

The suite runs in two modes on CPU: plain (CPU tensors take the pure-torch reference) and with
``TRITON_INTERPRET=1`` (CPU tensors run the Triton kernels in the interpreter). On a machine with CUDA the
same tests also run on ``cuda`` (Triton kernels compiled). Large shapes are ``@pytest.mark.slow`` and run
only where CUDA is available.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings
from tolerances import assert_equal_report
from torch.utils._pytree import tree_leaves

HAS_CUDA = torch.cuda.is_available()
# BNBF_TEST_DEVICES=cuda lets the GPU run skip the CPU duplicates that CI already runs
DEVICES = os.environ.get("BNBF_TEST_DEVICES", "").split(",") if os.environ.get("BNBF_TEST_DEVICES") else (
    ["cpu"] + (["cuda"] if HAS_CUDA else [])
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


def kernel_runs(device: str | torch.device) -> bool:
    """Whether tensors on ``device`` take the Triton kernels (else the pure-torch reference)."""
    device = torch.device(device)
    return device.type == "cuda" or (device.type == "cpu" and triton_mode())


def pytest_collection_modifyitems(config, items):
    skip_slow = pytest.mark.skip(reason="large shapes run only where CUDA is available")
    cpu_only = pytest.mark.skip(reason="CPU-only end-to-end run; BNBF_TEST_DEVICES leaves out cpu")
    for item in items:
        if "cpu" not in DEVICES and item.path.name in ("test_demo.py", "test_notebooks.py"):
            item.add_marker(cpu_only)
        if "slow" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


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
    """ANCHORS.md's conditions: params ~ N(0, 0.1^2) (grads: :func:`make_grad`, N(0, 0.01^2))."""
    return (torch.randn(shape) * 0.1).to(dtype).to(device)


def make_grad(shape, dtype, device):
    return (torch.randn(shape) * 0.01).to(dtype).to(device)

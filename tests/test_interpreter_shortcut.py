"""conftest's shortcut in Triton's interpreter (``_patch_lang_once_per_launch``) changes no result: the same
steps run with it and with Triton's own interpreter give the same bits, for each kernel bnbf launches
(the step in both 8-bit formats and 32-bit, the norm pass and its sums with LAMB and with max_unorm, the
block-wise quantizer) and each param dtype."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import INTERPRETER_SHORTCUT, init_params, make_grad
from tolerances import assert_equal_report
from torch.utils._pytree import tree_leaves

import bnbf

pytestmark = pytest.mark.skipif(not INTERPRETER_SHORTCUT, reason="the shortcut is on in the interpreter pass only")


@contextlib.contextmanager
def plain_interpreter():
    """Triton's own ``_patch_lang`` and launch for the length of the block."""
    import triton.runtime.interpreter as interp

    shortcut = interp._patch_lang, interp.GridExecutor.__call__
    interp._patch_lang, interp.GridExecutor.__call__ = interp._bnbf_originals
    try:
        yield
    finally:
        interp._patch_lang, interp.GridExecutor.__call__ = shortcut


def _steps(rule: str, bits: int, fmt: str, max_unorm: float) -> list[torch.Tensor]:
    torch.manual_seed(0)
    shapes = {"a": ((1,), torch.float32), "b": ((257,), torch.bfloat16), "c": ((300,), torch.float16)}
    params = {k: init_params(s, dt, "cpu") for k, (s, dt) in shapes.items()}
    spec = bnbf.OptimSpec(rule=rule, state_bits=bits, state_format=fmt, min_8bit_size=0)
    state = bnbf.init_state(params, spec)
    for step in (1, 2):
        grads = {k: make_grad(s, dt, "cpu") for k, (s, dt) in shapes.items()}
        params, state = bnbf.update(params, grads, state, {"lr": 1e-2}, step, max_unorm=max_unorm)
    x = torch.randn(1000)
    return [t for t in tree_leaves((params, state, bnbf.quantize_blockwise(x))) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize(
    ("rule", "bits", "fmt", "max_unorm"),
    [("adamw", 8, "dynamic", 0.1), ("adamw", 32, "power", 0.0), ("lamb", 8, "power", 0.0)],
)
def test_same_bits_as_the_plain_interpreter(rule, bits, fmt, max_unorm):
    fast = _steps(rule, bits, fmt, max_unorm)
    with plain_interpreter():
        plain = _steps(rule, bits, fmt, max_unorm)
    assert len(fast) == len(plain)
    for i, (a, b) in enumerate(zip(fast, plain)):
        assert_equal_report(a, b, f"leaf {i} with the shortcut vs Triton's own interpreter")

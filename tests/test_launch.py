"""The in-place step's direct launch: after a group's first (Triton-dispatched) launch, later steps call
the compiled kernel's launcher themselves. They must give the same bits as Triton's dispatch."""

from __future__ import annotations

import pytest
import torch
from test_no_recompile import compiled_count

import bnbf
import bnbf.functional as F
import bnbf.kernels.direct_launch as direct_launch

pytestmark = pytest.mark.gpu

HPARAMS = [
    {"lr": 1e-2, "weight_decay": 0.0},
    {"lr": 3e-3, "weight_decay": 0.1, "betas": (0.8, 0.95)},
    {"lr": 1e-3, "weight_decay": 0.01, "betas": (0.9, 0.99)},
]


def _run(use_direct: bool, rule: str, bits: int, dtype: torch.dtype, max_unorm: float, monkeypatch):
    monkeypatch.setattr(direct_launch, "DIRECT_LAUNCH", use_direct)
    gen = torch.Generator().manual_seed(0)
    shapes = [(1,), (255,), (257,), (4097,), (64, 129)]
    params = {f"p{i}": torch.randn(s, generator=gen).to("cuda", dtype) for i, s in enumerate(shapes)}
    spec = bnbf.OptimSpec(rule=rule, state_bits=bits, min_8bit_size=256)
    state = bnbf.init_state(params, spec, HPARAMS[0])
    for step in range(1, 7):
        grads = {k: (torch.randn(v.shape, generator=gen) * 0.1).to("cuda", dtype) for k, v in params.items()}
        bnbf.update_(params, grads, state, HPARAMS[step % 3], step, max_unorm=max_unorm)
    torch.cuda.synchronize()
    plan = next(p for p in F._PLANS.values() if p.params[0] is params["p0"])
    launched_directly = any(group.compiled for _, group in plan.groups)
    return params, state, launched_directly


@pytest.mark.parametrize("rule,max_unorm", [("adamw", 0.0), ("adamw", 0.05), ("lion", 0.0), ("lamb", 0.0)])
@pytest.mark.parametrize("bits", [8, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_direct_launch_matches_triton_dispatch(rule, max_unorm, bits, dtype, monkeypatch):
    p_jit, s_jit, used_jit = _run(False, rule, bits, dtype, max_unorm, monkeypatch)
    compiled = compiled_count()
    p_dir, s_dir, used_direct = _run(True, rule, bits, dtype, max_unorm, monkeypatch)
    assert not used_jit and used_direct, "the direct launch was not taken (or taken with BNBF_LAUNCH=jit)"
    assert compiled_count() == compiled, "the direct path compiled a kernel the dispatched path had not"
    for k in p_jit:
        assert torch.equal(p_jit[k], p_dir[k]), k
        for a, b in zip(s_jit[k], s_dir[k]):
            assert torch.equal(a, b), k

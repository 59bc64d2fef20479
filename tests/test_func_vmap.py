"""``torch.func.vmap`` over ensembles: ``init_state``, ``update`` and ``update_`` of stacked params.

Each member is quantized on its own (its own blocks and absmax), so the results equal a loop over the members
bit for bit, on the reference path and under ``TRITON_INTERPRET=1`` (the Triton kernels). The op's batching
rule hands all members of all tensors to one call of the step (one launch on the Triton path); a whole
``grad_and_value`` + ``update`` step of an ensemble of models (torch.func's model-ensembling recipe) matches the
members trained one by one (to the rounding of the batched forward pass).
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICES, triton_mode
from torch.func import functional_call, grad_and_value, stack_module_state
from torch.utils._pytree import tree_leaves, tree_map

import bnbf
import bnbf.ops

B = 3
SCALES = torch.tensor([1e-3, 1.0, 50.0])  # members of very different magnitudes: one shared absmax would show


def _stack(numels=(1, 257, 300), dtype=torch.float32, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    shapes = {f"t{n}": (n,) if n != 300 else (20, 15) for n in numels}
    scaled = lambda s: (torch.randn(B, *s, generator=gen) * SCALES.view(B, *[1] * len(s))).to(device, dtype)
    p = {k: scaled(s) for k, s in shapes.items()}
    g = {k: scaled(s) for k, s in shapes.items()}
    return p, g


def _member(tree, b):
    return tree_map(lambda t: t[b], tree)


def _same(a, b) -> bool:
    la, lb = tree_leaves(a), tree_leaves(b)
    return len(la) == len(lb) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(la, lb))


@pytest.mark.parametrize("bits", [8, 32])
def test_vmap_init_state_gives_each_member_its_own_state(bits):
    p, _ = _stack()
    spec = bnbf.OptimSpec(rule="adamw", state_bits=bits, min_8bit_size=0)
    s = torch.vmap(lambda q: bnbf.init_state(q, spec))(p)
    for b in range(B):
        assert _same(_member(s, b), bnbf.init_state(_member(p, b), spec))
    for t in tree_leaves(s):  # own memory per member, not one state expanded over the members
        assert t.stride(0) != 0 and t.untyped_storage().nbytes() >= t.numel() * t.element_size()


INTERP = triton_mode()
# the interpreter takes seconds a launch configuration: there one of each state width (the batching rule is the
# same on both paths; the kernels' other rules and dtypes are tested against the reference elsewhere)
_slow_in_interpreter = pytest.mark.skipif(INTERP, reason="covered on the reference path; slow in the interpreter")
CASES = [
    ("adamw", 8, torch.float32),
    ("adamw", 32, torch.float32),
    pytest.param("adamw", 8, torch.bfloat16, marks=_slow_in_interpreter),
    pytest.param("lamb", 8, torch.float32, marks=_slow_in_interpreter),
    pytest.param("sgd", 8, torch.bfloat16, marks=_slow_in_interpreter),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("rule", "bits", "dtype"), CASES)
def test_vmap_update_equals_a_loop_over_members(rule, bits, dtype, device):
    p, g = _stack(dtype=dtype, device=device)
    hp = {"lr": 0.01, "momentum": 0.9} if rule == "sgd" else {"lr": 0.01}
    spec = bnbf.OptimSpec(rule=rule, state_bits=bits, min_8bit_size=0)
    s = torch.vmap(lambda q: bnbf.init_state(q, spec, hp))(p)
    loop = [(_member(p, b), bnbf.init_state(_member(p, b), spec, hp)) for b in range(B)]
    for step in (1,) if INTERP else (1, 2):
        p, s = torch.vmap(lambda q, r, u, t=step: bnbf.update(q, r, u, hp, t))(p, g, s)
        loop = [bnbf.update(q, _member(g, b), u, hp, step) for b, (q, u) in enumerate(loop)]
        for b in range(B):
            assert _same((_member(p, b), _member(s, b)), loop[b])


def test_vmap_update_in_place_and_per_member_lr():
    p, g = _stack()
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=0)
    s = torch.vmap(lambda q: bnbf.init_state(q, spec))(p)
    lrs = torch.tensor([0.1, 0.01, 0.001])
    want = [bnbf.update(_member(p, b), _member(g, b), _member(s, b), {"lr": lrs[b]}, 1) for b in range(B)]
    p_, s_ = tree_map(torch.clone, (p, s))
    torch.vmap(lambda q, r, u, lr: bnbf.update_(q, r, u, {"lr": lr}, 1))(p_, g, s_, lrs)
    for b in range(B):
        assert _same((_member(p_, b), _member(s_, b)), want[b])


@pytest.mark.parametrize("device", DEVICES)
def test_vmap_steps_all_members_in_one_call(monkeypatch, device):
    """The batching rule: one call of the step for all members of all tensors of a group (one launch on the
    Triton path), not a loop over members."""
    calls = []
    run = bnbf.ops._run
    monkeypatch.setattr(bnbf.ops, "_run", lambda p_in, *a: (calls.append(len(p_in)), run(p_in, *a))[1])
    p, g = _stack(numels=(257, 300), device=device)
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=0)
    s = torch.vmap(lambda q: bnbf.init_state(q, spec))(p)
    torch.vmap(lambda q, r, u: bnbf.update(q, r, u, {"lr": 0.01}, 1))(p, g, s)
    assert calls == [2 * B]


class _MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 33)
        self.fc2 = torch.nn.Linear(33, 1)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


@_slow_in_interpreter
def test_vmap_of_a_whole_training_step_over_an_ensemble():
    torch.manual_seed(0)
    models = [_MLP() for _ in range(B)]
    params, _ = stack_module_state(models)
    params = {k: v.detach() for k, v in params.items()}
    base = _MLP().to("meta")
    x, y = torch.randn(8, 6), torch.randn(8, 1)
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=0)
    hp = {"lr": 1e-2, "weight_decay": 0.01}

    def loss_fn(p, x, y):
        return ((functional_call(base, p, (x,)) - y) ** 2).mean()

    def train_step(p, s, x, y, step):
        g, loss = grad_and_value(loss_fn)(p, x, y)
        p, s = bnbf.update(p, g, s, hp, step)
        return p, s, loss

    state = torch.vmap(lambda q: bnbf.init_state(q, spec))(params)
    singles = [(_member(params, b), bnbf.init_state(_member(params, b), spec)) for b in range(B)]
    for step in (1, 2):
        params, state, losses = torch.vmap(train_step, in_dims=(0, 0, None, None, None))(params, state, x, y, step)
        for b, (q, u) in enumerate(singles):
            q, u, loss = train_step(q, u, x, y, step)
            singles[b] = (q, u)
            # the batched forward (a batched matmul) may round otherwise than one member's: close, not equal
            torch.testing.assert_close(losses[b], loss, rtol=1e-5, atol=0)
    for b in range(B):
        torch.testing.assert_close(_member(params, b), singles[b][0], rtol=1e-5, atol=1e-6)

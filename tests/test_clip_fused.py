"""Gradient clipping inside the step (issue 13): ``bnbf.update(..., max_grad_norm=c)`` and ``update_``.

- float32 grads: the same bits as clipping first (``bnbf.clip_grad_norm``, which is torch's
  ``clip_grad_norm_`` bit for bit) and stepping the clipped copies, pure and in place, for AdamW (8-bit and
  32-bit, with ``maximize`` and with ``max_unorm``'s norm pass), Lion, LAMB, LARS (their norm passes) and a
  mixed-rule tree, from non-zero states (where the grads' scale matters to every rule);
- the kernels' coefficient (computed from the total norm on the device, torch's arithmetic op by op) against
  torch's own clipped grads, for float32, float16 and bfloat16 grads;
- 16-bit grads: the step's float32 update against float64 references (torch's clipping and torch.optim.SGD
  in float64; torch's coefficient applied in float64), closer than clipped 16-bit copies;
- ``max_grad_norm`` is a runtime value (no new kernel), bad values raise before anything is written, the grads
  are not modified, and a clipped step of a GPT-2-like tree adds to the unclipped one's launches only
  ``_foreach_norm`` and two small ops (and no host synchronisation on CUDA).
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_untouched, kernel_runs, snapshot
from tolerances import (
    CONTRACTION_ULPS,
    KERNEL_VS_REFERENCE_CODES,
    SAME_MATH,
    STATE32,
    assert_close_report,
    assert_equal_report,
    codes_differ,
    half_ulp,
)
from torch.utils._pytree import tree_leaves

import bnbf
from bnbf import compose
from bnbf._dispatch import interpreting

INTERP = interpreting()
MAX = 0.5  # the grads below have a global norm of about 2-3: clipping is active


def _random_state(state):
    """Non-zero states: random 8-bit codes and scales, or random non-negative float32 values (valid for
    signed and unsigned slots), so that the step depends on the grads' scale for every rule."""
    out = []
    for t in state:
        if t.dtype == torch.uint8:
            out.append(torch.randint(0, 256, t.shape, dtype=torch.uint8).to(t.device))
        else:
            out.append((torch.rand(t.shape) * 0.05 + 0.01).to(t.device))
    return type(state)._make(out)


def _setup(device, specs, hp=None, dtype=torch.float32):
    """Params, grads (~N(0, 0.1^2), norm ~2), non-zero states; ``specs`` names the leaves."""
    shapes = {"w": (9, 31), "b": (257,), "one": (1,), "emb": (20, 13)}
    params = {k: (torch.randn(shapes[k]) * 0.5).to(dtype).to(device) for k in specs}
    grads = {k: (torch.randn(shapes[k]) * 0.1).to(dtype).to(device) for k in specs}
    state = compose.init_state(params, specs, hp)
    return params, grads, {k: _random_state(s) for k, s in state.items()}


def _clones(params, state):
    return {k: p.clone() for k, p in params.items()}, {k: type(s)(*(t.clone() for t in s)) for k, s in state.items()}


def _eq(got, want, what):
    """The same bits on the reference path and under the interpreter. Compiled kernels (CUDA) contract the rule's
    multiply-adds into FMAs as the compiler chooses for each variant, and the clipped step is another variant
    than the unclipped one: there float tensors agree within CONTRACTION_ULPS float32 ulps of their largest
    value and 8-bit codes within KERNEL_VS_REFERENCE_CODES (seen on the H200: 1 ulp)."""
    for i, (a, b) in enumerate(zip(tree_leaves(got), tree_leaves(want), strict=True)):
        if a.device.type != "cuda":
            assert_equal_report(a, b, f"{what} (leaf {i})")
        elif a.dtype == torch.uint8:
            codes_differ(a, b, KERNEL_VS_REFERENCE_CODES, f"{what} (leaf {i})")
        else:
            scale = b.float().abs().max() if b.numel() else torch.tensor(0.0)
            atol = CONTRACTION_ULPS * 2 * float(half_ulp(scale, torch.float32))
            assert_close_report(a.float(), b.float(), atol=atol, rtol=0.0, what=f"{what} (leaf {i})")


_SPEC = lambda rule, bits=8: bnbf.OptimSpec(rule=rule, state_bits=bits, min_8bit_size=256)
# (specs by leaf, hparams, options); the interpreter runs the norm-pass rules on two leaves
CASES = {
    "adamw8": ({k: _SPEC("adamw") for k in ("w", "b", "one")}, {"lr": 1e-2, "weight_decay": 0.1}, {}),
    "adamw32_maximize": ({k: _SPEC("adamw", 32) for k in ("w", "one")}, {"lr": 1e-2}, {"maximize": True}),
    "adamw8_max_unorm": ({k: _SPEC("adamw") for k in ("w", "one")}, {"lr": 1e-2}, {"max_unorm": 0.01}),
    "lion": ({k: _SPEC("lion") for k in ("w", "b", "one")}, {"lr": 1e-3, "weight_decay": 0.1}, {}),
    "lamb": ({k: _SPEC("lamb") for k in ("w", "one")}, {"lr": 1e-2, "weight_decay": 0.01}, {}),
    "lars": ({k: _SPEC("lars") for k in ("w", "one")}, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1}, {}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_max_grad_norm_equals_clipping_first(device, case):
    """float32 grads: the same bits as stepping ``clip_grad_norm``'s clipped copies, pure and in place."""
    specs, hp, opts = CASES[case]
    params, grads, state = _setup(device, specs, hp)
    clipped, total = compose.clip_grad_norm(grads, MAX)
    assert float(total) > 2 * MAX  # clipping is active
    want = bnbf.update(params, clipped, state, hp, 3, **opts)
    snap = snapshot(params, grads, state)
    got = bnbf.update(params, grads, state, hp, 3, max_grad_norm=MAX, **opts)
    assert_untouched(snap)
    _eq(got, want, f"{case}: update(max_grad_norm=) vs update(clip_grad_norm(grads))")
    in_p, in_s = _clones(params, state)
    g_snap = snapshot(grads)
    out = bnbf.update_(in_p, grads, in_s, hp, 3, max_grad_norm=MAX, **opts)
    assert out[0] is in_p and out[1] is in_s
    assert_untouched(g_snap, "grad")  # clipped as they are loaded, not in place
    _eq((in_p, in_s), want, f"{case}: update_(max_grad_norm=) vs update(clip_grad_norm(grads))")
    # not vacuous: the unclipped step differs (the interpreter leaves this to the reference pass: the same inputs)
    if not (INTERP and case in ("lamb", "lars", "adamw8_max_unorm")):
        plain = bnbf.update(params, grads, state, hp, 3, **opts)
        assert not torch.equal(plain[0]["w"], want[0]["w"]), "clipping did not change the step"


def test_mixed_tree_equals_clipping_first(device):
    """AdamW on matrices, Lion on embeddings, no decay on 1-d leaves, in one call (one launch per rule and
    layout on the Triton path, each tensor with its own scalars), pure and in place."""
    specs = {"w": _SPEC("adamw"), "b": _SPEC("adamw", 32), "one": _SPEC("adamw"), "emb": _SPEC("lion")}
    hp = lambda path, p: {"lr": 1e-3} if path == "emb" else {"lr": 1e-2, "weight_decay": 0.1 * (p.ndim > 1)}
    params, grads, state = _setup(device, specs)
    clipped, _ = compose.clip_grad_norm(grads, MAX)
    want = bnbf.update(params, clipped, state, hp, 2)
    got = bnbf.update(params, grads, state, hp, 2, max_grad_norm=MAX)
    _eq(got, want, "mixed tree: update(max_grad_norm=)")
    in_p, in_s = _clones(params, state)
    bnbf.update_(in_p, grads, in_s, hp, 2, max_grad_norm=MAX)
    _eq((in_p, in_s), want, "mixed tree: update_(max_grad_norm=)")
    # a 0-d tensor max_grad_norm: the coefficient computed by torch's ops, read by the step
    t_max = torch.tensor(MAX, device=device)
    want_t = bnbf.update(params, compose.clip_grad_norm(grads, t_max)[0], state, hp, 2)
    _eq(bnbf.update(params, grads, state, hp, 2, max_grad_norm=t_max), want_t, "mixed tree, tensor max_grad_norm")


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16))
def test_coefficient_has_torchs_bits(device, dtype):
    """The coefficient itself, read out through a probe leaf (SGD, lr 1, param 0, grad 1: the new param is
    minus the coefficient, exactly), against the probe's grad as torch.nn.utils.clip_grad_norm_ clips it; over
    totals and limits where the dtype's roundings of ``max_norm / (total + 1e-6)`` differ from float32's."""
    spec = bnbf.OptimSpec(rule="sgd", state_bits=32)
    hp = {"lr": 1.0}
    base = torch.randn(300)
    for scale, max_norm in ((1.0, 0.1), (3.7, 1.3), (1e-3, 0.5), (250.0, 7.0)):
        params = {"probe": torch.zeros(1, dtype=dtype, device=device), "rest": torch.zeros(300, dtype=dtype).to(device)}
        grads = {"probe": torch.ones(1, dtype=dtype, device=device), "rest": (base * scale).to(dtype).to(device)}
        state = bnbf.init_state(params, spec)
        new, _ = bnbf.update(params, grads, state, hp, 1, max_grad_norm=max_norm)
        leaves = [torch.nn.Parameter(p.clone()) for p in params.values()]
        for p, g in zip(leaves, grads.values()):
            p.grad = g.clone()
        torch.nn.utils.clip_grad_norm_(leaves, max_norm)
        assert_equal_report(-new["probe"], leaves[0].grad, f"{dtype} scale {scale} max_norm {max_norm}: coefficient")


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
def test_16bit_grads_against_float64(device, dtype):
    """16-bit params and grads, SGD with momentum (32-bit state): the float32 update (``bnbf.updates``) is
    within the dtype's tolerance of torch's clipping and torch.optim.SGD in float64, and within float32
    rounding (SAME_MATH) of torch's coefficient applied in float64: the step multiplies the 16-bit grad by the
    coefficient in float32, where a clipped 16-bit copy rounds the product to the dtype (farther, checked)."""
    lr, hp = 0.1, {"lr": 0.1, "momentum": 0.9}
    params = {"w": (torch.randn(9, 31) * 0.5).to(dtype).to(device), "b": (torch.randn(257) * 0.5).to(dtype).to(device)}
    grads = {k: (torch.randn(p.shape) * 0.2).to(dtype).to(device) for k, p in params.items()}
    state = bnbf.init_state(params, bnbf.OptimSpec(rule="sgd", state_bits=32), hp)
    u, _ = compose.updates(params, grads, state, hp, 1, max_grad_norm=MAX)

    p64 = [torch.nn.Parameter(p.double()) for p in params.values()]
    for p, g in zip(p64, grads.values()):
        p.grad = g.double()
    torch.nn.utils.clip_grad_norm_(p64, MAX)
    torch.optim.SGD(p64, lr=lr, momentum=0.9).step()
    tol = STATE32[(dtype, 32)]
    # torch's coefficient for these grads (its total norm in the dtype, then its documented formula)
    total = torch.nn.utils.get_total_norm(list(grads.values()))
    coef = torch.clamp(MAX / (total + 1e-6), max=1.0).double()
    assert float(coef) < 0.5
    u_copy, _ = compose.updates(params, compose.clip_grad_norm(grads, MAX)[0], state, hp, 1)
    err_fused, err_copy = 0.0, 0.0
    for (k, p), p_new, g in zip(params.items(), p64, grads.values()):
        assert_close_report(u[k], p_new.detach() - p.double(), tol.atol, tol.rtol, f"{k}: vs float64 torch")
        exact = -lr * g.double() * coef
        assert_close_report(u[k].double(), exact, SAME_MATH.atol, SAME_MATH.rtol, f"{k}: vs torch's coefficient")
        err_fused = max(err_fused, float((u[k].double() - exact).abs().max()))
        err_copy = max(err_copy, float((u_copy[k].double() - exact).abs().max()))
    assert err_copy > 10 * err_fused, (err_copy, err_fused)
    # the params are that update rounded once into the dtype
    new, _ = bnbf.update(params, grads, state, hp, 1, max_grad_norm=MAX)
    _eq(new, compose.apply_updates(params, u), "update vs apply_updates(updates)")


def test_max_grad_norm_is_a_runtime_value(device, monkeypatch):
    """Other limits (numbers, then 0-d tensors) launch the kernel they launched: no compile."""
    if not kernel_runs(device):
        pytest.skip("the reference path compiles nothing; run with TRITON_INTERPRET=1 or on CUDA")
    from test_no_recompile import LaunchRecorder, compiled_count

    import bnbf.kernels.launcher as mt

    params, grads, state = _setup(device, {k: _SPEC("adamw") for k in ("w", "one")})
    hp = {"lr": 1e-2}
    on_cuda = device == "cuda"
    keys = []
    for limits in ((1.0, 0.3, 7.5), tuple(torch.tensor(v, device=device) for v in (0.2, 3.0))):
        if not on_cuda:
            recorder = LaunchRecorder(mt._step_kernel, run=False)
            monkeypatch.setattr(mt, "_step_kernel", recorder)
        bnbf.update(params, grads, state, hp, 2, max_grad_norm=limits[0])
        before = compiled_count() if on_cuda else set(mt.LAUNCH_KEYS)
        first = None if on_cuda else set(recorder.keys)  # two launch groups: 8-bit "w", 32-bit "one"
        for i, c in enumerate(limits[1:]):
            bnbf.update(params, grads, state, hp, 3 + i, max_grad_norm=c)
        if on_cuda:
            torch.cuda.synchronize()
            assert compiled_count() == before, f"another max_grad_norm compiled a kernel ({limits})"
        else:
            assert len(first) == 2 and set(recorder.keys) == first, "launch keys changed with max_grad_norm"
            assert set(mt.LAUNCH_KEYS) == before
            keys.append(first)
            monkeypatch.undo()
    if not on_cuda:  # the control: a number and a tensor limit key different kernels (CLIP 1 and 2)
        assert not keys[0] & keys[1]


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (-1.0, ValueError, "Invalid max_grad_norm value: -1.0"),
        (math.nan, ValueError, "Invalid max_grad_norm value: nan"),
        (math.inf, ValueError, "Invalid max_grad_norm value: inf"),
        (1e39, ValueError, "Invalid max_grad_norm value: 1e\\+39"),
        (torch.tensor(-2.0), ValueError, "Invalid max_grad_norm value: -2.0"),
        (torch.tensor([1.0, 2.0]), ValueError, "Tensor max_grad_norm must be 1-element"),
        (torch.tensor(1), TypeError, "max_grad_norm must be a floating point tensor"),
        ("1.0", TypeError, "max_grad_norm must be a number or a 0-d tensor, got str"),
        (True, TypeError, "max_grad_norm must be a number or a 0-d tensor, got bool"),
    ],
)
def test_bad_max_grad_norm_raises_before_writing(device, bad, error, match):
    params, grads, state = _setup(device, {k: _SPEC("adamw") for k in ("w", "one")})
    snap = snapshot(params, grads, state)
    for fn in (bnbf.update, bnbf.update_, compose.updates):
        with pytest.raises(error, match=match):
            fn(params, grads, state, {"lr": 1e-2}, 2, max_grad_norm=bad)
    assert_untouched(snap)


def test_bad_grad_with_clipping_raises_before_writing(device):
    """The norm is taken before the core checks the grads; a wrong grad still raises the core's error with
    nothing written."""
    params, grads, state = _setup(device, {k: _SPEC("adamw") for k in ("w", "one")})
    grads["w"] = grads["w"].t()  # another shape
    snap = snapshot(params, grads, state)
    for fn in (bnbf.update, bnbf.update_):
        with pytest.raises(ValueError, match="shape"):
            fn(params, grads, state, {"lr": 1e-2}, 2, max_grad_norm=MAX)
    assert_untouched(snap)


def _gpt2_like(device):
    """GPT-2's 148 leaves (embeddings, 12 blocks of norms, attention and MLP, final norm), tiny."""
    d, shapes = 8, [("wte.weight", (64, 8)), ("wpe.weight", (16, 8))]
    for i in range(12):
        h = f"h.{i}."
        for name, shape in (("ln_1", (d,)), ("attn.c_attn", (d, 3 * d)), ("attn.c_proj", (d, d)), ("ln_2", (d,))):
            shapes += [(h + name + ".weight", shape), (h + name + ".bias", (shape[-1],))]
        for name, shape in (("mlp.c_fc", (d, 4 * d)), ("mlp.c_proj", (4 * d, d))):
            shapes += [(h + name + ".weight", shape), (h + name + ".bias", (shape[-1],))]
    shapes += [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
    params = {k: torch.randn(s, device=device) for k, s in shapes}
    return params, {k: torch.randn_like(p) for k, p in params.items()}


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """The aten ops a call runs that could launch a kernel (views and metadata queries excluded)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not (torch.Tag.view_copy in func.tags or func.is_view or func.overloadpacket.__name__ in _META):
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


_META = {"detach", "alias", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_contiguous"}


@pytest.mark.parametrize("tree", ("adamw", "mixed"))
def test_clipped_step_adds_only_the_norm_ops(device, tree, monkeypatch):
    """A clipped in-place step of a GPT-2-like tree (148 leaves; AdamW, or AdamW on matrices with Lion on the
    embeddings and no decay on 1-d leaves): the unclipped step's launch groups, plus one ``_foreach_norm``
    (one device and dtype) and two small ops (the stack of the norms and their norm); the coefficient is
    computed by the step kernel. The launches are counted, not run."""
    if not kernel_runs(device):
        pytest.skip("launch groups exist on the Triton path (TRITON_INTERPRET=1 or CUDA)")
    import sys

    from bnbf.kernels import launcher

    params, grads = _gpt2_like(device)
    if tree == "adamw":
        state, hp = bnbf.init_state(params, bnbf.OptimSpec(rule="adamw", min_8bit_size=64)), {"lr": 1e-3}
    else:
        emb = lambda path: path.startswith(("wte", "wpe"))
        spec = lambda path, p: bnbf.OptimSpec(rule="lion" if emb(path) else "adamw", min_8bit_size=64)
        state = compose.init_state(params, spec)
        hp = lambda path, p: {"lr": 1e-4} if emb(path) else {"lr": 1e-3, "weight_decay": 0.1 * (p.ndim > 1)}
    launched = []
    for mod in (launcher, sys.modules["bnbf.plan"]):
        monkeypatch.setattr(mod, "launch_group", lambda group, *a, **k: launched.append(group.table.shape[0]))
    counts = {}
    for max_grad_norm in (None, 1.0):
        bnbf.update_(params, grads, state, hp, 1, max_grad_norm=max_grad_norm)  # warm: plans built, tables uploaded
        launched.clear()
        with _Ops() as seen:
            bnbf.update_(params, grads, state, hp, 2, max_grad_norm=max_grad_norm)
        counts[max_grad_norm] = (list(launched), seen.ops)
    (plain_launches, plain_ops), (clip_launches, clip_ops) = counts[None], counts[1.0]
    assert clip_launches == plain_launches and len(plain_launches) == (2 if tree == "adamw" else 3)
    extra = list(clip_ops)
    for op in plain_ops:
        extra.remove(op)
    assert sorted(extra) == ["_foreach_norm", "linalg_vector_norm", "stack"], extra


@pytest.mark.gpu
def test_clipped_step_does_not_synchronise():
    params = {"w": torch.randn(4096, device="cuda"), "b": torch.randn(7, device="cuda")}
    grads = {k: torch.randn_like(p) for k, p in params.items()}
    state = bnbf.init_state(params, bnbf.OptimSpec(rule="lamb"))
    hp = {"lr": 1e-3}
    for limit in (1.0, torch.tensor(0.5, device="cuda")):
        bnbf.update_(params, grads, state, hp, 1, max_grad_norm=limit)  # warm: first builds may synchronise
        bnbf.update(params, grads, state, hp, 1, max_grad_norm=limit)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            bnbf.update_(params, grads, state, hp, 2, max_grad_norm=limit)
            bnbf.update(params, grads, state, hp, 2, max_grad_norm=limit)
        finally:
            torch.cuda.set_sync_debug_mode("default")

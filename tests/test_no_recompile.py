"""Changing lr, betas, eps, weight decay or the step between calls must not compile a new kernel.

On CUDA: count the compiled kernels in the Triton JIT caches of every kernel in ``bnbf.kernels``.
On CPU with ``TRITON_INTERPRET=1`` nothing is compiled, so record what would key a compile instead: the
constexpr arguments of every launch of the step kernel, the specialization Triton would derive from the
other arguments (dtype and 16-byte alignment of tensors; value 1 and divisibility by 16 of integers), and
``bnbf.kernels.multi_tensor.LAUNCH_KEYS``. Each test also checks that a change that *must* compile (another
param dtype) shows up, so the counter is known to work.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil

import pytest
import torch
from conftest import DEVICES, kernel_runs
from optim_table import RULE_IDS, RULES

import bnbf

VARIATIONS = [
    {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
    {"lr": 3e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
    {"lr": 3e-4, "betas": (0.8, 0.99), "eps": 1e-8, "weight_decay": 0.0},
    {"lr": 3e-4, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.0},
    {"lr": 3e-4, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1},
    {"lr": 1.0, "betas": (0.0, 0.0), "eps": 0.0, "weight_decay": 1.0},  # values Triton could specialize on
    {"lr": 2.0, "betas": (0.5, 0.5), "eps": 16.0, "weight_decay": 16.0},
]
STEPS = [2, 16, 17, 1000, 3, 1, 2**20]  # one per variation


def _kernel_modules():
    import bnbf.kernels as pkg

    mods = [pkg]
    for info in pkgutil.iter_modules(pkg.__path__):
        mods.append(importlib.import_module(f"{pkg.__name__}.{info.name}"))
    return mods


def jit_functions():
    from triton.runtime.jit import JITFunction

    found = {}
    for mod in _kernel_modules():
        for name, obj in vars(mod).items():
            if isinstance(obj, JITFunction):
                found[f"{mod.__name__}.{name}"] = obj
    return found


def compiled_count() -> int:
    total = 0
    for fn in jit_functions().values():
        for cache in fn.device_caches.values():
            total += len(cache[0])
    return total


def clear_compiled() -> None:
    """Empty the in-memory kernel caches of bnbf's JIT functions (the next launch compiles or loads from
    Triton's disk cache, and counts as a compile)."""
    for fn in jit_functions().values():
        for cache in fn.device_caches.values():
            cache[0].clear()


class LaunchRecorder:
    """Stands in for a Triton kernel object: records each launch's compile-relevant key, then launches."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.keys: list[tuple] = []

    @staticmethod
    def _spec(v):
        if isinstance(v, torch.Tensor):
            return ("tensor", v.dtype, v.data_ptr() % 16 == 0)
        if isinstance(v, bool):
            return ("bool", v)
        if isinstance(v, int):
            return ("int", v == 1, v % 16 == 0, -(2**31) <= v < 2**31)
        if isinstance(v, float):
            return ("float",)
        return ("other", repr(v))

    @staticmethod
    def _const(v):
        return getattr(v, "__name__", None) or repr(v)

    def __getitem__(self, grid):
        launcher = self.kernel[grid]

        def run(*args, **kwargs):
            self.keys.append(
                (tuple(self._spec(a) for a in args), tuple(sorted((k, self._const(v)) for k, v in kwargs.items())))
            )
            return launcher(*args, **kwargs)

        return run


def _step_all(params, grads, state, hp, step):
    return bnbf.update(params, grads, state, hp, step)


def _params(device, dtype):
    return {"w": torch.randn(64, 33, device=device, dtype=dtype), "b": torch.randn(33, device=device, dtype=dtype)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", RULES, ids=RULE_IDS)
@pytest.mark.parametrize("bits", [8, 32])
@pytest.mark.parametrize("as_tensors", [False, True], ids=["floats", "tensors"])
def test_hparams_and_step_do_not_recompile(device, case, bits, as_tensors, monkeypatch):
    if not kernel_runs(device):
        pytest.skip("CPU tensors take the pure-torch reference here (no kernel to compile); "
                    "run with TRITON_INTERPRET=1 or on CUDA")
    spec = bnbf.OptimSpec(rule=case.name, state_bits=bits, min_8bit_size=1)
    params = _params(device, torch.float32)
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    state = bnbf.init_state(params, spec)

    def hp_of(v):
        if not as_tensors:
            return v
        t = lambda x: torch.tensor(float(x), device=device)
        return {"lr": t(v["lr"]), "betas": (t(v["betas"][0]), t(v["betas"][1])), "eps": t(v["eps"]),
                "weight_decay": t(v["weight_decay"])}

    def step_of(s):
        return torch.tensor(s, device=device) if as_tensors else s

    on_cuda = device == "cuda"
    if not on_cuda:
        import bnbf.kernels.multi_tensor as mt

        recorder = LaunchRecorder(mt._step_kernel)
        monkeypatch.setattr(mt, "_step_kernel", recorder)

    # warm up: the first call compiles
    params, state = _step_all(params, grads, state, hp_of(VARIATIONS[0]), step_of(1))
    if on_cuda:
        torch.cuda.synchronize()
        before = compiled_count()
        assert before > 0, "no compiled kernel found in bnbf.kernels' JIT caches"
    else:
        import bnbf.kernels.multi_tensor as mt

        keys_before = set(mt.LAUNCH_KEYS)
        assert recorder.keys, "the step kernel was not launched"
        first = recorder.keys[0]

    for v, s in zip(VARIATIONS, STEPS):
        params, state = _step_all(params, grads, state, hp_of(v), step_of(s))
    if on_cuda:
        torch.cuda.synchronize()
        assert compiled_count() == before, "changing hyperparameters or the step compiled a new kernel"
    else:
        assert all(k == first for k in recorder.keys), (
            "launch keys changed with hyperparameters/step: "
            + repr({k for k in recorder.keys if k != first})
        )
        assert set(mt.LAUNCH_KEYS) == keys_before, "LAUNCH_KEYS grew with hyperparameters/step"

    # positive control: another param dtype (and a block size no other test uses) must compile (or key)
    # a new kernel, so the counter above can see compilations at all
    p16 = _params(device, torch.bfloat16)
    g16 = {k: torch.randn_like(v) for k, v in p16.items()}
    control_spec = dataclasses.replace(spec, block_size=1024) if spec.state_bits == 8 else spec
    if on_cuda:  # in a long test session that kernel may be compiled already: start from empty caches
        clear_compiled()
    before_control = compiled_count() if on_cuda else None
    _step_all(p16, g16, bnbf.init_state(p16, control_spec), hp_of(VARIATIONS[0]), step_of(1))
    if on_cuda:
        torch.cuda.synchronize()
        assert compiled_count() > before_control, "the compile counter did not see a new kernel"
    else:
        assert recorder.keys[-1] != first, "the launch recorder did not see a bf16 launch"

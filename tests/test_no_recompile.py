"""Changing hyperparameters or the step between calls must not compile a new kernel: for every row of
``optim_table.ROWS``, its ``changes`` one after the other (floats, or 0-d tensors), with and without
max_unorm where the row can clip, 8-bit and 32-bit state.

On CUDA: count the compiled kernels in the Triton JIT caches of every kernel in ``bnbf.kernels``.
On CPU with ``TRITON_INTERPRET=1`` nothing is compiled, so record what would key a compile instead: the
constexpr arguments of every launch of the step kernel and of the norm pass's sums kernel, the
specialization Triton would derive from the other arguments (dtype and 16-byte alignment of tensors; value
1 and divisibility by 16 of integers), and ``bnbf.kernels.launcher.LAUNCH_KEYS``; there the recorded
kernels are not run (the interpreter would take seconds a test, and the launch's arguments are what would
key a compile). Each test also checks that a change that *must* compile (another param dtype) shows up, so
the counter is known to work.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil

import pytest
import torch
from conftest import DEVICES, kernel_runs
from optim_table import ROW_IDS, ROWS

import bnbf
import bnbf.kernels.members as members

STEPS = [2, 16, 17, 1000, 3, 1, 2**20, 4]  # the step of each of a row's changes (after a first at step 1)


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
    # and the groups the pure step reuses by address, and the structures its groups are made from: a hit, or a
    # group of a kept structure, launches the compiled kernel directly
    bnbf.ops._GROUPS.clear()
    for cache in (members._GROUPS, members._STRUCTURES, members._PROBES):
        cache.clear()


class LaunchRecorder:
    """Stands in for a Triton kernel object: records each launch's compile-relevant key, then launches (or,
    with ``run=False``, does not)."""

    def __init__(self, kernel, run: bool = True):
        self.kernel = kernel
        self.run = run
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
            return launcher(*args, **kwargs) if self.run else None

        return run


def _params(device, dtype):
    return {"w": torch.randn(5, 51, device=device, dtype=dtype), "b": torch.randn(1, device=device, dtype=dtype)}


def tensor_hparams(hp: dict, device) -> dict:
    """``hp`` with every float (and each beta) as a 0-d float32 tensor on ``device``."""
    t = lambda v: torch.tensor(v, dtype=torch.float32, device=device) if type(v) is float else v
    return {k: tuple(map(t, v)) if isinstance(v, tuple) else t(v) for k, v in hp.items()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("row", ROWS, ids=ROW_IDS)
@pytest.mark.parametrize("bits", [8, 32])
@pytest.mark.parametrize("as_tensors", [False, True], ids=["floats", "tensors"])
def test_hparams_and_step_do_not_recompile(device, row, bits, as_tensors, monkeypatch):
    if not kernel_runs(device):
        pytest.skip(
            "CPU tensors take the pure-torch reference here (no kernel to compile); "
            "run with TRITON_INTERPRET=1 or on CUDA"
        )
    import bnbf.kernels.launcher as mt

    # max_unorm (a norm pass) too where the row can clip; a row that refuses it is asserted to in test_rules
    clips = [0.0, 0.5] if row.max_unorm is True else [0.0]
    spec = bnbf.OptimSpec(rule=row.name, state_bits=bits, min_8bit_size=0)
    params = _params(device, torch.float32)
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    state = bnbf.init_state(params, spec, row.hparams)
    hp_of = (lambda v: tensor_hparams(v, device)) if as_tensors else (lambda v: v)
    step_of = (lambda s: torch.tensor(s, device=device)) if as_tensors else (lambda s: s)
    on_cuda = device == "cuda"
    seen = set()  # the first step's launch keys of every clip value: the control must key none of them
    for clip in clips:
        if not on_cuda:
            recorder = LaunchRecorder(mt._step_kernel, run=False)
            sums = LaunchRecorder(mt._tensor_sums_kernel, run=False)
            monkeypatch.setattr(mt, "_step_kernel", recorder)
            monkeypatch.setattr(mt, "_tensor_sums_kernel", sums)
        # warm up: the first call compiles (a second max_unorm value must not compile either)
        params, state = bnbf.update(params, grads, state, hp_of(row.hparams), step_of(1), max_unorm=clip)
        if on_cuda:
            torch.cuda.synchronize()
            before = compiled_count()
            assert before > 0, "no compiled kernel found in bnbf.kernels' JIT caches"
        else:
            keys_before = set(mt.LAUNCH_KEYS)
            assert recorder.keys, "the step kernel was not launched"
            first = set(recorder.keys)  # two launches (norm pass, step) with norms or clipping
            first_sums = set(sums.keys)
            seen |= first
        assert len(row.changes) <= len(STEPS), "give STEPS a step for each change"
        for i, (v, s) in enumerate(zip(row.changes, STEPS)):
            params, state = bnbf.update(params, grads, state, hp_of(v), step_of(s), max_unorm=clip * (1 + i))
        if on_cuda:
            torch.cuda.synchronize()
            assert compiled_count() == before, f"{row.id}: changing hyperparameters or the step compiled a kernel"
        else:
            assert set(recorder.keys) == first, (
                f"{row.id}: launch keys changed with hyperparameters/step: {set(recorder.keys) - first}"
            )
            assert set(sums.keys) == first_sums, f"{row.id}: the sums kernel's launch keys changed"
            assert set(mt.LAUNCH_KEYS) == keys_before, f"{row.id}: LAUNCH_KEYS grew with hyperparameters/step"
            monkeypatch.undo()

    # positive control: another param dtype (and a block size no other test uses) must compile (or key)
    # a new kernel, so the counter above can see compilations at all
    p16 = _params(device, torch.bfloat16)
    g16 = {k: torch.randn_like(v) for k, v in p16.items()}
    control_spec = dataclasses.replace(spec, block_size=1024) if bits == 8 else spec
    if on_cuda:  # in a long test session that kernel may be compiled already: start from empty caches
        clear_compiled()
        before_control = compiled_count()
    else:
        recorder = LaunchRecorder(mt._step_kernel, run=False)
        monkeypatch.setattr(mt, "_step_kernel", recorder)
    bnbf.update(p16, g16, bnbf.init_state(p16, control_spec, row.hparams), hp_of(row.hparams), step_of(1))
    if on_cuda:
        torch.cuda.synchronize()
        assert compiled_count() > before_control, "the compile counter did not see a new kernel"
    else:
        # against every clip's keys, not the last's: the control (no clipping) keys NORM_MODE 0, which a
        # clipping run's keys never have, whatever the dtype
        assert recorder.keys and recorder.keys[-1] not in seen, "the launch recorder did not see a bf16 launch"

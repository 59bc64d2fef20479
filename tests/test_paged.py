"""Paged optimizer state (bnbf.paged): CUDA managed memory, stepped as unpaged state, freed with the state.

The CPU tests check the arguments and that ``paged`` changes nothing on the CPU. The CUDA tests (marked
``gpu``) check, through the CUDA driver itself (cuPointerGetAttribute), that the state of large params is
managed memory, that a paged step equals the unpaged one bit for bit, that prefetching works, and that the
managed memory is freed when the optimizer is dropped.
"""

from __future__ import annotations

import gc

import pytest
import torch
from tolerances import assert_equal_report

import bnbf
import bnbf.paged
import bnbf_nn
from bnbf.paged import PAGED_MIN_NUMEL

BIG = (512, 520)  # 266240 elements: paged (>= PAGED_MIN_NUMEL), 1040 blocks
SMALL = (300,)  # below PAGED_MIN_NUMEL: ordinary device memory even when paged
assert BIG[0] * BIG[1] >= PAGED_MIN_NUMEL > SMALL[0]


def make(shapes, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in shapes]


def grads_for(params, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(p.shape, generator=g) * 0.1).to(p.device) for p in params] for _ in range(steps)]


def run(opt, params, grads):
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()


def state_tensors(opt, p):
    return [t for t in opt.state[p]["state"]]


# ---- CPU ----------------------------------------------------------------------------------------------------


def test_paged_is_a_bool():
    with pytest.raises(TypeError, match="paged must be a bool"):
        bnbf.OptimSpec(rule="adamw", paged="yes")
    with pytest.raises(TypeError, match="is_paged must be a bool"):
        bnbf_nn.AdamW8bit(make([SMALL], "cpu"), is_paged=None)


def test_paged_changes_nothing_on_the_cpu():
    p = torch.randn(BIG)
    a = bnbf.init_state(p, bnbf.OptimSpec(rule="ademamix", min_8bit_size=0, paged=True))
    b = bnbf.init_state(p, bnbf.OptimSpec(rule="ademamix", min_8bit_size=0))
    assert type(a) is type(b)
    for name, x, y in zip(a._fields, a, b):
        assert_equal_report(x, y, name)
    assert bnbf.paged.ranges_of(a) == [] and bnbf.paged.prefetch([]) is False
    with pytest.raises(ValueError, match="CUDA memory"):
        bnbf.paged.allocate([((4,), torch.uint8)], torch.device("cpu"))


def test_relaid_stacks_rows_aligned_with_the_same_values():
    p = torch.randn(257)
    s = bnbf.init_state(p, bnbf.OptimSpec(rule="ademamix", min_8bit_size=0))
    bnbf.update_([p], [torch.randn(257)], [s], {"lr": 1e-2}, 1)
    r = bnbf.state.relaid(s, ((0, 1), (2,)))
    assert type(r) is type(s)
    for name, a, b in zip(s._fields, r, s):
        assert_equal_report(a, b, f"relaid {name}")
    assert r.exp_avg.untyped_storage().data_ptr() == r.exp_avg_slow.untyped_storage().data_ptr()
    assert (r.exp_avg_slow.data_ptr() - r.exp_avg.data_ptr()) % 256 == 0  # each row starts aligned
    with pytest.raises(ValueError, match="each of the ademamix state slots once"):
        bnbf.state.relaid(s, ((0, 1),))


# ---- CUDA ---------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["PagedAdamW8bit", "PagedAdEMAMix8bit", "PagedLion32bit", "PagedAdam"])
def test_paged_state_is_managed_memory_and_steps_as_unpaged(name):
    params, twin = make([BIG, SMALL], "cuda"), make([BIG, SMALL], "cuda")
    grads = grads_for(params, 3)
    paged = getattr(bnbf_nn, name)(params)
    plain = getattr(bnbf_nn, name.removeprefix("Paged"))(twin)
    run(paged, params, grads)
    run(plain, twin, grads)
    torch.cuda.synchronize()
    big, small = params
    assert all(bnbf.paged.is_managed(t) for t in state_tensors(paged, big)), "large param: managed state"
    views = [v for k, v in paged.state[big].items() if k.startswith(("state", "absmax")) and k != "state"]
    assert views and all(bnbf.paged.is_managed(v) for v in views), "bitsandbytes' names: views of managed state"
    assert not any(bnbf.paged.is_managed(t) for t in state_tensors(paged, small)), "small param: device memory"
    assert not any(bnbf.paged.is_managed(t) for t in state_tensors(plain, twin[0]))
    for i, (p, q) in enumerate(zip(params, twin)):
        assert_equal_report(p.detach(), q.detach(), f"{name} param {i}")
        for field, a, b in zip(paged.state[p]["state"]._fields, state_tensors(paged, p), state_tensors(plain, q)):
            assert_equal_report(a, b, f"{name} param {i} state {field}")


@pytest.mark.gpu
def test_is_paged_on_any_class_and_through_the_functional_core():
    params = make([BIG], "cuda")
    opt = bnbf_nn.RMSprop8bit(params, 0.01, 0.9, is_paged=True)
    run(opt, params, grads_for(params, 2))
    assert bnbf.paged.is_managed(opt.state[params[0]]["state1"])
    p = torch.randn(BIG, device="cuda")
    spec = bnbf.OptimSpec(rule="lamb", paged=True)
    s = bnbf.init_state(p, spec)
    assert all(bnbf.paged.is_managed(t) for t in s)
    ranges = bnbf.paged.ranges_of(s)
    assert len(ranges) == 1 and ranges[0][1] >= bnbf.state_nbytes(s)  # one allocation holds the whole state
    assert bnbf.paged.prefetch(ranges)  # fits: issued, asynchronously, on the current stream
    ref_p, ref_s = p.clone(), bnbf.init_state(p, bnbf.OptimSpec(rule="lamb"))
    g = torch.randn_like(p)
    bnbf.update_([p], [g], [s], {"lr": 1e-2}, 1)
    bnbf.update_([ref_p], [g], [ref_s], {"lr": 1e-2}, 1)
    assert_equal_report(p, ref_p, "functional paged step")


@pytest.mark.gpu
def test_loading_a_checkpoint_into_a_paged_optimizer_pages_it():
    params, twin = make([BIG], "cuda"), make([BIG], "cuda")
    plain = bnbf_nn.AdamW8bit(params)
    run(plain, params, grads_for(params, 2))
    paged = bnbf_nn.PagedAdamW8bit(twin)
    paged.load_state_dict(plain.state_dict())
    assert all(bnbf.paged.is_managed(t) for t in state_tensors(paged, twin[0]))
    for field, a, b in zip(
        plain.state[params[0]]["state"]._fields, state_tensors(plain, params[0]), state_tensors(paged, twin[0])
    ):
        assert_equal_report(b, a, f"loaded {field}")


@pytest.mark.gpu
def test_managed_memory_returns_after_del_optimizer():
    """Unlike bitsandbytes' paged buffers, paged state is freed when the optimizer is dropped: the module's
    count of live managed bytes and the GPU's free memory both return to their earlier levels."""
    shapes = [(2048, 2048), (1024, 1024)]  # 5M elements: 10 MB of 8-bit state
    params = make(shapes, "cuda")
    grads = grads_for(params, 2)
    warm = make(shapes, "cuda")
    run(bnbf_nn.AdamW8bit(warm), warm, grads[:1])  # the kernels loaded (module memory) before measuring
    del warm
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    live0, free0 = bnbf.paged.live_bytes(), torch.cuda.mem_get_info()[0]
    opt = bnbf_nn.PagedAdamW8bit(params)
    run(opt, params, grads)
    torch.cuda.synchronize()
    held = bnbf.paged.live_bytes() - live0
    assert held >= sum(bnbf.state_nbytes(opt.state[p]["state"]) for p in params)
    del opt
    for p in params:
        p.grad = None  # allocated by the steps, after free0 was measured
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert bnbf.paged.live_bytes() == live0, "managed state outlived its optimizer"
    free1 = torch.cuda.mem_get_info()[0]
    assert free1 >= free0 - (2 << 20), f"GPU free memory {free1} did not return to {free0} after del optimizer"

"""bnbf.distributed's per-object caches (the split of a DTensor param, the local views of its state), the
grad's local tensor, the names its errors give leaves and its pickled plans, in this process: a fake process group
of two ranks, nothing spawned."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

pytestmark = pytest.mark.surface  # host-side caches: the reference pass covers them

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)


@pytest.fixture(scope="module")
def mesh():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def test_by_id_finds_only_the_same_object_and_keeps_nothing_alive():
    from bnbf.distributed import _ById

    cache = _ById()
    a, b = torch.zeros(3), torch.zeros(3)
    cache[a] = "a"
    assert cache.get(a) == "a"
    assert cache.get(b) is None  # equal values, another object
    ref = weakref.ref(a)
    del a
    gc.collect()
    assert ref() is None  # the cache held it weakly
    assert not cache._d  # and its entry went with it


def test_by_id_entry_of_a_reused_id_is_not_dropped_by_the_old_object():
    from bnbf.distributed import _ById

    cache = _ById()
    a = torch.zeros(1)
    cache[a] = 1
    cache[a] = 2  # the old weakref's callback must not remove the new entry
    assert cache.get(a) == 2
    del a
    gc.collect()
    assert not cache._d


def test_local_grad_is_the_local_tensor_and_checks_mesh(mesh):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import bnbf.distributed as bd

    p = distribute_tensor(torch.randn(10, 3), mesh, [Shard(0)])
    g = distribute_tensor(torch.randn(10, 3), mesh, [Shard(0)])
    sh = bd._shards(p)
    assert bd._shards(p) is sh  # cached
    names = bd._names_of([p])  # the leaves' names, for messages
    assert (sh.starts, sh.counts) == ((0, 15), (15, 15))
    local = bd._local_grad(names, 0, p, g, sh)
    # the fake process group leaves the shards' memory unset (NaNs, which torch.equal calls unequal): compare storage
    assert local is g._local_tensor and local.data_ptr() == g.to_local().data_ptr()
    with pytest.raises(TypeError, match=r"grad\[0\]: .* DTensor param needs a DTensor grad"):
        bd._local_grad(names, 0, p, g.to_local(), sh)
    rep = distribute_tensor(torch.randn(10, 3), mesh, [Replicate()])
    assert bd._local_grad(names, 0, p, rep, sh).shape == (5, 3)  # redistributed to the param's placements


def _rank0_shard(t: torch.Tensor, mesh):
    """Rank 0's ``Shard(0)`` DTensor of ``t``, made from its local rows: the fake process group moves no data, so
    ``distribute_tensor`` (which scatters on some torch versions) would leave rank 0 uninitialized memory."""
    from torch.distributed.tensor import DTensor, Shard

    local = t.chunk(2)[0].clone()
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=t.shape, stride=t.stride())


def test_plan_steps_like_update_on_flat_and_nested_trees(mesh):

    import bnbf
    import bnbf.distributed as bd

    torch.manual_seed(0)
    spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=0)
    hp = {"lr": 1e-2, "weight_decay": 0.0}
    for make in (lambda xs: dict(enumerate(xs)), list, lambda xs: {"a": xs[0], "b": {"c": xs[1]}}):
        full = [torch.randn(512, 2), torch.randn(4, 64)]
        grads = [torch.randn_like(t) for t in full]
        ps = [make([_rank0_shard(t, mesh) for t in full]) for _ in range(2)]
        gs = make([_rank0_shard(g, mesh) for g in grads])
        states = [bd.init_state(p, spec, hp) for p in ps]
        bd.update_(ps[0], gs, states[0], hp, 1)
        bd.plan(ps[1], states[1]).step(gs, hp, 1)
        for x, y in zip(torch.utils._pytree.tree_leaves(ps[0]), torch.utils._pytree.tree_leaves(ps[1])):
            assert torch.equal(x._local_tensor, y._local_tensor)
        # an AdamW step of lr 1e-2 moves every element by about lr (sign of the grad)
        for x, t, g in zip(torch.utils._pytree.tree_leaves(ps[0]), full, grads):
            step = t[: x._local_tensor.shape[0]] - x._local_tensor
            torch.testing.assert_close(step, 1e-2 * torch.sign(g[: step.shape[0]]), atol=1e-4, rtol=0)


def test_a_packed_state_refuses_dtensor_params(mesh):
    """DTensor params' state is bnbf.distributed's (each rank's shards): a packed state refuses them, building and
    stepping, before anything is written."""
    from torch.distributed.tensor import Shard, distribute_tensor

    import bnbf

    w = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    with pytest.raises(ValueError, match="DTensor"):
        bnbf.init_state({"w": w}, bnbf.OptimSpec(), packed=True)
    state = bnbf.init_state({"w": torch.zeros(8, 4)}, bnbf.OptimSpec(), packed=True)
    before = [b.clone() for b in state.buffers]
    for step in (bnbf.update, bnbf.update_):
        with pytest.raises(ValueError, match="DTensor"):
            step({"w": w}, {"w": w.detach()}, state, {"lr": 0.1}, 1)
    assert all(torch.equal(a, b) for a, b in zip(state.buffers, before))


def test_flat_layout_refuses_dtensor_params(mesh):
    """Flat buffers of FSDP2's sharded params would be local shards cut at other places on each rank: refused."""
    from torch.distributed.tensor import Shard, distribute_tensor

    import bnbf

    p = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    with pytest.raises(TypeError, match="leaf 'w' is a DTensor"):
        bnbf.flat_layout({"w": p}, bnbf.OptimSpec())


def test_norm_rules_refuse_sharded_beside_unsharded_params_before_writing(mesh):
    """LAMB's per-tensor norms of a sharded param need an all-reduce over its process group: one call holding a
    sharded and an unsharded param has no single group to reduce over, so it raises with everything unchanged."""
    import bnbf
    import bnbf.distributed as bd

    torch.manual_seed(0)
    spec = bnbf.OptimSpec(rule="lamb", state_bits=32)
    hp = {"lr": 1e-2}
    ps = {"sharded": _rank0_shard(torch.randn(16, 4), mesh), "plain": torch.randn(6, 4)}
    gs = {"sharded": _rank0_shard(torch.randn(16, 4), mesh), "plain": torch.randn(6, 4)}
    state = bd.init_state(ps, spec, hp)
    local = lambda t: t._local_tensor if hasattr(t, "_local_tensor") else t  # noqa: E731
    before = [local(t).clone() for t in torch.utils._pytree.tree_leaves((ps, state))]
    with pytest.raises(NotImplementedError, match="same process group"):
        bd.check_step(ps, "lamb")
    with pytest.raises(NotImplementedError, match="same process group"):
        bd.update_(ps, gs, state, hp, 1)
    after = [local(t) for t in torch.utils._pytree.tree_leaves((ps, state))]
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    bd.check_step(ps, "adamw")  # no norms: nothing to refuse


def test_compiled_step_with_a_tensor_lr_refuses_dtensor_params_before_writing(mesh):
    """bnbf_nn's compiled step traces groups with a tensor setting, which DTensor params cannot take (their step is
    bnbf.distributed's): it raises, with the params, the state and the step counts as they were. A group whose
    settings are numbers is stepped eagerly inside the compiled call, as on one device."""
    import bnbf_nn

    torch.manual_seed(0)
    full = torch.randn(512, 4)
    p = torch.nn.Parameter(_rank0_shard(full, mesh))
    p.grad = _rank0_shard(torch.randn(512, 4), mesh)
    opt = bnbf_nn.AdamW8bit([p], lr=torch.tensor(1e-2), weight_decay=0.0, min_8bit_size=0)
    before = p._local_tensor.clone()
    step = torch.compile(opt.step, backend="eager")
    with pytest.raises(NotImplementedError, match="torch.compile of step on DTensor"):
        step()
    assert torch.equal(p._local_tensor, before)
    assert all(int(s["step"]) == 0 for s in opt.state.values())
    opt.param_groups[0]["lr"] = 1e-2
    step()  # numbers: the eager step inside the compiled call
    torch.testing.assert_close(before - p._local_tensor, 1e-2 * torch.sign(p.grad._local_tensor), atol=1e-4, rtol=0)


def _tree(leaves: list) -> dict:
    """A nested tree of four leaves, so that a leaf's key path (``['head'][1]``) differs from its flat position."""
    return {"enc": {"w": leaves[0]}, "head": [leaves[1], leaves[2]], "b": leaves[3]}


def _named_leaves(mesh):
    """DTensor params of ``_tree``'s shape, their DTensor grads and 32-bit states."""
    import bnbf
    import bnbf.distributed as bd

    torch.manual_seed(0)
    shapes = [(8, 4), (8, 4), (10, 4), (4,)]  # two alike: one state for both passes the fit check
    params = _tree([_rank0_shard(torch.randn(s), mesh) for s in shapes])
    grads = _tree([_rank0_shard(torch.randn(s), mesh) for s in shapes])
    return params, grads, bd.init_state(params, bnbf.OptimSpec(rule="adamw", state_bits=32))


def _snapshot(*trees) -> list:
    local = lambda t: t._local_tensor if hasattr(t, "_local_tensor") else t  # noqa: E731
    return [local(t).clone() for t in torch.utils._pytree.tree_leaves(trees)]


def test_step_errors_name_leaves_by_key_path(mesh):
    """Every refusal of a step of DTensor params names the leaf as the core names a plain one (``grad['head'][1]``,
    not its flat position ``grad [2]``), whichever entry point raises it (bnbf.distributed's own checks, or the
    core's of the local shards), with nothing written."""
    import bnbf
    import bnbf.distributed as bd

    params, grads, state = _named_leaves(mesh)
    hp = {"lr": 1e-2}
    steps = {
        "update_": lambda p, g, s: bd.update_(p, g, s, hp, 1),
        "update": lambda p, g, s: bd.update(p, g, s, hp, 1),
        "bnbf.update_": lambda p, g, s: bnbf.update_(p, g, s, hp, 1),
        "plan": lambda p, g, s: bd.plan(p, s).step(g, hp, 1),
        "compose": lambda p, g, s: bnbf.update_(p, g, s, lambda path, leaf: hp, 1),  # per-leaf: bnbf.compose
    }
    wrong_shape = _rank0_shard(torch.randn(7, 4), mesh)
    bad = [
        (
            {**grads, "head": [grads["head"][0], wrong_shape]},
            state,
            ValueError,
            r"grad\['head'\]\[1\] has shape \(7, 4\) but the param has shape \(10, 4\)",
        ),
        (
            {**grads, "head": [grads["head"][0], grads["head"][1].full_tensor()]},
            state,
            TypeError,
            r"grad\['head'\]\[1\]: got mixed torch.Tensor and DTensor",
        ),
        (
            grads,
            {**state, "head": [state["head"][1], state["head"][0]]},
            ValueError,
            r"state\['head'\]\[0\]\.exp_avg does not fit the param",
        ),
        (  # the core's check of the local shards: one state for two params
            grads,
            {**state, "head": [state["enc"]["w"], state["head"][1]]},
            ValueError,
            r"state\['enc'\]\['w'\] and state\['head'\]\[0\] are the same state",
        ),
    ]
    before = _snapshot(params, state)
    for g, s, err, match in bad:
        for name, step in steps.items():
            with pytest.raises(err, match=match):
                step(params, g, s)
            assert all(torch.equal(a, b) for a, b in zip(_snapshot(params, state), before)), (name, match)


def test_plain_leaf_beside_dtensors_is_named_by_key_path(mesh):
    """A plain param given DTensor state, in a call or a plan of DTensor params: named by its key path."""
    import bnbf
    import bnbf.distributed as bd

    params, grads, state = _named_leaves(mesh)
    plain = {**params, "b": params["b"].full_tensor()}
    plain_g = {**grads, "b": grads["b"].full_tensor()}
    before = _snapshot(plain, state)
    for step in (bd.update_, bd.update):
        with pytest.raises(TypeError, match=r"param\['b'\]: got mixed torch.Tensor and DTensor"):
            step(plain, plain_g, state, {"lr": 1e-2}, 1)
    with pytest.raises(TypeError, match=r"state\['b'\]: got mixed torch.Tensor and DTensor"):
        bd.plan(plain, state)
    plain_state = {**state, "b": bnbf.init_state(plain["b"], bnbf.OptimSpec(rule="adamw", state_bits=32))}
    held = bd.plan(plain, plain_state)
    with pytest.raises(TypeError, match=r"grad\['b'\]: got mixed torch.Tensor and DTensor"):
        held.step(grads, {"lr": 1e-2}, 1)
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(plain, state), before))


def test_init_state_and_check_errors_name_leaves_by_key_path(mesh):
    """init_state (its own split check and the core's checks of the local shards), check_step and check_grads
    name a leaf by its key path; check_grads takes a list (bnbf_nn's group), named ``[i]`` as the core names a
    list's leaf."""
    from torch.distributed.tensor import DTensor, Shard

    import bnbf
    import bnbf.distributed as bd

    params, grads, _ = _named_leaves(mesh)
    spec = bnbf.OptimSpec(rule="adamw", state_bits=32)
    ints = _tree([params["enc"]["w"], params["head"][0], _rank0_shard(torch.ones(10, 4, dtype=torch.int32), mesh),
                  params["b"]])  # fmt: skip
    with pytest.raises(TypeError, match=r"param\['head'\]\[1\] has dtype torch.int32"):
        bd.init_state(ints, spec)
    cols = DTensor.from_local(torch.randn(10, 2), mesh, [Shard(1)], run_check=False, shape=(10, 4), stride=(4, 1))
    by_cols = {**params, "head": [params["head"][0], cols]}
    with pytest.raises(NotImplementedError, match=r"param\['head'\]\[1\] has placements \(Shard\(dim=1\),\)"):
        bd.init_state(by_cols, spec)
    with pytest.raises(NotImplementedError, match=r"param\['head'\]\[1\] has placements \(Shard\(dim=1\),\)"):
        bd.check_step(by_cols, "lamb")
    flat_p = torch.utils._pytree.tree_leaves(params)
    flat_g = torch.utils._pytree.tree_leaves(grads)
    flat_g[2] = _rank0_shard(torch.randn(7, 4), mesh)
    with pytest.raises(ValueError, match=r"grad\[2\] has shape \(7, 4\)"):
        bd.check_grads(flat_p, flat_g)


def _mixed_field_state(state, mesh):
    """``state`` with its ``['head'][1]`` state's last field a plain tensor (a hand-made state: init_state gives
    DTensors only)."""
    s = state["head"][1]
    bad = s._replace(**{s._fields[-1]: getattr(s, s._fields[-1]).to_local().clone()})
    return {**state, "head": [state["head"][0], bad]}


def test_state_functions_name_states_by_key_path_and_load_writes_nothing_on_refusal(mesh):
    """dequantize_state, state_dict and load_state_dict_ name a state they refuse by its key path; load_state_dict_
    refuses it before writing any state (it wrote the states before it, then raised)."""
    import bnbf
    import bnbf.distributed as bd

    params, _, _ = _named_leaves(mesh)
    for bits in (32, 8):
        state = bd.init_state(params, bnbf.OptimSpec(rule="adamw", state_bits=bits, min_8bit_size=0))
        bad = _mixed_field_state(state, mesh)
        match = r"state\['head'\]\[1\]\.exp_avg_sq\w* of a DTensor param must be a DTensor"
        with pytest.raises(TypeError, match=match):
            bd.dequantize_state(bad)
        if bits == 8:  # a 32-bit state's checkpoint form is its own fields
            with pytest.raises(TypeError, match=match):
                bd.state_dict(bad)
        # a checkpoint of other values, as plain tensors of the global shapes
        saved = torch.utils._pytree.tree_map(
            lambda x: torch.full(x.shape, 0.5, dtype=x.dtype) if isinstance(x, torch.Tensor) else x,
            bd.state_dict(state),
        )
        before = _snapshot(bad)
        with pytest.raises(TypeError, match=match):
            bd.load_state_dict_(bad, saved)
        assert all(torch.equal(a, b) for a, b in zip(_snapshot(bad), before)), bits


def _bundle(mesh):
    """A rank's params (an 8-bit and a 32-bit DTensor, a plain tensor; nested), their state, a plan of them, and
    grads for two steps."""
    import bnbf
    import bnbf.distributed as bd

    torch.manual_seed(0)
    shapes = {"w": (1024, 2), "b": (8, 4)}
    tree = lambda make: {"enc": {"w": make(shapes["w"])}, "head": [make(shapes["b"]), torch.randn(5)]}  # noqa: E731
    params = tree(lambda s: _rank0_shard(torch.randn(s), mesh))
    grads = [tree(lambda s: _rank0_shard(torch.randn(s), mesh)) for _ in range(2)]
    state = bd.init_state(params, bnbf.OptimSpec(rule="adamw", min_8bit_size=1024))
    assert type(state["enc"]["w"]).layout.quantized and not type(state["head"][0]).layout.quantized
    return {"params": params, "state": state, "plan": bd.plan(params, state)}, grads


@pytest.mark.parametrize("how", ["torch.save", "deepcopy", "copy"])
def test_a_pickled_plan_steps_its_copies(mesh, how):
    """bnbf.distributed.Plan could not be pickled (torch.save raised AttributeError on a lambda it held), unlike
    bnbf.Plan and the DTensors it holds. Now a rank's bundle of params, state and plan saved with torch.save loads
    with torch.load's default (weights_only=True), its plan a plan of the loaded tensors: stepping it moves them
    exactly as the original plan moves its own (copy.deepcopy alike; copy.copy: a second plan of the same tensors)."""
    import copy
    import io

    hp = {"lr": 1e-2}
    bundle, grads = _bundle(mesh)
    bundle["plan"].step(grads[0], hp, 1)
    if how == "torch.save":
        buf = io.BytesIO()
        torch.save(bundle, buf)
        buf.seek(0)
        other = torch.load(buf)  # torch's default: weights_only=True
    elif how == "deepcopy":
        other = copy.deepcopy(bundle)
    else:
        other = {**bundle, "plan": copy.copy(bundle["plan"])}
    before = _snapshot(bundle["params"], bundle["state"])
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(other["params"], other["state"]), before, strict=True))
    bundle["plan"].step(grads[1], hp, 2)
    moved = _snapshot(bundle["params"], bundle["state"])
    if how == "copy":  # the same tensors: its step moves them again
        other["plan"].step(grads[1], hp, 3)
        assert not torch.equal(_snapshot(bundle["params"])[0], moved[0])
        return
    assert not torch.equal(moved[0], before[0])
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(other["params"], other["state"]), before, strict=True))
    other["plan"].step(grads[1], hp, 2)
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(other["params"], other["state"]), moved, strict=True))


def test_a_pickled_plan_of_other_values_is_refused(mesh, monkeypatch):
    """The values a pickled plan is made from are a file's, DTensors as torch's loader took them: values plan()
    refuses, a DTensor whose local tensor is not the shard its metadata describes, a file saved at another rank's
    mesh coordinate and a mesh that does not read are refused with a ValueError naming the problem, through
    torch.load's default too; so is a plan loaded where no process group was made."""
    import copy
    import io

    from torch.distributed.tensor import DTensor

    import bnbf
    import bnbf.distributed as bd

    params = {"w": _rank0_shard(torch.randn(16, 4), mesh)}
    state = bd.init_state(params, bnbf.OptimSpec(rule="adamw", state_bits=32))
    args = bd.plan(params, state).__reduce__()[1]
    assert type(bd._rebuild_plan(*args)) is bd.Plan
    w = params["w"]
    short = DTensor.from_local(torch.randn(3, 4), mesh, w.placements, run_check=False, shape=w.shape, stride=w.stride())
    rank1 = copy.copy(mesh)
    rank1._coordinate_on_dim = (1,)  # what the mesh of a file rank 1 saved says (a private field: no API sets it)
    theirs = DTensor.from_local(torch.randn(8, 4), rank1, w.placements, run_check=False, shape=w.shape,
                                   stride=w.stride())  # fmt: skip
    other = _rank0_shard(torch.randn(18, 4), mesh)
    unread = copy.copy(mesh)
    broken = DTensor.from_local(torch.randn(8, 4), unread, w.placements, run_check=False, shape=w.shape,
                                stride=w.stride())  # fmt: skip
    del unread._layout  # a mesh whose fields a file left out
    cases = [
        (({"w": short}, state), r"shape \(16, 4\) .* holds a local tensor of shape \(3, 4\), not \(8, 4\)"),
        (({"w": theirs}, state), r"saved at mesh coordinate \(1,\), rank 0 is at \(0,\)"),
        ((params, {"w": w}), r"state\['w'\] must be a bnbf state, got DTensor"),
        ((params, {"v": state["w"]}), "state must have the structure of params"),
        (({"w": other}, state), r"state\['w'\]\.exp_avg does not fit the param"),
        (({"w": broken}, state), "_layout"),
    ]
    for bad, match in cases:
        with pytest.raises(ValueError, match=f"^a pickled bnbf.distributed Plan does not load: .*{match}"):
            bd._rebuild_plan(*bad)

        class Crafted:  # pickles as the call a file could hold
            def __reduce__(self, bad=bad):
                return bd._rebuild_plan, bad

        buf = io.BytesIO()
        torch.save(Crafted(), buf)
        buf.seek(0)
        with pytest.raises(ValueError, match=match):
            torch.load(buf)
    with monkeypatch.context() as m:  # a process that made no process group: the shards' split reads theirs
        m.setattr(dist, "is_initialized", lambda: False)
        with pytest.raises(ValueError, match="process groups are not made in this process"):
            bd._rebuild_plan(*args)

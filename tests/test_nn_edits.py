"""What users of torch.optim (and bitsandbytes) edit between steps reaches bnbf_nn's next step, although it caches a
plan per param group: a params list edited in place, optimizer state reset (``opt.state.clear()``, ``del
opt.state[p]``, ``opt.state[p] = {}``...), one param's step count set by hand. Each case runs the same edits on
torch.optim.AdamW, the independent reference, and on bnbf_nn.AdamW32bit (32-bit state: torch's math within
``STATE32``); bnbf_nn's 8-bit class must take the same route (steps and which params move). Also the settings
bitsandbytes users pass that bnbf_nn read wrongly: string numbers, ``override_config(p, key, None)``,
bitsandbytes' ``betas`` spelling in an override."""

from __future__ import annotations

import copy
from collections import defaultdict

import pytest
import torch
from tolerances import STATE32

import bnbf_nn

pytestmark = pytest.mark.surface  # the step's caches and checks: the reference pass covers them

HP = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
TOL = STATE32[(torch.float32, 32)]


def _params(n: int = 3) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(40, 8, generator=gen)) for _ in range(n)]


def _run(make, edit, steps: int = 6, at: int = 3, records: list | None = None):
    """``steps`` steps of ``make(params)`` with fixed grads, ``edit(opt, params, spare)`` applied after step ``at``;
    the params and spare tensors afterwards, and each param's step count (``records``: gets each param's record)."""
    params, (spare,) = _params(), _params(1)
    opt = make(params)
    gen = torch.Generator().manual_seed(1)
    for i in range(1, steps + 1):
        for p in (*params, spare):
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        if i == at:
            edit(opt, params, spare)
    counts = [int(opt.state[p]["step"]) if "step" in opt.state.get(p, {}) else None for p in (*params, spare)]
    if records is not None:
        records.extend(opt.state[p] for p in params)
    return [p.detach() for p in (*params, spare)], counts


def _torch_step(edit):
    def fixed(opt, params, spare):  # torch keeps a tensor step: the same edit, in torch's type
        edit(opt, params, spare, step=lambda v: torch.tensor(float(v)))

    return fixed


def _ours(edit):
    return lambda opt, params, spare: edit(opt, params, spare, step=int)


def _swap_in_place(opt, params, spare, step):
    opt.param_groups[0]["params"][1] = spare  # the removed param stops, the new one starts at step 1


def _clear_all(opt, params, spare, step):
    opt.state.clear()


def _del_one(opt, params, spare, step):
    del opt.state[params[0]]


def _empty_one(opt, params, spare, step):
    opt.state[params[1]] = {}


def _clear_record(opt, params, spare, step):
    opt.state[params[2]].clear()


def _new_dict(opt, params, spare, step):
    opt.state = defaultdict(dict)


def _first_count(opt, params, spare, step):
    opt.state[params[0]]["step"] = step(0)  # the others stay at their counts


def _second_count(opt, params, spare, step):
    opt.state[params[1]]["step"] = step(1)


EDITS = [_swap_in_place, _clear_all, _del_one, _empty_one, _clear_record, _new_dict, _first_count, _second_count]


@pytest.mark.parametrize("edit", EDITS, ids=lambda f: f.__name__.strip("_"))
def test_an_edit_between_steps_reaches_the_next_step_as_in_torch(edit):
    want, want_counts = _run(lambda ps: torch.optim.AdamW(ps, **HP), _torch_step(edit))
    got, counts = _run(lambda ps: bnbf_nn.AdamW32bit(ps, **HP), _ours(edit))
    assert counts == want_counts
    init = _params() + _params(1)
    for g, w, p0 in zip(got, want, init):
        torch.testing.assert_close(g - p0, w - p0, atol=TOL.atol, rtol=TOL.rtol)
    # the 8-bit class: the same counts, and the same params move
    got8, counts8 = _run(lambda ps: bnbf_nn.AdamW8bit(ps, **HP, min_8bit_size=0), _ours(edit))
    assert counts8 == want_counts
    assert [torch.equal(g, p0) for g, p0 in zip(got8, init)] == [torch.equal(w, p0) for w, p0 in zip(want, init)]


@pytest.mark.parametrize("kw", [{}, {"capturable": True}], ids=["plain", "capturable"])
@pytest.mark.parametrize("edit", [_first_count, _second_count], ids=lambda f: f.__name__.strip("_"))
def test_a_step_count_set_as_torch_keeps_it_steps_from_that_count(edit, kw):
    """torch.optim keeps a param's step as a float32 0-d tensor, and code written for it sets one so
    (``opt.state[p]["step"] = torch.tensor(3.0)``): bnbf_nn refused it; now it steps from that count, as torch, and
    the record holds the count as bnbf_nn writes its own afterwards (an int; a 0-d int64 tensor with capturable)."""
    want, want_counts = _run(lambda ps: torch.optim.AdamW(ps, **HP), _torch_step(edit))
    records: list = []
    got, counts = _run(lambda ps: bnbf_nn.AdamW32bit(ps, **HP, **kw), _torch_step(edit), records=records)
    assert counts == want_counts
    init = _params() + _params(1)
    for g, w, p0 in zip(got, want, init):
        torch.testing.assert_close(g - p0, w - p0, atol=TOL.atol, rtol=TOL.rtol)
    for r in records:
        if kw:
            assert isinstance(r["step"], torch.Tensor) and r["step"].dtype == torch.int64, r["step"]
        else:
            assert type(r["step"]) is int, r["step"]


def test_a_reset_state_is_in_the_next_state_dict():
    params = _params()
    opt = bnbf_nn.AdamW8bit(params, **HP, min_8bit_size=0)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    opt.step()
    opt.state.clear()
    opt.step()
    saved = opt.state_dict()["state"]
    assert sorted(saved) == [0, 1, 2] and all(float(s["step"]) == 1.0 for s in saved.values())


@pytest.mark.parametrize("where", ["constructor", "add_param_group", "override"])
def test_string_numbers_are_refused_with_nothing_changed(where):
    """A YAML config's ``lr: 1e-3`` is a string: torch raises TypeError; so does bnbf_nn, naming the setting."""
    params = _params()
    for p in params:
        p.grad = torch.ones_like(p)
    if where == "constructor":
        with pytest.raises(TypeError, match="lr must be a number or a 1-element tensor, got str"):
            bnbf_nn.AdamW8bit(params, lr="1e-3")
        return
    opt = bnbf_nn.AdamW8bit(params[:2], lr=1e-3)
    opt.step()
    before = [p.detach().clone() for p in params]
    if where == "add_param_group":
        with pytest.raises(TypeError, match="weight_decay must be a number"):
            opt.add_param_group({"params": [params[2]], "weight_decay": "0.1"})
        assert len(opt.param_groups) == 1
    else:
        bnbf_nn.GlobalOptimManager.get_instance().override_config(params[1], "eps", "1e-6")
        with pytest.raises(TypeError, match="eps.* must be a number"):
            opt.step()
    opt2_steps = [int(opt.state[p]["step"]) for p in params[:2]]
    assert opt2_steps == [1, 1]
    assert all(torch.equal(p, b) for p, b in zip(params, before))


def test_override_of_none_overrides_nothing():
    """bitsandbytes' override_config skips a None value; so does bnbf_nn's (it raised at step)."""
    a, b = _params(), _params()
    bnbf_nn.GlobalOptimManager.get_instance().override_config(a[0], "lr", None)
    bnbf_nn.GlobalOptimManager.get_instance().override_config(a[1], key_value_dict={"betas": None, "eps": None})
    runs = []
    for ps in (a, b):
        opt = bnbf_nn.AdamW8bit(ps, **HP, min_8bit_size=0)
        for p in ps:
            p.grad = torch.ones_like(p)
        opt.step()
        runs.append([p.detach() for p in ps])
    assert all(torch.equal(x, y) for x, y in zip(*runs))


@pytest.mark.parametrize(
    "cls, bnb_kw, own_kw",
    [
        (bnbf_nn.SGD8bit, {"betas": (0.5, 0.1)}, {"momentum": 0.5, "dampening": 0.1}),
        (bnbf_nn.RMSprop8bit, {"betas": (0.8, 0.3)}, {"alpha": 0.8, "momentum": 0.3}),
        (bnbf_nn.LARS8bit, {"betas": (0.5, 0.0)}, {"momentum": 0.5, "dampening": 0.0}),
    ],
)
def test_bitsandbytes_betas_spelling_in_an_override(cls, bnb_kw, own_kw):
    """bitsandbytes' SGD, RMSprop and LARS read an override's ``betas`` as their momentum (and dampening or
    alpha): the same step as the override in torch's names."""
    runs = []
    for kw in (bnb_kw, own_kw):
        bnbf_nn.GlobalOptimManager.get_instance().initialize()
        ps = _params(2)
        bnbf_nn.GlobalOptimManager.get_instance().override_config(ps[0], key_value_dict=kw)
        opt = cls(ps, lr=1e-2, momentum=0.9, min_8bit_size=0)
        gen = torch.Generator().manual_seed(2)
        for _ in range(3):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        runs.append([p.detach() for p in ps])
    assert all(torch.equal(x, y) for x, y in zip(*runs))
    ps = _params(1)
    clash = {**bnb_kw, next(iter(own_kw)): 0.95}
    bnbf_nn.GlobalOptimManager.get_instance().override_config(ps[0], key_value_dict=clash)
    opt = cls(ps, lr=1e-2, momentum=0.9)
    ps[0].grad = torch.ones_like(ps[0])
    with pytest.raises(ValueError, match="also sets"):
        opt.step()


@pytest.mark.parametrize("hook", ["get_config", "update_step", "init_state"])
@pytest.mark.parametrize("base", [bnbf_nn.Optimizer2State, bnbf_nn.Optimizer1State, bnbf_nn.AdamW8bit])
def test_a_subclass_overriding_a_bitsandbytes_hook_is_refused(base, hook):
    """bitsandbytes routes per-param settings through hooks such as get_config; bnbf_nn never calls them, so a
    subclass that overrides one is refused where it is defined, not silently ignored at every step."""
    with pytest.raises(TypeError, match=f"defines \\['{hook}'\\].* never calls"):
        type("Custom", (base,), {hook: lambda self, *a: None})
    type("Fine", (base,), {"helper": lambda self: None})  # other methods are the subclass's own business


def test_a_group_removed_by_hand_is_freed_with_its_state():
    """``param_groups.pop()`` then dropping the param: torch.optim frees the param and its state; bnbf_nn's cached
    plans (keyed by the group) held both for the optimizer's life, one set per removed group."""
    import gc
    import weakref

    body = torch.nn.Parameter(torch.randn(64, 64))
    opt = bnbf_nn.AdamW8bit([body], lr=1e-3, min_8bit_size=0)
    refs = []
    for _ in range(3):
        head = torch.nn.Parameter(torch.randn(64, 64))
        opt.add_param_group({"params": [head]})
        body.grad, head.grad = torch.randn_like(body), torch.randn_like(head)
        opt.step()
        opt.step()
        refs += [weakref.ref(head), *map(weakref.ref, opt.state[head]["state"])]
        opt.param_groups.pop()
        opt.state.pop(head)
        del head
    body.grad = torch.randn_like(body)
    opt.step()  # a step after the removal: the caches let go
    gc.collect()
    assert sum(r() is not None for r in refs) == 0


@pytest.mark.parametrize("old_freed_first", [False, True])
def test_an_lr_override_in_a_group_replaced_by_hand(old_freed_first):
    """A manager lr override is relative to its group's starting lr. A group dict replaced by hand (popped, a new dict
    appended) starts at its own lr, also when the new dict lands at the freed one's address (the starting lrs were
    keyed by id(group): the override was then scaled by the old group's lr, 10x here)."""
    w = torch.nn.Parameter(torch.ones(16, 16))
    bnbf_nn.GlobalOptimManager.get_instance().override_config(w, "lr", 1e-4)
    opt = bnbf_nn.SGD8bit([w], lr=1e-3, min_8bit_size=0)
    w.grad = torch.ones(16, 16)
    opt.step()
    old = opt.param_groups.pop()
    template = {k: v for k, v in old.items() if k != "params"}
    if old_freed_first:
        del old
    opt.param_groups.append({**template, "params": [w], "lr": 1e-2})
    before = w.detach().clone()
    opt.step()
    torch.testing.assert_close((before - w.detach()).mean().item(), 1e-4, rtol=1e-3, atol=0)


def test_an_lr_override_in_a_group_appended_by_hand_follows_its_lr():
    """A group appended to param_groups by hand has no starting lr recorded: its lr was read anew at every step as
    the one the override is relative to, so the override kept its lr while the group's lr was halved each step."""
    w, v = torch.nn.Parameter(torch.zeros(16, 16)), torch.nn.Parameter(torch.zeros(16, 16))
    bnbf_nn.GlobalOptimManager.get_instance().override_config(w, "lr", 1e-4)
    opt = bnbf_nn.SGD8bit([v], lr=1e-3, min_8bit_size=0)
    template = {k: x for k, x in opt.param_groups[0].items() if k != "params"}
    opt.param_groups.append({**template, "params": [w], "lr": 1e-2})
    moved = []
    for _ in range(3):
        w.grad, v.grad = torch.ones(16, 16), torch.ones(16, 16)
        before = w.detach().clone()
        opt.step()
        moved.append((before - w.detach()).mean().item())
        opt.param_groups[1]["lr"] *= 0.5
    torch.testing.assert_close(moved, [1e-4, 5e-5, 2.5e-5], rtol=1e-6, atol=0)


def _two_tensor(t: torch.Tensor) -> torch.Tensor:
    from torch.testing._internal.two_tensor import TwoTensor

    return TwoTensor(t, t.clone())


@pytest.mark.parametrize("when", ["first step", "later step", "later step, a param without grad"])
@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda t: t.to_sparse(), r"sparse gradients \(grad\[1\] of param group 1 has layout torch.sparse_coo\)"),
        (_two_tensor, r"grad\[1\] of param group 1 is a TwoTensor"),
    ],
    ids=["sparse", "subclass"],
)
def test_a_grad_no_step_can_take_raises_before_any_group_steps(when, bad, match):
    """A grad the step refuses in the last group (an ``nn.Embedding(sparse=True)``'s) raises before the first group
    steps or any param gets its first state, on the first step and on the cached steps after it: nothing changes."""
    params = _params(4)
    opt = bnbf_nn.AdamW8bit([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2, min_8bit_size=0)
    gen = torch.Generator().manual_seed(2)
    if when != "first step":
        for _ in range(2):  # the second step takes the cached path
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    if when.endswith("without grad"):
        params[0].grad = None
    before = [p.detach().clone() for p in params]
    saved = copy.deepcopy(opt.state_dict()["state"])
    params[3].grad = bad(params[3].grad)
    with pytest.raises((RuntimeError, TypeError), match=match):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    now = opt.state_dict()["state"]
    assert torch.utils._pytree.tree_structure(now) == torch.utils._pytree.tree_structure(saved)
    for a, b in zip(torch.utils._pytree.tree_leaves(now), torch.utils._pytree.tree_leaves(saved)):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("optim_bits", 16, "optim_bits must be 8 or 32"),
        ("min_8bit_size", -5, "min_8bit_size must be a non-negative int"),
    ],
)
@pytest.mark.parametrize("which", [0, 2])
def test_a_bad_storage_override_after_the_first_step_raises_for_any_param(key, value, match, which):
    """A storage setting (optim_bits, min_8bit_size) overridden after the states are made is refused wherever its
    param sits in the group: the params of one plan are bucketed without their storage settings (a made state's
    storage stays), and only the first param of a bucket was checked. Nothing moves."""
    params = _params()
    opt = bnbf_nn.AdamW8bit(params, **HP, min_8bit_size=0)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    bnbf_nn.GlobalOptimManager.get_instance().override_config(params[which], key, value)
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match=match) as info:
        opt.step()
    # the error says where the value came from (it named the core's state_bits and no override)
    assert info.value.__notes__ == [
        f"(GlobalOptimManager's override {{'{key}': {value}}} of param {which} in param group 0 of AdamW8bit)"
    ]
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    assert all(opt.state[p]["step"] == 1 for p in params)


@pytest.mark.parametrize(
    "cls, key", [("SGD8bit", "momentum"), ("SGD", "dampening"), ("RMSprop", "alpha"), ("LARS", "momentum")]
)
def test_a_value_the_constructor_refuses_is_refused_in_a_group(cls, key):
    """The constructors refuse what bitsandbytes' refuses of the settings it passes as ``betas`` (momentum, dampening,
    RMSprop's alpha in [0, 1)); the same value written into a param group (or a schedule's) is refused at the step,
    not stepped (RMSprop's alpha of 1.5 made NaN params, SGD's momentum of 1.5 grew them to 3e4). Nothing moves."""
    params = _params()
    opt = getattr(bnbf_nn, cls)(params, lr=1e-2, momentum=0.9, min_8bit_size=0)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    opt.param_groups[0][key] = 1.5
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match=rf"Invalid {key} value: 1.5 \({cls} takes 0 <= {key} < 1"):
        opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    opt.param_groups[0][key] = 0.5
    opt.step()
    assert all(opt.state[p]["step"] == 2 for p in params)


def test_override_keys_of_bitsandbytes_docs():
    """bitsandbytes' docs override ``is_sparse`` (its example) and list ``percentile_clipping`` and ``block_wise``;
    bitsandbytes 0.50 takes them and never reads them per parameter. Here: ignored at the values that change
    nothing (any for is_sparse), stepping as without them; refused at others, with nothing moved."""
    mng = bnbf_nn.GlobalOptimManager.get_instance()
    params, twin = _params(), _params()
    opt = bnbf_nn.Adam8bit(params, **HP, min_8bit_size=0)
    ref = bnbf_nn.Adam8bit(twin, **HP, min_8bit_size=0)
    mng.override_config(params[0], key_value_dict={"is_sparse": True, "percentile_clipping": 100, "block_wise": True})
    for _ in range(2):
        for p, q in zip(params, twin):
            p.grad = q.grad = torch.randn_like(p)
        opt.step()
        ref.step()
    assert all(torch.equal(p, q) for p, q in zip(params, twin))
    for key, value in (("percentile_clipping", 5), ("block_wise", False)):
        mng.override_config(params[1], key, value)
        before = [p.detach().clone() for p in params]
        with pytest.raises(ValueError, match=rf"override {key}={value} is not supported by Adam8bit"):
            opt.step()
        assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
        mng.override_config(params[1], key, 100 if key == "percentile_clipping" else True)


def _sparse_grad(opt, ps):
    ps[2].grad = ps[2].grad.to_sparse()


def _late_momentum(opt, ps):  # bitsandbytes' range, on a param of the last group that gets its first state now
    bnbf_nn.GlobalOptimManager.get_instance().override_config(ps[2], "betas", (1.0, 0.0))


def _slots_on_then_bad_grad(opt, ps):  # group 0 switches a state slot on; group 1's grad is bad
    opt.param_groups[0]["amsgrad" if "amsgrad" in opt.param_groups[0] else "momentum"] = True
    _sparse_grad(opt, ps)


def _differentiable_8bit(opt, ps):
    opt.param_groups[1]["differentiable"] = True


def _bad_step_count(opt, ps):
    opt.state[ps[2]]["step"] = -3


def _negative_tensor_count(opt, ps):  # capturable: step counts are 0-d tensors (on the params' CPU here)
    opt.state[ps[2]]["step"] = torch.tensor(-1)


def _int16_tensor_count(opt, ps):
    opt.state[ps[2]]["step"] = torch.tensor(3, dtype=torch.int16)


def _fractional_count(opt, ps):  # torch's float step tensor: only a whole number is a count
    opt.state[ps[2]]["step"] = torch.tensor(2.5)


def _float_count_then_bad_grad(opt, ps):  # group 0's float count (taken, made an int64 tensor when it steps)
    opt.state[ps[0]]["step"] = torch.tensor(1.0)
    _sparse_grad(opt, ps)


def _param_in_two_groups(opt, ps):
    opt.param_groups[1]["params"].append(ps[0])


def _bad_storage(opt, ps):
    opt.param_groups[1]["optim_bits"] = 7


LATE = {
    _late_momentum: (bnbf_nn.SGD8bit, dict(lr=1e-2, momentum=0.9), r"Invalid momentum value: 1.0"),
    _slots_on_then_bad_grad: (bnbf_nn.AdamW8bit, dict(lr=1e-2), r"sparse gradients .*param group 1"),
    _differentiable_8bit: (bnbf_nn.AdamW8bit, dict(lr=1e-2), r"differentiable=True in param group 1 needs 32-bit"),
    _bad_step_count: (bnbf_nn.AdamW8bit, dict(lr=1e-2), r"'step'\] of param 0 of param group 1 is -3"),
    _negative_tensor_count: (bnbf_nn.AdamW8bit, dict(lr=1e-2, capturable=True), r"group 1 is tensor\(-1\)"),
    _int16_tensor_count: (bnbf_nn.AdamW8bit, dict(lr=1e-2, capturable=True), r"dtype=torch.int16\): a step count"),
    _fractional_count: (bnbf_nn.AdamW8bit, dict(lr=1e-2), r"group 1 is tensor\(2.5000\): a step count is a whole"),
    _float_count_then_bad_grad: (bnbf_nn.AdamW8bit, dict(lr=1e-2, capturable=True), r"sparse gradients"),
    _param_in_two_groups: (bnbf_nn.AdamW8bit, dict(lr=1e-2), r"appear in more than one parameter group"),
    _bad_storage: (bnbf_nn.AdamW8bit, dict(lr=1e-2), r"optim_bits must be 8 or 32"),
}


@pytest.mark.parametrize("fresh", [True, False], ids=["first step", "later step"])
@pytest.mark.parametrize("edit", list(LATE), ids=lambda f: f.__name__.strip("_"))
def test_what_a_later_group_refuses_leaves_every_group_as_it_was(edit, fresh):
    """Refusals found while a later group stepped, after the earlier ones had (found by an audit of failed calls):
    bitsandbytes' momentum range of a param getting its first state, a state slot switched on in group 0 (added
    before group 1's grads were checked), differentiable=True written into an 8-bit group, a step count set by hand
    to -3, or a tensor count to -1, int16 or torch's float 2.5 (its group found it after group 0 stepped), the same
    param appended to a second group's list (stepped twice, with no error), a storage setting no made state reads
    (ignored). Each is refused before anything changes: params, states, step counts (a float count that group 0
    takes stays as set)."""
    cls, kw, match = LATE[edit]
    counts = (_bad_step_count, _negative_tensor_count, _int16_tensor_count, _fractional_count)
    if fresh and edit in (_slots_on_then_bad_grad, _float_count_then_bad_grad, *counts):
        pytest.skip("needs made states")
    ps = _params(3)
    opt = cls([{"params": ps[:2]}, {"params": ps[2:]}], min_8bit_size=0, **kw)
    gen = torch.Generator().manual_seed(1)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen)
    if not fresh:
        opt.step()
    edit(opt, ps)
    snap = copy.deepcopy((list(ps), {k: v for k, v in opt.state.items()}))
    with pytest.raises((ValueError, RuntimeError), match=match):
        opt.step()
    for p, q in zip(ps, snap[0]):
        assert torch.equal(p.detach(), q.detach())
    for p, q in zip(ps, snap[0]):
        got, want = opt.state.get(p, {}), snap[1].get(q, {})
        assert got.keys() == want.keys(), f"{edit.__name__}: state keys {sorted(got)} != {sorted(want)}"
        for k in want:
            a, b = got[k], want[k]
            if isinstance(b, torch.Tensor):
                assert type(a) is type(b) and torch.equal(a, b), k
            elif k == "state":
                assert type(a) is type(b) and all(torch.equal(x, y) for x, y in zip(a, b)), k
            elif k == "step":  # a tensor count of the same dtype too: not made the group's kind of count yet
                assert type(a) is type(b) and a == b and getattr(a, "dtype", None) == getattr(b, "dtype", None), k

"""GlobalOptimManager (bitsandbytes' example verbatim, overrides, lr overrides under a scheduler) and the
embeddings that keep 32-bit optimizer state."""

from __future__ import annotations

import copy
import gc
import math

import pytest
import torch
from test_nn_optim import MIN8, assert_same, make_grads, make_params, run_adapter

import bnbf
import bnbf_nn

# argument checks, errors and plumbing, not kernel numerics: the interpreter pass skips them (conftest)
pytestmark = pytest.mark.surface


class MyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 96)  # 6144 weights: 8-bit unless overridden
        self.fc2 = torch.nn.Linear(96, 64)

    def forward(self, x):
        return self.fc2(self.fc1(x).relu())


def test_bitsandbytes_override_example_runs_verbatim(device):
    # bitsandbytes' optimizer overview, with bnbf_nn in place of bnb.optim (and .to(device) for .cuda())
    mng = bnbf_nn.GlobalOptimManager.get_instance()

    model = MyModel()
    mng.register_parameters(model.parameters())  # 1. register parameters while still on CPU

    model = model.cuda() if device == "cuda" else model.to(device)
    # use 8-bit optimizer states for all parameters
    adam = bnbf_nn.Adam(model.parameters(), lr=0.001, optim_bits=8)

    # 2. override: the parameter model.fc1.weight now uses 32-bit Adam
    mng.override_config(model.fc1.weight, "optim_bits", 32)

    model(torch.randn(4, 64, device=device)).square().mean().backward()
    adam.step()
    layout = lambda p: type(adam.state[p]["state"]).layout
    assert layout(model.fc1.weight).bits == 32
    assert layout(model.fc2.weight).bits == 8
    assert layout(model.fc1.bias).bits == 32  # below min_8bit_size


def test_key_value_dict_and_hparam_overrides_make_their_own_call():
    params = make_params()
    params0 = [p.detach().clone() for p in params]
    grads = make_grads(params, 2)
    mng = bnbf_nn.GlobalOptimManager.get_instance()
    opt = bnbf_nn.AdamW8bit(params, lr=1e-2, min_8bit_size=MIN8)
    mng.override_config([params[1]], key_value_dict={"weight_decay": 0.0, "betas": (0.5, 0.9), "optim_bits": 32})
    run_adapter(opt, params, grads)
    hp = {"lr": 1e-2, "weight_decay": 1e-2}
    ps, states = [p.clone() for p in params0], []
    states = [
        bnbf.init_state(ps[0], bnbf.OptimSpec(rule="adamw", min_8bit_size=MIN8)),
        bnbf.init_state(ps[1], bnbf.OptimSpec(rule="adamw", state_bits=32)),
        bnbf.init_state(ps[2], bnbf.OptimSpec(rule="adamw", min_8bit_size=MIN8)),
    ]
    for t, gs in enumerate(grads, start=1):
        bnbf.update_([ps[0], ps[2]], [gs[0], gs[2]], [states[0], states[2]], hp, t)
        bnbf.update_(ps[1], gs[1], states[1], {**hp, "weight_decay": 0.0, "betas": (0.5, 0.9)}, t)
    assert_same(opt, params, ps, states)


def test_lr_override_follows_the_scheduler():
    params = make_params()
    params0 = [p.detach().clone() for p in params]
    grads = make_grads(params, 3)
    mng = bnbf_nn.GlobalOptimManager.get_instance()
    mng.override_config(params[0], "lr", 1e-3)
    opt = bnbf_nn.Lion8bit(params, lr=1e-2, min_8bit_size=MIN8)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5**epoch)
    for gs in grads:
        run_adapter(opt, params, [gs])
        sched.step()
    ps = [p.clone() for p in params0]
    states = bnbf.init_state(ps, bnbf.OptimSpec(rule="lion", min_8bit_size=MIN8))
    for t, gs in enumerate(grads, start=1):
        scale = 0.5 ** (t - 1)
        bnbf.update_(ps[:1], gs[:1], states[:1], {"lr": 1e-3 * scale}, t)  # the override, scaled like the group
        bnbf.update_(ps[1:], gs[1:], states[1:], {"lr": 1e-2 * scale}, t)
    assert_same(opt, params, ps, states)


def test_lr_override_follows_a_tensor_lr_changed_in_place():
    """A tensor lr is changed in place by schedulers (ReduceLROnPlateau's fill_, which sets no initial_lr): the
    group's starting lr was that very tensor, so the ratio an lr override is scaled by stayed 1 and the override
    kept its starting lr while the group's halved."""
    params = make_params()
    params0 = [p.detach().clone() for p in params]
    grads = make_grads(params, 4)
    bnbf_nn.GlobalOptimManager.get_instance().override_config(params[0], "lr", 1e-3)
    opt = bnbf_nn.Lion8bit(params, lr=torch.tensor(1e-2), min_8bit_size=MIN8)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
    lrs = []
    for gs in grads:
        lrs.append(opt.param_groups[0]["lr"].clone())
        run_adapter(opt, params, [gs])
        sched.step(1.0)  # no improvement after the first: halves the lr in place
    assert [float(lr) for lr in lrs] == pytest.approx([1e-2, 1e-2, 5e-3, 2.5e-3])
    ps = [p.clone() for p in params0]
    states = bnbf.init_state(ps, bnbf.OptimSpec(rule="lion", min_8bit_size=MIN8))
    for t, (gs, lr) in enumerate(zip(grads, lrs), start=1):
        bnbf.update_(ps[:1], gs[:1], states[:1], {"lr": 1e-3 * (lr / torch.tensor(1e-2))}, t)  # scaled as the group
        bnbf.update_(ps[1:], gs[1:], states[1:], {"lr": lr}, t)
    assert_same(opt, params, ps, states)


def test_override_after_the_first_step_applies_from_the_next():
    params = make_params()
    opt = bnbf_nn.SGD8bit(params, lr=0.1, momentum=0.9, min_8bit_size=MIN8)
    grads = make_grads(params, 2)
    run_adapter(opt, params, grads[:1])
    before = params[2].detach().clone()
    bnbf_nn.GlobalOptimManager.get_instance().override_config(params[2], "lr", 0.0)
    run_adapter(opt, params, grads[1:])
    assert torch.equal(params[2].detach(), before)
    assert opt.state[params[2]]["step"] == 2


def test_module_overrides_apply_from_the_next_step_and_merge_with_a_params_own():
    """A module override registered after the first step applies from the next, and one param's ``override_config``
    and module override both hold (bitsandbytes reads module overrides at its first step only, and there the
    module's replaces the param's own)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 64)
    mng = bnbf_nn.GlobalOptimManager.get_instance()
    mng.override_config(lin.weight, "lr", 0.0)
    mng.register_module_override(lin, "weight", {"optim_bits": 32})
    opt = bnbf_nn.AdamW8bit(lin.parameters(), lr=0.1, min_8bit_size=0)
    w0, b0 = lin.weight.detach().clone(), lin.bias.detach().clone()
    for step in range(3):
        for p in lin.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        if step == 0:
            assert not torch.equal(lin.bias.detach(), b0)
            b1 = lin.bias.detach().clone()
            mng.register_module_override(lin, "bias", {"lr": 0.0})
    assert torch.equal(lin.weight.detach(), w0)  # lr 0 from its own override
    assert opt.state[lin.weight]["state1"].dtype == torch.float32  # 32-bit from the module's
    assert opt.state[lin.bias]["state1"].dtype == torch.uint8
    assert torch.equal(lin.bias.detach(), b1)  # the module override made after the first step


def test_unknown_override_key_is_an_error():
    params = make_params()
    bnbf_nn.GlobalOptimManager.get_instance().override_config(params[0], "momentum", 0.9)
    opt = bnbf_nn.AdamW8bit(params)
    with pytest.raises(ValueError, match="'momentum'.* not a setting of AdamW8bit"):
        run_adapter(opt, params, make_grads(params, 1))


@pytest.mark.parametrize("value", ["1e-3", [1e-3]], ids=["str", "list"])
def test_a_non_number_lr_override_is_refused_naming_lr(value):
    """An lr override is scaled by the group's lr changes; one that is no number was multiplied all the same, which
    raised Python's "can't multiply sequence by non-int" naming no setting. It is refused as a group's lr is, by the
    step and by get_config alike."""
    params = make_params()
    opt = bnbf_nn.AdamW8bit(params)
    bnbf_nn.GlobalOptimManager.get_instance().override_config(params[0], "lr", value)
    match = "lr must be a number or a 1-element tensor, got"
    with pytest.raises(TypeError, match=match):
        opt.get_config(0, 0, opt.param_groups[0])
    with pytest.raises(TypeError, match=match):
        run_adapter(opt, params, make_grads(params, 1))


def test_override_config_needs_a_setting():
    mng = bnbf_nn.GlobalOptimManager.get_instance()
    with pytest.raises(ValueError):
        mng.override_config(make_params()[0])
    with pytest.raises(RuntimeError, match="get_instance"):
        bnbf_nn.GlobalOptimManager()


@pytest.mark.parametrize("cls", [bnbf_nn.StableEmbedding, bnbf_nn.Embedding])
def test_embeddings_keep_32bit_state(cls):
    torch.manual_seed(0)
    emb = cls(1000, 16, padding_idx=0)
    bound = math.sqrt(6 / (1000 + 16))  # Xavier uniform
    assert emb.weight.abs().max() <= bound and emb.weight.abs().max() > 0.9 * bound
    assert torch.equal(emb.weight[0], torch.zeros(16))
    idx = torch.tensor([[1, 5, 7]])
    out = emb(idx)
    if cls is bnbf_nn.StableEmbedding:  # layer norm after the lookup
        assert torch.allclose(out.mean(-1), torch.zeros(1, 3), atol=1e-5)
    else:
        assert torch.equal(out, emb.weight[idx].detach())
    other = torch.nn.Linear(100, 64)
    opt = bnbf_nn.AdamW8bit(list(emb.parameters()) + list(other.parameters()))
    (out.square().sum() + other(torch.randn(2, 100)).square().sum()).backward()
    opt.step()
    assert type(opt.state[emb.weight]["state"]).layout.bits == 32
    assert type(opt.state[other.weight]["state"]).layout.bits == 8


@pytest.mark.parametrize("freeze", [True, False])
@pytest.mark.parametrize("cls", [bnbf_nn.StableEmbedding, bnbf_nn.Embedding])
def test_from_pretrained_keeps_the_weights_and_their_32bit_state(cls, freeze):
    """torch.nn.Embedding.from_pretrained passes ``_freeze``, which the classes refused (TypeError)."""
    weights = torch.randn(300, 16)
    emb = cls.from_pretrained(weights, freeze=freeze, padding_idx=0)
    assert torch.equal(emb.weight.detach(), weights) and emb.weight.requires_grad is not freeze
    assert emb.padding_idx == 0 and (cls is not bnbf_nn.StableEmbedding or isinstance(emb.norm, torch.nn.LayerNorm))
    if not freeze:
        opt = bnbf_nn.AdamW8bit(emb.parameters())
        emb(torch.tensor([1, 2])).square().sum().backward()
        opt.step()
        assert type(opt.state[emb.weight]["state"]).layout.bits == 32


def test_stable_embedding_keeps_the_weight_dtype():
    emb = bnbf_nn.StableEmbedding(50, 8, dtype=torch.bfloat16)
    assert emb(torch.tensor([1, 2])).dtype == torch.bfloat16


def test_skip_zeros_leaves_rows_not_looked_up():
    torch.manual_seed(0)
    emb = bnbf_nn.StableEmbedding(300, 16)
    opt = bnbf_nn.AdamW8bit(emb.parameters(), lr=1e-2, weight_decay=0.1, skip_zeros=True)
    before = emb.weight.detach().clone()
    for _ in range(2):
        opt.zero_grad()
        emb(torch.tensor([3, 4, 200])).square().sum().backward()
        opt.step()
    changed = (emb.weight != before).any(dim=1).nonzero().flatten().tolist()
    assert changed == [3, 4, 200]


def test_module_overrides_are_held_weakly():
    mng = bnbf_nn.GlobalOptimManager.get_instance()
    emb = bnbf_nn.Embedding(10, 4)
    assert len(mng._modules) == 1
    del emb
    gc.collect()
    mng.configs_for([])
    assert mng._modules == []


def test_bad_override_leaves_every_param_unstepped():
    """An override that bnbf rejects fails the step before any bucket of the group has run."""
    params = make_params()
    opt = bnbf_nn.AdamW8bit(params, lr=1e-3, min_8bit_size=MIN8)
    for p, g in zip(params, make_grads(params, 1)[0]):
        p.grad = g
    opt.step()
    bnbf_nn.GlobalOptimManager.get_instance().override_config(params[-1], "lr", -1.0)
    before = [p.detach().clone() for p in params]
    states = {id(p): [t.clone() for t in opt.state[p]["state"]] for p in params}
    with pytest.raises(ValueError, match="Invalid learning rate"):
        opt.step()
    for p, b in zip(params, before):
        assert torch.equal(p.detach(), b)
        assert opt.state[p]["step"] == 1
        assert all(torch.equal(a, c) for a, c in zip(opt.state[p]["state"], states[id(p)]))


def test_override_config_with_a_non_tensor_changes_nothing():
    mng = bnbf_nn.GlobalOptimManager.get_instance()
    a = torch.nn.Parameter(torch.zeros(3))
    version = mng.version
    with pytest.raises(TypeError, match="override_config takes tensors"):
        mng.override_config([a, "not a tensor"], "lr", 1e-4)
    assert mng.configs_for([a]) == {} and mng.version == version


@pytest.mark.parametrize(
    "cls,kw,exc,match",
    [
        (bnbf_nn.AdamW8bit, {"max_unorm": -1.0}, ValueError, "Invalid max_unorm value"),
        (bnbf_nn.AdamW8bit, {"skip_zeros": "yes"}, TypeError, "skip_zeros must be a bool"),
        (bnbf_nn.AdamW8bit, {"max_unorm": "1"}, TypeError, "max_unorm must be a number or a 1-element tensor"),
    ],
)
def test_bad_call_settings_fail_at_construction(cls, kw, exc, match):
    with pytest.raises(exc, match=match):
        cls(make_params(), lr=1e-3, **kw)


@pytest.mark.parametrize("value", ["1", None])
@pytest.mark.parametrize("where", ["group", "override"])
def test_a_max_unorm_of_another_type_is_named_before_any_group_steps(where, value):
    """A second group's (or a manager override's) max_unorm="1" failed a bare comparison inside the step (None: a
    float() of the core's): refused naming max_unorm, before the first group stepped. A None override overrides
    nothing (bitsandbytes skips it), so the step runs."""
    params = make_params()
    opt = bnbf_nn.AdamW8bit([{"params": params[:1]}, {"params": params[1:]}], lr=1e-2, min_8bit_size=MIN8)
    run_adapter(opt, params, make_grads(params, 1))
    if where == "group":
        opt.param_groups[1]["max_unorm"] = value
    else:
        bnbf_nn.GlobalOptimManager.get_instance().override_config(params[2], "max_unorm", value)
    for p, g in zip(params, make_grads(params, 1, seed=2)[0]):
        p.grad = g
    before = [p.detach().clone() for p in params], copy.deepcopy([dict(opt.state[p]) for p in params])
    if where == "override" and value is None:
        opt.step()
        assert all(opt.state[p]["step"] == 2 for p in params)
        return
    match = rf"^max_unorm must be a number or a 1-element tensor, got {type(value).__name__}\n\(in param group 1 "
    with pytest.raises(TypeError, match=match):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(params, before[0]))
    for p, rec in zip(params, before[1]):
        assert opt.state[p]["step"] == rec["step"] == 1
        assert all(torch.equal(a, b) for a, b in zip(opt.state[p]["state"], rec["state"]))


def test_lamb_group_with_max_unorm_fails_at_construction():
    with pytest.raises(ValueError, match="max_unorm does not combine with lamb"):
        bnbf_nn.LAMB8bit([{"params": make_params(), "max_unorm": 0.5}], lr=1e-3)


class _BnbManager:
    """bitsandbytes' GlobalOptimManager as bitsandbytes 0.50 keeps it: per-parameter overrides keyed by id(p),
    module overrides as (module, attribute, config) triples."""

    _instance = None

    def __init__(self):
        self.pid2config, self.index2config, self.module_weight_config_triple = {}, {}, []


@pytest.fixture
def bnb_manager(monkeypatch):
    """A stand-in for bitsandbytes' manager where bitsandbytes is not installed (CI), the real one where it is."""
    try:
        from bitsandbytes.optim.optimizer import GlobalOptimManager
    except ImportError:
        import types

        module = types.ModuleType("bitsandbytes.optim.optimizer")
        module.GlobalOptimManager = _BnbManager
        monkeypatch.setitem(__import__("sys").modules, "bitsandbytes.optim.optimizer", module)
        monkeypatch.setattr(_BnbManager, "_instance", _BnbManager())
        yield _BnbManager._instance
        return
    mng = GlobalOptimManager.get_instance()
    mng.initialize()
    yield mng
    mng.initialize()


def test_bitsandbytes_manager_overrides_count(bnb_manager):
    """A model that keeps bitsandbytes' layers (StableEmbedding registers optim_bits=32 with bitsandbytes' own
    manager) gets the same state from bnbf_nn as from bitsandbytes: its module and per-parameter overrides
    apply, below bnbf_nn's own, and one made after a step applies from the next step."""
    model, twin = MyModel(), MyModel()
    twin.load_state_dict(model.state_dict())
    bnb_manager.module_weight_config_triple.append((model.fc1, "weight", {"optim_bits": 32}))
    bnb_manager.pid2config[id(model.fc2.weight)] = {"optim_bits": 32, "eps": 1e-3}
    bnbf_nn.GlobalOptimManager.get_instance().override_config(model.fc2.weight, "eps", 1e-2)
    opt = bnbf_nn.AdamW8bit(model.parameters(), min_8bit_size=0)
    grads = make_grads(list(model.parameters()), 2)
    run_adapter(opt, list(model.parameters()), grads[:1])
    assert opt.state[model.fc1.weight]["state1"].dtype == torch.float32
    assert opt.state[model.fc2.weight]["state1"].dtype == torch.float32
    assert opt.state[model.fc2.bias]["state1"].dtype == torch.uint8  # not overridden: 8-bit
    configs = bnbf_nn.GlobalOptimManager.get_instance().configs_for([model.fc2.weight])
    assert configs[id(model.fc2.weight)] == {"optim_bits": 32, "eps": 1e-2}  # bnbf_nn's own wins
    # an override made after a step, through bitsandbytes' manager (the cached plans see it), against the same
    # override through bnbf_nn's, on a twin without the others
    ref = bnbf_nn.AdamW8bit(twin.parameters(), min_8bit_size=0)
    run_adapter(ref, list(twin.parameters()), grads[:1])
    bnb_manager.pid2config[id(model.fc2.bias)] = {"weight_decay": 0.5}
    bnbf_nn.GlobalOptimManager.get_instance().override_config(twin.fc2.bias, "weight_decay", 0.5)
    run_adapter(opt, list(model.parameters()), grads[1:])
    run_adapter(ref, list(twin.parameters()), grads[1:])
    assert torch.equal(model.fc2.bias.detach(), twin.fc2.bias.detach())
    assert not torch.equal(model.fc2.weight.detach(), twin.fc2.weight.detach())  # twin: 8-bit, eps 1e-8


@pytest.mark.parametrize(
    "key, value, exc",
    [("bias_correction", False, ValueError), ("lr", -1.0, ValueError), ("lr", "1e-3", TypeError)],
    ids=["unknown-key", "negative-lr", "str-lr"],
)
def test_load_state_dict_refuses_an_override_the_step_refuses(key, value, exc):
    """A load with an override of one of the optimizer's params that the next step refuses succeeded, leaving an
    optimizer that could not step. It is refused as the step refuses it, before anything is loaded."""
    params = make_params()
    opt = bnbf_nn.AdamW8bit(params, lr=1e-2, min_8bit_size=MIN8)
    run_adapter(opt, params, make_grads(params, 1))
    saved = copy.deepcopy(opt.state_dict())  # a checkpoint's own tensors (the live ones would mark the state stale)
    mng = bnbf_nn.GlobalOptimManager.get_instance()
    mng.override_config(params[1], key, value)
    state, groups = opt.state, opt.param_groups
    records = {p: rec for p, rec in state.items()}
    settings = [{k: v for k, v in g.items() if k != "params"} for g in groups]
    fresh = bnbf_nn.AdamW8bit(params, lr=1e-2, min_8bit_size=MIN8)
    for target in (opt, fresh):
        with pytest.raises(exc) as refused:
            target.load_state_dict(saved)
    assert opt.state is state and len(state) == len(records) and all(state[p] is r for p, r in records.items())
    assert opt.param_groups is groups and [{k: v for k, v in g.items() if k != "params"} for g in groups] == settings
    assert not fresh.state
    assert mng.configs_for([params[1]]) == {id(params[1]): {key: value}}
    with pytest.raises(exc) as stepped:
        run_adapter(opt, params, make_grads(params, 1))
    assert str(refused.value) == str(stepped.value)

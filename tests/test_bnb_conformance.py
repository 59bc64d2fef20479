"""bnbf_nn as a bitsandbytes user meets it: bitsandbytes' optimizer classes and its optimizer tests' table.

* Every class ``bitsandbytes.optim`` exports (and its three documented bases) exists in ``bnbf_nn`` with
  bitsandbytes' constructor signature: the same positional-or-keyword arguments in the same order with the
  same defaults. bnbf's own arguments are keyword-only after them (:data:`KNOWN` names every other
  difference kept on purpose; today there is none).
* bitsandbytes' optimizer tests, with bnbf_nn in place of bitsandbytes: each class constructed as its test
  table writes it (``Adam8bit(p, block_wise=True)``, ``SGD8bit(p, 0.01, 0.9, block_wise=True)``...) against
  the reference optimizer the table pairs it with (torch.optim, lion_pytorch's Lion, bitsandbytes' own
  reference AdEMAMix); 50 steps; the state read from ``optimizer.state[p]`` by bitsandbytes' names
  (``state1``, ``qmap1``, ``absmax1``...) and, for 8-bit state, dequantized by
  ``bitsandbytes.functional.dequantize_blockwise``; a ``state_dict`` save and load into a new optimizer every
  10 steps, after which the state tensors are equal. 8-bit state: re-synced every step as bitsandbytes'
  test_optimizer8bit does (params rounded into both, our dequantized states into the reference) and held
  to its bar (``tolerances.STATE8``, checked by ``resync``'s param check); 32-bit state: its
  test_optimizer32bit's (``tolerances.STATE32``).

Shapes are small (64 x 65: above the default min_8bit_size of 4096, 17 blocks, the last partial). The
Paged* rows run here too (on the CPU paged state is ordinary memory; tests/test_paged.py covers CUDA).
"""

from __future__ import annotations

import dataclasses
import inspect
import io
from collections.abc import Callable

import pytest
import torch
from optim_table import ROW
from resync import _check_param, sign_ties
from tolerances import STATE8, STATE32, assert_close_report, assert_equal_report, count_outside

import bnbf
import bnbf.paged
import bnbf_nn
from bnbf._dispatch import interpreting

bnb = pytest.importorskip("bitsandbytes")
F = pytest.importorskip("bitsandbytes.functional")

SHAPE = (64, 65)
STEPS = 50
SCHEDULE = 20  # t_alpha and t_beta3 of the scheduled AdEMAMix rows
# (class name, difference) kept on purpose; none today
KNOWN: dict[tuple[str, str], str] = {}


# ---- signatures ---------------------------------------------------------------------------------------------


def bnb_classes() -> list[str]:
    import bitsandbytes.optim as bo

    names = [n for n in dir(bo) if inspect.isclass(getattr(bo, n)) and n != "GlobalOptimManager"]
    return names + ["Optimizer8bit", "Optimizer1State", "Optimizer2State"]


@pytest.mark.parametrize(
    "sub", ["adagrad", "adam", "adamw", "ademamix", "lamb", "lars", "lion", "optimizer", "rmsprop", "sgd"]
)
def test_bitsandbytes_optim_submodules_hold_their_classes(sub):
    """Code written for bitsandbytes names its optim submodules (``issubclass(c, bnb.optim.optimizer.Optimizer2State)``,
    ``from bitsandbytes.optim.adamw import AdamW8bit``): each is here, importable, with the same public classes."""
    import importlib

    theirs = importlib.import_module(f"bitsandbytes.optim.{sub}")
    ours = importlib.import_module(f"bnbf_nn.optim.{sub}")
    assert getattr(bnbf_nn.optim, sub) is ours
    # its own classes and the bitsandbytes classes it imports (adam.py's Optimizer2State); none private
    names = {
        n
        for n, v in vars(theirs).items()
        if inspect.isclass(v) and v.__module__.startswith("bitsandbytes.optim") and not n.startswith("_")
    }
    assert names == set(vars(ours)) - {"__name__", "__doc__", "__package__", "__loader__", "__spec__"}
    for n in names:
        assert getattr(ours, n) is getattr(bnbf_nn.optim, n), n


@pytest.mark.parametrize("name", bnb_classes())
def test_every_bitsandbytes_class_with_its_signature(name):
    import bitsandbytes.optim as bo
    import bitsandbytes.optim.optimizer as bopt

    theirs_cls = getattr(bo, name, None) or getattr(bopt, name)
    ours_cls = getattr(bnbf_nn, name, None)
    assert ours_cls is not None, f"bnbf_nn lacks bitsandbytes' {name}"
    assert getattr(bnbf_nn.optim, name) is ours_cls  # bnb.optim.X with `import bnbf_nn as bnb`
    base = name.startswith("Optimizer")
    theirs = [p for k, p in inspect.signature(theirs_cls.__init__).parameters.items() if k != "self"]
    ours = [
        p
        for k, p in inspect.signature(ours_cls.__init__ if base else ours_cls).parameters.items()
        if k != "self" and p.kind != p.KEYWORD_ONLY
    ]
    want = [(p.name, p.default) for p in theirs]
    got = [(p.name, p.default) for p in ours]
    if (name, "signature") not in KNOWN:
        assert [n for n, _ in got] == [n for n, _ in want], f"{name}: positional {got} != bitsandbytes' {want}"
        for (n, a), (_, b) in zip(got, want):
            assert a == b and type(a) is type(b) or (a == b and {type(a), type(b)} <= {int, float}), (
                f"{name}({n}=...): default {a!r} != bitsandbytes' {b!r}"
            )
    assert all(p.kind == p.POSITIONAL_OR_KEYWORD for p in ours), f"{name}: only keyword-only extras"


# ---- the test table -----------------------------------------------------------------------------------------


def _lion(ps):
    from lion_pytorch import Lion

    return Lion(ps)


def _ademamix(**kw):
    def make(ps):
        from bitsandbytes.optim.ademamix import _ReferenceAdEMAMix

        return _ReferenceAdEMAMix(ps, **kw)

    return make


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str  # bitsandbytes' class
    ref: Callable  # params -> the reference optimizer
    ours: Callable  # params -> ours, as the table writes it
    states: tuple[tuple[str, int], ...]  # (the reference's state name, k of our state{k})
    row: str  # optim_table row for resync's checks (its bf16 flag, sign ties)
    lr: float


_ADAM_STATES = (("exp_avg", 1), ("exp_avg_sq", 2))
_SCHED = dict(t_alpha=SCHEDULE, t_beta3=SCHEDULE)


def _table() -> list[Entry]:
    """bitsandbytes' table, for every X, X8bit, X32bit and Paged* class of its tested families."""
    out = []
    fams = [  # family, reference, positional arguments the table passes, states, row, lr
        ("Adam", lambda ps: torch.optim.Adam(ps), (), _ADAM_STATES, "adam", 1e-3, {}),
        ("AdamW", lambda ps: torch.optim.AdamW(ps), (), _ADAM_STATES, "adamw", 1e-3, {}),
        ("Lion", _lion, (), (("exp_avg", 1),), "lion", 1e-4, {}),
        (
            "SGD",
            lambda ps: torch.optim.SGD(ps, 0.01, 0.9),
            (0.01, 0.9),
            (("momentum_buffer", 1),),
            "sgd-momentum",
            0.01,
            {},
        ),
        (
            "RMSprop",
            lambda ps: torch.optim.RMSprop(ps, 0.01, 0.9),
            (0.01, 0.9),
            (("square_avg", 1),),
            "rmsprop-plain",
            0.01,
            {},
        ),
        ("AdEMAMix", _ademamix(), (), (("m1_m2", 1), ("nu", 2)), "ademamix", 1e-3, {}),
        ("AdEMAMix", _ademamix(**_SCHED), (), (("m1_m2", 1), ("nu", 2)), "ademamix", 1e-3, _SCHED),
    ]
    for fam, ref, args, states, row, lr, kw in fams:
        paged = ("", "Paged") if getattr(bnbf_nn, "Paged" + fam, None) is not None else ("",)
        for prefix in paged:
            for bits in ("", "8bit", "32bit"):
                name = prefix + fam + bits
                extra = {"block_wise": True} if bits == "8bit" and fam != "AdEMAMix" else {}
                cls = getattr(bnbf_nn, name)

                def ours(ps, cls=cls, args=args, kw={**kw, **extra}):  # noqa: B006 (read only)
                    return cls(ps, *args, **kw)

                label = name + ("_scheduled" if kw else "")
                out.append(Entry(label, ref, ours, states, row, lr))
    return out


TABLE = _table()
EIGHT = [e for e in TABLE if "8bit" in e.name]
THIRTY_TWO = [e for e in TABLE if "8bit" not in e.name]
# interpreter pass (the Triton kernels in the interpreter, ~0.4 s a step at this size): Adam8bit at fp32 for
# 11 steps (one save and load); every row, dtype and all 50 steps run in the plain pass and on CUDA
INTERP = {"Adam8bit"}
INTERP_STEPS = 11


def _skip(entry: Entry, dtype, device) -> None:
    if device == "cpu" and entry.name.startswith("Paged"):
        pytest.skip("on the CPU a Paged* class is its unpaged class (test_nn_optim checks it bit for bit)")
    if interpreting() and (entry.name not in INTERP or dtype != torch.float32):
        pytest.skip("interpreter pass: a few classes at fp32 (every row in the plain pass)")


def _start(device, dtype, shape=SHAPE):
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter((torch.randn(shape, generator=g) * 0.1).to(device, dtype))
    p_ref = torch.nn.Parameter(p.detach().float().clone())
    return p, p_ref, g


def _dequantized(rec: dict, k: int) -> torch.Tensor:
    """bitsandbytes' reading of our state{k}: through its dequantizer where the state is 8-bit."""
    s = rec[f"state{k}"]
    if s.dtype != torch.uint8:
        return s
    code, absmax = rec[f"qmap{k}"], rec[f"absmax{k}"]
    if absmax.dim() == 2:  # AdEMAMix's stacked first moments: row by row, as bitsandbytes' test does
        return torch.stack(
            [F.dequantize_blockwise(A=s[i], absmax=absmax[i], code=code, blocksize=256) for i in range(s.shape[0])]
        )
    return F.dequantize_blockwise(A=s, absmax=absmax, code=code, blocksize=256)


def _reload(entry: Entry, opt, p, what: str):
    """A new optimizer loaded from ``opt``'s saved state dict; its state tensors equal ``opt``'s."""
    before = {k: v.clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
    step = opt.state[p]["step"]
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    new = entry.ours([p])
    new.load_state_dict(torch.load(buf, weights_only=True))
    after = new.state[p]
    assert after["step"] == step
    assert set(k for k, v in after.items() if isinstance(v, torch.Tensor)) == set(before)
    for k, v in before.items():
        assert_equal_report(after[k], v, f"{what}: {k} after load_state_dict")
    return new


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("entry", EIGHT, ids=lambda e: e.name)
def test_optimizer8bit(entry, dtype, device):
    _skip(entry, dtype, device)
    run_optimizer8bit(entry, dtype, device, SHAPE)


PAGED_SHAPE = (1024, 130)  # above bitsandbytes' (and bnbf's) paging threshold of 100k elements


@pytest.mark.gpu
@pytest.mark.parametrize("entry", [e for e in EIGHT if e.name.startswith("Paged")], ids=lambda e: e.name)
def test_paged_optimizer8bit_in_managed_memory(entry):
    """The Paged* rows at a size that pages: the state is CUDA managed memory (asked of the driver) and
    passes the same checks."""
    opt = run_optimizer8bit(entry, torch.float32, "cuda", PAGED_SHAPE)
    p = opt.param_groups[0]["params"][0]
    assert all(bnbf.paged.is_managed(t) for t in opt.state[p]["state"])


def run_optimizer8bit(entry: Entry, dtype, device, shape):
    """bitsandbytes' test_optimizer8bit on one table entry; returns the last optimizer."""
    row = ROW[entry.row]
    bar = STATE8[(dtype, 8)]
    p, p_ref, g = _start(device, dtype, shape)
    ref, opt = entry.ref([p_ref]), entry.ours([p])
    hp = {"betas": ref.param_groups[0].get("betas")}
    for i in range(INTERP_STEPS if interpreting() else STEPS):
        what = f"{entry.name} {dtype} step {i + 1}"
        grad = (torch.randn(shape, generator=g) * 0.01).to(device, dtype)
        ties = sign_ties(hp, ref.state[p_ref].get("exp_avg"), grad) if row.sign_step else None
        p_ref.grad, p.grad = grad.float(), grad.clone()
        opt.step()
        ref.step()
        _check_param(row, bar, p.detach().float(), p_ref.detach(), dtype, ties, entry.lr, what)
        rec = opt.state[p]
        assert rec["state1"].dtype == torch.uint8, f"{what}: the table's 8-bit classes keep 8-bit state"
        ours_deq = bnbf.dequantize_state(rec["state"])
        deq = {}
        for theirs, k in entry.states:
            s = _dequantized(rec, k)
            # bitsandbytes' reading of the views is bnbf's reading of its own state
            names = [n for n in ours_deq if n in _slot_names(opt, rec["state"], k)]
            mine = torch.stack([ours_deq[n] for n in names]) if s.dim() > p.dim() else ours_deq[names[0]]
            assert_equal_report(s, mine, f"{what}: state{k} through bitsandbytes' dequantizer")
            outside = count_outside(s, ref.state[p_ref][theirs], bar.atol, bar.rtol)
            if outside >= bar.max_outside:
                assert_close_report(s, ref.state[p_ref][theirs], bar.atol, bar.rtol, f"{what}: {theirs}")
            deq[theirs] = s
        if i % 10 == 0 and i > 0:
            opt = _reload(entry, opt, p, what)
            for theirs, k in entry.states:
                assert_equal_report(_dequantized(opt.state[p], k), deq[theirs], f"{what}: {theirs} reloaded")
        # re-sync as bitsandbytes' test: the reference's params rounded to the param dtype into both, and
        # our dequantized states into the reference
        with torch.no_grad():
            p_ref.copy_(p_ref.to(dtype).float())
            p.copy_(p_ref)
            for theirs, s in deq.items():
                ref.state[p_ref][theirs].copy_(s)
    return opt


def _slot_names(opt, state, k: int) -> list[str]:
    """The bnbf state slots bitsandbytes' state{k} holds."""
    stacks = type(opt).family.bnb_slots
    rule = bnbf.RULES[type(state).layout.rule]
    slots = stacks[k - 1] if stacks else (k - 1,)
    return [rule.states[j].name for j in slots]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("entry", THIRTY_TWO, ids=lambda e: e.name)
def test_optimizer32bit(entry, dtype, device):
    """bitsandbytes' test_optimizer32bit: states compared directly each step, params within atol/rtol but
    for at most 10 elements, params re-synced (rounded to the param dtype) each step, states not."""
    _skip(entry, dtype, device)
    bar = STATE32[(dtype, 32)]
    p, p_ref, g = _start(device, dtype)
    ref, opt = entry.ref([p_ref]), entry.ours([p])
    for i in range(STEPS):
        what = f"{entry.name} {dtype} step {i + 1}"
        grad = (torch.randn(SHAPE, generator=g) * 0.01).to(device, dtype)
        p_ref.grad, p.grad = grad.float(), grad.clone()
        opt.step()
        ref.step()
        for theirs, k in entry.states:
            s = opt.state[p][f"state{k}"]
            assert s.dtype == torch.float32, f"{what}: 32-bit state"
            assert_close_report(s, ref.state[p_ref][theirs], bar.atol, bar.rtol, f"{what}: {theirs}")
        outside = count_outside(p.detach().float(), p_ref.detach(), bar.atol, bar.rtol)
        if outside > 10:
            assert_close_report(p.detach().float(), p_ref.detach(), bar.atol, bar.rtol, f"{what}: params")
        if i % 10 == 0 and i > 0:
            opt = _reload(entry, opt, p, what)
        with torch.no_grad():
            p_ref.copy_(p_ref.to(dtype).float())
            p.copy_(p_ref)


@pytest.mark.surface
@pytest.mark.parametrize("name", ["RMSprop8bit", "Adagrad8bit"])
def test_bitsandbytes_signed_map_checkpoints_of_nonnegative_state_are_refused(name):
    """bitsandbytes quantizes RMSprop's and Adagrad's non-negative state with its signed map, whose codes bnbf's
    unsigned state cannot take: load_state_dict raises, naming the map, and changes nothing."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, 80))
    theirs = getattr(bnb.optim, name)([p], lr=1e-3)
    p.grad = torch.randn_like(p)
    theirs.step()
    q = torch.nn.Parameter(p.detach().clone())
    q.grad = torch.randn_like(q)
    ours = getattr(bnbf_nn, name)([q], lr=1e-3)
    ours.step()
    before = {k: v.clone() for k, v in ours.state[q].items() if isinstance(v, torch.Tensor)}
    with pytest.raises(ValueError, match="signed dynamic map"):
        ours.load_state_dict(theirs.state_dict())
    assert all(torch.equal(ours.state[q][k], v) for k, v in before.items())
    assert ours.state[q]["step"] == 1

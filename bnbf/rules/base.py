"""What a rule module provides, and the hyperparameter checks shared by the rules.

A rule is one file in ``bnbf/rules/`` that defines:

- its hyperparameter dataclass (frozen, keyword-only, validated in ``__post_init__`` with torch's wording);
- its state slots, any number of them (name as torch.optim calls it, which map it uses when quantized);
- its scalars: a NamedTuple class naming the per-call numbers the math needs (at most 14), and
  ``scalars(hparams, step)``, which returns one, derived once per call on the host (passed as kernel
  arguments, or with tensor ops on the device into a float32 row when hyperparameters are tensors);
- ``math``: a ``@triton.jit`` function ``(p, g, s, hp, nrm) -> (p, s)`` on float32 values: ``s`` is a
  tuple with one value per state slot (the scalar 0.0 for a slot this state does not keep: 0-d, where a kept slot
  is a tile, so ``len(x.shape) == 0`` tells a slot not kept when the kernel compiles), ``hp`` the
  tuple of the rule's scalars, which the math names first thing (``h = AdamScalars(*hp)``; ``h.b1``),
  and for rules with ``norms``, ``nrm`` the tensor's three sums (float32 scalars, ``nrm[k]``);
- ``reference``: the same math in plain torch (the CPU path and the kernels' oracle); it receives the
  scalars as the rule's NamedTuple (0-d tensors) and a list with one float32 tensor per state slot,
  ``None`` for slots this state does not keep, and returns the new param and such a list;
- optionally ``norms``: a pair (``@triton.jit`` fn, torch fn) of ``(p, g, s, hp) -> (a, b, c)``,
  elementwise terms whose per-tensor sums the math needs (LAMB: ||p||², ||adam step||²); the kernel then
  runs a norm pass first (one launch for all tensors), and the reference passes the sums to
  ``reference(p, g, states, scalars, sums)``;
- optionally ``norm_grad_powers``: for a rule with ``norms`` whose first two terms scale as powers of the
  grads' scale (LARS: ||p||² as c⁰, ||g||² as c²) and whose third term is unused, those two powers. Gradient
  clipping (``update(..., max_grad_norm=)``) is then folded into the norm pass when every leaf of a call has
  them: the pass sums every grad's squares in the third term, the total norm comes from those sums and the
  first two sums are scaled by the coefficient's powers, so clipping costs no read of its own;
- optionally ``export``: maps the dequantized slots to torch.optim's state where a rule stores a
  transformed quantity (centered RMSprop keeps the variance);
- optionally ``present(hparams)``: which slots a state keeps (e.g. no momentum buffer when momentum is
  0), and ``initial(hparams)``: the slots' initial values (zeros by default).

Registering it is one row in :data:`bnbf.rules.RULES`; a rule made at run time is registered with
:func:`bnbf.rules.register_rule`, which checks it first (:func:`validate_rule`).
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import math
import operator
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from bnbf._bounded import Bounded

Number = float | int | Tensor


@dataclasses.dataclass(frozen=True)
class StateSlot:
    """One optimizer state tensor of a rule."""

    name: str  # torch.optim's name for it, e.g. "exp_avg"
    signed: bool  # quantized with the signed map (True) or the unsigned map for non-negative values
    # for an optional slot: settings, as (field, value) pairs, under which the rule keeps it without changing any
    # slot's initial value. bnbf_nn makes a state from them that keeps a slot its settings no longer step (a
    # momentum buffer after momentum was switched off, as torch.optim keeps it)
    kept_by: tuple[tuple[str, Any], ...] = ()


@dataclasses.dataclass(frozen=True)
class Rule:
    name: str
    hparams: type
    states: tuple[StateSlot, ...]
    scalar_names: type  # the NamedTuple class of the rule's scalars
    scalars: Callable[[Any, Number], tuple]  # (hparams, step) -> scalar_names(...)
    math: Any  # triton.JITFunction
    reference: Callable[[Tensor, Tensor, list[Tensor | None], Any], tuple[Tensor, list[Tensor | None]]]
    present: Callable[[Any], tuple[bool, ...]] | None = None
    initial: Callable[[Any], tuple[float, ...]] | None = None
    norms: tuple[Any, Callable] | None = None
    export: Callable[[dict], dict] | None = None  # stored slots -> torch.optim's state (dequantize_state)
    # grads times c multiply norm term k's sum by c**norm_grad_powers[k] (k = 0, 1), and term 2 is unused: then
    # gradient clipping takes its total norm from the norm pass (None: the terms are not so, e.g. LAMB's Adam step)
    norm_grad_powers: tuple[int, int] | None = None

    @property
    def signed_mask(self) -> int:
        """Bit j set when state slot j is quantized with the signed map (the kernel's SIGNED)."""
        return sum(1 << j for j, slot in enumerate(self.states) if slot.signed)

    def slots_present(self, hparams: Any) -> tuple[bool, ...]:
        return (True,) * len(self.states) if self.present is None else tuple(self.present(hparams))

    def initial_values(self, hparams: Any) -> tuple[float, ...]:
        return (0.0,) * len(self.states) if self.initial is None else tuple(self.initial(hparams))

    def make_hparams(self, hparams: Any) -> Any:
        """Validated hyperparameter dataclass from a mapping, a dataclass of this rule, or None."""
        if hparams is None:
            return self.hparams()
        if type(hparams) is self.hparams:  # exact: AdamW's and LAMB's hparams subclass Adam's
            return hparams
        if type(hparams) is dict:
            # the very value objects of this rule's last dict of plain numbers, under the same keys: its result
            # (an object is its type and value; numbers and tuples of them cannot change in place)
            last = _LAST.get(self.hparams)
            if last is not None and tuple(hparams) == last[0] and all(map(operator.is_, hparams.values(), last[1])):
                return last[2]
            # a dict of plain numbers (the usual call, every step) validates once; never keyed by tensors,
            # whose equality would read their values
            if all(map(_is_plain, hparams.values())):
                try:
                    key = (self.hparams, *hparams.items(), *_exact(hparams.values()))
                except OverflowError:  # an int beyond float64 has no float sign: validated (refused) uncached
                    return self._make_hparams(hparams)
                hit = _HPARAMS.get(key)
                if hit is None:  # e.g. a schedule's new lr every step
                    hit = _HPARAMS.put(key, self._make_hparams(hparams))
                _LAST[self.hparams] = (tuple(hparams), tuple(hparams.values()), hit)
                return hit
        return self._make_hparams(hparams)

    def _make_hparams(self, hparams: Any) -> Any:
        if dataclasses.is_dataclass(hparams):
            raise ValueError(
                f"hparams of type {type(hparams).__name__} do not belong to rule {self.name!r} "
                f"(expected {self.hparams.__name__} or a mapping)"
            )
        try:
            items = dict(hparams)
        except (TypeError, ValueError):
            raise TypeError(f"hparams must be a mapping or {self.hparams.__name__}, got {type(hparams)}") from None
        known = {f.name for f in dataclasses.fields(self.hparams)}
        unknown = sorted(set(items) - known)
        if unknown:
            raise ValueError(f"unknown hyperparameters for rule {self.name!r}: {unknown}; known: {sorted(known)}")
        return self.hparams(**items)


# keyed by the rule's hparams class, what the result depends on (not its name: a name deleted from the registry may
# be registered again for another class)
_HPARAMS = Bounded(256)  # (hparams class, *items) -> validated hparams, for dicts of plain numbers
_LAST: dict = {}  # hparams class -> (keys, values, validated hparams) of its last dict of plain numbers
# bools too (amsgrad, nesterov, centered): a group's dict holds them every step. True keys like 1: a flag given
# as 1 after True was cached is taken as True (torch takes any truthy flag), not refused as a non-bool
_PLAIN = (float, int, bool)


def _exact(values: Any) -> tuple:
    """What ``==`` of two dicts' values misses: the types (``True`` is ``1``, ``1`` is ``1.0``) and the signs of
    zeros (``-0.0`` is ``0.0``), which a rule may treat differently."""
    types = tuple(map(type, values))
    if tuple not in types:
        return types, tuple(map(math.copysign, _ONES, values))
    return types, tuple(
        tuple(map(math.copysign, _ONES, v)) if type(v) is tuple else math.copysign(1.0, v) for v in values
    )


_ONES = itertools.repeat(1.0)


def _is_plain(v: Any) -> bool:
    return type(v) in _PLAIN or (type(v) is tuple and all(type(x) in _PLAIN for x in v))


# ---- checks with torch.optim's wording ----------------------------------------------------------------

_F32_MAX = float(torch.finfo(torch.float32).max)  # the kernels take hyperparameters as float32


def _value(x: Number, name: str = "hyperparameters") -> float | None:
    """The number to check, or None where reading it would synchronise with a device."""
    if isinstance(x, Tensor):
        if x.numel() != 1:
            raise ValueError(f"Tensor {name} must be 1-element")  # torch's wording ("Tensor lr must be ...")
        if x.is_complex() or x.dtype == torch.bool:
            raise TypeError(f"{name} must be a real number, got a {x.dtype} tensor")
        if x.device.type != "cpu" or _batched(x):  # under vmap: a value per member, which item() cannot read
            return None
        return float(x.detach())  # a differentiable lr's value, read without torch's "requires_grad" warning
    if isinstance(x, (str, bytes)):  # float() would parse "1e-3" (a YAML config's lr), which the step cannot use
        raise TypeError(f"{name} must be a number or a 1-element tensor, got {type(x).__name__} {x!r}")
    try:
        return float(x)
    except OverflowError:  # an int beyond float64: as unusable as inf
        return math.inf
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number or a 1-element tensor, got {type(x).__name__}") from None


def members(t: Tensor) -> Tensor | None:
    """Every member's value of a tensor under vmap (the plain tensor below vmap's wrappers), or None where they are
    on a device (reading them would synchronize, as an eager device tensor's value is not read) or another
    transform wraps them."""
    while torch._C._functorch.is_batchedtensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t if t.device.type == "cpu" and not torch._C._functorch.is_functorch_wrapped_tensor(t) else None


def member_values(x: Any) -> list[float]:
    """The values of :func:`members` of a tensor vmap batches, as numbers; nothing for anything else."""
    u = members(x) if isinstance(x, Tensor) and torch._C._functorch.is_batchedtensor(x) else None
    if u is None:
        return []
    with torch._C._DisableFuncTorch():
        return u.detach().reshape(-1).tolist()


def _batched(x: Tensor) -> bool:
    """Whether vmap batches ``x`` at some level of torch.func's wrappers (a grad wrapper may hold a batched tensor)."""
    while not torch._C._functorch.is_batchedtensor(x):
        if not torch._C._functorch.is_functorch_wrapped_tensor(x):
            return False
        x = torch._C._functorch.get_unwrapped(x)
    return True


def finite(v: float | None) -> bool:
    """True for a number float32 holds as a finite value (None, an unread device value, passes): NaN, inf
    and values that overflow float32 (lr=1e39) would reach the kernels as NaN or inf."""
    return v is None or abs(v) <= _F32_MAX


def check_finite(x: Number, name: str) -> None:
    """``Invalid <name> value: <x>`` for NaN, inf or a float32 overflow (where torch has no wording)."""
    if not finite(_value(x, name)):
        raise ValueError(f"Invalid {name} value: {x}")


def check_nonneg(x: Number, name: str) -> None:
    """torch's ``if not 0.0 <= x: raise ValueError(f"Invalid {name} value: {x}")``, finite too; under vmap each
    member's value of a CPU tensor (a negative ``max_grad_norm`` would flip that member's grads)."""
    v = _value(x, name)
    if v is not None and not (v >= 0.0 and finite(v)):
        raise ValueError(f"Invalid {name} value: {x}")
    for m in member_values(x):
        if not (m >= 0.0 and finite(m)):
            raise ValueError(f"Invalid {name} value: {m}")


def start_value(x: Number, name: str) -> float:
    """A hyperparameter's value that a state starts from (``initial``: Adagrad's initial_accumulator_value), read
    once when the state is made; a meta tensor has none (``float()`` raised torch's "Tensor.item() cannot be called
    on meta tensors", naming nothing)."""
    if isinstance(x, Tensor) and x.device.type == "meta":
        raise no_value(name, "start the state from")
    return float(x)


def no_value(name: str, use: str = "step with") -> ValueError:
    """The error for a meta tensor whose value is needed (a step's, a hyperparameter's, a state's starting value)."""
    return ValueError(f"{name} is a meta tensor: it has no value to {use}")


def check_lr(lr: Number) -> None:
    v = _value(lr, "lr")
    if v is not None and not (v >= 0.0 and finite(v)):
        raise ValueError(f"Invalid learning rate: {lr}")


def check_eps(eps: Number, name: str = "epsilon") -> None:
    check_nonneg(eps, name)


def check_weight_decay(wd: Number) -> None:
    check_nonneg(wd, "weight_decay")


def check_momentum(momentum: Number) -> None:
    check_nonneg(momentum, "momentum")  # NaN too: torch's RMSprop refuses it in these words (its SGD lets it by)


_COUNTS = {2: "a pair", 3: "a triple (beta1, beta2, beta3)"}


def check_betas_of(hparams: Any, count: int) -> None:
    """Checks ``hparams.betas`` (a frozen dataclass's): ``count`` of them, each in [0, 1); a list (a JSON or YAML
    config's) made a tuple, where the checks for tensors that require grad, and their widening under
    ``differentiable=True``, look."""
    betas = hparams.betas
    if type(betas) is list:
        betas = tuple(betas)
        object.__setattr__(hparams, "betas", betas)
    if len(betas) != count:
        raise ValueError(f"betas must be {_COUNTS[count]}, got {betas}")
    check_betas(betas)


def check_betas(betas: Sequence[Number]) -> None:
    """Each beta in [0, 1) (a rule's own hparams class calls it too)."""
    for i, b in enumerate(betas):
        v = _value(b, f"betas[{i}]")
        if v is not None and not 0.0 <= v < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {b}")


def type_name(x: Any) -> str:
    """``x``'s type as an error names it: with its module where it is not a builtin (numpy 2 calls its bool
    ``bool``, so "must be a bool, got bool" said nothing)."""
    t = type(x)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def check_flag(x: Any, name: str) -> None:
    """A structural switch (amsgrad, nesterov, centered...) must be a bool: it decides which states exist."""
    if not isinstance(x, bool):
        raise TypeError(f"{name} must be a bool, got {type_name(x)}")


def norm_of(sum_sq: Tensor) -> Tensor:
    """``sum_sq.sqrt()`` whose derivative at 0 is 0, not inf: a torch.where that picks another value where a norm
    is 0 (a zero-initialized bias, a dead layer's gradient) would otherwise turn inf · 0 into NaN meta-gradients."""
    nonzero = sum_sq != 0
    return torch.where(nonzero, torch.where(nonzero, sum_sq, 1).sqrt(), 0)


def as_scalar_row(values: Sequence[Number], device: torch.device) -> Tensor:
    """Pack a rule's scalars into one float32 row on ``device`` without a host synchronisation: the Python
    numbers go up in one copy from pinned memory (a copy from pageable memory, as ``torch.tensor(x,
    device=...)`` makes, waits for the stream), the tensors join them on the device."""
    numbers = torch.tensor([0.0 if isinstance(v, Tensor) else float(v) for v in values], dtype=torch.float32)
    if device.type != "cpu":
        numbers = numbers.pin_memory().to(device, non_blocking=True)
    if not any(isinstance(v, Tensor) for v in values):
        return numbers
    parts = [
        v.to(device=device, dtype=torch.float32).reshape(()) if isinstance(v, Tensor) else numbers[i]
        for i, v in enumerate(values)
    ]
    return torch.stack(parts)


# ---- checks of a rule, at registration -------------------------------------------------------------------------

MAX_RULE_SCALARS = 14  # the kernel takes 18 scalars (h0..h17); the step adds four (see bnbf.plan._scalars)
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")


def _arity(fn: Any, n: int) -> bool:
    """Whether ``fn`` can be called with ``n`` positional arguments (True where Python cannot tell)."""
    try:
        inspect.signature(fn).bind(*range(n))
    except TypeError:
        return False
    except ValueError:  # no signature (some builtins)
        return True
    return True


def _is_triton_fn(fn: Any) -> bool:
    """A ``@triton.jit`` function (compiled, or the interpreter's with ``TRITON_INTERPRET=1``)."""
    return isinstance(getattr(fn, "arg_names", None), list) and hasattr(fn, "fn") and callable(fn.fn)


def validate_rule(rule: Any) -> None:
    """Check what a rule declares, so that a mistake raises here and not inside a kernel at the first step.

    Checks the types and arities of every field (``math(p, g, s, hp, nrm)`` a ``@triton.jit`` function,
    ``reference(p, g, states, scalars[, sums])``, ``scalars(hparams, step)``...), the hyperparameter class
    (a frozen dataclass with ``lr`` whose defaults construct), the state slots (identifiers, unique, at least
    one), the scalars (a NamedTuple of at most 14), ``present``/``initial`` (one value per slot), and runs
    ``scalars`` and ``reference`` once on a 3-element float32 tensor with the default hyperparameters (the math
    itself is compiled at the first step; its arity is checked here).

    Raises:
        TypeError, ValueError: naming the rule and what is wrong.
    """
    if not isinstance(rule, Rule):
        raise TypeError(f"a rule must be a bnbf.rules.Rule, got {type(rule).__name__}")
    name = rule.name
    if not isinstance(name, str) or not _NAME.fullmatch(name) or "_state_" in name:
        raise ValueError(f"rule name must be an identifier (letters, digits, '_'; no '_state_'), got {name!r}")

    def bad(what: str, exc: type = TypeError) -> Exception:
        return exc(f"rule {name!r}: {what}")

    # hyperparameters: a frozen dataclass whose defaults construct (make_hparams(None)) and that has lr (the
    # step passes lr for update clipping)
    hp_cls = rule.hparams
    if not (isinstance(hp_cls, type) and dataclasses.is_dataclass(hp_cls)):
        raise bad(f"hparams must be a dataclass class, got {hp_cls!r}")
    if not hp_cls.__dataclass_params__.frozen:
        raise bad(f"hparams class {hp_cls.__name__} must be frozen (@dataclasses.dataclass(frozen=True, kw_only=True))")
    if "lr" not in {f.name for f in dataclasses.fields(hp_cls)}:
        raise bad(f"hparams class {hp_cls.__name__} needs an lr field")
    try:
        h = hp_cls()
    except Exception as e:
        raise bad(f"hparams class {hp_cls.__name__}() must construct from its defaults: {e}") from e

    # state slots
    slots = rule.states
    if not isinstance(slots, tuple) or not slots or not all(isinstance(s, StateSlot) for s in slots):
        raise bad("states must be a non-empty tuple of StateSlot (a stateless rule keeps a slot with present() False)")
    names = [s.name for s in slots]
    for s in slots:
        if not isinstance(s.name, str) or not s.name.isidentifier() or s.name.startswith("_"):
            raise bad(f"state slot name must be an identifier not starting with '_', got {s.name!r}", ValueError)
        if not isinstance(s.signed, bool):
            raise bad(f"state slot {s.name!r}: signed must be a bool, got {type(s.signed).__name__}")
        kept = s.kept_by
        if not isinstance(kept, tuple) or not all(isinstance(x, tuple) and len(x) == 2 for x in kept):
            raise bad(f"state slot {s.name!r}: kept_by must be a tuple of (field, value) pairs, got {kept!r}")
        if unknown := [k for k, _ in kept if k not in {f.name for f in dataclasses.fields(hp_cls)}]:
            raise bad(f"state slot {s.name!r}: kept_by names {unknown}, not fields of {hp_cls.__name__}", ValueError)
    fields = names + [n + "_absmax" for n in names]
    if len(set(fields)) != len(fields):
        raise bad(f"state slot names collide (each slot also gets '<name>_absmax'): {names}", ValueError)

    # scalars
    sn = rule.scalar_names
    if not (isinstance(sn, type) and issubclass(sn, tuple) and hasattr(sn, "_fields")):
        raise bad(f"scalar_names must be a NamedTuple class, got {sn!r}")
    if not 1 <= len(sn._fields) <= MAX_RULE_SCALARS:
        raise bad(f"{sn.__name__} has {len(sn._fields)} fields; a rule passes 1 to {MAX_RULE_SCALARS}", ValueError)
    if rule.norms is not None:
        if not (isinstance(rule.norms, tuple) and len(rule.norms) == 2):
            raise bad("norms must be a pair (@triton.jit fn, torch fn)")
        if not _is_triton_fn(rule.norms[0]) or len(rule.norms[0].arg_names) != 4:
            raise bad("norms[0] must be a @triton.jit function of (p, g, s, hp)")
        if not callable(rule.norms[1]) or not _arity(rule.norms[1], 4):
            raise bad("norms[1] must be callable with (p, g, states, scalars)")
    powers = rule.norm_grad_powers
    if powers is not None:
        if rule.norms is None:
            raise bad("norm_grad_powers needs norms (the terms it describes)", ValueError)
        ok = isinstance(powers, tuple) and len(powers) == 2
        if not (ok and all(type(k) is int and k >= 0 for k in powers)):
            raise bad(f"norm_grad_powers must be a pair of non-negative ints (norm terms 0 and 1), got {powers!r}")
    for what, fn, n in (("scalars", rule.scalars, 2), ("reference", rule.reference, 5 if rule.norms else 4)):
        if not callable(fn) or not _arity(fn, n):
            raise bad(f"{what} must be callable with {n} positional arguments")
    if not _is_triton_fn(rule.math):
        raise bad(f"math must be a @triton.jit function, got {type(rule.math).__name__}")
    if len(rule.math.arg_names) != 5:
        raise bad(f"math must take (p, g, s, hp, nrm), got ({', '.join(rule.math.arg_names)})")
    for what in ("present", "initial", "export"):
        fn = getattr(rule, what)
        if fn is not None and (not callable(fn) or not _arity(fn, 1)):
            raise bad(f"{what} must be callable with one argument")

    # what the defaults give
    try:
        present = rule.slots_present(h)
        initial = rule.initial_values(h)
    except Exception as e:
        raise bad(f"present/initial failed on the default hyperparameters: {e!r}") from e
    if len(present) != len(slots) or not all(isinstance(x, bool) for x in present):
        raise bad(f"present() must return one bool per state slot ({len(slots)}), got {present!r}", ValueError)
    if len(initial) != len(slots) or not all(isinstance(x, (int, float)) and math.isfinite(x) for x in initial):
        raise bad(f"initial() must return one finite number per state slot ({len(slots)}), got {initial!r}", ValueError)
    for j, s in enumerate(slots):
        if s.kept_by:
            try:
                kept = dataclasses.replace(h, **dict(s.kept_by))
                keeps, kept_initial = rule.slots_present(kept)[j], rule.initial_values(kept)
            except Exception as e:
                raise bad(f"state slot {s.name!r}: the defaults with kept_by {s.kept_by} failed: {e!r}") from e
            if not keeps or kept_initial != initial:
                raise bad(
                    f"state slot {s.name!r}: kept_by {s.kept_by} must keep the slot (present: {keeps}) and leave"
                    f" every initial value as it was ({initial} -> {kept_initial})",
                    ValueError,
                )
    try:
        sc = rule.scalars(h, 1)
    except Exception as e:
        raise bad(f"scalars(default hparams, step=1) failed: {e!r}") from e
    if type(sc) is not sn:
        raise bad(f"scalars() must return a {sn.__name__}, got {type(sc).__name__}")
    _smoke_reference(rule, h, sc, present, initial, bad)


def _smoke_reference(rule: Rule, h: Any, sc: tuple, present: tuple, initial: tuple, bad: Callable) -> None:
    """Run the reference once as the CPU step calls it: scalars as 0-d float32 tensors, float32 states."""
    p = torch.tensor([0.5, -1.0, 2.0])
    g = torch.tensor([0.1, 0.2, -0.3])
    scalars = rule.scalar_names(*(torch.tensor(float(v), dtype=torch.float32) for v in sc))
    states = [torch.full_like(p, float(v)) if keep else None for keep, v in zip(present, initial)]
    try:
        if rule.norms is not None:
            terms = rule.norms[1](p, g, list(states), scalars)
            out = rule.reference(p, g, list(states), scalars, [t.sum() for t in terms])
        else:
            out = rule.reference(p, g, list(states), scalars)
    except Exception as e:
        raise bad(f"reference failed on a 3-element float32 tensor with the default hyperparameters: {e!r}") from e
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise bad("reference must return (new_param, new_states)")
    new_p, new_s = out
    if not isinstance(new_p, Tensor) or new_p.shape != p.shape:
        raise bad("reference's new_param must be a tensor of the param's shape")
    if not isinstance(new_s, (list, tuple)) or len(new_s) != len(rule.states):
        raise bad(f"reference must return one state per slot ({len(rule.states)}), None for slots not kept")
    for slot, keep, s in zip(rule.states, present, new_s):
        if keep and (not isinstance(s, Tensor) or s.shape != p.shape):
            raise bad(f"reference's new state {slot.name!r} must be a tensor of the param's shape, got {s!r}")

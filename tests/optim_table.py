"""The optimizers under test: ONE table, ``ROWS``, with one row per rule variant.

Every property test runs for every row (tests/test_rules.py lists them; the no-recompile test is in
tests/test_no_recompile.py): 32-bit parity with the row's reference, 8-bit re-synced accuracy
(tests/resync.py), non-finite gradient elements, skip_zeros, tensor hyperparameters equal to floats, no
recompile when hyperparameters change, bad hyperparameters refused with the message and nothing written,
max_unorm against a clipped reference (or its refusal), states built for other hyperparameters refused,
min_8bit_size, the reference's defaults, training. Whatever a property needs from a rule lives in its row;
a property a rule cannot have is stated in its row, and the tests then assert the refusal.
``test_rules.test_rows_are_complete`` checks each row's data against its rule.

References are built on float32 copies: torch.optim where torch has the rule, ``lion_pytorch.Lion``,
``torch_optimizer.Lamb``, and plain-torch AdEMAMix, LARS and Adan written below from the papers (Adan's
in float64, with the authors' conventions). Third-party references are imported when a row is used, not
when this table is.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch


class Bad(NamedTuple):
    """A bad override of a row's hyperparameters, the message bnbf refuses it with (a ValueError whose text
    starts with it), and what the row's reference does with the same values: ``"raises"`` the same
    ValueError (the wording is torch's or the peer's own), ``"accepts"`` them (bnbf is stricter, since the
    kernels would turn them into NaN params; or the reference, written here from a paper, checks nothing),
    or ``"asserts"`` (an AssertionError: lion_pytorch's checks)."""

    hparams: dict
    message: str
    reference: str = "raises"


@dataclass(frozen=True)
class Row:
    name: str  # bnbf rule name (a key of bnbf.RULES)
    variant: str  # names the row among its rule's rows ("" for a rule's first); test ids add it
    torch_cls: Callable[..., torch.optim.Optimizer]  # the reference optimizer, built on float32 copies
    hparams: dict  # the row's hyperparameters (bnbf names == the reference's keyword arguments)
    state_names: dict[str, str]  # exactly the states the row keeps: bnbf name -> the reference's state key
    train_lr: float  # learning rate of the small training problem (test_8bit_trains_like_32bit)
    # full hyperparameters a training run may switch to between steps without changing which states exist,
    # including values Triton could specialize on (0, 1, 16): the no-recompile and tensor-hparams tests
    changes: tuple[dict, ...]
    bad: tuple[Bad, ...]  # at least one per row; together a rule's rows cover each of its hyperparameters
    torch_kwargs: dict = field(default_factory=lambda: {"foreach": False})  # passed to torch_cls besides hparams
    weight_decays: tuple[float, ...] = (0.0, 0.01)  # weight decay values the parity tests sweep
    # True: update clipping works (tested against UnormClipped). A string: the rule refuses max_unorm, and
    # says why; the tests assert the refusal
    max_unorm: bool | str = True
    # states the 8-bit re-synced test checks code by code only, not against bitsandbytes' absolute atol
    # 3e-3: written for Adam's moments (the gradient's magnitude, |g| <= ~0.05 there), it is below the
    # rounding of any 256-code format for states larger than ~0.4, such as RMSprop's momentum buffer (a
    # sum of g/sqrt(v), of order 1 to 30)
    code_checked_only: tuple[str, ...] = ()
    # False: the 8-bit re-synced test leaves out bitsandbytes' mean relative error with bf16 params (the
    # per-element bound still applies). It measures the bf16 store's rounding, not the step, and for a
    # nearly constant step (centered RMSprop's first, ±3.3·lr) that is not the uniform 1.35e-3: 1.65e-3
    # against the 1.6e-3 bar at step 1
    bf16_mean_rel: bool = True
    # slots whose stored value is not the reference's state of that name: a function of the reference's
    # states giving it (the 8-bit re-synced test's code-gap check compares stored values)
    stored: dict[str, Callable[[dict], torch.Tensor]] = field(default_factory=dict)
    # True: the step is lr·sign(β1·m + (1 − β1)·g) (Lion): where that input is zero up to float32 rounding,
    # two correct evaluations may step either way, and the 8-bit re-synced test allows a step of lr there
    sign_step: bool = False

    @property
    def id(self) -> str:
        return f"{self.name}-{self.variant}" if self.variant else self.name

    def torch_opt(self, params, **hp) -> torch.optim.Optimizer:
        return self.torch_cls(params, **hp, **self.torch_kwargs)

    def __str__(self) -> str:  # readable test ids
        return self.id


# ------------------------------------------------------------------------------------------------
# references that are not torch.optim classes


def _lion(params, **kw):
    from lion_pytorch import Lion

    return Lion(params, **kw)


def _lamb(params, **kw):
    from torch_optimizer import Lamb

    return Lamb(params, **kw)


class AdEMAMixReference(torch.optim.Optimizer):
    """AdEMAMix from Pagliardini, Ablin and Grangier, "The AdEMAMix Optimizer: Better, Faster, Older"
    (2024), Algorithm 1, written from the paper (not from bnbf):

        m1 = β1·m1 + (1 − β1)·g          m2 = β3(t)·m2 + (1 − β3(t))·g          ν = β2·ν + (1 − β2)·g²
        θ  = θ − η·((m1/(1 − β1^t) + α(t)·m2) / (√(ν/(1 − β2^t)) + ε) + λ·θ)

    with the paper's schedulers: α(t) = min(t·α/T_α, α), and β3(t) a linear warm-up of the EMA's
    half-life f(β) = ln ½ / ln β − 1 from β1 to β3 over T_β3 steps (the authors' scheduler). The paper
    writes β3(t) in closed form, min(exp(ln β1·ln β3 / ((1 − t/T)·ln β3 + (t/T)·ln β1)), β3), which is
    the same function: the half-life form here is a second formulation, so a slip in either shows. The
    defaults are bitsandbytes' AdEMAMix's (the paper gives none)."""

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999, 0.9999),
        alpha=5.0,
        t_alpha=None,
        t_beta3=None,
        eps=1e-8,
        weight_decay=1e-2,
    ):
        super().__init__(
            params,
            dict(lr=lr, betas=betas, alpha=alpha, t_alpha=t_alpha, t_beta3=t_beta3, eps=eps, weight_decay=weight_decay),
        )

    @staticmethod
    def beta3_at(t, beta1, beta3, t_beta3):
        if t_beta3 is None or t >= t_beta3 or beta3 == 0:
            return beta3
        half_life = lambda b: (math.log(0.5) / math.log(b) if b > 0 else 0.0) - 1.0  # a β of 0: its limit, -1
        a = t / t_beta3
        return min(0.5 ** (1.0 / ((1.0 - a) * half_life(beta1) + a * half_life(beta3) + 1.0)), beta3)

    @staticmethod
    def alpha_at(t, alpha, t_alpha):
        return alpha if t_alpha is None else min(t * alpha / t_alpha, alpha)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2, b3 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["exp_avg"] = torch.zeros_like(p)
                    st["exp_avg_slow"] = torch.zeros_like(p)
                    st["exp_avg_sq"] = torch.zeros_like(p)
                st["step"] += 1
                t = st["step"]
                b3_t = self.beta3_at(t, b1, b3, group["t_beta3"])
                alpha_t = self.alpha_at(t, group["alpha"], group["t_alpha"])
                m1, m2, nu = st["exp_avg"], st["exp_avg_slow"], st["exp_avg_sq"]
                m1.mul_(b1).add_(g, alpha=1 - b1)
                m2.mul_(b3_t).add_(g, alpha=1 - b3_t)
                nu.mul_(b2).addcmul_(g, g, value=1 - b2)
                m1_hat = m1 / (1 - b1**t)
                nu_hat = nu / (1 - b2**t)
                update = (m1_hat + alpha_t * m2) / (nu_hat.sqrt() + group["eps"]) + group["weight_decay"] * p
                p.sub_(group["lr"] * update)


class LarsReference(torch.optim.Optimizer):
    """LARS from You, Gitman and Ginsburg, "Large Batch Training of Convolutional Networks" (2017), with
    torch.optim.SGD's momentum conventions, written from the paper (not from bnbf):

        local = η·‖p‖ / (‖g‖ + λ·‖p‖ + ε)   (1 where ‖p‖ or ‖g‖ is 0)
        d     = local·(g + λ·p)
        buf   = d (first step), then μ·buf + (1 − dampening)·d
        p     = p − lr·(d + μ·buf  if nesterov  else  buf)     (p − lr·d without momentum)
    """

    def __init__(
        self,
        params,
        lr=1e-3,
        momentum=0.0,
        dampening=0.0,
        weight_decay=0.0,
        nesterov=False,
        trust_coefficient=1e-3,
        eps=1e-8,
    ):
        super().__init__(
            params,
            dict(
                lr=lr,
                momentum=momentum,
                dampening=dampening,
                weight_decay=weight_decay,
                nesterov=nesterov,
                trust_coefficient=trust_coefficient,
                eps=eps,
            ),
        )

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            wd, mu = group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                p_norm = torch.linalg.vector_norm(p).item()
                g_norm = torch.linalg.vector_norm(g).item()
                if p_norm > 0 and g_norm > 0:
                    local = group["trust_coefficient"] * p_norm / (g_norm + wd * p_norm + group["eps"])
                else:
                    local = 1.0
                d = local * (g + wd * p)
                if mu != 0:
                    st = self.state[p]
                    if "momentum_buffer" not in st:
                        st["momentum_buffer"] = d.clone()
                    else:
                        st["momentum_buffer"].mul_(mu).add_(d, alpha=1 - group["dampening"])
                    buf = st["momentum_buffer"]
                    d = d + mu * buf if group["nesterov"] else buf
                p.sub_(group["lr"] * d)


class UnormClipped:
    """bitsandbytes' update-norm clipping on top of any reference optimizer: per tensor, with u the
    unclipped change per unit of learning rate, (p_new − p)/lr, a change whose ‖u‖ exceeds
    max_unorm·‖p‖ is scaled by max_unorm·‖p‖/‖u‖ (the optimizer's states are not scaled).
    ``clipped`` counts the tensor-steps that were scaled."""

    def __init__(self, opt: torch.optim.Optimizer, max_unorm: float):
        self.opt = opt
        self.max_unorm = max_unorm
        self.clipped = 0

    @property
    def state(self):
        return self.opt.state

    @torch.no_grad()
    def step(self):
        old = [(p, p.detach().clone(), g["lr"]) for g in self.opt.param_groups for p in g["params"]]
        self.opt.step()
        for p, p_old, lr in old:
            change = p - p_old
            unorm = torch.linalg.vector_norm(change / lr).item()
            limit = self.max_unorm * torch.linalg.vector_norm(p_old).item()
            if unorm > limit:
                p.copy_(p_old + change * (limit / unorm))
                self.clipped += 1


ADAN_STATES = ("exp_avg", "exp_avg_sq", "exp_avg_diff", "neg_pre_grad")


class AdanReference(torch.optim.Optimizer):
    """Adan from Xie, Zhou, Li, Lin and Yan, "Adan: Adaptive Nesterov Momentum Algorithm for Faster
    Optimizing Deep Models" (2022), Algorithm 1, with the authors' implementation's conventions (their betas
    are the paper's 1 − β; the first step has no previous gradient, so its difference is 0), in float64:

        Δ = g − g_prev;  m = β1·m + (1 − β1)·g;  d = β2·d + (1 − β2)·Δ;  n = β3·n + (1 − β3)·(g + β2·Δ)²
        u = (m/(1 − β1^t) + β2·d/(1 − β2^t)) / (√(n/(1 − β3^t)) + ε)
        p = (p − lr·u)/(1 + lr·λ),  or with no_prox  p = p·(1 − lr·λ) − lr·u

    States under the authors' names; ``neg_pre_grad`` holds −g_prev. Hyperparameters are checked in the
    authors' words."""

    def __init__(self, params, lr=1e-3, betas=(0.98, 0.92, 0.99), eps=1e-8, weight_decay=0.0, no_prox=False):
        if not lr >= 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not eps >= 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        for i in range(3):
            if not 0.0 <= betas[i] < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {betas[i]}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, no_prox=no_prox))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2, b3 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.double()
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    for name in ADAN_STATES[:3]:
                        st[name] = torch.zeros_like(g)
                st["step"] += 1
                t = st["step"]
                if t == 1:
                    st["neg_pre_grad"] = -g
                diff = g + st["neg_pre_grad"].double()
                m = b1 * st["exp_avg"].double() + (1 - b1) * g
                d = b2 * st["exp_avg_diff"].double() + (1 - b2) * diff
                n = b3 * st["exp_avg_sq"].double() + (1 - b3) * (g + b2 * diff) ** 2
                u = (m / (1 - b1**t) + b2 * d / (1 - b2**t)) / ((n / (1 - b3**t)).sqrt() + eps)
                x = p.double()
                x = x * (1 - lr * wd) - lr * u if group["no_prox"] else (x - lr * u) / (1 + lr * wd)
                p.copy_(x)
                st["exp_avg"], st["exp_avg_sq"], st["exp_avg_diff"], st["neg_pre_grad"] = m, n, d, -g


# ------------------------------------------------------------------------------------------------
# the table

NAN, INF = math.nan, math.inf
_ADAM_STATES = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
_MB = {"momentum_buffer": "momentum_buffer"}
_ADEMAMIX_STATES = {"exp_avg": "exp_avg", "exp_avg_slow": "exp_avg_slow", "exp_avg_sq": "exp_avg_sq"}


def _variance(st: dict) -> torch.Tensor:  # centered RMSprop stores square_avg - grad_avg² in square_avg
    return st["square_avg"] - st["grad_avg"] ** 2


def _without(changes: tuple[dict, ...], *keys: str) -> tuple[dict, ...]:
    """``changes`` for a row that keeps fewer states: the same values without ``keys``."""
    return tuple({k: v for k, v in c.items() if k not in keys} for c in changes)


_ADAM_CHANGES = (
    {"lr": 2e-3, "betas": (0.85, 0.995), "eps": 1e-7, "weight_decay": 0.05},
    {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
    {"lr": 3e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
    {"lr": 3e-4, "betas": (0.8, 0.99), "eps": 1e-8, "weight_decay": 0.0},
    {"lr": 3e-4, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.0},
    {"lr": 3e-4, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1},
    {"lr": 1.0, "betas": (0.0, 0.0), "eps": 0.0, "weight_decay": 1.0},
    {"lr": 2.0, "betas": (0.5, 0.5), "eps": 16.0, "weight_decay": 16.0},
)
# torch.optim.Adam refuses these in bnbf's words; the last three it takes (bnbf computes in float32, where
# each is inf, and the step would turn the params into NaN)
_ADAM_BAD = (
    Bad({"lr": -1.0}, "Invalid learning rate: -1.0"),
    Bad({"eps": -1.0}, "Invalid epsilon value: -1.0"),
    Bad({"betas": (1.0, 0.999)}, "Invalid beta parameter at index 0: 1.0"),
    Bad({"betas": (-0.1, 0.999)}, "Invalid beta parameter at index 0: -0.1"),
    Bad({"betas": (0.9, 1.0)}, "Invalid beta parameter at index 1: 1.0"),
    Bad({"weight_decay": -1.0}, "Invalid weight_decay value: -1.0"),
    Bad({"lr": NAN}, "Invalid learning rate: nan"),
    Bad({"eps": NAN}, "Invalid epsilon value: nan"),
    Bad({"betas": (0.9, NAN)}, "Invalid beta parameter at index 1: nan"),
    Bad({"weight_decay": NAN}, "Invalid weight_decay value: nan"),
    Bad({"weight_decay": -INF}, "Invalid weight_decay value: -inf"),
    Bad({"lr": torch.tensor([1e-3, 1e-3])}, "Tensor lr must be 1-element"),
    Bad({"lr": INF}, "Invalid learning rate: inf", "accepts"),
    Bad({"lr": 1e39}, "Invalid learning rate: 1e+39", "accepts"),
    Bad({"eps": INF}, "Invalid epsilon value: inf", "accepts"),
)
_SGD_CHANGES = (
    {"lr": 1e-2, "momentum": 0.9},
    {"lr": 1e-3, "momentum": 0.5, "dampening": 0.1, "weight_decay": 0.1},
    {"lr": 1e-3, "momentum": 0.9, "nesterov": True},
    {"lr": 1.0, "momentum": 1.0, "dampening": 1.0, "weight_decay": 16.0},
)
_RMSPROP_CHANGES = (  # momentum and centered: rmsprop-both's; the other rows drop what they do not keep
    {"lr": 1e-2, "momentum": 0.9, "centered": True},
    {"lr": 1e-3, "alpha": 0.9, "eps": 1e-6, "momentum": 0.5, "weight_decay": 0.1, "centered": True},
    {"lr": 1.0, "alpha": 0.0, "eps": 0.0, "momentum": 1.0, "weight_decay": 1.0, "centered": True},
    {"lr": 16.0, "alpha": 0.5, "eps": 16.0, "momentum": 16.0, "weight_decay": 16.0, "centered": True},
)
_ADAGRAD_CHANGES = (
    {"lr": 1e-2},
    {"lr": 1e-3, "lr_decay": 0.1, "eps": 1e-6, "weight_decay": 0.1},
    {"lr": 1.0, "lr_decay": 1.0, "eps": 0.0, "weight_decay": 1.0},
    {"lr": 16.0, "lr_decay": 16.0, "eps": 16.0, "weight_decay": 16.0},
)
_ADEMAMIX_CHANGES = (
    {"lr": 1e-3},
    {"lr": 3e-4, "betas": (0.8, 0.99, 0.999), "alpha": 8.0, "eps": 1e-6, "weight_decay": 0.1},
    {"lr": 3e-4, "t_alpha": 100, "t_beta3": 100},
    {"lr": 1.0, "betas": (0.0, 0.0, 0.0), "alpha": 1.0, "eps": 0.0, "weight_decay": 1.0},
    {
        "lr": 16.0,
        "betas": (0.5, 0.5, 0.5),
        "alpha": 16.0,
        "eps": 16.0,
        "weight_decay": 16.0,
        "t_alpha": 16,
        "t_beta3": 16,
    },
)
_LAMB_CHANGES = (
    {"lr": 1e-3},
    {"lr": 3e-4, "betas": (0.8, 0.99), "eps": 1e-8, "weight_decay": 0.1, "debias": True},
    {"lr": 3e-4, "adam": True, "clamp_value": 1.0},
    {"lr": 1.0, "betas": (0.0, 0.0), "eps": 0.0, "weight_decay": 1.0},
    {"lr": 16.0, "betas": (0.5, 0.5), "eps": 16.0, "weight_decay": 16.0, "clamp_value": 16.0},
)
_LARS_CHANGES = (
    {"lr": 0.1, "momentum": 0.9},
    {"lr": 0.01, "momentum": 0.5, "dampening": 0.1, "weight_decay": 0.1, "trust_coefficient": 0.02},
    {"lr": 0.01, "momentum": 0.9, "nesterov": True, "eps": 1e-6},
    {"lr": 1.0, "momentum": 1.0, "weight_decay": 1.0, "trust_coefficient": 1.0, "eps": 0.0},
    {"lr": 16.0, "momentum": 16.0, "weight_decay": 16.0, "trust_coefficient": 16.0, "eps": 16.0},
)
_NORMS = "scales the step by its own trust ratio: max_unorm does not combine"  # LAMB's and LARS's refusal

_ADAN_NAMES = {name: name for name in ADAN_STATES}
# full hyperparameters a run may switch to between steps (no_prox too: a scalar, not a kernel variant)
_ADAN_CHANGES = (
    {"lr": 1e-3, "betas": (0.98, 0.92, 0.99), "eps": 1e-8, "weight_decay": 0.0},
    {"lr": 3e-4, "betas": (0.9, 0.8, 0.95), "eps": 1e-6, "weight_decay": 0.02},
    {"lr": 3e-4, "betas": (0.9, 0.8, 0.95), "eps": 1e-6, "weight_decay": 0.02, "no_prox": True},
    {"lr": 1.0, "betas": (0.0, 0.0, 0.0), "eps": 0.0, "weight_decay": 1.0},
    {"lr": 16.0, "betas": (0.5, 0.5, 0.5), "eps": 16.0, "weight_decay": 16.0, "no_prox": True},
)
# the authors' class refuses these in bnbf's words; it checks no weight decay, nor values beyond float32
_ADAN_BAD = (
    Bad({"lr": -1.0}, "Invalid learning rate: -1.0"),
    Bad({"lr": math.nan}, "Invalid learning rate: nan"),
    Bad({"eps": -1.0}, "Invalid epsilon value: -1.0"),
    Bad({"betas": (1.0, 0.92, 0.99)}, "Invalid beta parameter at index 0: 1.0"),
    Bad({"betas": (0.98, -0.1, 0.99)}, "Invalid beta parameter at index 1: -0.1"),
    Bad({"betas": (0.98, 0.92, 1.5)}, "Invalid beta parameter at index 2: 1.5"),
    Bad({"betas": (0.98, 0.92, math.nan)}, "Invalid beta parameter at index 2: nan"),
    Bad({"weight_decay": -1.0}, "Invalid weight_decay value: -1.0", "accepts"),
    Bad({"weight_decay": math.inf}, "Invalid weight_decay value: inf", "accepts"),
    Bad({"lr": 1e39}, "Invalid learning rate: 1e+39", "accepts"),
    Bad({"eps": math.inf}, "Invalid epsilon value: inf", "accepts"),
)
_ADAN_HP = {"lr": 1e-3, "betas": (0.98, 0.92, 0.99)}

# Adding a rule touches three places: its rule file (bnbf/rules/<name>.py), its registry row
# (bnbf.rules.RULES), and its row here (a row per variant whose hyperparameters change which states exist or
# which code path runs). Every property test then runs for it, and test_rules.test_rows_are_complete fails
# until the row is there. (A bnbf_nn family for it also takes its line in tests/test_nn_optim.py's HPARAMS.)
# A row reads:
#   Row(rule, variant, reference class, {hparams}, {bnbf state: reference state}, train_lr,
#       changes=({hparams a run may switch to}, ...),  # keeping the states; with 0, 1 and 16 among the values
#       bad=(Bad({override}, "message", "raises" | "accepts" | "asserts"), ...),
#       [torch_kwargs={}, weight_decays=, max_unorm="why the rule refuses it", stored=, ...])
ROWS = [
    Row(
        "adam",
        "",
        torch.optim.Adam,
        {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8},
        _ADAM_STATES,
        1e-2,
        changes=_ADAM_CHANGES,
        bad=_ADAM_BAD,
    ),
    Row(
        "adamw",
        "",
        torch.optim.AdamW,
        {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8},
        _ADAM_STATES,
        1e-2,
        changes=_ADAM_CHANGES,
        bad=_ADAM_BAD,
    ),
    # β2 0.9: exp_avg_sq falls often enough in 20 steps for the maximum to matter (with 0.999 it rarely falls)
    Row(
        "adamw",
        "amsgrad",
        torch.optim.AdamW,
        {"lr": 1e-3, "betas": (0.9, 0.9), "amsgrad": True},
        {**_ADAM_STATES, "max_exp_avg_sq": "max_exp_avg_sq"},
        1e-2,
        changes=tuple({**c, "amsgrad": True} for c in _ADAM_CHANGES),
        bad=(Bad({"betas": (0.9, 1.0)}, "Invalid beta parameter at index 1: 1.0"),),
    ),
    Row(
        "lion",
        "",
        _lion,
        {"lr": 1e-4, "betas": (0.9, 0.99)},
        {"exp_avg": "exp_avg"},
        1e-2,
        changes=(
            {"lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 0.0},
            {"lr": 3e-4, "betas": (0.8, 0.9), "weight_decay": 0.1},
            {"lr": 1.0, "betas": (0.0, 0.0), "weight_decay": 1.0},
            {"lr": 16.0, "betas": (0.5, 0.5), "weight_decay": 16.0},
        ),
        bad=(
            Bad({"lr": -1.0}, "Invalid learning rate: -1.0", "asserts"),
            Bad({"betas": (0.9, 1.0)}, "Invalid beta parameter at index 1: 1.0", "accepts"),
            Bad({"betas": (-0.1, 0.99)}, "Invalid beta parameter at index 0: -0.1", "asserts"),
            Bad({"weight_decay": -0.1}, "Invalid weight_decay value: -0.1", "accepts"),
            Bad({"lr": 1e39}, "Invalid learning rate: 1e+39", "accepts"),
            Bad({"betas": (NAN, 0.99)}, "Invalid beta parameter at index 0: nan", "asserts"),
        ),
        weight_decays=(0.0, 1.0),
        torch_kwargs={},
        sign_step=True,
    ),
    Row(
        "sgd",
        "plain",
        torch.optim.SGD,
        {"lr": 1e-2},
        {},
        0.2,
        changes=(
            {"lr": 1e-3, "weight_decay": 0.1},
            {"lr": 1.0, "weight_decay": 1.0},
            {"lr": 16.0, "weight_decay": 16.0},
        ),
        bad=(
            Bad({"nesterov": True}, "Nesterov momentum requires a momentum and zero dampening"),
            Bad({"lr": -0.1}, "Invalid learning rate: -0.1"),
            Bad({"weight_decay": -1.0}, "Invalid weight_decay value: -1.0"),
            Bad({"lr": NAN}, "Invalid learning rate: nan", "accepts"),
        ),
    ),
    Row(
        "sgd",
        "momentum",
        torch.optim.SGD,
        {"lr": 1e-2, "momentum": 0.9},
        _MB,
        0.05,
        changes=_SGD_CHANGES,
        bad=(
            Bad({"momentum": -0.1}, "Invalid momentum value: -0.1"),
            Bad({"momentum": NAN}, "Invalid momentum value: nan", "accepts"),
        ),
    ),
    Row(
        "sgd",
        "dampening",
        torch.optim.SGD,
        {"lr": 1e-2, "momentum": 0.9, "dampening": 0.2},
        _MB,
        0.05,
        changes=_SGD_CHANGES,
        bad=(Bad({"dampening": INF}, "Invalid dampening value: inf", "accepts"),),
    ),
    Row(
        "sgd",
        "nesterov",
        torch.optim.SGD,
        {"lr": 1e-2, "momentum": 0.9, "nesterov": True},
        _MB,
        0.05,
        changes=_SGD_CHANGES,
        bad=(Bad({"dampening": 0.1}, "Nesterov momentum requires a momentum and zero dampening"),),
    ),
    Row(
        "rmsprop",
        "plain",
        torch.optim.RMSprop,
        {"lr": 1e-3, "alpha": 0.9},
        {"square_avg": "square_avg"},
        3e-3,
        changes=_without(_RMSPROP_CHANGES, "momentum", "centered"),
        bad=(
            Bad({"alpha": -0.5}, "Invalid alpha value: -0.5"),
            Bad({"eps": -1.0}, "Invalid epsilon value: -1.0"),
            Bad({"weight_decay": -1.0}, "Invalid weight_decay value: -1.0"),
            Bad({"lr": -1.0}, "Invalid learning rate: -1.0"),
            Bad({"alpha": NAN}, "Invalid alpha value: nan"),
        ),
    ),
    Row(
        "rmsprop",
        "momentum",
        torch.optim.RMSprop,
        {"lr": 1e-3, "alpha": 0.9, "momentum": 0.9},
        {"square_avg": "square_avg", **_MB},
        3e-3,
        changes=_without(_RMSPROP_CHANGES, "centered"),
        bad=(
            Bad({"momentum": -0.1}, "Invalid momentum value: -0.1"),
            Bad({"momentum": NAN}, "Invalid momentum value: nan"),
        ),
        code_checked_only=("momentum_buffer",),
    ),
    Row(
        "rmsprop",
        "centered",
        torch.optim.RMSprop,
        {"lr": 1e-3, "alpha": 0.9, "centered": True},
        {"square_avg": "square_avg", "grad_avg": "grad_avg"},
        3e-3,
        changes=_without(_RMSPROP_CHANGES, "momentum"),
        bad=(Bad({"lr": NAN}, "Invalid learning rate: nan"),),
        bf16_mean_rel=False,
        stored={"square_avg": _variance},
    ),
    Row(
        "rmsprop",
        "both",
        torch.optim.RMSprop,
        {"lr": 1e-3, "alpha": 0.9, "momentum": 0.9, "centered": True},
        {"square_avg": "square_avg", "grad_avg": "grad_avg", **_MB},
        3e-3,
        changes=_RMSPROP_CHANGES,
        bad=(Bad({"eps": INF}, "Invalid epsilon value: inf", "accepts"),),
        code_checked_only=("momentum_buffer",),
        bf16_mean_rel=False,
        stored={"square_avg": _variance},
    ),
    Row(
        "adagrad",
        "plain",
        torch.optim.Adagrad,
        {"lr": 1e-2},
        {"sum": "sum"},
        0.1,
        changes=_ADAGRAD_CHANGES,
        bad=(
            Bad({"lr_decay": -0.1}, "Invalid lr_decay value: -0.1"),
            Bad({"initial_accumulator_value": -0.1}, "Invalid initial_accumulator_value value: -0.1"),
            Bad({"eps": -1.0}, "Invalid epsilon value: -1.0"),
            Bad({"weight_decay": -1.0}, "Invalid weight_decay value: -1.0"),
            Bad({"lr": -1.0}, "Invalid learning rate: -1.0"),
            Bad({"weight_decay": 1e39}, "Invalid weight_decay value: 1e+39", "accepts"),
        ),
    ),
    Row(
        "adagrad",
        "decay",
        torch.optim.Adagrad,
        {"lr": 1e-2, "lr_decay": 0.05, "initial_accumulator_value": 0.1},
        {"sum": "sum"},
        0.05,
        changes=_ADAGRAD_CHANGES,
        bad=(
            Bad({"lr_decay": NAN}, "Invalid lr_decay value: nan"),
            Bad({"initial_accumulator_value": NAN}, "Invalid initial_accumulator_value value: nan"),
        ),
    ),
    # the paper references check nothing: every bad value is "accepts" there
    Row(
        "ademamix",
        "",
        AdEMAMixReference,
        {"lr": 1e-3, "betas": (0.9, 0.999, 0.9999), "alpha": 5.0},
        _ADEMAMIX_STATES,
        3e-2,
        changes=_ADEMAMIX_CHANGES,
        bad=(
            Bad({"betas": (0.9, 0.999, 1.0)}, "Invalid beta parameter at index 2: 1.0", "accepts"),
            Bad({"betas": (0.9, 1.5, 0.9999)}, "Invalid beta parameter at index 1: 1.5", "accepts"),
            Bad({"alpha": -1.0}, "Invalid alpha value: -1.0", "accepts"),
            Bad({"eps": -1.0}, "Invalid epsilon value: -1.0", "accepts"),
            Bad({"weight_decay": -1.0}, "Invalid weight_decay value: -1.0", "accepts"),
            Bad({"lr": -1.0}, "Invalid learning rate: -1.0", "accepts"),
            Bad({"alpha": NAN}, "Invalid alpha value: nan", "accepts"),
        ),
        torch_kwargs={},
    ),
    Row(
        "ademamix",
        "warmup",
        AdEMAMixReference,  # β3 0.999: the slow EMA (and so t_alpha) matters in 20 steps
        {"lr": 1e-3, "betas": (0.9, 0.999, 0.999), "alpha": 5.0, "t_alpha": 10, "t_beta3": 10},
        _ADEMAMIX_STATES,
        1e-2,
        changes=_ADEMAMIX_CHANGES,
        bad=(
            Bad({"t_alpha": 0}, "Invalid t_alpha value: 0", "accepts"),
            Bad({"t_beta3": -5}, "Invalid t_beta3 value: -5", "accepts"),
        ),
        torch_kwargs={},
    ),
    Row(
        "lamb",
        "",
        _lamb,
        {"lr": 1e-3},
        _ADAM_STATES,
        3e-2,
        changes=_LAMB_CHANGES,
        bad=(
            Bad({"weight_decay": -1.0}, "Invalid weight_decay value: -1.0"),
            Bad({"lr": -1.0}, "Invalid learning rate: -1.0"),
        ),
        torch_kwargs={},
        max_unorm=_NORMS,
    ),
    Row(
        "lamb",
        "debias",
        _lamb,
        {"lr": 1e-3, "debias": True},
        _ADAM_STATES,
        3e-2,
        changes=_LAMB_CHANGES,
        bad=(Bad({"betas": (1.0, 0.999)}, "Invalid beta parameter at index 0: 1.0"),),
        torch_kwargs={},
        max_unorm=_NORMS,
    ),
    Row(
        "lamb",
        "adam",
        _lamb,
        {"lr": 1e-3, "adam": True},
        _ADAM_STATES,
        1e-2,
        changes=_LAMB_CHANGES,
        bad=(Bad({"eps": -1.0}, "Invalid epsilon value: -1.0"),),
        torch_kwargs={},
        max_unorm=_NORMS,
    ),
    Row(
        "lamb",
        "clamp",
        _lamb,
        {"lr": 1e-3, "clamp_value": 0.5},
        _ADAM_STATES,
        3e-2,
        changes=_LAMB_CHANGES,
        bad=(
            Bad({"clamp_value": -1.0}, "Invalid clamp value: -1.0"),
            Bad({"clamp_value": NAN}, "Invalid clamp value: nan", "accepts"),
        ),
        torch_kwargs={},
        max_unorm=_NORMS,
    ),
    Row(
        "lars",
        "plain",
        LarsReference,
        {"lr": 0.1, "trust_coefficient": 0.02},
        {},
        1.0,
        changes=_without(_LARS_CHANGES, "momentum", "dampening", "nesterov"),
        bad=(
            Bad({"nesterov": True}, "Nesterov momentum requires a momentum and zero dampening", "accepts"),
            Bad({"trust_coefficient": 0.0}, "Invalid trust_coefficient value: 0.0", "accepts"),
            Bad({"weight_decay": -1.0}, "Invalid weight_decay value: -1.0", "accepts"),
            Bad({"lr": -1.0}, "Invalid learning rate: -1.0", "accepts"),
            Bad({"trust_coefficient": INF}, "Invalid trust_coefficient value: inf", "accepts"),
            Bad({"eps": -1.0}, "Invalid epsilon value: -1.0", "accepts"),
        ),
        torch_kwargs={},
        max_unorm=_NORMS,
    ),
    Row(
        "lars",
        "momentum",
        LarsReference,
        {"lr": 0.1, "trust_coefficient": 0.02, "momentum": 0.9},
        _MB,
        0.3,
        changes=_LARS_CHANGES,
        bad=(Bad({"momentum": -0.1}, "Invalid momentum value: -0.1", "accepts"),),
        torch_kwargs={},
        max_unorm=_NORMS,
    ),
    Row(
        "lars",
        "dampening",
        LarsReference,
        {"lr": 0.1, "trust_coefficient": 0.02, "momentum": 0.9, "dampening": 0.1},
        _MB,
        0.3,
        changes=_LARS_CHANGES,
        bad=(Bad({"momentum": -INF}, "Invalid momentum value: -inf", "accepts"),),
        torch_kwargs={},
        max_unorm=_NORMS,
    ),
    Row(
        "lars",
        "nesterov",
        LarsReference,
        {"lr": 0.1, "trust_coefficient": 0.02, "momentum": 0.9, "nesterov": True},
        _MB,
        0.3,
        changes=_LARS_CHANGES,
        bad=(Bad({"dampening": 0.1}, "Nesterov momentum requires a momentum and zero dampening", "accepts"),),
        torch_kwargs={},
        max_unorm=_NORMS,
    ),
    Row(
        "adan",
        "",
        AdanReference,
        _ADAN_HP,
        _ADAN_NAMES,
        1e-2,
        changes=_ADAN_CHANGES,
        bad=_ADAN_BAD,
        torch_kwargs={},
        weight_decays=(0.0, 0.02),
    ),
    Row(
        "adan",
        "no_prox",
        AdanReference,
        {**_ADAN_HP, "no_prox": True},
        _ADAN_NAMES,
        1e-2,
        changes=_ADAN_CHANGES,
        bad=(Bad({"betas": (0.98, 1.0, 0.99)}, "Invalid beta parameter at index 1: 1.0"),),
        torch_kwargs={},
        weight_decays=(0.0, 0.02),
    ),
]

ROW = {r.id: r for r in ROWS}
ROW_IDS = [r.id for r in ROWS]
ADAN_ROWS = [r for r in ROWS if r.name == "adan"]  # tests/test_adan.py's own tests run these

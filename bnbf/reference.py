"""The pure-torch optimizer step: the CPU path and the oracle the Triton kernels are tested against.

Per tensor: dequantize the states to float32, run the rule's ``reference`` math (:func:`step_math`), apply the
non-finite gradient rule, write the param in its dtype and requantize the states (stochastic rounding, see
bnbf.quant). :func:`step_math` is written in differentiable torch ops only (no in-place writes, no reads of
values on the host), so ``bnbf.update(..., differentiable=True)`` runs it as it is.
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from bnbf import _cpu_codec
from bnbf._dispatch import NORM_REDUCE
from bnbf.quant import dequantize_state_reference, quantize_state_reference, state_dither
from bnbf.rules import get_rule
from bnbf.rules.base import norm_of

# Set by bnbf.distributed around a step of shards: {param's data_ptr: the global index of its first block}, so a
# shard's stochastic rounding draws the dither of the unsharded tensor's blocks it holds (read here and by the
# kernels' address table, bnbf.kernels.launcher.build_group). None: every tensor starts at block 0.
FIRST_BLOCKS: contextvars.ContextVar = contextvars.ContextVar("bnbf_first_blocks", default=None)


@dataclasses.dataclass(eq=False)
class GradClip:
    """One call's gradient clipping by global norm (``bnbf.update(..., max_grad_norm=)``): the step scales each
    grad by ``min(1, max_norm / (total + 1e-6))`` as it loads it, instead of reading a clipped copy.

    Given a total (``torch._foreach_norm``'s, where bnbf.distributed reduces the norms across shards): ``value``
    is the total norm of all the call's grads (``max_norm`` a number: the kernels compute the coefficient from
    it, torch's arithmetic op by op, see ``step_kernel._clip_coef``) or, with ``max_norm`` None, the coefficient
    itself (computed by torch ops from a 0-d tensor max_norm). A 0-d tensor on the first grad's device, in the
    norms' dtype; copied to each other device once.

    Folded (:meth:`folded`, every other eager call on plain tensors): ``value`` is None while ``folding``; each
    group sums its grads' squares (the launcher's, or :func:`reference_step`'s: a rule with ``norm_grad_powers``,
    e.g. LARS, in its own norm pass, any other in a pass over the grads alone, float32 per tile, float64 across),
    hands its tensors' sums to :meth:`fold` with its step, deferred, and :meth:`finish` (called by
    ``bnbf.compose`` when the call's groups have all run) computes the total and the coefficient on the device,
    then runs the steps, which read the coefficient as for a 0-d tensor max_norm."""

    value: Tensor | None
    max_norm: float | None
    _on: dict = dataclasses.field(default_factory=dict)
    folding: bool = False
    fold_max: Any = None  # max_norm as given, a number or a 0-d tensor (folded)
    dtype: torch.dtype | None = None  # the total norm's dtype: the grads' (torch's); folded
    device: torch.device | None = None  # the total norm's device: the first grad's (torch's); folded
    total: Tensor | None = None  # the total norm, once a folded clip has finished
    _sq: list = dataclasses.field(default_factory=list)
    _dtypes: list = dataclasses.field(default_factory=list)
    _steps: list = dataclasses.field(default_factory=list)

    @classmethod
    def folded(cls, max_norm: Any, dtype: torch.dtype, device: torch.device) -> GradClip:
        """Clipping whose total comes from the groups' own sums of g² (see the class docstring)."""
        return cls(None, None, folding=True, fold_max=max_norm, dtype=dtype, device=device)

    def fold(self, sq: Tensor, dtype: torch.dtype, step: Callable[[], None]) -> None:
        """A group's norm pass has run: ``sq`` its tensors' sums of g² over every element (float64, one per
        tensor in the group's order), ``dtype`` its grads' dtype, ``step`` its step, run by :meth:`finish`."""
        self._sq.append(sq)
        self._dtypes.append(dtype)
        self._steps.append(step)

    def finish(self) -> None:
        """A folded clip: the total norm and the coefficient from the groups' sums, then the deferred steps (in
        the order their norm passes ran). Nothing for a clip that is not folded, or has finished."""
        if not self.folding:
            return
        if not self._sq:  # every group of the call was to hand its sums in: none did (a path that ignores the clip)
            raise RuntimeError("bnbf: a folded gradient clip received no group's sums of g² (a path ignored the clip)")
        sqs = [sq if sq.device == self.device else sq.to(self.device) for sq in self._sq]
        self.total = fold_total(sqs, self.dtype, self._dtypes)
        self.value = clip_coefficient(self.total, self.fold_max)
        self.folding = False
        steps, self._sq, self._dtypes, self._steps = self._steps, [], [], []
        for step in steps:
            step()

    def on(self, device: torch.device) -> Tensor:
        """``value`` on ``device``."""
        if self.value.device == device:
            return self.value
        t = self._on.get(device)
        if t is None:
            t = self._on[device] = self.value.to(device)
        return t

    def kernel_args(self, device: torch.device) -> tuple[int, Tensor, float]:
        """The step kernel's (CLIP, clip_ptr, clip_max)."""
        if self.max_norm is None:
            return 2, self.on(device), 0.0
        return 1, self.on(device), self.max_norm

    def coef(self, device: torch.device) -> Tensor:
        """The coefficient on ``device``: torch.nn.utils.clip_grad_norm_'s expression (``bnbf.clip_grad_norm``'s)."""
        v = self.on(device)
        return v if self.max_norm is None else clip_coefficient(v, self.max_norm)


def fold_total(sq: list[Tensor], dtype: torch.dtype, dtypes: list[torch.dtype] | None = None) -> Tensor:
    """The total norm of a folded clip from the norm passes' per-tensor sums of g² (float64 [tensors] each, one
    device; ``dtypes`` each part's grads' dtype): added in float64 in the order given, the root, rounded to the
    total's dtype ``dtype`` (the grads' promoted dtype, torch's total is in it). As torch.nn.utils.clip_grad_norm_
    takes each grad's norm in the grad's own dtype, a part of another dtype (fp16 grads beside fp32 ones) enters
    as its tensors' norms rounded to that dtype (16-bit grads: float32 ones are the total's dtype or the copies
    bnbf.updates steps, whose norms stay unrounded): inf where one overflows, so the total is inf and the grads are
    zeroed, as torch zeroes them. The launcher and the reference step hand in sums of the same squares: the same
    arithmetic after them."""
    if dtypes is not None and any(d != dtype for d in dtypes):
        sq = [s if d in (dtype, torch.float32) else s.sqrt().to(d).double().square() for s, d in zip(sq, dtypes)]
    return (sq[0] if len(sq) == 1 else torch.cat(sq)).sum().sqrt().to(dtype)


def clip_coefficient(total: Tensor, max_norm: Any) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_``'s coefficient ``min(1, max_norm / (total + 1e-6))``, its ops in its
    order (NaN stays NaN; an infinite total gives 0)."""
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


def clipped_sums(sums: Tensor, powers: tuple[int, int], coef: Tensor) -> Tensor:
    """A folded clip's norm sums of the clipped grads from those of the grads (``sums`` float64 [tensors, 3]):
    column k times ``coef ** powers[k]`` in float64 (coef² is exact: the coefficient has at most 24 significant
    bits), the third column (the total's) as it is. Rule-independent: the powers are the rule's declaration."""
    c = coef.double()
    return sums * torch.stack([c ** powers[0], c ** powers[1], torch.ones_like(c)])


# Set by bnbf.compose around the core calls of a step with ``max_grad_norm`` (a GradClip); read by
# reference_step and bnbf.kernels.launcher.launch_group. None: the grads as given.
GRAD_CLIP: contextvars.ContextVar = contextvars.ContextVar("bnbf_grad_clip", default=None)


def norm_sums(rule, p, g, states, scalars, counted, fold=0) -> list:
    """The per-tensor sums of the rule's norm terms over the ``counted`` elements (float32, 0-d). With ``fold``
    (the kernels' tile width) the third, which a rule with ``norm_grad_powers`` leaves unused, is a folded
    clip's sum of g² over every element, non-finite ones included, added as the kernels' norm pass adds it:
    float32 within each tile of ``fold`` elements, float64 across the tiles (a float64 0-d)."""
    terms = rule.norms[1](p, g, states, scalars)
    sums = [torch.where(counted, t, torch.zeros_like(t)).sum() for t in terms]
    if fold:
        sums[2] = tile_squares(g, fold)
    return sums


def tile_width(layout) -> int:
    """The elements of one of the kernels' tiles: a quantization block, or 256 for float32 states (no blocks)."""
    return layout.block_size if layout.quantized else 256


def tile_squares(g: Tensor, tile: int) -> Tensor:
    """The sum of ``g``'s squares over every element, non-finite ones included, as the kernels add it: float32
    within each tile of ``tile`` elements, float64 across the tiles (a float64 0-d; 0 for no elements)."""
    sq = g.float().reshape(-1)
    sq = sq * sq
    sq = torch.cat([sq, sq.new_zeros(-sq.numel() % tile)])  # the last tile's padding adds 0, as the kernel's
    return sq.view(-1, tile).sum(1).double().sum()


def step_math(rule, p, g, states, scalars, max_unorm, lr, skip_zeros=False, clip=False, sums=None, derivable=False):
    """One tensor's step on dequantized values: ``(new_p, new_states, finite)``.

    Args:
        rule: the rule (``bnbf.RULES[name]``).
        p, g: the param and the gradient (already negated for ``maximize``), in the compute dtype.
        states: one tensor per rule slot (``None`` for a slot the state does not keep).
        scalars: the rule's scalars NamedTuple (0-d tensors or numbers).
        max_unorm, lr: the clipping pair, read only with ``clip``.
        sums: the rule's norm sums where they were taken before (a folded gradient clip's, of the clipped
            grads); None: taken here.
        derivable: the differentiable step's call, whose derivatives must stay finite past non-finite grads.

    Returns:
        The new param (non-finite gradient elements keep their old value), the new states (not yet zeroed
        where the gradient is non-finite) and the mask of finite gradient elements.
    """
    finite = torch.isfinite(g)
    counted = _counted(finite, g, skip_zeros)
    # the step of a non-finite element is discarded below; taken on 1 its derivatives there are finite (0 · them
    # is 0), where on inf or NaN they would make every derivative of the differentiable step NaN (and on 0, Adam's
    # sqrt of a zero second moment would). The values are the same either way: the reference path skips the pass
    g_in = torch.where(finite, g, 1.0) if derivable else g
    if rule.norms is not None:  # per-tensor sums of the rule's terms over the counted elements
        if sums is None:
            sums = _reduced(norm_sums(rule, p, g_in, states, scalars, counted))
        new_p, new_states = rule.reference(p, g_in, states, scalars, sums)
    else:
        new_p, new_states = rule.reference(p, g_in, states, scalars)
        if clip:  # ||update|| <= max_unorm * ||p||, update = change per unit of lr
            zero = torch.zeros_like(p)
            d = (new_p - p) / lr
            pnorm, unorm = (norm_of(x) for x in _reduced([torch.where(counted, x * x, zero).sum() for x in (p, d)]))
            limit = max_unorm * pnorm
            on = unorm > limit
            if isinstance(max_unorm, torch.Tensor):  # 0 (or below, unread on a device) is off, as the number 0 is
                on = on & (max_unorm > 0)
            scale = torch.where(on, limit / unorm.clamp_min(1e-30), torch.ones_like(unorm))
            new_p = p + scale * (new_p - p)
    if skip_zeros:  # an exactly-zero gradient element leaves its param element and states alone
        keep = g == 0
        new_p = torch.where(keep, p, new_p)
        new_states = [s if s is None else torch.where(keep, old, s) for s, old in zip(new_states, states)]
    return torch.where(finite, new_p, p), new_states, finite


def _counted(finite: Tensor, g: Tensor, skip_zeros: bool) -> Tensor:
    """The elements a rule's norms are summed over: finite grads, and non-zero ones with ``skip_zeros``."""
    return finite & (g != 0) if skip_zeros else finite


def _reduced(sums: list) -> list:
    """Per-tensor sums, summed across the shards of a sharded tensor where bnbf.distributed asks for it."""
    # traced only in the differentiable step (the kernels' op is opaque to Dynamo), which bnbf.distributed never
    # runs; Dynamo cannot read a ContextVar
    reduce = None if torch.compiler.is_compiling() else NORM_REDUCE.get()
    if reduce is None:
        return sums
    both = torch.stack(sums)
    reduce(both)
    return list(both.unbind())


def reference_step(p_in, p_out, grads, s_in, s_out, hp, layout, skip_zeros=False, clip=False) -> None:
    """One step of a group of tensors (one device, dtype and state layout), written into ``p_out``/``s_out``
    (the inputs themselves for an in-place step): dequantize, :func:`step_math`, requantize.

    With a folded gradient clip (:meth:`GradClip.folded`) the grads' sums of g² are taken now and handed to the
    clip with the step, which it runs with the coefficient, as the launcher does: a rule with
    ``norm_grad_powers`` runs its norm pass now, the rule's sums of the grads as given and their sums of g² over
    every element (:func:`norm_sums`), and its step takes the sums scaled to the clipped grads
    (:func:`clipped_sums`); any other rule's sums of g² come from the grads alone (:func:`tile_squares`, the
    kernels' tiles)."""
    grad_clip = GRAD_CLIP.get()
    if grad_clip is None or not grad_clip.folding:
        _step_group(p_in, p_out, grads, s_in, s_out, hp, layout, skip_zeros, clip, grad_clip)
        return
    powers = get_rule(layout.rule).norm_grad_powers
    if powers is None:
        sq = torch.stack([tile_squares(g, tile_width(layout)) for g in grads])
        grad_clip.fold(
            sq,
            grads[0].dtype,
            lambda: _step_group(p_in, p_out, grads, s_in, s_out, hp, layout, skip_zeros, clip, grad_clip),
        )
        return
    sums = _step_group(p_in, p_out, grads, s_in, s_out, hp, layout, skip_zeros, clip, None, collect=True)

    def step() -> None:
        clipped = clipped_sums(sums, powers, grad_clip.coef(p_in[0].device)).float()
        _step_group(p_in, p_out, grads, s_in, s_out, hp, layout, skip_zeros, clip, grad_clip, sums=clipped)

    grad_clip.fold(sums[:, 2], grads[0].dtype, step)


def _step_group(p_in, p_out, grads, s_in, s_out, hp, layout, skip_zeros, clip, grad_clip, collect=False, sums=None):
    """:func:`reference_step`'s loop over the tensors; with ``collect`` only the norm sums of the grads as given,
    returned as float64 [tensors, 3] (nothing written); with ``sums`` ([tensors, 3]) the step with those sums."""
    rule = get_rule(layout.rule)
    fmt, block_size = layout.format, layout.block_size
    quant = layout.quantized
    slots = [j for j in range(len(rule.states)) if (layout.present >> j) & 1]
    signs = [rule.states[j].signed for j in slots]
    per = 2 * len(slots) if quant else len(slots)
    *scalars, grad_sign, seed, max_unorm, lr = hp.unbind()  # the rule's scalars, then the four the step adds
    if grad_clip is not None:  # the grads times the sign and the clipping coefficient: one float32 product each
        grad_sign = grad_sign * grad_clip.coef(p_in[0].device).float()
    scalars = rule.scalar_names(*scalars)
    seed = int(seed) if quant else 0
    given = FIRST_BLOCKS.get() if quant else None  # shards: each tensor's first global block, for the dither
    first = [given.get(p.data_ptr(), 0) for p in p_in] if given else [0] * len(p_in)
    # 8-bit CPU states take the native codec where it was built: bnbf.quant's oracle, bit for bit, in one pass
    native = quant and _cpu_codec.NATIVE is not None and p_in[0].device.type == "cpu"
    # one float32 buffer per slot, reused by the group's tensors for their dequantized states (a fresh 16 MB
    # buffer page-faults ~0.4 ms per 4M values); dropped when the call returns. Not where autograd records
    # (it would keep a buffer that the next tensor overwrites without bumping its version)
    records = torch.is_grad_enabled() and any(t.requires_grad for t in (hp, *p_in, *grads))
    scratch = (
        [torch.empty(max(p.numel() for p in p_in), dtype=torch.float32) for _ in slots]
        if native and not records
        else None
    )
    collected = []
    for i, (p, g) in enumerate(zip(p_in, grads)):
        p32 = p.float()
        g32 = g.float() * grad_sign
        fields = s_in[i * per : (i + 1) * per]
        out = s_out[i * per : (i + 1) * per]
        fast = native and all(t.is_contiguous() for t in (*fields, *out))  # (vmap's member views may not be)
        states: list = [None] * len(rule.states)
        for k, j in enumerate(slots):
            if fast:
                buf = None if scratch is None else scratch[k][: p.numel()]
                states[j] = _cpu_codec.dequantize(fields[2 * k], fields[2 * k + 1], fmt, signs[k], block_size, buf)
            elif quant:
                states[j] = dequantize_state_reference(fields[2 * k], fields[2 * k + 1], fmt, signs[k], block_size)
            else:
                states[j] = fields[k].float()
        if collect:  # a folded clip's norm pass: the counted elements as step_math counts them
            counted = _counted(torch.isfinite(g32), g32, skip_zeros)
            terms = norm_sums(rule, p32, g32, states, scalars, counted, fold=tile_width(layout))
            collected.append(torch.stack([x.double() for x in terms]))
            continue
        mine = None if sums is None else list(sums[i].unbind())
        # a non-finite gradient element leaves its param element alone and zeroes its states
        new_p, new_states, finite = step_math(rule, p32, g32, states, scalars, max_unorm, lr, skip_zeros, clip, mine)
        if quant:  # an 8-bit state holds no NaN or inf: such an element steps as a non-finite gradient's (the kernels)
            for j in slots:
                finite = finite & torch.isfinite(new_states[j])
            new_p = torch.where(finite, new_p, p32)
        p_out[i].copy_(new_p.to(p.dtype))
        if fast:  # the codec zeroes the states of non-finite elements (keep) as it quantizes
            keep = finite.reshape(-1)
            for k, j in enumerate(slots):
                x = new_states[j].float().reshape(-1)
                _cpu_codec.quantize_(x, keep, out[2 * k], out[2 * k + 1], fmt, signs[k], block_size, seed, first[i])
            continue
        # stochastic rounding, as the kernels: one offset per element, shared by its states
        d = state_dither(p.numel(), seed, block_size, p.device, first[i]) if quant else None
        for k, j in enumerate(slots):
            s = torch.where(finite, new_states[j], torch.zeros_like(new_states[j]))
            if quant:
                codes, absmax = quantize_state_reference(s, fmt, signs[k], block_size, d)
                out[2 * k].copy_(codes)
                out[2 * k + 1].copy_(absmax)
            else:
                out[k].copy_(s)
    if collect:
        return torch.stack(collected)
    return None

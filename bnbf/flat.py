"""Flat params: the leaves of a param tree as views of a few flat buffers, for ``torch.func.vmap``, ``grad`` and
``torch.compile``.

Those transforms cost something per tensor of their inputs and outputs (vmap wraps and unwraps each one, Dynamo
guards each one, Inductor checks each one at every call), and a model's params and grads are one tensor per leaf
(GPT-2 small: 148 of each). A packed state (``init_state(..., packed=True)``) takes the state down to a few
buffers; a :class:`FlatLayout` does the same for the params and grads. It places every leaf in one 1-D buffer
per (group, param dtype, state width), each leaf starting a multiple of the spec's block size into its buffer,
with zeros between leaves::

    layout = bnbf.flat_layout(params, spec)
    flat = layout.flatten(params)                     # {"float32/8bit": Tensor, "float32/32bit": Tensor}
    state = layout.init_state(flat)
    loss = lambda f, x: loss_fn(functional_call(model, layout.unflatten(f), (x,)))
    grads = torch.func.grad(loss)(flat, x)             # the same keys: one grad buffer per params buffer
    flat, state = bnbf.update(flat, grads, state, hparams, step)

:meth:`FlatLayout.unflatten` gives the leaves as views of the buffers (one ``split_with_sizes``, whose backward
writes every leaf's grad into one buffer); an ensemble stacks the buffers and vmaps over them.

Why the buffers step as the leaves would: a quantization block never spans two leaves, and the padding is zero
params with zero grads, whose update is zero under every elementwise rule and whose state stays at its initial
value, zero (:meth:`FlatLayout.init_state` starts it at zero also where a leaf's starts elsewhere, as Adagrad's
accumulator), so each block's absmax is its leaf's own. Leaves that would keep float32 state (fewer than
``min_8bit_size`` elements) get a buffer with float32 state. The one difference is the 8-bit state's stochastic
rounding, which hashes a block's index in its buffer: with that index, stepping the buffers equals stepping the
leaves one by one bit for bit on the reference path and in the interpreter, and within what two compiled variants of
the kernel round differently on the GPU (tests/test_flat.py). Each buffer is whole groups of 4 blocks, so that the
members of a stacked buffer keep 16-byte-aligned absmax (the kernels' aligned variant). What is per tensor applies
per buffer: ``update(..., max_unorm=)`` clips each buffer's update, and rules that scale by a tensor's norms (LAMB,
LARS) are refused.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from bnbf._dispatch import is_dtensor
from bnbf._host_checks import is_state
from bnbf.compose import path_name
from bnbf.functional import init_state
from bnbf.ops import vmap_level
from bnbf.packed import _plain_spec, _read_structure
from bnbf.quant import zero_code
from bnbf.rules import get_rule
from bnbf.state import OptimSpec


@dataclasses.dataclass(frozen=True)
class _Leaf:
    path: str
    key: str  # the buffer it lies in
    index: int  # its piece in the buffer's split (pieces alternate leaf, padding)
    shape: torch.Size
    dtype: torch.dtype


@dataclasses.dataclass(frozen=True, eq=False)
class FlatLayout:
    """Where each leaf of a param tree lies in the flat buffers (see the module's docstring).

    ``leaves`` in the tree's order; ``pieces[key]``: the sizes the buffer ``key`` splits into, leaf and padding
    alternately; ``specs[key]``: the spec its state is made with (``state_bits`` as the leaves would have it)."""

    spec: OptimSpec
    treespec: pytree.TreeSpec
    leaves: tuple[_Leaf, ...]
    pieces: dict[str, tuple[int, ...]]
    specs: dict[str, OptimSpec]

    def __reduce__(self) -> tuple:
        # plain values (specs as dicts, the structure as its JSON, leaves as tuples) through one function registered
        # with torch's safe globals: a checkpoint holding the layout beside its buffers and their state loads with
        # torch.load's default (weights_only=True), as they do
        return _rebuild_layout, (
            dataclasses.asdict(self.spec),
            _plain_spec(self.treespec),
            tuple((leaf.path, leaf.key, leaf.index, tuple(leaf.shape), leaf.dtype) for leaf in self.leaves),
            dict(self.pieces),
            {k: dataclasses.asdict(s) for k, s in self.specs.items()},
        )

    def flatten(self, tree: Any) -> dict[str, Tensor]:
        """New buffers holding the leaves of ``tree`` (params, grads, or anything shaped like the params),
        zeros between leaves. Differentiable and vmappable (it is one ``cat`` per buffer)."""
        parts: dict[str, list[Tensor]] = {k: [] for k in self.pieces}
        for leaf, t in zip(self.leaves, self._match(tree)):
            parts[leaf.key] += self._padded(leaf, t, 0)
        return {k: torch.cat(v) for k, v in parts.items()}

    def unflatten(self, flat: Any) -> Any:
        """The tree of leaves as views of the buffers ``flat`` (a mapping with this layout's keys)."""
        split = {key: buf.split_with_sizes(self.pieces[key]) for key, buf in self._buffers(flat)}
        views = [split[leaf.key][leaf.index].view(leaf.shape) for leaf in self.leaves]
        return pytree.tree_unflatten(views, self.treespec)

    def unflatten_state(self, state: Any) -> Any:
        """The per-leaf states (a tree shaped like the params) as views of the buffers' states ``state`` (from
        :meth:`init_state` or a step): for checkpoints in the per-param layout and :func:`bnbf.dequantize_state`."""
        if not isinstance(state, dict) or set(state) != set(self.pieces) or not all(map(is_state, state.values())):
            raise ValueError(f"expected a dict of bnbf states keyed like this layout's buffers {sorted(self.pieces)}")
        split = {}
        for key, sizes in self.pieces.items():
            s, block = state[key], state[key].layout.block_size
            # a rule that keeps no state (SGD without momentum) has no field to measure
            if s.layout.bits != self.specs[key].state_bits or (len(s) and s[0].shape != (sum(sizes),)):
                raise ValueError(f"state {key!r} is {type(s).__name__} of {tuple(s[0].shape)}, not the buffer's")
            blocks = [-(-n // block) if block else 0 for n in sizes[::2]]  # each leaf's, then the padding's
            blocks.append(sum(sizes) // block - sum(blocks) if block else 0)
            split[key] = [
                t.split_with_sizes(blocks) if name.endswith("_absmax") else t.split_with_sizes(sizes)[::2]
                for name, t in zip(s._fields, s)
            ]
        out = []
        for leaf in self.leaves:
            s, k = state[leaf.key], leaf.index // 2
            fields = [
                parts[k] if name.endswith("_absmax") else parts[k].view(leaf.shape)
                for name, parts in zip(s._fields, split[leaf.key])
            ]
            out.append(type(s)(*fields))
        return pytree.tree_unflatten(out, self.treespec)

    def flatten_state(self, state: Any) -> dict:
        """New buffers' states holding the per-leaf states ``state`` (a tree shaped like the params, as
        :func:`bnbf.init_state` makes it for the leaves: a checkpoint in the per-param layout), zero state in the
        padding. The inverse of :meth:`unflatten_state` but for the padding's state, which a step leaves at zero
        where it starts at zero."""
        states, treespec = pytree.tree_flatten(state, is_leaf=is_state)
        if treespec != self.treespec or not all(map(is_state, states)):
            raise ValueError(f"expected a tree of bnbf states with the layout's structure {self.treespec}")
        parts: dict[str, list[list[Tensor]]] = {}
        classes: dict[str, type] = {}
        for leaf, s in zip(self.leaves, states):
            want = classes.setdefault(leaf.key, type(s))
            expect = self.specs[leaf.key].layout_for(leaf.shape.numel())._replace(present=type(s).layout.present)
            if type(s) is not want or type(s).layout != expect:
                raise ValueError(f"the state of {leaf.path!r} is {type(s).__name__}, not the layout's for its buffer")
            for name, t, (shape, dtype) in zip(s._fields, s, type(s).layout.expected(leaf.shape).values()):
                if not isinstance(t, Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
                    got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
                    raise ValueError(
                        f"the state of {leaf.path!r}: {name} does not fit the leaf, expected {dtype} {shape}, got "
                        f"{got} (a state of other params, or stacked by vmap?)"
                    )
            cols = parts.setdefault(leaf.key, [[] for _ in s._fields])
            layout = type(s).layout
            for col, name, t in zip(cols, s._fields, s):
                if name.endswith("_absmax"):  # the padding inside a leaf's last block shares its absmax
                    pad = self.pieces[leaf.key][leaf.index + 1]
                    extra = (leaf.shape.numel() + pad) // layout.block_size - t.numel()
                    col += [t.reshape(t.numel()), t.new_zeros(extra)]
                    continue
                slot = next(sl for sl in layout.slots() if sl.name == name)
                col += self._padded(leaf, t, zero_code(layout.format, slot.signed) if layout.quantized else 0)
        return {k: classes[k](*(torch.cat(col) for col in parts[k])) for k in self.pieces}

    def init_state(self, flat: Any, hparams: Any = None) -> dict:
        """Initial state for the buffers: each leaf's as :func:`bnbf.init_state` makes it (with its buffer's
        ``specs[key]``, so leaves keep the state width they would have one by one), zero state in the padding
        (:meth:`flatten_state`). A nonzero initial state (Adagrad's accumulator) in the padding would share a
        leaf's last 8-bit block and hold its absmax once the leaf's values round below it."""
        found = vmap_level()
        if found is not None and found[1] == 0:  # an ensemble of no members (torch.cat has no batching at size 0)
            return {key: init_state(buf, self.specs[key], hparams) for key, buf in self._buffers(flat)}
        leaves = self.unflatten(flat)
        specs = pytree.tree_unflatten([self.specs[leaf.key] for leaf in self.leaves], self.treespec)
        return self.flatten_state(init_state(leaves, specs, hparams))

    def _padded(self, leaf: _Leaf, t: Tensor, fill: float) -> list[Tensor]:
        """``t`` (shaped like ``leaf``) flattened, then the padding after the leaf in its buffer, of ``fill``."""
        pad = self.pieces[leaf.key][leaf.index + 1]
        return [t.reshape(t.numel()), t.new_full((pad,), fill)] if pad else [t.reshape(t.numel())]

    def _buffers(self, flat: Any) -> list[tuple[str, Tensor]]:
        """``(key, buffer)`` of each of this layout's buffers in ``flat``, checked."""
        if not isinstance(flat, dict) or set(flat) != set(self.pieces):
            got = sorted(flat) if isinstance(flat, dict) else type(flat).__name__
            raise ValueError(f"expected a dict of this layout's buffers {sorted(self.pieces)}, got {got}")
        out = []
        for key, sizes in self.pieces.items():
            buf, n = flat[key], sum(sizes)
            if not isinstance(buf, Tensor):
                raise TypeError(f"flat buffer {key!r} must be a tensor, got {type(buf).__name__}")
            if buf.dim() != 1 or buf.numel() != n:
                raise ValueError(f"flat buffer {key!r} must be 1-D with {n} elements, got shape {tuple(buf.shape)}")
            if buf.dtype != self._dtypes[key]:
                raise TypeError(f"flat buffer {key!r} must be {self._dtypes[key]}, got {buf.dtype}")
            out.append((key, buf))
        return out

    @functools.cached_property  # unflatten runs in every step's loss: not a loop over the leaves per buffer
    def _dtypes(self) -> dict[str, torch.dtype]:
        return {leaf.key: leaf.dtype for leaf in self.leaves}

    def _match(self, tree: Any) -> list[Tensor]:
        leaves, treespec = pytree.tree_flatten(tree)
        if treespec != self.treespec:
            raise ValueError(f"the tree does not have the layout's structure: expected {self.treespec}, got {treespec}")
        for leaf, t in zip(self.leaves, leaves):
            if not isinstance(t, Tensor):
                raise TypeError(f"leaf {leaf.path!r} must be a tensor, got {type(t).__name__}")
            if t.shape != leaf.shape or t.dtype != leaf.dtype:
                raise ValueError(
                    f"leaf {leaf.path!r} is {tuple(t.shape)} {t.dtype}; the layout has {tuple(leaf.shape)} {leaf.dtype}"
                )
        return leaves


def _rebuild_layout(spec: Any, treespec: Any, leaves: Any, pieces: Any, specs: Any) -> FlatLayout:
    """A pickled :class:`FlatLayout` (:meth:`FlatLayout.__reduce__`) from its plain values, each checked as
    :func:`flat_layout` makes it (a checkpoint is input: a leaf's piece that did not fit it would have
    :meth:`FlatLayout.unflatten` give views of other leaves' elements); ``ValueError`` naming the first that is not."""

    def bad(what: str) -> ValueError:
        return ValueError(f"not a bnbf FlatLayout: {what}")

    def ints(xs: Any) -> bool:
        return type(xs) is tuple and all(type(x) is int and x >= 0 for x in xs)

    def optim_spec(plain: Any, what: str) -> OptimSpec:
        if type(plain) is not dict:
            raise bad(f"{what} is a {type(plain).__name__}, not an OptimSpec's dict")
        try:
            return OptimSpec(**plain)
        except (TypeError, ValueError) as e:  # unknown fields, or values the spec refuses
            raise bad(f"{what} is not an OptimSpec ({type(e).__name__}: {e})") from None

    # the structure's kinds before it is decoded: a TreeSpec (pickled with weights_only=False) or its JSON
    if type(treespec) is tuple and len(treespec) == 2 and treespec[0] == "treespec" and type(treespec[1]) is str:
        treespec = _read_structure(treespec, bad)
    if not isinstance(treespec, pytree.TreeSpec):
        raise bad(f"its structure is a {type(treespec).__name__}, not a pytree structure bnbf writes")
    spec = optim_spec(spec, "its spec")
    if not (type(pieces) is dict and pieces and all(type(k) is str for k in pieces)):
        raise bad("its pieces are not a dict keyed by buffer names")
    for key, sizes in pieces.items():
        if not (ints(sizes) and sizes and len(sizes) % 2 == 0):
            raise bad(f"buffer {key!r}'s pieces are not pairs of non-negative ints (a leaf's size, its padding)")
        if spec.block_size and sum(sizes) % (4 * spec.block_size):
            raise bad(f"buffer {key!r} is not whole groups of 4 blocks of {spec.block_size}")
    if not (type(specs) is dict and set(specs) == set(pieces)):
        raise bad(f"its specs are not one per buffer {sorted(pieces)}")
    specs = {k: optim_spec(v, f"the spec of buffer {k!r}") for k, v in specs.items()}
    for key, s in specs.items():
        if (s.rule, s.block_size) != (spec.rule, spec.block_size):
            raise bad(f"the spec of buffer {key!r} has another rule or block size than the layout's")
    if not (type(leaves) is tuple and len(leaves) == treespec.num_leaves):
        got = f"{len(leaves)} leaves" if type(leaves) is tuple else f"leaves as a {type(leaves).__name__}"
        raise bad(f"it has {got}, its structure {treespec.num_leaves} leaves as a tuple")
    made, held, dtypes = [], {k: 0 for k in pieces}, {}
    for i, leaf in enumerate(leaves):
        if not (
            type(leaf) is tuple
            and len(leaf) == 5
            and all(map(isinstance, leaf, (str, str, int, tuple, torch.dtype)))
            and ints(leaf[3])
        ):
            raise bad(f"leaf {i} is not (path, buffer, index, shape of ints, dtype)")
        path, key, index, shape, dtype = leaf
        if key not in pieces:
            raise bad(f"leaf {path!r} lies in buffer {key!r}, which has no pieces")
        sizes = pieces[key]
        # a buffer's leaves lie in the tree's order, each at the next even piece (flatten concatenates them so)
        if type(index) is not int or index != held[key]:
            raise bad(f"leaf {path!r} is piece {index!r} of buffer {key!r}, not the next leaf's piece {held[key]}")
        if index >= len(sizes):
            raise bad(f"leaf {path!r} is piece {index} of buffer {key!r}, which has {len(sizes)}")
        if sizes[index] != math.prod(shape):
            raise bad(f"leaf {path!r} of shape {shape} has {math.prod(shape)} elements, its piece {sizes[index]}")
        if spec.block_size and sum(sizes[:index]) % spec.block_size:  # a block never spans two leaves
            raise bad(f"leaf {path!r} does not start a whole number of blocks into buffer {key!r}")
        if not dtype.is_floating_point or dtypes.setdefault(key, dtype) != dtype:
            raise bad(f"leaf {path!r} is {dtype}, not the floating point dtype of buffer {key!r}'s leaves")
        held[key] = index + 2
        made.append(_Leaf(path, key, index, torch.Size(shape), dtype))
    for key, n in held.items():
        if n != len(pieces[key]):
            raise bad(f"buffer {key!r} has {len(pieces[key]) // 2} leaves' pieces, its leaves hold {n // 2}")
    return FlatLayout(spec, treespec, tuple(made), dict(pieces), specs)


torch.serialization.add_safe_globals([_rebuild_layout])


def flat_layout(params: Any, spec: OptimSpec, *, group: Callable[[str, Tensor], str] | None = None) -> FlatLayout:
    """The :class:`FlatLayout` of a param tree under ``spec``.

    Leaves share a buffer when they have the same ``group(path, param)`` (a string; e.g. ``"no_decay"`` for
    biases, so that the buffers can take different hyperparameters), param dtype and state width. Keys read
    ``"[group/]dtype/8bit"`` or ``".../32bit"``, in the order the leaves first appear. ``path`` is the leaf's
    ``torch.func.functional_call`` name."""
    if not isinstance(spec, OptimSpec):
        raise TypeError(f"spec must be an OptimSpec, got {type(spec).__name__}")
    if get_rule(spec.rule).norms is not None:
        raise ValueError(
            f"rule {spec.rule!r} scales each tensor's update by the tensor's norms; in a flat buffer its leaves would "
            "share one norm: step the params as a tree"
        )
    with_paths, treespec = pytree.tree_flatten_with_path(params)
    if not with_paths:
        raise ValueError("flat_layout needs at least one tensor")
    align = spec.block_size
    pieces: dict[str, list[int]] = {}
    specs: dict[str, OptimSpec] = {}
    leaves = []
    for kp, p in with_paths:
        path = path_name(kp)
        if not isinstance(p, Tensor):
            raise TypeError(f"leaf {path!r} must be a tensor, got {type(p).__name__}")
        if is_dtensor(p):
            raise TypeError(
                f"leaf {path!r} is a DTensor (FSDP2): flat_layout lays out local params; use bnbf.distributed"
            )
        if not p.dtype.is_floating_point:
            raise TypeError(f"leaf {path!r}: optimizers need floating point params, got {p.dtype}")
        bits = spec.layout_for(p.numel()).bits
        key = f"{str(p.dtype).removeprefix('torch.')}/{bits}bit"
        if group is not None:
            name = group(path, p)
            if not isinstance(name, str) or not name:
                raise TypeError(f"group({path!r}, param) must return a non-empty str, got {name!r}")
            key = f"{name}/{key}"
        sizes = pieces.setdefault(key, [])
        # 8-bit buffers keep 8 bits however few elements they hold; 32-bit ones keep 32
        specs.setdefault(key, dataclasses.replace(spec, state_bits=bits, min_8bit_size=0))
        leaves.append(_Leaf(path, key, len(sizes), p.shape, p.dtype))
        sizes += [p.numel(), -p.numel() % align]
    for sizes in pieces.values():  # buffers of whole groups of 4 blocks: stacked, each member's absmax 16-byte aligned
        sizes[-1] += -sum(sizes) % (4 * align)
    return FlatLayout(spec, treespec, tuple(leaves), {k: tuple(v) for k, v in pieces.items()}, specs)

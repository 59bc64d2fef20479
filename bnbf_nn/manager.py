"""``GlobalOptimManager``: per-parameter optimizer settings, as in bitsandbytes.

Overrides are keyed by the parameter object itself (held weakly), so they survive ``model.to(device)``
(which keeps the ``Parameter`` objects) and never leak or get mixed up when a parameter is freed and its
``id`` reused. Every optimizer of :mod:`bnbf_nn` reads the overrides of its parameters:

- settings that decide how a state is stored (``optim_bits``, ``min_8bit_size``, ``state_format``) apply
  when the parameter's state is created (its first step);
- hyperparameters (``betas``, ``eps``, ``weight_decay``, ``momentum``, ``skip_zeros``, ``max_unorm``...)
  replace the group's value on every step, from the step after the override on;
- overrides made through bitsandbytes' own ``GlobalOptimManager`` (``bitsandbytes.nn.StableEmbedding``'s
  ``optim_bits=32``, say, when a model keeps bitsandbytes' layers) count too, as bitsandbytes' optimizers read
  them: its module overrides, and its per-parameter ones (keyed by ``id(p)``, as bitsandbytes keys them; those
  it keys by position, for ``register_parameters`` called after ``override_config``, are not read). They
  rank below this manager's;
- ``lr`` is relative to the group: it is the parameter's learning rate while the group's ``lr`` is at its
  starting value (``group["initial_lr"]``, which LR schedulers set, or the ``lr`` the group was created
  with), and every change to the group's ``lr`` (a scheduler's or your own) scales it by the same factor.
  bitsandbytes instead pins the parameter at the override's value, so a scheduler silently stops acting on it.

Example (bitsandbytes' own, with ``bnbf_nn`` for ``bnb.optim``)::

    mng = bnbf_nn.GlobalOptimManager.get_instance()
    model = MyModel()
    mng.register_parameters(model.parameters())  # 1. register parameters while still on CPU
    model = model.cuda()
    adam = bnbf_nn.Adam(model.parameters(), lr=0.001, optim_bits=8)  # 8-bit state for every parameter
    mng.override_config(model.fc1.weight, "optim_bits", 32)  # 2. ... but fp32 state for this one
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["GlobalOptimManager"]


class GlobalOptimManager:
    """The process-wide registry of per-parameter optimizer settings (get it with :meth:`get_instance`)."""

    _instance: GlobalOptimManager | None = None

    def __init__(self):
        raise RuntimeError("Call GlobalOptimManager.get_instance() instead")

    @classmethod
    def get_instance(cls) -> GlobalOptimManager:
        """The one manager (made on first use)."""
        if cls._instance is None:
            inst = cls.__new__(cls)
            inst.initialize()
            cls._instance = inst
        return cls._instance

    def initialize(self) -> None:
        """Forget every registration and override."""
        self._configs: WeakIdKeyDictionary = WeakIdKeyDictionary()  # param -> {setting: value}
        self._modules: list[tuple[weakref.ref, str, dict]] = []  # (module, attribute, settings)
        # bumped on every change (never reset): optimizers rebuild their cached per-group plans
        self._version = getattr(self, "_version", 0) + 1

    @property
    def version(self) -> Any:
        """Changes whenever an override does, here or in bitsandbytes' manager (optimizers compare it to
        rebuild their cached plans)."""
        bnb = _bnb_manager()
        return self._version if bnb is None else (self._version, _bnb_overrides_key(bnb))

    def register_parameters(self, params: Iterable[Any]) -> None:
        """Register parameters (tensors, or param-group dicts as an optimizer takes them).

        Overrides are keyed by the parameter object, so registering is optional here; it is kept so that
        code written for bitsandbytes (register on the CPU, then move the model) runs unchanged.
        """
        for item in params:
            tensors = item["params"] if isinstance(item, Mapping) else [item]
            if isinstance(tensors, torch.Tensor):
                tensors = [tensors]
            for p in tensors:
                if not isinstance(p, torch.Tensor):
                    raise TypeError(f"register_parameters takes tensors or param groups, got {type(p).__name__}")

    def override_config(
        self, parameters: Any, key: str | None = None, value: Any = None, key_value_dict: Mapping | None = None
    ) -> None:
        """Override settings for one parameter or several.

        Args:
            parameters: a tensor or an iterable of tensors.
            key, value: one setting (``"optim_bits"``, ``"lr"``, ``"betas"``...) and its value (None: no
                override, as bitsandbytes skips it).
            key_value_dict: several settings at once (instead of ``key``/``value``; given with a ``key`` whose
                ``value`` is None, the dict is applied and the key ignored, as bitsandbytes does).
        """
        if key is not None and value is not None:
            if key_value_dict is not None:
                raise ValueError("give either key and value or key_value_dict, not both")
            settings = {key: value}
        elif key_value_dict is not None:  # a key without a value is ignored beside it, as in bitsandbytes
            settings = dict(key_value_dict)
        elif key is None:
            raise ValueError("override_config needs key and value, or key_value_dict")
        else:
            settings = {}
        # a None value overrides nothing, as in bitsandbytes (whose override_config skips it)
        settings = {k: v for k, v in settings.items() if v is not None}
        tensors = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        for p in tensors:  # all checked before any is changed
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"override_config takes tensors, got {type(p).__name__}")
        for p in tensors:
            self._configs.setdefault(p, {}).update(settings)
        self._version += 1

    def register_module_override(self, module: torch.nn.Module, param_name: str, config: Mapping) -> None:
        """Override settings for ``module.<param_name>``, whatever tensor that attribute holds when an optimizer
        creates its state (the module is held weakly)."""
        self._modules.append((weakref.ref(module), param_name, dict(config)))
        self._version += 1

    def configs_for(self, params: Iterable[torch.Tensor]) -> dict[int, dict]:
        """``{id(p): settings}`` for those of ``params`` that have overrides: bitsandbytes' manager's module
        overrides, then its per-parameter ones, then this manager's module overrides, then the parameter's own
        here (each later one wins)."""
        wanted = {id(p): p for p in params}
        out: dict[int, dict] = {}

        def by_module(module: Any, name: str, config: Mapping) -> None:
            t = getattr(module, name, None)
            if isinstance(t, torch.Tensor) and wanted.get(id(t)) is t:
                out.setdefault(id(t), {}).update(config)

        bnb = _bnb_manager()
        if bnb is not None:
            for module, name, config in bnb.module_weight_config_triple:
                by_module(module, name, config)
            for i in wanted.keys() & bnb.pid2config.keys():
                out.setdefault(i, {}).update(bnb.pid2config[i])
        alive = []
        for ref, name, config in self._modules:
            module = ref()
            if module is not None:
                alive.append((ref, name, config))
                by_module(module, name, config)
        self._modules = alive
        for i, p in wanted.items():
            own = self._configs.get(p)
            if own:
                out.setdefault(i, {}).update(own)
        return out


def _bnb_manager() -> Any:
    """bitsandbytes' manager where bitsandbytes is imported and its manager made (never imports it)."""
    module = sys.modules.get("bitsandbytes.optim.optimizer")
    manager = getattr(getattr(module, "GlobalOptimManager", None), "_instance", None)
    return manager if hasattr(manager, "pid2config") and hasattr(manager, "module_weight_config_triple") else None


def _bnb_overrides_key(bnb: Any) -> str:
    # its overrides are plain dicts edited in place: their text changes with them (a few entries: cheap)
    return repr((bnb.pid2config, [(id(m), name, c) for m, name, c in bnb.module_weight_config_triple]))

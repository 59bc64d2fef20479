"""bnbf: block-wise 8-bit optimizers for PyTorch with a pure functional core and fused Triton kernels.

>>> import torch, bnbf
>>> params = {"w": torch.randn(64, 64)}
>>> state = bnbf.init_state(params, bnbf.OptimSpec(rule="adamw", state_bits=8, min_8bit_size=0))
>>> grads = {"w": torch.randn(64, 64)}
>>> params, state = bnbf.update(params, grads, state, {"lr": 1e-3}, step=1)
"""

import warnings

with warnings.catch_warnings():
    # torch 2.13 warns "Failed to initialize NumPy: No module named 'numpy'" while importing itself where
    # numpy is not installed (torch/_subclasses/functional_tensor.py, a torch.device call at class level
    # probes for numpy). bnbf uses no numpy; where bnbf is the first to import torch the warning is noise.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    import torch  # noqa: F401

# bnbf.compose: mixed trees, schedules, updates, clipping; bnbf.distributed: FSDP2's DTensor params. Both call
# the core's functions only when called, so the import order does not matter.
from bnbf import compose, distributed, paged
from bnbf._dispatch import use_triton
from bnbf.compose import apply_updates, apply_updates_, clip_grad_norm, clip_grad_norm_, updates
from bnbf.flat import FlatLayout, flat_layout
from bnbf.functional import dequantize_state, hparams_for, init_state, update, update_
from bnbf.packed import PackedState, pack_state
from bnbf.plan import Plan, plan
from bnbf.quant import create_dynamic_map, dequantize_blockwise, quantize_blockwise
from bnbf.rules import RULES, register_rule
from bnbf.state import Layout, OptimSpec, state_nbytes

__version__ = "0.1.0"

__all__ = [
    "RULES",
    "apply_updates",
    "apply_updates_",
    "clip_grad_norm",
    "clip_grad_norm_",
    "compose",
    "distributed",
    "paged",
    "register_rule",
    "updates",
    "FlatLayout",
    "Layout",
    "OptimSpec",
    "PackedState",
    "Plan",
    "create_dynamic_map",
    "dequantize_blockwise",
    "dequantize_state",
    "flat_layout",
    "hparams_for",
    "init_state",
    "pack_state",
    "plan",
    "quantize_blockwise",
    "state_nbytes",
    "update",
    "update_",
    "use_triton",
]

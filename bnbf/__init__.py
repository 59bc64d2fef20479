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

from bnbf._dispatch import use_triton
from bnbf.functional import dequantize_state, hparams_for, init_state, update, update_
from bnbf.plan import Plan, plan
from bnbf.quant import create_dynamic_map, dequantize_blockwise, quantize_blockwise
from bnbf.rules import RULES
from bnbf.state import Layout, OptimSpec, state_nbytes

__version__ = "0.1.0"

__all__ = [
    "RULES",
    "Layout",
    "OptimSpec",
    "Plan",
    "create_dynamic_map",
    "dequantize_blockwise",
    "dequantize_state",
    "hparams_for",
    "init_state",
    "plan",
    "quantize_blockwise",
    "state_nbytes",
    "update",
    "update_",
    "use_triton",
]

"""bnbf_nn: drop-in torch.optim optimizers with bitsandbytes' names, arguments and checkpoints, on bnbf.

Change ``import bitsandbytes as bnb`` to ``import bnbf_nn as bnb`` (``bnb.optim.AdamW8bit``,
``bnb.optim.GlobalOptimManager``, ``bnb.nn.StableEmbedding`` keep working), or use the names directly:

    >>> import torch, bnbf_nn
    >>> model = torch.nn.Linear(128, 128)
    >>> opt = bnbf_nn.AdamW8bit(model.parameters(), lr=1e-3)
    >>> model(torch.randn(4, 128)).sum().backward()
    >>> opt.step()

The optimizers are thin: they turn param groups into bnbf specs and hyperparameters and call
:func:`bnbf.update_`. See :mod:`bnbf_nn.optim` for the arguments and what differs from bitsandbytes.
"""

import bnbf  # noqa: F401, I001  (first: it imports torch without torch's NumPy warning, see bnbf/__init__.py)
from bnbf_nn import nn, optim
from bnbf_nn._checkpoint import for_bitsandbytes
from bnbf_nn.manager import GlobalOptimManager
from bnbf_nn.nn import Embedding, StableEmbedding
from bnbf_nn.optim import *  # noqa: F403  (the generated classes: Adam, Adam8bit, Adam32bit, ...)
from bnbf_nn.optim import FAMILIES, Optimizer1State, Optimizer2State, Optimizer8bit

__all__ = [
    "nn",
    "optim",
    "Embedding",
    "GlobalOptimManager",
    "StableEmbedding",
    "for_bitsandbytes",
    "FAMILIES",
    "Optimizer1State",
    "Optimizer2State",
    "Optimizer8bit",
] + [n for n in optim.__all__ if n not in ("FAMILIES", "Family", "GlobalOptimManager") and n[0] != "O"]

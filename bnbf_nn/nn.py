"""Embeddings whose weights keep 32-bit optimizer state, as in bitsandbytes.nn.

8-bit state quantizes a block of 256 values against the block's largest one; an embedding's rows see very
different gradient magnitudes (frequent and rare tokens), so the 8-bit optimizers paper keeps their state in
32 bits. Both classes register ``{"optim_bits": 32}`` for their ``weight`` with :class:`GlobalOptimManager`,
which every bnbf_nn optimizer reads when it creates the weight's state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from bnbf_nn.manager import GlobalOptimManager

__all__ = ["Embedding", "StableEmbedding"]


class Embedding(torch.nn.Embedding):
    """``torch.nn.Embedding`` with Xavier-uniform initialisation and 32-bit optimizer state for its weight.

    Takes ``torch.nn.Embedding``'s arguments.

    Example:
        >>> emb = Embedding(1000, 64)
        >>> emb(torch.tensor([[1, 2, 3]])).shape
        torch.Size([1, 3, 64])
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight: Tensor | None = None,
        device=None,
        dtype=None,
        *,
        _freeze: bool = False,  # torch's from_pretrained passes it (bitsandbytes' classes refuse it)
    ) -> None:
        super().__init__(
            num_embeddings,
            embedding_dim,
            padding_idx,
            max_norm,
            norm_type,
            scale_grad_by_freq,
            sparse,
            _weight,
            _freeze,
            device=device,
            dtype=dtype,
        )
        GlobalOptimManager.get_instance().register_module_override(self, "weight", {"optim_bits": 32})

    def reset_parameters(self) -> None:
        torch.nn.init.xavier_uniform_(self.weight)
        self._fill_padding_idx_with_zero()


class StableEmbedding(Embedding):
    """The 8-bit optimizers paper's stable embedding: Xavier-uniform initialisation, a ``LayerNorm`` after the
    lookup (computed in the default float dtype, returned in the weight's dtype) and 32-bit optimizer state.

    Takes ``torch.nn.Embedding``'s arguments; ``self.norm`` is the ``LayerNorm``.

    Example:
        >>> emb = StableEmbedding(1000, 64)
        >>> out = emb(torch.tensor([[1, 2, 3]]))
        >>> out.shape, bool(out.mean(-1).abs().max() < 1e-5)  # each row normalised; a rounded mean printed -0.0
        (torch.Size([1, 3, 64]), True)
    """

    def __init__(self, *args, **kwargs) -> None:  # torch.nn.Embedding's arguments, as Embedding takes them
        super().__init__(*args, **kwargs)
        self.norm = torch.nn.LayerNorm(self.embedding_dim, device=self.weight.device)

    def forward(self, input: Tensor) -> Tensor:
        emb = F.embedding(
            input, self.weight, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse
        )
        return self.norm(emb.to(torch.get_default_dtype())).to(self.weight.dtype)

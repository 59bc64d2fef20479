"""The README's torch.func section runs as written: the meta-gradient, the vmapped ensemble, the compiled
training step (CPU and CUDA), the flat params and the CUDA-graph capture (its block does nothing without a GPU).
Each block is also checked for what its text claims."""

from __future__ import annotations

import inspect
import re
import sys
import types
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

README = Path(__file__).resolve().parents[1] / "README.md"


def _section_blocks(heading: str) -> list[str]:
    text = README.read_text()
    section = text[text.index(heading) :]
    section = section[: section.index("\n## ", 1)]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


@pytest.mark.surface  # the README's code runs, on the reference path here and the kernels on the GPU
def test_torch_func_section_runs(capsys):
    blocks = _section_blocks("## torch.func, torch.compile, CUDA graphs")
    assert len(blocks) == 5
    # a module of its own in sys.modules: Dynamo looks the compiled function's module up there
    module = types.ModuleType("readme_torch_func")
    sys.modules[module.__name__] = module
    scope = module.__dict__
    exec(compile(blocks[0], "README.md meta-gradient", "exec"), scope)
    lr = scope["lr"]
    assert lr.grad is not None and torch.isfinite(lr.grad) and lr.grad != 0, "a real derivative with respect to lr"
    exec(compile(blocks[1], "README.md ensemble", "exec"), scope)
    out = capsys.readouterr().out
    assert "torch.Size([8, 256, 64]) torch.Size([8, 64])" in out, out
    torch._dynamo.reset()
    counters.clear()
    exec(compile(blocks[2], "README.md compile", "exec"), scope)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # once, with lr and step changing
    assert not counters["graph_break"], dict(counters["graph_break"])
    exec(compile(blocks[3], "README.md flat params", "exec"), scope)
    assert "{'float32/8bit': (16384,), 'float32/32bit': (3072,)}" in capsys.readouterr().out
    views = scope["layout"].unflatten(scope["flat"])  # the steps moved the leaves, through the buffers
    assert not torch.equal(views["0.weight"], dict(scope["model"].named_parameters())["0.weight"])
    exec(compile(blocks[4], "README.md capture", "exec"), scope)


@pytest.mark.surface
def test_migration_block_runs_and_resolves_bitsandbytes_names():
    """The "Migrating from bitsandbytes" block: both imports run, and the names a bitsandbytes user's code reaches
    through them (``bnb.optim.*``, ``bnb.nn.StableEmbedding`` and ``bnb.nn.Embedding``) are bnbf_nn's."""
    (block,) = _section_blocks("## Migrating from bitsandbytes")
    scope: dict = {}
    exec(compile(block, "README.md migrating", "exec"), scope)
    import bnbf_nn

    bnb = scope["bnb"]
    assert scope["AdamW8bit"] is bnbf_nn.AdamW8bit
    assert bnb.optim.AdamW8bit is bnbf_nn.AdamW8bit and bnb.optim.PagedAdamW8bit is bnbf_nn.PagedAdamW8bit
    assert bnb.optim.GlobalOptimManager is bnbf_nn.GlobalOptimManager
    assert bnb.nn.StableEmbedding is bnbf_nn.StableEmbedding and bnb.nn.Embedding is bnbf_nn.Embedding
    # the block's comment: no other name of bitsandbytes.nn (Linear8bitLt, Int8Params...), no bnb.functional
    assert bnb.nn.__all__ == ["Embedding", "StableEmbedding"] and not hasattr(bnb, "functional")
    w = torch.nn.Parameter(torch.ones(4))
    w.grad = torch.ones(4)
    bnb.optim.AdamW8bit([w], lr=0.1, weight_decay=0.0).step()
    torch.testing.assert_close(w.detach(), torch.full((4,), 0.9))  # Adam's first step: lr times the grad's sign


@pytest.mark.surface
def test_embeddings_take_bitsandbytes_arguments():
    """The "Migrating from bitsandbytes" section: ``StableEmbedding`` and ``Embedding`` take ``bitsandbytes.nn``'s
    arguments in its order with its defaults; ``Embedding`` also takes ``dtype``, last; ``StableEmbedding``'s own
    signature is ``(*args, **kwargs)``, passed on to ``Embedding``."""
    bnb_nn = pytest.importorskip("bitsandbytes.nn")
    import bnbf_nn

    def params(cls) -> list[tuple]:
        return [(p.name, p.kind, p.default) for p in inspect.signature(cls).parameters.values()]

    ours = params(bnbf_nn.Embedding)
    assert ours[:-2] == params(bnb_nn.Embedding)
    assert ours[-2:] == [
        ("dtype", inspect.Parameter.POSITIONAL_OR_KEYWORD, None),
        ("_freeze", inspect.Parameter.KEYWORD_ONLY, False),  # torch's, for from_pretrained
    ]
    assert ours[:-1] == params(bnb_nn.StableEmbedding)
    assert [p.kind for p in inspect.signature(bnbf_nn.StableEmbedding).parameters.values()] == [
        inspect.Parameter.VAR_POSITIONAL,
        inspect.Parameter.VAR_KEYWORD,
    ]
    # every argument reaches Embedding, positionally as by name (``_weight`` given: torch keeps that tensor as it is)
    weight = torch.randn(10, 4)
    values = (10, 4, 0, 1.0, 1.0, True, False)
    names = ("num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")
    for cls in (bnbf_nn.Embedding, bnbf_nn.StableEmbedding):
        made = [
            cls(*values, None, "cpu", torch.float64),
            cls(**dict(zip(names, values)), _weight=None, device="cpu", dtype=torch.float64),
            cls(*values, weight),
            cls(**dict(zip(names, values)), _weight=weight),
        ]
        for k, emb in enumerate(made):
            assert (emb.padding_idx, emb.max_norm, emb.norm_type, emb.scale_grad_by_freq, emb.sparse) == values[2:]
            assert emb.weight.dtype == (torch.float64 if k < 2 else torch.float32)
            assert (emb.weight.data_ptr() == weight.data_ptr()) == (k >= 2)

"""bnbf_nn inside the training frameworks its users run: Hugging Face transformers' Trainer, accelerate and
Lightning, on the CPU with tiny models.

Each test imports its framework with ``pytest.importorskip`` (CI does not install them). A resumed run is
compared bit for bit with the same run uninterrupted (min_8bit_size small, so the tiny params get 8-bit state);
the frameworks' own code does the saving, loading and moving of optimizer state.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import bnbf_nn
from bnbf_nn import _checkpoint

MIN8 = 16  # every weight and bias of the tiny models below gets 8-bit state


def _data(n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _same_params(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def _views_live(opt: torch.optim.Optimizer) -> None:
    """Every record holds bitsandbytes' names, flat and nested, as views of the state the kernels step."""
    for p, rec in opt.state.items():
        if "state" not in rec:
            continue
        nested = rec[_checkpoint.QUANT_KEY]
        homes = {t.untyped_storage().data_ptr() for t in rec["state"]}
        assert "state1" in nested, sorted(rec)
        for k, v in nested.items():
            assert rec[k] is v, f"flat and nested {k} are one tensor"
            if not k.startswith("qmap"):
                assert v.untyped_storage().data_ptr() in homes, f"{k} of {tuple(p.shape)} is not a view of its state"


# ---- Lightning ----------------------------------------------------------------------------------------


def _lightning_module(pl):
    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()

        def training_step(self, batch, i):
            x, y = batch
            return ((self.net(x) - y) ** 2).mean()

        def configure_optimizers(self):
            opt = bnbf_nn.AdamW8bit(self.parameters(), lr=1e-2, min_8bit_size=MIN8)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)]

    return Module()


def _lightning_fit(pl, epochs: int, ckpt_path=None, save=None):
    from torch.utils.data import DataLoader, TensorDataset

    module = _lightning_module(pl)
    trainer = pl.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=0.5,
    )
    trainer.fit(module, DataLoader(TensorDataset(*_data()), batch_size=4), ckpt_path=ckpt_path)
    if save:
        trainer.save_checkpoint(save)
    return module, trainer


def test_lightning_resume_continues_as_the_uninterrupted_run(tmp_path):
    """fit, trainer.save_checkpoint, fit(ckpt_path=) in a fresh Trainer: Lightning loads the state dict and moves
    each record with its own mover (on restore and at teardown); the resumed run ends bit for bit where the
    uninterrupted one does, and the records keep bitsandbytes' names as live views of their state."""
    pl = pytest.importorskip("lightning.pytorch")
    ckpt = os.fspath(tmp_path / "epoch1.ckpt")
    whole, _ = _lightning_fit(pl, 2)
    _, first = _lightning_fit(pl, 1, save=ckpt)
    _views_live(first.optimizers[0])  # after the teardown's move
    resumed, second = _lightning_fit(pl, 2, ckpt_path=ckpt)
    assert _same_params(whole, resumed)
    _views_live(second.optimizers[0])


@pytest.mark.parametrize("name", ["AdamW8bit", "Lion8bit", "AdamW", "SGD8bit"])
def test_lightning_mover_to_another_device_moves_the_state(name):
    """Lightning's teardown moves every optimizer's state to the CPU with ``_optimizer_to_device`` (its
    restore moves it to the root device), assigning each of a record's entries a copy on that device. That
    refused every entry of a bnbf_nn record (a view takes only tensors on its own device), so a fit on a GPU
    raised at its end. The moved copies are kept: the state ends up on the new device, as torch's AdamW's does,
    and bitsandbytes' names are views of it again at the next state_dict. ``meta`` stands for the other device."""
    pytest.importorskip("lightning.pytorch")
    from lightning.fabric.utilities.optimizer import _optimizer_to_device

    net = _net()
    opt = getattr(bnbf_nn, name)(net.parameters(), lr=1e-2, min_8bit_size=MIN8)
    x, y = _data(4)
    ((net(x) - y) ** 2).mean().backward()
    opt.step()
    _optimizer_to_device(opt, torch.device("meta"))
    saved = opt.state_dict()["state"]
    for p in net.parameters():
        rec = opt.state[p]
        assert all(t.device.type == "meta" for t in rec["state"]), name
        nested = rec[_checkpoint.QUANT_KEY]
        assert all(rec[k] is v and v.device.type == "meta" for k, v in nested.items()), name
    assert all(t.device.type == "meta" for e in saved.values() for t in e[_checkpoint.QUANT_KEY].values())
    if name != "SGD8bit":  # SGD without momentum has no state to be on a device
        ((net(x) - y) ** 2).mean().backward()
        with pytest.raises(ValueError, match="is on meta but the param is on cpu"):
            opt.step()  # as torch's AdamW refuses a state left on another device than its param

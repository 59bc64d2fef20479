"""bnbf_nn inside the training frameworks its users run: Hugging Face transformers' Trainer, accelerate and
Lightning, on the CPU with tiny models.

Each test imports its framework with ``pytest.importorskip`` (CI does not install them). A resumed run is
compared bit for bit with the same run uninterrupted (min_8bit_size small, so the tiny params get 8-bit state);
the frameworks' own code does the saving, loading and moving of optimizer state.
"""

from __future__ import annotations

import inspect
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
    if name != "SGD8bit":  # a view given a copy elsewhere while its state stays: refused, its values would be lost
        with pytest.raises(ValueError, match="is a view of the state"):
            opt.state[net[0].weight]["state1"] = opt.state[net[0].weight]["state1"].to("meta")
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


# ---- Hugging Face transformers Trainer -----------------------------------------------------------------


def _hf_dataset():
    from torch.utils.data import Dataset

    class Pairs(Dataset):
        def __init__(self) -> None:
            g = torch.Generator().manual_seed(0)
            self.ids, self.y = torch.randint(0, 50, (32, 6), generator=g), torch.randn(32, 4, generator=g)

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.y[i]}

    return Pairs()


class _EmbedNet(nn.Module):
    """An embedding (32-bit state through a GlobalOptimManager override, as bitsandbytes' docs advise), a
    LayerNorm (the Trainer's no-decay group) and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.ln, self.out = nn.Embedding(50, 32), nn.LayerNorm(32), nn.Linear(32, 4)

    def forward(self, input_ids, labels=None):
        h = self.out(self.ln(self.emb(input_ids)).mean(1))
        return {"loss": ((h - labels) ** 2).mean(), "logits": h}


def _hf_train(transformers, out, how: str, resume=None):
    model = _EmbedNet()
    bnbf_nn.GlobalOptimManager.get_instance().register_module_override(model.emb, "weight", {"optim_bits": 32})
    args = transformers.TrainingArguments(
        output_dir=os.fspath(out),
        max_steps=8,
        save_steps=4,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_grad_norm=0.5,
        weight_decay=0.1,
        warmup_steps=2,
        lr_scheduler_type="cosine",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    kw = {"lr": 1e-2, "min_8bit_size": MIN8}
    if how == "optimizers":
        opt = bnbf_nn.AdamW8bit(model.parameters(), **kw)
        given = {"optimizers": (opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s)))}
    else:
        given = {"optimizer_cls_and_kwargs": (bnbf_nn.AdamW8bit, kw)}
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_hf_dataset(), **given)
    trainer.train(resume_from_checkpoint=resume)
    return model, trainer


@pytest.mark.parametrize("how", ["optimizers", "optimizer_cls_and_kwargs"])
def test_hf_trainer_resume_continues_as_the_uninterrupted_run(tmp_path, how):
    """The Trainer saves optimizer.pt (torch.save of state_dict) and loads it with weights_only=True into a
    fresh Trainer's optimizer: with gradient accumulation, max_grad_norm and a schedule, the resumed run ends
    bit for bit where the uninterrupted one does, the embedding's state still 32-bit and the others 8-bit."""
    transformers = pytest.importorskip("transformers")
    if how not in ("optimizers", *inspect.signature(transformers.Trainer).parameters):
        pytest.skip("this transformers has no optimizer_cls_and_kwargs")
    whole, _ = _hf_train(transformers, tmp_path / "a", how)
    resumed, trainer = _hf_train(transformers, tmp_path / "b", how, resume=tmp_path / "a" / "checkpoint-4")
    assert _same_params(whole, resumed)
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    assert opt.state[resumed.emb.weight]["state1"].dtype == torch.float32
    assert opt.state[resumed.out.weight]["state1"].dtype == torch.uint8
    _views_live(opt)


# ---- accelerate --------------------------------------------------------------------------------------------


def _accelerate_run(accelerate, steps: range, load=None, save=None):
    from torch.utils.data import DataLoader, TensorDataset

    accelerate.utils.set_seed(0)
    net = _net()
    opt = bnbf_nn.AdamW8bit(net.parameters(), lr=1e-2, min_8bit_size=MIN8)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    net, opt, loader, sched = acc.prepare(net, opt, DataLoader(TensorDataset(*_data()), batch_size=4), sched)
    if load:
        acc.load_state(load)
    for i, (x, y) in enumerate(loader):
        if i not in steps:
            continue
        with acc.accumulate(net):
            acc.backward(((net(x) - y) ** 2).mean())
            if acc.sync_gradients:
                acc.clip_grad_norm_(net.parameters(), 0.5)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        if save and i == steps[-1]:
            acc.save_state(save)
    return net


def test_accelerate_save_state_load_state_continues_as_the_uninterrupted_run(tmp_path):
    """Accelerator.prepare (which round-trips the optimizer's state dict), accumulate, clip_grad_norm_,
    save_state after 4 batches and load_state into a fresh Accelerator: bit for bit the uninterrupted run."""
    accelerate = pytest.importorskip("accelerate")
    whole = _accelerate_run(accelerate, range(8))
    _accelerate_run(accelerate, range(4), save=tmp_path / "state")
    resumed = _accelerate_run(accelerate, range(4, 8), load=tmp_path / "state")
    assert _same_params(whole, resumed)

"""Trainer(strategy="zero0_spawn", devices=2) end to end, against Lightning's own torch-DDP strategy."""

from __future__ import annotations

import os

import pytest
import torch
import torchmetrics
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import lightning_zero  # noqa: F401  (registers the strategy names)
from lightning_zero import ZeroStrategy
from tests.distributed import models

TOL = 1e-6


class TokenData(Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, models.VOCAB, (n, models.SEQ + 1), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        return self.data[i, :-1], self.data[i, 1:]


class LitTiny(LightningModule):
    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        self.net = models.build(seed=7)
        self.val_metric = torchmetrics.MeanMetric()
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        if not self.automatic_optimization:
            return self._manual_step(batch, batch_idx)
        loss = self.net(*batch)
        self.log("train_loss", loss)
        return loss

    def _manual_step(self, batch, batch_idx):
        opt = self.optimizers()
        sync = (batch_idx + 1) % 2 == 0
        ledger = getattr(self.trainer.strategy, "ledger", None)
        before = len(ledger.records) if ledger is not None else 0
        with opt.toggle_model(sync_grad=sync):
            self.manual_backward(self.net(*batch) / 2)
        if ledger is not None and not sync:
            assert len(ledger.records) == before, "a collective ran inside toggle_model(sync_grad=False)"
        if sync:
            opt.step()
            opt.zero_grad()

    def validation_step(self, batch, batch_idx):
        loss = self.net(*batch)
        self.val_metric.update(loss)
        self.log("val_loss", loss, sync_dist=True)
        self.log("val_metric", self.val_metric)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)

    def train_dataloader(self):
        return DataLoader(TokenData(28, seed=1), batch_size=2)  # 7 batches per rank

    def val_dataloader(self):
        return DataLoader(TokenData(8, seed=2), batch_size=2)


class SaveRankParams(Callback):
    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer, pl_module):
        params = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        params["global_step"] = torch.tensor(float(trainer.global_step))
        torch.save(params, os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


def _fit(strategy, out_dir, *, manual=False, accumulate=4):
    os.makedirs(out_dir, exist_ok=True)
    model = LitTiny(manual=manual)
    trainer = Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=2,
        accumulate_grad_batches=1 if manual else accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[SaveRankParams(str(out_dir))],
        default_root_dir=str(out_dir),
    )
    trainer.fit(model)
    ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(2)]
    return model, trainer, ranks


def _max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _expected_val_loss(model: LitTiny) -> float:
    ds = TokenData(8, seed=2)
    losses = []
    with torch.no_grad():
        for rank in range(2):
            loader = DataLoader(ds, batch_size=2, sampler=DistributedSampler(ds, 2, rank, shuffle=False))
            losses += [model.net(*b).item() for b in loader]
    return sum(losses) / len(losses)


def test_zero0_matches_lightning_ddp_with_accumulation(tmp_path):
    zero_model, trainer, zero_ranks = _fit("zero0_spawn", tmp_path / "zero")
    _, _, ddp_ranks = _fit("ddp_spawn", tmp_path / "ddp")
    assert isinstance(trainer.strategy, ZeroStrategy)
    assert _max_diff(zero_ranks[0], zero_ranks[1]) == 0.0
    assert _max_diff(zero_ranks[0], ddp_ranks[0]) <= TOL
    # 7 batches per epoch, accumulate 4: steps at 4 and 7 per epoch, 2 epochs
    assert zero_ranks[0]["global_step"].item() == 4
    # sync_dist logging and the torchmetrics metric equal the global value
    expected = _expected_val_loss(zero_model)
    assert trainer.callback_metrics["val_loss"].item() == pytest.approx(expected, abs=1e-6)
    assert trainer.callback_metrics["val_metric"].item() == pytest.approx(expected, abs=1e-6)


def test_manual_optimization_toggle_model(tmp_path):
    _, _, zero_ranks = _fit(ZeroStrategy(start_method="spawn"), tmp_path / "zero", manual=True)
    _, _, ddp_ranks = _fit("ddp_spawn", tmp_path / "ddp", manual=True)
    assert _max_diff(zero_ranks[1], ddp_ranks[1]) <= TOL

"""A small LightningModule, its data and a callback, shared by the Trainer tests."""

from __future__ import annotations

import os

import torch
import torchmetrics
from lightning.pytorch import Callback, LightningModule
from torch.utils.data import DataLoader, Dataset

from tests.distributed import models


class TokenData(Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, models.VOCAB, (n, models.SEQ + 1), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        return self.data[i, :-1], self.data[i, 1:]


class LitTiny(LightningModule):
    def __init__(self, manual: bool = False, groups: bool = False, stack: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = models.build_stack(seed=7, tied=True) if stack else models.build(seed=7)
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

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.net(*batch), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self.net(*batch)

    def configure_optimizers(self):
        if not self.hparams.groups:
            return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": 0.1},
            {"params": no_decay, "weight_decay": 0.0, "lr": 5e-3},
        ]
        optimizer = torch.optim.AdamW(groups, lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(TokenData(28, seed=1), batch_size=2)  # 7 batches per rank

    def val_dataloader(self):
        return DataLoader(TokenData(8, seed=2), batch_size=2)


class SaveRankParams(Callback):
    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer, pl_module):
        # through the strategy: stage 3 holds only shards until teardown (every rank takes part);
        # the references (Lightning's ddp, one process) hold the module whole
        full = getattr(trainer.strategy, "full_state_dict", None)
        state = full(rank0_only=False) if full is not None else pl_module.state_dict()
        params = {n: state[n].detach().clone() for n, _ in pl_module.named_parameters()}
        params["global_step"] = torch.tensor(float(trainer.global_step))
        torch.save(params, os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))

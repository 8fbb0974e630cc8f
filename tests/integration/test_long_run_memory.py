"""Bounded bookkeeping: resident memory stays flat over 10,000 steps of a tiny model (slow).

Before the ledger was bounded it kept every collective and every wait of the run: about 2.7 KiB
more per step (zero2, 2 ranks, ZeroMonitor on). The slope of the resident set from step 3,000 to
the last step, once the ledger's bounded windows have filled, is asserted near zero.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroMonitor, ZeroStrategy

STEPS = 10_000
SAMPLE_EVERY = 250  # steps between two readings of the resident set
FULL = 3_000  # by then the ledger's windows are full (4,096 records at 2 per step, 1,000 steps)
PAGE = os.sysconf("SC_PAGE_SIZE")


class Tiny(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

    def setup(self, stage: str) -> None:
        torch.set_num_threads(1)  # forked rank: see tests/integration/test_checkpoint_resume.py

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


class ResidentSet(Callback):
    """Rank r writes (step, resident bytes) every SAMPLE_EVERY steps to ``out/rss{r}.pt``."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.samples: list[tuple[int, int]] = []

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step % SAMPLE_EVERY == 0:
            with open("/proc/self/statm") as f:
                self.samples.append((trainer.global_step, int(f.read().split()[1]) * PAGE))

    def on_train_end(self, trainer, pl_module) -> None:
        torch.save(self.samples, self.out / f"rss{trainer.global_rank}.pt")


def slope_per_step(samples: list[tuple[int, int]]) -> float:
    """Least-squares slope of resident bytes over steps."""
    steps = torch.tensor([s for s, _ in samples], dtype=torch.float64)
    rss = torch.tensor([b for _, b in samples], dtype=torch.float64)
    steps, rss = steps - steps.mean(), rss - rss.mean()
    return float((steps * rss).sum() / (steps * steps).sum())


@pytest.mark.slow
def test_resident_memory_is_flat_over_ten_thousand_steps(tmp_path: Path):
    trainer = Trainer(
        strategy=ZeroStrategy(stage=2, start_method="fork"),
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ZeroMonitor(print_summary=False), ResidentSet(tmp_path)],
    )
    trainer.fit(Tiny())
    for rank in range(2):
        samples = [s for s in torch.load(tmp_path / f"rss{rank}.pt") if s[0] >= FULL]
        slope = slope_per_step(samples)
        growth = samples[-1][1] - samples[0][1]
        print(f"rank {rank}: {slope:.1f} B/step, {growth / 1024:.0f} KiB from step {FULL} to {STEPS}")
        assert abs(slope) < 64, (
            f"rank {rank}: {slope:.0f} B/step, {growth / 1024:.0f} KiB from step {FULL}: {samples}"
        )

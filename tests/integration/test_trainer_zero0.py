"""Trainer(strategy="zero0_spawn", devices=2) end to end, against Lightning's own torch-DDP strategy."""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader, DistributedSampler

import lightning_zero  # noqa: F401  (registers the strategy names)
from lightning_zero import ZeroStrategy
from tests.compare import max_diff
from tests.integration.lit import LitTiny, SaveRankParams, TokenData

TOL = 1e-6


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
    assert max_diff(zero_ranks[0], zero_ranks[1]) == 0.0
    assert max_diff(zero_ranks[0], ddp_ranks[0]) <= TOL
    # 7 batches per epoch, accumulate 4: steps at 4 and 7 per epoch, 2 epochs
    assert zero_ranks[0]["global_step"].item() == 4
    # sync_dist logging and the torchmetrics metric equal the global value
    expected = _expected_val_loss(zero_model)
    assert trainer.callback_metrics["val_loss"].item() == pytest.approx(expected, abs=1e-6)
    assert trainer.callback_metrics["val_metric"].item() == pytest.approx(expected, abs=1e-6)


@pytest.mark.slow  # manual optimization at every stage: tests/matrix, by default
def test_manual_optimization_toggle_model(tmp_path):
    _, _, zero_ranks = _fit(ZeroStrategy(start_method="spawn"), tmp_path / "zero", manual=True)
    _, _, ddp_ranks = _fit("ddp_spawn", tmp_path / "ddp", manual=True)
    assert max_diff(zero_ranks[1], ddp_ranks[1]) <= TOL

"""zero3 through the Trainer: parity with zero0, mid-epoch validation, checkpoint, resume, test, predict."""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_zero  # noqa: F401  (registers the strategy names)
from lightning_zero import ZeroStrategy
from tests.bigmodel.lit import quiet_trainer
from tests.compare import max_diff, state_diff
from tests.integration.lit import LitTiny, SaveRankParams

TOL = 1e-6
BLOCK = "tests.distributed.models.Block"


def _strategy(stage: int):
    if stage == 3:
        return ZeroStrategy(stage=3, wrap_policy=BLOCK, start_method="spawn")
    return ZeroStrategy(stage=stage, start_method="spawn")


def _trainer(stage: int, out_dir, *, max_epochs: int, checkpoint: bool = False, val_every=3) -> Trainer:
    os.makedirs(out_dir, exist_ok=True)
    callbacks = [SaveRankParams(str(out_dir))]
    if checkpoint:
        callbacks.append(ModelCheckpoint(dirpath=str(out_dir / "ckpt"), save_last=True, save_top_k=-1))
    return quiet_trainer(
        _strategy(stage),
        out_dir,
        max_epochs=max_epochs,
        callbacks=callbacks,
        accumulate_grad_batches=2,
        gradient_clip_val=0.05,
        val_check_interval=val_every,  # 3: validation in the middle of the epoch too
        limit_val_batches=2,
        enable_checkpointing=checkpoint,
    )


def _ranks(out_dir):
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(2)]


@pytest.mark.slow  # about 23 s; stage-3 resumes across stages also in the matrix and the fuzzer corpus
def test_zero3_fit_checkpoint_load_and_evaluate(tmp_path):
    _trainer(0, tmp_path / "zero0", max_epochs=2, checkpoint=True).fit(LitTiny(groups=True, stack=True))
    model = LitTiny(groups=True, stack=True)
    trainer = _trainer(3, tmp_path / "zero3", max_epochs=2, checkpoint=True)
    trainer.fit(model)
    zero0, zero3 = _ranks(tmp_path / "zero0"), _ranks(tmp_path / "zero3")
    assert max_diff(zero3[0], zero3[1]) == 0.0
    assert max_diff(zero3[0], zero0[0]) <= TOL
    ckpt = torch.load(tmp_path / "zero3" / "ckpt" / "last.ckpt", weights_only=False)
    ref = torch.load(tmp_path / "zero0" / "ckpt" / "last.ckpt", weights_only=False)
    assert ckpt["state_dict"].keys() == ref["state_dict"].keys()  # original names, tied ones too
    assert max_diff(ckpt["state_dict"], ref["state_dict"]) <= TOL
    assert state_diff(ckpt["optimizer_states"][0], ref["optimizer_states"][0]) <= TOL
    # a plain single process loads it
    loaded = LitTiny.load_from_checkpoint(tmp_path / "zero3" / "ckpt" / "last.ckpt")
    assert max_diff(ckpt["state_dict"], dict(loaded.named_parameters())) == 0.0
    # teardown left a full module, which the launcher handed back to this process; evaluate it
    final = {k: v for k, v in zero3[0].items() if k != "global_step"}
    assert max_diff(dict(model.named_parameters()), final) <= TOL
    tester = Trainer(
        strategy=_strategy(3), accelerator="cpu", devices=2, logger=False, enable_progress_bar=False
    )
    assert "test_loss" in tester.test(model, dataloaders=model.val_dataloader())[0]


@pytest.mark.slow  # test_checkpoint_resume.py resumes every stage by default
def test_zero3_resume_continues_exactly(tmp_path):
    # checkpoints at epoch ends: Lightning resumes mid-epoch checkpoints only approximately, whatever the strategy
    _trainer(3, tmp_path / "full", max_epochs=3, val_every=1.0).fit(LitTiny(groups=True, stack=True))
    first = _trainer(3, tmp_path / "first", max_epochs=1, checkpoint=True, val_every=1.0)
    first.fit(LitTiny(groups=True, stack=True))
    resumed = _trainer(3, tmp_path / "resumed", max_epochs=3, val_every=1.0)
    resumed.fit(LitTiny(groups=True, stack=True), ckpt_path=tmp_path / "first" / "ckpt" / "last.ckpt")
    full, again = _ranks(tmp_path / "full"), _ranks(tmp_path / "resumed")
    assert again[0]["global_step"].item() == full[0]["global_step"].item()
    assert max_diff(again[0], full[0]) <= TOL

"""precision="bf16-mixed" through the Trainer: bf16 compute, fp32 masters in checkpoints, exact resume."""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_zero  # noqa: F401  (registers the strategy names)
from lightning_zero import ZeroStrategy
from tests.integration.lit import LitTiny, SaveRankParams


class CheckDtypes(SaveRankParams):
    """Also records the dtype the module computes with during training: the embedding's weight as
    its forward sees it (at stage 3 a parameter at rest is the fp32 master shard's DTensor; its
    module computes with the gathered bf16 values)."""

    def on_train_start(self, trainer, pl_module):
        def seen(module, args):
            pl_module.compute_dtype = str(module.weight.dtype)

        pl_module.net.emb.register_forward_pre_hook(seen)

    def on_train_end(self, trainer, pl_module):
        super().on_train_end(trainer, pl_module)
        torch.save(pl_module.compute_dtype, os.path.join(self.out_dir, f"dtype{trainer.global_rank}.pt"))


def _fit(out_dir, *, max_epochs: int, ckpt_path=None, checkpoint: bool = False):
    os.makedirs(out_dir, exist_ok=True)
    callbacks = [CheckDtypes(str(out_dir))]
    if checkpoint:
        callbacks.append(ModelCheckpoint(dirpath=str(out_dir / "ckpt"), save_last=True))
    strategy = ZeroStrategy(stage=3, wrap_policy="tests.distributed.models.Block", start_method="spawn")
    trainer = Trainer(
        strategy=strategy,
        precision="bf16-mixed",
        accelerator="cpu",
        devices=2,
        max_epochs=max_epochs,
        limit_val_batches=1,
        logger=False,
        enable_checkpointing=checkpoint,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(LitTiny(groups=True, stack=True), ckpt_path=ckpt_path)
    return torch.load(out_dir / "rank0.pt"), torch.load(out_dir / "dtype0.pt")


@pytest.mark.slow  # tests/distributed/test_mixed_precision.py checks fp32 masters in checkpoints by default
def test_bf16_zero3_checkpoint_is_fp32_and_resume_is_exact(tmp_path):
    full, dtype = _fit(tmp_path / "full", max_epochs=2)
    assert dtype == "torch.bfloat16"
    _fit(tmp_path / "first", max_epochs=1, checkpoint=True)
    ckpt = torch.load(tmp_path / "first" / "ckpt" / "last.ckpt", weights_only=False)
    assert {v.dtype for v in ckpt["state_dict"].values() if v.is_floating_point()} == {torch.float32}
    LitTiny.load_from_checkpoint(tmp_path / "first" / "ckpt" / "last.ckpt")  # a plain fp32 module loads it
    resumed, _ = _fit(tmp_path / "resumed", max_epochs=2, ckpt_path=tmp_path / "first" / "ckpt" / "last.ckpt")
    assert max((resumed[k] - full[k]).abs().max().item() for k in full) <= 1e-6

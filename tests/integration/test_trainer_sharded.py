"""zero1/zero2 through the Trainer: parity with zero0, full checkpoints, resume, single-process load."""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_zero  # noqa: F401  (registers the strategy names)
from tests.bigmodel.lit import quiet_trainer
from tests.compare import max_diff, state_diff
from tests.integration.lit import LitTiny, SaveRankParams

TOL = 1e-6


def _fit(strategy: str, out_dir, *, max_epochs: int, ckpt_path=None, checkpoint=False):
    os.makedirs(out_dir, exist_ok=True)
    callbacks = [SaveRankParams(str(out_dir))]
    if checkpoint:
        callbacks.append(ModelCheckpoint(dirpath=str(out_dir / "ckpt"), save_last=True, save_top_k=-1))
    trainer = quiet_trainer(
        strategy,
        out_dir,
        max_epochs=max_epochs,
        callbacks=callbacks,
        accumulate_grad_batches=2,
        gradient_clip_val=0.05,
        gradient_clip_algorithm="norm",
        enable_checkpointing=checkpoint,
    )
    trainer.fit(LitTiny(groups=True), ckpt_path=ckpt_path)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(2)]


@pytest.mark.parametrize("stage", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_parity_checkpoint_and_single_process_load(tmp_path, stage):
    zero0 = _fit("zero0_spawn", tmp_path / "zero0", max_epochs=2, checkpoint=True)
    sharded = _fit(f"zero{stage}_spawn", tmp_path / "sharded", max_epochs=2, checkpoint=True)
    assert max_diff(sharded[0], sharded[1]) == 0.0
    assert max_diff(sharded[0], zero0[0]) <= TOL
    # the checkpoint holds the full model and the consolidated optimizer state under the usual keys
    ckpt = torch.load(tmp_path / "sharded" / "ckpt" / "last.ckpt", weights_only=False)
    ref = torch.load(tmp_path / "zero0" / "ckpt" / "last.ckpt", weights_only=False)
    assert state_diff(ckpt["optimizer_states"][0], ref["optimizer_states"][0]) <= TOL
    assert ckpt["optimizer_states"][0]["param_groups"] == ref["optimizer_states"][0]["param_groups"]
    assert ckpt["lr_schedulers"] == ref["lr_schedulers"]
    # a plain single process loads it, weights and optimizer alike
    model = LitTiny.load_from_checkpoint(tmp_path / "sharded" / "ckpt" / "last.ckpt")
    assert (
        max_diff(
            {n: p for n, p in model.named_parameters()},
            {k: v for k, v in sharded[0].items() if k != "global_step"},
        )
        <= TOL
    )
    optimizer = model.configure_optimizers()["optimizer"]
    optimizer.load_state_dict(ckpt["optimizer_states"][0])
    first = next(iter(optimizer.state.values()))
    assert set(first) == {"step", "exp_avg", "exp_avg_sq"}


@pytest.mark.slow  # test_checkpoint_resume.py resumes every stage by default
@pytest.mark.parametrize("stage", [1, 2])
def test_resume_continues_exactly(tmp_path, stage):
    full = _fit(f"zero{stage}_spawn", tmp_path / "full", max_epochs=3)
    _fit(f"zero{stage}_spawn", tmp_path / "first", max_epochs=1, checkpoint=True)
    resumed = _fit(
        f"zero{stage}_spawn",
        tmp_path / "resumed",
        max_epochs=3,
        ckpt_path=tmp_path / "first" / "ckpt" / "last.ckpt",
    )
    assert resumed[0]["global_step"].item() == full[0]["global_step"].item()
    assert max_diff(resumed[0], full[0]) <= TOL


def test_sharded_stage_on_one_process_trains_with_a_warning(tmp_path):
    trainer = quiet_trainer("zero2", tmp_path, devices=1, max_epochs=None, max_steps=3)
    model = LitTiny(groups=True)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        with pytest.warns(UserWarning, match="stage 2 on one process shards nothing"):
            trainer.fit(model)
    finally:  # this run was in the test process: leave no process group or port behind for later tests
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK"):
            os.environ.pop(name, None)
    assert trainer.global_step == 3
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())

"""fp16 with dynamic loss scaling through the Trainer: the ranks agree on every overflow."""

from __future__ import annotations

import csv
import os

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision

import lightning_zero  # noqa: F401  (registers the strategy names)
from lightning_zero import ZeroStrategy
from lightning_zero.callbacks import ZeroMonitor
from lightning_zero.precision import ZeroGradScaler
from tests.compare import max_diff
from tests.integration.lit import LitTiny, SaveRankParams

OVERFLOW_STEP = 2  # the optimizer step whose gradient gets an inf on rank 0 only


class OverflowOnRankZero(SaveRankParams):
    """Puts an inf into one element of one gradient on rank 0 at OVERFLOW_STEP (before the
    reduction, so after a reduce-scatter only the rank owning that element sees it) and records,
    per step, the scale, the scaler's flags and the full (master) parameters on every rank."""

    def __init__(self, out_dir: str, overflow: bool = True) -> None:
        super().__init__(out_dir)
        self.overflow = overflow
        self.steps: list[dict] = []

    def on_train_start(self, trainer, pl_module):
        param = pl_module.net.head.weight if hasattr(pl_module.net, "head") else next(pl_module.parameters())

        def poison(grad):
            if self.overflow and trainer.global_rank == 0 and trainer.global_step == OVERFLOW_STEP:
                grad = grad.clone()
                grad.view(-1)[0] = float("inf")
            return grad

        param.register_hook(poison)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        scaler = trainer.precision_plugin.scaler
        state = trainer.strategy.full_state_dict(rank0_only=False)  # all ranks take part
        self.steps.append(
            {
                "scaler": type(scaler).__name__,
                "scale": scaler.get_scale(),
                "local": scaler.local_found_inf,
                "ranks": scaler.ranks_found_inf,
                "skipped": scaler.skipped_steps,
                "params": {n: state[n].clone() for n, _ in pl_module.named_parameters()},
                "dtype": str(pl_module.net.emb.weight.dtype),
            }
        )

    def on_train_end(self, trainer, pl_module):
        super().on_train_end(trainer, pl_module)
        torch.save(self.steps, os.path.join(self.out_dir, f"steps{trainer.global_rank}.pt"))


def _fit(
    out_dir,
    stage: int,
    *,
    max_epochs=1,
    overflow=True,
    ckpt_path=None,
    checkpoint=False,
    lightning_amp=False,
    reduce_dtype=None,
):
    """``lightning_amp``: Lightning's own fp16 AMP plugin (what ``precision="16-mixed"`` gives on GPUs)
    instead of ``param_dtype="fp16"``; the strategy swaps its scaler."""
    os.makedirs(out_dir, exist_ok=True)
    callbacks = [OverflowOnRankZero(str(out_dir), overflow), ZeroMonitor(print_summary=False)]
    if checkpoint:
        callbacks.append(ModelCheckpoint(dirpath=str(out_dir / "ckpt"), save_last=True))
    trainer = Trainer(
        strategy=ZeroStrategy(
            stage,
            param_dtype=None if lightning_amp else "fp16",
            reduce_dtype=reduce_dtype,
            start_method="spawn",
        ),
        plugins=[MixedPrecision("16-mixed", "cpu")] if lightning_amp else None,
        accelerator="cpu",
        devices=2,
        max_epochs=max_epochs,
        limit_val_batches=0,
        logger=CSVLogger(str(out_dir), name="log", version=0),
        enable_checkpointing=checkpoint,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=str(out_dir),
    )
    trainer.fit(LitTiny(), ckpt_path=ckpt_path)
    steps = [torch.load(out_dir / f"steps{r}.pt") for r in range(2)]
    return steps, [torch.load(out_dir / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize(
    ("stage", "lightning_amp", "reduce_dtype"),
    [
        pytest.param(0, False, None, marks=pytest.mark.slow),
        (1, False, None),
        pytest.param(2, False, None, marks=pytest.mark.slow),
        (3, False, None),
        pytest.param(2, True, None, marks=pytest.mark.slow),
        pytest.param(1, False, "fp32", marks=pytest.mark.slow),
    ],
)
def test_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path, stage, lightning_amp, reduce_dtype):
    steps, final = _fit(tmp_path, stage, lightning_amp=lightning_amp, reduce_dtype=reduce_dtype)
    k = OVERFLOW_STEP
    # sharded stages: only the owner of the poisoned element sees it; stage 0 all-reduces, all see it
    seen = 2 if stage == 0 else 1
    for rank_steps in steps:
        # stage 3: at rest the parameter is the fp32 master the optimizer steps (gathered in fp16)
        assert rank_steps[0]["dtype"] == ("torch.float32" if stage == 3 else "torch.float16")
        assert rank_steps[0]["scaler"] == "ZeroGradScaler"
        assert [s["ranks"] for s in rank_steps[: k + 2]] == [0] * k + [seen, 0]
        assert rank_steps[k]["scale"] == rank_steps[k - 1]["scale"] / 2  # the scale dropped
        assert rank_steps[k + 1]["scale"] == rank_steps[k]["scale"]
        assert rank_steps[-1]["skipped"] == 1
        assert max_diff(rank_steps[k]["params"], rank_steps[k - 1]["params"]) == 0.0  # step skipped
        assert max_diff(rank_steps[k + 1]["params"], rank_steps[k]["params"]) > 0.0  # training goes on
    assert sum(rank_steps[k]["local"] for rank_steps in steps) == seen
    # ZeroMonitor logs the scale and the skipped steps; the flags' AllReduce is 4 bytes per step
    with open(tmp_path / "log" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("zero/loss_scale")]
    assert [float(r["zero/loss_scale"]) for r in rows[: k + 1]] == [2.0**16] * k + [2.0**15]
    assert [float(r["zero/skipped_steps"]) for r in rows[k - 1 : k + 1]] == [0.0, 1.0]
    if stage > 0:
        assert {float(r["zero/all_reduce_bytes"]) for r in rows} == {4.0}
    assert max_diff(final[0], final[1]) == 0.0


@pytest.mark.slow  # about 18 s (make test-slow; default suite kept near 15 min)
def test_loss_scale_is_checkpointed_and_resume_is_exact(tmp_path):
    _, full = _fit(tmp_path / "full", 2, max_epochs=2)
    _fit(tmp_path / "first", 2, max_epochs=1, checkpoint=True)
    ckpt = torch.load(tmp_path / "first" / "ckpt" / "last.ckpt", weights_only=False)
    assert ckpt["MixedPrecision"]["scale"] == 2.0**15  # one overflow halved 2**16
    steps, resumed = _fit(
        tmp_path / "resumed",
        2,
        max_epochs=2,
        overflow=False,
        ckpt_path=tmp_path / "first" / "ckpt" / "last.ckpt",
    )
    assert steps[0][0]["scale"] == 2.0**15
    assert max_diff(resumed[0], full[0]) == 0.0


def test_scaler_like_keeps_settings_and_state():
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7, backoff_factor=0.25)
    scaler.scale(torch.ones(()))
    scaler._scale.fill_(256.0)
    like = ZeroGradScaler.like(scaler, comm=None, label="zero2")
    assert (like.get_scale(), like.get_growth_interval(), like.get_backoff_factor()) == (256.0, 7, 0.25)


def test_fp16_needs_a_plugin_that_can_scale():
    from lightning.pytorch.plugins.precision import HalfPrecision

    from lightning_zero.precision import resolve_policy, training_precision

    policy = resolve_policy("fp16", None, "32-true")
    with pytest.raises(ValueError, match="fp16.*loss scaling.*HalfPrecision"):
        training_precision(HalfPrecision("16-true"), policy, None, "zero1", "cpu")

"""examples/slurm/callbacks.py without a cluster: one process that believes it runs under srun.

The SLURM variables of a one-task job and a stand-in `scontrol` on PATH are enough for
Lightning's SLURMEnvironment, and so for RequeueOnSignal's whole path: signal, checkpoint at the
step boundary, requeue request, exit, and the resumed fit that finishes like an uninterrupted one.
"""

from __future__ import annotations

import os
import signal
import stat
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero  # noqa: F401  (registers the zeroK strategy names)
from examples.slurm.callbacks import (
    RequeueOnSignal,
    RunDigest,
    next_hpc_checkpoint,
    parameter_sha256,
    slurm_job_id,
)
from tests.slurm.runs import free_port

STEPS = 8  # optimizer steps of every fit below


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.05)


def loader() -> DataLoader:
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    # one batch per epoch: every checkpoint is an end-of-epoch one (docs/slurm.md, "Resuming mid-epoch")
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=64)


class SignalAt(L.Callback):
    """Sends SIGUSR1 to this process after optimizer step ``step``, as SLURM would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGUSR1)


@pytest.fixture
def one_task_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """SLURM variables of job 4242 with one task, and an `scontrol` that logs its arguments."""
    for name, value in dict(
        SLURM_JOB_ID="4242", SLURM_JOB_NAME="test", SLURM_NTASKS="1", SLURM_NTASKS_PER_NODE="1",
        SLURM_NNODES="1", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_NODELIST="n1",
    ).items():  # fmt: skip
        monkeypatch.setenv(name, value)
    for name in ("SLURM_ARRAY_JOB_ID", "LOCAL_RANK", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.log"}\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    sigterm = signal.getsignal(signal.SIGTERM)
    yield tmp_path
    signal.signal(signal.SIGTERM, sigterm)  # RequeueOnSignal lets SIGTERM end the process


def fit(root: Path, *callbacks: L.Callback, strategy: str = "zero2") -> tuple[L.Trainer, Regression]:
    L.seed_everything(0)
    model = Regression()
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=STEPS, default_root_dir=root,
        callbacks=list(callbacks), logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=1, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(model, train_dataloaders=loader(), val_dataloaders=loader())
    return trainer, model


def test_signal_saves_at_the_step_boundary_requeues_and_the_resumed_fit_matches(one_task_job: Path):
    _, uninterrupted = fit(one_task_job / "uninterrupted")
    root = one_task_job / "preempted"
    with pytest.raises(SystemExit) as leaving:
        fit(root, RequeueOnSignal(), SignalAt(step=3))
    assert leaving.value.code == 0
    assert (one_task_job / "scontrol.log").read_text().split() == ["requeue", "4242"]
    checkpoint = torch.load(root / "hpc_ckpt_1.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 4  # the signal came after step 3: saved at the end of step 4
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    trainer, resumed = fit(root, RequeueOnSignal())  # the requeued job: fit() finds hpc_ckpt_1.ckpt
    assert trainer.global_step == STEPS
    assert parameter_sha256(resumed.state_dict()) == parameter_sha256(uninterrupted.state_dict())


def test_outside_slurm_the_handler_is_not_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    for name in [n for n in os.environ if n.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    before = signal.getsignal(signal.SIGUSR1)
    requeue = RequeueOnSignal()
    fit(tmp_path, requeue)
    assert not requeue._installed
    assert signal.getsignal(signal.SIGUSR1) is before


def test_run_digest_records_and_restores_validation_losses(tmp_path: Path):
    digest = RunDigest(out_dir=str(tmp_path / "out"))
    fit(tmp_path, digest)
    record = (tmp_path / "out" / "digest_rank0.json").read_text()
    assert '"world_size": 1' in record and '"global_step": 8' in record
    restored = RunDigest()
    restored.load_state_dict(digest.state_dict())
    assert restored.state_dict() == digest.state_dict() and digest.state_dict()["val_losses"]
    assert (tmp_path / "out" / "params.pt").is_file()


def test_next_hpc_checkpoint_counts_up_from_the_highest(tmp_path: Path):
    assert next_hpc_checkpoint(tmp_path) == tmp_path / "hpc_ckpt_1.ckpt"
    for name in ("hpc_ckpt_1.ckpt", "hpc_ckpt_3.ckpt", "hpc_ckpt_x.ckpt", "last.ckpt"):
        (tmp_path / name).touch()
    assert next_hpc_checkpoint(tmp_path) == tmp_path / "hpc_ckpt_4.ckpt"


def test_slurm_job_id_of_an_array_task(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SLURM_JOB_ID", "17")
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "15")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "2")
    assert slurm_job_id() == "15_2"


def test_bad_options_are_errors_naming_them():
    with pytest.raises(ValueError, match="check_every_n_steps must be >= 1, got 0"):
        RequeueOnSignal(check_every_n_steps=0)
    assert RequeueOnSignal(signum="SIGUSR2").signum == signal.SIGUSR2
    with pytest.raises(KeyError):
        RequeueOnSignal(signum="SIGNOPE")


def test_parameter_hash_sees_values_names_and_shapes():
    a = {"w": torch.zeros(2, 2), "b": torch.tensor(1.0)}
    assert parameter_sha256(a) == parameter_sha256({k: v.clone() for k, v in a.items()})
    assert parameter_sha256(a) != parameter_sha256({**a, "b": torch.tensor(2.0)})
    assert parameter_sha256(a) != parameter_sha256({"w": torch.zeros(4), "b": a["b"]})
    assert parameter_sha256(a) != parameter_sha256({"v": a["w"], "b": a["b"]})


def test_run_digest_at_stage_3_hashes_the_whole_model(tmp_path: Path):
    """Stage 3 holds 1/N of each parameter between steps: the digest gathers them first."""
    digest = RunDigest(out_dir=str(tmp_path / "out"))
    trainer, model = fit(tmp_path, digest, strategy="zero3")
    saved = torch.load(tmp_path / "out" / "params.pt")
    with trainer.strategy.gathered():
        whole = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert saved.keys() == whole.keys()
    assert all(torch.equal(saved[k], whole[k]) for k in whole)
    assert (
        f'"param_sha256": "{parameter_sha256(whole)}"' in (tmp_path / "out" / "digest_rank0.json").read_text()
    )

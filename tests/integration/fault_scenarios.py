"""The training runs of the fault tests: one rank per process (started by tests/integration/ranks.py).

    python -m tests.integration.fault_scenarios SCENARIO OUT_DIR '{"stage": 2, ...}'

Every rank builds the same Trainer (ZeroStrategy on CPU, gloo) around a small regression model and
prints ``step N`` after each optimizer step, so that a test can act at a known point; the options
make one rank misbehave on purpose. The scenario name only labels the run.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroStrategy


class Net(LightningModule):
    """Two layers and a head ``extra`` that rank ``unused_on`` leaves out from step ``unused_from``."""

    def __init__(
        self, unused_on: int | None = None, unused_from: int = 0, nan_on: int | None = None, nan_at: int = -1
    ):
        super().__init__()
        self.body = torch.nn.Linear(8, 16)
        self.head = torch.nn.Linear(16, 1)
        self.extra = torch.nn.Linear(16, 1)
        self.unused_on, self.unused_from = unused_on, unused_from
        self.nan_on, self.nan_at = nan_on, nan_at

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = torch.relu(self.body(x))
        out = self.head(h)
        skip = self.global_rank == self.unused_on and self.global_step >= self.unused_from
        if not skip:
            out = out + self.extra(h)
        loss = torch.nn.functional.mse_loss(out, y)
        if self.global_rank == self.nan_on and self.global_step == self.nan_at:
            loss = loss * float("nan")
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def data(samples: int, batch_size: int) -> DataLoader:
    x = torch.randn(samples, 8, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=batch_size)


class Act(Callback):
    """Prints ``step N`` after each optimizer step; sends ``signal`` to this rank at step ``at``."""

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = options

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        kill = self.options.get("kill")
        if kill and trainer.global_rank == kill["rank"] and trainer.global_step == kill["step"]:
            os.kill(os.getpid(), getattr(signal, kill["signal"]))

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        print(f"rank {trainer.global_rank} step {trainer.global_step}", flush=True)
        if self.options.get("print_params") and trainer.global_rank == 0:  # stages 0-2: whole on every rank
            digest = hashlib.sha256()
            for value in pl_module.state_dict().values():
                digest.update(value.detach().cpu().numpy().tobytes())
            print(f"rank 0 step {trainer.global_step} params {digest.hexdigest()[:16]}", flush=True)
        delay = self.options.get("step_delay_s")
        if delay:
            import time

            time.sleep(delay)


def signal_during_full_saves(rank: int, signum: int, times: int) -> None:
    """Rank ``rank`` sends itself ``signum`` ``times`` times while writing its first full checkpoint
    (written whole at stage 0, streamed while gathered at stages 1-3)."""
    from lightning_zero.checkpoint import writer

    calls = []

    def signalling(original):
        def write(obj, path, *args):
            calls.append(path)
            if len(calls) == 1 and int(os.environ["LOCAL_RANK"]) == rank:
                print(f"rank {rank} signals itself while saving {path}", flush=True)
                for _ in range(times):
                    os.kill(os.getpid(), signum)
            original(obj, path, *args)

        return write

    writer._write_synced = signalling(writer._write_synced)
    writer.write_streamed = signalling(writer.write_streamed)


class Final(Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module) -> None:
        state = trainer.strategy.full_state_dict()  # every rank takes part; the values on rank 0
        if trainer.is_global_zero:
            torch.save({k: v.detach().clone() for k, v in state.items()}, self.out / "final.pt")
        guard = trainer.strategy.nonfinite_guard
        skipped = f", {guard.skipped_steps} step(s) skipped" if guard is not None else ""
        print(f"rank {trainer.global_rank} finished at step {trainer.global_step}{skipped}", flush=True)


def main(scenario: str, out: Path, options: dict[str, Any]) -> None:
    if "dump_after_s" in options:  # a hang shows where every thread is
        import faulthandler

        faulthandler.dump_traceback_later(options["dump_after_s"], exit=False)
        faulthandler.register(signal.SIGUSR2, all_threads=True)
    torch.manual_seed(0)
    rank = int(os.environ["LOCAL_RANK"])
    if "signal_in_save" in options:
        how = options["signal_in_save"]
        signal_during_full_saves(how["rank"], getattr(signal, how["signal"]), how.get("times", 1))
    model = Net(**options.get("model", {}))
    callbacks: list[Callback] = [Act(options), Final(out)]
    if "checkpoint_every" in options:
        every = options["checkpoint_every"]
        callbacks.append(
            ModelCheckpoint(dirpath=out / "ckpt", save_last=True, save_top_k=0, every_n_train_steps=every)
        )
    trainer = Trainer(
        strategy=ZeroStrategy(**options.get("strategy", {"stage": 2})),
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        max_steps=options.get("max_steps", 20),
        logger=False,
        enable_checkpointing="checkpoint_every" in options,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=out,
        use_distributed_sampler=options.get("distributed_sampler", True),
    )
    samples = options.get("samples", {}).get(str(rank), options.get("default_samples", 512))
    print(f"rank {rank} starts {scenario}", flush=True)
    trainer.fit(model, train_dataloaders=data(samples, 8), ckpt_path=options.get("ckpt_path"))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3]))

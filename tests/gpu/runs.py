"""Trainer runs of the GPU tests: ``LitTiny`` on CUDA devices, what each rank ends with in a file."""

from __future__ import annotations

import csv
import os
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_zero import ZeroStrategy
from lightning_zero.callbacks import ZeroMonitor
from tests.gpu.training import BLOCK, optimizer_tensors
from tests.integration.lit import LitTiny


def zero(stage: int) -> ZeroStrategy:
    """``zero<stage>`` started by Lightning's spawn launcher (the test process keeps no process group)."""
    options = {"wrap_policy": BLOCK} if stage == 3 else {}
    return ZeroStrategy(stage=stage, start_method="spawn", **options)


def placement(trainer: Trainer, module: LightningModule) -> dict[str, Any]:
    """Where this rank's tensors live: the module's, the strategy's shards, the optimizer's state;
    and what it allocated on ``cuda:0`` when its own device is another one (None otherwise)."""
    tensors = [*module.parameters(), *module.buffers()]
    engine = getattr(trainer.strategy, "engine", None)
    if engine is not None:
        tensors += [space.shard for space in engine.param_spaces()]
    for optimizer in trainer.optimizers:
        tensors += optimizer_tensors(optimizer)
    device = trainer.strategy.root_device
    elsewhere = device.type == "cuda" and device.index != 0
    return {
        "devices": sorted({str(t.device) for t in tensors}),
        "cuda0_peak_bytes": torch.cuda.max_memory_allocated(0) if elsewhere else None,
    }


class RecordRank(Callback):
    """Writes ``rank<r>.pt`` at the end of training: this rank's full parameters on the host, its
    device, where its tensors were when training started (after a checkpoint was restored) and when
    it ended, and how the ZeroMonitor among the callbacks timed exposed communication.

    Args:
        out_dir: where the files go.
    """

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self._start: dict[str, Any] = {}  # placement() at the start of training

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start = placement(trainer, pl_module)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        strategy = trainer.strategy
        zeroed = isinstance(strategy, ZeroStrategy)
        state = strategy.full_state_dict(rank0_only=False) if zeroed else pl_module.state_dict()
        monitors = [c for c in trainer.callbacks if isinstance(c, ZeroMonitor)]
        record = {
            "params": {n: state[n].detach().cpu() for n, _ in pl_module.named_parameters()},
            "root_device": str(strategy.root_device),
            "at_start": self._start,
            "at_end": placement(trainer, pl_module),
            "monitor_timing": monitors[0].timing if monitors else None,
        }
        torch.save(record, os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


def fit(
    strategy: Any,
    out_dir: Path,
    *,
    devices: int = 1,
    max_steps: int = -1,
    max_epochs: int = 1,
    checkpoint: bool = False,
    monitor: bool = False,
    ckpt_path: Path | None = None,
    accelerator: str = "cuda",
) -> list[dict[str, Any]]:
    """Fit ``LitTiny(stack=True)`` (7 batches of 2 per rank and epoch on 2 ranks, AdamW); return
    every rank's record (:class:`RecordRank`). ``checkpoint``: ``ckpt/last.ckpt`` at the end of each
    epoch; ``monitor``: a ZeroMonitor logging to ``metrics/version_0/metrics.csv``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    callbacks: list[Callback] = [RecordRank(str(out_dir))]
    if checkpoint:
        callbacks.append(ModelCheckpoint(dirpath=str(out_dir / "ckpt"), save_last=True, save_top_k=-1))
    if monitor:
        callbacks.append(ZeroMonitor())
    trainer = Trainer(
        strategy=strategy,
        accelerator=accelerator,
        devices=devices,
        max_steps=max_steps,
        max_epochs=max_epochs,
        limit_val_batches=0,
        logger=CSVLogger(str(out_dir), name="metrics", version=0) if monitor else False,
        enable_checkpointing=checkpoint,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=str(out_dir),
        use_distributed_sampler=devices > 1,  # one device reads the loader as it is, as plain Lightning does
    )
    trainer.fit(LitTiny(stack=True), ckpt_path=ckpt_path)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(devices)]


def tensor_devices(path: Path) -> Counter[str]:
    """Device -> number of tensors, of a checkpoint file read by ``torch.load`` without
    ``map_location`` (each tensor goes where it was saved from)."""
    counts: Counter[str] = Counter()

    def walk(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            counts[str(obj.device)] += 1
        elif isinstance(obj, dict):
            for value in obj.values():
                walk(value)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                walk(value)

    walk(torch.load(path, map_location=None, weights_only=False))
    return counts


def read_metrics(out_dir: Path) -> list[dict[str, float]]:
    """The ZeroMonitor rows of a :func:`fit` with ``monitor=True``, one per optimizer step."""
    with open(out_dir / "metrics" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("zero/step_time_s")]
    return [{k: float(v) for k, v in r.items() if v != ""} for r in rows]

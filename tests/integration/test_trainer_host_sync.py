"""No host synchronisation per step through the Trainer, at every stage (2 gloo ranks).

tests/distributed/test_hot_path.py counts the calls that would make the host wait for the device
while the engine alone runs steps. This test counts them through a whole Trainer fit, where the
strategy adds its per-batch agreement of signals and last batches ([Note: signals at step
boundaries] in lightning_zero/signals.py): the calls made from lightning_zero's own frames on
tensors of the training device, after the first step. On CPU every tensor is on the training
device, so the host table of the communicator's side group (lightning_zero/comm/checks.py), which
lives on the host on any machine, is told apart by identity. Were the agreement to run on the
training device again (an int64 table read back with ``.tolist()``), every batch would count one.

    python -m tests.integration.test_trainer_host_sync OUT_DIR STAGE   # one rank (LOCAL_RANK set)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from torch.overrides import TorchFunctionMode

from lightning_zero import ZeroStrategy
from tests.distributed.test_hot_path import SYNCING
from tests.integration.fault_scenarios import Net, data
from tests.integration.test_desync_trainer import finish_all, start_ranks

PACKAGE = os.sep + "lightning_zero" + os.sep
STEPS = 6  # the first is not counted


def _caller() -> str | None:
    """``file:line`` of the first frame outside torch and this file, when it is lightning_zero's."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if f"{os.sep}torch{os.sep}" not in name and name != __file__:
            return f"{name.split(PACKAGE)[-1]}:{frame.f_lineno}" if PACKAGE in name else None
        frame = frame.f_back
    return None


class CountHostSyncs(TorchFunctionMode):
    """Calls that make the host wait for the device, made by lightning_zero on ``device`` tensors
    other than ``host_tables`` (which live on the host whatever the device), by call site."""

    def __init__(self, device: torch.device, host_tables: list[torch.Tensor]) -> None:
        super().__init__()
        self.device = device
        self.host_tables = host_tables
        self.calls: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        to_host = func is torch.Tensor.to and any(str(a) == "cpu" for a in (*args[1:], *kwargs.values()))
        tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if (func in SYNCING or to_host) and tensor is not None and self._counted(tensor):
            site = _caller()
            if site is not None:
                key = f"{getattr(func, '__name__', func)} at {site}"
                self.calls[key] = self.calls.get(key, 0) + 1
        return func(*args, **kwargs)

    def _counted(self, tensor: torch.Tensor) -> bool:
        return tensor.device == self.device and not any(tensor is t for t in self.host_tables)


class CountAfterFirstStep(Callback):
    def __init__(self, out: Path) -> None:
        self.out = out
        self.counter: CountHostSyncs | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 1:  # before the strategy's own hook: the agreement of this batch is counted
            comm = trainer.strategy.comm
            tables = [comm.side.table] if comm.side is not None else []
            self.counter = CountHostSyncs(trainer.strategy.root_device, tables)
            self.counter.__enter__()

    def on_train_end(self, trainer, pl_module) -> None:
        if self.counter is None:
            return
        self.counter.__exit__(None, None, None)
        result = {"calls": self.counter.calls, "agreements": trainer.strategy.ledger.control.calls}
        (self.out / f"syncs{trainer.global_rank}.json").write_text(json.dumps(result))


def main(out: Path, stage: int) -> None:
    torch.manual_seed(0)
    options = {"wrap_policy": "torch.nn.Linear"} if stage == 3 else {}
    trainer = Trainer(
        strategy=ZeroStrategy(stage=stage, **options),
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[CountAfterFirstStep(out)],
        default_root_dir=out,
    )
    trainer.fit(Net(), train_dataloaders=data(256, 8))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_no_host_synchronisation_per_step_through_the_trainer(tmp_path, stage):
    runs = finish_all(start_ranks(__name__, 2, tmp_path, str(stage)), timeout=240)
    for run in runs:
        assert run.returncode == 0, run.output[-3000:]
        counted = json.loads((tmp_path / f"syncs{run.rank}.json").read_text())
        assert counted["calls"] == {}, (stage, counted["calls"])
        assert counted["agreements"] >= STEPS  # the agreement ran before every batch, on the host


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))

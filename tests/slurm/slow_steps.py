"""A callback that makes each training step of the Hydra app last a while, for the SLURM tests that
need a job still running when a time-limit signal comes:

    python examples/train.py +callbacks.slow._target_=tests.slurm.slow_steps.SlowSteps +callbacks.slow.seconds=0.5
"""

from __future__ import annotations

import time
from typing import Any

import lightning as L


class SlowSteps(L.Callback):
    """Sleeps ``seconds`` after every training batch."""

    def __init__(self, seconds: float = 0.5) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        time.sleep(self.seconds)

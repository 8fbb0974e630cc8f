"""Lightning's FSDPStrategy on CPU processes with gloo: the stage-3 baseline of the benchmarks.

Lightning refuses ``Trainer(strategy="fsdp", accelerator="cpu")``: its accelerator connector
rejects FSDP without a GPU by an exact-type check (``type(strategy) is FSDPStrategy``), which a
subclass passes. Two more things stand between torch's FullyShardedDataParallel and a CPU:

- FSDP picks its compute device from ``device_id``; Lightning passes ``root_device.index``, which
  is None on CPU, and FSDP then looks for an accelerator and raises. ``_setup_model`` here passes
  ``device_id=torch.device("cpu")``.
- FSDPStrategy always launches by re-running the script (popen). The benchmarks start every
  strategy the same way, so ``start_method`` chooses Lightning's multiprocessing launcher
  ("fork" or "spawn") as ``DDPStrategy(start_method=...)`` does. That launcher hands rank 0's
  ``state_dict()`` back to the launching process, which under FSDP holds rank 0's flat shards
  that the unwrapped module there cannot load; :class:`_ShardedResultsLauncher` leaves them out.

This class is a benchmark baseline only; it is not registered and not part of ``lightning_zero``.
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Literal

import torch
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from typing_extensions import override


class _ShardedResultsLauncher(_MultiProcessingLauncher):
    """Lightning's multiprocessing launcher, without handing rank 0's weights to the launching process."""

    @override
    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> _WorkerOutput | None:
        output = super()._collect_rank_zero_results(trainer, results)
        if output is None or output.weights_path is None:
            return output
        shutil.rmtree(os.path.dirname(output.weights_path))  # a temporary folder holding rank 0's shards
        return output._replace(weights_path=None)


class CPUFSDPStrategy(FSDPStrategy):
    """FSDPStrategy for ``accelerator="cpu"`` (gloo), launched by fork or spawn.

    Args:
        start_method: ``"fork"`` or ``"spawn"``: how Lightning starts the rank processes.
        **kwargs: FSDPStrategy arguments, e.g. ``auto_wrap_policy={Block}`` to make every
            transformer block one FSDP unit; ``process_group_backend`` defaults to ``"gloo"``.
    """

    def __init__(self, *, start_method: Literal["fork", "spawn"] = "fork", **kwargs: Any) -> None:
        kwargs.setdefault("process_group_backend", "gloo")
        super().__init__(**kwargs)
        self._start_method = start_method  # launcher start method

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _ShardedResultsLauncher(self, start_method=self._start_method)

    @override
    def _setup_model(self, model: nn.Module) -> nn.Module:
        """Wrap ``model`` in FSDP with the CPU as compute device (the parent's wrapping, minus CUDA)."""
        return FullyShardedDataParallel(
            module=model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),
            **self.kwargs,
        )

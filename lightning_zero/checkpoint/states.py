"""The model's and an optimizer's checkpoint entries, in either form: what both glues (the
Trainer's strategy and Fabric's) put in a checkpoint, asked of the engine in one place."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.optim import Optimizer

from lightning_zero.checkpoint.full import streamed_model_state, streamed_optimizer_state
from lightning_zero.checkpoint.sharded import sharded_model_state, sharded_optimizer_state


def model_state(module: nn.Module, engine: Any, *, sharded: bool) -> dict[str, Any]:
    """The model's entry. Full form: the whole model under the original names, values that live in
    shards as Streamed tensors (see [Note: streamed full checkpoints]); sharded form: this rank's
    slices. Every rank calls it."""
    if sharded:
        return sharded_model_state(module, engine)
    engine.take_back()  # see [Note: taking back parameter changes] in engines.py
    if engine.streams_values:
        return streamed_model_state(module, engine)
    return engine.module_state_dict(module)


def optimizer_state(
    module: nn.Module, engine: Any, optimizer: Optimizer, index: int, *, sharded: bool
) -> dict:
    """The ``index``-th optimizer's entry: as one process has it (full form; its per-element
    state as Streamed tensors at stages 1-3), or this rank's slices by parameter name (sharded)."""
    if sharded:
        return sharded_optimizer_state(module, engine, optimizer, index)
    if engine.sharded:
        return streamed_optimizer_state(engine, optimizer, index)
    return engine.optimizer_state(optimizer, index)

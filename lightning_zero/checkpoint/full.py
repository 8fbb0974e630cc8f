"""The full form: rank 0 writes one Lightning checkpoint file; every rank reads it whole and takes its part."""

from __future__ import annotations

import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from torch import nn
from torch.optim import Optimizer

from lightning_zero.checkpoint.files import (
    _publish,
    _sibling,
    _size,
    _write_synced,
    remove_stale_partials,
)
from lightning_zero.checkpoint.format import CheckpointError
from lightning_zero.checkpoint.integrity import add_full_checksums
from lightning_zero.checkpoint.layout import _check_keys, _check_shape, _names, _slots
from lightning_zero.comm import Communicator
from lightning_zero.zero.flat_param import full_optimizer_state

# --------------------------------------------------------------------------- the full form: save


def gather_optimizer_state(
    engine: Any, optimizer: Optimizer, index: int, comm: Communicator
) -> dict[str, Any]:
    """Stages 1-3: the optimizer's state as one process has it, assembled on rank 0 only.

    One flat space and one state name at a time, the ranks' shards are gathered to rank 0, which
    keeps each parameter's slice in CPU memory; the other ranks send their shard and return
    ``{}``, never holding more than their own shards. Every rank must call it.
    """
    groups = engine.group_params(optimizer, index)
    return full_optimizer_state(optimizer, index, engine.flat_spaces(), groups, comm, engine.label, dst=0)


def save_full(
    checkpoint: dict[str, Any],
    path: str,
    comm: Communicator,
    checkpoint_io: CheckpointIO,
    storage_options: Any = None,
    *,
    keep_previous: bool = True,
) -> None:
    """Rank 0 writes ``checkpoint`` as one file, with its tensors' CRC32s; every rank calls it.

    With the default TorchCheckpointIO and a local path, rank 0 streams it into ``.NAME.partial``
    and renames that into place (TorchCheckpointIO itself would first serialize the whole file
    into memory, doubling rank 0's peak); any other CheckpointIO writes as it writes.
    """
    if comm.rank == 0:
        add_full_checksums(checkpoint)  # see [Note: checkpoint checksums]
        local = (
            type(checkpoint_io) is TorchCheckpointIO and storage_options is None and "://" not in str(path)
        )
        if local:
            partial = _sibling(Path(path), "partial")
            partial.parent.mkdir(parents=True, exist_ok=True)
            remove_stale_partials(partial.parent)
            _write_synced(checkpoint, partial)
            _publish(partial, Path(path), keep_previous=keep_previous)
        else:
            checkpoint_io.save_checkpoint(checkpoint, path, storage_options=storage_options)
    comm.barrier(name="checkpoint/barrier/published")


def _read_full(path: Any, checkpoint_io: CheckpointIO, weights_only: bool | None) -> dict[str, Any]:
    try:
        checkpoint = checkpoint_io.load_checkpoint(path, weights_only=weights_only)
    except Exception as err:
        if "Weights only load failed" in str(err) and zipfile.is_zipfile(path):
            raise  # a complete file with objects that weights_only refuses: torch's own advice applies
        raise CheckpointError(
            f"cannot read the checkpoint file {path} ({_size(path)}): truncated, corrupt or not written by "
            f"torch.save ({type(err).__name__}: {err})"
        ) from err
    if not isinstance(checkpoint, Mapping) or "state_dict" not in checkpoint:
        found = (
            sorted(map(str, checkpoint))[:8] if isinstance(checkpoint, Mapping) else type(checkpoint).__name__
        )
        raise CheckpointError(
            f"{path} is not a Lightning checkpoint: it has no 'state_dict' entry (found: {found}). A bare "
            "model state dict loads with module.load_state_dict(torch.load(...)), not through the Trainer"
        )
    return checkpoint


def _load_full_model(module: nn.Module, engine: Any, state: Mapping[str, Any], strict: bool) -> None:
    """From full tensors: each slot takes its part; the rest goes through ``load_state_dict``."""
    _check_keys(module, set(state), strict, source="(a full state dict)")
    names = _names(module)
    slots = _slots(module, engine)
    rest = {}
    with torch.no_grad():
        for key, value in state.items():
            first = names.aliases.get(key, key)
            slot = slots.get(first)
            if slot is None:
                rest[key] = value
            elif key == first:  # a tied parameter's other names are written through its first
                _check_shape(key, value.shape, slot.shape, "the checkpoint")
                if slot.piece is not None:
                    part = value.reshape(-1)[slot.piece.offset : slot.piece.offset + slot.piece.local.numel()]
                    slot.piece.local.copy_(part)
                if slot.whole is not None:
                    slot.whole.copy_(value.reshape(slot.whole.shape))
    module.load_state_dict(rest, strict=False)

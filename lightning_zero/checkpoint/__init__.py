"""Checkpoints: the full form (one file from rank 0) and the sharded form (a directory, every rank
writes its own shards); either loads with any stage on any number of ranks.

[Note: checkpoint forms]
``state_dict_type="full"``: rank 0 writes one Lightning checkpoint file whose ``state_dict`` holds
the full model under the original parameter names and whose ``optimizer_states`` hold the state
of the original parameters, numbered as a single process numbers them. The optimizer state is
consolidated to rank 0 only: one flat space and one state name at a time, each rank sends its
shard (a Gather), rank 0 copies the parameters' slices to CPU memory; the other ranks never hold
more than their shards. The file loads with ``LightningModule.load_from_checkpoint`` as it is.

``state_dict_type="sharded"``: a directory in the ``torch.distributed.checkpoint`` (DCP) format,
see [Note: sharded layout]. Every rank writes only the slices of parameters and optimizer state
that lie in its shards, in parallel; rank 0 adds ``meta.pt`` with everything else Lightning saves
(loops, LR schedulers, callbacks, hyper-parameters) and the layout. ``lightning-zero consolidate``
turns it into a full file without a process group.

The package: ``format.py`` (names, CheckpointError, Piece), ``layout.py`` (who holds what),
``full.py`` and ``sharded.py`` / ``sharded_load.py`` (the two forms), ``files.py`` (partial and
previous siblings, publishing), ``consolidate.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.fabric.plugins import CheckpointIO
from torch import nn

from lightning_zero.checkpoint.consolidate import Consolidated, consolidate
from lightning_zero.checkpoint.files import remove, resolve
from lightning_zero.checkpoint.format import (
    DCP_METADATA_FILE,
    FORMAT,
    FORMAT_VERSION,
    LAYOUT_KEY,
    META_FILE,
    MODEL_PREFIX,
    WEIGHTS_ONLY_DROPS,
    CheckpointError,
    Piece,
)
from lightning_zero.checkpoint.full import _load_full_model, _read_full, gather_optimizer_state, save_full
from lightning_zero.checkpoint.layout import layout_of
from lightning_zero.checkpoint.sharded import (
    ShardedModelState,
    ShardedOptimizerState,
    inspect_sharded,
    save_sharded,
    sharded_model_state,
    sharded_optimizer_state,
)
from lightning_zero.checkpoint.sharded_load import _load_sharded_model, load_sharded_optimizer
from lightning_zero.comm import Communicator

CheckpointError.__module__ = __name__  # raised and shown as lightning_zero.checkpoint.CheckpointError

__all__ = [
    "DCP_METADATA_FILE",
    "FORMAT",
    "FORMAT_VERSION",
    "LAYOUT_KEY",
    "META_FILE",
    "MODEL_PREFIX",
    "WEIGHTS_ONLY_DROPS",
    "CheckpointError",
    "Consolidated",
    "Piece",
    "ShardedModelState",
    "ShardedOptimizerState",
    "consolidate",
    "gather_optimizer_state",
    "inspect_sharded",
    "layout_of",
    "load_model_state",
    "load_sharded_optimizer",
    "read",
    "remove",
    "resolve",
    "save_full",
    "save_sharded",
    "sharded_model_state",
    "sharded_optimizer_state",
]


def read(path: str | Path, checkpoint_io: CheckpointIO, weights_only: bool | None = None) -> dict[str, Any]:
    """Lightning's checkpoint dict: a full file as saved; for a sharded directory ``meta.pt``'s
    entries, with stand-ins for the model and optimizer states, which are read later, each rank
    its own part (checked first: see :func:`inspect_sharded`)."""
    if "://" in str(path):
        return _read_full(str(path), checkpoint_io, weights_only)
    p = resolve(path)
    if not p.is_dir():
        return _read_full(p, checkpoint_io, weights_only)
    meta, metadata = inspect_sharded(p)
    layout = meta.pop(LAYOUT_KEY)
    meta["state_dict"] = ShardedModelState(p, layout, metadata)
    if layout["optimizers"] is not None:
        meta["optimizer_states"] = [
            ShardedOptimizerState(p, layout, metadata, i) for i in range(len(layout["optimizers"]))
        ]
    return meta


def load_model_state(
    module: nn.Module, engine: Any, comm: Communicator, state: Any, *, strict: bool = True
) -> None:
    """Load a checkpoint's model state (a full state dict or a :class:`ShardedModelState`) into
    ``module`` as set up now (any stage, any world size); every rank calls it."""
    if isinstance(state, ShardedModelState):
        _load_sharded_model(module, engine, comm, state, strict)
    else:
        _load_full_model(module, engine, state, strict)
    if engine is not None:
        engine.values_loaded()

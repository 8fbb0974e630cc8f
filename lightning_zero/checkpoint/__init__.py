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
see [Note: sharded layout] in ``layout.py``. Every rank writes only the slices of parameters and
optimizer state that lie in its shards, in parallel; rank 0 adds ``meta.pt`` with everything else
Lightning saves (loops, LR schedulers, callbacks, hyper-parameters) and the layout.
``lightning-zero consolidate`` turns it into a full file without a process group.

The package, a room for each step: a read (``reader.py``, [Note: one-way read]) goes
``locate.py`` (the path, its previous sibling, the fallbacks, the files a form needs) ->
``verify.py`` (the checksums, before parsing where the bytes allow) -> ``unpickle.py`` (through the
allow-list: [Note: what loading runs]) -> ``layout.py`` (who holds what; the Trainer's keys, the
stand-ins), and ``load.py`` reads each rank's part of the stand-ins into the model and optimizers
as set up now. A save (``writer.py``, [Note: one-way write]) goes ``states.py`` and ``hooks.py``
(what the model and optimizers put in it) -> ``disk.py`` (room to write: folders checked at setup,
the space a save needs, a failed write named) -> torch.save or DCP's writer -> ``checksum.py`` (the
CRCs recorded) -> ``publish.py`` (complete or absent, the previous one kept). Under all of them:
``format.py`` (names, CheckpointError, Piece) and ``agree.py`` (decisions every rank takes
together); over them ``consolidate.py``. No room imports one above it, nor this module.
"""

from __future__ import annotations

from lightning_zero.checkpoint.agree import agreed, attempt
from lightning_zero.checkpoint.checksum import INTEGRITY_KEY, files_of
from lightning_zero.checkpoint.consolidate import Consolidated, consolidate
from lightning_zero.checkpoint.disk import CheckpointWriteError, check_writable
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
    UnsafeCheckpointError,
)
from lightning_zero.checkpoint.layout import ShardedModelState, ShardedOptimizerState, layout_of
from lightning_zero.checkpoint.load import load_model_state, load_sharded_optimizer
from lightning_zero.checkpoint.locate import fallbacks, resolve
from lightning_zero.checkpoint.publish import remove, remove_stale_partials
from lightning_zero.checkpoint.reader import LoadedCheckpoint, inspect_sharded, read, read_or_fallback
from lightning_zero.checkpoint.states import (
    gather_optimizer_state,
    sharded_model_state,
    sharded_optimizer_state,
    streamed_model_state,
    streamed_optimizer_state,
)
from lightning_zero.checkpoint.unpickle import refusal
from lightning_zero.checkpoint.verify import (
    by_records,
    verify_full,
    verify_records,
    verify_sharded,
    verify_zip_records,
)
from lightning_zero.checkpoint.writer import save_full, save_sharded

CheckpointError.__module__ = __name__  # raised and shown as lightning_zero.checkpoint.CheckpointError
UnsafeCheckpointError.__module__ = __name__
CheckpointWriteError.__module__ = __name__

__all__ = [
    "DCP_METADATA_FILE",
    "FORMAT",
    "FORMAT_VERSION",
    "LAYOUT_KEY",
    "LoadedCheckpoint",
    "META_FILE",
    "MODEL_PREFIX",
    "WEIGHTS_ONLY_DROPS",
    "CheckpointError",
    "CheckpointWriteError",
    "Consolidated",
    "Piece",
    "ShardedModelState",
    "ShardedOptimizerState",
    "UnsafeCheckpointError",
    "check_writable",
    "consolidate",
    "fallbacks",
    "gather_optimizer_state",
    "inspect_sharded",
    "layout_of",
    "load_model_state",
    "load_sharded_optimizer",
    "read",
    "read_or_fallback",
    "remove",
    "remove_stale_partials",
    "resolve",
    "save_full",
    "save_sharded",
    "sharded_model_state",
    "sharded_optimizer_state",
    "streamed_model_state",
    "streamed_optimizer_state",
    # kept importable from the package as before: the rooms' own public names
    "INTEGRITY_KEY",
    "agreed",
    "attempt",
    "by_records",
    "files_of",
    "refusal",
    "verify_full",
    "verify_records",
    "verify_sharded",
    "verify_zip_records",
]

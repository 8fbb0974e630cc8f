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

The package: ``format.py`` (names, CheckpointError, Piece, what unpickling may run: [Note: what
loading runs]), ``dcp_metadata.py`` (DCP's index read through an allow-list), ``layout.py`` (who
holds what), ``full.py`` and ``sharded.py`` / ``sharded_load.py`` (the two forms), ``files.py``
(partial and previous siblings, publishing), ``integrity.py`` (checksums), ``consolidate.py``.
"""

from __future__ import annotations

import logging
import pickle
from pathlib import Path
from typing import Any

from lightning.fabric.plugins import CheckpointIO
from torch import nn

from lightning_zero.checkpoint.consolidate import Consolidated, consolidate
from lightning_zero.checkpoint.files import fallbacks, remove, remove_stale_partials, resolve
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
    refusal,
)
from lightning_zero.checkpoint.full import (
    _load_full_model,
    _read_full,
    gather_optimizer_state,
    save_full,
    streamed_model_state,
    streamed_optimizer_state,
)
from lightning_zero.checkpoint.integrity import (
    INTEGRITY_KEY,
    by_records,
    files_of,
    verify_full,
    verify_records,
    verify_sharded,
    verify_zip_records,
)
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

log = logging.getLogger(__name__)
CheckpointError.__module__ = __name__  # raised and shown as lightning_zero.checkpoint.CheckpointError
UnsafeCheckpointError.__module__ = __name__

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
    "UnsafeCheckpointError",
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
]


def read(
    path: str | Path,
    checkpoint_io: CheckpointIO,
    weights_only: bool | None = None,
    *,
    comm: Communicator | None = None,
    verify: bool = True,
) -> dict[str, Any]:
    """Lightning's checkpoint dict: a full file as saved; for a sharded directory ``meta.pt``'s
    entries, with stand-ins for the model and optimizer states, which are read later, each rank
    its own part (checked first: see :func:`inspect_sharded`). ``verify``: against the checksums
    recorded when it was written ([Note: checkpoint checksums]); with ``comm`` every rank takes
    part (the sharded form's files are checked one rank each, the verdict shared).

    Nothing in the checkpoint runs unless ``weights_only=False`` says the caller trusts it: a
    global off the allow-list is an :class:`UnsafeCheckpointError` ([Note: what loading runs])."""
    trusted = weights_only is False  # None (Lightning's default) loads weights only, remote files too
    if "://" in str(path):
        return _verified_full(_read_full_or_refuse(str(path), checkpoint_io, trusted), path, verify)
    p = resolve(path)
    if not p.is_dir():
        if verify:
            verify_zip_records(p, only_pickle=True)
        checkpoint = _read_full_or_refuse(p, checkpoint_io, trusted)
        if verify and by_records(checkpoint):
            _shared_verdict(comm, lambda rank, world: verify_records(p, rank=rank, world_size=world))
        return _verified_full(checkpoint, p, verify)
    meta, metadata = inspect_sharded(p, trusted=trusted)
    layout = meta.pop(LAYOUT_KEY)
    if verify:
        _verify_shards(p, metadata, layout.get("checksums"), comm)
    meta["state_dict"] = ShardedModelState(p, layout, metadata, trusted=trusted)
    if layout["optimizers"] is not None:
        meta["optimizer_states"] = [
            ShardedOptimizerState(p, layout, metadata, i, trusted=trusted)
            for i in range(len(layout["optimizers"]))
        ]
    return meta


def _read_full_or_refuse(path: Any, checkpoint_io: CheckpointIO, trusted: bool) -> dict[str, Any]:
    """A full file, weights only unless ``trusted``; torch's refusal of a global named with the file."""
    try:
        return _read_full(path, checkpoint_io, not trusted)
    except Exception as err:
        refused = [
            e
            for e in (err, err.__cause__)
            if isinstance(e, pickle.UnpicklingError) and "Weights only load failed" in str(e)
        ]
        if not refused:
            raise
        raise refusal(path, refused[0]) from err


def _verified_full(checkpoint: dict[str, Any], source: Any, verify: bool) -> dict[str, Any]:
    if verify:
        verify_full(checkpoint, source)
    checkpoint.pop(INTEGRITY_KEY, None)  # describes the file as written, not the dict from now on
    return checkpoint


def _verify_shards(path: Path, metadata: Any, record: Any, comm: Communicator | None) -> None:
    """Each rank checks every N-th shard file; one verdict for all (a control collective)."""
    _shared_verdict(
        comm, lambda rank, world: verify_sharded(path, metadata, record, set(files_of(metadata)[rank::world]))
    )


def _shared_verdict(comm: Communicator | None, check: Any) -> None:
    """``check(rank, world_size)`` on every rank, each its share; the first error raised on all."""
    rank, world = (comm.rank, comm.world_size) if comm is not None else (0, 1)
    error = None
    try:
        check(rank, world)
    except CheckpointError as err:
        error = str(err)
    errors = comm.all_gather_object(error, name="checkpoint/verify") if comm is not None else [error]
    found = next((e for e in errors if e), None)
    if found is not None:
        raise CheckpointError(found)


def read_or_fallback(
    path: str | Path,
    checkpoint_io: CheckpointIO,
    weights_only: bool | None = None,
    *,
    comm: Communicator | None = None,
    verify: bool = True,
) -> dict[str, Any]:
    """:func:`read`, or, when ``path`` is missing or damaged, the first intact checkpoint of
    :func:`fallbacks` with a warning that names both; every rank takes the same decision. A
    refused object (:class:`UnsafeCheckpointError`) is not damage: it is raised, never fallen back from."""
    try:
        return read(path, checkpoint_io, weights_only, comm=comm, verify=verify)
    except UnsafeCheckpointError:
        raise
    except (CheckpointError, FileNotFoundError) as err:
        if "://" in str(path):
            raise
        candidates = fallbacks(Path(path))
        if comm is not None:
            candidates = comm.all_gather_object(candidates, name="checkpoint/fallbacks")[0]  # rank 0's list
        for candidate in candidates:
            try:
                checkpoint = read(candidate, checkpoint_io, weights_only, comm=comm, verify=verify)
            except UnsafeCheckpointError:
                raise
            except (CheckpointError, FileNotFoundError):
                continue
            if comm is None or comm.rank == 0:
                log.warning(
                    f"{path} cannot be loaded ({err}); loading the previous intact checkpoint {candidate} "
                    f"(step {checkpoint.get('global_step')}) instead"
                )
            return checkpoint
        raise


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

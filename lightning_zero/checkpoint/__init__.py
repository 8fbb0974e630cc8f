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
(partial and previous siblings, publishing), ``integrity.py`` (checksums), ``agree.py`` (decisions
every rank takes together), ``disk.py`` (room to write: folders checked at setup, the space a save
needs, a failed write named), ``consolidate.py``.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.fabric.plugins import CheckpointIO
from torch import nn

from lightning_zero.checkpoint.agree import agreed, attempt
from lightning_zero.checkpoint.consolidate import Consolidated, consolidate
from lightning_zero.checkpoint.disk import CheckpointWriteError, check_writable
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
    part (the sharded form's files and the full form's streamed records are checked split over the
    ranks). Every rank ends alike: each rank's reading is agreed before anything else ([Note:
    agreed checkpoint decisions] in ``agree.py``), so a read that fails on one rank raises on all.

    Nothing in the checkpoint runs unless ``weights_only=False`` says the caller trusts it: a
    global off the allow-list is an :class:`UnsafeCheckpointError` ([Note: what loading runs])."""
    trusted = weights_only is False  # None (Lightning's default) loads weights only, remote files too
    loaded, error = attempt(lambda: _read_here(path, checkpoint_io, trusted, verify), where=path)
    agreed(comm, error, what=f"reading the checkpoint {path}", name="checkpoint/read")
    checkpoint, share = loaded
    if verify:
        _shared_verdict(comm, share, path)
    return checkpoint


Share = Callable[[int, int], None]  # (rank, world size) -> None; raises what that rank's share finds


def _read_here(
    path: Any, checkpoint_io: CheckpointIO, trusted: bool, verify: bool
) -> tuple[dict, Share | None]:
    """What this rank reads alone, checked as far as one rank checks it; and the check split over
    the ranks that follows (None: nothing left to check)."""
    if "://" in str(path):
        return _verified_full(_read_full_or_refuse(str(path), checkpoint_io, trusted), path, verify), None
    p = resolve(path)
    if not p.is_dir():
        if verify:
            verify_zip_records(p, only_pickle=True)
        checkpoint = _read_full_or_refuse(p, checkpoint_io, trusted)
        records = verify and by_records(checkpoint)
        checkpoint = _verified_full(checkpoint, p, verify)  # every tensor with a CRC of its own
        return checkpoint, (
            lambda rank, world: verify_records(p, rank=rank, world_size=world)
        ) if records else None
    meta, metadata = inspect_sharded(p, trusted=trusted, verify=verify)
    layout = meta.pop(LAYOUT_KEY)
    record = layout.get("checksums")
    meta["state_dict"] = ShardedModelState(p, layout, metadata, trusted=trusted)
    if layout["optimizers"] is not None:
        meta["optimizer_states"] = [
            ShardedOptimizerState(p, layout, metadata, i, trusted=trusted)
            for i in range(len(layout["optimizers"]))
        ]
    return meta, lambda rank, world: verify_sharded(p, metadata, record, set(files_of(metadata)[rank::world]))


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


def _shared_verdict(comm: Communicator | None, share: Share | None, path: Any) -> None:
    """``share(rank, world_size)`` on every rank (each checks its part; None: nothing to check), then
    one verdict for all (a control collective): the first damage found is raised on every rank."""
    rank, world = (comm.rank, comm.world_size) if comm is not None else (0, 1)
    _, error = attempt(lambda: share(rank, world) if share is not None else None, where=path)
    mine = None if error is None else f"{type(error).__name__}: {error}"
    errors = comm.all_gather_object(mine, name="checkpoint/verify") if comm is not None else [mine]
    found = next(((r, e) for r, e in enumerate(errors) if e), None)
    if found is None:
        return
    if error is not None:
        raise error
    raise CheckpointError(f"{found[1].split(': ', 1)[1]} (found by rank {found[0]})")


class LoadedCheckpoint(dict):
    """A checkpoint dict as :func:`read_or_fallback` returns it, with the path it was read from."""

    def __init__(self, entries: dict[str, Any], loaded_from: str, requested: str) -> None:
        super().__init__(entries)
        self.loaded_from = loaded_from  # the checkpoint actually read (a fallback's, if it fell back)
        self.requested = requested  # the checkpoint asked for

    @property
    def fell_back(self) -> bool:
        """Another checkpoint than the one asked for was loaded (a fallback)."""
        return self.loaded_from != self.requested


def read_or_fallback(
    path: str | Path,
    checkpoint_io: CheckpointIO,
    weights_only: bool | None = None,
    *,
    comm: Communicator | None = None,
    verify: bool = True,
) -> LoadedCheckpoint:
    """:func:`read`, or, when ``path`` is missing or damaged, the first intact checkpoint of
    :func:`fallbacks` with a warning that names both; ``loaded_from`` says which was read. Every
    rank takes the same decision: each read's outcome is agreed first (a read that fails on one
    rank only falls back on all). A refused object (:class:`UnsafeCheckpointError`) is not damage:
    it is raised, never fallen back from."""
    try:
        return LoadedCheckpoint(
            read(path, checkpoint_io, weights_only, comm=comm, verify=verify), str(path), str(path)
        )
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
            return LoadedCheckpoint(checkpoint, str(candidate), str(path))
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

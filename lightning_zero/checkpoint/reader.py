"""Reading a checkpoint: :func:`read`, and :func:`read_or_fallback`, which falls back to an older
intact checkpoint; the glues call them through the run (``runtime.py``).

[Note: one-way read]
A read flows one way. This module composes its steps top to bottom, each in the room named after
it; no room calls another room's step or back up (to this module, the package or a glue), they
only call down into ``format.py`` and ``checksum.py``:

1. locate (``locate.py``): the path, or its previous sibling where a save stopped between its
   renames; which form it is; the files that form needs;
2. verify (``verify.py``): the checksums of what is about to be parsed, before it is parsed;
3. unpickle (``unpickle.py``): through an allow-list ([Note: what loading runs]);
4. lay out (``layout.py``): for the caller.

A full file goes through them once: its pickle record's CRC, ``torch.load`` weights only, the
Trainer's keys; its tensors are then checked against their own CRCs, named by the paths the caller
finds them at. A sharded directory goes through them twice, since ``meta.pt`` keeps the CRC of
DCP's ``.metadata``: first ``meta.pt`` (the two index files located, its records verified,
unpickled, its layout entry read), then ``.metadata`` (verified against that CRC, so a damaged file
is named damaged and not a parser's error; unpickled through its own allow-list; the shard files it
names located, there and long enough; the stand-ins laid out). What is checked split over the
ranks (the shards' chunks, a streamed file's storage records) follows once every rank's own read is
agreed ([Note: agreed checkpoint decisions] in ``agree.py``). The later per-rank reads of the
stand-ins go lay out -> unpickle (``load.py``).

Traced (a stop: a run of calls in one file), ``fabric.load`` of a model and its optimizer in one
process went through 63 stops for a sharded checkpoint and 31 for a full file before these rooms,
``checkpoint/__init__.py`` entered 4 and 6 times and the sharded form's room calling the rooms of
the checksums, the format and DCP's metadata sideways; now 50 and 30, every call between rooms
made by this module (or by ``agree.py``, running the step it is handed), or down into ``format.py``
and ``checksum.py``. ``tests/unit/test_checkpoint_rooms.py`` keeps the imports one way.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from lightning.fabric.plugins import CheckpointIO
from torch.distributed.checkpoint.metadata import Metadata

from lightning_zero.checkpoint.agree import Share, _shared_verdict, agreed, attempt
from lightning_zero.checkpoint.checksum import files_of
from lightning_zero.checkpoint.format import (
    INTEGRITY_KEY,
    LAYOUT_KEY,
    META_FILE,
    CheckpointError,
    UnsafeCheckpointError,
)
from lightning_zero.checkpoint.layout import _saved_layout, in_trainer_layout, with_stand_ins
from lightning_zero.checkpoint.locate import _check_complete, _check_storage, fallbacks, resolve
from lightning_zero.checkpoint.unpickle import _load_meta, _read_full_or_refuse, read_dcp_metadata
from lightning_zero.checkpoint.verify import (
    by_records,
    verify_full,
    verify_metadata_file,
    verify_records,
    verify_sharded,
    verify_zip_records,
)
from lightning_zero.comm import Communicator

log = logging.getLogger(__name__)


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
    its own part (checked first: see :func:`inspect_sharded` and [Note: one-way read]). ``verify``:
    against the checksums recorded when it was written ([Note: checkpoint checksums] in
    ``checksum.py``); with ``comm`` every rank takes part (the sharded form's files and the full
    form's streamed records are checked split over the ranks). Every rank ends alike: each rank's
    reading is agreed before anything else ([Note: agreed checkpoint decisions] in ``agree.py``), so
    a read that fails on one rank raises on all.

    Nothing in the checkpoint runs unless ``weights_only=False`` says the caller trusts it: a
    global off the allow-list is an :class:`UnsafeCheckpointError` ([Note: what loading runs] in
    ``unpickle.py``)."""
    trusted = weights_only is False  # None (Lightning's default) loads weights only, remote files too
    loaded, error = attempt(lambda: _read_here(path, checkpoint_io, trusted, verify), where=path)
    agreed(comm, error, what=f"reading the checkpoint {path}", name="checkpoint/read")
    checkpoint, share = loaded
    if verify:
        _shared_verdict(comm, share, path)
    return checkpoint


def _read_here(
    path: Any, checkpoint_io: CheckpointIO, trusted: bool, verify: bool
) -> tuple[dict, Share | None]:
    """What this rank reads alone, checked as far as one rank checks it; and the check split over
    the ranks that follows (None: nothing left to check)."""
    if "://" in str(path):  # a remote file, as its CheckpointIO reads it
        checkpoint = in_trainer_layout(_read_full_or_refuse(str(path), checkpoint_io, trusted), str(path))
        return _verified_full(checkpoint, path, verify), None
    p = resolve(path)  # locate
    if p.is_dir():
        return _read_directory(p, trusted, verify)
    return _read_file(p, checkpoint_io, trusted, verify)


def _read_file(
    p: Path, checkpoint_io: CheckpointIO, trusted: bool, verify: bool
) -> tuple[dict, Share | None]:
    """A full file: its pickle record checked, unpickled, in the Trainer's layout, every tensor with a
    CRC of its own checked; the storage records of streamed tensors are the check split over the ranks."""
    if verify:
        verify_zip_records(p, only_pickle=True)  # verify: the pickle, before it is parsed
    checkpoint = _read_full_or_refuse(p, checkpoint_io, trusted)  # unpickle
    checkpoint = in_trainer_layout(checkpoint, p)  # lay out
    records = verify and by_records(checkpoint)
    checkpoint = _verified_full(checkpoint, p, verify)  # every tensor with a CRC of its own
    if not records:
        return checkpoint, None
    return checkpoint, lambda rank, world: verify_records(p, rank=rank, world_size=world)


def _verified_full(checkpoint: dict[str, Any], source: Any, verify: bool) -> dict[str, Any]:
    if verify:
        verify_full(checkpoint, source)
    checkpoint.pop(INTEGRITY_KEY, None)  # describes the file as written, not the dict from now on
    return checkpoint


def _read_directory(p: Path, trusted: bool, verify: bool) -> tuple[dict, Share]:
    """A sharded directory: ``meta.pt``'s entries with the stand-ins; its shard files' chunks are the
    check split over the ranks."""
    meta, metadata = inspect_sharded(p, trusted=trusted, verify=verify)
    record = meta[LAYOUT_KEY].get("checksums")

    def share(rank: int, world: int) -> None:
        verify_sharded(p, metadata, record, set(files_of(metadata)[rank::world]))

    return with_stand_ins(meta, p, metadata, trusted=trusted), share  # lay out


def inspect_sharded(
    path: Path, *, trusted: bool = False, verify: bool = True
) -> tuple[dict[str, Any], Metadata]:
    """``meta.pt``'s entries and DCP's metadata of a sharded checkpoint, after checking that every
    file it needs is there and long enough; otherwise a CheckpointError naming what is missing.
    Nothing of either file runs unless ``trusted`` (``meta.pt`` only; see [Note: what loading runs]).
    ``verify``: ``.metadata`` is checked against its recorded checksum before it is parsed."""
    _check_complete(path)  # locate: the two index files
    verify_zip_records(path / META_FILE, only_pickle=False)  # verify: meta.pt is small, every record's CRC
    meta = _load_meta(path / META_FILE, trusted)  # unpickle
    layout = _saved_layout(meta, path)  # the layout entry: ours, in a version this build reads
    if verify:
        verify_metadata_file(path, layout.get("checksums"))  # verify: .metadata, before it is parsed
    metadata = read_dcp_metadata(path)  # unpickle, through its own allow-list
    _check_storage(path, metadata)  # locate: the shard files it names
    return dict(meta), metadata


# --------------------------------------------------------------------------- falling back


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

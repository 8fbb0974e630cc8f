"""Writing a checkpoint, either form: every rank calls :func:`save_full` or :func:`save_sharded`.

[Note: one-way write]
A save flows one way, each step in its own room, none calling back up:

1. lay out: what the glue put in the checkpoint (``states.py``, ``hooks.py``; ``layout.py``'s
   :func:`layout_of` for ``meta.pt``);
2. room to write (``disk.py``): the folder made, the space the save needs checked;
3. write (here): the full form by torch.save into ``.NAME.partial``, the stand-ins gathered while
   it is written; the sharded form by DCP's writer, every rank its shards, then rank 0 ``meta.pt``;
4. checksum (``checksum.py``): the full form's CRCs go into the file before it is written, the
   shards' are taken of the bytes written and kept in ``meta.pt``;
5. publish (``publish.py``): [Note: complete or absent].
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex

from lightning_zero.checkpoint.checksum import add_full_checksums, files_of, shard_checksums, sharded_record
from lightning_zero.checkpoint.disk import (
    CheckpointWriteError,
    free_bytes,
    needed_bytes,
    room_for,
    write_failed,
)
from lightning_zero.checkpoint.format import LAYOUT_KEY, META_FILE, MODEL_PREFIX, Piece, _optimizer_prefix
from lightning_zero.checkpoint.locate import _sibling
from lightning_zero.checkpoint.publish import _publish, _remove, remove_stale_partials
from lightning_zero.checkpoint.states import _gather_space
from lightning_zero.comm import Communicator
from lightning_zero.streamed import Streamed, contains_streamed, plan
from lightning_zero.streamed import write as write_streamed

# --------------------------------------------------------------------------- the full form


def save_full(
    checkpoint: dict[str, Any],
    path: str,
    comm: Communicator,
    checkpoint_io: CheckpointIO,
    storage_options: Any = None,
    *,
    engine: Any = None,
    keep_previous: bool = True,
) -> None:
    """Rank 0 writes ``checkpoint`` as one file, with its tensors' CRC32s; every rank calls it.

    With the default TorchCheckpointIO and a local path, rank 0 writes ``.NAME.partial`` and
    renames it into place (TorchCheckpointIO itself would first serialize the whole file into
    memory, doubling rank 0's peak); tensors that live in shards (:class:`Streamed` stand-ins, see
    [Note: streamed full checkpoints]) are gathered one flat space at a time while it writes, their
    checksums the CRC32 the zip format keeps for each record. Any other CheckpointIO gets the whole
    dict, the stand-ins gathered into rank 0's memory first.
    """
    local = type(checkpoint_io) is TorchCheckpointIO and storage_options is None and "://" not in str(path)
    streamed = engine is not None and contains_streamed(checkpoint)
    needed = needed_bytes(checkpoint) if comm.rank == 0 else 0
    error = _prepare(Path(path), needed) if local and comm.rank == 0 else None
    items: list = []
    if streamed:  # the plan and whether rank 0 can write, before any gather
        items, error = comm.broadcast_object(
            (plan(checkpoint), error), name="checkpoint/plan", device=_device(engine)
        )
        if error is not None:
            raise CheckpointWriteError(error)
    gather = functools.partial(_gather_space, engine, comm) if streamed else None
    if error is None and not local:
        if streamed:
            checkpoint = _materialize(checkpoint, engine, comm, gather, items)
        if comm.rank == 0:
            error = _save_through(checkpoint, path, checkpoint_io, storage_options, needed)
    elif error is None:
        if comm.rank == 0:
            add_full_checksums(checkpoint)  # the stand-ins: by their zip records
        error = _write_local(checkpoint, Path(path), comm, engine, gather, items, needed, keep_previous)
    errors = comm.all_gather_object(error, name="checkpoint/published")  # every rank: saved, or the error
    if errors[0] is not None:
        raise CheckpointWriteError(errors[0])


def _prepare(path: Path, needed: int) -> str | None:
    """Rank 0, before writing ``path``: its folder made, leftovers removed, room for ``needed``
    bytes checked ([Note: a save that cannot be written] in ``disk.py``); the error, or None."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_partials(path.parent)
    except OSError as err:
        return write_failed(path, needed, err)
    return room_for(path, needed)


def _save_through(
    checkpoint: dict[str, Any], path: Any, checkpoint_io: CheckpointIO, options: Any, needed: int
) -> str | None:
    """Rank 0: the whole dict, on the host with its checksums, to another CheckpointIO; the error's
    message, or None."""
    try:
        checkpoint = on_host(checkpoint)
        add_full_checksums(checkpoint)  # see [Note: checkpoint checksums]
        checkpoint_io.save_checkpoint(checkpoint, path, storage_options=options)
    except Exception as err:
        return write_failed(path, needed, err)
    return None


def _write_local(
    checkpoint: dict[str, Any],
    path: Path,
    comm: Communicator,
    engine: Any,
    gather: Any,
    items: list,
    needed: int,
    keep_previous: bool,
) -> str | None:
    """Rank 0 writes ``.NAME.partial`` and publishes it; the other ranks send their shards for the
    streamed tensors. A write that fails on rank 0 removes the partial file and goes on with the
    gathers (the ranks stay in step); returns the error's message (rank 0), or None."""
    partial = _sibling(path, "partial")
    done, counted = _counting(gather)
    try:
        if gather is not None:
            write_streamed(checkpoint, partial, comm, engine.param_spaces(), counted, items)
            if comm.rank == 0:
                _fsync(partial)
        elif comm.rank == 0:
            _write_synced(on_host(checkpoint), partial)
        if comm.rank == 0:
            _publish(partial, path, keep_previous=keep_previous)
    except Exception as err:
        if comm.rank != 0 or done.gathering:
            raise  # a collective failed: the fault reporting names the rank (docs/failures.md)
        for space, what in items[done.count :]:
            gather(space, what)  # sent on by the others all the same
        _remove(partial)
        return write_failed(path, needed, err)
    return None


class _Gathered:
    """How far a streamed write got: gathers completed, and whether one is under way."""

    def __init__(self) -> None:
        self.count = 0  # gathers completed
        self.gathering = False  # a gather (a collective) is under way


def _counting(gather: Any) -> tuple[_Gathered, Any]:
    done = _Gathered()
    if gather is None:
        return done, None

    def counted(space: int, what: Any) -> Any:
        done.gathering = True
        out = gather(space, what)
        done.gathering, done.count = False, done.count + 1
        return out

    return done, counted


def on_host(obj: Any) -> Any:
    """``obj`` with its device tensors copied to the CPU: a full checkpoint loads onto the CPU
    wherever it was saved (each rank then puts its part on its own device), never onto ``cuda:0``."""
    return apply_to_collection(obj, Tensor, lambda t: t if t.device.type == "cpu" else t.detach().to("cpu"))


def _device(engine: Any) -> torch.device:
    spaces = engine.param_spaces()
    return spaces[0].shard.device if spaces else torch.device("cpu")


def _fsync(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _materialize(checkpoint: Any, engine: Any, comm: Communicator, gather: Any, items: list) -> Any:
    """The stand-ins replaced by their values in rank 0's memory (another CheckpointIO writes it)."""
    values: dict[Any, Tensor] = {}
    spaces = engine.param_spaces()
    for space, what in items:
        full = gather(space, what)
        if full is None:
            continue
        for i in range(len(spaces[space].shapes)):
            values[(space, i, what)] = spaces[space].value_of(full, i).to("cpu", copy=True)

    def resolve(obj: Any) -> Any:
        if isinstance(obj, Streamed):
            return values.get((obj.source.space, obj.source.position, obj.source.state))
        if isinstance(obj, dict):
            return {k: resolve(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(resolve(v) for v in obj)
        return obj

    return resolve(checkpoint) if comm.rank == 0 else {}


def _write_synced(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


# --------------------------------------------------------------------------- the sharded form


def save_sharded(
    checkpoint: dict[str, Any],
    path: Path,
    comm: Communicator,
    layout: dict[str, Any],
    *,
    keep_previous: bool = True,
) -> None:
    """Write a sharded checkpoint directory at ``path`` (every rank calls it; see [Note: complete
    or absent]). ``checkpoint`` is Lightning's dict with this rank's model and optimizer parts
    (:func:`sharded_model_state`, :func:`sharded_optimizer_state`). Every rank checksums the
    chunks it wrote ([Note: checkpoint checksums]); rank 0 keeps them in meta.pt."""
    items = {MODEL_PREFIX + k: v for k, v in checkpoint.pop("state_dict").items()}
    optimizers = checkpoint.pop("optimizer_states", None)
    for i, opt in enumerate(optimizers or []):
        for name, entry in opt["state"].items():
            for sname, value in entry.items():
                items[f"{_optimizer_prefix(i)}{name}.{sname}"] = value
    layout = {**layout, "optimizers": None if optimizers is None else [o["param_groups"] for o in optimizers]}
    partial = _sibling(path, "partial")
    needed = _ready_to_write(items, path, partial, comm)
    try:
        metadata = comm.save_checkpoint_items(
            items, FileSystemWriter(partial), _SavePlanner(), name="checkpoint/save/shards"
        )
    except CheckpointException as err:  # a write failed on some rank; DCP told every rank
        if comm.rank == 0:
            _remove(partial)
        raise CheckpointWriteError(_failed_write(err, path, needed, comm)) from err
    mine = {f for f in files_of(metadata) if f.startswith(f"__{comm.rank}_")}
    sums, error = _attempt_io(lambda: shard_checksums(partial, metadata, mine), path, needed)
    chunks = comm.all_gather_object((sums, error), name="checkpoint/checksums")
    error = next((e for _, e in chunks if e), None)
    if error is None and comm.rank == 0:
        layout["checksums"] = sharded_record(partial, {k: v for part, _ in chunks for k, v in part.items()})
        _, error = _attempt_io(
            lambda: _finish(checkpoint, layout, partial, path, keep_previous), path, needed
        )
    if error is not None and comm.rank == 0:
        _remove(partial)
    errors = comm.all_gather_object(error, name="checkpoint/published")  # every rank: saved, or the error
    if any(errors):
        raise CheckpointWriteError(next(e for e in errors if e))


class _SavePlanner(DefaultSavePlanner):
    """DCP's default save planner; a :class:`Piece` gives its own write item and its ``local`` data.

    [Note: pieces written without copies]
    torch's ``FileSystemWriter`` clones every tensor whose storage is larger than the tensor before
    it writes it (so as not to write the whole storage), and keeps every tensor it wrote until the
    rank's file is closed. A parameter's piece views its unit's or bucket's flat shard, so a sharded
    save held a copy of all of this rank's parameters at once (4Ψ/N in fp32: 194 MiB above the state
    on a 100.8M model at N = 2). A piece in host memory is therefore handed over as a tensor of its
    own storage over the same memory (through a NumPy view of its bytes): nothing is cloned, and
    what the writer keeps costs nothing. Device tensors are copied to the host by the writer anyway.
    """

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, Piece):
            return own_storage_view(obj.local.detach())
        return super().lookup_object(index)


def own_storage_view(t: Tensor) -> Tensor:
    """``t`` as a tensor whose storage is exactly its bytes, sharing its memory (no copy), where ``t``
    is a contiguous host tensor viewing a larger storage; ``t`` itself otherwise (or without NumPy).
    The result keeps ``t``'s memory alive."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.untyped_storage().nbytes() == t.nbytes:
        return t
    try:
        raw = t.reshape(-1).view(torch.uint8).numpy()  # the bytes, viewed
    except (RuntimeError, TypeError):  # NumPy absent, or a layout it cannot view
        return t
    return torch.from_numpy(raw).view(t.dtype).view(t.shape)


def _ready_to_write(items: dict[str, Any], path: Path, partial: Path, comm: Communicator) -> int:
    """Rank 0 makes ``.NAME.partial``; every rank learns whether it could, and whether the bytes all
    ranks will write fit in the space free there ([Note: a save that cannot be written] in
    ``disk.py``): all go on, or all raise before anything is written. Returns the bytes needed."""
    error, free, mine = None, None, needed_bytes(items, whole=comm.rank == 0)
    if comm.rank == 0:
        try:
            remove_stale_partials(path.parent)
            partial.mkdir(parents=True)
        except OSError as err:
            error = write_failed(path, mine, err)
        free = free_bytes(path.parent)
    shares = comm.all_gather_object((mine, error, free), name="checkpoint/partial")
    needed = sum(n for n, _, _ in shares)
    error = shares[0][1] or room_for(path, needed, free=shares[0][2])
    if error is not None:
        if comm.rank == 0:
            _remove(partial)
        raise CheckpointWriteError(error)
    return needed


def _finish(
    checkpoint: dict[str, Any], layout: dict[str, Any], partial: Path, path: Path, keep: bool
) -> None:
    """Rank 0: meta.pt written into the partial directory, which is then published."""
    _write_synced({**checkpoint, LAYOUT_KEY: layout}, partial / META_FILE)
    _publish(partial, path, keep_previous=keep)


def _attempt_io(step: Any, path: Path, needed: int) -> tuple[Any, str | None]:
    """``step()``'s value and None, or an empty dict and the message of its failure (an OSError, or
    torch's zip writer's RuntimeError: the ranks must stay in step whatever it was)."""
    try:
        return step(), None
    except Exception as err:
        return {}, write_failed(path, needed, err)


def _failed_write(err: CheckpointException, path: Path, needed: int, comm: Communicator) -> str:
    """The message every rank raises for a DCP write that failed: the first failing rank's own
    account (its errno, its file size limit), shared in one control collective."""
    failure = err.failures.get(comm.rank)
    mine = write_failed(path, needed, failure[0]) if failure is not None else None
    messages = comm.all_gather_object(mine, name="checkpoint/write_failed")
    first = next((m for m in messages if m), None) or write_failed(path, needed, err)
    return f"{first} (the write failed on rank(s) {', '.join(map(str, sorted(err.failures)))})"

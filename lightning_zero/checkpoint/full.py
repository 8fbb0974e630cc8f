"""The full form: rank 0 writes one Lightning checkpoint file; every rank reads it whole and takes its part.

[Note: two layouts of the full file]
The Trainer's strategy writes the Trainer's layout: ``state_dict``, ``optimizer_states`` (a list),
``lr_schedulers``, ``pytorch-lightning_version``, loops, callbacks. Fabric's strategy writes what
Fabric's DDP writes: the user's own keys (``{"model": <the model's state dict>, "optimizer":
<optimizer.state_dict() of one process>, "iter_num": 3}``), plus :data:`FABRIC_RECORD`, which names
the keys of the model, the optimizers and the LR schedulers (``"layout": "user keys"``) and the
Lightning version. Every reader of this package takes the Trainer's layout: :func:`_read_full` maps a
file of the user's keys onto it (:func:`as_trainer_layout`, checksum paths included), so the Trainer
resumes a Fabric file and Fabric loads either. Fabric files written before this layout hold the
Trainer's layout with the record (without ``"layout"``) and read as they are. A file of user keys
without the record (Fabric's DDP wrote it) is a :class:`UserKeyedCheckpoint` that carries its
entries: Fabric's strategy reads it with the keys of the state it is asked to load.
"""

from __future__ import annotations

import functools
import os
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.checkpoint.disk import CheckpointWriteError, needed_bytes, room_for, write_failed
from lightning_zero.checkpoint.files import (
    _publish,
    _remove,
    _sibling,
    _size,
    _write_synced,
    remove_stale_partials,
)
from lightning_zero.checkpoint.format import CheckpointError, _hyper
from lightning_zero.checkpoint.integrity import INTEGRITY_KEY, add_full_checksums
from lightning_zero.checkpoint.layout import _check_keys, _check_shape, _names, _slots
from lightning_zero.comm import Communicator
from lightning_zero.streamed import Resolver, Streamed, contains_streamed, plan
from lightning_zero.streamed import Source as StreamSource
from lightning_zero.streamed import write as write_streamed
from lightning_zero.zero.dtensor import local_of
from lightning_zero.zero.flat_param import full_optimizer_state, original_indices

FABRIC_RECORD = "lightning_zero_fabric"  # a Fabric save's entry naming the user's keys of each role
USER_KEYS = "user keys"  # the record's "layout" when the file holds the user's keys (Fabric's DDP layout)

# --------------------------------------------------------------------------- the full form: save


def gather_optimizer_state(
    engine: Any, optimizer: Optimizer, index: int, comm: Communicator
) -> dict[str, Any]:
    """Stages 1-3: the optimizer's state as one process has it, assembled in rank 0's memory only
    (the others return ``{}``), one flat space and one state name at a time; every rank calls it.
    Checkpoints do not use it: they write the state while gathering it (:func:`streamed_optimizer_state`)."""
    groups = engine.group_params(optimizer, index)
    return full_optimizer_state(optimizer, index, engine.flat_spaces(), groups, comm, engine.label, dst=0)


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


def streamed_model_state(module: nn.Module, engine: Any) -> dict[str, Any]:
    """The full form's model state with stand-ins for the parameters that live in shards: the
    values the optimizer holds (fp32 masters under a policy), written as they are gathered."""
    stand_ins: dict[int, Any] = {}
    resolve = resolver(engine)
    for s, space in enumerate(engine.param_spaces()):
        for i, (p, shape) in enumerate(zip(space.params, space.shapes)):
            stand_ins[id(p)] = Streamed(StreamSource(s, i, None), shape, space.shard.dtype, resolve)
    state = module.state_dict(keep_vars=True)
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in stand_ins:
            state[name] = stand_ins[id(p)]
    return {
        k: v.detach() if isinstance(v, Tensor) and not isinstance(v, Streamed) else v
        for k, v in state.items()
    }


def resolver(engine: Any) -> Resolver:
    """What a :class:`Streamed` of ``engine``'s spaces gathers its values with (every rank)."""
    return Resolver(functools.partial(_all_gather_space, engine), engine.param_spaces())


def streamed_optimizer_state(engine: Any, optimizer: Optimizer, index: int) -> dict[str, Any]:
    """Stages 1-3: the optimizer's state as one process has it, per-element states as stand-ins
    gathered while the file is written; step counts and other scalars as they are."""
    groups = engine.group_params(optimizer, index)
    ids = original_indices(groups)
    resolve = resolver(engine)
    state: dict[int, dict[str, Any]] = {}
    for s, space in enumerate(engine.param_spaces()):
        for i, sub in space.optimizer_subs(index).items():
            entry = state.setdefault(ids[id(space.params[i])], {})
            for sname, value in optimizer.state.get(sub, {}).items():
                if isinstance(value, Tensor) and value.dim() > 0 and sname != "step":
                    source = StreamSource(s, i, (index, sname))
                    entry[sname] = Streamed(source, space.shapes[i], value.dtype, resolve)
                else:
                    entry[sname] = value.to("cpu", copy=True) if isinstance(value, Tensor) else value
    param_groups = [
        {**_hyper(g), "params": [ids[id(p)] for p in ps]} for g, ps in zip(optimizer.param_groups, groups)
    ]
    return {"state": dict(sorted((k, v) for k, v in state.items() if v)), "param_groups": param_groups}


def _gather_space(engine: Any, comm: Communicator, space: int, what: tuple[int, str] | None) -> Tensor | None:
    """The full padded values of one flat space (its parameters, or one per-element state of one
    optimizer), on rank 0 only; every rank calls it. Gathered in the group the engine shards over
    (with hybrid sharding, every shard group gathers its copy: the ranks stay in step, and rank 0
    is the first group's first rank)."""
    chunk = _own_values(engine, space, what)
    group = engine.comm
    full = (
        torch.empty(engine.param_spaces()[space].padded_numel, dtype=chunk.dtype, device=chunk.device)
        if group.rank == 0
        else None
    )
    group.gather(full, chunk, dst=0, name=f"{engine.label}/gather/checkpoint")
    return full if comm.rank == 0 else None


def _all_gather_space(engine: Any, space: int, what: tuple[int, str] | None) -> Tensor:
    """As :func:`_gather_space`, on every rank (a :class:`Streamed` used as a tensor)."""
    chunk = _own_values(engine, space, what)
    full = torch.empty(engine.param_spaces()[space].padded_numel, dtype=chunk.dtype, device=chunk.device)
    engine.comm.all_gather(full, chunk, name=f"{engine.label}/all_gather/checkpoint_tensor", async_op=False)
    return full


def _own_values(engine: Any, space: int, what: tuple[int, str] | None) -> Tensor:
    """This rank's chunk (1D, shard_numel) of one space's parameters or per-element state."""
    flat = engine.param_spaces()[space]
    if what is None:
        chunk = flat.shard.detach()
    else:
        index, sname = what
        optimizer = engine.optimizer_of(index)
        values = {i: optimizer.state.get(sub, {}).get(sname) for i, sub in flat.optimizer_subs(index).items()}
        sample = next(v for v in values.values() if v is not None)
        chunk = torch.zeros(flat.shard_numel, dtype=sample.dtype, device=sample.device)
        for i, value in values.items():
            if value is not None:
                chunk[flat.slices[i].start : flat.slices[i].stop].copy_(local_of(value).reshape(-1))
    return chunk


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


def _read_full(path: Any, checkpoint_io: CheckpointIO, weights_only: bool | None) -> dict[str, Any]:
    try:
        checkpoint = _load(path, checkpoint_io, weights_only)
    except Exception as err:
        if "Weights only load failed" in str(err) and zipfile.is_zipfile(path):
            raise  # a complete file with objects that weights_only refuses: torch's own advice applies
        raise CheckpointError(
            f"cannot read the checkpoint file {path} ({_size(path)}): truncated, corrupt or not written by "
            f"torch.save ({type(err).__name__}: {err})"
        ) from err
    if isinstance(checkpoint, Mapping):
        checkpoint = as_trainer_layout(checkpoint)
    if not isinstance(checkpoint, Mapping) or "state_dict" not in checkpoint:
        found = (
            sorted(map(str, checkpoint))[:8] if isinstance(checkpoint, Mapping) else type(checkpoint).__name__
        )
        message = (
            f"{path} is not a Lightning checkpoint: it has no 'state_dict' entry (found: {found}). A bare "
            "model state dict loads with module.load_state_dict(torch.load(...)), not through the Trainer"
        )
        if isinstance(checkpoint, Mapping):
            raise UserKeyedCheckpoint(message, checkpoint)
        raise CheckpointError(message)
    return checkpoint


class UserKeyedCheckpoint(CheckpointError):
    """A full file of entries under a program's own keys with no record of which is which (what
    Fabric's DDP writes): only a caller that knows the keys can read it (``entries``, as loaded)."""

    def __init__(self, message: str, entries: Mapping[str, Any]) -> None:
        super().__init__(message)
        self.entries = entries  # the file's dict, as torch.load returned it


def as_trainer_layout(
    checkpoint: Mapping[str, Any], record: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """A file of the user's keys in the Trainer's layout (see [Note: two layouts of the full file]),
    by its own record or by ``record`` (the keys a caller knows); any other checkpoint as it is. An
    entry the record names but the file lacks stays missing (the reader's checks name it)."""
    record = record if record is not None else checkpoint.get(FABRIC_RECORD)
    if not isinstance(record, Mapping) or record.get("layout") != USER_KEYS:
        return dict(checkpoint)
    moves = {record["model"]: "state_dict"} if record["model"] in checkpoint else {}
    optimizers = [k for k in record["optimizers"] if k in checkpoint]
    schedulers = [k for k in record["lr_schedulers"] if k in checkpoint]
    moves |= {key: f"optimizer_states/{i}" for i, key in enumerate(optimizers)}
    moves |= {key: f"lr_schedulers/{j}" for j, key in enumerate(schedulers)}
    out = {k: v for k, v in checkpoint.items() if k not in moves}
    if record["model"] in checkpoint:
        out["state_dict"] = checkpoint[record["model"]]
    if optimizers:
        out["optimizer_states"] = [checkpoint[k] for k in optimizers]
    out["lr_schedulers"] = [checkpoint[k] for k in schedulers]
    out.setdefault("pytorch-lightning_version", record["lightning"])
    if isinstance(out.get(INTEGRITY_KEY), Mapping):
        out[INTEGRITY_KEY] = _moved_checksums(out[INTEGRITY_KEY], moves)
    return out


def _moved_checksums(integrity: Mapping[str, Any], moves: Mapping[str, str]) -> dict[str, Any]:
    """The checksum record with its tensor paths (``model/w``) where :func:`as_trainer_layout` put
    their tensors (``state_dict/w``)."""

    def moved(path: str) -> str:
        for key, place in moves.items():
            if path == key or path.startswith(f"{key}/"):
                return place + path[len(key) :]
        return path

    return {
        **integrity,
        "tensors": {moved(p): crc for p, crc in integrity.get("tensors", {}).items()},
        "records": [moved(p) for p in integrity.get("records", [])],
    }


def _load(path: Any, checkpoint_io: CheckpointIO, weights_only: bool | None) -> Any:
    """A local file through the default CheckpointIO is memory-mapped: each rank reads only the
    pages of what it loads (its shards), never the whole model; anything else as the IO reads it."""
    if type(checkpoint_io) is TorchCheckpointIO and isinstance(path, (str, Path)) and "://" not in str(path):
        return torch.load(str(path), map_location="cpu", weights_only=weights_only, mmap=True)
    return checkpoint_io.load_checkpoint(path, weights_only=weights_only)


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

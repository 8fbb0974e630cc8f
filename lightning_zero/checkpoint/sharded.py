"""The sharded form: this rank's slices of the model and optimizer, the DCP save, and the stand-ins
and checks of a read.

[Note: sharded layout]
Every original parameter is saved as one *logical 1D tensor* of its ``numel`` elements (its
row-major flattening), under ``model.<name>``; every per-element optimizer state as another,
under ``optim.<i>.<name>.<state>`` (``i``: the optimizer's index, ``name``: the parameter's,
``state``: e.g. ``exp_avg``). A flat space's shard [r*S, (r+1)*S) covers a contiguous range of
each parameter's flattening, so what rank r holds of a parameter is one chunk [a, b) of that 1D
tensor: a :class:`Piece`, which DCP stores as one chunk with its offset. Padding is never saved.
Step counters (0-dim tensors) are saved once per parameter (DCP writes a value that several ranks
hold once), other objects as pickled bytes; buffers and parameters kept whole (stage 0, frozen
ones) as ordinary tensors, which DCP spreads over the ranks. The file therefore describes the
model, not the layout that wrote it: a reader asks DCP for the chunks of its own layout (another
world size, stage, bucket plan or wrap policy) and DCP reads the overlapping parts of the saved
chunks. Tied parameters are saved once, under their first name (``meta.pt`` lists the aliases).
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    Metadata,
)
from torch.optim import Optimizer

from lightning_zero.checkpoint.dcp_metadata import CheckedReader, read_dcp_metadata
from lightning_zero.checkpoint.disk import (
    CheckpointWriteError,
    free_bytes,
    needed_bytes,
    room_for,
    write_failed,
)
from lightning_zero.checkpoint.files import (
    _publish,
    _remove,
    _sibling,
    _size,
    _write_synced,
    remove_stale_partials,
)
from lightning_zero.checkpoint.format import (
    DCP_METADATA_FILE,
    FORMAT,
    FORMAT_VERSION,
    LAYOUT_KEY,
    META_FILE,
    MODEL_PREFIX,
    CheckpointError,
    Piece,
    UnsafeCheckpointError,
    _box,
    _Kept,
    _LoadPlanner,
    _optimizer_prefix,
    _SavePlanner,
    load_pickled,
    refusal,
)
from lightning_zero.checkpoint.integrity import (
    files_of,
    shard_checksums,
    sharded_record,
    verify_metadata_file,
    verify_zip_records,
)
from lightning_zero.checkpoint.layout import _group_params, _named_groups, _names, _slots
from lightning_zero.comm import Communicator
from lightning_zero.zero.dtensor import local_of

# --------------------------------------------------------------------------- the sharded form: save


def sharded_model_state(module: nn.Module, engine: Any) -> dict[str, Any]:
    """This rank's part of the model, without copies: state-dict key -> Piece, tensor or object.

    Parameters are flattened (see [Note: sharded layout]); a parameter of a flat space of which
    this rank holds nothing is left out; tied parameters appear under their first name only.
    """
    names = _names(module)
    slots = _slots(module, engine)
    state: dict[str, Any] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if key in names.aliases:
            continue
        slot = slots.get(key)
        if slot is not None:
            if slot.piece is not None or slot.whole is not None:
                state[key] = slot.piece if slot.piece is not None else slot.whole.reshape(-1)
        elif isinstance(value, Tensor):
            is_param = id(value) in names.of
            state[key] = value.detach().reshape(-1) if is_param else value.detach()
        else:
            state[key] = _box(value)
    return state


def sharded_optimizer_state(
    module: nn.Module, engine: Any, optimizer: Optimizer, index: int
) -> dict[str, Any]:
    """This rank's part of an optimizer's state, by parameter name (no copies).

    ``{"state": {name: {state name: Piece | tensor | object}}, "param_groups": [...]}``, the
    groups' ``params`` given as names.
    """
    names = _names(module).of
    groups = _group_params(engine, optimizer, index)
    if any(id(p) not in names for params in groups for p in params):
        raise CheckpointError(
            f"{type(optimizer).__name__} {index} steps tensors that are not parameters of "
            f"{type(module).__name__} (after fitting, a sharded stage's optimizer keeps the shards it "
            "stepped): save checkpoints while fitting, e.g. with ModelCheckpoint"
        )
    if engine is not None and engine.sharded:
        state = _sub_shard_pieces(engine, optimizer, index, names)
    else:
        state = _whole_states(optimizer, names, groups)
    return {"state": state, "param_groups": _named_groups(optimizer, groups, names)}


def _whole_states(optimizer: Optimizer, names: dict[int, str], groups: list) -> dict[str, dict[str, Any]]:
    """Stage 0: each parameter's state as it is, per-element tensors flattened."""
    state: dict[str, dict[str, Any]] = {}
    for group, params in zip(optimizer.param_groups, groups):
        for stepped, p in zip(group["params"], params):
            for sname, value in optimizer.state.get(stepped, {}).items():
                state.setdefault(names[id(p)], {})[sname] = _whole_item(sname, value, stepped.shape)
    return state


def _whole_item(sname: str, value: Any, shape: torch.Size) -> Any:
    if not isinstance(value, Tensor):
        return _Kept(value)
    if sname != "step" and value.shape == shape:  # per-element, as flat_param's rule has it
        return value.detach().reshape(-1)
    return value.detach() if value.dim() == 0 else _Kept(value.detach())


def _sub_shard_pieces(engine: Any, optimizer: Optimizer, index: int, names: dict[int, str]) -> dict:
    """Stages 1-3: per parameter, its sub-shard's state: per-element state as a Piece of the
    parameter's flattening (left out where this rank holds none of it), scalars as they are."""
    state: dict[str, dict[str, Any]] = {}
    for flat in engine.flat_spaces():
        for i, sub in flat.optimizer_subs(index).items():
            start, stop, offset = flat.slices[i]
            for sname, value in optimizer.state.get(sub, {}).items():
                if isinstance(value, Tensor) and value.dim() > 0:
                    if start == stop:
                        continue
                    item = Piece(local_of(value).detach().reshape(-1), offset, flat.shapes[i].numel())
                else:
                    item = value.detach() if isinstance(value, Tensor) else _Kept(value)
                state.setdefault(names[id(flat.params[i])], {})[sname] = item
    return state


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


class ShardedModelState:
    """Stands in ``checkpoint["state_dict"]`` for a sharded checkpoint until the strategy reads
    this rank's part of it (:func:`load_model_state`)."""

    def __init__(
        self, path: Path, layout: dict[str, Any], metadata: Metadata, *, trusted: bool = False
    ) -> None:
        self.path = path  # the checkpoint directory
        self.layout = layout  # meta.pt's layout entry
        self.metadata = metadata  # DCP's metadata: every saved key, its size and chunks
        self.trusted = trusted  # loaded with weights_only=False: the shards' objects unpickled as saved

    def keys(self) -> set[str]:
        """The model's state-dict keys the checkpoint holds, tied parameters' other names too."""
        saved = {
            k[len(MODEL_PREFIX) :] for k in self.metadata.state_dict_metadata if k.startswith(MODEL_PREFIX)
        }
        return saved | set(self.layout["aliases"])

    def __repr__(self) -> str:
        return f"ShardedModelState({str(self.path)!r})"


class ShardedOptimizerState(ShardedModelState):
    """Stands in ``checkpoint["optimizer_states"][index]`` for a sharded checkpoint."""

    def __init__(
        self, path: Path, layout: dict[str, Any], metadata: Metadata, index: int, *, trusted: bool = False
    ) -> None:
        super().__init__(path, layout, metadata, trusted=trusted)
        self.index = index  # which optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.layout["optimizers"][self.index]

    def __repr__(self) -> str:
        return f"ShardedOptimizerState({str(self.path)!r}, optimizer={self.index})"


def inspect_sharded(
    path: Path, *, trusted: bool = False, verify: bool = True
) -> tuple[dict[str, Any], Metadata]:
    """``meta.pt``'s entries and DCP's metadata of a sharded checkpoint, after checking that every
    file it needs is there and long enough; otherwise a CheckpointError naming what is missing.
    Nothing of either file runs unless ``trusted`` (``meta.pt`` only; see [Note: what loading runs]).
    ``verify``: ``.metadata`` is checked against its recorded checksum before it is parsed."""
    for name, why in ((DCP_METADATA_FILE, "DCP's index of the shards"), (META_FILE, "rank 0's entries")):
        if not (path / name).is_file():
            raise CheckpointError(
                f"{path} is not a complete sharded checkpoint: {name} ({why}) is missing. A save that did "
                "not finish leaves no checkpoint under its final name; was this directory copied in part?"
            )
    verify_zip_records(path / META_FILE, only_pickle=False)  # small: every record's CRC
    meta = _load_meta(path / META_FILE, trusted)
    layout = meta.get(LAYOUT_KEY) if isinstance(meta, Mapping) else None
    if not isinstance(layout, Mapping) or layout.get("format") != FORMAT:
        raise CheckpointError(
            f"{path / META_FILE} has no {LAYOUT_KEY!r} layout entry: {path} was not written by "
            "ZeroStrategy(state_dict_type='sharded') (another strategy's checkpoint?)"
        )
    if layout.get("version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has layout version {layout['version']}; this lightning_zero reads up to {FORMAT_VERSION}"
        )
    if verify:
        verify_metadata_file(path, layout.get("checksums"))
    metadata = read_dcp_metadata(path)
    _check_storage(path, metadata)
    return dict(meta), metadata


def _load_meta(path: Path, trusted: bool) -> Any:
    try:
        return load_pickled(path, where=path, trusted=trusted)
    except UnsafeCheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(
            f"cannot read {path} ({_size(path)}): truncated or corrupt ({type(err).__name__}: {err})"
        ) from err


def _check_storage(path: Path, metadata: Metadata) -> None:
    """Every shard file DCP's metadata refers to exists and reaches the end of its last chunk."""
    need: dict[str, tuple[int, set[str]]] = {}
    for index, info in metadata.storage_data.items():
        end, keys = need.get(info.relative_path, (0, set()))
        keys.add(index.fqn)
        need[info.relative_path] = (max(end, info.offset + info.length), keys)
    for relative, (end, keys) in sorted(need.items()):
        file = path / relative
        held = f"it holds chunks of {len(keys)} tensors, e.g. {', '.join(sorted(keys)[:3])}"
        if not file.is_file():
            raise CheckpointError(f"{file} is missing: {path} is incomplete ({held})")
        size = file.stat().st_size
        if size < end:
            raise CheckpointError(f"{file} is truncated: {size} bytes, its chunks end at byte {end} ({held})")


def _load_items(
    comm: Communicator, dest: dict[str, Any], st: ShardedModelState, *, name: str, local: bool = False
) -> None:
    """DCP's load of ``dest`` from ``st``'s checkpoint: its reader given the metadata as checked, its
    objects unpickled through the allow-list; an object refused on any rank raised as itself on every
    rank (DCP gathers the failures into its CheckpointException)."""
    reader, planner = CheckedReader(st.path, st.metadata), _LoadPlanner(st.path, trusted=st.trusted)
    try:
        comm.load_checkpoint_items(dest, reader, planner, name=name, local=local)
    except CheckpointException as err:
        failures = [e for e, _ in err.failures.values()]
        refused = [e for e in failures if isinstance(e, UnsafeCheckpointError)]
        refused += [  # a tensor record DCP read itself, weights_only, that held an object instead
            refusal(f"{st.path} (a tensor record of one of its shard files)", e)
            for e in failures
            if isinstance(e, pickle.UnpicklingError) and "Weights only load failed" in str(e)
        ]
        if not refused:
            raise
        raise UnsafeCheckpointError(str(refused[0])) from err

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

[Note: complete or absent]
A checkpoint appears under its final name only when complete. The sharded form is written into
``.NAME.partial`` next to it; when every rank has written its shards and rank 0 ``meta.pt``, rank 0
renames the previous checkpoint (if any) to ``.NAME.previous``, ``.NAME.partial`` to ``NAME``,
and deletes ``.NAME.previous``; then all ranks pass a barrier. The full form is written to
``.NAME.partial`` and renamed over ``NAME`` (one atomic rename). A process killed during a save
leaves the previous checkpoint in place (or, in the instant between the two renames, under
``.NAME.previous``, which :func:`resolve` then loads with a warning). Reading checks what it
reads: a truncated or foreign file is an error that names the file and what is missing.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import zipfile
from bisect import bisect_left
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from torch import Tensor, nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.optim import Optimizer

from lightning_zero.comm import Communicator
from lightning_zero.streamed import Source as StreamSource
from lightning_zero.streamed import Streamed, contains_streamed, plan
from lightning_zero.streamed import write as write_streamed
from lightning_zero.zero.flat_param import FlatParameter, original_indices

log = logging.getLogger(__name__)

FORMAT = "lightning_zero.sharded"  # what meta.pt's layout entry says it is
FORMAT_VERSION = 1  # layout version this build writes and reads
META_FILE = "meta.pt"  # rank 0's part of a sharded checkpoint
DCP_METADATA_FILE = ".metadata"  # written by DCP's coordinator once every rank has written
LAYOUT_KEY = "lightning_zero"  # meta.pt entry holding the layout
MODEL_PREFIX = "model."  # DCP keys of the model's state
WEIGHTS_ONLY_DROPS = ("optimizer_states", "lr_schedulers", "callbacks")  # what --weights-only leaves out


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read as asked; the message names the file and what is wrong."""


# --------------------------------------------------------------------------- pieces and DCP planners


class Piece:
    """Elements [offset, offset + len(local)) of a logical 1D tensor of ``numel`` elements.

    What this rank holds of one parameter (or of one per-element optimizer state) inside its
    shard; ``local`` is a view into the shard, read for a save and written in place by a load.
    """

    __slots__ = ("local", "offset", "numel")

    def __init__(self, local: Tensor, offset: int, numel: int) -> None:
        self.local = local  # 1D view into this rank's storage
        self.offset = offset  # where ``local`` starts in the logical tensor
        self.numel = numel  # elements of the whole logical tensor

    def size(self) -> torch.Size:
        """The logical tensor's size (DCP compares it with the saved one)."""
        return torch.Size([self.numel])

    def _chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size([self.offset]), sizes=self.local.size())

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        data = TensorWriteData(
            chunk=self._chunk(), properties=TensorProperties.create_from_tensor(self.local), size=self.size()
        )
        index = MetadataIndex(fqn, torch.Size([self.offset]))
        return [WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=data)]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk()]

    def __repr__(self) -> str:
        return f"Piece([{self.offset}, {self.offset + self.local.numel()}) of {self.numel})"


class _SavePlanner(DefaultSavePlanner):
    """DCP's default save planner; a :class:`Piece` gives its own write item and its ``local`` data."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict.get(index.fqn)
        return obj.local.detach() if isinstance(obj, Piece) else super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner on a flat dict of tensors, :class:`Piece` and ``None`` (objects).

    Its own ``set_up_planner`` keeps the values as given (the default one turns objects it does
    not know, such as a Piece, into None); reads land in place in the tensors and Pieces.
    """

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(
        self, state_dict: dict, metadata: Metadata | None = None, is_coordinator: bool = False
    ):
        self.original_state_dict = self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        obj = self.state_dict.get(index.fqn)
        return obj.local.detach() if isinstance(obj, Piece) else super().lookup_tensor(index)


def _destination(md: Any, *, dtype: torch.dtype | None = None, device: Any = "cpu") -> Tensor | None:
    """An empty tensor to read a saved tensor into (``None`` for a pickled object)."""
    if isinstance(md, BytesStorageMetadata):
        return None
    return torch.empty(md.size, dtype=dtype or md.properties.dtype, device=device)


def _optimizer_prefix(index: int) -> str:
    return f"optim.{index}."


# --------------------------------------------------------------------------- names and layout


class _Names(NamedTuple):
    of: dict[int, str]  # id(param) -> its first name (registration order), the saved one
    aliases: dict[str, str]  # another name of a tied parameter -> its first name


def _names(module: nn.Module) -> _Names:
    of: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in of:
            aliases[name] = of[id(p)]
        else:
            of[id(p)] = name
    return _Names(of, aliases)


class _Overlap(NamedTuple):
    """The part of one parameter of a flat space that lies in this rank's shard."""

    param: nn.Parameter
    position: int  # the parameter's position in its flat space
    numel: int  # elements of the whole parameter
    start: int  # first element inside the shard (1D, shard_numel)
    stop: int  # one past the last
    offset: int  # the first element's index in the parameter's flattening


def _overlaps(flat: FlatParameter) -> list[_Overlap]:
    """This rank's part of every parameter of ``flat`` (empty parts left out)."""
    return [
        _Overlap(p, i, shape.numel(), start, stop, offset)
        for i, (p, shape, (start, stop, offset)) in enumerate(zip(flat.params, flat.shapes, flat.slices))
        if start < stop
    ]


def _spaces(engine: Any) -> list[FlatParameter]:
    """The flat spaces holding parameter values (frozen ones too, at stage 3)."""
    return engine.param_spaces() if engine is not None else []


class _Slot(NamedTuple):
    """Where a parameter's value lives on this rank when it is not simply the module's parameter."""

    shape: torch.Size  # the parameter's shape
    piece: Piece | None  # flat space: the part in this rank's shard (None: no part here)
    whole: Tensor | None  # kept whole but stepped as another tensor (an fp32 master)


def _slots(module: nn.Module, engine: Any) -> dict[str, _Slot]:
    """name -> slot for the parameters in flat spaces or with a whole master (first names only)."""
    names = _names(module).of
    slots: dict[str, _Slot] = {}
    for flat in _spaces(engine):
        parts = {id(o.param): o for o in _overlaps(flat)}
        for p, shape in zip(flat.params, flat.shapes):
            o = parts.get(id(p))
            piece = Piece(flat.shard.detach()[o.start : o.stop], o.offset, o.numel) if o else None
            slots[names[id(p)]] = _Slot(shape, piece, None)
    if engine is not None:
        for pid, master in engine.whole_values().items():
            slots[names[pid]] = _Slot(master.shape, None, master.detach())
    return slots


def layout_of(module: nn.Module, engine: Any, stage: int, world_size: int) -> dict[str, Any]:
    """What meta.pt records besides Lightning's entries: parameter shapes, aliases, key order."""
    names = _names(module)
    slots = _slots(module, engine)
    shapes = {
        name: list(slots[name].shape if name in slots else p.shape) for name, p in module.named_parameters()
    }
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "stage": stage,  # of the run that wrote it (informative: any stage reads it)
        "world_size": world_size,  # likewise
        "keys": list(module.state_dict(keep_vars=True).keys()),  # the model's state-dict keys, in order
        "shapes": shapes,  # parameter (first name) -> shape; saved flattened
        "aliases": names.aliases,  # tied parameters' other names -> first name
        "optimizers": None,  # per optimizer: param groups, parameters by name (set by save_sharded)
    }


class _Kept:
    """A value saved whole as pickled bytes: an object, or a tensor state that is neither
    per-element nor a scalar (stage 0 only). Boxed so that DCP does not walk into it."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _box(value: Any) -> Any:
    return value if isinstance(value, (Tensor, Piece)) else _Kept(value)


def _unbox(value: Any) -> Any:
    return value.value if isinstance(value, _Kept) else value


def _is_per_element(md: Any) -> bool:
    """Per-element state and parameters are saved 1D; scalars 0-dim; anything else as bytes."""
    return isinstance(md, TensorStorageMetadata) and len(md.size) == 1


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


def _group_params(engine: Any, optimizer: Optimizer, index: int) -> list[list[nn.Parameter]]:
    if engine is None:
        return [list(g["params"]) for g in optimizer.param_groups]
    return engine.group_params(optimizer, index)


def _named_groups(optimizer: Optimizer, groups: list, names: dict[int, str]) -> list[dict[str, Any]]:
    return [
        {**_hyper(group), "params": [names[id(p)] for p in params]}
        for group, params in zip(optimizer.param_groups, groups)
    ]


def _hyper(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


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
                    item = Piece(value.detach(), offset, flat.shapes[i].numel())
                else:
                    item = value.detach() if isinstance(value, Tensor) else _Kept(value)
                state.setdefault(names[id(flat.params[i])], {})[sname] = item
    return state


def save_sharded(checkpoint: dict[str, Any], path: Path, comm: Communicator, layout: dict[str, Any]) -> None:
    """Write a sharded checkpoint directory at ``path`` (every rank calls it; see [Note: complete
    or absent]). ``checkpoint`` is Lightning's dict with this rank's model and optimizer parts
    (:func:`sharded_model_state`, :func:`sharded_optimizer_state`)."""
    items = {MODEL_PREFIX + k: v for k, v in checkpoint.pop("state_dict").items()}
    optimizers = checkpoint.pop("optimizer_states", None)
    for i, opt in enumerate(optimizers or []):
        for name, entry in opt["state"].items():
            for sname, value in entry.items():
                items[f"{_optimizer_prefix(i)}{name}.{sname}"] = value
    layout = {**layout, "optimizers": None if optimizers is None else [o["param_groups"] for o in optimizers]}
    partial = _sibling(path, "partial")
    if comm.rank == 0:
        _remove(partial)
        partial.mkdir(parents=True)
    comm.barrier(name="checkpoint/barrier/partial")
    comm.save_checkpoint_items(
        items, FileSystemWriter(partial), _SavePlanner(), name="checkpoint/save/shards"
    )
    if comm.rank == 0:
        _write_synced({**checkpoint, LAYOUT_KEY: layout}, partial / META_FILE)
        _publish(partial, path)
    comm.barrier(name="checkpoint/barrier/published")


def _write_synced(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


# --------------------------------------------------------------------------- the full form: save


def save_full(
    checkpoint: dict[str, Any],
    path: str,
    comm: Communicator,
    checkpoint_io: CheckpointIO,
    storage_options: Any = None,
    engine: Any = None,
) -> None:
    """Rank 0 writes ``checkpoint`` as one file; every rank calls it.

    With the default TorchCheckpointIO and a local path, rank 0 writes ``.NAME.partial`` and
    renames it into place (TorchCheckpointIO itself would first serialize the whole file into
    memory, doubling rank 0's peak); tensors that live in shards (:class:`Streamed` stand-ins, see
    [Note: streamed full checkpoints]) are gathered one flat space at a time while it writes. Any
    other CheckpointIO gets the whole dict, the stand-ins gathered into rank 0's memory first.
    """
    local = type(checkpoint_io) is TorchCheckpointIO and storage_options is None and "://" not in str(path)
    streamed = engine is not None and contains_streamed(checkpoint)
    items = (
        comm.broadcast_object(plan(checkpoint), name="checkpoint/plan", device=_device(engine))
        if streamed
        else []
    )
    gather = functools.partial(_gather_space, engine, comm) if streamed else None
    if not local:
        if streamed:
            checkpoint = _materialize(checkpoint, engine, comm, gather, items)
        if comm.rank == 0:
            checkpoint_io.save_checkpoint(checkpoint, path, storage_options=storage_options)
    else:
        partial = _sibling(Path(path), "partial")
        if comm.rank == 0:
            partial.parent.mkdir(parents=True, exist_ok=True)
            _remove(partial)
        if streamed:
            write_streamed(checkpoint, partial, comm, engine.param_spaces(), gather, items)
            if comm.rank == 0:
                _fsync(partial)
        elif comm.rank == 0:
            _write_synced(checkpoint, partial)
        if comm.rank == 0:
            _publish(partial, Path(path))
    comm.barrier(name="checkpoint/barrier/published")


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
    for s, space in enumerate(engine.param_spaces()):
        for i, (p, shape) in enumerate(zip(space.params, space.shapes)):
            stand_ins[id(p)] = Streamed(StreamSource(s, i, None), shape, space.shard.dtype)
    state = module.state_dict(keep_vars=True)
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in stand_ins:
            state[name] = stand_ins[id(p)]
    return {k: v.detach() if isinstance(v, Tensor) else v for k, v in state.items()}


def streamed_optimizer_state(engine: Any, optimizer: Optimizer, index: int) -> dict[str, Any]:
    """Stages 1-3: the optimizer's state as one process has it, per-element states as stand-ins
    gathered while the file is written; step counts and other scalars as they are."""
    groups = engine.group_params(optimizer, index)
    ids = original_indices(groups)
    state: dict[int, dict[str, Any]] = {}
    for s, space in enumerate(engine.param_spaces()):
        for i, sub in space.optimizer_subs(index).items():
            entry = state.setdefault(ids[id(space.params[i])], {})
            for sname, value in optimizer.state.get(sub, {}).items():
                if isinstance(value, Tensor) and value.dim() > 0 and sname != "step":
                    entry[sname] = Streamed(StreamSource(s, i, (index, sname)), space.shapes[i], value.dtype)
                else:
                    entry[sname] = value.to("cpu", copy=True) if isinstance(value, Tensor) else value
    param_groups = [
        {**_hyper(g), "params": [ids[id(p)] for p in ps]} for g, ps in zip(optimizer.param_groups, groups)
    ]
    return {"state": dict(sorted((k, v) for k, v in state.items() if v)), "param_groups": param_groups}


def _gather_space(engine: Any, comm: Communicator, space: int, what: tuple[int, str] | None) -> Tensor | None:
    """The full padded values of one flat space (its parameters, or one per-element state of one
    optimizer), on rank 0 only; every rank calls it."""
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
                chunk[flat.slices[i].start : flat.slices[i].stop].copy_(value)
    full = torch.empty(flat.padded_numel, dtype=chunk.dtype, device=chunk.device) if comm.rank == 0 else None
    comm.gather(full, chunk, dst=0, name=f"{engine.label}/gather/checkpoint")
    return full


def _materialize(checkpoint: Any, engine: Any, comm: Communicator, gather: Any, items: list) -> Any:
    """The stand-ins replaced by their values in rank 0's memory (another CheckpointIO writes it)."""
    values: dict[Any, Tensor] = {}
    spaces = engine.param_spaces()
    for space, what in items:
        full = gather(space, what)
        if full is None:
            continue
        for i, (shape, offset) in enumerate(zip(spaces[space].shapes, spaces[space].offsets)):
            values[(space, i, what)] = full[offset : offset + shape.numel()].view(shape).to("cpu", copy=True)

    def resolve(obj: Any) -> Any:
        if isinstance(obj, Streamed):
            return values.get((obj.source.space, obj.source.position, obj.source.state))
        if isinstance(obj, dict):
            return {k: resolve(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(resolve(v) for v in obj)
        return obj

    return resolve(checkpoint) if comm.rank == 0 else {}


# --------------------------------------------------------------------------- files in place


def _sibling(path: Path, tag: str) -> Path:
    """``.NAME.partial`` / ``.NAME.previous`` next to ``path`` (hidden; not ``*.ckpt``)."""
    return path.parent / f".{path.name}.{tag}"


def _exists(path: Path) -> bool:
    return path.exists() or path.is_symlink()


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def _publish(partial: Path, path: Path) -> None:
    """Put the finished ``partial`` at ``path`` (see [Note: complete or absent])."""
    if partial.is_file() and (not _exists(path) or (path.is_file() and not path.is_symlink())):
        os.replace(partial, path)  # a file over a file: one atomic rename
        return
    previous = _sibling(path, "previous")
    _remove(previous)
    if _exists(path):
        os.rename(path, previous)
    os.rename(partial, path)
    _remove(previous)


def remove(path: str | Path, checkpoint_io: CheckpointIO) -> None:
    """Delete a checkpoint (file or directory) and what an interrupted save left beside it."""
    if "://" in str(path):
        checkpoint_io.remove_checkpoint(path)
        return
    path = Path(path)
    for p in (path, _sibling(path, "partial"), _sibling(path, "previous")):
        _remove(p)


# --------------------------------------------------------------------------- reading


class ShardedModelState:
    """Stands in ``checkpoint["state_dict"]`` for a sharded checkpoint until the strategy reads
    this rank's part of it (:func:`load_model_state`)."""

    def __init__(self, path: Path, layout: dict[str, Any], metadata: Metadata) -> None:
        self.path = path  # the checkpoint directory
        self.layout = layout  # meta.pt's layout entry
        self.metadata = metadata  # DCP's metadata: every saved key, its size and chunks

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

    def __init__(self, path: Path, layout: dict[str, Any], metadata: Metadata, index: int) -> None:
        super().__init__(path, layout, metadata)
        self.index = index  # which optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.layout["optimizers"][self.index]

    def __repr__(self) -> str:
        return f"ShardedOptimizerState({str(self.path)!r}, optimizer={self.index})"


def resolve(path: str | Path) -> Path:
    """The checkpoint at ``path``, or the previous one if a save stopped between its renames."""
    p = Path(path)
    if _exists(p):
        return p
    previous = _sibling(p, "previous")
    if _exists(previous):
        log.warning(f"{p} is missing but {previous} is complete (a save stopped while renaming): loading it")
        return previous
    raise FileNotFoundError(f"no checkpoint at {p}")


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
    if not isinstance(checkpoint, Mapping) or "state_dict" not in checkpoint:
        found = (
            sorted(map(str, checkpoint))[:8] if isinstance(checkpoint, Mapping) else type(checkpoint).__name__
        )
        raise CheckpointError(
            f"{path} is not a Lightning checkpoint: it has no 'state_dict' entry (found: {found}). A bare "
            "model state dict loads with module.load_state_dict(torch.load(...)), not through the Trainer"
        )
    return checkpoint


def _load(path: Any, checkpoint_io: CheckpointIO, weights_only: bool | None) -> Any:
    """A local file through the default CheckpointIO is memory-mapped: each rank reads only the
    pages of what it loads (its shards), never the whole model; anything else as the IO reads it."""
    if type(checkpoint_io) is TorchCheckpointIO and isinstance(path, (str, Path)) and "://" not in str(path):
        return torch.load(str(path), map_location="cpu", weights_only=weights_only, mmap=True)
    return checkpoint_io.load_checkpoint(path, weights_only=weights_only)


def _size(path: Any) -> str:
    try:
        return f"{os.path.getsize(path)} bytes"
    except OSError:
        return "size unknown"


def inspect_sharded(path: Path) -> tuple[dict[str, Any], Metadata]:
    """``meta.pt``'s entries and DCP's metadata of a sharded checkpoint, after checking that every
    file it needs is there and long enough; otherwise a CheckpointError naming what is missing."""
    for name, why in ((DCP_METADATA_FILE, "DCP's index of the shards"), (META_FILE, "rank 0's entries")):
        if not (path / name).is_file():
            raise CheckpointError(
                f"{path} is not a complete sharded checkpoint: {name} ({why}) is missing. A save that did "
                "not finish leaves no checkpoint under its final name; was this directory copied in part?"
            )
    meta = _load_meta(path / META_FILE)
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
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as err:
        raise CheckpointError(f"cannot read {path / DCP_METADATA_FILE}: {type(err).__name__}: {err}") from err
    _check_storage(path, metadata)
    return dict(meta), metadata


def _load_meta(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
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


def _reader(path: Path) -> FileSystemReader:
    return FileSystemReader(str(path))


# --------------------------------------------------------------------------- loading the model


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


def _check_keys(module: nn.Module, given: set[str], strict: bool, source: Any) -> None:
    expected = set(module.state_dict(keep_vars=True))
    missing, unexpected = sorted(expected - given), sorted(given - expected)
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"the checkpoint {source} does not match {type(module).__name__}: "
            f"missing {len(missing)} key(s) {missing[:8]}, unexpected {len(unexpected)} key(s) {unexpected[:8]}. "
            "Set LightningModule.strict_loading = False to load only the keys both have"
        )


def _check_shape(key: str, saved: Any, here: Any, source: Any) -> None:
    if tuple(saved) != tuple(here):
        raise CheckpointError(
            f"{source}: {key} has shape {tuple(saved)} in the checkpoint, {tuple(here)} here"
        )


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


def _load_sharded_model(
    module: nn.Module, engine: Any, comm: Communicator, st: ShardedModelState, strict: bool
) -> None:
    """Each rank reads the chunks its slots cover, in place; the rest into fresh tensors."""
    _check_keys(module, st.keys(), strict, source=st.path)
    names = _names(module)
    slots = _slots(module, engine)
    dest: dict[str, Any] = {}  # DCP key -> where to read it
    rest: dict[str, tuple[str, Any]] = {}  # state-dict key -> (DCP key, current value)
    saved = st.keys()
    for key, value in module.state_dict(keep_vars=True).items():
        if key in names.aliases or key not in saved:
            continue
        first = st.layout["aliases"].get(key, key)
        fqn = MODEL_PREFIX + first
        slot = slots.get(key)
        if first in st.layout["shapes"]:
            _check_shape(key, st.layout["shapes"][first], slot.shape if slot else value.shape, st.path)
        if slot is None:
            md = st.metadata.state_dict_metadata[fqn]
            dest[fqn] = _destination(md, dtype=value.dtype if isinstance(value, Tensor) else None)
            rest[key] = (fqn, value)
        elif slot.piece is not None:
            dest[fqn] = slot.piece
        elif slot.whole is not None:
            dest[fqn] = slot.whole.view(-1)
    comm.load_checkpoint_items(dest, _reader(st.path), _LoadPlanner(), name="checkpoint/load/model")
    values = {}
    for key, (fqn, value) in rest.items():
        loaded = _unbox(dest[fqn])
        values[key] = loaded.view(value.shape) if isinstance(value, Tensor) else loaded
    module.load_state_dict(values, strict=False)


# --------------------------------------------------------------------------- loading optimizers


def load_sharded_optimizer(
    module: nn.Module, engine: Any, comm: Communicator, optimizer: Optimizer, st: ShardedOptimizerState
) -> None:
    """Load optimizer ``st.index`` of a sharded checkpoint into ``optimizer`` as set up now:
    stages 1-3 read their sub-shards' slices, stage 0 whole tensors. Every rank calls it."""
    names = _names(module).of
    groups = _group_params(engine, optimizer, st.index)
    _check_groups(st, groups, names)
    index = _state_index(st.metadata, st.index, [names[id(p)] for params in groups for p in params])
    if engine is not None and engine.sharded:
        _load_sub_shards(engine, comm, optimizer, st, index, names)
        for group, saved in zip(optimizer.param_groups, st.param_groups):
            group.update(_hyper(saved))
        return
    named = _read_named_state(comm, st.path, st.layout, st.metadata, index, local=False)
    ids = original_indices(groups)
    state = {ids[id(p)]: named[names[id(p)]] for params in groups for p in params if names[id(p)] in named}
    param_groups = [
        {**_hyper(saved), "params": [ids[id(p)] for p in params]}
        for saved, params in zip(st.param_groups, groups)
    ]
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})


def _check_groups(st: ShardedOptimizerState, groups: list, names: dict[int, str]) -> None:
    where = f"{st.path} (optimizer {st.index})"
    if len(st.param_groups) != len(groups):
        raise CheckpointError(
            f"{where} has {len(st.param_groups)} param groups, the optimizer here {len(groups)}"
        )
    for g, (saved, params) in enumerate(zip(st.param_groups, groups)):
        here, there = {names[id(p)] for p in params}, set(saved["params"])
        if here != there:
            raise CheckpointError(
                f"{where}, param group {g} holds other parameters than the optimizer here: only in the "
                f"checkpoint {sorted(there - here)[:5]}, only here {sorted(here - there)[:5]}"
            )


def _state_index(metadata: Metadata, index: int, names: list[str]) -> dict[str, dict[str, str]]:
    """name -> {state name -> DCP key} for optimizer ``index`` (keys ``optim.<i>.<name>.<state>``).

    A parameter's name never continues with ``.`` into another parameter's name (a module cannot
    hold a parameter and a submodule of one name), so the prefix ``optim.<i>.<name>.`` is its own.
    """
    keys = sorted(k for k in metadata.state_dict_metadata if k.startswith(_optimizer_prefix(index)))
    out: dict[str, dict[str, str]] = {}
    for name in names:
        prefix = f"{_optimizer_prefix(index)}{name}."
        i = bisect_left(keys, prefix)
        while i < len(keys) and keys[i].startswith(prefix):
            out.setdefault(name, {})[keys[i][len(prefix) :]] = keys[i]
            i += 1
    return out


def _read_named_state(
    comm: Communicator, path: Path, layout: dict, metadata: Metadata, index: dict, *, local: bool
) -> dict[str, dict[str, Any]]:
    """Whole states by parameter name, per-element ones in the parameter's shape (CPU)."""
    mds = metadata.state_dict_metadata
    dest = {fqn: _destination(mds[fqn]) for entries in index.values() for fqn in entries.values()}
    comm.load_checkpoint_items(
        dest, _reader(path), _LoadPlanner(), name="checkpoint/load/optimizer", local=local
    )
    out: dict[str, dict[str, Any]] = {}
    for name, entries in index.items():
        shape = layout["shapes"][name]
        out[name] = {
            sname: dest[fqn].view(shape) if _is_per_element(mds[fqn]) else _unbox(dest[fqn])
            for sname, fqn in entries.items()
        }
    return out


def _load_sub_shards(
    engine: Any, comm: Communicator, optimizer: Optimizer, st: ShardedOptimizerState, index: dict, names: dict
) -> None:
    dest: dict[str, Any] = {}
    builders = []
    for flat in engine.flat_spaces():
        for i, sub in flat.optimizer_subs(st.index).items():
            entries = index.get(names[id(flat.params[i])], {})
            if entries:
                builders.append((sub, _plan_sub_shard(flat, i, sub, entries, st.metadata, dest)))
    comm.load_checkpoint_items(
        dest, _reader(st.path), _LoadPlanner(), name=f"checkpoint/load/optimizer={st.index}"
    )
    for sub, build in builders:
        optimizer.state[sub] = build()


def _plan_sub_shard(flat, i, sub, entries, metadata, dest) -> Callable[[], dict]:
    """Register what one sub-shard reads into ``dest``; return what assembles its state after.

    Per-element states: a buffer shaped like the sub-shard, read from its slice of the parameter's
    flattening. Scalars (step): read whole; empty sub-shards get them too, as the optimizer gave them.
    """
    start, stop, offset = flat.slices[i]
    mds = metadata.state_dict_metadata
    per_element: dict[str, Tensor] = {}
    scalars: dict[str, str] = {}
    for sname, fqn in entries.items():
        md = mds[fqn]
        if not _is_per_element(md):
            dest.setdefault(fqn, _destination(md))
            scalars[sname] = fqn
            continue
        dtype = sub.dtype if md.properties.dtype.is_floating_point else md.properties.dtype
        buf = torch.zeros(stop - start, dtype=dtype, device=sub.device)
        if stop > start:
            dest[fqn] = Piece(buf, offset, flat.shapes[i].numel())
        per_element[sname] = buf

    def build() -> dict[str, Any]:
        state: dict[str, Any] = dict(per_element)
        for sname, fqn in scalars.items():
            value = _unbox(dest[fqn])
            if isinstance(value, Tensor) and value.dim() > 0:
                raise CheckpointError(
                    f"optimizer state {fqn} is a tensor of shape {tuple(value.shape)}, neither per-element nor "
                    "a scalar: a sharded stage cannot split it. Resume with stage 0 (strategy='zero0')"
                )
            state[sname] = value.clone() if isinstance(value, Tensor) else value
        return state

    return build


# --------------------------------------------------------------------------- consolidation


class Consolidated(NamedTuple):
    path: Path  # the file written
    tensors: int  # model tensors in its state_dict
    optimizers: int  # optimizer states included (0 with weights_only)
    nbytes: int  # bytes of the file


def consolidate(source: str | Path, out: str | Path, *, weights_only: bool = False) -> Consolidated:
    """Turn a sharded checkpoint into one plain Lightning checkpoint file, in this process alone
    (no process group, CPU). ``LightningModule.load_from_checkpoint(out)`` loads it; with
    ``weights_only`` it holds no optimizer, LR-scheduler or callback state."""
    src = resolve(source)
    if not src.is_dir():
        raise CheckpointError(
            f"{src} is a file, not a sharded checkpoint directory: a full checkpoint loads as it is"
        )
    meta, metadata = inspect_sharded(src)
    layout = meta.pop(LAYOUT_KEY)
    comm = Communicator()
    checkpoint = dict(meta)
    checkpoint["state_dict"] = _read_full_model(comm, src, layout, metadata)
    optimizers = layout["optimizers"] if not weights_only else None
    if weights_only:
        for key in WEIGHTS_ONLY_DROPS:
            checkpoint.pop(key, None)
    elif optimizers is not None:
        checkpoint["optimizer_states"] = [
            _read_full_optimizer(comm, src, layout, metadata, i) for i in range(len(optimizers))
        ]
    target = Path(out)
    partial = _sibling(target, "partial")
    torch.save(checkpoint, partial)
    os.replace(partial, target)
    return Consolidated(target, len(checkpoint["state_dict"]), len(optimizers or []), target.stat().st_size)


def _read_full_model(comm: Communicator, path: Path, layout: dict, metadata: Metadata) -> dict[str, Any]:
    mds = metadata.state_dict_metadata
    dest = {fqn: _destination(md) for fqn, md in mds.items() if fqn.startswith(MODEL_PREFIX)}
    comm.load_checkpoint_items(dest, _reader(path), _LoadPlanner(), name="checkpoint/read/model", local=True)
    values: dict[str, Any] = {}
    for name in {layout["aliases"].get(k, k) for k in layout["keys"]}:
        value = _unbox(dest[MODEL_PREFIX + name])
        values[name] = value.view(layout["shapes"][name]) if name in layout["shapes"] else value
    return {key: values[layout["aliases"].get(key, key)] for key in layout["keys"]}


def _read_full_optimizer(comm: Communicator, path: Path, layout: dict, metadata: Metadata, i: int) -> dict:
    """Optimizer ``i`` as ``optimizer.state_dict()`` of one process: numbered in group order."""
    groups = layout["optimizers"][i]
    order = list(dict.fromkeys(n for g in groups for n in g["params"]))
    ids = {name: j for j, name in enumerate(order)}
    named = _read_named_state(comm, path, layout, metadata, _state_index(metadata, i, order), local=True)
    return {
        "state": {ids[n]: named[n] for n in order if n in named},
        "param_groups": [{**_hyper(g), "params": [ids[n] for n in g["params"]]} for g in groups],
    }

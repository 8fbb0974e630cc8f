"""Laying a checkpoint out (the reader's last step, and the writer's first): who holds what
(parameter names, tied ones; the parts of flat spaces in this rank's shard), the layout ``meta.pt``
records, where a saved entry is read into and the checks of keys and shapes a load makes; the
stand-ins a sharded read hands out; the Trainer's keys a full file is read into.

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

[Note: two layouts of the full file]
The Trainer's strategy writes the Trainer's layout: ``state_dict``, ``optimizer_states`` (a list),
``lr_schedulers``, ``pytorch-lightning_version``, loops, callbacks. Fabric's strategy writes what
Fabric's DDP writes: the user's own keys (``{"model": <the model's state dict>, "optimizer":
<optimizer.state_dict() of one process>, "iter_num": 3}``), plus :data:`FABRIC_RECORD`, which names
the keys of the model, the optimizers and the LR schedulers (``"layout": "user keys"``) and the
Lightning version. Every reader of this package takes the Trainer's layout:
:func:`in_trainer_layout` maps a file of the user's keys onto it (:func:`as_trainer_layout`,
checksum paths included), so the Trainer resumes a Fabric file and Fabric loads either. Fabric
files written before this layout hold the Trainer's layout with the record (without
``"layout"``) and read as they are. A file of user keys without the record (Fabric's DDP wrote
it) is a :class:`UserKeyedCheckpoint` that carries its entries: Fabric's strategy reads it with
the keys of the state it is asked to load.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
from torch.optim import Optimizer

from lightning_zero.checkpoint.format import (
    FABRIC_RECORD,
    FORMAT,
    FORMAT_VERSION,
    INTEGRITY_KEY,
    LAYOUT_KEY,
    META_FILE,
    MODEL_PREFIX,
    USER_KEYS,
    CheckpointError,
    Piece,
    _hyper,
)
from lightning_zero.zero.flat_param import FlatParameter

# --------------------------------------------------------------------------- names and slots


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


def _group_params(engine: Any, optimizer: Optimizer, index: int) -> list[list[nn.Parameter]]:
    if engine is None:
        return [list(g["params"]) for g in optimizer.param_groups]
    return engine.group_params(optimizer, index)


def _named_groups(optimizer: Optimizer, groups: list, names: dict[int, str]) -> list[dict[str, Any]]:
    return [
        {**_hyper(group), "params": [names[id(p)] for p in params]}
        for group, params in zip(optimizer.param_groups, groups)
    ]


# --------------------------------------------------------------------------- checks and destinations


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


def _destination(md: Any, *, dtype: torch.dtype | None = None, device: Any = "cpu") -> Tensor | None:
    """An empty tensor to read a saved tensor into (``None`` for a pickled object)."""
    if isinstance(md, BytesStorageMetadata):
        return None
    return torch.empty(md.size, dtype=dtype or md.properties.dtype, device=device)


# --------------------------------------------------------------------------- a sharded read's stand-ins


def _saved_layout(meta: Any, path: Path) -> Mapping[str, Any]:
    """``meta.pt``'s layout entry (``meta``: what it holds), written by this package in a version it
    reads; otherwise a CheckpointError saying what ``path`` is not."""
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
    return layout


class ShardedModelState:
    """Stands in ``checkpoint["state_dict"]`` for a sharded checkpoint until the strategy reads
    this rank's part of it (:func:`~lightning_zero.checkpoint.load.load_model_state`)."""

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


def with_stand_ins(meta: dict[str, Any], path: Path, metadata: Metadata, *, trusted: bool) -> dict[str, Any]:
    """``meta.pt``'s entries (``meta``) without its layout entry, and in the model's and the optimizers'
    places their stand-ins, which each rank reads later, its own part (``load.py``)."""
    layout = meta.pop(LAYOUT_KEY)
    meta["state_dict"] = ShardedModelState(path, layout, metadata, trusted=trusted)
    if layout["optimizers"] is not None:
        meta["optimizer_states"] = [
            ShardedOptimizerState(path, layout, metadata, i, trusted=trusted)
            for i in range(len(layout["optimizers"]))
        ]
    return meta


# --------------------------------------------------------------------------- the Trainer's keys


def in_trainer_layout(checkpoint: Any, path: Any) -> dict[str, Any]:
    """What the full file ``path`` holds (``checkpoint``), in the Trainer's layout (see [Note: two
    layouts of the full file]); anything that is not a Lightning checkpoint is a CheckpointError
    saying what it holds: a :class:`UserKeyedCheckpoint` with its entries when it is a dict."""
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

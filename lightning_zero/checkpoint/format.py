"""The sharded form's format: names and constants, CheckpointError, the :class:`Piece` DCP saves and loads
in place, the planners that resolve it, and what unpickling a checkpoint may run.

[Note: what loading runs]
Unpickling calls whatever the pickle names: a file that names ``builtins.exec`` runs code when it
is loaded. So nothing a checkpoint holds is unpickled unless every global it names is on an
allow-list of constructors of plain values:

- a full file, ``meta.pt``, and the objects a shard holds as pickled bytes (:class:`_Kept`):
  ``torch.load(weights_only=True)`` (containers, numbers, strings, tensors, dtypes, and the
  ``_Kept`` box for shards), by :func:`load_pickled`;
- DCP's ``.metadata``, which DCP itself reads with a plain ``pickle.load``: read first by our own
  unpickler with an allow-list of the classes DCP's metadata is made of
  (``dcp_metadata.py``), and DCP handed that object instead of reading the file;
- tensor chunks in shards: DCP loads them with ``weights_only=True`` itself.

A global off the list is an :class:`UnsafeCheckpointError` that names the file and the global,
raised before anything of the file is used. A caller who trusts a file says so with
``weights_only=False`` (Lightning's and torch's own switch): then a full file, ``meta.pt`` and the
shards' objects load as saved, which runs the code they name. ``.metadata`` is always read through
the allow-list (nothing legitimate needs more).
"""

from __future__ import annotations

import io
import pickle
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO, Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem, TensorWriteData, WriteItem, WriteItemType

FORMAT = "lightning_zero.sharded"  # what meta.pt's layout entry says it is
FORMAT_VERSION = 1  # layout version this build writes and reads
META_FILE = "meta.pt"  # rank 0's part of a sharded checkpoint
DCP_METADATA_FILE = ".metadata"  # written by DCP's coordinator once every rank has written
LAYOUT_KEY = "lightning_zero"  # meta.pt entry holding the layout
MODEL_PREFIX = "model."  # DCP keys of the model's state
WEIGHTS_ONLY_DROPS = ("optimizer_states", "lr_schedulers", "callbacks")  # what --weights-only leaves out


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read as asked; the message names the file and what is wrong."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint that holds an object whose unpickling would run code off the allow-list
    ([Note: what loading runs]); the message names the file and the global. Not a damaged file:
    loading does not fall back to another checkpoint."""


TRUST_HINT = (
    "If the file comes from a source you trust, load it with weights_only=False (trainer.fit(..., "
    "weights_only=False), fabric.load(..., weights_only=False), lightning-zero consolidate --trusted); "
    "otherwise delete it"
)


def load_pickled(
    source: str | Path | IO[bytes], *, where: Any, trusted: bool = False, allowed: Iterable[type] = ()
) -> Any:
    """``torch.load`` of a checkpoint file or record onto the CPU, ``weights_only`` unless
    ``trusted``, with ``allowed`` classes added to torch's allow-list for this load only; a refused
    global is an :class:`UnsafeCheckpointError` naming ``where`` (see [Note: what loading runs])."""
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(source, map_location="cpu", weights_only=not trusted)
    except pickle.UnpicklingError as err:
        if not trusted and "Weights only load failed" in str(err):
            raise refusal(where, err) from err
        raise


def refusal(where: Any, err: BaseException) -> UnsafeCheckpointError:
    """The refusal of torch's ``weights_only`` unpickler, as an error that names the file and global."""
    found = re.search(r"GLOBAL ([\w.]+)", str(err))
    name = found.group(1) if found else None
    what = f"the global {name if '.' in name else 'builtins.' + name}" if name else _reason(str(err))
    return UnsafeCheckpointError(
        f"{where} holds an object that unpickling would have to run code to build ({what}; only "
        f"plain containers, numbers, strings and tensors are allowed). Nothing of it was run. {TRUST_HINT}"
    )


def _reason(message: str) -> str:
    found = re.search(r"WeightsUnpickler error: ([^\n]*)", message)
    return found.group(1).strip() if found else message.splitlines()[0]


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
    not know, such as a Piece, into None); reads land in place in the tensors and Pieces. Objects
    saved as pickled bytes load through the allow-list ([Note: what loading runs]).

    Args:
        directory: the checkpoint directory (named in a refusal, with the shard file).
        trusted: the caller loads with ``weights_only=False``: objects load as saved.
    """

    def __init__(self, directory: Path, *, trusted: bool = False) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.directory = directory  # the checkpoint directory, for messages
        self.trusted = trusted  # objects unpickled without the allow-list

    def set_up_planner(
        self, state_dict: dict, metadata: Metadata | None = None, is_coordinator: bool = False
    ):
        self.original_state_dict = self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        obj = self.state_dict.get(index.fqn)
        return obj.local.detach() if isinstance(obj, Piece) else super().lookup_tensor(index)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """An object saved as pickled bytes (DCP's own ``load_bytes`` unpickles anything)."""
        info = self.metadata.storage_data.get(read_item.storage_index) if self.metadata else None
        file = self.directory / info.relative_path if info is not None else self.directory
        fqn = read_item.dest_index.fqn
        where = f"{file} (the object {fqn})"
        self.state_dict[fqn] = load_pickled(value, where=where, trusted=self.trusted, allowed=(_Kept,))


def _destination(md: Any, *, dtype: torch.dtype | None = None, device: Any = "cpu") -> Tensor | None:
    """An empty tensor to read a saved tensor into (``None`` for a pickled object)."""
    if isinstance(md, BytesStorageMetadata):
        return None
    return torch.empty(md.size, dtype=dtype or md.properties.dtype, device=device)


def _optimizer_prefix(index: int) -> str:
    return f"optim.{index}."


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


def _hyper(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}

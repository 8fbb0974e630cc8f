"""Unpickling a checkpoint safely (the reader's third step): a full file, ``meta.pt`` and the
objects a shard holds through torch's ``weights_only`` allow-list; DCP's ``.metadata`` through an
allow-list of the classes it is made of, and that object handed to DCP, whose own ``read_metadata``
would unpickle the file with ``pickle.load``; DCP's load of the shards' chunks, its objects through
the allow-list.

[Note: what loading runs]
Unpickling calls whatever the pickle names: a file that names ``builtins.exec`` runs code when it
is loaded. So nothing a checkpoint holds is unpickled unless every global it names is on an
allow-list of constructors of plain values:

- a full file, ``meta.pt``, and the objects a shard holds as pickled bytes (:class:`_Kept`):
  ``torch.load(weights_only=True)`` (containers, numbers, strings, tensors, dtypes, and the
  ``_Kept`` box for shards), by :func:`load_pickled`;
- DCP's ``.metadata``, which DCP itself reads with a plain ``pickle.load``: read first by our own
  unpickler with an allow-list of the classes DCP's metadata is made of
  (:func:`read_dcp_metadata`), and DCP handed that object instead of reading the file;
- tensor chunks in shards: DCP loads them with ``weights_only=True`` itself.

A global off the list is an :class:`UnsafeCheckpointError` that names the file and the global,
raised before anything of the file is used. A caller who trusts a file says so with
``weights_only=False`` (Lightning's and torch's own switch): then a full file, ``meta.pt`` and the
shards' objects load as saved, which runs the code they name. ``.metadata`` is always read through
the allow-list (nothing legitimate needs more).
"""

from __future__ import annotations

import io
import os
import pickle
import re
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from torch import Tensor
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from lightning_zero.checkpoint.format import (
    DCP_METADATA_FILE,
    CheckpointError,
    Piece,
    UnsafeCheckpointError,
    _Kept,
)
from lightning_zero.comm import Communicator

# --------------------------------------------------------------------------- torch.load, weights only


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


def _read_full_or_refuse(path: Any, checkpoint_io: CheckpointIO, trusted: bool) -> Any:
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


def _read_full(path: Any, checkpoint_io: CheckpointIO, weights_only: bool | None) -> Any:
    """What the full file ``path`` holds, as torch.load returns it; a file that cannot be loaded is
    a CheckpointError naming it and its size (a refused global, see :func:`_read_full_or_refuse`)."""
    try:
        return _load(path, checkpoint_io, weights_only)
    except Exception as err:
        if "Weights only load failed" in str(err) and zipfile.is_zipfile(path):
            raise  # a complete file with objects that weights_only refuses: torch's own advice applies
        raise CheckpointError(
            f"cannot read the checkpoint file {path} ({_size(path)}): truncated, corrupt or not written by "
            f"torch.save ({type(err).__name__}: {err})"
        ) from err


def _load(path: Any, checkpoint_io: CheckpointIO, weights_only: bool | None) -> Any:
    """A local file through the default CheckpointIO is memory-mapped: each rank reads only the
    pages of what it loads (its shards), never the whole model; anything else as the IO reads it."""
    if type(checkpoint_io) is TorchCheckpointIO and isinstance(path, (str, Path)) and "://" not in str(path):
        return torch.load(str(path), map_location="cpu", weights_only=weights_only, mmap=True)
    return checkpoint_io.load_checkpoint(path, weights_only=weights_only)


def _load_meta(path: Path, trusted: bool) -> Any:
    try:
        return load_pickled(path, where=path, trusted=trusted)
    except UnsafeCheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(
            f"cannot read {path} ({_size(path)}): truncated or corrupt ({type(err).__name__}: {err})"
        ) from err


def _size(path: Any) -> str:
    try:
        return f"{os.path.getsize(path)} bytes"
    except OSError:
        return "size unknown"


# --------------------------------------------------------------------------- DCP's .metadata


_PATHS = ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")  # StorageMeta.checkpoint_id

# (module, name) of every global torch's DCP writes into .metadata (torch 2.13, FileSystemWriter)
DCP_METADATA_GLOBALS = frozenset(
    {
        *(
            ("torch.distributed.checkpoint.metadata", name)
            for name in (
                "Metadata",
                "StorageMeta",
                "MetadataIndex",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        *(("pathlib", name) for name in _PATHS),
        *(("pathlib._local", name) for name in _PATHS),  # Python 3.13's module of the path classes
    }
)


class _AllowListUnpickler(pickle.Unpickler):
    """Builds only the globals of :data:`DCP_METADATA_GLOBALS` and torch's dtypes; any other is an
    :class:`UnsafeCheckpointError` naming ``file`` and the global, before anything is called."""

    def __init__(self, stream: IO[bytes], file: Path) -> None:
        super().__init__(stream)
        self.file = file  # named in a refusal

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in DCP_METADATA_GLOBALS or _is_dtype(module, name):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"{self.file} names the global {module}.{name}, which is not one of the classes DCP's metadata "
            "is made of: nothing of it was run. The file was not written by torch.distributed.checkpoint as "
            "it is (changed or planted); delete the checkpoint"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(f"{self.file} holds a persistent id ({pid!r}); DCP's metadata has none")


def _is_dtype(module: str, name: str) -> bool:
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


def read_dcp_metadata(directory: Path) -> Metadata:
    """The ``.metadata`` of the sharded checkpoint ``directory``, unpickled through the allow-list."""
    file = directory / DCP_METADATA_FILE
    try:
        with open(file, "rb") as f:
            metadata = _AllowListUnpickler(f, file).load()
    except UnsafeCheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(f"cannot read {file}: {type(err).__name__}: {err}") from err
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{file} is not DCP's metadata: it holds a {type(metadata).__name__}")
    return metadata


class CheckedReader(FileSystemReader):
    """DCP's file-system reader, given the metadata already read by :func:`read_dcp_metadata`
    (and checked against its checksum): DCP never unpickles ``.metadata`` itself."""

    def __init__(self, directory: Path, metadata: Metadata) -> None:
        super().__init__(str(directory))
        self.checked = metadata  # read through the allow-list

    def read_metadata(self) -> Metadata:  # type: ignore[override]  # no rank-local metadata
        if self.checked.storage_meta is None:
            self.checked.storage_meta = StorageMeta()
        self.checked.storage_meta.load_id = self.load_id  # as FileSystemReader.read_metadata does
        return self.checked


# --------------------------------------------------------------------------- the shards' chunks and objects


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


def _load_items(comm: Communicator, dest: dict[str, Any], st: Any, *, name: str, local: bool = False) -> None:
    """DCP's load of ``dest`` from the checkpoint of the stand-in ``st`` (a ``ShardedModelState``):
    its reader given the metadata as checked, its objects unpickled through the allow-list; an object
    refused on any rank raised as itself on every rank (DCP gathers the failures into its
    CheckpointException)."""
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

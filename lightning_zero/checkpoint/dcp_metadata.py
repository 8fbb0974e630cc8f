"""DCP's ``.metadata`` read through an allow-list of the classes it is made of, and the reader that
hands that object to DCP, whose own ``read_metadata`` would unpickle the file with ``pickle.load``
(see [Note: what loading runs] in ``format.py``)."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from lightning_zero.checkpoint.format import DCP_METADATA_FILE, CheckpointError, UnsafeCheckpointError

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

"""Checking a checkpoint against the checksums recorded when it was written (the reader's second
step; [Note: checkpoint checksums] in ``checksum.py``). What can be checked before it is parsed is
checked first: a full file's pickle record, ``meta.pt``'s records, DCP's ``.metadata`` (so a damaged
file is named damaged, never an error of the parser). A full file's tensors are checked once
loaded; the shard files' chunks and a streamed full file's storage records split over the ranks,
each rank its share."""

from __future__ import annotations

import io
import pickle
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from lightning_zero.checkpoint.checksum import (
    READ_BLOCK,
    chunk_key,
    file_crc,
    shard_checksums,
    tensor_crc,
    tensors_in,
)
from lightning_zero.checkpoint.format import DCP_METADATA_FILE, INTEGRITY_KEY, CheckpointError

# --------------------------------------------------------------------------- before parsing


def verify_zip_records(path: Path, *, only_pickle: bool) -> None:
    """The CRC32s the zip format keeps for its records (a torch.save file): all of them, or only
    the pickle (the non-tensor part). A local file that is not a zip is left to the loader."""
    if not zipfile.is_zipfile(path):
        return
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            if only_pickle and not info.filename.endswith("data.pkl"):
                continue
            try:
                _read_through(archive, info)
            except zipfile.BadZipFile as err:
                raise CheckpointError(
                    f"{path} is damaged: its record {info.filename} does not match its checksum ({err}). The "
                    "file changed after it was written (disk, copy or transfer); load an earlier checkpoint"
                ) from err


def _read_through(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> None:
    """Read one record to its end: zipfile checks its CRC there (BadZipFile on a mismatch)."""
    with archive.open(info) as record:
        while record.read(READ_BLOCK):
            pass


def verify_metadata_file(directory: Path, record: Mapping[str, Any] | None) -> None:
    """DCP's ``.metadata`` as recorded, checked before it is parsed: a damaged file is named damaged
    (not an error of the parser); nothing of it is unpickled first. ``record``: the layout's
    ``checksums`` (None: none kept)."""
    if record is None:
        return
    if file_crc(directory / DCP_METADATA_FILE) != record["metadata"]:
        raise CheckpointError(
            f"{directory / DCP_METADATA_FILE} is damaged: it does not match its checksum (CRC32 recorded "
            f"{record['metadata']:08x}); load an earlier checkpoint"
        )


# --------------------------------------------------------------------------- the full form's tensors


def by_records(checkpoint: Mapping[str, Any]) -> bool:
    """Some of its tensors are checked by their zip records (see :func:`verify_records`)."""
    record = checkpoint.get(INTEGRITY_KEY)
    return bool(record and record.get("records"))


def verify_full(checkpoint: Mapping[str, Any], source: Any) -> None:
    """Every tensor as recorded; else a CheckpointError naming ``source`` and the tensors."""
    record = checkpoint.get(INTEGRITY_KEY)
    if record is None:
        return  # written before checksums: nothing to compare with
    want: dict[str, int] = record["tensors"]
    by_record = set(record.get("records", ()))  # checked by verify_records
    got = {p: t for p, t in tensors_in(checkpoint) if p not in by_record}
    bad = [p for p, t in got.items() if p in want and tensor_crc(t) != want[p]]
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if not (bad or missing or extra):
        return
    parts = [f"tensor {p} does not match its checksum (CRC32 recorded {want[p]:08x})" for p in bad[:5]]
    if missing or extra:
        parts.append(f"tensors missing {missing[:5]}, not recorded {extra[:5]}")
    raise CheckpointError(
        f"{source} is damaged: {'; '.join(parts)}{' ...' if len(bad) > 5 else ''} ({len(bad)} of {len(want)} "
        "tensors differ). The file changed after it was written (disk, copy or transfer); load an earlier "
        "checkpoint"
    )


def verify_records(path: Path, *, rank: int = 0, world_size: int = 1) -> None:
    """The zip CRC of every ``rank``-th storage record of a torch.save file that needs it (those
    written while gathered carry no CRC of their own in the pickle; a record all of whose tensors
    have their own CRC in the file's checksum entry is left to :func:`verify_full`, which names the
    tensor among several that share one record, a flat buffer's views); else a CheckpointError
    naming the tensor(s) the damaged record holds."""
    with zipfile.ZipFile(path) as archive:
        held, covered = _record_tensors(archive)
        records = [
            i
            for i in archive.infolist()
            if "/data/" in i.filename
            and not i.filename.endswith(".pkl")
            and not (held.get(_key(i.filename)) and set(held[_key(i.filename)]) <= covered)
        ]
        for info in records[rank::world_size]:
            try:
                _read_through(archive, info)
            except zipfile.BadZipFile as err:
                raise CheckpointError(
                    f"{path} is damaged: {_named(held.get(_key(info.filename), []))} (record {info.filename}) "
                    f"does not match its checksum ({err}). The file changed after it was written (disk, copy "
                    "or transfer); load an earlier checkpoint"
                ) from err


def _key(filename: str) -> str:
    return filename.rsplit("/", 1)[-1]


def _named(paths: list[str]) -> str:
    """``tensor a`` or, for a record several tensors share, ``tensors a, b (one storage record)``."""
    if not paths:
        return "tensor ?"
    if len(paths) == 1:
        return f"tensor {paths[0]}"
    more = f" and {len(paths) - 4} more" if len(paths) > 4 else ""
    return f"tensors {', '.join(paths[:4])}{more} (one storage record)"


def _tensor_of(archive: zipfile.ZipFile, filename: str) -> str:
    """The path(s) in the checkpoint dict of the tensor(s) stored in record ``filename`` ("?" if unknown)."""
    return ", ".join(_record_tensors(archive)[0].get(_key(filename), [])) or "?"


def _record_tensors(archive: zipfile.ZipFile) -> tuple[dict[str, list[str]], set[str]]:
    """The paths in the checkpoint dict of the tensors stored in each record (by record key), and
    those with a CRC32 of their own in the file's checksum entry; empty if the pickle cannot be walked."""
    pickled = next((i.filename for i in archive.infolist() if i.filename.endswith("/data.pkl")), None)
    if pickled is None:
        return {}, set()
    try:
        obj = _Keys(io.BytesIO(archive.read(pickled))).load()
    except Exception:  # a pickle that cannot be walked here: name the record only
        return {}, set()
    held: dict[str, list[str]] = {}
    for p, k in tensors_in(obj, leaf=_StorageKey):
        held.setdefault(str(k), []).append(p)
    record = obj.get(INTEGRITY_KEY) if isinstance(obj, Mapping) else None
    tensors = record.get("tensors") if isinstance(record, Mapping) else None
    return held, set(tensors) if isinstance(tensors, Mapping) else set()


class _StorageKey(str):
    """A storage record's key, standing in for its tensor while the pickle is read for names."""


class _Keys(pickle.Unpickler):
    """Reads a torch.save pickle for its structure only: tensors become their storage keys, dicts
    stay dicts, every other global an inert :class:`_Opaque`; nothing the pickle names is called
    ([Note: what loading runs] in ``unpickle.py``)."""

    def persistent_load(self, pid: Any) -> Any:
        return _StorageKey(pid[2])

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_parameter"):
            return _storage_of  # its first argument: the storage (the tensor's, for a parameter)
        if (module, name) == ("collections", "OrderedDict"):
            return _Dict
        return _Opaque


class _Dict(dict):
    """A state dict's OrderedDict while a pickle is read for names (keeps its ``_metadata``)."""


def _storage_of(storage: Any, *args: Any, **kwargs: Any) -> Any:
    return storage


class _Opaque:
    """Stands in for any object but a dict or tensor while a pickle is read for names: built from
    anything, holding nothing."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Opaque:
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass


# --------------------------------------------------------------------------- the sharded form's chunks


def verify_sharded(
    directory: Path, metadata: Metadata, record: Mapping[str, Any] | None, files: set[str]
) -> None:
    """The chunks stored in ``files`` (and DCP's metadata) as recorded; else a CheckpointError
    naming the file and the tensor. ``record``: the layout's ``checksums`` (None: none kept)."""
    if record is None:
        return
    verify_metadata_file(directory, record)
    want: dict[str, int] = record["chunks"]
    got = shard_checksums(directory, metadata, files)
    for index, info in metadata.storage_data.items():
        key = chunk_key(info.relative_path, info.offset, info.length)
        if key in got and got[key] != want.get(key):
            raise CheckpointError(
                f"{directory / info.relative_path} is damaged: the chunk of tensor {index.fqn} at offset "
                f"{tuple(index.offset) if index.offset is not None else ()} (bytes {info.offset}-{info.offset + info.length}) "
                f"does not match its checksum (CRC32 recorded {want.get(key, 0):08x}); load an earlier checkpoint"
            )

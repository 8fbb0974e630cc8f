"""Checksums: what a checkpoint holds, recorded when it is written (the writer's checksum step),
and the CRCs that the writer records and the reader (``verify.py``) computes again.

[Note: checkpoint checksums]
Truncated files and missing shards are caught by their structure (``locate.py``, ``unpickle.py``), but flipped
bytes inside a tensor load without complaint and poison the run (a NaN in ``exp_avg_sq`` is a NaN
loss one step later). So every checkpoint records a CRC32 (``zlib.crc32``: about 2.8 GB/s on one
core here, docs/checkpoints.md) of what it holds, computed when it is written:

- full form: one CRC per tensor, by its path in the checkpoint dict (``state_dict/net.0.weight``,
  ``optimizer_states/0/state/3/exp_avg_sq``), stored in the file itself under ``INTEGRITY_KEY``;
  the non-tensor part (the pickle) is covered by the CRC the zip format keeps for that record,
  checked too. A plain Lightning process loads the file as before (one more top-level key).
  Tensors written while they are gathered ([Note: streamed full checkpoints]: the parameters and
  optimizer state that live in shards) are not known when the pickle is written: their paths are
  listed under ``"records"`` and their check is the CRC the zip format keeps for their storage
  record, computed as the record is written. Reading checks those records split over the ranks
  (each reads 1/N of the file), so a memory-mapped load never touches the pages it does not use.
- sharded form: one CRC per chunk of every shard file, over the bytes DCP wrote for it (each rank
  reads back its own file, still in the page cache), plus one of DCP's ``.metadata`` file, stored
  in ``meta.pt``'s layout; ``meta.pt`` is covered by its zip CRCs.

``verify.py`` compares them; a mismatch is a :class:`CheckpointError` that names the file and the
tensor (or chunk). Loading with ``verify_checkpoints`` (the default) checks everything it reads:
the full form on every rank (each reads the whole file), the sharded form split over the ranks,
one file each in turn.
Checkpoints written before this format have no checksums and load unchecked.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import Metadata

from lightning_zero.checkpoint.format import DCP_METADATA_FILE, INTEGRITY_KEY
from lightning_zero.streamed import Streamed

ALGORITHM = "crc32"
READ_BLOCK = 64 << 20  # bytes read at a time when checking a file


def tensor_crc(tensor: Tensor) -> int:
    """CRC32 of the tensor's bytes (row-major, on the CPU)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    data = t.contiguous().reshape(-1).view(torch.uint8).numpy()
    return zlib.crc32(memoryview(data))


def tensors_in(obj: Any, path: str = "", *, leaf: type = Tensor) -> Iterator[tuple[str, Any]]:
    """Every tensor (or other ``leaf``) in nested dicts, lists and tuples, with its path (``a/b/0/c``)."""
    if isinstance(obj, leaf):
        yield path, obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            if key != INTEGRITY_KEY:
                yield from tensors_in(value, f"{path}/{key}" if path else str(key), leaf=leaf)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from tensors_in(value, f"{path}/{i}" if path else str(i), leaf=leaf)


# --------------------------------------------------------------------------- the full form


def add_full_checksums(checkpoint: dict[str, Any]) -> None:
    """Record every tensor's CRC32 in ``checkpoint`` (before it is written); stand-ins for tensors
    written while they are gathered are listed by path, checked by their zip records."""
    checkpoint[INTEGRITY_KEY] = {
        "algorithm": ALGORITHM,
        "tensors": {path: tensor_crc(t) for path, t in tensors_in(checkpoint) if not isinstance(t, Streamed)},
        "records": [path for path, _ in tensors_in(checkpoint, leaf=Streamed)],
    }


# --------------------------------------------------------------------------- the sharded form


def chunk_key(relative_path: str, offset: int, length: int) -> str:
    return f"{relative_path}:{offset}:{length}"


def shard_checksums(directory: Path, metadata: Metadata, files: set[str]) -> dict[str, int]:
    """CRC32 of every chunk stored in ``files`` (names relative to ``directory``), by chunk key."""
    out: dict[str, int] = {}
    handles: dict[str, Any] = {}
    try:
        for info in sorted(metadata.storage_data.values(), key=lambda i: (i.relative_path, i.offset)):
            if info.relative_path not in files:
                continue
            f = handles.get(info.relative_path)
            if f is None:
                f = handles[info.relative_path] = open(directory / info.relative_path, "rb")
            out[chunk_key(info.relative_path, info.offset, info.length)] = _crc_range(
                f, info.offset, info.length
            )
    finally:
        for f in handles.values():
            f.close()
    return out


def _crc_range(f: Any, offset: int, length: int) -> int:
    f.seek(offset)
    crc, left = 0, length
    while left > 0:
        block = f.read(min(READ_BLOCK, left))
        if not block:
            break
        crc = zlib.crc32(block, crc)
        left -= len(block)
    return crc


def file_crc(path: Path) -> int:
    with open(path, "rb") as f:
        return _crc_range(f, 0, path.stat().st_size)


def sharded_record(directory: Path, chunks: dict[str, int]) -> dict[str, Any]:
    """What meta.pt's layout keeps: the chunks' CRCs and DCP's metadata file's."""
    return {"algorithm": ALGORITHM, "chunks": chunks, "metadata": file_crc(directory / DCP_METADATA_FILE)}


def files_of(metadata: Metadata) -> list[str]:
    """The shard files DCP's metadata refers to, sorted."""
    return sorted({info.relative_path for info in metadata.storage_data.values()})

"""Files in place: the partial and previous siblings of a checkpoint, publishing, removal.

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

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO

log = logging.getLogger(__name__)


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


def _write_synced(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


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


def _size(path: Any) -> str:
    try:
        return f"{os.path.getsize(path)} bytes"
    except OSError:
        return "size unknown"

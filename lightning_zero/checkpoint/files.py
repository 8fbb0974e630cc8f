"""Files in place: the partial and previous siblings of a checkpoint, publishing, removal.

[Note: complete or absent]
A checkpoint appears under its final name only when complete. The sharded form is written into
``.NAME.partial`` next to it; when every rank has written its shards and rank 0 ``meta.pt``, rank 0
renames the previous checkpoint (if any) to ``.NAME.previous`` and ``.NAME.partial`` to ``NAME``;
then all ranks pass a barrier. The full form is written to ``.NAME.partial``; the previous file
is hard-linked as ``.NAME.previous`` and the new one renamed over ``NAME`` (one atomic rename).
Every file is fsynced before it is published (DCP's writer fsyncs the shards, and the partial
directory is fsynced for its entries), and the folder after every rename: a checkpoint reported
saved is still there after a power loss.
With ``keep_previous_checkpoint`` (the default) ``.NAME.previous`` stays until the next save under
that name, so that a checkpoint found damaged later falls back to it (:func:`fallbacks`); without,
it is deleted at once. A process killed during a save leaves the previous checkpoint in place
(or, in the instant between the two renames, under ``.NAME.previous``, which :func:`resolve` then
loads with a warning) and a ``.NAME.partial``, which is not a checkpoint: every save removes the
leftovers in its folder, and the strategy removes them at start-up. Reading checks what it reads:
a truncated or foreign file is an error that names the file and what is missing, a damaged one
([Note: checkpoint checksums] in ``integrity.py``) the tensor.
"""

from __future__ import annotations

import errno
import logging
import os
import re
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


def _publish(partial: Path, path: Path, *, keep_previous: bool = True) -> None:
    """Put the finished ``partial`` at ``path`` (see [Note: complete or absent])."""
    previous = _sibling(path, "previous")
    _remove(previous)
    if partial.is_file() and (not _exists(path) or (path.is_file() and not path.is_symlink())):
        if keep_previous and _exists(path):
            _link_or_copy(path, previous)
        os.replace(partial, path)  # a file over a file: one atomic rename
        _fsync_dir(path.parent)
        return
    if partial.is_dir():
        _fsync_dir(partial)  # its entries: the shard files and meta.pt
    if _exists(path):
        os.rename(path, previous)
    os.rename(partial, path)
    _fsync_dir(path.parent)
    if not keep_previous:
        _remove(previous)


_NO_DIRECTORY_SYNC = (errno.EINVAL, errno.EBADF, errno.ENOTSUP, errno.EACCES, errno.EISDIR)


def _fsync_dir(directory: Path) -> None:
    """Make the renames in ``directory`` durable: fsync the directory itself. Skipped quietly where
    a directory cannot be opened or synced (Windows, some network file systems)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in _NO_DIRECTORY_SYNC:
            raise
    finally:
        os.close(fd)


def _link_or_copy(path: Path, target: Path) -> None:
    try:
        os.link(path, target)  # the old file's data, under a second name: no copy
    except OSError:  # a file system without hard links
        shutil.copy2(path, target)


def remove_stale_partials(directory: str | Path) -> list[Path]:
    """Delete what interrupted saves left in ``directory`` (``.NAME.partial``); returns them."""
    directory = Path(directory)
    if "://" in str(directory) or not directory.is_dir():
        return []
    stale = [p for p in directory.iterdir() if p.name.startswith(".") and p.name.endswith(".partial")]
    for p in stale:
        _remove(p)
    return stale


SERIES = re.compile(r"last(-v\d+)?\.ckpt|hpc_ckpt_\d+\.ckpt")  # names whose fallback is any older checkpoint


def fallbacks(path: Path) -> list[Path]:
    """Where to look when the checkpoint at ``path`` is missing or damaged, newest first: its kept
    previous version and, for ``last.ckpt`` and ``hpc_ckpt_<n>.ckpt`` (whatever checkpoint is the
    latest), every older ``*.ckpt`` in its folder. The previous version is ordered by its time like
    the others: a top-k checkpoint saved after it (step 12 beside a previous ``last.ckpt`` of step 8)
    comes first, so no intact newer checkpoint is passed over."""
    out = [p for p in (_sibling(path, "previous"),) if _exists(p)]
    if not SERIES.fullmatch(path.name) or not path.parent.is_dir():
        return out
    limit = path.stat().st_mtime if _exists(path) else float("inf")
    others = [
        p
        for p in path.parent.iterdir()
        if p.suffix == ".ckpt" and not p.name.startswith(".") and p != path and p.stat().st_mtime <= limit
    ]
    return sorted(out + others, key=_mtime, reverse=True)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # a link to nothing: last
        return float("-inf")


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

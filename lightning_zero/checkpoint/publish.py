"""Publishing a checkpoint (the writer's last step): the finished partial file or directory put
under its final name, the previous one kept beside it; what interrupted saves left, removed; a
checkpoint deleted.

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
that name, so that a checkpoint found damaged later falls back to it (:func:`fallbacks` in
``locate.py``); without, it is deleted at once. A process killed during a save leaves the previous
checkpoint in place (or, in the instant between the two renames, under ``.NAME.previous``, which
:func:`resolve` then loads with a warning) and a ``.NAME.partial``, which is not a checkpoint: every
save removes the leftovers in its folder, and the strategy removes them at start-up. Reading checks
what it reads: a truncated or foreign file is an error that names the file and what is missing, a
damaged one ([Note: checkpoint checksums] in ``checksum.py``) the tensor.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from lightning.fabric.plugins import CheckpointIO

from lightning_zero.checkpoint.locate import _exists, _sibling


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


def remove(path: str | Path, checkpoint_io: CheckpointIO) -> None:
    """Delete a checkpoint (file or directory) and what an interrupted save left beside it."""
    if "://" in str(path):
        checkpoint_io.remove_checkpoint(path)
        return
    path = Path(path)
    for p in (path, _sibling(path, "partial"), _sibling(path, "previous")):
        _remove(p)

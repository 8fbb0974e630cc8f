"""Room to write a checkpoint: the folders checked at setup, the space a save needs, and the error
that names a save that could not be written.

[Note: a save that cannot be written]
A full disk used to end a full save with torch's ``[enforce fail at inline_container.cc:672]
unexpected pos ...`` (nothing said ENOSPC), leave ``.NAME.partial`` behind and the disk full; a
read-only folder was found at the first save, many steps in. Now:

- at setup the strategy calls :func:`check_writable` with the run's checkpoint folders: rank 0
  (every rank for the sharded form, where every rank writes) creates and removes a probe file in
  each (in its nearest existing parent if the folder does not exist yet); the outcome is agreed,
  and every rank raises a :class:`CheckpointWriteError` naming the folder and the reason;
- before writing, the bytes the save needs (the sizes of the tensors it writes: :func:`needed_bytes`)
  are compared with the space free in the folder (``shutil.disk_usage``); a save that cannot fit
  writes nothing;
- a write that fails anyway (a file size limit, a disk filled by someone else meanwhile, an I/O
  error) removes its partial file or directory, keeps the previous checkpoint as it was, and every
  rank raises the same :class:`CheckpointWriteError`: the path, the bytes needed, the bytes free and
  the cause (ENOSPC, EFBIG, EROFS, ... when it can be told).
"""

from __future__ import annotations

import errno
import os
import resource
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from torch import Tensor

from lightning_zero.checkpoint.format import CheckpointError, Piece
from lightning_zero.comm import Communicator

PROBE = ".lightning_zero_write_probe"  # the probe file's name (with the pid appended)


class CheckpointWriteError(CheckpointError):
    """A checkpoint that could not be written: the message names the path, the bytes the save
    needed, the space free and the cause. The previous checkpoint under that name is unchanged."""


def check_writable(
    folders: Iterable[str | Path], comm: Communicator | None = None, *, every_rank: bool = False
) -> None:
    """Each of ``folders`` takes a checkpoint: a probe file is created and removed in it (or in its
    nearest existing parent, where it does not exist yet) by rank 0, or by every rank with
    ``every_rank`` (the sharded form, where every rank writes its shards); every rank calls it and
    every rank raises the same :class:`CheckpointWriteError` if any rank cannot write (one control
    collective). Remote paths (``s3://...``) are not probed."""
    probing = every_rank or comm is None or comm.rank == 0
    error = next((e for e in map(_probe, sorted(set(map(str, folders)))) if e), None) if probing else None
    errors = comm.all_gather_object(error, name="checkpoint/writable") if comm is not None else [error]
    failed = [(rank, e) for rank, e in enumerate(errors) if e]
    if not failed:
        return
    if len({e for _, e in failed}) == 1:
        raise CheckpointWriteError(
            failed[0][1] + f" (found by rank(s) {', '.join(str(r) for r, _ in failed)})"
        )
    raise CheckpointWriteError("; ".join(f"rank {r}: {e}" for r, e in failed))


def _probe(folder: str) -> str | None:
    """None if a file can be written in ``folder`` now; else why not."""
    if "://" in folder:
        return None
    target = Path(folder)
    existing = _existing_parent(target)
    if not existing.is_dir():
        return f"the checkpoint folder {target} cannot be created: {existing} is not a directory"
    probe = existing / f"{PROBE}.{os.getpid()}"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            os.write(fd, b"\0")
            os.fsync(fd)
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
    except OSError as err:
        where = target if existing == target else f"{target} (to be created in {existing})"
        return (
            f"cannot write checkpoints in {where}: {_cause(err)}; {_free_text(existing)}. The first save "
            "would fail: make the folder writable, free space, or choose another one (ModelCheckpoint("
            "dirpath=...), Trainer(default_root_dir=...))"
        )
    return None


def _existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def needed_bytes(obj: Any, *, whole: bool = True) -> int:
    """The bytes of the tensors in ``obj`` (nested dicts, lists, tuples; stand-ins by their shape,
    :class:`Piece` by this rank's part): what writing it puts on disk, less the small pickle.
    ``whole=False`` counts the pieces only: a sharded save writes a tensor every rank holds whole
    once, so only one rank counts those."""
    if isinstance(obj, Piece):
        return obj.local.numel() * obj.local.dtype.itemsize
    if isinstance(obj, Tensor):
        return obj.numel() * obj.dtype.itemsize if whole else 0
    if isinstance(obj, dict):
        return sum(needed_bytes(v, whole=whole) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(needed_bytes(v, whole=whole) for v in obj)
    return 0


def free_bytes(folder: str | Path) -> int | None:
    """The bytes free for this user on the file system of ``folder`` (None: unknown)."""
    try:
        return shutil.disk_usage(_existing_parent(Path(folder))).free
    except OSError:
        return None


def room_for(path: str | Path, needed: int, *, free: int | None = None) -> str | None:
    """None if ``needed`` bytes fit in the folder of ``path`` (``free`` bytes free there, measured
    now if not given); else the message of the error."""
    free = free if free is not None else free_bytes(Path(path).parent)
    if free is None or needed <= free:
        return None
    return (
        f"cannot write the checkpoint {path}: no space left on device (ENOSPC): the save needs about "
        f"{_size(needed)} ({needed} bytes: the tensors it writes) and {_size(free)} ({free} bytes) are free "
        f"in {Path(path).parent}. Nothing was written; the previous checkpoint under that name is unchanged. "
        "Free space or choose another folder"
    )


def write_failed(path: str | Path, needed: int, err: BaseException) -> str:
    """The message of a write of ``path`` that failed with ``err`` (after its partial was removed)."""
    folder = Path(path).parent
    return (
        f"cannot write the checkpoint {path}: {_cause(err, needed=needed, folder=folder)}. The save needed "
        f"about {_size(needed)} ({needed} bytes: the tensors it writes); {_free_text(folder)}. The partial "
        "file was removed and the previous checkpoint under that name is unchanged. Free space, raise the "
        "limit, or choose another folder"
    )


def _cause(err: BaseException, *, needed: int | None = None, folder: Path | None = None) -> str:
    """What went wrong, by errno where the error carries one, else by what can be measured: torch's
    zip writer reports a failed write as ``unexpected pos`` without the errno."""
    code = next((e.errno for e in _chain(err) if isinstance(e, OSError) and e.errno), None)
    if code is None and needed is not None and folder is not None:
        free, limit = free_bytes(folder), resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if free is not None and free < needed:
            code = errno.ENOSPC
        elif limit != resource.RLIM_INFINITY and limit < needed:
            code = errno.EFBIG
    if code == errno.EFBIG:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        shown = "unlimited" if limit == resource.RLIM_INFINITY else f"{limit} bytes"
        return f"file too large (EFBIG): the process's file size limit (ulimit -f) is {shown}"
    if code is not None:
        return f"{os.strerror(code).lower()} ({errno.errorcode.get(code, code)})"
    return f"{type(err).__name__}: {err}"


def _chain(err: BaseException | None) -> Iterable[BaseException]:
    seen = 0
    while err is not None and seen < 8:
        yield err
        err, seen = err.__cause__ or err.__context__, seen + 1


def _free_text(folder: Path) -> str:
    free = free_bytes(folder)
    return "the free space is unknown" if free is None else f"{_size(free)} ({free} bytes) are free there now"


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"

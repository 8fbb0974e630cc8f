"""Finding a checkpoint (the reader's first step): the path as given, or its previous sibling when
a save stopped between its renames; the checkpoints to fall back to when it is missing or damaged;
and the files the sharded form needs: its two index files, then the shard files DCP's index names,
each there and long enough. The names of a checkpoint's partial and previous siblings are kept here
too ([Note: complete or absent] in ``publish.py``)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

from torch.distributed.checkpoint.metadata import Metadata

from lightning_zero.checkpoint.format import DCP_METADATA_FILE, META_FILE, CheckpointError

log = logging.getLogger(__name__)


def _sibling(path: Path, tag: str) -> Path:
    """``.NAME.partial`` / ``.NAME.previous`` next to ``path`` (hidden; not ``*.ckpt``)."""
    return path.parent / f".{path.name}.{tag}"


def _exists(path: Path) -> bool:
    return path.exists() or path.is_symlink()


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


# --------------------------------------------------------------------------- the sharded form's files


def _check_complete(path: Path) -> None:
    """The sharded checkpoint ``path`` holds its two index files (``.metadata`` and ``meta.pt``);
    otherwise a CheckpointError naming the one missing."""
    for name, why in ((DCP_METADATA_FILE, "DCP's index of the shards"), (META_FILE, "rank 0's entries")):
        if not (path / name).is_file():
            raise CheckpointError(
                f"{path} is not a complete sharded checkpoint: {name} ({why}) is missing. A save that did "
                "not finish leaves no checkpoint under its final name; was this directory copied in part?"
            )


def _check_storage(path: Path, metadata: Metadata) -> None:
    """Every shard file DCP's metadata refers to exists and reaches the end of its last chunk."""
    need: dict[str, tuple[int, set[str]]] = {}
    for index, info in metadata.storage_data.items():
        end, keys = need.get(info.relative_path, (0, set()))
        keys.add(index.fqn)
        need[info.relative_path] = (max(end, info.offset + info.length), keys)
    for relative, (end, keys) in sorted(need.items()):
        file = path / relative
        held = f"it holds chunks of {len(keys)} tensors, e.g. {', '.join(sorted(keys)[:3])}"
        if not file.is_file():
            raise CheckpointError(f"{file} is missing: {path} is incomplete ({held})")
        size = file.stat().st_size
        if size < end:
            raise CheckpointError(f"{file} is truncated: {size} bytes, its chunks end at byte {end} ({held})")

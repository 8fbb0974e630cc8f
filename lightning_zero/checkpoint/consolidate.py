"""``lightning-zero consolidate``: a sharded checkpoint into one plain Lightning checkpoint file, in one
process without a process group: the reader's steps for the whole model and every optimizer
(``reader.py``, ``load.py``), then the full form's checksums and a file published under its name."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple

from lightning_zero.checkpoint.checksum import add_full_checksums, files_of
from lightning_zero.checkpoint.format import (
    LAYOUT_KEY,
    MODEL_PREFIX,
    WEIGHTS_ONLY_DROPS,
    CheckpointError,
    _hyper,
    _unbox,
)
from lightning_zero.checkpoint.layout import ShardedModelState, _destination
from lightning_zero.checkpoint.load import _read_named_state, _state_index
from lightning_zero.checkpoint.locate import _sibling, resolve
from lightning_zero.checkpoint.publish import _fsync_dir
from lightning_zero.checkpoint.reader import inspect_sharded
from lightning_zero.checkpoint.unpickle import _load_items
from lightning_zero.checkpoint.verify import verify_sharded
from lightning_zero.checkpoint.writer import _write_synced
from lightning_zero.comm import Communicator

# --------------------------------------------------------------------------- consolidation


class Consolidated(NamedTuple):
    path: Path  # the file written
    tensors: int  # model tensors in its state_dict
    optimizers: int  # optimizer states included (0 with weights_only)
    nbytes: int  # bytes of the file


def consolidate(
    source: str | Path, out: str | Path, *, weights_only: bool = False, trusted: bool = False
) -> Consolidated:
    """Turn a sharded checkpoint into one plain Lightning checkpoint file, in this process alone
    (no process group, CPU). ``LightningModule.load_from_checkpoint(out)`` loads it.

    Args:
        weights_only: the file holds no optimizer, LR-scheduler or callback state.
        trusted: the source is trusted: ``meta.pt`` and the shards' objects are unpickled as saved,
            which runs the code they name (else only plain values load, see [Note: what loading runs]).
    """
    src = resolve(source)
    if not src.is_dir():
        raise CheckpointError(
            f"{src} is a file, not a sharded checkpoint directory: a full checkpoint loads as it is"
        )
    meta, metadata = inspect_sharded(src, trusted=trusted)
    layout = meta.pop(LAYOUT_KEY)
    verify_sharded(src, metadata, layout.get("checksums"), set(files_of(metadata)))
    comm = Communicator()
    st = ShardedModelState(src, layout, metadata, trusted=trusted)
    checkpoint = dict(meta)
    checkpoint["state_dict"] = _read_full_model(comm, st)
    optimizers = layout["optimizers"] if not weights_only else None
    if weights_only:
        for key in WEIGHTS_ONLY_DROPS:
            checkpoint.pop(key, None)
    elif optimizers is not None:
        checkpoint["optimizer_states"] = [_read_full_optimizer(comm, st, i) for i in range(len(optimizers))]
    target = Path(out)
    partial = _sibling(target, "partial")
    add_full_checksums(checkpoint)
    _write_synced(checkpoint, partial)
    os.replace(partial, target)
    _fsync_dir(target.parent)  # the rename survives a power loss
    return Consolidated(target, len(checkpoint["state_dict"]), len(optimizers or []), target.stat().st_size)


def _read_full_model(comm: Communicator, st: ShardedModelState) -> dict[str, Any]:
    layout = st.layout
    mds = st.metadata.state_dict_metadata
    dest = {fqn: _destination(md) for fqn, md in mds.items() if fqn.startswith(MODEL_PREFIX)}
    _load_items(comm, dest, st, name="checkpoint/read/model", local=True)
    values: dict[str, Any] = {}
    for name in {layout["aliases"].get(k, k) for k in layout["keys"]}:
        value = _unbox(dest[MODEL_PREFIX + name])
        values[name] = value.view(layout["shapes"][name]) if name in layout["shapes"] else value
    return {key: values[layout["aliases"].get(key, key)] for key in layout["keys"]}


def _read_full_optimizer(comm: Communicator, st: ShardedModelState, i: int) -> dict:
    """Optimizer ``i`` as ``optimizer.state_dict()`` of one process: numbered in group order."""
    groups = st.layout["optimizers"][i]
    order = list(dict.fromkeys(n for g in groups for n in g["params"]))
    ids = {name: j for j, name in enumerate(order)}
    named = _read_named_state(comm, st, _state_index(st.metadata, i, order), local=True)
    return {
        "state": {ids[n]: named[n] for n in order if n in named},
        "param_groups": [{**_hyper(g), "params": [ids[n] for n in g["params"]]} for g in groups],
    }

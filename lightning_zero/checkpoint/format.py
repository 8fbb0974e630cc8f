"""Names and constants of both forms, the errors a read raises, and the values the sharded form
stores: the :class:`Piece` DCP saves and loads in place, and the box of a value saved whole as
pickled bytes. The other rooms of the package build on this one; it imports none of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

FORMAT = "lightning_zero.sharded"  # what meta.pt's layout entry says it is
FORMAT_VERSION = 1  # layout version this build writes and reads
META_FILE = "meta.pt"  # rank 0's part of a sharded checkpoint
DCP_METADATA_FILE = ".metadata"  # written by DCP's coordinator once every rank has written
LAYOUT_KEY = "lightning_zero"  # meta.pt entry holding the layout
MODEL_PREFIX = "model."  # DCP keys of the model's state
WEIGHTS_ONLY_DROPS = ("optimizer_states", "lr_schedulers", "callbacks")  # what --weights-only leaves out
INTEGRITY_KEY = "lightning_zero_integrity"  # the full form's entry holding the checksums
FABRIC_RECORD = "lightning_zero_fabric"  # a Fabric save's entry naming the user's keys of each role
USER_KEYS = "user keys"  # the record's "layout" when the file holds the user's keys (Fabric's DDP layout)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read as asked; the message names the file and what is wrong."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint that holds an object whose unpickling would run code off the allow-list
    ([Note: what loading runs] in ``unpickle.py``); the message names the file and the global. Not
    a damaged file: loading does not fall back to another checkpoint."""


# --------------------------------------------------------------------------- what the sharded form stores


class Piece:
    """Elements [offset, offset + len(local)) of a logical 1D tensor of ``numel`` elements.

    What this rank holds of one parameter (or of one per-element optimizer state) inside its
    shard; ``local`` is a view into the shard, read for a save and written in place by a load.
    """

    __slots__ = ("local", "offset", "numel")

    def __init__(self, local: Tensor, offset: int, numel: int) -> None:
        self.local = local  # 1D view into this rank's storage
        self.offset = offset  # where ``local`` starts in the logical tensor
        self.numel = numel  # elements of the whole logical tensor

    def size(self) -> torch.Size:
        """The logical tensor's size (DCP compares it with the saved one)."""
        return torch.Size([self.numel])

    def _chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size([self.offset]), sizes=self.local.size())

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        data = TensorWriteData(
            chunk=self._chunk(), properties=TensorProperties.create_from_tensor(self.local), size=self.size()
        )
        index = MetadataIndex(fqn, torch.Size([self.offset]))
        return [WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=data)]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk()]

    def __repr__(self) -> str:
        return f"Piece([{self.offset}, {self.offset + self.local.numel()}) of {self.numel})"


class _Kept:
    """A value saved whole as pickled bytes: an object, or a tensor state that is neither
    per-element nor a scalar (stage 0 only). Boxed so that DCP does not walk into it.
    Its class is named in every shard that holds an object (``lightning_zero.checkpoint.format._Kept``):
    it stays in this module."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _box(value: Any) -> Any:
    return value if isinstance(value, (Tensor, Piece)) else _Kept(value)


def _unbox(value: Any) -> Any:
    return value.value if isinstance(value, _Kept) else value


def _optimizer_prefix(index: int) -> str:
    return f"optim.{index}."


def _is_per_element(md: Any) -> bool:
    """Per-element state and parameters are saved 1D; scalars 0-dim; anything else as bytes."""
    return isinstance(md, TensorStorageMetadata) and len(md.size) == 1


def _hyper(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}

"""The sharded form's format: names and constants, CheckpointError, the :class:`Piece` DCP saves and loads
in place, and the planners that resolve it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
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


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read as asked; the message names the file and what is wrong."""


# --------------------------------------------------------------------------- pieces and DCP planners


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


class _SavePlanner(DefaultSavePlanner):
    """DCP's default save planner; a :class:`Piece` gives its own write item and its ``local`` data."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict.get(index.fqn)
        return obj.local.detach() if isinstance(obj, Piece) else super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner on a flat dict of tensors, :class:`Piece` and ``None`` (objects).

    Its own ``set_up_planner`` keeps the values as given (the default one turns objects it does
    not know, such as a Piece, into None); reads land in place in the tensors and Pieces.
    """

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(
        self, state_dict: dict, metadata: Metadata | None = None, is_coordinator: bool = False
    ):
        self.original_state_dict = self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        obj = self.state_dict.get(index.fqn)
        return obj.local.detach() if isinstance(obj, Piece) else super().lookup_tensor(index)


def _destination(md: Any, *, dtype: torch.dtype | None = None, device: Any = "cpu") -> Tensor | None:
    """An empty tensor to read a saved tensor into (``None`` for a pickled object)."""
    if isinstance(md, BytesStorageMetadata):
        return None
    return torch.empty(md.size, dtype=dtype or md.properties.dtype, device=device)


def _optimizer_prefix(index: int) -> str:
    return f"optim.{index}."


class _Kept:
    """A value saved whole as pickled bytes: an object, or a tensor state that is neither
    per-element nor a scalar (stage 0 only). Boxed so that DCP does not walk into it."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _box(value: Any) -> Any:
    return value if isinstance(value, (Tensor, Piece)) else _Kept(value)


def _unbox(value: Any) -> Any:
    return value.value if isinstance(value, _Kept) else value


def _is_per_element(md: Any) -> bool:
    """Per-element state and parameters are saved 1D; scalars 0-dim; anything else as bytes."""
    return isinstance(md, TensorStorageMetadata) and len(md.size) == 1


def _hyper(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}

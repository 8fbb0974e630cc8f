"""Full checkpoints written while they are gathered: rank 0 never holds the whole model.

[Note: streamed full checkpoints]
At stages 1-3 the parameters (stage 3) and the per-element optimizer state (stages 1-3) of a
``"full"`` checkpoint live in shards. Instead of gathering them first, the checkpoint dict holds
:class:`Streamed` stand-ins (shape and dtype, no data) for those tensors. Saving writes the file in
``torch.save``'s zip format: rank 0 pickles the dict (each stand-in pickles as a tensor whose
storage record comes later), then every rank walks the same list of (flat space, what) pairs in
the same order: the shards of that space are gathered to rank 0, which writes one storage record
per parameter and frees the space before the next. Rank 0's peak is one flat space (a bucket or a
unit) of one kind of state; the others send their shards and hold nothing more. The result is an
ordinary ``torch.save`` file: ``torch.load`` (memory-mapped or not) and a plain
``LightningModule.load_from_checkpoint`` read it unchanged.
"""

from __future__ import annotations

import collections
import io
import pickle
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.serialization import _open_zipfile_writer
from torch.utils._pytree import tree_map_only

from lightning_zero.comm import Communicator
from lightning_zero.zero.flat_param import FlatParameter


class Source(NamedTuple):
    """Where a streamed tensor's values come from."""

    space: int  # index into the flat spaces of the stream
    position: int  # the parameter's position in that space
    state: tuple[int, str] | None  # None: the parameter's value; (optimizer index, state name)


class Streamed(Tensor):
    """A tensor of a full checkpoint that lives in shards (see [Note: streamed full checkpoints]):
    shape and dtype, no data. Saving writes it while it is gathered. Used as a tensor (an
    ``on_save_checkpoint`` hook that casts ``checkpoint["state_dict"]`` to half, ``.clone()``,
    ``.detach()``), it gathers its values first through ``resolve``: a collective, so every rank
    runs the code that uses it, as every rank runs Lightning's checkpoint hooks."""

    source: Source
    resolve: Callable[[Source], Tensor] | None

    @staticmethod
    def __new__(
        cls,
        source: Source,
        shape: torch.Size,
        dtype: torch.dtype,
        resolve: Callable[[Source], Tensor] | None = None,
    ) -> Streamed:
        out = Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=dtype, device="cpu")
        out.source = source
        out.resolve = resolve
        return out

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        args, kwargs = tree_map_only(Streamed, _value, (args, kwargs or {}))
        return func(*args, **kwargs)

    def __reduce_ex__(self, protocol: int) -> tuple:
        stride = _contiguous_stride(self.shape)
        return torch._utils._rebuild_tensor_v2, (
            _Record(self),
            0,
            self.shape,
            stride,
            False,
            collections.OrderedDict(),
        )

    def __repr__(self, *args: Any, **kwargs: Any) -> str:
        return f"Streamed({tuple(self.shape)}, {self.dtype}, {self.source})"


def _value(streamed: Streamed) -> Tensor:
    if streamed.resolve is None:
        raise RuntimeError(
            f"{streamed!r} stands in a checkpoint for a tensor that lives in shards and has no way to gather it "
            "here; read full values with strategy.full_state_dict()"
        )
    return streamed.resolve(streamed.source)


class Resolver:
    """Gathers the values :class:`Streamed` tensors stand in for when user code computes with them;
    the last flat space gathered is kept, so a walk over a state dict gathers each space once.

    Args:
        gather: (space, what) -> the padded flat values (1D) of one space and kind of state, on
            every rank.
        spaces: the flat spaces the sources index.
    """

    def __init__(
        self, gather: Callable[[int, tuple[int, str] | None], Tensor], spaces: list[FlatParameter]
    ) -> None:
        self.gather = gather
        self.spaces = spaces
        self._kept: tuple[tuple[int, Any], Tensor] | None = None  # ((space, what), its padded flat values)

    def __call__(self, source: Source) -> Tensor:
        key = (source.space, source.state)
        if self._kept is None or self._kept[0] != key:
            self._kept = None  # freed before the next gather
            self._kept = (key, self.gather(source.space, source.state))
        space = self.spaces[source.space]
        return space.value_of(self._kept[1], source.position).to("cpu", copy=True)


class _Record:
    """The storage of a :class:`Streamed`, as the pickler sees it."""

    __slots__ = ("streamed",)

    def __init__(self, streamed: Streamed) -> None:
        self.streamed = streamed


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


def contains_streamed(obj: Any) -> bool:
    return any(isinstance(x, Streamed) for x in _walk(obj))


def _walk(obj: Any) -> Iterator[Any]:
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _walk(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _walk(v)
    else:
        yield obj


class _Pickler(pickle.Pickler):
    """``torch.save``'s pickling: storages go to records by key; a Streamed's record comes later."""

    def __init__(self, file: Any) -> None:
        super().__init__(file, protocol=2)
        self.storages: dict[str, Any] = {}  # key -> storage written right after data.pkl
        self.streamed: dict[Source, tuple[str, int]] = {}  # source -> (key, bytes)
        self._keys: dict[Any, str] = {}  # storage identity -> key

    def _key(self, identity: Any) -> str:
        return self._keys.setdefault(identity, str(len(self._keys)))

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Record):
            s = obj.streamed
            key = self._key(("streamed", s.source))
            numel = s.shape.numel()
            self.streamed[s.source] = (key, numel * _itemsize(s.dtype))
            return ("storage", _storage_type(s.dtype), key, "cpu", numel)
        if isinstance(obj, torch.storage.TypedStorage):
            storage = obj._untyped_storage
            key = self._key(storage._cdata)
            self.storages[key] = storage
            return (
                "storage",
                getattr(torch, obj._pickle_storage_type()),
                key,
                "cpu",  # written from host memory (see write): loads onto the CPU wherever it was saved
                obj._size(),
            )
        return None


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _storage_type(dtype: torch.dtype) -> Any:
    return getattr(torch, torch.storage._dtype_to_storage_type_map()[dtype])


def plan(obj: Any) -> list[tuple[int, tuple[int, str] | None]]:
    """The (flat space, what) pairs the streamed tensors of ``obj`` need, in the order of the walk."""
    seen = {(x.source.space, x.source.state) for x in _walk(obj) if isinstance(x, Streamed)}
    return sorted(seen, key=lambda item: (item[0], item[1] is not None, item[1] or ()))


Gatherer = Callable[[int, "tuple[int, str] | None"], "Tensor | None"]  # (space, what) -> full flat on rank 0


def write(
    checkpoint: Any,
    path: Path,
    comm: Communicator,
    spaces: list[FlatParameter],
    gather: Gatherer,
    items: list,
) -> None:
    """Write ``checkpoint`` to ``path`` (rank 0), gathering each of ``items`` in turn. Every rank
    calls it with the same ``items``; ``gather`` returns the padded flat values (1D) of one space
    and kind of state, on rank 0 only."""
    if comm.rank != 0:
        for space, what in items:
            gather(space, what)
        return
    with _open_zipfile_writer(str(path)) as opened:
        writer = opened
        pickler = _dump(writer, checkpoint)
        for key, storage in pickler.storages.items():
            cpu = storage.cpu() if storage.device.type != "cpu" else storage
            writer.write_record(f"data/{key}", cpu, cpu.nbytes())
        for space, what in items:
            full = gather(space, what)
            for source, (key, nbytes) in pickler.streamed.items():
                if source.space == space and source.state == what:
                    value = spaces[space].value_of(full, source.position).reshape(-1)
                    value = value.to("cpu", copy=True)  # a storage of its own
                    writer.write_record(f"data/{key}", value.untyped_storage(), nbytes)
            del full


def _dump(writer: Any, checkpoint: Any) -> _Pickler:
    buffer = io.BytesIO()
    pickler = _Pickler(buffer)
    pickler.dump(checkpoint)
    data = buffer.getvalue()
    writer.write_record("data.pkl", data, len(data))
    writer.write_record(".format_version", "1", 1)
    alignment = str(torch.serialization._get_storage_alignment())
    writer.write_record(".storage_alignment", alignment, len(alignment))
    writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))
    return pickler

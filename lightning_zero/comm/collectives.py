"""The only place in the package that calls torch.distributed.

Every collective goes through a :class:`Communicator`, which records it in the ledger (see
[Note: logical bytes] in ``ledger.py``) and names it for the profiler, so that a trace shows
``zero0/all_reduce/bucket=2`` instead of an anonymous ``gloo:all_reduce``.

With a world size of 1 (or no process group) every collective is a no-op that completes at once
and nothing is recorded: one process has nobody to talk to.
"""

from __future__ import annotations

import atexit
import functools
import pickle
import time
import warnings
from collections.abc import Generator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero.comm.ledger import CommLedger

# torch 2.13 renamed the flat-tensor collectives; older releases only have the former names
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Handle:
    """An issued collective; ``wait()`` blocks until its result is in the output tensor.

    The time a caller spends blocked in ``wait()`` is communication that computation did not
    hide (exposed communication); it is added to the ledger under the collective's op.
    """

    def __init__(self, work: Any | None = None, ledger: CommLedger | None = None, op: str = "") -> None:
        self._work = work  # torch Work object, None when the collective was a no-op
        self._ledger = ledger  # where the blocked time goes
        self._op = op  # the collective's op, the ledger's key for it

    def wait(self) -> None:
        if self._work is not None:
            start = time.perf_counter()
            self._work.wait()
            if self._ledger is not None:
                self._ledger.add_wait(self._op, time.perf_counter() - start)
            self._work = None

    @property
    def done(self) -> bool:
        return self._work is None


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@functools.cache
def _destroy_at_exit() -> None:
    """Tear the process group down before the interpreter exits.

    A gloo group left alive at exit can abort the process ("terminate called without an active
    exception") while its worker threads are destroyed; Lightning only registers this clean-up for
    NCCL. Registered once, by the first Communicator.
    """

    def destroy() -> None:
        if is_distributed():
            dist.destroy_process_group()

    atexit.register(destroy)


class Communicator:
    """Collectives over one process group, recorded in a :class:`CommLedger`.

    Args:
        group: the process group; ``None`` means the default (world) group.
        ledger: where every collective is recorded; a fresh one when not given.
    """

    def __init__(self, group: Any | None = None, ledger: CommLedger | None = None) -> None:
        self.group = group  # torch ProcessGroup or None for WORLD
        self.ledger = ledger if ledger is not None else CommLedger()  # record of every collective
        self.world_size = dist.get_world_size(group) if is_distributed() else 1  # N
        self.rank = dist.get_rank(group) if is_distributed() else 0  # this rank within the group
        if is_distributed():
            _destroy_at_exit()

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def _issue(self, op: str, name: str, payload_bytes: int, launch: Any) -> Handle:
        if not self.active:
            return Handle()
        self.ledger.record(op, name, payload_bytes, self.world_size)
        with torch.profiler.record_function(name):
            return Handle(launch(), self.ledger, op)

    def all_reduce(self, tensor: Tensor, *, name: str, async_op: bool = True) -> Handle:
        """Sum ``tensor`` in place across ranks."""
        nbytes = tensor.numel() * tensor.element_size()
        handle = self._issue(
            "all_reduce", name, nbytes, lambda: dist.all_reduce(tensor, group=self.group, async_op=True)
        )
        if not async_op:
            handle.wait()
        return handle

    def reduce_scatter(self, output: Tensor, input: Tensor, *, name: str, async_op: bool = True) -> Handle:
        """Sum ``input`` (1D, N x shard) across ranks; rank r receives chunk r in ``output``."""
        nbytes = input.numel() * input.element_size()
        handle = self._issue(
            "reduce_scatter",
            name,
            nbytes,
            lambda: _REDUCE_SCATTER(output, input, group=self.group, async_op=True),
        )
        if not self.active:
            output.copy_(input)
        if not async_op:
            handle.wait()
        return handle

    def all_gather(self, output: Tensor, input: Tensor, *, name: str, async_op: bool = True) -> Handle:
        """Concatenate every rank's ``input`` shard into ``output`` (1D, N x shard)."""
        nbytes = output.numel() * output.element_size()
        handle = self._issue(
            "all_gather",
            name,
            nbytes,
            lambda: _ALL_GATHER(output, input, group=self.group, async_op=True),
        )
        if not self.active:
            output.copy_(input)
        if not async_op:
            handle.wait()
        return handle

    def broadcast(self, tensor: Tensor, *, src: int = 0, name: str) -> None:
        """Overwrite ``tensor`` on every rank with rank ``src``'s value (synchronous)."""
        nbytes = tensor.numel() * tensor.element_size()
        src_global = dist.get_global_rank(self.group, src) if self.group is not None else src
        self._issue(
            "broadcast",
            name,
            nbytes,
            lambda: dist.broadcast(tensor, src_global, group=self.group, async_op=True),
        ).wait()

    def broadcast_tensors(self, tensors: Sequence[Tensor], *, src: int = 0, name: str) -> None:
        """Broadcast many tensors with one collective per (dtype, device), coalesced in a flat copy."""
        for group in _group_by_dtype_device(tensors):
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            self.broadcast(flat, src=src, name=name)
            offset = 0
            for t in group:
                t.detach().copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def broadcast_object(self, obj: Any, *, src: int = 0, name: str, device: torch.device) -> Any:
        """Rank ``src``'s picklable ``obj`` on every rank."""
        if not self.active:
            return obj
        data = pickle.dumps(obj) if self.rank == src else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
        self.broadcast(size, src=src, name=f"{name}/size")
        buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
        if self.rank == src:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.broadcast(buf, src=src, name=name)
        return pickle.loads(buf.cpu().numpy().tobytes())

    # -- checkpoints -----------------------------------------------------------------------------

    def _record_unmodelled(self, op: str, name: str, payload_bytes: int, wire: float) -> None:
        """Record an op outside the ledger's ring model (gather, barrier) with its own wire bytes."""
        self.ledger.record(op, name, payload_bytes, self.world_size, wire=wire)

    def gather(self, output: Tensor | None, input: Tensor, *, dst: int = 0, name: str) -> None:
        """Every rank's ``input`` (1D, one shard) concatenated into ``output`` (1D, N x shard) on rank
        ``dst`` only; the other ranks pass ``output=None`` and receive nothing (synchronous).

        Recorded with ``wire_bytes`` = one shard: what each rank but ``dst`` sends.
        """
        if not self.active:
            output.copy_(input)
            return
        nbytes = input.numel() * input.element_size()
        self._record_unmodelled("gather", name, nbytes * self.world_size, float(nbytes))
        chunks = list(output.chunk(self.world_size)) if self.rank == dst else None
        dst_global = dist.get_global_rank(self.group, dst) if self.group is not None else dst
        with torch.profiler.record_function(name):
            work = dist.gather(input, chunks, dst=dst_global, group=self.group, async_op=True)
        Handle(work, self.ledger, "gather").wait()

    def barrier(self, *, name: str) -> None:
        """Return once every rank of the group has arrived here."""
        if not self.active:
            return
        self._record_unmodelled("barrier", name, 0, 0.0)
        with torch.profiler.record_function(name):
            if dist.get_backend(self.group) == "nccl":
                dist.barrier(group=self.group, device_ids=[torch.cuda.current_device()])
            else:
                dist.barrier(group=self.group)

    def save_checkpoint_items(
        self, state_dict: dict[str, Any], writer: Any, planner: Any, *, name: str, local: bool = False
    ) -> None:
        """``torch.distributed.checkpoint.save``: every rank writes its own items in parallel, the
        coordinator (rank 0) writes the metadata once all have written (a collective, unless
        ``local``). DCP's small planning collectives carry plans, not tensors: not in the ledger.
        """
        from torch.distributed import checkpoint as dcp

        with self._dcp_call(name, local) as no_dist:
            dcp.save(
                state_dict, storage_writer=writer, planner=planner, process_group=self.group, no_dist=no_dist
            )

    def load_checkpoint_items(
        self, state_dict: dict[str, Any], reader: Any, planner: Any, *, name: str, local: bool = False
    ) -> None:
        """``torch.distributed.checkpoint.load`` into ``state_dict``'s tensors, in place: each rank
        reads only the chunks its items overlap (a collective, unless ``local``)."""
        from torch.distributed import checkpoint as dcp

        with self._dcp_call(name, local) as no_dist:
            dcp.load(
                state_dict, storage_reader=reader, planner=planner, process_group=self.group, no_dist=no_dist
            )

    @contextmanager
    def _dcp_call(self, name: str, local: bool) -> Generator[bool, None, None]:
        """Around a DCP save or load: named for the profiler; yields DCP's ``no_dist``."""
        with torch.profiler.record_function(name), warnings.catch_warnings():
            # one process on purpose: DCP's warning that it assumes so says nothing new
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            yield local or not is_distributed() or not self.active


def _group_by_dtype_device(tensors: Sequence[Tensor]) -> list[list[Tensor]]:
    groups: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return list(groups.values())

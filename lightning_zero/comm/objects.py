"""A Communicator's control collectives and checkpoint I/O: objects, agreements, gathers to one
rank, barriers and torch.distributed.checkpoint's save and load, each numbered, checked and
explained like the collectives on tensors (agreements and object exchanges counted apart in the
ledger: see [Note: bounded ledger] in ``ledger.py``)."""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Generator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero.comm.checks import DIGEST, FLAGS, signature
from lightning_zero.comm.faults import StoreUnreachable, looks_like_comm_error
from lightning_zero.comm.lent import lend
from lightning_zero.comm.tracker import Issued
from lightning_zero.comm.waiting import Handle


class ObjectCollectives:
    """Part of a :class:`Communicator`: what it exchanges besides tensors of the training step."""

    def broadcast_tensors(self, tensors: Sequence[Tensor], *, src: int = 0, name: str) -> None:
        """Broadcast many tensors with one collective per (dtype, device), coalesced in a flat copy."""
        for group in _group_by_dtype_device(tensors):
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            self.broadcast(flat, src=src, name=name)
            offset = 0
            for t in group:
                t.detach().copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def broadcast_object(
        self, obj: Any, *, src: int = 0, name: str, device: torch.device, control: bool = False
    ) -> Any:
        """Rank ``src``'s picklable ``obj`` on every rank (``control``: counted apart in the ledger)."""
        if not self.active:
            return obj
        data = pickle.dumps(obj) if self.rank == src else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
        self.broadcast(size, src=src, name=f"{name}/size", control=control)
        buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
        if self.rank == src:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.broadcast(buf, src=src, name=name, control=control)
        return pickle.loads(buf.cpu().numpy().tobytes())

    def agree(self, flags: int, *, name: str, device: torch.device) -> list[int]:
        """Every rank's ``flags`` on every rank: one AllReduce of a host table of N rows on the side
        group (each rank fills its row), which also checks that the ranks are in step (see [Note:
        checked issue]); before ``watch_faults``, N int64 on ``device`` over the main group."""
        if not self.active:
            return [flags]
        if self.side is not None:
            self._check_can_issue(name)
            nbytes = self.side.table.numel() * self.side.table.element_size()
            self.ledger.record_control(nbytes, self.world_size)
            world = self._root is self  # the digest covers every group's collectives: the world's agreement
            digest, since = (self.tracker.digest, self.tracker.since) if world else (0, [])
            issued = self.tracker.issue("agree", name, nbytes)
            self._post_if_unexpected(issued)
            with torch.profiler.record_function(name):
                rows = self._exchange(issued, flags, digest)
            if self.check_issue:
                self.schedule.checked(signature(issued), expectable=False)
            if world:
                self.tracker.agreed()
                if len({row[DIGEST] for row in rows}) > 1:
                    self._stop_for_digests(issued, since)
            return [row[FLAGS] for row in rows]
        table = torch.zeros(self.world_size, dtype=torch.int64, device=device)
        table[self.rank] = flags
        launch = lambda: dist.all_reduce(table, group=self.group, async_op=True)  # noqa: E731
        nbytes = table.numel() * table.element_size()
        self._issue("agree", name, nbytes, launch, control=True, lent=(table,)).wait()
        return table.tolist()

    def _post_if_unexpected(self, issued: Issued) -> None:
        """An agreement where the learned schedule expected another collective (a rank that skipped
        its optimizer step, and with it the step's all-gathers): posted as a deviation, so that
        ranks waiting in the expected collective, unchecked, stop within a wait slice (see [Note:
        learned schedule] in checks.py) instead of at the watchdog."""
        if not self.check_issue or self.board is None:
            return
        expected = self.schedule.expected()
        if expected is not None and expected != signature(issued):
            try:
                self.board.post_deviation(issued)
            except StoreUnreachable:
                pass

    def all_gather_object(self, obj: Any, *, name: str) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order, on every rank (synchronous)."""
        if not self.active:
            return [obj]
        self._check_can_issue(name)
        self.ledger.record_control(0, self.world_size)
        issued = self.tracker.issue("agree", name, 0)
        self._check(issued)
        out: list[Any] = [None] * self.world_size
        with self.tracker.blocked_in(issued), torch.profiler.record_function(name):
            try:
                dist.all_gather_object(out, obj, group=self.group)
            except Exception as err:
                explained = self.explain(err, issued)
                if explained is None:
                    raise
                raise explained from err
        return out

    # -- checkpoints -----------------------------------------------------------------------------

    def _issue_unmodelled(
        self,
        op: str,
        name: str,
        payload_bytes: int,
        wire: float,
        launch: Any,
        device: torch.device | None,
        lent: tuple[Tensor, ...] = (),
    ) -> Handle:
        """An op outside the ledger's ring model (gather, barrier), recorded with its own wire bytes;
        ``device``: where its tensors live (None: none, a barrier), which decides how its wait is timed."""
        self._check_can_issue(name)
        self.ledger.record(op, name, payload_bytes, self.world_size, wire=wire, link=self.link)
        issued = self.tracker.issue(op, name, payload_bytes)
        self._check(issued, timed_as=op, expectable=True)
        with torch.profiler.record_function(name):
            work = launch()
        self.tracker.launched(issued, work)
        return Handle(work, self, op, issued, device, lent)

    def gather(self, output: Tensor | None, input: Tensor, *, dst: int = 0, name: str) -> None:
        """Every rank's ``input`` (1D, one shard) concatenated into ``output`` (1D, N x shard) on rank
        ``dst`` only; the other ranks pass ``output=None`` and receive nothing (synchronous).

        Recorded with ``wire_bytes`` = one shard: what each rank but ``dst`` sends.
        """
        if not self.active:
            output.copy_(input)
            return
        nbytes = input.numel() * input.element_size()
        chunks = [lend(c) for c in output.chunk(self.world_size)] if self.rank == dst else None
        dst_global = dist.get_global_rank(self.group, dst) if self.group is not None else dst
        lent = lend(input)
        launch = lambda: dist.gather(lent, chunks, dst=dst_global, group=self.group, async_op=True)  # noqa: E731
        self._issue_unmodelled(
            "gather",
            name,
            nbytes * self.world_size,
            float(nbytes),
            launch,
            input.device,
            (lent, *(chunks or ())),
        ).wait()

    def barrier(self, *, name: str, control: bool = False) -> None:
        """Return once every rank of the group has arrived here (``control``: counted apart)."""
        if not self.active:
            return
        nccl = dist.get_backend(self.group) == "nccl"
        device_ids = [torch.cuda.current_device()] if nccl else None
        launch = lambda: dist.barrier(group=self.group, async_op=True, device_ids=device_ids)  # noqa: E731
        if control:
            self._issue("barrier", name, 0, launch, control=True).wait()
        else:
            self._issue_unmodelled(
                "barrier", name, 0, 0.0, launch, None
            ).wait()  # blocks the host, also on NCCL

    def save_checkpoint_items(
        self, state_dict: dict[str, Any], writer: Any, planner: Any, *, name: str, local: bool = False
    ) -> Any:
        """``torch.distributed.checkpoint.save``: every rank writes its own items in parallel, the
        coordinator (rank 0) writes the metadata once all have written (a collective, unless
        ``local``). DCP's small planning collectives carry plans, not tensors: not in the ledger.
        Returns DCP's Metadata of the whole checkpoint (every rank gets it).
        """
        from torch.distributed import checkpoint as dcp

        with self._dcp_call(name, local) as no_dist:
            return dcp.save(
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
        """Around a DCP save or load: named for the profiler, tracked as one collective (its inner
        collectives are DCP's own), a peer's failure explained; yields DCP's ``no_dist``."""
        no_dist = local or not dist.is_initialized() or not self.active
        if not no_dist:
            self._check_can_issue(name)
        issued = None if no_dist else self.tracker.issue("checkpoint", name, 0)
        if issued is not None:
            self._check(issued)
        with torch.profiler.record_function(name), warnings.catch_warnings(), self.tracker.blocked_in(issued):
            # one process on purpose: DCP's warning that it assumes so says nothing new
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            try:
                yield no_dist
            except Exception as err:
                if no_dist or not looks_like_comm_error(err):
                    raise  # this rank's own (a full disk, a bad path): as it is
                explained = self.explain(err, issued)
                if explained is None:
                    raise
                raise explained from err


def _group_by_dtype_device(tensors: Sequence[Tensor]) -> list[list[Tensor]]:
    groups: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return list(groups.values())

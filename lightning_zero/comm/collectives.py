"""The only place in the package that calls torch.distributed.

Every collective goes through a :class:`Communicator`, which records it in the ledger (see
[Note: logical bytes] in ``ledger.py``) and names it for the profiler, so that a trace shows
``zero0/all_reduce/bucket=2`` instead of an anonymous ``gloo:all_reduce``. Its concerns live
beside it: waiting without hanging (``waiting.py``), the check before a collective
(``guard.py``), control collectives and checkpoint I/O (``objects.py``), the fault board
(``faults.py``), what the backend is lent (``lent.py``).

With a world size of 1 (or no process group) every collective is a no-op that completes at once
and nothing is recorded: one process has nobody to talk to.

After a failure a process must not tear the group down: gloo joins its worker threads, which
wait for collectives that will never complete (until the group's timeout, 30 minutes by
default). A Communicator that failed (or that the strategy marked failed) therefore makes the
process leave at exit without destroying the group (status 1, logs flushed), and any further
collective on it raises at once instead of waiting ([Note: waiting without hanging] in
``waiting.py``).
"""

from __future__ import annotations

import atexit
import functools
import logging
import multiprocessing.util
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero.comm.checks import Schedule, SideGroup
from lightning_zero.comm.faults import (
    CollectivesStopped,
    FaultBoard,
    Liveness,
    RankInfo,
    StoreUnreachable,
    leave_without_destroying,
    looks_like_comm_error,
    process_exists,
    this_process,
)
from lightning_zero.comm.guard import CheckedIssue
from lightning_zero.comm.inplace import (
    all_gather_in_place,
    all_reduce_for_scatter,
    chunk_of,
    copies_in_backend,
    reduce_scatter_by_exchange,
    same_tensor,
)
from lightning_zero.comm.ledger import CommLedger
from lightning_zero.comm.lent import LENT, lend
from lightning_zero.comm.objects import ObjectCollectives
from lightning_zero.comm.tracker import CollectiveTracker
from lightning_zero.comm.waiting import POLL_S, Handle, Waits

__all__ = [
    "POLL_S",
    "CollectivesStopped",
    "Communicator",
    "Handle",
    "is_distributed",
    "looks_like_comm_error",
]

# torch 2.13 renamed the flat-tensor collectives; older releases only have the former names
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
STALL_FACTOR, MIN_STALL_S = 3, 10.0  # a heartbeat still for max(3 x fault_wait_s, 10 s): a lost rank
_FAILED: dict[str, Any] = {"group": None, "comm": None}  # the group and Communicator this process failed in

log = logging.getLogger(__name__)


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@functools.cache
def _destroy_at_exit() -> None:
    """Tear the process group down before the interpreter exits.

    A gloo group left alive at exit can abort the process ("terminate called without an active
    exception") while its worker threads are destroyed; Lightning only registers this clean-up for
    NCCL. First the backend gives back what it holds (see [Note: tensors lent to the backend] in
    lent.py). Registered once, by the first Communicator, with ``atexit`` and as a multiprocessing
    finalizer: a rank started by fork ends with ``os._exit`` after multiprocessing's finalizers,
    without ``atexit``, and rank 0 must still linger for its peers after a failure. The finalizer's
    priority (0) lets multiprocessing's queues flush first (the launcher's results).
    """
    done: list[bool] = []

    def destroy() -> None:
        if done:
            return
        done.append(True)
        LENT.drain()  # see [Note: tensors lent to the backend] in lent.py
        if not is_distributed():
            return
        failed = _FAILED["comm"]
        if failed is not None and _FAILED["group"] is dist.group.WORLD:
            failed.linger_for_peers()
            leave_without_destroying()  # see [Note: waiting without hanging] in waiting.py
        dist.destroy_process_group()

    atexit.register(destroy)
    multiprocessing.util.Finalize(None, destroy, exitpriority=0)


_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}


class Shared:
    """What every communicator of this process shares, whichever group it runs in (see [Note:
    hybrid comms]): one ledger, one numbering of collectives, one fault board and liveness watch,
    one failure state. Subgroup communicators hold the world's, not a copy."""

    def __init__(self, ledger: CommLedger, me: int) -> None:
        self.ledger = ledger  # record of every collective
        self.tracker = CollectiveTracker()  # sequence numbers; the collective this rank is blocked in
        self.board: FaultBoard | None = None  # faults in the store, once watch_faults() ran
        self.ranks: list[RankInfo] = [this_process(me)]  # every rank's host and pid
        self.liveness: Liveness | None = None  # dead peers, while this rank waits (watch_faults)
        self.fault_wait_s = 3.0  # how long a failed collective waits for the failing rank's message
        self.failure: BaseException | None = None  # what this rank failed with; no collective after it
        self.published = False  # this rank wrote its failure to the board (faults.publish)
        self.stop_reason: str | None = None  # set by the watchdog: the ranks are out of step for good
        self.on_poll: Callable[[], None] | None = None  # the watchdog's check, between two wait slices


def _shared(name: str) -> property:
    """An attribute of the process's :class:`Shared`, read and set through any of its communicators."""
    return property(lambda self: getattr(self.shared, name), lambda self, v: setattr(self.shared, name, v))


def _named_in_profile(name: str) -> Any:
    """A profiler range named ``name`` while a profiler records (torch.profiler, ProfileSteps);
    nothing otherwise: entering one costs a RecordFunction per collective on the hot path."""
    return torch.profiler.record_function(name) if torch.autograd._profiler_enabled() else nullcontext()


class Communicator(Waits, CheckedIssue, ObjectCollectives):
    """Collectives over one process group, recorded in a :class:`CommLedger`.

    Args:
        group: the process group; ``None`` means the default (world) group.
        ledger: where every collective is recorded; a fresh one when not given.
    """

    ledger = _shared("ledger")
    tracker = _shared("tracker")
    board = _shared("board")
    ranks = _shared("ranks")
    liveness = _shared("liveness")
    fault_wait_s = _shared("fault_wait_s")
    failure = _shared("failure")
    published = _shared("published")
    stop_reason = _shared("stop_reason")
    on_poll = _shared("on_poll")

    def __init__(
        self, group: Any | None = None, ledger: CommLedger | None = None, *, shared: Shared | None = None
    ):
        self._root = self  # the world's communicator (a subgroup's: see _GroupCommunicator)
        self.group = group  # torch ProcessGroup or None for WORLD
        self.world_size = dist.get_world_size(group) if is_distributed() else 1  # N
        self.rank = dist.get_rank(group) if is_distributed() else 0  # this rank within the group
        self.global_rank = dist.get_rank() if is_distributed() else 0  # this rank in the world
        self.me = dist.get_rank() if is_distributed() else 0  # this rank in the world (faults, board)
        self.shared = shared if shared is not None else Shared(ledger or CommLedger(), self.me)
        self.members = (  # the world ranks of the group, in group order
            dist.get_process_group_ranks(group)
            if is_distributed() and group is not None
            else list(range(self.world_size))
        )
        self.link = "intra"  # the link its collectives cross, for the ledger ([Note: links] in ledger.py)
        self.mean_over = self.world_size  # ranks whose gradients make one mean (hybrid: the world)
        self.replicate: Communicator | None = None  # hybrid sharding: the replicate group (see subgroup)
        self.secondary: Communicator | None = None  # stage 3's secondary shards ([Note: secondary shards])
        self._blocking_waits = is_distributed() and dist.get_backend(group) != "nccl"  # gloo, mpi, ...
        self.side: SideGroup | None = None  # gloo group for host tables (watch_faults); see checks.py
        # gloo: every collective checked before it is issued ([Note: checked issue] in checks.py)
        self.check_issue = self._blocking_waits
        self.schedule = Schedule()  # the collectives expected without a check ([Note: learned schedule])
        if is_distributed():
            _destroy_at_exit()

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @property
    def world(self) -> Communicator:
        """The communicator of every rank (itself, but for a subgroup's; see [Note: hybrid comms])."""
        return self._root

    def subgroup(self, group: Any, *, link: str) -> Communicator:
        """A communicator over ``group`` (a subgroup of this world's ranks) for hybrid sharding.

        [Note: hybrid comms]
        The engines of hybrid sharding shard over a shard group and all-reduce over a replicate
        group ([Note: shard groups and replicate groups] in ``mesh.py``). Their communicators share
        the world's ledger, tracker, fault board, liveness watch and failure state (one
        :class:`Shared`): every rank issues the same collectives in the same order, whichever group
        each runs in, so one sequence of numbers per process still describes it. Collectives on
        tensors run in the group, checked among its members (a side group of its own); agreements,
        broadcasts and checkpoint I/O (objects, barriers, DCP) run in the world, so that every group
        takes the same decision. ``rank`` and ``world_size`` are the group's, ``me`` the world rank
        that faults are filed under. Collective: every rank calls it, in the same order.
        """
        return _GroupCommunicator(self._root, group, link)

    def watch_faults(self, *, fault_wait_s: float = 3.0) -> None:
        """Exchange every rank's host and pid (a collective, once), open the fault board in the
        process group's store (see [Note: failures travel through the store]) and create the host
        side group (collectively, once; see [Note: checked issue] in ``checks.py``)."""
        if not self.active or self.board is not None:
            return
        self.fault_wait_s = fault_wait_s
        store = dist.distributed_c10d._get_default_store()  # the store every rank reached at init
        board = FaultBoard.open(store, self.rank, self.world_size)
        self.ranks = self.all_gather_object(this_process(self.rank), name="faults/ranks")  # all opened
        self.board = board
        self.liveness = self.new_liveness()
        if self.side is None:
            self.side = SideGroup.create(self.group, self.world_size)

    def new_liveness(self) -> Liveness:
        """A watch on dead peers: heartbeats still for max(3 x fault_wait_s, 10 s) mean gone."""
        stall_s = max(STALL_FACTOR * self.fault_wait_s, MIN_STALL_S)
        return Liveness(self.board, self.ranks, self.rank, stall_s)

    def mark_failed(self, error: BaseException) -> None:
        """This rank fails: no collective after this; the process leaves without destroying the group."""
        if self.failure is None:
            self.failure = error
        if is_distributed() and dist.get_world_size() > 1:  # alone, no peer can be left waiting
            _FAILED["group"], _FAILED["comm"] = dist.group.WORLD, self

    def linger_for_peers(self) -> None:
        """Rank 0 hosts the store: before it leaves after a failure, give the other ranks
        ``fault_wait_s`` (and two poll slices) to read the board, until each has noted itself or
        published a fault (a rank known dead is not waited for)."""
        if self.board is None or self.rank != 0:
            return
        deadline = time.monotonic() + self.fault_wait_s + 2 * POLL_S
        others = {i.rank for i in self.ranks[1:] if process_exists(i) is not False}
        try:
            while time.monotonic() < deadline:
                if others <= self.board.noted() | {f.rank for f in self.board.faults()}:
                    return
                time.sleep(0.1)
        except StoreUnreachable:
            return

    def _issue(
        self,
        op: str,
        name: str,
        payload_bytes: int,
        launch: Any,
        *,
        device: torch.device | None = None,
        control: bool = False,
        lent: tuple[Tensor, ...] = (),
    ) -> Handle:
        if not self.active:
            return Handle()
        self._check_can_issue(name)
        if control:
            self.ledger.record_control(payload_bytes, self.world_size)
        else:
            self.ledger.record(op, name, payload_bytes, self.world_size, link=self.link)
        issued = self.tracker.issue(op, name, payload_bytes)
        self._check(issued, timed_as=None if control else op, expectable=not control)
        with _named_in_profile(name):
            work = launch()  # an error here is this rank's own (a bad argument): raised as it is
        self.tracker.launched(issued, work)
        return Handle(work, self, None if control else op, issued, device, lent)

    def all_reduce(self, tensor: Tensor, *, name: str, async_op: bool = True, op: str = "sum") -> Handle:
        """Reduce ``tensor`` in place across ranks: ``op`` is "sum" (the default), "max" or "min"."""
        nbytes = tensor.numel() * tensor.element_size()
        reduce_op = _REDUCE_OPS[op]
        lent = lend(tensor)
        launch = lambda: dist.all_reduce(lent, op=reduce_op, group=self.group, async_op=True)  # noqa: E731
        handle = self._issue("all_reduce", name, nbytes, launch, device=tensor.device, lent=(lent,))
        if not async_op:
            handle.wait()
        return handle

    def probe_all_reduce(self, tensor: Tensor, *, name: str) -> None:
        """A synchronous all-reduce counted apart from the ZeRO traffic, as a control collective (the
        link probes of ``shard_size="auto"``, comm/mesh.py)."""
        lent = lend(tensor)
        launch = lambda: dist.all_reduce(lent, group=self.group, async_op=True)  # noqa: E731
        nbytes = tensor.numel() * tensor.element_size()
        self._issue("all_reduce", name, nbytes, launch, control=True, lent=(lent,)).wait()

    def reduce_scatter(
        self, output: Tensor, input: Tensor, *, name: str, async_op: bool = True, scratch_input: bool = False
    ) -> Handle:
        """Sum ``input`` (1D, N x shard) across ranks; rank r receives chunk r in ``output``.
        ``scratch_input``: the caller no longer needs ``input``'s values, so that gloo may reduce
        in it instead of in a copy of it (see [Note: collectives in place] in inplace.py)."""
        nbytes = input.numel() * input.element_size()
        in_place = (
            scratch_input and input.is_contiguous() and self.active and copies_in_backend(input, self.group)
        )
        launch = None
        if in_place:
            own = same_tensor(chunk_of(input, self.rank, self.world_size), output)
            if own:
                launch = all_reduce_for_scatter
            elif output.is_contiguous() and output.dtype == input.dtype:
                launch = reduce_scatter_by_exchange
        return self._flat("reduce_scatter", name, output, input, nbytes, launch, _REDUCE_SCATTER, async_op)

    def all_gather(self, output: Tensor, input: Tensor, *, name: str, async_op: bool = True) -> Handle:
        """Concatenate every rank's ``input`` shard into ``output`` (1D, N x shard); on gloo in
        place (see [Note: collectives in place] in inplace.py)."""
        nbytes = output.numel() * output.element_size()
        in_place = output.is_contiguous() and self.active and copies_in_backend(output, self.group)
        launch = all_gather_in_place if in_place else None
        return self._flat("all_gather", name, output, input, nbytes, launch, _ALL_GATHER, async_op)

    def _flat(
        self,
        op: str,
        name: str,
        output: Tensor,
        input: Tensor,
        nbytes: int,
        in_place: Callable[..., Any] | None,
        backend: Callable[..., Any],
        async_op: bool,
    ) -> Handle:
        """A reduce-scatter or all-gather of flat tensors: ``in_place``'s launch (inplace.py) on gloo,
        else the backend's own collective on private aliases; alone, the input copied over."""
        if in_place is not None:
            where = {"rank": self.rank, "world_size": self.world_size, "group": self.group}
            launch, lent = (lambda: in_place(output, input, **where)), ()  # the in-place work holds its own
        else:
            lent = (lend(output), lend(input))
            launch = lambda: backend(*lent, group=self.group, async_op=True)  # noqa: E731
        handle = self._issue(op, name, nbytes, launch, device=input.device, lent=lent)
        if not self.active:
            output.copy_(input)
        if not async_op:
            handle.wait()
        return handle

    def all_to_all(self, output: Tensor, input: Tensor, *, name: str, op: str = "reduce_scatter") -> Handle:
        """Chunk r of ``input`` (1D, N equal chunks) to rank r; chunk r of ``output`` from rank r.
        Recorded in the ledger as ``op``: the int8 gradient reduction is the reduce-scatter it
        stands for ([Note: quantized communication] in quantize.py), with the bytes it sends."""
        nbytes = input.numel() * input.element_size()
        lent = (lend(output), lend(input))
        launch = lambda: dist.all_to_all_single(*lent, group=self.group, async_op=True)  # noqa: E731
        return self._issue(op, name, nbytes, launch, device=input.device, lent=lent)

    def broadcast(self, tensor: Tensor, *, src: int = 0, name: str, control: bool = False) -> None:
        """Overwrite ``tensor`` on every rank with rank ``src``'s value (synchronous)."""
        nbytes = tensor.numel() * tensor.element_size()
        src_global = dist.get_global_rank(self.group, src) if self.group is not None else src
        lent = lend(tensor)
        self._issue(
            "broadcast",
            name,
            nbytes,
            lambda: dist.broadcast(lent, src_global, group=self.group, async_op=True),
            device=tensor.device,
            control=control,
            lent=(lent,),
        ).wait()


class _GroupCommunicator(Communicator):
    """A subgroup's communicator (see [Note: hybrid comms]): tensor collectives in the group over
    the world's :class:`Shared`; agreements, broadcasts, barriers and checkpoint I/O in the world."""

    def __init__(self, world: Communicator, group: Any, link: str) -> None:
        super().__init__(group, shared=world.shared)
        self._root = world
        self.link = link
        self.mean_over = world.mean_over  # the world's, unless the caller sets another
        self._blocking_waits, self.check_issue = world._blocking_waits, world.check_issue
        self.schedule = Schedule(world.schedule.trust_after)  # the group's own sequence of collectives
        self.side = SideGroup.create(group, self.world_size) if world.side is not None else None

    def broadcast(self, tensor: Tensor, **kwargs: Any) -> None:
        self._root.broadcast(tensor, **kwargs)

    def broadcast_tensors(self, tensors: Sequence[Tensor], **kwargs: Any) -> None:
        self._root.broadcast_tensors(tensors, **kwargs)

    def broadcast_object(self, obj: Any, **kwargs: Any) -> Any:
        return self._root.broadcast_object(obj, **kwargs)

    def agree(self, flags: int, **kwargs: Any) -> list[int]:
        return self._root.agree(flags, **kwargs)

    def all_gather_object(self, obj: Any, **kwargs: Any) -> list[Any]:
        return self._root.all_gather_object(obj, **kwargs)

    def barrier(self, **kwargs: Any) -> None:
        self._root.barrier(**kwargs)

    def save_checkpoint_items(self, *args: Any, **kwargs: Any) -> Any:
        return self._root.save_checkpoint_items(*args, **kwargs)

    def load_checkpoint_items(self, *args: Any, **kwargs: Any) -> None:
        self._root.load_checkpoint_items(*args, **kwargs)

    def tracked(self, name: str) -> Any:
        return self._root.tracked(name)

    def watch_faults(self, **kwargs: Any) -> None:
        self._root.watch_faults(**kwargs)

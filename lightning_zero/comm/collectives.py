"""The only place in the package that calls torch.distributed.

Every collective goes through a :class:`Communicator`, which records it in the ledger (see
[Note: logical bytes] in ``ledger.py``) and names it for the profiler, so that a trace shows
``zero0/all_reduce/bucket=2`` instead of an anonymous ``gloo:all_reduce``.

With a world size of 1 (or no process group) every collective is a no-op that completes at once
and nothing is recorded: one process has nobody to talk to.

[Note: waiting without hanging]
Every collective gets a sequence number ([Note: collective sequence numbers] in ``tracker.py``)
and a wait that can end for a reason other than the collective completing. On gloo (any backend
whose ``wait`` blocks the host) ``Handle.wait`` waits in slices of ``POLL_S`` seconds and, between
two slices, reads the fault board: a peer that published an error ([Note: failures travel through
the store] in ``faults.py``) ends the wait at once with that peer's message, as does a desync the
watchdog found (``watchdog.py``), or a peer found dead (its pid on this host, its heartbeat), and a
peer's posted deviation from the collectives every rank expected ([Note: learned schedule] in
``checks.py``) under a number where this rank issued another, which is a desync. Two
quirks of gloo shape the loop: a failed work does not report ``is_completed()`` (the slice's own
"Operation timed out!" tells a running collective from a failed one), and the reduce-scatter's
``wait`` ignores its timeout, so that one waits in a daemon thread (``_Waiter``) while the caller
waits in slices on an event. On NCCL ``wait`` does not block the host (the stream waits), so
the board is read by the watchdog thread instead. A collective that fails is explained from the
board: :class:`PeerFailure` with the failing rank's message, or the ranks that left without one.

After a failure a process must not tear the group down: gloo joins its worker threads, which
wait for collectives that will never complete (until the group's timeout, 30 minutes by
default). A Communicator that failed (or that the strategy marked failed) therefore makes the
process leave at exit without destroying the group (status 1, logs flushed), and any further
collective on it raises at once instead of waiting.
"""

from __future__ import annotations

import atexit
import functools
import logging
import pickle
import queue
import sys
import threading
import time
import warnings
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero.comm.checks import (
    FLAGS,
    Schedule,
    SideGroup,
    desync_report,
    deviation_report,
    elsewhere,
    in_step,
    issued_from_row,
    row_of,
    signature,
)
from lightning_zero.comm.faults import (
    FaultBoard,
    Liveness,
    PeerFailure,
    RankInfo,
    StoreUnreachable,
    fault_message,
    leave_without_destroying,
    lost_message,
    process_exists,
    store_lost_message,
    this_process,
)
from lightning_zero.comm.inplace import (
    Works,
    all_gather_by_broadcasts,
    all_reduce_for_scatter,
    copies_in_backend,
)
from lightning_zero.comm.ledger import CommLedger
from lightning_zero.comm.lent import LENT, lend
from lightning_zero.comm.timing import CUDA_EVENTS, StreamInterval, timing_for
from lightning_zero.comm.tracker import CollectiveTracker, Issued, RankState

# torch 2.13 renamed the flat-tensor collectives; older releases only have the former names
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
POLL_S = 1.0  # slice of a host-blocking wait between two reads of the fault board
SLICE_TIMEOUT = "Operation timed out!"  # what Work.wait(timeout) raises when the slice runs out
STALL_FACTOR, MIN_STALL_S = 3, 10.0  # a heartbeat still for max(3 x fault_wait_s, 10 s): a lost rank
_FAILED: dict[str, Any] = {"group": None, "comm": None}  # the group and Communicator this process failed in

log = logging.getLogger(__name__)


class _Waiting:
    __slots__ = ("work", "done", "error")

    def __init__(self, work: Any) -> None:
        self.work = work  # a torch Work
        self.done = threading.Event()  # set once work.wait() returned or raised
        self.error: BaseException | None = None  # what it raised


class _Waiter:
    """One daemon thread that blocks in ``Work.wait()`` for the works whose timed wait is ignored
    (gloo's reduce-scatter: its work neither times out nor reports a failure through
    ``is_completed``), so that the caller can wait in slices (see [Note: waiting without hanging])."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[_Waiting] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, work: Any) -> _Waiting:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="lightning_zero-waiter", daemon=True)
            self._thread.start()
        waiting = _Waiting(work)
        self._queue.put(waiting)
        return waiting

    def _run(self) -> None:
        while True:
            waiting = self._queue.get()
            try:
                waiting.work.wait()
            except BaseException as err:  # handed to the caller
                waiting.error = err
            finally:
                waiting.work = None  # a work holds its tensors: they are freed with the caller's
                waiting.done.set()
                waiting = None


_WAITER = _Waiter()
_UNTIMED_OPS = ("reduce_scatter",)  # gloo ops whose Work.wait(timeout) blocks past the timeout
# (not when done in place, as an all-reduce: see [Note: collectives in place] in inplace.py)


class CollectivesStopped(RuntimeError):
    """A collective asked for after this rank failed, or while the ranks are out of step."""


class Handle:
    """An issued collective; after ``wait()`` its result is in the output tensor (for CUDA tensors:
    for the kernels queued on the current stream after it).

    The time ``wait()`` holds the caller up is communication that computation did not hide
    (exposed communication); it is added to the ledger under the collective's op (control
    collectives: not at all), timed on the host for CPU tensors and on the CUDA stream for CUDA
    tensors (see [Note: timing a wait] in ``timing.py``). See [Note: waiting without hanging].
    """

    def __init__(
        self,
        work: Any | None = None,
        comm: Communicator | None = None,
        op: str | None = None,
        issued: Issued | None = None,
        device: torch.device | None = None,
        lent: tuple[Tensor, ...] = (),
    ) -> None:
        self._work = work  # torch Work object, None when the collective was a no-op
        self._comm = comm  # waits for it, explains its failure
        self._op = op  # the ledger's key for the blocked time; None: a control collective
        self._issued = issued  # its sequence number, op, name and bytes
        self._device = device  # where its tensors live: decides how the wait is timed
        self._lent = lent  # the aliases it was launched with (see [Note: tensors lent to the backend])

    def wait(self) -> None:
        if self._work is None:
            return
        if self._op is None:  # a control collective: not timed
            self._comm.wait_for(self._work, self._issued)
        elif timing_for(self._device) == CUDA_EVENTS:
            interval = StreamInterval(self._device)
            self._comm.wait_for(self._work, self._issued)
            self._comm.ledger.add_stream_wait(self._op, interval.close())
        else:
            start = time.perf_counter()
            self._comm.wait_for(self._work, self._issued)
            self._comm.ledger.add_wait(self._op, time.perf_counter() - start)
        lent = self._lent
        if isinstance(self._work, Works):  # a collective done in place: its output filled in now
            self._work.finish()
            lent = self._work.lent
        self._work, self._lent = None, ()
        LENT.give_back(lent)

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
    NCCL. First the backend gives back what it holds (see [Note: tensors lent to the backend] in
    lent.py). Registered once, by the first Communicator.
    """

    def destroy() -> None:
        LENT.drain()  # see [Note: tensors lent to the backend] in lent.py
        if not is_distributed():
            return
        failed = _FAILED["comm"]
        if failed is not None and _FAILED["group"] is dist.group.WORLD:
            failed.linger_for_peers()
            leave_without_destroying()  # see [Note: waiting without hanging]
        dist.destroy_process_group()

    atexit.register(destroy)


_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}


class Communicator:
    """Collectives over one process group, recorded in a :class:`CommLedger`.

    Args:
        group: the process group; ``None`` means the default (world) group.
        ledger: where every collective is recorded; a fresh one when not given.
    """

    def __init__(self, group: Any | None = None, ledger: CommLedger | None = None) -> None:
        self._root = self  # the world's communicator, whose failure state every subgroup shares
        self.group = group  # torch ProcessGroup or None for WORLD
        self.ledger = ledger if ledger is not None else CommLedger()  # record of every collective
        self.world_size = dist.get_world_size(group) if is_distributed() else 1  # N
        self.rank = dist.get_rank(group) if is_distributed() else 0  # this rank within the group
        self.me = dist.get_rank() if is_distributed() else 0  # this rank in the world (faults, board)
        self.members = (  # the world ranks of the group, in group order
            dist.get_process_group_ranks(group)
            if is_distributed() and group is not None
            else list(range(self.world_size))
        )
        self.link = "intra"  # the link its collectives cross, for the ledger ([Note: links] in ledger.py)
        self.mean_over = self.world_size  # ranks whose gradients make one mean (hybrid: the world)
        self.replicate: Communicator | None = None  # hybrid sharding: the replicate group (see subgroup)
        self.tracker = CollectiveTracker()  # sequence numbers; the collective this rank is blocked in
        self.board: FaultBoard | None = None  # faults in the store, once watch_faults() ran
        self.ranks: list[RankInfo] = [this_process(self.rank)]  # every rank's host and pid
        self.fault_wait_s = 3.0  # how long a failed collective waits for the failing rank's message
        self._failure: BaseException | None = None  # what this rank failed with; no collective after it
        self._published = False  # this rank wrote its failure to the board (faults.publish)
        self._stop_reason: str | None = None  # set by the watchdog: the ranks are out of step for good
        self._on_poll: Callable[[], None] | None = None  # the watchdog's check, between two wait slices
        self.liveness: Liveness | None = None  # dead peers, while this rank waits (watch_faults)
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

    # the failure state is the world's: a subgroup that fails fails its rank ([Note: hybrid comms])
    failure = property(lambda self: self._root._failure, lambda self, v: setattr(self._root, "_failure", v))
    stop_reason = property(
        lambda self: self._root._stop_reason, lambda self, v: setattr(self._root, "_stop_reason", v)
    )
    published = property(
        lambda self: self._root._published, lambda self, v: setattr(self._root, "_published", v)
    )
    on_poll = property(lambda self: self._root._on_poll, lambda self, v: setattr(self._root, "_on_poll", v))

    @property
    def world(self) -> Communicator:
        """The communicator of every rank (itself, but for a subgroup's; see [Note: hybrid comms])."""
        return self._root

    def subgroup(self, group: Any, *, link: str) -> Communicator:
        """A communicator over ``group`` (a subgroup of this world's ranks) for hybrid sharding.

        [Note: hybrid comms]
        The engines of hybrid sharding shard over a shard group and all-reduce over a replicate
        group ([Note: shard groups and replicate groups] in ``mesh.py``). Their communicators share
        the world's ledger, tracker, fault board, liveness watch and failure state: every rank
        issues the same collectives in the same order, whichever group each runs in, so one
        sequence of numbers per process still describes it. Collectives on tensors run in the
        group, checked among its members (a side group of its own); agreements, broadcasts and
        checkpoint I/O (objects, barriers, DCP) run in the world, so that every group takes the
        same decision. ``rank`` and ``world_size`` are the group's, ``me`` the world rank that
        faults are filed under. Collective: every rank calls it, in the same order.
        """
        sub = _GroupCommunicator.__new__(_GroupCommunicator)
        sub.__dict__.update(self.__dict__)  # ledger, tracker, board, ranks, liveness, fault_wait_s
        sub._root = self._root
        sub.group = group
        sub.world_size = dist.get_world_size(group)
        sub.rank = dist.get_rank(group)
        sub.members = dist.get_process_group_ranks(group)
        sub.link = link
        sub.replicate = None
        sub.schedule = Schedule(self.schedule.trust_after)  # the group's own sequence of collectives
        sub.side = SideGroup.create(group, sub.world_size) if self.side is not None else None
        return sub

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
        with torch.profiler.record_function(name):
            work = launch()  # an error here is this rank's own (a bad argument): raised as it is
        self.tracker.launched(issued, work)
        return Handle(work, self, None if control else op, issued, device, lent)

    def _check_can_issue(self, name: str) -> None:
        if self.failure is not None:
            raise CollectivesStopped(
                f"collective {name} not issued: rank {self.rank} already failed ({self.failure!r}); "
                "no collective runs after a failure, so that no rank waits for it"
            )
        if self.stop_reason is not None:
            raise CollectivesStopped(self.stop_reason)

    # -- checked issue (see [Note: checked issue] in ``checks.py``) --------------------------------

    def _check(self, issued: Issued, *, timed_as: str | None = None, expectable: bool = False) -> None:
        """On gloo, before ``issued`` is launched: every rank is about to issue the same collective,
        checked, or expected by every rank ([Note: learned schedule] in ``checks.py``). The time a
        check blocks (a rank waiting there for a slower one) is exposed communication, added to the
        ledger under ``timed_as`` as ``Handle.wait`` adds its own (None: not timed). ``expectable``:
        whether the schedule may expect it (False: its size is unknown here, or it is control)."""
        if not self.check_issue or self.side is None:
            return
        sig = signature(issued)
        expected = self.schedule.expected()
        if expected == sig:
            self.schedule.followed(sig)
            return
        if expected is not None and self.board is not None:
            try:  # where the others, expecting it, may have issued the expected one unchecked
                self.board.post_deviation(issued)
            except StoreUnreachable:
                pass
        self.ledger.record_check(self.side.table.numel() * self.side.table.element_size(), self.world_size)
        start = time.perf_counter()
        self._exchange(issued, 0)
        if timed_as is not None:
            self.ledger.add_wait(timed_as, time.perf_counter() - start)
        self.schedule.checked(sig, expectable=expectable)

    def _exchange(self, issued: Issued, flags: int) -> list[list[int]]:
        """Every rank's row (``flags`` and its collective) on every rank, over the side group;
        rows that name different collectives stop every rank with :class:`CollectivesStopped`."""
        work = self.side.launch(self.rank, row_of(issued, flags))
        self.wait_for(work, issued, blocking=True)
        rows = self.side.rows()
        if not in_step(rows):
            self._stop_for_desync(issued, rows)
        return rows

    def _stop_for_desync(self, issued: Issued, rows: list[list[int]]) -> None:
        """Every rank sees the same rows: each names every rank's collective and raises."""
        states = self._desync_states(issued, rows)
        others = [self.members[r] for r in elsewhere(rows, self.rank)]
        report = desync_report(self.me, states, others, self.members)
        print(report, file=sys.stderr, flush=True)  # also where the exception is caught and dropped
        self.stop_reason = report
        error = CollectivesStopped(report)
        self.mark_failed(error)
        if self.board is not None:
            try:
                self.board.publish_stop(report)  # for a rank that waits elsewhere
                self.board.note(self.me, issued.describe())
            except StoreUnreachable:
                pass
        raise error

    def _desync_states(self, issued: Issued, rows: list[list[int]]) -> dict[int, RankState]:
        """Every rank's collective, named as it posted it on the board (else from its row); keyed by
        world rank."""
        posted: dict[int, Issued] = {}
        check = self.side.count if self._root is self else f"{self.members[0]}-{self.side.count}"
        if self.board is not None:
            try:
                self.board.post_collective(check, issued)
                posted = self.board.collectives(check, self.fault_wait_s, ranks=self.members)
            except StoreUnreachable:
                pass
        states = {}
        for r, row in enumerate(rows):
            world = self.members[r]
            theirs = issued if r == self.rank else posted.get(world, issued_from_row(row))
            host = self.ranks[world].host if world < len(self.ranks) else "?"
            states[world] = RankState(world, host, theirs, theirs, 0.0)
        return states

    @contextmanager
    def tracked(self, name: str) -> Generator[None, None, None]:
        """Around a collective this package does not issue (Lightning's own reduce or all-gather):
        numbered, checked on gloo before it starts, and known to the watchdog while it blocks."""
        if not self.active:
            yield
            return
        self._check_can_issue(name)
        issued = self.tracker.issue("lightning", name, 0)
        self._check(issued)
        with self.tracker.blocked_in(issued):
            yield

    # -- waiting (see [Note: waiting without hanging]) -----------------------------------------

    def wait_for(self, work: Any, issued: Issued | None, *, blocking: bool | None = None) -> None:
        """Block until ``work`` completes; a failure is raised with the failing rank's message.
        ``blocking``: whether its ``wait`` blocks the host (None: as the main group's backend)."""
        if self.liveness is not None:
            self.liveness.reset()
        with self.tracker.blocked_in(issued):
            try:
                if self._blocking_waits if blocking is None else blocking:
                    self._wait_in_slices(work, issued)
                else:
                    work.wait()
            except (PeerFailure, CollectivesStopped) as err:
                self.mark_failed(err)
                self._note(issued)
                raise
            except Exception as err:
                explained = self.explain(err, issued)
                if explained is None:
                    raise
                raise explained from err

    def _wait_in_slices(self, work: Any, issued: Issued | None) -> None:
        untimed = issued is not None and issued.op in _UNTIMED_OPS and not isinstance(work, Works)
        if untimed and not work.is_completed():
            self._wait_in_background(work, issued)
            return
        while True:
            try:
                work.wait(timedelta(seconds=POLL_S))
                return
            except RuntimeError as err:
                # the slice ran out: "Operation timed out!" on a work still running; anything else
                # is the collective's failure (a failed gloo work does not report is_completed)
                if SLICE_TIMEOUT not in str(err):
                    raise  # explained by the caller
                if work.is_completed():  # it completed as the slice ran out: its own outcome counts
                    work.wait()
                    return
            self._between_slices(issued)  # the collective is still running

    def _wait_in_background(self, work: Any, issued: Issued | None) -> None:
        """A work whose ``wait`` ignores its timeout waits in the waiter thread; this one reads the
        board between slices (a collective that never ends leaves that thread blocked: failure)."""
        waiting = _WAITER.submit(work)
        while not waiting.done.wait(POLL_S):
            self._between_slices(issued)
        if waiting.error is not None:
            raise waiting.error

    def _between_slices(self, issued: Issued | None) -> None:
        if self.on_poll is not None:
            self.on_poll()
        if self.stop_reason is not None:
            raise CollectivesStopped(self.stop_reason)
        if self.board is None:
            return
        where = issued.describe() if issued is not None else "a collective"
        try:
            published = self.board.fault_count() > 0
            faults = [f for f in self.board.faults() if f.rank != self.me] if published else []
            stop = self.board.stop_reason() if published else None
            if faults or stop:
                self.board.note(self.me, where)  # read: the failing rank may leave now
            lost, silent_s = self.liveness.lost() if self.liveness is not None else ([], None)
            if not (stop or faults or lost):
                self._stop_if_deviated()
        except StoreUnreachable as err:
            raise PeerFailure(store_lost_message(self.ranks, self.me, where, err)) from err
        if stop:
            raise CollectivesStopped(stop)
        if faults:
            raise PeerFailure(fault_message(faults, self.me, where, None), faults)
        if lost:
            raise PeerFailure(lost_message(lost, self.me, where, None, silent_s=silent_s), lost=lost)

    def _stop_if_deviated(self) -> None:
        """Raise :class:`CollectivesStopped` (published for every rank) when a peer posted a
        deviation under a sequence number where this rank issued another collective, the expected
        one, unchecked ([Note: learned schedule] in ``checks.py``)."""
        posted = self.board.deviations()
        if not posted:
            return
        mine = {i.seq: i for i in tuple(self.tracker.recent)}
        apart = {r: i for r, i in posted.items() if i.seq in mine and signature(mine[i.seq]) != signature(i)}
        if not apart:
            return
        seq = min(i.seq for i in apart.values())
        deviating = sorted(r for r, i in apart.items() if i.seq == seq)
        states = {r: self._posted_state(r, apart[r]) for r in deviating}
        states[self.me] = RankState(
            self.me, self._host(self.me), self.tracker.last, mine[seq], self.tracker.blocked_for()
        )
        report = deviation_report(self.me, states, deviating, sorted(states))
        print(report, file=sys.stderr, flush=True)
        self.stop_reason = report
        self.board.publish_stop(report)
        self.board.note(self.me, mine[seq].describe())
        raise CollectivesStopped(report)

    def _host(self, rank: int) -> str:
        return self.ranks[rank].host if rank < len(self.ranks) else "?"

    def _posted_state(self, rank: int, issued: Issued) -> RankState:
        return RankState(rank, self._host(rank), issued, issued, 0.0)

    def _note(self, issued: Issued | None) -> None:
        """Tell rank 0 (the store's host, lingering after a failure) that this rank has read the board."""
        if self.board is not None:
            try:
                self.board.note(self.me, issued.describe() if issued is not None else "a collective")
            except StoreUnreachable:
                pass

    def explain(self, err: BaseException, issued: Issued | None) -> RuntimeError | None:
        """Why ``err`` ended this rank's collective, read from the fault board: a desync a peer found
        (:class:`CollectivesStopped`), a peer's failure or death (:class:`PeerFailure`); None when the
        board knows nothing (no board, or every rank answered and none failed: the backend's own error)."""
        self.mark_failed(err)
        if self.board is None:
            return None
        where = issued.describe() if issued is not None else "a collective"
        try:
            self.board.note(self.me, where)
            stop = self.board.stop_reason() if self.board.fault_count() else None
            if stop is not None:  # the peer that found the desync left first: this rank names it too
                return CollectivesStopped(stop)
            gone = [i for i in self.ranks if i.rank != self.me and process_exists(i) is False]
            if gone and not self.board.fault_count():  # dead for sure, and said nothing: no need to wait
                return PeerFailure(lost_message(gone, self.me, where, err), lost=gone)
            faults, silent = self.board.wait_for_cause(self.fault_wait_s)
        except StoreUnreachable:
            return PeerFailure(store_lost_message(self.ranks, self.me, where, err))
        faults = [f for f in faults if f.rank != self.me]
        if faults:
            return PeerFailure(fault_message(faults, self.me, where, err), faults)
        if silent:
            lost = [self.ranks[r] for r in sorted(silent)]
            return PeerFailure(lost_message(lost, self.me, where, err), lost=lost)
        return None

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
        if scratch_input and input.is_contiguous() and self.active and copies_in_backend(input, self.group):
            where = {"rank": self.rank, "world_size": self.world_size, "group": self.group}
            launch = lambda: all_reduce_for_scatter(output, input, **where)  # noqa: E731
            lent = ()  # the in-place work holds its own
        else:
            lent = (lend(output), lend(input))
            launch = lambda: _REDUCE_SCATTER(*lent, group=self.group, async_op=True)  # noqa: E731
        handle = self._issue("reduce_scatter", name, nbytes, launch, device=input.device, lent=lent)
        if not self.active:
            output.copy_(input)
        if not async_op:
            handle.wait()
        return handle

    def all_gather(self, output: Tensor, input: Tensor, *, name: str, async_op: bool = True) -> Handle:
        """Concatenate every rank's ``input`` shard into ``output`` (1D, N x shard); on gloo in
        place, by broadcasts (see [Note: collectives in place] in inplace.py)."""
        nbytes = output.numel() * output.element_size()
        if output.is_contiguous() and self.active and copies_in_backend(output, self.group):
            where = {"rank": self.rank, "world_size": self.world_size, "group": self.group}
            launch = lambda: all_gather_by_broadcasts(output, input, **where)  # noqa: E731
            lent = ()  # the in-place work holds its own
        else:
            lent = (lend(output), lend(input))
            launch = lambda: _ALL_GATHER(*lent, group=self.group, async_op=True)  # noqa: E731
        handle = self._issue("all_gather", name, nbytes, launch, device=output.device, lent=lent)
        if not self.active:
            output.copy_(input)
        if not async_op:
            handle.wait()
        return handle

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

    # -- control collectives (counted apart: see [Note: bounded ledger]) ------------------------

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
            issued = self.tracker.issue("agree", name, nbytes)
            with torch.profiler.record_function(name):
                rows = self._exchange(issued, flags)
            return [row[FLAGS] for row in rows]
        table = torch.zeros(self.world_size, dtype=torch.int64, device=device)
        table[self.rank] = flags
        launch = lambda: dist.all_reduce(table, group=self.group, async_op=True)  # noqa: E731
        nbytes = table.numel() * table.element_size()
        self._issue("agree", name, nbytes, launch, control=True, lent=(table,)).wait()
        return table.tolist()

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
        no_dist = local or not is_distributed() or not self.active
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


class _GroupCommunicator(Communicator):
    """A subgroup's communicator (see [Note: hybrid comms]): tensor collectives in the group;
    agreements, broadcasts, barriers and checkpoint I/O in the world."""

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


_COMM_ERROR_WORDS = (  # what backends say when a peer is gone or a collective broke
    "connection closed",
    "connection reset",
    "broken pipe",
    "timed out",
    "nccl",
    "gloo",
    "distbackenderror",
    "distnetworkerror",
)


def looks_like_comm_error(err: BaseException) -> bool:
    """Whether ``err`` (or an exception it wraps) is a backend's report of a broken collective."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        text = f"{type(err).__name__} {err}".lower()
        if isinstance(err, dist.DistError) or any(word in text for word in _COMM_ERROR_WORDS):
            return True
        err = err.__cause__ or err.__context__
    return False


def _group_by_dtype_device(tensors: Sequence[Tensor]) -> list[list[Tensor]]:
    groups: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return list(groups.values())

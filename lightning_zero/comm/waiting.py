"""Waiting for a collective without hanging: the Handle the caller waits on, waits in slices
that read the fault board between them, the waiter thread for gloo's untimed waits, and the
explanation of a failed collective from the board.

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
collective on it raises at once instead of waiting."""

from __future__ import annotations

import queue
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor

from lightning_zero.comm.checks import deviation_report, signature
from lightning_zero.comm.faults import (
    CollectivesStopped,
    PeerFailure,
    StoreUnreachable,
    fault_message,
    lost_message,
    process_exists,
    store_lost_message,
)
from lightning_zero.comm.inplace import Works
from lightning_zero.comm.lent import LENT
from lightning_zero.comm.timing import CUDA_EVENTS, StreamInterval, timing_for
from lightning_zero.comm.tracker import Issued, RankState

POLL_S = 1.0  # slice of a host-blocking wait between two reads of the fault board
SLICE_TIMEOUT = "Operation timed out!"  # what Work.wait(timeout) raises when the slice runs out


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
        self._queue: queue.SimpleQueue[_Waiting | None] = queue.SimpleQueue()  # None: stop
        self._thread: threading.Thread | None = None

    def submit(self, work: Any) -> _Waiting:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="lightning_zero-waiter", daemon=True)
            self._thread.start()
        waiting = _Waiting(work)
        self._queue.put(waiting)
        return waiting

    def stop(self, timeout_s: float = 1.0) -> bool:
        """End the thread once it has no work (the end of a run: no thread of the package outlives
        it); a later submit starts it again. False when it is still blocked in a work (a collective
        that never completed: a failure), which it is then left in."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            return True
        self._queue.put(None)
        thread.join(timeout_s)
        if thread.is_alive():
            return False
        self._thread = None
        return True

    def _run(self) -> None:
        while True:
            waiting = self._queue.get()
            if waiting is None:  # stop()
                return
            try:
                waiting.work.wait()
            except BaseException as err:  # handed to the caller
                waiting.error = err
            finally:
                waiting.work = None  # a work holds its tensors: they are freed with the caller's
                waiting.done.set()
                waiting = None


_WAITER = _Waiter()


def stop_waiter() -> bool:
    """End the package's waiter thread if it runs and waits for nothing (see :meth:`_Waiter.stop`)."""
    return _WAITER.stop()


_UNTIMED_OPS = ("reduce_scatter",)  # gloo ops whose Work.wait(timeout) blocks past the timeout
# (done in place, as an all-reduce or an exchange, the Works say: see [Note: collectives in place]
# in inplace.py)


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
        comm: Waits | None = None,  # the Communicator that issued it
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


class Waits:
    """How a :class:`Communicator` waits for its collectives and explains their failures (see
    [Note: waiting without hanging]); part of the Communicator, which holds the state it reads."""

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
        if isinstance(work, Works):
            untimed = not work.timed
        else:
            untimed = issued is not None and issued.op in _UNTIMED_OPS
        if untimed:
            if work.is_completed():
                work.wait()  # at once, and without a timeout
            else:
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
        mine = {i.seq: self.tracker.issued_at(i.seq) for i in posted.values()}
        apart = {
            r: i
            for r, i in posted.items()
            if mine[i.seq] is not None and signature(mine[i.seq]) != signature(i)
        }
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
            if gone:  # a rank that noted itself before it left stopped for a reason of its own: not lost
                noted = self.board.noted()
                gone = [i for i in gone if i.rank not in noted]
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

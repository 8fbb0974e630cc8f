"""The watchdog: a collective that waits too long is reported, with every rank's position.

[Note: the watchdog]
With ``watchdog_s`` (60 s by default), a daemon thread wakes every ``min(1, watchdog_s / 4)``
seconds. On a backend whose waits block the host (gloo) a rank is stuck when it has been blocked
in one collective longer than ``watchdog_s``; on NCCL, whose waits return at once, when the
oldest collective it issued has not completed after ``watchdog_s`` (checked with
``Work.is_completed``, which does not block). A stuck rank asks every rank, through the store,
for its state: the last collective it issued, the one it is blocked in and since when, and its
latest ``RECENT`` collectives (sequence number, op, name, bytes; [Note: collective sequence
numbers] in ``tracker.py``). Every rank's watchdog answers from its own thread, so a rank busy
outside any collective still answers. The report is printed on every stuck rank (again at twice
the time while it stays stuck), e.g.

    lightning_zero watchdog: rank 0 waited 12 s in a collective; the ranks are out of step (a desync): ...
      rank 0 (node1) waits in all_gather #57 zero3/all_gather/unit=blocks.3 (1.2 MiB) for 12 s
      rank 1 (node2) waits in reduce_scatter #57 zero3/reduce_scatter/unit=blocks.2 (2.4 MiB) for 12 s

It is a desync when two ranks issued different collectives under one sequence number
(``differ_at_one_number``), or, where their recent collectives do not overlap, when every rank
has waited at least ``SETTLED_S`` in a collective and they are not all in the same one
(``waits_apart``). Then no rank can ever leave: the run stops (``CollectivesStopped`` with the
report, raised by the waiting thread on gloo; the report is published so that every rank stops).
Lateness is never a desync: a rank that computes, saves a checkpoint or validates for a long time
is not in a collective, or in one that the others have not reached yet, and its collectives so
far match theirs. So the default cannot stop a healthy run, however long its waits; it bounds how
long a desync lasts that the check before each collective on gloo ([Note: checked issue] in
``checks.py``) and the per-batch agreement do not catch (an NCCL desync within a step; one of
Lightning's collectives that the strategy does not check). Cost when nothing is stuck: one read of
the store per tick; a wait longer than ``watchdog_s`` prints its report (a slow rank, a slow link).

Whatever ``watchdog_s``: when a peer has published an error, or is gone (its pid on this host, or
its heartbeat still), and this rank is still blocked ``fault_wait_s`` later in a wait no Python
code can interrupt (inside a DCP save or load, in Lightning's own collectives, in a device sync
on NCCL), the thread prints the reason and ends the process (status 1). In this package's own
waits on gloo the waiting thread raises first, with the same message.

With ``watchdog_s=None`` the same thread only beats: once a second it increments this rank's
heartbeat in the store, which a rank blocked in a collective reads to tell a dead peer on another
host from a slow one ([Note: waiting without hanging] in ``waiting.py``). One store write per
second per rank.
"""

from __future__ import annotations

import atexit
import functools
import logging
import sys
import threading
import time
import weakref
from typing import Any, NamedTuple

from lightning_zero.comm.faults import StoreUnreachable, fault_message, leave_without_destroying, lost_message
from lightning_zero.comm.tracker import RankState

log = logging.getLogger(__name__)
BEAT_S = 1.0  # heartbeat period (and the longest tick)
SETTLED_S = 1.0  # a wait this old is not a collective about to complete (see waits_apart)
ANSWER_WAIT_TICKS = 4  # how many ticks (at least 1 s) a stuck rank waits for the other ranks' states
_RUNNING: weakref.WeakSet[Watchdog] = weakref.WeakSet()  # started and not stopped, in this process


@functools.cache
def _stop_at_exit() -> None:
    """Stop every running watchdog before the interpreter finalizes.

    [Note: no daemon thread in torch at exit]
    A Fabric program never tears its strategy down, and a script may end with a Trainer's
    watchdog still beating. A daemon thread that is inside a torch call (a store write) when the
    interpreter finalizes cannot take the GIL back when the call returns: Python ends the thread
    with ``pthread_exit``, whose unwinding through pybind11's frames aborts the process
    ("terminate called without an active exception", status 134) after the program had ended
    well. atexit handlers run before that point, so the threads are stopped and joined there.
    Registered once, by the first watchdog started: after the Communicator's clean-up of the
    process group (atexit runs in reverse order), so the threads stop before the group goes.
    """

    def stop_all() -> None:
        for watchdog in list(_RUNNING):
            watchdog.stop()

    atexit.register(stop_all)


class Report(NamedTuple):
    text: str  # printed on the stuck ranks
    desync: bool  # the ranks are out of step (see [Note: the watchdog]): no rank can leave


def differ_at_one_number(states: dict[int, RankState]) -> bool:
    """Two ranks issued different collectives (op, name or bytes) under one sequence number."""
    known: dict[int, tuple[str, str, int]] = {}
    for state in states.values():
        for issued in (*state.recent, state.last, state.waiting):
            if issued is not None and known.setdefault(issued.seq, issued[1:]) != issued[1:]:
                return True
    return False


def waits_apart(states: dict[int, RankState], world_size: int) -> bool:
    """Every rank has waited at least ``SETTLED_S`` in a collective, not all in the same one, and
    the ranks further on show nothing of the lowest one (no sign that they passed it together)."""
    waiting = [s.waiting for s in states.values() if s.waiting is not None and s.for_s >= SETTLED_S]
    if len(waiting) < world_size or len({(w.seq, w.op, w.name) for w in waiting}) == 1:
        return False
    lowest = min(w.seq for w in waiting)
    ahead = [s for s in states.values() if s.waiting.seq > lowest]
    return not any(i.seq == lowest for s in ahead for i in s.recent)


def format_report(me: int, stuck_s: float, states: dict[int, RankState], world_size: int) -> Report:
    """The report of rank ``me``, stuck for ``stuck_s`` seconds, from the states that came back
    (see [Note: the watchdog] for when it is a desync)."""
    waiting = [s.waiting for s in states.values() if s.waiting is not None]
    everyone_waits = len(waiting) == world_size
    desync = differ_at_one_number(states) or waits_apart(states, world_size)
    if desync:
        mine = states[me].current() if me in states else None
        others = [r for r, s in sorted(states.items()) if s.current() != mine]
        where = f"rank {me} is in {mine.describe()}; " if mine is not None else ""
        verdict = (
            "the ranks are out of step (a desync): every rank must issue the same collectives in the same "
            f"order, and these never will ({where}rank(s) {', '.join(map(str, others))} are elsewhere)"
        )
    elif everyone_waits:
        verdict = "every rank waits in the same collective (a slow link, or a backend that lost a message)"
    else:
        verdict = "some ranks are not in a collective: they are slow, or blocked elsewhere"
    lines = [f"lightning_zero watchdog: rank {me} waited {stuck_s:.0f} s in a collective; {verdict}:"]
    for r in range(world_size):
        lines.append(f"  {states[r].describe()}" if r in states else f"  rank {r} did not answer")
    return Report("\n".join(lines), desync)


class Watchdog:
    """This rank's heartbeat in the store, and with ``after_s`` the reports of [Note: the watchdog].

    Args:
        comm: the Communicator whose collectives are watched (its tracker, board and ranks).
        after_s: a collective stuck longer than this is reported; None: heartbeat only.
    """

    def __init__(self, comm: Any, after_s: float | None = None) -> None:
        self.comm = comm
        self.after_s = after_s
        self.tick_s = min(BEAT_S, after_s / 4) if after_s is not None else BEAT_S  # between two checks
        self._stuck: int | None = None  # sequence number of the collective this rank is stuck in
        self._next_report_s = after_s or 0.0  # stuck this long: report (again); doubles after each report
        self._answered = 0  # the last report request this rank answered
        self._fault_seen_at: float | None = None  # when a peer's fault was first seen while stuck
        self._liveness = comm.new_liveness() if comm.board is not None else None  # dead peers, its own watch
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lightning_zero-watchdog", daemon=True)

    def start(self) -> None:
        reports = self.after_s is not None
        self.comm.tracker.track_pending = (
            reports and not self.comm._blocking_waits
        )  # NCCL: waits do not block
        _stop_at_exit()
        _RUNNING.add(self)
        self._thread.start()

    def stop(self) -> None:
        _RUNNING.discard(self)
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * self.tick_s)
        self.comm.tracker.track_pending = False

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            try:
                self.check()
            except StoreUnreachable as err:
                log.debug("watchdog: %s", err)
            except Exception:  # never let the thread die silently: the next tick tries again
                log.exception("lightning_zero watchdog: check failed")

    def check(self) -> None:
        """One tick: answer report requests; report this rank if it is stuck; act on a peer's fault."""
        board, tracker = self.comm.board, self.comm.tracker
        if board is None or self._liveness is None:
            return
        board.beat()
        if self.after_s is not None:
            self._answer(board)
        stuck, stuck_s = tracker.stuck_in()
        if stuck is None:
            self._fault_seen_at = None
            self._liveness.reset()
            return
        if stuck.seq != self._stuck:
            self._stuck, self._next_report_s = stuck.seq, self.after_s
            self._liveness.reset()
        if self.after_s is not None and stuck_s >= self._next_report_s:
            self._next_report_s = 2 * stuck_s  # again at twice the time, while it lasts
            self._report(board, stuck_s)
        if stuck_s >= self.comm.fault_wait_s:
            self._end_if_peer_failed(board, stuck)

    def _answer(self, board: Any) -> None:
        requests = board.report_requests()
        if requests > self._answered:
            board.post_state(requests, self._state())
            self._answered = requests

    def _state(self) -> RankState:
        me = self.comm.ranks[self.comm.rank]
        return self.comm.tracker.state(me.rank, me.host)

    def _report(self, board: Any, stuck_s: float) -> None:
        request = board.request_report()
        board.post_state(request, self._state())
        self._answered = max(self._answered, request)
        deadline = time.monotonic() + max(ANSWER_WAIT_TICKS * self.tick_s, 1.0)
        states = board.states(request)
        while len(states) < self.comm.world_size and time.monotonic() < deadline:
            time.sleep(self.tick_s / 4)
            self._answer(board)  # a peer stuck at the same time waits for this rank's answer
            states = board.states(request)
        report = format_report(self.comm.rank, stuck_s, states, self.comm.world_size)
        log.info(report.text)  # printed below: a warning would print it twice without a log handler
        print(report.text, file=sys.stderr, flush=True)
        if report.desync:
            self.comm.stop_reason = report.text  # the waiting thread raises it (gloo)
            board.publish_stop(report.text)  # and every other rank, with the same report

    def _end_if_peer_failed(self, board: Any, stuck: Any) -> None:
        """A peer failed or is gone, and this rank is still stuck ``fault_wait_s`` later, in a wait
        that no Python code can interrupt (inside DCP, a device sync on NCCL): nothing will wake it."""
        reason = self.comm.stop_reason
        if reason is None and board.fault_count() > 0:
            reason = board.stop_reason()  # a desync another rank found
        if reason is None and board.fault_count() > 0:
            faults = [f for f in board.faults() if f.rank != self.comm.rank]
            reason = fault_message(faults, self.comm.rank, stuck.describe(), None) if faults else None
        if reason is None:
            lost, silent_s = self._liveness.lost()
            reason = (
                lost_message(lost, self.comm.rank, stuck.describe(), None, silent_s=silent_s)
                if lost
                else None
            )
        if reason is None:
            return
        now = time.monotonic()
        if self._fault_seen_at is None:
            self._fault_seen_at = now
        elif now - self._fault_seen_at >= max(self.comm.fault_wait_s, 2 * self.tick_s):
            print(
                f"lightning_zero watchdog: ending rank {self.comm.rank}: {reason}",
                file=sys.stderr,
                flush=True,
            )
            leave_without_destroying()

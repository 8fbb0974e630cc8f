"""The check before a collective (see [Note: checked issue] and [Note: learned schedule] in
``checks.py``): a Communicator's collective is issued only when every rank is about to issue the
same one, checked over the side group or expected by every rank; rows that differ stop every rank
with each rank's collective named."""

from __future__ import annotations

import sys
import time
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

from lightning_zero.comm.checks import (
    desync_report,
    digest_report,
    elsewhere,
    in_step,
    issued_from_row,
    row_of,
    signature,
)
from lightning_zero.comm.faults import CollectivesStopped, StoreUnreachable
from lightning_zero.comm.tracker import Issued, RankState


class CheckedIssue:
    """The checks of a :class:`Communicator` before it issues a collective; part of the
    Communicator, which holds the side group, the schedule and the fault board they use."""

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

    def _exchange(self, issued: Issued, flags: int, digest: int = 0) -> list[list[int]]:
        """Every rank's row (``flags``, its collective, an agreement's ``digest``) on every rank, over
        the side group; rows that name different collectives stop every rank with
        :class:`CollectivesStopped`."""
        work = self.side.launch(self.rank, row_of(issued, flags, digest))
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
        self._stop_every_rank(issued, report)

    def _stop_every_rank(self, issued: Issued, report: str) -> None:
        """Every rank found the same desync at ``issued``: print, post and raise it. Posted as the
        stop (for a rank that waits elsewhere) and noted as read, so that rank 0, which hosts the
        store, leaves at once instead of lingering for its peers' word."""
        print(report, file=sys.stderr, flush=True)  # also where the exception is caught and dropped
        self.stop_reason = report
        error = CollectivesStopped(report)
        self.mark_failed(error)
        if self.board is not None:
            try:
                self.board.publish_stop(report)
                self.board.note(self.me, issued.describe())
            except StoreUnreachable:
                pass
        raise error

    def _stop_for_digests(self, issued: Issued, since: list[Issued]) -> None:
        """The agreement ``issued`` found that the ranks issued different collectives since the last
        one (see [Note: digest since the last agreement] in tracker.py): every rank exchanges its
        entries, names the first that differs and raises :class:`CollectivesStopped`."""
        entries: list[Any] = [None] * self.world_size
        mine = [tuple(e) for e in since]
        with self.tracker.blocked_in(issued):
            dist.all_gather_object(entries, mine, group=self.side.group)
        report = digest_report(issued, [[Issued(*e) for e in rank] for rank in entries], self.members)
        self._stop_every_rank(issued, report)

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
    def tracked(self, name: str, nbytes: int = 0) -> Generator[None, None, None]:
        """Around a collective this package does not issue (Lightning's own reduce or all-gather of
        ``nbytes``): numbered, checked on gloo before it starts, and known to the watchdog while it
        blocks."""
        if not self.active:
            yield
            return
        self._check_can_issue(name)
        issued = self.tracker.issue("lightning", name, nbytes)
        self._check(issued)
        with self.tracker.blocked_in(issued):
            yield

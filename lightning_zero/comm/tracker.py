"""What this rank's collectives are doing: the last one issued, the one it is blocked in.

[Note: collective sequence numbers]
Every collective a Communicator issues gets the next sequence number of its group (1, 2, ...).
Every rank issues the same collectives in the same order ([Note: same collectives everywhere] in
``grad_sync/reducer.py``), so at any moment the ranks' numbers may differ only while one rank
runs ahead of another; ranks blocked in collectives of *different* numbers, or of the same number
but a different op or name, are out of step for good: a desync. The numbers are what the fault
messages and the watchdog's report print (``all_gather #57 zero3/all_gather/unit=blocks.3``).
The tracker is written by the training thread and read by the watchdog thread; each field is
replaced by one assignment, which a reader sees whole.

[Note: digest since the last agreement]
Numbers alone do not show *which* collective a rank issued: on NCCL no collective is checked
before it is issued (and on gloo the learned schedule skips the checks), so when ranks take
different branches and issue different units of the same size, the all-gathers pair across units
and complete. So the tracker also folds every collective it issues (op, payload bytes, name) into
a running digest and keeps the entries since the last agreement; the agreements the glues make
(the Trainer once per batch, Fabric before each training forward) carry the digest, and digests
that differ stop every rank at that agreement, naming the first entry that differs (the entries
are exchanged only then). Both are reset at each agreement; past ``SINCE_MAX`` entries without
one only the digest goes on. Folding costs two cached lookups and a multiply per collective.
"""

from __future__ import annotations

import time
import zlib
from collections import deque
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any, NamedTuple

RECENT = 16  # collectives each rank keeps for the watchdog's comparison (see [Note: the watchdog])
SINCE_MAX = 1 << 14  # entries kept since the last agreement (see [Note: digest since the last agreement])
_MIX, _MOD = 0x100000001B3, (1 << 61) - 1  # the digest: a polynomial over the entries' codes, mod a prime
_CRC: dict[str, int] = {}  # name or op -> CRC32, for the names seen (bounded: _CRC_MAX)
_CRC_MAX = 4096


class Issued(NamedTuple):
    """One collective as the fault messages and the watchdog name it."""

    seq: int  # sequence number in this group: 1, 2, ... (see [Note: collective sequence numbers])
    op: str  # all_reduce | reduce_scatter | all_gather | broadcast | gather | barrier | agree | checkpoint
    name: str  # the ledger's name, e.g. "zero3/all_gather/unit=blocks.3"
    nbytes: int  # payload bytes (the full logical tensor)

    def describe(self) -> str:
        return f"{self.op} #{self.seq} {self.name} ({format_nbytes(self.nbytes)})"


class RankState(NamedTuple):
    """What one rank was doing when asked (posted to the store for the watchdog's report)."""

    rank: int
    host: str
    last: Issued | None  # the latest collective this rank issued
    waiting: Issued | None  # the collective it is blocked in now, if any
    for_s: float  # seconds blocked in ``waiting``, or since ``last`` was issued when not waiting
    recent: tuple[Issued, ...] = ()  # the latest collectives it issued (at most RECENT), oldest first

    def current(self) -> Issued | None:
        """The collective it waits in, or else the last it issued."""
        return self.waiting if self.waiting is not None else self.last

    def describe(self) -> str:
        where = f"rank {self.rank} ({self.host})"
        if self.waiting is not None:
            return f"{where} waits in {self.waiting.describe()} for {self.for_s:.0f} s"
        if self.last is None:
            return f"{where} has issued no collective yet"
        return f"{where} is not in a collective: its last was {self.last.describe()}, {self.for_s:.0f} s ago"


def _crc(text: str) -> int:
    crc = _CRC.get(text)
    if crc is None:
        crc = zlib.crc32(text.encode())
        if len(_CRC) < _CRC_MAX:
            _CRC[text] = crc
    return crc


def format_nbytes(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


class CollectiveTracker:
    """This rank's position in its group's sequence of collectives."""

    def __init__(self) -> None:
        self.seq = 0  # collectives issued so far
        self.last: Issued | None = None  # the latest one issued
        self.last_at = time.monotonic()  # when it was issued
        self.waiting: Issued | None = None  # the one this rank is blocked in now
        self.waiting_since = 0.0  # monotonic time it started waiting
        self.track_pending = False  # keep issued works until they complete (the watchdog on NCCL)
        self._pending: deque[tuple[Issued, Any, float]] = deque()  # (issued, torch Work, when), oldest first
        self.recent: deque[Issued] = deque(maxlen=RECENT)  # the latest issued, oldest first
        self.digest = 0  # of the collectives issued since the last agreement
        self.since: list[Issued] = []  # those collectives (at most SINCE_MAX), oldest first

    def issue(self, op: str, name: str, nbytes: int) -> Issued:
        self.seq += 1
        self.last, self.last_at = Issued(self.seq, op, name, nbytes), time.monotonic()
        self.recent.append(self.last)
        self.digest = (self.digest * _MIX + (_crc(name) << 32 ^ _crc(op)) + nbytes) % _MOD
        if len(self.since) < SINCE_MAX:
            self.since.append(self.last)
        return self.last

    def issued_at(self, seq: int) -> Issued | None:
        """The collective issued under ``seq``, if it is among those since the last agreement (or
        the latest ``RECENT``)."""
        since = self.since
        at = seq - since[0].seq if since else -1
        if 0 <= at < len(since):
            return since[at]
        return next((i for i in tuple(self.recent) if i.seq == seq), None)

    def agreed(self) -> None:
        """An agreement compared the digests: start anew (see [Note: digest since the last agreement])."""
        self.digest, self.since = 0, []

    def launched(self, issued: Issued, work: Any) -> None:
        """``issued`` is in flight as ``work`` (kept only while the watchdog needs it)."""
        if self.track_pending and work is not None:
            self._pending.append((issued, work, time.monotonic()))

    def stuck_in(self) -> tuple[Issued | None, float]:
        """The collective this rank is held up by, and for how long: the one it is blocked in, or
        (NCCL, whose waits do not block) the oldest it issued that has not completed."""
        if self.waiting is not None:
            return self.waiting, self.blocked_for()
        while self._pending and self._pending[0][1].is_completed():
            self._pending.popleft()
        if not self._pending:
            return None, 0.0
        issued, _, since = self._pending[0]
        return issued, time.monotonic() - since

    @contextmanager
    def blocked_in(self, issued: Issued | None) -> Generator[None, None, None]:
        """The caller blocks in ``issued`` until the block ends (nested blocks keep the outer one)."""
        if issued is None or self.waiting is not None:
            yield
            return
        self.waiting_since, self.waiting = time.monotonic(), issued
        try:
            yield
        finally:
            self.waiting = None

    def current(self) -> Issued | None:
        """The collective this rank is in, or else the last it issued."""
        return self.waiting if self.waiting is not None else self.last

    def blocked_for(self) -> float:
        """Seconds blocked in the current collective (0 when not blocked)."""
        return time.monotonic() - self.waiting_since if self.waiting is not None else 0.0

    def state(self, rank: int, host: str) -> RankState:
        stuck, for_s = self.stuck_in()
        recent = self._recent()
        if stuck is not None:
            return RankState(rank, host, self.last, stuck, for_s, recent)
        return RankState(rank, host, self.last, None, time.monotonic() - self.last_at, recent)

    def _recent(self) -> tuple[Issued, ...]:
        """A copy of ``recent`` from another thread (retried if the training thread appended meanwhile)."""
        for _ in range(3):
            try:
                return tuple(self.recent)
            except RuntimeError:  # deque mutated during iteration
                continue
        return ()

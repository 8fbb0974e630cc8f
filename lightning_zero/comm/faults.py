"""Failures that travel: a rank that fails says why in the process group's store, its peers read it.

[Note: failures travel through the store]
A collective cannot tell a rank why it failed: when one rank raises (an unused parameter, a bad
batch, out of memory) and leaves, its peers only see their own collective end with the backend's
words ("Connection closed by peer" on gloo, a timeout on NCCL). So before a failing rank leaves,
:meth:`FaultBoard.publish` writes its rank, host, pid, step, error and collective into the
process group's key-value store (the TCPStore every rank already reaches: no collective, which
the failing rank could not finish anyway). A rank whose collective fails notes itself in the
store and reads the board: it raises :class:`PeerFailure` with the failing rank's own message.
If after ``fault_wait_s`` seconds no rank has published an error, the ranks that have neither
published nor noted themselves are the ones that left without a word (SIGKILL, a segfault, a lost
host): they are named, with their host and pid, beside the collective the survivor was in. On one
host a pid can be checked, so a dead process is named as dead.

Keys live under ``lightning_zero/<generation>/``; the generation counts the boards opened on this
store (each rank opens one per fit), so a second fit in the same process group never reads the
first one's faults. The store is hosted by rank 0's process: if rank 0 dies the store goes with
it, and the survivors say so, naming rank 0's host from the table exchanged at setup.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch.distributed as dist

from lightning_zero.comm.tracker import Issued, RankState

PREFIX = "lightning_zero"  # of every key this package writes into the store
READ_PAUSE_S = 0.1  # between two reads of the board while waiting for a failing rank's message


class RankInfo(NamedTuple):
    rank: int
    host: str
    pid: int

    def describe(self) -> str:
        return f"rank {self.rank} ({self.host}, pid {self.pid})"


def this_process(rank: int) -> RankInfo:
    return RankInfo(rank, socket.gethostname(), os.getpid())


class Fault(NamedTuple):
    """What a failing rank publishes before it leaves."""

    rank: int
    host: str
    pid: int
    step: int | None  # the training step (None outside training)
    error: str  # "TypeName: message"
    where: str  # the collective it was in, or its last one
    time: float  # wall clock when published

    def describe(self) -> str:
        at = f" at step {self.step}" if self.step is not None else ""
        return f"rank {self.rank} ({self.host}, pid {self.pid}) failed{at}: {self.error}"


class CollectivesStopped(RuntimeError):
    """A collective asked for after this rank failed, or while the ranks are out of step."""


class PeerFailure(RuntimeError):
    """A collective on this rank could not complete because another rank failed or left.

    The message is the failing rank's own (see [Note: failures travel through the store]).
    ``faults`` holds what failing ranks published; ``lost`` the ranks that left without a word.
    """

    def __init__(self, message: str, faults: Sequence[Fault] = (), lost: Sequence[RankInfo] = ()) -> None:
        super().__init__(message)
        self.faults = list(faults)  # published by the failing ranks, earliest first
        self.lost = list(lost)  # ranks that neither published nor answered


class StoreUnreachable(RuntimeError):
    """The process group's store did not answer (its host, rank 0, is probably gone)."""


def describe_error(err: BaseException) -> str:
    """``TypeName: first line of the message`` (at most 2,000 characters)."""
    text = str(err).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(err).__name__}: {first[:2000]}"


class FaultBoard:
    """This run's faults, notes and state reports in the process group's store.

    Args:
        store: a torch.distributed Store (TCPStore, FileStore, ...), shared by every rank.
        prefix: the key prefix of this board (one generation, see the Note above).
        rank, world_size: this rank and N.
    """

    def __init__(self, store: Any, prefix: str, rank: int, world_size: int) -> None:
        self.store = store  # torch.distributed Store
        self.prefix = prefix  # e.g. "lightning_zero/0/"
        self.rank = rank
        self.world_size = world_size
        self._deviations: tuple[int, dict[int, Issued]] = (0, {})  # (the counter when read, what was read)

    @classmethod
    def open(cls, store: Any, rank: int, world_size: int) -> FaultBoard:
        """Every rank calls it once per run (the generation is counted from these calls)."""
        opened = store.add(f"{PREFIX}/boards_opened", 1)
        board = cls(store, f"{PREFIX}/{(opened - 1) // world_size}/", rank, world_size)
        board.beat()  # the key exists from now on
        return board

    # -- store access ------------------------------------------------------------------------

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self.store, method)(*args)
        except Exception as err:  # the store's host is gone, or its connection is
            raise StoreUnreachable(
                f"the process group's store did not answer ({describe_error(err)})"
            ) from err

    def _set(self, key: str, value: Any) -> None:
        self._call("set", self.prefix + key, json.dumps(value))

    def _get(self, key: str) -> Any:
        return json.loads(self._call("get", self.prefix + key))

    def _has(self, key: str) -> bool:
        return bool(self._call("check", [self.prefix + key]))

    def _count(self, key: str, add: int = 0) -> int:
        return int(self._call("add", self.prefix + key, add))

    # -- faults and notes --------------------------------------------------------------------

    def publish(self, fault: Fault) -> None:
        """Tell every rank why this one fails (before it leaves)."""
        self._set(f"fault/{fault.rank}", list(fault))
        self._count("faults", 1)

    def fault_count(self) -> int:
        """How many ranks published a fault: one cheap read, for polling."""
        return self._count("faults")

    def faults(self) -> list[Fault]:
        """Every published fault, earliest first."""
        if self.fault_count() == 0:
            return []
        found = [Fault(*self._get(f"fault/{r}")) for r in range(self.world_size) if self._has(f"fault/{r}")]
        return sorted(found, key=lambda f: f.time)

    def publish_stop(self, reason: str) -> None:
        """Every rank must stop for ``reason`` (a desync the watchdog found): counted as a fault."""
        self._set("stop", reason)
        self._count("faults", 1)

    def stop_reason(self) -> str | None:
        return self._get("stop") if self._has("stop") else None

    def note(self, rank: int, where: str) -> None:
        """A rank whose collective failed says it is alive, and where it was."""
        self._set(f"note/{rank}", where)

    def noted(self) -> set[int]:
        return {r for r in range(self.world_size) if self._has(f"note/{r}")}

    def wait_for_cause(self, seconds: float) -> tuple[list[Fault], set[int]]:
        """Faults published within ``seconds`` (at once when there are any), and the ranks that
        neither published nor noted themselves by then (every other rank noted: nobody is lost)."""
        deadline = time.monotonic() + seconds
        while True:
            faults = self.faults()
            if faults:
                return faults, set()
            silent = set(range(self.world_size)) - self.noted() - {self.rank}
            if not silent or time.monotonic() >= deadline:
                return [], silent
            time.sleep(READ_PAUSE_S)

    # -- signs of life ------------------------------------------------------------------------

    def beat(self) -> None:
        """This rank is alive (the watchdog thread calls it every second)."""
        self._count(f"beat/{self.rank}", 1)

    def beats(self) -> list[int]:
        """Every rank's heartbeat count (one request where the store can read many keys at once)."""
        keys = [f"{self.prefix}beat/{r}" for r in range(self.world_size)]
        if self._call("has_extended_api"):
            return [int(v) for v in self._call("multi_get", keys)]
        return [int(self._call("get", k)) for k in keys]

    # -- state reports (the watchdog) --------------------------------------------------------

    def request_report(self) -> int:
        """Ask every rank to post its state; returns the request's number."""
        return self._count("report_requests", 1)

    def report_requests(self) -> int:
        return self._count("report_requests")

    def post_state(self, request: int, state: RankState) -> None:
        self._set(f"state/{request}/{state.rank}", _state_to_json(state))

    def states(self, request: int) -> dict[int, RankState]:
        found = {}
        for r in range(self.world_size):
            if self._has(f"state/{request}/{r}"):
                found[r] = _state_from_json(self._get(f"state/{request}/{r}"))
        return found

    # -- a desync found by a check (see [Note: checked issue] in ``checks.py``) ------------------

    def post_deviation(self, issued: Issued) -> None:
        """This rank issues ``issued`` where every rank was expected to issue another collective
        ([Note: learned schedule] in ``checks.py``): its latest such, one key per rank."""
        self._set(f"deviation/{self.rank}", list(issued))
        self._count("deviations", 1)

    def deviations(self) -> dict[int, Issued]:
        """Every other rank's latest posted deviation. One store read (a counter) per call; the
        deviations themselves are read again only after another was posted, so that waiting ranks
        poll at a cost that does not grow with N or with the deviations a run has seen."""
        count = self._count("deviations")
        if count != self._deviations[0]:
            self._deviations = (
                count,
                {
                    r: Issued(*self._get(f"deviation/{r}"))
                    for r in range(self.world_size)
                    if r != self.rank and self._has(f"deviation/{r}")
                },
            )
        return self._deviations[1]

    def post_collective(self, check: int | str, issued: Issued) -> None:
        """This rank's collective at its ``check``-th table, which did not match (for its name)."""
        self._set(f"desync/{check}/{self.rank}", list(issued))

    def collectives(
        self, check: int | str, seconds: float, ranks: list[int] | None = None
    ) -> dict[int, Issued]:
        """Every rank's (of ``ranks``; None: all) collective posted for the ``check``-th table,
        waiting up to ``seconds``."""
        deadline = time.monotonic() + seconds
        ranks = list(range(self.world_size)) if ranks is None else ranks
        while True:
            found = {
                r: Issued(*self._get(f"desync/{check}/{r}"))
                for r in ranks
                if self._has(f"desync/{check}/{r}")
            }
            if len(found) == len(ranks) or time.monotonic() >= deadline:
                return found
            time.sleep(READ_PAUSE_S)


def _state_to_json(state: RankState) -> list:
    recent = [list(i) for i in state.recent]
    return [
        state.rank,
        state.host,
        _issued_json(state.last),
        _issued_json(state.waiting),
        state.for_s,
        recent,
    ]


def _state_from_json(value: list) -> RankState:
    rank, host, last, waiting, for_s, recent = value
    return RankState(
        rank,
        host,
        Issued(*last) if last else None,
        Issued(*waiting) if waiting else None,
        for_s,
        tuple(Issued(*i) for i in recent),
    )


def _issued_json(issued: Issued | None) -> list | None:
    return list(issued) if issued is not None else None


class Liveness:
    """Which peers are gone: a pid on this host that no longer runs (at once), or a heartbeat that
    has stood still for ``stall_s`` seconds since the first look (see [Note: failures travel
    through the store]). Call :meth:`reset` when the wait it watches ends.
    """

    def __init__(self, board: FaultBoard, ranks: Sequence[RankInfo], me: int, stall_s: float) -> None:
        self.board = board
        self.ranks = list(ranks)  # every rank's host and pid
        self.me = me
        self.stall_s = stall_s
        self._seen: tuple[float, list[int]] | None = None  # (when, heartbeats) at the first look

    def reset(self) -> None:
        self._seen = None

    def lost(self) -> tuple[list[RankInfo], float | None]:
        """The lost peers, and how long their heartbeat stood still (None: found by their pid)."""
        gone = [i for i in self.ranks if i.rank != self.me and process_exists(i) is False]
        if gone:  # not those that noted themselves on the board before they left (they said a word)
            noted = self.board.noted()
            gone = [i for i in gone if i.rank not in noted]
        if gone:
            return gone, None
        now = time.monotonic()
        if self._seen is None:
            self._seen = (now, self.board.beats())
            return [], None
        since, before = self._seen
        if now - since < self.stall_s:
            return [], None
        beats = self.board.beats()
        self._seen = (now, beats)
        still = [self.ranks[r] for r, (a, b) in enumerate(zip(before, beats)) if a == b and r != self.me]
        return still, now - since


# --------------------------------------------------------------------------- messages


def process_exists(info: RankInfo) -> bool | None:
    """Whether ``info``'s process still runs; None when it cannot be told (another host)."""
    if info.host != socket.gethostname():
        return None
    try:
        os.kill(info.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed process whose parent has not collected it yet is a zombie: dead all the same
        with open(f"/proc/{info.pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


def lost_message(
    lost: Sequence[RankInfo], me: int, where: str, err: BaseException | None, *, silent_s: float | None = None
) -> str:
    """The ranks that left without a word, and where this rank was when it noticed."""
    parts = []
    for info in lost:
        if process_exists(info) is False:
            parts.append(f"{info.describe()} is gone without a word (killed by a signal, or crashed)")
        elif silent_s is not None:
            parts.append(
                f"{info.describe()} has shown no sign of life for {silent_s:.0f} s: it died without a word "
                "(killed, crashed, host lost) or is frozen"
            )
        else:
            parts.append(
                f"{info.describe()} did not answer: it died without a word (killed, crashed, host lost) "
                "or is blocked outside lightning_zero's collectives"
            )
    backend = f" ({describe_error(err)})" if err is not None else ""
    return f"{'; '.join(parts)}. Rank {me} was in {where} when it noticed{backend}"


def fault_message(faults: Sequence[Fault], me: int, where: str, err: BaseException | None) -> str:
    """The failing ranks' own messages, and what this rank was doing (and its backend's words)."""
    first, *others = faults
    more = "".join(f"; also {f.describe()}" for f in others if f.rank != me)
    backend = f" ({describe_error(err)})" if err is not None else ""
    return f"{first.describe()} (its last collective: {first.where}){more}. Rank {me} stops too: it was in {where}{backend}"


def store_lost_message(ranks: Sequence[RankInfo], me: int, where: str, err: BaseException) -> str:
    host = ranks[0].describe() if ranks else "rank 0"
    return (
        f"the process group's store, hosted by {host}, does not answer: rank 0 has probably died "
        f"(killed, crashed, host lost). Rank {me} was in {where} ({describe_error(err)})"
    )


def leave_without_destroying(status: int = 1) -> None:
    """End the process now, logs flushed, without tearing the process group down (see [Note:
    waiting without hanging] in ``waiting.py``: gloo would wait for collectives that never end)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed stream: nothing left to lose
            pass
    os._exit(status)


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

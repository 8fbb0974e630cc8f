"""CommLedger: every collective this package issues, per training step, in bounded memory.

[Note: logical bytes]
Two byte counts are kept for each collective, both computed from the tensors, never measured on
the wire:

- ``payload_bytes``: the size of the full logical tensor the collective operates on (the bucket of
  an AllReduce, the unsharded flat tensor of a ReduceScatter or AllGather).
- ``wire_bytes``: what one rank sends under the ring algorithm: AllReduce 2(N-1)/N x payload,
  ReduceScatter and AllGather (N-1)/N x payload, Broadcast payload (root) - the figures the ZeRO
  analysis uses (2Ψ for DP, 3Ψ for ZeRO-3).

Backends differ from the ring model (gloo's reduce-scatter, for one, sends as much as an
AllReduce), so these are the algorithm's logical figures, the same on every backend.

[Note: bounded ledger]
A run issues a few collectives per step for as long as it trains, so the ledger keeps three
things of bounded size instead of one list that grows with the run:

- ``records``: the latest ``max_records`` CommRecords (the detail: names, sizes), oldest dropped
  first, in storage laid out when the ledger is made (names interned: the records of one bucket
  or unit share one string). ``recorded`` counts every record ever made, and
  ``records_since(n)`` returns those made after the n-th, so a reader that remembers
  ``recorded`` reads only what is new: the monitor's cost per step is the number of collectives
  of that step, whatever the length of the run.
- per-step aggregates (calls, payload, wire bytes, seconds blocked, per op) of the latest
  ``max_steps`` steps (about 1 KB a step: what a monitor or a benchmark reads back, the last steps);
- run totals per op, and the seconds blocked per op, over the whole run.

Waits on CUDA tensors are timed on the stream ([Note: timing a wait] in ``timing.py``) and resolved
later: ``pending`` holds only those whose events the GPU has not run yet (each new one first
resolves those complete), and every read of the seconds blocked first resolves them all.

[Note: links]
Each collective is also filed under the link it crosses: ``"intra"`` when every rank of its group
is on one node, ``"inter"`` when the group spans nodes (nodes as the cluster environment numbers
them; [Note: shard groups and replicate groups] in ``mesh.py``). With hybrid sharding the shard
groups' gathers and reduce-scatters stay on ``"intra"`` and only the replicate groups' all-reduces
cross to ``"inter"``; the planner's split (docs/planning.md) predicts the same wire bytes per link.

Control collectives (the per-batch agreement on signals and data, the non-finite guard's flags,
the exchange of host names at setup) are not ZeRO traffic: they are counted apart, in
``control``, so that the per-step figures compare one to one with the ZeRO plan; so are the
checks that precede each collective on gloo, in ``checks`` ([Note: checked issue] in ``checks.py``).
"""

from __future__ import annotations

import sys
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Iterator
from typing import NamedTuple, Protocol

from lightning_zero.comm.timing import CUDA_EVENTS, WALL_CLOCK

_WIRE_FACTOR = {  # ring-algorithm bytes sent per rank, as a multiple of (N-1)/N x payload
    "all_reduce": 2.0,
    "reduce_scatter": 1.0,
    "all_gather": 1.0,
}
MAX_RECORDS = 4_096  # default detail window: 56 bytes a record, laid out once (230 KB)
MAX_STEPS = 128  # default number of steps whose aggregates are kept (about 1 KB each)


class CommRecord(NamedTuple):
    step: int  # training step the collective belongs to (the ledger's current step)
    op: str  # all_reduce | reduce_scatter | all_gather | broadcast
    name: str  # readable label, e.g. "zero0/all_reduce/bucket=3"
    payload_bytes: int  # size of the full logical tensor
    wire_bytes: float  # bytes one rank sends under the ring algorithm
    group_size: int  # N of the process group
    link: str = "intra"  # "intra" (one node) or "inter" (the group spans nodes); see [Note: links]


class Interval(Protocol):
    """A wait timed on a device (a :class:`~lightning_zero.comm.timing.StreamInterval`)."""

    def done(self) -> bool: ...

    def seconds(self) -> float: ...


class PendingWait(NamedTuple):
    step: int  # the ledger's step when the wait happened
    op: str  # the ledger's key for the blocked time
    interval: Interval  # its events; resolved once they have run


class OpTotals(NamedTuple):
    calls: int
    payload_bytes: int
    wire_bytes: float


def wire_bytes(op: str, payload_bytes: int, group_size: int) -> float:
    """Bytes one rank sends for ``op`` on ``payload_bytes`` under the ring algorithm."""
    if group_size <= 1:
        return 0.0
    if op == "broadcast":
        return float(payload_bytes)
    return _WIRE_FACTOR[op] * (group_size - 1) / group_size * payload_bytes


def _add(totals: dict[str, OpTotals], op: str, payload: int, wire: float) -> None:
    calls, p, w = totals.get(op, OpTotals(0, 0, 0.0))
    totals[op] = OpTotals(calls + 1, p + payload, w + wire)


class _RecordRing:
    """The latest ``size`` CommRecords in storage laid out once, when the ledger is made: numbers in
    typed arrays, strings as references to interned ones, so that a record costs no allocation and
    filling the window does not grow the process (see [Note: bounded ledger]). Reads build the
    CommRecords; it reads like a bounded deque (``len``, iteration, ``[i]``, ``maxlen``)."""

    def __init__(self, size: int) -> None:
        self.size = size
        zeros = bytes(8 * size)
        self._step, self._payload, self._group = array("q", zeros), array("q", zeros), array("q", zeros)
        self._wire = array("d", zeros)
        self._op: list[str] = [""] * size
        self._name: list[str] = [""] * size
        self._link: list[str] = [""] * size
        self.count = 0  # records appended since made (or cleared)

    def append(self, step: int, op: str, name: str, payload: int, wire: float, group: int, link: str) -> None:
        i = self.count % self.size
        self._step[i], self._payload[i], self._wire[i], self._group[i] = step, payload, wire, group
        self._op[i], self._name[i], self._link[i] = op, name, link
        self.count += 1

    @property
    def maxlen(self) -> int:
        return self.size

    def __len__(self) -> int:
        return min(self.count, self.size)

    def _record(self, i: int) -> CommRecord:
        return CommRecord(
            self._step[i],
            self._op[i],
            self._name[i],
            self._payload[i],
            self._wire[i],
            self._group[i],
            self._link[i],
        )

    def __getitem__(self, index: int) -> CommRecord:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"record {index} of {n}")
        return self._record((self.count - n + index % n) % self.size)

    def __iter__(self) -> Iterator[CommRecord]:
        return iter(self.latest(len(self)))

    def latest(self, n: int) -> list[CommRecord]:
        """The latest ``n`` records (at most those kept), oldest first."""
        n = max(0, min(n, len(self)))
        return [self._record((self.count - n + k) % self.size) for k in range(n)]

    def clear(self) -> None:
        self.count = 0


class _StepTotals:
    """One step's aggregates: calls and bytes per op, seconds blocked per op."""

    __slots__ = ("links", "traffic", "waits")

    def __init__(self) -> None:
        self.traffic: dict[str, OpTotals] = {}  # op -> calls, payload, wire bytes
        self.links: Counter[str] = Counter()  # link -> wire bytes (see [Note: links])
        self.waits: Counter[str] = Counter()  # op -> seconds blocked in wait()


class CommLedger:
    """The collectives of a run, grouped by step, in bounded memory (see [Note: bounded ledger]).

    Args:
        max_records: how many of the latest records are kept in detail.
        max_steps: how many of the latest steps keep their per-step aggregates.
    """

    def __init__(self, *, max_records: int = MAX_RECORDS, max_steps: int = MAX_STEPS) -> None:
        if max_records < 1 or max_steps < 1:
            raise ValueError(f"max_records and max_steps must be >= 1, got {max_records} and {max_steps}")
        self.step = 0  # current step; set by the strategy at each training batch
        self.records = _RecordRing(max_records)  # the latest records, in issue order
        self.recorded = 0  # records made since the ledger was created (or cleared)
        self.max_steps = max_steps
        self._steps: OrderedDict[int, _StepTotals] = OrderedDict()  # the latest max_steps steps
        self._run: dict[str, OpTotals] = {}  # op -> totals over the whole run
        self._run_links: Counter[str] = Counter()  # link -> wire bytes over the whole run
        self._run_waits: Counter[str] = Counter()  # op -> seconds blocked over the whole run
        self._timed: Counter[str] = Counter()  # timing method -> waits timed with it over the run
        self.pending: deque[PendingWait] = deque()  # stream-timed waits the GPU has not finished
        self.control = OpTotals(0, 0, 0.0)  # control collectives: calls, payload, wire bytes
        self.checks = OpTotals(0, 0, 0.0)  # checks before a collective (gloo, checks.py): calls, bytes

    def _totals_of(self, step: int) -> _StepTotals:
        entry = self._steps.get(step)
        if entry is None:
            entry = self._steps[step] = _StepTotals()
            while len(self._steps) > self.max_steps:
                self._steps.popitem(last=False)
        return entry

    def begin_step(self, step: int) -> None:
        self.step = step

    def record(
        self,
        op: str,
        name: str,
        payload_bytes: int,
        group_size: int,
        *,
        wire: float | None = None,
        link: str = "intra",
    ) -> None:
        """File one collective under the current step; ``wire`` overrides the ring model (a gather);
        ``link``: the link its group crosses (see [Note: links])."""
        wire = wire_bytes(op, payload_bytes, group_size) if wire is None else wire
        name = sys.intern(name)  # one string per name however many records hold it
        self.records.append(self.step, op, name, payload_bytes, wire, group_size, link)
        self.recorded += 1
        entry = self._totals_of(self.step)
        _add(entry.traffic, op, payload_bytes, wire)
        entry.links[link] += wire
        _add(self._run, op, payload_bytes, wire)
        self._run_links[link] += wire

    def record_control(self, payload_bytes: int, group_size: int) -> None:
        """A control collective (an AllReduce of flags): counted apart from the ZeRO traffic."""
        calls, payload, wire = self.control
        sent = wire_bytes("all_reduce", payload_bytes, group_size)
        self.control = OpTotals(calls + 1, payload + payload_bytes, wire + sent)

    def record_check(self, payload_bytes: int, group_size: int) -> None:
        """The check before a collective ([Note: checked issue] in ``checks.py``): counted apart."""
        calls, payload, wire = self.checks
        sent = wire_bytes("all_reduce", payload_bytes, group_size)
        self.checks = OpTotals(calls + 1, payload + payload_bytes, wire + sent)

    def add_wait(self, op: str, seconds: float) -> None:
        """Wall-clock time the caller was blocked waiting for ``op`` collectives (communication not
        hidden)."""
        self._timed[WALL_CLOCK] += 1
        self._file_wait(self.step, op, seconds)

    def add_stream_wait(self, op: str, interval: Interval) -> None:
        """A wait for ``op`` timed on the device's stream, filed once its events have run (see
        [Note: timing a wait] in ``timing.py``); never blocks."""
        self._timed[CUDA_EVENTS] += 1
        self._resolve(block=False)
        self.pending.append(PendingWait(self.step, op, interval))

    def settle(self) -> None:
        """File every pending stream-timed wait, waiting for the GPU to run their events: for
        readers (the monitor at the end of a step), never the training path."""
        self._resolve(block=True)

    def _resolve(self, *, block: bool) -> None:
        while self.pending:  # one stream runs its events in order: stop at the first still running
            step, op, interval = self.pending[0]
            if not block and not interval.done():
                return
            self.pending.popleft()
            self._file_wait(step, op, interval.seconds())

    def _file_wait(self, step: int, op: str, seconds: float) -> None:
        entry = self._totals_of(step) if step == self.step else self._steps.get(step)
        if entry is not None:  # a step dropped from the kept ones counts in the run totals only
            entry.waits[op] += seconds
        self._run_waits[op] += seconds

    @property
    def timing(self) -> str | None:
        """How the waits were timed: ``"wall-clock"``, ``"cuda-events"`` (both, joined by " + "),
        None before the first wait."""
        return timing_of(self._timed)

    def wait_timings(self) -> Counter[str]:
        """Timing method -> waits timed with it over the whole run (a copy)."""
        return Counter(self._timed)

    def records_since(self, recorded: int) -> list[CommRecord]:
        """The records made after the first ``recorded`` ones (those still in the window)."""
        return self.records.latest(self.recorded - recorded)  # O(new), not O(window)

    def wait_totals(self) -> Counter[str]:
        """Seconds blocked per op over the whole run (a copy; pending waits settled first)."""
        self.settle()
        return Counter(self._run_waits)

    def wait_seconds(self, step: int) -> dict[str, float]:
        self.settle()
        entry = self._steps.get(step)
        return dict(entry.waits) if entry is not None else {}

    @property
    def waits(self) -> dict[tuple[int, str], float]:
        """(step, op) -> seconds blocked, for the steps still kept (pending waits settled first)."""
        self.settle()
        return {(s, op): t for s, entry in self._steps.items() for op, t in entry.waits.items()}

    def clear(self) -> None:
        self.records.clear()
        self.recorded = 0
        self._steps.clear()
        self._run.clear()
        self._run_links.clear()
        self._run_waits.clear()
        self._timed.clear()
        self.pending.clear()
        self.control = OpTotals(0, 0, 0.0)
        self.checks = OpTotals(0, 0, 0.0)

    def for_step(self, step: int) -> list[CommRecord]:
        """The records of ``step`` still in the detail window."""
        return [r for r in self.records if r.step == step]

    def totals(self, step: int | None = None, *, prefix: str = "") -> dict[str, OpTotals]:
        """Calls and bytes per op, for one step (or the whole run), for names starting with ``prefix``.

        Without a prefix, from the aggregates: exact for the whole run and for the kept steps.
        A prefix needs the names, so it counts only the records still in the detail window.
        """
        if prefix:
            return _sum_records(
                r for r in self.records if (step is None or r.step == step) and r.name.startswith(prefix)
            )
        if step is None:
            return dict(self._run)
        entry = self._steps.get(step)
        return dict(entry.traffic) if entry is not None else {}

    def link_bytes(self, step: int | None = None) -> dict[str, float]:
        """Wire bytes per link (``"intra"``, ``"inter"``; see [Note: links]) for one kept step, or
        the whole run."""
        if step is None:
            return dict(self._run_links)
        entry = self._steps.get(step)
        return dict(entry.links) if entry is not None else {}

    def steps(self) -> list[int]:
        """The kept steps that issued a collective, in order."""
        return sorted(s for s, entry in self._steps.items() if entry.traffic)


def timing_of(timed: Counter[str]) -> str | None:
    """The timing methods with a wait in ``timed`` (method -> waits), joined by " + "; None if none."""
    return " + ".join(sorted(method for method, count in timed.items() if count > 0)) or None


def _sum_records(records: Iterable[CommRecord]) -> dict[str, OpTotals]:
    totals: dict[str, OpTotals] = {}
    for r in records:
        _add(totals, r.op, r.payload_bytes, r.wire_bytes)
    return totals

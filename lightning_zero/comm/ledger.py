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
  first. ``recorded`` counts every record ever made, and ``records_since(n)`` returns those made
  after the n-th, so a reader that remembers ``recorded`` reads only what is new: the monitor's
  cost per step is the number of collectives of that step, whatever the length of the run.
- per-step aggregates (calls, payload, wire bytes, seconds blocked, per op) of the latest
  ``max_steps`` steps;
- run totals per op, and the seconds blocked per op, over the whole run.

Control collectives (the per-batch agreement on signals and data, the non-finite guard's flags,
the exchange of host names at setup) are not ZeRO traffic: they are counted apart, in
``control``, so that the per-step figures compare one to one with the ZeRO plan.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Iterable
from itertools import islice
from typing import NamedTuple

_WIRE_FACTOR = {  # ring-algorithm bytes sent per rank, as a multiple of (N-1)/N x payload
    "all_reduce": 2.0,
    "reduce_scatter": 1.0,
    "all_gather": 1.0,
}
MAX_RECORDS = 4_096  # default detail window: about 0.6 MB of records
MAX_STEPS = 1_000  # default number of steps whose aggregates are kept


class CommRecord(NamedTuple):
    step: int  # training step the collective belongs to (the ledger's current step)
    op: str  # all_reduce | reduce_scatter | all_gather | broadcast
    name: str  # readable label, e.g. "zero0/all_reduce/bucket=3"
    payload_bytes: int  # size of the full logical tensor
    wire_bytes: float  # bytes one rank sends under the ring algorithm
    group_size: int  # N of the process group


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


class _StepTotals:
    """One step's aggregates: calls and bytes per op, seconds blocked per op."""

    __slots__ = ("traffic", "waits")

    def __init__(self) -> None:
        self.traffic: dict[str, OpTotals] = {}  # op -> calls, payload, wire bytes
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
        self.records: deque[CommRecord] = deque(maxlen=max_records)  # the latest records, in issue order
        self.recorded = 0  # records made since the ledger was created (or cleared)
        self.max_steps = max_steps
        self._steps: OrderedDict[int, _StepTotals] = OrderedDict()  # the latest max_steps steps
        self._run: dict[str, OpTotals] = {}  # op -> totals over the whole run
        self._run_waits: Counter[str] = Counter()  # op -> seconds blocked over the whole run
        self.control = OpTotals(0, 0, 0.0)  # control collectives: calls, payload, wire bytes

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
        self, op: str, name: str, payload_bytes: int, group_size: int, *, wire: float | None = None
    ) -> None:
        """File one collective under the current step; ``wire`` overrides the ring model (a gather)."""
        wire = wire_bytes(op, payload_bytes, group_size) if wire is None else wire
        self.records.append(CommRecord(self.step, op, name, payload_bytes, wire, group_size))
        self.recorded += 1
        _add(self._totals_of(self.step).traffic, op, payload_bytes, wire)
        _add(self._run, op, payload_bytes, wire)

    def record_control(self, payload_bytes: int, group_size: int) -> None:
        """A control collective (an AllReduce of flags): counted apart from the ZeRO traffic."""
        calls, payload, wire = self.control
        sent = wire_bytes("all_reduce", payload_bytes, group_size)
        self.control = OpTotals(calls + 1, payload + payload_bytes, wire + sent)

    def add_wait(self, op: str, seconds: float) -> None:
        """Time the caller was blocked waiting for ``op`` collectives (communication not hidden)."""
        self._totals_of(self.step).waits[op] += seconds
        self._run_waits[op] += seconds

    def records_since(self, recorded: int) -> list[CommRecord]:
        """The records made after the first ``recorded`` ones (those still in the window)."""
        new = min(self.recorded - recorded, len(self.records))
        latest = list(islice(reversed(self.records), max(new, 0)))  # O(new), not O(window)
        return latest[::-1]

    def wait_totals(self) -> Counter[str]:
        """Seconds blocked per op over the whole run (a copy)."""
        return Counter(self._run_waits)

    def wait_seconds(self, step: int) -> dict[str, float]:
        entry = self._steps.get(step)
        return dict(entry.waits) if entry is not None else {}

    @property
    def waits(self) -> dict[tuple[int, str], float]:
        """(step, op) -> seconds blocked, for the steps still kept."""
        return {(s, op): t for s, entry in self._steps.items() for op, t in entry.waits.items()}

    def clear(self) -> None:
        self.records.clear()
        self.recorded = 0
        self._steps.clear()
        self._run.clear()
        self._run_waits.clear()
        self.control = OpTotals(0, 0, 0.0)

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

    def steps(self) -> list[int]:
        """The kept steps that issued a collective, in order."""
        return sorted(s for s, entry in self._steps.items() if entry.traffic)


def _sum_records(records: Iterable[CommRecord]) -> dict[str, OpTotals]:
    totals: dict[str, OpTotals] = {}
    for r in records:
        _add(totals, r.op, r.payload_bytes, r.wire_bytes)
    return totals

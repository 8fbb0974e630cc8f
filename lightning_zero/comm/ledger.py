"""CommLedger: every collective this package issues, per training step.

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
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

_WIRE_FACTOR = {  # ring-algorithm bytes sent per rank, as a multiple of (N-1)/N x payload
    "all_reduce": 2.0,
    "reduce_scatter": 1.0,
    "all_gather": 1.0,
}


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


class CommLedger:
    """Append-only list of collectives, grouped by step."""

    def __init__(self) -> None:
        self.step = 0  # current step; set by the strategy at each training batch
        self.records: list[CommRecord] = []  # every collective so far, in issue order
        self.waits: dict[tuple[int, str], float] = defaultdict(float)  # (step, op) -> seconds blocked

    def add_wait(self, op: str, seconds: float) -> None:
        """Time the caller was blocked waiting for ``op`` collectives (communication not hidden)."""
        self.waits[(self.step, op)] += seconds

    def wait_seconds(self, step: int) -> dict[str, float]:
        return {op: t for (s, op), t in self.waits.items() if s == step}

    def begin_step(self, step: int) -> None:
        self.step = step

    def record(self, op: str, name: str, payload_bytes: int, group_size: int) -> None:
        wire = wire_bytes(op, payload_bytes, group_size)
        self.records.append(CommRecord(self.step, op, name, payload_bytes, wire, group_size))

    def clear(self) -> None:
        self.records.clear()
        self.waits.clear()

    def for_step(self, step: int) -> list[CommRecord]:
        return [r for r in self.records if r.step == step]

    def totals(self, step: int | None = None, *, prefix: str = "") -> dict[str, OpTotals]:
        """Calls and bytes per op, for one step (or all steps), for names starting with ``prefix``."""
        calls: dict[str, int] = defaultdict(int)
        payload: dict[str, int] = defaultdict(int)
        wire: dict[str, float] = defaultdict(float)
        for r in self.records:
            if (step is None or r.step == step) and r.name.startswith(prefix):
                calls[r.op] += 1
                payload[r.op] += r.payload_bytes
                wire[r.op] += r.wire_bytes
        return {op: OpTotals(calls[op], payload[op], wire[op]) for op in calls}

    def steps(self) -> list[int]:
        return sorted({r.step for r in self.records})

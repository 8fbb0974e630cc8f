"""The host side group: one small table per control collective, and the check before a collective.

[Note: checked issue]
Every rank must issue the same collectives in the same order ([Note: collective sequence numbers]
in ``tracker.py``). When one does not (a rank skips a collective, or issues one of another size),
gloo pairs the wrong collectives: of different sizes, its transport thread aborts the receiving
process from C++ (``EnforceNotMet ... Received data size doesn't match expected size``, status
-6) before any Python code runs, and when that process is rank 0 the store goes with it, so the
peer can only say that rank 0 is gone. So on gloo every collective is checked before it is
issued: every rank writes the collective's row (sequence number, op, payload bytes, CRC32 of its
name) into a host table of N rows, one AllReduce of 40N bytes over a gloo *side group* makes every
row known on every rank, and the collective is issued only when all rows are equal. Rows that
differ are a desync, certain and seen by every rank at once: each rank publishes its collective
(name included) on the fault board, reads the others', and raises ``CollectivesStopped`` with
one line per rank, before anything was sent that could abort a process.

The side group is a gloo group of its own, created once (collectively) by ``watch_faults``. It
carries nothing but these tables, all of one shape, so in a desync a table always pairs with a
table of the same size: a check never aborts. On the main group it could pair with one of
Lightning's own collectives of another size. The per-batch agreement of signals and last batches
(``Communicator.agree``) is such a table too, with the flags in column 0: on NCCL it costs no
device-to-host synchronisation (the table lives on the host) and it checks the ranks' positions
once per batch, where NCCL itself would pair mismatched collectives silently or hang.

Cost on gloo: one AllReduce of 40N bytes and a host wait per checked collective
(``CommLedger.checks`` counts them). The wait is the larger part: it holds a rank that issues an
asynchronous collective (a prefetched all-gather, a reduce-scatter in backward) until its peer
reaches the same collective, which takes away the slack that lets ranks drift within a step. So
once a step's collectives repeat, they are no longer checked one by one (next note). A rank that waits in a check for a slower rank waits there instead of in the
collective, so that time is added to the ledger's waits under the collective's op, as exposed
communication, the same as the collective's own wait would have been. NCCL collectives are not
checked one by one (the host would wait for its peers at every collective, and NCCL does not
abort on sizes): the agreement and the watchdog check them.

[Note: learned schedule]
A training step issues the same collectives in the same order every step. Each rank keeps a
:class:`Schedule`: for each run of ``CONTEXT`` consecutive collectives (op, bytes, name), the
collective that followed it, and how many checks in a row found that same successor on every
rank (a run rather than one collective: a stage-3 unit's all-gather is followed by the next
unit's in forward and by a reduce-scatter in backward). Once ``TRUST_AFTER`` checks
have (two steps), the successor is *expected*, and a collective equal to the expected one is
issued without a check. The schedule changes only on checked collectives, whose rows every rank
saw alike, so every rank holds the same schedule and expects the same collective at the same
sequence number; ranks that each issue the expected one issue the same collective.

A rank whose collective is not the expected one (a desync, or a change of pattern such as the
end of an epoch, which every rank makes) posts it on the fault board as a *deviation* and checks
it as before. When every rank deviates alike, the check pairs their tables and passes, and the
schedule learns the new successor. When only some do, the others have issued the expected
collective without a check: gloo holds it (nothing is sent to them: the deviating ranks issued
nothing on the main group), and between two wait slices a rank held that way reads the posted
deviations: one whose sequence number names another collective than its own there is a desync
for certain, which it publishes (every rank stops, named, as after a failed check) within a poll
slice or two. A rank held in a wait that no Python code interrupts (one of Lightning's own
collectives) is stopped by the watchdog as any desync is. Collectives whose sizes the package does
not know (Lightning's own, tracked) and control collectives are never expected: they are always
checked. The per-batch agreement still compares the ranks' positions once per batch; it takes
part in the schedule (never expected), and posts a deviation where another collective was
expected (a rank that skipped its optimizer step, and the all-gathers after it, while the others
wait in them). A posted deviation is matched against every collective a rank issued since the
last agreement (not a fixed window: stage 1 launches every bucket before it waits for the first),
and a waiting rank reads two counters per poll: the deviations are read again only after another
was posted.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.distributed as dist

from lightning_zero.comm.tracker import Issued, RankState

OPS = (
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "broadcast",
    "gather",
    "barrier",
    "agree",
    "checkpoint",
    "lightning",
)  # a row's op column is the index in this tuple plus one
FLAGS, SEQ, OP, NBYTES, NAME, DIGEST = range(6)  # the columns of a row
_SIDE_GROUPS: dict[int, tuple[Any, Any]] = {}  # id(process group) -> (that group, its SideGroup)
COLUMNS = 6


def row_of(issued: Issued, flags: int = 0, digest: int = 0) -> list[int]:
    """The row a rank writes for ``issued`` (see [Note: checked issue]); ``digest``: an
    agreement's (see [Note: digest since the last agreement] in tracker.py)."""
    op = OPS.index(issued.op) + 1 if issued.op in OPS else len(OPS) + 1
    return [flags, issued.seq, op, issued.nbytes, zlib.crc32(issued.name.encode()), digest]


def in_step(rows: list[list[int]]) -> bool:
    """Whether every rank's row names the same collective (flags and digest aside)."""
    first = rows[0][SEQ:DIGEST]
    return all(r[SEQ:DIGEST] == first for r in rows[1:])


def issued_from_row(row: list[int]) -> Issued:
    """What a row tells of a rank's collective when its name cannot be read (its CRC32 instead)."""
    op = OPS[row[OP] - 1] if 1 <= row[OP] <= len(OPS) else "unknown op"
    return Issued(row[SEQ], op, f"(name CRC32 {row[NAME]:08x})", row[NBYTES])


class SideGroup:
    """A gloo group over the communicator's ranks and the host table its control collectives use.

    Args:
        group: the gloo process group.
        world_size: N, the rows of the table.
    """

    def __init__(self, group: Any, world_size: int) -> None:
        self.group = group  # torch ProcessGroup (gloo), for tables only
        self.table = torch.zeros(
            world_size, COLUMNS, dtype=torch.int64
        )  # (N, COLUMNS), host; every use is synchronous
        self.count = 0  # tables exchanged: equal on every rank up to a desync (they pair one to one)

    @classmethod
    def create(cls, group: Any | None, world_size: int) -> SideGroup:
        """Collective over the default group's ranks (``group`` None) or ``group``'s ranks. One per
        process and group: strategies built one after another in a process (several fits, several
        Fabrics) share it, so that no gloo group and its threads pile up per strategy."""
        base = group if group is not None else dist.group.WORLD
        kept = _SIDE_GROUPS.get(id(base))
        if kept is not None and kept[0] is base:
            return kept[1]
        if group is None:
            side = cls(dist.new_group(backend="gloo"), world_size)
        else:
            ranks = dist.get_process_group_ranks(group)
            side = cls(dist.new_group(ranks, backend="gloo", use_local_synchronization=True), world_size)
        _SIDE_GROUPS[id(base)] = (base, side)
        return side

    def launch(self, rank: int, row: list[int]) -> Any:
        """Start the exchange of this rank's ``row``; the rows are in :attr:`table` once it completed."""
        self.count += 1
        self.table.zero_()
        self.table[rank] = torch.tensor(row, dtype=torch.int64)
        return dist.all_reduce(self.table, group=self.group, async_op=True)

    def rows(self) -> list[list[int]]:
        return self.table.tolist()


Signature = tuple[str, int, str]  # (op, payload bytes, name): what a check compares, but the number
TRUST_AFTER = 2  # checks in a row that found a successor before it is expected (a step's pattern twice)
CONTEXT = 3  # the latest collectives that key the successor
MAX_KNOWN = 4096  # runs whose successor is kept; past it the schedule starts over (names made anew each
# step would otherwise grow it without end; every rank starts over at the same collective)


def signature(issued: Issued) -> Signature:
    return (issued.op, issued.nbytes, issued.name)


class Schedule:
    """The collectives every rank expects next, learned from checked ones ([Note: learned schedule]).

    Args:
        trust_after: checks in a row that must find a successor before it is expected; None: never
            (every collective is checked).
    """

    def __init__(self, trust_after: int | None = TRUST_AFTER) -> None:
        self.trust_after = trust_after
        self.last: tuple[Signature, ...] = ()  # the latest CONTEXT collectives, checked or expected
        self._next: dict[tuple[Signature, ...], tuple[Signature, int]] = {}  # successor, checks found it

    def expected(self) -> Signature | None:
        """The collective every rank is expected to issue next, or None when it must be checked."""
        known = self._next.get(self.last)
        if known is None or self.trust_after is None or known[1] < self.trust_after:
            return None
        return known[0]

    def followed(self, sig: Signature) -> None:
        """The expected collective ``sig`` was issued (unchecked)."""
        self.last = (*self.last, sig)[-CONTEXT:]

    def checked(self, sig: Signature, *, expectable: bool) -> None:
        """``sig`` was checked and every rank issued it; ``expectable``: whether it may ever be
        expected (False: its size is unknown to the package, or it is a control collective)."""
        if not expectable:
            self._next.pop(self.last, None)
        else:
            if len(self._next) >= MAX_KNOWN and self.last not in self._next:
                self._next.clear()
            known = self._next.get(self.last)
            count = known[1] + 1 if known is not None and known[0] == sig else 1
            self._next[self.last] = (sig, count)
        self.followed(sig)


def elsewhere(rows: list[list[int]], me: int) -> list[int]:
    """The ranks whose row names another collective than ``me``'s."""
    return [r for r, row in enumerate(rows) if row[SEQ:DIGEST] != rows[me][SEQ:DIGEST]]


def desync_report(me: int, states: dict[int, RankState], others: list[int], ranks: list[int]) -> str:
    """Every rank's collective where they differ; ``others``: the ranks elsewhere than ``me``;
    ``ranks``: the (world) ranks of the group that compared their collectives."""
    mine = states[me].waiting
    lines = [
        f"lightning_zero watchdog: rank {me} is in {mine.describe()}, checked before issuing it; the ranks "
        "are out of step (a desync): every rank must issue the same collectives in the same order, and "
        f"these never will; rank(s) {', '.join(map(str, others))} are elsewhere (nothing was sent):"
    ]
    for r in ranks:
        lines.append(f"  {states[r].describe()}" if r in states else f"  rank {r} did not answer")
    return "\n".join(lines + _read_at_rest(states))


def deviation_report(me: int, states: dict[int, RankState], deviating: list[int], ranks: list[int]) -> str:
    """The desync a rank finds when ``deviating`` ranks posted, under a number where it issued the
    expected collective, collectives of their own ([Note: learned schedule])."""
    mine = states[me].waiting
    lines = [
        f"lightning_zero watchdog: rank {me} is in {mine.describe()}, the collective every rank "
        "issued at this point of the previous steps; the ranks are out of step (a desync): every rank "
        "must issue the same collectives in the same order, and these never will; rank(s) "
        f"{', '.join(map(str, deviating))} issued another collective under its number (nothing was "
        "sent to them):"
    ]
    for r in ranks:
        lines.append(f"  {states[r].describe()}" if r in states else f"  rank {r} is elsewhere")
    return "\n".join(lines + _read_at_rest(states))


def digest_report(agreement: Issued, entries: list[list[Issued]], ranks: list[int]) -> str:
    """The desync an agreement found by its digests (see [Note: digest since the last agreement] in
    tracker.py): the first collective since the previous agreement where the ranks' entries differ
    (``entries``: each rank's, in group order; ``ranks``: their world ranks)."""
    length = min(len(e) for e in entries)
    first = next((i for i in range(length) if len({e[i] for e in entries}) > 1), length)
    lines = [
        f"lightning_zero: the ranks are out of step (a desync) at {agreement.describe()}: since the "
        "previous agreement they issued different collectives, which paired with each other and "
        "completed (collectives of one size pair whatever they carry; on NCCL none is checked before "
        "it is issued). Every rank must issue the same collectives in the same order: a branch taken "
        "on some ranks only (a different unit, a skipped or added collective) trains each rank on "
        "other values. The first that differs:"
    ]
    for r, mine in zip(ranks, entries):
        what = (
            mine[first].describe() if first < len(mine) else f"nothing more ({len(mine)} collectives in all)"
        )
        lines.append(f"  rank {r}: {what}")
    return "\n".join(lines + _read_at_rest_names([e[first].name for e in entries if first < len(e)]))


AT_REST = "/at_rest/"  # in the names of the collectives a read of a stage-3 parameter at rest makes


def _read_at_rest(states: dict[int, RankState]) -> list[str]:
    """The advice for a desync that a read of a parameter at rest made (a norm, a sum, a whole
    value): such a read is a collective, which ranks that do not run the same code never join."""
    return _read_at_rest_names([s.current().name for s in states.values() if s.current() is not None])


def _read_at_rest_names(names: list[str]) -> list[str]:
    reads = sorted({name.split(AT_REST, 1)[1] for name in names if AT_REST in name})
    if not reads:
        return []
    return [
        f"  {', '.join(reads)}: a stage-3 parameter read at rest (a norm, a sum, a whole value) is a collective "
        "over its shards; run the code that reads it on every rank (not under rank_zero_only, nor on "
        "some ranks only), or read strategy.full_state_dict() on every rank and use rank 0's copy"
    ]

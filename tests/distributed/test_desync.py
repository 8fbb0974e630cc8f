"""A desync ends on every rank, named, before gloo can abort a process (real gloo ranks).

Each test puts two spawned ranks out of step on purpose and asserts what each rank ends with and
how soon. Without the check before each collective ([Note: checked issue] in
lightning_zero/comm/checks.py) gloo pairs the mismatched collectives: of different sizes, it
aborts the receiving rank from C++ (status -6) and its peer names a death, not a desync (the
first test shows it with the check turned off).
"""

from __future__ import annotations

import re
import signal
import socket
import time

import pytest
import torch

from lightning_zero.comm import Communicator
from lightning_zero.comm.watchdog import Watchdog
from tests.distributed.fault_harness import run_ranks

HOST = socket.gethostname()
BOUND_S = 10  # every rank ends this soon after its first collective (spawn start-up excluded)


def _comm(*, checked: bool = True, watchdog_s: float | None = None) -> Communicator:
    comm = Communicator()
    comm.watch_faults(fault_wait_s=2.0)
    comm.check_issue = checked  # False: as on NCCL, where collectives are not checked one by one
    if watchdog_s is not None:
        Watchdog(comm, watchdog_s).start()
    comm.all_reduce(torch.ones(4), name="warm-up", async_op=False)  # collective #2 (#1: the hosts)
    return comm


def _sized_all_gather(rank: int, world_size: int, checked: bool) -> str:
    """Stage 3's all-gather of one unit, a different unit (and size) on each rank."""
    comm = _comm(checked=checked)
    unit, numel = ("blocks.3", 8) if rank == 0 else ("blocks.4", 12)
    out = torch.zeros(numel * world_size)
    comm.all_gather(out, torch.ones(numel), name=f"zero3/all_gather/unit={unit}", async_op=False)
    return "completed"


def test_differently_sized_all_gathers_abort_gloo_without_the_check(tmp_path):
    """What the check prevents: gloo's C++ abort on one rank, and a death named on the other."""
    rank0, rank1 = run_ranks(_sized_all_gather, 2, tmp_path, False, timeout=90)
    aborted = [o for o in (rank0, rank1) if o.exitcode == -signal.SIGABRT]
    assert aborted and "Received data size doesn't match expected size" in aborted[0].stderr, (rank0, rank1)


def test_differently_sized_all_gathers_are_a_desync_on_every_rank(tmp_path):
    outcomes = run_ranks(_sized_all_gather, 2, tmp_path, True, timeout=90)
    for o in outcomes:
        assert o.exitcode == 1, o  # no abort: left without tearing the group down
        assert o.error is not None and o.error.startswith("CollectivesStopped: "), o
        assert "the ranks are out of step (a desync)" in o.error
        assert f"rank 0 ({HOST}) waits in all_gather #3 zero3/all_gather/unit=blocks.3 (64 B)" in o.error
        assert f"rank 1 ({HOST}) waits in all_gather #3 zero3/all_gather/unit=blocks.4 (96 B)" in o.error
        other = 1 - o.rank
        assert f"rank {o.rank} is in all_gather #3" in o.error and f"rank(s) {other} are elsewhere" in o.error
        assert o.seconds < BOUND_S, o.seconds
        # printed where it is seen, also when the exception is caught
        assert f"lightning_zero watchdog: rank {o.rank} is in all_gather #3" in o.stderr


def _skip(rank: int, world_size: int) -> str:
    """Rank 1 skips the first bucket's all-reduce and goes on with the second one."""
    comm = _comm()
    if rank == 0:
        comm.all_reduce(torch.ones(4), name="zero0/all_reduce/bucket=0", async_op=False)
    comm.all_reduce(torch.ones(4), name="zero0/all_reduce/bucket=1", async_op=False)
    return "completed"


def test_a_skipped_collective_is_a_desync_on_every_rank(tmp_path):
    outcomes = run_ranks(_skip, 2, tmp_path, timeout=90)
    for o in outcomes:
        assert o.exitcode == 1 and o.error is not None and o.error.startswith("CollectivesStopped: "), o
        assert f"rank 0 ({HOST}) waits in all_reduce #3 zero0/all_reduce/bucket=0 (16 B)" in o.error
        assert f"rank 1 ({HOST}) waits in all_reduce #3 zero0/all_reduce/bucket=1 (16 B)" in o.error
        assert o.seconds < BOUND_S, o.seconds


def _skip_unchecked(rank: int, world_size: int) -> str:
    """As on NCCL (no check per collective): rank 1 skips bucket 0, so its bucket 1 pairs with rank
    0's bucket 0 (same size: gloo does not mind); then rank 0 waits in bucket 1 and rank 1 in the
    per-batch agreement, for good. The watchdog finds them apart under one sequence number."""
    comm = _comm(checked=False, watchdog_s=1.0)
    if rank == 0:
        comm.all_reduce(torch.ones(4), name="zero0/all_reduce/bucket=0", async_op=False)
        comm.all_reduce(torch.ones(4), name="zero0/all_reduce/bucket=1", async_op=False)
    else:
        comm.all_reduce(torch.ones(4), name="zero0/all_reduce/bucket=1", async_op=False)
        comm.agree(0, name="zero0/agree/batch", device=torch.device("cpu"))
    return "completed"


def test_an_unchecked_desync_is_found_by_the_watchdog_on_every_rank(tmp_path):
    outcomes = run_ranks(_skip_unchecked, 2, tmp_path, timeout=90)
    for o in outcomes:
        assert o.exitcode == 1 and o.error is not None and o.error.startswith("CollectivesStopped: "), o
        assert "the ranks are out of step (a desync)" in o.error
        assert f"rank 0 ({HOST}) waits in all_reduce #4 zero0/all_reduce/bucket=1 (16 B)" in o.error
        assert f"rank 1 ({HOST}) waits in agree #4 zero0/agree/batch (96 B)" in o.error
        assert o.seconds < BOUND_S, o.seconds


def _same_size_units(rank: int, world_size: int, checked: bool) -> str:
    """Stage 3 with a branch taken on one rank: rank 1 gathers another unit of the same size, which
    pairs with rank 0's and completes; the next agreement compares what each rank issued."""
    comm = _comm(checked=checked)
    comm.agree(0, name="zero3/agree/batch", device=torch.device("cpu"))  # the previous batch's
    for unit in ("blocks.0", "blocks.1" if rank == 1 else "blocks.0", "blocks.2"):
        comm.all_gather(torch.zeros(8 * world_size), torch.ones(8), name=f"zero3/all_gather/unit={unit}")
    comm.agree(0, name="zero3/agree/batch", device=torch.device("cpu"))
    return "completed"


def test_same_size_collectives_of_different_units_are_named_at_the_next_agreement(tmp_path):
    """As on NCCL (no check per collective): the units' all-gathers pair across units and complete;
    the agreement's digests differ and every rank names the first collective that differs."""
    outcomes = run_ranks(_same_size_units, 2, tmp_path, False, timeout=90)
    for o in outcomes:
        assert o.exitcode == 1 and o.error is not None and o.error.startswith("CollectivesStopped: "), o
        assert "out of step (a desync) at agree #7 zero3/agree/batch" in o.error, o.error
        assert "rank 0: all_gather #5 zero3/all_gather/unit=blocks.0 (64 B)" in o.error
        assert "rank 1: all_gather #5 zero3/all_gather/unit=blocks.1 (64 B)" in o.error
        assert o.seconds < BOUND_S, o.seconds


def test_the_same_collectives_agree_with_the_check_off(tmp_path):
    """The digest compares what was issued, not when: ranks in step pass every agreement."""
    outcomes = run_ranks(_same_units, 2, tmp_path, timeout=90)
    assert [(o.exitcode, o.result) for o in outcomes] == [(0, "completed")] * 2, outcomes


def _same_units(rank: int, world_size: int) -> str:
    comm = _comm(checked=False)
    for step in range(3):
        for unit in ("blocks.0", "blocks.1"):
            size = 8 + step
            comm.all_gather(
                torch.zeros(size * world_size), torch.ones(size), name=f"zero3/all_gather/unit={unit}"
            )
        comm.agree(0, name="zero3/agree/batch", device=torch.device("cpu"))
    return "completed"


def _many_in_flight(rank: int, world_size: int, in_flight: int) -> str:
    """Stage 1's pattern: every bucket's all-reduce launched, then waited; learned over three steps.
    At the fourth, rank 1 issues another collective first: rank 0 issues all ``in_flight`` expected
    ones unchecked and waits in the first, far behind its latest 16."""
    comm = _comm()
    for step in range(4):
        if step == 3 and rank == 1:
            comm.all_reduce(torch.ones(2), name="zero1/all_reduce/other", async_op=False)
        handles = [
            comm.all_reduce(torch.ones(4), name=f"zero1/all_reduce/bucket={b}") for b in range(in_flight)
        ]
        for handle in handles:
            handle.wait()
    return "completed"


@pytest.mark.parametrize("in_flight", [20, 64])
def test_a_deviation_behind_many_collectives_in_flight_is_named_without_the_watchdog(tmp_path, in_flight):
    outcomes = run_ranks(_many_in_flight, 2, tmp_path, in_flight, timeout=90)
    first = 3 + 3 * in_flight  # the fourth step's first collective (#1: the hosts, #2: the warm-up)
    for o in outcomes:
        assert o.exitcode == 1 and o.error is not None and o.error.startswith("CollectivesStopped: "), o
        assert "out of step (a desync)" in o.error, o.error
        assert f"all_reduce #{first} zero1/all_reduce/bucket=0 (16 B)" in o.error, o.error
        assert f"all_reduce #{first} zero1/all_reduce/other (8 B)" in o.error, o.error
        assert o.seconds < BOUND_S, o.seconds


def _slow_peer(rank: int, world_size: int) -> float:
    """Rank 1 computes for 3.5 s before every one of its two all-reduces (the watchdog at 0.5 s)."""
    comm = _comm(watchdog_s=0.5)
    total = 0.0
    for bucket in range(2):
        if rank == 1:
            time.sleep(3.5)
        t = torch.ones(4)
        comm.all_reduce(t, name=f"zero0/all_reduce/bucket={bucket}", async_op=False)
        total += float(t.sum())
    return total


def test_a_slow_rank_is_never_a_desync(tmp_path):
    """Seven times the watchdog's time, twice: reported as slow each time, never stopped."""
    rank0, rank1 = run_ranks(_slow_peer, 2, tmp_path, timeout=90)
    assert (rank0.result, rank1.result) == (16.0, 16.0) and (rank0.exitcode, rank1.exitcode) == (0, 0)
    assert rank0.stderr.count("some ranks are not in a collective: they are slow") >= 2, rank0.stderr
    assert "out of step (a desync)" not in rank0.stderr + rank1.stderr
    assert rank0.seconds >= 7.0


def _steps(comm: Communicator, steps: int, order_at: dict[int, tuple[str, ...]]) -> float:
    """``steps`` steps of two all-gathers of different sizes (units a, b); ``order_at[step]``: the
    units this rank gathers at that step instead of ("a", "b")."""
    numel = {"a": 8, "b": 12}
    total = 0.0
    for step in range(1, steps + 1):
        for unit in order_at.get(step, ("a", "b")):
            out = torch.zeros(numel[unit] * 2)
            comm.all_gather(
                out, torch.ones(numel[unit]), name=f"zero3/all_gather/unit={unit}", async_op=False
            )
            total += float(out.sum())
    return total


def _expected_then_apart(rank: int, world_size: int) -> str:
    """Past the learning steps, rank 1 gathers unit b where both expect a (another size)."""
    comm = _comm()
    _steps(comm, 5, {5: ("b", "a")} if rank == 1 else {})
    return "completed"


def test_a_desync_where_every_rank_expects_one_collective_is_named_on_every_rank(tmp_path):
    """Rank 0 issues the expected all-gather unchecked ([Note: learned schedule] in
    lightning_zero/comm/checks.py); rank 1 posts its deviation and checks: no abort, both named."""
    outcomes = run_ranks(_expected_then_apart, 2, tmp_path, timeout=90)
    for o in outcomes:
        assert o.exitcode == 1 and o.error is not None and o.error.startswith("CollectivesStopped: "), o
        assert "the ranks are out of step (a desync)" in o.error
        seq = re.search(
            r"rank 0 \(\S+\) waits in all_gather #(\d+) zero3/all_gather/unit=a \(64 B\)", o.error
        )
        assert seq, o.error
        assert f"rank 1 ({HOST}) waits in all_gather #{seq[1]} zero3/all_gather/unit=b (96 B)" in o.error
        assert "rank(s) 1 issued another collective under its number" in o.error
        assert o.seconds < BOUND_S, o.seconds
    assert "Received data size" not in outcomes[0].stderr + outcomes[1].stderr


def _checks_counted(rank: int, world_size: int, alike_at: int | None) -> tuple[float, int]:
    comm = _comm()
    total = _steps(comm, 8, {alike_at: ("b", "a")} if alike_at else {})
    return total, comm.ledger.checks.calls


def test_repeated_collectives_are_checked_until_learned_and_a_change_every_rank_makes_is_no_desync(tmp_path):
    """Two steps teach the schedule; then only what changes is checked. Every rank changing its
    order alike (the end of an epoch) passes its checks and trains on."""
    (tmp_path / "plain").mkdir(), (tmp_path / "changed").mkdir()
    plain = run_ranks(_checks_counted, 2, tmp_path / "plain", None, timeout=90)
    changed = run_ranks(_checks_counted, 2, tmp_path / "changed", 5, timeout=90)
    gathered = 8 * (8 + 12) * 2.0  # 8 steps, both units, two ranks of ones
    for o in plain + changed:
        assert o.exitcode == 0 and o.result[0] == gathered, o
    # the warm-up, then each run of three collectives checked until its successor was seen twice
    # (the first seven gathers): 8 of 17, none after step 4
    assert [o.result[1] for o in plain] == [8, 8]
    # step 5 changes order (both checked, one deviation each), steps 6-7 relearn it: more checks
    assert all(o.result[1] > 8 for o in changed) and changed[0].result[1] == changed[1].result[1]
    assert all("out of step" not in o.stderr for o in changed)

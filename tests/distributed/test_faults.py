"""Failures travel to every rank, fast, and a hang names its cause (real gloo ranks, real signals).

Each test makes one rank fail on purpose and asserts what every rank ends with, and how soon.
Without the fault board a rank that raised reached only itself: its peers saw gloo's
"Connection closed by peer", or waited for the process group's timeout (30 minutes by default).
"""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest
import torch

from lightning_zero import faults
from lightning_zero.comm import Communicator
from lightning_zero.comm.tracker import Issued, RankState
from lightning_zero.comm.watchdog import Watchdog, format_report
from tests.distributed.fault_harness import run_ranks

HOST = socket.gethostname()


def _comm(watchdog_s: float | None = None) -> Communicator:
    comm = Communicator()
    comm.watch_faults(fault_wait_s=2.0)
    if watchdog_s is not None:
        Watchdog(comm, watchdog_s).start()
    comm.all_reduce(torch.ones(4), name="warm-up", async_op=False)  # collective #2 (#1: the hosts)
    return comm


def _raise_and_stay(rank: int, world_size: int, out: str) -> str:
    """Rank 1 fails at step 3 and stays alive (as if stuck in its own clean-up); rank 0 waits."""
    comm = _comm()
    if rank == 1:
        faults.publish(comm, ValueError("bad batch 17"), step=3)
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(out, "outcome0.json")) and time.monotonic() < deadline:
            time.sleep(0.1)  # its connections stay open: gloo alone would let rank 0 wait
        return "stayed until rank 0 had left"
    comm.all_reduce(torch.ones(4), name="zero0/all_reduce/bucket=0", async_op=False)
    return "completed"


def test_a_failing_rank_stops_its_waiting_peer_with_its_own_message(tmp_path):
    rank0, rank1 = run_ranks(_raise_and_stay, 2, tmp_path, str(tmp_path), timeout=90)
    assert rank0.error is not None and rank0.error.startswith("PeerFailure: "), rank0
    assert f"rank 1 ({HOST}, pid " in rank0.error
    assert "failed at step 3: ValueError: bad batch 17" in rank0.error
    assert "Rank 0 stops too: it was in all_reduce #3 zero0/all_reduce/bucket=0 (16 B)" in rank0.error
    assert rank0.seconds < 10, rank0.seconds  # a poll slice (1 s) and the start-up of the peer
    assert rank0.exitcode == 1  # left without tearing down the group (a collective was pending)
    assert rank1.result == "stayed until rank 0 had left"


def _exchange_waits_on_a_failed_peer(rank: int, world_size: int, out: str, kill: bool) -> str:
    """Rank 0 waits in a stage-3 reduce-scatter done as sends and receives (waited without slices,
    see [Note: collectives in place]); rank 1 fails instead of joining it: killed, or raising and
    staying alive with its connections open."""
    comm = _comm()
    if rank == 1:
        if kill:
            os.kill(os.getpid(), signal.SIGKILL)
        faults.publish(comm, ValueError("bad batch 17"), step=3)
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(out, "outcome0.json")) and time.monotonic() < deadline:
            time.sleep(0.1)
        return "stayed until rank 0 had left"
    grads, shard = torch.ones(8 * world_size), torch.empty(8)
    name = "zero3/reduce_scatter/unit=blocks.2"
    comm.reduce_scatter(shard, grads, name=name, scratch_input=True, async_op=False)
    return "completed"


@pytest.mark.parametrize("kill", [False, True], ids=["raised", "killed"])
def test_a_peer_that_fails_stops_a_rank_waiting_in_an_exchange(tmp_path, kill):
    rank0, rank1 = run_ranks(_exchange_waits_on_a_failed_peer, 2, tmp_path, str(tmp_path), kill, timeout=90)
    assert rank0.error is not None and rank0.error.startswith("PeerFailure: "), rank0
    assert f"rank 1 ({HOST}, pid " in rank0.error
    why = (
        "is gone without a word (killed by a signal" if kill else "failed at step 3: ValueError: bad batch 17"
    )
    assert why in rank0.error, rank0.error
    assert "reduce_scatter #3 zero3/reduce_scatter/unit=blocks.2 (64 B)" in rank0.error, rank0.error
    assert rank0.seconds < 2.0 + 8, rank0.seconds
    assert rank0.exitcode == 1
    if kill:
        assert rank1.exitcode == -signal.SIGKILL


def _killed(rank: int, world_size: int) -> str:
    comm = _comm()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    comm.all_reduce(torch.ones(4), name="zero0/all_reduce/bucket=0", async_op=False)
    return "completed"


@pytest.mark.slow  # the default suite kills a rank of a Trainer run (tests/integration/test_failures.py)
def test_a_killed_rank_is_named_with_its_host_and_the_collective_its_peer_was_in(tmp_path):
    rank0, rank1 = run_ranks(_killed, 2, tmp_path, timeout=90)
    assert rank1.exitcode == -signal.SIGKILL and rank1.seconds is None
    assert rank0.error is not None and rank0.error.startswith("PeerFailure: "), rank0
    assert (
        f"rank 1 ({HOST}, pid " in rank0.error and "is gone without a word (killed by a signal" in rank0.error
    )
    assert "Rank 0 was in all_reduce #3 zero0/all_reduce/bucket=0 (16 B)" in rank0.error
    assert rank0.seconds < 2.0 + 8, rank0.seconds  # fault_wait_s for the silent rank, and start-up
    assert rank0.exitcode == 1


def _one_of_four_killed(rank: int, world_size: int) -> str:
    """Rank 3 is killed; ranks 1 and 2 notice first and leave with their own report; rank 0 comes to
    its collective last, when three of its peers are gone."""
    comm = _comm()
    if rank == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(4.0 if rank == 0 else 0.5)
    comm.all_reduce(torch.ones(4), name="zero0/all_reduce/bucket=0", async_op=False)
    return "completed"


def test_with_four_ranks_only_the_killed_one_is_named_gone_without_a_word(tmp_path):
    """Ranks that stopped with their own report (they noted themselves on the board) were named
    "gone without a word" beside the killed one; now only the killed rank is."""
    outcomes = run_ranks(_one_of_four_killed, 4, tmp_path, timeout=120)
    assert outcomes[3].exitcode == -signal.SIGKILL
    for o in outcomes[:3]:
        assert o.error is not None and o.error.startswith("PeerFailure: "), o
        assert f"rank 3 ({HOST}, pid " in o.error, o.error
        for other in {1, 2} - {o.rank}:
            assert f"rank {other} ({HOST}" not in o.error, o.error


def _desync(rank: int, world_size: int) -> str:
    """The ranks issue different collectives: rank 0 an all-gather, rank 1 a reduce-scatter."""
    comm = _comm(watchdog_s=1.0)
    if rank == 0:
        out = torch.zeros(8 * world_size)
        comm.all_gather(out, torch.ones(8), name="zero3/all_gather/unit=blocks.3", async_op=False)
    else:
        out = torch.zeros(8)
        comm.reduce_scatter(
            out, torch.ones(8 * world_size), name="zero3/reduce_scatter/unit=blocks.2", async_op=False
        )
    return "completed"


def test_a_desync_is_reported_with_each_ranks_collective_and_stops_every_rank(tmp_path):
    outcomes = run_ranks(_desync, 2, tmp_path, timeout=90)
    for o in outcomes:
        assert o.error is not None and o.error.startswith("CollectivesStopped: "), o
        assert "the ranks are out of step (a desync)" in o.error
        assert f"rank 0 ({HOST}) waits in all_gather #3 zero3/all_gather/unit=blocks.3 (64 B)" in o.error
        assert (
            f"rank 1 ({HOST}) waits in reduce_scatter #3 zero3/reduce_scatter/unit=blocks.2 (64 B)" in o.error
        )
        assert o.seconds < 10, o.seconds  # watchdog_s = 1 s, answers within 3 ticks; not gloo's 120 s
        assert o.exitcode == 1
        assert "lightning_zero watchdog: rank" in o.stderr  # printed as soon as it was seen


def _busy_peer(rank: int, world_size: int) -> str:
    """Rank 1 computes for 4 s before joining the all-reduce: reported, not stopped."""
    comm = _comm(watchdog_s=1.0)
    if rank == 1:
        time.sleep(4.0)
    t = torch.ones(4)
    comm.all_reduce(t, name="zero0/all_reduce/bucket=0", async_op=False)
    return float(t.sum())


@pytest.mark.slow
def test_a_slow_rank_is_reported_but_the_run_goes_on(tmp_path):
    rank0, rank1 = run_ranks(_busy_peer, 2, tmp_path, timeout=90)
    assert (rank0.result, rank1.result) == (8.0, 8.0) and rank0.error is None
    assert "some ranks are not in a collective: they are slow, or blocked elsewhere" in rank0.stderr
    assert f"rank 0 ({HOST}) waits in all_reduce #3 zero0/all_reduce/bucket=0 (16 B)" in rank0.stderr
    assert (
        f"rank 1 ({HOST}) is not in a collective: its last was all_reduce #2 warm-up (16 B)" in rank0.stderr
    )
    assert rank0.exitcode == 0 and rank1.exitcode == 0


def test_report_verdicts():
    ag = Issued(57, "all_gather", "zero3/all_gather/unit=blocks.3", 1 << 20)
    rs = Issued(56, "reduce_scatter", "zero3/reduce_scatter/unit=blocks.2", 2 << 20)
    waiting = {0: RankState(0, "a", ag, ag, 30.0), 1: RankState(1, "b", rs, rs, 31.0)}
    report = format_report(0, 30.0, waiting, 2)
    assert (
        report.desync
        and "rank 1 (b) waits in reduce_scatter #56 zero3/reduce_scatter/unit=blocks.2 (2.0 MiB)"
        in report.text
    )
    same = {0: waiting[0], 1: RankState(1, "b", ag, ag, 31.0)}
    assert not format_report(0, 30.0, same, 2).desync
    missing = format_report(0, 30.0, {0: waiting[0]}, 2)
    assert not missing.desync and "rank 1 did not answer" in missing.text


@pytest.mark.parametrize(
    "text", ["Connection closed by peer [127.0.0.1]:9364", "NCCL error: remote process exited"]
)
def test_backend_errors_are_recognised(text):
    from lightning_zero.comm.faults import looks_like_comm_error

    assert looks_like_comm_error(RuntimeError(text))
    wrapped = ValueError("while saving")
    wrapped.__cause__ = RuntimeError(text)
    assert looks_like_comm_error(wrapped)
    assert not looks_like_comm_error(ValueError("bad batch 17"))

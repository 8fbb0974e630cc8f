"""What a waiting rank reads from the store per wait slice does not grow with N or with the
deviations a run has posted (see [Note: learned schedule] in lightning_zero/comm/checks.py): one
counter of faults, one of deviations; the deviations themselves only after another was posted."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from lightning_zero.comm.faults import FaultBoard
from lightning_zero.comm.tracker import Issued


class CountingStore:
    """A store that counts the requests made to it."""

    def __init__(self) -> None:
        self.store = dist.HashStore()
        self.requests = 0

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def counted(*args):
            self.requests += 1
            return method(*args)

        return counted


def _poll(board: FaultBoard) -> None:
    """What a rank reads between two slices of a wait when nothing failed."""
    board.fault_count()
    board.deviations()


@pytest.mark.parametrize("world", [2, 4, 8])
def test_reads_per_poll_stay_two_whatever_n_and_the_deviations_posted(world):
    counting = CountingStore()
    boards = [FaultBoard(counting, "t/", rank, world) for rank in range(world)]
    for rank in range(1, world):  # every other rank changed its pattern once (an epoch's end)
        boards[rank].post_deviation(Issued(10 + rank, "agree", "zero2/agree/batch", 96))
    _poll(boards[0])  # reads the posted deviations once
    assert set(boards[0].deviations()) == set(range(1, world))
    before = counting.requests
    for _ in range(5):
        _poll(boards[0])
    assert (counting.requests - before) / 5 == 2  # two counters, not 2(N-1) keys
    boards[1].post_deviation(Issued(40, "all_gather", "zero3/all_gather/unit=blocks.1", 64))
    assert boards[0].deviations()[1].seq == 40  # a new one is read

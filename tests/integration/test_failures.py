"""Failures in a real Trainer run: every rank ends in bounded time, with the failing rank's reason.

The ranks are separate processes started like torchrun starts them (tests/integration/ranks.py,
scenario code in fault_scenarios.py); one of them fails on purpose. Before the fault board, the
rank that did not fail printed gloo's "Connection closed by peer" (or waited in its collective:
the killed-rank run below hung until the test's deadline).
"""

from __future__ import annotations

import re
import signal
import socket

from tests.integration.ranks import finish, start

HOST = socket.gethostname()


def test_a_parameter_unused_on_one_rank_is_named_on_every_rank(tmp_path):
    ranks = start("unused", 2, tmp_path, model={"unused_on": 0, "unused_from": 2}, max_steps=6)
    rank0, rank1 = finish(ranks, timeout=120)
    message = "UnusedParametersError: 2 parameter(s) that require grad got no gradient in this backward: extra.weight, extra.bias"
    assert rank0.returncode == 1 and message in rank0.output, rank0.output[-3000:]
    assert rank1.returncode == 1, rank1.output[-3000:]
    peer = re.search(r"PeerFailure: (.*)", rank1.output)
    assert peer is not None, rank1.output[-3000:]
    assert peer.group(1).startswith(f"rank 0 ({HOST}, pid {ranks.procs[0].pid}) failed at step 2: {message}")
    assert "Rank 1 stops too: it was in" in peer.group(1)
    assert abs(rank1.seconds - rank0.seconds) < 8, (rank0.seconds, rank1.seconds)


def test_a_killed_rank_is_named_on_the_survivor_with_the_collective_it_was_in(tmp_path):
    ranks = start("killed", 2, tmp_path, kill={"rank": 1, "step": 3, "signal": "SIGKILL"}, max_steps=8)
    rank0, rank1 = finish(ranks, timeout=120)
    assert rank1.returncode == -signal.SIGKILL
    assert rank0.returncode == 1, rank0.output[-3000:]
    peer = re.search(r"PeerFailure: (.*)", rank0.output)
    assert peer is not None, rank0.output[-3000:]
    assert peer.group(1).startswith(f"rank 1 ({HOST}, pid {ranks.procs[1].pid}) is gone without a word")
    assert re.search(r"Rank 0 was in \w+ #\d+ zero2/\S+ \(\d+ B\) when it noticed", peer.group(1)), (
        peer.group(1)
    )
    assert rank0.seconds - rank1.seconds < 8, (rank0.seconds, rank1.seconds)  # a poll slice, not a timeout

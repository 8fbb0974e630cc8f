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
import subprocess
import sys

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


CAUGHT_ALONE = """
import lightning as L
import torch

import lightning_zero


class Failing(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        raise ValueError("a bad batch")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=4)


trainer = L.Trainer(
    strategy=lightning_zero.ZeroStrategy(stage=2), accelerator="cpu", devices=1, max_steps=1,
    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
)
try:
    trainer.fit(Failing())
except ValueError as err:
    print("caught:", err, "| process group:", torch.distributed.is_initialized(), flush=True)
"""


def test_a_failure_caught_in_a_one_process_run_leaves_the_exit_status_alone(tmp_path):
    """With no peer to leave waiting, a caught failure is the script's business: the process ends
    as the script ends (a test runner or notebook that expects the error goes on; before, the exit
    status was forced to 1)."""
    script = tmp_path / "caught.py"
    script.write_text(CAUGHT_ALONE)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert "caught: a bad batch | process group: True" in done.stdout, done.stdout + done.stderr[-3000:]
    assert done.returncode == 0, done.stderr[-3000:]

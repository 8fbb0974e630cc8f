"""Signals under ZeRO: real signals to real rank processes; every rank saves at the same step boundary,
stops with a status that names the signal, and the run resumes from what it saved.

Before the strategy took over the handlers, SIGTERM during a full checkpoint save hung both ranks
until the process group's timeout (Lightning's handler broadcast a tensor from inside the handler
while the other rank waited in the save's closing collective), and a SIGTERM between two saves
ended the ranks with status 0 and no checkpoint.
"""

from __future__ import annotations

import signal
import time

import pytest
import torch

from tests.integration.ranks import finish, start

ONE_BATCH_EPOCHS = {"default_samples": 16}  # 2 ranks x 8: one batch per rank and epoch, so resumes are exact


def _assert_stopped(runs, out, *, signal_name: str, ranks: str, saved_step: int) -> None:
    path = out / "hpc_ckpt_1.ckpt"
    for run in runs:
        assert run.returncode == 128 + signal.Signals[signal_name].value, run.output[-3000:]
        assert (
            f"lightning_zero: rank {run.rank} stops: {signal_name} received by rank(s) {ranks}" in run.output
        ), run.output[-3000:]
        assert f"checkpoint saved at step {saved_step}: {path}" in run.output
    assert torch.load(path, weights_only=False)["global_step"] == saved_step


def test_sigterm_during_a_full_save_neither_hangs_nor_loses_the_save(tmp_path):
    """Rank 0 gets SIGTERM twice while writing last.ckpt; rank 1 waits in the save's closing barrier."""
    options = dict(
        signal_in_save={"rank": 0, "signal": "SIGTERM", "times": 2},
        checkpoint_every=2,
        max_steps=8,
        **ONE_BATCH_EPOCHS,
    )
    runs = finish(start("sigterm-in-save", 2, tmp_path, **options), timeout=150)
    _assert_stopped(runs, tmp_path, signal_name="SIGTERM", ranks="0", saved_step=2)  # the step under way
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["global_step"] == 2  # completed
    assert abs(runs[0].seconds - runs[1].seconds) < 8


def test_sigterm_to_one_rank_stops_every_rank_at_the_next_step_and_the_run_resumes(tmp_path):
    ranks = start("sigterm", 2, tmp_path / "run", max_steps=10, step_delay_s=0.2, **ONE_BATCH_EPOCHS)
    assert ranks.wait_for_text(1, "rank 1 step 3", timeout=120), ranks.output(1)[-3000:]
    ranks.procs[1].send_signal(signal.SIGTERM)  # what SLURM sends on scancel, requeue, preemption
    runs = finish(ranks, timeout=150)
    saved = torch.load(tmp_path / "run" / "hpc_ckpt_1.ckpt", weights_only=False)["global_step"]
    assert 3 <= saved <= 5, saved  # the step under way when the signal came (its batch agreed at its end)
    _assert_stopped(runs, tmp_path / "run", signal_name="SIGTERM", ranks="1", saved_step=saved)

    resumed = finish(
        start("resume", 2, tmp_path / "run", max_steps=10, ckpt_path="hpc", **ONE_BATCH_EPOCHS), timeout=150
    )
    for run in resumed:
        assert run.returncode == 0, run.output[-3000:]
        assert f"rank {run.rank} finished at step 10" in run.output
        assert (
            f"rank {run.rank} step {saved + 1}\n" in run.output
            and f"rank {run.rank} step {saved}\n" not in run.output
        )
    assert (
        f"Restored all states from the checkpoint at {tmp_path / 'run' / 'hpc_ckpt_1.ckpt'}"
        in resumed[0].output
    )


@pytest.mark.slow
def test_a_second_sigterm_outside_a_save_leaves_at_once_and_the_peer_is_told(tmp_path):
    ranks = start("sigterm-twice", 2, tmp_path, max_steps=40, step_delay_s=2.0, **ONE_BATCH_EPOCHS)
    assert ranks.wait_for_text(1, "rank 1 step 2", timeout=120), ranks.output(1)[-3000:]
    ranks.procs[1].send_signal(signal.SIGTERM)
    time.sleep(0.5)  # two signals at once are one for the kernel
    ranks.procs[1].send_signal(signal.SIGTERM)  # still inside the 2-second step: no boundary reached yet
    rank0, rank1 = finish(ranks, timeout=120)
    assert (
        rank1.returncode == 1
        and "SIGTERM received twice: leaving at once, without a checkpoint" in rank1.output
    )
    assert rank0.returncode == 1, rank0.output[-3000:]
    assert (
        "PeerFailure: rank 1" in rank0.output and "KeyboardInterrupt: SIGTERM received twice" in rank0.output
    )
    assert not (tmp_path / "hpc_ckpt_1.ckpt").exists()

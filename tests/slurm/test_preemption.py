"""SLURM's ways of ending a job, on the real two-node cluster: every one saves at a step boundary.

examples/slurm/train.sbatch adds no preemption callback: ZeroStrategy takes SIGTERM, SIGUSR1 and
SIGINT over (``handle_signals``). What each SLURM command sends and what follows is in
docs/slurm.md ("Signals and what they do"); these tests hold it to that:

- ``scontrol requeue``: SIGTERM to every task; the ranks save at the next step boundary and stop;
  SLURM starts the job again, which resumes and ends with the parameters of an uninterrupted run.
- ``scancel``: SIGTERM, then SIGKILL after KillWait (5 s here); the checkpoint is saved and intact.
- the time-limit signal (``--signal=USR1@60`` with a three-minute limit): SIGUSR1 to every task;
  saved, and the job requeued by rank 0 before its time ran out (slow: SLURM sends it up to a
  minute before the requested time, so the test waits for it for up to two minutes).

Before the strategy handled SIGTERM, ``scontrol requeue`` and ``scancel`` ended the ranks with no
checkpoint (Lightning printed "Bypassing SIGTERM") and the requeued job started again at step 0.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from lightning.fabric.plugins import TorchCheckpointIO

from lightning_zero import checkpoint as C
from tests.slurm.runs import (
    SBATCH_SCRIPT,
    TRAIN_OVERRIDES,
    ReferenceRuns,
    SlurmCluster,
    assert_two_nodes_in_step,
    needs_app_callbacks,
    run,
    wait_for_text,
)

pytestmark = [pytest.mark.slurm, needs_app_callbacks]

SLOW_STEPS = ["+callbacks.slow._target_=tests.slurm.slow_steps.SlowSteps", "+callbacks.slow.seconds=0.5"]


def _started(
    cluster: SlurmCluster, run_dir: Path, overrides: list[str], *, name: str, args=()
) -> tuple[str, Path]:
    """examples/slurm/train.sbatch on 2 nodes x 2 tasks, as ``SlurmCluster.submit_training`` submits
    it, with more sbatch options (``args``: a time limit, a signal) after the script's own."""
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir.parent / f"{run_dir.name}.out"
    options = [
        f"--job-name={name}",
        f"--output={log}",
        "--nodes=2",
        "--ntasks-per-node=2",
        "--time=00:10:00",
        *args,
    ]
    job_id = cluster.sbatch(
        [*options, str(SBATCH_SCRIPT), *overrides], env=cluster.job_env(RUN_DIR=str(run_dir))
    )
    return job_id, log


FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def _wait_for(cluster: SlurmCluster, job_id: str, log: Path, text: str, *, timeout: float = 240) -> None:
    """Until ``text`` is in the job's log; the job may pass through REQUEUED, COMPLETING, PENDING."""
    running = lambda: cluster.scontrol_job(job_id).get("JobState") not in FINAL_STATES  # noqa: E731
    assert wait_for_text(log, text, timeout=timeout, still_running=running), (
        f"job {job_id} never printed {text!r}: {cluster.scontrol_job(job_id)}\n"
        f"{log.read_text()[-4000:] if log.exists() else '(no log)'}"
    )


def _assert_saved_intact(run_dir: Path, log: str, signal_name: str) -> int:
    path = run_dir / "hpc_ckpt_1.ckpt"
    checkpoint = C.read(path, TorchCheckpointIO())  # checked against its checksums
    step = checkpoint["global_step"]
    assert f"{signal_name} received by rank(s) 0, 1, 2, 3" in log, log[-4000:]
    assert f"checkpoint saved at step {step}: {path}" in log, log[-4000:]
    return step


@pytest.mark.slow  # about 65 s: two job starts; SIGUSR1 requeue stays in the default suite (make test-slow; default suite kept near 15 min)
def test_scontrol_requeue_saves_and_the_requeued_job_resumes_exactly(
    slurm_cluster: SlurmCluster, reference_runs: ReferenceRuns, tmp_path: Path
):
    reference = reference_runs.get("zero2")
    run_dir = tmp_path / "run"
    job_id, log = _started(slurm_cluster, run_dir, ["strategy=zero2", *TRAIN_OVERRIDES], name="requeue")
    _wait_for(slurm_cluster, job_id, log, "step     10  val_loss")
    result = run(["scontrol", "requeue", job_id], timeout=30, env=slurm_cluster.env)
    assert result.returncode == 0, result.stderr
    job = slurm_cluster.finish(job_id, log, run_dir, timeout=300)

    assert job.state == "COMPLETED" and job.restarts == 1, job.explain()
    step = _assert_saved_intact(run_dir, job.log, "SIGTERM")
    assert 10 <= step < 30, step
    assert "not requeued (SIGUSR1 is SLURM's requeue signal" in job.log  # SLURM requeued it itself
    assert f"Restored all states from the checkpoint at {run_dir / 'hpc_ckpt_1.ckpt'}" in job.log, (
        job.explain()
    )
    assert_two_nodes_in_step(job.digests, environment="SLURMEnvironment", steps=30, explain=job.explain())
    resumed, uninterrupted = torch.load(run_dir / "params.pt"), torch.load(reference.run_dir / "params.pt")
    assert resumed.keys() == uninterrupted.keys()
    for name, value in uninterrupted.items():
        torch.testing.assert_close(
            resumed[name], value, rtol=0, atol=0, msg=f"{name} differs after the requeue"
        )


@pytest.mark.slow  # about 20 s (make test-slow; default suite kept near 15 min)
def test_scancel_saves_an_intact_checkpoint_and_ends_the_job(slurm_cluster: SlurmCluster, tmp_path: Path):
    run_dir = tmp_path / "run"
    job_id, log = _started(
        slurm_cluster,
        run_dir,
        ["strategy=zero3", "strategy.state_dict_type=sharded", *TRAIN_OVERRIDES],
        name="cancel",
    )
    _wait_for(slurm_cluster, job_id, log, "step     10  val_loss")
    result = run(["scancel", job_id], timeout=30, env=slurm_cluster.env)
    assert result.returncode == 0, result.stderr
    job = slurm_cluster.finish(job_id, log, run_dir, timeout=120)

    assert job.state == "CANCELLED" and job.restarts == 0, job.explain()
    assert (run_dir / "hpc_ckpt_1.ckpt").is_dir()  # sharded: every rank wrote its part
    step = _assert_saved_intact(run_dir, job.log, "SIGTERM")
    assert 10 <= step < 30, step


@pytest.mark.slow
def test_the_time_limit_signal_saves_and_requeues_before_the_time_runs_out(
    slurm_cluster: SlurmCluster, tmp_path: Path
):
    run_dir = tmp_path / "run"
    overrides = ["strategy=zero2", *TRAIN_OVERRIDES, "trainer.max_steps=400", *SLOW_STEPS]
    job_id, log = _started(
        slurm_cluster, run_dir, overrides, name="timelimit", args=["--time=00:03:00", "--signal=USR1@60"]
    )
    start = time.monotonic()
    _wait_for(slurm_cluster, job_id, log, f"requeueing SLURM job {job_id}", timeout=300)
    seconds = time.monotonic() - start
    _wait_for(slurm_cluster, job_id, log, "Restored all states from the checkpoint at", timeout=300)
    run(
        ["scancel", job_id], timeout=30, env=slurm_cluster.env
    )  # the requeued attempt would train for minutes
    job = slurm_cluster.finish(job_id, log, run_dir, timeout=120)
    assert job.restarts >= 1, job.explain()
    _assert_saved_intact(run_dir, job.log, "SIGUSR1")
    assert "; SLURM job" in job.log and "requeued" in job.log
    assert seconds < 170, seconds  # 60 to 120 s after the start, before the three-minute limit

"""examples/slurm/train.sbatch on the two-node cluster: 2 nodes x 2 ranks, and preemption with requeue."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.slurm.runs import (
    TRAIN_OVERRIDES,
    ReferenceRuns,
    SlurmCluster,
    assert_two_nodes_in_step,
    needs_app_callbacks,
    strategy_overrides,
    wait_for_text,
)

pytestmark = [pytest.mark.slurm, needs_app_callbacks]

HYBRID = "zero3+shard_size=node"  # hybrid sharding: one shard group per node (docs/planning.md)
STRATEGIES = ["zero2", "zero3", HYBRID]
# A preempted job starts twice; the default suite preempts hybrid zero3 (`pytest -m slow`: zero2, zero3).
PREEMPTED = [s if s == HYBRID else pytest.param(s, marks=pytest.mark.slow) for s in STRATEGIES]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_nodes_train_in_step(reference_runs: ReferenceRuns, strategy: str):
    job = reference_runs.get(strategy)
    assert job.state == "COMPLETED" and job.fields.get("ExitCode") == "0:0", job.explain()
    assert_two_nodes_in_step(job.digests, environment="SLURMEnvironment", steps=30, explain=job.explain())
    assert [d["slurm_node"] for d in job.digests] == ["n1", "n1", "n2", "n2"]
    assert {d["slurm_job_id"] for d in job.digests} == {job.job_id}
    assert "final val_loss" in job.log


@pytest.mark.parametrize("strategy", PREEMPTED)
def test_preempted_job_resumes_to_the_parameters_of_an_uninterrupted_run(
    slurm_cluster: SlurmCluster, reference_runs: ReferenceRuns, strategy: str, tmp_path: Path
):
    reference = reference_runs.get(strategy)
    run_dir = tmp_path / "run"
    job_id, log = slurm_cluster.submit_training(
        run_dir, [*strategy_overrides(strategy), *TRAIN_OVERRIDES], name="preempt"
    )
    running = lambda: slurm_cluster.scontrol_job(job_id).get("JobState") in ("PENDING", "RUNNING")  # noqa: E731
    validated = wait_for_text(log, "step     10  val_loss", timeout=180, still_running=running)
    assert validated, f"job {job_id} never reached its step-10 validation:\n{log.read_text()[-4000:]}"
    slurm_cluster.signal(job_id, "USR1")  # what SLURM sends before the time limit (--signal=USR1@90)
    job = slurm_cluster.finish(job_id, log, run_dir, timeout=240)

    assert job.state == "COMPLETED" and job.restarts == 1, job.explain()
    assert (run_dir / "hpc_ckpt_1.ckpt").is_file()
    assert f"saved {run_dir / 'hpc_ckpt_1.ckpt'}; requeueing SLURM job {job_id}" in job.log, job.explain()
    assert f"Restored all states from the checkpoint at {run_dir / 'hpc_ckpt_1.ckpt'}" in job.log, (
        job.explain()
    )
    assert_two_nodes_in_step(job.digests, environment="SLURMEnvironment", steps=30, explain=job.explain())
    assert {d["slurm_restart_count"] for d in job.digests} == {1}
    # the resumed job ends where the uninterrupted one does, bit for bit
    assert job.digests[0]["val_losses"] == reference.digests[0]["val_losses"]
    resumed = torch.load(run_dir / "params.pt")
    uninterrupted = torch.load(reference.run_dir / "params.pt")
    assert resumed.keys() == uninterrupted.keys()
    for name, value in uninterrupted.items():
        torch.testing.assert_close(
            resumed[name], value, rtol=0, atol=0, msg=f"{name} differs after the resume"
        )
    assert job.digests[0]["param_sha256"] == reference.digests[0]["param_sha256"]


def _inter_node_bytes(job) -> float:
    """Rank 0's inter-node wire bytes per step: the median over the steps not followed by a
    validation (stage 3 gathers the units again to validate, in the step before it)."""
    per_step = {int(step): links.get("inter", 0.0) for step, links in job.digests[0]["link_bytes"].items()}
    values = sorted(v for step, v in per_step.items() if v > 0 and (step + 1) % 10 != 0)
    assert values, f"no inter-node traffic recorded: {per_step}"
    return values[len(values) // 2]


def test_hybrid_sharding_sends_what_the_planner_says_across_nodes(reference_runs: ReferenceRuns):
    """zero3 with one shard group per node: only the replicate all-reduces cross the nodes, the
    planner's figure for them, and at least 2x fewer bytes than full sharding across the nodes."""
    from lightning_zero.planning import hybrid_traffic

    hybrid, full = reference_runs.get(HYBRID), reference_runs.get("zero3")
    for job in (hybrid, full):
        assert job.state == "COMPLETED" and job.fields.get("ExitCode") == "0:0", job.explain()
    psi = hybrid.digests[0]["trainable_params"]
    plan = hybrid_traffic(psi, 4, 3, ranks_per_node=2, shard_size=2, param_bytes=4, grad_bytes=4)
    measured, full_sharding = _inter_node_bytes(hybrid), _inter_node_bytes(full)
    assert measured == pytest.approx(plan.inter, rel=1e-2), (measured, plan)
    assert full_sharding >= 2 * measured, (full_sharding, measured)

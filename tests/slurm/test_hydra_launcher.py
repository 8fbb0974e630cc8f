"""configs/hydra/launcher/slurm.yaml: a Hydra multirun submits one SLURM job per configuration."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import yaml

from tests.slurm.runs import REPO_ROOT, TRAIN_OVERRIDES, SlurmCluster, needs_app_callbacks, run

pytestmark = [
    pytest.mark.slurm,
    needs_app_callbacks,
    pytest.mark.skipif(
        importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None,
        reason="hydra-submitit-launcher is not installed (pip install hydra-submitit-launcher)",
    ),
]


@pytest.mark.slow  # about 25 s: one SLURM job per strategy (make test-slow; default suite kept near 15 min)
def test_multirun_submits_one_job_per_strategy(slurm_cluster: SlurmCluster, tmp_path: Path):
    sweep_dir = tmp_path / "sweep"
    args = [
        "-m",
        "hydra/launcher=slurm",
        "strategy=zero1,zero2",
        # each job: one node, two ranks (the two jobs run side by side, on n1 and n2)
        "trainer.num_nodes=1",
        "trainer.devices=2",
        # srun starts every rank: keep Lightning's "popen", which then starts no process itself
        "trainer.strategy.multirun_start_method=popen",
        f"hydra.sweep.dir={sweep_dir}",
        *TRAIN_OVERRIDES,
    ]
    cmd = [sys.executable, str(REPO_ROOT / "examples" / "train.py"), *args]
    result = run(cmd, timeout=240, env=slurm_cluster.env, cwd=REPO_ROOT)
    explain = (
        f"exit {result.returncode}\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}"
    )
    assert result.returncode == 0, explain

    jobs = {}
    for job_dir in sorted(p for p in sweep_dir.iterdir() if p.name.isdigit()):
        overrides = yaml.safe_load((job_dir / ".hydra" / "overrides.yaml").read_text())
        strategy = next(o.split("=", 1)[1] for o in overrides if o.startswith("strategy="))
        jobs[strategy] = [json.loads(p.read_text()) for p in sorted(job_dir.glob("digest_rank*.json"))]
    assert sorted(jobs) == ["zero1", "zero2"], explain
    for strategy, digests in jobs.items():
        assert [d["global_rank"] for d in digests] == [0, 1], f"{strategy}: {digests}"
        assert {d["world_size"] for d in digests} == {2}
        assert {d["cluster_environment"] for d in digests} == {"SLURMEnvironment"}
        assert len({d["slurm_job_id"] for d in digests}) == 1, f"{strategy}: ranks in different jobs"
        assert len({d["param_sha256"] for d in digests}) == 1, f"{strategy}: parameters differ between ranks"
        losses = [loss for _, loss in digests[0]["val_losses"]]
        assert losses[-1] < losses[0] - 1.0, f"{strategy}: {losses}"
    job_ids = {strategy: digests[0]["slurm_job_id"] for strategy, digests in jobs.items()}
    assert len(set(job_ids.values())) == 2, f"expected one SLURM job per strategy, got {job_ids}"

"""Two nodes' worth of processes on this host under torchrun with a c10d rendezvous (no SLURM).

Two torchrun agents, one per "node", each start two ranks of examples/train.py; the rendezvous
gives them node ranks 0 and 1, and Lightning's TorchElasticEnvironment takes the ranks from the
variables torchrun sets.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.slurm.runs import (
    REPO_ROOT,
    TRAIN_OVERRIDES,
    assert_two_nodes_in_step,
    free_port,
    job_env,
    needs_app_callbacks,
    read_digests,
)

pytestmark = needs_app_callbacks


def torchrun_agent(port: int, run_dir: Path, log: Path) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes=2", "--nproc-per-node=2",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=lightning-zero-test",
        str(REPO_ROOT / "examples" / "train.py"),
        "strategy=zero2", "trainer.num_nodes=2", "trainer.devices=2", f"hydra.run.dir={run_dir}",
        *TRAIN_OVERRIDES,
    ]  # fmt: skip
    env = job_env()  # no cluster's SLURM_CONF: the ranks come from torchrun's rendezvous
    with log.open("w") as out:
        return subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


@pytest.mark.slow  # about 20 s (make test-slow; default suite kept near 15 min)
def test_torchrun_two_nodes_train_in_step(tmp_path: Path):
    port = free_port()
    run_dir = tmp_path / "run"
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    agents = [torchrun_agent(port, run_dir, log) for log in logs]
    try:
        codes = [agent.wait(timeout=240) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
    explain = "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs)
    assert codes == [0, 0], explain
    assert_two_nodes_in_step(
        read_digests(run_dir), environment="TorchElasticEnvironment", steps=30, explain=explain
    )

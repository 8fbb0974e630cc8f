"""Helpers for the multi-node tests: starting a cluster of .ci/slurm, submitting to it, reading the runs' records.

The training runs use the Hydra app ``examples/train.py`` with ``RunDigest``
(examples/slurm/callbacks.py), which writes one JSON record per rank: the tests assert on those.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CI_SLURM = REPO_ROOT / ".ci" / "slurm"
SBATCH_SCRIPT = REPO_ROOT / "examples" / "slurm" / "train.sbatch"
SLURM_TOOLS = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "munged", "mungekey")  # install.sh's

# One optimizer step per epoch (128 windows = 4 ranks x 32), so that a checkpoint taken after any
# step is an end-of-epoch one and a resumed run sees the same batches as an uninterrupted one
# (see docs/slurm.md, "Resuming mid-epoch").
TRAIN_OVERRIDES = [
    "model=gpt_tiny",
    "trainer.max_steps=30",
    "trainer.val_check_interval=10",
    "trainer.limit_val_batches=4",
    "data.num_train_samples=128",
    "sample_chars=0",
    "+callbacks.digest._target_=examples.slurm.callbacks.RunDigest",
]


def app_takes_callbacks() -> bool:
    """Whether examples/train.py builds the callbacks named under ``callbacks:`` in its config."""
    config = yaml.safe_load((REPO_ROOT / "configs" / "config.yaml").read_text())
    return isinstance(config, dict) and "callbacks" in config


needs_app_callbacks = pytest.mark.skipif(
    not app_takes_callbacks(),
    reason="examples/train.py does not add callbacks from its config yet (no `callbacks:` key in "
    "configs/config.yaml); the SLURM runs add RequeueOnSignal and RunDigest that way, see docs/slurm.md",
)


def job_env(**extra: str) -> dict[str, str]:
    """The environment a job is started with, without a cluster's (see ``SlurmCluster.job_env``)."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", ""), "/usr/sbin"])
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="1")
    for name in ("LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK"):
        env.pop(name, None)  # from the shell that runs pytest, never for the job
    env.update(extra)
    return env


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(
    cmd: list[str], *, timeout: float, env: dict[str, str] | None = None, **kwargs
) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, **kwargs)


@dataclass
class Job:
    """A finished (or abandoned) batch job, as scontrol and its files tell it."""

    job_id: str
    fields: dict[str, str]  # `scontrol show job` as key -> value
    log: str  # stdout + stderr of all its tasks and attempts
    run_dir: Path  # Hydra's output folder (RUN_DIR of train.sbatch)
    digests: list[dict] = field(default_factory=list)  # RunDigest records, by global rank

    @property
    def state(self) -> str:
        return self.fields.get("JobState", "?")

    @property
    def restarts(self) -> int:
        return int(self.fields.get("Restarts", "0"))

    def explain(self) -> str:
        return f"job {self.job_id}: {self.state}, ExitCode={self.fields.get('ExitCode')}\n--- log\n{self.log[-6000:]}"


def missing_slurm_tools() -> list[str]:
    """The programs of slurm-wlm and munge that are not installed here."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    return [tool for tool in SLURM_TOOLS if shutil.which(tool, path=path) is None]


def start_cluster() -> SlurmCluster:
    """A new two-node cluster (.ci/slurm/start.sh) in a folder of its own, on free ports.

    Its processes are this cluster's alone: ``stop()`` ends them and removes the folder, and leaves
    every other cluster on the host running.
    """
    # in /tmp, not below pytest's folder: munged wants every folder above its socket open to all
    cluster_dir = Path(tempfile.mkdtemp(prefix="lightning_zero_slurm-", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LZ_SLURM_")}  # start.sh picks the ports
    env["LZ_SLURM_DIR"] = str(cluster_dir)
    started = run(["bash", str(CI_SLURM / "start.sh")], timeout=180, env=env)
    cluster = SlurmCluster(cluster_dir)
    if started.returncode != 0:
        cluster.stop()  # start.sh stops what it started; this removes the folder
        raise RuntimeError(f".ci/slurm/start.sh failed (exit {started.returncode}):\n{started.stderr}")
    return cluster


class SlurmCluster:
    """Submit, signal and wait for jobs on a cluster of .ci/slurm/start.sh (see ``start_cluster``)."""

    def __init__(self, cluster_dir: Path) -> None:
        self.dir = cluster_dir  # the cluster's folder: configuration, MUNGE socket, state, logs
        self.conf = cluster_dir / "etc" / "slurm.conf"
        self.env = self.job_env()

    def job_env(self, **extra: str) -> dict[str, str]:
        """``job_env`` for this cluster: its SLURM_CONF, and MASTER_ADDR, since n1 and n2 do not resolve."""
        return job_env(**{"SLURM_CONF": str(self.conf), "MASTER_ADDR": "127.0.0.1", **extra})

    def stop(self) -> None:
        """End this cluster's daemons, jobs and tasks (.ci/slurm/stop.sh) and remove its folder."""
        env = {**os.environ, "LZ_SLURM_DIR": str(self.dir)}
        stopped = run(["bash", str(CI_SLURM / "stop.sh")], timeout=180, env=env)
        assert stopped.returncode == 0, f".ci/slurm/stop.sh failed:\n{stopped.stderr}"
        shutil.rmtree(self.dir, ignore_errors=True)

    def _with_cluster(self, env: dict[str, str]) -> dict[str, str]:
        """``env`` pointed at this cluster, whatever environment the caller built."""
        return {"MASTER_ADDR": "127.0.0.1", **env, "SLURM_CONF": str(self.conf)}

    def scontrol_job(self, job_id: str) -> dict[str, str]:
        out = run(["scontrol", "show", "job", "-o", job_id], timeout=30, env=self.env).stdout
        return dict(item.split("=", 1) for item in out.split() if "=" in item)

    def sbatch(self, args: list[str], *, env: dict[str, str]) -> str:
        env = self._with_cluster(env)
        result = run(["sbatch", "--parsable", *args], timeout=30, env=env, cwd=REPO_ROOT)
        assert result.returncode == 0, f"sbatch failed:\n{result.stderr}"
        return result.stdout.strip().split(";")[0]

    def signal(self, job_id: str, name: str) -> None:
        """Send signal ``name`` to every task of the job's steps, as SLURM does before a time limit."""
        result = run(["scancel", f"--signal={name}", job_id], timeout=30, env=self.env)
        assert result.returncode == 0, f"scancel --signal={name} {job_id} failed:\n{result.stderr}"

    def wait(self, job_id: str, *, timeout: float) -> dict[str, str]:
        """Wait until the job has ended for good (not merely an attempt of it); cancel it on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            fields = self.scontrol_job(job_id)
            if fields.get("JobState") in (
                "COMPLETED",
                "FAILED",
                "CANCELLED",
                "TIMEOUT",
                "NODE_FAIL",
                "OUT_OF_MEMORY",
            ):
                return fields
            time.sleep(1.0)
        run(["scancel", job_id], timeout=30, env=self.env)
        raise TimeoutError(f"job {job_id} did not finish within {timeout:.0f} s: {self.scontrol_job(job_id)}")

    def submit_training(self, run_dir: Path, overrides: list[str], *, name: str) -> tuple[str, Path]:
        """Submit examples/slurm/train.sbatch for 2 nodes x 2 tasks; returns the job id and its log file."""
        run_dir.mkdir(parents=True, exist_ok=True)
        log = run_dir.parent / f"{run_dir.name}.out"
        env = self.job_env(RUN_DIR=str(run_dir))
        args = [
            f"--job-name={name}",
            f"--output={log}",
            "--nodes=2",
            "--ntasks-per-node=2",
            "--time=00:10:00",
        ]
        return self.sbatch([*args, str(SBATCH_SCRIPT), *overrides], env=env), log

    def finish(self, job_id: str, log: Path, run_dir: Path, *, timeout: float) -> Job:
        fields = self.wait(job_id, timeout=timeout)
        return Job(job_id, fields, log.read_text() if log.exists() else "", run_dir, read_digests(run_dir))


def read_digests(run_dir: Path) -> list[dict]:
    """RunDigest's records in ``run_dir``, ordered by global rank."""
    records = [json.loads(p.read_text()) for p in run_dir.glob("digest_rank*.json")]
    return sorted(records, key=lambda r: r["global_rank"])


def wait_for_text(path: Path, text: str, *, timeout: float, still_running) -> bool:
    """Poll ``path`` until it contains ``text``; False once ``still_running()`` is False or on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return True
        if not still_running():
            return False
        time.sleep(0.2)
    return False


class ReferenceRuns:
    """Uninterrupted 2 x 2 runs with TRAIN_OVERRIDES, one per strategy, submitted once per session."""

    def __init__(self, cluster: SlurmCluster, root: Path) -> None:
        self.cluster = cluster
        self.root = root  # one run folder per strategy below it
        self._jobs: dict[str, Job] = {}  # strategy -> finished job

    def get(self, strategy: str) -> Job:
        """``strategy``: a strategy config, with options after ``+`` (``zero3+shard_size=node``)."""
        if strategy not in self._jobs:
            run_dir = self.root / strategy.replace("=", "-").replace("+", "_")
            overrides = [*strategy_overrides(strategy), *TRAIN_OVERRIDES]
            job_id, log = self.cluster.submit_training(run_dir, overrides, name=f"train-{strategy}")
            self._jobs[strategy] = self.cluster.finish(job_id, log, run_dir, timeout=180)
        return self._jobs[strategy]


def strategy_overrides(strategy: str) -> list[str]:
    """Hydra overrides for ``name+option=value+...``: the strategy config and its options."""
    name, *options = strategy.split("+")
    return [f"strategy={name}", *(f"strategy.{option}" for option in options)]


def assert_two_nodes_in_step(digests: list[dict], *, environment: str, steps: int, explain: str = "") -> None:
    """Two nodes x two ranks that trained ``steps`` steps to the same parameters, with falling val loss."""
    assert len(digests) == 4, f"expected a record from each of 4 ranks, got {len(digests)}\n{explain}"
    assert [d["global_rank"] for d in digests] == [0, 1, 2, 3]
    assert {d["world_size"] for d in digests} == {4}
    assert {d["num_nodes"] for d in digests} == {2}
    assert [d["node_rank"] for d in digests] == [0, 0, 1, 1]
    assert [d["local_rank"] for d in digests] == [0, 1, 0, 1]
    assert {d["cluster_environment"] for d in digests} == {environment}
    assert {d["global_step"] for d in digests} == {steps}
    hashes = {d["global_rank"]: d["param_sha256"] for d in digests}
    assert len(set(hashes.values())) == 1, f"parameters differ between ranks: {hashes}"
    losses = [loss for _, loss in digests[0]["val_losses"]]
    assert [step for step, _ in digests[0]["val_losses"]] == list(range(0, steps + 1, 10))
    assert losses == sorted(losses, reverse=True), (
        f"validation loss did not fall at every validation: {losses}"
    )
    assert losses[-1] < losses[0] - 1.0, f"validation loss fell too little: {losses}"

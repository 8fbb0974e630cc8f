"""Trainer ranks as separate processes, started the way torchrun or srun start them (each with its
LOCAL_RANK and the rendezvous address), so that a test can signal, kill and time each one.

``python -m tests.integration.fault_scenarios SCENARIO OUT_DIR OPTIONS_JSON`` is what every rank
runs; :func:`start` launches N of them and :func:`finish` collects their exit status, output and
wall time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.distributed.fault_harness import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class RankRun:
    rank: int
    returncode: int | None  # None: still running at the deadline (then killed)
    output: str  # stdout and stderr
    seconds: float  # from start to exit (or to the deadline)


@dataclass
class Ranks:
    procs: list[subprocess.Popen]
    logs: list[Path]
    started: float

    def output(self, rank: int) -> str:
        return self.logs[rank].read_text() if self.logs[rank].exists() else ""

    def wait_for_text(self, rank: int, text: str, *, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.output(rank):
                return True
            if all(p.poll() is not None for p in self.procs):
                return False
            time.sleep(0.05)
        return False


def start(scenario: str, world_size: int, out: Path, **options) -> Ranks:
    """Start ``world_size`` ranks of ``scenario`` (tests/integration/fault_scenarios.py)."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "NODE_RANK": "0"}
    env.update(WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for name in [n for n in env if n.startswith("SLURM_")]:
        del env[name]  # not a SLURM job, whatever the shell running the tests is
    procs, logs = [], []
    for rank in range(world_size):
        log = out / f"rank{rank}.log"
        cmd = [
            sys.executable,
            "-m",
            "tests.integration.fault_scenarios",
            scenario,
            str(out),
            json.dumps(options),
        ]
        with open(log, "w") as f:
            procs.append(
                subprocess.Popen(
                    cmd,
                    env={**env, "LOCAL_RANK": str(rank)},
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    cwd=REPO_ROOT,
                )
            )
        logs.append(log)
    return Ranks(procs, logs, time.monotonic())


def finish(ranks: Ranks, *, timeout: float) -> list[RankRun]:
    """Wait for every rank (killing those still running after ``timeout`` seconds from the start)."""
    deadline = ranks.started + timeout
    ended: dict[int, float] = {}
    while len(ended) < len(ranks.procs) and time.monotonic() < deadline:
        for rank, proc in enumerate(ranks.procs):
            if rank not in ended and proc.poll() is not None:
                ended[rank] = time.monotonic() - ranks.started
        time.sleep(0.05)
    runs = []
    for rank, proc in enumerate(ranks.procs):
        code = proc.returncode if rank in ended else None
        if code is None:
            proc.kill()
            proc.wait()
        runs.append(RankRun(rank, code, ranks.output(rank), ended.get(rank, timeout)))
    return runs


def exit_times(ranks: Ranks, *, timeout: float = 300) -> list[float]:
    """Seconds from start until each rank exited (polled; for measurements); killed at ``timeout``."""
    ended: dict[int, float] = {}
    deadline = ranks.started + timeout
    while len(ended) < len(ranks.procs) and time.monotonic() < deadline:
        for rank, proc in enumerate(ranks.procs):
            if rank not in ended and proc.poll() is not None:
                ended[rank] = time.monotonic() - ranks.started
        time.sleep(0.02)
    for rank, proc in enumerate(ranks.procs):
        if rank not in ended:
            proc.kill()
            proc.wait()
            ended[rank] = timeout
    return [ended[r] for r in range(len(ranks.procs))]

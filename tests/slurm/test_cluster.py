"""The emulated cluster itself: srun places tasks on both nodes, and stop.sh leaves nothing of its cluster running."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tests.slurm.runs import SlurmCluster, run, start_cluster

pytestmark = pytest.mark.slurm

PRINT_PLACE = (
    "import json, os; print(json.dumps({k: os.environ[k] for k in "
    "('SLURM_PROCID', 'SLURM_LOCALID', 'SLURM_NODEID', 'SLURMD_NODENAME', 'SLURM_NODELIST', 'SLURM_NTASKS')}))"
)


def test_srun_places_two_tasks_on_each_of_two_nodes(slurm_cluster: SlurmCluster):
    result = run(
        ["srun", "--nodes=2", "--ntasks-per-node=2", sys.executable, "-c", PRINT_PLACE],
        timeout=60,
        env=slurm_cluster.env,
    )
    assert result.returncode == 0, result.stderr
    places = sorted(
        (json.loads(line) for line in result.stdout.splitlines()), key=lambda p: int(p["SLURM_PROCID"])
    )
    assert [p["SLURM_PROCID"] for p in places] == ["0", "1", "2", "3"]
    assert [p["SLURM_NODEID"] for p in places] == ["0", "0", "1", "1"]
    assert [p["SLURM_LOCALID"] for p in places] == ["0", "1", "0", "1"]
    assert [p["SLURMD_NODENAME"] for p in places] == ["n1", "n1", "n2", "n2"]
    assert {p["SLURM_NODELIST"] for p in places} == {"n[1-2]"}
    assert {p["SLURM_NTASKS"] for p in places} == {"4"}


def cluster_processes(cluster_dir: Path) -> dict[int, str]:
    """pid -> name of the cluster's processes, found as stop.sh finds them, and their descendants."""
    daemon = f"LZ_SLURM_CLUSTER={cluster_dir}".encode()
    step_daemon = f"SLURM_CONF={cluster_dir}/etc/slurm.conf".encode()
    names, parents, ours = {}, {}, set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            environ = (stat.parent / "environ").read_bytes().split(b"\0")
        except OSError:
            continue  # gone, or not ours to read
        pid = int(stat.parent.name)
        names[pid] = text[text.index("(") + 1 : text.rindex(")")]
        parents[pid] = int(text[text.rindex(")") + 2 :].split()[1])
        if daemon in environ or (names[pid] == "slurmstepd" and step_daemon in environ):
            ours.add(pid)
    while grown := {pid for pid, ppid in parents.items() if ppid in ours and pid not in ours}:
        ours |= grown
    return {pid: names[pid] for pid in ours}


def test_stop_ends_daemons_and_running_jobs(slurm_cluster: SlurmCluster, tmp_path: Path):
    """A second cluster, with a job running, is torn down to the last process; the first keeps running."""
    second = start_cluster()
    try:
        assert second.dir != slurm_cluster.dir
        assert conf_values(second.conf, "SlurmctldPort") != conf_values(slurm_cluster.conf, "SlurmctldPort")
        submitted = run(
            ["sbatch", "--parsable", "-N2", "--ntasks-per-node=2", f"--output={tmp_path / 'sleep.out'}",
             "--wrap", "srun sleep 600"],
            timeout=30, env=second.env,
        )  # fmt: skip
        assert submitted.returncode == 0, submitted.stderr
        deadline = time.monotonic() + 60
        while (names := sorted(cluster_processes(second.dir).values())).count("sleep") < 4:
            assert time.monotonic() < deadline, f"the job's 4 tasks did not start: {names}"
            time.sleep(0.5)
        assert names.count("slurmd") == 2 and "slurmctld" in names and "slurmstepd" in names, names
        assert names.count("munged") == 1, names  # the cluster's own
        pid_files = {p.name: p.read_text().strip() for p in (second.dir / "run").glob("*.pid")}
    finally:
        second.stop()
    assert cluster_processes(second.dir) == {}
    for name, pid in pid_files.items():
        assert not Path(f"/proc/{pid}").exists(), f"{name} still alive"
    assert not second.dir.exists()
    # the session's cluster did not notice
    assert sorted(cluster_processes(slurm_cluster.dir).values()).count("slurmd") == 2
    test_srun_places_two_tasks_on_each_of_two_nodes(slurm_cluster)


def conf_values(conf: Path, key: str) -> list[str]:
    return [line.split("=", 1)[1] for line in conf.read_text().splitlines() if line.startswith(f"{key}=")]

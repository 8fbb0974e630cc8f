"""A real two-node SLURM cluster on this host for the tests in this folder.

The session-scoped ``slurm_cluster`` fixture installs SLURM and MUNGE from Debian's packages when
they are missing (.ci/slurm/install.sh), starts munged, slurmctld and two slurmd daemons (nodes
n1 and n2, 2 CPUs each: .ci/slurm/start.sh) and tears everything down at the end
(.ci/slurm/stop.sh), also when a test fails. It skips only where nothing can be installed (no
apt-get, or not root).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest

from tests.slurm.runs import CI_SLURM, CLUSTER_DIR, ReferenceRuns, SlurmCluster, run


def _script(name: str, *, timeout: float) -> subprocess.CompletedProcess:
    return run(
        ["bash", str(CI_SLURM / name)], timeout=timeout, env={**os.environ, "LZ_SLURM_DIR": str(CLUSTER_DIR)}
    )


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    installed = _script("install.sh", timeout=900)
    if installed.returncode == 3:
        pytest.skip(f"SLURM cannot be installed here: {installed.stderr.strip()}")
    assert installed.returncode == 0, f".ci/slurm/install.sh failed:\n{installed.stdout}\n{installed.stderr}"
    try:
        started = _script("start.sh", timeout=180)
        if started.returncode == 3:
            pytest.skip(f"the SLURM cluster cannot be started here: {started.stderr.strip()}")
        assert started.returncode == 0, f".ci/slurm/start.sh failed:\n{started.stderr}"
        yield SlurmCluster()
    finally:
        stopped = _script("stop.sh", timeout=180)
        assert stopped.returncode == 0, f".ci/slurm/stop.sh failed:\n{stopped.stderr}"


@pytest.fixture(scope="session")
def reference_runs(slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> ReferenceRuns:
    return ReferenceRuns(slurm_cluster, tmp_path_factory.mktemp("reference"))

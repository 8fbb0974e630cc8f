"""A real two-node SLURM cluster on this host for the tests in this folder, when asked for.

The cluster tests change the machine (they start daemons as root, and may install packages), so
they run only on request, through the environment variable ``LZ_SLURM``:

- unset (the default, ``make test``): every test that needs the cluster is skipped; nothing is
  installed or started.
- ``LZ_SLURM=1``: the session-scoped ``slurm_cluster`` fixture starts a cluster of its own
  (.ci/slurm/start.sh: its own munged, slurmctld and two slurmd daemons, nodes n1 and n2 with 2 CPUs
  each) in a new folder on free ports, and at the end stops exactly that cluster and removes the
  folder (.ci/slurm/stop.sh), also when a test fails. Needs root and SLURM installed.
- ``LZ_SLURM=install``: the same, after installing slurm-wlm and munge from Debian's packages when
  they are missing (.ci/slurm/install.sh, apt-get as root). This is what CI runs (.ci/run).

Once asked for, the cluster is not optional: a missing package or a start that fails is an error,
never a skip, so that CI cannot pass without running the cluster tests.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.slurm.runs import CI_SLURM, ReferenceRuns, SlurmCluster, missing_slurm_tools, run, start_cluster

SLURM_MODE = os.environ.get("LZ_SLURM", "")  # "", "1" or "install"
OPT_IN = (
    "needs a SLURM cluster on this host, which the suite starts only when asked: LZ_SLURM=1 make test "
    "(root, slurm-wlm and munge installed) or LZ_SLURM=install make test (also installs them with "
    "apt-get); see docs/testing.md"
)


def _install_slurm() -> None:
    installed = run(["bash", str(CI_SLURM / "install.sh")], timeout=900, env=dict(os.environ))
    assert installed.returncode == 0, f".ci/slurm/install.sh failed:\n{installed.stdout}\n{installed.stderr}"


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    if SLURM_MODE not in ("1", "install"):
        pytest.skip(f"LZ_SLURM={SLURM_MODE!r}: {OPT_IN}" if SLURM_MODE else OPT_IN)
    if SLURM_MODE == "install":
        _install_slurm()
    missing = missing_slurm_tools()
    assert not missing, (
        f"LZ_SLURM=1 asks for the SLURM cluster tests, but {', '.join(missing)} is not installed: "
        "run `sudo bash .ci/slurm/install.sh`, or use LZ_SLURM=install"
    )
    cluster = start_cluster()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def reference_runs(slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> ReferenceRuns:
    return ReferenceRuns(slurm_cluster, tmp_path_factory.mktemp("reference"))

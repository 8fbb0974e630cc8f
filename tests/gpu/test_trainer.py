"""The strategy through Lightning's Trainer on CUDA devices: parity with plain Lightning on one GPU,
where a full checkpoint's tensors live, where loading puts each rank's part, and the monitor's
timing of exposed communication over NCCL.

Runs of several tests are shared (module-scoped fixtures): each stage fits once per setting.
"""

from __future__ import annotations

import pytest

from tests.compare import max_diff
from tests.gpu.cuda import requires_gpus
from tests.gpu.runs import fit, read_metrics, tensor_devices, zero
from tests.gpu.training import STAGES

pytestmark = pytest.mark.gpu

TOL = 1e-6  # fp32, the same batches in the same order on the same device


@pytest.fixture(scope="module")
def one_gpu(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """An epoch (14 steps) of plain Lightning (``strategy="auto"``) and of each stage on ``cuda:0``;
    the stages save a full checkpoint at its end."""
    root = tmp_path_factory.mktemp("one_gpu")
    runs = {"auto": fit("auto", root / "auto")[0]}
    for stage in STAGES:
        runs[stage] = fit(zero(stage), root / f"zero{stage}", checkpoint=True)[0]
    return {"root": root, "runs": runs}


@requires_gpus(1)
@pytest.mark.parametrize("stage", STAGES)
def test_one_gpu_matches_plain_lightning(one_gpu: dict, stage: int):
    run, plain = one_gpu["runs"][stage], one_gpu["runs"]["auto"]
    assert run["at_end"]["devices"] == plain["at_end"]["devices"] == ["cuda:0"]
    assert max_diff(run["params"], plain["params"]) <= TOL


@requires_gpus(1)
@pytest.mark.parametrize("stage", STAGES)
def test_full_checkpoint_of_a_cuda_run_holds_host_tensors(one_gpu: dict, stage: int):
    devices = tensor_devices(one_gpu["root"] / f"zero{stage}" / "ckpt" / "last.ckpt")
    assert set(devices) == {"cpu"} and devices["cpu"] > 20, devices  # weights and Adam's moments


@pytest.fixture(scope="module")
def two_gpus(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Each stage on ``cuda:0`` and ``cuda:1`` over NCCL: an epoch with a ZeroMonitor that saves a
    full checkpoint, then a second run that resumes from it."""
    root = tmp_path_factory.mktemp("two_gpus")
    runs = {}
    for stage in STAGES:
        saved, resumed = root / f"zero{stage}", root / f"zero{stage}_resumed"
        runs[stage] = {
            "saved": fit(zero(stage), saved, devices=2, checkpoint=True, monitor=True),
            "metrics": read_metrics(saved),
            "resumed": fit(
                zero(stage), resumed, devices=2, max_epochs=2, ckpt_path=saved / "ckpt" / "last.ckpt"
            ),
        }
    return runs


@requires_gpus(2, nccl=True)
@pytest.mark.parametrize("stage", STAGES)
def test_loading_puts_each_ranks_part_on_its_own_gpu(two_gpus: dict, stage: int):
    resumed = two_gpus[stage]["resumed"]
    for rank, record in enumerate(resumed):
        assert record["root_device"] == f"cuda:{rank}"
        assert record["at_start"]["devices"] == [f"cuda:{rank}"], (rank, record["at_start"])
    assert resumed[1]["at_start"]["cuda0_peak_bytes"] == 0  # rank 1 never allocated on cuda:0


@requires_gpus(2, nccl=True)
@pytest.mark.parametrize("stage", STAGES)
def test_monitor_times_exposed_communication_with_cuda_events(two_gpus: dict, stage: int):
    rows = two_gpus[stage]["metrics"]
    assert len(rows) == 7  # 14 batches of 2 over 2 ranks
    assert all(row["zero/exposed_comm_cuda_events"] == 1.0 for row in rows)
    assert sum(row["zero/exposed_comm_s"] for row in rows) > 0  # the streams stalled behind NCCL
    assert [record["monitor_timing"] for record in two_gpus[stage]["saved"]] == ["cuda-events"] * 2

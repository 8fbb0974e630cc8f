"""Every stage through its engine on CUDA devices against one device's plain training: two GPUs
over NCCL, and two ranks sharing one GPU over gloo (where gloo runs the stage's collectives on CUDA
tensors). Parameters after K steps, where the tensors live, and how the waits were timed.
"""

from __future__ import annotations

import pytest
import torch

from tests.compare import max_diff
from tests.gpu.cuda import requires_gpus
from tests.gpu.harness import run_on
from tests.gpu.training import STAGE_OPS, STAGES, probe_ops, reference, train_stages

pytestmark = pytest.mark.gpu

# fp32; each rank computes its half of the global batch and the reduction adds the halves, in
# another order than one device's kernels over the whole batch (on CPU: 4e-7 apart after 4 steps)
TOL = 2e-6


@pytest.fixture(scope="module")
def one_device() -> dict[str, torch.Tensor]:
    return reference(2, torch.device("cuda", 0))


@pytest.fixture(scope="module")
def nccl(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_on(train_stages, ["cuda:0", "cuda:1"], "nccl", tmp_path_factory.mktemp("nccl"), STAGES)


@requires_gpus(2, nccl=True)
@pytest.mark.parametrize("stage", STAGES)
def test_two_gpus_over_nccl_match_one_device(nccl: list[dict], one_device: dict, stage: int):
    for rank, ranks in enumerate(nccl):
        run = ranks[stage]
        assert run["devices"] == [f"cuda:{rank}"]
        assert max_diff(run["params"], one_device) <= TOL, (rank, max_diff(run["params"], one_device))
        assert run["timing"] == "cuda-events" and run["exposed_s"] > 0  # the stream stalled behind NCCL


@pytest.fixture(scope="module")
def gloo_ops(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str | None]:
    """op -> None where gloo ran it on CUDA tensors with the right result, else what went wrong."""
    ranks = run_on(probe_ops, ["cuda:0", "cuda:0"], "gloo", tmp_path_factory.mktemp("probe"))
    return {op: next((r[op] for r in ranks if r[op] is not None), None) for op in ranks[0]}


def unsupported(gloo_ops: dict[str, str | None], stage: int) -> list[str]:
    return [op for op in STAGE_OPS[stage] if gloo_ops[op] is not None]


@pytest.fixture(scope="module")
def gloo(tmp_path_factory: pytest.TempPathFactory, gloo_ops: dict) -> list[dict]:
    stages = tuple(s for s in STAGES if not unsupported(gloo_ops, s))
    if not stages:
        return []
    return run_on(train_stages, ["cuda:0", "cuda:0"], "gloo", tmp_path_factory.mktemp("gloo"), stages)


@requires_gpus(1)
@pytest.mark.parametrize("stage", STAGES)
def test_two_ranks_sharing_one_gpu_over_gloo_match_one_device(
    gloo_ops: dict, gloo: list[dict], one_device: dict, stage: int
):
    missing = unsupported(gloo_ops, stage)
    if missing:
        why = "; ".join(f"{op}: {gloo_ops[op]}" for op in missing)
        pytest.skip(
            f"gloo cannot run {', '.join(missing)} on CUDA tensors (torch {torch.__version__}): {why}"
        )
    for ranks in gloo:
        run = ranks[stage]
        assert run["devices"] == ["cuda:0"]
        assert max_diff(run["params"], one_device) <= TOL
        assert run["timing"] == "cuda-events"  # CUDA tensors: timed on the stream, whatever the backend

"""Every stage on several ranks sets up under the 4 MiB mmap threshold; once the model is wrapped,
stages 0-1, and stages 2-3 whose every unit and bucket is smaller than the threshold, train on the
setting of the stages that free nothing, and stages 2-3 with a larger block keep the 4 MiB threshold
(lightning_zero/allocator.py)."""

from __future__ import annotations

import functools

import pytest
import torch

from lightning_zero.allocator import MMAP_THRESHOLD, STEADY_MMAP_THRESHOLD, cpu_allocator_state, glibc_version
from tests.bigmodel.lit import BigModule, Shape, quiet_trainer, zero_strategy
from tests.matrix.runner import run_jobs

SMALL = Shape(width=256, blocks=2, tokens=4, micro_batches=1)  # a block: 8 x 256^2 x 4 B = 2 MiB
LARGE = Shape(width=384, blocks=2, tokens=4, micro_batches=1)  # 4.5 MiB


class _Recorded(BigModule):
    """The allocator's setting where the model is built (in ``configure_model``, before the wrap)."""

    def configure_model(self) -> None:
        self.building = cpu_allocator_state().frees
        super().configure_model()


def mmap_threshold_after_fit(
    stage: int, shape: Shape, options: dict, root: str
) -> tuple[bool, int | None, bool]:
    torch.set_num_threads(1)
    module = _Recorded(shape)
    quiet_trainer(zero_strategy(stage, **options), root).fit(module)
    state = cpu_allocator_state()
    return module.building, state.applied.get("M_MMAP_THRESHOLD"), state.frees


@pytest.mark.skipif(glibc_version() is None, reason="the setting is glibc's")
def test_a_stage_that_frees_only_small_blocks_keeps_them_in_the_heap(tmp_path, monkeypatch):
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    runs = [
        (3, SMALL, {}),  # 2 MiB units: nothing the 4 MiB threshold would return
        (3, LARGE, {}),  # 4.5 MiB units
        (2, SMALL, {"bucket_cap_mb": 1}),  # buckets of 1 MiB
        (2, LARGE, {}),  # 9 MiB in 25 MiB buckets
        (1, LARGE, {}),  # buckets kept for the whole run
        (0, LARGE, {}),
    ]
    jobs = [functools.partial(mmap_threshold_after_fit, *run) for run in runs]
    for rank in run_jobs(jobs, str(tmp_path), world=2, timeout=300):
        assert rank == [
            (True, STEADY_MMAP_THRESHOLD, False),
            (True, MMAP_THRESHOLD, True),
            (True, STEADY_MMAP_THRESHOLD, False),
            (True, MMAP_THRESHOLD, True),
            (True, STEADY_MMAP_THRESHOLD, False),
            (True, STEADY_MMAP_THRESHOLD, False),
        ], rank

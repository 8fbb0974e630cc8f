"""Each ZeRO stage's whole-run peak resident memory per rank is below the previous stage's, by at
least half of what the formulas say it saves, with default settings (no option given, no malloc
variable in the environment), as a user measures it.

A stack of 16 MLP blocks of width 512 (tests/bigmodel/lit.py, Ψ = 33.6M parameters) built in
``configure_model``, AdamW in fp32, 2 ranks, 2 steps. Model state per rank: 16Ψ, 8Ψ + 8Ψ/N,
4Ψ + 12Ψ/N, 16Ψ/N (513, 385, 321 and 256 MiB at N = 2), against activations of 8 rows per step
and units of 8 MiB, so model state is most of what a rank adds to its start. Each stage runs in
two fresh processes; its figure is the largest rank's peak above the resident size before the
Trainer was built (setup, steps and teardown). What is compared is machine-independent: for each
stage, (previous stage's peak - this peak) / (previous stage's formula - this formula), the share
of the theoretical saving that shows, never absolute bytes or times.
"""

from __future__ import annotations

import functools
import gc
import os

import pytest
import torch
from lightning.pytorch import Trainer

from lightning_zero import ZeroStrategy
from lightning_zero.allocator import cpu_allocator_state
from tests.bigmodel.lit import BigModule, Shape, peak_rss_mb, psi, reset_peak, rss_mb
from tests.matrix.runner import run_jobs

SHAPE = Shape(width=512, blocks=16, tokens=8, micro_batches=2)  # 33.6M parameters, 2 steps
BLOCK = "tests.bigmodel.lit.Block"
BYTES_PER_PARAM = {0: 16.0, 1: 8 + 8 / 2, 2: 4 + 12 / 2, 3: 16 / 2}  # fp32 AdamW, N = 2
MIN_SHARE = 0.5  # of each stage's theoretical saving over the previous stage that must show


def whole_run_peak(stage: int, root: str) -> tuple[float, bool]:
    """MiB this rank's resident size rose above its start at most, over one fit at ``stage``; and
    whether the CPU allocator setting was applied in this process."""
    torch.set_num_threads(1)
    gc.collect()
    start = rss_mb()
    reset_peak()
    options = {"wrap_policy": BLOCK} if stage == 3 else {}
    trainer = Trainer(
        strategy=ZeroStrategy(stage=stage, **options),
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    trainer.fit(BigModule(SHAPE))
    return peak_rss_mb() - start, cpu_allocator_state() is not None


def stage_peaks(folder: str) -> tuple[dict[int, float], bool]:
    """Per stage, the largest rank's whole-run peak (each stage in two fresh processes), and
    whether every rank had the allocator setting applied."""
    peaks, tuned = {}, True
    for stage in (0, 1, 2, 3):
        jobs = [functools.partial(whole_run_peak, stage)]
        ranks = run_jobs(jobs, os.path.join(folder, f"zero{stage}"), world=2, timeout=600)
        peaks[stage] = max(r[0][0] for r in ranks)
        tuned = tuned and all(r[0][1] for r in ranks)
    return peaks, tuned


@pytest.mark.slow  # about a minute, and expected to fail until the stage-1/2 backward transients are gone
@pytest.mark.xfail(
    strict=True,
    reason=(
        "measured on 2 CPU ranks, peak MiB above start for zero0..zero3 on this model: with glibc's "
        "defaults 560, 633, 583, 514 (zero1 and zero2 above zero0); with the package's setting (a 4 MiB "
        "threshold) 545, 538, 470, 331 (64 KiB: 544, 536, 448, 331): zero1 shows 5% of its "
        "theoretical 128 MiB saving over zero0, because its steady-state backward holds a full-size "
        "(4Ψ, +120 MiB) transient above its between-steps state that zero0's does not (+7 MiB); "
        "zero2's backward holds +152 MiB (fp32 shard gradient 64, two 25 MiB reduce buffers, "
        "and ~40 MiB more)"
    ),
)
def test_each_stage_saves_what_the_formulas_say_over_the_previous(tmp_path, monkeypatch):
    for name in [n for n in os.environ if n.startswith("MALLOC_") or n == "GLIBC_TUNABLES"]:
        monkeypatch.delenv(name)  # the environment a user has: the ranks inherit this one
    peaks, tuned = stage_peaks(str(tmp_path))
    trainable, _ = psi(SHAPE)
    formula = {stage: b * trainable / 2**20 for stage, b in BYTES_PER_PARAM.items()}
    shares = {k: (peaks[k - 1] - peaks[k]) / (formula[k - 1] - formula[k]) for k in (1, 2, 3)}
    message = (
        f"peak MiB above start {peaks}, formulas {formula}, share of each stage's saving over the "
        f"previous that shows {shares}; allocator setting applied by the strategy: {tuned}"
    )
    assert peaks[3] < peaks[2] < peaks[1] < peaks[0], message
    assert all(share >= MIN_SHARE for share in shares.values()), message

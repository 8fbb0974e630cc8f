"""Each ZeRO stage's whole-run peak resident memory per rank is below the previous stage's, by at
least half of what the formulas say it saves, with default settings (no option given, no malloc
variable in the environment), as a user measures it.

A stack of 24 MLP blocks of width 576 (tests/bigmodel/lit.py, Ψ = 63.8M parameters) built in
``configure_model``, AdamW in fp32, 2 ranks, 2 steps. Model state per rank: 16Ψ, 8Ψ + 8Ψ/N,
4Ψ + 12Ψ/N, 16Ψ/N (973, 730, 608 and 487 MiB at N = 2), against activations of 8 rows per step,
units of 10 MiB and the default 25 MiB gradient buckets, so model state is most of what a rank
adds to its start. The stages run one after another in one pair of processes, after a small
warm-up fit (imports, the process group, the allocator setting, which the strategy applies once
per process); before each, what earlier fits freed is handed back to the system
(``malloc_trim``), and the smallest stage runs first, so that whatever of an earlier fit stays
resident can only lower a larger stage's figure, never fake a saving. A stage's figure is the
largest rank's peak above the resident size before its Trainer was built (setup, steps and
teardown). What is compared is machine-independent: for each stage, (previous stage's peak - this
peak) / (previous stage's formula - this formula), the share of the theoretical saving that shows,
never absolute bytes or times.
"""

from __future__ import annotations

import functools
import gc
import os

import torch

from lightning_zero.allocator import cpu_allocator_state
from tests.bigmodel.lit import (
    BigModule,
    Shape,
    peak_rss_mb,
    psi,
    quiet_trainer,
    release_free_heap,
    reset_peak,
    rss_mb,
    zero_strategy,
)
from tests.matrix.runner import run_jobs

SHAPE = Shape(width=576, blocks=24, tokens=8, micro_batches=2)  # 63.8M parameters, 2 steps
WARM_UP = Shape(width=32, blocks=2, tokens=8, micro_batches=2)  # the first fit of the processes
STAGES = (3, 2, 1, 0)  # smallest model state first
BYTES_PER_PARAM = {0: 16.0, 1: 8 + 8 / 2, 2: 4 + 12 / 2, 3: 16 / 2}  # fp32 AdamW, N = 2
MIN_SHARE = 0.5  # of each stage's theoretical saving over the previous stage that must show


def whole_run_peak(stage: int, shape: Shape, root: str) -> tuple[float, bool]:
    """MiB this rank's resident size rose above its start at most, over one fit at ``stage``; and
    whether the CPU allocator setting was applied in this process."""
    torch.set_num_threads(1)
    gc.collect()
    release_free_heap()  # what earlier fits freed is not this one's to reuse
    start = rss_mb()
    reset_peak()
    trainer = quiet_trainer(zero_strategy(stage), root)
    trainer.fit(BigModule(shape))
    return peak_rss_mb() - start, cpu_allocator_state() is not None


def stage_peaks(folder: str) -> tuple[dict[int, float], bool]:
    """Per stage, the largest rank's whole-run peak, and whether every rank had the allocator
    setting applied."""
    jobs = [functools.partial(whole_run_peak, 3, WARM_UP)]
    jobs += [functools.partial(whole_run_peak, stage, SHAPE) for stage in STAGES]
    ranks = run_jobs(jobs, folder, world=2, timeout=600)
    peaks = {stage: max(r[1 + i][0] for r in ranks) for i, stage in enumerate(STAGES)}
    tuned = all(result[1] for r in ranks for result in r[1:])
    return peaks, tuned


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

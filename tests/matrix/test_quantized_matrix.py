"""Stage 3 with int8 weights and gradients on the wire (stages 1-2: int8 gradients), through
Lightning's Trainer, where it meets
the ways people train: each precision, accumulation, activation checkpointing (both kinds), manual
optimization with two backward passes, clipping, a frozen layer, AdamW and a checkpoint saved
after fit.

Quantized training is not the reference's arithmetic, so it is compared with bounds: both ranks
end with the same parameters exactly (every rank computes with the same dequantized weights and
steps the same reduced gradients), the parameters stay within a few percent of the same fit in
full precision at stage 3 (relative to each parameter's norm), and the losses within 1%.
"""

from __future__ import annotations

import pytest

from tests.matrix.lit import Case
from tests.matrix.runner import Run, run_all

CASES = (
    Case(),
    Case(precision="bf16-mixed", accumulate=3, checkpointing="reentrant"),
    Case(precision="bf16-true", checkpointing="nonreentrant", manual=True),
    Case(accumulate=3, manual=True, clip=0.05),
    Case(frozen=True, precision="bf16-mixed", clip=0.05),
    Case(optimizer="adamw", accumulate=3, checkpointing="nonreentrant"),
)
SAVED = CASES[-1]  # also saves a full checkpoint after fit
STAGES_1_2 = Case(precision="bf16-mixed", accumulate=3, clip=0.05, optimizer="adamw")


def _relative(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-3)).item() for k in b)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_quantized_fit_follows_full_precision(tmp_path, case):
    _follows_full_precision(tmp_path, case, 3)


@pytest.mark.parametrize("stage", [1, 2])
def test_stages_1_and_2_with_int8_gradients_follow_full_precision(tmp_path, stage):
    _follows_full_precision(tmp_path, STAGES_1_2, stage)


def _follows_full_precision(tmp_path, case: Case, stage: int) -> None:
    runs = [Run(case._replace(quantize=q), stage, save_after_fit=case == SAVED) for q in (True, False)]
    (quantized, full), (quantized1, full1) = run_all(runs, str(tmp_path), world=2, timeout=180)
    for result in (quantized, full, quantized1, full1):
        assert result.error is None, result.error
    assert all((quantized.params[k] == quantized1.params[k]).all() for k in quantized.params)
    # measured: 1.1-2.2% (fp32, bf16-mixed), 3.0% (bf16-true, whose own rounding adds to it)
    assert _relative(quantized.params, full.params) <= (0.05 if case.precision == "bf16-true" else 0.03)
    for q_loss, f_loss in zip(quantized.losses, full.losses):
        assert abs(q_loss - f_loss) <= 0.01 * abs(f_loss)
    assert quantized.dtypes == full.dtypes
    if case == SAVED:  # the checkpoint holds the full-precision optimizer state of the shards
        assert (
            quantized.optimizer is not None
            and quantized.optimizer["state"].keys() == full.optimizer["state"].keys()
        )

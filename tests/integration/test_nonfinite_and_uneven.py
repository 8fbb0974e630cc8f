"""A NaN on one rank and ranks with different numbers of batches: one decision for every rank.

Without the guard, a NaN loss on one rank reaches every rank's weights through the reduction and
the fit ends with status 0; ranks with a different number of batches pair their collectives
wrongly (a hang, or gradients of different steps averaged).
"""

from __future__ import annotations

import re

from tests.integration.ranks import finish, start

NAN_ON_RANK_1_AT_STEP_3 = {"nan_on": 1, "nan_at": 3}


def _params_by_step(output: str) -> dict[int, str]:
    return {int(s): h for s, h in re.findall(r"rank 0 step (\d+) params (\w+)", output)}


def test_skip_leaves_weights_and_optimizer_state_untouched_and_counts_the_step(tmp_path):
    options = dict(
        strategy={"stage": 2, "nonfinite_grads": "skip"}, model=NAN_ON_RANK_1_AT_STEP_3, max_steps=6
    )
    runs = finish(start("nan-skip", 2, tmp_path, print_params=True, **options), timeout=150)
    for run in runs:
        assert run.returncode == 0, run.output[-3000:]
        assert f"rank {run.rank} finished at step 6, 1 step(s) skipped" in run.output
    params = _params_by_step(runs[0].output)
    assert params[4] == params[3]  # the step that went from 3 to 4 was skipped: the weights as they were
    assert len(set(params.values())) == 5  # every other step changed them
    assert (
        "step 3: non-finite loss on rank(s) 1; non-finite gradients on rank(s) 0, 1: step skipped"
        in runs[0].output
    )


def test_stop_raises_on_every_rank_naming_the_rank_and_the_step(tmp_path):
    options = dict(
        strategy={"stage": 3, "nonfinite_grads": "stop"}, model=NAN_ON_RANK_1_AT_STEP_3, max_steps=6
    )
    runs = finish(start("nan-stop", 2, tmp_path, **options), timeout=150)
    for run in runs:
        assert run.returncode == 1, run.output[-3000:]
        assert (
            "NonFiniteGradientError: step 3: non-finite loss on rank(s) 1; non-finite gradients on rank(s) 0, 1"
            in run.output
        )
    assert abs(runs[0].seconds - runs[1].seconds) < 8


def test_ranks_with_different_numbers_of_batches_end_with_a_clear_error(tmp_path):
    # a sampler of the user's own: rank 0 has 8 batches, rank 1 has 6
    options = dict(samples={"0": 64, "1": 48}, distributed_sampler=False, max_steps=20)
    runs = finish(start("uneven", 2, tmp_path, **options), timeout=150)
    for run in runs:
        assert run.returncode == 1, run.output[-3000:]
        assert (
            "UnevenBatchesError: the ranks have different numbers of training batches in epoch 0: rank(s) 1 reach "
            "their last batch at batch 5 (step 5), rank(s) 0 have more" in run.output
        ), run.output[-3000:]

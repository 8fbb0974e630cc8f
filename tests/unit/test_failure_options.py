"""The failure-handling options: checked where they enter, and what the monitor reads of them."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest

from lightning_zero import ZeroConfig, ZeroStrategy
from lightning_zero.callbacks import loss_scale_metrics
from lightning_zero.guard import describe
from lightning_zero.signals import LAST_BATCH, SIGNAL_BITS, UnevenBatchesError, check_even, describe_signals


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"nonfinite_grads": "ignore"},
            ValueError,
            r"nonfinite_grads must be one of \['off', 'skip', 'stop'\], got 'ignore'",
        ),
        ({"nonfinite_grads": False}, ValueError, "nonfinite_grads must be one of"),  # YAML's unquoted off
        ({"watchdog_s": 0}, ValueError, "watchdog_s must be > 0 seconds, got 0"),
        ({"watchdog_s": "1"}, TypeError, "watchdog_s must be a number of seconds, got '1'"),
        ({"fault_wait_s": -1.0}, ValueError, "fault_wait_s must be > 0 seconds"),
        ({"handle_signals": "yes"}, TypeError, "handle_signals must be true or false"),
        ({"verify_checkpoints": 1}, TypeError, "verify_checkpoints must be true or false"),
        ({"keep_previous_checkpoint": None}, TypeError, "keep_previous_checkpoint must be true or false"),
        ({"ledger_records": 0}, ValueError, "ledger_records must be >= 1, got 0"),
    ],
)
def test_bad_values_are_refused_naming_the_option(kwargs, error, match):
    with pytest.raises(error, match=match):
        ZeroConfig(**kwargs)
    with pytest.raises(error, match=match):
        ZeroStrategy(**kwargs)


def test_defaults():
    cfg = ZeroConfig()
    assert (cfg.handle_signals, cfg.nonfinite_grads, cfg.watchdog_s, cfg.fault_wait_s) == (
        True,
        "off",
        60.0,
        3.0,
    )
    assert (cfg.keep_previous_checkpoint, cfg.verify_checkpoints, cfg.ledger_records) == (True, True, 4096)
    assert ZeroStrategy(stage=1, ledger_records=7).ledger.records.maxlen == 7


def test_the_monitor_logs_the_guards_skipped_steps():
    trainer = SimpleNamespace(
        precision_plugin=SimpleNamespace(), strategy=SimpleNamespace(nonfinite_guard=None)
    )
    assert loss_scale_metrics(trainer) == {}
    trainer.strategy.nonfinite_guard = SimpleNamespace(skipped_steps=3)
    assert loss_scale_metrics(trainer) == {"zero/skipped_steps": 3.0}


def test_messages_name_ranks_and_step():
    assert (
        describe([0, 1 | 2, 2], 12)
        == "step 12: non-finite loss on rank(s) 1; non-finite gradients on rank(s) 1, 2"
    )
    term, usr1 = SIGNAL_BITS[signal.SIGTERM], SIGNAL_BITS[signal.SIGUSR1]
    assert describe_signals({0: ["SIGTERM"], 3: ["SIGTERM", "SIGUSR1"]}) == (
        "SIGTERM received by rank(s) 0, 3; SIGUSR1 received by rank(s) 3"
    )
    trainer = SimpleNamespace(current_epoch=2, global_step=40)
    check_even([LAST_BATCH, LAST_BATCH | term], trainer, 7)  # all at their last batch: fine
    check_even([0, usr1], trainer, 7)  # none: fine
    with pytest.raises(
        UnevenBatchesError,
        match=r"epoch 2: rank\(s\) 1 reach their last batch at batch 7 \(step 40\), rank\(s\) 0 have more",
    ):
        check_even([0, LAST_BATCH], trainer, 7)
